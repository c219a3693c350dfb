"""The watchdog's rules, with several ranks' watchdogs in this one process over a real TCPStore and real sockets.

A rank "dies" by closing its sockets without a word (what the kernel does for a killed process) and "ends"
(instead of ``os._exit``) by recording it and closing its sockets. The multi-process behaviour under each
launcher is in ``test_faults.py``.
"""

from __future__ import annotations

import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_varuna.failstop.watchdog import KEEPALIVE_S, Watchdog

WAIT = 10.0
"""Seconds a test waits for something that should take milliseconds (a loaded CI machine)."""


class Rank(Watchdog):
    """A watchdog whose process end is recorded instead of happening, and which records what its thread did.

    What it records are the positive signals a test waits for before it checks that something did *not*
    happen: that the message or closed connection that could have ended a rank was taken in, and that the
    timers ran past the deadline that could have.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ended = threading.Event()
        self.ended_at: float | None = None
        self.cleaned = False
        self.add_cleanup(lambda: setattr(self, "cleaned", True))
        self.closed: list[int | None] = []  # the ranks whose connection to this one closed, as taken in
        self.messages: list[tuple[int | None, dict]] = []  # (sender, message), as taken in
        self.timers_run: list[tuple[float, bool]] = []  # when the timers were checked, and whether a verdict was known

    def _terminate(self) -> None:  # the process ends: its sockets close
        self.ended_at = time.monotonic()
        self.ended.set()
        self._stopping.set()
        self._close()

    def _lost(self, link, detail: str) -> None:
        super()._lost(link, detail)
        self.closed.append(link.rank)

    def _handle(self, link, message: dict) -> None:
        super()._handle(link, message)
        self.messages.append((link.rank, message))

    def _timers(self) -> None:
        super()._timers()
        self.timers_run.append((time.monotonic(), self._verdict is not None))

    def took_in_state(self, sender: int, state: str) -> bool:
        """Whether a message from ``sender`` saying it is ``state`` (``"idle"``, ``"active"``) was taken in."""
        return any(rank == sender and m.get("state") == state for rank, m in list(self.messages))

    def timers_ran_after(self, moment: float) -> bool:
        """Whether the timers were checked after ``moment`` (a deadline due by then has been acted on)."""
        return any(t > moment for t, _ in list(self.timers_run))

    def acted_on_verdict(self) -> bool:
        """Whether the timers ran with a verdict known (one reached by settling is acted on in that same run)."""
        return any(known for _, known in list(self.timers_run))

    def die(self) -> None:
        """Ends without a word, as a SIGKILL would."""
        self._stopping.set()
        self._wake()
        self._thread.join(WAIT)
        self._close()


@pytest.fixture(scope="module")
def server() -> Iterator[dist.TCPStore]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield store


def ring(server: dist.TCPStore, n: int, **options) -> list[Rank]:
    store = dist.PrefixStore(uuid.uuid4().hex, server)
    ranks = [Rank(store, r, n, **options) for r in range(n)]
    for rank in ranks:
        rank.start()
    deadline = time.monotonic() + WAIT
    while any(len(r._links) < 2 for r in ranks):  # each rank: one link to its successor, one from its predecessor
        assert time.monotonic() < deadline, [len(r._links) for r in ranks]
        time.sleep(0.01)
    return ranks


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def stop_all(ranks: list[Rank]) -> None:
    for rank in ranks:
        if not rank.ended.is_set():
            rank.deactivate("test over")
    for rank in ranks:
        rank.die()


def test_a_dead_rank_ends_every_other_rank_naming_it(server) -> None:
    ranks = ring(server, 5)
    ranks[2].die()  # the time to the last end: benchmarks/fault_exit.py
    wait_until(lambda: all(r.ended.is_set() for r in ranks if r is not ranks[2]), "the others did not end")
    for rank in ranks:
        if rank is not ranks[2]:
            assert rank.verdict is not None and rank.verdict.origin == 2, rank.verdict
            assert rank.verdict.text.startswith("rank 2 died: its connection to rank ")
            assert rank.cleaned
    # only the dead rank's neighbours saw it (both, or one whose word reached the other first); the others were
    # told by them: no other connection is named
    texts = {r.verdict.text for r in ranks if r is not ranks[2]}
    assert texts and texts <= {
        "rank 2 died: its connection to rank 1 closed while the job was running",
        "rank 2 died: its connection to rank 3 closed while the job was running",
    }, texts
    # what each thread took in (each ended its loop after ending its rank): rank 2's connection closed at its
    # neighbours only, and the ranks named as having seen it are among them; the others were told in a message
    for rank in ranks:
        rank._thread.join(WAIT)
        assert not rank._thread.is_alive()
    observers = {r.rank for r in ranks if 2 in r.closed}
    assert observers and observers <= {1, 3}, observers
    assert {int(re.search(r"connection to rank (\d+)", text).group(1)) for text in texts} <= observers
    for rank in (ranks[0], ranks[4]):
        assert 2 not in rank.closed
        assert any(m.get("verdict", {}).get("origin") == 2 for _, m in rank.messages), rank.messages


def test_a_rank_that_said_goodbye_may_go_and_idle_ranks_stay(server) -> None:
    ranks = ring(server, 3)
    ranks[1].deactivate("finished")
    wait_until(lambda: ranks[0].took_in_state(1, "idle") and ranks[2].took_in_state(1, "idle"), "no goodbye")
    ranks[1].die()
    # what could have ended a rank, its closed connections, has been taken in by both of its neighbours
    wait_until(lambda: 1 in ranks[0].closed and 1 in ranks[2].closed, "the close was not seen")
    ranks[0].deactivate("finished")
    wait_until(lambda: ranks[2].took_in_state(0, "idle"), "rank 0's goodbye did not reach rank 2")
    assert not any(r.ended.is_set() for r in ranks) and all(r.verdict is None for r in ranks)
    ranks[2].die()  # rank 0 is idle: it records what happened but is not ended
    wait_until(lambda: ranks[0].verdict is not None, "rank 0 did not learn of rank 2's death")
    assert ranks[0].verdict.origin == 2 and not ranks[0].ended.is_set()
    assert ranks[0].activate() is ranks[0].verdict  # a new fit is told
    ranks[0].die()


def test_a_rank_whose_step_failed_is_ended_only_after_its_grace(server) -> None:
    ranks = ring(server, 4, grace=1.0)
    reported = time.monotonic()
    try:
        raise RuntimeError("injected")
    except RuntimeError as err:
        ranks[1].report(err, cause=True)
    wait_until(lambda: all(r.ended.is_set() for r in ranks if r is not ranks[1]), "the others did not end")
    assert {r.verdict.text for r in ranks} == {"rank 1 failed: RuntimeError: injected"}
    wait_until(ranks[1].ended.is_set, "the failed rank was not ended after its grace")
    assert ranks[1].ended_at - reported >= 1.0  # raising and reporting its own error until then
    stop_all(ranks)


def test_an_error_every_rank_raises_ends_no_peer_and_the_job_may_go_on(server) -> None:
    # e.g. a checkpoint write that failed: the ranks agreed on it, and each raises it itself; rank 0 reports it
    # first (the others are still on their way to raising it), then its process ends
    ranks = ring(server, 3, grace=0.3)
    reported = time.monotonic()
    ranks[0].report(RuntimeError("Could not write checkpoint"), cause=True, agreed=True)
    wait_until(lambda: ranks[1].took_in_state(0, "idle") and ranks[2].took_in_state(0, "idle"), "not told")
    ranks[0].die()
    # the closed connections taken in, and the timers checked past the grace (no settling: no symptom)
    wait_until(lambda: 0 in ranks[1].closed and 0 in ranks[2].closed, "the close was not seen")
    wait_until(lambda: all(r.timers_ran_after(reported + 0.3) for r in ranks[1:]), "timers not checked")
    assert not any(r.ended.is_set() for r in ranks[1:]) and all(r.verdict is None for r in ranks)
    reported = time.monotonic()
    ranks[1].report(RuntimeError("Could not write checkpoint"), cause=True, agreed=True)
    wait_until(lambda: ranks[2].took_in_state(1, "idle"), "not told")
    wait_until(lambda: ranks[1].timers_ran_after(reported + 0.3), "timers not checked")
    assert not ranks[1].ended.is_set()  # caught: it may go on
    assert ranks[1].activate() is None and ranks[2].activate() is None  # a new fit starts clean
    stop_all(ranks[1:])


def test_a_lost_peer_reported_while_the_cause_is_on_its_way_does_not_hide_the_cause(server) -> None:
    ranks = ring(server, 4, settle=5.0)
    ranks[0].report(ConnectionError("Connection closed by peer"), cause=False)  # a symptom: it settles
    ranks[2].die()
    wait_until(lambda: all(r.ended.is_set() for r in (ranks[0], ranks[1], ranks[3])), "not ended")
    assert {r.verdict.origin for r in (ranks[0], ranks[1], ranks[3])} == {2}


def test_lost_peers_with_no_cause_known_are_all_named_after_settling(server) -> None:
    # a hang: ranks that timed out waiting report it (symptoms); with no death or error anywhere within the
    # settling time, every rank ends naming what each of them saw
    ranks = ring(server, 4, settle=0.3, grace=WAIT * 3)
    start = time.monotonic()
    ranks[0].report(TimeoutError("no answer from rank 1 within p2p_timeout=5s"), cause=False)
    ranks[2].report(TimeoutError("no answer from rank 1 within p2p_timeout=5s"), cause=False)
    wait_until(lambda: ranks[1].ended.is_set() and ranks[3].ended.is_set(), "not ended")
    assert time.monotonic() - start >= 0.3
    for rank in (ranks[1], ranks[3]):
        assert "rank 0 failed: TimeoutError: no answer from rank 1" in rank.verdict.text
        assert "rank 2 failed: TimeoutError: no answer from rank 1" in rank.verdict.text
    # ranks 0 and 2 settled too (a verdict), and their timers acted on it: they are not ended, reporting their
    # own errors (within their grace)
    wait_until(lambda: ranks[0].acted_on_verdict() and ranks[2].acted_on_verdict(), "not settled")
    assert not ranks[0].ended.is_set() and not ranks[2].ended.is_set()
    stop_all(ranks)


def test_a_rank_that_reported_its_error_and_exited_at_once_is_not_taken_for_dead(server) -> None:
    ranks = ring(server, 3, settle=0.3)
    ranks[0].report(ConnectionError("Connection closed by peer"), cause=False)
    ranks[0].die()  # e.g. os._exit right after the error: no goodbye
    wait_until(lambda: ranks[1].ended.is_set() and ranks[2].ended.is_set(), "not ended")
    assert {r.verdict.text for r in ranks[1:]} == {"rank 0 failed: ConnectionError: Connection closed by peer"}


def test_an_uncaught_exception_at_exit_is_a_failure_and_a_clean_exit_is_not(server, monkeypatch) -> None:
    ranks = ring(server, 3)
    ranks[0].stop()  # a clean exit: goodbye
    wait_until(lambda: 0 in ranks[1].closed and 0 in ranks[2].closed, "the close was not seen")
    assert ranks[1].took_in_state(0, "idle") and ranks[2].took_in_state(0, "idle")
    assert not ranks[1].ended.is_set() and not ranks[2].ended.is_set()
    monkeypatch.setattr("sys.last_value", ValueError("uncaught"), raising=False)
    ranks[1].stop()
    wait_until(ranks[2].ended.is_set, "rank 2 was not ended")
    assert ranks[2].verdict.text == "rank 1 failed: ValueError: uncaught"


def test_ring_connections_probe_for_a_lost_machine() -> None:
    from lightning_varuna.failstop.ring_sockets import tune

    with socket.create_server(("127.0.0.1", 0)) as listener, socket.create_connection(listener.getsockname()) as client:
        tune(client)
        assert client.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        if hasattr(socket, "TCP_KEEPIDLE"):  # Linux
            idle = client.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
            interval = client.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)
            count = client.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)
            assert idle + interval * count == KEEPALIVE_S <= 5
