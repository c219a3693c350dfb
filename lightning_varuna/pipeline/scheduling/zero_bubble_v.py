"""The V schedule: zero-bubble over two model chunks per rank in the V-shaped placement (``schedule="zero-bubble-v"``).

Rank ``r`` holds stages ``r`` and ``2 P - 1 - r`` (:mod:`~lightning_varuna.pipeline.scheduling.placement`): a
micro-batch goes down the ranks and back up, the edge between stages ``P - 1`` and ``P`` stays on rank ``P - 1``
(handed over in memory), and rank 0 holds both the first stage and the last, whose loss starts the backward. This is
the placement of ZB-V (Qi et al., *Pipeline Parallelism with Controllable Memory*, 2024), which torch ships as
``ScheduleZBVZeroBubble``.

:func:`zero_bubble_v_schedule` is the generator of ``schedule="zero-bubble"`` over two chunks
(:func:`~lightning_varuna.pipeline.scheduling.looped_zero_bubble.looped_zero_bubble_schedule`: a discrete-time
simulation with unit costs ``F = R = I = W = 1`` per chunk that starts, whenever a rank is idle, the first ready task
by priority ``I > R > F > W``, forwards of the later stage first, within the memory bound) run over the V-shaped
placement. Two properties, checked by the tests for ``P = 2..8``, ``m = 1..32``:

- **Time**: with unit costs and free communication no schedule of ``m >= P`` micro-batches takes less than
  ``6 m + P - 1`` ticks (rank ``P - 1`` gets its first input after ``P - 1`` forwards and has ``6 m`` ticks of work).
  The V reaches it for ``P <= 4`` and for ``P = 8, m`` in ``{8, 16, 32}``, and is within 4 ticks of it everywhere
  (87 ticks above it over the 217 shapes ``P = 2..8, m = P..32``); the looped placement is up to 10 ticks above
  (356 in all): it sends every micro-batch from rank ``P - 1`` back to rank 0 where the V keeps it on the rank.
- **Memory** (:func:`zero_bubble_v_bound`), in chunk graphs a rank holds at once: without recompute ``2 P`` until
  ``W``, half a stage each, so ``P`` stages' worth: the activation memory 1F1B holds on its first stage, on every
  rank (ZB-V's bound). With recompute one until ``I`` and two until ``W`` (three on rank 0, whose last-stage
  forwards keep their graphs), plus the stashed inputs.
"""

from __future__ import annotations

from lightning_varuna.pipeline.scheduling.looped_zero_bubble import (
    looped_zero_bubble_bound,
    looped_zero_bubble_schedule,
)
from lightning_varuna.pipeline.scheduling.placement import V_SHAPED
from lightning_varuna.pipeline.scheduling.tasks import Schedule

__all__ = ["zero_bubble_v_bound", "zero_bubble_v_schedule"]


def zero_bubble_v_bound(rank: int, num_ranks: int, recompute: bool) -> tuple[int, int]:
    """The most chunk graphs rank ``rank`` holds until their ``I`` and until their ``W`` (module docstring)."""
    return looped_zero_bubble_bound(rank, num_ranks, recompute, V_SHAPED)


def zero_bubble_v_schedule(num_ranks: int, num_microbatches: int, recompute: bool) -> Schedule:
    """The V schedule (see the module docstring).

    Args:
        num_ranks: ``P``.
        num_microbatches: ``m`` (any number from 1).
        recompute: Whether every stage but the last runs its forwards without autograd and recomputes before ``I``.

    Returns:
        Per rank its task list, every task naming its stage. Not validated.
    """
    return looped_zero_bubble_schedule(num_ranks, 2, num_microbatches, recompute, V_SHAPED)
