"""The package's layers (the Lightning glue in ``trainer/``, checkpointing, the Lightning-free engine, ``failstop/``
and ``files/`` at the bottom), the order of the engine's parts, no import cycles, unique module names, folders of at
most 15 modules and modules of at most 500 lines, a module table in docs/architecture.md that matches the tree,
and Lightning left as it was after teardown."""

from __future__ import annotations

import ast
import re
import signal
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_varuna"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (module level or inside functions), ``from X import y`` as ``X.y`` if that
    is a module of the package, else ``X``."""
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in modules else node.module)
    return found


def _is_lightning(module: str) -> bool:
    return module.split(".")[0] == "lightning" or module == "pytorch_lightning"


def _outside(module: str, *allowed: str) -> bool:
    """Whether ``module`` is of the package but in none of the ``allowed`` sub-packages."""
    return module.startswith("lightning_varuna") and not any(
        module == f"lightning_varuna.{package}" or module.startswith(f"lightning_varuna.{package}.")
        for package in allowed)


def test_the_bottom_layers_import_nothing_of_lightning_or_of_the_layers_above() -> None:
    # files/ imports nothing of the package; failstop/ only files/
    offending = {}
    for layer, allowed in (("files", ("files",)), ("failstop", ("failstop", "files"))):
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            bad = sorted(m for m in _imports(path) if _is_lightning(m) or _outside(m, *allowed))
            if bad:
                offending[_module_name(path)] = bad
    assert offending == {}


def test_the_pipeline_engine_imports_nothing_of_lightning_or_of_the_layers_above_it() -> None:
    offending = {}
    for path in sorted((PACKAGE / "pipeline").rglob("*.py")):
        bad = sorted(m for m in _imports(path) if _is_lightning(m) or _outside(m, "pipeline", "failstop", "files"))
        if bad:
            offending[_module_name(path)] = bad
    assert offending == {}


# Inside pipeline/, each part imports only parts of lower levels: the engine and its setup at the top, the planner
# and the timeline it is handed (engine_inputs), the config, a stage's runtime, communication, the model's
# splitting, and the pure schedules at the bottom
_PIPELINE_LEVELS = {
    "__init__": 10, "engine": 9, "stage_setup": 8, "timelines": 8, "planning": 7, "engine_inputs": 6, "config": 5,
    "runtime": 4, "batches": 4, "comm": 3, "model": 2, "scheduling": 1, "topology": 1, "varuna_warning": 1,
}


def _pipeline_part(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["lightning_varuna", "pipeline"]:
        return None
    return parts[2] if len(parts) > 2 else "__init__"


def test_inside_the_pipeline_engine_no_part_imports_a_part_above_it() -> None:
    upward = []
    for path in sorted((PACKAGE / "pipeline").rglob("*.py")):
        part = _pipeline_part(_module_name(path))
        assert part in _PIPELINE_LEVELS, f"add {part} to _PIPELINE_LEVELS"
        for imported in sorted(_imports(path)):
            other = _pipeline_part(imported)
            if other is not None and other != part and _PIPELINE_LEVELS[other] >= _PIPELINE_LEVELS[part]:
                upward.append(f"{_module_name(path)} -> {imported}")
    assert upward == []


def test_the_runtime_imports_neither_planning_nor_drawing() -> None:
    # the engine is given a planner and a timeline recorder (pipeline/engine_inputs.py), it does not import them:
    # nothing of pipeline/ outside planning/ and timelines/ imports those two (at module level or in a function)
    offending = {}
    for path in sorted((PACKAGE / "pipeline").rglob("*.py")):
        inside = path.relative_to(PACKAGE / "pipeline").parts[0]
        if inside in ("planning", "timelines"):
            continue
        bad = sorted(m for m in _imports(path)
                     if m.startswith(("lightning_varuna.pipeline.planning", "lightning_varuna.pipeline.timelines")))
        if bad:
            offending[_module_name(path)] = bad
    assert offending == {}


def test_checkpointing_imports_nothing_of_the_lightning_glue_and_lightning_only_for_conversion() -> None:
    offending = {}
    for path in sorted((PACKAGE / "checkpoint").rglob("*.py")):
        imports = _imports(path)
        bad = sorted(m for m in imports if _outside(m, "checkpoint", "pipeline", "failstop", "files"))
        if path.name != "plain_format.py":
            bad += sorted(m for m in imports if _is_lightning(m))
        if bad:
            offending[_module_name(path)] = bad
    assert offending == {}


def test_the_package_root_holds_only_the_public_names_and_the_layers() -> None:
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py"]
    layers = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    assert layers == ["checkpoint", "failstop", "files", "pipeline", "trainer"]


def test_module_file_names_are_unique_across_the_package_and_differ_from_its_folders() -> None:
    # ``__init__.py`` aside: a module's name alone says which one it is, and no module is named like a folder
    modules = [p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"]
    seen: dict[str, list[str]] = {}
    for path in modules:
        seen.setdefault(path.stem, []).append(str(path.relative_to(PACKAGE)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
    folders = {p.parent.name for p in PACKAGE.rglob("__init__.py")}
    assert sorted(folders & set(seen)) == []


def test_no_folder_of_the_package_holds_more_than_15_modules() -> None:
    # ``__init__.py`` not counted
    counts = {str(folder.relative_to(PACKAGE.parent)): len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
              for folder in [PACKAGE, *(p.parent for p in PACKAGE.rglob("__init__.py"))]}
    assert {folder: n for folder, n in counts.items() if n > 15} == {}


def test_the_module_table_of_the_architecture_doc_lists_every_module_of_the_package() -> None:
    # the table's first column names each module by its path inside the package, in backticks
    table = ARCHITECTURE.read_text().split("## Modules", 1)[1].split("\n## ", 1)[0]
    listed = set()
    for row in re.findall(r"^\| (.+?) \|", table, flags=re.MULTILINE):
        listed.update(re.findall(r"`([\w/]+\.py)`", row))
    present = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")}
    assert sorted(present - listed) == [] and sorted(listed - present) == []


def test_no_module_of_the_package_has_more_than_500_lines() -> None:
    lines = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {path: n for path, n in lines.items() if n > 500} == {}


def test_the_pipeline_engine_trains_without_lightning_loaded() -> None:
    # the package's own __init__ registers the strategy with Lightning: load the engine without it, as a user
    # of PipelineEngine alone would if they vendored it, and train one step on a 1-process gloo group
    code = f"""
