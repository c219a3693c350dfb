"""Logging across stages: what the last stage logs reaches every rank, as the plain run would log it.

During a pipelined step ``LightningModule.log`` is intercepted. Afterwards the last stage reduces what each
micro-batch logged to one value per key (the mean weighted by micro-batch size: the whole batch's value)
and broadcasts the keys and values over the pipeline group. Every rank then logs exactly the same keys, so
``ModelCheckpoint``/``EarlyStopping`` collectives and ``sync_dist=True`` line up across ranks.

A logged torchmetrics metric is logged as itself on every rank: its epoch value comes from ``compute()``, which
gathers its state from every rank (the other stages' copies count nothing). A metric the step creates on its first
use exists only where the step got that far, on the last stage: with the keys, the last stage sends a reset copy of
it, which the other stages register at the same place (:func:`adopt_metrics`).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningModule
from torch import Tensor
from torchmetrics import Metric

from lightning_varuna.trainer.patches import replaced_log

LogKwargs = tuple[tuple[str, Any], ...]
"""The plain (picklable) ``log`` keyword arguments of a key, sorted by name."""
LogMeta = tuple[tuple[str, str | None, LogKwargs, bool], ...]
"""Per key: ``(name, metric path or None, log kwargs, whether a value follows in values)``."""

__all__ = ["LogBroadcaster", "LogCapture", "adopt_metrics", "fill", "headers", "metric_templates", "pack",
           "reduce_fx_name", "reduce_records", "replay"]

_LOG_SIGNATURE = inspect.signature(LightningModule.log)


@dataclass
class LogCapture:
    """Collects ``self.log`` calls made while micro-batches run."""

    module: LightningModule
    records: list[tuple[int, str, Any, dict[str, Any]]] = field(default_factory=list)
    microbatch: int = 0

    @contextlib.contextmanager
    def capturing(self, discard: Callable[[], bool] = lambda: False) -> Iterator[LogCapture]:
        """Replaces ``module.log`` inside the block (calls are dropped while ``discard()``, e.g. in recompute)."""

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if discard():
                return
            if args:  # rare: options passed by position
                bound = _LOG_SIGNATURE.bind(self.module, name, value, *args, **kwargs)
                kwargs = {k: v for k, v in bound.arguments.items() if k not in ("self", "name", "value")}
            if callable(kwargs.get("reduce_fx")):
                kwargs["reduce_fx"] = reduce_fx_name(kwargs["reduce_fx"])
            if isinstance(value, Metric):
                # its step value is what its last forward returned: this micro-batch's, so keep it now
                value = _MetricLog(value, _detached(getattr(value, "_forward_cache", None)))
            self.records.append((self.microbatch, name, value, kwargs))

        with replaced_log(self.module, log):
            yield self


_REDUCE_FX_NAMES = {torch.mean: "mean", torch.sum: "sum", sum: "sum", torch.max: "max", max: "max", torch.min: "min",
                    min: "min"}


def reduce_fx_name(reduce_fx: Callable[..., Any]) -> str:
    """The name of a ``reduce_fx`` callable that Lightning accepts (``torch.max``, ``max``, ...).

    Names travel between stages, and Lightning reduces by them as by the callables. Any other callable is refused
    with Lightning's own error.
    """
    name = _REDUCE_FX_NAMES.get(reduce_fx)
    if name is None:
        raise MisconfigurationException(
            "Only `self.log(..., reduce_fx={min,max,mean,sum})` are supported. If you need a custom reduction, please"
            f" log a `torchmetrics.Metric` instance instead. Found: {reduce_fx}"
        )
    return name


@dataclass(frozen=True)
class _MetricLog:
    """A ``Metric`` logged for one micro-batch, with its step value (its ``_forward_cache``) at that time."""

    metric: Metric
    step_value: Any


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, Tensor) else value


def reduce_records(
    module: LightningModule, records: Sequence[tuple[int, str, Any, dict[str, Any]]], sizes: Sequence[float],
    device: torch.device, names: dict[int, str] | None = None,
) -> tuple[LogMeta, list[Tensor]]:
    """Reduces per-micro-batch log records to one entry per key: ``(meta, values)``.

    A metric object is logged as itself (it accumulates its own state, which gives its epoch value); its
    step value, what its ``forward`` returned for each micro-batch, and numbers are averaged weighted by the
    micro-batch sizes (or counted tokens) they were logged for (the batch's value for means such as a
    micro-averaged accuracy); an explicit ``batch_size`` is summed over micro-batches. ``meta`` holds ``(name,
    metric path or None, log kwargs, whether a value follows in values)`` per key.
    """
    names = names if names is not None else {id(m): n for n, m in module.named_modules()}
    order: list[str] = []
    grouped: dict[str, list[tuple[int, Any, dict[str, Any]]]] = {}
    for k, name, value, kwargs in records:
        if name not in grouped:
            order.append(name)
            grouped[name] = []
        grouped[name].append((k, value, kwargs))
    meta: list[tuple[str, str | None, LogKwargs, bool]] = []
    values: list[Tensor] = []
    for name in order:
        entries = grouped[name]
        kwargs = dict(entries[-1][2])
        if "batch_size" in kwargs and kwargs["batch_size"] is not None:
            kwargs["batch_size"] = sum(e[2].get("batch_size") or 0 for e in entries)
        frozen = tuple(sorted((k, v) for k, v in kwargs.items() if _is_plain(v)))
        value = entries[-1][1]
        weights = [sizes[k] for k, _, _ in entries]
        if isinstance(value, _MetricLog):
            steps = [e[1].step_value for e in entries]
            scalar = all(isinstance(v, Tensor) and v.numel() == 1 for v in steps)
            if id(value.metric) not in names:  # created by the step since the names were taken
                names.update({id(m): n for n, m in module.named_modules()})
            path = names.get(id(value.metric))
            if path is None:
                raise ValueError(
                    f"`self.log({name!r}, metric)` logs a torchmetrics metric that is not a submodule of the"
                    " LightningModule: under pipeline parallelism every stage logs it by its place in the module."
                    " Assign it to an attribute of the module (e.g. `self.acc = ...`, or an nn.ModuleDict)."
                )
            meta.append((name, path, frozen, scalar))
            if scalar:
                values.append(_weighted_mean([v.reshape(()) for v in steps], weights, device))
            continue
        meta.append((name, None, frozen, True))
        values.append(_weighted_mean([v for _, v, _ in entries], weights, device))
    return tuple(meta), values


def _weighted_mean(values: Sequence[Any], weights: Sequence[float], device: torch.device) -> Tensor:
    total = float(sum(weights))
    parts = [torch.as_tensor(v, dtype=torch.float64, device=device).detach() * (w / total)
             for v, w in zip(values, weights, strict=True)]
    return torch.stack(parts).sum() if len(parts) > 1 else parts[0]


def _is_plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def pack(changed: bool, values: Sequence[Tensor], capacity: int, device: torch.device) -> Tensor:
    """The one wire format of logged values between stages: float64 ``[keys changed, n, value_1 .. value_n]``.

    The buffer holds ``capacity`` values; with more (``n > capacity``) only the header is filled, and the receiver
    learns from it that the values follow another way. ``keys changed`` tells the receiver that the list of
    logged keys (sent separately, as an object) is new.
    """
    packet = torch.zeros(2 + capacity, dtype=torch.float64, device=device)
    fill(packet, changed, values)
    return packet


def fill(packet: Tensor, changed: bool, values: Sequence[Tensor]) -> None:
    """Writes ``[changed, n, values]`` into an existing packet (see :func:`pack`)."""
    n = len(values)
    packet[0], packet[1] = float(changed), float(n)
    if n and n <= packet.numel() - 2:
        torch.stack([v.to(torch.float64).reshape(()) for v in values], out=packet[2 : 2 + n])


def headers(packets: Sequence[Tensor]) -> list[tuple[bool, int, bool]]:
    """``(keys changed, n, whether the values fit)`` of each packet (one host read for all)."""
    read = torch.stack([p[:2] for p in packets]).tolist()
    return [(bool(changed), int(n), int(n) <= p.numel() - 2) for (changed, n), p in zip(read, packets, strict=True)]


class LogBroadcaster:
    """Shares the last stage's reduced logs (and the step loss) with the other stages of its pipeline.

    One broadcast of a :func:`pack` packet per step in the steady state. Only when the logged keys change does
    the key list follow (as an object), and the buffer grow if needed.
    """

    def __init__(self, group: Any, src: int, is_src: bool, device: torch.device,
                 module: LightningModule | None = None) -> None:
        self.group = group
        self.module = module
        """Whose logged metrics travel with new keys (:func:`metric_templates`); None: none do."""
        self.src = src
        self.is_src = is_src
        self.device = device
        self._meta: LogMeta | None = None
        self._buffer = pack(False, (), 30, device)

    def share(self, meta: LogMeta, values: list[Tensor]) -> tuple[LogMeta, Tensor]:
        """Returns ``(meta, values)`` as the last stage has them (collective over the pipeline group)."""
        buffer = self._buffer
        if self.is_src:
            fill(buffer, meta != self._meta, values)
        dist.broadcast(buffer, self.src, group=self.group)
        ((changed, n, fits),) = headers([buffer])
        if changed:
            self.share_meta(meta)
        if not fits:  # send the values alone, and keep a buffer that fits
            flat = torch.stack([v.to(torch.float64) for v in values]) if self.is_src else buffer.new_zeros(n)
            dist.broadcast(flat, self.src, group=self.group)
            self._buffer = pack(False, (), n, self.device)
            return self.meta, flat
        return self.meta, buffer[2 : 2 + n].clone()

    @property
    def meta(self) -> LogMeta:
        """The keys last shared."""
        return self._meta or ()

    def share_meta(self, meta: LogMeta) -> LogMeta:
        """Shares new keys from the last stage (collective over the pipeline group)."""
        templates = metric_templates(self.module, meta) if self.is_src and self.module is not None else {}
        box: list[Any] = [meta, templates]
        dist.broadcast_object_list(box, self.src, group=self.group)
        self._meta = box[0]
        if not self.is_src and self.module is not None:
            adopt_metrics(self.module, box[1], self.device)
        return self._meta


def metric_templates(module: LightningModule, meta: LogMeta) -> dict[str, Metric]:
    """Reset copies (on the CPU) of the metrics ``meta`` logs, by their path in ``module``."""
    templates: dict[str, Metric] = {}
    for _, path, _, _ in meta:
        if path is not None and path not in templates:
            template = copy.deepcopy(cast(Metric, module.get_submodule(path)))
            template.reset()
            templates[path] = template.to("cpu")
    return templates


def adopt_metrics(module: LightningModule, templates: dict[str, Metric], device: torch.device) -> None:
    """Registers each template where ``module`` has no metric at its path (its step never got to create it)."""
    for path, template in templates.items():
        parent_path, _, attribute = path.rpartition(".")
        parent = module.get_submodule(parent_path) if parent_path else module
        if not isinstance(getattr(parent, attribute, None), Metric):
            setattr(parent, attribute, template.to(device))


def replay(module: LightningModule, meta: LogMeta, flat: Tensor, skip: int = 0) -> None:
    """Logs ``meta``/``flat`` through the real ``LightningModule.log``.

    The first ``skip`` values of ``flat`` are not logs (the step loss).
    """
    index = skip
    for name, metric_path, frozen, has_value in meta:
        kwargs = dict(frozen)
        if metric_path is not None:
            metric = cast(Metric, module.get_submodule(metric_path))  # reduce_records kept only Metrics' paths
            if has_value:
                # Lightning's step value of a logged Metric is its `_forward_cache`: make it the batch's on
                # every stage (not the last micro-batch's on the last stage and a stale one elsewhere)
                metric._forward_cache = flat[index].float()  # type: ignore[assignment]  # torchmetrics declares it None-only
                index += 1
            LightningModule.log(module, name, metric, **kwargs)
            continue
        LightningModule.log(module, name, flat[index].float(), **kwargs)
        index += 1
