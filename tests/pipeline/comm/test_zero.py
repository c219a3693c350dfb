"""``zero_stage=1``: the optimizer state sharded over the replicas trains exactly as the plain run, in 1/D the bytes.

The jobs run ``tests/jobs/equivalence.py`` (TinyGPT with a tied embedding and head, global-norm clipping, a step
scheduler) against the plain single-process run on the same data. With sharding, a replica's ``.grad`` after the
sync holds its rows of the averaged gradient and zeros elsewhere, so the replicas' recorded gradients add up to the
whole gradient. One configuration is preempted (a SIGTERM to one rank) and resumed under another shape. The
widest cases (P=2 x D=4 on 8 processes, the resume on 2 processes) run with
``VARUNA_ZERO=full`` or ``-m zero_full``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.launch import python, torchrun
from helpers.on_demand import wanted
from helpers.results import rank_result

from lightning_varuna import VarunaStrategy
from lightning_varuna.checkpoint import is_complete
from lightning_varuna.checkpoint.storage import META
from lightning_varuna.pipeline.comm.sharded_step import ELEMENTWISE, check_elementwise
from lightning_varuna.pipeline.comm.sharded_sync import shard_rows

P2D2 = "pipeline_parallel_size=2,num_microbatches=4,batch=8"
# the embedding is most of the parameters; stages split by parameter count, not by measured time, so that the
# sharded and the whole run split alike and their per-rank state compares
ADAMW = "tie=true,clip=0.5,gradnorm=true,vocab=512,partition=params"
REFERENCES = {
    "reference-adamw": ADAMW,
    "reference-sgd-accum": "tie=true,clip=0.5,optimizer=sgd,accumulate=2",
    "reference-groups-fp16": "tie=true,clip=0.5,optimizer=groups,precision=16-mixed,inf=2",
}
# fp16 with a loss scaler: an inf injected into stage 0's gradients at step 2 must make every rank skip the step
TOLERANCES = {"fp16": (5e-4, 1e-2, 1e-2)}
LOSS_TOLERANCE, GRAD_TOLERANCE, PARAM_TOLERANCE = 5e-4, 1e-5, 2e-5


def _full(request: pytest.FixtureRequest) -> bool:
    return wanted(request.config, "ZERO", marker="zero_full")


def configs(ckpt: Path) -> dict[str, str]:
    """The 4-process configurations, run in this order; ``z1-adamw`` keeps its checkpoints of steps 4 and 8 in
    ``ckpt``, and the ``r*`` ones at the end resume checkpoints written before them in the same job."""
    return {
        # global_batch_size: a resume under D=1 reads the same 16 samples per step
        "z1-adamw": f"{P2D2},{ADAMW},zero_stage=1,global_batch_size=16,save_every=4,save_all=true,save_dir={ckpt},"
        "count_wire=true",
        "z0-adamw": f"{P2D2},{ADAMW},zero_stage=0,count_wire=true",
        # the sharded state handed to the background writer (test_async_sharded_checkpoint_resumes_elsewhere)
        "z1-adamw-async": f"{P2D2},{ADAMW},zero_stage=1,global_batch_size=16,async_checkpoint=true,save_every=4,"
        f"save_all=true,save_dir={ckpt}/async",
        # two model chunks per rank (interleaved): the sharding covers both chunks' parameters, the tied copies
        # on chunks of different ranks; small buckets, each reduce-scattered by the chunk that makes it final
        "z1-adamw-il": f"{P2D2},{ADAMW},zero_stage=1,schedule=interleaved,stages_per_rank=2,bucket=4096,"
        f"global_batch_size=16,save_every=4,save_all=true,save_dir={ckpt}/il",
        # two chunks per rank placed in a V (rank 0 holds the first and the last): the tied copies on one rank
        "z1-adamw-zbv": f"{P2D2},{ADAMW},zero_stage=1,schedule=zero-bubble-v,stages_per_rank=2",
        # rank 2 warned with SIGTERM as step 3 starts: every rank stops after it with last.ckpt of step 3
        "z1-adamw-preempt": f"{P2D2},{ADAMW},zero_stage=1,global_batch_size=16,preempt=2:2,save_every=100,"
        f"save_dir={ckpt}/preempt",
        # small buckets: several reduce-scatters during the window's last backward
        "z1-sgd-accum": f"{P2D2},tie=true,clip=0.5,optimizer=sgd,accumulate=2,bucket=4096,partition=params,"
        "zero_stage=1",
        "z1-groups-fp16": f"{P2D2},tie=true,clip=0.5,optimizer=groups,precision=16-mixed,inf=2,zero_stage=1",
        # written without sharding under P=4 x D=1, resumed with it (test_resume_across_zero_stages)
        "z0-adamw-p4d1": f"pipeline_parallel_size=4,num_microbatches=4,{ADAMW},global_batch_size=16,steps=4,"
        f"save_every=4,save_dir={ckpt}/p4d1",
        # resumed from the checkpoints written above (test_preempted_sharded_job_resumes_on_the_plain_trajectory,
        # test_resume_across_chunks_per_rank)
        "r0-p4d1-preempt-adamw": f"pipeline_parallel_size=4,num_microbatches=4,{ADAMW},global_batch_size=16,"
        f"resume={ckpt}/preempt/last.ckpt",
        "r1-zb2-adamw": f"{P2D2},{ADAMW},zero_stage=1,schedule=zero-bubble,stages_per_rank=2,global_batch_size=16,"
        f"resume={ckpt}/ckpt-step=4.ckpt",
        "r1-from-il-adamw": f"{P2D2},{ADAMW},zero_stage=1,global_batch_size=16,resume={ckpt}/il/ckpt-step=4.ckpt",
    }


def reference_of(name: str) -> str:
    return next(r for r in REFERENCES if r.split("-", 1)[1] in name)


pytestmark = pytest.mark.xdist_group("zero")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("zero")
    python("equivalence.py", str(out), *(f"{n}:{o}" for n, o in REFERENCES.items()))
    job = torchrun("equivalence.py", str(out), *(f"{n}:{o}" for n, o in configs(out / "ckpt").items()), timeout=600)
    assert job.p2p_steps >= 8 * 4
    return out


def check_against_reference(directory: Path, name: str, ranks: int, steps: slice = slice(None),
                            final: bool = True) -> None:
    """Losses, step-1 gradients summed over each stage's replicas, logged norms and (``final``: a run that reached
    the last step) final weights: the plain run's."""
    reference = rank_result(directory, reference_of(name), 0)
    loss_tol, grad_tol, param_tol = TOLERANCES.get(name.split("-")[-1], (LOSS_TOLERANCE, GRAD_TOLERANCE,
                                                                           PARAM_TOLERANCE))
    runs = [rank_result(directory, name, rank) for rank in range(ranks)]
    sharded = name.startswith(("z1", "r1"))
    summed: dict[tuple[int, str], torch.Tensor] = {}
    for rank, run in enumerate(runs):
        want = reference["losses"][steps]
        assert run["losses"] == pytest.approx(want, abs=loss_tol), f"{name} rank {rank}: losses"
        for param, grad in run["grads"].items():
            key = (run["stage"] if sharded else rank, param)  # unsharded: every replica holds the whole gradient
            summed[key] = summed.get(key, torch.zeros(len(grad), dtype=torch.float64)) + torch.tensor(grad)
        for got, expected in zip(run["logged_norms"], reference["logged_norms"][steps]):
            assert got == pytest.approx(expected, rel=1e-4, abs=1e-6), f"{name} rank {rank}: logged norms"
        for param, values in run["final"].items() if final else ():
            worst = (torch.tensor(values) - torch.tensor(reference["final"][param])).abs().max().item()
            assert worst < param_tol, f"{name} rank {rank}: {param} ends {worst} away from the plain run's"
    for (where, param), grad in summed.items():  # with sharding, each replica holds its rows of the gradient
        worst = (grad - torch.tensor(reference["grads"][param], dtype=torch.float64)).abs().max().item()
        assert worst < grad_tol, f"{name} ({'stage' if sharded else 'rank'} {where}): {param}'s gradient differs"
    recorded = {param for _, param in summed}
    if (steps.start or 0) == 0:  # the run took step 1, whose gradients the job records: every parameter's
        assert recorded, f"{name}: no gradient was recorded"
        assert recorded == set(reference["grads"]), f"{name}: gradients of {recorded ^ set(reference['grads'])}"
    else:  # a run resumed after step 1 records none
        assert not recorded or recorded == set(reference["grads"])


