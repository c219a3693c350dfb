"""Checkpoint writing and loading under VarunaStrategy: asynchronous saves, fsspec URLs, fallbacks, bad files.

    torchrun --nproc-per-node=4 tests/jobs/checkpoint_io.py OUT SCENARIO [SCENARIO ...]

SCENARIO is ``name:key=value,...`` with ``name`` one of:

- ``train``: P=2 x D=2, ``async_checkpoint=True``, a ``ModelCheckpoint`` (every 2 steps, ``save_top_k=1``,
  ``save_last=True``) whose ``dirpath`` is a ``localdisk://`` URL, so the writes go through fsspec. With
  ``gate=true`` the publication of the first checkpoint is held back until rank 0 has looked at the folder
  at the next step's start (``localdisk.py``), so that training demonstrably goes on while a checkpoint is
  in flight. Records what rank 0 sees in the folder at every step start, and the
  process ids of the writer processes.
- ``kill_writer``: as ``train``, but once the step-2 checkpoint is written, rank 1's writer process is killed;
  records the ``CheckpointError`` every rank raises (at the save after the next one). Its callback state holds
  an instance of a class of this script, which only this script can unpickle.
- ``resume``: ``fit(ckpt_path=...)`` (``ckpt=last`` asks for ``"last"``); records the step it resumes at, the
  weights and one optimizer state entry it starts from, and the warnings raised.
- ``bad``: ``fit`` from a checkpoint that must fail; records the ``CheckpointError`` every rank raised.

Any scenario takes ``n_layer`` (the model's blocks, 4 unless given). ``bad`` takes ``rank_zero_first=true``:
rank 1 raises the load's error only once rank 0's report of it has reached rank 1's watchdog (so a report
that ended peers would end rank 1 before it raises the error itself).

Every rank writes ``OUT/<name>.rank<r>.json``.

``localdisk://`` (``localdisk.py``) is an fsspec filesystem backed by the local disk: an fsspec URL that every
process of the job can reach (``memory://`` cannot be shared between processes), and that Lightning does
not take for a local path (``ModelCheckpoint`` turns a ``file://`` dirpath into a relative local path).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from unittest import mock

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from helpers.models import RandomTokens, TinyGPT  # noqa: E402
from spec import job_command_line, parse_spec  # noqa: E402

import lightning_varuna  # noqa: E402
from lightning_varuna import checkpoint  # noqa: E402  (is_complete)
from lightning_varuna.failstop.job_watchdog import current_watchdog  # noqa: E402

WATCHED = "blocks.1.mlp.0.weight"
"""A parameter whose optimizer state the resume scenarios record."""


from localdisk import LocalDisk, wait_for  # noqa: E402,F401 - registers localdisk://


class GroupedGPT(TinyGPT):
    """TinyGPT with two optimizer groups whose members interleave in ``named_parameters()`` order."""

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if n.endswith("weight") and "ln" not in n]
        rest = [p for n, p in self.named_parameters() if not (n.endswith("weight") and "ln" not in n)]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=self.hparams.lr
        )
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ScriptState:
    """Callback state of a class defined in the training script (``__main__``), as user code often has."""

    def __init__(self, trainer_steps: int) -> None:
        self.trainer_steps = trainer_steps


class Watch(pl.Callback):
    """Records the step the run starts at, its first weights and optimizer state, and rank 0's view of the folder."""

    def __init__(self, folder: str | None, kill_writer: bool = False) -> None:
        self.folder = folder
        self.kill_writer = kill_writer
        self.restored: object = None
        self.start: dict = {}
        self.seen: list[dict] = []
        self.writer_pid: int | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        writer = trainer.strategy._checkpoints._process
        self.writer_pid = writer._process.pid if writer is not None else None
        optimizer = trainer.optimizers[0]
        names = {id(p): n for n, p in pl_module.named_parameters()}
        state = {names[id(p)]: s for p, s in optimizer.state.items() if id(p) in names}
        self.start = {
            "global_step": trainer.global_step,
            "weights": {n: p.detach().double().flatten().tolist() for n, p in pl_module.named_parameters()},
            "exp_avg": state[WATCHED]["exp_avg"].double().flatten().tolist() if WATCHED in state else None,
            "lr": [g["lr"] for g in optimizer.param_groups],
        }

    def state_dict(self) -> dict:
        if not self.kill_writer:
            return {}
        return {"marker": ScriptState(trainer_steps=len(self.seen))}  # a class of this script in meta.pt

    def load_state_dict(self, state_dict: dict) -> None:
        self.restored = type(state_dict["marker"]).__name__ if "marker" in state_dict else None

    @staticmethod
    def _gate(trainer) -> Path | None:
        """The publication gate, once the first checkpoint waits at it (see ``localdisk.py``); else ``None``."""
        folder = os.environ.get("LOCALDISK_PUBLISH_GATE")
        if not folder or (Path(folder) / "released").exists() or not trainer.strategy._checkpoints.in_flight:
            return None
        if not wait_for(Path(folder) / "reached"):
            raise RuntimeError("the first checkpoint's writer did not reach the publication gate")
        return Path(folder)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.writer_pid is not None and trainer.global_step == 1 and not self.kill_writer:
            # signals that end or preempt a job are the training process's to act on, not its writer's
            for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
                os.kill(self.writer_pid, sig)
        if self.kill_writer and trainer.global_step == 3:
            trainer.strategy.wait_for_checkpoint()  # the step-2 checkpoint is complete; none is in flight
            if trainer.global_rank == 1:
                process = trainer.strategy._checkpoints._process._process
                process.kill()
                process.wait()
        if self.folder is None or not trainer.is_global_zero:
            return
        gate = self._gate(trainer)
        root = checkpoint.Location.of(self.folder)
        names = sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in root.fs.ls(root.path, detail=False)) if (
            root.exists()) else []
        complete = [n for n in names if n.endswith(".ckpt") and checkpoint.is_complete(root.child(n))]
        # a checkpoint the writer removed (replaced, save_top_k) between the listing and the check is not an
        # incomplete one on view: it is dropped from the listing
        names = [n for n in names if n in complete or not n.endswith(".ckpt") or root.child(n).exists()]
        self.seen.append({"step": trainer.global_step, "in_flight": trainer.strategy._checkpoints.in_flight,
                          "names": names, "complete": complete})
        if gate is not None:
            (gate / "released").touch()  # the first checkpoint's writer may publish now


