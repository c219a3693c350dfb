"""The side values' hooks inside a compiled region: traced, no graph break from our code, no recompilation.

A block compiled in place (``block.compile()``) runs its own hooks outside its graph (torch 2.14 does not trace
``Module._call_impl``), so the hooks are inside a graph when a region that calls the hooked module is compiled.

A compiled model (``model.compile()``, as a whole-model compile or a compiled LightningModule forward does) whose
module calls are hooked: the producer's hook captures a value, the consumer's puts the stage's value in place of
its argument. Exactness of whole pipelines with compiled models: the zoo (``t5_stacks``, ``model-compiled-p2``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch._dynamo.utils import counters

from lightning_varuna.pipeline.model.data_flow import CallSite, SideValue
from lightning_varuna.pipeline.runtime.links import Chunk
from lightning_varuna.pipeline.runtime.side_value_hooks import SideValueHooks, acting_for

WIDTH = 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        return torch.tanh(self.linear(x) + bias)


class Model(nn.Module):
    """``bias`` made by ``make`` and passed to both blocks as a keyword argument (as T5's position bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.make = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        bias = self.make(x)
        for block in self.blocks:
            x = block(x, bias=bias)
        return x


def _value(what: str) -> SideValue:
    # leaf 0 of make's output; leaf 1 of blocks.1's (args, kwargs) leaves: (x,), {"bias": bias}
    return SideValue(CallSite("make", 0, 0, 0), (CallSite("blocks.1", 0, 0, 1),), (2, WIDTH), torch.float32, 0,
                     what)


class Forward:
    """A stage's forward as the hooks see it: blocks.1 takes ``given`` in place of the bias."""

    def __init__(self, used: SideValue, given: Tensor) -> None:
        self.segment: Callable[[], int] = lambda: 0
        self.captured: dict[SideValue, Tensor] = {}
        self.used, self.given = used, given

    def replacement(self, value: SideValue) -> Tensor | None:
        return self.given if value is self.used else None


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_hooks_in_a_compiled_model_are_traced_without_graph_breaks_or_recompiles(backend: str) -> None:
    torch.manual_seed(0)
    model = Model()
    made, used = _value("sent on"), _value("received")
    hooks = SideValueHooks(model, [Chunk(stage=0, first_cut=None, last_cut=None, sides_in=(used,),
                                         sides_out=(made,))])
    try:
        model.compile(backend=backend)
        torch._dynamo.reset()
        counters.clear()
        graphs = []
        for k in range(3):  # three micro-batches: new values every time
            x, given = torch.randn(2, WIDTH), torch.randn(2, WIDTH, requires_grad=True)
            forward = Forward(used, given)
            with acting_for(forward):
                out = model(x)
            bias = model.make(x)
            expected = model.blocks[1].forward(model.blocks[0].forward(x, bias), given)
            assert torch.allclose(out, expected), k
            assert torch.equal(forward.captured[made], bias), k
            out.sum().backward()
            assert given.grad is not None and given.grad.abs().sum() > 0, "the gradient reaches the given value"
            graphs.append(counters["stats"]["unique_graphs"])
        # one graph for the whole model, the same in every micro-batch (a hook that the compiler cannot trace splits
        # it: 3 graphs, and torch 2.14's counters["graph_break"] does not count a break in an inlined module call)
        assert graphs == [1, 1, 1], f"graphs after each micro-batch: {graphs}"
        with acting_for(Forward(used, torch.randn(2, WIDTH))):
            explained = torch._dynamo.explain(model._call_impl)(torch.randn(2, WIDTH))
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
        # outside a stage's forward the hooks change nothing
        x = torch.randn(2, WIDTH)
        bias = model.make(x)
        assert torch.allclose(model(x), model.blocks[1].forward(model.blocks[0].forward(x, bias), bias))
    finally:
        hooks.remove()
