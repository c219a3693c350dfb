"""Profiling a model built on the meta device one segment at a time: only that segment's parameters get memory.

For segment ``i``, :func:`measure_segments_on_meta` materializes (and initializes) the parameters the segment uses,
stands in for the modules of earlier segments (:class:`~lightning_varuna.pipeline.model.stand_ins.StandIn`: output
shapes only) and turns every other parameter into a placeholder, as a pipeline stage holding segment ``i`` alone would.
The user's step then runs with a cut point handler that puts a random activation of the traced shape at cut ``i - 1``
and ends the forward at cut ``i``: the forward without and with autograd, the backward (from a random output gradient,
or from the loss on the last segment) and the bytes the forward keeps for backward are timed and counted, as
:func:`~lightning_varuna.pipeline.planning.profiler.profile_model` does for a whole model. Then the model's
registrations are put back, which frees the segment's memory before the next one is materialized.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_varuna.pipeline.model.cut import CutPoint, StageOutputReady, forward_handler
from lightning_varuna.pipeline.model.dry_run import Trace
from lightning_varuna.pipeline.model.meta_init import ParamInitFn, materialize
from lightning_varuna.pipeline.model.stand_ins import (
    StandIn,
    free_parameter,
    install_stand_in,
    remove_stand_ins,
    stand_in_candidates,
)

__all__ = ["SegmentTimes", "measure_segments_on_meta"]

SegmentTimes = tuple[list[float], list[float], list[float], list[int]]
"""Per segment, for one micro-batch size: forward without autograd, forward with autograd, backward (seconds), and
the bytes the forward keeps for backward."""


def measure_segments_on_meta(
    module: nn.Module,
    step_on: Callable[[int], Any],
    loss_of: Callable[[Any], Tensor],
    trace: Trace,
    sizes: Sequence[int],
    device: torch.device,
    repeats: int,
    param_init_fn: ParamInitFn | None = None,
) -> list[SegmentTimes]:
    """Measures every segment alone, one at a time (see the module's docstring); one entry per size of ``sizes``.

    Args:
        module: The whole model, parameters on the meta device (left as they were).
        step_on: Runs the user's step on a batch of ``n`` samples and returns its output.
        loss_of: The loss in a step's output.
        trace: The dry run's trace (on meta).
        sizes: Micro-batch sizes to measure.
        device: Where the segment runs.
        repeats: Each time is the fastest of this many runs.
        param_init_fn: Initializes what a module owns directly (default: its ``reset_parameters()``).
    """
    measured: list[SegmentTimes] = [([], [], [], []) for _ in sizes]
    output_saved: dict[int, bool] = {}
    for index in range(trace.num_segments):
        with _segment_alone(module, trace, index, device, param_init_fn, output_saved) as probe:
            for times, n in zip(measured, sizes, strict=True):
                forward, forward_grad, backward, saved = probe.measure(step_on, loss_of, n, repeats)
                times[0].append(forward)
                times[1].append(forward_grad)
                times[2].append(backward)
                times[3].append(saved)
        output_saved = probe.output_saved
    return measured


@contextlib.contextmanager
def _segment_alone(module: nn.Module, trace: Trace, index: int, device: torch.device,
                   param_init_fn: ParamInitFn | None, input_saved: dict[int, bool]) -> Iterator[_SegmentProbe]:
    keep = {name for name, segments in trace.param_segments.items() if index in segments}
    probe = _SegmentProbe(module, trace, index, device, input_saved)
    with _registrations_restored(module):
        materialize(module, keep, device, seed=0, param_init_fn=param_init_fn)
        for name, _ in list(module.named_parameters()):
            if name not in keep:
                free_parameter(module, name, device)
        earlier = stand_in_candidates(trace, index)
        stand_ins = []
        for name in sorted(earlier):
            if any(name.startswith(other + ".") for other in earlier):
                continue  # inside a module already stood in for
            target = module.get_submodule(name)
            stand_ins.append(StandIn(target, range(index, index + 1), lambda: probe.segment, device,
                                     trace.call_shapes.get(name, ()), name, name not in trace.not_on_meta))
            install_stand_in(stand_ins[-1])
        try:
            yield probe
        finally:
            remove_stand_ins(stand_ins)


@contextlib.contextmanager
def _registrations_restored(module: nn.Module) -> Iterator[None]:
    """Every submodule's parameters and buffers are registered as before at the end of the block.

    The registries are private (``_parameters``, ``_buffers``, ``_non_persistent_buffers_set``): torch has no public
    way to turn a placeholder buffer back into the parameter it replaced, and restoring them as they were undoes
    :func:`~lightning_varuna.pipeline.model.meta_init.materialize` and
    :func:`~lightning_varuna.pipeline.model.stand_ins.free_parameter` alike.
    """
    saved = [(m, dict(m._parameters), dict(m._buffers), set(m._non_persistent_buffers_set)) for m in module.modules()]
    try:
        yield
    finally:
        for m, params, buffers, non_persistent in saved:
            m._parameters.clear()
            m._parameters.update(params)
            m._buffers.clear()
            m._buffers.update(buffers)
            m._non_persistent_buffers_set.clear()
            m._non_persistent_buffers_set.update(non_persistent)


class _SegmentProbe:
    """Runs the user's step so that only segment ``index`` computes, and times it.

    A whole model's profile counts each saved tensor once, in the segment that saves it first: the segment's input
    counts here only if the previous segment did not keep its output (``input_saved``, per size).
    """

    def __init__(self, module: nn.Module, trace: Trace, index: int, device: torch.device,
                 input_saved: dict[int, bool]) -> None:
        self.trace, self.index, self.device = trace, index, device
        self.input_saved = input_saved
        self.output_saved: dict[int, bool] = {}
        """Per size: whether this segment keeps its output for backward."""
        self.last = index == trace.num_segments - 1
        self.stored: set[int] = set()
        self.segment = 0
        self.start = 0.0
        self.end = 0.0
        self.output: Tensor | None = None
        self.size = 1
        self.saved = 0
        self._seen: set[int] = set()
        self._module = module

    # -- the cut point handler -------------------------------------------------------------------------------
    def on_cut(self, cut: CutPoint, x: Tensor) -> Tensor:
        position, self.segment = self.segment, self.segment + 1
        if position == self.index - 1:
            received = self._input(position)
            if self.input_saved.get(self.size, False):
                self._seen.add(received.untyped_storage().data_ptr())
            _synchronize(self.device)
            self.start = time.perf_counter()
            return received
        if position == self.index:
            _synchronize(self.device)
            self.end = time.perf_counter()
            self.output = x
            raise StageOutputReady
        return x

    def _input(self, cut: int) -> Tensor:
        info = self.trace.cuts[cut]
        shape = [self.size if d == info.batch_dim else n for d, n in enumerate(info.shape)]
        if not info.dtype.is_floating_point:
            return torch.zeros(shape, dtype=info.dtype, device=self.device)
        return torch.randn(shape, dtype=info.dtype, device=self.device).requires_grad_(torch.is_grad_enabled())

    def _pack(self, tensor: Tensor) -> Tensor:
        if self.segment < self.index or tensor.is_meta:
            return tensor  # a stand-in's shape inference, before the segment starts
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.stored and storage.data_ptr() not in self._seen:
            self._seen.add(storage.data_ptr())
            self.saved += storage.nbytes()
        return tensor

    # -- one size --------------------------------------------------------------------------------------------
    def measure(self, step_on: Callable[[int], Any], loss_of: Callable[[Any], Tensor], n: int,
                repeats: int) -> tuple[float, float, float, int]:
        """The segment's forward without and with autograd, backward (fastest of ``repeats``) and saved bytes."""
        self.size = n
        self.stored = {p.untyped_storage().data_ptr() for p in self._module.parameters() if not p.is_meta}
        forward, forward_grad, backward = (float("inf"),) * 3
        for _ in range(repeats):
            with torch.no_grad():
                forward = min(forward, self._forward(step_on, loss_of, n)[0])
            self.saved, self._seen = 0, set()
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                seconds, out = self._forward(step_on, loss_of, n)
            forward_grad = min(forward_grad, seconds)
            self.output_saved[n] = out.untyped_storage().data_ptr() in self._seen
            backward = min(backward, self._backward(out))
            for p in self._module.parameters():
                p.grad = None
        self.output = None
        return forward, forward_grad, backward, self.saved

    def _forward(self, step_on: Callable[[int], Any], loss_of: Callable[[Any], Tensor], n: int) -> tuple[float, Tensor]:
        self.segment, self.output = 0, None
        _synchronize(self.device)
        self.start = time.perf_counter()
        with forward_handler(self):
            try:
                out = loss_of(step_on(n))
                self.end = time.perf_counter()
            except StageOutputReady:
                assert self.output is not None
                out = self.output
        _synchronize(self.device)
        end = time.perf_counter() if self.last else self.end
        return max(0.0, end - self.start), out

    def _backward(self, out: Tensor) -> float:
        if not out.requires_grad:
            return 0.0  # nothing trainable in this segment nor before it
        gradient = None if self.last else torch.randn_like(out)
        _synchronize(self.device)
        start = time.perf_counter()
        torch.autograd.backward(out, gradient)
        _synchronize(self.device)
        return time.perf_counter() - start


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
