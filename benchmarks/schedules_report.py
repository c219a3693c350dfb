"""Table, chart and the issue's targets from ``schedules.py``'s stored JSON (nothing is measured here).

    python benchmarks/schedules_report.py benchmarks/results/schedules_p4.json [more.json ...] [--stem PATH]

Writes ``<first>.md`` (or ``PATH.md`` etc. with ``--stem``: the table and the targets), ``<first>.png``
(throughput against peak activation memory,
one point per system, one panel per (m, jitter), our Pareto front against torch's) and stores the targets in
``<first>_targets.json``.

Per row: throughput = samples per step / median step time; memory = peak activation memory of the stage that
needs most (max over stages of the peak above the step's start). Rows whose forward/I/W counts differ from what
the system must run are listed (torch's zero-bubble schedules with full checkpointing recompute a chunk once
per autograd pass, not once per micro-batch) and kept: that is what a user of them gets.

Targets, per (m, jitter):
  (a) front dominance: for every torch point, one of ours at no more memory (2% tolerance, the memory
      probe's resolution) whose median step is no slower than torch's slowest repetition (within the spread);
      the miss is ours' best step at that memory / torch's median step - 1.
  (b) at the memory of torch's checkpointed 1F1B or less, our best throughput >= 1.2x its (stretch 1.3x).
  (c) (a) and (b) with jitter 0.5.
"""

from __future__ import annotations

import json
import os
import sys

MEM_TOL = 1.02


def _mem(row: dict) -> float:
    return max(row["peak_mib_per_stage"])


def _tput(row: dict, step: float | None = None) -> float:
    return row["samples_per_step"] / (step if step is not None else row["step_s"])


def pareto(rows: list[dict]) -> list[dict]:
    """Rows no other row beats on both memory and step time, by memory."""
    front, best = [], float("inf")
    for r in sorted(rows, key=lambda r: (_mem(r), r["step_s"])):
        if r["step_s"] < best:
            front.append(r)
            best = r["step_s"]
    return front


def targets(rows: list[dict]) -> dict:
    """The issue's targets evaluated per (m, jitter); see the module docstring."""
    out = {}
    for key in sorted({(r["m"], r["jitter"]) for r in rows}):
        group = [r for r in rows if (r["m"], r["jitter"]) == key]
        torch_rows = [r for r in group if r["framework"] == "torch"]
        ours = [r for r in group if r["framework"] == "ours"]
        misses = []
        for t in torch_rows:
            fit = [o for o in ours if _mem(o) <= _mem(t) * MEM_TOL]
            best = min(fit, key=lambda o: o["step_s"]) if fit else None
            if best is None or best["step_s"] > t["step_s_max"]:
                misses.append({
                    "torch": t["system"], "torch_mib": round(_mem(t), 2), "torch_step_ms": round(t["step_s"] * 1e3, 1),
                    "ours": best["system"] if best else None,
                    "slower_by": round(best["step_s"] / t["step_s"] - 1, 3) if best else None,
                })
        ref = next((r for r in torch_rows if r["system"] == "torch-1f1b-full"), None)
        b = None
        if ref is not None:
            fit = [o for o in ours if _mem(o) <= _mem(ref) * MEM_TOL]
            best = min(fit, key=lambda o: o["step_s"]) if fit else None
            ratio = ref["step_s"] / best["step_s"] if best else None
            b = {"ref_mib": round(_mem(ref), 2), "ours": best["system"] if best else None,
                 "speedup": round(ratio, 3) if ratio else None, "holds": bool(ratio and ratio >= 1.2),
                 "stretch_1_3": bool(ratio and ratio >= 1.3)}
        out[f"m={key[0]} jitter={key[1]}"] = {"a_holds": not misses and bool(torch_rows), "a_misses": misses, "b": b}
    jittered = [v for k, v in out.items() if not k.endswith("jitter=0.0")]
    out["c_holds"] = bool(jittered) and all(v["a_holds"] and v["b"] and v["b"]["holds"] for v in jittered)
    return out


def table(rows: list[dict]) -> str:
    keys = sorted({(r["m"], r["jitter"]) for r in rows})
    systems = sorted({r["system"] for r in rows}, key=lambda s: (not s.startswith("torch"), s))
    head = "| system | " + " | ".join(f"m={m} j={j}: step ms [min-max] / peak MiB" for m, j in keys) + " |"
    lines = [head, "|---" * (len(keys) + 1) + "|"]
    for s in systems:
        cells = []
        for key in keys:
            r = next((r for r in rows if r["system"] == s and (r["m"], r["jitter"]) == key), None)
            if r is None:
                cells.append("n/a")
                continue
            flag = "" if r["counts_ok"] else " (counts!)"
            cells.append(f"{r['step_s'] * 1e3:.0f} [{r['step_s_min'] * 1e3:.0f}-{r['step_s_max'] * 1e3:.0f}]"
                         f" / {_mem(r):.1f}{flag}")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chart(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["m"], r["jitter"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 5), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        group = [r for r in rows if (r["m"], r["jitter"]) == key]
        for fw, color in (("torch", "tab:blue"), ("ours", "tab:red")):
            pts = [r for r in group if r["framework"] == fw]
            ax.scatter([_mem(r) for r in pts], [_tput(r) for r in pts], c=color, label=fw, s=18)
            for r in pts:
                ax.annotate(r["system"].split("-", 1)[1], (_mem(r), _tput(r)), fontsize=6)
            front = pareto(pts)
            ax.step([_mem(r) for r in front], [_tput(r) for r in front], where="post", c=color, alpha=0.6)
        ax.set_title(f"P={group[0]['P']} m={key[0]} jitter={key[1]}")
        ax.set_xlabel("peak activation memory, max over stages (MiB)")
        ax.set_ylabel("samples / s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> int:
    stem = None
    if "--stem" in argv:
        i = argv.index("--stem")
        stem, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    paths = argv
    data = [json.load(open(p)) for p in paths]
    rows = [r for d in data for r in d["rows"]]
    stem = stem or os.path.splitext(paths[0])[0]
    result = targets(rows)
    bad = sorted({(r["system"], r["m"]) for r in rows if not r["counts_ok"]})
    unavailable = sorted({(u["system"], u["reason"]) for d in data for u in d.get("unavailable", [])})
    meta = data[0]["meta"]
    md = [f"P={meta['P']}, F={meta['F_s'] * 1e3:.0f} ms, B={meta['B_s'] * 1e3:.0f} ms (I and W B/2 each), "
          f"{meta['repetitions']} interleaved repetitions, commit {meta['commit'][:9]}, load "
          f"{meta['loadavg_start'][0]:.1f} at start, {meta.get('loadavg_end', [0])[0]:.1f} at end.", "",
          table(rows), "", "Counts differ from one recompute per micro-batch: "
          + (", ".join(f"{s} (m={m})" for s, m in bad) or "none") + ".", "",
          "Not available: " + ("; ".join(f"{s}: {why}" for s, why in unavailable) or "none") + ".", "",
          "Targets:", "", "```", json.dumps(result, indent=1), "```"]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    with open(stem + "_targets.json", "w") as f:
        json.dump(result, f, indent=1)
    chart(rows, stem + ".png")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
