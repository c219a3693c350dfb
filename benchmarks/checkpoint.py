"""Step time lost to a checkpoint: no save vs a blocking save vs an asynchronous save, in one job.

Run from the repository root (4 gloo processes, 1 thread each; P=2 stages x D=2 replicas)::

    torchrun --standalone --nproc-per-node=4 benchmarks/checkpoint.py --out benchmarks/results/checkpoint.json

With ``--nproc-per-node=2`` it runs P=2 x D=1: one process per core on a 2-core machine, as on a GPU node where
each process has its device and host cores to spare (no replica shares the writing).

Smoke size (seconds, for checking that it runs)::

    torchrun --standalone --nproc-per-node=4 benchmarks/checkpoint.py --smoke

Model and data: the example GPT (``examples/gpt/model.py``) as in ``examples/gpt/config.yaml`` (n_layer 4,
n_embd 64, n_head 4, block_size 64, vocab 256, tied embedding/head; dropout 0) unless ``--n-layer`` /
``--n-embd`` say otherwise, batch 8 per replica, 4 micro-batches, the model's AdamW and schedule.

Modes, each one ``Trainer.fit`` of ``warmup + (saves + 1) * every`` steps with
``VarunaStrategy(pipeline_parallel_size=2, num_microbatches=4)``:

* ``none``: no checkpoint (its estimate below is the estimator's noise floor);
* ``blocking``: ``trainer.save_checkpoint(DIR/last.ckpt)`` every ``every`` steps (from a callback, at the end of a
  step, as ``ModelCheckpoint`` does; each save replaces the previous one);
* ``async``: the same with ``VarunaStrategy(async_checkpoint=True)``.

The saving modes save once during the warm-up (at step 2) and wait for that write before the measured steps, so
that the writer processes' start and DCP's first call are not measured (the first save's call is reported as
``first_save_call_s``). The measured saves come ``every // 2`` steps after the warm-up, then every ``every``
steps; the fit ends a whole interval after the last one. Every ``round`` runs every mode once, in an order that
rotates between rounds, so that they share the machine's background load.

``--idle-cpu-ms N[,N...]``: one more mode per ``N``, ``idle-cpu-N``, which saves nothing: instead, at each save
point, a helper process per rank (started with the fit, at idle CPU priority like the checkpoint writers) spends
``N`` ms of CPU in a busy loop. It measures what background CPU work costs the training processes on this
machine, whatever the work is: the asynchronous writers' share of the loss is their CPU time per write.

``--accelerator-like F_MS``: the same model, optimizer and checkpoint (same parameters, same AdamW state, same
bytes), but the step's compute mostly leaves the CPU, as on a GPU node, where the training thread waits for
kernels and the host's cores are free: each block's forward sleeps ``F_MS / n_layer`` ms (its backward twice that;
a recompute sleeps again) and the batch shrinks to 1 sequence of 8 tokens per micro-batch, so that real
compute is small. On this machine the default mode keeps both cores busy with 4 training processes, so a
background write can only take CPU time from training; this mode shows what the asynchronous save costs when
there is CPU to spare.

``--unverified``: two more modes, ``blocking-unverified`` and ``async-unverified``, with
``VarunaStrategy(verify_checkpoints=False)`` (no checksums, no check that parameters are finite): the cost of the
checks. Versions of the package without that option skip them.

After the measured window every saving mode makes ``--timed-writes`` more saves, one per step, each followed at
once by ``trainer.strategy.wait_for_checkpoint()``: ``save call`` is how long the training thread was in
``save_checkpoint`` (what a save blocks training for) and ``write`` how long until the checkpoint was complete
(the call included), both the latest over ranks; for ``async``, ``writer CPU`` is the CPU time the writer processes
spent on it (the busiest rank's, from ``/proc``). These saves are not in the step-time estimate.

Timing: every rank stamps ``time.monotonic()`` (one clock for the host) at the end of each step; step k lasts
from the latest stamp of step k-1 to the latest of step k (over ranks), so a save made at the end of step k
counts in step k+1. For each save, lost = the sum of the ``every // 2`` steps after it minus the mean of the sums
of the half-intervals before it and before the next save (so that a drift of the step time cancels out); lost per
checkpoint is the mean over the saves, reported as a fraction of the mean step of those second half-intervals
(the target for ``async``: < 10%). Each mode is measured against its own fit: step times differ by up to 20%
between fits on a 2-core machine. ``save call`` is how long ``save_checkpoint`` kept the training loop (latest
rank): for ``async``, the copy of the tensors into shared memory and the hand-over to the writer process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ["none", "blocking", "async"]
WARMUP_SAVE_STEP = 2
BATCH, MICROBATCHES = 8, 4


def build_gpt(n_layer: int, n_embd: int):
    import torch

    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    from model import GPT

    torch.manual_seed(1234)
    model = GPT(vocab_size=256, block_size=64, n_layer=n_layer, n_head=4, n_embd=n_embd, dropout=0.0)
    model.configure_model()  # built whole, here: the same model for every version of the package measured
    return model


def make_loader(num_batches: int, replicas: int, batch: int = BATCH, length: int = 64):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (num_batches * batch * replicas, length + 1), generator=g)
    data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    return DataLoader(data, batch_size=batch, shuffle=False, drop_last=True, num_workers=0)


def sleep_in_blocks(model, forward_ms: float) -> None:
    """Each block's forward sleeps ``forward_ms / n_layer`` ms and its backward twice that (accelerator-like)."""
    import torch

    per_block = forward_ms / 1e3 / len(model.blocks)

    class SleepInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            time.sleep(2 * per_block)
            return grad

    def hook(module, inputs, output):
        if output.device.type == "meta":  # shape inference of the pipeline's stand-ins
            return output
        time.sleep(per_block)
        return SleepInBackward.apply(output) if torch.is_grad_enabled() else output

    for block in model.blocks:
        block.register_forward_hook(hook)


