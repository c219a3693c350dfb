"""Where the stages of a pipeline of several model chunks per rank live: the looped and the V-shaped placement.

With ``v`` chunks per rank the model is cut into ``N = P v`` stages. In the *looped* placement rank ``r`` holds
stages ``r, r + P, ..., r + (v - 1) P``: a micro-batch goes round the ranks ``v`` times, and the edge from stage
``P - 1`` to ``P`` runs from the last rank back to the first (a link of its own for ``P > 2``). In the *V-shaped*
placement (``v = 2``) rank ``r`` holds stages ``r`` and ``2 P - 1 - r``: a micro-batch goes down the ranks and back
up, so every edge joins neighbouring ranks, and the edge between stages ``P - 1`` and ``P`` stays on rank ``P - 1``
(a *local* edge: the activation and its gradient are handed over in memory, no transfer). Each rank then holds the
first and the last of the remaining chunks, which evens out the memory a schedule holds per rank (the V schedule,
:mod:`~lightning_varuna.pipeline.scheduling.zero_bubble_v`, relies on it).

Which placement a schedule runs over is said by its entry in the schedule registry (:mod:`~.schedules`).
"""

from __future__ import annotations

from typing import Literal

__all__ = ["LOOPED", "PLACEMENTS", "V_SHAPED", "Placement", "placement_ranks", "rank_stages"]

Placement = Literal["looped", "v"]
LOOPED: Placement = "looped"
V_SHAPED: Placement = "v"
PLACEMENTS: tuple[Placement, ...] = (LOOPED, V_SHAPED)

def placement_ranks(num_ranks: int, stages_per_rank: int, placement: Placement = LOOPED) -> tuple[int, ...]:
    """The rank of each of the ``P v`` stages (see the module docstring).

    Raises:
        ValueError: For the V-shaped placement with ``v != 2``, or an unknown placement.
    """
    stages = range(num_ranks * stages_per_rank)
    if placement == LOOPED:
        return tuple(s % num_ranks for s in stages)
    if placement != V_SHAPED:
        raise ValueError(f"unknown placement {placement!r}; expected one of {', '.join(PLACEMENTS)}")
    if stages_per_rank != 2:
        raise ValueError(f"the V-shaped placement holds two stages per rank, got stages_per_rank={stages_per_rank}")
    return tuple(s if s < num_ranks else 2 * num_ranks - 1 - s for s in stages)


def rank_stages(rank: int, num_ranks: int, stages_per_rank: int, placement: Placement = LOOPED) -> tuple[int, ...]:
    """The stages rank ``rank`` holds, in pipeline order."""
    return tuple(s for s, r in enumerate(placement_ranks(num_ranks, stages_per_rank, placement)) if r == rank)
