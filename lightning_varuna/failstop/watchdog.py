"""Fail fast: every rank of a job ends within seconds of a peer's death or failure, under any launcher.

A gloo or NCCL wait learns of a dead peer only if it was exchanging data with it (its socket closes), and
otherwise only after its timeout; a rank waiting on a *live* peer that is itself stuck behind the dead one
waits the whole ``p2p_timeout``. Launchers do not help everywhere: torchrun stops the other workers with
SIGTERM (which a preemption handler turns into a checkpoint attempt), Lightning's launcher checks its
children every 5 s, and processes started independently (SLURM) are not stopped at all.

So each rank runs a :class:`Watchdog`: a daemon thread with a TCP connection to the next rank and one from
the previous rank (a ring over the world; the addresses go through the job's store, torch.distributed's
``TCPStore`` under every launcher). Nothing is sent while the job runs. What travels on the ring:

- **a state**: ``active`` while the rank may wait on its peers (from the engine's setup), ``idle`` once it no
  longer will (after ``fit`` finished, or once a preemption checkpoint is written). A connection that closes
  while its peer is active means the peer's process ended without saying why: **the peer died** (killed,
  crashed, ``os._exit``). The kernel closes the sockets of a dead process at once, so this is seen in
  milliseconds, and never because a live process is slow: a long step, a slow checkpoint save, a long
  evaluation or a stretch that holds the GIL sends nothing and closes nothing. A machine that disappears
  sends no close: TCP keep-alive probes, answered by the peer's kernel (not by its Python), find it after
  :data:`KEEPALIVE_S` seconds.
- **a failure**: this rank's own error (reported by the strategy) or a dead neighbour, flooded around the ring
  in both directions, so that ranks with no connection to the failed one learn of it from their neighbours.
  A *cause* (a rank died, or its own code failed) ends every other active rank at once: it logs the cause,
  runs its cleanups (e.g. stops the asynchronous checkpoint writer) and exits with :data:`FAILED_EXIT_CODE`.
  A *symptom* (a rank lost contact with a peer: a closed connection, or ``p2p_timeout``) gives a cause
  :data:`SETTLE_S` seconds to arrive first; if none does (a hung rank), every rank ends naming every symptom
  reported meanwhile (which ranks waited on which).

An error that every rank raises alike, by agreement (a checkpoint that could not be written), ends no one: the
rank that reports it only goes idle. A rank that failed itself is not ended at once: its own error is being
raised and reported. If it is still running :data:`GRACE_S` seconds later (stuck in teardown on a peer that is
gone), the watchdog prints that error and ends it; and its interpreter's shutdown is bounded by
:data:`SHUTDOWN_S`.

Nothing here imports Lightning; the strategy (or a user of the engine) drives the states.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import selectors
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, cast

from lightning_varuna.failstop.ring_sockets import KEEPALIVE_S, local_address, tune

__all__ = ["FAILED_EXIT_CODE", "GRACE_S", "KEEPALIVE_S", "SETTLE_S", "Verdict", "Watchdog", "say"]

FAILED_EXIT_CODE = 1
"""Exit status of a rank ended by its watchdog (as if the failure had been raised in it)."""
SETTLE_S = 1.0
"""Seconds a symptom (a rank that lost contact with a peer) leaves for a cause to arrive before it ends the job."""
GRACE_S = 10.0
"""Seconds a rank whose own step failed has to raise and report its error before its watchdog ends it."""
SHUTDOWN_S = 3.0
"""Seconds a rank that failed may spend shutting its interpreter down before it exits with
:data:`FAILED_EXIT_CODE` (torch's process groups can wait there for seconds on peers that are gone)."""
CONNECT_TIMEOUT_S = 300.0
"""How long a rank keeps trying to reach its successor while the job starts (a slow start is not a failure)."""
_KEY = "lightning_varuna/watchdog/"
_POLL_S = 0.05


@dataclass(frozen=True)
class Verdict:
    """A failure in a job: a cause (a rank died, or its own code failed), or a symptom (a rank lost a peer)."""

    origin: int
    """The rank that died or failed."""
    text: str
    """What happened, naming that rank (e.g. ``"rank 3 died: ..."``)."""
    cause: bool = True
    """Whether it is a cause rather than a symptom (a rank that lost contact with a peer, or timed out)."""
    died: bool = False
    """Whether the rank's process ended without a word (killed, crashed, its machine gone), rather than failing with
    an error of its own: the failure that survivors can recover from in place."""


@dataclass
class _Link:
    """One ring connection and what is known of the rank at its other end."""

    sock: socket.socket
    rank: int | None = None
    active: bool = False
    pending: bytes = b""


class Watchdog:
    """One rank's watchdog (see the module's description); normally made by :func:`watch_job`.

    Args:
        store: The job's store (its own connection is cloned from it, so that the thread never blocks the
            training thread's use of the store).
        rank: This process's global rank.
        world_size: The number of processes.
        settle: See :data:`SETTLE_S`.
        grace: See :data:`GRACE_S`.
    """

    def __init__(self, store: Any, rank: int, world_size: int, settle: float = SETTLE_S,
                 grace: float = GRACE_S) -> None:
        self.rank = rank
        self.world_size = world_size
        self.settle = settle
        self.grace = grace
        self._store = store.clone() if hasattr(store, "clone") else store
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._links: dict[socket.socket, _Link] = {}
        self._active = True
        self._verdict: Verdict | None = None
        self._symptoms: dict[int, Verdict] = {}
        self._settle_until: float | None = None
        self._known = threading.Event()
        self._own: tuple[Verdict, str, float] | None = None
        self._cleanups: list[Callable[[], None]] = []
        self._ending = False
        self._stopping = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        host, family = local_address()
        self._listener = socket.create_server(("", 0), family=family, backlog=max(8, world_size))
        self._listener.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._nonce = secrets.token_hex(8)
        self._address = f"{host}|{self._listener.getsockname()[1]}|{self._nonce}"
        self._successor = (rank + 1) % world_size
        self._thread = threading.Thread(target=self._run, name="varuna-watchdog", daemon=True)
        self.survive_deaths = False
        """Whether a peer's death leaves this rank running (in-place recovery): it is then recorded in
        :attr:`dead` and :attr:`lost` is set, instead of ending this rank."""
        self._dead: set[int] = set()
        self.lost = threading.Event()
        """Set once a peer died while :attr:`survive_deaths` is on: waits on peers give up (see
        :mod:`~lightning_varuna.failstop.abandon`)."""

    # -- driven by the training thread ----------------------------------------------------------------------
    def start(self) -> None:
        """Publishes this rank's address and starts the thread (which connects to the next rank)."""
        self._store.set(f"{_KEY}{self.rank}", self._address)
        self._thread.start()

    @property
    def verdict(self) -> Verdict | None:
        """The failure of the job: its first cause, or its symptoms once none came within ``settle``."""
        return self._verdict

    @property
    def failure(self) -> Verdict | None:
        """The verdict, or else the first symptom known (a rank that lost contact with a peer), if any."""
        with self._lock:
            return self._verdict or next(iter(self._symptoms.values()), None)

    def wait_for_verdict(self, timeout: float) -> Verdict | None:
        """The verdict, waiting up to ``timeout`` seconds for one."""
        self._known.wait(timeout)
        return self._verdict

    @property
    def dead(self) -> frozenset[int]:
        """The ranks known to have died while :attr:`survive_deaths` was on."""
        with self._lock:
            return frozenset(self._dead)

    @property
    def failed(self) -> bool:
        """Whether this rank failed, or learned of a failure while it was waiting on its peers."""
        return self._own is not None or (self.failure is not None and self._active)

    @property
    def active(self) -> bool:
        """Whether this rank may be waiting on its peers (another rank's failure then ends it)."""
        return self._active

    def activate(self) -> Verdict | None:
        """Marks this rank active again (e.g. a new ``fit``); returns the failure known meanwhile, if any."""
        self._active = True
        self._send({"rank": self.rank, "state": "active"})
        return self.failure

    def deactivate(self, why: str) -> None:
        """Marks this rank idle: it no longer waits on its peers, and its exit is no failure (``why`` says why)."""
        self._active = False
        self._send({"rank": self.rank, "state": "idle", "why": why})

    def add_cleanup(self, cleanup: Callable[[], None]) -> Callable[[], None]:
        """Has ``cleanup`` run (best effort) before the watchdog ends the process; returns its remover."""
        self._cleanups.append(cleanup)
        return lambda: self._cleanups.remove(cleanup) if cleanup in self._cleanups else None

    def report(self, error: BaseException, cause: bool, agreed: bool = False) -> None:
        """This rank failed with ``error``: every rank learns of it at once (see the module's description).

        Args:
            error: The error.
            cause: Whether it is a cause (the user's code, an interrupt) rather than a symptom of a lost peer.
            agreed: Whether every rank raises this same error at the same point (the ranks agreed on it, e.g. a
                checkpoint write that failed): it ends no other rank, since each raises it itself, and a
                process that catches it may go on. This rank only says that its exit is no failure.
        """
        text = "".join(traceback.format_exception_only(type(error), error)).strip()[-2000:]
        if agreed:
            self.deactivate(f"raised on every rank: {text}")
            return
        details = "".join(traceback.format_exception(type(error), error, error.__traceback__))[-8000:]
        verdict = Verdict(self.rank, f"rank {self.rank} failed: {text}", cause)
        with self._lock:
            if self._own is not None:
                return
            self._own = (verdict, details, time.monotonic())
        self._judge(verdict)
        self._wake()

    def stop(self) -> None:
        """Says goodbye (idle, or the error that ended this rank) and closes the ring."""
        if self._stopping.is_set():
            return
        if self._own is None:
            uncaught = getattr(sys, "last_value", None)
            if self._active and uncaught is not None:
                self.report(uncaught, cause=True)  # an uncaught exception ends this interpreter
            else:
                self.deactivate("exit")
        self._stopping.set()
        self._wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)
        self._close()

    # -- the thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        connect_by = time.monotonic() + CONNECT_TIMEOUT_S
        connecting = True
        while not self._stopping.is_set():
            if connecting:
                connecting = not self._connect_successor()
                if connecting and time.monotonic() > connect_by:
                    connecting = False
                    say(f"[rank {self.rank}] lightning_varuna: rank {self._successor} did not start its watchdog"
                         f" within {CONNECT_TIMEOUT_S:g}s; a failure there is noticed by p2p_timeout only.")
            timeout = _POLL_S if connecting else self._next_timer()
            for key, _ in self._selector.select(timeout):
                link = self._links.get(cast(socket.socket, key.fileobj))  # only sockets are registered
                if link is not None:
                    self._receive(link)
                elif key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj is self._wake_r:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
            self._timers()

    def _connect_successor(self) -> bool:
        key = f"{_KEY}{self._successor}"
        try:
            if not self._store.check([key]):
                return False
            host, port, nonce = self._store.get(key).decode().split("|")
            sock = socket.create_connection((host, int(port)), timeout=5.0)
        except Exception as err:  # noqa: BLE001 - the job goes on without this link; waits stay bounded
            say(f"[rank {self.rank}] lightning_varuna: the watchdog cannot reach rank {self._successor} ({err});"
                 " a failure there is noticed by p2p_timeout only.")
            return True  # do not retry
        self._add_link(sock, self._successor)
        self._send_to(sock, {"rank": self.rank, "nonce": nonce, "state": "active" if self._active else "idle"})
        return True

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        self._add_link(sock, None)  # identified by its first message, which must carry this rank's nonce

    def _add_link(self, sock: socket.socket, rank: int | None) -> None:
        tune(sock)
        link = _Link(sock, rank, active=rank is not None)
        self._links[sock] = link
        self._selector.register(sock, selectors.EVENT_READ)

    def _receive(self, link: _Link) -> None:
        try:
            data = link.sock.recv(65536)
        except OSError as err:
            lost_machine = err.errno == errno.ETIMEDOUT
            self._lost(link, " (no answer to TCP keep-alive probes: its machine may be gone)" if lost_machine
                       else f" ({err})")
            return
        if not data:
            self._lost(link, "")
            return
        link.pending += data
        *lines, link.pending = link.pending.split(b"\n")
        for line in lines:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            self._handle(link, message)

    def _handle(self, link: _Link, message: dict[str, Any]) -> None:
        if link.rank is None:  # an accepted connection introduces itself with this rank's nonce
            if message.get("nonce") != self._nonce:
                self._drop(link)
                return
            link.rank = int(message["rank"])
            self._send_to(link.sock, {"rank": self.rank, "state": "active" if self._active else "idle"})
        if "state" in message:
            link.active = message["state"] == "active"
        if "verdict" in message:
            verdict = Verdict(**message["verdict"])
            if verdict.origin == link.rank:  # its own report: its exit is explained
                link.active = False
            self._judge(verdict)

    def _lost(self, link: _Link, detail: str) -> None:
        self._drop(link)
        if link.rank is not None and link.active and not self._stopping.is_set():
            self._judge(Verdict(link.rank, f"rank {link.rank} died: its connection to rank {self.rank} closed while"
                                           f" the job was running{detail}", died=True))

    def _judge(self, verdict: Verdict) -> None:
        """Takes in a failure: passes it on, and ends this rank if it is another rank's cause."""
        if verdict.died and self.survive_deaths and verdict.origin != self.rank:
            self._mourn(verdict)
            return
        with self._lock:
            if self._verdict is not None or (not verdict.cause and verdict.origin in self._symptoms):
                return
            if verdict.cause:
                self._verdict = verdict
            else:
                self._symptoms[verdict.origin] = verdict
                if self._settle_until is None:  # a cause gets that long to arrive before the symptoms rule
                    self._settle_until = time.monotonic() + self.settle
        self._send({"verdict": asdict(verdict)})
        if verdict.cause:
            self._known.set()
            if verdict.origin != self.rank and self._active:
                self._end(verdict.text)
        self._wake()

    def _mourn(self, verdict: Verdict) -> None:
        """A peer died and this rank survives it: recorded, passed on (once), and every wait on peers gives up."""
        with self._lock:
            if verdict.origin in self._dead:
                return
            self._dead.add(verdict.origin)
        self._send({"verdict": asdict(verdict)})
        self.lost.set()
        self._wake()

    def _next_timer(self) -> float:
        deadlines = [d for d in (self._settle_until, self._grace_deadline()) if d is not None]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else 1.0

    def _grace_deadline(self) -> float | None:
        return None if self._own is None else self._own[2] + self.grace

    def _timers(self) -> None:
        now = time.monotonic()
        if self._settle_until is not None and now >= self._settle_until and self._verdict is None:
            with self._lock:
                symptoms = list(self._symptoms.values())
                first, others = symptoms[0], [v.text for v in symptoms[1:]]
                also = f" (also {'; '.join(others)})" if others else ""
                self._verdict = Verdict(first.origin, f"{first.text}{also}", cause=False)
                self._settle_until = None
            self._known.set()
            if self._own is None and self._active and not self.lost.is_set():
                self._end(self._verdict.text)
        grace = self._grace_deadline()
        if grace is not None and now >= grace and self._own is not None:  # a grace deadline implies an own error
            verdict, details, _ = self._own
            self._end(f"{verdict.text}; it did not exit within {self.grace:g}s of that error", details)

    def _end(self, why: str, details: str = "") -> None:
        with self._lock:
            if self._ending:
                return
            self._ending = True
        if self._own is not None and not details and self._own[0].text not in why:
            details = f"This rank's own error:\n{self._own[1]}"
        say(f"[rank {self.rank}] lightning_varuna: {why}. Ending rank {self.rank} (exit code {FAILED_EXIT_CODE})."
             + (f"\n{details}" if details else ""))
        self._send({"rank": self.rank, "state": "ending"})  # its neighbours must not take this exit for a death
        for cleanup in list(self._cleanups):
            with contextlib.suppress(Exception):
                cleanup()
        self._terminate()

    def _terminate(self) -> None:
        """Ends the process (tests override it)."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(FAILED_EXIT_CODE)

    # -- sockets ------------------------------------------------------------------------------------------
    def _send(self, message: dict[str, Any]) -> None:
        for sock in list(self._links):
            self._send_to(sock, message)

    def _send_to(self, sock: socket.socket, message: dict[str, Any]) -> None:
        data = json.dumps(message).encode() + b"\n"
        with self._send_lock, contextlib.suppress(OSError):
            sock.sendall(data)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _drop(self, link: _Link) -> None:
        self._links.pop(link.sock, None)
        with contextlib.suppress(Exception):
            self._selector.unregister(link.sock)
        with contextlib.suppress(OSError):
            link.sock.close()

    def _close(self) -> None:
        for link in list(self._links.values()):
            self._drop(link)
        for sock in (self._listener, self._wake_r, self._wake_w):
            with contextlib.suppress(Exception):
                self._selector.unregister(sock)
            with contextlib.suppress(OSError):
                sock.close()

    def forget_in_child(self) -> None:
        """In a forked child (a DataLoader worker): closes the child's copies of the sockets, nothing else.

        Otherwise the child would hold this rank's connections open after this rank died.
        """
        for sock in [*self._links, self._listener, self._wake_r, self._wake_w]:
            with contextlib.suppress(OSError):
                sock.close()


def say(message: str) -> None:
    """Writes ``message`` to stderr at once (best effort: the process may be ending)."""
    with contextlib.suppress(Exception):
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
