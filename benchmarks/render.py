"""Render benchmarks/emulated.py results (JSON) as a markdown table.

python benchmarks/render.py benchmarks/results/emulated.json > benchmarks/results/emulated.md
"""

from __future__ import annotations

import argparse
import json
import sys

SYSTEM_ORDER = [
    "torch-1f1b",
    "torch-1f1b-ckpt",
    "torch-gpipe",
    "torch-gpipe-ckpt",
    "ours-varuna-rc",
    "ours-varuna-rc-classic",
    "ours-1f1b-rc",
    "ours-1f1b",
    "ours-gpipe",
]


def _peer_of(row: dict) -> str:
    """The peer a row is compared with: torch 1F1B with the same memory policy (recompute or not)."""
    return "torch-1f1b-ckpt" if row["recompute"] else "torch-1f1b"


def _mib(values: list[float]) -> str:
    return "/".join(f"{v:.0f}" for v in values)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def render(results: dict) -> str:
    meta, rows = results["meta"], results["rows"]
    by_key = {(r["system"], r["m"], r["jitter"]): r for r in rows}
    order = {name: i for i, name in enumerate(SYSTEM_ORDER)}
    rows = sorted(rows, key=lambda r: (r["m"], r["jitter"], order.get(r["system"], 99), r["system"]))
    F, B, P = meta["F_s"] * 1e3, meta["B_s"] * 1e3, meta["world_size"]
    shape = "x".join(str(d) for d in meta["activation_shape"])
    out = [
        f"Emulated compute: P={P} stages (one per process, gloo, CPU), F={F:g} ms, B={B:g} ms per stage and "
        f"micro-batch, {meta['layers_per_stage']} layers per stage, activations {shape} fp32 "
        f"({meta['activation_mib']:g} MiB). Median of {meta['steps']} steps after {meta['warmup']} warm-up "
        + (
            f"step(s); peaks from {meta['memory_steps']} separate, untimed memory step(s). "
            if meta.get("memory_steps")
            else "step(s); no memory steps (peaks 0). "
            if "memory_steps" in meta
            else "step(s); peaks sampled in the timed steps. "
        )
        + f"Jitter: per-message delay U(0, frac)*F, `{meta['jitter_mode']}` model, "
        f"seed {meta['seed']}. "
        f"Wall time {meta.get('wall_s', float('nan')):.0f} s (after start-up); load average at start/end "
        f"{meta['loadavg_start'][0]:.1f}/{meta.get('loadavg_end', [float('nan')])[0]:.1f} "
        f"on {meta['cpus']} CPUs.",
        "",
        "| system | recompute | m | jitter | time/step (ms) | ratio to ideal | vs torch 1F1B | jitter cost "
        "| idle (measured) | idle (P-1)/(m+P-1) | peak MiB per stage | held MiB per stage | op overrun |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|",
    ]
    for r in rows:
        peer = by_key.get((_peer_of(r), r["m"], r["jitter"]))
        vs = f"{r['step_s'] / peer['step_s']:.3f}" if peer is not None else "-"
        calm = by_key.get((r["system"], r["m"], 0.0))
        jc = f"{r['step_s'] / calm['step_s']:.3f}" if calm is not None and r["jitter"] > 0 else "-"
        out.append(
            f"| {r['system']} | {'yes' if r['recompute'] else 'no'} | {r['m']} | {r['jitter']:g} "
            f"| {r['step_s'] * 1e3:.0f} | {r['ratio_ideal']:.3f} | {vs} | {jc} "
            f"| {r['idle_mean']:.3f} | {r['idle_theory']:.3f} "
            f"| {_mib(r['peak_mib_per_stage'])} | {_mib(r['held_mib_per_stage'])} "
            f"| {_pct(r.get('op_overrun'))} |"
        )
    out += [
        "",
        "- ideal = m*(F+B) = useful work per stage (total work / P); recompute is not counted as work, so "
        f"its cost shows in the ratio. A perfect flush schedule without recompute has ratio (m+P-1)/m "
        f"({(8 + P - 1) / 8:.3f} at m=8, {(16 + P - 1) / 16:.3f} at m=16).",
        "- vs torch 1F1B: step time / torch-1f1b's (rows without recompute) or torch-1f1b-ckpt's (rows with "
        "recompute: equal memory policy), same m and jitter, same run. jitter cost: step time / the same "
        "system's without jitter.",
        "- idle (measured): 1 - (time in compute ops, recompute included) / step time, mean over stages.",
        "- peak: heap bytes in use above the step's start (graphs, stashes, grads, temporaries), max over "
        "the memory steps (or the timed steps, in runs before they were separate); held: kept between steps "
        "(e.g. receive buffers). Stages s0/s1/s2/s3.",
        "- op overrun: how much longer the compute ops took than asked (median over stages and steps): "
        "sleep wake-up latency and real tensor work, i.e. how loaded the shared machine was for that row. "
        "About 1-3% on a quiet machine; compare rows with similar overrun.",
        "- torch recompute = torch.utils.checkpoint on every stage but the last.",
    ]
    for s in results.get("skipped", []):
        out.append(f"- skipped {s['system']}: {s['reason']}")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Render emulated-benchmark JSON as markdown.")
    p.add_argument("results", help="JSON written by benchmarks/emulated.py --out")
    args = p.parse_args(argv)
    with open(args.results) as f:
        sys.stdout.write(render(json.load(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
