"""Communication: the P x D process grid, point-to-point transfers with timeouts, and failure reports.

Ranks are laid out replica-major: ``rank = replica * P + stage``. Pipeline neighbours therefore have
adjacent ranks and share a node whenever P divides the processes per node (Varuna's rule: the chatty
per-micro-batch p2p traffic stays on the node), while the replicas of a stage, which exchange gradients
once per step, sit on different nodes.
"""

from __future__ import annotations

import atexit
import queue
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Topology", "P2P", "PipelineError", "WatchedWork", "report_failure", "peer_error"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_HEADER = 10  # dtype code, ndim, up to 8 dims
HEADER_BYTES = _HEADER * 8
_ERROR_KEY = "lightning_varuna/error/"
_WATCH_MARGIN_S = 5.0
_exit = {"registered": False, "failed": False}


class PipelineError(RuntimeError):
    """A pipeline peer failed, died or did not answer in time."""


@dataclass
class Topology:
    """Where this rank sits in the P x D grid, and the process groups it talks over."""

    world_size: int
    rank: int
    pipeline_size: int
    device: torch.device
    mesh: object = None
    pipe_group: object = None
    data_group: object = None
    timeout: timedelta | None = None
    """Timeout of collectives in the pipeline, data and shared-parameter groups (None: torch's default)."""
    _shared_groups: dict = field(default_factory=dict)

    @property
    def data_size(self) -> int:
        """D: the number of pipeline replicas."""
        return self.world_size // self.pipeline_size

    @property
    def stage(self) -> int:
        """This rank's pipeline stage."""
        return self.rank % self.pipeline_size

    @property
    def replica(self) -> int:
        """This rank's data-parallel replica."""
        return self.rank // self.pipeline_size

    @property
    def is_first(self) -> bool:
        """Whether this rank runs the first stage."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last stage."""
        return self.stage == self.pipeline_size - 1

    def rank_of(self, stage: int, replica: int | None = None) -> int:
        """Global rank of ``stage`` in ``replica`` (default: this rank's replica)."""
        return (self.replica if replica is None else replica) * self.pipeline_size + stage

    @property
    def pipe_src_rank(self) -> int:
        """Global rank of this replica's last stage, which broadcasts losses and logged values."""
        return self.rank_of(self.pipeline_size - 1)

    @staticmethod
    def check(world_size: int, pipeline_size: int) -> None:
        """Raises a clear error if ``pipeline_size`` cannot divide the world."""
        if pipeline_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {pipeline_size}.")
        if world_size % pipeline_size:
            raise ValueError(
                f"The world size ({world_size} processes) is not divisible by pipeline_parallel_size="
                f"{pipeline_size}. Use a P that divides {world_size}, or change devices/num_nodes."
            )

    @classmethod
    def create(
        cls, pipeline_size: int, device: torch.device, timeout: float | timedelta | None = None
    ) -> Topology:
        """Builds the grid over the initialised default process group (a collective call on every rank).

        ``timeout`` (seconds) bounds every collective of the groups made here. Without it a hung peer can
        hold the others in a gradient all-reduce or log broadcast for torch's default (30 minutes): subgroups
        do not inherit the default process group's timeout.
        """
        world, rank = dist.get_world_size(), dist.get_rank()
        cls.check(world, pipeline_size)
        destroy_process_groups_at_exit()
        from torch.distributed.device_mesh import DeviceMesh

        if isinstance(timeout, (int, float)):
            timeout = timedelta(seconds=timeout)
        data_size = world // pipeline_size
        layout = torch.arange(world).view(data_size, pipeline_size)
        # every rank creates every group, in the same order
        pipes = [dist.new_group(row.tolist(), timeout=timeout) for row in layout]
        datas = [dist.new_group(col.tolist(), timeout=timeout) for col in layout.t()]
        pipe_group, data_group = pipes[rank // pipeline_size], datas[rank % pipeline_size]
        mesh = DeviceMesh.from_group(
            [data_group, pipe_group], device.type, mesh=layout, mesh_dim_names=("data", "pipe")
        )
        return cls(
            world_size=world,
            rank=rank,
            pipeline_size=pipeline_size,
            device=device,
            mesh=mesh,
            pipe_group=pipe_group,
            data_group=data_group,
            timeout=timeout,
        )

    def stages_group(self, stages: tuple[int, ...]) -> object:
        """The group of every replica's copies of ``stages`` (all ranks must call this in the same order)."""
        if stages not in self._shared_groups:
            ranks = [self.rank_of(s, d) for d in range(self.data_size) for s in stages]
            self._shared_groups[stages] = dist.new_group(ranks=sorted(ranks), timeout=self.timeout)
        return self._shared_groups[stages]


def destroy_process_groups_at_exit() -> None:
    """Destroys every process group when the interpreter exits, unless this rank failed (registered once).

    Neither Lightning nor torchrun destroys the process groups. A gloo group that is still alive when the
    interpreter finalizes can abort the process ("terminate called without an active exception": its worker
    threads release tensors after Python is gone), turning a finished job into a failed one. A rank that
    failed skips it: destroying a group can wait on transfers that a lost peer will never complete.
    """
    if not _exit["registered"]:
        _exit["registered"] = True
        atexit.register(_destroy_process_groups)


def _destroy_process_groups() -> None:
    if _exit["failed"] or not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at exit
        pass


def report_failure(error: BaseException) -> None:
    """Leaves this rank's error in the job's store, so peers that lose contact can say what happened.

    Besides one key per rank, the first error reported in the job is kept (first writer wins), separately
    for errors of the user's code or model (the cause) and for :class:`PipelineError` (a rank that lost a
    peer), so that peers quote the cause rather than another rank's report of it.
    """
    _exit["failed"] = True
    try:
        store = dist.distributed_c10d._get_default_store()
        rank = dist.get_rank()
        text = "".join(traceback.format_exception_only(type(error), error)).strip()[-2000:]
        store.set(f"{_ERROR_KEY}{rank}", text)
        kind = "peer" if isinstance(error, PipelineError) else "cause"
        store.compare_set(f"{_ERROR_KEY}first-{kind}", "", f"Rank {rank} failed first with: {text}")
    except Exception:  # noqa: BLE001 - best effort: the store may be gone with rank 0
        pass


def _peer_failure() -> str:
    try:
        store = dist.distributed_c10d._get_default_store()
        for kind in ("cause", "peer"):
            key = f"{_ERROR_KEY}first-{kind}"
            if store.check([key]):
                return f" {store.get(key).decode()}"
    except Exception:  # noqa: BLE001 - the store may be gone with rank 0
        pass
    return ""


def peer_error(
    topology: Topology, what: str, err: BaseException, timeout: timedelta | None = None
) -> PipelineError:
    """The :class:`PipelineError` for a failed wait on peers: this rank, ``what`` it waited for, the cause.

    For any wait on other ranks (p2p, or a collective such as a gradient all-reduce or log broadcast)::

        except Exception as err:
            raise peer_error(topo, "averaging gradients over ranks [1, 3]", err) from err

    It quotes the first failure reported in the job, when there is one.
    """
    me = f"rank {topology.rank} (stage {topology.stage})"
    timeout = timeout or topology.timeout
    hint = ""
    if timeout is not None and ("timed out" in str(err).lower() or "timeout" in str(err).lower()):
        hint = f" (no answer within p2p_timeout={timeout.total_seconds():g}s: the peer is hung or far behind)"
    return PipelineError(f"{me}: {what} failed{hint}: {err}.{_peer_failure()}")


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
