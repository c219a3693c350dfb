"""Partitioning: the dry run's segments (:mod:`~lightning_varuna.pipeline.model.dry_run`) grouped into stages.

:func:`make_partition` balances the segments' costs (measured times, estimates from counted FLOPs and bytes, or
parameter counts) over P contiguous stages, keeps segments that a value crosses outside a cut point on one stage,
and finds the parameters shared across stages (tied weights).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lightning_varuna.pipeline.model.dry_run import PartitionError, Trace
from lightning_varuna.pipeline.model.segment_costs import DeviceRates, estimated_seconds
from lightning_varuna.pipeline.scheduling.placement import Placement, placement_ranks, rank_stages

__all__ = [
    "BALANCED_BY", "Partition", "StageInfo", "balance", "check_pipeline_size", "forbidden_boundaries", "make_partition",
    "segment_costs",
]


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
    """One stage of a partition."""

    segments: range
    params: tuple[str, ...]
    param_numel: int
    seconds: float
    """The stage's cost in the partition's unit: measured forward seconds, or estimated training seconds, per
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
class Partition:
    """How the model is split: stages, the parameters of each, and the parameters shared across stages."""

    stages: tuple[StageInfo, ...]
    tied: tuple[tuple[str, tuple[int, ...]], ...]
    trace: Trace
    balanced_by: str = "measured"
    """What the stages were balanced by: ``"measured"``, ``"estimated"`` or ``"params"`` (:data:`BALANCED_BY`)."""
    microbatch: int = 1
    """The micro-batch size the costs are given for."""
    stages_per_rank: int = 1
    """Model chunks per rank ``v``: stage ``s`` runs on rank ``s % P`` (the looped placement) unless ``placement``
    is ``"v"``."""
    placement: Placement = "looped"
    """Where the stages of several chunks per rank live: ``"looped"`` or ``"v"`` (rank ``r`` runs stages ``r`` and
    ``2 P - 1 - r``; :mod:`~lightning_varuna.pipeline.scheduling.placement`)."""

    @property
    def num_ranks(self) -> int:
        """``P``: the ranks of one pipeline."""
        return len(self.stages) // self.stages_per_rank

    def rank_of(self, stage: int) -> int:
        """The pipeline rank (position in the pipeline, 0..P-1) that runs ``stage``."""
        return placement_ranks(self.num_ranks, self.stages_per_rank, self.placement)[stage]

    def rank_stages(self, rank: int) -> tuple[int, ...]:
        """The stages pipeline rank ``rank`` runs, in pipeline order."""
        return rank_stages(rank, self.num_ranks, self.stages_per_rank, self.placement)

    def rank_params(self, rank: int) -> tuple[str, ...]:
        """The names of the parameters pipeline rank ``rank`` holds (of all its stages, each once)."""
        held = {name for s in self.rank_stages(rank) for name in self.stages[s].params}
        return tuple(name for name in self.trace.param_numel if name in held)

    @property
    def rank_tied(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """The parameters held by several pipeline ranks, with those ranks.

        A parameter that several stages of one rank share is one tensor there, and needs no synchronization.
        """
        tied = ((name, tuple(sorted({self.rank_of(s) for s in stages}))) for name, stages in self.tied)
        return tuple((name, ranks) for name, ranks in tied if len(ranks) > 1)

    def table(self) -> str:
        """A printable table: per stage its segments, parameters, FLOPs, saved activations and cost."""
        unit = {"measured": "fwd ms", "estimated": "est. ms"}.get(self.balanced_by, "ms")
        chunks = self.stages_per_rank > 1
        rows = [("stage", *(("rank",) if chunks else ()), "segments", "parameters", "param MB", "GFLOP/mb",
                 "act. MB/mb", unit)]
        for s, info in enumerate(self.stages):
            seg = f"{info.segments.start}-{info.segments.stop - 1}"
            cost = f"{info.seconds * 1e3:.2f}" if self.balanced_by != "params" else "-"
            rank = (str(self.rank_of(s)),) if chunks else ()
            rows.append((str(s), *rank, seg, f"{info.param_numel:,}", f"{info.param_bytes / 2**20:.2f}",
                         f"{info.forward_flops / 1e9:.3f}", f"{info.saved_bytes / 2**20:.2f}", cost))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
        lines.append(f"balanced by {BALANCED_BY[self.balanced_by]}; micro-batch of {self.microbatch};"
                     f" dry run on {DRY_RUNS.get(self.trace.dry_run, self.trace.dry_run)}"
                     + (f"; {self.stages_per_rank} stages per rank, {'V-shaped' if self.placement == 'v' else 'looped'}"
                        if chunks else ""))
        if self.tied:
            lines.append("shared across stages: " + ", ".join(f"{n} (stages {list(s)})" for n, s in self.tied))
        if self.trace.recomputed and len(self.stages) > 1:
            lines.append("side inputs recomputed on every stage by: " + ", ".join(sorted(self.trace.recomputed)))
        stage_of = {seg: s for s, info in enumerate(self.stages) for seg in info.segments}
        carried = [v for v in self.trace.side_values if stage_of[v.producer.segment] != stage_of[v.last_segment]]
        if carried:
            lines.append("side values carried with the activations: " + "; ".join(
                f"{v.producer.module} (stage {stage_of[v.producer.segment]}) to stage {stage_of[v.last_segment]}"
                for v in carried))
        return "\n".join(lines)


def check_pipeline_size(trace: Trace, num_stages: int, stages_per_rank: int = 1) -> None:
    """Raises a :class:`PartitionError` saying what to change if ``trace`` cannot be cut into ``num_stages``.

    With ``stages_per_rank`` ``v > 1``, ``num_stages`` is ``P v``.
    """
    n = trace.num_segments
    v = stages_per_rank
    asked = f"pipeline_parallel_size={num_stages}" if v == 1 else (
        f"pipeline_parallel_size={num_stages // v} x stages_per_rank={v} ({num_stages} stages)")

    def fewer(most: int) -> str:
        if v == 1:
            return f"pipeline_parallel_size <= {most}"
        return f"stages_per_rank <= {max(1, most // (num_stages // v))}"

    if num_stages > 1 and trace.skipped:
        raise PartitionError(
            "The dry run's step returned None before reaching any cut point, so it cannot see the model. It runs"
            " the step on the first batch (with Lightning: your step hook with batch_idx=0): skip other batches"
            " than that one, or return None after the loss."
        )
    if num_stages > 1 and not trace.cuts:
        raise PartitionError(
            f"{asked} but the model has no CutPoint and no cut_at was given. Add"
            " CutPoint() modules where the model may be split, or set cut_at='path.to.blocks'."
        )
    if num_stages > n:
        raise PartitionError(
            f"{asked} but the model has {n} segment(s) ({len(trace.cuts)} cut"
            f" point(s)). Use {fewer(n)}, or add CutPoint()s / set cut_at."
        )
    most = n - len(forbidden_boundaries(trace.crossings))
    if num_stages > most:
        (src, dst), what = min(trace.crossings.items())
        raise PartitionError(
            f"{what} is used in segment {dst} without passing through a CutPoint, so segments {src} to {dst} must"
            f" stay on one stage: on a later stage it would be zeros. The model can be split into at most {most}"
            f" stage(s), not {asked}. Make the value the output of a module call and pass it to the modules that"
            " read it as an argument (it then travels to their stages with the activation), or use"
            f" {fewer(most)}." + _others(trace.crossings)
        )


def _others(crossings: dict[tuple[int, int], str]) -> str:
    others = sorted(crossings)[1:]
    if not others:
        return ""
    return " Other values crossing cuts: " + "; ".join(f"{crossings[pair]} (to segment {pair[1]})" for pair in others)


def segment_costs(
    trace: Trace, by: str = "time", microbatch: int = 1, num_microbatches: int = 1, rates: DeviceRates | None = None,
) -> tuple[str, list[float]]:
    """What :func:`make_partition` balances: ``(kind, cost per segment)``, the kind a key of :data:`BALANCED_BY`.

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


def make_partition(
    trace: Trace, num_stages: int, by: str = "time", microbatch: int = 1, num_microbatches: int = 1,
    rates: DeviceRates | None = None, stages_per_rank: int = 1, placement: Placement = "looped",
) -> Partition:
    """Groups the traced segments into ``num_stages`` stages.

    Args:
        trace: The dry run's trace.
        num_stages: P, any number from 1 to the number of segments.
        by: ``"time"`` balances measured forward time, or estimated time if untimed (:func:`segment_costs`);
            ``"params"`` balances parameter counts.
        microbatch: Samples per micro-batch (for estimates and the printed costs).
        num_microbatches: Micro-batches per step (for estimates).
        rates: The device speeds estimates assume (default: :meth:`DeviceRates.nominal` of a CPU).
        stages_per_rank: ``v``: ``num_stages`` is then ``P v``, and stage ``s`` runs on rank ``s % P``.
        placement: ``"v"``: stage ``s`` runs on rank ``s`` or ``2 P - 1 - s`` instead (two stages per rank).

    Returns:
        The partition. Raises :class:`PartitionError` if it cannot be made.
    """
    n = trace.num_segments
    check_pipeline_size(trace, num_stages, stages_per_rank)
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
    stage_infos = tuple(
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
    return Partition(stages=stage_infos, tied=tuple(tied), trace=trace, balanced_by=kind, microbatch=microbatch,
                stages_per_rank=stages_per_rank, placement=placement)

