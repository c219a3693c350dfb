"""One step of one stage: its tasks (forward, recompute, backward) and its transfers, posted in message order.

:class:`StageStep` holds everything a step of a stage owns (received inputs, outputs kept for backward, RNG
states for recompute, held-back weight gradients, the transfers in flight) and has one method per
action: computation (forward, recompute, backward or its input and weight parts) and communication (inputs,
gradients, summary).

Transfers follow the step's message order (:mod:`~lightning_varuna.pipeline.scheduling.lowering`), posted by the step's
inboxes and outboxes (:mod:`~lightning_varuna.pipeline.runtime.links`): receives strictly in each link's order as soon
as each message's shape is known (the header at the step's start; every activation once the header has arrived; a
gradient once the activation it answers has been sent; the summary behind the last gradient), so that the run-time rules
can ask whether a message is there; sends only in the link's order. A link carries one direction only, so a receive
posted early never holds up a send. Every activation is checked against the shape agreed for the step (the header sent
with the first one) before it is posted.

A step whose batch is skipped before the model's forward (the user's step returned None before reaching a cut
point, for every micro-batch and on every stage alike) sends a skip header in place of the first activation's
header; the activations and gradients of the step are then dropped from every link's messages on both sides, and only
the summary still travels.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any, cast

import torch
from torch import Tensor

from lightning_varuna.failstop.failures import PipelineError
from lightning_varuna.pipeline.comm.events import Event, EventKind
from lightning_varuna.pipeline.comm.transfers import HEADER_SIZE, Transfer, decode_header, encode_header
from lightning_varuna.pipeline.model.cut import CutPointError, StageForward, StageOutputReady, forward_handler
from lightning_varuna.pipeline.runtime.fused_linear_grad import (
    PendingWeightGrads,
    WeightGradWork,
    accumulating_in_place,
    holding_weight_grads,
)
from lightning_varuna.pipeline.runtime.links import Boxes, Chunk, Spec, StageContext, StageLinks, nbytes, scaled_shape
from lightning_varuna.pipeline.runtime.recompute import backward_recomputed, rng_devices, rng_state, set_rng_state
from lightning_varuna.pipeline.runtime.selective_recompute import SavedOps, stage_ops
from lightning_varuna.pipeline.runtime.side_values import StageSides
from lightning_varuna.pipeline.runtime.skipped_batches import check_skipped_alike
from lightning_varuna.pipeline.scheduling.lowering import Message, MessageKind
from lightning_varuna.pipeline.scheduling.run_time_rules import next_task
from lightning_varuna.pipeline.scheduling.tasks import Kind, Task

__all__ = ["SUMMARY_SIZE", "StageContext", "StageStep"]

SUMMARY_SIZE = 64
"""Float64 slots of the per-step summary the last stage sends back along the pipeline (losses, logs)."""

SKIPPED = object()
"""What a forward returns whose step returned None before reaching a cut point (a skipped batch)."""


class StageStep:
    """Runs one stage's task list for one step (see the module docstring).

    Args:
        executor: The stage's executor (cut points, buffers, dtypes, the event hook).
        links: This stage's part of the step's message order (None with ``boxes``).
        tasks: This stage's task list.
        step: Runs the user's step on micro-batch ``k``.
        sizes: The batch size of each micro-batch.
        batch_dims: Which dimension of the received and of the sent activation scales with the batch (None: the
            chunk's).
        train: Whether backward tasks run.
        recompute: Whether forwards of a non-last stage run without autograd (train only).
        loss_of: On the last stage, turns step output ``k`` into the scalar to differentiate.
        summary: On the last stage, turns the outputs into at most :data:`SUMMARY_SIZE` float64 values.
        last_backward: A context manager factory for this stage's last backward task of the step (for a split
            backward: from the start of the last ``I`` to the end of the last ``W``; it is given ``held_back``, the
            parameters whose gradients still wait for ``W`` tasks, and yields a function to call with the
            parameters each ``W`` completes).
        chunk: The stage this step runs (default: the executor's only one).
        boxes: The rank's inboxes and outboxes, when the rank runs several stages
            (:class:`~lightning_varuna.pipeline.runtime.rank_step.RankStep` drives the step then).
    """

    def __init__(
        self, executor: StageContext, links: StageLinks | None, tasks: Sequence[Task], step: Callable[[int], Any],
        sizes: Sequence[int], batch_dims: tuple[int | None, int | None] | None, train: bool, recompute: bool,
        loss_of: Callable[[Any, int], Tensor] | None, summary: Callable[[list[Any]], Tensor] | None,
        last_backward: Callable[..., AbstractContextManager[Any]] | None, chunk: Chunk | None = None,
        boxes: Boxes | None = None,
    ) -> None:
        topo = executor.topology
        self.chunk = chunk = chunk if chunk is not None else executor.chunks[0]
        self.executor, self.p2p, self.device, self.stage = executor, executor.p2p, topo.device, chunk.stage
        self.tasks, self.step, self.sizes = tasks, step, sizes
        self.batch_dims = batch_dims if batch_dims is not None else chunk.batch_dims
        self.train, self.with_recompute, self.loss_of, self.summary = train, recompute, loss_of, summary
        self.last_backward = last_backward
        if boxes is None:
            assert links is not None
            # only a stage whose forwards stash asks whether a message has arrived (next_task)
            watch = train and recompute and links.next is not None
            boxes = Boxes.of_stage(self.p2p, topo.rank, links, watch, self._spec, self._buffer)
        self.prev, self.next = boxes.prev, boxes.next
        self.no_grad_forward = (not train) or (recompute and self.next is not None)
        self.stashes = train and recompute and self.prev is not None and self.next is not None
        self.grad_from = chunk.grad_from if train and recompute and self.next is not None else None
        self.policy = executor.recompute_policy if train and self.no_grad_forward and self.grad_from is None else None
        self.forwards_add_no_graph = self.no_grad_forward and self.grad_from is None and self.policy is None
        self.emit = executor.events.emit
        m = len(sizes)
        self.inputs: list[Tensor | None] = [None] * m
        self.outputs: list[Any] = [None] * m
        self.rng: list[Any] = [None] * m
        self.results: list[Any] = [None] * m
        # recompute by degree: each forward's activation at grad_from (a leaf), and its recomputed value
        self.boundaries: list[Tensor | None] = [None] * m
        self.recomputed: list[Tensor | None] = [None] * m
        self.saved_ops: list[SavedOps | None] = [None] * m  # what each forward kept for R (none moves ahead then)
        # the side values carried with the activations (None: none)
        kept = chunk.sides_kept if self.grad_from is not None else ()  # made and used on the stage by degree
        self.sides = StageSides(chunk, sizes, train, executor.boundary_dtype, kept) \
            if chunk.sides_in or chunk.sides_out or kept else None
        self.held_back = PendingWeightGrads()
        self.weight_work: list[WeightGradWork | None] = [None] * m
        self.last_region = ExitStack()
        """Open from the start of the step's last ``I`` to the end of its last ``W`` (split backward only)."""
        self.release: Callable[[Sequence[Any]], None] | None = None
        self.input_specs: list[Spec] | None = None
        """The shapes of this step's received activations, from the header (None until it has arrived)."""
        self.output_specs: list[Spec] | None = None
        """The shapes agreed for this step's sent activations (from the header this stage sent)."""
        self.sent_specs: list[Spec | None] = [None] * m
        self.sends: list[Transfer] = boxes.sends
        self.skipped = [False] * m
        """Micro-batches whose step returned None before the model's forward."""
        self.skip_mode: bool | None = None
        """Whether this step's batch is skipped before the forward (None until the first forward tells)."""
        self.upstream_skipped = False
        """Whether the previous stage's header said it skipped the batch."""
        self.from_prev, self.from_next = boxes.from_prev, boxes.from_next
        self.to_prev, self.to_next = boxes.to_prev, boxes.to_next

    # -- the step -------------------------------------------------------------------------------------------
    def run(self) -> list[Any]:
        """Runs the tasks (the run-time rules may move forwards ahead), passes the summary on, waits for sends."""
        emit = self.emit
        if emit is not None:
            emit(Event(EventKind.STEP_START, time.perf_counter(), train=self.train, microbatches=len(self.sizes)))
        for inbox in (self.from_prev, self.from_next):
            if inbox is not None:
                inbox.advance()
        last_b = next((t for t in reversed(self.tasks) if t.kind in (Kind.B, Kind.I)), None) if self.train else None
        last_w = next((t.microbatch for t in reversed(self.tasks) if t.kind is Kind.W), None)
        pending = list(self.tasks)
        completed = False
        try:
            while pending:
                index = next_task(pending, self.arrived, self.forwards_add_no_graph, self.executor.feed_next_stage) \
                    if self.train else 0
                task = pending.pop(index)
                if emit is not None:
                    emit(Event(EventKind.TASK_START, time.perf_counter(), task=task, moved=index > 0))
                graphs, stash = self.run_task(task, last_b, last_w)
                if emit is not None:
                    emit(Event(EventKind.TASK_END, time.perf_counter(), task=task, graphs=graphs, stash_bytes=stash))
                if self.sends:  # let go of tensors whose send is done, so memory follows the schedule
                    self.sends[:] = [t for t in self.sends if not self.p2p.finished(t)]
            if self.summary is not None:
                self.pass_summary()
            self.finish()
            completed = True
        finally:
            self.last_region.close()
            self.executor.current = None
            self.p2p.close(join=completed)
        if emit is not None:
            emit(Event(EventKind.STEP_END, time.perf_counter()))
        if self.next is None:
            return [r.detach() if isinstance(r, Tensor) else r for r in self.results]
        return self.results

    def run_task(self, task: Task, last_b: Task | None, last_w: int | None) -> tuple[int, int]:
        """Runs one task; returns the autograd graphs and stashed bytes it left held (+) or released (-).

        ``last_b`` is the step's last ``B`` or ``I`` task, ``last_w`` the micro-batch of its last ``W``.
        """
        k = task.microbatch
        if task.kind is Kind.F:
            return self.forward(k)
        if task.kind is Kind.R:
            return self.recompute(k)
        if task.kind is Kind.W:
            try:
                return self.weight_grad(k)
            finally:
                if k == last_w:
                    self.last_region.close()
        region = self.last_backward if task == last_b else None
        if task.kind is Kind.B:
            with region() if region is not None else nullcontext():
                return self.backward(k)
        if region is not None:
            self.release = self.last_region.enter_context(region(held_back=self.held_back))
        return self.input_grad(k)

    def arrived(self, task: Task) -> bool:
        """Whether the message ``task`` waits for is here (asked by the run-time rules)."""
        k = task.microbatch
        if self.skip_mode:
            return True
        if task.kind is Kind.F:
            if self.from_prev is None or self.inputs[k] is not None:
                return True
            if not self.input_shapes_known(wait=False):
                return False
            return self.upstream_skipped or self.from_prev.arrived(self._activation_in(k))
        return self.from_next is None or self.from_next.arrived(Message(MessageKind.GRADIENT, self.stage + 1, k))

    def finish(self) -> None:
        """Waits for this step's sends; checks that every message of the message order went and came."""
        for transfer in self.sends:
            self.p2p.wait(transfer, f"sending {transfer.message!r}")
        self.sends.clear()
        for box in (self.from_prev, self.from_next, self.to_prev, self.to_next):
            if box is not None:
                box.check_complete(self.stage)

    # -- tasks ----------------------------------------------------------------------------------------------
    def forward(self, k: int) -> tuple[int, int]:
        """``F(k)``: the stage's forward on micro-batch ``k``; sends its output to the next stage."""
        train = self.train
        if train and self.with_recompute and self.next is not None:
            self.rng[k] = rng_state(self.device)
        saved = self.saved_ops[k] = SavedOps(self.policy) if self.policy is not None else None
        out = self._stage_forward(k, with_grad=not self.no_grad_forward, saved=saved)
        if out is SKIPPED:  # on every stage alike: no message of this micro-batch, no recompute, no backward
            self.skipped[k] = True
            self.rng[k] = self.saved_ops[k] = None
            return 0, 0
        if self.next is not None:
            if not isinstance(out, Tensor):
                raise CutPointError("A stage output must be a tensor.")
            self.send_output(k, out)
        graphs = stash = 0
        if train and (not self.no_grad_forward or self.grad_from is not None):
            self.outputs[k] = out
            graphs = 1
        if self.stashes:
            stash = nbytes(self.inputs[k])
        if self.next is None:
            self.results[k] = out
        if not train and self.prev is not None:
            self.inputs[k] = None
        if not train and self.sides is not None:
            self.sides.release(k)
        return graphs, stash

    def recompute(self, k: int) -> tuple[int, int]:
        """``R(k)``: the forward again, with autograd and the RNG state of ``F(k)``."""
        if self.skipped[k]:
            return 0, 0
        with torch.random.fork_rng(devices=rng_devices(self.device)):  # R takes (and so frees) what F saved
            set_rng_state(self.device, self.rng[k])
            out = self._stage_forward(k, with_grad=True, recomputing=True, saved=self.saved_ops[k])
        if self.grad_from is None:
            self.outputs[k] = out
        else:
            self.recomputed[k] = out
        self.rng[k] = None
        return 1, 0

    def backward(self, k: int) -> tuple[int, int]:
        """``B(k)``: backward of the loss (last stage) or of the output with the received gradient."""
        return self._backward(k, nullcontext())

    def input_grad(self, k: int) -> tuple[int, int]:
        """``I(k)``: ``B(k)`` with linear layers' weight gradients held back for ``W(k)``."""
        if self.skipped[k]:
            return 0, 0
        work = self.weight_work[k] = WeightGradWork(self.held_back)
        return self._backward(k, holding_weight_grads(work))

    def weight_grad(self, k: int) -> tuple[int, int]:
        """``W(k)``: the weight gradients ``I(k)`` held back, added into ``.grad``."""
        work = self.weight_work[k]
        if work is None:  # a skipped micro-batch
            return 0, 0
        self.weight_work[k] = None
        final = work.run()
        if self.release is not None:
            self.release(final)
        return 0, 0

    def _backward(self, k: int, holding: AbstractContextManager[Any]) -> tuple[int, int]:
        """The backward of micro-batch ``k`` inside ``holding``; sends the input's gradient back."""
        if self.skipped[k]:
            return 0, 0
        if self.next is None:
            if self.results[k] is not None:  # else skipped after the loss: a zero gradient goes back
                with accumulating_in_place(), holding:
                    assert self.loss_of is not None  # the last stage is given one
                    torch.autograd.backward(self.loss_of(self.results[k], k))
        else:
            grad = self.receive_grad(k)
            output = self.outputs[k]
            # the side values sent with the output too (roots and gradients, then those of the recomputed part)
            grad, roots, grads, recomputed_roots, recomputed_grads, kept = \
                self.sides.backward_roots(k, grad, self.grad_from is not None) if self.sides is not None \
                else (grad, [], [], [], [], [])
            with accumulating_in_place(), holding:
                torch.autograd.backward([output, *roots],
                                        [grad if grad.dtype == output.dtype else grad.to(output.dtype), *grads])
                if self.grad_from is not None:  # then through the recomputed first segments
                    boundary, recomputed = self.boundaries[k], self.recomputed[k]
                    assert boundary is not None and recomputed is not None  # the forward kept both
                    backward_recomputed(boundary, recomputed, recomputed_roots, recomputed_grads, kept)
                    self.boundaries[k] = self.recomputed[k] = None
        self.outputs[k] = None
        stash = 0
        if self.prev is not None:
            received = self.inputs[k]
            assert received is not None
            grad = received.grad if received.grad is not None else torch.zeros_like(received)
            received.grad = None
            self.send_input_grad(k, grad)
            if self.stashes:
                stash = -nbytes(received)
            self.inputs[k] = None
        if self.sides is not None:
            self.sides.release(k)
        return -1 if self.grad_from is None else -2, stash

    def _stage_forward(self, k: int, with_grad: bool, recomputing: bool = False, saved: SavedOps | None = None) -> Any:
        """The step's output; :data:`SKIPPED` if it returned None before reaching a cut point.

        Recomputed by degree, a forward turns autograd on at ``grad_from`` and a recompute ends there. ``saved``: a
        selective recompute's outputs, kept by a forward and taken by its recompute (from the stage's input on).
        """
        executor = self.executor
        receive = fetch = (lambda: self._forward_input(k, with_grad)) if self.prev is not None else None
        ops, fetch = stage_ops(saved, recomputing, self.stage, k, fetch)
        chunk = self.chunk
        partial = self.grad_from is not None
        handler = StageForward(executor.cuts, chunk.first_cut, self.grad_from if partial and recomputing else
                               chunk.last_cut, fetch, k, recomputing, None if recomputing else self.grad_from)
        executor.current = handler
        try:
            with forward_handler(handler), torch.set_grad_enabled(with_grad), (
                    self.sides.forward(k, recomputing, executor.segment, lambda: handler.segment, receive)
                    if self.sides is not None else nullcontext()), ops:
                try:
                    out = self.step(k)
                except StageOutputReady:
                    out = handler.output
                else:
                    if out is None and handler.segment == 0:
                        check_skipped_alike(self, k, True)
                        return SKIPPED
                    if self.next is not None:
                        raise CutPointError(
                            f"Stage {self.stage}'s forward finished without reaching cut point"
                            f" #{chunk.last_cut}, where the stage ends. Cut points must run in every forward; a"
                            " step may return None (to skip its batch) only before the model's forward or after"
                            " the loss."
                        )
        finally:
            executor.current = None
        check_skipped_alike(self, k, False)
        if partial and not recomputing and self.train:
            self.boundaries[k] = handler.boundary
        return out

    def _forward_input(self, k: int, with_grad: bool) -> Tensor:
        """The received activation as the stage's forward takes it at its first cut point."""
        check_skipped_alike(self, k, False)  # checked before waiting: a stage that skipped sends nothing
        received = self.receive_input(k)
        received.requires_grad_(with_grad)
        input_dtype = self.chunk.input_dtype
        if input_dtype is not None and received.dtype != input_dtype:
            received = received.to(input_dtype)
        return received

    # -- communication --------------------------------------------------------------------------------------
    def receive_input(self, k: int) -> Tensor:
        """The activation of micro-batch ``k`` from the previous stage (waits for it the first time)."""
        received = self.inputs[k]
        if received is None:
            self.input_shapes_known(wait=True)
            if self.upstream_skipped:
                raise CutPointError(
                    f"Stage {self.stage - 1} skipped the batch before the model's forward, but stage {self.stage}"
                    " ran its forward on it: every stage must decide alike whether to skip a batch."
                )
            assert self.from_prev is not None
            received = self.from_prev.take(self._activation_in(k),
                                           f"receiving the activation of micro-batch {k}")
            if self.sides is not None:
                received = self.sides.unpack_input(k, received)
            self.inputs[k] = received
        return received

    def send_output(self, k: int, out: Tensor) -> None:
        """Sends this stage's output of micro-batch ``k`` (the step's header first), checked against the header."""
        wire = self.executor.boundary_dtype
        out = out.detach()
        if wire is not None and out.is_floating_point() and out.dtype != wire:
            out = out.to(wire)
        out = out.contiguous()
        outbox = self.to_next
        assert outbox is not None
        sides = self.sides
        if self.output_specs is None:
            header = encode_header(out) if sides is None else sides.header(out, k, self.batch_dims[1])
            outbox.send(Message(MessageKind.HEADER, self.stage), header, self.stage)
            shapes = [scaled_shape(out.shape, self.batch_dims[1], self.sizes[k], n) for n in self.sizes]
            self.output_specs = [(shape, out.dtype) for shape in shapes]
        shape, dtype = self.output_specs[k]
        if out.shape != shape or out.dtype != dtype:
            raise PipelineError(
                f"Stage {self.stage}'s output for micro-batch {k} has shape {tuple(out.shape)} ({out.dtype}), but"
                f" this step's header agreed {tuple(shape)} ({dtype}) with the next stage: the activation at a cut"
                " point may differ between the micro-batches of a step in its batch dimension only."
            )
        outbox.send(Message(MessageKind.ACTIVATION, self.stage, k),
                    out if sides is None else sides.pack_output(k, out), self.stage)
        if self.train:
            self.sent_specs[k] = (out.shape, out.dtype) if sides is None else sides.grad_spec(k)
            assert self.from_next is not None
            self.from_next.advance()  # the gradient's receive can be posted now

    def receive_grad(self, k: int) -> Tensor:
        """The gradient of this stage's output of micro-batch ``k``, from the next stage."""
        assert self.from_next is not None
        return self.from_next.take(Message(MessageKind.GRADIENT, self.stage + 1, k),
                                   f"receiving the gradient of micro-batch {k}")

    def send_input_grad(self, k: int, grad: Tensor) -> None:
        """Sends the gradient of this stage's input of micro-batch ``k`` to the previous stage."""
        received = self.inputs[k]
        assert received is not None and self.to_prev is not None
        if grad.shape != received.shape or grad.dtype != received.dtype:
            raise PipelineError(
                f"Stage {self.stage}'s input gradient for micro-batch {k} has shape {tuple(grad.shape)}"
                f" ({grad.dtype}), but the activation it answers had {tuple(received.shape)} ({received.dtype})."
            )
        if self.sides is not None:
            grad = self.sides.pack_input_grad(k, grad)
        self.to_prev.send(Message(MessageKind.GRADIENT, self.stage, k), grad, self.stage)

    def pass_summary(self) -> None:
        """Passes the step summary on: made on the last stage, received from the next stage on the others."""
        if self.from_next is None:
            assert self.summary is not None  # the last stage is given one
            values = self.summary(self.results)
            buffer = self.executor.buffer("summary", 0, torch.Size([SUMMARY_SIZE]), torch.float64)
            buffer.zero_()
            buffer[: values.numel()].copy_(values)
        else:
            buffer = self.from_next.take(Message(MessageKind.SUMMARY, self.stage + 1), "receiving the step summary")
        if self.to_prev is not None:
            self.to_prev.send(Message(MessageKind.SUMMARY, self.stage), buffer, self.stage)
        self.executor.summary = buffer

    # -- shapes and buffers ---------------------------------------------------------------------------------
    def _activation_in(self, k: int) -> Message:
        return Message(MessageKind.ACTIVATION, self.stage - 1, k)

    def input_shapes_known(self, wait: bool) -> bool:
        """Whether this step's input shapes are known: reads the header once it is here (waits for it if asked)."""
        if self.input_specs is not None or self.upstream_skipped:
            return True
        inbox = self.from_prev
        assert inbox is not None
        header = Message(MessageKind.HEADER, self.stage - 1)
        if not wait and not inbox.arrived(header):
            return False
        raw = inbox.take(header, "receiving the activation header")
        decoded = decode_header(raw)
        if decoded is None:
            self.upstream_skipped = True
            return True
        shape, dtype = decoded
        shapes = [scaled_shape(shape, self.batch_dims[0], self.sizes[0], n) for n in self.sizes]
        self.input_specs = [(s, dtype) for s in shapes] if self.sides is None else \
            self.sides.input_specs(raw, self.batch_dims[0])
        inbox.advance()  # every activation's receive can be posted now
        return True

    def _spec(self, message: Message) -> Spec | None:
        kind, k = message.kind, cast(int, message.microbatch)  # activations and gradients name their micro-batch
        if kind is MessageKind.ACTIVATION:
            return self.input_specs[k] if self.input_specs is not None else None
        if kind is MessageKind.GRADIENT:
            return self.sent_specs[k]
        if kind is MessageKind.HEADER:
            return torch.Size([HEADER_SIZE if self.sides is None else self.sides.header_size]), torch.int64
        return torch.Size([SUMMARY_SIZE]), torch.float64

    def _buffer(self, message: Message, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        return self.executor.buffer(message.kind.value, message.microbatch or 0, shape, dtype, message.stage)
