"""Converts between this strategy's sharded checkpoints and plain single-file Lightning checkpoints.

No process group is needed: both directions run in one process, on local paths or fsspec URLs.

    python -m lightning_varuna.convert to-plain DIR OUT.ckpt
    python -m lightning_varuna.convert from-plain IN.ckpt DIR [--model package.module:ModelClass]

``to-plain`` writes what Lightning's default strategies write: the full ``state_dict`` (loads with
``Model.load_from_checkpoint``) and optimizer states keyed by parameter *index* (resumes with
``Trainer(...).fit(ckpt_path=...)``), from the parameter names and optimizer groups recorded in ``meta.pt``.
The data loader's position is left out unless asked for: it belongs to the strategy's resumable loader,
which a plain run does not have.
``from-plain`` keys a plain file's optimizer state by parameter name again, so that the directory loads under
any P x D. It needs to know which parameter each index is: from the record a ``to-plain`` file carries, from
the model (``--model``: the optimizer groups its ``configure_optimizers`` builds), or, for one optimizer with
one group over every entry of the ``state_dict``, from the ``state_dict``'s order.
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import sys
from collections.abc import Sequence
from typing import Any

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

__all__ = ["from_plain", "main", "to_plain"]


def to_plain(
    src: str | os.PathLike,
    dst: str | os.PathLike,
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
    loc = Location.of(src)
    meta = check_files(loc, weights_only, verify)
    record = meta.get(RECORD)
    if record is None:
        raise CheckpointError(
            f"{loc} has no parameter record ({RECORD!r} in meta.pt): it was written by an earlier version of"
            " lightning_varuna. Resume from it once and save it again."
        )
    data = read_everything(loc, record.get(CHECKSUMS, {}).get("items", {}) if verify else {})
    saved = sorted(int(key.split("_", 1)[1]) for key in data if key.startswith("optimizer_"))
    if saved != list(range(len(record["optimizers"]))):
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
    buffer = io.BytesIO()
    torch.save(plain, buffer)
    Location.of(dst).write_bytes(buffer.getvalue())


def from_plain(
    src: str | os.PathLike,
    dst: str | os.PathLike,
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
    try:
        plain = torch.load(io.BytesIO(loc.read_bytes()), map_location="cpu", weights_only=weights_only)
    except Exception as err:  # noqa: BLE001 - any load error: damaged, truncated or not a checkpoint
        raise CheckpointError(f"{loc} cannot be read ({type(err).__name__}: {err}).") from err
    if not isinstance(plain, dict) or not isinstance(plain.get("state_dict"), dict):
        raise CheckpointError(f"{loc} is not a Lightning checkpoint (no 'state_dict').")
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


def _record(
    loc: Location, weights: dict[str, Any], states: Sequence[dict[str, Any]], model: LightningModule | None
) -> dict[str, Any]:
    if model is not None:
        try:
            optimizers = _configure_optimizers(model.configure_optimizers())[0]
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


def _model_from(spec: str, plain_path: str | os.PathLike, weights_only: bool | None) -> LightningModule:
    """Builds ``package.module:Class`` with the hyper-parameters saved in the plain checkpoint."""
    module_name, _, class_name = spec.partition(":")
    if not class_name:
        raise SystemExit(f"--model must look like package.module:Class, got {spec!r}")
    cls = getattr(importlib.import_module(module_name), class_name)
    plain = torch.load(io.BytesIO(Location.of(plain_path).read_bytes()), map_location="cpu", weights_only=weights_only)
    hparams = {k: v for k, v in dict(plain.get("hyper_parameters", {})).items() if not k.startswith("_")}
    return cls(**hparams)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (``python -m lightning_varuna.convert --help``)."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_varuna.convert", description=__doc__.split("\n")[0]
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
    for command in (to, back):
        command.add_argument(
            "--unsafe-load", action="store_true", help="torch.load with weights_only=False (only for trusted files)"
        )
    args = parser.parse_args(argv)
    weights_only = False if args.unsafe_load else None
    try:
        if args.command == "to-plain":
            to_plain(args.src, args.dst, weights_only, args.keep_loader_state)
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
