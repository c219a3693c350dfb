"""The pipeline engine: partition a model, run schedules on batches, sync gradients. No Lightning needed.

Typical use, on every rank of an initialised process group::

    engine = PipelineEngine(model, EngineConfig(pipeline_parallel_size=2, num_microbatches=4))
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
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_varuna.failstop.job_watchdog import current_watchdog
from lightning_varuna.pipeline.batches import (
    batch_size_of,
    count_loss_units,
    default_loss,
    first_samples,
    samples,
    split_batch,
    uneven_labels,
)
from lightning_varuna.pipeline.comm.events import EventHooks
from lightning_varuna.pipeline.comm.grad_sync import GradientSync
from lightning_varuna.pipeline.comm.sharded_step import ShardedStep, check_elementwise
from lightning_varuna.pipeline.comm.sharded_sync import ShardedGradientSync
from lightning_varuna.pipeline.config import EngineConfig
from lightning_varuna.pipeline.engine_inputs import Chosen, Planner, StepRecorder
from lightning_varuna.pipeline.model.cut import CutPoint
from lightning_varuna.pipeline.model.partition import Partition
from lightning_varuna.pipeline.model.stand_ins import remove_stand_ins
from lightning_varuna.pipeline.runtime.executor import StageExecutor
from lightning_varuna.pipeline.runtime.fused_linear_grad import remove_grad_accumulation
from lightning_varuna.pipeline.scheduling.schedules import Schedule, make_schedule
from lightning_varuna.pipeline.stage_setup import StageSetup
from lightning_varuna.pipeline.topology import Topology
from lightning_varuna.pipeline.varuna_warning import VarunaWarning

__all__ = ["PipelineEngine", "StepResult", "split_batch", "batch_size_of", "first_samples", "samples", "default_loss"]

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What a step returns on every rank."""

    outputs: list[Any]
    """The step function's output per micro-batch (last stage only; empty elsewhere)."""
    sizes: list[int]
    """The size of each micro-batch."""
    units: list[float] = dataclass_field(default_factory=list)
    """What each micro-batch's loss was weighted by within the batch (``units_k / sum(units)``): its size, or its
    counted tokens with ``loss_weighting`` by tokens."""
    summary: Tensor | None = None
    """The last stage's step summary, on every stage (when one was asked for)."""


