"""The V schedule: zero-bubble over two model chunks per rank in the V-shaped placement (``schedule="zero-bubble-v"``).

Rank ``r`` holds stages ``r`` and ``2 P - 1 - r`` (:mod:`~lightning_varuna.pipeline.scheduling.placement`): a
micro-batch goes down the ranks and back up, the edge between stages ``P - 1`` and ``P`` stays on rank ``P - 1``
(handed over in memory), and rank 0 holds both the first stage and the last, whose loss starts the backward. This is
the placement of ZB-V (Qi et al., *Pipeline Parallelism with Controllable Memory*, 2024), which torch ships as
``ScheduleZBVZeroBubble``.

Two generators, and :func:`zero_bubble_v_schedule` takes the better list:

- **Phased** (without recompute): the V's own pattern (the paper's ZB-V). Rank ``r`` first runs ``2 (P - r) - 1``
  forwards of its down stage ``r`` (the first micro-batch comes back up to rank ``r`` after that many down-stage
  ticks), then ``r`` pairs of up- and down-stage forwards, then ``P - r`` up-stage ``F I W`` triples; in the steady
  state it alternates a down-stage ``F I W`` with an up-stage ``F I W``; in the drain it holds the ``W`` tasks of
  ``r`` micro-batches back and runs them last, where the pipeline empties. A task of the steady state waits for a
  message sent a whole triple earlier, so a late message costs the step little: under random message delays this
  list loses less than half what the greedy one loses (the tests measure it), a fifth at ``P = 8, m = 32``.
- **Greedy** (every case with recompute, and the few shapes where it is shorter: ``m`` below about ``1.4 P``):
  :func:`~lightning_varuna.pipeline.scheduling.looped_zero_bubble.greedy_chunk_schedule` (a discrete-time
  simulation with unit costs ``F = R = I = W = 1`` per chunk that starts, whenever a rank is idle, the first ready
  task by priority ``I > R > F > W``, forwards of the later stage first, within the memory bound) run over the
  V-shaped placement. It packs every task at the first tick it can run, so each message arrives just in time.

The choice is by the simulated step with unit costs and free communication (ties go to the phased list), the same
on every rank. Two properties, checked by the tests for ``P = 2..8``, ``m = 1..32``:

- **Time**: with unit costs and free communication no schedule of ``m >= P`` micro-batches takes less than
  ``6 m + P - 1`` ticks (rank ``P - 1`` gets its first input after ``P - 1`` forwards and has ``6 m`` ticks of work).
  The V reaches it for ``P <= 4`` and for ``m >= 2 P - 1``, and is within 4 ticks of it everywhere; the looped
  placement is up to 10 ticks above it: it sends every micro-batch from rank ``P - 1`` back to rank 0 where the V
  keeps it on the rank.
- **Memory** (:func:`zero_bubble_v_bound`), in chunk graphs a rank holds at once: without recompute ``2 P`` until
  ``W``, half a stage each, so ``P`` stages' worth: the activation memory 1F1B holds on its first stage, on every
  rank (ZB-V's bound). With recompute one until ``I`` and two until ``W`` (three on rank 0, whose last-stage
  forwards keep their graphs), plus the stashed inputs.
"""

from __future__ import annotations

from lightning_varuna.pipeline.scheduling.looped_zero_bubble import greedy_chunk_schedule, looped_zero_bubble_bound
from lightning_varuna.pipeline.scheduling.placement import V_SHAPED, placement_ranks
from lightning_varuna.pipeline.scheduling.simulator import unit_step
from lightning_varuna.pipeline.scheduling.tasks import Kind, Schedule, Task

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
    greedy = greedy_chunk_schedule(num_ranks, 2, num_microbatches, recompute, V_SHAPED)
    if recompute:
        return greedy
    phased = tuple(_phased_rank(rank, num_ranks, num_microbatches) for rank in range(num_ranks))
    placement = placement_ranks(num_ranks, 2, V_SHAPED)
    return phased if unit_step(phased, placement) <= unit_step(greedy, placement) else greedy


class _RankList:
    """One rank's task list under construction: the next micro-batch of each (stage, kind) is counted."""

    def __init__(self, down: int, up: int) -> None:
        self.down, self.up = down, up
        self.tasks: list[Task] = []
        self.next: dict[tuple[int, Kind], int] = {}

    def add(self, stage: int, *kinds: Kind) -> None:
        for kind in kinds:
            k = self.next.get((stage, kind), 0)
            self.tasks.append(Task(kind, k, stage))
            self.next[stage, kind] = k + 1

    def count(self, stage: int, kind: Kind) -> int:
        return self.next.get((stage, kind), 0)


def _phased_rank(rank: int, num_ranks: int, num_microbatches: int) -> tuple[Task, ...]:
    """Rank ``rank``'s list of the phased V (module docstring).

    The pattern needs ``2 P - 1`` micro-batches to fill the V; with fewer it is built for ``2 P - 1`` and the tasks
    of micro-batches that do not exist are left out (they only ever follow the real ones of their stage and kind).
    """
    n = max(num_microbatches, 2 * num_ranks - 1)
    ranks_below = num_ranks - rank
    lst = _RankList(down=rank, up=2 * num_ranks - 1 - rank)
    fwd, inp, wgt = Kind.F, Kind.I, Kind.W
    for _ in range(2 * ranks_below - 1):
        lst.add(lst.down, fwd)
    for _ in range(rank):
        lst.add(lst.up, fwd)
        lst.add(lst.down, fwd)
    for _ in range(ranks_below):
        lst.add(lst.up, fwd, inp, wgt)
    while lst.count(lst.down, fwd) < n or lst.count(lst.up, fwd) < n:
        if lst.count(lst.down, fwd) < n:
            lst.add(lst.down, fwd)
        lst.add(lst.down, inp, wgt)
        lst.add(lst.up, fwd, inp, wgt)
    for _ in range(rank):  # the W of these micro-batches is held back to the end, where the pipeline drains
        lst.add(lst.down, inp)
        lst.add(lst.up, inp)
    for _ in range(ranks_below):
        lst.add(lst.down, inp, wgt)
    for stage in (lst.up, lst.down):
        while lst.count(stage, wgt) < n:
            lst.add(stage, wgt)
    return tuple(task for task in lst.tasks if task.microbatch < num_microbatches)
