"""Models built on the meta device: building, the dry run on meta, per-stage materialization, segment costs."""

from __future__ import annotations

import contextlib
import gc
import re
import weakref
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers.models import TinyGPT
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric

from lightning_varuna.pipeline import CutPoint, PartitionError
from lightning_varuna.pipeline.config import EngineConfig
from lightning_varuna.pipeline.engine import PipelineEngine, first_samples
from lightning_varuna.pipeline.model.dry_run import trace_step
from lightning_varuna.pipeline.model.meta_init import (
    has_meta_tensors,
    materialize,
    module_seed,
    move_real_tensors,
    on_meta,
    parameters_on_meta,
    to_meta,
    trace_unmaterialized,
)
from lightning_varuna.pipeline.model.partition import make_partition
from lightning_varuna.pipeline.model.segment_costs import CostCounter, DeviceRates, Linear, estimated_seconds

CPU = torch.device("cpu")


class Rotary(nn.Module):
    """No parameters; a non-persistent buffer computed at construction (and by reset_parameters)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.register_buffer("inv_freq", self._freq(), persistent=False)

    def _freq(self) -> torch.Tensor:
        return 1.0 / 100.0 ** (torch.arange(0, self.dim, 2, device=self.inv_freq.device if hasattr(self, "inv_freq")
                                            else None) / self.dim)

    def reset_parameters(self) -> None:
        self.inv_freq.copy_(self._freq())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.cat([self.inv_freq, self.inv_freq])


class Split(nn.Module):
    """A module with two parameters that may land on different stages (``b`` is used after the cut)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.empty(4, 4))
        self.b = nn.Parameter(torch.empty(4))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.a)
        nn.init.normal_(self.b)


class NoInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.rot = Rotary(4)
        self.split = Split()
        self.cut = CutPoint()
        self.out = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4, bias=False)
        self.head.weight = self.inp.weight  # tied, as Hugging Face ties an output head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.rot(self.inp(x)) @ self.split.a
        x = self.cut(x)
        return self.head(self.out(x) + self.split.b)


def test_parameters_on_meta_keeps_buffers_real_and_ties_intact() -> None:
    with parameters_on_meta():
        net = Net()
    assert all(p.is_meta for p in net.parameters())
    assert not net.rot.inv_freq.is_meta
    assert torch.equal(net.rot.inv_freq, Rotary(4).inv_freq)
    assert net.head.weight is net.inp.weight
    assert has_meta_tensors(net)
    # outside the block parameters are real again
    assert not has_meta_tensors(Net())


def test_materialized_values_do_not_depend_on_which_parameters_a_rank_keeps() -> None:
    def build(keep: set[str], seed: int = 7) -> dict[str, torch.Tensor]:
        with parameters_on_meta():
            net = Net()
        materialize(net, keep, torch.device("cpu"), seed)
        return {name: p.detach().clone() for name, p in net.named_parameters() if not p.is_meta}

    every = {name for name, _ in Net().named_parameters()}
    whole = build(every)
    assert set(whole) == every
    # one stage: the first module and one parameter of the split module (its other one is used on another stage)
    part = build({"inp.weight", "split.b"})
    assert set(part) == {"inp.weight", "split.b"}
    for name, value in part.items():
        assert torch.equal(value, whole[name]), name
    other_seed = build(every, seed=8)
    assert not torch.equal(other_seed["out.weight"], whole["out.weight"])
    assert module_seed(7, "out") != module_seed(7, "inp") != module_seed(8, "inp")


def test_materialize_keeps_the_tie_the_real_buffers_and_recomputes_meta_buffers() -> None:
    with parameters_on_meta():
        net = Net()
    freq = net.rot.inv_freq.clone()
    materialize(net, {"inp.weight", "inp.bias"}, torch.device("cpu"), 0)
    assert net.head.weight is net.inp.weight and not net.inp.weight.is_meta
    assert net.out.weight.is_meta  # not this rank's
    assert torch.equal(net.rot.inv_freq, freq)
    # built entirely on meta (buffers too): the module's reset_parameters recomputes the buffer
    with torch.device("meta"):
        built_on_meta = Net()
    assert built_on_meta.rot.inv_freq.is_meta
    materialize(built_on_meta, {"inp.weight"}, torch.device("cpu"), 0)
    assert torch.equal(built_on_meta.rot.inv_freq, freq)


