"""Framework overhead with REAL compute, P=2: VarunaStrategy in a Lightning Trainer vs a raw torch pipeline loop.

Run (from the repository root; it starts its own ``torchrun`` jobs, 2 processes each, gloo, 1 thread each)::

    python benchmarks/real_compute.py --out benchmarks/results/real_compute.json

About 2.5 minutes on a 2-core machine (the last run, six rows, took 143 s).

The model and data, the same for every system: the example GPT (``examples/gpt/model.py``, as in
``examples/gpt/config.yaml``: n_layer 4, n_embd 64, n_head 4, block_size 64, vocab 256, tied embedding/head;
dropout 0), batch 8 per step, 4 micro-batches, the same seeded random-token batches from the same kind of
``DataLoader``, the model's own AdamW parameter groups and LambdaLR schedule, the same initial weights.
The split is the one VarunaStrategy picks with ``partition="params"``: stage 0 = embeddings + blocks 0-1,
stage 1 = blocks 2-3 + ln_f + tied head (checked at run time; the run fails if the strategy or the engine
picks another).

Systems (one process per stage, 2 processes):

* ``ours-<schedule>[-rc]`` (``1f1b``, ``varuna``, ``zb`` = ``zero-bubble``, its backward split into input- and
  weight-gradient tasks): ``Trainer(strategy=VarunaStrategy(pipeline_parallel_size=2, num_microbatches=4,
  schedule=..., recompute=..., partition="params")).fit(GPT(...), loader)``, no logger, progress bar,
  checkpointing or model summary; the model's own ``training_step`` (with its ``self.log("train_loss",
  prog_bar=True)``).
* the raw peer, ``torch-1f1b`` (for ``ours-*``) or ``torch-1f1b-ckpt`` (for ``ours-*-rc``, the equal-memory
  peer): ``torch.distributed.pipelining.PipelineStage`` per half + ``Schedule1F1B(n_microbatches=4,
  scale_grads=True)``, then one ``all_reduce`` summing the two copies of the tied embedding's gradient (what
  any correct split of this model needs; our engine does the same), ``AdamW.step``, ``LambdaLR.step``,
  ``zero_grad``. No Lightning. ``-ckpt``: stage 0's forward in ``torch.utils.checkpoint`` (non-reentrant); the
  last stage is never wrapped (it never needs to recompute; our engine does the same).
* ``engine-*`` (``--no-engine`` drops it): our ``PipelineEngine`` without Lightning, the loop of
  engine.py's docstring (``train_step``, ``sync_gradients``, AdamW, LambdaLR, ``zero_grad``) on the model's
  loss. It separates what the engine costs (engine / peer) from what Lightning and the strategy glue cost
  (ours / engine).
* what-if, not in the default run: ``ours-1f1b-lean``, ``ours-varuna-lean``, see :func:`lean_patches`.

Interleaving: inside one torchrun job, each ``ours-*`` row is one ``Trainer.fit``; a callback runs, after each
of its steps, one step of the raw peer and one of the bare engine, with a barrier before each step, so the
three see the same background load at the same time (the machine is shared) and each step starts with an
empty pipeline. The ranks stamp ``time.monotonic()`` (one clock for all processes of a host) at the start
(after the barrier) and end of every step; Lightning's step spans from that barrier to ``on_train_batch_end``,
so data loading, hooks, logging and the loop's own bookkeeping are inside it. Step time = latest end over
ranks - latest start over ranks; samples/s = batch / median step time over the measured steps (after the
warm-up steps). Each repetition is a new torchrun job; the order of the rows rotates between repetitions.

Breakdown (``--no-breakdown`` drops it; ``perf_counter`` wrappers on this process's objects, a few microseconds
per step): per rank, the mean per measured step of ``engine.train_step`` / ``schedule.step`` (the schedule:
every micro-batch's forward and backward, p2p waits, and the loss/log summary sent back along the pipeline),
the log broadcast (``LogBroadcaster.share``, now only when the logged keys change), the
rest of ``VarunaStrategy.training_step`` (log capture and reduction, replay through ``self.log``, gradients set
aside), ``backward`` (gradients handed back), the gradient reductions (``GradientSync``), the rest of
Lightning's optimizer closure, AdamW, Lightning's per-step SIGTERM-flag broadcast, and what is left (loop,
data, hooks, scheduler; for ours also the barrier skew). Means, so the parts add up to the mean step.
``--profile DIR`` writes cProfile stats of the measured steps (inflates Python-heavy code: for attribution).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ["ours-1f1b", "ours-varuna", "ours-zb", "ours-1f1b-rc", "ours-varuna-rc", "ours-zb-rc"]  # the default run
ALL_SYSTEMS = SYSTEMS + ["ours-1f1b-lean", "ours-varuna-lean"]
# ours -> its raw peer (equal memory behaviour: recompute is compared with the checkpointed peer)
PEER = {
    "ours-1f1b": "torch-1f1b",
    "ours-varuna": "torch-1f1b",
    "ours-zb": "torch-1f1b",
    "ours-1f1b-rc": "torch-1f1b-ckpt",
    "ours-varuna-rc": "torch-1f1b-ckpt",
    "ours-zb-rc": "torch-1f1b-ckpt",
    # what-if rows (not run by default): the strategy with two per-step collectives removed, see lean_patches()
    "ours-1f1b-lean": "torch-1f1b",
    "ours-varuna-lean": "torch-1f1b",
}
SCHEDULES = {"1f1b": "1f1b", "varuna": "varuna", "zb": "zero-bubble"}  # a row name's part -> schedule=


def schedule_of(name: str) -> str:
    """The ``schedule=`` of a row (``ours-zb-rc`` -> ``zero-bubble``)."""
    return SCHEDULES[name.split("-")[1]]


CONFIG = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64, dropout=0.0)
BATCH, MICROBATCHES, SPLIT = 8, 4, 2  # SPLIT: blocks on stage 0


# ------------------------------------------------------------------------------------------------ worker
def _median(xs):
    return statistics.median(xs) if xs else float("nan")


class Timers:
    """Per-step sums of named intervals (perf_counter), one dict per step."""

    def __init__(self):
        self.steps: list[dict[str, float]] = []
        self.cur: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.cur[name] = self.cur.get(name, 0.0) + seconds

    def wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)
        timers = self

        def wrapped(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timers.add(name, time.perf_counter() - t0)

        setattr(obj, attr, wrapped)

    def end_step(self) -> None:
        self.steps.append(self.cur)
        self.cur = {}

    def means(self, skip: int) -> dict[str, float]:
        """Mean seconds per measured step of each interval (means, unlike medians, add up to the step)."""
        steps = self.steps[skip:]
        names = sorted({n for s in steps for n in s})
        return {n: statistics.fmean([s.get(n, 0.0) for s in steps]) for n in names} if steps else {}


def make_loader(num_batches: int):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CONFIG["vocab_size"], (num_batches * BATCH, CONFIG["block_size"] + 1), generator=g)
    data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    return DataLoader(data, batch_size=BATCH, shuffle=False, drop_last=True, num_workers=0)


def build_gpt():
    import torch

    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    from model import GPT

    torch.manual_seed(1234)
    gpt = GPT(**CONFIG)
    gpt.configure_model()  # real layers, initialized here: every system starts from the same weights
    return gpt


class RawPeer:
    """The raw torch.distributed.pipelining loop (no Lightning) on this rank's half of the GPT."""

    def __init__(self, name: str, steps: int, breakdown: bool):
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        from torch import nn
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
        from torch.utils.checkpoint import checkpoint

        self.rank, world = dist.get_rank(), dist.get_world_size()
        ckpt = name.endswith("-ckpt")
        gpt = build_gpt()

        class First(nn.Module):
            def __init__(self):
                super().__init__()
                self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop
                self.blocks = nn.ModuleList(gpt.blocks[:SPLIT])

            def body(self, idx):
                pos = torch.arange(idx.size(1), device=idx.device)
                x = self.drop(self.wte(idx) + self.wpe(pos))
                for block in self.blocks:
                    x = block(x)
                return x

            def forward(self, idx):
                return checkpoint(self.body, idx, use_reentrant=False) if ckpt else self.body(idx)

        class Last(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleList(gpt.blocks[SPLIT:])
                self.ln_f, self.wte = gpt.ln_f, gpt.wte  # tied head: this rank's copy of wte.weight

            def forward(self, x):
                for block in self.blocks:
                    x = block(x)
                return F.linear(self.ln_f(x), self.wte.weight)

        mod = First() if self.rank == 0 else Last()
        mbs, T, C, V = BATCH // MICROBATCHES, CONFIG["block_size"], CONFIG["n_embd"], CONFIG["vocab_size"]
        if self.rank == 0:
            ex_in, ex_out = torch.zeros(mbs, T, dtype=torch.long), torch.zeros(mbs, T, C, requires_grad=True)
        else:
            ex_in, ex_out = torch.zeros(mbs, T, C, requires_grad=True), torch.zeros(mbs, T, V, requires_grad=True)
        stage = PipelineStage(mod, self.rank, world, torch.device("cpu"), input_args=ex_in, output_args=ex_out)

        def loss_fn(logits, target):
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))

        self.sched = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn, scale_grads=True)
        # the model's own optimizer and LR schedule (AdamW, decay on matrices only; LambdaLR), this stage's params
        kept = {id(p) for p in mod.parameters()}
        conf = gpt.configure_optimizers()
        self.optimizer, self.scheduler = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
        for group in self.optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in kept]
        self.tied = gpt.wte.weight
        self.timers = Timers()
        self.breakdown = breakdown
        self.it = iter(make_loader(steps + 2))

    def step(self) -> None:
        import torch.distributed as dist

        idx, tgt = next(self.it)
        t0 = time.perf_counter()
        if self.rank == 0:
            self.sched.step(idx, return_outputs=False)
        else:
            self.sched.step(target=tgt, losses=[], return_outputs=False)
        t1 = time.perf_counter()
        dist.all_reduce(self.tied.grad)  # the two copies of the tied embedding: sum, as our GradientSync does
        t2 = time.perf_counter()
        self.optimizer.step()
        t3 = time.perf_counter()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.breakdown:
            self.timers.add("schedule.step", t1 - t0)
            self.timers.add("sync_gradients", t2 - t1)
            self.timers.add("AdamW", t3 - t2)
        self.timers.end_step()


