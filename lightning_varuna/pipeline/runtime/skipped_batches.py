"""A batch skipped before the model's forward: the user's step returned None before reaching a cut point.

It is skipped on every stage alike, for every micro-batch: the stage sends a skip header in place of the first
activation's header, and the activations and gradients of the step are dropped from every link's messages on both
sides; only the summary still travels. A batch skipped for some micro-batches or on some stages only is an error.
"""

from __future__ import annotations

from typing import Protocol

import torch

from lightning_varuna.pipeline.comm.transfers import HEADER_SIZE, encode_skip_header
from lightning_varuna.pipeline.model.cut import CutPointError
from lightning_varuna.pipeline.runtime.links import Inbox, LocalLink, Outbox
from lightning_varuna.pipeline.runtime.side_values import StageSides
from lightning_varuna.pipeline.scheduling.lowering import Message, MessageKind

__all__ = ["StepLinks", "check_skipped_alike"]


class StepLinks(Protocol):
    """What the check uses of a stage's step (:class:`~lightning_varuna.pipeline.runtime.stage_step.StageStep`)."""

    stage: int
    device: torch.device
    prev: int | None
    next: int | None
    skip_mode: bool | None
    upstream_skipped: bool
    from_prev: Inbox | LocalLink | None
    from_next: Inbox | LocalLink | None
    to_prev: Outbox | LocalLink | None
    to_next: Outbox | LocalLink | None
    sides: StageSides | None

    def input_shapes_known(self, wait: bool) -> bool:
        """Whether the step's input shapes are known (reads the header; waits for it if asked)."""
        ...

_DROPPED_WHEN_SKIPPED = (MessageKind.ACTIVATION, MessageKind.GRADIENT)


def check_skipped_alike(step: StepLinks, k: int, skipped: bool) -> None:
    """Checks that every micro-batch of the step is skipped before the forward, or none is."""
    if step.prev is None and step.next is None:
        return  # no neighbour waits for a message
    if step.skip_mode is None:
        step.skip_mode = skipped
        if skipped:
            _skip_links(step)
    elif step.skip_mode != skipped:
        raise CutPointError(
            f"The step returned None before the model's forward for micro-batch {k if skipped else 0} but"
            f" not for micro-batch {0 if skipped else k} of the same batch. A batch is skipped as a whole:"
            " decide before the forward from what every micro-batch shares (batch_idx, the trainer's"
            " state), or return None after the loss."
        )


def _skip_links(step: StepLinks) -> None:
    """The step's batch is skipped: a skip header goes on, and only the summary is left to exchange."""
    if step.to_next is not None:
        size = HEADER_SIZE if step.sides is None else step.sides.sent_header_size
        step.to_next.send(Message(MessageKind.HEADER, step.stage), encode_skip_header(step.device, size), step.stage)
        step.to_next.drop_unsent(_DROPPED_WHEN_SKIPPED)
    if step.to_prev is not None:
        step.to_prev.drop_unsent(_DROPPED_WHEN_SKIPPED)
    if step.from_next is not None:
        step.from_next.drop_unposted(_DROPPED_WHEN_SKIPPED)
        step.from_next.advance()
    if step.from_prev is not None:
        step.input_shapes_known(wait=True)
        if not step.upstream_skipped:
            raise CutPointError(
                f"Stage {step.stage}'s step returned None before the model's forward, but stage {step.stage - 1}"
                " ran its forward on the same batch: every stage must decide alike whether to skip a batch."
            )
        step.from_prev.drop_unposted(_DROPPED_WHEN_SKIPPED)
        step.from_prev.advance()
