"""Several model chunks per rank: the interleaved schedule's properties, its message order, the plan's rank view."""

from __future__ import annotations

import pytest
from helpers.schedules import random_delays, tied_partition

from lightning_varuna.pipeline.model.partition import Partition
from lightning_varuna.pipeline.scheduling.interleaved import interleaved_memory_bound, interleaved_warmup
from lightning_varuna.pipeline.scheduling.lowering import MessageKind, link_messages
from lightning_varuna.pipeline.scheduling.nccl_replay import plan_trace, replay
from lightning_varuna.pipeline.scheduling.schedules import (
    Kind,
    ScheduleError,
    Task,
    make_schedule,
    next_task,
    stage_ranks,
)
from lightning_varuna.pipeline.scheduling.simulator import StageCosts, simulate
from lightning_varuna.pipeline.scheduling.validation import validate_schedule


def _peak_graphs(tasks: tuple[Task, ...], recomputing: set[int]) -> int:
    """The most autograd graphs a rank holds at once: from F (R on a recomputing stage) to B."""
    held = peak = 0
    for task in tasks:
        builds = Kind.R if task.stage in recomputing else Kind.F
        if task.kind is builds:
            held += 1
            peak = max(peak, held)
        elif task.kind is Kind.B:
            held -= 1
    return peak


@pytest.mark.parametrize("recompute", [False, True])
def test_every_shape_validates_and_keeps_its_memory_bound_in_list_order_and_under_the_run_time_rules(
    recompute: bool,
) -> None:
    for ranks in range(2, 9):
        for v in (2, 3):
            stages = ranks * v
            placement = stage_ranks(ranks, v)
            recomputing = set(range(stages - 1)) if recompute else set()
            costs = [StageCosts(forward=1 / v, backward=2 / v)] * stages
            for m in range(ranks, 33, ranks):
                schedule = make_schedule("interleaved", ranks, m, recompute, stages_per_rank=v)
                assert sum(len(t) for t in schedule) == m * stages * (3 if recompute else 2) - (m if recompute else 0)
                run = simulate(schedule, costs, jitter=random_delays(ranks * 1000 + m), opportunistic=True,
                               stage_ranks=placement).order
                for rank in range(ranks):
                    bound = interleaved_memory_bound(rank, ranks, v, m, recompute)
                    for order in (schedule[rank], run[rank]):
                        assert _peak_graphs(order, recomputing) <= bound, (ranks, v, m, rank, order)
                    if not recompute:  # the bound is met in list order: it is the schedule's, not a loose number
                        assert _peak_graphs(schedule[rank], recomputing) == bound, (ranks, v, m, rank)


def test_the_bubble_is_1f1b_s_divided_by_the_chunks_per_rank() -> None:
    # unit costs (a stage's F = 1, B = 2, split evenly over its chunks), free communication:
    # 1F1B takes (m + P - 1) * 3, interleaved (m + (P - 1) / v) * 3
    for ranks in range(2, 9):
        for v in (2, 4):
            for m in range(2 * ranks, 33, ranks):
                schedule = make_schedule("interleaved", ranks, m, recompute=False, stages_per_rank=v)
                costs = [StageCosts(forward=1 / v, backward=2 / v)] * (ranks * v)
                interleaved = simulate(schedule, costs, stage_ranks=stage_ranks(ranks, v)).makespan
                one_f_one_b = simulate(make_schedule("1f1b", ranks, m, recompute=False),
                                       [StageCosts(1, 2)] * ranks).makespan
                assert one_f_one_b == pytest.approx((m + ranks - 1) * 3)
                assert interleaved == pytest.approx((m + (ranks - 1) / v) * 3), (ranks, v, m)


def test_megatron_s_warm_up_and_order_at_p2_v2_m4() -> None:
    schedule = make_schedule("interleaved", 2, 4, recompute=False, stages_per_rank=2)
    assert [interleaved_warmup(r, 2, 2, 4) for r in range(2)] == [4, 2]
    assert [repr(t) for t in schedule[0]] == (
        "F0@0 F1@0 F0@2 F1@2 F2@0 B0@2 F3@0 B1@2 F2@2 B0@0 F3@2 B1@0 B2@2 B3@2 B2@0 B3@0".split())
    # with recompute every stage but the last recomputes right before its backward
    rc = make_schedule("interleaved", 2, 4, recompute=True, stages_per_rank=2)
    assert [repr(t) for t in rc[1] if t.microbatch == 0] == "F0@1 F0@3 B0@3 R0@1 B0@1".split()


def test_evaluation_runs_any_number_of_microbatches() -> None:
    for m in range(1, 10):
        schedule = make_schedule("interleaved", 3, m, recompute=True, train=False, stages_per_rank=2)
        validate_schedule(schedule, m, recompute=False, train=False, stage_ranks=stage_ranks(3, 2))
        assert all(t.kind is Kind.F for tasks in schedule for t in tasks)


