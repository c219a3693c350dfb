"""Trains a model whose step creates its torchmetrics metric on first use, and records the logged epoch values.

    python tests/jobs/lazy_metric.py OUT ref           # the plain one-process run
    torchrun --nproc-per-node=2 tests/jobs/lazy_metric.py OUT p2      # P=2, 4 micro-batches

The step (as a user writes it) creates ``self.tacc`` the first time it runs, updates it with the batch and logs it
for the epoch; the strategy's dry run runs the step before the first real one. Writes ``OUT/CONFIG.rankR.json``:
the logged ``train_acc`` of every epoch (from ``callback_metrics`` at each epoch's end), the losses, and how many
samples the metric had counted at the end of the first epoch on the rank (before its reset); or ``{"error": ...}``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import traceback
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_varuna import CutPoint, VarunaStrategy  # noqa: E402

V, T, E = 64, 16, 32


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, E)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(E, E), nn.GELU()) for _ in range(4))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(3))
        self.head = nn.Linear(E, V)

    def forward(self, x):
        x = self.emb(x)
        for i, b in enumerate(self.blocks):
            x = b(x)
            if i < 3:
                x = self.cuts[i](x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
        if getattr(self, "tacc", None) is None:
            self.tacc = torchmetrics.classification.MulticlassAccuracy(num_classes=V, average="micro").to(self.device)
        self.tacc.update(logits.reshape(-1, V), y.reshape(-1))
        self.log("train_acc", self.tacc, on_step=False, on_epoch=True)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Recorder(L.Callback):
    def __init__(self) -> None:
        self.epochs: list[float] = []
        self.losses: list[float] = []
        self.counted: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        metric = getattr(pl_module, "tacc", None)
        if trainer.current_epoch == 0 and batch_idx == 3 and metric is not None:
            # what the metric counted on this rank in the first epoch (the dry run's samples would show here)
            self.counted.append(int(metric.tp.sum() + metric.fn.sum()))

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.epochs.append(float(trainer.callback_metrics["train_acc"]))


def run(out: Path, config: str) -> None:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, V, (128, T)), torch.randint(0, V, (128, T)))
    model = Net()  # before the Trainer, whose set-up may draw random numbers
    pipelined = config == "p2"
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]) if pipelined else 1, max_steps=8,
        limit_train_batches=4, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder],
        strategy=VarunaStrategy(pipeline_parallel_size=2, num_microbatches=4, p2p_timeout=60.0) if pipelined
        else "auto", use_distributed_sampler=pipelined,
    )
    # Lightning samples with DistributedSampler(seed=0) under a distributed strategy: the plain run reads the same
    # order in one process
    sampler = None if pipelined else DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=16, drop_last=True, sampler=sampler))
    result = {"epochs": recorder.epochs, "losses": recorder.losses, "counted": recorder.counted}
    (out / f"{config}.rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main() -> None:
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    config = sys.argv[2]
    faulthandler.dump_traceback_later(240, exit=True)
    try:
        run(out, config)
    except BaseException as err:  # noqa: BLE001 - recorded, then the process ends (the other may be waiting)
        rank = int(os.environ.get("RANK", "0"))
        (out / f"{config}.rank{rank}.json").write_text(json.dumps(
            {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]}))
        os._exit(1)


if __name__ == "__main__":
    main()
