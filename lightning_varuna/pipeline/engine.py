"""The pipeline engine: partition a model, run schedules on batches, sync gradients. No Lightning needed.

Typical use, on every rank of an initialised process group::

    engine = PipelineEngine(model, pipeline_parallel_size=2, num_microbatches=4)
    engine.setup(batch, lambda mb: loss_fn(model(mb[0]), mb[1]))
    optimizer = torch.optim.AdamW(engine.parameters())  # this stage's parameters only
    for batch in loader:
        # start_sync: the data-parallel all-reduces start during this stage's last backward (leave it False
        # on batches that only accumulate gradients)
        result = engine.train_step(batch, lambda mb: loss_fn(model(mb[0]), mb[1]), start_sync=True)
        engine.sync_gradients()  # waits for them
        optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_varuna.fault.failures import destroy_process_groups_at_exit
from lightning_varuna.fault.watchdog import current_watchdog, watch_job
from lightning_varuna.pipeline.batches import batch_size_of, default_loss, first_samples, samples, split_batch
from lightning_varuna.pipeline.comm.grad_sync import GradientSync
from lightning_varuna.pipeline.comm.initial_sync import broadcast_initial_state
from lightning_varuna.pipeline.comm.transfers import P2P, HostStaging
from lightning_varuna.pipeline.config import EngineConfig
from lightning_varuna.pipeline.model.cut import CutPoint, install_cut_at
from lightning_varuna.pipeline.model.meta_init import (
    ParamInitFn,
    has_meta_tensors,
    materialize,
    to_meta,
    trace_unmaterialized,
)
from lightning_varuna.pipeline.model.no_trace import no_trace
from lightning_varuna.pipeline.model.partition import (
    Plan,
    Trace,
    check_pipeline_size,
    make_plan,
    time_segments,
    trace_step,
)
from lightning_varuna.pipeline.model.segment_costs import DeviceRates
from lightning_varuna.pipeline.model.stand_ins import apply_plan, remove_stand_ins
from lightning_varuna.pipeline.planning.choice import AutoConfig, OptimizerSpec, choose
from lightning_varuna.pipeline.runtime.events import P2P_TRACE_ENV, EventHooks, P2PTraceWriter
from lightning_varuna.pipeline.runtime.executor import StageExecutor
from lightning_varuna.pipeline.runtime.fused_linear_grad import install_grad_accumulation, remove_grad_accumulation
from lightning_varuna.pipeline.scheduling.schedules import Schedule, make_schedule
from lightning_varuna.pipeline.timelines.timeline import TimelineRecorder
from lightning_varuna.pipeline.topology import Topology

__all__ = ["PipelineEngine", "StepResult", "split_batch", "batch_size_of", "first_samples", "samples", "default_loss"]

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What a step returns on every rank."""

    outputs: list[Any]
    """The step function's output per micro-batch (last stage only; empty elsewhere)."""
    sizes: list[int]
    """The size of each micro-batch."""
    summary: Tensor | None = None
    """The last stage's step summary, on every stage (when one was asked for)."""


