"""ProcessGroupCollection: the process groups a module needs, passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass, fields

from megatron_lite.core import parallel_state

# Field name -> parallel_state group name.
_MPU_GROUPS = {
    "tp": "tp",
    "pp": "pp",
    "mp": "mp",
    "embd": "embd",
    "pos_embd": "pos_embd",
    "cp": "cp",
    "tp_cp": "tp_cp",
    "dp": "dp",
    "dp_cp": "dp_cp",
    "tp_dp_cp": "tp_dp_cp",
    "ep": "ep",
    "expt_tp": "expt_tp",
    "tp_ep": "tp_ep",
    "tp_ep_pp": "tp_ep_pp",
    "expt_dp": "expt_dp",
}

# Groups parallel_state never builds: the caller creates them (all-gather/reduce-scatter overlap).
_CALLER_OWNED = ("dp_cp_ag", "expt_dp_ag")


@dataclass
class ProcessGroupCollection:
    """This rank's groups. A field is None where this rank belongs to no such group (e.g. ``embd``
    on a middle pipeline stage)."""

    tp: object = None
    """Tensor-parallel group."""
    pp: object = None
    """Pipeline-parallel group: one rank per stage."""
    mp: object = None
    """Model-parallel group (tensor x pipeline)."""
    embd: object = None
    """Embedding group: first and last pipeline stage, which share the word embedding."""
    pos_embd: object = None
    """Position-embedding group: the first pipeline stage."""
    cp: object = None
    """Context-parallel group."""
    tp_cp: object = None
    """Tensor x context parallel group."""
    dp: object = None
    """Data-parallel group (without context parallelism)."""
    dp_cp: object = None
    """Data-parallel group including context-parallel ranks: where gradients are averaged."""
    tp_dp_cp: object = None
    """Tensor x data x context parallel group."""
    ep: object = None
    """Expert-model-parallel group (singletons: expert parallelism is not supported yet)."""
    expt_tp: object = None
    """Expert-tensor-parallel group (the tensor-parallel ranks)."""
    tp_ep: object = None
    """Expert tensor x expert model parallel group."""
    tp_ep_pp: object = None
    """Expert tensor x expert model x pipeline parallel group."""
    expt_dp: object = None
    """Expert data-parallel group (data x context parallel ranks of the expert grid)."""
    dp_cp_ag: object = None
    """All-gather communicator over the dp-cp ranks, for overlapping parameter gathers; never built
    by parallel_state, set by the caller."""
    expt_dp_ag: object = None
    """All-gather communicator over the expert data-parallel ranks; set by the caller."""

    @classmethod
    def use_mpu_process_groups(cls, required_pgs: list[str] | None = None) -> ProcessGroupCollection:
        """Collect the groups built by ``parallel_state.initialize_model_parallel``."""
        names = required_pgs if required_pgs is not None else [f.name for f in fields(cls)]
        names = [n for n in names if n not in _CALLER_OWNED]
        unknown = [n for n in names if n not in _MPU_GROUPS]
        if unknown:
            raise ValueError(f"unknown process groups {unknown}; known: {sorted(_MPU_GROUPS)}")
        groups = parallel_state._state().groups
        return cls(**{n: groups.get(_MPU_GROUPS[n]) for n in names})
