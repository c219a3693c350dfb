"""Timelines as a picture: stages as rows, several timelines one above the other on one time scale.

Drawn with matplotlib, an optional dependency (``pip install lightning-varuna[viz]``); without it
:func:`render_png` raises ``ImportError`` saying so, and the Chrome trace (no dependency) is the timeline's record.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from lightning_varuna.pipeline.timelines.timeline import COLORS, KINDS, TASKS, TimelineEvent

__all__ = ["has_matplotlib", "render_png"]

_LANE_INCHES, _PANEL_INCHES, _DPI = 0.28, 0.7, 100


def has_matplotlib() -> bool:
    """Whether :func:`render_png` can draw (matplotlib is installed)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def render_png(path: str | os.PathLike[str], panels: Sequence[tuple[str, Sequence[TimelineEvent]]],
               width: int = 1200) -> None:
    """Draws timelines one above the other, each stage a row, on one time scale; writes a PNG.

    Args:
        path: The PNG file to write.
        panels: ``(title, events)`` per timeline, e.g. ``[("predicted", ...), ("executed", ...)]``; each panel's
            time starts at its earliest event.
        width: Pixels across.

    Raises:
        ImportError: Without matplotlib (the ``viz`` extra).
    """
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as err:
        raise ImportError("Timeline pictures need matplotlib: pip install 'lightning-varuna[viz]'.") from err
    lanes = [sorted({(e.replica, e.stage) for e in events}) or [(0, 0)] for _, events in panels]
    height = sum(_PANEL_INCHES + len(rows) * _LANE_INCHES for rows in lanes) + 0.6
    figure = Figure(figsize=(width / _DPI, height), dpi=_DPI, layout="constrained")
    axes = figure.subplots(len(panels), 1, squeeze=False, sharex=True,
                           height_ratios=[len(rows) + 1.5 for rows in lanes])[:, 0]
    for ax, (title, events), rows in zip(axes, panels, lanes, strict=True):
        _draw_panel(ax, title, events, rows)
    axes[-1].set_xlabel("ms")
    figure.legend(handles=[Patch(color=_rgb(COLORS[kind]), label=kind) for kind in KINDS], loc="outside upper center",
                  ncols=len(KINDS), frameon=False)
    figure.savefig(os.fspath(path), format="png")


def _draw_panel(ax: Any, title: str, events: Sequence[TimelineEvent], rows: list[tuple[int, int]]) -> None:
    origin = min((e.start for e in events), default=0.0)
    row_of = {lane: i for i, lane in enumerate(rows)}
    replicas = {replica for replica, _ in rows}
    for e in sorted(events, key=lambda e: e.kind not in TASKS):  # waits and sends inset, on top of tasks
        y, inset = row_of[(e.replica, e.stage)], 0.0 if e.kind in TASKS else 0.2
        start, length = (e.start - origin) * 1e3, max(e.end - e.start, 0.0) * 1e3
        ax.broken_barh([(start, length)], (y - 0.4 + inset, 0.8 - 2 * inset), facecolors=_rgb(COLORS.get(e.kind,
                                                                                                     (0, 0, 0))))
        if e.kind in TASKS and e.microbatch is not None:
            ax.text(start + length / 2, y, str(e.microbatch), ha="center", va="center", fontsize=7, color="white",
                    clip_on=True)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"stage {s}" if len(replicas) == 1 else f"d{r} stage {s}" for r, s in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_title(title, loc="left", fontsize=9)


def _rgb(color: tuple[int, int, int]) -> tuple[float, float, float]:
    return color[0] / 255, color[1] / 255, color[2] / 255
