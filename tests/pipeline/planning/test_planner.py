"""Auto-configuration's pure parts on hand-computed cases: memory model, search, profile files, timeline formats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.profiles import SIZES, search_space, segment, synthetic_profile, two_segments
from torch import nn

from lightning_varuna.pipeline import CutPoint, PipelineEngine
from lightning_varuna.pipeline.config import EngineConfig
from lightning_varuna.pipeline.engine import default_loss, first_samples, samples
from lightning_varuna.pipeline.model.dry_run import trace_step
from lightning_varuna.pipeline.planning.choice import PlannerChoice, choose, plan
from lightning_varuna.pipeline.planning.memory_model import (
    MEMORY_RESERVE,
    graphs_in_flight,
    parse_bytes,
    planning_budget,
    stage_memory,
)
from lightning_varuna.pipeline.planning.profile_data import (
    CutProfile,
    Link,
    ParamProfile,
    Profile,
    ProfileError,
    interpolate,
    load_cached,
    store_cached,
)
from lightning_varuna.pipeline.planning.search import Cluster, PlanError, format_table, predict, search
from lightning_varuna.pipeline.scheduling.schedules import make_schedule
from lightning_varuna.pipeline.timelines.picture import render_png
from lightning_varuna.pipeline.timelines.timeline import (
    COLORS,
    TimelineEvent,
    chrome_trace,
    predicted_events,
    step_metrics,
)


# -- memory ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("schedule", "recompute", "expected"), [
    ("gpipe", False, [3, 3]), ("1f1b", False, [2, 1]), ("varuna", True, [1, 1]), ("gpipe", True, [1, 3]),
])
def test_graphs_in_flight_follow_the_schedule(schedule: str, recompute: bool, expected: list[int]) -> None:
    lists = make_schedule(schedule, 2, 3, recompute)
    stashes = [recompute, False]  # the last stage never recomputes
    assert [graphs_in_flight(tasks, s) for tasks, s in zip(lists, stashes, strict=True)] == expected


def test_stage_memory_hand_computed() -> None:
    profile = Profile(
        microbatch_sizes=SIZES, segments=(segment(1.0, 2.0, 1000), segment(1.0, 2.0, 3000)),
        cuts=(CutProfile("cut", 8),),
        params=(ParamProfile("p0", 100, (0,)), ParamProfile("tied", 10, (0, 1)), ParamProfile("p1", 200, (1,))),
    )
    first = stage_memory(profile, range(0, 1), 0, 2, 2, microbatch_size=2, num_microbatches=4, graphs=1)
    # weights 100+10; gradients 110 + flat copies for D=2 (100) and for the tied one (10); Adam 2x; 4 gradient
    # receive buffers of 8 x 2 bytes + one output in flight; one graph of 2000 bytes
    assert (first.weights, first.gradients, first.optimizer, first.buffers, first.activations) == (
        110, 220, 220, 80, 2000)
    last = stage_memory(profile, range(1, 2), 1, 2, 1, microbatch_size=2, num_microbatches=4, graphs=1)
    # D=1: only the tied copy is flattened; 4 activation receive buffers + one input gradient in flight
    assert (last.weights, last.gradients, last.optimizer, last.buffers, last.activations) == (210, 220, 420, 80, 6000)
    assert last.total == 210 + 220 + 420 + 80 + 6000


@pytest.mark.parametrize(("text", "expected"), [
    ("80GiB", 80 * 2**30), ("1.5GB", 1_500_000_000), ("512 MiB", 512 * 2**20), (4096, 4096), ("10k", 10_000),
])
def test_parse_bytes(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["lots", "80 GiBs", 0, True, "-1GB"])
def test_parse_bytes_says_what_it_takes(bad: object) -> None:
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes(bad)  # type: ignore[arg-type]


# -- prediction and search ------------------------------------------------------------------------------------
def test_predicted_steps_hand_computed() -> None:
    profile = two_segments()
    two_procs = Cluster(2, 2)
    # one stage holds both segments: F=2s, B=4s per micro-batch of s samples; 2 samples per replica -> 12 s
    for m in (1, 2):
        assert predict(profile, two_procs, 1, 2 / m, m, "varuna", False).candidate.step_s == pytest.approx(12.0)
    # two stages without recompute: (m + P - 1) x (F + B) = 5 x 3 s with 4 micro-batches of one sample
    for schedule in ("1f1b", "gpipe"):
        assert predict(profile, two_procs, 2, 1, 4, schedule, False).candidate.step_s == pytest.approx(15.0)
    # with recompute stage 0 works F + R + B = 4 s per micro-batch: at least 16 s
    assert predict(profile, two_procs, 2, 1, 4, "varuna", True).candidate.step_s >= 16.0


def test_search_takes_the_fastest_and_excludes_what_does_not_fit() -> None:
    profile = two_segments(param_bytes=1000)
    two_procs = Cluster(2, 2)
    ranked = search(profile, two_procs, search_space(global_batch_size=4), memory_limit=2**40)
    best = ranked[0]
    assert (best.pipeline_size, best.data_size, best.step_s) == (1, 2, pytest.approx(12.0))
    assert best.num_microbatches == 2  # as fast as m=1, with half the activations
    # P=1 holds 2000 weight bytes, gradients and their flat copy (4000) and Adam's 4000: more than 8000 bytes
    ranked = search(profile, two_procs, search_space(global_batch_size=4), memory_limit=8000)
    best = ranked[0]
    # zero-bubble (its list in 1F1B's order, each W right after its I): 3 m + 2 (P - 1) unit ticks = 14 s, where
    # 1F1B's 3 m + 3 (P - 1) = 15 s, at the same memory
    assert (best.pipeline_size, best.num_microbatches, best.recompute, best.schedule, best.step_s) == (
        2, 4, False, "zero-bubble", pytest.approx(14.0))
    assert min(c.step_s for c in ranked if c.fits and c.schedule == "1f1b") == pytest.approx(15.0)
    assert all(c.fits == (max(c.peak_bytes) <= 8000) for c in ranked)
    assert all(not c.fits for c in ranked if c.pipeline_size == 1)
    assert "over the memory limit" in format_table(ranked, memory_limit=8000)


def test_a_slow_all_reduce_makes_the_pipeline_win() -> None:
    # the whole model's 2000 gradient bytes over 2 replicas: 2 ring steps of 1000 bytes at 500 B/s = 4 s exposed
    profile = two_segments(param_bytes=1000, allreduce=Link(0.0, 500.0))
    one_stage = predict(profile, Cluster(2, 2), 1, 1, 2, "varuna", False).candidate
    assert one_stage.step_s == pytest.approx(12.0 + 4.0)
    best = search(profile, Cluster(2, 2), search_space(global_batch_size=4), memory_limit=2**40)[0]
    assert (best.pipeline_size, best.schedule, best.step_s) == (2, "zero-bubble", pytest.approx(14.0))


def test_fixed_choices_are_kept_and_p_needs_a_global_batch() -> None:
    profile = two_segments()
    fixed = search_space(pipeline_parallel_size=2, microbatch_size=None, schedule="gpipe", recompute=True)
    ranked = search(profile, Cluster(2, 2), fixed, memory_limit=2**40, replica_batch_size=6)
    assert [(c.pipeline_size, c.num_microbatches, c.schedule, c.recompute) for c in ranked] == [(2, 4, "gpipe", True)]
    with pytest.raises(PlanError, match="needs global_batch_size"):
        search(profile, Cluster(2, 2), search_space(), memory_limit=2**40, replica_batch_size=6)
    with pytest.raises(PlanError, match="does not split"):
        search(profile, Cluster(2, 2), search_space(pipeline_parallel_size=1, global_batch_size=3), memory_limit=2**40)


def test_cluster_knows_which_traffic_crosses_nodes() -> None:
    two_nodes = Cluster(world_size=4, devices_per_node=2)
    assert [two_nodes.boundary_crosses(4, b) for b in range(3)] == [False, True, False]
    assert not two_nodes.boundary_crosses(2, 0)  # each pipeline inside a node
    assert two_nodes.replicas_cross(2, [0]) and two_nodes.replicas_cross(1, [0])
    assert two_nodes.replicas_cross(4, [0, 3]) and not two_nodes.replicas_cross(4, [0, 1])  # tied first and last
    assert not Cluster(world_size=4, devices_per_node=4).replicas_cross(1, [0])
    assert two_nodes.sharing(2) == 2 and two_nodes.sharing(1) == 1


def test_interpolation_between_and_beyond_measured_sizes() -> None:
    assert interpolate((1, 2, 4), (1.0, 3.0, 4.0), 3) == pytest.approx(3.5)
    assert interpolate((1, 2, 4), (1.0, 3.0, 4.0), 8) == pytest.approx(6.0)
    assert interpolate((2,), (3.0,), 6) == pytest.approx(9.0)
    assert interpolate((1, 2), (5.0, 1.0), 10) == 0.0  # never negative


# -- files ----------------------------------------------------------------------------------------------------
def test_profile_round_trip_and_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    profile = two_segments()
    path = tmp_path / "profile.json"
    profile.save(path)
    assert Profile.load(path) == profile
    monkeypatch.setenv("LIGHTNING_VARUNA_CACHE_DIR", str(tmp_path / "cache"))
    assert load_cached("two") is None
    stored = store_cached(profile)
    assert stored is not None and stored.parent.parent == tmp_path / "cache"
    assert load_cached("two") == profile
    data = json.loads(path.read_text())
    data["version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="version"):
        Profile.load(path)


def test_chrome_trace_and_png_are_valid(tmp_path: Path) -> None:
    prediction = predict(two_segments(), Cluster(2, 2), 2, 1, 4, "1f1b", False)
    events = predicted_events(prediction)
    trace = json.loads(json.dumps(chrome_trace(events)))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == {0, 1}
    assert sorted(e["name"] for e in spans if e["cat"] in "FB" and e["tid"] == 0) == sorted(
        [f"F{k}" for k in range(4)] + [f"B{k}" for k in range(4)])
    assert all(e["dur"] >= 0 and e["ts"] >= 0 and isinstance(e["pid"], int) for e in spans)
    names = {(e["tid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {(0, "stage 0"), (1, "stage 1")}
    metrics = step_metrics(events, 2)
    assert metrics["pipeline/busy_s/stage_0"] == pytest.approx(12.0)
    assert metrics["pipeline/bubble"] == pytest.approx(1 - 24 / 30) == prediction.candidate.bubble

    path = tmp_path / "timeline.png"
    executed = [TimelineEvent(0, "F", 0.0, 1.0, 0), TimelineEvent(1, "wait", 0.0, 1.0), TimelineEvent(1, "F", 1, 2, 0)]
    render_png(path, [("predicted", events), ("executed", executed)], width=400)
    width, height, pixels = _decode_png(path.read_bytes())
    assert width == 400 and height > 100
    colors = {tuple(round(float(c) * 255) for c in pixel[:3]) for row in pixels for pixel in row}
    assert COLORS["F"] in colors and COLORS["B"] in colors, "forward and backward tasks are drawn"


def _decode_png(data: bytes) -> tuple[int, int, object]:
    """Width, height and pixels of a PNG, read by matplotlib."""
    import io

    from matplotlib.image import imread

    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = imread(io.BytesIO(data), format="png")
    return pixels.shape[1], pixels.shape[0], pixels


# -- options and errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("options", "match"), [
    ({"recompute": "maybe"}, "recompute must be True, False, 'auto' or a number of segments"),
    ({"microbatch_size": "auto", "num_microbatches": 4}, "microbatch_size='auto' chooses the number"),
    ({"memory_limit": "lots"}, "memory size 'lots'"),
    ({"microbatch_size": "big"}, "microbatch_size must be an int or 'auto'"),
    ({"schedule": "fastest"}, "choose one of .* or 'auto'"),
])
def test_engine_config_says_what_to_change(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(**options)


def test_the_planner_keeps_a_reserve_below_the_memory_limit(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(8, 64), CutPoint(), nn.Linear(64, 1))
    batch = (torch.randn(4, 8), torch.randn(4, 1))

    def step(b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(model(b[0]), b[1])

    synthetic_profile(model, batch, step, 4).save(tmp_path / "profile.json")
    trace = trace_step(model, lambda n: step(first_samples(batch, n)))[0]

    def chosen(memory_limit: int) -> PlannerChoice:
        config = EngineConfig(pipeline_parallel_size=1, microbatch_size="auto", schedule="auto", recompute="auto",
                              memory_limit=memory_limit, profile=str(tmp_path / "profile.json"))
        return plan(config, model, trace, lambda n: step(samples(batch, n)), default_loss, 4, torch.device("cpu"),
                    None, Cluster(1, 1), None)

    fastest = chosen(2**40).chosen
    peak = max(fastest.peak_bytes)
    assert planning_budget(peak) == int(peak * (1 - MEMORY_RESERVE)) < peak
    # the fastest configuration's predicted peak is exactly the limit: within it, but not within the reserve
    auto = chosen(peak)
    assert auto.chosen.describe() != fastest.describe() and max(auto.chosen.peak_bytes) <= planning_budget(peak)
    assert all(c.fits == (max(c.peak_bytes) <= planning_budget(peak)) for c in auto.ranking)
    assert "less its 10% reserve" in format_table(auto.ranking, memory_limit=peak, reserve=MEMORY_RESERVE)


def test_nothing_fits_and_a_foreign_profile_are_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_VARUNA_CACHE_DIR", str(tmp_path / "cache"))
    model = nn.Sequential(nn.Linear(8, 8), CutPoint(), nn.Linear(8, 1))
    batch = (torch.randn(4, 8), torch.randn(4, 1))

    def step(b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(model(b[0]), b[1])

    engine = PipelineEngine(model, EngineConfig(1, schedule="auto", recompute="auto", memory_limit=64), planner=choose)
    with pytest.raises(PlanError, match="No configuration fits in memory_limit=64 bytes per stage"):
        engine.setup(batch, step)
    assert list((tmp_path / "cache" / "profiles").glob("*.json")), "the measured profile is cached"
    two_segments().save(tmp_path / "other.json")
    config = EngineConfig(1, schedule="auto", profile=str(tmp_path / "other.json"))
    engine = PipelineEngine(model, config, planner=choose)
    with pytest.raises(ProfileError, match="is of another model"):
        engine.setup(batch, step)


@pytest.mark.parametrize(("text", "expected"), [("100Gbit", 12.5e9), ("12.5GB", 12.5e9), ("800MB", 8e8),
                                                ("1e9", 1e9), ("100mbit/s", 12.5e6)])
def test_cli_bandwidths(text: str, expected: float) -> None:
    from lightning_varuna.trainer.preview import parse_bandwidth

    assert parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize(("text", "expected"), [("20us", 2e-5), ("0.5ms", 5e-4), ("1e-5", 1e-5), ("2s", 2.0)])
def test_cli_latencies(text: str, expected: float) -> None:
    from lightning_varuna.trainer.preview import parse_seconds

    assert parse_seconds(text) == pytest.approx(expected)
    with pytest.raises(ValueError, match="latency 'soon'"):
        parse_seconds("soon")


# -- profiling a model built on the meta device --------------------------------------------------------------
class _Recorded(nn.Module):
    """A block that, while ``seen`` is recording, notes which of the model's parameters have memory when it runs."""

    def __init__(self, model: list[nn.Module], seen: list[set[str]] | None, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self._model, self._seen = model, seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._seen is not None and self._model[1:] and not x.is_meta:
            self._seen.append({n for n, p in self._model[0].named_parameters() if not p.is_meta and p.stride(-1)})
        return torch.tanh(self.linear(x))


def _profile_blocks(meta: bool, seen: list[set[str]]) -> tuple[Profile, nn.Module, list]:
    """Profiles three recorded blocks with cut points between them, built on meta or for real."""
    from lightning_varuna.pipeline.engine import default_loss, first_samples, samples
    from lightning_varuna.pipeline.model.dry_run import trace_step
    from lightning_varuna.pipeline.model.meta_init import on_meta, parameters_on_meta, to_meta
    from lightning_varuna.pipeline.planning.profiler import profile_model

    torch.manual_seed(0)
    holder: list = []  # the model, then True while profiling (the tracer would count the recording's uses)
    with parameters_on_meta() if meta else torch.device("cpu"):
        model = nn.Sequential(_Recorded(holder, seen, 8), CutPoint(), _Recorded(holder, seen, 8), CutPoint(),
                              _Recorded(holder, seen, 8))
    holder.append(model)
    before = list(model.named_parameters())
    batch = torch.randn(4, 8)

    def step(b: torch.Tensor) -> torch.Tensor:
        return model(b).square().mean()

    with on_meta(model) if meta else torch.device("cpu"):
        trace, _ = trace_step(model, lambda n: step(first_samples(to_meta(batch) if meta else batch, n)))
    holder.append(True)
    profile = profile_model(model, lambda n: step(samples(batch, n)), default_loss, trace, (1, 2, 4),
                            torch.device("cpu"))
    return profile, model, before


def test_a_model_on_meta_is_profiled_a_segment_at_a_time() -> None:
    seen: list[set[str]] = []
    real, _, _ = _profile_blocks(False, [])
    on_meta, model, before = _profile_blocks(True, seen)
    assert list(model.named_parameters()) == before, "the same parameters afterwards"
    assert all(p.is_meta for _, p in before), "every segment's memory was given back"
    segments = [{f"{i}.linear.weight", f"{i}.linear.bias"} for i in (0, 2, 4)]
    assert seen and all(any(s <= segment for segment in segments) for s in seen), "one segment at a time"
    assert on_meta.params == real.params and on_meta.cuts == real.cuts and on_meta.key == real.key
    for a, b in zip(real.segments, on_meta.segments, strict=True):
        assert a.saved_bytes == b.saved_bytes
        assert all(t > 0 for t in (*b.forward_s, *b.forward_grad_s, *b.backward_s))
