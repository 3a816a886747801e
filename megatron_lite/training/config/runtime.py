"""How the run starts and draws: the launch (DistributedInitConfig), the seeds (RNGConfig) and the
rerun state machine (RerunStateMachineConfig), as Megatron-Bridge names them."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True)
class DistributedInitConfig:
    """Process launch and backend."""

    nproc_per_node: int | None = None
    """Workers pretrain.py starts on this machine (megatron_lite's launcher); None means the
    torchrun world when launched by torchrun, else tp x pp x cp."""
    distributed_backend: str | None = None
    """nccl or gloo; None picks nccl with GPUs, gloo without (upstream's default is nccl)."""
    distributed_timeout_minutes: int = 10
    """Timeout of collectives."""
    align_grad_reduce: bool = True
    """Start gradient reductions of all pipeline stages together."""
    local_rank: int = field(default_factory=lambda: int(os.getenv("LOCAL_RANK", "0")))
    """This process's rank on its node."""
    lazy_mpu_init: bool = False
    """Defer model-parallel initialisation (implies CPU initialisation of the model)."""
    use_gloo_process_groups: bool = True
    """Also build gloo copies of the data-parallel groups."""
    use_megatron_fsdp: bool = False
    """Megatron FSDP (not supported: False)."""
    use_torch_fsdp2: bool = False
    """PyTorch FSDP2 (not supported: False)."""
    use_tp_pp_dp_mapping: bool = False
    """Rank order tp-pp-dp instead of tp-cp-ep-dp-pp (not supported yet: False)."""
    use_decentralized_pg: bool = False
    """Pass process groups explicitly instead of through parallel_state (not supported yet: False)."""
    eval_context_parallel_size: int | None = None
    """A different context-parallel size for validation (not supported yet: None)."""

    @property
    def lazy_init(self) -> bool:
        return self.lazy_mpu_init

    @lazy_init.setter
    def lazy_init(self, value: bool) -> None:
        self.lazy_mpu_init = value


@dataclass(kw_only=True)
class RNGConfig:
    """Random seeds."""

    seed: int = 1234
    """Seed for initialisation, dropout and data."""
    te_rng_tracker: bool = False
    """Transformer Engine's RNG tracker (not supported: False)."""
    inference_rng_tracker: bool = False
    """A separate RNG tracker for inference (not supported: False)."""
    data_parallel_random_init: bool = False
    """Different initial weights per data-parallel rank (not supported: False)."""


@dataclass(kw_only=True)
class RerunStateMachineConfig:
    """Result validation by re-running iterations; megatron_lite only checks the loss for NaN."""

    error_injection_rate: int = 0
    """Inject an error every this many iterations (not supported: 0)."""
    error_injection_type: Literal["correct_result", "transient_error", "persistent_error"] = "transient_error"
    """Kind of error injected."""
    rerun_mode: Literal["disabled", "validate_results", "report_determinism_stats"] = "disabled"
    """Re-run engine mode (only disabled is supported)."""
    check_for_nan_in_loss: bool = True
    """Skip the optimizer step of an iteration whose loss is NaN or infinite."""
    check_for_spiky_loss: bool = False
    """Detect spiky losses (not supported: False)."""
    spiky_loss_factor: float = 10.0
    """A loss above this multiple of the window's maximum is spiky."""