@pytest.mark.parametrize(("ranks", "v", "m", "match"), [
    (4, 2, 6, r"rounds of P=4, but a step has 6 micro-batch\(es\); use num_microbatches=4 or 8"),
    (4, 2, 3, r"use num_microbatches=4 "),
    (4, 1, 8, r"needs stages_per_rank >= 2 \(got 1\)"),
])
def test_shapes_it_cannot_run_are_refused_with_the_nearest_choices(ranks: int, v: int, m: int, match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        make_schedule("interleaved", ranks, m, recompute=False, stages_per_rank=v)


def test_one_chunk_schedules_refuse_several_chunks() -> None:
    with pytest.raises(ScheduleError, match="schedule='varuna' runs one model chunk per rank"):
        make_schedule("varuna", 4, 8, recompute=True, stages_per_rank=2)


def test_validation_checks_each_stage_of_a_rank_and_the_rank_of_each_task() -> None:
    schedule = make_schedule("interleaved", 2, 2, recompute=False, stages_per_rank=2)
    placement = stage_ranks(2, 2)
    swapped = (schedule[0], tuple(Task(t.kind, t.microbatch, 0) if t.stage == 1 else t for t in schedule[1]))
    with pytest.raises(ScheduleError, match="rank 1 lists F0@0, whose stage does not run on rank 1"):
        validate_schedule(swapped, 2, recompute=False, stage_ranks=placement)
    # backwards of one chunk out of order
    tasks = list(schedule[0])
    b0, b1 = tasks.index(Task(Kind.B, 0, 2)), tasks.index(Task(Kind.B, 1, 2))
    tasks[b0], tasks[b1] = tasks[b1], tasks[b0]
    with pytest.raises(ScheduleError, match="stage 2: backwards must be in ascending"):
        validate_schedule((tuple(tasks), schedule[1]), 2, recompute=False, stage_ranks=placement)
    # a rank that waits for its own later chunk: deadlock
    first = [t for t in schedule[0] if t.kind is Kind.F and t.stage == 2]
    waits = (tuple(first + [t for t in schedule[0] if t not in first]), schedule[1])
    with pytest.raises(ScheduleError, match="deadlock"):
        validate_schedule(waits, 2, recompute=False, stage_ranks=placement)


@pytest.mark.parametrize("recompute", [False, True])
def test_every_plan_passes_the_nccl_rules(recompute: bool) -> None:
    for ranks in range(2, 6):
        placement = stage_ranks(ranks, 2)
        for m in range(ranks, 3 * ranks + 1, ranks):
            for train in (True, False):
                schedule = make_schedule("interleaved", ranks, m, recompute, train=train, stages_per_rank=2)
                transfers = replay(plan_trace(schedule, placement, summary=train))
                boundaries = 2 * ranks - 1
                per_boundary = (2 * m + 1) if train else (m + 1)  # activations + header (+ gradients)
                assert transfers == boundaries * per_boundary + (ranks - 1 if train else 0), (ranks, m, train)


def test_the_run_time_rules_keep_every_link_in_order_from_three_ranks_on() -> None:
    # a forward moved ahead of a recompute sends on the link to the next rank, a backward on the one to the previous:
    # different links from P = 3 on, so every link's messages keep their order
    ranks, v, m = 3, 2, 6
    placement = stage_ranks(ranks, v)
    schedule = make_schedule("interleaved", ranks, m, recompute=True, stages_per_rank=v)
    tasks = list(schedule[1])
    head = next(i for i, t in enumerate(tasks) if t.kind is Kind.R)
    forward = next(i for i, t in enumerate(tasks) if t.kind is Kind.F and i > head)
    assert next_task(tasks[head:], lambda task: task.kind is Kind.F, lambda task: task.stage != ranks * v - 1) > 0
    tasks.insert(head, tasks.pop(forward))
    moved = (schedule[0], tuple(tasks), schedule[2])
    assert link_messages(moved, placement, summary=True) == link_messages(schedule, placement, summary=True)
    # at P = 2 one link carries activations and gradients: a move would reorder it (the runtime does not move there)
    two = link_messages(make_schedule("interleaved", 2, 4, recompute=True, stages_per_rank=2), stage_ranks(2, 2))
    assert {m.kind for m in two[(0, 1)]} >= {MessageKind.ACTIVATION, MessageKind.GRADIENT}


def test_a_forward_that_builds_a_graph_never_moves() -> None:
    pending = [Task(Kind.R, 0, 1), Task(Kind.B, 0, 1), Task(Kind.F, 1, 3)]
    stash = lambda task: task.stage != 3  # noqa: E731 - stage 3 is the last: its forwards keep their graph
    assert next_task(pending, lambda task: task.kind is Kind.F, stash) == 0
    pending = [Task(Kind.R, 0, 1), Task(Kind.B, 0, 1), Task(Kind.F, 1, 1)]
    assert next_task(pending, lambda task: task.kind is Kind.F, stash) == 2


def test_the_plan_knows_the_rank_of_each_stage() -> None:
    plan = tied_partition(2)
    assert plan.num_ranks == 2 and [plan.rank_of(s) for s in range(4)] == [0, 1, 0, 1]
    assert plan.rank_stages(0) == (0, 2) and plan.rank_stages(1) == (1, 3)
    assert plan.rank_params(0) == ("wte.weight", "b0.weight", "b2.weight")
    assert plan.rank_params(1) == ("wte.weight", "b1.weight", "head.weight")
    assert plan.rank_tied == (("wte.weight", (0, 1)),)
    # four ranks of one stage each: the same view as the stages
    assert tied_partition(1).rank_tied == (("wte.weight", (0, 3)),)


def test_a_parameter_shared_by_two_stages_of_one_rank_needs_no_synchronization() -> None:
    plan = tied_partition(2)
    shared = Partition(stages=plan.stages, tied=(("wte.weight", (0, 2)),), trace=plan.trace, stages_per_rank=2)
    assert shared.rank_tied == ()
