"""Resuming with ``ckpt_path="last"``: which checkpoint that is, and what to fall back to when it is bad.

Lightning picks the newest ``last*.ckpt`` of the ``ModelCheckpoint`` folders by modification time, before any
strategy hook runs. A publication interrupted between its moves can leave the newest complete copy of
``last.ckpt`` as ``last.ckpt.varuna-tmp`` or ``last.ckpt.varuna-old`` (:mod:`lightning_varuna.checkpoint.publish`),
which Lightning does not see, and on an object store Lightning's listing drops the URL's protocol and finds
nothing. :func:`choose_last` (called from the wrapper of Lightning's choice, ``patches.py``) takes the newest
complete copy among all of them instead; it reads only the files, so every rank makes the same choice without a
process group.
"""

from __future__ import annotations

import os
import re
from typing import Any

from lightning_varuna.checkpoint.publish import OLD_SUFFIX, TMP_SUFFIX, TRASH_SUFFIX, copies, newest_copy
from lightning_varuna.checkpoint.storage import PART_SUFFIX, Location, is_complete, written_at
from lightning_varuna.trainer.patches import requested_ckpt_path

__all__ = ["checkpoint_folders", "choose_last", "last_fallbacks", "requested_name"]

_COPY_SUFFIXES = (TMP_SUFFIX, OLD_SUFFIX)


def checkpoint_folders(trainer: Any) -> list[str]:
    """The folders this run's checkpoint callbacks write to (``ModelCheckpoint``, ``OnExceptionCheckpoint``)."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    folders = [cb.dirpath for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
    folders += [os.path.dirname(cb.ckpt_path) for cb in trainer.callbacks if isinstance(cb, OnExceptionCheckpoint)]
    return list(dict.fromkeys(str(folder) for folder in folders))


def _family(name: str) -> str:
    """The checkpoint name a copy stands for (``last.ckpt`` for ``last.ckpt.varuna-tmp``)."""
    for suffix in _COPY_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def choose_last(trainer: Any, lightning_choice: Any) -> str | None:
    """The newest complete checkpoint that ``ckpt_path="last"`` stands for, or ``None`` if there is none.

    Candidates: Lightning's choice, every ``last*.ckpt`` in the ``ModelCheckpoint`` folders (Lightning's own
    pattern) and ``OnExceptionCheckpoint``'s file, each with the copies an interrupted publication leaves; of
    each checkpoint its newest complete copy, and of those the one finished last.
    """
    from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

    targets: dict[str, Location] = {}
    for cb in trainer.callbacks:
        if isinstance(cb, OnExceptionCheckpoint):
            loc = Location.of(cb.ckpt_path)
            targets[loc.text] = loc
        if not isinstance(cb, ModelCheckpoint) or not cb.dirpath:
            continue
        pattern = re.compile(rf"^{re.escape(cb.CHECKPOINT_NAME_LAST)}.*{re.escape(cb.FILE_EXTENSION)}$")
        folder = Location.of(cb.dirpath)
        folder.refresh()
        for name in {_family(name) for name in folder.names()}:
            if pattern.match(name):
                targets[folder.child(name).text] = folder.child(name)
    if lightning_choice:
        loc = Location.of(str(lightning_choice))
        targets.setdefault(loc.text, loc)
    found = [(copy, written_at(copy)) for copy in map(newest_copy, targets.values()) if copy is not None]
    if not found:
        return None
    return max(found, key=lambda pair: (pair[1], pair[0].text))[0].text


def requested_name(trainer: Any, path: str) -> str | None:
    """How an error names what ``ckpt_path="last"`` asked for: the checkpoint a copy of it stands for."""
    if requested_ckpt_path(trainer) != "last":
        return None
    return f'ckpt_path="last" ({_family(path)})'


def last_fallbacks(trainer: Any, bad: str) -> list[str]:
    """If the user asked for ``ckpt_path="last"``: the other complete checkpoints of the run, newest first.

    Looked for in every ``ModelCheckpoint``'s ``dirpath`` and next to ``OnExceptionCheckpoint``'s file, copies
    left by an interrupted publication included.
    """
    if requested_ckpt_path(trainer) != "last":
        return []
    bad_loc = Location.of(bad)
    found: dict[str, tuple[float, int]] = {}
    for folder in map(Location.of, checkpoint_folders(trainer)):
        folder.refresh()
        families = {_family(name) for name in folder.names()}
        for family in families:
            base = folder.child(family)
            if family.endswith((TRASH_SUFFIX, PART_SUFFIX)) or not (family.endswith(".ckpt") or base.isdir()):
                continue
            for rank, loc in enumerate(copies(base)):  # a newer copy first where two finished together
                if loc.path != bad_loc.path and is_complete(loc):
                    found[loc.text] = (written_at(loc), -rank)
    return sorted(found, key=found.__getitem__, reverse=True)
