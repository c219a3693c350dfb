"""Trains a Hugging Face Llama on padded batches (labels -100 in different numbers per sample), records what happened.

    python tests/jobs/token_loss.py OUT ref ref-accum2                        # plain one-process references
    torchrun --nproc-per-node=2 tests/jobs/token_loss.py OUT ddp tokens-p2 samples-p2 tokens-p2-accum2
    torchrun --nproc-per-node=4 tests/jobs/token_loss.py OUT tokens-p2d2

The model's loss is Hugging Face's mean over the counted tokens of the batch it is given, so the plain run's
gradient weighs every token alike; weighting micro-batch means by their samples does not. Each configuration writes
``OUT/CONFIG.rankR.json``: the logged loss of every batch, every held parameter's gradient at the first optimizer
step (by name), the validation loss (where run), the stage and replica; or ``{"error": ...}``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import traceback
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.zoo_models import FAMILIES, LR, SEQ, VOCAB, build  # noqa: E402
from spec import job_command_line  # noqa: E402

import lightning_varuna  # noqa: E402

STEPS = 8
BATCH = 8  # per step over all replicas
DATA_SEED = 3


def shifted_count(microbatch: dict) -> Tensor:
    """A user's own counter: what Hugging Face's causal loss averages over (labels shifted by one)."""
    return (microbatch["labels"][:, 1:] != -100).sum()


# configuration -> (processes kind, P, micro-batches, batch per replica, accumulated batches, loss_weighting)
CONFIGS = {
    "ref": ("plain", 1, 1, BATCH, 1, None),
    "ref-accum2": ("plain", 1, 1, BATCH, 2, None),
    "ddp": ("ddp", 1, 1, BATCH // 2, 1, None),
    "tokens-p2": ("varuna", 2, 4, BATCH, 1, "shifted_tokens"),
    "samples-p2": ("varuna", 2, 4, BATCH, 1, "samples"),
    "tokens-p2-accum2": ("varuna", 2, 3, BATCH, 2, shifted_count),
    "tokens-p2d2": ("varuna", 2, 2, BATCH // 2, 1, "shifted_tokens"),
}
VALIDATED = ("ref", "tokens-p2", "samples-p2")


def dataset() -> list[dict[str, Tensor]]:
    """2 x STEPS x BATCH samples whose labels end in -100 after 1..SEQ tokens (some batches far from uniform)."""
    g = torch.Generator().manual_seed(DATA_SEED)
    n = 2 * STEPS * BATCH
    ids = torch.randint(3, VOCAB, (n, SEQ), generator=g)
    kept = torch.randint(1, SEQ + 1, (n,), generator=g)
    kept[::5] = 2  # a few samples with almost nothing to predict
    labels = torch.where(torch.arange(SEQ) < kept[:, None], ids, torch.full_like(ids, -100))
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(n)]


class PaddedLlama(pl.LightningModule):
    """A tiny ``LlamaForCausalLM`` whose step is what a Lightning user writes: the model's own loss, logged."""

    def __init__(self) -> None:
        super().__init__()
        self.model = build(FAMILIES["llama"])

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)


class Recorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grads: dict[str, list[float]] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == 0:
            self.grads = {n: p.grad.detach().flatten().tolist()
                          for n, p in pl_module.named_parameters() if p.grad is not None}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def run(out: Path, config: str) -> None:
    kind, stages, microbatches, batch, accumulate, weighting = CONFIGS[config]
    data = dataset()
    plain = kind == "plain"
    # Lightning shuffles with DistributedSampler(seed=0) under a distributed strategy; the plain run reads the same
    # permutation in one process, so its batch k is the union of the replicas' k-th
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0) if plain else None
    if kind == "varuna":
        strategy = lightning_varuna.VarunaStrategy(
            pipeline_parallel_size=stages, num_microbatches=microbatches, cut_at=FAMILIES["llama"].cut_at,
            partition="params", p2p_timeout=60.0, loss_weighting=weighting)
    else:
        strategy = "auto" if plain else "ddp"
    recorder = Recorder()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1 if plain else int(os.environ["LOCAL_WORLD_SIZE"]), strategy=strategy,
        max_steps=STEPS, accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[recorder],
        use_distributed_sampler=not plain,
    )
    model = PaddedLlama()
    trainer.fit(model, DataLoader(data, batch_size=batch, sampler=sampler))
    result = {"losses": recorder.losses, "grads": recorder.grads}
    if config in VALIDATED:
        loader = DataLoader(data[: STEPS * BATCH], batch_size=batch)  # in order: the same batches on every run
        result["val_loss"] = trainer.validate(model, loader, verbose=False)[0]["val_loss"]
    if kind == "varuna":
        topology = trainer.strategy.topology
        result.update(stage=topology.stage, replica=topology.replica)
    (out / f"{config}.rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main() -> None:
    torch.set_num_threads(1)
    out, configs = job_command_line(__doc__)
    rank = int(os.environ.get("RANK", "0"))
    for config in configs:
        faulthandler.dump_traceback_later(240, exit=True)
        try:
            run(out, config)
        except BaseException as err:  # noqa: BLE001 - recorded, then the process ends (others may be waiting)
            (out / f"{config}.rank{rank}.json").write_text(json.dumps(
                {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]}))
            print(f"token_loss {config} failed on rank {rank}: {err}", file=sys.stderr, flush=True)
            os._exit(1)
        finally:
            faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
