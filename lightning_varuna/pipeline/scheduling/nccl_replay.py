"""NCCL's point-to-point rules, checked on CPU: replay what every rank posted and find deadlocks and mismatches.

On GPUs the pipeline's sends and receives go through NCCL, which matches them by rules that gloo does not have:

1. tags are ignored: the k-th send from A to B fills the k-th receive B posted from A;
2. the ops between two ranks on one process group run on one stream per side, in posting order, both directions
   together: a receive at the head of the stream holds up everything posted after it to that peer, sends too;
3. the ops of one ``batch_isend_irecv`` call progress together;
4. sizes must be equal (a smaller receive truncates, a larger one hangs).

:func:`replay` takes each rank's posted ops and host waits (:class:`Op`, :class:`Wait`) in posting order and
plays them under these rules, deterministically: a send and a receive complete together when each is at the head
of its side's stream (or inside the head batch); a rank's host stops at a wait until the ops it waits for have
completed. Sends are modelled as rendezvous (a send completes only with its receive), the strict reading; what
passes it also passes an eager transport. It raises :class:`P2POrderError` on a deadlock (no rank and no stream
can progress while ops remain) or a mismatch (bytes, dtype or message differ between a send and the receive it
fills).

:func:`plan_trace` models the executor's posting for any schedule (data only, e.g. interleaved or zero-bubble task
lists), and :func:`check_trace_dir` replays the traces that running engines write in the NCCL-rules mode
(:data:`~lightning_varuna.pipeline.comm.events.P2P_TRACE_ENV`; the test suite turns it on for every multi-process
job). ``python -m lightning_varuna.pipeline.scheduling.nccl_replay DIR`` checks such a directory.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_varuna.pipeline.scheduling.lowering import Message, MessageKind, link_messages, rank_messages, stage_of
from lightning_varuna.pipeline.scheduling.schedules import Kind, Task

__all__ = [
    "CheckSummary", "Op", "P2POrderError", "Wait", "check_trace_dir", "events_from_json", "plan_trace", "replay",
]


@dataclass(frozen=True)
class Op:
    """One send or receive as posted by a rank.

    Attributes:
        id: Unique per rank and step (waits refer to it).
        kind: ``"send"`` or ``"recv"``.
        peer: The other rank (global).
        group: The process group's name; each group has its own stream per pair of ranks.
        nbytes: Bytes transferred.
        dtype: Element type (``"float32"``...).
        what: The message, e.g. ``"act 3@0"`` (a send and the receive it fills must agree when both say).
        batch: Ops posted by one ``batch_isend_irecv`` call share a batch id; None for a single op.
    """

    id: int
    kind: str
    peer: int
    group: str
    nbytes: int
    dtype: str
    what: str | None = None
    batch: int | None = None

    def __str__(self) -> str:
        direction = "send to" if self.kind == "send" else "receive from"
        return f"{direction} rank {self.peer} on {self.group} ({self.what or '?'}, {self.nbytes} B {self.dtype})"


@dataclass(frozen=True)
class Wait:
    """The rank's host waits here until the ops with these ids have completed."""

    ids: tuple[int, ...]


Event = Op | Wait


class P2POrderError(RuntimeError):
    """The posted ops deadlock or mismatch under NCCL's rules."""


@dataclass
class _Entry:
    """One slot of a stream: a single op, or the ops of one batch (shared by the streams the batch touches)."""

    rank: int
    ops: list[Op]
    pending: list[Op] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pending = list(self.ops)


_StreamKey = tuple[str, int, int]  # (group, this rank, peer)


