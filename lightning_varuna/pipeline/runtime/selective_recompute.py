"""Selective recompute: a stage's recompute takes the outputs of the ops a policy saves from its forward.

A recomputing stage runs its forward without autograd and keeps only its input; ``R(k)`` runs the forward again
with autograd before the backward. With a policy (``recompute_policy``, in the format of torch's selective
activation checkpointing: a function of ``(ctx, op, *args, **kwargs)`` returning a
``torch.utils.checkpoint.CheckpointPolicy`` or a bool, or a list of ops to save), the forward also keeps the
outputs of the ops the policy saves, and the recompute returns them instead of running those ops again. Saving
the expensive ops (matrix multiplies, attention) and recomputing the cheap ones around them (norms,
activations, residual adds) makes the recompute nearly free for the memory of those outputs: a point between
"recompute the whole stage" and "keep every activation".

The ops are recorded from the stage's input on (after the received activation arrived; on the first stage from the
step's start) to the stage's last cut point, so a forward and its recompute see the same ops in the same order.
torch's ``create_selective_checkpoint_contexts`` does the saving and replaying; :meth:`SavedOps.check_replayed`
makes sure every saved output was taken back. An op that draws random numbers (dropout, attention with a nonzero
dropout probability) is always recomputed, whatever the policy says: R restores F's random state, and a saved
random op would draw nothing in R, so every later random op of R would draw other numbers than in F.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from types import TracebackType
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = ["RecomputePolicy", "SavedOps", "SelectiveRecomputeError", "StageOps", "draws_random_numbers",
           "selective_contexts", "stage_ops"]

RecomputePolicy = Callable[..., Any] | Sequence[Any]
"""torch's selective checkpointing policy: a function ``(ctx, op, *args, **kwargs) -> CheckpointPolicy | bool``, or
a list of ops (``torch.ops.aten.mm.default``, ...) whose outputs are saved."""


selective_contexts: Callable[..., tuple[Any, Any]] = create_selective_checkpoint_contexts
"""torch's ``create_selective_checkpoint_contexts`` (unannotated there): the saving and the replaying mode of a policy,
which also checks the policy's list of ops."""


class SelectiveRecomputeError(RuntimeError):
    """A recompute did not run the ops its forward ran, so it cannot take back what the forward saved."""


def draws_random_numbers(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether this call of ``op`` draws from a random generator (torch tags such ops ``nondeterministic_seeded``).

    A call whose dropout probability is 0 (attention without dropout), or ``native_dropout`` with ``train=False``,
    draws nothing. The argument names come from the op's schema (``OpOverload._schema``: no public accessor).
    """
    if torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()):
        return False
    values = dict(zip((argument.name for argument in op._schema.arguments), args, strict=False)) | kwargs
    if values.get("train", True) is False:
        return False
    probability = values.get("dropout_p", values.get("p"))
    return not (isinstance(probability, (int, float)) and probability == 0)


def _random_ops_recomputed(policy: RecomputePolicy) -> Callable[..., Any]:
    """``policy`` as a function, with every call that draws random numbers recomputed (see the module)."""
    if callable(policy):
        chosen = policy
    else:
        saved = frozenset(policy)

        def chosen(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    def decide(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if draws_random_numbers(op, args, kwargs):
            return CheckpointPolicy.PREFER_RECOMPUTE
        return chosen(ctx, op, *args, **kwargs)

    return decide


class SavedOps:
    """The outputs a policy saved from one micro-batch's forward, for its recompute.

    Args:
        policy: The policy (:data:`RecomputePolicy`).
    """

    def __init__(self, policy: RecomputePolicy) -> None:
        self.saving, self.replaying = selective_contexts(_random_ops_recomputed(policy))

    def check_replayed(self, where: str) -> None:
        """Raises :class:`SelectiveRecomputeError` if the recompute left a saved output untaken.

        A forward that ran a saved op more often than its recompute would otherwise hand the recompute's calls
        the outputs of other calls. torch keeps the saved outputs in the saving mode's ``storage`` (op -> call
        index -> entry); an entry still holding a tensor after the recompute was never replayed. ``storage`` is not
        public API; the tests cover torch 2.13-2.14 (``tests/pipeline/runtime/test_selective_recompute.py`` makes a
        forward and its recompute differ on purpose).
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


class StageOps:
    """A stage forward's selective-recompute mode: the saving one in ``F(k)``, the replaying one in ``R(k)``.

    Used as the innermost context of the stage's forward, and :meth:`after` wraps the function that receives the
    stage's input: the mode is entered once the input has arrived (on the first stage, which receives nothing, when
    the context is entered) and left with the context. Without ``saved`` it does nothing.

    Args:
        saved: The micro-batch's saved outputs.
        recomputing: Whether this forward is ``R(k)``; its exit then checks that every saved output was taken.
        where: The stage and micro-batch, for errors.
        first_stage: Whether the stage receives no input.
    """

    def __init__(self, saved: SavedOps, recomputing: bool, where: str, first_stage: bool) -> None:
        self.saved, self.recomputing, self.where, self.first_stage = saved, recomputing, where, first_stage
        self._scope = ExitStack()

    def after(self, fetch: Callable[[], Tensor] | None) -> Callable[[], Tensor] | None:
        """``fetch`` that enters the mode once it has returned the stage's input."""
        if fetch is None:
            return None
        received_by = fetch

        def fetch_then_enter() -> Tensor:
            received = received_by()
            self._enter()
            return received

        return fetch_then_enter

    def _enter(self) -> None:
        self._scope.enter_context(self.saved.replaying if self.recomputing else self.saved.saving)

    def __enter__(self) -> StageOps:
        if self.first_stage:
            self._enter()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._scope.close()
        if not self.recomputing:
            return
        if error is None:
            self.saved.check_replayed(self.where)
        elif isinstance(error, RuntimeError) and "not found in storage" in str(error):  # torch's replay mismatch
            raise SelectiveRecomputeError(
                f"{self.where}: the recompute ran an op its forward did not ({error}). The forward runs without"
                " autograd and the recompute with it; an op whose decomposition depends on that (e.g. a matmul of a"
                " non-contiguous 3-d input with a weight) cannot be saved. Save other ops, or turn recompute_policy"
                " off."
            ) from error


_NO_OPS = nullcontext()  # reusable: a forward without a policy allocates nothing here


def stage_ops(saved: SavedOps | None, recomputing: bool, stage: int, k: int, fetch: Callable[[], Tensor] | None
              ) -> tuple[AbstractContextManager[Any], Callable[[], Tensor] | None]:
    """The context of a stage forward's selective-recompute mode and the input function that enters it.

    Without ``saved`` (no policy): a shared no-op context and ``fetch`` itself.
    """
    if saved is None:
        return _NO_OPS, fetch
    ops = StageOps(saved, recomputing, f"Stage {stage}, micro-batch {k}", first_stage=fetch is None)
    return ops, ops.after(fetch)


def _holds_tensor(entry: object) -> bool:
    """Whether a storage entry still holds a saved output (taken and recomputed entries are torch's sentinels).

    An entry is the op's output with each tensor wrapped (an object whose ``val`` is the tensor), or a tuple or
    list of those for an op of several outputs.
    """
    if isinstance(entry, (tuple, list)):
        return any(_holds_tensor(e) for e in entry)
    return isinstance(getattr(entry, "val", None), torch.Tensor)
