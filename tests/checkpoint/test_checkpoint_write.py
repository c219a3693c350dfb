"""Writing checkpoints with DCP's public API: what DCP reads back, checksums, refusals, older checkpoints.

In-process tests use ``write_single`` / ``write_job`` over a one-rank group; the two-rank job
(``tests/jobs/checkpoint_write.py``) checks the shared writing and the ranks' agreement on failures.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers.models import TinyGPT
from helpers.results import rank_results
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_varuna.checkpoint import CheckpointError
from lightning_varuna.checkpoint import load as checkpoint_load
from lightning_varuna.checkpoint import plain_format as convert
from lightning_varuna.checkpoint import state as checkpoint_state
from lightning_varuna.checkpoint.integrity import CHECKSUMS, tensor_checksum
from lightning_varuna.checkpoint.job import WriteJob, write_job, write_single
from lightning_varuna.checkpoint.storage import INDEX, META, is_complete, read_meta, to_bytes

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "old_checkpoint"
OLD_MODEL = {"vocab_size": 16, "block_size": 8, "n_embd": 8, "n_head": 2, "n_layer": 2, "tie_weights": True}


def _state() -> dict:
    base = torch.arange(40, dtype=torch.float32)
    return {
        "state_dict": {
            "embed.weight": torch.randn(7, 5),
            "head.bias": torch.randn(3, dtype=torch.bfloat16),
            "view": base[10:20].view(2, 5),  # a view into a larger storage
            "transposed": torch.randn(4, 6).t(),  # not contiguous
            "empty": torch.empty(0, 3),
            "flag": torch.tensor([True, False]),
        },
        "optimizer_0": {
            "state.embed.weight.step": torch.tensor(2.0),
            "state.embed.weight.exp_avg": torch.randn(7, 5),
            "state.extra.note": "a string",
            "state.extra.sizes": [1, 2, 3],
        },
    }


def _assert_same(a, b) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    else:
        assert a == b


def _record(path: Path) -> dict:
    return read_meta(path, weights_only=False)["varuna"]


def test_written_checkpoint_is_dcps_format_with_a_checksum_per_item(tmp_path: Path) -> None:
    state = _state()
    write_single(tmp_path / "ckpt", state, {"global_step": 1}, [], ["embed.weight", "head.bias"])
    record = _record(tmp_path / "ckpt")
    checksums = record[CHECKSUMS]
    keys = {f"{part}.{name}" for part, values in state.items() for name in values}
    assert checksums["algorithm"] == "crc32" and set(checksums["items"]) == keys
    assert set(checksums["files"]) == {META, INDEX}
    assert checksums["items"]["state_dict.transposed"] == tensor_checksum(state["state_dict"]["transposed"])
    # whoever finds the directory learns how to load it (Lightning's own loader reads single files)
    assert "lightning_varuna.load_from_checkpoint" in (tmp_path / "ckpt" / "README.txt").read_text()
    # DCP's own reader and tools read it
    dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "plain.pt")
    _assert_same(state, torch.load(tmp_path / "plain.pt", weights_only=False))
    target = {"state_dict": {k: torch.zeros_like(v) for k, v in state["state_dict"].items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=dcp.FileSystemReader(tmp_path / "ckpt"), no_dist=True)
    _assert_same({"state_dict": state["state_dict"]}, target)


def _tensor_offset(path: Path, key: str) -> tuple[Path, int, int]:
    """The shard file, offset and length of an item's record."""
    info = next(i for index, i in dcp.FileSystemReader(path).read_metadata().storage_data.items() if index.fqn == key)
    return path / info.relative_path, info.offset, info.length


def _damage(path: Path, key: str) -> None:
    """Overwrites 64 bytes inside an item's values (the file keeps its size)."""
    shard, offset, length = _tensor_offset(path, key)
    data = bytearray(shard.read_bytes())
    start = offset + length // 2  # inside the values of a tensor of several KiB
    data[start : start + 64] = bytes(range(64))
    shard.write_bytes(bytes(data))


def test_a_damaged_item_of_the_right_size_is_refused_unless_verification_is_off(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyGPT(n_layer=2)
    names = [n for n, _ in model.named_parameters()]
    path = tmp_path / "ckpt"
    write_single(path, {"state_dict": checkpoint_state.model_state(model)}, {"global_step": 1}, [], names)
    size = sum(p.stat().st_size for p in path.iterdir())
    _damage(path, "state_dict.blocks.1.mlp.0.weight")
    assert sum(p.stat().st_size for p in path.iterdir()) == size
    fresh = TinyGPT(n_layer=2)
    with pytest.raises(CheckpointError, match=r"blocks.1.mlp.0.weight read back different .*checksum mismatch"):
        checkpoint_load.load(path, fresh, [], names)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        convert.to_plain(path, tmp_path / "plain.ckpt")
    checkpoint_load.load(path, fresh, [], names, verify=False)  # the switch: loads what is there
    assert not torch.equal(fresh.blocks[1].mlp[0].weight, model.blocks[1].mlp[0].weight)
    assert torch.equal(fresh.blocks[0].mlp[0].weight, model.blocks[0].mlp[0].weight)
    # a damaged meta.pt that still unpickles is caught by its checksum too
    meta = path / META
    meta.write_bytes(to_bytes({"global_step": 2}))
    with pytest.raises(CheckpointError, match="meta.pt reads back different"):
        checkpoint_load.check_files(path)


def _one_rank_group(tmp_path: Path) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)


