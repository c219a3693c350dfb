"""Side values: values made from parameters in one stage and used by later stages other than through a cut point.

``SideValueGPT`` makes a learned position bias and a gate (scaling with the batch) before its first block and passes
both to every block as keyword arguments (as T5 passes its relative position bias). At P=4 they travel from stage
0 through every later stage with the activations, and their gradients come back: the pipelined run's losses and
step-1 gradients equal the plain run's, with recompute and without, under several schedules, with uneven
micro-batches, with several stages per rank (looped and V-shaped), and recomputed by degree where stage 0
makes the values in its recomputed segment and uses them in its kept ones. Every pipelined step is replayed
under NCCL's rules. The two-chunk placements without recompute, recompute by degree with one chunk per rank and
selective recompute run with ``VARUNA_SCHEDULES=full``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.launch import python, torchrun
from helpers.on_demand import wanted
from helpers.results import rank_result

from lightning_varuna.pipeline.model.data_flow import CallSite, SideValue
from lightning_varuna.pipeline.runtime.side_values import pack, side_values_sent, unpack

SIDE = "side=true,partition=params"
CONFIGS = {
    "p4-varuna": f"pipeline_parallel_size=4,num_microbatches=4,{SIDE}",
    "p4-varuna-norecompute-m3": f"pipeline_parallel_size=4,num_microbatches=3,recompute=false,{SIDE}",
    "p4-zb-m5": f"pipeline_parallel_size=4,num_microbatches=5,schedule=zero-bubble,{SIDE}",
    "p4-1f1b-cut_at": f"pipeline_parallel_size=4,num_microbatches=8,schedule=1f1b,cut_at=blocks,{SIDE}",
    "p2d2-il": f"pipeline_parallel_size=2,num_microbatches=4,schedule=interleaved,stages_per_rank=2,batch=8,{SIDE}",
    # the V-shaped placement: rank 1 holds stages 1 and 2, so the side values cross their edge in memory (with the
    # activation) and their gradients come back the same way
    "p2d2-zbv": f"pipeline_parallel_size=2,num_microbatches=4,schedule=zero-bubble-v,stages_per_rank=2,batch=8,{SIDE}",
    # recompute by degree where stage 0 makes both values in its recomputed segment and uses them after it
    "p2d2-lzb-rc1-l8": "pipeline_parallel_size=2,num_microbatches=4,schedule=zero-bubble,stages_per_rank=2,"
    f"recompute=1,batch=8,layers=8,{SIDE}",
}
if wanted(part="SCHEDULES"):  # the two-chunk placements without recompute (CI runs them with it) and more
    CONFIGS.update({
        "p2d2-rc1": f"pipeline_parallel_size=2,num_microbatches=4,recompute=1,batch=8,{SIDE}",
        # selective recompute: side values received in the forward and taken again by the recompute, which replays
        # the forward's matrix multiplies
        "p4-1f1b-sac": f"pipeline_parallel_size=4,num_microbatches=4,schedule=1f1b,policy=list,{SIDE}",
        "p2d2-lzb-norecompute": "pipeline_parallel_size=2,num_microbatches=4,schedule=zero-bubble,stages_per_rank=2,"
        f"recompute=false,batch=8,{SIDE}",
        "p2d2-zbv-norecompute": "pipeline_parallel_size=2,num_microbatches=4,schedule=zero-bubble-v,"
        f"stages_per_rank=2,recompute=false,batch=8,{SIDE}",
    })
LOSS_TOLERANCE = 5e-4
GRAD_TOLERANCE = 1e-5

pytestmark = pytest.mark.xdist_group("side_values")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("side_values")
    python("equivalence.py", str(out), "reference:side=true", "reference-l8:side=true,layers=8")
    job = torchrun("equivalence.py", str(out), *(f"{name}:{options}" for name, options in CONFIGS.items()),
                   timeout=900)
    assert job.p2p_steps >= 8 * len(CONFIGS)  # every step of every configuration replayed under NCCL's rules
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_side_values_train_like_the_plain_run(results: Path, name: str) -> None:
    reference = rank_result(results, "reference-l8" if name.endswith("-l8") else "reference")
    seen: set[str] = set()
    for rank in range(4):
        run = rank_result(results, f"{name}", rank)
        assert len(run["losses"]) == len(reference["losses"]) == 8
        for step, (got, want) in enumerate(zip(run["losses"], reference["losses"])):
            assert abs(got - want) < LOSS_TOLERANCE, f"rank {rank} step {step}: loss {got} != {want}"
        for param, grad in run["grads"].items():
            worst = max(abs(a - b) for a, b in zip(grad, reference["grads"][param]))
            assert worst < GRAD_TOLERANCE, f"rank {rank}: gradient of {param} differs by {worst}"
            seen.add(param)
    assert seen == set(reference["grads"]), "every parameter is held (and checked) on some stage"
    if "-rc" in name:  # the case this configuration is for arises: stage 0 keeps both values as leaves
        assert max(rank_result(results, f"{name}", rank)["sides_kept"] for rank in range(4)) == 2
    # the side values' producers get gradients from every block (the later stages' come back through the pipeline)
    for param in ("position_bias.table", "gate.weight"):
        assert max(abs(g) for g in reference["grads"][param]) > 1e-4


def _value(producer: int, *consumers: int, batch_dim: int | None = None) -> SideValue:
    return SideValue(CallSite("made", producer, 0, 0), tuple(CallSite("used", c, 0, 0) for c in consumers),
                     (2, 3), torch.float32, batch_dim, "a value")


def test_each_boundary_carries_the_values_made_before_it_and_used_after_it() -> None:
    made_in_0 = _value(0, 1, 3)
    made_in_1 = _value(1, 2)
    made_and_used_in_2 = _value(2, 2)
    stages = [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    assert side_values_sent([made_in_0, made_in_1, made_and_used_in_2], stages) == [
        (made_in_0,), (made_in_0, made_in_1), (made_in_0,), ()]


def test_a_packed_message_holds_every_dtype_at_aligned_offsets() -> None:
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.tensor([True, False, True]),
               torch.randn(2, 2, dtype=torch.bfloat16)]
    specs = [(t.shape, t.dtype) for t in tensors]
    packed = pack(tensors, specs)
    assert packed.dtype == torch.uint8 and packed.numel() == 64 + 64 + 16 + 16
    for got, want in zip(unpack(packed, specs), tensors):
        assert got.dtype == want.dtype and torch.equal(got, want)
