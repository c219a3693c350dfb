"""Writing one strategy's checkpoints: blocking, or handed to a writer process per rank.

:class:`CheckpointWriter` runs :func:`~lightning_varuna.checkpoint.job.write_job` in the calling thread (a blocking
save), or, with ``asynchronous=True``, hands it to this rank's helper process
(:mod:`lightning_varuna.checkpoint.background`), which runs it over the helpers' own process group while training
goes on; a failure is raised at the next save (or at the end of the run).
"""

from __future__ import annotations

import logging
import os
import pickle
import time
import uuid
from collections.abc import Hashable, Sequence
from datetime import timedelta
from typing import Any, cast

import torch.distributed as dist
from torch import Tensor

from lightning_varuna.checkpoint.background import WriterProcess, hollow, map_tensors
from lightning_varuna.checkpoint.job import WriteJob, write_job
from lightning_varuna.checkpoint.lease import LeaseTicket
from lightning_varuna.checkpoint.publish import remove_quietly
from lightning_varuna.checkpoint.state import CheckpointError, split_shards
from lightning_varuna.checkpoint.storage import Location, to_bytes
from lightning_varuna.failstop.failures import raised_on_every_rank

__all__ = ["CheckpointWriter"]

log = logging.getLogger(__name__)

_DEFAULT_TIMEOUT_S = 1800.0


