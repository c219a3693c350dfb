"""What the dry run does to the model and the RNGs is undone (``pipeline.no_trace``), in one process."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import BinaryAccuracy

from lightning_varuna.pipeline.model.no_trace import no_trace


class Stateful(nn.Module):
    """A module whose forward changes every kind of state a user's step may change."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.norm = nn.BatchNorm1d(3)
        self.mean = MeanMetric()
        self.accuracy = BinaryAccuracy()
        self.outputs: list[torch.Tensor] = []
        self.totals = {"sum": torch.zeros(3), "calls": 0}
        self.running = torch.zeros(3)  # a plain tensor attribute, changed in place
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.linear(x))
        self.mean.update(y.sum(dim=1))  # fed with .update(): in-place on its state tensors
        self.accuracy(y[:, 0].sigmoid(), (x[:, 0] > 0).long())  # called (forward)
        self.outputs.append(y.detach())
        self.totals["sum"] += y.detach().sum(dim=0)
        self.totals["calls"] += 1
        self.running.add_(1.0)
        self.calls += 1
        self.last = y.detach()
        self.train(False)
        return y + torch.randn_like(y) * 0 + random.random() * 0 + float(np.random.rand()) * 0


def test_no_trace_puts_back_attributes_buffers_metrics_and_rngs() -> None:
    torch.manual_seed(0)
    model = Stateful()
    model(torch.randn(4, 3))  # some state before the dry run
    model.train(True)
    outputs, totals, running = model.outputs, model.totals, model.running
    before = {
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "mean": float(model.mean.compute()),
        "mean_updates": model.mean.update_count,
        "accuracy": float(model.accuracy.compute()),
        "outputs": [o.clone() for o in outputs],
        "sum": totals["sum"].clone(),
        "running": running.clone(),
        "last": model.last.clone(),
    }
    rngs = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())

    with no_trace(model, torch.device("cpu")):
        for _ in range(3):
            model(torch.randn(2, 3))
        model.added = True
        torch.rand(5), random.random(), np.random.rand()

    assert model.training and model.calls == 1 and not hasattr(model, "added")
    assert torch.equal(model.last, before["last"])
    assert model.outputs is outputs and len(outputs) == 1 and torch.equal(outputs[0], before["outputs"][0])
    assert model.totals is totals and totals["calls"] == 1 and torch.equal(totals["sum"], before["sum"])
    assert model.running is running and torch.equal(running, before["running"]), "put back in place"
    for name, value in model.named_buffers():
        assert torch.equal(value, before["buffers"][name]), name
    assert model.mean.update_count == before["mean_updates"] == 1
    assert float(model.mean.compute()) == before["mean"]
    assert float(model.accuracy.compute()) == before["accuracy"]
    assert torch.equal(torch.get_rng_state(), rngs[0]) and random.getstate() == rngs[1]
    assert (np.random.get_state()[1] == rngs[2]).all()


def test_metric_states_are_not_shared_with_the_dry_run() -> None:
    # copy.copy of a state tensor shares its storage, and .update() adds to the state in place
    metric = MeanMetric()
    metric.update(torch.tensor([1.0, 3.0]))
    holder = nn.Module()
    holder.metric = metric
    with no_trace(holder, torch.device("cpu")):
        metric.update(torch.tensor([100.0]))
    metric.update(torch.tensor([5.0]))
    assert float(metric.compute()) == 3.0 and float(metric.weight) == 3.0


class Lazy(nn.Module):
    """Creates a metric, a buffer and a parameter on its first call, as steps that build what they log lazily do."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "accuracy"):
            self.accuracy = BinaryAccuracy()
            self.register_buffer("seen", torch.zeros(()), persistent=False)
            self.scale = nn.Parameter(torch.ones(()))
        self.accuracy.update(x[:, 0].sigmoid(), (x[:, 1] > 0).long())
        self.seen += len(x)
        return x * self.scale


def test_submodules_buffers_and_parameters_created_by_the_dry_run_are_gone() -> None:
    model = Lazy()
    model.register_buffer("kept", torch.ones(()), persistent=False)
    with no_trace(model, torch.device("cpu")):
        model(torch.randn(4, 3))
    assert not hasattr(model, "accuracy") and not hasattr(model, "seen") and not hasattr(model, "scale")
    assert dict(model.named_buffers()).keys() == {"kept"} and model._non_persistent_buffers_set == {"kept"}
    x = torch.tensor([[2.0, 1.0], [-2.0, 1.0]])
    model(x)  # the first real step creates them afresh: only its own samples count
    assert float(model.accuracy.compute()) == 0.5 and float(model.seen) == 2
