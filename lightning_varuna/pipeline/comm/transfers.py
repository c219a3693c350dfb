"""Point-to-point transfers over links (one direction of one pipeline edge), each wait bounded by a timeout.

Every send or receive names its link (a two-rank process group that carries one direction only, see
:meth:`~lightning_varuna.pipeline.topology.Topology.link_group`) and its message; tags are never used, so messages
match by order, under gloo as under NCCL. What is posted, and in which order on each link, is decided by the
caller (:mod:`~lightning_varuna.pipeline.runtime.stage_step`) and is the same on every backend; gloo only adds helper
threads that post sends and wait for completions (below).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_varuna.failstop.abandon import PeersLost, raise_if_a_death_explains, surviving
from lightning_varuna.failstop.failures import PipelineError, peer_error
from lightning_varuna.failstop.watchdog import Watchdog
from lightning_varuna.pipeline.comm.events import Event, EventHooks, EventKind, PostedOp
from lightning_varuna.pipeline.scheduling.lowering import Message
from lightning_varuna.pipeline.topology import Topology

__all__ = ["HEADER_BYTES", "HEADER_SIZE", "HostStaging", "Link", "P2P", "Transfer", "decode_header",
           "encode_header", "encode_skip_header"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
HEADER_SIZE = 10
"""int64 slots of an activation header: dtype code, number of dimensions, up to 8 sizes."""
HEADER_BYTES = HEADER_SIZE * 8
_SKIP_CODE = -1
"""Dtype code of a header that announces a batch skipped before the model's forward (no activation follows)."""
_WATCH_MARGIN_S = 5.0


def encode_header(tensor: Tensor) -> Tensor:
    """The header describing ``tensor``'s shape and dtype (on ``tensor``'s device).

    Raises:
        PipelineError: For a tensor with more than 8 dimensions or a dtype that cannot cross a stage boundary.
    """
    if tensor.dim() > HEADER_SIZE - 2:
        raise PipelineError(
            f"A cut point tensor has {tensor.dim()} dimensions; at most {HEADER_SIZE - 2} are supported."
        )
    if tensor.dtype not in _DTYPES:
        raise PipelineError(f"A cut point tensor has dtype {tensor.dtype}; supported: {_DTYPES}.")
    values = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
    values += [0] * (HEADER_SIZE - len(values))
    return torch.tensor(values, dtype=torch.int64).to(tensor.device)


def encode_skip_header(device: torch.device, size: int = HEADER_SIZE) -> Tensor:
    """The header that says the sending stage skipped the step's batch before the model's forward.

    Args:
        device: Where the header is made.
        size: Its int64 slots (more than :data:`HEADER_SIZE` when side values travel with the activation).
    """
    return torch.tensor([_SKIP_CODE] + [0] * (size - 1), dtype=torch.int64).to(device)


def decode_header(header: Tensor) -> tuple[torch.Size, torch.dtype] | None:
    """The shape and dtype a header describes, or None for a skipped batch (reads it: call after the receive)."""
    values = header.tolist()
    if values[0] == _SKIP_CODE:
        return None
    return torch.Size(values[2 : 2 + values[1]]), _DTYPES[values[0]]


@dataclass(frozen=True)
class Link:
    """One direction of one pipeline edge: ``src`` only sends on it, ``dst`` only receives."""

    src: int
    dst: int
    group: Any = field(compare=False)
    """The link's process group (None: the default group, for hand-built topologies)."""
    gloo: bool = field(default=True, compare=False)
    """Whether transfers on it run on gloo (completion known only by waiting: see :class:`P2P`)."""

    @property
    def name(self) -> str:
        """``"<src>><dst>"`` in global ranks."""
        return f"{self.src}>{self.dst}"


