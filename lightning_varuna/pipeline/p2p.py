"""Point-to-point transfers between pipeline neighbours, each wait bounded by a timeout."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_varuna.pipeline.failures import PipelineError, peer_error
from lightning_varuna.pipeline.topology import Topology

__all__ = ["HEADER_BYTES", "P2P", "WatchedWork"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_HEADER = 10  # dtype code, ndim, up to 8 dims
HEADER_BYTES = _HEADER * 8
_WATCH_MARGIN_S = 5.0


class WatchedWork:
    """A send or receive whose completion can be asked for without blocking (see :class:`P2P`).

    It quacks like a ``dist.Work``: :meth:`is_completed` and :meth:`wait`.

    Args:
        work: The transfer, already posted; or None with ``post``.
        post: Posts the transfer and returns its work (the helper thread calls it: see :meth:`P2P.isend`).
    """

    __slots__ = ("work", "post", "done", "error")

    def __init__(self, work: dist.Work | None, post: Callable[[], dist.Work] | None = None) -> None:
        self.work = work
        self.post = post
        self.done = threading.Event()
        self.error: BaseException | None = None

    def is_completed(self) -> bool:
        """Whether the transfer has finished (successfully or not)."""
        return self.done.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Blocks until the transfer has finished and raises its error, if any.

        The helper thread's own wait is bounded by the p2p timeout and ends with gloo's error; ``timeout``
        (plus a margin, so that gloo's error comes first) only guards against a helper thread that is gone.
        """
        seconds = None if timeout is None else timeout.total_seconds() + _WATCH_MARGIN_S
        if not self.done.wait(seconds):
            raise TimeoutError(f"Timed out after {seconds:g}s waiting for the transfer")
        if self.error is not None:
            raise self.error
        return True


class _Watcher:
    """A daemon thread that waits on one peer's transfers in one direction, in the order they were posted.

    It lives for one step: no thread outlives the transfers it watches (a thread still inside a gloo wait when
    the interpreter exits can abort the process).

    The watched transfers between two ranks in one direction (activations, or gradients, and the step's summary;
    not the activation header) complete in the order they were posted, so waiting on them in that order finds
    each one as soon as it is done. After a failure every later transfer fails with it.

    A send handed over unposted (:meth:`P2P.isend`) is posted here once the previous transfer in the queue is
    done. A gloo send is done once the peer has posted the matching receive, so a queued send waits for the
    receives of those before it: the executor posts every receive ahead (activations when the header arrives,
    each gradient after its forward, the summary at the step's start).
    """

    def __init__(self, name: str, timeout: timedelta) -> None:
        self.timeout = timeout
        self.queue: queue.SimpleQueue[WatchedWork | None] = queue.SimpleQueue()
        self.failed: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def watch(self, work: dist.Work | None, post: Callable[[], dist.Work] | None = None) -> WatchedWork:
        watched = WatchedWork(work, post)
        self.queue.put(watched)
        return watched

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
                        item.work, item.post = item.post(), None  # type: ignore[misc]
                    item.work.wait(timeout=self.timeout)
                except BaseException as err:  # noqa: BLE001 - handed to the thread that waits on the work
                    self.failed = err
            item.error = self.failed
            item.done.set()


class P2P:
    """Asynchronous sends and receives between pipeline neighbours, each wait bounded by a timeout.

    With ``watch=True`` a send or receive can be asked whether it has completed without waiting for it
    (Varuna's opportunistic rule asks which messages are there; finished sends free their tensors). On gloo
    ``Work.is_completed()`` stays false until someone waits on the work, even after the data has moved, so
    such works are waited on by a helper thread per peer and direction, for the step (the wait releases the GIL) and
    returned as :class:`WatchedWork`. NCCL works report completion by themselves and are returned as they are.

    A watched send on gloo is also *posted* by its helper thread: gloo writes the message into the socket in
    the thread that posts it (about 0.5 ms per MiB here), which would otherwise delay the stage's next task.
    """

    def __init__(self, topology: Topology, timeout: float) -> None:
        self.topology = topology
        self.timeout = timedelta(seconds=timeout)
        self._header = torch.zeros(_HEADER, dtype=torch.int64, device=topology.device)
        self._watchers: dict[tuple[str, int], _Watcher] = {}

    def isend(self, tensor: Tensor, dst: int, tag: int, watch: bool = False) -> dist.Work:
        """Starts sending ``tensor`` to global rank ``dst`` (``tensor`` must not change until the send is done)."""
        if watch and self.topology.device.type == "cpu":
            return self._watcher("send", dst).watch(None, lambda: dist.isend(tensor, dst=dst, tag=tag))
        try:
            return self._watched(dist.isend(tensor, dst=dst, tag=tag), "send", dst, watch)
        except Exception as err:  # noqa: BLE001 - a peer that is already gone fails here, not in wait
            raise self._error(f"sending to rank {dst}", err) from err

    def irecv(self, tensor: Tensor, src: int, tag: int, watch: bool = False) -> dist.Work:
        """Starts receiving into ``tensor`` from global rank ``src``."""
        try:
            return self._watched(dist.irecv(tensor, src=src, tag=tag), "recv", src, watch)
        except Exception as err:  # noqa: BLE001 - a peer that is already gone fails here, not in wait
            raise self._error(f"receiving from rank {src}", err) from err

    def _watched(self, work: dist.Work, direction: str, peer: int, watch: bool) -> dist.Work:
        if not watch or self.topology.device.type != "cpu":
            return work
        return self._watcher(direction, peer).watch(work)  # type: ignore[return-value]

    def _watcher(self, direction: str, peer: int) -> _Watcher:
        key = (direction, peer)
        if key not in self._watchers:
            self._watchers[key] = _Watcher(f"varuna-{direction}-{peer}", self.timeout)
        return self._watchers[key]

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

    def wait(self, work: dist.Work, what: str, peer: int) -> None:
        """Waits for ``work``; a dead or silent peer becomes a :class:`PipelineError` naming it."""
        try:
            if self.topology.device.type == "cpu":
                work.wait(timeout=self.timeout)
            else:
                work.wait()
        except Exception as err:  # noqa: BLE001 - re-raised with the peer's own error, when known
            raise self._error(f"{what} from/to rank {peer}", err) from err

    def _error(self, what: str, err: Exception) -> PipelineError:
        return peer_error(self.topology, what, err, self.timeout)

    def send_header(self, tensor: Tensor, dst: int, tag: int) -> dist.Work:
        """Sends the shape and dtype of ``tensor`` ahead of a step's activations."""
        if tensor.dim() > _HEADER - 2:
            raise PipelineError(
                f"A cut point tensor has {tensor.dim()} dimensions; at most {_HEADER - 2} are supported."
            )
        if tensor.dtype not in _DTYPES:
            raise PipelineError(f"A cut point tensor has dtype {tensor.dtype}; supported: {_DTYPES}.")
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0] = _DTYPES.index(tensor.dtype)
        header[1] = tensor.dim()
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        return self.isend(header.to(self.topology.device), dst, tag)

    def recv_header(self, src: int, tag: int) -> tuple[torch.Size, torch.dtype]:
        """Receives what :meth:`send_header` sent (blocking, bounded by the timeout)."""
        self.wait(self.irecv(self._header, src, tag), "receiving an activation header", src)
        values = self._header.tolist()
        return torch.Size(values[2 : 2 + values[1]]), _DTYPES[values[0]]
