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

Targets, per (P, m, jitter):
  (a) front dominance: for every torch point, one of ours at no more memory (2% tolerance, the memory
      probe's resolution) whose median step is no slower than torch's slowest repetition (within the spread);
      the miss is ours' best step at that memory / torch's median step - 1.
  (b) at the memory of torch's checkpointed 1F1B or less, our best throughput >= 1.2x its (stretch 1.3x), and
      our best measured step within 1.1x of the simulator's best step over the same systems (each of ours that
      measured at that memory or less, its list simulated by ``lightning_varuna``'s simulator with the run's F,
      B = I + W, the recompute of its degree, the run-time rules on, the V's local edge free, and per message a
      delay drawn from U(0, jitter F) as the emulation draws it: the mean over 8 seeds).
  (c) (a) and (b) with jitter 0.5.
"""

from __future__ import annotations

import json
import os
import sys

MEM_TOL = 1.02
SIM_SEEDS = 8


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


def _key(row: dict) -> tuple[int, int, float]:
    return row["P"], row["m"], row["jitter"]


def _label(key: tuple[int, int, float]) -> str:
    return f"P={key[0]} m={key[1]} jitter={key[2]}"


def _uniform_delays(draw, spread: float):
    """Per message (src, dst, kind, micro-batch) one delay from U(0, spread), the same each time it is asked."""
    drawn: dict = {}
    return lambda *message: drawn.setdefault(message, draw.random() * spread)


def simulated_step(row: dict) -> float:
    """Our system's step time as the simulator predicts it for the run of ``row`` (module docstring, (b))."""
    import random

    from schedules import OURS

    from lightning_varuna.pipeline.scheduling.schedules import make_schedule, stage_ranks
    from lightning_varuna.pipeline.scheduling.simulator import StageCosts, simulate

    kwargs = OURS[row["system"]]
    P, m, v, recompute = row["P"], row["m"], int(kwargs.get("stages_per_rank", 1)), kwargs["recompute"]
    degree = not isinstance(recompute, bool)  # 1 == True: a degree is told apart by its type
    schedule = make_schedule(kwargs["schedule"], P, m, recompute is not False, stages_per_rank=v,
                             forwards_keep_graphs=degree)
    forward, layers = row["F_s"] / v, row["layers_per_chunk"]
    redone = forward * (min(int(recompute), layers) / layers if degree else 1.0)
    if kwargs.get("recompute_policy") is not None:  # selective: the emulated op's output is kept, not rerun
        redone = 0.0
    costs = [StageCosts(forward=forward, backward=row["B_s"] / v, recompute=redone)] * (P * v)
    spread = row["jitter"] * row["F_s"]
    times = []
    for seed in range(SIM_SEEDS if spread else 1):
        jitter = _uniform_delays(random.Random(seed), spread) if spread else None
        times.append(simulate(schedule, costs, jitter=jitter, opportunistic=True,
                              stage_ranks=stage_ranks(P, v, kwargs["schedule"]),
                              forwards_stash=(lambda stage: False) if degree else None).makespan)
    return sum(times) / len(times)


def targets(rows: list[dict]) -> dict:
    """The issue's targets evaluated per (P, m, jitter); see the module docstring."""
    out = {}
    for key in sorted({_key(r) for r in rows}):
        group = [r for r in rows if _key(r) == key]
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
            simulated = {o["system"]: simulated_step(o) for o in fit}
            sim_best = min(simulated, key=simulated.get) if simulated else None
            over_sim = best["step_s"] / simulated[sim_best] if best else None
            b = {"ref_mib": round(_mem(ref), 2), "ours": best["system"] if best else None,
                 "speedup": round(ratio, 3) if ratio else None, "holds": bool(ratio and ratio >= 1.2),
                 "stretch_1_3": bool(ratio and ratio >= 1.3),
                 "sim_best": sim_best, "sim_best_step_ms": round(simulated[sim_best] * 1e3, 1) if sim_best else None,
                 "measured_over_sim": round(over_sim, 3) if over_sim else None,
                 "within_1_1_of_sim": bool(over_sim and over_sim <= 1.1)}
        out[_label(key)] = {"a_holds": not misses and bool(torch_rows), "a_misses": misses, "b": b}
    jittered = [v for k, v in out.items() if not k.endswith("jitter=0.0")]
    out["c_holds"] = bool(jittered) and all(v["a_holds"] and v["b"] and v["b"]["holds"]
                                            and v["b"]["within_1_1_of_sim"] for v in jittered)
    return out


def table(rows: list[dict]) -> str:
    keys = sorted({_key(r) for r in rows})
    systems = sorted({r["system"] for r in rows}, key=lambda s: (not s.startswith("torch"), s))
    pipelines = {k[0] for k in keys}
    shown = [f"{f'P={P} ' if len(pipelines) > 1 else ''}m={m} j={j}" for P, m, j in keys]
    head = "| system | " + " | ".join(f"{k}: step ms [min-max] / peak MiB" for k in shown) + " |"
    lines = [head, "|---" * (len(keys) + 1) + "|"]
    for s in systems:
        cells = []
        for key in keys:
            r = next((r for r in rows if r["system"] == s and _key(r) == key), None)
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

    keys = sorted({_key(r) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 5), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        group = [r for r in rows if _key(r) == key]
        for fw, color in (("torch", "tab:blue"), ("ours", "tab:red")):
            pts = [r for r in group if r["framework"] == fw]
            ax.scatter([_mem(r) for r in pts], [_tput(r) for r in pts], c=color, label=fw, s=18)
            for r in pts:
                ax.annotate(r["system"].split("-", 1)[1], (_mem(r), _tput(r)), fontsize=6)
            front = pareto(pts)
            ax.step([_mem(r) for r in front], [_tput(r) for r in front], where="post", c=color, alpha=0.6)
        ax.set_title(_label(key))
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
    # each row with its run's F, B and layers per chunk (the simulator's costs)
    rows = [{**r, **{k: d["meta"][k] for k in ("F_s", "B_s", "layers_per_chunk")}} for d in data for r in d["rows"]]
    stem = stem or os.path.splitext(paths[0])[0]
    result = targets(rows)
    bad = sorted({(r["system"], r["m"]) for r in rows if not r["counts_ok"]})
    unavailable = sorted({(u["system"], u["reason"]) for d in data for u in d.get("unavailable", [])})
    meta = data[0]["meta"]
    runs = [f"- `{os.path.basename(p)}`: P={d['meta']['P']}, F={d['meta']['F_s'] * 1e3:.0f} ms, B="
            f"{d['meta']['B_s'] * 1e3:.0f} ms (I and W B/2 each), {d['meta']['layers_per_chunk']} layers per chunk, "
            f"m={d['meta']['microbatches']}, {d['meta']['repetitions']} interleaved repetitions, commit "
            f"{d['meta']['commit'][:9]}, load {d['meta']['loadavg_start'][0]:.1f} at start, "
            f"{d['meta'].get('loadavg_end', [0])[0]:.1f} at end, {d['meta'].get('wall_s', 0):.0f} s"
            for p, d in zip(paths, data, strict=True)]
    md = [f"{meta['cpus']} CPUs, torch {meta['torch']}. Runs:", "", *runs, "",
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
