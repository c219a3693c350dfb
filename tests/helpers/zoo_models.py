"""Third-party architectures for the model zoo tests: tiny configurations built in code, never downloaded.

Each family is one :class:`Family`: a builder that returns the third-party model (Hugging Face ``transformers``
or ``litgpt``) with its configuration written here, every dropout 0, its weights from ``torch.manual_seed(SEED)``;
the dotted ``cut_at`` path of its block list (from the LightningModule, whose ``self.model`` is the third-party
model); what its batches look like and how its loss is computed. :class:`ZooModule` wraps any of them; the
model is built in ``__init__`` or, with ``build="configure_model"``, in ``configure_model()`` (parameters on
meta under ``VarunaStrategy``, weights then loaded per stage from ``initial_weights``).

Attention: Hugging Face models use ``attn_implementation="eager"`` (every family has it, it is deterministic on
CPU and its meta dry run needs no fused-kernel formula); litgpt uses its own (SDPA).

Labels: the models' own losses with labels for every token (no ``-100``): every micro-batch then has the same
number of counted tokens, and the engine's weighting of micro-batch means by sample count equals the plain
run's mean over the batch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset

SEED = 0
DATA_SEED = 1
VOCAB = 64
SEQ = 16
LAYERS = 4  # P=4 puts one block on each stage
WIDTH = 32
HEADS = 4
FFN = 64
IMAGE = 16
CLASSES = 10
LR = 1e-2
STEPS = 8
BATCH = 8  # global batch per step; the data set holds STEPS batches
ROUTER_COEF = 0.5  # of the mixtures of experts trained with their router loss
# their weights: the references' least top-k router logit gap is 6.2e-5 with 4 micro-batches (D=1 and 2 x 2) and
# 2.1e-5 with 8; seed 0 leaves 4.9e-6 with 2 x 2 (a near tie), seeds 1-8 each below 1e-5 somewhere but 6
ROUTER_SEED = 9
QWEN3_MOE_ROUTER_SEED = 0  # least gaps 6.8e-5 (4 micro-batches) and 2.3e-5 (2 x 2)
OLMOE_ROUTER_SEED = 3  # 1.9e-5 in both; seed 0 leaves 5.9e-6 with 2 x 2

_NO_DROPOUT = {"attention_dropout": 0.0, "hidden_dropout": 0.0}


@dataclass(frozen=True)
class Family:
    """A third-party architecture: how to build it, where to cut it, what it eats."""

    name: str
    build: Callable[[], nn.Module]  # the model, weights from the current RNG state
    cut_at: str | tuple[str, ...]  # from the LightningModule (the model is its ``model`` attribute); several lists
    kind: str  # causal | masked | seq2seq | image | litgpt
    ties: bool  # the model ties its output head to its input embedding (its default, kept)
    notes: str = ""
    extra: dict = field(default_factory=dict)
    seed: int = SEED  # of the weights; a mixture of experts takes one whose routing has no near tie


def _hf(config_class: str, model_class: str, **config) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        cfg = getattr(transformers, config_class)(**config)
        cfg._attn_implementation = "eager"
        return getattr(transformers, model_class)(cfg)

    return build


_DECODER = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=FFN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=64,
                attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)


# mixture-of-experts: 4 experts, top-2, no router loss (output_router_logits=False, the default); transformers'
# default experts path (grouped_mm), or with experts_implementation="eager" its loop over the experts hit (nonzero)
_MOE = dict(_DECODER, num_experts_per_tok=2, output_router_logits=False, router_jitter_noise=0.0)

# the same with the router loss (the model's loss adds router_aux_loss_coef * aux_loss)
_ROUTER = dict(_MOE, output_router_logits=True, router_aux_loss_coef=ROUTER_COEF)

_T5 = _hf("T5Config", "T5ForConditionalGeneration", vocab_size=VOCAB, d_model=WIDTH, d_kv=8, d_ff=FFN,
          num_layers=LAYERS, num_decoder_layers=2, num_heads=HEADS, dropout_rate=0.0, decoder_start_token_id=0,
          pad_token_id=0, eos_token_id=1)


_BART = _hf("BartConfig", "BartForConditionalGeneration", vocab_size=VOCAB, d_model=WIDTH, encoder_layers=2,
            decoder_layers=LAYERS, encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
            decoder_ffn_dim=FFN, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
            max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2,
            forced_eos_token_id=None)


def _litgpt(**config) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from litgpt import Config
        from litgpt.model import GPT

        return GPT(Config(block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=LAYERS, n_head=HEADS,
                          n_embd=WIDTH, **config))

    return build


FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("gpt2", _hf("GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_positions=64, n_embd=WIDTH,
                       n_layer=LAYERS, n_head=HEADS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                       bos_token_id=1, eos_token_id=2),
           "model.transformer.h", "causal", ties=True),
    Family("llama", _hf("LlamaConfig", "LlamaForCausalLM", **_DECODER), "model.model.layers", "causal", ties=False),
    Family("mistral", _hf("MistralConfig", "MistralForCausalLM", **_DECODER, sliding_window=None),
           "model.model.layers", "causal", ties=False),
    Family("qwen2", _hf("Qwen2Config", "Qwen2ForCausalLM", **_DECODER), "model.model.layers", "causal", ties=False),
    Family("mixtral", _hf("MixtralConfig", "MixtralForCausalLM", **_MOE, num_local_experts=4, sliding_window=None),
           "model.model.layers", "causal", ties=False, notes="MoE: 4 experts, top-2, experts by grouped_mm"),
    # 8 blocks: two chunks per rank at P=4
    Family("mixtral_deep", _hf("MixtralConfig", "MixtralForCausalLM", **{**_MOE, "num_hidden_layers": 8},
                               num_local_experts=4, sliding_window=None),
           "model.model.layers", "causal", ties=False, notes="MoE: 8 blocks, 4 experts, top-2, experts by grouped_mm",
           seed=3),  # seed 0 routes with a near tie (logit gap 3.7e-7); 3 leaves 3.0e-5
    # the router loss (output_router_logits=True): every layer's router logits are read by the loss code on the last
    # stage; its coefficient large enough that a router gradient left out or wrong fails the gradient comparison
    Family("mixtral_router", _hf("MixtralConfig", "MixtralForCausalLM", **_ROUTER, num_local_experts=4,
                                 sliding_window=None),
           "model.model.layers", "causal", ties=False, notes="MoE with the router loss: the model's own `loss`",
           extra={"router_loss": "model"}, seed=ROUTER_SEED),
    Family("mixtral_router_step", _hf("MixtralConfig", "MixtralForCausalLM", **_ROUTER, num_local_experts=4,
                                      sliding_window=None),
           "model.model.layers", "causal", ties=False,
           notes="MoE with the router loss: the step adds `router_aux_loss_coef * out.aux_loss` itself",
           extra={"router_loss": "step"}, seed=ROUTER_SEED),
    Family("mixtral_eager", _hf("MixtralConfig", "MixtralForCausalLM", **_MOE, num_local_experts=4,
                                sliding_window=None, experts_implementation="eager"),
           "model.model.layers", "causal", ties=False, notes="MoE: 4 experts, top-2, eager experts loop"),
    Family("qwen3_moe", _hf("Qwen3MoeConfig", "Qwen3MoeForCausalLM", **_MOE, head_dim=8, num_experts=4,
                            moe_intermediate_size=FFN, norm_topk_prob=True),
           "model.model.layers", "causal", ties=False, notes="MoE: 4 experts, top-2"),
    Family("olmoe", _hf("OlmoeConfig", "OlmoeForCausalLM", **_MOE, num_experts=4), "model.model.layers", "causal",
           ties=False, notes="MoE: 4 experts, top-2"),
    Family("qwen3_moe_router", _hf("Qwen3MoeConfig", "Qwen3MoeForCausalLM", **_ROUTER, head_dim=8, num_experts=4,
                                   moe_intermediate_size=FFN, norm_topk_prob=True),
           "model.model.layers", "causal", ties=False, notes="MoE with the router loss: the model's own `loss`",
           extra={"router_loss": "model"}, seed=QWEN3_MOE_ROUTER_SEED),
    Family("olmoe_router", _hf("OlmoeConfig", "OlmoeForCausalLM", **_ROUTER, num_experts=4), "model.model.layers",
           "causal", ties=False, notes="MoE with the router loss: the model's own `loss`",
           extra={"router_loss": "model"}, seed=OLMOE_ROUTER_SEED),
    Family("qwen3", _hf("Qwen3Config", "Qwen3ForCausalLM", **_DECODER, head_dim=8), "model.model.layers", "causal",
           ties=False),
    Family("gemma", _hf("GemmaConfig", "GemmaForCausalLM", **_DECODER, head_dim=8,
                        hidden_activation="gelu_pytorch_tanh"), "model.model.layers", "causal", ties=True),
    Family("gemma2", _hf("Gemma2Config", "Gemma2ForCausalLM", **_DECODER, head_dim=8,
                         hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=8, sliding_window=8),
           "model.model.layers", "causal", ties=True),
    Family("phi3", _hf("Phi3Config", "Phi3ForCausalLM", **_DECODER, resid_pdrop=0.0, embd_pdrop=0.0),
           "model.model.layers", "causal", ties=False),
    Family("gpt_neox", _hf("GPTNeoXConfig", "GPTNeoXForCausalLM", vocab_size=VOCAB, hidden_size=WIDTH,
                           intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                           max_position_embeddings=64, attention_dropout=0.0, hidden_dropout=0.0,
                           bos_token_id=1, eos_token_id=2),
           "model.gpt_neox.layers", "causal", ties=False),
    Family("opt", _hf("OPTConfig", "OPTForCausalLM", vocab_size=VOCAB, hidden_size=WIDTH, ffn_dim=FFN,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS, max_position_embeddings=64,
                      word_embed_proj_dim=WIDTH, dropout=0.0, attention_dropout=0.0, layerdrop=0.0,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2),
           "model.model.decoder.layers", "causal", ties=True),
    Family("bloom", _hf("BloomConfig", "BloomForCausalLM", vocab_size=VOCAB, hidden_size=WIDTH, n_layer=LAYERS,
                        n_head=HEADS, **_NO_DROPOUT, pad_token_id=0, bos_token_id=1, eos_token_id=2),
           "model.transformer.h", "causal", ties=True),
    Family("falcon", _hf("FalconConfig", "FalconForCausalLM", vocab_size=VOCAB, hidden_size=WIDTH,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, max_position_embeddings=64,
                         **_NO_DROPOUT, bos_token_id=1, eos_token_id=2),
           "model.transformer.h", "causal", ties=True),
    Family("bert", _hf("BertConfig", "BertForMaskedLM", vocab_size=VOCAB, hidden_size=WIDTH,
                       num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
                       max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       pad_token_id=0),
           "model.bert.encoder.layer", "masked", ties=True),
    # two block lists (encoder and decoder): cut_at names the encoder's only (the decoder stays whole on the last
    # stage, where the encoder's output arrives through the last cut), or both (t5_stacks: the encoder's output and
    # the decoder's position biases travel as side values)
    Family("t5", _T5, "model.encoder.block", "seq2seq", ties=True, notes="cut_at: encoder blocks only"),
    Family("t5_stacks", _T5, ("model.encoder.block", "model.decoder.block"), "seq2seq", ties=True,
           notes="cut_at: encoder and decoder blocks"),
    # BART's encoder has no norm after its last block: its output reaches the decoder's blocks as the last encoder
    # cut's output itself (P=6: one decoder block per stage)
    Family("bart_stacks", _BART, ("model.model.encoder.layers", "model.model.decoder.layers"), "seq2seq", ties=True,
           notes="cut_at: encoder and decoder blocks"),
    Family("vit", _hf("ViTConfig", "ViTForImageClassification", image_size=IMAGE, patch_size=4, num_channels=3,
                      hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=CLASSES),
           "model.vit.layers", "image", ties=False),
    Family("litgpt", _litgpt(bias=True, rotary_percentage=0.25, parallel_residual=True),
           "model.transformer.h", "litgpt", ties=False),
    Family("litgpt_llama", _litgpt(n_query_groups=2, rotary_percentage=1.0, parallel_residual=False, bias=False,
                                   norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=FFN),
           "model.transformer.h", "litgpt", ties=False),
]}


def build(family: Family) -> nn.Module:
    """The family's model, always with the same weights (under meta: the same shapes)."""
    torch.manual_seed(family.seed)
    return family.build()


