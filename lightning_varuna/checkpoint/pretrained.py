"""Pretrained weights loaded into a partitioned model: each rank reads only the tensors its stage holds.

Sources (:func:`open_weights`):

- a state dict saved with ``torch.save``, or a Lightning ``.ckpt`` file (its ``state_dict``): mapped with
  ``torch.load(mmap=True, weights_only=True)``, so only the tensors copied are read from disk;
- a ``.safetensors`` file, read tensor by tensor;
- a Hugging Face model folder: ``model.safetensors``, or shards listed in ``model.safetensors.index.json``;
  ``pytorch_model.bin`` (or its ``.index.json`` shards);
- a checkpoint directory written by ``VarunaStrategy``: its weights, through DCP, which reads only the keys asked
  for.

The file's keys, with a prefix prepended, are matched against the whole model's ``state_dict`` keys and shapes
(known on every rank), so a mismatch raises the same :class:`CheckpointError` on every rank before any tensor is
read. A key the file lacks is filled from another key of the same tensor (Hugging Face omits an output head
tied to the embedding). The keys of a transformers model are renamed first as transformers renames them when it
loads (:mod:`~lightning_varuna.checkpoint.key_renames`).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_varuna.checkpoint.key_renames import key_renamer
from lightning_varuna.checkpoint.load import _agree, _few, check_files
from lightning_varuna.checkpoint.state import CheckpointError
from lightning_varuna.checkpoint.storage import META, Location, single_process_quiet
from lightning_varuna.pipeline.varuna_warning import VarunaWarning

__all__ = ["InitialWeights", "ModelLayout", "Weights", "check_keys", "load_initial_weights", "open_weights"]

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PYTORCH_BIN = "pytorch_model.bin"
PYTORCH_BIN_INDEX = "pytorch_model.bin.index.json"

Shape = tuple[int, ...]


class Weights:
    """A source of named tensors whose shapes are known before any is read.

    Attributes:
        path: Where the weights come from (for messages).
        shapes: Each key's shape.
    """

    def __init__(self, path: str, shapes: dict[str, Shape]) -> None:
        self.path = path
        self.shapes = shapes

    def copy_into(self, targets: Mapping[str, Sequence[Tensor]]) -> None:
        """Copies each key's tensor into its targets (cast to their dtype and device). Collective for DCP."""
        raise NotImplementedError


class _TensorDict(Weights):
    """Tensors already mapped (``torch.load(mmap=True)``): a copy reads only the pages it needs."""

    def __init__(self, path: str, tensors: dict[str, Tensor]) -> None:
        super().__init__(path, {k: tuple(v.shape) for k, v in tensors.items()})
        self.tensors = tensors

    def copy_into(self, targets: Mapping[str, Sequence[Tensor]]) -> None:
        with torch.no_grad():
            for key, outs in targets.items():
                for out in outs:
                    out.copy_(self.tensors[key])