class _Replay:
    def __init__(self, traces: Mapping[int, Sequence[Event]]) -> None:
        self.traces = traces
        self.cursor = dict.fromkeys(traces, 0)
        self.done: dict[int, set[int]] = {rank: set() for rank in traces}
        self.streams: dict[_StreamKey, deque[_Entry]] = {}
        self.matched = 0

    def run(self) -> int:
        progressed = True
        while progressed:
            progressed = any([self._advance(rank) for rank in self.traces])
            for key in list(self.streams):
                progressed |= self._match(key)
        if any(self.streams.values()) or any(self.cursor[r] < len(t) for r, t in self.traces.items()):
            raise P2POrderError("deadlock under NCCL's rules:\n" + self._blocked())
        return self.matched

    def _advance(self, rank: int) -> bool:
        """Posts the rank's ops up to its next unmet wait; whether it moved."""
        events, start = self.traces[rank], self.cursor[rank]
        index = start
        while index < len(events):
            event = events[index]
            if isinstance(event, Wait):
                if not set(event.ids) <= self.done[rank]:
                    break
                index += 1
                continue
            ops = [event]
            index += 1
            while event.batch is not None and index < len(events):
                following = events[index]
                if not isinstance(following, Op) or following.batch != event.batch:
                    break
                ops.append(following)
                index += 1
            entry = _Entry(rank, ops)
            for key in dict.fromkeys((op.group, rank, op.peer) for op in ops):
                self.streams.setdefault(key, deque()).append(entry)
        self.cursor[rank] = index
        return index > start

    def _match(self, key: _StreamKey) -> bool:
        """Matches the sends of one side's head against the receives of the other side's head."""
        group, rank, peer = key
        mine, theirs = self.streams.get(key), self.streams.get((group, peer, rank))
        if not mine or not theirs:
            return False
        sends = [op for op in mine[0].pending if op.kind == "send" and op.peer == peer and op.group == group]
        receives = [op for op in theirs[0].pending if op.kind == "recv" and op.peer == rank and op.group == group]
        if not sends or not receives:
            return False
        for send, receive in zip(sends, receives):
            self._check_pair(rank, send, peer, receive)
            mine[0].pending.remove(send)
            theirs[0].pending.remove(receive)
            self.matched += 1
        for entry in (mine[0], theirs[0]):
            if not entry.pending:
                self._retire(entry)
        return True

    def _retire(self, entry: _Entry) -> None:
        """Removes a completed entry from the head of every stream it is in (a batch may span several)."""
        for op in entry.ops:
            stream = self.streams[(op.group, entry.rank, op.peer)]
            if stream and stream[0] is entry:
                stream.popleft()
            self.done[entry.rank].add(op.id)

    @staticmethod
    def _check_pair(rank: int, send: Op, peer: int, receive: Op) -> None:
        if send.nbytes != receive.nbytes or send.dtype != receive.dtype or (
            send.what is not None and receive.what is not None and send.what != receive.what
        ):
            raise P2POrderError(
                f"mismatch under NCCL's rules: rank {rank}'s {send} fills rank {peer}'s {receive}"
            )

    def _blocked(self) -> str:
        lines = []
        for rank, events in self.traces.items():
            at = self.cursor[rank]
            if at < len(events):
                lines.append(f"  rank {rank} waits at event {at}: {_describe_wait(events[at], events)}")
        for (group, rank, peer), stream in self.streams.items():
            if stream:
                lines.append(f"  rank {rank}'s stream to rank {peer} on {group} is held by its head: "
                             + "; ".join(str(op) for op in stream[0].pending))
        return "\n".join(lines)


def _describe_wait(event: Event, events: Sequence[Event]) -> str:
    if isinstance(event, Op):
        return str(event)
    ops = {e.id: e for e in events if isinstance(e, Op)}
    return "wait for " + ", ".join(str(ops.get(i, i)) for i in event.ids)


def replay(traces: Mapping[int, Sequence[Event]]) -> int:
    """Plays every rank's posted ops and waits under NCCL's rules; returns the number of matched transfers.

    Args:
        traces: Per global rank, its ops and waits in posting order (one step, or any span that ends with
            every op completed).

    Raises:
        P2POrderError: On a deadlock, naming where each rank waits and what holds each blocked stream, or on the
            first send whose bytes, dtype or message differ from the receive it fills.
    """
    return _Replay(traces).run()


# -- traces of plans (data only) ---------------------------------------------------------------------------
def _default_nbytes(message: Message) -> int:
    return {MessageKind.HEADER: 80, MessageKind.SUMMARY: 512}.get(message.kind, 4096)


