"""Batches and micro-batches: the batch size, the split, samples for dry runs, the loss and what weights it.

Each micro-batch's loss is weighted by its samples or by its counted tokens (:func:`count_loss_units`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_varuna.pipeline.model.cut import CutPointError

__all__ = [
    "IGNORE_INDEX", "LOSS_WEIGHTINGS", "BatchSplitError", "TokenCounter", "batch_size_of", "check_batch",
    "count_loss_units", "default_loss", "first_samples", "is_meta_batch", "label_tokens", "samples", "split_batch",
    "uneven_labels",
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


class BatchSplitError(ValueError):
    """A batch holds a value that cannot be split into micro-batches with its samples, or whose role is ambiguous."""


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _holds_tensor(value: Any) -> bool:
    return any(isinstance(leaf, Tensor) for leaf in tree_flatten(value)[0])


def _per_sample_values(value: Any, size: int) -> bool:
    """Whether ``value`` is a list or tuple of ``size`` non-tensor values (names, ids, weights): one per sample.

    A list or tuple that holds tensors is structure (``x, y = batch``), never per-sample: its tensors are split when
    their dimension 0 is the batch size, so a batch of two tensors and two samples is not taken for two samples.
    """
    return (isinstance(value, (list, tuple)) and not _is_namedtuple(value) and len(value) == size
            and not _holds_tensor(value))


def _where(path: tuple[Any, ...]) -> str:
    return "batch" + "".join(f"[{key!r}]" for key in path)


def check_batch(batch: Any) -> None:
    """Refuses a batch with a value that :func:`split_batch` cannot give each micro-batch its own samples of.

    Every rank checks the same batch at setup, before any waits on another. Refused: an object other than a tensor,
    list or tuple whose ``len()`` is the batch size (a per-sample container that cannot be sliced), and a list or
    tuple of as many tensors as samples none of which has the batch dimension (per-sample tensors of different
    shapes, or shared tensors whose number equals the batch size by chance: it cannot tell).

    Raises:
        BatchSplitError: Naming the batch element, its type and what to change.
    """
    size = batch_size_of(batch)
    if size < 2:
        return
    _check(batch, size, ())


def _check(value: Any, size: int, path: tuple[Any, ...]) -> None:
    if isinstance(value, (Tensor, str, bytes)) or _per_sample_values(value, size):
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            _check(item, size, (*path, key))
        return
    if isinstance(value, (list, tuple)):
        tensors = [item for item in value if isinstance(item, Tensor)]
        if (len(value) == size and not _is_namedtuple(value) and tensors
                and not any(t.dim() > 0 and t.shape[0] == size for t in tensors)):
            raise BatchSplitError(
                f"{_where(path)} is a {type(value).__name__} of {size} values holding tensors, none of them with the"
                f" batch size {size} in dimension 0, in a batch of {size} samples: it cannot tell per-sample tensors"
                " from shared ones. Per-sample tensors: pad and stack them into one tensor of batch size (it is"
                " then split with the samples). Tensors shared by every sample: put them in a dict (a dict is never"
                " split)."
            )
        for k, item in enumerate(value):
            _check(item, size, (*path, k))
        return
    try:
        length = len(value)
    except TypeError:  # a number, None, an object: one value for the whole batch, given to every micro-batch
        return
    if length == size and not isinstance(value, _SLICED):
        raise BatchSplitError(
            f"{_where(path)} is a {type(value).__name__} of {size} values in a batch of {size} samples: it looks"
            " per-sample, but it cannot be split into micro-batches. Give per-sample values as a tensor, a list or a"
            " tuple (split with the samples), or make it a value of another length if it is shared by all samples."
        )


def _sliced_types() -> tuple[type, ...]:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy comes with torch
        return ()
    return (numpy.ndarray,)


_SLICED = _sliced_types()
"""Non-tensor arrays sliced along dimension 0 as tensors are (numpy arrays)."""


def _is_sliced(value: Any, size: int) -> bool:
    shape: tuple[int, ...] = cast(Any, value).shape if isinstance(value, _SLICED) else ()
    return len(shape) > 0 and shape[0] == size


def _leaves(batch: Any, size: int) -> tuple[list[Any], Any]:
    """The batch's leaves, a per-sample list or tuple of non-tensors being one leaf, and its structure."""
    return tree_flatten(batch, is_leaf=lambda value: _per_sample_values(value, size))


