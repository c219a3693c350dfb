"""Pipeline schedules with REAL compute at P=2: torch's one- and two-chunk schedules against ours, time and memory.

Run (from the repository root; it starts one ``torchrun`` job of 2 processes per repetition, gloo, 1 thread each)::

    python benchmarks/real_schedules.py --out benchmarks/results/real_schedules.json
    python benchmarks/real_schedules.py --render benchmarks/results/real_schedules.json   # the tables again
    python benchmarks/real_schedules.py --device cuda --out real_schedules_gpu.json        # two GPUs, NCCL

The model and data, the same for every system: the example GPT (``examples/gpt/model.py``; by default 8 blocks,
n_embd 128, 4 heads, block_size 128, vocab 256, tied embedding and head, dropout 0), built with one seed, so every
system starts from the same weights; batch 16, 8 micro-batches; step ``k`` of every system gets the same seeded
random tokens. A step is the pipeline's forward and backward of every micro-batch plus the gradient reduction of
the tied embedding (the optimizer, the same for all, is left out). The model is cut into ``P x v`` chunks of
``n_layer / (P v)`` blocks each; the first chunk also holds the embeddings, the last ``ln_f`` and the tied head.

Systems:

* ``torch-<schedule>[-full|-sac]``: ``torch.distributed.pipelining.PipelineStage`` per chunk and the schedule
  class of :data:`TORCH` (v=1: ``Schedule1F1B``; v=2, looped (rank r holds chunks r and r+2):
  ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``; v=2, V-shaped (r and 3-r):
  ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``), ``scale_grads=True``, then one ``all_reduce`` of the tied
  embedding's gradient where two ranks hold a copy. ``-full``: every chunk but the last stage's runs in
  ``torch.utils.checkpoint`` (non-reentrant); ``-sac``: selective checkpointing that saves the outputs of
  :data:`SAVED_OPS` (matrix products and attention) and recomputes the rest. torch's zero-bubble schedules run
  without checkpointing (``-full`` and ``-sac`` are not offered for them).
* ``ours-*``: our ``PipelineEngine`` (no Lightning: ``benchmarks/real_compute.py`` measures what the Lightning glue
  costs) with the keywords of :data:`OURS`, ``partition="params"`` (the split is checked to be the chunks above),
  ``train_step`` then ``sync_gradients``.

Method: inside one job every system is built and warmed up in turn, then their steps interleave round-robin
(a barrier before each step, so the pipeline starts empty and the systems share the machine's background load
alike). Step time = latest end over ranks - earliest start over ranks (``time.monotonic``, one clock per host).
Memory: in ``--memory-steps`` more steps per system, untimed, a ``TorchDispatchMode`` reads the glibc heap in use
(``mallinfo2``, ``emulated.py``'s probe; torch's CPU allocator is malloc-based) after every aten op; peak = the
largest reading above the step's start (after ``zero_grad`` and ``gc.collect``): activations kept for backward,
boundary buffers, gradients and temporaries. held = heap after warm-up - heap before the system was built
(buffers a framework keeps between steps). The maximum over ranks decides whether a job fits. With
``--device cuda`` (one GPU per process, NCCL) the figures are CUDA's allocator's (``memory_allocated``, and
``max_memory_allocated`` over the step) and each step ends with a ``torch.cuda.synchronize()``.
Check: every system's loss at every measured step is compared with the first system's (the same weights and
tokens, fp32); a row whose losses differ by more than 1e-4 relative is marked ``loss_ok: false`` and the run
exits non-zero.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

# torch: name -> (schedule class, chunks per rank, placement)
TORCH = {
    "1f1b": ("Schedule1F1B", 1, "looped"),
    "interleaved1f1b": ("ScheduleInterleaved1F1B", 2, "looped"),
    "interleavedzb": ("ScheduleInterleavedZeroBubble", 2, "looped"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v"),
    "dualpipev": ("ScheduleDualPipeV", 2, "v"),
}
TORCH_ZERO_BUBBLE = ("interleavedzb", "zbv", "dualpipev")
TORCH_SYSTEMS = {
    f"torch-{s}{'' if c == 'none' else '-' + c}": (s, c)
    for s in TORCH for c in ("none", "full", "sac") if c == "none" or s not in TORCH_ZERO_BUBBLE
}
# ours: name -> PipelineEngine keywords
OURS = {
    "ours-1f1b": dict(schedule="1f1b", recompute=False),
    "ours-zb": dict(schedule="zero-bubble", recompute=False),
    "ours-interleaved": dict(schedule="interleaved", recompute=False, stages_per_rank=2),
    "ours-zb-v2": dict(schedule="zero-bubble", recompute=False, stages_per_rank=2),
    "ours-zbv": dict(schedule="zero-bubble-v", recompute=False, stages_per_rank=2),
    "ours-zb-v2-rc": dict(schedule="zero-bubble", recompute=True, stages_per_rank=2),
    "ours-varuna-rc": dict(schedule="varuna", recompute=True),
    "ours-1f1b-rc": dict(schedule="1f1b", recompute=True),
    "ours-zb-rc": dict(schedule="zero-bubble", recompute=True),
    "ours-zbv-rc": dict(schedule="zero-bubble-v", recompute=True, stages_per_rank=2),
    "ours-interleaved-rc": dict(schedule="interleaved", recompute=True, stages_per_rank=2),
    "ours-zb-sac": dict(schedule="zero-bubble", recompute=True, recompute_policy="saved_ops"),
    "ours-varuna-sac": dict(schedule="varuna", recompute=True, recompute_policy="saved_ops"),
    "ours-1f1b-sac": dict(schedule="1f1b", recompute=True, recompute_policy="saved_ops"),
    **{f"ours-zb-rc{n}": dict(schedule="zero-bubble", recompute=n) for n in (1, 2, 3)},
}
DEFAULT_SYSTEMS = [*TORCH_SYSTEMS, *(name for name in OURS if name not in ("ours-varuna-sac", "ours-zb-rc1",
                                                                            "ours-zb-rc2", "ours-zb-rc3"))]
"""Every torch row and every one of ours but three degrees of recompute and one selective-recompute row."""
LOSS_RTOL = 1e-4


def saved_ops() -> list:
    """The ops whose outputs selective checkpointing keeps (torch's ``-sac`` rows and our ``-sac`` rows alike)."""
    import torch

    aten = torch.ops.aten
    return [aten.mm.default, aten.addmm.default, aten.bmm.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default]


def chunks_per_rank(name: str) -> int:
    if name.startswith("torch-"):
        return TORCH[TORCH_SYSTEMS[name][0]][1]
    return int(OURS[name].get("stages_per_rank", 1))


# --------------------------------------------------------------------------------------------- model
def build_gpt(args):
    import torch

    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    from model import GPT

    torch.manual_seed(1234)
    gpt = GPT(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
              n_embd=args.embd, dropout=0.0)
    gpt.configure_model()  # real layers, initialized here: every system starts from the same weights
    return gpt


def make_batch(args, k: int):
    """Step ``k``'s tokens (inputs, targets), the same for every system."""
    import torch

    g = torch.Generator().manual_seed(10_000 + k)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class TorchChunk:
    """Chunk ``s`` of ``S`` of the GPT as an ``nn.Module`` for torch's ``PipelineStage``."""

    @staticmethod
    def build(gpt, s: int, S: int, ckpt: str):
        import torch
        import torch.nn.functional as F
        from torch import nn
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        per = len(gpt.blocks) // S
        first, last = s == 0, s == S - 1

        class Chunk(nn.Module):
            def __init__(self):
                super().__init__()
                if first:
                    self.wte, self.wpe = gpt.wte, gpt.wpe
                self.blocks = nn.ModuleList(gpt.blocks[s * per:(s + 1) * per])
                if last:
                    self.ln_f, self.head = gpt.ln_f, gpt.wte  # the tied head: the embedding's weight

            def body(self, x):
                if first:
                    x = self.wte(x) + self.wpe(torch.arange(x.size(1), device=x.device))
                for block in self.blocks:
                    x = block(x)
                if last:
                    x = F.linear(self.ln_f(x), self.head.weight)
                return x

            def forward(self, x):
                if ckpt == "full":
                    return checkpoint(self.body, x, use_reentrant=False)
                if ckpt == "sac":
                    ctx = partial(create_selective_checkpoint_contexts, saved_ops())
                    return checkpoint(self.body, x, use_reentrant=False, context_fn=ctx)
                return self.body(x)

        return Chunk()


def _loss_fn(logits, target):
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def run_torch(name: str, args, rank: int, P: int, tied_group, device):
    """torch.distributed.pipelining stages and schedule: returns (step, zero_grad, plan)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining as pp

    sched_name, ckpt = TORCH_SYSTEMS[name]
    cls_name, v, placement = TORCH[sched_name]
    S = P * v
    sids = [rank, 2 * P - 1 - rank] if placement == "v" else [rank + i * P for i in range(v)]
    gpt = build_gpt(args).to(device)
    chunks = [TorchChunk.build(gpt, s, S, ckpt if s != S - 1 else "none") for s in sids]
    mbs, T, C, V = args.batch // args.microbatches, args.seq, args.embd, args.vocab
    stages = []
    for chunk, s in zip(chunks, sids, strict=True):
        ex_in = (torch.zeros(mbs, T, dtype=torch.long, device=device) if s == 0
                 else torch.zeros(mbs, T, C, device=device, requires_grad=True))
        ex_out = torch.zeros(mbs, T, V if s == S - 1 else C, device=device, requires_grad=True)
        stages.append(pp.PipelineStage(chunk, s, S, device, input_args=ex_in, output_args=ex_out))
    sched = getattr(pp, cls_name)(stages if v > 1 else stages[0], n_microbatches=args.microbatches,
                                  loss_fn=_loss_fn, scale_grads=True)
    has_first, has_last = 0 in sids, S - 1 in sids
    # the tied embedding: reduce its gradient where the first and the last chunk sit on two ranks
    tied = gpt.wte.weight if (has_first or has_last) and tied_group is not None else None

    def step(batch):
        idx, tgt = batch
        losses: list = []
        sched.step(*([idx] if has_first else []), target=tgt if has_last else None,
                   losses=losses if has_last else None, return_outputs=False)
        if tied is not None:
            dist.all_reduce(tied.grad, group=tied_group)
        return float(torch.stack(losses).detach().mean()) if has_last else None

    params = {id(p): p for c in chunks for p in c.parameters()}

    def zero_grad():
        for p in params.values():
            p.grad = None

    return step, zero_grad, [[s * (args.layers // S), (s + 1) * (args.layers // S) - 1] for s in range(S)]


def run_ours(name: str, args, rank: int, P: int, tied_group, device):
    """Our PipelineEngine on the same GPT: returns (step, zero_grad, plan)."""
    from lightning_varuna.pipeline.config import EngineConfig
    from lightning_varuna.pipeline.engine import PipelineEngine

    kwargs = dict(OURS[name])
    if kwargs.get("recompute_policy") == "saved_ops":
        kwargs["recompute_policy"] = saved_ops()
    gpt = build_gpt(args)
    config = EngineConfig(pipeline_parallel_size=P, num_microbatches=args.microbatches, partition="params",
                          p2p_timeout=120.0, **kwargs)
    engine = PipelineEngine(gpt, config, device)
    plan = engine.setup(tuple(t.to(device) for t in make_batch(args, -1)), gpt._loss)
    spans = [[st.segments[0], st.segments[-1]] for st in plan.stages]
    S = P * int(kwargs.get("stages_per_rank", 1))
    per = args.layers // S
    # the chunks torch's rows use (the GPT's last segment, after the last block's cut, is ln_f and the head)
    if spans != [[s * per, (s + 1) * per - 1 + (s == S - 1)] for s in range(S)]:
        raise RuntimeError(f"{name}: the engine split the blocks as {spans}, not {per} per stage")

    def step(batch):
        result = engine.train_step(batch, gpt._loss, start_sync=True)
        engine.sync_gradients()
        if not result.outputs:
            return None
        total = sum(result.sizes)
        return float(sum(out.detach() * n for out, n in zip(result.outputs, result.sizes, strict=True)) / total)

    def zero_grad():
        gpt.zero_grad(set_to_none=True)

    return step, zero_grad, spans


# --------------------------------------------------------------------------------------------- worker
class Meter:
    """Bytes in use and a step's peak: the glibc heap on CPU (read after every aten op), CUDA's allocator on GPUs."""

    def __init__(self, device) -> None:
        import torch

        self.cuda = device.type == "cuda"
        self.torch = torch

    def in_use(self) -> int:
        if self.cuda:
            self.torch.cuda.synchronize()
            return self.torch.cuda.memory_allocated()
        from emulated import heap_in_use

        return heap_in_use()

    def measure(self, step, batch):
        """Runs ``step(batch)``; returns its result and the peak bytes in use above the start."""
        if self.cuda:
            start = self.in_use()
            self.torch.cuda.reset_peak_memory_stats()
            out = step(batch)
            self.torch.cuda.synchronize()
            return out, self.torch.cuda.max_memory_allocated() - start
        mode = _heap_probe()
        with mode:
            out = step(batch)
        return out, mode.peak - mode.start


def _heap_probe():
    """A dispatch mode that keeps the largest glibc heap figure seen after any aten op."""
    from emulated import heap_in_use
    from torch.utils._python_dispatch import TorchDispatchMode  # the public hook for per-op work below autograd

    class HeapProbe(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.start = self.peak = heap_in_use()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.peak = max(self.peak, heap_in_use())
            return out

    return HeapProbe()


def one_step(fns, args, k: int, meter: Meter | None, device):
    """One step of a system (a barrier first); with ``meter``, untimed use: its peak memory instead of times."""
    import torch
    import torch.distributed as dist

    step, zero_grad = fns[0], fns[1]
    batch = tuple(t.to(device) for t in make_batch(args, k))
    zero_grad()
    gc.collect()
    dist.barrier()
    if meter is not None:
        loss, peak = meter.measure(step, batch)
        return None, None, loss, peak
    t0 = time.monotonic()
    loss = step(batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t1 = time.monotonic()
    return t0, t1, loss, None


def worker(args) -> int:
    import torch
    import torch.distributed as dist

    if args.device == "cuda":  # one GPU per process, NCCL
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    meter = Meter(device)
    rank, P = dist.get_rank(), dist.get_world_size()
    tied_group = dist.new_group(list(range(P)))  # P=2: every layout but the V puts a tied copy on each rank
    names = args.systems.split(",")
    # one-time allocations (gloo's buffers, lazy library state) land here, not in the first system's "held"
    prewarm = run_torch("torch-1f1b", args, rank, P, tied_group, device)
    one_step(prewarm, args, -1000, meter, device)
    del prewarm
    built = []
    for name in names:
        gc.collect()
        dist.barrier()
        base = meter.in_use()
        t_build = time.monotonic()
        if name.startswith("torch-"):
            v_shape = TORCH[TORCH_SYSTEMS[name][0]][2] == "v"
            fns = run_torch(name, args, rank, P, None if v_shape else tied_group, device)
        else:
            fns = run_ours(name, args, rank, P, tied_group, device)
        for i in range(args.warmup):
            one_step(fns, args, -100 - i, None, device)
        fns[1]()
        gc.collect()
        built.append((name, fns, meter.in_use() - base, time.monotonic() - t_build))
    recs: list[list] = [[] for _ in built]
    peaks = [0] * len(built)
    for k in range(args.steps + args.memory_steps):
        probe = k >= args.steps
        for j in range(len(built)):
            idx = (j + k) % len(built)
            t0, t1, loss, peak = one_step(built[idx][1], args, k, meter if probe else None, device)
            if probe:
                peaks[idx] = max(peaks[idx], peak)
            else:
                recs[idx].append((t0, t1, loss))
    mine = [(r, b[2], p, b[3], b[1][2]) for r, b, p in zip(recs, built, peaks, strict=True)]
    gathered = [None] * P
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        rows = []
        for j, (name, _, _, _) in enumerate(built):
            per = [gathered[r][j] for r in range(P)]
            n = len(per[0][0])
            step_s = [max(per[r][0][k][1] for r in range(P)) - min(per[r][0][k][0] for r in range(P))
                      for k in range(n)]
            losses = [next(per[r][0][k][2] for r in range(P) if per[r][0][k][2] is not None) for k in range(n)]
            rows.append({
                "system": name, "framework": name.split("-")[0], "chunks_per_rank": chunks_per_rank(name),
                "step_s_all": step_s, "step_s": statistics.median(step_s), "losses": losses,
                "peak_mib_per_rank": [per[r][2] / 2**20 for r in range(P)],
                "held_mib_per_rank": [per[r][1] / 2**20 for r in range(P)],
                "build_and_warmup_s": max(per[r][3] for r in range(P)), "chunks": per[0][4],
            })
        check_losses(rows)
        for row in rows:
            print(f"  {row['system']:28s} {row['step_s'] * 1e3:8.1f} ms  peak MiB "
                  f"{max(row['peak_mib_per_rank']):6.1f}  loss diff {row['loss_max_rel_diff']:.1e}", flush=True)
        Path(args.worker_out).write_text(json.dumps(rows))
    dist.destroy_process_group()
    return 0


def check_losses(rows: list[dict]) -> None:
    """Marks each row ``loss_ok`` if its loss at every measured step is within :data:`LOSS_RTOL` of the first row's."""
    ref = rows[0]["losses"]
    for row in rows:
        diff = max(abs(a - b) / abs(b) for a, b in zip(row["losses"], ref, strict=True))
        row["loss_max_rel_diff"], row["loss_ok"] = diff, diff <= LOSS_RTOL


# --------------------------------------------------------------------------------------------- driver
def _git(*a: str) -> str | None:
    try:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _loadavg():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def summarize(out: dict) -> list[dict]:
    """One row per system over every repetition: median step, spread, samples/s, the largest peak and held."""
    reps = out["repetitions"]
    batch = out["config"]["batch"]
    rows = []
    for name in out["systems"]:
        runs = [next(r for r in rep["rows"] if r["system"] == name) for rep in reps]
        medians = [r["step_s"] for r in runs]
        med = statistics.median(medians)
        rows.append({
            "system": name, "chunks_per_rank": runs[0]["chunks_per_rank"], "step_ms": med * 1e3,
            "step_ms_runs": [x * 1e3 for x in medians], "samples_per_s": batch / med,
            "peak_mib": max(max(r["peak_mib_per_rank"]) for r in runs),
            "peak_mib_per_rank": [max(r["peak_mib_per_rank"][i] for r in runs)
                                  for i in range(len(runs[0]["peak_mib_per_rank"]))],
            "held_mib": max(max(r["held_mib_per_rank"]) for r in runs),
            "loss_ok": all(r["loss_ok"] for r in runs),
        })
    return rows


def front_comparison(rows: list[dict]) -> list[dict]:
    """For each torch row: our fastest row at no more peak memory (the largest over ranks) and the speed ratio."""
    ours = [r for r in rows if r["system"].startswith("ours-")]
    out = []
    for t in (r for r in rows if r["system"].startswith("torch-")):
        fits = [o for o in ours if o["peak_mib"] <= t["peak_mib"]]
        best = min(fits, key=lambda o: o["step_ms"]) if fits else None
        out.append({"torch": t["system"], "torch_ms": t["step_ms"], "torch_peak_mib": t["peak_mib"],
                    "ours": best["system"] if best else None, "ours_ms": best["step_ms"] if best else None,
                    "ours_peak_mib": best["peak_mib"] if best else None,
                    "speedup": t["step_ms"] / best["step_ms"] if best else None})
    return out


def render(out: dict) -> str:
    rows, front = out["summary"], out["front"]
    lines = ["| system | v | step ms: median of runs (each run's median) | samples/s | peak MiB (max over ranks; "
             "per rank) | held MiB | losses equal |", "|---|---:|---|---:|---|---:|---|"]
    for r in rows:
        runs = " / ".join(f"{x:.0f}" for x in r["step_ms_runs"])
        per = " / ".join(f"{x:.1f}" for x in r["peak_mib_per_rank"])
        lines.append(f"| {r['system']} | {r['chunks_per_rank']} | **{r['step_ms']:.0f}** ({runs}) | "
                     f"{r['samples_per_s']:.1f} | **{r['peak_mib']:.1f}** ({per}) | {r['held_mib']:.1f} | "
                     f"{'yes' if r['loss_ok'] else 'NO'} |")
    lines += ["", "| torch row | its ms / peak MiB | our fastest at no more memory | its ms / peak MiB | speed-up |",
              "|---|---|---|---|---:|"]
    for f in front:
        ours = (f"{f['ours']} | {f['ours_ms']:.0f} / {f['ours_peak_mib']:.1f} | **{f['speedup']:.3f}x**"
                if f["ours"] else "none fits | - | -")
        lines.append(f"| {f['torch']} | {f['torch_ms']:.0f} / {f['torch_peak_mib']:.1f} | {ours} |")
    return "\n".join(lines)


def driver(args) -> int:
    systems = args.systems.split(",")
    config = {k: getattr(args, k) for k in ("layers", "embd", "heads", "seq", "vocab", "batch", "microbatches",
                                            "steps", "warmup", "memory_steps", "device")}
    out = {
        "command": "python benchmarks/real_schedules.py " + " ".join(sys.argv[1:]),
        "config": {**config, "P": 2, "threads_per_process": 1 if args.device == "cpu" else None,
                   "backend": "gloo" if args.device == "cpu" else "nccl", "loss_rtol": LOSS_RTOL},
        "systems": systems,
        "package_commit": _git("rev-parse", "HEAD"),
        "package_uncommitted_changes": _git("status", "--porcelain", "--", "lightning_varuna", "benchmarks"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "loadavg_start": _loadavg(),
        "repetitions": [],
    }
    t0 = time.monotonic()
    for rep in range(args.repeats):
        order = systems[rep % len(systems):] + systems[: rep % len(systems)]
        with tempfile.TemporaryDirectory() as tmp:
            res = Path(tmp) / "rows.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   str(Path(__file__).resolve()), "--worker", "--worker-out", str(res), "--systems", ",".join(order)]
            for k in config:
                cmd += [f"--{k.replace('_', '-')}", str(config[k])]
            print(f"run {rep + 1}/{args.repeats} (load {_loadavg()})", flush=True)
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
            rs = time.monotonic()
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
            print("\n".join(line for line in proc.stdout.splitlines() if line.startswith("  ")), flush=True)
            if proc.returncode != 0 or not res.exists():
                print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n", file=sys.stderr)
                return proc.returncode or 1
            rows = json.loads(res.read_text())
        out["repetitions"].append({"order": order, "rows": rows, "wall_s": time.monotonic() - rs,
                                   "loadavg_end": _loadavg()})
    out["loadavg_end"] = _loadavg()
    out["wall_s"] = time.monotonic() - t0
    out["summary"] = summarize(out)
    out["front"] = front_comparison(out["summary"])
    out["table_md"] = render(out)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\nload average start {out['loadavg_start']}, end {out['loadavg_end']}; wall {out['wall_s']:.0f} s")
    print(out["table_md"])
    return 0 if all(r["loss_ok"] for r in out["summary"]) else 3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="JSON result file")
    p.add_argument("--render", default=None, metavar="FILE", help="print the tables of a result file and exit")
    p.add_argument("--repeats", type=int, default=3, help="torchrun jobs (each runs every system)")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"comma list from {[*TORCH_SYSTEMS, *OURS]}")
    p.add_argument("--layers", type=int, default=8, help="transformer blocks (a multiple of 4)")
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="measured steps per system and repetition")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--memory-steps", type=int, default=1, help="untimed steps with the heap probe on")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one repetition may take")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: one GPU per process (two GPUs), NCCL, memory from CUDA's allocator")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.render:
        print(render(json.loads(Path(args.render).read_text())))
        return 0
    unknown = [n for n in args.systems.split(",") if n not in TORCH_SYSTEMS and n not in OURS]
    if unknown:
        p.error(f"unknown system(s) {unknown}; choose from {[*TORCH_SYSTEMS, *OURS]}")
    if args.layers % 4 or args.batch % args.microbatches:
        p.error("--layers must be a multiple of 4 (P x v chunks) and --batch a multiple of --microbatches")
    return worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    sys.exit(main())
