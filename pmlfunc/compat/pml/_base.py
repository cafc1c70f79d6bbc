"""The machinery of the PML-compatible modules: a class is a PML class name, PML's positional
order and defaults, and the pmlfunc function it calls (the subclasses in ``losses.py``,
``miners.py``, ... are that data and nothing else).

Every compat object keeps the pure thing it stands for in ``.function`` (a loss or miner
function, a :class:`pmlfunc.distances.Distance`, a reducer, a regularizer); a loss or miner
hands its compat arguments over as their ``.function``. Constructor arguments are kept as
attributes under PML's names, read at every call, so ``loss.margin = 0.3`` takes effect as it
does in PML.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

__all__ = [
    "Compat",
    "Loss",
    "Miner",
    "bind",
    "degrees",
    "given",
    "global_seed",
    "no_grad_copy",
    "radians",
    "reciprocal",
    "required",
    "same",
    "to_pure",
]


class Compat(nn.Module):
    """A PML-named module over a pmlfunc function.

    Class attributes (the data of a subclass):
        signature: PML's constructor arguments in their positional order.
        defaults: PML 2.9.0's default of each argument of ``signature`` whose pmlfunc default
            differs or that pmlfunc does not take (``required`` marks one without a default).
        units: the arguments PML keeps as an attribute in other units than its constructor's
            (ArcFace's margin in radians, SoftTriple's ``1/γ``): ``{name: (constructor value ->
            PML's attribute, attribute -> the function's argument)}``; the attribute holds PML's
            value, so code that reads or sets it (a margin schedule) means what it does in PML.
    """

    signature: ClassVar[tuple[str, ...]] = ()
    defaults: ClassVar[Mapping[str, Any]] = {}
    units: ClassVar[Mapping[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]]] = {}
    shared: ClassVar[tuple[str, ...]] = ()  # PML's base-class keywords this family takes
    consumed: ClassVar[tuple[str, ...]] = ()  # kept as attributes, not passed to the function

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self._names: tuple[str, ...] = ()
        for name, value in bind(type(self), args, kwargs).items():
            if name in self.units and value is not None:
                value = self.units[name][0](value)
            setattr(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        """Set as ``nn.Module`` does; an argument of the class's (``signature``, ``shared``;
        not ``consumed``) joins the function's options whenever it is set, in the constructor
        or after it (``loss.temperature = 0.5`` in a schedule, as PML reads ``self.temperature``
        at every call)."""
        super().__setattr__(name, value)
        cls = type(self)
        if (name in cls.signature or name in cls.shared) and name not in cls.consumed:
            names = self.__dict__.get("_names")
            if names is not None and name not in names:
                object.__setattr__(self, "_names", (*names, name))

    def argument(self, name: str) -> Any:
        """The constructor argument ``name`` as it stands now."""
        return getattr(self, name)

    def options(self) -> dict[str, Any]:
        """The function's keyword arguments: the attributes as pmlfunc takes them."""
        out = {}
        for name in self._names:
            value = to_pure(getattr(self, name))
            if name in self.units and value is not None:
                value = self.units[name][1](value)
            out[name] = value
        return out

    def extra_repr(self) -> str:
        return ", ".join(f"{n}={getattr(self, n)!r}" for n in self._names if n not in self._modules)


_REQUIRED = object()


def radians(value: Any) -> Any:
    """Degrees to radians (``np.radians``'s value), a number or a tensor."""
    return value * (math.pi / 180.0)


def degrees(value: Any) -> Any:
    """Radians to degrees; a CPU 0-d tensor (PML's ``AngularLoss.alpha``) as a number."""
    if isinstance(value, Tensor) and value.device.type == "cpu" and not value.requires_grad:
        value = float(value)
    return value * (180.0 / math.pi)


def same(value: Any) -> Any:
    return value


def reciprocal(value: Any) -> Any:
    return 1.0 / value


