"""Compiled blocks against eager: compile time and steady step time, under VarunaStrategy at P=2 and in the plain run.

The model, data and optimizer of ``benchmarks/real_compute.py`` (the example GPT: 4 blocks, n_embd 64, 4 heads, block
64, vocabulary 256, tied head; batch 8; the model's own AdamW and LambdaLR), in two variants:

- ``eager``: as built;
- ``compiled``: each block compiled in place in ``configure_model`` (``for block in blocks: block.compile()``, as
  torchtitan does), backend ``--backend`` (default ``inductor``), with a fresh inductor cache per job.

Two systems: ``plain``, the single-process ``Trainer`` (no strategy), 1 thread; ``ours``, ``Trainer(strategy=
VarunaStrategy(pipeline_parallel_size=2, num_microbatches=4, partition="params"))`` on 2 torchrun processes, 1 thread
each, the default schedule (``varuna``) and recompute. Every (system, variant) is its own job, so each compiles
from nothing; one call runs all four, ``--repeats`` times, the order rotated between repetitions.

Per job: the setup time (``fit`` called to the first step's start, the dry run included: it runs compiled modules
eagerly), the first step (its forward and backward compile), the median step time over ``--steps`` steps after
``--warmup`` steps, and the compiler's counters (graphs after the first step and at the end, graph breaks). Step k
lasts from the latest end of step k-1 over the ranks to the latest end of step k (``time.monotonic``, one clock for
the processes of a host); the first from the latest ``on_train_start``.

    python benchmarks/compiled.py --out benchmarks/results/compiled.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_compute import BATCH, CONFIG, MICROBATCHES, _git, _loadavg, make_loader  # noqa: E402

SYSTEMS = ("plain", "ours")
VARIANTS = ("eager", "compiled")


def build(compiled: bool, backend: str):
    """The example GPT with real layers and the benchmark's initial weights; ``compiled``: each block compiled."""
    import torch

    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    from model import GPT

    class CompiledBlocksGPT(GPT):
        def configure_model(self) -> None:
            built = hasattr(self, "blocks")
            super().configure_model()
            if not built:
                for block in self.blocks:  # in place, as torchtitan does
                    block.compile(backend=backend)

    torch.manual_seed(1234)
    gpt = (CompiledBlocksGPT if compiled else GPT)(**CONFIG)
    gpt.configure_model()  # real layers, initialized here: every job starts from the same weights
    return gpt


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from lightning_varuna import VarunaStrategy

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    ours = args.system == "ours"
    stamps: dict = {"ends": []}
    graphs: dict = {}

    class Stamps(pl.Callback):
        def on_train_start(self, trainer, module) -> None:
            stamps["train_start"] = time.monotonic()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            stamps["ends"].append(time.monotonic())
            if batch_idx == 0:
                graphs["after_first_step"] = counters["stats"]["unique_graphs"]

    model = build(args.variant == "compiled", args.backend)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2 if ours else 1,
        strategy=VarunaStrategy(pipeline_parallel_size=2, num_microbatches=MICROBATCHES, partition="params")
        if ours else "auto",
        max_steps=args.warmup + args.steps + 1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Stamps()],
    )
    stamps["fit"] = time.monotonic()
    trainer.fit(model, make_loader(args.warmup + args.steps + 3))
    record = {**stamps, "graphs_after_first_step": graphs.get("after_first_step", 0),
              "graphs_at_end": counters["stats"]["unique_graphs"],
              "graph_breaks": sorted(" ".join(r.split())[:200] for r in counters["graph_break"])}
    records = [record]
    if ours:
        records = [None] * dist.get_world_size()
        dist.all_gather_object(records, record)
    if trainer.global_rank == 0:
        Path(args.record).write_text(json.dumps(records))


def summarize(records: list[dict], warmup: int) -> dict:
    """Setup, first-step and steady step times of one job from its ranks' stamps (see the module docstring)."""
    ends = [max(r["ends"][k] for r in records) for k in range(min(len(r["ends"]) for r in records))]
    start = max(r["train_start"] for r in records)
    steps = [b - a for a, b in zip(ends, ends[1:])]
    steady = steps[warmup:]
    return {"setup_s": start - max(r["fit"] for r in records), "first_step_s": ends[0] - start,
            "steps_after_first_s": steps, "median_step_s": statistics.median(steady),
            "graphs_after_first_step": max(r["graphs_after_first_step"] for r in records),
            "graphs_at_end": max(r["graphs_at_end"] for r in records),
            "graph_breaks": sorted({b for r in records for b in r["graph_breaks"]})}


