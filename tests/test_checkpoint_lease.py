"""The lease of a checkpoint folder: who may take it, and when a lease is stale.

The two-job test (a second job refused, a dead job's lease taken over by a new start) is in
``test_checkpoint_faults.py``; here each rule is checked on its own, with holders made up for it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from lightning_varuna.checkpoint import lease
from lightning_varuna.checkpoint.lease import LEASE_FILE, Holder, LeaseKeeper, release, take
from lightning_varuna.checkpoint.storage import Location


def _other(**changes) -> Holder:
    """A holder in another job, on another host, unless ``changes`` say otherwise."""
    return replace(Holder(None, "other-token", "elsewhere", 1, None), **changes)


def _age(folder: Path, seconds: float) -> None:
    """Makes the lease in ``folder`` look ``seconds`` old."""
    path = folder / LEASE_FILE
    record = json.loads(path.read_text())
    record["renewed"] -= seconds
    path.write_text(json.dumps(record))


def _holder_of(folder: Path) -> Holder:
    return Holder(**json.loads((folder / LEASE_FILE).read_text())["holder"])


def test_a_lease_held_by_a_live_job_is_refused_until_it_is_stale(tmp_path: Path) -> None:
    me = Holder.current()
    assert take(tmp_path, _other(), 60) is None  # a free folder
    problem = take(tmp_path, me, 60)
    assert problem.startswith(f"Another job is writing checkpoints in {tmp_path}: a job, process 1 on elsewhere")
    assert "renewed 0 s ago" in problem and "not been renewed for 60 s" in problem
    _age(tmp_path, 59)
    assert take(tmp_path, me, 60) is not None
    _age(tmp_path, 2)  # 61 s: its job died elsewhere
    assert take(tmp_path, me, 60) is None and _holder_of(tmp_path).token == me.token
    assert take(tmp_path, me, 60) is None  # renewing one's own


def test_the_same_job_restarted_takes_its_lease_over_at_once(tmp_path: Path) -> None:
    assert take(tmp_path, _other(run="slurm:1234"), 60) is None
    restarted = replace(Holder.current(), run="slurm:1234")  # a requeue: same job id, another process and host
    assert take(tmp_path, restarted, 60) is None and _holder_of(tmp_path).token == restarted.token
    assert take(tmp_path, _other(run="slurm:1234", token="t2"), 60) is None
    assert take(tmp_path, _other(run="torchrun:abc", token="t3"), 60) is not None  # another job


def test_a_lease_whose_process_on_this_host_is_gone_is_stale(tmp_path: Path) -> None:
    ended = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        identity = lease._process_identity(ended.pid)
        if identity is None:
            pytest.skip("no /proc: a holder's process cannot be checked")
        holder = _other(host=socket.gethostname(), pid=ended.pid, process=identity)
        assert take(tmp_path, holder, 60) is None
        assert take(tmp_path, Holder.current(), 60) is not None  # alive
    finally:
        ended.kill()
        ended.wait()
    assert take(tmp_path, Holder.current(), 60) is None  # gone
    # a pid now used by another process (one started at another time) is not the holder either
    mine = lease._process_identity(os.getpid())
    reused = _other(host=socket.gethostname(), pid=os.getpid(), process=mine.rsplit("/", 1)[0] + "/1")
    assert lease._write(Location.of(tmp_path), reused, 60, create=False)
    assert take(tmp_path, Holder.current(), 60) is None


def test_release_removes_only_ones_own_lease(tmp_path: Path) -> None:
    me = Holder.current()
    assert take(tmp_path, _other(), 60) is None
    release(tmp_path, me)
    assert (tmp_path / LEASE_FILE).exists()
    release(tmp_path, _other())
    assert not (tmp_path / LEASE_FILE).exists()


def test_the_keeper_renews_and_stops_when_another_job_took_over(tmp_path: Path, monkeypatch) -> None:
    keeper = LeaseKeeper(timeout_s=1.0)  # renewed every second
    folders = [tmp_path / "a", tmp_path / "b"]
    # the keeper's renewal of folder b waits for the test: the takeover happens between two renewals, not by luck
    at_b, proceed, reads = threading.Event(), threading.Event(), []
    read = lease.read

    def controlled_read(folder: Location):
        if threading.current_thread().name == "varuna-checkpoint-lease":
            reads.append(folder.text)
            if folder.text == str(folders[1]) and not proceed.is_set():
                at_b.set()
                assert proceed.wait(30), "the test never let the keeper go on"
        return read(folder)

    monkeypatch.setattr(lease, "read", controlled_read)
    assert keeper.acquire([str(f) for f in folders]) is None
    try:
        first = json.loads((folders[0] / LEASE_FILE).read_text())["renewed"]
        assert at_b.wait(30), "not renewed"
        assert json.loads((folders[0] / LEASE_FILE).read_text())["renewed"] > first  # a was renewed
        # another job took folder b over (it found the lease stale): the keeper leaves it alone
        _age(folders[1], 10)
        assert take(folders[1], _other(), 1.0) is None
        done = len(reads)
        proceed.set()
        deadline = time.monotonic() + 30
        while str(folders[0]) not in reads[done:]:  # the next round began: b's renewal was decided
            assert time.monotonic() < deadline, "the keeper stopped renewing"
            time.sleep(0.05)
        assert _holder_of(folders[1]).token == "other-token"
        assert keeper.ticket().keep and keeper.ticket().holder == keeper.holder
    finally:
        proceed.set()
        keeper.close()
    assert not (folders[0] / LEASE_FILE).exists() and (folders[1] / LEASE_FILE).exists()


def test_two_jobs_creating_the_lease_at_once_on_a_local_disk_cannot_both_win(tmp_path: Path, monkeypatch) -> None:
    """The first write of a lease is a create-if-absent: the job that loses the race reads the winner's lease."""
    read = lease.read
    calls = []

    def racing_read(folder: Location):
        record = read(folder)
        if not calls:  # between this job's read (no lease) and its write, another job creates one
            calls.append(1)
            assert lease._write(folder, _other(), 60, create=True)
        return record

    monkeypatch.setattr(lease, "read", racing_read)
    problem = take(tmp_path, Holder.current(), 60)
    assert problem is not None and "process 1 on elsewhere" in problem
