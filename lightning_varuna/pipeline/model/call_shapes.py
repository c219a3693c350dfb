"""The output shapes of module calls as the dry run saw them, scaled to any micro-batch size without running anything.

A stage stands in for the modules of earlier stages (:mod:`~lightning_varuna.pipeline.model.stand_ins`): it needs
their outputs' shapes, not their values. Running a module on meta tensors gives those shapes for most code, but not
for code whose shapes depend on values: a mixture of experts sorts its tokens by expert and multiplies groups of
them (``torch._grouped_mm``, whose meta kernel takes bf16 only) or loops over the experts that got tokens
(``nonzero``, which has no meta kernel). The dry run ran every module for real, with a batch of 1 and of 2 samples:

- :func:`describe_call` records each call's arguments and output (tensors by shape and dtype);
- :func:`shape_rules` pairs the two runs' calls of a module into :class:`ShapeRule` s: which dimensions of each
  argument and output scale with the batch (exactly twice as large with 2 samples), everything else fixed;
- :meth:`ShapeRule.output` answers a later call whose arguments equal a rule's but for those dimensions, scaled
  alike: the output's batch dimensions scale by the same factor.

A call no rule answers (another sequence length under dynamic padding, another call signature) is left to the
stand-in's other ways: the module's forward on meta tensors, or where that cannot work, on the placeholder weights.
Which modules cannot run on meta the dry run finds without running any module on meta: :func:`runs_on_meta` tries
each torch function the dry run calls once more on meta copies of its arguments (a failed try changes nothing, as
a module's forward failing halfway on meta would: it may have written a cache object it was given).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map

__all__ = ["PLAIN", "CallRecord", "ShapeRule", "autocast_state", "describe_call", "runs_on_meta", "shape_rules"]

PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)
"""Argument values compared by value; any other object is compared by its type (a cache object, a config)."""

Leaf = tuple[str, Any, Any]
"""One leaf of a call's arguments or output: ``("tensor", shape, dtype)``, ``("value", value, None)`` or
``("object", type, None)``."""


@dataclass(frozen=True)
class CallRecord:
    """One call of a module as the dry run saw it."""

    args: tuple[TreeSpec, tuple[Leaf, ...]]
    output: tuple[TreeSpec, tuple[Leaf, ...]]
    autocast: tuple[Any, ...]
    """:func:`autocast_state` during the call: it decides the output's dtypes as much as the arguments do."""