class _SafeTensors(Weights):
    """One or several ``.safetensors`` files, read one tensor at a time."""

    def __init__(self, path: str, files: dict[str, str]) -> None:
        safe_open = _safe_open()
        shapes: dict[str, Shape] = {}
        for file in sorted(set(files.values())):
            with safe_open(file, framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if files.get(key) == file:
                        shapes[key] = tuple(handle.get_slice(key).get_shape())
        missing = sorted(set(files) - set(shapes))
        if missing:
            raise CheckpointError(f"{path}: the index lists tensors its files do not hold: {_few(missing)}.")
        super().__init__(path, shapes)
        self.files = files

    def copy_into(self, targets: Mapping[str, Sequence[Tensor]]) -> None:
        safe_open = _safe_open()
        by_file: dict[str, list[str]] = {}
        for key in targets:
            by_file.setdefault(self.files[key], []).append(key)
        with torch.no_grad():
            for file, keys in sorted(by_file.items()):
                with safe_open(file, framework="pt") as handle:
                    for key in keys:
                        tensor = handle.get_tensor(key)
                        for out in targets[key]:
                            out.copy_(tensor)


class _Sharded(Weights):
    """A checkpoint directory written by the strategy: DCP reads exactly the keys asked for."""

    def __init__(self, loc: Location) -> None:
        check_files(loc)
        index = loc.reader().read_metadata()
        prefix = "state_dict."
        shapes = {
            key[len(prefix):]: tuple(meta.size) for key, meta in index.state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
        }
        super().__init__(str(loc), shapes)
        self.loc = loc

    def copy_into(self, targets: Mapping[str, Sequence[Tensor]]) -> None:
        request = {key: outs[0].detach() for key, outs in targets.items()}
        with single_process_quiet():
            dcp.load({"state_dict": request}, storage_reader=self.loc.reader(), no_dist=not dist.is_initialized())
        with torch.no_grad():
            for key, outs in targets.items():
                for out in outs[1:]:
                    out.copy_(request[key])


def _safe_open() -> Any:
    try:
        from safetensors import safe_open
    except ImportError:  # an optional dependency
        raise CheckpointError(
            "Reading .safetensors weights needs the safetensors package: pip install safetensors"
        ) from None
    return safe_open


def _mapped(path: str) -> dict[str, Tensor]:
    """A state dict saved with ``torch.save`` or Lightning checkpoint, mapped into memory (tensors read on use)."""
    try:
        loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:  # noqa: BLE001 - damaged, not a torch file, or holding more than tensors
        raise CheckpointError(
            f"{path} cannot be read as a torch.save'd state dict ({type(err).__name__}: {err}). Give a state dict"
            " of tensors, a Lightning .ckpt, a .safetensors file or a Hugging Face model folder."
        ) from err
    if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        loaded = loaded["state_dict"]  # a Lightning checkpoint
    if not isinstance(loaded, dict) or not all(isinstance(v, Tensor) for v in loaded.values()):
        raise CheckpointError(f"{path} holds no state dict (a dict of tensors, or a Lightning checkpoint's).")
    return loaded


def _index(path: str) -> dict[str, str]:
    """A Hugging Face shard index: each key's file (a path)."""
    try:
        with open(path) as file:
            weight_map = json.load(file)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        problem = f"{path} is not a shard index with a 'weight_map' ({type(err).__name__}: {err})."
        raise CheckpointError(problem) from err
    folder = os.path.dirname(path)
    return {key: os.path.join(folder, name) for key, name in weight_map.items()}


def open_weights(path: str | os.PathLike[str]) -> Weights:
    """The weights at ``path`` (see the module's docstring for the formats), without reading any tensor.

    Raises:
        CheckpointError: ``path`` does not exist, or holds none of the formats, or cannot be read.
    """
    text = os.fspath(path)
    loc = Location.of(text)
    if not loc.exists():
        raise CheckpointError(f"initial_weights: {text} does not exist.")
    if not loc.isdir():
        if text.endswith(".safetensors"):
            return _SafeTensors(text, {key: text for key in _safetensors_keys(text)})
        return _TensorDict(text, _mapped(text))
    if loc.child(META).exists():
        return _Sharded(loc)
    folder = loc.path
    for name in (SAFETENSORS_INDEX, SAFETENSORS, PYTORCH_BIN_INDEX, PYTORCH_BIN):
        file = os.path.join(folder, name)
        if not os.path.exists(file):
            continue
        if name == SAFETENSORS_INDEX:
            return _SafeTensors(text, _index(file))
        if name == SAFETENSORS:
            return _SafeTensors(text, {key: file for key in _safetensors_keys(file)})
        if name == PYTORCH_BIN_INDEX:
            files = _index(file)
            tensors: dict[str, Tensor] = {}
            for shard in sorted(set(files.values())):
                tensors.update({k: v for k, v in _mapped(shard).items() if files.get(k) == shard})
            return _TensorDict(text, tensors)
        return _TensorDict(text, _mapped(file))
    raise CheckpointError(
        f"initial_weights: {text} is a folder without weights: expected a checkpoint written by VarunaStrategy"
        f" ({META}) or a Hugging Face model folder ({SAFETENSORS_INDEX}, {SAFETENSORS}, {PYTORCH_BIN_INDEX} or"
        f" {PYTORCH_BIN})."
    )


def _safetensors_keys(file: str) -> list[str]:
    safe_open = _safe_open()
    try:
        with safe_open(file, framework="pt") as handle:
            return list(handle.keys())
    except Exception as err:  # noqa: BLE001 - a damaged header
        raise CheckpointError(f"{file} cannot be read as safetensors ({type(err).__name__}: {err}).") from err


def check_keys(
    weights: Weights, shapes: Mapping[str, Shape], aliases: Mapping[str, Sequence[str]], prefix: str, strict: bool,
    rename: Callable[[str], str] | None = None,
) -> tuple[str | None, str | None, dict[str, str]]:
    """Matches the file's keys (``prefix`` + key) with the whole model's ``state_dict`` keys.

    Args:
        weights: The source.
        shapes: The whole model's ``state_dict`` keys and shapes.
        aliases: For each key, the other keys of the same tensor (a tied parameter registered twice).
        prefix: Prepended to the file's keys.
        strict: Whether missing and unexpected keys are an error (else a warning).
        rename: Renames a file key before the prefix is prepended (transformers' renamings,
            :func:`~lightning_varuna.checkpoint.key_renames.key_renamer`).

    Returns:
        ``(error, warning, source)``: the problem to raise, the one to warn about, and for each model key
        the file key it is loaded from (a key the file lacks from an alias the file has).
    """
    found = {prefix + (rename(key) if rename is not None else key): key for key in weights.shapes}
    source: dict[str, str] = {}
    for name in shapes:
        holder = next((n for n in (name, *aliases.get(name, ())) if n in found), None)
        if holder is not None:
            source[name] = found[holder]
    missing = [name for name in shapes if name not in source]
    unexpected = [name for name in found if name not in shapes]
    wrong = [f"{name} {weights.shapes[key]} in the file, {shapes[name]} in the model" for name, key in source.items()
             if tuple(weights.shapes[key]) != tuple(shapes[name])]
    where = f"initial_weights {weights.path}"
    if wrong:
        problem = f"{where}: {len(wrong)} shape(s) differ: {_few(wrong)}. It holds another model or configuration."
        return problem, None, {}
    parts = []
    if missing:
        parts.append(f"{len(missing)} key(s) of the model are not in it: {_few(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} of its key(s) are not in the model: {_few(unexpected)}")
    if not parts:
        return None, None, source
    hint = (f"Keys are matched as initial_weights_prefix + the file's key (prefix {prefix!r}; e.g. 'model.' when"
            " the pretrained model is the LightningModule's self.model).")
    if strict:
        return (f"{where}: {'; '.join(parts)}. {hint} Pass initial_weights_strict=False to load the keys that"
                " match and keep the initialization of the others.", None, {})
    return None, f"{where}: {'; '.join(parts)}; the model's keys not in it keep their initialization.", source


def load_initial_weights(
    path: str | os.PathLike[str], module: nn.Module, shapes: Mapping[str, Shape], aliases: Mapping[str, Sequence[str]],
    prefix: str = "", strict: bool = True,
) -> None:
    """Loads the weights this rank holds from ``path`` into ``module`` (collective: every rank calls it).

    Args:
        path: The pretrained weights (see :func:`open_weights`).
        module: The partitioned model: its ``state_dict`` holds this rank's parameters and the buffers.
        shapes: The whole model's ``state_dict`` keys and shapes (before partitioning).
        aliases: For each key, the other keys of the same tensor.
        prefix: Prepended to the file's keys.
        strict: Whether missing and unexpected keys are an error.

    Raises:
        CheckpointError: On every rank alike, if the file cannot be read or does not fit the model.
    """
    problem = note = None
    weights: Weights | None = None
    source: dict[str, str] = {}
    try:
        weights = open_weights(path)
        problem, note, source = check_keys(weights, shapes, aliases, prefix, strict, key_renamer(module, prefix))
    except CheckpointError as err:
        problem = str(err)
    _agree(problem)
    assert weights is not None
    if note is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        warnings.warn(note, VarunaWarning, stacklevel=2)
    targets: dict[str, list[Tensor]] = {}
    seen: set[int] = set()
    for name, tensor in module.state_dict(keep_vars=True).items():
        if name in source and id(tensor) not in seen:
            seen.add(id(tensor))
            targets.setdefault(source[name], []).append(tensor.detach())
    weights.copy_into(targets)


@dataclass(frozen=True)
class ModelLayout:
    """The whole model's ``state_dict`` keys and shapes, taken before partitioning (cheap on the meta device)."""

    shapes: dict[str, Shape]
    aliases: dict[str, list[str]]
    """For each key, the other keys of the same tensor (a parameter registered in two modules)."""

    @classmethod
    def of(cls, module: nn.Module) -> ModelLayout:
        """The layout of ``module``."""
        state = module.state_dict(keep_vars=True)
        keys: dict[int, list[str]] = {}
        for name, tensor in state.items():
            keys.setdefault(id(tensor), []).append(name)
        aliases = {name: [other for other in group if other != name] for group in keys.values() for name in group}
        return cls({name: tuple(t.shape) for name, t in state.items()}, aliases)


@dataclass(frozen=True)
class InitialWeights:
    """Pretrained weights to load at setup (``VarunaStrategy(initial_weights=...)``), checked when created.

    Args:
        path: The weights (see :func:`open_weights`).
        prefix: Prepended to the file's keys.
        strict: Whether missing and unexpected keys are an error.
    """

    path: str | os.PathLike[str]
    prefix: str = ""
    strict: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)):
            raise ValueError(f"initial_weights must be a path, got {self.path!r}.")
        if not isinstance(self.prefix, str):
            raise ValueError(f"initial_weights_prefix must be a string, got {self.prefix!r}.")
        if not isinstance(self.strict, bool):
            raise ValueError(f"initial_weights_strict must be True or False, got {self.strict!r}.")

    def load(self, module: nn.Module, layout: ModelLayout) -> None:
        """Loads them into the partitioned ``module`` (collective; see :func:`load_initial_weights`)."""
        load_initial_weights(self.path, module, layout.shapes, layout.aliases, self.prefix, self.strict)
