"""The backward split into an input-gradient pass (I) and held-back weight gradients (W), in one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_varuna.pipeline import Topology
from lightning_varuna.pipeline.comm.grad_sync import GradientSync
from lightning_varuna.pipeline.runtime.fused_linear_grad import (
    PendingWeightGrads,
    WeightGradWork,
    accumulating_in_place,
    held_weight_grad_work,
    holding_weight_grads,
    install_grad_accumulation,
)
from tests.pipeline.comm.test_grad_sync import launches  # noqa: F401 - the fixture


class TiedMLP(nn.Module):
    """An embedding whose weight the output layer reuses, two linear layers, a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8))
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens)))


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    tokens = torch.randint(0, 10, (3, 5), generator=torch.Generator().manual_seed(seed))
    return model(tokens).square().mean()


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_input_grad_pass_holds_linear_weight_grads_back_and_w_adds_them_exactly() -> None:
    torch.manual_seed(0)
    plain, split = TiedMLP(), TiedMLP()
    split.load_state_dict(plain.state_dict())
    install_grad_accumulation(split)
    for seed in range(3):
        _loss(plain, seed).backward()

    pending = PendingWeightGrads()
    works = []
    for seed in range(3):
        work = WeightGradWork(pending)
        with accumulating_in_place(), holding_weight_grads(work):
            _loss(split, seed).backward()
        works.append(work)
        if seed == 0:  # the linear layers' weights got nothing yet; biases, the norm and the embedding did
            assert split.body[0].weight.grad is None and split.body[2].weight.grad is None
            assert split.body[0].bias.grad is not None and split.body[3].weight.grad is not None
    held = [split.body[0].weight, split.body[2].weight, split.head.weight]
    assert all(p in pending for p in held) and split.body[0].bias not in pending
    assert sum(len(w.items) for w in works) == 9
    final = [works[0].run(), works[1].run(), works[2].run()]
    assert final[:2] == [[], []] and {id(p) for p in final[2]} == {id(p) for p in held}
    assert not any(p in pending for p in held)
    want, got = _grads(plain), _grads(split)
    assert want.keys() == got.keys()
    for name in want:  # fp32 sums in another order: a few ulps of gradients up to ~7 (a lost term is ~30%)
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6, msg=name)


def test_a_weight_with_a_gradient_hook_is_computed_in_the_pass() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    install_grad_accumulation(model)
    seen = []
    model[0].weight.register_hook(lambda g: seen.append(g.clone()))
    work = WeightGradWork(PendingWeightGrads())
    with accumulating_in_place(), holding_weight_grads(work):
        model(torch.randn(2, 4)).sum().backward()
    assert [p is model[1].weight for p, _, _ in work.items] == [True]
    assert model[0].weight.grad is not None and len(seen) == 1


def test_outside_the_engines_backward_nothing_is_held_back() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    install_grad_accumulation(model)
    work = WeightGradWork(PendingWeightGrads())
    with holding_weight_grads(work):  # no accumulating_in_place: not the engine's own backward
        model(torch.randn(2, 4)).sum().backward()
    assert not work.items and model[0].weight.grad is not None


class _ScaleOp(torch.autograd.Function):
    """``x * w`` whose backward holds ``w``'s gradient back when it may (the custom-layer protocol)."""

    calls: list[str] = []

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, param: nn.Parameter) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(x, w)
        ctx.param = param
        return x * w

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: ANN001, ANN205
        x, w = ctx.saved_tensors
        work = held_weight_grad_work(ctx, ctx.param, 1)

        def weight_grad() -> torch.Tensor:
            _ScaleOp.calls.append("W")
            return (g * x).sum(0)

        _ScaleOp.calls.append("I")
        if work is not None:
            work.hold_computed(ctx.param, weight_grad)
            return g * w, None, None
        return g * w, weight_grad(), None


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 2.0, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ScaleOp.apply(x, self.w, self.w)


def test_a_custom_layer_holds_its_weight_grad_back_and_w_adds_it_exactly() -> None:
    torch.manual_seed(0)
    plain, split = nn.Sequential(_Scale(), nn.Linear(4, 2)), nn.Sequential(_Scale(), nn.Linear(4, 2))
    split.load_state_dict(plain.state_dict())
    inputs = [torch.randn(3, 4) for _ in range(2)]
    for x in inputs:
        plain(x).square().sum().backward()
    _ScaleOp.calls.clear()
    pending = PendingWeightGrads()
    works = []
    for x in inputs:
        work = WeightGradWork(pending)
        with accumulating_in_place(), holding_weight_grads(work):
            split(x).square().sum().backward()
        works.append(work)
    assert _ScaleOp.calls == ["I", "I"] and split[0].w.grad is None and split[0].w in pending
    assert [len(w.computed) for w in works] == [1, 1]
    assert works[0].run() == [] and [id(p) for p in works[1].run()] == [id(split[0].w)]
    assert _ScaleOp.calls == ["I", "I", "W", "W"] and split[0].w not in pending
    torch.testing.assert_close(split[0].w.grad, plain[0].w.grad, rtol=0, atol=1e-6)
    # outside the engine's I pass the gradient is computed in the backward, as autograd does
    _ScaleOp.calls.clear()
    split(inputs[0]).sum().backward()
    assert _ScaleOp.calls == ["I", "W"]


@pytest.mark.usefixtures("launches")
def test_buckets_wait_for_held_back_weight_grads_and_start_in_order(launches) -> None:  # noqa: F811
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    install_grad_accumulation(model)
    topo = Topology(world_size=2, rank=0, pipeline_size=1, device=torch.device("cpu"), data_group="data")
    # buckets (reverse order): [2.bias, 2.weight, 1.bias], [1.weight, 0.bias], [0.weight]
    sync = GradientSync(topo, dict(model.named_parameters()), [], bucket_bytes=72 * 4)
    reference = [p.detach().clone() for p in model.parameters()]
    pending = PendingWeightGrads()
    work = WeightGradWork(pending)
    with sync.overlapping(held_back=pending) as release:
        with accumulating_in_place(), holding_weight_grads(work):
            model(torch.randn(3, 4)).square().sum().backward()
        assert launches == []  # every bucket holds a linear weight whose gradient is held back
        final = work.run()
        release(final[:1])  # 2.weight: the first bucket is complete
        assert len(launches) == 1
        release(final[1:])
        assert len(launches) == 3
    sync.finish()
    assert sync.overlapped_buckets == 3
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), reference, strict=True))
