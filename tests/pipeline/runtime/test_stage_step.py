"""A stage's step run in-process against a fake p2p layer: what it computes, what it posts, and in which order."""

from __future__ import annotations

import pytest
import torch
from helpers.models import LinearChain
from torch import Tensor

from lightning_varuna.failstop.failures import PipelineError
from lightning_varuna.pipeline.comm.events import (
    Event,
    EventHooks,
    EventKind,
    EventLog,
    P2PTraceWriter,
    PostedOp,
    StageCounters,
)
from lightning_varuna.pipeline.comm.transfers import Link, decode_header, encode_skip_header
from lightning_varuna.pipeline.model.cut import CutPointError
from lightning_varuna.pipeline.runtime.executor import SUMMARY_SIZE, StageExecutor
from lightning_varuna.pipeline.scheduling.lowering import Message, MessageKind, link_messages
from lightning_varuna.pipeline.scheduling.nccl_replay import check_trace_dir
from lightning_varuna.pipeline.scheduling.schedules import Kind, Task, make_schedule
from lightning_varuna.pipeline.topology import Topology

WIDTH = 4


class FakeTransfer:
    def __init__(self, kind: str, link: Link, message: Message, tensor: Tensor, op: PostedOp) -> None:
        self.kind, self.link, self.message, self.tensor, self.wire = kind, link, message, tensor, tensor
        self.op = op


class FakeP2P:
    """Receives are filled from ``inbound`` once their message is in ``arrived``; sends are kept in ``sent``."""

    def __init__(self, inbound: dict[Message, Tensor]) -> None:
        self.events = EventHooks()
        self.inbound = inbound
        self.arrived = set(inbound)
        self.posted: list[tuple[str, str, Message]] = []
        self.sent: dict[Message, Tensor] = {}
        self.waits: list[Message] = []
        self.closed = 0

    def link(self, src: int, dst: int) -> Link:
        return Link(src, dst, None)

    def isend(self, tensor: Tensor, link: Link, message: Message, watch: bool = False) -> FakeTransfer:
        self.sent[message] = tensor.clone()
        return self._post("send", link.dst, tensor, link, message)

    def irecv(self, tensor: Tensor, link: Link, message: Message, watch: bool = False) -> FakeTransfer:
        return self._post("recv", link.src, tensor, link, message)

    def _post(self, kind: str, peer: int, tensor: Tensor, link: Link, message: Message) -> FakeTransfer:
        """Records the op, and tells the event hook as the real layer does (the NCCL-rules mode listens)."""
        self.posted.append((kind, link.name, message))
        op = PostedOp(len(self.posted), kind, peer, link.name, tensor.numel() * tensor.element_size(), tensor.dtype,
                      message)
        if self.events.emit is not None:
            self.events.emit(Event(EventKind.POST, 0.0, op=op))
        return FakeTransfer(kind, link, message, tensor, op)

    def completed(self, transfer: FakeTransfer) -> bool:
        return transfer.kind == "send" or transfer.message in self.arrived

    def finished(self, transfer: FakeTransfer) -> bool:
        return self.completed(transfer)

    def wait(self, transfer: FakeTransfer, what: str) -> None:
        assert self.completed(transfer), f"the step waits for {transfer.message!r}, which never arrives here"
        if self.events.emit is not None:
            self.events.emit(Event(EventKind.WAIT_START, 0.0, op=transfer.op))
        self.waits.append(transfer.message)
        if transfer.kind == "recv":
            transfer.tensor.detach().copy_(self.inbound[transfer.message])  # as a transport writes: not autograd

    def close(self, join: bool = True) -> None:
        self.closed += 1




def _header(shape: tuple[int, ...]) -> Tensor:
    values = [0, len(shape), *shape]
    return torch.tensor(values + [0] * (10 - len(values)), dtype=torch.int64)


def _middle_stage(p2p: FakeP2P, model: LinearChain) -> StageExecutor:
    # P=3 on ranks 0, 1, 2; this is rank 1, the middle stage: it receives at cut 0 and ends at cut 1
    topology = Topology(world_size=3, rank=1, pipeline_size=3, device=torch.device("cpu"))
    return StageExecutor(topology, p2p, list(model.cuts), first_cut=0, last_cut=1)  # type: ignore[arg-type]


