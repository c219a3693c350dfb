"""Loading a checkpoint into a partitioned model, whatever P x D wrote it.

Before a load every rank checks the checkpoint (files present and long enough, keys and shapes fitting the
model) and the ranks agree on the outcome, so a bad checkpoint raises the same :class:`CheckpointError`
everywhere, or is skipped for the next candidate (``ckpt_path="last"``).

A plain single-file Lightning checkpoint (from a run without this strategy) loads as well: each rank takes
its own parameters' weights and optimizer state from it.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.optim import Optimizer

from lightning_varuna.checkpoint.integrity import CHECKSUMS, VerifyingLoadPlanner, checksum
from lightning_varuna.checkpoint.publish import newest_copy
from lightning_varuna.checkpoint.state import (
    RECORD,
    CheckpointError,
    StateShards,
    flat_name,
    load_optimizer_state,
    merge_groups,
    model_state,
    optimizer_state,
    param_groups_by_name,
    plain_to_flat,
)
from lightning_varuna.checkpoint.storage import INDEX, META, Location, is_complete, read_meta, single_process_quiet
from lightning_varuna.failstop.failures import raised_on_every_rank
from lightning_varuna.pipeline.varuna_warning import VarunaWarning

__all__ = ["check_files", "load", "read_everything", "read_items", "resolve"]


# -- reading ------------------------------------------------------------------------------------------------
_USE_ANOTHER = "Load another checkpoint (e.g. an earlier one of the same run)."
_OTHER_MODEL = (
    "It was saved from a different model (or another configuration of it): build the model as it was when"
    " saved, or load another checkpoint."
)


def load(
    path: str | os.PathLike[str],
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    full_names: Sequence[str],
    weights_only: bool | None = None,
    fallbacks: Sequence[str] = (),
    verify: bool = True,
    requested: str | None = None,
    shards: Sequence[StateShards | None] = (),
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
        verify: Check every file and item against the checksums the checkpoint was saved with (if any).
        requested: What the user asked for (e.g. ``last.ckpt`` when ``path`` is a copy of it), for the error.
        shards: Per optimizer, how it shards its state (``zero_stage=1``), or None (the default for each).

    Returns:
        Lightning's checkpoint dictionary without the weights and optimizer states.

    Raises:
        CheckpointError: No candidate could be loaded: names ``requested`` (or ``path``) and why each failed.
    """
    candidates = [os.fspath(path), *fallbacks]
    failures: list[str] = []
    for i, candidate in enumerate(candidates):
        try:
            return _load_one(candidate, module, optimizers, full_names, weights_only, verify, shards)
        except CheckpointError as err:
            failures.append(str(err))
            if i + 1 < len(candidates):  # every rank says so: a rank's log may be the only one read
                warnings.warn(f"{err} Falling back to {candidates[i + 1]}.", VarunaWarning, stacklevel=2)
    if len(candidates) == 1:
        raise raised_on_every_rank(CheckpointError(failures[0]))
    tried = " ".join(f"({n}) {failure}" for n, failure in enumerate(failures[1:], 2))
    raise raised_on_every_rank(CheckpointError(
        f"Could not load {requested or candidates[0]}: {failures[0]} Every other checkpoint of the run was tried"
        f" and failed too: {tried}"
    ))


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
            raise raised_on_every_rank(CheckpointError(error))
    return [e for _, e in gathered]


def resolve(loc: Location) -> tuple[Location, str | None]:
    """``loc``, or, if it is not complete, the newest complete copy an interrupted replacement left (and a note)."""
    if is_complete(loc):
        return loc, None
    newest = newest_copy(loc)
    if newest is None or newest == loc:
        return loc, None
    return newest, f"{loc} is not complete but {newest} is (a replacement was interrupted); loading that."


