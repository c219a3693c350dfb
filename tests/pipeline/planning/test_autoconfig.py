"""Auto-configuration end to end: the planner's choice trains like the plain run, is chosen again on a morph, writes
its timeline; and the planner CLI on the example.

The profiles are synthetic (the real models' structure, chosen costs), so the choices are fixed: a slow all-reduce
makes P = world size (D = 1) the fastest on 4 processes and again on 2; the model's 5 segments allow two chunks per
rank on 2 processes only, where they are the fastest (the morph resumes one chunk per rank's checkpoint with two).
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers.launch import ROOT, _env, python, torchrun
from helpers.models import RandomTokens, TinyGPT
from helpers.profiles import search_space, synthetic_profile
from helpers.results import rank_result, rank_results
from torch.utils.data import DataLoader

from lightning_varuna.pipeline.planning.memory_model import parse_bytes, planning_budget
from lightning_varuna.pipeline.planning.profile_data import Link, Profile
from lightning_varuna.pipeline.planning.search import Candidate, Cluster, search
from tests.pipeline.planning.test_planner import _decode_png

GLOBAL_BATCH = 16
MEMORY = "1GiB"
SLOW_ALLREDUCE = Link(0.0, 1e4)  # 10 kB/s: any data parallelism costs seconds


def _tiny_gpt_profile() -> Profile:
    torch.manual_seed(0)
    model = TinyGPT(sync_dist=True)
    batch = next(iter(DataLoader(RandomTokens(n=GLOBAL_BATCH, seed=1), batch_size=GLOBAL_BATCH)))
    with warnings.catch_warnings():  # self.log without a trainer
        warnings.simplefilter("ignore")
        return synthetic_profile(model, batch, lambda b: model.training_step(b, 0), GLOBAL_BATCH,
                                 allreduce=SLOW_ALLREDUCE)


def _expected(profile: Profile, world: int) -> Candidate:
    space = search_space(stages_per_rank="auto", global_batch_size=GLOBAL_BATCH)
    return search(profile, Cluster(world, world), space, planning_budget(parse_bytes(MEMORY)))[0]


# under pytest-xdist one worker runs all of this module's tests, so its module-scoped jobs run once
pytestmark = pytest.mark.xdist_group("autoconfig")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Profile]:
    out = tmp_path_factory.mktemp("autoconfig")
    profile = _tiny_gpt_profile()
    profile.save(out / "profile.json")
    auto = (f"pipeline_parallel_size=auto,microbatch_size=auto,schedule=auto,recompute=auto,stages_per_rank=auto,"
            f"global_batch_size={GLOBAL_BATCH},batch=5,memory_limit={MEMORY},profile={out / 'profile.json'}")
    python("equivalence.py", str(out), "reference")
    torchrun("equivalence.py", str(out),
             f"auto:{auto},steps=4,save_every=4,save_dir={out / 'ckpt'},timeline_dir={out / 'timeline'},"
             f"log_dir={out / 'logs'}")
    torchrun("equivalence.py", str(out), f"morph:{auto},resume={out / 'ckpt' / 'ckpt.ckpt'}", nproc=2)
    return out, profile


@pytest.mark.slow
def test_the_auto_choice_trains_like_the_plain_run_and_is_chosen_again_after_a_morph(runs) -> None:
    out, profile = runs
    reference = rank_result(out, "reference")
    for name, world, losses in (("auto", 4, reference["losses"][:4]), ("morph", 2, reference["losses"][4:])):
        expected = _expected(profile, world)
        assert expected.pipeline_size == world and expected.data_size == 1, "the profile forces P = world size"
        assert expected.stages_per_rank == (2 if world == 2 else 1), "5 segments: two chunks per rank at P=2 only"
        for run in rank_results(out, name, world):
            assert run["config"] == {
                "pipeline_parallel_size": expected.pipeline_size, "microbatch_size": expected.microbatch_size,
                "num_microbatches": None, "schedule": expected.schedule, "recompute": expected.recompute,
                "stages_per_rank": expected.stages_per_rank,
            }, name
            assert run["losses"] == pytest.approx(losses, abs=5e-4), name
    seen = set()
    for run in rank_results(out, "auto", 4):
        for param, grad in run["grads"].items():
            worst = max(abs(a - b) for a, b in zip(grad, reference["grads"][param], strict=True))
            assert worst < 1e-5, f"gradient of {param} differs by {worst}"
            seen.add(param)
    assert seen == set(reference["grads"])


@pytest.mark.slow
def test_the_timeline_the_metrics_and_the_hyperparameters_of_a_run(runs) -> None:
    out, profile = runs
    chosen = _expected(profile, 4)
    trace = json.loads((out / "timeline" / "timeline.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    steps = sorted({e["args"]["step"] for e in spans})
    assert steps == [0, 1, 2, 3]
    for stage in range(4):
        for step in steps:
            forwards = [e for e in spans if e["tid"] == stage and e["cat"] == "F" and e["args"]["step"] == step]
            # a split backward (zero-bubble) shows its input-gradient part as I, its weight-gradient part as W
            backwards = [e for e in spans if e["tid"] == stage and e["cat"] in ("B", "I") and e["args"]["step"] == step]
            assert len(forwards) == len(backwards) == chosen.num_microbatches, (stage, step)
    assert {e["cat"] for e in spans} >= {"F", "wait", "send", "optimizer"} and {e["cat"] for e in spans} & {"B", "I"}
    predicted = json.loads((out / "timeline" / "timeline_predicted.json").read_text())
    assert {e["tid"] for e in predicted["traceEvents"] if e["ph"] == "X" and e["cat"] == "F"} == {0, 1, 2, 3}
    width, height, _ = _decode_png((out / "timeline" / "timeline.png").read_bytes())
    assert width == 1200 and height > 150

    rows = list(csv.DictReader((out / "logs" / "run" / "version_0" / "metrics.csv").open()))
    bubbles = [float(r["pipeline/bubble"]) for r in rows if r.get("pipeline/bubble")]
    assert len(bubbles) == 2 and all(0.0 < b < 1.0 for b in bubbles)  # steps 2 and 4 of 4
    assert all(float(r["pipeline/busy_s/stage_3"]) > 0 for r in rows if r.get("pipeline/bubble"))
    hparams = (out / "logs" / "run" / "version_0" / "hparams.yaml").read_text()
    assert "varuna/pipeline_parallel_size: 4" in hparams and "varuna/profile_source: file" in hparams


def _gpt_profile() -> Profile:
    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    from model import GPT

    torch.manual_seed(0)
    model = GPT()
    model.configure_model()
    batch = (torch.randint(0, 256, (GLOBAL_BATCH, 64)), torch.randint(0, 256, (GLOBAL_BATCH, 64)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return synthetic_profile(model, batch, lambda b: model.training_step(b, 0), GLOBAL_BATCH,
                                 allreduce=Link(1e-5, 1e8))


@pytest.mark.slow
def test_the_planner_cli_on_the_example(tmp_path: Path) -> None:
    profile = _gpt_profile()
    profile.save(tmp_path / "profile.json")
    memory = "4MiB"  # rules out the configurations that hold the whole model on one stage
    gpt = ROOT / "examples" / "gpt"
    command = [sys.executable, "-m", "lightning_varuna.trainer.preview", "--config", str(gpt / "config.yaml"),
               "--model", f"{gpt / 'model.py'}:GPT", "--data", f"{gpt / 'data.py'}:StdlibText", "--devices", "4",
               "--auto", "--global-batch-size", str(GLOBAL_BATCH), "--memory", memory,
               "--profile", str(tmp_path / "profile.json"), "--top", "0", "--data.max_chars", "20000", "--meta"]
    result = subprocess.run([*command, "--json", "--timeline", str(tmp_path / "plan.png"), "--save-profile",
                             str(tmp_path / "saved.json")], capture_output=True, text=True, timeout=300, env=_env(),
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    plan = json.loads(result.stdout[result.stdout.index("{"):])
    budget = planning_budget(parse_bytes(memory))  # the limit less the planner's reserve
    ranking = search(profile, Cluster(4, 4), search_space(global_batch_size=GLOBAL_BATCH), budget)
    best = ranking[0]
    assert plan["chosen"]["pipeline_parallel_size"] == best.pipeline_size > 1
    assert (plan["chosen"]["microbatch_size"], plan["chosen"]["schedule"], plan["chosen"]["recompute"]) == (
        best.microbatch_size, best.schedule, best.recompute)
    assert plan["chosen"]["step_s"] == pytest.approx(best.step_s)
    assert plan["configurations"] == len(plan["candidates"]) == len(ranking)
    assert any(not c["fits"] for c in plan["candidates"])
    assert all(c["fits"] == (max(c["peak_bytes"]) <= budget) for c in plan["candidates"])
    assert Profile.load(tmp_path / "saved.json") == profile
    _decode_png((tmp_path / "plan.png").read_bytes())


@pytest.mark.slow
def test_the_measured_path_agrees_on_every_rank(tmp_path: Path) -> None:
    """Nothing given, the model on meta: both ranks measure the network, rank 0 profiles a segment at a time, both
    run the same choice."""
    cache = tmp_path / "cache"
    out = tmp_path / "out"
    out.mkdir()
    result = torchrun("measured.py", str(out), nproc=2, timeout=300, env={"LIGHTNING_VARUNA_CACHE_DIR": str(cache)},
                      check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    first, second = (json.loads((out / f"rank{r}.json").read_text()) for r in range(2))
    assert first["chosen"] == second["chosen"] and first["source"] == "measured" and first["built_on_meta"]
    assert all(b > 0 for saved in first["saved_bytes"] for b in saved)
    assert all(loss == loss for run in (first, second) for loss in run["losses"]), "a finite loss after materializing"
    assert first["sizes"] == [1, 2, 4, 8] and first["optimizer_state_ratio"] == pytest.approx(2.0, rel=1e-3)
    for latency, bandwidth in first["network"].values():
        assert latency >= 0 and bandwidth > 0
    assert first["network"]["p2p_intra"] != second["network"]["p2p_inter"], "the link inside the node was measured"
    assert list(cache.glob("profiles/*.json")), "the profile went to the cache directory"
