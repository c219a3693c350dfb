"""The pipeline engine: cut points, partitioning, schedules, the executor, p2p and gradient sync.

Nothing here imports Lightning: :class:`PipelineEngine` trains any ``nn.Module`` with cut points on an initialised
process group.
"""

from lightning_varuna.pipeline.cut import CutPoint, CutPointError
from lightning_varuna.pipeline.engine import PipelineEngine, StepResult
from lightning_varuna.pipeline.failures import PipelineError
from lightning_varuna.pipeline.partition import PartitionError, Plan
from lightning_varuna.pipeline.schedules import SCHEDULES, Kind, Schedule, Task, make_schedule
from lightning_varuna.pipeline.topology import Topology

__all__ = [
    "SCHEDULES", "CutPoint", "CutPointError", "Kind", "PartitionError", "PipelineEngine", "PipelineError", "Plan",
    "Schedule", "StepResult", "Task", "Topology", "make_schedule",
]
