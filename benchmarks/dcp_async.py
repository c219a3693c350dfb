"""How long a save blocks training: our background writer against DCP's ``async_save`` with a process executor.

    torchrun --standalone --nproc-per-node=2 benchmarks/dcp_async.py --out benchmarks/results/dcp_async.json

Every rank holds the same model (a stack of ``nn.Linear``, AdamW state included: about 3 x its parameter bytes)
and, per mode, trains ``--steps`` steps of real compute, saving every ``--every`` steps into a temporary folder:

- ``ours``: :class:`lightning_varuna.checkpoint.writer.CheckpointWriter` with ``asynchronous=True`` (the
  strategy's ``async_checkpoint``): tensors copied into shared memory, a helper process per rank at idle
  priority writes them with DCP, publishes (temporary directory, ``record.pt`` and ``meta.pt`` last, renames,
  the folder's lease) and checks checksums;
- ``dcp-process``: ``torch.distributed.checkpoint.async_save(..., async_checkpointer_type=PROCESS)`` (what
  torchtitan uses): DCP's default stager copies the tensors, a process DCP starts at the first save writes them
  into the checkpoint folder directly; the next save first waits for the previous one's future;
- ``dcp-thread``: the same with DCP's default thread executor.

Measured per save: the seconds the training thread was blocked (the save call; the previous save is complete
by then, so no wait for it is included), and the seconds until the checkpoint was complete (waited for before
the next step, so that each save is timed alone). Every save's numbers are kept, with the command, the commit
and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_varuna.checkpoint.state import model_state, optimizer_state, param_groups_by_name  # noqa: E402
from lightning_varuna.checkpoint.writer import CheckpointWriter  # noqa: E402


def build(width: int, layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer


def step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    start = time.perf_counter()
    model(batch).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - start


def run_mode(mode: str, args: argparse.Namespace, folder: Path) -> dict:
    model, optimizer = build(args.width, args.layers)
    batch = torch.randn(args.batch, args.width)
    step(model, optimizer, batch)  # optimizer state exists from here on
    writer = CheckpointWriter(asynchronous=True) if mode == "ours" else None
    if writer is not None:
        writer.start()
    saves, steps = [], []
    names = [n for n, _ in model.named_parameters()]
    for i in range(1, args.steps + 1):
        steps.append(step(model, optimizer, batch))
        if i % args.every:
            continue
        path = folder / f"{mode}-{i}.ckpt"
        shards = {"state_dict": model_state(model), "optimizer_0": optimizer_state(model, optimizer)}
        start = time.perf_counter()
        if writer is not None:
            writer.save(path, shards, {"global_step": i}, param_groups_by_name(model, [optimizer]), names)
            blocked = time.perf_counter() - start
            writer.wait()
        else:
            kind = AsyncCheckpointerType.PROCESS if mode == "dcp-process" else AsyncCheckpointerType.THREAD
            future = dcp.async_save(shards, checkpoint_id=str(path), async_checkpointer_type=kind)
            blocked = time.perf_counter() - start
            future.result()
        saves.append({"step": i, "blocked_s": blocked, "complete_s": time.perf_counter() - start})
    if writer is not None:
        writer.close()
    return {"saves": saves, "step_s": steps}


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--modes", default="ours,dcp-process,dcp-thread")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {"command": "torchrun --standalone --nproc-per-node=" + os.environ["WORLD_SIZE"]
              + " benchmarks/dcp_async.py " + " ".join(sys.argv[1:]),
              "commit": _git("rev-parse", "HEAD"),
              "uncommitted_changes": _git("status", "--porcelain", "--", "lightning_varuna", "benchmarks"),
              "torch": torch.__version__, "cpus": os.cpu_count(), "loadavg_start": list(os.getloadavg()),
              "config": vars(args) | {"out": str(args.out)}, "modes": {}}
    with tempfile.TemporaryDirectory(prefix="dcp-async-") as tmp:
        shared = [tmp]
        dist.broadcast_object_list(shared, 0)
        folder = Path(shared[0])
        for mode in args.modes.split(","):
            dist.barrier()
            per_rank = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, run_mode(mode, args, folder))
            result["modes"][mode] = per_rank
            if rank == 0:
                blocked = [s["blocked_s"] for s in per_rank[0]["saves"]]
                print(f"{mode}: blocked per save {[round(b, 3) for b in blocked]}", flush=True)
        dist.barrier()
    result["loadavg_end"] = list(os.getloadavg())
    result["table_md"] = render(result)
    if rank == 0:
        print(result["table_md"])
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    return 0


def render(result: dict) -> str:
    """Markdown: per mode, over every rank, the first save and the later ones (medians), and the step time."""
    lines = ["| mode | first save blocked, s (slowest rank) | later saves blocked, s (median) |"
             " write complete, s (median) | step, s (median) |", "|---|---|---|---|---|"]
    for mode, ranks in result["modes"].items():
        first = max(r["saves"][0]["blocked_s"] for r in ranks)
        later = statistics.median(s["blocked_s"] for r in ranks for s in r["saves"][1:])
        complete = statistics.median(s["complete_s"] for r in ranks for s in r["saves"])
        step_s = statistics.median(t for r in ranks for t in r["step_s"])
        lines.append(f"| {mode} | {first:.3f} | {later:.3f} | {complete:.2f} | {step_s:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
