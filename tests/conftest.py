"""Fixtures shared by every test module."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _process_group_destroyed_after_each_test():
    """An in-process fit leaves the strategy's process group (as DDP's does); later tests in the worker make theirs."""
    was_initialized = dist.is_available() and dist.is_initialized()
    yield
    if not was_initialized and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
