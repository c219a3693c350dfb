"""Three gloo ranks, P=3, Varuna's schedule with recompute; the last stage's backward is slow, so the middle
stage's gradients come late while its next inputs are already there. Each rank writes how many tasks the
opportunistic rule moved to ``<out>/opportunistic.rank<r>.json``.

A middle stage can only move a forward if it sees that forward's input arrive without waiting for it (on gloo,
through the watched receives of :class:`lightning_varuna.comm.P2P`).
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

SLOW_BACKWARD_S = 0.05


class SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(SLOW_BACKWARD_S)
        return grad


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(2))

    def forward(self, x):
        x = self.cuts[0](self.layers[0](x))
        x = self.cuts[1](self.layers[1](x))
        return SlowBackward.apply(self.layers[2](x)).pow(2).mean()


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = Model()
    engine = PipelineEngine(model, EngineConfig(pipeline_parallel_size=3, num_microbatches=8, schedule="varuna",
                                         recompute=True, partition="params", p2p_timeout=60.0))
    batch = torch.randn(16, 16)
    engine.setup(batch, lambda b: model(b))
    engine.executor.feed_next_stage = False  # count the moves of Varuna's rule alone
    counters = engine.events.add(StageCounters())
    for _ in range(3):
        engine.train_step(batch, lambda b: model(b))
    moves = counters.moves
    (out / f"opportunistic.rank{dist.get_rank()}.json").write_text(json.dumps({"moves": moves}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
