"""Job morphing: a checkpoint written mid-epoch under one P x D resumes under another on the same trajectory.

Each checkpoint is written by one job and resumed by later, separate jobs (fresh processes, as a restarted job
would be). The jobs are batched: the writers run in one 4-process job, the 4-process resumes in another and the
2-process resume in a third, so the module starts four jobs, not one per run. The checkpoints written and resumed
with two model chunks per rank (two -> one, and over the V-shaped placement) run with ``VARUNA_SCHEDULES=full`` (or
``VARUNA_TESTS=full``); CI resumes a checkpoint of one chunk per rank with two.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.launch import python, torchrun
from helpers.on_demand import wanted
from helpers.results import rank_result

from lightning_varuna.checkpoint import is_complete

# P=2 x D=2 and P=4 x D=1 with the same global batch: 16 samples per step whatever D is, and the resumable sampler
# makes every resumed step read exactly the samples the uninterrupted run reads
COMMON = "pipeline_parallel_size=2,num_microbatches=4,global_batch_size=16,batch=5"
P4 = "pipeline_parallel_size=4,num_microbatches=4,global_batch_size=16,batch=5"
WRITERS = {  # name -> (options, reference), each trained 4 of an epoch's 8 steps and saved at step 4
    "first-1f1b": (COMMON, "reference"),
}
RESUMES_ON_FOUR = {  # name -> (options, the writer whose checkpoint it resumes)
    "p4-from-1f1b": (P4, "first-1f1b"),
    # one chunk per rank -> two (interleaved, P=2 x D=2: four stages on two ranks)
    "chunks-from-1f1b": (f"{COMMON},schedule=interleaved,stages_per_rank=2", "first-1f1b"),
}
RESUMES_ON_TWO = {"two-from-1f1b": (COMMON, "first-1f1b")}  # P=2 x D=1
WRITTEN_WITH_TWO = wanted(part="SCHEDULES")
if WRITTEN_WITH_TWO:
    WRITERS.update({
        "first-il": (f"{COMMON},schedule=interleaved,stages_per_rank=2", "reference"),
        # the V schedule: stages 0 and 3 on rank 0, with the tied embedding, 1 and 2 on rank 1
        "first-zbv": (f"{COMMON},tie=true,schedule=zero-bubble-v,stages_per_rank=2", "reference-tied"),
    })
    RESUMES_ON_FOUR.update({
        "p4-from-il": (f"{P4},schedule=1f1b", "first-il"),
        # the looped placement's checkpoint resumed V-shaped (rank 0 now holds stages 0 and 3, rank 1 stages 1, 2)
        "v-from-il": (f"{COMMON},schedule=zero-bubble-v,stages_per_rank=2", "first-il"),
        # the V-shaped checkpoint resumed looped (zero-bubble: stages 0 and 2 on rank 0) and with one chunk per rank
        "looped-from-zbv": (f"{COMMON},tie=true,schedule=zero-bubble,stages_per_rank=2", "first-zbv"),
        "p4-from-zbv": (f"{P4},tie=true,schedule=1f1b", "first-zbv"),
    })

pytestmark = pytest.mark.xdist_group("resume")


def _ckpt(out: Path, writer: str) -> Path:
    return out / writer / "ckpt.ckpt"


def _specs(out: Path, runs: dict[str, tuple[str, str]]) -> list[str]:
    return [f"{name}:{options},resume={_ckpt(out, writer)}" for name, (options, writer) in runs.items()]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("resume")
    references = ["reference:epoch_steps=8"] + (["reference-tied:epoch_steps=8,tie=true"] if WRITTEN_WITH_TWO else [])
    python("equivalence.py", str(out), *references)
    torchrun("equivalence.py", str(out), *(f"{name}:{options},steps=4,save_every=4,save_dir={out / name}"
                                           for name, (options, _) in WRITERS.items()), timeout=600)
    torchrun("equivalence.py", str(out), *_specs(out, RESUMES_ON_FOUR), timeout=600)
    torchrun("equivalence.py", str(out), *_specs(out, RESUMES_ON_TWO), nproc=2, timeout=600)
    return out


def _losses(out: Path, name: str) -> list[float]:
    return rank_result(out, name)["losses"]


def _reference_of(run: str) -> str:
    writer = run if run in WRITERS else {**RESUMES_ON_FOUR, **RESUMES_ON_TWO}[run][1]
    return WRITERS[writer][1]


def _check_resumed(out: Path, *names: str) -> None:
    for name in names:
        reference = _losses(out, _reference_of(name))
        assert len(reference) == 8
        resumed = _losses(out, name)
        assert len(resumed) == 4, name
        assert resumed == pytest.approx(reference[4:], abs=5e-4), name


@pytest.mark.slow
@pytest.mark.parametrize("writer", list(WRITERS))
def test_the_first_half_matches_the_uninterrupted_run_and_leaves_a_complete_checkpoint(results: Path,
                                                                                      writer: str) -> None:
    assert is_complete(_ckpt(results, writer)) and not list((results / writer).glob("*.varuna-tmp"))
    assert _losses(results, writer) == pytest.approx(_losses(results, _reference_of(writer))[:4], abs=5e-4)


@pytest.mark.slow
def test_mid_epoch_checkpoint_from_p2d2_resumes_under_p4d1_on_two_processes_and_with_two_chunks(results: Path) -> None:
    """Trained 4 of an epoch's 8 steps at P=2 x D=2, resumed at P=4 x D=1, at P=2 x D=1 on 2 processes and with
    two model chunks per rank."""
    _check_resumed(results, "p4-from-1f1b", "two-from-1f1b", "chunks-from-1f1b")


@pytest.mark.slow
@pytest.mark.skipif(not WRITTEN_WITH_TWO, reason="on demand: VARUNA_SCHEDULES=full or VARUNA_TESTS=full")
def test_a_checkpoint_written_with_two_chunks_per_rank_resumes_with_one(results: Path) -> None:
    """Written at P=2 x D=2 with two model chunks per rank (interleaved), resumed at P=4 x D=1 with one (1F1B)."""
    _check_resumed(results, "p4-from-il")


@pytest.mark.slow
@pytest.mark.skipif(not WRITTEN_WITH_TWO, reason="on demand: VARUNA_SCHEDULES=full or VARUNA_TESTS=full")
def test_checkpoints_move_between_the_looped_and_the_v_shaped_placement(results: Path) -> None:
    """The interleaved checkpoint resumed V-shaped; one written by the V schedule with a tied embedding resumed
    with the same four stages looped and at P=4 x D=1."""
    _check_resumed(results, "v-from-il", "looped-from-zbv", "p4-from-zbv")
