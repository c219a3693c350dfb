"""What a :class:`~lightning_varuna.pipeline.engine.PipelineEngine` is asked to do, checked once when created."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from typing_extensions import TypeIs

from lightning_varuna.pipeline.batches import LOSS_WEIGHTINGS, TokenCounter
from lightning_varuna.pipeline.runtime.selective_recompute import selective_contexts
from lightning_varuna.pipeline.scheduling.schedules import SCHEDULES, check_schedule_shape, schedule_spec
from lightning_varuna.pipeline.scheduling.tasks import ScheduleError

__all__ = [
    "AUTO", "P2P_BACKENDS", "PARTITIONS", "EngineConfig", "MicrobatchSize", "P2PBackend", "PartitionBy",
    "LossWeighting", "PipelineSize", "Recompute", "ScheduleName", "StagesPerRank", "ZeroStage", "parse_bytes",
]

AUTO = "auto"

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

# The options' types, written once: EngineConfig's fields and VarunaStrategy's parameters (which LightningCLI reads)
PipelineSize = int | Literal["auto"]
MicrobatchSize = int | Literal["auto"] | None
ScheduleName = Literal["varuna", "1f1b", "gpipe", "zero-bubble", "interleaved", "zero-bubble-v", "auto"]
Recompute = bool | int | Literal["auto"]
PartitionBy = Literal["time", "params"]
P2PBackend = Literal["auto", "nccl", "gloo"]
ZeroStage = Literal[0, 1]
StagesPerRank = int | Literal["auto"]
LossWeighting = Literal["samples", "tokens", "shifted_tokens"] | TokenCounter

PARTITIONS: tuple[str, ...] = get_args(PartitionBy)
P2P_BACKENDS: tuple[str, ...] = get_args(P2PBackend)


@dataclass(frozen=True)
class EngineConfig:
    """The engine's options. Invalid values raise ``ValueError`` with what to change, before any process waits.

    Any of ``pipeline_parallel_size`` (with ``global_batch_size``), ``microbatch_size``, ``schedule`` and
    ``recompute`` may be ``"auto"``: the engine then profiles the model and chooses them
    (:mod:`lightning_varuna.pipeline.planning.choice`).

    Args:
        pipeline_parallel_size: P, the number of stages (D = world size / P). ``"auto"``: chosen by the planner
            when ``global_batch_size`` is given; otherwise the largest P that divides the world size, is at most
            the number of segments the dry run finds and at most ``max_pipeline_size``.
        num_microbatches: Micro-batches per batch. Default: ``2 * P``. A batch with fewer samples (the last one
            without ``drop_last``) runs one micro-batch per sample.
        microbatch_size: Alternatively, the size of each micro-batch; ``"auto"``: chosen by the planner among the
            sizes that divide the replica's batch.
        schedule: ``"varuna"``, ``"1f1b"``, ``"gpipe"``, ``"zero-bubble"``, ``"interleaved"`` (with
            ``stages_per_rank >= 2``), ``"zero-bubble-v"`` (with ``stages_per_rank=2``: the V schedule over the
            V-shaped placement, rank ``r`` holding stages ``r`` and ``2 P - 1 - r``) or ``"auto"``.
        recompute: Non-last stages keep only their inputs during forwards and recompute before backward
            (``"auto"``: chosen by the planner). A number ``n``: only the first ``n`` segments of each non-last
            stage recompute, the rest keep their autograd graph as without recompute (recompute by degree; a stage
            of at most ``n`` segments recomputes whole).
        recompute_policy: With ``recompute=True``: the ops whose outputs a forward keeps so that the recompute
            takes them instead of running those ops again (selective recompute), in the format of torch's selective
            activation checkpointing: a function ``(ctx, op, *args, **kwargs)`` returning a
            ``torch.utils.checkpoint.CheckpointPolicy`` (or a bool: save), or a list of ops such as
            ``[torch.ops.aten.mm.default]``. Saving the expensive ops makes the recompute cheap for the memory of
            their outputs (:mod:`~lightning_varuna.pipeline.runtime.selective_recompute`).
        cut_at: Dotted path of an ``nn.ModuleList``/``nn.Sequential`` to cut between its children, or several
            such paths in execution order (an encoder-decoder's two stacks), cut after each of their blocks.
        partition: Balance stages by measured ``"time"`` or by ``"params"``.
        p2p_timeout: Seconds a stage waits for a peer before it ends the job with an error.
        boundary_dtype: If set, floating-point activations and gradients cross stage boundaries in this dtype and
            are cast back on arrival.
        grad_bucket_bytes: Size of a data-parallel all-reduce bucket (default: a quarter of the stage's
            gradient, within 64 KiB-25 MiB).
        overlap_grad_sync: Whether buckets start reducing during the stage's last backward of a step.
        fuse_grad_accumulation: Whether ``nn.Linear`` layers add each later micro-batch's weight gradient straight
            into ``.grad`` (one multiply-add) instead of making it apart and adding it: no weight-sized temporary
            (:mod:`~lightning_varuna.pipeline.runtime.fused_linear_grad`). Weights under ``MIN_FUSED_NUMEL``
            (2^20) elements keep autograd's way, except under zero-bubble schedules.
        max_pipeline_size: With ``pipeline_parallel_size="auto"`` and no ``global_batch_size``, P is at most this
            (e.g. the processes per node, so that pipelines stay inside a node).
        global_batch_size: Samples per step over all replicas: each replica's batch is ``global_batch_size / D``,
            which the planner needs to choose P.
        memory_limit: Bytes (or a string such as ``"80GiB"``) a stage may use; configurations predicted above
            90% of it are never chosen (10% kept in reserve). Default: the device's memory (CUDA), or the
            machine's memory shared by the processes of the node (CPU). Given with every value fixed, the planner
            still runs: it predicts the fixed configuration's peak and raises ``PlanError`` if it does not fit.
        profile: A profile file (:class:`~lightning_varuna.pipeline.planning.profile_data.Profile`) to plan from instead
            of measuring: the same file gives the same choice (and the stages are balanced by its costs, also when every
            value is fixed).
        devices_per_node: Processes per node (default: all processes on one node); tells the planner which
            traffic crosses nodes.
        param_init_fn: For a model built on the meta device: initializes the parameters a module owns directly
            (default: the module's ``reset_parameters()``).
        init_seed: The seed of that initialization (default: rank 0's ``torch.initial_seed()``).
        p2p_backend: The backend of the pipeline's sends and receives. ``"auto"``: the default process group's
            (NCCL for a CUDA job). ``"gloo"``: through pinned host memory over gloo, data-parallel all-reduces
            staying on the default backend (what Varuna shipped; for CUDA jobs where NCCL's point-to-point
            misbehaves, or whose processes share a GPU). ``"nccl"``: NCCL even if the default group is gloo
            (CUDA only).
        zero_stage: 1: each replica keeps the optimizer state of, and steps, one shard of every parameter
            (gradients reduce-scattered, parameters all-gathered after the step; ZeRO stage 1); 0: every replica
            keeps all of it. 2 and 3 are refused.
        stages_per_rank: Model chunks per rank ``v``: the model is cut into ``P v`` stages and rank ``r`` runs stages
            ``r, r + P, ...`` (the looped placement), which divides the pipeline's fill and drain time by ``v`` at
            the cost of ``v`` times the messages. Needs ``schedule="interleaved"`` (micro-batches divisible by ``P``)
            or ``"zero-bubble"`` (``v <= 2``), or ``v = 2`` with ``"zero-bubble-v"`` (stages ``r`` and
            ``2 P - 1 - r`` on rank ``r``). ``"auto"``: the planner chooses 1 or 2.
        loss_weighting: What weights each micro-batch's loss within its batch: ``"samples"`` (``size_k / batch``),
            ``"tokens"`` (its labels other than -100 over the batch's), ``"shifted_tokens"`` (the same of
            ``labels[..., 1:]``, for causal language models that shift inside) or a function of the micro-batch
            returning its count (:func:`~lightning_varuna.pipeline.batches.count_loss_units`).
    """

    pipeline_parallel_size: PipelineSize = "auto"
    num_microbatches: int | None = None
    microbatch_size: MicrobatchSize = None
    schedule: ScheduleName = "varuna"
    recompute: Recompute = True
    recompute_policy: Callable[..., Any] | tuple[Any, ...] | list[Any] | None = None
    cut_at: str | tuple[str, ...] | None = None
    partition: PartitionBy = "time"
    p2p_timeout: float = 300.0
    boundary_dtype: torch.dtype | None = None
    grad_bucket_bytes: int | None = None
    overlap_grad_sync: bool = True
    fuse_grad_accumulation: bool = True
    max_pipeline_size: int | None = None
    param_init_fn: Callable[[torch.nn.Module], None] | None = None
    init_seed: int | None = None
    p2p_backend: P2PBackend = "auto"
    global_batch_size: int | None = None
    memory_limit: int | str | None = None
    profile: str | None = None
    devices_per_node: int | None = None
    zero_stage: ZeroStage = 0
    stages_per_rank: StagesPerRank = 1
    loss_weighting: LossWeighting = "samples"

    def __post_init__(self) -> None:
        if self.zero_stage in (2, 3):
            raise ValueError(
                f"zero_stage={self.zero_stage} is not possible in a pipeline: inside a step each stage's gradients"
                " add up over the micro-batches until the last one's backward, so they cannot be sharded and dropped"
                f" after each backward{' (nor the parameters between micro-batches)' if self.zero_stage == 3 else ''}."
                " Use zero_stage=1 (optimizer state sharded over the replicas), which saves the most memory here."
            )
        if self.zero_stage not in (0, 1) or isinstance(self.zero_stage, bool):
            raise ValueError(f"zero_stage must be 0 or 1, got {self.zero_stage!r}.")
        size = self.pipeline_parallel_size
        if size != AUTO and (not _is_int(size) or size < 1):
            raise ValueError(f"pipeline_parallel_size must be a positive int or 'auto', got {size!r}.")
        if self.schedule not in (*SCHEDULES, AUTO):
            raise ValueError(f"schedule={self.schedule!r}: choose one of {SCHEDULES} or 'auto'.")
        if not (isinstance(self.recompute, bool) or self.recompute == AUTO
                or (_is_int(self.recompute) and self.recompute >= 1)):
            raise ValueError(f"recompute must be True, False, 'auto' or a number of segments >= 1 (recompute by"
                             f" degree), got {self.recompute!r}.")
        _check_recompute_policy(self)
        _check_chunks_of(self)
        micro = self.microbatch_size
        if self.num_microbatches is not None and micro is not None and micro != AUTO:
            raise ValueError("Give num_microbatches or microbatch_size, not both.")
        if micro == AUTO and self.num_microbatches is not None:
            raise ValueError("microbatch_size='auto' chooses the number of micro-batches too; leave num_microbatches"
                             " unset, or set microbatch_size=None to keep a fixed num_microbatches.")
        if self.memory_limit is not None:
            parse_bytes(self.memory_limit)
        for name in ("num_microbatches", "microbatch_size", "grad_bucket_bytes", "max_pipeline_size",
                     "global_batch_size", "devices_per_node"):
            value = getattr(self, name)
            if value == AUTO and name == "microbatch_size":
                continue
            if value is not None and not _is_int(value):
                also = " or 'auto'" if name == "microbatch_size" else ""
                raise ValueError(f"{name} must be an int{also}, got {value!r}.")
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}.")
        if self.partition not in PARTITIONS:
            raise ValueError(f"partition={self.partition!r}: use 'time' or 'params'.")
        if isinstance(self.cut_at, list):  # from a config file: one value, hashable like the others
            object.__setattr__(self, "cut_at", tuple(self.cut_at))
        paths = (self.cut_at,) if isinstance(self.cut_at, str) else self.cut_at
        if paths is not None and (not isinstance(paths, tuple) or not paths
                                  or not all(isinstance(p, str) and p for p in paths)):
            raise ValueError(f"cut_at must be a dotted path string such as 'model.blocks', or a list of them such as"
                             f" ['model.encoder.block', 'model.decoder.block'], got {self.cut_at!r}.")
        if self.param_init_fn is not None and not callable(self.param_init_fn):
            raise ValueError(
                f"param_init_fn must be a callable taking a module, got {self.param_init_fn!r}."
            )
        if self.init_seed is not None and not _is_int(self.init_seed):
            raise ValueError(f"init_seed must be an int or None, got {self.init_seed!r}.")
        if self.p2p_backend not in P2P_BACKENDS:
            raise ValueError(f"p2p_backend={self.p2p_backend!r}: choose one of {P2P_BACKENDS}.")
        if not callable(self.loss_weighting) and self.loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(f"loss_weighting={self.loss_weighting!r}: choose one of {LOSS_WEIGHTINGS} or pass a"
                             " function of a micro-batch that returns its token count.")
        timeout = self.p2p_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"p2p_timeout must be a positive number of seconds, got {timeout!r}.")

    @property
    def recomputes(self) -> bool:
        """Whether non-last stages recompute (all or some of their segments); not for ``"auto"``."""
        return self.recompute is not False

    @property
    def recompute_segments(self) -> int | None:
        """With recompute by degree, how many of each non-last stage's first segments recompute; else None."""
        return None if isinstance(self.recompute, (bool, str)) else self.recompute

    @property
    def searches(self) -> bool:
        """Whether the planner runs at setup: it chooses a value, plans from a profile, or checks a memory_limit.

        A ``memory_limit`` the configuration is not checked against would be silently unused.
        """
        return (self.schedule == AUTO or self.recompute == AUTO or self.microbatch_size == AUTO
                or self.stages_per_rank == AUTO
                or (self.pipeline_parallel_size == AUTO and self.global_batch_size is not None)
                or self.profile is not None or self.memory_limit is not None)

    def pipeline_size_for(self, world_size: int, num_segments: int) -> int:
        """P for a world of ``world_size`` processes and a model of ``num_segments`` segments (without the planner)."""
        if isinstance(self.pipeline_parallel_size, int):
            return self.pipeline_parallel_size
        limit = min(num_segments, world_size, self.max_pipeline_size or world_size)
        return max(p for p in range(1, limit + 1) if world_size % p == 0)

    def link_backend(self, device: torch.device) -> str | None:
        """The backend of the link groups on ``device`` (None: the default group's).

        Raises:
            ValueError: For ``p2p_backend="nccl"`` on a device that is not CUDA.
        """
        if self.p2p_backend == "nccl" and device.type != "cuda":
            raise ValueError(
                f"p2p_backend='nccl' needs CUDA devices; this rank runs on {device}. Use 'auto' or 'gloo'."
            )
        return None if self.p2p_backend == "auto" else self.p2p_backend


def parse_bytes(value: int | str) -> int:
    """Bytes from an int or a string such as ``"80GiB"``, ``"512 MiB"``, ``"1.5GB"`` (GB = 10**9, GiB = 2**30).

    Raises:
        ValueError: For anything else, or a size below 1 byte.
    """
    if isinstance(value, bool):
        raise ValueError(f"a memory size must be bytes or a string such as '80GiB', got {value!r}.")
    if isinstance(value, int):
        number = value
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"memory size {value!r}: write bytes or a number with a unit, e.g. '80GiB' or '500MB'.")
        number = int(float(match.group(1)) * _UNITS[unit])
    if number < 1:
        raise ValueError(f"a memory size must be at least 1 byte, got {value!r}.")
    return number


def _check_chunks_of(config: EngineConfig) -> None:
    """Raises ``ValueError`` naming the nearest valid choices if ``stages_per_rank`` and the schedule do not fit."""
    v = config.stages_per_rank
    if v == AUTO:  # the planner chooses among the chunk counts the schedule can run
        if config.pipeline_parallel_size == 1:
            raise ValueError("stages_per_rank='auto' needs a pipeline: with pipeline_parallel_size=1 leave it at 1.")
        return
    if not _is_int(v) or v < 1:
        raise ValueError(f"stages_per_rank must be an int >= 1 or 'auto', got {v!r}.")
    size = config.pipeline_parallel_size
    if size == 1 and v > 1:
        raise ValueError(f"stages_per_rank={v} needs a pipeline (pipeline_parallel_size >= 2); use stages_per_rank=1.")
    if config.schedule == AUTO or (v == 1 and not schedule_spec(config.schedule).needs_several_chunks):
        return  # with "auto" the planner searches the schedules that run v chunks per rank
    try:
        check_schedule_shape(config.schedule, 1, v, None)
    except ScheduleError as err:
        raise ValueError(str(err)) from None
    try:
        check_schedule_shape(config.schedule, size if isinstance(size, int) else 1, v,
                             config.num_microbatches if size != AUTO else None)
    except ScheduleError as err:
        raise ValueError(str(err)) from None


def _check_recompute_policy(config: EngineConfig) -> None:
    """A recompute policy needs whole-stage recompute, chosen by the user (the planner cannot size what it keeps)."""
    policy = config.recompute_policy
    if policy is None:
        return
    if isinstance(policy, list):  # from a config file: one value, hashable like the others
        policy = tuple(policy)
        object.__setattr__(config, "recompute_policy", policy)
    if callable(policy) and type(policy).__module__ == "torch._ops":  # an op is callable, but not a policy
        raise ValueError(f"recompute_policy={policy!r} is an op, not a policy function: pass a list of ops such as"
                         " [torch.ops.aten.mm.default].")
    if not callable(policy) and not (isinstance(policy, tuple) and policy):
        raise ValueError(f"recompute_policy must be a function (ctx, op, *args, **kwargs) -> CheckpointPolicy or a"
                         f" non-empty list of ops such as [torch.ops.aten.mm.default], got {policy!r}.")
    if isinstance(policy, tuple):
        try:  # torch's own check of the ops (an OpOverload each, not a packet such as torch.ops.aten.mm)
            selective_contexts(list(policy))
        except ValueError as error:
            raise ValueError(f"recompute_policy: {error}") from None
    if config.recompute is not True:
        raise ValueError(
            f"recompute_policy applies to the recompute of whole stages, but recompute={config.recompute!r}. Use"
            " recompute=True with it, or leave recompute_policy unset."
        )
    if config.searches:
        raise ValueError(
            "recompute_policy cannot be used with 'auto' values, a profile or a memory_limit: the planner cannot"
            " predict the memory the policy keeps. Set pipeline_parallel_size (or leave global_batch_size unset), the"
            " micro-batches, schedule, recompute and stages_per_rank yourself, and leave memory_limit unset."
        )


def _is_int(value: object) -> TypeIs[int]:
    return isinstance(value, int) and not isinstance(value, bool)
