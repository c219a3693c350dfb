"""Ordinary user code under the strategy, against the plain single-process Lightning run.

    torchrun --nproc-per-node=2 tests/jobs/ordinary_code.py OUT SPEC [SPEC ...]
    python tests/jobs/ordinary_code.py OUT reference-weights:kind=weights ...

SPEC is ``name:kind=KIND,key=value,...``; names starting with ``reference`` run the plain Trainer in one process,
others ``VarunaStrategy(**options)`` (plus ``samples``: the dataset's size, ``batch``: the batch size; a size that is
not a multiple of the batch makes the last batch short, as without ``drop_last``). Kinds:

- ``weights``: batches ``(idx, targets, weights, ids)`` with ``weights`` a list of one float per sample and ``ids``
  a list of one string per sample; the loss is the per-sample loss times its weight, averaged (and the step checks
  that it got as many ids as samples).
- ``inplace``: the GPT idiom ``h = self.wte(idx); h += self.pos[:, :T]`` (in place on the embedding's output).
- ``plain``: :class:`TinyGPT` as it is.
- ``branch``: a module called only when the batch asks for it (``if flag.any()``): the first batch, the dry run's,
  does not, later batches do.

Each run records the loss per step and the gradients of the first and last step of every parameter this rank
holds.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, default_collate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.models import RandomTokens, TinyGPT  # noqa: E402
from spec import parse_spec, trainer_for  # noqa: E402

STEPS = 3


class WeightedGPT(TinyGPT):
    """Weights each sample's loss by the batch's per-sample list."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        idx, targets, weights, ids = batch
        if len(weights) != idx.shape[0] or len(ids) != idx.shape[0]:
            raise AssertionError(f"{len(weights)} weights and {len(ids)} ids for {idx.shape[0]} samples")
        logits = self(idx)
        per_token = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        loss = (per_token.mean(dim=1) * torch.tensor(weights, dtype=per_token.dtype)).mean()
        self.log("train_loss", loss)
        return loss


class InPlaceGPT(TinyGPT):
    """Adds the position table in place to the embedding's output, as many GPT implementations do."""

    def forward(self, idx: Tensor) -> Tensor:
        _, T = idx.shape
        h = self.wte(idx)
        h += self.pos[:, :T]
        h = self.drop(h)
        for i, block in enumerate(self.blocks):
            h = self.cuts[i](block(h))
        return self.lm_head(self.ln_f(h))


class BranchGPT(TinyGPT):
    """Runs ``extra`` on the last block's input when the batch's ``flag`` says so (not in the first batch)."""

    def _build(self) -> None:
        super()._build()
        self.extra = nn.Linear(self.hparams.n_embd, self.hparams.n_embd)

    def forward(self, idx: Tensor, flag: Tensor | None = None) -> Tensor:
        h = self.wte(idx) + self.pos[:, : idx.shape[1]]
        for i, block in enumerate(self.blocks):
            if i == len(self.blocks) - 1 and flag is not None and flag.any():
                h = self.extra(h)
            h = self.cuts[i](block(h))
        return self.lm_head(self.ln_f(h))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        idx, targets, flag = batch
        loss = self._loss(self(idx, flag), targets)
        self.log("train_loss", loss)
        return loss


class Recorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grads: dict[str, list[float]] = {}
        self.last_grads: dict[str, list[float]] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        grads = {n: p.grad.flatten().tolist() for n, p in pl_module.named_parameters() if p.grad is not None}
        if trainer.global_step == 0:
            self.grads = grads
        self.last_grads = grads  # the last step's: a short last batch's

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def weighted_collate(samples: list) -> tuple[Tensor, Tensor, list[float], list[str]]:
    idx, targets = default_collate(samples)
    weights = [0.5 + int(row[0]) % 3 for row in idx]  # 0.5, 1.5 or 2.5: differs from sample to sample
    return idx, targets, weights, [f"sample-{int(row[0])}" for row in idx]


def flag_collate(samples: list) -> tuple[Tensor, Tensor, Tensor]:
    """Flags every batch but the first collated (the dry run's, under the strategy) for the branch."""
    idx, targets = default_collate(samples)
    flag_collate.calls += 1  # type: ignore[attr-defined]
    return idx, targets, torch.full((idx.shape[0],), flag_collate.calls > 1)  # type: ignore[attr-defined]


flag_collate.calls = 0  # type: ignore[attr-defined]

MODELS = {"weights": (WeightedGPT, weighted_collate), "inplace": (InPlaceGPT, None),
          "branch": (BranchGPT, flag_collate), "plain": (TinyGPT, None)}


def run(name: str, options: dict, reference: bool) -> dict:
    model_class, collate = MODELS[options.pop("kind")]
    samples = options.pop("samples", 8 * STEPS)
    batch = options.pop("batch", 8)
    max_steps = options.pop("steps", STEPS)
    torch.manual_seed(0)
    model = model_class()
    recorder = Recorder()
    trainer = trainer_for(reference, options, max_steps=max_steps, num_sanity_val_steps=0, enable_checkpointing=False,
                          enable_progress_bar=False, callbacks=[recorder])
    dataset = RandomTokens(n=samples, seed=1)
    # Lightning shuffles training data with DistributedSampler(seed=0) under a distributed strategy: the reference
    # reads the same permutation
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0) if reference else None
    loader = DataLoader(dataset, batch_size=batch, sampler=sampler, collate_fn=collate)
    trainer.fit(model, loader)
    return {"losses": recorder.losses, "grads": recorder.grads, "last_grads": recorder.last_grads}


if __name__ == "__main__":
    torch.set_num_threads(1)
    directory = Path(sys.argv[1])
    directory.mkdir(parents=True, exist_ok=True)
    for spec in sys.argv[2:]:
        name, options = parse_spec(spec)
        result = run(name, options, name.startswith("reference"))
        rank = int(os.environ.get("RANK", 0))
        (directory / f"{name}.rank{rank}.json").write_text(json.dumps(result))
