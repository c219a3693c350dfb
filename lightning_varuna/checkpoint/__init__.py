"""Checkpoints keyed by parameter name, so that one written under any P x D loads under any other.

A checkpoint is a directory written by ``torch.distributed.checkpoint.save`` (DCP): every stage writes the
tensors it holds (weights and optimizer state under full-model parameter names; a tensor held by several ranks,
such as a replica's copy or a tied parameter, is written once), and rank 0 adds ``meta.pt`` with Lightning's own
state and ``record.pt``, the model's parameter names, optimizer groups and checksums.

Modules: :mod:`~.state` (the name-keyed state), :mod:`~.storage` (locations and files), :mod:`~.publish` (putting
a checkpoint in place, surviving any interruption), :mod:`~.integrity` (checksums), :mod:`~.lease` (one job per
folder), :mod:`~.job` (one collective write), :mod:`~.background` (the writer processes), :mod:`~.writer`
(blocking or background saves), :mod:`~.load` (checks and loading), :mod:`~.plain_format` (to and from plain
Lightning checkpoints; needs Lightning, so it is not imported here).
"""

from lightning_varuna.checkpoint.state import CheckpointError
from lightning_varuna.checkpoint.storage import Location, is_complete

__all__ = ["CheckpointError", "Location", "is_complete"]
