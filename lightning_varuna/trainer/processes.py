"""The job's processes: one per device, laid out as P x D, one default process group, Lightning's collectives.

:class:`ProcessGroupStrategy` is the part of the strategy that concerns processes: devices and ranks, the P x D
layout (checked before any process starts, and how the sampler splits the data among replicas), the launcher,
the default process group (started as Lightning's own ``DDPStrategy`` starts it, with the same private helpers of
``lightning.fabric``; see the private-API list in ``docs/architecture.md``), and Lightning's barrier, broadcast and
``sync_dist`` reduction. Once the pipeline exists each collective goes through
:func:`~lightning_varuna.failstop.failures.waiting_on_peers`, so a peer that failed or hung turns into a
:class:`~lightning_varuna.failstop.failures.PipelineError` that names it, within the job's timeout.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Generator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_varuna.failstop.failures import PipelineError, waiting_on_peers
from lightning_varuna.failstop.job_watchdog import current_watchdog
from lightning_varuna.pipeline.engine import PipelineEngine
from lightning_varuna.pipeline.model.meta_init import has_meta_tensors, move_real_tensors, parameters_on_meta
from lightning_varuna.pipeline.topology import Topology
from lightning_varuna.trainer.data import check_global_batch
from lightning_varuna.trainer.launcher import PipelineLauncher

__all__ = ["ProcessGroupStrategy", "global_grad_norm", "is_initialized", "stop_watching_peers",
           "waiting", "watch_peers"]


class ProcessGroupStrategy(ParallelStrategy):
    """One process per device of every node on one default process group, with Lightning's collectives over it.

    A subclass sets :attr:`topology` once the pipeline exists; from then on every collective's wait is bounded and
    its failure names the rank.

    The first five arguments are ``ParallelStrategy``'s (the Trainer sets them); ``process_group_backend`` is
    ``"gloo"`` or ``"nccl"`` (None: the device's default), ``timeout`` bounds the default group's collectives;
    ``pipeline_parallel_size`` (P, or ``"auto"``) and ``global_batch_size`` are the strategy's, checked against the
    number of processes before any is started.
    """

    def __init__(self, accelerator: Accelerator | None, parallel_devices: list[torch.device] | None,
                 cluster_environment: ClusterEnvironment | None, checkpoint_io: CheckpointIO | None,
                 precision_plugin: Precision | None, process_group_backend: str | None, timeout: timedelta, *,
                 pipeline_parallel_size: int | str = "auto", global_batch_size: int | None = None) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.num_nodes = 1
        self.topology: Topology | None = None
        self.pipeline_parallel_size = pipeline_parallel_size
        self.global_batch_size = global_batch_size

    @property
    @override
    def root_device(self) -> torch.device:
        """This process's device."""
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def attached_module(self) -> LightningModule:
        """The ``LightningModule`` being run (Lightning attaches it before any hook that reads it)."""
        module = self.lightning_module
        if module is None:
            raise RuntimeError("VarunaStrategy: no LightningModule is attached (the Trainer has not connected one).")
        return module

    @property
    def num_processes(self) -> int:
        """Processes per node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def collective_timeout(self) -> timedelta:
        """The timeout of the default group's collectives."""
        return self._timeout

    @property
    def process_group_backend(self) -> str | None:
        """The process group backend in use."""
        return self._process_group_backend

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every stage of a replica reads the same batches; replicas read different ones, as under DDP."""
        if self.topology is None:
            size = self.pipeline_parallel_size if isinstance(self.pipeline_parallel_size, int) else self.world_size
            return {"num_replicas": self.world_size // size, "rank": self.global_rank // size}
        return {"num_replicas": self.topology.data_size, "rank": self.topology.replica}

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        world = self.num_nodes * self.num_processes
        if isinstance(self.pipeline_parallel_size, int):  # before any process is started
            Topology.check(world, self.pipeline_parallel_size)
            check_global_batch(self.global_batch_size, world // self.pipeline_parallel_size)
        self._launcher = PipelineLauncher(self.cluster_environment, self.num_processes, self.num_nodes, self._timeout)

    @override
    def setup_environment(self) -> None:
        """Checks the P x D shape, sets up the device, then starts the default process group."""
        if isinstance(self.pipeline_parallel_size, int):
            Topology.check(self.num_nodes * self.num_processes, self.pipeline_parallel_size)
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        store = getattr(self, "recovery_store", None)
        if store is not None:  # every rank a client of a store that outlives the training processes
            host, _, port = store.rpartition(":")
            os.environ.update(MASTER_ADDR=host, MASTER_PORT=port, TORCHELASTIC_USE_AGENT_STORE="True")
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        self._process_group_backend = backend

    def set_world_ranks(self) -> None:
        """Sets global rank and world size from node rank, local rank and processes per node."""
        self.adopt_ranks(self.node_rank * self.num_processes + self.local_rank, self.num_nodes * self.num_processes)

    def adopt_ranks(self, rank: int, world_size: int) -> None:
        """Makes ``rank`` of ``world_size`` this process's global rank for Lightning (also after in-place recovery)."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(rank)
            self.cluster_environment.set_world_size(world_size)
        for name, value in (("RANK", rank), ("WORLD_SIZE", world_size)):  # for environments that read them again;
            if name in os.environ:  # never new ones: Lightning's launcher hands this environment to its ranks
                os.environ[name] = str(value)
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]  # Lightning keeps it on fn

    @override
    def model_to_device(self) -> None:
        """Moves the model to this process's device (parameters on the meta device stay there until setup)."""
        assert self.model is not None
        if has_meta_tensors(self.model):
            move_real_tensors(self.model, self.root_device)
        else:
            self.model.to(self.root_device)

    @contextlib.contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Tensors created inside are on this process's device; with ``empty_init=True``, parameters on ``meta``.

        ``Trainer.init_module(empty_init=True)`` thus builds parameters that take no memory (each stage materializes
        its own at setup) and real buffers; a plain ``Trainer.init_module()`` builds real parameters.
        """
        meta = parameters_on_meta() if empty_init else contextlib.nullcontext()
        with meta, self.root_device, self.precision_plugin.tensor_init_context():
            yield

    @contextlib.contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Inside ``configure_model``: parameters on the meta device (each stage materializes its own), real buffers."""
        with parameters_on_meta():
            yield

    @override
    def barrier(self, name: str | None = None) -> None:
        """Waits for every process (nothing to wait for without a process group)."""
        if _distributed_is_initialized():
            waiting(self.topology, f"a barrier ({name or 'unnamed'})", dist.barrier)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Sends ``obj`` from rank ``src`` to every process."""
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        waiting(self.topology, f"a broadcast from rank {src}", lambda: dist.broadcast_object_list(box, src))
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Reduces a tensor over all processes as ``sync_dist`` asks (mean by default); anything else as it is."""
        if not isinstance(tensor, Tensor):
            return tensor
        return waiting(self.topology, "a reduction of logged values (sync_dist)",
                       lambda: _sync_ddp_if_available(tensor, group, reduce_op=reduce_op))


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return _distributed_is_initialized()


