"""The dry run: the user's whole step on a tiny batch, observed without guessing.

It records:

- the cut points in execution order, and the shape of the tensor at each one (with batch 1 and 2, to learn
  which dimension scales with the batch);
- which parameters each segment uses (a ``TorchFunctionMode`` sees every parameter passed to a torch
  function), so a parameter used on two stages (a tied embedding and head) is found automatically;
- which module calls start and end inside one segment (those can be replaced by stand-ins on other stages), and
  their arguments' and outputs' shapes (:mod:`~lightning_varuna.pipeline.model.call_shapes`: the stand-ins' shapes);
- values that flow from one segment to a later one without passing through a cut point: a skip connection
  across a cut cannot be split there, and side inputs made by modules without parameters (rotary position
  embeddings, masks) are recomputed on the later stage when that gives the same values
  (:mod:`~lightning_varuna.pipeline.model.data_flow`), else cannot be split there either;
- what each segment costs: forward FLOPs and saved-activation bytes
  (:mod:`~lightning_varuna.pipeline.model.segment_costs`).

It works on real tensors or on the meta device (a model built there, see
:mod:`~lightning_varuna.pipeline.model.meta_init`): it reads shapes, never values. The result is a :class:`Trace`,
which :mod:`~lightning_varuna.pipeline.model.partition` groups into stages.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from lightning_varuna.pipeline.model.call_shapes import (
    CallRecord,
    ShapeRule,
    autocast_state,
    describe_call,
    runs_on_meta,
    shape_rules,
)
from lightning_varuna.pipeline.model.cut import CutPoint, CutPointError, forward_handler
from lightning_varuna.pipeline.model.data_flow import DataFlow, SideValue, producer_ancestors
from lightning_varuna.pipeline.model.segment_costs import CostCounter, SegmentCost, fit_costs

__all__ = ["CutInfo", "PartitionError", "TIMED_RUNS", "Trace", "time_segments", "trace_step"]


TIMED_RUNS = 3
"""How many times the dry run times a micro-batch's forward; each segment's fastest run counts."""


class PartitionError(ValueError):
    """The model cannot be split as asked; the message says what to change."""


@dataclass(frozen=True)
class CutInfo:
    """What flows through one cut point."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    batch_dim: int | None


