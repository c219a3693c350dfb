"""Third-party architectures (``tests/helpers/zoo_models.py``) trained pipelined equal their plain single-process runs.

Every family x configuration trains 8 AdamW steps (lr 1e-2) on tiny models built in code (no downloads) and is
compared with the plain ``Trainer(devices=1)`` run on the same batches: fp32 losses within 5e-4 at every step and
every parameter's step-1 gradient within 1e-5 (each parameter held by some rank); bf16-mixed losses within 2e-2.

CI runs P=2 built in ``__init__`` for every family, and with compiled blocks (``aot_eager``) for Llama. The full
matrix (P=2, P=4, P=2 x D=2, built on meta in ``configure_model`` with ``initial_weights``, bf16-mixed, blocks
compiled by ``aot_eager`` and by ``inductor`` from a fresh cache, and for GPT-2, Llama and litgpt the rest of that
matrix with compiled blocks (P=4, P=2 x D=2, built on meta and compiled in ``configure_model``, bf16-mixed), peft
LoRA adapters, Hugging Face's own gradient checkpointing, ``validate`` and ``predict`` after training) runs with
``VARUNA_ZOO=full``, ``VARUNA_TESTS=full`` or ``-m zoo``; ``VARUNA_ZOO_OUT=DIR`` keeps the results there for
``python tests/helpers/zoo_table.py DIR`` (and with ``VARUNA_ZOO_REUSE=1`` the results already there are judged
again instead of rerun).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers.launch import python, torchrun
from helpers.on_demand import wanted
from helpers.zoo_models import FAMILIES
from helpers.zoo_results import (
    CONFIGS,
    ROUTER,
    STEPS,
    applies,
    error_of,
    in_ci,
    judge,
    reference_of,
    run_specs,
    specs_of,
)

# family x configuration the current engine cannot train (measured, tests/helpers/zoo_table.py): strict, so a fix makes
# them fail until removed here
EXPECTED_FAILURES: dict[tuple[str, str], str] = {}

# the first test's timeout includes the module's jobs (the full matrix: about 7 minutes on 2 busy cores)
pytestmark = [pytest.mark.xdist_group("zoo"), pytest.mark.zoo, pytest.mark.timeout(2400)]


def _full(config: pytest.Config) -> bool:
    return wanted(config, "ZOO", marker="zoo")


def _params() -> list:
    params = []
    for family in FAMILIES:
        for config in filter(lambda c, f=family: applies(f, c), CONFIGS):
            marks = [pytest.mark.slow]
            reason = EXPECTED_FAILURES.get((family, config))
            if reason is not None:
                marks.append(pytest.mark.xfail(reason=reason, strict=True))
            params.append(pytest.param(family, config, marks=marks, id=f"{family}-{config}"))
    return params


def _selected(request: pytest.FixtureRequest) -> list[tuple[str, str]]:
    """The family x configuration pairs of this module's selected tests that will run (not skipped)."""
    full = _full(request.config)
    pairs = []
    for item in request.session.items:
        spec = getattr(item, "callspec", None)
        if item.module is request.module and spec is not None and {"family", "config"} <= set(spec.params):
            if full or in_ci(spec.params["family"], spec.params["config"]):
                pairs.append((spec.params["family"], spec.params["config"]))
    return pairs


@pytest.fixture(scope="module")
def zoo_results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = Path(os.environ["VARUNA_ZOO_OUT"]) if os.environ.get("VARUNA_ZOO_OUT") else tmp_path_factory.mktemp("zoo")
    out.mkdir(parents=True, exist_ok=True)
    pairs = _selected(request)
    # the fp32 reference writes the weights the meta-built runs load: it runs for every family in use (but those
    # compared with the plain run of their micro-batches, which never build on meta)
    references = [f"{f}:ref" for f in dict.fromkeys(f for f, _ in pairs) if f not in ROUTER]
    references += list(dict.fromkeys(f"{f}:{reference_of(f, c)}" for f, c in pairs if reference_of(f, c) != "ref"))
    if not os.environ.get("VARUNA_ZOO_REUSE"):  # else the results already in VARUNA_ZOO_OUT are judged again
        for spec in [*references, *(f"{f}:{c}" for f, c in pairs)]:
            for stale in out.glob(f"{spec.replace(':', '.')}.*"):
                stale.unlink()
    run_specs(out, references, lambda *args: python("zoo.py", *args, timeout=900, check=False))
    replayed: list[int] = []

    def launch(*args: str, processes: int):
        job = torchrun("zoo.py", *args, nproc=processes, timeout=1800, check=False)
        replayed.append(job.p2p_steps)
        return job

    pipelined = [f"{f}:{c}" for f, c in pairs]
    todo = specs_of(out, pipelined)
    for processes in sorted({CONFIGS[c][0] for _, c in pairs}):
        specs = [s for s in pipelined if CONFIGS[s.partition(":")[2]][0] == processes]
        run_specs(out, specs, lambda *args, n=processes: launch(*args, processes=n))
    # every step of every pipelined run that trained was replayed under NCCL's rules (a deadlock fails here)
    trained = [s for s in todo if error_of(out, *s.split(":")) is None]
    assert sum(replayed) >= STEPS * len(trained), (sum(replayed), trained)
    return out


