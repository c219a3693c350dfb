"""Four gloo ranks, P=4, m=8, Varuna's schedule with recompute, every stage a layer that sleeps F per forward and
2F per backward (the unit costs Varuna's lists come from). Runs two steps with the rule that feeds a starving
next stage and two with Varuna's rule alone; each rank writes the order its last step of each ran in to
``<out>/feed.rank<r>.json``.

In the list, stage 2 holds F6 behind R3 B3 R4 B4 R5 B5 while the last stage, done with micro-batch 5, waits
for it; fed, stage 2 sends F6 as soon as the last stage has nothing left (the simulator's order).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lightning_varuna import CutPoint
from lightning_varuna.pipeline.comm.events import StageCounters
from lightning_varuna.pipeline.config import EngineConfig
from lightning_varuna.pipeline.engine import PipelineEngine

F_S = 0.03


class Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        time.sleep(F_S)
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * F_S)
        return grad


class SleepyLinear(nn.Module):
    """A module, so that stages that do not own it stand in for it and do not sleep."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return Sleep.apply(self.linear(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SleepyLinear() for _ in range(4))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(3))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.cuts):
                x = self.cuts[i](x)
        return x.pow(2).mean()


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = Model()
    engine = PipelineEngine(model, EngineConfig(pipeline_parallel_size=4, num_microbatches=8, schedule="varuna",
                                         recompute=True, partition="params", p2p_timeout=60.0))
    batch = torch.randn(16, 8)
    engine.setup(batch, lambda b: model(b))
    counters = engine.events.add(StageCounters())
    orders = {}
    for fed in (True, False):
        engine.executor.feed_next_stage = fed
        for _ in range(2):
            dist.barrier()
            engine.train_step(batch, lambda b: model(b))
        orders["fed" if fed else "varuna_rule_alone"] = [repr(task) for task in counters.executed]
    (out / f"feed.rank{dist.get_rank()}.json").write_text(json.dumps(orders))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
