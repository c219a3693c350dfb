"""The user's optimizer stepping only this replica's shard of each parameter (ZeRO stage 1).

:class:`ShardedStep` attaches to a torch optimizer through its public step hooks and leaves the object the user
made in place: its ``param_groups`` keep the module's own parameters, and its ``state`` holds, per parameter, the
state of this replica's rows only (shard-sized tensors). Around the update itself (after the step's closure has
run: gradient sync, hooks, clipping), each group's parameters are swapped for views of this replica's rows (the
optimizer updates the parameters in place through them) and the state is keyed by those views; then everything
is swapped back and the updated rows are all-gathered (:meth:`ShardedGradientSync.gather_parameters
<lightning_varuna.pipeline.comm.sharded_sync.ShardedGradientSync.gather_parameters>`).

Only optimizers whose update of an element depends on that element's gradient and state alone give the
unsharded result on a shard; :func:`check_elementwise` accepts those of torch and refuses the others.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.optim import Optimizer

from lightning_varuna.pipeline.comm.sharded_sync import ShardedGradientSync

__all__ = ["ELEMENTWISE", "ShardedStep", "check_elementwise"]

ELEMENTWISE: tuple[type[Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD, torch.optim.Adadelta,
    torch.optim.Rprop,
)
"""torch's optimizers whose update is elementwise: stepping a shard gives the unsharded result on it."""

_MIXING = {
    "LBFGS": "its line search and curvature history combine every element of every parameter",
    "Adafactor": "its factored second moment keeps row and column statistics of each matrix",
    "Muon": "it orthogonalizes each matrix's update as a whole",
    "SparseAdam": "it takes sparse gradients, which are not reduced in buckets",
}


def check_elementwise(optimizer: Optimizer) -> None:
    """Refuses an optimizer whose update is not known to be elementwise, saying why and what to use.

    Raises:
        ValueError: For anything but :data:`ELEMENTWISE` (and their subclasses).
    """
    if isinstance(optimizer, ELEMENTWISE):
        return
    name = type(optimizer).__name__
    why = _MIXING.get(name, "its update is not known to be elementwise (each element's new value computed from"
                             " that element's gradient and state alone)")
    accepted = ", ".join(cls.__name__ for cls in ELEMENTWISE)
    raise ValueError(
        f"zero_stage=1 cannot shard {name}: {why}, so stepping a shard of each parameter would not give the"
        f" unsharded result. Use zero_stage=0 with {name}, or an elementwise optimizer ({accepted})."
    )


