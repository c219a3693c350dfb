"""Pipeline schedule quality with EMULATED compute (sleeps), on CPU/gloo, peers and ours in the same run.

Launch (from the repository root)::

    torchrun --standalone --nproc-per-node=4 benchmarks/emulated.py --out benchmarks/results/emulated.json
    python benchmarks/render.py benchmarks/results/emulated.json > benchmarks/results/emulated.md

Why sleeps: on a 2-core machine real compute cannot show pipeline speed-up (4 processes fight for 2 cores).
A stage here is a few layers whose forward *sleeps* a fixed time and whose backward sleeps 2x that, so the
processes do not compete for cores and the step time is decided by the schedule and communication only.
The layers still do a real (cheap) multiply with a small real parameter, pass real activation-sized tensors
(default micro-batch 4 x 128 x 512 fp32 = 1 MiB) between stages over gloo, keep real tensors alive in the
autograd graph (so memory behaves like a real model) and produce real gradients.

Model of one pipeline stage (``EmulatedStage``)::

    InGate -> L x SleepLayer -> OutGate          (recompute/checkpoint wraps only the SleepLayers)

* ``SleepLayer``: forward = ``x * w`` (w: [hidden] parameter), saves its input for backward, then sleeps so
  the op takes ``F/L`` wall time in total; backward computes ``g*w`` and ``sum(g*x)`` and takes ``2F/L``.
  A recomputed forward (torch checkpoint, or our engine's recompute) sleeps ``F/L`` again: recompute costs
  time, exactly as it would with real layers. The backward unpacks its saved tensors *before* starting its
  clock: under torch.utils.checkpoint that unpack runs the recompute, which must not be hidden inside the
  backward's own time.
* ``InGate`` / ``OutGate``: communication jitter (below) and memory sampling; they sit *outside* the
  checkpointed region so that waiting for a late gradient happens *before* torch's checkpoint recomputes.

Communication jitter ("deadline" model, default, applies identically to every system):
every activation/gradient message crossing a stage boundary carries a 4-float header in its first 4
elements ``[MAGIC, key, deadline, 0]`` (key = step*1000 + micro-batch). When a stage *produces* a message
(end of its forward in ``OutGate.forward``, end of its backward in ``InGate.backward``) it stamps
``deadline = now + d``; the receiving stage, before it may *use* the message (start of ``InGate.forward``
for activations, start of ``OutGate.backward`` for gradients, i.e. before any recompute) sleeps until the
deadline. So a message is usable no earlier than ``d`` after it was produced, the sender is never blocked by
it (as with real network latency), and the real gloo transfer still happens in the framework's own order.
``d = U(0, jitter_frac) * F`` is a pure function of (seed, key, direction, boundary): every system sees
exactly the same delay for the same message, whatever its schedule order or recompute.
Polling: a schedule that asks "has the message arrived?" (our executor's ``is_completed`` check, used by
Varuna's opportunistic rule) would see the gloo arrival, not the emulated deadline. So in this mode our
engine's receives count as arrived only from the message's deadline on (the transport's ``completed`` is
wrapped): our schedule sees the same arrival times that the torch stages wait for.
``--jitter-mode sender`` (the sender sleeps ``d`` before returning its output / input-gradient, so the real
send is late) is the alternative: the delay is visible to any polling, at the price of also stalling the
sender.

Clock: ``time.monotonic`` (CLOCK_MONOTONIC is one clock for all processes of a host); times in headers are
relative to a base broadcast from rank 0 (float32 keeps ~15 us resolution over minutes).

Order: for each m, every (system, jitter) entry is built and warmed up in turn, then all are measured with
their steps interleaved (step k of every entry before step k+1 of any, order rotated each step), so that
background load on a shared machine hits all of them alike. Torch peers are built first. Our engine's
systems first pass a small preflight step; if it fails on any rank their rows are skipped with the reason
and the peers are still measured.

Per configuration, per step (after warm-up steps; a barrier before each step, so pipelines start empty):
* step time = max over ranks of step end - min over ranks of step start (shared clock); median reported.
* busy[s] = wall time stage s spent inside SleepLayer ops (forward, recompute, backward; measured, so
  sleep overshoot is busy, not idle). idle[s] = 1 - busy[s] / step time. Waiting for data/jitter is idle.
* ideal = m * (F + B): total *useful* work / P with P balanced stages. Recompute is NOT counted as work, so
  its cost shows up in the ratio (step / ideal); a perfect flush schedule without recompute has
  ratio (m+P-1)/m and idle (P-1)/(m+P-1).
* memory, per stage, from glibc heap bytes in use (``mallinfo2``: ``uordblks + hblkhd``; torch's CPU
  allocator is malloc-based and does not cache), sampled at every op boundary (each layer's forward and
  backward after its allocations, and in the gates) in *memory steps*: ``--memory-steps`` more steps per
  configuration after the timed ones, interleaved the same way and not timed. The timed steps do not sample:
  one ``mallinfo2`` call walks every malloc arena's free lists and cost 40-50 us in the torch peers' processes
  but 150-170 us in ours (more threads, so more arenas), 5-6 vs 18-26 ms of a step, which skewed the times.
  - peak[s] = max over the step's samples - the figure at the step's start (after ``zero_grad`` and
    ``gc.collect``): live autograd graphs (saved activations), stashed inputs, outputs kept for backward,
    gradients and temporaries. Max over the memory steps. Sampled, not continuous: a transient between two
    ops can be missed (at most about one activation).
  - held[s] = the figure after the warm-up step(s) (after ``zero_grad`` and ``gc.collect``) - the figure
    before the configuration's stage and schedule objects were built: buffers a framework keeps between
    steps (torch preallocates one receive buffer per micro-batch for activations and for gradients). May
    include one-time lazy allocations of the first configuration that uses a code path (a pre-warm at
    start-up removes the known ones).
  The peak a stage really needs is about held + peak.
* op overrun = measured busy / nominal op time - 1 (median): sleep wake-up latency plus real tensor work; a
  gauge of machine load while the row was measured (about 1-3% when the machine is quiet).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

# The repository root (so `lightning_varuna` imports when the script is run as benchmarks/emulated.py).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

MAGIC = -12345.0  # header marker: no real activation / gradient element is ever exactly this
HDR = 4  # header floats: [MAGIC, key, deadline (relative to CLOCK_BASE), unused]
FWD, BWD = 0, 1


# --------------------------------------------------------------------------------------------- memory
class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


try:
    _libc = ctypes.CDLL("libc.so.6")
    _libc.mallinfo2.restype = _MallInfo2

    def heap_in_use() -> int:
        """Bytes in use in the glibc heap (arenas + mmapped chunks); torch's CPU allocator uses malloc."""
        mi = _libc.mallinfo2()
        return int(mi.uordblks + mi.hblkhd)

