"""Writing checkpoints: every rank's shards with DCP, then ``meta.pt`` and the move into place by rank 0.

:func:`write_job` is that sequence, collective over a process group, ending with every rank's agreement on
the outcome. :class:`CheckpointWriter` runs it in the calling thread (a blocking save), or, with
``asynchronous=True``, hands it to this rank's helper process (:mod:`lightning_varuna.checkpoint_process`),
which runs it over the helpers' own process group while training goes on; a failure is raised at the next
save (or at the end of the run).
"""

from __future__ import annotations

import logging
import os
import pickle
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.utils._pytree import tree_map_only

from lightning_varuna import checkpoint_files as files
from lightning_varuna import checkpoint_format
from lightning_varuna.checkpoint import (
    RECORD,
    CheckpointError,
    Groups,
    make_record,
    single_process_quiet,
    split_shards,
)
from lightning_varuna.checkpoint_files import Location
from lightning_varuna.checkpoint_process import WriterProcess, hollow

__all__ = ["CheckpointWriter", "WriteJob", "write_job", "write_single"]

log = logging.getLogger(__name__)

_DEFAULT_TIMEOUT_S = 1800.0


@dataclass
class WriteJob:
    """One rank's share of a checkpoint write (picklable: it travels to the helper process).

    Attributes:
        target: Where the checkpoint goes (local path or fsspec URL, as given).
        shards: ``{"state_dict": ..., "optimizer_0": ...}`` held by this rank, optimizer states without the
            per-parameter copies of the group hyper-parameters.
        meta: Rank 0: ``meta.pt``'s content without the parameter record; ``None`` elsewhere.
        groups: This rank's optimizer groups by parameter name.
        hyper: Each of this rank's optimizer groups' hyper-parameters.
        param_names: The full model's parameter names in ``named_parameters()`` order.
        problem: Found before the write: every rank fails the save alike.
    """

    target: str
    shards: dict[str, Any]
    meta: bytes | None
    groups: Groups
    hyper: list[list[dict | None]]
    param_names: list[str]
    problem: str | None = None


def write_job(job: WriteJob, group: dist.ProcessGroup | None) -> str | None:
    """Writes a checkpoint (collective over ``group``) and returns the error every rank agrees on, if any.

    Rank 0 first puts back what an interrupted replacement left and clears the temporary directory; every
    rank then writes the shards it is assigned under the temporary name (:mod:`~lightning_varuna.checkpoint_format`:
    DCP's format, without DCP's planning protocol), and rank 0 writes DCP's index, adds ``record.pt`` (the
    parameter record of every rank's groups) and ``meta.pt`` and moves it into place.
    """
    target = Location.of(job.target)
    tmp = target.with_suffix(files.TMP_SUFFIX)
    problem = job.problem
    if job.meta is not None and problem is None:
        try:
            files.recover(target)
            tmp.remove()
        except Exception as err:  # noqa: BLE001 - agreed on by every rank, then raised
            problem = f"rank 0 could not prepare the write: {type(err).__name__}: {err}"
    flat, held = None, None
    try:
        flat = checkpoint_format.flatten(job.shards)
        held = checkpoint_format.inventory(flat)
    except checkpoint_format.UnsupportedState:
        pass  # this rank's state is written by dcp.save, and so every rank's
    except Exception as err:  # noqa: BLE001 - agreed on by every rank, then raised
        problem = problem or f"rank {dist.get_rank(group)} could not list its state: {type(err).__name__}: {err}"
    try:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (job.target, job.groups, job.hyper, problem, held), group=group)
        paths = sorted({path for path, *_ in gathered})
        problem = next((p for _, _, _, p, _ in gathered if p is not None), None)
        if problem is not None:  # seen alike by every rank: no write, no further collective
            return problem
        if len(paths) > 1:
            return f"the ranks were given different paths ({', '.join(paths)}); give every rank the same one"
        inventories = [h for *_, h in gathered]
        members = [(g, h) for _, g, h, _, _ in gathered]
        if any(h is None for h in inventories):
            return _write_with_dcp(job, tmp, target, members, group)
        part, error = None, None
        try:
            mine = checkpoint_format.assign(inventories)[rank]
            part = checkpoint_format.write_items(tmp, rank, flat, mine)  # type: ignore[arg-type]
        except Exception as err:  # noqa: BLE001 - agreed on by every rank, then raised
            log.debug("checkpoint write failed", exc_info=True)
            error = f"{type(err).__name__}: {err}"
        # rank 0 (the one with meta) alone reads the parts, publishes, and tells every rank the outcome
        root = dist.get_global_rank(group, 0) if group is not None else 0
        written: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object((part, error), written, dst=root, group=group)
        outcome: list[str | None] = [None]
        if written is not None:
            outcome[0] = next((f"rank {r}: {e}" for r, (_, e) in enumerate(written) if e is not None), None)
            if outcome[0] is None:
                try:
                    expected = {key for listed in inventories for key, _ in listed}
                    checkpoint_format.write_index(tmp, [p for p, _ in written], expected)
                    record = files.to_bytes(make_record(job.param_names, members))
                    files.publish(tmp, target, job.meta, record)  # type: ignore[arg-type]
                except Exception as err:  # noqa: BLE001 - agreed on by every rank, then raised
                    log.debug("checkpoint publication failed", exc_info=True)
                    outcome[0] = f"rank 0: {type(err).__name__}: {err}"
        dist.broadcast_object_list(outcome, src=root, group=group)
        return outcome[0]
    except Exception as err:  # noqa: BLE001 - a peer lost during the collectives
        return f"{type(err).__name__}: {err}"


