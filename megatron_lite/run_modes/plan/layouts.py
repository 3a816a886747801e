"""The layouts the planner searches: every way to split a job over N GPUs (tp, pp, vp, cp, ep, dp) and
the memory levers each may pull (sequence parallelism, the distributed optimizer, recompute, the fused
loss), each as a real ConfigContainer of the job with only those fields changed.

What is not searched, and why (the doc and the output say it too):
- sequence parallelism is on whenever tp > 1: it never needs more memory than SP off (norms, dropout
  and the residual stream split over tp), and Megatron runs TP with SP; SP off moves 80% of its bytes
  (four all-reduces per layer instead of its ten all-gathers and reduce-scatters) but repeats the
  norms and dropout on every TP rank;
- the distributed optimizer is on: it never needs more memory, and in our code it moves fewer bytes
  (a reduce-scatter of the fp32 gradients and an all-gather of the bf16 parameters, where plain DDP
  all-reduces the fp32 gradients);
- tp stays within a node (at most ``GPUS_PER_NODE``), as Megatron advises;
- the job's model, sequence length, global and micro batch, precision and every other field are kept.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from megatron_lite.core.transformer.pipeline_layer_split import pipeline_layer_counts
from megatron_lite.training.config import runtime_config_update

# GPUs a node holds: tensor parallelism stays inside one, and a group wider than it crosses nodes.
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Layout:
    """One candidate: the parallel sizes and the levers. ``recompute`` is None, "selective" or "full"
    (block recompute of ``recompute_layers`` of each chunk's layers)."""

    tp: int
    pp: int
    vp: int
    cp: int
    dp: int
    ep: int = 1
    sp: bool = False
    distopt: bool = True
    recompute: str | None = None
    recompute_layers: int = 0
    fused_loss: bool = False

    @property
    def grid(self) -> tuple[int, int, int, int, int]:
        """The parallel sizes alone (what the levers do not change)."""
        return self.tp, self.pp, self.vp, self.cp, self.ep

    def sizes(self) -> str:
        """'tp 4 pp 4 vp 5 cp 2 dp 1' (ep too for MoE)."""
        ep = f" ep {self.ep}" if self.ep > 1 else ""
        return f"tp {self.tp} pp {self.pp} vp {self.vp} cp {self.cp}{ep} dp {self.dp}"

    def levers(self) -> str:
        """'SP, dist-opt, no recompute, fused loss'."""
        parts = ["SP"] if self.sp else []
        parts += ["dist-opt"] if self.distopt else []
        if self.recompute == "full":
            parts.append(f"full recompute of {self.recompute_layers} layer(s) per chunk")
        else:
            parts.append("selective recompute" if self.recompute else "no recompute")
        parts.append("fused loss" if self.fused_loss else "unfused loss")
        return ", ".join(parts)

    def describe(self) -> str:
        """One short line: 'tp 4 pp 4 vp 5 cp 2 dp 1, SP, dist-opt, no recompute, fused loss'."""
        return f"{self.sizes()}, {self.levers()}"


def layout_of(config) -> Layout:
    """A validated config's own layout."""
    m = config.model
    full = m.recompute_granularity == "full"
    return Layout(
        tp=m.tensor_model_parallel_size,
        pp=m.pipeline_model_parallel_size,
        vp=m.virtual_pipeline_model_parallel_size or 1,
        cp=m.context_parallel_size,
        dp=config.data_parallel_size,
        ep=m.expert_model_parallel_size if m.num_moe_experts else 1,
        sp=bool(m.sequence_parallel),
        distopt=bool(config.optimizer.use_distributed_optimizer),
        recompute=m.recompute_granularity,
        recompute_layers=(m.recompute_num_layers or 0) if full else 0,
        fused_loss=bool(m.cross_entropy_loss_fusion),
    )


def apply_layout(base, layout: Layout, gpus: int):
    """A copy of ``base`` (a ConfigContainer not yet validated) with ``layout``'s fields, for ``gpus``
    processes, validated: a ConfigError (or upstream's AssertionError / ValueError) when refused."""
    config = copy.deepcopy(base)
    m = config.model
    m.tensor_model_parallel_size, m.pipeline_model_parallel_size = layout.tp, layout.pp
    m.virtual_pipeline_model_parallel_size = layout.vp if layout.vp > 1 else None
    m.context_parallel_size = layout.cp
    if m.num_moe_experts:
        m.expert_model_parallel_size = layout.ep
    m.sequence_parallel = layout.sp
    m.recompute_granularity = layout.recompute
    m.recompute_method = "block" if layout.recompute == "full" else None
    m.recompute_num_layers = layout.recompute_layers if layout.recompute == "full" else None
    m.cross_entropy_loss_fusion = layout.fused_loss
    config.optimizer.use_distributed_optimizer = layout.distopt
    config.ddp.use_distributed_optimizer = layout.distopt
    config.dist.nproc_per_node = gpus
    config.env_vars = {}  # a plan sets nothing in this process's environment
    runtime_config_update(config)  # a recipe's mixed-precision recipe applied, then validate()
    return config


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def parallel_grids(base, gpus: int) -> list[tuple[int, int, int, int, int]]:
    """(tp, pp, vp, cp, ep) for ``gpus``: tp a divisor of the GPUs within a node, pp and cp divisors
    of the rest, vp every chunk count that splits each rank's layers evenly (vp 1 when pp is 1), ep
    (MoE) every divisor of the experts; the validation then refuses what does not divide (heads by
    tp, the sequence by 2 cp, the global batch by the micro batch times dp, ...)."""
    m = base.model
    grids = []
    for tp in _divisors(gpus):
        if tp > GPUS_PER_NODE:
            continue
        for pp in _divisors(gpus // tp):
            if pp > m.num_layers:
                continue
            vps = (
                [1] if pp == 1 else [v for v in _divisors(m.num_layers // pp) if m.num_layers % (pp * v) == 0]
            )
            for vp in vps:
                for cp in _divisors(gpus // (tp * pp)):
                    eps = _divisors(m.num_moe_experts) if m.num_moe_experts else [1]
                    grids.extend((tp, pp, vp, cp, ep) for ep in eps)
    return grids


def lever_sets(grid, gpus: int, layers_per_chunk: int) -> list[Layout]:
    """Every lever combination searched for one grid: SP with tp > 1 and the distributed optimizer
    always (the module docstring says why), recompute none, selective, or full block recompute of a
    quarter, half, three quarters and all of a chunk's layers, each with and without the fused loss."""
    tp, pp, vp, cp, ep = grid
    dp = gpus // (tp * pp * cp)
    blocks = sorted({max(1, layers_per_chunk * q // 4) for q in (1, 2, 3, 4)})
    recomputes = [(None, 0), ("selective", 0), *(("full", n) for n in blocks)]
    return [
        Layout(tp, pp, vp, cp, dp, ep, sp=tp > 1, distopt=True, recompute=r, recompute_layers=n, fused_loss=f)
        for r, n in recomputes
        for f in (False, True)
    ]


def layers_per_chunk(config) -> int:
    """The most layers one model chunk of ``config`` (validated) holds."""
    return max(max(chunks) for chunks in pipeline_layer_counts(config.model))


# pretrain.py's flags that say the layout: dropped from the user's flag set and given per candidate.
VALUE_FLAGS = (
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--virtual-pipeline-model-parallel-size",
    "--num-layers-per-virtual-pipeline-stage",
    "--num-virtual-stages-per-pipeline-rank",
    "--context-parallel-size",
    "--expert-model-parallel-size",
    "--recompute-granularity",
    "--recompute-method",
    "--recompute-num-layers",
    "--nproc-per-node",
)
SWITCH_FLAGS = (
    "--sequence-parallel",
    "--use-distributed-optimizer",
    "--cross-entropy-loss-fusion",
    "--recompute-activations",
)


def without_layout_flags(argv: list[str]) -> list[str]:
    """``argv`` less the flags :data:`VALUE_FLAGS` and :data:`SWITCH_FLAGS` name (with their values)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in SWITCH_FLAGS or (name in VALUE_FLAGS and "=" in arg):
            continue
        if name in VALUE_FLAGS:
            skip = True
            continue
        kept.append(arg)
    return kept


def layout_flags(layout: Layout, gpus: int, moe: bool = False) -> list[str]:
    """pretrain.py's flags for ``layout`` on ``gpus`` GPUs (to add to the job's other flags)."""
    flags = ["--nproc-per-node", str(gpus), "--tensor-model-parallel-size", str(layout.tp)]
    flags += ["--pipeline-model-parallel-size", str(layout.pp)]
    if layout.vp > 1:
        flags += ["--virtual-pipeline-model-parallel-size", str(layout.vp)]
    flags += ["--context-parallel-size", str(layout.cp)]
    if moe:
        flags += ["--expert-model-parallel-size", str(layout.ep)]
    flags += ["--sequence-parallel"] if layout.sp else []
    flags += ["--use-distributed-optimizer"] if layout.distopt else []
    if layout.recompute == "selective":
        flags += ["--recompute-granularity", "selective"]
    elif layout.recompute == "full":
        flags += ["--recompute-granularity", "full", "--recompute-method", "block"]
        flags += ["--recompute-num-layers", str(layout.recompute_layers)]
    flags += ["--cross-entropy-loss-fusion"] if layout.fused_loss else []
    return flags


def layout_overrides(layout: Layout, moe: bool = False) -> list[str]:
    """The recipe overrides (``section.field=value``) for ``layout``."""
    recompute = {"selective": "selective", "full": "full"}.get(layout.recompute, "null")
    overrides = [
        f"model.tensor_model_parallel_size={layout.tp}",
        f"model.pipeline_model_parallel_size={layout.pp}",
        f"model.virtual_pipeline_model_parallel_size={layout.vp if layout.vp > 1 else 'null'}",
        f"model.context_parallel_size={layout.cp}",
        *([f"model.expert_model_parallel_size={layout.ep}"] if moe else []),
        f"model.sequence_parallel={str(layout.sp).lower()}",
        f"ddp.use_distributed_optimizer={str(layout.distopt).lower()}",
        f"model.recompute_granularity={recompute}",
    ]
    if layout.recompute == "full":
        overrides += ["model.recompute_method=block", f"model.recompute_num_layers={layout.recompute_layers}"]
    else:  # as apply_layout clears them: a method the job had would be refused without full recompute
        overrides += ["model.recompute_method=null", "model.recompute_num_layers=null"]
    overrides.append(f"model.cross_entropy_loss_fusion={str(layout.fused_loss).lower()}")
    return overrides
