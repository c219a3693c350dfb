"""Point-to-point transfers: completion can be asked for without waiting, on gloo too; waits are bounded."""

from __future__ import annotations

import json
from pathlib import Path

from helpers.launch import torchrun
from helpers.results import rank_result


def test_watched_transfers_report_completion_without_a_wait_and_a_missing_message_times_out(tmp_path: Path) -> None:
    # gloo's own Work.is_completed() stays False until someone waits on the work, so without the helper threads
    # the opportunistic rule would never see a message arrive, and finished sends would hold their tensors
    torchrun("p2p.py", str(tmp_path), nproc=2, timeout=120)
    sender = rank_result(tmp_path, "p2p")
    receiver = json.loads((tmp_path / "p2p.rank1.json").read_text())
    for rank in (sender, receiver):  # the grid made and destroyed 3 times: nothing of it is left running
        rebuilt = rank.pop("threads_after_rebuilds")
        assert rebuilt[0] == rebuilt[1] == rebuilt[2], rebuilt
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
