"""The pipeline engine's setup: the dry run, P (or the planner's choice), the process grid, the partition, the stage.

:class:`StageSetup` holds :meth:`~lightning_varuna.pipeline.engine.PipelineEngine.setup` and its parts;
:class:`~lightning_varuna.pipeline.engine.PipelineEngine` inherits them (its ``__init__`` sets the attributes used
here).
"""

from __future__ import annotations

import os
import uuid
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_varuna.failstop.failures import destroy_process_groups_at_exit
from lightning_varuna.failstop.job_watchdog import watch_job
from lightning_varuna.pipeline.batches import batch_size_of, check_batch, default_loss, first_samples, samples
from lightning_varuna.pipeline.comm.events import P2P_TRACE_ENV, EventHooks, P2PTraceWriter
from lightning_varuna.pipeline.comm.grad_sync import GradientSync
from lightning_varuna.pipeline.comm.initial_sync import broadcast_initial_state
from lightning_varuna.pipeline.comm.sharded_sync import ShardedGradientSync
from lightning_varuna.pipeline.comm.transfers import P2P, HostStaging
from lightning_varuna.pipeline.config import EngineConfig
from lightning_varuna.pipeline.engine_inputs import Chosen, OptimizerSpec, Planner
from lightning_varuna.pipeline.model.cut import CutPoint, check_cut_at_order, install_cut_at
from lightning_varuna.pipeline.model.dry_run import Trace, time_segments, trace_step
from lightning_varuna.pipeline.model.meta_init import (
    has_meta_tensors,
    materialize,
    to_meta,
    trace_unmaterialized,
)
from lightning_varuna.pipeline.model.no_trace import no_trace
from lightning_varuna.pipeline.model.partition import Partition, check_pipeline_size, make_partition
from lightning_varuna.pipeline.model.segment_costs import DeviceRates
from lightning_varuna.pipeline.model.stand_ins import apply_partition
from lightning_varuna.pipeline.runtime.executor import StageExecutor
from lightning_varuna.pipeline.runtime.fused_linear_grad import MIN_FUSED_NUMEL, install_grad_accumulation
from lightning_varuna.pipeline.runtime.links import Chunk
from lightning_varuna.pipeline.runtime.recompute import grad_from_cut
from lightning_varuna.pipeline.runtime.side_value_hooks import SideValueHooks
from lightning_varuna.pipeline.runtime.side_values import side_values_kept, side_values_sent
from lightning_varuna.pipeline.scheduling.placement import LOOPED, V_SHAPED
from lightning_varuna.pipeline.scheduling.schedules import placement_of, schedule_spec, stage_ranks
from lightning_varuna.pipeline.topology import Topology
from lightning_varuna.pipeline.varuna_warning import VarunaWarning

__all__ = ["StageSetup"]


