"""Measures a :class:`~.profile_data.Profile`: segment costs, optimizer, executor, network.

- Segments, per micro-batch size: the step runs on the whole model (one process) and cut points mark where each
  segment's forward ends; a hook on each cut point's tensor marks where the backward passes it, so every
  segment's backward is timed inside one backward of the whole model. A forward without autograd (a recomputing
  stage's forward) and one with autograd (a recompute, or a forward without recompute) are timed separately;
  each segment's fastest of ``repeats`` runs counts (a run preempted on a busy machine would skew the plan), and
  times and bytes are made non-decreasing in the micro-batch size (:func:`monotone`).
  ``torch.autograd.graph.saved_tensors_hooks`` counts the bytes each segment's forward keeps for backward
  (parameters excluded, each storage once).
- Optimizer: the model's optimizer class steps twice on a flat tensor of up to 64 MiB; its state bytes per
  parameter byte and its time per byte are kept.
- Executor: one stage runs a schedule of trivial tasks in this process; its time beyond the tasks' own is the
  overhead per task.
- Network (:func:`measure_network`, collective): ping-pong between two ranks of a node (and of two nodes), and
  all-reduces over all ranks, at a few sizes; latency and bandwidth are fitted by least squares.

A model built on the meta device is measured one segment at a time, only that segment's parameters materialized
(:mod:`~lightning_varuna.pipeline.planning.segment_profiler`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_varuna.pipeline.comm.transfers import P2P
from lightning_varuna.pipeline.model.cut import CutPoint, forward_handler
from lightning_varuna.pipeline.model.dry_run import Trace, time_segments
from lightning_varuna.pipeline.model.meta_init import ParamInitFn, has_meta_tensors
from lightning_varuna.pipeline.planning.profile_data import (
    CutProfile,
    Link,
    Network,
    ParamProfile,
    Profile,
    SegmentProfile,
    default_network,
    machine_description,
)
from lightning_varuna.pipeline.planning.segment_profiler import SegmentTimes, measure_segments_on_meta
from lightning_varuna.pipeline.runtime.executor import StageExecutor
from lightning_varuna.pipeline.scheduling.schedules import make_schedule
from lightning_varuna.pipeline.topology import Topology

__all__ = ["measure_network", "measure_optimizer", "measure_task_overhead", "monotone", "profile_model",
           "profile_sizes"]

REPEATS = 3
MAX_PROFILED_SIZE = 64
"""Micro-batch sizes above this are extrapolated, not run."""
_OPTIMIZER_BYTES = 64 * 2**20
_NETWORK_SIZES = (4 * 2**10, 256 * 2**10, 4 * 2**20)


def profile_sizes(largest: int) -> tuple[int, ...]:
    """The micro-batch sizes to measure for micro-batches up to ``largest``: powers of two and ``largest``."""
    top = min(largest, MAX_PROFILED_SIZE)
    sizes = {1, top}
    size = 2
    while size < top:
        sizes.add(size)
        size *= 2
    return tuple(sorted(sizes))


def profile_model(
    module: nn.Module,
    step_on: Callable[[int], Any],
    loss_of: Callable[[Any], Tensor],
    trace: Trace,
    sizes: Sequence[int],
    device: torch.device,
    optimizer: tuple[type[torch.optim.Optimizer], dict[str, Any]] | None = None,
    network: Network | None = None,
    key: str = "",
    param_init_fn: ParamInitFn | None = None,
) -> Profile:
    """Measures the model's profile in this process (gradients left as they were).

    A model with parameters on the meta device is measured a segment at a time (see the module's docstring).

    Args:
        module: The whole model.
        step_on: Runs the user's step on a batch of ``n`` samples and returns its output.
        loss_of: The loss in a step's output.
        trace: The dry run's trace (cut points, parameters per segment).
        sizes: Micro-batch sizes to measure (ascending).
        device: Where the model runs.
        optimizer: The optimizer's class and its keyword arguments (default: ``AdamW``).
        network: The network to record (default:
            :func:`~lightning_varuna.pipeline.planning.profile_data.default_network`).
        key: The structure key to record.
        param_init_fn: For a model on the meta device: initializes what a module owns directly (default: its
            ``reset_parameters()``).
    """
    grads = {p: p.grad for p in module.parameters()}
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            if has_meta_tensors(module):
                measured = measure_segments_on_meta(module, step_on, loss_of, trace, sizes, device, REPEATS,
                                                    param_init_fn)
            else:
                measured = [_measure_size(module, step_on, loss_of, trace.num_segments, n, device) for n in sizes]
    finally:
        for p, grad in grads.items():
            p.grad = grad
    # a larger micro-batch never takes less time or memory: noise that says otherwise is smoothed out
    segments = tuple(
        SegmentProfile(*(tuple(monotone([m[field][i] for m in measured])) for field in range(4)))
        for i in range(trace.num_segments)
    )
    ratio, per_byte = measure_optimizer(module, device, *(optimizer or (torch.optim.AdamW, {})))
    return Profile(
        microbatch_sizes=tuple(sizes),
        segments=segments,
        cuts=tuple(CutProfile(c.name, _cut_bytes(c.shape, c.dtype, c.batch_dim), c.batch_dim is not None)
                   for c in trace.cuts),
        params=tuple(_param_profiles(module, trace)),
        crossings=tuple(sorted(trace.crossings)),
        optimizer_state_ratio=ratio,
        optimizer_s_per_byte=per_byte,
        task_overhead_s=measure_task_overhead(device),
        network=network or default_network(device.type),
        machine=machine_description(device),
        key=key,
    )


def monotone(values: Sequence[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for value in values:
        blocks.append([float(value), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, count = blocks.pop()
            blocks[-1] = [(blocks[-1][0] * blocks[-1][1] + mean * count) / (blocks[-1][1] + count),
                          blocks[-1][1] + count]
    return [type(values[0])(mean) if isinstance(values[0], int) else mean
            for mean, count in blocks for _ in range(int(count))]


def _cut_bytes(shape: tuple[int, ...], dtype: torch.dtype, batch_dim: int | None) -> int:
    numel = 1
    for d, n in enumerate(shape):
        numel *= 1 if d == batch_dim else n
    if batch_dim is not None:
        numel = numel * shape[batch_dim] // 2  # the dry run's shape is for a batch of 2
    return numel * torch.empty((), dtype=dtype).element_size()


def _param_profiles(module: nn.Module, trace: Trace) -> list[ParamProfile]:
    params = dict(module.named_parameters())
    return [ParamProfile(name, params[name].numel() * params[name].element_size(),
                         tuple(sorted(trace.param_segments.get(name, {0}))), params[name].requires_grad)
            for name in trace.param_numel]


def _register_hook(tensor: Tensor) -> Callable[[Callable[[Tensor], None]], object]:
    """``tensor.register_hook``, with the signature torch leaves unannotated."""
    return cast(Callable[[Callable[[Tensor], None]], object], tensor.register_hook)


def _measure_size(module: nn.Module, step_on: Callable[[int], Any], loss_of: Callable[[Any], Tensor],
                  num_segments: int, n: int, device: torch.device) -> SegmentTimes:
    """Forward without and with autograd, backward and saved bytes of every segment for micro-batches of ``n``."""
    forward = time_segments(lambda: step_on(n)) if num_segments > 1 else [_time_call(lambda: step_on(n), device)]
    stored = {p.untyped_storage().data_ptr() for p in module.parameters()}
    best: tuple[list[float], list[float]] | None = None
    saved: list[int] = []
    for _ in range(REPEATS):
        probe = _GradProbe(num_segments, stored)
        forward_grad, backward = probe.run(step_on, loss_of, n, device)
        for p in module.parameters():
            p.grad = None
        saved = probe.saved
        if best is None:
            best = (forward_grad, backward)
        else:
            best = ([min(a, b) for a, b in zip(best[0], forward_grad)], [min(a, b) for a, b in zip(best[1], backward)])
    assert best is not None
    return forward, best[0], best[1], saved


def _time_call(call: Callable[[], Any], device: torch.device) -> float:
    with torch.no_grad():
        return _fastest(call, device)


def _fastest(call: Callable[[], Any], device: torch.device, repeats: int = REPEATS,
             before: Callable[[], Any] | None = None) -> float:
    """The fastest of ``repeats`` timed calls (``before`` runs untimed ahead of each)."""
    fastest = float("inf")
    for _ in range(repeats):
        if before is not None:
            before()
        _synchronize(device)
        start = time.perf_counter()
        call()
        _synchronize(device)
        fastest = min(fastest, time.perf_counter() - start)
    return fastest


class _GradProbe:
    """Times one forward with autograd and its backward per segment, and counts each segment's saved bytes."""

    def __init__(self, num_segments: int, parameter_storages: set[int]) -> None:
        self.num_segments = num_segments
        self.parameter_storages = parameter_storages
        self.segment = 0
        self.forward_marks: list[float] = []
        self.backward_marks: dict[int, float] = {}
        self.saved = [0] * num_segments
        self._seen: set[int] = set()

    def on_cut(self, cut: CutPoint, x: Tensor) -> Tensor:
        self.forward_marks.append(time.perf_counter())
        index, self.segment = self.segment, self.segment + 1
        if x.requires_grad:
            _register_hook(x)(partial(self._marks_backward, index))
        return x

    def _marks_backward(self, cut: int, grad: Tensor) -> None:
        self.backward_marks.setdefault(cut, time.perf_counter())

    def pack(self, tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self.parameter_storages and pointer not in self._seen:
            self._seen.add(pointer)
            self.saved[min(self.segment, self.num_segments - 1)] += storage.nbytes()
        return tensor

    def run(self, step_on: Callable[[int], Any], loss_of: Callable[[Any], Tensor], n: int,
            device: torch.device) -> tuple[list[float], list[float]]:
        _synchronize(device)
        start = time.perf_counter()
        with forward_handler(self), torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            loss = loss_of(step_on(n))
        _synchronize(device)
        forward_end = time.perf_counter()
        torch.autograd.backward(loss)
        _synchronize(device)
        backward_end = time.perf_counter()
        marks = [start, *self.forward_marks, forward_end]
        forward = [max(b - a, 0.0) for a, b in zip(marks, marks[1:])]
        # the backward passes the cut points from the last to the first; a cut whose tensor needs no gradient
        # (frozen layers before it) gives its segment's time to the segment before it
        passed = [backward_end] + [0.0] * (self.num_segments - 1) + [forward_end]
        for cut in range(self.num_segments - 2, -1, -1):
            passed[cut + 1] = self.backward_marks.get(cut, passed[cut + 2])
        backward = [max(passed[i] - passed[i + 1], 0.0) for i in range(self.num_segments)]
        return forward, backward


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_optimizer(module: nn.Module, device: torch.device, optimizer: type[torch.optim.Optimizer],
                      kwargs: dict[str, Any]) -> tuple[float, float]:
    """The optimizer's state bytes per parameter byte, and its step's seconds per parameter byte.

    It steps twice on a flat float tensor as large as the model's trainable parameters (at most 64 MiB); the
    second step is timed.
    """
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    element = torch.empty((), dtype=dtype).element_size()
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    numel = max(1024, min(trainable, _OPTIMIZER_BYTES // element))
    flat = torch.zeros(numel, dtype=dtype, device=device, requires_grad=True)
    flat.grad = torch.full_like(flat, 1e-3)
    try:
        step = optimizer([flat], **kwargs)
    except Exception:  # noqa: BLE001 - an optimizer that needs more than parameters: assume Adam's costs
        step = torch.optim.AdamW([flat])
    step.step()
    _synchronize(device)
    start = time.perf_counter()
    step.step()
    _synchronize(device)
    seconds = time.perf_counter() - start
    state = sum(t.numel() * t.element_size() for s in step.state.values() for t in s.values()
                if isinstance(t, Tensor) and t.numel() > 1)
    return state / (numel * element), seconds / (numel * element)


def measure_task_overhead(device: torch.device, tasks: int = 32) -> float:
    """The executor's own seconds per task: a one-stage schedule of trivial tasks run here, minus their own time."""
    weight = torch.ones(4, device=device, requires_grad=True)
    topology = Topology(world_size=1, rank=0, pipeline_size=1, device=device)
    executor = StageExecutor(topology, P2P(topology, 10.0), [], None, None)
    schedule = make_schedule("1f1b", 1, tasks, recompute=False)

    def step(k: int) -> Tensor:
        return (weight * (k + 1)).sum()

    def direct() -> None:
        for k in range(tasks):
            torch.autograd.backward(step(k))

    def run() -> None:
        executor.run(schedule, step, [1] * tasks, (None, None), train=True, recompute=False,
                     loss_of=lambda out, k: out)

    run()
    through_executor = _fastest(run, device)
    alone = _fastest(direct, device)
    weight.grad = None
    return max(0.0, (through_executor - alone) / (2 * tasks))


# -- network --------------------------------------------------------------------------------------------------
def measure_network(device: torch.device, devices_per_node: int, base: Network | None = None) -> Network:
    """Measures the links this job's ranks have (collective: every rank calls it; rank 0's result counts).

    Ping-pong between ranks 0 and 1 (inside a node) and between rank 0 and the first rank of the second node, if
    any; all-reduces over all ranks (spanning nodes when there are several). What cannot be measured here keeps
    ``base``'s value (default: :func:`~lightning_varuna.pipeline.planning.profile_data.default_network`).
    """
    network = base or default_network(device.type)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        return network
    rank = dist.get_rank()
    intra = _ping_pong(rank, 1, device) if devices_per_node > 1 else None
    inter = _ping_pong(rank, devices_per_node, device) if world > devices_per_node else None
    ring = _ring_step(rank, world, device)
    updates: dict[str, Link] = {}
    if intra is not None:
        updates["p2p_intra"] = intra
    if inter is not None:
        updates["p2p_inter"] = inter
    if world > devices_per_node:
        updates["allreduce_inter"] = ring
        if intra is not None:
            updates["allreduce_intra"] = intra
    else:
        updates["allreduce_intra"] = ring
    return Network(**{**network.__dict__, **updates})


def _ping_pong(rank: int, peer: int, device: torch.device) -> Link:
    def exchange(buffer: Tensor) -> None:
        if rank == 0:
            dist.send(buffer, peer)
            dist.recv(buffer, peer)
        elif rank == peer:
            dist.recv(buffer, 0)
            dist.send(buffer, 0)

    return _fit([(nbytes, _fastest(partial(exchange, _buffer(nbytes, device)), device, REPEATS + 1) / 2)
                 for nbytes in _NETWORK_SIZES])


def _ring_step(rank: int, world: int, device: torch.device) -> Link:
    """A ring step's link, from all-reduces over every rank: ``t = 2 (n-1) latency + 2 (n-1) / n * N / bandwidth``."""
    fitted = _fit([(nbytes, _fastest(partial(dist.all_reduce, _buffer(nbytes, device)), device, REPEATS + 1,
                                     before=dist.barrier)) for nbytes in _NETWORK_SIZES])
    steps = 2 * (world - 1)
    return Link(fitted.latency_s / steps, fitted.bandwidth * steps / world)


def _buffer(nbytes: int, device: torch.device) -> Tensor:
    return torch.zeros(nbytes // 4, dtype=torch.float32, device=device)


def _fit(samples: Sequence[tuple[float, float]]) -> Link:
    """``seconds = latency + bytes / bandwidth`` by least squares (latency at least 0)."""
    n = len(samples)
    mean_x = sum(x for x, _ in samples) / n
    mean_y = sum(y for _, y in samples) / n
    var = sum((x - mean_x) ** 2 for x, _ in samples)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in samples) / var if var > 0 else 0.0
    slope = max(slope, 1e-15)
    return Link(max(0.0, mean_y - slope * mean_x), 1.0 / slope)
