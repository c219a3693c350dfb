"""The runtime executor: runs one stage's task list of any schedule over torch.distributed p2p.

Receives are posted ahead (all of a step's activations once their shape is known, each gradient as soon as
the forward that it answers has been sent); sends are asynchronous and only waited for at the end of the
step. A recompute or backward whose gradient is late, or that would leave the next stage without work, lets
the next forward go first if its input is there (Varuna's opportunistic rule and ours,
:func:`~lightning_varuna.pipeline.schedules.next_task`): forwards keep their order, as do recomputes and backwards, so
message order holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_varuna.pipeline.cut import CutPoint, CutPointError, StageOutputReady, forward_handler
from lightning_varuna.pipeline.failures import PipelineError
from lightning_varuna.pipeline.p2p import HEADER_BYTES, P2P
from lightning_varuna.pipeline.schedules import Kind, Task, next_task
from lightning_varuna.pipeline.topology import Topology

__all__ = ["StageExecutor", "MemoryStats", "StepFunction"]

StepFunction = Callable[[int], Any]
"""Runs the user's step on micro-batch ``k`` and returns its output (on the last stage: the loss)."""
EventHook = Callable[[str, float, float, "int | None"], None]
"""Receives ``(kind, start, end, microbatch)`` (``time.perf_counter`` seconds): a task (``"F"``, ``"R"``, ``"B"``), a
``"wait"`` for a message inside a task, or a ``"send"`` from its posting to when the stage saw it done."""

_HEADER_TAG = 0
_SUMMARY_TAG = 2**30
SUMMARY_SIZE = 64
"""Float64 slots of the per-step summary the last stage sends back along the pipeline (losses, logs)."""


def _tag(kind: str, k: int) -> int:
    return 1 + 2 * k + (kind == "grad")


@dataclass
class MemoryStats:
    """Counters of what a stage holds, to check the memory promises of a schedule."""

    live_graphs: int = 0
    peak_live_graphs: int = 0
    stash_bytes: int = 0
    peak_stash_bytes: int = 0
    sent_bytes: int = 0
    """Bytes this stage has sent to its neighbours (activations, gradients, headers), all steps together."""

    def graph(self, delta: int) -> None:
        """Counts an autograd graph kept (+1) or released (-1)."""
        self.live_graphs += delta
        self.peak_live_graphs = max(self.peak_live_graphs, self.live_graphs)

    def stash(self, delta: int) -> None:
        """Counts bytes of stashed stage inputs kept (+) or released (-)."""
        self.stash_bytes += delta
        self.peak_stash_bytes = max(self.peak_stash_bytes, self.stash_bytes)


class _StageForward:
    """The cut point handler of one forward of one stage."""

    def __init__(self, cuts: Sequence[CutPoint], first: int | None, last: int | None, received: Tensor | None,
                 microbatch: int, recomputing: bool):
        self.microbatch = microbatch
        self.recomputing = recomputing
        self.cuts = cuts
        self.first = first
        self.last = last
        self.received = received
        self.segment = 0
        self.output: Tensor | None = None

    def on_cut(self, cut: CutPoint, x: Tensor) -> Tensor:
        index = self.segment
        if index >= len(self.cuts) or self.cuts[index] is not cut:
            seen = getattr(cut, "_varuna_name", None) or "a cut point the dry run did not see"
            expected = (
                f"the dry run saw {getattr(self.cuts[index], '_varuna_name', None) or 'another one'} there"
                if index < len(self.cuts) else f"the dry run saw only {len(self.cuts)} cut point(s)"
            )
            raise CutPointError(
                f"Cut point #{index} of this forward is {seen}, but {expected} (micro-batch {self.microbatch})."
                " Cut points must be reached in the same order in every forward (and each at most once); keep"
                " data-dependent control flow inside a segment."
            )
        self.segment = index + 1
        if index == self.first:
            return self.received  # type: ignore[return-value]
        if index == self.last:
            self.output = x
            raise StageOutputReady
        return x


