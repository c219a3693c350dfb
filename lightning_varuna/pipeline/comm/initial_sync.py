"""Replicas that start in sync: every copy of a stage, and of a parameter shared by stages, starts equal.

Each process builds the whole model itself, so without a seed every process has its own random weights. Once
the model is partitioned, each stage's parameters and buffers are broadcast from replica 0 over the stage's
data-parallel group, and each parameter held by several stages (a tied embedding and head) from its first
holder in replica 0 over the group of all its copies, as ``DistributedDataParallel`` broadcasts rank 0's state
when it is created. After that, averaged gradients and identical optimizer steps keep the copies equal.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_varuna.pipeline.topology import Topology

__all__ = ["BUCKET_BYTES", "broadcast_initial_state"]

BUCKET_BYTES = 64 * 2**20
"""Most bytes broadcast in one call (tensors are flattened into buckets of one dtype up to this size)."""


def broadcast_initial_state(
    topology: Topology, module: nn.Module, tied: Iterable[tuple[str, tuple[int, ...]]]
) -> None:
    """Makes every replica's copy of this stage, and every copy of a tied parameter, equal to replica 0's.

    Collective: every rank calls it once the model is partitioned (with the same ``tied`` on every rank).

    Args:
        topology: The process grid.
        module: The partitioned model (this stage's parameters; other stages' freed).
        tied: ``(name, stages)`` of each parameter held by more than one stage.
    """
    if topology.world_size == 1:
        return
    tied = list(tied)
    tied_names = {name for name, _ in tied}
    params = dict(module.named_parameters())
    if topology.data_size > 1:
        own: list[Tensor] = [p for name, p in params.items() if name not in tied_names]
        own += [b for b in module.buffers() if not _is_placeholder(b)]
        _broadcast(own, topology.rank_of(topology.stage, 0), topology.data_group)
    by_stages: dict[tuple[int, ...], list[str]] = {}
    for name, stages in tied:
        by_stages.setdefault(stages, []).append(name)
    # every rank creates every group in the same order (GradientSync asks for the same ones, in the same order)
    for stages, names in sorted(by_stages.items()):
        group = topology.stages_group(stages)
        if topology.stage in stages:
            _broadcast([params[n] for n in names], topology.rank_of(stages[0], 0), group)


def _is_placeholder(tensor: Tensor) -> bool:
    """Whether ``tensor`` stands in for another stage's parameter (zero strides: one element of memory)."""
    return any(stride == 0 and size > 1 for stride, size in zip(tensor.stride(), tensor.shape))


@torch.no_grad()
def _broadcast(tensors: Sequence[Tensor], src: int, group: dist.ProcessGroup | None) -> None:
    for bucket in _buckets(tensors):
        if len(bucket) == 1 and bucket[0].is_contiguous():
            dist.broadcast(bucket[0].detach(), src, group=group)  # in place
            continue
        flat = torch.cat([t.detach().reshape(-1) for t in bucket])
        dist.broadcast(flat, src, group=group)
        offset = 0
        for t in bucket:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def _buckets(tensors: Sequence[Tensor]) -> list[list[Tensor]]:
    by_kind: dict[tuple[torch.dtype, torch.device], list[list[Tensor]]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for t in tensors:
        kind = (t.dtype, t.device)
        buckets = by_kind.setdefault(kind, [[]])
        nbytes = t.numel() * t.element_size()
        if buckets[-1] and sizes[kind] + nbytes > BUCKET_BYTES:
            buckets.append([])
            sizes[kind] = 0
        buckets[-1].append(t)
        sizes[kind] = sizes.get(kind, 0) + nbytes
    return [b for buckets in by_kind.values() for b in buckets if b]