def _inbound(m: int, rows: int = 2) -> dict[Message, Tensor]:
    torch.manual_seed(1)
    inbound = {Message(MessageKind.HEADER, 0): _header((rows, WIDTH)),
               Message(MessageKind.SUMMARY, 2): torch.arange(SUMMARY_SIZE, dtype=torch.float64)}
    for k in range(m):
        inbound[Message(MessageKind.ACTIVATION, 0, k)] = torch.randn(rows, WIDTH)
        inbound[Message(MessageKind.GRADIENT, 2, k)] = torch.randn(rows, WIDTH)
    return inbound


@pytest.mark.parametrize(("name", "recompute"), [("varuna", True), ("1f1b", False), ("gpipe", True)])
def test_a_middle_stage_computes_the_gradients_and_posts_each_link_in_plan_order(name: str, recompute: bool) -> None:
    m = 3
    model = LinearChain()
    p2p = FakeP2P(_inbound(m))
    executor = _middle_stage(p2p, model)
    log = executor.events.add(EventLog())
    schedule = make_schedule(name, 3, m, recompute=recompute)
    batch = torch.zeros(2 * m, WIDTH)
    executor.run(schedule, lambda k: model(batch[2 * k: 2 * k + 2]), [2] * m, (0, 0), train=True,
                 recompute=recompute, summary=lambda outputs: torch.zeros(1))
    # each link's ops are the plan's messages, in order; receives on the links in, sends on the links out
    plan = link_messages(schedule, summary=True)
    for (src, dst), messages in plan.items():
        if 1 in (src, dst):
            kind = "send" if src == 1 else "recv"
            assert [msg for k, link, msg in p2p.posted if link == f"{src}>{dst}"] == list(messages)
            assert {k for k, link, _ in p2p.posted if link == f"{src}>{dst}"} == {kind}
    # the gradients it sent are those of its segment, and so are its parameters' gradients
    layer = model.layers[1]
    for k in range(m):
        x = p2p.inbound[Message(MessageKind.ACTIVATION, 0, k)].clone().requires_grad_()
        out = layer(x)
        sent = p2p.sent[Message(MessageKind.ACTIVATION, 1, k)]
        torch.testing.assert_close(sent, out.detach())
        (grad_x,) = torch.autograd.grad(out, x, p2p.inbound[Message(MessageKind.GRADIENT, 2, k)])
        torch.testing.assert_close(p2p.sent[Message(MessageKind.GRADIENT, 1, k)], grad_x)
    grad_w = sum(p2p.inbound[Message(MessageKind.GRADIENT, 2, k)].T @ p2p.inbound[Message(MessageKind.ACTIVATION, 0, k)]
                 for k in range(m))
    torch.testing.assert_close(layer.weight.grad, grad_w)
    # the summary came from the next stage and went on to the previous one; the header went first
    torch.testing.assert_close(executor.summary, p2p.inbound[Message(MessageKind.SUMMARY, 2)])
    assert decode_header(p2p.sent[Message(MessageKind.HEADER, 1)]) == (torch.Size([2, WIDTH]), torch.float32)
    # the events saw every task once, in the order run
    started = [e.task for e in log.events if e.kind is EventKind.TASK_START]
    assert sorted(started) == sorted(schedule[1]) and p2p.closed == 1


def test_a_late_gradient_lets_the_next_forward_go_first_and_keeps_every_link_in_order() -> None:
    m = 4
    model = LinearChain()
    inbound = _inbound(m)
    p2p = FakeP2P(inbound)
    late = Message(MessageKind.GRADIENT, 2, 0)
    p2p.arrived.discard(late)
    executor = _middle_stage(p2p, model)
    executor.feed_next_stage = False
    counters = executor.events.add(StageCounters())
    schedule = make_schedule("varuna", 3, m, recompute=True)
    batch = torch.zeros(2 * m, WIDTH)
    # the gradient of micro-batch 0 arrives once the stage has run every forward it could run before it
    original = p2p.completed

    def completed(transfer) -> bool:
        if transfer.message == late and sum(t.kind is Kind.F for t in counters.executed) == m:
            p2p.arrived.add(late)
        return original(transfer)

    p2p.completed = completed  # type: ignore[method-assign]
    p2p.finished = completed  # type: ignore[method-assign]
    executor.run(schedule, lambda k: model(batch[2 * k: 2 * k + 2]), [2] * m, (0, 0), train=True, recompute=True)
    ran = counters.executed
    assert schedule[1].index(Task(Kind.R, 0)) < schedule[1].index(Task(Kind.F, 3))
    assert ran.index(Task(Kind.F, 3)) < ran.index(Task(Kind.R, 0)), ran
    assert counters.moves > 0
    assert counters.peak_live_graphs == 1 and counters.live_graphs == 0
    assert counters.peak_stash_bytes == m * 2 * WIDTH * 4 and counters.stash_bytes == 0
    assert [msg for _, link, msg in p2p.posted if link == "1>2"] == list(link_messages(schedule)[(1, 2)])
    assert [msg for _, link, msg in p2p.posted if link == "2>1"] == list(link_messages(schedule)[(2, 1)])


