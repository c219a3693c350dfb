"""``cut_at`` with several block lists (an encoder-decoder's two stacks): where it cuts, and the errors it raises.

Every error is raised by the engine's setup on a process grid without a process group (a check made after a
collective call would fail differently), so every rank raises it before any rank waits. Exactness against the plain
run: the zoo's ``t5_stacks`` family (``tests/models/test_zoo.py``).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from lightning_varuna import EngineConfig
from lightning_varuna.pipeline.model.cut import CutPointError, check_cut_at_order, install_cut_at
from lightning_varuna.pipeline.model.dry_run import trace_step
from lightning_varuna.pipeline.model.partition import make_partition
from tests.pipeline.test_errors import setup_engine, topology

WIDTH = 4
STACKS = ["enc", "dec"]


class EncoderDecoder(nn.Module):
    """Three encoder blocks, a norm, two decoder blocks that also read the encoder's output (cross-attention)."""

    def __init__(self, run: tuple[str, ...] = ("enc", "dec"), norm: bool = True) -> None:
        super().__init__()
        self.run = run
        self.with_norm = norm
        self.enc = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.norm = nn.LayerNorm(WIDTH)
        self.dec = nn.ModuleList(CrossBlock() for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        memory = y = x
        for stack in self.run:
            if stack == "enc":
                for block in self.enc:
                    memory = block(memory)
                memory = y = self.norm(memory) if self.with_norm else memory
            else:
                for block in self.dec:
                    y = block(y, memory)
        return y.pow(2).mean()


class CrossBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, y: Tensor, memory: Tensor) -> Tensor:
        return self.linear(y) + memory


def test_an_encoder_output_read_past_the_next_segment_travels_from_the_last_encoder_block() -> None:
    # no norm after the encoder (BART): the decoder blocks read the last encoder block's cut output itself; later
    # segments than the first decoder block's take it as a side value made by that block, not as an unsplittable
    # value of the step
    model = EncoderDecoder(norm=False)
    cuts, hooks = install_cut_at(model, STACKS)
    try:
        batch = torch.randn(4, WIDTH)
        trace, _ = trace_step(model, lambda n: model(batch[:n]), cut_names={id(c): c._varuna_name for c in cuts})
        assert trace.crossings == {}
        assert {(v.producer.module, v.producer.segment) for v in trace.side_values} == {("enc.2", 2)}
        assert {c.segment for v in trace.side_values for c in v.consumers} == {4}
        assert len(make_partition(trace, 5).stages) == 5
    finally:
        for hook in hooks:
            hook.remove()


def test_several_block_lists_are_cut_after_each_block_but_the_last_one_in_execution_order() -> None:
    model = EncoderDecoder()
    cuts, hooks = install_cut_at(model, STACKS)
    try:
        assert [c._varuna_name for c in cuts] == ["enc.0:output", "enc.1:output", "enc.2:output", "dec.0:output"]
        batch = torch.randn(4, WIDTH)
        names = {id(c): c._varuna_name for c in cuts}
        trace, executed = trace_step(model, lambda n: model(batch[:n]), cut_names=names)
        check_cut_at_order(cuts, executed)
        assert [c.name for c in trace.cuts] == ["enc.0:output", "enc.1:output", "enc.2:output", "dec.0:output"]
        # the encoder's output, read by both decoder blocks, travels as a side value: every P up to 5 splits it
        assert trace.crossings == {} and {v.producer.module for v in trace.side_values} == {"norm"}
        assert len(make_partition(trace, 5).stages) == 5
    finally:
        for hook in hooks:
            hook.remove()
    # one path in a list is the same as the path alone
    assert [c._varuna_name for c in install_cut_at(EncoderDecoder(), ["enc"])[0]] == ["enc.0:output", "enc.1:output"]


@pytest.mark.parametrize(
    ("model", "cut_at", "error"),
    [
        (EncoderDecoder, ["enc", "decoder"], r"cut_at='decoder': EncoderDecoder has no submodule at that path"),
        (EncoderDecoder, ["enc", "norm"], r"cut_at='norm' names a LayerNorm; it must be an nn\.ModuleList"),
        (EncoderDecoder, ["enc", "enc"], r"names a block list twice; name each once"),
        (EncoderDecoder, ["enc", "enc.0"], r"'enc\.0' lies inside 'enc'; name each block list once, not nested"),
        (EncoderDecoder, ["dec", "enc"], r"cut_at: enc\.0 ran before dec\.0, but cut_at lists \['dec', 'enc'\] in"
                                         r" that order\. Give the block lists in the order the forward runs them"),
        (lambda: EncoderDecoder(run=("enc",)), STACKS, r"none of the blocks of 'dec' ran in the step's forward"),
        (lambda: EncoderDecoder(run=("enc", "dec", "dec")), STACKS, r"dec\.0:output was called twice in one"
                                                                     r" forward"),
    ],
    ids=["not-found", "not-a-block-list", "twice-named", "nested", "out-of-order", "not-run", "run-twice"],
)
def test_a_block_list_that_cannot_be_cut_is_refused_before_any_rank_waits(model, cut_at: list[str],
                                                                          error: str) -> None:
    with pytest.raises(CutPointError, match=error):
        setup_engine(model(), topology(2, 2), cut_at=cut_at)


@pytest.mark.parametrize("cut_at", [[], ["enc", 3], ["enc", ""], {"enc": 1}])
def test_cut_at_must_be_a_path_or_a_list_of_paths(cut_at: object) -> None:
    with pytest.raises(ValueError, match=r"cut_at must be a dotted path string such as 'model\.blocks', or a list"):
        EngineConfig(cut_at=cut_at)  # type: ignore[arg-type]
    assert EngineConfig(cut_at=["enc", "dec"]).cut_at == ("enc", "dec")  # hashable, as every other option
