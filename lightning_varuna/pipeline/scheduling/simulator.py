"""Timing simulator for pipeline schedules: makespan, busy time and bubble of any :data:`Schedule`.

Each stage executes its task list in order. ``F(k)`` on stage ``s > 0`` waits for the activation sent when
``F(k)`` finished on ``s-1``; ``B(k)`` or ``I(k)`` on ``s < P-1`` waits for the gradient sent when ``B(k)`` or
``I(k)`` finished on ``s+1``; ``R(k)`` and ``W(k)`` have no remote dependency. Sends never block; a message takes
``comm`` plus an optional jitter. With ``opportunistic=True`` the simulator applies the executor's runtime rules
(see :func:`simulate`).

Used to compare schedules, to check the runtime rule, and to choose a pipeline shape from profiled costs.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_varuna.pipeline.scheduling.run_time_rules import next_task
from lightning_varuna.pipeline.scheduling.tasks import Kind, Schedule, ScheduleError, Task

__all__ = ["WEIGHT_SHARES", "Jitter", "SimResult", "StageCosts", "ideal_bubble", "most_robust", "simulate", "unit_step"]

Jitter = Callable[[int, int, Kind, int], float]
"""Extra delay of one message: ``jitter(src_stage, dst_stage, kind, microbatch) -> seconds``."""

# (destination stage, kind of the message's task (B for a gradient), micro-batch) -> arrival time of the message.
_Arrivals = dict[tuple[int, Kind, int], float]

_GRADIENT_KINDS = (Kind.B, Kind.I)
"""Tasks that send the gradient of the stage's input (and so wait for the next stage's)."""


def _arrival_kind(kind: Kind) -> Kind:
    return Kind.B if kind is Kind.I else kind


@dataclass(frozen=True)
class StageCosts:
    """Time one stage spends on one micro-batch, per task kind.

    Attributes:
        forward: Time of ``F``.
        backward: Time of ``B``; a split backward's ``I`` and ``W`` together take the same.
        recompute: Time of ``R``; ``None`` means the same as ``forward``.
        weight: Time of ``W`` (the rest of ``backward`` is ``I``); ``None`` means half of ``backward``.
    """

    forward: float
    backward: float
    recompute: float | None = None
    weight: float | None = None

    def cost(self, kind: Kind) -> float:
        """The time of a task of the given kind.

        Args:
            kind: The task kind.

        Returns:
            The task's duration.
        """
        if kind is Kind.F:
            return self.forward
        if kind is Kind.B:
            return self.backward
        weight = self.backward / 2 if self.weight is None else self.weight
        if kind is Kind.W:
            return weight
        if kind is Kind.I:
            return self.backward - weight
        return self.forward if self.recompute is None else self.recompute


@dataclass(frozen=True)
class SimResult:
    """Outcome of :func:`simulate`.

    Attributes:
        makespan: Time at which the last task ends.
        busy: Per stage, the total time spent running tasks (recompute counts as busy).
        idle_fraction: Per stage, ``1 - busy / makespan``.
        bubble: Overall idle fraction, ``1 - sum(busy) / (P * makespan)``.
        order: Per stage, the tasks in the order they were executed.
        start_times: Per stage, the start time of each task of ``order``.
    """

    makespan: float
    busy: tuple[float, ...]
    idle_fraction: tuple[float, ...]
    bubble: float
    order: tuple[tuple[Task, ...], ...]
    start_times: tuple[tuple[float, ...], ...]


def unit_step(schedule: Schedule, stage_ranks: Sequence[int] | None = None) -> float:
    """The step of ``schedule`` with unit costs per task (``F = R = I = W = 1``) and free communication.

    The generators compare their candidate lists by it.

    Args:
        schedule: One task list per rank.
        stage_ranks: With several stages per rank, the rank of each stage (as for :func:`simulate`).

    Returns:
        The makespan in ticks.
    """
    num_stages = len(schedule) if stage_ranks is None else len(stage_ranks)
    costs = [StageCosts(forward=1.0, backward=2.0, weight=1.0)] * num_stages
    return simulate(schedule, costs, stage_ranks=stage_ranks).makespan


WEIGHT_SHARES = (0.5, 0.35, 0.2)
"""Shares of a backward that its weight-gradient task ``W`` takes, over which :func:`most_robust` compares lists.

