"""The dry run's data flow: which values a later stage would compute wrongly, and which modules it may run itself.

On a stage, a parameter of another stage is a zero placeholder and a module called only in earlier stages'
segments is a stand-in that returns zeros (:mod:`~lightning_varuna.pipeline.model.stand_ins`). A value computed from
either is right only on the stage that owns them. While the dry run runs the step, :class:`DataFlow` follows each
tensor's sources through every torch function:

- parameters and cut point outputs, by segment;
- outputs of module calls that start and end in one segment, by module name.

A value used in a later segment than the one that made it, other than through a cut point, *crosses*. A crossing
from parameters cannot be split. A crossing from module outputs (rotary position embeddings computed once before
the first block and passed to every block, an ALiBi tensor, a mask module) can, when each such module can run on
the consuming stage itself: it has no parameters, draws no random numbers, writes none of its buffers or
attributes, and its output depends on no parameter and no output of a module outside it. Such modules are
*recomputed*: they run on every stage instead of being stood in for.

Any other crossing value (computed from parameters: T5's relative position bias, made by the first block and
passed to every later one) is a *side value* that the stages transport with the activation when it can be taken
where it is made and put where it is used: it is an element of the output of a module call made within one segment
(its *producer*, the innermost such call), and every use of it in a later segment lies inside a module call of that
segment that takes it as an argument (its *consumers*, the outermost such calls). The stage holding the producer
captures it there with a forward hook; a stage holding consumers puts the received value in place of the argument
with a forward pre-hook (:mod:`~lightning_varuna.pipeline.runtime.side_values`).

A producer's output that the step's own code reads in a later segment outside any module call (the loss code of a
mixture of experts reading every layer's router logits, which transformers collects with forward hooks on the
routers) is a side value too, when no other module call takes it as an argument or gives it out: the stages whose
segments read it give it as the producer call's output there (the producer stood in, its ancestors' code run), so
whatever Python path took it from that call to the reader (a hook, a returned tuple) hands over the received value.
Any other crossing is an error when it spans two stages
(:func:`~lightning_varuna.pipeline.model.partition.make_partition`), never a silently different computation.

Reading a tensor's shape, dtype or device is not a use of its values: stand-ins have the right shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, overload

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["CallSite", "Crossings", "DataFlow", "Reads", "SideValue", "producer_ancestors"]

RANDOM_OPS = frozenset({
    "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "bernoulli", "bernoulli_",
    "multinomial", "normal", "normal_", "uniform_", "random_", "exponential_", "geometric_", "cauchy_",
    "log_normal_", "poisson", "rrelu", "rrelu_", "gumbel_softmax",
})
"""Functions that always draw random numbers."""

DROPOUTS = frozenset({
    "dropout", "dropout_", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "alpha_dropout_",
    "feature_alpha_dropout", "feature_alpha_dropout_", "feature_dropout", "feature_dropout_", "native_dropout",
})
"""Functions that draw random numbers when training with ``p > 0`` (arguments ``input, p, training``)."""

SHAPE_ONLY = frozenset({
    "zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_ones", "new_empty", "new_full",
})
"""Functions whose tensor result depends on their input's shape, dtype and device only."""

VALUE_READS = frozenset({
    "item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "numpy", "equal", "allclose",
})
"""Functions that return a Python value read from a tensor's values (others without a tensor result read metadata)."""

Crossings = dict[tuple[int, int], str]
"""``(from segment, to segment) -> what crosses``, for values that cannot reach the later segment's stage."""


_V = TypeVar("_V")
_D = TypeVar("_D")


class _TensorTable(Protocol[_V]):
    """The part of a ``WeakTensorKeyDictionary`` used here, typed (torch leaves its methods unannotated)."""

    @overload
    def get(self, key: Tensor) -> _V | None: ...

    @overload
    def get(self, key: Tensor, default: _D) -> _V | _D: ...

    def __setitem__(self, key: Tensor, value: _V) -> None: ...

    def __contains__(self, key: object) -> bool: ...


def _weak_table() -> Any:
    """A table keyed by tensors that does not keep them alive (typed by the attribute it is assigned to)."""
    return WeakTensorKeyDictionary()