except (OSError, AttributeError):  # not glibc >= 2.33: no memory figures

    def heap_in_use() -> int:
        return 0


# --------------------------------------------------------------------------------------------- runtime
@dataclass
class Runtime:
    """Per-process emulation settings and per-step counters."""

    fwd_s: float  # F: one stage's forward time
    bwd_s: float  # B: one stage's backward time
    layers: int  # L: SleepLayers per stage
    jitter_frac: float = 0.0  # d ~ U(0, jitter_frac) * F per message; 0 = off
    jitter_mode: str = "deadline"  # "deadline": receiver waits until produced+d; "sender": sender sleeps d
    seed: int = 0
    clock_base: float = 0.0
    # counters (reset every step)
    busy_s: float = 0.0
    jitter_wait_s: float = 0.0
    n_fwd: int = 0
    n_bwd: int = 0
    peak: int = 0
    gauge: bool = False  # sample the heap at op boundaries (memory steps only: the probe costs time)
    extra: dict = field(default_factory=dict)

    def reset(self, gauge: bool) -> None:
        self.busy_s = self.jitter_wait_s = 0.0
        self.n_fwd = self.n_bwd = 0
        self.gauge = gauge
        self.peak = heap_in_use() if gauge else 0

    def sample(self) -> None:
        if not self.gauge:
            return
        b = heap_in_use()
        if b > self.peak:
            self.peak = b

    def now(self) -> float:
        return time.monotonic() - self.clock_base

    def delay(self, key: float, direction: int, boundary: int) -> float:
        """Seeded delay of one message: the same for every system measured."""
        if self.jitter_frac <= 0.0:
            return 0.0
        u = random.Random(f"{self.seed}:{int(key)}:{direction}:{boundary}").random()
        return u * self.jitter_frac * self.fwd_s


def _sleep_until(rt: Runtime, t: float) -> None:
    while True:
        left = t - rt.now()
        if left <= 0:
            return
        time.sleep(left)


def _real(t: torch.Tensor) -> bool:
    """False for meta tensors (shape inference, e.g. our engine's stand-ins): no sleeping, no header."""
    return t.device.type != "meta"


