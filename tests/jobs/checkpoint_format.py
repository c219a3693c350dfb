"""Two gloo ranks run ``write_job`` in four scenarios; each rank writes its outcomes to ``<out>/format.rank<r>.json``.

* ``shared``: ranks hold different items and one in common (a replicated weight): written once, all readable;
* ``write-fails``: rank 1's shard write raises: both ranks report rank 1's error, nothing is published;
* ``publish-fails``: rank 0's publication raises: both ranks report it;
* ``list-on-one-rank``: only rank 1's state holds a list of tensors: both ranks take ``dcp.save`` alike.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lightning_varuna.checkpoint import format as checkpoint_format
from lightning_varuna.checkpoint import storage as checkpoint_files
from lightning_varuna.checkpoint.job import WriteJob, write_job


def _state(rank: int, scenario: str) -> dict:
    own = {"state_dict": {"shared": torch.arange(6.0), f"only{rank}": torch.full((2,), float(rank))}}
    if scenario == "list-on-one-rank" and rank == 1:
        own["optimizer_0"] = {"state.only1.history": [torch.ones(2)]}
    return own


def _fail(*args, **kwargs):
    raise RuntimeError("injected")


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    outcomes: dict = {}
    write_items, publish = checkpoint_format.write_items, checkpoint_files.publish
    for scenario in ("shared", "write-fails", "publish-fails", "list-on-one-rank"):
        target = out / scenario
        checkpoint_format.write_items = _fail if scenario == "write-fails" and rank == 1 else write_items
        checkpoint_files.publish = _fail if scenario == "publish-fails" and rank == 0 else publish
        meta = checkpoint_files.to_bytes({"scenario": scenario}) if rank == 0 else None
        job = WriteJob(str(target), _state(rank, scenario), meta, [], [], [])
        error = write_job(job, None)
        seen = {"error": error, "complete": checkpoint_files.is_complete(target)}
        if rank == 0 and error is None:
            index = checkpoint_files.Location.of(target).reader().read_metadata()
            seen["files"] = sorted({info.relative_path for info in index.storage_data.values()})
            seen["keys"] = sorted(index.state_dict_metadata)
            loaded = {"state_dict": {"shared": torch.zeros(6), "only0": torch.zeros(2), "only1": torch.zeros(2)}}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(loaded, storage_reader=dcp.FileSystemReader(target), no_dist=True)
            seen["values"] = {k: v.tolist() for k, v in loaded["state_dict"].items()}
        outcomes[scenario] = seen
    (out / f"format.rank{rank}.json").write_text(json.dumps(outcomes))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
