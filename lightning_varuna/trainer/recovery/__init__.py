"""Surviving interruptions (Lightning glue): checkpoint hooks and leases, resuming, preemption, in-place recovery.

Modules: :mod:`~.checkpoint_hooks`, :mod:`~.resume` (what ``ckpt_path="last"`` stands for), :mod:`~.preemption`,
:mod:`~.in_place` (survivors of deaths going on inside the same ``fit``).
"""
