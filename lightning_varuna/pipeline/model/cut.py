"""Cut points: the places where a model may be split into pipeline stages.

A :class:`CutPoint` is an identity module until a pipeline forward is active. While one is, every cut point
reports to the active :class:`ForwardHandler`, which may count it, hand back a received activation in place
of the tensor, or end the stage's forward once its output is known.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar, cast

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = ["CutPoint", "CutPointError", "ForwardHandler", "StageForward", "StageOutputReady", "check_cut_at_order",
           "install_cut_at", "segment_boundaries"]

_F = TypeVar("_F", bound=Callable[..., Any])

never_compiled = cast(Callable[[_F], _F], torch.compiler.disable)
"""``torch.compiler.disable`` as a typed decorator (torch leaves it unannotated): the function runs as Python."""


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


_boundary: Callable[[bool], None] | None = None
"""Called with False before a cut point's hand-over (a segment ends) and True after it (the next one starts)."""


@contextlib.contextmanager
def segment_boundaries(listener: Callable[[bool], None]) -> Iterator[None]:
    """Inside the block, ``listener`` is called around every cut point's hand-over (uncompiled, as the hand-over).

    The side values' hooks learn there what each segment's module calls take and give, so that the hooks
    themselves are code the compiler traces (:mod:`~lightning_varuna.pipeline.runtime.side_value_hooks`).
    """
    global _boundary
    previous, _boundary = _boundary, listener
    try:
        yield
    finally:
        _boundary = previous


@never_compiled
def _report(cut: CutPoint, x: object) -> Tensor:
    """Hands a cut point's input to the handler.

    Never compiled: in a pipeline a cut point ends a compiled graph (what a stage does there, a receive or the end
    of its forward, is not computation).
    """
    handler = _handler
    if handler is None:
        return cast(Tensor, x)  # outside a pipeline forward the cut point hands back whatever it was given
    if not isinstance(x, Tensor):
        raise CutPointError(
            f"A CutPoint was called on a {type(x).__name__}; it takes exactly one tensor. Move the cut point to"
            " a place where a single activation tensor flows, or pack the values into one tensor."
        )
    boundary = _boundary
    if boundary is None:
        return handler.on_cut(cut, x)
    boundary(False)
    out = handler.on_cut(cut, x)
    boundary(True)
    return out


class CutPoint(nn.Module):
    """Marks a place where the model may be split into pipeline stages.

    Call it on the one activation tensor that flows across the cut: ``x = self.cut(x)``. Outside a pipeline
    (plain training, inference, export) it returns its input unchanged. A cut point must be called at most
    once per forward, and cut points must be reached in the same order in every forward.
    """

    _varuna_name: str
    """Where the dry run saw it (``module.path:output`` for ``cut_at``), for messages; set on cut points it saw."""

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
            assert self.receive is not None  # a stage that does not start the model receives its input
            return self.receive()
        if index == self.last:
            self.output = x
            raise StageOutputReady
        if index == self.grad_from:
            # a plain call, not a context: the stage's own grad-mode context restores the mode when its forward ends
            torch.set_grad_enabled(True)
            self.boundary = x.detach().requires_grad_(x.is_floating_point())
            return self.boundary
        return x


def install_cut_at(root: nn.Module, path: str | Sequence[str]) -> tuple[list[CutPoint], list[RemovableHandle]]:
    """Puts a cut point after every block of the block list(s) at ``path``, but the last block of the last list.

    The cut points run as forward hooks, so the model's code and parameter names stay as they are. Each block
    must return a tensor, or a tuple or list whose first element is the tensor passed to the next block (BLOOM,
    Falcon, T5 and LSTM blocks return ``(hidden, extras)``): the cut is on that element.

    Several lists (an encoder-decoder's two stacks, e.g. ``["model.encoder.block", "model.decoder.block"]``) are
    cut after each of their blocks, the last block of an earlier list included: the code between two lists (the
    encoder's final norm, the decoder's embedding) runs in the segment of the next list's first block. The lists
    must be given in the order the forward runs them; :func:`check_cut_at_order` checks that after the dry run.

    Args:
        root: The module that owns the block lists (usually the LightningModule).
        path: Dotted attribute path of an ``nn.ModuleList`` or ``nn.Sequential``, e.g. ``"model.blocks"``, or
            several such paths in execution order.

    Returns:
        The cut points, in order, and the hook handles that remove them.
    """
    paths = [path] if isinstance(path, str) else list(path)
    _check_paths(paths)
    lists = [(p, _block_list(root, p)) for p in paths]
    total = sum(len(blocks) for _, blocks in lists)
    if total < 2:
        raise CutPointError(f"cut_at={path!r} has {total} child module(s); at least 2 are needed to cut.")
    cuts, handles = [], []
    for number, (p, blocks) in enumerate(lists):
        cut_after = blocks if number < len(lists) - 1 else blocks[:-1]
        for index, child in enumerate(cut_after):
            cut = CutPoint()
            cut._varuna_name = f"{p}.{index}:output"
            hook = _cut_hook(cut, f"{p}.{index}")
            handles.append(child.register_forward_hook(hook))
            cuts.append(cut)
    return cuts, handles


