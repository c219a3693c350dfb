"""ZeRO stage 1: bytes per rank and bytes on the wire, ``zero_stage`` 0 vs 1, and the three candidate mechanisms.

Two parts, each in real multi-process jobs (torchrun, gloo on CPU):

1. **strategy**: TinyGPT (tests/helpers/models.py, vocabulary 2048, width 64, 4 blocks, tied embedding and head: the
   embedding is most of the parameters) trained 4 AdamW steps with ``VarunaStrategy`` at P=2 x D=2 and P=2 x D=4,
   with ``zero_stage=0`` and ``1``. Per rank, after the last step: parameter bytes held, gradient bytes
   (``.grad``),
   the gradient sync's peak in the last step (``.grad`` and the sync's own buffers together, sampled whenever the
   sync allocates or frees one: ``GradientSync.peak_held_bytes``), the optimizer state (a DTensor counted
   by its local shard), the executor's peak stashed inputs (recompute) and autograd graphs in flight (activations,
   which ``zero_stage`` does not change); and the bytes the gradient sync sends per step and rank: every
   ``torch.distributed`` call it makes (over the replicas and over the tied copies' holders) counted as in part 2.
2. **candidates**: one data-parallel module (an embedding-heavy MLP language model, 2 micro-batches per step, AdamW, 3
   steps) on D=4 processes, with each mechanism the issue lists: our flat reduce-scatter/all-gather
   (``ShardedGradientSync`` + ``ShardedStep``), ``torch.distributed.optim.ZeroRedundancyOptimizer`` under
   ``DistributedDataParallel`` (its all-reduce seen through a counting communication hook), and FSDP2's
   ``fully_shard`` (``reshard_after_forward=False``; on earlier micro-batches no gradient sync and no resharding after
   backward, so the parameters are gathered once per step and the gradient reduce-scattered once). Every collective
   call goes through a counting wrapper of ``torch.distributed``'s functions; the same ring formulas give wire
   bytes (a broadcast of N bytes: (n-1)/n N per rank on average; an all-to-all of N bytes: the (n-1)/n N it sends
   to the others; a point-to-point send: its bytes). State bytes: the maximum over ranks.

    python benchmarks/zero.py --out benchmarks/results/zero.json

The result file keeps every rank's raw figures, the commit, the load average and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"p2d2": (2, 2), "p2d4": (2, 4)}
STEPS = 4


# -- part 1: the strategy --------------------------------------------------------------------------------------
def _tensor_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def strategy_job(out: Path, layout: str) -> None:
    """One rank of the strategy part: both zero stages, one after the other."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.models import RandomTokens, TinyGPT

    import lightning_varuna
    from lightning_varuna.pipeline.comm.events import StageCounters

    torch.set_num_threads(1)
    pipeline, data = LAYOUTS[layout]
    log: list = []
    _count_collectives(log)
    for zero in (0, 1):
        torch.manual_seed(0)
        model = TinyGPT(vocab_size=2048, n_embd=64, tie_weights=True)
        class Measure(pl.Callback):
            def __init__(self) -> None:
                self.counters = StageCounters()
                self.record: dict = {}

            def on_train_start(self, trainer, pl_module) -> None:
                trainer.strategy.engine.events.add(self.counters)
                log.clear()  # setup's broadcasts are not a step's

            def on_train_end(self, trainer, pl_module) -> None:
                sync = trainer.strategy.engine.grad_sync
                params = list(pl_module.parameters())
                optimizer = trainer.optimizers[0]
                counters = self.counters
                self.record.update(
                    parameters=_tensor_bytes(params),
                    gradients=_tensor_bytes(p.grad for p in params if p.grad is not None),
                    sync_peak=sync.peak_held_bytes,
                    optimizer_state=_tensor_bytes(v for s in optimizer.state.values() for v in s.values()
                                                  if isinstance(v, torch.Tensor)),
                    peak_stash_bytes=counters.peak_stash_bytes,
                    peak_live_graphs=counters.peak_live_graphs,
                    reduced_payload_per_step=sync.reduced_bytes / STEPS,
                    gathered_payload_per_step=getattr(sync, "gathered_bytes", 0) / STEPS,
                )
                # the calls the gradient sync made: over the replicas, and over the tied copies' holders
                groups = [sync.topology.data_group, *(g for g, _ in sync.tied_groups),
                          *getattr(sync, "_replica_tied_groups", [])]
                self.record["wire_per_step"] = _wire([e for e in log if any(e[3] is g for g in groups)]) / STEPS

        strategy = lightning_varuna.VarunaStrategy(pipeline_parallel_size=pipeline, num_microbatches=4,
                                                   zero_stage=zero, partition="params")
        trainer = pl.Trainer(accelerator="cpu", devices=pipeline * data, strategy=strategy, max_steps=STEPS,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[measure := Measure()])
        trainer.fit(model, DataLoader(RandomTokens(n=64 * data, vocab_size=2048, seed=1), batch_size=8))
        record = measure.record
        record.update(rank=trainer.global_rank, stage=trainer.strategy.topology.stage)
        (out / f"{layout}-zero{zero}.rank{trainer.global_rank}.json").write_text(json.dumps(record))


