"""Counts what a training step makes the host wait for: the plain run, Lightning's DDP and the pipeline.

    python tests/jobs/host_syncs.py OUT plain                                # one process, Lightning's own loop
    torchrun --nproc-per-node=2 tests/jobs/host_syncs.py OUT ddp             # Lightning's DDPStrategy, D=2
    torchrun --nproc-per-node=4 tests/jobs/host_syncs.py OUT varuna          # VarunaStrategy, P=2 x D=2

Every mode fits the same TinyGPT (logging ``train_loss`` to the progress bar every step) and counts, on each rank,
from the start of step ``FIRST`` to the start of step ``FIRST + COUNTED``: reads of a tensor's values by the host
(``Tensor.item``, ``tolist``, ``__bool__``, ``cpu``, ``numpy``; each one a device synchronization on a GPU),
collectives and point-to-point calls made through ``torch.distributed``, and the engine's own p2p events (posted
transfers and host waits on them). ``OUT/<mode>.rank<r>.json`` holds each count per optimizer step.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.models import RandomTokens, TinyGPT  # noqa: E402

import lightning_varuna  # noqa: E402
from lightning_varuna.pipeline.comm.events import Event, EventKind  # noqa: E402

FIRST = 3
COUNTED = 4
BATCH = 8
HOST_READS = ("item", "tolist", "__bool__", "cpu", "numpy")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
               "broadcast_object_list", "reduce_scatter_tensor", "all_to_all_single", "barrier", "send", "recv",
               "isend", "irecv", "batch_isend_irecv", "monitored_barrier")


class Counting(pl.Callback):
    """Counts host reads, ``torch.distributed`` calls and engine p2p events inside the counted steps."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()
        """The same counts by the first caller outside torch (``module:function``), to say where each comes from."""
        self.active = False
        self._undo: list[Callable[[], None]] = []

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            engine.events.add(self._event)
        for name in HOST_READS:
            self._wrap(torch.Tensor, name, f"host.{name}")
        for name in COLLECTIVES:
            if hasattr(dist, name):
                self._wrap(dist, name, f"dist.{name}")

    def _wrap(self, owner: Any, name: str, key: str) -> None:
        original = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.active:
                self.counts[key] += 1
                self.sites[f"{key} {_caller()}"] += 1
            return original(*args, **kwargs)

        setattr(owner, name, counted)
        self._undo.append(lambda: setattr(owner, name, original))

    def _event(self, event: Event) -> None:
        if self.active and event.kind in (EventKind.POST, EventKind.WAIT_START):
            self.counts[f"p2p.{event.kind.value}"] += 1

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.active = FIRST <= batch_idx < FIRST + COUNTED

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.active = False
        for undo in self._undo:
            undo()


class SgdGPT(TinyGPT):
    """TinyGPT under SGD with momentum: torch's Adam reads its step count with ``.item()`` per parameter on CPU,
    which would drown what the strategy reads."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9)


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None and (frame.f_globals.get("__name__", "").startswith("torch")
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_globals.get('__name__', '?')}:{frame.f_code.co_name}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("mode", choices=("plain", "ddp", "varuna"))
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)
    torch.set_num_threads(1)
    steps = FIRST + COUNTED + 1
    if args.mode == "plain":
        strategy: Any = "auto"
        devices = 1
    elif args.mode == "ddp":
        strategy, devices = "ddp", 2
    else:
        strategy = lightning_varuna.VarunaStrategy(pipeline_parallel_size=2, num_microbatches=4)
        devices = 4
    counting = Counting()
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=True,
                         callbacks=[counting], num_sanity_val_steps=0)
    data = DataLoader(RandomTokens(n=BATCH * 2 * steps), batch_size=BATCH)
    trainer.fit(SgdGPT(), data)
    rank = dist.get_rank() if dist.is_initialized() else 0
    per_step = {key: count / COUNTED for key, count in sorted(counting.counts.items())}
    sites = {key: count / COUNTED for key, count in sorted(counting.sites.items())}
    engine = getattr(trainer.strategy, "engine", None)
    layout = {} if engine is None else {
        "stage": engine.topology.stage, "last_stage": engine.topology.is_last,
        "buckets": len(engine.grad_sync.buckets), "microbatches": 4,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.mode}.rank{rank}.json").write_text(json.dumps({"per_step": per_step, "sites": sites,
                                                                        **layout}))


if __name__ == "__main__":
    main()
