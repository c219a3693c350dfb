"""Lightning callbacks that would see one stage where a plain run has the whole model.

- ``ModelSummary`` (and ``RichModelSummary``) summarize the module at ``on_fit_start``, after the strategy has
  partitioned it: each rank then holds only its stage's parameters, and rank 0 (stage 0) would print a fraction of
  the model. The strategy asks each summary callback for its summary (Lightning's own ``_summary``: layers up to
  its depth, parameter counts, modes, FLOPs and sizes of the ``example_input_array`` forward) while the model is
  still whole, keeps the numbers, and hands them back at ``on_fit_start``
  (:func:`lightning_varuna.trainer.patches.summarize_with`). The stage table the strategy prints follows it.
- ``BasePredictionWriter``: every stage of a pipeline holds the same predictions; only the first stage of each
  replica writes them (:func:`lightning_varuna.trainer.patches.silence_prediction_writers`).
- ``StochasticWeightAveraging`` is refused: it keeps a copy of the whole model on every rank and averages it with
  one stage's parameters, and its checkpoint state would hold one stage's average.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary, StochasticWeightAveraging

from lightning_varuna.trainer.patches import InstancePatches, silence_prediction_writers, summarize_with

__all__ = [
    "FrozenSummary", "adapt_callbacks", "refuse_unsupported_callbacks", "trainer_callbacks", "whole_model_summaries",
]


class _WithCallbacks(Protocol):
    callbacks: list[Callback]


def trainer_callbacks(trainer: Trainer) -> list[Callback]:
    """The trainer's callbacks (set by Lightning's callback connector; ``Trainer`` does not declare them)."""
    return cast(_WithCallbacks, trainer).callbacks


class FrozenSummary:
    """What ``ModelSummary.on_fit_start`` reads from a summary, taken from one made of the whole model.

    Args:
        summary: A Lightning model summary (``lightning.pytorch.utilities.model_summary.ModelSummary`` or its
            DeepSpeed variant), read at once.
    """

    def __init__(self, summary: Any) -> None:
        self._data: list[tuple[str, list[str]]] = summary._get_summary_data()
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
    callbacks = [cb for cb in trainer_callbacks(trainer) if isinstance(cb, ModelSummary)]
    # `_max_depth` is the callback's only record of its depth (0: it prints nothing)
    return [(cb, FrozenSummary(cb._summary(trainer, module))) for cb in callbacks if cb._max_depth]


def adapt_callbacks(
    trainer: Trainer, patches: InstancePatches, summaries: list[tuple[ModelSummary, FrozenSummary]], first_stage: bool
) -> None:
    """After partitioning: summaries of the whole model at ``on_fit_start``; prediction writers on stage 0 only."""
    for callback, summary in summaries:
        summarize_with(patches, callback, summary)
    if not first_stage:
        silence_prediction_writers(patches, trainer_callbacks(trainer))


def refuse_unsupported_callbacks(trainer: Trainer) -> None:
    """Raises, on every rank alike and before any collective, for callbacks that cannot work on one stage."""
    if any(isinstance(cb, StochasticWeightAveraging) for cb in trainer_callbacks(trainer)):
        raise MisconfigurationException(
            "StochasticWeightAveraging does not work with VarunaStrategy: it keeps a copy of the whole model on"
            " every rank and averages it with the parameters of this rank's stage only, and its checkpoint state"
            " would hold one stage's average. Remove the callback (to average weights, average checkpoints of the"
            " run after `python -m lightning_varuna.trainer.convert to-plain`)."
        )