def lean_patches(strategy, trainer) -> None:
    """What-if for the ``-lean`` rows, patched on this process's objects only (the package is not changed).

    1. The last stage's logged values and loss reach the other stages in ONE broadcast per step instead of
       two (header, then values): after the first step both sides know the number of values, so the values
       travel with a one-element "same keys as last step" flag; when the keys change, the package's own
       protocol runs as before.
    2. Lightning's per-step SIGTERM-flag broadcast (``_broadcast_sigterm_tensor``) is skipped. This loses
       Lightning's SIGTERM propagation: it only shows what that collective costs.
    """
    import torch
    import torch.distributed as dist

    b = strategy._pipeline.steps.broadcaster
    original = b.share
    known = {"n": None}

    def share(meta, values):
        n = known["n"]
        if n is not None:
            buf = torch.zeros(n + 1, dtype=torch.float64, device=b.device)
            if b.is_src:
                flat = torch.stack([v.to(torch.float64) for v in values]) if values else buf[:0]
                same = meta == b._meta and flat.numel() == n
                buf[0] = 0.0 if same else 1.0
                if same:
                    buf[1:] = flat
                dist.broadcast(buf, b.src, group=b.group)
                if same:
                    return meta, flat
            else:
                dist.broadcast(buf, b.src, group=b.group)
                if buf[0].item() == 0.0:
                    return b._meta or (), buf[1:]
        meta, flat = original(meta, values)
        known["n"] = flat.numel()
        return meta, flat

    b.share = share
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None


