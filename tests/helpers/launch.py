"""Launching real multi-process jobs from tests: always a subprocess, always a timeout, always NCCL's rules.

Every job runs in the NCCL-rules mode: its engines record each step's p2p ops in a fresh trace directory
(``LIGHTNING_VARUNA_P2P_TRACE``) and after the job every step that all ranks completed is replayed under NCCL's
matching rules (:mod:`lightning_varuna.pipeline.scheduling.nccl_replay`); a deadlock or a mismatch fails the test, on
CPU, as the same order would hang on GPUs. The number of steps checked is in the returned result's ``p2p_steps``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from lightning_varuna.pipeline.comm.events import P2P_TRACE_ENV
from lightning_varuna.pipeline.scheduling.nccl_replay import CheckSummary, P2POrderError, check_trace_dir

ROOT = Path(__file__).resolve().parents[2]
JOBS = ROOT / "tests" / "jobs"


_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                     "NODE_RANK", "TORCHELASTIC_RUN_ID")


def _env() -> dict[str, str]:
    # an in-process fit in this worker leaves Lightning's MASTER_PORT (and rank variables) in os.environ, with
    # its store possibly still listening there: a job started from here must choose its own
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
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


def python(script: str, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    """Runs ``tests/jobs/<script>`` as a plain process (Lightning may launch more ranks itself).

    With ``check=False`` a failed job is returned, not raised.
    """
    return _run([sys.executable, str(JOBS / script), *args], timeout, check=check)


@contextlib.contextmanager
def nccl_rules(env: dict[str, str]) -> Iterator[dict[str, CheckSummary]]:
    """Turns the NCCL-rules mode on in ``env`` for the block; afterwards replays the traces (``box["summary"]``).

    Raises:
        AssertionError: If a completed step deadlocks or mismatches under NCCL's rules.
    """
    directory = tempfile.mkdtemp(prefix="varuna-p2p-")
    env[P2P_TRACE_ENV] = directory
    box: dict[str, CheckSummary] = {}
    try:
        yield box
        try:
            box["summary"] = check_trace_dir(directory)
        except P2POrderError as err:
            raise AssertionError(f"p2p order violates NCCL's rules: {err}") from None
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def run_checked(command: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run`` in the NCCL-rules mode; ``result.p2p_steps`` is the number of steps replayed."""
    env = dict(env if env is not None else _env())
    result = None
    try:
        with nccl_rules(env) as box:
            result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except AssertionError as err:
        output = f"\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}" if result is not None else ""
        raise AssertionError(f"{' '.join(command)}: {err}{output}") from None
    result.p2p_steps = box["summary"].steps  # type: ignore[attr-defined]
    return result


def _run(
    command: list[str], timeout: float, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    result = run_checked(command, timeout, {**_env(), **(env or {})})
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
    env = _env()
    with nccl_rules(env):
        _run_agents(script, args, nodes, nproc, port, env, timeout)


def _run_agents(script: str, args: tuple[str, ...], nodes: int, nproc: int, port: int, env: dict[str, str],
                timeout: float) -> None:
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node-rank={i}",
             f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={port}", str(JOBS / script),
             *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, start_new_session=True,
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
