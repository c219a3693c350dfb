"""Choosing the configuration at setup: profile (or load), measure the network, search, and agree on every rank.

:func:`choose` runs inside :meth:`PipelineEngine.setup <lightning_varuna.pipeline.engine.PipelineEngine.setup>`,
after the dry run and before the process grid exists. Every rank measures the network together
(:func:`~lightning_varuna.pipeline.planning.profiler.measure_network`); rank 0 alone takes the profile (from the given
file, the cache, or by measuring it while the other ranks wait) and runs the search; its outcome, or its error,
is broadcast, so every rank uses the same configuration or raises the same error.
"""

from __future__ import annotations

import hashlib
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_varuna.failstop.failures import PipelineError
from lightning_varuna.pipeline.config import AUTO, EngineConfig, ScheduleName
from lightning_varuna.pipeline.engine_inputs import OptimizerSpec
from lightning_varuna.pipeline.model.dry_run import Trace
from lightning_varuna.pipeline.planning.memory_model import (
    MEMORY_RESERVE,
    default_memory_limit,
    parse_bytes,
    planning_budget,
)
from lightning_varuna.pipeline.planning.profile_data import (
    Network,
    Profile,
    ProfileError,
    load_cached,
    machine_description,
    store_cached,
    structure_key,
)
from lightning_varuna.pipeline.planning.profiler import measure_network, profile_model, profile_sizes
from lightning_varuna.pipeline.planning.search import (
    Candidate,
    Cluster,
    PlanError,
    Prediction,
    predict,
    search,
)

__all__ = ["OptimizerSpec", "PlannerChoice", "choose", "model_key", "plan"]



@dataclass(frozen=True)
class PlannerChoice:
    """The planner's answer: the user's config with every ``"auto"`` filled in, and what it was chosen from.

    Attributes:
        config: The configuration the engine runs: the :class:`EngineConfig` it was given, with the chosen values in
            place of ``"auto"`` (and P, chunks per rank and schedule as the chosen candidate has them).
        chosen: The chosen configuration's predicted figures.
        ranking: Every valid configuration, best first (``ranking[0] is chosen``).
        profile: The profile planned from (with the network measured for this job).
        cluster: The processes planned for.
        memory_limit: Bytes a stage may use; the search kept predicted peaks within
            :func:`~lightning_varuna.pipeline.planning.memory_model.planning_budget` of it.
        source: Where the profile came from: ``"file"``, ``"cache"`` or ``"measured"``.
        seconds: Time to profile (or load) and search, on rank 0.
        replica_batch_size: The replica's batch, when no global batch was given.
        wire_bytes_per_element: Bytes on the wire per byte of an activation (``boundary_dtype``).
    """

    config: EngineConfig
    chosen: Candidate
    ranking: tuple[Candidate, ...]
    profile: Profile
    cluster: Cluster
    memory_limit: int
    source: str
    seconds: float
    replica_batch_size: int = 0
    wire_bytes_per_element: float = 1.0

    @property
    def global_batch_size(self) -> int | None:
        """The global batch planned for (None: the replica's batch was fixed)."""
        return self.config.global_batch_size

    @property
    def mean_microbatch_size(self) -> float:
        """The chosen micro-batches' mean size (the replica's batch over their number)."""
        c = self.chosen
        batch = self.global_batch_size // c.data_size if self.global_batch_size is not None else self.replica_batch_size
        return batch / c.num_microbatches

    def segment_costs(self) -> list[float]:
        """The per-segment costs the planner balanced the chosen stages by."""
        return self.profile.segment_costs(self.mean_microbatch_size)

    def prediction(self) -> Prediction:
        """The chosen configuration's predicted step, for its timeline."""
        c = self.chosen
        return predict(self.profile, self.cluster, c.pipeline_size, self.mean_microbatch_size, c.num_microbatches,
                       c.schedule, c.recompute, self.config, c.stages_per_rank, self.wire_bytes_per_element)


def _filled(config: EngineConfig, chosen: Candidate) -> EngineConfig:
    """``config`` with the chosen values in place of ``"auto"``."""
    micro = chosen.microbatch_size if config.microbatch_size == AUTO else config.microbatch_size
    recompute = chosen.recompute if config.recompute == AUTO else config.recompute
    schedule = cast(ScheduleName, chosen.schedule)  # a candidate's schedule is one of the names
    return replace(config, pipeline_parallel_size=chosen.pipeline_size, microbatch_size=micro, schedule=schedule,
                   recompute=recompute, stages_per_rank=chosen.stages_per_rank)


