"""Models larger than one process's share: memory, the largest model that trains, and setup time.

Compares the example GPT (``examples/gpt/model.py``) built two ways, under ``VarunaStrategy`` with torchrun:

- ``init``: built in ``__init__`` (``model.configure_model()`` called before ``fit``): every rank builds and
  initializes the whole model, then keeps its stage's share;
- ``configure``: built in ``configure_model`` by Lightning, parameters on the meta device, and each stage
  materializes and initializes only its own (``param_init_fn``);
- ``configure-autograd`` (``--builds``, memory part only): as ``configure``, with weight gradients accumulated
  by autograd (``fuse_grad_accumulation=False``) instead of in place.

One command runs everything (under the benchmark lock; each trial's memory is capped, see below)::

    python benchmarks/big_models.py --out benchmarks/results/big_models.json

- ``memory``: a 2.2 GB (fp32) GPT, P=4 on 4 processes, SGD, batch 8 x 16 tokens: each rank's peak resident
  memory (growth over the process's resident memory before the model exists) during setup and through 2 steps,
  next to its parameter, gradient, optimizer-state and activation bytes; and the setup time (model
  construction to the first step). ``--runs`` runs of each.
- ``largest``: the largest GPT (more layers of the same width) that trains 2 steps within the memory budget
  (``--budget-gib``, the job's total proportional set size, 10 GiB by default), for P=4 with SGD and P=8 with
  AdamW, both ways. A coarse bisection from a predicted size finds the boundary within a tenth of the layers
  (at most ``--max-trials`` trials per build); every trial is kept.

Memory caps: each trial runs under ``prlimit --as`` (per process) and a watchdog that kills the whole job as
soon as its total proportional set size exceeds the budget, so a trial too large for the machine fails on its
own and never takes the machine down. A trial that fails that way, or by running out of address space, does
not fit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
VOCAB, TOKENS, BATCH = 256, 16, 8


# -- one rank --------------------------------------------------------------------------------------------------
def _status_mib(key: str) -> float:
    return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size


def worker(args: argparse.Namespace) -> None:
    """One rank of a trial: builds the model as asked, trains 2 steps, writes its measurements."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    from model import GPT, init_weights

    import lightning_varuna

    torch.set_num_threads(1)
    base = _status_mib("VmRSS")
    _reset_peak()
    started = time.perf_counter()

    class BenchGPT(GPT):
        def configure_optimizers(self):
            if args.optimizer == "sgd":
                return torch.optim.SGD(self.parameters(), lr=1e-3)
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    model = BenchGPT(vocab_size=VOCAB, block_size=TOKENS, n_layer=args.layers, n_head=args.width // 128,
                     n_embd=args.width, dropout=0.0, bias=False)
    if args.build == "init":
        model.configure_model()  # the whole model, built and initialized here on every rank

    record: dict = {"rank": int(os.environ["RANK"]), "base_mib": base}

    class Probe(pl.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            record["setup_s"] = time.perf_counter() - started
            record["setup_peak_mib"] = _status_mib("VmHWM") - base

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            if trainer.global_step == 1:  # the second step: gradients, and the optimizer state of the first
                params = list(pl_module.parameters())
                record["param_bytes"] = sum(p.numel() * p.element_size() for p in params)
                record["grad_bytes"] = sum(p.grad.numel() * p.grad.element_size() for p in params
                                           if p.grad is not None)
                record["optimizer_bytes"] = sum(v.numel() * v.element_size() for s in optimizer.state.values()
                                                for v in s.values() if torch.is_tensor(v) and v.dim())

        def on_train_end(self, trainer, pl_module) -> None:
            strategy = trainer.strategy
            info = strategy.engine.partition.stages[strategy.topology.stage]
            record["stage"] = strategy.topology.stage
            # an upper bound: every micro-batch's saved activations held at once (recompute holds fewer)
            record["activation_bytes"] = info.saved_bytes * pipeline
            # the gradient sync's peak of the last step: .grad plus its own buffers
            record["sync_peak_bytes"] = strategy.engine.grad_sync.peak_held_bytes
            record["peak_mib"] = _status_mib("VmHWM") - base

    pipeline = args.pipeline or args.procs  # P; D = procs / P replicas (benchmarks/zero_largest.py)
    strategy = lightning_varuna.VarunaStrategy(pipeline_parallel_size=pipeline, num_microbatches=pipeline,
                                               param_init_fn=init_weights, zero_stage=args.zero or 0,
                                               fuse_grad_accumulation=args.build != "configure-autograd")
    trainer = pl.Trainer(accelerator="cpu", devices=args.procs, strategy=strategy, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Probe()])
    tokens = torch.randint(VOCAB, (4 * BATCH, TOKENS + 1), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)
    trainer.fit(model, data)
    Path(args.record, f"rank{record['rank']}.json").write_text(json.dumps(record))


