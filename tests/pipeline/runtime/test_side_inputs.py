"""Side inputs: values a later segment reads that do not pass through a cut point (rotary embeddings, masks).

A module called only in an earlier stage's segments is a stand-in (zeros) on later stages, so its output reaching a
later stage other than through a cut point is recomputed there (a module without parameters, random numbers or state
writes, fed nothing computed from parameters), or transported with the activation (an element of a module call's
output used later only as module-call arguments), or refused with an error naming the value, the code that made it
and the code that reads it: never a silently different computation.
"""

from __future__ import annotations

from copy import deepcopy as copy_module

import pytest
import torch
from torch import Tensor, nn

from lightning_varuna import CutPoint, EngineConfig, PartitionError, PipelineEngine
from lightning_varuna.pipeline import Topology
from lightning_varuna.pipeline.model.dry_run import trace_step
from lightning_varuna.pipeline.model.partition import check_pipeline_size, make_partition
from lightning_varuna.pipeline.model.stand_ins import apply_partition, remove_stand_ins
from lightning_varuna.pipeline.planning.prediction import recomputed_segments
from lightning_varuna.pipeline.runtime.recompute import grad_from_cut
from lightning_varuna.pipeline.runtime.side_values import side_values_kept

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
    plan = make_partition(result, 3)
    assert "side inputs recomputed on every stage by: side" in plan.table()
    for stage in (1, 2):
        copy = copy_module(model)
        stand_ins = apply_partition(copy, plan, stage, lambda: 0, torch.device("cpu"))
        try:
            assert {id(s.module) for s in stand_ins} == {id(copy.embed), *(id(b) for b in list(copy.blocks)[:stage])}
        finally:
            remove_stand_ins(stand_ins)


def test_reading_only_the_shape_of_a_side_value_is_no_crossing() -> None:
    result = trace(Model(Noise(), block=ShapeOnly))
    assert result.crossings == {} and result.recomputed == set()
    make_partition(result, 3)


@pytest.mark.parametrize("side", [Noise(), Counting(), FromValues(), Learned()],
                         ids=["draws-random-numbers", "writes-a-buffer", "fed-parameter-values", "has-parameters"])
def test_a_side_value_that_cannot_be_recomputed_is_transported_from_its_producer_to_its_consumers(
        side: nn.Module) -> None:
    """Formerly refused: the value is an element of ``side``'s output and every later use is a block's argument."""
    result = trace(Model(side))
    assert result.crossings == {} and result.recomputed == set()
    assert [(v.producer.module, v.producer.leaf) for v in result.side_values] == [("side", 0), ("side", 1)]
    for value in result.side_values:
        assert [(c.module, c.segment, c.leaf) for c in value.consumers] == [
            ("blocks.1", 1, value.producer.leaf + 1), ("blocks.2", 2, value.producer.leaf + 1)]
        assert value.shape == (WIDTH,) and value.batch_dim is None
    plan = make_partition(result, 3)
    assert len(plan.stages) == 3
    assert "side values carried with the activations: side (stage 0) to stage 2; side (stage 0) to stage 2" in \
        plan.table()


class ReadByTheStep(Model):
    """The step's own code (no module call) reads the side value in every segment."""

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        cos, sin = self.side(h, torch.arange(WIDTH, device=x.device))
        for i, block in enumerate(self.blocks):
            h = block(h, cos, sin) * sin
            if i < len(self.cuts):
                h = self.cuts[i](h)
        return h.pow(2).mean()


class MadeByTheStep(Model):
    """The step's own code (no module's output) makes the side value from a parameter."""

    def __init__(self) -> None:
        super().__init__(Rotary())
        self.table = nn.Parameter(torch.randn(WIDTH))

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        cos, sin = self.table.cos(), self.table.sin()
        for i, block in enumerate(self.blocks):
            h = block(h, cos, sin)
            if i < len(self.cuts):
                h = self.cuts[i](h)
        return h.pow(2).mean()


@pytest.mark.parametrize(
    ("model", "why"),
    [
        (lambda: ReadByTheStep(Learned()), r"made by side, read by mul\(\) in the step's own code, not as an argument"
                                           r" of a module call in segment 1, and blocks\.0 takes or gives it too"),
        (MadeByTheStep, r"made by the step's own code outside any module's output, read by blocks\.1"),
    ],
    ids=["read-outside-a-module-call", "made-outside-a-module-call"],
)
def test_a_side_value_that_cannot_be_transported_is_refused_with_its_producer_and_reader(model, why: str) -> None:
    result = trace(model())
    assert set(result.crossings) == {(0, 1), (0, 2)}
    message = (r"A tensor \(\(4,\) torch\.float32\) computed from parameters in segment 0 \(" + why
               + r"\) is used in segment 1 without passing through a CutPoint, so segments 0 to 1 must stay on one"
               r" stage.* at most 1 stage\(s\), not pipeline_parallel_size=2")
    with pytest.raises(PartitionError, match=message):
        check_pipeline_size(result, 2)
    with pytest.raises(PartitionError, match=message):
        make_partition(result, 2)
    assert len(make_partition(result, 1).stages) == 1


