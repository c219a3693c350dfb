"""What auto-configuration plans for and what it predicts: the cluster, each candidate's figures.

What is fixed and what is searched is the user's own :class:`~lightning_varuna.pipeline.config.EngineConfig`: a value
``"auto"`` is searched, any other is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_varuna.pipeline.planning.memory_model import StageMemory
from lightning_varuna.pipeline.scheduling.simulator import SimResult, StageCosts

__all__ = ["Candidate", "Cluster", "PlanError", "Prediction"]


class PlanError(ValueError):
    """No configuration is valid, or none fits in memory; the message says what to change."""


@dataclass(frozen=True)
class Cluster:
    """The processes a job runs on.

    Attributes:
        world_size: All processes.
        devices_per_node: Processes per node (ranks are numbered node by node).
    """

    world_size: int
    devices_per_node: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.devices_per_node < 1:
            raise ValueError(f"a cluster needs at least one process, got {self}.")

    def _node(self, rank: int) -> int:
        return rank // self.devices_per_node

    def boundary_crosses(self, pipeline_size: int, boundary: int) -> bool:
        """Whether the messages between stages ``boundary`` and ``boundary + 1`` cross nodes (in some replica)."""
        return self.ranks_cross(pipeline_size, boundary, boundary + 1)

    def ranks_cross(self, pipeline_size: int, source: int, destination: int) -> bool:
        """Whether the messages between pipeline ranks ``source`` and ``destination`` cross nodes (in some replica)."""
        return any(self._node(d * pipeline_size + source) != self._node(d * pipeline_size + destination)
                   for d in range(self.world_size // pipeline_size))

    def replicas_cross(self, pipeline_size: int, stages: Sequence[int]) -> bool:
        """Whether the replicas of ``stages`` lie on more than one node."""
        data = self.world_size // pipeline_size
        return len({self._node(d * pipeline_size + s) for d in range(data) for s in stages}) > 1

    def sharing(self, pipeline_size: int) -> int:
        """How many stages' all-reduces leave one node at once: the node's distinct stages."""
        return min(pipeline_size, self.devices_per_node)


@dataclass(frozen=True)
class Candidate:
    """One configuration with its predictions.

    Attributes:
        pipeline_size: P.
        data_size: D.
        microbatch_size: Samples per micro-batch (the largest, when the batch does not divide evenly).
        num_microbatches: Micro-batches per step (m).
        schedule: The schedule.
        recompute: Whether non-last stages recompute; a number: their first that many segments.
        step_s: Predicted seconds per optimizer step.
        bubble: Predicted idle share of the schedule (from the first task to the last, over all stages; a
            recompute counts as busy).
        memory: Predicted peak memory per pipeline rank (of its stages together).
        stages: The segments of each stage (``P v`` stages; stage ``s`` runs on rank ``s % P``).
        fits: Whether every rank's peak is within the memory limit.
        stages_per_rank: Model chunks per rank ``v``.
    """

    pipeline_size: int
    data_size: int
    microbatch_size: int
    num_microbatches: int
    schedule: str
    recompute: bool | int
    step_s: float
    bubble: float
    memory: tuple[StageMemory, ...]
    stages: tuple[range, ...]
    fits: bool = True
    stages_per_rank: int = 1

    @property
    def peak_bytes(self) -> tuple[int, ...]:
        """Predicted peak bytes per pipeline rank."""
        return tuple(m.total for m in self.memory)

    def describe(self) -> str:
        """One line: ``P=2 x D=2, micro-batch 4 x 8, varuna, recompute`` (and ``2 chunks per rank``)."""
        recompute = ("recompute" if self.recompute is True else "no recompute" if self.recompute is False
                     else f"recompute {self.recompute} segments")
        chunks = f", {self.stages_per_rank} chunks per rank" if self.stages_per_rank > 1 else ""
        return (f"P={self.pipeline_size} x D={self.data_size}, micro-batch {self.microbatch_size} x "
                f"{self.num_microbatches}, {self.schedule}, {recompute}{chunks}")


@dataclass(frozen=True)
class Prediction:
    """A candidate and how its step unfolds (for the predicted timeline).

    Attributes:
        candidate: The configuration and its figures.
        schedule: The simulated schedule.
        costs: Each stage's task costs as simulated.
        sync: Per stage, ``(start, end)`` of its gradient sync (start = end when there is nothing to sync).
        optimizer: Per stage, ``(start, end)`` of its optimizer step.
    """

    candidate: Candidate
    schedule: SimResult
    costs: tuple[StageCosts, ...]
    sync: tuple[tuple[float, float], ...] = field(default=())
    optimizer: tuple[tuple[float, float], ...] = field(default=())