def dataset(family: Family) -> TensorDataset:
    """STEPS x BATCH samples, the same for every run (fixed seed)."""
    g = torch.Generator().manual_seed(DATA_SEED)
    n = STEPS * BATCH
    if family.kind == "image":
        return TensorDataset(torch.randn(n, 3, IMAGE, IMAGE, generator=g), torch.randint(0, CLASSES, (n,), generator=g))
    if family.kind == "seq2seq":
        return TensorDataset(torch.randint(3, VOCAB, (n, SEQ), generator=g),
                             torch.randint(3, VOCAB, (n, SEQ // 2), generator=g))
    if family.kind == "masked":
        labels = torch.randint(3, VOCAB, (n, SEQ), generator=g)
        masked = torch.rand(n, SEQ, generator=g) < 0.15
        return TensorDataset(torch.where(masked, torch.full_like(labels, 2), labels), labels)
    if family.kind == "litgpt":
        return TensorDataset(torch.randint(0, VOCAB, (n, SEQ + 1), generator=g))
    return TensorDataset(torch.randint(0, VOCAB, (n, SEQ), generator=g))


def save_weights(family: Family, folder: Path) -> None:
    """The weights ``build`` makes, as a Hugging Face folder (``save_pretrained``; litgpt: ``model.safetensors``)."""
    model = build(family)
    if family.kind == "litgpt":
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors")
    else:
        model.save_pretrained(folder)


LORA_TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}
"""The modules LoRA adapts, per family that runs with adapters."""


def with_variant(model: nn.Module, family: str, variant: str | None) -> nn.Module:
    """The model as a variant runs it: ``"lora"`` (peft adapters, base frozen), ``"checkpointing"`` (Hugging Face's
    own ``gradient_checkpointing_enable()``), or as built."""
    if variant == "checkpointing":
        model.gradient_checkpointing_enable()
    elif variant == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                 target_modules=LORA_TARGETS[family]))
        generator = torch.Generator().manual_seed(SEED + 1)
        for name, param in model.named_parameters():  # peft starts B at zero: A would get no gradient at step 1
            if "lora_B" in name:
                with torch.no_grad():
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def variant_cut_at(cut_at: str | tuple[str, ...], variant: str | None) -> str | tuple[str, ...]:
    """The block lists' paths once the variant wrapped the model (peft puts it under ``base_model.model``)."""
    if variant != "lora":
        return cut_at
    moved = tuple(path.replace("model.", "model.base_model.model.", 1) for path in block_lists(cut_at))
    return moved[0] if isinstance(cut_at, str) else moved