def bind(cls: type[Compat], args: tuple, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """PML's constructor call ``cls(*args, **kwargs)`` as ``{name: value}``: positional
    arguments in ``cls.signature`` order, PML's defaults where ``cls.defaults`` has them;
    ``TypeError`` for what PML's class would not take."""
    name = cls.__name__
    if len(args) > len(cls.signature):
        raise TypeError(
            f"{name} takes at most {len(cls.signature)} positional arguments "
            f"({', '.join(cls.signature) or 'none'}), got {len(args)}"
        )
    given = dict(zip(cls.signature, args, strict=False))
    for key, value in kwargs.items():
        if key in given:
            raise TypeError(f"{name} got multiple values for argument {key!r}")
        if key not in cls.signature and key not in cls.shared:
            known = ", ".join((*cls.signature, *cls.shared))
            raise TypeError(f"{name} got an unexpected keyword argument {key!r} (takes {known})")
        given[key] = value
    out = {k: v for k, v in cls.defaults.items() if k not in given}
    missing = [k for k, v in out.items() if v is _REQUIRED]
    if missing:
        raise TypeError(f"{name} missing required argument(s): {', '.join(missing)}")
    return {**out, **given}


def required() -> Any:
    """The default of an argument PML requires."""
    return _REQUIRED


def to_pure(value: Any) -> Any:
    """A compat distance's, reducer's or regularizer's ``.function`` (a list or dict of them
    element-wise); a compat loss or miner is itself the callable pmlfunc's wrappers take;
    anything else as it is."""
    if isinstance(value, Loss | Miner):
        return value
    if isinstance(value, Compat):
        return value.function
    if isinstance(value, list | tuple):
        return type(value)(to_pure(v) for v in value)
    if isinstance(value, dict):
        return {k: to_pure(v) for k, v in value.items()}
    return value


def given(**inputs: Any) -> dict[str, Any]:
    """The call's optional inputs that were given (PML's ``None`` for absent)."""
    return {k: v for k, v in inputs.items() if v is not None}


class Loss(Compat):
    """A PML loss: ``forward(embeddings, labels=None, indices_tuple=None, ref_emb=None,
    ref_labels=None)`` is ``function(embeddings, labels, **options, ...)``."""

    function: ClassVar[Callable[..., Tensor]]
    shared = ("distance", "reducer", "embedding_regularizer", "embedding_reg_weight")

    def params(self) -> dict[str, Tensor] | None:
        """The function's ``params`` (the learnable losses: their parameters in pmlfunc's
        layout, views of PML's)."""
        return None

    def forward(
        self,
        embeddings: Tensor,
        labels: Tensor | None = None,
        indices_tuple: Any = None,
        ref_emb: Tensor | None = None,
        ref_labels: Tensor | None = None,
    ) -> Tensor:
        inputs = given(indices_tuple=indices_tuple, ref_emb=ref_emb, ref_labels=ref_labels)
        params = self.params()
        fn = type(self).function
        if params is None:
            return fn(embeddings, labels, **self.options(), **inputs)
        return fn(embeddings, labels, params, **self.options(), **inputs)


class Miner(Compat):
    """A PML miner: ``forward(embeddings, labels, ref_emb=None, ref_labels=None)`` returns PML's
    index tuple (``.to_indices()`` of the function's fixed-shape result: one host
    synchronisation, as in PML)."""

    function: ClassVar[Callable[..., Any]]
    shared = ("distance",)

    def forward(
        self,
        embeddings: Tensor,
        labels: Tensor | None = None,
        ref_emb: Tensor | None = None,
        ref_labels: Tensor | None = None,
    ) -> tuple[Tensor, ...]:
        inputs = given(ref_emb=ref_emb, ref_labels=ref_labels)
        mined = type(self).function(embeddings, labels, **self.options(), **inputs)
        return mined.to_indices()


def global_seed() -> Tensor:
    """A 0-d int64 seed for a stochastic function, drawn from torch's global RNG (where PML
    draws its samples): ``torch.manual_seed`` makes the calls repeatable, as in PML."""
    return torch.randint(0, 2**62, (), dtype=torch.int64)


def no_grad_copy(buffer: Tensor, value: Tensor) -> None:
    """Write a new state into a module's buffer (the stateful losses' update)."""
    with torch.no_grad():
        buffer.copy_(value)
