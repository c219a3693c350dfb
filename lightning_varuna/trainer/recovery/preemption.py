"""Preemption: every rank stops together at a step boundary, with a checkpoint, when any one is warned.

A warning is a signal (``SIGTERM``, ``SIGUSR1`` or the SLURM requeue signal) or a :class:`PreemptionNotice`
(a file, a cloud metadata endpoint) polled in a background thread. Neither does more than set this
process's flag: a collective inside a signal handler deadlocks as soon as only some ranks get the signal
(Lightning's own handler does that). The flag is agreed at the start of every training batch by the one
all-reduce that replaces Lightning's per-batch SIGTERM broadcast; once any rank has it, every rank writes
the checkpoint where ``ckpt_path="last"`` finds it and raises :class:`Preempted`, which ends the process
with :data:`PREEMPTED_EXIT_CODE`.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments.slurm import SLURMEnvironment
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_varuna.failstop.failures import check_job, waiting_on_peers
from lightning_varuna.failstop.job_watchdog import current_watchdog
from lightning_varuna.pipeline.topology import Topology
from lightning_varuna.pipeline.varuna_warning import VarunaWarning
from lightning_varuna.trainer.patches import InstancePatches, take_over_sigterm

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "FileNotice",
    "HTTPNotice",
    "Preempted",
    "PreemptionGuard",
    "PreemptionNotice",
    "PreemptionWatch",
    "requeue_slurm_job",
]

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 143
"""Exit status of every process of a preempted job: 128 + SIGTERM, what a shell reports for a process ended by
SIGTERM. Non-zero, so torchrun restarts the workers (while ``--max-restarts`` allows) and Kubernetes restarts
the pod; SLURM requeues on it where ``RequeueExit`` lists it."""

_TERMINATE, _REQUEUE = 1, 2
"""Flag values, agreed with MAX: a requeue signal (SLURM) wins over any other warning."""


class Preempted(SystemExit):
    """Raised on every rank once the job has agreed to stop for a preemption and the checkpoint is saved.

    A ``SystemExit``, so the process ends with :data:`PREEMPTED_EXIT_CODE` without a traceback, and
    ``except Exception`` blocks let it through.

    Args:
        reason: What warned this rank (``"SIGTERM"``, a notice's description), or that another rank was warned.
        checkpoint: Where the checkpoint was written.
    """

    def __init__(self, reason: str, checkpoint: str) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.reason = reason
        self.checkpoint = checkpoint


class PreemptionNotice(ABC):
    """A source of advance warning that this machine is about to be taken away, polled in a background thread.

    Subclass it and implement :meth:`poll`. It runs in a daemon thread of every rank and must never
    communicate with other ranks; any rank's notice stops the whole job.

    Args:
        interval: Seconds between two polls.
    """

    def __init__(self, interval: float = 5.0) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be positive, got {interval!r}.")
        self.interval = interval

    @abstractmethod
    def poll(self) -> str | None:
        """Returns a short description of the notice if there is one, else ``None``."""


class FileNotice(PreemptionNotice):
    """A notice given by creating a file (e.g. by a node agent or a prolog/epilog script).

    Args:
        path: The file whose existence is the notice.
        interval: Seconds between two checks.
    """

    def __init__(self, path: str, interval: float = 1.0) -> None:
        super().__init__(interval)
        self.path = path

    def poll(self) -> str | None:
        """The notice if the file exists."""
        return f"notice file {self.path}" if os.path.exists(self.path) else None


class HTTPNotice(PreemptionNotice):
    """A notice read from an HTTP endpoint, such as a cloud provider's instance metadata server.

    A poll is a notice when the endpoint answers ``200`` with a non-empty body that contains ``match``
    (if given). Anything else (another status, a refused connection, a timeout) is no notice. Proxies are
    bypassed. Examples:

    - AWS spot: ``http://169.254.169.254/latest/meta-data/spot/instance-action`` answers 404 until an
      interruption is scheduled (with IMDSv2, pass the session token in ``headers``).
    - GCE: ``http://metadata.google.internal/computeMetadata/v1/instance/preempted`` with
      ``headers={"Metadata-Flavor": "Google"}`` and ``match="TRUE"`` (it answers ``FALSE`` until then).

    Args:
        url: The endpoint.
        interval: Seconds between two polls.
        timeout: Seconds one request may take.
        headers: Extra request headers.
        match: Text the body must contain to be a notice; by default any non-empty body is.
    """

    def __init__(
        self,
        url: str,
        interval: float = 5.0,
        timeout: float = 2.0,
        headers: dict[str, str] | None = None,
        match: str | None = None,
    ) -> None:
        super().__init__(interval)
        self.url = url
        self.timeout = timeout
        self.headers = dict(headers or {})
        self.match = match

    def poll(self) -> str | None:
        """The notice if the endpoint answers 200 with a (matching) body."""
        request = urllib.request.Request(self.url, headers=self.headers)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # metadata servers are local
        try:
            with opener.open(request, timeout=self.timeout) as response:
                status, body = response.status, response.read(4096).decode(errors="replace").strip()
        except Exception as err:  # noqa: BLE001 - an unreachable or failing endpoint is no notice
            log.debug("HTTPNotice: %s: %s", self.url, err)
            return None
        if status != 200 or not body or (self.match is not None and self.match not in body):
            return None
        return f"notice from {self.url}: {body[:200]}"


class PreemptionWatch:
    """This process's own record of a coming preemption: the signal handlers and the notice poller set it.

    Args:
        notice: A notice source to poll, if any.
        signals: Signals that mean "terminate" (default ``SIGTERM`` and ``SIGUSR1``).
        requeue_signals: Signals that mean "requeue" (SLURM's requeue signal); they are handled too.
    """

    def __init__(
        self,
        notice: PreemptionNotice | None = None,
        signals: tuple[signal.Signals, ...] | None = None,
        requeue_signals: tuple[signal.Signals, ...] = (),
    ) -> None:
        if signals is None:
            signals = tuple(s for s in (signal.SIGTERM, getattr(signal, "SIGUSR1", None)) if s is not None)
        self.notice = notice
        self.kinds = {s: _TERMINATE for s in signals} | {s: _REQUEUE for s in requeue_signals}
        self.reason: str | None = None
        self.kind = 0
        self._previous: dict[signal.Signals, Any] = {}
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Installs the flag-only handlers (main thread only) and starts polling the notice."""
        self.reason, self.kind = None, 0
        if threading.current_thread() is threading.main_thread():
            for signum in self.kinds:
                self._previous.setdefault(signum, signal.signal(signum, self._on_signal))
        else:
            rank_zero_warn("VarunaStrategy: not in the main thread, so preemption signals are not handled.",
                           category=VarunaWarning)
        if self.notice is not None and self._thread is None:
            self._stopping = threading.Event()  # one per thread: a thread still in a request sees its own
            self._thread = threading.Thread(
                target=self._poll, args=(self.notice, self._stopping), name="varuna-preemption-notice", daemon=True
            )
            self._thread.start()

    def stop(self, exiting: bool = False) -> None:
        """Puts the previous handlers back and stops polling.

        Args:
            exiting: Ignore these signals from now on instead (a preempted process on its way out: a launcher that
                stops the stragglers with SIGTERM, as torchrun does once the first worker has exited, would end
                them with -15 instead of their exit status). An ignored signal stays ignored while the interpreter
                shuts down, whereas Python's own handlers are dropped before the end of it.
        """
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_IGN if exiting else handler)
        self._previous = {}
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None

    def set(self, reason: str, kind: int = _TERMINATE) -> None:
        """Records a warning (the first reason is kept; a requeue outranks a terminate)."""
        if self.reason is None:
            self.reason = reason
        self.kind = max(self.kind, kind)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # only a flag: no collective, no I/O (the other ranks may be in the middle of a step)
        self.set(signal.Signals(signum).name, self.kinds.get(signal.Signals(signum), _TERMINATE))

    def _poll(self, notice: PreemptionNotice, stopping: threading.Event) -> None:
        while not stopping.wait(notice.interval):
            try:
                reason = notice.poll()
            except Exception as err:  # noqa: BLE001 - a broken notice source must not end training
                log.warning("Preemption notice %r failed: %s", notice, err)
                continue
            if reason is not None and not stopping.is_set():
                self.set(reason)
                return


class PreemptionGuard:
    """Watches for a preemption during ``fit`` and, once any rank is warned, stops every rank together.

    :meth:`attach` takes over from Lightning's signal handling for this fit: Lightning's handlers are not
    installed (its SIGTERM handler broadcasts inside the handler, its SLURM handler saves a checkpoint
    there), and the start of every training batch agrees on the flag with an all-reduce (MAX) in place of
    Lightning's broadcast of rank 0's SIGTERM flag, so agreement costs no extra collective.

    Args:
        trainer: The trainer, during ``strategy.setup`` of a fit.
        notice: A notice source to poll, if any.
        device: The device of the agreement's tensor.
        topology: The process grid (names this rank in errors).
    """

    agreed_by: Callable[[], int] | None = None
    """Where the agreed warning comes from when another collective already carries it (in-place recovery's commit);
    None: the agreement's own all-reduce at every batch's start."""

    def __init__(self, trainer: Trainer, notice: PreemptionNotice | None, device: torch.device,
                 topology: Topology | None = None) -> None:
        self.trainer = trainer
        self.device = device
        self.topology = topology
        self.preempted = False
        environment = trainer._accelerator_connector.cluster_environment
        requeue: tuple[signal.Signals, ...] = ()
        slurm = environment if isinstance(environment, SLURMEnvironment) else None
        self.slurm_requeue = slurm is not None and slurm.auto_requeue
        if slurm is not None and self.slurm_requeue and slurm.requeue_signal is not None:
            requeue = (slurm.requeue_signal,)
        terminate = tuple(s for s in (signal.SIGTERM, getattr(signal, "SIGUSR1", None))
                          if isinstance(s, signal.Signals) and s not in requeue)
        self.watch = PreemptionWatch(notice, terminate, requeue)
        self._patches = InstancePatches()

    def attach(self) -> None:
        """Replaces Lightning's signal handling for this fit and starts watching."""
        take_over_sigterm(self._patches, self.trainer, self.agree)
        if self.checkpoint_callback() is None:
            rank_zero_warn(
                f"VarunaStrategy: no ModelCheckpoint callback, so a preemption writes its checkpoint to"
                f" {self.checkpoint_path()}, where `ckpt_path='last'` does not look. Add"
                " `ModelCheckpoint(dirpath=...)` to resume with `ckpt_path='last'`.",
                category=VarunaWarning,
            )
        self.watch.start()

    def detach(self) -> None:
        """Stops watching and gives Lightning its signal handling back.

        After a preemption the signals are ignored instead, so that every rank exits with
        :data:`PREEMPTED_EXIT_CODE`: torchrun sends SIGTERM to the workers still running once the first one has
        exited, and they are only finishing their exit.
        """
        self.watch.stop(exiting=self.preempted)
        self._patches.undo()

    def checkpoint_callback(self) -> ModelCheckpoint | None:
        """The first ``ModelCheckpoint`` (``ckpt_path="last"`` searches its ``dirpath``)."""
        return next((c for c in self.trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)), None)

    def checkpoint_path(self) -> str:
        """``last.ckpt`` in the ``ModelCheckpoint``'s directory (a path or URL), else in ``default_root_dir``."""
        callback = self.checkpoint_callback()
        if callback is None or callback.dirpath is None:
            return os.path.join(self.trainer.default_root_dir, "last.ckpt")
        name = callback.CHECKPOINT_NAME_LAST
        name = name if "{" not in name else "last"  # a formatted last name is not what "last" searches for
        return os.path.join(callback.dirpath, f"{name}{callback.FILE_EXTENSION}")

    def agree(self) -> None:
        """At a step boundary, on every rank: stops the job if any rank has been warned."""
        if self.agreed_by is not None:  # agreed already, by the collective that ended the last step
            self._decide(self.agreed_by())
            return
        flag = torch.tensor([self.watch.kind], dtype=torch.int64, device=self.device)
        if self.trainer.world_size > 1:
            # a rank already known to be dead or failed can neither agree nor help write a checkpoint
            check_job("the preemption agreement")
            if self.topology is not None:
                waiting_on_peers(self.topology, "agreeing on preemption warnings (all-reduce over every rank)",
                                 lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX))
            else:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self._decide(int(flag.item()))

    def _decide(self, kind: int) -> None:
        # the partial gradient sums of an accumulation window are not in checkpoints: stop where one begins (the
        # warned rank keeps its flag, so the agreement repeats at every batch until then)
        accumulate = self.trainer.accumulate_grad_batches
        at_window_start = self.trainer.fit_loop.epoch_loop.batch_progress.current.ready % accumulate == 0
        if kind and at_window_start:
            self._stop(kind)

    def _stop(self, kind: int) -> None:
        trainer = self.trainer
        path = self.checkpoint_path()
        reason = self.watch.reason or "another rank was warned"
        if self.watch.reason is not None:
            log.warning("VarunaStrategy: rank %d: preemption warning (%s)", trainer.global_rank, reason)
        rank_zero_info(
            f"VarunaStrategy: preempted after {trainer.global_step} optimizer steps; saving {path} on every rank."
        )
        if trainer.is_global_zero and os.path.islink(path):  # ModelCheckpoint(save_last="link")
            os.unlink(path)
        trainer.save_checkpoint(path)
        flush = getattr(trainer.strategy, "wait_for_checkpoint", None)
        if flush is not None:  # an asynchronous write must be on disk before SLURM or the cloud ends the job
            flush()
        if kind == _REQUEUE and self.slurm_requeue and trainer.is_global_zero:
            requeue_slurm_job()
        self.preempted = True
        watchdog = current_watchdog()
        if watchdog is not None:  # the checkpoint is complete: this rank's exit is no failure for the others
            watchdog.deactivate("preempted")
        rank_zero_info(
            f"VarunaStrategy: checkpoint written; every process exits with {PREEMPTED_EXIT_CODE}."
            " Resume with `trainer.fit(..., ckpt_path='last')`."
        )
        raise Preempted(reason, path)


def requeue_slurm_job() -> None:
    """Asks SLURM to requeue this job (``scontrol requeue``), as Lightning's auto-requeue does."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ.get('SLURM_ARRAY_TASK_ID')}" if array_job else os.environ.get("SLURM_JOB_ID")
    if not job:
        log.warning("VarunaStrategy: no SLURM_JOB_ID: the job was not requeued.")
        return
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.warning("VarunaStrategy: could not requeue SLURM job %s: %s", job, err)
        return
    if result.returncode == 0:
        rank_zero_info(f"VarunaStrategy: requeued SLURM job {job}.")
    else:
        log.warning("VarunaStrategy: `scontrol requeue %s` failed: %s", job, result.stderr.strip())
