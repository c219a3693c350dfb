"""The V schedule over the V-shaped placement: its generator's properties, its speed, its message order."""

from __future__ import annotations

import statistics

import pytest
import torch
from helpers.schedules import peak_graphs_until_i_and_w, random_delays, tied_partition

from lightning_varuna.failstop.failures import PipelineError
from lightning_varuna.pipeline.config import EngineConfig
from lightning_varuna.pipeline.runtime.links import LocalLink
from lightning_varuna.pipeline.scheduling.looped_zero_bubble import greedy_chunk_schedule
from lightning_varuna.pipeline.scheduling.lowering import Message, MessageKind, link_messages, summary_path
from lightning_varuna.pipeline.scheduling.nccl_replay import plan_trace, replay
from lightning_varuna.pipeline.scheduling.placement import V_SHAPED, placement_ranks, rank_stages
from lightning_varuna.pipeline.scheduling.schedules import ScheduleError, make_schedule, stage_ranks
from lightning_varuna.pipeline.scheduling.simulator import StageCosts, simulate
from lightning_varuna.pipeline.scheduling.zero_bubble_v import zero_bubble_v_bound

V = "zero-bubble-v"
CHUNK = StageCosts(forward=1, backward=2, weight=1)
"""Unit costs per chunk: F = I = W = 1."""
STAGE = StageCosts(forward=2, backward=4, weight=2)
"""A stage of one chunk per rank holds two chunks' work."""


def test_the_v_shaped_placement() -> None:
    assert placement_ranks(4, 2, "v") == (0, 1, 2, 3, 3, 2, 1, 0) == stage_ranks(4, 2, V)
    assert rank_stages(0, 4, 2, "v") == (0, 7) and rank_stages(3, 4, 2, "v") == (3, 4)
    assert stage_ranks(4, 2, "zero-bubble") == (0, 1, 2, 3, 0, 1, 2, 3)
    with pytest.raises(ValueError, match="two stages per rank"):
        placement_ranks(4, 3, "v")


@pytest.mark.parametrize("recompute", [False, True])
def test_every_shape_validates_and_keeps_its_memory_bound_in_list_order_and_under_the_run_time_rules(
    recompute: bool,
) -> None:
    for ranks in range(2, 9):
        stages, placement = 2 * ranks, stage_ranks(ranks, 2, V)
        recomputing = set(range(stages - 1)) if recompute else set()
        for m in range(1, 33):
            schedule = make_schedule(V, ranks, m, recompute, stages_per_rank=2)  # validates
            run = simulate(schedule, [CHUNK] * stages, jitter=random_delays(ranks * 1000 + m), opportunistic=True,
                           stage_ranks=placement).order
            for rank in range(ranks):
                bound = zero_bubble_v_bound(rank, ranks, recompute)
                for order in (schedule[rank], run[rank]):
                    peak = peak_graphs_until_i_and_w(order, recomputing)
                    assert peak[0] <= bound[0] and peak[1] <= bound[1], (ranks, m, rank, peak, bound)


def test_the_bound_is_1f1b_s_first_stage_on_every_rank() -> None:
    # 2P chunk graphs of half a stage each: P stages' worth, what 1F1B holds on its first stage (and only there)
    for ranks in range(2, 9):
        assert {zero_bubble_v_bound(r, ranks, False) for r in range(ranks)} == {(2 * ranks, 2 * ranks)}
        assert zero_bubble_v_bound(0, ranks, True) == (2, 3)  # rank 0 holds the last stage, which never recomputes
        assert {zero_bubble_v_bound(r, ranks, True) for r in range(1, ranks)} == {(1, 2)}


def test_a_step_takes_the_least_time_any_schedule_can_or_close() -> None:
    # unit costs, free communication, m >= P: rank P-1 gets its first input after P-1 forwards and has 6m of work,
    # so no schedule takes less than 6m + P - 1; the V reaches it for P <= 4 and for m >= 2P - 1, and is within 4
    # ticks everywhere (in all, 13 ticks above the bound over these 217 shapes; the looped placement's lists: the
    # next test)
    excess = 0
    for ranks in range(2, 9):
        for m in range(ranks, 33):
            least = 6 * m + ranks - 1
            schedule = make_schedule(V, ranks, m, False, stages_per_rank=2)
            over = simulate(schedule, [CHUNK] * (2 * ranks), stage_ranks=stage_ranks(ranks, 2, V)).makespan - least
            assert over == 0 if ranks <= 4 or m >= 2 * ranks - 1 else 0 <= over <= 4, (ranks, m, over)
            excess += over
    assert excess == 13


