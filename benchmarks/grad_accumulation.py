"""Fused gradient accumulation against autograd's: step time and peak memory of one stage's micro-batches.

One stage's work of a training step, in one process: the example GPT's blocks (``examples/gpt/model.py``), the
previous step's gradients dropped, then M micro-batches of forward and backward, gradients accumulated into
``.grad``. Measured with ``nn.Linear`` weight gradients accumulated in place
(``lightning_varuna.pipeline.runtime.fused_linear_grad``, the engine's default) and with autograd's accumulation
(``fuse_grad_accumulation=False``):

- step time: median of the timed steps of a process;
- peak memory: the growth of the process's resident memory (``VmHWM``, reset before the step) over its
  resident memory at the step's start, the largest of the timed steps.

Each (shape, mode) runs in a fresh process, modes alternating, ``--rounds`` times; every process's figures are
kept. ``MALLOC_MMAP_THRESHOLD_`` is fixed so that every large tensor is its own mapping and a freed one leaves
the resident set at once (glibc's default threshold moves with the program's history, so that a freed tensor
may stay resident or not depending on what ran before): the peak then counts the tensors alive at once, as a
GPU's allocator does.

    python benchmarks/grad_accumulation.py --out benchmarks/results/grad_accumulation.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # name: (width, layers, micro-batch, tokens, micro-batches)
    "wide": (2048, 2, 2, 16, 8),
    "gpt-small": (768, 4, 4, 128, 8),
    "narrow": (256, 4, 4, 64, 8),
}
MODES = ("fused", "autograd")


def _status_mib(key: str) -> float:
    return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


def worker(shape: str, mode: str, steps: int, threads: int) -> dict:
    """Builds the blocks, runs ``steps`` steps (after one warm-up), returns the step times and peaks."""
    import torch

    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    from model import Block

    from lightning_varuna.pipeline.runtime.fused_linear_grad import accumulating_in_place, install_grad_accumulation

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    width, layers, micro, tokens, microbatches = SHAPES[shape]
    blocks = torch.nn.Sequential(*(Block(width, width // 64, 0.0, False) for _ in range(layers)))
    if mode == "fused":
        install_grad_accumulation(blocks)
    inputs = [torch.randn(micro, tokens, width) for _ in range(microbatches)]
    times, peaks = [], []
    for step in range(steps + 1):
        for p in blocks.parameters():
            p.grad = None  # as the engine does before a step's schedule
        start_mib = _status_mib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the resident size now
        started = time.perf_counter()
        for x in inputs:
            loss = blocks(x).square().mean()
            with accumulating_in_place():  # as the engine runs a stage's backward
                loss.backward()
        elapsed = time.perf_counter() - started
        if step:  # the first step allocates the gradients' memory for the first time
            times.append(elapsed)
            peaks.append(_status_mib("VmHWM") - start_mib)
    params = sum(p.numel() * 4 for p in blocks.parameters())
    largest = max(p.numel() * 4 for p in blocks.parameters())
    return {"shape": shape, "mode": mode, "step_s": times, "peak_growth_mib": peaks,
            "param_mib": params / 2**20, "largest_weight_mib": largest / 2**20}


def run(rounds: int, steps: int, threads: int, shapes: list[str]) -> list[dict]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20), "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    records = []
    for round_ in range(rounds):
        for shape in shapes:
            for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
                command = [sys.executable, __file__, "--worker", shape, mode, "--steps", str(steps),
                           "--threads", str(threads)]
                out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=True)
                record = json.loads(out.stdout.strip().splitlines()[-1])
                record["round"] = round_
                records.append(record)
                step_ms = statistics.median(record["step_s"]) * 1e3
                print(f"round {round_ + 1}/{rounds} {shape:9s} {mode:8s} step {step_ms:8.1f} ms"
                      f"  peak growth {max(record['peak_growth_mib']):7.1f} MiB", flush=True)
    return records


def table(records: list[dict]) -> str:
    """Markdown: per shape and mode, the median over processes of each process's median step time (range), the
    median of their peaks (range), and the ratios fused / autograd."""
    lines = ["| shape (width x layers, micro-batch x tokens, micro-batches) | params MiB | largest weight MiB | mode |"
             " step ms, median (range) | peak growth MiB, median (range) |", "|---|---|---|---|---|---|"]
    ratios = []
    for shape, (width, layers, micro, tokens, m) in SHAPES.items():
        medians = {}
        for mode in MODES:
            mine = [r for r in records if r["shape"] == shape and r["mode"] == mode]
            if not mine:
                continue
            steps = [statistics.median(r["step_s"]) * 1e3 for r in mine]
            peaks = [max(r["peak_growth_mib"]) for r in mine]
            medians[mode] = (statistics.median(steps), statistics.median(peaks))
            lines.append(f"| {shape} ({width} x {layers}, {micro} x {tokens}, {m}) | {mine[0]['param_mib']:.0f} |"
                         f" {mine[0]['largest_weight_mib']:.0f} | {mode} | {medians[mode][0]:.1f}"
                         f" ({min(steps):.1f}-{max(steps):.1f}) | {medians[mode][1]:.1f}"
                         f" ({min(peaks):.1f}-{max(peaks):.1f}) |")
        if len(medians) == 2:
            ratios.append(f"| {shape} | {medians['fused'][0] / medians['autograd'][0]:.3f} |"
                          f" {medians['fused'][1] - medians['autograd'][1]:+.1f} |")
    lines += ["", "| shape | step time fused / autograd | peak growth fused - autograd (MiB) |", "|---|---|---|",
              *ratios]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "grad_accumulation.json"))
    parser.add_argument("--rounds", type=int, default=4, help="processes per (shape, mode), modes alternating")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per process")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, steps=args.steps, threads=args.threads)))
        return
    command = " ".join(["python", "benchmarks/grad_accumulation.py", *sys.argv[1:]])
    records = run(args.rounds, args.steps, args.threads, args.shapes.split(","))
    result = {"command": command, "records": records, "table_md": table(records)}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(result["table_md"])


if __name__ == "__main__":
    main()