_IDLE_CPU_HELPER = """
import os, sys, time
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
seconds = float(sys.argv[1]) / 1e3
while sys.stdin.buffer.read(1):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
    sys.stdout.buffer.write(b".")
    sys.stdout.flush()
"""


class IdleCpu:
    """A helper process at idle CPU priority that spends ``ms`` of CPU each time it is poked."""

    def __init__(self, ms: float) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", _IDLE_CPU_HELPER, str(ms)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE)

    def poke(self) -> None:
        self.process.stdin.write(b"x")
        self.process.stdin.flush()

    def wait_for(self, count: int) -> None:
        self.process.stdout.read(count)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(30)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from ``/proc`` (0 where there is none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _writer_pid(trainer) -> int | None:
    """The asynchronous writer's process (the same attribute path in every version measured)."""
    writer = getattr(trainer.strategy._checkpoints, "_process", None)
    return writer._process.pid if writer is not None else None


def _strategy(mode: str):
    from lightning_varuna import VarunaStrategy

    options = {"pipeline_parallel_size": 2, "num_microbatches": MICROBATCHES,
               "async_checkpoint": mode.startswith("async")}
    if mode.endswith("-unverified"):
        options["verify_checkpoints"] = False
    if _has_verify_option():
        options.setdefault("verify_checkpoints", True)
    return VarunaStrategy(**options)


def run_mode(mode: str, args, folder: Path) -> dict:
    """One ``Trainer.fit``; returns this rank's step-end stamps, save-call durations and timed writes."""
    import lightning.pytorch as pl

    measured_steps = args.warmup + (args.saves + 1) * args.every
    steps = measured_steps + (args.timed_writes if mode != "none" and not mode.startswith("idle-cpu-") else 0)
    first_save = args.warmup + args.every // 2
    stamps: list[float] = []
    calls: list[float] = []

    first_call: list[float] = []
    timed: list[dict] = []
    idle_cpu = IdleCpu(float(mode.removeprefix("idle-cpu-"))) if mode.startswith("idle-cpu-") else None

    def save(trainer) -> None:
        if idle_cpu is not None:
            idle_cpu.poke()
        else:
            trainer.save_checkpoint(folder / "last.ckpt")

    class Saver(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            stamps.append(time.monotonic())
            step = len(stamps)
            if mode == "none":
                return
            if step == WARMUP_SAVE_STEP:  # first use: the writer's start, DCP's first call (not measured)
                start = time.monotonic()
                save(trainer)
                first_call.append(time.monotonic() - start)
            elif step == args.warmup - 1:  # that first write done before the window (which starts after this step)
                if idle_cpu is not None:
                    idle_cpu.wait_for(1)
                else:
                    trainer.strategy.wait_for_checkpoint()
            elif first_save <= step < first_save + args.saves * args.every and (step - first_save) % args.every == 0:
                start = time.monotonic()
                save(trainer)
                calls.append(time.monotonic() - start)
            elif step > measured_steps:
                timed.append(timed_write(trainer))

    def timed_write(trainer) -> dict:
        pid = _writer_pid(trainer)
        cpu = _cpu_seconds(pid) if pid else 0.0
        start = time.monotonic()
        trainer.save_checkpoint(folder / "last.ckpt")
        call = time.monotonic() - start
        trainer.strategy.wait_for_checkpoint()
        total = time.monotonic() - start
        return {"call": call, "write": total, "writer_cpu": _cpu_seconds(pid) - cpu if pid else None}

    strategy = _strategy(mode)
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", 4))
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Saver()], num_sanity_val_steps=0)
    model = build_gpt(args.n_layer, args.n_embd)
    if args.accelerator_like:
        sleep_in_blocks(model, args.accelerator_like)
        loader = make_loader(steps + 2, 2, batch=MICROBATCHES, length=8)
    else:
        loader = make_loader(steps + 2, 2)
    try:
        trainer.fit(model, loader)
    finally:
        if idle_cpu is not None:
            idle_cpu.close()
    return {"stamps": stamps, "calls": calls, "first_call": first_call, "timed": timed}


