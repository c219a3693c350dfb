"""Training data that resumes at the exact sample, whatever the number of data-parallel replicas.

Every replica reads the same per-epoch permutation of the dataset, cut into *global* batches of
``batch_size * num_replicas`` samples; replica ``r`` takes every ``num_replicas``-th sample of each global batch,
starting at ``r``. For an uninterrupted run this is exactly what ``DistributedSampler`` + ``BatchSampler`` give
(the same samples on the same replica in the same order), so switching to it changes nothing.

What it adds is a position measured in samples of the permutation: a checkpoint records how many samples
the completed steps consumed, and a run resumed from it, under any other number of replicas, starts at that
sample. With the same global batch size (``VarunaStrategy(global_batch_size=...)``) every later global batch
holds exactly the samples the uninterrupted run would have used.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sized
from typing import Any, cast

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.trainer.connectors.data_connector import _request_dataloader
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, Sampler

from lightning_varuna.pipeline.varuna_warning import VarunaWarning
from lightning_varuna.trainer.patches import InstancePatches, hand_over_dataloader

__all__ = ["ElasticBatchSampler", "ResumableDataLoader", "check_global_batch", "make_resumable",
           "resumable_training_loader", "sample_batch"]


class ElasticBatchSampler(Sampler[list[int]]):
    """One replica's batches, cut from global batches of a permutation shared by all replicas.

    Args:
        num_samples: Length of the dataset.
        batch_size: Samples per batch on this replica.
        num_replicas: Number of data-parallel replicas (D).
        rank: This replica's index.
        shuffle: Permute the dataset every epoch (seeded by ``seed + epoch``), as ``DistributedSampler`` does.
        seed: Seed of the permutation; the same on every replica.
        drop_last: Drop the tail that does not divide evenly over the replicas (``DistributedSampler``'s
            ``drop_last``); otherwise the tail is padded with samples from the start.
        drop_last_batch: Drop this replica's last batch if it is smaller than ``batch_size`` (the data
            loader's ``drop_last``).
        epoch_of: Returns the current epoch when an iteration starts; by default the value given to
            :meth:`set_epoch`.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        drop_last_batch: bool = False,
        epoch_of: Callable[[], int] | None = None,
    ) -> None:
        if batch_size < 1 or num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(
                f"ElasticBatchSampler: batch_size={batch_size}, num_replicas={num_replicas}, rank={rank} is not valid."
            )
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.drop_last_batch = drop_last_batch
        self.epoch = 0
        self._epoch_of = epoch_of
        self._resume: tuple[int, int] | None = None
        self.next_batch = (0, 0)
        """``(epoch, index)`` of the next global batch this sampler hands out."""
        self._order_cache: tuple[int, list[int]] | None = None

    @property
    def global_batch_size(self) -> int:
        """Samples per step over all replicas."""
        return self.batch_size * self.num_replicas

    @property
    def total_size(self) -> int:
        """Samples per epoch over all replicas (after padding or dropping the uneven tail)."""
        if self.drop_last:
            return self.num_samples - self.num_samples % self.num_replicas
        return math.ceil(self.num_samples / self.num_replicas) * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch (the permutation's seed offset), as ``DistributedSampler.set_epoch`` does."""
        self.epoch = epoch

    def resume_at(self, epoch: int, samples: int) -> None:
        """Makes the next iteration over ``epoch`` start after its first ``samples`` samples (once)."""
        self._resume = (epoch, samples)

    def __len__(self) -> int:
        per_replica = self.total_size // self.num_replicas
        if self.drop_last_batch:
            return per_replica // self.batch_size
        return math.ceil(per_replica / self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self._epoch_of() if self._epoch_of is not None else self.epoch
        start = 0
        if self._resume is not None:
            resume_epoch, samples = self._resume
            self._resume = None
            if resume_epoch == epoch:
                # every replica must get as many batches as the others (or some would wait in a gradient
                # all-reduce forever): start on a multiple of D. Exact when the global batch is unchanged (a
                # multiple of D); otherwise up to D - 1 samples are read again.
                start = samples - samples % self.num_replicas
        order = self._order(epoch)
        self._order_cache = (epoch, order)
        step = self.global_batch_size
        for begin in range(start, len(order), step):
            # the layout is read at every batch: in-place recovery changes it mid-epoch (see relayout)
            batch = order[begin + self.rank : begin + step : self.num_replicas]
            if not batch or (self.drop_last_batch and len(batch) < self.batch_size):
                return
            self.next_batch = (epoch, begin // step + 1)
            yield batch

    def relayout(self, num_replicas: int, rank: int) -> tuple[int, int]:
        """Splits the same global batches over ``num_replicas`` from the next batch on (in-place recovery).

        Returns:
            ``(epoch, index)``: the batches before ``index`` of ``epoch`` were handed out under the old layout (some
            may not have been trained yet: a data loader fetches ahead); :meth:`batch_indices` gives their samples
            under the new one.

        Raises:
            ValueError: If the global batch does not split evenly over ``num_replicas``.
        """
        step = self.global_batch_size
        if step % num_replicas:
            raise ValueError(f"the global batch of {step} samples does not split evenly over {num_replicas} replicas")
        self.num_replicas, self.rank, self.batch_size = num_replicas, rank, step // num_replicas
        return self.next_batch

    def batch_indices(self, epoch: int, index: int) -> list[int]:
        """This replica's samples of the ``index``-th global batch of ``epoch``, under the current layout."""
        if self._order_cache is None or self._order_cache[0] != epoch:
            self._order_cache = (epoch, self._order(epoch))
        step = self.global_batch_size
        return self._order_cache[1][index * step + self.rank : (index + 1) * step : self.num_replicas]

    def _order(self, epoch: int) -> list[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_samples, generator=generator).tolist()
        else:
            order = list(range(self.num_samples))
        total = self.total_size
        if total > len(order):
            padding = total - len(order)
            order += (order * math.ceil(padding / max(len(order), 1)))[:padding]
        return order[:total]


class ResumableDataLoader(DataLoader[Any]):
    """A ``DataLoader`` over an :class:`ElasticBatchSampler` whose position Lightning saves and restores.

    Lightning stores ``state_dict()`` in the checkpoint's loop state and calls ``load_state_dict()`` before it
    iterates again on resume. The position counts the samples of the steps that have *finished* (given by
    ``position``), not the batches fetched ahead.

    Args:
        dataset: The dataset.
        batch_sampler: The sampler of this replica's batches.
        position: Returns ``(epoch, finished batches in that epoch)`` when a checkpoint is saved.
        **kwargs: Other ``DataLoader`` arguments (workers, collate function, ...).
    """

    def __init__(
        self,
        dataset: Any,
        batch_sampler: ElasticBatchSampler,
        position: Callable[[], tuple[int, int]],
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
        self._position = position

    def state_dict(self) -> dict[str, int]:
        """The data position: epoch and samples consumed in it (over all replicas)."""
        sampler = self.batch_sampler
        assert isinstance(sampler, ElasticBatchSampler)
        epoch, batches = self._position()
        return {"epoch": epoch, "samples": batches * sampler.global_batch_size, "seed": sampler.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Starts the next iteration where the saved run stopped."""
        sampler = self.batch_sampler
        assert isinstance(sampler, ElasticBatchSampler)
        if "samples" in state:
            sampler.resume_at(int(state["epoch"]), int(state["samples"]))


_LOADER_ARGS = (
    "num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
    "generator", "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order",
)


def make_resumable(
    loader: Any,
    num_replicas: int,
    rank: int,
    batch_size: int | None,
    epoch_of: Callable[[], int],
    position: Callable[[], tuple[int, int]],
) -> DataLoader[Any] | None:
    """A :class:`ResumableDataLoader` reading what ``loader`` reads, or ``None`` if ``loader`` is not plain.

    Only a plain ``DataLoader`` with the ``DistributedSampler`` Lightning injected and the default batch sampler
    is replaced; a custom sampler or loader (or any other iterable) is the user's own and is left alone.

    Args:
        loader: The training loader as Lightning prepared it (any iterable).
        num_replicas: Number of data-parallel replicas.
        rank: This replica's index.
        batch_size: Per-replica batch size; ``None`` keeps the loader's.
        epoch_of: Returns the current epoch.
        position: Returns ``(epoch, finished batches in that epoch)``.
    """
    if type(loader) is not DataLoader:
        return None
    sampler = loader.sampler
    if (
        type(sampler) is not DistributedSampler
        or type(loader.batch_sampler) is not BatchSampler
        or loader.batch_size is None
    ):
        return None
    elastic = ElasticBatchSampler(
        len(cast(Sized, loader.dataset)),  # a DistributedSampler's dataset has a length
        batch_size or loader.batch_size,
        num_replicas,
        rank,
        shuffle=sampler.shuffle,
        seed=sampler.seed,
        drop_last=sampler.drop_last,
        drop_last_batch=loader.drop_last,
        epoch_of=epoch_of,
    )
    kwargs = {name: getattr(loader, name) for name in _LOADER_ARGS if hasattr(loader, name)}
    if not kwargs.get("num_workers"):
        kwargs.pop("prefetch_factor", None)
        kwargs["persistent_workers"] = False
    return ResumableDataLoader(loader.dataset, elastic, position, **kwargs)


def check_global_batch(global_batch_size: int | None, data_size: int) -> None:
    """Raises if ``global_batch_size`` does not split evenly over ``data_size`` replicas."""
    if global_batch_size is not None and global_batch_size % data_size:
        raise MisconfigurationException(
            f"global_batch_size={global_batch_size} does not split evenly over {data_size} data-parallel"
            f" replicas: choose a multiple of {data_size}, or another pipeline_parallel_size."
        )


def resumable_training_loader(
    dataloader: Any, fit_loop: Any, num_replicas: int, rank: int, global_batch_size: int | None
) -> Any:
    """The training loader Lightning prepared, made resumable (see :func:`make_resumable`) where it can be.

    Its position comes from Lightning's fit loop: the epoch, and the batches whose step has finished in it.
    Any other iterable (a ``DataLoader`` with its own sampler or over an ``IterableDataset``, a streaming
    dataset's loader, any object with ``__iter__``) is kept as it is, with a warning: each process reads what
    it yields, and a run resumed mid-epoch starts wherever the iterable starts.

    Args:
        dataloader: The training loader as Lightning prepared it.
        fit_loop: The trainer's ``fit_loop``.
        num_replicas: Number of data-parallel replicas (D).
        rank: This replica's index.
        global_batch_size: Samples per batch over all replicas (a multiple of D), or ``None`` to keep the
            loader's batch size per replica.

    Raises:
        MisconfigurationException: ``global_batch_size`` is set but the loader has its own sampler.
    """
    batch_size = None if global_batch_size is None else global_batch_size // num_replicas

    def epoch() -> int:
        return int(fit_loop.epoch_progress.current.processed)

    def position() -> tuple[int, int]:
        return epoch(), fit_loop.epoch_loop.batch_progress.current.processed

    resumable = make_resumable(dataloader, num_replicas, rank, batch_size, epoch, position)
    if resumable is None:
        if global_batch_size is not None:
            raise MisconfigurationException(
                "global_batch_size needs Lightning's default distributed sampler: pass a plain DataLoader (no"
                " custom sampler or batch_sampler) and keep Trainer(use_distributed_sampler=True), or drop"
                " global_batch_size and set the DataLoader's batch_size to the per-replica batch."
            )
        rank_zero_warn(_not_resumable(dataloader, num_replicas), category=VarunaWarning)
        return dataloader
    if batch_size is not None and batch_size != dataloader.batch_size:
        rank_zero_info(
            f"VarunaStrategy: global_batch_size={global_batch_size} over {num_replicas} replica(s): each reads"
            f" batches of {batch_size} (the DataLoader's batch_size={dataloader.batch_size} is not used)."
        )
    return resumable


def sample_batch(trainer: Any, patches: InstancePatches) -> Any:
    """The first batch of the dataloader the trainer's running loop is about to use, for the strategy's dry run.

    A ``*_dataloader()`` hook is called here as the loop would call it (``_request_dataloader``, which records the
    loader's arguments for Lightning's sampler injection), and the loop's first request gets the same loaders
    back (:func:`~lightning_varuna.trainer.patches.hand_over_dataloader`): the hook runs as often as in a plain run.
    Reading the batch leaves the RNGs as they were.
    """
    fn = trainer.state.fn.value  # "fit", "validate", "test" or "predict"
    loop = trainer.fit_loop if fn == "fit" else getattr(trainer, f"{fn}_loop")
    source = loop._data_source  # where Lightning's loop takes its dataloaders from
    loaders = _request_dataloader(source) if source.is_module() else source.dataloader()
    with torch.random.fork_rng():
        first = loaders
        while isinstance(first, (list, tuple, dict)):
            first = next(iter(first.values())) if isinstance(first, dict) else first[0]
        iterator = iter(first)
        if iterator is first:
            raise MisconfigurationException(
                f"VarunaStrategy takes one batch from the loader for its dry run, but this one"
                f" ({type(first).__name__}) is a one-shot iterator (iter() returns the object itself) that"
                " would lose that batch. Pass an iterable whose __iter__ starts a new pass, e.g. a DataLoader"
                " over a torch.utils.data.IterableDataset."
            )
        try:
            batch = next(iterator)
        except StopIteration:
            raise MisconfigurationException(
                "VarunaStrategy needs one batch from the dataloader for its dry run, but it is empty."
            ) from None
    if source.is_module() and not _holds_iterator(loaders):  # an iterator would not start again for the loop
        hand_over_dataloader(patches, source, loaders)
    return batch


def _holds_iterator(loaders: Any) -> bool:
    if isinstance(loaders, (list, tuple)):
        return any(_holds_iterator(x) for x in loaders)
    if isinstance(loaders, dict):
        return any(_holds_iterator(x) for x in loaders.values())
    return isinstance(loaders, Iterator)


def _not_resumable(loader: Any, num_replicas: int) -> str:
    """What a training loader that is not made resumable means for the user, and what it needs."""
    if type(loader) is DataLoader and not isinstance(loader.dataset, IterableDataset):
        what = "The training DataLoader has its own sampler"
    else:
        what = f"The training loader ({type(loader).__name__}) is an iterable without Lightning's sampler"
    replicas = (
        f" (and each of the {num_replicas} replicas its own: split the data by replica with"
        " `trainer.strategy.distributed_sampler_kwargs`, num_replicas and rank, not by global rank)"
        if num_replicas > 1 else ""
    )
    return (
        f"VarunaStrategy: {what}: every process reads what it yields, and a run resumed mid-epoch starts wherever"
        " it starts (no exact-sample resume). Every pipeline stage of a replica must get the same batches in the"
        f" same order{replicas}."
    )
