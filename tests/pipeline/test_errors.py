"""Bad input gets a clear error that says what to change, raised before any process waits on another.

Everything here runs in one process: the dry run (``trace_step``), planning (``make_partition``, ``balance``),
``cut_at``, micro-batch sizes and argument validation need no process group, and ``PipelineEngine.setup`` is
given a ``Topology`` by hand, so that a check made after a collective would fail here with "Default process
group has not been initialized" instead of the expected message.
"""

from __future__ import annotations

import os
import time
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from helpers.models import RandomTokens, TinyGPT
from torch import Tensor, nn

from lightning_varuna import (
    CutPoint,
    CutPointError,
    EngineConfig,
    PartitionError,
    PipelineEngine,
    VarunaStrategy,
    VarunaWarning,
)
from lightning_varuna.pipeline import Topology
from lightning_varuna.pipeline.model.cut import install_cut_at
from lightning_varuna.pipeline.model.dry_run import TIMED_RUNS, trace_step
from lightning_varuna.pipeline.model.partition import balance, check_pipeline_size, make_partition

CPU = torch.device("cpu")


def topology(world_size: int, pipeline_size: int, rank: int = 0) -> Topology:
    """A process grid without a process group: any collective call made by mistake fails loudly."""
    return Topology(world_size=world_size, rank=rank, pipeline_size=pipeline_size, device=CPU)


class Chain(nn.Module):
    """``n`` linear layers with a cut point after each but the last; ``forward`` may be customised."""

    def __init__(self, n: int = 3, width: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(n))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(n - 1))
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.cuts):
                x = self.cuts[i](x)
        return x.pow(2).mean()


def trace(model: nn.Module, width: int = 4):
    batch = torch.randn(4, width)
    return trace_step(model, lambda n: model(batch[:n]))


def setup_engine(model: nn.Module, topo: Topology, batch_size: int = 4, **options) -> PipelineEngine:
    engine = PipelineEngine(model, EngineConfig(topo.pipeline_size, **options))
    batch = torch.randn(batch_size, 4)
    engine.setup(batch, lambda b: model(b), topology=topo)
    return engine


# -- arguments -------------------------------------------------------------------------------------------

