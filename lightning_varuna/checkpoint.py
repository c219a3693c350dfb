"""Checkpoints keyed by parameter name, so that one written under any P x D loads under any other.

A checkpoint is a directory written with ``torch.distributed.checkpoint`` (DCP): every stage writes the
tensors it holds (weights and optimizer state under full-model parameter names; a tensor held by several
ranks, such as a replica's copy or a tied parameter, is written once), and rank 0 adds ``meta.pt`` with
Lightning's own state (loops, callbacks, LR schedulers, precision, hyper-parameters) and a record of the
model's parameter names and optimizer groups (:data:`RECORD`). Writing, in the calling thread or in the
background, is :mod:`lightning_varuna.checkpoint_writer`; storage and the atomic move into place are
:mod:`lightning_varuna.checkpoint_files`.

This module has the format (name-keyed flat optimizer state, the record, the plain single-file format's
positions) and loading. Before a load every rank checks the checkpoint (files present and long enough,
keys and shapes fitting the model) and the ranks agree on the outcome, so a bad checkpoint raises the same
:class:`CheckpointError` everywhere, or is skipped for the next candidate (``ckpt_path="last"``).

A plain single-file Lightning checkpoint (from a run without this strategy) loads as well: each rank takes
its own parameters' weights and optimizer state from it.
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
)
from torch.optim import Optimizer

from lightning_varuna.checkpoint_files import (
    INDEX,
    META,
    PART_SUFFIX,
    TMP_SUFFIX,
    TRASH_SUFFIX,
    Location,
    is_complete,
    read_meta,
    resolve,
)

__all__ = [
    "META",
    "RECORD",
    "CheckpointError",
    "Location",
    "check_files",
    "flat_to_plain",
    "is_complete",
    "last_fallbacks",
    "load",
    "make_record",
    "merge_groups",
    "model_state",
    "optimizer_state",
    "param_groups_by_name",
    "plain_to_flat",
    "remember_requested_ckpt_path",
    "split_hyper",
]

RECORD = "varuna"
"""Key of the parameter record, ``{"param_names": [...], "optimizers": [[[names]]], "hyper": [[{}]]}``, in what
:func:`~lightning_varuna.checkpoint_files.read_meta` returns (a checkpoint keeps it in ``record.pt``, or, if
written by :func:`~lightning_varuna.checkpoint_writer.write_single` or an earlier version, in ``meta.pt``).

``optimizers``: per optimizer, per parameter group, the names of the group's parameters (the order a plain
checkpoint numbers them in); ``hyper``: each group's hyper-parameters (``lr``, ``betas``, ...). They are kept
here rather than in DCP's files, where the flat format repeats them for every parameter (most of the items
of a checkpoint, and most of the time it takes to write).
"""
Groups = list[list[list[str]]]
"""Per optimizer, per parameter group, the parameter names in the group's order."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, damaged or does not fit the model."""



def model_state(module: nn.Module) -> dict[str, Tensor]:
    """This rank's parameters and persistent buffers by full-model name (sharing storage with the model)."""
    return dict(module.state_dict())


