"""Jobs that fail on purpose under each launcher, and one that must not fail: end-to-end checks of the watchdog.

    python tests/jobs/failfast.py launch MODE OUT SCENARIO   # starts the job, records how each rank ended
    python tests/jobs/failfast.py train OUT SCENARIO         # one rank: what the launcher runs

MODE is how the 4 processes (TinyGPT, P=2 x D=2) start:

- ``lightning``: Lightning's own launcher (``Trainer(devices=4)`` runs this script again for ranks 1-3);
- ``torchrun``: ``torchrun --standalone --nproc-per-node=4`` (no restart);
- ``independent``: 4 plain ``python`` processes with ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK`` and ``NODE_RANK`` set, as SLURM starts them (Lightning sees them as created externally).

SCENARIO is what happens, at a controlled point (the job does it to itself):

- ``kill``: rank 3 SIGKILLs itself inside the schedule of step 7;
- ``sigint``: rank 0 sends itself SIGINT (Ctrl-C) inside step 7;
- ``sigterm``: rank 2 sends itself SIGTERM in step 3 (a preemption warning): every rank checkpoints and must exit
  with 143; rank 1 then lingers 3 s in an ``atexit`` handler, so torchrun sends it SIGTERM while it exits;
- ``healthy``: no seed anywhere; tied input/output embeddings (a parameter on both stages); the training data
  is a plain iterable (not a ``DataLoader``) split by replica; rank 1 holds the GIL for 8 s in step 2. Every
  rank saves its weights before ``fit``, after setup and at the end, and every rank must exit 0.

``OUT/<scenario>-<mode>.rank<r>.log`` holds each rank's output, ``OUT/<scenario>-<mode>.json`` per rank the exit
status, the time it ended (``time.time()``, seen by polling ``/proc``), the seconds from the fault to that end,
and whether it had to be killed at the deadline. Exit statuses come from ``waitpid`` (the launching process is
a child subreaper, so ranks orphaned by the death of Lightning's rank 0 are reaped here), from rank 0's own
waits on the children it started (Lightning's launcher), or from torchrun's failure summary.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

STEPS = 9
FAULTS = {"kill": (3, 7), "sigint": (0, 7), "sigterm": (2, 3)}
"""scenario -> (rank, global step during which it happens)"""
GIL_HOLD = (1, 2, 8.0)
"""healthy: (rank, global step, seconds) of the stretch that holds the GIL."""
LINGER_S = 3.0
DEADLINE_S = 400.0
FAULT_MARK = "FAILFAST-FAULT-AT"
ROOT = Path(__file__).resolve().parents[2]


# -- one rank -------------------------------------------------------------------------------------------------
def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def train(out: Path, scenario: str) -> None:
    """One rank of the job (started by the launcher of the mode)."""
    name, rank = os.environ["FAILFAST_NAME"], _rank()
    log = os.open(out / f"{name}.rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    (out / f"{name}.rank{rank}.pid").write_text(str(os.getpid()))
    if scenario == "sigint":  # what Ctrl-C finds: Python's handler, and SIGINT not blocked
        print(f"SIGINT handler {signal.getsignal(signal.SIGINT)!r}, blocked "
              f"{signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])}", flush=True)
    import warnings

    warnings.simplefilter("default")
    sys.path.insert(0, str(ROOT / "tests"))
    import lightning.pytorch as pl
    import torch
    from helpers.models import RandomTokens, TinyGPT
    from lightning.pytorch.callbacks import ModelCheckpoint

    import lightning_varuna

    torch.set_num_threads(1)
    healthy = scenario == "healthy"

    class Job(TinyGPT):
        def training_step(self, batch, batch_idx: int):
            executor = self.trainer.strategy.engine.executor  # None during the dry run
            in_schedule = executor is not None and executor.current is not None
            if in_schedule and not getattr(self, "done", False):
                _act(self.trainer, scenario, rank)
            return super().training_step(batch, batch_idx)

    class Stream:
        """What users of streaming datasets pass: an iterable (not a DataLoader), split by replica."""

        def __iter__(self):
            split = trainer.strategy.distributed_sampler_kwargs
            data = RandomTokens(n=64, seed=1)
            size = 4
            for begin in range(split["rank"] * size, len(data) - size + 1, split["num_replicas"] * size):
                samples = [data[i] for i in range(begin, begin + size)]
                yield torch.stack([x for x, _ in samples]), torch.stack([y for _, y in samples])

    class ChildExits(pl.Callback):
        """Rank 0 under Lightning's launcher: records how each child it started ended (it is their parent)."""

        def setup(self, trainer, pl_module, stage: str) -> None:
            for local_rank, proc in enumerate(trainer.strategy.launcher.procs, start=1):
                threading.Thread(target=_record_exit, args=(out, name, local_rank, proc), daemon=True).start()

    class Weights(pl.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            _save_weights(out / f"{name}.rank{rank}.start.pt", pl_module)

        def on_train_end(self, trainer, pl_module) -> None:
            _save_weights(out / f"{name}.rank{rank}.end.pt", pl_module)

    model = Job(n_layer=2, tie_weights=healthy)
    if healthy:
        _save_weights(out / f"{name}.rank{rank}.init.pt", model)
    callbacks: list = [Weights()] if healthy else []
    if scenario == "sigterm":
        callbacks.append(ModelCheckpoint(dirpath=out / f"{name}-ckpt", save_top_k=0))
        if rank == 1:
            atexit.register(_linger)
    if os.environ.get("FAILFAST_MODE") == "lightning" and rank == 0:
        callbacks.append(ChildExits())
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, max_steps=STEPS, logger=False, callbacks=callbacks,
        enable_checkpointing=scenario == "sigterm", enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
        # a long rendezvous timeout: on a loaded machine the 4 processes may take minutes to import and start
        strategy=lightning_varuna.VarunaStrategy(pipeline_parallel_size=2, num_microbatches=2, p2p_timeout=60,
                                                 timeout=timedelta(seconds=600)),
    )
    if healthy:
        loader = Stream()
    else:
        from torch.utils.data import DataLoader

        loader = DataLoader(RandomTokens(n=64, seed=1), batch_size=4)
    trainer.fit(model, loader)
    print("FAILFAST-FINISHED", flush=True)


