"""Selective recompute: a stage's recompute takes the outputs of the ops a policy saves from its forward.

A recomputing stage runs its forward without autograd and keeps only its input; ``R(k)`` runs the forward again
with autograd before the backward. With a policy (``recompute_policy``, in the format of torch's selective
activation checkpointing: a function of ``(ctx, op, *args, **kwargs)`` returning a
``torch.utils.checkpoint.CheckpointPolicy`` or a bool, or a list of ops to save), the forward also keeps the
outputs of the ops the policy saves, and the recompute returns them instead of running those ops again. Saving
the expensive ops (matrix multiplies, attention) and recomputing the cheap ones around them (norms,
activations, residual adds) makes the recompute nearly free for the memory of those outputs: a point between
"recompute the whole stage" and "keep every activation".

The ops are recorded from the stage's first cut point (after its input arrived) to its last, so a forward and
its recompute see the same ops in the same order. torch's ``create_selective_checkpoint_contexts`` does the
saving and replaying; :meth:`SavedOps.check_replayed` makes sure every saved output was taken back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import create_selective_checkpoint_contexts

__all__ = ["RecomputePolicy", "SavedOps", "SelectiveRecomputeError", "selective_contexts"]

RecomputePolicy = Callable[..., Any] | Sequence[Any]
"""torch's selective checkpointing policy: a function ``(ctx, op, *args, **kwargs) -> CheckpointPolicy | bool``, or
a list of ops (``torch.ops.aten.mm.default``, ...) whose outputs are saved."""


selective_contexts: Callable[..., tuple[Any, Any]] = create_selective_checkpoint_contexts
"""torch's ``create_selective_checkpoint_contexts`` (unannotated there): the saving and the replaying mode of a policy,
which also checks the policy's list of ops."""


class SelectiveRecomputeError(RuntimeError):
    """A recompute did not take back every output its forward saved: the two ran different ops."""


class SavedOps:
    """The outputs a policy saved from one micro-batch's forward, for its recompute.

    Args:
        policy: The policy (:data:`RecomputePolicy`).
    """

    def __init__(self, policy: RecomputePolicy) -> None:
        policy_arg = list(policy) if not callable(policy) else policy
        self.saving, self.replaying = selective_contexts(policy_arg)

    def entered_at_input(self, fetch: Callable[[], Tensor] | None, recomputing: bool, scope: ExitStack,
                         where: str) -> Callable[[], Tensor] | None:
        """Enters the saving mode (a forward) or the replaying one (a recompute) into ``scope`` at the stage's input.

        That is once ``fetch`` has returned the received activation, or at once on the first stage (no ``fetch``).
        The replaying mode checks at its exit that every saved output was taken (:meth:`check_replayed`).

        Returns:
            What to call for the input instead of ``fetch``.
        """
        mode = self._replaying_checked(where) if recomputing else self.saving
        if fetch is None:
            scope.enter_context(mode)
            return None
        received_by = fetch

        def fetch_then_enter() -> Tensor:
            received = received_by()
            scope.enter_context(mode)
            return received

        return fetch_then_enter

    @contextlib.contextmanager
    def _replaying_checked(self, where: str) -> Iterator[None]:
        with self.replaying:
            yield
        self.check_replayed(where)

    def check_replayed(self, where: str) -> None:
        """Raises :class:`SelectiveRecomputeError` if the recompute left a saved output untaken.

        A forward that ran a saved op more often than its recompute would otherwise hand the recompute's calls
        the outputs of other calls. torch keeps the saved outputs in the saving mode's ``storage`` (op -> call
        index -> entry); an entry still holding a tensor after the recompute was never replayed. ``storage`` is not
        public API; the tests cover torch 2.13-2.14 (``tests/test_selective_recompute.py`` makes a forward and its
        recompute differ on purpose).
        """
        storage = self.saving.storage
        left = [str(op) for op, entries in storage.items() for entry in entries.values() if _holds_tensor(entry)]
        if left:
            raise SelectiveRecomputeError(
                f"{where}: the recompute did not take back the saved outputs of {sorted(set(left))} ({len(left)}"
                " call(s)): the forward ran these ops more often than its recompute. recompute_policy needs a stage's"
                " forward to run the same ops on its recompute (keep data-dependent or first-call-only code out of"
                " the stage's segments), or turn recompute_policy off."
            )


def _holds_tensor(entry: object) -> bool:
    """Whether a storage entry still holds a saved output (taken and recomputed entries are torch's sentinels).

    An entry is the op's output with each tensor wrapped (an object whose ``val`` is the tensor), or a tuple or
    list of those for an op of several outputs.
    """
    if isinstance(entry, (tuple, list)):
        return any(_holds_tensor(e) for e in entry)
    return isinstance(getattr(entry, "val", None), torch.Tensor)
