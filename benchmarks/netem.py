"""A commodity-network link between two "nodes": which traffic crosses it, for P x D placements of the example GPT.

Run as root, from the repository root (Linux with ``ip`` and ``tc`` from iproute2)::

    python benchmarks/netem.py --rate 100mbit --out benchmarks/results/netem.json

The script builds two network namespaces joined by a veth pair, shapes the egress of both ends with
``tc qdisc ... tbf rate RATE`` (optionally behind a ``netem delay``), and runs each placement as torchrun agents
inside the namespaces (``--nnodes``, ``--node-rank``, rendezvous at the first namespace's address, gloo bound
to the veth by ``GLOO_SOCKET_IFNAME``). Processes of one namespace talk over its loopback, unshaped, as on one
node. The addresses exist only inside the namespaces, and everything is removed on exit (also after an error,
Ctrl-C or SIGTERM).

Each run is ``benchmarks/pxd.py``'s worker (see its docstring: emulated compute by default, overlap and sync
at end alternating step by step, bytes per step), plus the tx bytes per step of each namespace's veth: what
crossed the link. Placements (ranks are ``replica * P + stage``; torchrun numbers them
``node_rank * nproc + local_rank``):

* ``2x2-local-pipelines`` (Varuna's rule): 2 nodes x 2 processes. Each replica's pipeline is on one node; the
  data-parallel all-reduces cross the link.
* ``2x2-crossed-pipelines``: 4 agents of 1 process; node ranks 0 and 2 (both stage 0s) in namespace A, 1 and 3
  (both stage 1s) in B. Every pipeline p2p message crosses the link; the stages' all-reduces stay local.
* ``4x1``: 2 nodes x 2 processes, one pipeline: the boundary between stages 1 and 2 crosses.
* ``1x4``: 2 nodes x 2 processes, data parallelism only: the all-reduce crosses.

In every placement with P > 1 the tied embedding's all-reduce (first and last stage of every replica) crosses
as well.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pxd  # noqa: E402

ROOT = pxd.ROOT
SUBNET = "10.231.0"
PORT = 29631
# name -> (P x D, processes per agent, namespace index of each node rank)
PLACEMENTS = {
    "2x2-local-pipelines": ("2x2", 2, [0, 1]),
    "2x2-crossed-pipelines": ("2x2", 1, [0, 1, 0, 1]),
    "4x1": ("4x1", 2, [0, 1]),
    "1x4": ("1x4", 2, [0, 1]),
}


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


class Link:
    """Two namespaces joined by a shaped veth pair; :meth:`remove` deletes what :meth:`create` made."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 10**6}"
        self.namespaces = [f"lvb{tag}a", f"lvb{tag}b"]
        self.ifaces = [f"lvb{tag}x", f"lvb{tag}y"]
        self.addresses = [f"{SUBNET}.1", f"{SUBNET}.2"]
        self.created: list[str] = []

    def create(self, rate: str, delay_ms: float, latency: str) -> None:
        for ns in self.namespaces:
            _sh("ip", "netns", "add", ns)
            self.created.append(ns)
        _sh("ip", "link", "add", self.ifaces[0], "type", "veth", "peer", "name", self.ifaces[1])
        rate_bps = _bits(rate)
        burst = max(16 * 1024, int(rate_bps / 8 / 100))  # 10 ms at the rate, at least a few full packets
        for ns, iface, address in zip(self.namespaces, self.ifaces, self.addresses, strict=True):
            _sh("ip", "link", "set", iface, "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", iface)
            _sh("ip", "-n", ns, "link", "set", iface, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            tbf = ["tbf", "rate", rate, "burst", str(burst), "latency", latency]
            if delay_ms > 0:
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", iface, "root", "handle", "1:",
                    "netem", "delay", f"{delay_ms}ms")
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", iface, "parent", "1:", "handle", "10:",
                    *tbf)
            else:
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", iface, "root", *tbf)

    def remove(self) -> None:
        # deleting a namespace deletes the veth end in it, and with it the pair; a pair never moved is deleted here
        subprocess.run(["ip", "link", "del", self.ifaces[0]], capture_output=True)
        for ns in self.created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.created = []