class BareEngine:
    """Our ``PipelineEngine`` without Lightning: the engine's own loop (docstring of engine.py) on the GPT."""

    def __init__(self, name: str, steps: int, breakdown: bool):
        from lightning_varuna.pipeline.config import EngineConfig
        from lightning_varuna.pipeline.engine import PipelineEngine

        schedule = schedule_of(name)
        gpt = build_gpt()
        self.loss = gpt._loss  # the model's loss (its training_step minus self.log, which needs a Trainer)
        self.engine = PipelineEngine(gpt, EngineConfig(2, num_microbatches=MICROBATCHES, schedule=schedule,
                                                       recompute=name.endswith("-rc"), partition="params"))
        self.it = iter(make_loader(steps + 3))
        plan = self.engine.setup(next(self.it), self.loss)
        self.partition = [[st.segments[0], st.segments[-1]] for st in plan.stages]
        conf = gpt.configure_optimizers()  # after setup: this stage's parameters only
        self.optimizer, self.scheduler = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
        self.timers = Timers()
        self.breakdown = breakdown
        if breakdown:  # the reductions start inside train_step (start_sync=True)
            self.timers.wrap(self.engine.grad_sync, "start", "grad_sync.start")

    def step(self) -> None:
        batch = next(self.it)
        t0 = time.perf_counter()
        self.engine.train_step(batch, self.loss, start_sync=True)
        t1 = time.perf_counter()
        self.engine.sync_gradients()
        t2 = time.perf_counter()
        self.optimizer.step()
        t3 = time.perf_counter()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.breakdown:
            self.timers.add("engine.train_step", t1 - t0)
            self.timers.add("sync_gradients", t2 - t1)
            self.timers.add("AdamW", t3 - t2)
        self.timers.end_step()


