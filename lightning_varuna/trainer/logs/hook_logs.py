"""What is logged in ``on_before_optimizer_step``, merged over the stages of a pipeline.

Each stage holds only its own parameters, so ``lightning.pytorch.utilities.grad_norm(self, norm_type)`` (the
usual way to log gradient norms, from that hook) sees one stage's share of the model. The strategy captures
the scalars every stage logs in that hook (the module's and the callbacks'), gathers them over the pipeline
group, and every stage logs the merged set, as a plain run of the whole model would:

- a key logged on one stage keeps its value; a key logged on several stages (the norm of a tied parameter,
  identical on its holders after the gradient sync) takes the first stage's;
- a total ``grad_<p>_norm_total`` is the p-norm of the merged per-parameter norms (the other keys that start
  with ``grad_<p>_norm``), so a tied parameter counts once; without those, the stages' totals are combined as a
  p-norm.

With a sharded optimizer (``zero_stage=1``) each replica's ``.grad`` holds its rows of the averaged gradient (zeros
elsewhere), so each gradient norm (a key that starts with ``grad_<p>_norm``) is first combined as a p-norm over the
replicas of the stage (one more small all-reduce), then merged over the pipeline as above.

Steady-state cost: one small all-gather over the pipeline per optimizer step (the keys follow only when they
change), and none when neither the module nor any callback overrides ``on_before_optimizer_step``.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule
from torch import Tensor

from lightning_varuna.failstop.failures import waiting_on_peers
from lightning_varuna.pipeline.topology import Topology
from lightning_varuna.trainer.callbacks import trainer_callbacks
from lightning_varuna.trainer.logs.log_sync import LogCapture, LogKwargs, _MetricLog, headers, pack

__all__ = ["HookLogMerger", "OptimizerHookLogs", "logs_in_optimizer_hook"]

HOOK = "on_before_optimizer_step"
_TOTAL = re.compile(r"^grad_(.+)_norm_total$")
_NORM = re.compile(r"^grad_([0-9.]+|inf)_norm")

HookMeta = tuple[tuple[str, LogKwargs], ...]
"""Per key an optimizer hook logged: ``(name, plain log kwargs)``."""


def logs_in_optimizer_hook(module: LightningModule) -> bool:
    """Whether the module or a callback overrides ``on_before_optimizer_step`` (the same answer on every rank)."""
    if type(module).on_before_optimizer_step is not LightningModule.on_before_optimizer_step:
        return True
    return any(type(cb).on_before_optimizer_step is not Callback.on_before_optimizer_step
               for cb in trainer_callbacks(module.trainer))


class OptimizerHookLogs:
    """Around each optimizer step: what ``on_before_optimizer_step`` logs is captured, then merged over the pipeline.

    Args:
        topology: Where this rank sits.
        device: Where the exchanged values live (the process group's device).
        sharded: Whether each replica holds only its shard of the reduced gradient (``zero_stage=1``).
    """

    def __init__(self, topology: Topology, device: torch.device, sharded: bool = False) -> None:
        self.topology = topology
        self.device = device
        self.sharded = sharded
        self._merger: HookLogMerger | None = None
        self._abandon: Callable[[], None] | None = None
        self.skip_merge = False
        """Skip the next merge (once): set by in-place recovery for a step whose update it applied itself."""

    def abandon_attempt(self) -> None:
        """Forgets what this step's hooks logged so far: the step is trained again (in-place recovery)."""
        if self._abandon is not None:
            self._abandon()

    def regroup(self) -> None:
        """Takes the groups the topology has now (after in-place recovery made them again)."""
        self._merger = None

    @contextlib.contextmanager
    def around_step(self, module: LightningModule) -> Iterator[Callable[[], None]]:
        """Yields what the optimizer closure calls when it is done (the hooks run next); merges after the step.

        Nothing is captured with one stage, or when neither the module nor a callback overrides the hook.
        """
        if (self.topology.pipeline_size == 1 and not self.sharded) or not logs_in_optimizer_hook(module):
            yield lambda: None
            return
        capture = LogCapture(module)
        capturing = False
        with contextlib.ExitStack() as hooks:

            def start_capture() -> None:
                nonlocal capturing
                if not capturing:  # once, however often Lightning calls the closure
                    hooks.enter_context(capture.capturing())
                    capturing = True

            def abandon() -> None:
                nonlocal capturing
                hooks.close()  # the step's own capture (its training_step) must not run inside this one
                capture.records.clear()
                capturing = False

            self._abandon = abandon
            try:
                yield start_capture
            finally:
                self._abandon = None
        if self.skip_merge:  # after in-place recovery: some pipeline peers may have merged this step already
            self.skip_merge = False
            return
        if self._merger is None:
            self._merger = HookLogMerger(self.topology.pipe_group, self.topology.pipeline_size, self.device,
                                         self.topology.data_group if self.sharded else None)
        merger = self._merger
        waiting_on_peers(self.topology, f"merging what {HOOK} logged over the pipeline",
                         lambda: merger.replay(module, capture.records))


class HookLogMerger:
    """Merges the scalars the stages of one pipeline logged in ``on_before_optimizer_step`` (see the module doc).

    Args:
        group: The pipeline's process group.
        pipeline_size: P, the number of ranks in ``group``.
        device: Where the exchanged values live (the process group's device).
        replicas_group: With a sharded optimizer, the stage's data-parallel group: gradient norms are combined
            over it first.
    """

    def __init__(self, group: Any, pipeline_size: int, device: torch.device, replicas_group: Any = None) -> None:
        self.group = group
        self.size = pipeline_size
        self.replicas_group = replicas_group
        self.device = device
        self._mine: HookMeta | None = None
        self._metas: list[HookMeta] = []
        self._capacity = 0
        self._recipe: list[tuple[str, dict[str, Any], str, Any]] = []

    def replay(self, module: LightningModule, records: Sequence[tuple[int, str, Any, dict[str, Any]]]) -> None:
        """Merges ``records`` (from a :class:`~lightning_varuna.trainer.logs.log_sync.LogCapture`) and logs the result.

        Collective over the pipeline group: every stage calls it after the same optimizer step.
        """
        latest: dict[str, tuple[Any, dict[str, Any]]] = {}
        local = []
        for _, name, value, kwargs in records:
            if _scalar(value):
                latest.pop(name, None)  # logged twice: the last call counts, in its place
                latest[name] = (value, kwargs)
            else:
                local.append((name, value, kwargs))
        meta = tuple((name, tuple(sorted((k, v) for k, v in kw.items() if _plain(v)))) for name, (_, kw) in
                     latest.items())
        values = [torch.as_tensor(v, dtype=torch.float64, device=self.device).reshape(())
                  for v, _ in latest.values()]
        if self.replicas_group is not None:
            values = self._over_replicas(list(latest), values)
        flat = self._exchange(meta, values)  # may renew the recipe
        merged = merge(self._recipe, flat)
        previous = module._current_fx_name
        module._current_fx_name = HOOK
        try:
            for name, value, kwargs in merged:
                LightningModule.log(module, name, value.float(), **kwargs)
            for name, value, kwargs in local:
                LightningModule.log(module, name, value.metric if isinstance(value, _MetricLog) else value, **kwargs)
        finally:
            module._current_fx_name = previous

    def _over_replicas(self, names: list[str], values: list[Tensor]) -> list[Tensor]:
        """Each gradient norm of a replica's shard combined into the norm over all replicas (the same keys on each)."""
        orders = [(i, float(m.group(1))) for i, name in enumerate(names) if (m := _NORM.match(name)) is not None]
        for infinite in (False, True):
            chosen = [(i, p) for i, p in orders if math.isinf(p) == infinite]
            if not chosen:
                continue
            stacked = torch.stack([values[i] if infinite else values[i].pow(p) for i, p in chosen])
            op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
            dist.all_reduce(stacked, op=op, group=self.replicas_group)
            for (i, p), value in zip(chosen, stacked):
                values[i] = value if infinite else value.pow(1.0 / p)
        return values

    def _exchange(self, meta: HookMeta, values: list[Tensor]) -> Tensor:
        """All stages' values, concatenated in stage order; the keys (and the merge recipe) follow a change."""
        out = self._gather(meta != self._mine, values)
        heads = headers(out)
        if any(changed or not fits for changed, _, fits in heads):
            metas: list[Any] = [None] * self.size
            dist.all_gather_object(metas, meta, group=self.group)
            self._mine, self._metas = meta, metas
            self._recipe = _recipe(metas, self.device)
            if not all(fits for _, _, fits in heads):
                self._capacity = max(len(m) for m in metas)
                out = self._gather(False, values)
        return torch.cat([o[2 : 2 + len(m)] for o, m in zip(out, self._metas, strict=True)])

    def _gather(self, changed: bool, values: list[Tensor]) -> list[Tensor]:
        send = pack(changed, values, self._capacity, self.device)
        out = [torch.empty_like(send) for _ in range(self.size)]
        dist.all_gather(out, send, group=self.group)
        return out


def merge(recipe: list[tuple[str, dict[str, Any], Any, Any]], flat: Tensor) -> list[tuple[str, Tensor, dict[str, Any]]]:
    """``(name, value, log kwargs)`` per merged key, from the stages' values concatenated in stage order."""
    merged = []
    for name, kwargs, kind, source in recipe:
        if kind == "value":
            value = flat[source]
        elif kind == "max":
            value = flat[source].max()
        else:
            value = flat[source].pow(kind).sum().pow(1.0 / kind)
        merged.append((name, value, kwargs))
    return merged


def _recipe(metas: list[HookMeta], device: torch.device) -> list[tuple[str, dict[str, Any], Any, Any]]:
    """``(name, log kwargs, kind, source)`` per merged key, in stage order.

    kind ``"value"``: source is an index into the concatenated values; ``"max"`` or a float p: source indexes
    the norms to combine.
    """
    first: dict[str, tuple[int, LogKwargs]] = {}
    where: dict[str, list[int]] = {}
    index = 0
    for meta in metas:
        for name, frozen in meta:
            first.setdefault(name, (index, frozen))
            where.setdefault(name, []).append(index)
            index += 1
    recipe: list[tuple[str, dict[str, Any], Any, Any]] = []
    for name, (i, frozen) in first.items():
        match = _TOTAL.match(name)
        if match is None:
            recipe.append((name, dict(frozen), "value", i))
            continue
        p = float(match.group(1))
        prefix = f"grad_{match.group(1)}_norm"
        parts = [j for other, (j, _) in first.items() if other != name and other.startswith(prefix)]
        source = torch.tensor(parts or where[name], dtype=torch.long, device=device)
        recipe.append((name, dict(frozen), "max" if math.isinf(p) else p, source))
    return recipe


def _scalar(value: Any) -> bool:
    if isinstance(value, Tensor):
        return value.numel() == 1
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))