def test_modules_without_reset_parameters_are_reported_and_zero_unless_param_init_fn_handles_them() -> None:
    with parameters_on_meta():
        net = nn.Sequential(nn.Linear(2, 2), NoInit())
    assert materialize(net, {"0.weight", "1.w"}, torch.device("cpu"), 0) == {"NoInit"}
    assert torch.equal(net[1].w, torch.zeros(4))

    def init(module: nn.Module) -> None:
        for param in module.parameters(recurse=False):
            param.fill_(0.5)

    with parameters_on_meta():
        net = nn.Sequential(nn.Linear(2, 2), NoInit())
    assert materialize(net, {"0.weight", "1.w"}, torch.device("cpu"), 0, param_init_fn=init) == set()
    assert torch.equal(net[1].w, torch.full((4,), 0.5)) and torch.equal(net[0].weight, torch.full((2, 2), 0.5))


def test_on_meta_swaps_every_real_tensor_and_puts_it_back() -> None:
    net = Net()
    weight, freq = net.out.weight, net.rot.inv_freq
    with on_meta(net):
        assert all(t.is_meta for t in (*net.parameters(), *net.buffers()))
        assert net.head.weight is net.inp.weight
    assert net.out.weight is weight and net.rot.inv_freq is freq


def test_move_real_tensors_leaves_meta_ones() -> None:
    with parameters_on_meta():
        net = Net()
    net.extra = nn.Linear(1, 1)
    move_real_tensors(net, torch.device("meta"))  # any device other than the tensors' own
    assert net.extra.weight.is_meta and net.rot.inv_freq.is_meta and isinstance(net.extra.weight, nn.Parameter)


def _lm_step(model: nn.Module):
    def step(batch):
        idx, targets = batch
        logits = model(idx)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    return step


def _trace(model: nn.Module, batch, meta: bool):
    step = _lm_step(model)
    if meta:
        batch = to_meta(batch)
        with on_meta(model):
            return trace_step(model, lambda n: step(first_samples(batch, n)))[0]
    return trace_step(model, lambda n: step(first_samples(batch, n)))[0]


def test_the_dry_run_on_meta_sees_what_the_real_one_sees_with_the_same_costs() -> None:
    batch = (torch.randint(64, (4, 16)), torch.randint(64, (4, 16)))
    real = _trace(TinyGPT(tie_weights=True, head_alias=True, sinusoidal=True), batch, meta=False)
    with parameters_on_meta():
        model = TinyGPT(tie_weights=True, head_alias=True, sinusoidal=True)
    meta = _trace(model, batch, meta=True)
    assert meta.cuts == real.cuts and meta.param_segments == real.param_segments
    assert meta.module_segments == real.module_segments and meta.crossings == real.crossings
    assert meta.costs == real.costs
    block = meta.costs[1]
    # per sample, one block: 4 linear layers (2 x 16 tokens x 32 x (96 + 32 + 128 + 128)) and two 16 x 16 x 32 products
    assert block.forward_flops == Linear(0.0, 2 * 16 * 32 * 384 + 2 * (2 * 16 * 16 * 32))
    assert block.saved_bytes.per_sample > 0 and block.param_bytes == 4 * sum(
        p.numel() for p in TinyGPT().blocks[0].parameters())


def test_attention_through_sdpa_is_counted_on_meta_and_on_cpu() -> None:
    class Attention(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = x.view(x.shape[0], 2, 16, 8)
            return F.scaled_dot_product_attention(q, q, q, is_causal=True).reshape(x.shape)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.att = Attention()
            self.cut = CutPoint()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.cut(self.att(self.lin(x).view(x.shape[0], 16, 16).reshape(x.shape[0], 256))).sum()

    model = Model()
    x = torch.randn(2, 16, 16)
    costs = {}
    for meta in (False, True):
        step = lambda n, m=meta: model(first_samples(to_meta(x) if m else x, n))  # noqa: E731
        with on_meta(model) if meta else torch.no_grad():
            costs[meta] = trace_step(model, step)[0].costs[0].forward_flops
    attention = 2 * (2 * 2 * 16 * 16 * 8)  # per sample: two heads, q@k and att@v
    assert costs[False] == costs[True]
    assert costs[True].per_sample == 2 * 16 * 16 * 16 + attention


def test_estimated_costs_balance_stages_without_timing() -> None:
    # cheap blocks, and a head whose FLOPs (vocabulary 4096) equal three blocks: estimated time puts it alone
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))
            self.cuts = nn.ModuleList(CutPoint() for _ in range(6))
            self.head = nn.Linear(64, 192, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block, cut in zip(self.blocks, self.cuts):
                x = cut(block(x))
            return self.head(x).sum()

    with parameters_on_meta():
        model = Model()
    x = torch.randn(4, 64)
    with on_meta(model):
        trace = trace_step(model, lambda n: model(first_samples(to_meta(x), n)))[0]
    plan = make_partition(trace, 2, microbatch=64)
    assert plan.balanced_by == "estimated"
    assert [len(s.segments) for s in plan.stages] in ([4, 3], [5, 2])
    assert "balanced by estimated" in plan.table()
    cost = trace.costs[0]
    rates = DeviceRates(flops_per_second=1.0, bytes_per_second=1e30)
    assert estimated_seconds(cost, 64, rates) == pytest.approx(3 * 2 * 64 * 64 * 64)
    assert make_partition(trace, 2, by="params").balanced_by == "params"


def test_the_dry_run_on_real_tensors_frees_its_activations_and_counting_keeps_gradients_exact() -> None:
    # exp and sigmoid save their own outputs for backward: neither counting saved bytes nor the step's result
    # (the loss, which holds the graph) may keep them alive
    kept: list[weakref.ref] = []

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.cut, self.b = nn.Linear(8, 8), CutPoint(), nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x).exp()
            kept.append(weakref.ref(h.untyped_storage()))
            return self.b(self.cut(torch.sigmoid(h))).sum()

    torch.manual_seed(0)
    model, x = Model(), torch.randn(4, 8)
    trace = trace_step(model, lambda n: model(first_samples(x, n)))[0]
    assert trace.costs[0].saved_bytes.per_sample > 0
    del trace
    gc.collect()
    assert len(kept) == 2 and all(ref() is None for ref in kept)

    model(x).backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with CostCounter(lambda: 0):
        model(x).backward()
    assert all(torch.equal(p.grad, r) for p, r in zip(model.parameters(), reference))