def _header(t: torch.Tensor) -> tuple[bool, float, float]:
    if not _real(t):
        return False, 0.0, 0.0
    h = t.detach().reshape(-1)[:HDR].tolist()
    if len(h) < HDR or h[0] != MAGIC:
        return False, 0.0, 0.0
    return True, h[1], h[2]


def _stamp(t: torch.Tensor, key: float, deadline: float) -> None:
    if not (_real(t) and t.is_contiguous()):
        return
    flat = t.view(-1)  # contiguous: we write the header in place
    flat[:HDR] = torch.tensor([MAGIC, key, deadline, 0.0], dtype=t.dtype)


# --------------------------------------------------------------------------------------------- layers
class _SleepOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, rt: Runtime):
        t0 = rt.now()
        out = x * w
        ctx.save_for_backward(x, w)  # the activation this "layer" keeps for backward
        ctx.rt = rt
        if not _real(out):
            return out
        out.view(-1)[:HDR] = x.reshape(-1)[:HDR]  # carry the message header through the stage
        rt.sample()
        _sleep_until(rt, t0 + rt.fwd_s / rt.layers)
        rt.busy_s += rt.now() - t0
        rt.n_fwd += 1
        return out

    @staticmethod
    def backward(ctx, g):
        rt: Runtime = ctx.rt
        # Unpack first: under torch.utils.checkpoint this is where the recompute runs (timed by its own
        # forward ops), and it must not eat into this backward op's time.
        x, w = ctx.saved_tensors
        t0 = rt.now()
        gx = g * w
        gw = (g * x).sum(dim=tuple(range(g.dim() - 1)))
        if not _real(gx):
            return gx, gw, None
        rt.sample()
        _sleep_until(rt, t0 + rt.bwd_s / rt.layers)
        rt.busy_s += rt.now() - t0
        rt.n_bwd += 1
        return gx, gw, None


class SleepLayer(nn.Module):
    def __init__(self, hidden: int, rt: Runtime):
        super().__init__()
        self.w = nn.Parameter(torch.ones(hidden))  # stays 1: no optimizer step is taken
        self.rt = rt

    def forward(self, x):
        return _SleepOp.apply(x, self.w, self.rt)


class _InGate(torch.autograd.Function):
    """Forward: wait until the received activation is 'delivered'. Backward: stamp the outgoing gradient."""

    @staticmethod
    def forward(ctx, x, rt: Runtime, stage: int):
        ok, key, deadline = _header(x)
        ctx.rt, ctx.stage, ctx.key = rt, stage, key if ok else None
        if ok and rt.jitter_mode == "deadline" and deadline > 0:
            t0 = rt.now()
            _sleep_until(rt, deadline)
            rt.jitter_wait_s += rt.now() - t0
        rt.sample()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        rt: Runtime = ctx.rt
        if ctx.key is not None and ctx.stage > 0:
            g = g.contiguous()
            d = rt.delay(ctx.key, BWD, ctx.stage)  # gradient crossing boundary stage-1 <- stage
            if rt.jitter_mode == "sender" and d > 0:
                t0 = rt.now()
                _sleep_until(rt, t0 + d)
                rt.jitter_wait_s += rt.now() - t0
                _stamp(g, ctx.key, 0.0)
            else:
                _stamp(g, ctx.key, rt.now() + d if d > 0 else 0.0)
        rt.sample()
        return g, None, None


class _OutGate(torch.autograd.Function):
    """Forward: stamp the outgoing activation. Backward: wait until the received gradient is 'delivered'."""

    @staticmethod
    def forward(ctx, x, rt: Runtime, stage: int, last: bool):
        ctx.rt = rt
        ok, key, _ = _header(x)
        if ok and not last:
            d = rt.delay(key, FWD, stage + 1)  # activation crossing boundary stage -> stage+1
            if rt.jitter_mode == "sender" and d > 0:
                t0 = rt.now()
                _sleep_until(rt, t0 + d)
                rt.jitter_wait_s += rt.now() - t0
                _stamp(x, key, 0.0)
            else:
                _stamp(x, key, rt.now() + d if d > 0 else 0.0)
        ctx.mark_dirty(x)
        rt.sample()
        return x

    @staticmethod
    def backward(ctx, g):
        rt: Runtime = ctx.rt
        ok, _, deadline = _header(g)
        if ok and rt.jitter_mode == "deadline" and deadline > 0:
            t0 = rt.now()
            _sleep_until(rt, deadline)
            rt.jitter_wait_s += rt.now() - t0
        rt.sample()
        return g, None, None, None


