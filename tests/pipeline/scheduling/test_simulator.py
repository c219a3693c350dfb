from __future__ import annotations

import random
import sys

import pytest
from helpers.launch import ROOT

from lightning_varuna.pipeline.scheduling.schedules import (
    SCHEDULES,
    Kind,
    ScheduleError,
    Task,
    make_schedule,
    schedule_spec,
    stage_ranks,
    validate_schedule,
)
from lightning_varuna.pipeline.scheduling.simulator import Jitter, SimResult, StageCosts, ideal_bubble, simulate

sys.path.insert(0, str(ROOT / "benchmarks"))
from simulator_speed import simulate_asking_every_rank  # noqa: E402 - the loop simulate replaced, kept beside its timing

ONE_CHUNK = [name for name in SCHEDULES if not schedule_spec(name).needs_several_chunks]


UNIT = StageCosts(forward=1.0, backward=2.0)


def unit_costs(num_stages: int) -> list[StageCosts]:
    return [UNIT] * num_stages


def seeded_jitter(seed: int, scale: float) -> Jitter:
    """Uniform [0, scale) delay that depends only on the message, not on the order of the calls."""

    def jitter(src: int, dst: int, kind: Kind, microbatch: int) -> float:
        return random.Random(f"{seed}/{src}/{dst}/{kind.value}/{microbatch}").uniform(0.0, scale)

    return jitter


def subsequence(order: tuple[Task, ...], kind: Kind) -> list[int]:
    return [task.microbatch for task in order if task.kind is kind]


def test_ideal_bubble() -> None:
    assert ideal_bubble(4, 8) == pytest.approx(3 / 11)
    assert ideal_bubble(1, 5) == 0.0
    with pytest.raises(ValueError):
        ideal_bubble(0, 5)


def test_stage_costs_recompute_defaults_to_forward() -> None:
    assert StageCosts(1.5, 3.0).cost(Kind.R) == 1.5
    assert StageCosts(1.5, 3.0, recompute=0.5).cost(Kind.R) == 0.5
    assert StageCosts(1.5, 3.0).cost(Kind.B) == 3.0


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_1f1b_and_gpipe_bubble_is_ideal_p4_m8(name: str) -> None:
    result = simulate(make_schedule(name, 4, 8, recompute=False), unit_costs(4))
    assert result.makespan == 33.0
    assert result.busy == (24.0,) * 4
    assert result.bubble == pytest.approx(3 / 11)
    assert result.bubble == pytest.approx(ideal_bubble(4, 8))
    assert result.idle_fraction == pytest.approx((9 / 33,) * 4)


@pytest.mark.parametrize("name", ONE_CHUNK)
def test_bubble_without_recompute_is_ideal_for_all_sizes(name: str) -> None:
    for num_stages in range(1, 6):
        for num_microbatches in range(1, 9):
            schedule = make_schedule(name, num_stages, num_microbatches, recompute=False)
            result = simulate(schedule, unit_costs(num_stages))
            ideal = ideal_bubble(num_stages, num_microbatches)
            if schedule_spec(name).split_backward and num_stages > 1:  # weight gradients fill part of the bubble
                assert result.bubble < ideal - 0.01
            else:
                assert result.bubble == pytest.approx(ideal)


def test_bubbles_with_recompute_p4_m8() -> None:
    # R costs 1 and counts as busy work: non-last stages do 32 units, the last stage 24.
    results = {name: simulate(make_schedule(name, 4, 8, recompute=True), unit_costs(4)) for name in ONE_CHUNK}
    assert results["varuna"].busy == (32.0, 32.0, 32.0, 24.0)
    assert results["varuna"].makespan == 39.0
    assert results["varuna"].bubble == pytest.approx(3 / 13)  # ~0.231
    assert results["1f1b"].makespan == 39.0
    assert results["gpipe"].makespan == 40.0
    assert results["gpipe"].bubble == pytest.approx(0.25)


def test_in_order_execution_follows_the_schedule() -> None:
    schedule = make_schedule("varuna", 4, 8, recompute=True)
    result = simulate(schedule, unit_costs(4), comm=0.3, jitter=seeded_jitter(0, 2.0))
    assert result.order == schedule
    for times in result.start_times:
        assert list(times) == sorted(times)


def test_forward_only_makespan() -> None:
    result = simulate(make_schedule("varuna", 3, 5, recompute=True, train=False), unit_costs(3))
    assert result.makespan == 5 + 3 - 1


def test_uneven_stages_and_comm() -> None:
    costs = [UNIT, StageCosts(3.0, 6.0), UNIT]
    result = simulate(make_schedule("1f1b", 3, 4, recompute=False), costs, comm=0.5)
    assert result.busy == (12.0, 36.0, 12.0)
    # The slow stage waits for F0 (1 + 0.5), works 36, then B3 reaches stage 0 (0.5 + 2).
    assert result.makespan >= 1.5 + 36.0 + 2.5
    assert result.makespan == 41.0
    assert result.idle_fraction[1] < result.idle_fraction[0]


def test_opportunistic_never_worse_under_jitter_and_sometimes_better() -> None:
    schedule = make_schedule("varuna", 4, 8, recompute=True)
    gains = []
    for seed in range(20):
        plain = simulate(schedule, unit_costs(4), comm=0.2, jitter=seeded_jitter(seed, 2.0))
        eager = simulate(
            schedule, unit_costs(4), comm=0.2, jitter=seeded_jitter(seed, 2.0), opportunistic=True
        )
        assert eager.makespan <= plain.makespan + 1e-9, seed
        gains.append(plain.makespan - eager.makespan)
    assert max(gains) > 1e-6


