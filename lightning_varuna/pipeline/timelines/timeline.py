"""Timelines of pipeline steps: what each stage did when, as a Chrome trace, and per-step metrics.

A timeline is a list of :class:`TimelineEvent` (a stage's task, a wait for a message, a send, the gradient sync,
the optimizer step), predicted by the planner (:func:`predicted_events`) or recorded while training
(:class:`TimelineRecorder`, a recorder of the executor's event hook, :mod:`~lightning_varuna.pipeline.comm.events`).
:func:`chrome_trace` gives the JSON that ``chrome://tracing`` and Perfetto (ui.perfetto.dev) open, one process per
replica and a track per stage (sends and gradient sync on tracks of their own, since they overlap the tasks);
:func:`~lightning_varuna.pipeline.timelines.picture.render_png` draws them (matplotlib); :func:`step_metrics` gives
the bubble fraction and each stage's busy time.

The bubble fraction of a step is ``1 - sum(busy) / (P * span)``: busy is a stage's time in forward, recompute and
backward tasks less the waits for messages inside them, and span runs from the first task's start to the last
task's end over all stages (the planner's bubble, :attr:`~lightning_varuna.pipeline.planning.search.Candidate.bubble`,
is the same quantity predicted).
"""

from __future__ import annotations

import bisect
import json
import os
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_varuna.pipeline.comm.events import Event, EventKind, PostedOp
from lightning_varuna.pipeline.planning.search import Prediction

__all__ = ["COLORS", "KINDS", "StepSpan", "TimelineEvent", "TimelineRecorder", "chrome_trace", "pipeline_metrics",
           "predicted_events", "step_metrics", "step_span", "write_chrome_trace"]

KINDS: tuple[str, ...] = ("F", "R", "B", "wait", "send", "sync", "optimizer")
"""Forward, recompute and backward of a micro-batch; a wait for a message; a send; the gradient sync; the
optimizer step."""
TASKS = frozenset({"F", "R", "B"})
_TRACKS = {"send": 1000, "sync": 2000}  # Chrome trace thread offsets of the kinds that overlap tasks
Color = tuple[int, int, int]
COLORS: dict[str, Color] = {
    "F": (66, 133, 244), "R": (251, 188, 5), "B": (52, 168, 83), "wait": (225, 225, 225),
    "send": (156, 39, 176), "sync": (234, 67, 53), "optimizer": (110, 110, 110),
}


@dataclass(frozen=True)
class TimelineEvent:
    """One span of one stage's work.

    Attributes:
        stage: The pipeline stage.
        kind: One of :data:`KINDS`.
        start: Seconds, on a clock common to the timeline.
        end: Seconds (``end >= start``).
        microbatch: The micro-batch of a task, wait or send.
        replica: The data-parallel replica.
        step: The training step the event belongs to.
        chunk: With several model chunks per rank, the model stage of a task (``stage`` is then the rank's position in
            the pipeline).
    """

    stage: int
    kind: str
    start: float
    end: float
    microbatch: int | None = None
    replica: int = 0
    step: int = 0
    chunk: int | None = None

    @property
    def name(self) -> str:
        """``F3`` for a task (``F3@5`` on stage 5 of several per rank), else the kind (with the micro-batch, if any)."""
        if self.microbatch is None:
            return self.kind
        if self.kind not in TASKS:
            return f"{self.kind} {self.microbatch}"
        return f"{self.kind}{self.microbatch}" + (f"@{self.chunk}" if self.chunk is not None else "")


def predicted_events(prediction: Prediction) -> list[TimelineEvent]:
    """The planner's predicted step as events: tasks, the waits between them, gradient sync, optimizer step."""
    events = []
    sim = prediction.schedule
    for stage, (order, starts) in enumerate(zip(sim.order, sim.start_times, strict=True)):
        clock = 0.0
        for task, start in zip(order, starts, strict=True):
            if start > clock:
                events.append(TimelineEvent(stage, "wait", clock, start))
            end = start + prediction.costs[stage if task.stage is None else task.stage].cost(task.kind)
            events.append(TimelineEvent(stage, task.kind.value, start, end, task.microbatch))
            clock = end
        for kind, (start, end) in (("sync", prediction.sync[stage]), ("optimizer", prediction.optimizer[stage])):
            if end > start:
                events.append(TimelineEvent(stage, kind, start, end))
    return events


