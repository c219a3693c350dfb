"""What recompute needs beyond the forward: the first forward's RNG state, and recompute by degree.

With ``recompute`` a number of segments ``n`` (recompute by degree), a non-last stage runs its first ``n`` segments
without autograd in its forward and recomputes them before its backward, and keeps the autograd graph of the rest
from the forward on, as without recompute: memory between "recompute the whole stage" and "none".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from lightning_varuna.pipeline.model.dry_run import PartitionError

__all__ = ["backward_recomputed", "grad_from_cut", "rng_devices", "rng_state", "set_rng_state"]


def grad_from_cut(first_cut: int | None, last_cut: int | None, segments: int | None,
                  crossings: Mapping[tuple[int, int], str]) -> int | None:
    """The cut point from which a stage recomputed by ``segments`` keeps its graph; None: recompute all of it.

    Args:
        first_cut: The cut point the stage receives from (None on the first stage).
        last_cut: The cut point where the stage ends (None on the last stage, which never recomputes).
        segments: How many of the stage's first segments recompute (None: all).
        crossings: Values that cross from one segment to a later one other than through the cut point between
            them (the dry run's), by ``(source, destination)`` segment.

    Raises:
        PartitionError: If a value computed in the recomputed part reaches the rest other than through the cut
            point: it would be computed without autograd, and its gradient lost.
    """
    if segments is None or last_cut is None:
        return None
    cut = (-1 if first_cut is None else first_cut) + segments
    if cut >= last_cut:
        return None
    for (source, destination), what in sorted(crossings.items()):
        if source <= cut < destination:
            raise PartitionError(
                f"recompute={segments} ends the recomputed part of a stage at cut point #{cut}, which a value"
                f" crosses from segment {source} to segment {destination} other than through the cut point"
                f" ({what}): its gradient would be lost. Choose another number of segments, or recompute=True (the"
                " whole stage)."
            )
    return cut


def backward_recomputed(boundary: Tensor, recomputed: Tensor, roots: Sequence[Tensor] = (),
                        grads: Sequence[Tensor] = (), kept: Sequence[tuple[Tensor, Tensor]] = ()) -> None:
    """The backward of a stage's recomputed segments, from the gradient its other segments gave ``boundary``.

    ``roots`` are values the recomputed segments made that the stage sent on (side values), with their ``grads``.
    ``kept`` pairs each value the recomputed segments made again with the leaf the other segments used in its place
    (a side value made and used on the stage): the value continues the leaf's gradient, as ``recomputed`` continues
    ``boundary``'s. A value both sent and used is a root twice; autograd adds its gradients.
    """
    grad = boundary.grad if boundary.grad is not None else torch.zeros_like(recomputed)
    pairs = [(value, leaf.grad) for value, leaf in kept if leaf.grad is not None and value.requires_grad]
    torch.autograd.backward([recomputed, *roots, *(value for value, _ in pairs)],
                            [grad, *grads, *(g for _, g in pairs)])


def rng_devices(device: torch.device) -> list[torch.device]:
    """The devices whose RNG ``torch.random.fork_rng`` must save besides the CPU's."""
    return [device] if device.type == "cuda" else []


def rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    """The CPU's and the device's RNG state."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def set_rng_state(device: torch.device, state: tuple[Tensor, Tensor | None]) -> None:
    """Restores a state of :func:`rng_state`."""
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