POSITIVE_P = "pipeline_parallel_size must be a positive int or 'auto'"


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"pipeline_parallel_size": 0}, f"{POSITIVE_P}, got 0"),
        ({"pipeline_parallel_size": "two"}, f"{POSITIVE_P}, got 'two'"),
        ({"pipeline_parallel_size": 2.0}, f"{POSITIVE_P}, got 2.0"),
        ({"num_microbatches": 0}, "num_microbatches must be >= 1, got 0"),
        ({"microbatch_size": -2}, "microbatch_size must be >= 1, got -2"),
        ({"num_microbatches": 2.5}, "num_microbatches must be an int"),
        ({"num_microbatches": 4, "microbatch_size": 2}, "Give num_microbatches or microbatch_size, not both"),
        ({"schedule": "dualpipe"}, r"schedule='dualpipe': choose one of"),
        ({"schedule": "interleaved"}, r"schedule='interleaved' needs stages_per_rank >= 2 \(got 1\); use"),
        ({"schedule": "1f1b", "stages_per_rank": 2}, r"schedule='1f1b' runs one model chunk per rank.*'interleaved'"),
        ({"schedule": "interleaved", "stages_per_rank": 2, "pipeline_parallel_size": 4, "num_microbatches": 6},
         r"rounds of P=4.*use num_microbatches=4 or 8"),
        ({"stages_per_rank": "auto", "pipeline_parallel_size": 1}, r"stages_per_rank='auto' needs a pipeline"),
        ({"schedule": "interleaved", "stages_per_rank": 0, "pipeline_parallel_size": 2},
         r"stages_per_rank must be an int >= 1 or 'auto', got 0"),
        ({"schedule": "interleaved", "stages_per_rank": 2, "pipeline_parallel_size": 1},
         r"stages_per_rank=2 needs a pipeline"),
        ({"partition": "flops"}, "partition='flops': use 'time' or 'params'"),
        ({"cut_at": 3}, r"cut_at must be a dotted path string .* got 3"),
        ({"p2p_backend": "mpi"}, r"p2p_backend='mpi': choose one of \('auto', 'nccl', 'gloo'\)"),
    ],
)
def test_strategy_rejects_bad_arguments(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        VarunaStrategy(**options)


@pytest.mark.parametrize("timeout", [0, -1.0])
def test_engine_rejects_non_positive_p2p_timeout(timeout: float) -> None:
    with pytest.raises(ValueError, match=f"p2p_timeout must be a positive number of seconds, got {timeout}"):
        EngineConfig(1, p2p_timeout=timeout)


def test_strategy_rejects_non_positive_p2p_timeout() -> None:
    with pytest.raises(ValueError, match="p2p_timeout must be a positive number of seconds, got 0"):
        VarunaStrategy(p2p_timeout=0)


def test_nccl_point_to_point_on_a_cpu_device_raised_before_any_collective() -> None:
    with pytest.raises(ValueError, match="p2p_backend='nccl' needs CUDA devices; this rank runs on cpu"):
        setup_engine(Chain(3), topology(2, 2), p2p_backend="nccl")


def test_world_size_not_divisible_by_pipeline_size() -> None:
    message = r"world size \(3 processes\) is not divisible by pipeline_parallel_size=2\. Use a P that"
    with pytest.raises(ValueError, match=message):
        Topology.check(3, 2)
    Topology.check(4, 2)


# -- cut points in the dry run ------------------------------------------------------------------------------

def test_pipeline_larger_than_number_of_segments() -> None:
    result, _ = trace(Chain(2))  # one cut point, two segments
    message = r"pipeline_parallel_size=3 but the model has 2 segment\(s\) \(1 cut point\(s\)\)\. Use"
    with pytest.raises(PartitionError, match=message + r" pipeline_parallel_size <= 2"):
        make_partition(result, 3)
    assert len(make_partition(result, 2).stages) == 2


def test_pipeline_larger_than_number_of_segments_raised_before_any_collective() -> None:
    with pytest.raises(PartitionError, match=r"pipeline_parallel_size=4 but the model has 3 segment\(s\)"):
        setup_engine(Chain(3), topology(4, 4))


def test_no_cut_points_and_no_cut_at() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with pytest.raises(PartitionError, match=r"pipeline_parallel_size=2 but the model has no CutPoint and no"
                       r" cut_at was given\. Add CutPoint\(\) modules .* or set cut_at="):
        setup_engine(lambda_module(model), topology(2, 2))
    setup_engine(lambda_module(model), topology(1, 1))  # one stage needs no cut point


def lambda_module(inner: nn.Module) -> nn.Module:
    class Wrap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = inner

        def forward(self, x: Tensor) -> Tensor:
            return self.net(x).mean()

    return Wrap()


def test_cut_at_missing_path() -> None:
    with pytest.raises(CutPointError, match=r"cut_at='model\.blocks': TinyGPT has no submodule at that path.*"
                       r"Give the dotted path of the nn\.ModuleList or nn\.Sequential"):
        install_cut_at(TinyGPT(n_layer=2), "model.blocks")
    with pytest.raises(CutPointError, match=r"cut_at='blocks\.7'"):
        install_cut_at(TinyGPT(n_layer=2), "blocks.7")


def test_cut_at_not_a_container() -> None:
    message = r"cut_at='ln_f' names a LayerNorm; it must be an nn\.ModuleList or nn\.Sequential"
    with pytest.raises(CutPointError, match=message):
        install_cut_at(TinyGPT(n_layer=2), "ln_f")
    with pytest.raises(CutPointError, match=r"cut_at='pos': TinyGPT has no submodule"):
        install_cut_at(TinyGPT(n_layer=2), "pos")  # a parameter, not a module
    message = r"cut_at='blocks' has 1 child module\(s\); at least 2 are needed"
    with pytest.raises(CutPointError, match=message):
        install_cut_at(TinyGPT(n_layer=1), "blocks")


def test_cut_at_raised_through_engine_before_any_collective() -> None:
    model = TinyGPT(n_layer=2, use_cut_points=False)
    engine = PipelineEngine(model, EngineConfig(2, cut_at="model.blocks"))
    idx, targets = RandomTokens(n=4)[0]
    with pytest.raises(CutPointError, match="cut_at='model.blocks'"):
        engine.setup((idx[None], targets[None]), lambda b: model.training_step(b, 0), topology=topology(2, 2))


def test_cut_at_block_returning_a_tuple() -> None:
    class TupleBlocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.LSTM(4, 4, batch_first=True) for _ in range(2))

        def forward(self, x: Tensor) -> Tensor:
            for block in self.blocks:
                x, _ = block(x)
            return x.mean()

    model = TupleBlocks()
    install_cut_at(model, "blocks")
    trace, _ = trace_step(model, lambda n: model(torch.randn(n, 3, 4)))  # the first element crosses the cut
    assert [(c.name, c.shape) for c in trace.cuts] == [("blocks.0:output", (2, 3, 4))] and not trace.crossings


