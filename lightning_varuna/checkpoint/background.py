"""The asynchronous checkpoint writer: a helper process per rank, at idle CPU priority.

A background *thread* would share the GIL and the cores with training: on a busy host its DCP planning and
pickling (tens of milliseconds per write) come straight out of the step. So each rank starts one helper
(a fresh ``python`` running :func:`main`, not a fork of the training process, and not
``multiprocessing``'s spawn, which would re-import the user's script). The helpers form a gloo process group
of their own (a rendezvous through the job's TCP store, under a prefix agreed at start) and run exactly what a
blocking save runs: DCP's collective save, rank 0's publication, the agreement on the outcome.

A save copies this rank's tensors into a staging buffer in shared memory (allocated once, reused while the
tensors keep their shapes) and sends the rest of the job, pickled, over a socket pair. A ``DTensor`` (a sharded
optimizer's state, ``zero_stage=1``) travels as its local shard plus where that shard sits (:class:`ShardSlot`);
the helpers rebuild it over a process group of their own with the same ranks, so that DCP writes each shard
(and checksums it) as a blocking save would. The helper runs under
``SCHED_IDLE`` (nice 19 where that is missing), so on a host whose cores training keeps busy it only takes
the time training leaves idle; on a GPU node the host's cores are free anyway. It ends with its training
process: on Linux by a parent-death signal, elsewhere at the closed socket.
"""

from __future__ import annotations

import importlib
import mmap
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from pathlib import Path
from typing import Any, cast

import fsspec
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["ShardSlot", "Slot", "WriterProcess", "fill", "hollow", "map_tensors", "shard_meshes"]

_ALIGN = 64
_JOB_SIGNAL_NAMES = ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
_JOB_SIGNALS = {getattr(signal, name) for name in _JOB_SIGNAL_NAMES if hasattr(signal, name)}
# signals first: the training process decides when the job ends (see main). The package's own __init__
# imports Lightning (seconds of CPU): the helper loads only the modules it needs.
_BOOT = (
    "import signal, sys, types; [signal.signal(getattr(signal, name), signal.SIG_IGN) for name in"
    " {signals!r} if hasattr(signal, name)];"
    " package = types.ModuleType('lightning_varuna'); package.__path__ = [{folder!r}];"
    " sys.modules['lightning_varuna'] = package; from lightning_varuna.checkpoint.background import main; main()"
)
_STARTUP_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Slot:
    """Stands for the staged tensor at ``index`` in a job's state (the tensors travel through shared memory)."""

    index: int