class PipelineEngine:
    """Splits a model into pipeline stages and runs schedules over them.

    Args:
        module: The model, with ``CutPoint`` modules where it may be split (or see ``cut_at``). Built with real
            tensors, every rank holds the full model until :meth:`setup`, which keeps only this rank's stage;
            built with its parameters on the meta device (:func:`~lightning_varuna.pipeline.model.meta_init.
            parameters_on_meta`), each rank materializes and initializes only its stage's parameters.
        pipeline_parallel_size: P, the number of stages, or ``"auto"``. D = world size / P.
        num_microbatches: Micro-batches per batch. Default: ``2 * P`` (fewer if the batch is smaller).
        microbatch_size: Alternatively, the size of each micro-batch.
        schedule: ``"varuna"``, ``"1f1b"`` or ``"gpipe"``.
        recompute: Non-last stages keep only their inputs during forwards and recompute before backward.
        cut_at: Dotted path of an ``nn.ModuleList``/``nn.Sequential`` to cut between its children.
        partition: Balance stages by measured ``"time"`` or by ``"params"``.
        p2p_timeout: Seconds a stage waits for a peer before it ends the job with an error.
        device: The device of this rank (default: CPU).
        boundary_dtype: If set, floating-point activations and gradients cross stage boundaries in this dtype
            (e.g. ``torch.bfloat16`` under bf16 autocast: half the bytes) and are cast back on arrival.
        grad_bucket_bytes: Size of a data-parallel all-reduce bucket (default: a quarter of the stage's
            gradient, within 64 KiB-25 MiB; see :func:`~lightning_varuna.pipeline.comm.grad_sync.default_bucket_bytes`).
        overlap_grad_sync: Whether buckets start reducing during the stage's last backward of a
            ``train_step(..., start_sync=True)`` (else all start after the schedule). Switchable later through
            ``engine.grad_sync.overlap``.
        fuse_grad_accumulation: Whether ``nn.Linear`` layers add later micro-batches' weight gradients straight
            into ``.grad`` (no weight-sized temporary; :mod:`~lightning_varuna.pipeline.runtime.fused_linear_grad`).
        max_pipeline_size: With ``pipeline_parallel_size="auto"`` and no ``global_batch_size``, P is at most this.
        param_init_fn: Initializes what a module owns directly, for a model built on the meta device (default:
            the module's ``reset_parameters()``).
        init_seed: The seed of that initialization (default: rank 0's ``torch.initial_seed()``).
        p2p_backend: ``"auto"`` (the default process group's backend), ``"gloo"`` (activations and gradients
            through pinned host memory over gloo, for CUDA jobs) or ``"nccl"``.
        global_batch_size: Samples per step over all replicas; needed to choose P (``"auto"``).
        memory_limit: Bytes (or e.g. ``"80GiB"``) a stage may use; the planner plans within 90% of it.
        profile: A profile file to plan from instead of measuring.
        devices_per_node: Processes per node (default: all on one node).

    With ``"auto"`` for ``microbatch_size``, ``schedule``, ``recompute``, or ``pipeline_parallel_size`` together
    with ``global_batch_size``, :meth:`setup` profiles the model and chooses those values
    (:mod:`lightning_varuna.pipeline.planning.choice`); :attr:`autoconfig` then holds the choice and the ranking.

    The options are checked at once (:class:`~lightning_varuna.pipeline.config.EngineConfig`);
    :meth:`from_config` builds an engine from a config. :attr:`events` is the executor's event hook: recorders
    added there (:mod:`~lightning_varuna.pipeline.runtime.events`) see every task and transfer; there are none by
    default.
    """

    def __init__(
        self,
        module: nn.Module,
        pipeline_parallel_size: int | Literal["auto"] = "auto",
        num_microbatches: int | None = None,
        microbatch_size: int | None = None,
        schedule: str = "varuna",
        recompute: bool = True,
        cut_at: str | None = None,
        partition: str = "time",
        p2p_timeout: float = 300.0,
        device: torch.device | None = None,
        boundary_dtype: torch.dtype | None = None,
        grad_bucket_bytes: int | None = None,
        overlap_grad_sync: bool = True,
        fuse_grad_accumulation: bool = True,
        max_pipeline_size: int | None = None,
        param_init_fn: ParamInitFn | None = None,
        init_seed: int | None = None,
        p2p_backend: str = "auto",
        global_batch_size: int | None = None,
        memory_limit: int | str | None = None,
        profile: str | None = None,
        devices_per_node: int | None = None,
    ) -> None:
        config = EngineConfig(
            pipeline_parallel_size=pipeline_parallel_size, num_microbatches=num_microbatches,
            microbatch_size=microbatch_size, schedule=schedule, recompute=recompute, cut_at=cut_at,
            partition=partition, p2p_timeout=p2p_timeout, boundary_dtype=boundary_dtype,
            grad_bucket_bytes=grad_bucket_bytes, overlap_grad_sync=overlap_grad_sync,
            fuse_grad_accumulation=fuse_grad_accumulation, max_pipeline_size=max_pipeline_size,
            param_init_fn=param_init_fn,
            init_seed=init_seed, p2p_backend=p2p_backend, global_batch_size=global_batch_size,
            memory_limit=memory_limit, profile=profile, devices_per_node=devices_per_node,
        )
        self.config = config
        self.module = module
        self.device = device or torch.device("cpu")
        self.topology: Topology | None = None
        self.plan: Plan | None = None
        self.executor: StageExecutor | None = None
        self.grad_sync: GradientSync | None = None
        self.events = EventHooks()
        """The executor's event hook: add recorders (:mod:`~.runtime.events`) before or after setup."""
        self.autoconfig: AutoConfig | None = None
        """The planner's choice and ranking, when it chose (see :mod:`lightning_varuna.pipeline.planning.choice`)."""
        self.recorder: TimelineRecorder | None = None
        """What each training step did when (see :meth:`record_timeline`); None when not recording."""
        self._pipeline_size = pipeline_parallel_size if pipeline_parallel_size != "auto" else None
        self._cuts: list[CutPoint] = []
        self._hooks: list[Any] = []
        self._stand_ins: list[Any] = []
        self._accumulating: list[nn.Linear] = []
        self._schedules: dict[tuple[int, bool], Schedule] = {}
        self._batch_dims: tuple[int | None, int | None] = (None, None)
        self.built_on_meta = False
        """Whether :meth:`setup` found parameters on the meta device (and materialized this stage's)."""

    @classmethod
    def from_config(cls, module: nn.Module, config: EngineConfig, device: torch.device | None = None) -> PipelineEngine:
        """An engine for ``module`` with the options of ``config``."""
        return cls(module, device=device, **{f.name: getattr(config, f.name) for f in fields(config)})

    @property
    def pipeline_size(self) -> int:
        """P (known once :meth:`setup` has resolved ``"auto"``)."""
        if self._pipeline_size is None:
            raise RuntimeError("pipeline_parallel_size='auto' is resolved by PipelineEngine.setup().")
        return self._pipeline_size

    # -- setup --------------------------------------------------------------------------------------------
    def setup(self, sample_batch: Any, step: Callable[[Any], Any], topology: Topology | None = None,
              optimizer: OptimizerSpec | None = None) -> Plan:
        """Dry-runs ``step`` on a slice of ``sample_batch``, partitions, and keeps only this rank's stage.

        Every replica's copy of the stage then takes replica 0's parameters and buffers, and every copy of a
        parameter held by several stages its first holder's (as ``DistributedDataParallel`` broadcasts rank 0's
        state), so the replicas train one model whatever the seeding. Every rank must call it (it is
        collective). Errors in the model are raised on every rank before any rank waits on another; from the
        first wait on, a rank that dies or fails ends every rank (:mod:`~lightning_varuna.fault.watchdog`). With
        ``"auto"`` values the model is profiled and the configuration chosen (:attr:`autoconfig`) before the process
        grid is made.

        Args:
            sample_batch: A batch like the training batches (on this rank's device).
            step: Runs the user's step on a (micro-)batch; the dry run calls it on 1 and 2 samples.
            topology: The process grid (created from the default process group if not given).
            optimizer: The optimizer's class and keyword arguments, for the planner's costs (default: AdamW).

        Returns:
            The plan (identical on every rank).
        """
        config = self.config
        # everything that can be wrong with the model is checked before the first collective call
        link_backend = config.link_backend(self.device)
        if config.cut_at is not None:
            self._cuts, self._hooks = install_cut_at(self.module, config.cut_at)
        self.built_on_meta = has_meta_tensors(self.module)
        trace, cut_modules = self._dry_run(sample_batch, step, topology, optimizer)
        for cut, info in zip(cut_modules, trace.cuts, strict=True):
            cut._varuna_name = info.name  # type: ignore[assignment] - names cut points in runtime errors
        # from the first wait on another rank on, a rank that dies or fails ends every rank within seconds
        watch_job()
        self.topology = topology or Topology.create(
            self.pipeline_size, self.device, timeout=config.p2p_timeout, link_backend=link_backend
        )
        destroy_process_groups_at_exit()
        topo = self.topology
        seed = config.init_seed if config.init_seed is not None else torch.initial_seed()
        run = uuid.uuid4().hex[:12]
        if topo.world_size > 1:
            # measured times differ between ranks: everyone uses rank 0's, so the plan is the same everywhere
            shared = [trace.segment_seconds, seed, run]
            dist.broadcast_object_list(shared, src=0)
            trace.segment_seconds, seed, run = shared
        size = batch_size_of(sample_batch)
        m = self.microbatches_for(size)
        self.plan = make_plan(trace, topo.pipeline_size, by=self.config.partition, microbatch=max(1, size // m),
                              num_microbatches=m, rates=DeviceRates.nominal(self.device))
        stage = self.plan.stages[topo.stage]
        if self.built_on_meta:
            self._materialize(stage.params, seed)
        first_cut = stage.segments.start - 1 if topo.stage > 0 else None
        last_cut = stage.segments.stop - 1 if not topo.is_last else None
        self._trace_p2p(run)
        self.executor = StageExecutor(topo, self._p2p(), cut_modules, first_cut, last_cut, self.events)
        self.executor.boundary_dtype = self.config.boundary_dtype
        self.executor.input_dtype = trace.cuts[first_cut].dtype if first_cut is not None else None
        self._stand_ins = apply_plan(self.module, self.plan, topo.stage, self.executor.segment, self.device)
        if self.config.fuse_grad_accumulation:
            self._accumulating = install_grad_accumulation(self.module)
        self._batch_dims = (
            trace.cuts[first_cut].batch_dim if first_cut is not None else None,
            trace.cuts[last_cut].batch_dim if last_cut is not None else None,
        )
        # whatever the user's seeding, every replica of a stage (and every copy of a tied parameter) starts equal
        broadcast_initial_state(topo, self.module, self.plan.tied)
        self.grad_sync = GradientSync(topo, dict(self.module.named_parameters()), self.plan.tied,
                                      bucket_bytes=self.config.grad_bucket_bytes,
                                      overlap=self.config.overlap_grad_sync)
        return self.plan

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
            world = topology.world_size if topology is not None else _world_size()
            if config.searches and topology is None:  # a model on meta is profiled a segment at a time
                self._autoconfigure(trace, sample_batch, step, optimizer)
                config = self.config
            else:
                self._pipeline_size = topology.pipeline_size if topology is not None else config.pipeline_size_for(
                    world, trace.num_segments
                )
            check_pipeline_size(trace, self.pipeline_size)
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
                stacklevel=3,
            )

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
        """In the NCCL-rules mode (:data:`~.runtime.events.P2P_TRACE_ENV`), records the p2p trace."""
        directory = os.environ.get(P2P_TRACE_ENV)
        topo = self.topology
        if directory and topo is not None and topo.pipeline_size > 1:
            self.events.add(P2PTraceWriter(directory, run, topo.rank, topo.world_size))

    def _autoconfigure(self, trace: Any, sample_batch: Any, step: Callable[[Any], Any],
                       optimizer: OptimizerSpec | None) -> None:
        """Lets the planner choose the ``"auto"`` values (collective)."""
        self.autoconfig = choose(
            self.config, self.module, trace, lambda n: step(samples(sample_batch, n)), default_loss,
            batch_size_of(sample_batch), self.device, optimizer,
        )
        self.config = self.autoconfig.resolved(self.config)
        self._pipeline_size = self.config.pipeline_parallel_size  # type: ignore[assignment]

    # -- sizes --------------------------------------------------------------------------------------------
    def microbatches_for(self, batch_size: int, train: bool = True) -> int:
        """How many micro-batches a batch of ``batch_size`` is split into."""
        config = self.config
        if config.microbatch_size is not None:
            return max(1, math.ceil(batch_size / config.microbatch_size))
        if config.num_microbatches is not None:
            if batch_size < config.num_microbatches:
                if train:
                    raise ValueError(
                        f"A batch of {batch_size} sample(s) cannot be split into num_microbatches="
                        f"{config.num_microbatches}. Use a batch size >= {config.num_microbatches}, fewer"
                        " micro-batches, or drop_last=True in the DataLoader."
                    )
                return batch_size
            return config.num_microbatches
        return max(1, min(2 * self.pipeline_size, batch_size))

    def _schedule(self, m: int, train: bool) -> Schedule:
        key = (m, train)
        if key not in self._schedules:
            self._schedules[key] = make_schedule(
                self.config.schedule, self.pipeline_size, m, recompute=self.config.recompute and train, train=train
            )
        return self._schedules[key]

    def record_timeline(self, keep: int = 4) -> TimelineRecorder:
        """Starts recording every training step's tasks, waits, sends and gradient sync (after :meth:`setup`).

        Args:
            keep: How many of the latest steps' events the recorder keeps.
        """
        if self.topology is None:
            raise RuntimeError("Call PipelineEngine.setup() before record_timeline().")
        if self.recorder is not None:
            self.events.remove(self.recorder)
        self.recorder = TimelineRecorder(self.topology.stage, self.topology.replica, keep)
        self.events.add(self.recorder)  # it sees the executor's events, and keeps those of training steps
        return self.recorder

    # -- steps --------------------------------------------------------------------------------------------
    def train_step(
        self, batch: Any, step: Callable[[Any], Any], loss_of: Callable[[Any], Tensor] | None = None,
        loss_scale: float = 1.0, loss_transform: Callable[[Tensor], Tensor] | None = None,
        summary: Callable[[list[Any], list[int]], Tensor] | None = None, start_sync: bool = False,
        accumulated: Mapping[nn.Parameter, Tensor] | None = None,
    ) -> StepResult:
        """Runs forward and backward of every micro-batch of ``batch``; gradients add up in ``.grad``.

        The loss of micro-batch ``k`` is weighted by its share of the batch (``size_k / batch``) times
        ``loss_scale``, so the gradients equal those of the mean loss over the whole batch. ``loss_transform``
        is applied to each weighted loss before backward (e.g. an fp16 ``GradScaler.scale``). ``summary``
        turns the last stage's outputs into a few float64 values every stage receives (``StepResult.summary``)
        without a collective.

        With ``start_sync`` (on the batch before an optimizer step, when ``.grad`` then holds the whole
        gradient), the gradient reductions start during the step: each data-parallel bucket as soon as this
        stage's last backward has made it final (see :class:`~lightning_varuna.pipeline.comm.grad_sync.GradientSync`),
        the rest right after the schedule. :meth:`sync_gradients` then only waits for them. ``accumulated`` holds the
        gradients of the window's earlier batches if the caller keeps them outside ``.grad``: the reductions add them
        (:meth:`GradientSync.start <lightning_varuna.pipeline.comm.grad_sync.GradientSync.start>`).

        The step may return None to skip its micro-batch: before the model's forward (then for every micro-batch
        of the batch, on every stage alike: no activation or gradient is exchanged) or, on the last stage, after the
        loss (a zero gradient goes back). Such micro-batches have None in ``StepResult.outputs``; to drop the batch,
        the caller discards its gradient (and :meth:`discard_gradient_sync` after ``start_sync``).
        """
        return self._run(batch, step, train=True, loss_of=loss_of, loss_scale=loss_scale,
                         loss_transform=loss_transform, summary=summary, start_sync=start_sync,
                         accumulated=accumulated)

    def eval_step(self, batch: Any, step: Callable[[Any], Any]) -> StepResult:
        """Runs forward only (validation, test, predict); outputs exist on the last stage."""
        return self._run(batch, step, train=False)

    def _run(self, batch: Any, step: Callable[[Any], Any], train: bool, loss_of: Any = None,
             loss_scale: float = 1.0, loss_transform: Callable[[Tensor], Tensor] | None = None,
             summary: Callable[[list[Any], list[int]], Tensor] | None = None,
             start_sync: bool = False, accumulated: Mapping[nn.Parameter, Tensor] | None = None) -> StepResult:
        if self.executor is None or self.topology is None:
            raise RuntimeError("Call PipelineEngine.setup() before running steps.")
        size = batch_size_of(batch)
        m = self.microbatches_for(size, train)
        micro = split_batch(batch, m)
        sizes = [batch_size_of(mb) for mb in micro]
        schedule = self._schedule(m, train)
        loss_of = loss_of or default_loss
        weights = [n / size * loss_scale for n in sizes]
        # reductions that start during this step: each bucket in the last backward, the rest right after
        sync = self.grad_sync if start_sync and train else None
        def weighted_loss(output: Any, k: int) -> Tensor:
            loss = loss_of(output) * weights[k]
            return loss_transform(loss) if loss_transform is not None else loss

        outputs = self.executor.run(
            schedule,
            lambda k: step(micro[k]),
            sizes,
            self._batch_dims,
            train=train,
            recompute=self.config.recompute,
            loss_of=weighted_loss,
            summary=(lambda results: summary(results, sizes)) if summary is not None else None,
            last_backward=functools.partial(sync.overlapping, accumulated) if sync is not None else None,
        )
        if sync is not None:
            sync.start(accumulated)
        return StepResult(
            outputs=outputs if self.topology.is_last else [],
            sizes=sizes,
            summary=self.executor.summary if summary is not None and train else None,
        )

    # -- gradients ----------------------------------------------------------------------------------------
    def sync_gradients(self) -> None:
        """Averages gradients over replicas and sums tied copies (once per optimizer step).

        After ``train_step(..., start_sync=True)`` it waits for the reductions that step started.
        """
        assert self.grad_sync is not None
        if self.grad_sync.started:
            self.grad_sync.finish()
        else:
            self.grad_sync.sync()
        started = self.grad_sync.started_at
        if self.recorder is not None and started is not None:
            self.recorder.add("sync", started, time.perf_counter())

    def discard_gradient_sync(self) -> None:
        """Waits for the reductions ``train_step(..., start_sync=True)`` started and drops their results.

        For a batch that is skipped after its reductions started (every replica must discard alike).
        """
        assert self.grad_sync is not None
        if self.grad_sync.started:
            self.grad_sync.discard()

    def parameters(self) -> list[nn.Parameter]:
        """This stage's parameters."""
        return list(self.module.parameters())

    def local_grad_norm_sq(self) -> Tensor:
        """This stage's share of the squared global gradient norm.

        A parameter held by several stages counts once over the pipeline: summed over the stages of a pipeline
        it is the whole model's.
        """
        assert self.grad_sync is not None
        return self.grad_sync.local_norm_sq()

    @property
    def param_names(self) -> list[str]:
        """The full model's parameter names, in ``named_parameters()`` order (known after :meth:`setup`)."""
        return list(self.plan.trace.param_numel) if self.plan is not None else []

    @property
    def stage_param_names(self) -> tuple[str, ...]:
        """The names of the parameters this stage holds (a tied parameter on every stage that uses it)."""
        assert self.plan is not None and self.topology is not None
        return self.plan.stages[self.topology.stage].params

    @property
    def microbatch(self) -> int:
        """The micro-batch whose forward (or recompute) is running; 0 outside of one."""
        current = self.executor.current if self.executor is not None else None
        return current.microbatch if current is not None else 0

    @property
    def recomputing(self) -> bool:
        """Whether the forward that is running is a recompute (its side effects already happened once)."""
        current = self.executor.current if self.executor is not None else None
        return current is not None and current.recomputing

    def teardown(self) -> None:
        """Undoes setup's changes to the module (freed parameters stay freed); this rank's work with others is done.

        From here on this process may end without its peers taking it for a failure (see
        :mod:`~lightning_varuna.fault.watchdog`).
        """
        watchdog = current_watchdog()
        if watchdog is not None:
            watchdog.deactivate("finished")
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        remove_stand_ins(self._stand_ins)
        self._stand_ins = []
        remove_grad_accumulation(self._accumulating)
        self._accumulating = []


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
