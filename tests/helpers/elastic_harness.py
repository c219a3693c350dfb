"""Two torchrun agents on loopback, one of them lost mid-training: the harness of test_elastic and benchmarks/elastic.

Each agent stands for a machine: ``torchrun --nnodes=1:2 --nproc-per-node=2 --rdzv-backend=c10d`` running
``examples/gpt/elastic.py`` (a tiny GPT, a checkpoint every step, ``ckpt_path="last"``). The first agent hosts
the rendezvous. Once the 4-process job (P=2 x D=2) has done ``kill_after`` steps, the second agent and its
workers are SIGKILLed at once, as when a machine disappears (torchrun starts every worker in a session of its
own, so killing the agent's process group alone would leave its workers running). The survivor's workers lose
their peers and fail, and its agent restarts them with the smaller world size; they resume from the last
checkpoint and finish.

The agents run with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: in torch 2.13 the workers otherwise share the
rendezvous store across restarts, and the restarted (smaller) group reads the dead group's stale addresses and
cannot connect (pytorch/pytorch#135712).

Everything runs under deadlines, and every process started here (agents and, through them, workers: their ids
are collected while they run) is SIGKILLed when a run ends, however it ends.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "gpt" / "elastic.py"
# "params": the same split on every start (a timed split varies with the machine's load), so that runs compare.
TINY = ["--n-layer", "2", "--n-embd", "32", "--block-size", "32", "--global-batch-size", "8", "--num-microbatches", "2",
        "--max-chars", "100000", "--every-n-steps", "1", "--pipeline-parallel-size", "2", "--partition", "params"]
TUNED = {"keep_alive_interval": 1, "keep_alive_max_attempt": 2, "last_call_timeout": 3}
"""Rendezvous settings that shorten recovery (torchrun's defaults: 5 s x 3 keep-alive, 30 s last call)."""


@dataclass
class ElasticRun:
    """What one run recorded. Times are ``time.time()`` of this machine (all processes share the clock)."""

    records: list[dict]
    kill_time: float | None
    returncodes: dict[str, int | None]
    logs: dict[str, str] = field(default_factory=dict)

    @property
    def before(self) -> list[dict]:
        """Step records of the first, full-size incarnation."""
        return [r for r in self.records if r["event"] == "step" and r["time"] < (self.kill_time or float("inf"))]

    @property
    def resume(self) -> dict | None:
        """The ``start`` record of the first incarnation after the kill."""
        after = [r for r in self.records if r["event"] == "start" and r["time"] > (self.kill_time or float("inf"))]
        return after[0] if after else None

    @property
    def after(self) -> list[dict]:
        """Step records after the kill."""
        return [r for r in self.records if r["event"] == "step" and r["time"] > (self.kill_time or float("inf"))]

    def summary(self) -> dict:
        """Kill-to-first-resumed-step time and steps lost (None where the run did not get that far)."""
        resume, after, before = self.resume, self.after, self.before
        if self.kill_time is None or resume is None or not after or not before:
            return {"kill_to_first_step_s": None, "steps_lost": None}
        return {
            "kill_to_first_step_s": round(after[0]["time"] - self.kill_time, 2),
            "kill_to_relaunch_s": round(resume["launched"] - self.kill_time, 2),
            "relaunch_to_start_s": round(resume["time"] - resume["launched"], 2),
            "steps_lost": before[-1]["step"] - resume["step"],
            "last_step_before_kill": before[-1]["step"],
            "resumed_from": resume["step"],
            "resumed_world_size": resume["world_size"],
        }


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []
    found = []
    for task in tasks:
        try:
            found += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except FileNotFoundError:
            pass
    return found


def _descendants(pid: int) -> list[int]:
    found, todo = [], _children(pid)
    while todo:
        child = todo.pop()
        found.append(child)
        todo += _children(child)
    return found


def _workers(agent: int) -> list[int]:
    """The agent's worker processes (its children running the training script)."""
    found = []
    for pid in _children(agent):
        try:
            if SCRIPT.name in Path(f"/proc/{pid}/cmdline").read_text():
                found.append(pid)
        except FileNotFoundError:
            pass
    if not found:
        raise RuntimeError(f"agent {agent} has no worker running {SCRIPT.name}")
    return found


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (tells a process from a later one with the same id)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (FileNotFoundError, IndexError):
        return None


class _Processes:
    """Every process seen under the agents, so that none outlives a run."""

    def __init__(self) -> None:
        self.seen: dict[int, str] = {}

    def watch(self, pid: int) -> list[int]:
        tree = [pid, *_descendants(pid)]
        for p in tree:
            start = _start_time(p)
            if start is not None:
                self.seen.setdefault(p, start)
        return tree

    def kill(self, pids: list[int]) -> None:
        for pid in pids:
            if pid in self.seen and _start_time(pid) == self.seen[pid]:
                for kill in (os.killpg, os.kill):  # its session (torchrun's workers lead their own), then itself
                    try:
                        kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass

    def kill_all(self, agents: list[int]) -> None:
        for pid in agents:  # frozen first, so that no new worker appears while the trees are read
            if pid in self.seen and _start_time(pid) == self.seen[pid]:
                os.kill(pid, signal.SIGSTOP)
        for pid in agents:
            self.watch(pid)
        self.kill(list(self.seen))


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def run_elastic(
    workdir: Path,
    *,
    max_steps: int = 12,
    kill_after: int = 4,
    rdzv_conf: dict[str, int] | None = None,
    deadline: float = 180.0,
    extra_args: list[str] | None = None,
    action: str = "kill",
    environment: dict[str, str] | None = None,
) -> ElasticRun:
    """Runs the two-agent job, kills the second agent's "machine" after ``kill_after`` steps, waits for the end.

    Args:
        workdir: Empty directory for checkpoints, the step record and the agents' output.
        max_steps: Steps of the whole training run.
        kill_after: Kill once the 4-process job has recorded this many steps (0: never kill).
        rdzv_conf: Rendezvous settings besides ``is_host`` (see :data:`TUNED`); None: torchrun's defaults.
        deadline: Seconds after which everything still running is killed.
        extra_args: More arguments for ``examples/gpt/elastic.py``.
        action: ``"kill"``: SIGKILL the second agent and its workers (a machine lost). ``"sigterm"``: SIGTERM one
            worker of the second agent (a preemption warning that reaches one rank); both agents stay.
        environment: More environment variables for the agents (e.g. the NCCL-rules mode's trace directory).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    record = workdir / "steps.jsonl"
    port = free_port()
    conf = ",".join(f"{k}={v}" for k, v in (rdzv_conf or {}).items())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               **(environment or {}))
    script = [str(SCRIPT), "--ckpt-dir", str(workdir / "ckpt"), "--record", str(record), "--max-steps",
              str(max_steps), "--p2p-timeout", "30", *TINY, *(extra_args or [])]
    processes = _Processes()
    agents: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}
    kill_time = None
    start = time.monotonic()
    try:
        for name, host in (("host", "true"), ("other", "false")):
            command = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=2",
                "--max-restarts=3", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic",
                f"--rdzv-conf=is_host={host}" + (f",{conf}" if conf else ""), *script,
            ]
            logs[name] = workdir / f"agent-{name}.log"
            with logs[name].open("w") as out:
                agents[name] = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                                start_new_session=True)
            processes.watch(agents[name].pid)
        while time.monotonic() - start < deadline:
            for agent in agents.values():
                processes.watch(agent.pid)
            if kill_after and kill_time is None:
                steps = [r for r in _records(record) if r["event"] == "step" and r["world_size"] == 4]
                if len(steps) >= kill_after:
                    victims = processes.watch(agents["other"].pid)
                    kill_time = time.time()
                    if action == "sigterm":
                        os.kill(_workers(agents["other"].pid)[0], signal.SIGTERM)
                    else:
                        processes.kill(victims)
            # after a kill the second agent is gone; otherwise (no kill, or a SIGTERM) both agents must finish
            machine_lost = action == "kill" and kill_time is not None
            if agents["host"].poll() is not None and (machine_lost or agents["other"].poll() is not None):
                break
            time.sleep(0.05)
    finally:
        processes.kill_all([agent.pid for agent in agents.values()])
        for agent in agents.values():
            agent.wait(timeout=30)
    return ElasticRun(
        records=_records(record),
        kill_time=kill_time,
        returncodes={name: agent.returncode for name, agent in agents.items()},
        logs={name: path.read_text(errors="replace") for name, path in logs.items()},
    )
