"""Every place where lightning-varuna changes an object that is Lightning's or the user's, and why: :data:`PATCHES`.

Lightning offers no extension point for Lightning's entries. Each acts only for a trainer whose strategy is a
:class:`~lightning_varuna.VarunaStrategy`; the instance patches are applied through :class:`InstancePatches` by the
strategy (during ``setup``) and undone in its ``teardown``, so a later trainer in the same process sees stock
Lightning. The user's model is changed where pipelining needs it (its stage kept, the rest stood in for), and
Lightning's precision plugin is replaced by a pipeline-aware subclass of its own class. Each entry of
:data:`PATCHES` says what is changed, where the package does it, why, which versions it was tested with and how
it is undone; ``tests/architecture/test_architecture.py`` checks that the list matches the code (every such
assignment in the package is listed, every listed one exists).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PATCHES", "InstancePatches", "Patch", "hand_over_dataloader", "install_ckpt_path_recorder", "kept_on_meta",
    "meta_dry_run", "replaced_log", "requested_ckpt_path", "selected_ckpt_path", "silence_prediction_writers",
    "summarize_with", "take_over_sigterm",
]

@dataclass(frozen=True)
class Patch:
    """One change the package makes to an object that is not its own.

    Attributes:
        number: Its number (the functions below name it).
        target: What is changed.
        sites: Where the package does it: ``(module path inside the package, a piece of the line that does it)``.
        why: Why (no public API does it).
        tested: The versions it was tested with.
        undone: How and when it is undone.
    """

    number: int
    target: str
    sites: tuple[tuple[str, str], ...]
    why: str
    tested: str
    undone: str


_LIGHTNING = "Lightning 2.6 (2.6.6; pyproject.toml pins >=2.6,<2.7), torch 2.13 and 2.14"
_TORCH = "torch 2.13 and 2.14"
_TEARDOWN = "by InstancePatches.undo in the strategy's teardown (a later trainer sees stock Lightning)"
_ENGINE_TEARDOWN = (
    "by PipelineEngine.teardown (a user of the engine alone); under the strategy the module stays partitioned for"
    " its later trainer calls")

PATCHES: tuple[Patch, ...] = (
    Patch(1, "_CheckpointConnector._select_ckpt_path (the class's method), and two attributes it records on the"
          " trainer's checkpoint connector", (
              ("trainer/patches.py", "_CheckpointConnector._select_ckpt_path = select"),
              ("trainer/patches.py", "setattr(self, _REQUESTED, ckpt_path)"),
              ("trainer/patches.py", "setattr(self, _SELECTED, selected)")),
          "Lightning resolves ckpt_path='last' before any strategy hook runs, and the strategy needs what the user"
          " asked for ('last' may fall back to an older checkpoint, an explicit path may not). For 'last' it chooses"
          " the newest complete copy of the run's last checkpoint (recovery.resume.choose_last, from the files alone,"
          " so every rank chooses alike before the process group exists), which Lightning misses when an"
          " interrupted publication left it under a temporary name; at setup it also tells whether a checkpoint"
          " will be restored (initial_weights are then not loaded).", _LIGHTNING,
          "never: installed once per process, it calls Lightning's own method for any other strategy"),
    Patch(2, "trainer._signal_connector.register_signal_handlers (during fit)", (
              ("trainer/patches.py", 'patches.replace(trainer._signal_connector, "register_signal_handlers"'),),
          "Lightning's SIGTERM handler runs a collective inside the signal handler, which deadlocks a pipeline when"
          " one rank is signalled while its peers wait in a p2p receive; its SLURM handler saves a checkpoint inside"
          " the handler. The strategy's own handlers only set a flag (recovery.preemption).", _LIGHTNING,
          "by InstancePatches.undo when the preemption guard is detached (the strategy's teardown)"),
    Patch(3, "fit_loop.epoch_loop._broadcast_sigterm_tensor (during fit)", (
              ("trainer/patches.py", 'patches.replace(epoch_loop, "_broadcast_sigterm_tensor", agree)'),),
          "Lightning broadcasts rank 0's SIGTERM flag at every batch; the strategy agrees on every rank's flag"
          " instead (an all-reduce in its place, so the agreement costs no extra collective).", _LIGHTNING,
          "by InstancePatches.undo when the preemption guard is detached (the strategy's teardown)"),
    Patch(4, "fit_loop.epoch_loop.advance (during fit, one process only)", (
              ("trainer/patches.py", 'patches.replace(epoch_loop, "advance", agree_then_advance)'),),
          "Lightning calls (3) only with several processes; a single process agrees before each batch here.",
          _LIGHTNING, "by InstancePatches.undo when the preemption guard is detached (the strategy's teardown)"),
    Patch(5, "LightningModule.log of the user's module (while the strategy runs one step)", (
              ("trainer/patches.py", "module.log = log"), ("trainer/patches.py", "del module.log")),
          "A pipelined step calls the user's step once per micro-batch and only the last stage sees the loss, so"
          " its self.log calls are captured, reduced over micro-batches and shared over the pipeline before"
          " Lightning sees them (logs.log_sync).", _LIGHTNING, "at the end of the step (a context manager)"),
    Patch(6, "ModelSummary._summary of the trainer's model summary callbacks (during fit)", (
              ("trainer/patches.py", 'patches.replace(callback, "_summary"'),),
          "Lightning summarizes the module at on_fit_start, after the strategy has cut it down to one stage;"
          " _summary is where Lightning itself picks another summary (DeepSpeed's). It returns the whole model's"
          " summary, made by Lightning's own _summary before the model was partitioned (callbacks).", _LIGHTNING,
          _TEARDOWN),
    Patch(7, "_DataLoaderSource.dataloader of the running loop's data source (from setup to the loop's first"
          " request)", (
              ("trainer/patches.py", 'patches.replace(source, "dataloader", dataloader)'),
              ("trainer/patches.py", 'vars(source).pop("dataloader", None)')),
          "The dry run needs a batch before Lightning requests the dataloader, and a second *_dataloader() call"
          " would be one more than a plain run makes (reload_dataloaders_every_n_epochs counts them): the loop"
          " gets, once, the loader the dry run's batch came from.", _LIGHTNING,
          "at the loop's first request (it removes itself), else " + _TEARDOWN),
    Patch(8, "BasePredictionWriter.write_on_batch_end/write_on_epoch_end of the trainer's prediction writers"
          " (during predict, on every stage but the first)", (
              ("trainer/patches.py", 'patches.replace(callback, "write_on_batch_end"'),
              ("trainer/patches.py", 'patches.replace(callback, "write_on_epoch_end"')),
          "Every stage of a pipeline holds the same predictions, so each replica writes them once, as a process of"
          " a plain data-parallel run does.", _LIGHTNING, _TEARDOWN),
    Patch(9, "LightningModule._device of the user's module (during the dry run of a model built on meta)", (
              ("trainer/patches.py", 'patches.replace(module, "_device"'),),
          "The step then runs on meta tensors, and code that creates tensors on self.device must create them"
          " there.", _LIGHTNING, "at the end of the dry run (a context manager)"),
    Patch(10, "forward and update of the module's torchmetrics Metrics (during that dry run)", (
              ("trainer/patches.py", 'patches.replace(metric, "update"'),
              ("trainer/patches.py", 'patches.replace(metric, "forward"')),
          "A metric's state is real and its input validation reads values, neither of which works on meta"
          " tensors; the dry run only needs shapes.", _LIGHTNING + ", torchmetrics 1.x",
          "at the end of the dry run (a context manager)"),
    Patch(11, "cpu of the user's module (during teardown, only if setup failed before this stage was"
          " materialized)", (("trainer/patches.py", 'patches.replace(module, "cpu"'),),
          "Lightning's teardown moves the module to the CPU, which raises for meta tensors and would hide the error"
          " that ended setup; the real tensors are moved instead, meta ones stay.", _LIGHTNING,
          "at the end of Lightning's teardown (a context manager)"),
    Patch(12, "Lightning's precision plugin: replaced by an object of a generated subclass of its class and"
          " PipelinePrecision, sharing its attributes; its loss scaler by a ShardedGradScaler; the global norm"
          " given to it", (
              ("trainer/precision.py", 'type(f"Pipeline{cls.__name__}"'),
              ("trainer/precision.py", "wrapped.__dict__.update(plugin.__dict__)"),
              ("trainer/precision.py", "with_scaler.scaler = _sharded("),
              ("trainer/strategy.py", "precision.global_grad_norm = self.global_grad_norm")),
          "clip_grad_by_norm must clip by the whole model's norm (all stages), and fp16 overflow must be agreed by"
          " every stage and replica; a subclass of the user's own plugin class keeps everything else of it"
          " (autocast, conversions, state) and Lightning's isinstance checks.", _LIGHTNING,
          "not needed: the plugin object the user gave is left as it was (the strategy holds the new one)"),
    Patch(13, "LightningModule._current_fx_name of the user's module (while the merged optimizer-hook logs are"
          " replayed)", (
              ("trainer/logs/hook_logs.py", "module._current_fx_name = HOOK"),
              ("trainer/logs/hook_logs.py", "module._current_fx_name = previous")),
          "Lightning files a self.log call under the hook that is running; the logs of on_before_optimizer_step,"
          " merged over the pipeline, are replayed after it and must be filed under it.", _LIGHTNING,
          "at once: the previous value is put back (try/finally)"),
    Patch(14, "torchmetrics Metric._forward_cache of a metric the user logs (on every stage, at a step's end)", (
              ("trainer/logs/log_sync.py", "metric._forward_cache = flat[index].float()"),),
          "Lightning's step value of a logged Metric object is its _forward_cache: it becomes the batch's value,"
          " shared from the last stage (not the last micro-batch's, nor a stale one on other stages).",
          _LIGHTNING + ", torchmetrics 1.x", "not undone: the metric's next forward sets it, as without the strategy"),
    Patch(15, "lightning's rank_zero_only.rank (Lightning's and Fabric's)", (
              ("trainer/processes.py", "rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank"),),
          "Lightning's rank-zero utilities read it; Lightning's own parallel strategies set it the same way.",
          _LIGHTNING, "not undone, as by Lightning's strategies"),
    Patch(16, "the user's model: modules of other stages stood in for (their forward replaced, a compiled"
          " module's compiled call dropped meanwhile), other stages' parameters replaced by zero-stride buffers", (
              ("pipeline/model/stand_ins.py", "stand_in.module.forward = stand_in"),
              ("pipeline/model/stand_ins.py", "stand_in.module._compiled_call_impl = None"),
              ("pipeline/model/stand_ins.py", 'del stand_in.module.__dict__["forward"]'),
              ("pipeline/model/stand_ins.py", "stand_in.module._compiled_call_impl = stand_in.compiled_call"),
              ("pipeline/model/stand_ins.py", "del module._parameters[attr]"),
              ("pipeline/model/stand_ins.py", "module.register_buffer(attr, placeholder"),
              ("pipeline/model/stand_ins.py", "handles.append(module.register_forward_pre_hook(hook))")),
          "Each rank keeps one stage: the user's unchanged step must run on it, with no memory for the other"
          " stages (pipeline.model.stand_ins); a module holding freed parameters gets a pre-hook that refuses a call"
          " the dry run did not see (it would compute with the placeholders).", _TORCH,
          "forwards and compiled calls " + _ENGINE_TEARDOWN + "; freed parameters and their guards stay"),
    Patch(17, "forward of the user's plain nn.Linear modules (gradients accumulated in place)", (
              ("pipeline/runtime/fused_linear_grad.py", "module.forward = functools.partial(_forward, module)"),
              ("pipeline/runtime/fused_linear_grad.py", 'del module.__dict__["forward"]')),
          "Later micro-batches' weight gradients are added into .grad with one multiply-add, without a"
          " weight-sized temporary (fuse_grad_accumulation).", _TORCH, _ENGINE_TEARDOWN),
    Patch(18, "forward hooks on the children of the user's containers named by cut_at", (
              ("pipeline/model/cut.py", "child.register_forward_hook(hook)"),),
          "cut_at cuts between blocks without code changes: each block's output goes through a cut point.",
          _TORCH, "the hooks are removed " + _ENGINE_TEARDOWN),
    Patch(19, "the user's model during a dry run: its registered tensors replaced (meta or placeholder views),"
          " parameters created on meta while it is built in configure_model, process-wide module hooks while it is"
          " traced", (
              ("pipeline/model/meta_init.py", "setattr(module, attr, new[id(tensor)])"),
              ("pipeline/model/meta_init.py", "register_module_parameter_registration_hook(to_meta_parameter)"),
              ("pipeline/model/dry_run.py", "register_module_forward_pre_hook(tracer.pre_hook)"),
              ("pipeline/model/dry_run.py", "register_module_forward_hook(tracer.post_hook)"),
              ("pipeline/model/dry_run.py", "m.register_forward_pre_hook(tracer.arguments, with_kwargs=True)")),
          "The dry run finds cut points, shapes and the modules and parameters of each segment, without memory for"
          " the whole model when it is built on meta.", _TORCH,
          "at the end of each block: the original tensors put back, the hooks removed"),
    Patch(20, "the user's model after the dry run: what its step changed put back (attributes, buffers, tensors"
          " in place, registrations, RNG states)", (
              ("pipeline/model/no_trace.py", "value.data = saved"),
              ("pipeline/model/no_trace.py", "setattr(self.module, name, saved.restore())")),
          "The first real step must start from the state a plain run's would (a metric fed by the dry run, a"
          " BatchNorm's statistics, the RNGs).", _TORCH, "this is the undoing of the dry run's own changes"),
    Patch(21, "the user's optimizer under zero_stage=1: its groups' params and its state keys, for the step only;"
          " and its step pre/post hooks", (
              ("pipeline/comm/sharded_step.py", 'group["params"] = [view for view, _ in pairs]'),
              ("pipeline/comm/sharded_step.py", 'group["params"] = params'),
              ("pipeline/comm/sharded_step.py", "optimizer.register_step_pre_hook(self._before_step)"),
              ("pipeline/comm/sharded_step.py", "optimizer.register_step_post_hook(self._after_step)"),
              ("pipeline/comm/sharded_step.py", 'group["lr"] = 0.0 if not isinstance'),
              ("pipeline/comm/sharded_step.py", 'group["lr"] = lr')),
          "Each replica steps its own rows of every parameter: the optimizer runs unchanged on row views, so any"
          " elementwise optimizer gives the unsharded result. A shard without state yet gets it from one step at"
          " learning rate 0 with zero gradients (the groups' lr set to 0 and put back).", _TORCH,
          "the post-hook puts the module's own parameters and state keys back after every step; the hooks are"
          " removed at the strategy's teardown"),
    Patch(22, "forward pre-hooks and forward hooks on the user's modules that make or use side values", (
              ("pipeline/runtime/side_value_hooks.py", "register_forward_pre_hook(_substitute(slot),"),
              ("pipeline/runtime/side_value_hooks.py", "register_forward_hook(_capture(slot), prepend=True)"),
              ("pipeline/runtime/side_value_hooks.py", "register_forward_hook(_give(slot), prepend=True)")),
          "A value a later stage uses other than through a cut point (T5's position bias) is captured where it is"
          " made and put in place of the argument where it is used (pipeline.runtime.side_value_hooks), or, read by"
          " the step's code (router logits), in place of its stood-in producer's output on the reading stage; the"
          " hooks act only while a stage's forward runs, and the compiler traces them.", _TORCH,
          "the hooks are removed " + _ENGINE_TEARDOWN),
    Patch(23, "the user's module on stages whose step never creates a metric the last stage's step creates on first"
          " use: a reset copy of that metric registered at the same path", (
              ("trainer/logs/log_sync.py", "setattr(parent, attribute, template.to(device))"),),
          "Every stage then holds the metric its logs replay into, so an epoch-end compute() does not wait on a stage"
          " without it.", _LIGHTNING + ", torchmetrics 1.x",
          "not undone: the module holds the metric its own step would have created, as in the plain run"),
)
"""Every change to an object that is not the package's own (``tests/architecture/test_architecture.py`` keeps it
complete)."""


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
    if getattr(original, "__module__", None) == __name__:  # already installed: the method is this module's select
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

    _CheckpointConnector._select_ckpt_path = select  # type: ignore[method-assign]  # the patch itself


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
