"""Several model chunks per rank: the looped placement and the interleaved 1F1B schedule.

With ``v`` chunks per rank (``stages_per_rank``) the model is cut into ``N = P * v`` stages and rank ``r`` holds
stages ``r, r + P, ..., r + (v - 1) P`` (the *looped* placement): a micro-batch goes round the ranks ``v`` times.
Each rank's task list names the stage of every task (:class:`~lightning_varuna.pipeline.scheduling.tasks.Task`'s
``stage``); stage ``N - 1`` is the last, and only it computes the loss.

:func:`interleaved_schedule` is Megatron-LM's interleaved 1F1B. Micro-batches go in rounds of ``P``: a rank runs
the forwards of one round through its chunks in order (``F0..F(P-1)`` on its first chunk, then on its second, ...),
and the backwards of a round through its chunks in reverse order. Rank ``r`` runs ``w = 2 (P - 1 - r) + (v - 1) P``
warm-up forwards (all of them when ``m = P``), then one forward and one backward alternately, then the remaining
backwards. Each chunk is ``1/v`` of a stage, so the pipeline fills and drains ``v`` times faster: the bubble of
1F1B divided by ``v``, for ``m`` a multiple of ``P``.

**Memory bound** (:func:`interleaved_memory_bound`), in micro-batches of one chunk's activations a rank holds at
once (a chunk is ``1/v`` of a stage): without recompute ``min(w + 1, m v)`` autograd graphs, so rank 0 holds
``2 (P - 1) + (v - 1) P + 1`` chunk graphs, ``(1 + (v - 1) / (2 v))`` times 1F1B's first stage for ``v`` chunks
of equal size, up to 1.5x for large ``v``; with recompute (every stage but the last runs its forwards without
autograd, keeping only its input, and recomputes right before its backward) one graph, two on the rank of the last
stage (``P`` when ``m = P``: every forward runs before the first backward), plus the stashed inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_varuna.pipeline.scheduling.tasks import Kind, Schedule, ScheduleError, Task

__all__ = [
    "interleaved_memory_bound",
    "interleaved_schedule",
    "interleaved_warmup",
    "looped_ranks",
    "looped_stages",
    "check_interleaved_sizes",
]


def looped_ranks(num_ranks: int, stages_per_rank: int) -> tuple[int, ...]:
    """The rank of each stage in the looped placement: stage ``s`` on rank ``s % P``."""
    return tuple(s % num_ranks for s in range(num_ranks * stages_per_rank))


def looped_stages(rank: int, num_ranks: int, stages_per_rank: int) -> tuple[int, ...]:
    """The stages rank ``rank`` holds in the looped placement, in pipeline order."""
    return tuple(rank + c * num_ranks for c in range(stages_per_rank))


def check_interleaved_sizes(num_ranks: int, stages_per_rank: int, num_microbatches: int) -> None:
    """Raises :class:`ScheduleError` naming the nearest valid choices unless the sizes can run interleaved.

    Interleaved 1F1B needs at least two chunks per rank and a number of micro-batches divisible by ``P`` (it runs
    them in rounds of ``P``).
    """
    if stages_per_rank < 2:
        raise ScheduleError(
            f"schedule='interleaved' needs stages_per_rank >= 2 (got {stages_per_rank}); use stages_per_rank=2, or"
            " schedule='1f1b' for one model chunk per rank."
        )
    if num_microbatches % num_ranks:
        lower = num_microbatches // num_ranks * num_ranks
        options = [n for n in (lower, lower + num_ranks) if n > 0]
        raise ScheduleError(
            f"schedule='interleaved' runs micro-batches in rounds of P={num_ranks}, but a step has {num_microbatches}"
            f" micro-batch(es); use num_microbatches={' or '.join(map(str, options))} (or a batch size that splits"
            " into that many)."
        )


def interleaved_warmup(rank: int, num_ranks: int, stages_per_rank: int, num_microbatches: int) -> int:
    """The number of forwards rank ``rank`` runs before its first backward (Megatron-LM's)."""
    total = num_microbatches * stages_per_rank
    if num_microbatches == num_ranks:
        return total
    return min(2 * (num_ranks - 1 - rank) + (stages_per_rank - 1) * num_ranks, total)


def interleaved_memory_bound(
    rank: int, num_ranks: int, stages_per_rank: int, num_microbatches: int, recompute: bool
) -> int:
    """The most autograd graphs (micro-batches of one chunk) rank ``rank`` holds at once (module docstring)."""
    if recompute:
        if rank < num_ranks - 1:
            return 1
        # the last stage keeps its forwards' graphs: all of one round's when the warm-up is every forward (m = P)
        return num_ranks if num_microbatches == num_ranks else 2
    total = num_microbatches * stages_per_rank
    return min(interleaved_warmup(rank, num_ranks, stages_per_rank, num_microbatches) + 1, total)


def interleaved_schedule(num_ranks: int, stages_per_rank: int, num_microbatches: int, recompute: bool) -> Schedule:
    """Megatron-LM's interleaved 1F1B over the looped placement (see the module docstring).

    With ``recompute`` every stage but the last runs ``R(k)`` right before its ``B(k)``; the run-time rules then let
    a forward whose input is there go ahead of a recompute whose gradient is late, as in Varuna's schedule.

    Args:
        num_ranks: ``P``.
        stages_per_rank: ``v`` (at least 2).
        num_microbatches: ``m``, a multiple of ``P``.
        recompute: Whether every stage but the last recomputes.

    Returns:
        Per rank its task list; every task names its stage. Not validated.
    """
    check_interleaved_sizes(num_ranks, stages_per_rank, num_microbatches)
    last = num_ranks * stages_per_rank - 1
    schedule = []
    for rank in range(num_ranks):
        total = num_microbatches * stages_per_rank
        warmup = interleaved_warmup(rank, num_ranks, stages_per_rank, num_microbatches)
        forwards = [_forward(i, rank, num_ranks, stages_per_rank) for i in range(total)]
        backwards = [_backward(i, rank, num_ranks, stages_per_rank, recompute, last) for i in range(total)]
        tasks: list[Task] = forwards[:warmup]
        for i in range(total - warmup):
            tasks.append(forwards[warmup + i])
            tasks += backwards[i]
        for i in range(total - warmup, total):
            tasks += backwards[i]
        schedule.append(tuple(tasks))
    return tuple(schedule)


def _chunk_and_microbatch(i: int, num_ranks: int, stages_per_rank: int, reverse: bool) -> tuple[int, int]:
    """The chunk and micro-batch of a rank's ``i``-th forward (or backward, chunks in reverse)."""
    group, position = divmod(i, num_ranks * stages_per_rank)
    chunk = position // num_ranks
    if reverse:
        chunk = stages_per_rank - 1 - chunk
    return chunk, group * num_ranks + position % num_ranks


def _forward(i: int, rank: int, num_ranks: int, stages_per_rank: int) -> Task:
    chunk, k = _chunk_and_microbatch(i, num_ranks, stages_per_rank, reverse=False)
    return Task(Kind.F, k, rank + chunk * num_ranks)


def _backward(i: int, rank: int, num_ranks: int, stages_per_rank: int, recompute: bool, last: int) -> list[Task]:
    chunk, k = _chunk_and_microbatch(i, num_ranks, stages_per_rank, reverse=True)
    stage = rank + chunk * num_ranks
    if recompute and stage != last:
        return [Task(Kind.R, k, stage), Task(Kind.B, k, stage)]
    return [Task(Kind.B, k, stage)]


def forward_only_looped(
    num_ranks: int, stages_per_rank: int, num_microbatches: int, ranks: Sequence[int] | None = None
) -> Schedule:
    """Evaluation over several chunks per rank: each rank runs its chunks' forwards in interleaved order.

    ``ranks`` is the rank of each stage (default: the looped placement).
    """
    if num_microbatches < 1:
        raise ScheduleError(f"num_microbatches must be at least 1, got {num_microbatches}")
    placed = looped_ranks(num_ranks, stages_per_rank) if ranks is None else tuple(ranks)
    rounds = range(0, num_microbatches, num_ranks)
    return tuple(
        tuple(
            Task(Kind.F, k, stage)
            for start in rounds
            for stage in (s for s, r in enumerate(placed) if r == rank)
            for k in range(start, min(start + num_ranks, num_microbatches))
        )
        for rank in range(num_ranks)
    )