class EmulatedStage(nn.Module):
    """One pipeline stage: InGate -> `layers` SleepLayers (optionally checkpointed) -> OutGate."""

    def __init__(self, stage: int, num_stages: int, hidden: int, rt: Runtime, checkpoint: bool = False):
        super().__init__()
        self.stage, self.num_stages, self.rt, self.checkpoint = stage, num_stages, rt, checkpoint
        self.body = nn.Sequential(*[SleepLayer(hidden, rt) for _ in range(rt.layers)])

    def forward(self, x):
        x = _InGate.apply(x, self.rt, self.stage)
        if self.checkpoint:
            x = torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)
        else:
            x = self.body(x)
        return _OutGate.apply(x, self.rt, self.stage, self.stage == self.num_stages - 1)


def make_batch(base: torch.Tensor, m: int, step: int) -> torch.Tensor:
    """Write each micro-batch's header (key = step*1000 + micro-batch) into every one of its samples."""
    mbs = base.shape[0] // m
    for i in range(m):
        base[i * mbs : (i + 1) * mbs, 0, :HDR] = torch.tensor([MAGIC, step * 1000 + i, 0.0, 0.0])
    return base


# --------------------------------------------------------------------------------------------- systems
@dataclass(frozen=True)
class System:
    name: str
    framework: str  # "torch" | "ours"
    schedule: str  # "1f1b" | "gpipe" | "varuna"
    recompute: bool
    feed_next_stage: bool = True  # ours: the run-time rule that feeds a starving next stage (schedules.next_task)
    varuna_rule: bool = True  # ours: Varuna's rule (a forward goes ahead of an R/B whose gradient is late)


SYSTEMS = {
    s.name: s
    for s in [
        System("torch-1f1b", "torch", "1f1b", False),
        System("torch-1f1b-ckpt", "torch", "1f1b", True),
        System("torch-gpipe", "torch", "gpipe", False),
        System("torch-gpipe-ckpt", "torch", "gpipe", True),
        System("ours-varuna-rc", "ours", "varuna", True),
        System("ours-varuna-rc-classic", "ours", "varuna", True, feed_next_stage=False),  # Varuna's rule alone
        System("ours-varuna-rc-static", "ours", "varuna", True, feed_next_stage=False, varuna_rule=False),  # list order
        System("ours-1f1b-rc", "ours", "1f1b", True),
        System("ours-1f1b", "ours", "1f1b", False),
        System("ours-gpipe", "ours", "gpipe", False),
    ]
}
_GROUP: list = [None]  # the process group of the benchmark's own collectives and of the torch peers
# Default: the four peers and our Varuna schedule (~3 min in all). Add ours-1f1b (+~25 s) to separate our
# engine's overhead from its schedule.
DEFAULT_SYSTEMS = "torch-1f1b,torch-1f1b-ckpt,torch-gpipe,torch-gpipe-ckpt,ours-varuna-rc"


