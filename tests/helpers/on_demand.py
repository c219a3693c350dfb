"""The wide test matrices: CI runs one configuration per case, the rest runs on demand.

A part of the suite marked ``full`` (and the zoo's and ZeRO's own markers) runs when asked for:

- ``VARUNA_TESTS=full`` runs every on-demand part;
- ``VARUNA_<PART>=full`` runs one (``VARUNA_ZOO``, ``VARUNA_ZERO``, ``VARUNA_SCHEDULES``);
- ``-m full`` (or ``-m zoo``, ``-m zero_full``) selects them by marker.
"""

from __future__ import annotations

import os
import re

import pytest

ALL = "VARUNA_TESTS"


def wanted(config: pytest.Config | None = None, part: str | None = None, marker: str = "full") -> bool:
    """Whether the on-demand ``part`` (or, without one, every ``full``-marked test) runs in this session."""
    if os.environ.get(ALL) == "full" or (part is not None and os.environ.get(f"VARUNA_{part}") == "full"):
        return True
    markexpr = (config.option.markexpr if config is not None else "") or ""
    return re.search(rf"(?<!not )\b{marker}\b", markexpr) is not None


def skip_unless_wanted(items: list[pytest.Item], config: pytest.Config) -> None:
    """Skips the ``full``-marked tests, unless asked for, with the way to run them."""
    if wanted(config):
        return
    skip = pytest.mark.skip(reason=f"on demand: {ALL}=full or -m full")
    for item in items:
        if item.get_closest_marker("full") is not None:
            item.add_marker(skip)
