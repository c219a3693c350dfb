"""Byte-level text from the Python standard library's own source files: no download needed.

The corpus is the ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (``site-packages`` and
``__pycache__`` excluded), read in sorted order and cut at ``max_chars`` bytes, so it is the same on every
rank and every run with the same interpreter. Samples are windows of ``block_size + 1`` bytes at offsets
drawn once from a seeded generator.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def read_stdlib_bytes(max_chars: int) -> bytes:
    """Concatenate the standard library's ``.py`` files in sorted path order, up to ``max_chars`` bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)  # walk subfolders in sorted order
        for name in sorted(f for f in filenames if f.endswith(".py")):
            chunk = (Path(dirpath) / name).read_bytes() + b"\n"
            chunks.append(chunk)
            total += len(chunk)
            if total >= max_chars:
                return b"".join(chunks)[:max_chars]
    return b"".join(chunks)


class RandomWindows(Dataset):
    """``num_samples`` windows of a byte tensor at seeded random offsets, as ``(input, next-byte target)``."""

    def __init__(self, data: Tensor, block_size: int, num_samples: int, seed: int) -> None:
        if data.numel() <= block_size + 1:
            raise ValueError(f"{data.numel()} bytes are too few for windows of {block_size + 1}")
        self.data = data
        self.block_size = block_size
        generator = torch.Generator().manual_seed(seed)
        self.offsets = torch.randint(data.numel() - block_size, (num_samples,), generator=generator)

    def __len__(self) -> int:
        return self.offsets.numel()

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        start = int(self.offsets[i])
        window = self.data[start : start + self.block_size + 1].long()
        return window[:-1], window[1:]


class StdlibText(pl.LightningDataModule):
    """Byte-level (vocabulary 256) language-modelling data from the Python standard library's sources.

    Args:
        block_size: Sequence length of each sample.
        batch_size: Samples per batch (the global batch of one data-parallel replica; a pipeline strategy
            splits it into micro-batches).
        max_chars: Bytes of source text to use, taken from the start of the sorted file list.
        val_fraction: Fraction of the text, taken from its end, held out for validation.
        train_samples: Training windows per epoch.
        val_samples: Validation windows.
        num_workers: Data loader worker processes.
        seed: Seed of the window offsets (the validation set uses ``seed + 1``).
    """

    def __init__(
        self,
        block_size: int = 64,
        batch_size: int = 8,
        max_chars: int = 2_000_000,
        val_fraction: float = 0.1,
        train_samples: int = 20_000,
        val_samples: int = 512,
        num_workers: int = 0,
        seed: int = 1234,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_set: RandomWindows | None = None
        self.val_set: RandomWindows | None = None

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        data = torch.frombuffer(bytearray(read_stdlib_bytes(hp.max_chars)), dtype=torch.uint8)
        n_val = int(data.numel() * hp.val_fraction)
        train, val = data[: data.numel() - n_val], data[data.numel() - n_val :]
        self.train_set = RandomWindows(train, hp.block_size, hp.train_samples, hp.seed)
        self.val_set = RandomWindows(val, hp.block_size, hp.val_samples, hp.seed + 1)

    def train_dataloader(self) -> DataLoader:
        # The offsets are already random; no shuffling keeps the data order independent of global seeds.
        return self._loader(self.train_set)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set)

    def _loader(self, dataset: Dataset) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.hparams.batch_size,
            shuffle=False,
            num_workers=self.hparams.num_workers,
            drop_last=True,
        )
