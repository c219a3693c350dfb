"""The engine and the strategy on CUDA, each against the plain run on the same device. Skipped without CUDA.

Run as is on a GPU machine: ``bash tests/gpu/run.sh``. With one GPU: the compute path on CUDA (recompute replaying
the forward's CUDA RNG, bf16 autocast with bfloat16 on the wire, ``torch.cuda.max_memory_allocated``, linear layers'
gradients accumulated in place against autograd's), P=1 under
Lightning, and P=2 with two processes sharing the GPU over gloo (``p2p_backend="gloo"``: pinned host staging),
engine-level and under Lightning. With two or more GPUs, NCCL point-to-point too (P=2, and P=2 x D=2 with four), and
``benchmarks/real_schedules.py``'s comparison of torch's schedules with ours (losses equal, its table printed).
Every job also runs in the NCCL-rules mode (``launch.py``), so its p2p order is replayed as well.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.launch import python, torchrun
from helpers.results import rank_result, rank_results

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="needs a CUDA device"),
              pytest.mark.xdist_group("gpu")]

# fp32 on a GPU: micro-batched matrix products and summed micro-batch gradients round differently from the full
# batch's (different kernels and summation order), well below these
FP32 = {"rtol": 1e-4, "atol": 1e-5}
BF16 = {"rtol": 3e-2, "atol": 2e-3}


def _close(got: list[float], want: list[float], what: str, tolerance: dict) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), msg=lambda m: f"{what}: {m}", **tolerance)


def _check_against_plain(runs: list[dict], config: str, tolerance: dict) -> None:
    """Every stage's gradients equal the plain run's; the replicas' mean loss equals the plain loss."""
    replicas = {run[config]["replica"] for run in runs}
    for run in runs:
        record = run[config]
        for name, grad in record["grads"].items():
            _close(grad, record["plain_grads"][name], f"{config} stage {record['stage']} {name}", tolerance)
    for stage in {run[config]["stage"] for run in runs}:
        losses = [run[config]["losses"] for run in runs if run[config]["stage"] == stage]
        mean = [sum(step) / len(replicas) for step in zip(*losses)]
        _close(mean, runs[0][config]["plain_losses"], f"{config} losses on stage {stage}", tolerance)


def _check_engine(runs: list[dict]) -> None:
    _check_against_plain(runs, "fp32", FP32)
    _check_against_plain(runs, "bf16", BF16)
    for run in runs:
        rc, plain = run["dropout-recompute"], run["dropout-plain"]
        # the recompute replayed the forward's CUDA RNG state: the same dropout masks, the same training
        _close(rc["losses"], plain["losses"], f"dropout losses, stage {rc['stage']}", FP32)
        for name, grad in rc["grads"].items():
            _close(grad, plain["grads"][name], f"dropout gradient {name}", FP32)
        assert rc["losses"] != run["fp32"]["losses"], "dropout acted"


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpu-shared")
    torchrun("gpu_engine.py", str(out), "shared", nproc=2, timeout=400)
    return out


def test_two_processes_share_one_gpu_over_gloo_and_train_as_the_plain_run(shared: Path) -> None:
    runs = rank_results(shared, "shared", 2)
    assert {run["fp32"]["device"] for run in runs} == {"cuda:0"}
    _check_engine(runs)


def test_recompute_lowers_a_stages_peak_cuda_memory(shared: Path) -> None:
    first = next(run for run in rank_results(shared, "shared", 2) if run["fp32"]["stage"] == 0)
    recompute, gpipe = first["memory-recompute"]["peak_bytes"], first["memory-gpipe"]["peak_bytes"]
    print(f"\nstage 0 peak CUDA memory of a step: recompute {recompute / 2**20:.1f} MiB,"
          f" GPipe without recompute {gpipe / 2**20:.1f} MiB")
    assert 0 < recompute < gpipe


def _lightning(tmp_path: Path, name: str, options: str, nproc: int) -> tuple[dict, list[dict]]:
    python("equivalence.py", str(tmp_path), "reference:accelerator=gpu,steps=4", timeout=300)
    torchrun("equivalence.py", str(tmp_path), f"{name}:{options},accelerator=gpu,steps=4", nproc=nproc, timeout=400)
    return rank_result(tmp_path, "reference"), rank_results(tmp_path, name, nproc)