# -- part 2: the candidates ------------------------------------------------------------------------------------
COUNTED = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_into_tensor",
           "all_gather_single", "broadcast", "all_gather", "reduce_scatter", "_reduce_scatter_base",
           "_all_gather_base", "all_to_all_single", "isend")


def _count_collectives(log: list) -> None:
    """Wraps ``torch.distributed``'s collectives: each call appends ``(name, payload bytes, group size, group)``."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    def payload(name: str, args: tuple, kwargs: dict) -> int:
        if name in ("all_gather_into_tensor", "all_gather_single", "_all_gather_base"):
            tensor = args[0] if args else kwargs.get("output_tensor")
        elif name in ("reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base", "all_to_all_single"):
            tensor = args[1] if len(args) > 1 else kwargs.get("input")
        else:
            tensor = args[0] if args else kwargs.get("tensor")
        tensors = tensor if isinstance(tensor, list) else [tensor]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    for name in COUNTED:
        for module in (dist, distributed_c10d):
            original = getattr(module, name, None)
            if original is None or getattr(original, "_counted", False):
                continue

            def counted(*args, _name=name, _original=original, **kwargs):
                group = kwargs.get("group")
                log.append((_name, payload(_name, args, kwargs), dist.get_world_size(group), group))
                return _original(*args, **kwargs)

            counted._counted = True  # type: ignore[attr-defined]
            setattr(module, name, counted)


def _wire(log: list) -> float:
    total = 0.0
    for name, nbytes, n, *_ in log:
        total += nbytes if name == "isend" else nbytes * (2 if name == "all_reduce" else 1) * (n - 1) / n
    return total


def candidates_job(out: Path) -> None:
    """One rank of the candidates part: the three mechanisms one after the other, on the same module and data."""
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    vocab, width, micro, tokens = 4096, 64, 2, 16

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(vocab, width), nn.Linear(width, 4 * width), nn.GELU(),
                             nn.Linear(4 * width, width), nn.Linear(width, vocab))

    def batches(step: int):
        g = torch.Generator().manual_seed(1000 * step + rank)
        return [torch.randint(vocab, (micro, tokens + 1), generator=g) for _ in range(2)]

    def loss_of(module: nn.Module, batch) -> torch.Tensor:
        logits = module(batch[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1)) / 2

    results = {}
    log: list = []
    _count_collectives(log)

    # (a) ours
    from lightning_varuna.pipeline.comm.sharded_step import ShardedStep
    from lightning_varuna.pipeline.comm.sharded_sync import ShardedGradientSync
    from lightning_varuna.pipeline.topology import Topology

    module = model()
    topology = Topology.create(1, torch.device("cpu"), timeout=120)
    params = dict(module.named_parameters())
    sync = ShardedGradientSync(topology, params, [])
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    ShardedStep(sync, optimizer, {p: n for n, p in params.items()})
    results["flat reduce-scatter + all-gather (ours)"] = _steps(
        log, lambda step: _plain_step(module, optimizer, batches(step), loss_of, sync), optimizer)

    # (b) ZeroRedundancyOptimizer under DDP
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model())

    def counting_hook(state, bucket):
        buffer = bucket.buffer().div_(world)
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, counting_hook)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)

    def ddp_step(step: int) -> None:
        first, last = batches(step)
        with ddp.no_sync():
            loss_of(ddp, first).backward()
        loss_of(ddp, last).backward()
        zero.step()
        zero.zero_grad()

    results["ZeroRedundancyOptimizer + DDP"] = _steps(log, ddp_step, zero)

    # (c) FSDP2
    try:
        from torch.distributed.fsdp import fully_shard

        sharded = model()
        fully_shard(sharded, reshard_after_forward=False)
        fsdp_optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-3)

        def fsdp_step(step: int) -> None:
            first, last = batches(step)
            sharded.set_requires_gradient_sync(False)  # accumulate unsharded, keep the parameters gathered
            sharded.set_reshard_after_backward(False)
            loss_of(sharded, first).backward()
            sharded.set_requires_gradient_sync(True)
            sharded.set_reshard_after_backward(True)
            loss_of(sharded, last).backward()
            fsdp_optimizer.step()
            fsdp_optimizer.zero_grad()

        results["FSDP2 fully_shard"] = _steps(log, fsdp_step, fsdp_optimizer)
    except Exception as err:  # noqa: BLE001 - recorded in the result: the candidate does not run here
        results["FSDP2 fully_shard"] = {"error": f"{type(err).__name__}: {err}"}
    param_bytes = sum(p.numel() * p.element_size() for p in model().parameters())
    (out / f"candidates.rank{rank}.json").write_text(json.dumps({"rank": rank, "world": world,
                                                                 "param_bytes": param_bytes, **results}))
    dist.destroy_process_group()


def _plain_step(module, optimizer, batch, loss_of, sync) -> None:
    first, last = batch
    loss_of(module, first).backward()
    with sync.overlapping():
        loss_of(module, last).backward()
    sync.start()
    sync.finish()
    optimizer.step()
    optimizer.zero_grad()


def _steps(log: list, step, optimizer) -> dict:
    import torch

    step(0)  # warm-up: state created, buffers allocated
    log.clear()
    for i in range(1, 4):
        step(i)
    calls: dict[str, int] = {}
    for name, *_ in log:
        calls[name] = calls.get(name, 0) + 1
    state = optimizer.state if not hasattr(optimizer, "optim") else optimizer.optim.state
    return {"wire_per_step": _wire(log) / 3, "payload_per_step": sum(entry[1] for entry in log) / 3, "calls": calls,
            "optimizer_state": _tensor_bytes(v for s in state.values() for v in s.values()
                                             if isinstance(v, torch.Tensor))}


# -- the parent ------------------------------------------------------------------------------------------------
def _torchrun(nproc: int, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                    __file__, *args], check=True, env=env, cwd=ROOT, timeout=1200, capture_output=True, text=True)


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT).stdout.strip()


def table(ranks: dict[str, list[dict]], candidates: list[dict]) -> str:
    lines = ["| layout | zero_stage | parameters | gradients | sync peak (.grad + buffers) | optimizer state |"
             " stashed activations"
             " (peak) | graphs in flight (peak) | wire bytes per step |", "|---|---|---|---|---|---|---|---|---|"]
    kib = 1024
    for name, records in ranks.items():
        layout, zero = name.split("-zero")
        worst = {key: max(r[key] for r in records) for key in records[0] if key not in ("rank", "stage")}
        cells = [f"{worst[key] / kib:.0f} KiB" for key in ("parameters", "gradients", "sync_peak", "optimizer_state",
                                                           "peak_stash_bytes", "wire_per_step")]
        cells.insert(5, str(worst["peak_live_graphs"]))
        lines.append(f"| {layout.upper()} | {zero} | {' | '.join(cells)} |")
    lines += ["", "| mechanism (D=4) | wire bytes per step per rank | vs. an all-reduce of the gradient |"
              " optimizer state per rank (max) | calls per step |", "|---|---|---|---|---|"]
    all_reduce = candidates[0]["param_bytes"] * 2 * 3 / 4
    for key in [k for k in candidates[0] if k not in ("rank", "world", "param_bytes")]:
        runs = [c[key] for c in candidates]
        if "error" in runs[0]:
            lines.append(f"| {key} | does not run: {runs[0]['error'][:120]} | | | |")
            continue
        wire = max(r["wire_per_step"] for r in runs)
        state = max(r["optimizer_state"] for r in runs)
        calls = ", ".join(f"{n} {c // 3}" for n, c in sorted(runs[0]["calls"].items()))
        lines.append(f"| {key} | {wire / kib:.0f} KiB | {wire / all_reduce:.2f}x | {state / kib:.0f} KiB | {calls} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "zero.json"))
    parser.add_argument("--job", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        kind, out, *rest = args.job
        strategy_job(Path(out), *rest) if kind == "strategy" else candidates_job(Path(out))
        return
    work = Path(tempfile.mkdtemp(prefix="varuna-zero-"))  # every rank's figures go into the result file
    start = time.time()
    for layout, (pipeline, data) in LAYOUTS.items():
        _torchrun(pipeline * data, "--job", "strategy", str(work), layout)
    _torchrun(4, "--job", "candidates", str(work))
    ranks = {f"{layout}-zero{zero}": [json.loads((work / f"{layout}-zero{zero}.rank{r}.json").read_text())
                                      for r in range(p * d)]
             for layout, (p, d) in LAYOUTS.items() for zero in (0, 1)}
    candidates = [json.loads((work / f"candidates.rank{r}.json").read_text()) for r in range(4)]
    result = {"command": " ".join(["python", "benchmarks/zero.py", *sys.argv[1:]]), "commit": _git("rev-parse", "HEAD"),
              "dirty": bool(_git("status", "--porcelain")), "loadavg_end": list(os.getloadavg()),
              "cpus": os.cpu_count(), "wall_s": time.time() - start, "ranks": ranks, "candidates": candidates,
              "table_md": table(ranks, candidates)}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(result["table_md"])


if __name__ == "__main__":
    main()
