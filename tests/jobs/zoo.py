"""Trains model-zoo families (``tests/helpers/zoo_models.py``) under one configuration each and records what happened.

    python tests/jobs/zoo.py OUT llama:ref gpt2:ref-bf16 ...               # plain one-process references
    torchrun --nproc-per-node=2 tests/jobs/zoo.py OUT llama:p2 gpt2:meta-p2 ...

A reference run also writes the family's weights as a Hugging Face folder, ``OUT/weights/FAMILY`` (read by the
``meta-*`` configurations through ``initial_weights``). Every spec writes ``OUT/FAMILY.CONFIG.rankR.json``:
losses of every step, every held parameter's gradient at step 1 (by name), the stage and replica of the rank,
seconds; or ``{"error": ...}``, after which the process ends (a rank that fails leaves the others waiting: the
launcher starts a new job for the specs not yet run). ``OUT/FAMILY.CONFIG.started`` marks the spec in progress.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.zoo_models import (  # noqa: E402
    BATCH,
    FAMILIES,
    STEPS,
    ZooModule,
    block_lists,
    dataset,
    save_weights,
    variant_cut_at,
    watch_routers,
)
from spec import job_command_line  # noqa: E402

import lightning_varuna  # noqa: E402

SPLITS = {"4": (4, 1), "8": (8, 1), "2x2": (2, 2)}
"""The plain references of a loss that is not a mean over samples (``ref-splitS``): the micro-batches the pipelined
runs split each batch into, ``(micro-batches per replica, replicas)``."""


def split_of(micro: int, replicas: int) -> list[torch.Tensor]:
    """The samples of each micro-batch of a batch of the plain run, as the pipelined runs split it.

    Replica ``r`` reads every ``replicas``-th sample of the global batch from the ``r``-th (``ElasticBatchSampler``),
    and cuts its batch into ``micro`` contiguous parts (``split_batch``).
    """
    per_replica = BATCH // replicas
    size = per_replica // micro
    return [torch.arange(r, BATCH, replicas)[j * size:(j + 1) * size] for r in range(replicas) for j in range(micro)]


# configuration -> (P, micro-batches, batch per replica, precision, built in, compiler backend of the blocks)
CONFIGS = {
    "p2": (2, 4, BATCH, "32-true", "init", None),
    "p4": (4, 4, BATCH, "32-true", "init", None),
    "p6": (6, 4, BATCH, "32-true", "init", None),
    "p2d2": (2, 2, BATCH // 2, "32-true", "init", None),
    "meta-p2": (2, 4, BATCH, "32-true", "configure_model", None),
    "bf16-p2": (2, 4, BATCH, "bf16-mixed", "init", None),
    "compiled-p2": (2, 4, BATCH, "32-true", "init", "aot_eager"),
    "inductor-p2": (2, 4, BATCH, "32-true", "init", "inductor"),
    "compiled-p4": (4, 4, BATCH, "32-true", "init", "aot_eager"),
    "compiled-p2d2": (2, 2, BATCH // 2, "32-true", "init", "aot_eager"),
    "compiled-meta-p2": (2, 4, BATCH, "32-true", "configure_model", "aot_eager"),
    "compiled-bf16-p2": (2, 4, BATCH, "bf16-mixed", "init", "aot_eager"),
    "ref-compiled-bf16": (1, 1, BATCH, "bf16-mixed", "init", "aot_eager"),
    "ref": (1, 1, BATCH, "32-true", "init", None),
    **{f"ref-split{split}": (1, 1, BATCH, "32-true", "init", None) for split in SPLITS},
    "ref-bf16": (1, 1, BATCH, "bf16-mixed", "init", None),
    "ref-compiled": (1, 1, BATCH, "32-true", "init", "aot_eager"),
    "ref-inductor": (1, 1, BATCH, "32-true", "init", "inductor"),
    "lora-p2": (2, 4, BATCH, "32-true", "init", None),
    "checkpointing-p2": (2, 4, BATCH, "32-true", "init", None),
    "ref-lora": (1, 1, BATCH, "32-true", "init", None),
    "ref-checkpointing": (1, 1, BATCH, "32-true", "init", None),
    "eval-p2": (2, 4, BATCH, "32-true", "init", None),
    "model-compiled-p2": (2, 4, BATCH, "32-true", "init", "aot_eager"),
    "wrapped-compiled-p2": (2, 4, BATCH, "32-true", "init", "aot_eager"),
    "ref-model-compiled": (1, 1, BATCH, "32-true", "init", "aot_eager"),
    "ref-wrapped-compiled": (1, 1, BATCH, "32-true", "init", "aot_eager"),
    "1f1b-p2": (2, 4, BATCH, "32-true", "init", None),
    "zero-bubble-p2": (2, 4, BATCH, "32-true", "init", None),
    "interleaved-p2": (2, 4, BATCH, "32-true", "init", None),
    "zero-bubble-v-p2": (2, 4, BATCH, "32-true", "init", None),
    "no-recompute-p2": (2, 4, BATCH, "32-true", "init", None),
    "1f1b-p4": (4, 4, BATCH, "32-true", "init", None),
    "no-recompute-p4": (4, 4, BATCH, "32-true", "init", None),
    "interleaved-p4": (4, 4, BATCH, "32-true", "init", None),
    "zero-bubble-p4": (4, 4, BATCH, "32-true", "init", None),
    **{f"{name}-p2d2": (2, 2, BATCH // 2, "32-true", "init", None)
       for name in ("1f1b", "zero-bubble", "interleaved", "zero-bubble-v", "no-recompute")},
    "zero-bubble-v-p4": (4, 8, BATCH, "32-true", "init", None),
}
SCHEDULES = {
    "1f1b-p2": dict(schedule="1f1b"), "zero-bubble-p2": dict(schedule="zero-bubble"),
    "interleaved-p2": dict(schedule="interleaved", stages_per_rank=2),
    "zero-bubble-v-p2": dict(schedule="zero-bubble-v", stages_per_rank=2),
    "no-recompute-p2": dict(recompute=False), "1f1b-p4": dict(schedule="1f1b"),
    "no-recompute-p4": dict(recompute=False),
    "interleaved-p4": dict(schedule="interleaved", stages_per_rank=2),
    "zero-bubble-p4": dict(schedule="zero-bubble"),
    "1f1b-p2d2": dict(schedule="1f1b"), "zero-bubble-p2d2": dict(schedule="zero-bubble"),
    "interleaved-p2d2": dict(schedule="interleaved", stages_per_rank=2),
    "zero-bubble-v-p2d2": dict(schedule="zero-bubble-v", stages_per_rank=2),
    "no-recompute-p2d2": dict(recompute=False),
    "zero-bubble-v-p4": dict(schedule="zero-bubble-v", stages_per_rank=2),
}
"""Configurations that run another schedule than the default (varuna), or without recompute (two chunks per rank:
the 4 blocks make 4 stages at P=2)."""
COMPILE_SCOPES = {"model-compiled-p2": "model", "ref-model-compiled": "model",
                  "wrapped-compiled-p2": "wrapped", "ref-wrapped-compiled": "wrapped"}
"""What a configuration with a backend compiles (default: each block in place, ``"blocks"``): ``"model"``, the whole
third-party model in place (``self.model.compile()``); ``"wrapped"``, the same through ``self.model =
torch.compile(self.model)``."""
EVALUATED = ("eval-p2", "ref")
"""Configurations that also validate and predict after fit (the reference always does, for them to compare)."""
VARIANTS = {"lora-p2": "lora", "ref-lora": "lora", "checkpointing-p2": "checkpointing",
            "ref-checkpointing": "checkpointing"}
"""Configurations whose model is wrapped (peft LoRA) or set up (HF gradient checkpointing) as users do."""
HANG_S = 240  # a spec that takes longer dumps its stacks and ends the process


class Recorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.router_losses: list[float] = []
        self.grads: dict[str, list[float]] = {}
        self.compiled_calls: list[int] = []
        self.compiled_modules = None  # () -> the compiled modules whose calls are counted (set with a backend)
        self.counted: list = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == 0:
            self.grads = {n: p.grad.detach().float().flatten().tolist()
                          for n, p in pl_module.named_parameters() if p.grad is not None}

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.compiled_modules is not None:  # a model built in configure_model has its blocks only now
            self.counted = self.compiled_modules()
            self.compiled_calls = count_compiled_calls(self.counted)

    def on_train_start(self, trainer, pl_module) -> None:
        self.compiled_calls[:] = [0] * len(self.compiled_calls)  # the dry run's calls (run eagerly) do not count

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        if "router_loss" in trainer.callback_metrics:
            self.router_losses.append(float(trainer.callback_metrics["router_loss"]))
        if trainer.global_step == 1:
            self.graphs_after_first_step = counters["stats"]["unique_graphs"]


def count_compiled_calls(modules: list) -> list[int]:
    """Counts, per module, the calls that go through its compiled call (``Module.compile``'s entry, or the
    ``forward`` of ``torch.compile``'s wrapper)."""
    calls = [0] * len(modules)
    for i, module in enumerate(modules):
        attribute = "forward" if isinstance(module, torch._dynamo.eval_frame.OptimizedModule) else "_compiled_call_impl"
        compiled = getattr(module, attribute)
        if compiled is None:  # a stood-in block, set up by the strategy after compile(): nothing to count
            continue

        def counted(*args, i=i, compiled=compiled, **kwargs):
            calls[i] += 1
            return compiled(*args, **kwargs)

        setattr(module, attribute, counted)
    return calls


def blocks_of(model: ZooModule) -> list:
    """The blocks of every block list the family is cut at."""
    return [block for path in block_lists(model.family.cut_at) for block in model.get_submodule(path)]


def compile_stats(recorder: Recorder, blocks: list, calls: list[int]) -> dict:
    """The compiler's counters, and whether each block this rank holds ran through its compiled call."""
    owned = [i for i, block in enumerate(blocks) if next(block.parameters(), None) is not None]
    return {
        "graphs_after_first_step": recorder.graphs_after_first_step,
        "graphs_at_end": counters["stats"]["unique_graphs"],
        "graph_breaks": sorted(" ".join(reason.split())[:300] for reason in counters["graph_break"]),
        "owned_blocks": owned,
        "uncompiled_owned_blocks": [i for i in owned if calls[i] == 0],
    }


def run(out: Path, spec: str) -> None:
    family_name, _, config = spec.partition(":")
    family = FAMILIES[family_name]
    stages, microbatches, batch, precision, build_in, backend = CONFIGS[config]
    reference = config.startswith("ref")
    weights = out / "weights" / family_name
    if reference and config == "ref":
        save_weights(family, weights)
    data = dataset(family)
    # Lightning shuffles with DistributedSampler(seed=0) under a distributed strategy; the reference reads the
    # same permutation in one process, so its batch k is the union of the replicas' k-th
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0) if reference else None
    # split by parameter counts: the same stages in every run (a split by measured time moves with the machine's
    # load, and with it which layers a stage-dependent defect reaches)
    variant = VARIANTS.get(config)
    options = dict(pipeline_parallel_size=stages, num_microbatches=microbatches,
                   cut_at=variant_cut_at(family.cut_at, variant),
                   partition="params", p2p_timeout=60.0, **SCHEDULES.get(config, {}))
    if build_in == "configure_model":
        options.update(initial_weights=str(weights), initial_weights_prefix="model.")
    recorder = Recorder()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1 if reference else int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy="auto" if reference else lightning_varuna.VarunaStrategy(**options),
        precision=precision,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[recorder],
        use_distributed_sampler=not reference,
    )
    # a model built in configure_model compiles its blocks there (ZooModule); the others are compiled here
    model = ZooModule(family_name, build_in, variant, compile_backend=backend)
    if config.startswith("ref-split"):
        model.split = split_of(*SPLITS[config.removeprefix("ref-split")])
    margins = watch_routers(model) if build_in == "init" else []
    scope = COMPILE_SCOPES.get(config, "blocks")
    if backend is not None:
        torch._dynamo.reset()
        counters.clear()
        if build_in == "init" and scope == "blocks":
            for block in blocks_of(model):  # as torchtitan compiles: each block in place
                block.compile(backend=backend)
        elif scope == "model":
            model.model.compile(backend=backend)
        elif scope == "wrapped":
            model.model = torch.compile(model.model, backend=backend)
        recorder.compiled_modules = lambda: blocks_of(model) if scope == "blocks" else [model.model]
    start = time.monotonic()
    trainer.fit(model, DataLoader(data, batch_size=batch, sampler=sampler))
    result = {"losses": recorder.losses, "grads": recorder.grads, "seconds": time.monotonic() - start}
    if recorder.router_losses:
        result["router_losses"] = recorder.router_losses
    if margins and reference:
        result["router_margin"] = min(margins)
    if backend is not None:
        result["compile"] = compile_stats(recorder, recorder.counted, recorder.compiled_calls)
    if config in EVALUATED and family.kind != "seq2seq":
        # the trained model, split: a validation loss, and the logits of the first batch (every stage has them)
        loader = DataLoader(data, batch_size=batch)  # in order (Lightning's evaluation sampler does not shuffle)
        result["val_loss"] = trainer.validate(model, loader, verbose=False)[0]["val_loss"]
        result["predictions"] = trainer.predict(model, loader)[0].float().flatten().tolist()
    if not reference:
        topology = trainer.strategy.topology
        result.update(stage=topology.stage, replica=topology.replica, data_size=topology.data_size)
    (out / f"{family_name}.{config}.rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main() -> None:
    torch.set_num_threads(1)
    # inductor compiles from scratch: a fresh cache per process
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="varuna-inductor-")
    out, specs = job_command_line(__doc__)
    rank = int(os.environ.get("RANK", "0"))
    for spec in specs:
        name = spec.replace(":", ".")
        if rank == 0:
            (out / f"{name}.started").write_text("")
        faulthandler.dump_traceback_later(HANG_S, exit=True)
        try:
            run(out, spec)
        except BaseException as err:  # noqa: BLE001 - recorded, then the process ends (others may be waiting)
            first = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
            (out / f"{name}.rank{rank}.json").write_text(json.dumps(
                {"error": first, "traceback": traceback.format_exc()[-4000:]}))
            print(f"zoo spec {spec} failed on rank {rank}: {first}", file=sys.stderr, flush=True)
            os._exit(1)
        finally:
            faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
