"""Putting a written checkpoint in place so that no interruption, at any point, loses the newest complete one.

A checkpoint ``<path>`` is written as ``<path>.varuna-tmp`` and becomes complete when its ``meta.pt`` is in
(:func:`~lightning_varuna.checkpoint.storage.is_complete`). :func:`publish` then moves the checkpoint it replaces
aside (``<path>.varuna-old``), moves the new one into place, and deletes the old one. On the local disk each
move is one rename. On an object store (fsspec: S3, GCS, ...) a "rename" copies every object, so a move copies
the files, ``meta.pt`` last, and only then deletes the source, ``meta.pt`` first: at every instant one of the
two is complete, and the two are the same checkpoint while both are.

Whatever point a publication stops at, the three names of one checkpoint, taken in the order
``<path>.varuna-tmp``, ``<path>``, ``<path>.varuna-old``, hold the newest complete checkpoint in the first
complete one (:func:`newest_copy`); :func:`recover` finishes (or rolls back) an interrupted publication from
that rule before the next write. Rank 0 alone publishes and recovers, under the folder's lease
(:mod:`~lightning_varuna.checkpoint.lease`), so nothing else writes these names meanwhile.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable

from lightning_varuna.checkpoint.storage import META, README, README_TEXT, RECORD_FILE, Location, is_complete

__all__ = ["OLD_SUFFIX", "TMP_SUFFIX", "TRASH_SUFFIX", "copies", "move", "newest_copy", "publish", "recover",
           "remove_checkpoint", "remove_quietly"]

log = logging.getLogger(__name__)

TMP_SUFFIX = ".varuna-tmp"
OLD_SUFFIX = ".varuna-old"
TRASH_SUFFIX = ".varuna-trash"

FAULT_ENV = "LIGHTNING_VARUNA_TEST_FAULT"
"""Testing only: ``<point>@<p>.<n>`` ends the process (``os._exit(86)``) the ``n``-th time (default 1) the ``p``-th
:func:`publish` of this process reaches ``<point>``; ``...:raise`` raises instead. The points are the names passed
to :func:`reached`."""
fault_hook: Callable[[str], None] | None = None
"""Testing only: called with each point's name as the publication reaches it (may raise to stop it there)."""
_publications = 0
_counts: dict[str, int] = {}


def reached(point: str) -> None:
    """Marks a point of the publication sequence, where tests stop it (:data:`fault_hook`, :data:`FAULT_ENV`)."""
    if fault_hook is not None:
        fault_hook(point)
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    name, _, rest = spec.partition("@")
    where, _, action = rest.partition(":")
    publication, _, count = where.partition(".")
    if name != point or int(publication) != _publications:
        return
    _counts[point] = _counts.get(point, 0) + 1
    if _counts[point] == int(count or 1):
        if action == "raise":
            raise RuntimeError(f"fault injected at {point}")
        print(f"fault injected at {point}, exiting at {time.time():.3f}", file=sys.stderr, flush=True)
        os._exit(86)


def copies(target: Location) -> list[Location]:
    """The names one checkpoint may be found under, newest first: the new one, the one in place, the replaced one."""
    return [target.with_suffix(TMP_SUFFIX), target, target.with_suffix(OLD_SUFFIX)]


def newest_copy(target: Location) -> Location | None:
    """The newest complete copy of the checkpoint ``target`` names (``None`` if none is complete).

    ``<target>.varuna-tmp`` is complete only between the end of its write and its move into place, so it is newer
    than ``<target>``; ``<target>.varuna-old`` is what ``<target>`` held before. No process group is needed: every
    rank reaches the same answer from the same files.
    """
    for loc in copies(target):
        loc.refresh()
        if is_complete(loc):
            return loc
    return None


