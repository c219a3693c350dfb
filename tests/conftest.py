"""Fixtures shared by every test module."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from helpers.on_demand import skip_unless_wanted


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules that run multi-process jobs first, each module's tests kept together: with ``-n``, the short
    in-process tests then fill the workers' last minutes instead of one long job running alone at the end.
    The tests marked ``full`` are skipped unless asked for (``tests/helpers/on_demand.py``)."""
    skip_unless_wanted(items, config)
    with_jobs = {item.module for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.module not in with_jobs)


@pytest.fixture(autouse=True)
def _process_group_destroyed_after_each_test():
    """An in-process fit leaves the strategy's process group (as DDP's does); later tests in the worker make theirs."""
    was_initialized = dist.is_available() and dist.is_initialized()
    yield
    if not was_initialized and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
