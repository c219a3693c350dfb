"""How the ranks of a checkpoint job ended on an expected ``CheckpointError``.

Every rank finds a bad checkpoint (or a refused save) by agreement with the others and raises the same error
itself; one rank's report of it ends no other rank (they all raise it), so each rank records its own error and
the job goes on with its next scenario.
"""

from __future__ import annotations

import json
from pathlib import Path


def own_errors(out: Path, name: str, world: int) -> dict[int, dict]:
    """The results of the ranks that recorded scenario ``name`` (each with the error it raised, if any)."""
    results = {}
    for rank in range(world):
        try:
            results[rank] = json.loads((out / f"{name}.rank{rank}.json").read_text())
        except (OSError, ValueError):  # none: the rank did not get there
            pass
    return results


def not_raised(out: Path, name: str, world: int, message: str) -> list[str]:
    """Why each rank of scenario ``name`` did not raise (and record) a ``CheckpointError`` with ``message``.

    Empty: every rank did.
    """
    own = own_errors(out, name, world)
    problems = []
    for rank in range(world):
        if rank not in own:
            problems.append(f"rank {rank} recorded nothing")
        elif message not in (own[rank].get("error") or ""):
            problems.append(f"rank {rank} raised {own[rank].get('error')!r}")
    return problems
