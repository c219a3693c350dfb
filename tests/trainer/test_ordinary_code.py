"""Ordinary user code is never silently wrong under the strategy: it trains as the plain run, or is refused clearly.

One torchrun job (2 gloo processes, P=2) runs the scenarios of ``jobs/ordinary_code.py`` that must train, one plain
process their references; jobs that must fail run on their own. Setup refusals run in one process with a process
grid made by hand (no process group: a check made after a collective would fail differently).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.launch import python, torchrun
from helpers.models import LinearChain
from torch import nn

from lightning_varuna import EngineConfig, PipelineEngine
from lightning_varuna.pipeline import Topology
from lightning_varuna.pipeline.batches import BatchSplitError, check_batch, first_samples, samples, split_batch

LOSS_TOLERANCE = 5e-4
GRAD_TOLERANCE = 1e-5
P2 = "pipeline_parallel_size=2"
REFERENCES = {
    "reference-weights": "kind=weights",
    # batches of 8, 8 and a short last one of 3 or 5 samples (no drop_last)
    "reference-short3": "kind=plain,samples=19",
    "reference-short5": "kind=plain,samples=21",
    "reference-inplace": "kind=inplace",
}
CONFIGS = {
    # micro-batches of 2, then of 1 sample: each step must see its own weights
    "weights-m4": f"kind=weights,{P2},num_microbatches=4",
    "weights-m8": f"kind=weights,{P2},num_microbatches=8",
    # a last batch of 3 samples runs 3 micro-batches; one of 5 runs 4 of sizes 2, 1, 1, 1
    "short3": f"kind=plain,{P2},num_microbatches=4,samples=19",
    "short5": f"kind=plain,{P2},num_microbatches=4,samples=21",
    # `h = self.wte(idx); h += self.pos[:, :T]`: the last stage stands in for wte
    "inplace": f"kind=inplace,{P2},num_microbatches=4",
}
CPU = torch.device("cpu")

pytestmark = pytest.mark.xdist_group("ordinary_code")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ordinary_code")
    python("ordinary_code.py", str(out), *(f"{n}:{s}" for n, s in REFERENCES.items()), timeout=240)
    torchrun("ordinary_code.py", str(out), *(f"{n}:{s}" for n, s in CONFIGS.items()), nproc=2, timeout=400)
    return out


def _load(results: Path, name: str, rank: int = 0) -> dict:
    return json.loads((results / f"{name}.rank{rank}.json").read_text())


def _assert_matches_plain_run(results: Path, name: str, reference: str) -> None:
    want = _load(results, reference)
    held: set[str] = set()
    for rank in range(2):
        got = _load(results, name, rank)
        assert len(got["losses"]) == len(want["losses"]), f"rank {rank}: {got['losses']} != {want['losses']}"
        for step, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=True)):
            assert abs(a - b) < LOSS_TOLERANCE, f"{name} rank {rank} step {step}: loss {a} != {b} (plain run)"
        for which in ("grads", "last_grads"):  # the first step's, and the last's (a short last batch's)
            for param, grad in got[which].items():
                worst = max(abs(a - b) for a, b in zip(grad, want[which][param], strict=True))
                assert worst < GRAD_TOLERANCE, f"{name} rank {rank}: {which} of {param} off by {worst}"
        held |= set(got["grads"])
    assert held == set(want["grads"]), "the stages together hold every parameter, each with its gradient"


def _topology(world_size: int, pipeline_size: int) -> Topology:
    return Topology(world_size=world_size, rank=0, pipeline_size=pipeline_size, device=CPU)




# -- per-sample lists ---------------------------------------------------------------------------------------

def test_per_sample_lists_follow_their_samples_into_micro_batches() -> None:
    x = torch.arange(10).view(5, 2)
    batch = {"x": x, "names": ["a", "b", "c", "d", "e"], "w": (0.5, 1.5, 2.5, 0.5, 1.5), "task": "lm",
             "classes": ["cat", "dog"], "ids": [{"id": i} for i in range(5)]}
    parts = split_batch(batch, 3)
    assert [p["names"] for p in parts] == [["a", "b"], ["c", "d"], ["e"]]
    assert [p["w"] for p in parts] == [(0.5, 1.5), (2.5, 0.5), (1.5,)]
    assert [len(p["x"]) for p in parts] == [2, 2, 1]  # tensor_split's sizes, the lists alike
    assert [p["ids"] for p in parts][2] == [{"id": 4}]
    assert all(p["task"] == "lm" and p["classes"] == ["cat", "dog"] for p in parts)  # shared: not per sample
    assert first_samples(batch, 2)["names"] == ["a", "b"]
    assert samples(batch, 7)["names"] == ["a", "b", "c", "d", "e", "a", "b"]


def test_a_list_of_batch_sized_tensors_is_structure_even_when_its_length_is_the_batch_size() -> None:
    x, y = torch.zeros(2, 3), torch.ones(2)
    parts = split_batch([x, y], 2)  # `x, y = batch` with a batch of 2: two tensors, not two samples
    assert [[t.shape[0] for t in p] for p in parts] == [[1, 1], [1, 1]]
    check_batch([x, y])


@pytest.mark.parametrize(
    ("element", "match"),
    [
        ([torch.zeros(3), torch.zeros(5)], r"batch\[1\] is a list of 2 values holding tensors, none of them with the"
         r" batch size 2 .* pad and stack them .* put them in a dict"),
        ({"a", "b"}, r"batch\[1\] is a set of 2 values in a batch of 2 samples: it looks per-sample, but it cannot"
         r" be split"),
    ],
)
def test_a_batch_element_that_cannot_follow_its_samples_is_refused_at_setup(element: object, match: str) -> None:
    model = LinearChain()
    engine = PipelineEngine(model, EngineConfig(2, num_microbatches=2))
    with pytest.raises(BatchSplitError, match=match):  # raised before the topology's first collective
        engine.setup((torch.randn(2, 4), element), lambda b: model(b[0]), topology=_topology(2, 2))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["weights-m4", "weights-m8"])
def test_per_sample_weight_list_trains_as_the_plain_run(results: Path, name: str) -> None:
    _assert_matches_plain_run(results, name, "reference-weights")


# -- a short last batch ------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("samples", [3, 5])
def test_short_last_batch_trains_as_the_plain_run(results: Path, samples: int) -> None:
    assert len(_load(results, f"short{samples}")["losses"]) == 3, "the short last batch is the third step"
    _assert_matches_plain_run(results, f"short{samples}", f"reference-short{samples}")


# -- in-place arithmetic on a stood-in module's output -------------------------------------------------------

def test_stand_in_output_takes_in_place_arithmetic_and_every_call_sees_zeros() -> None:
    from lightning_varuna.pipeline.model.stand_ins import StandIn

    stand_in = StandIn(nn.Embedding(8, 4), frozenset({0}), lambda: 1, CPU)  # runs in segment 1: stood in for
    idx = torch.zeros(2, 3, dtype=torch.long)
    h = stand_in(idx)
    h += torch.ones(1, 3, 4)  # the GPT idiom; a zero-stride tensor refuses it
    assert h.is_contiguous() and bool((h == 1).all())
    again = stand_in(idx)
    assert not bool(again.any()), "a write by user code leaked into the next call"
    assert again.data_ptr() == h.data_ptr(), "one buffer, no allocation per call"
    weight = torch.ones(2, 3, 4, requires_grad=True)
    again += weight  # gives this call's tensor a graph, not the buffer the next calls get
    assert again.grad_fn is not None and not stand_in(idx).requires_grad
    with torch.inference_mode():  # validation before training: the buffer stays a normal tensor
        stand_in(torch.zeros(4, 3, dtype=torch.long)).add_(2)
    assert stand_in(torch.zeros(4, 3, dtype=torch.long)).sum() == 0 and stand_in(idx).sum() == 0


@pytest.mark.slow
def test_in_place_add_on_a_stood_in_embedding_trains_as_the_plain_run(results: Path) -> None:
    _assert_matches_plain_run(results, "inplace", "reference-inplace")


# -- a branch the dry run did not take ----------------------------------------------------------------------

@pytest.mark.slow
def test_module_called_where_the_dry_run_did_not_see_it_fails_every_rank(tmp_path: Path) -> None:
    # `extra` runs only when the batch's flag says so: not in the dry run's batch, so its parameters went to
    # stage 0, and stage 1 would run it on placeholders in the first training step
    # a rank left waiting for its peer would wait p2p_timeout (600 s), past the job's 240 s: the test bounds how soon
    # the other rank ends without timing it (measured: rank 0 reports within 0.1 s, the job ends 4 s after the error)
    result = torchrun("ordinary_code.py", str(tmp_path), f"branch:kind=branch,{P2},num_microbatches=4,p2p_timeout=600",
                      nproc=2, timeout=240, check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0, "the job trained on placeholders without an error"
    assert not list(tmp_path.glob("branch.rank*.json")), "no rank finished the fit"
    message = ("UnseenCallError: Stage 1 called extra (Linear) in segment 3, a call the dry run did not see: it called"
               " it never (its batch did not take the branch that calls it), so its parameters (extra.weight,"
               " extra.bias) are held by stage 0")
    assert f"[rank1]: lightning_varuna.pipeline.model.stand_ins.{message}" in output, output[-4000:]
    assert "h = torch.where(flag, self.extra(h), h)" in output  # what to do
    # the other rank ends with the cause, naming the module, not a timeout
    assert f"[rank 0] lightning_varuna: rank 1 failed: lightning_varuna.pipeline.model.stand_ins.{message}" in output
    ended = [line for line in output.splitlines() if line.startswith("[rank 0] lightning_varuna: rank 1 failed")]
    assert ended and ended[0].endswith("Ending rank 0 (exit code 1)."), ended


# -- a memory limit with nothing to choose ------------------------------------------------------------------

def test_memory_limit_is_checked_against_a_fixed_configuration() -> None:
    from lightning_varuna.pipeline.planning.choice import PlanError, choose

    config = EngineConfig(1, num_microbatches=2, schedule="gpipe", recompute=False, memory_limit="1KiB")
    assert config.searches, "a memory limit is a reason to run the planner"
    with pytest.raises(ValueError, match=r"a memory_limit to check\): give the engine one"):
        PipelineEngine(LinearChain(), config)
    model = LinearChain()
    engine = PipelineEngine(model, config, planner=choose)
    # the planner's own wording, for the one configuration the user fixed
    match = (r"No configuration fits in memory_limit=1024 bytes per stage: the smallest predicted peak is \d+ bytes"
             r" \(P=1 x D=1, micro-batch 2 x 2, gpipe, no recompute\)")
    with pytest.raises(PlanError, match=match):  # raised before the process grid's first collective
        engine.setup(torch.randn(4, 4), model)


# -- refused before other processes start -------------------------------------------------------------------

def test_manual_optimization_is_refused_before_the_launcher_starts_other_ranks() -> None:
    import os
    from unittest import mock

    import lightning.pytorch as pl
    from helpers.models import RandomTokens, TinyGPT
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
    from lightning.pytorch.utilities.exceptions import MisconfigurationException
    from torch.utils.data import DataLoader

    from lightning_varuna import VarunaStrategy

    class Manual(TinyGPT):
        def __init__(self) -> None:
            super().__init__(n_layer=2)
            self.automatic_optimization = False

    started = mock.Mock(side_effect=AssertionError("the launcher started other ranks first"))
    with (mock.patch.dict(os.environ), mock.patch.object(_SubprocessScriptLauncher, "_call_children_scripts", started),
          pytest.raises(MisconfigurationException, match="supports automatic optimization only")):
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=VarunaStrategy(pipeline_parallel_size=2),
                             max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
        trainer.fit(Manual(), DataLoader(RandomTokens(n=8), batch_size=4))
    started.assert_not_called()
