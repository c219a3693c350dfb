"""In-place recovery: when ranks die, the survivors go on inside the same ``fit``, on the same trajectory.

With ``VarunaStrategy(recovery="in_place")`` a peer's death does not end the survivors (see
:mod:`~lightning_varuna.failstop.abandon`): their waits give up with a ``PeersLost`` error
and each survivor, wherever that happened, runs :meth:`InPlaceRecovery.recover`:

1. the survivors agree on who is left, through the job's store
   (:func:`~lightning_varuna.failstop.survivors.agree_on_survivors`);
2. the old pipeline replicas that kept every stage stay, renumbered in order (each keeps its stages; a replica
   keeps its members, so its pipeline peers are the same processes); survivors of a replica that lost a stage are
   released: they exit with status 0, saying why. Without one complete replica the job cannot go on in place:
   the error ends every rank and the launcher's restart path takes over (the newest checkpoint);
3. a new default process group is formed over the survivors, every group of the pipeline is made again
   (pipeline, data-parallel, links, tied weights), and a new watchdog ring is started;
4. the data is split over the remaining replicas: the global batch stays the same (``global_batch_size``), so each
   replica reads a larger share, and the batches already fetched under the old layout are read again under the new;
5. the step in flight is settled all-or-nothing. Every rank makes one small all-reduce over the job once its
   gradients are final and clipped, just before the optimizer's update (the *commit*, which also carries the
   preemption warnings, so there is no other collective at a batch's start). A rank whose commit completed knows
   that every rank had reached it; so if any survivor committed, the survivors still waiting in that commit apply
   their update too; if none did, nobody updated, and the step is trained again from its first micro-batch on the
   new layout. Either way every survivor then trains the next step together, on the trajectory of the run without
   the failure.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities import rank_zero_warn

from lightning_varuna.failstop.abandon import PeersLost
from lightning_varuna.failstop.failures import PipelineError, waiting_on_peers
from lightning_varuna.failstop.job_watchdog import current_watchdog, watch_job
from lightning_varuna.failstop.survivors import Survivors, agree_on_survivors, form_new_world, job_store
from lightning_varuna.pipeline.topology import Topology
from lightning_varuna.pipeline.varuna_warning import VarunaWarning
from lightning_varuna.trainer.data import ElasticBatchSampler, ResumableDataLoader
from lightning_varuna.trainer.logs.hook_logs import OptimizerHookLogs
from lightning_varuna.trainer.precision import PipelinePrecision
from lightning_varuna.trainer.recovery.preemption import PreemptionGuard

__all__ = ["InPlaceRecovery", "as_restart", "check_in_place", "check_recovery_options", "complete_replicas",
           "in_place_possible"]

log = logging.getLogger(__name__)

RELEASED_EXIT_CODE = 0
"""Exit status of a survivor released because its replica lost a stage: it did nothing wrong."""


def in_place_possible(engine: Any) -> bool:
    """Whether deaths can be recovered from in place; if not (a sharded optimizer), says so once: they restart."""
    if engine.shards_optimizer:
        rank_zero_warn("VarunaStrategy(recovery='in_place') with zero_stage=1: a lost replica's shard of the optimizer"
                       " state has no other copy, so a death ends every rank and the job restarts from the newest"
                       " checkpoint, as with recovery='restart'.", category=VarunaWarning)
        return False
    return True


def check_recovery_options(recovery: str, store: str | None, global_batch_size: int | None) -> None:
    """Refuses recovery options that cannot work, when the strategy is made (before any process starts)."""
    if recovery not in ("restart", "in_place"):
        raise ValueError(f"recovery={recovery!r}: use 'restart' or 'in_place'.")
    if store is not None and (store.count(":") < 1 or not store.rpartition(":")[2].isdigit()):
        raise ValueError(f"recovery_store={store!r}: write it as 'host:port' (a store started with `varuna-store`).")
    if recovery != "in_place":
        return
    if global_batch_size is None:
        raise ValueError("recovery='in_place' needs global_batch_size: the replicas left then read the lost ones'"
                         " share of every batch, so the training follows the same trajectory.")


def check_in_place(trainer: Any, backend: str | None) -> None:
    """Refuses, at setup and on every rank alike, a fit that in-place recovery cannot serve."""
    if backend != "gloo":
        raise MisconfigurationException(
            f"recovery='in_place' runs on the gloo backend (this job uses {backend}): a waiting NCCL collective"
            " cannot be given up without aborting its communicator. Use process_group_backend='gloo' (with"
            " p2p_backend='gloo' on GPUs) or recovery='restart'.")
    if trainer.accumulate_grad_batches != 1:
        raise MisconfigurationException(
            "recovery='in_place' trains a step again from its batch, which needs accumulate_grad_batches=1: raise"
            " global_batch_size (or num_microbatches) instead of accumulating.")


def complete_replicas(ranks: tuple[int, ...], pipeline_size: int) -> tuple[list[int], list[int]]:
    """Splits surviving ranks (replica-major layout) into those of replicas with every stage alive, and the rest."""
    alive = set(ranks)
    kept: list[int] = []
    released: list[int] = []
    for r in sorted(alive):
        first = r - r % pipeline_size
        (kept if all(first + s in alive for s in range(pipeline_size)) else released).append(r)
    return kept, released


class Recovering(Protocol):
    """What in-place recovery needs of the strategy (:class:`~lightning_varuna.trainer.strategy.VarunaStrategy`)."""

    topology: Topology | None
    train_loader: Any
    global_batch_size: int | None

    @property
    def process_group_backend(self) -> str | None: ...

    @property
    def collective_timeout(self) -> timedelta: ...

    @property
    def root_device(self) -> torch.device: ...

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any: ...

    def regroup(self, generation: int, rank: int, world_size: int) -> None: ...


class InPlaceRecovery:
    """The survivors' side of ranks' deaths during ``fit`` (see the module's description).

    Args:
        strategy: The strategy whose pipeline recovers.
        timeout: Seconds the survivors wait for each other (agreement, forming the new group).
    """

    def __init__(self, strategy: Recovering, timeout: float) -> None:
        self.strategy = strategy
        self.timeout = timeout
        self.generation = 0
        self.commits = 0
        """Optimizer steps this rank has committed (see the module's description)."""
        self.agreed_warning = 0
        """The preemption warning agreed by the last commit (0: none)."""
        self.stale: tuple[int, int] | None = None
        """``(epoch, index)``: batches before it were fetched under an old layout and are read again."""
        self._store: Any = None

    def arm(self, trainer: Any, precision: PipelinePrecision, guard: PreemptionGuard) -> None:
        """From now on this rank survives its peers' deaths (at setup, once the pipeline exists, on every rank).

        The commit runs just before each update, and carries the preemption warnings the guard then decides on.
        """
        check_in_place(trainer, self.strategy.process_group_backend)  # on every rank, before any rank waits
        self._store = job_store()
        self._survive()
        precision.before_update = lambda: self.commit(guard.watch.kind)
        guard.agreed_by = lambda: self.agreed_warning

    @staticmethod
    def _survive() -> None:
        watchdog = current_watchdog()
        if watchdog is not None:
            watchdog.survive_deaths = True

    # -- every step ---------------------------------------------------------------------------------------
    def commit(self, warning: int) -> None:
        """The all-reduce that makes this step's update all-or-nothing, carrying this rank's preemption warning."""
        strategy = self.strategy
        assert strategy.topology is not None
        flag = torch.tensor([warning], dtype=torch.int64, device=strategy.root_device)
        waiting_on_peers(strategy.topology, "committing the optimizer step (all-reduce over every rank)",
                         lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX))
        self.commits += 1
        self.agreed_warning = int(flag.item())  # one host read per step, as the agreement it replaces

    def batch(self, batch: Any, fit_loop: Any) -> Any:
        """``batch``, or this replica's share of it under the new layout if it was fetched under an old one."""
        if self.stale is None:
            return batch
        epoch, index = int(fit_loop.epoch_progress.current.processed), int(fit_loop.epoch_loop.batch_idx)
        if (epoch, index) >= self.stale:
            return batch
        loader = self.strategy.train_loader
        assert isinstance(loader, ResumableDataLoader) and loader.collate_fn is not None
        indices = cast(ElasticBatchSampler, loader.batch_sampler).batch_indices(epoch, index)
        return self.strategy.batch_to_device(loader.collate_fn([loader.dataset[i] for i in indices]))

    def step(self, update: Callable[[], Any], optimizer: Any, hook_logs: OptimizerHookLogs) -> Any:
        """Runs ``update`` (the closure and the optimizer's update), settled all-or-nothing across peers' deaths.

        After a death, either every survivor had reached the commit (this rank applies its update itself, and its
        step's logs are not merged) or nobody updated (the step is trained again, what its hooks logged forgotten).
        """
        while True:
            try:
                return update()
            except PeersLost as lost:
                if self.recover(lost):
                    hook_logs.skip_merge = True
                    return optimizer.step()
                hook_logs.abandon_attempt()

    @contextlib.contextmanager
    def after_update(self) -> Iterator[None]:
        """Around what follows this rank's update (the logs' merge): a death there leaves nothing to redo."""
        try:
            yield
        except PeersLost as lost:
            if self.recover(lost):  # this rank committed, so nobody is ahead of it
                raise

    # -- after a death ------------------------------------------------------------------------------------
    def recover(self, lost: PeersLost) -> bool:
        """Re-forms the job over the survivors; returns whether this rank must still apply its committed update.

        Raises:
            PipelineError: When the job cannot go on in place (no complete replica, or a global batch that does
                not split over the replicas left): every survivor raises it, and the restart path takes over.
        """
        strategy = self.strategy
        topology, watchdog = strategy.topology, current_watchdog()
        assert topology is not None and watchdog is not None and self._store is not None
        started = time.monotonic()
        self.generation += 1
        old_rank, old_world, size = topology.rank, topology.world_size, topology.pipeline_size
        survivors = agree_on_survivors(self._store, self.generation, old_rank, old_world, watchdog.dead,
                                       lambda: watchdog.dead, self.timeout)
        kept, released = complete_replicas(survivors.ranks, size)
        replicas = len(kept) // size
        why = self._cannot_go_on(replicas, survivors)
        if why is not None:
            raise PipelineError(f"rank {old_rank}: {why}; falling back to a restart from the newest checkpoint"
                                f" (ranks {list(survivors.dead)} died while this rank was {lost.what}).")
        if old_rank in released:
            self._release(old_rank, survivors)
        backend = strategy.process_group_backend or "gloo"
        new_rank = form_new_world(self._store, Survivors(self.generation, tuple(kept), old_world), old_rank, backend,
                                  strategy.collective_timeout)
        watch_job()
        self._survive()
        strategy.regroup(self.generation, new_rank, len(kept))
        loader = strategy.train_loader
        if isinstance(loader, ResumableDataLoader):
            self.stale = cast(ElasticBatchSampler, loader.batch_sampler).relayout(replicas, topology.replica)
        complete = self._settle_step()
        if new_rank == 0:
            log.warning(
                "VarunaStrategy: ranks %s died (this rank was %s); recovered in place in %.2f s: %d x %d -> %d x %d"
                " (pipeline x replicas)%s.", list(survivors.dead), lost.what, time.monotonic() - started, size,
                old_world // size, size, replicas, f"; released ranks {released}" if released else "")
        return complete

    def _cannot_go_on(self, replicas: int, survivors: Survivors) -> str | None:
        if replicas == 0:
            return f"no pipeline replica kept every stage (survivors: ranks {list(survivors.ranks)})"
        global_batch = self.strategy.global_batch_size
        if global_batch is not None and global_batch % replicas:
            return f"global_batch_size={global_batch} does not split over the {replicas} replica(s) left"
        return None

    def _release(self, rank: int, survivors: Survivors) -> None:
        watchdog = current_watchdog()
        if watchdog is not None:
            watchdog.deactivate("released after in-place recovery")
        print(f"[rank {rank}] lightning_varuna: ranks {list(survivors.dead)} died and this rank's pipeline replica"
              f" lost a stage: released (exit code {RELEASED_EXIT_CODE}); the complete replicas go on.", flush=True)
        sys.stderr.flush()
        os._exit(RELEASED_EXIT_CODE)

    def _settle_step(self) -> bool:
        """Agrees, over the new world, on the step in flight: True if this rank must apply its committed update."""
        counts = torch.tensor([self.commits, -self.commits], dtype=torch.int64)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        most, least = int(counts[0]), -int(counts[1])
        if most - least > 1:  # a rank commits only after every rank reached the commit before
            raise PipelineError(f"in-place recovery found ranks {most - least} optimizer steps apart")
        behind = self.commits < most
        if behind:
            self.commits += 1
        return behind



def as_restart(error: BaseException) -> BaseException:
    """A death that ended ``fit`` outside the steps in-place recovery settles: an error that ends every rank."""
    if not isinstance(error, PeersLost):
        return error
    return PipelineError(f"in-place recovery covers deaths during training steps; {error}: falling back to a restart"
                         " from the newest checkpoint.")
