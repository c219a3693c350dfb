"""Job configurations on the command line (``OUT SPEC [SPEC ...]``, each spec ``name:key=value,key=value`` with typed
values), and their trainers."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def job_command_line(doc: str | None, argv: Sequence[str] | None = None) -> tuple[Path, list[str]]:
    """``OUT SPEC [SPEC ...]``, parsed with argparse: the results folder (made if missing) and the specs in order.

    ``doc`` (the job's docstring, its usage) is the help's description.
    """
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, metavar="OUT", help="the folder every rank writes its results to")
    parser.add_argument("specs", nargs="*", metavar="SPEC",
                        help="name:key=value,... (values: ints, floats, true, false, none, or strings), run in order")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    return args.out, args.specs


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


def trainer_for(reference: bool, options: dict, **kwargs: Any) -> Any:
    """The plain one-process Trainer (``reference``) or one of ``VarunaStrategy(**options)`` on every rank.

    No logger, no model summary unless asked for; the reference reads its data in the order it is given.
    """
    import lightning.pytorch as pl

    import lightning_varuna

    kwargs.setdefault("enable_model_summary", False)
    return pl.Trainer(
        accelerator="cpu",
        devices=1 if reference else int(os.environ["WORLD_SIZE"]),
        strategy="auto" if reference else lightning_varuna.VarunaStrategy(**options),
        logger=False,
        use_distributed_sampler=not reference,
        **kwargs,
    )
