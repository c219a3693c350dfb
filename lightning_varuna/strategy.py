"""The Lightning strategy: thin glue between Lightning's loops and the :class:`PipelineEngine`.

How a training step maps onto Lightning's automatic optimization (``training_step -> zero_grad ->
backward`` inside ``optimizer.step(closure)``):

- ``training_step`` runs the whole schedule (every micro-batch's forward and backward, the user's own
  ``training_step`` called once per micro-batch), moves the gradients aside, shares the last stage's logged
  values and loss with every stage, and returns the loss;
- ``zero_grad`` then finds no gradients to clear, and ``backward`` puts them back instead of
  differentiating (with gradient accumulation the schedule adds to the window's partial sum in ``.grad``);
- gradients are synced across replicas and tied copies once per optimizer step (each bucket's all-reduce
  starts during the stage's last backward; the wrapped optimizer closure waits for them), before Lightning
  clips them (with a norm taken over the whole pipeline); what ``on_before_optimizer_step`` logs is merged
  over the pipeline.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
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
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer

from lightning_varuna.checkpoint import load as checkpoint
from lightning_varuna.checkpoint import state as checkpoint_state
from lightning_varuna.checkpoint.writer import CheckpointWriter
from lightning_varuna.data import resumable_training_loader
from lightning_varuna.hook_logs import HookLogMerger, logs_in_optimizer_hook
from lightning_varuna.log_sync import LogCapture
from lightning_varuna.patches import install_ckpt_path_recorder
from lightning_varuna.pipeline.config import EngineConfig
from lightning_varuna.pipeline.engine import PipelineEngine
from lightning_varuna.pipeline.failures import report_failure, waiting_on_peers
from lightning_varuna.pipeline.topology import Topology
from lightning_varuna.planning import TimelineOutput, optimizer_spec, report_choice
from lightning_varuna.precision import PipelinePrecision, pipeline_precision
from lightning_varuna.preemption import Preempted, PreemptionGuard, PreemptionNotice
from lightning_varuna.resume import last_fallbacks
from lightning_varuna.steps import StepRunner, metric_states_kept

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
        accelerator: The accelerator (set by the Trainer).
        parallel_devices: The devices of this node (set by the Trainer).
        cluster_environment: The cluster environment (set by the Trainer).
        checkpoint_io: Checkpoint I/O plugin.
        precision_plugin: Precision plugin (set by the Trainer).
        process_group_backend: ``"gloo"`` or ``"nccl"``; by default chosen from the device.
        timeout: Timeout of collective operations of the default process group (Lightning's barriers,
            ``sync_dist``, checkpoint collectives). Default: ``p2p_timeout``, so no wait on a dead or hung
            peer lasts longer than that.
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
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
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
            partition=partition, p2p_timeout=p2p_timeout, global_batch_size=global_batch_size,
            memory_limit=memory_limit, profile=profile,
        )
        self.pipeline_parallel_size = pipeline_parallel_size
        self.timeline_dir = timeline_dir
        self._timeline: TimelineOutput | None = None
        self.boundary_dtype = boundary_dtype
        self.global_batch_size = global_batch_size
        self.preemption_notice = preemption_notice
        self.async_checkpoint = async_checkpoint
        self._process_group_backend = process_group_backend
        self._timeout = timeout if timeout is not None else timedelta(seconds=p2p_timeout)
        self._checkpoints = CheckpointWriter(asynchronous=async_checkpoint, timeout=self._timeout)
        install_ckpt_path_recorder()
        self.num_nodes = 1
        self.engine: PipelineEngine | None = None
        self.topology: Topology | None = None
        self._steps: StepRunner | None = None
        self._pending_grads: list[tuple[torch.nn.Parameter, Tensor]] = []
        self._hook_logs: HookLogMerger | None = None
        self._params: list[torch.nn.Parameter] = []
        self._preemption: PreemptionGuard | None = None

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
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

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
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._setup_pipeline(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        precision = self.precision_plugin
        assert isinstance(precision, PipelinePrecision)
        precision.global_grad_norm = self.global_grad_norm
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            precision.check_optimizers(self.optimizers)
            self._preemption = PreemptionGuard(trainer, self.preemption_notice, self.root_device)
            self._preemption.attach()
            self._checkpoints.start()  # the asynchronous writer's helper process starts while training does

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

        def dry_step(batch: Any) -> Any:
            with capture.capturing(), metric_states_kept(module), self.precision_plugin.train_step_context():
                return step(batch, 0)

        # the planner times the model's optimizer (only rank 0 profiles, and not from a given profile)
        profiles = config.searches and config.profile is None and self.global_rank == 0
        optimizer = optimizer_spec(module) if profiles else None
        plan = engine.setup(self._sample_batch(trainer), dry_step, optimizer=optimizer)
        config = engine.config
        self._params = list(module.parameters())
        self.topology = topo = engine.topology
        assert topo is not None
        self._steps = StepRunner(module, engine, self.precision_plugin)
        if engine.autoconfig is not None:
            report_choice(trainer, engine.autoconfig)
        rank_zero_info(
            f"VarunaStrategy: {topo.pipeline_size} stage(s) x {topo.data_size} replica(s), schedule"
            f" {config.schedule!r}, recompute={config.recompute}\n{plan.table()}"
        )
        if self.timeline_dir is not None and trainer.state.fn == TrainerFn.FITTING:
            self._timeline = TimelineOutput(engine, self.timeline_dir)

    def _wire_dtype(self) -> torch.dtype | None:
        if self.boundary_dtype != "auto":
            return getattr(torch, self.boundary_dtype)
        mixed = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
        return mixed.get(getattr(self.precision_plugin, "precision", ""))

    def _sample_batch(self, trainer: Trainer) -> Any:
        loop = {
            TrainerFn.FITTING: trainer.fit_loop,
            TrainerFn.VALIDATING: trainer.validate_loop,
            TrainerFn.TESTING: trainer.test_loop,
            TrainerFn.PREDICTING: trainer.predict_loop,
        }[trainer.state.fn]  # type: ignore[index]
        with torch.random.fork_rng():
            loaders = loop._data_source.dataloader()
            while isinstance(loaders, (list, tuple, dict)):
                loaders = next(iter(loaders.values())) if isinstance(loaders, dict) else loaders[0]
            try:
                batch = next(iter(loaders))
            except StopIteration:
                raise MisconfigurationException(
                    "VarunaStrategy needs one batch from the dataloader for its dry run, but it is empty."
                ) from None
        return self.batch_to_device(batch, self.root_device)

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
        """Moves the model to this process's device."""
        assert self.model is not None
        self.model.to(self.root_device)

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
        """
        trainer = self.lightning_module.trainer
        params = self._params
        # Lightning calls zero_grad after this step only on the first batch of an accumulation window. There
        # `.grad` still holds the last optimizer step's gradients: hide them from the schedule and put them back
        # for zero_grad. On later batches `.grad` holds the window's partial sum and the schedule adds to it, so
        # the gradients are complete (and reducible) as soon as the last backward has run.
        first = trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0
        stale = [p.grad for p in params] if first else None
        if first:
            for p in params:
                p.grad = None
        loss = self._run_step("training_step", args, kwargs, loss_scale=1.0 / trainer.accumulate_grad_batches,
                              start_sync=not _accumulating(trainer))
        self._pending_grads = [(p, p.grad) for p in params if p.grad is not None]
        for i, p in enumerate(params):
            p.grad = stale[i] if stale is not None else None
        return loss

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
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        for p, grad in self._pending_grads:
            if p.grad is None:
                p.grad = grad
            else:
                p.grad.add_(grad)
        self._pending_grads = []
        return self.precision_plugin.post_backward(closure_loss, module)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Steps the optimizer after syncing gradients across replicas and tied copies.

        What the module and callbacks log in ``on_before_optimizer_step`` (which runs between the closure and
        the step) is captured and, after the step, merged over the pipeline (:mod:`lightning_varuna.hook_logs`):
        logged gradient norms are the whole model's.
        """
        engine, topo = self.engine, self.topology
        assert engine is not None and topo is not None
        module = self.lightning_module
        merge = topo.pipeline_size > 1 and logs_in_optimizer_hook(module)
        capture = LogCapture(module)
        hooks = contextlib.ExitStack()
        capturing = False

        synced = 0.0

        def closure_then_sync() -> Any:
            nonlocal capturing, synced
            result = closure()
            waiting_on_peers(topo, "syncing gradients", engine.sync_gradients)
            if merge and not capturing:  # the on_before_optimizer_step hooks run next
                hooks.enter_context(capture.capturing())
                capturing = True
            synced = time.perf_counter()
            return result

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
        self._checkpoints.save(path, shards, checkpoint_dict, groups, names)

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
        return checkpoint.load(path, self.lightning_module, optimizers, names, weights_only, fallbacks)

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
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Sends ``obj`` from ``src`` to every process."""
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Reduces a tensor over all processes (mean by default)."""
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def on_train_end(self) -> None:
        """Writes the timeline files (with ``timeline_dir``)."""
        if self._timeline is not None:
            self._timeline.write()

    def on_exception(self, exception: BaseException) -> None:
        """Leaves the error where the other ranks can quote it when they lose contact with this one."""
        if _distributed_is_initialized() and not isinstance(exception, Preempted):
            report_failure(exception)

    def teardown(self) -> None:
        """Gives the model its own forwards back and releases the process resources."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        interrupted = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED
        try:
            self._checkpoints.close(interrupted)  # the last background checkpoint write finishes first
        finally:  # the rest of teardown happens even if that write failed
            if self._preemption is not None:
                self._preemption.detach()
                self._preemption = None
            # the engine (stand-ins, cut_at hooks) stays: the module remains partitioned for this strategy's
            # later validate/test/predict calls
            super().teardown()


def _accumulating(trainer: Trainer) -> bool:
    """Whether this batch only accumulates gradients (no optimizer step follows it)."""
    return trainer.fit_loop.epoch_loop._should_accumulate()
