"""Elastic restart under torchrun: a machine is lost mid-training, the survivor resumes at the smaller world size.

Two torchrun agents on loopback stand for two machines with 2 processes each (P=2 x D=2); after a few steps one
agent and its workers are SIGKILLed. See ``elastic_harness.py`` for how the job is run and cleaned up.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.elastic_harness import TUNED, run_elastic
from helpers.launch import nccl_rules

MAX_STEPS = 12
KILL_AFTER = 4


@pytest.mark.slow
def test_survivor_resumes_from_last_checkpoint_at_smaller_world_size(tmp_path: Path) -> None:
    environment: dict[str, str] = {}
    with nccl_rules(environment):
        run = run_elastic(tmp_path, max_steps=MAX_STEPS, kill_after=KILL_AFTER, rdzv_conf=TUNED, deadline=240,
                          environment=environment)
    logs = "\n".join(f"--- agent {name} ---\n{text[-6000:]}" for name, text in run.logs.items())
    assert run.kill_time is not None, f"the job never reached {KILL_AFTER} steps at world size 4:\n{logs}"
    assert run.returncodes == {"host": 0, "other": -9}, f"{run.returncodes}\n{logs}"

    before, resume, after = run.before, run.resume, run.after
    assert [r["world_size"] for r in before[-KILL_AFTER:]] == [4] * KILL_AFTER
    assert resume is not None, f"no restart after the kill:\n{logs}"
    assert resume["world_size"] == 2 and resume["restart"] >= 1, resume
    assert resume["ckpt_path"] is not None and Path(resume["ckpt_path"]).name == "last.ckpt", resume
    # a checkpoint is written after every step: at most the step whose checkpoint was being written is lost
    last = before[-1]["step"]
    assert resume["step"] in (last - 1, last), (resume, before[-1])
    assert [r["step"] for r in after] == list(range(resume["step"] + 1, MAX_STEPS + 1))
    assert {r["world_size"] for r in after} == {2}
    assert {r["step"] for r in run.records if r["event"] == "step"} == set(range(1, MAX_STEPS + 1))

    summary = run.summary()
    print(f"\nelastic restart (tuned keep-alive): {summary}")
    assert summary["steps_lost"] == last - resume["step"]


@pytest.mark.slow
def test_sigterm_to_one_worker_checkpoints_exits_143_and_torchrun_resumes_without_losing_a_step(tmp_path: Path) -> None:
    """A preemption warning that reaches one rank of one machine: every rank stops at the next step boundary with a
    checkpoint and exit status 143, which torchrun treats as a failure and restarts from; no step is lost or repeated.
    """
    environment: dict[str, str] = {}
    with nccl_rules(environment):
        run = run_elastic(tmp_path, max_steps=MAX_STEPS, kill_after=KILL_AFTER, rdzv_conf=TUNED, deadline=240,
                          action="sigterm", environment=environment)
    logs = "\n".join(f"--- agent {name} ---\n{text[-6000:]}" for name, text in run.logs.items())
    assert run.kill_time is not None, f"the job never reached {KILL_AFTER} steps:\n{logs}"
    assert run.returncodes == {"host": 0, "other": 0}, f"{run.returncodes}\n{logs}"
    assert "exitcode: 143" in logs or "exitcode : 143" in logs, logs
    starts = [r for r in run.records if r["event"] == "start"]
    restart = next(r for r in starts if r["restart"] >= 1)
    assert restart["world_size"] == 4 and Path(restart["ckpt_path"]).name == "last.ckpt", restart
    steps = [r for r in run.records if r["event"] == "step"]
    done = [r["step"] for r in steps if r["time"] < restart["time"]]
    assert restart["step"] == max(done) >= KILL_AFTER, (restart, done)
    # every step exactly once: nothing lost, nothing repeated
    assert sorted(r["step"] for r in steps) == list(range(1, MAX_STEPS + 1))