import os, sys, types
package = types.ModuleType("lightning_varuna"); package.__path__ = [{str(PACKAGE)!r}]
sys.modules["lightning_varuna"] = package
import torch, torch.distributed as dist
from torch import nn
from lightning_varuna.pipeline import CutPoint, EngineConfig, PipelineEngine
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
model = nn.Sequential(nn.Linear(4, 4), CutPoint(), nn.Linear(4, 1))
engine = PipelineEngine(model, EngineConfig(1, num_microbatches=2))
batch = (torch.randn(4, 4), torch.randn(4, 1))
step = lambda mb: nn.functional.mse_loss(model(mb[0]), mb[1])
engine.setup(batch, step)
engine.train_step(batch, step, start_sync=True)
engine.sync_gradients()
assert all(p.grad is not None for p in engine.parameters())
loaded = sorted(m for m in sys.modules if m == "lightning" or m.startswith(("lightning.", "pytorch_lightning")))
assert not loaded, loaded
dist.destroy_process_group()
print("ok")
"""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={"PORT": str(port), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_no_import_cycles_in_the_package() -> None:
    graph = {_module_name(p): {m for m in _imports(p) if m.startswith("lightning_varuna")}
             for p in PACKAGE.rglob("*.py")}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, [*path, nxt])
        done.add(node)

    done: set[str] = set()
    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert cycles == []


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from lightning_varuna import CutPoint

        self.net = torch.nn.Sequential(torch.nn.Linear(4, 4), CutPoint(), torch.nn.Linear(4, 1))
        self.seen_sigterm_handler: object = None

    def training_step(self, batch, batch_idx):
        self.seen_sigterm_handler = signal.getsignal(signal.SIGTERM)
        self.log("loss", 1.0)
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)


def _fit(strategy: object, tmp_path: Path) -> pl.Trainer:
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=True,
                         default_root_dir=tmp_path)
    trainer.fit(_Tiny())
    return trainer


def test_patches_are_undone_at_teardown_and_a_later_trainer_is_stock_lightning(tmp_path: Path) -> None:
    from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

    from lightning_varuna import VarunaStrategy
    from lightning_varuna.trainer.patches import requested_ckpt_path

    try:
        varuna = _fit(VarunaStrategy(pipeline_parallel_size=1, num_microbatches=2), tmp_path)
    finally:  # the strategy's process group outlives its trainer, as DDP's does
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert requested_ckpt_path(varuna) is None  # recorded (fit without ckpt_path)
    summaries = [cb for cb in varuna.callbacks if isinstance(cb, pl.callbacks.ModelSummary)]
    assert summaries, "the default model summary callback"
    patched = [
        (varuna._signal_connector, {"register_signal_handlers"}),
        (varuna.fit_loop.epoch_loop, {"_broadcast_sigterm_tensor", "advance"}),
        (varuna.lightning_module, {"log"}),
        *((summary, {"_summary"}) for summary in summaries),
        (varuna.fit_loop._data_source, {"dataloader"}),
    ]
    for obj, names in patched:
        leftovers = names & set(vars(obj))
        assert leftovers == set(), (type(obj).__name__, leftovers)

    plain = _fit("auto", tmp_path)
    handler = plain.lightning_module.seen_sigterm_handler
    # Lightning's own SIGTERM handling was installed during the plain fit (its notifier is a _SignalConnector
    # method), and the ckpt_path recorder did nothing for it
    handlers = getattr(handler, "signal_handlers", [handler])
    assert any(getattr(h, "__self__", None).__class__ is _SignalConnector for h in handlers), handler
    assert not hasattr(plain._checkpoint_connector, "_varuna_requested_ckpt_path")


# What changes an object that is not the package's own: every line of the package that matches one of these must
# be a site of an entry of patches.PATCHES (or of the helper that applies and undoes instance patches)
_PATCH_SITE = re.compile("|".join([
    r"patches\.replace\(", r"\bsetattr\(", r"vars\([\w.]+\)\.pop\(", r"_current_fx_name\s*=", r"__class__\s*=",
    r"__dict__\.update\(", r"\btype\(\"", r"(?<!self)\.forward\s*=", r"del [\w.]+\.__dict__\[",
    r"_compiled_call_impl\s*=", r"_forward_cache\s*=", r"del [\w.]+\._parameters\[", r"\.register_buffer\(",
    r"register_(module_)?forward(_pre)?_hook\(", r"register_module_parameter_registration_hook\(",
    r"\bmodule\.log\s*=", r"\bdel module\.log\b", r"rank_zero_only\.rank\s*=", r"\.scaler\s*=",
    r"\.global_grad_norm\s*=", r"\.data\s*=", r"_select_ckpt_path\s*=", r"sys\.meta_path\.insert\(",
    r"\bgroup\[\"\"\s*\]\s*=", r"register_step_(pre|post)_hook\(",
]))
def _code_lines(path: Path) -> dict[int, str]:
    """Each line without its comment and with every string literal written as ``""`` (the texts of PATCHES and the
    docstrings are no sites)."""
    import io
    import tokenize

    text = path.read_text()
    lines = text.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        (row, col), (end_row, end_col) = token.start, token.end
        if token.type == tokenize.COMMENT:
            lines[row - 1] = lines[row - 1][:col]
        elif token.type == tokenize.STRING:
            if row == end_row:
                lines[row - 1] = lines[row - 1][:col] + '""' + " " * (end_col - col - 2) + lines[row - 1][end_col:]
            else:
                lines[row - 1] = lines[row - 1][:col] + '""'
                for inside in range(row, end_row - 1):
                    lines[inside] = ""
                lines[end_row - 1] = " " * end_col + lines[end_row - 1][end_col:]
    return dict(enumerate(lines, 1))


_PATCH_HELPER = {("trainer/patches.py", "setattr(obj, name, value)"),
                 ("trainer/patches.py", "setattr(obj, name, previous)"),
                 ("trainer/patches.py", "vars(obj).pop(name, None)")}


def test_every_change_to_lightnings_or_the_users_objects_is_listed_in_patches_py() -> None:
    from lightning_varuna.trainer.patches import PATCHES

    listed = {site for patch in PATCHES for site in patch.sites} | _PATCH_HELPER
    unlisted = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = str(path.relative_to(PACKAGE))
        lines = path.read_text().splitlines()
        for number, code in _code_lines(path).items():
            if _PATCH_SITE.search(code) and not any(m == module and piece in lines[number - 1] for m, piece in listed):
                unlisted.append(f"{module}:{number}: {lines[number - 1].strip()}")
    assert unlisted == []
    # every listed site is in its module, on a line the search above finds
    missing = []
    for module, piece in sorted(listed):
        path = PACKAGE / module
        code = _code_lines(path)
        found = [n for n, line in enumerate(path.read_text().splitlines(), 1) if piece in line]
        if not any(_PATCH_SITE.search(code[n]) for n in found):
            missing.append((module, piece))
    assert missing == []
    assert [p.number for p in PATCHES] == list(range(1, len(PATCHES) + 1))
    assert all(p.target and p.sites and p.why and p.tested and p.undone for p in PATCHES)


def test_a_test_module_whose_module_fixture_runs_jobs_keeps_its_tests_on_one_xdist_worker() -> None:
    # under `pytest -n 2 --dist loadgroup` a module-scoped fixture runs once per worker that gets one of the module's
    # tests: without a group, both workers would run the same jobs
    tests = Path(__file__).resolve().parents[1]
    ungrouped = []
    for path in sorted(tests.rglob("test_*.py")):
        source = path.read_text()
        module_fixture = re.search(r'@pytest\.fixture\(scope="module"\)\ndef \w+\(.*?\n(?=\S)', source, re.S)
        if module_fixture and re.search(r"\b(torchrun|python)\(", module_fixture.group(0)):
            if "pytest.mark.xdist_group(" not in source:
                ungrouped.append(str(path.relative_to(tests)))
    assert not ungrouped, f"add pytestmark = pytest.mark.xdist_group(...) to {ungrouped}"
