"""Auto-configuration: every valid configuration's step time and memory, predicted from a profile.

:func:`search` ranks them; the fastest that fits in memory is chosen.

A configuration is P (stages), D = world size / P (replicas), the micro-batch size and count, the schedule and
recompute. For each one :func:`predict`

1. splits the segments into P stages the way the engine will (:func:`~lightning_varuna.pipeline.model.partition.balance`
   of the profile's per-segment costs at that micro-batch size, or of parameter bytes);
2. runs the schedule in the simulator with the run-time rules, each stage's forward, recompute and backward
   taken from the profile plus the executor's overhead per task, and each message crossing its boundary's link
   (latency, and bytes over bandwidth with messages on one link one after another);
3. adds each stage's gradient sync: the data-parallel all-reduce in buckets, each started when the stage's last
   backward has made it final (the overlap; linear in the backward's progress) or after the schedule, one after
   another; the sum of tied copies after the schedule; then the optimizer step. The step ends when the last
   stage is done.

The all-reduce is a ring over the stage's D replicas
(:class:`~lightning_varuna.pipeline.planning.profile_data.Network`), over the links between nodes when the replicas span
nodes, where the stages of a node share the node's link. Ranks are ``replica * P + stage``, numbered node by node, so a
pipeline boundary crosses nodes when its two ranks lie on different nodes. Memory per stage is
:func:`~lightning_varuna.pipeline.planning.memory_model.stage_memory` with the graphs in flight counted along the
simulated order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_varuna.pipeline.comm.grad_sync import default_bucket_bytes
from lightning_varuna.pipeline.model.dry_run import PartitionError
from lightning_varuna.pipeline.model.partition import balance
from lightning_varuna.pipeline.planning.memory_model import StageMemory, format_bytes, graphs_in_flight, stage_memory
from lightning_varuna.pipeline.planning.profile_data import Profile
from lightning_varuna.pipeline.scheduling.schedules import CHUNKS_REQUIRED, SCHEDULES, Kind, make_schedule
from lightning_varuna.pipeline.scheduling.simulator import SimResult, StageCosts, simulate

__all__ = ["Candidate", "Choices", "Cluster", "PlanError", "Prediction", "format_table", "predict", "search",
           "stage_ranges"]

MAX_MICROBATCHES = 256
"""The search does not consider more micro-batches per step than this."""


class PlanError(ValueError):
    """No configuration is valid, or none fits in memory; the message says what to change."""


@dataclass(frozen=True)
class Cluster:
    """The processes a job runs on.

    Attributes:
        world_size: All processes.
        devices_per_node: Processes per node (ranks are numbered node by node).
    """

    world_size: int
    devices_per_node: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.devices_per_node < 1:
            raise ValueError(f"a cluster needs at least one process, got {self}.")

    def _node(self, rank: int) -> int:
        return rank // self.devices_per_node

    def boundary_crosses(self, pipeline_size: int, boundary: int) -> bool:
        """Whether the messages between stages ``boundary`` and ``boundary + 1`` cross nodes (in some replica)."""
        return any(self._node(d * pipeline_size + boundary) != self._node(d * pipeline_size + boundary + 1)
                   for d in range(self.world_size // pipeline_size))

    def replicas_cross(self, pipeline_size: int, stages: Sequence[int]) -> bool:
        """Whether the replicas of ``stages`` lie on more than one node."""
        data = self.world_size // pipeline_size
        return len({self._node(d * pipeline_size + s) for d in range(data) for s in stages}) > 1

    def sharing(self, pipeline_size: int) -> int:
        """How many stages' all-reduces leave one node at once: the node's distinct stages."""
        return min(pipeline_size, self.devices_per_node)


@dataclass(frozen=True)
class Choices:
    """What is fixed and what is searched.

    Attributes:
        pipeline_size: P, or None to search every P that divides the world size.
        microbatch_size: A size, ``"auto"`` to search every size that divides the replica's batch, or None for
            the engine's default (``2 * P`` micro-batches, fewer if the batch is smaller).
        num_microbatches: A fixed count (instead of ``microbatch_size``).
        schedule: A schedule, or None to search all.
        recompute: True or False, or None to search both.
        partition: How the engine balances stages: ``"time"`` or ``"params"``.
        bucket_bytes: The gradient sync's bucket size (None: its default).
        overlap: Whether the data-parallel all-reduce starts during the last backward.
        wire_bytes_per_element: Bytes on the wire per byte of an activation (0.5 for bfloat16 over float32).
        zero_stage: 1: the optimizer state sharded over the replicas (memory; the sync's bytes are the same).
    """

    pipeline_size: int | None = None
    microbatch_size: int | str | None = "auto"
    num_microbatches: int | None = None
    schedule: str | None = None
    recompute: bool | None = None
    partition: str = "time"
    bucket_bytes: int | None = None
    overlap: bool = True
    wire_bytes_per_element: float = 1.0
    zero_stage: int = 0


@dataclass(frozen=True)
class Candidate:
    """One configuration with its predictions.

    Attributes:
        pipeline_size: P.
        data_size: D.
        microbatch_size: Samples per micro-batch (the largest, when the batch does not divide evenly).
        num_microbatches: Micro-batches per step (m).
        schedule: The schedule.
        recompute: Whether non-last stages recompute.
        step_s: Predicted seconds per optimizer step.
        bubble: Predicted idle share of the schedule (from the first task to the last, over all stages; a
            recompute counts as busy).
        memory: Predicted peak memory per stage.
        stages: The segments of each stage.
        fits: Whether every stage's peak is within the memory limit.
    """

    pipeline_size: int
    data_size: int
    microbatch_size: int
    num_microbatches: int
    schedule: str
    recompute: bool
    step_s: float
    bubble: float
    memory: tuple[StageMemory, ...]
    stages: tuple[range, ...]
    fits: bool = True

    @property
    def peak_bytes(self) -> tuple[int, ...]:
        """Predicted peak bytes per stage."""
        return tuple(m.total for m in self.memory)

    def describe(self) -> str:
        """One line: ``P=2 x D=2, micro-batch 4 x 8, varuna, recompute``."""
        recompute = "recompute" if self.recompute else "no recompute"
        return (f"P={self.pipeline_size} x D={self.data_size}, micro-batch {self.microbatch_size} x "
                f"{self.num_microbatches}, {self.schedule}, {recompute}")


@dataclass(frozen=True)
class Prediction:
    """A candidate and how its step unfolds (for the predicted timeline).

    Attributes:
        candidate: The configuration and its figures.
        schedule: The simulated schedule.
        costs: Each stage's task costs as simulated.
        sync: Per stage, ``(start, end)`` of its gradient sync (start = end when there is nothing to sync).
        optimizer: Per stage, ``(start, end)`` of its optimizer step.
    """

    candidate: Candidate
    schedule: SimResult
    costs: tuple[StageCosts, ...]
    sync: tuple[tuple[float, float], ...] = field(default=())
    optimizer: tuple[tuple[float, float], ...] = field(default=())


def stage_ranges(profile: Profile, pipeline_size: int, microbatch_size: float, partition: str = "time") -> list[range]:
    """The segments of each stage, as the engine groups them.

    Raises:
        PartitionError: If the grouping separates two segments that must share a stage.
    """
    costs = profile.segment_costs(microbatch_size) if partition == "time" else profile.param_costs()
    ranges = balance(costs, pipeline_size, together=profile.crossings)
    stage_of = {segment: s for s, r in enumerate(ranges) for segment in r}
    for source, destination in profile.crossings:
        if stage_of[source] != stage_of[destination]:
            raise PartitionError(f"segments {source} and {destination} must share a stage")
    return ranges


def predict(
    profile: Profile, cluster: Cluster, pipeline_size: int, microbatch_size: float, num_microbatches: int,
    schedule: str, recompute: bool, choices: Choices = Choices(),  # noqa: B008 - frozen, never mutated
) -> Prediction:
    """The predicted step of one configuration (see the module's docstring).

    Args:
        profile: The model's profile.
        cluster: Where the job runs.
        pipeline_size: P (divides ``cluster.world_size``).
        microbatch_size: Mean samples per micro-batch.
        num_microbatches: m.
        schedule: The schedule's name.
        recompute: Whether non-last stages recompute.
        choices: The bucket size, overlap, partition and wire dtype used (the searched fields are ignored).
    """
    P = pipeline_size
    D = cluster.world_size // P
    ranges = stage_ranges(profile, P, microbatch_size, choices.partition)
    costs = tuple(_stage_costs(profile, r, microbatch_size, recompute and s < P - 1) for s, r in enumerate(ranges))
    boundary_bytes = [profile.cuts[r.stop - 1].nbytes(microbatch_size) * choices.wire_bytes_per_element
                      for r in ranges[:-1]]
    links = [profile.network.p2p(cluster.boundary_crosses(P, b)) for b in range(P - 1)]
    sim = simulate(
        make_schedule(schedule, P, num_microbatches, recompute), costs,
        jitter=lambda src, dst, kind, k: links[min(src, dst)].latency_s,
        opportunistic=True, transfer=[n / link.bandwidth for n, link in zip(boundary_bytes, links, strict=True)],
    )
    sync, optimizer = [], []
    for s, r in enumerate(ranges):
        start, end, last_backward = _schedule_span(sim, costs[s], s)
        synced = _sync_end(profile, cluster, ranges, s, end, last_backward, costs[s].backward, choices)
        sync.append((end, synced))
        trainable = sum(p.nbytes for p in profile.params if p.trainable and any(i in r for i in p.segments))
        # sharded (zero_stage=1): each replica steps 1/D of it (the all-gather after the step is not modelled yet)
        shards = D if choices.zero_stage == 1 else 1
        optimizer.append((synced, synced + profile.optimizer_s_per_byte * trainable / shards))
    step = max(end for _, end in optimizer)
    memory = tuple(
        stage_memory(profile, r, s, P, D, math.ceil(microbatch_size), num_microbatches,
                     graphs_in_flight(sim.order[s], recompute and s < P - 1), choices.wire_bytes_per_element,
                     choices.zero_stage)
        for s, r in enumerate(ranges)
    )
    candidate = Candidate(
        pipeline_size=P, data_size=D, microbatch_size=math.ceil(microbatch_size), num_microbatches=num_microbatches,
        schedule=schedule, recompute=recompute, step_s=step, bubble=sim.bubble,
        memory=memory, stages=tuple(ranges),
    )
    return Prediction(candidate, sim, costs, tuple(sync), tuple(optimizer))


def _stage_costs(profile: Profile, segments: range, microbatch_size: float, stashes: bool) -> StageCosts:
    overhead = profile.task_overhead_s
    return StageCosts(
        forward=overhead + sum(profile.forward(i, microbatch_size, grad=not stashes) for i in segments),
        backward=overhead + sum(profile.backward(i, microbatch_size) for i in segments),
        recompute=overhead + sum(profile.forward(i, microbatch_size, grad=True) for i in segments),
    )


def _schedule_span(sim: SimResult, costs: StageCosts, stage: int) -> tuple[float, float, float]:
    """The stage's first start, last end, and the start of its last backward.

    For a split backward the last ``W``'s start: the linear layers' weights, most of every bucket, are final
    only then (the model is conservative: the input-gradient part before it also readies some parameters).
    """
    order, starts = sim.order[stage], sim.start_times[stage]
    end = starts[-1] + costs.cost(order[-1].kind) if order else 0.0
    last_backward = next(
        (t for task, t in zip(reversed(order), reversed(starts)) if task.kind in (Kind.B, Kind.W)), end)
    return (starts[0] if starts else 0.0), end, last_backward


def _sync_end(profile: Profile, cluster: Cluster, ranges: Sequence[range], stage: int, end: float,
              last_backward: float, backward_s: float, choices: Choices) -> float:
    """When the stage's gradient sync ends: data-parallel buckets, then the sum of tied copies."""
    P, segments = len(ranges), ranges[stage]
    D = cluster.world_size // P
    network = profile.network
    held = [p for p in profile.params if p.trainable and any(i in segments for i in p.segments)]
    tied = [p for p in held if any(i not in segments for i in p.segments)]
    plain = [p for p in reversed(held) if p not in tied]  # buckets hold parameters in backward order
    done = end
    if D > 1 and plain:
        crosses = cluster.replicas_cross(P, [stage])
        total = sum(p.nbytes for p in plain)
        bucket_bytes = choices.bucket_bytes or default_bucket_bytes(total)
        clock, filled = 0.0, 0
        for size in _bucket_sizes([p.nbytes for p in plain], bucket_bytes):
            filled += size
            ready = last_backward + backward_s * filled / total if choices.overlap else end
            clock = max(clock, ready) + network.allreduce(size, D, crosses, cluster.sharing(P))
        done = max(done, clock)
    if tied:
        stage_of = {i: s for s, r in enumerate(ranges) for i in r}
        holders = sorted({stage_of[i] for p in tied for i in p.segments})
        crosses = cluster.replicas_cross(P, holders)
        nbytes = sum(p.nbytes for p in tied)
        done = max(done, end + network.allreduce(nbytes, D * len(holders), crosses))
    return done


def _bucket_sizes(sizes: list[int], bucket_bytes: int) -> list[int]:
    buckets: list[int] = []
    for size in sizes:
        if not buckets or buckets[-1] + size > bucket_bytes:
            buckets.append(0)
        buckets[-1] += size
    return buckets


# -- search ---------------------------------------------------------------------------------------------------
def search(
    profile: Profile,
    cluster: Cluster,
    choices: Choices,
    memory_limit: int,
    global_batch_size: int | None = None,
    replica_batch_size: int | None = None,
) -> list[Candidate]:
    """Every valid configuration, ranked: those that fit in memory by predicted step time, then the others.

    Args:
        profile: The model's profile.
        cluster: Where the job runs.
        choices: What is fixed and what is searched.
        memory_limit: Bytes a stage may use.
        global_batch_size: Samples per step over all replicas (each replica gets ``global / D``). Needed when P
            is searched.
        replica_batch_size: Samples per step and replica, when no global batch is given (P fixed).

    Raises:
        PlanError: If no configuration is valid (the message says why).
    """
    if choices.pipeline_size is None and global_batch_size is None:
        raise PlanError("choosing pipeline_parallel_size needs global_batch_size: D = world size / P sets each"
                        " replica's batch. Give global_batch_size, or a fixed pipeline_parallel_size.")
    candidates, reasons = [], []
    for P in _pipeline_sizes(profile, cluster, choices):
        D = cluster.world_size // P
        batch = global_batch_size // D if global_batch_size is not None else replica_batch_size
        if global_batch_size is not None and global_batch_size % D:
            reasons.append(f"P={P}: global_batch_size={global_batch_size} does not split over D={D} replicas")
            continue
        assert batch is not None
        for m in _microbatch_counts(batch, P, choices):
            seen: set[tuple] = set()
            for schedule, recompute in _schedules(P, choices):
                same = (make_schedule(schedule, P, m, recompute), recompute and P > 1)
                if same in seen:  # e.g. gpipe with one micro-batch runs what varuna runs
                    continue
                seen.add(same)
                try:
                    candidate = predict(profile, cluster, P, batch / m, m, schedule, recompute, choices).candidate
                except PartitionError as err:
                    reasons.append(f"P={P}: {err}")
                    break
                fits = max(candidate.peak_bytes) <= memory_limit
                candidates.append(_with_fit(candidate, fits))
    if not candidates:
        raise PlanError("no valid configuration for " f"{cluster.world_size} process(es): " + "; ".join(reasons[:4]))
    order = {name: i for i, name in enumerate(SCHEDULES)}
    # ties (equal predicted times) go to the smaller peak, then to fewer stages and micro-batches
    return sorted(candidates, key=lambda c: (not c.fits, c.step_s if c.fits else 0.0, max(c.peak_bytes),
                                             c.pipeline_size, c.num_microbatches, order[c.schedule], not c.recompute))


def _with_fit(candidate: Candidate, fits: bool) -> Candidate:
    return candidate if fits else Candidate(**{**candidate.__dict__, "fits": False})


def _pipeline_sizes(profile: Profile, cluster: Cluster, choices: Choices) -> list[int]:
    if choices.pipeline_size is not None:
        return [choices.pipeline_size]
    limit = min(cluster.world_size, profile.num_segments)
    return [p for p in range(1, limit + 1) if cluster.world_size % p == 0]


def _microbatch_counts(batch: int, P: int, choices: Choices) -> list[int]:
    if choices.num_microbatches is not None:
        return [choices.num_microbatches] if choices.num_microbatches <= batch else []
    size = choices.microbatch_size
    if isinstance(size, int):
        return [max(1, math.ceil(batch / size))]
    if size is None:
        return [max(1, min(2 * P, batch))]
    return [m for m in range(1, min(batch, MAX_MICROBATCHES) + 1) if batch % m == 0]


def _schedules(P: int, choices: Choices) -> list[tuple[str, bool]]:
    # several chunks per rank are not planned yet (the configuration refuses "auto" with stages_per_rank > 1)
    one_chunk = [s for s in SCHEDULES if s not in CHUNKS_REQUIRED]
    schedules = [choices.schedule] if choices.schedule is not None else one_chunk
    if P == 1 and choices.schedule is None:
        schedules = ["varuna", "gpipe"]  # one stage: 1f1b runs the same order as varuna
    recomputes = [choices.recompute] if choices.recompute is not None else ([False] if P == 1 else [True, False])
    return [(s, r) for s in schedules for r in recomputes]


# -- table ----------------------------------------------------------------------------------------------------
def format_table(candidates: Sequence[Candidate], limit: int | None = 8, memory_limit: int | None = None,
                 reserve: float = 0.0) -> str:
    """The ranked candidates as a text table (the first ``limit`` rows; the chosen one first).

    Args:
        candidates: Ranked, best first.
        limit: Rows shown (None: all).
        memory_limit: The limit the fits were judged against, named in the line under the table.
        reserve: The share of ``memory_limit`` the search kept in reserve, named in that line too.
    """
    header = ("rank", "P", "D", "mbs", "m", "schedule", "recompute", "step ms", "bubble", "peak per stage", "fits")
    rows = [header]
    shown = list(candidates if limit is None else candidates[:limit])
    for rank, c in enumerate(shown, 1):
        peaks = "/".join(format_bytes(b).replace(" ", "") for b in c.peak_bytes)
        rows.append((str(rank), str(c.pipeline_size), str(c.data_size), str(c.microbatch_size),
                     str(c.num_microbatches), c.schedule, "yes" if c.recompute else "no", f"{c.step_s * 1e3:.2f}",
                     f"{c.bubble:.1%}", peaks, "yes" if c.fits else "no"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    hidden = len(candidates) - len(shown)
    excluded = sum(not c.fits for c in candidates)
    note = f"{len(candidates)} configuration(s)"
    if memory_limit is not None:
        note += f", {excluded} over the memory limit of {format_bytes(memory_limit)}"
        note += f" less its {reserve:.0%} reserve" if reserve else ""
    if hidden > 0:
        note += f"; {hidden} more not shown"
    return "\n".join([*lines, note])
