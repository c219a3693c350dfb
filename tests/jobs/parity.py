"""The ``parity`` scenario of ``lightning_features.py``: what a plain Lightning run must see alike under the strategy.

One fit (2 epochs of 4 batches, accumulate_grad_batches=2, reload_dataloaders_every_n_epochs=1) of
:class:`ParityGPT`, then ``trainer.predict`` through a prediction writer, then ``trainer.validate`` and
``trainer.test`` of a fresh model (with BatchNorm statistics) by a new trainer, without a fit. Recorded:

- at ``on_fit_start`` (after the strategy's dry run): the state a step changes (a metric's count, a list, an
  attribute, a buffer) and the RNG states;
- per batch: the logged loss (NaN where the batch is skipped after the loss); per epoch: a metric fed with
  ``.update()``, one called (forward) and the batch index logged with ``reduce_fx=torch.max``;
- the model summary Lightning prints at the start of fit (rank 0), the number of ``train_dataloader()`` calls,
  the final weights this rank holds, the files the prediction writer wrote, and the fresh model's evaluation.

Skipped batches: ``training_step`` returns None before the forward at batch 2 of each epoch, and after the loss
when the batch holds the poisoned sample (its loss is made NaN), which sits in one replica's share of batch 1 of
epoch 0: every stage of every replica must skip that optimizer step, which still takes batch 0's gradients.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from helpers.models import RandomTokens, TinyGPT
from lightning.pytorch.callbacks import BasePredictionWriter, ModelSummary
from spec import trainer_for
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

EPOCHS = 2
_QUIET = {"enable_checkpointing": False, "enable_progress_bar": False}
SKIP_BEFORE_FORWARD = 2
POISON = 63
POISON_POSITION = 19
"""Position of the poisoned sample in epoch 0's permutation: batch 1 of the plain run, replica 1 under D=2."""


class ChannelBatchNorm(nn.Module):
    """BatchNorm over the channels of a ``(B, T, C)`` activation."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(channels)

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(x.transpose(1, 2)).transpose(1, 2)


class ParityGPT(TinyGPT):
    """TinyGPT whose step changes module state, logs metrics fed both ways and skips batches (see the module doc)."""

    def __init__(self, batchnorm: bool = False, batch: int = 16, reference: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        n_embd = self.hparams.n_embd
        if batchnorm:
            self.ln_f = nn.Sequential(ChannelBatchNorm(n_embd), self.ln_f)
        self.token_loss = MeanMetric()
        self.train_acc = MulticlassAccuracy(num_classes=self.hparams.vocab_size, average="micro")
        self.seen: list[int] = []
        self.register_buffer("steps_run", torch.zeros((), dtype=torch.long))
        self.loader_calls = 0
        self.batch = batch
        self.reference = reference
        self.example_input_array = torch.zeros(2, 8, dtype=torch.long)
        for p in self.blocks[-1].ln_1.parameters():  # frozen on the last stage: the summary counts them anyway
            p.requires_grad_(False)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
        if batch_idx == SKIP_BEFORE_FORWARD:
            return None
        idx, targets = batch
        self.seen.append(batch_idx)
        self.last_batch_idx = batch_idx
        self.steps_run += 1
        logits = self(idx)
        per_token = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none")
        loss = per_token.mean()
        self.token_loss.update(per_token)
        self.log("token_loss", self.token_loss, on_step=False, on_epoch=True)
        self.train_acc(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        # the same on every replica: its epoch maximum is the plain run's whatever D
        self.log("last_batch", float(batch_idx), reduce_fx=torch.max, on_step=False, on_epoch=True)
        if (idx[:, 0] == POISON).any():
            loss = loss * float("nan")
        self.log("train_loss", loss, sync_dist=True)
        if not torch.isfinite(loss):
            return None
        return loss

    def train_dataloader(self) -> DataLoader:
        self.loader_calls += 1
        dataset = poisoned_tokens()
        # the plain run reads the permutation Lightning's DistributedSampler gives under the strategy
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0) if self.reference else None
        return DataLoader(dataset, batch_size=self.batch, sampler=sampler)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)


def poisoned_tokens() -> RandomTokens:
    """64 samples; one, at :data:`POISON_POSITION` of epoch 0's permutation, starts with the token :data:`POISON`."""
    dataset = RandomTokens(n=64, seed=1)
    dataset.data[:, 0] %= POISON
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0)).tolist()
    dataset.data[perm[POISON_POSITION], 0] = POISON
    return dataset