@pytest.mark.parametrize(("family", "config"), _params())
def test_zoo_model_matches_plain_run(request: pytest.FixtureRequest, zoo_results: Path, family: str,
                                     config: str) -> None:
    if not in_ci(family, config) and not _full(request.config):
        pytest.skip("full zoo matrix: VARUNA_ZOO=full or -m zoo")
    verdict = judge(zoo_results, family, config)
    detail = "\n".join(verdict.problems[:8])
    if verdict.zeroed:
        detail += f"\nall-zero gradients (the reference's are not): {verdict.zeroed}"
    assert verdict.ok, f"{family} {config}: {detail}"


def _write(folder: Path, name: str, runs: list[dict]) -> None:
    for rank, run in enumerate(runs):
        (folder / f"{name}.rank{rank}.json").write_text(json.dumps(run))


def test_the_comparison_finds_a_zeroed_gradient_and_an_unheld_parameter(tmp_path: Path) -> None:
    """The judge is not blind: a gradient a stage got as zeros, or a parameter no rank holds, fails the pair."""
    losses = [1.0] * 8
    grads = {"a": [0.5, -0.25], "b": [1.0, 2.0], "c": [3.0]}
    _write(tmp_path, "m.ref", [{"losses": losses, "grads": grads}])
    _write(tmp_path, "m.p2", [{"losses": losses, "grads": {"a": grads["a"]}, "stage": 0},
                              {"losses": losses, "grads": {"b": grads["b"], "c": grads["c"]}, "stage": 1}])
    assert judge(tmp_path, "m", "p2").ok
    _write(tmp_path, "m.p2", [{"losses": losses, "grads": {"a": grads["a"]}, "stage": 0},
                              {"losses": losses, "grads": {"b": [0.0, 0.0], "c": grads["c"]}, "stage": 1}])
    verdict = judge(tmp_path, "m", "p2")
    assert not verdict.ok and verdict.differing == ["b"] and verdict.zeroed == ["b"]
    _write(tmp_path, "m.p2", [{"losses": losses, "grads": {"a": grads["a"]}, "stage": 0},
                              {"losses": [1.0] * 7 + [1.001], "grads": {"b": grads["b"]}, "stage": 1}])
    problems = judge(tmp_path, "m", "p2").problems
    assert any("held by no rank" in p for p in problems) and any("step 7" in p for p in problems)


def test_a_reference_job_that_dies_is_recorded_and_fails_its_pairs(tmp_path: Path) -> None:
    """A plain reference run that ends without a result (a one-process job) fails the pairs that compare with it,
    naming its error, rather than stopping the whole module."""
    def launch(out: str, *specs: str) -> subprocess.CompletedProcess:
        (Path(out) / f"{specs[0].replace(':', '.')}.started").touch()
        return subprocess.CompletedProcess([], 1, "", "Traceback ...\nRuntimeError: the compiler failed\n")

    run_specs(tmp_path, ["m:ref-inductor"], launch)
    assert error_of(tmp_path, "m", "ref-inductor") == "RuntimeError: the compiler failed"
    _write(tmp_path, "m.inductor-p2", [{"losses": [1.0] * 8, "grads": {}, "stage": s} for s in range(2)])
    verdict = judge(tmp_path, "m", "inductor-p2")
    assert not verdict.ok and "the compiler failed" in verdict.problems[0]
