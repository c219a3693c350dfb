"""Checkpoint faults under VarunaStrategy: interrupted publications, damaged files, NaN weights, two jobs.

    torchrun --nproc-per-node=2 tests/jobs/checkpoint_faults.py OUT SCENARIO [SCENARIO ...]

TinyGPT (2 blocks) at P=2, blocking saves; every scenario is ``name:key=value,...`` and writes
``OUT/<name>.rank<r>.json`` (the step it started at, the steps it trained, the ``CheckpointError`` it raised,
the checkpoint warnings it saw, when ``fit`` was called and when it ended). Kinds (``kind=``, default the name):

- ``train``: ``fit`` with ``ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_last=True,
  save_top_k=0)`` (``last.ckpt`` after every step), plus one keeping ``step=<N>.ckpt`` every ``keep_every`` steps;
  ``ckpt`` is passed to ``fit`` (``last`` for ``"last"``), ``steps`` is ``max_steps``. ``nan_at=k``: rank 1 sets
  a parameter to NaN at the end of step k (before its save). ``wait_at=k``: every rank waits at the start of step k
  until the file ``OUT/<name>.go`` exists, after writing its pid to ``OUT/<name>.waiting.rank<r>``. ``fault`` sets
  ``LIGHTNING_VARUNA_TEST_FAULT`` (``lightning_varuna.checkpoint.publish``) for this run: rank 0, which
  publishes, stops (``...:raise``) or dies at that point of its n-th publication. Other options go to the
  strategy. A ``CheckpointError`` is recorded; any other error ends the job.
- ``damage``: rank 0 overwrites 64 bytes in the values of the largest tensor of ``target`` (the file keeps its
  size); every rank waits for it.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from helpers.models import RandomTokens, TinyGPT  # noqa: E402
from spec import job_command_line, parse_spec  # noqa: E402

import lightning_varuna  # noqa: E402
from lightning_varuna.checkpoint import CheckpointError, Location, publish  # noqa: E402


class Record(pl.Callback):
    """The step the run starts at and the steps it finishes; NaN weights and the wait, where asked."""

    def __init__(self, out: Path, name: str, nan_at: int | None, wait_at: int | None) -> None:
        self.out, self.name, self.nan_at, self.wait_at = out, name, nan_at, wait_at
        self.start: int | None = None
        self.steps: list[int] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = trainer.global_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.wait_at:
            (self.out / f"{self.name}.waiting.rank{trainer.global_rank}").write_text(str(os.getpid()))
            deadline = time.monotonic() + 300
            while not (self.out / f"{self.name}.go").exists() and time.monotonic() < deadline:
                time.sleep(0.1)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append(trainer.global_step)
        if trainer.global_step == self.nan_at and trainer.global_rank == 1:
            with torch.no_grad():
                next(p for p in pl_module.parameters() if p.numel() > 1).view(-1)[0] = float("nan")


def damage(target: str) -> None:
    """Overwrites 64 bytes inside the values of the checkpoint's largest tensor."""
    if dist.get_rank() == 0:
        loc = Location.of(target)
        index = loc.reader().read_metadata()
        info = max(index.storage_data.values(), key=lambda i: i.length)
        shard = loc.child(info.relative_path)
        data = bytearray(shard.read_bytes())
        start = info.offset + info.length // 2
        data[start : start + 64] = bytes(range(64))
        shard.fs.pipe_file(shard.path, bytes(data))
    dist.barrier()


def train(out: Path, name: str, options: dict) -> dict:
    folder = options.pop("folder")
    ckpt = options.pop("ckpt", None)
    keep_every = options.pop("keep_every", None)
    os.environ[publish.FAULT_ENV] = options.pop("fault", "")
    publish._publications = 0  # the fault's publications count from this run's first
    record = Record(out, name, options.pop("nan_at", None), options.pop("wait_at", None))
    callbacks: list[pl.Callback] = [
        record, ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_last=True, save_top_k=0)]
    if keep_every:
        callbacks.append(ModelCheckpoint(dirpath=folder, filename="step={step}", every_n_train_steps=keep_every,
                                         save_top_k=-1, auto_insert_metric_name=False))
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), max_steps=options.pop("steps", 6), logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=callbacks,
        strategy=lightning_varuna.VarunaStrategy(pipeline_parallel_size=2, num_microbatches=2, p2p_timeout=60,
                                                 **options),
    )
    result: dict = {"error": None, "fit_start": time.time()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(TinyGPT(n_layer=2), DataLoader(RandomTokens(n=64, seed=1), batch_size=4), ckpt_path=ckpt)
        except CheckpointError as err:
            result["error"] = str(err)
    result["fit_end"] = time.time()
    result["warnings"] = [str(w.message) for w in caught if "checkpoint" in str(w.message).lower()]
    result.update(start=record.start, steps=record.steps, global_step=trainer.global_step)
    return result


if __name__ == "__main__":
    torch.set_num_threads(1)
    out, specs = job_command_line(__doc__)
    for spec in specs:
        name, options = parse_spec(spec)
        kind = options.pop("kind", name)
        if kind == "damage":
            damage(options["target"])
            continue
        result = train(out, name, options)
        rank = int(os.environ["RANK"])
        (out / f"{name}.rank{rank}.json").write_text(json.dumps(result))
