"""Memory per stage: what a configuration holds at its peak, so that only configurations that fit are chosen.

Per stage, in bytes (:class:`StageMemory`):

- weights: the parameters the stage holds (a tied one on every stage that uses it);
- gradients: one per trainable parameter, plus the flat buffers the gradient sync reduces in (a copy of the
  stage's gradient when D > 1, and of its tied parameters when P > 1);
- optimizer: ``optimizer_state_ratio`` times the trainable bytes (Adam keeps two values per parameter), divided by D
  with ``zero_stage=1`` (each replica keeps one shard; its reduce-scatter segments add 1/D of the gradient);
- buffers: the receive buffers the executor keeps between steps (one activation per micro-batch on a non-first
  stage, one gradient per micro-batch on a non-last stage), plus one output and one input gradient in flight;
- activations: the autograd graphs the stage holds at once, counted along the schedule as it runs (the run-time
  rules included), times what one micro-batch's graph of the stage keeps. A backward frees its graph's saved
  tensors as it goes while it makes their gradients, so it needs little beyond its graph: the input gradient it
  produces is the one counted in flight.

A recomputing stage's stashed inputs are its receive buffers (on the first stage, views of the batch), so they
cost nothing beyond the buffers.

What the model does not count (the allocator's fragmentation and rounding, communication buffers, the step's
short-lived temporaries, the CUDA context on a GPU) is left to a reserve: a configuration fits when its predicted
peak is within :func:`planning_budget` of the memory limit.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_varuna.pipeline.config import parse_bytes  # defined with the options it checks; re-exported here
from lightning_varuna.pipeline.planning.profile_data import Profile
from lightning_varuna.pipeline.scheduling.schedules import Kind, Task

__all__ = [
    "MEMORY_RESERVE", "StageMemory", "activation_peak", "default_memory_limit", "format_bytes", "graphs_in_flight",
    "parse_bytes", "planning_budget", "stage_memory",
]

MEMORY_RESERVE = 0.1
"""The share of the memory limit the planner leaves for what its model does not count (see the module's docstring)."""


@dataclass(frozen=True)
class StageMemory:
    """A stage's bytes at its peak, by what holds them (see the module's docstring)."""

    weights: int
    gradients: int
    optimizer: int
    buffers: int
    activations: int

    @property
    def total(self) -> int:
        """All of it."""
        return self.weights + self.gradients + self.optimizer + self.buffers + self.activations


def graphs_in_flight(order: Sequence[Task], forwards_stash: bool) -> int:
    """The most autograd graphs a stage holds at once when it runs its tasks in ``order``.

    A forward with autograd (``forwards_stash`` off) or a recompute adds a graph; a backward frees one. A split
    backward frees it at its weight-gradient task: counted in full until then (the inputs of the linear layers
    and their output gradients, most of a transformer block's activations, wait for it).
    """
    live = peak = 0
    for task in order:
        if task.kind is Kind.R or (task.kind is Kind.F and not forwards_stash):
            live += 1
        peak = max(peak, live)
        if task.kind in (Kind.B, Kind.W):
            live -= 1
    return peak


def activation_peak(order: Sequence[Task], forward_bytes: Sequence[int], recompute_bytes: Sequence[int],
                    rank: int) -> int:
    """The most bytes of autograd graphs a rank holds at once when it runs ``order`` (tasks may name their stage).

    As :func:`graphs_in_flight`, in bytes: a forward keeps ``forward_bytes[stage]`` (all the stage saves, nothing
    where the whole stage recomputes, the kept segments' with recompute by degree), a recompute adds
    ``recompute_bytes[stage]``, a backward (a split backward's weight-gradient task) frees both. For a rank of
    several stages (model chunks) of different sizes, and for recompute by degree.
    """
    live = peak = 0
    for task in order:
        stage = rank if task.stage is None else task.stage
        if task.kind is Kind.F:
            live += forward_bytes[stage]
        elif task.kind is Kind.R:
            live += recompute_bytes[stage]
        peak = max(peak, live)
        if task.kind in (Kind.B, Kind.W):
            live -= forward_bytes[stage] + recompute_bytes[stage]
    return peak


def stage_memory(
    profile: Profile,
    segments: range,
    stage: int,
    num_stages: int,
    data_size: int,
    microbatch_size: int,
    num_microbatches: int,
    graphs: int,
    wire_bytes_per_element: float = 1.0,
    zero_stage: int = 0,
) -> StageMemory:
    """The peak memory of one stage (see the module's docstring).

    Args:
        profile: The model's profile.
        segments: The stage's segments.
        stage: The stage's index.
        num_stages: P.
        data_size: D.
        microbatch_size: Samples per micro-batch.
        num_microbatches: Micro-batches per step.
        graphs: The most autograd graphs the stage holds at once (:func:`graphs_in_flight`).
        wire_bytes_per_element: Bytes of a received activation per byte the model computes it in (0.5 for a
            bfloat16 boundary of a float32 model).
        zero_stage: 1: the optimizer state is sharded over the D replicas.
    """
    held = [p for p in profile.params if any(s in segments for s in p.segments)]
    weights = sum(p.nbytes for p in held)
    trainable = sum(p.nbytes for p in held if p.trainable)
    tied = sum(p.nbytes for p in held if p.trainable and _spans_stages(p.segments, segments))
    flat = (trainable - tied if data_size > 1 else 0) + tied
    shards = data_size if zero_stage == 1 else 1
    if shards > 1:  # the reduce-scatter's output segments
        flat += (trainable - tied) // shards
    received = profile.cuts[segments.start - 1].nbytes(microbatch_size) if stage > 0 else 0
    sent = profile.cuts[segments.stop - 1].nbytes(microbatch_size) if stage < num_stages - 1 else 0
    buffers = int(num_microbatches * (received + sent) * wire_bytes_per_element) + received + sent
    activations = graphs * sum(profile.saved_bytes(i, microbatch_size) for i in segments)
    return StageMemory(
        weights=weights,
        gradients=trainable + flat,
        optimizer=int(profile.optimizer_state_ratio * trainable / shards),
        buffers=buffers,
        activations=activations,
    )


def planning_budget(memory_limit: int) -> int:
    """The bytes a stage's predicted peak may reach: ``memory_limit`` less its :data:`MEMORY_RESERVE`."""
    return int(memory_limit * (1.0 - MEMORY_RESERVE))


def _spans_stages(param_segments: tuple[int, ...], stage_segments: range) -> bool:
    return any(s not in stage_segments for s in param_segments)


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in KiB, MiB or GiB, whichever reads best."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{int(nbytes)} B"


def default_memory_limit(device: torch.device, processes_per_node: int) -> int:
    """The memory a stage may use when no ``memory_limit`` is given.

    On CUDA the device's memory; on CPU the machine's physical memory shared evenly by the processes of the node.
    """
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return physical // max(1, processes_per_node)
