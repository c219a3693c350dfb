"""Figures of ``benchmarks/autoconfig.py``: agreement of predictions and measurements, the table, the scatter plot."""

from __future__ import annotations

import statistics
from pathlib import Path

MIB = 2**20


def kendall_tau_b(x: list[float], y: list[float]) -> float:
    """Kendall's tau-b between two equally long sequences (ties in either count as neither concordant nor not)."""
    concordant = discordant = ties_x = ties_y = 0
    n = len(x)
    for i in range(n):
        for j in range(i + 1, n):
            dx, dy = x[i] - x[j], y[i] - y[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    denominator = ((concordant + discordant + ties_x) * (concordant + discordant + ties_y)) ** 0.5
    return (concordant - discordant) / denominator if denominator else 0.0


def summarize(result: dict, rounds: int = 1) -> dict:
    """Medians, tau, relative error, the auto choice's regret and peak, how many fits the prediction got right.

    With several rounds, also the measurement's own repeatability: Kendall's tau between the per-round medians of
    every two rounds (``retest_tau``), the ceiling that measurement noise puts on the predicted-measured tau.
    """
    rows, limit = result["rows"], result["memory_limit"]
    for row in rows:
        row["measured_step_s"] = statistics.median(row["steps_s"])
        row["spread_s"] = [min(row["steps_s"]), max(row["steps_s"])]
        row["measured_fits"] = max(row["measured_peak_bytes"]) <= limit
    predicted = [r["predicted_step_s"] for r in rows]
    measured = [r["measured_step_s"] for r in rows]
    errors = [abs(p - m) / m for p, m in zip(predicted, measured, strict=True)]
    chosen = next(r for r in rows if r["predicted_fits"])  # rows are ranked: the first that fits is the choice
    fitting = [r for r in rows if r["measured_fits"]]
    best = min(fitting, key=lambda r: r["measured_step_s"]) if fitting else None
    memory_errors = [max(r["measured_peak_bytes"]) / max(r["predicted_peak_bytes"]) for r in rows]
    per_round = _round_medians(rows, rounds)
    return {
        "rounds": rounds,
        "retest_tau": [kendall_tau_b(per_round[a], per_round[b])
                       for a in range(rounds) for b in range(a + 1, rounds)],
        "kendall_tau_per_round": [kendall_tau_b(predicted, medians) for medians in per_round],
        "configurations": len(rows),
        "kendall_tau": kendall_tau_b(predicted, measured),
        "median_relative_error": statistics.median(errors),
        "chosen": _label(chosen),
        "chosen_measured_step_s": chosen["measured_step_s"],
        "best_measured": _label(best) if best else None,
        "best_measured_step_s": best["measured_step_s"] if best else None,
        "regret": chosen["measured_step_s"] / best["measured_step_s"] if best else None,
        "chosen_measured_peak_bytes": max(chosen["measured_peak_bytes"]),
        "chosen_within_limit": max(chosen["measured_peak_bytes"]) <= limit,
        "predicted_over_limit": sum(not r["predicted_fits"] for r in rows),
        "measured_over_limit": sum(not r["measured_fits"] for r in rows),
        "fit_disagreements": [_label(r) for r in rows if r["predicted_fits"] != r["measured_fits"]],
        "measured_over_predicted_peak_median": statistics.median(memory_errors),
        "measured_over_predicted_peak_range": [min(memory_errors), max(memory_errors)],
    }


def _round_medians(rows: list[dict], rounds: int) -> list[list[float]]:
    """Each round's median step time of every configuration (a round measured each configuration once)."""
    per = len(rows[0]["steps_s"]) // max(1, rounds)
    return [[statistics.median(r["steps_s"][k * per:(k + 1) * per]) for r in rows] for k in range(rounds)]


def _label(row: dict) -> str:
    recompute = "rc" if row["recompute"] else "no-rc"
    return f"{row['P']}x{row['D']} mbs {row['microbatch_size']} m {row['m']} {row['schedule']} {recompute}"


def render(out: dict) -> str:
    s = out["summary"]
    lines = [
        f"Emulated GPT (block_size {out['bench_model']['block_size']}, n_embd {out['bench_model']['n_embd']}, "
        f"{out['bench_model']['n_layer']} layers; compute = profile x {out['args']['scale']}), {out['world_size']} "
        f"processes, {out['devices_per_node']} per node, link {out['args']['link']}"
        + (f" {out['args']['rate']}" if out["args"]["link"] == "netem" else "")
        + f"; global batch {out['args']['global_batch']}; memory limit {out['memory_limit'] / MIB:.1f} MiB per stage.",
        f"Kendall tau {s['kendall_tau']:.3f}; median relative error {s['median_relative_error']:.1%}; "
        f"regret {s['regret']:.3f} (chosen {s['chosen']}: {s['chosen_measured_step_s'] * 1e3:.1f} ms; best within "
        f"the limit {s['best_measured']}: {s['best_measured_step_s'] * 1e3:.1f} ms); chosen peak "
        f"{s['chosen_measured_peak_bytes'] / MIB:.1f} MiB ({'within' if s['chosen_within_limit'] else 'OVER'} the "
        f"limit). Planning in the job: {out['plan_seconds']:.1f} s. Example GPT: profile {out['example_profile_s']:.1f}"
        f" s, search {out['example_search_s']:.2f} s."
        + (f" Per round, predicted vs measured tau {', '.join(f'{t:.3f}' for t in s['kendall_tau_per_round'])};"
           f" measured vs measured between rounds (repeatability) {', '.join(f'{t:.3f}' for t in s['retest_tau'])}."
           if s.get("retest_tau") else ""),
        "",
        "| rank | P x D | mbs | m | schedule | recompute | predicted ms | measured ms (min-max) | error "
        "| predicted peak MiB | measured peak MiB | fits: predicted / measured |",
        "|---:|---|---:|---:|---|---|---:|---:|---:|---|---|---|",
    ]
    for rank, r in enumerate(out["rows"], 1):
        error = r["predicted_step_s"] / r["measured_step_s"] - 1
        lines.append(
            f"| {rank} | {r['P']}x{r['D']} | {r['microbatch_size']} | {r['m']} | {r['schedule']} "
            f"| {'yes' if r['recompute'] else 'no'} | {r['predicted_step_s'] * 1e3:.1f} "
            f"| {r['measured_step_s'] * 1e3:.1f} ({r['spread_s'][0] * 1e3:.0f}-{r['spread_s'][1] * 1e3:.0f}) "
            f"| {error:+.0%} | {'/'.join(f'{b / MIB:.1f}' for b in r['predicted_peak_bytes'])} "
            f"| {'/'.join(f'{b / MIB:.1f}' for b in r['measured_peak_bytes'])} "
            f"| {'yes' if r['predicted_fits'] else 'no'} / {'yes' if r['measured_fits'] else 'no'} |"
        )
    return "\n".join(lines)


def scatter_png(out: dict, path: Path) -> None:
    """Predicted (x) against measured (y) step time, one square per configuration coloured by P, and y = x."""
    from matplotlib.figure import Figure

    rows = out["rows"]
    values = [v * 1e3 for r in rows for v in (r["predicted_step_s"], r["measured_step_s"])]
    low, high = min(values) * 0.95, max(values) * 1.03
    figure = Figure(figsize=(7, 7), dpi=100, layout="constrained")
    ax = figure.subplots()
    ax.plot([low, high], [low, high], color="0.8", zorder=0)
    colors = {1: "tab:green", 2: "tab:blue", 4: "tab:red"}
    for r in rows:
        ax.scatter(r["predicted_step_s"] * 1e3, r["measured_step_s"] * 1e3, marker="s", s=30,
                   color=colors.get(r["P"], "black") if r["predicted_fits"] else "0.7")
    chosen = next(r for r in rows if r["predicted_fits"])
    ax.scatter(chosen["predicted_step_s"] * 1e3, chosen["measured_step_s"] * 1e3, marker="s", s=160,
               facecolors="none", edgecolors="black", label="chosen")
    ax.set(xlim=(low, high), ylim=(low, high), xlabel="predicted step time, ms", ylabel="measured step time, ms",
           title=f"kendall tau {out['summary']['kendall_tau']:.2f}\nP=1 green, P=2 blue, P=4 red;"
                 " grey: predicted over the memory limit")
    ax.legend(loc="upper left")
    figure.savefig(path)