class ShardedStep:
    """Makes ``optimizer`` step this replica's rows of its parameters, then gathers the rest (see the module doc).

    Args:
        sync: The stage's sharded gradient sync (its :attr:`~ShardedGradientSync.shards` say which rows).
        optimizer: The user's optimizer over this rank's parameters.
        names: Parameter names by parameter (for the checkpoint view and errors).

    Raises:
        ValueError: The optimizer is not elementwise (:func:`check_elementwise`).
    """

    def __init__(self, sync: ShardedGradientSync, optimizer: Optimizer, names: dict[nn.Parameter, str]) -> None:
        check_elementwise(optimizer)
        self.sync = sync
        self.optimizer = optimizer
        self.names = names
        self._mesh: DeviceMesh | None = None
        self._swapped: list[tuple[list[Any], list[tuple[Tensor, nn.Parameter]]]] | None = None
        self._gather = True
        self._handles = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        ]

    def remove(self) -> None:
        """Detaches from the optimizer (its state stays shard-sized)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def holds(self, param: Tensor) -> bool:
        """Whether this replica steps (and keeps optimizer state for) some of ``param``."""
        rows = self.sync.shards.get(param)
        return rows is not None and rows[1] > rows[0]

    # -- the step -----------------------------------------------------------------------------------------
    def _before_step(self, optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
                     ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        # torch passes the step's own arguments, the optimizer first (in torch 2.13 and 2.14)
        at = 1 if args and args[0] is optimizer else 0
        closure = kwargs.get("closure", args[at] if len(args) > at else None)
        if closure is None:  # the closure ran already (a loss scaler calls it before stepping)
            self._swap_in()
            return None

        def closure_then_shards() -> Any:
            result = closure()
            self._swap_in()  # after the sync, the hooks and clipping: only the update sees the shards
            return result

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_shards}
        return (*args[:at], closure_then_shards, *args[at + 1 :]), kwargs

    def _after_step(self, optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._swap_out()
        if self._gather:
            self.sync.gather_parameters()

    def _swap_in(self) -> None:
        if self._swapped is not None:
            return
        state = self.optimizer.state
        swapped = []
        for group in self.optimizer.param_groups:
            pairs = []
            for p in group["params"]:
                rows = self.sync.shards.get(p)
                if rows is None or rows[1] <= rows[0]:
                    continue
                view = _rows_view(p, rows)
                if p.grad is not None:
                    view.grad = _rows_view(p.grad, rows)
                if p in state:
                    state[view] = state.pop(p)
                pairs.append((view, p))
            swapped.append((group["params"], pairs))
            group["params"] = [view for view, _ in pairs]
        self._swapped = swapped

    def _swap_out(self) -> None:
        swapped, self._swapped = self._swapped, None
        if swapped is None:
            return
        state = self.optimizer.state
        for group, (params, pairs) in zip(self.optimizer.param_groups, swapped):
            for view, p in pairs:
                if view in state:
                    state[p] = state.pop(view)
                view.grad = None
            group["params"] = params

    def ensure_state(self) -> None:
        """Gives every held shard its optimizer state, if it has none yet.

        As torch's own checkpoint helpers do: a step with zero gradients and learning rate 0, which changes no
        parameter (and makes no collective).
        """
        if all(p in self.optimizer.state for g in self.optimizer.param_groups for p in g["params"] if self.holds(p)):
            return
        saved = []
        for group in self.optimizer.param_groups:
            saved.append(group["lr"])
            group["lr"] = 0.0 if not isinstance(group["lr"], Tensor) else torch.zeros_like(group["lr"])
        grads = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                grads[p] = p.grad
                p.grad = torch.zeros_like(p) if p.requires_grad else None
        self._gather = False
        try:
            self.optimizer.step()
        finally:
            self._gather = True
            for group, lr in zip(self.optimizer.param_groups, saved):
                group["lr"] = lr
            for p, grad in grads.items():
                p.grad = grad

    # -- checkpoints --------------------------------------------------------------------------------------
    def global_view(self, param: Tensor, value: Tensor) -> Tensor:
        """A state tensor of ``param`` as the whole parameter's: a ``DTensor`` sharded by rows over the replicas.

        ``value`` itself when it is not per element (a step count) or the parameter is 0-dim (one holder).
        """
        rows = self.sync.shards.get(param)
        if rows is None or param.dim() == 0 or value.dim() == 0:
            return value
        local = _rows_view(param, rows)
        if value.shape != local.shape:
            return value
        if self._mesh is None:
            self._mesh = DeviceMesh.from_group(self.sync.topology.made_data_group(), value.device.type)
        return DTensor.from_local(value, self._mesh, [Shard(0)], run_check=False, shape=param.shape,
                                  stride=_contiguous_stride(param.shape))

    def local_value(self, param: Tensor, value: Any) -> Any:
        """A loaded state value as the optimizer keeps it.

        A ``DTensor``'s local rows, this replica's rows of a whole per-element tensor (from a plain checkpoint),
        anything else as it is.
        """
        if isinstance(value, DTensor):
            return value.to_local()
        rows = self.sync.shards.get(param)
        if rows is None or not isinstance(value, Tensor) or param.dim() == 0 or value.shape != param.shape:
            return value
        return _rows_view(value, rows).clone()


def _rows_view(tensor: Tensor, rows: tuple[int, int]) -> Tensor:
    if tensor.dim() == 0:
        return tensor.detach().view(())
    row = tensor[0].numel() if tensor.shape[0] else 1
    return tensor.detach()[rows[0] // row : rows[1] // row]


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))

