"""An interrupted publication never loses the newest complete checkpoint, on a local disk and on an object store.

Every point of the publication sequence is tried in one process: a checkpoint of step 1 is in place, the
publication of step 2 over it stops at the k-th point (``publish.fault_hook`` raises there, as a crash would
leave it), and then: the newest complete copy is step 2 once step 2 was complete (its ``meta.pt`` written), step 1
before; ``recover`` (what rank 0 runs before the next save) puts exactly that one in place without deleting it,
even when recovery itself stops at any of its points; and the next publication succeeds. On S3 (moto's server,
through s3fs) every copy and delete of a move is a point of its own. The real jobs that die inside a publication
and resume with ``ckpt_path="last"`` are in ``test_checkpoint_faults.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from helpers.s3server import fresh_prefix, s3_server
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_varuna.checkpoint import publish
from lightning_varuna.checkpoint.job import write_single
from lightning_varuna.checkpoint.load import resolve
from lightning_varuna.checkpoint.storage import Location, read_meta
from lightning_varuna.files.atomic_write import write_atomic
from lightning_varuna.trainer.recovery.resume import choose_last, last_fallbacks


class Stop(Exception):
    """Where the injected crash stops the publication."""


# under pytest-xdist one worker runs all of this module's tests, so its module-scoped jobs run once
pytestmark = pytest.mark.xdist_group("checkpoint_publish")


@pytest.fixture(scope="module")
def s3() -> Iterator[None]:
    with s3_server():
        yield


@pytest.fixture(params=["local", "s3"])
def folder(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path)
    request.getfixturevalue("s3")
    return fresh_prefix()


def _write(target: Location, step: int) -> None:
    write_single(target, {"state_dict": {"w": torch.full((3,), float(step))}}, {"global_step": step}, [], ["w"])


def _step(loc: Location) -> int:
    return read_meta(loc, weights_only=False)["global_step"]


def _names(target: Location) -> list[str]:
    target.parent.refresh()
    return [name for name in target.parent.names() if name.startswith(target.name)]


def _stop_at(k: int | None, seen: list[str]):
    def hook(point: str) -> None:
        seen.append(point)
        if len(seen) - 1 == k:
            raise Stop(point)

    return hook


def _interrupted(target: Location, k: int) -> list[str]:
    """Step 1 in place, then step 2's publication stopped at its k-th point; returns the points reached."""
    publish.remove_checkpoint(target)
    _write(target, 1)
    seen: list[str] = []
    publish.fault_hook = _stop_at(k, seen)
    try:
        with pytest.raises(Stop):
            _write(target, 2)
    finally:
        publish.fault_hook = None
    return seen


def _points(target: Location) -> list[str]:
    publish.remove_checkpoint(target)
    _write(target, 1)
    seen: list[str] = []
    publish.fault_hook = _stop_at(None, seen)
    try:
        _write(target, 2)
    finally:
        publish.fault_hook = None
    return seen


def test_every_point_of_a_publication_leaves_the_newest_complete_checkpoint(folder: str) -> None:
    target = Location.of(f"{folder}/last.ckpt")
    points = _points(target)
    assert points[:2] == ["publish/record-written", "publish/meta-written"] and points[-1] == "publish/done"
    if target.local:
        assert points.count("move/done") == 2 and "move/copied-file" not in points  # two renames
    else:  # each file copied, then the source's meta.pt deleted first, twice
        assert points.count("move/copied-meta") == 2 and points.count("move/source-meta-removed") == 2
        assert points.count("move/copied-file") >= 6
    for k, point in enumerate(points[:-1]):
        if 0 < k < len(points) - 2 and points[k - 1] == point == points[k + 1]:
            continue  # the middle files of a move's run of copies: its first and last are tried
        reached = _interrupted(target, k)
        assert reached[-1] == point
        expected = 2 if "publish/meta-written" in reached else 1
        newest = publish.newest_copy(target)
        assert newest is not None and _step(newest) == expected, (point, k, _names(target))
        loaded, _ = resolve(target)  # what an explicit path loads: a copy only when the target is not complete
        assert _step(loaded) in (1, 2), (point, k)
        # recovery puts that one in place, even when recovery itself stops (at its k-th point: over all k, at
        # each of them) and is run again
        seen: list[str] = []
        publish.fault_hook = _stop_at(k, seen)
        try:
            publish.recover(target)
        except Stop:
            newest = publish.newest_copy(target)
            assert newest is not None and _step(newest) == expected, (point, k, seen, _names(target))
        finally:
            publish.fault_hook = None
        publish.recover(target)
        assert _names(target) == ["last.ckpt"] and _step(target) == expected, (point, k, _names(target))
        _write(target, 3)
        assert _names(target) == ["last.ckpt"] and _step(target) == 3


