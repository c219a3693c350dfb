"""One step's transfers on the links of one stage, in the order of the step's message order.

:class:`StageLinks` is a stage's part of the message order (its neighbours and each link's messages in order). On each
inbound link an :class:`Inbox` posts receives strictly in the link's order, as soon as each message's shape is
known, so that the run-time rules can ask whether a message is there; on each outbound link an :class:`Outbox`
posts sends in the link's order and refuses anything else. A skipped batch drops its activations and gradients
from both sides' lists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_varuna.failstop.failures import PipelineError
from lightning_varuna.pipeline.comm.events import EventHooks
from lightning_varuna.pipeline.comm.transfers import P2P, Transfer
from lightning_varuna.pipeline.model.cut import CutPoint, StageForward
from lightning_varuna.pipeline.model.data_flow import SideValue
from lightning_varuna.pipeline.scheduling.lowering import Message, MessageKind, link_messages, rank_messages
from lightning_varuna.pipeline.scheduling.schedules import Schedule
from lightning_varuna.pipeline.topology import Topology

__all__ = ["Boxes", "Chunk", "Inbox", "LocalLink", "Outbox", "RankLinks", "Spec", "StageContext", "StageLinks"]

Spec = tuple[torch.Size, torch.dtype]
"""The shape and dtype of a message's buffer."""


@dataclass(frozen=True)
class Chunk:
    """One stage a rank runs: where its forward starts and ends in the model, and what crosses its boundaries."""

    stage: int
    first_cut: int | None
    """The cut point whose output this stage receives (None on the first stage)."""
    last_cut: int | None
    """The cut point where this stage's forward ends (None on the last stage)."""
    input_dtype: torch.dtype | None = None
    """The dtype the model has at ``first_cut`` (received activations are cast back to it)."""
    batch_dims: tuple[int | None, int | None] = (None, None)
    """Which dimension of the received and of the sent activation scales with the batch."""
    params: tuple[Any, ...] = ()
    """The parameters this stage uses (whose gradients its backward makes)."""
    grad_from: int | None = None
    """With recompute by degree: the cut point from which the stage's forward keeps its autograd graph (the segments
    before it run without autograd and are recomputed before the backward); None: the whole stage or nothing."""
    sides_in: tuple[SideValue, ...] = ()
    """The side values received with the activation (:mod:`~lightning_varuna.pipeline.runtime.side_values`)."""
    sides_out: tuple[SideValue, ...] = ()
    """The side values sent with the output: received ones passed on and ones this stage makes."""
    sides_kept: tuple[SideValue, ...] = ()
    """With recompute by degree: the side values this stage makes in its recomputed segments and uses in its kept
    ones (each kept segment takes a leaf of the value, whose gradient the recomputed part's backward continues)."""

    @property
    def first_segment(self) -> int:
        """The first segment of the model this stage runs."""
        return 0 if self.first_cut is None else self.first_cut + 1


@dataclass(frozen=True)
class StageLinks:
    """One stage's part of a step's message order: its neighbours (global ranks) and each link's messages in order."""

    prev: int | None
    next: int | None
    from_prev: tuple[Message, ...]
    from_next: tuple[Message, ...]
    to_prev: tuple[Message, ...]
    to_next: tuple[Message, ...]

    @classmethod
    def build(cls, schedule: Schedule, topology: Topology, summary: bool) -> StageLinks:
        """Lowers ``schedule`` (one stage per rank) and keeps what this rank's stage takes part in.

        A schedule whose tasks name their stages (several per rank) goes to :meth:`RankLinks.build`.
        """
        for tasks in schedule:
            for task in tasks:
                if task.stage is not None:
                    raise PipelineError(f"{task!r} names a stage: schedules of several stages per rank use RankLinks")
        stage = topology.stage
        order = rank_messages(link_messages(schedule, summary=summary), stage)
        prev = stage - 1 if stage > 0 else None
        after = stage + 1 if stage < topology.pipeline_size - 1 else None
        return cls(
            prev=topology.rank_of(prev) if prev is not None else None,
            next=topology.rank_of(after) if after is not None else None,
            from_prev=order.inbound.get(prev, ()) if prev is not None else (),
            from_next=order.inbound.get(after, ()) if after is not None else (),
            to_prev=order.outbound.get(prev, ()) if prev is not None else (),
            to_next=order.outbound.get(after, ()) if after is not None else (),
        )


@dataclass(frozen=True)
class RankLinks:
    """One rank's part of a step's message order when it runs several stages: each link's messages, by peer.

    A link between two ranks carries the messages of every stage pair across it, in the sender's order.
    """

    inbound: dict[int, tuple[Message, ...]]
    outbound: dict[int, tuple[Message, ...]]

    @classmethod
    def build(cls, schedule: Schedule, topology: Topology, summary: bool, stage_ranks: tuple[int, ...]) -> RankLinks:
        """Lowers ``schedule`` (per pipeline rank, tasks naming their stages) and keeps this rank's links."""
        order = rank_messages(link_messages(schedule, stage_ranks, summary=summary), topology.stage)
        return cls(
            inbound={topology.rank_of(peer): messages for peer, messages in order.inbound.items()},
            outbound={topology.rank_of(peer): messages for peer, messages in order.outbound.items()},
        )


