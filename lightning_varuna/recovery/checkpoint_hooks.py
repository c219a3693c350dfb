"""The strategy's checkpoint hooks over :mod:`lightning_varuna.checkpoint`: saving, loading, folder leases.

Lightning hands the strategy one dictionary to save and one path to load. Saving splits the dictionary into the
name-keyed shards the checkpoint package writes (weights and optimizer states) and the rest (``meta.pt``);
loading reads this stage's share of a checkpoint written under any P x D, falling back, for ``ckpt_path="last"``,
to the newest good one. Rank 0 holds a lease on every checkpoint folder of a fit, so that a second job writing to
the same folder is refused (:mod:`lightning_varuna.checkpoint.lease`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from torch.optim import Optimizer

from lightning_varuna.checkpoint import load as checkpoint_load
from lightning_varuna.checkpoint import state as checkpoint_state
from lightning_varuna.checkpoint.lease import Holder, LeaseKeeper, LeaseTicket
from lightning_varuna.checkpoint.state import CheckpointError
from lightning_varuna.checkpoint.storage import Location
from lightning_varuna.checkpoint.writer import CheckpointWriter
from lightning_varuna.recovery.resume import checkpoint_folders, last_fallbacks, requested_name

__all__ = ["StrategyCheckpoints", "unwrapped"]

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
        self.writer.save(path, shards, checkpoint, groups, param_names, self.verify, ticket)

    def _lease_ticket(self, path: str) -> LeaseTicket | None:
        """How rank 0's save takes its folder's lease (kept and renewed during fit, released after it otherwise)."""
        if self.lease_timeout is None:
            return None
        if self._leases is None:
            return LeaseTicket(Holder.current(), self.lease_timeout, keep=False)
        self._leases.track(Location.of(path).parent)
        return self._leases.ticket()

    def load(self, path: str, trainer: Trainer, optimizers: Sequence[Any], param_names: list[str],
             weights_only: bool | None, rank_zero: bool, broadcast: Broadcast) -> dict[str, Any]:
        """Loads this stage's share of the checkpoint at ``path`` (the same on every rank) into the module."""
        self.writer.wait()
        # with ckpt_path="last", a bad checkpoint falls back to the newest good one of the run
        fallbacks = broadcast(last_fallbacks(trainer, path) if rank_zero else None)
        module = trainer.lightning_module
        return checkpoint_load.load(path, module, unwrapped(optimizers), param_names, weights_only, fallbacks,
                                    self.verify, requested_name(trainer, path))

    def close(self, interrupted: bool) -> None:
        """Waits for the last background write (unless ``interrupted``), then releases the leases."""
        try:
            self.writer.close(interrupted)
        finally:
            if self._leases is not None:
                self._leases.close()
                self._leases = None