Half for layers whose backward is all matrix products (the input's gradient and the weights' are the same work);
less where the backward also has work without weights (attention, norms, activations): about 0.4 for a transformer
block at GPU scale, and 0.2-0.3 measured for a small GPT block on a CPU."""


def most_robust(candidates: Sequence[Schedule], stage_ranks: Sequence[int] | None = None) -> Schedule:
    """The candidate list whose step stays nearest the best candidate's whatever share of a backward ``W`` takes.

    Each candidate's step is simulated with ``F = 1`` and ``B = I + W = 2`` per stage and free communication, for every
    share of :data:`WEIGHT_SHARES`; the candidate whose largest ratio to the best step at the same share is smallest
    is returned (ties go to the earlier candidate). A list packed for ``I = W`` counts on each ``W`` to fill the time
    a gradient takes to come back; where ``W`` is shorter the gradient is late and the stage waits.

    Args:
        candidates: Task lists of the same schedule (one list per rank each).
        stage_ranks: With several stages per rank, the rank of each stage (as for :func:`simulate`).
    """
    num_stages = len(candidates[0]) if stage_ranks is None else len(stage_ranks)
    steps = [[simulate(candidate, [StageCosts(forward=1.0, backward=2.0, weight=2.0 * share)] * num_stages,
                       stage_ranks=stage_ranks).makespan for share in WEIGHT_SHARES] for candidate in candidates]
    best = [min(column) for column in zip(*steps, strict=True)]
    worst = [max(step / least for step, least in zip(row, best, strict=True)) for row in steps]
    return candidates[worst.index(min(worst))]


def ideal_bubble(num_stages: int, num_microbatches: int) -> float:
    """The idle fraction of GPipe and 1F1B with uniform stages and free communication.

    Args:
        num_stages: Number of pipeline stages ``P`` (at least 1).
        num_microbatches: Number of micro-batches ``m`` (at least 1).

    Returns:
        ``(P - 1) / (m + P - 1)``.

    Raises:
        ValueError: If a size is below 1.
    """
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(f"sizes must be at least 1, got P={num_stages}, m={num_microbatches}")
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def simulate(
    schedule: Schedule,
    costs: Sequence[StageCosts],
    comm: float = 0.0,
    jitter: Jitter | None = None,
    opportunistic: bool = False,
    feed_next_stage: bool = True,
    transfer: Sequence[float] | None = None,
    stage_ranks: Sequence[int] | None = None,
    forwards_stash: Callable[[int], bool] | None = None,
) -> SimResult:
    """Simulate the execution of a schedule in continuous time.

    Every stage, whenever it is idle, starts the next task of its list as soon as the message that task
    waits for has arrived. A message leaves when its task finishes and arrives
    ``max(0, comm + jitter(src, dst, kind, k))`` later. With ``transfer``, a message between stages ``b`` and
    ``b+1`` first occupies that link for ``transfer[b]`` seconds, after the link's previous message in the
    same direction (a stage's sends to one neighbour are posted in order): it arrives ``comm + jitter`` after
    its transfer ends.

    With ``opportunistic=True`` the executor's runtime rule applies (Varuna's opportunistic rule,
    :func:`~lightning_varuna.pipeline.scheduling.run_time_rules.next_task`): a stage whose next recompute or backward
    waits for a late gradient runs its next forward first if that forward's input is there (for a backward, only on a
    stage with recompute tasks, whose forwards the executor runs without autograd); with ``feed_next_stage`` it does
    so too while the next stage has nothing left to do. Forwards keep their order, as do recomputes and backwards, so
    every message between two stages is still sent in the same order.

    Args:
        schedule: One task list per stage.
        costs: One :class:`StageCosts` per stage.
        comm: Base delay of every message.
        jitter: Optional extra delay per message.
        opportunistic: Whether to apply Varuna's runtime rule.
        feed_next_stage: With ``opportunistic``, whether a forward also goes first while the next stage has
            finished everything this stage sent it (see
            :func:`~lightning_varuna.pipeline.scheduling.run_time_rules.next_task`).
        transfer: Optional seconds one message occupies each boundary's link (``P - 1`` values).
        stage_ranks: With several stages per rank, the rank of each stage: ``schedule`` has one list per rank whose
            tasks name their stage, ``costs`` one entry per stage; a message between two stages of one rank arrives
            when it is sent.
        forwards_stash: Whether a stage's forwards keep no autograd graph (for the run-time rules); default: the
            stages that have recompute tasks (with recompute by degree a forward keeps its later segments' graph).

    Returns:
        The timing result (per rank).

    Raises:
        ValueError: If ``costs`` does not have one entry per stage.
        ScheduleError: If the schedule deadlocks.
    """
    ranks = tuple(range(len(schedule))) if stage_ranks is None else tuple(stage_ranks)
    num_stages, num_ranks = len(ranks), len(schedule)
    if len(costs) != num_stages:
        raise ValueError(f"need one StageCosts per stage: {num_stages} stages, {len(costs)} costs")
    if transfer is not None and len(transfer) != num_stages - 1:
        raise ValueError(f"need one transfer time per boundary: {num_stages - 1} boundaries, {len(transfer)} given")
    links = _Links(transfer, ranks)
    pending = [list(tasks) for tasks in schedule]
    recomputing = {_stage_of(t, r) for r, tasks in enumerate(schedule) for t in tasks if t.kind is Kind.R}
    stashes: list[bool | Callable[[Task], bool]] = [
        any(task.kind is Kind.R for task in tasks) if stage_ranks is None
        else _stashes_by_stage(r, recomputing.__contains__)
        for r, tasks in enumerate(schedule)
    ]
    if forwards_stash is not None:
        by_stage = forwards_stash
        stashes = [_stashes_by_stage(r, by_stage) for r in range(num_ranks)]
    # the message each task waits for, looked up by the task's identity: the run-time rules ask about tasks
    waits = [{id(task): _awaited(task, rank, num_stages) for task in tasks} for rank, tasks in enumerate(schedule)]
    free_at = [0.0] * num_ranks
    arrivals: _Arrivals = {}
    wakeups = _Wakeups(num_ranks)
    order: list[list[Task]] = [[] for _ in range(num_ranks)]
    starts: list[list[float]] = [[] for _ in range(num_ranks)]
    now = 0.0
    while True:
        while wakeups.due:
            due, wakeups.due = wakeups.due, set()
            for rank in sorted(due):
                if free_at[rank] > now or not pending[rank]:
                    continue
                index = _pick(rank, num_stages, pending[rank], waits[rank], arrivals, now, opportunistic, stashes[rank],
                              feed_next_stage)
                if index is None:
                    continue
                task = pending[rank].pop(index)
                stage = _stage_of(task, rank)
                finish = now + costs[stage].cost(task.kind)
                sent = _send(stage, num_stages, task, finish, arrivals, comm, jitter, links)
                if sent is not None:
                    wakeups.add(sent[0], ranks[sent[1]], now)
                wakeups.add(finish, rank, now)
                free_at[rank] = finish
                order[rank].append(task)
                starts[rank].append(now)
        if not any(pending):
            break
        now = wakeups.next(now, pending)
    return _result(costs, ranks, free_at, order, starts)


class _Wakeups:
    """When to look at which rank again: a rank's choice changes only when it frees up or a message reaches it.

    A free rank that waits keeps waiting until one of the two happens, so only those ranks are asked again (in
    rank order, as long as starts at the same time wake more); every such time is an event.
    """

    def __init__(self, num_ranks: int) -> None:
        self.due: set[int] = set(range(num_ranks))  # the ranks to ask at the current time
        self._times: list[float] = []  # heap of the later times in ``_ranks``
        self._ranks: dict[float, set[int]] = {}

    def add(self, time: float, rank: int, now: float) -> None:
        """Ask ``rank`` again at ``time`` (at once if that is ``now``)."""
        if time <= now:
            self.due.add(rank)
        elif time in self._ranks:
            self._ranks[time].add(rank)
        else:
            self._ranks[time] = {rank}
            heapq.heappush(self._times, time)

    def next(self, now: float, pending: list[list[Task]]) -> float:
        """Moves to the earliest later event and returns its time (the ranks to ask there are then ``due``).

        Raises:
            ScheduleError: If nothing is left to happen but tasks remain (a deadlock).
        """
        if not self._times:
            blocked = ", ".join(f"stage {s} at {tasks[0]!r}" for s, tasks in enumerate(pending) if tasks)
            raise ScheduleError(f"deadlock in simulation at time {now}: blocked {blocked}")
        time = heapq.heappop(self._times)
        self.due = self._ranks.pop(time)
        return time


def _stashes_by_stage(rank: int, stage_stashes: Callable[[int], bool]) -> Callable[[Task], bool]:
    """Whether a task of ``rank`` stashes its forward, from whether its stage does."""
    return lambda task: stage_stashes(_stage_of(task, rank))


def _stage_of(task: Task, rank: int) -> int:
    return rank if task.stage is None else task.stage


def _awaited(task: Task, rank: int, num_stages: int) -> tuple[int, Kind, int] | None:
    """The arrival key of the message ``task`` waits for, or ``None`` if it waits for none."""
    stage = _stage_of(task, rank)
    if (task.kind is Kind.F and stage > 0) or (task.kind in _GRADIENT_KINDS and stage < num_stages - 1):
        return stage, _arrival_kind(task.kind), task.microbatch
    return None


def _pick(
    rank: int, num_stages: int, tasks: list[Task], waits: dict[int, tuple[int, Kind, int] | None],
    arrivals: _Arrivals, now: float, opportunistic: bool, forwards_stash: bool | Callable[[Task], bool],
    feed_next_stage: bool,
) -> int | None:
    """Index in ``tasks`` of the task to start now, or ``None`` to wait (``waits``: the list's arrival keys by id)."""

    def ready(task: Task) -> bool:
        # the run-time rules also ask about tasks not in the list (the backward of a pending recompute)
        key = waits[id(task)] if id(task) in waits else _awaited(task, rank, num_stages)
        return key is None or arrivals.get(key, math.inf) <= now

    index = next_task(tasks, ready, forwards_stash, feed_next_stage) if opportunistic else 0
    return index if ready(tasks[index]) else None


class _Links:
    """When each boundary's link is free again, per direction (messages over one link go one after another)."""

    def __init__(self, transfer: Sequence[float] | None, ranks: Sequence[int]) -> None:
        self.transfer = transfer
        self.ranks = ranks
        self.free: dict[tuple[int, int], float] = {}

    def local(self, source: int, destination: int) -> bool:
        """Whether both stages run on one rank (the message is handed over, not sent)."""
        return self.ranks[source] == self.ranks[destination]

    def send(self, source: int, destination: int, ready: float) -> float:
        """The time a message ready to leave at ``ready`` has crossed the link (of the stages' ranks)."""
        if self.transfer is None:
            return ready
        link = (self.ranks[source], self.ranks[destination])
        start = max(ready, self.free.get(link, 0.0))
        done = start + self.transfer[min(source, destination)]
        self.free[link] = done
        return done


def _send(
    stage: int,
    num_stages: int,
    task: Task,
    finish: float,
    arrivals: _Arrivals,
    comm: float,
    jitter: Jitter | None,
    links: _Links,
) -> tuple[float, int] | None:
    """Record the arrival of the message ``task`` sends when it finishes: its time and destination stage (if any)."""
    if task.kind is Kind.F and stage < num_stages - 1:
        destination = stage + 1
    elif task.kind in _GRADIENT_KINDS and stage > 0:
        destination = stage - 1
    else:
        return None
    key = (destination, _arrival_kind(task.kind), task.microbatch)
    if links.local(stage, destination):
        arrivals[key] = finish
    else:
        extra = 0.0 if jitter is None else jitter(stage, destination, task.kind, task.microbatch)
        arrivals[key] = links.send(stage, destination, finish) + max(0.0, comm + extra)
    return arrivals[key], destination


def _result(
    costs: Sequence[StageCosts], ranks: Sequence[int], free_at: list[float], order: list[list[Task]],
    starts: list[list[float]],
) -> SimResult:
    """Summarise a finished simulation (per rank)."""
    makespan = max(free_at, default=0.0)
    busy = tuple(
        float(sum(costs[_stage_of(t, r)].cost(t.kind) for t in tasks)) for r, tasks in enumerate(order)
    )
    if makespan > 0:
        idle = tuple(1.0 - b / makespan for b in busy)
        bubble = 1.0 - sum(busy) / (len(busy) * makespan)
    else:
        idle = tuple(0.0 for _ in busy)
        bubble = 0.0
    return SimResult(
        makespan=makespan,
        busy=busy,
        idle_fraction=idle,
        bubble=bubble,
        order=tuple(tuple(tasks) for tasks in order),
        start_times=tuple(tuple(times) for times in starts),
    )
