"""Runs code (the dry run) that must leave no trace in the model or in the random number generators.

The dry run calls the user's whole step several times on a slice of a batch. Whatever that step changes must be
put back, or the first real step starts from another state than the plain run's: a torchmetrics metric fed with
``.update()`` would count the dry run's samples, a BatchNorm its statistics, a counter or a list of outputs kept on
the module its calls, and the RNGs would be a few draws ahead.

:func:`no_trace` puts back, for every submodule: its attributes (added ones removed, replaced ones restored,
tensors and builtin containers restored in place, so that references held elsewhere see the old values), its
buffers, and which submodules, buffers and parameters it has (a metric the step creates on its first call is gone
again, so the first real step creates it afresh); and the torch (CPU and this device), Python and NumPy random
states. Parameters are not copied (a step does not change them), and objects that are not tensors or builtin
containers (the trainer, a datamodule) are restored by reference only: what a step changes inside them stays.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["no_trace"]

_MODULE_INTERNALS = frozenset(vars(nn.Module())) - {"training"}
"""``nn.Module``'s own bookkeeping (parameters, buffers, submodules, hooks), not state a step would change."""
_REGISTRIES = ("_modules", "_buffers", "_parameters")
"""Where ``nn.Module`` registers submodules, buffers and parameters (private: there is no public way to unregister
one that a step registered)."""
_MAX_DEPTH = 4
"""How deep nested containers are copied; deeper ones are kept by reference."""


class _Saved:
    """A value as it was: ``restore()`` puts it back and returns the original object."""

    __slots__ = ("original", "copy")

    def __init__(self, original: Any, depth: int = 0) -> None:
        self.original = original
        self.copy: Any = None
        if isinstance(original, nn.Parameter) or depth > _MAX_DEPTH:
            return
        if isinstance(original, Tensor):
            self.copy = None if original.is_meta else original.detach().clone()
        elif isinstance(original, (list, tuple, set)):
            self.copy = [_Saved(v, depth + 1) for v in original]
        elif isinstance(original, dict):
            self.copy = [(k, _Saved(v, depth + 1)) for k, v in original.items()]

    def restore(self) -> Any:
        value, saved = self.original, self.copy
        if saved is None:
            return value
        if isinstance(value, Tensor):
            with torch.no_grad():
                if value.shape == saved.shape and value.dtype == saved.dtype:
                    value.copy_(saved)
                else:  # resized in place
                    value.data = saved
        elif isinstance(value, list):
            value[:] = [s.restore() for s in saved]
        elif isinstance(value, set):
            items = [s.restore() for s in saved]
            value.clear()
            value.update(items)
        elif isinstance(value, tuple):
            for s in saved:
                s.restore()
        else:
            items = [(k, s.restore()) for k, s in saved]
            value.clear()
            value.update(items)
        return value


class _ModuleState:
    """One module's attributes and buffers as they were."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.attributes = {k: _Saved(v) for k, v in vars(module).items() if k not in _MODULE_INTERNALS}
        self.buffers = {name: _Saved(b) for name, b in module.named_buffers(recurse=False)}
        self.registered = {kind: dict(getattr(module, kind)) for kind in _REGISTRIES}
        self.non_persistent = set(module._non_persistent_buffers_set)

    def restore(self) -> None:
        state = vars(self.module)
        for name in [k for k in state if k not in _MODULE_INTERNALS and k not in self.attributes]:
            del state[name]  # set by the step
        for name, saved in self.attributes.items():
            state[name] = saved.restore()
        for kind, before in self.registered.items():
            # submodules, buffers and parameters the step registered (a metric created on the first call) go
            registry = getattr(self.module, kind)
            registry.clear()
            registry.update(before)
        self.module._non_persistent_buffers_set.clear()
        self.module._non_persistent_buffers_set.update(self.non_persistent)
        for name, saved in self.buffers.items():
            setattr(self.module, name, saved.restore())


@contextlib.contextmanager
def no_trace(module: nn.Module, device: torch.device) -> Iterator[None]:
    """Inside the block, anything may change ``module``'s state and the RNGs; at its end all is put back.

    Args:
        module: The model whose submodules' attributes and buffers are restored.
        device: This rank's device: its CUDA RNG is restored too.
    """
    saved = [_ModuleState(m) for m in module.modules()]
    python_rng = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_rng = numpy.random.get_state() if numpy is not None else None
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        for state in saved:
            state.restore()
        random.setstate(python_rng)
        if numpy is not None and numpy_rng is not None:
            numpy.random.set_state(numpy_rng)