def test_the_engine_refuses_it_before_any_rank_waits() -> None:
    """A topology without a process group: a check made after a collective would fail differently."""
    model = MadeByTheStep()
    engine = PipelineEngine(model, EngineConfig(2, num_microbatches=2))
    topology = Topology(world_size=2, rank=1, pipeline_size=2, device=torch.device("cpu"))
    with pytest.raises(PartitionError, match=r"outside any module's output, read by blocks\.1"):
        engine.setup(torch.randn(4, WIDTH), lambda b: model(b), topology=topology)


def test_recompute_by_degree_keeps_a_side_value_that_its_stage_makes_in_the_recomputed_part_and_uses_after_it(
        ) -> None:
    """Formerly refused: the forward makes the value without autograd, so the kept part takes a leaf of it (whose
    gradient the recompute's value continues); exact against the plain run in ``test_side_values.py`` (``*rc*``)."""
    result = trace(Model(Learned()))
    # segments 0 and 1 on one stage: side made in 0 (recomputed with recompute=1), used by blocks.1 in 1 (kept)
    assert grad_from_cut(None, 1, 1, result.crossings) == 0
    assert side_values_kept(result.side_values, range(0, 2), 0) == tuple(result.side_values)
    assert side_values_kept(result.side_values, range(0, 3), 1) == tuple(result.side_values)  # used by blocks.2
    assert side_values_kept(result.side_values, range(0, 2), None) == ()  # no recompute by degree
    # a stage that only receives it: the received value is a leaf with its own gradient already
    assert side_values_kept(result.side_values, range(1, 3), 1) == ()
    # the planner's rule is the engine's: both refuse only what crosses the recomputed part's end unsplittably
    assert recomputed_segments([range(0, 2), range(2, 3)], 1, tuple(result.crossings)) == [range(0, 1), range(2, 2)]


# -- values the step's code reads outside module calls (a mixture of experts' router logits) ----------------------

class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, WIDTH))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        logits = x @ self.weight.t()
        return logits, logits.argmax(-1)


class RoutedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.router = Router()

    def forward(self, x: Tensor) -> Tensor:
        _, chosen = self.router(x)  # the logits are dropped here: only a hook keeps them (as transformers' do)
        return self.linear(x) * (1 + chosen[:, None])


class Routed(nn.Module):
    """Blocks whose routers' logits a forward hook collects, read by the loss after the last block."""

    def __init__(self, n: int = 3, hand_over: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(RoutedBlock() for _ in range(n))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(n - 1))
        self.probe = nn.Identity()
        self.hand_over = hand_over
        self.collected: list[Tensor] = []
        for block in self.blocks:
            block.router.register_forward_hook(lambda module, args, out: self.collected.append(out[0]))

    def forward(self, x: Tensor) -> Tensor:
        self.collected = []
        h = self.embed(x)
        for i, block in enumerate(self.blocks):
            h = block(h)
            if self.hand_over and i == 0:
                self.probe(self.collected[0])  # another module takes the first router's logits
            if i < len(self.cuts):
                h = self.cuts[i](h)
        logits, self.collected = torch.cat(self.collected), []  # kept no longer than the forward
        return h.pow(2).mean() + logits.softmax(-1).pow(2).mean()


def test_a_value_the_step_reads_outside_module_calls_is_given_at_its_producer_on_the_reading_stage() -> None:
    model = Routed()
    result = trace(model)
    values = {v.producer.module: v for v in result.side_values}
    assert set(values) == {"blocks.0.router", "blocks.1.router"}  # blocks.2's is read in its own segment
    assert all(v.consumers == () and v.step_reads == (2,) and v.batch_dim == 0 for v in values.values())
    assert "used by the step's code in segment(s) 2" in values["blocks.0.router"].what
    plan = make_partition(result, 3)
    assert "blocks.0.router (stage 0) to stage 2; blocks.1.router (stage 1) to stage 2" in plan.table()
    for stage, whole in ((1, {"embed", "blocks.0"}), (2, {"embed", "blocks.0.linear", "blocks.0.router",
                                                          "blocks.1.linear", "blocks.1.router"})):
        copy = copy_module(model)
        stand_ins = apply_partition(copy, plan, stage, lambda: 0, torch.device("cpu"))
        try:  # the reading stage runs the blocks' own code, so that their routers are called (and hooked) there
            names = {name for name, module in copy.named_modules() if any(s.module is module for s in stand_ins)}
            assert names == whole
        finally:
            remove_stand_ins(stand_ins)
    # its rules give the stood-in routers' shapes without running them
    assert {"blocks.0.router", "blocks.0.linear", "blocks"} - set(result.call_shapes) == {"blocks"}


def test_a_value_the_step_reads_that_another_module_also_takes_is_refused() -> None:
    """That module may keep it (a stage standing it in would read a stale value): refused, never silently wrong."""
    result = trace(Routed(hand_over=True))
    assert {v.producer.module for v in result.side_values} == {"blocks.1.router"}
    with pytest.raises(PartitionError, match=r"made by blocks\.0\.router, read by .* not as an argument of a module"
                                             r" call in segment 2"):
        make_partition(result, 2)