@dataclass
class Boxes:
    """The inboxes and outboxes one stage's step uses (shared by the stages of a rank), and the sends in flight."""

    prev: int | None
    next: int | None
    from_prev: Inbox | LocalLink | None
    from_next: Inbox | LocalLink | None
    to_prev: Outbox | LocalLink | None
    to_next: Outbox | LocalLink | None
    sends: list[Transfer]

    @classmethod
    def of_stage(cls, p2p: P2P, rank: int, links: StageLinks, watch: bool,
                 spec: Callable[[Message], Spec | None], buffer: Callable[[Message, torch.Size, torch.dtype], Tensor]
                 ) -> Boxes:
        """The boxes of a rank that runs one stage: one per link of its part of the message order."""
        sends: list[Transfer] = []
        prev, after = links.prev, links.next
        return cls(
            prev=prev, next=after,
            from_prev=Inbox(p2p, prev, rank, links.from_prev, spec, buffer, watch) if prev is not None else None,
            from_next=Inbox(p2p, after, rank, links.from_next, spec, buffer, watch) if after is not None else None,
            to_prev=Outbox(p2p, rank, prev, links.to_prev, sends) if prev is not None else None,
            to_next=Outbox(p2p, rank, after, links.to_next, sends) if after is not None else None,
            sends=sends,
        )


class Inbox:
    """The receives of one inbound link in one step, posted in the link's order.

    Args:
        p2p: The transport.
        src: The sending rank.
        dst: This rank.
        messages: The link's messages, in order.
        spec: The shape and dtype of a message's buffer, or None while not known yet.
        buffer: A buffer for a message of that shape and dtype.
        watch: Whether completions can be asked for (the run-time rules ask).
    """

    def __init__(self, p2p: P2P, src: int, dst: int, messages: tuple[Message, ...],
                 spec: Callable[[Message], Spec | None], buffer: Callable[[Message, torch.Size, torch.dtype], Tensor],
                 watch: bool) -> None:
        self.p2p, self.link, self.messages = p2p, p2p.link(src, dst), messages
        self.position = {message: index for index, message in enumerate(messages)}
        self.spec, self.buffer, self.watch = spec, buffer, watch
        self.transfers: list[Transfer | None] = [None] * len(messages)
        self.posted = 0
        self.taken = 0

    def advance(self) -> None:
        """Posts the receives whose shapes are known, in order, up to the first one that is not."""
        while self.posted < len(self.messages):
            message = self.messages[self.posted]
            spec = self.spec(message)
            if spec is None:
                return
            tensor = self.buffer(message, *spec)
            self.transfers[self.posted] = self.p2p.irecv(tensor, self.link, message, watch=self.watch)
            self.posted += 1

    def arrived(self, message: Message) -> bool:
        """Whether ``message`` is here (or was taken already), without waiting."""
        self.advance()
        index = self.position[message]
        if index >= self.posted:
            return False
        transfer = self.transfers[index]
        return transfer is None or self.p2p.completed(transfer)

    def take(self, message: Message, what: str) -> Tensor:
        """Waits for ``message`` and returns its buffer."""
        self.advance()
        index = self.position[message]
        transfer = self.transfers[index]
        if index >= self.posted or transfer is None:
            raise PipelineError(f"{what}: its receive cannot be posted (its shape is not known) or was taken before.")
        self.p2p.wait(transfer, what)
        self.transfers[index] = None
        self.taken += 1
        return transfer.tensor

    def drop_unposted(self, kinds: tuple[MessageKind, ...]) -> None:
        """Removes the messages of ``kinds`` from the link's messages (a skipped batch); none may be posted yet."""
        if any(m.kind in kinds for m in self.messages[: self.posted]):
            raise PipelineError(f"A message of a skipped batch from rank {self.link.src} was already posted.")
        kept = [i for i, m in enumerate(self.messages) if m.kind not in kinds]
        self.messages = tuple(self.messages[i] for i in kept)
        self.transfers = [self.transfers[i] for i in kept]
        self.position = {message: index for index, message in enumerate(self.messages)}

    def check_complete(self, stage: int) -> None:
        """Raises unless every message of the link was received this step."""
        if self.taken != len(self.messages):
            left = [m for i, m in enumerate(self.messages) if i >= self.posted or self.transfers[i] is not None]
            raise PipelineError(f"Stage {stage} ended its step without receiving {left} from rank {self.link.src}.")


