"""Converts between this strategy's sharded checkpoints and plain single-file Lightning checkpoints.

No process group is needed: both directions run in one process, on local paths or fsspec URLs.

    python -m lightning_varuna.trainer.convert to-plain DIR OUT.ckpt
    python -m lightning_varuna.trainer.convert from-plain IN.ckpt DIR [--model package.module:ModelClass]
    python -m lightning_varuna.trainer.convert to-safetensors DIR_OR_CKPT OUT.safetensors [--strip-prefix model.]

``to-plain`` writes what Lightning's default strategies write: the full ``state_dict`` (loads with
``Model.load_from_checkpoint``) and optimizer states keyed by parameter *index* (resumes with
``Trainer(...).fit(ckpt_path=...)``), from the parameter names and optimizer groups recorded in ``meta.pt``.
The data loader's position is left out unless asked for: it belongs to the strategy's resumable loader,
which a plain run does not have.
``from-plain`` keys a plain file's optimizer state by parameter name again, so that the directory loads under
any P x D. It needs to know which parameter each index is: from the record a ``to-plain`` file carries, from
the model (``--model``: the optimizer groups its ``configure_optimizers`` builds), or, for one optimizer with
one group over every entry of the ``state_dict``, from the ``state_dict``'s order.
``to-safetensors`` writes the weights alone (of a checkpoint directory or a plain file) as one ``.safetensors``
file; with ``--strip-prefix model.`` only the keys under ``model.`` are written, without it, which is the
layout a Hugging Face model wrapped as the LightningModule's ``self.model`` loads back with its own loading.
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.core.optimizer import _configure_optimizers

from lightning_varuna.checkpoint.integrity import CHECKSUMS
from lightning_varuna.checkpoint.job import write_single
from lightning_varuna.checkpoint.load import check_files, read_everything
from lightning_varuna.checkpoint.state import (
    RECORD,
    CheckpointError,
    flat_to_plain,
    param_groups_by_name,
    plain_to_flat,
)
from lightning_varuna.checkpoint.storage import Location

__all__ = ["from_plain", "load_from_checkpoint", "main", "plain_checkpoint", "to_plain", "to_safetensors"]

_Module = TypeVar("_Module", bound=LightningModule)


def to_plain(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    weights_only: bool | None = None,
    keep_loader_state: bool = False,
    verify: bool = True,
) -> None:
    """Writes the sharded checkpoint ``src`` as one plain Lightning checkpoint file ``dst``.

    Args:
        src: A checkpoint directory written by ``VarunaStrategy`` (local path or fsspec URL).
        dst: The file to write (replaced atomically if it exists).
        weights_only: Passed to ``torch.load`` for ``meta.pt``.
        keep_loader_state: Keep the training data loader's position. It is dropped by default: the strategy
            records it for its own resumable loader, and Lightning refuses it when resuming with a plain
            ``DataLoader`` (the resumed epoch then starts from its beginning, as for any plain loader).
        verify: Check every file and item against the checksums it was saved with (if it has them).

    Raises:
        CheckpointError: ``src`` is incomplete or damaged, or has no parameter record.
    """
    plain = plain_checkpoint(src, weights_only, keep_loader_state, verify=verify)
    buffer = io.BytesIO()
    torch.save(plain, buffer)
    Location.of(dst).write_bytes(buffer.getvalue())


def plain_checkpoint(
    src: str | os.PathLike[str] | Location, weights_only: bool | None = None, keep_loader_state: bool = False,
    optimizer_states: bool = True, verify: bool = True,
) -> dict[str, Any]:
    """The sharded checkpoint ``src`` as the dictionary of a plain Lightning checkpoint (see :func:`to_plain`).

    Reads in this process alone, whether or not a process group exists. ``optimizer_states=False`` leaves the
    optimizer states out (and unread).
    """
    loc = Location.of(src)
    meta = check_files(loc, weights_only, verify)
    record = meta.get(RECORD)
    if record is None:
        raise CheckpointError(
            f"{loc} has no parameter record ({RECORD!r} in meta.pt): it was written by an earlier version of"
            " lightning_varuna. Resume from it once and save it again."
        )
    data = read_everything(loc, record.get(CHECKSUMS, {}).get("items", {}) if verify else {},
                           None if optimizer_states else {"state_dict"})
    saved = sorted(int(key.split("_", 1)[1]) for key in data if key.startswith("optimizer_"))
    if optimizer_states and saved != list(range(len(record["optimizers"]))):
        raise CheckpointError(
            f"{loc} holds {len(saved)} optimizer state(s) but its record lists {len(record['optimizers'])}."
        )
    plain = {key: value for key, value in meta.items()}
    if not keep_loader_state:
        plain.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).pop("combined_loader", None)
    plain["state_dict"] = data.get("state_dict", {})
    if saved:
        plain["optimizer_states"] = [
            flat_to_plain(data[f"optimizer_{i}"], groups, record.get("hyper", [None] * len(saved))[i])
            for i, groups in enumerate(record["optimizers"])
        ]
    return plain


def load_from_checkpoint(
    cls: type[_Module], checkpoint_path: str | os.PathLike[str], map_location: Any = None,
    hparams_file: str | os.PathLike[str] | None = None, strict: bool | None = None, weights_only: bool | None = None,
    **kwargs: Any,
) -> _Module:
    """``cls.load_from_checkpoint`` for a checkpoint this strategy wrote: the module with all its weights.

    Lightning's ``LightningModule.load_from_checkpoint`` reads one file; this strategy's checkpoints are
    directories. The directory is read as the plain checkpoint :func:`to_plain` would write (weights only, in
    memory) and handed to Lightning's loader, so hyper-parameters, ``on_load_checkpoint``, ``strict``,
    ``map_location`` and ``kwargs`` behave as there. A plain checkpoint file goes to Lightning's loader as it is.
    It runs in this process alone (whether or not a process group exists) and holds the weights about three
    times in memory at its peak; for a model that does not fit, convert the checkpoint to a file first
    (``python -m lightning_varuna.trainer.convert to-plain``).

    Args:
        cls: The LightningModule class.
        checkpoint_path: A checkpoint directory written by ``VarunaStrategy``, or a plain checkpoint file
            (local path or fsspec URL).
        map_location: As for Lightning's ``load_from_checkpoint``.
        hparams_file: As for Lightning's ``load_from_checkpoint``.
        strict: As for Lightning's ``load_from_checkpoint``.
        weights_only: Passed to ``torch.load`` (``meta.pt`` and the weights).
        **kwargs: Hyper-parameters overriding the saved ones, as for Lightning's ``load_from_checkpoint``.

    Raises:
        CheckpointError: The directory is incomplete or damaged.
    """
    loc = Location.of(checkpoint_path)
    source: Any = checkpoint_path
    if loc.isdir():
        plain = plain_checkpoint(loc, weights_only, optimizer_states=False)
        source = io.BytesIO()
        torch.save(plain, source)
        del plain
        source.seek(0)
    # Lightning reads hparams_file through str() and fsspec, which take any path, though it declares str | Path
    hparams = cast("str | Path | None", hparams_file)
    return cls.load_from_checkpoint(source, map_location=map_location, hparams_file=hparams, strict=strict,
                                    weights_only=weights_only, **kwargs)


def from_plain(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    model: LightningModule | None = None,
    weights_only: bool | None = None,
) -> None:
    """Writes the plain Lightning checkpoint file ``src`` as a sharded checkpoint directory ``dst``.

    Args:
        src: A single-file Lightning checkpoint (local path or fsspec URL).
        dst: The directory to write (replaced atomically if it exists); loads under any P x D.
        model: The model the checkpoint is of, built as for training: its ``configure_optimizers`` tells
            which parameter each optimizer entry belongs to. Not needed for files written by :func:`to_plain`
            or with a single optimizer of one group over all parameters (and no persistent buffers).
        weights_only: Passed to ``torch.load``.

    Raises:
        CheckpointError: ``src`` cannot be read, or its optimizer entries cannot be matched to parameters.
    """
    loc = Location.of(src)
    plain = _read_plain(loc, weights_only)
    weights = plain.pop("state_dict")
    states = plain.pop("optimizer_states", [])
    record = plain.pop(RECORD, None) or _record(loc, weights, states, model)
    if len(record["optimizers"]) != len(states):
        raise CheckpointError(
            f"{loc} has {len(states)} optimizer state(s), the model's configure_optimizers {len(record['optimizers'])}."
        )
    shards: dict[str, Any] = {"state_dict": weights}
    for i, (state, groups) in enumerate(zip(states, record["optimizers"])):
        flat = plain_to_flat(state, groups, f"{loc}: ")
        _check_shapes(loc, flat, weights)
        shards[f"optimizer_{i}"] = flat
    write_single(dst, shards, plain, record["optimizers"], record["param_names"])


def to_safetensors(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], strip_prefix: str = "", weights_only: bool | None = None
) -> int:
    """Writes the weights of ``src`` as one ``.safetensors`` file ``dst``; returns how many tensors it holds.

    Args:
        src: A checkpoint directory written by ``VarunaStrategy``, or a plain Lightning checkpoint file.
        dst: The file to write (local path).
        strip_prefix: Keep only the keys that start with it, without it (e.g. ``"model."``).
        weights_only: Passed to ``torch.load`` for a plain file.

    Raises:
        CheckpointError: ``src`` is incomplete, damaged, not a checkpoint, or has no key under ``strip_prefix``.
    """
    try:
        from safetensors.torch import save_file
    except ImportError:  # an optional dependency
        raise CheckpointError("Writing .safetensors needs the safetensors package: pip install safetensors") from None
    loc = Location.of(src)
    if loc.isdir():
        meta = check_files(loc, weights_only)
        expected = meta.get(RECORD, {}).get(CHECKSUMS, {}).get("items", {})
        weights = read_everything(loc, expected, {"state_dict"})["state_dict"]
    else:
        weights = _read_plain(loc, weights_only)["state_dict"]
    kept = {key[len(strip_prefix):]: value for key, value in weights.items() if key.startswith(strip_prefix)}
    if not kept:
        raise CheckpointError(f"{loc} has no weights whose name starts with {strip_prefix!r}.")
    storages: set[int] = set()
    tensors = {}
    for key, value in kept.items():
        # safetensors refuses tensors sharing memory (a tied parameter saved under two names): copy the others
        value = value.detach().contiguous()
        pointer = value.untyped_storage().data_ptr()
        tensors[key] = value.clone() if pointer in storages else value
        storages.add(pointer)
    save_file(tensors, os.fspath(dst), metadata={"format": "pt"})
    return len(tensors)


def _read_plain(loc: Location, weights_only: bool | None) -> dict[str, Any]:
    """A plain Lightning checkpoint file's dictionary."""
    try:
        plain = torch.load(io.BytesIO(loc.read_bytes()), map_location="cpu", weights_only=weights_only)
    except Exception as err:  # noqa: BLE001 - any load error: damaged, truncated or not a checkpoint
        raise CheckpointError(f"{loc} cannot be read ({type(err).__name__}: {err}).") from err
    if not isinstance(plain, dict) or not isinstance(plain.get("state_dict"), dict):
        raise CheckpointError(f"{loc} is not a Lightning checkpoint (no 'state_dict').")
    return plain


