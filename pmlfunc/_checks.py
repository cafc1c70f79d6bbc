"""Input validation shared by every public function.

Checks look at shapes, dtypes and devices (never at values), so they cost nothing under
``torch.compile`` and never synchronise with the host; the one exception, :func:`index`, reads
index values only in eager mode on CPU and asserts on the device elsewhere. Each error names the
argument and what was expected.
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from ._ops import inside_transform, readable

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
LOW_PRECISION = (torch.float16, torch.bfloat16)


def tensor(x: object, name: str) -> Tensor:
    """``x``, refused with a ``TypeError`` naming ``name`` unless it is a tensor."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def floating(x: object, name: str) -> Tensor:
    """``x``, refused unless it is a floating-point tensor (``TypeError`` naming ``name``)."""
    x = tensor(x, name)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be floating-point, got {x.dtype}")
    return x


def embeddings(x: object, name: str = "embeddings") -> Tensor:
    """Validate a ``(B, D)`` floating-point embedding matrix with ``B >= 1`` and ``D >= 1``."""
    x = tensor(x, name)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be a floating-point tensor (float16/bfloat16/float32/float64), got {x.dtype}"
        )
    if x.ndim != 2:
        raise ValueError(
            f"{name} must be 2-D of shape (batch_size, embedding_size), got shape {tuple(x.shape)}"
        )
    if x.shape[0] == 0:
        raise ValueError(
            f"{name} is an empty batch (shape {tuple(x.shape)}); at least one row is required"
        )
    if x.shape[1] == 0:
        raise ValueError(f"{name} has embedding size 0 (shape {tuple(x.shape)})")
    return x


def labels(
    y: object,
    batch_size: int,
    device: torch.device,
    name: str = "labels",
    rows_of: str = "embeddings",
) -> Tensor:
    """Validate a 1-D integer label vector on ``device``, one label per row of ``rows_of``
    (``batch_size`` rows)."""
    if not isinstance(y, Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor of integer class ids, got {type(y).__name__}"
        )
    if y.dtype.is_floating_point or y.dtype.is_complex:
        raise TypeError(f"{name} must have an integer (or bool) dtype, got {y.dtype}")
    if y.ndim != 1:
        raise ValueError(f"{name} must be 1-D of shape (batch_size,), got shape {tuple(y.shape)}")
    if y.shape[0] != batch_size:
        raise ValueError(
            f"{name} has length {y.shape[0]} but {rows_of} has {batch_size} rows (one label per row)"
        )
    if y.device != device:
        raise ValueError(f"{name} is on {y.device} but {rows_of} is on {device}")
    return y


def index(t: Tensor, size: int, name: str) -> Tensor:
    """Integer indices into ``size`` rows, negative ones wrapped (Python's and PML's rule:
    ``-1`` is the last row), after checking ``−size ≤ t < size`` (:func:`in_range`)."""
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int32 or int64 index tensor, got {t.dtype}")
    low = in_range(t, -size, size, name, f"for {size} rows")
    return t if low is not None and low >= 0 else torch.where(t < 0, t + size, t)


def in_range(
    t: Tensor,
    low: int,
    high: int,
    name: str,
    what: str = "",
    error: type[Exception] = IndexError,
) -> int | None:
    """Check ``low ≤ t < high`` where reading the values costs nothing and cannot break a
    trace: in eager mode on CPU an ``error`` (default ``IndexError``) naming ``name``, the first
    offending position (none for a 0-d ``t``) and the valid range. On CUDA and under
    ``torch.compile`` it is a device-side assert (``torch._assert_async``: no host sync; a
    ``RuntimeError`` when it fires). Not checked on ``meta`` or inside ``torch.func``
    transforms (no batching rule for the assert). ``what`` (e.g. ``"for 8 rows"``) follows "is
    out of range" in the message. Returns the smallest value where it was read (eager, CPU: one
    reduction reads both ends), else ``None``."""
    if t.numel() == 0 or inside_transform():
        return None
    if readable(t):  # the usual, valid case: both ends from one reduction
        lo, hi = (int(v) for v in torch.aminmax(t))
        if lo >= low and hi < high:
            return lo
    inside = (t >= low) & (t < high)
    what = f" {what}" if what else ""
    if readable(t):
        if not bool(inside.all()):
            pos = tuple(int(i) for i in (~inside).nonzero()[0]) if t.ndim else ()
            where = "" if not pos else f"[{pos[0] if len(pos) == 1 else pos}]"
            raise error(
                f"{name}{where} = {int(t[pos])} is out of range{what} "
                f"(valid: {low} <= value < {high})"
            )
    elif t.device.type != "meta":
        # (pyright: torch's __all__ omits the private name)
        torch._assert_async(inside.all(), f"{name}: a value is out of range{what} [{low}, {high})")  # pyright: ignore[reportPrivateImportUsage]
    return None


