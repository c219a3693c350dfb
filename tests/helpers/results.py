"""The results a job in ``tests/jobs`` writes: one JSON file per rank, ``OUT/NAME.rankR.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def rank_result(out: Path, name: str, rank: int = 0) -> Any:
    """What rank ``rank`` of run ``name`` wrote in ``out``."""
    return json.loads((out / f"{name}.rank{rank}.json").read_text())


def rank_results(out: Path, name: str, world: int) -> list[Any]:
    """Every rank's result of run ``name``, which ran ``world`` processes, in rank order (a missing rank fails)."""
    return [rank_result(out, name, rank) for rank in range(world)]
