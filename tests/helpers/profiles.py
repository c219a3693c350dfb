"""Profiles with chosen costs for a real model's structure, so that the planner's choices are fixed in tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_varuna.pipeline.config import EngineConfig
from lightning_varuna.pipeline.engine import first_samples
from lightning_varuna.pipeline.planning.profile_data import (
    CutProfile,
    Link,
    Network,
    ParamProfile,
    Profile,
    SegmentProfile,
)
from lightning_varuna.pipeline.planning.profiler import profile_sizes

FAST = Link(1e-5, 1e9)
FREE = Link(0.0, 1e30)
"""A link that costs nothing: no latency, unbounded bandwidth."""
SIZES = (1, 2, 4)
"""The micro-batch sizes of the hand-written profiles."""


def network(allreduce: Link = FREE) -> Network:
    """Free point-to-point messages; the all-reduce's ring step is ``allreduce``."""
    return Network(p2p_intra=FREE, p2p_inter=FREE, allreduce_intra=allreduce, allreduce_inter=allreduce)


def segment(forward: float, backward: float, saved_per_sample: int) -> SegmentProfile:
    """Costs proportional to the micro-batch size (``SIZES``): ``forward`` seconds per sample, with or without
    autograd, ``backward`` seconds per sample, ``saved_per_sample`` bytes kept for backward."""
    return SegmentProfile(forward_s=tuple(forward * s for s in SIZES), forward_grad_s=tuple(forward * s for s in SIZES),
                          backward_s=tuple(backward * s for s in SIZES),
                          saved_bytes=tuple(saved_per_sample * s for s in SIZES))


def two_segments(param_bytes: int = 1000, allreduce: Link = FREE, key: str = "two") -> Profile:
    """Two equal segments, F=1 and B=2 seconds per sample, free messages, no overhead or optimizer time."""
    return Profile(
        microbatch_sizes=SIZES, segments=(segment(1.0, 2.0, 10), segment(1.0, 2.0, 10)),
        cuts=(CutProfile("cut", 4),),
        params=(ParamProfile("a", param_bytes, (0,)), ParamProfile("b", param_bytes, (1,))),
        network=network(allreduce), key=key,
    )


def search_space(**options: Any) -> EngineConfig:
    """An :class:`EngineConfig` that leaves the planner every value not given: P, the micro-batch size (unless a
    count is given), schedule and recompute are ``"auto"``."""
    searched: dict[str, Any] = {"schedule": "auto", "recompute": "auto"}
    if "num_microbatches" not in options:
        searched["microbatch_size"] = "auto"
    return EngineConfig(**{**searched, **options})


def synthetic_profile(module: nn.Module, batch: Any, step: Callable[[Any], Any], largest: int,
                      forward_s: float = 1e-3, allreduce: Link = FAST) -> Profile:
    """The structure of ``module`` (traced on ``batch``) with costs proportional to the micro-batch size.

    Every segment takes ``forward_s`` per sample forward (with or without autograd) and twice that backward, and
    keeps four times its output activation for backward; messages take 10 us + 1 GB/s; the all-reduce's ring step
    is ``allreduce``.
    """
    from lightning_varuna.pipeline.model.dry_run import trace_step

    with torch.random.fork_rng():
        trace, _ = trace_step(module, lambda n: step(first_samples(batch, n)))
    sizes = profile_sizes(largest)
    cut_bytes = [c.dtype.itemsize * _numel(c.shape) // 2 for c in trace.cuts]  # traced with a batch of 2
    per_sample = cut_bytes + [cut_bytes[-1]]
    forward = tuple(forward_s * s for s in sizes)
    segments = tuple(
        SegmentProfile(forward_s=forward, forward_grad_s=forward, backward_s=tuple(2 * t for t in forward),
                       saved_bytes=tuple(4 * per_sample[i] * s for s in sizes))
        for i in range(trace.num_segments)
    )
    params = dict(module.named_parameters())
    return Profile(
        microbatch_sizes=sizes, segments=segments,
        cuts=tuple(CutProfile(c.name, b, c.batch_dim is not None) for c, b in zip(trace.cuts, cut_bytes, strict=True)),
        params=tuple(ParamProfile(name, params[name].numel() * params[name].element_size(),
                                  tuple(sorted(trace.param_segments.get(name, {0})))) for name in trace.param_numel),
        crossings=tuple(sorted(trace.crossings)),
        network=Network(p2p_intra=FAST, p2p_inter=FAST, allreduce_intra=allreduce, allreduce_inter=allreduce),
        machine="synthetic", key="synthetic",
    )


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for n in shape:
        total *= n
    return total
