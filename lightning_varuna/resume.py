"""Resuming with ``ckpt_path="last"``: the checkpoints to fall back to when the newest one is bad."""

from __future__ import annotations

import os
from typing import Any

from lightning_varuna.checkpoint.storage import META, PART_SUFFIX, TMP_SUFFIX, TRASH_SUFFIX, Location, is_complete
from lightning_varuna.patches import requested_ckpt_path

__all__ = ["last_fallbacks"]


def last_fallbacks(trainer: Any, bad: str) -> list[str]:
    """If the user asked for ``ckpt_path="last"``: the other complete checkpoints of the run, newest first.

    Looked for in every ``ModelCheckpoint``'s ``dirpath`` and next to ``OnExceptionCheckpoint``'s file.
    """
    if requested_ckpt_path(trainer) != "last":
        return []
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    folders = {cb.dirpath for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)}
    folders |= {os.path.dirname(cb.ckpt_path) for cb in trainer.callbacks if isinstance(cb, OnExceptionCheckpoint)}
    bad_loc = Location.of(bad)
    found: dict[str, float] = {}
    for folder in folders:
        root = Location.of(folder)
        if not root.isdir():
            continue
        for entry in root.fs.ls(root.path, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            loc = root.child(name)
            skipped = name.endswith((TMP_SUFFIX, PART_SUFFIX, TRASH_SUFFIX)) or loc.path == bad_loc.path
            if skipped or not is_complete(loc):
                continue
            if loc.isdir():
                found[str(loc)] = loc.child(META).modified()
            elif name.endswith(".ckpt"):
                found[str(loc)] = loc.modified()
    return sorted(found, key=found.get, reverse=True)  # type: ignore[arg-type]
