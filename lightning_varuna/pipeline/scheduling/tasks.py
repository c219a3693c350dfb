"""The schedule IR: tasks (one unit of work of one stage on one micro-batch) and schedules (per-stage task lists)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Kind", "Schedule", "ScheduleError", "Task"]


class Kind(str, enum.Enum):
    """The kind of a task.

    ``F`` forward, ``R`` recompute (the forward again, with autograd), ``B`` backward. A split backward (zero-bubble
    schedules) has ``I``, the input-gradient part that sends the gradient to the previous stage, and ``W``, the
    weight-gradient part that communicates nothing; the executor runs ``F``, ``R`` and ``B`` today, and the p2p
    message order (:mod:`~lightning_varuna.pipeline.scheduling.lowering`) already lowers ``I`` and ``W``.
    """

    F = "F"
    R = "R"
    B = "B"
    I = "I"  # noqa: E741 - the name zero-bubble schedules use
    W = "W"


@dataclass(frozen=True, order=True)
class Task:
    """One unit of work of one stage on one micro-batch.

    ``stage`` is None in the schedules of one stage per rank (the rank's own stage); a rank that runs several
    (virtual, interleaved) stages names the stage of each task.
    """

    kind: Kind
    microbatch: int
    stage: int | None = None

    def __repr__(self) -> str:
        where = "" if self.stage is None else f"@{self.stage}"
        return f"{self.kind.value}{self.microbatch}{where}"


Schedule = tuple[tuple[Task, ...], ...]


class ScheduleError(ValueError):
    """A schedule that cannot run: a missing task, a wrong order or a dependency that is never met."""
