"""Auto-configuration with ``zero_stage=1``: optimizer state per rank is 1/D, the sync's time is the same bytes.

Synthetic profiles (no measurement): the memory model's optimizer state per rank, a search whose memory limit
only a sharded configuration meets, and the time model's reduce-scatter plus all-gather against the all-reduce.
"""

from __future__ import annotations

import pytest
from helpers.profiles import FREE, search_space, two_segments

from lightning_varuna.pipeline.planning.memory_model import MEMORY_RESERVE, stage_memory
from lightning_varuna.pipeline.planning.profile_data import (
    Link,
    Profile,
)
from lightning_varuna.pipeline.planning.search import Cluster, format_table, predict, search


def weighty(param_bytes: int = 40_000, allreduce: Link = FREE) -> Profile:
    """Two equal segments, F=1 and B=2 seconds per sample, whose parameters outweigh their activations."""
    return two_segments(param_bytes, allreduce, key="weighty")


def test_optimizer_state_per_rank_is_a_quarter_at_d4() -> None:
    profile = weighty()
    whole = stage_memory(profile, range(0, 2), 0, 1, 4, microbatch_size=1, num_microbatches=1, graphs=1)
    sharded = stage_memory(profile, range(0, 2), 0, 1, 4, microbatch_size=1, num_microbatches=1, graphs=1,
                           zero_stage=1)
    assert whole.optimizer == 2 * 80_000  # Adam: two values per parameter
    assert sharded.optimizer == whole.optimizer // 4
    # the reduce-scatter's output segment adds a quarter of the gradient; the rest is unchanged
    assert sharded.gradients == whole.gradients + 80_000 // 4
    assert (sharded.weights, sharded.buffers, sharded.activations) == (whole.weights, whole.buffers,
                                                                     whole.activations)


def test_a_configuration_that_fits_only_sharded_is_chosen_under_a_limit_that_excludes_it_without() -> None:
    profile = weighty()
    cluster = Cluster(4, 4)
    # P=1 x D=4 is the fastest shape (no pipeline fill and drain); its peak sits between the two limits
    sharded_p1 = predict(profile, cluster, 1, 1, 1, "1f1b", False, search_space(zero_stage=1)).candidate
    whole_p1 = predict(profile, cluster, 1, 1, 1, "1f1b", False, search_space(zero_stage=0)).candidate
    assert max(m.optimizer for m in sharded_p1.memory) * 4 == max(m.optimizer for m in whole_p1.memory)
    budget = (max(sharded_p1.peak_bytes) + max(whole_p1.peak_bytes)) // 2
    memory_limit = int(budget / (1 - MEMORY_RESERVE))

    with_sharding = search(profile, cluster, search_space(zero_stage=1, global_batch_size=4), memory_limit=memory_limit)
    without = search(profile, cluster, search_space(zero_stage=0, global_batch_size=4), memory_limit=memory_limit)
    chosen = with_sharding[0]
    assert chosen.fits and (chosen.pipeline_size, chosen.data_size) == (1, 4)
    assert not any(c.fits for c in without if c.pipeline_size == 1)
    assert without[0].fits and without[0].pipeline_size == 2  # the unsharded search must give P=1 up
    assert chosen.step_s < without[0].step_s
    # the table shows the optimizer state per rank (a quarter of the unsharded one's)
    table = format_table(with_sharding, memory_limit=memory_limit)
    assert "optimizer state" in table.splitlines()[0]
    assert "156.2KiB" in format_table([whole_p1]) and "39.1KiB" in format_table([sharded_p1])


@pytest.mark.parametrize("latency_s", [0.0, 0.01])
def test_reduce_scatter_and_all_gather_take_the_all_reduces_time(latency_s: float) -> None:
    # one bucket per rank, sync after the schedule: all-reduce = reduce-scatter + all-gather, same bytes and steps
    profile = weighty(param_bytes=1000, allreduce=Link(latency_s, 1000.0))
    cluster = Cluster(2, 2)
    choices = dict(overlap_grad_sync=False, grad_bucket_bytes=10**6)
    whole = predict(profile, cluster, 1, 2, 1, "1f1b", False, search_space(zero_stage=0, **choices))
    sharded = predict(profile, cluster, 1, 2, 1, "1f1b", False, search_space(zero_stage=1, **choices))
    # F=2 s + B=4 s per sample, 2 samples: 12 s; 2000 bytes over 2 ranks at 1000 B/s: 2 s (+ 2 latencies)
    assert whole.candidate.step_s == pytest.approx(12.0 + 2.0 + 2 * latency_s)
    assert sharded.candidate.step_s == pytest.approx(whole.candidate.step_s)
    # the sync itself is the reduce-scatter, half of it; the all-gather follows the step
    assert sharded.sync[0][1] - sharded.sync[0][0] == pytest.approx(1.0 + latency_s)
    assert sharded.optimizer[0][1] - sharded.optimizer[0][0] == pytest.approx(1.0 + latency_s)
