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
from lightning_varuna.checkpoint.lease import LEASE_FILE, Holder, LeaseKeeper, is_lease_file, read, release, take
from lightning_varuna.checkpoint.storage import Location


def _other(**changes) -> Holder:
    """A holder in another job, on another host, unless ``changes`` say otherwise."""
    return replace(Holder(None, "other-token", "elsewhere", 1, None), **changes)


def _lease_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if is_lease_file(p.name))


def _age(folder: Path, seconds: float) -> None:
    """Makes the lease in ``folder`` look ``seconds`` old."""
    path = folder / _lease_files(folder)[-1]
    record = json.loads(path.read_text())
    record["renewed"] -= seconds
    path.write_text(json.dumps(record))


def _holder_of(folder: Path) -> Holder:
    return read(folder)["holder"]


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
    assert lease._write(Location.of(tmp_path), reused, 60, read(tmp_path)["generation"] + 1)
    assert take(tmp_path, Holder.current(), 60) is None


def test_release_removes_only_ones_own_lease(tmp_path: Path) -> None:
    me = Holder.current()
    assert take(tmp_path, _other(), 60) is None
    release(tmp_path, me)
    assert _holder_of(tmp_path).token == "other-token"
    release(tmp_path, _other())
    assert read(tmp_path) is None
    # what stays is one file that names no holder (the generation count goes on from it)
    assert _lease_files(tmp_path) == [lease.lease_name(2)]
    assert take(tmp_path, me, 60) is None and read(tmp_path)["generation"] == 3


def _renewed(folder: Path) -> float:
    return read(folder)["renewed"]


def test_the_keeper_renews_and_stops_when_another_job_took_over(tmp_path: Path, monkeypatch) -> None:
    keeper = LeaseKeeper(timeout_s=1.0)  # renewed every second
    folders = [tmp_path / "a", tmp_path / "b"]
    # the keeper's renewal of folder b waits for the test: the takeover happens between two renewals, not by luck
    at_b, proceed, reads = threading.Event(), threading.Event(), []
    newest = lease._newest

    def controlled_newest(folder: Location):
        if threading.current_thread().name == "varuna-checkpoint-lease":
            reads.append(folder.text)
            if folder.text == str(folders[1]) and not proceed.is_set():
                at_b.set()
                assert proceed.wait(30), "the test never let the keeper go on"
        return newest(folder)

    monkeypatch.setattr(lease, "_newest", controlled_newest)
    assert keeper.acquire([str(f) for f in folders]) is None
    try:
        first = _renewed(folders[0])
        assert at_b.wait(30), "not renewed"
        assert _renewed(folders[0]) > first  # a was renewed
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
    assert read(folders[0]) is None and _holder_of(folders[1]).token == "other-token"


def test_a_renewal_read_before_another_jobs_takeover_and_written_after_it_loses(tmp_path: Path, monkeypatch,
                                                                                 caplog) -> None:
    """The keeper reads its lease, then (stopped there by the test) another job takes it over as stale: the
    keeper's write of the generation it read is refused, so only one job holds the lease."""
    keeper = LeaseKeeper(timeout_s=1.0)
    at_write, proceed, written = threading.Event(), threading.Event(), []
    write = lease._write

    def controlled_write(folder: Location, holder, timeout_s: float, generation: int) -> bool:
        if threading.current_thread().name == "varuna-checkpoint-lease" and not proceed.is_set():
            at_write.set()
            assert proceed.wait(30), "the test never let the keeper go on"
        done = write(folder, holder, timeout_s, generation)
        if threading.current_thread().name == "varuna-checkpoint-lease":
            written.append(done)
        return done

    monkeypatch.setattr(lease, "_write", controlled_write)
    assert keeper.acquire([str(tmp_path)]) is None
    try:
        assert at_write.wait(30), "not renewed"  # the keeper read generation 1 and is about to write 2
        _age(tmp_path, 10)  # this job looks dead (a long pause): another job takes its lease over
        assert take(tmp_path, _other(), 1.0) is None and read(tmp_path)["generation"] == 2
        proceed.set()
        deadline = time.monotonic() + 30
        while not written:
            assert time.monotonic() < deadline, "the keeper never wrote"
            time.sleep(0.05)
        assert written == [False]
        with keeper._lock:
            assert keeper._folders == {}  # it stopped renewing there
    finally:
        proceed.set()
        keeper.close()
    assert _holder_of(tmp_path).token == "other-token" and read(tmp_path)["generation"] == 2
    assert "process 1 on elsewhere holds its lease" in caplog.text and "saves there will fail" in caplog.text


