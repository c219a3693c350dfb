"""Turning the full model into one stage: other stages' parameters are freed and their modules stood in for.

Every rank runs the user's whole Python step ("predicated execution"). On a stage that does not own them:

- a parameter becomes a non-persistent buffer of the same shape and dtype with all strides zero (one
  element of memory), so code such as ``x + self.pos[:, :T]`` keeps working;
- a module whose calls all start and end inside segments of earlier stages is replaced by a stand-in that
  returns zeros of the shapes its output would have, contiguous, so that in-place arithmetic on them
  (``h = self.wte(idx); h += self.pos[:, :T]``) works (:class:`_Zeros`: one reused buffer per output, re-zeroed
  after a write). User code never sees ``None`` and needs no
  changes. The shapes come, in this order, from the dry run's calls of the module, scaled to the micro-batch
  (:mod:`~lightning_varuna.pipeline.model.call_shapes`: nothing runs); else from the module's forward on meta
  tensors (another sequence length, another call signature); else, where the dry run found the forward cannot
  run on meta (a torch function it calls has no meta kernel for its arguments: a mixture of experts' grouped
  matrix products or ``nonzero``), from the forward on the stage's device with the placeholder weights, without
  autograd, its buffer writes and random numbers discarded. The last two are cached per input signature. Modules
  without parameters whose outputs later segments read (rotary position embeddings, masks) run for real instead,
  when the dry run found that gives the same values (:mod:`~lightning_varuna.pipeline.model.data_flow`).

At the stage's first cut point the received activation replaces the tensor, and at its last one the forward
is cut short, so modules of later stages never run.

A module with parameters another stage holds is never run on their placeholders: called in a segment this stage
runs for real where the dry run did not see it called (a branch its batch did not take), it raises
:class:`UnseenCallError` (:func:`guard_unseen_calls`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.hooks import RemovableHandle

from lightning_varuna.pipeline.model.call_shapes import PLAIN, ShapeRule
from lightning_varuna.pipeline.model.cut import never_compiled, zero_like_shape
from lightning_varuna.pipeline.model.data_flow import SideValue, producer_ancestors
from lightning_varuna.pipeline.model.dry_run import Trace
from lightning_varuna.pipeline.model.partition import Partition

__all__ = [
    "StandIn", "UnseenCallError", "apply_partition", "free_parameter", "given_at_producers", "guard_unseen_calls",
    "install_stand_in",
    "remove_stand_ins", "stand_in_candidates",
]


def free_parameter(root: nn.Module, name: str, device: torch.device | None = None) -> None:
    """Replaces parameter ``name`` (everywhere it is registered) by a zero-stride, non-persistent buffer.

    The placeholder is on ``device`` (default: the parameter's own, which for a meta parameter is meta).
    """
    target = root.get_parameter(name)
    placeholder = zero_like_shape(target.shape, target.dtype, device or target.device)
    for module in root.modules():
        for attr, param in list(module._parameters.items()):
            if param is target:
                del module._parameters[attr]
                module.register_buffer(attr, placeholder, persistent=False)


def _signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """The cache key of a call: the structure of its arguments, tensors by shape and dtype (None: unhashable).

    Other objects than plain values count by their type, as in the dry run's rules
    (:mod:`~lightning_varuna.pipeline.model.call_shapes`): a call given a new cache object each forward still finds
    its entry, and the cache keeps no such object alive.
    """
    if not kwargs and all(isinstance(arg, Tensor) for arg in args):
        # the usual call, block(x): skip the pytree walk, which costs more than the rest of the stand-in
        return tuple((arg.shape, arg.dtype) for arg in args)
    leaves, spec = tree_flatten((args, kwargs))
    key: list[Any] = [spec]
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            key.append((tuple(leaf.shape), leaf.dtype))
        elif not isinstance(leaf, PLAIN):
            key.append(type(leaf))
        else:
            try:
                hash(leaf)
            except TypeError:
                return None
            key.append(leaf)
    try:
        hash(tuple(key))
    except TypeError:
        return None
    return tuple(key)


class StandIn:
    """Replaces a module's ``forward``: runs it for real in owned segments, by shape only elsewhere."""

    def __init__(self, module: nn.Module, owned: range | frozenset[int], segment: Callable[[], int],
                 device: torch.device, rules: tuple[ShapeRule, ...] = (), name: str = "", on_meta: bool = True):
        self.module = module
        self.rules = rules
        """The dry run's calls of the module (:mod:`~lightning_varuna.pipeline.model.call_shapes`)."""
        self.name = name or type(module).__name__
        self.on_meta = on_meta
        """Whether its forward may run on meta tensors (False where the dry run found it cannot, or once it failed
        there: a forward that failed halfway may have written objects it was given, so it is not tried again)."""
        self.forward = module.forward
        # a compiled module (Module.compile) would compile this stand-in's Python too: it runs uncompiled
        self.compiled_call = module.__dict__.get("_compiled_call_impl")
        self.owned = owned
        self.segment = segment
        self.device = device
        self._cache: dict[tuple[Any, ...], tuple[list[Any], Any]] = {}
        """Per call signature: the output's leaves as (shape, dtype) or (value, None), and its tree structure
        (None for a single tensor)."""
        self._zeros: dict[tuple[int, torch.dtype], _Zeros] = {}
        """Per output leaf (its position and dtype): the zeros handed out for it."""

    @never_compiled  # inside a compiled caller: runs as Python (it computes nothing in other segments)
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The module's output: real in an owned segment, contiguous zeros of the right shapes elsewhere."""
        if self.segment() in self.owned:
            return self.forward(*args, **kwargs)
        key = _signature(args, kwargs)
        entry = self._cache.get(key) if key is not None else None
        if entry is None:
            entry = next((found for rule in self.rules if (found := rule.output(args, kwargs)) is not None), None)
            if entry is None:
                entry = self._shapes(args, kwargs)
                if key is not None and len(self._cache) < 64:
                    self._cache[key] = entry
        specs, tree = entry
        if tree is None:  # a single tensor
            shape, dtype = specs[0]
            return self._zeros_for(0, dtype).get(shape)
        leaves = [self._zeros_for(k, d).get(s) if isinstance(s, tuple) else s for k, (s, d) in enumerate(specs)]
        return tree_unflatten(leaves, tree)

    def _zeros_for(self, leaf: int, dtype: torch.dtype) -> _Zeros:
        zeros = self._zeros.get((leaf, dtype))
        if zeros is None:
            zeros = self._zeros[(leaf, dtype)] = _Zeros(dtype, self.device)
        return zeros

    def _shapes(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
        meta_error: Exception | None = None
        if self.on_meta:
            try:
                return self._meta_shapes(args, kwargs)
            except Exception as err:  # noqa: BLE001 - any op that cannot run on meta: the placeholder run decides
                meta_error = err
                self.on_meta = False
        try:
            return self._placeholder_shapes(args, kwargs)
        except Exception as err:
            why = f" (on meta tensors it failed with {type(meta_error).__name__}: {meta_error})" if meta_error else ""
            raise RuntimeError(
                f"The output shapes of {self.name}, a module of an earlier pipeline stage this stage stands in for,"
                f" could not be worked out for a call the dry run did not see: its forward failed on this stage's"
                f" device with the other stages' weights as placeholders{why}. Each call's output shapes must depend"
                " on its arguments' shapes only."
            ) from err

    def _placeholder_shapes(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
        """The shapes from the module's forward on the real arguments, the weights as they are on this stage."""
        # the stage's own computation must not change: buffer writes go to copies, random numbers are drawn from a
        # forked generator, and nothing is recorded for autograd
        buffers = {name: t.clone() for name, t in self.module.named_buffers()}
        devices = [self.device] if self.device.type == "cuda" else []
        with (torch.no_grad(), torch.random.fork_rng(devices, device_type=self.device.type),
              _reparametrize_module(self.module, buffers)):
            out = self.forward(*args, **kwargs)
        return _specs(out)

    def _meta_shapes(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
        def to_meta(value: Any) -> Any:
            return torch.empty(value.shape, dtype=value.dtype, device="meta") if isinstance(value, Tensor) else value

        state = {name: to_meta(t) for name, t in self.module.state_dict(keep_vars=True).items()}
        state.update({name: to_meta(t) for name, t in self.module.named_buffers()})
        # call the module's own forward (not __call__): its hooks, cut points included, belong to the real call
        with _reparametrize_module(self.module, state):
            out = self.forward(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
        return _specs(out)


def _specs(out: Any) -> tuple[list[Any], Any]:
    """A stand-in's cache entry for output ``out``: its leaves as (shape, dtype) or (value, None), and its tree."""
    if isinstance(out, Tensor):
        return [(tuple(out.shape), out.dtype)], None
    leaves, tree = tree_flatten(out)
    specs = [(tuple(v.shape), v.dtype) if isinstance(v, Tensor) else (v, None) for v in leaves]
    return specs, tree


class _Zeros:
    """Contiguous zeros of any shape for one output leaf of a stand-in, without an allocation per call.

    One flat buffer, grown to the largest shape asked for, is handed out as a fresh detached view per call, so that
    in-place arithmetic on a stood-in module's output works as on the real one's (a zero-stride tensor refuses it:
    "more than one element of the written-to tensor refers to a single memory location"). Every call sees zeros: a
    write by user code bumps the buffer's version counter (shared by all its views), and the next call re-zeroes
    it, so the write never reaches a later call. The detached view keeps autograd off the buffer: an in-place
    ``+=`` of a tensor that requires grad gives that call's view a graph, never the buffer. The values are
    placeholders: the stage's first cut point replaces them with the received activation, so calls of one module
    within a forward may share the memory.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self.flat = self._allocate(0)
        self.clean = self.flat._version
        self.views: dict[tuple[int, ...], Tensor] = {}

    def _allocate(self, numel: int) -> Tensor:
        # a normal tensor even when first asked for under inference mode (validation): an inference tensor has no
        # version counter, and training could not write to it
        with torch.inference_mode(False):
            return torch.zeros(numel, dtype=self.dtype, device=self.device)

    def get(self, shape: tuple[int, ...]) -> Tensor:
        """Zeros of ``shape``: a new tensor object on the shared memory (an O(1) view, no allocation)."""
        view = self.views.get(shape)
        if view is None:
            numel = math.prod(shape)
            if numel > self.flat.numel():
                self.flat, self.views = self._allocate(numel), {}
                self.clean = self.flat._version
            if len(self.views) >= 64:  # shapes that keep changing: bounded, as the signature cache is
                self.views.clear()
            view = self.views[shape] = self.flat[:numel].view(shape)
        if self.flat._version != self.clean:  # written in place since the last call: zeroed again, once
            with torch.no_grad():
                self.flat.zero_()
            self.clean = self.flat._version
        return view.detach()


def stand_in_candidates(trace: Trace, first_segment: int) -> set[str]:
    """Modules a stage whose segments start at ``first_segment`` stands in for (the outermost of them get one).

    Those called in an earlier segment, except the ones recomputed on every stage (they have no parameters and
    a later segment uses their output, see :mod:`~lightning_varuna.pipeline.model.data_flow`).
    """
    return {
        name for name, segments in trace.module_segments.items()
        if name and min(segments) < first_segment and name not in trace.recomputed
    }


def _outermost(names: set[str]) -> list[str]:
    return [n for n in sorted(names) if not any(n.startswith(other + ".") for other in names if other != n)]


def apply_partition(
    root: nn.Module, partition: Partition, rank: int, segment: Callable[[], int], device: torch.device
) -> list[StandIn]:
    """Makes ``root`` hold only pipeline rank ``rank``'s parameters and stand-ins for other stages' modules.

    With several stages per rank, a module of one of the rank's earlier stages is stood in for during a later
    stage's forward: ``segment`` returns -1 there (see
    :meth:`~lightning_varuna.pipeline.runtime.executor.StageExecutor.segment`).

    Args:
        root: The full model (the LightningModule).
        partition: The partition partition (identical on every rank).
        rank: This rank's position in the pipeline (its stage with one stage per rank).
        segment: Returns the segment the running forward runs for real in (-1: none).
        device: Device of the stand-ins' outputs.

    Returns:
        The stand-ins installed.
    """
    stages = partition.rank_stages(rank)
    owned = frozenset(seg for s in stages for seg in partition.stages[s].segments)
    keep = set(partition.rank_params(rank))
    guard_unseen_calls(root, partition, rank, owned, segment)  # before freeing: it finds the parameters by identity
    for name, _ in list(root.named_parameters()):
        if name not in keep:
            free_parameter(root, name, device)
    candidates = stand_in_candidates(partition.trace, partition.stages[stages[-1]].segments.start)
    candidates -= producer_ancestors(given_at_producers(partition, rank))
    stand_ins = []
    for name in _outermost(candidates):
        module = root.get_submodule(name)
        stand_in = StandIn(module, owned, segment, device, partition.trace.call_shapes.get(name, ()), name,
                           name not in partition.trace.not_on_meta)
        install_stand_in(stand_in)
        stand_ins.append(stand_in)
    return stand_ins


def given_at_producers(partition: Partition, rank: int) -> list[SideValue]:
    """The side values a stage of ``rank`` reads in its step's code and gets at their producers' outputs.

    The rank runs their producers' ancestors (so that the producer is called where the step's code expects it), and
    stands in for the producer and the rest one by one (:attr:`SideValue.step_reads`).
    """
    given = []
    for s in partition.rank_stages(rank):
        segments = partition.stages[s].segments
        given += [v for v in partition.trace.side_values
                  if v.producer.segment < segments.start and any(r in segments for r in v.step_reads)]
    return list(dict.fromkeys(given))


class UnseenCallError(RuntimeError):
    """A module ran where the dry run did not see it, on a stage that holds only placeholders of its parameters."""


def guard_unseen_calls(root: nn.Module, partition: Partition, rank: int, owned: frozenset[int],
                       segment: Callable[[], int]) -> list[RemovableHandle]:
    """Makes each module whose own parameters another stage holds raise if this rank runs it in an unseen segment.

    Such a module ran, in the dry run, only in other stages' segments (or never: a branch the dry run's batch did
    not take). Run in a segment of this rank's, it would compute with the zero-stride placeholders
    :func:`free_parameter` leaves, silently wrong. Modules whose calls cross a cut point (the model itself) are not
    guarded: their forward is the step's own code.

    Returns:
        The forward pre-hooks' handles (the guards last as long as the stage).
    """
    names = {id(p): name for name, p in root.named_parameters()}
    keep = set(partition.rank_params(rank))
    holders = {name: s for s in reversed(range(len(partition.stages))) for name in partition.stages[s].params}
    stage_of = {seg: s for s in partition.rank_stages(rank) for seg in partition.stages[s].segments}
    handles = []
    for module_name, module in root.named_modules():
        if module_name in partition.trace.spanning or module_name in partition.trace.recomputed:
            continue
        foreign = [names[id(p)] for p in module._parameters.values()
                   if p is not None and id(p) in names and names[id(p)] not in keep]
        if foreign:
            seen = frozenset(partition.trace.module_segments.get(module_name, ()))
            where = sorted({holders.get(name, 0) for name in foreign})
            hook = _UnseenCall(module_name or type(module).__name__, type(module).__name__, foreign, where, stage_of,
                               seen, segment)
            handles.append(module.register_forward_pre_hook(hook))
    return handles


class _UnseenCall:
    """The forward pre-hook of :func:`guard_unseen_calls`: O(1) per call, and called only on other stages' modules."""

    def __init__(self, name: str, kind: str, params: list[str], holders: list[int], stage_of: dict[int, int],
                 seen: frozenset[int], segment: Callable[[], int]) -> None:
        self.name, self.kind, self.params, self.holders, self.stage_of = name, kind, params, holders, stage_of
        self.seen, self.segment = seen, segment

    @never_compiled
    def __call__(self, module: nn.Module, args: Any) -> None:
        """Raises :class:`UnseenCallError` if the module runs in a segment of this rank the dry run did not see."""
        current = self.segment()
        if current not in self.stage_of or current in self.seen:
            return
        held_by = ", ".join(f"stage {s}" for s in self.holders)
        seen = (f"only in segment(s) {', '.join(map(str, sorted(self.seen)))}" if self.seen
                else "never (its batch did not take the branch that calls it)")
        params = ", ".join(self.params[:4]) + (f" and {len(self.params) - 4} more" if len(self.params) > 4 else "")
        raise UnseenCallError(
            f"Stage {self.stage_of[current]} called {self.name} ({self.kind}) in segment {current}, a call the dry run"
            f" did not see: it called it {seen}, so its parameters ({params}) are held by {held_by} and this stage"
            " has only placeholders of them; the step would compute with those, silently wrong. Calls that depend on"
            " the data (an `if` on the batch, optional heads, experts) must be seen by the dry run, which runs the"
            " first batch of the dataloader: make that batch take every branch, or call the module on every batch"
            " and mask its effect (e.g. `h = torch.where(flag, self.extra(h), h)`)."
        )


def install_stand_in(stand_in: StandIn) -> None:
    """Makes ``stand_in`` its module's ``forward``, and the module's calls uncompiled."""
    stand_in.module.forward = stand_in
    if stand_in.compiled_call is not None:
        stand_in.module._compiled_call_impl = None


def remove_stand_ins(stand_ins: list[StandIn]) -> None:
    """Gives the modules their own ``forward`` back."""
    for stand_in in stand_ins:
        if stand_in.module.__dict__.get("forward") is stand_in:
            del stand_in.module.__dict__["forward"]
        if stand_in.compiled_call is not None:
            stand_in.module._compiled_call_impl = stand_in.compiled_call
