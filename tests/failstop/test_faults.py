"""Failures in a running job: every rank ends promptly, with the cause in its output; nothing hangs.

``tests/jobs/faults.py`` starts the ranks itself (one fork per rank, like an external launcher) and, unlike
torchrun, does not end the job when one rank fails: the times measured here are the ranks' own. Every job runs
under a deadline there and a ``subprocess`` timeout here, so a hang fails a test, never CI. The same faults
under Lightning's launcher, torchrun and independent processes run in ``tests/jobs/failfast.py``.
"""

from __future__ import annotations

import json
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from helpers.launch import JOBS, python, run_checked

from lightning_varuna.checkpoint import is_complete
from lightning_varuna.trainer.recovery.preemption import PREEMPTED_EXIT_CODE

SCENARIOS = ["error", "hook-error", "hang", "hang-dp", "hang-sync", "kill", "exit", "train-end-error",
             "teardown-error", "mixed-skip", "kill-scatter", "kill-gather"]
PROMPT = 20.0
"""Seconds in which every rank must end after a fault it can detect (p2p_timeout is 60 there): a generous
bound for a loaded CI machine; the times themselves are measured by ``benchmarks/fault_exit.py``."""
HUNG_TIMEOUT = 5.0
"""p2p_timeout of the hang scenarios."""


# under pytest-xdist one worker runs all of this module's tests, so its module-scoped jobs run once
pytestmark = pytest.mark.xdist_group("faults")


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


def check_every_rank_ends(result: dict, logs: dict[int, str], within: float, dead: int | None = None) -> None:
    """Every rank (the faulty one too, unless ``dead``) ended by itself, non-zero, within ``within`` s of the fault."""
    for rank, info in result["ranks"].items():
        assert not info["killed"], f"rank {rank} hung (killed at the deadline):\n{logs[rank][-3000:]}"
        assert info["returncode"] != 0, f"rank {rank} exited 0:\n{logs[rank][-2000:]}"
        if rank != dead:
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
@pytest.mark.parametrize(("scenario", "when"), [("error", "at"), ("hook-error", "after")])
def test_an_error_on_one_rank_ends_every_rank_naming_it(faults: Path, scenario: str, when: str) -> None:
    # rank 2 raises in training_step ("error") or in a hook outside the pipeline ("hook-error") at step 3: its
    # watchdog tells the others at once (p2p_timeout is 60 s)
    result, logs = load(faults, scenario)
    check_every_rank_ends(result, logs, PROMPT)
    cause = f"RuntimeError: injected failure on rank 2 {when} step 3"
    assert cause in logs[2]
    for rank in (0, 1, 3):
        assert f"lightning_varuna: rank 2 failed: {cause}. Ending rank {rank}" in logs[rank], logs[rank][-2000:]


@pytest.mark.slow
def test_hung_peer_ends_the_job_after_p2p_timeout(faults: Path) -> None:
    # P=4: rank 2 stops answering in step 2; its neighbours give up after p2p_timeout, and every rank ends then,
    # the hung one included (its watchdog thread still runs)
    result, logs = load(faults, "hang")
    check_every_rank_ends(result, logs, HUNG_TIMEOUT + PROMPT)
    for rank, info in result["ranks"].items():
        assert info["after_fault"] > HUNG_TIMEOUT / 2, rank  # ended by the timeout, not by chance
        assert "no answer within p2p_timeout=5s" in logs[rank], logs[rank][-2000:]
    for rank in (1, 3):  # the hung rank's neighbours name it and the timeout
        assert "from/to rank 2 failed (no answer within p2p_timeout=5s" in logs[rank], logs[rank][-2000:]
    assert "Ending rank 2 (exit code 1)" in logs[2], logs[2][-2000:]


@pytest.mark.slow
def test_hung_peer_ends_its_replica_too(faults: Path) -> None:
    # P=2, D=2: rank 1 hangs; rank 3 (the same stage of the other replica) finishes its step and waits for rank 1
    # in the data-parallel all-reduce (a group made with p2p_timeout too); every rank ends after the timeout
    result, logs = load(faults, "hang-dp")
    check_every_rank_ends(result, logs, HUNG_TIMEOUT + PROMPT)
    for rank in (0, 2, 3):
        assert "no answer within p2p_timeout=5s" in logs[rank], logs[rank][-2000:]
    assert "rank 1 failed (no answer within p2p_timeout=5s" in logs[0], logs[0][-2000:]  # its pipeline peer
    assert "Ending rank 1 (exit code 1)" in logs[1], logs[1][-2000:]


@pytest.mark.slow
def test_hung_peer_does_not_hold_its_pipeline_in_the_log_broadcast(faults: Path) -> None:
    # P=4: rank 0 hangs in its last recompute of step 2, after its last message of the step; ranks 1-3 finish
    # the step and wait for it in the log broadcast over the pipeline group, bounded by p2p_timeout
    result, logs = load(faults, "hang-sync")
    check_every_rank_ends(result, logs, HUNG_TIMEOUT + PROMPT)
    for rank in (1, 2, 3):
        assert "Timed out waiting 5000ms" in logs[rank], logs[rank][-2000:]