def test_a_renewal_by_the_jobs_own_save_is_not_a_lost_lease(tmp_path: Path, monkeypatch) -> None:
    keeper = LeaseKeeper(timeout_s=60.0)
    assert keeper.acquire([str(tmp_path)]) is None
    newest = lease._newest

    def save_renews_between(folder: Location):
        found = newest(folder)
        monkeypatch.setattr(lease, "_newest", newest)
        assert take(folder, keeper.holder, 60.0) is None  # a checkpoint write's step 1, from this job
        return found

    monkeypatch.setattr(lease, "_newest", save_renews_between)
    try:
        keeper._renew_one(Location.of(tmp_path))
        with keeper._lock:
            assert list(keeper._folders) == [str(tmp_path)]
    finally:
        monkeypatch.undo()
        keeper.close()


def test_two_jobs_taking_a_stale_lease_over_at_once_cannot_both_win(tmp_path: Path, monkeypatch) -> None:
    assert take(tmp_path, _other(token="dead"), 60) is None
    _age(tmp_path, 100)
    newest = lease._newest
    calls = []

    def racing_newest(folder: Location):
        found = newest(folder)
        if not calls:  # between this job's read (a stale lease) and its write, another job takes it over
            calls.append(1)
            assert take(folder, _other(), 60) is None
        return found

    monkeypatch.setattr(lease, "_newest", racing_newest)
    problem = take(tmp_path, Holder.current(), 60)
    assert problem is not None and "process 1 on elsewhere" in problem
    assert _holder_of(tmp_path).token == "other-token"


def test_two_jobs_creating_the_lease_at_once_on_a_local_disk_cannot_both_win(tmp_path: Path, monkeypatch) -> None:
    """The first write of a lease is a create-if-absent: the job that loses the race reads the winner's lease."""
    newest = lease._newest
    calls = []

    def racing_newest(folder: Location):
        found = newest(folder)
        if not calls:  # between this job's read (no lease) and its write, another job creates one
            calls.append(1)
            assert lease._write(folder, _other(), 60, 1)
        return found

    monkeypatch.setattr(lease, "_newest", racing_newest)
    problem = take(tmp_path, Holder.current(), 60)
    assert problem is not None and "process 1 on elsewhere" in problem


def test_a_write_decided_on_a_generation_long_gone_loses(tmp_path: Path) -> None:
    me = Holder.current()
    for _ in range(4):
        assert take(tmp_path, me, 60) is None
    assert _lease_files(tmp_path) == [lease.lease_name(3), lease.lease_name(4)]  # the one before is kept
    # a job that read generation 1 long ago (it was stopped) writes generation 2 now: that file was removed,
    # so the write itself succeeds, but generation 4 is beside it
    assert not lease._write(Location.of(tmp_path), _other(), 60, 2)
    assert _lease_files(tmp_path) == [lease.lease_name(3), lease.lease_name(4)]
    assert _holder_of(tmp_path).token == me.token


def test_an_earlier_versions_lease_file_is_generation_zero(tmp_path: Path) -> None:
    record = {"holder": vars(_other()), "renewed": time.time(), "timeout_s": 60}
    (tmp_path / LEASE_FILE).write_text(json.dumps(record))
    assert read(tmp_path)["generation"] == 0 and take(tmp_path, Holder.current(), 60) is not None
    _age(tmp_path, 100)
    assert take(tmp_path, Holder.current(), 60) is None
    assert _lease_files(tmp_path) == [lease.lease_name(1)]  # the old file went with the takeover
