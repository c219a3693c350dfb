"""In-place recovery: TinyGPT at P=2 x D=2 under ``recovery="in_place"``, one rank SIGKILLed at a controlled point.

    python tests/jobs/in_place.py OUT SCENARIO [SCENARIO ...]

The parent starts a job store of its own (``varuna-store``: it outlives every rank) and forks one child per rank,
as an external launcher (srun) would; it never ends the job when a rank dies. Each rank appends, after every
optimizer step, ``{"step", "world", "rank", "loss"}`` to ``OUT/<scenario>.rank<r>.jsonl`` (r: its first rank) and at
the end of ``fit`` saves the parameters its stage holds to ``OUT/<scenario>.params.rank<r>.pt``.
``OUT/<scenario>.json`` holds each rank's exit code and time, and the fault's time.

Scenarios: ``none`` (the uninterrupted run) and ``<point>`` for each fault point of :data:`POINTS`, where the last
rank (stage 1 of the last replica) SIGKILLs itself in step :data:`FAULT_STEP` + 1. A suffix ``@8`` runs 8 processes
(P=2 x D=4, global batch 24, so that it splits over the 3 replicas left) instead of 4 (P=2 x D=2, global batch 8);
``#k`` (ignored) tells repetitions apart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from forked import free_port, marked_time, run_ranks  # noqa: E402
from helpers.models import RandomTokens, TinyGPT  # noqa: E402

import lightning_varuna  # noqa: E402

PIPELINE = 2
STEPS = 6
FAULT_STEP = 2
GLOBAL_BATCH = {4: 8, 8: 24}
FAULT_MARK = "VARUNA-FAULT-AT"
POINTS = ("forward", "backward", "all-reduce", "before-update", "after-update")
"""Where the faulty rank dies in its step: in a forward (its first micro-batch), in a backward (its last block's),
right after starting its gradient all-reduce, in ``on_before_optimizer_step`` (before the commit), and after the
optimizer's update (after the commit)."""
SEVERAL = {"two-replicas": (5, 7), "stage-lost": (1, 3)}
"""Scenarios where several ranks die at once, in a forward: two of four replicas (8 processes), or both copies of
stage 1 (4 processes: no complete replica is left, so the survivors fall back to a restart)."""
HANG_S = 120
"""In scenario ``hang`` the last rank sleeps this long in a forward instead of dying (its peers give up after
``p2p_timeout``: a hung rank is alive, so nothing is recovered in place)."""


class Recorded(TinyGPT):
    """TinyGPT that records its losses and dies at the scenario's fault point."""

    def __init__(self, out: Path, scenario: str) -> None:
        super().__init__(n_layer=4, lr=1e-2)
        self.out, self.scenario = out, scenario
        name = scenario.partition("@")[0].partition("#")[0]
        self.point = "forward" if name in (*SEVERAL, "hang") else name
        self.first_rank = int(os.environ["RANK"])
        self.fault_ranks = fault_ranks(scenario)
        self.hang = name == "hang"

    def _dies_here(self, point: str) -> bool:
        return (self.point == point and self.first_rank in self.fault_ranks and self.trainer.global_step == FAULT_STEP
                and self.trainer.state.stage == "train")

    def _die(self) -> None:
        print(f"{FAULT_MARK} {time.time():.3f}", flush=True)
        if self.hang:
            time.sleep(HANG_S)
        os.kill(os.getpid(), signal.SIGKILL)

    def on_fit_start(self) -> None:
        last_block = self.blocks[-1]  # on stage 1 (partition by parameters)
        last_block.register_forward_hook(self._arm_backward_fault)
        grad_sync = self.trainer.strategy.engine.grad_sync
        start = grad_sync._all_reduce

        def started_then_killed(*args, **kwargs):
            start(*args, **kwargs)
            if self._dies_here("all-reduce"):
                self._die()

        grad_sync._all_reduce = started_then_killed
        for optimizer in self.trainer.optimizers:
            optimizer.register_step_post_hook(lambda *_: self._die() if self._dies_here("after-update") else None)

    def _arm_backward_fault(self, module, args, output) -> None:
        if self._dies_here("backward") and torch.is_grad_enabled() and output.requires_grad:
            output.register_hook(lambda grad: self._die())

    def training_step(self, batch, batch_idx: int):
        if self._dies_here("forward"):
            self._die()
        return super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer) -> None:
        if self._dies_here("before-update"):
            self._die()

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        record = {"step": self.trainer.global_step, "world": self.trainer.world_size, "time": time.time(),
                  "rank": self.trainer.global_rank, "loss": float(outputs["loss"])}
        with open(self.out / f"{self.scenario}.rank{self.first_rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_fit_end(self) -> None:
        held = {n: p.detach().clone() for n, p in self.named_parameters() if p.device.type != "meta"}
        held = {n: t for n, t in held.items() if n in set(self.trainer.strategy.engine.stage_param_names)}
        torch.save(held, self.out / f"{self.scenario}.params.rank{self.first_rank}.pt")


def _world(scenario: str) -> int:
    if scenario.startswith("two-replicas"):
        return 8
    return int(scenario.partition("@")[2].partition("#")[0] or 4)


def fault_ranks(scenario: str) -> tuple[int, ...]:
    """The ranks that die (or hang) in ``scenario``."""
    return SEVERAL.get(scenario.partition("@")[0].partition("#")[0], (_world(scenario) - 1,))


def _rank_main(out: Path, scenario: str, store: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Recorded(out, scenario)
    strategy = lightning_varuna.VarunaStrategy(
        pipeline_parallel_size=PIPELINE, num_microbatches=2, global_batch_size=GLOBAL_BATCH[_world(scenario)],
        partition="params",
        p2p_timeout=5 if scenario.startswith("hang") else 60, recovery="in_place", recovery_store=store,
    )
    trainer = pl.Trainer(accelerator="cpu", devices=_world(scenario), strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    trainer.fit(model, DataLoader(RandomTokens(n=64, seed=1), batch_size=4))
    print("VARUNA-FINISHED", flush=True)


def run_scenario(out: Path, scenario: str) -> None:
    port = free_port()
    store = subprocess.Popen([sys.executable, "-m", "lightning_varuna.failstop.store_server", "--port", str(port),
                              "--host", "127.0.0.1"], stdout=subprocess.PIPE, text=True)
    assert store.stdout is not None
    store.stdout.readline()  # "serving on ...": up before any rank connects (with p2p_timeout=5, within 5 s)
    try:
        for stale in out.glob(f"{scenario}.*"):
            stale.unlink()
        start = time.time()
        address = f"127.0.0.1:{port}"
        ends = run_ranks(out, scenario, _world(scenario), lambda rank: _rank_main(out, scenario, address), 240)
    finally:
        store.kill()
        store.wait()
    fault_time = marked_time(out, scenario, fault_ranks(scenario), FAULT_MARK)
    result = {"fault_ranks": fault_ranks(scenario), "fault_time": fault_time, "start": start,
              "ranks": {rank: info for rank, info in sorted(ends.items())}}
    (out / f"{scenario}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    directory = Path(sys.argv[1])
    directory.mkdir(parents=True, exist_ok=True)
    for name in sys.argv[2:]:
        run_scenario(directory, name)
