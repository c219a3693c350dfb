"""The runtime executor: runs one stage's part of a schedule, step after step, over the message order's links.

:class:`StageExecutor` keeps what lasts across steps (the cut points of its stage, receive buffers, the
message order of each schedule, the event hook); each step is a :class:`~.stage_step.StageStep`.
A recompute or backward whose gradient is late, or that would leave the next stage without work, lets the next
forward go first if its input is there (Varuna's opportunistic rule and ours,
:func:`~lightning_varuna.pipeline.scheduling.run_time_rules.next_task`): forwards keep their order, as do recomputes and
backwards, so every link's messages keep the message order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor

from lightning_varuna.pipeline.comm.events import EventHooks
from lightning_varuna.pipeline.comm.transfers import P2P
from lightning_varuna.pipeline.model.cut import CutPoint, StageForward
from lightning_varuna.pipeline.runtime.links import Chunk, RankLinks, StageLinks
from lightning_varuna.pipeline.runtime.rank_step import RankStep
from lightning_varuna.pipeline.runtime.selective_recompute import RecomputePolicy
from lightning_varuna.pipeline.runtime.stage_step import SUMMARY_SIZE, StageStep
from lightning_varuna.pipeline.scheduling.schedules import Schedule
from lightning_varuna.pipeline.topology import Topology

__all__ = ["SUMMARY_SIZE", "StageExecutor", "StepFunction"]

StepFunction = Callable[[int], Any]
"""Runs the user's step on micro-batch ``k`` and returns its output (on the last stage: the loss)."""


class StageExecutor:
    """Runs the tasks of one stage, one step at a time.

    Args:
        topology: Where this rank sits.
        p2p: The transport.
        cuts: The cut points in execution order.
        first_cut: The cut point whose output this stage receives (None on the first stage).
        last_cut: The cut point where this stage's forward ends (None on the last stage).
        events: The event hook (the p2p layer's, so that one set of recorders sees tasks and transfers).
        chunks: The stages this rank runs, when it runs several (``first_cut`` and ``last_cut`` are then the first
            one's); default: one stage, this rank's, from ``first_cut`` to ``last_cut``.
        stage_ranks: With several stages per rank, the pipeline rank of each stage of the model.
    """

    def __init__(self, topology: Topology, p2p: P2P, cuts: Sequence[CutPoint], first_cut: int | None,
                 last_cut: int | None, events: EventHooks | None = None, chunks: Sequence[Chunk] | None = None,
                 stage_ranks: tuple[int, ...] | None = None) -> None:
        self.topology = topology
        self.p2p = p2p
        self.cuts = cuts
        self.chunks: list[Chunk] = list(chunks) if chunks else [Chunk(topology.stage, first_cut, last_cut)]
        """The stages this rank runs, in pipeline order."""
        self.stage_ranks = stage_ranks
        self.events = events if events is not None else p2p.events
        self.boundary_dtype: torch.dtype | None = None
        """If set, floating-point activations and their gradients travel in this dtype."""
        self.current: StageForward | None = None
        self.feed_next_stage = True
        """Whether a forward also goes ahead of a recompute or backward while the next stage has run out of work
        (see :func:`~lightning_varuna.pipeline.scheduling.run_time_rules.next_task`); False keeps Varuna's rule
        alone."""
        self.summary: Tensor | None = None
        self.recompute_policy: RecomputePolicy | None = None
        """With recompute, the ops whose forward outputs a recompute takes instead of running them again
        (:mod:`~lightning_varuna.pipeline.runtime.selective_recompute`)."""
        self._pool: dict[tuple[str, int, int], Tensor] = {}
        self._links: dict[tuple[int, bool], tuple[Schedule, StageLinks | RankLinks]] = {}

    # -- state visible to stand-ins -------------------------------------------------------------------------
    @property
    def first_cut(self) -> int | None:
        """The cut point whose output this rank's (first) stage receives."""
        return self.chunks[0].first_cut

    @property
    def last_cut(self) -> int | None:
        """The cut point where this rank's (first) stage's forward ends."""
        return self.chunks[0].last_cut

    def segment(self) -> int:
        """The segment the running forward runs for real in (-1: none).

        The segment it is in once it has reached its stage's first segment, -1 before (where the rank's earlier
        stages, if any, are stood in for like any other); the first stage's first segment when none is running.
        """
        current = self.current
        if current is None:
            return self.chunks[0].first_segment
        start = 0 if current.first is None else current.first + 1
        return current.segment if current.segment >= start else -1

    # -- what lasts across steps ----------------------------------------------------------------------------
    def buffer(self, kind: str, k: int, shape: torch.Size, dtype: torch.dtype, stage: int = 0) -> Tensor:
        """A receive buffer for micro-batch ``k`` of a stage, reused across steps while its shape stays the same."""
        key = (kind, stage, k)
        buffer = self._pool.get(key)
        if buffer is None or buffer.shape != shape or buffer.dtype != dtype:
            buffer = torch.empty(shape, dtype=dtype, device=self.topology.device)
            self._pool[key] = buffer
        return buffer

    def forget_links(self) -> None:
        """Drops the lowered message orders (they name peer ranks): after the process groups were made again."""
        self._links.clear()

    def links(self, schedule: Schedule, summary: bool) -> StageLinks | RankLinks:
        """This rank's part of the message order of ``schedule`` (lowered once per schedule)."""
        key = (id(schedule), summary)
        cached = self._links.get(key)
        if cached is None or cached[0] is not schedule:
            links = StageLinks.build(schedule, self.topology, summary) if self.stage_ranks is None else \
                RankLinks.build(schedule, self.topology, summary, self.stage_ranks)
            cached = self._links[key] = (schedule, links)
        return cached[1]

    # -- one step -------------------------------------------------------------------------------------------
    def run(
        self,
        schedule: Schedule,
        step: StepFunction,
        sizes: Sequence[int],
        batch_dims: tuple[int | None, int | None],
        train: bool,
        recompute: bool,
        loss_of: Callable[[Any, int], Tensor] | None = None,
        summary: Callable[[list[Any]], Tensor] | None = None,
        last_backward: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> list[Any]:
        """Runs this stage's tasks of ``schedule`` and returns, on the last stage, each micro-batch's step output.

        With ``summary`` (training only), the last stage turns the step's outputs into at most
        :data:`SUMMARY_SIZE` float64 values after its schedule, and they travel back stage by stage behind the
        last gradient: every stage finds them in :attr:`summary` when ``run`` returns, with no collective.

        Args:
            schedule: The step's schedule, every stage's task list (the message order is derived from all of them).
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
                :meth:`GradientSync.overlapping <lightning_varuna.pipeline.comm.grad_sync.GradientSync.overlapping>`.
        """
        summary = summary if train else None
        links = self.links(schedule, summary is not None)
        tasks = schedule[self.topology.stage]
        if isinstance(links, RankLinks):
            return RankStep(self, links, tasks, step, sizes, train, recompute, loss_of, summary, last_backward).run()
        return StageStep(self, links, tasks, step, sizes, batch_dims, train, recompute, loss_of, summary,
                         last_backward).run()
