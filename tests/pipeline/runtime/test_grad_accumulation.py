"""Linear layers' weight gradients accumulated in place across micro-batches (pipeline/runtime/fused_linear_grad.py)."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_varuna.pipeline import CutPoint, EngineConfig, PipelineEngine
from lightning_varuna.pipeline.model.stand_ins import free_parameter
from lightning_varuna.pipeline.runtime.fused_linear_grad import (
    MIN_FUSED_NUMEL,
    accumulating_in_place,
    install_grad_accumulation,
    remove_grad_accumulation,
)

MICROBATCHES = 4


class _TiedNet(nn.Module):
    """An embedding whose weight is also the output head's, between two biased linear layers and one without."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(16, 8)
        self.up = nn.Linear(8, 32)
        self.down = nn.Linear(32, 8, bias=False)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: Tensor) -> Tensor:
        x = self.wte(idx)
        return self.head(x + self.down(torch.nn.functional.gelu(self.up(x))))


class _WeightShapedOutputs(TorchDispatchMode):
    """Records the ops that make a new tensor of one of ``shapes`` (in-place ops and aliases make none)."""

    def __init__(self, shapes: set[tuple[int, ...]]) -> None:
        super().__init__()
        self.shapes, self.ops = shapes, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        fresh = not schema.is_mutable and func is not torch.ops.aten.detach.default
        for value in out if isinstance(out, (tuple, list)) else [out]:
            if fresh and isinstance(value, Tensor) and tuple(value.shape) in self.shapes:
                self.ops.append(schema.name)
        return out


def _batches() -> list[Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(16, (3, 5), generator=generator) for _ in range(MICROBATCHES)]


def _train(model: _TiedNet) -> list[tuple[list[str], int]]:
    """Per micro-batch: the ops of its backward that made an ``up``/``down``-shaped tensor, the gradient's storage."""
    seen = []
    for idx in _batches():
        loss = model(idx).logsumexp(-1).sum()
        mode = _WeightShapedOutputs({tuple(model.up.weight.shape), tuple(model.down.weight.shape)})
        with mode, accumulating_in_place():
            loss.backward()
        seen.append((mode.ops, model.up.weight.grad.untyped_storage().data_ptr()))
    return seen


def test_accumulated_gradients_equal_autograds_for_biased_unbiased_and_tied_weights() -> None:
    torch.manual_seed(0)
    model = _TiedNet()
    reference = copy.deepcopy(model)
    _train(reference)
    changed = install_grad_accumulation(model)
    assert set(changed) == {model.up, model.down, model.head}
    _train(model)
    for (name, param), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        # the same sums in another order: equal to fp32 rounding of the gradient's scale
        scale = expected.grad.abs().max().item()
        torch.testing.assert_close(param.grad, expected.grad, rtol=1e-6, atol=1e-6 * scale, msg=name)


def test_no_weight_sized_gradient_is_made_after_the_first_microbatch() -> None:
    torch.manual_seed(0)
    model = _TiedNet()
    # the detector sees autograd's temporaries: every micro-batch makes both weights' gradients anew
    plain = _train(copy.deepcopy(model))
    assert all(ops.count("aten::mm") == 2 for ops, _ in plain), plain
    install_grad_accumulation(model)
    fused = _train(model)
    assert fused[0][0].count("aten::mm") == 2  # the first micro-batch's gradients become .grad
    assert [ops for ops, _ in fused[1:]] == [[]] * (MICROBATCHES - 1)
    assert len({storage for _, storage in fused}) == 1  # one buffer, written in place by every micro-batch


def test_post_accumulate_grad_hooks_see_every_backward_as_with_autograd() -> None:
    torch.manual_seed(0)
    model = _TiedNet()
    install_grad_accumulation(model)
    calls: dict[str, int] = {}
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(lambda p, n=name: calls.__setitem__(n, calls.get(n, 0) + 1))
    _train(model)
    assert calls == {name: MICROBATCHES for name, _ in model.named_parameters()}


def test_autocast_frozen_weights_subclasses_and_other_stages_layers_use_plain_linear() -> None:
    class Scaled(nn.Linear):
        def forward(self, x: Tensor) -> Tensor:
            return super().forward(x) * 2

    model = nn.Sequential(nn.Linear(4, 4), Scaled(4, 4), nn.Linear(4, 2), nn.Linear(2, 2))
    model[2].weight.requires_grad_(False)
    free_parameter(model, "3.weight")  # held by another stage: a placeholder buffer here
    changed = install_grad_accumulation(model)
    assert changed == [model[0], model[2]]
    model = model[:3]
    reference = copy.deepcopy(model)
    remove_grad_accumulation([reference[0], reference[2]])
    for net in (model, reference):
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = net(torch.randn(3, 4, generator=torch.Generator().manual_seed(1))).float().sum()
            with accumulating_in_place():
                loss.backward()
    for param, expected in zip(model.parameters(), reference.parameters(), strict=True):
        assert (param.grad is None) == (expected.grad is None)
        if param.grad is not None:
            assert torch.equal(param.grad, expected.grad)
    remove_grad_accumulation(changed)
    assert all("forward" not in m.__dict__ for m in model)


