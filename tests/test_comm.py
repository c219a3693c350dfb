"""Point-to-point transfers: completion can be asked for without waiting, on gloo too; waits are bounded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import torchrun

from lightning_varuna.pipeline.schedules import Kind, Task, make_schedule, validate_schedule
from lightning_varuna.pipeline.simulator import StageCosts, simulate


def test_watched_transfers_report_completion_without_a_wait_and_a_missing_message_times_out(tmp_path: Path) -> None:
    # gloo's own Work.is_completed() stays False until someone waits on the work, so without the helper threads
    # the opportunistic rule would never see a message arrive, and finished sends would hold their tensors
    torchrun("comm.py", str(tmp_path), nproc=2, timeout=120)
    sender = json.loads((tmp_path / "comm.rank0.json").read_text())
    receiver = json.loads((tmp_path / "comm.rank1.json").read_text())
    assert sender == {"send_completed_without_wait": True, "posted_by": ["varuna-0>1", "varuna-0>1"],
                      "staged_wire_is_a_copy": True}
    assert receiver["completed_before_send"] is False
    assert receiver["completed_without_wait"] is True
    assert receiver["received"] == [0.0, 1.0, 2.0, 3.0]
    # staged (p2p_backend="gloo" in a CUDA job): the receiver's tensor is written when it is waited for
    assert receiver["staged_lands_in_host_buffer"] is True
    assert receiver["staged_before_wait"] == [[0.0] * 3] * 2
    assert receiver["staged_after_wait"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert "no answer within p2p_timeout=2s" in receiver["timeout_error"], receiver
    assert 1.5 < receiver["timeout_after"] < 10, receiver


def test_a_middle_stage_runs_a_ready_forward_while_its_gradient_is_late(tmp_path: Path) -> None:
    # P=3 with a slow last backward: the middle stage's gradients are late and its inputs are there, so Varuna's
    # rule must move forwards there (it never did on gloo before the transfers were watched)
    torchrun("opportunistic.py", str(tmp_path), nproc=3, timeout=180)
    moves = [json.loads((tmp_path / f"opportunistic.rank{r}.json").read_text())["moves"] for r in range(3)]
    assert moves[1] > 0, moves
    assert moves[2] == 0, moves  # the last stage has nothing to move


@pytest.mark.slow
def test_a_stage_sends_a_forward_early_when_its_next_stage_runs_out_of_work(tmp_path: Path) -> None:
    # P=4, m=8 with unit-cost sleeps: fed, stage 2 runs F6 before B5 (the list has it after), as the simulator
    # predicts; every stage still runs forwards and backwards in micro-batch order, so messages keep their order
    torchrun("feed.py", str(tmp_path), nproc=4, timeout=240)
    orders = [json.loads((tmp_path / f"feed.rank{r}.json").read_text()) for r in range(4)]
    schedule = make_schedule("varuna", 4, 8, recompute=True)
    predicted = simulate(schedule, [StageCosts(1.0, 2.0)] * 4, opportunistic=True).order
    assert schedule[2].index(Task(Kind.F, 6)) > schedule[2].index(Task(Kind.B, 5))
    assert predicted[2].index(Task(Kind.F, 6)) < predicted[2].index(Task(Kind.B, 5))
    fed = [[_task(text) for text in order["fed"]] for order in orders]
    assert fed[2].index(Task(Kind.F, 6)) < fed[2].index(Task(Kind.B, 5)), fed[2]
    alone = [_task(text) for text in orders[2]["varuna_rule_alone"]]
    assert alone.index(Task(Kind.F, 6)) > alone.index(Task(Kind.B, 5)), alone  # the switch is obeyed
    for run in ("fed", "varuna_rule_alone"):
        executed = tuple(tuple(_task(text) for text in order[run]) for order in orders)
        validate_schedule(executed, 8, recompute=True)
        for stage in executed:
            assert [t.microbatch for t in stage if t.kind is Kind.F] == list(range(8))
            assert [t.microbatch for t in stage if t.kind is Kind.B] == list(range(8))


def _task(text: str) -> Task:
    return Task(Kind(text[0]), int(text[1:]))
