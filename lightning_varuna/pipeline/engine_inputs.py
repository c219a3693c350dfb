"""What the engine is given instead of importing it: a planner, and a recorder of the steps' timeline.

The planner chooses the ``"auto"`` values at setup; the recorder receives the training steps' events. The runtime
neither plans nor draws: auto-configuration (:mod:`lightning_varuna.pipeline.planning`) and the timeline
(:mod:`lightning_varuna.pipeline.timelines`) sit above it and are handed in through these interfaces, by the strategy
or by a user of the engine alone (``tests/architecture/test_architecture.py`` keeps it so).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn

from lightning_varuna.pipeline.comm.events import Event
from lightning_varuna.pipeline.config import EngineConfig

if TYPE_CHECKING:
    from lightning_varuna.pipeline.model.dry_run import Trace

__all__ = ["Chosen", "OptimizerSpec", "Planner", "StepRecorder"]

OptimizerSpec = tuple[type[torch.optim.Optimizer], dict[str, Any]]
"""The optimizer the profiler times: its class and keyword arguments."""


class Chosen(Protocol):
    """What the engine uses of a planner's answer (the planner's own answer holds more: the ranking, ...)."""

    @property
    def config(self) -> EngineConfig:
        """The config the engine was given, with every ``"auto"`` value replaced by the chosen one."""
        ...

    def segment_costs(self) -> list[float]:
        """Each segment's cost, by which the stages are balanced (``partition="time"``)."""
        ...


class Planner(Protocol):
    """Chooses the ``"auto"`` values at setup, on every rank alike (collective when a process group is initialised).

    :func:`lightning_varuna.pipeline.planning.choice.choose` is the package's planner.
    """

    def __call__(self, config: EngineConfig, module: nn.Module, trace: Trace, step_on: Callable[[int], Any],
                 loss_of: Callable[[Any], Tensor], replica_batch_size: int, device: torch.device,
                 optimizer: OptimizerSpec | None = None) -> Chosen:
        """The choice for ``module``, whose dry run gave ``trace``; ``step_on(n)`` runs the step on ``n`` samples."""
        ...


class StepRecorder(Protocol):
    """A recorder of the training steps' timeline: the executor's events, and the spans the engine adds.

    :class:`lightning_varuna.pipeline.timelines.timeline.TimelineRecorder` is the package's recorder.
    """

    def __call__(self, event: Event) -> None:
        """Receives each event of the executor (an :class:`~.comm.events.EventHooks` recorder)."""
        ...

    def add(self, kind: str, start: float, end: float, microbatch: int | None = None,
            chunk: int | None = None) -> None:
        """Records a span of ``kind`` (e.g. ``"sync"``), in ``time.perf_counter`` seconds."""
        ...