def run_torch(sysm: System, rt: Runtime, rank: int, world: int, m: int, shape: tuple[int, ...]):
    """torch.distributed.pipelining PipelineStage + Schedule1F1B / ScheduleGPipe, one stage per rank.

    With recompute, the stage's layers are wrapped in torch.utils.checkpoint (non-reentrant) on every stage
    but the last (the last stage never needs to recompute; this is also what Varuna does).
    Returns (step_fn(batch), zero_grad_fn, cleanup_fn).
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    last = rank == world - 1
    mod = EmulatedStage(rank, world, shape[-1], rt, checkpoint=sysm.recompute and not last)
    # Static shapes (no metadata-inference forward); received activations / outputs need grad.
    ex_in = torch.zeros(shape).requires_grad_(rank > 0)
    ex_out = torch.zeros(shape).requires_grad_(True)
    stage = PipelineStage(mod, rank, world, torch.device("cpu"), input_args=ex_in, output_args=ex_out, group=_GROUP[0])
    cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[sysm.schedule]
    sched = cls(stage, n_microbatches=m, loss_fn=lambda out, tgt: out.mean(), scale_grads=True)
    target = torch.zeros(m * shape[0])

    def step(batch):
        if rank == 0:
            sched.step(batch, return_outputs=False)
        elif last:
            sched.step(target=target, losses=[], return_outputs=False)
        else:
            sched.step(return_outputs=False)

    return step, (lambda: mod.zero_grad(set_to_none=True)), (lambda: None)


class FullModel(nn.Module):
    """The whole emulated model, as our engine wants it: P stage blocks with a CutPoint between each."""

    def __init__(self, num_stages: int, hidden: int, rt: Runtime, cut_point_cls):
        super().__init__()
        self.blocks = nn.ModuleList(EmulatedStage(i, num_stages, hidden, rt) for i in range(num_stages))
        self.cuts = nn.ModuleList(cut_point_cls() for _ in range(num_stages - 1))

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i < len(self.cuts):
                x = self.cuts[i](x)
        return x


def ours_importable() -> str | None:
    """None if `lightning_varuna.pipeline.engine.PipelineEngine` imports, else the reason."""
    try:
        import lightning_varuna
        from lightning_varuna.pipeline.engine import PipelineEngine  # noqa: F401

        lightning_varuna.CutPoint  # noqa: B018
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def run_varuna(sysm: System, rt: Runtime, rank: int, world: int, m: int, shape: tuple[int, ...]):
    """Our engine (lightning_varuna.pipeline.engine.PipelineEngine) on the same emulated model.

    ``PipelineEngine(module, EngineConfig(pipeline_parallel_size=P, num_microbatches=m, schedule=..., recompute=...))``,
    ``engine.setup(batch, step)``, ``engine.train_step(batch, step)`` with ``step(microbatch) -> loss``. (It
    also adapts to an older announced shape, ``PipelineEngine(module, step_fn, ...)`` with
    ``engine.setup(batch)``, so that the benchmark can measure earlier commits.) The model's blocks are NOT
    checkpointed here: the engine does its own recompute. Jitter and memory sampling live in the blocks
    (InGate/OutGate/SleepLayer), so they apply to the engine unchanged.
    Raises NotImplementedError while the engine is not importable (the rows are then skipped with a note).
    """
    reason = ours_importable()
    if reason is not None:
        raise NotImplementedError(f"lightning_varuna.pipeline.engine not importable ({reason})")
    import inspect

    import lightning_varuna
    from lightning_varuna.pipeline.engine import PipelineEngine

    model = FullModel(world, shape[-1], rt, lightning_varuna.CutPoint)

    def step_fn(module, microbatch):
        return module(microbatch).mean()

    def step(microbatch):
        return step_fn(model, microbatch)

    kwargs = dict(pipeline_parallel_size=world, num_microbatches=m, schedule=sysm.schedule, recompute=sysm.recompute)
    params = inspect.signature(PipelineEngine.__init__).parameters
    if "p2p_timeout" in params or "config" in params:
        kwargs["p2p_timeout"] = 30.0  # a failed peer ends the step within 30 s (see preflight_ours)
    announced = "step_fn" in params
    if "config" in params:  # the engine takes its options as one EngineConfig
        from lightning_varuna.pipeline.config import EngineConfig

        engine = PipelineEngine(model, EngineConfig(**kwargs))
    elif announced:
        engine = PipelineEngine(model, step_fn, **kwargs)
    else:
        engine = PipelineEngine(model, **kwargs)
    sample = make_batch(torch.randn(m * shape[0], *shape[1:]), m, step=999)
    if "step" in inspect.signature(engine.setup).parameters:
        engine.setup(sample, step)
    else:
        engine.setup(sample)
    takes_step = "step" in inspect.signature(engine.train_step).parameters
    executor = getattr(engine, "executor", None)
    if not sysm.feed_next_stage:
        if executor is None:
            raise NotImplementedError("this engine has no executor to switch the feed_next_stage rule off")
        executor.feed_next_stage = False
    if rt.jitter_mode == "deadline" and executor is not None:
        _arrive_at_deadlines(executor.p2p, rt)
    if not sysm.varuna_rule:  # every message counts as there: next_task then always runs the list's head
        if executor is None or sysm.feed_next_stage:
            raise NotImplementedError("Varuna's rule is switched off through the executor, with feed_next_stage off")
        executor.p2p.completed = lambda transfer: True

    def run_step(batch):
        if takes_step:
            engine.train_step(batch, step)
        else:
            engine.train_step(batch)

    def cleanup():
        if hasattr(engine, "teardown"):
            engine.teardown()

    return run_step, (lambda: model.zero_grad(set_to_none=True)), cleanup


class _ArrivesAtDeadline:
    """A receive that counts as arrived only from its message's deadline on: emulated network latency.

    Torch's stages see the same arrival time (they sleep until the deadline before using a message); this
    lets our executor's readiness check (``is_completed``, used by Varuna's opportunistic rule) see it too.
    """

    def __init__(self, work, buffer: torch.Tensor, rt: Runtime) -> None:
        self.work, self.buffer, self.rt = work, buffer, rt

    def is_completed(self) -> bool:
        if not self.work.is_completed():
            return False
        ok, _, deadline = _header(self.buffer)
        return not ok or self.rt.now() >= deadline

    def wait(self, *args, **kwargs):
        return self.work.wait(*args, **kwargs)


def _arrive_at_deadlines(p2p, rt: Runtime) -> None:
    if hasattr(p2p, "completed"):  # an engine whose executor asks the transport whether a receive completed
        completed = p2p.completed

        def completed_at_deadline(transfer) -> bool:
            if not completed(transfer):
                return False
            ok, _, deadline = _header(transfer.tensor)
            return transfer.kind != "recv" or not ok or rt.now() >= deadline

        p2p.completed = completed_at_deadline
        return
    irecv = p2p.irecv  # earlier engines: wrap the receive's work

    def deadline_irecv(tensor: torch.Tensor, src: int, tag: int, **kwargs):
        return _ArrivesAtDeadline(irecv(tensor, src, tag, **kwargs), tensor, rt)

    p2p.irecv = deadline_irecv


RUNNERS = {"torch": run_torch, "ours": run_varuna}


# --------------------------------------------------------------------------------------------- driver
def _one_step(
    fns, rt: Runtime, batch: torch.Tensor, m: int, i: int, barrier: bool = True, gauge: bool = False
) -> list:
    """One barrier-aligned step; returns this rank's record (its peak is 0 unless ``gauge``)."""
    step, zero_grad, _ = fns
    make_batch(batch, m, step=i)  # key = i*1000 + micro-batch: the same messages, the same jitter
    zero_grad()
    gc.collect()
    rt.reset(gauge)
    start_mem = rt.peak
    if barrier:
        dist.barrier(group=_GROUP[0])
    t0 = time.monotonic()
    step(batch)
    t1 = time.monotonic()
    return [t0, t1, rt.busy_s, rt.jitter_wait_s, rt.n_fwd, rt.n_bwd, rt.peak - start_mem]


