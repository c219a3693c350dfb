"""Models built on the meta device: no rank holds a parameter it does not train.

A model can be built with its parameters on ``meta`` (:func:`parameters_on_meta`, or ``torch.device("meta")``):
they have shapes and dtypes but no memory. The dry run then runs on meta tensors (:func:`on_meta`), or on the device
with zero-stride placeholder weights where the step cannot run on meta (:func:`trace_unmaterialized`), and after
partitioning each rank materializes only its own stage's parameters (:func:`materialize`):

- every parameter the stage holds gets zero-filled memory on the device, then each module owning one of them
  is initialized by ``param_init_fn(module)`` (default: its own ``reset_parameters()``), with the RNG seeded
  from the run's seed and the module's name: the weights are the same whatever P and D are, and the copies
  of a tied parameter on different stages are equal;
- buffers built with real values (rotary frequencies, masks) keep them; buffers left on ``meta`` are given
  memory and recomputed by the same initialization (a module that builds them in ``reset_parameters``), or
  stay zero.

This differs from the module's own ``__init__`` initialization (which draws from one RNG stream in
construction order): load pretrained weights for exact values.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.utils._python_dispatch import TorchDispatchMode  # private: see _ZeroProducts
from torch.utils._pytree import tree_map

from lightning_varuna.pipeline.model.cut import CutPoint, CutPointError
from lightning_varuna.pipeline.model.dry_run import PartitionError, Trace, trace_step

__all__ = [
    "explained_meta_errors",
    "ParamInitFn", "has_meta_tensors", "materialize", "module_seed", "move_real_tensors", "on_meta",
    "on_placeholders", "parameters_on_meta", "to_meta", "trace_unmaterialized",
]

ParamInitFn = Callable[[nn.Module], None]
"""Initializes the parameters (and buffers) a module owns directly (not those of its submodules)."""


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Parameters registered inside the block are moved to the meta device; buffers and other tensors stay real.

    A parameter is created where it would be (uninitialized memory from ``torch.empty`` is not touched) and
    replaced by a meta tensor as it is registered, before the module's own initialization runs on it (which on
    meta costs nothing), so building a model this way takes no parameter memory and almost no time.
    """

    def to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is None or param.is_meta:
            return None
        return nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)

    # torch annotates the hook as returning None, yet registers the parameter it returns in place of the given one
    to_meta_parameter = cast(Callable[..., None], to_meta)
    handle = register_module_parameter_registration_hook(to_meta_parameter)
    try:
        yield
    finally:
        handle.remove()


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def to_meta(tree: Any) -> Any:
    """Every tensor of ``tree`` as a meta tensor of the same shape and dtype."""
    return tree_map(lambda t: torch.empty_like(t, device="meta") if isinstance(t, Tensor) else t, tree)


def _registrations(root: nn.Module) -> Iterator[tuple[str, nn.Module, str, Tensor, bool]]:
    """Every ``(module name, module, attribute, tensor, is parameter)`` registered anywhere under ``root``.

    A tensor registered in several modules (a tied parameter) appears once per registration.
    """
    for prefix, module in root.named_modules(remove_duplicate=False):
        for attr, param in module.named_parameters(recurse=False, remove_duplicate=False):
            yield prefix, module, attr, param, True
        for attr, buffer in module.named_buffers(recurse=False, remove_duplicate=False):
            yield prefix, module, attr, buffer, False


def _replace(root: nn.Module, new: Mapping[int, Tensor]) -> None:
    """Registers ``new[id(t)]`` wherever a tensor ``t`` is registered (every alias of a tied parameter)."""
    for _, module, attr, tensor, _ in list(_registrations(root)):
        if id(tensor) in new:
            setattr(module, attr, new[id(tensor)])


@contextlib.contextmanager
def on_meta(module: nn.Module) -> Iterator[None]:
    """Inside the block, every parameter and buffer of ``module`` is a meta tensor (a dry run on meta).

    Real tensors are replaced by meta ones of the same shape and dtype (parameters by parameters, so that
    uses are still recognised by name), and put back afterwards.
    """
    def on_meta(tensor: Tensor, is_param: bool) -> Tensor | None:
        if tensor.is_meta:
            return None
        meta = torch.empty_like(tensor, device="meta")
        return nn.Parameter(meta, requires_grad=tensor.requires_grad) if is_param else meta

    with _substituted(module, on_meta):
        yield


@contextlib.contextmanager
def on_placeholders(module: nn.Module, device: torch.device) -> Iterator[None]:
    """Inside the block, every meta parameter of ``module`` is a zero-stride placeholder on ``device``.

    A placeholder costs one element of memory whatever its shape, so a step runs on real tensors (it may read
    values and make tensors without a device) without the model's memory: a kernel that needs a contiguous
    weight copies only that one for the duration of the op. Meta buffers get real zeros (a step may write them in
    place). The values are zeros, which is enough to learn shapes, data flow and costs, not to train; matrix
    products with a placeholder are not computed (they are zeros), so no kernel copies a weight.
    """
    products = _ZeroProducts()

    def placeholder(tensor: Tensor, is_param: bool) -> Tensor | None:
        if not tensor.is_meta:
            return None
        if not is_param:
            return torch.zeros(tensor.shape, dtype=tensor.dtype, device=device)
        return nn.Parameter(products.placeholder(tensor.shape, tensor.dtype, device),
                            requires_grad=tensor.requires_grad)

    with _substituted(module, placeholder), products:
        yield


