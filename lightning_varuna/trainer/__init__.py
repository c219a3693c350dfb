"""The Lightning side: :class:`VarunaStrategy` and what it delegates to.

Everything here imports Lightning; the layers below (:mod:`lightning_varuna.checkpoint`,
:mod:`lightning_varuna.pipeline`, :mod:`lightning_varuna.failstop`) do not. Modules: :mod:`~.strategy` (the
strategy's hooks), :mod:`~.processes` (its base: processes, groups, collectives), :mod:`~.launcher`,
:mod:`~.module_setup` (the engine built from the LightningModule's own step), :mod:`~.step_hooks`,
:mod:`~.batch_gradients`, :mod:`~.precision`, :mod:`~.callbacks`, :mod:`~.data`, :mod:`~.patches` (every change
made to Lightning's or the user's objects), :mod:`~.reports`, :mod:`~.fabric`; the command lines :mod:`~.preview`
and :mod:`~.convert`; sub-packages :mod:`~.logs` (logging across stages) and :mod:`~.recovery` (checkpoints,
resume, preemption).
"""
