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

Every write of a lease is conditional on the lease it read: the lease is a file per *generation*
(``.varuna-lease.<generation>.json``, the newest is the lease), and a job that read generation ``g`` (to take
it, take it over or renew it) writes generation ``g + 1`` only if that file does not exist yet (a hard link, see
:mod:`~lightning_varuna.files.atomic_write`). Of two jobs that decided on the same generation (a keeper
renewing its lease while another job takes it over as stale) exactly one creates the next file; the other
has lost the lease. A write keeps the generation before it (a job that read an older one and creates its
successor finds a newer file beside it and has lost), and a release writes a generation that names no
holder, so that the count never starts again under a write decided before it.

An object store has no create-if-absent: there a job skips a generation that exists and reads the lease back
after writing it, which narrows the window between two jobs' writes but cannot close it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from lightning_varuna.checkpoint.storage import Location
from lightning_varuna.files.atomic_write import write_atomic

__all__ = [
    "DEFAULT_TIMEOUT_S", "LEASE_FILE", "LEASE_PREFIX", "Holder", "LeaseKeeper", "LeaseTicket", "is_lease_file",
    "lease_name", "read", "release", "take",
]

log = logging.getLogger(__name__)

LEASE_PREFIX = ".varuna-lease."
"""The start of a lease file's name (``.varuna-lease.<generation>.json``)."""
LEASE_FILE = ".varuna-lease.json"
"""The lease file of earlier versions (one file, rewritten in place), read as generation 0."""
_GENERATION = re.compile(r"\.varuna-lease\.(\d+)\.json")
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


def lease_name(generation: int) -> str:
    """The file of one generation of a folder's lease."""
    return f"{LEASE_PREFIX}{generation:012d}.json"


def is_lease_file(name: str) -> bool:
    """Whether ``name`` is one of a folder's lease files (of any generation, or of an earlier version)."""
    return name == LEASE_FILE or _GENERATION.fullmatch(name) is not None


def _generations(folder: Location) -> list[tuple[int, str]]:
    """The lease files of ``folder``, newest first, with their generations (an earlier version's file is 0)."""
    found = []
    for name in folder.names():
        match = _GENERATION.fullmatch(name)
        if match is not None:
            found.append((int(match.group(1)), name))
        elif name == LEASE_FILE:
            found.append((0, name))
    return sorted(found, reverse=True)


def _newest(folder: Location) -> tuple[int, dict[str, Any] | None]:
    """The newest generation of the lease of ``folder`` (0: none yet) and its record.

    The record is ``None`` if the lease was released or cannot be read; otherwise it holds the ``holder``, when it
    was ``renewed``, its ``timeout_s`` and its ``generation``.
    """
    folder.refresh()
    generation = 0
    for _ in range(5):  # a renewal removed the file between the listing and the read: list again
        files = _generations(folder)
        if not files:
            return 0, None
        generation, name = files[0]
        try:
            record = json.loads(folder.child(name).read_bytes())
        except FileNotFoundError:
            continue
        except (OSError, ValueError):
            return generation, None
        try:
            if record.get("holder") is None:
                return generation, None
            record["holder"] = Holder(**record["holder"])
            record["generation"] = generation
            float(record["renewed"]), float(record["timeout_s"])
        except (AttributeError, KeyError, TypeError, ValueError):
            return generation, None
        return generation, record
    return generation, None


def read(folder: str | os.PathLike[str] | Location) -> dict[str, Any] | None:
    """The lease of ``folder`` (``None`` if there is none, it was released, or it cannot be read)."""
    return _newest(Location.of(folder))[1]


def _write(folder: Location, holder: Holder | None, timeout_s: float, generation: int) -> bool:
    """Writes ``generation`` of the lease (``holder`` ``None``: released) if no other job wrote it.

    Returns whether this write made the lease: ``False`` if the generation's file existed (another job wrote
    after the read this write was decided on) or a newer generation is beside it (the read was older than that).
    """
    record = {"holder": None if holder is None else asdict(holder), "renewed": time.time(), "timeout_s": timeout_s}
    data = json.dumps(record).encode()
    loc = folder.child(lease_name(generation))
    if loc.local:
        if not write_atomic(loc.path, data, exclusive=True):
            return False
    else:
        loc.refresh()
        if loc.exists():
            return False
        loc.write_bytes(data)
    newest, written = _newest(folder)
    mine = newest == generation and (holder is None or (written is not None and written["holder"] == holder))
    if not mine:
        if newest > generation:  # a successor of a generation long gone: not the lease, never read as it
            loc.remove()
        return False
    # the generation before stays: a listing during the next write sees one of the two, never neither (an
    # earlier version's file goes: its jobs rewrite it in place, outside the generations)
    for older, name in _generations(folder):
        if older < generation - (0 if holder is None else 1) or name == LEASE_FILE:
            folder.child(name).remove()
    return True


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


def take(folder: str | os.PathLike[str] | Location, holder: Holder, timeout_s: float) -> str | None:
    """Takes or renews the lease of ``folder`` for ``holder``; returns the problem if another job holds it."""
    folder = Location.of(folder)
    for _ in range(3):  # another job wrote the lease between this read and this write: read again
        generation, record = _newest(folder)
        now = time.time()
        if record is not None and not holder.may_take_over(record["holder"]):
            stale = now - record["renewed"] > record["timeout_s"] or _is_gone(record["holder"])
            if not stale:
                return holder_problem(folder, record, now)
            log.warning(f"Taking over the stale checkpoint lease of {folder} from {record['holder'].describe()}.")
        if _write(folder, holder, timeout_s, generation + 1):
            return None
    record = read(folder)
    return holder_problem(folder, record) if record is not None else f"Could not take the lease of {folder}."


def release(folder: str | os.PathLike[str] | Location, holder: Holder) -> None:
    """Releases the lease of ``folder`` if ``holder`` holds it (a failure is logged).

    The released lease stays as a generation that names no holder (see the module's description).
    """
    folder = Location.of(folder)
    try:
        generation, record = _newest(folder)
        if record is not None and record["holder"].token == holder.token:
            _write(folder, None, record["timeout_s"], generation + 1)
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

    def track(self, folder: str | os.PathLike[str] | Location) -> None:
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
                    self._renew_one(folder)

    def _renew_one(self, folder: Location) -> None:
        """Renews the lease of ``folder`` unless another job took it over (then stops renewing it)."""
        generation, record = _newest(folder)
        lost = record is not None and record["holder"].token != self.holder.token
        # the renewal is the next generation of the lease this keeper just read: if another job wrote that
        # generation meanwhile (it took the lease over as stale), this job has lost the lease
        if lost or not _write(folder, self.holder, self.timeout_s, generation + 1):
            record = read(folder)
            if record is not None and record["holder"].token == self.holder.token:
                return  # this job's own save renewed it (a write's step 1) between the read and the write
            problem = holder_problem(folder, record) if record is not None else f"Lost the lease of {folder}."
            log.error(problem + " This job's saves there will fail.")
            with self._lock:
                self._folders.pop(folder.text, None)

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