def test_opportunistic_without_jitter_is_no_worse() -> None:
    schedule = make_schedule("varuna", 4, 8, recompute=True)
    plain = simulate(schedule, unit_costs(4))
    eager = simulate(schedule, unit_costs(4), opportunistic=True)
    assert eager.makespan <= plain.makespan


def test_feeding_the_next_stage_reaches_the_critical_stage_bound() -> None:
    # With recompute, stage P-2 does m * (F + R + B) = 4m units; it cannot start before its first input
    # (P-2 ticks) and its last backward still has to cross P-2 stages (2 ticks each): P=4, m=8 gives 38.
    schedule = make_schedule("varuna", 4, 8, recompute=True)
    varuna_rule_alone = simulate(schedule, unit_costs(4), opportunistic=True, feed_next_stage=False)
    fed = simulate(schedule, unit_costs(4), opportunistic=True)
    assert varuna_rule_alone.makespan == 39.0
    assert fed.makespan == 2 + 4 * 8 + 2 * 2
    # stage 2 no longer holds F6 behind R5 B5 while the last stage waits for it
    assert fed.order[2].index(Task(Kind.F, 6)) < fed.order[2].index(Task(Kind.B, 5))
    assert_message_order_kept(fed, 8)
    validate_schedule(fed.order, 8, recompute=True)


def test_feeding_the_next_stage_is_never_worse_and_reaches_the_bound_with_unit_costs() -> None:
    for num_stages in range(2, 9):
        for num_microbatches in range(1, 33):
            schedule = make_schedule("varuna", num_stages, num_microbatches, recompute=True)
            alone = simulate(schedule, unit_costs(num_stages), opportunistic=True, feed_next_stage=False)
            fed = simulate(schedule, unit_costs(num_stages), opportunistic=True)
            assert fed.makespan <= alone.makespan, (num_stages, num_microbatches)
            if num_stages >= 3 and num_microbatches >= 3:  # stage P-2's bound, as above
                bound = (num_stages - 2) + 4 * num_microbatches + 2 * (num_stages - 2)
                assert fed.makespan == bound, (num_stages, num_microbatches)


def assert_message_order_kept(result: SimResult, num_microbatches: int) -> None:
    for order in result.order:
        assert subsequence(order, Kind.F) == list(range(num_microbatches))
        assert subsequence(order, Kind.B) == list(range(num_microbatches))


def test_opportunistic_keeps_forward_and_backward_order() -> None:
    schedule = make_schedule("varuna", 4, 8, recompute=True)
    moved = False
    for seed in range(10):
        result = simulate(
            schedule, unit_costs(4), comm=0.2, jitter=seeded_jitter(seed, 2.0), opportunistic=True
        )
        assert_message_order_kept(result, 8)
        validate_schedule(result.order, 8, recompute=True)
        moved = moved or result.order != schedule
    assert moved


def test_cost_count_mismatch_and_deadlock() -> None:
    schedule = make_schedule("1f1b", 2, 2, recompute=False)
    with pytest.raises(ValueError, match="one StageCosts per stage"):
        simulate(schedule, unit_costs(3))
    deadlocked = (
        (Task(Kind.F, 0), Task(Kind.B, 0), Task(Kind.F, 1), Task(Kind.B, 1)),
        (Task(Kind.F, 0), Task(Kind.F, 1), Task(Kind.B, 0), Task(Kind.B, 1)),
    )
    with pytest.raises(ScheduleError, match="deadlock.*stage 0 at B0, stage 1 at F1"):
        simulate(deadlocked, unit_costs(2))


@pytest.mark.parametrize("name", SCHEDULES)
def test_asking_only_the_ranks_an_event_concerns_gives_what_asking_every_rank_gives(name: str) -> None:
    """Zero-time tasks and messages included (a rank freed, or a message arrived, at the time it is asked)."""
    draws = random.Random(7)
    for v in (1, 2):
        for ranks in (2, 3, 4):
            for m in (1, 3, 4, 8):
                try:
                    schedule = make_schedule(name, ranks, m, draws.random() < 0.5, stages_per_rank=v)
                except ScheduleError:
                    continue
                placement = None if v == 1 else stage_ranks(ranks, v, name)
                stages = ranks * v
                costs = [StageCosts(forward=draws.choice((0.0, 0.5, 1.0)), backward=draws.choice((0.0, 2.0)),
                                    weight=draws.choice((0.0, 1.0, None))) for _ in range(stages)]
                costs = [c if c.weight is None or c.weight <= c.backward else StageCosts(c.forward, 1.0, weight=1.0)
                         for c in costs]
                for comm, jitter in ((0.0, None), (0.1, seeded_jitter(m, 0.5))):
                    for opportunistic in (False, True):
                        want = simulate_asking_every_rank(schedule, costs, comm, jitter, placement, opportunistic)
                        got = simulate(schedule, costs, comm=comm, jitter=jitter, opportunistic=opportunistic,
                                       stage_ranks=placement)
                        assert got == want, (name, v, ranks, m, comm, opportunistic)