def _record(
    loc: Location, weights: dict[str, Any], states: Sequence[dict[str, Any]], model: LightningModule | None
) -> dict[str, Any]:
    if model is not None:
        try:
            configured: Any = model.configure_optimizers()  # Lightning's parser takes every form it may return
            optimizers = _configure_optimizers(configured)[0]
        except Exception as err:  # noqa: BLE001 - user code outside a Trainer
            raise CheckpointError(
                f"{type(model).__name__}.configure_optimizers() failed outside a Trainer ({type(err).__name__}:"
                f" {err}); it is needed to tell which parameter each optimizer entry of {loc} belongs to."
            ) from err
        optimizers = [getattr(o, "_optimizer", o) for o in optimizers]
        names = [name for name, _ in model.named_parameters()]
        return {"param_names": names, "optimizers": param_groups_by_name(model, optimizers)}
    if not states:
        return {"param_names": [], "optimizers": []}
    groups = states[0].get("param_groups", [])
    if len(states) == 1 and len(groups) == 1 and len(groups[0]["params"]) == len(weights):
        names = list(weights)
        return {"param_names": names, "optimizers": [[names]]}
    raise CheckpointError(
        f"{loc} keys optimizer state by parameter position, and with {len(states)} optimizer(s),"
        f" {sum(len(s.get('param_groups', [])) for s in states)} group(s) and {len(weights)} state_dict entries the"
        " position cannot be matched to a name from the file alone: give the model (--model package.module:Class)."
    )