def _draws_random_numbers(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if name in RANDOM_OPS:
        return True
    if name == "scaled_dot_product_attention":
        p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        return isinstance(p, float) and p > 0
    if name in DROPOUTS:
        p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
        training = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else True))
        return bool(training) and not (isinstance(p, (int, float)) and p == 0)
    return False


def _describe(value: Tensor) -> str:
    return f"{tuple(value.shape)} {value.dtype}"


@dataclass(frozen=True, order=True)
class CallSite:
    """A place in the forward: one leaf of the arguments or of the output of one module call.

    The ``call``-th call (from 0) of ``module`` in ``segment``; ``leaf`` indexes ``tree_leaves((args, kwargs))``
    (consumers) or ``tree_leaves(output)`` (producers). Producers are counted by the order their calls end,
    consumers by the order their calls start.
    """

    module: str
    segment: int
    call: int
    leaf: int


@dataclass(frozen=True)
class SideValue:
    """A value a later segment uses other than through a cut point, that the stages transport with the activation."""

    producer: CallSite
    consumers: tuple[CallSite, ...]
    shape: tuple[int, ...]
    """Its shape in the dry run's larger batch."""
    dtype: torch.dtype
    batch_dim: int | None
    """Which dimension scales with the batch (None: none)."""
    what: str
    step_reads: tuple[int, ...] = ()
    """The later segments whose code reads it outside module calls' arguments: a stage running one gives it as the
    producer's output (see the module docstring)."""

    @property
    def last_segment(self) -> int:
        """The last segment that uses it."""
        return max([*(c.segment for c in self.consumers), *self.step_reads])


@dataclass
class Reads:
    """How later segments read one producer's value.

    The module calls that take it, the segments whose code reads it outside module calls
    (:attr:`SideValue.step_reads`), and the value itself.
    """

    consumers: set[CallSite]
    step_reads: set[int]
    value: Tensor


@dataclass
class _Call:
    name: str
    segment: int
    state: dict[str, tuple[int, int]] | None
    """Of a module without parameters: the identity and version of each buffer and attribute before the call."""
    call: int = 0
    """How many calls of this module started before this one in its segment."""
    arguments: dict[int, int] | None = None
    """``id`` of each tensor among its arguments' leaves -> the leaf's index (the arguments are alive during the
    call, so the ids are theirs)."""


def _state(module: nn.Module) -> dict[str, tuple[int, int]]:
    state = {}
    for prefix, sub in module.named_modules():
        for key, value in vars(sub).items():
            if key not in ("_buffers", "_modules", "_parameters"):
                state[f"{prefix}.{key}"] = (id(value), 0)
        for key, buffer in sub._buffers.items():
            # a tensor's version counter grows with every in-place write (also on the meta device)
            state[f"{prefix}.{key}"] = (id(buffer), buffer._version if buffer is not None else 0)
    return state