def _bits(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, factor in units.items():
        if rate.lower().endswith(unit):
            return float(rate[: -len(unit)]) * factor
    raise SystemExit(f"--rate {rate!r}: use e.g. 100mbit, 1gbit, 500kbit")


def run_placement(link: Link, name: str, args, port: int) -> dict:
    """Runs pxd.py's worker in the placement's agents; returns its summary rows."""
    grid, nproc, where = PLACEMENTS[name]
    with tempfile.TemporaryDirectory() as tmp:
        worker_out = str(Path(tmp) / "worker.json")
        if args.zero and not grid.endswith("x1"):  # D > 1: the same shape with zero_stage=1, steps interleaved
            grid = f"{grid},{grid}z1"
        worker_args = pxd.worker_command(args, worker_out, grid)
        agents = []
        for node_rank, ns_index in enumerate(where):
            ns, iface = link.namespaces[ns_index], link.ifaces[ns_index]
            env = {"GLOO_SOCKET_IFNAME": iface, "LV_BENCH_IFACE": iface, "OMP_NUM_THREADS": "1",
                   "PYTHONWARNINGS": "ignore"}
            cmd = ["ip", "netns", "exec", ns, "env", *(f"{k}={v}" for k, v in env.items()),
                   sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(where)}", f"--node-rank={node_rank}",
                   f"--nproc-per-node={nproc}", f"--master-addr={link.addresses[0]}", f"--master-port={port}",
                   str(ROOT / "benchmarks" / "pxd.py"), *worker_args]
            agents.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                           start_new_session=True))
        t0 = time.monotonic()
        outputs = []
        try:
            for agent in agents:
                outputs.append(agent.communicate(timeout=max(1.0, t0 + args.run_timeout_s - time.monotonic())))
        finally:
            for agent in agents:
                if agent.poll() is None:
                    os.killpg(agent.pid, signal.SIGKILL)
                    agent.wait()
        if any(a.returncode for a in agents) or not Path(worker_out).exists():
            for i, (out, err) in enumerate(outputs):
                print(f"--- node {i}:\n{out[-2000:]}\n{err[-4000:]}", file=sys.stderr)
            raise RuntimeError(f"placement {name} failed")
        result = json.loads(Path(worker_out).read_text())
    rows = pxd.summarize(result, args.warmup)
    for row in rows:
        row["placement"] = name
        row["link_ifaces"] = dict(zip(link.ifaces, link.namespaces, strict=True))
    return {"placement": name, "grid": grid, "agents": len(where), "nproc_per_agent": nproc, "wall_s":
            time.monotonic() - t0, "rows": rows}


def render(runs: list[dict], global_batch: int) -> str:
    lines = [
        "| placement | config | step ms, overlap | step ms, sync at end | gain | samples/s (overlap) "
        "| link KiB/step A->B | B->A |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        for r in run["rows"]:
            ifaces = sorted(r["link_tx_bytes_per_step"])
            tx = [r["link_tx_bytes_per_step"].get(i, float("nan")) / 1024 for i in ifaces]
            lines.append(
                f"| {run['placement']} | {r['name']} | {r['step_s_overlap'] * 1e3:.1f} "
                f"| {r['step_s_sync_at_end'] * 1e3:.1f} | {r['gain'] * 100:+.1f}% "
                f"| {global_batch / r['step_s_overlap']:.0f} | " + " | ".join(f"{x:.1f}" for x in tx) + " |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    pxd.add_arguments(p)
    p.set_defaults(compute="emulated", steps=10)
    p.add_argument("--placements", default=",".join(PLACEMENTS), help=f"comma list of {list(PLACEMENTS)}")
    p.add_argument("--rate", default="100mbit", help="tbf rate of each direction of the link")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way netem delay added to each direction")
    p.add_argument("--latency", default="100ms", help="tbf latency (bounds its queue)")
    p.add_argument("--run-timeout-s", type=float, default=900.0, help="wall-clock limit of one placement")
    p.add_argument("--zero", action="store_true", help="also run each D > 1 placement with zero_stage=1")
    args = p.parse_args(argv)
    names = [n for n in args.placements.split(",") if n]
    unknown = [n for n in names if n not in PLACEMENTS]
    if unknown:
        p.error(f"unknown placement(s) {unknown}; choose from {list(PLACEMENTS)}")
    if os.geteuid() != 0:
        p.error("needs root (ip netns, veth, tc)")
    if "," in args.compute:
        p.error("--compute: one of emulated, real")

    def terminate(signum, frame):  # the finally below removes the namespaces
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGHUP, terminate)
    t0 = time.monotonic()
    load_start = list(os.getloadavg())
    runs = []
    link = Link()
    try:
        link.create(args.rate, args.delay_ms, args.latency)
        print(f"link: {args.rate}, delay {args.delay_ms} ms, namespaces {link.namespaces}", flush=True)
        for i, name in enumerate(names):
            run = run_placement(link, name, args, PORT + i)
            runs.append(run)
            print(f"{name}: {run['wall_s']:.0f} s", flush=True)
    finally:
        link.remove()
    out = {"command": "python benchmarks/netem.py " + " ".join(sys.argv[1:]), "wall_s": time.monotonic() - t0,
           "loadavg_start": load_start, "loadavg_end": list(os.getloadavg()), "config": pxd.CONFIG,
           "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                    text=True).stdout.strip(),
           "args": vars(args), "runs": runs, "table_md": render(runs, args.global_batch),
           "bytes_md": "\n\n".join(f"{r['placement']}:\n\n{pxd.render(r['rows'], args.global_batch)}" for r in runs)}
    print(out["table_md"])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
