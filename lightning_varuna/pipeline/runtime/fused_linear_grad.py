"""Weight gradients of linear layers added straight into ``.grad`` across a step's micro-batches.

A stage runs several micro-batches' backwards per step. For every micro-batch after the first, autograd makes
each weight's gradient as a new tensor and then adds it into ``.grad``: one weight-sized temporary at a time
(the largest weight of the stage sets the peak) and a pass over it. For ``nn.Linear`` layers the engine
computes that gradient with one multiply-add into the existing ``.grad`` instead (as Megatron-LM's
``gradient_accumulation_fusion`` does for its own layers), so no weight-sized tensor is made after the first
micro-batch.

The accumulated gradient still reaches ``.grad`` through autograd: the backward takes ``.grad`` away, adds this
micro-batch into it and returns it as the weight's gradient, which autograd's accumulation then takes over
without a copy (it owns the only reference). So every guarantee of ``.grad`` holds as before: gradient
hooks and post-accumulate-grad hooks run, a parameter used twice (tied) sums both uses, and a gradient that
cannot be taken over is copied rather than lost. Two differences remain: a ``.grad`` that something else also
references (a view kept into a flat buffer) is written in place and then copied, so it stops being that view
(nothing in this package keeps one); and a backward that fails between a linear layer and its weight's
accumulation leaves that weight's ``.grad`` empty, where autograd would leave the earlier micro-batches' sum
(the step fails either way).

**Held back for a later task** (zero-bubble schedules, which split a backward into an input-gradient task ``I``
and a weight-gradient task ``W``): inside :func:`holding_weight_grads` too, the backward computes the input's and
the bias's gradients and keeps the layer's input and output gradient in a :class:`WeightGradWork` instead of
computing the weight's; :meth:`WeightGradWork.run` adds each held weight gradient into ``.grad`` with the same
multiply-add, later. A weight that would not be accumulated in place (see below) is computed in the pass as usual.

Layers of one's own (a custom ``torch.autograd.Function``) can hold back their weight-gradient work the same way:
in the backward, :func:`held_weight_grad_work` returns the micro-batch's :class:`WeightGradWork` when this weight's
gradient may be held back (else ``None``: compute and return it as usual), and
:meth:`WeightGradWork.hold_computed` keeps a function that makes the gradient; ``W`` calls it and adds its result
into ``.grad``. The backward then returns ``None`` for that weight.

**Small weights keep autograd's way.** The in-place path runs each linear layer's forward and backward through a
Python ``torch.autograd.Function``, which costs host time on every call; what it saves is one weight-sized
temporary and one pass over it. For a weight of fewer than :data:`MIN_FUSED_NUMEL` elements (4 MiB in fp32) the
saving is smaller than that cost, so :func:`install_grad_accumulation` leaves such layers alone when given that
bound; the engine gives it unless its schedule holds weight gradients back, which needs every linear layer on
this path.

Only backward passes run inside :func:`accumulating_in_place` (the stage's own, which the engine runs) do this:
there autograd accumulates into every leaf's ``.grad``. Any other (``torch.autograd.grad``, a backward with
``inputs=``) computes the weight's gradient as autograd does, and so does a weight with a gradient hook
(``register_hook``: it must see one micro-batch's gradient). Only plain ``nn.Linear`` modules (not subclasses,
which may compute differently) are changed, and a call falls back to ``F.linear`` under autocast (the weight's
gradient is then made in another dtype than ``.grad``), under ``torch.func`` transforms, when the weight is
frozen, and when gradients of gradients are asked for.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "MIN_FUSED_NUMEL",
    "LinearAccumulatingGrad",
    "PendingWeightGrads",
    "WeightGradWork",
    "accumulating_in_place",
    "held_weight_grad_work",
    "holding_weight_grads",
    "install_grad_accumulation",
    "remove_grad_accumulation",
]

MIN_FUSED_NUMEL = 1 << 20
"""Weights with fewer elements keep autograd's accumulation unless the schedule holds weight gradients back."""

# Backward passes inside accumulating_in_place(). Not thread-local: autograd runs a CUDA graph's backward on its
# device's own thread, while the caller waits in torch.autograd.backward.
_depth = 0
_holding: WeightGradWork | None = None


