"""A/B of the emulated benchmark: the engine of an earlier commit against this checkout's, runs alternated.

    python benchmarks/p2p_ab.py --before bda546e --pairs 3 --out benchmarks/results/p2p_ab
    python benchmarks/p2p_ab.py --summarize benchmarks/results/p2p_ab

Both sides run this checkout's ``benchmarks/emulated.py`` (it adapts to the earlier engine's API), so only the
engine differs; ``before`` imports the package extracted from ``--before`` (``git archive``), ``after`` this
checkout's. Runs alternate ``before, after, after, before, ...`` so that drift in the machine's load hits both
sides alike; every run is kept (``<side>-<i>.json`` and its log). ``after`` also runs ``ours-varuna-rc-static``
(both run-time rules off), which the earlier engine cannot.

``--summarize`` prints, per configuration, each run's step-time ratio and the median: torch's 1F1B with
checkpointing over our Varuna schedule with recompute, torch's 1F1B over our 1F1B without recompute, and our Varuna
schedule with fewer run-time rules (``-classic``: Varuna's rule alone; ``-static``: none, the list's order) over
``ours-varuna-rc`` in the same runs (above 1: what the rules gain).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = "torch-1f1b,torch-1f1b-ckpt,ours-1f1b,ours-varuna-rc,ours-varuna-rc-classic"
COMPARISONS = [  # (label, slower, faster): ratio = step time of the first / of the second (> 1: the second gains)
    ("our Varuna schedule with recompute against torch's 1F1B with checkpointing", "torch-1f1b-ckpt", "ours-varuna-rc"),
    ("our 1F1B without recompute against torch's 1F1B", "torch-1f1b", "ours-1f1b"),
    ("what the rule that feeds the next stage gains (Varuna's rule alone / both)", "ours-varuna-rc-classic",
     "ours-varuna-rc"),
    ("what both run-time rules gain (list order / both)", "ours-varuna-rc-static", "ours-varuna-rc"),
]


def _run(side: str, index: int, package: Path, out: Path) -> None:
    systems = SYSTEMS + (",ours-varuna-rc-static" if side == "after" else "")
    env = dict(os.environ, PYTHONPATH=str(package), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
               str(ROOT / "benchmarks" / "emulated.py"), "--out", str(out / f"{side}-{index}.json"),
               "--systems", systems]
    with (out / f"{side}-{index}.log").open("w") as log:
        subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=1800, check=True)


def run_pairs(before: str, pairs: int, out: Path) -> None:
    """Extracts ``before`` and runs ``pairs`` alternated pairs of the emulated benchmark."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="p2p-ab-") as tmp:
        archive = subprocess.run(["git", "archive", before], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        packages = {"before": Path(tmp), "after": ROOT}
        for pair in range(1, pairs + 1):
            order = ("before", "after") if pair % 2 else ("after", "before")
            for side in order:
                _run(side, pair, packages[side], out)


def _step_times(path: Path) -> dict[tuple[str, int, float], float]:
    rows = json.loads(path.read_text())["rows"]
    return {(row["system"], row["m"], row["jitter"]): row["step_s"] for row in rows}


def summarize(out: Path) -> str:
    """A Markdown table per comparison: each run's ratio per configuration, and the median."""
    runs = {side: [_step_times(p) for p in sorted(out.glob(f"{side}-*.json"))] for side in ("before", "after")}
    configs = sorted({(m, jitter) for times in runs["after"] for (_, m, jitter) in times})
    lines = []
    for label, peer, ours in COMPARISONS:
        lines += [f"\n{label} (`{peer}` / `{ours}`)\n", "| side | " + " | ".join(
            f"m={m}, jitter {jitter:g}" for m, jitter in configs) + " |", "|---|" + "---:|" * len(configs)]
        for side, side_runs in runs.items():
            cells = []
            for m, jitter in configs:
                ratios = [t[(peer, m, jitter)] / t[(ours, m, jitter)] for t in side_runs
                          if (peer, m, jitter) in t and (ours, m, jitter) in t]
                if not ratios:
                    cells.append("-")
                    continue
                runs_text = ", ".join(f"{r:.3f}" for r in ratios)
                cells.append(f"**{statistics.median(ratios):.3f}** ({runs_text})")
            lines.append(f"| {side} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="bda546e", help="the commit whose engine is side A")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "p2p_ab")
    parser.add_argument("--summarize", type=Path, help="print the tables of an earlier run's folder and exit")
    args = parser.parse_args()
    if args.summarize is None:
        run_pairs(args.before, args.pairs, args.out)
    print(summarize(args.summarize or args.out))


if __name__ == "__main__":
    main()
