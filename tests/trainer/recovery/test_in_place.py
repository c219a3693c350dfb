"""In-place recovery: survivors of a SIGKILL go on inside the same ``fit``, on the uninterrupted run's trajectory.

``tests/jobs/in_place.py`` runs TinyGPT at P=2 x D=2 (global batch 8, AdamW) with ``recovery="in_place"``, its ranks
forked as an external launcher starts them, over a job store of its own; rank 3 (stage 1 of replica 1) SIGKILLs
itself at step 3 at one point of the step per scenario. Replica 0 then trains alone (P=2 x D=1) on the whole global
batch; rank 2, left without its stage 1, is released. Compared with the same job without a fault: every step's
loss after the recovery equals the uninterrupted run's global loss (the mean over its replicas) within 1e-5, and the
final parameters of both stages within 1e-5 (fp32): the same trajectory, no sample lost or read twice. The p2p
order of every completed step, before and after the recovery, is replayed under NCCL's rules.

Also: both copies of stage 1 lost (no complete replica: the survivors fall back to a restart, saying so), and a rank
that hangs instead of dying (alive, so nothing is recovered: every rank ends after ``p2p_timeout``). On demand
(``-m full``): two of four replicas lost at once (8 processes, P=2 x D=4 -> P=2 x D=2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.launch import python
from helpers.on_demand import wanted

FAULTS = ["forward", "backward", "all-reduce", "before-update", "after-update"]
TOLERANCE = 1e-5

pytestmark = pytest.mark.xdist_group("in_place")


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("in_place")
    wide = ["none@8", "two-replicas"] if wanted(request.config) else []
    python("in_place.py", str(out), "none", *FAULTS, "stage-lost", "hang", *wide, timeout=1500)
    return out


def _losses(out: Path, scenario: str, rank: int) -> dict[int, tuple[float, int]]:
    lines = (out / f"{scenario}.rank{rank}.jsonl").read_text().splitlines()
    return {r["step"]: (r["loss"], r["world"]) for r in map(json.loads, lines)}


def _ended(out: Path, scenario: str) -> dict[int, dict]:
    result = json.loads((out / f"{scenario}.json").read_text())
    assert result["fault_time"] is not None or scenario == "none", f"{scenario}: the fault was never injected"
    return {int(rank): info for rank, info in result["ranks"].items()}


def _log(out: Path, scenario: str, rank: int) -> str:
    return (out / f"{scenario}.rank{rank}.log").read_text(errors="replace")[-3000:]


@pytest.mark.parametrize("fault", FAULTS)
def test_survivors_recover_in_place_on_the_uninterrupted_trajectory(runs: Path, fault: str) -> None:
    ended = _ended(runs, fault)
    assert ended[3]["returncode"] == -9, _log(runs, fault, 3)  # SIGKILL
    for rank in (0, 1, 2):  # replica 0 finishes; rank 2 (its stage 1 gone) is released: exit code 0 either way
        assert not ended[rank]["killed"] and ended[rank]["returncode"] == 0, _log(runs, fault, rank)
    assert "released" in _log(runs, fault, 2)
    assert "recovered in place" in _log(runs, fault, 0)
    _check_trajectory(runs, fault, "none", replicas=2, survivors=(0, 1))


@pytest.mark.full
def test_two_replicas_lost_at_once_recover_in_place(runs: Path) -> None:
    ended = _ended(runs, "two-replicas")
    for rank in range(8):
        want = -9 if rank in (5, 7) else 0  # ranks 4 and 6 lost their stage 1: released
        assert not ended[rank]["killed"] and ended[rank]["returncode"] == want, _log(runs, "two-replicas", rank)
    _check_trajectory(runs, "two-replicas", "none@8", replicas=4, survivors=(0, 1, 2, 3))


def test_losing_every_copy_of_a_stage_falls_back_to_a_restart(runs: Path) -> None:
    ended = _ended(runs, "stage-lost")
    for rank in (0, 2):
        assert not ended[rank]["killed"] and ended[rank]["returncode"] not in (0, None), _log(runs, "stage-lost", rank)
        assert "falling back to a restart" in _log(runs, "stage-lost", rank)


def test_a_hung_rank_is_not_recovered_from_and_ends_the_job(runs: Path) -> None:
    ended = _ended(runs, "hang")
    for rank in (0, 1, 2):  # they give up after p2p_timeout=5 s; nothing waits out the hung rank's 120 s
        assert not ended[rank]["killed"] and ended[rank]["returncode"] not in (0, None), _log(runs, "hang", rank)
    assert "p2p_timeout" in _log(runs, "hang", 2)


def _check_trajectory(runs: Path, fault: str, uninterrupted: str, replicas: int, survivors: tuple[int, ...]) -> None:
    """The survivors' losses after the recovery and their final parameters are the uninterrupted run's."""
    size = 2
    per_replica = [_losses(runs, uninterrupted, r * size) for r in range(replicas)]
    reference = {step: sum(losses[step][0] for losses in per_replica) / replicas for step in per_replica[0]}
    kept = [_losses(runs, fault, r) for r in survivors if r % size == 0]  # one rank of each replica left
    survivor = kept[0]
    assert sorted(survivor) == sorted(reference), "every step was trained once"
    worlds = {world for _, world in survivor.values()}
    after = {step: sum(losses[step][0] for losses in kept) / len(kept)
             for step, (_, world) in survivor.items() if world == min(worlds)}
    assert len(worlds) == 2 and after, "no step ran after the recovery"
    worst = max(abs(loss - reference[step]) for step, loss in after.items())
    assert worst <= TOLERANCE, {step: (loss, reference[step]) for step, loss in after.items()}
    for rank in survivors:
        want = torch.load(runs / f"{uninterrupted}.params.rank{rank % size}.pt")
        got = torch.load(runs / f"{fault}.params.rank{rank}.pt")
        assert sorted(got) == sorted(want)
        worst = max((got[n] - want[n]).abs().max().item() for n in want)
        assert worst <= TOLERANCE, f"stage {rank}: parameters differ by {worst:.3g}"
