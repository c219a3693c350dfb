"""Gradient sync once per optimizer step: data-parallel averaging, tied copies summed, global norms.

- Each stage's gradients are averaged over its D replicas in flat buckets (one all-reduce per bucket,
  all buckets in flight at once), never per micro-batch.
- A parameter held by several stages (found by the dry run, e.g. a tied embedding and head) has its copies'
  gradients summed over every holder of every replica (and divided by D), so the copies stay identical.
- The global gradient norm counts each parameter once: a tied parameter only on its first holder stage.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_varuna.comm import Topology

__all__ = ["GradientSync"]


class GradientSync:
    """Synchronises the gradients of one stage's parameters.

    Args:
        topology: The process grid.
        params: This stage's parameters by full-model name.
        tied: ``(name, stages)`` for each parameter held by more than one stage (same order on every rank).
        bucket_bytes: Size of a data-parallel all-reduce bucket.
    """

    def __init__(
        self,
        topology: Topology,
        params: dict[str, nn.Parameter],
        tied: Iterable[tuple[str, tuple[int, ...]]],
        bucket_bytes: int = 25 * 2**20,
    ) -> None:
        self.topology = topology
        self.params = params
        tied = list(tied)
        self.tied_names = {name for name, _ in tied}
        # every rank creates every group, in the same order, whether or not it belongs to it
        self.tied_groups: list[tuple[object, list[nn.Parameter]]] = []
        by_stages: dict[tuple[int, ...], list[str]] = {}
        for name, stages in tied:
            by_stages.setdefault(stages, []).append(name)
        for stages, names in sorted(by_stages.items()):
            group = topology.stages_group(stages) if topology.world_size > 1 else None
            if topology.stage in stages:
                self.tied_groups.append((group, [params[n] for n in names if params[n].requires_grad]))
        self.not_counted = {
            name for name, stages in tied if topology.stage in stages and topology.stage != stages[0]
        }
        plain = [p for n, p in params.items() if n not in self.tied_names and p.requires_grad]
        self.buckets = _buckets(plain, bucket_bytes)
        self._flat: list[Tensor | None] = [None] * len(self.buckets)
        self._pending: list[tuple[dist.Work, Tensor, list[nn.Parameter]]] = []

    def sync(self) -> None:
        """Averages over replicas and sums tied copies; call once per optimizer step, on every rank."""
        self.start()
        self.finish()

    def start(self) -> None:
        """Starts the reductions of the current gradients (asynchronous); :meth:`finish` completes them.

        Called as soon as a stage's last backward of the step is done, the reductions run while the other
        stages finish their schedules and Lightning does its bookkeeping.
        """
        if self._pending:
            raise RuntimeError("GradientSync.start() called twice without finish().")
        d = self.topology.data_size
        if d > 1:
            for i, bucket in enumerate(self.buckets):
                flat = self._flatten(i, bucket)
                flat.div_(d)
                work = dist.all_reduce(flat, group=self.topology.data_group, async_op=True)
                self._pending.append((work, flat, bucket))
        for group, tied in self.tied_groups:
            if tied:
                flat = torch.cat([_grad(p).reshape(-1) for p in tied])
                flat.div_(d)
                self._pending.append((dist.all_reduce(flat, group=group, async_op=True), flat, tied))

    def finish(self) -> None:
        """Waits for the reductions :meth:`start` began and writes the results into the gradients."""
        pending, self._pending = self._pending, []
        for work, flat, params in pending:
            work.wait()
            _unflatten(flat, params)

    @property
    def started(self) -> bool:
        """Whether reductions are in flight."""
        return bool(self._pending)

    def local_norm_sq(self, norm_type: float = 2.0) -> Tensor:
        """This stage's share of the squared global norm (a tied parameter counted on its first stage)."""
        grads = [p.grad for n, p in self.params.items() if p.grad is not None and n not in self.not_counted]
        device = self.topology.device
        if not grads:
            return torch.zeros((), device=device, dtype=torch.float32)
        norms = torch._foreach_norm(grads, norm_type)
        return torch.stack([n.float() for n in norms]).pow(norm_type).sum()

    def _flatten(self, i: int, bucket: list[nn.Parameter]) -> Tensor:
        flat = self._flat[i]
        numel = sum(p.numel() for p in bucket)
        if flat is None or flat.numel() != numel:
            flat = self._flat[i] = torch.empty(numel, dtype=bucket[0].dtype, device=bucket[0].device)
        offset = 0
        for p in bucket:
            n = p.numel()
            if p.grad is None:
                flat[offset : offset + n].zero_()
            else:
                flat[offset : offset + n].copy_(p.grad.reshape(-1))
            offset += n
        return flat


def _grad(p: nn.Parameter) -> Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def _unflatten(flat: Tensor, params: list[nn.Parameter]) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        _grad(p).copy_(flat[offset : offset + n].view_as(p))
        offset += n


def _buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not buckets or size + nbytes > bucket_bytes or buckets[-1][0].dtype != p.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets
