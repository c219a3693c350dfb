"""The run-time rules: which of a stage's pending tasks runs next when the head of its list waits for a message.

Apart from the schedules' generators, so that the simulator (which the generators use to compare their lists) and
the executor can import the rules without importing the generators.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lightning_varuna.pipeline.scheduling.tasks import Kind, Task

__all__ = ["next_task"]


def next_task(
    pending: Sequence[Task], arrived: Callable[[Task], bool], forwards_stash: bool | Callable[[Task], bool],
    feed_next_stage: bool = True,
) -> int:
    """Which of a stage's pending tasks to run next: Varuna's opportunistic rule, and ours to feed the next stage.

    The head of ``pending`` runs, unless it is ``R(k)``, ``B(k)`` or ``I(k)`` and the stage's first pending
    forward ``F(j)`` has its input there; then ``F(j)`` goes first if

    - the gradient for ``B(k)`` has not arrived (Varuna's rule: this stage would wait for it), or
    - with ``feed_next_stage``, the gradient for ``B(j-1)`` has arrived: the next stage has finished every
      micro-batch this stage sent it and waits for ``F(j)``. Varuna's static lists can hold a forward back
      behind recomputes and backwards whose gradients are on time, starving the stages downstream (stage 2 of
      ``P=4, m=8`` runs ``R3 B3 R4 B4 R5 B5`` before ``F6``); with unit costs this rule brings the list to the
      critical stage's bound (39 -> 38 ticks at ``P=4, m=8``).

    Only when ``forwards_stash`` (the stage's forwards run without autograd and keep only their input, so the
    stage holds no more autograd graphs): a forward that keeps a graph, as the kept segments' forward does with
    recompute by degree, would add one beyond the schedule's memory bound, ahead of a recompute as of a backward
    (moved ahead of every recompute whose gradient is late, a stage's forwards would all run before its first
    backward).

    ``W`` tasks never move: zero-bubble schedules hold them back on purpose, so that input gradients (the
    critical path) run as soon as their gradient is there; running a held-back ``W`` while waiting for a
    gradient delays the ``I`` whenever the gradient arrives during it, which in simulation with random message
    delays cost more than the waits it filled.

    Only forwards move, and only ahead of recomputes and backwards: each kind keeps its order, so every message
    between two stages keeps its order, and a move only sends an activation earlier, so a schedule that cannot
    deadlock in list order cannot deadlock with the moves. (Moving a recompute ahead of a late forward instead
    delays the pipeline's fill whenever the input is only a little late; it gained nothing in simulation or in the
    emulated benchmark.)

    Args:
        pending: The stage's remaining tasks, in schedule order (not empty).
        arrived: Whether the message a task waits for is there: the activation for ``F(k)`` (always on the
            first stage), the gradient for ``B(k)`` or ``I(k)`` (always on the last stage, and for one that has
            run). Not asked for ``R`` and ``W`` tasks.
        forwards_stash: Whether the stage's forwards run without autograd (recompute on a non-last stage); on a
            rank with several stages, a function of the forward task (a forward that builds a graph never moves).
        feed_next_stage: Whether a forward also goes first when the next stage has nothing left to do.

    Returns:
        The index in ``pending`` of the task to run (0 when the head runs, or must be waited for).
    """
    head = pending[0]
    if head.kind in (Kind.F, Kind.W):
        return 0
    if callable(forwards_stash):
        forward = _forward_first(pending, arrived, feed_next_stage)
        if forward is not None and (head.kind is Kind.R or forwards_stash(head)) and forwards_stash(pending[forward]):
            return forward
        return 0
    if forwards_stash:  # a forward that builds a graph (recompute by degree) never moves, not even ahead of R
        forward = _forward_first(pending, arrived, feed_next_stage)
        if forward is not None:
            return forward
    return 0


def _forward_first(pending: Sequence[Task], arrived: Callable[[Task], bool], feed_next_stage: bool) -> int | None:
    """The index of the first pending forward if it goes ahead of the head (see :func:`next_task`), else None."""
    head = pending[0]
    forward = next((i for i, task in enumerate(pending) if task.kind is Kind.F), None)
    if forward is None or not arrived(pending[forward]):
        return None
    if not arrived(Task(Kind.B, head.microbatch, head.stage)):
        return forward
    first = pending[forward]
    if feed_next_stage and first.microbatch > 0 and arrived(Task(Kind.B, first.microbatch - 1, first.stage)):
        return forward
    return None