def test_a_step_that_cannot_run_on_meta_is_dry_run_with_placeholder_weights() -> None:
    """Reading a value (HF's mask code does with an attention_mask) and a tensor made without a device fail on meta."""
    with parameters_on_meta():
        model = nn.Sequential(nn.Linear(4, 1000), CutPoint(), nn.Linear(1000, 1))
    batch = torch.randn(4, 4)

    strides = []

    def step(x):
        strides.append(model[0].weight.stride())
        h = model[0](x) + torch.zeros(1000)  # made on the default device
        if (x[:, 0] > 100).any().item():  # a branch on a value
            h = h * 2
        return model[2](model[1](h)).sum()

    trace, cuts = trace_unmaterialized(model, lambda n: step(to_meta(batch)[:n]), lambda n: step(batch[:n]), CPU)
    assert trace.dry_run.startswith("placeholders (on meta: RuntimeError: ") and len(cuts) == 1
    assert trace.cuts[0].shape == (2, 1000) and set(trace.param_segments) == {"0.weight", "0.bias", "2.weight",
                                                                              "2.bias"}
    assert trace.costs[0].forward_flops.at(1) > 0
    assert all(p.is_meta for p in model.parameters()), "the model is given back on meta"
    assert strides[-1] == (0, 0), "a placeholder costs one element whatever its shape"
    assert "dry run on placeholders (on meta: RuntimeError" in make_partition(trace, 2).table()


def _peak_growth_mib(run) -> float:
    """How far this process's resident memory rose above its level before ``run()`` (the kernel's high-water mark)."""
    def status(key: str) -> float:
        return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024

    before = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets the high-water mark to the current resident size
    run()
    return status("VmHWM") - before


def test_the_placeholder_dry_run_copies_no_weight_and_still_counts_the_products() -> None:
    """A BLAS kernel copies a zero-stride weight whole; products with a placeholder are zeros, made without it."""
    def build(width: int, on_meta: bool = True) -> nn.Sequential:
        with parameters_on_meta() if on_meta else contextlib.nullcontext():
            model = nn.Sequential(nn.Linear(width, width * 2), CutPoint(), nn.Linear(width * 2, 8))
        model[2].bias = nn.Parameter(torch.arange(8.0))  # a real bias next to a placeholder weight (addmm)
        return model

    outputs = []

    def stepper(model, batch):
        def step(x):
            h = model[0](x)  # 3-d: matmul's mm with the transposed placeholder; its bias is one too (addmm)
            if (h.abs().sum() > 1).item():  # a branch on a value: the meta dry run fails
                h = h * 2
            out = model[2](model[1](h))
            outputs.append(out.detach())
            return out.sum()
        return lambda n: step(to_meta(batch)[:n]), lambda n: step(batch[:n])

    warm = build(8)
    trace_unmaterialized(warm, *stepper(warm, torch.randn(2, 3, 8)), CPU)  # lazy initializations happen here
    model = build(4096)  # the first weight: 128 MiB in fp32
    batch = torch.randn(2, 3, 4096)
    traced = []
    growth = _peak_growth_mib(lambda: traced.append(trace_unmaterialized(model, *stepper(model, batch), CPU)[0]))
    trace = traced[0]
    assert trace.dry_run.startswith("placeholders")
    assert growth < 64, f"the dry run's resident memory rose by {growth:.0f} MiB: a weight was copied"
    assert torch.equal(outputs[-1], torch.arange(8.0).expand(2, 3, 8)), "zeros, plus the real bias"
    # the same model with real zero weights, traced for real: the same FLOPs and saved bytes
    real = build(4096, on_meta=False)
    with torch.no_grad():
        for name, param in real.named_parameters():
            if name != "2.bias":
                param.zero_()
    reference = trace_step(real, stepper(real, batch)[1])[0]
    assert trace.costs == reference.costs


