"""Batches and micro-batches: the batch size, the split, samples for dry runs, the loss and what weights it.

Each micro-batch's loss is weighted by its samples or by its counted tokens (:func:`count_loss_units`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_varuna.pipeline.model.cut import CutPointError

__all__ = [
    "IGNORE_INDEX", "LOSS_WEIGHTINGS", "TokenCounter", "batch_size_of", "count_loss_units", "default_loss",
    "first_samples", "is_meta_batch", "label_tokens", "samples", "split_batch",
]

IGNORE_INDEX = -100
"""The label that losses ignore (``torch.nn.CrossEntropyLoss``'s and Hugging Face's default)."""
LOSS_WEIGHTINGS: tuple[str, ...] = ("samples", "tokens", "shifted_tokens")
"""How a micro-batch's loss is weighted: by its samples, its labels other than ``-100``, or those of
``labels[..., 1:]`` (causal language models that shift the labels inside, as Hugging Face's ``*ForCausalLM``)."""

TokenCounter = Callable[[Any], "int | Tensor"]
"""Counts what a micro-batch's mean loss averages over (its tokens), from the micro-batch."""


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
    loss = output.get("loss") if isinstance(output, dict) else None
    if isinstance(loss, Tensor):
        return loss
    raise CutPointError(
        f"The step returned a {type(output).__name__}; for training it must return the loss tensor or a dict"
        " with a 'loss' tensor."
    )


def label_tokens(batch: Any, shifted: bool = False) -> Tensor:
    """How many labels of ``batch`` a mean loss counts: those other than ``-100`` (a 0-dim tensor, on their device).

    The labels are ``batch["labels"]`` for a mapping (a Hugging Face batch), else the last element of a tuple or
    list batch when it is an integer tensor (``x, y = batch``).

    Args:
        batch: A batch or micro-batch.
        shifted: Count ``labels[..., 1:]`` only: a causal language model that shifts the labels inside (Hugging
            Face's ``*ForCausalLM``) never predicts the first position.

    Raises:
        ValueError: If the batch holds no such labels.
    """
    labels = batch.get("labels") if isinstance(batch, Mapping) else (
        batch[-1] if isinstance(batch, Sequence) and not isinstance(batch, str) and len(batch) else None)
    if not isinstance(labels, Tensor) or labels.is_floating_point() or labels.is_complex() or labels.dim() == 0:
        raise ValueError(
            "loss_weighting='tokens' counts the labels other than -100 of each micro-batch, but found none in a"
            f" batch of type {type(batch).__name__}: it looks for batch['labels'] (a mapping) or the last element"
            " of a tuple/list batch, an integer tensor. Pass loss_weighting=a function of the micro-batch that"
            " returns its token count instead."
        )
    if shifted:
        labels = labels[..., 1:]
    return labels.ne(IGNORE_INDEX).sum()


def count_loss_units(
    microbatches: Sequence[Any], sizes: Sequence[int], weighting: str | TokenCounter, device: torch.device,
) -> list[float]:
    """What each micro-batch's loss is weighted by, before normalizing: its samples or its counted tokens.

    Counting tokens costs one host read for all micro-batches together (none per micro-batch). A batch without any
    counted token is weighted by samples: a mean over no token is NaN in every micro-batch, as in the plain run.

    Raises:
        ValueError: If a counter returns something other than a non-negative number.
    """
    if weighting == "samples":
        return [float(n) for n in sizes]
    if callable(weighting):
        counts = [weighting(mb) for mb in microbatches]
    else:
        counts = [label_tokens(mb, shifted=weighting == "shifted_tokens") for mb in microbatches]
    for count in counts:
        if isinstance(count, bool) or not isinstance(count, (int, float, Tensor)) or (
                isinstance(count, Tensor) and count.numel() != 1):
            raise ValueError(f"The token counter of loss_weighting returned {count!r}: it must return a number (an"
                             " int or a one-element tensor) per micro-batch.")
    values = torch.stack([torch.as_tensor(c, device=device).reshape(()).to(torch.float64) for c in counts]).tolist()
    if any(v < 0 for v in values):
        raise ValueError(f"The token counter of loss_weighting returned negative counts {values}; a count is >= 0.")
    return [float(n) for n in sizes] if sum(values) == 0 else values