def check_copies_identical(directory: Path, name: str, ranks: int) -> None:
    """Replicas of a stage, and the tied copies on different stages, end bit-identical."""
    held: dict[str, list] = {}
    for rank in range(ranks):
        for param, values in rank_result(directory, name, rank)["final"].items():
            held.setdefault(param, []).append(values)
    for param, copies in held.items():
        assert all(c == copies[0] for c in copies), f"{name}: the copies of {param} differ"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["z1-adamw", "z0-adamw", "z1-adamw-async", "z1-adamw-il", "z1-adamw-zbv",
                                  "z1-sgd-accum", "z1-groups-fp16"])
def test_sharded_optimizer_trains_as_the_plain_run(results: Path, name: str) -> None:
    check_against_reference(results, name, 4)
    check_copies_identical(results, name, 4)


@pytest.mark.slow
def test_each_rank_keeps_about_half_the_optimizer_state_at_d2(results: Path) -> None:
    sharded = [rank_result(results, "z1-adamw", rank)["state_bytes"] for rank in range(4)]
    whole = [rank_result(results, "z0-adamw", rank)["state_bytes"] for rank in range(4)]
    ratio = max(sharded) / max(whole)
    print(f"\noptimizer state bytes per rank: zero_stage=1 {sharded}, zero_stage=0 {whole}: {ratio:.3f}x")
    assert 0.4 < ratio <= 0.6
    # two chunks per rank: each replica keeps half of its two chunks' state
    chunks = [rank_result(results, "z1-adamw-il", rank)["state_bytes"] for rank in range(4)]
    print(f"with two chunks per rank: {chunks}: {max(chunks) / max(whole):.3f}x")
    assert 0.4 < max(chunks) / max(whole) <= 0.6


