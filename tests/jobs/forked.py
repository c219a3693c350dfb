"""Starts a job's ranks by forking the parent (which has imported torch and Lightning once), as an external launcher
would: each rank's own exit status and end time are seen, and a rank that outlives a deadline is killed."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    out: Path,
    name: str,
    world: int,
    rank_main: Callable[[int], None],
    deadline: float,
    give_up: Callable[[Iterable[int]], bool] | None = None,
) -> dict[int, dict]:
    """Runs ``rank_main(rank)`` in ``world`` forked processes with the usual rendezvous variables set.

    Each rank writes its output to ``out/<name>.rank<r>.log``; an uncaught exception is printed there and exits
    with 1, ``SystemExit`` with its code. Ranks still running ``deadline`` seconds after the start, or once
    ``give_up(running ranks)`` says so, are SIGKILLed.

    Returns:
        Per rank: ``returncode`` (``None`` if killed), ``end`` (``time.time()``) and ``killed``.
    """
    port = free_port()
    start = time.time()
    pids = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                log = os.open(out / f"{name}.rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                                  NODE_RANK="0", LOCAL_RANK=str(rank), RANK=str(rank))
                rank_main(rank)
                code = 0
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 1
                print(f"SystemExit({exit_.code!r})", flush=True)
            except BaseException:  # noqa: BLE001 - print it as the interpreter would, then exit non-zero
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids[pid] = rank
    ends: dict[int, dict] = {}
    while pids:
        now = time.time()
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            ends[pids.pop(pid)] = {"returncode": os.waitstatus_to_exitcode(status), "end": now, "killed": False}
            continue
        if now - start > deadline or (give_up is not None and give_up(pids.values())):
            for pid, rank in list(pids.items()):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                ends[rank] = {"returncode": None, "end": now, "killed": True}
                del pids[pid]
        time.sleep(0.05)
    return ends


def marked_time(out: Path, name: str, ranks: Iterable[int], mark: str) -> float | None:
    """The time a rank printed after ``mark`` (``<mark> <time>``) in its log, the last one found, if any."""
    found = None
    for rank in ranks:
        for line in (out / f"{name}.rank{rank}.log").read_text(errors="replace").splitlines():
            if line.startswith(mark):
                found = float(line.split()[1])
    return found
