"""Padded batches under the default ``loss_weighting="samples"``: the first step warns, naming ``loss_weighting``,
when the micro-batches count labels out of proportion to their samples; otherwise it says nothing."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_varuna import CutPoint, VarunaStrategy, VarunaWarning
from lightning_varuna.pipeline.batches import uneven_labels

VOCAB, T, B = 16, 6, 4


class TokenModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.cut = CutPoint()
        self.head = nn.Linear(8, VOCAB)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        logits = self.head(self.cut(self.emb(batch["input_ids"])))
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _batches(padded_rows: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    labels = ids.clone()
    labels[:padded_rows, T // 2:] = -100  # the first samples padded: the first micro-batch counts fewer labels
    return [{"input_ids": ids, "labels": labels}]


def _fit(padded_rows: int, **options) -> list[warnings.WarningMessage]:
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         strategy=VarunaStrategy(pipeline_parallel_size=1, num_microbatches=2, **options))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TokenModel(), DataLoader(_batches(padded_rows) * 2, batch_size=None))
    return [w for w in caught if issubclass(w.category, VarunaWarning) and "loss_weighting" in str(w.message)]


def test_uneven_labels_are_found_only_out_of_proportion_to_the_samples() -> None:
    cpu = torch.device("cpu")
    even = [{"labels": torch.ones(2, 4, dtype=torch.long)}, {"labels": torch.ones(1, 4, dtype=torch.long)}]
    assert uneven_labels(even, [2, 1], cpu) is None  # 8 and 4 labels for 2 and 1 samples
    padded = [{"labels": torch.tensor([[1, -100], [1, 1]])}, {"labels": torch.tensor([[1, 1], [1, 1]])}]
    assert uneven_labels(padded, [2, 2], cpu) == [3.0, 4.0]
    assert uneven_labels([{"x": torch.ones(2)}, {"x": torch.ones(2)}], [2, 2], cpu) is None  # no labels


def test_the_first_step_warns_once_when_padding_makes_samples_weighting_differ() -> None:
    caught = _fit(padded_rows=2)
    assert len(caught) == 1
    assert "loss_weighting='shifted_tokens'" in str(caught[0].message) and "6, 12 labels" in str(caught[0].message)


@pytest.mark.parametrize(("padded_rows", "options"), [(0, {}), (2, {"loss_weighting": "tokens"})])
def test_no_warning_without_padding_or_with_token_weighting(padded_rows: int, options: dict) -> None:
    assert _fit(padded_rows, **options) == []
