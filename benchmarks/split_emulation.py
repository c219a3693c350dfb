"""The emulated layers of ``schedules.py``: a backward split into two autograd nodes, I and W, each sleeping B/2.

``y = _InputPath(x, w.detach()) + _WeightPath(x.detach(), w)``: ``_InputPath``'s forward calls the custom op
``varuna_bench::work`` (it sleeps the layer's forward time, so that selective checkpointing can save its output)
and keeps the layer's activation for backward; its backward is ``I``. ``_WeightPath``'s forward is free; its
backward is ``W``, held back for our engine's ``W`` task through ``held_weight_grad_work``. Forward, I and W
are counted in the runtime. The jitter gates, headers, clock and memory probe are ``emulated.py``'s.
"""

from __future__ import annotations

import os
import sys
from functools import partial

import torch
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import emulated as emu  # noqa: E402

_RT: list[SplitRuntime | None] = [None]  # the runtime of the layer whose custom op runs (set by the layer)


class SplitRuntime(emu.Runtime):
    """emulated.Runtime with I and W counted apart, and boundaries without jitter (local edges)."""

    n_i: int = 0
    n_w: int = 0
    local_boundaries: frozenset = frozenset()

    def reset(self, gauge: bool) -> None:
        super().reset(gauge)
        self.n_i = self.n_w = 0

    def delay(self, key: float, direction: int, boundary: int) -> float:
        return 0.0 if boundary in self.local_boundaries else super().delay(key, direction, boundary)


@torch.library.custom_op("varuna_bench::work", mutates_args=())
def work(x: Tensor, w: Tensor, seconds: float) -> Tensor:
    """The layer's expensive op: ``x * w`` taking ``seconds`` (the header carried through)."""
    rt = _RT[0]
    t0 = rt.now()
    out = x * w
    out.view(-1)[: emu.HDR] = x.reshape(-1)[: emu.HDR]
    rt.sample()
    emu._sleep_until(rt, t0 + seconds)
    rt.busy_s += rt.now() - t0
    rt.n_fwd += 1
    return out


@work.register_fake
def _(x: Tensor, w: Tensor, seconds: float) -> Tensor:
    return torch.empty_like(x)


class _InputPath(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, rt: SplitRuntime, fwd_s: float, i_s: float, act_numel: int):
        ctx.rt, ctx.i_s = rt, i_s
        if not emu._real(x):
            return x * w
        _RT[0] = rt
        out = torch.ops.varuna_bench.work(x, w, fwd_s)
        act = torch.ones(act_numel)  # the layer's internal activation, kept for backward (touched: resident)
        ctx.save_for_backward(x, w, act)
        rt.sample()
        return out

    @staticmethod
    def backward(ctx, g):
        rt: SplitRuntime = ctx.rt
        x, w, _ = ctx.saved_tensors  # unpack first: a checkpoint's recompute runs here, timed by its own ops
        t0 = rt.now()
        gx = g * w
        rt.sample()
        emu._sleep_until(rt, t0 + ctx.i_s)
        rt.busy_s += rt.now() - t0
        rt.n_i += 1
        return gx, None, None, None, None, None


def _held_work(ctx, param):
    try:
        from lightning_varuna.pipeline.runtime.fused_linear_grad import held_weight_grad_work
    except ImportError:  # an engine without the protocol: W runs in the pass
        return None
    return held_weight_grad_work(ctx, param, 1)


class _WeightPath(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, rt: SplitRuntime, w_s: float):
        ctx.rt, ctx.w_s, ctx.param = rt, w_s, w
        ctx.save_for_backward(x)
        return x.new_zeros(()).expand_as(x)

    @staticmethod
    def backward(ctx, g):
        rt: SplitRuntime = ctx.rt
        (x,) = ctx.saved_tensors

        def weight_grad() -> Tensor:
            t0 = rt.now()
            gw = (g * x).sum(dim=tuple(range(g.dim() - 1)))
            if emu._real(gw):
                rt.sample()
                emu._sleep_until(rt, t0 + ctx.w_s)
                rt.busy_s += rt.now() - t0
                rt.n_w += 1
            return gw

        held = _held_work(ctx, ctx.param) if emu._real(g) else None
        if held is not None:
            held.hold_computed(ctx.param, weight_grad)
            return None, None, None, None
        return None, weight_grad(), None, None


class SplitLayer(nn.Module):
    def __init__(self, hidden: int, rt: SplitRuntime, fwd_s: float, half_bwd_s: float, act_numel: int):
        super().__init__()
        self.w = nn.Parameter(torch.ones(hidden))  # stays 1: no optimizer step is taken
        self.rt, self.fwd_s, self.half_bwd_s, self.act_numel = rt, fwd_s, half_bwd_s, act_numel

    def forward(self, x: Tensor) -> Tensor:
        y = _InputPath.apply(x, self.w.detach(), self.rt, self.fwd_s, self.half_bwd_s, self.act_numel)
        return y + _WeightPath.apply(x.detach(), self.w, self.rt, self.half_bwd_s)


def _sac_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    if op is torch.ops.varuna_bench.work.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class Chunk(nn.Module):
    """Stage ``stage`` of ``num_stages``: InGate -> [anchor on stage 0] -> L SplitLayers -> OutGate."""

    def __init__(self, stage: int, num_stages: int, args, rt: SplitRuntime, v: int, ckpt: str = "none"):
        super().__init__()
        self.stage, self.num_stages, self.rt, self.ckpt = stage, num_stages, rt, ckpt
        fwd_s = args.fwd_ms / 1e3 / (v * args.layers)
        half_bwd_s = args.fwd_ms * args.bwd_factor / 1e3 / (2 * v * args.layers)
        act = args.act_factor * args.mbs * args.seq * args.hidden
        self.body = nn.Sequential(*[SplitLayer(args.hidden, rt, fwd_s, half_bwd_s, act) for _ in range(args.layers)])
        # so that the first layer's input needs a gradient on stage 0 too: every layer runs its I
        self.anchor = nn.Parameter(torch.ones(1)) if stage == 0 else None

    def forward(self, x: Tensor) -> Tensor:
        x = emu._InGate.apply(x, self.rt, self.stage)
        if self.anchor is not None:
            x = x * self.anchor
        if self.ckpt == "full":
            x = torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)
        elif self.ckpt == "sac":
            from torch.utils.checkpoint import create_selective_checkpoint_contexts

            ctx_fn = partial(create_selective_checkpoint_contexts, _sac_policy)
            x = torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False, context_fn=ctx_fn)
        else:
            x = self.body(x)
        return emu._OutGate.apply(x, self.rt, self.stage, self.stage == self.num_stages - 1)
