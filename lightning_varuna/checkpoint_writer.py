"""Writing checkpoints: every rank's shards with DCP, then ``meta.pt`` and the move into place by rank 0.

:class:`CheckpointWriter` runs that sequence in the calling thread, or, with ``asynchronous=True``, on copies
of this rank's tensors in a background thread: its collectives (DCP's, and the gathers of the parameter
record and of the outcome) go over a gloo group of its own, so they never interleave with the training
thread's. Rank 0 publishes once DCP's coordinator reports every rank's shards written. Every rank learns the
outcome at the end of each write; a failure is raised at the next save (or at the end of the run).
"""

from __future__ import annotations

import io
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor

from lightning_varuna import checkpoint_files as files
from lightning_varuna.checkpoint import (
    RECORD,
    CheckpointError,
    Groups,
    make_record,
    single_process_quiet,
    split_shards,
)
from lightning_varuna.checkpoint_files import Location

__all__ = ["CheckpointWriter", "write_single"]

log = logging.getLogger(__name__)


@dataclass
class _Job:
    target: Location
    tmp: Location
    shards: dict[str, Any]
    meta: bytes | None  # rank 0 publishes
    groups: Groups
    hyper: list[list[dict | None]]
    param_names: list[str]
    problem: str | None = None  # found before the write (rank 0): every rank fails the save alike


