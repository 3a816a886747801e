"""Every check of a whole configuration, in the one order ConfigContainer.validate runs them (after
each section's own ``finalize``), for the command line and the
Python API alike. Each raises ConfigError naming the flag and the fix. (The sizes validate divides by
are range-checked before anything, the other ranges here, after upstream's own checks.)

``general``: features not built yet, values that must agree, the loggers; ``data``: the data and
tokenizer files; ``moe``: the mixture-of-experts options; ``peft``: LoRA fine-tuning; ``sft``: the
supervised fine-tuning data (checked last: it tokenizes every file); ``layout``: the parallel layout
(the expert grid included) and layer split; ``architecture``: the model's shape;
``activation_levers``: recomputation and the other activation-memory flags.
"""

from __future__ import annotations

from megatron_lite.training.cli.ranges import check_config_ranges
from megatron_lite.training.config.validate.activation_levers import check_activation_levers
from megatron_lite.training.config.validate.architecture import check_architecture
from megatron_lite.training.config.validate.data import check_data
from megatron_lite.training.config.validate.general import check_logger, check_ranges, check_supported
from megatron_lite.training.config.validate.layout import check_deferred_wgrad, check_divisibility
from megatron_lite.training.config.validate.moe import check_moe
from megatron_lite.training.config.validate.peft import check_peft
from megatron_lite.training.config.validate.sft import check_sft

CHECKS = (
    check_supported,
    check_data,
    check_config_ranges,
    check_ranges,
    check_moe,
    check_peft,
    check_divisibility,
    check_deferred_wgrad,
    check_architecture,
    check_activation_levers,
    check_sft,  # last but the loggers: it reads and tokenizes every file
    check_logger,
)


def run_checks(cfg) -> None:
    """Each of CHECKS on ``cfg``, in order; the first failure raises."""
    for check in CHECKS:
        check(cfg)
