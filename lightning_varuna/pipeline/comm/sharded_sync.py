"""Gradient sync for a sharded optimizer (ZeRO stage 1): reduce-scatter the gradients, all-gather the parameters.

Each of the D replicas of a rank's parameters keeps the optimizer state of, and steps, one shard of every
parameter: the rows ``Shard(0)`` of :class:`torch.distributed.tensor.DTensor` gives it (``ceil(rows / D)`` rows
per replica in replica order; a replica past the last row holds none; a 0-dim parameter belongs to replica 0).
Row shards are rectangular, so the state saves as DTensors that DCP reshards to any other layout.

:class:`ShardedGradientSync` keeps :class:`~lightning_varuna.pipeline.comm.grad_sync.GradientSync`'s buckets and
its "bucket is ready" trigger; a bucket is laid out replica by replica (each replica's rows of every parameter of
the bucket, padded to the same length) and reduce-scattered instead of all-reduced, so every replica receives the
average of its own rows only. After the step each replica's updated rows are sent to the others. A ring
reduce-scatter and all-gather of N bytes send what a ring all-reduce of N bytes sends, ``2 (D - 1) / D * N`` per
rank, and so do the transfers used on gloo:

- gloo's ``reduce_scatter_tensor`` runs an all-reduce of the whole input on a copy (the whole bucket's bytes again
  on the wire and in memory) and ``all_gather_into_tensor`` stages the whole output in a temporary; on gloo the
  reduce-scatter is an ``all_to_all_single`` of the replica-major bucket (each replica receives the others' copies
  of its rows, ``(D - 1) / D`` of the bucket sent per rank, no hidden buffer) summed locally in replica order, and
  the all-gather is point-to-point: each replica sends its rows of each parameter straight from the parameter and
  receives the others' rows straight into it (no staging). With NCCL the native reduce-scatter and all-gather run.
- Memory: starting a bucket moves its gradients into the flat buffer (``.grad`` dropped), so at most
  :data:`IN_FLIGHT` buckets' receive buffers exist beyond the gradients themselves (a third bucket waits for the
  first); a finished bucket keeps only this replica's segment until :meth:`ShardedGradientSync.finish`.

Shared (tied) copies are still summed by an all-reduce over every holder of every replica (each holder then
steps its rows of the same sum, so the copies stay equal without traffic between stages). After
:meth:`~ShardedGradientSync.finish` a parameter's ``.grad`` holds the averaged gradient on this replica's rows
and zeros elsewhere: the replicas' ``.grad`` add up to the whole averaged gradient.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeAlias, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_varuna.failstop.failures import PipelineError, peer_error
from lightning_varuna.pipeline.comm.grad_sync import GradientSync
from lightning_varuna.pipeline.topology import Topology

__all__ = ["IN_FLIGHT", "ShardedGradientSync", "shard_rows"]

IN_FLIGHT = 1
"""Buckets whose reduce-scatter may be in flight at once on gloo (each holds a receive buffer of its size).