def same_space(x: Tensor, ref: Tensor, ref_name: str = "ref_emb", name: str = "embeddings") -> None:
    """``ref`` must live in the same space as ``x``: same width, dtype and device."""
    if ref.shape[1] != x.shape[1]:
        raise ValueError(
            f"{ref_name} has embedding size {ref.shape[1]} but {name} has {x.shape[1]}"
        )
    if ref.dtype != x.dtype:
        raise TypeError(f"{ref_name} has dtype {ref.dtype} but {name} has {x.dtype}")
    if ref.device != x.device:
        raise ValueError(f"{ref_name} is on {ref.device} but {name} is on {x.device}")


def paired_rows(a: object, b: object, names: tuple[str, str], what: str) -> tuple[Tensor, Tensor]:
    """Two sets whose row ``i`` pair (queries and their positives, two modalities): each
    embeddings (:func:`embeddings`), the same space (:func:`same_space`) and as many rows,
    else an error that says ``what`` pairs them."""
    x, y = embeddings(a, names[0]), embeddings(b, names[1])
    same_space(x, y, names[1], names[0])
    if y.shape[0] != x.shape[0]:
        raise ValueError(
            f"{what} pairs row i of {names[0]} with row i of {names[1]}: they need as many "
            f"rows, got {x.shape[0]} and {y.shape[0]}"
        )
    return x, y


def integer(value: object, name: str, *, minimum: int = 1) -> int:
    """A Python integer (not ``bool``) of at least ``minimum``: ``TypeError`` for any other type,
    ``ValueError`` below the minimum."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return int(value)


def chunk_size(value: object, name: str = "chunk_size") -> int:
    """A chunk size: a Python int >= 1; a ``ValueError`` for anything else (``None`` included,
    where the caller asked for chunking)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def number(value: object, name: str, *, positive: bool = False, nonnegative: bool = False) -> float:
    """A Python real number (not ``bool``, not a tensor), with an optional sign constraint:
    ``TypeError`` for any other type, ``ValueError`` for the wrong sign."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a Python number, got {type(value).__name__}")
    value = float(value)
    if positive and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if nonnegative and not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def hyper(
    value: object, name: str, *, positive: bool = False, nonnegative: bool = False
) -> float | Tensor:
    """Validate a hyper-parameter given as a Python number or a 0-d tensor.

    Sign constraints are checked for Python numbers only; a tensor is never read on the host.
    """
    if isinstance(value, Tensor):
        if value.ndim != 0:
            raise ValueError(
                f"{name} must be a Python number or a 0-d tensor, got shape {tuple(value.shape)}"
            )
        if not (value.dtype.is_floating_point or value.dtype in (torch.int32, torch.int64)):
            raise TypeError(f"{name} must be a real number, got dtype {value.dtype}")
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a Python number or a 0-d tensor, got {type(value).__name__}"
        )
    return number(value, name, positive=positive, nonnegative=nonnegative)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype reductions accumulate in: float32 for float16/bfloat16 inputs, else the input's."""
    return torch.float32 if dtype in LOW_PRECISION else dtype
