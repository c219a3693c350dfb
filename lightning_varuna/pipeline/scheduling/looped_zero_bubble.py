"""Zero-bubble over two model chunks per rank: interleaving and the I/W split together, looped or V-shaped.

:func:`looped_zero_bubble_schedule` generates per-rank task lists over either placement
(:mod:`~lightning_varuna.pipeline.scheduling.placement`; ``schedule="zero-bubble"`` runs it looped,
``"zero-bubble-v"`` V-shaped, :mod:`~lightning_varuna.pipeline.scheduling.zero_bubble_v`) by a discrete-time
simulation with unit costs per chunk task (``F = R = I = W = 1``: a chunk is ``1/v`` of a stage, a backward two
forwards split evenly), like :func:`~lightning_varuna.pipeline.scheduling.zero_bubble.zero_bubble_schedule` does
for one chunk per rank. Whenever a rank is idle it starts the first ready task of its chunks by priority
``I > R > F > W``:

- ``I(k)@s`` is ready once the gradient of ``k`` from stage ``s + 1`` has arrived (on the last stage once ``F(k)`` is
  done) and, with recompute, ``R(k)@s`` is done; among several, the lowest micro-batch, then the latest stage.
- ``R(k)@s`` (recompute, every stage but the last) is ready once stage ``s + 1`` has started ``I(k)``.
- ``F(k)@s`` is ready once its input has arrived and the rank holds fewer chunk graphs than its bound; among several,
  the latest stage first (depth first: the micro-batch reaches the last stage, whose backward starts the drain,
  soonest), then the lowest micro-batch.
- ``W(k)@s`` is ready once ``I(k)@s`` is done; the oldest ``I`` first.

**Memory bound** (:func:`looped_zero_bubble_bound`), in chunk graphs a rank holds at once: without recompute
``2 P`` until ``W`` (of chunk size ``1/v`` of a stage: ``2 P / v`` stages' worth, as much as 1F1B's first stage holds
for ``v = 2``); with recompute one until ``I`` and two until ``W`` (three on the rank of the last stage, whose
forwards keep their graphs: rank ``P - 1`` looped, rank 0 V-shaped), plus the stashed inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_varuna.pipeline.scheduling.placement import LOOPED, Placement, placement_ranks
from lightning_varuna.pipeline.scheduling.simulator import WEIGHT_SHARES, most_robust
from lightning_varuna.pipeline.scheduling.tasks import Kind, Schedule, ScheduleError, Task

__all__ = ["greedy_chunk_schedule", "looped_zero_bubble_bound", "looped_zero_bubble_schedule"]


def looped_zero_bubble_bound(
    rank: int, num_ranks: int, recompute: bool, placement: Placement = LOOPED
) -> tuple[int, int]:
    """The most chunk graphs rank ``rank`` holds until their ``I`` and until their ``W`` (module docstring)."""
    if recompute:
        return (2, 3) if rank == placement_ranks(num_ranks, 2, placement)[-1] else (1, 2)
    return 2 * num_ranks, 2 * num_ranks


_TICKS = 10
"""Ticks of a forward in the generating simulation (a backward takes twice as many, split by ``weight_share``)."""


@dataclass
class _Chunk:
    stage: int
    recomputes: bool
    inputs: set[int] = field(default_factory=set)
    gradients: set[int] = field(default_factory=set)
    triggered: set[int] = field(default_factory=set)
    forwarded: int = 0
    recomputed: int = 0
    input_grads: int = 0
    weight_grads: int = 0


@dataclass
class _Rank:
    chunks: list[_Chunk]
    bound: tuple[int, int]
    until_i: int = 0
    until_w: int = 0
    running: tuple[Task, _Chunk] | None = None
    busy_until: int = 0
    order: list[Task] = field(default_factory=list)


def looped_zero_bubble_schedule(
    num_ranks: int, stages_per_rank: int, num_microbatches: int, recompute: bool
) -> Schedule:
    """The zero-bubble schedule over the looped placement (``schedule="zero-bubble"`` with ``stages_per_rank=2``).

    With recompute the packed list of :func:`greedy_chunk_schedule`; without, that list or the one with each ``W``
    right after its ``I``, whichever stays nearer the better of the two whatever share of a backward ``W`` takes
    (:func:`~lightning_varuna.pipeline.scheduling.simulator.most_robust`; see the module docstring).

    Args:
        num_ranks: ``P``.
        stages_per_rank: ``v``.
        num_microbatches: ``m`` (any number from 1).
        recompute: Whether every stage but the last runs its forwards without autograd and recomputes before ``I``.

    Returns:
        Per rank its task list, every task naming its stage. Not validated.
    """
    if recompute:
        return greedy_chunk_schedule(num_ranks, stages_per_rank, num_microbatches, recompute)
    candidates = [greedy_chunk_schedule(num_ranks, stages_per_rank, num_microbatches, recompute, weight_share=share)
                  for share in WEIGHT_SHARES]
    return most_robust(candidates, placement_ranks(num_ranks, stages_per_rank, LOOPED))


def greedy_chunk_schedule(
    num_ranks: int, stages_per_rank: int, num_microbatches: int, recompute: bool, placement: Placement = LOOPED,
    weight_share: float = 0.5,
) -> Schedule:
    """The list of the generating simulation over several chunks per rank (see the module docstring).

    Args:
        num_ranks: ``P``.
        stages_per_rank: ``v`` (2 for the V-shaped placement).
        num_microbatches: ``m`` (any number from 1).
        recompute: Whether every stage but the last runs its forwards without autograd and recomputes before ``I``.
        placement: Where the stages live: ``"looped"`` or ``"v"``.
        weight_share: The share of a backward that ``W`` takes in the simulation (``I`` takes the rest); a forward
            takes half a backward. ``0.5``: the unit costs of the module docstring.

    Returns:
        Per rank its task list, every task naming its stage. Not validated.

    Raises:
        ScheduleError: If the simulation does not finish (a bug, never expected).
    """
    if num_ranks < 1 or stages_per_rank < 1 or num_microbatches < 1:
        raise ScheduleError(f"sizes must be at least 1, got P={num_ranks}, v={stages_per_rank}, m={num_microbatches}")
    ranks_of = placement_ranks(num_ranks, stages_per_rank, placement)
    last = len(ranks_of) - 1
    chunks = [_Chunk(s, recompute and s < last) for s in range(last + 1)]
    chunks[0].inputs.update(range(num_microbatches))
    ranks = [_Rank([chunks[s] for s in range(last + 1) if ranks_of[s] == r],
                   looped_zero_bubble_bound(r, num_ranks, recompute, placement)) for r in range(num_ranks)]
    backward = 2 * _TICKS
    weight = round(backward * weight_share)
    ticks = {Kind.F: _TICKS, Kind.R: _TICKS, Kind.I: backward - weight, Kind.W: weight}
    total = sum(num_microbatches * (4 if c.recomputes else 3) for c in chunks)
    tick = 0
    while True:
        for rank in ranks:
            _finish(rank, chunks, tick)
        if sum(len(r.order) for r in ranks) == total and all(r.running is None for r in ranks):
            return tuple(tuple(r.order) for r in ranks)
        for rank in ranks:
            _start(rank, chunks, tick, num_microbatches, ticks)
        running = [r.busy_until for r in ranks if r.running is not None]
        if not running:
            break
        tick = min(running)  # the next task to end (nothing else changes before it)
    raise ScheduleError(f"looped zero-bubble simulation did not finish for P={num_ranks}, v={stages_per_rank},"
                        f" m={num_microbatches}")


def _finish(rank: _Rank, chunks: list[_Chunk], tick: int) -> None:
    if rank.running is None or rank.busy_until != tick:
        return
    task, chunk = rank.running
    rank.running = None
    s = chunk.stage
    if task.kind is Kind.F and s + 1 < len(chunks):
        chunks[s + 1].inputs.add(task.microbatch)
    elif task.kind is Kind.I and s > 0:
        chunks[s - 1].gradients.add(task.microbatch)


def _start(rank: _Rank, chunks: list[_Chunk], tick: int, num_microbatches: int, ticks: dict[Kind, int]) -> None:
    if rank.running is not None:
        return
    chosen = _choose(rank, len(chunks) - 1, num_microbatches)
    if chosen is None:
        return
    task, chunk = chosen
    if task.kind is Kind.I:
        chunk.input_grads += 1
        rank.until_i -= 1
        if chunk.stage > 0 and chunks[chunk.stage - 1].recomputes:
            chunks[chunk.stage - 1].triggered.add(task.microbatch)
    elif task.kind is Kind.R:
        chunk.recomputed += 1
        rank.until_i, rank.until_w = rank.until_i + 1, rank.until_w + 1
    elif task.kind is Kind.F:
        chunk.forwarded += 1
        if not chunk.recomputes:
            rank.until_i, rank.until_w = rank.until_i + 1, rank.until_w + 1
    else:
        chunk.weight_grads += 1
        rank.until_w -= 1
    rank.running = (task, chunk)
    rank.busy_until = tick + max(1, ticks[task.kind])
    rank.order.append(task)


def _choose(rank: _Rank, last: int, m: int) -> tuple[Task, _Chunk] | None:
    room = rank.until_i < rank.bound[0] and rank.until_w < rank.bound[1]
    inputs = [(c.input_grads, -c.stage, c) for c in rank.chunks if _input_grad_ready(c, last, m)]
    if inputs:
        c = min(inputs, key=lambda x: x[:2])[2]
        return Task(Kind.I, c.input_grads, c.stage), c
    recomputes = [(c.recomputed, -c.stage, c) for c in rank.chunks
                  if c.recomputes and c.recomputed < c.forwarded and c.recomputed in c.triggered]
    if recomputes and room:
        c = min(recomputes, key=lambda x: x[:2])[2]
        return Task(Kind.R, c.recomputed, c.stage), c
    forwards = [(-c.stage, c.forwarded, c) for c in rank.chunks if c.forwarded < m and c.forwarded in c.inputs
                and (c.recomputes or room)]
    if forwards:
        c = min(forwards, key=lambda x: x[:2])[2]
        return Task(Kind.F, c.forwarded, c.stage), c
    weights = [(c.weight_grads, c.stage, c) for c in rank.chunks if c.weight_grads < c.input_grads]
    if weights:
        c = min(weights, key=lambda x: x[:2])[2]
        return Task(Kind.W, c.weight_grads, c.stage), c
    return None


def _input_grad_ready(c: _Chunk, last: int, m: int) -> bool:
    k = c.input_grads
    return (k < m and k < c.forwarded and (not c.recomputes or k < c.recomputed)
            and (c.stage == last or k in c.gradients))
