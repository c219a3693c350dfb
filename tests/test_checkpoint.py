"""Checkpoints keyed by parameter name: written under one P x D, loaded under another."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import python, torchrun

from lightning_varuna.checkpoint import is_complete


@pytest.mark.slow
def test_checkpoint_from_p2d2_resumes_under_p4d1_and_p1d4(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    python("equivalence.py", str(tmp_path), "reference:epoch_steps=4")
    torchrun("equivalence.py", str(tmp_path),
             f"first:pipeline_parallel_size=2,num_microbatches=4,batch=8,epoch_steps=4,epochs=1,save={ckpt}")
    assert is_complete(ckpt) and not list(tmp_path.glob("*.varuna-tmp"))
    torchrun("equivalence.py", str(tmp_path),
             f"p4:pipeline_parallel_size=4,num_microbatches=4,epoch_steps=4,steps=8,resume={ckpt}",
             f"p1:pipeline_parallel_size=1,num_microbatches=2,batch=4,epoch_steps=4,steps=8,resume={ckpt}")
    reference = json.loads((tmp_path / "reference.rank0.json").read_text())["losses"]
    first = json.loads((tmp_path / "first.rank0.json").read_text())["losses"]
    assert first == pytest.approx(reference[:4], abs=5e-4)
    for name in ("p4", "p1"):
        resumed = json.loads((tmp_path / f"{name}.rank0.json").read_text())["losses"]
        # the first resumed step sees the weights as written by 4 other ranks in another layout
        assert resumed[0] == pytest.approx(reference[4], abs=5e-4), name
