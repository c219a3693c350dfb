"""From a fault to the last rank's exit: how fast a job ends on its own when one rank fails, dies or hangs.

    python benchmarks/fault_exit.py --out benchmarks/results/fault_exit.json [--runs 1]

What it runs (the jobs of ``tests/failstop/test_faults.py`` and ``tests/failstop/test_watchdog.py``, whose tests check
bounds only):

- ``tests/jobs/faults.py`` scenarios (one fork per rank, the parent ends nothing: the times are the ranks' own):
  ``kill`` (rank 0, which hosts the job's store, SIGKILLs itself), ``exit`` (rank 1 calls ``os._exit(1)``),
  ``error`` and ``hook-error`` (rank 2 raises in ``training_step`` / in a hook; ``p2p_timeout`` is 60 s, so
  only the watchdog can end the others early), ``hang`` (rank 2 stops answering; ``p2p_timeout=5``);
- ``tests/jobs/failfast.py`` ``kill`` under each launcher (Lightning's, torchrun, independent processes): rank 3
  SIGKILLs itself inside step 7 of a P=2 x D=2 job;
- five watchdogs on a ring inside this process (real sockets and TCPStore): one closes its sockets without a
  word; the time until the last of the others has ended.

Every run's numbers per rank are kept in the result file, with the command, the commit, the machine's CPU count
and its load average before and after. A rank killed at a job's deadline (hung) is recorded as such.
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
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOBS = ROOT / "tests" / "jobs"
FAULT_SCENARIOS = ["kill", "exit", "error", "hook-error", "hang"]
LAUNCHERS = ["lightning", "torchrun", "independent"]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _ranks(record_file: Path) -> dict:
    """A job's record: per rank the seconds from the fault to its exit, its exit status, whether it hung."""
    record = json.loads(record_file.read_text())
    ranks = {int(rank): {"after_fault_s": info["after_fault"], "returncode": info["returncode"],
                         "hung": bool(info["killed"])} for rank, info in record["ranks"].items()}
    return {"fault_injected": record["fault_time"] is not None, "ranks": ranks}


def run_faults(scenarios: list[str]) -> dict[str, dict]:
    """One ``faults.py`` job over ``scenarios``; each scenario's record."""
    with tempfile.TemporaryDirectory(prefix="fault-exit-") as out:
        subprocess.run([sys.executable, str(JOBS / "faults.py"), out, *scenarios], env=_env(), timeout=600,
                       check=True, capture_output=True)
        return {f"faults.py {s}": _ranks(Path(out) / f"{s}.json") for s in scenarios}


def run_failfast(launcher: str) -> dict:
    """``failfast.py``'s ``kill`` scenario under ``launcher``; its record."""
    with tempfile.TemporaryDirectory(prefix="fault-exit-") as out:
        subprocess.run([sys.executable, str(JOBS / "failfast.py"), "launch", launcher, out, "kill"], env=_env(),
                       timeout=600, check=True, capture_output=True)
        return _ranks(Path(out) / f"kill-{launcher}.json")


def run_ring(size: int = 5, dead: int = 2) -> dict:
    """``size`` watchdogs in this process (``tests/failstop/test_watchdog.py``'s ring); ``dead`` closes its sockets."""
    import torch.distributed as dist

    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's package, and the test's ring
    from test_watchdog import ring, stop_all, wait_until

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    ranks = ring(server, size)
    start = time.monotonic()
    ranks[dead].die()
    wait_until(lambda: all(r.ended.is_set() for r in ranks if r is not ranks[dead]), "the others did not end")
    record = {"fault_injected": True, "ranks": {
        r.rank: {"after_fault_s": r.ended_at - start, "returncode": None, "hung": False}
        for r in ranks if r is not ranks[dead]}}
    stop_all([r for r in ranks if not r.ended.is_set()])
    return record


def summarize(runs: list[dict[str, dict]]) -> str:
    """Markdown: per case, the last rank's exit after the fault (median, min-max over runs) and hung ranks."""
    lines = ["| case | last exit after the fault, s (median) | min-max | ranks hung | runs |", "|---|---|---|---|---|"]
    for case in runs[0]:
        lasts = [max(i["after_fault_s"] for i in run[case]["ranks"].values()) for run in runs]
        hung = sum(i["hung"] for run in runs for i in run[case]["ranks"].values())
        lines.append(f"| {case} | {statistics.median(lasts):.2f} | {min(lasts):.2f}-{max(lasts):.2f} | {hung} |"
                     f" {len(runs)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the result file (JSON)")
    parser.add_argument("--runs", type=int, default=1, help="how often every case runs")
    parser.add_argument("--scenarios", default=",".join(FAULT_SCENARIOS), help="faults.py scenarios")
    parser.add_argument("--launchers", default=",".join(LAUNCHERS), help="failfast.py kill under these launchers")
    args = parser.parse_args(argv)
    result = {
        "command": " ".join(["python benchmarks/fault_exit.py", *(argv if argv is not None else sys.argv[1:])]),
        "commit": _git("rev-parse", "HEAD"),
        "uncommitted_changes": _git("status", "--porcelain", "--", "lightning_varuna", "tests/jobs"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "loadavg_start": list(os.getloadavg()),
        "runs": [],
    }
    started = time.monotonic()
    for run in range(args.runs):
        cases: dict[str, dict] = {"watchdog ring, 5 ranks in one process": run_ring()}
        cases.update(run_faults(args.scenarios.split(",")))
        for launcher in filter(None, args.launchers.split(",")):
            cases[f"failfast.py kill ({launcher})"] = run_failfast(launcher)
        result["runs"].append(cases)
        print(f"run {run + 1}/{args.runs} done (load {os.getloadavg()[0]:.1f})", flush=True)
    result["loadavg_end"] = list(os.getloadavg())
    result["wall_s"] = time.monotonic() - started
    result["table_md"] = summarize(result["runs"])
    print(result["table_md"])
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
