"""Side values: what a later stage needs besides the activation, carried with it across each stage boundary.

The dry run finds them (:class:`~lightning_varuna.pipeline.model.data_flow.SideValue`): a value computed from
parameters (T5's relative position bias, made by the first block and passed to every later one) that is an element
of a module call's output (its *producer*) and is used in later segments only as an argument of module calls (its
*consumers*). At run time:

- the stage holding the producer captures the value with a forward hook (it runs before the hooks of ``cut_at``,
  which may end the stage's forward);
- each boundary carries the side values made at or before it and used after it, forwarded unchanged through
  stages that only pass them on; the activation and its side values travel as one message (their bytes packed,
  each piece aligned), their shapes and dtypes agreed in the step's header, ``boundary_dtype`` applied to floating
  ones as to the activation;
- a received side value is a leaf that requires grad like the activation; a forward pre-hook puts it in place of
  the argument of each consumer on the stage (where the stood-in producer gave zeros); a value the step's code
  reads outside module calls (a mixture of experts' router logits, read by its loss) is put in place of the
  stood-in producer's output instead, by a forward hook that runs before the model's own;
- the backward runs autograd over the stage's output and the side values it sent, with the gradients received
  for them (one message with the activation's), and sends back the gradients of its received leaves. A value
  captured again by a recompute is differentiated there; with recompute by degree, in the recomputed part's
  backward;
- with recompute by degree, a value the stage makes in its recomputed segments (run without autograd in the
  forward) and uses in its kept ones is put there as a leaf (as the activation at the kept part's first cut point):
  the kept part's backward gives the leaf its gradient, which the recomputed part's backward continues from the
  value the recompute makes again (:func:`~lightning_varuna.pipeline.runtime.recompute.backward_recomputed`).

The hooks (:mod:`~lightning_varuna.pipeline.runtime.side_value_hooks`) act only while a stage's forward runs
(:meth:`StageSides.forward`); the compiler traces them (no graph break in a compiled region that holds a hooked
module), their bookkeeping runs uncompiled at the cut points.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_varuna.failstop.failures import PipelineError
from lightning_varuna.pipeline.comm.transfers import HEADER_SIZE, encode_header
from lightning_varuna.pipeline.model.data_flow import SideValue
from lightning_varuna.pipeline.runtime.links import Chunk, Spec, scaled_shape
from lightning_varuna.pipeline.runtime.side_value_hooks import acting_for

__all__ = ["StageSides", "pack", "side_values_kept", "side_values_sent", "unpack"]

ALIGN = 16
"""Bytes each piece of a packed message starts at a multiple of (any dtype can view it)."""
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.bool, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8)

def _offsets(specs: Sequence[Spec]) -> tuple[list[int], int]:
    offsets, total = [], 0
    for shape, dtype in specs:
        offsets.append(total)
        total += -(-shape.numel() * dtype.itemsize // ALIGN) * ALIGN
    return offsets, total


def packed_spec(specs: Sequence[Spec]) -> Spec:
    """The spec of the message that packs tensors of ``specs`` (one tensor is its own message)."""
    if len(specs) == 1:
        return specs[0]
    return torch.Size([_offsets(specs)[1]]), torch.uint8


def pack(tensors: Sequence[Tensor], specs: Sequence[Spec]) -> Tensor:
    """One byte tensor holding ``tensors`` (of ``specs``), each at an aligned offset; one tensor: itself (no copy).

    A message of one piece is the same as without side values, so a stage that has side values only for itself
    (recompute by degree) or no longer sends any talks to its neighbour as one without.
    """
    if len(tensors) == 1:
        return tensors[0]
    offsets, total = _offsets(specs)
    packed = torch.empty(total, dtype=torch.uint8, device=tensors[0].device)
    for tensor, offset in zip(tensors, offsets):
        size = tensor.numel() * tensor.element_size()
        packed[offset : offset + size].copy_(tensor.contiguous().reshape(-1).view(torch.uint8))
    return packed


def unpack(packed: Tensor, specs: Sequence[Spec]) -> list[Tensor]:
    """Views of the tensors :func:`pack` put in ``packed`` (no copy)."""
    if len(specs) == 1:
        return [packed]
    offsets, _ = _offsets(specs)
    return [packed[o : o + shape.numel() * dtype.itemsize].view(dtype).view(shape)
            for (shape, dtype), o in zip(specs, offsets)]


def side_values_sent(values: Sequence[SideValue], stages: Sequence[range]) -> list[tuple[SideValue, ...]]:
    """What each stage sends with its output: the side values made on it or before and used after it.

    Args:
        values: The dry run's side values.
        stages: Each stage's segments.
    """
    stage_of = {segment: s for s, segments in enumerate(stages) for segment in segments}
    return [tuple(v for v in values if stage_of[v.producer.segment] <= s < stage_of[v.last_segment])
            for s in range(len(stages))]


def side_values_kept(values: Sequence[SideValue], segments: range, grad_from: int | None) -> tuple[SideValue, ...]:
    """The side values a stage recomputed by degree makes in its recomputed segments and uses in its kept ones.

    Args:
        values: The dry run's side values.
        segments: The stage's segments.
        grad_from: The cut point from which the stage keeps its graph (None: no recompute by degree).
    """
    if grad_from is None:
        return ()
    kept = tuple(v for v in values if segments.start <= v.producer.segment <= grad_from
                 and any(grad_from < c < segments.stop for c in (*(c.segment for c in v.consumers), *v.step_reads)))
    read_by_step = [v.what for v in kept if v.step_reads]
    if read_by_step:
        # the kept part would read the value made without autograd: its gradient would be lost
        raise PipelineError(f"Recompute by degree cannot keep a value the step's code reads outside module calls"
                            f" on the stage that makes it: {read_by_step[0]}. Use recompute=True or False.")
    return kept


def _encode(tensor: Tensor) -> list[int]:
    if tensor.dim() > HEADER_SIZE - 2 or tensor.dtype not in _DTYPES:
        raise PipelineError(f"A side value of shape {tuple(tensor.shape)} ({tensor.dtype}) cannot cross a stage"
                            f" boundary: at most {HEADER_SIZE - 2} dimensions and a dtype of {_DTYPES}.")
    values = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
    return values + [0] * (HEADER_SIZE - len(values))


def _decode(values: list[int]) -> Spec:
    return torch.Size(values[2 : 2 + values[1]]), _DTYPES[values[0]]


@dataclass
class _Forward:
    """One forward of one stage: its calls counted per module and segment, the values its producers gave."""

    sides: StageSides
    k: int
    segment: Callable[[], int]
    reached: Callable[[], int]
    recomputing: bool
    receive: Callable[[], object] | None
    """Waits for the stage's input (a value given at a stood-in producer is needed before the first cut point)."""
    captured: dict[SideValue, Tensor] = field(default_factory=dict)
    substitutes: dict[SideValue, Tensor] | None = None
    kept: dict[SideValue, Tensor] = field(default_factory=dict)
    """The leaves put in place of the stage's own values in its kept segments (recompute by degree)."""

    def replacement(self, value: SideValue) -> Tensor | None:
        """What a consumer takes in place of ``value`` on this stage (None: the value as the model made it)."""
        sides = self.sides
        if value in sides.ins:
            if not sides.received[self.k] and self.receive is not None:
                self.receive()
            if self.substitutes is None:
                self.substitutes = sides.substitutes(self.k)
            return self.substitutes.get(value)
        if value not in sides.kept or self.recomputing:
            return None
        leaf = self.kept.get(value)
        if leaf is None:
            made = self.captured.get(value)
            if made is None:
                raise PipelineError(
                    f"Stage {sides.stage}'s forward of micro-batch {self.k} used a side value before making it,"
                    f" unlike the dry run: {value.what}. The model's data flow must be the same in every forward."
                )
            leaf = self.kept[value] = made.detach().requires_grad_(made.is_floating_point())
        return leaf


