"""The model summary at the start of ``fit``: of the whole model, not of the stage a rank holds.

Lightning's ``ModelSummary`` callback summarizes the module at ``on_fit_start``, after the strategy has partitioned it:
each rank then holds only its stage's parameters, and rank 0 (stage 0) would print a fraction of the model. The
strategy asks each summary callback for its summary (Lightning's own ``_summary``: layers up to its depth,
parameter counts, modes, FLOPs and sizes of the ``example_input_array`` forward) while the model is still whole,
keeps the numbers, and hands them back at ``on_fit_start`` (:func:`lightning_varuna.patches.summarize_with`).
The stage table the strategy prints follows it.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary

__all__ = ["FrozenSummary", "whole_model_summaries"]


class FrozenSummary:
    """What ``ModelSummary.on_fit_start`` reads from a summary, taken from one made of the whole model.

    Args:
        summary: A Lightning model summary (``lightning.pytorch.utilities.model_summary.ModelSummary`` or its
            DeepSpeed variant), read at once.
    """

    def __init__(self, summary: Any) -> None:
        self._data = summary._get_summary_data()
        self.total_parameters: int = summary.total_parameters
        self.trainable_parameters: int = summary.trainable_parameters
        self.model_size: float = summary.model_size
        self.total_training_modes: dict[str, int] = summary.total_training_modes
        self.total_flops: int = getattr(summary, "total_flops", 0)

    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        """The summary's columns (the name Lightning's callback calls)."""
        return self._data


def whole_model_summaries(trainer: Trainer, module: LightningModule) -> list[tuple[ModelSummary, FrozenSummary]]:
    """Each of the trainer's model summary callbacks that prints one, with its summary of ``module`` as it is now.

    Every rank makes them, as Lightning does at ``on_fit_start``.
    """
    callbacks = [cb for cb in trainer.callbacks if isinstance(cb, ModelSummary)]  # type: ignore[attr-defined]
    # `_max_depth` is the callback's only record of its depth (0: it prints nothing)
    return [(cb, FrozenSummary(cb._summary(trainer, module))) for cb in callbacks if cb._max_depth]