_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def optimizer_state(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's state, flat and keyed by parameter name (``state.<name>.exp_avg``, ``param_groups.<name>.lr``).

    Flat per-parameter keys are what makes it reshardable: any rank can load any parameter's entries. Once
    every parameter has state (after the first step) the entries are read directly, sharing storage with the
    optimizer, as torch's ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` names them; a save
    pays no more than a dictionary walk. Before that, torch's function initializes the missing state first.
    """
    names = {id(p): name for name, p in module.named_parameters()}
    flat: dict[str, Any] = {}
    for group in optimizer.param_groups:
        hyper = [(key, value) for key, value in group.items() if key != "params"]
        for param in group["params"]:
            state = optimizer.state.get(param)
            name = names.get(id(param))
            if not state or name is None:
                return get_optimizer_state_dict(module, optimizer, options=_FLAT)
            for key, value in state.items():
                flat[f"state.{name}.{key}"] = value
            for key, value in hyper:
                flat[f"param_groups.{name}.{key}"] = value
    return flat


def load_optimizer_state(module: nn.Module, optimizer: Optimizer, flat: dict[str, Any]) -> None:
    """Loads a flat, name-keyed optimizer state (:func:`optimizer_state`) into ``optimizer``.

    Unlike torch's own unflattening, a parameter group that holds none of this stage's parameters is fine (a
    stage may get no parameter of, say, a "no weight decay" group): it keeps its current hyper-parameters, as
    does any hyper-parameter the state lacks.
    """
    names = {id(p): name for name, p in module.named_parameters()}
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


def split_hyper(flat: dict[str, Any], groups: Sequence[Sequence[str]]) -> tuple[dict[str, Any], list[dict | None]]:
    """Takes the per-parameter copies of the group hyper-parameters out of a flat optimizer state.

    Returns:
        The state entries alone, and each group's hyper-parameters (``None`` for a group with no parameter here).
    """
    hyper = [_entries(flat, f"param_groups.{names[0]}.") if names else None for names in groups]
    return {k: v for k, v in flat.items() if not k.startswith("param_groups.")}, hyper


def make_record(param_names: Sequence[str], per_rank: Sequence[tuple[Groups, list[list[dict | None]]]]) -> dict:
    """The parameter record from every rank's ``(groups, hyper)``."""
    hyper: list[list[dict]] = []
    for i, groups in enumerate(merge_groups([g for g, _ in per_rank], param_names)):
        found = [[h[i][g] for _, h in per_rank if len(h) > i and len(h[i]) > g] for g in range(len(groups))]
        hyper.append([next((h for h in options if h is not None), {}) for options in found])
    return {"param_names": list(param_names), "optimizers": merge_groups([g for g, _ in per_rank], param_names),
            "hyper": hyper}


def split_shards(shards: dict[str, Any], groups: Groups) -> tuple[dict[str, Any], list[list[dict | None]]]:
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


def _flat_name(key: str) -> str:
    """The parameter name in a flat optimizer key (``state.<name>.<key>`` or ``param_groups.<name>.<key>``)."""
    return key.split(".", 1)[1].rsplit(".", 1)[0]


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """Silences DCP's warning that it runs without a process group (meant here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        yield


# -- reading ------------------------------------------------------------------------------------------------
_USE_ANOTHER = "Load another checkpoint (e.g. an earlier one of the same run)."
_OTHER_MODEL = (
    "It was saved from a different model (or another configuration of it): build the model as it was when"
    " saved, or load another checkpoint."
)


def load(
    path: str | os.PathLike,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    full_names: Sequence[str],
    weights_only: bool | None = None,
    fallbacks: Sequence[str] = (),
) -> dict[str, Any]:
    """Loads this rank's share of a checkpoint into ``module`` and ``optimizers``; returns the rest.

    Collective: every rank calls it with the same paths, and every rank loads the same checkpoint or raises.

    Args:
        path: A sharded checkpoint directory or a plain Lightning checkpoint file.
        module: The partitioned module.
        optimizers: This rank's optimizers (their state is replaced).
        full_names: Parameter names of the full model in ``named_parameters()`` order (plain checkpoints
            key optimizer state by position).
        weights_only: Passed to ``torch.load`` for metadata and plain files.
        fallbacks: Checkpoints to try, in order, if ``path`` is missing, incomplete, damaged or does not fit.

    Returns:
        Lightning's checkpoint dictionary without the weights and optimizer states.

    Raises:
        CheckpointError: No candidate could be loaded (the error of the last one tried).
    """
    candidates = [os.fspath(path), *fallbacks]
    for i, candidate in enumerate(candidates):
        try:
            return _load_one(candidate, module, optimizers, full_names, weights_only)
        except CheckpointError as err:
            if i + 1 == len(candidates):
                raise
            if _rank() == 0:
                warnings.warn(f"{err} Falling back to {candidates[i + 1]}.", stacklevel=2)
    raise AssertionError("unreachable")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _agree(problem: str | None, extra: Any = None) -> list[Any]:
    """Shares every rank's problem (and ``extra``); raises the first problem on every rank."""
    if not dist.is_initialized():
        if problem is not None:
            raise CheckpointError(problem)
        return [extra]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (problem, extra))
    for error, _ in gathered:
        if error is not None:
            raise CheckpointError(error)
    return [e for _, e in gathered]


