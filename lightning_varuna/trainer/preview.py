r"""Preview a pipeline job without training: ``varuna-preview --config config.yaml --devices N``.

It builds the model, the data and the strategy from a LightningCLI config (as ``fit`` would), profiles the model
in this process (or reads ``--profile``; measured profiles are cached), and prints every valid configuration for
N devices of this kind, ranked by predicted step time, with the predicted peak memory per stage; ``--json`` prints
the same for scripts. The strategy's ``"auto"`` values are searched, its other values kept; ``--auto`` searches
P, micro-batches, schedule and recompute whatever the config says. Layers built in ``configure_model`` are built
for real here, or with ``--meta`` on the meta device (as the strategy builds them) and profiled a segment at a time.

Examples::

    python -m lightning_varuna.trainer.preview --config examples/gpt/config.yaml --model examples/gpt/model.py:GPT \\
        --data examples/gpt/data.py:StdlibText --devices 8 --auto --global-batch-size 32
    python -m lightning_varuna.trainer.preview ... --devices 16 --devices-per-node 8 --bandwidth 10Gbit --memory 80GiB

The model and data classes come from ``--model``/``--data`` (``package.module:Class`` or ``path/file.py:Class``),
or from ``class_path`` entries in the config. Arguments the planner does not know are passed on to the
LightningCLI (e.g. ``--trainer.strategy.init_args.schedule auto``). Argument links a script's own LightningCLI
subclass makes (``link_arguments``) are not applied: set those values in the config.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import re
import sys
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import move_data_to_device

from lightning_varuna.pipeline.batches import is_meta_batch
from lightning_varuna.pipeline.config import EngineConfig
from lightning_varuna.pipeline.engine import batch_size_of, default_loss, first_samples, samples
from lightning_varuna.pipeline.model.cut import check_cut_at_order, install_cut_at
from lightning_varuna.pipeline.model.dry_run import trace_step
from lightning_varuna.pipeline.model.meta_init import (
    has_meta_tensors,
    move_real_tensors,
    parameters_on_meta,
    to_meta,
    trace_unmaterialized,
)
from lightning_varuna.pipeline.planning.choice import PlannerChoice, plan
from lightning_varuna.pipeline.planning.memory_model import MEMORY_RESERVE, format_bytes, parse_bytes
from lightning_varuna.pipeline.planning.profile_data import Network, Profile, ProfileError, default_network
from lightning_varuna.pipeline.planning.search import Candidate, Cluster, PlanError, format_table
from lightning_varuna.pipeline.timelines.picture import render_png
from lightning_varuna.pipeline.timelines.timeline import predicted_events, write_chrome_trace
from lightning_varuna.trainer.module_setup import boundary_dtype
from lightning_varuna.trainer.patches import meta_dry_run
from lightning_varuna.trainer.reports import optimizer_spec
from lightning_varuna.trainer.strategy import VarunaStrategy

__all__ = ["main", "parse_bandwidth", "parse_seconds"]


def main(argv: list[str] | None = None) -> int:
    """Runs the planner (see the module's docstring); returns the exit status."""
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    try:
        model, data, trainer = _build(args, rest)
        autoconfig = _plan(args, model, data, trainer)
    except (PlanError, ProfileError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.save_profile:
        autoconfig.profile.save(args.save_profile)
    if args.timeline:
        _timeline(autoconfig, Path(args.timeline))
    if args.json:
        print(json.dumps(_as_json(autoconfig, args), indent=1))
    else:
        _print(autoconfig, args)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="varuna-preview", description=__doc__.split("\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("--config", action="append", default=[], help="LightningCLI config file (repeatable)")
    parser.add_argument("--model", help="the LightningModule class: package.module:Class or path/file.py:Class")
    parser.add_argument("--data", help="the LightningDataModule class, likewise")
    parser.add_argument("--devices", type=int, required=True, help="processes (devices) to plan for")
    parser.add_argument("--devices-per-node", type=int, help="processes per node (default: all on one node)")
    parser.add_argument("--memory", help="memory a stage may use, e.g. 80GiB (default: the strategy's memory_limit,"
                                         " else the device's memory, or the CPU's shared by the node's processes)")
    parser.add_argument("--bandwidth", help="between nodes, e.g. 100Gbit or 12.5GB (bytes per second unless bit)")
    parser.add_argument("--latency", help="between nodes, e.g. 20us or 0.5ms")
    parser.add_argument("--intra-bandwidth", help="inside a node (default: measured in the profile, or stated)")
    parser.add_argument("--intra-latency", help="inside a node")
    parser.add_argument("--global-batch-size", type=int, help="instead of the strategy's global_batch_size")
    parser.add_argument("--auto", action="store_true", help="search P, micro-batches, schedule and recompute")
    parser.add_argument("--meta", action="store_true",
                        help="build configure_model's layers on the meta device, as the strategy does, and profile"
                             " the model a segment at a time (for a model larger than this machine)")
    parser.add_argument("--profile", help="a profile file to plan from instead of measuring")
    parser.add_argument("--save-profile", help="write the profile used to this file")
    parser.add_argument("--timeline", help="write the chosen and the runner-up's predicted timelines (PNG) here")
    parser.add_argument("--top", type=int, default=10, help="rows of the table (0: all)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return parser


def _import(spec: str) -> type:
    """``package.module:Class``, ``package.module.Class`` or ``path/file.py:Class``."""
    module_name, _, name = spec.rpartition(":") if ":" in spec else spec.rpartition(".")
    if module_name.endswith(".py"):
        path = Path(module_name).resolve()
        sys.path.insert(0, str(path.parent))  # the file's sibling modules import as they would from a script
        loaded = importlib.util.spec_from_file_location(path.stem, path)
        if loaded is None or loaded.loader is None:
            raise ValueError(f"cannot import {spec!r}")
        module = importlib.util.module_from_spec(loaded)
        sys.modules[path.stem] = module
        loaded.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    found: type = getattr(module, name)
    return found


def _build(args: argparse.Namespace, rest: list[str]) -> tuple[LightningModule, Any, Trainer]:
    model_class = _import(args.model) if args.model else LightningModule
    data_class = _import(args.data) if args.data else (None if not _mentions_data(args.config) else LightningDataModule)
    cli_args = [item for config in args.config for item in ("--config", config)] + rest
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli = LightningCLI(model_class, data_class, run=False, args=cli_args, save_config_callback=None,
                           subclass_mode_model=args.model is None, subclass_mode_data=args.data is None)
    return cli.model, cli.datamodule, cli.trainer


def _mentions_data(configs: list[str]) -> bool:
    return any(re.search(r"^data:", Path(c).read_text(), re.MULTILINE) for c in configs)


def _plan(args: argparse.Namespace, model: LightningModule, data: Any, trainer: Trainer) -> PlannerChoice:
    strategy = trainer.strategy
    if not isinstance(strategy, VarunaStrategy):
        raise ValueError(f"the config's strategy is {type(strategy).__name__}; plan needs VarunaStrategy")
    config = _config(args, strategy)
    device = torch.device("cuda", 0) if isinstance(trainer.accelerator, CUDAAccelerator) else torch.device("cpu")
    # layers built in the configure_model hook: on meta as under the strategy, or for real as a plain fit would
    with parameters_on_meta() if args.meta else device:
        model.configure_model()
    move_real_tensors(model, device)
    batch = _first_batch(model, data, device)
    step = _dry_step(model, trainer)
    cuts, hooks = install_cut_at(model, config.cut_at) if config.cut_at is not None else ([], [])
    try:
        names = {id(c): getattr(c, "_varuna_name", "") for c in cuts}
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            if has_meta_tensors(model):
                meta_batch = to_meta(batch)
                trace, executed = trace_unmaterialized(model, lambda n: step(first_samples(meta_batch, n)),
                                                       lambda n: step(first_samples(batch, n)), device, names)
            else:
                trace, executed = trace_step(model, lambda n: step(first_samples(batch, n)), cut_names=names)
            check_cut_at_order(cuts, executed)
            cluster = Cluster(args.devices, args.devices_per_node or args.devices)
            return plan(config, model, trace, lambda n: step(samples(batch, n)), default_loss, batch_size_of(batch),
                        device, optimizer_spec(model), cluster, _network(args, config, device))
    finally:
        for hook in hooks:
            hook.remove()


def _config(args: argparse.Namespace, strategy: VarunaStrategy) -> EngineConfig:
    # as the strategy sets them at setup; without a global batch, P follows its rule (at most the devices per node)
    wire = boundary_dtype(strategy.boundary_dtype, strategy.precision_plugin)
    config = replace(strategy.config, boundary_dtype=wire, profile=args.profile or strategy.config.profile,
                     max_pipeline_size=args.devices_per_node or args.devices)
    if args.global_batch_size is not None:
        config = replace(config, global_batch_size=args.global_batch_size)
    if args.memory is not None:
        config = replace(config, memory_limit=parse_bytes(args.memory))
    if args.auto:
        config = replace(config, pipeline_parallel_size="auto", microbatch_size="auto", num_microbatches=None,
                         schedule="auto", recompute="auto")
    return config


def _first_batch(model: LightningModule, data: Any, device: torch.device) -> Any:
    if data is not None:
        data.prepare_data()
        data.setup("fit")
        loader = data.train_dataloader()
    else:
        loader = model.train_dataloader()
    return move_data_to_device(next(iter(loader)), device)


def _dry_step(model: LightningModule, trainer: Trainer) -> Any:
    precision = trainer.precision_plugin

    built_on_meta = has_meta_tensors(model)

    def step(batch: Any) -> Any:
        with warnings.catch_warnings():  # self.log without a running trainer warns and does nothing
            warnings.simplefilter("ignore")
            dry = meta_dry_run(model) if built_on_meta and is_meta_batch(batch) else contextlib.nullcontext()
            with precision.train_step_context(), dry:
                return model.training_step(batch, 0)

    return step


def _network(args: argparse.Namespace, config: EngineConfig, device: torch.device) -> Network | None:
    """The network with the command line's values; None without any (the profile's own, or the stated defaults)."""
    if not any([args.bandwidth, args.latency, args.intra_bandwidth, args.intra_latency]):
        return None
    network = Profile.load(config.profile).network if config.profile is not None else default_network(device.type)
    inter = network.with_inter_node(_maybe(parse_bandwidth, args.bandwidth), _maybe(parse_seconds, args.latency))
    bandwidth, latency = _maybe(parse_bandwidth, args.intra_bandwidth), _maybe(parse_seconds, args.intra_latency)
    if bandwidth is None and latency is None:
        return inter
    intra = type(network.p2p_intra)(latency if latency is not None else network.p2p_intra.latency_s,
                                    bandwidth if bandwidth is not None else network.p2p_intra.bandwidth)
    return replace(inter, p2p_intra=intra, allreduce_intra=intra)


def _maybe(parse: Any, value: str | None) -> float | None:
    return None if value is None else parse(value)


def parse_bandwidth(text: str) -> float:
    """Bytes per second from ``"100Gbit"``, ``"12.5GB"``, ``"800MB"``, ``"1e9"`` (bytes unless ``bit``)."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgGtT]?)(bit|b|B|)(/s)?\s*", text)
    if match is None:
        raise ValueError(f"bandwidth {text!r}: write e.g. 100Gbit, 12.5GB or 800MB (per second)")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[match.group(2).lower()]
    value = float(match.group(1)) * scale
    return value / 8 if match.group(3) == "bit" or match.group(3) == "b" else value


def parse_seconds(text: str) -> float:
    """Seconds from ``"20us"``, ``"0.5ms"``, ``"1e-5"`` or ``"2s"``."""
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(us|ms|s|)\s*", text)
    if match is None:
        raise ValueError(f"latency {text!r}: write e.g. 20us, 0.5ms or 1e-5")
    return float(match.group(1)) * {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}[match.group(2)]


# -- output ---------------------------------------------------------------------------------------------------
def _candidate_json(candidate: Candidate) -> dict[str, Any]:
    return {
        "pipeline_parallel_size": candidate.pipeline_size, "data_parallel_size": candidate.data_size,
        "microbatch_size": candidate.microbatch_size, "num_microbatches": candidate.num_microbatches,
        "schedule": candidate.schedule, "recompute": candidate.recompute,
        "stages_per_rank": candidate.stages_per_rank, "step_s": candidate.step_s,
        "bubble": candidate.bubble, "peak_bytes": list(candidate.peak_bytes), "fits": candidate.fits,
        "stages": [[r.start, r.stop] for r in candidate.stages],
    }


def _as_json(autoconfig: PlannerChoice, args: argparse.Namespace) -> dict[str, Any]:
    ranking = autoconfig.ranking if args.top == 0 else autoconfig.ranking[: args.top]
    return {
        "devices": autoconfig.cluster.world_size, "devices_per_node": autoconfig.cluster.devices_per_node,
        "memory_limit": autoconfig.memory_limit, "global_batch_size": autoconfig.global_batch_size,
        "profile_source": autoconfig.source, "seconds": autoconfig.seconds, "machine": autoconfig.profile.machine,
        "configurations": len(autoconfig.ranking), "chosen": _candidate_json(autoconfig.chosen),
        "candidates": [_candidate_json(c) for c in ranking],
    }


def _print(autoconfig: PlannerChoice, args: argparse.Namespace) -> None:
    c = autoconfig.chosen
    print(f"{args.devices} device(s) of this machine ({autoconfig.profile.machine}); profile: {autoconfig.source};"
          f" {autoconfig.seconds:.2f} s to profile and search; memory limit {format_bytes(autoconfig.memory_limit)}")
    print(f"chosen: {c.describe()}, predicted {c.step_s * 1e3:.2f} ms per step")
    print(format_table(autoconfig.ranking, limit=args.top or None, memory_limit=autoconfig.memory_limit,
                       reserve=MEMORY_RESERVE))


def _timeline(autoconfig: PlannerChoice, path: Path) -> None:
    panels = [(f"predicted: {c.describe()}", predicted_events(replace(autoconfig, chosen=c).prediction()))
              for c in autoconfig.ranking[:2]]
    path.parent.mkdir(parents=True, exist_ok=True)
    render_png(path, panels)
    write_chrome_trace(path.with_suffix(".json"), panels[0][1], "predicted")


if __name__ == "__main__":
    sys.exit(main())