def _runtime(args, jf: float, clock_base: float) -> Runtime:
    return Runtime(
        fwd_s=args.fwd_ms / 1e3,
        bwd_s=args.fwd_ms * args.bwd_factor / 1e3,
        layers=args.layers,
        jitter_frac=jf,
        jitter_mode=args.jitter_mode,
        seed=args.seed,
        clock_base=clock_base,
    )


def measure_group(entries: list[tuple[System, float]], args, rank: int, world: int, m: int, clock_base: float):
    """Measures every (system, jitter) entry at one m, their steps interleaved.

    Each entry is built and warmed up in turn (its `held` memory is taken then, alone); then measured step
    k runs on every entry before step k+1 runs on any (order rotated every step), so that background load
    on a shared machine hits all entries alike. Returns the rows on rank 0 (an empty list elsewhere).
    """
    shape = (args.mbs, args.seq, args.hidden)
    batch = torch.randn(m * args.mbs, args.seq, args.hidden, generator=torch.Generator().manual_seed(rank))
    built = []  # (system, jitter, runtime, fns, held_bytes, build_s)
    for sysm, jf in entries:
        rt = _runtime(args, jf, clock_base)
        gc.collect()
        dist.barrier(group=_GROUP[0])
        t0, base_mem = time.monotonic(), heap_in_use()
        fns = RUNNERS[sysm.framework](sysm, rt, rank, world, m, shape)
        for i in range(args.warmup):
            _one_step(fns, rt, batch, m, i)
        fns[1]()
        gc.collect()
        built.append((sysm, jf, rt, fns, heap_in_use() - base_mem, time.monotonic() - t0))
    recs: list[list] = [[] for _ in built]
    peaks: list[int] = [0 for _ in built]
    for k in range(args.steps + args.memory_steps):
        gauge = k >= args.steps  # timed steps first, then the memory steps
        for j in range(len(built)):
            idx = (j + k) % len(built)
            rt, fns = built[idx][2], built[idx][3]
            rec = _one_step(fns, rt, batch, m, args.warmup + k, gauge=gauge)
            if gauge:
                peaks[idx] = max(peaks[idx], rec[6])
            else:
                recs[idx].append(rec)
    for b in built:
        b[3][2]()
    gathered = [None] * world
    mine = [(r, b[4], p) for r, b, p in zip(recs, built, peaks, strict=True)]
    dist.all_gather_object(gathered, mine, group=_GROUP[0])
    rows = []
    P = world
    for j, (sysm, jf, rt, _, _, build_s) in enumerate(built if rank == 0 else []):
        out = [gathered[r][j][0] for r in range(P)]
        held = [gathered[r][j][1] for r in range(P)]
        peak = [gathered[r][j][2] for r in range(P)]
        n = len(out[0])
        step_s = [max(out[r][k][1] for r in range(P)) - min(out[r][k][0] for r in range(P)) for k in range(n)]
        med = statistics.median(step_s)
        F, B = rt.fwd_s, rt.bwd_s

        def per_stage(col, fn=statistics.median, out=out, n=n):
            return [fn([out[r][k][col] for k in range(n)]) for r in range(P)]

        idle = [statistics.median([1.0 - out[r][k][2] / step_s[k] for k in range(n)]) for r in range(P)]
        # How much longer the compute ops took than asked (sleep wake-up latency, real tensor work): a
        # gauge of how loaded the machine was while this row was measured. ~1-3% on a quiet machine.
        nominal = [out[r][k][4] * F / rt.layers + out[r][k][5] * B / rt.layers for r in range(P) for k in range(n)]
        busy = [out[r][k][2] for r in range(P) for k in range(n)]
        overrun = statistics.median([b / t - 1.0 for b, t in zip(busy, nominal, strict=True) if t > 0])
        rows.append(
            {
                "system": sysm.name,
                "framework": sysm.framework,
                "schedule": sysm.schedule,
                "recompute": sysm.recompute,
                "m": m,
                "P": P,
                "jitter": jf,
                "step_s": med,
                "step_s_all": step_s,
                "ideal_s": m * (F + B),
                "ratio_ideal": med / (m * (F + B)),
                "bound_s": (m + P - 1) * (F + B),
                "idle_mean": statistics.mean(idle),
                "idle_per_stage": idle,
                "idle_theory": (P - 1) / (m + P - 1),
                "busy_s_per_stage": per_stage(2),
                "jitter_wait_s_per_stage": per_stage(3),
                "fwd_ops_per_stage": per_stage(4, max),
                "bwd_ops_per_stage": per_stage(5, max),
                "peak_mib_per_stage": [v / 2**20 for v in peak],
                "held_mib_per_stage": [v / 2**20 for v in held],
                "op_overrun": overrun,
                "build_warmup_s": build_s,
            }
        )
    built.clear()
    gc.collect()
    return rows


