"""One checkpoint write, collective over a process group, ending with every rank's agreement on the outcome.

Every rank writes its shards; rank 0 then writes the index, ``meta.pt`` and moves it into place. The same
sequence runs in the training process (a blocking save) or in the writer processes
(:mod:`lightning_varuna.checkpoint.background`). :func:`write_single` writes a whole model's checkpoint from one
process (conversion).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lightning_varuna.checkpoint import format as checkpoint_format
from lightning_varuna.checkpoint import storage as files
from lightning_varuna.checkpoint.load import single_process_quiet
from lightning_varuna.checkpoint.state import RECORD, Groups, make_record, split_shards
from lightning_varuna.checkpoint.storage import Location

__all__ = ["WriteJob", "write_job", "write_single"]

log = logging.getLogger(__name__)


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
    rank then writes the shards it is assigned under the temporary name (:mod:`~lightning_varuna.checkpoint.format`:
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
    """The write of a state that :mod:`~lightning_varuna.checkpoint.format` does not flatten: DCP's own save."""
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
