"""Fault injection: runs TinyGPT under VarunaStrategy with one rank failing, hanging or dying mid-step.

    python tests/jobs/faults.py OUT SCENARIO [SCENARIO ...]
    python tests/jobs/faults.py indivisible        # Trainer(devices=3) with P=2, Lightning's own launcher

For each scenario the parent (which imports torch and Lightning once) forks one child per rank, as an
external launcher would start them, with each rank's output in ``OUT/<scenario>.rank<r>.log``. Unlike
torchrun, the parent does not end the job when a rank fails, so what is measured is how fast the ranks end on
their own, the one injected to hang included. At the scenario's deadline any rank still running is killed,
and counts as hung. ``OUT/<scenario>.json`` holds, per rank, the exit code, the seconds from the fault to the
exit, and whether the parent killed it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from forked import marked_time, run_ranks  # noqa: E402
from helpers.models import RandomTokens, TinyGPT  # noqa: E402

import lightning_varuna  # noqa: E402

# name -> (processes, strategy options, fault, faulty rank, step of the fault, deadline in seconds)
SCENARIOS = {
    # a Python error in user code on a middle stage: in training_step, and in a hook outside the pipeline
    "error": (4, {"pipeline_parallel_size": 4, "p2p_timeout": 60}, "error", 2, 3, 40),
    "hook-error": (4, {"pipeline_parallel_size": 4, "p2p_timeout": 60}, "hook-error", 2, 3, 40),
    # a peer that stops answering inside training_step: neighbours give up after p2p_timeout
    "hang": (4, {"pipeline_parallel_size": 4, "p2p_timeout": 5}, "hang", 2, 2, 40),
    # the same with two replicas: the other replica's copy of the hung stage waits in a collective over replicas
    "hang-dp": (4, {"pipeline_parallel_size": 2, "p2p_timeout": 5}, "hang", 1, 2, 40),
    # stage 0 hangs in its last recompute, after its last message of the step: the other stages finish the
    # step and wait for it in the log broadcast over the pipeline group (with P = world size, that group was
    # the default one, whose timeout is VarunaStrategy's `timeout`, 30 minutes by default)
    "hang-sync": (4, {"pipeline_parallel_size": 4, "p2p_timeout": 5}, "hang-last", 0, 2, 30),
    # peers that die without a word: rank 0 also hosts the job's store (SIGKILL), rank 1 calls os._exit(1)
    "kill": (4, {"pipeline_parallel_size": 4, "p2p_timeout": 60}, "kill", 0, 2, 40),
    "exit": (4, {"pipeline_parallel_size": 4, "p2p_timeout": 60}, "exit", 1, 2, 40),
    # errors after the last step on the last stage (in on_train_end; in the module's teardown hook, which runs
    # after the strategy's): every rank's fit raises, though rank 0 had finished
    "train-end-error": (2, {"pipeline_parallel_size": 2, "p2p_timeout": 60}, "train-end-error", 1, 2, 40),
    "teardown-error": (2, {"pipeline_parallel_size": 2, "p2p_timeout": 60}, "teardown-error", 1, 2, 40),
    # zero_stage=1: rank 3 SIGKILLs itself right after starting its reduce-scatter of gradients (during its last
    # backward), or its all-gather of the updated parameters (after the optimizer step); its replica peer waits in it
    "kill-scatter": (4, {"pipeline_parallel_size": 2, "p2p_timeout": 60, "zero_stage": 1}, "kill-scatter", 3, 2, 40),
    "kill-gather": (4, {"pipeline_parallel_size": 2, "p2p_timeout": 60, "zero_stage": 1}, "kill-gather", 3, 2, 40),
    # training_step returns None before the forward for micro-batch 0 only (on every rank): refused at once
    "mixed-skip": (2, {"pipeline_parallel_size": 2, "p2p_timeout": 60}, "mixed-skip", 0, 2, 40),
}
FAULT_MARK = "VARUNA-FAULT-AT"
HANG_SECONDS = 120


class Faulty(TinyGPT):
    """TinyGPT that misbehaves on one rank at one step (in the first micro-batch of that step)."""

    def __init__(self, fault: str, rank: int, step: int) -> None:
        super().__init__(n_layer=4, sync_dist=fault == "hang-last")
        self.fault, self.fault_rank, self.fault_step = fault, rank, step

    def _at_fault(self, batch_idx: int) -> bool:
        here = self.trainer.global_rank == self.fault_rank and batch_idx == self.fault_step
        if here:
            print(f"{FAULT_MARK} {time.time():.3f}", flush=True)
        return here

    def training_step(self, batch, batch_idx: int):
        if self.fault == "mixed-skip" and batch_idx == self.fault_step:  # decided alike on every rank
            self._at_fault(batch_idx)
            if self.trainer.strategy.engine.microbatch == 0:
                return None
        if self.fault == "hang-last":  # the recompute of the last micro-batch, stage 0's last call of a step
            executor = self.trainer.strategy.engine.executor  # None during the dry run
            current = executor.current if executor is not None else None
            last = current is not None and current.recomputing and current.microbatch == 1
            if last and self._at_fault(batch_idx):
                time.sleep(HANG_SECONDS)
        elif self.fault in ("error", "hang", "kill", "exit") and self._at_fault(batch_idx):
            if self.fault == "error":
                raise RuntimeError(f"injected failure on rank {self.fault_rank} at step {batch_idx}")
            if self.fault == "hang":
                time.sleep(HANG_SECONDS)
            if self.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.fault == "exit":
                os._exit(1)
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if self.fault == "hook-error" and self._at_fault(batch_idx):
            raise RuntimeError(f"injected failure on rank {self.fault_rank} after step {batch_idx}")

    def on_train_end(self) -> None:
        if self.fault == "train-end-error" and self._at_fault(self.fault_step):
            raise RuntimeError(f"injected failure on rank {self.fault_rank} in on_train_end")

    def teardown(self, stage: str) -> None:
        if self.fault == "teardown-error" and self._at_fault(self.fault_step):
            raise RuntimeError(f"injected failure on rank {self.fault_rank} in teardown")


def _trainer(devices: int, strategy: lightning_varuna.VarunaStrategy, steps: int) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def _kill_inside(model: Faulty, name: str) -> None:
    """Makes this rank SIGKILL itself once it has started the sharded sync's collective ``name`` at the fault step."""
    from lightning_varuna.pipeline.comm import sharded_sync

    collective = getattr(sharded_sync, name)

    def started_then_killed(*args, **kwargs):
        work = collective(*args, **kwargs)
        if model._at_fault(model.trainer.global_step):
            os.kill(os.getpid(), signal.SIGKILL)
        return work

    setattr(sharded_sync, name, started_then_killed)


