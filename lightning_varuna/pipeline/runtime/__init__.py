"""Running a schedule on one stage: the executor, a step's actions, its links.

Modules: :mod:`~.executor`, :mod:`~.stage_step`, :mod:`~.links` (inboxes and outboxes),
:mod:`~.fused_linear_grad` (linear layers' weight gradients accumulated in place), :mod:`~.selective_recompute` (a
recompute that takes the outputs a policy saved from the forward).
"""