def test_a_step_that_fails_on_meta_and_on_placeholders_gets_an_error_that_says_why() -> None:
    with parameters_on_meta():
        model = nn.Sequential(nn.Linear(4, 4), CutPoint(), nn.Linear(4, 1))

    def step(batch):
        loss = model(batch).sum()
        if loss.item() == 0:  # on meta .item() raises; with placeholder weights the loss is 0
            raise ValueError("the loss is zero")
        return loss

    engine = PipelineEngine(model, EngineConfig(1))
    with pytest.raises(PartitionError, match=r"meta device.*\.item\(\).*ValueError: the loss is zero"):
        engine.setup(torch.randn(4, 4), step)


class _MetaTiny(pl.LightningModule):
    """Built in configure_model; its step creates a tensor on ``self.device`` and updates a metric."""

    def __init__(self, metric: bool = True) -> None:
        super().__init__()
        self.acc = MeanMetric() if metric else None
        self.register_buffer("scale", torch.full((4,), 0.5))

    def configure_model(self) -> None:
        if not hasattr(self, "net"):
            self.net = nn.Sequential(nn.Linear(4, 4), CutPoint(), nn.Linear(4, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = x * self.scale + torch.zeros(4, device=self.device)
        loss = F.mse_loss(self.net(x), y)
        if self.acc is not None:
            self.acc(loss)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(**strategy: object) -> pl.Trainer:
    from lightning_varuna import VarunaStrategy

    return pl.Trainer(strategy=VarunaStrategy(pipeline_parallel_size=1, num_microbatches=2, **strategy),
                      accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)


def test_lightning_builds_on_meta_only_where_asked_and_trains(tmp_path) -> None:
    trainer = _trainer()
    with trainer.init_module(empty_init=True):
        meta = TinyGPT(sinusoidal=True)
    with trainer.init_module():
        real = TinyGPT()
    assert all(p.is_meta for p in meta.parameters()) and not meta.inv_freq.is_meta
    assert not any(p.is_meta for p in real.parameters())

    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)
    model = _MetaTiny()
    update = vars(model.acc)["update"]  # torchmetrics wraps it per instance
    trainer.fit(model, data)
    assert not has_meta_tensors(model) and model.device == torch.device("cpu")
    assert vars(model.acc)["update"] is update and "forward" not in vars(model.acc), "the dry run's patches undone"
    assert model.acc.update_count == 2 * 2, "one update per micro-batch of the 2 steps, none from the dry run"
    assert all(torch.isfinite(p).all() for p in model.parameters())

    # a module the user built on meta (buffers too): materialized, and initialized by param_init_fn
    with torch.device("meta"):
        on_meta_model = _MetaTiny(metric=False)
        on_meta_model.configure_model()
    assert on_meta_model.scale.is_meta

    def init(module: nn.Module) -> None:
        if isinstance(module, _MetaTiny):
            module.scale.fill_(0.5)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()

    _trainer(param_init_fn=init).fit(on_meta_model, data)
    assert torch.equal(on_meta_model.scale, torch.full((4,), 0.5))
    # a metric built there has no state to start from: said before anything runs
    with torch.device("meta"):
        with_metric = _MetaTiny()
    with pytest.raises(ValueError, match=r"metric\(s\) acc were built on the meta device"):
        _trainer().fit(with_metric, data)


class _GradWatch(_MetaTiny):
    """Records, in the second step's schedule, whether the first step's gradient is still alive."""

    def __init__(self, hook: bool) -> None:
        super().__init__(metric=False)
        self.previous, self.alive = None, []

    def _seen(self, optimizer) -> None:
        self.alive.append(("hook", self.net[0].weight.grad is not None))

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.previous = weakref.ref(self.net[0].weight.grad)

    def training_step(self, batch, batch_idx):
        if self.previous is not None:
            self.alive.append(("schedule", self.previous() is not None))
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("hook", [False, True])
def test_last_steps_gradients_are_freed_before_the_schedule_unless_a_zero_grad_hook_reads_them(hook: bool) -> None:
    model = _GradWatch(hook)
    if hook:
        type(model).on_before_zero_grad = _GradWatch._seen  # is_overridden looks at the class
    try:
        _trainer().fit(model, DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4))
    finally:
        if hook:
            del type(model).on_before_zero_grad
    schedule = [alive for where, alive in model.alive if where == "schedule"]
    assert schedule and all(alive == hook for alive in schedule), model.alive
    if hook:
        assert ("hook", True) in model.alive, "the hook sees last step's gradients, as in a plain run"
