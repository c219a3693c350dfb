"""Fail-stop: a failure on any rank detected, reported and ending every rank together.

The error a lost peer raises, failure reports in the job's store, the watchdog ring. Imported by the pipeline
engine, by checkpointing and by the Lightning glue; imports none of them, nor Lightning. Coming back after a
failure (checkpoints, resume, preemption) is :mod:`lightning_varuna.trainer.recovery`'s.
Modules: :mod:`~.failures`, :mod:`~.watchdog` (with :mod:`~.ring_sockets`); for survivors that recover in place,
:mod:`~.abandon` (waits given up), :mod:`~.survivors` (agreement, a new world) and :mod:`~.store_server`.
"""