class StageExecutor:
    """Runs the tasks of one stage for one step.

    Args:
        topology: Where this rank sits.
        p2p: The transport.
        cuts: The cut points in execution order.
        recompute: Whether non-last stages run forwards without autograd and recompute before backward.
    """

    def __init__(self, topology: Topology, p2p: P2P, cuts: Sequence[CutPoint], first_cut: int | None,
                 last_cut: int | None) -> None:
        self.topology = topology
        self.p2p = p2p
        self.cuts = cuts
        self.first_cut = first_cut
        self.last_cut = last_cut
        self.stats = MemoryStats()
        self.wire_dtype: torch.dtype | None = None
        """If set, floating-point activations and their gradients travel in this dtype."""
        self.input_dtype: torch.dtype | None = None
        """The dtype the model had at this stage's first cut (received activations are cast back to it)."""
        self.current: _StageForward | None = None
        self.opportunistic_moves = 0
        self.executed: list[Task] = []
        """The tasks of the last step, in the order they ran (the run-time rules may move forwards)."""
        self.feed_next_stage = True
        """Whether a forward also goes ahead of a recompute or backward while the next stage has run out of work
        (see :func:`~lightning_varuna.pipeline.schedules.next_task`); False keeps Varuna's rule alone."""
        self.summary: Tensor | None = None
        self.on_event: EventHook | None = None
        """If set, told what ran when (see :data:`EventHook`): for timelines; off by default."""
        self._pool: dict[tuple[str, int], Tensor] = {}

    def _finished(self, work: dist.Work, tensor: Tensor, peer: int, sent: Callable[[dist.Work], None]) -> bool:
        """Whether a send is done (its errors, if any, are raised here); ``sent`` is told if so."""
        if not work.is_completed():
            return False
        self.p2p.wait(work, "sending", peer)
        sent(work)
        return True

    # -- state visible to stand-ins -------------------------------------------------------------------------
    def segment(self) -> int:
        """The segment the running forward is in (the stage's first segment when none is running)."""
        if self.current is None:
            return 0 if self.first_cut is None else self.first_cut + 1
        return self.current.segment

    # -- buffers ------------------------------------------------------------------------------------------
    def _buffer(self, kind: str, k: int, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        """A receive buffer, reused across steps while its shape stays the same."""
        buffer = self._pool.get((kind, k))
        if buffer is None or buffer.shape != shape or buffer.dtype != dtype:
            buffer = torch.empty(shape, dtype=dtype, device=self.topology.device)
            self._pool[(kind, k)] = buffer
        return buffer

    # -- one step -----------------------------------------------------------------------------------------
    def run(
        self,
        tasks: Sequence[Task],
        step: StepFunction,
        sizes: Sequence[int],
        batch_dims: tuple[int | None, int | None],
        train: bool,
        recompute: bool,
        loss_of: Callable[[Any, int], Tensor] | None = None,
        summary: Callable[[list[Any]], Tensor] | None = None,
        last_backward: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> list[Any]:
        """Runs ``tasks`` and returns, on the last stage, each micro-batch's step output (detached).

        With ``summary`` (training only), the last stage turns the step's outputs into at most
        :data:`SUMMARY_SIZE` float64 values after its schedule, and they travel back stage by stage behind the
        last gradient: every stage finds them in :attr:`summary` when ``run`` returns, with no collective.

        Args:
            tasks: This stage's task list.
            step: Runs the user's step on micro-batch ``k``.
            sizes: The batch size of each micro-batch (the same on every stage).
            batch_dims: Which dimension of the received and of the sent activation scales with the batch.
            train: Whether backward tasks run.
            recompute: Whether forwards of a non-last stage run without autograd (train only).
            loss_of: On the last stage, turns step output ``k`` into the scalar to differentiate (already
                weighted).
            summary: On the last stage, turns the outputs into at most :data:`SUMMARY_SIZE` float64 values
                that every stage receives (training only).
            last_backward: A context manager factory that this stage's last backward task of the step runs in
                (the backward and the posting of its input-gradient send), e.g.
                :meth:`GradientSync.overlapping <lightning_varuna.pipeline.grad_sync.GradientSync.overlapping>`.
        """
        topo = self.topology
        m = len(sizes)
        prev_rank = topo.rank_of(topo.stage - 1) if not topo.is_first else None
        next_rank = topo.rank_of(topo.stage + 1) if not topo.is_last else None
        no_grad_forward = (not train) or (recompute and not topo.is_last)
        # only a stage whose forwards stash asks whether a message has arrived (next_task); every stage frees
        # what it sent as the sends finish (watched sends)
        asks_arrival = train and no_grad_forward

        inputs: list[Tensor | None] = [None] * m
        input_works: list[dist.Work | None] = [None] * m
        outputs: list[Any] = [None] * m
        grads: list[Tensor | None] = [None] * m
        grad_works: list[dist.Work | None] = [None] * m
        rng: list[Any] = [None] * m
        sends: list[tuple[dist.Work, Tensor, int]] = []
        results: list[Any] = [None] * m
        input_shape: list[torch.Size] | None = None
        posted: dict[int, tuple[float, int | None]] = {}  # with a hook: each send's posting time and micro-batch

        def post_input_receives() -> None:
            nonlocal input_shape
            shape, dtype = self.p2p.recv_header(prev_rank, _HEADER_TAG)
            shapes = [_resize(shape, batch_dims[0], sizes[0], n) for n in sizes]
            for k in range(m):
                inputs[k] = self._buffer("act", k, shapes[k], dtype)
                input_works[k] = self.p2p.irecv(inputs[k], prev_rank, _tag("act", k), watch=asks_arrival)
            input_shape = shapes

        def input_ready(k: int) -> bool:
            if prev_rank is None:
                return True
            if input_shape is None:
                return False
            return input_works[k].is_completed()  # type: ignore[union-attr]

        def arrived(task: Task) -> bool:  # for next_task: is the message ``task`` waits for here?
            if task.kind is Kind.F:
                return input_ready(task.microbatch)
            work = grad_works[task.microbatch]
            return work is None or work.is_completed()

        def forward(k: int, with_grad: bool, recomputing: bool = False) -> Any:
            received = None
            if prev_rank is not None:
                if input_shape is None:
                    post_input_receives()
                work = input_works[k]
                if work is not None:
                    timed_wait(work, f"receiving the activation of micro-batch {k}", prev_rank, k)
                    input_works[k] = None
                received = inputs[k]
                received.requires_grad_(with_grad)  # type: ignore[union-attr]
                if self.input_dtype is not None and received.dtype != self.input_dtype:  # type: ignore[union-attr]
                    received = received.to(self.input_dtype)  # type: ignore[union-attr]
            handler = _StageForward(self.cuts, self.first_cut, self.last_cut, received, k, recomputing)
            self.current = handler
            try:
                with forward_handler(handler), torch.set_grad_enabled(with_grad):
                    try:
                        out = step(k)
                    except StageOutputReady:
                        out = handler.output
                    else:
                        if next_rank is not None:
                            raise CutPointError(
                                f"Stage {topo.stage}'s forward finished without reaching cut point"
                                f" #{self.last_cut}, where the stage ends. Cut points must run in every forward."
                            )
            finally:
                self.current = None
            return out

        hook = self.on_event

        def timed_wait(work: dist.Work, what: str, peer: int, k: int) -> None:
            if hook is None:
                self.p2p.wait(work, what, peer)
                return
            start = time.perf_counter()
            self.p2p.wait(work, what, peer)
            hook("wait", start, time.perf_counter(), k)

        def send(tensor: Tensor, dst: int, tag: int, k: int | None = None) -> None:
            sends.append((self.p2p.isend(tensor, dst, tag, watch=True), tensor, dst))
            self.stats.sent_bytes += tensor.numel() * tensor.element_size()
            if hook is not None:
                posted[id(sends[-1][0])] = (time.perf_counter(), k)

        def sent(work: dist.Work) -> None:
            if hook is not None and id(work) in posted:
                start, k = posted.pop(id(work))
                hook("send", start, time.perf_counter(), k)

        def send_output(k: int, out: Tensor) -> None:
            out = out.detach()
            if self.wire_dtype is not None and out.is_floating_point() and out.dtype != self.wire_dtype:
                out = out.to(self.wire_dtype)
            out = out.contiguous()
            if k == 0:
                sends.append((self.p2p.send_header(out, next_rank, _HEADER_TAG), out, next_rank))
                self.stats.sent_bytes += HEADER_BYTES
            send(out, next_rank, _tag("act", k), k)

        def run_forward(k: int) -> None:
            if train and recompute and not topo.is_last:
                rng[k] = _rng_state(topo.device)
            out = forward(k, with_grad=not no_grad_forward)
            if next_rank is not None:
                if not isinstance(out, Tensor):
                    raise CutPointError("A stage output must be a tensor.")
                send_output(k, out)
                if train:
                    wire = self.wire_dtype if self.wire_dtype is not None and out.is_floating_point() else out.dtype
                    buffer = self._buffer("grad", k, out.shape, wire)
                    grads[k] = buffer
                    grad_works[k] = self.p2p.irecv(buffer, next_rank, _tag("grad", k), watch=asks_arrival)
            if train and not no_grad_forward:
                outputs[k] = out
                self.stats.graph(+1)
            if prev_rank is not None and train and recompute and next_rank is not None:
                self.stats.stash(inputs[k].numel() * inputs[k].element_size())  # type: ignore[union-attr]
            if next_rank is None:
                results[k] = out
            if not train and prev_rank is not None:
                inputs[k] = None

        def run_recompute(k: int) -> None:
            with torch.random.fork_rng(devices=_rng_devices(topo.device)):
                _set_rng_state(topo.device, rng[k])
                outputs[k] = forward(k, with_grad=True, recomputing=True)
            rng[k] = None
            self.stats.graph(+1)

        def run_backward(k: int) -> None:
            if next_rank is None:
                torch.autograd.backward(loss_of(results[k], k))  # type: ignore[misc]
            else:
                work = grad_works[k]
                if work is not None:
                    timed_wait(work, f"receiving the gradient of micro-batch {k}", next_rank, k)
                    grad_works[k] = None
                grad = grads[k]
                if grad.dtype != outputs[k].dtype:  # type: ignore[union-attr]
                    grad = grad.to(outputs[k].dtype)  # type: ignore[union-attr]
                torch.autograd.backward(outputs[k], grad_tensors=grad)
            outputs[k] = None
            self.stats.graph(-1)
            if prev_rank is not None:
                received = inputs[k]
                grad = received.grad if received.grad is not None else torch.zeros_like(received)  # type: ignore[union-attr]
                received.grad = None  # type: ignore[union-attr]
                send(grad, prev_rank, _tag("grad", k), k)
                if recompute and next_rank is not None:
                    self.stats.stash(-(received.numel() * received.element_size()))  # type: ignore[union-attr]
                inputs[k] = None

        summary_buffer = None
        if summary is not None and train:
            summary_buffer = self._buffer("summary", 0, torch.Size([SUMMARY_SIZE]), torch.float64)
            summary_work = self.p2p.irecv(summary_buffer, next_rank, _SUMMARY_TAG) if next_rank is not None else None

        last_b = next((t.microbatch for t in reversed(tasks) if t.kind is Kind.B), None) if train else None
        pending = list(tasks)
        self.executed = []
        completed = False
        try:
            while pending:
                index = next_task(pending, arrived, no_grad_forward, self.feed_next_stage) if train else 0
                task = pending.pop(index)
                self.executed.append(task)
                self.opportunistic_moves += index > 0
                started = time.perf_counter() if hook is not None else 0.0
                if task.kind is Kind.F:
                    run_forward(task.microbatch)
                elif task.kind is Kind.R:
                    run_recompute(task.microbatch)
                elif task.microbatch == last_b and last_backward is not None:
                    with last_backward():
                        run_backward(task.microbatch)
                else:
                    run_backward(task.microbatch)
                if hook is not None:
                    hook(task.kind.value, started, time.perf_counter(), task.microbatch)
                if sends:  # let go of tensors whose send is done, so memory follows the schedule
                    sends[:] = [entry for entry in sends if not self._finished(*entry, sent)]
            if summary_buffer is not None:
                if next_rank is None:
                    values = summary(results)  # type: ignore[misc]
                    summary_buffer.zero_()
                    summary_buffer[: values.numel()].copy_(values)
                else:
                    self.p2p.wait(summary_work, "receiving the step summary", next_rank)
                if prev_rank is not None:
                    send(summary_buffer, prev_rank, _SUMMARY_TAG)
                self.summary = summary_buffer
            for work, _, peer in sends:
                self.p2p.wait(work, "sending", peer)
                sent(work)
            completed = True
        finally:
            self.current = None
            self.p2p.close(join=completed)
        if next_rank is None:
            return [r.detach() if isinstance(r, Tensor) else r for r in results]
        return results


def _resize(shape: torch.Size, dim: int | None, reference: int, size: int) -> torch.Size:
    if dim is None or size == reference:
        return shape
    if shape[dim] % reference:
        raise PipelineError(f"Activation shape {tuple(shape)} does not scale with micro-batch size {reference}.")
    dims = list(shape)
    dims[dim] = shape[dim] // reference * size
    return torch.Size(dims)


def _rng_devices(device: torch.device) -> list:
    return [device] if device.type == "cuda" else []


def _rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(device: torch.device, state: tuple[Tensor, Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
