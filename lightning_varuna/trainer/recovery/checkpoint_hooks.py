"""The strategy's checkpoint hooks over :mod:`lightning_varuna.checkpoint`: saving, loading, folder leases.

Lightning hands the strategy one dictionary to save and one path to load. Saving splits the dictionary into the
name-keyed shards the checkpoint package writes (weights and optimizer states) and the rest (``meta.pt``);
loading reads this stage's share of a checkpoint written under any P x D, falling back, for ``ckpt_path="last"``,
to the newest good one. Rank 0 holds a lease on every checkpoint folder of a fit, so that a second job writing to
the same folder is refused (:mod:`lightning_varuna.checkpoint.lease`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lightning.pytorch import LightningModule, Trainer
from torch.optim import Optimizer
from typing_extensions import override

from lightning_varuna.checkpoint import load as checkpoint_load
from lightning_varuna.checkpoint import state as checkpoint_state
from lightning_varuna.checkpoint.lease import Holder, LeaseKeeper, LeaseTicket
from lightning_varuna.checkpoint.state import CheckpointError, StateShards
from lightning_varuna.checkpoint.storage import Location
from lightning_varuna.checkpoint.writer import CheckpointWriter
from lightning_varuna.trainer.recovery.resume import checkpoint_folders, last_fallbacks, requested_name

if TYPE_CHECKING:  # the mixin is checked as the strategy it is mixed into
    from lightning_varuna.pipeline.engine import PipelineEngine
    from lightning_varuna.trainer.processes import ProcessGroupStrategy as _StrategyBase
else:
    _StrategyBase = object

__all__ = ["CheckpointHooks", "StrategyCheckpoints", "unwrapped"]

Broadcast = Callable[[Any], Any]
"""Sends rank 0's value to every rank (the strategy's ``broadcast``)."""


def unwrapped(optimizers: Sequence[Any]) -> list[Optimizer]:
    """The torch optimizers behind Lightning's ``LightningOptimizer`` wrappers."""
    return [getattr(optimizer, "_optimizer", optimizer) for optimizer in optimizers]


class StrategyCheckpoints:
    """One strategy's checkpoints: its writer (blocking or background) and rank 0's leases during ``fit``.

    Args:
        writer: Writes the checkpoints.
        verify: Record checksums on saving and check them on loading; refuse to save parameters that are not finite.
        lease_timeout: Seconds after which a lease no longer renewed is stale; ``None``: no lease.
    """

    def __init__(self, writer: CheckpointWriter, verify: bool, lease_timeout: float | None) -> None:
        if lease_timeout is not None and not lease_timeout > 0:
            raise ValueError(f"checkpoint_lease_timeout: give seconds (> 0) or None, not {lease_timeout!r}.")
        self.writer = writer
        self.verify = verify
        self.lease_timeout = lease_timeout
        self._leases: LeaseKeeper | None = None

    def take_leases(self, trainer: Trainer, rank_zero: bool, broadcast: Broadcast) -> None:
        """Rank 0 takes the lease of every checkpoint folder of this fit; a refusal is raised on every rank."""
        if self.lease_timeout is None:
            return
        problem = None
        if rank_zero:
            self._leases = LeaseKeeper(self.lease_timeout)
            problem = self._leases.acquire(checkpoint_folders(trainer))
        problem = broadcast(problem)
        if problem is not None:
            raise CheckpointError(problem)

    def save(self, checkpoint: dict[str, Any], path: str, module: LightningModule, optimizers: Sequence[Any],
             param_names: list[str], rank_zero: bool) -> None:
        """Writes Lightning's ``checkpoint`` dictionary at ``path`` (collective; blocking or handed to the writer)."""
        shards = {"state_dict": checkpoint.pop("state_dict")}
        for i, state in enumerate(checkpoint.pop("optimizer_states", [])):
            shards[f"optimizer_{i}"] = state
        groups = checkpoint_state.param_groups_by_name(module, unwrapped(optimizers))
        ticket = self._lease_ticket(path) if rank_zero else None
        # one training state per (epoch, step) on every rank; the writer checks the tensors themselves too
        state_key = (checkpoint.get("epoch"), checkpoint.get("global_step"))
        self.writer.save(path, shards, checkpoint, groups, param_names, self.verify, ticket, state_key)

    def _lease_ticket(self, path: str) -> LeaseTicket | None:
        """How rank 0's save takes its folder's lease (kept and renewed during fit, released after it otherwise)."""
        if self.lease_timeout is None:
            return None
        if self._leases is None:
            return LeaseTicket(Holder.current(), self.lease_timeout, keep=False)
        self._leases.track(Location.of(path).parent)
        return self._leases.ticket()

    def load(self, path: str, trainer: Trainer, optimizers: Sequence[Any], param_names: list[str],
             weights_only: bool | None, rank_zero: bool, broadcast: Broadcast,
             shards: Sequence[StateShards | None] = ()) -> dict[str, Any]:
        """Loads this stage's share of the checkpoint at ``path`` (the same on every rank) into the module.

        ``shards``: per optimizer, how it shards its state (``zero_stage=1``), or None.
        """
        self.writer.wait()
        # with ckpt_path="last", a bad checkpoint falls back to the newest good one of the run
        fallbacks = broadcast(last_fallbacks(trainer, path) if rank_zero else None)
        module = trainer.lightning_module
        return checkpoint_load.load(path, module, unwrapped(optimizers), param_names, weights_only, fallbacks,
                                    self.verify, requested_name(trainer, path), shards)

    def close(self, interrupted: bool) -> None:
        """Waits for the last background write (unless ``interrupted``), then releases the leases."""
        try:
            self.writer.close(interrupted)
        finally:
            if self._leases is not None:
                self._leases.close()
                self._leases = None