def summarize(per_rank: list[dict], args) -> dict:
    """Step times over the measured window (after the warm-up) and the save calls, from every rank's stamps."""
    n = min(len(r["stamps"]) for r in per_rank)
    latest = [max(r["stamps"][k] for r in per_rank) for k in range(n)]
    steps = [b - a for a, b in zip(latest[args.warmup - 1 : -1], latest[args.warmup :])]
    half = args.every // 2
    # steps[i] is the step after the save at the end of the step before it
    starts = range(half, half + args.saves * args.every, args.every)
    after = [steps[i : i + half] for i in starts]
    # the half-intervals before the save and before the next one: a linear drift cancels out
    before = [steps[i - half : i] + steps[i + args.every - half : i + args.every] for i in starts]
    lost = [sum(a) - sum(b) / 2 for a, b in zip(after, before)]
    calls = [max(c) for c in zip(*(r["calls"] for r in per_rank))]
    first = [max(c) for c in zip(*(r["first_call"] for r in per_rank))]
    quiet_mean = statistics.fmean(s for b in before for s in b)
    timed = {}
    if all(r["timed"] for r in per_rank):
        for key in ("call", "write", "writer_cpu"):
            values = [[t[key] for t in r["timed"]] for r in per_rank]
            if all(v is not None for vs in values for v in vs):
                timed[f"timed_{key}_s"] = [max(v) for v in zip(*values)]
    return {**timed, "step_s": steps, "quiet_mean_step_s": quiet_mean,
            "saving_mean_step_s": statistics.fmean(s for a in after for s in a), "save_call_s": calls,
            "first_save_call_s": first, "lost_per_save_s": lost, "lost_per_checkpoint_s": statistics.fmean(lost),
            "lost_fraction_of_step": statistics.fmean(lost) / quiet_mean}


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def _has_verify_option() -> bool:
    import inspect

    from lightning_varuna import VarunaStrategy

    return "verify_checkpoints" in inspect.signature(VarunaStrategy).parameters


def modes_of(args) -> list[str]:
    unverified = args.unverified and _has_verify_option()
    extra = ["blocking-unverified", "async-unverified"] if unverified else []
    return MODES + extra + [f"idle-cpu-{n}" for n in args.idle_cpu_ms]


def worker(args) -> dict | None:
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    import logging

    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_varuna"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    base = Path(tempfile.gettempdir()) / f"varuna-ckpt-bench-{os.environ['MASTER_PORT']}"
    rounds = []
    size = 0
    started = time.monotonic()
    modes = modes_of(args)
    for r in range(args.rounds):
        order = modes[r % len(modes):] + modes[: r % len(modes)]
        results = {}
        for mode in order:
            folder = base / f"{r}-{mode}"
            mine = run_mode(mode, args, folder)
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            results[mode] = summarize(gathered, args)
            if rank == 0:
                size = max(size, _bytes(folder / "last.ckpt"))
                res = results[mode]
                print(f"round {r} {mode:8s} step 1st half {res['saving_mean_step_s'] * 1e3:6.1f} ms, 2nd half"
                      f" {res['quiet_mean_step_s'] * 1e3:6.1f} ms, lost/ckpt {res['lost_per_checkpoint_s'] * 1e3:6.1f}"
                      f" ms, save calls"
                      f" {[round(c * 1e3, 1) for c in res['save_call_s']]} ms (first, not measured:"
                      f" {[round(c * 1e3, 1) for c in res['first_save_call_s']]} ms); timed writes"
                      f" {[round(c * 1e3, 1) for c in res.get('timed_write_s', [])]} ms", flush=True)
        rounds.append(results)
    if rank != 0:
        return None
    shutil.rmtree(base, ignore_errors=True)
    return {"rounds": rounds, "checkpoint_bytes": size, "wall_s": time.monotonic() - started}


