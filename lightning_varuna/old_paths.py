"""Old module paths keep working: one import finder maps each moved module's old path to its new one.

The modules were regrouped into sub-packages (``pipeline/model/``, ``pipeline/scheduling/``, ``fault/``, ...) and
some were renamed. ``import lightning_varuna.pipeline.partition`` (any old path in :data:`MOVED`) still works: it
warns (``FutureWarning``, naming the new path) and gives the module at the new path, the same object, so names
imported, patched or pickled under the old path are the new module's. ``python -m`` with an old path runs the new
module. The package's ``__init__`` installs the finder (:func:`install`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import CodeType, ModuleType
from typing import cast

__all__ = ["MOVED", "REMOVED", "OldPaths", "install"]

MOVED = {
    "lightning_varuna.pipeline.cut": "lightning_varuna.pipeline.model.cut",
    "lightning_varuna.pipeline.partition": "lightning_varuna.pipeline.model.partition",
    "lightning_varuna.pipeline.costs": "lightning_varuna.pipeline.model.segment_costs",
    "lightning_varuna.pipeline.stage": "lightning_varuna.pipeline.model.stand_ins",
    "lightning_varuna.pipeline.materialize": "lightning_varuna.pipeline.model.meta_init",
    "lightning_varuna.pipeline.no_trace": "lightning_varuna.pipeline.model.no_trace",
    "lightning_varuna.pipeline.schedules": "lightning_varuna.pipeline.scheduling.schedules",
    "lightning_varuna.pipeline.simulator": "lightning_varuna.pipeline.scheduling.simulator",
    "lightning_varuna.pipeline.p2p_plan": "lightning_varuna.pipeline.scheduling.lowering",
    "lightning_varuna.pipeline.p2p_check": "lightning_varuna.pipeline.scheduling.nccl_replay",
    "lightning_varuna.pipeline.executor": "lightning_varuna.pipeline.runtime.executor",
    "lightning_varuna.pipeline.stage_step": "lightning_varuna.pipeline.runtime.stage_step",
    "lightning_varuna.pipeline.step_links": "lightning_varuna.pipeline.runtime.links",
    "lightning_varuna.pipeline.events": "lightning_varuna.pipeline.runtime.events",
    "lightning_varuna.pipeline.grad_accumulation": "lightning_varuna.pipeline.runtime.fused_linear_grad",
    "lightning_varuna.pipeline.p2p": "lightning_varuna.pipeline.comm.transfers",
    "lightning_varuna.pipeline.grad_sync": "lightning_varuna.pipeline.comm.grad_sync",
    "lightning_varuna.pipeline.replicas": "lightning_varuna.pipeline.comm.initial_sync",
    "lightning_varuna.pipeline.autoconfig": "lightning_varuna.pipeline.planning.choice",
    "lightning_varuna.pipeline.planner": "lightning_varuna.pipeline.planning.search",
    "lightning_varuna.pipeline.memory": "lightning_varuna.pipeline.planning.memory_model",
    "lightning_varuna.pipeline.profile": "lightning_varuna.pipeline.planning.profile_data",
    "lightning_varuna.pipeline.profiler": "lightning_varuna.pipeline.planning.profiler",
    "lightning_varuna.pipeline.segment_profiler": "lightning_varuna.pipeline.planning.segment_profiler",
    "lightning_varuna.pipeline.timeline": "lightning_varuna.pipeline.timelines.timeline",
    "lightning_varuna.pipeline.failures": "lightning_varuna.fault.failures",
    "lightning_varuna.pipeline.watchdog": "lightning_varuna.fault.watchdog",
    "lightning_varuna.checkpoint.convert": "lightning_varuna.checkpoint.plain_format",
    "lightning_varuna.engine_setup": "lightning_varuna.pipeline_setup",
    "lightning_varuna.steps": "lightning_varuna.step_hooks",
    "lightning_varuna.checkpointing": "lightning_varuna.recovery.checkpoint_hooks",
    "lightning_varuna.resume": "lightning_varuna.recovery.resume",
    "lightning_varuna.preemption": "lightning_varuna.recovery.preemption",
    "lightning_varuna.hook_logs": "lightning_varuna.logs.hook_logs",
    "lightning_varuna.log_sync": "lightning_varuna.logs.log_sync",
    "lightning_varuna.gradients": "lightning_varuna.batch_gradients",
    "lightning_varuna.planning": "lightning_varuna.reports",
}
"""Old module path -> new module path."""

REMOVED = {
    "lightning_varuna.pipeline.png": "timeline pictures are drawn with matplotlib: use"
                                     " lightning_varuna.pipeline.timelines.picture.render_png",
}
"""Old module path -> what replaced it (importing it raises ``ImportError`` saying so)."""


class OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of :data:`MOVED`; loading one warns and gives the module at its new path."""

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        """A spec of this loader for an old path; None for any other module."""
        if fullname in REMOVED:
            raise ImportError(f"{fullname} was removed: {REMOVED[fullname]}.", name=fullname)
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        """The module at the new path (imported if need be), after a warning that names it."""
        _warn(spec.name)
        module = importlib.import_module(MOVED[spec.name])
        self._specs[spec.name] = module.__spec__  # the import system puts the old path's spec on it next
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the module ran at its new path): its own spec put back."""
        spec = module.__spec__
        assert spec is not None  # the import system has just given the module the old path's spec
        module.__spec__ = self._specs.pop(spec.name)

    def get_code(self, fullname: str) -> CodeType | None:
        """The new module's code, for ``python -m`` with an old path."""
        _warn(fullname)
        spec = importlib.util.find_spec(MOVED[fullname])
        assert spec is not None  # MOVED names modules of this package
        # a module of this package is loaded from source, by a loader that can give its code
        return cast(importlib.abc.InspectLoader, spec.loader).get_code(spec.name)


def _warn(old: str) -> None:
    warnings.warn(f"{old} moved to {MOVED[old]}: import it from there (the old path is deprecated)", FutureWarning,
                  stacklevel=3)


def install() -> None:
    """Puts the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, OldPaths) for finder in sys.meta_path):
        sys.meta_path.insert(0, OldPaths())  # before path finders (an editable install maps names to files)
