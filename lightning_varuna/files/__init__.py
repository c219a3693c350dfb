"""Files a crash cannot tear: the package's one atomic write (:mod:`~.atomic_write`).

Beside :mod:`lightning_varuna.failstop` at the bottom of the layers: checkpoint files and leases
(:mod:`lightning_varuna.checkpoint`) and cached profiles (:mod:`lightning_varuna.pipeline.planning`) use it; it
imports nothing of the package, nor Lightning.
"""