def _git(*args: str, cwd: Path = ROOT) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def render(out: dict) -> str:
    """The results table (markdown): per mode, medians over rounds (min-max)."""

    def cell(values: list[float], scale: float = 1e3, fmt: str = ".1f") -> str:
        med = statistics.median(values)
        return f"{med * scale:{fmt}} ({min(values) * scale:{fmt}}-{max(values) * scale:{fmt}})"

    rows = ["| mode | step, 1st half of an interval (ms) | step, 2nd half (ms) | save call (ms) |"
            " step time lost per checkpoint (ms) | lost / step |", "|---|---:|---:|---:|---:|---:|"]
    for mode in out["rounds"][0]:
        per = [r[mode] for r in out["rounds"]]
        first_half = cell([p["saving_mean_step_s"] for p in per])
        second_half = cell([p["quiet_mean_step_s"] for p in per])
        calls = cell([statistics.fmean(p["save_call_s"]) for p in per]) if per[0]["save_call_s"] else "-"
        lost = cell([p["lost_per_checkpoint_s"] for p in per])
        frac = cell([p["lost_fraction_of_step"] for p in per], scale=100, fmt=".0f")
        rows.append(f"| `{mode}` | {first_half} | {second_half} | {calls} | {lost} | {frac} % |")
    rows += ["", "| mode | save call: training blocked (ms) | write, call to complete (ms) | writer CPU (ms) |",
             "|---|---:|---:|---:|"]
    for mode in out["rounds"][0]:
        per = [r[mode] for r in out["rounds"]]
        if "timed_call_s" not in per[0]:
            continue
        call, write = (cell([v for p in per for v in p[key]]) for key in ("timed_call_s", "timed_write_s"))
        cpu = cell([v for p in per for v in p["timed_writer_cpu_s"]]) if "timed_writer_cpu_s" in per[0] else "-"
        rows.append(f"| `{mode}` | {call} | {write} | {cpu} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="JSON result file (written by rank 0)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; each runs every mode once")
    p.add_argument("--warmup", type=int, default=10,
                   help="warm-up steps per mode (not measured); saving modes save once in it, at step 2")
    p.add_argument("--every", type=int, default=10, help="steps between saves")
    p.add_argument("--saves", type=int, default=10, help="saves per mode")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--accelerator-like", type=float, default=0.0, metavar="F_MS",
                   help="sleep F_MS per micro-batch forward (2x in backward) instead of most real compute (see above)")
    p.add_argument("--idle-cpu-ms", type=lambda v: [int(n) for n in v.split(",")], default=[], metavar="N[,N...]",
                   help="extra modes: an idle-priority helper per rank spends N ms of CPU per save point (see above)")
    p.add_argument("--timed-writes", type=int, default=5,
                   help="saves after the measured window, each waited for: save call and write time (see above)")
    p.add_argument("--unverified", action="store_true",
                   help="also the saving modes with verify_checkpoints=False (the cost of the checks)")
    p.add_argument("--smoke", action="store_true", help="1 round, 2 saves 4 steps apart: checks that it runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.rounds, args.warmup, args.every, args.saves, args.timed_writes = 1, 4, 4, 2, 2
    if "RANK" not in os.environ:
        p.error("run it under torchrun --standalone --nproc-per-node=4")
    out = worker(args)
    if out is None:
        return 0
    package = Path(__import__("lightning_varuna").__file__).parent  # PYTHONPATH may point at another version
    out.update(
        command=" ".join([f"torchrun --standalone --nproc-per-node={os.environ['WORLD_SIZE']} benchmarks/checkpoint.py",
                          *(argv or sys.argv[1:])]),
        world_size=int(os.environ["WORLD_SIZE"]),
        config={k: getattr(args, k) for k in ("rounds", "warmup", "every", "saves", "n_layer", "n_embd",
                                              "accelerator_like", "idle_cpu_ms", "timed_writes", "unverified")},
        package=str(package),
        package_commit=_git("rev-parse", "HEAD", cwd=package),
        package_uncommitted_changes=_git("status", "--porcelain", "--", ".", cwd=package),
        loadavg=os.getloadavg(),
    )
    out["table_md"] = render(out)
    print(out["table_md"])
    print(f"checkpoint: {out['checkpoint_bytes'] / 2**20:.2f} MiB; {out['wall_s']:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
