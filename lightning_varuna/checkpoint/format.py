"""DCP's on-disk format, written without DCP's planning protocol: one file per rank, one index by rank 0.

``dcp.save`` plans every write collectively (local plans, a reduce-scatter of them, a global plan, a gather of
the results), builds a dataclass per item at each step and pickles each tensor: for the example model's
3 MiB that is 25-45 ms of CPU per rank and write, which an asynchronous writer takes from the training
processes on a small host. The checkpoints written here hold only whole tensors and small objects, keyed by
name, so the plan is known without that protocol:

* :func:`flatten` flattens a rank's state exactly as DCP's ``DefaultSavePlanner`` does (nested mappings,
  keys joined by dots), and :func:`inventory` lists each item's size;
* :func:`assign` gives every item to one of the ranks that hold it (replicas share the writing), the same
  on every rank, from every rank's inventory;
* :func:`write_items` writes a rank's items into ``__<rank>_0.distcp`` (a ``torch.save`` record per item,
  as DCP's ``FileSystemWriter`` writes them, byte for byte) and returns their part of the index;
* :func:`write_index` writes DCP's ``.metadata`` from every rank's part (one rank gathers them).

What comes out is read by DCP's own ``FileSystemReader`` / ``FsspecReader`` and ``dcp.load``, and by its tools
(``dcp_to_torch_save``). A state this module does not flatten like DCP (a list holding tensors) raises
:class:`UnsupportedState`; the caller then uses ``dcp.save``.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
import sys
import uuid
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, serialization
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from lightning_varuna.checkpoint.storage import INDEX, Location

__all__ = ["IndexPart", "UnsupportedState", "assign", "flatten", "inventory", "write_index", "write_items"]

log = logging.getLogger(__name__)

_SUFFIX = ".distcp"
_BUFFER_BYTES = 4 << 20

Flat = Mapping[str, tuple[tuple[str, ...], Any]]
"""``{flat key: (path in the state, value)}``, from :func:`flatten`."""
Inventory = list[tuple[str, int]]
"""``(flat key, bytes)`` of each item a rank holds, in its state's order."""


class UnsupportedState(ValueError):
    """A state that :func:`flatten` does not take (``dcp.save`` is used instead)."""


@dataclasses.dataclass
class IndexPart:
    """One rank's part of DCP's index: the items it wrote, and where."""

    items: dict[str, TensorStorageMetadata | BytesStorageMetadata]
    paths: dict[str, tuple[str, ...]]
    storage: dict[MetadataIndex, _StorageInfo]


def flatten(state: Mapping[str, Any]) -> dict[str, tuple[tuple[str, ...], Any]]:
    """``{flat key: (path, value)}`` as DCP's ``flatten_state_dict`` makes it for a state of nested mappings.

    Raises:
        UnsupportedState: A list or tuple holds a tensor or a mapping (DCP would descend into it).
    """
    flat: dict[str, tuple[tuple[str, ...], Any]] = {}

    def visit(path: tuple[str, ...], value: Any) -> None:
        if isinstance(value, Mapping):
            for key, inner in value.items():
                visit((*path, str(key)), inner)
            return
        if isinstance(value, (list, tuple)) and _holds_structure(value):
            raise UnsupportedState(f"{'.'.join(path)} is a {type(value).__name__} holding tensors or mappings")
        key = ".".join(path)
        if key in flat:
            raise UnsupportedState(f"two entries flatten to {key}")
        flat[key] = (path, value)

    for key, value in state.items():
        visit((str(key),), value)
    return flat


def _holds_structure(values: Sequence[Any]) -> bool:
    return any(
        isinstance(v, (Tensor, Mapping)) or (isinstance(v, (list, tuple)) and _holds_structure(v)) for v in values
    )


def inventory(flat: Flat) -> Inventory:
    """Each item's flat key and size in bytes (objects count as 0: their size is unknown before pickling)."""
    return [(key, value.nbytes if isinstance(value, Tensor) else 0) for key, (_, value) in flat.items()]


