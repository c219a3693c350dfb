"""Two gloo ranks exercise watched p2p transfers; each rank writes what it saw to ``<out>/p2p.rank<r>.json``.

Rank 0 sends a tensor 0.3 s after the start (gloo writes it into the socket in the thread that posts it: a
helper thread must, not the caller); rank 1 has posted a watched receive and polls ``completed()``
without waiting on it (Varuna's opportunistic rule needs exactly that). Then a transfer through host staging
(what ``p2p_backend="gloo"`` does in a CUDA job; here with CPU tensors): the bytes cross in host buffers and land
in the receiver's own tensor once waited for. Then rank 1 waits on a receive that is never sent, which must end
in a PipelineError after ``p2p_timeout`` (rank 0 stays up meanwhile, so that it is a timeout and not a closed
connection). A gloo timeout closes the pair, so no collective follows. First, the grid of groups is made and
destroyed three times: the process's thread count must not grow (each gloo group has threads of its own).
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
from lightning_varuna.pipeline.comm.transfers import P2P, HostStaging
from lightning_varuna.pipeline.scheduling.lowering import Message, MessageKind

TIMEOUT = 2.0


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    seen: dict = {"threads_after_rebuilds": []}
    for _ in range(3):
        Topology.create(2, torch.device("cpu"), timeout=30.0).destroy_groups()
        seen["threads_after_rebuilds"].append(_native_threads())
    p2p = P2P(Topology(world_size=2, rank=rank, pipeline_size=2, device=torch.device("cpu")), TIMEOUT)
    link = p2p.link(0, 1)
    first, staged, never = (Message(MessageKind.ACTIVATION, 0, k) for k in range(3))
    if rank == 0:
        posted_by = []
        isend = dist.isend

        def recording_isend(*args, **kwargs):
            posted_by.append(threading.current_thread().name)
            return isend(*args, **kwargs)

        dist.isend = recording_isend
        time.sleep(0.3)
        transfer = p2p.isend(torch.arange(4.0), link, first, watch=True)
        seen["send_completed_without_wait"] = _poll(p2p, transfer, 5.0)
        seen["posted_by"] = posted_by
        p2p.wait(transfer, "sending")
        p2p.staging = HostStaging(pin=False)
        tensor = torch.arange(6.0).view(2, 3)
        transfer = p2p.isend(tensor, link, staged, watch=True)
        seen["staged_wire_is_a_copy"] = transfer.wire is not tensor and transfer.wire.data_ptr() != tensor.data_ptr()
        p2p.wait(transfer, "sending")
        time.sleep(2 * TIMEOUT + 1.0)
    else:
        buffer = torch.zeros(4)
        transfer = p2p.irecv(buffer, link, first, watch=True)
        seen["completed_before_send"] = p2p.completed(transfer)
        seen["completed_without_wait"] = _poll(p2p, transfer, 5.0)
        p2p.wait(transfer, "receiving")
        seen["received"] = buffer.tolist()
        p2p.staging = HostStaging(pin=False)
        landing = torch.zeros(2, 3)
        transfer = p2p.irecv(landing, link, staged, watch=True)
        seen["staged_lands_in_host_buffer"] = transfer.wire.data_ptr() != landing.data_ptr()
        _poll(p2p, transfer, 5.0)
        seen["staged_before_wait"] = landing.tolist()
        p2p.wait(transfer, "receiving")
        seen["staged_after_wait"] = landing.tolist()
        lost = p2p.irecv(torch.zeros(4), link, never, watch=True)
        start = time.monotonic()
        try:
            p2p.wait(lost, "receiving a message that is never sent")
        except PipelineError as err:
            seen["timeout_error"] = str(err)
        seen["timeout_after"] = time.monotonic() - start
    p2p.close()
    (out / f"p2p.rank{rank}.json").write_text(json.dumps(seen))


def _native_threads() -> int:
    return len(list(Path("/proc/self/task").iterdir()))


def _poll(p2p: P2P, transfer, deadline: float) -> bool:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if p2p.completed(transfer):
            return True
        time.sleep(0.01)
    return False


if __name__ == "__main__":
    main(Path(sys.argv[1]))
