"""mypy, strict, on the modules ``[tool.mypy]`` in pyproject.toml lists; run by the suite so that ``.ci/run`` stays the
README's test command. Skipped with the reason when mypy is not installed (``pip install -e .[dev]`` installs it)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]


def _checked_files() -> list[Path]:
    paths = [ROOT / entry for entry in CONFIG["files"]]
    return sorted({f for p in paths for f in ([p] if p.is_file() else p.rglob("*.py"))})


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed (pip install mypy)")
def test_mypy_strict_passes_on_the_checked_modules() -> None:
    assert CONFIG["strict"] is True
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_checked_modules_exist_and_include_the_engine() -> None:
    files = _checked_files()
    assert files and all(f.exists() for f in files)
    assert ROOT / "lightning_varuna" / "pipeline" / "engine.py" in files


def test_a_type_ignore_in_a_checked_module_names_its_error_code_and_its_reason() -> None:
    # `# type: ignore[code]  # why` on one line; a bare ignore would hide any error of the line
    bad = []
    for path in _checked_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "type: ignore" in line and not re.search(r"# type: ignore\[[\w-]+(, [\w-]+)*\]\s+# \S", line):
                bad.append(f"{path.relative_to(ROOT)}:{number}")
    assert bad == []


def _type_ignores(root: Path) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{number}" for path in sorted(root.rglob("*.py"))
            for number, line in enumerate(path.read_text().splitlines(), 1) if "# type: ignore" in line]


def test_type_ignores_in_pipeline_are_at_most_five() -> None:
    ignores = _type_ignores(ROOT / "lightning_varuna" / "pipeline")
    assert len(ignores) <= 5, ignores


def test_type_ignores_in_the_package_are_at_most_ten() -> None:
    ignores = _type_ignores(ROOT / "lightning_varuna")
    assert len(ignores) <= 10, ignores