def test_autograd_grad_and_backward_outside_the_engine_compute_as_autograd_and_leave_grad_alone() -> None:
    torch.manual_seed(0)
    model = _TiedNet()
    reference = copy.deepcopy(model)
    install_grad_accumulation(model)
    idx = _batches()
    for net in (model, reference):  # .grad holds a first micro-batch's gradient
        with accumulating_in_place():
            net(idx[0]).logsumexp(-1).sum().backward()
    before = model.up.weight.grad.clone()
    # gradients taken with torch.autograd.grad, or a backward limited by inputs=, are not meant for .grad: also
    # inside the engine's backward (a hook may run one)
    for context in (contextlib.nullcontext, accumulating_in_place):
        with context():
            got = torch.autograd.grad(model(idx[1]).logsumexp(-1).sum(), [model.up.weight, model.down.weight])
            model(idx[1]).logsumexp(-1).sum().backward(inputs=[model.up.bias])
        want = torch.autograd.grad(reference(idx[1]).logsumexp(-1).sum(), [reference.up.weight, reference.down.weight])
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6 * w.abs().max().item())
        assert torch.equal(model.up.weight.grad, before)
    # a backward outside the engine accumulates as autograd does
    model(idx[1]).logsumexp(-1).sum().backward()
    reference(idx[1]).logsumexp(-1).sum().backward()
    torch.testing.assert_close(model.up.weight.grad, reference.up.weight.grad, rtol=1e-6, atol=1e-5)


def test_a_gradient_hook_sees_each_microbatch_alone_and_a_weight_frozen_after_forward_keeps_its_grad() -> None:
    torch.manual_seed(0)
    model = _TiedNet()
    reference = copy.deepcopy(model)
    install_grad_accumulation(model)
    seen: dict[str, list[float]] = {"fused": [], "plain": []}
    for net, name in ((model, "fused"), (reference, "plain")):
        # a hook that changes the gradient: applied to each micro-batch's, not to the running sum
        net.up.weight.register_hook(lambda g, n=name: seen[n].append(g.norm().item()) or g.clamp(-0.5, 0.5))
        for i, idx in enumerate(_batches()):
            loss = net(idx).logsumexp(-1).sum()
            net.down.weight.requires_grad_(i < 2)  # frozen between the forward and the backward of micro-batch 2
            with accumulating_in_place():
                loss.backward()
    torch.testing.assert_close(seen["fused"], seen["plain"])
    for (name, param), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param.grad, expected.grad, rtol=1e-6, atol=1e-5, msg=name)


@pytest.mark.parametrize(("fuse", "schedule", "changed"), [
    (True, "1f1b", [False, True]),  # the small weight keeps autograd's way
    (True, "zero-bubble", [True, True]),  # W needs every linear layer's weight gradient held back
    (False, "1f1b", [False, False]),
    (False, "zero-bubble", [False, False]),
])
def test_the_engine_installs_it_for_its_stage_and_teardown_removes_it(
        fuse: bool, schedule: str, changed: list[bool], tmp_path: Path) -> None:
    width = 1024  # a weight of exactly MIN_FUSED_NUMEL elements
    assert width * width == MIN_FUSED_NUMEL
    model = nn.Sequential(nn.Linear(4, width), CutPoint(), nn.Linear(width, width), nn.Linear(width, 1))
    engine = PipelineEngine(model, EngineConfig(1, num_microbatches=2, fuse_grad_accumulation=fuse,
                                                schedule=schedule))  # type: ignore[arg-type]
    batch = (torch.randn(4, 4), torch.randn(4, 1))
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        engine.setup(batch, lambda mb: nn.functional.mse_loss(model(mb[0]), mb[1]))
        assert ["forward" in m.__dict__ for m in (model[0], model[2])] == changed
        assert ("forward" in model[3].__dict__) == (fuse and schedule == "zero-bubble")
    finally:
        engine.teardown()
    assert all("forward" not in m.__dict__ for m in model)


def test_install_skips_weights_below_the_bound() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 16))
    assert install_grad_accumulation(model, min_numel=128) == [model[1]]
    assert install_grad_accumulation(nn.Sequential(nn.Linear(4, 8)), min_numel=33) == []
