"""A model's measured costs, what auto-configuration plans from: kept as JSON, cached per model and machine.

A :class:`Profile` holds, per segment (the code between two cut points) and for a few micro-batch sizes, the
time of a forward without autograd, of a forward with autograd (a recompute, or a forward without recompute) and
of a backward, and the bytes the forward with autograd keeps for backward; the bytes crossing each cut point;
every parameter's bytes and the segments that use it; the optimizer's state per parameter byte and its step
time; a per-task framework overhead; and the network (:class:`Network`). Times at other micro-batch sizes are
interpolated linearly between the measured sizes and extrapolated from the two nearest.

Profiles are measured by :mod:`lightning_varuna.pipeline.planning.profiler`, or given as a file (which makes choices
reproducible), and cached in :func:`cache_dir` keyed by the model's structure and the machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, overload

import torch

from lightning_varuna.files.atomic_write import write_atomic

__all__ = [
    "PROFILE_VERSION", "CutProfile", "Link", "Network", "ParamProfile", "Profile", "ProfileError", "SegmentProfile",
    "cache_dir", "default_network", "load_cached", "machine_description", "store_cached",
]

PROFILE_VERSION = 1
CACHE_ENV = "LIGHTNING_VARUNA_CACHE_DIR"


class ProfileError(ValueError):
    """A profile that cannot be used: unreadable, of another version, or of another model."""


@dataclass(frozen=True)
class Link:
    """A transfer's cost: ``latency_s + bytes / bandwidth``.

    Attributes:
        latency_s: Seconds per transfer, whatever its size.
        bandwidth: Bytes per second.
    """

    latency_s: float
    bandwidth: float

    def seconds(self, nbytes: float) -> float:
        """The time of one transfer of ``nbytes``."""
        return self.latency_s + nbytes / self.bandwidth


@dataclass(frozen=True)
class Network:
    """Point-to-point and all-reduce costs between processes of one node and between nodes.

    A ring all-reduce of ``N`` bytes over ``n`` ranks takes ``2 (n-1)`` steps, each sending ``N / n`` bytes:
    ``2 (n-1) latency + 2 (n-1) / n * N / bandwidth`` with the per-step :class:`Link` of the all-reduce; a
    reduce-scatter and an all-gather are its two halves (``n-1`` steps each), as the sharded optimizer runs them. When
    ``sharing`` all-reduces cross the same node's link at once, each gets ``bandwidth / sharing``.

    Attributes:
        p2p_intra: One message between two processes of a node.
        p2p_inter: One message between processes of two nodes.
        allreduce_intra: A ring step of an all-reduce inside a node.
        allreduce_inter: A ring step of an all-reduce that spans nodes.
    """

    p2p_intra: Link
    p2p_inter: Link
    allreduce_intra: Link
    allreduce_inter: Link

    def p2p(self, crosses_nodes: bool) -> Link:
        """The link of a pipeline boundary's messages."""
        return self.p2p_inter if crosses_nodes else self.p2p_intra

    def allreduce(self, nbytes: float, ranks: int, crosses_nodes: bool, sharing: int = 1) -> float:
        """Seconds of one all-reduce of ``nbytes`` over ``ranks`` ranks (0 for a single rank)."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        link = self.allreduce_inter if crosses_nodes else self.allreduce_intra
        steps = 2 * (ranks - 1)
        return steps * link.latency_s + steps / ranks * nbytes * max(1, sharing) / link.bandwidth

    def reduce_scatter(self, nbytes: float, ranks: int, crosses_nodes: bool, sharing: int = 1) -> float:
        """Seconds of a ring reduce-scatter of ``nbytes`` (the first half of :meth:`allreduce`: ``n-1`` steps)."""
        return self.allreduce(nbytes, ranks, crosses_nodes, sharing) / 2

    def all_gather(self, nbytes: float, ranks: int, crosses_nodes: bool, sharing: int = 1) -> float:
        """Seconds of a ring all-gather whose result is ``nbytes`` (the second half of :meth:`allreduce`)."""
        return self.allreduce(nbytes, ranks, crosses_nodes, sharing) / 2

    def with_inter_node(self, bandwidth: float | None = None, latency_s: float | None = None) -> Network:
        """A copy whose links between nodes have the given bandwidth (bytes/s) and latency, where given."""
        def link(old: Link) -> Link:
            return Link(old.latency_s if latency_s is None else latency_s,
                        old.bandwidth if bandwidth is None else bandwidth)

        return replace(self, p2p_inter=link(self.p2p_inter), allreduce_inter=link(self.allreduce_inter))


def default_network(device_type: str) -> Network:
    """Stated defaults where nothing was measured: what a node of this kind typically has.

    CPU (gloo over loopback): 50 us and 2 GB/s inside a node. CUDA (NVLink class): 10 us and 100 GB/s inside a
    node. Between nodes: 25 us and 25 Gbit/s (3.1 GB/s), a commodity data-centre network.
    """
    inter = Link(25e-6, 25e9 / 8)
    intra = Link(10e-6, 100e9) if device_type == "cuda" else Link(50e-6, 2e9)
    return Network(p2p_intra=intra, p2p_inter=inter, allreduce_intra=intra, allreduce_inter=inter)


@dataclass(frozen=True)
class SegmentProfile:
    """One segment's costs, one value per measured micro-batch size (:attr:`Profile.microbatch_sizes`).

    Attributes:
        forward_s: A forward without autograd (a recomputing stage's forward).
        forward_grad_s: A forward with autograd (a recompute, or any forward without recompute).
        backward_s: The backward.
        saved_bytes: Bytes a forward with autograd keeps for the backward (parameters excluded).
    """

    forward_s: tuple[float, ...]
    forward_grad_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    saved_bytes: tuple[float, ...]
    """Measured bytes, smoothed over the sizes (so not always whole)."""


@dataclass(frozen=True)
class CutProfile:
    """The activation crossing one cut point.

    Attributes:
        name: The cut point's name.
        nbytes_per_sample: Bytes per sample (``scales``), or of the whole tensor (not ``scales``).
        scales: Whether a dimension of the tensor scales with the batch.
    """

    name: str
    nbytes_per_sample: int
    scales: bool = True

    @overload
    def nbytes(self, microbatch_size: int) -> int: ...

    @overload
    def nbytes(self, microbatch_size: float) -> float: ...

    def nbytes(self, microbatch_size: float) -> float:
        """Bytes of the activation of one micro-batch."""
        return self.nbytes_per_sample * microbatch_size if self.scales else self.nbytes_per_sample


@dataclass(frozen=True)
class ParamProfile:
    """One parameter: its bytes, the segments that use it (several for a tied weight), and whether it trains."""

    name: str
    nbytes: int
    segments: tuple[int, ...]
    trainable: bool = True


@dataclass(frozen=True)
class Profile:
    """What auto-configuration knows about a model on a machine (see the module's docstring).

    Attributes:
        microbatch_sizes: The measured micro-batch sizes, ascending.
        segments: One entry per segment.
        cuts: One entry per cut point (``len(segments) - 1``).
        params: Every parameter of the model, in ``named_parameters()`` order.
        crossings: Pairs of segments that must share a stage (a value crosses between them outside a cut point).
        optimizer_state_ratio: Optimizer state bytes per trainable parameter byte (2 for Adam).
        optimizer_s_per_byte: Seconds of an optimizer step per trainable parameter byte.
        task_overhead_s: The executor's own time per task (forward, recompute or backward of a micro-batch).
        network: Transfer costs (:func:`default_network` where nothing was measured).
        machine: A description of the machine the times were measured on.
        key: The model structure's key (:func:`structure_key`), to check that a profile fits a model.
    """

    microbatch_sizes: tuple[int, ...]
    segments: tuple[SegmentProfile, ...]
    cuts: tuple[CutProfile, ...]
    params: tuple[ParamProfile, ...]
    crossings: tuple[tuple[int, int], ...] = ()
    optimizer_state_ratio: float = 2.0
    optimizer_s_per_byte: float = 0.0
    task_overhead_s: float = 0.0
    network: Network = field(default_factory=lambda: default_network("cpu"))
    machine: str = ""
    key: str = ""

    def __post_init__(self) -> None:
        sizes = self.microbatch_sizes
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ProfileError(f"microbatch_sizes must be ascending positive sizes, got {sizes}.")
        if len(self.cuts) != len(self.segments) - 1:
            raise ProfileError(f"{len(self.segments)} segment(s) need {len(self.segments) - 1} cut(s), got "
                               f"{len(self.cuts)}.")
        for index, segment in enumerate(self.segments):
            for name in ("forward_s", "forward_grad_s", "backward_s", "saved_bytes"):
                if len(getattr(segment, name)) != len(sizes):
                    raise ProfileError(f"segment {index}: {name} needs one value per micro-batch size {sizes}.")

    @property
    def num_segments(self) -> int:
        """The number of segments."""
        return len(self.segments)

    def forward(self, segment: int, microbatch_size: float, grad: bool) -> float:
        """Seconds of a forward of one segment, with or without autograd."""
        values = self.segments[segment].forward_grad_s if grad else self.segments[segment].forward_s
        return interpolate(self.microbatch_sizes, values, microbatch_size)

    def backward(self, segment: int, microbatch_size: float) -> float:
        """Seconds of a backward of one segment."""
        return interpolate(self.microbatch_sizes, self.segments[segment].backward_s, microbatch_size)

    def saved_bytes(self, segment: int, microbatch_size: float) -> int:
        """Bytes one micro-batch's autograd graph keeps in one segment."""
        return int(interpolate(self.microbatch_sizes, self.segments[segment].saved_bytes, microbatch_size))

    def segment_costs(self, microbatch_size: float) -> list[float]:
        """Each segment's forward with autograd plus backward: what stages are balanced by."""
        return [self.forward(i, microbatch_size, True) + self.backward(i, microbatch_size)
                for i in range(self.num_segments)]

    def param_costs(self) -> list[float]:
        """Each segment's parameter bytes, a shared parameter split evenly over its segments."""
        costs = [0.0] * self.num_segments
        for param in self.params:
            for segment in param.segments:
                costs[segment] += param.nbytes / len(param.segments)
        return costs

    def scaled(self, factor: float) -> Profile:
        """The same profile with every compute time (segments, optimizer, task overhead) times ``factor``."""
        segments = tuple(
            replace(s, forward_s=_times(s.forward_s, factor), forward_grad_s=_times(s.forward_grad_s, factor),
                    backward_s=_times(s.backward_s, factor))
            for s in self.segments
        )
        return replace(self, segments=segments, optimizer_s_per_byte=self.optimizer_s_per_byte * factor,
                       task_overhead_s=self.task_overhead_s * factor)

    # -- files --------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dictionary (see :meth:`from_dict`)."""
        return {"version": PROFILE_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        """The profile of :meth:`to_dict`'s dictionary.

        Raises:
            ProfileError: If it is of another version or misses a field.
        """
        if data.get("version") != PROFILE_VERSION:
            raise ProfileError(f"profile version {data.get('version')!r}; this version reads {PROFILE_VERSION}.")
        try:
            net = data["network"]
            return cls(
                microbatch_sizes=tuple(data["microbatch_sizes"]),
                segments=tuple(SegmentProfile(*(tuple(s[k]) for k in ("forward_s", "forward_grad_s", "backward_s",
                                                                        "saved_bytes"))) for s in data["segments"]),
                cuts=tuple(CutProfile(**c) for c in data["cuts"]),
                params=tuple(ParamProfile(p["name"], p["nbytes"], tuple(p["segments"]), p.get("trainable", True))
                             for p in data["params"]),
                crossings=tuple(tuple(c) for c in data.get("crossings", ())),
                optimizer_state_ratio=float(data.get("optimizer_state_ratio", 2.0)),
                optimizer_s_per_byte=float(data.get("optimizer_s_per_byte", 0.0)),
                task_overhead_s=float(data.get("task_overhead_s", 0.0)),
                network=Network(**{k: Link(**v) for k, v in net.items()}),
                machine=data.get("machine", ""),
                key=data.get("key", ""),
            )
        except (KeyError, TypeError) as err:
            raise ProfileError(f"the profile misses or mistypes a field ({err!r}).") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the profile as JSON (atomically: a reader never sees half a file)."""
        write_atomic(path, json.dumps(self.to_dict(), indent=1).encode())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        """Reads a profile written by :meth:`save`.

        Raises:
            ProfileError: If the file cannot be read or is not a profile.
        """
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise ProfileError(f"cannot read the profile {str(path)!r}: {err}") from None
        return cls.from_dict(data)


def interpolate(sizes: Sequence[int], values: Sequence[float], x: float) -> float:
    """Piecewise-linear through ``(sizes, values)``, extrapolated from the nearest two points, at least 0.

    With one point the value is taken as proportional to the size.
    """
    if len(sizes) == 1:
        return max(0.0, values[0] * x / sizes[0])
    index = 1
    while index < len(sizes) - 1 and sizes[index] < x:
        index += 1
    x0, x1, y0, y1 = sizes[index - 1], sizes[index], values[index - 1], values[index]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def _times(values: tuple[float, ...], factor: float) -> tuple[float, ...]:
    return tuple(v * factor for v in values)


# -- cache ----------------------------------------------------------------------------------------------------
def cache_dir() -> Path:
    """Where measured profiles are kept (never the working directory).

    ``$LIGHTNING_VARUNA_CACHE_DIR``, else ``$XDG_CACHE_HOME/lightning-varuna``, else ``~/.cache/lightning-varuna``.
    """
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lightning-varuna"


def _cache_file(key: str) -> Path:
    return cache_dir() / "profiles" / f"{key}.json"


def load_cached(key: str) -> Profile | None:
    """The cached profile of ``key``, or None (also for an unreadable or outdated file)."""
    path = _cache_file(key)
    if not path.is_file():
        return None
    try:
        profile = Profile.load(path)
    except ProfileError:
        return None
    return profile if profile.key == key else None


def store_cached(profile: Profile) -> Path | None:
    """Keeps ``profile`` under its key; returns the file, or None if the cache directory is not writable."""
    path = _cache_file(profile.key)
    try:
        profile.save(path)
    except OSError:
        return None
    return path


def machine_description(device: torch.device) -> str:
    """What the times depend on besides the model: the device (or CPU model and threads) and torch's version."""
    if device.type == "cuda":
        what = torch.cuda.get_device_name(device)
    else:
        what = f"{_cpu_model()} x{torch.get_num_threads()} threads"
    return f"{device.type}: {what}; torch {torch.__version__}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def structure_key(*parts: object) -> str:
    """A short hash of ``parts`` (JSON-able: the model's structure, the machine, the profiling settings)."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]