def _act(trainer, scenario: str, rank: int) -> None:
    """Does what the scenario does, once, at its rank and step."""
    module = trainer.lightning_module
    if scenario == "healthy":
        hold_rank, step, seconds = GIL_HOLD
        if rank == hold_rank and trainer.global_step == step:
            module.done = True
            print(f"holding the GIL for {seconds:g}s", flush=True)
            ctypes.PyDLL(None).sleep(int(seconds))  # a C call made without releasing the GIL
        return
    fault_rank, step = FAULTS[scenario]
    if rank != fault_rank or trainer.global_step != step:
        return
    module.done = True
    print(f"{FAULT_MARK} {time.time():.3f}", flush=True)
    sig = {"kill": signal.SIGKILL, "sigint": signal.SIGINT, "sigterm": signal.SIGTERM}[scenario]
    os.kill(os.getpid(), sig)


def _linger() -> None:
    print(f"lingering {LINGER_S:g}s at exit", flush=True)
    time.sleep(LINGER_S)


def _save_weights(path: Path, module) -> None:
    import torch

    from lightning_varuna.pipeline.comm.initial_sync import _is_placeholder

    state = {f"param:{n}": p.detach().clone() for n, p in module.named_parameters()}
    state |= {f"buffer:{n}": b.clone() for n, b in module.named_buffers() if not _is_placeholder(b)}
    torch.save(state, path)


def _record_exit(out: Path, name: str, rank: int, proc: subprocess.Popen) -> None:
    # WNOWAIT: the child stays to be reaped; if this process dies before writing the record, the child goes to the
    # harness (a subreaper), which reaps it and reads its status itself
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
    except ChildProcessError:  # Lightning's own observer reaped it first
        code = proc.returncode
    (out / f"{name}.exit.rank{rank}").write_text(json.dumps({"returncode": code, "end": time.time()}))


# -- the harness ----------------------------------------------------------------------------------------------
def launch(mode: str, out: Path, scenario: str) -> None:
    """Runs the job under ``mode`` and writes ``OUT/<scenario>-<mode>.json``."""
    name = f"{scenario}-{mode}"
    _become_subreaper()
    # the ranks get Ctrl-C as a terminal's user would: a shell starts background jobs with SIGINT ignored, and an
    # ignored signal stays ignored across exec (a handler is reset to the default there)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, str(ROOT / "tests" / "jobs"))
    from forked import free_port

    env = dict(os.environ, FAILFAST_NAME=name, FAILFAST_MODE=mode, PYTHONPATH=str(ROOT))
    command = [sys.executable, __file__, "train", str(out), scenario]
    agent_log = (out / f"{name}.launcher.log").open("w")
    procs: dict[int | str, subprocess.Popen] = {}
    if mode == "independent":
        port = str(free_port())
        for rank in range(4):
            procs[rank] = subprocess.Popen(command, env=env | {
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "4", "NODE_RANK": "0",
                "RANK": str(rank), "LOCAL_RANK": str(rank)}, stdout=agent_log, stderr=agent_log)
    elif mode == "lightning":
        procs[0] = subprocess.Popen(command, env=env, stdout=agent_log, stderr=agent_log)
    else:
        procs["torchrun"] = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "--max-restarts=0",
             *command[1:]], env=env, stdout=agent_log, stderr=agent_log, start_new_session=True)
    ranks = _watch(out, name, procs)
    agent_log.close()
    _exit_codes(out, name, mode, ranks)
    fault_time = _marked_time(out, name)
    for info in ranks.values():
        info["after_fault"] = None if fault_time is None or info["end"] is None else info["end"] - fault_time
    survivors = [info["after_fault"] for r, info in ranks.items() if FAULTS.get(scenario, (None,))[0] != r]
    last = max(survivors) if survivors and None not in survivors else None
    result = {"mode": mode, "scenario": scenario, "fault_time": fault_time, "last_exit_after_fault": last,
              "ranks": ranks}
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))


