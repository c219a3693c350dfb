"""Two gloo ranks plan a small model built on the meta device with nothing given: the network measured by both, the
profile by rank 0 (a segment at a time), then each rank materializes its stage.

    torchrun --nproc-per-node=2 tests/jobs/measured.py OUT

Writes ``OUT/rank<r>.json``: the chosen configuration, the measured network and profile facts, and the loss of one
training step under the choice.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lightning_varuna.pipeline import CutPoint, EngineConfig, PipelineEngine
from lightning_varuna.pipeline.model.meta_init import parameters_on_meta
from lightning_varuna.pipeline.planning.choice import choose


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    with parameters_on_meta():
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), CutPoint(), nn.Linear(32, 32), nn.Tanh(), CutPoint(),
                              nn.Linear(32, 1))
    batch = (torch.randn(8, 16), torch.randn(8, 1))

    def step(b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(model(b[0]), b[1])

    engine = PipelineEngine(model, EngineConfig("auto", microbatch_size="auto", schedule="auto", recompute="auto",
                                         global_batch_size=8, p2p_timeout=60.0), planner=choose)
    engine.setup(batch, step)
    chosen = engine.autoconfig.chosen
    D = chosen.data_size
    local = tuple(t[rank // chosen.pipeline_size :: D] for t in batch)
    result = engine.train_step(local, step, start_sync=True)
    engine.sync_gradients()
    profile = engine.autoconfig.profile
    record = {
        "chosen": chosen.describe(), "source": engine.autoconfig.source, "built_on_meta": engine.built_on_meta,
        "saved_bytes": [list(s.saved_bytes) for s in profile.segments],
        "configurations": len(engine.autoconfig.ranking),
        "network": {k: [v.latency_s, v.bandwidth] for k, v in profile.network.__dict__.items()},
        "sizes": list(profile.microbatch_sizes), "task_overhead_s": profile.task_overhead_s,
        "optimizer_state_ratio": profile.optimizer_state_ratio, "losses": [float(o) for o in result.outputs],
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