def check_cut_at_order(cuts: Sequence[CutPoint], executed: Sequence[CutPoint]) -> None:
    """Checks that the cut points of ``cut_at`` ran in the dry run in the order :func:`install_cut_at` made them.

    Args:
        cuts: The cut points of ``cut_at`` (:func:`install_cut_at`'s order: list by list, block by block).
        executed: Every cut point in the dry run's execution order (those of ``CutPoint`` modules too).

    Raises:
        CutPointError: If a block list's blocks ran out of their order, a later list's before an earlier one's,
            or none of a list's blocks ran (a cut point that runs twice is refused by the dry run itself).
    """
    ours = {id(c) for c in cuts}
    ran = [c for c in executed if id(c) in ours]
    done = {id(c) for c in ran}
    lists: dict[str, list[CutPoint]] = {}
    for cut in cuts:
        lists.setdefault(_list_of(cut), []).append(cut)
    for name, members in lists.items():
        if not any(id(c) in done for c in members):
            raise CutPointError(
                f"cut_at: none of the blocks of {name!r} ran in the step's forward. Name only block lists the"
                " training step runs."
            )
    expected = [c for c in cuts if id(c) in done]
    for got, want in zip(ran, expected):
        if got is not want:
            raise CutPointError(
                f"cut_at: {_block_of(got)} ran before {_block_of(want)}, but cut_at lists {list(lists)} in that"
                " order. Give the block lists in the order the forward runs them (each list's blocks must run in"
                " their order, one list after the other)."
            )


def _check_paths(paths: list[str]) -> None:
    if not paths or not all(isinstance(p, str) and p for p in paths):
        raise CutPointError(f"cut_at={paths!r}: give a dotted path, or a list of dotted paths, of block lists.")
    for p in paths:
        for other in paths:
            if other != p and other.startswith(p + "."):
                raise CutPointError(f"cut_at: {other!r} lies inside {p!r}; name each block list once, not nested.")
    if len(set(paths)) != len(paths):
        raise CutPointError(f"cut_at={paths!r} names a block list twice; name each once.")


def _block_list(root: nn.Module, path: str) -> list[nn.Module]:
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
    return list(container.children())


def _cut_hook(cut: CutPoint, name: str) -> Callable[[nn.Module, object, object], object]:
    def hook(module: nn.Module, args: object, output: object) -> object:
        if isinstance(output, Tensor):
            return cut(output)
        if isinstance(output, (tuple, list)) and type(output) in (tuple, list) and output and isinstance(output[0],
                                                                                                      Tensor):
            # (hidden states, attention weights, ...): the first element crosses the cut; the data flow check
            # transports or refuses the others if a later stage reads them
            return type(output)([cut(output[0]), *output[1:]])
        raise CutPointError(
            f"cut_at: {name} returned a {type(output).__name__}; cut_at needs blocks that return a tensor, or a"
            " tuple or list whose first element is the tensor that flows to the next block. Place CutPoint()"
            " modules in your forward instead."
        )

    return hook


def _block_of(cut: CutPoint) -> str:
    return getattr(cut, "_varuna_name", "a block").rsplit(":", 1)[0]


def _list_of(cut: CutPoint) -> str:
    return _block_of(cut).rsplit(".", 1)[0]


def zero_like_shape(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A tensor of ``shape`` that costs one element of memory (all strides zero)."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)
