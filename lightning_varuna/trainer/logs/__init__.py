"""Logging across stages (Lightning glue): ``self.log`` per micro-batch and optimizer-hook logs, merged.

Modules: :mod:`~.log_sync` (captured per micro-batch, reduced on the last stage, shared over the pipeline),
:mod:`~.hook_logs` (what ``on_before_optimizer_step`` logs, merged over the pipeline).
"""
