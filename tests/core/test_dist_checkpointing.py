"""``--ckpt-format torch_dist``: a checkpoint saved at tp 2 pp 2 resumes at other tp / pp / vp / dp
sizes and with the distributed optimizer on or off, with the losses of the unbroken run; ``--async-save``
writes in the background and a kill -9 mid-write leaves the previous checkpoint; ``.metadata`` runs no
code. Real gloo worlds, real files."""

from __future__ import annotations

import os
import pickle
import signal
import time

import pytest
from dist_helpers import SMALL_MODEL, loss_lines, ok, parse_losses, run_pretrain
from job_helpers import Job, alive, children

from megatron_lite.core.dist_checkpointing import load_metadata

EIGHT_LAYERS = [*SMALL_MODEL, "--num-layers", "8"]  # the last value of a flag wins
COMMON = [*EIGHT_LAYERS, "--train-iters", "8", "--ckpt-format", "torch_dist"]
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


@pytest.fixture(scope="module")
def saved_tp2_pp2(tmp_path_factory):
    """8 iterations at tp 2 pp 2 dp 1 (the reference losses), saving iterations 3, 6 and 8."""
    root = tmp_path_factory.mktemp("dist")
    straight = ok(run_pretrain([*COMMON, *TP2_PP2, "--save", "ckpt", "--save-interval", "3"], root))
    return root, parse_losses(straight.stdout), loss_lines(straight.stdout)


def _resume(root, layout: list[str], *extra: str):
    return ok(run_pretrain([*COMMON, *layout, "--load", "ckpt", "--ckpt-step", "3", *extra], root))


def _assert_close(resumed: dict, reference: dict, iterations) -> None:
    assert sorted(resumed) == list(iterations)
    for it in iterations:
        assert abs(resumed[it] - reference[it]) <= 5e-4, (it, resumed[it], reference[it])


@pytest.mark.world
def test_megatron_core_layout_on_disk(saved_tp2_pp2):
    root, _, _ = saved_tp2_pp2
    step = root / "ckpt" / "iter_0000003"
    assert (root / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
    assert sorted(p.name for p in step.iterdir()) == [
        ".metadata",
        *(f"__{r}_0.distcp" for r in range(4)),
        "common.pt",
        "metadata.json",
    ]
    assert (step / "metadata.json").read_text() == (
        '{"sharded_backend": "torch_dist", "sharded_backend_version": 1, '
        '"common_backend": "torch", "common_backend_version": 1}'
    )
    saved = load_metadata(str(step)).state_dict_metadata
    # Each tensor once, at its whole-model shape: layers stacked, TP shards merged, vocabulary padded.
    assert tuple(saved["decoder.layers.self_attention.linear_qkv.weight"].size) == (8, 192, 64)
    assert tuple(saved["decoder.layers.mlp.linear_fc2.weight"].size) == (8, 64, 256)
    assert tuple(saved["optimizer.state.exp_avg.embedding.word_embeddings.weight"].size) == (256, 64)
    assert len(saved["decoder.layers.self_attention.linear_qkv.weight"].chunks) == 8 * 2  # layer x TP rank


@pytest.mark.world
@pytest.mark.parametrize(
    "layout, note",
    [
        (["--pipeline-model-parallel-size", "4"], "to tp=1 pp=4 dp=1"),
        (
            ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"],
            "to tp=1 pp=2 vp=2 dp=2",
        ),
    ],
    ids=["tp1-pp4", "pp2-vp2-dp2"],
)
def test_resume_at_another_layout(saved_tp2_pp2, layout, note):
    root, reference, _ = saved_tp2_pp2
    resumed = _resume(root, [*layout, "--nproc-per-node", "4", "--exit-interval", "6"])
    assert f"resharding checkpoint from tp=2 pp=2 dp=1 {note}" in resumed.stdout
    assert "random generator states are per rank and do not carry to another layout" in resumed.stdout
    _assert_close(parse_losses(resumed.stdout), reference, range(4, 7))


@pytest.mark.world
def test_distributed_optimizer_on_then_off_across_dp_sizes(saved_tp2_pp2):
    """Saved without the distributed optimizer, resumed with it at dp 2 (its shards: flat ranges of the
    parameters) and saved; that checkpoint resumed without it at tp 1 pp 4."""
    root, reference, _ = saved_tp2_pp2
    tp2_dp2 = ["--tensor-model-parallel-size", "2", "--nproc-per-node", "4", "--use-distributed-optimizer"]
    tp2_dp2 += ["--overlap-param-gather"]  # the save must wait for the parameters' all-gather
    first = _resume(root, tp2_dp2, "--save", "sharded", "--exit-interval", "6")
    _assert_close(parse_losses(first.stdout), reference, range(4, 7))
    second = ok(run_pretrain([*COMMON, "--pipeline-model-parallel-size", "4", "--load", "sharded"], root))
    assert "successfully loaded checkpoint from sharded at iteration 6" in second.stdout
    _assert_close(parse_losses(second.stdout), reference, range(7, 9))


@pytest.mark.world
@pytest.mark.parametrize(
    "layout",
    [
        ["--pipeline-model-parallel-size", "4"],
        # The main parameters' shards start where whole weights do, in pieces of other sizes.
        ["--pipeline-model-parallel-size", "2", "--nproc-per-node", "4", "--use-distributed-optimizer"],
    ],
    ids=["tp1-pp4", "pp2-dp2-distopt"],
)
def test_bf16_run_resumes_an_fp32_checkpoint(saved_tp2_pp2, layout):
    """Its fp32 main parameters and its bf16 weights both come from the saved fp32 weights (the same
    tensors, read into two places); an untrained model's loss would be 0.1 off."""
    root, reference, _ = saved_tp2_pp2
    resumed = _resume(root, layout, "--bf16", "--exit-interval", "4")
    assert abs(parse_losses(resumed.stdout)[4] - reference[4]) < 1e-2, (
        parse_losses(resumed.stdout),
        reference,
    )


@pytest.mark.world
def test_same_layout_resumes_bitwise(saved_tp2_pp2):
    root, _, reference = saved_tp2_pp2
    resumed = _resume(root, TP2_PP2)
    assert "resharding" not in resumed.stdout and "reseeding" not in resumed.stdout
    assert loss_lines(resumed.stdout) == {it: reference[it] for it in range(4, 9)}


@pytest.mark.world
def test_async_save_trains_during_the_write_and_a_kill_keeps_the_previous(tmp_path, monkeypatch):
    """Each background write waits 4 s first: iterations go on meanwhile. The job is killed with SIGKILL
    while iteration 4's write is in flight; iteration 2 stays the latest and resumes exactly."""
    args = [*COMMON, "--pipeline-model-parallel-size", "2", "--save", "ckpt", "--save-interval", "2"]
    monkeypatch.setenv("MEGATRON_LITE_TEST_ASYNC_WRITE_DELAY_S", "4")
    job = Job([*args, "--async-save"], tmp_path)
    job.wait_for("successfully saved checkpoint from iteration       2")
    job.wait_for("iteration        5/")
    out = "".join(job.out)
    assert out.index("iteration        3/") < out.index(
        "successfully saved checkpoint from iteration       2"
    )
    assert "successfully saved checkpoint from iteration       4" not in out
    workers = children(job.proc.pid)
    spawned = [pid for w in workers for pid in children(w)]  # writers, multiprocessing's helpers
    assert sum(_comm(pid) == "ckpt-writer" for pid in spawned) == 2  # one background writer per rank
    job.proc.send_signal(signal.SIGKILL)  # the launcher; its workers and their writers die with it
    job.proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in workers + spawned):
        assert time.monotonic() < deadline, "a worker or a background writer outlived the job"
        time.sleep(0.1)
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert not (ckpt / "iter_0000004").exists()
    monkeypatch.delenv("MEGATRON_LITE_TEST_ASYNC_WRITE_DELAY_S")
    resumed = ok(run_pretrain([*args, "--load", "ckpt", "--exit-interval", "5"], tmp_path))
    assert "successfully loaded checkpoint from ckpt at iteration 2" in resumed.stdout
    killed = loss_lines(out)
    assert loss_lines(resumed.stdout) == {it: killed[it] for it in range(3, 6)}
    assert not (ckpt / ".tmp_iter_0000004").exists()  # the next save cleared the killed one's leftovers