class CheckpointWriter:
    """Writes one strategy's checkpoints (collective calls), blocking or in the background.

    Args:
        asynchronous: ``save`` copies this rank's tensors and returns; a background thread writes them, over a
            process group of its own, and rank 0 publishes the checkpoint once every rank's shards are written.
            A second save waits for the first; :meth:`remove` calls for older checkpoints wait until the write
            in flight has succeeded (they are dropped if it fails).
        timeout: Timeout of the background writes' process group.
    """

    def __init__(self, asynchronous: bool = False, timeout: timedelta | None = None) -> None:
        self.asynchronous = asynchronous
        self._timeout = timeout
        self._group: dist.ProcessGroup | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._future: Future | None = None
        self._lock = threading.Lock()
        self._busy = False
        self._error: str | None = None
        self._removals: list[Location] = []

    def __getstate__(self) -> dict[str, Any]:
        # a copy (a pickled or deep-copied strategy) starts with nothing in flight
        return {"asynchronous": self.asynchronous, "timeout": self._timeout}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    @property
    def in_flight(self) -> bool:
        """Whether a background write has not finished yet."""
        with self._lock:
            return self._busy

    def save(
        self,
        path: str | os.PathLike,
        shards: dict[str, Any],
        metadata: dict[str, Any],
        groups: Groups = (),  # type: ignore[assignment]
        param_names: Sequence[str] = (),
    ) -> None:
        """Writes a checkpoint directory atomically (collective: every rank calls it).

        Args:
            path: The checkpoint directory to create or replace (local path or fsspec URL).
            shards: ``{"state_dict": ..., "optimizer_0": ...}`` as held by this rank, keyed by name.
            metadata: Everything else Lightning saves (only rank 0's is written).
            groups: This rank's optimizer groups by parameter name (:func:`param_groups_by_name`).
            param_names: The full model's parameter names in ``named_parameters()`` order.

        Raises:
            CheckpointError: On every rank, if this write (blocking) or the background write before it failed.
        """
        self.wait()
        error = self._take_error()  # agreed by every rank at the end of that write
        if error is not None:
            raise CheckpointError(f"The previous checkpoint could not be written: {error}")
        rank = dist.get_rank()
        target = Location.of(path)
        tmp = target.with_suffix(files.TMP_SUFFIX)
        meta, problem = None, None
        if rank == 0:
            # before any rank writes; a failure here travels with the job's first collective, so that every
            # rank raises it instead of waiting for rank 0
            try:
                files.recover(target)
                tmp.remove()
                meta = files.to_bytes(metadata)
            except Exception as err:  # noqa: BLE001 - agreed on by every rank, then raised
                problem = f"rank 0 could not prepare the write: {type(err).__name__}: {err}"
        groups = [g for i, g in enumerate(groups) if f"optimizer_{i}" in shards]  # none with save_weights_only
        shards, hyper = split_shards(shards, groups)
        if not self.asynchronous:
            job = _Job(target, tmp, shards, meta, list(groups), hyper, list(param_names), problem)
            self._run(job, None)
            error = self._take_error()
            if error is not None:
                raise CheckpointError(f"Could not write checkpoint {target}: {error}")
            return
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=self._timeout)
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="varuna-checkpoint")
        assert self._executor is not None
        job = _Job(target, tmp, _staged(shards), meta, list(groups), hyper, list(param_names), problem)
        with self._lock:
            self._busy = True
        self._future = self._executor.submit(self._run, job, self._group)

    def _run(self, job: _Job, group: dist.ProcessGroup | None) -> None:
        """Writes, publishes (rank 0) and agrees on the outcome; in the background thread if asynchronous."""
        error = None
        try:
            world = dist.get_world_size(group)
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, (job.target.text, job.groups, job.hyper, job.problem), group=group)
            paths = sorted({path for path, _, _, _ in gathered})
            problem = next((p for _, _, _, p in gathered if p is not None), None)
            if problem is not None:  # seen alike by every rank: no write, no further collective
                error = problem
            elif len(paths) > 1:
                error = f"the ranks were given different paths ({', '.join(paths)}); give every rank the same one"
            else:
                if job.meta is not None:
                    metadata = torch.load(io.BytesIO(job.meta), weights_only=False)
                    record = make_record(job.param_names, [(g, h) for _, g, h, _ in gathered])
                    job.meta = files.to_bytes({**metadata, RECORD: record})
                error = self._write(job, group)
                errors: list[Any] = [None] * world
                dist.all_gather_object(errors, error, group=group)
                error = next((f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None), None)
        except Exception as err:  # noqa: BLE001 - a peer lost during the collectives: reported at the next call
            error = error or f"{type(err).__name__}: {err}"
        with self._lock:
            self._error = error
            self._busy = False
            removals, self._removals = self._removals, []
        if error is not None:
            log.error(f"Writing checkpoint {job.target} failed ({error}); older checkpoints are kept.")
            return
        for loc in removals:
            files.remove_quietly(loc)

    def _write(self, job: _Job, group: dist.ProcessGroup | None) -> str | None:
        try:
            dcp.save(job.shards, storage_writer=job.tmp.writer(), process_group=group)
            if job.meta is not None:
                # DCP's coordinator returns only after every rank's write: all shards are in
                files.publish(job.tmp, job.target, job.meta)
        except Exception as err:  # noqa: BLE001 - agreed on by every rank, then raised
            log.debug("checkpoint write failed", exc_info=True)
            return f"{type(err).__name__}: {err}"
        return None

    def _take_error(self) -> str | None:
        with self._lock:
            error, self._error = self._error, None
        return error

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for the background write in flight, if any; returns whether none is left running."""
        future = self._future
        if future is None:
            return True
        try:
            future.result(timeout)
        except FutureTimeout:
            return False
        self._future = None
        return True

    def remove(self, path: str | os.PathLike) -> None:
        """Deletes a checkpoint (call on rank 0); while a write is in flight, once it has succeeded."""
        loc = Location.of(path)
        with self._lock:
            if self._busy:
                self._removals.append(loc)
                return
        files.remove_quietly(loc)

    def flush(self) -> None:
        """Waits for the background write in flight (if any) to be written and published.

        Raises:
            CheckpointError: On every rank, if that write failed.
        """
        self.wait()
        error = self._take_error()
        if error is not None:
            raise CheckpointError(f"The checkpoint could not be written: {error}")

    def close(self, interrupted: bool = False) -> None:
        """Waits for the write in flight (at the end of a run); reports its failure.

        Args:
            interrupted: The run ends with an exception: a failure is logged instead of raised.

        Raises:
            CheckpointError: The last background write failed (not ``interrupted``).
        """
        timeout = self._timeout.total_seconds() if self._timeout is not None else None
        if not self.wait(timeout):
            log.error("A background checkpoint write did not finish in time; it stays unpublished (not loadable).")
            return
        error = self._take_error()
        if error is not None and not interrupted:
            raise CheckpointError(f"The last checkpoint could not be written: {error}")


def write_single(
    path: str | os.PathLike, shards: dict[str, Any], metadata: dict[str, Any], groups: Groups,
    param_names: Sequence[str],
) -> None:
    """Writes a whole model's checkpoint from one process, without a process group (atomic).

    Args:
        path: The checkpoint directory to create or replace (local path or fsspec URL).
        shards: ``{"state_dict": ..., "optimizer_0": ...}``, optimizer states flat and keyed by name.
        metadata: Everything else (Lightning's loops, callbacks, hyper-parameters, ...).
        groups: Per optimizer, per parameter group, the parameter names.
        param_names: The model's parameter names in ``named_parameters()`` order.
    """
    target = Location.of(path)
    tmp = target.with_suffix(files.TMP_SUFFIX)
    tmp.remove()
    shards, hyper = split_shards(shards, groups)
    with single_process_quiet():
        dcp.save(shards, storage_writer=tmp.writer(), no_dist=True)
    files.publish(tmp, target, files.to_bytes({**metadata, RECORD: make_record(param_names, [(groups, hyper)])}))


def _staged(value: Any) -> Any:
    """A copy of every tensor (on the CPU), so that training can go on changing the originals."""
    if isinstance(value, Tensor):
        return value.detach().clone() if value.device.type == "cpu" else value.detach().to("cpu")
    if isinstance(value, dict):
        return {k: _staged(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_staged(v) for v in value)
    return value
