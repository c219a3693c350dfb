"""The pipeline engine: cut points, partitioning, schedules, the executor, p2p and gradient sync.

Nothing here imports Lightning: :class:`PipelineEngine` trains any ``nn.Module`` with cut points on an initialised
process group. Here: :mod:`~.engine` (with :mod:`~.stage_setup`), :mod:`~.config`, :mod:`~.engine_inputs` (the
planner and timeline recorder it is given), :mod:`~.topology`, :mod:`~.batches`; sub-packages :mod:`~.model`
(splitting a model), :mod:`~.scheduling`, :mod:`~.runtime` (a stage's step), :mod:`~.comm` (between ranks),
:mod:`~.planning` (auto-configuration), :mod:`~.timelines`.
"""

from lightning_varuna.failstop.failures import PipelineError
from lightning_varuna.pipeline.config import EngineConfig
from lightning_varuna.pipeline.engine import PipelineEngine, StepResult
from lightning_varuna.pipeline.model.cut import CutPoint, CutPointError
from lightning_varuna.pipeline.model.dry_run import PartitionError
from lightning_varuna.pipeline.model.partition import Partition
from lightning_varuna.pipeline.scheduling.schedules import SCHEDULES, Kind, Schedule, Task, make_schedule
from lightning_varuna.pipeline.topology import Topology

__all__ = [
    "SCHEDULES", "CutPoint", "CutPointError", "EngineConfig", "Kind", "PartitionError", "PipelineEngine",
    "PipelineError", "Partition", "Schedule", "StepResult", "Task", "Topology", "make_schedule",
]
