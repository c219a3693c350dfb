"""Checkpoint state keyed by parameter name, so that one written under any P x D loads under any other.

Weights are this stage's ``state_dict`` under full-model names. Optimizer state is flat and keyed by parameter
name (``state.<name>.<key>``, as torch's flat optimizer state dict names it), with each group's members and
hyper-parameters kept once in a record (:data:`RECORD`) rather than repeated per parameter. A plain
single-file Lightning checkpoint numbers parameters instead: :func:`flat_to_plain` and :func:`plain_to_flat`
convert between the two.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
)
from torch.optim import Optimizer

__all__ = [
    "RECORD",
    "CheckpointError",
    "StateShards",
    "Groups",
    "flat_name",
    "flat_to_plain",
    "load_optimizer_state",
    "make_record",
    "merge_groups",
    "model_state",
    "optimizer_state",
    "param_groups_by_name",
    "plain_to_flat",
    "split_hyper",
    "split_shards",
]

RECORD = "varuna"
"""Key of the parameter record, ``{"param_names": [...], "optimizers": [[[names]]], "hyper": [[{}]], "written": t,
"checksums": {...}}``, in what
:func:`~lightning_varuna.checkpoint.storage.read_meta` returns (a checkpoint keeps it in ``record.pt``, or, if
written by :func:`~lightning_varuna.checkpoint.writer.write_single` or an earlier version, in ``meta.pt``).

``optimizers``: per optimizer, per parameter group, the names of the group's parameters (the order a plain
checkpoint numbers them in); ``hyper``: each group's hyper-parameters (``lr``, ``betas``, ...). They are kept
here rather than in DCP's files, where the flat format repeats them for every parameter (most of the items
of a checkpoint, and most of the time it takes to write). ``written``: when it was written (seconds since the
epoch), which orders checkpoints where moving one changes its files' times; ``checksums``: see
:data:`lightning_varuna.checkpoint.integrity.CHECKSUMS`.
"""
Groups = list[list[list[str]]]
"""Per optimizer, per parameter group, the parameter names in the group's order."""
Hyper = list[list[dict[str, Any] | None]]
"""Per optimizer, each group's hyper-parameters (``None`` for a group with no parameter on this rank)."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, damaged or does not fit the model."""



class StateShards(Protocol):
    """An optimizer that keeps the state of a shard of each parameter (``zero_stage=1``), as checkpoints see it.

    :class:`~lightning_varuna.pipeline.comm.sharded_step.ShardedStep` is one.
    """

    def holds(self, param: Tensor) -> bool:
        """Whether this rank keeps state for some of ``param``."""
        ...

    def ensure_state(self) -> None:
        """Creates the state of every shard this rank holds, if it has none yet (no collective)."""
        ...

    def global_view(self, param: Tensor, value: Tensor) -> Tensor:
        """A state tensor as the whole parameter's (a ``DTensor``), or ``value`` where it is not per element."""
        ...

    def local_value(self, param: Tensor, value: Any) -> Any:
        """A loaded state value as the optimizer keeps it: this rank's rows of a whole or ``DTensor`` value."""
        ...


def model_state(module: nn.Module) -> dict[str, Tensor]:
    """This rank's parameters and persistent buffers by full-model name (sharing storage with the model)."""
    return dict(module.state_dict())


