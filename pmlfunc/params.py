"""Learnable parameters of proxy and classifier losses: validation, initialisation, tree tools.

Parameters are a plain ``dict[str, Tensor]`` (an optree/torch pytree with no ``None`` leaves),
class-major: ``(num_classes, D)``, or ``(num_classes, K, D)`` for sub-centres. They are created by
``pf.losses.<loss>_init(...)`` and passed to the loss as its third positional argument, so
``torch.func.grad(loss, argnums=2)``, ``functional_call``, optimizers and compiled steps all see
them. Nothing here mutates or casts a parameter in place: float16/bfloat16 embeddings are
computed in float32 against the parameters, and the caller's tensors are never touched.

Example:
    >>> params = pf.losses.arcface_init(num_classes=10, embedding_size=16)
    >>> pf.params.count(params)  # parameters in the tree
    160
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch
from torch import Tensor

from . import _global
from ._ops import inside_transform

__all__ = [
    "check",
    "class_labels",
    "count",
    "generator_device",
    "init_kaiming_uniform",
    "init_normal",
    "tree_cast",
    "tree_flatten",
]


def check(
    params: object,
    key: str,
    embeddings: Tensor,
    *,
    ndim: int = 2,
    name: str = "params",
) -> Tensor:
    """Return ``params[key]`` after checking it against the embeddings.

    It must be a floating-point tensor with ``ndim`` dimensions (``(C, D)`` or ``(C, K, D)``, its
    last dimension the embedding width; ``ndim=0``: a scalar such as a logit scale), on the
    embeddings' device. Shapes only: no host sync.
    """
    if not isinstance(params, Mapping):
        raise TypeError(
            f"{name} must be a dict of tensors (from the loss's *_init), got {type(params).__name__}"
        )
    if key not in params:
        raise ValueError(f"{name} has no {key!r} entry (keys: {sorted(params)})")
    p = params[key]
    where = f"{name}[{key!r}]"
    if not isinstance(p, Tensor):
        raise TypeError(f"{where} must be a tensor, got {type(p).__name__}")
    if not p.dtype.is_floating_point:
        raise TypeError(f"{where} must be floating point, got {p.dtype}")
    if p.ndim != ndim:
        layout = {
            0: "() (a 0-d tensor)",
            2: "(num_classes, embedding_size)",
            3: "(num_classes, sub_centers, embedding_size)",
        }[ndim]
        raise ValueError(f"{where} must have shape {layout}, got {tuple(p.shape)}")
    if ndim > 0 and p.shape[-1] != embeddings.shape[-1]:
        raise ValueError(
            f"{where} has embedding size {p.shape[-1]} but embeddings have {embeddings.shape[-1]}"
        )
    if p.device != embeddings.device:
        raise ValueError(f"{where} is on {p.device} but embeddings are on {embeddings.device}")
    return p


def known_keys(params: Mapping, allowed: tuple[str, ...], name: str = "params") -> None:
    """A ``ValueError`` naming the entries of ``params`` outside ``allowed`` (a misspelt key would
    otherwise be ignored silently)."""
    unknown = sorted(str(k) for k in params if k not in allowed)
    if unknown:
        raise ValueError(f"{name} has unknown entries {unknown} (expected {', '.join(allowed)})")


def class_labels(labels: Tensor, num_classes: int, name: str = "labels") -> None:
    """Eager-only range check ``0 <= labels < num_classes``, with a clear ``ValueError``.

    It reads values, so it runs only where that costs no device synchronisation and cannot break
    a trace: on CPU tensors, outside ``torch.compile`` and ``torch.func`` transforms. Elsewhere it
    does nothing; an out-of-range label then fails inside the indexing op (an ``IndexError`` on
    CPU, a device-side assert on CUDA). Call it yourself on a CUDA batch when debugging.
    """
    if torch.compiler.is_compiling() or labels.device.type != "cpu" or labels.numel() == 0:
        return
    if inside_transform():
        return
    shard = _global.class_shard()  # params hold this rank's shard; labels are global class ids
    source = "params" if shard is None else "the ranks' shards together"
    num_classes = num_classes if shard is None else shard.num_classes
    lo, hi = int(labels.min()), int(labels.max())
    if lo < 0 or hi >= num_classes:
        raise ValueError(
            f"{name} must be in [0, {num_classes}) (num_classes from {source}), got values in "
            f"[{lo}, {hi}]"
        )


def generator_device(generator: torch.Generator | None, device) -> torch.device:
    """Where an init draws: ``device`` if given, else the generator's device, else CPU."""
    if device is not None:
        return torch.device(device)
    return torch.device("cpu") if generator is None else generator.device


def init_normal(
    shape: tuple[int, ...],
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device=None,
    std: float = 1.0,
) -> Tensor:
    """``N(0, std²)`` entries (PML's default ``torch.nn.init.normal_``).

    Sampled in float32 and cast, so one generator state gives the same values in every dtype.
    """
    _check_shape(shape)
    out = torch.empty(shape, dtype=torch.float32, device=generator_device(generator, device))
    return out.normal_(0.0, std, generator=generator).to(dtype)


def init_kaiming_uniform(
    shape: tuple[int, ...],
    *,
    fan_in: int,
    a: float = math.sqrt(5),
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> Tensor:
    """``U(−b, b)`` with ``b = gain·√(3 / fan_in)``, ``gain = √(2 / (1 + a²))``: PML's
    ``kaiming_uniform_(a=√5)`` computed with PML's fan (pass the fan of PML's layout).
    Sampled in float32 and cast, like :func:`init_normal`."""
    _check_shape(shape)
    bound = math.sqrt(2.0 / (1 + a * a)) * math.sqrt(3.0 / fan_in)
    out = torch.empty(shape, dtype=torch.float32, device=generator_device(generator, device))
    return out.uniform_(-bound, bound, generator=generator).to(dtype)


def _check_shape(shape: tuple[int, ...]) -> None:
    for n in shape:
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ValueError(f"parameter sizes must be positive integers, got {shape}")


def tree_cast(params, dtype: torch.dtype):
    """A copy of the parameter tree with floating-point leaves cast to ``dtype`` (never in place)."""
    return optree.tree_map(
        lambda t: t.to(dtype) if t.dtype.is_floating_point else t, params, namespace="torch"
    )


def count(params) -> int:
    """Total number of scalar parameters in the tree."""
    return sum(t.numel() for t in optree.tree_leaves(params, namespace="torch"))


def tree_flatten(params) -> tuple[Tensor, Callable[[Tensor], Any]]:
    """Concatenate every leaf into one flat vector; returns ``(vector, unflatten)``, where
    ``unflatten`` rebuilds a tree of ``params``'s structure (a dict for a loss's parameters).

    Useful for checks (``gradcheck`` over all parameters, comparing two trees at once).
    """
    leaves, spec = optree.tree_flatten(params, namespace="torch")
    shapes = [t.shape for t in leaves]
    flat = torch.cat([t.reshape(-1) for t in leaves]) if leaves else torch.empty(0)

    def unflatten(vector: Tensor) -> Any:
        if vector.ndim != 1 or vector.numel() != flat.numel():
            raise ValueError(
                f"unflatten needs a 1-D vector of the tree's {flat.numel()} entries, got shape "
                f"{tuple(vector.shape)}"
            )
        out, start = [], 0
        for shape in shapes:
            n = math.prod(shape)
            out.append(vector[start : start + n].view(shape))
            start += n
        return optree.tree_unflatten(spec, out)

    return flat, unflatten