def _take(leaf: Any, size: int, start: int, stop: int) -> Any:
    """Samples ``start:stop`` of ``leaf`` if it holds one value per sample; else ``leaf`` itself (shared)."""
    if isinstance(leaf, Tensor):
        return leaf[start:stop] if leaf.dim() > 0 and leaf.shape[0] == size else leaf
    if _per_sample_values(leaf, size):
        return type(leaf)(leaf[start:stop])
    if _is_sliced(leaf, size):
        return leaf[start:stop]
    return leaf


def split_batch(batch: Any, chunks: int) -> list[Any]:
    """Splits ``batch`` into ``chunks`` near-equal parts along its samples (as ``Tensor.tensor_split``).

    Split: every tensor (and numpy array) whose dimension 0 is the batch size, and every list or tuple of as many
    non-tensor values as samples (names, ids, per-sample weights), so each part holds its own samples. Other values
    (tensors of another size, numbers, strings, lists of another length) are shared by all parts.

    Raises:
        BatchSplitError: For a value :func:`check_batch` refuses.
    """
    size = batch_size_of(batch)
    if chunks > 1:  # a later batch may hold what setup's did not: refused, never shared silently
        _check(batch, size, ())
    leaves, spec = _leaves(batch, size)
    bounds = [0]
    for k in range(chunks):  # tensor_split's sizes: the first size % chunks parts one larger
        bounds.append(bounds[-1] + size // chunks + (1 if k < size % chunks else 0))
    parts: list[Any] = []
    for k in range(chunks):
        start, stop = bounds[k], bounds[k + 1]
        parts.append(tree_unflatten([_take(leaf, size, start, stop) for leaf in leaves], spec))
    return parts


def first_samples(batch: Any, n: int) -> Any:
    """The first ``n`` samples of ``batch``: of every value :func:`split_batch` splits; others as they are."""
    size = batch_size_of(batch)
    leaves, spec = _leaves(batch, size)
    return tree_unflatten([_take(leaf, size, 0, n) for leaf in leaves], spec)


def samples(batch: Any, n: int) -> Any:
    """A batch of ``n`` samples made from ``batch``: its first ``n``, or it repeated along dimension 0."""
    size = batch_size_of(batch)
    if n <= size:
        return first_samples(batch, n)
    copies = -(-n // size)
    leaves, spec = _leaves(batch, size)

    def repeat(leaf: Any) -> Any:
        if isinstance(leaf, Tensor):
            return torch.cat([leaf] * copies)[:n] if leaf.dim() > 0 and leaf.shape[0] == size else leaf
        if _per_sample_values(leaf, size):
            return type(leaf)((list(leaf) * copies)[:n])
        return leaf

    return tree_unflatten([repeat(leaf) for leaf in leaves], spec)


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


def uneven_labels(microbatches: Sequence[Any], sizes: Sequence[int], device: torch.device) -> list[float] | None:
    """The labels other than ``-100`` each micro-batch counts, if they are not in proportion to the samples; else None.

    Under ``loss_weighting="samples"`` a micro-batch's mean loss is weighted by its samples, which equals the plain
    run's mean over the batch's tokens only when every micro-batch counts labels in proportion to its samples. A
    padded batch (``-100`` labels, as Hugging Face collators write them) breaks that. One host read for all
    micro-batches; None also for a batch without integer labels (``batch["labels"]`` or a tuple's last element).
    """
    try:
        counts = [label_tokens(mb) for mb in microbatches]
    except ValueError:  # no labels to count: nothing to say
        return None
    values = torch.stack([c.to(device=device, dtype=torch.float64) for c in counts]).tolist()
    total, samples = sum(values), sum(sizes)
    if all(v * samples == total * n for v, n in zip(values, sizes, strict=True)):
        return None
    return values
