"""Zero-bubble schedules: the backward split into input-gradient (``I``) and weight-gradient (``W``) tasks.

A stage's backward of micro-batch ``k`` runs as ``I(k)``, which computes the gradient of the stage's input and
sends it to the previous stage, and ``W(k)``, which computes the weight gradients and sends nothing (Qi et al.,
*Zero Bubble Pipeline Parallelism*, ICLR 2024). Only ``I`` is on the pipeline's critical path, so a stage can
hold its ``W`` tasks back and run them where it would otherwise wait.

:func:`zero_bubble_schedule` takes one of two lists. Without recompute, the one whose step stays nearest the better
of the two whatever share of a backward ``W`` takes
(:func:`~lightning_varuna.pipeline.scheduling.simulator.most_robust`; up to ``m = 32`` that is the first list for
every ``m`` above about ``1.4 P``: at ``P = 4`` every ``m >= 6``, at ``P = 8`` every ``m >= 12``): the
**1F1B-ordered** list (ZB-H1's order): 1F1B's forwards and input gradients, each ``W`` right after its ``I``. It does
not count on a ``W`` to fill the time a gradient takes to come back, so neither a ``W`` shorter than its ``I`` nor a
late message costs it much: where ``W`` is a fifth of the backward it is 20% shorter than the packed list at
``P = 4, m = 32`` (103.8 against 130.4 ticks), with random message delays of up to half a forward 15% (103.5
against 121.4), and one tick longer with ``I = W`` and no delays (102 against 101). Otherwise, and always with
recompute, the **packed** list of a discrete-time simulation with unit costs (``F = R = I = W = 1``: a backward
costs two forwards, split evenly), which starts every task at the first tick it can run, so that each message is
needed as it arrives. Whenever a stage is
idle it starts the first ready task by priority ``I > R > F > W``:

- ``I(k)`` is ready once the gradient of ``k`` has arrived (on the last stage once ``F(k)`` is done) and, with
  recompute, ``R(k)`` is done.
- ``R(k)`` (recompute, on non-last stages) is ready once the next stage has started ``I(k)``, Varuna's trigger:
  the recompute then runs while the gradient is being made downstream.
- ``F(k)`` is ready once its input has arrived and the stage holds fewer micro-batches than its memory bound
  (on a recomputing stage: fewer than ``P - s`` forwarded and not yet through ``I``, 1F1B's warm-up, so that the
  inputs stashed for recompute do not grow with ``m``).
- ``W(k)`` is ready once ``I(k)`` is done; the oldest runs first.

**Memory bound** (:func:`memory_bound`), in micro-batches of activations a stage holds at once. A micro-batch
is held in full until its ``I`` (the autograd graph) and in part until its ``W`` (the inputs of the layers whose
weight gradients ``W`` computes, and the gradients of their outputs):

- without recompute, stage ``s`` of ``P`` holds at most ``P - s`` micro-batches until their ``I``, as 1F1B does
  until their ``B``, and at most ``P`` until their ``W``: no stage holds more than 1F1B's first stage, so the
  largest memory over the stages, which decides whether a job fits, is 1F1B's. This is ZB-H1 of the paper,
  which counts the same way;
- with recompute, forwards of non-last stages keep only their input (like Varuna's) and a micro-batch's autograd
  graph lives from the start of ``R(k)`` (``F(k)`` on the last stage, which never recomputes): every stage holds
  at most one micro-batch until its ``W``, as 1F1B and Varuna's schedule with recompute hold one graph at a time
  until its backward. ``R(k + 1)`` waits for ``W(k)``: a held-back ``W`` runs in the wait for the next gradient,
  never beside the next graph, so recompute with zero-bubble needs no more memory than recompute with 1F1B.
  (Letting ``W(k)`` wait past ``R(k + 1)`` gains one ``W`` per step, but holds ``W(k)``'s inputs and output
  gradients, most of a block's activations, beside the whole next graph: with the stash unbounded, 1.3x the
  peak on the emulated model.)

With unit costs the first stage waits one ``F + I`` per stage after its warm-up (the first gradient travels back
through ``I`` tasks only, half a backward each) where 1F1B waits one ``F + B``: at ``P = 4, m = 8`` the makespan is
30 ticks (the packed list: 29) against 1F1B's 33, and 36 with recompute against 38 for Varuna's schedule and
1F1B's, at their memory. The 1F1B-ordered list holds ``P - s`` micro-batches until their ``W`` on stage ``s``, within
the bound above.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_varuna.pipeline.scheduling.simulator import most_robust
from lightning_varuna.pipeline.scheduling.tasks import Kind, Schedule, ScheduleError, Task

__all__ = ["MemoryBound", "memory_bound", "zero_bubble_schedule"]


@dataclass(frozen=True)
class MemoryBound:
    """The most micro-batches a stage holds at once (see the module docstring).

    A micro-batch counts from the start of the task that builds its autograd graph (``R`` on a recomputing
    stage, else ``F``); stashed inputs of forwards run without autograd are not counted.

    Attributes:
        until_input_grad: Micro-batches whose ``I`` has not ended (held in full).
        until_weight_grad: Micro-batches whose ``W`` has not ended (held in full or in part).
        forwarded: Micro-batches forwarded whose ``I`` has not ended, their graphs or (on a recomputing stage)
            their stashed inputs; in list order (the run-time rules may run a stashing forward early, as they
            do in every schedule with recompute, rather than wait).
    """

    until_input_grad: int
    until_weight_grad: int
    forwarded: int


def memory_bound(stage: int, num_stages: int, recompute: bool) -> MemoryBound:
    """The memory bound of stage ``stage`` in the zero-bubble schedule (see the module docstring)."""
    if recompute:
        return MemoryBound(1, 1, num_stages - stage)
    return MemoryBound(num_stages - stage, num_stages, num_stages - stage)


@dataclass
class _Stage:
    """One stage's state in the generating simulation."""

    bound: MemoryBound
    recomputes: bool
    inputs: set[int] = field(default_factory=set)
    gradients: set[int] = field(default_factory=set)
    triggered: set[int] = field(default_factory=set)
    """Micro-batches whose ``I`` the next stage has started (their ``R`` may run)."""
    forwarded: int = 0
    recomputed: int = 0
    input_grads: int = 0
    weight_grads: int = 0
    running: Task | None = None
    busy_until: int = 0
    order: list[Task] = field(default_factory=list)

    def may_build_graph(self) -> bool:
        """Whether one more autograd graph stays within :attr:`bound`."""
        built = self.recomputed if self.recomputes else self.forwarded
        return (built - self.input_grads < self.bound.until_input_grad
                and built - self.weight_grads < self.bound.until_weight_grad)


