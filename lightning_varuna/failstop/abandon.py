"""Waits on peers that a rank can give up, so that it survives a peer's death (in-place recovery).

A gloo wait on a dead peer fails only when a socket to it closes; a rank waiting on a *live* peer that is itself
stuck behind the dead one waits its whole timeout, and neither ``abort()`` nor ``shutdown()`` of a gloo group
interrupts it. So while a job recovers in place, the training thread never blocks inside gloo: each wait runs in a
helper thread and the training thread polls it and the watchdog's :attr:`~.watchdog.Watchdog.lost` flag. When a
peer died, the wait is *abandoned*: :class:`PeersLost` is raised, the helper thread is left to fail on its own
once the old process groups are gone (their sockets close), and a new helper serves the next wait.

Nothing changes for a job that fails and restarts (the default): there the wait runs in the calling thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

from lightning_varuna.failstop.job_watchdog import current_watchdog
from lightning_varuna.failstop.watchdog import SETTLE_S, Watchdog

__all__ = ["PeersLost", "abandonable", "raise_if_a_death_explains", "surviving"]

_T = TypeVar("_T")
_POLL_S = 0.05


class PeersLost(RuntimeError):
    """Peers died while this rank waited on them; the rank survives and recovers in place.

    Args:
        dead: The global ranks (of the world that was) known to have died.
        what: What this rank was waiting for.
    """

    def __init__(self, dead: frozenset[int], what: str) -> None:
        super().__init__(f"rank(s) {sorted(dead)} died while this rank was {what}")
        self.dead = dead
        self.what = what


def surviving() -> Watchdog | None:
    """The watchdog when this rank survives peers' deaths (in-place recovery is on), else None."""
    watchdog = current_watchdog()
    return watchdog if watchdog is not None and watchdog.survive_deaths else None


def raise_if_a_death_explains(watchdog: Watchdog, what: str, error: BaseException) -> None:
    """Raises :class:`PeersLost` if a peer's death explains ``error``.

    The watchdog learns of the death within :data:`~.watchdog.SETTLE_S` of the closed connection that caused it.
    """
    if watchdog.lost.wait(SETTLE_S):
        raise PeersLost(watchdog.dead, what) from error


class _Helper:
    """A daemon thread that runs one wait at a time for the training thread."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], list[Any], threading.Event]] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="varuna-wait", daemon=True)
        self.thread.start()

    def submit(self, wait: Callable[[], Any]) -> tuple[list[Any], threading.Event]:
        box: list[Any] = []
        done = threading.Event()
        self._jobs.put((wait, box, done))
        return box, done

    def _run(self) -> None:
        while True:
            wait, box, done = self._jobs.get()
            try:
                box.append((True, wait()))
            except BaseException as err:  # noqa: BLE001 - handed to the training thread
                box.append((False, err))
            done.set()


_helper: dict[str, _Helper | None] = {"current": None}


def abandonable(wait: Callable[[], _T], what: str, watchdog: Watchdog) -> _T:
    """Runs ``wait`` in a helper thread; gives it up with :class:`PeersLost` as soon as a peer died.

    An error of the wait itself is re-raised, unless a peer's death explains it
    (:func:`raise_if_a_death_explains`).
    """
    helper = _helper["current"] or _Helper()
    _helper["current"] = helper
    box, done = helper.submit(wait)
    while not done.wait(_POLL_S):
        if watchdog.lost.is_set():
            _helper["current"] = None  # this one may stay blocked until the old groups are gone
            raise PeersLost(watchdog.dead, what)
    ok, value = box[0]
    if ok:
        return cast(_T, value)
    raise_if_a_death_explains(watchdog, what, value)
    raise value