@pytest.mark.slow
def test_each_rank_holds_fewer_tensor_bytes_at_d2(results: Path) -> None:
    """Parameters, optimizer state and the sync's peak (``.grad`` plus its buffers), the largest rank: at D=2 AdamW's
    state halves (2 of 4 parameter-sized tensors on top of weights and gradients: 3/4 of the bytes) and the sync
    holds no full-size copy beyond the gradients, so the sharded rank holds at most 0.8x the unsharded one's."""

    def held(name: str, rank: int) -> int:
        run = rank_result(results, name, rank)
        return run["param_bytes"] + run["state_bytes"] + max(run["sync_peak_bytes"])

    sharded = max(held("z1-adamw", rank) for rank in range(4))
    whole = max(held("z0-adamw", rank) for rank in range(4))
    parts = {name: {k: rank_result(results, name)[k] for k in ("param_bytes", "state_bytes")}
             | {"sync_peak": max(rank_result(results, name)["sync_peak_bytes"])} for name in ("z1-adamw", "z0-adamw")}
    print(f"\ntensor bytes per rank (max): zero_stage=1 {sharded}, zero_stage=0 {whole}: {sharded / whole:.3f}x;"
          f" rank 0: {parts}")
    assert sharded / whole <= 0.8


@pytest.mark.slow
def test_sharded_sync_sends_no_more_than_the_all_reduce(results: Path) -> None:
    """Bytes each rank sends per step on the data-parallel group, counted at the torch.distributed calls the sync
    makes: the sharded run's reduce-scatter and all-gather together at most the unsharded run's all-reduce (plus
    the padding of uneven row shards, 2%)."""
    for rank in range(4):
        sharded, whole = rank_result(results, "z1-adamw", rank), rank_result(results, "z0-adamw", rank)
        per_step = {name: sum(run["wire_bytes"].values()) / run["wire_steps"] for name, run in
                    (("z1", sharded), ("z0", whole))}
        print(f"rank {rank}: sent per step {per_step}, by call {sharded['wire_bytes']} vs {whole['wire_bytes']}")
        assert "reduce_scatter_tensor" not in sharded["wire_bytes"], "gloo's reduce-scatter sends an all-reduce"
        assert 0 < per_step["z1"] <= 1.02 * per_step["z0"], f"rank {rank}: {per_step}"


