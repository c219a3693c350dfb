"""Trains a wrapped TinyGPT built on the meta device (``configure_model``) and records losses and initial weights.

    torchrun --nproc-per-node=N tests/jobs/big_models.py OUT CONFIG [CONFIG ...]
    python tests/jobs/big_models.py OUT reference:weights=PATH

CONFIG is ``name:key=value,...`` with keys of VarunaStrategy plus ``batch``, ``steps``, ``init`` (use this file's
``init_weights`` as ``param_init_fn``), ``save_dir`` (a ModelCheckpoint writing ``step4.ckpt`` after step 4),
``resume`` (a checkpoint path) and ``expect_error`` (the run must fail: its error is recorded instead, and the
rank ends there: such a run must be the job's last).
``reference`` trains in one process without the strategy, built in ``__init__`` and loaded from ``weights``.
The model ties its output head to the embedding under two ``state_dict`` keys (``lm_head.weight`` and
``wte.weight``, as Hugging Face models do) and adds a position signal computed from a non-persistent buffer.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.models import RandomTokens, TinyGPT  # noqa: E402
from spec import job_command_line, parse_spec  # noqa: E402

import lightning_varuna  # noqa: E402

STEPS = 8


class Wrapped(pl.LightningModule):
    """A LightningModule whose network is ``self.model`` (as a Hugging Face model is wrapped)."""

    def __init__(self, in_configure_model: bool = True) -> None:
        super().__init__()
        self.in_configure_model = in_configure_model
        if not in_configure_model:
            self.configure_model()

    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            self.model = TinyGPT(tie_weights=True, head_alias=True, sinusoidal=True)

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        logits = self.model(idx)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1)


def init_weights(module: nn.Module) -> None:
    """``param_init_fn``: TinyGPT's own initialization, module by module."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, TinyGPT):
        nn.init.normal_(module.pos, std=0.02)
    else:
        module.reset_parameters()


class Recorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.initial: dict[str, list[float]] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.initial = {n: p.detach().double().flatten().tolist() for n, p in pl_module.named_parameters()}
        self.initial["model.inv_freq"] = pl_module.model.inv_freq.double().tolist()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def run(out: Path, spec: str) -> None:
    name, options = parse_spec(spec)
    batch = options.pop("batch", 16)
    steps = options.pop("steps", STEPS)
    save_dir = options.pop("save_dir", None)
    resume = options.pop("resume", None)
    expect_error = options.pop("expect_error", False)
    if options.pop("init", False):
        options["param_init_fn"] = init_weights
    reference = name == "reference"
    torch.manual_seed(0)
    dataset = RandomTokens(n=16 * STEPS, seed=1)
    recorder = Recorder()
    callbacks: list[pl.Callback] = [recorder]
    if save_dir is not None:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=save_dir, filename="step{step}", every_n_train_steps=4,
                                                      save_top_k=-1, auto_insert_metric_name=False))
    if reference:
        model = Wrapped(in_configure_model=False)
        model.load_state_dict(torch.load(options.pop("weights"), weights_only=True))
        # the order Lightning's DistributedSampler(seed=0) gives the strategy's runs
        loader = DataLoader(dataset, batch_size=batch, sampler=DistributedSampler(dataset, 1, 0, shuffle=True, seed=0))
    else:
        model = Wrapped()
        loader = DataLoader(dataset, batch_size=batch)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1 if reference else int(os.environ["WORLD_SIZE"]),
        strategy="auto" if reference else lightning_varuna.VarunaStrategy(**options),
        max_steps=steps,
        logger=False,
        enable_checkpointing=save_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        use_distributed_sampler=not reference,
    )
    result: dict = {}
    try:
        trainer.fit(model, loader, ckpt_path=resume)
    except Exception as err:  # noqa: BLE001 - the error cases record what every rank raised
        if not expect_error:
            raise
        result["error"] = f"{type(err).__name__}: {err}"
    else:
        assert not expect_error, f"{name} trained although it should have failed"
        result.update(losses=recorder.losses, initial=recorder.initial, stage=trainer.strategy.topology.stage
                      if not reference else 0)
    (out / f"{name}.rank{trainer.global_rank}.json").write_text(json.dumps(result))
    if expect_error:
        # A rank whose fit failed is a failed rank: the watchdog ends it, non-zero, moments later (and torchrun
        # then stops the others, perhaps before they record their own error). Its error is recorded: end here.
        os._exit(0)


if __name__ == "__main__":
    torch.set_num_threads(1)
    directory, specs = job_command_line(__doc__)
    if any("expect_error" in spec for spec in specs[:-1]):
        raise SystemExit("an expect_error run must be the job's last")
    for spec in specs:
        run(directory, spec)