@pytest.mark.slow
@pytest.mark.parametrize(("scenario", "dead", "signal_code"), [("kill", 0, -9), ("exit", 1, 1)])
def test_dead_peer_ends_the_job_promptly(faults: Path, scenario: str, dead: int, signal_code: int) -> None:
    # "kill": rank 0, which also hosts the job's store, SIGKILLs itself; "exit": rank 1 calls os._exit(1)
    result, logs = load(faults, scenario)
    assert result["ranks"][dead]["returncode"] == signal_code
    check_every_rank_ends(result, logs, PROMPT, dead=dead)
    for rank in set(logs) - {dead}:
        assert f"lightning_varuna: rank {dead} died: its connection to rank" in logs[rank], logs[rank][-2000:]



@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["kill-scatter", "kill-gather"])
def test_rank_killed_inside_a_sharded_collective_ends_the_job_promptly(faults: Path, scenario: str) -> None:
    # zero_stage=1, P=2 x D=2: rank 3 dies with its reduce-scatter (or all-gather) in flight; rank 1, its stage's
    # other replica, waits in that collective; every rank ends within seconds (p2p_timeout is 60 s)
    result, logs = load(faults, scenario)
    assert result["ranks"][3]["returncode"] == -9
    check_every_rank_ends(result, logs, PROMPT, dead=3)
    for rank in (0, 1, 2):
        assert "lightning_varuna: rank 3 died: its connection to rank" in logs[rank], logs[rank][-2000:]


@pytest.mark.slow
@pytest.mark.parametrize(("scenario", "hook"), [("train-end-error", "on_train_end"), ("teardown-error", "teardown")])
def test_error_after_the_last_step_fails_every_rank(faults: Path, scenario: str, hook: str) -> None:
    # rank 1 (the last stage) fails after training; rank 0's fit had ended well, but the run made no model
    # rank 0 learns it from rank 1's watchdog if it is still training, else in the launcher's end of the call
    result, logs = load(faults, scenario)
    check_every_rank_ends(result, logs, PROMPT)
    assert f"RuntimeError: injected failure on rank 1 in {hook}" in logs[1]
    assert f"rank 1 failed: RuntimeError: injected failure on rank 1 in {hook}" in logs[0], logs[0][-2000:]
    assert "VARUNA-FINISHED" not in logs[0] + logs[1]


@pytest.mark.slow
def test_error_after_the_last_step_fails_the_job_under_lightnings_launcher() -> None:
    # rank 0 is the process Lightning's launcher runs in (it starts rank 1): its exit status is the job's
    result = run_checked([sys.executable, str(JOBS / "faults.py"), "train-end-error-lightning"], timeout=120)
    assert result.returncode != 0, result.stderr[-3000:]
    assert "RuntimeError: injected failure on rank 1 in on_train_end" in result.stderr, result.stderr[-3000:]
    assert "VARUNA-FINISHED" not in result.stdout


@pytest.mark.slow
def test_batch_skipped_before_the_forward_for_some_micro_batches_only_is_refused_on_every_rank(faults: Path) -> None:
    result, logs = load(faults, "mixed-skip")
    check_every_rank_ends(result, logs, PROMPT)
    message = ("CutPointError: The step returned None before the model's forward for micro-batch 0 but not for"
               " micro-batch 1 of the same batch")
    for rank, log in logs.items():
        assert message in log, f"rank {rank}:\n{log[-2000:]}"


# -- under each launcher (tests/jobs/failfast.py): one job per test, several checks per job -------------------
def launch(tmp_path: Path, mode: str, scenario: str) -> tuple[dict, dict[int, str], str]:
    """Runs a ``failfast.py`` job; returns its record, each rank's output and the launcher's."""
    python("failfast.py", "launch", mode, str(tmp_path), scenario, timeout=500)
    name = f"{scenario}-{mode}"
    result = json.loads((tmp_path / f"{name}.json").read_text())
    result["ranks"] = {int(rank): info for rank, info in result["ranks"].items()}
    logs = {r: (tmp_path / f"{name}.rank{r}.log").read_text(errors="replace") for r in range(4)}
    return result, logs, (tmp_path / f"{name}.launcher.log").read_text(errors="replace")


def check_ended_by(result: dict, logs: dict[int, str], culprit: int, what: str) -> None:
    """Every rank ended by itself, non-zero; the others name ``culprit`` (times: ``benchmarks/fault_exit.py``)."""
    assert result["fault_time"] is not None, f"the fault was never injected:\n{logs}"
    for rank, info in result["ranks"].items():
        assert not info["killed"], f"rank {rank} hung (killed at the deadline):\n{logs[rank][-3000:]}"
        assert info["returncode"] not in (0, None), f"rank {rank}: {info}\n{logs[rank][-2000:]}"
        if rank != culprit:
            assert f"lightning_varuna: rank {culprit} {what}" in logs[rank], logs[rank][-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["lightning", "torchrun", "independent"])
