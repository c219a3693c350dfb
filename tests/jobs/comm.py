"""Two gloo ranks exercise watched p2p transfers; each rank writes what it saw to ``<out>/comm.rank<r>.json``.

Rank 0 sends a tensor 0.3 s after the start (gloo writes it into the socket in the thread that posts it: a
helper thread must, not the caller); rank 1 has posted a watched receive and polls ``is_completed()``
without waiting on it (Varuna's opportunistic rule needs exactly that). Then rank 1 waits on a receive that
is never sent, which must end in a PipelineError after ``p2p_timeout`` (rank 0 stays up meanwhile, so that it is
a timeout and not a closed connection). A gloo timeout closes the pair, so no collective follows.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_varuna.pipeline import PipelineError, Topology
from lightning_varuna.pipeline.p2p import P2P

TIMEOUT = 2.0


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    p2p = P2P(Topology(world_size=2, rank=rank, pipeline_size=2, device=torch.device("cpu")), TIMEOUT)
    seen: dict = {}
    if rank == 0:
        posted_by = []
        isend = dist.isend

        def recording_isend(*args, **kwargs):
            posted_by.append(threading.current_thread().name)
            return isend(*args, **kwargs)

        dist.isend = recording_isend
        time.sleep(0.3)
        work = p2p.isend(torch.arange(4.0), dst=1, tag=7, watch=True)
        seen["send_completed_without_wait"] = _poll(work, 5.0)
        seen["posted_by"] = posted_by
        p2p.wait(work, "sending", 1)
        time.sleep(2 * TIMEOUT + 1.0)
    else:
        buffer = torch.zeros(4)
        work = p2p.irecv(buffer, src=0, tag=7, watch=True)
        seen["completed_before_send"] = work.is_completed()
        seen["completed_without_wait"] = _poll(work, 5.0)
        p2p.wait(work, "receiving", 0)
        seen["received"] = buffer.tolist()
        never = p2p.irecv(torch.zeros(4), src=0, tag=8, watch=True)
        start = time.monotonic()
        try:
            p2p.wait(never, "receiving a message that is never sent", 0)
        except PipelineError as err:
            seen["timeout_error"] = str(err)
        seen["timeout_after"] = time.monotonic() - start
    p2p.close()
    (out / f"comm.rank{rank}.json").write_text(json.dumps(seen))


def _poll(work, deadline: float) -> bool:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if work.is_completed():
            return True
        time.sleep(0.01)
    return False


if __name__ == "__main__":
    main(Path(sys.argv[1]))