_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def optimizer_state(module: nn.Module, optimizer: Optimizer, shards: StateShards | None = None) -> dict[str, Any]:
    """The optimizer's state, flat and keyed by parameter name (``state.<name>.exp_avg``, ``param_groups.<name>.lr``).

    With ``shards`` (a sharded optimizer) each per-element state tensor is the whole parameter's ``DTensor`` over
    this rank's rows, which DCP writes as that shard and reads back under any other layout.

    Flat per-parameter keys are what makes it reshardable: any rank can load any parameter's entries. Once
    every parameter has state (after the first step) the entries are read directly, sharing storage with the
    optimizer, as torch's ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` names them; a save
    pays no more than a dictionary walk. Before that, torch's function initializes the missing state first.
    """
    names = {id(p): name for name, p in module.named_parameters()}
    flat: dict[str, Any] = {}
    if shards is not None:
        shards.ensure_state()
    for group in optimizer.param_groups:
        hyper = [(key, value) for key, value in group.items() if key != "params"]
        for param in group["params"]:
            state = optimizer.state.get(param)
            name = names.get(id(param))
            if shards is not None and name is not None:
                for key, value in (state or {}).items():  # a shard not held here (or frozen) has none
                    flat[f"state.{name}.{key}"] = shards.global_view(param, value) if isinstance(
                        value, Tensor) else value
            elif not state or name is None:
                return get_optimizer_state_dict(module, optimizer, options=_FLAT)
            else:
                for key, value in state.items():
                    flat[f"state.{name}.{key}"] = value
            for key, value in hyper:
                flat[f"param_groups.{name}.{key}"] = value
    return flat


def load_optimizer_state(
    module: nn.Module, optimizer: Optimizer, flat: dict[str, Any], shards: StateShards | None = None
) -> None:
    """Loads a flat, name-keyed optimizer state (:func:`optimizer_state`) into ``optimizer``.

    Unlike torch's own unflattening, a parameter group that holds none of this stage's parameters is fine (a
    stage may get no parameter of, say, a "no weight decay" group): it keeps its current hyper-parameters, as
    does any hyper-parameter the state lacks. With ``shards`` each value becomes this rank's rows of it.
    """
    params = dict(module.named_parameters())
    if shards is not None:
        flat = {key: shards.local_value(params[flat_name(key)], value) if key.startswith("state.") else value
                for key, value in flat.items() if not key.startswith("state.") or flat_name(key) in params}
    names = {id(p): name for name, p in params.items()}
    groups = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    plain = flat_to_plain(flat, groups)
    for loaded, current in zip(plain["param_groups"], optimizer.param_groups):
        for key, value in current.items():
            loaded.setdefault(key, value)
    optimizer.load_state_dict(plain)


def param_groups_by_name(module: nn.Module, optimizers: Sequence[Optimizer]) -> Groups:
    """For each optimizer and each of its parameter groups, the names of the group's parameters held here."""
    names = {id(p): name for name, p in module.named_parameters()}  # a shared parameter by its first name, as torch
    return [[[names[id(p)] for p in group["params"] if id(p) in names] for group in o.param_groups] for o in optimizers]


def merge_groups(per_rank: Sequence[Groups], order: Sequence[str]) -> Groups:
    """The whole model's optimizer groups from every stage's share, each group in ``order`` (full model order)."""
    position = {name: i for i, name in enumerate(order)}
    merged: Groups = []
    for i in range(max((len(groups) for groups in per_rank), default=0)):
        count = max(len(groups[i]) for groups in per_rank if len(groups) > i)
        merged.append([])
        for g in range(count):
            names = {name for groups in per_rank if len(groups) > i and len(groups[i]) > g for name in groups[i][g]}
            merged[i].append(sorted(names, key=lambda n: (position.get(n, len(position)), n)))
    return merged


