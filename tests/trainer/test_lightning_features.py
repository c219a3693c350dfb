"""Lightning features under the strategy behave as in the plain single-process Lightning run.

One torchrun job (4 gloo processes) runs every scenario of ``jobs/lightning_features.py``; one plain process
runs the references. Covered: validation with the sanity check, gradient accumulation, ModelCheckpoint,
EarlyStopping and the progress bar during fit; trainer.validate/test/predict on the fitted model; dropout
with and without recompute; the memory counters and the parameters each stage holds; sequence lengths that
change between steps; the LR scheduler and what ``trainer.callback_metrics`` holds; loading the trained module
from a checkpoint directory. The ``parity`` scenarios (``jobs/parity.py``) add: a dry run that leaves no trace,
torchmetrics fed both ways, skipped batches, a callable ``reduce_fx``, the model summary, dataloader hook calls,
prediction writers, and validate/test without a fit.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers.launch import python, torchrun
from helpers.models import TinyGPT
from helpers.results import rank_result, rank_results

from lightning_varuna.trainer.logs.log_sync import LogCapture, reduce_records

REFERENCES = {
    "reference-parity": "kind=parity",
    "reference-fit": "kind=fit",
    "reference-steps": "kind=steps",
    "reference-varlen": "kind=steps,varlen=true",
}
# name -> job spec (batch is per replica: P=2 x D=2 reads 8 + 8 where the reference reads 16)
# (micro-batches of 3: unequal sizes 6/5/5 and 3/3/2, so per-micro-batch logs must be weighted by size)
P4 = "pipeline_parallel_size=4,num_microbatches=4"
CONFIGS = {
    "fit-p2d2": "kind=fit,pipeline_parallel_size=2,num_microbatches=3,batch=8",
    "fit-p4": "kind=fit,pipeline_parallel_size=4,num_microbatches=3",
    # the same stages in both (a "time" partition may differ between runs, and so would the dropout masks)
    "dropout-recompute": f"kind=steps,{P4},dropout=0.1,partition=params",
    "dropout-norecompute": f"kind=steps,{P4},dropout=0.1,partition=params,recompute=false",
    # selective recompute asked to save dropout's random ops: they are recomputed, so the masks stay F's
    "dropout-sac": f"kind=steps,{P4},dropout=0.1,partition=params,policy=dropout",
    # recompute by degree: stages of two segments, the first recomputed, the second's graph kept from the forward
    "dropout-rc1-l8": f"kind=steps,{P4},dropout=0.1,partition=params,recompute=1,layers=8",
    "dropout-norecompute-l8": f"kind=steps,{P4},dropout=0.1,partition=params,recompute=false,layers=8",
    "gpipe-norecompute": f"kind=steps,{P4},schedule=gpipe,recompute=false",
    "varlen-p4": f"kind=steps,{P4},varlen=true",
}
# what a plain run must see alike (jobs/parity.py); P=2 x D=2: a batch skipped on one replica's data only
PARITY = {
    "parity-p2d2": "kind=parity,pipeline_parallel_size=2,num_microbatches=3,batch=8",
    "parity-p4": "kind=parity,pipeline_parallel_size=4,num_microbatches=3,evaluate=false",
}
EVALUATED = [name for name, spec in PARITY.items() if "evaluate=false" not in spec]
FITS = ["fit-p2d2", "fit-p4"]
RECOMPUTE = ["fit-p2d2", "fit-p4", "dropout-recompute", "varlen-p4"]
WORLD = 4
TOLERANCE = 5e-4
WEIGHT_TOLERANCE = 1e-4
"""Weights after a few AdamW steps (lr 1e-3): Adam's first steps are near lr * sign(gradient), so an element whose
gradient is tiny moves by up to 3e-5 more or less when micro-batching rounds its gradient differently; a step taken
or skipped wrongly moves elements by about lr."""


# under pytest-xdist one worker runs all of this module's tests, so its module-scoped jobs run once
pytestmark = pytest.mark.xdist_group("lightning_features")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lightning_features")
    python("lightning_features.py", str(out), *(f"{n}:{s}" for n, s in REFERENCES.items()), timeout=120)
    jobs = {**CONFIGS, **PARITY}
    torchrun("lightning_features.py", str(out), *(f"{n}:{s}" for n, s in jobs.items()), timeout=420)
    return out


def _ranks(results: Path, name: str) -> list[dict]:
    return rank_results(results, name, WORLD)


def _close(got: list[float], want: list[float], what: str, tolerance: float = TOLERANCE) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} values, the plain run has {len(want)}"
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert abs(a - b) < tolerance, f"{what} at step {step}: {a} != {b} (plain run)"


@pytest.mark.slow
@pytest.mark.parametrize("name", FITS)
def test_fit_with_validation_checkpoint_and_accumulation_matches_plain_run(results: Path, name: str) -> None:
    reference = rank_result(results, "reference-fit")
    assert len(reference["losses"]) == 8 and len(reference["val"]) == 2
    for rank, run in enumerate(_ranks(results, name)):
        _close(run["losses"], reference["losses"], f"rank {rank} train_loss")
        assert len(run["val"]) == len(reference["val"])
        for epoch, (got, want) in enumerate(zip(run["val"], reference["val"], strict=True)):
            assert set(got) == set(want), f"rank {rank} epoch {epoch}: logged {sorted(got)}"
            for key in ("val_loss", "val_acc"):
                assert abs(got[key] - want[key]) < TOLERANCE, f"rank {rank} epoch {epoch}: {got} != {want}"
        best, want_best = run["best_score"], reference["best_score"]
        assert abs(best - want_best) < TOLERANCE, f"rank {rank}: best_model_score {best} != {want_best}"
    assert rank_result(results, name, 0)["best_exists"], "rank 0 wrote the best checkpoint"


@pytest.mark.slow
@pytest.mark.parametrize("name", [*FITS, "varlen-p4"])
def test_lr_schedule_and_callback_metrics_hold_the_batch_values(results: Path, name: str) -> None:
    # first_token is logged once per micro-batch with a different value each time: the callback metric must be
    # the whole batch's mean (micro-batches of unequal size weighted by size), as the plain run logs it
    reference = rank_result(results, "reference-varlen" if name == "varlen-p4" else "reference-fit")
    runs = _ranks(results, name)
    for rank, run in enumerate(runs):
        _close(run["first_token"], reference["first_token"], f"rank {rank} callback_metrics['first_token']")
        assert run["lrs"] == reference["lrs"], f"rank {rank}: lr {run['lrs']} != {reference['lrs']}"
    assert len(set(reference["lrs"])) > 1, "the scheduler changed the learning rate during the run"
    # train_acc: a torchmetrics metric called on each (micro-)batch and logged; its step value is the batch's
    # accuracy, unsynced (as under DDP every replica shows its own): every stage of a replica shows the
    # replica's, and the replicas' mean is the plain run's (equal shares)
    pipeline_size = runs[0]["pipeline_size"]
    replicas = [runs[r * pipeline_size]["train_acc"] for r in range(WORLD // pipeline_size)]
    for rank, run in enumerate(runs):
        own = replicas[rank // pipeline_size]
        _close(run["train_acc"], own, f"rank {rank} train_acc_step", tolerance=1e-6)
    mean = [sum(values) / len(values) for values in zip(*replicas, strict=True)]
    _close(mean, reference["train_acc"], "train_acc_step (mean over replicas)")


@pytest.mark.slow
@pytest.mark.parametrize("name", FITS)
def test_metric_epoch_value_counts_only_the_training_batches(results: Path, name: str) -> None:
    reference = [epoch["train_acc_epoch"] for epoch in rank_result(results, "reference-fit")["val"]]
    for rank, run in enumerate(_ranks(results, name)):
        _close([epoch["train_acc_epoch"] for epoch in run["val"]], reference, f"rank {rank} train_acc_epoch")


@pytest.mark.slow
@pytest.mark.parametrize("name", FITS)
def test_validate_test_predict_on_fitted_model_match_plain_run(results: Path, name: str) -> None:
    reference = rank_result(results, "reference-fit")
    runs = _ranks(results, name)
    pipeline_size = runs[0]["pipeline_size"]
    data_size = WORLD // pipeline_size
    for rank, run in enumerate(runs):
        for fn in ("validate", "test"):
            (got,), (want,) = run[fn], reference[fn]
            assert set(got) == set(want), f"rank {rank} trainer.{fn}: {sorted(got)} != {sorted(want)}"
            for key in want:
                assert abs(got[key] - want[key]) < TOLERANCE, f"rank {rank} trainer.{fn}: {got} != {want}"
    # predict: each rank returns its replica's share (as under DDP), equal to the plain run's predictions
    plain = {tuple(inputs): outputs for inputs, outputs in reference["predictions"]}
    samples = [inputs for inputs, _ in reference["predictions"]]
    for rank, run in enumerate(runs):
        replica = rank // pipeline_size
        assert run["num_predictions"] == len(run["predictions"]) == len(samples) // data_size
        assert [inputs for inputs, _ in run["predictions"]] == samples[replica::data_size], (
            f"rank {rank} predicted other samples than replica {replica}'s share"
        )
        for i, (inputs, outputs) in enumerate(run["predictions"]):
            assert outputs == plain[tuple(inputs)], f"rank {rank}: prediction {i} differs from the plain run"


@pytest.mark.slow
@pytest.mark.parametrize("recomputed", ["dropout-recompute", "dropout-rc1-l8", "dropout-sac"])
def test_dropout_same_losses_with_and_without_recompute(results: Path, recomputed: str) -> None:
    plain = recomputed.replace("-recompute", "-norecompute").replace("-rc1", "-norecompute").replace("-sac",
                                                                                                     "-norecompute")
    with_recompute, without = _ranks(results, recomputed), _ranks(results, plain)
    assert with_recompute[0]["plan_segments"] == without[0]["plan_segments"], "the same stages in both"
    if "rc1" in recomputed:  # each non-last stage has a part recomputed and a part kept
        assert all(stop - start >= 2 for start, stop in with_recompute[0]["plan_segments"][:-1])
    for rank, (a, b) in enumerate(zip(with_recompute, without, strict=True)):
        _close(a["losses"], b["losses"], f"rank {rank} loss with recompute vs without", tolerance=1e-6)
    # dropout did act: the losses are not those of the same run without dropout
    no_dropout = rank_result(results, "reference-steps")["losses"]
    if "l8" not in recomputed:
        assert max(abs(a - b) for a, b in zip(with_recompute[0]["losses"], no_dropout, strict=True)) > TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("name", RECOMPUTE)
def test_memory_counters_with_recompute(results: Path, name: str) -> None:
    for run in _ranks(results, name):
        stage, last = run["stage"], run["pipeline_size"] - 1
        if stage == last:
            continue
        assert run["stats"]["peak_live_graphs"] <= 1, f"stage {stage}: {run['stats']}"
        if stage > 0:
            assert run["stats"]["peak_stash_bytes"] > 0, f"stage {stage} stashed no inputs: {run['stats']}"


@pytest.mark.slow
def test_memory_counters_gpipe_without_recompute(results: Path) -> None:
    runs = _ranks(results, "gpipe-norecompute")
    first = next(run for run in runs if run["stage"] == 0)
    assert first["stats"]["peak_live_graphs"] == first["num_microbatches"] == 4
    reference = rank_result(results, "reference-steps")
    for rank, run in enumerate(runs):
        _close(run["losses"], reference["losses"], f"rank {rank} loss")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_rank_holds_only_its_stage_parameters(results: Path, name: str) -> None:
    runs = _ranks(results, name)
    for run in runs:
        numels = {k: run[k] for k in ("local_numel", "plan_numel", "full_numel")}
        assert run["local_numel"] == run["plan_numel"] < run["full_numel"], f"stage {run['stage']}: {numels}"
    assert sum(runs[0]["plan_numels"]) == runs[0]["full_numel"], "no parameter is shared, none is lost"
    assert sorted({run["stage"] for run in runs}) == list(range(runs[0]["pipeline_size"]))


@pytest.mark.slow
def test_process_groups_are_destroyed_at_exit(results: Path) -> None:
    """The job ran six fits, each with its own strategy and groups; none is left alive at exit (gloo aborts)."""
    for rank in range(WORLD):
        assert rank_result(results, "exit", rank) is False, f"rank {rank}"


@pytest.mark.slow
def test_variable_sequence_length_matches_plain_run(results: Path) -> None:
    reference = rank_result(results, "reference-varlen")
    assert len(set(reference["lengths"])) > 1, f"the lengths did not vary: {reference['lengths']}"
    for rank, run in enumerate(_ranks(results, "varlen-p4")):
        assert run["lengths"] == reference["lengths"]
        _close(run["losses"], reference["losses"], f"rank {rank} loss")


def test_logged_values_reduce_to_the_batch_values() -> None:
    # in-process: what the last stage makes of per-micro-batch logs (a number; a Metric called on each)
    module = TinyGPT(n_layer=1)
    capture = LogCapture(module)
    microbatches = [
        (torch.tensor([0, 1, 2]), torch.tensor([0, 0, 0])),
        (torch.tensor([5]), torch.tensor([5])),
    ]
    for k, (preds, target) in enumerate(microbatches):
        capture.microbatch = k
        with capture.capturing():
            module.val_acc(preds, target)
            module.log("acc", module.val_acc)
            module.log("k", float(k), prog_bar=True)
    meta, values = reduce_records(module, capture.records, [3, 1], torch.device("cpu"))
    assert meta == (("acc", "val_acc", (), True), ("k", None, (("prog_bar", True),), True))
    assert [float(v) for v in values] == [pytest.approx(2 / 4), pytest.approx(1 / 4)]
    assert float(module.val_acc.compute()) == pytest.approx(2 / 4), "the state holds both micro-batches"


# -- parity with the plain run (jobs/parity.py) ----------------------------------------------------------------


def _same_or_both_nan(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} values, the plain run has {len(want)}"
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        if math.isnan(b):
            assert math.isnan(a), f"{what} at step {step}: {a}, the plain run logged NaN"
        else:
            assert abs(a - b) < TOLERANCE, f"{what} at step {step}: {a} != {b} (plain run)"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PARITY))
def test_the_dry_run_leaves_no_trace_in_the_model_or_the_rngs(results: Path, name: str) -> None:
    # at on_fit_start the dry run has called training_step 5 times: no metric count, list entry, attribute,
    # buffer change or RNG draw of it may remain
    reference = rank_result(results, "reference-parity")["fit_start"]
    assert reference["token_loss_updates"] == 0 and not reference["has_last_batch_idx"]
    for rank, run in enumerate(_ranks(results, name)):
        differing = {k: (v, reference[k]) for k, v in run["fit_start"].items() if v != reference[k]}
        assert differing == {}, f"rank {rank}: (got, plain run) {differing}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PARITY))
def test_metrics_fed_by_update_or_forward_and_callable_reduce_fx_match_the_plain_run(results: Path, name: str) -> None:
    reference = rank_result(results, "reference-parity")["epochs"]
    assert [e["last_batch"] for e in reference] == [3.0, 3.0], "reduce_fx=torch.max (not the mean)"
    for rank, run in enumerate(_ranks(results, name)):
        assert len(run["epochs"]) == len(reference) == 2
        for key in ("token_loss", "train_acc", "last_batch"):
            _close([e[key] for e in run["epochs"]], [e[key] for e in reference], f"rank {rank} {key} per epoch")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PARITY))
def test_batches_skipped_before_the_forward_or_after_the_loss_match_the_plain_run(results: Path, name: str) -> None:
    plain = rank_result(results, "reference-parity")
    assert sum(math.isnan(v) for v in plain["losses"]) == 2, "batch 1 and (logging nothing) batch 2 of epoch 0"
    held: dict[str, list[float]] = {}
    for rank, run in enumerate(_ranks(results, name)):
        _same_or_both_nan(run["losses"], plain["losses"], f"rank {rank} train_loss")
        held.update(run["weights"])
        for param, values in run["weights"].items():
            worst = max(abs(a - b) for a, b in zip(values, plain["weights"][param], strict=True))
            assert worst < WEIGHT_TOLERANCE, f"rank {rank}: {param} differs from the plain run's by {worst}"
    assert set(held) == set(plain["weights"]), "every trained parameter is held (and checked) on some stage"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PARITY))
def test_the_model_summary_describes_the_whole_model(results: Path, name: str) -> None:
    plain = rank_result(results, "reference-parity")["summary"]
    assert plain["trainable"] < plain["total"], "some parameters are frozen (on the last stage)"
    assert rank_result(results, name)["summary"] == plain
    assert all(rank_result(results, name, rank)["summary"] is None for rank in range(1, WORLD)), "printed by rank 0"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PARITY))
def test_train_dataloader_is_requested_as_often_as_in_the_plain_run(results: Path, name: str) -> None:
    # reload_dataloaders_every_n_epochs=1 over two epochs: two calls, the strategy's dry run batch included
    calls = [run["loader_calls"] for run in _ranks(results, name)]
    assert calls == [rank_result(results, "reference-parity")["loader_calls"]] * WORLD == [2] * WORLD


@pytest.mark.slow
@pytest.mark.parametrize("name", EVALUATED)
def test_a_prediction_writer_writes_once_per_replica(results: Path, name: str) -> None:
    pipeline_size = int(PARITY[name].split("pipeline_parallel_size=")[1].split(",")[0])
    written = sorted((results / f"predictions-{name}").glob("*.json"))
    writers = {path.name.split("-")[0] for path in written}
    assert writers == {f"rank{r}" for r in range(0, WORLD, pipeline_size)}, "the first stage of each replica"
    plain = {}
    for path in (results / "predictions-reference-parity").glob("*.json"):
        record = json.loads(path.read_text())
        plain.update(zip(record["indices"], record["predictions"], strict=True))
    got = {}
    for path in written:
        record = json.loads(path.read_text())
        for index, prediction in zip(record["indices"], record["predictions"], strict=True):
            assert index not in got, f"sample {index} written twice"
            got[index] = prediction
    assert got == plain


@pytest.mark.slow
@pytest.mark.parametrize("name", EVALUATED)
def test_validate_and_test_without_a_fit_match_the_plain_run(results: Path, name: str) -> None:
    # the dry run of validation_step runs in training mode: it must not move the BatchNorm statistics, nor leave
    # its samples in val_acc (fed with .update())
    plain = rank_result(results, "reference-parity")
    for rank, run in enumerate(_ranks(results, name)):
        _close(run["running_mean"], plain["running_mean"], f"rank {rank} BatchNorm running_mean", tolerance=1e-7)
        for fn in ("validate", "test"):
            (got,), (want,) = run[fn], plain[fn]
            assert set(got) == set(want), f"rank {rank} trainer.{fn}: {sorted(got)} != {sorted(want)}"
            for key in want:
                assert abs(got[key] - want[key]) < TOLERANCE, f"rank {rank} trainer.{fn}: {got} != {want}"


def test_a_reduce_fx_callable_travels_by_name_and_a_custom_one_gets_lightnings_error() -> None:
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    module = TinyGPT(n_layer=1)
    capture = LogCapture(module)
    with capture.capturing():
        module.log("a", 1.0, reduce_fx=torch.max)
        module.log("b", 1.0, reduce_fx=min)
        module.log("c", 1.0, reduce_fx="sum")
    meta, _ = reduce_records(module, capture.records, [1], torch.device("cpu"))
    assert [dict(frozen)["reduce_fx"] for _, _, frozen, _ in meta] == ["max", "min", "sum"]
    with capture.capturing(), pytest.raises(MisconfigurationException, match=r"Only `self.log\(..., reduce_fx="):
        module.log("d", 1.0, reduce_fx=lambda x: x.median())


@pytest.mark.slow
@pytest.mark.parametrize("name", FITS)
def test_load_from_checkpoint_returns_the_whole_trained_module(results: Path, name: str) -> None:
    import lightning_varuna

    (plain_file,) = (results / "ckpt-reference-fit").glob("*.ckpt")
    (directory,) = (results / f"ckpt-{name}").glob("*.ckpt")
    assert plain_file.name == directory.name and directory.is_dir()
    plain = TinyGPT.load_from_checkpoint(plain_file)
    loaded = lightning_varuna.load_from_checkpoint(TinyGPT, directory, map_location="cpu", lr=0.5)
    assert isinstance(loaded, TinyGPT) and loaded.hparams.lr == 0.5 and loaded.hparams.sync_dist
    want, got = plain.state_dict(), loaded.state_dict()
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.allclose(got[key], value, rtol=0, atol=WEIGHT_TOLERANCE), key
    torch.manual_seed(0)
    initial = TinyGPT(sync_dist=True).state_dict()
    assert max(float((got[k] - initial[k]).abs().max()) for k in got) > 10 * WEIGHT_TOLERANCE, "trained weights"
    # Lightning's own loader reads single files; the directory says what to use instead
    with pytest.raises(IsADirectoryError):
        TinyGPT.load_from_checkpoint(directory)
    assert "lightning_varuna.load_from_checkpoint(MyModule" in (directory / "README.txt").read_text()