def preflight_ours(systems: list[System], args, rank: int, world: int, clock_base: float) -> dict[str, str]:
    """Builds each of our systems and runs one small step, catching errors on every rank.

    Returns {system name: reason} for those that failed on any rank (their rows are then skipped, and the
    peers are still measured). Our engine talks over its own groups; the benchmark's collectives and the
    torch peers use a separate group (_GROUP), so a failed engine step cannot leave stray messages there.
    A rank that is left waiting on a failed peer gets out through the engine's p2p timeout.
    """
    failed: dict[str, str] = {}
    m = max(world, min(int(x) for x in args.microbatches.split(",")))
    shape = (args.mbs, args.seq, args.hidden)
    for sysm in systems:
        err = None
        try:
            rt = _runtime(args, 0.0, clock_base)
            fns = run_varuna(sysm, rt, rank, world, m, shape)
            batch = torch.randn(m * args.mbs, args.seq, args.hidden)
            _one_step(fns, rt, batch, m, 0, barrier=False)
            fns[2]()
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            err = f"rank {rank}: {type(e).__name__}: {e}"
        errs = [None] * world
        dist.all_gather_object(errs, err, group=_GROUP[0])
        errs = [e for e in errs if e]
        if errs:
            failed[sysm.name] = "; ".join(errs)[:500]
    return failed


