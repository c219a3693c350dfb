"""Recovery time of an elastic restart: a machine lost mid-training, torchrun's defaults vs tuned rendezvous settings.

Run from the repository root (each run starts two torchrun agents on loopback, 2 processes each)::

    python benchmarks/elastic.py --runs 3 --out benchmarks/results/elastic.json

Each run is ``tests/helpers/elastic_harness.py``'s job: ``examples/gpt/elastic.py`` with a tiny GPT, P=2 x D=2 over two
agents, a checkpoint every step; right after step ``--kill-after`` is recorded (so while that step's checkpoint is
being written) the second agent and its workers are SIGKILLed; the first agent's workers fail on the lost peers,
and it restarts them at world size 2 from ``last.ckpt``. Reported per setting (median over runs):

* ``kill_to_first_step_s``: from the kill to the end of the first step of the restarted workers;
* ``kill_to_relaunch_s``: to the start of the restarted worker process (failure detection, stopping the old
  workers, the new rendezvous round);
* ``relaunch_to_start_s``: imports, Trainer, process group, dry run and checkpoint load, up to the first step;
* ``steps_lost``: steps done before the kill that were done again after it.

Settings: ``default`` (torchrun's keep-alive 5 s x 3 attempts and 30 s last call), ``last-call`` (only
``last_call_timeout=3``) and ``tuned`` (``keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=3``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.elastic_harness import TUNED, run_elastic  # noqa: E402

SETTINGS = {"default": None, "last-call": {"last_call_timeout": TUNED["last_call_timeout"]}, "tuned": TUNED}
KEYS = ("kill_to_first_step_s", "kill_to_relaunch_s", "relaunch_to_start_s", "steps_lost")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per setting (alternating settings)")
    parser.add_argument("--settings", default="default,tuned", help=f"comma-separated, of {', '.join(SETTINGS)}")
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--kill-after", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    names = args.settings.split(",")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    start = time.monotonic()
    for i in range(args.runs):
        for name in names:
            with tempfile.TemporaryDirectory(prefix=f"elastic-{name}-") as workdir:
                run = run_elastic(Path(workdir), max_steps=args.max_steps, kill_after=args.kill_after,
                                  rdzv_conf=SETTINGS[name], deadline=300)
            summary = {**run.summary(), "returncodes": run.returncodes}
            print(f"{name} run {i}: {summary}", flush=True)
            if summary["kill_to_first_step_s"] is None or run.returncodes["host"] != 0:
                print(f"--- the surviving agent's output ---\n{run.logs.get('host', '')[-8000:]}", flush=True)
            runs[name].append(summary)
    result = {"command": " ".join(sys.argv), "wall_s": round(time.monotonic() - start, 1), "settings": {}}
    for name, summaries in runs.items():
        done = [s for s in summaries if s["kill_to_first_step_s"] is not None and s["returncodes"]["host"] == 0]
        result["settings"][name] = {
            "rdzv_conf": SETTINGS[name],
            "runs": summaries,
            "completed": len(done),
            **{f"median_{key}": statistics.median(s[key] for s in done) if done else None for key in KEYS},
        }
    print(json.dumps({name: {k: v for k, v in s.items() if k != "runs"} for name, s in result["settings"].items()},
                     indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
