"""Batches and micro-batches: the batch size, the split into micro-batches, samples for dry runs, the loss."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_varuna.pipeline.model.cut import CutPointError

__all__ = ["batch_size_of", "default_loss", "first_samples", "is_meta_batch", "samples", "split_batch"]


def batch_size_of(batch: Any) -> int:
    """The size of dimension 0 of the first tensor in ``batch``."""
    for leaf in tree_flatten(batch)[0]:
        if isinstance(leaf, Tensor) and leaf.dim() > 0:
            return leaf.shape[0]
    raise ValueError("The batch holds no tensor with a batch dimension; it cannot be split into micro-batches.")


def is_meta_batch(batch: Any) -> bool:
    """Whether ``batch`` holds a tensor on the meta device (a dry run on meta)."""
    return any(isinstance(leaf, Tensor) and leaf.is_meta for leaf in tree_flatten(batch)[0])


def split_batch(batch: Any, chunks: int) -> list[Any]:
    """Splits every tensor of ``batch`` along dimension 0 into ``chunks`` near-equal parts.

    Other values (strings, numbers) are shared by all parts.
    """
    leaves, spec = tree_flatten(batch)
    size = batch_size_of(batch)
    parts = [
        leaf.tensor_split(chunks) if isinstance(leaf, Tensor) and leaf.dim() > 0 and leaf.shape[0] == size else None
        for leaf in leaves
    ]
    return [
        tree_unflatten([p[k] if p is not None else leaf for p, leaf in zip(parts, leaves)], spec) for k in range(chunks)
    ]


def first_samples(batch: Any, n: int) -> Any:
    """The first ``n`` samples of every batch-sized tensor in ``batch``."""
    size = batch_size_of(batch)
    leaves, spec = tree_flatten(batch)
    return tree_unflatten(
        [x[:n] if isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == size else x for x in leaves], spec
    )


def samples(batch: Any, n: int) -> Any:
    """A batch of ``n`` samples made from ``batch``: its first ``n``, or it repeated along dimension 0."""
    size = batch_size_of(batch)
    if n <= size:
        return first_samples(batch, n)
    copies = -(-n // size)
    leaves, spec = tree_flatten(batch)
    return tree_unflatten(
        [torch.cat([x] * copies)[:n] if isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == size else x
         for x in leaves], spec
    )


def default_loss(output: Any) -> Tensor:
    """The loss in a step's output: the tensor itself, or ``output["loss"]``."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    raise CutPointError(
        f"The step returned a {type(output).__name__}; for training it must return the loss tensor or a dict"
        " with a 'loss' tensor."
    )
