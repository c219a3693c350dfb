"""Failures across ranks: the error a lost peer raises, reports in the job's store, the watchdog ring; files a crash
never leaves half-written.

Imported by the pipeline engine, by checkpointing and by the Lightning glue; imports none of them, nor Lightning.
Modules: :mod:`~.failures`, :mod:`~.watchdog` (with :mod:`~.ring_sockets`), :mod:`~.atomic_write`.
"""
