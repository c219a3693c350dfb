"""lightning-varuna: Varuna-style pipeline parallelism for PyTorch Lightning."""

from lightning_varuna.checkpoint import CheckpointError
from lightning_varuna.pipeline import (
    CutPoint,
    CutPointError,
    EngineConfig,
    PartitionError,
    PipelineEngine,
    PipelineError,
)
from lightning_varuna.pipeline.varuna_warning import VarunaWarning

__all__ = [
    "CheckpointError", "CutPoint", "CutPointError", "EngineConfig", "PipelineEngine", "PipelineError", "PartitionError",
    "VarunaStrategy", "VarunaWarning", "load_from_checkpoint",
]
__version__ = "0.1.0"

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGIES  # noqa: E402
from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402

from lightning_varuna.checkpoint.plain_format import load_from_checkpoint  # noqa: E402
from lightning_varuna.trainer.fabric import register_for_fabric  # noqa: E402
from lightning_varuna.trainer.strategy import VarunaStrategy  # noqa: E402

VarunaStrategy.register_strategies(StrategyRegistry)
register_for_fabric(FABRIC_STRATEGIES)