def _load_one(
    path: str, module: nn.Module, optimizers: Sequence[Optimizer], full_names: Sequence[str],
    weights_only: bool | None, verify: bool, shards: Sequence[StateShards | None] = (),
) -> dict[str, Any]:
    shards = [shards[i] if i < len(shards) else None for i in range(len(optimizers))]
    loc, note = resolve(Location.of(path))
    if note is not None:
        warnings.warn(note, VarunaWarning, stacklevel=3)
    if loc.exists() and not loc.isdir():
        return _load_plain(loc, module, optimizers, full_names, weights_only, shards)
    problem, meta, index = _check_directory(loc, weights_only, verify)
    state: dict[str, Any] = {}
    request: dict[str, Any] = {}
    own: list[str] = []
    if problem is None:
        state = {"state_dict": model_state(module)}
        for i, optimizer in enumerate(optimizers):
            state[f"optimizer_{i}"] = optimizer_state(module, optimizer, shards[i])
        # group hyper-parameters come from the record (older checkpoints hold them in DCP's files)
        record = meta.get(RECORD, {}) if meta is not None else {}
        if "hyper" in record:
            for i in range(len(optimizers)):
                if i < len(record["hyper"]):
                    _apply_hyper(state[f"optimizer_{i}"], record["optimizers"][i], record["hyper"][i])
        assert index is not None  # _check_directory returns an index whenever it finds no problem
        problem, request = _check_fit(loc, state, index, skip_groups="hyper" in record)
        own = list(state["state_dict"])
    held = _agree(problem, own)
    assert index is not None and meta is not None
    _check_extra(loc, {k[len("state_dict."):] for k in index.state_dict_metadata if k.startswith("state_dict.")}, held)
    expected = meta.get(RECORD, {}).get(CHECKSUMS, {}).get("items", {}) if verify else {}
    _agree(read_items(loc, request, expected))
    for i, optimizer in enumerate(optimizers):
        key = f"optimizer_{i}"
        state[key].update(request[key])
        load_optimizer_state(module, optimizer, state[key], shards[i])
    meta.pop(RECORD, None)
    return meta


