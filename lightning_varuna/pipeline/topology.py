"""The P x D process grid: where each rank sits, and the process groups it talks over.

Ranks are laid out replica-major: ``rank = replica * P + stage``. Pipeline neighbours therefore have
adjacent ranks and share a node whenever P divides the processes per node (Varuna's rule: the chatty
per-micro-batch p2p traffic stays on the node), while the replicas of a stage, which exchange gradients
once per step, sit on different nodes.

Each direction of each pipeline edge is a *link* with a two-rank process group of its own: activations go down
one, gradients and the step summary come up the other. On NCCL each process group has its own stream per pair of
ranks, so a link's stream carries one direction, in the order of the message order, and a receive posted early on it can
never hold up a send (:mod:`~lightning_varuna.pipeline.scheduling.lowering`). Data-parallel all-reduces run on the data
groups, the pipeline's collectives (log sharing) on the pipeline groups: never on a link.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal, TypeAlias, cast

import torch
import torch.distributed as dist

__all__ = ["Topology"]

NewGroup: TypeAlias = "dist.ProcessGroup | Literal[-100]"
"""What ``dist.new_group`` returns: the group, or ``GroupMember.NON_GROUP_MEMBER`` (-100) on a rank outside it."""


@dataclass
class Topology:
    """Where this rank sits in the P x D grid, and the process groups it talks over."""

    world_size: int
    rank: int
    pipeline_size: int
    device: torch.device
    pipe_group: dist.ProcessGroup | None = None
    data_group: dist.ProcessGroup | None = None
    timeout: timedelta | None = None
    """Timeout of collectives in the pipeline, data and shared-parameter groups (None: torch's default)."""
    links: dict[tuple[int, int], dist.ProcessGroup] = field(default_factory=dict)
    """The process group of each link this rank is on, by ``(sending rank, receiving rank)``."""
    last_position: int | None = None
    """The position (0..P-1) of the rank that runs the model's last stage: ``P - 1`` (None), or 0 in the V-shaped
    placement of two stages per rank, where rank 0 holds the first stage and the last."""
    link_backend: str | None = None
    """The backend of the link groups (None: the default group's)."""
    wrap_around: bool = False
    """Whether the last rank of each pipeline has links to its first (see :meth:`create`)."""
    _shared_groups: dict[tuple[int, ...] | tuple[tuple[int, ...], int], NewGroup] = field(default_factory=dict)

    @property
    def data_size(self) -> int:
        """D: the number of pipeline replicas."""
        return self.world_size // self.pipeline_size

    @property
    def stage(self) -> int:
        """This rank's pipeline stage."""
        return self.rank % self.pipeline_size

    @property
    def replica(self) -> int:
        """This rank's data-parallel replica."""
        return self.rank // self.pipeline_size

    @property
    def is_first(self) -> bool:
        """Whether this rank runs the first stage."""
        return self.stage == 0

    @property
    def last_stage_position(self) -> int:
        """The position of the rank that runs the model's last stage (see :attr:`last_position`)."""
        return self.pipeline_size - 1 if self.last_position is None else self.last_position

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last stage (computes the loss)."""
        return self.stage == self.last_stage_position

    def rank_of(self, stage: int, replica: int | None = None) -> int:
        """Global rank of ``stage`` in ``replica`` (default: this rank's replica)."""
        return (self.replica if replica is None else replica) * self.pipeline_size + stage

    @property
    def pipe_src_rank(self) -> int:
        """Global rank of this replica's last stage, which broadcasts losses and logged values."""
        return self.rank_of(self.last_stage_position)

    @staticmethod
    def check(world_size: int, pipeline_size: int) -> None:
        """Raises a clear error if ``pipeline_size`` cannot divide the world."""
        if pipeline_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {pipeline_size}.")
        if world_size % pipeline_size:
            raise ValueError(
                f"The world size ({world_size} processes) is not divisible by pipeline_parallel_size="
                f"{pipeline_size}. Use a P that divides {world_size}, or change devices/num_nodes."
            )

    def link_group(self, src: int, dst: int) -> dist.ProcessGroup | None:
        """The process group of the link from global rank ``src`` to ``dst`` (None: the default group).

        A hand-built topology (tests) has no link groups; its transfers use the default group.
        """
        return self.links.get((src, dst))

    def made_data_group(self) -> dist.ProcessGroup:
        """:attr:`data_group`, for code that runs only on a topology :meth:`create` made (never None there)."""
        assert self.data_group is not None, "a hand-built topology has no data group"
        return self.data_group

    @classmethod
    def create(
        cls, pipeline_size: int, device: torch.device, timeout: float | timedelta | None = None,
        link_backend: str | None = None, wrap_around: bool = False,
    ) -> Topology:
        """Builds the grid over the initialised default process group (a collective call on every rank).

        ``timeout`` (seconds) bounds every collective of the groups made here. Without it a hung peer can
        hold the others in a gradient all-reduce or log broadcast for torch's default (30 minutes): subgroups
        do not inherit the default process group's timeout. ``link_backend`` is the backend of the link groups
        (None: the default group's). ``wrap_around`` adds the links between the last and the first rank of each
        pipeline, in both directions (several stages per rank in the looped placement: a micro-batch goes from
        rank ``P - 1`` back to rank 0 for its next chunk); for ``P = 2`` they are the pipeline's own links.
        """
        world, rank = dist.get_world_size(), dist.get_rank()
        cls.check(world, pipeline_size)
        if isinstance(timeout, (int, float)):
            timeout = timedelta(seconds=timeout)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # before the first NCCL call, or communicators can hang at creation
        data_size = world // pipeline_size
        layout = torch.arange(world).view(data_size, pipeline_size)
        # every rank creates every group, in the same order
        pipes = [dist.new_group(row.tolist(), timeout=timeout) for row in layout]
        datas = [dist.new_group(col.tolist(), timeout=timeout) for col in layout.t()]
        links: dict[tuple[int, int], dist.ProcessGroup] = {}
        for row in layout.tolist():
            edges = list(zip(row, row[1:]))
            if wrap_around and pipeline_size > 2:
                edges.append((row[-1], row[0]))
            for upper, lower in edges:
                for src, dst in ((upper, lower), (lower, upper)):
                    group = dist.new_group([upper, lower], timeout=timeout, backend=link_backend)
                    if rank in (src, dst):
                        links[(src, dst)] = _as_member(group)
        _connect(links, rank, device)
        pipe_group, data_group = pipes[rank // pipeline_size], datas[rank % pipeline_size]
        return cls(
            world_size=world,
            rank=rank,
            pipeline_size=pipeline_size,
            device=device,
            pipe_group=_as_member(pipe_group),
            data_group=_as_member(data_group),
            timeout=timeout,
            links=links,
            link_backend=link_backend,
            wrap_around=wrap_around,
        )

    def remake(self) -> None:
        """Rebuilds the grid in place over a new default process group (after in-place recovery changed the world).

        The pipeline size stays; the world size, this rank and every group come from the new default group. Whoever
        holds this object sees the new groups; objects that kept a group of their own must be rebuilt too.
        """
        fresh = Topology.create(self.pipeline_size, self.device, timeout=self.timeout,
                                link_backend=self.link_backend, wrap_around=self.wrap_around)
        self.world_size, self.rank = fresh.world_size, fresh.rank
        self.pipe_group, self.data_group, self.links = fresh.pipe_group, fresh.data_group, fresh.links
        self._shared_groups = {}

    def stages_group(self, stages: tuple[int, ...], replica: int | None = None) -> dist.ProcessGroup:
        """The group of every replica's copies of ``stages``, or of one ``replica``'s copies.

        All ranks must call this in the same order. On a rank that holds none of ``stages`` the result is
        ``NON_GROUP_MEMBER``, which the callers keep only where this rank's stage is in ``stages``.
        """
        key = stages if replica is None else (stages, replica)
        if key not in self._shared_groups:
            replicas = range(self.data_size) if replica is None else [replica]
            ranks = {self.rank_of(s, d) for d in replicas for s in stages}
            self._shared_groups[key] = dist.new_group(ranks=sorted(ranks), timeout=self.timeout)
        return _as_member(self._shared_groups[key])

    def destroy_groups(self) -> None:
        """Destroys every process group this rank belongs to that :meth:`create` and :meth:`stages_group` made.

        For a process that builds several engines one after another (each gloo group keeps its own threads and
        connections until destroyed); a collective call on every rank. The topology is unusable afterwards.
        """
        groups = [self.pipe_group, self.data_group, *self.links.values(), *self._shared_groups.values()]
        for group in dict.fromkeys(g for g in groups if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER):
            dist.destroy_process_group(group)
        self.links.clear()
        self._shared_groups.clear()


def _as_member(group: NewGroup) -> dist.ProcessGroup:
    """``group`` as a process group, for a rank that is one of its members (where ``new_group`` returns one)."""
    return cast(dist.ProcessGroup, group)


def _connect(links: dict[tuple[int, int], dist.ProcessGroup], rank: int, device: torch.device) -> None:
    """Moves one element over every link of this rank, link after link in the order they were created.

    NCCL creates a pair's communicator at its first transfer and blocks the calling thread until the peer gets
    there too. In a step a stage posts receives ahead of use (the gradient of micro-batch 0 right after sending
    its activation, before the next activation), so a first transfer inside a step could block a stage while its
    peer waits for that next activation. Here every rank meets each peer in the same global order (the links
    along the pipeline, edge by edge), which cannot deadlock. On gloo it only checks the connections.
    """
    for (src, dst), group in links.items():
        on_device = device.type == "cuda" and dist.get_backend(group) != "gloo"
        token = torch.zeros(1, device=device if on_device else "cpu")
        if rank == src:
            dist.send(token, dst=dst, group=group)
        else:
            dist.recv(token, src=src, group=group)
