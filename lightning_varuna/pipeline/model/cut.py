"""Cut points: the places where a model may be split into pipeline stages.

A :class:`CutPoint` is an identity module until a pipeline forward is active. While one is, every cut point
reports to the active :class:`ForwardHandler`, which may count it, hand back a received activation in place
of the tensor, or end the stage's forward once its output is known.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = ["CutPoint", "CutPointError", "install_cut_at", "ForwardHandler", "StageForward", "StageOutputReady"]


class CutPointError(RuntimeError):
    """A cut point was used in a way that cannot be split (wrong input, wrong order, called twice)."""


class StageOutputReady(BaseException):  # noqa: N818 - a control-flow signal, not an error
    """Ends a stage's forward at its last cut point.

    It derives from ``BaseException`` so that ``except Exception`` blocks in user code let it through; only the
    executor catches it, and no other exception is ever swallowed.
    """


class ForwardHandler(Protocol):
    """What a cut point talks to while a pipeline forward runs."""

    def on_cut(self, cut: CutPoint, x: Tensor) -> Tensor:
        """Called by each cut point with its input; returns the tensor the model continues with."""
        ...


_handler: ForwardHandler | None = None
_active = False
"""Whether a handler is set. Compiled code that reaches a cut point guards on this bool's value (it never reads the
handler, which changes every micro-batch): a pipeline compiles once more than a plain run, never per micro-batch."""


@contextlib.contextmanager
def forward_handler(handler: ForwardHandler) -> Iterator[ForwardHandler]:
    """Makes ``handler`` receive every cut point call inside the block."""
    global _handler, _active
    previous, _handler, _active = _handler, handler, True
    try:
        yield handler
    finally:
        _handler, _active = previous, previous is not None


@torch.compiler.disable
def _report(cut: CutPoint, x: object) -> Tensor:
    """Hands a cut point's input to the handler.

    Never compiled: in a pipeline a cut point ends a compiled graph (what a stage does there, a receive or the end
    of its forward, is not computation).
    """
    handler = _handler
    if handler is None:
        return x  # type: ignore[return-value]
    if not isinstance(x, Tensor):
        raise CutPointError(
            f"A CutPoint was called on a {type(x).__name__}; it takes exactly one tensor. Move the cut point to"
            " a place where a single activation tensor flows, or pack the values into one tensor."
        )
    return handler.on_cut(cut, x)


class CutPoint(nn.Module):
    """Marks a place where the model may be split into pipeline stages.

    Call it on the one activation tensor that flows across the cut: ``x = self.cut(x)``. Outside a pipeline
    (plain training, inference, export) it returns its input unchanged. A cut point must be called at most
    once per forward, and cut points must be reached in the same order in every forward.
    """

    def forward(self, x: Tensor) -> Tensor:
        """Returns ``x``, or what the running pipeline stage puts in its place."""
        if not _active:
            return x
        return _report(self, x)


class StageForward:
    """The cut point handler of one forward of one stage.

    ``receive`` returns the activation received from the previous stage: it is waited for only when the forward
    reaches the stage's first cut point (a step that returns None before the model's forward waits for nothing).
    With ``grad_from`` (recompute by degree) the forward turns autograd on at that cut point, where the activation
    continues as a new leaf (``boundary``) that the backward of the rest of the stage gives a gradient.
    """

    def __init__(self, cuts: Sequence[CutPoint], first: int | None, last: int | None,
                 receive: Callable[[], Tensor] | None, microbatch: int, recomputing: bool,
                 grad_from: int | None = None):
        self.microbatch = microbatch
        self.grad_from = grad_from
        self.boundary: Tensor | None = None
        self.recomputing = recomputing
        self.cuts = cuts
        self.first = first
        self.last = last
        self.receive = receive
        self.segment = 0
        self.output: Tensor | None = None

    def on_cut(self, cut: CutPoint, x: Tensor) -> Tensor:
        """Counts the cut point; returns the received activation at the first, ends the forward at the last."""
        index = self.segment
        if index >= len(self.cuts) or self.cuts[index] is not cut:
            seen = getattr(cut, "_varuna_name", None) or "a cut point the dry run did not see"
            expected = (
                f"the dry run saw {getattr(self.cuts[index], '_varuna_name', None) or 'another one'} there"
                if index < len(self.cuts) else f"the dry run saw only {len(self.cuts)} cut point(s)"
            )
            raise CutPointError(
                f"Cut point #{index} of this forward is {seen}, but {expected} (micro-batch {self.microbatch})."
                " Cut points must be reached in the same order in every forward (and each at most once); keep"
                " data-dependent control flow inside a segment."
            )
        self.segment = index + 1
        if index == self.first:
            return self.receive()  # type: ignore[misc]
        if index == self.last:
            self.output = x
            raise StageOutputReady
        if index == self.grad_from:
            # a plain call, not a context: the stage's own grad-mode context restores the mode when its forward ends
            torch.set_grad_enabled(True)
            self.boundary = x.detach().requires_grad_(x.is_floating_point())
            return self.boundary
        return x


def install_cut_at(root: nn.Module, path: str) -> tuple[list[CutPoint], list[RemovableHandle]]:
    """Puts a cut point after every child but the last of the container at ``path``.

    The cut points run as forward hooks, so the model's code and parameter names stay as they are. Each child
    must return a tensor, or a tuple or list whose first element is the tensor passed to the next child (BLOOM,
    Falcon and LSTM blocks return ``(hidden, extras)``): the cut is on that element.

    Args:
        root: The module that owns the container (usually the LightningModule).
        path: Dotted attribute path of an ``nn.ModuleList`` or ``nn.Sequential``, e.g. ``"model.blocks"``.

    Returns:
        The cut points, in order, and the hook handles that remove them.
    """
    try:
        container = root.get_submodule(path)
    except AttributeError as err:
        raise CutPointError(
            f"cut_at={path!r}: {type(root).__name__} has no submodule at that path ({err}). Give the dotted"
            " path of the nn.ModuleList or nn.Sequential that holds the blocks, e.g. 'model.blocks'."
        ) from None
    if not isinstance(container, (nn.ModuleList, nn.Sequential)):
        raise CutPointError(
            f"cut_at={path!r} names a {type(container).__name__}; it must be an nn.ModuleList or nn.Sequential"
            " whose children run one after another."
        )
    children = list(container.children())
    if len(children) < 2:
        raise CutPointError(f"cut_at={path!r} has {len(children)} child module(s); at least 2 are needed to cut.")
    cuts, handles = [], []
    for index, child in enumerate(children[:-1]):
        cut = CutPoint()
        cut._varuna_name = f"{path}.{index}:output"  # type: ignore[assignment]

        def hook(module: nn.Module, args: object, output: object, cut: CutPoint = cut, name: str = f"{path}.{index}"):
            if isinstance(output, Tensor):
                return cut(output)
            if type(output) in (tuple, list) and output and isinstance(output[0], Tensor):  # type: ignore[index]
                # (hidden states, attention weights, ...): the first element crosses the cut; the data flow check
                # refuses the others if a later stage reads them
                return type(output)([cut(output[0]), *output[1:]])  # type: ignore[index]
            raise CutPointError(
                f"cut_at: {name} returned a {type(output).__name__}; cut_at needs blocks that return a tensor, or a"
                " tuple or list whose first element is the tensor that flows to the next block. Place CutPoint()"
                " modules in your forward instead."
            )

        handles.append(child.register_forward_hook(hook))
        cuts.append(cut)
    return cuts, handles


def zero_like_shape(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A tensor of ``shape`` that costs one element of memory (all strides zero)."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)