def _check_lightning(reference: dict, runs: list[dict]) -> None:
    seen = set()
    for run in runs:
        _close(run["losses"], reference["losses"], "losses", FP32)
        for name, grad in run["grads"].items():
            _close(grad, reference["grads"][name], name, FP32)
            seen.add(name)
    assert seen == set(reference["grads"])


def test_lightning_p1_on_one_gpu_trains_as_the_plain_run(tmp_path: Path) -> None:
    _check_lightning(*_lightning(tmp_path, "p1", "pipeline_parallel_size=1,num_microbatches=2", nproc=1))


def test_lightning_p2_with_two_processes_on_one_gpu_trains_as_the_plain_run(tmp_path: Path) -> None:
    options = "pipeline_parallel_size=2,num_microbatches=4,batch=16,shared_gpu=true"
    _check_lightning(*_lightning(tmp_path, "p2-shared", options, nproc=2))


@pytest.mark.skipif(GPUS < 2, reason="NCCL point-to-point needs two GPUs")
def test_nccl_point_to_point_trains_as_the_plain_run(tmp_path: Path) -> None:
    world = 4 if GPUS >= 4 else 2  # P=2 x D=2 with four GPUs
    torchrun("gpu_engine.py", str(tmp_path), "nccl", nproc=world, timeout=400)
    runs = rank_results(tmp_path, "nccl", world)
    assert len({run["fp32"]["device"] for run in runs}) == world
    _check_engine(runs)
    if world == 4:
        _check_against_plain(runs, "fp32-p4", FP32)


def test_fused_accumulation_on_cuda_saves_the_largest_weight_and_matches_autograd() -> None:
    from lightning_varuna.pipeline.runtime.fused_linear_grad import accumulating_in_place, install_grad_accumulation

    def step(fused: bool) -> tuple[int, list[torch.Tensor]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
        if fused:
            install_grad_accumulation(model)
        inputs = [torch.randn(8, 64, 1024, device="cuda") for _ in range(4)]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        for x in inputs:
            loss = model(x).square().mean()
            with accumulating_in_place():
                loss.backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start, [p.grad for p in model.parameters()]

    fused_peak, fused_grads = step(True)
    plain_peak, plain_grads = step(False)
    weight = 1024 * 4096 * 4
    print(f"\npeak CUDA memory of 4 micro-batches: fused {fused_peak / 2**20:.1f} MiB,"
          f" autograd {plain_peak / 2**20:.1f} MiB (largest weight {weight / 2**20:.0f} MiB)")
    assert fused_peak <= plain_peak - 0.9 * weight
    for got, want in zip(fused_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want, **FP32)


@pytest.mark.skipif(GPUS < 2, reason="torch's P=2 pipeline and ours over NCCL need two GPUs")
def test_real_compute_schedules_benchmark_runs_torchs_and_ours_on_two_gpus_with_equal_losses(tmp_path: Path) -> None:
    """benchmarks/real_schedules.py's comparison on GPUs (the CPU run is in docs/benchmarks.md, section 11): one and
    two chunks per rank, torch's and ours, with and without recompute; every system's losses equal the first's."""
    import subprocess
    import sys

    from helpers.launch import ROOT

    out = tmp_path / "real_schedules_gpu.json"
    systems = ("torch-1f1b,torch-1f1b-full,torch-interleaved1f1b,torch-zbv,torch-dualpipev,"
               "ours-1f1b,ours-zb,ours-interleaved,ours-zbv,ours-varuna-rc,ours-1f1b-rc,ours-zb-rc")
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "real_schedules.py"), "--device", "cuda", "--repeats", "2",
         "--steps", "10", "--systems", systems, "--out", str(out), "--timeout", "500"],
        capture_output=True, text=True, timeout=1100, cwd=ROOT,
    )
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-4000:])
    data = json.loads(out.read_text())
    assert data["config"]["backend"] == "nccl" and all(row["loss_ok"] for row in data["summary"])
    peaks = {row["system"]: row["peak_mib"] for row in data["summary"]}
    assert all(peak > 0 for peak in peaks.values()), peaks
    # recompute keeps less on the first stage than torch's plain 1F1B (the last stage never recomputes)
    first = {row["system"]: row["peak_mib_per_rank"][0] for row in data["summary"]}
    assert first["ours-1f1b-rc"] < first["torch-1f1b"], first
    print(data["table_md"])  # the GPU check's log carries the table
