"""Failures across ranks (the error a lost peer raises, reports, the watchdog ring) and files a crash cannot tear.

Imported by the pipeline engine, by checkpointing and by the Lightning glue; imports none of them, nor Lightning.
Modules: :mod:`~.failures`, :mod:`~.watchdog` (with :mod:`~.ring_sockets`), :mod:`~.atomic_write`.
"""
