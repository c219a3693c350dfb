"""Trains a tiny Mixtral (mixture of experts) on dynamically padded batches; records what happened.

    python tests/jobs/moe_padding.py OUT ref ref-eager                      # plain one-process references
    torchrun --nproc-per-node=2 tests/jobs/moe_padding.py OUT p2 p2-eager

Each batch is as long as its longest sample (4 to 16 tokens: the sequence length changes from step to step), padded
with -100 labels and a zero attention mask, the loss the model's own. A stage stands in for the experts of earlier
stages: their output shapes at a sequence length the dry run did not see cannot come from the dry run, nor from
meta tensors (the experts' grouped matrix products and ``nonzero`` have no meta kernel for them). Each configuration
writes ``OUT/CONFIG.rankR.json``: the loss of every step, every held parameter's gradient at step 1, the reference's
least router margin (``tests/helpers/zoo_models.py``), and how each stand-in of the rank got its shapes; or
``{"error": ...}``.
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
from helpers.zoo_models import FAMILIES, LR, SEQ, VOCAB, build, watch_routers  # noqa: E402

import lightning_varuna  # noqa: E402

STEPS = 8
BATCH = 8
DATA_SEED = 5
# configuration -> (pipelined, family)
CONFIGS = {"ref": (False, "mixtral"), "ref-eager": (False, "mixtral_eager"), "p2": (True, "mixtral"),
           "p2-eager": (True, "mixtral_eager")}


def dataset() -> list[Tensor]:
    """STEPS x BATCH samples of 4 to SEQ tokens (ids from 3: never the padding id)."""
    g = torch.Generator().manual_seed(DATA_SEED)
    lengths = torch.randint(4, SEQ + 1, (STEPS * BATCH,), generator=g)
    return [torch.randint(3, VOCAB, (int(n),), generator=g) for n in lengths]


def collate(samples: list[Tensor]) -> dict[str, Tensor]:
    """The batch padded to its longest sample, as a Hugging Face data collator pads."""
    longest = max(len(s) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for i, sample in enumerate(samples):
        ids[i, : len(sample)] = sample
        mask[i, : len(sample)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class PaddedMoE(pl.LightningModule):
    def __init__(self, family: str) -> None:
        super().__init__()
        self.model = build(FAMILIES[family])

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)


class Recorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grads: dict[str, list[float]] = {}
        self.lengths: list[int] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == 0:
            self.grads = {n: p.grad.detach().flatten().tolist()
                          for n, p in pl_module.named_parameters() if p.grad is not None}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        self.lengths.append(batch["input_ids"].shape[1])


def run(out: Path, config: str) -> None:
    pipelined, family = CONFIGS[config]
    data = dataset()
    sampler = None if pipelined else DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    strategy = lightning_varuna.VarunaStrategy(
        pipeline_parallel_size=2, num_microbatches=4, cut_at=FAMILIES[family].cut_at, partition="params",
        p2p_timeout=60.0, loss_weighting="shifted_tokens") if pipelined else "auto"
    recorder = Recorder()
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]) if pipelined else 1, strategy=strategy,
        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[recorder], use_distributed_sampler=pipelined,
    )
    model = PaddedMoE(family)
    margins = [] if pipelined else watch_routers(model)
    stand_ins: list = []
    if pipelined:  # read before teardown gives the modules their own forward back
        recorder.on_train_end = lambda trainer, module: stand_ins.extend(trainer.strategy.engine._stand_ins)
    trainer.fit(model, DataLoader(data, batch_size=BATCH, sampler=sampler, collate_fn=collate))
    result = {"losses": recorder.losses, "grads": recorder.grads, "lengths": recorder.lengths}
    if margins:
        result["router_margin"] = min(margins)
    if pipelined:
        result["stage"] = trainer.strategy.topology.stage
        result["stand_ins"] = {s.name: {"on_meta": s.on_meta, "rules": len(s.rules), "cached": len(s._cache)}
                               for s in stand_ins}
    (out / f"{config}.rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main() -> None:
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    for config in sys.argv[2:]:
        faulthandler.dump_traceback_later(240, exit=True)
        try:
            run(out, config)
        except BaseException as err:  # noqa: BLE001 - recorded, then the process ends (others may be waiting)
            (out / f"{config}.rank{rank}.json").write_text(json.dumps(
                {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]}))
            os._exit(1)
        finally:
            faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
