"""Checkpoint robustness: bad checkpoints, conversion to and from plain Lightning files, fsspec, async saves.

The in-process tests load with :func:`lightning_varuna.checkpoint.load` into a whole model (no process group:
the single-rank case of the strategy's load). The multi-process test runs ``tests/jobs/checkpoint_io.py``.
fsspec is exercised with ``memory://`` in-process and, across processes (where ``memory://`` cannot be
shared), with ``localdisk://``, an fsspec filesystem backed by the local disk that the job registers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers.checkpoint_outcomes import not_raised, own_errors
from helpers.launch import JOBS, ROOT, _env, torchrun
from helpers.models import RandomTokens, TinyGPT
from helpers.results import rank_result, rank_results
from torch.utils.data import DataLoader

from lightning_varuna.checkpoint import CheckpointError, is_complete
from lightning_varuna.checkpoint import load as checkpoint_load
from lightning_varuna.checkpoint import plain_format as convert
from lightning_varuna.checkpoint import publish as checkpoint_publish
from lightning_varuna.checkpoint import state as checkpoint
from lightning_varuna.checkpoint import storage as checkpoint_files
from lightning_varuna.checkpoint.job import write_single

_spec = importlib.util.spec_from_file_location("checkpoint_io_job", JOBS / "checkpoint_io.py")
job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(job)
GroupedGPT = job.GroupedGPT


def _trained(model: torch.nn.Module, steps: int = 2) -> torch.optim.Optimizer:
    optimizer = model.configure_optimizers()["optimizer"]
    data = RandomTokens(n=4 * steps, seed=3)
    for i in range(steps):
        idx, targets = data.data[4 * i : 4 * i + 4, :-1], data.data[4 * i : 4 * i + 4, 1:]
        model._loss(model(idx), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def _save(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    shards = {"state_dict": checkpoint.model_state(model), "optimizer_0": checkpoint.optimizer_state(model, optimizer)}
    names = [n for n, _ in model.named_parameters()]
    groups = checkpoint.param_groups_by_name(model, [optimizer])
    write_single(path, shards, {"global_step": 2}, groups, names)


def _load(path: Path, model: torch.nn.Module) -> dict:
    optimizer = model.configure_optimizers()["optimizer"]
    return checkpoint_load.load(path, model, [optimizer], [n for n, _ in model.named_parameters()])


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, GroupedGPT]:
    torch.manual_seed(0)
    model = GroupedGPT(n_layer=2)
    optimizer = _trained(model)
    for group, lr in zip(optimizer.param_groups, (0.25, 0.5)):
        group["lr"] = lr
    _save(tmp_path / "good.ckpt", model, optimizer)
    model.saved_optimizer = optimizer
    return tmp_path / "good.ckpt", model


def test_good_checkpoint_loads(saved) -> None:
    path, model = saved
    fresh = GroupedGPT(n_layer=2)
    optimizer = fresh.configure_optimizers()["optimizer"]
    meta = checkpoint_load.load(path, fresh, [optimizer], [n for n, _ in fresh.named_parameters()])
    assert meta == {"global_step": 2}
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name
    expected = model.saved_optimizer.state_dict()
    loaded = optimizer.state_dict()
    assert loaded["param_groups"] == expected["param_groups"]  # lr 0.25 / 0.5, weight decay 0.1 / 0.0
    for i, entries in expected["state"].items():
        for key, value in entries.items():
            assert torch.equal(loaded["state"][i][key], value), (i, key)


def _copy(path: Path, name: str) -> Path:
    copy = path.with_name(name)
    shutil.copytree(path, copy)
    return copy


def _shard(path: Path) -> Path:
    return max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)


def test_bad_checkpoints_raise_what_is_wrong(saved) -> None:
    path, _ = saved
    missing = _copy(path, "missing.ckpt")
    _shard(missing).unlink()
    truncated = _copy(path, "truncated.ckpt")
    shard = _shard(truncated)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    unfinished = _copy(path, "unfinished.ckpt")
    (unfinished / checkpoint_files.META).unlink()
    damaged_meta = _copy(path, "meta.ckpt")
    (damaged_meta / checkpoint_files.META).write_bytes(b"not a pickle")
    expected = {
        missing: "is missing 1 of its 1 shard files",
        truncated: "is truncated",
        unfinished: "not a complete checkpoint",
        damaged_meta: "meta.pt cannot be read",
        path.with_name("absent.ckpt"): "does not exist",
    }
    for bad, message in expected.items():
        with pytest.raises(CheckpointError, match=message) as err:
            _load(bad, GroupedGPT(n_layer=2))
        assert str(bad) in str(err.value) and "another checkpoint" in str(err.value)
    assert not is_complete(unfinished) and is_complete(path)
    # a different model: wider, deeper, shallower
    with pytest.raises(CheckpointError, match=r"pos has shape \(1, 16, 32\) in the checkpoint, \(1, 16, 16\) in"):
        _load(path, GroupedGPT(n_layer=2, n_embd=16))
    with pytest.raises(CheckpointError, match="has no weights for blocks.2"):
        _load(path, GroupedGPT(n_layer=3))
    with pytest.raises(CheckpointError, match="has weights the model does not have: blocks.1"):
        _load(path, GroupedGPT(n_layer=1))
    # another optimizer
    sgd = TinyGPT(n_layer=2)
    with pytest.raises(CheckpointError, match="no optimizer state .* saved with another optimizer"):
        checkpoint_load.load(path, sgd, [torch.optim.SGD(sgd.parameters(), lr=0.1, momentum=0.9)], [])


def test_fallbacks_skip_bad_checkpoints(saved) -> None:
    path, model = saved
    bad = _copy(path, "bad.ckpt")
    _shard(bad).unlink()
    fresh = GroupedGPT(n_layer=2)
    optimizer = fresh.configure_optimizers()["optimizer"]
    with pytest.warns(UserWarning, match=f"{re.escape(str(bad))}.*missing.*Falling back to {re.escape(str(path))}"):
        checkpoint_load.load(bad, fresh, [optimizer], [], fallbacks=[str(path)])
    assert torch.equal(fresh.wte.weight, model.wte.weight)


def test_interrupted_replacement_leaves_a_loadable_checkpoint(saved) -> None:
    # crashed between moving the old checkpoint aside and moving the new one in: both complete, none in place
    path, model = saved
    old = path.with_name(path.name + ".varuna-old")
    path.rename(old)
    with pytest.warns(UserWarning, match="replacement was interrupted"):
        _load(path, GroupedGPT(n_layer=2))
    checkpoint_publish.recover(checkpoint_files.Location.of(path))  # what rank 0 does before the next save
    assert is_complete(path) and not old.exists()


def _plain_lightning_checkpoint(path: Path, steps: int = 2) -> GroupedGPT:
    torch.manual_seed(0)
    model = GroupedGPT(n_layer=2)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(RandomTokens(n=16, seed=1), batch_size=4))
    trainer.save_checkpoint(path)
    return model


def _assert_same_plain(a: dict, b: dict) -> None:
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for name, tensor in a["state_dict"].items():
        assert torch.equal(tensor, b["state_dict"][name]), name
    for x, y in zip(a["optimizer_states"], b["optimizer_states"], strict=True):
        assert x["param_groups"] == y["param_groups"]
        assert x["state"].keys() == y["state"].keys()
        for i, entries in x["state"].items():
            for key, value in entries.items():
                assert torch.equal(value, y["state"][i][key]), (i, key)
    assert a["lr_schedulers"] == b["lr_schedulers"] and a["global_step"] == b["global_step"]


def test_convert_round_trip_with_two_param_groups(tmp_path: Path) -> None:
    plain = tmp_path / "plain.ckpt"
    model = _plain_lightning_checkpoint(plain)
    # two interleaved groups: the file alone cannot say which index is which parameter
    with pytest.raises(CheckpointError, match="--model"):
        convert.from_plain(plain, tmp_path / "nope")
    assert not (tmp_path / "nope").exists()
    convert.from_plain(plain, tmp_path / "sharded", model=GroupedGPT(n_layer=2))
    assert is_complete(tmp_path / "sharded")
    assert convert.main(["to-plain", str(tmp_path / "sharded"), str(tmp_path / "back.ckpt")]) == 0
    original = torch.load(plain, weights_only=False)
    back = torch.load(tmp_path / "back.ckpt", weights_only=False)
    _assert_same_plain(original, back)
    # the plain file loads without this strategy
    loaded = GroupedGPT.load_from_checkpoint(tmp_path / "back.ckpt")
    assert torch.equal(loaded.blocks[1].mlp[0].weight, model.blocks[1].mlp[0].weight)
    # any fsspec URL: the converted file carries the record, so no model is needed on the way back
    convert.from_plain(tmp_path / "back.ckpt", "memory://convert-test/sharded")
    convert.to_plain("memory://convert-test/sharded", "memory://convert-test/again.ckpt")
    again = checkpoint_files.Location.of("memory://convert-test/again.ckpt")
    with again.fs.open("/convert-test/again.ckpt", "rb") as f:
        _assert_same_plain(original, torch.load(f, weights_only=False))
    checkpoint_files.Location.of("memory://convert-test").remove()


def test_convert_command_line(tmp_path: Path) -> None:
    plain = tmp_path / "plain.ckpt"
    _plain_lightning_checkpoint(plain, steps=1)
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(JOBS), str(ROOT / "tests"), env["PYTHONPATH"]])
    command = [sys.executable, "-m", "lightning_varuna.trainer.convert", "from-plain", str(plain),
               str(tmp_path / "dir")]
    failed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert failed.returncode == 1 and "--model" in failed.stderr
    done = subprocess.run([*command, "--model", "checkpoint_io:GroupedGPT"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert is_complete(tmp_path / "dir")


def _merged(out: Path, name: str, key: str, ranks: int = 4) -> dict:
    merged: dict = {}
    for rank in range(ranks):
        merged.update(rank_result(out, name, rank)[key])
    return merged


@pytest.mark.slow
def test_async_fsspec_checkpoints_convert_and_fall_back(tmp_path: Path) -> None:
    folder = tmp_path / "ckpts"
    url = f"localdisk://{folder}"
    torchrun("checkpoint_io.py", str(tmp_path),
             f"train:pipeline_parallel_size=2,async_checkpoint=true,folder={url},gate=true", timeout=400)
    train = json.loads((tmp_path / "train.rank0.json").read_text())
    # training went on while a checkpoint was being written, which only appeared once complete, and the
    # checkpoint it replaces (save_top_k=1) stayed until then
    overlapped = [s for s in train["seen"] if s["in_flight"] and any(n.endswith(".varuna-tmp") for n in s["names"])]
    assert overlapped, train["seen"]
    # the first of them: the step-2 checkpoint, whose publication the job held back while it looked (saving
    # last.ckpt of the same state right after it did not wait for that write)
    assert overlapped[0]["step"] == 2 and "epoch=0-step=2.ckpt.varuna-tmp" in overlapped[0]["names"], train["seen"]
    assert not (tmp_path / "gate" / "timed-out").exists(), "the first publication waited out its gate"
    first = next(i for i, s in enumerate(train["seen"]) if s["complete"])
    assert all(s["complete"] for s in train["seen"][first:]), train["seen"]
    assert all(set(s["complete"]) == {n for n in s["names"] if n.endswith(".ckpt")} for s in train["seen"])
    # besides the two checkpoints only the lease's generation files (a release leaves one naming no holder)
    assert sorted(n for n in os.listdir(folder) if not n.startswith(".varuna-lease")) == [
        "epoch=1-step=6.ckpt", "last.ckpt"]
    trained = rank_results(tmp_path, "train", 4)
    pids = [t["writer_pid"] for t in trained]
    # the writers ignored SIGTERM, SIGUSR1 and SIGINT sent to them at step 1, and stopped with the run
    assert all(pid is not None and _writer_gone(pid) for pid in pids), pids
    assert all(t["after_complete"] for t in trained)  # a save after fit (no writer left) is complete on return
    final = _merged(tmp_path, "train", "final")

    # to a plain file: loads into the LightningModule, and resumes under Lightning's default strategy
    plain = tmp_path / "plain.ckpt"
    subprocess.run([sys.executable, "-m", "lightning_varuna.trainer.convert", "to-plain", str(folder / "last.ckpt"),
                    str(plain)], check=True, env=_env(), timeout=120, capture_output=True)
    loaded = GroupedGPT.load_from_checkpoint(plain)
    for name, value in loaded.named_parameters():
        assert value.detach().double().flatten().tolist() == pytest.approx(final[name], abs=0), name
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=7, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(GroupedGPT(n_layer=4, sync_dist=True), DataLoader(RandomTokens(n=64, seed=1), batch_size=8),
                    ckpt_path=plain)
    assert trainer.global_step == 7
    plain_state = torch.load(plain, weights_only=False)
    # and back to a sharded directory (the plain file carries the parameter record)
    convert.from_plain(plain, tmp_path / "from-plain.ckpt")

    # damage: last.ckpt loses half a shard (ckpt_path="last" must fall back to epoch=1-step=6.ckpt); a copy of
    # the good one loses a shard (an explicit path must fail on every rank)
    missing = tmp_path / "missing.ckpt"
    shutil.copytree(folder / "epoch=1-step=6.ckpt", missing)
    _shard(missing).unlink()
    shard = _shard(folder / "last.ckpt")
    shard.write_bytes(shard.read_bytes()[:100])
    loads = torchrun("checkpoint_io.py", str(tmp_path),
                     f"last:pipeline_parallel_size=4,folder={url},ckpt=last,steps=7",
                     f"plain:pipeline_parallel_size=1,ckpt={plain},steps=7",
                     f"dir:pipeline_parallel_size=4,ckpt={tmp_path / 'from-plain.ckpt'},steps=7",
                     f"bad:pipeline_parallel_size=2,ckpt={missing},steps=7", timeout=400, check=False)
    output = loads.stdout + loads.stderr
    for name in ("last", "plain", "dir"):
        assert all((tmp_path / f"{name}.rank{r}.json").exists() for r in range(4)), (name, output[-6000:])
    last = json.loads((tmp_path / "last.rank0.json").read_text())
    fell_back = [w for w in last["warnings"] if "last.ckpt" in w and "truncated" in w and "Falling back" in w]
    assert fell_back, last["warnings"]
    exp_avg = plain_state["optimizer_states"][0]["state"]
    # Lightning's plain format: the position in the optimizer's groups, as configure_optimizers builds them
    names = {id(p): n for n, p in loaded.named_parameters()}
    order = [names[id(p)] for g in loaded.configure_optimizers()["optimizer"].param_groups for p in g["params"]]
    watched = order.index(job.WATCHED)
    lrs = [g["lr"] for g in plain_state["optimizer_states"][0]["param_groups"]]
    for name in ("last", "plain", "dir"):
        starts = [run["start"] for run in rank_results(tmp_path, name, 4)]
        assert all(s["global_step"] == 6 for s in starts), name
        assert all(s["lr"] == pytest.approx(lrs) for s in starts), name
        weights = {k: v for s in starts for k, v in s["weights"].items()}
        assert weights.keys() == final.keys()
        for key, value in weights.items():
            assert value == pytest.approx(final[key], abs=1e-7), (name, key)
        held = [s["exp_avg"] for s in starts if s["exp_avg"] is not None]
        assert held and all(e == pytest.approx(exp_avg[watched]["exp_avg"].double().flatten().tolist(), abs=1e-7)
                            for e in held), name
    assert not not_raised(tmp_path, "bad", 4, "missing.ckpt is missing 1 of its"), output[-6000:]
    # nothing good was overwritten or removed by the failed and fallen-back loads
    assert is_complete(folder / "epoch=1-step=6.ckpt") and is_complete(tmp_path / "from-plain.ckpt")


def test_every_rank_raises_the_error_of_a_checkpoint_found_bad_while_loading_itself(tmp_path: Path) -> None:
    """A bad checkpoint's error is raised by every rank itself: rank 0's report of it (which rank 1 waits for
    before it raises) ends no other rank. Errors found by the checks before reading (a missing shard) and after
    the ranks' first agreement (weights the model lacks, a shard DCP cannot read) alike."""
    torch.manual_seed(0)
    four = GroupedGPT(n_layer=4)
    _save(tmp_path / "four.ckpt", four, _trained(four))
    zeroed = _copy(tmp_path / "four.ckpt", "zeroed.ckpt")
    shard = _shard(zeroed)
    shard.write_bytes(bytes(shard.stat().st_size))  # present and long enough: the checks before reading pass
    missing = _copy(tmp_path / "four.ckpt", "missing.ckpt")
    _shard(missing).unlink()
    result = torchrun("checkpoint_io.py", str(tmp_path),
                      f"extra:kind=bad,pipeline_parallel_size=2,ckpt={tmp_path / 'four.ckpt'},n_layer=2,steps=3"
                      ",rank_zero_first=true",
                      f"zeroed:kind=bad,pipeline_parallel_size=2,ckpt={zeroed},steps=3,rank_zero_first=true",
                      f"missing:kind=bad,pipeline_parallel_size=2,ckpt={missing},steps=3,rank_zero_first=true",
                      nproc=2, timeout=400, check=False)
    output = result.stdout + result.stderr
    assert not not_raised(tmp_path, "extra", 2, "has weights the model does not have: blocks.2."), output[-6000:]
    assert not not_raised(tmp_path, "zeroed", 2, f"Could not read {zeroed}"), output[-6000:]
    assert not not_raised(tmp_path, "missing", 2, "missing.ckpt is missing 1 of its"), output[-6000:]
    assert result.returncode == 0 and "Ending rank" not in output, output[-6000:]