def read_items(loc: Location, request: dict[str, Any], expected: dict[str, str]) -> str | None:
    """``dcp.load`` of ``request`` from ``loc`` (collective), each item checked against ``expected``; the problem.

    DCP raises a failure to read on every rank; a checksum that differs is this rank's problem (to agree on).
    """
    planner = VerifyingLoadPlanner(expected)
    try:
        with single_process_quiet():
            dcp.load(request, storage_reader=loc.reader(), planner=planner, no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - raised on every rank by DCP, re-raised with what to do
        raise CheckpointError(f"Could not read {loc}: {err}. The files may be damaged. {_USE_ANOTHER}") from err
    if not planner.mismatched:
        return None
    return (
        f"{loc}: {_few(sorted(planner.mismatched))} read back different from what was saved (checksum mismatch):"
        f" a shard file is damaged. {_USE_ANOTHER} (verify_checkpoints=False loads it without this check.)"
    )


def read_everything(loc: Location, expected: dict[str, str], only: set[str] | None = None) -> dict[str, Any]:
    """Every item of the checkpoint at ``loc`` (or of its entries named in ``only``), nested as saved.

    Reads in this process alone, whether or not a process group exists.

    Raises:
        CheckpointError: A file cannot be read, or an item differs from its checksum in ``expected``.
    """
    index = loc.reader().read_metadata()
    flat: dict[str, Any] = {}
    paths = index.planner_data or {}
    for key, item in index.state_dict_metadata.items():
        if only is not None and paths.get(key, tuple(key.split(".", 1)))[0] not in only:
            continue
        flat[key] = torch.empty(tuple(item.size), dtype=item.properties.dtype) if isinstance(
            item, TensorStorageMetadata) else None
    planner = VerifyingLoadPlanner(expected, flatten_state_dict=False)
    try:
        with single_process_quiet():
            dcp.load(flat, storage_reader=loc.reader(), planner=planner, no_dist=True)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - any reader error means the same to the user
        raise CheckpointError(f"Could not read {loc}: {err}. The files may be damaged.") from err
    if planner.mismatched:
        raise CheckpointError(f"{loc}: {_few(sorted(planner.mismatched))} read back different from what was saved"
                              " (checksum mismatch): a shard file is damaged.")
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = paths.get(key, tuple(key.split(".", 1)))
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def _check_directory(
    loc: Location, weights_only: bool | None, verify: bool = True
) -> tuple[str | None, dict[str, Any] | None, Metadata | None]:
    """Whether every file is there, readable and as saved: ``(problem, meta, DCP index)``."""
    loc.refresh()
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
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - any reader error means the same to the user
        damaged = f"{loc}: its index ({INDEX}) is missing or damaged ({type(err).__name__}: {err}). {_USE_ANOTHER}"
        return damaged, None, None
    problem = _check_shards(loc, index)
    if problem is not None:
        return problem, None, None
    raw: dict[str, bytes] = {}
    try:
        meta = read_meta(loc, weights_only, raw)
    except Exception as err:  # noqa: BLE001 - truncated or otherwise unreadable
        return f"{loc}: {META} cannot be read ({type(err).__name__}: {err}); it is damaged. {_USE_ANOTHER}", None, None
    saved = meta.get(RECORD, {}).get(CHECKSUMS, {}).get("files", {}) if verify else {}
    for name, value in saved.items():
        data = raw[name] if name in raw else loc.child(name).read_bytes()
        if checksum(data) != value:
            return (
                f"{loc}: {name} reads back different from what was saved (checksum mismatch); it is damaged."
                f" {_USE_ANOTHER} (verify_checkpoints=False loads it without this check.)",
                None,
                None,
            )
    return None, meta, index


def _check_shards(loc: Location, index: Metadata) -> str | None:
    """Whether every shard file the index names is there and long enough."""
    needed: dict[str, int] = {}
    for info in (index.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    missing = [name for name in sorted(needed) if not loc.child(name).exists()]
    if missing:
        return (
            f"{loc} is missing {len(missing)} of its {len(needed)} shard files ({', '.join(missing[:4])}): it was"
            f" copied or deleted in part. {_USE_ANOTHER}"
        )
    for name, size in sorted(needed.items()):
        actual = loc.fs.size(loc.child(name).path)
        if actual < size:
            return (
                f"{loc}: shard file {name} is truncated ({actual} bytes, the index needs {size}); it was cut short"
                f" while being written or copied. {_USE_ANOTHER}"
            )
    return None


def check_files(
    path: str | os.PathLike[str] | Location, weights_only: bool | None = None, verify: bool = True
) -> dict[str, Any]:
    """Checks that a sharded checkpoint is complete and its files as saved; returns its ``meta.pt``.

    Raises:
        CheckpointError: Saying what is missing or damaged.
    """
    problem, meta, _ = _check_directory(Location.of(path), weights_only, verify)
    if problem is not None:
        raise CheckpointError(problem)
    assert meta is not None
    return meta


def _apply_hyper(flat: dict[str, Any], groups: Sequence[Sequence[str]], hyper: Sequence[dict[str, Any]]) -> None:
    """Sets the ``param_groups.<name>.<key>`` entries of a flat optimizer state from the record's groups."""
    group_of = {name: g for g, names in enumerate(groups) for name in names}
    for key in list(flat):
        if key.startswith("param_groups."):
            g = group_of.get(flat_name(key))
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
    flat = _flatten(state)
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
        names = sorted({flat_name(k.split(".", 1)[1]) for k in missing})
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


def _flatten(state: dict[str, Any]) -> dict[str, Any]:
    """``state``'s items by the keys DCP saves them under (its default planner's own flattening)."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, storage_meta=None, is_coordinator=False)
    return dict(planner.state_dict)


def _check_extra(loc: Location, saved: set[str], held: Sequence[Sequence[str]]) -> None:
    extra = saved - {name for names in held for name in names}
    if extra:
        raise CheckpointError(f"{loc} has weights the model does not have: {_few(sorted(extra))}. {_OTHER_MODEL}")


def _few(names: Sequence[str]) -> str:
    shown = ", ".join(names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _load_plain(
    loc: Location, module: nn.Module, optimizers: Sequence[Optimizer], full_names: Sequence[str],
    weights_only: bool | None, shards: Sequence[StateShards | None],
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
            mine = {k: v for k, v in flat.items() if flat_name(k) in params}
            for key, value in mine.items():
                shape = params[flat_name(key)].shape
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
    for optimizer, flat, sharded in zip(optimizers, flats, shards):
        # entries the file lacks (parameters that never had a gradient) keep their fresh state
        current = optimizer_state(module, optimizer, sharded)
        current.update({k: v for k, v in flat.items() if k in current})
        load_optimizer_state(module, optimizer, current, sharded)
    for key in ("state_dict", "optimizer_states", RECORD):
        checkpoint.pop(key, None)
    return checkpoint