def run_pair(ours: str, peer: str, steps: int, warmup: int, breakdown: bool, profile: str | None = None,
             with_engine: bool = True) -> dict:
    """Trainer.fit with VarunaStrategy; after each of its steps, one step of the raw peer (barriers around it).

    Returns this rank's stamps: ours/peer step start and end (time.monotonic), and the breakdowns.
    """
    import lightning.pytorch as pl
    import torch.distributed as dist

    from lightning_varuna import VarunaStrategy

    schedule = schedule_of(ours)
    recompute = ours.endswith("-rc")
    raw = RawPeer(peer, warmup + steps, breakdown)
    bare = BareEngine(ours.replace("ours-", "engine-"), warmup + steps, breakdown) if with_engine else None
    profiles = None
    if profile is not None:  # cProfile of the measured steps, ours and the peer apart (inflates Python-heavy code)
        import cProfile

        profiles = {"ours": cProfile.Profile(), "peer": cProfile.Profile()}
    timers = Timers()
    stamps = {"ours_start": [], "ours_end": [], "peer_start": [], "peer_end": [], "engine_start": [], "engine_end": []}
    info: dict = {}

    class Interleave(pl.Callback):
        def on_train_start(self, trainer, module):
            strategy = trainer.strategy
            info["plan"] = [[st.segments[0], st.segments[-1]] for st in strategy.engine.partition.stages]
            if ours.endswith("-lean"):
                lean_patches(strategy, trainer)
            if breakdown:
                timers.wrap(strategy, "training_step", "training_step")
                timers.wrap(strategy.engine, "train_step", "engine.train_step")
                timers.wrap(strategy._pipeline.steps.broadcaster, "share", "log_share")
                timers.wrap(strategy, "backward", "backward")
                # gradient reductions: GradientSync.sync, or start (in training_step) + finish (in the closure)
                sync = strategy.engine.grad_sync
                for attr, label in (("sync", "grad_sync.finish"), ("start", "grad_sync.start"),
                                    ("finish", "grad_sync.finish")):
                    if callable(getattr(type(sync), attr, None)):
                        timers.wrap(sync, attr, label)
                # Lightning runs the closure (training_step, zero_grad, backward, our sync) inside optimizer.step
                timers.wrap(strategy.precision_plugin, "_wrap_closure", "closure")
                # Lightning (2.6.6 here) broadcasts a SIGTERM flag from rank 0 at the start of every training step
                loop = trainer.fit_loop.epoch_loop
                if hasattr(loop, "_broadcast_sigterm_tensor"):
                    timers.wrap(loop, "_broadcast_sigterm_tensor", "sigterm_broadcast")
                for opt in strategy.optimizers:
                    opt.register_step_pre_hook(lambda *a: info.__setitem__("t_opt", time.perf_counter()))
                    opt.register_step_post_hook(
                        lambda *a: timers.add("optimizer.step", time.perf_counter() - info["t_opt"]))
            dist.barrier()
            stamps["ours_start"].append(time.monotonic())

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            stamps["ours_end"].append(time.monotonic())
            timers.end_step()
            if profiles is not None:
                profiles["ours"].disable()
            dist.barrier()
            stamps["peer_start"].append(time.monotonic())
            if profiles is not None and batch_idx + 1 >= warmup:
                profiles["peer"].enable()
            raw.step()
            if profiles is not None:
                profiles["peer"].disable()
            stamps["peer_end"].append(time.monotonic())
            if bare is not None:
                dist.barrier()
                stamps["engine_start"].append(time.monotonic())
                bare.step()
                stamps["engine_end"].append(time.monotonic())
            dist.barrier()
            stamps["ours_start"].append(time.monotonic())
            if profiles is not None and batch_idx + 1 >= warmup:
                profiles["ours"].enable()

    module = build_gpt()
    strategy = VarunaStrategy(
        pipeline_parallel_size=2, num_microbatches=MICROBATCHES, schedule=schedule, recompute=recompute,
        partition="params",
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=warmup + steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Interleave()], num_sanity_val_steps=0,
    )
    trainer.fit(module, make_loader(warmup + steps + 2))
    # the strategy's plan must be the split the raw peer uses: segments 0-1 (embeddings + blocks 0, 1) | 2-4
    if info.get("plan") != [[0, SPLIT - 1], [SPLIT, CONFIG["n_layer"]]]:
        raise RuntimeError(f"VarunaStrategy chose split {info.get('plan')}, the raw peer uses blocks 0-{SPLIT - 1}")
    stamps["ours_start"] = stamps["ours_start"][: len(stamps["ours_end"])]
    if profiles is not None:
        Path(profile).mkdir(parents=True, exist_ok=True)
        for kind, prof in profiles.items():
            prof.dump_stats(str(Path(profile) / f"{ours}_{kind}_rank{dist.get_rank()}.prof"))
    if bare is not None and bare.partition != info["plan"]:
        raise RuntimeError(f"PipelineEngine chose split {bare.partition}, VarunaStrategy {info['plan']}")
    return {"stamps": stamps, "plan": info["plan"], "ours_breakdown": timers.means(warmup),
            "peer_breakdown": raw.timers.means(warmup),
            "engine_breakdown": bare.timers.means(warmup) if bare is not None else {}}