def test_an_activation_that_disagrees_with_the_steps_header_is_refused_before_it_is_posted() -> None:
    model = LinearChain()
    p2p = FakeP2P(_inbound(2))
    executor = _middle_stage(p2p, model)
    schedule = make_schedule("gpipe", 3, 2, recompute=False)
    batch = torch.zeros(4, WIDTH)

    # micro-batch 1's activation at the stage's last cut has 3 columns instead of 4 (after the header sent 4)
    model.layers[1].register_forward_hook(
        lambda module, args, out: out[:, :3] if executor.current.microbatch == 1 else out)
    with pytest.raises(PipelineError, match=r"Stage 1's output for micro-batch 1 has shape \(2, 3\).*agreed \(2, 4\)"):
        executor.run(schedule, lambda k: model(batch[2 * k: 2 * k + 2]), [2, 2], (0, 0), train=True,
                     recompute=False)
    assert Message(MessageKind.ACTIVATION, 1, 1) not in p2p.sent and Message(MessageKind.ACTIVATION, 1, 0) in p2p.sent
    assert p2p.closed == 1


def test_an_evaluation_step_on_the_last_stage_receives_in_order_and_returns_outputs() -> None:
    model = LinearChain()
    m = 3
    p2p = FakeP2P(_inbound(m))
    p2p.inbound[Message(MessageKind.HEADER, 1)] = p2p.inbound.pop(Message(MessageKind.HEADER, 0))
    for k in range(m):
        p2p.inbound[Message(MessageKind.ACTIVATION, 1, k)] = p2p.inbound[Message(MessageKind.ACTIVATION, 0, k)]
    p2p.arrived = set(p2p.inbound)
    topology = Topology(world_size=3, rank=2, pipeline_size=3, device=torch.device("cpu"))
    executor = StageExecutor(topology, p2p, list(model.cuts), first_cut=1, last_cut=None)  # type: ignore[arg-type]
    batch = torch.zeros(2 * m, WIDTH)
    outputs = executor.run(make_schedule("varuna", 3, m, recompute=True, train=False),
                           lambda k: model(batch[2 * k: 2 * k + 2]), [2] * m, (0, 0), train=False, recompute=True)
    assert [(kind, link, repr(msg)) for kind, link, msg in p2p.posted] == [
        ("recv", "1>2", "header@1"), *[("recv", "1>2", f"act {k}@1") for k in range(m)]
    ]
    for k in range(m):
        expected = model.layers[2](p2p.inbound[Message(MessageKind.ACTIVATION, 1, k)]).pow(2).mean()
        torch.testing.assert_close(outputs[k], expected)


def test_the_event_hook_is_off_without_recorders_and_fans_out_with_several() -> None:
    hooks = EventHooks()
    assert hooks.emit is None
    first, second = hooks.add(EventLog()), hooks.add(StageCounters())
    assert hooks.emit is not None
    hooks.remove(first)
    assert hooks.emit is second
    hooks.remove(second)
    assert hooks.emit is None


# -- a batch skipped before the model's forward -------------------------------------------------------------------
def _stage(p2p: FakeP2P, model: LinearChain, stages: int, rank: int) -> StageExecutor:
    # stage s of P (P <= 3) on rank s: it receives at cut s-1 and ends at cut s
    topology = Topology(world_size=stages, rank=rank, pipeline_size=stages, device=torch.device("cpu"))
    first, last = (rank - 1 if rank > 0 else None), (rank if rank < stages - 1 else None)
    return StageExecutor(topology, p2p, list(model.cuts), first_cut=first, last_cut=last)  # type: ignore[arg-type]


def _from_neighbours(rank: int, stages: int, m: int, skipped: bool, train: bool) -> dict[Message, Tensor]:
    """What the neighbours of ``rank`` send it in one step (the real shapes and dtypes, random values)."""
    inbound: dict[Message, Tensor] = {}
    if rank > 0:
        inbound[Message(MessageKind.HEADER, rank - 1)] = (
            encode_skip_header(torch.device("cpu")) if skipped else _header((2, WIDTH)))
        for k in range(0 if skipped else m):
            inbound[Message(MessageKind.ACTIVATION, rank - 1, k)] = torch.randn(2, WIDTH)
    if rank < stages - 1 and train:
        inbound[Message(MessageKind.SUMMARY, rank + 1)] = torch.zeros(SUMMARY_SIZE, dtype=torch.float64)
        for k in range(0 if skipped else m):
            inbound[Message(MessageKind.GRADIENT, rank + 1, k)] = torch.randn(2, WIDTH)
    return inbound


