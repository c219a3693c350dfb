"""The gradients of one training batch, between the strategy's ``training_step``, ``backward`` and optimizer step.

Lightning's automatic optimization runs ``training_step -> zero_grad -> backward`` in the optimizer's closure, and
calls ``zero_grad`` only on the first batch of an accumulation window. The strategy's ``training_step`` runs the
whole schedule (backward included), so:

- before the schedule, ``.grad`` holds the last optimizer step's gradients (first batch of a window, cleared by the
  ``zero_grad`` that follows; dropped right away unless a ``zero_grad`` hook may read them) or the window's sum so
  far; both are set aside, and the schedule computes this
  batch's gradients alone. On the window's last batch the data-parallel reductions, which start during the
  stage's last backward, add the window's sum (``accumulated``), so they still reduce the whole gradient;
- after the schedule the set-aside gradients go back, and ``backward`` adds this batch's to them;
- a skipped batch (the module's ``training_step`` returned None) has its gradients dropped, and its started
  reductions discarded: the window's sum is as if the batch had not been there, as in a plain run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn

from lightning_varuna.trainer.callbacks import trainer_callbacks

__all__ = ["BatchGradients", "window_position"]


class BatchGradients:
    """This stage's gradients around one training batch (see the module doc).

    Args:
        params: This stage's parameters.
    """

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = list(params)
        self.skipped = False
        """Whether the last batch was skipped (the same on every rank)."""
        self.window_has_gradients = False
        """Whether a batch of the current accumulation window has contributed gradients (the same on every rank)."""
        self._held: list[Tensor | None] = []
        self._fresh: list[tuple[nn.Parameter, Tensor]] = []

    def set_aside(self, first: bool, final: bool, drop_stale: bool = False) -> Mapping[nn.Parameter, Tensor] | None:
        """Before the schedule: ``.grad`` is set aside; returns what the reductions must add (the window's sum).

        Args:
            first: The batch is the first of its accumulation window.
            final: The batch is the last of its window (the reductions start during its schedule).
            drop_stale: On the window's first batch, drop the last optimizer step's gradients instead of holding
                them until ``zero_grad`` (for when nothing reads them there).
        """
        self._held = [None if first and drop_stale else p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        if not final or first:
            return None
        return {p: g for p, g in zip(self.params, self._held) if g is not None}

    def take(self, first: bool, skipped: bool) -> None:
        """After the schedule: keeps this batch's gradients for :meth:`put_back` (none if ``skipped``)."""
        fresh = [(p, p.grad) for p in self.params if p.grad is not None]
        for p, grad in zip(self.params, self._held):
            p.grad = grad
        self._held = []
        self.skipped = skipped
        self._fresh = [] if skipped else fresh
        self.window_has_gradients = not skipped or (self.window_has_gradients and not first)

    def put_back(self) -> None:
        """In Lightning's ``backward``: ``.grad`` becomes the window's sum including this batch."""
        summed = [(p.grad, grad) for p, grad in self._fresh if p.grad is not None]
        for p, grad in self._fresh:
            if p.grad is None:
                p.grad = grad
        if summed:
            torch._foreach_add_([a for a, _ in summed], [b for _, b in summed])
        self._fresh = []


def window_position(trainer: Trainer) -> tuple[bool, bool, bool]:
    """Where the running batch sits in its accumulation window, as :meth:`BatchGradients.set_aside` takes it.

    Returns:
        ``first`` (the window's first batch), ``final`` (its last: an optimizer step follows), and ``drop_stale``:
        nothing reads the last step's gradients before ``zero_grad`` clears them, unless the module or a callback
        has its own ``zero_grad`` hooks; without one they can be dropped before the schedule (one gradient's memory
        less).
    """
    module = trainer.lightning_module
    loop = trainer.fit_loop.epoch_loop
    first = loop.batch_idx % trainer.accumulate_grad_batches == 0
    final = not loop._should_accumulate()  # private: Lightning's own test of the window's end
    hooks = (
        is_overridden("optimizer_zero_grad", module) or is_overridden("on_before_zero_grad", module)
        or any(is_overridden("on_before_zero_grad", callback, Callback) for callback in trainer_callbacks(trainer))
    )
    return first, final, not hooks
