"""Setup memory of a Hugging Face model built on the meta device, when the dry run runs on placeholder weights.

A model built in ``configure_model()`` under ``VarunaStrategy`` has its parameters on ``meta``. The dry run runs
the step on meta tensors; a step that reads values there (Hugging Face's mask code does when it is given an
``attention_mask``) is run again on the real batch with every weight a zero-stride placeholder
(``lightning_varuna.pipeline.model.meta_init.trace_unmaterialized``). Target: each rank's peak resident memory
through setup is at most its own stage's parameters plus the largest single module, plus 10%.

The model: a ``transformers`` GPT-2 (``GPT2LMHeadModel``) of the big-model benchmark's size
(``benchmarks/big_models.py``: width 2560, 7 blocks, vocabulary 256, 16 positions, tied head; 0.55 B parameters,
2.2 GB in fp32), or a Llama (``LlamaForCausalLM``, width 2560, MLP 6912 (2.7x), 7 blocks, untied head, about as large),
built in ``configure_model()``, split with ``cut_at`` at its blocks, P=2 on 2 torchrun processes, SGD, batch 8 x 16
tokens, 2 micro-batches, ``partition="params"``, weights from a ``param_init_fn``. Steps:

- ``mask``: the step passes ``attention_mask`` (all ones, as a tokenizer gives for unpadded text): the meta dry run
  fails on a value read in the mask code and the placeholder dry run runs (what this benchmark is about);
- ``nomask``: the same without the mask: the dry run runs on meta (the control).

Per rank, as growth of resident memory over the process before the model existed (``VmHWM``, reset after the
imports): the peak at the end of the dry run and at the end of setup (first training step's start), the peak
through 2 steps; the stage's parameter bytes (what the rank holds after setup) and the largest module's (the
module owning the most parameter bytes itself), and which dry run ran (the stage table's line). Each trial is one
torchrun job under ``prlimit --as`` and a watchdog on the job's total proportional set size (``--budget-gib``).

    python benchmarks/meta_setup.py --out benchmarks/results/meta_setup.json
    python benchmarks/meta_setup.py --render    # the table of --out
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from big_models import _available_gib, _reset_peak, _status_mib, run_within_budget  # noqa: E402

GIB, MIB = 2**30, 2**20
VOCAB, TOKENS, BATCH, WIDTH, LAYERS = 256, 16, 8, 2560, 7
CUT_AT = {"gpt2": "model.transformer.h", "llama": "model.model.layers"}


def hf_model(family: str, width: int = WIDTH, layers: int = LAYERS):
    """The family's model at the benchmark's size (under the strategy's ``configure_model``: on meta)."""
    import transformers

    heads = width // 128
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=TOKENS, n_embd=width, n_layer=layers,
                                         n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         bos_token_id=1, eos_token_id=2)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=width, intermediate_size=width * 27 // 10,
                                      num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=64,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM(config)


def init_weights(module) -> None:
    """``param_init_fn``: matrices N(0, 0.02), norm weights 1, biases 0 (what the module owns itself)."""
    import torch

    for name, param in module.named_parameters(recurse=False):
        if param.dim() >= 2:
            torch.nn.init.normal_(param, std=0.02)
        elif name == "weight":
            torch.nn.init.ones_(param)
        else:
            torch.nn.init.zeros_(param)


def largest_module(family: str, width: int, layers: int) -> tuple[str, int]:
    """The module owning the most parameter bytes itself (not through submodules), built on meta."""
    import torch

    with torch.device("meta"):
        model = hf_model(family, width, layers)
    sizes = {name: sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
             for name, m in model.named_modules()}
    name = max(sizes, key=sizes.get)
    return name, sizes[name]


# -- one rank ------------------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_varuna
    from lightning_varuna.pipeline import stage_setup

    torch.set_num_threads(1)
    largest_name, largest_bytes = largest_module(args.family, args.width, args.layers)
    base = _status_mib("VmRSS")
    _reset_peak()
    started = time.perf_counter()
    record: dict = {"rank": int(os.environ["RANK"]), "base_mib": base, "largest_module": largest_name,
                    "largest_module_bytes": largest_bytes}

    # the dry run of a model on meta, measured where the engine calls it
    traced = stage_setup.trace_unmaterialized

    def measured(*a, **k):
        trace, cuts = traced(*a, **k)
        record["dry_run"] = trace.dry_run
        record["dry_run_peak_mib"] = _status_mib("VmHWM") - base
        record["after_dry_run_mib"] = _status_mib("VmRSS") - base
        record["dry_run_s"] = time.perf_counter() - started
        return trace, cuts

    stage_setup.trace_unmaterialized = measured
    mask = args.step == "mask"

    class HFModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:
            if self.model is None:
                self.model = hf_model(args.family, args.width, args.layers)

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            extra = {"attention_mask": torch.ones_like(ids)} if mask else {}
            return self.model(input_ids=ids, labels=ids, **extra).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Probe(pl.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            record["setup_s"] = time.perf_counter() - started
            record["setup_peak_mib"] = _status_mib("VmHWM") - base
            params = {id(p): p for p in pl_module.parameters()}.values()
            record["param_bytes"] = sum(p.numel() * p.element_size() for p in params)
            # buffers with memory (the zero-stride placeholders of other stages' parameters hold one element)
            storages = {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in pl_module.buffers()}
            record["buffer_bytes"] = sum(storages.values())
            record["stage"] = trainer.strategy.topology.stage

        def on_train_end(self, trainer, pl_module) -> None:
            record["peak_mib"] = _status_mib("VmHWM") - base

    strategy = lightning_varuna.VarunaStrategy(pipeline_parallel_size=2, num_microbatches=2,
                                               cut_at=CUT_AT[args.family], partition="params",
                                               param_init_fn=init_weights)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Probe()])
    tokens = torch.randint(VOCAB, (4 * BATCH, TOKENS), generator=torch.Generator().manual_seed(0))
    trainer.fit(HFModule(), DataLoader(TensorDataset(tokens), batch_size=BATCH))
    Path(args.record, f"rank{record['rank']}.json").write_text(json.dumps(record))