def _become_subreaper() -> None:
    """Orphaned ranks (their parent, Lightning's rank 0, died first) become this process's children."""
    PR_SET_CHILD_SUBREAPER = 36  # noqa: N806 - the kernel's name
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _watch(out: Path, name: str, procs: dict) -> dict[int, dict]:
    """Polls until every rank and every started process has ended (or the deadline); reaps what it can."""
    start = time.time()
    ranks: dict[int, dict] = {r: {"pid": None, "end": None, "returncode": None, "killed": False} for r in range(4)}
    by_pid = {p.pid: key for key, p in procs.items()}
    exited: dict[int | str, int] = {}

    def reap() -> bool:
        """Collects the exit status of every child (or adopted orphan) that has ended; False once none is left."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return False
            if not pid:
                return True
            key = by_pid.get(pid)
            if key is not None:
                exited[key] = os.waitstatus_to_exitcode(status)
                if key in procs:
                    procs[key].returncode = exited[key]

    while True:
        now = time.time()
        for rank, info in ranks.items():
            pid_file = out / f"{name}.rank{rank}.pid"
            if info["pid"] is None and pid_file.exists() and pid_file.read_text():
                info["pid"] = int(pid_file.read_text())
                by_pid.setdefault(info["pid"], rank)
            if info["pid"] is not None and info["end"] is None and not _alive(info["pid"]):
                info["end"] = now
        reap()
        started_done = all(key in exited for key in procs)
        if started_done and all(info["end"] is not None or info["pid"] is None for info in ranks.values()):
            break
        if now - start > DEADLINE_S:
            for info in ranks.values():
                if info["pid"] is not None and info["end"] is None:
                    info["killed"] = True
                    _kill(info["pid"])
            for key, proc in procs.items():
                if key not in exited:
                    _kill(proc.pid, group=key == "torchrun")
            time.sleep(1.0)
            continue
        time.sleep(0.02)
    # a process is seen as ended once its main thread has; its status comes when its last thread has ended too
    drain_until = time.time() + 20.0
    while reap() and time.time() < drain_until:
        time.sleep(0.05)
    for rank, info in ranks.items():
        if rank in exited:
            info["returncode"] = exited[rank]
    return ranks


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _kill(pid: int, group: bool = False) -> None:
    try:
        os.killpg(pid, signal.SIGKILL) if group else os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def _exit_codes(out: Path, name: str, mode: str, ranks: dict[int, dict]) -> None:
    """Fills in the exit statuses this process could not reap itself."""
    if mode == "lightning":
        for rank, info in ranks.items():
            recorded = out / f"{name}.exit.rank{rank}"
            if info["returncode"] is None and recorded.exists():
                info["returncode"] = json.loads(recorded.read_text())["returncode"]
    if mode == "torchrun":
        text = (out / f"{name}.launcher.log").read_text(errors="replace")
        for rank, code in re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", text):
            ranks[int(rank)]["returncode"] = int(code)
        for info in ranks.values():  # torchrun lists failures only
            if info["returncode"] is None and info["end"] is not None and "FAILED" not in text:
                info["returncode"] = 0


def _marked_time(out: Path, name: str) -> float | None:
    for rank in range(4):
        log = out / f"{name}.rank{rank}.log"
        if log.exists():
            for line in log.read_text(errors="replace").splitlines():
                if line.startswith(FAULT_MARK):
                    return float(line.split()[1])
    return None


if __name__ == "__main__":
    if sys.argv[1] == "launch":
        launch(sys.argv[2], Path(sys.argv[3]), sys.argv[4])
    else:
        train(Path(sys.argv[2]), sys.argv[3])