class CheckpointHooks(_StrategyBase):
    """The strategy's checkpoint hooks, over :class:`StrategyCheckpoints`.

    The strategy inherits them; its ``__init__`` sets the attributes used here.
    """

    async_checkpoint: bool
    engine: PipelineEngine | None
    _checkpoints: CheckpointWriter
    _checkpointing: StrategyCheckpoints
    _sharded_steps: Mapping[Optimizer, StateShards]

    @override
    @property
    def lightning_restore_optimizer(self) -> bool:
        """Optimizer state is loaded by the strategy itself, by parameter name."""
        return False

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This stage's weights, keyed by full-model name."""
        return checkpoint_state.model_state(self.attached_module)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This stage's optimizer state, keyed by parameter name (this replica's shard of it with ``zero_stage=1``)."""
        torch_optimizer = unwrapped([optimizer])[0]
        shards = self._sharded_steps.get(torch_optimizer)
        return checkpoint_state.optimizer_state(self.attached_module, torch_optimizer, shards)

    @override
    def save_checkpoint(self, checkpoint_dict: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Writes a sharded checkpoint directory at ``filepath``, a local path or fsspec URL (collective; atomic).

        With ``async_checkpoint`` it returns once this rank's tensors are copied; the files follow.
        """
        if storage_options is not None:
            raise TypeError("VarunaStrategy.save_checkpoint does not take storage_options.")
        # async: the ranks compare paths in the background instead (no collective in the training thread)
        path = str(filepath) if self.async_checkpoint else self.broadcast(str(filepath))
        names = self.engine.param_names if self.engine is not None else []
        self._checkpointing.save(checkpoint_dict, path, self.attached_module, self.optimizers, names,
                                 self.is_global_zero)

    def wait_for_checkpoint(self) -> None:
        """Blocks until the checkpoint being written in the background (``async_checkpoint``) is complete.

        Raises:
            CheckpointError: On every rank, if that write failed.
        """
        self._checkpoints.flush()

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Deletes a checkpoint (on rank 0); while a save is in flight, only once that one is complete."""
        if self.is_global_zero:
            self._checkpoints.remove(str(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Loads this stage's share of a sharded (or plain single-file) checkpoint, whatever P x D wrote it."""
        assert self.engine is not None
        self._checkpoints.wait()
        path = self.broadcast(str(checkpoint_path))
        shards = [self._sharded_steps.get(o) for o in unwrapped(self.optimizers)]
        return self._checkpointing.load(path, self.attached_module.trainer, self.optimizers, self.engine.param_names,
                                        weights_only, self.is_global_zero, self.broadcast, shards)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Nothing to do: :meth:`load_checkpoint` has loaded the weights."""

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Nothing to do: :meth:`load_checkpoint` has loaded the optimizer state."""

    @override
    def barrier(self, name: str | None = None) -> None:
        """Waits for every process."""
        if name != "Trainer.save_checkpoint":  # a save ends with the ranks' agreement, or goes on in the background
            super().barrier(name)