def _load_one(
    path: str, module: nn.Module, optimizers: Sequence[Optimizer], full_names: Sequence[str],
    weights_only: bool | None,
) -> dict[str, Any]:
    loc, note = resolve(Location.of(path))
    if note is not None and _rank() == 0:
        warnings.warn(note, stacklevel=3)
    if loc.exists() and not loc.isdir():
        return _load_plain(loc, module, optimizers, full_names, weights_only)
    problem, meta, index = _check_directory(loc, weights_only)
    state: dict[str, Any] = {}
    request: dict[str, Any] = {}
    own: list[str] = []
    if problem is None:
        state = {"state_dict": model_state(module)}
        for i, optimizer in enumerate(optimizers):
            state[f"optimizer_{i}"] = optimizer_state(module, optimizer)
        # group hyper-parameters come from the record (older checkpoints hold them in DCP's files)
        record = meta.get(RECORD, {}) if meta is not None else {}
        if "hyper" in record:
            for i in range(len(optimizers)):
                if i < len(record["hyper"]):
                    _apply_hyper(state[f"optimizer_{i}"], record["optimizers"][i], record["hyper"][i])
        problem, request = _check_fit(loc, state, index, skip_groups="hyper" in record)
        own = list(state["state_dict"])
    held = _agree(problem, own)
    assert index is not None and meta is not None
    _check_extra(loc, {k[len("state_dict."):] for k in index.state_dict_metadata if k.startswith("state_dict.")}, held)
    try:
        with single_process_quiet():
            dcp.load(request, storage_reader=loc.reader(), no_dist=not dist.is_initialized())
    except Exception as err:  # noqa: BLE001 - raised on every rank by DCP, re-raised with what to do
        raise CheckpointError(f"Could not read {loc}: {err}. The files may be damaged. {_USE_ANOTHER}") from err
    for i, optimizer in enumerate(optimizers):
        key = f"optimizer_{i}"
        state[key].update(request[key])
        load_optimizer_state(module, optimizer, state[key])
    meta.pop(RECORD, None)
    return meta


