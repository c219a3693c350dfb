"""Checks that a schedule is complete, correctly ordered and free of deadlock."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

from lightning_varuna.pipeline.scheduling.tasks import Kind, Schedule, ScheduleError, Task

__all__ = ["check_sizes", "validate_schedule"]


def check_sizes(num_stages: int, num_microbatches: int) -> None:
    """Raise :class:`ScheduleError` unless both sizes are at least 1."""
    if num_stages < 1:
        raise ScheduleError(f"num_stages must be at least 1, got {num_stages}")
    if num_microbatches < 1:
        raise ScheduleError(f"num_microbatches must be at least 1, got {num_microbatches}")


def validate_schedule(
    schedule: Schedule, num_microbatches: int, recompute: bool, train: bool = True, split_backward: bool = False,
    stage_ranks: Sequence[int] | None = None,
) -> None:
    """Check that a schedule is complete, correctly ordered and free of deadlock.

    The checks, per stage: every task appears exactly once (``F`` for every micro-batch; with ``train`` also
    ``B``, or ``I`` and ``W`` with ``split_backward``; with ``train`` and ``recompute`` also ``R`` on every
    non-last stage, and no ``R`` anywhere else); ``R(k)`` lies between ``F(k)`` and the backward, ``W(k)`` after
    ``I(k)``; forwards, backwards (``B`` or ``I``) and weight-gradient tasks are each in ascending micro-batch
    order (the order of messages). Finally the schedule is executed symbolically, each stage running its list in
    order: ``F(k)`` on ``s > 0`` waits for ``F(k)`` on ``s-1``, ``B(k)`` or ``I(k)`` on ``s < P-1`` waits for
    the same on ``s+1``, sends never block. If no stage can progress before all are done, the schedule deadlocks.

    Args:
        schedule: One tuple of tasks per stage.
        num_microbatches: Number of micro-batches the schedule must cover.
        recompute: Whether non-last stages must recompute.
        train: ``False`` for a forward-only schedule.
        split_backward: Whether backwards are split into ``I`` and ``W`` tasks.
        stage_ranks: With several stages per rank, the rank of each stage (``schedule`` then has one task list per
            rank, whose tasks name their stage); the checks above apply to each stage's tasks, and the symbolic
            execution runs the ranks' lists.

    Raises:
        ScheduleError: Naming the stage and task at fault.
    """
    if len(schedule) < 1:
        raise ScheduleError("a schedule needs at least one stage")
    ranks = tuple(range(len(schedule))) if stage_ranks is None else tuple(stage_ranks)
    check_sizes(len(ranks), num_microbatches)
    num_stages = len(ranks)
    per_stage = _tasks_per_stage(schedule, ranks, named=stage_ranks is not None)
    for stage, tasks in enumerate(per_stage):
        expected = _expected_tasks(stage, num_stages, num_microbatches, recompute, train, split_backward)
        _check_task_set(stage, tasks, expected, recompute, train)
        _check_order(stage, tasks)
    _check_deadlock(schedule, ranks)


def _tasks_per_stage(schedule: Schedule, ranks: tuple[int, ...], named: bool) -> list[tuple[Task, ...]]:
    """Each stage's tasks in its rank's order, without their stage names; checks every task's rank."""
    if not named:
        return [tuple(tasks) for tasks in schedule]
    if max(ranks, default=-1) >= len(schedule):
        raise ScheduleError(f"stage_ranks names rank {max(ranks)}, but the schedule has {len(schedule)} rank(s)")
    per_stage: list[list[Task]] = [[] for _ in ranks]
    for rank, tasks in enumerate(schedule):
        for task in tasks:
            if task.stage is None or not 0 <= task.stage < len(ranks) or ranks[task.stage] != rank:
                raise ScheduleError(f"rank {rank} lists {task!r}, whose stage does not run on rank {rank}")
            per_stage[task.stage].append(Task(task.kind, task.microbatch))
    return [tuple(tasks) for tasks in per_stage]


def _expected_tasks(
    stage: int, num_stages: int, num_microbatches: int, recompute: bool, train: bool, split_backward: bool
) -> set[Task]:
    """The set of tasks that stage ``stage`` must run."""
    kinds = [Kind.F]
    if train:
        kinds += [Kind.I, Kind.W] if split_backward else [Kind.B]
        if recompute and stage < num_stages - 1:
            kinds.append(Kind.R)
    return {Task(kind, k) for kind in kinds for k in range(num_microbatches)}