gloo runs a group's collectives one after another, so a second one in flight would only wait, holding its
buffers: the next bucket's start waits for the previous one instead (the backward goes on meanwhile).
"""

# torch 2.14 names them *_single and deprecates the *_tensor names that torch 2.13 has alone
_Group: TypeAlias = "dist.ProcessGroup | None"
_native_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_native_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


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
        # (bucket, work, its flat gradients, the segment received, the group that sums it next)
        self._in_flight: collections.deque[tuple[int, dist.Work, Tensor, Tensor, _Group]] = collections.deque()
        self._segments: dict[int, Tensor] = {}
        self._summing: list[tuple[dist.Work, dist.ProcessGroup | None]] = []
        tied = list(tied)
        super().__init__(topology, params, tied, bucket_bytes, overlap)
        # a tied parameter's rows are summed over its holders within the replica, after the reduce-scatter
        self._replica_tied_groups: list[dist.ProcessGroup | None] = []
        for stages in sorted({stages for _, stages in tied}):
            groups = [topology.stages_group(stages, replica) for replica in range(topology.data_size)]
            if topology.stage in stages:
                self._replica_tied_groups.append(groups[topology.replica])
        # gloo: the exchanges of the module doc; other backends (NCCL) run the native collectives
        self._gloo = dist.get_backend(topology.data_group) == "gloo"
        self._replica_ranks = dist.get_process_group_ranks(topology.made_data_group())
        self._tied_params = [p for _, group in self.tied_groups for p in group]
        trainable = [*self._plain, *self._tied_params]
        held = set(trainable)
        uneven = [n for n, p in params.items() if p in held and not p.is_contiguous()]
        if uneven:
            raise ValueError(f"zero_stage=1 shards parameters by rows; {', '.join(uneven)} is not contiguous."
                             " Make it contiguous (e.g. nn.Parameter(tensor.contiguous())) or use zero_stage=0.")
        self.shards: dict[Tensor, tuple[int, int]] = {  # by parameter; asked with any tensor
            p: shard_rows(p, topology.data_size, topology.replica) for p in trainable
        }
        """Each trainable parameter's flat element range ``[start, stop)`` held (and stepped) by this replica."""
        self.gathered_bytes = 0
        """Payload bytes of the parameters this rank has all-gathered (whole, every replica's rows), all steps."""

    # -- layouts ------------------------------------------------------------------------------------------
    def _layout_of(self, key: int, params: list[nn.Parameter]) -> _Layout:
        if self._layouts_of is not self.buckets:  # the buckets were rebuilt (bucket_bytes changed)
            self._layouts, self._layouts_of = {}, self.buckets
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = _layout(params, self.topology.data_size)
        return layout

    # -- gradients ----------------------------------------------------------------------------------------
    def _launch_bucket(self) -> None:
        i = self._launched
        self._launched += 1
        if i == 0 and not self._started:
            self.peak_held_bytes = 0
        self._launch(i, self.buckets[i])

    def _launch_tied(self) -> None:
        """Tied copies: reduce-scattered over the replicas like a bucket, then summed over their holders.

        Each replica's rows are all-reduced over the stages of that replica that hold a copy: the same bytes as one
        all-reduce over every holder of every replica, and each replica steps its rows of the same sum.
        """
        for j, (_, tied) in enumerate(self.tied_groups):
            if tied:
                self._launch(len(self.buckets) + j, tied, self._replica_tied_groups[j])

    def _launch(self, i: int, params: list[nn.Parameter], then_sum_over: dist.ProcessGroup | None = None) -> None:
        if self._gloo:  # bounded memory: the oldest bucket's receive buffer goes before a new one comes
            while len(self._in_flight) >= IN_FLIGHT:
                self._retire()
        layout = self._layout_of(i, params)
        d = self.topology.data_size
        whole = layout.segment * d
        padded = any(sum(b - a for _, a, b, _ in pieces) < layout.segment for pieces in layout.pieces)
        flat = (torch.zeros if padded else torch.empty)(whole, dtype=params[0].dtype, device=params[0].device)
        flat = self._flatten(params, flat, [piece for pieces in layout.pieces for piece in pieces])
        flat.div_(d)
        received = torch.empty(whole if self._gloo else layout.segment, dtype=flat.dtype, device=flat.device)
        self._held(received)
        group = self.topology.data_group
        self._mark_start()
        try:
            work = _reduce_scatter(received, flat, group, self._gloo)
        except Exception as err:  # noqa: BLE001 - a peer that is already gone fails here
            raise self._error("starting", group, err) from err
        self._in_flight.append((i, work, flat, received, then_sum_over))
        self.reduced_bytes += flat.numel() * flat.element_size()

    def _retire(self) -> None:
        """Waits for the oldest bucket in flight and keeps this replica's segment of it (the sum, on gloo)."""
        i, work, flat, received, then_sum_over = self._in_flight.popleft()
        try:
            work.wait()
        except Exception as err:  # noqa: BLE001 - a peer that failed or hung
            raise self._error("waiting for", self.topology.data_group, err) from err
        if self._gloo:  # the replicas' copies of this replica's rows, added in replica order (the same each step)
            copies = received.view(self.topology.data_size, -1)
            segment = torch.add(copies[0], copies[1])
            for copy in copies[2:]:
                segment.add_(copy)
            self._held(segment)
        else:
            segment = received
        self._segments[i] = segment
        self._held(flat, -1)
        if received is not segment:
            self._held(received, -1)
        if then_sum_over is not None:
            try:
                self._summing.append((dist.all_reduce(segment, group=then_sum_over, async_op=True), then_sum_over))
            except Exception as err:  # noqa: BLE001 - a peer that is already gone fails here
                raise self._error("starting", then_sum_over, err) from err
            self.reduced_bytes += segment.numel() * segment.element_size()

    def _wait_summing(self) -> None:
        summing, self._summing = self._summing, []
        for work, group in summing:
            try:
                work.wait()
            except Exception as err:  # noqa: BLE001 - a peer that failed or hung
                raise self._error("waiting for", group, err) from err

    def _held(self, tensor: Tensor, sign: int = 1) -> None:
        self._buffer_bytes += sign * tensor.numel() * tensor.element_size()
        if sign > 0:
            self._sample()

    def finish(self) -> None:
        """Waits for the reductions; ``.grad`` gets the averaged gradient on this replica's rows, zeros elsewhere."""
        while self._in_flight:
            self._retire()
        self._wait_summing()
        segments, self._segments = self._segments, {}
        super().finish()
        me = self.topology.replica
        done = set()
        for i in sorted(segments):
            segment = segments.pop(i)
            base = self._layouts[i].segment * me
            for p, a, b, offset in self._layouts[i].pieces[me]:
                if p.grad is None:  # only its rows are written: the zeros elsewhere come with it
                    p.grad = torch.zeros_like(p)
                    done.add(p)
                p.grad.view(-1)[a:b].copy_(segment[offset - base : offset - base + b - a])
            self._sample()
            self._held(segment, -1)
            del segment
        for held, (a, b) in self.shards.items():
            if held in done:
                continue
            if held.grad is None:
                held.grad = torch.zeros_like(held)
            else:
                flat = held.grad.view(-1)
                flat[:a].zero_()
                flat[b:].zero_()

    def discard(self) -> None:
        """Waits for the reductions started and drops their results (see :meth:`GradientSync.discard`)."""
        while self._in_flight:
            self._retire()
        self._wait_summing()
        for segment in self._segments.values():
            self._held(segment, -1)
        self._segments = {}
        super().discard()

    @property
    def started(self) -> bool:
        """Whether reductions have started this step (and :meth:`finish` is due)."""
        return super().started or bool(self._in_flight) or bool(self._segments)

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

    def _error(self, what: str, group: dist.ProcessGroup | None, err: Exception) -> PipelineError:
        if group is not self.topology.data_group:
            return super()._error(what, group, err)
        return peer_error(self.topology, f"{what} the reduce-scatter of gradients over replicas", err)

    def _gather_error(self, what: str, err: Exception) -> PipelineError:
        return peer_error(self.topology, f"{what} the all-gather of the updated parameters over replicas", err)

    # -- parameters ---------------------------------------------------------------------------------------
    def gather_parameters(self) -> None:
        """All-gathers every trainable parameter's rows from the replica that stepped them (after each step)."""
        lists = [*self.buckets, *([p for p in group if p.requires_grad] for _, group in self.tied_groups)]
        layouts = [self._layout_of(i, params) for i, params in enumerate(lists) if params]
        for layout in layouts:
            self.gathered_bytes += layout.segment * self.topology.data_size * _element_size(layout)
        with torch.no_grad():
            if self._gloo:
                self._gather_point_to_point(layouts)
            else:
                for layout in layouts:
                    self._gather_natively(layout)

    def _gather_point_to_point(self, layouts: list[_Layout]) -> None:
        """gloo: each replica's rows go from its parameters straight into the others' (point-to-point)."""
        try:
            works = _send_rows(layouts, self.topology.replica, self._replica_ranks, self.topology.data_group)
        except Exception as err:  # noqa: BLE001 - a peer that is already gone fails here
            raise self._gather_error("starting", err) from err
        for work in works:
            try:
                work.wait()
            except Exception as err:  # noqa: BLE001 - a peer that failed or hung
                raise self._gather_error("waiting for", err) from err

    def _gather_natively(self, layout: _Layout) -> None:
        """NCCL and others: the native all-gather of the replica-major layout, staged in one list's buffer."""
        me, group = self.topology.replica, self.topology.data_group
        first = next(p for pieces in layout.pieces for p, _, _, _ in pieces)
        flat = torch.zeros(layout.segment * self.topology.data_size, dtype=first.dtype, device=first.device)
        base = layout.segment * me
        for p, a, b, offset in layout.pieces[me]:
            flat[offset : offset + b - a].copy_(p.detach().view(-1)[a:b])
        try:
            work = _started(_native_all_gather(flat, flat[base : base + layout.segment], group=group, async_op=True))
        except Exception as err:  # noqa: BLE001 - a peer that is already gone fails here
            raise self._gather_error("starting", err) from err
        try:
            work.wait()
        except Exception as err:  # noqa: BLE001 - a peer that failed or hung
            raise self._gather_error("waiting for", err) from err
        for j, pieces in enumerate(layout.pieces):
            if j != me:
                for p, a, b, offset in pieces:
                    p.detach().view(-1)[a:b].copy_(flat[offset : offset + b - a])


