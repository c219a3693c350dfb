"""Models built on the meta device, trained under the strategy: pretrained weights, layout-independent
initialization, errors on every rank, and resuming under another P x D.

One plain reference run and two torchrun jobs (2 and 4 processes), several configurations each.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.launch import python, torchrun
from helpers.results import rank_results
from safetensors.torch import save_file

from tests.trainer.test_equivalence import LOSS_TOLERANCE

MODEL = "model."


def _write_weights(out: Path) -> dict[str, Path]:
    """The reference's weights as a torch.save'd state dict, and as a sharded Hugging Face folder without the
    tied head and without the wrapper's prefix; and three broken folders."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jobs"))
    from big_models import Wrapped

    torch.manual_seed(123)
    state = {k: v.detach().clone() for k, v in Wrapped(in_configure_model=False).state_dict().items()}
    paths = {"pt": out / "weights.pt"}
    torch.save(state, paths["pt"])
    hf = {k[len(MODEL):]: v for k, v in state.items() if k != "model.lm_head.weight"}
    keys = sorted(hf)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    paths["hf"] = out / "hf"
    paths["hf"].mkdir()
    for name, part in shards.items():
        save_file({k: hf[k] for k in part}, paths["hf"] / name, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, part in shards.items() for k in part}}
    (paths["hf"] / "model.safetensors.index.json").write_text(json.dumps(index))
    broken = {  # a wrong shape is reported alone; a missing and an extra key together
        "missing_extra": {**{k: v for k, v in hf.items() if k != "blocks.3.mlp.0.weight"},
                          "blocks.7.mlp.0.weight": torch.zeros(128, 32)},
        "shape": {**hf, "ln_f.weight": torch.zeros(33)},
    }
    for name, weights in broken.items():
        paths[name] = out / f"{name}.safetensors"
        save_file(weights, paths[name])
    return paths


# under pytest-xdist one worker runs all of this module's tests, so its module-scoped jobs run once
pytestmark = pytest.mark.xdist_group("big_models")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("big_models")
    paths = _write_weights(out)
    python("big_models.py", str(out), f"reference:weights={paths['pt']}")
    meta = "pipeline_parallel_size=2,num_microbatches=4"
    torchrun("big_models.py", str(out), f"file-p2:{meta},initial_weights={paths['pt']}",
             f"init-p2:{meta},init=true,save_dir={out / 'ckpt'}",
             f"shape-p2:{meta},initial_weights={paths['shape']},initial_weights_prefix={MODEL},expect_error=true",
             nproc=2, timeout=600)
    torchrun("big_models.py", str(out),
             f"hf-p2d2:{meta},batch=8,initial_weights={paths['hf']},initial_weights_prefix={MODEL}",
             "init-p4:pipeline_parallel_size=4,num_microbatches=4,init=true",
             # the checkpoint, not initial_weights, supplies the weights
             f"resume-p4:pipeline_parallel_size=4,num_microbatches=4,init=true,resume={out / 'ckpt' / 'step4.ckpt'},"
             f"initial_weights={paths['hf']},initial_weights_prefix={MODEL}",
             f"missing_extra-p4:pipeline_parallel_size=4,num_microbatches=4,initial_weights={paths['missing_extra']},"
             f"initial_weights_prefix={MODEL},expect_error=true",
             nproc=4, timeout=600)
    return out


def _ranks(out: Path, name: str, count: int) -> list[dict]:
    """The results of every rank of job ``name``, which ran ``count`` processes (a missing rank fails the test)."""
    files = len(list(out.glob(f"{name}.rank*.json")))
    assert files == count, f"{name}: {files} result files, {count} ranks"
    return rank_results(out, name, count)


def _assert_close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), what
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) < LOSS_TOLERANCE, f"{what} step {step}: {a} != {b}"


@pytest.mark.slow
@pytest.mark.parametrize(("name", "ranks"), [("file-p2", 2), ("hf-p2d2", 4)])
def test_pretrained_weights_give_the_plain_runs_losses(runs: Path, name: str, ranks: int) -> None:
    """A torch.save'd file (P=2), and a sharded Hugging Face folder without the tied head into the wrapped model
    (P=2 x D=2), loaded per stage into a model built on meta: the losses of the plain run that loaded the file."""
    reference = _ranks(runs, "reference", 1)[0]
    assert len(reference["losses"]) == 8
    results = _ranks(runs, name, ranks)
    held: dict[str, list[float]] = {}
    for rank, run in enumerate(results):
        _assert_close(run["losses"], reference["losses"], f"{name} rank {rank}")
        for param, values in run["initial"].items():
            assert values == reference["initial"][param], f"{name} rank {rank}: {param} as loaded"
            held[param] = values
    assert set(held) == set(reference["initial"]), "every parameter is held by some stage"
    # the embedding, tied to the head, is held by both ends and was loaded on both
    assert sum("model.wte.weight" in run["initial"] for run in results) == ranks


@pytest.mark.slow
def test_strategy_initialization_does_not_depend_on_the_layout(runs: Path) -> None:
    p2, p4 = _ranks(runs, "init-p2", 2), _ranks(runs, "init-p4", 4)
    _assert_close(p4[0]["losses"], p2[0]["losses"], "P=4 vs P=2")
    merged2 = {k: v for run in p2 for k, v in run["initial"].items()}
    merged4 = {k: v for run in p4 for k, v in run["initial"].items()}
    assert merged2 == merged4, "the same initial weights under P=2 and P=4"
    reference = _ranks(runs, "reference", 1)[0]
    assert merged2["model.inv_freq"] == reference["initial"]["model.inv_freq"], "the buffer built at construction"
    assert merged2["model.wte.weight"] != reference["initial"]["model.wte.weight"]


@pytest.mark.slow
def test_resuming_a_meta_built_run_under_another_layout_takes_the_checkpoints_weights(runs: Path) -> None:
    uninterrupted = _ranks(runs, "init-p2", 2)[0]["losses"]
    for rank, run in enumerate(_ranks(runs, "resume-p4", 4)):
        _assert_close(run["losses"], uninterrupted[4:], f"resumed rank {rank}")


@pytest.mark.slow
@pytest.mark.parametrize(("job", "ranks", "messages"), [
    ("missing_extra-p4", 4, [r"1 key\(s\) of the model are not in it: model\.blocks\.3\.mlp\.0\.weight; ",
                             r"; 1 of its key\(s\) are not in the model: model\.blocks\.7\.mlp\.0\.weight\. Keys"
                             r" are matched as initial_weights_prefix"]),
    ("shape-p2", 2, [r"1 shape\(s\) differ: model\.ln_f\.weight \(33,\) in the file, \(32,\) in the model"]),
])
def test_weights_that_do_not_fit_fail_on_every_rank_with_the_names(runs: Path, job: str, ranks: int,
                                                                    messages: list[str]) -> None:
    import re

    results = _ranks(runs, job, ranks)
    for rank, run in enumerate(results):
        assert run["error"].startswith("CheckpointError: initial_weights"), f"rank {rank}: {run['error']}"
        for message in messages:
            assert re.search(message, run["error"]), f"rank {rank}: {run['error']}"
