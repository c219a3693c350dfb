"""This process's watchdog: started once per job (:func:`watch_job`), stopped when the interpreter exits.

A new default process group (a new job, or the survivors' new world after in-place recovery) gets a new watchdog;
a forked child (a DataLoader worker) forgets its parent's.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
from typing import IO, NotRequired, TypedDict

import torch.distributed as dist

from lightning_varuna.failstop.watchdog import SHUTDOWN_S, Watchdog, say

__all__ = ["current_watchdog", "watch_job"]


class _Running(TypedDict):
    watchdog: Watchdog | None
    store: object  # the store the watchdog was started over: a new store means a new job
    devnull: NotRequired[IO[str]]  # kept open for faulthandler's tracebacks at a failed shutdown


_running: _Running = {"watchdog": None, "store": None}


def watch_job() -> Watchdog | None:
    """Starts this process's watchdog over the default process group (once; None with a single process).

    Call it on every rank once the default process group exists (the engine does, before its first
    collective). It stops when the interpreter exits.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    store = dist.distributed_c10d._get_default_store()  # private: the job's store, the same under every launcher
    watchdog = _running["watchdog"]
    if watchdog is not None and _running["store"] is store:
        return watchdog
    if watchdog is not None:  # the process group was made again: a new job
        watchdog.stop()
    try:
        watchdog = Watchdog(store, dist.get_rank(), dist.get_world_size())
        watchdog.start()
    except Exception as err:  # noqa: BLE001 - training goes on; failures are then noticed by the timeouts only
        say(f"[rank {dist.get_rank()}] lightning_varuna: the watchdog could not start ({err}); a failure of another"
             " rank is noticed by p2p_timeout only.")
        return None
    _running.update({"watchdog": watchdog, "store": store})
    return watchdog


def current_watchdog() -> Watchdog | None:
    """This process's running watchdog, if any."""
    return _running["watchdog"]


def _stop_at_exit() -> None:
    watchdog = _running["watchdog"]
    if watchdog is None:
        return
    failed = watchdog.failed
    watchdog.stop()
    if failed:  # the rest of the shutdown is bounded: a C-level timer, which runs while the interpreter finalizes
        devnull = open(os.devnull, "w")  # faulthandler writes its tracebacks there  # noqa: SIM115
        _running["devnull"] = devnull
        faulthandler.dump_traceback_later(SHUTDOWN_S, exit=True, file=devnull)


def _forget_in_child() -> None:
    watchdog = _running["watchdog"]
    if watchdog is not None:
        watchdog.forget_in_child()
    _running.update({"watchdog": None, "store": None})


atexit.register(_stop_at_exit)
os.register_at_fork(after_in_child=_forget_in_child)
