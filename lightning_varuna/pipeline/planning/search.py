"""Auto-configuration's search: every valid configuration predicted (:func:`~.prediction.predict`) and ranked.

:func:`search` ranks them; the fastest that fits in memory is chosen. The shapes searched: every P that divides the
world size (or the given one), 1 or 2 model chunks per rank (or the given count), every micro-batch count that
divides the replica's batch (or the given size or count), every schedule that runs the shape, with and without
recompute (or the given values).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_varuna.pipeline.config import AUTO, EngineConfig
from lightning_varuna.pipeline.model.dry_run import PartitionError
from lightning_varuna.pipeline.planning.candidates import Candidate, Cluster, PlanError, Prediction
from lightning_varuna.pipeline.planning.memory_model import format_bytes
from lightning_varuna.pipeline.planning.prediction import predict, recomputed_segments, stage_ranges
from lightning_varuna.pipeline.planning.profile_data import Profile
from lightning_varuna.pipeline.scheduling.schedules import (
    SCHEDULES,
    ScheduleError,
    check_schedule_shape,
    make_schedule,
    schedule_spec,
)

__all__ = ["Candidate", "Cluster", "PlanError", "Prediction", "format_table", "predict", "search",
           "stage_ranges"]

MAX_MICROBATCHES = 256
"""The search does not consider more micro-batches per step than this."""


# -- search ---------------------------------------------------------------------------------------------------
def search(
    profile: Profile,
    cluster: Cluster,
    config: EngineConfig,
    memory_limit: int,
    replica_batch_size: int | None = None,
    wire_bytes_per_element: float = 1.0,
) -> list[Candidate]:
    """Every valid configuration, ranked: those that fit in memory by predicted step time, then the others.

    Args:
        profile: The model's profile.
        cluster: Where the job runs.
        config: What is searched (``"auto"``: P, micro-batches, schedule, recompute, chunks per rank) and what is
            fixed (any other value); ``global_batch_size`` (each replica gets ``global / D``) is needed when P is
            searched.
        memory_limit: Bytes a stage may use.
        replica_batch_size: Samples per step and replica, when no global batch is given (P fixed).
        wire_bytes_per_element: Bytes on the wire per byte of an activation (``boundary_dtype``).

    Raises:
        PlanError: If no configuration is valid (the message says why).
    """
    global_batch_size = config.global_batch_size
    if config.pipeline_parallel_size == AUTO and global_batch_size is None:
        raise PlanError("choosing pipeline_parallel_size needs global_batch_size: D = world size / P sets each"
                        " replica's batch. Give global_batch_size, or a fixed pipeline_parallel_size.")
    candidates, reasons = [], []
    for P in _pipeline_sizes(profile, cluster, config):
        D = cluster.world_size // P
        batch = global_batch_size // D if global_batch_size is not None else replica_batch_size
        if global_batch_size is not None and global_batch_size % D:
            reasons.append(f"P={P}: global_batch_size={global_batch_size} does not split over D={D} replicas")
            continue
        assert batch is not None
        for v in _chunk_counts(P, config):
            for m in _microbatch_counts(batch, P, config):
                try:
                    found = _candidates(profile, cluster, config, P, v, batch, m, memory_limit, wire_bytes_per_element)
                except PartitionError as err:
                    reasons.append(f"P={P}" + (f" x {v} chunks per rank" if v > 1 else "") + f": {err}")
                    break
                candidates.extend(found)
                if not found and v > 1:
                    reasons.append(f"P={P}, m={m}: no schedule of {v} chunks per rank runs this shape")
    if not candidates:
        raise PlanError("no valid configuration for " f"{cluster.world_size} process(es): " + "; ".join(reasons[:4]))
    order = {name: i for i, name in enumerate(SCHEDULES)}
    # ties (equal predicted times) go to the smaller peak, then to fewer stages, micro-batches and chunks
    return sorted(candidates, key=lambda c: (not c.fits, c.step_s if c.fits else 0.0, max(c.peak_bytes),
                                             c.pipeline_size, c.num_microbatches, c.stages_per_rank,
                                             order[c.schedule], not c.recompute))


def _candidates(profile: Profile, cluster: Cluster, config: EngineConfig, P: int, v: int, batch: int, m: int,
                memory_limit: int, wire_bytes_per_element: float) -> list[Candidate]:
    """The predicted candidates of one shape (P, v, m): one per schedule and recompute that can run it."""
    found, seen = [], set()
    degrees = _degrees(profile, P, v, batch / m, config)
    for schedule, recompute in _schedules(P, v, config, degrees):
        try:
            check_schedule_shape(schedule, P, v, m)
        except ScheduleError:
            continue
        # repr: True and 1 (recompute by one segment) are different choices
        same = (make_schedule(schedule, P, m, recompute is not False, stages_per_rank=v,
                       forwards_keep_graphs=not isinstance(recompute, bool)),
                repr(recompute) if P > 1 else "")
        if same in seen:  # e.g. gpipe with one micro-batch runs what varuna runs
            continue
        seen.add(same)
        candidate = predict(profile, cluster, P, batch / m, m, schedule, recompute, config, v,
                            wire_bytes_per_element).candidate
        found.append(_with_fit(candidate, max(candidate.peak_bytes) <= memory_limit))
    return found


MAX_DEGREES = 4
"""With ``recompute="auto"`` at most this many degrees (recompute by degree) are searched per shape."""


def _degrees(profile: Profile, P: int, v: int, microbatch_size: float, config: EngineConfig) -> list[int]:
    """The degrees searched with ``recompute="auto"`` (recompute by degree).

    Numbers of segments below the longest non-last stage's, spread over that range, less those whose recomputed part
    a parameter-derived value would cross.
    """
    if config.recompute != AUTO or P == 1:
        return []
    ranges = stage_ranges(profile, P * v, microbatch_size, config.partition)
    longest = max(len(r) for r in ranges[:-1])
    spread = sorted({max(1, round(i * (longest - 1) / MAX_DEGREES)) for i in range(1, MAX_DEGREES + 1)})
    valid = []
    for n in (d for d in spread if d < longest):
        try:
            recomputed_segments(ranges, n, profile.crossings)
        except PartitionError:
            continue
        valid.append(n)
    return valid


def _with_fit(candidate: Candidate, fits: bool) -> Candidate:
    return candidate if fits else Candidate(**{**candidate.__dict__, "fits": False})


def _pipeline_sizes(profile: Profile, cluster: Cluster, config: EngineConfig) -> list[int]:
    if isinstance(config.pipeline_parallel_size, int):
        return [config.pipeline_parallel_size]
    limit = min(cluster.world_size, profile.num_segments)
    return [p for p in range(1, limit + 1) if cluster.world_size % p == 0]


def _microbatch_counts(batch: int, P: int, config: EngineConfig) -> list[int]:
    if config.num_microbatches is not None:
        return [config.num_microbatches] if config.num_microbatches <= batch else []
    size = config.microbatch_size
    if isinstance(size, int):
        return [max(1, math.ceil(batch / size))]
    if size is None:
        return [max(1, min(2 * P, batch))]
    return [m for m in range(1, min(batch, MAX_MICROBATCHES) + 1) if batch % m == 0]


def _chunk_counts(P: int, config: EngineConfig) -> list[int]:
    v = config.stages_per_rank
    if isinstance(v, int):
        return [v] if P > 1 or v == 1 else []
    return [1, 2] if P > 1 else [1]


def _schedules(P: int, v: int, config: EngineConfig, degrees: Sequence[int] = ()) -> list[tuple[str, bool | int]]:
    if v > 1:
        fitting = [s for s in SCHEDULES if schedule_spec(s).runs_several_chunks]
    else:
        fitting = [s for s in SCHEDULES if not schedule_spec(s).needs_several_chunks]
    schedules = [config.schedule] if config.schedule != AUTO else fitting
    if P == 1 and config.schedule == AUTO:
        schedules = ["varuna", "gpipe"]  # one stage: 1f1b runs the same order as varuna
    recomputes: list[bool | int] = (
        [config.recompute] if not isinstance(config.recompute, str) else [False] if P == 1 else [True, False, *degrees])
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
    header = ("rank", "P", "D", "v", "mbs", "m", "schedule", "recompute", "step ms", "bubble", "peak per rank",
              "optimizer state", "fits")
    rows = [header]
    shown = list(candidates if limit is None else candidates[:limit])
    for rank, c in enumerate(shown, 1):
        peaks = "/".join(format_bytes(b).replace(" ", "") for b in c.peak_bytes)
        # the part of the peak the optimizer keeps (1/D of it with zero_stage=1), per rank
        states = "/".join(format_bytes(m.optimizer).replace(" ", "") for m in c.memory)
        rows.append((str(rank), str(c.pipeline_size), str(c.data_size), str(c.stages_per_rank), str(c.microbatch_size),
                     str(c.num_microbatches), c.schedule, _recompute_cell(c.recompute), f"{c.step_s * 1e3:.2f}",
                     f"{c.bubble:.1%}", peaks, states, "yes" if c.fits else "no"))
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


def _recompute_cell(recompute: bool | int) -> str:
    return "yes" if recompute is True else "no" if recompute is False else f"{recompute} seg"
