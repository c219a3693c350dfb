"""The strategy's side of auto-configuration and timelines.

- :func:`report_choice`: rank 0 prints the chosen configuration and the runners-up as a table, and every logger
  gets the choice as hyper-parameters (``varuna/...``).
- :class:`TimelineOutput`: with ``VarunaStrategy(timeline_dir=...)``, every training step is recorded; the
  loggers get the bubble fraction and each stage's busy time at the logging interval, and at the end of fit
  rank 0 writes ``timeline.json`` (Chrome trace: every rank's last steps) and ``timeline.png`` (the last step of
  every stage, under the planner's prediction when it chose the configuration).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from lightning_varuna.failstop.failures import waiting_on_peers
from lightning_varuna.pipeline.engine import PipelineEngine
from lightning_varuna.pipeline.planning.choice import OptimizerSpec, PlannerChoice
from lightning_varuna.pipeline.planning.memory_model import MEMORY_RESERVE
from lightning_varuna.pipeline.planning.search import format_table
from lightning_varuna.pipeline.timelines.picture import has_matplotlib, render_png
from lightning_varuna.pipeline.timelines.timeline import (
    TimelineEvent,
    TimelineRecorder,
    pipeline_metrics,
    predicted_events,
    write_chrome_trace,
)

__all__ = ["TimelineOutput", "choice_hparams", "optimizer_spec", "report_choice"]


class _LogsEveryNSteps(Protocol):
    log_every_n_steps: int  # set by Lightning's logger connector, not declared on Trainer


def optimizer_spec(module: LightningModule) -> OptimizerSpec | None:
    """The class and defaults of the first optimizer ``configure_optimizers`` returns (None if there is none).

    The profiler times one step of that class and counts its state; the optimizer made here is thrown away.
    """
    try:
        found = _first_optimizer(module.configure_optimizers())
    except Exception:  # noqa: BLE001 - the planner then assumes AdamW; Lightning reports the error later
        return None
    if found is None:
        return None
    return type(found), {k: v for k, v in found.defaults.items() if k != "params"}


def _first_optimizer(value: Any) -> torch.optim.Optimizer | None:
    if isinstance(value, torch.optim.Optimizer):
        return value
    if isinstance(value, dict):
        return _first_optimizer(value.get("optimizer"))
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_optimizer(item)
            if found is not None:
                return found
    return None


def choice_hparams(autoconfig: PlannerChoice) -> dict[str, Any]:
    """The chosen configuration as hyper-parameters."""
    c = autoconfig.chosen
    return {
        "varuna/pipeline_parallel_size": c.pipeline_size, "varuna/data_parallel_size": c.data_size,
        "varuna/microbatch_size": c.microbatch_size, "varuna/num_microbatches": c.num_microbatches,
        "varuna/schedule": c.schedule, "varuna/recompute": c.recompute, "varuna/stages_per_rank": c.stages_per_rank,
        "varuna/predicted_step_s": c.step_s, "varuna/predicted_bubble": c.bubble,
        "varuna/predicted_peak_bytes": max(c.peak_bytes), "varuna/memory_limit": autoconfig.memory_limit,
        "varuna/profile_source": autoconfig.source,
    }


def report_choice(trainer: Trainer, autoconfig: PlannerChoice, rows: int = 6) -> None:
    """Prints the choice and the runners-up on rank 0 and logs the choice to every logger's hyper-parameters."""
    c = autoconfig.chosen
    rank_zero_info(
        f"VarunaStrategy auto-configuration: {c.describe()}, predicted {c.step_s * 1e3:.2f} ms per step "
        f"(profile: {autoconfig.source}; {autoconfig.seconds:.2f} s to profile and search)\n"
        + format_table(autoconfig.ranking, limit=rows, memory_limit=autoconfig.memory_limit,
                       reserve=MEMORY_RESERVE)
    )
    for logger in trainer.loggers:
        logger.log_hyperparams(choice_hparams(autoconfig))


class TimelineOutput:
    """Records every training step and writes the metrics and files (see the module's docstring).

    Args:
        engine: The set-up engine (its recorder is started here).
        directory: Where the files go.
    """

    def __init__(self, engine: PipelineEngine, directory: str | Path) -> None:
        self.engine = engine
        self.directory = Path(directory)
        topology = engine.topology
        assert topology is not None, "the engine is set up"
        self.recorder = TimelineRecorder(topology.stage, topology.replica)
        engine.record_timeline(self.recorder)
        self._steps = 0

    def optimizer_step(self, start: float, end: float) -> None:
        """Records the optimizer step (``time.perf_counter`` times)."""
        self.recorder.add("optimizer", start, end)

    def log_metrics(self, trainer: Trainer) -> None:
        """Every ``log_every_n_steps`` optimizer steps, logs the pipeline metrics of the steps since.

        Collective over the pipeline, at the same steps on every rank.
        """
        self._steps += 1
        if not trainer.loggers or self._steps % max(1, cast(_LogsEveryNSteps, trainer).log_every_n_steps):
            return
        topology = self.engine.topology
        assert topology is not None
        spans = self.recorder.take_spans()
        gathered: list[Any] = [None] * topology.pipeline_size
        if topology.pipeline_size > 1:
            waiting_on_peers(topology, "gathering the pipeline metrics",
                             lambda: dist.all_gather_object(gathered, spans, group=topology.pipe_group))
        else:
            gathered = [spans]
        metrics = pipeline_metrics(gathered)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def write(self) -> None:
        """Gathers every rank's kept events and writes the trace and the PNG on rank 0 (collective)."""
        topology = self.engine.topology
        assert topology is not None
        events = self.recorder.events()
        gathered: list[Any] = [events]
        if topology.world_size > 1:
            gathered = [None] * topology.world_size
            waiting_on_peers(topology, "gathering the timeline", lambda: dist.all_gather_object(gathered, events))
        if topology.rank != 0:
            return
        executed: list[TimelineEvent] = [e for rank_events in gathered for e in rank_events]
        self.directory.mkdir(parents=True, exist_ok=True)
        write_chrome_trace(self.directory / "timeline.json", executed, "executed")
        last = max((e.step for e in executed), default=0)
        panels = [(f"executed: step {last}", [e for e in executed if e.step == last])]
        autoconfig = self.engine.autoconfig
        if isinstance(autoconfig, PlannerChoice):
            predicted = predicted_events(autoconfig.prediction())
            write_chrome_trace(self.directory / "timeline_predicted.json", predicted, "predicted")
            panels.insert(0, (f"predicted: {autoconfig.chosen.describe()}", predicted))
        picture = ""
        if has_matplotlib():
            render_png(self.directory / "timeline.png", panels)
        else:
            picture = " (no timeline.png: pictures need matplotlib, pip install 'lightning-varuna[viz]')"
        rank_zero_info(f"VarunaStrategy: timeline written to {self.directory}{picture}")