@dataclass(frozen=True)
class ShardSlot:
    """Stands for a ``DTensor`` whose local shard is the staged tensor at ``index``.

    Attributes:
        index: The local shard's place among the staged tensors.
        ranks: The global ranks of its (one-dimensional) device mesh, in mesh order.
        placements: Its placements (``Shard(0)``).
        shape: The whole tensor's shape.
        stride: The whole tensor's stride.
    """

    index: int
    ranks: tuple[int, ...]
    placements: tuple[Any, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def map_tensors(fn: Callable[[Any], Any], value: Any, kind: type = Tensor) -> Any:
    """``value`` with every ``kind`` inside its dicts, lists and tuples replaced by ``fn(it)``."""
    if isinstance(value, kind):
        return fn(value)
    if isinstance(value, dict):
        return {key: map_tensors(fn, inner, kind) for key, inner in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):  # not a namedtuple
        return type(value)(map_tensors(fn, inner, kind) for inner in value)
    return value


def hollow(value: Any, tensors: list[Tensor]) -> Any:
    """``value`` with every tensor replaced by a :class:`Slot`, appended to ``tensors`` in that order.

    A ``DTensor`` becomes a :class:`ShardSlot`, and its local shard is what is appended.
    """

    def slot(tensor: Tensor) -> Slot | ShardSlot:
        if isinstance(tensor, DTensor):
            mesh = tensor.device_mesh
            if mesh.ndim != 1:
                raise ValueError(f"the asynchronous checkpoint writer takes DTensors over a one-dimensional mesh,"
                                 f" not {mesh}")
            tensors.append(tensor.to_local())
            return ShardSlot(len(tensors) - 1, tuple(mesh.mesh.tolist()), tuple(tensor.placements),
                             tuple(tensor.shape), tuple(tensor.stride()))
        tensors.append(tensor)
        return Slot(len(tensors) - 1)

    return map_tensors(slot, value)


def fill(value: Any, tensors: list[Tensor], meshes: dict[tuple[int, ...], Any] | None = None) -> Any:
    """The reverse of :func:`hollow`; ``meshes``: the device mesh of each :class:`ShardSlot`'s ranks."""
    value = map_tensors(lambda slot: tensors[slot.index], value, Slot)

    def rebuild(slot: ShardSlot) -> DTensor:
        assert meshes is not None, "the DTensors' device meshes are needed"
        return DTensor.from_local(tensors[slot.index], meshes[slot.ranks], list(slot.placements), run_check=False,
                                  shape=torch.Size(slot.shape), stride=slot.stride)

    return map_tensors(rebuild, value, ShardSlot)


def shard_meshes(value: Any) -> set[tuple[int, ...]]:
    """The ranks of every :class:`ShardSlot`'s mesh in ``value``."""
    found: set[tuple[int, ...]] = set()
    map_tensors(lambda slot: found.add(slot.ranks), value, ShardSlot)
    return found


Layout = list[tuple[torch.dtype, tuple[int, ...]]]


class _Staging:
    """Tensors of a fixed layout, back to back (64-byte aligned) in one shared-memory file."""

    def __init__(self, layout: Layout, fd: int | None = None) -> None:
        self.layout = layout
        spans, size = [], 0  # (offset, bytes) of each tensor
        for dtype, shape in layout:
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            spans.append((size, nbytes))
            size += -(-nbytes // _ALIGN) * _ALIGN
        if fd is None:
            fd = _anonymous_shared_file(size)
        self.fd = fd
        self._map = mmap.mmap(fd, max(size, 1))
        base = torch.frombuffer(self._map, dtype=torch.uint8)
        self.views = [base[offset : offset + nbytes].view(dtype).view(shape)
                      for (dtype, shape), (offset, nbytes) in zip(layout, spans)]

    def close(self) -> None:
        self.views = []
        try:
            self._map.close()
        except BufferError:  # a view is still referenced somewhere: the mapping goes with it
            pass
        os.close(self.fd)


def _anonymous_shared_file(size: int) -> int:
    """A file descriptor of ``size`` bytes of shared memory with no name left behind."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("lightning-varuna-checkpoint")
    else:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="lightning-varuna-checkpoint-", dir=folder)
        os.unlink(path)
    os.ftruncate(fd, max(size, 1))
    return fd


class WriterProcess:
    """The training side of one rank's helper: starts it, stages jobs, collects their outcomes.

    Args:
        rank: This rank in the default process group; the helper takes the same rank in its own.
        world_size: The number of ranks (and helpers).
        token: The same fresh string on every rank: the helpers' rendezvous prefix.
        timeout_s: Timeout of the helpers' process group and of their rendezvous.
    """

    def __init__(self, rank: int, world_size: int, token: str, timeout_s: float) -> None:
        address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not address or not port:
            raise RuntimeError(
                "async_checkpoint needs MASTER_ADDR and MASTER_PORT (set by Lightning, torchrun and SLURM) to start"
                " its writer processes; set them, or use async_checkpoint=False."
            )
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # what this process can import, the helper can (fsspec filesystems registered here are sent over)
        package_root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in (package_root, *sys.path) if p))
        env["OMP_NUM_THREADS"] = "1"
        # a session of its own: a signal to the job's process group (torchrun stopping its workers, SLURM's
        # preemption warning, Ctrl-C) must not end the writer before the training process has saved. The
        # signals are blocked around the start, so that the child begins with them blocked (the mask survives
        # exec) until it ignores them; this thread gets any that arrive meanwhile once they are unblocked.
        boot = _BOOT.format(signals=_JOB_SIGNAL_NAMES, folder=str(Path(__file__).resolve().parents[1]))
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _JOB_SIGNALS)
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", boot, str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        theirs.close()
        self._conn = Connection(ours.detach())
        _send(self._conn, (rank, world_size, address, int(port), token, timeout_s))
        self._staging: _Staging | None = None
        self._filesystems: dict[str, type] = {}

    def holds(self, tensors: list[Tensor]) -> bool:
        """Whether the staging buffer holds exactly ``tensors`` (layout and bits), so a job may reuse it."""
        if self._staging is None or self._staging.layout != [(t.dtype, tuple(t.shape)) for t in tensors]:
            return False
        with torch.no_grad():  # bits, not values: -0.0 is not 0.0, and a NaN equals itself
            return all(torch.equal(_bits(view), _bits(tensor.detach().cpu()))
                       for view, tensor in zip(self._staging.views, tensors))

    def submit(self, job: Any, tensors: list[Tensor], filesystem: type | None = None, staged: bool = False) -> None:
        """Copies ``tensors`` into the staging buffer and sends ``job`` (whose state holds their slots).

        Args:
            job: The job, pickled to the helper.
            tensors: The tensors its slots stand for.
            filesystem: The fsspec filesystem class of the job's location: one defined in the main script
                cannot be imported by the helper.
            staged: The staging buffer already holds ``tensors`` (:meth:`holds`): nothing is copied, and the helper
                writes this job from it after the jobs sent before.

        Raises:
            ValueError: ``filesystem`` is defined in the main script.
            pickle.PicklingError: The job cannot be pickled (nothing was sent).
            ConnectionError: The helper is gone.
        """
        if filesystem is not None and filesystem.__module__ == "__main__":
            raise ValueError(
                f"The fsspec filesystem {filesystem.__qualname__} is defined in the main script, which the"
                " asynchronous checkpoint writer's process cannot import: define it in a module, or use"
                " async_checkpoint=False."
            )
        try:
            message = pickle.dumps(("write", job), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # noqa: BLE001 - any failure to pickle, reported as one
            raise pickle.PicklingError(f"{type(err).__name__}: {err}") from err
        registered = {k: v for k, v in fsspec.registry.items() if self._filesystems.get(k) is not v}
        if registered:
            _send(self._conn, ("filesystems", {k: (v.__module__, v.__qualname__) for k, v in registered.items()
                                             if v.__module__ != "__main__"}))
            self._filesystems.update(registered)
        layout = [(t.dtype, tuple(t.shape)) for t in tensors]
        if staged:
            self._conn.send_bytes(message)
            return
        if tensors and (self._staging is None or self._staging.layout != layout):
            if self._staging is not None:
                self._staging.close()
                self._staging = None
            self._staging = _Staging(layout)
            _send(self._conn, ("staging", layout))
            send_handle(self._conn, self._staging.fd, self._process.pid)
        if tensors:
            assert self._staging is not None
            with torch.no_grad():
                for view, tensor in zip(self._staging.views, tensors):
                    view.copy_(tensor)
        self._conn.send_bytes(message)

    def outcome(self, timeout: float | None) -> tuple[bool, str | None]:
        """``(True, error or None)`` once the helper reports the job's outcome; ``(False, None)`` before."""
        try:
            if not self._conn.poll(timeout):
                return False, None
            kind, error = _receive(self._conn)
        except (EOFError, OSError):
            return True, self.ended()
        assert kind == "done", kind
        return True, error

    def ended(self, timeout: float = 10.0) -> str:
        """What to report once the helper has gone (one that has not within ``timeout`` is killed)."""
        try:
            code = self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            code = self._process.wait()
        return f"the checkpoint writer process ended (exit code {code})"

    def remove_after(self, path: str) -> None:
        """Has the helper delete ``path`` once the job in flight has succeeded (dropped if it fails)."""
        _send(self._conn, ("remove", path))

    def kill(self) -> None:
        """Ends the helper at once (whatever it is writing)."""
        try:
            self._process.kill()
        except OSError:
            pass

    def close(self, timeout: float = 30.0) -> None:
        """Stops the helper (after the job it is writing, if any, within ``timeout``)."""
        try:
            _send(self._conn, ("stop", None))
            self._process.wait(timeout)
        except (OSError, subprocess.TimeoutExpired):
            self._process.kill()
            self._process.wait()
        self._conn.close()
        if self._staging is not None:
            self._staging.close()
            self._staging = None


def _bits(tensor: Tensor) -> Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _send(conn: Connection, message: Any) -> None:
    # plain pickle: torch's multiprocessing reductions would pass tensors by shared-memory handles
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _receive(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _lower_priority() -> None:
    """Idle priority for every thread of this process (gloo's included); later threads inherit it."""
    threads = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    for tid in threads:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):
            try:
                os.setpriority(os.PRIO_PROCESS, tid, 19)
            except OSError:
                pass


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1  # noqa: N806 - the kernel's name
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != int(sys.argv[2]):  # the parent is already gone (re-parented to init or a subreaper)
        os._exit(1)


def serve(conn: Connection, write: Callable[[Any, list[Tensor]], str | None], remove: Callable[[str], None]) -> None:
    """The helper's loop: stage layouts, writes (``write(job, staged tensors) -> error``), removals, stop."""
    staging: _Staging | None = None
    last_error: str | None = None
    while True:
        try:
            kind, payload = _receive(conn)
        except (EOFError, OSError):
            return  # the training process is gone
        if kind == "staging":
            if staging is not None:
                staging.close()
            staging = _Staging(payload, fd=recv_handle(conn))
        elif kind == "write":
            last_error = write(payload, staging.views if staging is not None else [])
            _send(conn, ("done", last_error))
        elif kind == "filesystems":
            for protocol, (module, name) in payload.items():
                cls: Any = importlib.import_module(module)
                for part in name.split("."):
                    cls = getattr(cls, part)
                fsspec.register_implementation(protocol, cls, clobber=True)
        elif kind == "remove":
            if last_error is None:
                remove(payload)
        elif kind == "stop":
            return


def main() -> None:
    """Entry point of the helper (arguments: ``FD``, its end of the socket pair, and its parent's pid).

    It ignores the signals that end or preempt a job: the training process, which gets them, saves and then
    stops its writer; a writer whose training process is gone is ended by the parent-death signal or the
    closed socket.
    """
    _die_with_parent()
    conn = Connection(int(sys.argv[1]))
    rank, world_size, address, port, token, timeout_s = _receive(conn)
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import PrefixStore

    from lightning_varuna.checkpoint.job import write_job
    from lightning_varuna.checkpoint.publish import remove_quietly
    from lightning_varuna.checkpoint.storage import Location

    torch.set_num_threads(1)
    timeout = timedelta(seconds=timeout_s)
    tcp_store = dist.TCPStore(  # type: ignore[attr-defined]  # torch.distributed does not declare its re-export
        address, port, is_master=False, timeout=timedelta(seconds=_STARTUP_TIMEOUT_S))
    store = PrefixStore(f"lightning_varuna/checkpoint_writer/{token}", tcp_store)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    _lower_priority()  # started at normal priority: a starved start would delay the first save's write

    from torch.distributed.device_mesh import DeviceMesh

    meshes: dict[tuple[int, ...], Any] = {}  # a DeviceMesh, or the group alone where this rank is not in it
    meshes_needed: list[bool] = []

    def write(job: Any, staged: list[Tensor]) -> str | None:
        # every helper creates the meshes any rank's shards need, in one order (new_group is collective); a job
        # without shards (zero_stage=0, or D=1: the same on every rank) skips the agreement
        if not shard_meshes(job.shards) and not meshes_needed:
            job.shards = fill(job.shards, staged)
            return write_job(job, None)
        meshes_needed.append(True)  # from now on every write agrees, whatever its own shards
        try:
            wanted: list[Any] = [None] * world_size
            dist.all_gather_object(wanted, sorted(shard_meshes(job.shards)))
            for ranks in sorted({tuple(r) for part in wanted for r in part} - set(meshes)):
                group = dist.new_group(list(ranks), timeout=timeout)
                if rank in ranks:  # new_group gives a ProcessGroup to the ranks in it (a placeholder to the others)
                    meshes[ranks] = DeviceMesh.from_group(cast(dist.ProcessGroup, group), "cpu")
                else:
                    meshes[ranks] = group
        except Exception as err:  # noqa: BLE001 - a peer lost: this write fails, as write_job would report it
            return f"{type(err).__name__}: {err}"
        job.shards = fill(job.shards, staged, meshes)
        return write_job(job, None)

    try:
        serve(conn, write, lambda path: remove_quietly(Location.of(path)))
    finally:
        dist.destroy_process_group()
