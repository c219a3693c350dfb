"""Pipeline schedules as data: per-stage ordered task lists, produced by pure functions and validated.

A schedule for ``P`` stages and ``m`` micro-batches is a tuple of ``P`` tuples of :class:`Task`. Stage ``s``
runs its tasks in that order, except where :func:`next_task` lets a forward whose input is there go ahead of a
recompute or backward whose gradient is late (Varuna's opportunistic rule), or while the next stage has run
out of work. Forwards keep their order among themselves, as do recomputes, backwards and weight-gradient tasks,
so every message between two stages keeps its order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from lightning_varuna.pipeline.scheduling.interleaved import (
    check_interleaved_sizes,
    forward_only_looped,
    interleaved_schedule,
)
from lightning_varuna.pipeline.scheduling.looped_zero_bubble import looped_zero_bubble_schedule
from lightning_varuna.pipeline.scheduling.placement import LOOPED, V_SHAPED, Placement, placement_ranks
from lightning_varuna.pipeline.scheduling.run_time_rules import next_task
from lightning_varuna.pipeline.scheduling.tasks import Kind, Schedule, ScheduleError, Task
from lightning_varuna.pipeline.scheduling.validation import check_sizes, validate_schedule
from lightning_varuna.pipeline.scheduling.zero_bubble import zero_bubble_schedule
from lightning_varuna.pipeline.scheduling.zero_bubble_v import zero_bubble_v_schedule

__all__ = [
    "Kind",
    "Task",
    "Schedule",
    "SCHEDULES",
    "ScheduleSpec",
    "make_schedule",
    "next_task",
    "validate_schedule",
    "ScheduleError",
    "forward_only_schedule",
    "gpipe_schedule",
    "one_f_one_b_schedule",
    "varuna_schedule",
    "zero_bubble_schedule",
    "interleaved_schedule",
    "check_schedule_shape",
    "placement_of",
    "schedule_spec",
    "stage_ranks",
]


@dataclass(frozen=True)
class ScheduleSpec:
    """A schedule by name: its generators and what it needs.

    Attributes:
        name: The name users give (``schedule=...``).
        one_chunk: The generator for one model chunk per rank, ``(P, m, recompute) -> Schedule``; None if the
            schedule runs only with several.
        chunked: The generator for ``v`` chunks per rank, ``(P, v, m, recompute) -> Schedule``; None if the schedule
            runs one chunk per rank only.
        split_backward: Whether its backward runs as an input-gradient task ``I`` and a weight-gradient task ``W``.
        chunk_counts: The chunks per rank it runs, ``(least, most)`` (``most`` None: no bound).
        placement: Where the stages of several chunks per rank live (:mod:`~.placement`).
        chunk_advice: What to use instead when ``stages_per_rank`` (its argument) is outside ``chunk_counts``.
    """

    name: str
    one_chunk: Callable[[int, int, bool], Schedule] | None
    chunked: Callable[[int, int, int, bool], Schedule] | None = None
    split_backward: bool = False
    chunk_counts: tuple[int, int | None] = (1, 1)
    placement: Placement = LOOPED
    chunk_advice: Callable[[int], str] = str

    @property
    def runs_several_chunks(self) -> bool:
        """Whether it runs several model chunks per rank."""
        return self.chunked is not None

    @property
    def needs_several_chunks(self) -> bool:
        """Whether it runs only with several model chunks per rank."""
        return self.one_chunk is None


def _zero_bubble_v(num_ranks: int, stages_per_rank: int, num_microbatches: int, recompute: bool) -> Schedule:
    return zero_bubble_v_schedule(num_ranks, num_microbatches, recompute)  # two chunks per rank, always


# Unit costs of Varuna's generating simulation (time ticks).
_UNIT_COST: dict[Kind, int] = {Kind.F: 1, Kind.R: 1, Kind.B: 2}


def schedule_spec(name: str) -> ScheduleSpec:
    """The registered schedule ``name``.

    Raises:
        ScheduleError: For an unknown name, listing the known ones.
    """
    spec = _SPECS.get(name)
    if spec is None:
        raise ScheduleError(f"unknown schedule {name!r}; expected one of {', '.join(SCHEDULES)}")
    return spec


def placement_of(schedule: str) -> Placement:
    """The placement ``schedule`` runs its stages over when a rank holds several."""
    return schedule_spec(schedule).placement


def stage_ranks(num_ranks: int, stages_per_rank: int, schedule: str = "") -> tuple[int, ...] | None:
    """The rank of each stage when ranks hold several (in the placement of ``schedule``); None for one per rank."""
    if stages_per_rank == 1:
        return None
    return placement_ranks(num_ranks, stages_per_rank, placement_of(schedule) if schedule else LOOPED)


def check_schedule_shape(name: str, num_ranks: int, stages_per_rank: int, num_microbatches: int | None) -> None:
    """Raises :class:`ScheduleError` naming the nearest valid choices if ``name`` cannot run this shape.

    ``num_microbatches`` None: not known yet (only the number of chunks is checked).
    """
    if stages_per_rank < 1:
        raise ScheduleError(f"stages_per_rank must be at least 1, got {stages_per_rank}")
    spec = schedule_spec(name)
    least, most = spec.chunk_counts
    if stages_per_rank > 1 and not spec.runs_several_chunks:
        several = sorted(n for n, s in _SPECS.items() if s.runs_several_chunks)
        raise ScheduleError(
            f"schedule={name!r} runs one model chunk per rank, but stages_per_rank={stages_per_rank}; use"
            f" one of {several} for several chunks per rank, or stages_per_rank=1."
        )
    if stages_per_rank < least or (most is not None and stages_per_rank > most):
        raise ScheduleError(f"schedule={name!r} {spec.chunk_advice(stages_per_rank)}")
    if name == "interleaved":
        check_interleaved_sizes(num_ranks, stages_per_rank, num_microbatches or num_ranks)


def make_schedule(
    name: str, num_stages: int, num_microbatches: int, recompute: bool, train: bool = True, stages_per_rank: int = 1,
    forwards_keep_graphs: bool = False,
) -> Schedule:
    """Build and validate the per-stage task lists of a pipeline schedule.

    Every schedule runs forwards and backwards in ascending micro-batch order on every stage, so the
    messages between two stages are sent and received in the same order. With ``recompute`` each non-last
    stage runs ``R(k)`` (the forward again, with autograd) somewhere after ``F(k)`` and before ``B(k)``; the
    last stage never recomputes. With ``train=False`` every stage runs ``F0 .. F(m-1)`` only.

    Args:
        name: One of :data:`SCHEDULES` (the registry at the end of this module says which generator each
            runs): ``"varuna"`` (see :func:`varuna_schedule`), ``"1f1b"`` (see :func:`one_f_one_b_schedule`),
            ``"gpipe"`` (see :func:`gpipe_schedule`), ``"zero-bubble"`` (see
            :func:`~lightning_varuna.pipeline.scheduling.zero_bubble.zero_bubble_schedule`), or one of the
            schedules of several chunks per rank (``stages_per_rank`` below).
        num_stages: Number of pipeline stages ``P`` (at least 1).
        num_microbatches: Number of micro-batches ``m`` per step (at least 1; may be smaller than ``P``).
        recompute: Whether non-last stages recompute their forward before the backward.
        train: ``False`` for a forward-only (evaluation) schedule.
        stages_per_rank: Model chunks per rank ``v``; with ``v > 1`` ``num_stages`` is the number of ranks ``P``,
            the model has ``P v`` stages in the schedule's placement (:func:`stage_ranks`), and every task names
            its stage (``"interleaved"``, see :func:`~.interleaved.interleaved_schedule`, ``"zero-bubble"``, see
            :func:`~.looped_zero_bubble.looped_zero_bubble_schedule`, or ``"zero-bubble-v"``, see
            :func:`~.zero_bubble_v.zero_bubble_v_schedule`).
        forwards_keep_graphs: With ``recompute``, whether forwards keep an autograd graph (recompute by degree
            keeps the later segments'): the forwards then run in the order of the schedule without recompute,
            which bounds the graphs they hold, and each ``R(k)`` right before the backward of ``k`` (see
            :func:`recompute_before_backward`). The recompute orders let forwards run ahead, each holding only
            its input.

    Returns:
        The validated schedule: one tuple of tasks per stage (per rank with ``stages_per_rank > 1``).

    Raises:
        ScheduleError: For an unknown name, a size below 1, or a shape the schedule cannot run (naming the
            nearest valid choices).
    """
    check_sizes(num_stages, num_microbatches)
    spec = schedule_spec(name)
    if spec.placement != LOOPED:  # before its placement is asked for v chunks per rank
        check_schedule_shape(name, num_stages, stages_per_rank, num_microbatches)
    ranks = stage_ranks(num_stages, stages_per_rank, name)
    split = train and spec.split_backward
    if recompute and train and forwards_keep_graphs:
        without = make_schedule(name, num_stages, num_microbatches, False, stages_per_rank=stages_per_rank)
        schedule = recompute_before_backward(without, num_stages * stages_per_rank)
        validate_schedule(schedule, num_microbatches, True, split_backward=split, stage_ranks=ranks)
        return schedule
    if ranks is not None or spec.one_chunk is None:
        if not train:
            schedule = forward_only_looped(num_stages, stages_per_rank, num_microbatches, ranks)
        else:
            check_schedule_shape(name, num_stages, stages_per_rank, num_microbatches)
            assert spec.chunked is not None  # checked above: it runs several chunks per rank
            schedule = spec.chunked(num_stages, stages_per_rank, num_microbatches, recompute)
        validate_schedule(schedule, num_microbatches, recompute, train=train, split_backward=split,
                          stage_ranks=ranks)
        return schedule
    if not train:
        schedule = forward_only_schedule(num_stages, num_microbatches)
    else:
        schedule = spec.one_chunk(num_stages, num_microbatches, recompute)
    validate_schedule(schedule, num_microbatches, recompute, train=train, split_backward=split)
    return schedule


def recompute_before_backward(schedule: Schedule, num_stages: int) -> Schedule:
    """``schedule`` (without recompute) with ``R(k)`` inserted right before each non-last stage's ``B(k)``/``I(k)``.

    No message moves, so the order stays deadlock-free; a stage holds the graphs its forwards keep as without
    recompute, plus one recomputed part at a time.

    Args:
        schedule: Task lists without recompute (one per stage, or per rank with tasks naming their stage).
        num_stages: The model's stages (``P v``); the last one never recomputes.
    """
    lists = []
    for rank, tasks in enumerate(schedule):
        out: list[Task] = []
        for task in tasks:
            stage = rank if task.stage is None else task.stage
            if task.kind in (Kind.B, Kind.I) and stage < num_stages - 1:
                out.append(Task(Kind.R, task.microbatch, task.stage))
            out.append(task)
        lists.append(tuple(out))
    return tuple(lists)


def _backward_steps(stage: int, num_stages: int, microbatch: int, recompute: bool) -> list[Task]:
    """``[R(k), B(k)]`` on a recomputing non-last stage, else ``[B(k)]``."""
    if recompute and stage < num_stages - 1:
        return [Task(Kind.R, microbatch), Task(Kind.B, microbatch)]
    return [Task(Kind.B, microbatch)]


def forward_only_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """Every stage runs ``F0 .. F(m-1)`` (evaluation: no recompute, no backward).

    Args:
        num_stages: Number of pipeline stages.
        num_microbatches: Number of micro-batches.

    Returns:
        The schedule (not validated).
    """
    forwards = tuple(Task(Kind.F, k) for k in range(num_microbatches))
    return tuple(forwards for _ in range(num_stages))


def gpipe_schedule(num_stages: int, num_microbatches: int, recompute: bool) -> Schedule:
    """GPipe: every stage runs all forwards, then its backwards in ascending order.

    Unlike the original GPipe (which runs backwards in reverse), backwards are ascending so gradients are
    received in the order they are sent. With ``recompute`` each backward of a non-last stage is preceded
    immediately by its recompute.

    Args:
        num_stages: Number of pipeline stages.
        num_microbatches: Number of micro-batches.
        recompute: Whether non-last stages recompute.

    Returns:
        The schedule (not validated).
    """
    stages = []
    for stage in range(num_stages):
        tasks = [Task(Kind.F, k) for k in range(num_microbatches)]
        for k in range(num_microbatches):
            tasks += _backward_steps(stage, num_stages, k, recompute)
        stages.append(tuple(tasks))
    return tuple(stages)


def one_f_one_b_schedule(num_stages: int, num_microbatches: int, recompute: bool) -> Schedule:
    """1F1B: a warm-up of forwards, then one forward and one backward alternately, then the rest.

    Stage ``s`` runs ``w = min(P-1-s, m)`` warm-up forwards, then ``F(w+i), B(i)`` for
    ``i = 0 .. m-w-1`` and finally the remaining backwards ``B(m-w) .. B(m-1)``. With ``recompute`` each
    backward of a non-last stage is preceded immediately by its recompute.

    Args:
        num_stages: Number of pipeline stages.
        num_microbatches: Number of micro-batches (any value, also below ``num_stages``).
        recompute: Whether non-last stages recompute.

    Returns:
        The schedule (not validated).
    """
    stages = []
    for stage in range(num_stages):
        warmup = min(num_stages - 1 - stage, num_microbatches)
        tasks = [Task(Kind.F, k) for k in range(warmup)]
        for i in range(num_microbatches - warmup):
            tasks.append(Task(Kind.F, warmup + i))
            tasks += _backward_steps(stage, num_stages, i, recompute)
        for k in range(num_microbatches - warmup, num_microbatches):
            tasks += _backward_steps(stage, num_stages, k, recompute)
        stages.append(tuple(tasks))
    return tuple(stages)


@dataclass
class _VarunaStage:
    """Mutable state of one stage in Varuna's generating simulation."""

    forwards: deque[int] = field(default_factory=deque)
    recomputes: deque[int] = field(default_factory=deque)
    backwards: deque[int] = field(default_factory=deque)
    gradients: set[int] = field(default_factory=set)
    running: Task | None = None
    busy_until: int = 0
    order: list[Task] = field(default_factory=list)


def varuna_schedule(num_stages: int, num_microbatches: int, recompute: bool) -> Schedule:
    """Varuna's schedule, generated by a discrete-time simulation with unit costs F=1, R=1, B=2.

    Each stage keeps three FIFO queues (forward, recompute, backward). The simulation advances in integer
    ticks ``t = 0, 1, 2, ...``; each tick has two phases:

    1. *Finish*: every task ending at ``t`` takes effect, visible to all stages at ``t``:

       - ``F(k)`` on ``s < P-1`` appends ``k`` to the forward queue of ``s+1``. On the last stage it
         appends ``k`` to its own backward queue (the last stage never recomputes). Without recompute it
         also appends ``k`` to the backward queue of ``s`` itself.
       - ``R(k)`` appends ``k`` to the backward queue of its stage.
       - ``B(k)`` on ``s > 0`` marks the gradient of ``k`` as arrived at ``s-1``.

    2. *Start*: stages ``0, 1, ..., P-1`` in that order, if idle, start the head of the first queue whose
       head is ready, by priority backward > recompute > forward. A forward or recompute head is always
       ready; a backward head ``B(k)`` on ``s < P-1`` is ready once the gradient of ``k`` has arrived.
       Starting ``B(k)`` on ``s > 0`` with recompute appends ``k`` to the recompute queue of ``s-1``.
       Because ``s-1`` has already chosen in this tick, it sees that recompute from tick ``t+1`` on: the
       recompute then runs while ``s`` finishes its backward, and the gradient arrives as it ends.

    For ``P=4, m=8`` with recompute this gives stage 0 ``F0..F7, R0 B0 .. R7 B7``, stage 1
    ``F0..F5, R0 B0 R1 B1 R2 B2, F6 F7, R3 B3 .. R7 B7``, stage 2 ``F0 F1 F2, R0 B0 R1 B1 R2 B2, F3 F4 F5,
    R3 B3 R4 B4 R5 B5, F6 F7, R6 B6 R7 B7`` and stage 3 ``F0 B0 F1 B1 .. F7 B7``.

    Args:
        num_stages: Number of pipeline stages.
        num_microbatches: Number of micro-batches.
        recompute: Whether non-last stages recompute.

    Returns:
        The schedule (not validated).

    Raises:
        ScheduleError: If the simulation does not finish (a bug, never expected).
    """
    check_sizes(num_stages, num_microbatches)
    stages = [_VarunaStage() for _ in range(num_stages)]
    stages[0].forwards.extend(range(num_microbatches))
    tasks_per_stage = [
        _stage_task_count(s, num_stages, num_microbatches, recompute) for s in range(num_stages)
    ]
    limit = 2 * sum(tasks_per_stage) * max(_UNIT_COST.values()) + 1
    for tick in range(limit):
        for stage in range(num_stages):
            _varuna_finish(stages, stage, tick, recompute)
        if all(
            len(st.order) == n and st.running is None for st, n in zip(stages, tasks_per_stage, strict=True)
        ):
            return tuple(tuple(st.order) for st in stages)
        for stage in range(num_stages):
            _varuna_start(stages, stage, tick, recompute)
    raise ScheduleError(f"varuna simulation did not finish for P={num_stages}, m={num_microbatches}")


def _stage_task_count(stage: int, num_stages: int, num_microbatches: int, recompute: bool) -> int:
    """Number of tasks of a training stage: F and B per micro-batch, plus R on recomputing stages."""
    per_microbatch = 3 if recompute and stage < num_stages - 1 else 2
    return per_microbatch * num_microbatches


def _varuna_finish(stages: list[_VarunaStage], stage: int, tick: int, recompute: bool) -> None:
    """Apply the effects of the task of ``stage`` that ends at ``tick``, if any."""
    state = stages[stage]
    task = state.running
    if task is None or state.busy_until != tick:
        return
    state.running = None
    last = stage == len(stages) - 1
    k = task.microbatch
    if task.kind is Kind.F:
        if last or not recompute:
            state.backwards.append(k)
        if not last:
            stages[stage + 1].forwards.append(k)
    elif task.kind is Kind.R:
        state.backwards.append(k)
    elif stage > 0:
        stages[stage - 1].gradients.add(k)


def _varuna_start(stages: list[_VarunaStage], stage: int, tick: int, recompute: bool) -> None:
    """Start the highest-priority ready task on ``stage`` if it is idle at ``tick``."""
    state = stages[stage]
    if state.running is not None:
        return
    last = stage == len(stages) - 1
    if state.backwards and (last or state.backwards[0] in state.gradients):
        task = Task(Kind.B, state.backwards.popleft())
        if recompute and stage > 0:
            stages[stage - 1].recomputes.append(task.microbatch)
    elif state.recomputes:
        task = Task(Kind.R, state.recomputes.popleft())
    elif state.forwards:
        task = Task(Kind.F, state.forwards.popleft())
    else:
        return
    state.running = task
    state.busy_until = tick + _UNIT_COST[task.kind]
    state.order.append(task)


_SPECS: dict[str, ScheduleSpec] = {spec.name: spec for spec in (
    ScheduleSpec("varuna", varuna_schedule),
    ScheduleSpec("1f1b", one_f_one_b_schedule),
    ScheduleSpec("gpipe", gpipe_schedule),
    ScheduleSpec("zero-bubble", zero_bubble_schedule, looped_zero_bubble_schedule, split_backward=True,
                 chunk_counts=(1, 2), chunk_advice=lambda v: f"runs one or two model chunks per rank, but"
                 f" stages_per_rank={v} (its memory bound is stated for those); use stages_per_rank=2, or"
                 " schedule='interleaved'."),
    # interleaved's own check names the sizes it runs (check_interleaved_sizes)
    ScheduleSpec("interleaved", None, interleaved_schedule, chunk_counts=(1, None)),
    ScheduleSpec("zero-bubble-v", None, _zero_bubble_v, split_backward=True, chunk_counts=(2, 2), placement=V_SHAPED,
                 chunk_advice=lambda v: f"runs two model chunks per rank (the V-shaped placement), but"
                 f" stages_per_rank={v}; use stages_per_rank=2, or schedule='zero-bubble' for"
                 f" {'one chunk' if v == 1 else 'the looped placement'}."),
)}
"""The schedule registry: each name, its generators and what it needs."""

SCHEDULES: tuple[str, ...] = tuple(_SPECS)
"""Every schedule's name, in the order the planner prefers among equals."""
