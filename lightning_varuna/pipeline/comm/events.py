"""The executor's event hook: what ran, when, and what was posted, for tests, benchmarks, checks and timelines.

The executor and its p2p layer report :class:`Event` objects to the recorders added to an :class:`EventHooks`
(``engine.events``). With no recorder the hook is off and costs one ``None`` check per task and transfer; no
event is built. Recorders here:

- :class:`StageCounters`: autograd graphs and stashed inputs held (and their peaks), bytes sent, tasks moved by the
  run-time rules, the last step's executed order;
- :class:`EventLog`: every event, in order (timelines);
- :class:`P2PTraceWriter`: each completed step's posted ops and host waits, one JSON line per step, for
  :func:`~lightning_varuna.pipeline.scheduling.nccl_replay.check_trace_dir` (the NCCL-rules mode: the engine adds one
  when :data:`P2P_TRACE_ENV` names a directory).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lightning_varuna.pipeline.scheduling.lowering import Message
from lightning_varuna.pipeline.scheduling.schedules import Task

__all__ = [
    "P2P_TRACE_ENV", "Event", "EventHooks", "EventKind", "EventLog", "P2PTraceWriter", "PostedOp", "Recorder",
    "StageCounters",
]

P2P_TRACE_ENV = "LIGHTNING_VARUNA_P2P_TRACE"
"""Environment variable: a directory where every engine writes its p2p trace (the NCCL-rules mode)."""


class EventKind(str, enum.Enum):
    """What an :class:`Event` reports."""

    STEP_START = "step_start"
    STEP_END = "step_end"
    """The step completed (every transfer done); a failed step has no end."""
    TASK_START = "task_start"
    TASK_END = "task_end"
    POST = "post"
    """A send or receive was posted (in the order the stage posts them on each link)."""
    WAIT_START = "wait_start"
    """The stage's thread starts waiting for a transfer."""
    WAIT_END = "wait_end"
    DONE = "done"
    """The stage learnt that a transfer completed (by a wait or a poll)."""


@dataclass(frozen=True, slots=True)
class PostedOp:
    """A posted send or receive."""

    id: int
    kind: str
    """``"send"`` or ``"recv"``."""
    peer: int
    """The other rank (global)."""
    group: str
    """The link's name, ``"<src>><dst>"`` (global ranks)."""
    nbytes: int
    dtype: torch.dtype
    message: Message


@dataclass(frozen=True, slots=True)
class Event:
    """One thing the executor did. Fields that do not apply to ``kind`` keep their defaults."""

    kind: EventKind
    time: float
    """``time.perf_counter()`` when it happened."""
    task: Task | None = None
    op: PostedOp | None = None
    moved: bool = False
    """TASK_START: a run-time rule ran this task ahead of its place in the list."""
    graphs: int = 0
    """TASK_END: autograd graphs the task left held (+1) or released (-1)."""
    stash_bytes: int = 0
    """TASK_END: bytes of stashed stage input the task kept (+) or released (-)."""
    train: bool = False
    """STEP_START: a training step (else forward only)."""
    microbatches: int = 0
    """STEP_START: micro-batches in the step."""


Recorder = Callable[[Event], None]


class EventHooks:
    """The recorders that see the executor's events; :attr:`emit` is None while there are none."""

    def __init__(self) -> None:
        self._recorders: list[Recorder] = []
        self.emit: Recorder | None = None

    def add(self, recorder: Recorder) -> Recorder:
        """Adds ``recorder`` (any callable taking an :class:`Event`) and returns it."""
        self._recorders.append(recorder)
        self._update()
        return recorder

    @property
    def recorders(self) -> tuple[Recorder, ...]:
        """The recorders, in the order they were added."""
        return tuple(self._recorders)

    def remove(self, recorder: Recorder) -> None:
        """Removes ``recorder``."""
        self._recorders.remove(recorder)
        self._update()

    def _update(self) -> None:
        recorders = tuple(self._recorders)
        if not recorders:
            self.emit = None
        elif len(recorders) == 1:
            self.emit = recorders[0]
        else:
            def emit(event: Event) -> None:
                for recorder in recorders:
                    recorder(event)

            self.emit = emit


@dataclass
class StageCounters:
    """Counters kept from a stage's events: memory held, bytes sent, run-time moves, the last executed order."""

    live_graphs: int = 0
    peak_live_graphs: int = 0
    stash_bytes: int = 0
    peak_stash_bytes: int = 0
    sent_bytes: int = 0
    """Bytes this stage has sent to its neighbours (activations, gradients, headers, summaries), all steps."""
    moves: int = 0
    """Tasks the run-time rules ran ahead of their place in the list, all steps."""
    executed: list[Task] = field(default_factory=list)
    """The last step's tasks, in the order they ran."""

    def __call__(self, event: Event) -> None:
        """Counts ``event``."""
        kind = event.kind
        if kind is EventKind.TASK_END:
            self.live_graphs += event.graphs
            self.peak_live_graphs = max(self.peak_live_graphs, self.live_graphs)
            self.stash_bytes += event.stash_bytes
            self.peak_stash_bytes = max(self.peak_stash_bytes, self.stash_bytes)
        elif kind is EventKind.TASK_START:
            assert event.task is not None  # a task's start names it
            self.executed.append(event.task)
            self.moves += event.moved
        elif kind is EventKind.POST and event.op is not None and event.op.kind == "send":
            self.sent_bytes += event.op.nbytes
        elif kind is EventKind.STEP_START:
            self.executed = []

    def memory(self) -> dict[str, int]:
        """The memory and traffic counters as a plain dict."""
        return {name: getattr(self, name) for name in
                ("live_graphs", "peak_live_graphs", "stash_bytes", "peak_stash_bytes", "sent_bytes", "moves")}


@dataclass
class EventLog:
    """Keeps every event, in order."""

    events: list[Event] = field(default_factory=list)

    def __call__(self, event: Event) -> None:
        """Keeps ``event``."""
        self.events.append(event)


class P2PTraceWriter:
    """Appends each completed step's posted ops and host waits to ``<directory>/<run>.rank<rank>.jsonl``.

    One JSON line per step that completed on this rank, numbered by the steps started (the same on every rank);
    :func:`~lightning_varuna.pipeline.scheduling.nccl_replay.check_trace_dir` replays the steps every rank completed.

    Args:
        directory: Where the trace files go (created if missing).
        run: Identifies the engine run; the same on every rank (the engine broadcasts rank 0's).
        rank: This global rank.
        world: The number of ranks of the run.
    """

    def __init__(self, directory: str | Path, run: str, rank: int, world: int) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{run}.rank{rank}.jsonl"
        self.rank, self.world = rank, world
        self.step = -1
        self.ops: list[dict[str, object]] = []

    def __call__(self, event: Event) -> None:
        """Records posts and waits; writes the step's line when it ends."""
        kind = event.kind
        if kind is EventKind.POST and event.op is not None:
            op = event.op
            self.ops.append({"op": op.kind, "id": op.id, "peer": op.peer, "group": op.group, "bytes": op.nbytes,
                             "dtype": str(op.dtype).removeprefix("torch."), "what": repr(op.message)})
        elif kind is EventKind.WAIT_START and event.op is not None:
            self.ops.append({"wait": [event.op.id]})
        elif kind is EventKind.STEP_START:
            self.step += 1
            self.ops = []
        elif kind is EventKind.STEP_END:
            record = {"step": self.step, "rank": self.rank, "world": self.world, "events": self.ops}
            with self.path.open("a") as file:
                file.write(json.dumps(record) + "\n")
            self.ops = []
