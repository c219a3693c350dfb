"""Timelines of pipeline steps, predicted or recorded: Chrome traces, metrics, pictures.

Modules: :mod:`~.timeline` (events, Chrome traces, metrics), :mod:`~.picture` (PNGs drawn with matplotlib, the
optional ``viz`` extra).
"""
