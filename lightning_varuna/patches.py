"""Every place where lightning-varuna replaces a method of a Lightning object, and why.

Lightning offers no extension point for these. Each one acts only for a trainer whose strategy is a
:class:`~lightning_varuna.VarunaStrategy`; the instance patches are installed by the strategy (during ``setup``)
and undone in its ``teardown``, so a later trainer in the same process sees stock Lightning.

1. ``_CheckpointConnector._select_ckpt_path`` (class level, installed when the strategy is created): Lightning
   resolves ``ckpt_path="last"`` to a path before any strategy hook runs, and the strategy needs the value the
   user asked for ("last" may fall back to an older checkpoint; an explicit path may not). For ``"last"`` it
   also chooses the newest complete copy of the run's last checkpoint, which Lightning does not see when an
   interrupted publication left it under a temporary name (:func:`lightning_varuna.recovery.resume.choose_last`, from
   the files alone: every rank chooses alike before the process group exists). It also records, at setup, whether a
   checkpoint will be restored at all (Lightning records the resolved path only after the strategy's setup;
   ``initial_weights`` are not loaded when a checkpoint supplies the weights). For any other strategy the wrapper only
   calls Lightning's own method.
2. ``trainer._signal_connector.register_signal_handlers`` (during ``fit``): Lightning's SIGTERM handler runs a
   collective inside the signal handler, which deadlocks a pipeline when one non-zero rank is signalled while
   its peers wait in a p2p receive; its SLURM handler saves a checkpoint inside the handler. The strategy's
   own handlers only set a flag (:mod:`lightning_varuna.recovery.preemption`).
3. ``fit_loop.epoch_loop._broadcast_sigterm_tensor`` (during ``fit``): Lightning broadcasts rank 0's SIGTERM
   flag at every batch; the strategy agrees on every rank's flag instead (an all-reduce in its place, so the
   agreement costs no extra collective).
4. ``fit_loop.epoch_loop.advance`` (during ``fit``, one process only): Lightning calls (3) only with several
   processes; a single process agrees before each batch here.
5. ``LightningModule.log`` of the user's module (while the strategy runs one step): a pipelined step calls
   the user's step once per micro-batch, and only the last stage sees the loss, so its ``self.log`` calls are
   captured, reduced over micro-batches and shared over the pipeline before Lightning sees them
   (:mod:`lightning_varuna.logs.log_sync`).
6. ``ModelSummary._summary`` of the trainer's model summary callbacks (during ``fit``): Lightning summarizes the
   module at ``on_fit_start``, after the strategy has cut it down to one stage; the callback's ``_summary`` is
   where Lightning itself picks another summary (DeepSpeed's). It returns the whole model's summary, made by
   Lightning's own ``_summary`` before the model was partitioned (:mod:`lightning_varuna.callbacks`).
7. ``_DataLoaderSource.dataloader`` of the running loop's data source (from setup to the loop's first request):
   the dry run needs a batch before Lightning requests the dataloader, and a second ``*_dataloader()`` call
   would be one more than a plain run makes (``reload_dataloaders_every_n_epochs`` counts them); the loop gets,
   once, the loader the dry run's batch came from.
8. ``BasePredictionWriter.write_on_batch_end``/``write_on_epoch_end`` of the trainer's prediction writers
   (during ``predict``, on every stage but the first): every stage of a pipeline holds the same predictions, so
   each replica writes them once, as a process of a plain data-parallel run does.
9. ``LightningModule._device`` of the user's module (during the dry run of a model built on the meta device):
   the step then runs on meta tensors, and code that creates tensors on ``self.device`` must create them there.
10. ``forward`` and ``update`` of the module's torchmetrics ``Metric``s (during that dry run): a metric's state
    is real and its input validation reads values, neither of which works on meta tensors; the dry run only
    needs shapes, and metric states are put back after it anyway.
11. ``cpu`` of the user's module (during ``teardown``, only if setup failed before this stage's parameters were
    materialized): Lightning's teardown moves the module to the CPU, which raises for meta tensors and would hide
    the error that ended setup. The module's real tensors are moved to the CPU instead; meta ones stay.

Tested on Lightning 2.5 and 2.6 (``pyproject.toml`` pins that range).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "InstancePatches", "hand_over_dataloader", "install_ckpt_path_recorder", "kept_on_meta", "meta_dry_run",
    "replaced_log", "requested_ckpt_path", "selected_ckpt_path", "silence_prediction_writers", "summarize_with",
    "take_over_sigterm",
]

_REQUESTED = "_varuna_requested_ckpt_path"
_SELECTED = "_varuna_selected_ckpt_path"
_UNSET = object()


def _is_varuna(strategy: Any) -> bool:
    return getattr(strategy, "strategy_name", None) == "varuna"


def install_ckpt_path_recorder(choose_last: Callable[[Any, Any], Any]) -> None:
    """Patch 1: records the ``ckpt_path`` the user passed and resolves ``"last"``, for this strategy (installed once).

    Args:
        choose_last: ``(trainer, Lightning's choice) -> path or None``: the checkpoint ``"last"`` stands for.
    """
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    original = _CheckpointConnector._select_ckpt_path
    if getattr(original, "_varuna", False):
        return

    def select(self: Any, state_fn: Any, ckpt_path: Any, *args: Any, **kwargs: Any) -> Any:
        if not _is_varuna(self.trainer.strategy):
            return original(self, state_fn, ckpt_path, *args, **kwargs)
        setattr(self, _REQUESTED, ckpt_path)
        selected = _select_for_varuna(self, original, state_fn, ckpt_path, *args, **kwargs)
        setattr(self, _SELECTED, selected)
        return selected

    def _select_for_varuna(self: Any, original: Any, state_fn: Any, ckpt_path: Any, *args: Any, **kwargs: Any) -> Any:
        if ckpt_path != "last":
            return original(self, state_fn, ckpt_path, *args, **kwargs)
        with warnings.catch_warnings(record=True) as caught:  # "no last checkpoint" may not be so
            warnings.simplefilter("always")
            chosen = original(self, state_fn, ckpt_path, *args, **kwargs)
        ours = choose_last(self.trainer, chosen)
        if ours is None:
            for warning in caught:
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
        return ours if ours is not None else chosen

    select._varuna = True  # type: ignore[attr-defined]
    _CheckpointConnector._select_ckpt_path = select  # type: ignore[method-assign]


def requested_ckpt_path(trainer: Any) -> Any:
    """The ``ckpt_path`` the user passed to the running ``fit``/``validate``/... (recorded by patch 1)."""
    return getattr(trainer._checkpoint_connector, _REQUESTED, None)


def selected_ckpt_path(trainer: Any) -> Any:
    """The checkpoint Lightning will restore in the running ``fit``/``validate``/... (None: none; patch 1)."""
    return getattr(trainer._checkpoint_connector, _SELECTED, None)


class InstancePatches:
    """Methods replaced on single objects, and undone together (in reverse order)."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []

    def replace(self, obj: Any, name: str, value: Any) -> None:
        """Sets ``obj.<name> = value`` until :meth:`undo`."""
        self._undo.append((obj, name, vars(obj).get(name, _UNSET)))
        setattr(obj, name, value)

    def undo(self) -> None:
        """Puts back everything replaced."""
        for obj, name, previous in reversed(self._undo):
            if previous is _UNSET:
                vars(obj).pop(name, None)
            else:
                setattr(obj, name, previous)
        self._undo = []

    def __bool__(self) -> bool:
        return bool(self._undo)


def take_over_sigterm(patches: InstancePatches, trainer: Any, agree: Callable[[], None]) -> None:
    """Patches 2-4: Lightning installs no signal handler, and ``agree`` runs at every training batch's start."""
    epoch_loop = trainer.fit_loop.epoch_loop
    patches.replace(trainer._signal_connector, "register_signal_handlers", lambda: None)
    patches.replace(epoch_loop, "_broadcast_sigterm_tensor", agree)
    if trainer.world_size == 1 or not hasattr(type(epoch_loop), "_broadcast_sigterm_tensor"):
        # Lightning calls the hook only with more than one process (and only since 2.5.2)
        advance = epoch_loop.advance

        def agree_then_advance(data_fetcher: Any) -> None:
            agree()
            advance(data_fetcher)

        patches.replace(epoch_loop, "advance", agree_then_advance)


@contextlib.contextmanager
def replaced_log(module: Any, log: Callable[..., None]) -> Iterator[None]:
    """Patch 5: ``module.log`` is ``log`` inside the block."""
    module.log = log
    try:
        yield
    finally:
        del module.log


def summarize_with(patches: InstancePatches, callback: Any, summary: Any) -> None:
    """Patch 6: the model summary ``callback`` prints at ``on_fit_start`` is ``summary``."""
    patches.replace(callback, "_summary", lambda trainer, pl_module: summary)


def hand_over_dataloader(patches: InstancePatches, source: Any, loaders: Any) -> None:
    """Patch 7: the next ``source.dataloader()`` call returns ``loaders`` (once) instead of calling the hook."""

    def dataloader() -> Any:
        vars(source).pop("dataloader", None)
        return loaders

    patches.replace(source, "dataloader", dataloader)


def silence_prediction_writers(patches: InstancePatches, callbacks: Any) -> None:
    """Patch 8: the prediction writers among ``callbacks`` write nothing."""
    from lightning.pytorch.callbacks import BasePredictionWriter

    for callback in callbacks:
        if isinstance(callback, BasePredictionWriter):
            patches.replace(callback, "write_on_batch_end", lambda *args, **kwargs: None)
            patches.replace(callback, "write_on_epoch_end", lambda *args, **kwargs: None)


@contextlib.contextmanager
def meta_dry_run(module: Any) -> Iterator[None]:
    """Patches 9 and 10: inside the block ``module.device`` is ``meta`` and its metrics do nothing."""
    import torch
    from torchmetrics import Metric

    patches = InstancePatches()
    if hasattr(module, "_device"):
        patches.replace(module, "_device", torch.device("meta"))
    for metric in module.modules():
        if isinstance(metric, Metric):
            patches.replace(metric, "update", lambda *args, **kwargs: None)
            patches.replace(metric, "forward", lambda *args, **kwargs: torch.zeros((), device="meta"))
    try:
        yield
    finally:
        patches.undo()


@contextlib.contextmanager
def kept_on_meta(module: Any) -> Iterator[None]:
    """Patch 11: ``module.cpu()`` does nothing inside the block."""
    patches = InstancePatches()
    patches.replace(module, "cpu", lambda: module)
    try:
        yield
    finally:
        patches.undo()
