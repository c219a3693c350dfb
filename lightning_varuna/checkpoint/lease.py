"""One job at a time per checkpoint folder: a lease file naming the job that writes there, renewed while it runs.

Two jobs saving into one folder replace each other's ``last.ckpt`` and delete each other's temporary
directories. So rank 0 takes the lease of a folder (``.varuna-lease.json`` in it) at the start of ``fit`` for
the folders its checkpoint callbacks write to, and before every save for the folder saved to, and renews it
from a thread while the job runs (:class:`LeaseKeeper`). A lease held by another job is refused with an error
that names it, unless it is *stale*:

- the same job started again: the same SLURM job (a requeue) or the same torchrun run id (an elastic restart),
  at once, whatever host its rank 0 now runs on;
- its holder died on this host (its process is gone), at once;
- not renewed for its timeout (a job that died elsewhere), after the timeout.

A local disk creates the file only if it is absent (no two jobs can both create it). An object store has no such
call: there each job reads the lease back after writing it, and the renewals read it before writing, so of two
jobs that start within the same moment the one that wrote first finds the other's lease and stops saving.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from lightning_varuna.checkpoint.storage import Location
from lightning_varuna.fault.atomic_write import write_atomic

__all__ = ["DEFAULT_TIMEOUT_S", "LEASE_FILE", "Holder", "LeaseKeeper", "LeaseTicket", "release", "take"]

log = logging.getLogger(__name__)

LEASE_FILE = ".varuna-lease.json"
DEFAULT_TIMEOUT_S = 60.0
_TOKEN = uuid.uuid4().hex  # this process


@dataclass(frozen=True)
class Holder:
    """Who holds a lease.

    Attributes:
        run: The job across restarts (``slurm:<job id>``, ``torchrun:<run id>``), or ``None`` if unknown.
        token: This process (a fresh value per process).
        host: The host name.
        pid: The process id.
        process: What tells this process from a later one with the same pid on the same host (boot id, PID
            namespace and start time, from ``/proc``), or ``None`` where ``/proc`` is missing.
    """

    run: str | None
    token: str
    host: str
    pid: int
    process: str | None

    @classmethod
    def current(cls) -> Holder:
        """This process, in this job."""
        return cls(_run_identity(), _TOKEN, socket.gethostname(), os.getpid(), _process_identity(os.getpid()))

    def describe(self) -> str:
        """The holder in words."""
        job = f"job {self.run.split(':', 1)[1]} ({self.run.split(':', 1)[0]})" if self.run else "a job"
        return f"{job}, process {self.pid} on {self.host}"

    def may_take_over(self, other: Holder) -> bool:
        """Whether ``self`` may take a fresh lease of ``other`` (the same process, or the same job restarted)."""
        return other.token == self.token or (other.run is not None and other.run == self.run)


@dataclass(frozen=True)
class LeaseTicket:
    """What a checkpoint write needs to take its folder's lease (it travels to the writer process).

    Attributes:
        holder: The job's rank 0.
        timeout_s: Seconds after which a lease not renewed is stale.
        keep: Keep the lease after the write (during ``fit``, where a :class:`LeaseKeeper` renews and releases
            it); otherwise it is released once the checkpoint is published.
    """

    holder: Holder
    timeout_s: float
    keep: bool


def _run_identity() -> str | None:
    slurm = os.environ.get("SLURM_JOB_ID")
    if slurm:
        return f"slurm:{slurm}"
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run and run != "none":
        return f"torchrun:{run}"
    return None


def _process_identity(pid: int) -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.readlink(f"/proc/{pid}/ns/pid")
        with open(f"/proc/{pid}/stat") as f:
            start = f.read().rsplit(")", 1)[1].split()[19]  # field 22, after the command name
    except (OSError, IndexError):
        return None
    return f"{boot}/{namespace}/{start}"


def _is_gone(holder: Holder) -> bool:
    """Whether ``holder`` is a process of this host (and PID namespace) that has ended."""
    if holder.host != socket.gethostname() or holder.process is None:
        return False
    mine = _process_identity(os.getpid())
    if mine is None or mine.rsplit("/", 1)[0] != holder.process.rsplit("/", 1)[0]:
        return False  # another boot or PID namespace: its pid means nothing here
    return _process_identity(holder.pid) != holder.process


def _lease_file(folder: Location) -> Location:
    return folder.child(LEASE_FILE)


def read(folder: Location) -> dict[str, Any] | None:
    """The lease of ``folder`` (``None`` if there is none, or it cannot be read)."""
    loc = _lease_file(folder)
    loc.refresh()
    try:
        record = json.loads(loc.read_bytes())
        record["holder"] = Holder(**record["holder"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record


def _write(folder: Location, holder: Holder, timeout_s: float, create: bool) -> bool:
    """Writes the lease; with ``create``, only if there is none (where the filesystem can tell). Whether written."""
    data = json.dumps({"holder": asdict(holder), "renewed": time.time(), "timeout_s": timeout_s}).encode()
    loc = _lease_file(folder)
    if not (create and loc.local):
        loc.write_bytes(data)
        return True
    return write_atomic(loc.path, data, exclusive=True)  # no two jobs create it


def holder_problem(folder: Location, record: dict[str, Any], now: float | None = None) -> str:
    """The error for a lease held by another job."""
    age = (now or time.time()) - record["renewed"]
    timeout = record["timeout_s"]
    return (
        f"Another job is writing checkpoints in {folder}: {record['holder'].describe()} holds its lease"
        f" ({LEASE_FILE}, renewed {age:.0f} s ago). Two jobs saving in one folder overwrite each other's"
        " checkpoints. Give this run its own folder (ModelCheckpoint(dirpath=...)), or stop the other job. A lease"
        f" is taken over once it has not been renewed for {timeout:.0f} s (its job died), or at once by a restart"
        " of the same job (the same SLURM job, the same torchrun run id) or when its process on this host is gone."
    )


def take(folder: str | os.PathLike | Location, holder: Holder, timeout_s: float) -> str | None:
    """Takes or renews the lease of ``folder`` for ``holder``; returns the problem if another job holds it."""
    folder = Location.of(folder)
    for _ in range(3):  # a lease created by another job between the read and the write: read again
        record = read(folder)
        now = time.time()
        if record is not None and not holder.may_take_over(record["holder"]):
            stale = now - record["renewed"] > record["timeout_s"] or _is_gone(record["holder"])
            if not stale:
                return holder_problem(folder, record, now)
            log.warning(f"Taking over the stale checkpoint lease of {folder} from {record['holder'].describe()}.")
        if not _write(folder, holder, timeout_s, create=record is None):
            continue
        back = read(folder)  # two jobs writing at once on an object store: the later write wins
        if back is not None and back["holder"].token != holder.token:
            return holder_problem(folder, back)
        return None
    record = read(folder)
    return holder_problem(folder, record) if record is not None else f"Could not take the lease of {folder}."


def release(folder: str | os.PathLike | Location, holder: Holder) -> None:
    """Removes the lease of ``folder`` if ``holder`` holds it (a failure is logged)."""
    folder = Location.of(folder)
    try:
        record = read(folder)
        if record is not None and record["holder"].token == holder.token:
            _lease_file(folder).remove()
    except OSError as err:
        log.warning(f"Could not release the checkpoint lease of {folder}: {err}")


class LeaseKeeper:
    """Rank 0's leases during ``fit``: taken at its start, renewed from a thread, released at its end.

    Args:
        timeout_s: Seconds after which a lease not renewed is stale; it is renewed every quarter of that.
    """

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.holder = Holder.current()
        self._folders: dict[str, Location] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def ticket(self) -> LeaseTicket:
        """What a write during this ``fit`` takes its lease with."""
        return LeaseTicket(self.holder, self.timeout_s, keep=True)

    def acquire(self, folders: list[str]) -> str | None:
        """Takes the lease of each folder (and starts renewing them); the first problem, if another job holds one."""
        for folder in folders:
            problem = take(folder, self.holder, self.timeout_s)
            if problem is not None:
                return problem
            self.track(folder)
        return None

    def track(self, folder: str | os.PathLike | Location) -> None:
        """Renews the lease of ``folder`` from now on (the write that takes it is under way); starts the thread."""
        loc = Location.of(folder)
        with self._lock:
            self._folders.setdefault(loc.text, loc)
        if self._thread is None:
            self._thread = threading.Thread(target=self._renew, name="varuna-checkpoint-lease", daemon=True)
            self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(max(1.0, self.timeout_s / 4)):
            with self._lock:
                folders = list(self._folders.values())
            for folder in folders:
                with contextlib.suppress(OSError):  # a storage hiccup: the next renewal may succeed
                    record = read(folder)
                    if record is not None and record["holder"].token != self.holder.token:
                        log.error(holder_problem(folder, record) + " This job's saves there will fail.")
                        with self._lock:
                            self._folders.pop(folder.text, None)
                        continue
                    _write(folder, self.holder, self.timeout_s, create=False)

    def close(self) -> None:
        """Stops renewing and releases every lease held (at the end of ``fit``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        with self._lock:
            folders, self._folders = list(self._folders.values()), {}
        for folder in folders:
            release(folder, self.holder)
        self._stop.clear()
