"""The launcher: every rank's ``fit`` (or ``validate``, ``test``, ``predict``) fails if any rank's does.

Each rank of a pipeline holds part of the model, so a run in which one rank failed produced no model, even when
the failure came after the last step (``on_train_end``, a ``teardown`` hook). Under Lightning's own launchers
the other ranks would return normally, and the job could exit 0. Here every trainer call ends with
:func:`~lightning_varuna.failstop.failures.finish_together`: a rank whose call succeeded waits (at most the
strategy's ``timeout``) until every rank's has ended, and raises a ``PipelineError`` naming the rank that failed.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

from lightning_varuna.failstop.failures import finish_together

__all__ = ["PipelineLauncher", "refuse_unsupported"]


def refuse_unsupported(model: Any) -> None:
    """Raises for a model the strategy cannot run (manual optimization).

    Raises:
        MisconfigurationException: Saying what to change.
    """
    if isinstance(model, LightningModule) and not model.automatic_optimization:
        raise MisconfigurationException(
            "VarunaStrategy supports automatic optimization only: the pipeline schedule runs forward and"
            " backward itself. Remove `self.automatic_optimization = False` (and manual_backward) from the"
            " LightningModule."
        )


class PipelineLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher (which starts the other ranks when nothing else does), ending together.

    Args:
        cluster_environment: The cluster environment; if it creates the processes (torchrun, SLURM), none is
            started.
        num_processes: Processes per node.
        num_nodes: Number of nodes.
        timeout: How long a rank that succeeded waits for the others to end their call.
    """

    def __init__(
        self, cluster_environment: ClusterEnvironment, num_processes: int, num_nodes: int, timeout: timedelta
    ) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.timeout = timeout

    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        """Runs ``function`` (starting the other ranks first if needed); raises if any rank's run failed.

        A model the strategy refuses is refused here, before other ranks start (``function``'s first argument is the
        trainer call's model): a refusal after would leave the started ranks to fail on their own, later.
        """
        if args:
            refuse_unsupported(args[0])
        try:
            if self.cluster_environment.creates_processes_externally:
                result = function(*args, **kwargs)
            else:
                result = super().launch(function, *args, trainer=trainer, **kwargs)
        except BaseException as error:
            finish_together(error, self.timeout)
            raise
        finish_together(None, self.timeout)
        return result