class RecordingSummary(ModelSummary):
    """Lightning's model summary (what rank 0 would print), kept."""

    def __init__(self) -> None:
        super().__init__(max_depth=2)
        self.recorded: dict | None = None

    def summarize(self, summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                  total_flops, **kwargs) -> None:
        self.recorded = {"data": summary_data, "total": total_parameters, "trainable": trainable_parameters,
                         "size": model_size, "modes": total_training_modes, "flops": total_flops}


class FileWriter(BasePredictionWriter):
    """Writes each batch's predictions to ``rank<global rank>-batch<i>.json``."""

    def __init__(self, directory: Path) -> None:
        super().__init__("batch")
        self.directory = directory

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        path = self.directory / f"rank{trainer.global_rank}-batch{batch_idx}.json"
        path.write_text(json.dumps({"indices": batch_indices, "predictions": prediction.tolist()}))


class Recorder(pl.Callback):
    def __init__(self) -> None:
        self.fit_start: dict = {}
        self.losses: list[float] = []
        self.epochs: list[dict[str, float]] = []
        self.weights: dict[str, list[float]] = {}
        self.loader_calls = 0

    def on_fit_start(self, trainer, pl_module) -> None:
        self.fit_start = {
            "token_loss_weight": float(pl_module.token_loss.weight),
            "token_loss_updates": pl_module.token_loss.update_count,
            "seen": list(pl_module.seen),
            "has_last_batch_idx": hasattr(pl_module, "last_batch_idx"),
            "steps_run": int(pl_module.steps_run),
            "torch_rng": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest(),
            "python_rng": random.random(),
        }
        random.seed(1234)  # the draw above must not change what follows

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        metrics = trainer.callback_metrics
        self.epochs.append({k: float(metrics[k]) for k in ("token_loss", "train_acc", "last_batch")})

    def on_train_end(self, trainer, pl_module) -> None:
        self.weights = {n: p.detach().flatten().tolist() for n, p in pl_module.named_parameters()}
        self.loader_calls = pl_module.loader_calls


def parity(out: Path, name: str, options: dict, reference: bool) -> dict:
    batch = options.pop("batch", 16)
    evaluate = options.pop("evaluate", True)  # also predict, and validate/test a fresh model
    random.seed(0)
    torch.manual_seed(0)
    model = ParityGPT(batch=batch, reference=reference, sync_dist=True)
    recorder, summary = Recorder(), RecordingSummary()
    writes = out / f"predictions-{name}"
    writes.mkdir(exist_ok=True)
    trainer = trainer_for(reference, dict(options), callbacks=[recorder, summary, FileWriter(writes)],
                          max_epochs=EPOCHS, accumulate_grad_batches=2, reload_dataloaders_every_n_epochs=1,
                          limit_val_batches=0, enable_model_summary=True, **_QUIET)
    trainer.fit(model)
    if evaluate:
        trainer.predict(model, DataLoader(RandomTokens(n=24, seed=4), batch_size=batch), return_predictions=False)
    return {
        "fit_start": recorder.fit_start,
        "losses": recorder.losses,
        "epochs": recorder.epochs,
        "weights": recorder.weights,
        "loader_calls": recorder.loader_calls,
        "summary": summary.recorded,
        "global_rank": trainer.global_rank,
        **(evaluate_fresh_model(options, batch, reference) if evaluate else {}),
    }


def evaluate_fresh_model(options: dict, batch: int, reference: bool) -> dict:
    """``trainer.validate`` and ``trainer.test`` of a model with BatchNorm statistics, without a fit."""
    torch.manual_seed(1)
    model = ParityGPT(batchnorm=True, batch=batch, reference=reference, sync_dist=True)
    norm = model.ln_f[0].bn
    with torch.no_grad():
        norm.running_mean.normal_()
        norm.running_var.uniform_(0.5, 2.0)
    trainer = trainer_for(reference, options, **_QUIET)
    validated = trainer.validate(model, DataLoader(RandomTokens(n=32, seed=2), batch_size=batch), verbose=False)
    tested = trainer.test(model, DataLoader(RandomTokens(n=40, seed=3), batch_size=batch), verbose=False)
    return {"validate": validated, "test": tested, "running_mean": norm.running_mean.tolist()}
