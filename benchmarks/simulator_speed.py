"""The simulator's speed: ``simulate`` against the loop that asks every rank again at every event.

    python benchmarks/simulator_speed.py --out benchmarks/results/simulator_speed.json

``simulate`` asks again, at each event, only the ranks that a finished task or an arrived message concerns, and
takes the next event from a heap. :func:`simulate_asking_every_rank` is the loop it replaced: at every event every
free rank is asked again until none starts a task, and the next event is the least of every finish and arrival
time still to come. Both run the same lists (every schedule's largest shapes, with recompute, random message
delays and the run-time rules on) in one process, interleaved, and must give equal results
(``tests/pipeline/scheduling/test_simulator.py`` checks that on many small shapes, zero-time tasks included). The
result file keeps every repetition's seconds, the commit and the machine's load before and after.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from lightning_varuna.pipeline.scheduling import simulator as sim
from lightning_varuna.pipeline.scheduling.schedules import make_schedule, stage_ranks
from lightning_varuna.pipeline.scheduling.simulator import Jitter, SimResult, StageCosts, simulate
from lightning_varuna.pipeline.scheduling.tasks import Kind, Schedule

ROOT = Path(__file__).resolve().parents[1]
SHAPES = (("1f1b", 1, 8, 32), ("varuna", 1, 8, 32), ("zero-bubble", 1, 16, 64), ("interleaved", 2, 8, 32),
          ("zero-bubble", 2, 8, 32), ("zero-bubble", 2, 16, 64), ("zero-bubble-v", 2, 16, 64))
"""(schedule, chunks per rank, ranks, micro-batches)."""


def simulate_asking_every_rank(
    schedule: Schedule, costs: Sequence[StageCosts], comm: float = 0.0, jitter: Jitter | None = None,
    stage_ranks: Sequence[int] | None = None, opportunistic: bool = False,
) -> SimResult:
    """:func:`simulate` (without link transfer times) by asking every free rank again at every event."""
    ranks = tuple(range(len(schedule))) if stage_ranks is None else tuple(stage_ranks)
    num_stages, links = len(ranks), sim._Links(None, ranks)
    pending = [list(tasks) for tasks in schedule]
    recomputing = {sim._stage_of(t, r) for r, tasks in enumerate(schedule) for t in tasks if t.kind is Kind.R}
    stashes = [any(t.kind is Kind.R for t in tasks) if stage_ranks is None
               else sim._stashes_by_stage(r, recomputing.__contains__) for r, tasks in enumerate(schedule)]
    waits = [{id(t): sim._awaited(t, r, num_stages) for t in tasks} for r, tasks in enumerate(schedule)]
    free_at, arrivals, now = [0.0] * len(schedule), {}, 0.0
    order: list[list] = [[] for _ in schedule]
    starts: list[list[float]] = [[] for _ in schedule]
    while True:
        started = True
        while started:
            started = False
            for rank in range(len(schedule)):
                if free_at[rank] > now or not pending[rank]:
                    continue
                index = sim._pick(rank, num_stages, pending[rank], waits[rank], arrivals, now, opportunistic,
                                  stashes[rank], True)
                if index is not None:
                    task = pending[rank].pop(index)
                    stage = sim._stage_of(task, rank)
                    free_at[rank] = now + costs[stage].cost(task.kind)
                    sim._send(stage, num_stages, task, free_at[rank], arrivals, comm, jitter, links)
                    order[rank].append(task)
                    starts[rank].append(now)
                    started = True
        if not any(pending):
            return sim._result(costs, ranks, free_at, order, starts)
        now = min(t for t in [*free_at, *arrivals.values()] if t > now)


def _case(name: str, v: int, num_ranks: int, m: int) -> tuple[Schedule, list[StageCosts], Jitter, tuple | None]:
    schedule = make_schedule(name, num_ranks, m, True, stages_per_rank=v)
    draws, table = random.Random(0), {}
    return (schedule, [StageCosts(forward=1 / v, backward=2 / v)] * (num_ranks * v),
            lambda *message: table.setdefault(message, draws.random()), stage_ranks(num_ranks, v, name))


def _row(name: str, v: int, num_ranks: int, m: int, repeats: int) -> dict:
    """Both simulations of one shape, checked equal, then timed ``repeats`` times each, interleaved."""
    schedule, costs, jitter, placement = _case(name, v, num_ranks, m)
    ours = functools.partial(simulate, schedule, costs, jitter=jitter, opportunistic=True, stage_ranks=placement)
    every = functools.partial(simulate_asking_every_rank, schedule, costs, jitter=jitter, stage_ranks=placement,
                              opportunistic=True)
    assert ours() == every(), (name, v, num_ranks, m)
    times: dict[str, list[float]] = {"simulate": [], "asking_every_rank": []}
    for _ in range(repeats):  # interleaved, so a change in the machine's load reaches both
        times["simulate"].append(_seconds(ours))
        times["asking_every_rank"].append(_seconds(every))
    medians = {k: statistics.median(t) * 1e3 for k, t in times.items()}
    return {"schedule": name, "stages_per_rank": v, "ranks": num_ranks, "microbatches": m, "seconds": times,
            "median_ms": medians, "speedup": medians["asking_every_rank"] / medians["simulate"]}


def _seconds(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/simulator_speed.json")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {"command": " ".join(sys.argv), "commit": commit, "python": platform.python_version(),
              "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(), "rows": []}
    for name, v, num_ranks, m in SHAPES:
        row = _row(name, v, num_ranks, m, args.repeats)
        result["rows"].append(row)
        print(f"{name:14s} v={v} P={num_ranks:2d} m={m:2d}: {row['median_ms']['simulate']:7.1f} ms against "
              f"{row['median_ms']['asking_every_rank']:7.1f} ms asking every rank ({row['speedup']:.1f}x)", flush=True)
    result["loadavg_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