def flat_to_plain(
    flat: dict[str, Any], groups: Sequence[Sequence[str]], hyper: Sequence[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """A flat, name-keyed optimizer state as ``Optimizer.state_dict()`` gives it (parameters by index).

    Args:
        flat: ``state.<name>.<key>`` (and ``param_groups.<name>.<key>``) entries of the whole model.
        groups: The optimizer's groups, each a list of parameter names in the optimizer's order.
        hyper: Each group's hyper-parameters, instead of the ``param_groups`` entries.
    """
    state: dict[int, dict[str, Any]] = {}
    param_groups = []
    index = 0
    for g, names in enumerate(groups):
        ids = list(range(index, index + len(names)))
        index += len(names)
        group = dict(hyper[g]) if hyper is not None else {}
        for i, name in zip(ids, names):
            entries = _entries(flat, f"state.{name}.")
            if entries:
                state[i] = entries
            group = group or _entries(flat, f"param_groups.{name}.")
        param_groups.append({**group, "params": ids})
    return {"state": state, "param_groups": param_groups}


def split_hyper(
    flat: dict[str, Any], groups: Sequence[Sequence[str]]
) -> tuple[dict[str, Any], list[dict[str, Any] | None]]:
    """Takes the per-parameter copies of the group hyper-parameters out of a flat optimizer state.

    Returns:
        The state entries alone, and each group's hyper-parameters (``None`` for a group with no parameter here).
    """
    hyper = [_entries(flat, f"param_groups.{names[0]}.") if names else None for names in groups]
    return {k: v for k, v in flat.items() if not k.startswith("param_groups.")}, hyper


def make_record(param_names: Sequence[str], per_rank: Sequence[tuple[Groups, Hyper]]) -> dict[str, Any]:
    """The parameter record from every rank's ``(groups, hyper)``."""
    hyper: list[list[dict[str, Any]]] = []
    for i, groups in enumerate(merge_groups([g for g, _ in per_rank], param_names)):
        found = [[h[i][g] for _, h in per_rank if len(h) > i and len(h[i]) > g] for g in range(len(groups))]
        hyper.append([next((h for h in options if h is not None), {}) for options in found])
    return {"param_names": list(param_names), "optimizers": merge_groups([g for g, _ in per_rank], param_names),
            "hyper": hyper, "written": time.time()}


def split_shards(shards: dict[str, Any], groups: Groups) -> tuple[dict[str, Any], list[list[dict[str, Any] | None]]]:
    """Takes the group hyper-parameters out of each ``optimizer_<i>`` shard (they go into the record)."""
    shards = dict(shards)
    hyper = []
    for i, names in enumerate(groups):
        key = f"optimizer_{i}"
        if key in shards:
            shards[key], h = split_hyper(shards[key], names)
            hyper.append(h)
    return shards, hyper


def plain_to_flat(plain: dict[str, Any], groups: Sequence[Sequence[str]], where: str = "") -> dict[str, Any]:
    """The reverse of :func:`flat_to_plain`: a plain optimizer state keyed by parameter name.

    Raises:
        CheckpointError: The group structure does not match ``groups``.
    """
    plain_groups = plain.get("param_groups", [])
    if len(plain_groups) != len(groups):
        raise CheckpointError(
            f"{where}the optimizer state has {len(plain_groups)} parameter group(s), the model's optimizer"
            f" {len(groups)}. Use the same configure_optimizers as the run that saved it."
        )
    flat: dict[str, Any] = {}
    for g, (group, names) in enumerate(zip(plain_groups, groups)):
        ids = group["params"]
        if len(ids) != len(names):
            raise CheckpointError(
                f"{where}parameter group {g} of the optimizer state has {len(ids)} parameters, the model's"
                f" {len(names)}. Use the same configure_optimizers as the run that saved it."
            )
        hyper = {k: v for k, v in group.items() if k != "params"}
        for i, name in zip(ids, names):
            for key, value in plain.get("state", {}).get(i, {}).items():
                flat[f"state.{name}.{key}"] = value
            for key, value in hyper.items():
                flat[f"param_groups.{name}.{key}"] = value
    return flat


def _entries(flat: dict[str, Any], prefix: str) -> dict[str, Any]:
    # parameter names never continue past a leaf, and state keys hold no dot: the prefix is unambiguous
    return {key[len(prefix):]: v for key, v in flat.items() if key.startswith(prefix) and "." not in key[len(prefix):]}


def flat_name(key: str) -> str:
    """The parameter name in a flat optimizer key (``state.<name>.<key>`` or ``param_groups.<name>.<key>``)."""
    return key.split(".", 1)[1].rsplit(".", 1)[0]