class DataFlow:
    """Follows each tensor's sources while the dry run runs the step (see the module docstring).

    Args:
        module: The model; module names in reports are its ``named_modules()`` names.
        segment: Returns the segment the running forward is in.
    """

    def __init__(self, module: nn.Module, segment: Callable[[], int]) -> None:
        self.segment = segment
        self.names = {id(m): name for name, m in module.named_modules()}
        self.parameter_free = {id(m) for m in module.modules() if next(m.parameters(), None) is None}
        self.from_parameters: Crossings = {}
        """Crossings of values computed from parameters (or from cut point outputs)."""
        self.from_modules: dict[tuple[int, int, frozenset[str]], str] = {}
        """Crossings of values computed from module outputs: ``(from, to, modules) -> what crosses``."""
        self.checked: set[str] = set()
        """Modules without parameters whose calls were checked (each stayed in one segment)."""
        self.unclean: set[str] = set()
        """Modules seen to draw random numbers, write their state, or return values from parameters or from
        modules outside them: they cannot be recomputed."""
        self._segment_of: _TensorTable[int] = _weak_table()
        self._modules_of: _TensorTable[tuple[int, frozenset[str]]] = _weak_table()
        self._produced: _TensorTable[CallSite] = _weak_table()
        """Tensor -> the innermost module call (within one segment) whose output holds it, as a :class:`CallSite`."""
        self._made_by: _TensorTable[str] = _weak_table()
        self._handled: _TensorTable[str] = _weak_table()
        """A module call's output -> the first other call that took it as an argument or gave it out (not its
        producer's ancestors): a later stage stands that call in, so the step's reads of it cannot be given at the
        producer's output."""
        """Tensor computed from parameters -> the innermost module call running when it was made (for errors)."""
        self._starts: dict[tuple[str, int], int] = {}
        self._ends: dict[tuple[str, int], int] = {}
        self._calls: list[_Call] = []
        self._pending: list[tuple[tuple[int, int], Tensor, frozenset[str] | None]] = []
        self.transported: dict[tuple[int, int, frozenset[str] | None], dict[CallSite, Reads] | None] = {}
        """Per crossing ``(from, to, modules or None for parameters)``: the side values read across it, by producer,
        with their consumers and a tensor (None: a value read across it cannot be transported)."""
        self.untransportable: dict[tuple[int, int, frozenset[str] | None], str] = {}
        """Why a crossing cannot be transported (the first value that cannot, its producer and its consumer)."""

    # module calls -------------------------------------------------------------------------------------------

    def enter(self, module: nn.Module) -> None:
        """A module call starts."""
        name = self.names.get(id(module))
        if name is not None:
            state = _state(module) if id(module) in self.parameter_free else None
            segment = self.segment()
            count = self._starts.get((name, segment), 0)
            self._starts[(name, segment)] = count + 1
            self._calls.append(_Call(name, segment, state, count))

    def arguments(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The arguments of the module call that just started (from a forward pre-hook that sees keywords)."""
        call = self._calls[-1] if self._calls else None
        if call is not None and call.name == self.names.get(id(module)):
            leaves = list(tree_leaves((args, kwargs)))
            call.arguments = {id(leaf): index for index, leaf in enumerate(leaves) if isinstance(leaf, Tensor)}
            self._handle(call.name, leaves)

    def _handle(self, name: str, leaves: list[Any]) -> None:
        """Marks module outputs among ``leaves`` that the call of ``name`` takes or gives (see :attr:`_handled`)."""
        for leaf in leaves:
            if isinstance(leaf, Tensor) and leaf not in self._handled:
                producer = self._produced.get(leaf)
                if producer is not None and not _within(producer.module, name):
                    self._handled[leaf] = name

    def exit(self, module: nn.Module, output: object) -> None:
        """A module call ends: its output is labelled with the module if the call stayed in one segment."""
        name = self.names.get(id(module))
        if name is None or not self._calls:
            return
        call = self._calls.pop()
        segment = self.segment()
        if call.segment != segment:
            return
        ended = self._ends.get((name, segment), 0)
        self._ends[(name, segment)] = ended + 1
        all_leaves = tree_leaves(output)
        self._handle(name, all_leaves)
        for index, leaf in enumerate(all_leaves):
            if isinstance(leaf, Tensor) and leaf not in self._produced:  # inner calls end first: the innermost wins
                self._produced[leaf] = CallSite(name, segment, ended, index)
        leaves = [leaf for leaf in all_leaves if isinstance(leaf, Tensor)]
        if call.state is not None:
            self.checked.add(name)
            inside = name + "."
            outside = {other for leaf in leaves for other in self._modules_of.get(leaf, (0, frozenset()))[1]
                       if other != name and not other.startswith(inside)}
            if call.state != _state(module) or outside or any(leaf in self._segment_of for leaf in leaves):
                self.unclean.add(name)
        for leaf in leaves:
            seen = self._modules_of.get(leaf)
            modules = seen[1] if seen is not None and seen[0] == segment else frozenset()
            self._modules_of[leaf] = (segment, modules | {name})

    def cut_output(self, value: Tensor, given: Tensor) -> None:
        """A cut point handed ``value`` (a view of ``given``) to the next segment (which is now running).

        Segments after the next one may read ``value`` again (cross-attention over an encoder's output that
        passed the last encoder block's cut): it is then a side value made where ``given`` was made, a module
        call's output on the stage before the cut.
        """
        self._segment_of[value] = self.segment()
        producer = self._produced.get(given)
        if producer is not None:
            self._produced[value] = producer

    # torch functions ----------------------------------------------------------------------------------------

    def before(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
               uses_parameters: bool) -> tuple[bool, frozenset[str]]:
        """Inspects a torch function's inputs; returns what its tensor results derive from (for :meth:`after`).

        Crossings are recorded by :meth:`after`, once it is known whether the function read values.
        """
        if _draws_random_numbers(name, args, kwargs):
            self.unclean.update(call.name for call in self._calls)
        self._pending = []
        if name in SHAPE_ONLY:
            return False, frozenset()
        segment = self.segment()
        from_parameters = uses_parameters
        modules: set[str] = set()
        for value in tree_leaves((args, kwargs)):
            if not isinstance(value, Tensor):
                continue
            origin = self._segment_of.get(value)
            if origin is not None:
                from_parameters = True
                if origin != segment:
                    self._pending.append(((origin, segment), value, None))
            labelled = self._modules_of.get(value)
            if labelled is not None:
                if labelled[0] == segment:
                    modules |= labelled[1]
                else:
                    self._pending.append(((labelled[0], segment), value, labelled[1]))
        return from_parameters, frozenset(modules)

    def after(self, name: str, derived: tuple[bool, frozenset[str]], out: object) -> None:
        """Labels a torch function's tensor results and records the crossings of a function that read values."""
        leaves = [leaf for leaf in tree_leaves(out) if isinstance(leaf, Tensor)]
        if self._pending and (leaves or name in VALUE_READS):
            consumer = self._consumer()
            for (source, destination), value, modules in self._pending:
                self._transport((source, destination, modules), value, destination, name)
                if modules is None:
                    self.from_parameters.setdefault(
                        (source, destination),
                        f"A tensor ({_describe(value)}) computed from parameters in segment {source}",
                    )
                else:
                    producers = ", ".join(sorted(_outermost(modules)))
                    self.from_modules.setdefault(
                        (source, destination, modules),
                        f"A tensor ({_describe(value)}) computed by {producers} in segment {source} and read by"
                        f" {consumer}",
                    )
        self._pending = []
        from_parameters, modules = derived
        segment = self.segment()
        for leaf in leaves:
            if from_parameters:
                self._segment_of[leaf] = segment
                self._made_by[leaf] = self._consumer()
            if modules:
                seen = self._modules_of.get(leaf)
                earlier = seen[1] if seen is not None and seen[0] == segment else frozenset()
                self._modules_of[leaf] = (segment, earlier | modules)

    def _transport(self, key: tuple[int, int, frozenset[str] | None], value: Tensor, segment: int,
                   function: str) -> None:
        """Records a read of ``value`` across crossing ``key`` as a side value, or why it cannot be one."""
        seen = self.transported.setdefault(key, {})
        if seen is None:
            return
        producer = self._produced.get(value)
        consumer = next((CallSite(call.name, segment, call.call, call.arguments[id(value)]) for call in self._calls
                         if call.segment == segment and call.arguments and id(value) in call.arguments), None)
        if producer is not None and consumer is None and value not in self._handled:
            # read by the step's own code: given as the producer's output on the reading stages
            seen.setdefault(producer, Reads(set(), set(), value)).step_reads.add(segment)
            return
        if producer is None or consumer is None:
            self.transported[key] = None
            made = f"made by {producer.module}" if producer is not None else (
                f"made by {self._made_by.get(value, 'the step')} outside any module's output")
            used = f"read by {consumer.module}" if consumer is not None else (
                f"read by {function}() in {self._consumer()}, not as an argument of a module call in segment"
                f" {segment}")
            handled = self._handled.get(value) if producer is not None and consumer is None else None
            if handled is not None:  # else it would be given at its producer's output on the reading stage
                used += f", and {handled} takes or gives it too"
            self.untransportable.setdefault(key, f"{made}, {used}")
            return
        seen.setdefault(producer, Reads(set(), set(), value)).consumers.add(consumer)

    def _consumer(self) -> str:
        for call in reversed(self._calls):
            if call.name:
                return call.name
        return "the step's own code"

    # results ------------------------------------------------------------------------------------------------

    def recomputed(self, module_segments: dict[str, set[int]]) -> tuple[set[str], Crossings]:
        """Which modules must run on every stage, and the crossings no stage layout can split.

        The crossings whose values are transported instead are kept in :attr:`carried`
        (see :meth:`side_values`).

        Args:
            module_segments: The segments of each module whose calls each stay in one segment (the stand-in
                candidates); a module is stood in for by its outermost such ancestor.

        Returns:
            The modules to recompute, and every unsplittable crossing (from parameters or from modules that cannot
            be recomputed, whose values cannot be transported).
        """
        recomputed: set[str] = set()
        unsplittable: Crossings = {}
        self.carried: set[tuple[int, int, frozenset[str] | None]] = set()
        for (source, destination), what in self.from_parameters.items():
            key: tuple[int, int, frozenset[str] | None] = (source, destination, None)
            if self.transported.get(key) is not None:
                self.carried.add(key)
            else:
                why = self.untransportable.get(key)
                unsplittable.setdefault((source, destination), f"{what} ({why})" if why else what)
        for (source, destination, modules), what in self.from_modules.items():
            stood_in = {a for name in modules if (a := _outermost_ancestor(name, module_segments)) is not None}
            blocking = sorted(n for n in stood_in if n not in self.checked or n in self.unclean)
            key = (source, destination, modules)
            if not blocking:
                recomputed |= stood_in
            elif self.transported.get(key) is not None:
                self.carried.add(key)
            else:
                why = self.untransportable.get(key)
                unsplittable.setdefault(
                    (source, destination),
                    f"{what} ({', '.join(blocking)} cannot run on a later stage itself: "
                    f"{_why_not(blocking, self.checked)}" + (f"; nor can the value be transported: {why})" if why
                                                             else ")"),
                )
        return recomputed, unsplittable

    def side_values(self) -> dict[CallSite, Reads]:
        """The side values of the crossings :meth:`recomputed` found carried, by producer."""
        merged: dict[CallSite, Reads] = {}
        for key in getattr(self, "carried", ()):
            for producer, reads in (self.transported[key] or {}).items():
                into = merged.setdefault(producer, Reads(set(), set(), reads.value))
                into.consumers |= reads.consumers
                into.step_reads |= reads.step_reads
        return merged


def producer_ancestors(values: Iterable[SideValue]) -> set[str]:
    """The modules within which the producers of ``values`` are called (not the root, not the producers).

    A stage that gives a value at its producer's output (:attr:`SideValue.step_reads`) runs these modules' code, so
    that the producer is called there; it stands in for their other submodules one by one.
    """
    names: set[str] = set()
    for value in values:
        parts = value.producer.module.split(".")
        names.update(".".join(parts[:end]) for end in range(1, len(parts)))
    return names


def _within(name: str, caller: str) -> bool:
    """Whether module ``name`` is ``caller`` or inside it (a call of ``caller`` runs ``name``'s)."""
    return not caller or name == caller or name.startswith(caller + ".")


def _outermost(names: frozenset[str]) -> list[str]:
    return [n for n in names if not any(n.startswith(other + ".") for other in names if other and other != n)]


def _outermost_ancestor(name: str, candidates: dict[str, set[int]]) -> str | None:
    """The outermost of ``name`` and its ancestors that a later stage stands in for (None: none is)."""
    parts = name.split(".")
    for end in range(1, len(parts) + 1):
        prefix = ".".join(parts[:end])
        if prefix in candidates:
            return prefix
    return None


def _why_not(names: list[str], checked: set[str]) -> str:
    if all(name in checked for name in names):
        return "it draws random numbers, writes its state, or its output depends on parameters"
    return "it has parameters, draws random numbers, writes its state, or its output depends on parameters"
