"""How a rank of a checkpoint job ended on an expected ``CheckpointError``.

Every rank of a job finds a bad checkpoint (or a refused save) itself and raises; but once one rank has raised,
its report reaches the others' watchdogs, which end a rank still busy finding it, quoting that error (exit code
1), and the launcher may then stop the rank that raised before it recorded its error. Which rank ends which way
depends on timing, so a job whose scenario ends that way runs it last, and a test accepts any of these endings
from each rank, as long as it names the error.
"""

from __future__ import annotations

import json
import re
from pathlib import Path


def own_errors(out: Path, name: str, world: int) -> dict[int, dict]:
    """The results of the ranks that raised (and recorded) their own error in scenario ``name``."""
    results = {}
    for rank in range(world):
        try:
            results[rank] = json.loads((out / f"{name}.rank{rank}.json").read_text())
        except (OSError, ValueError):  # none, or cut short by the launcher stopping the process
            pass
    return results


def ended_on(out: Path, name: str, world: int, output: str, message: str) -> list[str]:
    """Why each rank of scenario ``name`` did not end on ``message`` (empty: every rank did).

    A rank ends on it if it recorded a ``CheckpointError`` containing ``message``, if another rank's watchdog
    quoted it raising one (in the job's ``output``), or if its own watchdog ended it quoting another rank's.
    """
    own = own_errors(out, name, world)
    problems = []
    for rank in range(world):
        if rank in own:
            if message not in (own[rank].get("error") or ""):
                problems.append(f"rank {rank} raised {own[rank].get('error')!r}")
            continue
        error = rf"failed: [\w.]*CheckpointError: [^\n]*{re.escape(message)}"
        raised = rf"lightning_varuna: rank {rank} {error}"
        ended = rf"\[rank {rank}\] lightning_varuna: rank \d+ {error}"
        if re.search(raised, output) is None and re.search(ended, output) is None:
            problems.append(f"rank {rank} neither raised nor was ended quoting {message!r}")
    return problems
