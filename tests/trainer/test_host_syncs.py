"""What a training step makes the host wait for: no more than the plain run and Lightning's DDP make with the same
module, plus what the pipeline needs by design (each listed below with its reason).

``tests/jobs/host_syncs.py`` counts, per optimizer step on every rank (P=2 x D=2, ``train_loss`` logged to the
progress bar every step): the host's reads of tensor values (``item``, ``tolist``, ``__bool__``, ``cpu``, ``numpy``:
each a device synchronization on a GPU), the calls into ``torch.distributed`` and the engine's posted transfers and
host waits. The same job counts the plain one-process run and Lightning's ``DDPStrategy`` (D=2).
"""

from __future__ import annotations

import json

import pytest
from helpers.launch import python, torchrun

pytestmark = [pytest.mark.xdist_group("host_syncs"), pytest.mark.slow]


def designed(rank: dict) -> dict[str, float]:
    """What the pipeline adds per step on this rank, by design, beyond the plain run and Lightning's DDP."""
    m = rank["microbatches"]
    last, replicas = rank["last_stage"], True  # D=2 in every counted run
    return {
        # every rank reads the step summary the last stage sends back behind the last gradient (the loss and the
        # logged values live on the last stage; each rank logs them and the progress bar shows them)
        "host.tolist": 1 + (1 if rank["stage"] > 0 else 0),  # and a receiving stage reads each step's header
        # (activation shapes vary with the batch: dynamic padding)
        # the replicas' last stages agree whether the user's step skipped the batch (training_step returned None)
        # before the summary carries it: an all-reduce over their data-parallel group, read on the host
        "host.item": 1 if last and replicas else 0,
        "dist.all_reduce": (
            1  # the preemption agreement, which replaces Lightning's SIGTERM broadcast (counted under DDP)
            + rank["buckets"]  # the data-parallel gradient buckets (DDP reduces its buckets in C++, out of sight)
            + (1 if last and replicas else 0)  # the skip agreement above
        ),
        # the step's messages on its one link: the header or summary and one activation or gradient per
        # micro-batch each way, posted once, each waited for at most once
        "dist.isend": m + 1,
        "dist.irecv": m + 1,
        "p2p.post": 2 * (m + 1),
        "p2p.wait_start": 2 * (m + 1),
    }


@pytest.fixture(scope="module")
def counts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("host_syncs")
    python("host_syncs.py", str(out), "plain", timeout=600)
    torchrun("host_syncs.py", str(out), "ddp", nproc=2, timeout=600)
    torchrun("host_syncs.py", str(out), "varuna", nproc=4, timeout=600)
    return {mode: [json.loads(p.read_text()) for p in sorted(out.glob(f"{mode}.rank*.json"))]
            for mode in ("plain", "ddp", "varuna")}


def test_a_pipeline_step_makes_the_host_wait_no_more_than_ddp_plus_what_the_pipeline_needs(counts) -> None:
    assert len(counts["varuna"]) == 4 and len(counts["ddp"]) == 2 and len(counts["plain"]) == 1
    keys = {k for runs in counts.values() for run in runs for k in run["per_step"]}
    # Lightning's own per-step reads (logging; the progress bar on global rank 0; its SIGTERM broadcast under DDP),
    # rank 0 against rank 0, the other ranks against DDP's rank 1
    first, other = (counts["plain"][0], counts["ddp"][0]), (counts["ddp"][1],)
    assert counts["ddp"][1]["per_step"].get("dist.broadcast") == 1.0
    over = {}
    for rank, run in enumerate(counts["varuna"]):
        lightning = first if rank == 0 else other
        allowed = designed(run)
        for key in sorted(keys):
            baseline = max(r["per_step"].get(key, 0.0) for r in lightning)
            got = run["per_step"].get(key, 0.0)
            if got > baseline + allowed.get(key, 0):
                over[f"rank {rank}: {key}"] = (got, baseline, [s for s in run["sites"] if s.startswith(key + " ")])
    assert over == {}


def test_the_count_sees_the_strategys_own_reads(counts) -> None:
    # the counter is live: the preemption agreement's all-reduce and read are seen on every rank
    for run in counts["varuna"]:
        assert run["sites"].get("host.item lightning_varuna.trainer.recovery.preemption:agree") == 1.0
        assert run["per_step"]["p2p.post"] > 0
