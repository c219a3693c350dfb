"""P x D grid of the example GPT on 4 processes: step times, all-reduce overlap gain, bytes on the wire per step.

Run (from the repository root; it starts its own ``torchrun`` job, 4 processes, gloo, 1 thread each)::

    python benchmarks/pxd.py --out benchmarks/results/pxd.json

Every configuration of ``--grid`` (default ``4x1,2x2,1x4``: P stages x D replicas) and of ``--compute`` runs in
the same torchrun job, their steps interleaved (step k of every configuration before step k+1 of any, order
rotated), so background load hits all alike. ``benchmarks/netem.py`` runs the same worker as two "nodes" joined
by a bandwidth-limited link.

Model: the example GPT (``examples/gpt/model.py`` as in ``examples/gpt/config.yaml``: 4 layers, n_embd 64,
4 heads, block 64, vocab 256, tied embedding and head; dropout 0), driven by ``PipelineEngine`` (no Lightning:
``benchmarks/real_compute.py`` measures the Lightning glue), schedule ``varuna`` with recompute, split by
parameters. The global batch is fixed (``--global-batch``, default 16 sequences), so each replica gets
``16 / D`` in micro-batches of ``--microbatch-size`` (2): m = 8, 4, 2 for P = 4, 2, 1.

* ``--compute real``: the model as it is.
* ``--compute emulated``: each transformer block sleeps ``--block-fwd-ms`` (default 4) per micro-batch forward
  (recompute included) and twice that in backward, instead of computing; embeddings, head and loss stay real
  (they are small). The blocks keep their real parameters, which all get a gradient, so buckets, all-reduces
  and p2p messages have the real sizes. Four sleeping processes do not compete for cores, so the grid shows
  what P and D do on hardware with one device per process.

One step = ``train_step(start_sync=True)``, ``sync_gradients()`` (waits for the all-reduces), AdamW and
``zero_grad``, after a barrier; step time = latest end over ranks - latest start. Odd and even steps alternate
``grad_sync.overlap`` (buckets start reducing during each stage's last backward) with "sync at end" (every
all-reduce starts after the stage's schedule), so both are measured in the same run under the same load.
"exposed sync" is the time ``sync_gradients()`` waits, per rank.

Bytes per step and rank (measured on every step, identical from step to step):

* p2p: the bytes of the sends the engine posted (a ``StageCounters`` on ``engine.events``: activations forward,
  their gradients backward, one 80-byte shape header per step); analytic: ``m`` activations of
  ``mbs x T x C x 4`` bytes forward unless last stage, as many gradients backward unless first stage, plus the
  header.
* all-reduce payload: ``grad_sync.reduced_bytes`` (data-parallel buckets and the tied embedding's copies);
  analytic: this stage's parameter bytes when D > 1 (embedding excluded when tied across stages), plus the
  tied embedding (V x C x 4) on its holders when P > 1. A ring all-reduce of N bytes among n ranks sends
  ``2 (n - 1) / n x N`` per rank ("ring wire" column); gloo's actual algorithm may differ.
* with ``LV_BENCH_IFACE`` set (``netem.py`` does), the interface's tx bytes per step (all ranks of that node).
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64, dropout=0.0)
HEADER_BYTES = 80


# ------------------------------------------------------------------------------------------------ model
def build_model(compute: str, block_fwd_s: float):
    """The example GPT (seeded), its blocks sleeping instead of computing when ``compute == "emulated"``."""
    import torch
    from torch import nn

    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    from model import GPT, Block

    class _Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            time.sleep(block_fwd_s)
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            time.sleep(2 * block_fwd_s)
            return g

    class SleepBlock(Block):
        """A block with its real parameters that sleeps F (forward) / 2F (backward) instead of computing."""

        def forward(self, x):
            if x.device.type == "meta":  # a stand-in's shape inference
                return x
            # every parameter is used (the dry run sees it) and gets a gradient (its hook fires in backward)
            touch = sum(p[(0,) * p.dim()] for p in self.parameters())
            return _Sleep.apply(x) + 0.0 * touch

    torch.manual_seed(1234)
    gpt = GPT(**CONFIG)
    gpt.configure_model()  # the example builds its modules there (Lightning calls it; the bare engine does not)
    if compute == "emulated":
        c = CONFIG
        gpt.blocks = nn.ModuleList(SleepBlock(c["n_embd"], c["n_head"], 0.0, True) for _ in range(c["n_layer"]))
    return gpt


def make_batches(n: int, batch: int, replica: int):
    import torch

    g = torch.Generator().manual_seed(1000 + replica)
    tokens = torch.randint(0, CONFIG["vocab_size"], (n, batch, CONFIG["block_size"] + 1), generator=g)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def analytic_bytes(P: int, D: int, stage: int, blocks: int, m: int, replica_batch: int) -> dict[str, int]:
    """Bytes per step this rank sends by p2p and passes to all-reduces, from the model's shapes alone."""
    V, T, C = CONFIG["vocab_size"], CONFIG["block_size"], CONFIG["n_embd"]
    act = replica_batch * T * C * 4  # all m micro-batches of one boundary
    p2p = (act + HEADER_BYTES if stage < P - 1 else 0) + (act if stage > 0 else 0)
    block = 12 * C * C + 13 * C  # qkv, proj, mlp (with biases) and two LayerNorms
    own = blocks * block + (T * C if stage == 0 else 0) + (2 * C if stage == P - 1 else 0)
    embedding = V * C
    tied = P > 1 and stage in (0, P - 1)
    data = (own + (embedding if P == 1 else 0)) * 4 if D > 1 else 0
    return {"p2p": p2p, "allreduce": data + (embedding * 4 if tied else 0), "data_allreduce": data,
            "tied_allreduce": embedding * 4 if tied else 0}