@pytest.mark.full
def test_the_looped_placement_stays_above_that_least_time_by_what_its_lists_give_up() -> None:
    # the looped lists are made to hold up whatever share of the backward W takes, not for unit costs alone: 1034
    # ticks above the least time over the same 217 shapes, up to 16 at one shape (the V: 13 in all, at most 4)
    excess = 0
    for ranks in range(2, 9):
        for m in range(ranks, 33):
            schedule = make_schedule("zero-bubble", ranks, m, False, stages_per_rank=2)
            makespan = simulate(schedule, [CHUNK] * (2 * ranks),
                                stage_ranks=stage_ranks(ranks, 2, "zero-bubble")).makespan
            excess += makespan - (6 * m + ranks - 1)
    assert excess == 1034


# Simulated step time, unit costs per chunk (F = I = W = 1, B = 2); one chunk per rank: F = 2, B = 4. Without
# delays, and the mean over 20 seeds of exponential message delays of mean 0.5 (the run-time rules on).
#
#   P  m | zb-v  zb-looped  interleaved  1f1b  zb(1 chunk) | with delays: zb-v  zb-looped  interleaved  1f1b  zb
#   4  8 |   51     54         57         66      60       |              60.1    68.3       66.3      75.6  63.9
#   4 16 |   99    102        105        114     108       |             108.8   126.9      116.8     132.3 113.6
#   4 32 |  195    198        201        210     204       |             205.2   244.1      217.5     246.4 213.6
#   8  8 |   55     55         69         90      62       |              82.7    85.5       98.0     104.5  77.1
#   8 16 |  103    113        117        138     124       |             127.2   150.9      137.7     164.4 134.8
#   8 32 |  199    209        213        234     220       |             223.5   268.0      239.0     282.8 235.8
#
# The V's list is the phased one wherever m >= 2P - 1; the greedy list of the same shapes, with delays: 71.6, 136.6,
# 266.3, -, 159.6, 306.3 (it packs every task at the first tick it can run, so every message arrives just in time).
# Without recompute `zero-bubble` takes lists that do not count on W = I (test_schedules.py,
# test_looped_zero_bubble.py): one chunk per rank the 1F1B-ordered list wherever m >= 6 (P=4) or m >= 12 (P=8), where
# the packed list gave 58 / 106 / 202 / - / 114 / 210 without delays and 69.6 / 128.6 / 247.2 / - / 145.9 / 273.2
# with them; two chunks per rank the one made with W at 0.35 or a fifth of the backward, where the list made for
# I = W gave 52 / 102 / 197 / 55 / 108 / 204 and, with delays, 77.3 / 152.9 / 297.2 / 85.5 / 171.7 / 325.3.
COMPARED = {
    (4, 8): (51, 54, 57, 66, 60), (4, 16): (99, 102, 105, 114, 108), (4, 32): (195, 198, 201, 210, 204),
    (8, 8): (55, 55, 69, 90, 62), (8, 16): (103, 113, 117, 138, 124), (8, 32): (199, 209, 213, 234, 220),
}


def _step_times(ranks: int, m: int, jitter: bool) -> tuple[float, ...]:
    seeds = range(20) if jitter else (None,)
    chunks, one = [CHUNK] * (2 * ranks), [STAGE] * ranks
    runs = (
        (make_schedule(V, ranks, m, False, stages_per_rank=2), chunks, stage_ranks(ranks, 2, V)),
        (make_schedule("zero-bubble", ranks, m, False, stages_per_rank=2), chunks, stage_ranks(ranks, 2)),
        (make_schedule("interleaved", ranks, m, False, stages_per_rank=2), chunks, stage_ranks(ranks, 2)),
        (make_schedule("1f1b", ranks, m, False), one, None),
        (make_schedule("zero-bubble", ranks, m, False), one, None),
    )
    return tuple(
        statistics.mean(simulate(schedule, costs, jitter=None if seed is None else random_delays(seed),
                                 opportunistic=True, stage_ranks=placement).makespan for seed in seeds)
        for schedule, costs, placement in runs
    )


@pytest.mark.parametrize(("ranks", "m"), list(COMPARED))
def test_it_is_never_slower_than_the_looped_zero_bubble_with_or_without_delays(ranks: int, m: int) -> None:
    plain = _step_times(ranks, m, jitter=False)
    assert plain == COMPARED[(ranks, m)]
    # in these shapes the V reaches the least step time any schedule can (above): no other schedule beats it
    assert plain[0] == 6 * m + ranks - 1 == min(plain)
    delayed = _step_times(ranks, m, jitter=True)
    # with delays: one edge in 2P - 1 is local (no delay), and it loses less than the looped placement
    assert delayed[0] <= delayed[1], delayed
    assert delayed[0] / plain[0] < delayed[1] / plain[1]
    if m >= 2 * ranks - 1:  # the phased list: a message is sent a whole F I W triple before it is needed
        assert delayed[0] == min(delayed), delayed