def _reduce_scatter(received: Tensor, flat: Tensor, group: dist.ProcessGroup | None, gloo: bool) -> dist.Work:
    """Starts a bucket's reduce-scatter (the module doc's all-to-all on gloo, else the native one).

    ``received``: on gloo every replica's copy of this replica's segment, else the segment.
    """
    if gloo:
        return _started(dist.all_to_all_single(received, flat, group=group, async_op=True))
    return _started(_native_reduce_scatter(received, flat, group=group, async_op=True))


def _send_rows(layouts: list[_Layout], me: int, ranks: list[int], group: dist.ProcessGroup | None) -> list[dist.Work]:
    """Posts the module doc's point-to-point all-gather; returns the works to wait for.

    This replica's rows of each piece go to every other replica, and theirs into this one's parameters.
    """
    works = []
    for layout in layouts:
        for j, rank in enumerate(ranks):
            if j == me:
                continue
            # the same order on both sides of each pair: gloo matches a pair's messages in order
            for p, a, b, _ in layout.pieces[me]:
                works.append(_started(dist.isend(p.detach().view(-1)[a:b], rank, group=group)))
            for p, a, b, _ in layout.pieces[j]:
                works.append(_started(dist.irecv(p.detach().view(-1)[a:b], rank, group=group)))
    return works


def _started(work: dist.Work | None) -> dist.Work:
    """The work of an asynchronous collective or p2p call: None only on a rank outside the group, never here."""
    return cast(dist.Work, work)


def _element_size(layout: _Layout) -> int:
    first = next((p for pieces in layout.pieces for p, _, _, _ in pieces), None)
    return first.element_size() if first is not None else 0
