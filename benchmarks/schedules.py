"""Every pipeline schedule torch ships against all of ours, emulated compute with the backward split into I and W.

Launch (from the repository root; one job per P runs every system, configuration and repetition)::

    torchrun --standalone --nproc-per-node=4 benchmarks/schedules.py --out benchmarks/results/schedules_p4.json
    python benchmarks/schedules_report.py benchmarks/results/schedules_p4.json   # table, chart, targets
    torchrun --standalone --nproc-per-node=2 benchmarks/schedules.py --smoke --out /tmp/smoke.json  # seconds

The model, the jitter and the clock are those of ``emulated.py`` (imported from it), with one change: each
emulated layer's backward is two autograd nodes, so that a schedule that splits the backward into an
input-gradient task ``I`` and a weight-gradient task ``W`` runs them apart, each sleeping its half of ``B``:

* ``y = _InputPath(x, w.detach()) + _WeightPath(x.detach(), w)``. ``_InputPath``'s forward calls the custom op
  ``varuna_bench::work`` (it sleeps the layer's forward time) and allocates the layer's internal activation
  (``--act-factor`` times the boundary tensor), saved for backward; its backward is ``I`` (``g * w``, sleeps B/2).
  ``_WeightPath``'s forward is free (zeros); its backward is ``W`` (``sum(g * x)``, sleeps B/2). torch's stage
  computes ``autograd.grad`` with respect to the stage's inputs first (only ``_InputPath`` lies on that path),
  the parameters' gradients later. Our engine's ``I`` holds ``W`` back through
  ``fused_linear_grad.held_weight_grad_work``: the sleep runs in our held-back path, inside the ``W`` task.
* Forward, ``I`` and ``W`` are counted per step and rank and compared with what the system must run
  (``counts_ok`` in each row): a forward per micro-batch and layer, plus one more per recomputed layer
  (full checkpointing); selective checkpointing saves the custom op's output, so its recompute does not run
  the op again (the activation is still rebuilt: that is what it saves memory on).
* Memory: ``emulated.py``'s method, glibc heap in use sampled at every op boundary in memory steps; the
  figure per stage is the peak above the step's start; the max over stages decides whether a job fits.

Checkpointing for torch's stages wraps each model chunk's layers (per chunk, not per layer), on every chunk but
the last stage's, as ``emulated.py`` does; ``sac`` = ``create_selective_checkpoint_contexts`` with a policy
that must save ``varuna_bench::work``'s output and prefers to recompute everything else.
torch's multi-chunk schedules run v=2 chunks per rank: looped (rank r holds stages r and r+P) for
Interleaved1F1B, LoopedBFS, InterleavedZeroBubble; V-shaped (r and 2P-1-r) for ZBVZeroBubble and DualPipeV
(the edge between a rank's two chunks is local: no jitter there). A chunk's forward takes F/v. Ours with
``stages_per_rank=2`` are placed alike: looped for ``interleaved`` and ``zero-bubble``, V-shaped for
``zero-bubble-v`` (its local edge handed over in memory, no jitter either).
Our systems are (name, PipelineEngine keywords) in ``OURS``: one line each; one the engine refuses at
construction or setup (ValueError/TypeError) is recorded as not available.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import emulated as emu  # noqa: E402 - the jitter gates, headers, memory probe and clock of emulated.py
from split_emulation import Chunk, SplitRuntime, _sac_policy  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------------------------- systems
# torch: name -> (class, chunks per rank, placement)
TORCH = {
    "gpipe": ("ScheduleGPipe", 1, "looped"),
    "1f1b": ("Schedule1F1B", 1, "looped"),
    "interleaved1f1b": ("ScheduleInterleaved1F1B", 2, "looped"),
    "loopedbfs": ("ScheduleLoopedBFS", 2, "looped"),
    "interleavedzb": ("ScheduleInterleavedZeroBubble", 2, "looped"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v"),
    "dualpipev": ("ScheduleDualPipeV", 2, "v"),
}
TORCH_SYSTEMS = {f"torch-{s}{'' if c == 'none' else '-' + c}": (s, c) for s in TORCH for c in ("none", "full", "sac")}
# ours: name -> PipelineEngine keywords (one line per system)
OURS = {
    "ours-varuna-rc": dict(schedule="varuna", recompute=True),
    "ours-1f1b": dict(schedule="1f1b", recompute=False),
    "ours-1f1b-rc": dict(schedule="1f1b", recompute=True),
    "ours-gpipe": dict(schedule="gpipe", recompute=False),
    "ours-zb": dict(schedule="zero-bubble", recompute=False),
    "ours-zb-rc": dict(schedule="zero-bubble", recompute=True),
    "ours-interleaved": dict(schedule="interleaved", recompute=False, stages_per_rank=2),
    "ours-interleaved-rc": dict(schedule="interleaved", recompute=True, stages_per_rank=2),
    "ours-interleaved-rc1": dict(schedule="interleaved", recompute=1, stages_per_rank=2),
    "ours-zb-v2": dict(schedule="zero-bubble", recompute=False, stages_per_rank=2),
    "ours-zb-v2-rc": dict(schedule="zero-bubble", recompute=True, stages_per_rank=2),
    "ours-zb-v2-rc1": dict(schedule="zero-bubble", recompute=1, stages_per_rank=2),
    "ours-zbv": dict(schedule="zero-bubble-v", recompute=False, stages_per_rank=2),
    "ours-zbv-rc": dict(schedule="zero-bubble-v", recompute=True, stages_per_rank=2),
    # recompute by degree: with a cut point after every layer (``--layers`` segments per chunk), the first n
    # segments of each non-last stage are recomputed and the rest keep their graph
    # selective recompute: the forward keeps the custom op's output, the recompute rebuilds only the activation
    **{f"ours-{short}-sac": dict(schedule=schedule, recompute=True, recompute_policy=_sac_policy)
       for short, schedule in (("varuna", "varuna"), ("1f1b", "1f1b"), ("zb", "zero-bubble"))},
    **{f"ours-zb-rc{n}": dict(schedule="zero-bubble", recompute=n) for n in (1, 2, 3)},
    **{f"ours-1f1b-rc{n}": dict(schedule="1f1b", recompute=n) for n in (1, 2, 3)},
    **{f"ours-zbv-rc{n}": dict(schedule="zero-bubble-v", recompute=n, stages_per_rank=2) for n in (1, 2, 3)},
}
SMOKE_SYSTEMS = ("torch-1f1b,torch-1f1b-full,torch-1f1b-sac,torch-interleavedzb-full,torch-zbv,torch-zbv-sac,"
                 "ours-varuna-rc,ours-1f1b-sac,ours-zb,ours-zbv")


def _stage_ids(rank: int, P: int, v: int, placement: str) -> list[int]:
    return [rank, 2 * P - 1 - rank] if placement == "v" else [rank + i * P for i in range(v)]


ZERO_BUBBLE = ("interleavedzb", "zbv", "dualpipev")  # torch's schedules that run I and W as two autograd passes


def _probe_split_backward(args, ckpt: str) -> None:
    """One chunk's backward as torch's zero-bubble stage runs it, in this process: ``autograd.grad`` with respect
    to the input (graph retained), then with respect to the parameters. Raises what torch would raise mid-step
    (where it would leave the other ranks waiting), so that such a system is refused before any rank waits."""
    rt = SplitRuntime(fwd_s=0.0, bwd_s=0.0, layers=args.layers)
    chunk = Chunk(1, 3, args, rt, 1, ckpt)
    x = torch.randn(1, 2, args.hidden, requires_grad=True)
    out = chunk(x)
    g = torch.ones_like(out)
    torch.autograd.grad(out, [x], g, retain_graph=True)
    torch.autograd.grad(out, list(chunk.parameters()), g)


def run_torch(name: str, rt: SplitRuntime, args, rank: int, P: int, m: int):
    """torch.distributed.pipelining stages and schedule; returns (step, zero_grad, cleanup, expected counts)."""
    import torch.distributed.pipelining as pp

    sched_name, ckpt = TORCH_SYSTEMS[name]
    cls_name, v, placement = TORCH[sched_name]
    if sched_name in ZERO_BUBBLE and ckpt != "none":
        try:
            _probe_split_backward(args, ckpt)
        except RuntimeError as e:
            raise NotImplementedError(f"torch's split backward under {ckpt} checkpointing fails: {e}") from e
    S = P * v
    sids = _stage_ids(rank, P, v, placement)
    rt.local_boundaries = frozenset(s + 1 for s in range(S - 1) if placement == "v" and s == P - 1)
    chunks = [Chunk(s, S, args, rt, v, ckpt if s != S - 1 else "none") for s in sids]
    shape = (args.mbs, args.seq, args.hidden)
    stages = [
        pp.PipelineStage(c, s, S, torch.device("cpu"), input_args=torch.zeros(shape).requires_grad_(s > 0),
                         output_args=torch.zeros(shape).requires_grad_(True), group=emu._GROUP[0])
        for c, s in zip(chunks, sids, strict=True)
    ]
    cls = getattr(pp, cls_name)
    sched = cls(stages if v > 1 else stages[0], n_microbatches=m, loss_fn=lambda out, tgt: out.mean(),
                scale_grads=True)
    target = torch.zeros(m * args.mbs)
    first, last = 0 in sids, S - 1 in sids

    def step(batch):
        sched.step(*([batch] if first else []), target=target if last else None, losses=[] if last else None,
                   return_outputs=False)

    def zero_grad():
        for c in chunks:
            c.zero_grad(set_to_none=True)

    L = args.layers
    recomputed = sum(1 for c in chunks if c.ckpt == "full")
    expected = {"fwd": m * L * (v + recomputed), "i": m * L * v, "w": m * L * v}
    return step, zero_grad, (lambda: None), expected


class FullModel(nn.Module):
    """The S chunks in a row, a cut point between chunks and one after every layer inside a chunk: the engine sees
    ``S x layers`` segments and, balancing by parameters, gives each stage one chunk's layers (checked after setup)."""

    def __init__(self, S: int, args, rt: SplitRuntime, v: int, cut_point_cls):
        super().__init__()
        self.blocks = nn.ModuleList(Chunk(i, S, args, rt, v) for i in range(S))
        for block in self.blocks:
            layers = list(block.body)
            block.body = nn.Sequential(*[m for layer in layers[:-1] for m in (layer, cut_point_cls())], layers[-1])
        self.cuts = nn.ModuleList(cut_point_cls() for _ in range(S - 1))

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i < len(self.cuts):
                x = self.cuts[i](x)
        return x