def plan_trace(
    schedule: Sequence[Sequence[Task]],
    stage_ranks: Sequence[int] | None = None,
    summary: bool = False,
    nbytes: Callable[[Message], int] = _default_nbytes,
    receive_order: Callable[[int, int, tuple[Message, ...]], tuple[Message, ...]] | None = None,
) -> dict[int, list[Event]]:
    """The ops each rank posts for ``schedule`` as the executor posts them, for :func:`replay`.

    Each rank runs its tasks in list order. Before a task that needs a message, it posts the receives of that
    message's link in link order up to it (a header is waited for before the receives after it, whose shapes
    it gives) and waits for it; after a task that produces a message, it posts the send. After its tasks it
    passes the summary on, then waits for its sends. The executor may post receives earlier than this (all
    activations once the header is there): on a link that carries one direction only that changes nothing
    under NCCL's rules.

    Args:
        schedule: Per rank, its task list (tasks name their stage when a rank runs several).
        stage_ranks: The rank of each stage (default: stage ``s`` on rank ``s``).
        summary: Whether the step passes the summary from the last rank to the first.
        nbytes: The size of a message.
        receive_order: Replaces the order in which a rank posts a link's receives (``(src, dst, messages)``
            to the order): for tests that show what a wrong order does.
    """
    links = link_messages(schedule, stage_ranks, summary)
    ranks = tuple(range(len(schedule))) if stage_ranks is None else tuple(stage_ranks)
    traces: dict[int, list[Event]] = {}
    for rank, tasks in enumerate(schedule):
        order = rank_messages(links, rank)
        inbound = {
            src: receive_order(src, rank, messages) if receive_order else messages
            for src, messages in order.inbound.items()
        }
        traces[rank] = _RankModel(rank, ranks, inbound, nbytes).run(tasks, order.outbound)
    return traces


class _RankModel:
    def __init__(self, rank: int, ranks: tuple[int, ...], inbound: dict[int, tuple[Message, ...]],
                 nbytes: Callable[[Message], int]) -> None:
        self.rank, self.ranks, self.inbound, self.nbytes = rank, ranks, inbound, nbytes
        self.posted = dict.fromkeys(inbound, 0)
        self.ids: dict[Message, int] = {}
        self.sends: list[int] = []
        self.events: list[Event] = []

    def run(self, tasks: Sequence[Task], outbound: dict[int, tuple[Message, ...]]) -> list[Event]:
        last = len(self.ranks) - 1
        for task in tasks:
            stage, k = stage_of(task, self.rank), task.microbatch
            # a local edge (two stages of this rank) hands its messages over in memory: nothing is posted
            before = self.ranks[stage - 1] if stage > 0 else self.rank
            after = self.ranks[stage + 1] if stage < last else self.rank
            if task.kind is Kind.F and before != self.rank:
                self._take(before, Message(MessageKind.ACTIVATION, stage - 1, k))
            if task.kind in (Kind.B, Kind.I) and after != self.rank:
                self._take(after, Message(MessageKind.GRADIENT, stage + 1, k))
            if task.kind is Kind.F and after != self.rank:
                header = Message(MessageKind.HEADER, stage)
                if header in outbound.get(after, ()) and header not in self.ids:
                    self._post("send", after, header)
                self._post("send", after, Message(MessageKind.ACTIVATION, stage, k))
            if task.kind in (Kind.B, Kind.I) and before != self.rank:
                self._post("send", before, Message(MessageKind.GRADIENT, stage, k))
        for src, messages in self.inbound.items():
            if any(m.kind is MessageKind.SUMMARY for m in messages):
                self._take(src, Message(MessageKind.SUMMARY, src))
        for dst, messages in outbound.items():
            if any(m.kind is MessageKind.SUMMARY for m in messages):
                self._post("send", dst, Message(MessageKind.SUMMARY, self.rank))
        if self.sends:
            self.events.append(Wait(tuple(self.sends)))
        return self.events

    def _take(self, src: int, message: Message) -> None:
        messages = self.inbound.get(src, ())
        while message not in self.ids and self.posted.get(src, 0) < len(messages):
            posted = messages[self.posted[src]]
            self._post("recv", src, posted)
            self.posted[src] += 1
            if posted.kind is MessageKind.HEADER:
                self.events.append(Wait((self.ids[posted],)))
        if message not in self.ids:
            raise P2POrderError(f"rank {self.rank} needs {message!r}, which no link to it carries")
        self.events.append(Wait((self.ids[message],)))

    def _post(self, kind: str, peer: int, message: Message) -> None:
        op = Op(len(self.events), kind, peer, _link_name(*((self.rank, peer) if kind == "send" else (peer, self.rank))),
                self.nbytes(message), "float32", repr(message))
        self.ids[message] = op.id
        if kind == "send":
            self.sends.append(op.id)
        self.events.append(op)