def step_times(per_rank: list[dict], kind: str, warmup: int) -> list[float]:
    """Step k lasts from the latest start over ranks (just after a barrier) to the latest end over ranks."""
    starts = [r["stamps"][f"{kind}_start"] for r in per_rank]
    ends = [r["stamps"][f"{kind}_end"] for r in per_rank]
    n = min(len(x) for x in starts + ends)
    return [max(e[k] for e in ends) - max(s[k] for s in starts) for k in range(warmup, n)]


def worker(args) -> int:
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    import logging

    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_varuna"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    for ours in args.systems.split(","):
        peer = PEER[ours]
        t_start = time.monotonic()
        mine = run_pair(ours, peer, args.steps, args.warmup, args.breakdown, args.profile, args.engine)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            entry = {"peer_name": peer, "plan": mine["plan"], "wall_s": time.monotonic() - t_start}
            for kind in ("ours", "peer", "engine") if args.engine else ("ours", "peer"):
                st = step_times(gathered, kind, args.warmup)
                med = _median(st)
                entry[kind] = {"step_s": st, "median_step_s": med, "mean_step_s": statistics.fmean(st),
                               "samples_per_s": BATCH / med,
                               "breakdown_per_rank": [g[f"{kind}_breakdown"] for g in gathered]}
            entry["ratio"] = entry["ours"]["samples_per_s"] / entry["peer"]["samples_per_s"]
            line = (f"  {ours:15s} {entry['ours']['samples_per_s']:6.1f} samples/s | {peer:15s}"
                    f" {entry['peer']['samples_per_s']:6.1f} | ratio {entry['ratio']:.3f}")
            if args.engine:
                entry["engine_ratio"] = entry["engine"]["samples_per_s"] / entry["peer"]["samples_per_s"]
                line += f" | bare engine {entry['engine']['samples_per_s']:6.1f}, ratio {entry['engine_ratio']:.3f}"
            results[ours] = entry
            print(line + f" | {entry['wall_s']:.1f} s", flush=True)
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps(results))
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------------------ driver
def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _loadavg():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def _spread(xs: list[float], fmt: str = ".2f") -> str:
    return f"**{statistics.median(xs):{fmt}}** ({min(xs):{fmt}}-{max(xs):{fmt}})"


