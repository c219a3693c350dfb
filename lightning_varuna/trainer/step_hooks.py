"""Lightning's step hooks run through the pipeline: one call of the user's hook per micro-batch, on every stage.

Each stage runs the user's ``training_step`` (or ``validation_step``, ...) for every micro-batch; cut points
decide what a stage computes. Only the last stage reaches the loss and what is logged after the model's forward,
so its ``self.log`` calls are captured, reduced over micro-batches and shared over the pipeline (in training
behind the last gradient, with no collective), and every stage then logs the same keys and values
(:mod:`lightning_varuna.trainer.logs.log_sync`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten
from torchmetrics import Metric

from lightning_varuna.failstop.failures import report_failure, waiting_on_peers
from lightning_varuna.pipeline.engine import PipelineEngine, default_loss
from lightning_varuna.pipeline.runtime.executor import SUMMARY_SIZE
from lightning_varuna.trainer.logs.log_sync import LogBroadcaster, LogCapture, LogMeta, fill, reduce_records, replay

__all__ = ["StepRunner", "check_metric_states"]


class StepRunner:
    """Runs one of the module's step hooks on a batch through the engine and logs what the last stage logged.

    Args:
        module: The LightningModule (partitioned by ``engine``).
        engine: The set-up engine.
        precision: The precision plugin whose step contexts each micro-batch runs in.
    """

    def __init__(self, module: LightningModule, engine: PipelineEngine, precision: Precision) -> None:
        topology = engine.topology
        assert topology is not None
        self.module = module
        self.engine = engine
        self.topology = topology
        self.precision = precision
        self.device = engine.device
        self.broadcaster = self._broadcaster()
        self.module_names = {id(m): name for name, m in module.named_modules()}

    def _broadcaster(self) -> LogBroadcaster:
        topology = self.topology
        return LogBroadcaster(topology.pipe_group, topology.pipe_src_rank, topology.is_last, self.device, self.module)

    def regroup(self) -> None:
        """Takes the pipeline group the topology has now (after in-place recovery made the groups again)."""
        self.broadcaster = self._broadcaster()

    def run(self, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any], loss_scale: float = 1.0,
            start_sync: bool = False, accumulated: Mapping[torch.nn.Parameter, Tensor] | None = None) -> Any:
        """Runs ``hook`` on ``args[0]`` (the batch); returns the batch loss (training) or the merged outputs.

        In training it returns None, on every rank, when the batch is skipped: the user's step returned None for
        a micro-batch, before the model's forward or after the loss, on any replica (the replicas' last stages
        agree on it, and the flag travels back with the step's summary).

        Args:
            hook: ``"training_step"``, ``"validation_step"``, ``"test_step"`` or ``"predict_step"``.
            args: The hook's arguments (the batch first).
            kwargs: The hook's keyword arguments.
            loss_scale: Training: each micro-batch's loss is weighted by its share of the batch times this.
            start_sync: Training: start the gradient reductions during this step (before an optimizer step).
            accumulated: Training, with ``start_sync``: the accumulation window's earlier gradients, kept outside
                ``.grad`` (see :meth:`~lightning_varuna.pipeline.engine.PipelineEngine.train_step`).
        """
        train = hook == "training_step"
        batch, rest = args[0], args[1:]
        step = getattr(self.module, hook)
        context = _STEP_CONTEXTS[hook](self.precision)
        capture = LogCapture(self.module)
        engine = self.engine

        def run_one(microbatch: Any) -> Any:
            capture.microbatch = engine.microbatch
            with context():
                return step(microbatch, *rest, **kwargs)

        shared: dict[str, Any] = {}
        summarize = self._summarizer(capture, shared) if train and self.topology.pipeline_size > 1 else None
        try:
            with capture.capturing(discard=lambda: engine.recomputing):
                if train:
                    result = engine.train_step(batch, run_one, loss_scale=loss_scale, loss_transform=self._scale_loss,
                                               summary=summarize, start_sync=start_sync, accumulated=accumulated)
                else:
                    result = engine.eval_step(batch, run_one, weigh=hook != "predict_step")
        except BaseException as err:
            report_failure(err)
            raise
        meta, flat, skipped = self._shared_logs(capture, result, shared, train)
        replay(self.module, meta, flat, skip=_TRAINING_VALUES if train else 0)
        if train:
            return None if skipped else flat[0].float()
        return self._merge_outputs(hook, result.outputs, result.sizes)

    def _shared_logs(
        self, capture: LogCapture, result: Any, shared: dict[str, Any], train: bool
    ) -> tuple[LogMeta, Tensor, bool]:
        """The step's logged keys and values as the last stage has them, and whether the batch is skipped.

        In training the values start with the loss and the skip flag.
        """
        if result.summary is not None:
            return waiting_on_peers(self.topology, "sharing the last stage's logged values",
                                    lambda: self._unpack_summary(result.summary, shared))
        meta, values, skipped = self._reduce(capture, result.outputs, result.units, train)
        if self.topology.pipeline_size > 1:
            meta, flat = waiting_on_peers(self.topology, "sharing the last stage's logged values",
                                          lambda: self.broadcaster.share(meta, values))
            return meta, flat, skipped
        return meta, torch.stack([v.to(torch.float64) for v in values]) if values else torch.zeros(0), skipped

    def _reduce(
        self, capture: LogCapture, outputs: list[Any], units: list[float], train: bool
    ) -> tuple[LogMeta, list[Tensor], bool]:
        """The step's logged keys and values as the last stage has them, and whether the batch is skipped.

        Micro-batches weigh as their losses did (``units``: sizes, or counted tokens with ``loss_weighting`` by
        tokens). In training, on the last stage, the values start with the loss and the skip flag, agreed over
        replicas.
        """
        meta, values = reduce_records(self.module, capture.records, units, self.device, self.module_names)
        if not (train and self.topology.is_last):
            return meta, values, False
        total = sum(units)
        kept = [default_loss(o).detach().float() * (n / total) for o, n in zip(outputs, units) if o is not None]
        loss = torch.stack(kept).sum() if kept else torch.zeros((), device=self.device)
        skipped = self._agree_on_skip(len(kept) < len(outputs))
        return meta, [loss, loss.new_full((), float(skipped)), *values], skipped

    def _agree_on_skip(self, skipped: bool) -> bool:
        """Whether any replica skips the batch (a collective over the last stages of the replicas)."""
        topology = self.topology
        if topology.data_size == 1:
            return skipped
        flag = torch.full((), float(skipped), device=self.device)
        replicas = [topology.rank_of(topology.stage, r) for r in range(topology.data_size)]
        waiting_on_peers(topology, f"agreeing with the other replicas (ranks {replicas}) whether the batch is skipped",
                         lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=topology.data_group))
        return bool(flag.item())

    def _summarizer(self, capture: LogCapture, shared: dict[str, Any]) -> Callable[[list[Any], list[float]], Tensor]:
        """Packs the last stage's loss and logs to travel back along the pipeline behind the last gradient.

        The packet is :func:`~lightning_varuna.trainer.logs.log_sync.pack`'s format.
        """
        def summarize(outputs: list[Any], units: list[float]) -> Tensor:
            meta, values, shared["skipped"] = self._reduce(capture, outputs, units, True)
            shared["meta"], shared["values"] = meta, values
            packet = torch.zeros(SUMMARY_SIZE, dtype=torch.float64, device=self.device)
            fill(packet, meta != self.broadcaster.meta, values)
            return packet

        return summarize

    def _unpack_summary(self, summary: Tensor, shared: dict[str, Any]) -> tuple[LogMeta, Tensor, bool]:
        # one host read: the header, the loss and the skip flag
        changed, n, _, skipped = summary[:2 + _TRAINING_VALUES].tolist()
        if n > summary.numel() - 2:  # too many values for the summary: the last stage broadcasts them
            meta, flat = self.broadcaster.share(shared.get("meta", ()), shared.get("values", []))
            return meta, flat, bool(flat[1])
        meta = self.broadcaster.share_meta(shared.get("meta", ())) if changed else self.broadcaster.meta
        return meta, summary[2 : 2 + int(n)].clone(), bool(skipped)

    def _scale_loss(self, loss: Tensor) -> Tensor:
        # fp16: only the last stage scales; the gradients reaching earlier stages are already scaled
        scaler = getattr(self.precision, "scaler", None)
        return scaler.scale(loss) if scaler is not None else loss

    def _merge_outputs(self, hook: str, outputs: list[Any], sizes: list[int]) -> Any:
        merged = _concat(outputs) if outputs else None
        if hook == "predict_step" and self.topology.pipeline_size > 1:
            box = [merged]
            dist.broadcast_object_list(box, self.topology.pipe_src_rank, group=self.topology.pipe_group)
            merged = box[0]
            if merged is not None:
                merged = _to_device(merged, self.device)
        return merged


_TRAINING_VALUES = 2
"""In training the shared values start with the batch loss and the skip flag (1.0: the batch is skipped)."""

_STEP_CONTEXTS: dict[str, Callable[[Precision], Callable[[], contextlib.AbstractContextManager[Any]]]] = {
    "training_step": lambda p: p.train_step_context,
    "validation_step": lambda p: p.val_step_context,
    "test_step": lambda p: p.test_step_context,
    "predict_step": lambda p: p.predict_step_context,
}


def check_metric_states(module: torch.nn.Module) -> None:
    """Raises a clear error if a torchmetrics metric was built on the meta device (its state has no values)."""
    names = [name for name, metric in module.named_modules() if isinstance(metric, Metric)
             and any(isinstance(value, Tensor) and value.is_meta for value in metric._defaults.values())]
    if names:
        raise ValueError(
            f"The torchmetrics metric(s) {', '.join(names)} were built on the meta device: their states have no values"
            " to start from. Create metrics outside `torch.device('meta')` (the strategy puts only parameters on"
            " meta when the model is built in configure_model or under Trainer.init_module(empty_init=True))."
        )


def _concat(outputs: list[Any]) -> Any:
    if len(outputs) == 1:
        return outputs[0]
    leaves = [tree_flatten(o) for o in outputs]
    spec = leaves[0][1]
    merged: list[Any] = []
    for parts in zip(*(flat for flat, _ in leaves)):
        first = parts[0]
        if isinstance(first, Tensor) and first.dim() > 0:
            merged.append(torch.cat(parts))
        else:
            merged.append(list(parts))
    return tree_unflatten(merged, spec)


def _to_device(value: Any, device: torch.device) -> Any:
    leaves, spec = tree_flatten(value)
    return tree_unflatten([v.to(device) if isinstance(v, Tensor) else v for v in leaves], spec)
