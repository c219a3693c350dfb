"""A GPT-style causal language model, split into pipeline stages by ``CutPoint`` modules.

The model is ordinary Lightning code. The only pipeline-specific lines are the ``CutPoint`` modules called
after each block: ``lightning_varuna.VarunaStrategy`` may split the model at any of them and is a plain
identity otherwise, so the same module trains unchanged with any other strategy.

The layers are built in ``configure_model``, as for Lightning's model-parallel strategies: under
``VarunaStrategy`` their parameters are created on the meta device (no memory), and each pipeline stage
materializes and initializes only its own, with :func:`init_weights` (``param_init_fn`` in ``config.yaml``).
Under any other strategy they are built for real and :func:`init_weights` runs on them here.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_varuna import CutPoint


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (PyTorch's fused ``scaled_dot_product_attention``)."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd, bias=bias),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd, bias=bias),
            nn.Dropout(dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def init_weights(module: nn.Module) -> None:
    """GPT-2's initialization of the parameters ``module`` owns directly (``VarunaStrategy(param_init_fn=...)``).

    Linear and embedding weights are normal with std 0.02, or the module's ``init_std`` (the residual output
    projections: ``0.02 / sqrt(2 * n_layer)``); biases are zero; layer norms start as identities.
    """
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=getattr(module, "init_std", 0.02))
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.LayerNorm):
        module.reset_parameters()


class GPT(pl.LightningModule):
    """GPT-style language model with a cut point after every transformer block.

    Args:
        vocab_size: Number of token ids (256 for the byte-level data module).
        block_size: Longest sequence the model accepts. ``train.py`` links it to ``data.block_size``.
        n_layer: Number of transformer blocks; the model has ``n_layer`` cut points, so up to
            ``n_layer + 1`` pipeline stages.
        n_head: Number of attention heads; must divide ``n_embd``.
        n_embd: Width of the residual stream.
        dropout: Dropout probability (embeddings, attention, residual and MLP).
        bias: Use biases in linear layers and LayerNorms.
        tie_weights: Share the token embedding matrix with the output head. Under pipeline parallelism
            the two uses land on the first and the last stage.
        learning_rate: Peak AdamW learning rate.
        weight_decay: AdamW weight decay, applied to matrices only (not to biases, norms or embeddings).
        betas: AdamW betas.
        warmup_steps: Steps of linear learning-rate warm-up, then constant.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 64,
        dropout: float = 0.1,
        bias: bool = True,
        tie_weights: bool = True,
        learning_rate: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 10,
    ) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head})")
        self.save_hyperparameters()

    def configure_model(self) -> None:
        """Builds the layers (once: Lightning may call this hook again, e.g. for ``trainer.validate``)."""
        if hasattr(self, "blocks"):
            return
        hp = self.hparams
        self.wte = nn.Embedding(hp.vocab_size, hp.n_embd)
        self.wpe = nn.Embedding(hp.block_size, hp.n_embd)
        self.drop = nn.Dropout(hp.dropout)
        self.blocks = nn.ModuleList(Block(hp.n_embd, hp.n_head, hp.dropout, hp.bias) for _ in range(hp.n_layer))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(hp.n_layer))
        self.ln_f = nn.LayerNorm(hp.n_embd, bias=hp.bias)
        self.lm_head = None if hp.tie_weights else nn.Linear(hp.n_embd, hp.vocab_size, bias=False)
        for block in self.blocks:  # GPT-2: the residual output projections start smaller
            block.attn.proj.init_std = block.mlp[2].init_std = 0.02 / math.sqrt(2 * hp.n_layer)
        self.apply(init_weights)  # nothing to do on the meta device: the strategy initializes each stage

    def forward(self, idx: Tensor) -> Tensor:
        """Return logits of shape ``(B, T, vocab_size)`` for token ids of shape ``(B, T)``."""
        T = idx.size(1)
        if T > self.hparams.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.hparams.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block, cut in zip(self.blocks, self.cuts, strict=True):
            x = cut(block(x))
        x = self.ln_f(x)
        if self.lm_head is None:
            return F.linear(x, self.wte.weight)
        return self.lm_head(x)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        idx, targets = batch
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        # Decay matrices only; biases, norms and the embeddings (the tied head included) are not decayed.
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if p.requires_grad:
                skip = p.dim() < 2 or name.startswith(("wte.", "wpe."))
                (no_decay if skip else decay).append(p)
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.hparams.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.hparams.learning_rate,
            betas=self.hparams.betas,
        )
        warmup = max(1, self.hparams.warmup_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
