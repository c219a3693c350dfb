"""Checks shared by every test module."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """A test that leaves the default process group initialized breaks later tests in the same worker."""
    was_initialized = dist.is_available() and dist.is_initialized()
    yield
    if not was_initialized and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left the default process group initialized; destroy it in the test")