def zero_bubble_schedule(num_stages: int, num_microbatches: int, recompute: bool) -> Schedule:
    """The zero-bubble schedule for one stage per rank (see the module docstring).

    Args:
        num_stages: Number of pipeline stages ``P``.
        num_microbatches: Number of micro-batches ``m``.
        recompute: Whether non-last stages run their forwards without autograd and recompute before ``I``.

    Returns:
        The schedule (not validated): per stage ``F``, ``I`` and ``W`` of every micro-batch, and ``R`` on
        recomputing stages.

    Raises:
        ScheduleError: If the simulation does not finish (a bug, never expected).
    """
    if num_stages < 1 or num_microbatches < 1:
        raise ScheduleError(f"sizes must be at least 1, got P={num_stages}, m={num_microbatches}")
    packed = _packed_schedule(num_stages, num_microbatches, recompute)
    if recompute:
        return packed
    ordered = tuple(_ordered_stage(s, num_stages, num_microbatches) for s in range(num_stages))
    return most_robust((ordered, packed))


def _ordered_stage(stage: int, num_stages: int, num_microbatches: int) -> tuple[Task, ...]:
    """Stage ``stage``'s 1F1B-ordered list: 1F1B's forwards and input gradients, each ``W`` right after its ``I``."""
    warmup = min(num_stages - stage - 1, num_microbatches)
    tasks = [Task(Kind.F, k) for k in range(warmup)]
    for k in range(num_microbatches):
        if k + warmup < num_microbatches:
            tasks.append(Task(Kind.F, k + warmup))
        tasks += [Task(Kind.I, k), Task(Kind.W, k)]
    return tuple(tasks)


def _packed_schedule(num_stages: int, num_microbatches: int, recompute: bool) -> Schedule:
    """The list of the generating simulation (module docstring)."""
    last = num_stages - 1
    stages = [
        _Stage(memory_bound(s, num_stages, recompute), recompute and s < last) for s in range(num_stages)
    ]
    stages[0].inputs.update(range(num_microbatches))
    per_stage = [num_microbatches * (4 if st.recomputes else 3) for st in stages]
    for tick in range(4 * sum(per_stage) + 1):
        for s in range(num_stages):
            _finish(stages, s, tick)
        if all(len(st.order) == n and st.running is None for st, n in zip(stages, per_stage, strict=True)):
            return tuple(tuple(st.order) for st in stages)
        for s in range(num_stages):
            _start(stages, s, tick, num_microbatches)
    raise ScheduleError(f"zero-bubble simulation did not finish for P={num_stages}, m={num_microbatches}")


def _finish(stages: list[_Stage], s: int, tick: int) -> None:
    """Applies the effects of the task of stage ``s`` that ends at ``tick``, if any."""
    state = stages[s]
    task = state.running
    if task is None or state.busy_until != tick:
        return
    state.running = None
    if task.kind is Kind.F and s + 1 < len(stages):
        stages[s + 1].inputs.add(task.microbatch)
    elif task.kind is Kind.I and s > 0:
        stages[s - 1].gradients.add(task.microbatch)


def _start(stages: list[_Stage], s: int, tick: int, num_microbatches: int) -> None:
    """Starts the first ready task of stage ``s`` by priority ``I > R > F > W``, if the stage is idle."""
    state = stages[s]
    if state.running is not None:
        return
    task = _choose(state, s == len(stages) - 1, num_microbatches)
    if task is None:
        return
    k = task.microbatch
    if task.kind is Kind.I:
        state.input_grads += 1
        if s > 0 and stages[s - 1].recomputes:
            stages[s - 1].triggered.add(k)
    elif task.kind is Kind.R:
        state.recomputed += 1
    elif task.kind is Kind.F:
        state.forwarded += 1
    else:
        state.weight_grads += 1
    state.running = task
    state.busy_until = tick + 1
    state.order.append(task)


def _choose(state: _Stage, last: bool, num_microbatches: int) -> Task | None:
    """The task stage ``state`` starts now, or None (see :func:`zero_bubble_schedule`)."""
    k = state.input_grads
    if k < num_microbatches and k < state.forwarded and (not state.recomputes or k < state.recomputed) and (
            last or k in state.gradients):
        return Task(Kind.I, k)
    r = state.recomputed
    if state.recomputes and r < state.forwarded and r in state.triggered and state.may_build_graph():
        return Task(Kind.R, r)
    f = state.forwarded
    if (f < num_microbatches and f in state.inputs and f - state.input_grads < state.bound.forwarded
            and (state.recomputes or state.may_build_graph())):
        return Task(Kind.F, f)
    if state.weight_grads < state.input_grads:
        return Task(Kind.W, state.weight_grads)
    return None