def test_cut_at_block_returning_a_dict() -> None:
    class DictBlock(nn.Linear):
        def forward(self, x: Tensor) -> dict:  # type: ignore[override]
            return {"hidden": super().forward(x)}

    class DictBlocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(DictBlock(4, 4) for _ in range(2))

        def forward(self, x: Tensor) -> Tensor:
            for block in self.blocks:
                x = block(x)["hidden"]
            return x.mean()

    model = DictBlocks()
    install_cut_at(model, "blocks")
    message = r"cut_at: blocks\.0 returned a dict; cut_at needs blocks that return a tensor, or a tuple or list whose"
    with pytest.raises(CutPointError, match=message):
        trace_step(model, lambda n: model(torch.randn(n, 4)))


def test_cut_point_called_twice() -> None:
    class Twice(Chain):
        def forward(self, x: Tensor) -> Tensor:
            x = self.cuts[0](self.layers[0](x))
            return self.cuts[0](self.layers[1](x)).mean()

    message = r"cuts\.0 was called twice in one forward\. .*create one CutPoint per place"
    with pytest.raises(CutPointError, match=message):
        trace(Twice(2))


def test_cut_point_on_non_tensor() -> None:
    class OnTuple(Chain):
        def forward(self, x: Tensor) -> Tensor:
            a, b = self.cuts[0]((self.layers[0](x), x))
            return (a + b).mean()

    with pytest.raises(CutPointError, match=r"A CutPoint was called on a tuple; it takes exactly one tensor\."
                       " Move the cut point"):
        trace(OnTuple(2))


def test_cut_point_on_integer_tensor() -> None:
    class OnIndices(Chain):
        def forward(self, x: Tensor) -> Tensor:
            return self.cuts[0](self.layers[0](x).argmax(-1)).float().mean()

    with pytest.raises(CutPointError, match=r"cuts\.0 got a torch\.int64 tensor; a cut point needs a"
                       " floating-point activation"):
        trace(OnIndices(2))


def test_cut_point_tensor_with_two_batch_dimensions() -> None:
    class Outer(Chain):
        def forward(self, x: Tensor) -> Tensor:
            h = self.layers[0](x)
            return self.cuts[0](h[:, None] * h[None, :]).mean()

    message = r"cuts\.0 has shape \(1, 1, 4\) for batch 1 and \(2, 2, 4\) for batch 2; exactly one dimension"
    with pytest.raises(PartitionError, match=message + " may scale with the batch"):
        trace(Outer(2))


def test_cut_points_in_a_different_order_in_the_dry_run() -> None:
    class Flips(Chain):
        def forward(self, x: Tensor) -> Tensor:
            order = [0, 1] if x.shape[0] == 1 else [1, 0]  # the dry run runs batch 1, then batch 2
            x = self.cuts[order[0]](self.layers[0](x))
            x = self.cuts[order[1]](self.layers[1](x))
            return self.layers[2](x).mean()

    with pytest.raises(CutPointError, match=r"different order in two forwards.*\[cuts\.0, cuts\.1\].*"
                       r"\[cuts\.1, cuts\.0\]"):
        trace(Flips(3))


def test_cut_points_in_a_different_order_after_the_dry_run() -> None:
    class FlipsLater(Chain):
        flip_after = 1_000_000

        def forward(self, x: Tensor) -> Tensor:
            self.calls += 1
            order = [1, 0] if self.calls > self.flip_after else [0, 1]
            x = self.cuts[order[0]](self.layers[0](x))
            x = self.cuts[order[1]](self.layers[1](x))
            return self.layers[2](x).mean()

    model = FlipsLater(3)
    engine = setup_engine(model, topology(1, 1), num_microbatches=2)
    batch = torch.randn(4, 4)
    for _ in range(2):
        engine.train_step(batch, model)
    model.flip_after = model.calls + 1  # step 3 flips in its second micro-batch
    message = r"Cut point #0 of this forward is cuts\.1, but the dry run saw cuts\.0 there \(micro-batch 1\)"
    with pytest.raises(CutPointError, match=message + r"\. Cut points must be reached in the same order"):
        engine.train_step(batch, model)