def move(src: Location, dst: Location) -> None:
    """Moves a checkpoint to a name that is free; never without a complete copy under one of the two names.

    Locally one rename (atomic). On an object store: every file copied, ``meta.pt`` last (``dst`` is complete
    from then on), then ``src``'s ``meta.pt`` deleted first (``src`` is no longer complete) and the rest.
    """
    if src.local or not src.isdir():
        src.fs.mv(src.path, dst.path)
        reached("move/done")
        return
    names = src.names()
    for name in sorted(names, key=lambda n: n == META):
        src.child(name).copy_to(dst.child(name))
        reached("move/copied-meta" if name == META else "move/copied-file")
    src.child(META).remove()
    reached("move/source-meta-removed")
    src.remove()
    reached("move/done")


def remove_checkpoint(loc: Location) -> None:
    """Deletes a checkpoint, never leaving a half-deleted one that looks complete under its name.

    A local directory is first renamed (``<path>.varuna-trash``, atomic); elsewhere ``meta.pt`` goes first.
    """
    if loc.local:
        if loc.isdir():
            trash = loc.with_suffix(TRASH_SUFFIX)
            trash.remove()
            loc.fs.mv(loc.path, trash.path)
            loc = trash
    elif META in loc.names():
        loc.child(META).remove()
        reached("remove/meta-removed")
    loc.remove()


def remove_quietly(loc: Location) -> None:
    """:func:`remove_checkpoint`, with a failure logged instead of raised."""
    try:
        remove_checkpoint(loc)
    except OSError as err:
        log.warning(f"Could not remove checkpoint {loc}: {err}")


def publish(tmp: Location, target: Location, meta: bytes, record: bytes | None = None) -> None:
    """Completes a written checkpoint and puts it in place of ``target`` (rank 0 only).

    ``record.pt``, ``README.txt`` and then ``meta.pt`` go into ``tmp`` (complete from then on); the checkpoint at
    ``target``, if any, moves to ``<target>.varuna-old``; ``tmp`` moves to ``target``; the old one is deleted.
    ``record`` is kept apart from ``meta`` so that the writer never unpickles Lightning's state (whose classes may
    live in the user's script, and whose tensors may be on a GPU).
    """
    global _publications
    _publications += 1
    _counts.clear()
    if record is not None:
        tmp.child(RECORD_FILE).write_bytes(record)
        reached("publish/record-written")
    tmp.child(README).write_bytes(README_TEXT.encode())
    tmp.child(META).write_bytes(meta)
    reached("publish/meta-written")
    _put_in_place(tmp, target)


def _put_in_place(tmp: Location, target: Location) -> None:
    """The moves of :func:`publish`, for a complete ``tmp``."""
    old = target.with_suffix(OLD_SUFFIX)
    remove_checkpoint(old)
    if target.exists():
        if is_complete(target):
            move(target, old)
            reached("publish/target-moved-aside")
        else:  # what an earlier, interrupted deletion left
            remove_checkpoint(target)
    move(tmp, target)
    reached("publish/tmp-moved-in")
    remove_checkpoint(old)
    reached("publish/done")


def recover(target: Location) -> Location | None:
    """Finishes or undoes an interrupted publication of ``target``, and clears its leftovers (rank 0).

    The newest complete copy (:func:`newest_copy`) ends up at ``target``; the other names are cleared, so the
    next write starts from a clean ``<target>.varuna-tmp``. Returns the copy that was moved into place, if any.
    """
    newest = newest_copy(target)
    tmp, old = target.with_suffix(TMP_SUFFIX), target.with_suffix(OLD_SUFFIX)
    moved = None
    if newest is not None and newest != target:
        log.warning(f"{target}: a replacement was interrupted; putting its newest complete copy, {newest}, in place.")
        if newest == tmp:
            _put_in_place(tmp, target)
        else:
            remove_checkpoint(target)
            move(old, target)
        moved = newest
    remove_checkpoint(tmp)
    remove_checkpoint(old)
    target.with_suffix(TRASH_SUFFIX).remove()
    return moved

