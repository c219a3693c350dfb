"""What the schedule tests share: random message delays for the simulator, the chunk graphs a rank's task list
holds, and a four-stage partition with a tied embedding."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from lightning_varuna.pipeline.model.dry_run import Trace
from lightning_varuna.pipeline.model.partition import Partition, StageInfo
from lightning_varuna.pipeline.scheduling.schedules import Kind, Task


def random_delays(seed: int) -> Callable[..., float]:
    """A delay per message, exponential with mean 0.5 (half a forward, or half a chunk's), the same whenever that
    message is asked for again; fixed per seed."""
    draws, table = random.Random(seed), {}
    return lambda *message: table.setdefault(message, draws.expovariate(2.0))


def peak_graphs_until_i_and_w(tasks: tuple[Task, ...], recomputing: set[int]) -> tuple[int, int]:
    """The most chunk graphs a rank holds at once until their ``I`` and until their ``W``."""
    until_i = until_w = peak_i = peak_w = 0
    for task in tasks:
        builds = Kind.R if task.stage in recomputing else Kind.F
        if task.kind is builds:
            until_i, until_w = until_i + 1, until_w + 1
            peak_i, peak_w = max(peak_i, until_i), max(peak_w, until_w)
        elif task.kind is Kind.I:
            until_i -= 1
        elif task.kind is Kind.W:
            until_w -= 1
    return peak_i, peak_w


def tied_partition(stages_per_rank: int, **options: Any) -> Partition:
    """Four one-segment stages; the embedding (stage 0) and the head (stage 3) share ``wte.weight``."""
    names = ["wte.weight", "b0.weight", "b1.weight", "b2.weight", "head.weight"]
    trace = Trace.__new__(Trace)
    trace.param_numel = dict.fromkeys(names, 4)
    stage_params = [("wte.weight", "b0.weight"), ("b1.weight",), ("b2.weight",), ("head.weight", "wte.weight")]
    stages = tuple(StageInfo(segments=range(s, s + 1), params=p, param_numel=4 * len(p), seconds=0.0)
                   for s, p in enumerate(stage_params))
    return Partition(stages=stages, tied=(("wte.weight", (0, 3)),), trace=trace, stages_per_rank=stages_per_rank,
                     **options)