# -- a trial: one torchrun job, capped ---------------------------------------------------------------------------
def _pss_mib(pid: int) -> float:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0.0
    found = re.search(r"^Pss:\s+(\d+)", text, re.M)
    return int(found.group(1)) / 1024 if found else 0.0


def _tree_pids(root: int) -> list[int]:
    """``root`` and every process below it (torchrun's workers run in sessions of their own)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int(Path(entry, "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(parents.get(pid, []))
    return found


def _kill_tree(root: int) -> None:
    for pid in _tree_pids(root):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _available_gib() -> float:
    return int(re.search(r"MemAvailable:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1)) / 2**20


def trial(layers: int, width: int, procs: int, optimizer: str, build: str, budget_gib: float,
          timeout: float, pipeline: int | None = None, zero_stage: int = 0) -> dict:
    """Runs one configuration; returns its ranks' records, whether it fit, and the job's peak total PSS.

    ``pipeline``: P (default ``procs``: one replica); ``zero_stage``: the strategy's.
    """
    params = 12 * width * width * layers + (VOCAB + TOKENS) * width
    config = {"layers": layers, "width": width, "procs": procs, "optimizer": optimizer, "build": build,
              "params": params, "param_gib": params * 4 / GIB, "budget_gib": budget_gib,
              "pipeline": pipeline or procs, "zero_stage": zero_stage}
    while _available_gib() < budget_gib:  # other work on the machine: wait rather than risk its memory
        print(f"  waiting: {_available_gib():.1f} GiB available, the trial may use {budget_gib} GiB", flush=True)
        time.sleep(30)
    with tempfile.TemporaryDirectory() as out:
        command = [
            "prlimit", f"--as={int((budget_gib + 6) * GIB)}",  # per process: the budget plus its mappings
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}",
            str(Path(__file__).resolve()), "--worker", "--layers", str(layers), "--width", str(width), "--procs",
            str(procs), "--optimizer", optimizer, "--build", build, "--record", out,
            "--pipeline", str(pipeline or procs), "--zero", str(zero_stage),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2", "PYTHONWARNINGS": "ignore",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        started = time.perf_counter()
        job = run_within_budget(command, env, budget_gib, timeout)
        if job.timed_out:
            config["timed_out"] = True
        output = job.output
        records = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    fits = job.returncode == 0 and not job.killed_over_budget and len(records) == procs
    config.update(fits=fits, killed_over_budget=job.killed_over_budget, returncode=job.returncode,
                  peak_pss_gib=job.peak_pss_gib,
                  wall_s=time.perf_counter() - started, ranks=records)
    if not fits:
        config["output_tail"] = output[-1500:]
    state = "fits" if fits else ("over budget" if job.killed_over_budget else f"failed ({job.returncode})")
    print(f"  {build:9s} {procs} procs P={pipeline or procs} zero_stage={zero_stage} {optimizer:5s}"
          f" {layers:3d} layers x {width}: {params / 1e9:.2f} B params"
          f" ({config['param_gib']:.1f} GiB), peak job PSS {job.peak_pss_gib:.1f} GiB: {state}", flush=True)
    return config


# -- the measurements ----------------------------------------------------------------------------------------------
def memory(runs: int, budget_gib: float, timeout: float, builds: list[str]) -> list[dict]:
    trials = []
    for run in range(runs):
        for build in builds:
            print(f"memory: run {run + 1}/{runs}", flush=True)
            trials.append(trial(7, 2560, 4, "sgd", build, budget_gib, timeout))
    return trials


def largest(procs: int, optimizer: str, width: int, start: dict[str, int], budget_gib: float, timeout: float,
            trials: list[dict], save: Callable[[], None], max_trials: int = 4) -> None:
    """The largest number of layers that fits, for each build, by a coarse bisection from a predicted size.

    Up by a quarter while it fits (down by a fifth while it does not) until a fitting and a failing size bracket
    the boundary, then halving the bracket until it is within a tenth, at most ``max_trials`` trials per build.
    Each trial is appended to ``trials`` and saved as soon as it ends.
    """
    for build in ("init", "configure"):
        fits, fails, layers = 0, None, max(procs, start[build])
        for _ in range(max_trials):
            result = trial(layers, width, procs, optimizer, build, budget_gib, timeout)
            trials.append(result)
            save()
            if result["fits"]:
                fits = layers
            else:
                fails = layers
            if fails is None:
                layers = max(layers + 1, round(layers * 1.25))
            elif not fits:
                if fails == procs:  # not even one layer per stage fits
                    break
                layers = max(procs, min(fails - 1, round(fails * 0.8)))
            elif fails - fits <= max(1, fits // 10):
                break
            else:
                layers = (fits + fails) // 2


def _predict(procs: int, optimizer: str, width: int, budget_gib: float) -> dict[str, int]:
    """Layers that should just fit, each build: the first size the search tries.

    From the memory runs: built in ``__init__`` every process holds about 1.1x the whole model at its peak;
    built in ``configure_model`` the job holds about 1.1x the parameters, gradients and optimizer state in all;
    each process starts at about 0.55 GiB before the model.
    """
    copies = {"sgd": 2, "adamw": 4}[optimizer]  # parameter, gradient (+ 2 AdamW moments), over all stages
    free = budget_gib - 0.55 * procs
    per_layer = 12 * width * width * 4 / GIB
    return {"init": max(procs, int(free / (1.1 * procs * per_layer))),
            "configure": max(procs, int(free / (1.1 * copies * per_layer)))}


def _mib(value: float) -> str:
    return f"{value / 2**20:,.0f}"


def render(results: dict) -> str:
    """Markdown tables of the results (``--render``)."""
    lines = []
    memory = results.get("memory", [])
    if memory:
        model = memory[0]["param_gib"] * GIB
        lines += [f"Memory, P=4 on 4 processes, SGD, {memory[0]['params'] / 1e9:.2f} B parameters"
                  f" ({memory[0]['param_gib']:.2f} GiB fp32), batch {BATCH} x {TOKENS} tokens; growth of each rank's"
                  " resident memory over the process before the model (MiB), every run:", "",
                  "| build | run | stage | params | grads | setup peak | peak (2 steps) | peak / (params + grads)"
                  " | peak / model | setup s |", "|---|---|---|---|---|---|---|---|---|---|"]
        runs: dict[str, int] = {}
        for t in memory:
            runs[t["build"]] = runs.get(t["build"], 0) + 1
            for r in sorted(t["ranks"], key=lambda r: r["stage"]):
                share = r["param_bytes"] + r["grad_bytes"]
                peak = r["peak_mib"] * 2**20
                lines.append(
                    f"| {t['build']} | {runs[t['build']]} | {r['stage']} | {_mib(r['param_bytes'])} |"
                    f" {_mib(r['grad_bytes'])} | {r['setup_peak_mib']:,.0f} | {r['peak_mib']:,.0f} |"
                    f" {peak / share:.2f} | {peak / model:.2f} | {r['setup_s']:.1f} |")
        lines.append("")
    for name, trials in results.get("largest", {}).items():
        best = {}
        for build in ("init", "configure"):
            fitting = [t for t in trials if t["build"] == build and t["fits"]]
            best[build] = max(fitting, key=lambda t: t["params"]) if fitting else None
        ratio = (f"{best['configure']['params'] / best['init']['params']:.2f}x larger"
                 if best["init"] and best["configure"] else "no ratio")
        lines += [f"{name}, budget {trials[0]['budget_gib']:g} GiB, every trial in order ({ratio} built in"
                  " configure_model):", "",
                  "| build | layers x width | parameters | fp32 GiB | job peak PSS GiB | 2 steps |",
                  "|---|---|---|---|---|---|"]
        for t in trials:
            state = "fit" if t["fits"] else ("over the budget" if t["killed_over_budget"] else "failed")
            lines.append(f"| {t['build']} | {t['layers']} x {t['width']} | {t['params'] / 1e9:.2f} B |"
                         f" {t['param_gib']:.2f} | {t['peak_pss_gib']:.1f} | {state} |")
        lines += ["", f"{name}, the largest that trains, per rank (MiB; peak is the growth of resident memory):", "",
                  "| build | stage | params | grads | optimizer | activations (bound) | rest | peak |",
                  "|---|---|---|---|---|---|---|---|"]
        for build, t in best.items():
            for r in sorted(t["ranks"] if t else [], key=lambda r: r["stage"]):
                known = r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"] + r["activation_bytes"]
                rest = r["peak_mib"] * 2**20 - known
                lines.append(f"| {build} | {r['stage']} | {_mib(r['param_bytes'])} | {_mib(r['grad_bytes'])} |"
                             f" {_mib(r['optimizer_bytes'])} | {_mib(r['activation_bytes'])} | {_mib(rest)} |"
                             f" {r['peak_mib']:,.0f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "big_models.json"))
    parser.add_argument("--runs", type=int, default=2, help="runs of each memory measurement")
    parser.add_argument("--budget-gib", type=float, default=10.0,
                        help="memory a job may use in all (total PSS of its processes), for the largest model")
    parser.add_argument("--max-trials", type=int, default=4, help="trials per build in the largest-model search")
    parser.add_argument("--memory-budget-gib", type=float, default=15.0, help="the same for the 2.2 GB model")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per trial")
    parser.add_argument("--only", choices=["memory", "largest"], help="run one part")
    parser.add_argument("--builds", default="init,configure",
                        help="builds of the memory part; also configure-autograd: built in configure_model, weight"
                             " gradients accumulated by autograd (fuse_grad_accumulation=False)")
    parser.add_argument("--settings", default="p4-sgd,p8-adamw", help="which largest-model searches to run")
    parser.add_argument("--render", action="store_true", help="print the tables of --out and stop")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("layers", "width", "procs", "pipeline", "zero"):
        parser.add_argument(f"--{name}", type=int, help=argparse.SUPPRESS)
    for name in ("optimizer", "build", "record"):
        parser.add_argument(f"--{name}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    if args.render:
        print(render(results))
        return
    command = "python benchmarks/big_models.py " + " ".join(sys.argv[1:])
    results["command" if args.only != "largest" else "command_largest"] = command
    if args.only in (None, "memory"):
        results["memory"] = memory(args.runs, args.memory_budget_gib, args.timeout, args.builds.split(","))
        out.write_text(json.dumps(results, indent=1))
    if args.only in (None, "largest"):
        settings = {"p4-sgd": (4, "sgd", 1536), "p8-adamw": (8, "adamw", 768)}
        results.setdefault("largest", {})
        for name, (procs, optimizer, width) in settings.items():
            if name not in args.settings.split(","):
                continue
            start = _predict(procs, optimizer, width, args.budget_gib)
            print(f"largest {name}: predicted {start} layers of width {width}", flush=True)
            results["largest"][name] = []
            largest(procs, optimizer, width, start, args.budget_gib, args.timeout, results["largest"][name],
                    lambda: out.write_text(json.dumps(results, indent=1)), args.max_trials)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")



@dataclass
class WatchedJob:
    """A job run under a memory budget: how it ended, its output, and the peak total PSS of its processes."""

    returncode: int | None
    output: str
    peak_pss_gib: float
    killed_over_budget: bool
    timed_out: bool


def run_within_budget(command: list[str], env: dict[str, str], budget_gib: float, timeout: float) -> WatchedJob:
    """Runs ``command`` in a session of its own, killing its process tree once their PSS passes ``budget_gib``."""
    job = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)
    peak, killed = [0.0], [False]

    def watch() -> None:
        while job.poll() is None:
            total = sum(_pss_mib(pid) for pid in _tree_pids(job.pid)) / 1024
            peak[0] = max(peak[0], total)
            if total > budget_gib:
                killed[0] = True
                _kill_tree(job.pid)
                return
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    timed_out = False
    try:
        output, _ = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(job.pid)
        output, _ = job.communicate()
        timed_out = True
    watcher.join()
    return WatchedJob(job.returncode, output, peak[0], killed[0], timed_out)

if __name__ == "__main__":
    main()