def test_a_killed_rank_ends_every_rank_within_seconds_under_every_launcher(tmp_path: Path, mode: str) -> None:
    # rank 3 SIGKILLs itself in step 7; no launcher ends the others in time (Lightning's checks its children
    # every 5 s, torchrun sends SIGTERM, which a preemption handler would turn into a checkpoint attempt, and
    # independent processes have nobody): the watchdogs do
    result, logs, launcher = launch(tmp_path, mode, "kill")
    assert result["ranks"][3]["returncode"] == -signal.SIGKILL, result["ranks"][3]
    check_ended_by(result, logs, 3, "died: its connection to rank")
    for rank in (0, 1, 2):  # torchrun's SIGTERM to the survivors started no checkpoint with a dead peer
        assert "VarunaStrategy: preempted after" not in logs[rank], logs[rank][-3000:]
    if mode == "torchrun":  # the exit statuses come from torchrun's summary
        assert "exitcode  : -9" in launcher and launcher.count("exitcode  : 1 ") == 3, launcher[-3000:]


@pytest.mark.slow
def test_ctrl_c_on_rank_0_of_independent_processes_ends_every_rank(tmp_path: Path) -> None:
    result, logs, _ = launch(tmp_path, "independent", "sigint")
    # the rank must start with Python's Ctrl-C handler and SIGINT unblocked, or no KeyboardInterrupt can happen
    assert "SIGINT handler <built-in function default_int_handler>, blocked False" in logs[0], logs[0][-2000:]
    assert "Detected KeyboardInterrupt" in logs[0], logs[0][-2000:]
    check_ended_by(result, logs, 0, "failed: KeyboardInterrupt")


@pytest.mark.slow
def test_every_rank_of_a_preempted_torchrun_job_exits_143(tmp_path: Path) -> None:
    # rank 2 is warned in step 3; every rank writes last.ckpt and exits 143. Rank 1 lingers 3 s in its exit, so
    # torchrun, which stops the other workers as soon as the first one has exited, sends it SIGTERM meanwhile
    result, logs, launcher = launch(tmp_path, "torchrun", "sigterm")
    codes = dict(re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", launcher))
    assert codes == {str(r): str(PREEMPTED_EXIT_CODE) for r in range(4)}, launcher[-4000:]
    pid = (tmp_path / "sigterm-torchrun.rank1.pid").read_text()
    assert f"Sending process {pid} closing signal SIGTERM" in launcher, launcher[-4000:]
    assert "lingering" in logs[1]
    assert is_complete(tmp_path / "sigterm-torchrun-ckpt" / "last.ckpt")
    assert "rank 2: preemption warning (SIGTERM)" in logs[2]
    assert all("lightning_varuna: rank" not in log for log in logs.values())  # no rank taken for dead


@pytest.mark.slow
def test_replicas_train_one_model_without_a_seed_and_a_long_stretch_holding_the_gil_is_no_failure(
    tmp_path: Path,
) -> None:
    # no seed anywhere, P=2 x D=2, tied embedding (on both stages), a plain iterable as training data; rank 1
    # holds the GIL for 8 s in step 2 while the others wait on it
    import torch

    result, logs, _ = launch(tmp_path, "lightning", "healthy")
    for rank, info in result["ranks"].items():
        assert info["returncode"] == 0 and "FAILFAST-FINISHED" in logs[rank], f"rank {rank}: {logs[rank][-3000:]}"
    assert "holding the GIL for 8s" in logs[1]
    assert logs[0].count("The training loader (Stream) is an iterable without Lightning's sampler") == 1

    def weights(rank: int, when: str) -> dict:
        return torch.load(tmp_path / f"healthy-lightning.rank{rank}.{when}.pt")

    # each process built its own random model ...
    assert not torch.equal(weights(0, "init")["param:wte.weight"], weights(2, "init")["param:wte.weight"])
    for when in ("start", "end"):
        for stage in (0, 1):  # ... every replica of a stage holds the same parameters and buffers (ranks s, s + 2)
            first, second = weights(stage, when), weights(stage + 2, when)
            assert first.keys() == second.keys() and any(k.startswith("param:") for k in first)
            for key in first:
                assert torch.equal(first[key], second[key]), (when, stage, key)
        # ... and the tied embedding is the same on both stages
        assert torch.equal(weights(0, when)["param:wte.weight"], weights(1, when)["param:wte.weight"]), when
    assert not torch.equal(weights(0, "start")["param:wte.weight"], weights(0, "end")["param:wte.weight"])
