"""Pipelined training equals the plain single-process Lightning run: losses per step and gradients per name.

The whole matrix of several model chunks per rank (P in {2, 4} x recompute on/off x D in {1, 2}) runs with
``VARUNA_SCHEDULES=full`` (or ``VARUNA_TESTS=full``); CI runs one configuration of each kind.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.launch import python, torchrun
from helpers.on_demand import wanted
from helpers.results import rank_result

from lightning_varuna.pipeline.runtime.executor import SUMMARY_SIZE

# name -> strategy options (and batch per replica); the references train on batch 16 in one process
CONFIGS = {
    "p4-varuna": "pipeline_parallel_size=4,num_microbatches=4,schedule=varuna",
    "p4-varuna-norecompute": "pipeline_parallel_size=4,num_microbatches=4,schedule=varuna,recompute=false",
    "p4-1f1b": "pipeline_parallel_size=4,num_microbatches=8,schedule=1f1b",
    "p4-1f1b-norecompute-m3": "pipeline_parallel_size=4,num_microbatches=3,schedule=1f1b,recompute=false",
    "p4-gpipe-m5": "pipeline_parallel_size=4,num_microbatches=5,schedule=gpipe",
    "p4-gpipe-norecompute": "pipeline_parallel_size=4,num_microbatches=4,schedule=gpipe,recompute=false",
    "p4-varuna-cut_at": "pipeline_parallel_size=4,num_microbatches=4,cut_at=blocks",
    "p2-varuna": "pipeline_parallel_size=2,num_microbatches=4,batch=8",
    "p2-gpipe-norecompute": "pipeline_parallel_size=2,num_microbatches=4,schedule=gpipe,recompute=false,batch=8",
    "p2-1f1b-cut_at": "pipeline_parallel_size=2,num_microbatches=4,schedule=1f1b,cut_at=blocks,batch=8",
    # tied embedding/head + global clipping, as P x D = 2 x 2, 4 x 1 and 1 x 4 (plain data parallel)
    # (the model logs grad_norm(self, 2) in on_before_optimizer_step: the logged norms must be the whole model's)
    "tied-clip-p2d2": "pipeline_parallel_size=2,num_microbatches=4,batch=8,tie=true,clip=0.5,gradnorm=true",
    "tied-clip-p4d1": "pipeline_parallel_size=4,num_microbatches=4,tie=true,clip=0.5,gradnorm=true",
    "tied-clip-p1d4": "pipeline_parallel_size=1,num_microbatches=2,batch=4,tie=true,clip=0.5,gradnorm=true",
    # zero-bubble: buckets wait for the held-back weight gradients (small buckets: several per stage)
    "tied-clip-p2d2-zb": "pipeline_parallel_size=2,num_microbatches=4,batch=8,tie=true,clip=0.5,gradnorm=true,"
    "schedule=zero-bubble,recompute=false,bucket=4096,partition=params",
    "clipvalue-p2d2": "pipeline_parallel_size=2,num_microbatches=4,batch=8,tie=true,clip=0.002,clip_algorithm=value",
    # gradient accumulation with small buckets: every bucket reduces during the last backward of the window
    # (split by parameters: a split by measured time could leave a stage with too few weights for several buckets)
    "accum-p2d2": "pipeline_parallel_size=2,num_microbatches=4,batch=8,tie=true,clip=0.5,gradnorm=true,accumulate=2,"
    "bucket=4096,partition=params",
    # all-reduces started after the schedule (overlap off)
    "bf16-p2d2": "pipeline_parallel_size=2,num_microbatches=4,batch=8,tie=true,precision=bf16-mixed,overlap=false",
    # fp16 with a loss scaler; an inf injected into stage 0's gradients at step 2 must make every stage skip
    "fp16-inf-p2d2": "pipeline_parallel_size=2,num_microbatches=4,batch=8,tie=true,clip=0.5,precision=16-mixed,inf=2",
    # several model chunks per rank (interleaved 1F1B over the looped placement): P=4 with 8 blocks (the
    # wrap-around link), tied embedding + clipping at P=2 (one link each way carries both directions) with every
    # bucket reduced in the last backward of the stage that makes its gradients final
    "p4-il-l8": "pipeline_parallel_size=4,num_microbatches=8,schedule=interleaved,stages_per_rank=2,layers=8",
    "tied-clip-p2d2-il": "pipeline_parallel_size=2,num_microbatches=4,batch=8,tie=true,clip=0.5,gradnorm=true,"
    "schedule=interleaved,stages_per_rank=2,bucket=4096,partition=params",
    # zero-bubble over the looped placement: I/W split on ranks of two chunks (weights shared across a rank's
    # chunks final after the last W of either; every bucket released by the W that makes it final)
    "tied-clip-p2d2-lzb": "pipeline_parallel_size=2,num_microbatches=4,batch=8,tie=true,clip=0.5,gradnorm=true,"
    "schedule=zero-bubble,stages_per_rank=2,recompute=false,bucket=4096,partition=params",
    # the V schedule over the V-shaped placement: P=4 (rank 3's two stages hand over in memory; the first and last
    # stage on rank 0), tied embedding + clipping under P x D = 2 x 2 (the tied copies on one rank: one tensor)
    "p4-zbv-l8": "pipeline_parallel_size=4,num_microbatches=8,schedule=zero-bubble-v,stages_per_rank=2,layers=8",
    "tied-clip-p2d2-zbv": "pipeline_parallel_size=2,num_microbatches=4,batch=8,tie=true,clip=0.5,gradnorm=true,"
    "schedule=zero-bubble-v,stages_per_rank=2,recompute=false,bucket=4096,partition=params",
    # recompute by degree (each non-last stage recomputes its first segment, the rest keeps its graph) over the
    # V-shaped placement: forwards in the V schedule's order, each R(k) right before I(k) (rank 1's two stages hand
    # over in memory)
    "p2-zbv-rc1-l8": "pipeline_parallel_size=2,num_microbatches=4,batch=8,schedule=zero-bubble-v,stages_per_rank=2,"
    "recompute=1,layers=8,partition=params",
    # selective recompute: the recompute takes the matrix multiplies' outputs from the forward (a policy function
    # under zero-bubble at P=4; a list of ops in FULL_MATRIX, and in process in test_selective_recompute)
    "p4-zb-sac": "pipeline_parallel_size=4,num_microbatches=8,schedule=zero-bubble,policy=function",
}
FULL_MATRIX = {
    # what CI runs of several chunks per rank, recompute by degree and selective recompute, at the other P and
    # with recompute switched (test_side_values runs zero-bubble at P=4 with odd m in CI)
    "p4-zb-norecompute": "pipeline_parallel_size=4,num_microbatches=8,schedule=zero-bubble,recompute=false",
    "p4-zb-m5": "pipeline_parallel_size=4,num_microbatches=5,schedule=zero-bubble",
    "p2-il-norecompute": "pipeline_parallel_size=2,num_microbatches=4,schedule=interleaved,stages_per_rank=2,"
    "recompute=false,batch=8",
    "p4-lzb-l8": "pipeline_parallel_size=4,num_microbatches=8,schedule=zero-bubble,stages_per_rank=2,layers=8",
    "p2-rc1": "pipeline_parallel_size=2,num_microbatches=4,batch=8,recompute=1,partition=params",
    "tied-clip-p2d2-zb-rc1": "pipeline_parallel_size=2,num_microbatches=4,batch=8,tie=true,clip=0.5,gradnorm=true,"
    "schedule=zero-bubble,recompute=1,bucket=4096,partition=params",
    "tied-clip-p2d2-sac": "pipeline_parallel_size=2,num_microbatches=4,batch=8,tie=true,clip=0.5,gradnorm=true,"
    "schedule=1f1b,policy=list",
    # the P=2 cases of what CI runs at P=4 (varuna without recompute, odd m) and P=2 x D=2 (1f1b)
    "p2-varuna-norecompute-m3": "pipeline_parallel_size=2,num_microbatches=3,recompute=false,batch=8",
    "p2-1f1b": "pipeline_parallel_size=2,num_microbatches=2,schedule=1f1b,batch=8",
    "p4-varuna-sac": "pipeline_parallel_size=4,num_microbatches=4,policy=list",
    "p2-il-sac-l8": "pipeline_parallel_size=2,num_microbatches=4,batch=8,schedule=interleaved,stages_per_rank=2,"
    "layers=8,policy=function",
    "p4-zbv-sac-l8": "pipeline_parallel_size=4,num_microbatches=8,schedule=zero-bubble-v,stages_per_rank=2,layers=8,"
    "policy=list",
    "p2-il-m8": "pipeline_parallel_size=2,num_microbatches=8,schedule=interleaved,stages_per_rank=2,batch=8",
    "p4-il-norecompute-l8": "pipeline_parallel_size=4,num_microbatches=8,schedule=interleaved,stages_per_rank=2,"
    "recompute=false,layers=8",
    "p4-il-m4-l8": "pipeline_parallel_size=4,num_microbatches=4,schedule=interleaved,stages_per_rank=2,layers=8",
    "tied-clip-p2d2-il-norecompute": "pipeline_parallel_size=2,num_microbatches=4,batch=8,tie=true,clip=0.5,"
    "gradnorm=true,schedule=interleaved,stages_per_rank=2,recompute=false",
    "tied-clip-p4d1-il-l8": "pipeline_parallel_size=4,num_microbatches=4,tie=true,clip=0.5,gradnorm=true,layers=8,"
    "schedule=interleaved,stages_per_rank=2",
    "p2-lzb-m5": "pipeline_parallel_size=2,num_microbatches=5,schedule=zero-bubble,stages_per_rank=2,batch=8",
    "p4-lzb-norecompute-l8": "pipeline_parallel_size=4,num_microbatches=8,schedule=zero-bubble,stages_per_rank=2,"
    "recompute=false,layers=8",
    "tied-clip-p2d2-lzb-recompute": "pipeline_parallel_size=2,num_microbatches=4,batch=8,tie=true,clip=0.5,"
    "gradnorm=true,schedule=zero-bubble,stages_per_rank=2,bucket=4096,partition=params",
    "tied-clip-p4d1-lzb-l8": "pipeline_parallel_size=4,num_microbatches=4,tie=true,clip=0.5,gradnorm=true,layers=8,"
    "schedule=zero-bubble,stages_per_rank=2,recompute=false",
    "p4-1f1b-rc1-l8": "pipeline_parallel_size=4,num_microbatches=8,schedule=1f1b,recompute=1,layers=8,partition=params",
    "p2-il-rc1-l8": "pipeline_parallel_size=2,num_microbatches=4,batch=8,schedule=interleaved,stages_per_rank=2,"
    "recompute=1,layers=8,partition=params",
    "p2-lzb-rc1-l8": "pipeline_parallel_size=2,num_microbatches=4,batch=8,schedule=zero-bubble,stages_per_rank=2,"
    "recompute=1,layers=8,partition=params",
    "p2-zbv-m5": "pipeline_parallel_size=2,num_microbatches=5,schedule=zero-bubble-v,stages_per_rank=2,batch=8",
    "p4-zbv-norecompute-l8": "pipeline_parallel_size=4,num_microbatches=8,schedule=zero-bubble-v,stages_per_rank=2,"
    "recompute=false,layers=8",
    "tied-clip-p2d2-zbv-recompute": "pipeline_parallel_size=2,num_microbatches=4,batch=8,tie=true,clip=0.5,"
    "gradnorm=true,schedule=zero-bubble-v,stages_per_rank=2,bucket=4096,partition=params",
    "tied-clip-p4d1-zbv-l8": "pipeline_parallel_size=4,num_microbatches=4,tie=true,clip=0.5,gradnorm=true,layers=8,"
    "schedule=zero-bubble-v,stages_per_rank=2,recompute=false",
}


if wanted(part="SCHEDULES"):
    CONFIGS.update(FULL_MATRIX)
REFERENCES = {
    "reference": "",
    "reference-tied-clip": "tie=true,clip=0.5,gradnorm=true",
    "reference-clipvalue": "tie=true,clip=0.002,clip_algorithm=value",
    "reference-accum": "tie=true,clip=0.5,gradnorm=true,accumulate=2",
    "reference-bf16": "tie=true,precision=bf16-mixed",
    "reference-fp16-inf": "tie=true,clip=0.5,precision=16-mixed,inf=2",
    "reference-l8": "layers=8",
    "reference-tied-clip-l8": "tie=true,clip=0.5,gradnorm=true,layers=8",
}


def reference_of(name: str) -> str:
    if name.endswith("-l8"):
        return "reference-tied-clip-l8" if name.startswith("tied-clip") else "reference-l8"
    if name.startswith("tied-clip"):
        return "reference-tied-clip"
    if name.startswith("accum"):
        return "reference-accum"
    if name.startswith("bf16"):
        return "reference-bf16"
    if name.startswith("fp16"):
        return "reference-fp16-inf"
    if name.startswith("clipvalue"):
        return "reference-clipvalue"
    return "reference"


# fp32: tight. bf16: each micro-batch rounds separately, so sums differ in the last bf16 bits (measured:
# losses 7e-5, gradients 4.3e-4). fp16: gradients differ by fp16 rounding (measured 1e-5 on losses).
TOLERANCES = {"bf16": (1e-3, 2e-3), "fp16": (5e-4, 1e-2)}
LOSS_TOLERANCE = 5e-4
GRAD_TOLERANCE = 1e-5


# under pytest-xdist one worker runs all of this module's tests, so its module-scoped jobs run once
pytestmark = pytest.mark.xdist_group("equivalence")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("equivalence")
    python("equivalence.py", str(out), *(f"{name}:{options}" for name, options in REFERENCES.items()))
    job = torchrun("equivalence.py", str(out), *(f"{name}:{options}" for name, options in CONFIGS.items()),
                   timeout=900)
    # every training step of every pipelined configuration was replayed under NCCL's rules (P=1 posts nothing)
    assert job.p2p_steps >= 8 * sum("pipeline_parallel_size=1," not in options for options in CONFIGS.values())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_losses_and_gradients_match_plain_run(results: Path, name: str) -> None:
    reference = rank_result(results, reference_of(name))
    loss_tolerance, grad_tolerance = TOLERANCES.get(name.split("-")[0], (LOSS_TOLERANCE, GRAD_TOLERANCE))
    seen: set[str] = set()
    for rank in range(4):
        run = rank_result(results, f"{name}", rank)
        assert len(run["losses"]) == len(reference["losses"]) == 8 * (2 if name.startswith("accum") else 1)
        for step, (got, want) in enumerate(zip(run["losses"], reference["losses"])):
            assert abs(got - want) < loss_tolerance, f"rank {rank} step {step}: loss {got} != {want}"
        for param, grad in run["grads"].items():
            want = reference["grads"][param]
            worst = max(abs(a - b) for a, b in zip(grad, want))
            assert worst < grad_tolerance, f"rank {rank}: gradient of {param} differs by {worst}"
            seen.add(param)
    assert seen == set(reference["grads"]), "every parameter is held (and checked) on some stage"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_copy_of_a_parameter_is_identical(results: Path, name: str) -> None:
    """Replicas of a stage, and tied copies on different stages, stay bit-identical after 8 steps."""
    copies: dict[str, list] = {}
    for rank in range(4):
        for param, values in rank_result(results, f"{name}", rank)["final"].items():
            copies.setdefault(param, []).append((rank, values))
    for param, held in copies.items():
        first_rank, first = held[0]
        for rank, values in held[1:]:
            assert values == first, f"{param} differs between rank {first_rank} and rank {rank}"
    if "tied" in name and "p1" not in name and "zbv" not in name:
        assert len(copies["wte.weight"]) >= 2, "the tied embedding is held by the first and the last stage"
    if "tied" in name and "zbv" in name:  # V-shaped: the first and the last stage on one rank, one tensor there
        assert len(copies["wte.weight"]) == int(name.split("-p")[1][2]), "one copy per replica"


@pytest.mark.slow
def test_fp16_overflow_on_one_stage_is_skipped_everywhere(results: Path) -> None:
    reference = rank_result(results, "reference-fp16-inf")
    for rank in range(4):
        run = rank_result(results, "fp16-inf-p2d2", rank)
        assert run["scale"] == reference["scale"] == 2.0**15, "every rank halved the scale once"


@pytest.mark.slow
@pytest.mark.parametrize(("name", "element_bytes"), [("p2-varuna", 4), ("bf16-p2d2", 2)])
def test_bytes_on_the_wire_match_the_analytic_count(results: Path, name: str, element_bytes: int) -> None:
    """P=2, per-replica batch 8 x 16 tokens x 32 channels: one activation and one gradient per sample and step.

    Under bf16-mixed the boundary tensors travel as bfloat16: half the bytes of float32.
    """
    header = 10 * 8  # shape and dtype of a step's activations, once per step, forward
    summary = SUMMARY_SIZE * 8  # the step's loss and logged values, once per step, backward
    per_step = 8 * 16 * 32 * element_bytes
    for rank in range(4):
        run = rank_result(results, f"{name}", rank)
        expected = 8 * (per_step + header) if run["stage"] == 0 else 8 * (per_step + summary)
        assert run["sent_bytes"] == expected, f"rank {rank} (stage {run['stage']})"


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in CONFIGS if "gradnorm=true" in CONFIGS[n]])
def test_logged_grad_norms_are_the_whole_models(results: Path, name: str) -> None:
    """``grad_norm`` logged in on_before_optimizer_step reaches callback_metrics with the plain run's keys and values
    on every rank: every stage's parameters (a tied one once) and the total over the whole model."""
    reference = rank_result(results, reference_of(name))["logged_norms"]
    assert any("grad_2.0_norm_total" in step for step in reference)
    for rank in range(4):
        logged = rank_result(results, f"{name}", rank)["logged_norms"]
        assert len(logged) == len(reference)
        for step, (got, want) in enumerate(zip(logged, reference)):
            assert set(got) == set(want), f"rank {rank} step {step}: keys differ by {set(got) ^ set(want)}"
            for key, value in want.items():
                assert abs(got[key] - value) <= 1e-5 * max(1.0, value), f"rank {rank} step {step}: {key}"


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in CONFIGS if "clip=" in CONFIGS[n] and "accumulate" not in CONFIGS[n]])
def test_gradients_are_clipped_as_in_the_plain_run(results: Path, name: str) -> None:
    """The gradients after clipping (first step; by the whole model's norm, or by value) equal the plain run's.

    AdamW hardly reacts to a constant factor on every gradient, so a wrong global norm would barely show in the
    losses: this checks the clipped gradients themselves (under fp16 the norm comes with the overflow agreement).
    """
    plain = rank_result(results, reference_of(name))
    reference = plain["clipped_norms"][0]
    relative = 2e-2 if name.startswith("fp16") else 1e-4
    seen = {}
    for rank in range(4):
        seen.update(rank_result(results, f"{name}", rank)["clipped_norms"][0])
    assert set(seen) == set(reference)
    before = plain["grad_norms"][0]
    assert any(abs(reference[p] - before[p]) > 1e-3 * before[p] for p in reference), "clipping is active"
    if "value" not in CONFIGS[name]:
        assert sum(v * v for v in reference.values()) ** 0.5 == pytest.approx(0.5, rel=1e-3)
    for param, value in reference.items():
        assert seen[param] == pytest.approx(value, rel=relative, abs=1e-7), param


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in CONFIGS if "p2d2" in n or "p1d4" in n])
def test_buckets_reduce_during_the_last_backward(results: Path, name: str) -> None:
    """With overlap on, every data-parallel bucket starts its all-reduce during the stage's last backward."""
    overlap = "overlap=false" not in CONFIGS[name]
    for rank in range(4):
        run = rank_result(results, f"{name}", rank)
        assert run["data_size"] > 1 and run["overlapped"]
        if name.startswith("accum") or name.endswith(("-zb", "-il", "-lzb", "-lzb-recompute", "-zb-rc1", "-zbv",
                                                      "-zbv-recompute")):
            assert run["buckets"] > 2, "bucket=4096 makes several buckets per stage"
        expected = run["buckets"] if overlap else 0
        assert run["overlapped"] == [expected] * len(run["overlapped"]), f"rank {rank}"
