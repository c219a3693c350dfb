"""Partitioning: a dry run finds the segments between cut points, and segments are grouped into stages.

The dry run runs the user's whole step on a tiny batch and observes, without guessing:

- the cut points in execution order, and the shape of the tensor at each one (with batch 1 and 2, to learn
  which dimension scales with the batch);
- which parameters each segment uses (a ``TorchFunctionMode`` sees every parameter passed to a torch
  function), so a parameter used on two stages (a tied embedding and head) is found automatically;
- which module calls start and end inside one segment (those can be replaced by stand-ins on other stages);
- values that flow from one segment to a later one without passing through a cut point: a skip connection
  across a cut cannot be split there, and side inputs made by modules without parameters (rotary position
  embeddings, masks) are recomputed on the later stage when that gives the same values
  (:mod:`~lightning_varuna.pipeline.model.data_flow`), else cannot be split there either;
- what each segment costs: forward FLOPs and saved-activation bytes
  (:mod:`~lightning_varuna.pipeline.model.segment_costs`).

The dry run works on real tensors or on the meta device (a model built there, see
:mod:`~lightning_varuna.pipeline.model.meta_init`): it reads shapes, never values.

The result is a :class:`Trace`; :func:`make_plan` groups its segments into stages balanced by cost.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from lightning_varuna.pipeline.model.cut import CutPoint, CutPointError, forward_handler
from lightning_varuna.pipeline.model.data_flow import DataFlow
from lightning_varuna.pipeline.model.segment_costs import (
    CostCounter,
    DeviceRates,
    SegmentCost,
    estimated_seconds,
    fit_costs,
)

__all__ = [
    "BALANCED_BY", "Trace", "CutInfo", "Plan", "StageInfo", "trace_step", "time_segments", "balance", "make_plan",
    "segment_costs", "check_pipeline_size",
    "PartitionError",
]


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
    segment_seconds: list[float] = field(default_factory=list)
    """Measured forward time of each segment (empty when not timed, e.g. on the meta device)."""
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
        self._stack: list[tuple[str, int]] = []
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
        self.flow.cut_output(out)
        return out

    def _name(self, cut: CutPoint) -> str:
        return getattr(cut, "_varuna_name", None) or self.module_names.get(id(cut), "a CutPoint")

    def pre_hook(self, module: nn.Module, args: object) -> None:
        name = self.module_names.get(id(module))
        if name is not None:
            self._stack.append((name, self.segment))
            self.flow.enter(module)

    def post_hook(self, module: nn.Module, args: object, output: object) -> None:
        name = self.module_names.get(id(module))
        if name is None or not self._stack:
            return
        _, start = self._stack.pop()
        if start == self.segment:
            self.module_segments.setdefault(name, set()).add(start)
        else:
            self.spanning.add(name)
        self.flow.exit(module, output)

    def uses_parameters(self, args: tuple, kwargs: dict) -> bool:
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

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, D105
        kwargs = kwargs or {}
        tracer = self.tracer
        if tracer.paused:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        derived = tracer.flow.before(name, args, kwargs, tracer.uses_parameters(args, kwargs))
        out = func(*args, **kwargs)
        tracer.flow.after(name, derived, out)
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


def time_segments(timed_step: Callable[[], object]) -> list[float]:
    """Each segment's forward time in seconds: the fastest of :data:`TIMED_RUNS` runs of ``timed_step``.

    The plan is only as good as these times, and one run on a busy machine can be preempted inside any segment:
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
    recomputed, crossings = two.flow.recomputed(module_segments)
    trace = Trace(
        param_bytes={name: p.numel() * p.element_size() for name, p in params.items()},
        cuts=cuts,
        param_segments=two.param_segments,
        param_numel=numel,
        module_segments=module_segments,
        crossings=crossings,
        recomputed=recomputed,
        segment_seconds=seconds,
        skipped=not cuts and one.returned_nothing,
        costs=fit_costs(one.costs, two.costs, two.param_segments, params, len(cuts) + 1),
    )
    return trace, list(one.cut_order)


def forbidden_boundaries(together: Iterable[tuple[int, int]]) -> set[int]:
    """The stage boundaries that would separate a pair of segments that must share a stage.

    Boundary ``b`` falls between segments ``b - 1`` and ``b``.
    """
    return {b for source, destination in together for b in range(source + 1, destination + 1)}


