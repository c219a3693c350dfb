"""Preemption: a warning to any one rank stops every rank at the next step boundary, with a checkpoint.

The multi-process scenarios run in ``tests/jobs/preemption.py`` (one fork per rank, so each rank's own exit
status and time are measured); the notice scenario polls an HTTP server on loopback started here.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from helpers.launch import python

from lightning_varuna import VarunaStrategy
from lightning_varuna.checkpoint import is_complete
from lightning_varuna.checkpoint.storage import META
from lightning_varuna.trainer.recovery.preemption import (
    PREEMPTED_EXIT_CODE,
    FileNotice,
    HTTPNotice,
    PreemptionWatch,
    requeue_slurm_job,
)

SCENARIOS = ["reference", "sigterm-rank2", "sigterm-rank0", "sigusr1-rank3", "notice", "kill"]
STEPS = 8
PROMPT = 30.0
"""Seconds in which every rank must end after the warning (it takes one step and a checkpoint)."""
P2P_TIMEOUT = 20.0
"""p2p_timeout (and collective timeout) of the jobs."""
SIGNALLED = {"sigterm-rank2": (2, "SIGTERM", 3), "sigterm-rank0": (0, "SIGTERM", 6), "sigusr1-rank3": (3, "SIGUSR1", 4)}
"""scenario -> (warned rank, signal, global_step of the checkpoint): sent during step k, saved after it."""


class NoticeServer(ThreadingHTTPServer):
    """Answers ``GET /notice`` with ``status`` and ``body``; ``GET /arm`` switches it to ``200 preempt``."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.status, self.body = 404, b""
        self.paths: list[str] = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: NoticeServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        server = self.server
        server.paths.append(self.path)
        if self.path == "/arm":
            server.status, server.body = 200, b"preempt"
        status, body = (200, b"armed") if self.path == "/arm" else (server.status, server.body)
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server() -> Iterator[NoticeServer]:
    server = NoticeServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


# under pytest-xdist one worker runs all of this module's tests, so its module-scoped jobs run once
pytestmark = pytest.mark.xdist_group("preemption")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> Iterator[tuple[Path, list[str]]]:
    out = tmp_path_factory.mktemp("preemption")
    server = NoticeServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        python("preemption.py", str(out), server.url, *SCENARIOS, timeout=540)
    finally:
        server.shutdown()
        server.server_close()
    yield out, server.paths


def _run(out: Path, run: str) -> tuple[dict[int, dict], dict[int, str]]:
    ranks = {int(r): info for r, info in json.loads((out / f"{run}.json").read_text())["ranks"].items()}
    logs = {r: (out / f"{run}.rank{r}.log").read_text(errors="replace") for r in ranks}
    return ranks, logs


def _steps(out: Path, run: str, rank: int) -> list[tuple[int, float]]:
    lines = (out / f"{run}.rank{rank}.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


def _global_step(ckpt: Path) -> int:
    return torch.load(ckpt / META, weights_only=False)["global_step"]


def _check_preempted(out: Path, run: str) -> int:
    """Every rank exited with the preemption status, promptly, without a traceback; returns the saved step."""
    ranks, logs = _run(out, run)
    assert len(ranks) == 4
    for rank, info in ranks.items():
        assert info["returncode"] == PREEMPTED_EXIT_CODE, f"rank {rank}: {info}\n{logs[rank][-3000:]}"
        assert info["after_fault"] is not None and info["after_fault"] < PROMPT, f"rank {rank}: {info}"
        assert "Traceback" not in logs[rank] and "failed first with" not in logs[rank], logs[rank][-3000:]
    ckpt = out / f"{run}-ckpt" / "last.ckpt"
    assert is_complete(ckpt), sorted(p.name for p in ckpt.parent.iterdir())
    saved = _global_step(ckpt)
    for rank in ranks:  # no step lost: every finished step, the one under way at the warning included, is saved
        assert [s for s, _ in _steps(out, run, rank)] == list(range(1, saved + 1)), rank
    return saved


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(SIGNALLED))
def test_signal_to_one_rank_stops_every_rank_after_the_step_with_a_checkpoint(jobs, scenario: str) -> None:
    out, _ = jobs
    rank, name, expected = SIGNALLED[scenario]
    assert _check_preempted(out, scenario) == expected
    _, logs = _run(out, scenario)
    assert f"rank {rank}: preemption warning ({name})" in logs[rank], logs[rank][-2000:]


@pytest.mark.slow
def test_http_notice_stops_every_rank_with_a_checkpoint(jobs) -> None:
    out, paths = jobs
    saved = _check_preempted(out, "notice")
    assert 2 <= saved < STEPS  # armed during step 2, and the notice came before training ended
    assert "/arm" in paths and paths.count("/notice") >= 4  # every rank polled it


