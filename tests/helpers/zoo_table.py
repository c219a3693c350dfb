"""Writes the "Tested models" markdown table from the model-zoo results (``tests/models/test_zoo.py``), never by hand.

    VARUNA_ZOO=full VARUNA_ZOO_OUT=/tmp/zoo python -m pytest tests/models/test_zoo.py
    python tests/helpers/zoo_table.py /tmp/zoo -o docs/tested_models.md

A cell is **exact** when every step's loss and every parameter's step-1 gradient match the plain single-process
run within the tolerances of ``tests/helpers/zoo_results.py`` (bf16-mixed: **matches**, losses only), **fails** with the
first problem otherwise, and empty where the pair did not run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the helpers package
from helpers.zoo_models import FAMILIES, block_lists  # noqa: E402
from helpers.zoo_results import CONFIGS, DESCRIPTIONS, applies, judge  # noqa: E402

TITLES = {
    "gpt2": "GPT-2 (`GPT2LMHeadModel`)", "llama": "Llama (`LlamaForCausalLM`)",
    "mistral": "Mistral (`MistralForCausalLM`)", "qwen2": "Qwen2 (`Qwen2ForCausalLM`)",
    "qwen3": "Qwen3 (`Qwen3ForCausalLM`)", "gemma": "Gemma (`GemmaForCausalLM`)",
    "gemma2": "Gemma 2 (`Gemma2ForCausalLM`)", "phi3": "Phi-3 (`Phi3ForCausalLM`)",
    "gpt_neox": "GPT-NeoX (`GPTNeoXForCausalLM`)", "opt": "OPT (`OPTForCausalLM`)",
    "bloom": "BLOOM (`BloomForCausalLM`)", "falcon": "Falcon (`FalconForCausalLM`)",
    "bert": "BERT (`BertForMaskedLM`)", "t5": "T5 (`T5ForConditionalGeneration`)",
    "t5_stacks": "T5, both stacks cut (`T5ForConditionalGeneration`)",
    "bart_stacks": "BART, both stacks cut (`BartForConditionalGeneration`)",
    "vit": "ViT (`ViTForImageClassification`)", "litgpt": "litgpt `GPT` (GPT-NeoX style)",
    "litgpt_llama": "litgpt `GPT` (Llama style)",
    "mixtral": "Mixtral (`MixtralForCausalLM`), MoE",
    "mixtral_deep": "Mixtral, 8 blocks (`MixtralForCausalLM`), MoE",
    "mixtral_eager": "Mixtral, eager experts (`experts_implementation`)",
    "qwen3_moe": "Qwen3-MoE (`Qwen3MoeForCausalLM`)", "olmoe": "OLMoE (`OlmoeForCausalLM`)",
    "mixtral_router": "Mixtral with the router loss, the model's own `loss`",
    "mixtral_router_step": "Mixtral with the router loss, added by the step (`out.aux_loss`)",
    "qwen3_moe_router": "Qwen3-MoE with the router loss", "olmoe_router": "OLMoE with the router loss",
}


def _ran(out: Path, family: str, config: str) -> bool:
    return any(out.glob(f"{family}.{config}.*.json"))


def _cell(out: Path, family: str, config: str, notes: list[str]) -> str:
    if not applies(family, config):
        return "-"
    if not _ran(out, family, config):
        return ""
    verdict = judge(out, family, config)
    if verdict.ok:
        return "exact" if CONFIGS[config][3] is not None else "matches"
    notes.append(f"- {TITLES.get(family, family)}, {DESCRIPTIONS[config]}: {_first_sentence(verdict.problems[0], out)}"
                 + (f"; all-zero gradients: {', '.join(verdict.zeroed[:6])}" if verdict.zeroed else ""))
    return f"fails ({len(notes)})"


def _first_sentence(problem: str, out: Path) -> str:
    """The problem's first sentence, without the results folder's path (it differs between runs)."""
    problem = problem.replace(str(out), "<results>")
    end = problem.find(". ", 60)
    return problem if end < 0 else problem[: end + 1]


def rows(out: Path) -> tuple[list[str], list[str]]:
    """The table's lines and the failure notes its cells refer to."""
    configs = [c for c in CONFIGS if any(_ran(out, f, c) for f in FAMILIES)]
    notes: list[str] = []
    lines = [
        "| architecture | `cut_at` | " + " | ".join(DESCRIPTIONS[c] for c in configs) + " |",
        "|---|---|" + "---|" * len(configs),
    ]
    for name, family in FAMILIES.items():
        cells = [_cell(out, name, c, notes) for c in configs]
        paths = ", ".join(f"`{path}`" for path in block_lists(family.cut_at))
        lines.append(f"| {TITLES.get(name, name)} | {paths} | " + " | ".join(cells) + " |")
    return lines, notes


def table(out: Path) -> str:
    lines, notes = rows(out)
    header = [
        "# Tested models",
        "",
        "Generated from the results of `tests/models/test_zoo.py`, never by hand:",
        "`VARUNA_ZOO=full VARUNA_ZOO_OUT=DIR python -m pytest tests/models/test_zoo.py`, then",
        "`python tests/helpers/zoo_table.py DIR -o docs/tested_models.md --sections README.md docs/user_guide.md`.",
        "Tiny configurations built in code (`tests/helpers/zoo_models.py`), split with `cut_at`, trained 8 AdamW steps",
        "and compared with the plain single-process Trainer: **exact** = every step's loss within 5e-4 and every",
        "parameter's step-1 gradient within 1e-5 (each parameter held by some rank); bf16-mixed: **matches** =",
        "losses within 2e-2. Blocks compiled: each block's `compile()`, as torchtitan does; -: not in the matrix.",
        "",
    ]
    footer = ["", "Failures (first problem):", "", *notes] if notes else []
    return "\n".join(header + lines + footer) + "\n"


START, END = "<!-- tested-models:start -->", "<!-- tested-models:end -->"


def update_section(path: Path, out: Path) -> None:
    """Replaces the table between the markers in ``path`` (the failures are in docs/tested_models.md)."""
    text = path.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{path}: no {START} ... {END} section to update")
    lines, notes = rows(out)
    if notes:
        lines += ["", "Where a cell says *fails*, docs/tested_models.md says why."]
    before, rest = text.split(START, 1)
    after = rest.split(END, 1)[1]
    path.write_text(before + START + "\n" + "\n".join(lines) + "\n" + END + after)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="the folder of VARUNA_ZOO_OUT")
    parser.add_argument("-o", "--output", type=Path, help="the markdown file (default: standard output)")
    parser.add_argument("--sections", type=Path, nargs="*", default=[],
                        help="files whose tested-models section (between markers) gets the table")
    args = parser.parse_args()
    for path in args.sections:
        update_section(path, args.results)
    text = table(args.results)
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
