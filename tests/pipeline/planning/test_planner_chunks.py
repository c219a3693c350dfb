"""Auto-configuration of several model chunks per rank and of recompute by degree: what is searched, memory per rank.

End to end (a chosen ``stages_per_rank=2`` training like the plain run, resumed from one chunk per rank) is in
``test_autoconfig.py``.
"""

from __future__ import annotations

import pytest
from helpers.profiles import network, search_space, segment

from lightning_varuna.pipeline.config import EngineConfig
from lightning_varuna.pipeline.planning.memory_model import activation_peak
from lightning_varuna.pipeline.planning.profile_data import CutProfile, ParamProfile, Profile
from lightning_varuna.pipeline.planning.search import Cluster, PlanError, predict, search
from lightning_varuna.pipeline.scheduling.schedules import SCHEDULES, Kind, Task, schedule_spec

UNLIMITED = 2**40


def uniform(segments: int, saved_per_sample: int = 10) -> Profile:
    """``segments`` equal segments (F=1 s, B=2 s per sample), free messages, no overhead or optimizer time."""
    return Profile(
        microbatch_sizes=(1, 2, 4), segments=tuple(segment(1.0, 2.0, saved_per_sample) for _ in range(segments)),
        cuts=tuple(CutProfile(f"cut{i}", 4) for i in range(segments - 1)),
        params=tuple(ParamProfile(f"p{i}", 100, (i,)) for i in range(segments)),
        network=network(), key="uniform",
    )


def test_graphs_of_chunks_of_different_sizes_are_weighed_by_their_own_bytes() -> None:
    # rank 0 of P=2 runs stages 0 (saves 10 bytes, no recompute) and 2 (saves 30, recomputed whole: its forward
    # keeps nothing, its recompute all 30)
    order = [Task(Kind.F, 0, stage=0), Task(Kind.F, 0, stage=2), Task(Kind.R, 0, stage=2), Task(Kind.F, 1, stage=0),
             Task(Kind.B, 0, stage=2), Task(Kind.B, 0, stage=0), Task(Kind.B, 1, stage=0)]
    # live after each task: 10, 10, 40, 50, 20, 10, 0
    assert activation_peak(order, [10, 20, 0, 40], [0, 0, 30, 0], rank=0) == 50


def test_recompute_by_degree_holds_the_kept_part_of_each_forward_and_one_recomputed_part() -> None:
    order = [Task(Kind.F, 0), Task(Kind.F, 1), Task(Kind.R, 0), Task(Kind.B, 0), Task(Kind.R, 1), Task(Kind.B, 1)]
    # a stage saving 30 bytes: its first segments 18, the rest 12
    assert activation_peak(order, [12], [18], rank=0) == 12 + 12 + 18  # after R0: two kept parts, one recomputed
    assert activation_peak(order, [0], [30], rank=0) == 30  # recompute=True
    assert activation_peak([t for t in order if t.kind is not Kind.R], [30], [0], rank=0) == 60  # recompute=False


def test_two_chunks_per_rank_are_searched_with_the_schedules_that_run_them() -> None:
    profile = uniform(8)
    ranked = search(profile, Cluster(4, 4),
                    search_space(pipeline_parallel_size=4, num_microbatches=8, stages_per_rank="auto"),
                    UNLIMITED, replica_batch_size=8)
    chunks = {c.stages_per_rank for c in ranked}
    assert chunks == {1, 2}
    several = {s for s in SCHEDULES if schedule_spec(s).runs_several_chunks}
    assert {c.schedule for c in ranked if c.stages_per_rank == 2} == several
    assert "interleaved" not in {c.schedule for c in ranked if c.stages_per_rank == 1}
    # halving the chunks halves the fill and drain: the fastest runs two chunks per rank
    best = ranked[0]
    one_chunk = min(c.step_s for c in ranked if c.stages_per_rank == 1)
    assert best.stages_per_rank == 2 and best.step_s < one_chunk
    assert len(best.stages) == 8 and best.describe().endswith("2 chunks per rank")


def test_a_memory_limit_below_two_chunks_peak_chooses_one_chunk() -> None:
    profile = uniform(8, saved_per_sample=1000)  # activations decide the peak
    choices = search_space(pipeline_parallel_size=4, num_microbatches=8, stages_per_rank="auto", recompute=False)
    ranked = search(profile, Cluster(4, 4), choices, UNLIMITED, replica_batch_size=8)
    fastest_two = next(c for c in ranked if c.stages_per_rank == 2)
    lighter_one = min((c for c in ranked if c.stages_per_rank == 1), key=lambda c: max(c.peak_bytes))
    assert max(lighter_one.peak_bytes) < max(fastest_two.peak_bytes)
    limit = max(fastest_two.peak_bytes) - 1
    ranked = search(profile, Cluster(4, 4), choices, limit, replica_batch_size=8)
    assert ranked[0].fits and max(ranked[0].peak_bytes) <= limit
    assert all(c.fits == (max(c.peak_bytes) <= limit) for c in ranked)
    chosen = ranked[0]
    assert (chosen.stages_per_rank, chosen.schedule) != (2, fastest_two.schedule)
    assert chosen.step_s >= fastest_two.step_s  # the memory limit costs time


