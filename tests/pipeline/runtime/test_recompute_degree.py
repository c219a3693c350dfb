"""Recompute by degree (``recompute=n``): where a stage's kept graph starts, and the inputs that are refused.

Exactness against the plain run is in ``test_equivalence.py`` (``*-rc1*`` configurations, every schedule) and, with
dropout, in ``test_lightning_features.py``.
"""

from __future__ import annotations

import random

import pytest
from torch import Tensor

from lightning_varuna import VarunaStrategy
from lightning_varuna.pipeline.config import EngineConfig
from lightning_varuna.pipeline.model.dry_run import PartitionError
from lightning_varuna.pipeline.runtime.recompute import grad_from_cut
from lightning_varuna.pipeline.scheduling.schedules import make_schedule, next_task
from lightning_varuna.pipeline.scheduling.simulator import StageCosts, simulate
from lightning_varuna.pipeline.scheduling.tasks import Kind, Task
from tests.pipeline.test_errors import Chain, trace


def test_the_kept_graph_starts_after_the_first_n_segments() -> None:
    # a stage of segments 3..6 receives at cut point 2 and sends at cut point 6
    assert grad_from_cut(2, 6, 1, {}) == 3
    assert grad_from_cut(2, 6, 3, {}) == 5
    # the first stage has no received cut: its first segment is segment 0
    assert grad_from_cut(None, 2, 1, {}) == 0


def test_a_stage_of_at_most_n_segments_recomputes_whole_and_the_last_stage_never() -> None:
    assert grad_from_cut(2, 6, 4, {}) is None
    assert grad_from_cut(2, 6, 9, {}) is None
    assert grad_from_cut(2, None, 1, {}) is None
    assert grad_from_cut(2, 6, None, {}) is None  # recompute=True: the whole stage


class Skip(Chain):
    """``h`` from segment 0 is added in segment 1 without passing through the cut point."""

    def forward(self, x: Tensor) -> Tensor:
        h = self.layers[0](x)
        y = self.layers[1](self.cuts[0](h)) + h
        y = self.cuts[1](y)
        y = self.layers[2](y)
        return self.layers[3](self.cuts[2](y)).pow(2).mean()


def test_a_value_crossing_the_end_of_the_recomputed_part_is_refused() -> None:
    result, _ = trace(Skip(4))
    assert set(result.crossings) == {(0, 1)}
    # stage 0 of segments 0..2: recomputing segment 0 alone would compute h without autograd for segment 1
    with pytest.raises(PartitionError, match=r"recompute=1 .* cut point #0, .* segment 0 to segment 1"):
        grad_from_cut(None, 2, 1, result.crossings)
    assert grad_from_cut(None, 2, 2, result.crossings) == 1  # segments 0 and 1 recomputed together, 2 kept
    assert grad_from_cut(1, 3, 1, result.crossings) == 2  # a stage after the crossing is not concerned


@pytest.mark.parametrize("value", [0, -1, 1.5, "2"])
def test_a_degree_must_be_a_positive_number_of_segments(value: object) -> None:
    with pytest.raises(ValueError, match="recompute must be True, False, 'auto' or a number of segments >= 1"):
        EngineConfig(recompute=value)  # type: ignore[arg-type]


def test_a_degree_is_a_value_auto_configuration_plans_with() -> None:
    config = EngineConfig(recompute=2, schedule="auto")
    assert config.searches and config.recomputes and config.recompute_segments == 2
    VarunaStrategy(recompute=1, microbatch_size="auto")
    assert EngineConfig(recompute=True).recompute_segments is None
    assert not EngineConfig(recompute=False).recomputes


