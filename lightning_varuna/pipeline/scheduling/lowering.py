"""The message order of a step: which messages each link carries, in which order, derived from the schedule alone.

A *link* is one direction of one pipeline edge between two ranks: a process group of its own, on which one rank
only sends and the other only receives (:meth:`~lightning_varuna.pipeline.topology.Topology.link_group`). Under
NCCL's rules (tags ignored; one stream per pair of ranks and communicator, shared by both directions; messages
matched by order) a link is therefore a single first-in-first-out queue: the k-th send fills the k-th receive,
and a receive posted early can only hold up later receives on the same link, never a send.

:func:`link_messages` lowers a schedule to the message sequence of every link. It walks each rank's task list in
order, as the sending rank runs it:

- ``F`` of stage ``s`` (not the last) sends the activation ``act k@s`` to the rank of stage ``s+1``, preceded by
  ``header@s`` (shape and dtype of the step's activations) before the first activation of the step;
- ``B`` or ``I`` (input-gradient backward) of stage ``s > 0`` sends ``grad k@s`` to the rank of stage ``s-1``;
- ``R`` and ``W`` (weight-gradient backward) send nothing;
- nothing crosses a *local* edge, between two stages of one rank (stages ``P - 1`` and ``P`` in the V-shaped
  placement): the activation and its gradient are handed over in memory, and no link carries them;
- with a summary, the last stage's losses and logs travel from its rank to every other, rank by rank
  (:func:`summary_path`: towards the first rank, or with the last stage on rank 0, V-shaped, towards the last),
  behind everything else on each link.

Both sides of a link derive the same sequence from the same schedule, so the receiver posts its receives in the
sender's order even where it consumes them in another (several stages per rank). The run-time rules
(:func:`~lightning_varuna.pipeline.scheduling.run_time_rules.next_task`) only move forwards ahead of recomputes and
backwards, which send on other links, so they never reorder a link's messages.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_varuna.pipeline.scheduling.schedules import Kind, ScheduleError, Task

__all__ = [
    "Link", "Message", "MessageKind", "RankMessages", "link_messages", "rank_messages", "stage_of", "summary_path",
]

Link = tuple[int, int]
"""A link as ``(sending rank, receiving rank)``, ranks counted inside one pipeline."""


class MessageKind(str, enum.Enum):
    """What a message carries."""

    HEADER = "header"
    """Shape and dtype of a stage's activations in this step (fixed size)."""
    ACTIVATION = "act"
    GRADIENT = "grad"
    """The gradient of a stage's input (travels to the stage before it)."""
    SUMMARY = "summary"
    """The last stage's step summary (fixed size), passed on rank by rank towards the first."""


@dataclass(frozen=True)
class Message:
    """One message of a step: its kind, the stage that sends it, and its micro-batch (None for header, summary).

    For a summary ``stage`` is the sending rank (the same as its stage with one stage per rank).
    """

    kind: MessageKind
    stage: int
    microbatch: int | None = None

    def __repr__(self) -> str:
        number = "" if self.microbatch is None else f" {self.microbatch}"
        return f"{self.kind.value}{number}@{self.stage}"


@dataclass(frozen=True)
class RankMessages:
    """The messages one rank receives and sends in a step, per peer rank, in link order."""

    rank: int
    inbound: dict[int, tuple[Message, ...]]
    """By sending rank."""
    outbound: dict[int, tuple[Message, ...]]
    """By receiving rank."""


def stage_of(task: Task, rank: int) -> int:
    """The stage ``task`` runs on: its own ``stage``, or the rank's (one stage per rank)."""
    return rank if task.stage is None else task.stage


def summary_path(num_ranks: int, source: int) -> tuple[Link, ...]:
    """The links the step summary takes from ``source`` (the rank of the last stage: ``P - 1`` or 0), in order."""
    if source == 0:
        return tuple((rank, rank + 1) for rank in range(num_ranks - 1))
    if source != num_ranks - 1:
        raise ScheduleError(f"the last stage runs on rank {source}: the summary starts at the first or the last rank")
    return tuple((rank, rank - 1) for rank in range(num_ranks - 1, 0, -1))


def link_messages(
    schedule: Sequence[Sequence[Task]], stage_ranks: Sequence[int] | None = None, summary: bool = False
) -> dict[Link, tuple[Message, ...]]:
    """Lowers a schedule to the ordered messages of every link (a pure function of its arguments).

    Args:
        schedule: Per rank, its task list in the order it runs.
        stage_ranks: The rank of each stage (default: stage ``s`` on rank ``s``). Interleaved schedules place
            stage ``s`` on rank ``s % P``; ``"zero-bubble-v"`` places stages ``r`` and ``2 P - 1 - r`` on rank ``r``.
        summary: Whether the step ends with the summary travelling from the last rank to the first.

    Returns:
        For each link that carries anything, its messages in sending order (never a rank's link to itself).

    Raises:
        ScheduleError: For a task whose stage does not live on the rank that lists it.
    """
    ranks = tuple(range(len(schedule))) if stage_ranks is None else tuple(stage_ranks)
    last = len(ranks) - 1
    links: dict[Link, list[Message]] = {}
    for rank, tasks in enumerate(schedule):
        headers: set[int] = set()
        for task in tasks:
            stage = stage_of(task, rank)
            if not 0 <= stage <= last or ranks[stage] != rank:
                raise ScheduleError(f"rank {rank} lists {task!r}, but stage {stage} does not run on rank {rank}")
            if task.kind is Kind.F and stage < last and ranks[stage + 1] != rank:
                queue = links.setdefault((rank, ranks[stage + 1]), [])
                if stage not in headers:
                    headers.add(stage)
                    queue.append(Message(MessageKind.HEADER, stage))
                queue.append(Message(MessageKind.ACTIVATION, stage, task.microbatch))
            elif task.kind in (Kind.B, Kind.I) and stage > 0 and ranks[stage - 1] != rank:
                links.setdefault((rank, ranks[stage - 1]), []).append(
                    Message(MessageKind.GRADIENT, stage, task.microbatch)
                )
    if summary:
        for rank, towards in summary_path(len(schedule), ranks[last]):
            links.setdefault((rank, towards), []).append(Message(MessageKind.SUMMARY, rank))
    return {link: tuple(messages) for link, messages in links.items()}


def rank_messages(links: dict[Link, tuple[Message, ...]], rank: int) -> RankMessages:
    """The part of :func:`link_messages`'s result that ``rank`` takes part in."""
    return RankMessages(
        rank=rank,
        inbound={src: messages for (src, dst), messages in links.items() if dst == rank},
        outbound={dst: messages for (src, dst), messages in links.items() if src == rank},
    )