def _write_with_dcp(
    job: WriteJob, tmp: Location, target: Location, members: list[tuple[Groups, Any]], group: dist.ProcessGroup | None
) -> str | None:
    """The write of a state that :mod:`~lightning_varuna.checkpoint_format` does not flatten: DCP's own save."""
    error = None
    try:
        dcp.save(job.shards, storage_writer=tmp.writer(), process_group=group)
        if job.meta is not None:
            # DCP's coordinator returns only after every rank's write: all shards are in
            files.publish(tmp, target, job.meta, files.to_bytes(make_record(job.param_names, members)))
    except Exception as err:  # noqa: BLE001 - agreed on by every rank, then raised
        log.debug("checkpoint write failed", exc_info=True)
        error = f"{type(err).__name__}: {err}"
    return _agree(error, group)


def _agree(error: str | None, group: dist.ProcessGroup | None) -> str | None:
    """The first rank's error, on every rank (collective)."""
    errors: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None), None)


class CheckpointWriter:
    """Writes one strategy's checkpoints (collective calls), blocking or by a helper process per rank.

    Args:
        asynchronous: ``save`` copies this rank's tensors into shared memory and returns; this rank's helper
            process (started by :meth:`start`) writes them, and rank 0's helper publishes the checkpoint once
            every rank's shards are written. A second save waits for the first; :meth:`remove` calls for
            older checkpoints take effect once the write in flight has succeeded (they are dropped if it fails).
        timeout: Timeout of the helpers' process group (default 30 minutes).
    """

    def __init__(self, asynchronous: bool = False, timeout: timedelta | None = None) -> None:
        self.asynchronous = asynchronous
        self._timeout = timeout
        self._process: WriterProcess | None = None
        self._busy = False
        self._error: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        # a copy (a pickled or deep-copied strategy) starts with nothing in flight
        return {"asynchronous": self.asynchronous, "timeout": self._timeout}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    @property
    def _timeout_s(self) -> float:
        return self._timeout.total_seconds() if self._timeout is not None else _DEFAULT_TIMEOUT_S

    def start(self) -> None:
        """Starts this rank's helper process, if asynchronous and not started (collective: every rank calls it).

        The helper imports torch and joins the others while training goes on; call it early (the strategy does,
        at the start of ``fit``) so that the first save does not wait for that.
        """
        if not self.asynchronous or self._process is not None:
            return
        token = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(token, 0)
        self._process = WriterProcess(dist.get_rank(), dist.get_world_size(), token[0], self._timeout_s)

    @property
    def in_flight(self) -> bool:
        """Whether a background write has not finished yet."""
        return not self.wait(0)

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
        meta, problem = None, None
        if dist.get_rank() == 0:
            try:
                meta = files.to_bytes(metadata)
            except Exception as err:  # noqa: BLE001 - agreed on by every rank, then raised
                problem = f"rank 0 could not prepare the write: {type(err).__name__}: {err}"
        groups = [g for i, g in enumerate(groups) if f"optimizer_{i}" in shards]  # none with save_weights_only
        shards, hyper = split_shards(shards, groups)
        target = Location.of(path).text
        # a tensor hyper-parameter (a scheduler's lr) must not bring CUDA into the writer process
        hyper = tree_map_only(Tensor, lambda t: t.detach().cpu(), hyper)
        job = WriteJob(target, shards, meta, list(groups), hyper, list(param_names), problem)
        if not self.asynchronous or self._process is None:  # outside fit (no writer started): blocking
            error = write_job(job, None)
            if error is not None:
                log.error(f"Writing checkpoint {target} failed ({error}); older checkpoints are kept.")
                raise CheckpointError(f"Could not write checkpoint {target}: {error}")
            return
        tensors: list[Tensor] = []
        job.shards = hollow(shards, tensors)
        loc = Location.of(target)
        try:
            try:
                self._process.submit(job, tensors, type(loc.fs) if loc.url else None)
            except pickle.PicklingError as err:
                # the other ranks' writers are about to wait for this one: it joins them with the problem instead
                problem = f"rank {dist.get_rank()} could not hand its state to the writer: {err}"
                self._process.submit(WriteJob(target, {}, None, [], [], [], problem), [])
        except ValueError as err:
            raise CheckpointError(str(err)) from None
        except (ConnectionError, EOFError):
            # this rank's helper is gone: the other helpers' write fails too, and every rank raises at the next save
            self._error = self._process.ended()
            log.error(f"Writing checkpoint {target} failed ({self._error}); older checkpoints are kept.")
            return
        self._busy = True

    def _take_error(self) -> str | None:
        error, self._error = self._error, None
        return error

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for the background write in flight, if any; returns whether none is left running."""
        if not self._busy:
            return True
        assert self._process is not None
        done, error = self._process.outcome(timeout)
        if not done:
            return False
        self._busy = False
        self._error = error
        if error is not None:
            log.error(f"Writing a checkpoint failed ({error}); older checkpoints are kept.")
        return True

    def remove(self, path: str | os.PathLike) -> None:
        """Deletes a checkpoint (call on rank 0); while a write is in flight, once it has succeeded."""
        loc = Location.of(path)
        if self.wait(0):
            if self._error is None:
                files.remove_quietly(loc)
            else:  # the write that was to replace it failed (raised at the next save): keep it
                log.warning(f"Keeping checkpoint {loc}: the checkpoint written after it failed.")
        else:
            assert self._process is not None
            self._process.remove_after(loc.text)

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
        """Waits for the write in flight (at the end of a run), stops the helper, reports a failure.

        Args:
            interrupted: The run ends with an exception: a failure is logged instead of raised.

        Raises:
            CheckpointError: The last background write failed (not ``interrupted``).
        """
        finished = self.wait(self._timeout_s)
        if self._process is not None:
            self._process.close()
            self._process = None
            self._busy = False
        if not finished:
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
    try:
        flat = checkpoint_format.flatten(shards)
    except checkpoint_format.UnsupportedState:
        with single_process_quiet():
            dcp.save(shards, storage_writer=tmp.writer(), no_dist=True)
    else:
        part = checkpoint_format.write_items(tmp, 0, flat, set(flat))
        checkpoint_format.write_index(tmp, [part], flat)
    files.publish(tmp, target, files.to_bytes({**metadata, RECORD: make_record(param_names, [(groups, hyper)])}))
