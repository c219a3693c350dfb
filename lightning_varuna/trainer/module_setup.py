"""The pipeline built for a LightningModule at setup: the engine's dry run through the module's own step hook.

:func:`build_pipeline` gives the engine one batch of the running stage's dataloader and a step that calls the
module's hook for the trainer's function (``training_step`` for ``fit``, ...) in the precision plugin's context,
with its ``self.log`` calls captured (and, for a model built on the meta device, on meta). The engine partitions
the module (choosing any ``"auto"`` value with the planner); then the initial weights are loaded, unless a
checkpoint will be restored, and the parts the strategy runs each step with are returned.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info

from lightning_varuna.checkpoint.pretrained import InitialWeights, ModelLayout
from lightning_varuna.pipeline.batches import is_meta_batch
from lightning_varuna.pipeline.config import EngineConfig
from lightning_varuna.pipeline.engine import PipelineEngine
from lightning_varuna.pipeline.model.meta_init import has_meta_tensors
from lightning_varuna.pipeline.planning.choice import PlannerChoice, choose
from lightning_varuna.pipeline.topology import Topology
from lightning_varuna.trainer.batch_gradients import BatchGradients
from lightning_varuna.trainer.data import sample_batch
from lightning_varuna.trainer.logs.hook_logs import OptimizerHookLogs
from lightning_varuna.trainer.logs.log_sync import LogCapture
from lightning_varuna.trainer.patches import InstancePatches, meta_dry_run, selected_ckpt_path
from lightning_varuna.trainer.processes import ProcessGroupStrategy
from lightning_varuna.trainer.reports import TimelineOutput, optimizer_spec, report_choice
from lightning_varuna.trainer.step_hooks import StepRunner, check_metric_states

__all__ = ["STEP_HOOKS", "Pipeline", "boundary_dtype", "build_pipeline", "new_engine"]

STEP_HOOKS = {
    TrainerFn.FITTING: "training_step",
    TrainerFn.VALIDATING: "validation_step",
    TrainerFn.TESTING: "test_step",
    TrainerFn.PREDICTING: "predict_step",
}
"""The module's step hook the dry run calls, per trainer function."""


@dataclass
class Pipeline:
    """What the strategy runs each step with, once the module is partitioned."""

    engine: PipelineEngine
    topology: Topology
    steps: StepRunner
    gradients: BatchGradients
    hook_logs: OptimizerHookLogs
    timeline: TimelineOutput | None


def check_strategy_options(boundary_dtype: str, global_batch_size: int | None) -> None:
    """The strategy's own options that :class:`EngineConfig` does not check, checked before any process starts."""
    if boundary_dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(f"boundary_dtype={boundary_dtype!r}: use 'auto', 'float32', 'bfloat16' or 'float16'.")
    if global_batch_size is not None and (not isinstance(global_batch_size, int) or global_batch_size < 1):
        raise ValueError(f"global_batch_size must be a positive int or None, got {global_batch_size!r}.")


def boundary_dtype(setting: str, precision: Precision) -> torch.dtype | None:
    """The dtype of activations and gradients between stages for the strategy's ``boundary_dtype`` setting.

    ``"auto"``: the compute dtype under ``bf16-mixed``/``16-mixed`` precision, else None (as produced).
    """
    if setting != "auto":
        named: torch.dtype = getattr(torch, setting)
        return named
    mixed = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
    return mixed.get(getattr(precision, "precision", ""))


def new_engine(strategy: ProcessGroupStrategy, trainer: Trainer, config: EngineConfig) -> PipelineEngine:
    """The engine for the strategy's module (not set up yet); P is at most the node's number of devices.

    Raises:
        MisconfigurationException: For a trainer function the strategy cannot run.
    """
    if trainer.state.fn not in STEP_HOOKS:
        raise MisconfigurationException(f"VarunaStrategy cannot run trainer.{trainer.state.fn}.")
    devices = strategy.num_processes or None
    config = replace(config, max_pipeline_size=devices, devices_per_node=devices)
    return PipelineEngine(strategy.attached_module, config, device=strategy.root_device, planner=choose)


