"""The schedules' upstream (megatron-core) surface: selection, helpers, loss contracts, 1F1B order.

Mostly single-process with stand-ins for groups and communicators; one real 2-rank gloo world checks
the P2P communicator's upstream call signatures.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from dist_helpers import run_world

import megatron_lite.core.pipeline_parallel.microbatches as microbatch_steps  # where the patched steps live
import megatron_lite.core.pipeline_parallel.schedules as schedules
from megatron_lite.core.distributed.finalize_model_grads import finalize_model_grads
from megatron_lite.core.hyper_comm_grid import HyperCommGrid
from megatron_lite.core.pipeline_parallel import utils as pp_utils
from megatron_lite.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron_lite.core.process_groups_config import ProcessGroupCollection


class _Group:
    """A process-group stand-in: just rank() and size()."""

    def __init__(self, rank=0, size=1):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def _config(**overrides):
    base = dict(
        timers=None,
        calculate_per_token_loss=False,
        deallocate_pipeline_outputs=False,
        grad_scale_func=None,
        no_sync_func=None,
        grad_sync_func=None,
        finalize_model_grads_func=None,
        variable_seq_lengths=False,
        sequence_parallel=False,
        hidden_size=8,
    )
    return SimpleNamespace(**{**base, **overrides})


def _collection(cp=1):
    pgc = ProcessGroupCollection()
    pgc.tp, pgc.cp = _Group(), _Group(size=cp)
    return pgc


# --- selection -------------------------------------------------------------------------------


def test_get_forward_backward_func_from_explicit_sizes():
    assert schedules.get_forward_backward_func(1, None) is schedules.forward_backward_no_pipelining
    assert (
        schedules.get_forward_backward_func(4, None)
        is schedules.forward_backward_pipelining_without_interleaving
    )
    interleaved = schedules.get_forward_backward_func(4, 2)
    assert interleaved is schedules.forward_backward_pipelining_with_interleaving
    with pytest.raises(AssertionError, match="list of model chunks"):
        interleaved(
            forward_step_func=None,
            data_iterator=None,
            model=None,
            num_microbatches=1,
            seq_length=8,
            micro_batch_size=1,
        )
    with pytest.raises(NotImplementedError, match="MIMO"):
        schedules.get_forward_backward_func(schedule_pg_collection=object())


# --- helpers -----------------------------------------------------------------------------------


def test_deallocate_output_tensor_only_when_asked():
    kept = torch.ones(2, 3, requires_grad=True) * 2
    schedules.deallocate_output_tensor(kept)
    assert kept.nelement() == 6  # the default (False) leaves the tensor alone, as upstream
    freed = [torch.ones(2, 3, requires_grad=True) * 2, torch.ones(4, requires_grad=True) * 3]
    schedules.deallocate_output_tensor({"a": freed[0], "b": [freed[1]]}, True)
    assert [t.nelement() for t in freed] == [1, 1]
    assert all(t.grad_fn is not None for t in freed)  # the autograd node survives
    with pytest.raises(AssertionError, match="view"):
        schedules.deallocate_output_tensor(torch.ones(4, 2)[0], True)


def test_check_first_val_step():
    assert schedules.check_first_val_step(None, True, True) is True
    assert schedules.check_first_val_step(False, True, True) is False
    assert schedules.check_first_val_step(False, False, True) is True  # only narrows forward-only passes


def test_get_tensor_shapes():
    cfg = _config(hidden_size=16)
    kw = dict(seq_length=32, micro_batch_size=2, decoder_seq_length=None, config=cfg)
    assert schedules.get_tensor_shapes(**kw, cp_group=_Group(size=2)) == [(16, 2, 16)]
    assert schedules.get_tensor_shapes(**{**kw, "decoder_seq_length": 8}) == [(8, 2, 16)]
    cfg.sequence_parallel = True
    assert schedules.get_tensor_shapes(**kw, tp_group=_Group(size=4)) == [(8, 2, 16)]
    cfg.variable_seq_lengths = True
    assert schedules.get_tensor_shapes(**kw) == [()]


def test_pipeline_stage_helpers():
    assert pp_utils.is_pp_first_stage(_Group(0, 3)) and not pp_utils.is_pp_last_stage(_Group(0, 3))
    assert pp_utils.is_pp_last_stage(_Group(2, 3))
    assert pp_utils.is_vp_first_stage(None, None) and pp_utils.is_vp_last_stage(0, 1)
    assert pp_utils.is_vp_first_stage(0, 2) and not pp_utils.is_vp_last_stage(0, 2)
    with pytest.raises(AssertionError):
        pp_utils.is_vp_first_stage(1, None)


# --- forward_step / backward_step ------------------------------------------------------------


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(3.0))
        self.inputs = []

    def set_input_tensor(self, input_tensor):
        self.inputs.append(input_tensor)

    def forward(self, x):
        return self.weight * x


def _step(loss_func):
    def forward_step_func(data_iterator, model):
        return model(torch.tensor(next(data_iterator))), loss_func

    return forward_step_func


def _forward(loss_func, *, cfg=None, cp=1, last=True, store=None, **kw):
    store = [] if store is None else store
    model = _Model()
    out, num_tokens = schedules.forward_step(
        _step(loss_func), iter([2.0]), model, 4, None, store, cfg or _config(), cp, is_last_stage=last, **kw
    )
    return out, num_tokens, store, model


def test_forward_step_three_value_loss_is_a_token_mean_per_microbatch():
    out, num_tokens, store, model = _forward(lambda o: (o * 10, torch.tensor(5), {"lm loss": o.detach()}))
    assert model.inputs == [[None]]  # set_input_tensor always gets a list, as upstream
    assert out.item() == pytest.approx(6.0 * 10 / 5 / 4) and num_tokens.item() == 5
    assert store == [{"lm loss": torch.tensor(6.0)}]
    per_token, *_ = _forward(
        lambda o: (o * 10, torch.tensor(5), {}), cfg=_config(calculate_per_token_loss=True)
    )
    assert per_token.item() == pytest.approx(60.0)  # summed loss: finalize divides by the step's tokens


def test_forward_step_two_value_loss_is_scaled_by_cp_and_microbatches():
    out, num_tokens, store, _ = _forward(lambda o: (o, {"x": 1}), cp=2)
    assert out.item() == pytest.approx(6.0 * 2 / 4) and num_tokens.item() == 0 and store == [{"x": 1}]


def test_forward_step_other_outputs():
    out, _, store, _ = _forward(None)
    assert store == [out]  # no loss function: the output itself is collected
    _, _, store, _ = _forward(
        lambda o, non_loss_data=False: ("data", non_loss_data), collect_non_loss_data=True
    )
    assert store == [("data", True)]
    out, _, store, _ = _forward(lambda o: pytest.fail("loss on a non-last stage"), last=False)
    assert out.item() == 6.0 and store == []


def test_backward_step_uses_custom_backward_for_freed_outputs(mocker):
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    y = (x * 3).sum()
    spy = mocker.spy(microbatch_steps, "custom_backward")
    grad = schedules.backward_step(x, y, None, _config(deallocate_pipeline_outputs=True))
    assert spy.call_count == 1 and torch.equal(grad, torch.tensor([3.0, 3.0]))
    x2 = torch.tensor([1.0], requires_grad=True)
    out = x2 * 2
    grads = schedules.backward_step([x2], [out], [torch.tensor([5.0])], _config())
    assert spy.call_count == 1 and torch.equal(grads[0], torch.tensor([10.0]))


# --- whole schedules ----------------------------------------------------------------------------


def test_no_pipelining_syncs_once_and_finalizes_once():
    events = []

    @contextlib.contextmanager
    def no_sync():
        events.append("no_sync")
        yield

    finalize = []
    cfg = _config(no_sync_func=no_sync, finalize_model_grads_func=lambda *a, **kw: finalize.append((a, kw)))
    model = _Model()
    model.config = cfg
    pgc = _collection()
    store = schedules.forward_backward_no_pipelining(
        # A copy: the schedule scales the returned loss in place.
        forward_step_func=_step(lambda o: (o, {"loss": o.detach().clone()})),
        data_iterator=[iter([1.0, 2.0, 3.0])],
        model=[model],
        num_microbatches=3,
        seq_length=None,
        micro_batch_size=None,
        pg_collection=pgc,
    )
    assert [d["loss"].item() for d in store] == [3.0, 6.0, 9.0]
    assert events == ["no_sync"]  # once, around every microbatch but the last
    assert model.weight.grad.item() == pytest.approx((1 + 2 + 3) / 3)  # accumulated step mean
    assert len(finalize) == 1 and finalize[0][0][0] == [model] and finalize[0][0][1] is None
    assert finalize[0][1] == {"pg_collection": pgc, "force_all_reduce": False}
    schedules.forward_backward_no_pipelining(
        forward_step_func=_step(lambda o: (o, {})),
        data_iterator=iter([1.0]),
        model=model,
        num_microbatches=1,
        forward_only=True,
        pg_collection=pgc,
    )
    assert len(finalize) == 1  # forward-only steps do not finalize gradients


class _RecordingP2P(P2PCommunicator):
    """Stage ``stage`` of ``stages``: records the calls, receives dummies."""

    def __init__(self, stage, stages, config, calls):
        self.stage, self.stages, self.config, self.calls = stage, stages, config, calls

    total_stages = property(lambda self: self.stages)
    current_stage = property(lambda self: self.stage)
    is_pp_first_stage = property(lambda self: self.stage == 0)
    is_pp_last_stage = property(lambda self: self.stage == self.stages - 1)

    def _record(self, name, value=None):
        self.calls.append(name)
        return value

    def recv_forward(self, shapes, first):
        return self._record("recv_fwd", None if first else torch.ones(1, requires_grad=True))

    def send_forward(self, out, last):
        self._record("send_fwd")

    def recv_backward(self, shapes, last):
        return self._record("recv_bwd", None if last else torch.ones(1))

    def send_backward(self, grad, first):
        self._record("send_bwd")

    def send_forward_recv_backward(self, out, shapes, last):
        return self._record("send_fwd_recv_bwd", None if last else torch.ones(1))

    def send_backward_recv_forward(self, grad, shapes, first):
        return self._record("send_bwd_recv_fwd", None if first else torch.ones(1, requires_grad=True))


def _run_1f1b(monkeypatch, stage, stages, microbatches, forward_only=False, calls=None, **cfg):
    cfg = _config(**cfg)
    p2p = _RecordingP2P(stage, stages, cfg, [] if calls is None else calls)
    monkeypatch.setattr(
        microbatch_steps, "forward_step", lambda *a, **kw: (p2p._record("F", torch.ones(1)), torch.tensor(0))
    )
    monkeypatch.setattr(microbatch_steps, "backward_step", lambda *a, **kw: p2p._record("B"))
    model = SimpleNamespace(config=cfg, parameters=lambda: [])
    schedules.forward_backward_pipelining_without_interleaving(
        forward_step_func=None,
        data_iterator=None,
        model=[model],
        num_microbatches=microbatches,
        seq_length=4,
        micro_batch_size=1,
        forward_only=forward_only,
        p2p_communicator=p2p,
        pg_collection=_collection(),
    )
    return p2p.calls


def test_1f1b_order_on_the_first_of_three_stages(monkeypatch):
    calls = [c for c in _run_1f1b(monkeypatch, 0, 3, 4) if c in ("F", "B")]
    assert calls == ["F", "F", "F", "B", "F", "B", "B", "B"]  # 2 warmup forwards, then 1F1B, cooldown


def test_1f1b_order_on_the_last_stage(monkeypatch):
    calls = _run_1f1b(monkeypatch, 2, 3, 2)
    assert calls == ["recv_fwd", "F", "send_fwd_recv_bwd", "B", "send_bwd_recv_fwd", "F"] + [
        "send_fwd_recv_bwd",
        "B",
        "send_bwd",
    ]


def test_1f1b_forward_only_never_runs_backward(monkeypatch):
    calls = _run_1f1b(monkeypatch, 1, 3, 3, forward_only=True)
    assert "B" not in calls and calls.count("F") == 3 and calls.count("send_fwd") == 3


def test_1f1b_grad_sync_enabled_before_the_last_backward(monkeypatch):
    calls = []

    @contextlib.contextmanager
    def no_sync():
        calls.append("enter")
        yield
        calls.append("exit")

    _run_1f1b(monkeypatch, 0, 2, 2, calls=calls, no_sync_func=no_sync)
    order = [c for c in calls if c in ("enter", "exit", "F", "B")]
    assert order == ["enter", "F", "F", "B", "exit", "B"]  # only the last backward may sync


def test_1f1b_refuses_a_communicator_without_groups():
    with pytest.raises(ValueError, match="pg_collection"):
        schedules.forward_backward_pipelining_without_interleaving(
            forward_step_func=None,
            data_iterator=None,
            model=SimpleNamespace(config=_config()),
            num_microbatches=1,
            seq_length=1,
            micro_batch_size=1,
            p2p_communicator=object(),
        )


# --- finalize_model_grads and HyperCommGrid -------------------------------------------------


def test_finalize_model_grads_syncs_each_chunk():
    synced = []
    chunks = [
        SimpleNamespace(
            finish_grad_sync=lambda force_all_reduce=False, i=i: synced.append((i, force_all_reduce))
        )
        for i in range(2)
    ]
    pgc = ProcessGroupCollection()
    finalize_model_grads(chunks, None, pg_collection=pgc, force_all_reduce=True)
    assert synced == [(0, True), (1, True)]
    # Per-token loss: each chunk's gradients divided by the step's token count (one process: its own).
    scaled = []
    for chunk in chunks:
        chunk.scale_gradients = scaled.append
    finalize_model_grads(chunks, torch.tensor(4), pg_collection=pgc)
    assert [float(s) for s in scaled] == [0.25, 0.25]


def test_hyper_comm_grid_rank_enumeration(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    grid = HyperCommGrid([2, 1, 4, 1], ["tp", "cp", "pp", "dp"])
    assert grid.get_rank_enum("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.get_rank_enum("pp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert grid.get_rank_enum(["pp", "tp"]) == [list(range(8))]
    with pytest.raises(ValueError, match="ep"):
        grid.get_rank_enum("ep")
    with pytest.raises(RuntimeError, match="needs 16"):
        HyperCommGrid([4, 4], ["tp", "dp"])


# --- the P2P communicator in a real pipeline -------------------------------------------------


def _p2p_signatures(rank, world):
    import torch.distributed as dist

    cfg = _config(pipeline_dtype=torch.float32, virtual_pipeline_model_parallel_size=None)
    p2p = P2PCommunicator(dist.new_group([0, 1]), cfg)
    shape = (2, 1, 3)
    out = {"stage": (p2p.current_stage, p2p.total_stages, p2p.is_pp_first_stage, p2p.is_pp_last_stage)}
    if p2p.is_pp_first_stage:
        assert p2p.recv_forward(shape, True) is None
        grad = p2p.send_forward_recv_backward(torch.full(shape, 2.0), shape, False)
        p2p.send_forward([torch.full(shape, 5.0)], False)  # a list of tensors is sent one by one
        out["got"] = grad.mean().item()
    else:
        received = p2p.recv_forward([shape], False)[0]
        nxt = p2p.send_backward_recv_forward(received.detach() * 10, shape, False)
        out["got"] = (received.mean().item(), nxt.mean().item())
    p2p.wait_for_sends()  # gloo sends complete lazily: the last one must land before the world goes
    return out


@pytest.mark.world
def test_p2p_communicator_upstream_calls():
    first, second = run_world(_p2p_signatures, 2)
    assert first == {"stage": (0, 2, True, False), "got": 20.0}
    assert second == {"stage": (1, 2, False, True), "got": (2.0, 5.0)}


def test_schedule_enables_grad_sync_on_first_stage(monkeypatch):
    """Upstream's test (its P2PCommunicator case), patched where the steps live: with one microbatch
    on the first stage, gradient sync is re-enabled before that microbatch's backward."""
    events = []

    @contextlib.contextmanager
    def no_sync():
        events.append("enter_no_sync")
        try:
            yield
        finally:
            events.append("exit_no_sync")

    config = SimpleNamespace(
        overlap_p2p_comm=False,
        variable_seq_lengths=True,
        finalize_model_grads_func=None,
        timers=None,
        no_sync_func=no_sync,
        num_microbatches_with_partial_activation_checkpoints=None,
        deallocate_pipeline_outputs=False,
        grad_sync_func=lambda _parameters: events.append("grad_sync"),
        calculate_per_token_loss=False,
    )
    model = SimpleNamespace(config=config, parameters=lambda: [])

    class FakeCommunicator(P2PCommunicator):
        total_stages, current_stage = 1, 0
        is_pp_first_stage = is_pp_last_stage = True

        def __init__(self):
            self.config = config

        recv_forward = send_forward_recv_backward = send_forward = staticmethod(lambda *_a: None)
        recv_backward = send_backward = staticmethod(lambda *_a: None)

    monkeypatch.setattr(
        microbatch_steps, "forward_step", lambda *_a, **_k: (torch.tensor(1.0), torch.tensor(0))
    )
    monkeypatch.setattr(
        microbatch_steps, "backward_step", lambda *_a, **_k: events.append("backward") or None
    )
    monkeypatch.setattr(microbatch_steps, "deallocate_output_tensor", lambda *_a: None)
    pg_collection = ProcessGroupCollection()
    pg_collection.tp = SimpleNamespace(size=lambda: 1)
    pg_collection.cp = SimpleNamespace(size=lambda: 1)
    schedules.forward_backward_pipelining_without_interleaving(
        forward_step_func=None,
        data_iterator=None,
        model=model,
        num_microbatches=1,
        seq_length=1,
        micro_batch_size=1,
        p2p_communicator=FakeCommunicator(),
        pg_collection=pg_collection,
    )
    assert events == ["enter_no_sync", "exit_no_sync", "backward"]