def test_strategy_with_async_checkpoint_pickles() -> None:
    import copy
    import pickle

    from lightning_varuna import VarunaStrategy

    strategy = VarunaStrategy(async_checkpoint=True)
    for copied in (copy.deepcopy(strategy), pickle.loads(pickle.dumps(strategy))):
        assert copied._checkpoints.asynchronous and not copied._checkpoints.in_flight


def test_optimizer_state_loads_into_a_stage_that_holds_no_parameter_of_a_group() -> None:
    """A stage may hold none of a group's parameters (e.g. only biases of a 'decay' / 'no decay' split)."""
    from lightning_varuna.checkpoint.state import load_optimizer_state, optimizer_state

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.LayerNorm(4))

    def make() -> torch.optim.Optimizer:
        matrices = [p for p in module.parameters() if p.dim() >= 2]  # none here
        others = [p for p in module.parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1},
                                  {"params": others, "weight_decay": 0.0, "lr": 0.01}])

    saved = make()
    module(torch.randn(3, 4)).sum().backward()
    saved.step()
    saved.param_groups[1]["lr"] = 0.005  # as a scheduler would have set it
    flat = optimizer_state(module, saved)
    fresh = make()
    load_optimizer_state(module, fresh, flat)
    assert fresh.param_groups[0]["weight_decay"] == 0.1 and fresh.param_groups[1]["lr"] == 0.005
    for p in module.parameters():
        for key, value in saved.state[p].items():
            assert torch.equal(fresh.state[p][key], value), key