class StageSetup:
    """:meth:`setup` of :class:`~lightning_varuna.pipeline.engine.PipelineEngine`, with its parts."""

    # set by PipelineEngine.__init__ (the parts of a stage are None until setup makes them)
    config: EngineConfig
    planner: Planner | None
    autoconfig: Chosen | None
    topology: Topology | None
    partition: Partition | None
    executor: StageExecutor | None
    grad_sync: GradientSync | None
    _pipeline_size: int | None
    module: nn.Module
    device: torch.device
    events: EventHooks

    if TYPE_CHECKING:  # PipelineEngine's
        @property
        def pipeline_size(self) -> int:
            """P, known once setup has chosen it."""
            ...

        def microbatches_for(self, batch_size: int, train: bool = True) -> int:
            """The number of micro-batches of a batch of ``batch_size`` samples."""
            ...

    _hooks: Sequence[RemovableHandle | SideValueHooks]
    _p2p_run: str

    def _stages_per_rank(self) -> int:
        """``config.stages_per_rank``, a number once the dry run has resolved ``"auto"``."""
        return cast(int, self.config.stages_per_rank)

    # -- setup --------------------------------------------------------------------------------------------
    def setup(self, sample_batch: Any, step: Callable[[Any], Any], topology: Topology | None = None,
              optimizer: OptimizerSpec | None = None) -> Partition:
        """Dry-runs ``step`` on a slice of ``sample_batch``, partitions, and keeps only this rank's stage.

        Every replica's copy of the stage then takes replica 0's parameters and buffers, and every copy of a
        parameter held by several stages its first holder's (as ``DistributedDataParallel`` broadcasts rank 0's
        state), so the replicas train one model whatever the seeding. Every rank must call it (it is
        collective). Errors in the model are raised on every rank before any rank waits on another; from the
        first wait on, a rank that dies or fails ends every rank (:mod:`~lightning_varuna.failstop.watchdog`). With
        ``"auto"`` values the model is profiled and the configuration chosen (:attr:`autoconfig`) before the process
        grid is made.

        Args:
            sample_batch: A batch like the training batches (on this rank's device).
            step: Runs the user's step on a (micro-)batch; the dry run calls it on 1 and 2 samples.
            topology: The process grid (created from the default process group if not given).
            optimizer: The optimizer's class and keyword arguments, for the planner's costs (default: AdamW).

        Returns:
            The partition (identical on every rank).
        """
        config = self.config
        # everything that can be wrong with the model is checked before the first collective call
        link_backend = config.link_backend(self.device)
        check_batch(sample_batch)  # a value that cannot follow its samples into the micro-batches
        if config.cut_at is not None:
            self._cuts, self._hooks = install_cut_at(self.module, config.cut_at)
        self.built_on_meta = has_meta_tensors(self.module)
        trace, cut_modules = self._dry_run(sample_batch, step, topology, optimizer)
        config = self.config  # with the planner's choices in place of "auto"
        for cut, info in zip(cut_modules, trace.cuts, strict=True):
            cut._varuna_name = info.name  # names cut points in runtime errors
        # from the first wait on another rank on, a rank that dies or fails ends every rank within seconds
        watch_job()
        placement = placement_of(config.schedule) if self._stages_per_rank() > 1 else LOOPED
        self.topology = topology or Topology.create(
            self.pipeline_size, self.device, timeout=config.p2p_timeout, link_backend=link_backend,
            wrap_around=self._stages_per_rank() > 1 and placement == LOOPED,  # V-shaped: neighbours only
        )
        self.topology.last_position = 0 if placement == V_SHAPED else None
        destroy_process_groups_at_exit()
        topo = self.topology
        seed = config.init_seed if config.init_seed is not None else torch.initial_seed()
        run = uuid.uuid4().hex[:12]
        if topo.world_size > 1:
            # measured times differ between ranks: everyone uses rank 0's, so the partition is the same everywhere
            shared: list[Any] = [trace.segment_seconds, seed, run]
            dist.broadcast_object_list(shared, src=0)
            trace.segment_seconds, seed, run = shared
        size = batch_size_of(sample_batch)
        m = self.microbatches_for(size)
        if config.num_microbatches is not None and m < config.num_microbatches and topo.rank == 0:
            # a short last batch is expected; a usual batch this small is likely a mistake worth a word
            warnings.warn(
                f"The batch of {size} sample(s) is split into {m} micro-batch(es), fewer than num_microbatches="
                f"{config.num_microbatches}: batches smaller than that run one micro-batch per sample. Use a batch"
                f" size >= {config.num_microbatches} or fewer micro-batches.",
                VarunaWarning,
                stacklevel=2,
            )
        v = self._stages_per_rank()
        self.partition = make_partition(trace, topo.pipeline_size * v, by=self.config.partition,
                              microbatch=max(1, size // m), num_microbatches=m, rates=DeviceRates.nominal(self.device),
                              stages_per_rank=v, placement=placement)
        if self.config.recompute_segments is not None:  # every rank checks every stage: each raises the error
            for s, stage in enumerate(self.partition.stages[:-1]):
                grad_from_cut(stage.segments.start - 1 if s else None, stage.segments.stop - 1,
                              self.config.recompute_segments, trace.crossings)
        if self.built_on_meta:
            self._materialize(self.partition.rank_params(topo.stage), seed)
        chunks = self._chunks(trace)
        self._p2p_run = run
        self._trace_p2p(run)
        self.executor = StageExecutor(topo, self._p2p(), cut_modules, None, None, self.events, chunks=chunks,
                                      stage_ranks=stage_ranks(topo.pipeline_size, v, config.schedule))
        self.executor.boundary_dtype = self.config.boundary_dtype
        self.executor.recompute_policy = self.config.recompute_policy
        self._stand_ins = apply_partition(self.module, self.partition, topo.stage, self.executor.segment, self.device)
        if any(c.sides_in or c.sides_out for c in chunks):
            self._hooks = [*self._hooks, SideValueHooks(self.module, chunks)]
        held = dict(self.module.named_parameters())
        self.executor.chunks = [
            replace(c, params=tuple(held[n] for n in self.partition.stages[c.stage].params if n in held))
            for c in chunks
        ]
        if self.config.fuse_grad_accumulation:
            # a held-back weight gradient (zero-bubble's W) needs the in-place path whatever the weight's size
            min_numel = 0 if schedule_spec(config.schedule).split_backward else MIN_FUSED_NUMEL
            self._accumulating = install_grad_accumulation(self.module, min_numel)
        self._batch_dims = chunks[0].batch_dims
        # whatever the user's seeding, every replica of a stage (and every copy of a tied parameter) starts equal
        broadcast_initial_state(topo, self.module, self.partition.rank_tied)
        sync_class = ShardedGradientSync if self.config.zero_stage == 1 and topo.data_size > 1 else GradientSync
        self.grad_sync = sync_class(topo, dict(self.module.named_parameters()), self.partition.rank_tied,
                                    bucket_bytes=self.config.grad_bucket_bytes, overlap=self.config.overlap_grad_sync)
        return self.partition

    def _chunks(self, trace: Trace) -> list[Chunk]:
        """The stages this rank runs: where each one's forward starts and ends, and its boundaries' dtypes."""
        assert self.partition is not None and self.topology is not None
        last_stage = len(self.partition.stages) - 1
        sides_out = side_values_sent(trace.side_values, [stage.segments for stage in self.partition.stages])
        chunks = []
        for s in self.partition.rank_stages(self.topology.stage):
            segments = self.partition.stages[s].segments
            first = segments.start - 1 if s > 0 else None
            last = segments.stop - 1 if s < last_stage else None
            grad_from = grad_from_cut(first, last, self.config.recompute_segments, trace.crossings)
            chunks.append(Chunk(
                stage=s, first_cut=first, last_cut=last,
                sides_in=sides_out[s - 1] if s > 0 else (), sides_out=sides_out[s],
                sides_kept=side_values_kept(trace.side_values, segments, grad_from), grad_from=grad_from,
                input_dtype=trace.cuts[first].dtype if first is not None else None,
                batch_dims=(trace.cuts[first].batch_dim if first is not None else None,
                            trace.cuts[last].batch_dim if last is not None else None),
            ))
        return chunks

    def _dry_run(self, sample_batch: Any, step: Callable[[Any], Any], topology: Topology | None,
                 optimizer: OptimizerSpec | None) -> tuple[Trace, list[CutPoint]]:
        """Traces the step (on meta for a model built there), resolves P or plans ``"auto"``, times the segments."""
        config = self.config
        names = {id(m): n for n, m in self.module.named_modules()}
        cut_names = {id(c): getattr(c, "_varuna_name", names.get(id(c), "")) for c in self._cuts}
        with no_trace(self.module, self.device):  # the dry run changes no state of the model, nor the RNGs
            if self.built_on_meta:
                meta_batch = to_meta(sample_batch)
                trace, cut_modules = trace_unmaterialized(
                    self.module, lambda n: step(first_samples(meta_batch, n)),
                    lambda n: step(first_samples(sample_batch, n)), self.device, cut_names,
                )
            else:
                trace, cut_modules = trace_step(self.module, lambda n: step(first_samples(sample_batch, n)),
                                                cut_names=cut_names)
            check_cut_at_order(self._cuts, cut_modules)
            world = topology.world_size if topology is not None else _world_size()
            if config.searches and topology is None:  # a model on meta is profiled a segment at a time
                self._autoconfigure(trace, sample_batch, step, optimizer)
                config = self.config
            else:
                self._pipeline_size = topology.pipeline_size if topology is not None else config.pipeline_size_for(
                    world, trace.num_segments
                )
            check_pipeline_size(trace, self.pipeline_size * self._stages_per_rank(), self._stages_per_rank())
            if self.autoconfig is not None:
                if config.partition == "time":  # the planner's costs, so that its stages are the ones made
                    trace.segment_seconds = self.autoconfig.segment_costs()
            elif config.partition == "time" and trace.cuts and not self.built_on_meta:
                size = batch_size_of(sample_batch)
                micro = max(1, size // self.microbatches_for(size))
                trace.segment_seconds = time_segments(lambda: step(first_samples(sample_batch, micro)))
        return trace, cut_modules

    def _materialize(self, keep: tuple[str, ...], seed: int) -> None:
        assert self.topology is not None
        missing = materialize(self.module, keep, self.device, seed, self.config.param_init_fn)
        if missing and self.topology.replica == 0:
            warnings.warn(
                f"Stage {self.topology.stage}: the parameters of {', '.join(sorted(missing))} were materialized as"
                " zeros: these modules have no reset_parameters() and no param_init_fn was given. Give a"
                " param_init_fn that initializes a module's own parameters, or load pretrained weights.",
                VarunaWarning,
                stacklevel=3,
            )

    def regroup(self, generation: int) -> None:
        """Rebuilds every process group the stage talks over, after in-place recovery made a new default group.

        This rank keeps its stage, its parameters and the partition; its replica and rank may change. The
        transport, the lowered message orders (they name peer ranks) and the gradient sync are made again.
        """
        topo = self.topology
        assert topo is not None and self.executor is not None and self.partition is not None
        topo.remake()
        self.executor.p2p.close(join=False)
        self.executor.p2p = self._p2p()
        self.executor.forget_links()
        for writer in [r for r in self.events.recorders if isinstance(r, P2PTraceWriter)]:
            self.events.remove(writer)
        self._trace_p2p(f"{self._p2p_run}-{generation}")  # a new run: the new world's ranks
        self.grad_sync = GradientSync(topo, dict(self.module.named_parameters()), self.partition.rank_tied,
                                      bucket_bytes=self.config.grad_bucket_bytes, overlap=self.config.overlap_grad_sync)

    def _p2p(self) -> P2P:
        """The transport; on a CUDA device whose links run on gloo, staged through pinned host memory."""
        topo = self.topology
        assert topo is not None
        staging = None
        if self.device.type == "cuda" and topo.pipeline_size > 1:
            group = next(iter(topo.links.values()), None)
            if dist.get_backend(group) == "gloo":
                staging = HostStaging(pin=True)
        return P2P(topo, self.config.p2p_timeout, self.events, staging)

    def _trace_p2p(self, run: str) -> None:
        """In the NCCL-rules mode (:data:`~.comm.events.P2P_TRACE_ENV`), records the p2p trace."""
        directory = os.environ.get(P2P_TRACE_ENV)
        topo = self.topology
        if directory and topo is not None and topo.pipeline_size > 1:
            self.events.add(P2PTraceWriter(directory, run, topo.rank, topo.world_size))

    def _autoconfigure(self, trace: Any, sample_batch: Any, step: Callable[[Any], Any],
                       optimizer: OptimizerSpec | None) -> None:
        """Lets the planner choose the ``"auto"`` values (collective)."""
        assert self.planner is not None  # PipelineEngine refuses a config that searches without one
        self.autoconfig = self.planner(
            self.config, self.module, trace, lambda n: step(samples(sample_batch, n)), default_loss,
            batch_size_of(sample_batch), self.device, optimizer,
        )
        self.config = self.autoconfig.config
        self._pipeline_size = cast(int, self.config.pipeline_parallel_size)  # the planner's choice


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
