"""Failures across ranks: the error a lost peer raises, reports to the job, and clean exits.

A rank that fails leaves its error in the job's store and tells the job's watchdogs
(:func:`report_failure`; :mod:`~lightning_varuna.failstop.watchdog` then ends every other rank), so that a peer
that loses contact with it raises a :class:`PipelineError` quoting the cause (:func:`peer_error`) instead of a
bare timeout or "connection closed".
"""

from __future__ import annotations

import atexit
import itertools
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch.distributed as dist

from lightning_varuna.failstop.abandon import PeersLost, abandonable, surviving
from lightning_varuna.failstop.job_watchdog import current_watchdog
from lightning_varuna.failstop.watchdog import SETTLE_S

if TYPE_CHECKING:  # torch.distributed re-exports Store only when it is built with distributed support
    from torch._C._distributed_c10d import Store

__all__ = [
    "PipelineError", "check_job", "destroy_process_groups_at_exit", "finish_together", "peer_error",
    "raised_on_every_rank", "report_failure",
    "waiting_on_peers",
]

_ERROR_KEY = "lightning_varuna/error/"
_FINISH_KEY = "lightning_varuna/finish/"
_exit = {"registered": False, "failed": False}
_runs = itertools.count()
_T = TypeVar("_T")
_E = TypeVar("_E", bound=BaseException)


class Placement(Protocol):
    """Where a waiting rank is: a :class:`~lightning_varuna.pipeline.topology.Topology`.

    A protocol, since this package imports nothing of the pipeline.
    """

    rank: int
    timeout: timedelta | None

    @property
    def stage(self) -> int: ...


class PipelineError(RuntimeError):
    """A pipeline peer failed, died or did not answer in time."""


def destroy_process_groups_at_exit() -> None:
    """Destroys every process group when the interpreter exits, unless this rank failed (registered once).

    Neither Lightning nor torchrun destroys the process groups. A gloo group that is still alive when the
    interpreter finalizes can abort the process ("terminate called without an active exception": its worker
    threads release tensors after Python is gone), turning a finished job into a failed one. A rank that
    failed skips it: destroying a group can wait on transfers that a lost peer will never complete.
    """
    if not _exit["registered"]:
        _exit["registered"] = True
        atexit.register(_destroy_process_groups)


def _destroy_process_groups() -> None:
    if _exit["failed"] or not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at exit
        pass


def raised_on_every_rank(error: _E) -> _E:
    """Marks ``error`` as raised by every rank alike, at the same point, after the ranks agreed on it.

    :func:`report_failure` then ends no other rank: each raises the error itself, and a process that catches it
    may go on (e.g. call ``fit`` again).
    """
    error.raised_on_every_rank = True  # type: ignore[attr-defined]  # a mark on any exception, read by getattr
    return error


def report_failure(error: BaseException) -> None:
    """Leaves this rank's error in the job's store, so peers that lose contact can say what happened.

    Besides one key per rank, the first error reported in the job is kept (first writer wins), separately
    for errors of the user's code or model (the cause) and for :class:`PipelineError` (a rank that lost a
    peer), so that peers quote the cause rather than another rank's report of it. The watchdog, if running,
    passes it to every rank (a lost peer only once the cause had a moment to arrive first).
    """
    if isinstance(error, PeersLost) and surviving() is not None:
        return  # not a failure: in-place recovery takes it in hand (or reports what it cannot recover from)
    agreed = getattr(error, "raised_on_every_rank", False)
    _exit["failed"] = _exit["failed"] or not agreed  # every peer is alive after an agreed error
    watchdog = current_watchdog()
    if watchdog is not None:
        watchdog.report(error, cause=not _lost_peer(error), agreed=agreed)
    try:
        store = dist.distributed_c10d._get_default_store()
        rank = dist.get_rank()
        text = "".join(traceback.format_exception_only(type(error), error)).strip()[-2000:]
        store.set(f"{_ERROR_KEY}{rank}", text)
        kind = "peer" if isinstance(error, PipelineError) else "cause"
        store.compare_set(f"{_ERROR_KEY}first-{kind}", "", f"Rank {rank} failed first with: {text}")
    except Exception:  # noqa: BLE001 - best effort: the store may be gone with rank 0
        pass


def _lost_peer(error: BaseException) -> bool:
    """Whether ``error`` is what a rank sees when a peer failed (a symptom), rather than a cause of its own."""
    if isinstance(error, (PipelineError, PeersLost)) or isinstance(error, getattr(dist, "DistError", ())):
        return True
    # gloo raises plain RuntimeErrors from its transport ("Connection closed by peer", "Timed out waiting ...")
    return isinstance(error, RuntimeError) and "gloo/transport/" in str(error)


def _peer_failure() -> str:
    try:
        store = dist.distributed_c10d._get_default_store()
        for kind in ("cause", "peer"):
            key = f"{_ERROR_KEY}first-{kind}"
            if store.check([key]):
                return f" {store.get(key).decode()}"
    except Exception:  # noqa: BLE001 - the store may be gone with rank 0
        pass
    return ""