def _rank_main(scenario: str, world: int, rank: int) -> None:
    _, options, fault, fault_rank, step, _ = SCENARIOS[scenario]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Faulty(fault, fault_rank, step)
    if fault in ("kill-scatter", "kill-gather") and rank == fault_rank:
        # on gloo: the all-to-all of the reduce-scatter, the point-to-point all-gather
        _kill_inside(model, "_reduce_scatter" if fault == "kill-scatter" else "_send_rows")
    loader = DataLoader(RandomTokens(n=64, seed=1), batch_size=4)
    strategy = lightning_varuna.VarunaStrategy(num_microbatches=2, **options)
    _trainer(world, strategy, steps=step + 3).fit(model, loader)
    print("VARUNA-FINISHED", flush=True)


def run_scenario(out: Path, scenario: str) -> None:
    world, _, _, fault_rank, _, deadline = SCENARIOS[scenario]
    start = time.time()
    ends = run_ranks(out, scenario, world, lambda rank: _rank_main(scenario, world, rank), deadline)
    fault_time = marked_time(out, scenario, [fault_rank], FAULT_MARK)
    result = {"fault_rank": fault_rank, "fault_time": fault_time, "start": start, "ranks": {}}
    for rank, info in sorted(ends.items()):
        info["after_fault"] = None if fault_time is None else info["end"] - fault_time
        result["ranks"][rank] = info
    (out / f"{scenario}.json").write_text(json.dumps(result, indent=1))


def indivisible() -> None:
    """Three processes, P=2: Lightning's launcher starts ranks 1 and 2 by running this script again."""
    torch.set_num_threads(1)
    model = TinyGPT()
    strategy = lightning_varuna.VarunaStrategy(pipeline_parallel_size=2)
    _trainer(3, strategy, steps=1).fit(model, DataLoader(RandomTokens(n=16), batch_size=4))


def train_end_error_under_lightnings_launcher() -> None:
    """Two processes, P=2, started by Lightning's launcher; rank 1 fails in on_train_end, after the last step."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Faulty("train-end-error", 1, 1)
    strategy = lightning_varuna.VarunaStrategy(pipeline_parallel_size=2, num_microbatches=2, p2p_timeout=60)
    _trainer(2, strategy, steps=2).fit(model, DataLoader(RandomTokens(n=16), batch_size=4))
    print("VARUNA-FINISHED", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "indivisible":
        indivisible()
    elif sys.argv[1] == "train-end-error-lightning":
        train_end_error_under_lightnings_launcher()
    else:
        directory = Path(sys.argv[1])
        directory.mkdir(parents=True, exist_ok=True)
        for name in sys.argv[2:]:
            run_scenario(directory, name)
