"""``Fabric(strategy="varuna")``: not supported (yet); the error says what to use instead.

The strategy runs Lightning's ``training_step`` hooks through the pipeline, which Fabric's loops do not have.
Registering the name in Fabric's registry turns Fabric's generic "invalid strategy name" error into one that
points to what works: the Trainer, or :class:`~lightning_varuna.pipeline.engine.PipelineEngine` in the user's own
loop.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FABRIC_MESSAGE", "register_for_fabric"]

FABRIC_MESSAGE = (
    "Fabric(strategy='varuna') is not supported: VarunaStrategy runs Lightning's training_step hooks through the"
    " pipeline, which Fabric's own loops do not have. Use Trainer(strategy='varuna') with a LightningModule, or,"
    " in your Fabric loop, lightning_varuna.PipelineEngine directly (on every rank of an initialised process group:"
    " engine = PipelineEngine(model, EngineConfig(pipeline_parallel_size=P)); engine.setup(batch, step); then per batch"
    " engine.train_step(batch, step, start_sync=True), engine.sync_gradients() and your optimizer over"
    " engine.parameters(); see the user guide, 'Without Lightning')."
)


def _refuse(**_: Any) -> Any:
    raise ValueError(FABRIC_MESSAGE)


def register_for_fabric(registry: Any) -> None:
    """Registers ``"varuna"`` in Fabric's strategy registry (once), as a name that raises :data:`FABRIC_MESSAGE`."""
    if "varuna" not in registry:
        registry.register("varuna", _refuse, description="Varuna-style pipeline parallelism (Trainer only)")
