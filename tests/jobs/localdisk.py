"""``localdisk://``: an fsspec filesystem backed by the local disk, registered on import.

In a module of its own (not the job script) so that the asynchronous checkpoint writer's processes can import
it. ``LOCALDISK_PUBLISH_GATE`` (a folder, in the environment, which the writer processes inherit) holds
back the publication of the first checkpoint written in the job: once its ``meta.pt`` is written, before
the directory is moved into place (publication's fault hook at ``publish/meta-written``), the writer puts
``reached`` into the folder and waits until the job puts ``released`` there (at most ``GATE_TIMEOUT``
seconds, then it leaves ``timed-out`` there and publishes, so that a broken test fails instead of hanging). Later
checkpoints are published at once.
"""

import os
import time
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem

from lightning_varuna.checkpoint import publish


class LocalDisk(LocalFileSystem):
    """The local disk behind ``localdisk://`` URLs."""

    protocol = ("localdisk",)

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        return super()._strip_protocol(path[len("localdisk://"):] if path.startswith("localdisk://") else path)

    def unstrip_protocol(self, name: str) -> str:
        return f"localdisk://{self._strip_protocol(name)}"



GATE_TIMEOUT = 120.0
"""Seconds a writer waits at the gate before it publishes anyway (the test then fails, it does not hang)."""


def hold_first_publication(gate: Path) -> None:
    """Signals ``gate/reached`` and waits for ``gate/released``, unless that is already there."""
    released = gate / "released"
    if released.exists():
        return
    (gate / "reached").touch()
    if not wait_for(released):
        (gate / "timed-out").touch()  # the job never released it (it waited for this write): the test fails


def wait_for(path: Path, timeout: float = GATE_TIMEOUT) -> bool:
    """Polls for ``path`` for at most ``timeout`` seconds; returns whether it appeared."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _at_publication_point(point: str) -> None:
    gate = os.environ.get("LOCALDISK_PUBLISH_GATE")
    if gate and point == "publish/meta-written":
        hold_first_publication(Path(gate))


fsspec.register_implementation("localdisk", LocalDisk, clobber=True)
publish.fault_hook = _at_publication_point
