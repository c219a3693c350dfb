"""Launching real multi-process jobs from tests: always a subprocess, always a timeout."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOBS = ROOT / "tests" / "jobs"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore"
    return env


def torchrun(
    script: str, *args: str, nproc: int = 4, timeout: float = 300, env: dict[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Runs ``tests/jobs/<script>`` under torchrun with ``nproc`` gloo processes; fails the test on error.

    ``env`` adds to the environment; with ``check=False`` a failed job is returned, not raised.
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(JOBS / script), *args]
    return _run(command, timeout, env, check)


def python(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs ``tests/jobs/<script>`` as a plain process (Lightning may launch more ranks itself)."""
    return _run([sys.executable, str(JOBS / script), *args], timeout)


def _run(
    command: list[str], timeout: float, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env={**_env(), **(env or {})},
                            cwd=ROOT)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} exited with {result.returncode}:\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
        )
    return result


def torchrun_nodes(script: str, *args: str, nodes: int = 2, nproc: int = 2, timeout: float = 300) -> None:
    """Runs ``tests/jobs/<script>`` as ``nodes`` torchrun agents on this host, as a multi-node job would run.

    Each agent gets ``--nnodes``, its ``--node-rank`` and the same rendezvous address (loopback); global ranks are
    ``node_rank * nproc + local_rank``. Fails the test if any agent fails or the job outlives ``timeout``.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node-rank={i}",
             f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={port}", str(JOBS / script),
             *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT, start_new_session=True,
        )
        for i in range(nodes)
    ]
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        for agent in agents:
            if agent.poll() is None:  # the agent and its workers
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    for i, (agent, (out, err)) in enumerate(zip(agents, outputs)):
        if agent.returncode != 0:
            raise AssertionError(f"node {i} of {script} exited with {agent.returncode}:\n{out[-3000:]}\n{err[-6000:]}")
