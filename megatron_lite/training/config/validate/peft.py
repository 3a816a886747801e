"""Checks of ``config.peft`` (Megatron-Bridge's LoRA), run by validate with the other config checks on
every rank before any collective: Bridge's rule (a PEFT run needs the base model's checkpoint) and
what megatron_lite's LoRA can honour. Each failure is one ConfigError naming the flag and the fix."""

from __future__ import annotations

from megatron_lite.peft import LoRA
from megatron_lite.training.errors import ConfigError

# LoRA's fields and the flag that sets each (the Python API's users read the field too).
_FLAG = {
    "dim": "--lora-dim",
    "alpha": "--lora-alpha",
    "dropout": "--lora-dropout",
    "dropout_position": "--lora-dropout-position",
    "target_modules": "--lora-target-modules",
    "exclude_modules": "--lora-exclude-modules",
    "lora_A_init_method": "--lora-a-init-method",
    "lora_B_init_method": "--lora-b-init-method",
}

# Bridge's LoRA options megatron_lite's layers do not implement: (field, value that is supported).
_NOT_SUPPORTED = (("a2a_experimental", False), ("experts_shared_outer_loras", False))


def _validate_lora(peft: LoRA) -> None:
    """LoRA's own checks (its ``validate``), with the flag of the field each one names."""
    try:
        peft.validate()
    except ValueError as err:
        message = str(err)
        field = next((f for f in _FLAG if f in message.split(" must")[0].split()), None)
        raise ConfigError(_FLAG.get(field, "peft"), message.removeprefix("LoRA ")) from None


def check_peft(cfg) -> None:
    peft = cfg.peft
    if peft is None:
        return
    if not isinstance(peft, LoRA):
        raise ConfigError(
            "--peft",
            f"{type(peft).__name__} is not supported; megatron_lite has Megatron-Bridge's LoRA only (--peft lora)",
        )
    if cfg.checkpoint.pretrained_checkpoint is None:
        raise ConfigError(
            "--peft",
            "needs --pretrained-checkpoint: the base model whose frozen weights the adapters train on "
            "(a megatron_lite checkpoint of any format and layout, or a Hugging Face directory)",
        )
    for name, supported in _NOT_SUPPORTED:
        if getattr(peft, name, supported) != supported:
            raise ConfigError(
                f"peft.{name}", "is not supported yet by megatron_lite; leave it at its default"
            )
    if isinstance(peft.target_modules, str) or isinstance(peft.exclude_modules, str):
        raise ConfigError("--lora-target-modules", "takes a list of module names or patterns, not one string")
    _validate_lora(peft)
    m = cfg.model
    # Column-parallel layers' adapters split their rank over the (expert) tensor-parallel ranks.
    etp = (m.expert_tensor_parallel_size or m.tensor_model_parallel_size) if m.num_moe_experts else 1
    for size, flag in (
        (m.tensor_model_parallel_size, "--tensor-model-parallel-size"),
        (1 if peft.normalize_moe_lora else etp, "--expert-tensor-parallel-size"),  # normalised: rounded up
    ):
        if size and peft.dim % size:
            raise ConfigError(
                "--lora-dim",
                f"{peft.dim} must be divisible by {flag} {size} (each rank holds dim / {size} rows)",
            )
