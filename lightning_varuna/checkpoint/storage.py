"""Where checkpoints live, and how a written one is put in place atomically.

A :class:`Location` is a local path (DCP's ``FileSystemWriter``) or an fsspec URL (``FsspecWriter``, e.g.
``s3://...``, ``file://...``). A checkpoint directory is written as ``<path>.varuna-tmp``; :func:`publish`
adds ``meta.pt`` last and moves it into place, after moving aside (``<path>.varuna-old``) the checkpoint it
replaces, which it deletes only once the new one is in place. :func:`resolve` and :func:`recover` deal with a
replacement interrupted between the two moves. A directory without ``meta.pt`` is never loaded.
:func:`remove_quietly` deletes an old one without leaving it half-deleted under its name.
"""

from __future__ import annotations

import io
import logging
import os
import re
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

__all__ = [
    "INDEX", "META", "README", "RECORD_FILE", "Location", "is_complete", "publish", "read_meta", "recover",
    "remove_quietly", "resolve", "to_bytes",
]

log = logging.getLogger(__name__)

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
      python -m lightning_varuna.convert to-plain <this directory> model.ckpt
"""
TMP_SUFFIX = ".varuna-tmp"
OLD_SUFFIX = ".varuna-old"
TRASH_SUFFIX = ".varuna-trash"
PART_SUFFIX = ".part"
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
    def of(cls, path: str | os.PathLike) -> Location:
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

    def child(self, name: str) -> Location:
        """An entry of this directory."""
        return replace(self, path=f"{self.path.rstrip('/')}/{name}", text=f"{self.text.rstrip('/')}/{name}")

    def with_suffix(self, suffix: str) -> Location:
        """A sibling named with ``suffix`` appended."""
        return replace(self, path=self.path.rstrip("/") + suffix, text=self.text.rstrip("/") + suffix)

    def exists(self) -> bool:
        """Whether anything is at this location."""
        return self.fs.exists(self.path)

    def isdir(self) -> bool:
        """Whether it is a directory."""
        return self.fs.isdir(self.path)

    def read_bytes(self) -> bytes:
        """The whole file."""
        return self.fs.cat_file(self.path)

    def write_bytes(self, data: bytes) -> None:
        """Writes a file atomically (under another name first, then moved into place)."""
        part = self.with_suffix(PART_SUFFIX)
        with self.fs.open(part.path, "wb") as f:
            f.write(data)
        self.fs.mv(part.path, self.path)

    def remove(self) -> None:
        """Deletes the file or directory, if any (a link, not what it points to)."""
        if isinstance(self.fs, LocalFileSystem) and os.path.islink(self.path):
            os.unlink(self.path)
        elif self.exists():
            self.fs.rm(self.path, recursive=True)

    def writer(self) -> dcp.StorageWriter:
        """DCP's writer for this directory."""
        return FsspecWriter(self.text) if self.url else dcp.FileSystemWriter(self.path)

    def reader(self) -> dcp.StorageReader:
        """DCP's reader for this directory."""
        return FsspecReader(self.text) if self.url else dcp.FileSystemReader(self.path)

    def modified(self) -> float:
        """Modification time in seconds (0 where the filesystem does not tell)."""
        try:
            return self.fs.modified(self.path).timestamp()
        except (NotImplementedError, OSError, KeyError, AttributeError):
            return 0.0


def is_complete(path: str | os.PathLike | Location) -> bool:
    """Whether ``path`` is a finished sharded checkpoint (or a plain checkpoint file)."""
    loc = Location.of(path)
    if not loc.exists():
        return False
    if not loc.isdir():
        return True
    return loc.child(META).exists() and loc.child(INDEX).exists()


def move(src: Location, dst: Location) -> None:
    """Moves a checkpoint; on a filesystem without directory renames, file by file with ``meta.pt`` last.

    Moving ``meta.pt`` last keeps the destination incomplete (never loaded) until it has every shard; the
    source loses its ``meta.pt`` first, so a half-moved source is incomplete too.
    """
    if isinstance(src.fs, LocalFileSystem) or not src.isdir():
        src.fs.mv(src.path, dst.path)
        return
    names = sorted(
        (entry.rstrip("/").rsplit("/", 1)[-1] for entry in src.fs.ls(src.path, detail=False)),
        key=lambda name: name == META,
    )
    dst.fs.makedirs(dst.path, exist_ok=True)
    for name in names:
        src.fs.mv(src.child(name).path, dst.child(name).path)
    src.remove()


def resolve(loc: Location) -> tuple[Location, str | None]:
    """``loc``, or what an interrupted replacement left in its place (and a note saying so)."""
    if loc.exists():
        return loc, None
    for suffix in (TMP_SUFFIX, OLD_SUFFIX):
        other = loc.with_suffix(suffix)
        if is_complete(other):
            return other, f"{loc} is missing but {other} is complete (a replacement was interrupted); using it"
    return loc, None


def publish(tmp: Location, target: Location, meta: bytes, record: bytes | None = None) -> None:
    """Completes a written checkpoint: ``record.pt`` and ``meta.pt`` in, then in place of ``target`` (rank 0 only).

    ``record`` is kept apart from ``meta`` so that the writer never unpickles Lightning's state (whose classes
    may live in the user's script, and whose tensors may be on a GPU).
    """
    if record is not None:
        tmp.child(RECORD_FILE).write_bytes(record)
    tmp.child(README).write_bytes(README_TEXT.encode())
    tmp.child(META).write_bytes(meta)
    old = target.with_suffix(OLD_SUFFIX)
    old.remove()
    if target.exists():
        move(target, old)
    move(tmp, target)
    old.remove()


def recover(target: Location) -> None:
    """Puts back a checkpoint that an interrupted replacement left under another name (rank 0)."""
    found, note = resolve(target)
    if note is not None:
        log.warning(note)
        move(found, target)
    target.with_suffix(OLD_SUFFIX).remove()


def remove_quietly(loc: Location) -> None:
    """Deletes a checkpoint, never leaving it half-deleted under its name; a failure is logged, not raised.

    A local directory is first renamed (``<path>.varuna-trash``, atomic); elsewhere ``meta.pt`` goes first, so
    that what is left while the rest is deleted is an incomplete checkpoint, never loaded.
    """
    try:
        if loc.isdir():
            if isinstance(loc.fs, LocalFileSystem):
                trash = loc.with_suffix(TRASH_SUFFIX)
                trash.remove()
                loc.fs.mv(loc.path, trash.path)
                loc = trash
            else:
                loc.child(META).remove()
        loc.remove()
    except OSError as err:
        log.warning(f"Could not remove checkpoint {loc}: {err}")


def to_bytes(obj: Any) -> bytes:
    """``torch.save`` into memory."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def read_meta(path: str | os.PathLike | Location, weights_only: bool | None = None) -> dict[str, Any]:
    """A sharded checkpoint's ``meta.pt`` (Lightning's state without weights and optimizer states).

    The parameter record of ``record.pt``, where there is one, is put under its key.
    """
    loc = Location.of(path)
    meta = torch.load(io.BytesIO(loc.child(META).read_bytes()), map_location="cpu", weights_only=weights_only)
    record = loc.child(RECORD_FILE)
    if record.exists():
        from lightning_varuna.checkpoint.state import RECORD

        meta[RECORD] = torch.load(io.BytesIO(record.read_bytes()), map_location="cpu", weights_only=weights_only)
    return meta