def balance(costs: list[float], num_stages: int, together: Iterable[tuple[int, int]] = ()) -> list[range]:
    """Splits segments into ``num_stages`` contiguous, non-empty groups minimising the largest group cost.

    Ties are broken towards earlier stages taking fewer segments, since they also hold more stashed
    activations under pipeline schedules.

    Args:
        costs: Cost of each segment, in order.
        num_stages: Number of groups; at most ``len(costs)``.
        together: Pairs of segments that must fall in one group (a value crosses between them outside a cut).

    Returns:
        One ``range`` of segment indices per stage.
    """
    n = len(costs)
    forbidden = forbidden_boundaries(together)
    if not 1 <= num_stages <= n - len(forbidden - {0, n}):
        kept = f" ({len(forbidden)} boundaries excluded by values that cross them)" if forbidden else ""
        raise PartitionError(f"Cannot split {n} segment(s) into {num_stages} stage(s){kept}.")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest possible maximum cost when the last k stages hold segments i..n-1
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[n] * (n + 1) for _ in range(num_stages + 1)]
    best[0][n] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(n - k, -1, -1):
            for j in range(i + 1, n - k + 2):
                if j in forbidden and j < n:
                    continue
                value = max(prefix[j] - prefix[i], best[k - 1][j])
                if value < best[k][i] - 1e-12 * max(1.0, value):
                    best[k][i], cut[k][i] = value, j
    ranges, start = [], 0
    for k in range(num_stages, 0, -1):
        end = cut[k][start]
        ranges.append(range(start, end))
        start = end
    return ranges


@dataclass(frozen=True)
class StageInfo:
    """One stage of a plan."""

    segments: range
    params: tuple[str, ...]
    param_numel: int
    seconds: float
    """The stage's cost in the plan's unit: measured forward seconds, or estimated training seconds, per
    micro-batch (0 when balanced by parameters)."""
    param_bytes: int = 0
    forward_flops: float = 0.0
    """Forward FLOPs of a micro-batch."""
    saved_bytes: float = 0.0
    """Activation bytes autograd saves for backward, per micro-batch."""


BALANCED_BY = {
    "measured": "measured forward time per micro-batch",
    "estimated": "estimated training time per micro-batch (FLOPs, activation and parameter bytes; not timed)",
    "params": "parameter count",
}


DRY_RUNS = {"real": "the model's weights", "meta": "meta tensors"}


@dataclass(frozen=True)
class Plan:
    """How the model is split: stages, the parameters of each, and the parameters shared across stages."""

    stages: tuple[StageInfo, ...]
    tied: tuple[tuple[str, tuple[int, ...]], ...]
    trace: Trace
    balanced_by: str = "measured"
    """What the stages were balanced by: ``"measured"``, ``"estimated"`` or ``"params"`` (:data:`BALANCED_BY`)."""
    microbatch: int = 1
    """The micro-batch size the costs are given for."""

    def table(self) -> str:
        """A printable table: per stage its segments, parameters, FLOPs, saved activations and cost."""
        unit = {"measured": "fwd ms", "estimated": "est. ms"}.get(self.balanced_by, "ms")
        rows = [("stage", "segments", "parameters", "param MB", "GFLOP/mb", "act. MB/mb", unit)]
        for s, info in enumerate(self.stages):
            seg = f"{info.segments.start}-{info.segments.stop - 1}"
            cost = f"{info.seconds * 1e3:.2f}" if self.balanced_by != "params" else "-"
            rows.append((str(s), seg, f"{info.param_numel:,}", f"{info.param_bytes / 2**20:.2f}",
                         f"{info.forward_flops / 1e9:.3f}", f"{info.saved_bytes / 2**20:.2f}", cost))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
        lines.append(f"balanced by {BALANCED_BY[self.balanced_by]}; micro-batch of {self.microbatch};"
                     f" dry run on {DRY_RUNS.get(self.trace.dry_run, self.trace.dry_run)}")
        if self.tied:
            lines.append("shared across stages: " + ", ".join(f"{n} (stages {list(s)})" for n, s in self.tied))
        if self.trace.recomputed and len(self.stages) > 1:
            lines.append("side inputs recomputed on every stage by: " + ", ".join(sorted(self.trace.recomputed)))
        return "\n".join(lines)


def check_pipeline_size(trace: Trace, num_stages: int) -> None:
    """Raises a :class:`PartitionError` saying what to change if ``trace`` cannot be cut into ``num_stages``."""
    n = trace.num_segments
    if num_stages > 1 and trace.skipped:
        raise PartitionError(
            "The dry run's step returned None before reaching any cut point, so it cannot see the model. It runs"
            " the step on the first batch (with Lightning: your step hook with batch_idx=0): skip other batches"
            " than that one, or return None after the loss."
        )
    if num_stages > 1 and not trace.cuts:
        raise PartitionError(
            f"pipeline_parallel_size={num_stages} but the model has no CutPoint and no cut_at was given. Add"
            " CutPoint() modules where the model may be split, or set cut_at='path.to.blocks'."
        )
    if num_stages > n:
        raise PartitionError(
            f"pipeline_parallel_size={num_stages} but the model has {n} segment(s) ({len(trace.cuts)} cut"
            f" point(s)). Use pipeline_parallel_size <= {n}, or add CutPoint()s / set cut_at."
        )
    most = n - len(forbidden_boundaries(trace.crossings))
    if num_stages > most:
        (src, dst), what = min(trace.crossings.items())
        raise PartitionError(
            f"{what} is used in segment {dst} without passing through a CutPoint, so segments {src} to {dst} must"
            f" stay on one stage: on a later stage it would be zeros. The model can be split into at most {most}"
            f" stage(s), not pipeline_parallel_size={num_stages}. Route the value through a cut point, or use"
            f" pipeline_parallel_size <= {most}." + _others(trace.crossings)
        )