class Transfer:
    """A posted send or receive of one message.

    Attributes:
        tensor: The tensor sent, or the buffer received into (valid once :meth:`P2P.wait` returned).
        wire: What travels: ``tensor``, or its host copy when the link stages through host memory.
    """

    __slots__ = ("id", "kind", "link", "message", "tensor", "wire", "work", "post", "done", "error", "op")

    def __init__(self, id: int, kind: str, link: Link, message: Message, tensor: Tensor) -> None:
        self.id, self.kind, self.link, self.message = id, kind, link, message
        self.tensor = self.wire = tensor
        self.work: Any = None
        self.post: Callable[[], Any] | None = None
        self.done: threading.Event | None = None
        """Set by the helper thread that watches this transfer (gloo); None for a transfer nobody watches."""
        self.error: BaseException | None = None
        self.op: PostedOp | None = None
        """What the event hook was told (only while a recorder listens)."""

    @property
    def peer(self) -> int:
        """The other rank."""
        return self.link.dst if self.kind == "send" else self.link.src

    def is_completed(self) -> bool:
        """Whether the transfer has finished (successfully or not)."""
        if self.done is not None:
            return self.done.is_set()
        return self.work is not None and self.work.is_completed()


class HostStaging:
    """Host buffers for links whose backend reads host memory only (``p2p_backend="gloo"`` in a CUDA job).

    A send copies the tensor into a host buffer (asynchronously from the device; the copy is waited for just
    before the transfer is posted); a receive lands in a host buffer and is copied to the device tensor when it
    is waited for. Buffers are kept per link and message and reused while shapes stay the same; a receive buffer
    is reused only after its last copy to the device has finished.

    Args:
        pin: Pin the host buffers (needed for asynchronous copies from and to CUDA memory).
    """

    def __init__(self, pin: bool = True) -> None:
        self.pin = pin
        self._buffers: dict[tuple[str, Message], Tensor] = {}
        self._delivered: dict[tuple[str, Message], Any] = {}

    def _host(self, key: tuple[str, Message], like: Tensor) -> Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            buffer = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self.pin)
            self._buffers[key] = buffer
        return buffer

    def outgoing(self, key: tuple[str, Message], tensor: Tensor) -> tuple[Tensor, Any]:
        """A host copy of ``tensor`` being made, and the CUDA event to wait for before sending it (or None)."""
        host = self._host(key, tensor)
        host.copy_(tensor, non_blocking=tensor.is_cuda)
        return host, _recorded_event(tensor)

    def incoming(self, key: tuple[str, Message], tensor: Tensor) -> Tensor:
        """The host buffer a receive for ``tensor`` lands in (free: its previous copy to the device is done)."""
        previous = self._delivered.pop(key, None)
        if previous is not None:
            previous.synchronize()
        return self._host(key, tensor)

    def deliver(self, key: tuple[str, Message], host: Tensor, tensor: Tensor) -> None:
        """Copies a completed receive from ``host`` into ``tensor`` (stream-ordered on CUDA)."""
        tensor.copy_(host, non_blocking=tensor.is_cuda)
        event = _recorded_event(tensor)
        if event is not None:
            self._delivered[key] = event


def _recorded_event(tensor: Tensor) -> Any:
    if not tensor.is_cuda:
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event.__init__ unannotated
    event.record()
    return event


class _Watcher:
    """A daemon thread that posts and waits on one link's transfers in the order they were handed to it (gloo).

    On gloo ``Work.is_completed()`` stays false until someone waits on the work, so the transfers whose completion
    the executor asks for are waited on here, and their :class:`Transfer` reports ``done`` (Varuna's rule asks which
    messages are there; finished sends free their tensors). A send is also *posted* here: gloo writes the message
    into the socket in the thread that posts it, which would otherwise delay the stage's next task. Sends of one
    link are posted in the order the executor handed them over, so the order on the link is the executor's.

    It lives for one step: no thread outlives the transfers it watches (a thread still inside a gloo wait when the
    interpreter exits can abort the process). After a failure every later transfer fails with it.
    """

    def __init__(self, name: str, timeout: timedelta) -> None:
        self.timeout = timeout
        self.queue: queue.SimpleQueue[Transfer | None] = queue.SimpleQueue()
        self.failed: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def watch(self, transfer: Transfer) -> None:
        transfer.done = threading.Event()
        self.queue.put(transfer)

    def close(self, join: bool) -> None:
        if not join:  # after a failure: sends still queued are not posted
            self.failed = self.failed or PipelineError("the step failed before this transfer was posted")
        self.queue.put(None)
        if join:
            self.thread.join(timeout=_WATCH_MARGIN_S)

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            if self.failed is None:
                try:
                    if item.work is None:
                        post = item.post
                        assert post is not None  # a transfer posted by this thread brings its post
                        item.work, item.post = post(), None
                    item.work.wait(timeout=self.timeout)
                except BaseException as err:  # noqa: BLE001 - handed to the thread that waits on the transfer
                    self.failed = err
            item.error = self.failed
            assert item.done is not None  # set for every transfer handed to this thread
            item.done.set()