def _check_directory(
    loc: Location, weights_only: bool | None
) -> tuple[str | None, dict[str, Any] | None, Metadata | None]:
    """Whether every file is there and readable: ``(problem, meta, DCP index)``."""
    if not loc.exists():
        return f"Checkpoint {loc} does not exist. Check the path, or load another checkpoint.", None, None
    if not loc.child(META).exists():
        return (
            f"{loc} is not a complete checkpoint (no {META}): it was interrupted while being written, or is not"
            f" a checkpoint. {_USE_ANOTHER}",
            None,
            None,
        )
    try:
        index = loc.reader().read_metadata()
    except Exception as err:  # noqa: BLE001 - any reader error means the same to the user
        problem = f"{loc}: its index ({INDEX}) is missing or damaged ({type(err).__name__}: {err}). {_USE_ANOTHER}"
        return problem, None, None
    needed: dict[str, int] = {}
    for info in (index.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    missing = [name for name in sorted(needed) if not loc.child(name).exists()]
    if missing:
        return (
            f"{loc} is missing {len(missing)} of its {len(needed)} shard files ({', '.join(missing[:4])}): it was"
            f" copied or deleted in part. {_USE_ANOTHER}",
            None,
            None,
        )
    for name, size in sorted(needed.items()):
        actual = loc.fs.size(loc.child(name).path)
        if actual < size:
            return (
                f"{loc}: shard file {name} is truncated ({actual} bytes, the index needs {size}); it was cut short"
                f" while being written or copied. {_USE_ANOTHER}",
                None,
                None,
            )
    try:
        meta = read_meta(loc, weights_only)
    except Exception as err:  # noqa: BLE001 - truncated or otherwise unreadable
        return f"{loc}: {META} cannot be read ({type(err).__name__}: {err}); it is damaged. {_USE_ANOTHER}", None, None
    return None, meta, index


def check_files(path: str | os.PathLike | Location, weights_only: bool | None = None) -> dict[str, Any]:
    """Checks that a sharded checkpoint is complete and undamaged; returns its ``meta.pt``.

    Raises:
        CheckpointError: Saying what is missing or damaged.
    """
    problem, meta, _ = _check_directory(Location.of(path), weights_only)
    if problem is not None:
        raise CheckpointError(problem)
    assert meta is not None
    return meta


def _apply_hyper(flat: dict[str, Any], groups: Sequence[Sequence[str]], hyper: Sequence[dict[str, Any]]) -> None:
    """Sets the ``param_groups.<name>.<key>`` entries of a flat optimizer state from the record's groups."""
    group_of = {name: g for g, names in enumerate(groups) for name in names}
    for key in list(flat):
        if key.startswith("param_groups."):
            g = group_of.get(_flat_name(key))
            field = key.rsplit(".", 1)[1]
            if g is not None and field in hyper[g]:
                flat[key] = hyper[g][field]


def _check_fit(
    loc: Location, state: dict[str, Any], index: Metadata, skip_groups: bool = False
) -> tuple[str | None, dict[str, Any]]:
    """Whether the checkpoint has every entry this rank needs, in the right shape: ``(problem, request)``.

    The request is ``state`` without optimizer entries of parameters the checkpoint holds no optimizer state
    for (a parameter that never had a gradient): those keep their freshly initialised state. With
    ``skip_groups``, the ``param_groups`` entries (set from the record) are not requested either.
    """
    saved = index.state_dict_metadata
    flat, _ = flatten_state_dict(state)
    if skip_groups:
        flat = {k: v for k, v in flat.items() if not (k.startswith("optimizer_") and ".param_groups." in k)}
    stateless = {
        key for key in flat
        if key.startswith("optimizer_") and key.split(".", 1)[1].startswith("state.") and key not in saved
        and not any(k.startswith(key.rsplit(".", 1)[0] + ".") for k in saved)
    }
    missing = [key for key in flat if key not in saved and key not in stateless]
    if missing:
        weights = [k[len("state_dict."):] for k in missing if k.startswith("state_dict.")]
        if weights:
            return f"{loc} has no weights for {_few(weights)}. {_OTHER_MODEL}", {}
        names = sorted({_flat_name(k.split(".", 1)[1]) for k in missing})
        return (
            f"{loc} has no optimizer state for {_few(names)} ({_few([k.split('.', 1)[1] for k in missing])}):"
            " it was saved with another optimizer or without one. Use the optimizer it was saved with.",
            {},
        )
    for key, value in flat.items():
        meta = saved.get(key)
        if not (isinstance(value, Tensor) and isinstance(meta, TensorStorageMetadata)):
            continue
        if tuple(meta.size) != tuple(value.shape):
            name = key.split(".", 1)[1]
            return (
                f"{loc}: {name} has shape {tuple(meta.size)} in the checkpoint, {tuple(value.shape)} in the model."
                f" {_OTHER_MODEL}",
                {},
            )
    request = {k: v for k, v in state.items() if k == "state_dict"}
    for key, value in state.items():
        if key != "state_dict":
            request[key] = {k: v for k, v in value.items() if f"{key}.{k}" in flat and f"{key}.{k}" not in stateless}
    return None, request


def _check_extra(loc: Location, saved: set[str], held: Sequence[Sequence[str]]) -> None:
    extra = saved - {name for names in held for name in names}
    if extra:
        raise CheckpointError(f"{loc} has weights the model does not have: {_few(sorted(extra))}. {_OTHER_MODEL}")


def _few(names: Sequence[str]) -> str:
    shown = ", ".join(names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _load_plain(
    loc: Location, module: nn.Module, optimizers: Sequence[Optimizer], full_names: Sequence[str],
    weights_only: bool | None,
) -> dict[str, Any]:
    checkpoint: dict[str, Any] = {}
    problem = None
    own = model_state(module)
    try:
        checkpoint = torch.load(io.BytesIO(loc.read_bytes()), map_location="cpu", weights_only=weights_only)
    except Exception as err:  # noqa: BLE001 - truncated, damaged or not a checkpoint
        problem = f"{loc} cannot be read ({type(err).__name__}: {err}): it is truncated or damaged. {_USE_ANOTHER}"
    weights = checkpoint.get("state_dict", {}) if isinstance(checkpoint, dict) else {}
    if problem is None:
        missing = [name for name in own if name not in weights]
        wrong = [name for name in own if name in weights and weights[name].shape != own[name].shape]
        if missing:
            problem = f"{loc} has no weights for {_few(missing)}. {_OTHER_MODEL}"
        elif wrong:
            name = wrong[0]
            problem = (
                f"{loc}: {name} has shape {tuple(weights[name].shape)} in the checkpoint, {tuple(own[name].shape)} in"
                f" the model. {_OTHER_MODEL}"
            )
    held = _agree(problem, (list(own), param_groups_by_name(module, optimizers)))
    _check_extra(loc, set(weights), [names for names, _ in held])
    groups = merge_groups([g for _, g in held], checkpoint.get(RECORD, {}).get("param_names") or full_names)
    flats = []
    try:
        for i, plain in enumerate(checkpoint.get("optimizer_states", [])[: len(optimizers)]):
            flat = plain_to_flat(plain, groups[i], f"{loc}: ")
            params = dict(module.named_parameters())
            mine = {k: v for k, v in flat.items() if _flat_name(k) in params}
            for key, value in mine.items():
                shape = params[_flat_name(key)].shape
                if key.startswith("state.") and isinstance(value, Tensor) and value.dim() and value.shape != shape:
                    raise CheckpointError(
                        f"{loc}: the optimizer state does not line up with the parameters ({key} has shape"
                        f" {tuple(value.shape)}, the parameter {tuple(shape)}). A plain checkpoint keys optimizer"
                        " state by position: each parameter group must list its parameters in the model's"
                        " named_parameters() order."
                    )
            flats.append(mine)
        problem = None
    except CheckpointError as err:
        problem = str(err)
    _agree(problem)
    with torch.no_grad():
        for name, tensor in own.items():
            tensor.copy_(weights[name])
    for optimizer, flat in zip(optimizers, flats):
        # entries the file lacks (parameters that never had a gradient) keep their fresh state
        current = optimizer_state(module, optimizer)
        current.update({k: v for k, v in flat.items() if k in current})
        load_optimizer_state(module, optimizer, current)
    for key in ("state_dict", "optimizer_states", RECORD):
        checkpoint.pop(key, None)
    return checkpoint


# -- resuming from "last" -----------------------------------------------------------------------------------
_REQUESTED = "_varuna_requested_ckpt_path"


def remember_requested_ckpt_path() -> None:
    """Makes Lightning's checkpoint connector keep the ``ckpt_path`` the user passed (before ``"last"`` is resolved).

    Lightning resolves ``ckpt_path="last"`` to a path before the strategy sees it; the strategy needs to know
    whether the user asked for "last" (then a bad checkpoint falls back to an older one) or for a path.
    """
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    original = _CheckpointConnector._select_ckpt_path
    if getattr(original, "_varuna", False):
        return

    def select(self: Any, state_fn: Any, ckpt_path: Any, *args: Any, **kwargs: Any) -> Any:
        setattr(self, _REQUESTED, ckpt_path)
        return original(self, state_fn, ckpt_path, *args, **kwargs)

    select._varuna = True  # type: ignore[attr-defined]
    _CheckpointConnector._select_ckpt_path = select  # type: ignore[method-assign]


def last_fallbacks(trainer: Any, bad: str) -> list[str]:
    """If the user asked for ``ckpt_path="last"``: the other complete checkpoints of the run, newest first.

    Looked for in every ``ModelCheckpoint``'s ``dirpath`` and next to ``OnExceptionCheckpoint``'s file.
    """
    if getattr(trainer._checkpoint_connector, _REQUESTED, None) != "last":
        return []
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    folders = {cb.dirpath for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)}
    folders |= {os.path.dirname(cb.ckpt_path) for cb in trainer.callbacks if isinstance(cb, OnExceptionCheckpoint)}
    bad_loc = Location.of(bad)
    found: dict[str, float] = {}
    for folder in folders:
        root = Location.of(folder)
        if not root.isdir():
            continue
        for entry in root.fs.ls(root.path, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            loc = root.child(name)
            skipped = name.endswith((TMP_SUFFIX, PART_SUFFIX, TRASH_SUFFIX)) or loc.path == bad_loc.path
            if skipped or not is_complete(loc):
                continue
            if loc.isdir():
                found[str(loc)] = loc.child(META).modified()
            elif name.endswith(".ckpt"):
                found[str(loc)] = loc.modified()
    return sorted(found, key=found.get, reverse=True)  # type: ignore[arg-type]
