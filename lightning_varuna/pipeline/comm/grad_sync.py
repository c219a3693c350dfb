"""Gradient sync once per optimizer step: data-parallel averaging, tied copies summed, global norms.

- Each stage's gradients are averaged over its D replicas in flat buckets (one all-reduce per bucket), never
  per micro-batch. Buckets hold the parameters in reverse order, the order in which backward finishes them.
- With ``overlap`` on, a bucket starts its all-reduce during the stage's *last* backward of the step, as soon
  as every gradient in it is final (post-accumulate-grad hooks, registered for that backward only), so the
  reductions run while the rest of that backward and the other stages' work go on. Buckets start strictly in
  bucket order, the same on every replica, so the collectives of a data-parallel group always match.
- A parameter held by several stages (found by the dry run, e.g. a tied embedding and head) has its copies'
  gradients summed over every holder of every replica (and divided by D), so the copies stay identical.
- The global gradient norm counts each parameter once: a tied parameter only on its first holder stage.
- Memory: a bucket's flat buffer exists only from its start to the next step. Starting a bucket copies its
  gradients into a new flat buffer and drops them from ``.grad`` (at most one bucket held twice, during the
  copy); after the reduction each ``.grad`` is a view of the reduced buffer (as ``DistributedDataParallel``'s
  ``gradient_as_bucket_view``), so a replica holds its gradients once, not also in persistent bucket copies.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_varuna.failstop.failures import PipelineError, peer_error
from lightning_varuna.pipeline.topology import Topology

__all__ = ["GradientSync", "default_bucket_bytes"]

MIN_BUCKET_BYTES = 64 * 2**10
MAX_BUCKET_BYTES = 25 * 2**20
BUCKETS_PER_STAGE = 4


def default_bucket_bytes(stage_bytes: int) -> int:
    """The bucket size used when none is given: a quarter of the stage's gradient, within [64 KiB, 25 MiB].

    Only the stage's last backward can hide reductions, and the last bucket to become ready (the stage's first
    layers) starts when that backward ends, so its reduction is never hidden: about four buckets per stage
    leave a quarter of the stage's reduction exposed at most, at the cost of four per-call latencies
    (tens of microseconds each for gloo on a host, more on a network). Below 64 KiB a bucket's transfer time
    is comparable to that latency; above 25 MiB (the default of ``DistributedDataParallel``) per-call costs are
    negligible already and smaller buckets only add calls.
    """
    return min(MAX_BUCKET_BYTES, max(MIN_BUCKET_BYTES, stage_bytes // BUCKETS_PER_STAGE))


class GradientSync:
    """Synchronises the gradients of one stage's parameters.

    Call :meth:`sync` once per optimizer step, or :meth:`start` then :meth:`finish`. To overlap the data-parallel
    reductions with the step's last backward, run that backward inside :meth:`overlapping` (the engine does this
    with ``train_step(..., start_sync=True)``) and call :meth:`start` right after it.

    Args:
        topology: The process grid.
        params: This stage's parameters by full-model name.
        tied: ``(name, stages)`` for each parameter held by more than one stage (same order on every rank).
        bucket_bytes: Size of a data-parallel all-reduce bucket; ``None``: :func:`default_bucket_bytes` of this
            stage's gradient. It must come out the same on every replica of a stage (it does when it is the same
            number, or ``None``).
        overlap: Whether buckets start reducing during the last backward (see :meth:`overlapping`); when off,
            every reduction starts in :meth:`start`. Can be changed between steps, identically on every rank.
    """

    def __init__(
        self,
        topology: Topology,
        params: dict[str, nn.Parameter],
        tied: Iterable[tuple[str, tuple[int, ...]]],
        bucket_bytes: int | None = None,
        overlap: bool = True,
    ) -> None:
        self.topology = topology
        self.params = params
        self.overlap = overlap
        tied = list(tied)
        self.tied_names = {name for name, _ in tied}
        # every rank creates every group, in the same order, whether or not it belongs to it
        self.tied_groups: list[tuple[dist.ProcessGroup | None, list[nn.Parameter]]] = []
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
        self._plain = [p for n, p in reversed(params.items()) if n not in self.tied_names and p.requires_grad]
        self.reduced_bytes = 0
        """Payload bytes this rank has passed to all-reduces (buckets and tied copies), all steps together.

        A ring all-reduce of N bytes among n ranks sends about ``2 (n - 1) / n * N`` bytes per rank.
        """
        self.overlapped_buckets = 0
        """How many buckets started reducing during the last :meth:`overlapping` backward."""
        self.started_at: float | None = None
        """When this step's first reduction started (``time.perf_counter``), or None if it had none."""
        self.peak_held_bytes = 0
        """The most bytes this stage's ``.grad`` and the sync's own buffers held together during the last sync.

        Sampled whenever the sync allocates or releases a buffer (per bucket, never per micro-batch).
        """
        self._buffer_bytes = 0
        self._timed = False  # started_at is this step's
        self._started = False
        self._launched = 0
        self._pending: list[tuple[dist.Work, Tensor, list[nn.Parameter], dist.ProcessGroup | None]] = []
        self._accumulated: Mapping[nn.Parameter, Tensor] = {}
        self.bucket_bytes = bucket_bytes  # builds the buckets

    # -- buckets ------------------------------------------------------------------------------------------
    @property
    def bucket_bytes(self) -> int:
        """The bucket size in bytes.

        Setting it (``None``: the default) rebuilds the buckets; do it between steps, the same on every rank.
        """
        return self._bucket_bytes

    @bucket_bytes.setter
    def bucket_bytes(self, value: int | None) -> None:
        if self.started:
            raise RuntimeError("GradientSync.bucket_bytes cannot change while reductions are in flight.")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"bucket_bytes must be a positive int or None, got {value!r}.")
        stage_bytes = sum(p.numel() * p.element_size() for p in self._plain)
        self._bucket_bytes = default_bucket_bytes(stage_bytes) if value is None else value
        self.buckets = _buckets(self._plain, self._bucket_bytes)
        self._sizes = [len(b) for b in self.buckets]
        self._remaining = list(self._sizes)
        self._hooks: list[tuple[nn.Parameter, Callable[[nn.Parameter], None]]] = [
            (p, self._ready_hook(i)) for i, bucket in enumerate(self.buckets) for p in bucket
        ]

    def _ready_hook(self, bucket: int) -> Callable[[nn.Parameter], None]:
        def ready(_: nn.Parameter) -> None:
            self._remaining[bucket] -= 1
            # strictly in bucket order: every replica issues the same collectives in the same order
            while self._launched < len(self.buckets) and self._remaining[self._launched] <= 0:
                self._launch_bucket()

        return ready

    # -- one step -----------------------------------------------------------------------------------------
    def sync(self) -> None:
        """Averages over replicas and sums tied copies; call once per optimizer step, on every rank."""
        self.start()
        self.finish()

    @contextlib.contextmanager
    def overlapping(
        self, accumulated: Mapping[nn.Parameter, Tensor] | None = None, held_back: Container[nn.Parameter] = (),
    ) -> Iterator[Callable[[Iterable[nn.Parameter]], None]]:
        """Runs the stage's last backward of the step: each bucket starts reducing once its gradients are final.

        The gradients are complete after this backward: in ``.grad``, plus ``accumulated`` (see :meth:`start`). A
        bucket with a parameter that got no gradient in this backward waits for :meth:`start`, and so do the buckets
        after it. Does nothing when ``overlap`` is off or there is no data-parallel replica.

        A split backward (an input-gradient pass, then weight-gradient tasks) runs all of it inside: a parameter
        in ``held_back`` when autograd accumulates into it still waits for held-back work, and is final only
        when the caller passes it to the function this yields.
        """
        self._accumulated = accumulated or {}
        if not self.overlap or self.topology.data_size == 1 or not self.buckets or self.started:
            yield _ignore
            return
        self._remaining[:] = self._sizes
        hooks = dict(self._hooks)

        def accumulated_into(param: nn.Parameter) -> None:
            if param not in held_back:
                hooks[param](param)

        def release(params: Iterable[nn.Parameter]) -> None:
            for param in params:
                if param in hooks and param.requires_grad:
                    hooks[param](param)

        # a parameter frozen since setup never completes its bucket here: that bucket waits for start()
        handles = [_post_accumulate_hook(p)(accumulated_into) for p in hooks if p.requires_grad]
        try:
            yield release
        finally:
            for handle in handles:
                handle.remove()
        self.overlapped_buckets = self._launched

    def start(self, accumulated: Mapping[nn.Parameter, Tensor] | None = None) -> None:
        """Starts every reduction not started yet (asynchronous); :meth:`finish` completes them.

        Args:
            accumulated: Gradients of earlier batches of an accumulation window that the caller keeps outside
                ``.grad`` (by parameter): each reduction adds them, so that :meth:`finish` writes the window's
                total into ``.grad``. Keeping them apart lets the caller drop the batch's own gradient (a skipped
                batch, with :meth:`discard`) and still have the window's.
        """
        if self._started:
            raise RuntimeError("GradientSync.start() called twice without finish().")
        if not self.started:  # a new step: the first bucket of the overlapping backward starts it too
            self.peak_held_bytes = 0
        self._started = True
        if accumulated is not None:
            self._accumulated = accumulated
        if self.topology.data_size > 1:
            while self._launched < len(self.buckets):
                self._launch_bucket()
        self._launch_tied()

    def _launch_tied(self) -> None:
        """Starts summing the tied copies (over every holder of every replica, divided by D)."""
        for group, tied in self.tied_groups:
            if tied:
                flat = self._flatten(tied)
                flat.div_(self.topology.data_size)
                self._all_reduce(flat, tied, group)

    def finish(self) -> None:
        """Waits for the reductions started; each reduced parameter's ``.grad`` becomes a view of its result."""
        for flat, params in self._wait():
            _adopt(flat, params)
            self._buffer_bytes -= flat.numel() * flat.element_size()
        self._sample()

    def discard(self) -> None:
        """Waits for the reductions started and drops their results.

        The gradients a started reduction had taken from ``.grad`` are gone with it (``.grad`` is None there):
        restore the gradients you keep (the strategy puts the accumulation window's back).
        """
        for flat, _ in self._wait():
            self._buffer_bytes -= flat.numel() * flat.element_size()

    def _wait(self) -> list[tuple[Tensor, list[nn.Parameter]]]:
        pending, self._pending = self._pending, []
        self._started, self._launched, self._accumulated = False, 0, {}
        if not self._timed:
            self.started_at = None
        self._timed = False
        for work, _, _, group in pending:
            try:
                work.wait()
            except Exception as err:  # noqa: BLE001 - a peer that failed or hung
                raise self._error("waiting for", group, err) from err
        return [(flat, params) for _, flat, params, _ in pending]

    @property
    def started(self) -> bool:
        """Whether reductions have started this step (and :meth:`finish` is due)."""
        return self._started or self._launched > 0

    def local_norm_sq(self, norm_type: float = 2.0) -> Tensor:
        """This stage's share of the squared global norm (a tied parameter counted on its first stage)."""
        grads = [p.grad for n, p in self.params.items() if p.grad is not None and n not in self.not_counted]
        device = self.topology.device
        if not grads:
            return torch.zeros((), device=device, dtype=torch.float32)
        norms = torch._foreach_norm(grads, norm_type)
        return torch.stack([n.float() for n in norms]).pow(norm_type).sum()

    # -- internals ----------------------------------------------------------------------------------------
    def _launch_bucket(self) -> None:
        i = self._launched
        self._launched += 1
        if i == 0 and not self._started:
            self.peak_held_bytes = 0
        flat = self._flatten(self.buckets[i])
        flat.div_(self.topology.data_size)
        self._all_reduce(flat, self.buckets[i], self.topology.data_group)

    def _all_reduce(self, flat: Tensor, params: list[nn.Parameter], group: dist.ProcessGroup | None) -> None:
        self._mark_start()
        try:
            work = dist.all_reduce(flat, group=group, async_op=True)
        except Exception as err:  # noqa: BLE001 - a peer that is already gone fails here
            raise self._error("starting", group, err) from err
        self._pending.append((work, flat, params, group))
        self.reduced_bytes += flat.numel() * flat.element_size()

    def _mark_start(self) -> None:
        """Notes the time of the step's first reduction (:attr:`started_at`)."""
        if not self._timed:
            self.started_at = time.perf_counter()
            self._timed = True

    def _error(self, what: str, group: dist.ProcessGroup | None, err: Exception) -> PipelineError:
        kind = "averaging gradients over replicas" if group is self.topology.data_group else "summing tied copies"
        try:
            # None (one process: the default group) fails inside the try like any other lookup
            ranks = f" (ranks {dist.get_process_group_ranks(cast(dist.ProcessGroup, group))})"
        except Exception:  # noqa: BLE001 - only for the message
            ranks = ""
        return peer_error(self.topology, f"{what} the all-reduce {kind}{ranks}", err)

    def _flatten(self, params: list[nn.Parameter], flat: Tensor | None = None,
                 pieces: Iterable[tuple[nn.Parameter, int, int, int]] | None = None) -> Tensor:
        """Copies the parameters' gradients (plus the window's earlier sum) into a new flat buffer; drops ``.grad``.

        ``pieces``: ``(param, start, stop, offset)``, the flat elements ``[start, stop)`` of ``param``'s gradient at
        ``offset`` of ``flat`` (which must then be given, its padding zero); default: the parameters one after
        another, whole. Dropping ``.grad`` right after its copy keeps one copy of each gradient (the buffer's) while
        the reduction runs; the flat buffer is new each step so that it is held only until the next one.
        """
        if flat is None:
            numel = sum(p.numel() for p in params)
            flat = torch.empty(numel, dtype=params[0].dtype, device=params[0].device)
            pieces = _whole(params)
        assert pieces is not None
        self._buffer_bytes += flat.numel() * flat.element_size()
        self._sample()
        for p, a, b, offset in pieces:
            view = flat[offset : offset + b - a]
            grad, earlier = p.grad, self._accumulated.get(p)
            if grad is None and earlier is None:
                view.zero_()
            elif earlier is None or grad is None:
                source = grad if grad is not None else earlier
                assert source is not None  # both None is the branch above
                view.copy_(source.reshape(-1)[a:b])
            else:
                torch.add(grad.reshape(-1)[a:b], earlier.reshape(-1)[a:b], out=view)
        for p in params:
            p.grad = None
        return flat

    def _sample(self) -> None:
        """Updates :attr:`peak_held_bytes` with what ``.grad`` and the sync's buffers hold now."""
        grads = sum(p.grad.numel() * p.grad.element_size() for p in self.params.values() if p.grad is not None)
        self.peak_held_bytes = max(self.peak_held_bytes, grads + self._buffer_bytes)


def _post_accumulate_hook(param: nn.Parameter) -> Callable[[Callable[[nn.Parameter], None]], RemovableHandle]:
    """``param.register_post_accumulate_grad_hook``, with the signature torch leaves unannotated."""
    return cast(Callable[[Callable[[nn.Parameter], None]], RemovableHandle], param.register_post_accumulate_grad_hook)


def _ignore(_: Iterable[nn.Parameter]) -> None:
    """What :meth:`GradientSync.overlapping` yields when it does not overlap."""


def _whole(params: list[nn.Parameter]) -> list[tuple[nn.Parameter, int, int, int]]:
    pieces, offset = [], 0
    for p in params:
        pieces.append((p, 0, p.numel(), offset))
        offset += p.numel()
    return pieces


def _adopt(flat: Tensor, params: list[nn.Parameter]) -> None:
    """Each parameter's ``.grad`` becomes its view of ``flat`` (laid out by :func:`_whole`)."""
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p)
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
