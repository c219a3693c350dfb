"""After peers died: the survivors agree on who is left and form a new default process group among themselves.

Every survivor registers in the job's store under the recovery's *generation* (the n-th recovery of the job),
with the deaths it knows of. Once every rank of the old world is either registered or known dead to some survivor,
the first survivor to see it proposes the list of survivors; the store keeps the first proposal (compare-and-set),
so every survivor adopts the same view. A survivor that is slow but alive is waited for, never counted out.

The new default group is made on a fresh prefix of the same store, so the addresses of the old world's groups are
never read again. The store must outlive the processes that die: a store process of its own, a launcher's agent,
or a host the user names; a store hosted by a training rank (rank 0 under Lightning's launcher) dies with it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore

__all__ = ["Survivors", "agree_on_survivors", "form_new_world", "job_store"]

_KEY = "lightning_varuna/recovery/"
_POLL_S = 0.01


@dataclass(frozen=True)
class Survivors:
    """The view every survivor of one recovery adopts.

    Attributes:
        generation: Which recovery of the job this is (1 for the first).
        ranks: The surviving ranks of the old world, ascending.
        old_world: The old world's size.
    """

    generation: int
    ranks: tuple[int, ...]
    old_world: int

    @property
    def dead(self) -> tuple[int, ...]:
        """The old world's ranks that are gone."""
        return tuple(r for r in range(self.old_world) if r not in self.ranks)


def job_store() -> Any:
    """The default process group's store (private: torch has no public accessor; torch 2.5-2.14 tested)."""
    return dist.distributed_c10d._get_default_store()


def agree_on_survivors(store: Any, generation: int, rank: int, world: int, dead: frozenset[int],
                       known_dead: Any, timeout: float) -> Survivors:
    """Registers this rank as alive for ``generation`` and returns the view every survivor adopts.

    Args:
        store: The job's store (it must outlive the ranks that died).
        generation: The recovery's number, the same on every survivor.
        rank: This rank in the old world.
        world: The old world's size.
        dead: The ranks this rank knows to be dead.
        known_dead: Returns the deaths this rank knows of now (its watchdog learns more while it waits).
        timeout: Seconds to wait for every rank to be accounted for.

    Raises:
        TimeoutError: If some rank neither registered nor was known dead within ``timeout`` (a hung rank).
    """
    prefix = f"{_KEY}{generation}/"
    store.set(f"{prefix}alive/{rank}", json.dumps(sorted(dead)))
    deadline = time.monotonic() + timeout
    view_key = f"{prefix}view"
    while True:
        if store.check([view_key]):
            return _view(store.get(view_key), generation, world)
        alive, gone = _accounted(store, prefix, world, set(known_dead()))
        if len(alive) + len(gone) == world:
            proposal = json.dumps(sorted(alive)).encode()
            return _view(store.compare_set(view_key, "", proposal), generation, world)
        if time.monotonic() > deadline:
            missing = sorted(set(range(world)) - alive - gone)
            raise TimeoutError(f"ranks {missing} neither joined the recovery nor were seen to die within {timeout:g}s")
        time.sleep(_POLL_S)


def _accounted(store: Any, prefix: str, world: int, gone: set[int]) -> tuple[set[int], set[int]]:
    alive = set()
    for r in range(world):
        key = f"{prefix}alive/{r}"
        if r not in gone and store.check([key]):
            alive.add(r)
            gone.update(json.loads(store.get(key)))
    return alive - gone, gone


def _view(value: bytes, generation: int, world: int) -> Survivors:
    return Survivors(generation, tuple(json.loads(value)), world)


def form_new_world(store: Any, survivors: Survivors, rank: int, backend: str, timeout: timedelta) -> int:
    """Replaces the default process group by one over ``survivors`` (numbered by old rank); returns the new rank.

    The old groups are destroyed first: their sockets close, so waits abandoned on them fail at once on every
    survivor (a wait on a live peer that is stuck behind the dead one would otherwise last its whole timeout).
    """
    new_rank = survivors.ranks.index(rank)
    dist.destroy_process_group()
    dist.init_process_group(backend, store=PrefixStore(f"{_KEY}{survivors.generation}/world", store),
                            rank=new_rank, world_size=len(survivors.ranks), timeout=timeout)
    return new_rank