class StageSides:
    """The side values of one step of one stage: received, captured, sent, and their gradients.

    Args:
        chunk: The stage (its ``sides_in`` and ``sides_out``).
        sizes: The batch size of each micro-batch.
        train: Whether received side values require grad (a backward follows).
        wire: The dtype floating values travel in (``boundary_dtype``; None: their own).
        kept: The values the stage makes in its recomputed segments and uses in its kept ones (recompute by degree,
            ``chunk.sides_kept``; empty when this step's forwards keep no partial graph).
    """

    def __init__(self, chunk: Chunk, sizes: Sequence[int], train: bool, wire: torch.dtype | None,
                 kept: Sequence[SideValue] = ()) -> None:
        self.stage, self.ins, self.outs, self.sizes, self.train, self.wire = \
            chunk.stage, chunk.sides_in, chunk.sides_out, sizes, train, wire
        self.kept = frozenset(kept)
        m = len(sizes)
        self.received: list[dict[SideValue, Tensor]] = [{} for _ in range(m)]
        self.captured: list[dict[SideValue, Tensor]] = [{} for _ in range(m)]
        self.kept_leaves: list[dict[SideValue, Tensor]] = [{} for _ in range(m)]
        self.recaptured: list[dict[SideValue, Tensor] | None] = [None] * m
        self.in_specs: list[list[Spec]] | None = None
        """Per micro-batch: the received activation's spec, then the received side values'."""
        self.out_specs: list[list[Spec]] | None = None

    @property
    def header_size(self) -> int:
        """int64 slots of the header this stage receives."""
        return HEADER_SIZE * (1 + len(self.ins))

    @property
    def sent_header_size(self) -> int:
        """int64 slots of the header this stage sends."""
        return HEADER_SIZE * (1 + len(self.outs))

    # -- forward --------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def forward(self, k: int, recomputing: bool, segment: Callable[[], int], reached: Callable[[], int],
                receive: Callable[[], object] | None = None) -> Iterator[None]:
        """Inside the block, this stage's hooks act for micro-batch ``k``.

        ``segment`` returns the segment the forward runs for real in (-1 where it stands in), ``reached`` the one it
        is in either way (where a value read by the step's code is given at its producer's output, before the
        stage's first cut point: ``receive`` waits for the message that holds it).
        """
        forward = _Forward(self, k, segment, reached, recomputing, receive)
        try:
            with acting_for(forward):
                yield
        finally:
            if recomputing:
                self.recaptured[k] = forward.captured
            else:
                self.captured[k], self.kept_leaves[k] = forward.captured, forward.kept

    def substitutes(self, k: int) -> dict[SideValue, Tensor]:
        """The received side values, in the dtypes the model had for them."""
        return {v: t if t.dtype == v.dtype or not t.is_floating_point() else t.to(v.dtype)
                for v, t in self.received[k].items()}

    def _sent(self, k: int) -> list[Tensor]:
        values = []
        for value in self.outs:
            tensor = self.received[k].get(value) if value in self.ins else self.captured[k].get(value)
            if tensor is None:
                raise PipelineError(
                    f"Stage {self.stage}'s forward of micro-batch {k} did not make a side value the dry run saw:"
                    f" {value.what}. The model's data flow must be the same in every forward."
                )
            tensor = tensor.detach()
            if self.wire is not None and tensor.is_floating_point() and tensor.dtype != self.wire:
                tensor = tensor.to(self.wire)
            values.append(tensor)
        return values

    # -- sending --------------------------------------------------------------------------------------------
    def header(self, out: Tensor, k: int, batch_dim: int | None) -> Tensor:
        """The step's header for the activation ``out`` of micro-batch ``k`` and the side values sent with it."""
        values = self._sent(k)
        slots = encode_header(out).tolist() + [slot for value in values for slot in _encode(value)]
        dims = [batch_dim, *(v.batch_dim for v in self.outs)]
        self.out_specs = [[(scaled_shape(t.shape, d, self.sizes[k], n), t.dtype) for t, d in zip([out, *values], dims)]
                          for n in self.sizes]
        return torch.tensor(slots, dtype=torch.int64).to(out.device)

    def pack_output(self, k: int, out: Tensor) -> Tensor:
        """The message of micro-batch ``k``: ``out`` (checked against the header by the caller), the side values."""
        assert self.out_specs is not None
        values = self._sent(k)
        for value, tensor, (shape, dtype) in zip(self.outs, values, self.out_specs[k][1:]):
            if tensor.shape != shape or tensor.dtype != dtype:
                raise PipelineError(
                    f"Stage {self.stage}'s side value for micro-batch {k} has shape {tuple(tensor.shape)}"
                    f" ({tensor.dtype}), but this step's header agreed {tuple(shape)} ({dtype}): {value.what}."
                )
        return pack([out, *values], self.out_specs[k])

    def grad_spec(self, k: int) -> Spec:
        """The spec of the gradient message that answers the activation sent for micro-batch ``k``."""
        assert self.out_specs is not None
        return packed_spec(_floating(self.out_specs[k]))

    # -- receiving ------------------------------------------------------------------------------------------
    def input_specs(self, header: Tensor, batch_dim: int | None) -> list[Spec]:
        """Reads the received header; returns the spec of each micro-batch's message."""
        values = header.tolist()
        pieces = [_decode(values[i : i + HEADER_SIZE]) for i in range(0, len(values), HEADER_SIZE)]
        dims = [batch_dim, *(v.batch_dim for v in self.ins)]
        self.in_specs = [[(scaled_shape(shape, d, self.sizes[0], n), dtype) for (shape, dtype), d in zip(pieces, dims)]
                         for n in self.sizes]
        return [packed_spec(specs) for specs in self.in_specs]

    def unpack_input(self, k: int, packed: Tensor) -> Tensor:
        """The activation of a received message; its side values become leaves that require grad if training."""
        assert self.in_specs is not None
        activation, *values = unpack(packed, self.in_specs[k])
        for value, tensor in zip(self.ins, values):
            self.received[k][value] = tensor.requires_grad_(self.train and tensor.is_floating_point())
        return activation

    # -- backward -------------------------------------------------------------------------------------------
    def backward_roots(self, k: int, packed: Tensor, partial: bool) -> tuple[
            Tensor, list[Tensor], list[Tensor], list[Tensor], list[Tensor], list[tuple[Tensor, Tensor]]]:
        """Splits a received gradient message into the activation's gradient and the side values' roots.

        Returns the activation's gradient, then the side values sent with their gradients, as ``roots, grads`` of
        the backward of the rest of the stage and again of its recomputed part (recompute by degree), then the
        values that part makes again with the leaves the kept part used in their place (their gradients are known
        after the kept part's backward).
        """
        assert self.out_specs is not None
        grad, *grads = unpack(packed, _floating(self.out_specs[k]))
        roots: tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]] = ([], [], [], [])
        recaptured = self.recaptured[k] or {}
        kept: list[tuple[Tensor, Tensor]] = []
        for value, leaf in self.kept_leaves[k].items():
            if value not in recaptured:
                raise PipelineError(f"Stage {self.stage}'s recompute of micro-batch {k} did not make a side value"
                                    f" its forward made: {value.what}. The model's data flow must be the same in"
                                    " every forward.")
            kept.append((recaptured[value], leaf))
        sent = [v for v, (_, dtype) in zip(self.outs, self.out_specs[k][1:]) if dtype.is_floating_point]
        for value, g in zip(sent, grads):
            if value in self.ins:
                root, recomputed = self.received[k][value], False
            elif value in recaptured:
                root, recomputed = recaptured[value], partial
            else:
                root, recomputed = self.captured[k][value], False
            if root.requires_grad:
                roots[2 * recomputed].append(root)
                roots[2 * recomputed + 1].append(g if g.dtype == root.dtype else g.to(root.dtype))
        return (grad, *roots, kept)

    def pack_input_grad(self, k: int, grad: Tensor) -> Tensor:
        """The gradient message for the previous stage: ``grad`` (the activation's), the received side values'."""
        assert self.in_specs is not None
        tensors = [grad]
        for value in self.ins:
            leaf = self.received[k][value]
            if leaf.is_floating_point():
                tensors.append(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
                leaf.grad = None
        return pack(tensors, _floating(self.in_specs[k]))

    def release(self, k: int) -> None:
        """Forgets micro-batch ``k``'s values."""
        self.received[k], self.captured[k], self.recaptured[k], self.kept_leaves[k] = {}, {}, None, {}


def _floating(specs: list[Spec]) -> list[Spec]:
    """The activation's spec and those of the floating side values (the pieces of a gradient message)."""
    return [specs[0], *(spec for spec in specs[1:] if spec[1].is_floating_point)]
