"""Counter-based random numbers from a seed tensor: pure tensor ops, so they run under
``torch.func`` transforms, ``torch.compile(fullgraph=True)``, CUDA-graph capture and on
``device="meta"``.

A stochastic function takes ``generator=``: a ``torch.Generator`` (eager; one 62-bit seed is
drawn from it, which advances its state) or a 0-d integer tensor used as the seed directly (the
form to use under compile or inside a captured graph, where the seed tensor can be updated in
place between replays). Random values are a hash of ``(seed, stream, index)``: the same seed
gives the same values on every device and in every mode.

The hash is 32-bit ``lowbias32``-style mixing written with int64 arithmetic that never overflows
(multiplications are split into 16-bit halves), so results do not depend on wrap-around
behaviour.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["random_bits", "seed_tensor", "uniform"]

_MASK32 = 0xFFFFFFFF
_SEED_HIGH = 1 << 62


def seed_tensor(generator: object, device: torch.device, name: str = "generator") -> Tensor:
    """The 0-d int64 seed a stochastic function uses, from ``generator``.

    Raises ``ValueError`` when it is ``None`` (randomness is always explicit) and ``TypeError``
    for anything but a ``torch.Generator`` or a 0-d integer tensor.
    """
    if generator is None:
        raise ValueError(
            f"{name} is required: pass a torch.Generator, or a 0-d int64 seed tensor "
            "(the form to use under torch.compile and CUDA graphs)"
        )
    if isinstance(generator, torch.Generator):
        seed = torch.randint(0, _SEED_HIGH, (), generator=generator, device=generator.device)
        return seed.to(device)
    if isinstance(generator, Tensor):
        if generator.ndim != 0:
            raise ValueError(
                f"{name} as a seed tensor must be 0-d, got shape {tuple(generator.shape)}"
            )
        if (
            generator.dtype.is_floating_point
            or generator.dtype.is_complex
            or generator.dtype == torch.bool
        ):
            raise TypeError(
                f"{name} as a seed tensor must have an integer dtype, got {generator.dtype}"
            )
        return generator.to(device=device, dtype=torch.int64)
    raise TypeError(
        f"{name} must be a torch.Generator or a 0-d integer seed tensor, got {type(generator).__name__}"
    )


def _mul32(x: Tensor, c: int) -> Tensor:
    """``(x * c) mod 2**32`` for ``0 <= x < 2**32`` without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit avalanche hash (``lowbias32``-style xorshift-multiply rounds)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def random_bits(seed: Tensor, stream: int, shape: tuple[int, ...], device=None) -> Tensor:
    """Independent 62-bit non-negative int64 values, one per element of ``shape``.

    ``stream`` separates the uses of one seed inside a function (each draw its own number).
    """
    device = seed.device if device is None else device
    n = 1
    for s in shape:
        n *= s
    idx = torch.arange(n, device=device, dtype=torch.int64)
    s_lo = seed & _MASK32
    s_hi = (seed >> 32) & _MASK32
    base = _mix32(_mix32(s_lo ^ _mix32(s_hi + stream * 0x9E37)) ^ (stream & _MASK32))
    lo_idx, hi_idx = idx & _MASK32, idx >> 32
    a = _mix32(_mix32(base ^ lo_idx) ^ hi_idx)
    b = _mix32(a ^ 0x5BD1E995)
    return ((a >> 1) << 31 | (b >> 1)).view(shape)


def uniform(
    seed: Tensor, stream: int, shape: tuple[int, ...], dtype=torch.float64, device=None
) -> Tensor:
    """Uniform values in ``[0, 1)`` with 53 random bits (``float64``; cast for other dtypes)."""
    bits = random_bits(seed, stream, shape, device) >> 9  # 53 bits
    u = bits.to(torch.float64) * (1.0 / (1 << 53))
    return u if dtype == torch.float64 else u.to(dtype)