class _ZeroProducts(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's __init_subclass__ is untyped
    """Matrix products with a placeholder, and its dtype casts, made without reading the placeholder.

    A BLAS kernel cannot read a zero-stride matrix: it copies the whole weight first, and with glibc's adaptive
    mmap threshold the freed copies of weights under 32 MiB stay in the heap, so the copies of one step added up
    to ten times the largest weight (a 2.2 GB Llama). Every tensor that shares a placeholder's storage is zeros,
    so the product is known without computing it: zeros, plus the added term of ``addmm``/``baddbmm``. Autograd
    (above this mode) still records the op and what it saves, and the FLOP counter (a mode entered later, so
    consulted first) still counts it.

    ``TorchDispatchMode`` is private (``torch.utils._python_dispatch``): torch has no public mode below autograd
    (``FlopCounterMode`` is built on it); tested with torch 2.14.
    """

    _PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                 torch.ops.aten.baddbmm.default}

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is untyped
        self._zeros: dict[int, Tensor] = {}  # storage address -> the one-element zero, held so addresses stay unique

    def placeholder(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A zero-stride tensor of ``shape`` whose one element is zero (one element of memory)."""
        zero = torch.zeros((), dtype=dtype, device=device)
        self._zeros[zero.untyped_storage().data_ptr()] = zero
        return zero.expand(shape)

    def _is_placeholder(self, value: object) -> bool:
        return isinstance(value, Tensor) and not value.is_meta and value.untyped_storage().data_ptr() in self._zeros

    def __torch_dispatch__(self, func: Any, types: Collection[type], args: tuple[Any, ...] = (),  # noqa: D105
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in self._PRODUCTS:
            added = func in (torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default)
            first, second = args[1:3] if added else args[:2]
            if self._is_placeholder(first) or self._is_placeholder(second):
                out = first.new_zeros((*first.shape[:-1], second.shape[-1]))
                beta = kwargs.get("beta", args[3] if len(args) > 3 else 1)
                if added and beta != 0 and not self._is_placeholder(args[0]):
                    out.add_(args[0], alpha=beta)
                return out
        if func is torch.ops.aten._to_copy.default and self._is_placeholder(args[0]):
            source = args[0]
            return self.placeholder(source.shape, kwargs.get("dtype") or source.dtype,
                                    kwargs.get("device") or source.device)
        return func(*args, **kwargs)


@contextlib.contextmanager
def _substituted(module: nn.Module, substitute: Callable[[Tensor, bool], Tensor | None]) -> Iterator[None]:
    """Inside the block, registered tensors are replaced by ``substitute(tensor, is_parameter)`` where it gives one.

    A tensor is replaced in every module that registers it; at the end the originals are put back.
    """
    substitutes: dict[int, Tensor] = {}
    originals: dict[int, Tensor] = {}
    for _, _, _, tensor, is_param in _registrations(module):
        if id(tensor) in substitutes:
            continue
        new = substitute(tensor, is_param)
        if new is not None:
            substitutes[id(tensor)] = new
            originals[id(new)] = tensor
    _replace(module, substitutes)
    try:
        yield
    finally:
        _replace(module, originals)


def trace_unmaterialized(
    module: nn.Module, step_on_meta: Callable[[int], object], step_on_device: Callable[[int], object],
    device: torch.device, cut_names: dict[int, str] | None = None,
) -> tuple[Trace, list[CutPoint]]:
    """The dry run of a model built on the meta device: on meta tensors, else with placeholder weights.

    The second runs on the device, each weight a placeholder of :func:`on_placeholders`.

    A step fails on meta tensors when it reads values (``.item()``, a branch on a mask, as Hugging Face's mask code
    does with an ``attention_mask``) or mixes in tensors made without a device. Then it runs on the real batch,
    each parameter a zero-stride placeholder: the model's compute for one and two samples, and the memory of the
    largest weight a kernel copies, not the model's. ``Trace.dry_run`` says which ran.

    Args:
        module: The model, its parameters (some or all) on meta.
        step_on_meta: Runs the step on the first ``n`` samples of the batch, as meta tensors.
        step_on_device: Runs the step on the first ``n`` samples of the batch, on ``device``.
        device: This rank's device.
        cut_names: Readable names of cut points that are not submodules of ``module``.
    """
    try:
        with on_meta(module):
            trace, cuts = trace_step(module, step_on_meta, cut_names=cut_names)
        trace.dry_run = "meta"
        return trace, cuts
    except (CutPointError, PartitionError):
        raise
    except Exception as err:  # noqa: BLE001 - user code on meta tensors: any error, then the placeholder run
        meta_error = err
    with on_placeholders(module, device), explained_meta_errors(meta_error):
        trace, cuts = trace_step(module, step_on_device, cut_names=cut_names)
    trace.dry_run = f"placeholders (on meta: {type(meta_error).__name__}: {str(meta_error).splitlines()[0][:80]})"
    return trace, cuts


def move_real_tensors(module: nn.Module, device: torch.device) -> None:
    """Moves every parameter and buffer that is not on the meta device to ``device`` (meta ones stay)."""
    moved: dict[int, Tensor] = {}
    for _, _, _, tensor, is_param in _registrations(module):
        if tensor.is_meta or tensor.device == device or id(tensor) in moved:
            continue
        data = tensor.detach().to(device)
        moved[id(tensor)] = nn.Parameter(data, requires_grad=tensor.requires_grad) if is_param else data
    _replace(module, moved)


def module_seed(seed: int, name: str) -> int:
    """The RNG seed of module ``name``'s initialization in a run seeded with ``seed`` (63 bits)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _materialized(tensor: Tensor, device: torch.device, is_param: bool) -> Tensor:
    data = torch.zeros(tensor.shape, dtype=tensor.dtype, device=device)
    return nn.Parameter(data, requires_grad=tensor.requires_grad) if is_param else data


def materialize(
    module: nn.Module,
    keep: Collection[str],
    device: torch.device,
    seed: int,
    param_init_fn: ParamInitFn | None = None,
) -> set[str]:
    """Gives the meta parameters named in ``keep``, and every meta buffer, memory on ``device``, and initializes them.

    The modules initialized are those that own (directly) a parameter materialized here, and those without
    parameters that own a meta buffer; each by ``param_init_fn(module)``, or its ``reset_parameters()``, in
    ``named_modules()`` order with the RNG seeded by :func:`module_seed`. A module's other meta parameters
    (used on other stages) get memory for that call only, so that the values do not depend on which of its
    parameters a stage holds. Meta buffers of other modules (which do not run on this stage) become zeros.
    Materialized parameters are new objects.

    Args:
        module: The model, parameters not in ``keep`` still registered (on meta or not).
        keep: Names (``named_parameters()``) of the parameters this rank holds.
        device: Where they go.
        seed: The run's seed (the same on every rank).
        param_init_fn: Initializes what a module owns directly; default: ``reset_parameters()``.

    Returns:
        The class names of modules that needed initialization but have no ``reset_parameters`` (when
        ``param_init_fn`` is not given): their tensors stay zero.
    """
    kept = {id(p) for name, p in module.named_parameters() if name in keep and p.is_meta}
    owners = [
        (name, owner) for name, owner in module.named_modules() if _needs_init(owner, kept)
    ]
    new: dict[int, Tensor] = {}
    for _, _, _, tensor, is_param in _registrations(module):
        if tensor.is_meta and (id(tensor) in kept or not is_param) and id(tensor) not in new:
            new[id(tensor)] = _materialized(tensor, device, is_param)
    _replace(module, new)
    missing: set[str] = set()
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        for name, owner in owners:
            if param_init_fn is None and not callable(getattr(owner, "reset_parameters", None)):
                missing.add(type(owner).__name__)
                continue
            with _whole(owner, device):
                torch.manual_seed(module_seed(seed, name))
                param_init_fn(owner) if param_init_fn is not None else owner.reset_parameters()
    return missing


def _needs_init(owner: nn.Module, kept: set[int]) -> bool:
    params = [p for _, p in owner.named_parameters(recurse=False, remove_duplicate=False)]
    if params:
        return any(id(p) in kept for p in params)
    return any(b.is_meta for b in owner.buffers(recurse=False))


@contextlib.contextmanager
def _whole(owner: nn.Module, device: torch.device) -> Iterator[None]:
    """Gives ``owner``'s own meta parameters memory inside the block, so its initialization runs as on a full model."""
    temporary = {id(p): _materialized(p, device, True) for _, p in owner.named_parameters(recurse=False) if p.is_meta}
    if not temporary:
        yield
        return
    originals = {id(t): p for _, p in owner.named_parameters(recurse=False) if id(p) in temporary
                 for t in [temporary[id(p)]]}
    _replace(owner, temporary)
    try:
        yield
    finally:
        _replace(owner, originals)


@contextlib.contextmanager
def explained_meta_errors(meta_error: BaseException) -> Iterator[None]:
    """Says why the dry run of a model built on the meta device failed both ways, and what to change."""
    try:
        yield
    except (CutPointError, PartitionError):
        raise
    except Exception as err:  # noqa: BLE001 - user code on placeholders: any error, re-raised with the reasons
        raise PartitionError(
            "The model's parameters are on the meta device. The dry run ran the step on meta tensors (shapes"
            f" without values), which failed with {type(meta_error).__name__}: {meta_error}, then on the batch"
            " with zero placeholder weights, which failed with"
            f" {type(err).__name__}: {err}. Keep the step runnable on either: create tensors on the device of the"
            " step's inputs (x.device), and keep branches on values (.item()) behind `if not x.is_meta`, or build"
            " the model in __init__."
        ) from err
