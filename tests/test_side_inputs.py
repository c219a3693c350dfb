"""Side inputs: values a later segment reads that do not pass through a cut point (rotary embeddings, masks).

A module called only in an earlier stage's segments is a stand-in (zeros) on later stages, so its output reaching a
later stage other than through a cut point is either recomputed there (a module without parameters, random numbers
or state writes, fed nothing computed from parameters) or refused with an error naming the value, the module that
made it and the one that reads it: never a silently different computation.
"""

from __future__ import annotations

from copy import deepcopy as copy_module

import pytest
import torch
from torch import Tensor, nn

from lightning_varuna import CutPoint, EngineConfig, PartitionError, PipelineEngine
from lightning_varuna.pipeline import Topology
from lightning_varuna.pipeline.model.dry_run import trace_step
from lightning_varuna.pipeline.model.partition import check_pipeline_size, make_plan
from lightning_varuna.pipeline.model.stand_ins import apply_plan, remove_stand_ins

WIDTH = 4


class Rotary(nn.Module):
    """Parameter-free and deterministic: frequencies from a buffer and positions (as Hugging Face's rotary)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(WIDTH).float() / WIDTH), persistent=False)

    def forward(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions.float() * self.inv_freq
        return freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)


class Noise(Rotary):
    def forward(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = super().forward(x, positions)
        return cos + 0.01 * torch.randn_like(cos), sin


class Counting(Rotary):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        self.calls += 1
        return super().forward(x, positions)


class FromValues(Rotary):
    """Parameter-free, but its output depends on the values of its input (computed from parameters)."""

    def forward(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = super().forward(x, positions)
        return cos * x.mean(), sin


class Learned(nn.Module):
    """A learned side input (it has parameters, so it lives on the first stage only)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(WIDTH))

    def forward(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        return self.table.cos(), self.table.sin()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return self.linear(x) * cos + sin


class ShapeOnly(Block):
    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return self.linear(x) + torch.zeros_like(cos) + cos.shape[-1]


class Model(nn.Module):
    """An embedding, a side module called once before the blocks, and blocks that all read its outputs."""

    def __init__(self, side: nn.Module, block: type[nn.Module] = Block, n: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.side = side
        self.blocks = nn.ModuleList(block() for _ in range(n))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(n - 1))

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        cos, sin = self.side(h, torch.arange(WIDTH, device=x.device))
        for i, block in enumerate(self.blocks):
            h = block(h, cos, sin)
            if i < len(self.cuts):
                h = self.cuts[i](h)
        return h.pow(2).mean()


def trace(model: nn.Module):
    torch.manual_seed(0)
    batch = torch.randn(4, WIDTH)
    result, _ = trace_step(model, lambda n: model(batch[:n]))
    return result


def test_a_parameter_free_deterministic_side_module_is_recomputed_on_every_stage() -> None:
    model = Model(Rotary())
    result = trace(model)
    assert result.crossings == {}
    assert result.recomputed == {"side"}
    plan = make_plan(result, 3)
    assert "side inputs recomputed on every stage by: side" in plan.table()
    for stage in (1, 2):
        copy = copy_module(model)
        stand_ins = apply_plan(copy, plan, stage, lambda: 0, torch.device("cpu"))
        try:
            assert {id(s.module) for s in stand_ins} == {id(copy.embed), *(id(b) for b in list(copy.blocks)[:stage])}
        finally:
            remove_stand_ins(stand_ins)


def test_reading_only_the_shape_of_a_side_value_is_no_crossing() -> None:
    result = trace(Model(Noise(), block=ShapeOnly))
    assert result.crossings == {} and result.recomputed == set()
    make_plan(result, 3)


@pytest.mark.parametrize(
    ("side", "why"),
    [
        (Noise(), "side cannot run on a later stage itself"),
        (Counting(), "side cannot run on a later stage itself"),
    ],
    ids=["draws-random-numbers", "writes-a-buffer"],
)
def test_a_side_value_that_cannot_be_recomputed_is_refused_with_its_producer_and_reader(side: nn.Module,
                                                                                        why: str) -> None:
    result = trace(Model(side))
    assert set(result.crossings) == {(0, 1), (0, 2)}
    message = (
        r"A tensor \(\(4,\) torch\.float32\) computed by side in segment 0 and read by blocks\.1 \(" + why
        + r".*\) is used in segment 1 without passing through a CutPoint, so segments 0 to 1 must stay on one stage"
        r".* at most 1 stage\(s\), not pipeline_parallel_size=2"
    )
    with pytest.raises(PartitionError, match=message):
        check_pipeline_size(result, 2)
    with pytest.raises(PartitionError, match=message):
        make_plan(result, 2)
    assert len(make_plan(result, 1).stages) == 1


@pytest.mark.parametrize("side", [FromValues(), Learned()], ids=["fed-parameter-values", "has-parameters"])
def test_a_side_value_computed_from_parameters_is_refused(side: nn.Module) -> None:
    result = trace(Model(side))
    assert set(result.crossings) == {(0, 1), (0, 2)}
    assert result.recomputed == set()
    with pytest.raises(PartitionError, match=r"computed from parameters in segment 0 is used in segment 1"):
        make_plan(result, 2)


def test_the_engine_refuses_it_before_any_rank_waits() -> None:
    """A topology without a process group: a check made after a collective would fail differently."""
    model = Model(Noise())
    engine = PipelineEngine(model, EngineConfig(2, num_microbatches=2))
    topology = Topology(world_size=2, rank=1, pipeline_size=2, device=torch.device("cpu"))
    with pytest.raises(PartitionError, match=r"computed by side in segment 0 and read by blocks\.1"):
        engine.setup(torch.randn(4, WIDTH), lambda b: model(b), topology=topology)
