"""benchmarks/real_schedules.py's bookkeeping: the loss check, the front comparison and the stored result's tables."""

from __future__ import annotations

import json
import sys

from helpers.launch import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import real_schedules  # noqa: E402 - a benchmark script, importable without torch at module level

RESULT = ROOT / "benchmarks" / "results" / "real_schedules_p2_m8.json"


def test_a_row_whose_losses_differ_from_the_first_rows_is_marked() -> None:
    rows = [{"losses": [2.0, 3.0]}, {"losses": [2.0, 3.0 * (1 + real_schedules.LOSS_RTOL / 2)]},
            {"losses": [2.0 * (1 + 2 * real_schedules.LOSS_RTOL), 3.0]}]
    real_schedules.check_losses(rows)
    assert [row["loss_ok"] for row in rows] == [True, True, False]


def test_the_front_takes_our_fastest_row_at_no_more_memory_or_none() -> None:
    rows = [
        {"system": "torch-1f1b", "step_ms": 100.0, "peak_mib": 20.0},
        {"system": "torch-1f1b-full", "step_ms": 130.0, "peak_mib": 10.0},
        {"system": "ours-1f1b", "step_ms": 99.0, "peak_mib": 20.0},
        {"system": "ours-zb", "step_ms": 90.0, "peak_mib": 20.5},  # faster, but holds more than torch's 1F1B
        {"system": "ours-1f1b-rc", "step_ms": 110.0, "peak_mib": 12.0},
    ]
    front = {f["torch"]: f for f in real_schedules.front_comparison(rows)}
    assert front["torch-1f1b"]["ours"] == "ours-1f1b" and front["torch-1f1b"]["speedup"] == 100.0 / 99.0
    assert front["torch-1f1b-full"]["ours"] is None


def test_every_default_system_is_known_and_torchs_zero_bubble_rows_run_without_checkpointing() -> None:
    assert set(real_schedules.DEFAULT_SYSTEMS) <= set(real_schedules.TORCH_SYSTEMS) | set(real_schedules.OURS)
    assert all(real_schedules.TORCH_SYSTEMS[name][1] == "none" for name in real_schedules.TORCH_SYSTEMS
               if real_schedules.TORCH_SYSTEMS[name][0] in real_schedules.TORCH_ZERO_BUBBLE)


def test_the_stored_result_renders_and_every_row_computed_the_same_losses(capsys) -> None:
    stored = json.loads(RESULT.read_text())
    assert real_schedules.summarize(stored) == stored["summary"]
    assert all(row["loss_ok"] for rep in stored["repetitions"] for row in rep["rows"])
    assert len(stored["repetitions"]) == 3 and stored["package_commit"]
    assert real_schedules.main(["--render", str(RESULT)]) == 0
    assert capsys.readouterr().out.strip() == stored["table_md"]
