"""Preemption: one rank is warned (a signal, a notice) or killed mid-training; then a run resumes from "last".

    python tests/jobs/preemption.py OUT NOTICE_URL SCENARIO [SCENARIO ...]

TinyGPT at P=2 x D=2, 4 steps per epoch, 8 steps in all. Like ``faults.py``, the parent forks one child per
rank (an external launcher that does not end the job when one rank ends), so each rank's own exit status
and time are measured. Every scenario but ``reference`` is followed by ``<scenario>-resume``: a run with
``ckpt_path="last"`` and no fault. Per run, ``OUT/<run>.rank<r>.jsonl`` holds each finished step's
``global_step`` and loss, ``OUT/<run>.rank<r>.log`` the output, ``OUT/<run>.json`` the exit codes and the
seconds from the fault to each exit, and ``OUT/<scenario>-ckpt`` the ``ModelCheckpoint`` directory.

The resume is a fresh launch, as after a scheduler's restart: an in-place ``torchrun --max-restarts``
restart fails to reconnect gloo in the torch used here (``Gloo connectFullMesh failed``), whatever the job.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from forked import marked_time, run_ranks  # noqa: E402
from helpers.models import RandomTokens, TinyGPT  # noqa: E402

import lightning_varuna  # noqa: E402
from lightning_varuna.trainer.recovery.preemption import HTTPNotice  # noqa: E402

WORLD = 4
STEPS = 8
P2P_TIMEOUT = 20.0
DEADLINE = 120.0
# name -> (fault, faulty rank, trainer.global_step while it happens: during that step, or in the save after it)
SCENARIOS = {
    "reference": (None, None, None),
    "sigterm-rank2": ("SIGTERM", 2, 2),
    "sigterm-rank0": ("SIGTERM", 0, 5),
    "sigusr1-rank3": ("SIGUSR1", 3, 3),  # the last step of epoch 0: agreed at the start of epoch 1
    "notice": ("notice", 1, 1),  # rank 1 arms the test's HTTP server; every rank polls it
    "kill": ("kill", 2, 4),  # SIGKILL as rank 2 starts writing last.ckpt at step 4
}
FAULT_MARK = "VARUNA-FAULT-AT"


class Recorder(pl.Callback):
    """Appends each finished step's global_step and loss to this rank's file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": trainer.global_step, "loss": float(outputs["loss"])}) + "\n")


class Faulty(TinyGPT):
    """TinyGPT whose ``rank`` is warned (or arms the notice) in the first forward of ``step``."""

    def __init__(self, fault: str | None, rank: int | None, step: int | None, url: str) -> None:
        super().__init__(n_layer=2)
        self.fault, self.fault_rank, self.fault_step, self.url = fault, rank, step, url
        self.done = False

    def training_step(self, batch, batch_idx: int):
        executor = self.trainer.strategy.engine.executor  # None during the dry run
        in_step = executor is not None and executor.current is not None
        if (in_step and not self.done and self.fault in ("SIGTERM", "SIGUSR1", "notice")
                and self.trainer.global_rank == self.fault_rank and self.trainer.global_step == self.fault_step):
            self.done = True
            print(f"{FAULT_MARK} {time.time():.3f}", flush=True)
            if self.fault == "notice":
                urllib.request.build_opener(urllib.request.ProxyHandler({})).open(f"{self.url}/arm", timeout=10)
            else:
                os.kill(os.getpid(), getattr(signal, self.fault))
        return super().training_step(batch, batch_idx)


def _kill_in_checkpoint_write(trainer: pl.Trainer, step: int) -> None:
    """The rank dies as DCP hands it the first item of last.ckpt to write at ``step``; the others write theirs."""
    import torch.distributed.checkpoint as dcp

    save = dcp.save

    def die_in_write(state, *args, storage_writer, planner, **kwargs):
        if trainer.global_step == step and Path(str(storage_writer.checkpoint_id)).name.startswith("last"):
            def die(*_):
                print(f"{FAULT_MARK} {time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

            planner.transform_object = die
        return save(state, *args, storage_writer=storage_writer, planner=planner, **kwargs)

    dcp.save = die_in_write


def train(out: Path, run: str, url: str, rank: int) -> None:
    scenario = run.removesuffix("-resume")
    fault, fault_rank, step = SCENARIOS[scenario] if run == scenario else (None, None, None)
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    model = Faulty(fault, fault_rank, step, url)
    every = 1 if fault == "kill" else None
    callbacks: list[pl.Callback] = [Recorder(out / f"{run}.rank{rank}.jsonl")]
    if scenario != "reference":
        callbacks.append(ModelCheckpoint(dirpath=out / f"{scenario}-ckpt", every_n_train_steps=every,
                                         save_last=every is not None, save_top_k=1 if every else 0))
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, max_steps=STEPS, logger=False, callbacks=callbacks,
        enable_checkpointing=scenario != "reference", enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
        strategy=lightning_varuna.VarunaStrategy(
            pipeline_parallel_size=2, num_microbatches=2, p2p_timeout=P2P_TIMEOUT,
            preemption_notice=HTTPNotice(f"{url}/notice", interval=0.05) if fault == "notice" else None,
        ),
    )
    if fault == "kill" and rank == fault_rank:
        _kill_in_checkpoint_write(trainer, step)
    loader = DataLoader(RandomTokens(n=32, seed=1), batch_size=4)
    trainer.fit(model, loader, ckpt_path="last" if run != scenario else None)


def run_forked(out: Path, run: str, url: str) -> None:
    ends = run_ranks(out, run, WORLD, lambda rank: train(out, run, url, rank), DEADLINE)
    fault_time = marked_time(out, run, ends, FAULT_MARK)
    result = {"fault_time": fault_time, "ranks": {}}
    for rank, info in sorted(ends.items()):
        info["after_fault"] = None if fault_time is None else info["end"] - fault_time
        result["ranks"][rank] = info
    (out / f"{run}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    directory = Path(sys.argv[1])
    directory.mkdir(parents=True, exist_ok=True)
    for name in sys.argv[3:]:
        run_forked(directory, name, sys.argv[2])
        if name != "reference":
            run_forked(directory, f"{name}-resume", sys.argv[2])
