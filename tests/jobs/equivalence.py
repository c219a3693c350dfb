"""Trains TinyGPT under several strategy configurations (or the plain reference) and records losses and grads.

Run under torchrun for the strategy (every configuration in one job), or as a plain script for the reference:

    torchrun --nproc-per-node=4 tests/jobs/equivalence.py OUT CONFIG [CONFIG ...]
    python tests/jobs/equivalence.py OUT reference[:BATCH]

CONFIG is ``name:key=value,key=value`` with keys of VarunaStrategy plus ``tie``, ``clip``, ``clip_algorithm``,
``batch``, ``precision``, ``dropout``, ``accumulate``, ``steps``, ``epoch_steps``, ``epochs``, ``save`` (a path
written after fit), ``save_every`` (a ModelCheckpoint directory, written every that many steps as ``ckpt.ckpt``)
(with ``save_all``, every one is kept, as ``ckpt-step=<n>.ckpt``) and ``resume``;
``side`` (``SideValueGPT``: side values made in the first segment, passed to every block), ``gradnorm`` (the
model logs ``grad_norm(self, 2)`` in ``on_before_optimizer_step``), ``bucket`` (gradient bucket bytes),
``overlap`` (all-reduce during the last backward, default on), ``accelerator`` (default ``cpu``),
``shared_gpu`` (every process on ``cuda:0``: gloo process group and p2p), ``log_dir`` (a CSVLogger there, logging
every 2 steps), ``preempt`` (``STEP:RANK``: that rank sends itself SIGTERM as training step STEP starts, so every
rank stops after it with ``last.ckpt`` in ``save_dir``; the steps done so far are recorded), ``vocab`` (the
vocabulary size) and ``optimizer`` (``adamw``, the model's own: AdamW with a step
scheduler; ``sgd``: SGD with momentum and the same scheduler; ``groups``: AdamW with two parameter groups,
weight decay 0.1 on matrices and 0 on the rest). Each rank records its optimizer state's bytes (a DTensor
counted by its local shard), its parameters' bytes and the gradient sync's peak (``.grad`` plus the sync's own
buffers, :attr:`GradientSync.peak_held_bytes`). The configuration the strategy ran (chosen by its planner where
``"auto"``) is recorded. ``count_wire``: every ``torch.distributed`` call on the data-parallel group during the
training batches is counted (:class:`WireCounter`), as the bytes this rank sends.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.utilities import grad_norm
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.models import RandomTokens, SideValueGPT, TinyGPT  # noqa: E402
from spec import job_command_line, parse_spec  # noqa: E402

import lightning_varuna  # noqa: E402, F401
from lightning_varuna.pipeline.comm.events import StageCounters  # noqa: E402
from lightning_varuna.trainer.recovery.preemption import Preempted  # noqa: E402

STEPS = 8


class NormLoggingGPT(TinyGPT):
    def on_before_optimizer_step(self, optimizer) -> None:
        self.log_dict(grad_norm(self, norm_type=2))


def with_optimizer(model_class: type, kind: str) -> type:
    """``model_class`` with the optimizer ``kind`` (see the module doc)."""
    if kind == "adamw":
        return model_class

    def configure_optimizers(self):
        if kind == "sgd":
            optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        elif kind == "groups":
            matrices = [p for p in self.parameters() if p.dim() >= 2]
            rest = [p for p in self.parameters() if p.dim() < 2]
            optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1},
                                           {"params": rest, "weight_decay": 0.0}], lr=self.hparams.lr)
        else:
            optimizer = getattr(torch.optim, kind)(self.parameters())
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return type(f"{model_class.__name__}With{kind}", (model_class,), {"configure_optimizers": configure_optimizers})


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors on this rank (a DTensor's local shard)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


class WireCounter:
    """Bytes this rank sends in the collectives and point-to-point calls it makes on some groups, by kind.

    Each call is counted by what its algorithm sends per rank on gloo: a ring all-reduce of N bytes over n ranks
    ``2 (n - 1) / n * N``; gloo's ``reduce_scatter_tensor`` runs an all-reduce of its whole input (measured on a
    link, ``docs/benchmarks.md``), so it counts as one; an all-to-all sends every chunk but its own; a ring
    all-gather ``(n - 1) / n`` of its output; ``isend`` its tensor.
    """

    NAMES = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single",
             "all_gather_into_tensor", "all_gather_single", "isend", "send", "broadcast")

    def __init__(self) -> None:
        self.groups: list[object] = []
        self.counting = False
        self.sent: dict[str, int] = {}
        dist = torch.distributed
        for name in self.NAMES:
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name: str, call):
        def counted(*args, **kwargs):
            group = kwargs.get("group")
            if self.counting and group is not None and any(group is g for g in self.groups):
                n = torch.distributed.get_world_size(group)
                self.sent[name] = self.sent.get(name, 0) + self._bytes(name, n, *args, **kwargs)
            return call(*args, **kwargs)

        return counted

    @staticmethod
    def _bytes(name: str, n: int, first, second=None, *rest, **kwargs) -> int:
        def size(t) -> int:
            return t.numel() * t.element_size()

        if name in ("all_reduce",):
            return 2 * (n - 1) * size(first) // n
        if name.startswith("reduce_scatter"):
            return 2 * (n - 1) * size(second) // n  # gloo: an all-reduce of the input
        if name == "all_to_all_single":
            splits = kwargs.get("input_split_sizes") or (rest[1] if len(rest) > 1 else None)
            if splits:
                raise NotImplementedError("uneven all-to-all splits are not counted")
            return (n - 1) * size(second) // n
        if name.startswith("all_gather"):
            return (n - 1) * size(first) // n
        if name in ("isend", "send"):
            return size(first)
        return (n - 1) * size(first)  # broadcast from this rank at most


WIRE = WireCounter() if "count_wire=true" in " ".join(sys.argv) else None


class Recorder(pl.Callback):
    def __init__(self, bucket: int | None = None, overlap: bool = True) -> None:
        self.losses: list[float] = []
        self.grads: dict[str, list[float]] = {}
        self.grad_norms: list[dict[str, float]] = []
        self.logged_norms: list[dict[str, float]] = []
        self.clipped_norms: list[dict[str, float]] = []
        self.overlapped: list[int] = []
        self.bucket, self.overlap = bucket, overlap
        self.counters = StageCounters()
        self.sync_peaks: list[int] = []
        self.param_bytes = 0

    def on_train_start(self, trainer, pl_module) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            engine.events.add(self.counters)
        sync = getattr(engine, "grad_sync", None)
        if WIRE is not None and engine is not None:  # the groups the gradient sync talks over
            WIRE.groups = [engine.topology.data_group, *(group for group, _ in sync.tied_groups),
                           *getattr(sync, "_replica_tied_groups", [])]
            WIRE.sent = {}
        if sync is not None:
            sync.overlap = self.overlap
            if self.bucket is not None:
                sync.bucket_bytes = self.bucket

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        sync = getattr(getattr(trainer.strategy, "engine", None), "grad_sync", None)
        if sync is not None:
            self.overlapped.append(sync.overlapped_buckets)
            self.sync_peaks.append(sync.peak_held_bytes)
        self.param_bytes = sum(p.numel() * p.element_size() for p in pl_module.parameters())
        self.grad_norms.append(
            {n: float(p.grad.norm()) for n, p in pl_module.named_parameters() if p.grad is not None}
        )
        if trainer.global_step == 0:
            for name, p in pl_module.named_parameters():
                if p.grad is not None:
                    self.grads[name] = p.grad.detach().flatten().tolist()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if WIRE is not None:
            WIRE.counting = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if WIRE is not None:  # ModelCheckpoint saves after this (Lightning runs it last): not counted
            WIRE.counting = False
        # after the optimizer step .grad still holds the gradients as clipped (zero_grad comes with the next step)
        self.clipped_norms.append(
            {n: float(p.grad.norm()) for n, p in pl_module.named_parameters() if p.grad is not None}
        )
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        self.logged_norms.append(
            {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("grad_2.0_norm")}
        )


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """A torch selective-checkpointing policy function: matrix multiplies saved, everything else recomputed."""
    return CheckpointPolicy.MUST_SAVE if op in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
POLICIES = {"list": list(MATMULS), "function": _save_matmuls}


class Preempter(pl.Callback):
    """Warns ``rank`` with SIGTERM as step ``step`` starts: the flag is agreed at the next batch's start."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def run(out: Path, spec: str) -> None:
    name, options = parse_spec(spec)
    batch = options.pop("batch", 16)
    tie = options.pop("tie", False)
    clip = options.pop("clip", None)
    clip_algorithm = options.pop("clip_algorithm", None)
    precision = options.pop("precision", "32-true")
    dropout = options.pop("dropout", 0.0)
    accumulate = options.pop("accumulate", 1)
    inject_inf_at = options.pop("inf", None)
    steps = options.pop("steps", STEPS)
    count_wire = options.pop("count_wire", False)
    epochs = options.pop("epochs", None)
    epoch_steps = options.pop("epoch_steps", STEPS)
    save = options.pop("save", None)
    save_every = options.pop("save_every", None)
    save_dir = options.pop("save_dir", None)
    save_all = options.pop("save_all", False)
    resume = options.pop("resume", None)
    gradnorm = options.pop("gradnorm", False)
    bucket = options.pop("bucket", None)
    log_dir = options.pop("log_dir", None)
    overlap = options.pop("overlap", True)
    accelerator = options.pop("accelerator", "cpu")
    shared_gpu = options.pop("shared_gpu", False)
    if shared_gpu:  # NCCL refuses two ranks on one device: gloo, staged through host memory; one device to Lightning
        options.update(parallel_devices=[torch.device("cuda", 0)] * int(os.environ["LOCAL_WORLD_SIZE"]),
                       process_group_backend="gloo", p2p_backend="gloo")
    vocab = options.pop("vocab", 64)
    layers = options.pop("layers", 4)
    optimizer_kind = options.pop("optimizer", "adamw")
    side = options.pop("side", False)
    preempt = options.pop("preempt", None)
    policy = options.pop("policy", None)
    if policy is not None:  # selective recompute: the matrix multiplies kept, the rest recomputed
        options["recompute_policy"] = POLICIES[policy]
    cut_points = options.get("cut_at") is None
    torch.manual_seed(0)
    model_class = with_optimizer(SideValueGPT if side else NormLoggingGPT if gradnorm else TinyGPT, optimizer_kind)
    model = model_class(vocab_size=vocab, tie_weights=tie, use_cut_points=cut_points, dropout=dropout,
                        sync_dist=True, n_layer=layers)
    if inject_inf_at is not None:
        # an overflow in one stage's gradients only (blocks.0 sits on stage 0): every stage must skip the step
        weight = model.blocks[0].mlp[0].weight
        weight.register_hook(lambda g: g * float("inf") if model.trainer.global_step == inject_inf_at else g)
    # the same data whatever the replica count
    dataset = RandomTokens(n=16 * epoch_steps * accumulate, seed=1, vocab_size=vocab)
    reference = name.startswith("reference")
    # Lightning shuffles training data with DistributedSampler(seed=0) under any distributed strategy; the
    # reference reads the same permutation in one process, so its batch k is the union of the replicas' k-th
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0) if reference else None
    loader = DataLoader(dataset, batch_size=batch, sampler=sampler)
    recorder = Recorder(bucket, overlap)
    callbacks: list[pl.Callback] = [recorder]
    if save_every is not None:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(dirpath=save_dir, filename="ckpt-{step}" if save_all else "ckpt",
                                         every_n_train_steps=save_every, save_top_k=-1 if save_all else 1)
        )
    if preempt is not None:
        step, warned = (int(part) for part in str(preempt).split(":"))
        callbacks.append(Preempter(step, warned))
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=1 if reference or shared_gpu else int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=1 if reference else int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy="auto" if reference else lightning_varuna.VarunaStrategy(**options),
        max_steps=-1 if epochs else steps,
        max_epochs=epochs,
        precision=None if precision == "16-mixed" else precision,
        # fp16 with a loss scaler on CPU (Lightning makes one by default only on GPU)
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]
        if precision == "16-mixed"
        else None,
        gradient_clip_val=clip,
        gradient_clip_algorithm=clip_algorithm,
        accumulate_grad_batches=accumulate,
        logger=pl.loggers.CSVLogger(log_dir, name="run") if log_dir is not None else False,
        log_every_n_steps=2 if log_dir is not None else 50,
        enable_checkpointing=save_every is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        use_distributed_sampler=not reference,
    )
    try:
        trainer.fit(model, loader, ckpt_path=resume)
    except Preempted:
        if preempt is None:
            raise
    if save is not None:
        trainer.save_checkpoint(save)
    rank = trainer.global_rank
    result = {"preempted_at": trainer.global_step if preempt is not None else None,
              "losses": recorder.losses, "grads": recorder.grads, "grad_norms": recorder.grad_norms,
              "logged_norms": recorder.logged_norms}
    if not reference:
        result["sent_bytes"] = recorder.counters.sent_bytes
        result["stage"] = trainer.strategy.topology.stage
        sync = trainer.strategy.engine.grad_sync
        result["overlapped"] = recorder.overlapped
        result["buckets"] = len(sync.buckets)
        result["data_size"] = trainer.strategy.topology.data_size
        result["replica"] = trainer.strategy.topology.replica
        result["node"] = trainer.node_rank
        config = trainer.strategy.engine.config
        result["config"] = {"pipeline_parallel_size": config.pipeline_parallel_size,
                            "microbatch_size": config.microbatch_size, "num_microbatches": config.num_microbatches,
                            "schedule": config.schedule, "recompute": config.recompute,
                            "stages_per_rank": config.stages_per_rank}
        result["sync_peak_bytes"] = recorder.sync_peaks
        # side values a stage recomputed by degree makes in its recomputed part and uses in its kept part
        result["sides_kept"] = sum(len(c.sides_kept) for c in trainer.strategy.engine.executor.chunks)
        result["param_bytes"] = recorder.param_bytes
        if count_wire and WIRE is not None:
            result["wire_bytes"] = dict(WIRE.sent)
            result["wire_steps"] = len(recorder.losses)
    result["clipped_norms"] = recorder.clipped_norms
    result["state_bytes"] = sum(state_bytes(o) for o in trainer.optimizers)
    result["final"] = {n: p.detach().double().flatten().tolist() for n, p in model.named_parameters()}
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    result["scale"] = float(scaler.get_scale()) if scaler is not None else None
    (out / f"{name}.rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    torch.set_num_threads(1)
    directory, specs = job_command_line(__doc__)
    for spec in specs:
        run(directory, spec)