def _rank_zero_reports_first() -> contextlib.AbstractContextManager:
    """On rank 1, the strategy's load raises its error once rank 0's report of it has reached this rank's watchdog.

    Rank 0's report is in the job's store once it was sent over the watchdog ring; a rank that says its error is
    raised on every rank marks itself idle there, any other report is a verdict that ends this rank at once.
    """
    from lightning_varuna.trainer.recovery import checkpoint_hooks

    load = checkpoint_hooks.checkpoint_load.load

    def late_on_rank_one(*args, **kwargs):
        try:
            return load(*args, **kwargs)
        except checkpoint.CheckpointError:
            if torch.distributed.get_rank() == 1:
                store = torch.distributed.distributed_c10d._get_default_store()
                store.wait(["lightning_varuna/error/0"], timedelta(seconds=60))
                watchdog = current_watchdog()
                # private: the ring's view of rank 0 (taken in: idle, or this process has been ended already)
                deadline = time.monotonic() + 60
                while not any(link.rank == 0 and not link.active for link in list(watchdog._links.values())):
                    assert time.monotonic() < deadline, "no word from rank 0"
                    time.sleep(0.01)
            raise

    return mock.patch.object(checkpoint_hooks.checkpoint_load, "load", late_on_rank_one)


def run(out: Path, spec: str) -> None:
    name, options = parse_spec(spec)
    kind = options.pop("kind", name)
    folder = options.pop("folder", None)
    ckpt = options.pop("ckpt", None)
    steps = options.pop("steps", 6)
    rank_zero_first = options.pop("rank_zero_first", False)
    if options.pop("gate", False):  # the writer processes hold back the first publication (see localdisk.py)
        os.environ["LOCALDISK_PUBLISH_GATE"] = str(out / "gate")
        (out / "gate").mkdir(exist_ok=True)
    torch.manual_seed(0)
    model = GroupedGPT(n_layer=options.pop("n_layer", 4), sync_dist=True)
    callbacks: list[pl.Callback] = [Watch(folder if kind in ("train", "kill_writer") else None,
                                          kill_writer=kind == "kill_writer")]
    if folder is not None:
        callbacks.append(ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=1, save_last=True))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=lightning_varuna.VarunaStrategy(**options),
        max_steps=steps,
        logger=False,
        enable_checkpointing=folder is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    loader = DataLoader(RandomTokens(n=64, seed=1), batch_size=8)
    result: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with _rank_zero_reports_first() if rank_zero_first else contextlib.nullcontext():
                trainer.fit(model, loader, ckpt_path=ckpt)
        except checkpoint.CheckpointError as err:
            if kind not in ("bad", "kill_writer"):
                raise
            result["error"] = str(err)
            result["error_step"] = trainer.global_step
    result["warnings"] = [str(w.message) for w in caught if "checkpoint" in str(w.message).lower()]
    watch = callbacks[0]
    result.update(start=watch.start, seen=watch.seen, writer_pid=watch.writer_pid, restored=watch.restored)
    if options.get("async_checkpoint") and kind == "train":  # after fit, no writer runs: a save is blocking
        trainer.save_checkpoint(f"{folder}-after/after.ckpt")
        result["after_complete"] = checkpoint.is_complete(f"{folder}-after/after.ckpt")
    result["final"] = {n: p.detach().double().flatten().tolist() for n, p in model.named_parameters()}
    (out / f"{name}.rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    torch.set_num_threads(1)
    directory, specs = job_command_line(__doc__)
    for spec in specs:
        run(directory, spec)
