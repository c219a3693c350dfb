"""Stand-ins: a module owned by an earlier stage answers by shape, with zeros from a reused buffer, and costs little."""

from __future__ import annotations

import torch
from torch import nn

from lightning_varuna.pipeline.model.stand_ins import StandIn


class Pair(nn.Module):
    def forward(self, x, scale=1.0):
        return x * scale, x.sum(-1)


def stand_in(module: nn.Module) -> StandIn:
    standing = StandIn(module, owned=range(2, 3), segment=lambda: 0, device=torch.device("cpu"))
    module.forward = standing  # type: ignore[method-assign]
    return standing


def test_a_single_tensor_call_answers_by_shape_per_input_shape() -> None:
    linear = nn.Linear(8, 4)
    standing = stand_in(linear)
    pointers = set()
    for shape in [(2, 5, 8), (2, 3, 8), (2, 5, 8)]:  # the largest first: the buffer never grows
        out = linear(torch.randn(shape))
        assert out.shape == (*shape[:-1], 4)
        assert out.is_contiguous()  # takes in-place arithmetic, as the module's own output does
        assert not out.any()
        pointers.add(out.data_ptr())
    assert len(pointers) == 1, "every call answers from the same memory: no allocation per call"
    assert len(standing._cache) == 2  # one entry per input shape and dtype
    linear.to(torch.float64)(torch.randn(2, 3, 8, dtype=torch.float64))
    assert len(standing._cache) == 3


def test_structured_outputs_and_keyword_arguments() -> None:
    pair = Pair()
    stand_in(pair)
    scaled, summed = pair(torch.randn(2, 6), scale=2.0)
    assert scaled.shape == (2, 6) and summed.shape == (2,)
    scaled, summed = pair(torch.randn(3, 6), 2.0)
    assert scaled.shape == (3, 6) and summed.shape == (3,)


def test_an_owned_segment_runs_the_module() -> None:
    linear = nn.Linear(4, 4)
    segment = [0]
    linear.forward = StandIn(linear, owned=range(1, 2), segment=lambda: segment[0], device=torch.device("cpu"))
    x = torch.randn(2, 4)
    segment[0] = 1
    assert torch.equal(linear(x), nn.functional.linear(x, linear.weight, linear.bias))
    segment[0] = 0
    assert not linear(x).any()