# ------------------------------------------------------------------------------------------------ worker
class Config:
    """One P x D configuration on this rank: model, engine, optimizer, data and its measurements."""

    def __init__(self, compute: str, P: int, args, zero_stage: int = 0) -> None:
        import torch.distributed as dist

        from lightning_varuna.pipeline.comm.events import StageCounters
        from lightning_varuna.pipeline.config import EngineConfig
        from lightning_varuna.pipeline.engine import PipelineEngine

        world = dist.get_world_size()
        self.compute, self.P, self.D = compute, P, world // P
        self.name = f"{compute} {P}x{self.D}" + (" zero1" if zero_stage else "")
        self.zero_stage = zero_stage
        self.replica_batch = args.global_batch // self.D
        self.model = build_model(compute, args.block_fwd_ms / 1e3)
        self.loss = self.model._loss
        self.engine = PipelineEngine(self.model, EngineConfig(
            P, microbatch_size=args.microbatch_size, schedule=args.schedule, recompute=True, partition="params",
            p2p_timeout=args.timeout_s, grad_bucket_bytes=args.bucket_bytes, zero_stage=zero_stage))
        replica = dist.get_rank() // P
        self.batches = make_batches(args.warmup + args.steps + 1, self.replica_batch, replica)
        plan = self.engine.setup(self.batches[-1], self.loss)
        self.counters = self.engine.events.add(StageCounters())
        topo = self.engine.topology
        self.stage = topo.stage
        stage_plan = plan.stages[topo.stage]
        blocks = sum(1 for s in stage_plan.segments if s < CONFIG["n_layer"])
        self.m = self.engine.microbatches_for(self.replica_batch)
        self.analytic = analytic_bytes(P, self.D, topo.stage, blocks, self.m, self.replica_batch)
        conf = self.model.configure_optimizers()  # after setup: this stage's parameters only
        self.optimizer = conf["optimizer"]
        self.engine.shard_optimizer(self.optimizer)  # zero_stage=1: steps this replica's rows, then all-gathers
        self.sync = self.engine.grad_sync
        self.records: list[dict] = []
        self.iface = os.environ.get("LV_BENCH_IFACE")

    def _tx(self) -> int:
        if not self.iface:
            return 0
        return int(Path(f"/sys/class/net/{self.iface}/statistics/tx_bytes").read_text())

    def step(self, k: int, overlap: bool, group) -> None:
        import torch.distributed as dist

        self.sync.overlap = overlap
        sent, reduced = self.counters.sent_bytes, self.sync.reduced_bytes
        dist.barrier(group=group)
        tx = self._tx()
        t0 = time.monotonic()
        self.engine.train_step(self.batches[k], self.loss, start_sync=True)
        t1 = time.monotonic()
        self.engine.sync_gradients()
        t2 = time.monotonic()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t3 = time.monotonic()
        dist.barrier(group=group)
        self.records.append({
            "overlap": overlap, "start": t0, "end": t3, "train_step_s": t1 - t0, "exposed_sync_s": t2 - t1,
            "p2p_bytes": self.counters.sent_bytes - sent, "allreduce_bytes": self.sync.reduced_bytes - reduced,
            "overlapped_buckets": self.sync.overlapped_buckets if overlap else 0, "iface_tx_bytes": self._tx() - tx,
        })

    def summary(self) -> dict:
        return {"name": self.name, "compute": self.compute, "P": self.P, "D": self.D, "stage": self.stage,
                "zero_stage": self.zero_stage, "gathered_bytes": getattr(self.sync, "gathered_bytes", 0),
                "m": self.m, "buckets": len(self.sync.buckets), "bucket_bytes": self.sync.bucket_bytes,
                "analytic": self.analytic, "iface": self.iface, "records": self.records}