@pytest.mark.slow
def test_resume_across_zero_stages(results: Path) -> None:
    """Written with zero_stage=1 at P=2 x D=2, resumed with 0 at P=4 x D=1; written with 0 at P=4 x D=1, resumed
    with 1 at P=2 x D=2: both continue the uninterrupted (plain) run's trajectory."""
    sharded_ckpt = results / "ckpt" / "ckpt-step=4.ckpt"
    plain_ckpt = results / "ckpt" / "p4d1" / "ckpt.ckpt"
    torchrun("equivalence.py", str(results),
             f"r0-p4d1-adamw:pipeline_parallel_size=4,num_microbatches=4,{ADAMW},global_batch_size=16,"
             f"resume={sharded_ckpt}",
             f"r1-p2d2-adamw:{P2D2},{ADAMW},zero_stage=1,global_batch_size=16,resume={plain_ckpt}", timeout=400)
    for name in ("r0-p4d1-adamw", "r1-p2d2-adamw"):
        runs = [rank_result(results, name, rank) for rank in range(4)]
        assert all(len(run["losses"]) == 4 for run in runs), name
        check_against_reference(results, name, 4, slice(4, 8))


@pytest.mark.slow
def test_preempted_sharded_job_resumes_on_the_plain_trajectory(results: Path) -> None:
    """A P=2 x D=2 job with zero_stage=1 warned with SIGTERM on one rank stops on every rank after the step under way,
    with its checkpoint; resumed with zero_stage=0 at P=4 x D=1 it continues the uninterrupted (plain) trajectory."""
    ckpt = results / "ckpt" / "preempt" / "last.ckpt"
    assert is_complete(ckpt) and torch.load(ckpt / META, weights_only=False)["global_step"] == 3
    runs = [rank_result(results, "z1-adamw-preempt", rank) for rank in range(4)]
    assert all(run["preempted_at"] == 3 and len(run["losses"]) == 3 for run in runs)
    check_against_reference(results, "z1-adamw-preempt", 4, slice(0, 3), final=False)
    check_copies_identical(results, "z1-adamw-preempt", 4)
    resumed = [rank_result(results, "r0-p4d1-preempt-adamw", rank) for rank in range(4)]
    assert all(len(run["losses"]) == 5 for run in resumed)
    check_against_reference(results, "r0-p4d1-preempt-adamw", 4, slice(3, 8))


@pytest.mark.slow
@pytest.mark.parametrize(("name", "chunks"), [("r1-zb2-adamw", 2), ("r1-from-il-adamw", 1)])
def test_resume_across_chunks_per_rank(results: Path, name: str, chunks: int) -> None:
    """Written with zero_stage=1 and one chunk per rank, resumed with two (zero-bubble); written with two chunks per
    rank (interleaved), resumed with one: both continue the uninterrupted (plain) run's trajectory."""
    runs = [rank_result(results, name, rank) for rank in range(4)]
    assert all(len(run["losses"]) == 4 and run["config"]["stages_per_rank"] == chunks for run in runs)
    check_against_reference(results, name, 4, slice(4, 8))
    check_copies_identical(results, name, 4)


@pytest.mark.slow
def test_async_sharded_checkpoint_resumes_elsewhere(results: Path) -> None:
    """Written by the background writer with zero_stage=1 at P=2 x D=2 (each replica's shard of the AdamW state,
    checksummed per shard), resumed with zero_stage=0 at P=2 x D=1: the uninterrupted (plain) run's trajectory."""
    ckpt = results / "ckpt" / "async" / "ckpt-step=4.ckpt"
    record = torch.load(ckpt / "record.pt", weights_only=False)
    shard_keys = [key for key in record["checksums"]["items"] if key.startswith("optimizer_0.state.") and "@" in key]
    assert shard_keys, "no per-shard checksum of the sharded optimizer state"
    torchrun("equivalence.py", str(results), f"r0-p2d1-async-adamw:{P2D2.replace('batch=8', 'batch=16')},{ADAMW},"
             f"global_batch_size=16,resume={ckpt}", nproc=2, timeout=400)
    runs = [rank_result(results, "r0-p2d1-async-adamw", rank) for rank in range(2)]
    assert all(len(run["losses"]) == 4 for run in runs)
    check_against_reference(results, "r0-p2d1-async-adamw", 2, slice(4, 8))


