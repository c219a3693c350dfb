"""Selective recompute (``recompute_policy``): what is refused, and the check that a recompute replayed every saved op.

Training with a policy equals the plain run: ``tests/trainer/test_equivalence.py`` (``*-sac``) and
``tests/pipeline/runtime/test_side_values.py`` (``p4-1f1b-sac``). That the recompute does not run the saved ops again
is counted by the schedules benchmark's smoke test (``tests/benchmarks/test_schedules.py``, ``ours-1f1b-sac``).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from lightning_varuna import VarunaStrategy
from lightning_varuna.pipeline import EngineConfig
from lightning_varuna.pipeline.runtime.selective_recompute import (
    SavedOps,
    SelectiveRecomputeError,
    StageOps,
    draws_random_numbers,
)

MM = torch.ops.aten.mm.default


def _save_mm(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op is MM else CheckpointPolicy.PREFER_RECOMPUTE


def _layer(x: torch.Tensor, w: torch.Tensor, times: int = 1) -> torch.Tensor:
    for _ in range(times):
        x = torch.tanh(x @ w)
    return x


class _MmCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts aten.mm calls that reach the kernels (a replayed one does not)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is MM
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("policy", [_save_mm, [MM]], ids=["function", "list"])
def test_the_recompute_takes_the_saved_outputs_and_gives_the_plain_gradients(policy) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    expected = torch.autograd.grad(_layer(x, w, 2).sum(), w)[0]
    saved = SavedOps(policy)
    with torch.no_grad(), saved.saving:  # the stage's forward, without autograd
        _layer(x, w, 2)
    counter = _MmCounter()
    # the recompute; the counter sits below the replaying mode (entered first), so it sees only the ops that run
    with counter, saved.replaying:
        out = _layer(x, w, 2)
    saved.check_replayed("test")
    assert counter.calls == 0
    torch.testing.assert_close(torch.autograd.grad(out.sum(), w)[0], expected, rtol=0, atol=0)


def test_a_recompute_that_ran_fewer_saved_ops_than_its_forward_is_an_error() -> None:
    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    saved = SavedOps([MM])
    with torch.no_grad(), saved.saving:
        _layer(x, w, 3)
    with saved.replaying:
        _layer(x, w, 2)
    with pytest.raises(SelectiveRecomputeError, match=r"aten\.mm\.default.*1 call"):
        saved.check_replayed("Stage 0, micro-batch 1")


@pytest.mark.parametrize(("options", "message"), [
    (dict(recompute=False), "recompute=False"),
    (dict(recompute=2), "recompute=2"),
    (dict(recompute="auto"), "recompute='auto'"),
    (dict(schedule="auto"), "cannot be used with 'auto' values"),
    (dict(microbatch_size="auto"), "cannot be used with 'auto' values"),
])
def test_a_policy_without_whole_stage_recompute_chosen_by_the_user_is_refused(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(2, recompute_policy=[MM], **options)
    with pytest.raises(ValueError, match=message):
        VarunaStrategy(pipeline_parallel_size=2, recompute_policy=[MM], **options)


@pytest.mark.parametrize("policy", [[], [torch.ops.aten.mm], ["mm"], 3, MM, torch.ops.aten.mm])
def test_a_policy_that_is_neither_a_function_nor_a_list_of_ops_is_refused(policy) -> None:
    with pytest.raises(ValueError, match="recompute_policy"):
        EngineConfig(2, num_microbatches=4, recompute_policy=policy)


def test_a_list_of_ops_from_code_or_a_config_file_is_kept_as_a_tuple() -> None:
    config = EngineConfig(2, num_microbatches=4, recompute_policy=[MM, torch.ops.aten.addmm.default])
    assert config.recompute_policy == (MM, torch.ops.aten.addmm.default)
    hash(config)


def test_ops_that_draw_random_numbers_are_recomputed_whatever_the_policy_says() -> None:
    """A saved random op would draw nothing in R, which restores F's random state: later random ops would differ."""
    torch.manual_seed(0)
    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)

    def step() -> torch.Tensor:  # a random mask the policy saves, then one it does not
        h = x @ w
        h = h * torch.bernoulli(torch.full_like(h, 0.5))
        return (h * (torch.rand_like(h) > 0.5)) @ w

    state = torch.get_rng_state()
    expected = torch.autograd.grad(step().sum(), w)[0]
    saved = SavedOps([MM, torch.ops.aten.bernoulli.default])  # torch's own contexts: a gradient 10.5 off
    torch.set_rng_state(state)
    with torch.no_grad(), saved.saving:
        step()
    torch.set_rng_state(state)
    with saved.replaying:
        out = step()
    saved.check_replayed("test")
    torch.testing.assert_close(torch.autograd.grad(out.sum(), w)[0], expected, rtol=0, atol=0)


@pytest.mark.parametrize(("op", "args", "random"), [
    (torch.ops.aten.native_dropout.default, (torch.ones(2), 0.1, True), True),
    (torch.ops.aten.native_dropout.default, (torch.ones(2), 0.0, True), False),
    (torch.ops.aten.native_dropout.default, (torch.ones(2), 0.1, False), False),
    (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, (None, None, None, 0.0), False),
    (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, (None, None, None, 0.1), True),
    (torch.ops.aten.bernoulli.default, (torch.ones(2),), True),
    (MM, (torch.ones(2, 2), torch.ones(2, 2)), False),
])
def test_which_calls_draw_random_numbers(op, args, random: bool) -> None:
    assert draws_random_numbers(op, args, {}) is random


def test_a_recompute_that_runs_an_op_its_forward_did_not_is_an_error_naming_the_cause() -> None:
    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    saved = SavedOps([MM])
    with torch.no_grad(), StageOps(saved, False, "Stage 0, micro-batch 0", first_stage=True):
        _layer(x, w, 1)
    with pytest.raises(SelectiveRecomputeError, match="ran an op its forward did not"):
        with StageOps(saved, True, "Stage 0, micro-batch 0", first_stage=True):
            _layer(x, w, 2)