def worker(args) -> int:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo")  # the benchmark's own barriers, apart from the engines' groups
    configs = []
    for compute in args.compute.split(","):
        for grid in args.grid.split(","):
            shape, _, zero = grid.partition("z")  # "2x2z1": zero_stage=1
            P, D = (int(x) for x in shape.split("x"))
            if P * D != world:
                raise SystemExit(f"--grid {grid}: P x D must be the world size {world}")
            configs.append(Config(compute, P, args, int(zero or 0)))
    t_start = time.monotonic()
    for k in range(args.warmup + args.steps):
        for j in range(len(configs)):
            configs[(j + k) % len(configs)].step(k, overlap=k % 2 == 0, group=group)
    mine = [c.summary() for c in configs]
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    if rank == 0:
        out = {"world_size": world, "wall_s": time.monotonic() - t_start, "args": vars(args),
               "rows": [[g[j] for g in gathered] for j in range(len(configs))]}
        Path(args.worker_out).write_text(json.dumps(out))
    dist.barrier(group=group)
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------------------ results
def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def _kib(x: float) -> str:
    return f"{x / 1024:.1f}"


def summarize(worker_out: dict, warmup: int) -> list[dict]:
    """Per configuration: median step time with and without overlap, exposed sync per rank, bytes per rank."""
    rows = []
    for per_rank in worker_out["rows"]:
        first = per_rank[0]
        n = len(first["records"])
        steps = {True: [], False: []}
        exposed: dict[bool, list[list[float]]] = {True: [], False: []}
        for k in range(warmup, n):
            recs = [r["records"][k] for r in per_rank]
            overlap = recs[0]["overlap"]
            steps[overlap].append(max(r["end"] for r in recs) - max(r["start"] for r in recs))
            exposed[overlap].append([r["exposed_sync_s"] for r in recs])
        med = {o: statistics.median(v) if v else float("nan") for o, v in steps.items()}
        ranks = []
        for r in per_rank:
            rec = r["records"][-1]
            ranks.append({"stage": r["stage"], "p2p_bytes": rec["p2p_bytes"], "allreduce_bytes": rec["allreduce_bytes"],
                          "analytic": r["analytic"], "buckets": r["buckets"],
                          "overlapped_buckets": max(x["overlapped_buckets"] for x in r["records"]),
                          "iface": r["iface"], "iface_tx_bytes": [x["iface_tx_bytes"] for x in r["records"][warmup:]]})
        link = {}
        for r in ranks:  # one counter per interface (node), whichever rank read it
            if r["iface"]:
                link[r["iface"]] = statistics.median(r["iface_tx_bytes"]) if r["iface_tx_bytes"] else 0
        rows.append({
            "name": first["name"], "compute": first["compute"], "P": first["P"], "D": first["D"], "m": first["m"],
            "bucket_bytes": first["bucket_bytes"], "step_s_overlap": med[True], "step_s_sync_at_end": med[False],
            "steps_overlap": steps[True], "steps_sync_at_end": steps[False],
            "gain": med[False] / med[True] - 1 if med[True] == med[True] else float("nan"),
            "exposed_sync_s_per_rank": {str(o): [statistics.median(c) for c in zip(*v)] if v else [] for o, v in
                                        exposed.items()},
            "ranks": ranks, "link_tx_bytes_per_step": link,
        })
    return rows