# -- batches and steps -------------------------------------------------------------------------------------

def test_batch_smaller_than_num_microbatches_runs_one_micro_batch_per_sample() -> None:
    # the last batch of an epoch without drop_last: trained, as in the plain run, not refused
    engine = PipelineEngine(nn.Linear(4, 1), EngineConfig(2, num_microbatches=4))
    assert [engine.microbatches_for(n) for n in (1, 3, 4, 5, 9)] == [1, 3, 4, 4, 4]
    assert engine.microbatches_for(3, train=False) == 3
    interleaved = PipelineEngine(nn.Linear(4, 1), EngineConfig(2, num_microbatches=4, schedule="interleaved",
                                                               stages_per_rank=2))
    assert [interleaved.microbatches_for(n) for n in (3, 5)] == [2, 4]  # rounds of P micro-batches


def test_setup_on_a_batch_smaller_than_num_microbatches_warns_and_trains_with_one_per_sample() -> None:
    model = Chain(3)
    with pytest.warns(VarunaWarning, match=r"The batch of 2 sample\(s\) is split into 2 micro-batch\(es\), fewer"
                      r" than num_microbatches=4: .* Use a batch size >= 4 or fewer micro-batches"):
        engine = setup_engine(model, topology(1, 1), batch_size=2, num_microbatches=4)
    batch = torch.randn(3, 4)
    result = engine.train_step(batch, model)
    assert result.sizes == [1, 1, 1]
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(batch).backward()  # the plain mean over the batch: a mean of per-sample means, each weighted 1/3
    for a, b in zip(got, (p.grad for p in model.parameters()), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_step_that_returns_no_loss() -> None:
    model = Chain(2)
    engine = setup_engine(model, topology(1, 1), num_microbatches=2)
    message = "The step returned a str; for training it must return the loss"
    with pytest.raises(CutPointError, match=message):
        engine.train_step(torch.randn(4, 4), lambda b: "no loss")


def test_step_that_returns_none_skips_its_micro_batch() -> None:
    model = Chain(2)
    engine = setup_engine(model, topology(1, 1), num_microbatches=2)
    batch = torch.randn(4, 4)
    result = engine.train_step(batch, lambda b: None if b[0, 0] == batch[0, 0] else model(b))
    assert result.outputs[0] is None and result.outputs[1] is not None
    engine.train_step(batch, lambda b: None)  # a whole batch skipped: no backward at all
    assert all(p.grad is not None for p in model.parameters()), "the second micro-batch's backward ran"


def test_dry_run_of_a_step_that_skips_the_first_batch_says_what_to_change() -> None:
    model = Chain(3)
    trace_of_skip, _ = trace_step(model, lambda n: None)
    with pytest.raises(PartitionError, match=r"The dry run's step returned None before reaching any cut point.*"
                       r"skip other batches than that one, or return None after the loss"):
        make_partition(trace_of_skip, 2)
    make_partition(trace_of_skip, 1)  # one stage: nothing to cut


def test_stochastic_weight_averaging_is_refused_at_setup() -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import StochasticWeightAveraging
    from lightning.pytorch.utilities.exceptions import MisconfigurationException
    from torch.utils.data import DataLoader

    message = r"StochasticWeightAveraging does not work with VarunaStrategy.*Remove the callback"
    with mock.patch.dict(os.environ), pytest.raises(MisconfigurationException, match=message):
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, strategy=VarunaStrategy(pipeline_parallel_size=1), max_steps=1,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[StochasticWeightAveraging(swa_lrs=0.01)],
        )
        trainer.fit(TinyGPT(n_layer=2), DataLoader(RandomTokens(n=8), batch_size=4))