def autocast_state() -> tuple[Any, ...]:
    """Whether autocast is on, and its dtype, for CPU and CUDA (part of what decides a call's output dtypes)."""
    return tuple((kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda"))


def runs_on_meta(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether torch function ``func`` runs on meta copies of its tensor arguments (True without any).

    A function without a meta kernel (``nonzero``), one whose meta kernel refuses what its device kernel takes
    (``torch._grouped_mm`` on float32), or one that reads values (``item``, ``bool``) fails there.
    """
    def to_meta(value: Any) -> Any:
        if isinstance(value, Tensor) and not value.is_meta:
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
        return value

    copies = tree_map(to_meta, (args, kwargs))
    if not any(isinstance(v, Tensor) and v is not o for v, o in zip(tree_flatten(copies)[0],
                                                                       tree_flatten((args, kwargs))[0])):
        return True  # nothing to try: no real tensor among its arguments
    # the dry run's cost counter (a dispatch mode) must not count the try, nor autograd save anything for it
    with _disable_current_modes(), torch.no_grad():
        try:
            func(*copies[0], **copies[1])
        except Exception:  # noqa: BLE001 - any error: the function cannot run on meta
            return False
    return True


def _leaf(value: Any) -> Leaf:
    if isinstance(value, Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, PLAIN):
        return ("value", value, None)
    return ("object", type(value), None)


def describe_call(tree: Any) -> tuple[TreeSpec, tuple[Leaf, ...]]:
    """A call's arguments ``(args, kwargs)`` or its output: the tree's structure and its leaves."""
    leaves, spec = tree_flatten(tree)
    return spec, tuple(_leaf(leaf) for leaf in leaves)


def _scaling(small: tuple[Leaf, ...], large: tuple[Leaf, ...]) -> tuple[tuple[int, ...] | None, ...] | None:
    """Per leaf, the dimensions that are twice as large with 2 samples as with 1 (None: not a tensor).

    None if a leaf changes otherwise (another dtype or rank, a dimension that grows another way, another value).
    """
    dims: list[tuple[int, ...] | None] = []
    for one, two in zip(small, large, strict=True):
        if one[0] != two[0] or one[2] != two[2]:
            return None
        if one[0] != "tensor":
            if one[1] != two[1]:
                return None
            dims.append(None)
            continue
        if len(one[1]) != len(two[1]):
            return None
        scaled = tuple(d for d, (a, b) in enumerate(zip(one[1], two[1])) if a != b)
        if any(two[1][d] != 2 * one[1][d] for d in scaled):
            return None
        dims.append(scaled)
    return tuple(dims)


@dataclass(frozen=True)
class ShapeRule:
    """A module call's output shapes as a function of the micro-batch size (see the module docstring)."""

    spec: TreeSpec
    leaves: tuple[Leaf, ...]
    """The arguments' leaves with 1 sample."""
    scaled: tuple[tuple[int, ...] | None, ...]
    """Per argument leaf, the dimensions that scale with the batch."""
    out_spec: TreeSpec
    out_leaves: tuple[Leaf, ...]
    """The output's leaves with 1 sample."""
    out_scaled: tuple[tuple[int, ...] | None, ...]
    autocast: tuple[Any, ...]

    def output(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], TreeSpec] | None:
        """The output of a call with these arguments, as a stand-in's cache entry (None: the rule does not apply).

        Returns:
            The output's leaves as ``(shape, dtype)`` for tensors or ``(value, None)``, and its tree structure.
        """
        leaves, spec = tree_flatten((args, kwargs))
        if len(leaves) != len(self.leaves) or spec != self.spec or autocast_state() != self.autocast:
            return None
        factor = None
        for value, (kind, reference, dtype), scaled in zip(leaves, self.leaves, self.scaled, strict=True):
            if kind == "tensor":
                if not isinstance(value, Tensor) or value.dtype != dtype or value.dim() != len(reference):
                    return None
                for d, (size, base) in enumerate(zip(value.shape, reference)):
                    if scaled is not None and d in scaled:
                        if size % base or (factor is not None and size // base != factor):
                            return None
                        factor = size // base
                    elif size != base:
                        return None
            elif _leaf(value) != (kind, reference, dtype):
                return None
        if factor is None and any(self.out_scaled):
            return None  # the output scales with the batch, but no argument says how large it is
        specs: list[Any] = []
        for (kind, reference, dtype), scaled in zip(self.out_leaves, self.out_scaled, strict=True):
            if kind != "tensor":
                specs.append((reference, None))
                continue
            shape = tuple(s * factor if scaled and d in scaled and factor is not None else s
                          for d, s in enumerate(reference))
            specs.append((shape, dtype))
        return specs, self.out_spec


def shape_rules(one: list[CallRecord], two: list[CallRecord]) -> tuple[ShapeRule, ...]:
    """The rules of one module from its calls with 1 and with 2 samples, in call order.

    A module whose calls differ in number between the two runs gets none; a call whose output holds an object (not
    a tensor or a plain value) gets none, as the stand-in could only hand back the dry run's object; two calls with
    the same arguments but different outputs (a module with state) get none. Their stand-ins work the shapes out
    otherwise.
    """
    if len(one) != len(two):
        return ()
    rules: dict[tuple[Any, ...], ShapeRule | None] = {}
    for small, large in zip(one, two, strict=True):
        if small.args[0] != large.args[0] or small.output[0] != large.output[0] or small.autocast != large.autocast:
            return ()
        scaled = _scaling(small.args[1], large.args[1])
        out_scaled = _scaling(small.output[1], large.output[1])
        if scaled is None or out_scaled is None or any(leaf[0] == "object" for leaf in small.output[1]):
            return ()
        rule = ShapeRule(small.args[0], small.args[1], scaled, small.output[0], small.output[1], out_scaled,
                         small.autocast)
        key = (repr(rule.spec), rule.leaves, rule.scaled, rule.autocast)
        if key in rules and rules[key] != rule:
            return ()  # the same arguments gave different outputs: the rule would depend on the call's order
        rules[key] = rule
    return tuple(rule for rule in rules.values() if rule is not None)