@dataclass
class Trace:
    """What the dry run saw. Picklable, so one rank's trace can be shared with all."""

    cuts: list[CutInfo]
    param_segments: dict[str, set[int]]
    param_numel: dict[str, int]
    module_segments: dict[str, set[int]]
    crossings: dict[tuple[int, int], str] = field(default_factory=dict)
    """Pairs of segments that must share a stage: ``(from, to) -> the value that crosses`` (see
    :mod:`~lightning_varuna.pipeline.model.data_flow`)."""
    recomputed: set[str] = field(default_factory=set)
    """Modules without parameters whose outputs later segments use: every stage runs them (none stands in)."""
    spanning: set[str] = field(default_factory=set)
    """Modules with a call that crossed a cut point (the model, a stack of blocks)."""
    side_values: list[SideValue] = field(default_factory=list)
    """Values later segments use other than through a cut point, that the stages transport with the activation
    (see :mod:`~lightning_varuna.pipeline.model.data_flow`)."""
    segment_seconds: list[float] = field(default_factory=list)
    """Measured forward time of each segment (empty when not timed, e.g. on the meta device)."""
    call_shapes: dict[str, tuple[ShapeRule, ...]] = field(default_factory=dict)
    """Of each module a stage may stand in for: its calls' output shapes by micro-batch size (see
    :mod:`~lightning_varuna.pipeline.model.call_shapes`)."""
    not_on_meta: set[str] = field(default_factory=set)
    """Modules whose forward cannot run on meta tensors (a torch function they call cannot): their stand-ins never
    try."""
    costs: list[SegmentCost] = field(default_factory=list)
    """Each segment's counted cost (FLOPs, saved activations, parameter bytes)."""
    param_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes of each parameter."""
    skipped: bool = False
    """Whether the step returned None before reaching any cut point (it skipped the dry run's batch)."""
    dry_run: str = "real"
    """What the dry run ran on: ``"real"`` tensors, ``"meta"`` tensors, or ``"placeholders (...)"``: the batch with
    zero-stride weights, where the step could not run on meta (the reason follows)."""

    @property
    def num_segments(self) -> int:
        """Number of segments: one more than the number of cut points."""
        return len(self.cuts) + 1


class _Tracer:
    """Counts cut points during a dry run and records everything :class:`Trace` holds."""

    def __init__(self, module: nn.Module, cut_names: dict[int, str]) -> None:
        self.cut_names = cut_names
        self.segment = 0
        self.costs = CostCounter(lambda: self.segment)
        self.cut_order: list[CutPoint] = []
        self.cut_tensors: list[Tensor] = []
        self.module_names = {id(m): name for name, m in module.named_modules()}
        self.param_names = {id(p): name for name, p in module.named_parameters()}
        self.param_segments: dict[str, set[int]] = {}
        self.module_segments: dict[str, set[int]] = {}
        self.spanning: set[str] = set()
        self._stack: list[list[Any]] = []
        """Per module call running: its name, its segment and its arguments (:func:`describe_call`)."""
        self.calls: dict[str, list[CallRecord]] = {}
        self.not_on_meta: set[str] = set()
        self.paused = False
        self.returned_nothing = False
        self.flow = DataFlow(module, lambda: self.segment)

    def on_cut(self, cut: CutPoint, x: Tensor) -> Tensor:
        if any(seen is cut for seen in self.cut_order):
            raise CutPointError(
                f"{self._name(cut)} was called twice in one forward. Each CutPoint marks one place; create one"
                " CutPoint per place (e.g. an nn.ModuleList of them)."
            )
        self.cut_order.append(cut)
        self.costs.settle()
        self.paused = True
        try:
            self.cut_tensors.append(x.detach())
            out = x.view_as(x)
        finally:
            self.paused = False
        self.segment += 1
        self.flow.cut_output(out, x)
        return out

    def _name(self, cut: CutPoint) -> str:
        return str(getattr(cut, "_varuna_name", None) or self.module_names.get(id(cut), "a CutPoint"))

    def pre_hook(self, module: nn.Module, args: object) -> None:
        name = self.module_names.get(id(module))
        if name is not None:
            self._stack.append([name, self.segment, None])
            self.flow.enter(module)

    def arguments(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The arguments of the module call that just started (a forward pre-hook that sees keywords)."""
        self.flow.arguments(module, args, kwargs)
        if self._stack and self._stack[-1][0] == self.module_names.get(id(module)):
            self._stack[-1][2] = (describe_call((args, kwargs)), autocast_state())

    def post_hook(self, module: nn.Module, args: object, output: object) -> None:
        name = self.module_names.get(id(module))
        if name is None or not self._stack:
            return
        _, start, arguments = self._stack.pop()
        if start == self.segment:
            self.module_segments.setdefault(name, set()).add(start)
            if arguments is not None:
                self.calls.setdefault(name, []).append(CallRecord(arguments[0], describe_call(output), arguments[1]))
        else:
            self.spanning.add(name)
        self.flow.exit(module, output)

    def uses_parameters(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Records the parameters a torch function is given; returns whether it is given any."""
        uses = False
        for value in tree_leaves((args, kwargs)):
            name = self.param_names.get(id(value)) if isinstance(value, nn.Parameter) else None
            if name is not None:
                self.param_segments.setdefault(name, set()).add(self.segment)
                uses = True
        return uses


class _TraceMode(TorchFunctionMode):
    def __init__(self, tracer: _Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func: Callable[..., Any], types: Collection[type], args: tuple[Any, ...] = (),  # noqa: D105
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        tracer = self.tracer
        if tracer.paused:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        derived = tracer.flow.before(name, args, kwargs, tracer.uses_parameters(args, kwargs))
        out = func(*args, **kwargs)
        tracer.flow.after(name, derived, out)
        stack = tracer._stack
        if stack and stack[-1][0] not in tracer.not_on_meta and not runs_on_meta(func, args, kwargs):
            tracer.not_on_meta.update(call[0] for call in stack)
        return out


class _Timer:
    """Times segments of a forward by the moments cut points are reached."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def on_cut(self, cut: CutPoint, x: Tensor) -> Tensor:
        self.marks.append(time.perf_counter())
        return x


def _run_traced(module: nn.Module, step: Callable[[], object], cut_names: dict[int, str]) -> _Tracer:
    tracer = _Tracer(module, cut_names)
    pre = nn.modules.module.register_module_forward_pre_hook(tracer.pre_hook)
    post = nn.modules.module.register_module_forward_hook(tracer.post_hook)
    # the global pre-hook sees no keyword arguments: each module's own hook records its call's arguments
    arguments = [m.register_forward_pre_hook(tracer.arguments, with_kwargs=True) for m in module.modules()]
    try:
        # compiled modules run eagerly: the tracer must see every torch function and module call
        with forward_handler(tracer), _TraceMode(tracer), tracer.costs, torch.compiler.set_stance("force_eager"):
            # only whether the step returned anything is kept: its result holds the step's autograd graph, whose
            # saved tensors hold the cost counter's pack hook, which holds this tracer (a cycle through C++ that
            # the garbage collector cannot see, so the dry run's activations would outlive it)
            tracer.returned_nothing = step() is None
    finally:
        pre.remove()
        post.remove()
        for handle in arguments:
            handle.remove()
    return tracer


def _batch_dim(small: Tensor, large: Tensor, name: str) -> int | None:
    if small.dim() != large.dim():
        raise PartitionError(f"The tensor at {name} changes rank with the batch size; a cut needs a fixed rank.")
    differing = [d for d in range(small.dim()) if small.shape[d] != large.shape[d]]
    if not differing:
        return None
    if len(differing) > 1 or large.shape[differing[0]] != 2 * small.shape[differing[0]]:
        raise PartitionError(
            f"The tensor at {name} has shape {tuple(small.shape)} for batch 1 and {tuple(large.shape)} for batch 2;"
            " exactly one dimension may scale with the batch."
        )
    return differing[0]


def _side_values(one: DataFlow, two: DataFlow) -> list[SideValue]:
    """The side values of the two dry runs (batch 1 and 2), in the order of their producers."""
    small, large = one.side_values(), two.side_values()
    values = []
    for producer in sorted(large):
        reads = large[producer]
        seen = small.get(producer)
        if seen is None or (seen.consumers, seen.step_reads) != (reads.consumers, reads.step_reads):
            raise PartitionError(
                f"The output of {producer.module} is used by later segments differently with a batch of 1 and of 2"
                " (other module calls, or only once): the model's data flow must not depend on the batch size."
            )
        tensor = reads.value
        users = sorted({c.module for c in reads.consumers})
        if reads.step_reads:
            users.append(f"the step's code in segment(s) {', '.join(map(str, sorted(reads.step_reads)))}")
        values.append(SideValue(
            producer=producer, consumers=tuple(sorted(reads.consumers)), shape=tuple(tensor.shape),
            dtype=tensor.dtype, batch_dim=_batch_dim(seen.value, tensor, f"the output of {producer.module}"),
            what=f"A tensor ({tuple(tensor.shape)} {tensor.dtype}) made by {producer.module} in segment"
                 f" {producer.segment} and used by {', '.join(users)}",
            step_reads=tuple(sorted(reads.step_reads)),
        ))
    return values


def _stand_in_roots(module_segments: dict[str, set[int]], recomputed: set[str], values: list[SideValue]) -> set[str]:
    """The modules that get a stand-in on some stage.

    Those within one segment per call, no ancestor of which is; and on a stage that gives a value at its producer's
    output, those within its producer's ancestors.
    """
    candidates = {name for name in module_segments if name and name not in recomputed}

    def roots(names: set[str]) -> set[str]:
        return {name for name in names
                if not any(".".join(name.split(".")[:end]) in names for end in range(1, name.count(".") + 1))}

    run = producer_ancestors(v for v in values if v.step_reads)
    return roots(candidates) | (roots(candidates - run) if run else set())


def time_segments(timed_step: Callable[[], object]) -> list[float]:
    """Each segment's forward time in seconds: the fastest of :data:`TIMED_RUNS` runs of ``timed_step``.

    The partition is only as good as these times, and one run on a busy machine can be preempted inside any segment:
    each segment's fastest run counts (the first also pays one-off warm-up costs).

    Args:
        timed_step: Runs the step on a realistic micro-batch (it is run without autograd).
    """
    seconds: list[float] = []
    for _ in range(TIMED_RUNS):
        timer = _Timer()
        with forward_handler(timer), torch.no_grad():
            start = time.perf_counter()
            timed_step()
            end = time.perf_counter()
        marks = [start, *timer.marks, end]
        run = [max(b - a, 0.0) for a, b in zip(marks, marks[1:])]
        seconds = run if not seconds else [min(a, b) for a, b in zip(seconds, run)]
    return seconds


def trace_step(
    module: nn.Module,
    step_on: Callable[[int], object],
    timed_step: Callable[[], object] | None = None,
    cut_names: dict[int, str] | None = None,
) -> tuple[Trace, list[CutPoint]]:
    """Dry-runs a step and records cut points, parameter use, module calls and segment times.

    Args:
        module: The full model (every parameter present).
        step_on: Runs the user's step on the first ``n`` samples of a batch, for ``n`` in (1, 2).
        timed_step: Runs the step on a realistic micro-batch without autograd, to time the segments
            (:func:`time_segments`). If not given, segment costs are left empty and parameter counts are used
            to balance.
        cut_names: Readable names of cut points that are not submodules of ``module``.

    Returns:
        The trace and the cut point modules in execution order. Raises :class:`CutPointError` or
        :class:`PartitionError` for models that cannot be cut.
    """
    cut_names = cut_names or {}
    one = _run_traced(module, lambda: step_on(1), cut_names)
    two = _run_traced(module, lambda: step_on(2), cut_names)
    if [id(c) for c in one.cut_order] != [id(c) for c in two.cut_order]:
        first = ", ".join(one._name(c) for c in one.cut_order)
        second = ", ".join(two._name(c) for c in two.cut_order)
        raise CutPointError(
            f"Cut points were reached in a different order in two forwards: [{first}] with a batch of 1, then"
            f" [{second}] with a batch of 2. Cut points must run in the same order every time; keep"
            " data-dependent control flow inside a segment."
        )
    cuts = []
    for cut, small, large in zip(one.cut_order, one.cut_tensors, two.cut_tensors):
        name = one._name(cut)
        if not small.is_floating_point():
            raise CutPointError(f"{name} got a {small.dtype} tensor; a cut point needs a floating-point activation.")
        cuts.append(CutInfo(name, tuple(large.shape), large.dtype, _batch_dim(small, large, name)))
    seconds = time_segments(timed_step) if timed_step is not None and cuts else []
    params = dict(module.named_parameters())
    numel = {name: p.numel() for name, p in params.items()}
    module_segments = {k: v for k, v in two.module_segments.items() if k not in two.spanning}
    two.flow.unclean |= one.flow.unclean
    one.flow.unclean = two.flow.unclean
    recomputed, crossings = two.flow.recomputed(module_segments)
    one.flow.recomputed(module_segments)
    side_values = _side_values(one.flow, two.flow)
    trace = Trace(
        param_bytes={name: p.numel() * p.element_size() for name, p in params.items()},
        cuts=cuts,
        param_segments=two.param_segments,
        param_numel=numel,
        module_segments=module_segments,
        crossings=crossings,
        recomputed=recomputed,
        spanning=two.spanning | one.spanning,
        side_values=side_values,
        segment_seconds=seconds,
        not_on_meta=one.not_on_meta | two.not_on_meta,
        call_shapes={name: rules for name in _stand_in_roots(module_segments, recomputed, side_values)
                     if (rules := shape_rules(one.calls.get(name, []), two.calls.get(name, [])))},
        skipped=not cuts and one.returned_nothing,
        costs=fit_costs(one.costs, two.costs, two.param_segments, params, len(cuts) + 1),
    )
    return trace, list(one.cut_order)
