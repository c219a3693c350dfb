"""Two gloo ranks run ``write_job`` (``dcp.save``) in five scenarios; each writes ``<out>/write.rank<r>.json``.

* ``shared``: the ranks hold different items and one in common (a replicated weight): written once, each rank
  writing a share, every item's checksum recorded, all readable;
* ``write-fails``: rank 1's write of an item raises: both ranks report rank 1's error, nothing is published;
* ``publish-fails``: rank 0's publication raises: both ranks report it;
* ``not-finite``: a parameter held by rank 1 only is NaN: both ranks refuse, naming it; the target is untouched;
* ``paths-differ``: the ranks are given different paths: both refuse before writing.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lightning_varuna.checkpoint import job as checkpoint_job
from lightning_varuna.checkpoint.integrity import CHECKSUMS, ChecksumSavePlanner
from lightning_varuna.checkpoint.job import WriteJob, write_job
from lightning_varuna.checkpoint.storage import Location, is_complete, read_meta, to_bytes

SCENARIOS = ["shared", "write-fails", "publish-fails", "not-finite", "paths-differ"]


def _state(rank: int, scenario: str) -> dict:
    own = {"state_dict": {"shared": torch.arange(6.0), f"only{rank}": torch.full((2,), float(rank))}}
    if scenario == "not-finite" and rank == 1:
        own["state_dict"]["only1"][1] = float("nan")
    return own


def _fail(*args, **kwargs):
    raise RuntimeError("injected")


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    outcomes: dict = {}
    transform, publish = ChecksumSavePlanner.transform_object, checkpoint_job.publish
    for scenario in SCENARIOS:
        target = out / scenario
        ChecksumSavePlanner.transform_object = _fail if scenario == "write-fails" and rank == 1 else transform
        checkpoint_job.publish = _fail if scenario == "publish-fails" and rank == 0 else publish
        path = f"{target}-{rank}" if scenario == "paths-differ" else str(target)
        meta = to_bytes({"scenario": scenario}) if rank == 0 else None
        job = WriteJob(path, _state(rank, scenario), meta, [], [], ["shared", "only0", "only1"])
        error = write_job(job, None)
        seen = {"error": error, "complete": is_complete(target), "exists": Location.of(target).exists()}
        if rank == 0 and error is None:
            index = Location.of(target).reader().read_metadata()
            seen["files"] = sorted({info.relative_path for info in index.storage_data.values()})
            seen["keys"] = sorted(index.state_dict_metadata)
            seen["checksums"] = sorted(read_meta(target)["varuna"][CHECKSUMS]["items"])
            loaded = {"state_dict": {"shared": torch.zeros(6), "only0": torch.zeros(2), "only1": torch.zeros(2)}}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(loaded, storage_reader=dcp.FileSystemReader(target), no_dist=True)
            seen["values"] = {k: v.tolist() for k, v in loaded["state_dict"].items()}
        outcomes[scenario] = seen
    (out / f"write.rank{rank}.json").write_text(json.dumps(outcomes))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
