"""One step of a rank that runs several stages (model chunks): their tasks in one list, their links shared.

With ``stages_per_rank > 1`` a rank's task list names the stage of each task. :class:`RankStep` keeps one
:class:`~lightning_varuna.pipeline.runtime.stage_step.StageStep` per stage (its received inputs, kept outputs, RNG
states) and one inbox or outbox per link of the rank: the stages on either side of a link share it, and its
messages keep the sender's order (:mod:`~lightning_varuna.pipeline.scheduling.lowering`). A received message is
routed to the stage it is for by the stage that sent it.

The run-time rules apply as with one stage per rank, with two limits: a forward goes ahead of a recompute or backward
only if its own stage runs forwards without autograd (it adds no graph), and not at all when one link carries both
activations and gradients from this rank (``P = 2``: the move would reorder that link's messages).

With a split backward (``I`` and ``W`` tasks) the rank's stages share one count of held-back weight gradients, so a
weight two of its stages share is final only after the last ``W`` of either.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from typing import Any

import torch
from torch import Tensor

from lightning_varuna.pipeline.comm.events import Event, EventKind
from lightning_varuna.pipeline.runtime.fused_linear_grad import PendingWeightGrads
from lightning_varuna.pipeline.runtime.links import Boxes, Inbox, LocalLink, Outbox, RankLinks, Spec
from lightning_varuna.pipeline.runtime.stage_step import SUMMARY_SIZE, StageContext, StageStep
from lightning_varuna.pipeline.scheduling.lowering import Message, MessageKind
from lightning_varuna.pipeline.scheduling.run_time_rules import next_task
from lightning_varuna.pipeline.scheduling.tasks import Kind, Task

__all__ = ["RankStep"]


class RankStep:
    """Runs one rank's task list over the stages it holds, for one step.

    Args:
        executor: The rank's executor (its chunks, cut points, buffers, the event hook).
        links: The rank's part of the step's message order.
        tasks: The rank's task list (each task names its stage).
        step: Runs the user's step on micro-batch ``k``.
        sizes: The batch size of each micro-batch.
        train: Whether backward tasks run.
        recompute: Whether forwards of non-last stages run without autograd (train only).
        loss_of: On the last stage, turns step output ``k`` into the scalar to differentiate.
        summary: On the last stage, turns the outputs into at most ``SUMMARY_SIZE`` float64 values.
        last_backward: A context manager factory for the rank's last backward task of the step.
    """

    def __init__(
        self, executor: StageContext, links: RankLinks, tasks: Sequence[Task], step: Callable[[int], Any],
        sizes: Sequence[int], train: bool, recompute: bool, loss_of: Callable[[Any, int], Tensor] | None,
        summary: Callable[[list[Any]], Tensor] | None, last_backward: Callable[..., AbstractContextManager[Any]] | None,
    ) -> None:
        topo = executor.topology
        self.executor, self.p2p, self.tasks, self.train = executor, executor.p2p, tasks, train
        self.summary, self.emit, self.last_backward = summary, executor.events.emit, last_backward
        self.rank = topo.rank
        self.sends: list[Any] = []
        ranks = executor.stage_ranks
        assert ranks is not None, "a rank of several stages knows the rank of every stage"
        self.last_stage = len(ranks) - 1
        watch = train and recompute
        me = topo.rank
        self.inboxes = {peer: Inbox(self.p2p, peer, me, messages, self._spec, self._buffer, watch)
                        for peer, messages in links.inbound.items()}
        self.outboxes = {peer: Outbox(self.p2p, me, peer, messages, self.sends)
                         for peer, messages in links.outbound.items()}
        self.local = LocalLink()
        """The edge between two stages of this rank, if it has one (V-shaped placement): handed over in memory."""
        self.steps: dict[int, StageStep] = {}
        for chunk in executor.chunks:
            s = chunk.stage
            prev = topo.rank_of(ranks[s - 1]) if s > 0 else None
            after = topo.rank_of(ranks[s + 1]) if s < self.last_stage else None
            boxes = Boxes(
                prev=prev, next=after,
                from_prev=self._box(self.inboxes, prev), from_next=self._box(self.inboxes, after),
                to_prev=self._box(self.outboxes, prev), to_next=self._box(self.outboxes, after),
                sends=self.sends,
            )
            self.steps[s] = StageStep(executor, None, (), step, sizes, None, train, recompute, loss_of, summary,
                                      last_backward, chunk=chunk, boxes=boxes)
        self.held_back = PendingWeightGrads()
        for stage_step in self.steps.values():
            stage_step.held_back = self.held_back
        mixed = any({m.kind for m in messages} >= {MessageKind.ACTIVATION, MessageKind.GRADIENT}
                    for messages in links.outbound.values())
        self.moves = train and not mixed

    def _box(self, boxes: dict[int, Any], peer: int | None) -> Any:
        """The box towards ``peer`` (a global rank): this rank's local edge for itself, None for no neighbour."""
        if peer is None:
            return None
        return self.local if peer == self.rank else boxes.get(peer)

    def _final_backwards(self) -> dict[Task, set[Any]]:
        """Each stage's last backward (``B`` or ``I``), with the parameters whose gradients are final after it.

        A parameter two stages of this rank share (one tensor) is final after the later of their last backwards.
        The gradient reductions' region opens at the first of them: each bucket starts once all its parameters are
        final, and a parameter counts only in the last backward that accumulates into it. With a split backward a
        held-back weight is final only once its last ``W`` ran, too (:class:`_NotFinal`).
        """
        last = {t.stage: t for t in self.tasks if t.kind in (Kind.B, Kind.I)}
        position = {task: i for i, task in enumerate(self.tasks)}
        final_in: dict[Any, Task] = {}
        for stage, task in last.items():
            for param in self._step_at(stage).chunk.params:
                if param not in final_in or position[task] > position[final_in[param]]:
                    final_in[param] = task
        finals: dict[Task, set[Any]] = {task: set() for task in last.values()}
        for param, task in final_in.items():
            finals[task].add(param)
        return finals

    def _forwards_stash(self, task: Task) -> bool:
        return self._step_at(task.stage).forwards_add_no_graph

    def arrived(self, task: Task) -> bool:
        """Whether the message ``task`` waits for is here (asked by the run-time rules)."""
        return self._step_at(task.stage).arrived(task)

    def run(self) -> list[Any]:
        """Runs the tasks (the run-time rules may move forwards ahead), passes the summary on, waits for sends."""
        emit = self.emit
        if emit is not None:
            emit(Event(EventKind.STEP_START, time.perf_counter(), train=self.train,
                       microbatches=len(next(iter(self.steps.values())).sizes)))
        for inbox in self.inboxes.values():
            inbox.advance()
        finals = self._final_backwards() if self.train and self.last_backward is not None else {}
        region, opened = ExitStack(), False
        held_back = _NotFinal(set().union(*finals.values()) if finals else set(), self.held_back)
        last_b = next((t for t in reversed(self.tasks) if t.kind in (Kind.B, Kind.W)), None)
        pending = list(self.tasks)
        completed = False
        try:
            while pending:
                index = next_task(pending, self.arrived, self._forwards_stash, self.executor.feed_next_stage) \
                    if self.moves else 0
                task = pending.pop(index)
                if task in finals:  # a stage's last backward: its parameters' gradients become final in it
                    if not opened:
                        assert self.last_backward is not None  # a rank with final backwards is given one
                        release = region.enter_context(self.last_backward(held_back=held_back))
                        for stage_step in self.steps.values():
                            stage_step.release = held_back.releasing(release)
                        opened = True
                    held_back.waiting -= finals[task]
                if emit is not None:
                    emit(Event(EventKind.TASK_START, time.perf_counter(), task=task, moved=index > 0))
                graphs, stash = self._step_at(task.stage).run_task(task, None, None)
                if emit is not None:
                    emit(Event(EventKind.TASK_END, time.perf_counter(), task=task, graphs=graphs, stash_bytes=stash))
                if task == last_b:
                    region.close()
                if self.sends:  # let go of tensors whose send is done, so memory follows the schedule
                    self.sends[:] = [t for t in self.sends if not self.p2p.finished(t)]
            if self.summary is not None:
                self.pass_summary()
            self.finish()
            completed = True
        finally:
            region.close()
            for stage_step in self.steps.values():
                stage_step.release = None
            self.executor.current = None
            self.p2p.close(join=completed)
        if emit is not None:
            emit(Event(EventKind.STEP_END, time.perf_counter()))
        last = self.steps.get(self.last_stage)
        if last is None:
            return []
        return [r.detach() if isinstance(r, Tensor) else r for r in last.results]

    def pass_summary(self) -> None:
        """Passes the step summary on: made on the last stage's rank, received from the next rank on the others."""
        topo = self.executor.topology
        position = topo.stage
        # away from the last stage's rank: towards rank 0, or from rank 0 on (V-shaped placement)
        away = 1 if topo.last_stage_position == 0 else -1
        last = self.steps.get(self.last_stage)
        if last is not None:
            assert self.summary is not None  # the rank of the last stage is given one
            values = self.summary(last.results)
            buffer = self.executor.buffer("summary", 0, torch.Size([SUMMARY_SIZE]), torch.float64)
            buffer.zero_()
            buffer[: values.numel()].copy_(values)
        else:
            inbox = self.inboxes[topo.rank_of(position - away)]
            buffer = inbox.take(Message(MessageKind.SUMMARY, position - away), "receiving the step summary")
        if 0 <= position + away < topo.pipeline_size:
            outbox = self.outboxes[topo.rank_of(position + away)]
            outbox.send(Message(MessageKind.SUMMARY, position), buffer, position)
        self.executor.summary = buffer

    def finish(self) -> None:
        """Waits for this step's sends; checks that every message of the message order went and came."""
        for transfer in self.sends:
            self.p2p.wait(transfer, f"sending {transfer.message!r}")
        self.sends.clear()
        position = self.executor.topology.stage
        boxes: list[Inbox | Outbox | LocalLink] = [*self.inboxes.values(), *self.outboxes.values(), self.local]
        for box in boxes:
            box.check_complete(position)

    def _step_at(self, stage: int | None) -> StageStep:
        """The step of ``stage``: a rank of several stages names each task's."""
        assert stage is not None
        return self.steps[stage]

    # -- routing of received messages to their stage --------------------------------------------------------
    def _receiver(self, message: Message) -> StageStep:
        if message.kind is MessageKind.GRADIENT:
            return self.steps[message.stage - 1]
        return self.steps[message.stage + 1]

    def _spec(self, message: Message) -> Spec | None:
        if message.kind is MessageKind.SUMMARY:
            return torch.Size([SUMMARY_SIZE]), torch.float64
        return self._receiver(message)._spec(message)

    def _buffer(self, message: Message, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        return self.executor.buffer(message.kind.value, message.microbatch or 0, shape, dtype, message.stage)


class _NotFinal:
    """The parameters whose gradients are not final yet in the rank's last backwards.

    Those of stages whose last backward has not started (``waiting``) and those with held-back weight-gradient work
    (``weights``).
    """

    def __init__(self, waiting: set[Any], weights: PendingWeightGrads) -> None:
        self.waiting, self.weights = waiting, weights

    def __contains__(self, param: object) -> bool:
        return param in self.waiting or param in self.weights

    def releasing(self, release: Callable[[Sequence[Any]], None]) -> Callable[[Sequence[Any]], None]:
        """``release`` for the parameters a ``W`` finished, except those whose stage has a backward to come."""
        def release_final(params: Sequence[Any]) -> None:
            release([p for p in params if p not in self.waiting])
        return release_final