def block_lists(cut_at: str | tuple[str, ...]) -> tuple[str, ...]:
    """The paths of a ``cut_at`` value."""
    return (cut_at,) if isinstance(cut_at, str) else cut_at


class ZooModule(pl.LightningModule):
    """Any family as a LightningModule: ``self.model`` is the third-party model, the loss its own."""

    def __init__(self, family: str, build_in: str = "init", variant: str | None = None,
                 compile_backend: str | None = None) -> None:
        super().__init__()
        self.family = FAMILIES[family]
        self.model: nn.Module | None = None
        self.compile_backend = compile_backend  # of a model built in configure_model: its blocks compiled there
        self.split: list[Tensor] | None = None
        """The reference of a loss that is not a mean over samples (the router loss): each batch's micro-batches
        (sample indices) as the pipelined run splits it, their losses weighted by size (see :meth:`training_step`)."""
        if build_in == "init":
            self.model = with_variant(build(self.family), family, variant)

    def configure_model(self) -> None:
        if self.model is None:  # under VarunaStrategy: parameters on meta
            self.model = build(self.family)
            if self.compile_backend is not None:  # as torchtitan does: each block in place, where it is built
                for path in block_lists(self.family.cut_at):
                    for block in self.get_submodule(path):
                        block.compile(backend=self.compile_backend)

    def training_step(self, batch, batch_idx: int) -> Tensor:
        if self.split is None:
            loss, router = self._losses(batch)
        else:  # as gradient accumulation over the same micro-batches computes
            parts = [(len(index) / len(batch[0]), self._losses([t[index] for t in batch])) for index in self.split]
            loss = sum(weight * part_loss for weight, (part_loss, _) in parts)
            router = sum(weight * part_router for weight, (_, part_router) in parts) if parts[0][1][1] is not None \
                else None
        self.log("train_loss", loss, sync_dist=True)  # under D > 1 the mean over the replicas, as the plain run
        if router is not None:
            self.log("router_loss", router, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx: int) -> Tensor:
        """The logits (for a token model, of every position)."""
        kind = self.family.kind
        if kind == "image":
            return self.model(pixel_values=batch[0]).logits
        if kind == "litgpt":
            return self.model(batch[0][:, :-1])
        return self.model(input_ids=batch[0]).logits

    def _losses(self, batch) -> tuple[Tensor, Tensor | None]:
        """The step's loss, and the router loss where the family trains with one (``extra["router_loss"]``)."""
        router_loss = self.family.extra.get("router_loss")
        if router_loss is None:
            return self._loss(batch), None
        (ids,) = batch
        if router_loss == "model":  # the model's own loss: its cross-entropy plus router_aux_loss_coef * aux_loss
            out = self.model(input_ids=ids, labels=ids)
            return out.loss, out.aux_loss
        out = self.model(input_ids=ids)  # no labels: the step adds the router loss itself
        logits = out.logits[:, :-1].float()
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        return loss + self.model.config.router_aux_loss_coef * out.aux_loss, out.aux_loss

    def _loss(self, batch) -> Tensor:
        kind = self.family.kind
        if kind == "image":
            pixels, labels = batch
            return F.cross_entropy(self.model(pixel_values=pixels).logits, labels)
        if kind == "litgpt":
            (tokens,) = batch
            logits = self.model(tokens[:, :-1])
            return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        if kind in ("seq2seq", "masked"):
            ids, labels = batch
            return self.model(input_ids=ids, labels=labels).loss
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=LR)


def watch_routers(model: nn.Module) -> list[float]:
    """Records, per call of a mixture of experts' top-k router, the least gap between the logits of the k-th
    chosen expert and the best expert not chosen (the reference's routing is far from a tie when it is large).

    Tokens whose logits are all equal are left out: their hidden state is exactly zero (the padding token's zero
    embedding, at the first position, attends to itself only), so every expert gives them zero and its gradients
    zero, whichever is chosen.
    """
    margins: list[float] = []

    def hook(router, args, output) -> None:
        logits = output[0].detach().float().flatten(0, -2)
        logits = logits[logits.amax(-1) != logits.amin(-1)]
        if len(logits):
            top = logits.topk(router.top_k + 1, dim=-1).values
            margins.append(float((top[..., -2] - top[..., -1]).min()))

    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.register_forward_hook(hook)
    return margins


def describe() -> str:
    """The families as JSON (name, cut_at, kind, ties), for the table generator."""
    return json.dumps({n: {"cut_at": f.cut_at, "kind": f.kind, "ties": f.ties, "notes": f.notes}
                       for n, f in FAMILIES.items()})
