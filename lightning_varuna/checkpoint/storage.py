"""Where checkpoints live: local paths and fsspec URLs, and the files a checkpoint directory holds.

A :class:`Location` is a local path (DCP's ``FileSystemWriter``) or an fsspec URL (DCP's fsspec writer, e.g.
``s3://...``, ``file://...``). A checkpoint directory holds DCP's shards and index (``.metadata``), then
``record.pt`` (the parameter record) and, last, ``meta.pt`` (Lightning's state): a directory without ``meta.pt``
is never loaded. How a written directory replaces an older one is :mod:`~lightning_varuna.checkpoint.publish`'s.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

# private: torch 2.13/2.14 keep DCP's fsspec reader and writer in this module only (see docs/architecture.md)
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from lightning_varuna.files.atomic_write import PART_SUFFIX, write_atomic

__all__ = [
    "INDEX", "META", "PART_SUFFIX", "README", "README_TEXT", "RECORD_FILE", "Location", "is_complete", "read_meta",
    "single_process_quiet", "to_bytes", "written_at",
]

META = "meta.pt"
"""Lightning's state without weights and optimizer states, written by rank 0 once every shard is in."""
RECORD_FILE = "record.pt"
"""The parameter record (``checkpoint.RECORD``), written just before ``meta.pt``; merged into it on reading."""
INDEX = ".metadata"
"""DCP's index of the shards."""
README = "README.txt"
"""What a checkpoint directory is and how to use it, for whoever finds it (Lightning's loader reads single files)."""
README_TEXT = """\
This directory is one checkpoint written by lightning-varuna's VarunaStrategy: the weights and optimizer states,
sharded in the format of torch.distributed.checkpoint, and Lightning's own state (meta.pt).

- Resume training, under any number of stages and replicas:
      Trainer(strategy=VarunaStrategy(...)).fit(model, ckpt_path="<this directory>")
- The trained module (LightningModule.load_from_checkpoint reads single files and fails here with
  IsADirectoryError):
      lightning_varuna.load_from_checkpoint(MyModule, "<this directory>")
- A plain single-file Lightning checkpoint:
      python -m lightning_varuna.trainer.convert to-plain <this directory> model.ckpt
"""
_PROTOCOL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:")  # two characters at least: "C:" is a drive


