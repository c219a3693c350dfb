"""The resumable training sampler: DDP's order when uninterrupted, the exact next sample when resumed under any D."""

from __future__ import annotations

import itertools

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from lightning_varuna.trainer.data import ElasticBatchSampler, ResumableDataLoader, make_resumable


def _ddp_batches(n: int, batch: int, replicas: int, rank: int, shuffle: bool, drop_last: bool, drop_last_batch: bool,
                 epoch: int) -> list[list[int]]:
    sampler = DistributedSampler(range(n), num_replicas=replicas, rank=rank, shuffle=shuffle, seed=3,
                                 drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(BatchSampler(sampler, batch, drop_last_batch))


@pytest.mark.parametrize(
    ("n", "batch", "replicas", "shuffle", "drop_last", "drop_last_batch"),
    [(64, 8, 2, True, False, False), (50, 4, 4, True, False, False), (50, 4, 4, True, True, True),
     (37, 5, 3, False, False, False), (37, 5, 3, True, False, True), (3, 2, 4, True, False, False)],
)
def test_uninterrupted_order_equals_distributed_sampler(n, batch, replicas, shuffle, drop_last, drop_last_batch):
    for rank, epoch in itertools.product(range(replicas), (0, 2)):
        sampler = ElasticBatchSampler(n, batch, replicas, rank, shuffle=shuffle, seed=3, drop_last=drop_last,
                                      drop_last_batch=drop_last_batch)
        sampler.set_epoch(epoch)
        expected = _ddp_batches(n, batch, replicas, rank, shuffle, drop_last, drop_last_batch, epoch)
        assert list(sampler) == expected
        assert len(sampler) == len(expected)


def _global_batches(replicas: int, global_batch: int, n: int, epoch: int, resume: tuple[int, int] | None):
    """Each step's samples over all replicas (as sets, since replicas split a global batch differently)."""
    per_rank = []
    for rank in range(replicas):
        sampler = ElasticBatchSampler(n, global_batch // replicas, replicas, rank, seed=7, epoch_of=lambda: epoch)
        if resume is not None:
            sampler.resume_at(*resume)
        per_rank.append(list(sampler))
    return [sorted(itertools.chain(*step)) for step in zip(*per_rank)]


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 4), (4, 2), (2, 2)])
def test_resume_under_other_replica_count_sees_the_next_global_batches(before: int, after: int) -> None:
    n, global_batch, epoch = 96, 16, 1
    uninterrupted = _global_batches(before, global_batch, n, epoch, None)
    done = 2
    resumed = _global_batches(after, global_batch, n, epoch, (epoch, done * global_batch))
    assert resumed == uninterrupted[done:]
    # the position applies to its own epoch only, and only once
    assert _global_batches(after, global_batch, n, epoch + 1, (epoch, 32)) == _global_batches(
        after, global_batch, n, epoch + 1, None
    )


def test_resumable_loader_saves_finished_steps_and_restores_them() -> None:
    dataset = list(range(40))
    loader = DataLoader(dataset, batch_size=4, sampler=DistributedSampler(dataset, num_replicas=2, rank=1, seed=5))
    finished = {"epoch": 0, "batches": 3}
    resumable = make_resumable(loader, 2, 1, None, lambda: 0, lambda: (finished["epoch"], finished["batches"]))
    assert isinstance(resumable, ResumableDataLoader)
    assert [b.tolist() for b in resumable] == [b.tolist() for b in loader]
    state = resumable.state_dict()
    assert state == {"epoch": 0, "samples": 3 * 8, "seed": 5}
    # resumed as the only replica, with twice the per-replica batch: the same global batches follow
    again = make_resumable(DataLoader(dataset, batch_size=8, sampler=DistributedSampler(dataset, 1, 0, seed=5)),
                           1, 0, None, lambda: 0, lambda: (0, 0))
    again.load_state_dict(state)
    rest = [sorted(b.tolist()) for b in again]
    pairs = [sorted(a.tolist() + b.tolist()) for a, b in zip(
        make_resumable(DataLoader(dataset, batch_size=4, sampler=DistributedSampler(dataset, 2, 0, seed=5)),
                       2, 0, None, lambda: 0, lambda: (0, 0)),
        make_resumable(DataLoader(dataset, batch_size=4, sampler=DistributedSampler(dataset, 2, 1, seed=5)),
                       2, 1, None, lambda: 0, lambda: (0, 0)),
    )]
    assert rest == pairs[3:]


def test_custom_samplers_are_left_alone() -> None:
    dataset = list(range(10))
    assert make_resumable(DataLoader(dataset, batch_size=2), 1, 0, None, lambda: 0, lambda: (0, 0)) is None
    custom = DataLoader(dataset, batch_sampler=BatchSampler(DistributedSampler(dataset, 1, 0), 2, False))
    assert make_resumable(custom, 1, 0, None, lambda: 0, lambda: (0, 0)) is None


def test_resume_under_another_replica_count_gives_every_replica_as_many_batches() -> None:
    """Without global_batch_size the saved position need not be a multiple of the new D: it is rounded down, or
    some replicas would run one step more than the others and wait in the gradient all-reduce forever."""
    n, saved = 8, 6  # one step of 3 replicas x 2 samples done; resumed by 4 replicas
    counts = []
    for rank in range(4):
        sampler = ElasticBatchSampler(n, 1, 4, rank, seed=1, epoch_of=lambda: 0)
        sampler.resume_at(0, saved)
        counts.append(len(list(sampler)))
    assert len(set(counts)) == 1 and counts[0] >= 1


class _Stream:
    """A streaming dataset's loader as users pass it: an iterable that is not a DataLoader."""

    def __init__(self, batches: list) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def test_an_iterable_that_is_not_a_data_loader_is_kept_with_a_warning_that_says_what_it_needs() -> None:
    from types import SimpleNamespace

    from lightning_varuna.trainer.data import resumable_training_loader

    stream = _Stream([torch.zeros(2, 3)])
    assert make_resumable(stream, 2, 0, None, lambda: 0, lambda: (0, 0)) is None
    progress = SimpleNamespace(current=SimpleNamespace(processed=0))
    fit_loop = SimpleNamespace(epoch_progress=progress, epoch_loop=SimpleNamespace(batch_progress=progress))
    with pytest.warns(UserWarning) as caught:
        assert resumable_training_loader(stream, fit_loop, 2, 1, None) is stream
    message = str(caught[0].message)
    assert "The training loader (_Stream) is an iterable without Lightning's sampler" in message
    assert "no exact-sample resume" in message and "distributed_sampler_kwargs" in message
    with pytest.raises(MisconfigurationException, match="global_batch_size needs Lightning's default"):
        resumable_training_loader(stream, fit_loop, 2, 1, 8)


def test_a_one_shot_iterator_is_refused_with_what_to_pass_instead(tmp_path) -> None:
    import lightning.pytorch as pl
    from helpers.models import RandomTokens, TinyGPT

    from lightning_varuna import VarunaStrategy

    batches = iter(DataLoader(RandomTokens(n=8), batch_size=4))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         strategy=VarunaStrategy(pipeline_parallel_size=1, num_microbatches=2))
    with pytest.raises(MisconfigurationException, match="one-shot iterator .* Pass an iterable whose __iter__"):
        trainer.fit(TinyGPT(n_layer=1), batches)
