"""A local file that a crash never leaves half-written: the package's one atomic write.

The bytes go to a part file of the writer's own (named by process and thread, so that two writers of one file
never rename each other's part away), are synced to disk, and then take the final name in one step: a rename
(``os.replace``, the new file replaces any old one) or, with ``exclusive``, a hard link (``os.link``, which fails
if the name exists: of two writers that create one name, exactly one succeeds, on a local disk and on NFS alike).
A reader sees the old file or the new one, never a part of either.
"""

from __future__ import annotations

import os
import threading

__all__ = ["PART_SUFFIX", "write_atomic"]

PART_SUFFIX = ".part"
"""Ends the name of a file being written (``<name>-<pid>-<thread><PART_SUFFIX>``); never read as a result."""


def write_atomic(path: str | os.PathLike[str], data: bytes, exclusive: bool = False) -> bool:
    """Writes ``data`` to ``path`` whole or not at all; creates the parent directories.

    Args:
        path: The local file.
        data: Its new content.
        exclusive: Create the file only if ``path`` does not exist yet (its old content is then kept).

    Returns:
        Whether the file was written (always, unless ``exclusive`` and the file existed).
    """
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    part = f"{path}-{os.getpid()}-{threading.get_ident()}{PART_SUFFIX}"
    try:
        with open(part, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        if not exclusive:
            os.replace(part, path)
            return True
        try:
            os.link(part, path)
        except FileExistsError:
            return False
        return True
    finally:
        if os.path.lexists(part):
            os.unlink(part)