@pytest.mark.parametrize(("ranks", "m"), [(4, 16), (8, 16), (8, 32)])
def test_late_messages_cost_the_phased_list_less_than_half_what_they_cost_the_greedy_one(ranks: int, m: int) -> None:
    chosen = make_schedule(V, ranks, m, False, stages_per_rank=2)
    greedy = greedy_chunk_schedule(ranks, 2, m, False, V_SHAPED)
    assert chosen != greedy
    placement, chunks = stage_ranks(ranks, 2, V), [CHUNK] * (2 * ranks)

    def step(schedule: tuple, seed: int | None) -> float:
        delays = None if seed is None else random_delays(seed)
        return simulate(schedule, chunks, jitter=delays, opportunistic=True, stage_ranks=placement).makespan

    assert step(chosen, None) == step(greedy, None) == 6 * m + ranks - 1
    lost = [statistics.mean(step(s, seed) for seed in range(20)) - step(s, None) for s in (chosen, greedy)]
    assert lost[0] < lost[1] / 2, lost


def test_shapes_it_cannot_run_are_refused_with_what_to_use() -> None:
    with pytest.raises(ScheduleError, match="use stages_per_rank=2, or schedule='zero-bubble' for one chunk"):
        make_schedule(V, 4, 8, False)
    with pytest.raises(ScheduleError, match="use stages_per_rank=2, or schedule='zero-bubble' for the looped"):
        make_schedule(V, 4, 8, False, stages_per_rank=3)


def test_the_strategy_s_configuration_refuses_other_chunk_counts_before_any_process_waits() -> None:
    assert EngineConfig(schedule=V, pipeline_parallel_size=4, stages_per_rank=2).schedule == V
    with pytest.raises(ValueError, match="use stages_per_rank=2"):
        EngineConfig(schedule=V, pipeline_parallel_size=4)


def test_the_local_edge_carries_nothing_and_the_summary_leaves_rank_0() -> None:
    schedule = make_schedule(V, 4, 4, False, stages_per_rank=2)
    links = link_messages(schedule, stage_ranks(4, 2, V), summary=True)
    assert all(src != dst for src, dst in links)
    assert set(links) == {(0, 1), (1, 0), (1, 2), (2, 1), (2, 3), (3, 2)}, "neighbours only: no wrap-around link"
    # each link carries both an activation stream (down the V or back up) and a gradient stream
    for messages in links.values():
        assert {m.kind for m in messages} >= {MessageKind.ACTIVATION, MessageKind.GRADIENT}
    assert summary_path(4, 0) == ((0, 1), (1, 2), (2, 3)) and summary_path(4, 3) == ((3, 2), (2, 1), (1, 0))
    assert [m.kind for m in links[(0, 1)]][-1] is MessageKind.SUMMARY


@pytest.mark.parametrize("recompute", [False, True])
def test_every_plan_passes_the_nccl_rules(recompute: bool) -> None:
    for ranks in range(2, 6):
        placement = stage_ranks(ranks, 2, V)
        for m in range(1, 33):
            schedule = make_schedule(V, ranks, m, recompute, stages_per_rank=2)
            transfers = replay(plan_trace(schedule, placement, summary=True))
            boundaries = 2 * ranks - 2  # 2P - 1 edges, one of them local
            assert transfers == boundaries * (2 * m + 1) + ranks - 1, (ranks, m)
        evaluation = make_schedule(V, ranks, 6, False, train=False, stages_per_rank=2)
        assert replay(plan_trace(evaluation, placement)) == (2 * ranks - 2) * 7


def test_the_plan_places_v_shaped_and_a_tied_embedding_needs_no_synchronization() -> None:
    plan = tied_partition(2, placement="v")
    assert [plan.rank_of(s) for s in range(4)] == [0, 1, 1, 0]
    assert plan.rank_stages(0) == (0, 3) and plan.rank_stages(1) == (1, 2)
    assert plan.rank_params(0) == ("wte.weight", "b0.weight", "head.weight")
    assert plan.rank_params(1) == ("b1.weight", "b2.weight")
    assert plan.rank_tied == (), "the first and the last stage share rank 0: one tensor, nothing to sum"


def test_a_local_edge_hands_over_in_memory_and_says_what_was_never_taken() -> None:
    link, out = LocalLink(), torch.ones(2)
    activation = Message(MessageKind.ACTIVATION, 3, 0)
    assert not link.arrived(activation)
    with pytest.raises(PipelineError, match="has not run yet"):
        link.take(activation, "receiving the activation of micro-batch 0")
    link.send(activation, out, 3)
    assert link.arrived(activation) and link.take(activation, "") is out and link.arrived(activation)
    link.check_complete(3)
    link.send(Message(MessageKind.GRADIENT, 4, 0), out, 4)
    with pytest.raises(PipelineError, match="never taken"):
        link.check_complete(4)