class PipelineEngine(StageSetup):
    """Splits a model into pipeline stages and runs schedules over them.

    Args:
        module: The model, with ``CutPoint`` modules where it may be split (or see ``cut_at``). Built with real
            tensors, every rank holds the full model until :meth:`setup`, which keeps only this rank's stage;
            built with its parameters on the meta device (:func:`~lightning_varuna.pipeline.model.meta_init.
            parameters_on_meta`), each rank materializes and initializes only its stage's parameters.
        config: The options (P, micro-batches, schedule, recompute, ...), checked when the config is made:
            :class:`~lightning_varuna.pipeline.config.EngineConfig` documents each. Default: ``EngineConfig()``.
        device: The device of this rank (default: CPU).
        planner: Chooses the ``"auto"`` values at setup; needed when ``config`` leaves any to it
            (``config.searches``): :func:`lightning_varuna.pipeline.planning.choice.choose`, the package's planner.

    With ``"auto"`` for ``microbatch_size``, ``schedule``, ``recompute``, or ``pipeline_parallel_size`` together
    with ``global_batch_size``, :meth:`setup` has ``planner`` profile the model and choose those values;
    :attr:`autoconfig` then holds its choice.

    :attr:`events` is the executor's event hook: recorders added there (:mod:`~lightning_varuna.pipeline.runtime.
    events`) see every task and transfer; there are none by default.
    """

    def __init__(
        self,
        module: nn.Module,
        config: EngineConfig | None = None,
        device: torch.device | None = None,
        *,
        planner: Planner | None = None,
    ) -> None:
        if config is None:
            config = EngineConfig()
        elif not isinstance(config, EngineConfig):
            raise TypeError(f"PipelineEngine takes its options as one EngineConfig, got {config!r}: write"
                            " PipelineEngine(module, EngineConfig(pipeline_parallel_size=..., ...)).")
        if config.searches and planner is None:
            raise ValueError(
                "This EngineConfig leaves values to the planner ('auto', a profile to plan from, or a memory_limit to"
                " check): give the engine"
                " one, PipelineEngine(module, config, planner=choose) with"
                " `from lightning_varuna.pipeline.planning.choice import choose`."
            )
        self.planner = planner
        self.config = config
        self.module = module
        self.device = device or torch.device("cpu")
        self.topology: Topology | None = None
        self.partition: Partition | None = None
        self.executor: StageExecutor | None = None
        self.grad_sync: GradientSync | None = None
        self.events = EventHooks()
        """The executor's event hook: add recorders (:mod:`~.comm.events`) before or after setup."""
        self.autoconfig: Chosen | None = None
        """The planner's choice, when it chose (with :func:`~lightning_varuna.pipeline.planning.choice.choose`: an
        :class:`~lightning_varuna.pipeline.planning.choice.PlannerChoice`, which holds the ranking too)."""
        self.recorder: StepRecorder | None = None
        """What each training step did when (see :meth:`record_timeline`); None when not recording."""
        size = config.pipeline_parallel_size
        self._pipeline_size: int | None = size if isinstance(size, int) else None
        self._cuts: list[CutPoint] = []
        self._hooks: list[Any] = []
        self._stand_ins: list[Any] = []
        self._accumulating: list[nn.Linear] = []
        self._schedules: dict[tuple[int, bool], Schedule] = {}
        self._batch_dims: tuple[int | None, int | None] = (None, None)
        self.built_on_meta = False
        self._weighting_checked = False
        """Whether :meth:`setup` found parameters on the meta device (and materialized this stage's)."""

    @classmethod
    def from_config(cls, module: nn.Module, config: EngineConfig, device: torch.device | None = None,
                    planner: Planner | None = None) -> PipelineEngine:
        """The same as ``PipelineEngine(module, config, device, planner=planner)``."""
        return cls(module, config, device, planner=planner)

    @property
    def pipeline_size(self) -> int:
        """P (known once :meth:`setup` has resolved ``"auto"``)."""
        if self._pipeline_size is None:
            raise RuntimeError("pipeline_parallel_size='auto' is resolved by PipelineEngine.setup().")
        return self._pipeline_size

    # -- sizes --------------------------------------------------------------------------------------------
    def microbatches_for(self, batch_size: int, train: bool = True) -> int:
        """How many micro-batches a batch of ``batch_size`` is split into.

        A batch with fewer samples than ``num_microbatches`` (the last one of an epoch without ``drop_last``) runs
        one micro-batch per sample, each loss weighted by its size, as the plain run's mean over the batch. Every
        stage sees the same batch, so all derive the same count, and the schedule of each count is made once.
        ``schedule="interleaved"`` runs rounds of P micro-batches: a short batch of at least P samples runs the
        largest multiple of P micro-batches it can fill.

        Args:
            batch_size: The batch's samples.
            train: Whether the batch is trained on (evaluation splits alike; kept for callers that pass it).
        """
        config = self.config
        if isinstance(config.microbatch_size, int):  # "auto" is resolved by the planner at setup, before any split
            return max(1, math.ceil(batch_size / config.microbatch_size))
        if config.num_microbatches is not None:
            m = min(config.num_microbatches, batch_size)
            if m < config.num_microbatches and config.schedule == "interleaved" and m >= self.pipeline_size:
                m -= m % self.pipeline_size
            return max(1, m)
        return max(1, min(2 * self.pipeline_size, batch_size))

    def _schedule(self, m: int, train: bool) -> Schedule:
        key = (m, train)
        if key not in self._schedules:
            self._schedules[key] = make_schedule(
                self.config.schedule, self.pipeline_size, m, recompute=self.config.recomputes and train, train=train,
                stages_per_rank=int(self.config.stages_per_rank),
                forwards_keep_graphs=self._forwards_keep_activations(),
            )
        return self._schedules[key]

    def _forwards_keep_activations(self) -> bool:
        """Whether a recomputing stage's forwards keep activations, so the schedule's order without recompute is run.

        Recompute by degree keeps the later segments' graphs; a policy keeps the saved ops' outputs (about half a
        block's activations for matrix products and attention). The recompute orders let forwards run ahead or
        overlap a held-back ``W`` with the next forward, which costs only a stashed input when nothing else is kept
        (with a policy, ``zero-bubble``'s held ``W(k)`` beside two stashes took 1.3x the peak of its order without
        recompute, measured). Varuna's own list without recompute runs more forwards ahead than with it, so a policy
        keeps its recompute order.
        """
        config = self.config
        if config.recompute_segments is not None:
            return True
        return config.recompute_policy is not None and config.schedule != "varuna"

    def record_timeline(self, recorder: StepRecorder) -> StepRecorder:
        """Starts recording every training step's tasks, waits, sends and gradient sync into ``recorder``.

        Args:
            recorder: e.g. ``TimelineRecorder(engine.topology.stage, engine.topology.replica)``
                (:mod:`lightning_varuna.pipeline.timelines.timeline`); replaces the recorder given before.
        """
        if self.recorder is not None:
            self.events.remove(self.recorder)
        self.recorder = recorder
        self.events.add(recorder)  # it sees the executor's events, and keeps those of training steps
        return recorder

    # -- steps --------------------------------------------------------------------------------------------
    def train_step(
        self, batch: Any, step: Callable[[Any], Any], loss_of: Callable[[Any], Tensor] | None = None,
        loss_scale: float = 1.0, loss_transform: Callable[[Tensor], Tensor] | None = None,
        summary: Callable[[list[Any], list[float]], Tensor] | None = None, start_sync: bool = False,
        accumulated: Mapping[nn.Parameter, Tensor] | None = None,
    ) -> StepResult:
        """Runs forward and backward of every micro-batch of ``batch``; gradients add up in ``.grad``.

        The loss of micro-batch ``k`` is weighted by its share of the batch (``size_k / batch``) times
        ``loss_scale``, so the gradients equal those of the mean loss over the whole batch; with ``loss_weighting``
        by tokens, by its share of the batch's counted tokens (``tokens_k / tokens``, counted on the micro-batches
        before the schedule: one host read per step), for a loss that is a mean over tokens. ``loss_transform``
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

    def eval_step(self, batch: Any, step: Callable[[Any], Any], weigh: bool = False) -> StepResult:
        """Runs forward only (validation, test, predict); outputs exist on the last stage.

        With ``weigh``, ``StepResult.units`` holds what training would weight each micro-batch's loss by (its
        counted tokens under ``loss_weighting`` by tokens); else the sizes.
        """
        return self._run(batch, step, train=False, weigh=weigh)

    def _run(self, batch: Any, step: Callable[[Any], Any], train: bool, loss_of: Any = None,
             loss_scale: float = 1.0, loss_transform: Callable[[Tensor], Tensor] | None = None,
             summary: Callable[[list[Any], list[float]], Tensor] | None = None,
             start_sync: bool = False, accumulated: Mapping[nn.Parameter, Tensor] | None = None,
             weigh: bool = True) -> StepResult:
        if self.executor is None or self.topology is None:
            raise RuntimeError("Call PipelineEngine.setup() before running steps.")
        size = batch_size_of(batch)
        m = self.microbatches_for(size, train)
        micro = split_batch(batch, m)
        sizes = [batch_size_of(mb) for mb in micro]
        schedule = self._schedule(m, train)
        loss_of = loss_of or default_loss
        weighting = self.config.loss_weighting if weigh else "samples"
        units = count_loss_units(micro, sizes, weighting, self.device)
        if train and weighting == "samples" and not self._weighting_checked:
            self._weighting_checked = True  # the first training step only: one host read, never again
            _warn_if_labels_uneven(micro, sizes, self.device)
        total = sum(units)
        weights = [n / total * loss_scale for n in units]
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
            recompute=self.config.recomputes,
            loss_of=weighted_loss,
            summary=(lambda results: summary(results, units)) if summary is not None else None,
            last_backward=functools.partial(sync.overlapping, accumulated) if sync is not None else None,
        )
        if sync is not None:
            sync.start(accumulated)
        return StepResult(
            outputs=outputs if self.topology.is_last else [],
            sizes=sizes,
            units=units,
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
    def shards_optimizer(self) -> bool:
        """Whether optimizers step a shard of each parameter (``zero_stage=1`` with D > 1; after :meth:`setup`)."""
        return isinstance(self.grad_sync, ShardedGradientSync)

    def shard_optimizer(self, optimizer: Optimizer) -> ShardedStep | None:
        """With ``zero_stage=1``, makes ``optimizer`` (over this stage's parameters) step this replica's shard only.

        Its ``state`` then holds shard-sized tensors, its ``param_groups`` the module's parameters; after each
        ``step`` the updated rows are all-gathered. The squared norm shares of :meth:`local_grad_norm_sq` then add up
        over every rank of the job, not only the pipeline. None when nothing is sharded (``zero_stage=0``, or D=1).

        Raises:
            ValueError: With ``zero_stage=1`` (whatever D), an optimizer whose update is not elementwise (LBFGS...).
        """
        if self.config.zero_stage != 1:
            return None
        check_elementwise(optimizer)
        if not isinstance(self.grad_sync, ShardedGradientSync):
            return None
        names = {p: n for n, p in self.module.named_parameters()}
        return ShardedStep(self.grad_sync, optimizer, names)

    @property
    def param_names(self) -> list[str]:
        """The full model's parameter names, in ``named_parameters()`` order (known after :meth:`setup`)."""
        return list(self.partition.trace.param_numel) if self.partition is not None else []

    @property
    def stage_param_names(self) -> tuple[str, ...]:
        """The names of the parameters this rank holds (a tied parameter on every rank that uses it)."""
        assert self.partition is not None and self.topology is not None
        return self.partition.rank_params(self.topology.stage)

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
        :mod:`~lightning_varuna.failstop.watchdog`).
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


def _warn_if_labels_uneven(micro: list[Any], sizes: list[int], device: torch.device) -> None:
    counts = uneven_labels(micro, sizes, device)
    if counts is None or (dist.is_initialized() and dist.get_rank() != 0):
        return
    warnings.warn(
        f"The micro-batches of the first step count {', '.join(f'{c:g}' for c in counts)} labels other than -100 for"
        f" {', '.join(map(str, sizes))} samples, but loss_weighting='samples' weights each micro-batch's mean loss by"
        " its samples: if the loss is a mean over tokens (a Hugging Face model's own loss), the pipelined loss and"
        " gradients differ from the plain run's. Set loss_weighting='shifted_tokens' (causal language models that"
        " shift the labels inside, *ForCausalLM) or 'tokens'; keep 'samples' if the loss is a mean over samples.",
        VarunaWarning, stacklevel=3,
    )
