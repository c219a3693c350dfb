"""benchmarks/schedules.py's smoke mode: every system it runs does its forwards, I and W exactly as counted."""

from __future__ import annotations

import json
import sys

import pytest
from helpers.launch import ROOT, run_checked


@pytest.mark.slow
def test_schedules_benchmark_smoke_counts_and_report(tmp_path) -> None:
    out = tmp_path / "smoke.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(ROOT / "benchmarks" / "schedules.py"), "--smoke", "--out", str(out)]
    result = run_checked(command, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.p2p_steps > 0  # our engine's steps replayed under NCCL's rules
    data = json.loads(out.read_text())
    rows = {(r["system"], r["jitter"]): r for r in data["rows"]}
    assert len(rows) == 18
    # torch's split backward under selective checkpointing: refused before any rank waits, with torch's reason
    assert {u["system"] for u in data["unavailable"]} == {"torch-zbv-sac"}
    assert all("backward" in u["reason"] for u in data["unavailable"])
    for (name, _), row in rows.items():
        # torch's zero-bubble schedule with full checkpointing recomputes once per autograd pass (see the report)
        assert row["counts_ok"] == (name != "torch-interleavedzb-full"), (name, row["counts_per_stage_step"])
        assert all(c[1] == c[2] > 0 for stage in row["counts_per_stage_step"] for c in stage[:1]), name
        assert max(row["peak_mib_per_stage"]) > 0, name
    # checkpointing saves memory on the stage that needs most; selective checkpointing keeps the op's output
    mem = {name: max(rows[(name, 0.0)]["peak_mib_per_stage"]) for name in ("torch-1f1b", "torch-1f1b-full",
                                                                            "torch-1f1b-sac")}
    assert mem["torch-1f1b-full"] < mem["torch-1f1b-sac"] < mem["torch-1f1b"], mem
    # ours with a recompute policy: the op's output kept (counts_ok above: the recompute did not run the op again),
    # the rest of each layer's activation rebuilt
    assert max(rows[("ours-1f1b-sac", 0.0)]["peak_mib_per_stage"]) < mem["torch-1f1b"], rows
    report = run_checked([sys.executable, str(ROOT / "benchmarks" / "schedules_report.py"), str(out)], timeout=120)
    assert report.returncode == 0, report.stderr[-3000:]
    assert (tmp_path / "smoke.png").stat().st_size > 0 and "c_holds" in (tmp_path / "smoke_targets.json").read_text()
    # target (b) compares our best measured step with the simulator's best over ours at torch-1f1b-full's memory
    targets = json.loads((tmp_path / "smoke_targets.json").read_text())
    for key in ("P=2 m=4 jitter=0.0", "P=2 m=4 jitter=0.5"):
        b = targets[key]["b"]
        assert b["sim_best_step_ms"] > 0 and b["measured_over_sim"] > 0, (key, b)
