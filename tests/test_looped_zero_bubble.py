"""Zero-bubble over several model chunks per rank: properties of the generator, its speed, its p2p plan."""

from __future__ import annotations

import random

import pytest

from lightning_varuna.pipeline.scheduling.looped_zero_bubble import looped_zero_bubble_bound
from lightning_varuna.pipeline.scheduling.nccl_replay import plan_trace, replay
from lightning_varuna.pipeline.scheduling.schedules import Kind, ScheduleError, Task, make_schedule, stage_ranks
from lightning_varuna.pipeline.scheduling.simulator import StageCosts, simulate


def _random_delays(seed: int):
    draws, table = random.Random(seed), {}
    return lambda *message: table.setdefault(message, draws.expovariate(2.0))


def _peaks(tasks: tuple[Task, ...], recomputing: set[int]) -> tuple[int, int]:
    """The most chunk graphs a rank holds at once until their ``I`` and until their ``W``."""
    until_i = until_w = peak_i = peak_w = 0
    for task in tasks:
        builds = Kind.R if task.stage in recomputing else Kind.F
        if task.kind is builds:
            until_i, until_w = until_i + 1, until_w + 1
            peak_i, peak_w = max(peak_i, until_i), max(peak_w, until_w)
        elif task.kind is Kind.I:
            until_i -= 1
        elif task.kind is Kind.W:
            until_w -= 1
    return peak_i, peak_w


def _unit_costs(stages: int, v: int) -> list[StageCosts]:
    # a stage's F = 1, B = 2 split evenly into I and W, over its v chunks
    return [StageCosts(forward=1 / v, backward=2 / v, weight=1 / v)] * stages


@pytest.mark.parametrize("recompute", [False, True])
def test_every_shape_validates_and_keeps_its_memory_bound_in_list_order_and_under_the_run_time_rules(
    recompute: bool,
) -> None:
    for ranks in range(2, 9):
        for v in (2,):  # one chunk per rank: tests/test_schedules.py
            stages = ranks * v
            placement = stage_ranks(ranks, v)
            recomputing = set(range(stages - 1)) if recompute else set()
            for m in range(1, 33):
                schedule = make_schedule("zero-bubble", ranks, m, recompute, stages_per_rank=v)  # validates
                run = simulate(schedule, _unit_costs(stages, v), jitter=_random_delays(ranks * 1000 + m),
                               opportunistic=True, stage_ranks=placement).order
                for rank in range(ranks):
                    bound = looped_zero_bubble_bound(rank, ranks, recompute)
                    for order in (schedule[rank], run[rank]):
                        peak = _peaks(order, recomputing)
                        assert peak[0] <= bound[0] and peak[1] <= bound[1], (ranks, v, m, rank, peak, bound)


def test_it_is_faster_than_interleaved_and_one_chunk_zero_bubble_with_and_without_recompute() -> None:
    # unit costs, free communication; a step of m micro-batches with m >= P
    for ranks in range(2, 9):
        for m in range(2 * ranks, 33, ranks):
            placement, costs = stage_ranks(ranks, 2), _unit_costs(2 * ranks, 2)
            for recompute in (False, True):
                ours = simulate(make_schedule("zero-bubble", ranks, m, recompute, stages_per_rank=2), costs,
                                stage_ranks=placement).makespan
                interleaved = simulate(make_schedule("interleaved", ranks, m, recompute, stages_per_rank=2), costs,
                                       stage_ranks=placement).makespan
                one_chunk = simulate(make_schedule("zero-bubble", ranks, m, recompute),
                                     [StageCosts(forward=1, backward=2, weight=1)] * ranks).makespan
                assert ours <= interleaved and ours <= one_chunk, (ranks, m, recompute, ours, interleaved, one_chunk)
    # the numbers the user guide quotes
    placement, costs = stage_ranks(4, 2), _unit_costs(8, 2)
    assert simulate(make_schedule("zero-bubble", 4, 8, False, stages_per_rank=2), costs,
                    stage_ranks=placement).makespan == pytest.approx(26)


def test_three_chunks_per_rank_are_refused_with_what_to_use() -> None:
    with pytest.raises(ScheduleError, match="use stages_per_rank=2, or schedule='interleaved'"):
        make_schedule("zero-bubble", 4, 8, False, stages_per_rank=3)


@pytest.mark.parametrize("recompute", [False, True])
def test_every_plan_passes_the_nccl_rules(recompute: bool) -> None:
    for ranks in range(2, 6):
        placement = stage_ranks(ranks, 2)
        for m in range(1, 2 * ranks + 2):
            schedule = make_schedule("zero-bubble", ranks, m, recompute, stages_per_rank=2)
            transfers = replay(plan_trace(schedule, placement, summary=True))
            boundaries = 2 * ranks - 1
            assert transfers == boundaries * (2 * m + 1) + ranks - 1, (ranks, m)