def _graphs_held(order: tuple[Task, ...] | list[Task]) -> int:
    """The most graphs a stage recomputed by degree holds: each forward keeps its kept segments' graph until the
    micro-batch's backward (B, or W for a split one), a recompute adds the recomputed segments' graph."""
    live = peak = 0
    for task in order:
        if task.kind in (Kind.F, Kind.R):
            live += 1
        peak = max(peak, live)
        if task.kind is Kind.B or task.kind is Kind.W:
            live -= 2
    return peak


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble", "varuna"])
def test_forwards_that_keep_a_graph_never_move_ahead_under_the_run_time_rules(schedule: str) -> None:
    # recompute by degree: a forward keeps its later segments' graph, so a late gradient must not let the stage's
    # forwards run ahead of its recomputes (they all would, each holding a graph: measured, stage 0 of P=4, m=8
    # held 8 forwards' graphs, more than without recompute)
    draws, delays = random.Random(0), {}
    for num_stages in (2, 4, 8):
        costs = [StageCosts(forward=1, backward=2)] * num_stages
        for m in (4, 8, 16, 32):
            listed = make_schedule(schedule, num_stages, m, recompute=True)
            run = simulate(listed, costs, opportunistic=True, forwards_stash=lambda stage: False,
                           jitter=lambda *msg: delays.setdefault(msg, draws.expovariate(2.0))).order
            for stage in range(num_stages - 1):
                assert _graphs_held(run[stage]) <= _graphs_held(listed[stage]), (schedule, num_stages, m, stage)
    # the rule as a stage of one chunk per rank asks it (one flag for all its forwards; the simulator above asks
    # per task): a forward ready while the head's gradient is late moves only if forwards keep no graph
    pending = [Task(Kind.R, 0), Task(Kind.B, 0), Task(Kind.F, 4)]
    forward_ready = lambda task: task.kind is Kind.F  # noqa: E731
    assert next_task(pending, forward_ready, forwards_stash=True) == 2
    assert next_task(pending, forward_ready, forwards_stash=False) == 0



def _bytes_per_rank(order: tuple[Task, ...], kept: int, recomputed: int, recompute: bool) -> int:
    """The most activation bytes a rank holds in ``order``: a forward keeps ``kept`` (all of a stage's
    ``kept + recomputed`` without recompute), a recompute adds ``recomputed``, the micro-batch's B (or W) frees it."""
    live: dict[tuple[int, int | None], int] = {}
    peak = 0
    for task in order:
        key = (task.microbatch, task.stage)
        if task.kind is Kind.F:
            live[key] = kept if recompute else kept + recomputed
        elif task.kind is Kind.R:
            live[key] += recomputed
        peak = max(peak, sum(live.values()))
        if task.kind in (Kind.B, Kind.W):
            live.pop(key, None)
    return peak


@pytest.mark.parametrize(("schedule", "v"), [("1f1b", 1), ("varuna", 1), ("gpipe", 1), ("zero-bubble", 1),
                                             ("interleaved", 2), ("zero-bubble", 2), ("zero-bubble-v", 2)])
def test_by_degree_a_rank_never_holds_more_than_without_recompute(schedule: str, v: int) -> None:
    # recompute by degree: forwards keep their later segments' graph, so they run in the order without recompute
    # and each R(k) right before the backward of k: every micro-batch holds at most what it holds without
    # recompute, at every moment (the last stage's list is the same: its forwards keep everything)
    for num_ranks in range(2, 9):
        for m in (num_ranks, 2 * num_ranks, 4 * num_ranks, 8 * num_ranks):
            without = make_schedule(schedule, num_ranks, m, recompute=False, stages_per_rank=v)
            by_degree = make_schedule(schedule, num_ranks, m, recompute=True, stages_per_rank=v,
                                      forwards_keep_graphs=True)
            for rank, (plain, degree) in enumerate(zip(without, by_degree, strict=True)):
                assert [t for t in degree if t.kind is not Kind.R] == list(plain)
                for kept, recomputed in ((1, 1), (3, 1), (1, 3)):
                    assert _bytes_per_rank(degree, kept, recomputed, True) <= _bytes_per_rank(
                        plain, kept, recomputed, False), (schedule, num_ranks, m, rank, kept, recomputed)
    # the orders made for recomputing whole stages let forwards run ahead: with forwards that keep a graph, rank 0
    # of two-chunk zero-bubble's P=4, m=8 would hold more kept parts at once (50 units against 32 without recompute)
    recomputing = make_schedule("zero-bubble", 4, 8, recompute=True, stages_per_rank=2)
    plain = make_schedule("zero-bubble", 4, 8, recompute=False, stages_per_rank=2)
    assert _bytes_per_rank(recomputing[0], 3, 1, True) > _bytes_per_rank(plain[0], 3, 1, False)
