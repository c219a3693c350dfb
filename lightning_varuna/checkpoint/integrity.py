"""Checksums of everything a checkpoint holds, taken as DCP writes it and checked as DCP reads it back.

A shard can be damaged without changing its size (a bad disk, a torn copy, a bit flip in transit), and the
tensor then loads with wrong values. The writer's DCP planner (:class:`ChecksumSavePlanner`) takes a CRC-32 of
each item as it hands it to DCP's writer: a tensor's bytes, or the exact bytes written for any other object; the
checkpoint's record keeps them (:data:`CHECKSUMS`), with those of ``meta.pt`` and DCP's index. The loader's
planner (:class:`VerifyingLoadPlanner`) recomputes each one from what DCP read, before it reaches the model's
own dtype or device, and lists what differs. Both are DCP's public planner extension points
(``DefaultSavePlanner.transform_object``, ``DefaultLoadPlanner.load_bytes``/``resolve_tensor``/``commit_tensor``).

The save planner can also refuse parameters that hold NaN or infinite values (:class:`NonFiniteWeights`), so that
a run that diverged never replaces its last good checkpoint.
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem, WriteItem

__all__ = ["CHECKSUMS", "ChecksumSavePlanner", "NonFiniteWeights", "VerifyingLoadPlanner", "checksum",
           "tensor_checksum"]

CHECKSUMS = "checksums"
"""Key of the checksums in the parameter record: ``{"algorithm": "crc32", "files": {name: hex}, "items": {key: hex}}``,
``key`` as DCP names the item (``state_dict.<name>``, ``optimizer_0.state.<name>.exp_avg``)."""
ALGORITHM = "crc32"


class NonFiniteWeights(ValueError):
    """A parameter to be saved holds NaN or infinite values."""


def checksum(data: Any) -> str:
    """The CRC-32 of a bytes-like object, in hex."""
    return f"{zlib.crc32(data):08x}"


def tensor_checksum(tensor: Tensor) -> str | None:
    """The CRC-32 of a tensor's values (its elements in order, whatever its strides); ``None`` if not strided."""
    if tensor.layout is not torch.strided or tensor.is_quantized or tensor.is_nested:
        return None
    values = tensor.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
    return checksum(values.view(torch.uint8).numpy().data)


class ChecksumSavePlanner(DefaultSavePlanner):
    """DCP's default save planner that also takes each item's checksum (and checks parameters are finite).

    Args:
        finite: The DCP keys (``state_dict.<name>``) of the parameters that must hold finite values.
    """

    def __init__(self, finite: Collection[str] = ()) -> None:
        super().__init__()
        self.checksums: dict[str, str] = {}
        self._finite = set(finite)

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002 - DCP's name
        """The item as DCP writes it; its checksum recorded on the way."""
        data = super().transform_object(write_item, object)
        key = write_item.index.fqn
        chunk = write_item.tensor_data.chunk if write_item.tensor_data is not None else None
        if chunk is not None and write_item.tensor_data is not None and _partial(chunk, write_item.tensor_data.size):
            key = _chunk_key(key, chunk.offsets)  # a shard (a sharded optimizer's DTensor): one checksum per shard
        if isinstance(data, io.BytesIO):
            self.checksums[key] = checksum(data.getbuffer())
            return data
        # DCP's writer copies a tensor to the host anyway; taking it here lets the checksum read it once
        tensor = data.detach().cpu()
        if key in self._finite and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise NonFiniteWeights(f"parameter {key.split('.', 1)[1]} holds NaN or infinite values")
        value = tensor_checksum(tensor)
        if value is not None:
            self.checksums[key] = value
        return tensor


class VerifyingLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner that checks every item it loads against its checksum.

    A tensor whose target has another dtype or lives on a device is read into a host tensor of the saved dtype
    first, checked, then copied into the target (the copy DCP's reader would have made).

    Args:
        expected: Checksums by DCP key (items without one are not checked).
        flatten_state_dict: As DCP's planner: ``False`` for a state already keyed by DCP key.
    """

    def __init__(self, expected: Mapping[str, str], flatten_state_dict: bool = True) -> None:
        super().__init__(flatten_state_dict=flatten_state_dict)
        self.expected = expected
        self.mismatched: list[str] = []
        self._pending: dict[tuple[str, tuple[int, ...]], tuple[Tensor | None, str]] = {}

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Checks an object's bytes, then loads them as DCP does."""
        self._check(read_item.storage_index.fqn, checksum(value.getbuffer()))
        super().load_bytes(read_item, value)

    def resolve_tensor(self, read_item: ReadItem) -> Tensor:
        """Where DCP reads a tensor into: the target, or a host tensor of the saved dtype."""
        target: Tensor = super().resolve_tensor(read_item)
        key = read_item.storage_index.fqn
        saved = self.metadata.state_dict_metadata.get(key) if self.metadata is not None else None
        if not isinstance(saved, TensorStorageMetadata) or any(read_item.storage_offsets):
            return target
        offset = tuple(read_item.storage_index.offset or ())
        chunk = next((c for c in saved.chunks if tuple(c.offsets) == offset), None)
        if chunk is None or tuple(read_item.lengths) != tuple(chunk.sizes):  # only part of what was checksummed
            return target
        if _partial(chunk, saved.size):
            key = _chunk_key(key, chunk.offsets)
        if key not in self.expected:
            return target
        slot = (read_item.storage_index.fqn, tuple(read_item.dest_offsets))
        dtype = saved.properties.dtype
        if target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous():
            self._pending[slot] = (None, key)
            return target
        self._pending[slot] = (target, key)
        return torch.empty(tuple(target.shape), dtype=dtype)

    def commit_tensor(self, read_item: ReadItem, tensor: Tensor) -> None:
        """Checks a tensor as read, and copies it into its target if it was read elsewhere."""
        slot = (read_item.storage_index.fqn, tuple(read_item.dest_offsets))
        if slot in self._pending:
            target, key = self._pending.pop(slot)
            value = tensor_checksum(tensor)
            if value is not None:
                self._check(key, value)
            if target is not None:
                target.copy_(tensor)
        super().commit_tensor(read_item, tensor)

    def _check(self, key: str, value: str) -> None:
        expected = self.expected.get(key)
        if expected is not None and expected != value:
            self.mismatched.append(key)


def _partial(chunk: Any, size: Any) -> bool:
    """Whether a DCP chunk is only part of its tensor."""
    return any(chunk.offsets) or tuple(chunk.sizes) != tuple(size)


def _chunk_key(fqn: str, offsets: Any) -> str:
    """The checksum key of a shard of the tensor saved under ``fqn``."""
    return f"{fqn}@{','.join(str(o) for o in offsets)}"