def _comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


@pytest.mark.world
def test_sigterm_during_an_async_write_saves_and_exits_cleanly(tmp_path, monkeypatch):
    """The background writer ignores the SIGTERM sent to the process group; the rank finishes the save
    in flight, saves its last iteration and exits 0."""
    monkeypatch.setenv("MEGATRON_LITE_TEST_ASYNC_WRITE_DELAY_S", "2")
    job = Job(
        [*COMMON, "--train-iters", "1000", "--save", "ckpt", "--save-interval", "2", "--async-save",
         "--ckpt-format", "torch_dist", "--exit-signal-handler"],
        tmp_path,
    )  # fmt: skip
    job.wait_for("saving checkpoint at iteration       2")
    job.proc.send_signal(signal.SIGTERM)  # the launcher forwards it to every worker's process group
    assert job.proc.wait(timeout=120) == 0, "".join(job.err)
    out = "".join(job.out)
    saved = int((tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    assert "successfully saved checkpoint from iteration       2" in out
    assert saved == max(parse_losses(out)) >= 2


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_metadata_that_would_run_code_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(pickle.UnpicklingError, match="posix.system is not allowed"):
        load_metadata(str(tmp_path))
    assert not (tmp_path / "pwned").exists()


def _opcodes(*parts: bytes) -> bytes:
    return b"\x80\x04" + b"".join(parts) + b"."


def _text(s: str) -> bytes:
    return b"\x8c" + bytes([len(s)]) + s.encode()


def test_metadata_may_not_set_a_class_attribute_or_call_other_classes(tmp_path):
    """BUILD on a class (it would patch DCP's Metadata for the whole process) and REDUCE of a DCP class
    that is no metadata (FsspecReader would open any URL) are refused."""
    from torch.distributed.checkpoint.metadata import Metadata

    build = _opcodes(
        _text(Metadata.__module__), _text("Metadata"), b"\x93N}", _text("pwned"), _text("yes"), b"s\x86b"
    )
    reduce = _opcodes(_text("torch.distributed.checkpoint._fsspec_filesystem"), _text("FsspecReader"), b"\x93",
                      _text("memory://x/"), b"\x85R")  # fmt: skip
    for payload, refusal in ((build, "setting the state of a type"), (reduce, "FsspecReader is not allowed")):
        (tmp_path / ".metadata").write_bytes(payload)
        with pytest.raises(pickle.UnpicklingError, match=refusal):
            load_metadata(str(tmp_path))
    assert not hasattr(Metadata, "pwned")