def render(rows: list[dict], global_batch: int) -> str:
    lines = [
        "| config | m | buckets/stage | step ms, overlap | step ms, sync at end | gain | samples/s (overlap) "
        "| exposed sync ms per rank: overlap / sync at end |",
        "|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        buckets = "/".join(str(x["buckets"]) for x in r["ranks"][: r["P"]]) if r["D"] > 1 else "-"
        ex = r["exposed_sync_s_per_rank"]
        lines.append(
            f"| {r['name']} | {r['m']} | {buckets} | {_ms(r['step_s_overlap'])} | {_ms(r['step_s_sync_at_end'])} "
            f"| {r['gain'] * 100:+.1f}% | {global_batch / r['step_s_overlap']:.0f} "
            f"| {' '.join(_ms(x) for x in ex['True'])} / {' '.join(_ms(x) for x in ex['False'])} |"
        )
    lines += [
        "",
        "| config | rank (stage) | p2p KiB/step: measured | analytic | all-reduce payload KiB/step: measured "
        "| analytic | ring wire KiB (2(n-1)/n) | buckets started in last backward |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        for rank, x in enumerate(r["ranks"]):
            a = x["analytic"]
            ring = a["data_allreduce"] * 2 * (r["D"] - 1) / r["D"]
            if a["tied_allreduce"]:
                n = 2 * r["D"]  # the tied copies: first and last stage of every replica
                ring += a["tied_allreduce"] * 2 * (n - 1) / n
            lines.append(
                f"| {r['name']} | {rank} ({x['stage']}) | {_kib(x['p2p_bytes'])} | {_kib(a['p2p'])} "
                f"| {_kib(x['allreduce_bytes'])} | {_kib(a['allreduce'])} | {_kib(ring)} "
                f"| {x['overlapped_buckets']}/{x['buckets'] if r['D'] > 1 else 0} |"
            )
    if any(r["link_tx_bytes_per_step"] for r in rows):
        lines += ["", "| config | link tx KiB/step per node interface |", "|---|---|"]
        for r in rows:
            lines.append(f"| {r['name']} | " + ", ".join(f"{k}: {_kib(v)}" for k, v in
                                                         sorted(r["link_tx_bytes_per_step"].items())) + " |")
    return "\n".join(lines)


def worker_command(args, worker_out: str, grid: str) -> list[str]:
    """The worker's arguments (after ``torchrun ... benchmarks/pxd.py``)."""
    return ["--worker", "--worker-out", worker_out, "--grid", grid, "--compute", args.compute,
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--global-batch", str(args.global_batch),
            "--microbatch-size", str(args.microbatch_size), "--block-fwd-ms", str(args.block_fwd_ms),
            "--schedule", args.schedule, "--timeout-s", str(args.timeout_s)] + (
        ["--bucket-bytes", str(args.bucket_bytes)] if args.bucket_bytes else [])


def driver(args) -> int:
    load_start = list(os.getloadavg())
    with tempfile.TemporaryDirectory() as tmp:
        worker_out = str(Path(tmp) / "worker.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               str(Path(__file__).resolve()), *worker_command(args, worker_out, args.grid)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not Path(worker_out).exists():
            print(proc.stdout[-4000:], proc.stderr[-8000:], sep="\n", file=sys.stderr)
            return proc.returncode or 1
        result = json.loads(Path(worker_out).read_text())
    report(result, args, time.monotonic() - t0, "python benchmarks/pxd.py " + " ".join(sys.argv[1:]),
           {"loadavg_start": load_start})
    return 0


def report(result: dict, args, wall_s: float, command: str, extra: dict | None = None) -> dict:
    rows = summarize(result, args.warmup)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    out = {"command": command, "commit": commit, "wall_s": wall_s, "loadavg_end": list(os.getloadavg()),
           "config": CONFIG,
           "args": {k: v for k, v in vars(args).items() if k not in ("worker", "worker_out")}, **(extra or {}),
           "rows": rows, "table_md": render(rows, args.global_batch)}
    print(out["table_md"])
    print(f"\nwall {wall_s:.0f} s, load average {out['loadavg_end']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options shared with ``netem.py``."""
    p.add_argument("--out", default=None, help="JSON result file")
    p.add_argument("--compute", default="emulated,real", help="comma list of emulated, real")
    p.add_argument("--steps", type=int, default=20, help="measured steps per configuration (half with overlap)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step over all replicas")
    p.add_argument("--microbatch-size", type=int, default=2)
    p.add_argument("--block-fwd-ms", type=float, default=4.0, help="emulated: one block's forward per micro-batch")
    p.add_argument("--schedule", default="varuna", choices=["varuna", "1f1b", "gpipe"])
    p.add_argument("--bucket-bytes", type=int, default=None, help="gradient bucket size (default: the engine's)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="p2p timeout (a hang becomes an error)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(p)
    p.add_argument("--grid", default="4x1,2x2,1x4", help="comma list of PxD (PxDz1: with zero_stage=1)")
    p.add_argument("--nproc", type=int, default=4, help="processes (P x D of every grid entry)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    return worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    sys.exit(main())
