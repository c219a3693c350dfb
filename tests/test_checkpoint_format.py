"""DCP's format written without DCP's save (``checkpoint_format``): what DCP itself writes and reads back.

The index must equal the one ``dcp.save`` writes for the same state (entries, planner data, storage keys), and
DCP's own reader, ``dcp.load`` and ``dcp_to_torch_save`` must give back every value.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_varuna.checkpoint import format as fmt
from lightning_varuna.checkpoint.storage import INDEX, Location


def _state() -> dict:
    base = torch.arange(40, dtype=torch.float32)
    return {
        "state_dict": {
            "model.embed.weight": torch.randn(7, 5),
            "model.head.bias": torch.randn(3, dtype=torch.bfloat16),
            "model.view": base[10:20].view(2, 5),  # a view into a larger storage
            "model.transposed": torch.randn(4, 6).t(),  # not contiguous
            "model.empty": torch.empty(0, 3),
            "model.nested": {"flag": torch.tensor([True, False]), "count": torch.tensor(3, dtype=torch.int64)},
        },
        "optimizer_0": {
            "state.model.embed.weight.step": torch.tensor(2.0),
            "state.model.embed.weight.exp_avg": torch.randn(7, 5),
            "state.model.extra.note": "a string",
            "state.model.extra.sizes": [1, 2, 3],
            "state.model.extra.lr": 0.5,
        },
    }


def _write_ours(folder: Path, state: dict) -> None:
    flat = fmt.flatten(state)
    part = fmt.write_items(Location.of(folder), 0, flat, fmt.assign([fmt.inventory(flat)])[0])
    fmt.write_index(Location.of(folder), [part], flat)


def _index(folder: Path):
    with open(folder / INDEX, "rb") as f:
        return pickle.load(f)


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


def test_the_index_equals_what_dcp_save_writes(tmp_path: Path) -> None:
    state = _state()
    _write_ours(tmp_path / "ours", state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "dcp"), no_dist=True)
    ours, theirs = _index(tmp_path / "ours"), _index(tmp_path / "dcp")
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.planner_data == theirs.planner_data
    assert ours.storage_data.keys() == theirs.storage_data.keys()
    assert getattr(ours, "version", None) == getattr(theirs, "version", None)
    assert type(ours.storage_meta) is type(theirs.storage_meta)


def test_dcp_reads_every_value_back(tmp_path: Path) -> None:
    state = _state()
    _write_ours(tmp_path, state)
    target = {
        "state_dict": {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in
                       state["state_dict"].items() if k != "model.nested"},
        "optimizer_0": {"state.model.embed.weight.exp_avg": torch.zeros(7, 5), "state.model.extra.note": None,
                        "state.model.extra.sizes": None},
    }
    target["state_dict"]["model.nested"] = {"flag": torch.zeros(2, dtype=torch.bool),
                                            "count": torch.tensor(0, dtype=torch.int64)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=dcp.FileSystemReader(tmp_path), no_dist=True)
    expected = {"state_dict": state["state_dict"],
                "optimizer_0": {k: state["optimizer_0"][k] for k in target["optimizer_0"]}}
    _assert_same(expected, target)


def test_dcp_to_torch_save_gives_the_state(tmp_path: Path) -> None:
    state = _state()
    _write_ours(tmp_path / "ckpt", state)
    dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "plain.pt")
    _assert_same(state, torch.load(tmp_path / "plain.pt", weights_only=False))


def test_each_item_is_written_once_and_replicas_share_the_writing() -> None:
    replica = [("a", 400), ("b", 300), ("c", 200), ("d", 100)]
    other_stage = [("e", 50)]
    chosen = fmt.assign([replica, list(replica), other_stage])
    assert sorted(k for keys in chosen for k in keys) == ["a", "b", "c", "d", "e"]
    assert chosen[2] == {"e"}
    assert chosen[0] == {"a", "d"} and chosen[1] == {"b", "c"}  # 500 bytes each
    assert fmt.assign([list(replica), replica, other_stage]) == chosen


def test_an_item_no_rank_wrote_is_an_error(tmp_path: Path) -> None:
    flat = fmt.flatten({"state_dict": {"w": torch.ones(2), "b": torch.ones(1)}})
    writer = fmt.write_items(Location.of(tmp_path), 0, flat, {"state_dict.w"})
    idle = fmt.write_items(Location.of(tmp_path), 1, flat, set())
    assert not idle.storage and not idle.items
    assert sorted(p.name for p in tmp_path.iterdir()) == ["__0_0.distcp"]
    with pytest.raises(RuntimeError, match="no rank wrote state_dict.b"):
        fmt.write_index(Location.of(tmp_path), [writer, idle], flat)
    fmt.write_index(Location.of(tmp_path), [writer, idle], ["state_dict.w"])


def test_a_list_of_tensors_is_left_to_dcp() -> None:
    with pytest.raises(fmt.UnsupportedState, match="optimizer_0.buffers"):
        fmt.flatten({"optimizer_0": {"buffers": [torch.ones(1)]}})


@pytest.mark.parametrize("lists_tensors", [False, True], ids=["format", "dcp-save"])
def test_write_job_publishes_a_checkpoint_dcp_loads(tmp_path: Path, lists_tensors: bool, monkeypatch) -> None:
    """``write_job`` over a one-rank group: this module's writer, or DCP's save for a state it does not flatten."""
    import torch.distributed as dist

    from lightning_varuna.checkpoint.job import WriteJob, write_job
    from lightning_varuna.checkpoint.storage import is_complete, to_bytes

    state = {"state_dict": {"w": torch.randn(3, 2)}, "optimizer_0": {"state.w.exp_avg": torch.randn(3, 2)}}
    if lists_tensors:
        state["optimizer_0"]["state.w.history"] = [torch.ones(2), torch.zeros(1)]
    target = tmp_path / "ckpt"
    calls = []
    write_items = fmt.write_items
    monkeypatch.setattr(fmt, "write_items", lambda *args: calls.append(1) or write_items(*args))
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        job = WriteJob(str(target), state, to_bytes({"global_step": 1}), [["w"]], [[{"lr": 0.1}]], ["w"])
        assert write_job(job, None) is None
    finally:
        dist.destroy_process_group()
    assert is_complete(target)
    assert len(calls) == (0 if lists_tensors else 1)
    loaded = {"state_dict": {"w": torch.zeros(3, 2)}, "optimizer_0": {"state.w.exp_avg": torch.zeros(3, 2)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(loaded, storage_reader=dcp.FileSystemReader(target), no_dist=True)
    _assert_same({k: {n: v for n, v in d.items() if n != "state.w.history"} for k, d in state.items()}, loaded)


def test_tensor_records_are_torch_saves_bytes_without_pickling_each_tensor() -> None:
    import io

    records = fmt._TensorRecords()
    for tensor in (torch.randn(7, 5), torch.arange(6, dtype=torch.int64), torch.tensor(2.5), torch.empty(0, 4),
                   torch.randn(3, dtype=torch.bfloat16), torch.tensor([True, False]), torch.randn(1, 4)):
        for values in (tensor, tensor.clone().fill_(1) if tensor.dtype != torch.bool else ~tensor):
            expected, written = io.BytesIO(), io.BytesIO()
            torch.save(values, expected)
            records.write(written, values)
            assert written.getvalue() == expected.getvalue()
        assert records._pickles[(tensor.dtype, tuple(tensor.shape), tensor.stride())] is not None  # rebuilt


def test_every_kind_of_tensor_reads_back_as_written() -> None:
    """What the rebuilt records skip (views, quantized, conjugate, negative, grad) goes through torch.save."""
    import io

    base = torch.randn(12)
    complex_values = torch.randn(3, dtype=torch.complex64)
    tensors = [
        base[2:8].view(2, 3), torch.randn(4, 3).t(), torch.randn(2, 2, requires_grad=True),
        torch.quantize_per_tensor(torch.tensor([0.5, 1.0]), 0.1, 0, torch.qint8),
        torch.quantize_per_tensor(torch.tensor([0.5, 1.0]), 0.5, 3, torch.qint8),  # same layout, other scale
        complex_values.conj(), torch.randn(3)._neg_view(), torch.randn(1, 4).expand(3, 4),
    ]
    for tensor in tensors:
        sink = io.BytesIO()
        fmt._write_record(fmt._Sink(sink), tensor)
        loaded = torch.load(io.BytesIO(sink.getvalue()), weights_only=False)
        expected = tensor.detach().resolve_conj().resolve_neg()
        if tensor.is_quantized:
            assert (loaded.q_scale(), loaded.q_zero_point()) == (tensor.q_scale(), tensor.q_zero_point())
            expected, loaded = expected.dequantize(), loaded.dequantize()
        assert loaded.shape == tensor.shape and torch.equal(loaded.resolve_conj().resolve_neg(), expected)


@pytest.mark.slow
def test_two_ranks_share_the_writing_and_agree_on_failures(tmp_path: Path) -> None:
    import json

    from launch import torchrun

    torchrun("checkpoint_format.py", str(tmp_path), nproc=2, timeout=180)
    ranks = [json.loads((tmp_path / f"format.rank{r}.json").read_text()) for r in range(2)]
    shared = ranks[0]["shared"]
    assert [r["shared"]["error"] for r in ranks] == [None, None] and shared["complete"]
    assert shared["keys"] == ["state_dict.only0", "state_dict.only1", "state_dict.shared"]
    assert shared["files"] == ["__0_0.distcp", "__1_0.distcp"]  # each rank wrote a share
    assert shared["values"] == {"shared": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], "only0": [0.0, 0.0], "only1": [1.0, 1.0]}
    for scenario, who in (("write-fails", "rank 1: RuntimeError: injected"),
                          ("publish-fails", "rank 0: RuntimeError: injected")):
        assert [r[scenario]["error"] for r in ranks] == [who, who]
        assert not ranks[0][scenario]["complete"]
    fallback = ranks[0]["list-on-one-rank"]
    assert [r["list-on-one-rank"]["error"] for r in ranks] == [None, None] and fallback["complete"]
    assert "state_dict.shared" in fallback["keys"]