class PendingWeightGrads:
    """How many held-back weight gradients each parameter still waits for, over a step's micro-batches.

    ``param in pending`` says whether ``param``'s gradient is not final yet because of held-back work.
    """

    def __init__(self) -> None:
        self._counts: dict[object, int] = {}  # keyed by parameter; any object may be asked

    def __contains__(self, param: object) -> bool:
        return self._counts.get(param, 0) > 0

    def add(self, param: nn.Parameter) -> None:
        """One more held-back gradient of ``param``."""
        self._counts[param] = self._counts.get(param, 0) + 1

    def done(self, param: nn.Parameter) -> bool:
        """One held-back gradient of ``param`` added into ``.grad``; returns whether it was the last."""
        left = self._counts[param] - 1
        if left:
            self._counts[param] = left
        else:
            del self._counts[param]
        return not left


class WeightGradWork:
    """The weight gradients of one micro-batch's linear layers, held back from its input-gradient pass.

    Args:
        pending: The step's count of held-back gradients per parameter, kept up to date.
    """

    def __init__(self, pending: PendingWeightGrads) -> None:
        self.pending = pending
        self.items: list[tuple[nn.Parameter, Tensor, Tensor]] = []
        self.computed: list[tuple[nn.Parameter, Callable[[], Tensor]]] = []

    def hold(self, param: nn.Parameter, x_2d: Tensor, grad_2d: Tensor) -> None:
        """Keeps what ``param``'s gradient is made of: the layer's input and output gradient, both 2-d."""
        self.items.append((param, x_2d, grad_2d))
        self.pending.add(param)

    def hold_computed(self, param: nn.Parameter, compute: Callable[[], Tensor]) -> None:
        """Keeps ``compute``, which returns ``param``'s gradient (``param``'s shape and dtype), for :meth:`run`.

        For a custom layer's backward, after :func:`held_weight_grad_work` returned this work (see the module's
        docstring). ``compute`` runs once, without autograd recording, when ``W`` runs.
        """
        self.computed.append((param, compute))
        self.pending.add(param)

    def run(self) -> list[nn.Parameter]:
        """Adds every held gradient into its weight's ``.grad``; returns the weights whose gradient is now final."""
        final = []
        for param, x_2d, grad_2d in self.items:
            held = param.grad
            if held is None:
                param.grad = grad_2d.t().mm(x_2d)
            else:
                held.addmm_(grad_2d.t(), x_2d)
            if self.pending.done(param):
                final.append(param)
        for param, compute in self.computed:
            with torch.no_grad():
                grad = compute()
            if param.grad is None:
                param.grad = grad
            else:
                param.grad.add_(grad)
            if self.pending.done(param):
                final.append(param)
        self.items.clear()
        self.computed.clear()
        return final


def held_weight_grad_work(ctx: Any, param: nn.Parameter, input_index: int) -> WeightGradWork | None:
    """In a custom ``torch.autograd.Function``'s backward: where ``param``'s gradient may be held back, else None.

    Args:
        ctx: The Function's ``ctx`` (its backward node).
        param: The weight, passed to the Function's ``forward`` as input number ``input_index``.
        input_index: Position of ``param`` among ``forward``'s inputs (its gradient's position in the return).

    Returns:
        The micro-batch's :class:`WeightGradWork` when this backward is an engine's input-gradient task ``I`` and
        ``param``'s gradient goes to ``.grad`` unobserved (no gradient hook, not frozen, the pass accumulates it):
        give it the gradient's computation with :meth:`WeightGradWork.hold_computed` and return ``None`` for the
        weight. Otherwise ``None``: compute and return the gradient as usual.
    """
    if _holding is None or not _into_grad(ctx, param, param.grad, param.dtype, may_be_empty=True, index=input_index):
        return None
    return _holding


@contextlib.contextmanager
def holding_weight_grads(work: WeightGradWork) -> Iterator[None]:
    """Inside :func:`accumulating_in_place`: linear layers' weight gradients go to ``work`` instead of ``.grad``."""
    global _holding
    previous, _holding = _holding, work
    try:
        yield
    finally:
        _holding = previous


@contextlib.contextmanager
def accumulating_in_place() -> Iterator[None]:
    """Backward passes run inside accumulate linear layers' weight gradients in place into ``.grad``.

    Only for passes whose gradients all go to ``.grad`` (``torch.autograd.backward`` without ``inputs``).
    """
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


