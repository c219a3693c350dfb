"""What each segment costs, measured by the dry run without real tensors, and a model of time from it.

The dry run (:func:`~lightning_varuna.pipeline.model.dry_run.trace_step`) runs the step on 1 and on 2 samples;
:class:`CostCounter` counts, per segment, the forward FLOPs (``torch.utils.flop_counter.FlopCounterMode``, which
works on the meta device) and the bytes autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``).
The two runs give each count as a line in the micro-batch size, ``fixed + per_sample * b``
(:class:`Linear`), which :class:`SegmentCost` keeps together with the bytes of the parameters the segment uses.

:func:`estimated_seconds` turns a segment's cost into time on a device with given rates
(:class:`DeviceRates`); the partition balances those estimates when no measured time exists (a model on the meta
device). Everything here is a pure function of the trace, so other planners (a profiler choosing P, D and the
micro-batch size) can evaluate other layouts from the same trace.

Attention: on the meta device ``scaled_dot_product_attention`` runs its math path, whose matrix products are
counted; CPU's fused kernel has no formula in torch's table, so one is given here. A causal mask is not
discounted (the full ``T x T`` product is counted), which overestimates attention the same way in every
segment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

__all__ = [
    "CostCounter", "DeviceRates", "Linear", "SegmentCost", "estimated_seconds", "fit_costs", "state_bytes",
]

OPTIMIZER_STATE_FACTOR = 2.0
"""Optimizer state bytes per parameter byte assumed by the estimate (Adam's two moments; SGD without momentum
has 0)."""


@dataclass(frozen=True)
class Linear:
    """A quantity that grows linearly with the micro-batch size: ``fixed + per_sample * samples``."""

    fixed: float
    per_sample: float

    def at(self, samples: float) -> float:
        """The value for a micro-batch of ``samples`` (never negative)."""
        return max(0.0, self.fixed + self.per_sample * samples)

    @classmethod
    def through(cls, one: float, two: float) -> Linear:
        """The line through the values measured with 1 and with 2 samples."""
        return cls(fixed=2 * one - two, per_sample=two - one)


@dataclass(frozen=True)
class SegmentCost:
    """What one segment costs (one micro-batch's forward, and the parameters it uses)."""

    forward_flops: Linear
    """Forward FLOPs of a micro-batch."""
    saved_bytes: Linear
    """Bytes of activations autograd keeps for backward (parameters and buffers not included)."""
    param_bytes: int
    """Bytes of the parameters the segment uses (a parameter used by several segments counts in each)."""
    trainable_bytes: int
    """Of which parameters that train (they also have a gradient and optimizer state)."""


@dataclass(frozen=True)
class DeviceRates:
    """The speeds an estimate assumes: arithmetic and memory traffic of one device.

    Only their ratio matters for balancing stages; the absolute values only scale the printed estimate.
    """

    flops_per_second: float
    bytes_per_second: float

    @classmethod
    def nominal(cls, device: torch.device | str) -> DeviceRates:
        """Round figures for a data-centre GPU (``cuda``) or a server CPU core group (anything else)."""
        if torch.device(device).type == "cuda":
            return cls(flops_per_second=1e14, bytes_per_second=2e12)
        return cls(flops_per_second=1e11, bytes_per_second=2e10)


def state_bytes(cost: SegmentCost, optimizer_state_factor: float = OPTIMIZER_STATE_FACTOR) -> float:
    """Bytes of the segment's parameters, gradients and optimizer state."""
    return cost.param_bytes + cost.trainable_bytes * (1.0 + optimizer_state_factor)


def estimated_seconds(
    cost: SegmentCost, microbatch: int, rates: DeviceRates, num_microbatches: int = 1,
    optimizer_state_factor: float = OPTIMIZER_STATE_FACTOR,
) -> float:
    """Estimated time a segment takes per micro-batch in training (forward, backward, its share of the update).

    A roofline-style sum, ``compute / flops_per_second + traffic / bytes_per_second``:

    - compute: forward plus backward, ``3 x`` the forward FLOPs (a backward costs about two forwards);
    - traffic per micro-batch: the saved activations written in forward and read in backward (``2 x``), the
      parameters read in forward and backward and their gradient written (``3 x`` the parameter bytes);
    - traffic per optimizer step, spread over ``num_microbatches``: parameters, gradients and optimizer state
      read and written once (``2 x`` :func:`state_bytes`).

    Args:
        cost: The segment's cost.
        microbatch: Samples per micro-batch.
        rates: The device's speeds.
        num_microbatches: Micro-batches per optimizer step.
        optimizer_state_factor: Optimizer state bytes per trainable parameter byte.
    """
    compute = 3.0 * cost.forward_flops.at(microbatch)
    traffic = 2.0 * cost.saved_bytes.at(microbatch) + 3.0 * cost.param_bytes
    update = 2.0 * state_bytes(cost, optimizer_state_factor) / max(1, num_microbatches)
    return compute / rates.flops_per_second + (traffic + update) / rates.bytes_per_second


def fit_costs(
    one: CostCounter, two: CostCounter, param_segments: dict[str, set[int]], params: dict[str, nn.Parameter],
    num_segments: int,
) -> list[SegmentCost]:
    """Each segment's cost from the counts of the runs on 1 and on 2 samples.

    Args:
        one: The counts of the run on 1 sample.
        two: The counts of the run on 2 samples.
        param_segments: The segments each parameter is used in (by name).
        params: The model's parameters by name.
        num_segments: The number of segments.
    """
    one_flops, one_saved = one.totals(num_segments)
    two_flops, two_saved = two.totals(num_segments)
    param_bytes = [0] * num_segments
    trainable = [0] * num_segments
    for name, segments in param_segments.items():
        param = params[name]
        size = param.numel() * param.element_size()
        for s in segments:
            param_bytes[s] += size
            trainable[s] += size if param.requires_grad else 0
    return [
        SegmentCost(
            forward_flops=Linear.through(one_flops[s], two_flops[s]),
            saved_bytes=Linear.through(one_saved[s], two_saved[s]),
            param_bytes=param_bytes[s],
            trainable_bytes=trainable[s],
        )
        for s in range(num_segments)
    ]


class _Mode(Protocol):
    def __enter__(self) -> object: ...

    def __exit__(self, *exc: object) -> object: ...


def _as_mode(mode: FlopCounterMode) -> _Mode:
    """``mode`` as the context manager it is (torch leaves its ``__enter__`` and ``__exit__`` unannotated)."""
    return cast(_Mode, mode)


def _cpu_attention_flops(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    # torch's table has formulas for the CUDA fused kernels and the math path, none for CPU's fused kernel
    return cast(Callable[..., int], sdpa_flop_count)(query, key, value)  # torch leaves it unannotated


_EXTRA_FORMULAS: dict[Any, Callable[..., int]] = {}
if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
    _EXTRA_FORMULAS[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_attention_flops


class CostCounter:
    """Counts forward FLOPs and saved-activation bytes per segment while a step runs (use as a context).

    Args:
        segment: Returns the segment the running forward is in.
    """

    def __init__(self, segment: Callable[[], int]) -> None:
        self.segment = segment
        self.flops: list[float] = []
        self.saved: list[float] = []
        self._flop_mode = FlopCounterMode(display=False, custom_mapping=_EXTRA_FORMULAS)
        self._counted = 0
        self._seen: dict[int, Tensor] = {}
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _grow(self, segment: int) -> None:
        while len(self.flops) <= segment:
            self.flops.append(0.0)
            self.saved.append(0.0)

    def settle(self) -> None:
        """Books the FLOPs counted since the last call to the running segment (call it when a segment ends)."""
        total = self._flop_mode.get_total_flops()
        segment = self.segment()
        self._grow(segment)
        self.flops[segment] += total - self._counted
        self._counted = total

    def totals(self, num_segments: int) -> tuple[list[float], list[float]]:
        """The FLOPs and saved bytes of each of ``num_segments`` segments (0 for a segment that ran no op)."""
        self._grow(num_segments - 1)
        return self.flops[:num_segments], self.saved[:num_segments]

    def _pack(self, tensor: Tensor) -> Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if not isinstance(base, nn.Parameter) and id(base) not in self._seen:
            self._seen[id(base)] = base  # held for the run, so that ids stay unique
            segment = self.segment()
            self._grow(segment)
            self.saved[segment] += base.numel() * base.element_size()
        # An op that saves its own output (exp, sigmoid, layer norm) would otherwise hold that output, whose
        # grad_fn holds the saved variable: a cycle through C++ that the garbage collector cannot see, so the
        # dry run's activations outlived it. A detached alias keeps the same data for backward without the cycle.
        return tensor.detach()

    def __enter__(self) -> CostCounter:
        _as_mode(self._flop_mode).__enter__()
        self._saved_hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                self.settle()
        finally:
            self._seen.clear()
            self._saved_hooks.__exit__(*exc)
            _as_mode(self._flop_mode).__exit__(*exc)


def _unpack(tensor: Tensor) -> Tensor:
    return tensor
