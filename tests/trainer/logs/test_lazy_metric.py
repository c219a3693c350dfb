"""A torchmetrics metric the step creates on its first use trains and logs the plain run's epoch values.

The model of ``tests/jobs/lazy_metric.py`` (four blocks, three cut points, P=2, 4 micro-batches, 2 epochs of 4
batches) creates ``self.tacc`` inside ``training_step`` and logs it ``on_epoch=True``. The dry run runs the step
first and must leave no trace: the last stage's metric counts exactly the real batches' labels in the first epoch,
as the plain run's does; the first stage, whose step never reaches the metric, gets a reset copy to log (its
``compute()`` gathers every rank's state). Both ranks log the plain run's ``train_acc`` of every epoch, and the
losses of every step, within the suite's 5e-4.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.launch import python, torchrun

pytestmark = [pytest.mark.xdist_group("lazy_metric"), pytest.mark.slow, pytest.mark.timeout(900)]


def _load(path: Path) -> dict:
    result = json.loads(path.read_text())
    assert "error" not in result, f"{path.name}: {result['error']}\n{result.get('traceback', '')}"
    return result


def test_a_metric_created_in_the_step_logs_the_plain_runs_epoch_values(tmp_path: Path) -> None:
    python("lazy_metric.py", str(tmp_path), "ref", timeout=300)
    assert torchrun("lazy_metric.py", str(tmp_path), "p2", nproc=2, timeout=600).p2p_steps >= 8
    ref = _load(tmp_path / "ref.rank0.json")
    assert len(ref["epochs"]) == 2 and ref["counted"] == [4 * 16 * 16]
    for rank in range(2):
        run = _load(tmp_path / f"p2.rank{rank}.json")
        assert max(abs(a - b) for a, b in zip(run["epochs"], ref["epochs"], strict=True)) <= 5e-4
        assert max(abs(a - b) for a, b in zip(run["losses"], ref["losses"], strict=True)) <= 5e-4
    # the last stage's metric counted the real batches only (the dry run's samples would add to it)
    assert _load(tmp_path / "p2.rank1.json")["counted"] == ref["counted"]
    assert _load(tmp_path / "p2.rank0.json")["counted"] == [0]