def assign(inventories: Sequence[Inventory]) -> list[set[str]]:
    """Which items each rank writes: each item once, by one of the ranks that hold it.

    Largest items first, each to the holder with the fewest bytes assigned so far (the lowest rank on a tie),
    so replicas share the writing. A pure function of the inventories: every rank computes the same.
    """
    holders: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    for rank, items in enumerate(inventories):
        for key, nbytes in items:
            holders.setdefault(key, []).append(rank)
            sizes[key] = max(sizes.get(key, 0), nbytes)
    load = [0] * len(inventories)
    chosen: list[set[str]] = [set() for _ in inventories]
    for key in sorted(holders, key=lambda k: (-sizes[k], k)):
        rank = min(holders[key], key=lambda r: (load[r], r))
        chosen[rank].add(key)
        load[rank] += max(sizes[key], 1)
    return chosen


def write_items(directory: Location, rank: int, flat: Flat, mine: set[str]) -> IndexPart:
    """Writes the items in ``mine`` to ``directory/__<rank>_0.distcp`` and returns this rank's part of the index.

    Args:
        directory: The checkpoint directory (created if missing).
        rank: This rank (names the file, as ``dcp.save`` does).
        flat: This rank's state, from :func:`flatten`.
        mine: The keys this rank writes (:func:`assign`); the others are written by other ranks.
    """
    items: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    paths: dict[str, tuple[str, ...]] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    directory.fs.makedirs(directory.path, exist_ok=True)
    if not mine:
        return IndexPart(items, paths, storage)
    name = f"__{rank}_0{_SUFFIX}"
    with _open_for_writing(directory.child(name)) as stream:
        sink = _Sink(stream)
        for key, (path, value) in flat.items():
            if key not in mine:
                continue
            offset = sink.tell()
            _write_record(sink, value)
            items[key] = _describe(value)
            paths[key] = path
            storage[_index(key, value)] = _StorageInfo(name, offset, sink.tell() - offset)
        _sync(stream)
    return IndexPart(items, paths, storage)


def write_index(directory: Location, parts: Sequence[IndexPart], expected: Iterable[str]) -> None:
    """Writes DCP's ``.metadata`` for a checkpoint whose ranks returned ``parts`` (call on one rank).

    Raises:
        RuntimeError: An item of ``expected`` (every rank's inventory) was written by no rank.
    """
    items: dict[str, Any] = {}
    paths: dict[str, tuple[str, ...]] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for part in parts:
        items.update(part.items)
        paths.update(part.paths)
        storage.update(part.storage)
    missing = [key for key in expected if key not in items]
    if missing:
        raise RuntimeError(f"no rank wrote {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    metadata = Metadata(state_dict_metadata=items, planner_data=paths, storage_data=storage)
    fields = {f.name for f in dataclasses.fields(Metadata)}
    if "storage_meta" in fields:
        metadata.storage_meta = StorageMeta(checkpoint_id=directory.text, save_id=str(uuid.uuid4()))
    if "version" in fields:
        metadata.version = getattr(dcp_filesystem, "CURRENT_DCP_VERSION", None)
    directory.fs.makedirs(directory.path, exist_ok=True)
    unfinished = directory.child(INDEX + ".tmp")
    with _open_for_writing(unfinished) as stream:
        pickle.dump(metadata, stream)
        _sync(stream)
    directory.fs.mv(unfinished.path, directory.child(INDEX).path)


def _describe(value: Any) -> TensorStorageMetadata | BytesStorageMetadata:
    if not isinstance(value, Tensor):
        return BytesStorageMetadata()
    return TensorStorageMetadata(
        properties=TensorProperties.create_from_tensor(value),
        size=value.size(),
        chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * value.dim()), sizes=value.size())],
    )


def _index(key: str, value: Any) -> MetadataIndex:
    if isinstance(value, Tensor):
        return MetadataIndex(key, torch.Size([0] * value.dim()), 0)
    return MetadataIndex(key)


def _write_record(sink: _Sink, value: Any) -> None:
    """``torch.save`` of one item, as DCP's ``FileSystemWriter`` writes it (a tensor without its larger storage)."""
    if isinstance(value, Tensor):
        value = value.detach()
        if value.device.type != "cpu":
            value = value.cpu()
        if value.untyped_storage().nbytes() != value.nbytes or not value.is_contiguous():
            value = value.clone(memory_format=torch.contiguous_format)
        if _TensorRecords.applies_to(value):
            _TENSOR_RECORDS.write(sink, value)
            return
    torch.save(value, sink)


