"""Job morphing: a checkpoint written mid-epoch under one P x D resumes under another on the same trajectory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.launch import python, torchrun

from lightning_varuna.checkpoint import is_complete


def _losses(directory: Path, name: str) -> list[float]:
    return json.loads((directory / f"{name}.rank0.json").read_text())["losses"]


@pytest.mark.slow
def test_mid_epoch_checkpoint_from_p2d2_resumes_under_p4d1_and_on_two_processes(tmp_path: Path) -> None:
    """Trained 4 of an epoch's 8 steps at P=2 x D=2, resumed at P=4 x D=1 and at P=2 x D=1 on 2 processes.

    ``global_batch_size=16`` keeps the optimization identical (16 samples per step whatever D is), and the
    resumable sampler makes every resumed step read exactly the samples the uninterrupted run reads.
    """
    ckpt_dir = tmp_path / "ckpt"
    python("equivalence.py", str(tmp_path), "reference:epoch_steps=8")
    torchrun("equivalence.py", str(tmp_path),
             f"first:pipeline_parallel_size=2,num_microbatches=4,global_batch_size=16,batch=5,steps=4,"
             f"save_every=4,save_dir={ckpt_dir}")
    ckpt = ckpt_dir / "ckpt.ckpt"
    assert is_complete(ckpt) and not list(ckpt_dir.glob("*.varuna-tmp"))
    torchrun("equivalence.py", str(tmp_path),
             f"p4:pipeline_parallel_size=4,num_microbatches=4,global_batch_size=16,batch=5,resume={ckpt}")
    torchrun("equivalence.py", str(tmp_path),
             f"two:pipeline_parallel_size=2,num_microbatches=4,global_batch_size=16,batch=5,resume={ckpt}", nproc=2)
    # one chunk per rank -> two (interleaved, P=2 x D=2: four stages on two ranks)
    torchrun("equivalence.py", str(tmp_path),
             f"chunks:pipeline_parallel_size=2,num_microbatches=4,global_batch_size=16,batch=5,resume={ckpt},"
             "schedule=interleaved,stages_per_rank=2")
    reference = _losses(tmp_path, "reference")
    assert len(reference) == 8
    assert _losses(tmp_path, "first") == pytest.approx(reference[:4], abs=5e-4)
    for name in ("p4", "two", "chunks"):
        resumed = _losses(tmp_path, name)
        assert len(resumed) == 4, name
        assert resumed == pytest.approx(reference[4:], abs=5e-4), name


@pytest.mark.slow
def test_a_checkpoint_written_with_two_chunks_per_rank_resumes_with_one(tmp_path: Path) -> None:
    """Written at P=2 x D=2 with two model chunks per rank (interleaved), resumed at P=4 x D=1 with one (1F1B)."""
    ckpt_dir = tmp_path / "ckpt"
    python("equivalence.py", str(tmp_path), "reference:epoch_steps=8")
    torchrun("equivalence.py", str(tmp_path),
             f"first:pipeline_parallel_size=2,num_microbatches=4,global_batch_size=16,batch=5,steps=4,"
             f"save_every=4,save_dir={ckpt_dir},schedule=interleaved,stages_per_rank=2")
    ckpt = ckpt_dir / "ckpt.ckpt"
    assert is_complete(ckpt)
    torchrun("equivalence.py", str(tmp_path),
             f"p4:pipeline_parallel_size=4,num_microbatches=4,global_batch_size=16,batch=5,resume={ckpt},schedule=1f1b")
    # the looped placement's checkpoint resumed V-shaped (rank 0 now holds stages 0 and 3, rank 1 stages 1 and 2)
    torchrun("equivalence.py", str(tmp_path),
             f"v:pipeline_parallel_size=2,num_microbatches=4,global_batch_size=16,batch=5,resume={ckpt},"
             "schedule=zero-bubble-v,stages_per_rank=2")
    reference = _losses(tmp_path, "reference")
    assert _losses(tmp_path, "first") == pytest.approx(reference[:4], abs=5e-4)
    for name in ("p4", "v"):
        assert _losses(tmp_path, name) == pytest.approx(reference[4:], abs=5e-4), name


@pytest.mark.slow
def test_a_checkpoint_written_v_shaped_resumes_looped_and_with_one_chunk_per_rank(tmp_path: Path) -> None:
    """Written at P=2 x D=2 by the V schedule (stages 0 and 3 on rank 0, with the tied embedding, 1 and 2 on rank 1),
    resumed with the same four stages looped (zero-bubble: 0 and 2 on rank 0) and at P=4 x D=1 with one chunk."""
    ckpt_dir = tmp_path / "ckpt"
    python("equivalence.py", str(tmp_path), "reference:epoch_steps=8,tie=true")
    torchrun("equivalence.py", str(tmp_path),
             f"first:pipeline_parallel_size=2,num_microbatches=4,global_batch_size=16,batch=5,steps=4,tie=true,"
             f"save_every=4,save_dir={ckpt_dir},schedule=zero-bubble-v,stages_per_rank=2")
    ckpt = ckpt_dir / "ckpt.ckpt"
    assert is_complete(ckpt)
    torchrun("equivalence.py", str(tmp_path),
             f"looped:pipeline_parallel_size=2,num_microbatches=4,global_batch_size=16,batch=5,resume={ckpt},tie=true,"
             "schedule=zero-bubble,stages_per_rank=2")
    torchrun("equivalence.py", str(tmp_path),
             f"p4:pipeline_parallel_size=4,num_microbatches=4,global_batch_size=16,batch=5,resume={ckpt},tie=true,"
             "schedule=1f1b")
    reference = _losses(tmp_path, "reference")
    assert _losses(tmp_path, "first") == pytest.approx(reference[:4], abs=5e-4)
    for name in ("looped", "p4"):
        assert _losses(tmp_path, name) == pytest.approx(reference[4:], abs=5e-4), name
