"""The largest GPT that trains 2 AdamW steps at P=2 x D=4 (8 processes) in a memory budget, ``zero_stage`` 0 vs 1.

Each trial is one torchrun job of ``benchmarks/big_models.py``'s worker (the example GPT built in
``configure_model``, each stage materializing only its own parameters; batch 8 x 16 tokens per replica), run
under the same cap as the big-model benchmark (``run_within_budget``: the job is killed once the total
proportional set size of its processes passes ``--budget-gib``, 10 GiB by default, and every process runs
under ``prlimit --as``). The width is fixed and the search moves the number of layers: from a predicted size,
up by a quarter while it fits and down by a fifth while it does not, then halving the bracket until a fitting
and a failing size are at most ``--resolution`` layers apart (or ``--max-trials`` trials per stage ran). A
trial that times out is recorded and counts as not fitting (said in its row).

    python benchmarks/zero_largest.py --out benchmarks/results/zero_largest.json

The result file keeps every trial in order (its ranks' parameter, gradient and optimizer-state bytes and peak
resident memory), the commit, the load average at start and end, and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from big_models import GIB, trial  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROCS, PIPELINE = 8, 2
# bytes per parameter of a replica's stage, from the memory model: weights, gradients (the sync keeps no copy of
# them beyond a bucket or two), AdamW's two moments (1/D of them sharded)
BYTES_PER_PARAM = {0: 4 + 4 + 8, 1: 4 + 4 + 8 / 4}


def predicted_layers(zero_stage: int, width: int, budget_gib: float) -> int:
    """Layers that should just fit: the budget less ~0.55 GiB per process, over every replica's whole model."""
    free = (budget_gib - 0.55 * PROCS) * GIB
    replicas = PROCS // PIPELINE
    per_layer = 12 * width * width * BYTES_PER_PARAM[zero_stage] * replicas * 1.1
    return max(PIPELINE, int(free / per_layer))


def search(zero_stage: int, width: int, budget_gib: float, timeout: float, resolution: int, max_trials: int,
           trials: list[dict], save: callable) -> None:  # type: ignore[valid-type]
    """The bisection of the module's docstring; each trial appended to ``trials`` and saved as it ends."""
    fits, fails, layers = 0, None, predicted_layers(zero_stage, width, budget_gib)
    for _ in range(max_trials):
        result = trial(layers, width, PROCS, "adamw", "configure", budget_gib, timeout, pipeline=PIPELINE,
                       zero_stage=zero_stage)
        trials.append(result)
        save()
        if result["fits"]:
            fits = layers
        else:
            fails = layers
        if fails is None:
            layers = max(layers + 1, round(layers * 1.25))
        elif not fits:
            if fails == PIPELINE:
                break
            layers = max(PIPELINE, min(fails - 1, round(fails * 0.8)))
        elif fails - fits <= resolution:
            break
        else:
            layers = (fits + fails) // 2


def _load() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def render(results: dict) -> str:
    """A markdown table of every trial, and the ratio of the largest fitting sizes."""
    lines = ["| zero_stage | layers x width | parameters | job peak PSS GiB | wall s | 2 steps |",
             "|---|---|---|---|---|---|"]
    best = {}
    for t in results["trials"]:
        state = ("fit" if t["fits"] else "timed out" if t.get("timed_out") else
                 "over the budget" if t["killed_over_budget"] else "failed")
        lines.append(f"| {t['zero_stage']} | {t['layers']} x {t['width']} | {t['params'] / 1e6:.1f} M |"
                     f" {t['peak_pss_gib']:.1f} | {t['wall_s']:.0f} | {state} |")
        if t["fits"] and t["params"] > best.get(t["zero_stage"], 0):
            best[t["zero_stage"]] = t["params"]
    if 0 in best and 1 in best:
        lines.append(f"\nlargest that trains: {best[0] / 1e6:.1f} M (zero_stage=0), {best[1] / 1e6:.1f} M"
                     f" (zero_stage=1): {best[1] / best[0]:.2f}x")
    lines += ["", "Where the bytes go in the largest run that trains, per rank (MiB, the largest rank; peak: growth of"
              " the rank's resident memory over the process before the model; sync peak: `.grad` and the sync's"
              " buffers at their most, which holds the gradients once):", "",
              "| zero_stage | layers | parameters | gradients | optimizer state | activations (bound) | sync peak"
              " | sync peak - gradients | peak | peak - (parameters + sync peak + optimizer + activations) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for stage, params in sorted(best.items()):
        t = next(t for t in results["trials"] if t["zero_stage"] == stage and t["fits"] and t["params"] == params)
        r = max(t["ranks"], key=lambda r: r["peak_mib"])
        mib = 2**20
        known = r["param_bytes"] + r.get("sync_peak_bytes", r["grad_bytes"]) + r["optimizer_bytes"]
        known += r["activation_bytes"]
        lines.append(f"| {stage} | {t['layers']} | {r['param_bytes'] / mib:.0f} | {r['grad_bytes'] / mib:.0f} |"
                     f" {r['optimizer_bytes'] / mib:.0f} | {r['activation_bytes'] / mib:.0f} |"
                     f" {r.get('sync_peak_bytes', 0) / mib:.0f} |"
                     f" {(r.get('sync_peak_bytes', 0) - r['grad_bytes']) / mib:.0f} | {r['peak_mib']:.0f} |"
                     f" {r['peak_mib'] - known / mib:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "zero_largest.json"))
    parser.add_argument("--budget-gib", type=float, default=10.0, help="total PSS a job may reach")
    parser.add_argument("--width", type=int, default=512, help="the GPT's width (fixed; layers are searched)")
    parser.add_argument("--resolution", type=int, default=2, help="stop when fit and fail are this many layers apart")
    parser.add_argument("--max-trials", type=int, default=4, help="trials per zero_stage")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per trial")
    parser.add_argument("--stages", default="0,1", help="zero stages to search")
    parser.add_argument("--render", action="store_true", help="print the table of --out and stop")
    args = parser.parse_args()
    out = Path(args.out)
    if args.render:
        print(render(json.loads(out.read_text())))
        return
    results = {"command": "python benchmarks/zero_largest.py " + " ".join(sys.argv[1:]), "commit": _commit(),
               "load_start": _load(), "cpus": os.cpu_count(), "budget_gib": args.budget_gib,
               "layout": f"P={PIPELINE} x D={PROCS // PIPELINE}", "resolution_layers": args.resolution,
               "trials": []}

    def save() -> None:
        out.write_text(json.dumps(results, indent=1))

    for zero_stage in (int(s) for s in args.stages.split(",")):
        print(f"zero_stage={zero_stage}: predicted {predicted_layers(zero_stage, args.width, args.budget_gib)}"
              f" layers of width {args.width}", flush=True)
        search(zero_stage, args.width, args.budget_gib, args.timeout, args.resolution, args.max_trials,
               results["trials"], save)
    results["load_end"] = _load()
    save()
    print(render(results))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