def test_fabric_is_told_what_to_use_instead() -> None:
    from lightning.fabric import Fabric

    with pytest.raises(ValueError, match=r"Fabric\(strategy='varuna'\) is not supported.*Trainer\(strategy='varuna'\)"
                       r".*lightning_varuna\.PipelineEngine directly"):
        Fabric(strategy="varuna", accelerator="cpu", devices=1)


def test_manual_optimization_is_rejected() -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.exceptions import MisconfigurationException
    from torch.utils.data import DataLoader

    class Manual(TinyGPT):
        def __init__(self) -> None:
            super().__init__(n_layer=2)
            self.automatic_optimization = False

    # Lightning's launcher and process-group setup write MASTER_PORT etc.; keep them out of other tests
    message = r"supports automatic optimization only.*Remove `self\.automatic_optimization = False`"
    with mock.patch.dict(os.environ), pytest.raises(MisconfigurationException, match=message):
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, strategy=VarunaStrategy(pipeline_parallel_size=1), max_steps=1,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )
        trainer.fit(Manual(), DataLoader(RandomTokens(n=8), batch_size=4))


def test_manual_optimization_is_rejected_before_the_process_group_starts() -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.exceptions import MisconfigurationException
    from torch.utils.data import DataLoader

    class Manual(TinyGPT):
        def __init__(self) -> None:
            super().__init__(n_layer=2)
            self.automatic_optimization = False

    started = []
    with mock.patch.dict(os.environ), pytest.raises(MisconfigurationException):
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, strategy=VarunaStrategy(pipeline_parallel_size=1), max_steps=1,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )
        try:
            trainer.fit(Manual(), DataLoader(RandomTokens(n=8), batch_size=4))
        finally:
            started.append(dist.is_initialized())
    assert started == [False]


def test_world_size_not_divisible_is_rejected_by_the_trainer() -> None:
    import lightning.pytorch as pl

    with mock.patch.dict(os.environ), pytest.raises(ValueError, match="not divisible by pipeline_parallel_size=2"):
        pl.Trainer(accelerator="cpu", devices=3, strategy=VarunaStrategy(pipeline_parallel_size=2), logger=False)


# -- values that skip a cut point ------------------------------------------------------------------------

class Skip(Chain):
    """``h`` from segment 0 is added in segment 1 without passing through the cut point."""

    def forward(self, x: Tensor) -> Tensor:
        h = self.layers[0](x)
        y = self.layers[1](self.cuts[0](h)) + h
        y = self.cuts[1](y)
        return self.layers[2](y).pow(2).mean()


def test_skip_connection_across_stages() -> None:
    result, _ = trace(Skip(3))
    assert set(result.crossings) == {(0, 1)}
    message = (
        r"A tensor \(\(2, 4\) torch\.float32\) computed from parameters in segment 0 \(made by layers\.0, read by"
        r" add\(\) in the step's own code, not as an argument of a module call in segment 1, and cuts\.0 takes or gives"
        r" it too\) is used in segment 1"
        r" without passing through a CutPoint, so segments 0 to 1 must stay on one stage: on a later stage it would"
        r" be zeros\. The model can be split into at most 2 stage\(s\), not pipeline_parallel_size=3\."
    )
    with pytest.raises(PartitionError, match=message):
        make_partition(result, 3)
    with pytest.raises(PartitionError, match=message):
        check_pipeline_size(result, 3)  # before any rank waits: it needs only the dry run
    # P=2: segments 0 and 1 share a stage, even where balancing the costs alone would separate them
    result.segment_seconds = [1.0, 1.0, 1.0]
    assert balance(result.segment_seconds, 2) == [range(0, 1), range(1, 3)]
    plan = make_partition(result, 2)
    assert [list(s.segments) for s in plan.stages] == [[0, 1], [2]]


def test_input_reused_after_a_cut_is_not_a_crossing() -> None:
    class ReusesInput(Chain):
        def forward(self, x: Tensor) -> Tensor:
            # x comes from the batch, which every stage has
            y = self.layers[1](self.cuts[0](self.layers[0](x))) + x
            return y.mean()

    result, _ = trace(ReusesInput(2))
    assert result.crossings == {}
    make_partition(result, 2)