def choose(
    config: EngineConfig,
    module: nn.Module,
    trace: Trace,
    step_on: Callable[[int], Any],
    loss_of: Callable[[Any], Tensor],
    replica_batch_size: int,
    device: torch.device,
    optimizer: OptimizerSpec | None = None,
) -> PlannerChoice:
    """Chooses the configuration (collective when a process group is initialised; see the module's docstring).

    The arguments are :func:`plan`'s; the cluster is the process group's (``config.devices_per_node`` per node)
    and the network is measured, unless ``config.profile`` brings one.

    Raises:
        PlanError: On every rank, if no configuration is valid or none fits in memory.
        ProfileError: On every rank, if the given profile does not fit the model.
    """
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    cluster = Cluster(world, config.devices_per_node or world)
    # a given profile brings its network; otherwise every rank takes part in measuring this job's
    network = measure_network(device, cluster.devices_per_node) if config.profile is None else None
    outcome: PlannerChoice | BaseException | None = None
    if _rank() == 0:
        try:
            outcome = plan(config, module, trace, step_on, loss_of, replica_batch_size, device, optimizer, cluster,
                           network)
        except (PlanError, ProfileError, PipelineError) as err:
            outcome = err
        except Exception as err:  # noqa: BLE001 - reported on every rank, not only here
            outcome = PipelineError(f"Profiling the model for auto-configuration failed on rank 0: "
                                    f"{type(err).__name__}: {err}")
    if world > 1:
        box = [outcome]
        dist.broadcast_object_list(box, src=0)
        outcome = box[0]
    if isinstance(outcome, BaseException):
        raise outcome
    return cast(PlannerChoice, outcome)  # rank 0 planned one or raised, and every rank got its outcome


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def plan(config: EngineConfig, module: nn.Module, trace: Trace, step_on: Callable[[int], Any],
         loss_of: Callable[[Any], Tensor], replica_batch_size: int, device: torch.device,
         optimizer: OptimizerSpec | None, cluster: Cluster, network: Network | None) -> PlannerChoice:
    """Takes the profile (the given file, the cache, or measured here) and searches; one process, no collective.

    Args:
        config: The engine's options (``"auto"`` where the planner chooses).
        module: The whole model.
        trace: The dry run's trace.
        step_on: Runs the user's step on a batch of ``n`` samples (for the profile).
        loss_of: The loss in a step's output.
        replica_batch_size: The batch of one replica, used when no global batch is given.
        device: Where the model runs.
        optimizer: The model's optimizer class and keyword arguments (default: AdamW).
        cluster: The processes to plan for.
        network: The network to plan with (None: the given profile's, or the stated defaults).

    Raises:
        PlanError: If no configuration is valid or none fits in memory.
        ProfileError: If the given profile does not fit the model.
    """
    start = time.perf_counter()
    searched, wire = _searched(config, trace, cluster)
    if config.profile is not None:
        profile, source = Profile.load(config.profile), "file"
        _check_fits(profile, trace, config.profile)
    else:
        largest = config.global_batch_size or replica_batch_size
        key = model_key(module, trace, device, optimizer, largest)
        cached = load_cached(key)
        if cached is not None:
            profile, source = cached, "cache"
        else:
            sizes = profile_sizes(largest)
            profile = profile_model(module, step_on, loss_of, trace, sizes, device, optimizer, key=key,
                                    param_init_fn=config.param_init_fn)
            store_cached(profile)
            source = "measured"
    if network is not None:
        profile = replace(profile, network=network)
    limit = parse_bytes(config.memory_limit) if config.memory_limit is not None else default_memory_limit(
        device, cluster.devices_per_node)
    budget = planning_budget(limit)
    ranking = search(profile, cluster, searched, budget, replica_batch_size, wire)
    if not ranking[0].fits:
        smallest = min(ranking, key=lambda c: max(c.peak_bytes))
        raise PlanError(
            f"No configuration fits in memory_limit={limit} bytes per stage: the smallest predicted peak is "
            f"{max(smallest.peak_bytes)} bytes ({smallest.describe()}), and the planner keeps "
            f"{MEMORY_RESERVE:.0%} of the limit in reserve (a peak may reach {budget} bytes). Raise memory_limit,"
            " use more devices, allow recompute, or add cut points."
        )
    return PlannerChoice(_filled(config, ranking[0]), ranking[0], tuple(ranking), profile, cluster, limit, source,
                         time.perf_counter() - start, replica_batch_size, wire)


def _searched(config: EngineConfig, trace: Trace, cluster: Cluster) -> tuple[EngineConfig, float]:
    """``config`` as the search takes it, and the bytes on the wire per byte of an activation.

    With P "auto" and no global batch to choose it by, P is the engine's own default.
    """
    if config.pipeline_parallel_size == AUTO and config.global_batch_size is None:
        size = config.pipeline_size_for(cluster.world_size, trace.num_segments)
        config = replace(config, pipeline_parallel_size=size)
    wire = 1.0
    if config.boundary_dtype is not None and trace.cuts:
        wire = _element_size(config.boundary_dtype) / _element_size(trace.cuts[0].dtype)
    return config, wire


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _check_fits(profile: Profile, trace: Trace, path: str | None) -> None:
    params = [p.name for p in profile.params]
    if profile.num_segments != trace.num_segments or params != list(trace.param_numel):
        raise ProfileError(
            f"The profile {path!r} is of another model: {profile.num_segments} segment(s) and {len(params)}"
            f" parameter(s), this model has {trace.num_segments} and {len(trace.param_numel)}. Measure a profile"
            " for this model (leave profile unset), or give its own file."
        )


def model_key(module: nn.Module, trace: Trace, device: torch.device, optimizer: OptimizerSpec | None,
              largest: int) -> str:
    """The cache key: the model's structure and code, the cut points, the machine, the optimizer, the sizes."""
    params = [(name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in module.named_parameters()]
    cuts = [(c.name, c.shape, str(c.dtype), c.batch_dim) for c in trace.cuts]
    code = sorted({_source_hash(type(m)) for m in module.modules()})
    optimizer_name = f"{optimizer[0].__module__}.{optimizer[0].__qualname__}:{optimizer[1]}" if optimizer else "AdamW"
    return structure_key(params, cuts, code, machine_description(device), optimizer_name, profile_sizes(largest))


def _source_hash(cls: type) -> str:
    try:
        return hashlib.sha256(Path(inspect.getfile(cls)).read_bytes()).hexdigest()[:16]
    except (OSError, TypeError):
        return f"{cls.__module__}.{cls.__qualname__}"