def run_ours(name: str, rt: SplitRuntime, args, rank: int, P: int, m: int):
    """Our PipelineEngine on the same chunks; returns (step, zero_grad, cleanup, expected counts)."""
    import lightning_varuna
    from lightning_varuna.pipeline.config import EngineConfig
    from lightning_varuna.pipeline.engine import PipelineEngine
    from lightning_varuna.pipeline.scheduling.schedules import stage_ranks

    kwargs = OURS[name]
    v = int(kwargs.get("stages_per_rank", 1))
    S = P * v
    placed = stage_ranks(P, v, kwargs["schedule"])  # looped, or V-shaped for zero-bubble-v
    # the edge between stages P-1 and P of the V-shaped placement stays on one rank: no jitter there (as for torch's)
    rt.local_boundaries = frozenset(s + 1 for s in range(S - 1) if placed is not None and placed[s] == placed[s + 1])
    model = FullModel(S, args, rt, v, lightning_varuna.CutPoint)

    def step_fn(microbatch):
        return model(microbatch).mean()

    config = EngineConfig(pipeline_parallel_size=P, num_microbatches=m, p2p_timeout=60.0, partition="params",
                          **kwargs)
    engine = PipelineEngine(model, config)
    sample = emu.make_batch(torch.randn(m * args.mbs, args.seq, args.hidden), m, step=999)
    engine.setup(sample, step_fn)
    L = args.layers
    segments = [len(stage.segments) for stage in engine.partition.stages]
    if segments != [L] * S:  # the emulation's gates and counts assume a stage is one chunk
        raise RuntimeError(f"{name}: the engine split the {S * L} segments as {segments}, not {L} per stage")
    if args.jitter_mode == "deadline":
        emu._arrive_at_deadlines(engine.executor.p2p, rt)
    recompute = kwargs.get("recompute")
    # every held chunk but the last stage's runs `redone` of its L layers' forwards twice: all of them with
    # recompute=True, the first n with recompute=n (1 == True in Python: a degree is told apart by its type)
    held = [s for s in range(S) if placed[s] == rank] if placed is not None else [rank]
    redone = L if recompute is True else (0 if recompute is False else int(recompute))
    if kwargs.get("recompute_policy") is not None:  # the saved op does not run again
        redone = 0
    fwd = m * (L * v + redone * sum(1 for s in held if s != S - 1))
    expected = {"fwd": fwd, "i": m * L * v, "w": m * L * v}
    return (lambda b: engine.train_step(b, step_fn)), (lambda: model.zero_grad(set_to_none=True)), \
        (lambda: engine.teardown() if hasattr(engine, "teardown") else None), expected


