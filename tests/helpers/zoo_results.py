"""Running the model-zoo jobs and judging their results against the plain runs (used by tests and the table).

Results live in one folder: ``FAMILY.CONFIG.rankR.json`` per rank (``tests/jobs/zoo.py``), and for a spec whose
job ended without a result on every rank, ``FAMILY.CONFIG.failed.json`` with the error that ended it.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

# configuration -> processes (the jobs group specs by it), its reference, and the tolerances (loss, gradient);
# a gradient tolerance of None: losses only
CONFIGS: dict[str, tuple[int, str, float, float | None]] = {
    "p2": (2, "ref", 5e-4, 1e-5),
    "p4": (4, "ref", 5e-4, 1e-5),
    "p6": (6, "ref", 5e-4, 1e-5),
    "p2d2": (4, "ref", 5e-4, 1e-5),
    "meta-p2": (2, "ref", 5e-4, 1e-5),
    "bf16-p2": (2, "ref-bf16", 2e-2, None),
    "compiled-p2": (2, "ref-compiled", 5e-4, 1e-5),
    "inductor-p2": (2, "ref-inductor", 5e-4, 1e-5),
    "compiled-p4": (4, "ref-compiled", 5e-4, 1e-5),
    "compiled-p2d2": (4, "ref-compiled", 5e-4, 1e-5),
    "compiled-meta-p2": (2, "ref-compiled", 5e-4, 1e-5),
    "compiled-bf16-p2": (2, "ref-compiled-bf16", 2e-2, None),
    "lora-p2": (2, "ref-lora", 5e-4, 1e-5),
    "checkpointing-p2": (2, "ref-checkpointing", 5e-4, 1e-5),
    "eval-p2": (2, "ref", 5e-4, 1e-5),
    "model-compiled-p2": (2, "ref-model-compiled", 5e-4, 1e-5),
    "wrapped-compiled-p2": (2, "ref-wrapped-compiled", 5e-4, 1e-5),
    **{config: (int(config[-1]), "ref", 5e-4, 1e-5) for config in (
        "1f1b-p2", "zero-bubble-p2", "interleaved-p2", "zero-bubble-v-p2", "no-recompute-p2", "1f1b-p4",
        "no-recompute-p4", "interleaved-p4", "zero-bubble-v-p4", "zero-bubble-p4")},
    **{f"{name}-p2d2": (4, "ref", 5e-4, 1e-5)
       for name in ("1f1b", "zero-bubble", "interleaved", "zero-bubble-v", "no-recompute")},
}
MOE = ("mixtral", "mixtral_eager", "qwen3_moe", "olmoe")
"""The mixture-of-experts families: they also run every schedule, and without recompute."""
COMPILED_MATRIX = ("compiled-p4", "compiled-p2d2", "compiled-meta-p2", "compiled-bf16-p2")
"""The rest of the matrix with each block compiled (``aot_eager``), for GPT-2, Llama and litgpt."""
ONLY = {"p6": ("t5_stacks", "bart_stacks"),
        "compiled-p2": ("gpt2", "llama", "t5_stacks", "litgpt", "litgpt_llama"),
        "inductor-p2": ("gpt2", "llama", "t5_stacks", "litgpt", "litgpt_llama"),
        **{config: ("gpt2", "llama", "litgpt") for config in COMPILED_MATRIX},
        "lora-p2": ("gpt2", "llama"), "checkpointing-p2": ("gpt2", "llama"),
        "eval-p2": ("gpt2", "llama", "bert", "vit", "litgpt"),
        "model-compiled-p2": ("gpt2", "llama", "t5_stacks", "litgpt"),
        "wrapped-compiled-p2": ("gpt2", "llama", "t5_stacks", "litgpt"),
        **{config: MOE for config in ("1f1b-p2", "zero-bubble-p2", "interleaved-p2", "zero-bubble-v-p2",
                                      "no-recompute-p2", "1f1b-p4", "no-recompute-p4")},
        "interleaved-p4": ("mixtral_deep",), "zero-bubble-v-p4": ("mixtral_deep",),
        # the rest of the schedule x layout matrix for the mixture of experts CI runs (Mixtral)
        **{config: ("mixtral",) for config in ("zero-bubble-p4", "1f1b-p2d2", "zero-bubble-p2d2", "interleaved-p2d2",
                                               "zero-bubble-v-p2d2", "no-recompute-p2d2")}}
"""Configurations run for some families only."""
COMPILED = ("compiled-p2", "inductor-p2", *COMPILED_MATRIX, "model-compiled-p2", "wrapped-compiled-p2")
WHOLE_MODEL_COMPILED = ("model-compiled-p2", "wrapped-compiled-p2")
"""The whole third-party model compiled, not each block: its graphs also break where it calls another stage's stood-in
module (a stand-in runs as Python, uncompiled, by design)."""
DESCRIPTIONS = {
    "p2": "P=2, built in `__init__`",
    "p4": "P=4, built in `__init__`",
    "p6": "P=6, built in `__init__` (encoder-decoders: one block per stage)",
    "p2d2": "P=2 x D=2, built in `__init__`",
    "meta-p2": "P=2, built on meta in `configure_model`, `initial_weights`",
    "bf16-p2": "P=2, bf16-mixed",
    "compiled-p2": "P=2, blocks compiled (`aot_eager`)",
    "inductor-p2": "P=2, blocks compiled (`inductor`)",
    "compiled-p4": "P=4, blocks compiled (`aot_eager`)",
    "compiled-p2d2": "P=2 x D=2, blocks compiled (`aot_eager`)",
    "compiled-meta-p2": "P=2, built on meta in `configure_model` and its blocks compiled there (`aot_eager`)",
    "compiled-bf16-p2": "P=2, bf16-mixed, blocks compiled (`aot_eager`)",
    "lora-p2": "P=2, peft LoRA adapters, base frozen",
    "checkpointing-p2": "P=2, `gradient_checkpointing_enable()`",
    "eval-p2": "P=2, then `validate` and `predict`",
    "model-compiled-p2": "P=2, whole model compiled (`self.model.compile()`, `aot_eager`)",
    "wrapped-compiled-p2": "P=2, whole model compiled (`torch.compile(self.model)`, `aot_eager`)",
    "1f1b-p2": "P=2, `schedule=\"1f1b\"`",
    "zero-bubble-p2": "P=2, `schedule=\"zero-bubble\"`",
    "interleaved-p2": "P=2, `schedule=\"interleaved\"`, two stages per rank",
    "zero-bubble-v-p2": "P=2, `schedule=\"zero-bubble-v\"`, two stages per rank",
    "no-recompute-p2": "P=2, `recompute=False`",
    "1f1b-p4": "P=4, `schedule=\"1f1b\"`",
    "no-recompute-p4": "P=4, `recompute=False`",
    "interleaved-p4": "P=4, `schedule=\"interleaved\"`, two stages per rank",
    "zero-bubble-v-p4": "P=4, `schedule=\"zero-bubble-v\"`, two stages per rank",
    "zero-bubble-p4": "P=4, `schedule=\"zero-bubble\"`",
    "1f1b-p2d2": "P=2 x D=2, `schedule=\"1f1b\"`",
    "zero-bubble-p2d2": "P=2 x D=2, `schedule=\"zero-bubble\"`",
    "interleaved-p2d2": "P=2 x D=2, `schedule=\"interleaved\"`, two stages per rank",
    "zero-bubble-v-p2d2": "P=2 x D=2, `schedule=\"zero-bubble-v\"`, two stages per rank",
    "no-recompute-p2d2": "P=2 x D=2, `recompute=False`",
}
ROUTER = ("mixtral_router", "mixtral_router_step", "qwen3_moe_router", "olmoe_router")
"""The mixtures of experts trained with their router loss (the model's own loss, and a step that adds it)."""
ROUTER_CONFIGS = ("p2", "p4", "p2d2", "1f1b-p2", "zero-bubble-p2", "interleaved-p2", "zero-bubble-v-p2", "1f1b-p4",
                  "zero-bubble-p4", "1f1b-p2d2", "interleaved-p2d2", "zero-bubble-v-p2d2")
"""What they run: the layouts and every schedule (the plain run's router loss is not a mean over samples, so each
compares with the plain run of the same micro-batches, :func:`reference_of`)."""
SPLITS = {"p2d2": "2x2", **{f"{name}-p2d2": "2x2" for name in ("1f1b", "zero-bubble", "interleaved",
                                                               "zero-bubble-v", "no-recompute")},
          "zero-bubble-v-p4": "8"}
"""The micro-batches of a configuration, as ``tests/jobs/zoo.py``'s ``ref-splitS`` names them (default ``"4"``)."""
CI_CONFIGS = {"p2": None, "compiled-p2": ("llama",)}
"""What CI runs: each configuration for these families (``None``: every family); the rest with ``VARUNA_ZOO=full``."""


ON_DEMAND_FAMILIES = ("mixtral_deep", "mixtral_eager", "qwen3_moe", "olmoe", "qwen3_moe_router", "olmoe_router")
"""Families CI leaves out (the same experts code as Mixtral, whose P=2 CI runs): they run with the full matrix."""


def reference_of(family: str, config: str) -> str:
    """The plain run a family's configuration is compared with: for a loss that is not a mean over samples (the
    router loss), the plain run of the same micro-batches (each one's loss weighted by its size)."""
    reference = CONFIGS[config][1]
    if family in ROUTER and reference == "ref":
        return f"ref-split{SPLITS.get(config, '4')}"
    return reference


def in_ci(family: str, config: str) -> bool:
    """Whether CI runs ``family`` x ``config`` (the full matrix runs on demand)."""
    return (config in CI_CONFIGS and family not in ON_DEMAND_FAMILIES
            and (CI_CONFIGS[config] is None or family in CI_CONFIGS[config]))


def applies(family: str, config: str) -> bool:
    """Whether the configuration is run for the family (see :data:`ONLY`)."""
    if family in ROUTER:
        return config in ROUTER_CONFIGS
    return family in ONLY.get(config, (family,))
STEPS = 8


@dataclass
class Verdict:
    """What a run of one family under one configuration showed, compared with its reference."""

    ok: bool
    problems: list[str] = field(default_factory=list)
    loss_diff: float | None = None
    grad_diff: float | None = None
    worst_param: str | None = None
    stages: dict[str, int] = field(default_factory=dict)  # parameter -> a stage holding it
    differing: list[str] = field(default_factory=list)  # parameters whose gradients differ beyond the tolerance
    zeroed: list[str] = field(default_factory=list)  # parameters with an all-zero gradient where the reference's is not

    def summary(self) -> str:
        if self.ok:
            text = f"max loss diff {self.loss_diff:.1e}"
            return text + (f", max grad diff {self.grad_diff:.1e}" if self.grad_diff is not None else "")
        return self.problems[0]


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def processes_of(config: str) -> int:
    """How many processes a configuration's job runs: a reference (``ref``, ``ref-bf16``, ...) runs one."""
    return CONFIGS[config][0] if config in CONFIGS else 1


def ranks(out: Path, family: str, config: str) -> list[dict | None]:
    return [_load(out / f"{family}.{config}.rank{r}.json") for r in range(processes_of(config))]


def error_of(out: Path, family: str, config: str) -> str | None:
    """The first error a rank recorded for the spec, or the launcher's note of a job that ended without one."""
    for run in ranks(out, family, config):
        if run is not None and "error" in run:
            return run["error"]
    failed = _load(out / f"{family}.{config}.failed.json")
    return failed["error"] if failed is not None else None


ROUTER_MARGIN = 1e-5
"""A mixture of experts is compared in fp32 only where the reference's router logits separate the chosen experts from
the others by at least this much at every token and step (``router_margin`` of ``tests/jobs/zoo.py``): the pipelined
run's logits differ from the plain run's by fp32 rounding (its losses by at most 5e-7), too little to flip an expert
there. The families' seeds give at least 2.5e-5 (bf16-mixed, compared by losses only, is not held to it)."""


def judge(out: Path, family: str, config: str) -> Verdict:
    """Compares every rank's losses (all steps) and step-1 gradients (per parameter) with the reference run's."""
    processes, _, loss_tolerance, grad_tolerance = CONFIGS[config]
    reference_name = reference_of(family, config)
    reference = _load(out / f"{family}.{reference_name}.rank0.json")
    if reference is None or "error" in reference:
        return Verdict(False, [f"reference failed: {error_of(out, family, reference_name) or 'no result'}"])
    error = error_of(out, family, config)
    if error is not None:
        return Verdict(False, [error])
    verdict = Verdict(True, loss_diff=0.0, grad_diff=0.0 if grad_tolerance is not None else None)
    margin = reference.get("router_margin")
    if margin is not None and grad_tolerance is not None and margin < ROUTER_MARGIN:
        verdict.problems.append(f"the reference's top-k routing has a near tie (logit gap {margin:.1e} <"
                                f" {ROUTER_MARGIN:.0e}): choose another seed, never a looser tolerance")
    worst_per_param: dict[str, float] = {}
    for rank, run in enumerate(ranks(out, family, config)):
        if run is None:
            verdict.problems.append(f"rank {rank}: no result")
            continue
        if len(run["losses"]) != len(reference["losses"]) or len(run["losses"]) != STEPS:
            verdict.problems.append(f"rank {rank}: {len(run['losses'])} losses, reference {len(reference['losses'])}")
        if len(run.get("router_losses", [])) != len(reference.get("router_losses", [])):
            verdict.problems.append(f"rank {rank}: {len(run.get('router_losses', []))} router losses logged,"
                                    f" reference {len(reference.get('router_losses', []))}")
        for name in ("losses", "router_losses"):
            for step, (got, want) in enumerate(zip(run.get(name, []), reference.get(name, []))):
                diff = abs(got - want)
                verdict.loss_diff = max(verdict.loss_diff, diff)
                if diff > loss_tolerance:
                    verdict.problems.append(f"rank {rank} step {step}: {name[:-2]} {got:.6f} != {want:.6f}"
                                            f" (diff {diff:.2e})")
        for param, grad in run["grads"].items():
            verdict.stages.setdefault(param, run["stage"])
            want = reference["grads"].get(param)
            if want is None or len(want) != len(grad):
                verdict.problems.append(f"rank {rank}: gradient of {param} not in the reference (or its shape)")
                continue
            worst = max(abs(a - b) for a, b in zip(grad, want))
            if not any(grad) and any(want) and param not in verdict.zeroed:
                verdict.zeroed.append(param)
            worst_per_param[param] = max(worst, worst_per_param.get(param, 0.0))
    if config == "eval-p2":
        verdict.problems += evaluation_problems(reference, ranks(out, family, config), loss_tolerance)
    if config in COMPILED:
        plain_breaks = (reference.get("compile") or {}).get("graph_breaks", [])
        for rank, run in enumerate(ranks(out, family, config)):
            if run is not None:
                problems = compile_problems(run.get("compile"), plain_breaks, stand_ins=config in WHOLE_MODEL_COMPILED)
                verdict.problems += [f"rank {rank}: {problem}" for problem in problems]
    missing = sorted(set(reference["grads"]) - set(worst_per_param))
    if missing:
        verdict.problems.append(f"{len(missing)} parameters held by no rank, e.g. {missing[:3]}")
    if grad_tolerance is not None and worst_per_param:
        verdict.worst_param = max(worst_per_param, key=worst_per_param.get)
        verdict.grad_diff = worst_per_param[verdict.worst_param]
        verdict.differing = sorted(p for p, d in worst_per_param.items() if d > grad_tolerance)
        if verdict.differing:
            verdict.problems.insert(0, f"{len(verdict.differing)} gradients differ, worst {verdict.worst_param} "
                                       f"by {verdict.grad_diff:.2e} (stage {verdict.stages[verdict.worst_param]})")
    verdict.ok = not verdict.problems
    return verdict


def specs_of(out: Path, specs: list[str]) -> list[str]:
    """The specs without a result or a recorded error on every rank yet."""
    left = []
    for spec in specs:
        family, _, config = spec.partition(":")
        done = (out / f"{family}.{config}.failed.json").exists() or all(
            (out / f"{family}.{config}.rank{r}.json").exists() for r in range(processes_of(config)))
        if not done:
            left.append(spec)
    return left


def run_specs(out: Path, specs: list[str], launch) -> None:
    """Runs ``specs`` with ``launch(*specs)`` (a job of ``tests/jobs/zoo.py`` returning its CompletedProcess)
    until each has a result or an error: a job ends at its first failing spec, so the next job starts after it.
    """
    left = specs_of(out, specs)
    while left:
        for spec in left:  # markers of an earlier job
            (out / f"{spec.replace(':', '.')}.started").unlink(missing_ok=True)
        job: subprocess.CompletedProcess = launch(str(out), *left)
        started = [s for s in left if (out / f"{s.replace(':', '.')}.started").exists()]
        now_left = specs_of(out, left)
        # the job ended in the last spec it started: done if every rank recorded its error, else failed here
        failing = started[-1] if started else now_left[0] if now_left else None
        if failing in now_left:
            family, _, config = failing.partition(":")
            error = error_of(out, family, config) or _first_error(job.stderr) or f"job exited with {job.returncode}"
            (out / f"{family}.{config}.failed.json").write_text(json.dumps(
                {"error": error, "rc": job.returncode, "stderr": job.stderr[-20000:]}))
        left = specs_of(out, now_left)


def _first_error(stderr: str) -> str | None:
    for line in stderr.splitlines():
        if re.match(r"^\w*(Error|Exception|Timeout)\w*:", line.strip()) or "Fatal Python error" in line:
            return line.strip()
    return None


def compile_problems(stats: dict | None, plain_breaks: list[str] = (), stand_ins: bool = False) -> list[str]:
    """What the compiler counters of a rank with compiled blocks show wrong (``tests/jobs/zoo.py`` records them).

    Every block the rank runs for real (or, for a whole compiled model, the model) went through a compiled graph;
    graphs break only where a cut point hands its tensor over (the compiler-disabled hand-over), where the plain
    compiled run's graphs break too (``plain_breaks``), and with ``stand_ins`` where a whole compiled model calls
    a stood-in module; never inside a block; nothing is compiled after the first step (no recompilation per
    micro-batch or per stage).
    """
    if stats is None:
        return ["no compiler counters recorded"]
    problems = []
    if stats["graphs_after_first_step"] < 1 or not stats["owned_blocks"]:
        problems.append(f"no compiled graph for its blocks ({stats})")
    if stats["uncompiled_owned_blocks"]:
        never = stats["uncompiled_owned_blocks"]
        problems.append(f"blocks it holds that never ran through their compiled call: {never}")
    if stats["graphs_at_end"] != stats["graphs_after_first_step"]:
        problems.append(f"recompiled after the first step: {stats['graphs_after_first_step']} graphs, then"
                        f" {stats['graphs_at_end']}")
    others = [reason for reason in stats["graph_breaks"] if "_report" not in reason and reason not in plain_breaks
              and not (stand_ins and "StandIn.__call__" in reason)]
    if others:
        problems.append(f"graph breaks other than at cut points: {others[:2]}")
    return problems


PREDICTION_TOLERANCE = 1e-4
"""Logits after 8 steps: the trained weights differ from the plain run's by fp32 rounding only."""


def evaluation_problems(reference: dict, runs: list[dict | None], loss_tolerance: float) -> list[str]:
    """``trainer.validate`` and ``trainer.predict`` on the split model give the plain run's loss and logits."""
    problems = []
    for rank, run in enumerate(runs):
        if run is None or "val_loss" not in run:
            problems.append(f"rank {rank}: no validation or prediction recorded")
            continue
        if abs(run["val_loss"] - reference["val_loss"]) > loss_tolerance:
            problems.append(f"rank {rank}: val_loss {run['val_loss']:.6f} != {reference['val_loss']:.6f}")
        got, want = run["predictions"], reference["predictions"]
        worst = max((abs(a - b) for a, b in zip(got, want)), default=float("inf"))
        if len(got) != len(want) or worst > PREDICTION_TOLERANCE:
            problems.append(f"rank {rank}: predictions differ by {worst:.2e} ({len(got)} values, {len(want)} wanted)")
    return problems
