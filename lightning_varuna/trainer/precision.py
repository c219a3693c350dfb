"""Precision for a pipeline: gradient clipping by the whole model's norm, and fp16 overflow agreed by every rank.

Lightning picks a precision plugin from ``Trainer(precision=...)`` (``32-true``, ``bf16-mixed``, ``16-mixed``, ...).
Each stage holds only part of the model, so two of its behaviours would be wrong in a pipeline:

- ``clip_grad_by_norm`` clips by the norm of this rank's gradients; the strategy's plugin clips by the norm of
  the whole model's gradient, summed over the stages of the pipeline (a tied parameter counted once);
- under ``16-mixed``, ``GradScaler`` decides from this rank's gradients whether to skip the step; every stage
  and replica must skip (and update the scale) together, so the scaler is torch's
  :class:`~torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`, which agrees on overflow over the
  process group.

:func:`pipeline_precision` turns the plugin Lightning chose into one that does both, keeping everything else of
it (autocast, conversions, state): its class becomes a subclass of the user's plugin class and
:class:`PipelinePrecision`, so Lightning's own ``isinstance`` checks still hold.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, cast

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.amp.grad_scaler import GradScaler
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.optim import Optimizer
from typing_extensions import override

__all__ = ["PipelinePrecision", "pipeline_precision"]

_EPSILON = 1e-6  # as torch.nn.utils.clip_grad_norm_


class PipelinePrecision(Precision):
    """The part of a pipeline's precision plugin that differs from the plugin it extends (see the module doc).

    ``global_grad_norm`` is set by the strategy once the pipeline exists: it returns the whole model's gradient
    norm (a collective over the pipeline).
    """

    global_grad_norm: Callable[[], Tensor] | None = None
    before_update: Callable[[], None] | None = None
    """Called once the closure and the clipping are done, just before the optimizer updates the parameters (the
    in-place recovery's commit); None: nothing."""

    @override
    def _after_closure(self, model: Any, optimizer: Any) -> None:
        # private hook of Lightning's Precision (2.5-2.6 tested): every plugin calls it between the closure (with
        # on_before_optimizer_step and clipping) and the update, which no public hook separates
        super()._after_closure(model, optimizer)
        if self.before_update is not None:
            self.before_update()

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Scales this stage's gradients so that the whole model's gradient norm is at most ``clip_val``."""
        if self.global_grad_norm is None:
            raise RuntimeError("The pipeline's gradient norm is not available before the strategy's setup.")
        norm = self.global_grad_norm()
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if grads:
            coef = torch.clamp(float(clip_val) / (norm + _EPSILON), max=1.0)
            torch._foreach_mul_(grads, coef.to(grads[0].device))

    def check_optimizers(self, optimizers: Iterable[Optimizer]) -> None:
        """Refuses optimizers that would bypass the agreement on fp16 overflow."""
        scaler = getattr(self, "scaler", None)
        fused = [type(o).__name__ for o in optimizers if getattr(o, "_step_supports_amp_scaling", False)]
        if scaler is not None and fused:
            raise MisconfigurationException(
                f"VarunaStrategy with a loss scaler (16-mixed) cannot use {', '.join(fused)} with fused=True:"
                " such optimizers skip the scaler's unscale_, where every stage and replica agrees on overflow, so"
                " the ranks would decide alone. Create it with fused=False (or use bf16-mixed)."
            )


class _WithScaler(Protocol):
    scaler: GradScaler


_PIPELINE_CLASSES: dict[type[Precision], type[Precision]] = {}


def _pipeline_class(cls: type[Precision]) -> type[Precision]:
    """``cls`` with :class:`PipelinePrecision` mixed in (one class per plugin class)."""
    if issubclass(cls, PipelinePrecision):
        return cls
    if cls not in _PIPELINE_CLASSES:
        _PIPELINE_CLASSES[cls] = type(f"Pipeline{cls.__name__}", (PipelinePrecision, cls), {"__module__": __name__})
    return _PIPELINE_CLASSES[cls]


def pipeline_precision(plugin: Precision) -> Precision:
    """``plugin`` as a :class:`PipelinePrecision` (the same object if it already is one).

    Its loss scaler, if any, is replaced by a :class:`ShardedGradScaler` with the same settings and state,
    which agrees on overflow over the default process group.
    """
    if isinstance(plugin, PipelinePrecision):
        return plugin
    wrapped = _pipeline_class(type(plugin)).__new__(_pipeline_class(type(plugin)))
    wrapped.__dict__.update(plugin.__dict__)
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None and not isinstance(scaler, ShardedGradScaler):
        with_scaler = cast(_WithScaler, wrapped)  # a copy of the plugin, which has a scaler
        with_scaler.scaler = _sharded(scaler, getattr(plugin, "device", "cpu"))
    return wrapped


def _sharded(scaler: Any, device: str) -> ShardedGradScaler:
    sharded = ShardedGradScaler(
        device=device,
        init_scale=scaler.get_scale() if scaler.is_enabled() else 2.0**16,
        growth_factor=scaler.get_growth_factor(),
        backoff_factor=scaler.get_backoff_factor(),
        growth_interval=scaler.get_growth_interval(),
        enabled=scaler.is_enabled(),
        process_group=None,  # the default group: every stage of every replica
    )
    state = scaler.state_dict()  # empty until the first step
    if state:
        sharded.load_state_dict(state)
    return sharded