def _wait_unless_lost(transfer: Transfer, seconds: float, what: str, watchdog: Watchdog) -> None:
    """Waits for a watched gloo transfer (its helper thread waits inside gloo), giving up once a peer died."""
    assert transfer.done is not None  # a survivor's gloo transfers are all watched (isend, irecv)
    deadline = time.monotonic() + seconds
    pause = 5e-5
    while not transfer.done.wait(pause):
        if watchdog.lost.is_set():
            raise PeersLost(watchdog.dead, f"{what} from/to rank {transfer.peer}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"Timed out after {seconds:g}s waiting for the transfer")
        pause = min(2 * pause, 0.005)
    if transfer.error is not None:
        raise transfer.error


class P2P:
    """Asynchronous sends and receives over links, each wait bounded by a timeout.

    With ``watch=True`` a transfer's completion can be asked for without waiting (:meth:`completed`). NCCL works
    report it by themselves. On gloo a helper thread per link waits on the link's watched transfers, for the step
    (the wait releases the GIL), and posts its watched sends. On CUDA with NCCL every transfer is posted from the
    calling thread, in the caller's order.

    Args:
        topology: Where this rank sits, with its link groups.
        timeout: Seconds a wait may take before it fails naming the peer.
        events: The executor's event hook (posts, waits, completions).
        staging: Host staging for links that cannot read device memory (gloo links in a CUDA job).
    """

    def __init__(self, topology: Topology, timeout: float, events: EventHooks | None = None,
                 staging: HostStaging | None = None) -> None:
        self.topology = topology
        self.timeout = timedelta(seconds=timeout)
        self.events = events or EventHooks()
        self.staging = staging
        self._links: dict[tuple[int, int], Link] = {}
        self._watchers: dict[str, _Watcher] = {}
        self._next_id = 0

    def link(self, src: int, dst: int) -> Link:
        """The link from global rank ``src`` to ``dst`` (this rank is one of them)."""
        link = self._links.get((src, dst))
        if link is None:
            group = self.topology.link_group(src, dst)
            gloo = self.topology.device.type == "cpu" or dist.get_backend(group) == "gloo"
            link = self._links[(src, dst)] = Link(src, dst, group, gloo)
        return link

    def isend(self, tensor: Tensor, link: Link, message: Message, watch: bool = False) -> Transfer:
        """Starts sending ``tensor`` (it must not change until the send is done)."""
        transfer = self._transfer("send", link, message, tensor)
        ready = None
        if self.staging is not None:
            transfer.wire, ready = self.staging.outgoing((link.name, message), tensor)
        self._posted(transfer)
        wire, dst, group = transfer.wire, link.dst, link.group

        def post() -> Any:
            if ready is not None:
                ready.synchronize()
            return dist.isend(wire, dst=dst, group=group)

        if (watch or surviving() is not None) and link.gloo:  # a survivor never waits inside gloo itself
            transfer.post = post
            self._watcher(link).watch(transfer)
            return transfer
        try:
            transfer.work = post()
        except Exception as err:  # noqa: BLE001 - a peer that is already gone fails here, not in wait
            raise self._error(f"sending {message!r} to rank {dst}", err) from err
        return transfer

    def irecv(self, tensor: Tensor, link: Link, message: Message, watch: bool = False) -> Transfer:
        """Starts receiving into ``tensor`` (read it only after :meth:`wait`)."""
        transfer = self._transfer("recv", link, message, tensor)
        if self.staging is not None:
            transfer.wire = self.staging.incoming((link.name, message), tensor)
        self._posted(transfer)
        try:
            transfer.work = dist.irecv(transfer.wire, src=link.src, group=link.group)
        except Exception as err:  # noqa: BLE001 - a peer that is already gone fails here, not in wait
            raise self._error(f"receiving {message!r} from rank {link.src}", err) from err
        if (watch or surviving() is not None) and link.gloo:
            self._watcher(link).watch(transfer)
        return transfer

    def _transfer(self, kind: str, link: Link, message: Message, tensor: Tensor) -> Transfer:
        transfer = Transfer(self._next_id, kind, link, message, tensor)
        self._next_id += 1
        return transfer

    def _posted(self, transfer: Transfer) -> None:
        emit = self.events.emit
        if emit is not None:
            wire = transfer.wire
            transfer.op = PostedOp(transfer.id, transfer.kind, transfer.peer, transfer.link.name,
                                   wire.numel() * wire.element_size(), wire.dtype, transfer.message)
            emit(Event(EventKind.POST, time.perf_counter(), op=transfer.op))

    def completed(self, transfer: Transfer) -> bool:
        """Whether ``transfer`` has finished, without waiting (a watched one, or any on NCCL)."""
        return transfer.is_completed()

    def finished(self, transfer: Transfer) -> bool:
        """Whether ``transfer`` has finished; raises its error if it failed. Never waits."""
        if not transfer.is_completed():
            return False
        self._settle(transfer, "sending" if transfer.kind == "send" else "receiving")
        return True

    def wait(self, transfer: Transfer, what: str) -> None:
        """Waits for ``transfer``; a dead or silent peer becomes a :class:`PipelineError` naming it."""
        emit = self.events.emit
        if emit is not None:
            emit(Event(EventKind.WAIT_START, time.perf_counter(), op=transfer.op))
        self._settle(transfer, what)
        if emit is not None:
            now = time.perf_counter()
            emit(Event(EventKind.WAIT_END, now, op=transfer.op))
            emit(Event(EventKind.DONE, now, op=transfer.op))

    def _settle(self, transfer: Transfer, what: str) -> None:
        watchdog = surviving()
        try:
            if watchdog is not None and transfer.link.gloo:
                _wait_unless_lost(transfer, self.timeout.total_seconds() + _WATCH_MARGIN_S, what, watchdog)
            elif transfer.done is not None:
                seconds = self.timeout.total_seconds() + _WATCH_MARGIN_S  # the helper's own wait fails first
                if not transfer.done.wait(seconds):
                    raise TimeoutError(f"Timed out after {seconds:g}s waiting for the transfer")
                if transfer.error is not None:
                    raise transfer.error
            elif transfer.link.gloo:
                transfer.work.wait(timeout=self.timeout)
            else:
                transfer.work.wait()
        except PeersLost:
            raise
        except Exception as err:  # noqa: BLE001 - re-raised with the peer's own error, when known
            if watchdog is not None:
                raise_if_a_death_explains(watchdog, f"{what} from/to rank {transfer.peer}", err)
            raise self._error(f"{what} from/to rank {transfer.peer}", err) from err
        if transfer.wire is not transfer.tensor and transfer.kind == "recv":
            assert self.staging is not None
            self.staging.deliver((transfer.link.name, transfer.message), transfer.wire, transfer.tensor)
            transfer.wire = transfer.tensor  # delivered once

    def _watcher(self, link: Link) -> _Watcher:
        watcher = self._watchers.get(link.name)
        if watcher is None:
            watcher = self._watchers[link.name] = _Watcher(f"varuna-{link.name}", self.timeout)
        return watcher

    def close(self, join: bool = True) -> None:
        """Stops the helper threads once the transfers they watch are done (the executor calls it after each step).

        Args:
            join: Wait for the threads to end (after a step that completed, they have nothing left to wait on).
                After a failure a thread may still be waiting on a transfer that will never complete: it ends
                once that wait fails or times out.
        """
        for watcher in self._watchers.values():
            watcher.close(join)
        self._watchers.clear()

    def _error(self, what: str, err: Exception) -> PipelineError:
        return peer_error(self.topology, what, err, self.timeout)
