"""``loss_weighting`` by tokens: on padded batches the pipeline trains as the plain run of a mean-over-tokens loss.

A Hugging Face ``LlamaForCausalLM`` (its own loss: the mean over labels other than -100, shifted by one) on batches
whose samples have 1 to 16 counted tokens (``tests/jobs/token_loss.py``), 8 AdamW steps: losses of every batch,
every parameter's gradient at the first step and the validation loss against the plain single-process run (P=2;
P=2 with ``accumulate_grad_batches=2`` and a user's counter against the plain run with the same accumulation) and
against Lightning's DDP on 2 processes (P=2 x D=2: each replica's mean over its own tokens, averaged; on demand,
``VARUNA_TESTS=full``). The default weighting by samples fails the same comparison.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.launch import python, torchrun
from helpers.on_demand import wanted
from helpers.results import rank_result

from lightning_varuna import VarunaStrategy
from lightning_varuna.pipeline.batches import count_loss_units, label_tokens

LOSS_TOLERANCE = 5e-4  # the suite's (tests/trainer/test_equivalence.py)
GRAD_TOLERANCE = 1e-5
STEPS = 8

# configuration -> its reference, the processes it runs on
COMPARED = {"tokens-p2": ("ref", 2), "tokens-p2-accum2": ("ref-accum2", 2), "tokens-p2d2": ("ddp", 4),
            "samples-p2": ("ref", 2)}


def _load(out: Path, config: str, rank: int) -> dict:
    result = rank_result(out, config, rank)
    assert "error" not in result, f"{config} rank {rank}: {result['error']}\n{result.get('traceback', '')}"
    return result


def _differences(out: Path, config: str) -> tuple[float, float, list[str]]:
    """The largest loss and step-1 gradient differences of ``config`` from its reference, and what is missing."""
    reference_name, processes = COMPARED[config]
    reference = _load(out, reference_name, 0)
    loss_diff, grad_diff, held, problems = 0.0, 0.0, set(), []
    for rank in range(processes):
        run = _load(out, config, rank)
        if len(run["losses"]) != len(reference["losses"]) or len(run["losses"]) < STEPS:
            problems.append(f"rank {rank}: {len(run['losses'])} losses, reference {len(reference['losses'])}")
        loss_diff = max([loss_diff, *(abs(a - b) for a, b in zip(run["losses"], reference["losses"]))])
        if "val_loss" in reference:
            loss_diff = max(loss_diff, abs(run["val_loss"] - reference["val_loss"]))
        for name, grad in run["grads"].items():
            held.add(name)
            grad_diff = max([grad_diff, *(abs(a - b) for a, b in zip(grad, reference["grads"][name], strict=True))])
    missing = sorted(set(reference["grads"]) - held)
    if missing:
        problems.append(f"parameters held by no rank: {missing[:3]}")
    return loss_diff, grad_diff, problems


# under pytest-xdist one worker runs all of this module's tests, so its module-scoped jobs run once (not once per
# worker)
pytestmark = pytest.mark.xdist_group("token_loss")


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("token_loss")
    python("token_loss.py", str(out), "ref", "ref-accum2", timeout=600)
    replayed = torchrun("token_loss.py", str(out), "tokens-p2", "samples-p2", "tokens-p2-accum2", nproc=2,
                        timeout=900).p2p_steps
    runs = 3
    if wanted(request.config):  # P x D against Lightning's DDP: two more jobs (6 processes)
        torchrun("token_loss.py", str(out), "ddp", nproc=2, timeout=600)
        replayed += torchrun("token_loss.py", str(out), "tokens-p2d2", nproc=4, timeout=900).p2p_steps
        runs += 1
    assert replayed >= runs * STEPS  # every pipelined step was replayed under NCCL's rules
    return out


@pytest.mark.slow
@pytest.mark.parametrize("config", ["tokens-p2", "tokens-p2-accum2",
                                    pytest.param("tokens-p2d2", marks=pytest.mark.full)])
def test_token_weighting_on_padded_batches_trains_as_the_plain_run(results: Path, config: str) -> None:
    loss_diff, grad_diff, problems = _differences(results, config)
    assert not problems, problems
    assert loss_diff <= LOSS_TOLERANCE, f"{config}: loss differs by {loss_diff:.2e}"
    assert grad_diff <= GRAD_TOLERANCE, f"{config}: step-1 gradient differs by {grad_diff:.2e}"


@pytest.mark.slow
def test_sample_weighting_on_padded_batches_differs_from_the_plain_run(results: Path) -> None:
    """The comparison can fail: weighting micro-batch token means by samples is not the batch's token mean."""
    loss_diff, grad_diff, problems = _differences(results, "samples-p2")
    assert not problems, problems
    assert loss_diff > 10 * LOSS_TOLERANCE and grad_diff > 10 * GRAD_TOLERANCE, (loss_diff, grad_diff)


def test_label_tokens_finds_the_labels_of_a_mapping_or_a_tuple() -> None:
    labels = torch.tensor([[5, 6, -100], [-100, 7, 8]])
    assert int(label_tokens({"input_ids": labels.clamp(min=0), "labels": labels})) == 4
    assert int(label_tokens({"labels": labels}, shifted=True)) == 3  # the first position never counts
    assert int(label_tokens((torch.randn(2, 3), labels))) == 4
    with pytest.raises(ValueError, match=r"batch\['labels'\].*loss_weighting=a function"):
        label_tokens({"input_ids": labels})
    with pytest.raises(ValueError, match="found none in a batch of type tuple"):
        label_tokens((labels, torch.randn(2, 3)))  # the last element is not an integer tensor


def test_loss_units_per_micro_batch() -> None:
    micro = [{"labels": torch.tensor([[1, -100, -100]])}, {"labels": torch.tensor([[1, 2, 3], [4, -100, 5]])}]
    cpu = torch.device("cpu")
    assert count_loss_units(micro, [1, 2], "samples", cpu) == [1.0, 2.0]
    assert count_loss_units(micro, [1, 2], "tokens", cpu) == [1.0, 5.0]
    assert count_loss_units(micro, [1, 2], "shifted_tokens", cpu) == [0.0, 3.0]
    assert count_loss_units(micro, [1, 2], lambda mb: int(mb["labels"].numel()), cpu) == [3.0, 6.0]
    # no counted token in the batch: a mean over none is NaN in every micro-batch, as in the plain run
    assert count_loss_units(micro, [1, 2], lambda mb: 0, cpu) == [1.0, 2.0]
    with pytest.raises(ValueError, match="negative counts"):
        count_loss_units(micro, [1, 2], lambda mb: -1, cpu)
    with pytest.raises(ValueError, match="must return a number"):
        count_loss_units(micro, [1, 2], lambda mb: mb["labels"], cpu)


def test_unknown_loss_weighting_is_refused_when_the_strategy_is_created() -> None:
    with pytest.raises(ValueError, match=r"loss_weighting='words': choose one of \('samples', 'tokens'"):
        VarunaStrategy(pipeline_parallel_size=2, loss_weighting="words")