class CheckpointWriter:
    """Writes one strategy's checkpoints (collective calls), blocking or by a helper process per rank.

    Args:
        asynchronous: ``save`` copies this rank's tensors into shared memory and returns; this rank's helper
            process (started by :meth:`start`) writes them, and rank 0's helper publishes the checkpoint once
            every rank's shards are written. A second save waits for the first, unless it saves the very
            tensors staged for the write in flight (``ModelCheckpoint(save_last=True)`` saving ``last.ckpt``
            after the step's checkpoint): then it is queued behind it, nothing copied. :meth:`remove` calls for
            older checkpoints take effect once the write sent before them has succeeded (dropped if it fails).
        timeout: Timeout of the helpers' process group (default 30 minutes).
    """

    def __init__(self, asynchronous: bool = False, timeout: timedelta | None = None) -> None:
        self.asynchronous = asynchronous
        self._timeout = timeout
        self._process: WriterProcess | None = None
        self._pending = 0  # writes handed to the helper whose outcome has not been collected
        self._staged_key: Hashable | None = None  # the state_key of the last save handed to the helper
        self._error: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        # a copy (a pickled or deep-copied strategy) starts with nothing in flight
        return {"asynchronous": self.asynchronous, "timeout": self._timeout}

    def __setstate__(self, state: dict[str, Any]) -> None:
        type(self).__init__(self, **state)

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
        run = cast(str, token[0])  # rank 0's token, now on every rank
        self._process = WriterProcess(dist.get_rank(), dist.get_world_size(), run, self._timeout_s)

    @property
    def in_flight(self) -> bool:
        """Whether a background write has not finished yet."""
        return not self.wait(0)

    def save(
        self,
        path: str | os.PathLike[str],
        shards: dict[str, Any],
        metadata: dict[str, Any],
        groups: Sequence[list[list[str]]] = (),
        param_names: Sequence[str] = (),
        verify: bool = True,
        lease: LeaseTicket | None = None,
        state_key: Hashable | None = None,
    ) -> None:
        """Writes a checkpoint directory atomically (collective: every rank calls it).

        Args:
            path: The checkpoint directory to create or replace (local path or fsspec URL).
            shards: ``{"state_dict": ..., "optimizer_0": ...}`` as held by this rank, keyed by name.
            metadata: Everything else Lightning saves (only rank 0's is written).
            groups: This rank's optimizer groups by parameter name (:func:`param_groups_by_name`).
            param_names: The full model's parameter names in ``named_parameters()`` order.
            verify: Record checksums, and refuse to publish parameters that are not finite.
            lease: Rank 0: the lease to take on the checkpoint's folder (:mod:`~lightning_varuna.checkpoint.lease`).
            state_key: The same on every rank for one training state (e.g. epoch and step): a save with the key of
                the write in flight is queued behind it, and its failure is raised at a later save.

        Raises:
            CheckpointError: On every rank, if this write (blocking) or the background write before it failed.
        """
        meta, problem = None, None
        if dist.get_rank() == 0:
            try:
                meta = to_bytes(metadata)
            except Exception as err:  # noqa: BLE001 - agreed on by every rank, then raised
                problem = f"rank 0 could not prepare the write: {type(err).__name__}: {err}"
        groups = [g for i, g in enumerate(groups) if f"optimizer_{i}" in shards]  # none with save_weights_only
        shards, hyper = split_shards(shards, groups)
        target = Location.of(path).text
        # a tensor hyper-parameter (a scheduler's lr) must not bring CUDA into the writer process
        hyper = map_tensors(lambda t: t.detach().cpu(), hyper)
        job = WriteJob(target, shards, meta, list(groups), hyper, list(param_names), problem, verify,
                       lease if dist.get_rank() == 0 else None)
        if not self.asynchronous or self._process is None:  # outside fit (no writer started): blocking
            self._raise_previous_error()
            error = write_job(job, None)
            if error is not None:
                log.error(f"Writing checkpoint {target} failed ({error}); older checkpoints are kept.")
                raise raised_on_every_rank(CheckpointError(f"Could not write checkpoint {target}: {error}"))
            return
        tensors: list[Tensor] = []
        job.shards = hollow(shards, tensors)
        # the same state saved again at once (last.ckpt after the step's checkpoint) is queued behind the write
        # in flight, from its staged copy: training does not wait for that write. The choice to wait and raise is
        # made on every rank alike (from the key); the staged copy is checked on each rank, and one that differs
        # (the user changed weights between the two saves) waits for its own write, raising nothing yet
        same_state = self._pending > 0 and state_key is not None and state_key == self._staged_key
        staged = same_state and self._process.holds(tensors)
        if not same_state:
            self._raise_previous_error()
        elif not staged:
            self.wait()
        self._staged_key = state_key
        loc = Location.of(target)
        try:
            try:
                self._process.submit(job, tensors, type(loc.fs) if loc.url else None, staged)
            except pickle.PicklingError as err:
                # the other ranks' writers are about to wait for this one: it joins them with the problem instead
                problem = f"rank {dist.get_rank()} could not hand its state to the writer: {err}"
                self._process.submit(WriteJob(target, {}, None, [], [], [], problem), [])
        except ValueError as err:
            raise CheckpointError(str(err)) from None
        except (ConnectionError, EOFError):
            # this rank's helper is gone: the other helpers' write fails too, and every rank raises where it waits
            # for this write's outcome (here: the helper's end), like the others for theirs
            log.error(f"Writing checkpoint {target} failed ({self._process.ended()}); older checkpoints are kept.")
        self._pending += 1

    def _raise_previous_error(self) -> None:
        """Waits for the writes in flight; raises their failure (agreed by every rank at the end of each write)."""
        self.wait()
        error = self._take_error()
        if error is not None:
            raise raised_on_every_rank(CheckpointError(f"The previous checkpoint could not be written: {error}"))

    def _take_error(self) -> str | None:
        error, self._error = self._error, None
        return error

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for the background writes in flight, if any; returns whether none is left running."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._pending:
            assert self._process is not None
            done, error = self._process.outcome(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if not done:
                return False
            self._pending -= 1
            if error is not None:
                self._error = self._error or error  # the first failure is the one to report
                log.error(f"Writing a checkpoint failed ({error}); older checkpoints are kept.")
        return True

    def remove(self, path: str | os.PathLike[str]) -> None:
        """Deletes a checkpoint (call on rank 0); while a write is in flight, once it has succeeded."""
        loc = Location.of(path)
        if self.wait(0):
            if self._error is None:
                remove_quietly(loc)
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

    def abort(self) -> None:
        """Kills the helper process at once: the job is ending after a failure, and no write in flight can complete."""
        if self._process is not None:
            self._process.kill()

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
            self._pending = 0
        if not finished:
            log.error("A background checkpoint write did not finish in time; it stays unpublished (not loadable).")
            return
        error = self._take_error()
        if error is not None and not interrupted:
            raise CheckpointError(f"The last checkpoint could not be written: {error}")
