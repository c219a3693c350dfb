"""The survivors' agreement (in-place recovery), the replicas kept, and the options refused up front."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from lightning_varuna import VarunaStrategy
from lightning_varuna.failstop.survivors import agree_on_survivors
from lightning_varuna.trainer.recovery.in_place import complete_replicas


def _agree_in_threads(world: int, alive: list[int], dead: dict[int, set[int]], late: int | None = None) -> dict:
    """Runs the agreement for each rank of ``alive`` in a thread of its own over one store; their views."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    views: dict[int, tuple[int, ...]] = {}
    start_late = threading.Event()

    def run(rank: int) -> None:
        if rank == late:
            start_late.wait(5)
        known = dead[rank]
        views[rank] = agree_on_survivors(store, 1, rank, world, frozenset(known), lambda: frozenset(known), 10).ranks

    threads = [threading.Thread(target=run, args=(r,)) for r in alive]
    for thread in threads:
        thread.start()
    if late is not None:
        threading.Timer(0.3, start_late.set).start()
    for thread in threads:
        thread.join(15)
    return views


def test_survivors_adopt_one_view_even_when_only_some_saw_the_death() -> None:
    # rank 3 died; only rank 2 (its ring neighbour) knows it: the others learn it through the store
    views = _agree_in_threads(4, [0, 1, 2], {0: set(), 1: set(), 2: {3}})
    assert views == {0: (0, 1, 2), 1: (0, 1, 2), 2: (0, 1, 2)}


def test_a_slow_survivor_is_waited_for_not_counted_out() -> None:
    views = _agree_in_threads(4, [0, 1, 2], {0: {3}, 1: {3}, 2: {3}}, late=1)
    assert views == {0: (0, 1, 2), 1: (0, 1, 2), 2: (0, 1, 2)}


def test_a_rank_neither_alive_nor_known_dead_times_the_agreement_out() -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    with pytest.raises(TimeoutError, match=r"ranks \[1\] neither joined"):
        agree_on_survivors(store, 1, 0, 3, frozenset({2}), lambda: frozenset({2}), 0.3)


def test_only_replicas_with_every_stage_are_kept() -> None:
    # P=2: replicas (0, 1), (2, 3), (4, 5); rank 3 died
    assert complete_replicas((0, 1, 2, 4, 5), 2) == ([0, 1, 4, 5], [2])
    assert complete_replicas((0, 2), 2) == ([], [0, 2])


@pytest.mark.parametrize(("options", "message"), [
    ({"recovery": "inplace"}, "use 'restart' or 'in_place'"),
    ({"recovery": "in_place"}, "needs global_batch_size"),
    ({"recovery_store": "storehost"}, "write it as 'host:port'"),
])
def test_recovery_options_that_cannot_work_are_refused_when_the_strategy_is_made(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        VarunaStrategy(pipeline_parallel_size=2, **options)