def _link_name(src: int, dst: int) -> str:
    return f"{src}>{dst}"


# -- traces written by running engines ---------------------------------------------------------------------
def events_from_json(items: Sequence[dict[str, Any]]) -> list[Event]:
    """Events as the trace files hold them (``{"op": ...}`` or ``{"wait": [...]}``)."""
    events: list[Event] = []
    for item in items:
        if "wait" in item:
            events.append(Wait(tuple(item["wait"])))
        else:
            events.append(Op(item["id"], item["op"], item["peer"], item["group"], item["bytes"], item["dtype"],
                             item.get("what"), item.get("batch")))
    return events


@dataclass(frozen=True)
class CheckSummary:
    """What :func:`check_trace_dir` replayed."""

    runs: int
    steps: int
    """Steps replayed (every rank of the run completed them)."""
    skipped: int
    """Steps some rank did not complete (a job that ended mid-step): not replayed."""
    transfers: int


def check_trace_dir(directory: str | Path) -> CheckSummary:
    """Replays every complete step of every engine run traced in ``directory`` under NCCL's rules.

    Raises:
        P2POrderError: For the first step that deadlocks or mismatches, naming the run and the step.
    """
    runs: dict[str, dict[int, dict[int, list[Event]]]] = {}
    worlds: dict[str, int] = {}
    for path in sorted(Path(directory).glob("*.jsonl")):
        run = path.name.split(".rank")[0]
        for line in path.read_text().splitlines():
            if not line.strip():
                continue  # a rank killed while writing leaves at most a partial last line: that step is skipped
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            worlds[run] = record["world"]
            runs.setdefault(run, {}).setdefault(record["step"], {})[record["rank"]] = events_from_json(
                record["events"]
            )
    steps = skipped = transfers = 0
    for run, by_step in runs.items():
        for step, traces in sorted(by_step.items()):
            if len(traces) < worlds[run]:
                skipped += 1
                continue
            try:
                transfers += replay(traces)
            except P2POrderError as err:
                raise P2POrderError(f"run {run}, step {step}: {err}") from None
            steps += 1
    return CheckSummary(runs=len(runs), steps=steps, skipped=skipped, transfers=transfers)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: replay a trace directory; exit 1 on a violation.

    ``python -m lightning_varuna.pipeline.scheduling.nccl_replay DIR``.
    """
    parser = argparse.ArgumentParser(prog="python -m lightning_varuna.pipeline.scheduling.nccl_replay",
                                     description="Replays a trace directory's p2p ops under NCCL's matching rules.")
    parser.add_argument("trace_dir", metavar="TRACE_DIR", help="the directory of LIGHTNING_VARUNA_P2P_TRACE")
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # a usage error (2, the usage printed) or --help (0): returned, as the other exits
        return stop.code if isinstance(stop.code, int) else 2
    try:
        summary = check_trace_dir(args.trace_dir)
    except P2POrderError as err:
        print(err, file=sys.stderr)
        return 1
    print(f"{summary.steps} step(s) of {summary.runs} run(s) pass NCCL's rules ({summary.transfers} transfers;"
          f" {summary.skipped} incomplete step(s) skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