class LinearAccumulatingGrad(torch.autograd.Function):
    """``F.linear`` whose backward adds the weight's gradient into the weight's existing ``.grad`` in place."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """``F.linear(x, weight, bias)``."""
        ctx.save_for_backward(x, weight)
        ctx.weight = weight  # the parameter itself: saved tensors are unpacked as new Tensor objects
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """The input's and bias's gradients, and the weight's accumulated into its ``.grad`` when it has one."""
        x, weight = ctx.saved_tensors
        grad_2d = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_bias = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        x_2d = x.reshape(-1, x.shape[-1])
        param: nn.Parameter = ctx.weight
        held = param.grad
        if _holding is not None and _into_grad(ctx, param, held, grad_2d.dtype, may_be_empty=True):
            _holding.hold(param, x_2d, grad_2d)
            return grad_x, None, grad_bias
        if not _into_grad(ctx, param, held, grad_2d.dtype):
            return grad_x, grad_2d.t().mm(x_2d), grad_bias
        # autograd's accumulation takes ``held`` back as the whole gradient (no copy: ours is the only reference)
        param.grad = None
        # _into_grad without may_be_empty holds only for a tensor ``held``
        return grad_x, cast(Tensor, held).addmm_(grad_2d.t(), x_2d), grad_bias


def _into_grad(ctx: Any, param: nn.Parameter, held: Tensor | None, dtype: torch.dtype,
               may_be_empty: bool = False, index: int = 1) -> bool:
    """Whether this backward may add the weight's gradient into ``held`` (its ``.grad``) and hand that back.

    With ``may_be_empty``, also when there is no ``.grad`` yet and ``param`` has the gradient's dtype.
    """
    if held is None and may_be_empty:
        if param.dtype != dtype:
            return False
    elif held is None or held.dtype != dtype or held.is_sparse:
        return False
    if not _depth or torch.is_grad_enabled():
        return False
    # a hook on the gradient must see this micro-batch's alone; autograd's accumulation skips a frozen parameter
    if param._backward_hooks or not param.requires_grad:
        return False
    try:
        # whether this pass runs the weight's accumulation into .grad (torch.autograd.grad and a backward with
        # inputs= may not): torch.autograd.graph.register_multi_grad_hook asks the engine the same way
        return bool(torch._C._will_engine_execute_node(ctx.next_functions[index][0]))
    except RuntimeError:  # inside torch.autograd.grad, whose gradients never go to .grad
        return False


def _forward(self: nn.Linear, x: Tensor) -> Tensor:
    """``nn.Linear.forward`` through :class:`LinearAccumulatingGrad` where it applies."""
    # torch.func's transforms need an autograd.Function with setup_context; torch.autograd asks them the same way
    if (not self.weight.requires_grad or not torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type)
            or torch._C._are_functorch_transforms_active()):
        return F.linear(x, self.weight, self.bias)
    return cast(Tensor, LinearAccumulatingGrad.apply(x, self.weight, self.bias))


def install_grad_accumulation(root: nn.Module, min_numel: int = 0) -> list[nn.Linear]:
    """Makes every plain ``nn.Linear`` of ``root`` that holds its weight accumulate in place.

    Skipped: subclasses, modules whose ``forward`` is already replaced (a stand-in), modules whose weight
    another stage holds (a placeholder buffer here), and weights of fewer than ``min_numel`` elements.

    Args:
        root: The module whose linear layers change.
        min_numel: Smallest weight (in elements) to change: :data:`MIN_FUSED_NUMEL` where weight gradients are
            never held back, 0 where they may be (a held-back gradient needs this path).

    Returns:
        The modules changed, for :func:`remove_grad_accumulation`.
    """
    changed = []
    for module in root.modules():
        if (type(module) is nn.Linear and "forward" not in module.__dict__
                and isinstance(module.weight, nn.Parameter) and module.weight.numel() >= min_numel):
            # a partial pickles (torch.save of the model)
            module.forward = functools.partial(_forward, module)  # type: ignore[method-assign]  # per instance
            changed.append(module)
    return changed


def remove_grad_accumulation(modules: list[nn.Linear]) -> None:
    """Gives the modules their class's ``forward`` back."""
    for module in modules:
        if getattr(module.__dict__.get("forward"), "func", None) is _forward:
            del module.__dict__["forward"]