# --------------------------------------------------------------------------------------------- driver
def _one_step(fns, rt: SplitRuntime, batch: Tensor, m: int, i: int, gauge: bool) -> list:
    step, zero_grad = fns[0], fns[1]
    emu.make_batch(batch, m, step=i)
    zero_grad()
    gc.collect()
    rt.reset(gauge)
    start_mem = rt.peak
    dist.barrier(group=emu._GROUP[0])
    t0 = time.monotonic()
    step(batch)
    t1 = time.monotonic()
    return [t0, t1, rt.busy_s, rt.jitter_wait_s, rt.n_fwd, rt.n_i, rt.n_w, rt.peak - start_mem]


def _build(name: str, rt: SplitRuntime, args, rank: int, P: int, m: int):
    """The system's functions, or the reason it is not available (the same on every rank)."""
    err = None
    fns = None
    try:
        fns = (run_torch if name.startswith("torch-") else run_ours)(name, rt, args, rank, P, m)
    except (ValueError, TypeError, NotImplementedError) as e:
        err = f"{type(e).__name__}: {e}"
    errs = [None] * P
    dist.all_gather_object(errs, err, group=emu._GROUP[0])
    errs = [e for e in errs if e]
    return (None, errs[0][:400]) if errs else (fns, None)


def measure_group(names: list[str], jitters: list[float], args, rank: int, P: int, m: int, clock_base: float):
    """Every (system, jitter) at one m: built and warmed up in turn, then their steps interleaved."""
    batch = torch.randn(m * args.mbs, args.seq, args.hidden, generator=torch.Generator().manual_seed(rank))
    built, unavailable = [], []
    for name in names:
        for jf in jitters:
            rt = SplitRuntime(fwd_s=args.fwd_ms / 1e3, bwd_s=args.fwd_ms * args.bwd_factor / 1e3,
                              layers=args.layers, jitter_frac=jf, jitter_mode=args.jitter_mode, seed=args.seed,
                              clock_base=clock_base)
            gc.collect()
            dist.barrier(group=emu._GROUP[0])
            base_mem = emu.heap_in_use()
            fns, why = _build(name, rt, args, rank, P, m)
            if fns is None:
                unavailable.append({"system": name, "m": m, "jitter": jf, "reason": why})
                continue
            for i in range(args.warmup):
                _one_step(fns, rt, batch, m, i, gauge=False)
            fns[1]()
            gc.collect()
            built.append((name, jf, rt, fns, emu.heap_in_use() - base_mem))
    recs: list[list] = [[] for _ in built]
    peaks = [0] * len(built)
    for k in range(args.steps + args.memory_steps):
        gauge = k >= args.steps
        for j in range(len(built)):
            idx = (j + k) % len(built)
            rec = _one_step(built[idx][3], built[idx][2], batch, m, args.warmup + k, gauge=gauge)
            if gauge:
                peaks[idx] = max(peaks[idx], rec[7])
            else:
                recs[idx].append(rec)
    for b in built:
        b[3][2]()
    mine = [(r, b[4], p, b[3][3]) for r, b, p in zip(recs, built, peaks, strict=True)]
    gathered = [None] * P
    dist.all_gather_object(gathered, mine, group=emu._GROUP[0])
    rows = []
    for j, (name, jf, rt, _, _) in enumerate(built if rank == 0 else []):
        out = [gathered[r][j][0] for r in range(P)]
        n = len(out[0])
        step_s = [max(out[r][k][1] for r in range(P)) - min(out[r][k][0] for r in range(P)) for k in range(n)]
        counts = [[out[r][k][4:7] for k in range(n)] for r in range(P)]
        expected = [gathered[r][j][3] for r in range(P)]
        ok = all(
            (e["fwd"] is None or c[0] == e["fwd"]) and c[1] == e["i"] and c[2] == e["w"]
            for r, e in enumerate(expected) for c in counts[r]
        )
        half_b = rt.bwd_s / 2
        v = 2 if (name.startswith("torch-") and TORCH[TORCH_SYSTEMS[name][0]][1] == 2) or \
            (name in OURS and OURS[name].get("stages_per_rank", 1) == 2) else 1
        fl, bl = rt.fwd_s / (v * rt.layers), half_b / (v * rt.layers)
        overrun = [out[r][k][2] / (out[r][k][4] * fl + (out[r][k][5] + out[r][k][6]) * bl) - 1.0
                   for r in range(P) for k in range(n)]
        rows.append({
            "system": name, "framework": name.split("-")[0], "m": m, "P": P, "jitter": jf, "chunks_per_rank": v,
            "samples_per_step": m * args.mbs,
            "step_s": statistics.median(step_s), "step_s_all": step_s,
            "step_s_min": min(step_s), "step_s_max": max(step_s),
            "ideal_s": m * (rt.fwd_s + rt.bwd_s),
            "counts_per_stage_step": counts, "counts_expected_per_stage": expected, "counts_ok": ok,
            "busy_s_per_stage": [statistics.median(out[r][k][2] for k in range(n)) for r in range(P)],
            "jitter_wait_s_per_stage": [statistics.median(out[r][k][3] for k in range(n)) for r in range(P)],
            "peak_mib_per_stage": [gathered[r][j][2] / 2**20 for r in range(P)],
            "held_mib_per_stage": [gathered[r][j][1] / 2**20 for r in range(P)],
            "op_overrun_median": statistics.median(overrun), "op_overrun_max": max(overrun),
        })
    return rows, unavailable


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/schedules.json")
    p.add_argument("--systems", default=",".join([*TORCH_SYSTEMS, *OURS]))
    p.add_argument("--microbatches", default="8,16,32")
    p.add_argument("--jitter", default="0,0.5")
    p.add_argument("--jitter-mode", choices=["deadline", "sender"], default="deadline")
    p.add_argument("--fwd-ms", type=float, default=20.0, help="F: forward time of one rank's model part")
    p.add_argument("--bwd-factor", type=float, default=2.0, help="B = bwd_factor * F (I and W: B/2 each)")
    p.add_argument("--layers", type=int, default=2, help="SplitLayers per chunk")
    p.add_argument("--act-factor", type=int, default=4, help="a layer's saved activation / the boundary tensor")
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="timed repetitions per configuration (interleaved)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--memory-steps", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=180.0)
    p.add_argument("--smoke", action="store_true", help=f"seconds: {SMOKE_SYSTEMS}, m=4, F=4 ms, one step")
    args = p.parse_args(argv)
    if args.smoke:
        args.systems, args.microbatches, args.jitter = SMOKE_SYSTEMS, "4", "0,0.5"
        args.fwd_ms, args.steps, args.seq = 4.0, 1, 16

    t_start = time.monotonic()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    rank, P = dist.get_rank(), dist.get_world_size()
    emu._GROUP[0] = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.timeout_s))
    names = [s for s in args.systems.split(",") if s]
    unknown = [s for s in names if s not in TORCH_SYSTEMS and s not in OURS]
    if unknown:
        raise SystemExit(f"unknown systems {unknown}: choose from {[*TORCH_SYSTEMS, *OURS]}")
    for module in ("torch.distributed.pipelining", "lightning_varuna.pipeline.engine"):  # before gc.freeze
        importlib.import_module(module)
    gc.collect()
    gc.freeze()
    base = [time.monotonic() - 1.0]
    dist.broadcast_object_list(base, src=0, group=emu._GROUP[0])
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_ROOT, capture_output=True, text=True).stdout.strip()
    meta = {
        "commit": commit, "loadavg_start": os.getloadavg(), "command": " ".join(sys.argv),
        "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(), "P": P,
        "F_s": args.fwd_ms / 1e3, "B_s": args.fwd_ms * args.bwd_factor / 1e3, "layers_per_chunk": args.layers,
        "boundary_mib": args.mbs * args.seq * args.hidden * 4 / 2**20,
        "activation_mib_per_layer": args.act_factor * args.mbs * args.seq * args.hidden * 4 / 2**20,
        "microbatches": args.microbatches, "jitter_fracs": args.jitter, "repetitions": args.steps,
        "warmup": args.warmup, "memory_steps": args.memory_steps, "smoke": args.smoke,
        "memory_method": "glibc mallinfo2 (uordblks+hblkhd) sampled at every op boundary in memory steps; peak "
                         "above the step's start, per stage",
    }
    results = {"meta": meta, "rows": [], "unavailable": []}

    def save():
        if rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            meta["wall_s"], meta["loadavg_end"] = time.monotonic() - t_start, os.getloadavg()
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)

    jitters = [float(x) for x in args.jitter.split(",")]
    names.sort(key=lambda s: not s.startswith("torch-"))
    for m in [int(x) for x in args.microbatches.split(",")]:
        rows, unavailable = measure_group(names, jitters, args, rank, P, m, base[0])
        results["rows"] += rows
        results["unavailable"] += unavailable if rank == 0 else []
        for row in rows:
            print(f"[schedules] {row['system']:26s} m={m:2d} jitter={row['jitter']:.1f} step={row['step_s'] * 1e3:7.1f}"
                  f" ms [{row['step_s_min'] * 1e3:.0f}-{row['step_s_max'] * 1e3:.0f}] peak MiB="
                  + "/".join(f"{x:.1f}" for x in row["peak_mib_per_stage"])
                  + f" counts_ok={row['counts_ok']} overrun={row['op_overrun_median'] * 100:.1f}%", flush=True)
        for u in unavailable if rank == 0 else []:
            print(f"[schedules] not available: {u['system']} m={m}: {u['reason']}", flush=True)
        save()
    dist.barrier(group=emu._GROUP[0])
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