class LocalLink:
    """The messages between two stages of one rank (a local edge, in the V-shaped placement): handed over in memory.

    It stands in for both stages' inbox and outbox on that edge. The activation handed over is the sending stage's
    detached output (a transfer would copy it into the receiver's buffer; a forward that changed its input in place
    would then change the sender's saved output too, which autograd reports at the sender's backward as a tensor
    modified in place); the gradient is the receiving stage's input gradient. Nothing is sent, so nothing is posted.
    """

    def __init__(self) -> None:
        self.held: dict[Message, Tensor] = {}
        self.taken: set[Message] = set()

    def advance(self) -> None:
        """Nothing to post."""

    def arrived(self, message: Message) -> bool:
        """Whether ``message`` was handed over (or taken already)."""
        return message in self.held or message in self.taken

    def take(self, message: Message, what: str) -> Tensor:
        """The tensor handed over as ``message``."""
        if message not in self.held:
            raise PipelineError(f"{what}: the stage on this rank that makes it has not run yet (a schedule runs the"
                                " task that makes a message before the task that takes it, on a local edge too).")
        self.taken.add(message)
        return self.held.pop(message)

    def send(self, message: Message, tensor: Tensor, stage: int) -> None:
        """Hands ``tensor`` over as ``message``."""
        self.held[message] = tensor

    def drop_unposted(self, kinds: tuple[MessageKind, ...]) -> None:
        """Nothing is planned on a local edge (a skipped batch hands nothing over)."""

    def drop_unsent(self, kinds: tuple[MessageKind, ...]) -> None:
        """Nothing is planned on a local edge (a skipped batch hands nothing over)."""

    def check_complete(self, stage: int) -> None:
        """Raises if a message was handed over and never taken this step."""
        if self.held:
            raise PipelineError(f"Stage {stage} ended its step with {sorted(map(repr, self.held))} handed over on this"
                                " rank but never taken.")


class Outbox:
    """The sends of one outbound link in one step: posted only in the link's order."""

    def __init__(self, p2p: P2P, src: int, dst: int, messages: tuple[Message, ...], sends: list[Transfer]) -> None:
        self.p2p, self.link, self.messages, self.sends = p2p, p2p.link(src, dst), messages, sends
        self.sent = 0

    def send(self, message: Message, tensor: Tensor, stage: int) -> None:
        """Posts ``tensor`` as ``message``, which must be the link's next message."""
        expected = self.messages[self.sent] if self.sent < len(self.messages) else None
        if message != expected:
            raise PipelineError(
                f"Stage {stage} would send {message!r} to rank {self.link.dst}, but the step's message order has"
                f" {expected!r} next on that link (messages must keep the message order on every link)."
            )
        self.sends.append(self.p2p.isend(tensor, self.link, message, watch=True))
        self.sent += 1

    def drop_unsent(self, kinds: tuple[MessageKind, ...]) -> None:
        """Removes the messages of ``kinds`` not sent yet from the link's messages (a skipped batch)."""
        self.messages = self.messages[: self.sent] + tuple(m for m in self.messages[self.sent:] if m.kind not in kinds)

    def check_complete(self, stage: int) -> None:
        """Raises unless every message of the link was sent this step."""
        if self.sent != len(self.messages):
            raise PipelineError(
                f"Stage {stage} ended its step without sending {list(self.messages[self.sent:])} to rank"
                f" {self.link.dst}."
            )


class StageContext(Protocol):
    """What a step uses of its stage (:class:`~lightning_varuna.pipeline.runtime.executor.StageExecutor`)."""

    topology: Topology
    p2p: P2P
    events: EventHooks
    cuts: Sequence[CutPoint]
    stage_ranks: tuple[int, ...] | None
    boundary_dtype: torch.dtype | None
    current: StageForward | None
    feed_next_stage: bool
    summary: Tensor | None
    recompute_policy: Any

    def buffer(self, kind: str, k: int, shape: torch.Size, dtype: torch.dtype, stage: int = 0) -> Tensor:
        """A receive buffer, reused across steps."""
        ...

    @property
    def chunks(self) -> Sequence[Chunk]:
        """The stage's chunks, in the order of its forward."""
        ...

    def segment(self) -> int:
        """The segment the running forward runs for real in (-1: none)."""
        ...


def nbytes(tensor: Tensor | None) -> int:
    """The bytes of a tensor's elements (0 for None)."""
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def scaled_shape(shape: torch.Size, dim: int | None, reference: int, size: int) -> torch.Size:
    """``shape`` of a micro-batch of ``reference`` samples, scaled in dimension ``dim`` to ``size`` samples."""
    if dim is None or size == reference:
        return shape
    if shape[dim] % reference:
        raise PipelineError(f"Activation shape {tuple(shape)} does not scale with micro-batch size {reference}.")
    dims = list(shape)
    dims[dim] = shape[dim] // reference * size
    return torch.Size(dims)