def test_two_chunks_hold_what_each_stage_holds() -> None:
    profile = uniform(8)
    two = predict(profile, Cluster(4, 4), 4, 1, 8, "interleaved", False, stages_per_rank=2).candidate
    # rank 0 holds stages 0 and 4: both parameters (100 bytes each), their gradients and Adam's two states
    assert two.memory[0].weights == 200 and two.memory[0].optimizer == 400
    # the interleaved schedule's stated bound at P=4, v=2 on rank 0: 2(P-1) + P + 1 = 11 chunk graphs of 10 bytes
    assert two.memory[0].activations <= 11 * 10
    one = predict(profile, Cluster(4, 4), 4, 1, 8, "1f1b", False).candidate
    assert one.memory[0].activations == 4 * 20  # 1F1B's first stage: P graphs of its two segments


def test_the_v_schedule_is_predicted_over_its_own_placement() -> None:
    profile = uniform(8)
    v = predict(profile, Cluster(4, 4), 4, 1, 16, "zero-bubble-v", False, stages_per_rank=2)
    looped = predict(profile, Cluster(4, 4), 4, 1, 16, "zero-bubble", False, stages_per_rank=2)
    # rank 0 holds stages 0 and 7 (V-shaped), not 0 and 4: its tasks name those
    assert {t.stage for t in v.schedule.order[0]} == {0, 7}
    assert {t.stage for t in looped.schedule.order[0]} == {0, 4}
    assert v.candidate.memory[0].weights == 200  # two stages' parameters
    # every rank within 2P chunk graphs (one segment of 10 bytes each, micro-batches of 1 sample)
    assert max(m.activations for m in v.candidate.memory) <= 2 * 4 * 10
    assert v.candidate.step_s <= looped.candidate.step_s


def test_a_model_with_too_few_segments_for_two_chunks_says_so() -> None:
    with pytest.raises(PlanError, match="2 chunks per rank"):
        search(uniform(3), Cluster(2, 2),
               search_space(pipeline_parallel_size=2, num_microbatches=4, stages_per_rank=2),
               UNLIMITED, replica_batch_size=4)
    # searched: one chunk per rank remains
    ranked = search(uniform(3), Cluster(2, 2),
                    search_space(pipeline_parallel_size=2, num_microbatches=4, stages_per_rank="auto"),
                    UNLIMITED, replica_batch_size=4)
    assert {c.stages_per_rank for c in ranked} == {1}


def test_the_configuration_takes_auto_chunks_and_auto_values_with_two_chunks() -> None:
    assert EngineConfig(stages_per_rank="auto", schedule="auto").searches
    EngineConfig(stages_per_rank=2, schedule="auto", pipeline_parallel_size=2, recompute="auto")
    with pytest.raises(ValueError, match="stages_per_rank='auto' needs a pipeline"):
        EngineConfig(stages_per_rank="auto", pipeline_parallel_size=1)
    with pytest.raises(ValueError, match="stages_per_rank must be an int >= 1 or 'auto'"):
        EngineConfig(stages_per_rank="two")  # type: ignore[arg-type]


# -- recompute by degree ------------------------------------------------------------------------------------------
def test_degrees_lie_between_no_recompute_and_whole_stages_in_memory_and_time() -> None:
    profile = uniform(8)  # P=2: stages of 4 segments
    ranked = search(profile, Cluster(2, 2),
                    search_space(pipeline_parallel_size=2, num_microbatches=4, schedule="1f1b"), UNLIMITED,
                    replica_batch_size=4)
    by_recompute = {repr(c.recompute): c for c in ranked}
    assert set(by_recompute) == {"True", "False", "1", "2", "3"}
    order = ["False", "1", "2", "3", "True"]  # more segments recomputed: less memory on stage 0, more work
    peaks = [by_recompute[r].memory[0].activations for r in order]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 5
    # (whole stages recomputed may beat a high degree: their forwards keep no graph, so the run-time rules may
    # move them ahead of a late recompute)
    steps = [by_recompute[r].step_s for r in order]
    assert steps[:4] == sorted(steps[:4]) and steps[0] < steps[4]
    # 1F1B's stage 0 holds P=2 forwards' kept parts and one recomputed part: segments of 10 bytes per sample
    assert by_recompute["1"].memory[0].activations == 2 * 3 * 10 + 1 * 10
    assert "recompute 1 segments" in by_recompute["1"].describe()


def test_under_a_memory_limit_the_fastest_degree_that_fits_is_chosen() -> None:
    profile = uniform(8, saved_per_sample=1000)
    choices = search_space(pipeline_parallel_size=2, num_microbatches=4, schedule="1f1b")
    ranked = search(profile, Cluster(2, 2), choices, UNLIMITED, replica_batch_size=4)
    two = next(c for c in ranked if c.recompute == 2 and c.recompute is not True)
    chosen = search(profile, Cluster(2, 2), choices, max(two.peak_bytes), replica_batch_size=4)[0]
    assert chosen.recompute == 2 and chosen.recompute is not True and chosen.step_s == two.step_s


def test_a_degree_a_value_would_cross_is_not_searched() -> None:
    profile = uniform(8)
    crossed = Profile(**{**profile.__dict__, "crossings": ((0, 1),)})
    ranked = search(crossed, Cluster(2, 2),
                    search_space(pipeline_parallel_size=2, num_microbatches=4, schedule="1f1b"), UNLIMITED,
                    replica_batch_size=4)
    assert {repr(c.recompute) for c in ranked} == {"True", "False", "2", "3"}
