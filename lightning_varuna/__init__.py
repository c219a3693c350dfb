"""lightning-varuna: Varuna-style pipeline parallelism for PyTorch Lightning."""

from lightning_varuna.checkpoint import CheckpointError
from lightning_varuna.pipeline import CutPoint, CutPointError, PartitionError, PipelineEngine, PipelineError

__all__ = [
    "CheckpointError", "CutPoint", "CutPointError", "PipelineEngine", "PipelineError", "PartitionError",
    "VarunaStrategy",
]
__version__ = "0.1.0"

from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402

from lightning_varuna.strategy import VarunaStrategy  # noqa: E402

VarunaStrategy.register_strategies(StrategyRegistry)
