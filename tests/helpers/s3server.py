"""An S3-compatible object store for tests: moto's server on loopback, reached through s3fs.

On an object store a "rename" copies every object and deletes the source, one request at a time: what the
publication of a checkpoint must survive being interrupted in. Needs the test extras ``moto[server]`` and
``s3fs``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator

import pytest

BUCKET = "checkpoints"
CLIENT_LIMITS = {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 2}}
"""botocore's limits for the tests' requests: a server that stops answering fails a request within about two
minutes instead of botocore's retries stretching it (each test's own timeout bounds it anyway)."""


@contextlib.contextmanager
def s3_server(timeout: float = 60.0) -> Iterator[dict[str, str]]:
    """Starts the server with one bucket; yields the environment that points s3fs at it (set here too).

    The server is a process of its own (``python -m moto.server``): in this process its request threads would
    compete for the GIL with the client's. Skips the test where ``moto[server]`` or ``s3fs`` is not installed;
    raises if the server does not answer within ``timeout`` seconds.
    """
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    import fsspec
    import s3fs

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "FSSPEC_S3_ENDPOINT_URL": url,  # read by fsspec when a process imports it
           "FSSPEC_S3_CONFIG_KWARGS": json.dumps(CLIENT_LIMITS)}
    saved = {key: os.environ.get(key) for key in env}
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.build_opener(urllib.request.ProxyHandler({})).open(f"{url}/moto-api/", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto's server did not start (exit code {server.poll()})") from None
                time.sleep(0.2)
        os.environ.update(env)
        fsspec.config.conf["s3"] = {"endpoint_url": url, "config_kwargs": CLIENT_LIMITS}  # imported already
        s3fs.S3FileSystem.clear_instance_cache()
        fsspec.filesystem("s3").mkdir(BUCKET)
        yield env
    finally:
        fsspec.config.conf.pop("s3", None)
        s3fs.S3FileSystem.clear_instance_cache()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.kill()
        server.wait()


def fresh_prefix() -> str:
    """An unused ``s3://`` folder in the bucket."""
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
