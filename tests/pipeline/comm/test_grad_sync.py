"""GradientSync's bucket order and overlap, in one process.

The all-reduce is replaced by a fake that records each call and sums two identical replicas (x 2), so the
averaged gradient must equal the local one.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_varuna.pipeline import Topology
from lightning_varuna.pipeline.comm import grad_sync
from lightning_varuna.pipeline.comm.grad_sync import GradientSync, default_bucket_bytes


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
    torch.manual_seed(1)
    inputs = [torch.randn(3, 4), torch.randn(3, 4)]
    twin = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    twin.load_state_dict(model.state_dict())
    for x in inputs:  # both micro-batches, accumulated, on a copy that is not synced
        twin(x).square().sum().backward()
    model(inputs[0]).square().sum().backward()  # an earlier micro-batch: nothing starts
    assert launches == []
    with sync.overlapping():
        model(inputs[1]).square().sum().backward()
    assert [n for n, _ in launches] == [26, 72, 32] and sync.overlapped_buckets == 3
    assert seen_at_first_layer[-1] >= 1, "the last layers' bucket started before the first layer's gradient"
    # a started bucket holds its gradients in its flat buffer only
    assert all(p.grad is None for p in model.parameters())
    sync.start()
    assert len(launches) == 3, "start() starts only what is left"
    sync.finish()
    for p, want in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, want.grad)  # averaged over two identical replicas
    # each gradient is a view of its bucket's reduced buffer: no second copy
    assert model[2].bias.grad.untyped_storage().data_ptr() == model[2].weight.grad.untyped_storage().data_ptr()
    assert sync.reduced_bytes == (26 + 72 + 32) * 4 and not sync.started
    # at most one bucket held twice (during its copy) beyond the gradients themselves
    assert sync.peak_held_bytes <= (130 + 72) * 4


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