def chrome_trace(events: Iterable[TimelineEvent], title: str = "pipeline") -> dict[str, Any]:
    """A Chrome trace (JSON object format): one process per replica, one thread per stage, times in microseconds.

    Args:
        events: The events (any clock: times are shifted so that the earliest starts at 0).
        title: Prefix of the process names (``"<title> replica 0"``).
    """
    events = list(events)
    origin = min((e.start for e in events), default=0.0)
    trace: list[dict[str, Any]] = []
    for replica, track in sorted({(e.replica, _track(e)) for e in events}):
        stage, extra = track % 1000, next((k for k, v in _TRACKS.items() if v == track - track % 1000), "")
        trace.append({"ph": "M", "name": "thread_name", "pid": replica, "tid": track,
                      "args": {"name": f"stage {stage} {extra}".strip()}})
        trace.append({"ph": "M", "name": "thread_sort_index", "pid": replica, "tid": track,
                      "args": {"sort_index": stage * 3 + track // 1000}})
    for replica in sorted({e.replica for e in events}):
        name = f"{title} replica {replica}"
        trace.append({"ph": "M", "name": "process_name", "pid": replica, "args": {"name": name}})
    for e in sorted(events, key=lambda e: (e.start, e.replica, e.stage)):
        args: dict[str, Any] = {"step": e.step}
        if e.microbatch is not None:
            args["microbatch"] = e.microbatch
        if e.chunk is not None:
            args["model_stage"] = e.chunk
        trace.append({"name": e.name, "cat": e.kind, "ph": "X", "ts": round((e.start - origin) * 1e6, 3),
                      "dur": round(max(0.0, e.end - e.start) * 1e6, 3), "pid": e.replica, "tid": _track(e),
                      "args": args})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def _track(event: TimelineEvent) -> int:
    """The Chrome trace thread of an event: the stage's, or one of its own for kinds that overlap tasks."""
    return _TRACKS.get(event.kind, 0) + event.stage


def write_chrome_trace(path: str | os.PathLike[str], events: Iterable[TimelineEvent], title: str = "pipeline") -> None:
    """Writes :func:`chrome_trace` to ``path`` (open it in ui.perfetto.dev or chrome://tracing)."""
    Path(path).write_text(json.dumps(chrome_trace(events, title)))


StepSpan = tuple[float, float, float]
"""One stage's step: ``(first task's start, last task's end, busy seconds)``."""


def step_span(events: Iterable[TimelineEvent]) -> StepSpan | None:
    """One stage's step from its events (tasks, and waits inside them); None without tasks."""
    tasks = sorted((e for e in events if e.kind in TASKS), key=lambda e: e.start)
    if not tasks:
        return None
    starts = [t.start for t in tasks]
    busy = sum(e.end - e.start for e in tasks)
    for wait in (e for e in events if e.kind == "wait"):
        # a recorded task includes its wait for the message it needs (a predicted wait lies between tasks)
        index = bisect.bisect_right(starts, wait.start) - 1
        if index >= 0 and wait.end <= tasks[index].end:
            busy -= wait.end - wait.start
    return tasks[0].start, max(e.end for e in tasks), max(0.0, busy)


def pipeline_metrics(spans: Sequence[Sequence[StepSpan]]) -> dict[str, float]:
    """Bubble fraction and busy time per stage, averaged over steps.

    Args:
        spans: Per stage, one :data:`StepSpan` per step (the same steps on every stage).

    Returns:
        ``{"pipeline/bubble": ..., "pipeline/busy_s/stage_<s>": ...}`` (busy: mean seconds per step).
    """
    stages = len(spans)
    steps = min((len(s) for s in spans), default=0)
    if stages == 0 or steps == 0:
        return {}
    bubbles = []
    for j in range(steps):
        span = max(s[j][1] for s in spans) - min(s[j][0] for s in spans)
        busy = sum(s[j][2] for s in spans)
        bubbles.append(1.0 - busy / (stages * span) if span > 0 else 0.0)
    metrics = {"pipeline/bubble": sum(bubbles) / steps}
    metrics.update({f"pipeline/busy_s/stage_{i}": sum(x[2] for x in s[:steps]) / steps for i, s in enumerate(spans)})
    return metrics


def step_metrics(events: Iterable[TimelineEvent], num_stages: int) -> dict[str, float]:
    """:func:`pipeline_metrics` of one replica's events (grouped by stage and step)."""
    grouped: dict[tuple[int, int], list[TimelineEvent]] = {}
    for e in events:
        grouped.setdefault((e.stage, e.step), []).append(e)
    steps = sorted({step for _, step in grouped})
    spans = [[span for step in steps if (span := step_span(grouped.get((s, step), []))) is not None]
             for s in range(num_stages)]
    return pipeline_metrics(spans)


class TimelineRecorder:
    """One rank's timeline, step by step: the executor's events, the gradient sync and the optimizer step.

    Times are ``time.perf_counter`` seconds moved onto the wall clock (``time.time``), so that the ranks of a
    machine share a clock (those of several machines, up to the machines' clock synchronisation).

    Args:
        stage: This rank's stage.
        replica: This rank's replica.
        keep: How many of the latest steps' events to keep (for :meth:`events`).
    """

    def __init__(self, stage: int, replica: int, keep: int = 4) -> None:
        self.stage, self.replica = stage, replica
        self.offset = time.time() - time.perf_counter()
        self.step = -1
        self._current: list[TimelineEvent] = []
        self._kept: deque[list[TimelineEvent]] = deque(maxlen=keep)
        self._spans: list[StepSpan] = []
        self._recording = False
        self._started: dict[tuple[str, int], float] = {}

    def __call__(self, event: Event) -> None:
        """The executor's event hook: a training step's tasks, waits for messages and sends become spans."""
        kind = event.kind
        if kind is EventKind.STEP_START:
            self._recording = event.train
            self._started.clear()
            if event.train:
                self.begin_step()
        elif not self._recording:
            return
        elif kind is EventKind.TASK_START:
            self._started[("task", 0)] = event.time
        elif kind is EventKind.TASK_END and event.task is not None:
            start = self._started.pop(("task", 0), event.time)
            self.add(event.task.kind.value, start, event.time, event.task.microbatch, event.task.stage)
        elif event.op is not None:
            self._transfer(kind, event.time, event.op)

    def _transfer(self, kind: EventKind, now: float, op: PostedOp) -> None:
        if kind is EventKind.WAIT_START:
            self._started[("wait", op.id)] = now
        elif kind is EventKind.WAIT_END and ("wait", op.id) in self._started:
            self.add("wait", self._started.pop(("wait", op.id)), now, op.message.microbatch)
        elif kind is EventKind.POST and op.kind == "send":
            self._started[("send", op.id)] = now
        elif kind is EventKind.DONE and ("send", op.id) in self._started:
            self.add("send", self._started.pop(("send", op.id)), now, op.message.microbatch)

    def begin_step(self) -> None:
        """Starts the next training step (the previous one is complete)."""
        self._close()
        self.step += 1

    def add(self, kind: str, start: float, end: float, microbatch: int | None = None, chunk: int | None = None) -> None:
        """Records an event of the current step (``time.perf_counter`` times)."""
        self._current.append(TimelineEvent(self.stage, kind, start + self.offset, end + self.offset, microbatch,
                                           self.replica, self.step, chunk))

    def take_spans(self) -> list[StepSpan]:
        """This stage's span of every step finished since the last call (the current one counts as finished)."""
        self._close()
        spans, self._spans = self._spans, []
        return spans

    def events(self) -> list[TimelineEvent]:
        """The kept steps' events and the current step's."""
        return [e for step in self._kept for e in step] + list(self._current)

    def _close(self) -> None:
        if self._current:
            span = step_span(self._current)
            if span is not None:
                self._spans.append(span)
            self._kept.append(self._current)
            self._current = []