def test_write_job_refuses_parameters_that_are_not_finite_and_keeps_the_last_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    good = {"state_dict": {"w": torch.ones(3), "mask": torch.full((2,), float("-inf"))}}
    bad = {"state_dict": {"w": torch.tensor([1.0, float("nan"), 2.0]), "mask": torch.full((2,), float("-inf"))}}
    _one_rank_group(tmp_path)
    try:
        # a buffer may hold infinities (a mask); only parameters are checked
        assert write_job(WriteJob(str(target), good, to_bytes({"global_step": 1}), [], [], ["w"]), None) is None
        error = write_job(WriteJob(str(target), bad, to_bytes({"global_step": 2}), [], [], ["w"]), None)
        assert "NonFiniteWeights: parameter w holds NaN or infinite values" in error
        assert write_job(WriteJob(str(target), bad, to_bytes({"global_step": 3}), [], [], ["w"], verify=False),
                         None) is None
    finally:
        dist.destroy_process_group()
    assert is_complete(target) and read_meta(target)["global_step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # the refused write's files are gone


def test_old_checkpoints_of_this_package_still_load() -> None:
    """A checkpoint of the writer before ``dcp.save`` (DCP's format written by hand, no checksums), P=2."""
    expected = torch.load(FIXTURE / "step2.plain.ckpt", weights_only=False)
    torch.manual_seed(1)
    model = TinyGPT(**OLD_MODEL)
    optimizer = model.configure_optimizers()["optimizer"]
    names = [n for n, _ in model.named_parameters()]
    meta = checkpoint_load.load(FIXTURE / "step2.ckpt", model, [optimizer], names, weights_only=False)
    assert meta["global_step"] == 2
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected["state_dict"][name]), name
    loaded = optimizer.state_dict()
    assert loaded["param_groups"] == expected["optimizer_states"][0]["param_groups"]
    for i, entries in expected["optimizer_states"][0]["state"].items():
        for key, value in entries.items():
            assert torch.equal(loaded["state"][i][key], value), (i, key)


def test_old_checkpoints_convert_as_before(tmp_path: Path) -> None:
    convert.to_plain(FIXTURE / "step2.ckpt", tmp_path / "plain.ckpt", weights_only=False)
    ours = torch.load(tmp_path / "plain.ckpt", weights_only=False)
    theirs = torch.load(FIXTURE / "step2.plain.ckpt", weights_only=False)
    assert ours.keys() == theirs.keys()
    _assert_same(ours["state_dict"], theirs["state_dict"])
    _assert_same(ours["optimizer_states"][0]["state"], theirs["optimizer_states"][0]["state"])
    # and back: the rewritten directory has checksums and the same values
    convert.from_plain(tmp_path / "plain.ckpt", tmp_path / "again.ckpt")
    assert _record(tmp_path / "again.ckpt")[CHECKSUMS]["items"]
    convert.to_plain(tmp_path / "again.ckpt", tmp_path / "again.plain.ckpt", weights_only=False)
    _assert_same(ours["state_dict"], torch.load(tmp_path / "again.plain.ckpt", weights_only=False)["state_dict"])


def test_conversion_runs_in_a_process_that_has_a_process_group(tmp_path: Path) -> None:
    """A script that converts after training (its process group still up) converts in its own process only."""
    _one_rank_group(tmp_path)
    try:
        shutil.copytree(FIXTURE / "step2.ckpt", tmp_path / "copy.ckpt")
        convert.to_plain(tmp_path / "copy.ckpt", tmp_path / "plain.ckpt", weights_only=False)
        convert.from_plain(tmp_path / "plain.ckpt", tmp_path / "back.ckpt")
    finally:
        dist.destroy_process_group()
    assert is_complete(tmp_path / "back.ckpt")


@pytest.mark.slow
def test_two_ranks_share_the_writing_and_agree_on_failures(tmp_path: Path) -> None:
    from helpers.launch import torchrun

    torchrun("checkpoint_write.py", str(tmp_path), nproc=2, timeout=180)
    ranks = rank_results(tmp_path, "write", 2)
    shared = ranks[0]["shared"]
    assert [r["shared"]["error"] for r in ranks] == [None, None] and shared["complete"]
    assert shared["keys"] == ["state_dict.only0", "state_dict.only1", "state_dict.shared"]
    assert shared["checksums"] == shared["keys"]
    assert shared["files"] == ["__0_0.distcp", "__1_0.distcp"]  # each rank wrote a share
    assert shared["values"] == {"shared": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], "only0": [0.0, 0.0], "only1": [1.0, 1.0]}
    for scenario, who in (("write-fails", "rank 1: RuntimeError: injected"),
                          ("publish-fails", "rank 0: RuntimeError: injected"),
                          ("not-finite", "rank 1: NonFiniteWeights: parameter only1 holds NaN"),
                          ("paths-differ", "the ranks were given different paths")):
        errors = [r[scenario]["error"] for r in ranks]
        assert errors[0] == errors[1] and errors[0].startswith(who), errors
        assert not ranks[0][scenario]["exists"], scenario