def _others(crossings: dict[tuple[int, int], str]) -> str:
    others = sorted(crossings)[1:]
    if not others:
        return ""
    return " Other values crossing cuts: " + "; ".join(f"{crossings[pair]} (to segment {pair[1]})" for pair in others)


def segment_costs(
    trace: Trace, by: str = "time", microbatch: int = 1, num_microbatches: int = 1, rates: DeviceRates | None = None,
) -> tuple[str, list[float]]:
    """What :func:`make_plan` balances: ``(kind, cost per segment)``, the kind a key of :data:`BALANCED_BY`.

    ``by="time"`` uses measured forward times when the dry run took them, else the estimate of
    :func:`~lightning_varuna.pipeline.model.segment_costs.estimated_seconds` (FLOPs and bytes, at ``rates``), else
    parameter counts; ``by="params"`` uses parameter counts (a shared parameter split between the segments using it).
    """
    n = trace.num_segments
    if by not in ("time", "params"):
        raise PartitionError(f"partition={by!r}: use 'time' or 'params'.")
    if by == "time" and len(trace.segment_seconds) == n and sum(trace.segment_seconds) > 0:
        return "measured", list(trace.segment_seconds)
    if by == "time" and len(trace.costs) == n:
        rates = rates or DeviceRates.nominal("cpu")
        estimates = [estimated_seconds(c, microbatch, rates, num_microbatches) for c in trace.costs]
        if sum(estimates) > 0:
            return "estimated", estimates
    param_cost = [0.0] * n
    for name, segments in trace.param_segments.items():
        for seg in segments:
            param_cost[seg] += trace.param_numel[name] / len(segments)
    return "params", param_cost


def make_plan(
    trace: Trace, num_stages: int, by: str = "time", microbatch: int = 1, num_microbatches: int = 1,
    rates: DeviceRates | None = None,
) -> Plan:
    """Groups the traced segments into ``num_stages`` stages.

    Args:
        trace: The dry run's trace.
        num_stages: P, any number from 1 to the number of segments.
        by: ``"time"`` balances measured forward time, or estimated time if untimed (:func:`segment_costs`);
            ``"params"`` balances parameter counts.
        microbatch: Samples per micro-batch (for estimates and the printed costs).
        num_microbatches: Micro-batches per step (for estimates).
        rates: The device speeds estimates assume (default: :meth:`DeviceRates.nominal` of a CPU).

    Returns:
        The plan. Raises :class:`PartitionError` if it cannot be made.
    """
    n = trace.num_segments
    check_pipeline_size(trace, num_stages)
    kind, costs = segment_costs(trace, by, microbatch, num_microbatches, rates)
    ranges = balance(costs, num_stages, together=trace.crossings)
    stage_of = {seg: s for s, r in enumerate(ranges) for seg in r}
    for (src, dst), what in sorted(trace.crossings.items()):
        if stage_of[src] != stage_of[dst]:
            raise PartitionError(
                f"{what} is used in segment {dst} without passing through a CutPoint, and those segments fall on"
                f" stages {stage_of[src]} and {stage_of[dst]}. Route it through the cut point, or remove the cut"
                f" points between them (or use fewer stages): on stage {stage_of[dst]} it would be zeros."
            )
    stage_params: list[list[str]] = [[] for _ in ranges]
    tied = []
    for name in trace.param_numel:
        stages = sorted({stage_of[seg] for seg in trace.param_segments.get(name, {0})})
        for s in stages:
            stage_params[s].append(name)
        if len(stages) > 1:
            tied.append((name, tuple(stages)))
    seconds = costs if kind != "params" else [0.0] * n
    flops = [c.forward_flops.at(microbatch) for c in trace.costs] if len(trace.costs) == n else [0.0] * n
    saved = [c.saved_bytes.at(microbatch) for c in trace.costs] if len(trace.costs) == n else [0.0] * n
    stages = tuple(
        StageInfo(
            segments=r,
            params=tuple(stage_params[s]),
            param_numel=sum(trace.param_numel[p] for p in stage_params[s]),
            seconds=sum(seconds[i] for i in r),
            param_bytes=sum(trace.param_bytes.get(p, 4 * trace.param_numel[p]) for p in stage_params[s]),
            forward_flops=sum(flops[i] for i in r),
            saved_bytes=sum(saved[i] for i in r),
        )
        for s, r in enumerate(ranges)
    )
    return Plan(stages=stages, tied=tuple(tied), trace=trace, balanced_by=kind, microbatch=microbatch)
