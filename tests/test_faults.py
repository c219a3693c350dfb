"""Failures in a running job: every rank ends promptly, with the cause in its output; nothing hangs.

``tests/jobs/faults.py`` starts the ranks itself (one fork per rank, like an external launcher) and, unlike
torchrun, does not end the job when one rank fails: the times measured here are the surviving ranks' own.
Every job runs under a deadline there and a ``subprocess`` timeout here, so a hang fails a test, never CI.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
from launch import JOBS, python, run_checked

SCENARIOS = ["error", "hook-error", "hang", "hang-dp", "hang-sync", "kill", "exit"]
PROMPT = 20.0
"""Seconds in which every surviving rank must end after a fault it can detect (p2p_timeout is 60 there)."""
HUNG_TIMEOUT = 5.0
"""p2p_timeout of the hang scenarios."""


@pytest.fixture(scope="module")
def faults(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("faults")
    python("faults.py", str(out), *SCENARIOS, timeout=300)
    return out


def load(out: Path, scenario: str) -> tuple[dict, dict[int, str]]:
    result = json.loads((out / f"{scenario}.json").read_text())
    result["ranks"] = {int(rank): info for rank, info in result["ranks"].items()}
    logs = {r: (out / f"{scenario}.rank{r}.log").read_text(errors="replace") for r in result["ranks"]}
    assert result["fault_time"] is not None, f"{scenario}: the fault was never injected:\n{logs}"
    return result, logs


def check_survivors_end(result: dict, logs: dict[int, str], within: float, hung: int | None = None) -> None:
    """Every rank but ``hung`` ended by itself, non-zero, within ``within`` seconds of the fault."""
    for rank, info in result["ranks"].items():
        if rank == hung:
            assert info["killed"], f"rank {rank} was meant to hang but ended:\n{logs[rank][-2000:]}"
            continue
        assert not info["killed"], f"rank {rank} hung (killed at the deadline):\n{logs[rank][-3000:]}"
        assert info["returncode"] != 0, f"rank {rank} exited 0:\n{logs[rank][-2000:]}"
        took = info["after_fault"]
        assert took < within, f"rank {rank} took {took:.1f}s:\n{logs[rank][-2000:]}"


@pytest.mark.slow
def test_world_size_not_divisible_by_pipeline_size() -> None:
    # Trainer(devices=3, strategy=VarunaStrategy(pipeline_parallel_size=2)) under Lightning's own launcher:
    # rank 0 starts ranks 1 and 2 by running the script again; run() waits until all three have closed stderr
    start = time.monotonic()
    result = run_checked([sys.executable, str(JOBS / "faults.py"), "indivisible"], timeout=120)
    message = (
        "ValueError: The world size (3 processes) is not divisible by pipeline_parallel_size=2. Use a P that"
        " divides 3, or change devices/num_nodes."
    )
    assert result.returncode != 0
    # 3: every process started says it, not just rank 0; 1: the Trainer refused before starting any process
    assert result.stderr.count(message) in (1, 3), result.stderr[-4000:]
    assert "Initializing distributed" not in result.stderr + result.stdout  # raised before any rendezvous
    assert time.monotonic() - start < 100


@pytest.mark.slow
def test_error_in_training_step_ends_every_rank_with_that_error(faults: Path) -> None:
    result, logs = load(faults, "error")
    check_survivors_end(result, logs, PROMPT)
    cause = "RuntimeError: injected failure on rank 2 at step 3"
    assert cause in logs[2]
    for rank in (0, 1, 3):
        assert "PipelineError: rank" in logs[rank], logs[rank][-2000:]
        assert f"Rank 2 failed first with: {cause}" in logs[rank], logs[rank][-2000:]


@pytest.mark.slow
def test_error_in_a_hook_ends_every_rank(faults: Path) -> None:
    result, logs = load(faults, "hook-error")
    check_survivors_end(result, logs, PROMPT)
    assert "RuntimeError: injected failure on rank 2 after step 3" in logs[2]
    for rank in (1, 3):  # the neighbours of rank 2 name it (a transfer from it, or the step boundary's agreement)
        assert re.search(r"PipelineError: rank \d \(stage \d\): .*[Rr]ank 2 failed", logs[rank]), logs[rank][-2000:]


@pytest.mark.slow
def test_error_in_a_hook_is_named_by_the_other_ranks(faults: Path) -> None:
    _, logs = load(faults, "hook-error")
    for rank in (0, 1, 3):
        assert "Rank 2 failed first with: RuntimeError: injected failure on rank 2 after step 3" in logs[rank]


@pytest.mark.slow
def test_hung_peer_ends_the_job_after_p2p_timeout(faults: Path) -> None:
    result, logs = load(faults, "hang")
    check_survivors_end(result, logs, HUNG_TIMEOUT + PROMPT, hung=2)
    for rank in (0, 1, 3):
        assert result["ranks"][rank]["after_fault"] > HUNG_TIMEOUT / 2  # ended by the timeout, not by chance
    for rank in (1, 3):  # the hung rank's neighbours name it and the timeout
        assert "PipelineError: rank" in logs[rank]
        assert "rank 2 failed (no answer within p2p_timeout=5s" in logs[rank], logs[rank][-2000:]
    assert "PipelineError: rank 0 (stage 0)" in logs[0]


@pytest.mark.slow
def test_hung_peer_does_not_hold_its_replica_in_the_gradient_all_reduce(faults: Path) -> None:
    # P=2, D=2: rank 1 hangs; rank 3 (the same stage of the other replica) finishes its step and waits for
    # rank 1 in the data-parallel all-reduce, bounded by p2p_timeout because the groups are made with it
    result, logs = load(faults, "hang-dp")
    check_survivors_end(result, logs, HUNG_TIMEOUT + PROMPT, hung=1)
    # gloo words the timeout "Timed out waiting 5000ms" or "Application timeout caused pair closure",
    # depending on which side notices first; the error names the all-reduce and the timeout either way
    assert "waiting for the all-reduce averaging gradients over replicas (ranks [1, 3])" in logs[3], logs[3][-2000:]
    assert "no answer within p2p_timeout=5s" in logs[3], logs[3][-2000:]


@pytest.mark.slow
def test_hung_peer_does_not_hold_its_pipeline_in_the_log_broadcast(faults: Path) -> None:
    # P=4: rank 0 hangs in its last recompute of step 2, after its last message of the step; ranks 1-3 finish
    # the step and wait for it in the log broadcast over the pipeline group, bounded by p2p_timeout
    result, logs = load(faults, "hang-sync")
    check_survivors_end(result, logs, HUNG_TIMEOUT + PROMPT, hung=0)
    for rank in (1, 2, 3):
        assert "Timed out waiting 5000ms" in logs[rank], logs[rank][-2000:]


@pytest.mark.slow
def test_hung_peer_in_the_gradient_all_reduce_is_a_pipeline_error(faults: Path) -> None:
    _, logs = load(faults, "hang-dp")
    assert "PipelineError: rank 3 (stage 1)" in logs[3], logs[3][-2000:]
    assert "failed (no answer within p2p_timeout=5s" in logs[3], logs[3][-2000:]


@pytest.mark.slow
@pytest.mark.parametrize(("scenario", "dead", "signal_code"), [("kill", 0, -9), ("exit", 1, 1)])
def test_dead_peer_ends_the_job_promptly(faults: Path, scenario: str, dead: int, signal_code: int) -> None:
    # "kill": rank 0, which also hosts the job's store, SIGKILLs itself; "exit": rank 1 calls os._exit(1)
    result, logs = load(faults, scenario)
    assert result["ranks"][dead]["returncode"] == signal_code
    check_survivors_end(result, logs, PROMPT)
    for rank in (dead - 1, dead + 1):
        if rank in logs:
            assert f"from/to rank {dead} failed" in logs[rank], logs[rank][-2000:]
