"""Launching real multi-process jobs from tests: always a subprocess, always a timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOBS = ROOT / "tests" / "jobs"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore"
    return env


def torchrun(script: str, *args: str, nproc: int = 4, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs ``tests/jobs/<script>`` under torchrun with ``nproc`` gloo processes; fails the test on error."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(JOBS / script), *args]
    return _run(command, timeout)


def python(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs ``tests/jobs/<script>`` as a plain process (Lightning may launch more ranks itself)."""
    return _run([sys.executable, str(JOBS / script), *args], timeout)


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)
    if result.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} exited with {result.returncode}:\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
        )
    return result