def test_balance_and_plan_arguments() -> None:
    with pytest.raises(PartitionError, match=r"Cannot split 2 segment\(s\) into 3 stage\(s\)"):
        balance([1.0, 2.0], 3)
    with pytest.raises(PartitionError, match=r"Cannot split 2 segment\(s\) into 0 stage\(s\)"):
        balance([1.0, 2.0], 0)
    result, _ = trace(Chain(2))
    with pytest.raises(PartitionError, match="partition='flops': use 'time' or 'params'"):
        make_partition(result, 2, by="flops")


def test_one_slow_timed_run_does_not_skew_the_plan() -> None:
    """A preemption inside one segment during one timed run must not move the stage boundaries."""

    class Takes(nn.Module):
        # a segment's compute as a fixed time, so that the plan does not depend on how loaded the machine is;
        # with ``stall_on``, that call (a timed run) is stalled as a busy machine would stall it
        def __init__(self, seconds: float, stall_on: int | None = None) -> None:
            super().__init__()
            self.seconds, self.stall_on, self.calls = seconds, stall_on, 0

        def forward(self, x: Tensor) -> Tensor:
            self.calls += 1
            time.sleep(0.5 if self.calls == self.stall_on else self.seconds)
            return x

    model = Chain(4, width=8)
    for i in range(4):  # calls 1 and 2 are the traced forwards on 1 and 2 samples; call 3 the first timed run
        model.layers[i] = nn.Sequential(model.layers[i], Takes(0.02, stall_on=3 if i == 3 else None))
    batch = torch.randn(4, 8)
    result, _ = trace_step(model, lambda n: model(batch[:n]), lambda: model(batch))
    assert model.layers[3][1].calls == 2 + TIMED_RUNS
    assert max(result.segment_seconds) < 0.25, result.segment_seconds
    assert [len(s.segments) for s in make_partition(result, 2).stages] == [2, 2]


def test_global_batch_size_must_be_a_positive_int() -> None:
    with pytest.raises(ValueError, match="global_batch_size must be a positive int"):
        VarunaStrategy(global_batch_size=0)


def test_global_batch_size_must_split_over_the_replicas() -> None:
    # 4 processes, P=2: D=2 replicas cannot share 15 samples; raised while the Trainer is built, before any process
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    with mock.patch.dict(os.environ), pytest.raises(MisconfigurationException, match="choose a multiple of 2"):
        pl.Trainer(accelerator="cpu", devices=4, logger=False,
                   strategy=VarunaStrategy(pipeline_parallel_size=2, global_batch_size=15))


def test_fused_optimizer_with_a_loss_scaler_is_rejected() -> None:
    """A fused optimizer skips the scaler's unscale_, where the stages agree on overflow: refused at setup."""
    import lightning.pytorch as pl
    from lightning.pytorch.plugins import MixedPrecision
    from lightning.pytorch.utilities.exceptions import MisconfigurationException
    from torch.utils.data import DataLoader

    class Fused(TinyGPT):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

    with mock.patch.dict(os.environ), pytest.raises(MisconfigurationException, match="with fused=True"):
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, strategy=VarunaStrategy(pipeline_parallel_size=1), max_steps=1,
            plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )
        trainer.fit(Fused(n_layer=2), DataLoader(RandomTokens(n=8), batch_size=4))


def test_engine_refuses_options_that_are_not_a_config() -> None:
    with pytest.raises(TypeError, match=r"one EngineConfig, got 2.*PipelineEngine\(module, EngineConfig\("):
        PipelineEngine(nn.Linear(4, 1), 2)


def test_engine_takes_its_options_as_one_config_without_warning() -> None:
    config = EngineConfig(2, num_microbatches=4, schedule="1f1b")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = PipelineEngine(nn.Linear(4, 1), config)
    assert engine.config is config
    assert PipelineEngine(nn.Linear(4, 1)).config == EngineConfig()


def test_engine_refuses_auto_values_without_a_planner_naming_it() -> None:
    with pytest.raises(ValueError, match=r"leaves values to the planner.*planner=choose.*planning\.choice import"):
        PipelineEngine(nn.Linear(4, 1), EngineConfig(1, schedule="auto"))
    from lightning_varuna.pipeline.planning.choice import choose

    assert PipelineEngine(nn.Linear(4, 1), EngineConfig(1, schedule="auto"), planner=choose).planner is choose
    PipelineEngine(nn.Linear(4, 1), EngineConfig("auto"))  # P from the world size: nothing to plan