def test_optimizer_state_read_directly_equals_torchs_flat_state_dict() -> None:
    """The direct read (after the first step) names and holds what torch's ``get_optimizer_state_dict`` gives."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from lightning_varuna.checkpoint.state import optimizer_state

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 5))
    module[2].weight = module[0].weight  # tied: one parameter, two names
    optimizer = torch.optim.AdamW([{"params": [module[0].weight, module[2].bias], "weight_decay": 0.1},
                                   {"params": list(module[1].parameters()), "lr": 0.01, "betas": (0.8, 0.9)}])
    module(torch.tensor([[1, 2, 3]])).sum().backward()
    optimizer.step()
    direct = optimizer_state(module, optimizer)
    torchs = get_optimizer_state_dict(module, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    assert direct.keys() == torchs.keys()
    for key, value in torchs.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(direct[key], value), key
        else:
            assert direct[key] == value, key


def _writer_gone(pid: int) -> bool:
    try:
        return "checkpoint_process" not in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return True


@pytest.mark.slow
def test_a_lost_writer_process_fails_every_rank_and_keeps_the_last_good_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "ckpts"
    run = torchrun("checkpoint_io.py", str(tmp_path),
                   f"kill_writer:pipeline_parallel_size=2,async_checkpoint=true,folder=localdisk://{folder},"
                   "p2p_timeout=30", timeout=300, check=False)
    output = run.stdout + run.stderr
    # rank 1's save at step 4 finds its writer gone; the other writers' write fails without it; ModelCheckpoint's
    # save of last.ckpt at the same step is queued behind it on every rank (no rank waits there), and every rank
    # raises at the next save of a new state, at step 6
    assert not not_raised(tmp_path, "kill_writer", 4, "could not be written"), output[-6000:]
    own = own_errors(tmp_path, "kill_writer", 4)
    assert all(r["error_step"] == 6 for r in own.values()), own
    assert "checkpoint writer process ended" in own[1]["error"], own[1]["error"]
    # the step-2 checkpoints stay complete: nothing replaced or removed them
    assert is_complete(folder / "last.ckpt") and is_complete(folder / "epoch=0-step=2.ckpt"), os.listdir(folder)
    # meta.pt holds an instance of a class of the job's script (its __main__), which the writers never unpickle
    monkeypatch.setattr(sys.modules["__main__"], "ScriptState", job.ScriptState, raising=False)
    meta = checkpoint_files.read_meta(folder / "last.ckpt", weights_only=False)
    assert meta["global_step"] == 2 and type(meta["callbacks"]["Watch"]["marker"]).__name__ == "ScriptState"
    assert all(_writer_gone(r["writer_pid"]) for r in own.values())


def test_removing_a_checkpoint_never_leaves_it_half_deleted_under_its_name(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GroupedGPT(n_layer=2)
    optimizer = _trained(model, steps=1)
    for path in (tmp_path / "old.ckpt", "memory://remove-test/old.ckpt"):
        _save(path, model, optimizer)
        loc = checkpoint_files.Location.of(path)
        moves: list[tuple[str, str]] = []
        original = loc.fs.mv
        def recorded(a, b, *args, moves=moves, original=original, **kw):
            moves.append((a, b))
            return original(a, b, *args, **kw)

        loc.fs.mv = recorded
        try:
            checkpoint_publish.remove_quietly(loc)
        finally:
            del loc.fs.mv
        assert not loc.exists() and not loc.with_suffix(checkpoint_publish.TRASH_SUFFIX).exists()
        if isinstance(path, Path):  # locally, renamed away in one step before the files go
            assert moves == [(loc.path, loc.with_suffix(checkpoint_publish.TRASH_SUFFIX).path)]


def test_the_async_writer_refuses_a_filesystem_defined_in_the_main_script() -> None:
    """The writer processes cannot import ``__main__``'s classes: said before anything is sent to them."""
    from fsspec.implementations.local import LocalFileSystem

    from lightning_varuna.checkpoint.background import WriterProcess

    in_main = type("ScriptFS", (LocalFileSystem,), {"__module__": "__main__"})
    writer = WriterProcess.__new__(WriterProcess)  # no process: the check comes first
    with pytest.raises(ValueError, match="defined in the main script.*async_checkpoint=False"):
        writer.submit(None, [], in_main)