@pytest.mark.slow
def test_killed_rank_ends_the_others_and_the_restart_takes_the_last_complete_checkpoint(jobs) -> None:
    out, _ = jobs
    ranks, logs = _run(out, "kill")
    assert ranks[2]["returncode"] == -signal.SIGKILL, f"rank 2 was not killed:\n{logs[2][-2000:]}"
    for rank in (0, 1, 3):
        info = ranks[rank]
        assert not info["killed"] and info["returncode"] not in (0, None), f"rank {rank}: {info}"
        assert info["after_fault"] < P2P_TIMEOUT + PROMPT, f"rank {rank}: {info}\n{logs[rank][-2000:]}"
    directory = out / "kill-ckpt"
    # rank 2 died while last.ckpt of step 4 was being written: the step-3 one is the last complete one
    assert is_complete(directory / "last.ckpt") and _global_step(directory / "last.ckpt") == 3
    for partial in directory.glob("*.varuna-tmp"):
        assert not is_complete(partial)
    resumed, _ = _run(out, "kill-resume")
    assert all(info["returncode"] == 0 for info in resumed.values()), resumed
    assert _steps(out, "kill-resume", 0)[0][0] == 4


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["sigterm-rank2", "sigterm-rank0", "sigusr1-rank3", "notice", "kill"])
def test_resumed_run_continues_on_the_uninterrupted_trajectory(jobs, scenario: str) -> None:
    out, _ = jobs
    ranks, logs = _run(out, f"{scenario}-resume")
    for rank, info in ranks.items():
        assert info["returncode"] == 0, f"rank {rank}: {info}\n{logs[rank][-3000:]}"
    saved = _global_step(out / f"{scenario}-ckpt" / "last.ckpt")
    for rank in (0, 2):  # one rank of each replica (each logs its replica's loss)
        reference = dict(_steps(out, "reference", rank))
        assert sorted(reference) == list(range(1, STEPS + 1))
        before = _steps(out, scenario, rank)
        after = _steps(out, f"{scenario}-resume", rank)
        assert [s for s, _ in after] == list(range(saved + 1, STEPS + 1)), (rank, saved)
        for step, loss in before + after:
            assert loss == pytest.approx(reference[step], abs=5e-4), (rank, step)


def test_signal_only_sets_the_flag_and_the_previous_handler_comes_back() -> None:
    previous = signal.getsignal(signal.SIGTERM)
    watch = PreemptionWatch(requeue_signals=(signal.SIGUSR2,))
    watch.start()
    try:
        assert watch.reason is None and watch.kind == 0
        os.kill(os.getpid(), signal.SIGTERM)
        assert watch.reason == "SIGTERM" and watch.kind == 1
        os.kill(os.getpid(), signal.SIGUSR2)  # a requeue signal outranks, the first reason stays
        assert watch.reason == "SIGTERM" and watch.kind == 2
    finally:
        watch.stop()
    assert signal.getsignal(signal.SIGTERM) == previous


def test_file_notice(tmp_path: Path) -> None:
    notice = FileNotice(str(tmp_path / "preempt"), interval=0.01)
    assert notice.poll() is None
    (tmp_path / "preempt").touch()
    assert notice.poll() == f"notice file {tmp_path / 'preempt'}"
    watch = PreemptionWatch(notice, signals=())
    watch.start()
    try:
        for _ in range(500):
            if watch.reason is not None:
                break
            threading.Event().wait(0.01)
        assert watch.reason == f"notice file {tmp_path / 'preempt'}" and watch.kind == 1
    finally:
        watch.stop()


def test_http_notice_rule(server: NoticeServer) -> None:
    notice = HTTPNotice(f"{server.url}/notice", timeout=5)
    assert notice.poll() is None  # 404: AWS before an interruption is scheduled
    server.status, server.body = 200, b""
    assert notice.poll() is None  # empty body
    server.status, server.body = 200, b"FALSE"
    assert HTTPNotice(f"{server.url}/notice", match="TRUE").poll() is None  # GCE before preemption
    server.body = b"TRUE"
    assert HTTPNotice(f"{server.url}/notice", match="TRUE").poll() == f"notice from {server.url}/notice: TRUE"
    assert notice.poll() == f"notice from {server.url}/notice: TRUE"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    assert HTTPNotice(f"http://127.0.0.1:{closed}/", timeout=1).poll() is None  # unreachable: no notice


def test_cli_builds_the_notice_from_a_class_path() -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(VarunaStrategy, "strategy")
    config = parser.parse_object({"strategy": {"preemption_notice": {
        "class_path": "lightning_varuna.trainer.recovery.preemption.HTTPNotice",
        "init_args": {"url": "http://169.254.169.254/latest/meta-data/spot/instance-action", "interval": 2.0},
    }}})
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in 4.49
    notice = instantiate(config).strategy.preemption_notice
    assert isinstance(notice, HTTPNotice) and notice.interval == 2.0


def test_slurm_requeue_calls_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "called"}\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    requeue_slurm_job()
    assert (tmp_path / "called").read_text().split() == ["requeue", "1234"]


def test_a_warning_inside_an_accumulation_window_stops_where_the_next_window_begins() -> None:
    """The partial gradient sums of an accumulation window are not checkpointed: stopping inside one would
    resume with a short window. The warned rank's flag stays set, so the stop comes at the next window start."""
    from types import SimpleNamespace

    from lightning_varuna.trainer.recovery.preemption import PreemptionGuard

    current = SimpleNamespace(ready=0)
    trainer = SimpleNamespace(world_size=1, accumulate_grad_batches=3,
                              fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(
                                  batch_progress=SimpleNamespace(current=current))))
    guard = object.__new__(PreemptionGuard)
    guard.trainer, guard.device, guard.watch = trainer, torch.device("cpu"), SimpleNamespace(kind=1)
    stops = []
    guard._stop = lambda kind: stops.append(current.ready)
    for ready in range(1, 7):  # warned during the batch after the first one: batches 1..6 of the epoch done
        current.ready = ready
        guard.agree()
    assert stops == [3, 6]
