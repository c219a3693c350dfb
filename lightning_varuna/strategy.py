"""The Lightning strategy: thin glue between Lightning's loops and the :class:`PipelineEngine`.

How a training step maps onto Lightning's automatic optimization (``training_step -> zero_grad ->
backward`` inside ``optimizer.step(closure)``):

- ``training_step`` runs the whole schedule (every micro-batch's forward and backward, the user's own
  ``training_step`` called once per micro-batch) on gradients kept apart from ``.grad``
  (:mod:`lightning_varuna.gradients`), shares the last stage's logged values and loss with every stage, and
  returns the loss (NaN for a batch the user's step skipped);
- ``zero_grad`` then clears only the previous step's gradients, and ``backward`` adds the batch's instead of
  differentiating;
- gradients are synced across replicas and tied copies once per optimizer step (each bucket's all-reduce
  starts during the stage's last backward; the wrapped optimizer closure waits for them), before Lightning
  clips them (with a norm taken over the whole pipeline); what ``on_before_optimizer_step`` logs is merged
  over the pipeline.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Generator
from dataclasses import replace
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_varuna.callbacks import (
    FrozenSummary,
    adapt_callbacks,
    refuse_unsupported_callbacks,
    whole_model_summaries,
)
from lightning_varuna.checkpoint import load as checkpoint
from lightning_varuna.checkpoint import state as checkpoint_state
from lightning_varuna.checkpoint.lease import DEFAULT_TIMEOUT_S, Holder, LeaseKeeper, LeaseTicket
from lightning_varuna.checkpoint.pretrained import InitialWeights, ModelLayout
from lightning_varuna.checkpoint.state import CheckpointError
from lightning_varuna.checkpoint.storage import Location
from lightning_varuna.checkpoint.writer import CheckpointWriter
from lightning_varuna.data import resumable_training_loader, sample_batch
from lightning_varuna.gradients import BatchGradients
from lightning_varuna.hook_logs import HookLogMerger, logs_in_optimizer_hook
from lightning_varuna.launcher import PipelineLauncher
from lightning_varuna.log_sync import LogCapture
from lightning_varuna.patches import (
    InstancePatches,
    install_ckpt_path_recorder,
    kept_on_meta,
    meta_dry_run,
    selected_ckpt_path,
)
from lightning_varuna.pipeline.config import EngineConfig
from lightning_varuna.pipeline.engine import PipelineEngine
from lightning_varuna.pipeline.failures import PipelineError, report_failure, waiting_on_peers
from lightning_varuna.pipeline.materialize import has_meta_tensors, move_real_tensors, parameters_on_meta
from lightning_varuna.pipeline.topology import Topology
from lightning_varuna.pipeline.watchdog import current_watchdog
from lightning_varuna.planning import TimelineOutput, optimizer_spec, report_choice
from lightning_varuna.precision import PipelinePrecision, pipeline_precision
from lightning_varuna.preemption import Preempted, PreemptionGuard, PreemptionNotice
from lightning_varuna.resume import checkpoint_folders, choose_last, last_fallbacks, requested_name
from lightning_varuna.steps import StepRunner, check_metric_states

__all__ = ["VarunaStrategy"]

log = logging.getLogger(__name__)

_STEP_HOOKS = {
    TrainerFn.FITTING: "training_step",
    TrainerFn.VALIDATING: "validation_step",
    TrainerFn.TESTING: "test_step",
    TrainerFn.PREDICTING: "predict_step",
}


class VarunaStrategy(ParallelStrategy):
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
        num_microbatches: Micro-batches per batch. The default is ``2 * P``, or fewer for small batches.
        microbatch_size: Size of each micro-batch, instead of ``num_microbatches``; ``"auto"``: chosen by the
            planner among the sizes that divide the replica's batch.
        schedule: ``"varuna"`` (recompute-aware, tolerant of late messages), ``"1f1b"``, ``"gpipe"``, or
            ``"auto"`` (chosen by the planner).
        recompute: Non-last stages keep only their input during forwards and rerun the forward with
            autograd just before backward (activation memory of one micro-batch per stage); ``"auto"``: chosen
            by the planner.
        cut_at: Dotted path (from the LightningModule) of an ``nn.ModuleList``/``nn.Sequential`` whose
            children are cut apart, for models without ``CutPoint`` modules, e.g. ``"model.blocks"``.
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
            ``lightning_varuna.preemption.HTTPNotice`` for a cloud metadata endpoint). Whatever the notice,
            ``SIGTERM`` and ``SIGUSR1`` to any rank are handled: at the next step boundary every rank writes
            ``last.ckpt`` in the ``ModelCheckpoint``'s directory and exits with status 143.
        memory_limit: Bytes, or a string such as ``"80GiB"``, that a stage may use: the planner never chooses a
            configuration predicted above it. Default: the device's memory (CUDA), or the machine's memory shared
            by the processes of a node (CPU).
        profile: A profile file (``python -m lightning_varuna.plan --save-profile``) to plan from instead of
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
    """

    strategy_name = "varuna"
    is_distributed = True

    def __init__(
        self,
        pipeline_parallel_size: int | Literal["auto"] = "auto",
        num_microbatches: int | None = None,
        microbatch_size: int | Literal["auto"] | None = None,
        schedule: Literal["varuna", "1f1b", "gpipe", "auto"] = "varuna",
        recompute: bool | Literal["auto"] = True,
        cut_at: str | None = None,
        partition: Literal["time", "params"] = "time",
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
        p2p_backend: Literal["auto", "nccl", "gloo"] = "auto",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if boundary_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"boundary_dtype={boundary_dtype!r}: use 'auto', 'float32', 'bfloat16' or 'float16'.")
        if global_batch_size is not None and (not isinstance(global_batch_size, int) or global_batch_size < 1):
            raise ValueError(f"global_batch_size must be a positive int or None, got {global_batch_size!r}.")
        # checked now, before any process starts
        self.config = EngineConfig(
            pipeline_parallel_size=pipeline_parallel_size, num_microbatches=num_microbatches,
            microbatch_size=microbatch_size, schedule=schedule, recompute=recompute, cut_at=cut_at,
            partition=partition, p2p_timeout=p2p_timeout, param_init_fn=param_init_fn,
            p2p_backend=p2p_backend, global_batch_size=global_batch_size, memory_limit=memory_limit, profile=profile,
        )
        self.initial_weights = (
            InitialWeights(initial_weights, initial_weights_prefix, initial_weights_strict)
            if initial_weights is not None else None
        )
        self.pipeline_parallel_size = pipeline_parallel_size
        self.timeline_dir = timeline_dir
        self._timeline: TimelineOutput | None = None
        self.boundary_dtype = boundary_dtype
        self.global_batch_size = global_batch_size
        self.preemption_notice = preemption_notice
        if checkpoint_lease_timeout is not None and not checkpoint_lease_timeout > 0:
            raise ValueError(f"checkpoint_lease_timeout: give seconds (> 0) or None, not {checkpoint_lease_timeout!r}.")
        self.async_checkpoint = async_checkpoint
        self.verify_checkpoints = verify_checkpoints
        self.checkpoint_lease_timeout = checkpoint_lease_timeout
        self._leases: LeaseKeeper | None = None
        self._process_group_backend = process_group_backend
        self._timeout = timeout if timeout is not None else timedelta(seconds=p2p_timeout)
        self._checkpoints = CheckpointWriter(asynchronous=async_checkpoint, timeout=self._timeout)
        install_ckpt_path_recorder(choose_last)
        self.num_nodes = 1
        self.engine: PipelineEngine | None = None
        self.topology: Topology | None = None
        self._steps: StepRunner | None = None
        self._gradients: BatchGradients | None = None
        self._hook_logs: HookLogMerger | None = None
        self._preemption: PreemptionGuard | None = None
        self._patches = InstancePatches()
        self._summaries: list[tuple[Any, FrozenSummary]] | None = None
        self._forget_cleanup: Callable[[], None] | None = None

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Registers ``"varuna"`` (once)."""
        if "varuna" not in strategy_registry:
            strategy_registry.register("varuna", cls, description="Varuna-style pipeline parallelism")

    # -- processes ----------------------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        """This process's device."""
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        """Processes per node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str | None:
        """The process group backend in use."""
        return self._process_group_backend

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every stage of a replica reads the same batches; replicas read different ones, as under DDP."""
        if self.topology is None:
            size = self._resolved_pipeline_size()
            return {"num_replicas": self.world_size // size, "rank": self.global_rank // size}
        return {"num_replicas": self.topology.data_size, "rank": self.topology.replica}

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints are loaded after the model has been partitioned."""
        return True

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if isinstance(self.pipeline_parallel_size, int):
            # before any process is started
            Topology.check(self.num_nodes * self.num_processes, self.pipeline_parallel_size)
            self._check_global_batch(self.num_nodes * self.num_processes // self.pipeline_parallel_size)
        self._launcher = PipelineLauncher(self.cluster_environment, self.num_processes, self.num_nodes, self._timeout)

    def _check_global_batch(self, data_size: int) -> None:
        if self.global_batch_size is not None and self.global_batch_size % data_size:
            raise MisconfigurationException(
                f"global_batch_size={self.global_batch_size} does not split evenly over {data_size} data-parallel"
                f" replicas: choose a multiple of {data_size}, or another pipeline_parallel_size."
            )

    def _resolved_pipeline_size(self) -> int:
        return self.pipeline_parallel_size if isinstance(self.pipeline_parallel_size, int) else self.world_size

    def setup_environment(self) -> None:
        """Checks the P x D shape, then starts the process group."""
        super().setup_environment()
        world = self.num_nodes * self.num_processes
        if isinstance(self.pipeline_parallel_size, int):
            Topology.check(world, self.pipeline_parallel_size)
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = (
            self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        )
        assert self.cluster_environment is not None
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout)

    def set_world_ranks(self) -> None:
        """Sets global rank and world size from node rank, local rank and processes per node."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
        from lightning.pytorch.utilities.rank_zero import rank_zero_only

        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank

    # -- setup --------------------------------------------------------------------------------------------
    def connect(self, model: Any) -> None:
        """Takes the model; rejects manual optimization before any process group starts."""
        if isinstance(model, LightningModule) and not model.automatic_optimization:
            raise MisconfigurationException(
                "VarunaStrategy supports automatic optimization only: the pipeline schedule runs forward and"
                " backward itself. Remove `self.automatic_optimization = False` (and manual_backward) from the"
                " LightningModule."
            )
        super().connect(model)

    @property
    def precision_plugin(self) -> Precision:
        """The precision plugin Lightning chose, made pipeline-aware (:mod:`lightning_varuna.precision`)."""
        return self._precision_plugin if self._precision_plugin is not None else pipeline_precision(Precision())

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        self._precision_plugin = pipeline_precision(precision_plugin) if precision_plugin is not None else None

    def setup(self, trainer: Trainer) -> None:
        """Partitions the model with a dry run, then creates optimizers over this stage's parameters."""
        assert self.accelerator is not None and self.model is not None
        refuse_unsupported_callbacks(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._take_leases(trainer)  # before any work: a refused job stops at once
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._summaries is None:  # of the whole model, before it is partitioned
            self._summaries = whole_model_summaries(trainer, self.lightning_module)
        self._setup_pipeline(trainer)
        self._watch()
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
            self._preemption = PreemptionGuard(trainer, self.preemption_notice, self.root_device, self.topology)
            self._preemption.attach()
            self._checkpoints.start()  # the asynchronous writer's helper process starts while training does

    def _watch(self) -> None:
        """This rank waits on its peers from now on: a failure elsewhere ends it (see the engine's watchdog)."""
        watchdog = current_watchdog()
        if watchdog is None:
            return
        verdict = watchdog.activate()
        if verdict is not None and verdict.origin != watchdog.rank:
            raise PipelineError(f"rank {watchdog.rank}: the job cannot go on: {verdict.text}.")
        # a write that can no longer complete is stopped at once, not left to its timeout
        self._forget_cleanup = watchdog.add_cleanup(self._checkpoints.abort)

    def _setup_pipeline(self, trainer: Trainer) -> None:
        module = self.lightning_module
        if self.engine is not None:
            return
        hook = _STEP_HOOKS.get(trainer.state.fn)  # type: ignore[arg-type]
        if hook is None:
            raise MisconfigurationException(f"VarunaStrategy cannot run trainer.{trainer.state.fn}.")
        config = replace(self.config, wire_dtype=self._wire_dtype(), max_pipeline_size=self.num_processes or None,
                         devices_per_node=self.num_processes or None)
        self.engine = engine = PipelineEngine.from_config(module, config, device=self.root_device)
        step = getattr(module, hook)
        capture = LogCapture(module)
        on_meta = has_meta_tensors(module)
        if on_meta:
            check_metric_states(module)
        layout = ModelLayout.of(module)  # before partitioning: the whole model's keys and shapes

        def dry_step(batch: Any) -> Any:
            dry = meta_dry_run(module) if on_meta else contextlib.nullcontext()
            with capture.capturing(), self.precision_plugin.train_step_context(), dry:
                return step(batch, 0)

        # the planner times the model's optimizer (only rank 0 profiles, and not from a given profile)
        profiles = config.searches and config.profile is None and self.global_rank == 0
        optimizer = optimizer_spec(module) if profiles else None
        batch = self.batch_to_device(sample_batch(trainer, self._patches), self.root_device)
        plan = engine.setup(batch, dry_step, optimizer=optimizer)
        config = engine.config
        self._gradients = BatchGradients(list(module.parameters()))
        self.topology = topo = engine.topology
        assert topo is not None
        if on_meta:
            module.to(self.root_device)  # every tensor is real now: updates the module's `device`
        self._load_initial_weights(trainer, layout)
        self._steps = StepRunner(module, engine, self.precision_plugin)
        if engine.autoconfig is not None:
            report_choice(trainer, engine.autoconfig)
        rank_zero_info(
            f"VarunaStrategy: {topo.pipeline_size} stage(s) x {topo.data_size} replica(s), schedule"
            f" {config.schedule!r}, recompute={config.recompute}\n{plan.table()}"
        )
        if self.timeline_dir is not None and trainer.state.fn == TrainerFn.FITTING:
            self._timeline = TimelineOutput(engine, self.timeline_dir)

    def _load_initial_weights(self, trainer: Trainer, layout: ModelLayout) -> None:
        if self.initial_weights is None:
            return
        # Lightning restores a checkpoint after this setup: then it supplies the weights (rank 0's view decides)
        if self.broadcast(selected_ckpt_path(trainer) is not None):
            rank_zero_info(f"VarunaStrategy: initial_weights ({self.initial_weights.path}) not loaded: resuming"
                           " from a checkpoint, which holds the weights.")
            return
        self.initial_weights.load(self.lightning_module, layout)

    def _wire_dtype(self) -> torch.dtype | None:
        if self.boundary_dtype != "auto":
            return getattr(torch, self.boundary_dtype)
        mixed = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
        return mixed.get(getattr(self.precision_plugin, "precision", ""))

    def process_dataloader(self, dataloader: Any) -> Any:
        """Gives the training loader a data position that survives a resume under another number of replicas.

        Lightning's ``DistributedSampler`` is replaced by an :class:`~lightning_varuna.data.ElasticBatchSampler`
        that reads the same samples in the same order, and whose position (samples consumed by finished steps)
        is saved in checkpoints. With ``global_batch_size``, each replica reads ``global_batch_size / D``.
        """
        trainer = self.lightning_module.trainer
        if not trainer.training or self.topology is None:  # the training loader is prepared while training
            return dataloader
        topo = self.topology
        if self.global_batch_size is not None:
            self._check_global_batch(topo.data_size)
        return resumable_training_loader(dataloader, trainer.fit_loop, topo.data_size, topo.replica,
                                         self.global_batch_size)

    def model_to_device(self) -> None:
        """Moves the model to this process's device (parameters on the meta device stay there until setup)."""
        assert self.model is not None
        if has_meta_tensors(self.model):
            move_real_tensors(self.model, self.root_device)
        else:
            self.model.to(self.root_device)

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Tensors created inside are on this process's device; with ``empty_init=True``, parameters on ``meta``.

        ``Trainer.init_module(empty_init=True)`` thus builds a model whose parameters take no memory (each stage
        materializes its own at setup), while its buffers keep the values computed at construction. With
        ``empty_init`` not set (a plain ``Trainer.init_module()``) parameters are real, as with other strategies.
        """
        meta = parameters_on_meta() if empty_init else contextlib.nullcontext()
        with meta, self.root_device, self.precision_plugin.tensor_init_context():
            yield

    @contextlib.contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Inside ``configure_model``: parameters are created on the meta device, buffers are real.

        Each stage materializes and initializes only its own parameters at setup (``param_init_fn``), or loads
        them (``initial_weights``, or a checkpoint when resuming).
        """
        with parameters_on_meta():
            yield

    # -- steps --------------------------------------------------------------------------------------------
    def _run_step(self, hook: str, args: tuple, kwargs: dict, **options: Any) -> Any:
        assert self._steps is not None
        return self._steps.run(hook, args, kwargs, **options)

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
        trainer = self.lightning_module.trainer
        gradients = self._gradients
        assert gradients is not None and self.engine is not None
        first = trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0
        final = not _accumulating(trainer)
        # nothing reads the last step's gradients before zero_grad clears them unless a zero_grad hook does:
        # without one they are dropped now rather than held through the schedule (one gradient's memory less)
        accumulated = gradients.set_aside(first, final, drop_stale=not _zero_grad_hooks(trainer))
        loss = self._run_step("training_step", args, kwargs, loss_scale=1.0 / trainer.accumulate_grad_batches,
                              start_sync=final, accumulated=accumulated)
        gradients.take(first, skipped=loss is None)
        if loss is not None:
            return loss
        self.engine.discard_gradient_sync()  # the same on every replica: they agreed on the skip
        rank_zero_warn("`training_step` returned `None`. If this was on purpose, ignore this warning...")
        return torch.full((), float("nan"), device=self.root_device)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Runs every micro-batch forward through the pipeline."""
        return self._run_step("validation_step", args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """Runs every micro-batch forward through the pipeline."""
        return self._run_step("test_step", args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Runs every micro-batch forward; the whole batch's predictions are returned on every stage."""
        return self._run_step("predict_step", args, kwargs)

    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Puts back the gradients the schedule computed (the schedule already ran backward)."""
        assert self._gradients is not None
        if self._gradients.skipped:  # a plain run calls no backward (nor its hooks) for a skipped batch
            return closure_loss
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._gradients.put_back()
        return self.precision_plugin.post_backward(closure_loss, module)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Steps the optimizer after syncing gradients across replicas and tied copies.

        What the module and callbacks log in ``on_before_optimizer_step`` (which runs between the closure and
        the step) is captured and, after the step, merged over the pipeline (:mod:`lightning_varuna.hook_logs`):
        logged gradient norms are the whole model's.
        """
        engine, topo, gradients = self.engine, self.topology, self._gradients
        assert engine is not None and topo is not None and gradients is not None
        module = self.lightning_module
        merge = topo.pipeline_size > 1 and logs_in_optimizer_hook(module)
        capture = LogCapture(module)
        hooks = contextlib.ExitStack()
        capturing = False

        synced = 0.0

        def closure_then_sync() -> Any:
            nonlocal capturing, synced
            result = closure()
            if gradients.window_has_gradients:  # else the window's batches were all skipped, and there are none
                waiting_on_peers(topo, "syncing gradients", engine.sync_gradients)
            if merge and not capturing:  # the on_before_optimizer_step hooks run next
                hooks.enter_context(capture.capturing())
                capturing = True
            synced = time.perf_counter()
            return None if gradients.skipped else result  # None: the precision plugin skips the step, as Lightning

        with hooks:
            output = super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)
        if self._timeline is not None:
            self._timeline.optimizer_step(synced, time.perf_counter())
            self._timeline.log_metrics(module.trainer)
        if merge:
            if self._hook_logs is None:
                self._hook_logs = HookLogMerger(topo.pipe_group, topo.pipeline_size, self.root_device)
            merger = self._hook_logs
            waiting_on_peers(topo, "merging what on_before_optimizer_step logged over the pipeline",
                             lambda: merger.replay(module, capture.records))
        return output

    def global_grad_norm(self) -> Tensor:
        """The L2 norm of the whole model's gradient (all stages, tied parameters once)."""
        assert self.engine is not None and self.topology is not None
        total = self.engine.local_grad_norm_sq()
        topo = self.topology
        if topo.pipeline_size > 1:
            waiting_on_peers(topo, "summing the gradient norm over stages",
                             lambda: dist.all_reduce(total, group=topo.pipe_group))
        return total.sqrt()

    # -- checkpoints ----------------------------------------------------------------------------------------
    @property
    def lightning_restore_optimizer(self) -> bool:
        """Optimizer state is loaded by the strategy itself, by parameter name."""
        return False

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This stage's weights, keyed by full-model name."""
        return checkpoint_state.model_state(self.lightning_module)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This stage's optimizer state, keyed by parameter name."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        return checkpoint_state.optimizer_state(self.lightning_module, optimizer)

    def save_checkpoint(self, checkpoint_dict: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Writes a sharded checkpoint directory at ``filepath``, a local path or fsspec URL (collective; atomic).

        With ``async_checkpoint`` it returns once this rank's tensors are copied; the files follow.
        """
        if storage_options is not None:
            raise TypeError("VarunaStrategy.save_checkpoint does not take storage_options.")
        # async: the ranks compare paths in the background instead (no collective in the training thread)
        path = str(filepath) if self.async_checkpoint else self.broadcast(str(filepath))
        shards = {"state_dict": checkpoint_dict.pop("state_dict")}
        for i, state in enumerate(checkpoint_dict.pop("optimizer_states", [])):
            shards[f"optimizer_{i}"] = state
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        groups = checkpoint_state.param_groups_by_name(self.lightning_module, optimizers)
        names = self.engine.param_names if self.engine is not None else []
        self._checkpoints.save(path, shards, checkpoint_dict, groups, names, self.verify_checkpoints,
                               self._lease_ticket(path))

    def _take_leases(self, trainer: Trainer) -> None:
        """Rank 0 takes the lease of every checkpoint folder of this fit; any refusal is raised on every rank."""
        if self.checkpoint_lease_timeout is None:
            return
        problem = None
        if self.is_global_zero:
            self._leases = LeaseKeeper(self.checkpoint_lease_timeout)
            problem = self._leases.acquire(checkpoint_folders(trainer))
        problem = self.broadcast(problem)
        if problem is not None:
            raise CheckpointError(problem)

    def _lease_ticket(self, path: str) -> LeaseTicket | None:
        """Rank 0: how a save takes its folder's lease (kept and renewed during fit, released after it otherwise)."""
        if self.checkpoint_lease_timeout is None or not self.is_global_zero:
            return None
        if self._leases is None:
            return LeaseTicket(Holder.current(), self.checkpoint_lease_timeout, keep=False)
        self._leases.track(Location.of(path).parent)
        return self._leases.ticket()

    def wait_for_checkpoint(self) -> None:
        """Blocks until the checkpoint being written in the background (``async_checkpoint``) is complete.

        Raises:
            CheckpointError: On every rank, if that write failed.
        """
        self._checkpoints.flush()

    def remove_checkpoint(self, filepath: Any) -> None:
        """Deletes a checkpoint (on rank 0); while a save is in flight, only once that one is complete."""
        if self.is_global_zero:
            self._checkpoints.remove(str(filepath))

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Loads this stage's share of a sharded (or plain single-file) checkpoint, whatever P x D wrote it."""
        assert self.engine is not None
        self._checkpoints.wait()
        path = self.broadcast(str(checkpoint_path))
        # with ckpt_path="last", a bad checkpoint falls back to the newest good one of the run
        trainer = self.lightning_module.trainer
        fallbacks = self.broadcast(last_fallbacks(trainer, path) if self.is_global_zero else None)
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        names = self.engine.param_names
        return checkpoint.load(path, self.lightning_module, optimizers, names, weights_only, fallbacks,
                               self.verify_checkpoints, requested_name(trainer, path))

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Nothing to do: :meth:`load_checkpoint` has loaded the weights."""

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Nothing to do: :meth:`load_checkpoint` has loaded the optimizer state."""

    # -- collectives Lightning needs ----------------------------------------------------------------------
    def barrier(self, name: str | None = None) -> None:
        """Waits for every process."""
        if name == "Trainer.save_checkpoint":
            return  # the save ended with the ranks' agreement on its outcome, or (async) goes on in the background
        if _distributed_is_initialized():
            self._waiting(f"a barrier ({name or 'unnamed'})", dist.barrier)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Sends ``obj`` from ``src`` to every process."""
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        self._waiting(f"a broadcast from rank {src}", lambda: dist.broadcast_object_list(box, src))
        return box[0]

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Reduces a tensor over all processes (mean by default)."""
        if isinstance(tensor, Tensor):
            return self._waiting("a reduction of logged values (sync_dist)",
                                 lambda: _sync_ddp_if_available(tensor, group, reduce_op=reduce_op))
        return tensor

    def _waiting(self, what: str, wait: Callable[[], Any]) -> Any:
        """Runs a collective of Lightning's; its failure becomes a :class:`PipelineError` naming this rank."""
        if self.topology is None:  # before the pipeline exists (the dry run's broadcast of timings)
            return wait()
        return waiting_on_peers(self.topology, what, wait)

    def on_train_end(self) -> None:
        """Writes the timeline files (with ``timeline_dir``)."""
        if self._timeline is not None:
            self._timeline.write()

    def on_exception(self, exception: BaseException) -> None:
        """Reports the error to the other ranks (their watchdogs end them; they quote it if they lose contact)."""
        if _distributed_is_initialized() and not isinstance(exception, Preempted):
            report_failure(exception)

    def teardown(self) -> None:
        """Gives the model its own forwards back and releases the process resources."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        interrupted = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED
        try:
            self._checkpoints.close(interrupted)  # the last background checkpoint write finishes first
        finally:  # the rest of teardown happens even if that write failed
            watchdog = current_watchdog()
            if watchdog is not None and not interrupted:  # done with the peers: this rank may exit before them
                watchdog.deactivate("finished")
            if self._forget_cleanup is not None:
                self._forget_cleanup()
                self._forget_cleanup = None
            self._patches.undo()
            if self._leases is not None:
                self._leases.close()
                self._leases = None
            if self._preemption is not None:
                self._preemption.detach()
                self._preemption = None
            # the engine (stand-ins, cut_at hooks) stays: the module remains partitioned for this strategy's
            # later validate/test/predict calls
            module = self.lightning_module
            if module is not None and has_meta_tensors(module):  # setup failed before materializing
                move_real_tensors(module, torch.device("cpu"))
                with kept_on_meta(module):
                    super().teardown()
            else:
                super().teardown()


def _zero_grad_hooks(trainer: Trainer) -> bool:
    """Whether the module or a callback has its own zero_grad hooks (which may read last step's gradients)."""
    module = trainer.lightning_module
    return (
        is_overridden("optimizer_zero_grad", module) or is_overridden("on_before_zero_grad", module)
        or any(is_overridden("on_before_zero_grad", callback, Callback) for callback in trainer.callbacks)
    )


def _accumulating(trainer: Trainer) -> bool:
    """Whether this batch only accumulates gradients (no optimizer step follows it)."""
    return trainer.fit_loop.epoch_loop._should_accumulate()
