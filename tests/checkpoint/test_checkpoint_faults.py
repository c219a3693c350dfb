"""Checkpoint faults in real jobs (``tests/jobs/checkpoint_faults.py``, 2 gloo processes, P=2, blocking saves).

- A publication interrupted between its moves (rank 0 dies there, on a local disk; on an S3-compatible server,
  where a rename is a copy, it stops halfway through copying the new checkpoint into place): the resume with
  ``ckpt_path="last"`` takes the newest complete checkpoint and deletes nothing newer.
- A shard damaged without changing its size: refused by its checksum on every rank (an explicit path is an
  error; ``"last"`` falls back, warning on every rank); when every candidate is bad the error names
  ``last.ckpt``; parameters that are not finite are never published.
- Two jobs on one folder: the second is refused naming the first; after the first is killed, a new job takes its
  lease over at once (the holder's processes are gone) and resumes.

Each test prints what the fault cost, as measured (seconds from the fault to the last exit, steps lost).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.checkpoint_outcomes import not_raised, own_errors
from helpers.launch import JOBS, ROOT, _env, nccl_rules, torchrun
from helpers.results import rank_results
from helpers.s3server import fresh_prefix, s3_server

from lightning_varuna.checkpoint import Location, is_complete, lease
from lightning_varuna.checkpoint.storage import read_meta


def _names(folder: str) -> list[str]:
    """The checkpoints (and copies) in ``folder``."""
    loc = Location.of(folder)
    loc.refresh()
    return [name for name in loc.names() if not lease.is_lease_file(name)]


def _step(path: str) -> int:
    return read_meta(path, weights_only=False)["global_step"]


@pytest.mark.slow
def test_a_job_stopped_inside_a_publication_resumes_from_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    local = str(tmp_path / "ckpt")
    with s3_server() as env:
        remote = fresh_prefix()
        # S3: step 4's publication stops after two files of the new checkpoint were copied into place (the
        # checkpoint being replaced already copied aside); local: rank 0 dies between the two renames
        died = torchrun("checkpoint_faults.py", str(tmp_path),
                        f"s3:kind=train,folder={remote},steps=6,fault=move/copied-file@4.6:raise",
                        f"local:kind=train,folder={local},steps=6,fault=publish/target-moved-aside@4",
                        nproc=2, env=env, check=False, timeout=400)
        assert died.returncode != 0, died.stdout[-2000:]
        death = re.search(r"fault injected at publish/target-moved-aside, exiting at ([0-9.]+)", died.stderr)
        assert death is not None, died.stderr[-3000:]
        s3_run = rank_results(tmp_path, "s3", 2)
        assert all("fault injected at move/copied-file" in r["error"] for r in s3_run), s3_run
        # rank 0 died: rank 1's watchdog ended it, naming rank 0
        assert re.search(r"\[rank 1\] lightning_varuna: rank 0 died", died.stderr), died.stderr[-3000:]
        assert sorted(_names(remote)) == ["last.ckpt", "last.ckpt.varuna-old", "last.ckpt.varuna-tmp"]
        assert not is_complete(f"{remote}/last.ckpt") and _step(f"{remote}/last.ckpt.varuna-tmp") == 4
        assert sorted(_names(local)) == ["last.ckpt.varuna-old", "last.ckpt.varuna-tmp"]
        assert lease.read(local) is not None  # left by the dead job; its processes are gone
        assert _step(f"{local}/last.ckpt.varuna-tmp") == 4 and _step(f"{local}/last.ckpt.varuna-old") == 3
        # Lightning alone finds no last*.ckpt in either folder; the resumes start at step 4, the newest complete
        torchrun("checkpoint_faults.py", str(tmp_path), f"s3-resume:kind=train,folder={remote},steps=6,ckpt=last",
                 f"local-resume:kind=train,folder={local},steps=6,ckpt=last", nproc=2, env=env, timeout=400)
        for name, folder in (("s3-resume", remote), ("local-resume", local)):
            runs = rank_results(tmp_path, name, 2)
            assert [r["start"] for r in runs] == [4, 4] and runs[0]["steps"] == [5, 6], (name, runs)
            assert runs[0]["error"] is None
            assert sorted(_names(folder)) == ["last.ckpt"] and _step(f"{folder}/last.ckpt") == 6, name
    print("\nrank 0 killed between the two moves of step 4's publication: both resumes started at step 4"
          " (0 steps lost)")


@pytest.mark.slow
def test_damaged_checkpoints_are_refused_on_every_rank_and_last_falls_back(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    last = folder / "last.ckpt"
    # one job: a scenario that ends on an error (raised by every rank alike) leaves the job to the next one
    job = torchrun(
        "checkpoint_faults.py", str(tmp_path),
        f"train:folder={folder},steps=4,keep_every=3",  # last.ckpt = step 4, step=3.ckpt
        f"damage:target={last}",
        f"fallback:kind=train,folder={folder},steps=5,ckpt=last,keep_every=3",
        f"damage:target={last}", f"damage:target={folder / 'step=3.ckpt'}",
        f"unverified:kind=train,folder={tmp_path / 'unverified'},steps=6,ckpt={folder / 'step=3.ckpt'},"
        "verify_checkpoints=false",
        f"all-bad:kind=train,folder={folder},steps=6,ckpt=last",
        f"explicit:kind=train,folder={folder},steps=6,ckpt={last}",
        f"nan:kind=train,folder={tmp_path / 'nan'},steps=3,nan_at=2",
        nproc=2, timeout=500,
    )
    output = job.stdout + job.stderr
    fallback = rank_results(tmp_path, "fallback", 2)
    for run in fallback:  # every rank warns, and resumes at step 3 (one step lost to the damage)
        assert run["error"] is None and run["start"] == 3 and run["steps"] == [4, 5], run
        assert any("checksum mismatch" in w and "Falling back to" in w and "step=3.ckpt" in w for w in run["warnings"])
    assert [r["start"] for r in rank_results(tmp_path, "unverified", 2)] == [3, 3]  # verify_checkpoints=False loads it
    assert not not_raised(tmp_path, "all-bad", 2, f'Could not load ckpt_path="last" ({last}): {last}: ')
    for run in own_errors(tmp_path, "all-bad", 2).values():
        error = run["error"]
        assert "step=3.ckpt" in error and error.count("checksum mismatch") == 2, error
        assert sum("Falling back" in w for w in run["warnings"]) == 1, run["warnings"]
    assert not not_raised(tmp_path, "explicit", 2, f"{last}: "), output[-6000:]
    explicit = own_errors(tmp_path, "explicit", 2).values()
    refused = max(r["fit_end"] - r["fit_start"] for r in explicit)
    for run in explicit:
        assert "checksum mismatch" in run["error"] and run["start"] is None, run  # nothing trained
    # NaN parameters at step 2: refused on every rank; last.ckpt stays at step 1
    assert not not_raised(tmp_path, "nan", 2, "NaN or infinite"), output[-6000:]
    assert all(run["global_step"] == 2 for run in own_errors(tmp_path, "nan", 2).values())
    assert _step(str(tmp_path / "nan" / "last.ckpt")) == 1
    assert sorted(_names(str(tmp_path / "nan"))) == ["last.ckpt"]
    print(f"\ndamaged last.ckpt: an explicit path refused {refused:.1f} s after fit() was called (setup and the"
          " check included); 'last' resumed from the step-3 checkpoint, 1 step lost; NaN parameters at step 2:"
          " refused, last.ckpt stayed at step 1")


def _start(out: Path, spec: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(JOBS / "checkpoint_faults.py"), str(out), spec]
    return subprocess.Popen(command, cwd=ROOT, env={**_env(), **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait_for(path: Path, job: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if job.poll() is not None:
            raise AssertionError(f"the job ended ({job.returncode}):\n{job.stdout.read()[-3000:]}")
        assert time.monotonic() < deadline, f"no {path.name} after {timeout} s"
        time.sleep(0.2)


def _first_job_holds_then_dies(tmp_path: Path, folder: Path, environment: dict[str, str]) -> float:
    """A first job holds the folder's lease; a second is refused (returns how soon); the first dies holding it."""
    first = _start(tmp_path, f"first:kind=train,folder={folder},steps=6,wait_at=3", env=environment)
    try:
        for rank in range(2):  # steps 1-3 saved; waits before step 4, holding the lease
            _wait_for(tmp_path / f"first.waiting.rank{rank}", first)
        second = torchrun("checkpoint_faults.py", str(tmp_path), f"second:kind=train,folder={folder},steps=6",
                          nproc=2, timeout=300)
        refused = max(r["fit_end"] - r["fit_start"] for r in rank_results(tmp_path, "second", 2))
        for run in rank_results(tmp_path, "second", 2):
            assert run["error"].startswith(f"Another job is writing checkpoints in {folder}: "), run["error"]
            assert "holds its lease" in run["error"] and "process" in run["error"], run["error"]
            assert run["start"] is None
        assert second.returncode == 0  # the job script records the error on every rank
        assert _step(str(folder / "last.ckpt")) == 3 and lease.read(folder) is not None
        for rank in range(2):  # the first job dies without releasing its lease
            os.kill(int((tmp_path / f"first.waiting.rank{rank}").read_text()), signal.SIGKILL)
        first.wait(60)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    return refused


@pytest.mark.slow
def test_a_second_job_on_a_checkpoint_folder_is_refused_and_a_dead_jobs_lease_is_taken_over(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    environment: dict[str, str] = {}
    with nccl_rules(environment):  # the first job's completed steps are replayed under NCCL's rules
        refused = _first_job_holds_then_dies(tmp_path, folder, environment)
    # a new start takes the dead job's lease over at once and resumes from its checkpoint
    torchrun("checkpoint_faults.py", str(tmp_path), f"restart:kind=train,folder={folder},steps=5,ckpt=last",
             nproc=2, timeout=300)
    restart = rank_results(tmp_path, "restart", 2)
    assert [r["start"] for r in restart] == [3, 3] and restart[0]["error"] is None, restart
    assert _step(str(folder / "last.ckpt")) == 5 and lease.read(folder) is None  # released at the end
    print(f"\nsecond job on the folder: refused on every rank {refused:.2f} s after fit() was called; the dead"
          " job's lease taken over at once, its last checkpoint (step 3) resumed")