def _run_step(executor: StageExecutor, model: LinearChain, name: str, m: int, train: bool, recompute: bool,
              skip: object = ()) -> list:
    stages = executor.topology.pipeline_size
    batch = torch.zeros(2 * m, WIDTH)
    return executor.run(make_schedule(name, stages, m, recompute=recompute, train=train),
                        lambda k: None if k in skip else model(batch[2 * k: 2 * k + 2]), [2] * m, (0, 0),
                        train=train, recompute=recompute, loss_of=lambda out, k: out,
                        summary=lambda outputs: torch.zeros(1))


@pytest.mark.parametrize(("stages", "name", "recompute"),
                         [(2, "varuna", True), (3, "varuna", True), (3, "1f1b", False)])
def test_a_batch_skipped_before_the_forward_on_every_stage_passes_nccls_rules(
    tmp_path, stages: int, name: str, recompute: bool
) -> None:
    # each rank runs in-process against a fake p2p layer fed what its neighbours send; the ops every rank posted
    # are recorded as in the NCCL-rules mode and replayed together: a skipped step between two full ones, and a
    # skipped evaluation step
    m = 3
    steps = [(True, False), (True, True), (True, False), (False, True)]  # (train, skipped)
    for rank in range(stages):
        torch.manual_seed(rank)
        model, p2p = LinearChain(), FakeP2P({})
        executor = _stage(p2p, model, stages, rank)
        executor.events.add(P2PTraceWriter(tmp_path, "skips", rank, stages))
        for train, skipped in steps:
            p2p.inbound = _from_neighbours(rank, stages, m, skipped, train)
            p2p.arrived, p2p.posted = set(p2p.inbound), []
            outputs = _run_step(executor, model, name, m, train, recompute, skip=range(m) if skipped else ())
            if not skipped:
                continue
            # only the step's header and its summary travel; the header says the batch was skipped
            assert {message.kind for _, _, message in p2p.posted} <= {MessageKind.HEADER, MessageKind.SUMMARY}
            if rank < stages - 1:
                assert decode_header(p2p.sent[Message(MessageKind.HEADER, rank)]) is None
            else:
                assert outputs == [None] * m
    checked = check_trace_dir(tmp_path)
    per_edge = (2 * m + 2) + 2 + (2 * m + 2) + 1  # full step, skipped step (header, summary), full, skipped eval
    assert (checked.steps, checked.skipped, checked.transfers) == (len(steps), 0, (stages - 1) * per_edge)


def test_a_batch_skipped_for_some_micro_batches_or_on_some_stages_only_is_a_clear_error() -> None:
    m = 2
    # the first stage skips one micro-batch of the batch but not the other (either way round)
    for skip, first, then in [({1}, 1, 0), ({0}, 0, 1)]:
        model = LinearChain()
        p2p = FakeP2P(_from_neighbours(0, 3, m, skipped=False, train=True))
        with pytest.raises(CutPointError, match=f"micro-batch {first} but not for micro-batch {then} of the same"):
            _run_step(_stage(p2p, model, 3, 0), model, "varuna", m, True, True, skip=skip)
        assert p2p.closed == 1
    # a middle stage runs its forward on a batch the stage before it skipped; and skips one that stage ran
    model = LinearChain()
    p2p = FakeP2P(_from_neighbours(1, 3, m, skipped=True, train=True))
    with pytest.raises(CutPointError, match="Stage 0 skipped the batch before the model's forward, but stage 1 ran"):
        _run_step(_stage(p2p, model, 3, 1), model, "varuna", m, True, True)
    model = LinearChain()
    p2p = FakeP2P(_from_neighbours(1, 3, m, skipped=False, train=True))
    with pytest.raises(CutPointError, match="Stage 1's step returned None .* but stage 0 ran its forward"):
        _run_step(_stage(p2p, model, 3, 1), model, "varuna", m, True, True, skip=range(m))
    # neither waited for a message that never comes (the fake fails such a wait), nor posted a gradient's receive
    assert not any(message.kind is MessageKind.GRADIENT for _, _, message in p2p.posted)