def _check_shapes(loc: Location, flat: dict[str, Any], weights: dict[str, Any]) -> None:
    for key, value in flat.items():
        if not key.startswith("state.") or not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        name = key[len("state.") :].rsplit(".", 1)[0]
        weight = weights.get(name)
        if weight is None or weight.shape != value.shape:
            raise CheckpointError(
                f"{loc}: the optimizer state does not line up with the parameters ({key} has shape"
                f" {tuple(value.shape)}, the weight {None if weight is None else tuple(weight.shape)}). Give the model"
                " (--model) or check that each parameter group lists parameters in named_parameters() order."
            )


def _model_from(spec: str, plain_path: str | os.PathLike[str], weights_only: bool | None) -> LightningModule:
    """Builds ``package.module:Class`` with the hyper-parameters saved in the plain checkpoint."""
    module_name, _, class_name = spec.partition(":")
    if not class_name:
        raise SystemExit(f"--model must look like package.module:Class, got {spec!r}")
    cls = getattr(importlib.import_module(module_name), class_name)
    plain = torch.load(io.BytesIO(Location.of(plain_path).read_bytes()), map_location="cpu", weights_only=weights_only)
    hparams = {k: v for k, v in dict(plain.get("hyper_parameters", {})).items() if not k.startswith("_")}
    model: LightningModule = cls(**hparams)
    return model


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (``python -m lightning_varuna.trainer.convert --help``)."""
    parser = argparse.ArgumentParser(
        prog="varuna-convert", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    to = commands.add_parser("to-plain", help="sharded checkpoint directory -> plain Lightning checkpoint file")
    to.add_argument("src", help="checkpoint directory (path or fsspec URL)")
    to.add_argument("dst", help="file to write, e.g. model.ckpt")
    back = commands.add_parser("from-plain", help="plain Lightning checkpoint file -> sharded checkpoint directory")
    back.add_argument("src", help="plain checkpoint file (path or fsspec URL)")
    back.add_argument("dst", help="directory to write")
    back.add_argument("--model", help="package.module:Class of the LightningModule, built from the saved hparams")
    to.add_argument("--keep-loader-state", action="store_true",
                    help="keep the data loader's position (for resuming with the same stateful loader)")
    safe = commands.add_parser("to-safetensors", help="checkpoint directory or plain file -> .safetensors weights")
    safe.add_argument("src", help="checkpoint directory or plain checkpoint file")
    safe.add_argument("dst", help="file to write, e.g. model.safetensors")
    safe.add_argument("--strip-prefix", default="", help="write only keys starting with it, without it ('model.')")
    for command in (to, back, safe):
        command.add_argument(
            "--unsafe-load", action="store_true", help="torch.load with weights_only=False (only for trusted files)"
        )
    args = parser.parse_args(argv)
    weights_only = False if args.unsafe_load else None
    try:
        if args.command == "to-plain":
            to_plain(args.src, args.dst, weights_only, args.keep_loader_state)
        elif args.command == "to-safetensors":
            to_safetensors(args.src, args.dst, args.strip_prefix, weights_only)
        else:
            model = _model_from(args.model, args.src, weights_only) if args.model else None
            from_plain(args.src, args.dst, model, weights_only)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
