"""One configuration's step, predicted from a profile: time (simulated) and memory per pipeline rank.

For a configuration (P ranks of ``v`` model chunks each, D = world size / P replicas, the micro-batch size and count,
the schedule and recompute) :func:`predict`

1. splits the segments into ``P v`` stages the way the engine will
   (:func:`~lightning_varuna.pipeline.model.partition.balance` of the profile's per-segment costs at that micro-batch
   size, or of parameter bytes); stage ``s`` runs on rank ``s % P``;
2. runs the schedule in the simulator with the run-time rules, each stage's forward, recompute and backward
   taken from the profile plus the executor's overhead per task, and each message crossing its boundary's link
   (latency, and bytes over bandwidth with messages on one link one after another);
3. adds each rank's gradient sync: the data-parallel all-reduce in buckets, each started when the rank's last
   backward has made it final (the overlap; linear in the backward's progress) or after the schedule, one after
   another; the sum of tied copies after the schedule; then the optimizer step. With ``zero_stage=1`` the
   buckets are reduce-scattered instead (half an all-reduce's time), the step updates 1/D of the parameters,
   and the updated rows are all-gathered after it (the other half), bucket by bucket. The step ends when the
   last rank is done.

The all-reduce is a ring over the rank's D replicas
(:class:`~lightning_varuna.pipeline.planning.profile_data.Network`), over the links between nodes when the replicas span
nodes, where the ranks of a node share the node's link. Ranks are ``replica * P + pipeline rank``, numbered node by
node, so a pipeline link crosses nodes when its two ranks lie on different nodes. Memory per rank is
:func:`~lightning_varuna.pipeline.planning.memory_model.stage_memory` of each of its stages, with the autograd graphs
in flight counted along the simulated order (each weighed by its chunk's saved bytes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_varuna.pipeline.comm.grad_sync import default_bucket_bytes
from lightning_varuna.pipeline.config import EngineConfig
from lightning_varuna.pipeline.model.dry_run import PartitionError
from lightning_varuna.pipeline.model.partition import balance
from lightning_varuna.pipeline.planning.candidates import Candidate, Cluster, Prediction
from lightning_varuna.pipeline.planning.memory_model import (
    StageMemory,
    activation_peak,
    stage_memory,
)
from lightning_varuna.pipeline.planning.profile_data import Profile
from lightning_varuna.pipeline.runtime.recompute import grad_from_cut
from lightning_varuna.pipeline.scheduling.schedules import Kind, Task, make_schedule, stage_ranks
from lightning_varuna.pipeline.scheduling.simulator import SimResult, StageCosts, simulate

__all__ = ["predict", "recomputed_segments", "stage_ranges"]


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


def recomputed_segments(ranges: Sequence[range], recompute: bool | int, crossings: Sequence[tuple[int, int]] = (),
                        ) -> list[range]:
    """The segments each stage runs without autograd in its forward and recomputes before its backward.

    All of a non-last stage's with ``recompute=True``, its first ``n`` with a number ``n`` (recompute by degree),
    none on the last stage or without recompute.

    Raises:
        PartitionError: If a value computed from parameters would cross from a stage's recomputed segments to its
            others other than through their cut point (the engine refuses that degree).
    """
    parts = []
    described = {pair: "a value computed from parameters" for pair in crossings}
    for s, r in enumerate(ranges):
        if recompute is False or s == len(ranges) - 1:
            parts.append(range(r.start, r.start))
            continue
        # the engine's own rule for where the kept graph starts (None: the whole stage recomputes)
        cut = grad_from_cut(r.start - 1 if s else None, r.stop - 1, None if recompute is True else int(recompute),
                            described)
        parts.append(r if cut is None else range(r.start, cut + 1))
    return parts


def predict(
    profile: Profile, cluster: Cluster, pipeline_size: int, microbatch_size: float, num_microbatches: int,
    schedule: str, recompute: bool | int, config: EngineConfig | None = None, stages_per_rank: int = 1,
    wire_bytes_per_element: float = 1.0,
) -> Prediction:
    """The predicted step of one configuration (see the module's docstring).

    Args:
        profile: The model's profile.
        cluster: Where the job runs.
        pipeline_size: P (divides ``cluster.world_size``).
        microbatch_size: Mean samples per micro-batch.
        num_microbatches: m.
        schedule: The schedule's name.
        recompute: Whether non-last stages recompute; a number ``n``: their first ``n`` segments (by degree).
        config: The options read here: ``partition``, ``zero_stage``, ``grad_bucket_bytes``, ``overlap_grad_sync``
            (default: ``EngineConfig()``'s); the shape is given by the other arguments.
        stages_per_rank: Model chunks per rank ``v``: ``P v`` stages, stage ``s`` on rank ``s % P`` (looped), or
            on rank ``s`` or ``2 P - 1 - s`` for ``"zero-bubble-v"`` (V-shaped).
        wire_bytes_per_element: Bytes on the wire per byte of an activation (0.5 for ``boundary_dtype`` bfloat16
            over float32).

    Raises:
        PartitionError: If the model cannot be split into ``P v`` stages, or recomputed by that degree.
        ScheduleError: If the schedule cannot run this shape.
    """
    config = config or EngineConfig()
    P, v = pipeline_size, stages_per_rank
    num_stages = P * v
    D = cluster.world_size // P
    ranges = stage_ranges(profile, num_stages, microbatch_size, config.partition)
    placed = stage_ranks(P, v, schedule)  # looped, or V-shaped for "zero-bubble-v"
    rank_of = list(placed) if placed is not None else list(range(num_stages))
    stages_of = [[s for s in range(num_stages) if rank_of[s] == r] for r in range(P)]
    recomputed = recomputed_segments(ranges, recompute, profile.crossings)
    costs = tuple(_stage_costs(profile, r, part, microbatch_size) for r, part in zip(ranges, recomputed, strict=True))
    # a forward adds no autograd graph where the whole stage recomputes: the run-time rules may move it
    stashes = [len(part) == len(r) for r, part in zip(ranges, recomputed, strict=True)]
    boundary_bytes = [profile.cuts[r.stop - 1].nbytes(microbatch_size) * wire_bytes_per_element
                      for r in ranges[:-1]]
    links = [profile.network.p2p(cluster.ranks_cross(P, rank_of[b], rank_of[b + 1])) for b in range(num_stages - 1)]
    sim = simulate(
        make_schedule(schedule, P, num_microbatches, recompute is not False, stages_per_rank=v,
                       forwards_keep_graphs=not isinstance(recompute, bool)), costs,
        jitter=lambda src, dst, kind, k: links[min(src, dst)].latency_s,
        opportunistic=True, transfer=[n / link.bandwidth for n, link in zip(boundary_bytes, links, strict=True)],
        stage_ranks=placed, forwards_stash=stashes.__getitem__,
    )
    held = [[i for s in stages_of[r] for i in ranges[s]] for r in range(P)]
    sync, optimizer = [], []
    for r in range(P):
        start, end, last_backward, backward_s = _schedule_span(sim, costs, r)
        synced, gather_s = _sync_end(profile, cluster, held, r, end, last_backward, backward_s, config)
        sync.append((end, synced))
        trainable = sum(p.nbytes for p in profile.params if p.trainable and any(i in held[r] for i in p.segments))
        # sharded (zero_stage=1): each replica steps 1/D of it, then the updated rows are all-gathered
        shards = D if config.zero_stage == 1 else 1
        optimizer.append((synced, synced + profile.optimizer_s_per_byte * trainable / shards + gather_s))
    step = max(end for _, end in optimizer)
    memory = tuple(_rank_memory(profile, sim, ranges, recomputed, r, D, microbatch_size, num_microbatches, config,
                                stages_of[r], wire_bytes_per_element) for r in range(P))
    candidate = Candidate(
        pipeline_size=P, data_size=D, microbatch_size=math.ceil(microbatch_size), num_microbatches=num_microbatches,
        schedule=schedule, recompute=recompute, step_s=step, bubble=sim.bubble,
        memory=memory, stages=tuple(ranges), stages_per_rank=v,
    )
    return Prediction(candidate, sim, costs, tuple(sync), tuple(optimizer))


def _rank_memory(profile: Profile, sim: SimResult, ranges: Sequence[range], recomputed: Sequence[range], rank: int,
                 data_size: int, microbatch_size: float, num_microbatches: int, config: EngineConfig,
                 stages: Sequence[int], wire_bytes_per_element: float) -> StageMemory:
    """A rank's peak: its stages' weights, state and buffers added, and the graphs of its chunks as they overlap.

    Each graph counts what its own chunk saves (chunks of a rank may differ in size), a forward what its kept
    segments save, a recompute what its recomputed segments save, along the simulated order.
    """
    num_stages = len(ranges)
    mbs = math.ceil(microbatch_size)
    per_stage = [
        stage_memory(profile, ranges[s], s, num_stages, data_size, mbs, num_microbatches, 0,
                     wire_bytes_per_element, config.zero_stage)
        for s in stages
    ]
    again = [sum(profile.saved_bytes(i, mbs) for i in part) for part in recomputed]
    kept = [sum(profile.saved_bytes(i, mbs) for i in r) - a for r, a in zip(ranges, again, strict=True)]
    activations = activation_peak(sim.order[rank], kept, again, rank)
    # a parameter that two chunks of the rank use is one tensor, with one gradient and one optimizer state
    shared, shared_trainable = _shared_bytes(profile, [ranges[s] for s in stages])
    shards = data_size if config.zero_stage == 1 else 1
    return StageMemory(
        weights=sum(m.weights for m in per_stage) - shared,
        gradients=sum(m.gradients for m in per_stage) - shared_trainable,
        optimizer=sum(m.optimizer for m in per_stage) - int(profile.optimizer_state_ratio * shared_trainable / shards),
        buffers=sum(m.buffers for m in per_stage),
        activations=activations,
    )


def _shared_bytes(profile: Profile, chunks: Sequence[range]) -> tuple[int, int]:
    """Bytes (all, trainable) counted more than once when each of a rank's chunks counts its parameters."""
    extra = trainable = 0
    for p in profile.params:
        repeats = max(0, sum(any(i in r for i in p.segments) for r in chunks) - 1)
        extra += repeats * p.nbytes
        trainable += repeats * p.nbytes if p.trainable else 0
    return extra, trainable


def _stage_costs(profile: Profile, segments: range, recomputed: range, microbatch_size: float) -> StageCosts:
    overhead = profile.task_overhead_s
    return StageCosts(
        forward=overhead + sum(profile.forward(i, microbatch_size, grad=i not in recomputed) for i in segments),
        backward=overhead + sum(profile.backward(i, microbatch_size) for i in segments),
        recompute=overhead + sum(profile.forward(i, microbatch_size, grad=True) for i in recomputed),
    )


def _schedule_span(sim: SimResult, costs: Sequence[StageCosts], rank: int) -> tuple[float, float, float, float]:
    """The rank's first start, last end, the start of its last backward, and that backward's duration.

    For a split backward the last ``W``'s start: the linear layers' weights, most of every bucket, are final
    only then (the model is conservative: the input-gradient part before it also readies some parameters).
    """
    order, starts = sim.order[rank], sim.start_times[rank]

    def stage_of(task: Task) -> int:
        return rank if task.stage is None else task.stage

    end = starts[-1] + costs[stage_of(order[-1])].cost(order[-1].kind) if order else 0.0
    last = next(((task, t) for task, t in zip(reversed(order), reversed(starts)) if task.kind in (Kind.B, Kind.W)),
                None)
    if last is None:
        return (starts[0] if starts else 0.0), end, end, costs[rank].backward
    return (starts[0] if starts else 0.0), end, last[1], costs[stage_of(last[0])].backward


def _sync_end(profile: Profile, cluster: Cluster, held_segments: Sequence[Sequence[int]], rank: int, end: float,
              last_backward: float, backward_s: float, config: EngineConfig) -> tuple[float, float]:
    """When the rank's gradient sync ends, and how long the all-gather after a sharded step takes.

    The sync: data-parallel buckets, then the sum of tied copies. The all-gather: ``zero_stage=1`` only (0
    otherwise).
    """
    P, segments = len(held_segments), set(held_segments[rank])
    D = cluster.world_size // P
    network = profile.network
    held = [p for p in profile.params if p.trainable and any(i in segments for i in p.segments)]
    tied = [p for p in held if any(i not in segments for i in p.segments)]
    plain = [p for p in reversed(held) if p not in tied]  # buckets hold parameters in backward order
    done, gather_s = end, 0.0
    if D > 1 and plain:
        crosses = cluster.replicas_cross(P, [rank])
        total = sum(p.nbytes for p in plain)
        bucket_bytes = config.grad_bucket_bytes or default_bucket_bytes(total)
        # sharded: a reduce-scatter per bucket now, an all-gather per bucket after the step (same bytes in all)
        reduce = network.reduce_scatter if config.zero_stage == 1 else network.allreduce
        clock, filled = 0.0, 0
        for size in _bucket_sizes([p.nbytes for p in plain], bucket_bytes):
            filled += size
            ready = last_backward + backward_s * filled / total if config.overlap_grad_sync else end
            clock = max(clock, ready) + reduce(size, D, crosses, cluster.sharing(P))
            if config.zero_stage == 1:
                gather_s += network.all_gather(size, D, crosses, cluster.sharing(P))
        done = max(done, clock)
    if tied:
        rank_of = {i: r for r, held_by in enumerate(held_segments) for i in held_by}
        holders = sorted({rank_of[i] for p in tied for i in p.segments})
        crosses = cluster.replicas_cross(P, holders)
        nbytes = sum(p.nbytes for p in tied)
        done = max(done, end + network.allreduce(nbytes, D * len(holders), crosses))
    return done, gather_s


def _bucket_sizes(sizes: list[int], bucket_bytes: int) -> list[int]:
    buckets: list[int] = []
    for size in sizes:
        if not buckets or buckets[-1] + size > bucket_bytes:
            buckets.append(0)
        buckets[-1] += size
    return buckets