class _Sink:
    """A file for ``torch.save`` whose ``flush`` waits for the end of the file.

    ``torch.save`` flushes after every record, which would make a system call per item (tens of microseconds
    each in a virtual machine); the records go out in large writes through the file's own buffer instead.
    """

    def __init__(self, stream: Any) -> None:
        self.write = stream.write
        self.tell = stream.tell

    def flush(self) -> None:
        pass


class _TensorRecords:
    """``torch.save`` of plain tensors, byte for byte, without pickling each one (4x faster for small tensors).

    ``torch.save`` pickles a tensor's dtype, shape and strides into a ``data.pkl`` record and adds its bytes as
    ``data/0``; that pickle is the same for every plain CPU tensor of one dtype, shape and strides that owns its
    storage. It is taken from ``torch.save``'s output the first time a layout is seen, and used only if the
    records rebuilt from it give exactly ``torch.save``'s bytes for that tensor. Where they do not (a torch that
    writes other records), that layout keeps going through ``torch.save``.
    """

    def __init__(self) -> None:
        self._pickles: dict[tuple[torch.dtype, tuple[int, ...], tuple[int, ...]], bytes | None] = {}

    @staticmethod
    def applies_to(tensor: Tensor) -> bool:
        """Whether ``tensor`` is plain: no subclass, quantization, nesting, sparsity, conjugate or negative bit."""
        return (
            type(tensor) is Tensor and tensor.layout is torch.strided and tensor.device.type == "cpu"
            and not (tensor.is_quantized or tensor.is_nested or tensor.is_conj() or tensor.is_neg())
            and not tensor.requires_grad and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == tensor.nbytes
        )

    def write(self, sink: Any, tensor: Tensor) -> None:
        """Writes ``torch.save(tensor)`` to ``sink`` (``tensor`` must be :meth:`plain <applies_to>`)."""
        key = (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
        if key not in self._pickles:
            self._pickles[key] = self._learn(tensor)
        pickled = self._pickles[key]
        if pickled is None:
            torch.save(tensor, sink)
        else:
            self._rebuild(sink, tensor, pickled)

    def _learn(self, tensor: Tensor) -> bytes | None:
        reference = io.BytesIO()
        torch.save(tensor, reference)
        try:
            with zipfile.ZipFile(reference) as archive:
                pickled = archive.read("archive/data.pkl")
            rebuilt = io.BytesIO()
            self._rebuild(rebuilt, tensor, pickled)
            if rebuilt.getvalue() == reference.getvalue():
                return pickled
        except Exception:  # noqa: BLE001 - any difference in torch's format: keep using torch.save
            log.debug("torch.save records of %s %s are not rebuilt", tensor.dtype, tuple(tensor.shape), exc_info=True)
        return None

    @staticmethod
    def _rebuild(sink: Any, tensor: Tensor, pickled: bytes) -> None:
        # the records torch.serialization._save writes for one tensor that owns its storage, in its order
        alignment = str(serialization._get_storage_alignment())  # a config lookup, as torch.save does each time
        with serialization._open_zipfile_writer(sink) as archive:
            archive.write_record("data.pkl", pickled, len(pickled))
            archive.write_record(".format_version", "1", 1)
            archive.write_record(".storage_alignment", alignment, len(alignment))
            archive.write_record("byteorder", sys.byteorder, len(sys.byteorder))
            archive.write_record("data/0", tensor.untyped_storage(), tensor.nbytes)


_TENSOR_RECORDS = _TensorRecords()


def _sync(stream: Any) -> None:
    """Flushes ``stream`` and has the OS write it to disk where it can (local files, fsspec's local files)."""
    stream.flush()
    try:
        os.fsync(stream.fileno())
    except (AttributeError, OSError, io.UnsupportedOperation):
        pass  # a remote store: closing the file uploads it


def _open_for_writing(loc: Location) -> Any:
    if loc.url:
        return loc.fs.open(loc.path, "wb")
    return open(loc.path, "wb", buffering=_BUFFER_BYTES)  # noqa: SIM115 - a context manager
