"""Checkpoints keyed by parameter name, so that one written under any P x D loads under any other.

A checkpoint is a directory written with ``torch.distributed.checkpoint`` (DCP): every stage writes the
tensors it holds (weights and optimizer state under full-model parameter names; a tensor held by several
ranks, such as a replica's copy or a tied parameter, is written once), and rank 0 adds ``meta.pt`` with
Lightning's own state (loops, callbacks, LR schedulers, precision, hyper-parameters).

Writes are atomic: the directory is written under a temporary name, ``meta.pt`` goes in last, after every
rank has finished, and only then is the directory renamed into place. A directory without ``meta.pt`` is
never loaded.

A plain single-file Lightning checkpoint (from a run without this strategy) loads as well: each rank takes
its own parameters' weights and optimizer state from it.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

__all__ = ["save", "load", "is_complete", "META", "CheckpointError"]

META = "meta.pt"
_TMP_SUFFIX = ".varuna-tmp"
_OLD_SUFFIX = ".varuna-old"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not fit the model."""


def is_complete(path: str | Path) -> bool:
    """Whether ``path`` is a finished sharded checkpoint (or a plain checkpoint file)."""
    path = Path(path)
    return path.is_file() or (path.is_dir() and (path / META).is_file() and (path / ".metadata").is_file())


def model_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters and persistent buffers by full-model name (sharing storage with the model)."""
    return dict(module.state_dict())


_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def optimizer_state(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's state, flat and keyed by parameter name (``state.<name>.exp_avg``, ``param_groups.<name>.lr``).

    Flat per-parameter keys are what makes it reshardable: any rank can load any parameter's entries.
    """
    return get_optimizer_state_dict(module, optimizer, options=_FLAT)


def save(path: str | Path, shards: dict[str, Any], metadata: dict[str, Any], rank: int) -> None:
    """Writes a checkpoint directory atomically (collective: every rank calls it).

    Args:
        path: The checkpoint directory to create or replace.
        shards: ``{"state_dict": ..., "optimizer_0": ...}`` as held by this rank, keyed by name.
        metadata: Everything else Lightning saves (only rank 0's is written).
        rank: This rank.
    """
    path = Path(path)
    tmp = path.with_name(path.name + _TMP_SUFFIX)
    if rank == 0 and tmp.exists():
        shutil.rmtree(tmp)
    dist.barrier()
    dcp.save(shards, checkpoint_id=tmp)
    dist.barrier()
    if rank == 0:
        torch.save(metadata, tmp / META)
        old = path.with_name(path.name + _OLD_SUFFIX)
        if path.exists():
            if path.is_dir():
                path.rename(old)
            else:
                path.unlink()
        tmp.rename(path)
        if old.exists():
            shutil.rmtree(old)
    dist.barrier()


def load(
    path: str | Path,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    full_names: Sequence[str],
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Loads this rank's share of a checkpoint into ``module`` and ``optimizers``; returns the rest.

    Args:
        path: A sharded checkpoint directory or a plain Lightning checkpoint file.
        module: The partitioned module.
        optimizers: This rank's optimizers (their state is replaced).
        full_names: Parameter names of the full model in ``named_parameters()`` order (plain checkpoints
            key optimizer state by that position).
        weights_only: Passed to ``torch.load`` for metadata.

    Returns:
        Lightning's checkpoint dictionary without the weights and optimizer states.
    """
    path = Path(path)
    if path.is_file():
        return _load_plain(path, module, optimizers, full_names, weights_only)
    if not is_complete(path):
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no {META} or DCP metadata): it was probably interrupted while"
            " being written. Use an earlier checkpoint."
        )
    state = {"state_dict": model_state(module)}
    for i, optimizer in enumerate(optimizers):
        state[f"optimizer_{i}"] = optimizer_state(module, optimizer)
    try:
        dcp.load(state, checkpoint_id=path)
    except Exception as err:  # noqa: BLE001 - re-raised with what to do
        raise CheckpointError(f"Could not load {path} into this model: {err}") from err
    for i, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(module, optimizer, optim_state_dict=state[f"optimizer_{i}"], options=_FLAT)
    metadata = torch.load(path / META, weights_only=weights_only, map_location="cpu")
    return metadata


def _load_plain(
    path: Path, module: nn.Module, optimizers: Sequence[Optimizer], full_names: Sequence[str],
    weights_only: bool | None,
) -> dict[str, Any]:
    checkpoint = torch.load(path, map_location="cpu", weights_only=weights_only)
    own = model_state(module)
    weights = checkpoint.get("state_dict", {})
    missing = [name for name in own if name not in weights]
    if missing:
        raise CheckpointError(f"{path} has no weights for {missing[:5]}: it is from a different model.")
    with torch.no_grad():
        for name, tensor in own.items():
            if weights[name].shape != tensor.shape:
                raise CheckpointError(
                    f"{path}: {name} has shape {tuple(weights[name].shape)}, the model {tuple(tensor.shape)}."
                )
            tensor.copy_(weights[name])
    for optimizer, plain in zip(optimizers, checkpoint.get("optimizer_states", [])):
        keyed = {
            "state": {full_names[i]: s for i, s in plain["state"].items() if full_names[i] in own},
            "param_groups": [
                {**g, "params": [full_names[i] for i in g["params"] if full_names[i] in own]}
                for g in plain["param_groups"]
            ],
        }
        set_optimizer_state_dict(
            module, optimizer, optim_state_dict=keyed, options=StateDictOptions(strict=False)
        )
    checkpoint.pop("state_dict", None)
    checkpoint.pop("optimizer_states", None)
    return checkpoint