def watch_peers(cleanup: Callable[[], None]) -> Callable[[], None] | None:
    """From now on a failure of another rank ends this one (the engine's watchdog), running ``cleanup`` first.

    Returns:
        What removes ``cleanup`` again (None without a watchdog).

    Raises:
        PipelineError: If the job already cannot go on (another rank failed before this one got here).
    """
    watchdog = current_watchdog()
    if watchdog is None:
        return None
    verdict = watchdog.activate()
    if verdict is not None and verdict.origin != watchdog.rank:
        raise PipelineError(f"rank {watchdog.rank}: the job cannot go on: {verdict.text}.")
    return watchdog.add_cleanup(cleanup)


def stop_watching_peers(forget_cleanup: Callable[[], None] | None, finished: bool) -> None:
    """Undoes :func:`watch_peers`; once ``finished`` with the peers, this rank may exit before them."""
    watchdog = current_watchdog()
    if watchdog is not None and finished:
        watchdog.deactivate("finished")
    if forget_cleanup is not None:
        forget_cleanup()


def waiting(topology: Topology | None, what: str, wait: Callable[[], Any]) -> Any:
    """Runs a collective; once the pipeline exists, its failure becomes a ``PipelineError`` naming this rank."""
    if topology is None:  # before the pipeline exists (the dry run's broadcast of timings)
        return wait()
    return waiting_on_peers(topology, what, wait)


def global_grad_norm(engine: PipelineEngine, topology: Topology) -> Tensor:
    """The L2 norm of the whole model's gradient: every stage's share summed over the pipeline.

    With a sharded optimizer each replica holds the reduced gradient of its shard only: the shares are summed over
    every rank of the job.
    """
    total = engine.local_grad_norm_sq()
    if engine.shards_optimizer:
        waiting_on_peers(topology, "summing the gradient norm over stages and replicas",
                         lambda: dist.all_reduce(total))
    elif topology.pipeline_size > 1:
        waiting_on_peers(topology, "summing the gradient norm over stages",
                         lambda: dist.all_reduce(total, group=topology.pipe_group))
    return total.sqrt()