def build_pipeline(strategy: ProcessGroupStrategy, trainer: Trainer, engine: PipelineEngine, patches: InstancePatches,
                   initial_weights: InitialWeights | None, timeline_dir: str | None) -> Pipeline:
    """Partitions the strategy's module with the engine's dry run; loads the initial weights (collective).

    Args:
        strategy: The strategy (its module, precision plugin, device, rank and broadcast are used).
        trainer: The trainer being set up.
        engine: The engine of :func:`new_engine`.
        patches: Where the dry run's dataloader is handed on to Lightning's loop.
        initial_weights: Pretrained weights to load, if any.
        timeline_dir: Where ``fit``'s timeline goes, if anywhere.
    """
    module = strategy.lightning_module
    assert module is not None
    precision = strategy.precision_plugin
    config = engine.config
    fn = trainer.state.fn
    assert fn is not None  # new_engine accepted it: one of STEP_HOOKS
    step = getattr(module, STEP_HOOKS[fn])
    capture = LogCapture(module)
    on_meta = has_meta_tensors(module)
    if on_meta:
        check_metric_states(module)
    layout = ModelLayout.of(module)  # before partitioning: the whole model's keys and shapes

    def dry_step(batch: Any) -> Any:
        # a model built on meta dry-runs on a meta batch, or on the real one with placeholder weights
        dry = meta_dry_run(module) if on_meta and is_meta_batch(batch) else contextlib.nullcontext()
        with capture.capturing(), precision.train_step_context(), dry:
            return step(batch, 0)

    # the planner times the model's optimizer (only rank 0 profiles, and not from a given profile)
    profiles = config.searches and config.profile is None and strategy.global_rank == 0
    optimizer = optimizer_spec(module) if profiles else None
    batch = strategy.batch_to_device(sample_batch(trainer, patches), strategy.root_device)
    partition = engine.setup(batch, dry_step, optimizer=optimizer)
    gradients = BatchGradients(list(module.parameters()))
    topology = engine.topology
    assert topology is not None
    if on_meta:
        module.to(strategy.root_device)  # every tensor is real now: updates the module's `device`
    if initial_weights is not None:
        _load_initial_weights(strategy, trainer, initial_weights, layout)
    if isinstance(engine.autoconfig, PlannerChoice):  # the choice of `choose`, the planner given above
        report_choice(trainer, engine.autoconfig)
    rank_zero_info(
        f"VarunaStrategy: {_shape(topology.pipeline_size, partition.stages_per_rank)} x {topology.data_size}"
        " replica(s),"
        f" schedule {engine.config.schedule!r}, recompute={engine.config.recompute}\n{partition.table()}"
    )
    timeline = None
    if timeline_dir is not None and trainer.state.fn == TrainerFn.FITTING:
        timeline = TimelineOutput(engine, timeline_dir)
    steps = StepRunner(module, engine, precision)
    hook_logs = OptimizerHookLogs(topology, engine.device, engine.shards_optimizer)
    return Pipeline(engine, topology, steps, gradients, hook_logs, timeline)


def _load_initial_weights(strategy: ProcessGroupStrategy, trainer: Trainer, weights: InitialWeights,
                          layout: ModelLayout) -> None:
    # Lightning restores a checkpoint after this setup: then it supplies the weights (rank 0's view decides)
    if strategy.broadcast(selected_ckpt_path(trainer) is not None):
        rank_zero_info(f"VarunaStrategy: initial_weights ({weights.path}) not loaded: resuming from a checkpoint,"
                       " which holds the weights.")
        return
    weights.load(strategy.attached_module, layout)


def _shape(pipeline_size: int, stages_per_rank: int) -> str:
    if stages_per_rank == 1:
        return f"{pipeline_size} stage(s)"
    total = pipeline_size * stages_per_rank
    return f"{pipeline_size} pipeline ranks with {stages_per_rank} stages each ({total} stages)"
