"""The Lightning strategy: thin glue between Lightning's loops and the :class:`PipelineEngine`.

``training_step`` runs the whole schedule (the user's ``training_step`` once per micro-batch, forwards and
backwards) on gradients kept apart from ``.grad``, ``backward`` hands them to Lightning, and the optimizer closure
waits for their sync; ``docs/architecture.md`` shows the flow of one step and the modules this one delegates to.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any, Literal, cast

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_varuna.checkpoint.lease import DEFAULT_TIMEOUT_S
from lightning_varuna.checkpoint.pretrained import InitialWeights
from lightning_varuna.checkpoint.writer import CheckpointWriter
from lightning_varuna.failstop.failures import report_failure, waiting_on_peers
from lightning_varuna.pipeline import config as engine_config  # the options' types, written once there
from lightning_varuna.pipeline.comm.sharded_step import ShardedStep
from lightning_varuna.pipeline.engine import PipelineEngine
from lightning_varuna.pipeline.model.meta_init import has_meta_tensors, move_real_tensors
from lightning_varuna.pipeline.varuna_warning import VarunaWarning
from lightning_varuna.trainer.batch_gradients import window_position
from lightning_varuna.trainer.callbacks import (
    FrozenSummary,
    adapt_callbacks,
    refuse_unsupported_callbacks,
    whole_model_summaries,
)
from lightning_varuna.trainer.data import check_global_batch, resumable_training_loader
from lightning_varuna.trainer.launcher import refuse_unsupported
from lightning_varuna.trainer.module_setup import (
    Pipeline,
    boundary_dtype,
    build_pipeline,
    check_strategy_options,
    new_engine,
)
from lightning_varuna.trainer.patches import InstancePatches, install_ckpt_path_recorder, kept_on_meta
from lightning_varuna.trainer.precision import PipelinePrecision, pipeline_precision
from lightning_varuna.trainer.processes import (
    ProcessGroupStrategy,
    global_grad_norm,
    is_initialized,
    stop_watching_peers,
    watch_peers,
)
from lightning_varuna.trainer.recovery import in_place
from lightning_varuna.trainer.recovery.checkpoint_hooks import CheckpointHooks, StrategyCheckpoints
from lightning_varuna.trainer.recovery.preemption import Preempted, PreemptionGuard, PreemptionNotice
from lightning_varuna.trainer.recovery.resume import choose_last

__all__ = ["VarunaStrategy"]


class VarunaStrategy(CheckpointHooks, ProcessGroupStrategy):
    """Pipeline-parallel training of any LightningModule, Varuna style, with data parallelism across pipelines.

    The model is split at its ``CutPoint`` modules (or between the children of ``cut_at``) into P stages,
    one per process; ``world_size / P`` pipeline replicas train on different data. Each batch is split into
    micro-batches that flow through the stages under the chosen schedule.

    Values set to ``"auto"`` are chosen at setup by the planner: it profiles the model (or reads ``profile``),
    predicts every valid configuration's step time and memory, and takes the fastest that fits in
    ``memory_limit``; rank 0 prints the ranking and the loggers get the choice as hyper-parameters.

    Args:
        pipeline_parallel_size: P, the number of pipeline stages. ``"auto"`` with ``global_batch_size``: chosen by
            the planner (D = world size / P follows). ``"auto"`` without it: the largest P that divides the world
            size, is at most the number of processes per node (pipelines stay inside a node) and at most the
            number of segments of the model.
        num_microbatches: Micro-batches per batch. The default is ``2 * P``. A batch with fewer samples (the last
            one of an epoch without ``drop_last``) runs one micro-batch per sample.
        microbatch_size: Size of each micro-batch, instead of ``num_microbatches``; ``"auto"``: chosen by the
            planner among the sizes that divide the replica's batch.
        schedule: ``"varuna"`` (recompute-aware, tolerant of late messages), ``"1f1b"``, ``"gpipe"``,
            ``"zero-bubble"`` (backward split into input- and weight-gradient tasks, the latter filling the waits;
            1F1B's peak memory), ``"interleaved"``, ``"zero-bubble-v"`` (two chunks per rank placed V-shaped: rank
            ``r`` holds stages ``r`` and ``2P-1-r``), or ``"auto"`` (chosen by the planner).
        recompute: Non-last stages keep only their input during forwards and rerun the forward with
            autograd just before backward (activation memory of one micro-batch per stage); ``"auto"``: chosen
            by the planner. A number ``n``: only each non-last stage's first ``n`` segments recompute, the rest
            keep their activations (recompute by degree: memory between ``True`` and ``False``).
        recompute_policy: With ``recompute=True``, the ops whose forward outputs the recompute takes instead of
            running them again (selective recompute), as torch's selective activation checkpointing has them: a
            function ``(ctx, op, *args, **kwargs) -> CheckpointPolicy`` or a list of ops (``[aten.mm.default]``).
        cut_at: Dotted path (from the LightningModule) of an ``nn.ModuleList``/``nn.Sequential`` whose children are
            cut apart, for models without ``CutPoint``s (``"model.blocks"``), or a list of them in execution order.
        partition: Balance stages by measured forward ``"time"`` (dry run) or by ``"params"``.
        p2p_timeout: Seconds a stage waits for a neighbour before it ends the job with an error.
        boundary_dtype: The dtype activations and their gradients travel in between stages. ``"auto"``: the
            compute dtype under ``bf16-mixed``/``16-mixed`` precision (half the bytes of float32), else as
            produced. They are cast back to the model's dtype on arrival.
        global_batch_size: Samples per training batch over all replicas. Each replica then reads batches of
            ``global_batch_size / D`` (instead of the ``DataLoader``'s ``batch_size``) whatever D is, so a run
            resumed under another P x D follows the same optimization. Needs Lightning's default distributed
            sampler (``use_distributed_sampler=True`` and a plain ``DataLoader``).
        preemption_notice: A source of advance warning of a preemption, polled during fit (e.g.
            ``lightning_varuna.trainer.recovery.preemption.HTTPNotice`` for a cloud metadata endpoint). Whatever the
            notice, ``SIGTERM`` and ``SIGUSR1`` to any rank are handled: at the next step boundary every rank writes
            ``last.ckpt`` in the ``ModelCheckpoint``'s directory and exits with status 143.
        memory_limit: Bytes, or a string such as ``"80GiB"``, that a stage may use: the planner chooses only a
            configuration predicted within 90% of it (10% kept in reserve), and checks a fixed one against it.
            Default: the device's memory (CUDA), or the machine's memory shared by the processes of a node (CPU).
        profile: A profile file (``python -m lightning_varuna.trainer.preview --save-profile``) to plan from instead of
            measuring; the same file always gives the same choice.
        timeline_dir: If set, every training step is recorded: the loggers get the bubble fraction and each
            stage's busy time at the logging interval, and at the end of fit ``timeline.json`` (a Chrome trace:
            open it in ui.perfetto.dev) and ``timeline.png`` are written there.
        async_checkpoint: Checkpoint saves copy this rank's tensors into shared memory and return; a helper
            process per rank (started with ``fit``, at idle CPU priority, in a process group of its own) writes
            them while training goes on, and the checkpoint appears once every rank's part is written. A save
            waits for the one before; fit's end waits for the last.
        param_init_fn: For parameters built on the meta device (in ``configure_model``, or under
            ``Trainer.init_module(empty_init=True)``): initializes the parameters a module owns directly, called
            once per such module of this rank's stage (default: the module's ``reset_parameters()``). Each
            module's RNG is seeded from the run's seed and its name, so the weights do not depend on P and D.
        initial_weights: Pretrained weights loaded after the model is partitioned, each rank reading only the
            tensors it holds: a state dict saved with ``torch.save`` or a Lightning ``.ckpt`` file, a
            ``.safetensors`` file, a Hugging Face model folder (``model.safetensors``, sharded with
            ``model.safetensors.index.json``, or ``pytorch_model.bin``), or a checkpoint directory written by this
            strategy (its weights). Not used when ``fit`` resumes from a checkpoint (``ckpt_path``).
        initial_weights_prefix: Prepended to the keys of ``initial_weights``, e.g. ``"model."`` when the
            pretrained model is the LightningModule's ``self.model``.
        initial_weights_strict: Whether keys of the model missing from ``initial_weights`` (or keys of the file
            the model lacks) are an error. With ``False`` they are reported in a warning and the missing ones
            keep their initialization; a shape mismatch is always an error.
        verify_checkpoints: Record a checksum of every file and tensor of a checkpoint, check them on loading
            (a mismatch makes the checkpoint damaged: an error, or the next candidate for ``ckpt_path="last"``),
            and refuse to save parameters that hold NaN or infinite values (the last good checkpoint stays).
            Checkpoints without checksums (written by earlier versions) load unchecked.
        checkpoint_lease_timeout: Seconds after which the lease of a checkpoint folder that is no longer
            renewed is stale. Rank 0 holds a lease on each folder it saves to during ``fit`` (renewed every
            quarter of this); another job saving to that folder meanwhile is refused with an error naming this
            one. A restart of the same job (same SLURM job, same torchrun run id) takes the lease over at once,
            as does anyone when the holder's process on the same host is gone. ``None``: no lease.
        accelerator: The accelerator (set by the Trainer).
        parallel_devices: The devices of this node (set by the Trainer).
        cluster_environment: The cluster environment (set by the Trainer).
        checkpoint_io: Checkpoint I/O plugin.
        precision_plugin: Precision plugin (set by the Trainer).
        process_group_backend: ``"gloo"`` or ``"nccl"``; by default chosen from the device.
        timeout: Timeout of collective operations of the default process group (Lightning's barriers,
            ``sync_dist``, checkpoint collectives). Default: ``p2p_timeout``, so no wait on a dead or hung
            peer lasts longer than that.
        p2p_backend: The backend of the activations and gradients between stages. ``"auto"``: the process group
            backend's (NCCL on GPUs). ``"gloo"``: through pinned host memory over gloo, with data-parallel
            all-reduces still on the process group backend (what Varuna shipped; for GPUs where NCCL's
            point-to-point misbehaves, and with ``process_group_backend="gloo"`` for processes that share a GPU).
            ``"nccl"``: NCCL (GPUs only).
        fuse_grad_accumulation: ``nn.Linear`` weights of 2^20 elements or more (all under zero-bubble schedules) add
            each later micro-batch's gradient straight into ``.grad`` with one multiply-add, instead of autograd
            making it as a temporary and adding it (Megatron-LM's gradient accumulation fusion); not under autocast.
        zero_stage: ``1``: each of the D replicas of a stage keeps the optimizer state of, and steps, one shard of
            every parameter (ZeRO stage 1: gradients reduce-scattered, parameters all-gathered after the step, the
            same bytes as the all-reduce); the optimizer must be elementwise (SGD, Adam, AdamW, ...; LBFGS and the
            like are refused). ``0``: every replica keeps the whole state. 2 and 3 are refused.
        stages_per_rank: Model chunks per rank (``"interleaved"``, ``"zero-bubble"``; 2 for ``"zero-bubble-v"``):
            the model is cut into P x this many stages, rank ``r`` running ``r, r + P, ...`` (V-shaped: ``r, 2P-1-r``),
            which divides the pipeline's fill and drain by it; ``"auto"``: the planner chooses 1 or 2.
        recovery: What a rank's death does: ``"restart"`` ends every rank and the launcher restarts from the newest
            checkpoint; ``"in_place"``: the survivors go on in the same ``fit`` over the complete replicas left, on
            the same trajectory (needs ``global_batch_size``, gloo, ``accumulate_grad_batches=1``; spot guide).
        recovery_store: ``"host:port"`` of a store that outlives the training processes (``varuna-store``): every
            rank joins it as a client, instead of rank 0 hosting the job's store.
        loss_weighting: A micro-batch's loss weighs by its share of the batch's samples (``"samples"``), of its labels
            other than -100 (``"tokens"``; ``"shifted_tokens"``: of ``labels[..., 1:]``, for ``*ForCausalLM``), or
            of the count a function of the micro-batch returns: exact for a mean over tokens (user guide section 2).
    """

    strategy_name = "varuna"
    is_distributed = True

    def __init__(
        self,
        pipeline_parallel_size: engine_config.PipelineSize = "auto",
        num_microbatches: int | None = None,
        microbatch_size: engine_config.MicrobatchSize = None,
        schedule: engine_config.ScheduleName = "varuna",
        recompute: engine_config.Recompute = True,
        cut_at: str | Sequence[str] | None = None,
        partition: engine_config.PartitionBy = "time",
        p2p_timeout: float = 300.0,
        boundary_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto",
        global_batch_size: int | None = None,
        memory_limit: int | str | None = None,
        profile: str | None = None,
        timeline_dir: str | None = None,
        preemption_notice: PreemptionNotice | None = None,
        async_checkpoint: bool = False,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        initial_weights: str | None = None,
        initial_weights_prefix: str = "",
        initial_weights_strict: bool = True,
        verify_checkpoints: bool = True,
        checkpoint_lease_timeout: float | None = DEFAULT_TIMEOUT_S,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        p2p_backend: engine_config.P2PBackend = "auto",
        fuse_grad_accumulation: bool = True,
        zero_stage: engine_config.ZeroStage = 0,
        stages_per_rank: engine_config.StagesPerRank = 1,
        loss_weighting: engine_config.LossWeighting = "samples",
        recompute_policy: Callable[..., Any] | list[Any] | None = None,
        recovery: Literal["restart", "in_place"] = "restart",
        recovery_store: str | None = None,
    ) -> None:
        timeout = timeout if timeout is not None else timedelta(seconds=p2p_timeout)
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
                         process_group_backend, timeout, pipeline_parallel_size=pipeline_parallel_size,
                         global_batch_size=global_batch_size)
        check_strategy_options(boundary_dtype, global_batch_size)  # with EngineConfig: before any process starts
        in_place.check_recovery_options(recovery, recovery_store, global_batch_size)
        self.config = engine_config.EngineConfig(
            pipeline_parallel_size=pipeline_parallel_size, num_microbatches=num_microbatches,
            microbatch_size=microbatch_size, schedule=schedule, recompute=recompute, recompute_policy=recompute_policy,
            cut_at=cast("str | tuple[str, ...] | None", cut_at),  # EngineConfig makes a list a tuple
            partition=partition, p2p_timeout=p2p_timeout, param_init_fn=param_init_fn, loss_weighting=loss_weighting,
            p2p_backend=p2p_backend, global_batch_size=global_batch_size, memory_limit=memory_limit, profile=profile,
            fuse_grad_accumulation=fuse_grad_accumulation, zero_stage=zero_stage, stages_per_rank=stages_per_rank,
        )
        self.initial_weights = (InitialWeights(initial_weights, initial_weights_prefix, initial_weights_strict)
                                if initial_weights is not None else None)
        self.timeline_dir = timeline_dir
        self.boundary_dtype = boundary_dtype
        self.preemption_notice = preemption_notice
        self.async_checkpoint = async_checkpoint
        self.verify_checkpoints = verify_checkpoints
        self.checkpoint_lease_timeout = checkpoint_lease_timeout
        self._checkpoints = CheckpointWriter(asynchronous=async_checkpoint, timeout=self._timeout)
        self._checkpointing = StrategyCheckpoints(self._checkpoints, verify_checkpoints, checkpoint_lease_timeout)
        install_ckpt_path_recorder(choose_last)
        self.engine: PipelineEngine | None = None
        self._pipeline: Pipeline | None = None
        self._preemption: PreemptionGuard | None = None
        self._patches = InstancePatches()
        self._summaries: list[tuple[Any, FrozenSummary]] | None = None
        self._forget_cleanup: Callable[[], None] | None = None
        self._sharded_steps: dict[Optimizer, ShardedStep] = {}
        self.recovery, self.recovery_store = recovery, recovery_store
        self._in_place: in_place.InPlaceRecovery | None = None
        self.train_loader: Any = None  # as process_dataloader made it: in-place recovery splits it anew

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Registers ``"varuna"`` (once)."""
        if "varuna" not in strategy_registry:
            strategy_registry.register("varuna", cls, description="Varuna-style pipeline parallelism")

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints are loaded after the model has been partitioned."""
        return True

    # -- setup --------------------------------------------------------------------------------------------
    @override
    def connect(self, model: Any) -> None:
        """Takes the model; rejects what the strategy cannot run (the launcher did already, before other ranks)."""
        refuse_unsupported(model)
        super().connect(model)

    @property
    @override
    def precision_plugin(self) -> Precision:
        """The precision plugin Lightning chose, made pipeline-aware (:mod:`lightning_varuna.trainer.precision`)."""
        return self._precision_plugin if self._precision_plugin is not None else pipeline_precision(Precision())

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        self._precision_plugin = pipeline_precision(precision_plugin) if precision_plugin is not None else None

    @override
    def setup(self, trainer: Trainer) -> None:
        """Partitions the model with a dry run, then creates optimizers over this stage's parameters."""
        assert self.accelerator is not None and self.model is not None
        refuse_unsupported_callbacks(trainer)
        if trainer.state.fn == TrainerFn.FITTING:  # before any work: a refused job stops at once
            self._checkpointing.take_leases(trainer, self.is_global_zero, self.broadcast)
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._summaries is None:  # of the whole model, before it is partitioned
            self._summaries = whole_model_summaries(trainer, self.attached_module)
        self._setup_pipeline(trainer)
        # this rank waits on its peers from now on; a write that can no longer complete is stopped at once
        self._forget_cleanup = watch_peers(self._checkpoints.abort)
        assert self.topology is not None
        adapt_callbacks(trainer, self._patches, self._summaries if fitting and self._summaries else [],
                        first_stage=self.topology.is_first)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        precision = self.precision_plugin
        assert isinstance(precision, PipelinePrecision)
        precision.global_grad_norm = self.global_grad_norm
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            precision.check_optimizers(self.optimizers)
            assert self.engine is not None  # zero_stage=1: each optimizer steps its shard (or is refused)
            self._sharded_steps = {o: z for o in self.optimizers if (z := self.engine.shard_optimizer(o)) is not None}
            self._preemption = PreemptionGuard(trainer, self.preemption_notice, self.root_device, self.topology)
            self._preemption.attach()
            if self.recovery == "in_place" and in_place.in_place_possible(self.engine):
                self._in_place = in_place.InPlaceRecovery(self, self._timeout.total_seconds())
                self._in_place.arm(trainer, precision, self._preemption)
            self._checkpoints.start()  # the asynchronous writer's helper process starts while training does

    def regroup(self, generation: int, rank: int, world_size: int) -> None:
        """Takes a new world after in-place recovery: ranks, the pipeline's groups, and what holds them."""
        assert self.engine is not None and self._pipeline is not None
        self.engine.regroup(generation)
        self.adopt_ranks(rank, world_size)
        self._pipeline.steps.regroup()
        self._pipeline.hook_logs.regroup()

    def _setup_pipeline(self, trainer: Trainer) -> None:
        if self.engine is not None:  # the module stays partitioned for this strategy's later trainer calls
            return
        config = replace(self.config, boundary_dtype=boundary_dtype(self.boundary_dtype, self.precision_plugin))
        self.engine = engine = new_engine(self, trainer, config)  # visible to the module's hooks during the dry run
        self._pipeline = build_pipeline(self, trainer, engine, self._patches, self.initial_weights, self.timeline_dir)
        self.topology = self._pipeline.topology

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """Gives the training loader a data position that survives a resume under another number of replicas.

        Lightning's ``DistributedSampler`` becomes a :class:`~.data.ElasticBatchSampler`: the same samples in the
        same order, its position saved in checkpoints; each replica reads ``global_batch_size / D`` if given.
        """
        trainer = self.attached_module.trainer
        if not trainer.training or self.topology is None:  # the training loader is prepared while training
            return dataloader
        topo = self.topology
        if self.global_batch_size is not None:
            check_global_batch(self.global_batch_size, topo.data_size)
        self.train_loader = resumable_training_loader(dataloader, trainer.fit_loop, topo.data_size, topo.replica,
                                                      self.global_batch_size)
        return self.train_loader

    # -- steps --------------------------------------------------------------------------------------------
    def _run_step(self, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any], **options: Any) -> Any:
        assert self._pipeline is not None
        return self._pipeline.steps.run(hook, args, kwargs, **options)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Runs every micro-batch through the pipeline; returns the batch's loss (on every rank).

        The new gradients are handed to Lightning in :meth:`backward`. On the batch that ends an
        accumulation window, each data-parallel bucket starts its all-reduce during this stage's last backward,
        as soon as its gradients are final; the rest (tied copies) right after the schedule. The optimizer
        closure only waits for them.

        A batch is skipped when the module's ``training_step`` returned None (on any stage of any replica; every
        rank agrees): its gradients are dropped, the backward hooks do not run, and the optimizer closure returns
        None, as in a plain run. Lightning refuses None from a strategy's step with several processes, so a
        skipped batch returns a NaN loss instead.
        """
        trainer = self.attached_module.trainer
        assert self._pipeline is not None
        gradients = self._pipeline.gradients
        first, final, drop_stale = window_position(trainer)
        if self._in_place is not None and args:  # a batch fetched before in-place recovery is read again
            args = (self._in_place.batch(args[0], trainer.fit_loop), *args[1:])
        accumulated = gradients.set_aside(first, final, drop_stale)
        loss = self._run_step("training_step", args, kwargs, loss_scale=1.0 / trainer.accumulate_grad_batches,
                              start_sync=final, accumulated=accumulated)
        gradients.take(first, skipped=loss is None)
        if loss is not None:
            return loss
        self._pipeline.engine.discard_gradient_sync()  # the same on every replica: they agreed on the skip
        rank_zero_warn("`training_step` returned `None`. If this was on purpose, ignore this warning...",
                       category=VarunaWarning)
        return torch.full((), float("nan"), device=self.root_device)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Runs every micro-batch forward through the pipeline."""
        return self._run_step("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """Runs every micro-batch forward through the pipeline."""
        return self._run_step("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Runs every micro-batch forward; the whole batch's predictions are returned on every stage."""
        return self._run_step("predict_step", args, kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Puts back the gradients the schedule computed (the schedule already ran backward)."""
        assert self._pipeline is not None
        gradients = self._pipeline.gradients
        if gradients.skipped:  # a plain run calls no backward (nor its hooks) for a skipped batch
            return closure_loss
        module = self.attached_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        gradients.put_back()
        return self.precision_plugin.post_backward(closure_loss, module)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Steps the optimizer after syncing gradients across replicas and tied copies.

        What the module and callbacks log in ``on_before_optimizer_step`` (which runs between the closure and
        the step) is captured and, after the step, merged over the pipeline
        (:mod:`lightning_varuna.trainer.logs.hook_logs`): logged gradient norms are the whole model's.
        """
        pipeline = self._pipeline
        assert pipeline is not None
        synced = 0.0

        def closure_then_sync() -> Any:
            nonlocal synced
            result = closure()
            if pipeline.gradients.window_has_gradients:  # else every batch of the window was skipped
                waiting_on_peers(pipeline.topology, "syncing gradients", pipeline.engine.sync_gradients)
            capture_hook_logs()  # the on_before_optimizer_step hooks run next
            synced = time.perf_counter()
            return None if pipeline.gradients.skipped else result  # None: the precision plugin skips the step

        def update() -> Any:
            return super(VarunaStrategy, self).optimizer_step(optimizer, closure_then_sync, model, **kwargs)

        recovery = self._in_place
        with recovery.after_update() if recovery is not None else contextlib.nullcontext():
            with pipeline.hook_logs.around_step(self.attached_module) as capture_hook_logs:
                output = update() if recovery is None else recovery.step(update, optimizer, pipeline.hook_logs)
        if pipeline.timeline is not None:
            pipeline.timeline.optimizer_step(synced, time.perf_counter())
            pipeline.timeline.log_metrics(self.attached_module.trainer)
        return output

    def global_grad_norm(self) -> Tensor:
        """The L2 norm of the whole model's gradient (all stages, tied parameters once)."""
        assert self.engine is not None and self.topology is not None
        return global_grad_norm(self.engine, self.topology)

    # -- the end ------------------------------------------------------------------------------------------
    @override
    def on_train_end(self) -> None:
        """Writes the timeline files (with ``timeline_dir``)."""
        if self._pipeline is not None and self._pipeline.timeline is not None:
            self._pipeline.timeline.write()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Reports the error to the other ranks (their watchdogs end them; they quote it if they lose contact)."""
        exception = in_place.as_restart(exception)  # a death outside the steps that in-place recovery settles
        if is_initialized() and not isinstance(exception, Preempted):
            report_failure(exception)

    @override
    def teardown(self) -> None:
        """Gives the model its own forwards back and releases the process resources."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        interrupted = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED
        try:
            self._checkpointing.close(interrupted)  # the last background write finishes first; leases released
        finally:  # the rest of teardown happens even if that write failed
            stop_watching_peers(self._forget_cleanup, finished=not interrupted)
            self._forget_cleanup = None
            self._patches.undo()
            if self._preemption is not None:
                self._preemption.detach()
                self._preemption = None
            # the engine (stand-ins, cut_at hooks) stays: the module remains partitioned for this strategy's
            # later validate/test/predict calls
            module = self.lightning_module
            on_meta = module is not None and has_meta_tensors(module)  # setup failed before materializing
            if on_meta and module is not None:
                move_real_tensors(module, torch.device("cpu"))
            with kept_on_meta(module) if on_meta else contextlib.nullcontext():
                super().teardown()
