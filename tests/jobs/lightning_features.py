"""Runs Lightning feature scenarios under the strategy (or the plain reference) and records what they produce.

Run under torchrun for the strategy (every scenario in one job), or as a plain script for the reference:

    torchrun --nproc-per-node=4 tests/jobs/lightning_features.py OUT SPEC [SPEC ...]
    python tests/jobs/lightning_features.py OUT reference-fit:kind=fit reference-steps:kind=steps ...

SPEC is ``name:kind=fit|steps,key=value,...``; names starting with ``reference`` run the plain Trainer in one
process. Other keys are VarunaStrategy arguments plus ``batch`` (per replica), ``dropout``, ``varlen`` (a
``cut_at`` model has no CutPoint modules).

- ``fit``: fit with validation (sanity check on), accumulate_grad_batches=2, ModelCheckpoint and
  EarlyStopping on val_loss and the progress bar; then trainer.validate, trainer.test and trainer.predict on
  the fitted model. Records per-batch train_loss / first_token / lr, per-epoch val metrics, the returned
  metrics and predictions, the memory counters and the parameters this rank holds.
- ``steps``: a short plain fit (no validation), optionally with dropout or a collate_fn that truncates each
  batch to a length that varies from batch to batch.
- ``parity``: what a plain run must see alike (:mod:`parity`): torchmetrics fed both ways, batches skipped by
  ``training_step`` returning None (before the forward, and after a non-finite loss on one replica's data), a
  callable ``reduce_fx``, the model summary, ``reload_dataloaders_every_n_epochs`` and a prediction writer;
  then ``trainer.validate``/``trainer.test`` of a fresh model with BatchNorm statistics, without a fit.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler, default_collate
from torchmetrics.classification import MulticlassAccuracy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.models import RandomTokens, TinyGPT  # noqa: E402
from parity import parity  # noqa: E402
from spec import job_command_line, parse_spec, trainer_for  # noqa: E402

import lightning_varuna  # noqa: E402, F401
from lightning_varuna.pipeline.comm.events import StageCounters  # noqa: E402

FIT_EPOCHS = 2
STEPS = 4


class FeatureGPT(TinyGPT):
    """TinyGPT that also logs, from training_step, a value that differs between micro-batches (before its
    forward runs) and a torchmetrics metric called on each batch (step value: the batch's accuracy)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.train_acc = MulticlassAccuracy(num_classes=self.hparams.vocab_size, average="micro")

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        idx, targets = batch
        self.log("first_token", idx[:, 0].float().mean(), sync_dist=self.hparams.sync_dist)
        logits = self(idx)
        loss = self._loss(logits, targets)
        self.log("train_loss", loss, prog_bar=True, sync_dist=self.hparams.sync_dist)
        self.train_acc(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return loss


class Recorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.first_token: list[float] = []
        self.lrs: list[float] = []
        self.lengths: list[int] = []
        self.train_acc: list[float | None] = []
        self.val: list[dict[str, float]] = []
        self.predict_inputs: list[list[list[int]]] = []
        self.counters = StageCounters()

    def on_fit_start(self, trainer, pl_module) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:  # the strategy has partitioned the model: count what its stage holds from now on
            engine.events.add(self.counters)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = trainer.callback_metrics
        self.losses.append(float(metrics["train_loss"]))
        self.first_token.append(float(metrics["first_token"]))
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])
        self.train_acc.append(float(metrics["train_acc_step"]) if "train_acc_step" in metrics else None)
        self.lengths.append(batch[0].shape[1])

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        metrics = trainer.callback_metrics
        keys = ("val_loss", "val_acc", "train_acc_epoch")
        self.val.append({k: float(metrics[k]) for k in keys if k in metrics})

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.predict_inputs.append(batch[0].tolist())


def truncating_collate(samples: list) -> tuple[Tensor, Tensor]:
    """Stacks the samples, then cuts the batch to a length (6..16) that depends on its content."""
    idx, targets = default_collate(samples)
    length = 6 + int(idx[:, 0].sum()) % 11
    return idx[:, :length], targets[:, :length]


def train_loader(dataset, batch: int, reference: bool, **kwargs) -> DataLoader:
    # Lightning shuffles training data with DistributedSampler(seed=0) under a distributed strategy; the
    # reference reads the same permutation in one process (its batch k is the union of the replicas' k-th)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0) if reference else None
    return DataLoader(dataset, batch_size=batch, sampler=sampler, **kwargs)


