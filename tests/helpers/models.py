"""Small models and data shared by the correctness tests.

``TinyGPT`` is a deliberately small causal transformer that exercises what a pipeline strategy must
handle in ordinary user code: a parameter used directly in ``forward`` (``self.pos``), a causal mask built
from the input's shape, modules that return tuples, optionally tied input/output embeddings (a parameter
used on the first and the last stage), dropout, a torchmetrics metric, and a per-step LR scheduler.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset
from torchmetrics.classification import MulticlassAccuracy

from lightning_varuna import CutPoint

__all__ = ["RandomTokens", "SideValueGPT", "TinyGPT"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention written out by hand; returns ``(output, attention weights)``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head})")
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # The mask is built from the input's shape on every call (no registered buffer).
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = (q @ k.transpose(-2, -1)) * (k.size(-1) ** -0.5)
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        att = self.attn_drop(att)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.resid_drop(self.proj(y)), att


class Block(nn.Module):
    """Pre-norm transformer block: attention and MLP, each with a residual connection."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        y, _ = self.attn(self.ln_1(x))
        x = x + y
        return x + self.mlp(self.ln_2(x))


def _init_weights(module: nn.Module) -> None:
    # GPT-2 style: small normal weights, so that a tied head starts near the uniform loss log(vocab_size).
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class TinyGPT(pl.LightningModule):
    """A tiny causal language model for correctness tests.

    Args:
        vocab_size: Number of token ids.
        block_size: Longest sequence the model accepts (length of the position table).
        n_embd: Width of the residual stream.
        n_head: Number of attention heads; must divide ``n_embd``.
        n_layer: Number of transformer blocks.
        dropout: Dropout probability (attention, residual, MLP and embedding).
        tie_weights: Use the token embedding matrix as the output head (``F.linear(x, wte.weight)``).
        use_cut_points: Put a ``CutPoint`` after every block (``n_layer`` cut points, ``n_layer + 1``
            segments). Without them the model cannot be split.
        lr: AdamW learning rate.
        sync_dist: Log losses with ``sync_dist=True`` (mean over data-parallel replicas).
        head_alias: With ``tie_weights``, register the output head as ``lm_head`` sharing ``wte.weight`` (two
            ``state_dict`` keys for one tensor, as Hugging Face ties them) instead of using ``wte.weight`` in
            ``forward``.
        sinusoidal: Add a fixed sinusoidal position signal computed from a non-persistent buffer (built at
            construction, like a rotary cache).
        build_in_configure_model: Build the layers in ``configure_model`` instead of ``__init__``.
    """

    def __init__(
        self,
        vocab_size: int = 64,
        block_size: int = 16,
        n_embd: int = 32,
        n_head: int = 4,
        n_layer: int = 4,
        dropout: float = 0.0,
        tie_weights: bool = False,
        use_cut_points: bool = True,
        lr: float = 1e-3,
        sync_dist: bool = False,
        head_alias: bool = False,
        sinusoidal: bool = False,
        build_in_configure_model: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.val_acc = MulticlassAccuracy(num_classes=vocab_size, average="micro")
        if not build_in_configure_model:
            self._build()

    def configure_model(self) -> None:
        if self.hparams.build_in_configure_model and not hasattr(self, "blocks"):
            self._build()

    def _build(self) -> None:
        vocab_size, block_size, n_embd = self.hparams.vocab_size, self.hparams.block_size, self.hparams.n_embd
        n_head, n_layer, dropout = self.hparams.n_head, self.hparams.n_layer, self.hparams.dropout
        tie_weights, use_cut_points = self.hparams.tie_weights, self.hparams.use_cut_points
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Parameter(torch.randn(1, block_size, n_embd) * 0.02)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(n_layer)) if use_cut_points else None
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = None if tie_weights else nn.Linear(n_embd, vocab_size, bias=False)
        if tie_weights and self.hparams.head_alias:
            self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
            self.lm_head.weight = self.wte.weight
        if self.hparams.sinusoidal:
            self.register_buffer("inv_freq", 1.0 / 100.0 ** (torch.arange(0, n_embd, 2) / n_embd), persistent=False)
        self.apply(_init_weights)

    def forward(self, idx: Tensor) -> Tensor:
        """Return logits of shape ``(B, T, vocab_size)`` for token ids of shape ``(B, T)``."""
        _, T = idx.shape
        x = self.drop(self.wte(idx) + self.pos[:, :T])
        if self.hparams.sinusoidal:
            angles = torch.arange(T, device=idx.device)[:, None] * self.inv_freq
            x = x + torch.cat([angles.sin(), angles.cos()], dim=-1)
        for i, block in enumerate(self.blocks):
            x = block(x)
            if self.cuts is not None:
                x = self.cuts[i](x)
        x = self.ln_f(x)
        if self.lm_head is None:
            return F.linear(x, self.wte.weight)
        return self.lm_head(x)

    def _loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        idx, targets = batch
        logits = self(idx)
        loss = self._loss(logits, targets)
        self.log("train_loss", loss, prog_bar=True, sync_dist=self.hparams.sync_dist)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        idx, targets = batch
        logits = self(idx)
        self.log("val_loss", self._loss(logits, targets), prog_bar=True, sync_dist=self.hparams.sync_dist)
        self.val_acc.update(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        self.log("val_acc", self.val_acc, on_epoch=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        idx, targets = batch
        self.log("test_loss", self._loss(self(idx), targets), sync_dist=self.hparams.sync_dist)

    def predict_step(self, batch: Tensor | tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        idx = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(idx).argmax(dim=-1)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class PositionBias(nn.Module):
    """A learned bias per position (as T5's relative attention bias, made once and passed to every block)."""

    def __init__(self, block_size: int, n_embd: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(1, block_size, n_embd) * 0.02)

    def forward(self, length: int) -> Tensor:
        return self.table[:, :length] * 1.0


class SideBlock(Block):
    """A block that also takes two side values as keyword arguments: a bias added to its input, a gate on its output."""

    def forward(self, x: Tensor, *, bias: Tensor, gate: Tensor) -> Tensor:  # type: ignore[override]
        return super().forward(x + bias) * torch.sigmoid(gate)


class SideValueGPT(TinyGPT):
    """TinyGPT whose blocks all take values made in the first segment from parameters, as keyword arguments.

    ``position_bias`` (a learned table, the same for every sample) and ``gate`` (a linear map of the embeddings: it
    scales with the batch) are computed once before the first block and passed to every block; on a pipeline they
    must travel from the first stage to every later one, and their gradients back.
    """

    def _build(self) -> None:
        super()._build()
        n_embd, n_head, dropout = self.hparams.n_embd, self.hparams.n_head, self.hparams.dropout
        self.blocks = nn.ModuleList(SideBlock(n_embd, n_head, dropout) for _ in range(self.hparams.n_layer))
        self.position_bias = PositionBias(self.hparams.block_size, n_embd)
        self.gate = nn.Linear(n_embd, n_embd)
        self.blocks.apply(_init_weights)
        nn.init.normal_(self.gate.weight, std=0.5)

    def forward(self, idx: Tensor) -> Tensor:
        """Return logits of shape ``(B, T, vocab_size)`` for token ids of shape ``(B, T)``."""
        _, T = idx.shape
        x = self.drop(self.wte(idx) + self.pos[:, :T])
        bias, gate = self.position_bias(T), self.gate(x)
        for i, block in enumerate(self.blocks):
            x = block(x, bias=bias, gate=gate)
            if self.cuts is not None:
                x = self.cuts[i](x)
        return self.lm_head(self.ln_f(x))


class RandomTokens(Dataset):
    """Deterministic random token sequences: ``(idx, targets)`` with ``targets`` the next tokens.

    The data depend only on the arguments (a local ``torch.Generator`` is used, the global RNG is untouched).

    Args:
        n: Number of samples.
        block_size: Sequence length ``T`` of each sample.
        vocab_size: Tokens are drawn uniformly from ``[0, vocab_size)``.
        seed: Seed of the local generator.
    """

    def __init__(self, n: int = 64, block_size: int = 16, vocab_size: int = 64, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.data = torch.randint(vocab_size, (n, block_size + 1), generator=generator)

    def __len__(self) -> int:
        return self.data.size(0)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        row = self.data[i]
        return row[:-1], row[1:]


class LinearChain(nn.Module):
    """Three ``Linear(width, width)`` layers with a cut point between each two; the step is the output's squared
    mean (three segments, for stage-level tests)."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < 2:
                x = self.cuts[i](x)
        return x.pow(2).mean()
