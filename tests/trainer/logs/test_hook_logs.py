"""What on_before_optimizer_step logs on each stage, merged over the pipeline (the merge rules, in one process)."""

from __future__ import annotations

import pytest
import torch

from lightning_varuna.trainer.logs.hook_logs import _recipe, merge


def test_merge_unions_keys_and_recomputes_totals() -> None:
    norms = {"grad_2.0_norm/a": 3.0, "grad_2.0_norm/tied": 4.0, "grad_2.0_norm/b": 12.0}
    # stage 0 holds a and the tied copy, stage 1 the tied copy and b; each logs its local total
    stage0 = {"grad_2.0_norm/a": 3.0, "grad_2.0_norm/tied": 4.0, "grad_2.0_norm_total": 5.0, "lr": 0.1}
    stage1 = {"grad_2.0_norm/tied": 4.0, "grad_2.0_norm/b": 12.0, "grad_2.0_norm_total": 160**0.5, "lr": 0.2}
    metas = [tuple((k, ()) for k in stage) for stage in (stage0, stage1)]
    flat = torch.tensor([*stage0.values(), *stage1.values()], dtype=torch.float64)
    merged = {name: float(value) for name, value, _ in merge(_recipe(metas, torch.device("cpu")), flat)}
    assert set(merged) == {*norms, "grad_2.0_norm_total", "lr"}
    assert merged["grad_2.0_norm_total"] == pytest.approx(13.0)  # sqrt(9 + 16 + 144): the tied one once
    assert merged["lr"] == 0.1  # logged on several stages: the first stage's
    assert {k: merged[k] for k in norms} == norms


def test_merge_of_inf_norms_and_of_totals_alone() -> None:
    metas = [(("grad_inf_norm/a", ()), ("grad_inf_norm_total", ())),
             (("grad_inf_norm/b", ()), ("grad_inf_norm_total", ()))]
    flat = torch.tensor([2.0, 2.0, 7.0, 7.0], dtype=torch.float64)
    merged = {n: float(v) for n, v, _ in merge(_recipe(metas, torch.device("cpu")), flat)}
    assert merged["grad_inf_norm_total"] == 7.0
    metas = [(("grad_2.0_norm_total", ()),), (("grad_2.0_norm_total", ()),)]
    flat = torch.tensor([3.0, 4.0], dtype=torch.float64)
    merged = {n: float(v) for n, v, _ in merge(_recipe(metas, torch.device("cpu")), flat)}
    assert merged["grad_2.0_norm_total"] == pytest.approx(5.0)
