"""Measured and predicted memory of every pipeline stage of a real run (tests and bench/memory_prediction.py).

The run is the real pretrain() in a real gloo world with --log-memory-to-tensorboard
--log-memory-per-pp-stage; peak saved activations and optimizer state are read back from its event
files, weights and gradient buffers from the tensors of each rank's model chunks after training,
and the predictions from the ``memory/pp-stage-<i>/predicted-*`` tags the run logged at start.
"""

from __future__ import annotations

from dist_helpers import run_world
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

QUANTITIES = ("weights", "grads", "optimizer", "activations")
MEASURED_TAGS = {"optimizer": "mem-optimizer-state-gigabytes", "activations": "mem-max-activation-gigabytes"}
PREDICTED_TAGS = {
    "weights": "predicted-weights-gigabytes",
    "grads": "predicted-grads-gigabytes",
    "optimizer": "predicted-optimizer-state-gigabytes",
    "activations": "predicted-max-activation-gigabytes",
}


def _train_and_measure(rank, world, argv):
    """pretrain() on this rank; then the bytes of its parameters and DDP gradient buffers."""
    import torch.distributed as dist

    import megatron_lite.training.pretrain as pretrain_module
    from megatron_lite.training.arguments import parse_args
    from megatron_lite.training.gpt_step import forward_step

    captured = {}
    real_setup = pretrain_module.setup

    def recording_setup(state):
        s = real_setup(state)
        pg = s.pg_collection
        captured.update(s=s, ranks=tuple(dist.get_rank(g) for g in (pg.pp, pg.tp, pg.dp)))
        return s

    pretrain_module.setup = recording_setup
    pretrain_module.pretrain(parse_args(argv), forward_step)
    chunks = captured["s"].model
    weights = sum(p.numel() * p.element_size() for c in chunks for p in c.module.parameters())
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for c in chunks for b in c.buffers)
    pp, tp, dp = captured["ranks"]
    return {"pp": pp, "tp": tp, "dp": dp, "weights": weights / 1e9, "grads": grads / 1e9}


def measure(argv: list[str], world: int, tb_dir) -> list[dict[str, tuple[float, float]]]:
    """Per stage: ``{quantity: (measured GB, predicted GB)}`` for TP rank 0 / DP rank 0 of the stage."""
    argv = [
        *argv,
        "--log-memory-to-tensorboard",
        "--log-memory-per-pp-stage",
        "--tensorboard-dir",
        str(tb_dir),
    ]
    ranks = run_world(_train_and_measure, world, argv)
    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])

    def last(stage, name):
        tag = f"memory/pp-stage-{stage}/{name}"
        assert tag in tags, f"{tag} not logged"
        return acc.Scalars(tag)[-1].value

    stages = []
    for r in sorted((r for r in ranks if r["tp"] == 0 and r["dp"] == 0), key=lambda r: r["pp"]):
        stage = r["pp"]
        measured = {"weights": r["weights"], "grads": r["grads"]}
        measured.update({q: last(stage, tag) for q, tag in MEASURED_TAGS.items()})
        stages.append({q: (measured[q], last(stage, PREDICTED_TAGS[q])) for q in QUANTITIES})
    return stages