def strategy_facts(trainer: pl.Trainer, model: pl.LightningModule, full_numel: int, counters: StageCounters) -> dict:
    strategy = trainer.strategy
    if not isinstance(strategy, lightning_varuna.VarunaStrategy):
        return {}
    engine = strategy.engine
    stage = strategy.topology.stage
    return {
        "stage": stage,
        "pipeline_size": strategy.topology.pipeline_size,
        "stats": counters.memory(),
        "num_microbatches": engine.config.num_microbatches,
        "local_numel": sum(p.numel() for p in model.parameters()),
        "plan_numel": engine.partition.stages[stage].param_numel,
        "plan_numels": [s.param_numel for s in engine.partition.stages],
        "plan_segments": [[s.segments.start, s.segments.stop] for s in engine.partition.stages],
        "full_numel": full_numel,
    }


def fit(out: Path, name: str, options: dict, reference: bool) -> dict:
    batch = options.pop("batch", 16)
    torch.manual_seed(0)
    model = FeatureGPT(sync_dist=True, use_cut_points=options.get("cut_at") is None)
    full_numel = sum(p.numel() for p in model.parameters())
    recorder = Recorder()
    checkpoint = ModelCheckpoint(monitor="val_loss", dirpath=out / f"ckpt-{name}", save_top_k=1)
    trainer = trainer_for(
        reference,
        options,
        max_epochs=FIT_EPOCHS,
        accumulate_grad_batches=2,
        num_sanity_val_steps=2,
        enable_progress_bar=True,
        callbacks=[recorder, checkpoint, EarlyStopping(monitor="val_loss", patience=100)],
    )
    loader = train_loader(RandomTokens(n=64, seed=1), batch, reference)
    val_loader = DataLoader(RandomTokens(n=32, seed=2), batch_size=batch)
    trainer.fit(model, loader, val_loader)
    result = {
        "losses": recorder.losses,
        "first_token": recorder.first_token,
        "lrs": recorder.lrs,
        "train_acc": recorder.train_acc,
        "val": recorder.val,
        "best_score": float(checkpoint.best_model_score),
        "best_exists": Path(checkpoint.best_model_path).exists() if trainer.global_rank == 0 else None,
        **strategy_facts(trainer, model, full_numel, recorder.counters),
    }
    result["validate"] = trainer.validate(model, val_loader, verbose=False)
    test_loader = DataLoader(RandomTokens(n=40, seed=3), batch_size=batch)
    result["test"] = trainer.test(model, test_loader, verbose=False)
    predictions = trainer.predict(model, DataLoader(RandomTokens(n=24, seed=4), batch_size=batch))
    inputs = [row for rows in recorder.predict_inputs for row in rows]
    outputs = [row for p in predictions for row in p.tolist()]
    result["predictions"] = [[i, o] for i, o in zip(inputs, outputs, strict=True)]
    result["num_predictions"] = len(outputs)
    return result


def steps(out: Path, name: str, options: dict, reference: bool) -> dict:
    batch = options.pop("batch", 16)
    dropout = options.pop("dropout", 0.0)
    varlen = options.pop("varlen", False)
    layers = options.pop("layers", 4)
    if options.pop("policy", None) == "dropout":  # selective recompute whose list names dropout's random ops too
        aten = torch.ops.aten
        options["recompute_policy"] = [aten.mm.default, aten.addmm.default, aten.bmm.default,
                                       aten.bernoulli_.float, aten.native_dropout.default]
    torch.manual_seed(0)
    model = FeatureGPT(dropout=dropout, sync_dist=True, use_cut_points=options.get("cut_at") is None, n_layer=layers)
    full_numel = sum(p.numel() for p in model.parameters())
    recorder = Recorder()
    trainer = trainer_for(
        reference,
        options,
        max_steps=STEPS,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[recorder],
    )
    collate = {"collate_fn": truncating_collate} if varlen else {}
    loader = train_loader(RandomTokens(n=16 * STEPS, seed=1), batch, reference, **collate)
    trainer.fit(model, loader)
    return {
        "losses": recorder.losses,
        "first_token": recorder.first_token,
        "lrs": recorder.lrs,
        "train_acc": recorder.train_acc,
        "lengths": recorder.lengths,
        **strategy_facts(trainer, model, full_numel, recorder.counters),
    }


def record_groups_at_exit(directory: Path) -> None:
    """Registered before any strategy exists, so it runs after the strategy's own exit handler."""
    import atexit

    import torch.distributed as dist

    def record() -> None:
        if "RANK" in os.environ:
            (directory / f"exit.rank{os.environ['RANK']}.json").write_text(json.dumps(dist.is_initialized()))

    atexit.register(record)


if __name__ == "__main__":
    torch.set_num_threads(1)
    directory, specs = job_command_line(__doc__)
    record_groups_at_exit(directory)
    for spec in specs:
        name, options = parse_spec(spec)
        kind = options.pop("kind")
        run = {"fit": fit, "steps": steps, "parity": parity}[kind]
        result = run(directory, name, options, name.startswith("reference"))
        rank = int(os.environ.get("RANK", 0))
        (directory / f"{name}.rank{rank}.json").write_text(json.dumps(result))