def peer_error(
    topology: Placement, what: str, err: BaseException, timeout: timedelta | None = None
) -> PipelineError:
    """The :class:`PipelineError` for a failed wait on peers: this rank, ``what`` it waited for, the cause.

    For any wait on other ranks (p2p, or a collective such as a gradient all-reduce or log broadcast)::

        except Exception as err:
            raise peer_error(topo, "averaging gradients over ranks [1, 3]", err) from err

    It quotes the first failure known in the job, when there is one: the watchdog's (given a moment to
    arrive after a closed connection), else the first one reported in the store.
    """
    me = f"rank {topology.rank} (stage {topology.stage})"
    timeout = timeout or topology.timeout
    hint = ""
    timed_out = "timed out" in str(err).lower() or "timeout" in str(err).lower()
    if timeout is not None and timed_out:
        hint = f" (no answer within p2p_timeout={timeout.total_seconds():g}s: the peer is hung or far behind)"
    watchdog = current_watchdog()
    verdict = None
    if watchdog is not None:
        verdict = watchdog.verdict if timed_out else watchdog.wait_for_verdict(SETTLE_S)
    cause = f" {verdict.text}." if verdict is not None else _peer_failure()
    return PipelineError(f"{me}: {what} failed{hint}: {err}.{cause}")


def check_job(what: str) -> None:
    """Raises a :class:`PipelineError` if a failure of another rank is known (so that ``what`` is not started).

    A wait on peers after one of them failed could only fail, or (a checkpoint) leave a partial write behind.
    """
    watchdog = current_watchdog()
    failure = watchdog.failure if watchdog is not None else None
    if watchdog is not None and failure is not None and failure.origin != watchdog.rank:
        raise PipelineError(f"rank {watchdog.rank}: {what} not started: {failure.text}.")


def waiting_on_peers(topology: Placement, what: str, wait: Callable[[], _T]) -> _T:
    """Runs ``wait`` (a collective or p2p wait); its failure becomes a :class:`PipelineError` that says ``what``.

    While the job recovers in place from deaths, the wait can be given up: a peer's death raises
    :class:`~lightning_varuna.failstop.abandon.PeersLost` instead (see :mod:`~lightning_varuna.failstop.abandon`).
    """
    watchdog = surviving()
    try:
        return wait() if watchdog is None else abandonable(wait, what, watchdog)
    except (PipelineError, PeersLost):
        raise
    except Exception as err:  # noqa: BLE001 - a wait that failed because of a peer
        raise peer_error(topology, what, err) from err


def finish_together(error: BaseException | None, timeout: timedelta) -> None:
    """Ends a run (one ``fit``, say) on this rank: a rank that succeeded raises if any other rank failed.

    Every rank calls it once per run, in the same order, with the error that ended its run or None. A failed rank
    leaves its error in the job's store and returns at once (it raises its own error). A rank that succeeded
    waits until every rank has ended its run, at most ``timeout``, and raises a :class:`PipelineError` naming the
    first rank that failed (or, past ``timeout``, the ranks that did not end). No collective is used: the ranks
    that failed do not take part in one.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    run = f"{_FINISH_KEY}{next(_runs)}/"
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: nothing to agree through
        return
    if error is not None:
        text = "".join(traceback.format_exception_only(type(error), error)).strip()[-2000:]
        try:
            store.compare_set(f"{run}failed", "", f"rank {rank} failed: {text}")
            store.add(f"{run}ended", 1)
        except Exception:  # noqa: BLE001 - best effort: this rank raises its own error anyway
            pass
        return
    try:
        _wait_for_every_rank(store, run, rank, world, timeout)
    except PipelineError:
        raise
    except Exception as err:  # noqa: BLE001 - the store went away with its host (rank 0) before every rank ended
        raise PipelineError(
            f"rank {rank}: this rank finished, but lost the job's store while waiting for the others to finish"
            f" (its host, rank 0, is gone): {err}"
        ) from err


def _wait_for_every_rank(store: Store, run: str, rank: int, world: int, timeout: timedelta) -> None:
    store.add(f"{run}ended", 1)
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 0.005
    while True:
        ended = store.add(f"{run}ended", 0)
        if store.check([f"{run}failed"]):  # after the count: a rank that failed wrote this before counting itself
            raise PipelineError(f"rank {rank}: this rank finished, but {store.get(f'{run}failed').decode()}")
        if ended >= world:
            break
        if time.monotonic() > deadline:
            raise PipelineError(
                f"rank {rank}: this rank finished, but not every rank did within timeout="
                f"{timeout.total_seconds():g}s (one is hung or far behind)."
            )
        time.sleep(pause)
        pause = min(2 * pause, 0.25)
    # the store lives in rank 0's process under Lightning's launcher: it stays until every rank has seen the end
    store.add(f"{run}seen", 1)
    if rank == 0:
        while store.add(f"{run}seen", 0) < world and time.monotonic() < deadline:
            time.sleep(0.005)
