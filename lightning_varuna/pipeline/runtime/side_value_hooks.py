"""The hooks that take side values where they are made and put them where they are used, traceable by the compiler.

A producer's forward hook captures a side value from the module call's output; a consumer's forward pre-hook puts
the value the stage has for it (received, or a leaf of the stage's own value with recompute by degree) in place of
the call's argument (:mod:`~lightning_varuna.pipeline.runtime.side_values`). A value the step's code reads outside
module calls is given at its producer instead: on a stage that reads it, a forward hook puts the received value in
place of the leaf of the (stood-in) producer's output, ahead of the model's own hooks (transformers collects router
logits with forward hooks on the routers).

Which call of a module, in which segment, takes or gives which value is Python bookkeeping that changes with every
segment and micro-batch. It runs uncompiled at the segment boundaries only: when a stage's forward starts and at
each cut point's hand-over (itself uncompiled, :func:`~lightning_varuna.pipeline.model.cut.segment_boundaries`),
each hooked module's :class:`_Slot` is told what its calls in the segment that begins do (a list, one entry per
call), and the values captured in the segment that ends are collected. The hooks themselves only pop their call's
entry, swap argument leaves and append output leaves: code the compiler traces. So a compiled region that contains
a hooked module (a compiled model, stack or LightningModule forward) has no graph break from these hooks and the
same guards in every micro-batch (no recompilation); a block compiled in place (``block.compile()``) runs its
module's hooks outside its graph anyway.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeAlias, cast

from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten
from torch.utils.hooks import RemovableHandle

from lightning_varuna.pipeline.model.cut import segment_boundaries
from lightning_varuna.pipeline.model.data_flow import SideValue
from lightning_varuna.pipeline.runtime.links import Chunk

__all__ = ["ForwardSides", "SideValueHooks", "acting_for"]

_Calls = list[list[tuple[int, SideValue]]]
"""Per call of a module in one segment (from 0): the leaves of its arguments or output that are side values."""


class ForwardSides(Protocol):
    """One forward of one stage, as the hooks see it."""

    @property
    def segment(self) -> Callable[[], int]:
        """The segment the forward runs in."""
        ...

    @property
    def reached(self) -> Callable[[], int]:
        """The segment the forward is in, stood in for or not (the cut points it passed)."""
        ...

    @property
    def captured(self) -> dict[SideValue, Tensor]:
        """The values the stage's producers gave."""
        ...

    def replacement(self, value: SideValue) -> Tensor | None:
        """What a consumer takes in place of ``value`` (None: the value as the model made it)."""
        ...


class _Slot:
    """What one hooked module's calls do in the running segment (empty outside a stage's forward)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        """Per call still to come: ``(leaf, tensor)`` pairs to put in place (consumer), or leaves to take
        (producer)."""
        self.captured: list[Tensor] = []
        """The leaves a producer's calls took, in order."""


