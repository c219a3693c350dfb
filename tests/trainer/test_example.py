"""The main example runs as documented: LightningCLI, Lightning's own launcher, 4 CPU processes."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers.launch import _env, run_checked

from lightning_varuna import VarunaStrategy

# the CLI reads a number given on the command line as a float: "1" would be 1.0, every validation batch; "2" is
# 2.0, which Lightning takes as 2 batches
SHORT = ["--trainer.max_steps", "4", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "2",
         "--trainer.logger", "false", "--trainer.enable_progress_bar", "false"]


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    # the example runs clean: any warning of ours is an error, in every rank (Lightning's launcher passes the
    # environment on)
    command = [sys.executable, "examples/gpt/train.py", *args]
    result = run_checked(command, timeout, env={**_env(), "PYTHONWARNINGS": "error::lightning_varuna.VarunaWarning"})
    assert result.returncode == 0, f"{' '.join(command)}:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


# the registered name's example chooses P automatically (a profiling run first): CI trains the README's config only
@pytest.mark.slow
@pytest.mark.parametrize("config", ["config.yaml", pytest.param("config_registered.yaml", marks=pytest.mark.full)])
def test_example_trains_on_four_processes(config: str, tmp_path) -> None:
    result = _cli("fit", "--config", f"examples/gpt/{config}", *SHORT,
                  "--trainer.callbacks.dirpath", str(tmp_path / "checkpoints"))
    output = result.stdout + result.stderr
    assert "VarunaStrategy:" in output and "replica(s)" in output
    assert "`Trainer.fit` stopped: `max_steps=4` reached." in output
    assert "100% of the batches will be used" not in output


def test_the_registered_name_is_the_strategy_with_its_defaults() -> None:
    import lightning.pytorch as pl

    trainer = pl.Trainer(strategy="varuna", accelerator="cpu", devices=4, logger=False, enable_progress_bar=False)
    assert type(trainer.strategy) is VarunaStrategy
    assert trainer.strategy.num_processes == 4
    defaults = VarunaStrategy()
    assert trainer.strategy.pipeline_parallel_size == defaults.pipeline_parallel_size == "auto"
    assert trainer.strategy.config == defaults.config


def test_strategy_arguments_are_documented_for_the_cli() -> None:
    result = _cli("fit", "--trainer.strategy.help", "lightning_varuna.VarunaStrategy", timeout=120)
    for argument in ("pipeline_parallel_size", "num_microbatches", "schedule", "recompute", "cut_at", "memory_limit",
                     "profile", "timeline_dir"):
        assert f"--trainer.strategy.{argument}" in result.stdout
    assert "Micro-batches per batch" in result.stdout


def test_strategy_option_types_are_the_engine_configs_and_parse_in_the_cli() -> None:
    from typing import get_args

    from jsonargparse import ArgumentParser

    from lightning_varuna.pipeline import config
    from lightning_varuna.pipeline.scheduling.schedules import SCHEDULES

    assert set(get_args(config.ScheduleName)) == {*SCHEDULES, config.AUTO}, "every schedule is a CLI choice"
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(VarunaStrategy, "strategy")
    parsed = parser.parse_args(["--strategy.schedule=zero-bubble", "--strategy.recompute=2",
                                "--strategy.microbatch_size=auto", "--strategy.stages_per_rank=2",
                                "--strategy.zero_stage=1", "--strategy.partition=params"]).strategy
    assert (parsed.schedule, parsed.recompute, parsed.microbatch_size) == ("zero-bubble", 2, "auto")
    assert (parsed.stages_per_rank, parsed.zero_stage, parsed.partition) == (2, 1, "params")
    for bad in ("--strategy.schedule=nope", "--strategy.partition=layers", "--strategy.zero_stage=2"):
        with pytest.raises(Exception, match="Expected a typing.Literal"):
            parser.parse_args([bad])
