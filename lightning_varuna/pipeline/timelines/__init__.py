"""Timelines of pipeline steps, predicted or recorded: Chrome traces, metrics, PNGs.

Modules: :mod:`~.timeline`, :mod:`~.png` (PNGs drawn with the standard library).
"""