def _prewarm() -> None:
    """Run the code paths once (checkpoint, custom Functions, pipelining import) so that their one-time
    lazy allocations do not land in the first configuration's memory figures."""
    import torch.distributed.pipelining  # noqa: F401

    rt = Runtime(fwd_s=0.0, bwd_s=0.0, layers=2)
    for ckpt in (False, True):
        st = EmulatedStage(1, 2, 8, rt, checkpoint=ckpt)
        x = make_batch(torch.randn(2, 2, 8), 1, 0).requires_grad_()
        st(x).mean().backward()
    gc.collect()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/emulated.json")
    p.add_argument("--systems", default=DEFAULT_SYSTEMS, help=f"comma list of {sorted(SYSTEMS)}")
    p.add_argument("--microbatches", default="8,16", help="comma list of m")
    p.add_argument("--jitter", default="0,0.5", help="comma list of jitter fractions of F (0 = off)")
    p.add_argument("--jitter-mode", choices=["deadline", "sender"], default="deadline")
    p.add_argument("--fwd-ms", type=float, default=20.0, help="F: forward time of one stage")
    p.add_argument("--bwd-factor", type=float, default=2.0, help="B = bwd_factor * F")
    p.add_argument("--layers", type=int, default=4, help="SleepLayers per stage (each saves one activation)")
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--steps", type=int, default=4, help="measured steps per configuration (median)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--memory-steps", type=int, default=1,
        help="steps per configuration, after the timed ones, that sample the heap for the peak (not timed)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=120.0, help="gloo timeout (a hang becomes an error)")
    args = p.parse_args(argv)

    t_start = time.monotonic()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    _GROUP[0] = dist.new_group(backend="gloo", timeout=timedelta(seconds=3 * args.timeout_s))
    systems = [SYSTEMS[s] for s in args.systems.split(",") if s]
    _prewarm()
    if any(s.framework == "ours" for s in systems):
        ours_importable()  # import our engine too before freezing
    # Objects from imports/pre-warm move to the permanent generation: gc.collect() (run before every step so
    # that the memory figures start clean) then costs microseconds instead of ~0.2 s.
    gc.collect()
    gc.freeze()

    base = [time.monotonic() - 1.0]
    dist.broadcast_object_list(base, src=0, group=_GROUP[0])
    ms = [int(x) for x in args.microbatches.split(",")]
    jitters = [float(x) for x in args.jitter.split(",")]

    # Our engine: skip its rows (on every rank alike) while it cannot be imported or fails a first step.
    skipped = []
    ours = [s for s in systems if s.framework == "ours"]
    if ours:
        reasons = [None] * world
        dist.all_gather_object(reasons, ours_importable(), group=_GROUP[0])
        reason = next((r for r in reasons if r), None)
        failed = (
            {s.name: f"lightning_varuna.pipeline.engine not importable: {reason}" for s in ours}
            if reason
            else preflight_ours(ours, args, rank, world, base[0])
        )
        skipped = [{"system": name, "reason": why} for name, why in failed.items()]
        systems = [s for s in systems if s.name not in failed]

    meta = {
        "loadavg_start": os.getloadavg(),
        "command": f"torchrun --standalone --nproc-per-node={world} " + " ".join(sys.argv),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "world_size": world,
        "F_s": args.fwd_ms / 1e3,
        "B_s": args.fwd_ms * args.bwd_factor / 1e3,
        "layers_per_stage": args.layers,
        "activation_shape": [args.mbs, args.seq, args.hidden],
        "activation_mib": args.mbs * args.seq * args.hidden * 4 / 2**20,
        "microbatches": ms,
        "jitter_fracs": jitters,
        "steps": args.steps,
        "warmup": args.warmup,
        "jitter_mode": args.jitter_mode,
        "seed": args.seed,
        "memory_steps": args.memory_steps,
        "memory_method": "glibc mallinfo2 (uordblks+hblkhd) sampled at every op boundary, in memory steps only",
        "ideal": "m*(F+B): useful work per stage; recompute not counted as work",
    }
    results = {"meta": meta, "rows": [], "skipped": skipped}

    def save():
        if rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            meta["wall_s"] = time.monotonic() - t_start
            meta["loadavg_end"] = os.getloadavg()
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)

    for s in skipped:
        if rank == 0:
            print(f"[emulated] skipped {s['system']}: {s['reason']}", flush=True)
    # One group per m: every system x jitter entry, interleaved. Peers are built first.
    entries = [(s, jf) for s in sorted(systems, key=lambda s: s.framework != "torch") for jf in jitters]
    for m in ms:
        t0 = time.monotonic()
        try:
            rows = measure_group(entries, args, rank, world, m, base[0])
        except Exception:  # a failing system cannot be skipped safely here: its peers may be blocked in p2p
            traceback.print_exc()
            save()
            raise
        for row in rows:
            row["group_wall_s"] = time.monotonic() - t0
            results["rows"].append(row)
            print(
                f"[emulated] {row['system']:17s} m={m:2d} jitter={row['jitter']:.2f}"
                f" step={row['step_s'] * 1e3:7.1f} ms ratio={row['ratio_ideal']:.3f}"
                f" idle={row['idle_mean']:.3f} (theory {row['idle_theory']:.3f})"
                f" overrun={row['op_overrun'] * 100:.1f}% peak+held MiB="
                + "/".join(
                    f"{a:.0f}+{b:.0f}"
                    for a, b in zip(row["peak_mib_per_stage"], row["held_mib_per_stage"], strict=True)
                ),
                flush=True,
            )
        save()
    save()
    dist.barrier(group=_GROUP[0])
    dist.destroy_process_group()
    if rank == 0:
        print(f"[emulated] wrote {args.out} in {time.monotonic() - t_start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