def _check_task_set(
    stage: int, tasks: tuple[Task, ...], expected: set[Task], recompute: bool, train: bool
) -> None:
    """Raise unless ``tasks`` holds every task of ``expected`` exactly once and nothing else."""
    seen: set[Task] = set()
    for task in tasks:
        if not isinstance(task, Task):
            raise ScheduleError(f"stage {stage}: {task!r} is not a Task")
        if task in seen:
            raise ScheduleError(f"stage {stage}: task {task!r} appears more than once")
        if task not in expected:
            raise ScheduleError(
                f"stage {stage}: unexpected task {task!r} ({_why_unexpected(task, expected, recompute, train)})"
            )
        seen.add(task)
    missing = sorted(expected - seen, key=lambda t: (t.microbatch, t.kind.value))
    if missing:
        raise ScheduleError(f"stage {stage}: missing task {missing[0]!r} ({len(missing)} missing in all)")


def _why_unexpected(task: Task, expected: set[Task], recompute: bool, train: bool) -> str:
    """A short reason why ``task`` does not belong on a stage."""
    if task.kind is not Kind.F and not train:
        return "a forward-only schedule has no recompute or backward"
    if task.kind is Kind.R:
        return "recompute is off" if not recompute else "the last stage never recomputes"
    if not any(t.kind is task.kind for t in expected):
        return "the backward is split into I and W here" if task.kind is Kind.B else "the backward is not split"
    return "micro-batch out of range"


_BACKWARD = (Kind.B, Kind.I)
"""The task that ends a micro-batch's autograd graph and sends the input's gradient."""


def _check_order(stage: int, tasks: tuple[Task, ...]) -> None:
    """Raise unless each kind is ascending and every task comes after those it needs on its stage."""
    position = {task: i for i, task in enumerate(tasks)}
    for kind, name in ((Kind.F, "forwards"), (Kind.B, "backwards"), (Kind.I, "input gradients"),
                       (Kind.W, "weight gradients")):
        microbatches = [t.microbatch for t in tasks if t.kind is kind]
        for before, after in pairwise(microbatches):
            if after < before:
                raise ScheduleError(
                    f"stage {stage}: {name} must be in ascending micro-batch order, "
                    f"but {Task(kind, after)!r} comes after {Task(kind, before)!r}"
                )
    for task in tasks:
        k = task.microbatch
        backward = next((t for t in (Task(Kind.B, k), Task(Kind.I, k)) if t in position), None)
        if task.kind in (Kind.R, *_BACKWARD) and not position[Task(Kind.F, k)] < position[task]:
            raise ScheduleError(f"stage {stage}: {task!r} must come after F{k}")
        if task.kind is Kind.R and backward is not None and not position[task] < position[backward]:
            raise ScheduleError(f"stage {stage}: {task!r} must come before {backward!r}")
        if task.kind is Kind.W and not position[Task(Kind.I, k)] < position[task]:
            raise ScheduleError(f"stage {stage}: {task!r} must come after I{k}")


def _check_deadlock(schedule: Schedule, ranks: tuple[int, ...]) -> None:
    """Run every rank's list in order symbolically; raise naming the blocked tasks if none can progress."""
    num_stages = len(ranks)
    done: set[tuple[int, Kind, int]] = set()
    heads = [0] * len(schedule)
    progressed = True
    while progressed:
        progressed = False
        for rank, tasks in enumerate(schedule):
            while heads[rank] < len(tasks) and _dependency_met(rank, tasks[heads[rank]], num_stages, done):
                task = tasks[heads[rank]]
                done.add((_stage(task, rank), task.kind, task.microbatch))
                heads[rank] += 1
                progressed = True
    blocked = [
        f"{'stage' if len(schedule) == num_stages else 'rank'} {r} at {schedule[r][heads[r]]!r}"
        for r in range(len(schedule)) if heads[r] < len(schedule[r])
    ]
    if blocked:
        raise ScheduleError("deadlock: no stage can progress; blocked " + ", ".join(blocked))


def _stage(task: Task, rank: int) -> int:
    return rank if task.stage is None else task.stage


def _dependency_met(rank: int, task: Task, num_stages: int, done: set[tuple[int, Kind, int]]) -> bool:
    """Whether the message ``task`` waits for (if any) has been sent."""
    stage = _stage(task, rank)
    if task.kind is Kind.F and stage > 0:
        return (stage - 1, task.kind, task.microbatch) in done
    if task.kind in _BACKWARD and stage < num_stages - 1:
        return (stage + 1, task.kind, task.microbatch) in done
    return True