# -- a trial: one torchrun job, capped ---------------------------------------------------------------------------
def trial(family: str, step: str, width: int, layers: int, budget_gib: float, timeout: float) -> dict:
    config = {"family": family, "step": step, "width": width, "layers": layers, "procs": 2, "budget_gib": budget_gib}
    while _available_gib() < budget_gib:  # other work on the machine: wait rather than risk its memory
        print(f"  waiting: {_available_gib():.1f} GiB available, the trial may use {budget_gib} GiB", flush=True)
        time.sleep(30)
    config["available_gib_before"] = _available_gib()
    config["loadavg_before"] = list(os.getloadavg())
    with tempfile.TemporaryDirectory() as out:
        command = ["prlimit", f"--as={int((budget_gib + 6) * GIB)}", sys.executable, "-m", "torch.distributed.run",
                   "--standalone", "--nproc-per-node=2", str(Path(__file__).resolve()), "--worker", "--family",
                   family, "--step", step, "--width", str(width), "--layers", str(layers), "--record", out]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2", "PYTHONWARNINGS": "ignore",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        started = time.perf_counter()
        job = run_within_budget(command, env, budget_gib, timeout)
        if job.timed_out:
            config["timed_out"] = True
        output = job.output
        records = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    ok = job.returncode == 0 and not job.killed_over_budget and len(records) == 2
    config.update(ok=ok, killed_over_budget=job.killed_over_budget, returncode=job.returncode,
                  peak_pss_gib=job.peak_pss_gib,
                  wall_s=time.perf_counter() - started, loadavg_after=list(os.getloadavg()), ranks=records)
    if not ok:
        config["output_tail"] = output[-3000:]
    for r in sorted(records, key=lambda r: r["stage"]):
        print(f"  {family} {step:6s} stage {r['stage']}: setup peak {r['setup_peak_mib']:,.0f} MiB"
              f" ({_ratio(r):.3f}x stage + largest module), dry run peak {r['dry_run_peak_mib']:,.0f} MiB,"
              f" dry run: {r['dry_run'][:40]}", flush=True)
    if not ok:
        print(f"  {family} {step}: failed ({job.returncode}, over budget: {job.killed_over_budget})\n"
              f"{output[-3000:]}", flush=True)
    return config


def _ratio(r: dict) -> float:
    return r["setup_peak_mib"] * MIB / (r["param_bytes"] + r["largest_module_bytes"])


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def render(results: dict) -> str:
    """The per-rank table of every trial (``--render``)."""
    lines = ["| model | step | dry run | stage | stage params | largest module | dry-run peak | setup peak |"
             " setup peak / (stage + largest) | peak (2 steps) | setup s |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for t in results.get("trials", []):
        if not t["ok"]:
            lines.append(f"| {t['family']} | {t['step']} | failed ({t['returncode']}) | | | | | | | | |")
            continue
        for r in sorted(t["ranks"], key=lambda r: r["stage"]):
            kind = r["dry_run"].split(" (")[0]
            lines.append(
                f"| {t['family']} | {t['step']} | {kind} | {r['stage']} | {r['param_bytes'] / MIB:,.0f} |"
                f" {r['largest_module_bytes'] / MIB:,.0f} ({r['largest_module']}) | {r['dry_run_peak_mib']:,.0f} |"
                f" {r['setup_peak_mib']:,.0f} | {_ratio(r):.3f} | {r['peak_mib']:,.0f} | {r['setup_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "meta_setup.json"))
    parser.add_argument("--trials", default="gpt2:mask,gpt2:nomask,llama:mask",
                        help="comma list of FAMILY:STEP (families gpt2, llama; steps mask, nomask)")
    parser.add_argument("--runs", type=int, default=1, help="runs of each trial")
    parser.add_argument("--budget-gib", type=float, default=8.0, help="the job's total PSS at most")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per trial")
    parser.add_argument("--width", type=int, default=WIDTH, help="hidden size (the heads are 128 wide)")
    parser.add_argument("--layers", type=int, default=LAYERS, help="blocks")
    parser.add_argument("--render", action="store_true", help="print the table of --out and stop")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("family", "step", "record"):
        parser.add_argument(f"--{name}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    out = Path(args.out)
    if args.render:
        print(render(json.loads(out.read_text())))
        return
    results = {
        "command": "python benchmarks/meta_setup.py " + " ".join(sys.argv[1:]),
        "package_commit": _git("rev-parse", "HEAD"),
        "package_uncommitted_changes": _git("status", "--porcelain", "--", "lightning_varuna"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "mem_total_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB},
        "loadavg_start": list(os.getloadavg()),
        "trials": [],
    }
    for run in range(args.runs):
        for spec in args.trials.split(","):
            family, step = spec.split(":")
            print(f"run {run + 1}/{args.runs}: {family} {step}", flush=True)
            results["trials"].append(trial(family, step, args.width, args.layers, args.budget_gib, args.timeout))
            out.write_text(json.dumps(results, indent=1))
    results["loadavg_end"] = list(os.getloadavg())
    results["table_md"] = render(results)
    out.write_text(json.dumps(results, indent=1))
    print(results["table_md"])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
