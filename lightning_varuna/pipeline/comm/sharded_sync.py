"""Gradient sync for a sharded optimizer (ZeRO stage 1): reduce-scatter the gradients, all-gather the parameters.

Each of the D replicas of a rank's parameters keeps the optimizer state of, and steps, one shard of every
parameter: the rows ``Shard(0)`` of :class:`torch.distributed.tensor.DTensor` gives it (``ceil(rows / D)`` rows
per replica in replica order; a replica past the last row holds none; a 0-dim parameter belongs to replica 0).
Row shards are rectangular, so the state saves as DTensors that DCP reshards to any other layout.

:class:`ShardedGradientSync` keeps :class:`~lightning_varuna.pipeline.comm.grad_sync.GradientSync`'s buckets and
its "bucket is ready" trigger; a bucket is laid out replica by replica (each replica's rows of every parameter of
the bucket, padded to the same length) and reduce-scattered instead of all-reduced, so every replica receives the
average of its own rows only. After the step each bucket's updated rows are all-gathered. A reduce-scatter and an
all-gather of N bytes move what an all-reduce of N bytes moves.

Shared (tied) copies are still summed by an all-reduce over every holder of every replica (each holder then
steps its rows of the same sum, so the copies stay equal without traffic between stages). After
:meth:`~ShardedGradientSync.finish` a parameter's ``.grad`` holds the averaged gradient on this replica's rows
and zeros elsewhere: the replicas' ``.grad`` add up to the whole averaged gradient.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_varuna.fault.failures import PipelineError, peer_error
from lightning_varuna.pipeline.comm.grad_sync import GradientSync
from lightning_varuna.pipeline.topology import Topology

__all__ = ["ShardedGradientSync", "shard_rows"]

# torch 2.14 names them *_single and deprecates the *_tensor names that torch 2.13 has alone
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def shard_rows(param: Tensor, shards: int, index: int) -> tuple[int, int]:
    """The flat element range ``[start, stop)`` of ``param`` that shard ``index`` of ``shards`` holds.

    Rows (dim 0) are split as ``DTensor``'s ``Shard(0)`` splits them; a 0-dim parameter is shard 0's.
    """
    numel = param.numel()
    if param.dim() == 0:
        return (0, numel) if index == 0 else (numel, numel)
    rows = param.shape[0]
    row = numel // rows if rows else 0
    per = math.ceil(rows / shards) if rows else 0
    first = min(index * per, rows)
    last = min(first + per, rows)
    return first * row, last * row


@dataclass
class _Layout:
    """A list of parameters laid out replica by replica, ``segment`` elements each.

    ``pieces[j]`` are replica j's ``(param, start, stop, offset)``: its flat elements ``[start, stop)`` at
    ``offset`` of the flat buffer.
    """

    pieces: list[list[tuple[nn.Parameter, int, int, int]]]
    segment: int


def _layout(params: list[nn.Parameter], shards: int) -> _Layout:
    lengths = [sum(b - a for a, b in (shard_rows(p, shards, j) for p in params)) for j in range(shards)]
    segment = max(lengths, default=0)
    pieces: list[list[tuple[nn.Parameter, int, int, int]]] = []
    for j in range(shards):
        offset = j * segment
        mine = []
        for p in params:
            a, b = shard_rows(p, shards, j)
            if b > a:
                mine.append((p, a, b, offset))
                offset += b - a
        pieces.append(mine)
    return _Layout(pieces, segment)


class ShardedGradientSync(GradientSync):
    """:class:`GradientSync` for an optimizer sharded over the replicas (``zero_stage=1``); needs D > 1.

    The arguments are :class:`GradientSync`'s. Besides its methods: :meth:`gather_parameters` after each
    optimizer step, :attr:`shards` (each trainable parameter's flat range on this replica).
    """

    def __init__(
        self,
        topology: Topology,
        params: dict[str, nn.Parameter],
        tied: Iterable[tuple[str, tuple[int, ...]]],
        bucket_bytes: int | None = None,
        overlap: bool = True,
    ) -> None:
        if topology.data_size < 2:
            raise ValueError("ShardedGradientSync shards over replicas: it needs a data-parallel size above 1.")
        self._layouts: dict[int, _Layout] = {}
        self._layouts_of: list[list[nn.Parameter]] | None = None
        self._segments: dict[int, Tensor] = {}
        self._scattered: list[int] = []
        super().__init__(topology, params, tied, bucket_bytes, overlap)
        self._tied_params = [p for _, group in self.tied_groups for p in group]
        trainable = [*self._plain, *self._tied_params]
        held = set(trainable)
        uneven = [n for n, p in params.items() if p in held and not p.is_contiguous()]
        if uneven:
            raise ValueError(f"zero_stage=1 shards parameters by rows; {', '.join(uneven)} is not contiguous."
                             " Make it contiguous (e.g. nn.Parameter(tensor.contiguous())) or use zero_stage=0.")
        self.shards: dict[nn.Parameter, tuple[int, int]] = {
            p: shard_rows(p, topology.data_size, topology.replica) for p in trainable
        }
        """Each trainable parameter's flat element range ``[start, stop)`` held (and stepped) by this replica."""
        self.gathered_bytes = 0
        """Payload bytes this rank has all-gathered (its output buffers), all steps together."""

    # -- layouts ------------------------------------------------------------------------------------------
    def _layout_of(self, key: int, params: list[nn.Parameter]) -> _Layout:
        if self._layouts_of is not self.buckets:  # the buckets were rebuilt (bucket_bytes changed)
            self._layouts, self._segments, self._layouts_of = {}, {}, self.buckets
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = _layout(params, self.topology.data_size)
        return layout

    def _buffers(self, key: int, layout: _Layout, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        whole = layout.segment * self.topology.data_size
        flat, segment = self._flat.get(key), self._segments.get(key)
        if flat is None or flat.numel() < whole:  # zeros: the padding is never written
            flat = self._flat[key] = torch.zeros(whole, dtype=dtype, device=device)
        flat = flat[:whole]
        if segment is None or segment.numel() != layout.segment:
            segment = self._segments[key] = torch.zeros(layout.segment, dtype=dtype, device=device)
        return flat, segment

    # -- gradients ----------------------------------------------------------------------------------------
    def _launch_bucket(self) -> None:
        i = self._launched
        self._launched += 1
        params = self.buckets[i]
        layout = self._layout_of(i, params)
        flat, segment = self._buffers(i, layout, params[0].dtype, params[0].device)
        for pieces in layout.pieces:
            for p, a, b, offset in pieces:
                view = flat[offset : offset + b - a]
                grad, earlier = p.grad, self._accumulated.get(p)
                if grad is None and earlier is None:
                    view.zero_()
                elif earlier is None or grad is None:
                    view.copy_((grad if grad is not None else earlier).reshape(-1)[a:b])
                else:
                    torch.add(grad.reshape(-1)[a:b], earlier.reshape(-1)[a:b], out=view)
        flat.div_(self.topology.data_size)
        group = self.topology.data_group
        if not self._pending:
            self.started_at = time.perf_counter()
        try:
            work = _reduce_scatter(segment, flat, group=group, async_op=True)
        except Exception as err:  # noqa: BLE001 - a peer that is already gone fails here
            raise self._error("starting", group, err) from err
        self._pending.append((work, segment, [], group))  # no parameter: finish() writes the rows itself
        self._scattered.append(i)
        self.reduced_bytes += flat.numel() * flat.element_size()

    def finish(self) -> None:
        """Waits for the reductions; ``.grad`` gets the averaged gradient on this replica's rows, zeros elsewhere."""
        scattered, self._scattered = self._scattered, []
        super().finish()
        me = self.topology.replica
        for i in scattered:
            segment, base = self._segments[i], self._layouts[i].segment * me
            for p, a, b, offset in self._layouts[i].pieces[me]:
                _grad(p).view(-1)[a:b].copy_(segment[offset - base : offset - base + b - a])
        for p, (a, b) in self.shards.items():
            if p.grad is not None:
                flat = p.grad.view(-1)
                flat[:a].zero_()
                flat[b:].zero_()

    def _flatten(self, key: int, params: list[nn.Parameter]) -> Tensor:
        """GradientSync's flattening (of tied copies), into the start of a buffer the all-gather may lengthen."""
        flat = self._flat.get(key)
        numel = sum(p.numel() for p in params)
        if flat is None or flat.numel() < numel:
            flat = self._flat[key] = torch.empty(numel, dtype=params[0].dtype, device=params[0].device)
        self._flat[key] = flat[:numel]
        try:
            return super()._flatten(key, params)
        finally:
            self._flat[key] = flat

    def discard(self) -> None:
        """Waits for the reductions started and drops their results (``.grad`` stays as it is)."""
        self._scattered = []
        super().discard()

    def local_norm_sq(self, norm_type: float = 2.0) -> Tensor:
        """This replica's rows' share of the squared global norm (sum it over every rank of the job)."""
        grads = [
            p.grad.view(-1)[self.shards[p][0] : self.shards[p][1]]
            for n, p in self.params.items()
            if p.grad is not None and n not in self.not_counted and p in self.shards
        ]
        if not grads:
            return torch.zeros((), device=self.topology.device, dtype=torch.float32)
        norms = torch._foreach_norm(grads, norm_type)
        return torch.stack([n.float() for n in norms]).pow(norm_type).sum()

    def _error(self, what: str, group: object, err: Exception) -> PipelineError:
        if group is not self.topology.data_group:
            return super()._error(what, group, err)
        return peer_error(self.topology, f"{what} the reduce-scatter of gradients over replicas", err)

    def _gather_error(self, what: str, err: Exception) -> PipelineError:
        return peer_error(self.topology, f"{what} the all-gather of the updated parameters over replicas", err)

    # -- parameters ---------------------------------------------------------------------------------------
    def gather_parameters(self) -> None:
        """All-gathers every trainable parameter's rows from the replica that stepped them (after each step)."""
        lists = [*self.buckets, *([p for p in group if p.requires_grad] for _, group in self.tied_groups)]
        me, group = self.topology.replica, self.topology.data_group
        pending = []
        for i, params in enumerate(lists):
            if not params:
                continue
            key = i  # a tied list shares its buffer with its all-reduce (GradientSync's key for it)
            layout = self._layout_of(key, params)
            flat, segment = self._buffers(key, layout, params[0].dtype, params[0].device)
            base = layout.segment * me
            with torch.no_grad():
                for p, a, b, offset in layout.pieces[me]:
                    segment[offset - base : offset - base + b - a].copy_(p.detach().view(-1)[a:b])
            try:
                work = _all_gather(flat, segment, group=group, async_op=True)
            except Exception as err:  # noqa: BLE001 - a peer that is already gone fails here
                raise self._gather_error("starting", err) from err
            pending.append((work, flat, layout))
            self.gathered_bytes += flat.numel() * flat.element_size()
        for work, flat, layout in pending:
            try:
                work.wait()
            except Exception as err:  # noqa: BLE001 - a peer that failed or hung
                raise self._gather_error("waiting for", err) from err
            with torch.no_grad():
                for j, pieces in enumerate(layout.pieces):
                    if j != me:
                        for p, a, b, offset in pieces:
                            p.detach().view(-1)[a:b].copy_(flat[offset : offset + b - a])


def _grad(p: nn.Parameter) -> Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


