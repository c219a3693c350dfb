"""Schedules as data: the varuna, 1f1b, gpipe and zero-bubble task lists, their validation, and the run-time rules
(next_task), as pure functions and in running jobs."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from helpers.launch import torchrun
from helpers.results import rank_results
from helpers.schedules import random_delays

from lightning_varuna.pipeline.planning.memory_model import graphs_in_flight
from lightning_varuna.pipeline.scheduling.schedules import (
    SCHEDULES,
    Kind,
    Schedule,
    ScheduleError,
    Task,
    make_schedule,
    next_task,
    schedule_spec,
    validate_schedule,
)
from lightning_varuna.pipeline.scheduling.simulator import StageCosts, simulate
from lightning_varuna.pipeline.scheduling.zero_bubble import _ordered_stage, _packed_schedule, memory_bound

ONE_CHUNK = [name for name in SCHEDULES if not schedule_spec(name).needs_several_chunks]



def tasks(text: str) -> tuple[Task, ...]:
    """Parse ``"F0 F1 R0 B0"`` (commas allowed) into tasks."""
    return tuple(Task(Kind(word[0]), int(word[1:])) for word in text.replace(",", " ").split())


def interleave(*kinds: str, microbatches: range) -> str:
    """``interleave("R", "B", microbatches=range(2))`` -> ``"R0 B0 R1 B1"``."""
    return " ".join(f"{kind}{k}" for k in microbatches for kind in kinds)


def forwards(microbatches: range) -> str:
    return interleave("F", microbatches=microbatches)


# --- varuna ---------------------------------------------------------------------------------------------

VARUNA_P4_M8 = (
    # Stage 0: F0..F7 then R0 B0 R1 B1 ... R7 B7 (the Varuna paper's example).
    tasks(forwards(range(8)) + " " + interleave("R", "B", microbatches=range(8))),
    # Stage 1: not given in the paper's example; this is what the rules produce.
    tasks("F0 F1 F2 F3 F4 F5, R0 B0 R1 B1 R2 B2, F6 F7, R3 B3 R4 B4 R5 B5 R6 B6 R7 B7"),
    # Stage 2 (the Varuna paper's example).
    tasks("F0 F1 F2, R0 B0 R1 B1 R2 B2, F3 F4 F5, R3 B3 R4 B4 R5 B5, F6 F7, R6 B6 R7 B7"),
    # Stage 3, the last: F0 B0 F1 B1 ... F7 B7 (the Varuna paper's example).
    tasks(interleave("F", "B", microbatches=range(8))),
)


def test_varuna_reproduces_paper_example() -> None:
    schedule = make_schedule("varuna", 4, 8, recompute=True)
    assert schedule[0] == VARUNA_P4_M8[0]
    assert schedule[2] == VARUNA_P4_M8[2]
    assert schedule[3] == VARUNA_P4_M8[3]


def test_varuna_stage_one_for_p4_m8() -> None:
    assert make_schedule("varuna", 4, 8, recompute=True)[1] == VARUNA_P4_M8[1]


def test_varuna_without_recompute_p4_m8() -> None:
    schedule = make_schedule("varuna", 4, 8, recompute=False)
    assert schedule == (
        tasks(forwards(range(8)) + " " + interleave("B", microbatches=range(8))),
        tasks("F0 F1 F2 F3 F4 F5 F6 B0 F7 B1 B2 B3 B4 B5 B6 B7"),
        tasks("F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"),
        tasks(interleave("F", "B", microbatches=range(8))),
    )


def test_single_stage_is_forward_backward_alternating() -> None:
    expected = (tasks(interleave("F", "B", microbatches=range(3))),)
    assert make_schedule("varuna", 1, 3, recompute=True) == expected
    assert make_schedule("1f1b", 1, 3, recompute=True) == expected
    assert make_schedule("gpipe", 1, 3, recompute=True) == (tasks("F0 F1 F2 B0 B1 B2"),)


# --- 1F1B -----------------------------------------------------------------------------------------------


def test_1f1b_p4_m8_without_recompute() -> None:
    assert make_schedule("1f1b", 4, 8, recompute=False) == (
        tasks("F0 F1 F2, F3 B0 F4 B1 F5 B2 F6 B3 F7 B4, B5 B6 B7"),
        tasks("F0 F1, F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5, B6 B7"),
        tasks("F0, F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6, B7"),
        tasks("F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"),
    )


def test_1f1b_p4_m8_with_recompute() -> None:
    assert make_schedule("1f1b", 4, 8, recompute=True) == (
        tasks("F0 F1 F2, F3 R0 B0 F4 R1 B1 F5 R2 B2 F6 R3 B3 F7 R4 B4, R5 B5 R6 B6 R7 B7"),
        tasks("F0 F1, F2 R0 B0 F3 R1 B1 F4 R2 B2 F5 R3 B3 F6 R4 B4 F7 R5 B5, R6 B6 R7 B7"),
        tasks("F0, F1 R0 B0 F2 R1 B1 F3 R2 B2 F4 R3 B3 F5 R4 B4 F6 R5 B5 F7 R6 B6, R7 B7"),
        tasks("F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"),
    )


def test_1f1b_fewer_microbatches_than_stages() -> None:
    assert make_schedule("1f1b", 4, 2, recompute=True) == (
        tasks("F0 F1 R0 B0 R1 B1"),
        tasks("F0 F1 R0 B0 R1 B1"),
        tasks("F0, F1 R0 B0, R1 B1"),
        tasks("F0 B0 F1 B1"),
    )


# --- GPipe ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recompute", [False, True])
def test_gpipe_shape(recompute: bool) -> None:
    schedule = make_schedule("gpipe", 3, 5, recompute=recompute)
    for stage, stage_tasks in enumerate(schedule):
        kinds = ("R", "B") if recompute and stage < 2 else ("B",)
        assert stage_tasks == tasks(forwards(range(5)) + " " + interleave(*kinds, microbatches=range(5)))


# --- zero-bubble ----------------------------------------------------------------------------------------


def test_zero_bubble_p4_m8_is_zb_h1() -> None:
    packed = _packed_schedule(4, 8, recompute=False)
    # 1F1B's warm-up; then input gradients first, forwards while within the bound, weight gradients last; the
    # last stage holds its weight gradients back while it holds fewer than P micro-batches
    assert packed[0] == tasks("F0 F1 F2 F3, I0 W0 I1 F4 I2 W1 I3 F5 W2 F6 I4 W3 F7 W4 I5 W5 I6 W6 I7 W7")
    assert packed[3] == tasks("F0 I0 F1 I1 F2 I2 F3 I3 W0 W1 F4 I4 W2 W3 F5 I5 F6 I6 W4 W5 F7 I7 W6 W7")
    costs = [StageCosts(forward=1, backward=2)] * 4
    assert simulate(packed, costs).makespan == 29  # 1F1B: 33 at the same memory over the stages
    # the list taken: 1F1B's order, each W right after its I, one tick longer here but not made for I = W only
    schedule = make_schedule("zero-bubble", 4, 8, recompute=False)
    assert schedule[0] == tasks("F0 F1 F2 F3, I0 W0 F4 I1 W1 F5 I2 W2 F6 I3 W3 F7 I4 W4 I5 W5 I6 W6 I7 W7")
    assert schedule[3] == tasks(" ".join(f"F{k} I{k} W{k}" for k in range(8)))
    assert simulate(schedule, costs).makespan == 30
    assert simulate(make_schedule("1f1b", 4, 8, recompute=False), costs).makespan == 33
    recomputing = make_schedule("zero-bubble", 4, 8, recompute=True)
    assert simulate(recomputing, costs, opportunistic=True).makespan == 36
    assert simulate(make_schedule("varuna", 4, 8, recompute=True), costs, opportunistic=True).makespan == 38


@pytest.mark.parametrize(("num_stages", "m"), [(4, 16), (4, 32), (8, 16), (8, 32)])
def test_zero_bubble_takes_the_1f1b_ordered_list_which_loses_less_to_a_short_w_and_to_late_messages(
    num_stages: int, m: int,
) -> None:
    chosen = make_schedule("zero-bubble", num_stages, m, recompute=False)
    packed = _packed_schedule(num_stages, m, False)
    ordered = tuple(_ordered_stage(s, num_stages, m) for s in range(num_stages))
    assert chosen == ordered

    def step(schedule: tuple, seed: int | None = None, weight_share: float = 0.5) -> float:
        costs = [StageCosts(forward=1, backward=2, weight=2 * weight_share)] * num_stages
        delays = None if seed is None else random_delays(seed)
        return simulate(schedule, costs, jitter=delays, opportunistic=True).makespan

    # the packed list is made for I = W without delays, and is shorter there (P=8, m=16: 57 against 62 ticks) ...
    gain = step(ordered) - step(packed)
    assert gain > 0
    # ... but where W is a fifth of the backward it waits for late gradients, and loses more than it gained (73.2
    # against 66.2) ...
    assert step(packed, weight_share=0.2) - step(ordered, weight_share=0.2) > gain
    # ... and late messages cost it more too (P=8, m=16: 32.7 against 17.6 ticks; elsewhere more than twice as much)
    lost = [statistics.mean(step(s, seed) for seed in range(20)) - step(s) for s in (ordered, packed)]
    assert lost[0] < 0.6 * lost[1], lost


def _peak_held(tasks_run: tuple[Task, ...], recomputes: bool) -> tuple[int, int, int]:
    """The most micro-batches held until their I, until their W, and forwarded until their I (memory_bound)."""
    builds = Kind.R if recomputes else Kind.F
    until_i = until_w = forwarded = peak_i = peak_w = peak_f = 0
    for task in tasks_run:
        if task.kind is Kind.F:
            forwarded += 1
            peak_f = max(peak_f, forwarded)
        if task.kind is builds:
            until_i, until_w = until_i + 1, until_w + 1
            peak_i, peak_w = max(peak_i, until_i), max(peak_w, until_w)
        if task.kind in (Kind.I, Kind.B):
            until_i, forwarded = until_i - 1, forwarded - 1
        if task.kind in (Kind.W, Kind.B):
            until_w -= 1
    return peak_i, peak_w, peak_f


@pytest.mark.parametrize("recompute", [False, True])
def test_zero_bubble_keeps_its_stated_memory_bound_in_list_order_and_under_the_run_time_rules(recompute: bool) -> None:
    for num_stages in range(2, 9):
        costs = [StageCosts(forward=1, backward=2)] * num_stages
        for m in range(1, 33):
            schedule = make_schedule("zero-bubble", num_stages, m, recompute)
            run = simulate(schedule, costs, jitter=random_delays(num_stages * 100 + m), opportunistic=True).order
            for stage in range(num_stages):
                bound = memory_bound(stage, num_stages, recompute)
                recomputes = recompute and stage < num_stages - 1
                for order in (schedule[stage], run[stage]):
                    until_i, until_w, forwarded = _peak_held(order, recomputes)
                    assert until_i <= bound.until_input_grad and until_w <= bound.until_weight_grad, (
                        num_stages, m, stage, order)
                # the run-time rules may run a stashing forward early instead of waiting (next_task)
                assert _peak_held(schedule[stage], recomputes)[2] <= bound.forwarded, (num_stages, m, stage)
            if not recompute:  # no stage holds more than 1F1B's first stage
                assert max(memory_bound(s, num_stages, False).until_weight_grad for s in range(num_stages)) == (
                    num_stages)


def test_zero_bubble_with_recompute_holds_no_more_than_1f1b_with_recompute() -> None:
    # the autograd graphs (held until W) and the stashed inputs (forwarded, not through I) of every stage, in
    # list order, against 1F1B's with recompute; and it is faster than 1F1B (unit costs, recompute = forward)
    for num_stages in range(2, 9):
        costs = [StageCosts(forward=1, backward=2)] * num_stages
        for m in range(1, 33):
            ours, reference = (make_schedule(name, num_stages, m, recompute=True) for name in ("zero-bubble", "1f1b"))
            for stage in range(num_stages):
                stashes = stage < num_stages - 1
                assert graphs_in_flight(ours[stage], stashes) <= graphs_in_flight(reference[stage], stashes)
                assert _peak_held(ours[stage], stashes)[2] <= _peak_held(reference[stage], stashes)[2]
            ticks = [simulate(s, costs, opportunistic=True).makespan for s in (ours, reference)]
            assert ticks[0] <= ticks[1], (num_stages, m, ticks)
            if num_stages > 2 and m >= num_stages:
                assert ticks[0] < ticks[1], (num_stages, m, ticks)


@pytest.mark.parametrize("num_stages", [2, 3, 4, 8])
def test_zero_bubble_with_recompute_takes_the_least_time_any_schedule_recomputing_every_stage_can(
        num_stages: int) -> None:
    # every non-last stage recomputes each micro-batch and holds back at most one W: stage P-2 gets its first
    # input after P-2 forwards, has m (F + R + I + W) of work, and its last I still has P-2 stages' I to pass before
    # stage 0's last W, so no such schedule is shorter than (P-2) F + m (F + R + B) + (P-2) I (unit costs: F = R =
    # I = W = 1). zero-bubble's list reaches it for every m >= P; 1F1B's is up to 1.16x longer (P=8, m=8)
    costs = [StageCosts(forward=1, backward=2, recompute=1)] * num_stages
    for m in (num_stages, 2 * num_stages, 32):
        least = 2 * (num_stages - 2) + 4 * m
        ticks = simulate(make_schedule("zero-bubble", num_stages, m, recompute=True), costs,
                         opportunistic=True).makespan
        assert ticks == least, (num_stages, m, ticks, least)
        assert simulate(make_schedule("1f1b", num_stages, m, recompute=True), costs).makespan > least


# --- all schedules and sizes ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ONE_CHUNK)
def test_every_size_validates(name: str) -> None:
    for num_stages in range(1, 7):
        for num_microbatches in range(1, 14):
            for recompute in (False, True):
                schedule = make_schedule(name, num_stages, num_microbatches, recompute)
                assert len(schedule) == num_stages
                last = schedule[-1]
                assert not any(task.kind is Kind.R for task in last)
                has_r = any(task.kind is Kind.R for stage in schedule for task in stage)
                assert has_r == (recompute and num_stages > 1)
                evaluation = make_schedule(name, num_stages, num_microbatches, recompute, train=False)
                assert evaluation == (tasks(forwards(range(num_microbatches))),) * num_stages
                validate_schedule(evaluation, num_microbatches, recompute, train=False)


@pytest.mark.parametrize("name", ONE_CHUNK)
def test_fewer_microbatches_than_stages(name: str) -> None:
    schedule = make_schedule(name, 6, 2, recompute=True)
    split = schedule_spec(name).split_backward
    validate_schedule(schedule, 2, recompute=True, split_backward=split)
    assert all(len(stage) == (8 if split else 6) for stage in schedule[:-1])
    assert len(schedule[-1]) == (6 if split else 4)


# --- bad arguments --------------------------------------------------------------------------------------


def test_bad_name_and_sizes() -> None:
    with pytest.raises(ScheduleError, match="unknown schedule 'zb'"):
        make_schedule("zb", 4, 8, recompute=False)
    with pytest.raises(ScheduleError, match="num_stages"):
        make_schedule("1f1b", 0, 8, recompute=False)
    with pytest.raises(ValueError, match="num_microbatches"):
        make_schedule("varuna", 2, 0, recompute=False)


# --- invalid schedules ----------------------------------------------------------------------------------


def replace_stage(schedule: Schedule, stage: int, new: tuple[Task, ...]) -> Schedule:
    return schedule[:stage] + (new,) + schedule[stage + 1 :]


def test_rejects_swapped_backward_order() -> None:
    schedule = make_schedule("1f1b", 2, 3, recompute=False)
    bad = replace_stage(schedule, 0, tasks("F0 F1 B1 F2 B0 B2"))
    with pytest.raises(ScheduleError, match=r"stage 0: backwards .* B0 comes after B1"):
        validate_schedule(bad, 3, recompute=False)


def test_rejects_swapped_forward_order() -> None:
    schedule = make_schedule("gpipe", 2, 2, recompute=False)
    bad = replace_stage(schedule, 1, tasks("F1 F0 B0 B1"))
    with pytest.raises(ScheduleError, match=r"stage 1: forwards .* F0 comes after F1"):
        validate_schedule(bad, 2, recompute=False)


def test_rejects_missing_recompute() -> None:
    schedule = make_schedule("varuna", 3, 2, recompute=True)
    bad = replace_stage(schedule, 1, tuple(t for t in schedule[1] if t != Task(Kind.R, 1)))
    with pytest.raises(ScheduleError, match="stage 1: missing task R1"):
        validate_schedule(bad, 2, recompute=True)


def test_rejects_recompute_where_not_allowed() -> None:
    with_r = make_schedule("gpipe", 2, 2, recompute=True)
    with pytest.raises(ScheduleError, match="stage 0: unexpected task R0 .recompute is off"):
        validate_schedule(with_r, 2, recompute=False)
    on_last = replace_stage(with_r, 1, tasks("F0 F1 R0 B0 B1"))
    with pytest.raises(ScheduleError, match="stage 1: unexpected task R0 .the last stage never recomputes"):
        validate_schedule(on_last, 2, recompute=True)


def test_rejects_recompute_out_of_place() -> None:
    schedule = make_schedule("gpipe", 2, 2, recompute=True)
    after_backward = replace_stage(schedule, 0, tasks("F0 F1 B0 R0 R1 B1"))
    with pytest.raises(ScheduleError, match="stage 0: R0 must come before B0"):
        validate_schedule(after_backward, 2, recompute=True)
    before_forward = replace_stage(schedule, 0, tasks("F0 R1 F1 R0 B0 B1"))
    with pytest.raises(ScheduleError, match="stage 0: R1 must come after F1"):
        validate_schedule(before_forward, 2, recompute=True)


def test_rejects_missing_duplicate_and_foreign_tasks() -> None:
    schedule = make_schedule("1f1b", 2, 2, recompute=False)
    with pytest.raises(ScheduleError, match="stage 1: missing task B1"):
        validate_schedule(replace_stage(schedule, 1, tasks("F0 B0 F1")), 2, recompute=False)
    with pytest.raises(ScheduleError, match="stage 1: task F0 appears more than once"):
        validate_schedule(replace_stage(schedule, 1, tasks("F0 F0 B0 F1 B1")), 2, recompute=False)
    with pytest.raises(ScheduleError, match="stage 1: unexpected task F2"):
        validate_schedule(replace_stage(schedule, 1, tasks("F0 B0 F1 B1 F2")), 2, recompute=False)
    with pytest.raises(ScheduleError, match="stage 0: unexpected task B0 .a forward-only"):
        validate_schedule(schedule, 2, recompute=False, train=False)
    with pytest.raises(ScheduleError, match="at least one stage"):
        validate_schedule((), 2, recompute=False)


def test_rejects_deadlock() -> None:
    # Stage 0 waits for the gradient of micro-batch 0 before sending F1, which stage 1 needs before B0.
    deadlocked = (tasks("F0 B0 F1 B1"), tasks("F0 F1 B0 B1"))
    with pytest.raises(ScheduleError, match=r"deadlock.*stage 0 at B0, stage 1 at F1"):
        validate_schedule(deadlocked, 2, recompute=False)


def test_next_task_moves_a_ready_forward_ahead_of_a_recompute_or_backward_whose_gradient_is_late() -> None:
    def arrived_only(text: str):
        there = set(tasks(text))
        return lambda task: task in there

    pending = list(tasks("R0 B0 F3 F4"))
    # gradient late, input of F3 there: F3 goes first; the gradient there: the recompute runs
    assert next_task(pending, arrived_only("F3"), forwards_stash=True) == 2
    assert next_task(pending, arrived_only("F3 B0"), forwards_stash=True) == 0
    # nothing there: the recompute runs anyway (it waits for nothing)
    assert next_task(pending, arrived_only(""), forwards_stash=True) == 0
    # a backward head: a forward may go first only where forwards keep no autograd graph
    assert next_task(pending[1:], arrived_only("F3"), forwards_stash=True) == 1
    assert next_task(pending[1:], arrived_only("F3"), forwards_stash=False) == 0
    # a forward head is never moved, whatever has arrived
    assert next_task(list(tasks("F3 R1 B1")), arrived_only("B1"), forwards_stash=True) == 0


def test_next_task_feeds_a_next_stage_that_has_run_out_of_work() -> None:
    def arrived_only(text: str):
        there = set(tasks(text))
        return lambda task: task in there

    pending = list(tasks("R3 B3 R4 B4 F6 R5 B5"))  # F0..F5 have run
    # B3's gradient is on time, but so is B5's: the next stage has finished all it got and waits for F6
    assert next_task(pending, arrived_only("F6 B3 B4 B5"), forwards_stash=True) == 4
    # ... also ahead of a backward, where forwards stash
    assert next_task(pending[1:], arrived_only("F6 B3 B4 B5"), forwards_stash=True) == 3
    # the next stage still has work (B5's gradient not back): the list's order holds
    assert next_task(pending, arrived_only("F6 B3 B4"), forwards_stash=True) == 0
    # F6's input not there, or the rule off: the list's order holds
    assert next_task(pending, arrived_only("B3 B4 B5"), forwards_stash=True) == 0
    assert next_task(pending, arrived_only("F6 B3 B4 B5"), forwards_stash=True, feed_next_stage=False) == 0


# --- the run-time rules in running jobs ------------------------------------------------------------------


def test_a_middle_stage_runs_a_ready_forward_while_its_gradient_is_late(tmp_path: Path) -> None:
    # P=3 with a slow last backward: the middle stage's gradients are late and its inputs are there, so Varuna's
    # rule must move forwards there (it never did on gloo before the transfers were watched)
    torchrun("opportunistic.py", str(tmp_path), nproc=3, timeout=180)
    moves = [run["moves"] for run in rank_results(tmp_path, "opportunistic", 3)]
    assert moves[1] > 0, moves
    assert moves[2] == 0, moves  # the last stage has nothing to move


@pytest.mark.slow
def test_a_stage_sends_a_forward_early_when_its_next_stage_runs_out_of_work(tmp_path: Path) -> None:
    # P=4, m=8 with unit-cost sleeps: fed, stage 2 runs F6 before B5 (the list has it after), as the simulator
    # predicts; every stage still runs forwards and backwards in micro-batch order, so messages keep their order
    torchrun("feed.py", str(tmp_path), nproc=4, timeout=240)
    orders = rank_results(tmp_path, "feed", 4)
    schedule = make_schedule("varuna", 4, 8, recompute=True)
    predicted = simulate(schedule, [StageCosts(1.0, 2.0)] * 4, opportunistic=True).order
    assert schedule[2].index(Task(Kind.F, 6)) > schedule[2].index(Task(Kind.B, 5))
    assert predicted[2].index(Task(Kind.F, 6)) < predicted[2].index(Task(Kind.B, 5))
    fed = [[_task(text) for text in order["fed"]] for order in orders]
    assert fed[2].index(Task(Kind.F, 6)) < fed[2].index(Task(Kind.B, 5)), fed[2]
    alone = [_task(text) for text in orders[2]["varuna_rule_alone"]]
    assert alone.index(Task(Kind.F, 6)) > alone.index(Task(Kind.B, 5)), alone  # the switch is obeyed
    for run in ("fed", "varuna_rule_alone"):
        executed = tuple(tuple(_task(text) for text in order[run]) for order in orders)
        validate_schedule(executed, 8, recompute=True)
        for stage in executed:
            assert [t.microbatch for t in stage if t.kind is Kind.F] == list(range(8))
            assert [t.microbatch for t in stage if t.kind is Kind.B] == list(range(8))


def _task(text: str) -> Task:
    return Task(Kind(text[0]), int(text[1:]))


def test_the_schedule_registry_names_every_schedule_the_config_type_accepts() -> None:
    from typing import get_args

    from lightning_varuna.pipeline.config import ScheduleName

    assert set(get_args(ScheduleName)) == {*SCHEDULES, "auto"}
    with pytest.raises(ScheduleError, match="unknown schedule 'nope'; expected one of varuna, 1f1b"):
        schedule_spec("nope")