@pytest.mark.slow
@pytest.mark.zero_full
def test_p2d4_sharded_trains_as_the_plain_run_in_a_quarter_of_the_state(
    request: pytest.FixtureRequest, results: Path
) -> None:
    if not _full(request):
        pytest.skip("8 processes: VARUNA_ZERO=full or -m zero_full")
    p2d4 = "pipeline_parallel_size=2,num_microbatches=4,batch=4"
    torchrun("equivalence.py", str(results), f"z1-p2d4-adamw:{p2d4},{ADAMW},zero_stage=1",
             f"z0-p2d4-adamw:{p2d4},{ADAMW},zero_stage=0", nproc=8, timeout=900)
    check_against_reference(results, "z1-p2d4-adamw", 8)
    check_copies_identical(results, "z1-p2d4-adamw", 8)
    sharded = max(rank_result(results, "z1-p2d4-adamw", rank)["state_bytes"] for rank in range(8))
    whole = max(rank_result(results, "z0-p2d4-adamw", rank)["state_bytes"] for rank in range(8))
    assert sharded / whole <= 0.35
    # and the sharded checkpoint of P=2 x D=2 resumed on two processes (P=2 x D=1)
    ckpt = results / "ckpt" / "ckpt-step=4.ckpt"
    torchrun("equivalence.py", str(results), f"r0-p2d1-adamw:{P2D2.replace('batch=8', 'batch=16')},{ADAMW},"
             f"global_batch_size=16,resume={ckpt}", nproc=2, timeout=400)
    check_against_reference(results, "r0-p2d1-adamw", 2, slice(4, 8))


# -- in one process ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_stages_2_and_3_are_refused_with_the_reason(stage: int) -> None:
    with pytest.raises(ValueError, match=f"zero_stage={stage} is not possible in a pipeline: inside a step each"
                                         " stage's gradients add up over the micro-batches.*Use zero_stage=1"):
        VarunaStrategy(zero_stage=stage)


def test_bad_zero_stage_values_are_refused() -> None:
    with pytest.raises(ValueError, match="zero_stage must be 0 or 1, got 4"):
        VarunaStrategy(zero_stage=4)


def test_optimizers_that_mix_elements_are_refused_naming_them() -> None:
    params = [torch.nn.Parameter(torch.zeros(4, 3))]
    with pytest.raises(ValueError, match="zero_stage=1 cannot shard LBFGS: its line search"):
        check_elementwise(torch.optim.LBFGS(params))
    with pytest.raises(ValueError, match="zero_stage=1 cannot shard Adafactor: its factored second moment"):
        check_elementwise(torch.optim.Adafactor(params))
    for cls in ELEMENTWISE:
        check_elementwise(cls(params, lr=0.1))


def test_rows_are_split_as_dtensor_splits_them() -> None:
    # DTensor's Shard(0) follows torch.chunk: ceil(rows / D) rows per shard, the last shards shorter or empty
    for rows in range(0, 10):
        for shards in range(1, 5):
            param = torch.zeros(rows, 3)
            chunks = list(torch.arange(rows).chunk(shards)) if rows else []
            for index in range(shards):
                start, stop = shard_rows(param, shards, index)
                expected = chunks[index].tolist() if index < len(chunks) else []
                assert list(range(start // 3, stop // 3)) == expected, (rows, shards, index)
    assert shard_rows(torch.zeros(()), 2, 0) == (0, 1) and shard_rows(torch.zeros(()), 2, 1) == (1, 1)


def test_a_non_elementwise_optimizer_is_refused_at_setup() -> None:
    import lightning.pytorch as pl
    from helpers.models import RandomTokens, TinyGPT
    from torch.utils.data import DataLoader

    class WithLBFGS(TinyGPT):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters())

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         strategy=VarunaStrategy(pipeline_parallel_size=1, zero_stage=1))
    with pytest.raises(ValueError, match="zero_stage=1 cannot shard LBFGS"):
        trainer.fit(WithLBFGS(), DataLoader(RandomTokens(n=8), batch_size=4))