@dataclass(frozen=True)
class Location:
    """A file or directory on a local disk or behind an fsspec URL.

    Attributes:
        fs: The filesystem.
        path: The path as ``fs`` names it (no protocol).
        text: The path as given (a URL keeps its protocol), for DCP's fsspec reader and writer.
        url: Whether it was given as a URL: DCP then goes through fsspec.
    """

    fs: AbstractFileSystem
    path: str
    text: str
    url: bool

    @classmethod
    def of(cls, path: str | os.PathLike[str] | Location) -> Location:
        """The location of ``path``: a local path, or any URL fsspec understands (``"memory://x"``)."""
        if isinstance(path, Location):
            return path
        text = os.fspath(path)
        # any "protocol:" prefix, as fsspec reads it ("file:/x" included)
        if "::" in text or _PROTOCOL.match(text):
            fs, inner = url_to_fs(text)
            return cls(fs, inner, text, True)
        absolute = os.path.abspath(text)
        return cls(LocalFileSystem(), absolute, absolute, False)

    def __str__(self) -> str:
        return self.text

    @property
    def name(self) -> str:
        """The last component of the path."""
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    @property
    def local(self) -> bool:
        """Whether this is the local disk (renames are atomic there; on object stores a rename is a copy)."""
        return isinstance(self.fs, LocalFileSystem)

    @property
    def parent(self) -> Location:
        """The directory holding this entry."""
        path, text = self.path.rstrip("/"), self.text.rstrip("/")
        return replace(self, path=path.rsplit("/", 1)[0] or "/", text=text[: len(text) - len(self.name) - 1] or "/")

    def child(self, name: str) -> Location:
        """An entry of this directory."""
        return replace(self, path=f"{self.path.rstrip('/')}/{name}", text=f"{self.text.rstrip('/')}/{name}")

    def with_suffix(self, suffix: str) -> Location:
        """A sibling named with ``suffix`` appended."""
        return replace(self, path=self.path.rstrip("/") + suffix, text=self.text.rstrip("/") + suffix)

    def refresh(self) -> None:
        """Forgets what the filesystem cached about this entry (object stores cache listings per process)."""
        self.fs.invalidate_cache(self.path)
        self.fs.invalidate_cache(self.parent.path)

    def exists(self) -> bool:
        """Whether anything is at this location."""
        return bool(self.fs.exists(self.path))

    def isdir(self) -> bool:
        """Whether it is a directory."""
        return bool(self.fs.isdir(self.path))

    def names(self) -> list[str]:
        """The names of this directory's entries (none if it is missing), listed afresh (not from a cache)."""
        try:
            listing = self.fs.ls(self.path, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in listing)

    def read_bytes(self) -> bytes:
        """The whole file."""
        return cast(bytes, self.fs.cat_file(self.path))  # fsspec's cat_file of one path returns its bytes

    def write_bytes(self, data: bytes) -> None:
        """Writes a file atomically: locally under another name first, synced, then renamed; elsewhere one upload."""
        if not self.local:
            self.fs.pipe_file(self.path, data)
            return
        write_atomic(self.path, data)

    def copy_to(self, dst: Location) -> None:
        """Copies this file to ``dst`` (on the same filesystem; an object store copies on the server)."""
        self.fs.copy(self.path, dst.path)

    def remove(self) -> None:
        """Deletes the file or directory, if any (a link, not what it points to)."""
        if self.local and os.path.islink(self.path):
            os.unlink(self.path)
            return
        try:
            self.fs.rm(self.path, recursive=True)
        except FileNotFoundError:
            pass

    def writer(self) -> StorageWriter:
        """DCP's writer for this directory (files synced to disk where the filesystem has a disk)."""
        if not self.url:
            return FileSystemWriter(self.path)
        return FsspecWriter(self.text, sync_files=self.local)

    def reader(self) -> StorageReader:
        """DCP's reader for this directory."""
        return FsspecReader(self.text) if self.url else FileSystemReader(self.path)

    def modified(self) -> float:
        """Modification time in seconds (0 where the filesystem does not tell)."""
        try:
            return float(self.fs.modified(self.path).timestamp())
        except (NotImplementedError, OSError, KeyError, AttributeError, ValueError):
            return 0.0


def is_complete(path: str | os.PathLike[str] | Location) -> bool:
    """Whether ``path`` is a finished sharded checkpoint (or a plain checkpoint file)."""
    loc = Location.of(path)
    names = loc.names()  # one listing (a file lists as itself)
    if META in names and INDEX in names:
        return True
    return bool(names) and loc.fs.isfile(loc.path)


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """Silences DCP's warning that it runs without a process group (meant here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        yield



def written_at(loc: Location) -> float:
    """When a complete checkpoint was written.

    The time its record holds: a move on an object store is a copy, which changes the files' times. Else (an
    earlier version's checkpoint) its ``meta.pt``'s time, or a plain file's own.
    """
    if not loc.isdir():
        return loc.modified()
    try:
        record = torch.load(io.BytesIO(loc.child(RECORD_FILE).read_bytes()), map_location="cpu", weights_only=True)
        return float(record["written"])
    except Exception:  # noqa: BLE001 - written by an earlier version, or unreadable: the file's time
        return loc.child(META).modified()


def to_bytes(obj: Any) -> bytes:
    """``torch.save`` into memory."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def read_meta(
    path: str | os.PathLike[str] | Location, weights_only: bool | None = None, raw: dict[str, bytes] | None = None
) -> dict[str, Any]:
    """A sharded checkpoint's ``meta.pt`` (Lightning's state without weights and optimizer states).

    The parameter record of ``record.pt``, where there is one, is put under its key.

    Args:
        path: The checkpoint directory.
        weights_only: Passed to ``torch.load``.
        raw: If given, receives the bytes read, by file name (for checksums).
    """
    loc = Location.of(path)
    loc.refresh()  # another process (a writer) may have published it since this one listed it
    data = loc.child(META).read_bytes()
    if raw is not None:
        raw[META] = data
    meta: dict[str, Any] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)
    record = loc.child(RECORD_FILE)
    if record.exists():
        from lightning_varuna.checkpoint.state import RECORD

        meta[RECORD] = torch.load(io.BytesIO(record.read_bytes()), map_location="cpu", weights_only=weights_only)
    return meta
