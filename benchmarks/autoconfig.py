"""Auto-configuration: predicted against measured step time and memory of every valid configuration on 4 processes.

Run from the repository root (it starts its own ``torchrun`` job: 4 processes, gloo, 1 thread each)::

    python benchmarks/autoconfig.py --out benchmarks/results/autoconfig.json
    python benchmarks/autoconfig.py --link netem --rate 100mbit \\
        --out benchmarks/results/autoconfig_netem.json      # as root: two "nodes" joined by a shaped link

What it does:

1. Profiles the example GPT as ``examples/gpt/config.yaml`` has it, and plans it for 4 devices (the time of the
   profile and of the search is reported), then profiles the *bench model*: the same GPT with a longer sequence
   and a wider residual stream (``--block-size 256 --n-embd 128``), whose activations dominate its memory.
2. Builds the *emulated model*: the bench model's structure and parameters (tied embedding and head), whose every
   segment sleeps its profiled time times ``--scale`` (forward without or with autograd, backward: each at the
   micro-batch size it runs at) and keeps for backward as many bytes as the profile says the real segment keeps.
   Real compute is left out (the head scores the last position only), so that 4 processes on 2 cores do not
   compete for the cores and the step time is what a node with one device per process would see.
3. In the torchrun job, the engine's own auto-configuration profiles the emulated model (rank 0), measures the
   network on the 4 ranks and predicts every valid configuration: P in {1, 2, 4}, D = 4 / P, every micro-batch
   size that divides the replica's batch (global batch ``--global-batch``), the three schedules, recompute on and
   off. The memory limit (``--memory-limit``, default: the 60th percentile of the predicted peaks, so that the
   largest configurations are ruled out) decides the auto choice: the fastest predicted whose every stage's
   peak is within the planner's budget (the limit less its 10% reserve).
4. Measures every configuration (built by the engine with the planner's stages, AdamW on its stage): ``--rounds``
   rounds, each building every configuration in turn (the order rotated between rounds), one warm-up step,
   ``--steps`` timed steps and one untimed memory step in which the heap in use (glibc ``mallinfo2``) is sampled
   at every segment's forward and backward and after the gradient sync. Step time = latest end over ranks -
   earliest start (one clock for the host), after a barrier; median over all timed steps of all rounds. Peak =
   the largest sample minus the heap in use before the configuration was built, per rank (= stage of replica 0).
5. Reports per configuration the predicted and measured step time and peak memory, Kendall's tau (tau-b) between
   predicted and measured step times, their median relative error, the regret of the auto choice (its measured
   step time over the best measured configuration whose measured peak is within the limit), the chosen
   configuration's measured peak against the limit, and a scatter plot (``<out>.png``).

With ``--link netem`` the 4 processes run as 2 torchrun agents of 2 processes in two network namespaces joined
by a ``tbf``-shaped veth link (``benchmarks/netem.py``'s ``Link``; root only): the planner is told 2 devices per
node and measures the link between them, so a configuration whose all-reduce or pipeline crosses it pays for it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))  # this checkout's lightning_varuna, whatever is installed
EXAMPLE = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64, dropout=0.0)


# ------------------------------------------------------------------------------------------------ models
def gpt_class():
    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    from model import GPT

    return GPT


def real_profile(config: dict, largest: int, devices: int):
    """Profiles the real GPT in this process; returns (profile, seconds to profile, seconds to search 4 devices)."""
    import torch

    from lightning_varuna.pipeline.config import EngineConfig
    from lightning_varuna.pipeline.engine import default_loss, first_samples, samples
    from lightning_varuna.pipeline.model.dry_run import trace_step
    from lightning_varuna.pipeline.planning.profiler import profile_model, profile_sizes
    from lightning_varuna.pipeline.planning.search import Cluster, search

    torch.manual_seed(0)
    model = gpt_class()(**config)
    model.configure_model()  # the layers, built for real (outside the strategy)
    T, V = config["block_size"], config["vocab_size"]
    batch = (torch.randint(0, V, (largest, T)), torch.randint(0, V, (largest, T)))
    start = time.perf_counter()
    trace, _ = trace_step(model, lambda n: model._loss(first_samples(batch, n)))
    profile = profile_model(model, lambda n: model._loss(samples(batch, n)), default_loss, trace,
                            profile_sizes(largest), torch.device("cpu"))
    profiled = time.perf_counter()
    searched = EngineConfig(microbatch_size="auto", schedule="auto", recompute="auto", global_batch_size=largest)
    search(profile, Cluster(devices, devices), searched, 2**40)
    return profile, profiled - start, time.perf_counter() - profiled


def emulated_model(real, scale: float, config: dict, rt: dict):
    """The GPT's structure and parameters; each segment sleeps ``scale`` times its real profile (see docstring)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    GPT = gpt_class()
    from model import Block

    def sample() -> None:
        if rt.get("gauge"):
            rt["peak"] = max(rt["peak"], heap_in_use())

    class _Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, touch, segment: int, grad: bool):
            size = x.shape[0]
            ctx.segment, ctx.size = segment, size
            if grad:  # what the real segment keeps for backward
                ctx.save_for_backward(torch.empty(real.saved_bytes(segment, size) // 4))
            _sleep(real.forward(segment, size, grad) * scale)
            sample()
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            ctx.saved_tensors  # noqa: B018 - unpacked, as a real backward would
            _sleep(real.backward(ctx.segment, ctx.size) * scale)
            sample()
            return g, torch.zeros(()), None, None

    def sleep_op(x, module: nn.Module, segment: int):
        if x.device.type == "meta":  # a stand-in's shape inference
            return x
        touch = sum(p.reshape(-1)[0] for p in module.parameters())  # every parameter used, so it gets a gradient
        return _Sleep.apply(x, touch, segment, torch.is_grad_enabled())

    class SleepBlock(Block):
        def __init__(self, segment: int) -> None:
            super().__init__(config["n_embd"], config["n_head"], 0.0, True)
            self.segment = segment

        def forward(self, x):
            return sleep_op(x, self, self.segment)

    class EmulatedGPT(GPT):
        def __init__(self) -> None:
            super().__init__(**config)
            self.configure_model()  # the GPT's layers, for real; then the blocks are swapped for sleeping ones
            self.blocks = nn.ModuleList(SleepBlock(i) for i in range(config["n_layer"]))

        def forward(self, idx):
            T = idx.size(1)
            x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
            for block, cut in zip(self.blocks, self.cuts, strict=True):
                x = cut(block(x))
            x = sleep_op(self.ln_f(x), self.ln_f, config["n_layer"])
            return F.linear(x[:, -1:], self.wte.weight)  # the last position only: next to no real compute

        def _loss(self, batch):
            idx, targets = batch
            logits = self(idx)
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets[:, -1:].reshape(-1))

    torch.manual_seed(1234)
    return EmulatedGPT()


def _sleep(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while (left := end - time.perf_counter()) > 0:
        time.sleep(left)


def heap_in_use() -> int:
    from emulated import heap_in_use as heap

    return heap()


# ------------------------------------------------------------------------------------------------ worker
def worker(args) -> int:
    import torch
    import torch.distributed as dist

    from lightning_varuna.pipeline import PipelineEngine
    from lightning_varuna.pipeline.config import EngineConfig
    from lightning_varuna.pipeline.engine import default_loss, first_samples, samples
    from lightning_varuna.pipeline.model.dry_run import trace_step
    from lightning_varuna.pipeline.planning.choice import choose
    from lightning_varuna.pipeline.planning.memory_model import planning_budget
    from lightning_varuna.pipeline.planning.profile_data import Profile
    from lightning_varuna.pipeline.planning.search import search

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo")  # the benchmark's own barriers
    real = Profile.load(args.real_profile)
    config = dict(EXAMPLE, block_size=args.block_size, n_embd=args.n_embd)
    rt: dict = {"gauge": False, "peak": 0}
    G, T, V = args.global_batch, args.block_size, config["vocab_size"]

    # the planner, as the engine runs it: rank 0 profiles the emulated model, every rank measures the network
    model = emulated_model(real, args.scale, config, rt)
    sample = _batch(G, T, V, 0)
    trace, _ = trace_step(model, lambda n: model._loss(first_samples(sample, n)))
    plan_config = EngineConfig(pipeline_parallel_size="auto", microbatch_size="auto", schedule="auto",
                               recompute="auto", global_batch_size=G, memory_limit=2**40,
                               devices_per_node=args.devices_per_node)
    start = time.perf_counter()
    auto = choose(plan_config, model, trace, lambda n: model._loss(samples(sample, n)), default_loss, G,
                  torch.device("cpu"), (torch.optim.AdamW, {}))
    plan_seconds = time.perf_counter() - start
    if rank == 0:
        auto.profile.save(args.emulated_profile)
    peaks = sorted(max(c.peak_bytes) for c in auto.ranking)
    limit = args.memory_limit or peaks[int(0.6 * (len(peaks) - 1))]
    ranking = search(auto.profile, auto.cluster, plan_config, planning_budget(limit))  # as the engine plans
    dist.barrier(group=group)
    model = None  # free it before the configurations are built

    measured: dict[int, dict] = {i: {"steps": [], "peak": []} for i in range(len(ranking))}
    for round_index in range(args.rounds):
        order = list(range(len(ranking)))
        shift = round_index * len(order) // max(1, args.rounds)
        for i in order[shift:] + order[:shift]:
            c = ranking[i]
            steps, peak = _measure(c, args, real, config, rt, group, PipelineEngine, G, T, V)
            measured[i]["steps"] += steps
            measured[i]["peak"].append(peak)
        if rank == 0:
            print(f"[autoconfig] round {round_index + 1}/{args.rounds} done", flush=True)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, measured, group=group)
    if rank == 0:
        rows = []
        for i, c in enumerate(ranking):
            steps = [max(g[i]["steps"][k][1] for g in gathered) - min(g[i]["steps"][k][0] for g in gathered)
                     for k in range(len(gathered[0][i]["steps"]))]
            rows.append({"P": c.pipeline_size, "D": c.data_size, "microbatch_size": c.microbatch_size,
                         "m": c.num_microbatches, "schedule": c.schedule, "recompute": c.recompute,
                         "predicted_step_s": c.step_s, "predicted_peak_bytes": list(c.peak_bytes),
                         "predicted_fits": c.fits, "bubble": c.bubble, "steps_s": steps,
                         "measured_peak_bytes": [max(g[i]["peak"]) for g in gathered]})
        out = {"world_size": world, "devices_per_node": args.devices_per_node, "memory_limit": limit,
               "plan_seconds": plan_seconds, "planner_seconds_rank0": auto.seconds, "profile": auto.profile.to_dict(),
               "rows": rows}
        Path(args.worker_out).write_text(json.dumps(out))
    dist.barrier(group=group)
    dist.destroy_process_group()
    return 0


def _batch(n: int, T: int, V: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (n, T + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _measure(c, args, real, config, rt, group, engine_class, G, T, V):
    """Builds one configuration, runs a warm-up, the timed steps and a memory step; tears it down."""
    import gc

    import torch
    import torch.distributed as dist

    gc.collect()
    dist.barrier(group=group)
    base = heap_in_use()
    model = emulated_model(real, args.scale, config, rt)
    replica = dist.get_rank() // c.pipeline_size
    batch = _batch(G // c.data_size, T, V, 100 + replica)
    from lightning_varuna.pipeline import EngineConfig
    from lightning_varuna.pipeline.planning.choice import choose

    engine = engine_class(model, EngineConfig(
        c.pipeline_size, microbatch_size=c.microbatch_size, schedule=c.schedule, recompute=c.recompute,
        profile=args.emulated_profile, global_batch_size=G, memory_limit=2**40, devices_per_node=args.devices_per_node,
        p2p_timeout=args.timeout_s), planner=choose)
    engine.setup(batch, model._loss)
    optimizer = torch.optim.AdamW(engine.parameters())
    steps = []

    def step(gauge: bool) -> tuple[float, float]:
        dist.barrier(group=group)
        rt["gauge"], rt["peak"] = gauge, 0
        start = time.monotonic()
        engine.train_step(batch, model._loss, start_sync=True)
        engine.sync_gradients()
        if gauge:
            rt["peak"] = max(rt["peak"], heap_in_use())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return start, time.monotonic()

    step(False)
    for _ in range(args.steps):
        steps.append(step(False))
    step(True)
    peak = rt["peak"] - base
    rt["gauge"] = False
    engine.teardown()
    engine.topology.destroy_groups()  # the next configuration makes its own
    return steps, peak


# ------------------------------------------------------------------------------------------------ driver
def driver(args) -> int:
    from autoconfig_report import render, scatter_png, summarize

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    t0 = time.monotonic()
    _, example_profile_s, example_search_s = real_profile(EXAMPLE, args.global_batch, 4)
    bench = dict(EXAMPLE, block_size=args.block_size, n_embd=args.n_embd)
    real, bench_profile_s, _ = real_profile(bench, args.global_batch, 4)
    print(f"[autoconfig] example: profile {example_profile_s:.1f} s, search {example_search_s:.2f} s; "
          f"bench model profile {bench_profile_s:.1f} s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        real_path, worker_out = Path(tmp) / "real.json", Path(tmp) / "worker.json"
        real.save(real_path)
        worker_args = ["--worker", "--worker-out", str(worker_out), "--real-profile", str(real_path),
                       "--emulated-profile", str(Path(tmp) / "emulated.json"), *_shared_args(args)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "LIGHTNING_VARUNA_CACHE_DIR": str(Path(tmp) / "cache"), "PYTHONPATH": str(ROOT)}
        if args.link == "netem":
            _run_netem(args, worker_args, env)
        else:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                       str(Path(__file__).resolve()), *worker_args, "--devices-per-node", "4"]
            proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
            if proc.returncode != 0 or not worker_out.exists():
                print(proc.stdout[-4000:], proc.stderr[-8000:], sep="\n", file=sys.stderr)
                return proc.returncode or 1
        result = json.loads(worker_out.read_text())
    summary = summarize(result, args.rounds)
    out = {"command": "python benchmarks/autoconfig.py " + " ".join(sys.argv[1:]), "wall_s": time.monotonic() - t0,
           "loadavg_end": list(os.getloadavg()), "args": vars(args), "bench_model": bench,
           "example_profile_s": example_profile_s, "example_search_s": example_search_s,
           "bench_profile_s": bench_profile_s, "real_profile": real.to_dict(), **result, "summary": summary}
    out["table_md"] = render(out)
    print(out["table_md"])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
        scatter_png(out, Path(args.out).with_suffix(".png"))
    return 0


def _shared_args(args) -> list[str]:
    return ["--global-batch", str(args.global_batch), "--block-size", str(args.block_size), "--n-embd",
            str(args.n_embd), "--scale", str(args.scale), "--rounds", str(args.rounds), "--steps", str(args.steps),
            "--timeout-s", str(args.timeout_s)] + (["--memory-limit", str(args.memory_limit)] if args.memory_limit
                                                   else [])


def _run_netem(args, worker_args: list[str], env: dict) -> None:
    import netem

    link = netem.Link()
    agents = []
    try:
        link.create(args.rate, args.delay_ms, "100ms")
        for node_rank, (ns, iface) in enumerate(zip(link.namespaces, link.ifaces, strict=True)):
            node_env = [f"{k}={v}" for k, v in {**env, "GLOO_SOCKET_IFNAME": iface}.items()
                        if k in ("OMP_NUM_THREADS", "PYTHONWARNINGS", "LIGHTNING_VARUNA_CACHE_DIR", "PYTHONPATH",
                                 "GLOO_SOCKET_IFNAME", "PATH", "HOME")]
            command = ["ip", "netns", "exec", ns, "env", *node_env, sys.executable, "-m", "torch.distributed.run",
                       "--nnodes=2", f"--node-rank={node_rank}", "--nproc-per-node=2",
                       f"--master-addr={link.addresses[0]}", "--master-port=29641", str(Path(__file__).resolve()),
                       *worker_args, "--devices-per-node", "2"]
            agents.append(subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                           text=True, start_new_session=True))
        outputs = [agent.communicate(timeout=args.run_timeout_s) for agent in agents]
        if any(agent.returncode for agent in agents):
            for out, err in outputs:
                print(out[-3000:], err[-6000:], sep="\n", file=sys.stderr)
            raise RuntimeError("the netem run failed")
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
        link.remove()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="JSON result file (the scatter plot goes next to it, .png)")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step over all replicas")
    p.add_argument("--block-size", type=int, default=256, help="the bench model's sequence length")
    p.add_argument("--n-embd", type=int, default=128, help="the bench model's width")
    p.add_argument("--scale", type=float, default=2.0, help="emulated time = profiled time x scale")
    p.add_argument("--memory-limit", type=int, default=None, help="bytes per stage (default: 60th percentile)")
    p.add_argument("--rounds", type=int, default=2, help="rounds over every configuration")
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration and round")
    p.add_argument("--link", choices=["loopback", "netem"], default="loopback")
    p.add_argument("--rate", default="100mbit", help="netem: the link's rate")
    p.add_argument("--delay-ms", type=float, default=0.0, help="netem: one-way delay")
    p.add_argument("--timeout-s", type=float, default=300.0, help="p2p timeout (a hang becomes an error)")
    p.add_argument("--run-timeout-s", type=float, default=3600.0, help="netem: wall-clock limit of the job")
    p.add_argument("--devices-per-node", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    p.add_argument("--real-profile", help=argparse.SUPPRESS)
    p.add_argument("--emulated-profile", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.link == "netem" and not args.worker and os.geteuid() != 0:
        p.error("--link netem needs root (ip netns, veth, tc)")
    return worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    sys.exit(main())
