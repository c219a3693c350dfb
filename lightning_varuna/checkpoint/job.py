"""One checkpoint write, collective over a process group, ending with every rank's agreement on the outcome.

Rank 0 first takes the folder's lease and finishes what an interrupted publication left; every rank then runs
``torch.distributed.checkpoint.save`` (DCP's planner writes each tensor once, replicas sharing the writing,
and takes each item's checksum on the way); rank 0 adds the parameter record (with the checksums) and
``meta.pt`` and publishes the checkpoint (:mod:`~lightning_varuna.checkpoint.publish`). The same sequence runs in
the training process (a blocking save) or in the writer processes
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
from torch.distributed.checkpoint.api import CheckpointException

from lightning_varuna.checkpoint import lease as leases
from lightning_varuna.checkpoint.integrity import ALGORITHM, CHECKSUMS, ChecksumSavePlanner, checksum
from lightning_varuna.checkpoint.publish import TMP_SUFFIX, publish, recover, remove_checkpoint, remove_quietly
from lightning_varuna.checkpoint.state import RECORD, Groups, make_record, split_shards
from lightning_varuna.checkpoint.storage import INDEX, META, Location, is_complete, single_process_quiet, to_bytes

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
        verify: Take checksums, and refuse parameters that are not finite.
        lease: Rank 0: the lease to take on the target's folder (``None``: none is taken).
    """

    target: str
    shards: dict[str, Any]
    meta: bytes | None
    groups: Groups
    hyper: list[list[dict[str, Any] | None]]
    param_names: list[str]
    problem: str | None = None
    verify: bool = True
    lease: leases.LeaseTicket | None = None


def write_job(job: WriteJob, group: dist.ProcessGroup | None) -> str | None:
    """Writes a checkpoint (collective over ``group``) and returns the error every rank agrees on, if any."""
    target = Location.of(job.target)
    tmp = target.with_suffix(TMP_SUFFIX)
    problem = job.problem
    if job.meta is not None and problem is None:
        problem = _prepare(job, target, tmp)
    try:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (job.target, job.groups, job.hyper, problem), group=group)
        problem = next((str(p) for *_, p in gathered if p is not None), None)
        if problem is not None:  # seen alike by every rank: no write, no further collective
            return problem
        paths = sorted({path for path, *_ in gathered})
        if len(paths) > 1:
            return f"the ranks were given different paths ({', '.join(paths)}); give every rank the same one"
        planner = ChecksumSavePlanner(_parameter_keys(job) if job.verify else ())
        error = None
        try:
            dcp.save(job.shards, storage_writer=tmp.writer(), planner=planner, process_group=group)
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP raises it on every rank (not an Exception)
            log.debug("checkpoint write failed", exc_info=True)
            error = _describe(err)
        # rank 0 (the one with meta) alone reads the checksums, publishes, and tells every rank the outcome
        root = dist.get_global_rank(group, 0) if group is not None else 0
        written: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(planner.checksums if job.verify else None, written, dst=root, group=group)
        outcome: list[str | None] = [error]
        if written is not None:
            if error is None:
                outcome[0] = _publish(job, target, tmp, [(g, h) for _, g, h, _ in gathered], written)
            if outcome[0] is not None and not is_complete(tmp):  # a complete one is the newest: it stays
                remove_quietly(tmp)
        dist.broadcast_object_list(outcome, src=root, group=group)
        return outcome[0]
    except Exception as err:  # noqa: BLE001 - a peer lost during the collectives
        return f"{type(err).__name__}: {err}"


def _prepare(job: WriteJob, target: Location, tmp: Location) -> str | None:
    """Rank 0, before the write: the folder's lease, an interrupted publication finished, ``tmp`` cleared."""
    try:
        if job.lease is not None:
            problem = leases.take(target.parent, job.lease.holder, job.lease.timeout_s)
            if problem is not None:
                return problem
        recover(target)
        remove_checkpoint(tmp)
    except Exception as err:  # noqa: BLE001 - agreed on by every rank, then raised
        return f"rank 0 could not prepare the write: {type(err).__name__}: {err}"
    return None


def _publish(
    job: WriteJob, target: Location, tmp: Location, members: list[tuple[Groups, Any]], checksums: list[Any]
) -> str | None:
    """Rank 0, after every rank's write: the record (with the checksums) and ``meta.pt`` in, then in place."""
    assert job.meta is not None
    try:
        record = make_record(job.param_names, members)
        if job.verify:
            files = {META: checksum(job.meta), INDEX: checksum(tmp.child(INDEX).read_bytes())}
            items = {key: value for part in checksums for key, value in part.items()}
            record[CHECKSUMS] = {"algorithm": ALGORITHM, "files": files, "items": items}
        publish(tmp, target, job.meta, to_bytes(record))
        if job.lease is not None and not job.lease.keep:
            leases.release(target.parent, job.lease.holder)
    except Exception as err:  # noqa: BLE001 - agreed on by every rank, then raised
        log.debug("checkpoint publication failed", exc_info=True)
        return f"rank 0: {type(err).__name__}: {err}"
    return None


def _parameter_keys(job: WriteJob) -> list[str]:
    return [f"state_dict.{name}" for name in job.param_names]


def _describe(err: BaseException) -> str:
    """One line for a failed ``dcp.save``: the first failing rank's own error, not DCP's wrapper of all of them."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        failure = failures[rank]
        inner = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {type(inner).__name__}: {inner}"
    return f"{type(err).__name__}: {err}"


def write_single(
    path: str | os.PathLike[str], shards: dict[str, Any], metadata: dict[str, Any], groups: Groups,
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
    tmp = target.with_suffix(TMP_SUFFIX)
    recover(target)
    remove_checkpoint(tmp)
    shards, hyper = split_shards(shards, groups)
    planner = ChecksumSavePlanner()
    with single_process_quiet():
        dcp.save(shards, storage_writer=tmp.writer(), planner=planner, no_dist=True)
    meta = to_bytes({key: value for key, value in metadata.items() if key != RECORD})
    record = make_record(param_names, [(groups, hyper)])
    files = {META: checksum(meta), INDEX: checksum(tmp.child(INDEX).read_bytes())}
    record[CHECKSUMS] = {"algorithm": ALGORITHM, "files": files, "items": planner.checksums}
    publish(tmp, target, meta, to_bytes(record))
