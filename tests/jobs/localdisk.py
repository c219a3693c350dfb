"""``localdisk://``: an fsspec filesystem backed by the local disk, registered on import.

In a module of its own (not the job script) so that the asynchronous checkpoint writer's processes can import
it. ``LOCALDISK_PUBLISH_DELAY`` (seconds, in the environment, which the writer processes inherit) holds back
the publication of every checkpoint: once its shards are written, before ``meta.pt`` goes in and the
directory is moved into place.
"""

import os
import time

import fsspec
from fsspec.implementations.local import LocalFileSystem


class LocalDisk(LocalFileSystem):
    """The local disk behind ``localdisk://`` URLs."""

    protocol = ("localdisk",)

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        return super()._strip_protocol(path[len("localdisk://"):] if path.startswith("localdisk://") else path)

    def unstrip_protocol(self, name: str) -> str:
        return f"localdisk://{self._strip_protocol(name)}"

    def mv(self, path1, path2, *args, **kwargs):
        delay = float(os.environ.get("LOCALDISK_PUBLISH_DELAY", "0"))
        if delay and str(path2).endswith(".varuna-tmp/meta.pt"):  # the last file in: publication begins
            time.sleep(delay)
        return super().mv(path1, path2, *args, **kwargs)


fsspec.register_implementation("localdisk", LocalDisk, clobber=True)