def test_a_partial_copy_on_an_object_store_is_never_taken_for_a_checkpoint(s3) -> None:
    """Half of an interrupted object-store move has no meta.pt; a removal deletes meta.pt first."""
    target = Location.of(f"{fresh_prefix()}/last.ckpt")
    _write(target, 1)
    tmp = target.with_suffix(publish.TMP_SUFFIX)
    for name in target.names():
        if name != "meta.pt":
            target.child(name).copy_to(tmp.child(name))
    assert publish.newest_copy(target) == target
    seen: list[str] = []
    publish.fault_hook = _stop_at(0, seen)
    try:
        with pytest.raises(Stop):
            publish.remove_checkpoint(target)
    finally:
        publish.fault_hook = None
    assert seen == ["remove/meta-removed"] and publish.newest_copy(target) is None


def _trainer(*callbacks) -> SimpleNamespace:
    """What the choice of "last" reads of a trainer: its callbacks, and the ckpt_path asked for ("last")."""
    checkpoints = [cb for cb in callbacks if isinstance(cb, ModelCheckpoint)]
    connector = SimpleNamespace(_varuna_requested_ckpt_path="last")
    return SimpleNamespace(callbacks=list(callbacks), checkpoint_callbacks=checkpoints, _checkpoint_connector=connector)


def test_last_is_the_newest_complete_copy_of_the_newest_last_checkpoint(folder: str) -> None:
    trainer = _trainer(ModelCheckpoint(dirpath=folder))
    assert choose_last(trainer, None) is None
    last = Location.of(f"{folder}/last.ckpt")
    _write(last, 1)
    time.sleep(1.1)  # object stores keep modification times to the second
    _write(Location.of(f"{folder}/last-v1.ckpt"), 2)
    assert choose_last(trainer, None) == f"{folder}/last-v1.ckpt"
    time.sleep(1.1)
    # a publication of last.ckpt (step 3) interrupted after its temporary copy was complete
    tmp = last.with_suffix(publish.TMP_SUFFIX)
    _write(tmp, 3)
    assert choose_last(trainer, None) == tmp.text
    publish.move(last, last.with_suffix(publish.OLD_SUFFIX))  # and after the one it replaces was moved aside
    assert choose_last(trainer, f"{folder}/last-v1.ckpt") == tmp.text
    # every complete copy is a fallback, newest first; the one being loaded is not
    _write(Location.of(f"{folder}/epoch=0-step=1.ckpt"), 1)
    assert last_fallbacks(trainer, tmp.text) == [f"{folder}/epoch=0-step=1.ckpt", f"{folder}/last-v1.ckpt",
                                                 f"{folder}/last.ckpt.varuna-old"]


def test_writers_of_the_same_file_at_once_each_replace_it_whole(tmp_path) -> None:
    # a lease is renewed by one thread while another job (or a test) takes it over: both write the same file
    target = Location.of(str(tmp_path / "lease.json"))
    errors: list[BaseException] = []

    def write(mark: bytes) -> None:
        try:
            for _ in range(200):
                target.write_bytes(mark * 64)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    writers = [threading.Thread(target=write, args=(mark,)) for mark in (b"a", b"b")]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    assert not errors, errors
    assert target.read_bytes() in (b"a" * 64, b"b" * 64)
    assert [p.name for p in tmp_path.iterdir()] == ["lease.json"], "no part file is left"


def test_an_exclusive_write_creates_the_file_once_and_a_failed_write_leaves_no_part_file(tmp_path) -> None:
    target = tmp_path / "sub" / "lease.json"
    assert write_atomic(target, b"first", exclusive=True)
    assert not write_atomic(target, b"second", exclusive=True) and target.read_bytes() == b"first"
    assert write_atomic(target, b"third") and target.read_bytes() == b"third"
    with pytest.raises(TypeError):
        write_atomic(target, "not bytes")
    assert target.read_bytes() == b"third" and [p.name for p in target.parent.iterdir()] == ["lease.json"]