class SideValueHooks:
    """The hooks of one rank: producers capture side values, consumers take the stage's values for them.

    Args:
        root: The model (module names are its ``named_modules()`` names).
        chunks: The stages the rank runs.
    """

    def __init__(self, root: nn.Module, chunks: Sequence[Chunk]) -> None:
        consumers: dict[str, dict[tuple[int, int], list[tuple[int, SideValue]]]] = {}
        producers: dict[str, dict[tuple[int, int], list[tuple[int, SideValue]]]] = {}
        givers: dict[str, dict[tuple[int, int], list[tuple[int, SideValue]]]] = {}
        for chunk in chunks:
            last = chunk.last_cut if chunk.last_cut is not None else float("inf")
            kept_from = chunk.grad_from if chunk.grad_from is not None else last
            for value in (*chunk.sides_in, *chunk.sides_kept):
                start = chunk.first_segment if value in chunk.sides_in else kept_from + 1
                for c in value.consumers:
                    if start <= c.segment <= last:
                        consumers.setdefault(c.module, {}).setdefault((c.segment, c.call), []).append((c.leaf, value))
            for value in chunk.sides_in:
                p = value.producer
                if any(chunk.first_segment <= r <= last for r in value.step_reads):
                    givers.setdefault(p.module, {}).setdefault((p.segment, p.call), []).append((p.leaf, value))
            for value in dict.fromkeys((*chunk.sides_out, *chunk.sides_kept)):
                p = value.producer
                if value not in chunk.sides_in:
                    producers.setdefault(p.module, {}).setdefault((p.segment, p.call), []).append((p.leaf, value))
        self.segments: dict[int, list[tuple[_Slot, bool, _Calls]]] = {}
        """Per segment: each hooked module's slot, whether it is a producer, and what its calls do there."""
        self.given: dict[int, list[tuple[_Slot, bool, _Calls]]] = {}
        """Per segment a stage stands in for: the producers whose outputs it gives (:attr:`SideValue.step_reads`)."""
        self.slots: list[_Slot] = []
        self.handles: list[RemovableHandle] = []
        for role, tables in (("consumer", consumers), ("producer", producers), ("giver", givers)):
            for name, table in tables.items():
                slot = _Slot()
                self.slots.append(slot)
                into = self.given if role == "giver" else self.segments
                for segment in sorted({s for s, _ in table}):
                    calls = [table.get((segment, call), []) for call in range(1 + max(c for s, c in table
                                                                                      if s == segment))]
                    into.setdefault(segment, []).append((slot, role == "producer", calls))
                self.handles.append(_register(root.get_submodule(name), role, slot))
        _installed.append(self)

    def remove(self) -> None:
        """Removes the hooks."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if self in _installed:
            _installed.remove(self)


def _register(module: nn.Module, role: str, slot: _Slot) -> RemovableHandle:
    # a producer's or giver's hook first: a cut_at hook on the same module may end the stage's forward, and the
    # model's own hooks (transformers' output capture) must see the given value
    if role == "producer":
        return module.register_forward_hook(_capture(slot), prepend=True)
    if role == "giver":
        return module.register_forward_hook(_give(slot), prepend=True)
    return module.register_forward_pre_hook(_substitute(slot), with_kwargs=True)


_installed: list[SideValueHooks] = []
"""The hooks of the engines of this process (one per engine set up)."""


class _Segments:
    """Tells the slots what to do in each segment of one forward, and collects what they captured."""

    def __init__(self, forward: ForwardSides) -> None:
        self.forward = forward
        self.running: list[tuple[_Slot, bool, _Calls]] = []

    def start(self) -> None:
        forward = self.forward
        segment = forward.segment()
        self.running = [entry for hooks in _installed for entry in hooks.segments.get(segment, ())]
        if segment == -1:  # stood in for: the producers whose outputs this stage gives
            reached = forward.reached()
            self.running += [entry for hooks in _installed for entry in hooks.given.get(reached, ())]
        for slot, producing, calls in self.running:
            if producing:
                slot.calls[:] = [tuple(leaf for leaf, _ in targets) for targets in calls]
            else:
                slot.calls[:] = [tuple((leaf, t) for leaf, value in targets
                                       if (t := forward.replacement(value)) is not None) for targets in calls]

    def end(self) -> None:
        for slot, producing, calls in self.running:
            if producing:
                values = [value for targets in calls for _, value in targets]
                self.forward.captured.update(zip(values, slot.captured))
                slot.captured.clear()
            slot.calls.clear()
        self.running = []

    def boundary(self, started: bool) -> None:
        if started:
            self.start()
        else:
            self.end()


@contextlib.contextmanager
def acting_for(forward: ForwardSides) -> Iterator[None]:
    """Inside the block the hooks act for ``forward`` (see the module docstring)."""
    if not _installed:
        yield
        return
    segments = _Segments(forward)
    segments.start()
    try:
        with segment_boundaries(segments.boundary):
            yield
    finally:
        segments.end()


_CallArgs: TypeAlias = tuple[tuple[Any, ...], dict[str, Any]]


def _substitute(slot: _Slot) -> Callable[..., object]:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _CallArgs | None:
        if not slot.calls:
            return None
        replacements = slot.calls.pop(0)
        if not replacements:
            return None
        leaves, spec = tree_flatten((args, kwargs))
        for leaf, tensor in replacements:
            leaves[leaf] = tensor
        return cast(_CallArgs, tree_unflatten(leaves, spec))  # the tree flattened above

    return hook


def _give(slot: _Slot) -> Callable[..., object]:
    def hook(module: nn.Module, args: tuple[Any, ...], output: object) -> object:
        if not slot.calls:
            return None
        replacements = slot.calls.pop(0)
        if not replacements:
            return None
        leaves, spec = tree_flatten(output)
        for leaf, tensor in replacements:
            leaves[leaf] = tensor
        return tree_unflatten(leaves, spec)

    return hook


def _capture(slot: _Slot) -> Callable[..., object]:
    def hook(module: nn.Module, args: tuple[Any, ...], output: object) -> None:
        if not slot.calls:
            return
        taken = slot.calls.pop(0)
        if taken:
            leaves = tree_leaves(output)
            for leaf in taken:
                slot.captured.append(leaves[leaf])

    return hook
