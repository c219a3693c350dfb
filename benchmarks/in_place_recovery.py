"""In-place recovery time: SIGKILL of one process to the next completed step on the survivors, on loopback.

Run from the repository root::

    python benchmarks/in_place_recovery.py --runs 5 --out benchmarks/results/in_place_recovery.json

Each run is ``tests/jobs/in_place.py``: TinyGPT under ``VarunaStrategy(recovery="in_place")`` over a ``varuna-store``,
its ranks forked as an external launcher starts them; the last rank SIGKILLs itself in a forward of step 3. Layouts:
4 processes (P=2 x D=2 -> P=2 x D=1) and 8 processes (P=2 x D=4 -> P=2 x D=3). Reported per run:

* ``kill_to_next_step_s``: from the kill to the end of the survivors' first step in the new world (the failure
  noticed, the survivors' agreement, new process groups, and the step trained again on the new layout);
* ``step_s``: the median time between two steps before the kill (what one step costs here, for comparison);
* ``recovery_s``: what the new rank 0 logged for the agreement and the new groups alone.

A machine that vanishes without closing its connections (a dropped link, no FIN) is not emulated here: its
detection is TCP keep-alive's (``KEEPALIVE_S`` of the watchdog), after which recovery is the same.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "jobs" / "in_place.py"
LAYOUTS = {"2x2": "forward", "2x4": "forward@8"}


def _git() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def one_run(scenario: str) -> dict:
    """Runs the job once; what it measured."""
    with tempfile.TemporaryDirectory(prefix="in-place-") as folder:
        out = Path(folder)
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
        job = subprocess.run([sys.executable, str(JOB), str(out), scenario], capture_output=True, text=True,
                             timeout=600, env=env, cwd=ROOT)
        result = json.loads((out / f"{scenario}.json").read_text())
        kill = result["fault_time"]
        steps = _records(out / f"{scenario}.rank0.jsonl")
        before = [r["time"] for r in steps if r["time"] < kill]
        after = [r["time"] for r in steps if r["world"] < steps[0]["world"]]  # the new world's first step
        logged = re.search(r"recovered in place in ([0-9.]+) s", (out / f"{scenario}.rank0.log").read_text())
        return {
            "kill_to_next_step_s": round(after[0] - kill, 3) if after else None,
            "step_s": round(statistics.median(b - a for a, b in zip(before, before[1:])), 3) if len(before) > 1
            else None,
            "recovery_s": float(logged.group(1)) if logged else None,
            "steps": len(steps),
            "returncodes": {rank: info["returncode"] for rank, info in result["ranks"].items()},
            "job_returncode": job.returncode,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per layout (layouts alternate)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    names = args.layouts.split(",")
    result: dict = {"command": " ".join(sys.argv), "commit": _git(), "cpus": os.cpu_count(),
                    "loadavg_start": list(os.getloadavg()), "layouts": {name: {"runs": []} for name in names}}
    start = time.monotonic()
    for i in range(args.runs):
        for name in names:
            run = one_run(f"{LAYOUTS[name]}#{i}")
            print(f"{name} run {i}: {run}", flush=True)
            result["layouts"][name]["runs"].append(run)
    for layout in result["layouts"].values():
        times = [r["kill_to_next_step_s"] for r in layout["runs"] if r["kill_to_next_step_s"] is not None]
        layout["completed"] = len(times)
        layout["median_kill_to_next_step_s"] = statistics.median(times) if times else None
        layout["range_kill_to_next_step_s"] = [min(times), max(times)] if times else None
    result.update(wall_s=round(time.monotonic() - start, 1), loadavg_end=list(os.getloadavg()))
    print(json.dumps({n: {k: v for k, v in s.items() if k != "runs"} for n, s in result["layouts"].items()}, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
