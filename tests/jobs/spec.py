"""Job configurations on the command line: ``name:key=value,key=value`` with typed values."""

from __future__ import annotations

from typing import Any


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """Splits ``name:key=value,...`` into the name and options (ints, floats, booleans, none, strings)."""
    name, _, rest = spec.partition(":")
    options = {}
    for item in filter(None, rest.split(",")):
        key, _, text = item.partition("=")
        options[key] = _typed(text)
    return name, options


def _typed(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)
