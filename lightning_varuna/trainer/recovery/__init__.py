"""Surviving interruptions (Lightning glue): checkpoint hooks and leases, resuming, preemption.

Modules: :mod:`~.checkpoint_hooks`, :mod:`~.resume` (what ``ckpt_path="last"`` stands for), :mod:`~.preemption`.
"""