def render(out: dict) -> str:
    reps = out["repetitions"]
    names = [n for n in ALL_SYSTEMS if all(n in r["results"] for r in reps)]
    engine = all("engine" in r["results"][n] for r in reps for n in names)
    head = ["ours (Lightning + VarunaStrategy)", "samples/s per run", "raw peer (same job, interleaved)",
            "samples/s per run", "ours / peer per run", "ours / peer: median (min-max)"]
    if engine:
        head += ["bare engine / peer: median (min-max)", "ours / bare engine: median (min-max)"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for n in names:
        res = [r["results"][n] for r in reps]
        ours = [x["ours"]["samples_per_s"] for x in res]
        peer = [x["peer"]["samples_per_s"] for x in res]
        ratios = [x["ratio"] for x in res]
        cells = [n, " / ".join(f"{v:.0f}" for v in ours), res[0]["peer_name"], " / ".join(f"{v:.0f}" for v in peer),
                 " / ".join(f"{v:.2f}" for v in ratios), _spread(ratios)]
        if engine:
            cells += [_spread([x["engine_ratio"] for x in res]),
                      _spread([x["ours"]["samples_per_s"] / x["engine"]["samples_per_s"] for x in res])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


BUCKETS = ["step", "schedule", "step - schedule", "log_share", "training_step other", "backward", "sync_gradients",
           "closure other", "AdamW", "sigterm_broadcast", "rest"]


def step_buckets(res: dict, rank: int) -> dict[str, float]:
    """One run's per-step medians on one rank, in seconds, split into BUCKETS (see the module docstring)."""
    bd = res["breakdown_per_rank"][rank]
    d = {"step": res["mean_step_s"]}
    # grad_sync.start (the reductions not started during the last backward) runs inside engine.train_step
    start = bd.get("grad_sync.start", 0.0)
    d["schedule"] = bd.get("engine.train_step", bd.get("schedule.step", 0.0)) - start
    for k in ("log_share", "backward", "sync_gradients", "AdamW", "sigterm_broadcast"):
        if k in bd:
            d[k] = bd[k]
    if "engine.train_step" in bd:
        d["sync_gradients"] = d.get("sync_gradients", 0.0) + start
    if "training_step" in bd:  # ours in Lightning
        finish = bd.get("grad_sync.finish", 0.0)
        d["sync_gradients"] = start + finish
        d["training_step other"] = bd["training_step"] - d["schedule"] - d.get("log_share", 0.0) - start
        d["closure other"] = bd["closure"] - bd["training_step"] - d.get("backward", 0.0) - finish
        d["AdamW"] = bd["optimizer.step"] - bd["closure"]
    d["rest"] = d["step"] - sum(v for k, v in d.items() if k != "step")
    d["step - schedule"] = d["step"] - d["schedule"]  # everything outside the schedule (a sum of the others)
    return d


def render_breakdown(out: dict) -> str:
    """Median over runs of each rank's per-step means, in ms."""
    reps = out["repetitions"]
    names = [n for n in ALL_SYSTEMS if all(n in r["results"] for r in reps)]
    lines = ["| system (job) | rank | " + " | ".join(BUCKETS) + " |", "|---|---|" + "---:|" * len(BUCKETS)]
    for n in names:
        for kind in ("ours", "engine", "peer"):
            if not all(kind in r["results"][n] for r in reps):
                continue
            label = {"ours": n, "peer": f"{reps[0]['results'][n]['peer_name']} (with {n})",
                     "engine": f"{n.replace('ours-', 'engine-')} (with {n})"}[kind]
            for rank in range(2):
                runs = [step_buckets(r["results"][n][kind], rank) for r in reps]
                cells = []
                for b in BUCKETS:
                    vals = [d[b] for d in runs if b in d]
                    cells.append(f"{statistics.median(vals) * 1e3:.2f}" if vals else "-")
                lines.append(f"| {label} | {rank} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def driver(args) -> int:
    systems = args.systems.split(",")
    out = {
        "command": "python benchmarks/real_compute.py " + " ".join(sys.argv[1:]),
        "config": {**CONFIG, "batch": BATCH, "microbatches": MICROBATCHES, "split_blocks_stage0": SPLIT,
                   "steps": args.steps, "warmup": args.warmup, "threads_per_process": 1, "backend": "gloo"},
        "package_commit": _git("rev-parse", "HEAD"),
        "package_uncommitted_changes": _git("status", "--porcelain", "--", "lightning_varuna"),
        "repetitions": [],
        "loadavg_start": _loadavg(),
    }
    t0 = time.monotonic()
    for rep in range(args.repeats):
        order = systems[rep % len(systems):] + systems[: rep % len(systems)]
        if rep % 2 == 1:
            order = order[::-1]
        with tempfile.TemporaryDirectory() as tmp:
            res_path = Path(tmp) / "res.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   str(Path(__file__).resolve()), "--worker", "--worker-out", str(res_path),
                   "--systems", ",".join(order), "--steps", str(args.steps), "--warmup", str(args.warmup)]
            if args.profile:
                cmd += ["--profile", str(Path(args.profile).resolve())]
            if not args.breakdown:
                cmd.append("--no-breakdown")
            if not args.engine:
                cmd.append("--no-engine")
            print(f"run {rep + 1}/{args.repeats} (load {_loadavg()}): {','.join(order)}", flush=True)
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
            rs = time.monotonic()
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            for line in proc.stdout.splitlines():
                if line.startswith("  ours"):  # the worker's result lines (Lightning's banners are dropped)
                    print(line, flush=True)
            if proc.returncode != 0 and not res_path.exists():
                print(proc.stdout[-4000:], proc.stderr[-8000:], sep="\n", file=sys.stderr)
                print(f"run {rep + 1} failed with exit code {proc.returncode}", file=sys.stderr)
                return proc.returncode
            if proc.returncode != 0:  # results were written; a rank failed while shutting down
                print(f"run {rep + 1}: a worker exited with {proc.returncode} after writing its results"
                      f" ({proc.stderr.strip().splitlines()[-1][:200] if proc.stderr.strip() else ''})", flush=True)
            results = json.loads(res_path.read_text())
        out["repetitions"].append({"order": order, "results": results, "wall_s": time.monotonic() - rs,
                                   "loadavg_end": _loadavg()})
    out["loadavg_end"] = _loadavg()
    out["wall_s"] = time.monotonic() - t0
    out["table_md"] = render(out)
    if args.breakdown:
        out["breakdown_md"] = render_breakdown(out)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    print()
    print(f"load average start {out['loadavg_start']}, end {out['loadavg_end']}; wall {out['wall_s']:.0f} s")
    print(out["table_md"])
    if args.breakdown:
        print()
        print("per-step breakdown, ms (median over runs of each rank's mean per measured step):")
        print(out["breakdown_md"])
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="JSON result file")
    p.add_argument("--repeats", type=int, default=3, help="torchrun jobs (each runs every system)")
    p.add_argument("--steps", type=int, default=40, help="measured steps per system")
    p.add_argument("--warmup", type=int, default=5, help="warm-up steps per system")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma list from {ALL_SYSTEMS}; each is paired with its raw peer (and the bare engine)")
    p.add_argument("--no-breakdown", dest="breakdown", action="store_false")
    p.add_argument("--no-engine", dest="engine", action="store_false",
                   help="skip the third interleaved system, our PipelineEngine without Lightning")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="also write cProfile stats of the measured steps per system, kind and rank to DIR"
                   " (slows Python-heavy code; use for attribution, not for the ratios)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = [n for n in args.systems.split(",") if n not in ALL_SYSTEMS]
    if unknown:
        p.error(f"unknown system(s) {unknown}; choose from {ALL_SYSTEMS}")
    return worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    sys.exit(main())