def job(system: str, variant: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "record.json"
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
                    if system == "ours" else [sys.executable])
        command = [*launcher, str(Path(__file__).resolve()), "--worker", "--system", system, "--variant", variant,
                   "--backend", args.backend, "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--record", str(record)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor"),  # compiles from nothing
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        load = _loadavg()
        started = time.monotonic()
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
        wall = time.monotonic() - started
        if proc.returncode != 0 or not record.exists():
            raise SystemExit(f"{system} {variant} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
        result = summarize(json.loads(record.read_text()), args.warmup)
    result.update(system=system, variant=variant, wall_s=wall, loadavg_before=load, loadavg_after=_loadavg())
    print(f"  {system:5s} {variant:8s} setup {result['setup_s']:5.1f} s, first step {result['first_step_s']:6.2f} s,"
          f" median step {result['median_step_s'] * 1e3:6.1f} ms, graphs {result['graphs_after_first_step']}"
          f" -> {result['graphs_at_end']}, breaks {len(result['graph_breaks'])}, wall {wall:.0f} s", flush=True)
    return result


def render(out: dict) -> str:
    """Per system and variant: every run's figures, and the medians' ratio compiled / eager."""
    runs = out["jobs"]
    lines = ["| system | variant | setup s per run | first step s per run | median step ms per run |"
             " graphs after step 1 / at end | graph breaks |", "|---|---|---|---|---|---|---|"]
    for system in SYSTEMS:
        for variant in VARIANTS:
            mine = [r for r in runs if r["system"] == system and r["variant"] == variant]
            if not mine:
                continue
            cells = [" / ".join(f"{r['setup_s']:.1f}" for r in mine),
                     " / ".join(f"{r['first_step_s']:.2f}" for r in mine),
                     " / ".join(f"{r['median_step_s'] * 1e3:.1f}" for r in mine),
                     " / ".join(f"{r['graphs_after_first_step']}/{r['graphs_at_end']}" for r in mine),
                     str(max(len(r["graph_breaks"]) for r in mine))]
            lines.append(f"| {system} | {variant} | " + " | ".join(cells) + " |")
    lines += ["", "| system | compiled / eager median step: median (min-max) | first step, compiled - eager s:"
              " median (min-max) |", "|---|---|---|"]
    for system in SYSTEMS:
        eager, compiled = ([r for r in runs if r["system"] == system and r["variant"] == v] for v in VARIANTS)
        pairs = list(zip(eager, compiled))  # the k-th run of each, from the same repetition
        if not pairs:
            continue
        ratios = [c["median_step_s"] / e["median_step_s"] for e, c in pairs]
        extra = [c["first_step_s"] - e["first_step_s"] for e, c in pairs]
        lines.append(f"| {system} | **{statistics.median(ratios):.2f}** ({min(ratios):.2f}-{max(ratios):.2f}) |"
                     f" **{statistics.median(extra):.1f}** ({min(extra):.1f}-{max(extra):.1f}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="JSON result file")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each (system, variant) job")
    parser.add_argument("--steps", type=int, default=40, help="measured steps per job")
    parser.add_argument("--warmup", type=int, default=5, help="steps after the first that are not measured")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of the blocks")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    parser.add_argument("--render", default=None, metavar="JSON", help="print the tables of a result file and stop")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("system", "variant", "record"):
        parser.add_argument(f"--{name}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.render:
        print(render(json.loads(Path(args.render).read_text())))
        return
    out = {
        "command": "python benchmarks/compiled.py " + " ".join(sys.argv[1:]),
        "config": {**CONFIG, "batch": BATCH, "microbatches": MICROBATCHES, "steps": args.steps,
                   "warmup": args.warmup, "backend": args.backend, "threads_per_process": 1},
        "package_commit": _git("rev-parse", "HEAD"),
        "package_uncommitted_changes": _git("status", "--porcelain", "--", "lightning_varuna"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "loadavg_start": _loadavg(),
        "jobs": [],
    }
    pairs = [(s, v) for s in SYSTEMS for v in VARIANTS]
    for rep in range(args.repeats):
        order = pairs[rep % len(pairs):] + pairs[:rep % len(pairs)]
        print(f"run {rep + 1}/{args.repeats} (load {_loadavg()})", flush=True)
        for system, variant in order:
            out["jobs"].append(job(system, variant, args))
            if args.out:
                Path(args.out).write_text(json.dumps(out, indent=1))
    out["loadavg_end"] = _loadavg()
    out["table_md"] = render(out)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    print(out["table_md"])


if __name__ == "__main__":
    main()
