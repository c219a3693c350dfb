"""GradientSync's bucket order and overlap, and the merge of on_before_optimizer_step logs, in one process.

The all-reduce is replaced by a fake that records each call and sums two identical replicas (x 2), so the
averaged gradient must equal the local one.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_varuna.hook_logs import _plan, merge
from lightning_varuna.pipeline import Topology, grad_sync
from lightning_varuna.pipeline.grad_sync import GradientSync, default_bucket_bytes


class _Done:
    def wait(self) -> None:
        pass


@pytest.fixture
def launches(monkeypatch) -> list[tuple[int, str]]:
    calls: list[tuple[int, str]] = []

    def all_reduce(tensor, group=None, async_op=False):
        calls.append((tensor.numel(), group))
        tensor.mul_(2)  # two identical replicas
        return _Done()

    monkeypatch.setattr(grad_sync.dist, "all_reduce", all_reduce)
    return calls


def _setup(overlap: bool = True) -> tuple[nn.Sequential, GradientSync]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    topo = Topology(world_size=2, rank=0, pipeline_size=1, device=torch.device("cpu"), data_group="data")
    # 72 floats per bucket, filled from the last parameter: [2.bias, 2.weight, 1.bias], [1.weight, 0.bias], [0.weight]
    sync = GradientSync(topo, dict(model.named_parameters()), [], bucket_bytes=72 * 4, overlap=overlap)
    return model, sync


def _loss(model: nn.Module) -> torch.Tensor:
    return model(torch.randn(3, 4)).square().sum()


def test_buckets_hold_parameters_in_reverse_order() -> None:
    model, sync = _setup()
    names = {id(p): n for n, p in model.named_parameters()}
    assert [[names[id(p)] for p in b] for b in sync.buckets] == [
        ["2.bias", "2.weight", "1.bias"], ["1.weight", "0.bias"], ["0.weight"]
    ]


def test_each_bucket_starts_during_the_last_backward_in_order(launches) -> None:
    model, sync = _setup()
    seen_at_first_layer = []
    model[0].weight.register_post_accumulate_grad_hook(lambda p: seen_at_first_layer.append(len(launches)))
    _loss(model).backward()  # an earlier micro-batch: nothing starts
    assert launches == []
    with sync.overlapping():
        _loss(model).backward()
    assert [n for n, _ in launches] == [26, 72, 32] and sync.overlapped_buckets == 3
    assert seen_at_first_layer[-1] >= 1, "the last layers' bucket started before the first layer's gradient"
    expected = [p.grad.clone() for p in model.parameters()]  # both micro-batches, accumulated
    sync.start()
    assert len(launches) == 3, "start() starts only what is left"
    sync.finish()
    for p, want in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, want)  # averaged over two identical replicas
    assert sync.reduced_bytes == (26 + 72 + 32) * 4 and not sync.started


def test_a_bucket_without_gradient_waits_for_start_and_keeps_the_order(launches) -> None:
    model, sync = _setup()
    model[1].weight.requires_grad_(False)  # bucket 1 is not complete; bucket 2 may not overtake it
    with sync.overlapping():
        _loss(model).backward()
    assert [n for n, _ in launches] == [26]
    sync.start()
    assert [n for n, _ in launches] == [26, 72, 32]
    sync.finish()
    assert model[1].weight.grad is not None and not model[1].weight.grad.any()  # zeros, as averaged


def test_without_overlap_everything_starts_in_start(launches) -> None:
    model, sync = _setup(overlap=False)
    with sync.overlapping():
        _loss(model).backward()
    assert launches == []
    sync.sync()
    assert [n for n, _ in launches] == [26, 72, 32]
    with pytest.raises(RuntimeError, match="twice"):
        sync.start()
        sync.start()


def test_default_bucket_size() -> None:
    assert default_bucket_bytes(10 * 2**20) == 10 * 2**20 // 4
    assert default_bucket_bytes(1000) == 64 * 2**10
    assert default_bucket_bytes(10 * 2**30) == 25 * 2**20


def test_merge_unions_keys_and_recomputes_totals() -> None:
    norms = {"grad_2.0_norm/a": 3.0, "grad_2.0_norm/tied": 4.0, "grad_2.0_norm/b": 12.0}
    # stage 0 holds a and the tied copy, stage 1 the tied copy and b; each logs its local total
    stage0 = {"grad_2.0_norm/a": 3.0, "grad_2.0_norm/tied": 4.0, "grad_2.0_norm_total": 5.0, "lr": 0.1}
    stage1 = {"grad_2.0_norm/tied": 4.0, "grad_2.0_norm/b": 12.0, "grad_2.0_norm_total": 160**0.5, "lr": 0.2}
    metas = [tuple((k, ()) for k in stage) for stage in (stage0, stage1)]
    flat = torch.tensor([*stage0.values(), *stage1.values()], dtype=torch.float64)
    merged = {name: float(value) for name, value, _ in merge(_plan(metas, torch.device("cpu")), flat)}
    assert set(merged) == {*norms, "grad_2.0_norm_total", "lr"}
    assert merged["grad_2.0_norm_total"] == pytest.approx(13.0)  # sqrt(9 + 16 + 144): the tied one once
    assert merged["lr"] == 0.1  # logged on several stages: the first stage's
    assert {k: merged[k] for k in norms} == norms


def test_merge_of_inf_norms_and_of_totals_alone() -> None:
    metas = [(("grad_inf_norm/a", ()), ("grad_inf_norm_total", ())),
             (("grad_inf_norm/b", ()), ("grad_inf_norm_total", ()))]
    flat = torch.tensor([2.0, 2.0, 7.0, 7.0], dtype=torch.float64)
    merged = {n: float(v) for n, v, _ in merge(_plan(metas, torch.device("cpu")), flat)}
    assert merged["grad_inf_norm_total"] == 7.0
    metas = [(("grad_2.0_norm_total", ()),), (("grad_2.0_norm_total", ()),)]
    flat = torch.tensor([3.0, 4.0], dtype=torch.float64)
    merged = {n: float(v) for n, v, _ in merge(_plan(metas, torch.device("cpu")), flat)}
    assert merged["grad_2.0_norm_total"] == pytest.approx(5.0)
