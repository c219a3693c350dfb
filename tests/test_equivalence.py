"""Pipelined training equals the plain single-process Lightning run: losses per step and gradients per name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import python, torchrun

# name -> (strategy options, per-replica batch); the reference trains on batch 16 in one process
CONFIGS = {
    "p4-varuna": "pipeline_parallel_size=4,num_microbatches=4,schedule=varuna",
    "p4-varuna-norecompute": "pipeline_parallel_size=4,num_microbatches=4,schedule=varuna,recompute=false",
    "p4-1f1b": "pipeline_parallel_size=4,num_microbatches=8,schedule=1f1b",
    "p4-1f1b-norecompute-m3": "pipeline_parallel_size=4,num_microbatches=3,schedule=1f1b,recompute=false",
    "p4-gpipe-m5": "pipeline_parallel_size=4,num_microbatches=5,schedule=gpipe",
    "p4-gpipe-norecompute": "pipeline_parallel_size=4,num_microbatches=4,schedule=gpipe,recompute=false",
    "p4-varuna-cut_at": "pipeline_parallel_size=4,num_microbatches=4,cut_at=blocks",
    "p2-varuna": "pipeline_parallel_size=2,num_microbatches=4,batch=8",
    "p2-varuna-norecompute-m3": "pipeline_parallel_size=2,num_microbatches=3,recompute=false,batch=8",
    "p2-1f1b": "pipeline_parallel_size=2,num_microbatches=2,schedule=1f1b,batch=8",
    "p2-gpipe-norecompute": "pipeline_parallel_size=2,num_microbatches=4,schedule=gpipe,recompute=false,batch=8",
    "p2-1f1b-cut_at": "pipeline_parallel_size=2,num_microbatches=4,schedule=1f1b,cut_at=blocks,batch=8",
}
LOSS_TOLERANCE = 5e-4
GRAD_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("equivalence")
    python("equivalence.py", str(out), "reference")
    torchrun("equivalence.py", str(out), *(f"{name}:{options}" for name, options in CONFIGS.items()), timeout=900)
    return out


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_losses_and_gradients_match_plain_run(results: Path, name: str) -> None:
    reference = _load(results / "reference.rank0.json")
    seen: set[str] = set()
    for rank in range(4):
        run = _load(results / f"{name}.rank{rank}.json")
        assert len(run["losses"]) == len(reference["losses"]) == 8
        for step, (got, want) in enumerate(zip(run["losses"], reference["losses"])):
            assert abs(got - want) < LOSS_TOLERANCE, f"rank {rank} step {step}: loss {got} != {want}"
        for param, grad in run["grads"].items():
            want = reference["grads"][param]
            worst = max(abs(a - b) for a, b in zip(grad, want))
            assert worst < GRAD_TOLERANCE, f"rank {rank}: gradient of {param} differs by {worst}"
            seen.add(param)
    assert seen == set(reference["grads"]), "every parameter is held (and checked) on some stage"
