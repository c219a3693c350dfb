"""The engine on CUDA, against the plain run on the same device; each rank writes ``<out>/<mode>.rank<r>.json``.

    torchrun --nproc-per-node=2 tests/jobs/gpu_engine.py OUT shared   # two processes on cuda:0, gloo p2p
    torchrun --nproc-per-node=N tests/jobs/gpu_engine.py OUT nccl     # N >= 2 GPUs, one each, NCCL (P=2 x D=N/2)
    torchrun --nproc-per-node=2 tests/jobs/gpu_engine.py OUT cpu      # the same job on CPU (to check the job)

``shared``: every process uses ``cuda:0``; the process group is gloo (NCCL refuses two ranks on one device) and
activations and gradients travel through pinned host memory (``p2p_backend="gloo"``). ``nccl``: one GPU per
process, NCCL for the pipeline's p2p and the data-parallel all-reduce. Each run records, per configuration, the
losses and this stage's gradients after a few steps, and the same for the plain (unpipelined) model on this rank's
device; the test compares them. Configurations:

- ``fp32``: recompute on, dropout off: equal to the plain run;
- ``dropout-recompute`` / ``dropout-plain``: dropout on, with and without recompute: equal to each other (the
  recompute replays the forward's CUDA RNG state, so its dropout masks are the forward's);
- ``fp32-p4`` (four GPUs): P=4, 1F1B, where a stage posts a gradient's receive before the next activation's
  send (links are connected at setup, so no first transfer waits for a peer inside a step);
- ``bf16``: the step under ``torch.autocast("cuda", torch.bfloat16)`` and bfloat16 on the wire, against the plain
  run under the same autocast;
- ``memory-*`` (shared only): ``torch.cuda.max_memory_allocated`` of a step with recompute and with GPipe without
  it, larger activations.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_varuna import CutPoint
from lightning_varuna.pipeline.config import EngineConfig
from lightning_varuna.pipeline.engine import PipelineEngine

STEPS = 3


class Net(nn.Module):
    """Four MLP blocks with a cut point after each but the last; dropout optional."""

    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(dropout), nn.Linear(2 * width, width))
            for _ in range(4)
        )
        self.cuts = nn.ModuleList(CutPoint() for _ in range(3))

    def forward(self, x: Tensor) -> Tensor:
        for i, block in enumerate(self.blocks):
            x = x + block(x)
            if i < len(self.cuts):
                x = self.cuts[i](x)
        return x.float().pow(2).mean()


def _batches(replicas: int, rows: int, width: int, device: torch.device) -> list[Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(replicas * rows, width, generator=generator).to(device) for _ in range(STEPS)]


def _train(model: nn.Module, step, batches: list[Tensor], pipelined: PipelineEngine | None) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters() if pipelined is None else pipelined.parameters(), lr=0.1)
    losses = []
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        if pipelined is None:
            loss = step(batch)
            loss.backward()
            losses.append(float(loss.detach()))
        else:
            result = pipelined.train_step(batch, step, summary=lambda outs, sizes: torch.stack(
                [o.detach().double() * n for o, n in zip(outs, sizes)]).sum().reshape(1) / sum(sizes))
            pipelined.sync_gradients()
            losses.append(float(result.summary[0]))
        if batch is not batches[-1]:
            optimizer.step()
    return losses


def run(name: str, device: torch.device, width: int, rows: int, dropout: float, recompute: bool, schedule: str,
        bf16: bool, p2p_backend: str, stages: int = 2) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    replicas = world // stages
    torch.manual_seed(0)
    model = Net(width, dropout).to(device)
    plain = Net(width, dropout).to(device)
    plain.load_state_dict(model.state_dict())

    def step_of(net: nn.Module):
        def step(batch: Tensor) -> Tensor:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                return net(batch)
        return step

    engine = PipelineEngine(model, EngineConfig(stages, num_microbatches=4, schedule=schedule, recompute=recompute,
                                         partition="params", p2p_timeout=120, p2p_backend=p2p_backend,
                                         boundary_dtype=torch.bfloat16 if bf16 else None), device=device)
    replica = rank // stages
    batches = _batches(replicas, rows, width, device)
    mine = [b[replica * rows: (replica + 1) * rows] for b in batches]
    engine.setup(mine[0], step_of(model))
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if cuda else 0
    torch.manual_seed(1234)
    losses = _train(model, step_of(model), mine, engine)
    if cuda:
        torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before if cuda else 0
    torch.manual_seed(1234)
    plain_losses = _train(plain, step_of(plain), batches, None)
    held = set(engine.stage_param_names)
    record = {
        "stage": engine.topology.stage, "replica": replica, "device": str(device), "losses": losses,
        "plain_losses": plain_losses, "peak_bytes": peak,
        "grads": {n: p.grad.float().flatten().tolist() for n, p in model.named_parameters() if n in held},
        "plain_grads": {n: p.grad.float().flatten().tolist() for n, p in plain.named_parameters() if n in held},
    }
    engine.teardown()
    return record


def main(out: Path, mode: str) -> None:
    local = int(os.environ["LOCAL_RANK"])
    if mode == "shared":
        device, backend, p2p = torch.device("cuda", 0), "gloo", "gloo"
    elif mode == "nccl":
        device, backend, p2p = torch.device("cuda", local), "nccl", "auto"
    else:
        device, backend, p2p = torch.device("cpu"), "gloo", "auto"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    configs = {
        "fp32": dict(width=64, rows=16, dropout=0.0, recompute=True, schedule="varuna", bf16=False),
        "dropout-recompute": dict(width=64, rows=16, dropout=0.2, recompute=True, schedule="varuna", bf16=False),
        "dropout-plain": dict(width=64, rows=16, dropout=0.2, recompute=False, schedule="varuna", bf16=False),
        "bf16": dict(width=64, rows=16, dropout=0.0, recompute=True, schedule="1f1b", bf16=True),
    }
    if mode != "shared" and dist.get_world_size() == 4:  # P=4 as well: links connected before the first step
        configs["fp32-p4"] = dict(width=64, rows=16, dropout=0.0, recompute=True, schedule="1f1b", bf16=False,
                                  stages=4)
    if mode == "shared":
        configs["memory-recompute"] = dict(width=1024, rows=512, dropout=0.0, recompute=True, schedule="varuna",
                                           bf16=False)
        configs["memory-gpipe"] = dict(width=1024, rows=512, dropout=0.0, recompute=False, schedule="gpipe",
                                       bf16=False)
    results = {name: run(name, device, p2p_backend=p2p, **config) for name, config in configs.items()}
    (out / f"{mode}.rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    directory = Path(sys.argv[1])
    directory.mkdir(parents=True, exist_ok=True)
    main(directory, sys.argv[2])
