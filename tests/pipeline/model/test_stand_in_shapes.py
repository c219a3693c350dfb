"""Stand-ins of modules whose shapes depend on values (mixtures of experts) never run them on meta tensors.

A tiny Hugging Face Mixtral (4 experts, top-2; transformers' default experts path, ``torch._grouped_mm``, whose meta
kernel takes bf16 only, and its eager path, ``nonzero``, which has no meta kernel) is dry-run as the engine does, its
first two blocks then stood in for as on stage 1 of P=2: a call the dry run saw (scaled to another micro-batch size)
is answered from its record without running anything, a call at another sequence length (dynamic padding) by the
forward on the placeholder weights, and neither changes the stage's RNG or buffers nor records autograd history.
The pipelined runs against the plain run are in ``tests/models/test_zoo.py`` (families ``mixtral``, ``mixtral_eager``,
``qwen3_moe``, ``olmoe``) and ``tests/models/test_moe_padding.py``.
"""

from __future__ import annotations

import pytest
import torch
from helpers.zoo_models import FAMILIES, build
from torch import Tensor, nn

from lightning_varuna.pipeline.model.call_shapes import CallRecord, autocast_state, describe_call, shape_rules
from lightning_varuna.pipeline.model.cut import install_cut_at
from lightning_varuna.pipeline.model.dry_run import trace_step
from lightning_varuna.pipeline.model.stand_ins import StandIn, free_parameter, install_stand_in, remove_stand_ins

CUT_AT = "model.layers"


class Wrapper(nn.Module):
    """The Hugging Face model as a LightningModule holds it (``self.model``)."""

    def __init__(self, family: str) -> None:
        super().__init__()
        self.model = build(FAMILIES[family])


def _loss(root: Wrapper, ids: Tensor) -> Tensor:
    return root.model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("family", ["mixtral", "mixtral_eager"])
def test_the_experts_are_stood_in_for_from_the_dry_run_or_on_placeholders_never_on_meta(family: str) -> None:
    root = Wrapper(family)
    cuts, hooks = install_cut_at(root.model, CUT_AT)
    torch.manual_seed(0)
    ids = torch.randint(3, 64, (4, 16))
    trace, _ = trace_step(root, lambda n: _loss(root, ids[:n]))
    blocks = {f"model.model.layers.{i}" for i in range(4)}
    assert blocks <= trace.not_on_meta and "model.model.embed_tokens" not in trace.not_on_meta
    assert blocks <= set(trace.call_shapes)
    for name, _ in list(root.named_parameters()):
        if name.startswith(("model.model.layers.0.", "model.model.layers.1.")):
            free_parameter(root, name)
    stand_ins = [StandIn(root.get_submodule(f"model.model.layers.{i}"), frozenset({2, 3}), lambda: 0,
                         torch.device("cpu"), trace.call_shapes[f"model.model.layers.{i}"], f"layers.{i}",
                         f"model.model.layers.{i}" not in trace.not_on_meta) for i in range(2)]
    ran: list[str] = []
    for stand_in in stand_ins:
        forward = stand_in.forward
        stand_in.forward = lambda *a, _f=forward, _n=stand_in.name, **k: (ran.append(_n), _f(*a, **k))[1]
        install_stand_in(stand_in)
    try:
        layer = root.model.model.layers[2]
        seen: list[tuple[int, ...]] = []
        handle = layer.register_forward_pre_hook(lambda m, args: seen.append(tuple(args[0].shape)))
        buffers = {n: b.clone() for n, b in root.named_buffers()}
        rng = torch.get_rng_state()
        with torch.no_grad():
            _loss(root, ids[:2])  # the dry run's sequence length, another batch size: from the record
            assert ran == [] and seen == [(2, 16, 32)]
            _loss(root, ids[:3, :11])  # another sequence length: on the placeholder weights
            assert ran == ["layers.0", "layers.1"] and seen[-1] == (3, 11, 32)
            _loss(root, ids[:3, :11])  # cached
            assert len(ran) == 2
        handle.remove()
        assert torch.equal(torch.get_rng_state(), rng)
        assert all(torch.equal(b, buffers[n]) for n, b in root.named_buffers())
    finally:
        remove_stand_ins(stand_ins)
        for hook in hooks:
            hook.remove()
        del cuts


class Picks(nn.Module):
    """Output shape from values alone (``nonzero``): no stand-in can know it without running it."""

    def forward(self, x: Tensor) -> Tensor:
        return x[x.sum(-1) > 0].sum(0, keepdim=True).expand(x.shape[0], -1) * 2


def test_a_module_that_fails_on_meta_halfway_is_run_on_placeholders_and_never_again_on_meta() -> None:
    """Without the dry run's verdict (a stand-in made by hand), the meta try's failure falls back once, for good."""
    module = Picks()
    stand_in = StandIn(module, frozenset({1}), lambda: 0, torch.device("cpu"), name="picks")
    install_stand_in(stand_in)
    out = module(torch.randn(5, 3))
    assert out.shape == (5, 3) and not stand_in.on_meta and not out.any()


def test_a_rule_scales_the_batch_dimensions_and_refuses_anything_else() -> None:
    def record(batch: int, length: int) -> CallRecord:
        x = torch.zeros(batch, length, 8)
        return CallRecord(describe_call(((x,), {"flag": True})), describe_call((x[..., :4], batch * length)),
                          autocast_state())

    rules = shape_rules([record(1, 16)], [record(2, 16)])
    assert rules == ()  # an output value that changes with the batch: no rule
    x1, x2 = torch.zeros(1, 16, 8), torch.zeros(2, 16, 8)
    one = [CallRecord(describe_call(((x1,), {"flag": True})), describe_call(x1[..., :4]), autocast_state())]
    two = [CallRecord(describe_call(((x2,), {"flag": True})), describe_call(x2[..., :4]), autocast_state())]
    (rule,) = shape_rules(one, two)
    assert rule.output((torch.zeros(6, 16, 8),), {"flag": True})[0] == [((6, 16, 4), torch.float32)]
    assert rule.output((torch.zeros(6, 12, 8),), {"flag": True}) is None  # another sequence length
    assert rule.output((torch.zeros(6, 16, 8),), {"flag": False}) is None
    assert rule.output((torch.zeros(6, 16, 8, dtype=torch.float64),), {"flag": True}) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert rule.output((torch.zeros(6, 16, 8),), {"flag": True}) is None  # other output dtypes possible
