"""Train the GPT example so that it survives losing processes or machines: torchrun elastic + ``ckpt_path="last"``.

Two machines (or two agents on one machine), 2 processes each: 2 pipeline stages x 2 replicas. If a machine
goes away, the surviving agent restarts its workers with the smaller world size (2 stages x 1 replica) and
they resume from the newest checkpoint::

    # on the first machine (it hosts the rendezvous)
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1:2 --nproc-per-node=2 --max-restarts=3 \\
        --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 --rdzv-id=gpt \\
        --rdzv-conf=is_host=true,keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=3 \\
        examples/gpt/elastic.py --ckpt-dir /nfs/ckpt/gpt
    # on the second machine: the same with is_host=false

``--ckpt-dir`` must be on storage that every machine sees and that outlives them. Without
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, torch 2.13's restarted workers read the previous group's addresses from
the shared rendezvous store and fail to connect (pytorch/pytorch#135712). See docs/spot_instances.md.

What makes it elastic (each restart runs this script again from the top):

- ``devices`` and ``num_nodes`` come from torchrun's ``LOCAL_WORLD_SIZE`` and ``WORLD_SIZE`` (or SLURM's
  ``SLURM_NTASKS`` and ``SLURM_NNODES`` under ``srun``), so they match the world size of every restart
  (Lightning refuses a mismatch);
- ``ModelCheckpoint`` writes ``last.ckpt`` into a fixed directory every ``--every-n-steps`` steps, so a
  restarted run finds it (without a fixed ``dirpath`` each run logs to a new version folder);
- ``fit(ckpt_path="last")`` resumes from it, whatever P x D wrote it; on the very first start there is none
  yet and training starts from scratch;
- P must divide every world size the job may shrink to: ``"auto"`` takes the largest divisor of the world
  size that is at most the processes per machine, so pipelines never span machines;
- ``global_batch_size`` keeps the samples per step the same when the number of replicas changes.
"""

from __future__ import annotations

import time

LAUNCHED = time.time()  # before the heavy imports: a restart's cost starts here

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from data import StdlibText  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from model import GPT, init_weights  # noqa: E402

from lightning_varuna import VarunaStrategy  # noqa: E402


def world_shape() -> tuple[int, int]:
    """``(devices, num_nodes)`` of this (re)start: from torchrun's environment, else SLURM's, else 1 x 1."""
    env = os.environ
    if "LOCAL_WORLD_SIZE" in env:  # torchrun: the world of this restart
        local, world = int(env["LOCAL_WORLD_SIZE"]), int(env["WORLD_SIZE"])
    elif "SLURM_NTASKS" in env and "SLURM_NNODES" in env:  # srun: the allocation of this (requeued) job
        world, nodes = int(env["SLURM_NTASKS"]), int(env["SLURM_NNODES"])
        local = world // nodes
    else:
        return 1, 1
    if world % local:
        raise RuntimeError(f"{world} processes do not split evenly into machines of {local}: start the same number"
                           " of processes on every machine.")
    return local, world // local


def has_last_checkpoint(directory: Path) -> bool:
    """Whether ``ckpt_path="last"`` will find something (only to say so; Lightning decides)."""
    return directory.is_dir() and any(p.name.startswith("last") and p.suffix == ".ckpt" for p in directory.iterdir())


class StepRecord(pl.Callback):
    """Appends one JSON line per finished step (rank 0): step, world size, time. Used by the tests."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _write(self, **entry) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(entry) + "\n")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self._write(event="start", step=trainer.global_step, world_size=trainer.world_size, time=time.time(),
                        launched=LAUNCHED, ckpt_path=str(trainer.ckpt_path) if trainer.ckpt_path else None,
                        restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.is_global_zero:
            self._write(event="step", step=trainer.global_step, world_size=trainer.world_size, time=time.time())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt-dir", type=Path, required=True, help="fixed checkpoint directory (shared)")
    parser.add_argument("--every-n-steps", type=int, default=10, help="checkpoint interval in optimizer steps")
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--pipeline-parallel-size", default="auto", help='P, or "auto"')
    parser.add_argument("--num-microbatches", type=int, default=4)
    parser.add_argument("--partition", choices=["time", "params"], default="time", help="how stages are balanced")
    parser.add_argument("--global-batch-size", type=int, default=16,
                        help="samples per step over all replicas, whatever their number (a multiple of every D)")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--max-chars", type=int, default=2_000_000, help="bytes of standard-library text")
    parser.add_argument("--p2p-timeout", type=float, default=60.0, help="seconds to wait for a pipeline peer")
    parser.add_argument("--record", type=Path, help="append a JSON line per step to this file")
    args = parser.parse_args()

    torch.set_num_threads(1)
    pl.seed_everything(1234, workers=True)
    devices, num_nodes = world_shape()
    size = args.pipeline_parallel_size
    strategy = VarunaStrategy(
        pipeline_parallel_size=int(size) if size != "auto" else "auto",
        num_microbatches=args.num_microbatches,
        partition=args.partition,
        global_batch_size=args.global_batch_size,  # each replica reads global / D: same steps after a shrink
        p2p_timeout=args.p2p_timeout,  # a peer lost without a word ends the others after at most this
        param_init_fn=init_weights,  # GPT builds its layers on the meta device; each stage initializes its own
    )
    callbacks: list[pl.Callback] = [
        # save_top_k=0: only last.ckpt, overwritten in place (atomically) every N steps
        ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True, save_top_k=0, every_n_train_steps=args.every_n_steps)
    ]
    if args.record is not None:
        callbacks.append(StepRecord(args.record))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        max_steps=args.max_steps,
        callbacks=callbacks,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = GPT(block_size=args.block_size, n_layer=args.n_layer, n_embd=args.n_embd)
    # the loader's batch_size is replaced by global_batch_size / D
    data = StdlibText(block_size=args.block_size, batch_size=args.global_batch_size, max_chars=args.max_chars)
    if trainer.is_global_zero and not has_last_checkpoint(args.ckpt_dir):
        print(f"No last checkpoint in {args.ckpt_dir} yet: starting from scratch.", flush=True)
    # "last": the newest last*.ckpt in the ModelCheckpoint's dirpath; nothing there yet -> a warning, a fresh start
    trainer.fit(model, data, ckpt_path="last")


if __name__ == "__main__":
    main()
