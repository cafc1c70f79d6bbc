r"""Fixed-shape miner results: what :mod:`pmlfunc.miners` returns and every loss accepts as
``indices_tuple``.

PML's miners return index lists whose lengths depend on the data, so every call synchronises with
the host and breaks ``torch.compile(fullgraph=True)`` and CUDA graphs. pmlfunc's results have
shapes that depend on shapes only:

| type | holds | made by |
|---|---|---|
| :class:`MinedPairs` | ``(B, M)`` positive / negative pair multiplicities | pair miners |
| :class:`MinedTriplets` | ``(L,)`` anchor / positive / negative indices and a 0/1 ``valid`` weight | batch-hard, distance-weighted, any triplet miner with ``tuples_per_anchor`` |
| :class:`PackagedTriplets` | a ``MinedTriplets`` known to be rows ``(3i, 3i+1, 3i+2)``, every slot valid | ``embeddings_already_packaged_as_triplets`` |
| :class:`TripletWindow` | all triplets with ``low < e_an − e_ap ≤ high``, never enumerated | ``triplet_margin`` |
| :class:`TripletMask` | a ``(B, M, M)`` boolean triplet mask | ``angular`` |

``e`` is the miner's matrix oriented so that smaller means closer (a similarity enters as
``−s``). Each result can give the loss what it needs: pair multiplicities (as PML's
``convert_to_pairs``: a triplet ``(a, p, n)`` lists the pairs ``(a, p)`` and ``(a, n)``), the
per-sample counts of PML's ``convert_to_weights``, and triplets grouped by anchor (a pair result
becomes the triplets ``(a, p, n)`` whose two pairs share the anchor ``a``, never the product of
all positive and all negative pairs). :meth:`to_indices` gives PML-style index tuples in eager
mode (it synchronises; it is for inspection and interoperability, not for the training step).
Losses still accept PML tuples.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from . import _checks, _ops

__all__ = [
    "MINED_TYPES",
    "MinedPairs",
    "MinedTriplets",
    "PackagedTriplets",
    "TripletMask",
    "TripletWindow",
    "WindowSearch",
    "is_mined",
]


CUBE_BLOCK = 1 << 22  # elements of one (chunk, M, M) block of a triplet cube
# In CPU eager mode, blocks that stay in cache (256 KiB of float32): each elementwise pass over a
# fresh 16 MiB block pays its page faults; PNP at B = 128 runs ~3x faster in 64 Ki blocks.
# Accelerators and compiled graphs keep the large blocks (few launches, a short unrolled loop).
CPU_CUBE_BLOCK = 1 << 16


def cube_chunk(m: int, device: torch.device | None = None, width: int | None = None) -> int:
    """Anchors per chunk so that a ``(chunk, width, M)`` block of a triplet cube (``width``:
    ``M`` unless given, e.g. each anchor's listed columns) holds about :data:`CUBE_BLOCK`
    elements (:data:`CPU_CUBE_BLOCK` for a CPU ``device`` in eager mode), at least one anchor."""
    cpu = device is not None and device.type == "cpu" and not torch.compiler.is_compiling()
    size = m * (m if width is None else width)
    return max(1, (CPU_CUBE_BLOCK if cpu else CUBE_BLOCK) // max(1, size))


_ROLES = {3: ("anchors", "positives", "negatives"), 4: ("a1", "p", "a2", "n")}


def check_tuple(indices_tuple: object, shape: tuple[int, int] | None = None) -> tuple[Tensor, ...]:
    """Validate a PML index tuple: 3 ``(anchors, positives, negatives)`` or 4 ``(a1, p, a2, n)``
    1-D int32/int64 tensors of matching lengths.

    With ``shape = (B, M)`` the indices are also checked against it (anchors index the ``B``
    query rows, the others the ``M`` reference rows) and returned with negative indices wrapped,
    as PML and Python index: an ``IndexError`` naming the offending position and the valid range
    in eager mode on CPU; elsewhere a device-side assert (``torch._assert_async``, no host sync),
    except inside ``torch.func`` transforms, where indices are not checked. Every loss reads a
    PML tuple through this function.
    """
    if not isinstance(indices_tuple, (tuple, list)) or len(indices_tuple) not in (3, 4):
        raise ValueError(
            "indices_tuple must be a tuple of 3 (anchors, positives, negatives) or 4 (a1, p, a2, n) index tensors"
        )
    for i, t in enumerate(indices_tuple):
        if not isinstance(t, Tensor):
            raise TypeError(f"indices_tuple[{i}] must be a tensor, got {type(t).__name__}")
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(
                f"indices_tuple[{i}] must be an int32 or int64 index tensor, got {t.dtype}"
            )
        if t.ndim != 1:
            raise ValueError(f"indices_tuple[{i}] must be 1-D, got shape {tuple(t.shape)}")
    n = len(indices_tuple)
    lengths = [t.shape[0] for t in indices_tuple]
    if n == 3 and len(set(lengths)) != 1:
        raise ValueError(f"indices_tuple (a, p, n) tensors must have equal lengths, got {lengths}")
    if n == 4 and (lengths[0] != lengths[1] or lengths[2] != lengths[3]):
        raise ValueError(
            f"indices_tuple (a1, p, a2, n) needs len(a1) == len(p) and len(a2) == len(n), got {lengths}"
        )
    if shape is None:
        return tuple(indices_tuple)
    b, m = shape
    sizes = (b, m, m) if n == 3 else (b, m, b, m)
    return tuple(
        _checks.index(t, size, f"indices_tuple[{i}] ({role})")
        for i, (t, size, role) in enumerate(zip(indices_tuple, sizes, _ROLES[n], strict=True))
    )


def _pair_rows(x: Tensor, rows: tuple[int, int] | None) -> Tensor:
    return x if rows is None else x[rows[0] : rows[1]]


def _counts_by_index(
    index: Tensor, weights: Tensor, size: int, dtype: torch.dtype, device
) -> Tensor:
    out = torch.zeros(size, dtype=dtype, device=device)
    return out.index_add(0, index.reshape(-1).long(), weights.reshape(-1).to(dtype))


def grid_counts(
    anchors: Tensor,
    cols: Tensor,
    shape: tuple[int, int],
    dtype: torch.dtype,
    rows: tuple[int, int] | None = None,
    weights: Tensor | None = None,
) -> Tensor:
    """Pair multiplicities over the ``(B, M)`` grid: ``Σ_k weights_k`` at ``(anchors_k,
    cols_k)`` (weight 1 when ``weights`` is ``None``). With ``rows = (r0, r1)`` only the pairs of
    the chunk's anchors, as a ``(r1 − r0, M)`` grid: the others are counted into one spare cell
    that is dropped, so shapes stay static."""
    anchors, cols = anchors.reshape(-1).long(), cols.reshape(-1).long()
    n_rows, n_cols = shape
    w = (
        torch.ones(anchors.shape, dtype=dtype, device=anchors.device)
        if weights is None
        else weights.reshape(-1).to(dtype)
    )
    r0, r1 = (0, n_rows) if rows is None else rows
    flat = (anchors - r0) * n_cols + cols
    spare = (r1 - r0) * n_cols
    if rows is not None:
        flat = torch.where((anchors >= r0) & (anchors < r1), flat, spare)
    out = torch.zeros(spare + 1, dtype=dtype, device=anchors.device).index_add(0, flat, w)
    return out[:spare].view(r1 - r0, n_cols)


def _eager_only(name: str) -> None:
    if torch.compiler.is_compiling():
        raise RuntimeError(f"{name}.to_indices() is eager-only (its output size depends on values)")


class MinedPairs(NamedTuple):
    """Mined pairs as ``(B, M)`` multiplicities over the query × reference grid.

    ``pos[a, j]`` (``neg[a, j]``) is how often ``(a, j)`` is a mined positive (negative) pair:
    0/1 for most miners, larger when a miner samples with replacement (``uniform_histogram``).
    """

    pos: Tensor
    neg: Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (self.pos.shape[0], self.pos.shape[1])

    def pair_masks(self, shape, dtype: torch.dtype, rows=None) -> tuple[Tensor, Tensor]:
        return _pair_rows(self.pos, rows).to(dtype), _pair_rows(self.neg, rows).to(dtype)

    def any_pairs(self) -> tuple[Tensor, Tensor]:
        return self.pos.sum() > 0, self.neg.sum() > 0

    def sample_counts(self, batch_size: int, dtype: torch.dtype, anchors_only: bool) -> Tensor:
        """Each query sample's number of appearances (PML's ``convert_to_weights`` counts)."""
        counts = (self.pos.sum(-1) + self.neg.sum(-1)).to(dtype)
        if not anchors_only:  # self mode: columns are the same samples
            counts = counts + (self.pos.sum(0) + self.neg.sum(0)).to(dtype)
        return counts

    def to_indices(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """PML pairs ``(a1, p, a2, n)``, each pair repeated by its multiplicity (eager only)."""
        _eager_only("MinedPairs")
        out = []
        for w in (self.pos, self.neg):
            reps = w.round().long().reshape(-1)
            flat = torch.arange(reps.numel(), device=w.device).repeat_interleave(reps)
            out += [flat // w.shape[1], flat % w.shape[1]]
        return out[0], out[1], out[2], out[3]


class MinedTriplets(NamedTuple):
    """Mined triplets as fixed-length ``(L,)`` index tensors with a 0/1 ``valid`` weight.

    Invalid slots hold index 0 and weight 0: they count nowhere (not in a mean, not as a pair).
    """

    anchors: Tensor
    positives: Tensor
    negatives: Tensor
    valid: Tensor

    def pair_masks(self, shape, dtype: torch.dtype, rows=None) -> tuple[Tensor, Tensor]:
        a, w = self.anchors, self.valid
        return (
            grid_counts(a, self.positives, shape, dtype, rows, w),
            grid_counts(a, self.negatives, shape, dtype, rows, w),
        )

    def any_pairs(self) -> tuple[Tensor, Tensor]:
        has = self.valid.sum() > 0
        return has, has

    def sample_counts(self, batch_size: int, dtype: torch.dtype, anchors_only: bool) -> Tensor:
        idx = (self.anchors,) if anchors_only else (self.anchors, self.positives, self.negatives)
        w = self.valid
        return sum(_counts_by_index(i, w, batch_size, dtype, w.device) for i in idx)  # type: ignore[return-value]  # idx is never empty: a Tensor

    def for_rows(self, rows: tuple[int, int] | None) -> MinedTriplets:
        """The triplets of the anchor ``rows = (r0, r1)`` of a chunk, anchors renumbered from 0:
        the other slots keep their length with weight 0 (static shapes). ``None``: all."""
        if rows is None:
            return self
        r0, r1 = rows
        a = self.anchors.long()
        valid = self.valid * ((a >= r0) & (a < r1)).to(self.valid.dtype)
        return self._replace(anchors=(a - r0).clamp(0, r1 - r0 - 1), valid=valid)

    def to_indices(self) -> tuple[Tensor, Tensor, Tensor]:
        """PML triplets ``(a, p, n)`` of the valid slots (eager only)."""
        _eager_only("MinedTriplets")
        keep = self.valid > 0
        return self.anchors[keep].long(), self.positives[keep].long(), self.negatives[keep].long()


class PackagedTriplets(MinedTriplets):
    """:class:`MinedTriplets` whose triplet ``i`` is rows ``(3i, 3i+1, 3i+2)`` of ``3T`` rows,
    every slot valid: what :func:`~pmlfunc.miners.embeddings_already_packaged_as_triplets`
    returns. A loss given them on their rows reads the ``(T, 3, D)`` view of the rows (each
    anchor against the next two rows, no gather and no scattered add; as
    ``F.triplet_margin_loss`` on ``e[0::3], e[1::3], e[2::3]``) and checks their range on
    shapes alone; anywhere else they are a ``MinedTriplets``.

    Only :meth:`of` makes one. Anything that builds the tuple again from fields (the
    constructor, ``_make``, ``_replace``, a tree map of ``torch.utils._pytree`` or optree,
    ``copy``, ``pickle``, a transform's output) gets a plain ``MinedTriplets`` of those fields:
    fields made another way are no longer known to be packaged, and are read by index.

    Example:
        >>> t = PackagedTriplets.of(6, None, torch.float32)
        >>> t.anchors, t.positives, t.negatives
        (tensor([0, 3]), tensor([1, 4]), tensor([2, 5]))
        >>> type(t._replace(valid=torch.tensor([1.0, 0.0]))).__name__
        'MinedTriplets'
        >>> from torch.utils._pytree import tree_map
        >>> type(tree_map(lambda f: f.flip(0), t)).__name__
        'MinedTriplets'
    """

    __slots__ = ()

    def __new__(cls, anchors: Tensor, positives: Tensor, negatives: Tensor, valid: Tensor):
        return MinedTriplets(anchors, positives, negatives, valid)

    @classmethod
    def of(cls, rows: int, device: torch.device | None, dtype: torch.dtype) -> PackagedTriplets:
        """The ``rows // 3`` triplets of ``rows`` packaged rows, ``valid`` of ``dtype``."""
        a = torch.arange(0, rows, 3, device=device)
        return tuple.__new__(
            cls, (a, a + 1, a + 2, torch.ones(a.shape, dtype=dtype, device=device))
        )

    @classmethod
    def _make(cls, iterable) -> MinedTriplets:  # type: ignore[override]
        return MinedTriplets._make(iterable)

    def _replace(self, **fields: Tensor) -> MinedTriplets:  # type: ignore[override]
        return MinedTriplets(*self)._replace(**fields)


def source_of(distance: object, tensors: tuple) -> tuple:
    """What a matrix is computed from, for :class:`TripletWindow`'s ``source``: ``(distance,
    tensors, their version counters)`` (``None`` for an absent tensor). The counters tell a
    tensor written in place since (a buffer or queue updated between mining and the loss) from
    the one the miner read; under ``torch.compile``, which cannot compare them in a graph, they
    are left out (``()``) and the objects alone are compared."""
    if torch.compiler.is_compiling():
        return (distance, tensors, ())
    return (distance, tensors, tuple(None if t is None else t._version for t in tensors))


class TripletWindow(NamedTuple):
    r"""Every triplet ``(a, p, n)`` with ``pos[a, p]``, ``neg[a, n]`` and
    ``low < e_an − e_ap ≤ high``, held implicitly (``O(B·M)`` memory for ``O(B·M²)`` triplets).

    The window is evaluated as ``e_ap + low < e_an ≤ e_ap + high`` (PML subtracts first; the two
    agree except within one rounding of a bound). ``source`` records what the miner's matrix
    came from (the embeddings and reference tensors, or the ``mat`` it was given, their
    version counters and the distance, :func:`source_of`): a triplet loss computed from the
    same source, not written in place since, sorts each row once and reads the
    window and its own hinge together in ``O(B·M log M)``; any other loss re-evaluates the window
    triplet by triplet, exactly, in anchor chunks.
    """

    e: Tensor  # (B, M), detached, smaller = closer
    pos: Tensor  # (B, M) 0/1
    neg: Tensor  # (B, M) 0/1
    low: float | Tensor
    high: float | Tensor
    source: tuple = ()

    def search(self, margin: float | Tensor | None = None) -> WindowSearch:
        """One sort per row of the negatives by ``e``; for every column ``j`` the sorted-position
        range ``[first_j, stop_j)`` of the negatives in ``j``'s window (narrowed to
        ``e_an < e_aj + margin`` when ``margin`` is given), by binary search."""
        return _window_search(self.e, self.pos, self.neg, self.low, self.high, margin)

    def pair_masks(self, shape, dtype: torch.dtype, rows=None) -> tuple[Tensor, Tensor]:
        """Per positive pair the number of its negatives, per negative pair the number of
        positives whose window holds it (PML's ``convert_to_pairs`` multiplicities)."""
        found = self.search()
        cover = window_cover(found)
        return _pair_rows(found.count, rows).to(dtype), _pair_rows(cover, rows).to(dtype)

    def any_pairs(self) -> tuple[Tensor, Tensor]:
        has = self.search().count.sum() > 0
        return has, has

    def sample_counts(self, batch_size: int, dtype: torch.dtype, anchors_only: bool) -> Tensor:
        return _triplet_sample_counts(*self.pair_masks(None, dtype), anchors_only)

    def for_rows(self, rows: tuple[int, int] | None) -> TripletWindow:
        """The window of the anchor ``rows = (r0, r1)`` of a chunk (``None``: all)."""
        if rows is None:
            return self
        r0, r1 = rows
        return self._replace(e=self.e[r0:r1], pos=self.pos[r0:r1], neg=self.neg[r0:r1])

    def select(self, start: int, stop: int) -> Tensor:
        """The ``(stop − start, M, M)`` boolean block of the triplet cube for anchors
        ``start..stop`` (the window compared exactly as :meth:`search` does)."""
        e = self.e[start:stop]
        ap = e.unsqueeze(-1)
        an = e.unsqueeze(-2)
        inside = (an > ap + self.low) & (an <= ap + self.high)
        return (
            inside
            & (self.pos[start:stop] > 0).unsqueeze(-1)
            & (self.neg[start:stop] > 0).unsqueeze(-2)
        )

    def to_indices(self) -> tuple[Tensor, Tensor, Tensor]:
        """PML triplets ``(a, p, n)`` ordered by anchor, positive, negative (eager only)."""
        _eager_only("TripletWindow")
        return _cube_indices(self.select, self.e.shape)


class TripletMask(NamedTuple):
    """Mined triplets as a ``(B, M, M)`` boolean cube: ``mask[a, p, n]``.

    ``O(B·M²)`` bytes; pass ``tuples_per_anchor`` to the miner for a bounded
    :class:`MinedTriplets` instead.
    """

    mask: Tensor

    def pair_masks(self, shape, dtype: torch.dtype, rows=None) -> tuple[Tensor, Tensor]:
        m = _pair_rows(self.mask, rows).to(dtype)
        return m.sum(-1), m.sum(-2)

    def any_pairs(self) -> tuple[Tensor, Tensor]:
        has = self.mask.any()
        return has, has

    def sample_counts(self, batch_size: int, dtype: torch.dtype, anchors_only: bool) -> Tensor:
        return _triplet_sample_counts(*self.pair_masks(None, dtype), anchors_only)

    def for_rows(self, rows: tuple[int, int] | None) -> TripletMask:
        """The mask of the anchor ``rows = (r0, r1)`` of a chunk (``None``: all)."""
        return self if rows is None else TripletMask(self.mask[rows[0] : rows[1]])

    def select(self, start: int, stop: int) -> Tensor:
        return self.mask[start:stop]

    def to_indices(self) -> tuple[Tensor, Tensor, Tensor]:
        """PML triplets ``(a, p, n)`` ordered by anchor, positive, negative (eager only)."""
        _eager_only("TripletMask")
        a, p, n = torch.where(self.mask)
        return a, p, n


MINED_TYPES = (MinedPairs, MinedTriplets, TripletWindow, TripletMask)


def _triplet_sample_counts(pos: Tensor, neg: Tensor, anchors_only: bool) -> Tensor:
    """Each sample's count in the triplet list ``(a, p, n)`` (PML's ``convert_to_weights`` of a
    triplet tuple: every triplet lists its anchor once), from the pair multiplicities: an
    anchor's triplets are the sum of its positive pairs' multiplicities."""
    anchors = pos.sum(-1)
    if anchors_only:
        return anchors
    return anchors + pos.sum(0) + neg.sum(0)


def is_mined(x: object) -> bool:
    """Whether ``x`` is one of pmlfunc's fixed-shape miner results (not a PML index tuple).

    Example:
        >>> is_mined(MinedPairs(torch.zeros(2, 2), torch.zeros(2, 2)))
        True
    """
    return isinstance(x, MINED_TYPES)


_TRIPLET_FIELDS = ("anchors", "positives", "negatives")


def _all_below(fields: tuple[Tensor, ...], size: int) -> bool:
    """Whether every index of ``fields`` (1-D, one length and dtype) is read to lie in ``[0,
    size)`` by one reduction over them (a CPU tensor in eager mode, :func:`_ops.readable`):
    two host reads where each field's own check took two (the usual, valid call); ``False``
    where that is not known (then each field is checked on its own)."""
    first = fields[0]
    if not first.numel() or not _ops.readable(first) or any(t.dtype != first.dtype for t in fields):
        return False
    lo, hi = (int(v) for v in torch.aminmax(torch.stack(fields)))
    return lo >= 0 and hi < size


def check_mined(result: object, shape: tuple[int, int]):
    """Validate a fixed-shape miner result against the ``(B, M)`` grid of its reader and return
    it: :class:`MinedPairs`' and :class:`TripletWindow`'s ``(B, M)`` fields and
    :class:`TripletMask`'s ``(B, M, M)`` cube (a ``ValueError`` naming the field); a
    :class:`MinedTriplets`' four 1-D fields of one length, integer indices with
    ``0 ≤ anchors < B`` and ``0 ≤ positives, negatives < M`` (no wrapping: a miner's slots are
    never negative). An index out of range is an ``IndexError`` naming the field and its first
    offending position in eager mode on CPU, a device-side assert elsewhere, unchecked inside
    ``torch.func`` transforms (as :func:`check_tuple`)."""
    b, m = shape
    if isinstance(result, MinedTriplets):
        fields = (result.anchors, result.positives, result.negatives, result.valid)
        if any(t.ndim != 1 or t.shape != fields[0].shape for t in fields):
            raise ValueError(
                "indices_tuple (MinedTriplets) needs four 1-D fields of one length, got shapes "
                f"{[tuple(t.shape) for t in fields]}"
            )
        for name, t in zip(_TRIPLET_FIELDS, fields, strict=False):
            if t.dtype not in (torch.int32, torch.int64):
                raise TypeError(
                    f"indices_tuple.{name} must be an int32 or int64 index tensor, got {t.dtype}"
                )
        # packaged rows 0 .. 3T - 1 are in range when there are as many rows (shapes alone);
        # else one reduction, and each field on its own (the first offender) where it fails
        packaged = isinstance(result, PackagedTriplets) and 3 * fields[0].shape[0] <= min(b, m)
        if not (packaged or _all_below(fields[:3], min(b, m))):
            for name, t, size in zip(_TRIPLET_FIELDS, fields, (b, m, m), strict=False):
                _checks.in_range(t, 0, size, f"indices_tuple.{name}", f"for {size} rows")
        return result
    expected: dict[str, tuple[int, ...]]
    if isinstance(result, TripletMask):
        expected = {"mask": (b, m, m)}
    elif isinstance(result, TripletWindow):
        expected = {"e": (b, m), "pos": (b, m), "neg": (b, m)}
    elif isinstance(result, MinedPairs):
        expected = {"pos": (b, m), "neg": (b, m)}
    else:
        raise TypeError(f"not a pmlfunc miner result: {type(result).__name__}")
    for name, want in expected.items():
        got = tuple(getattr(result, name).shape)
        if got != want:
            raise ValueError(
                f"indices_tuple.{name} ({type(result).__name__}) must have shape {want} for "
                f"{b} query rows and {m} reference rows, got {got}"
            )
    return result


def as_triplets(indices_tuple) -> MinedTriplets | None:
    """A list of triplets as :class:`MinedTriplets`: a PML triplet tuple ``(a, p, n)`` (every
    slot valid) or a ``MinedTriplets`` itself; ``None`` for anything else (pairs, windows,
    masks, no tuple)."""
    if isinstance(indices_tuple, MinedTriplets):
        return indices_tuple
    if indices_tuple is None or is_mined(indices_tuple):
        return None
    t = check_tuple(indices_tuple)
    if len(t) != 3:
        return None
    a, p, n = (x.long() for x in t)
    return MinedTriplets(a, p, n, torch.ones(a.shape, device=a.device))


def sample_weights(
    indices_tuple, batch_size: int, dtype: torch.dtype, device, *, anchors_only: bool = False
) -> Tensor | None:
    """PML's ``lmu.convert_to_weights`` without ``unique``: each sample's count in the tuple over
    the largest count (0 for samples not listed). ``None`` means all ones (no tuple, or a tuple of
    empty index tensors: a static decision on shapes; a fixed-shape miner result that selected
    nothing gives all ones too, by a ``where``). ``anchors_only`` counts only the anchors
    (PML's ``using_ref=True``). Counted with ``index_add``: no host sync."""
    if indices_tuple is None:
        return None
    if is_mined(indices_tuple):
        if isinstance(indices_tuple, MinedTriplets) and anchors_only:  # a reference set's
            a = indices_tuple.anchors  # indices (positives, negatives) are not counted here
            _checks.in_range(a, 0, batch_size, "indices_tuple.anchors", f"for {batch_size} rows")
        elif isinstance(indices_tuple, MinedTriplets):
            check_mined(indices_tuple, (batch_size, batch_size))
        counts = indices_tuple.sample_counts(batch_size, dtype, anchors_only).to(device)
        top = counts.amax()
        return torch.where(top > 0, counts / top.clamp_min(1.0), 1.0)
    t = check_tuple(indices_tuple)
    if all(x.shape[0] == 0 for x in t):
        return None
    positions: tuple[int, ...] = tuple(range(len(t)))
    if anchors_only:  # the other indices refer to a reference set: not counted here
        positions = (0,) if len(t) == 3 else (0, 2)
    roles = _ROLES[len(t)]
    t = tuple(
        _checks.index(t[i], batch_size, f"indices_tuple[{i}] ({roles[i]})") for i in positions
    )
    idx = torch.cat([x.reshape(-1).to(device=device, dtype=torch.long) for x in t])
    counts = torch.zeros(batch_size, dtype=dtype, device=device)
    counts = counts.index_add(0, idx, torch.ones(idx.shape, dtype=dtype, device=device))
    return counts / counts.amax().clamp_min(1.0)


def _cube_indices(select, shape) -> tuple[Tensor, Tensor, Tensor]:
    b, m = shape
    chunk = cube_chunk(m)
    parts = []
    for start in range(0, b, chunk):
        a, p, n = torch.where(select(start, min(b, start + chunk)))
        parts.append((a + start, p, n))
    a, p, n = (torch.cat([x[i] for x in parts]) for i in range(3))
    return a, p, n


class WindowSearch(NamedTuple):
    """Sorted-position ranges of each positive's negatives: see :meth:`TripletWindow.search`."""

    order: Tensor  # (B, M) column order sorting each row's negatives first, by e
    first: Tensor  # (B, M) first sorted position inside the window
    stop: Tensor  # (B, M) one past the last (narrowed by the margin when given)
    # (B, M) int64 (stop − first) on positives, 0 elsewhere (the ignore: it shadows tuple.count)
    count: Tensor  # type: ignore[assignment]
    window_count: Tensor  # (B, M) the same without the margin


def _bitcast_batches() -> bool:
    """Whether ``vmap`` batches ``Tensor.view(dtype)`` (PyTorch >= 2.13 does; 2.11 does not)."""
    try:
        torch.vmap(lambda v: v.view(torch.int32))(torch.zeros(1, 1))
    except RuntimeError:
        return False
    return True


BITCAST_BATCHES = _bitcast_batches()


def bitcast_ok() -> bool:
    """Whether :func:`ordered_bits` can run here: always, but inside ``torch.func`` transforms on
    a PyTorch whose ``vmap`` cannot batch a dtype view (callers then sort the floats)."""
    return BITCAST_BATCHES or not _ops.inside_transform()


def ordered_keys(x: Tensor) -> Tensor:
    """Sort keys ordered exactly like the floats ``x``: :func:`ordered_bits` where it can run,
    else the floats themselves (``−0.0`` made ``0.0``). No gradient."""
    return ordered_bits(x) if bitcast_ok() else x.detach() + 0.0


def ordered_bits(x: Tensor) -> Tensor:
    """Integers ordered exactly like the floats ``x`` (a strictly monotone bijection, the IEEE
    bit trick; ``−0.0`` and ``0.0`` map to the same integer), in a fresh buffer that the caller
    may change in place: sorting and binary search on them give the float comparisons, faster
    (CPU sorts integers ~1.6x faster than floats). No gradient."""
    x = x.detach()
    if x.dtype == torch.float64:
        bits, mask = (x + 0.0).view(torch.int64), 0x7FFFFFFFFFFFFFFF  # + 0.0: no -0.0
    else:
        bits, mask = (x.float() + 0.0).view(torch.int32), 0x7FFFFFFF
    flip = (bits >> (bits.element_size() * 8 - 1)).bitwise_and_(mask)
    return bits.bitwise_xor_(flip)


def _is_inf(bound: float | Tensor, sign: float) -> bool:
    return isinstance(bound, float) and bound == sign * math.inf


def _window_search(e, pos, neg, low, high, margin=None) -> WindowSearch:
    is_neg = neg > 0
    is_pos = pos > 0
    keys = ordered_keys(torch.where(is_neg, e, torch.inf))
    order = _ops.argsort_rows(keys)
    sorted_keys = keys.gather(-1, order)
    n_neg = _ops.count_true(is_neg, -1, keepdim=True).long()

    def count_below(bound, right: bool) -> Tensor:  # per column: # negatives (≤ or <) e + bound
        return torch.searchsorted(sorted_keys, ordered_keys(e + bound), right=right)

    # an infinite bound needs no search: nothing is below −inf, every negative is below +inf
    first = torch.zeros_like(order) if _is_inf(low, -1.0) else count_below(low, True)
    stop_w = n_neg.expand_as(order) if _is_inf(high, 1.0) else count_below(high, True)
    stop_w = torch.minimum(stop_w, n_neg)
    count_w = (stop_w - first).clamp_min(0) * is_pos
    if margin is None:
        return WindowSearch(order, first, stop_w, count_w, count_w)
    stop = torch.minimum(stop_w, count_below(margin, False))
    return WindowSearch(order, first, stop, (stop - first).clamp_min(0) * is_pos, count_w)


def window_cover(found: WindowSearch) -> Tensor:
    """Per negative (column order), how many positives' ranges ``[first, stop)`` hold it: a
    difference array over sorted positions, a prefix sum, and the sort undone."""
    m = found.count.shape[-1]
    w = (found.count > 0).to(torch.int64)
    diff = torch.zeros((*found.count.shape[:-1], m + 1), dtype=torch.int64, device=w.device)
    diff = diff.scatter_add(-1, found.first, w).scatter_add(-1, found.stop, -w)
    cover_sorted = diff.cumsum(-1)[..., :m]
    return torch.zeros_like(cover_sorted).scatter(-1, found.order, cover_sorted)


def sample_without_replacement(
    total: Tensor, k: int, seed: Tensor, stream: int
) -> tuple[Tensor, Tensor]:
    """Per row, ``min(k, total)`` distinct integers drawn uniformly from ``[0, total)``.

    Floyd's algorithm, vectorised over rows: ``k`` steps of ``O(k)`` each, whatever ``total``
    is (it may be far larger than memory could enumerate). Returns ``(idx, valid)``, both
    ``total.shape + (k,)``; invalid slots (``total < k``) hold 0.
    """
    from ._random import random_bits

    total = total.to(torch.int64)
    bits = random_bits(seed, stream, (k, *tuple(total.shape)), total.device)
    chosen: list[Tensor] = []
    for i in range(k):
        j = total - k + i  # Floyd: draw from [0, j], take j itself on a repeat
        r = bits[i] % (j + 1).clamp_min(1)
        if chosen:
            dup = (torch.stack(chosen, -1) == r.unsqueeze(-1)).any(-1)
            r = torch.where(dup, j, r)
        chosen.append(torch.where(total > k, r, torch.full_like(r, i)))
    idx = torch.stack(chosen, -1)
    arange = torch.arange(k, device=total.device)
    valid = arange < total.unsqueeze(-1)
    return torch.where(valid, idx, 0), valid


def random_subset(mask: Tensor, k: int, seed: Tensor, stream: int) -> tuple[Tensor, Tensor]:
    """Per row, ``min(k, #selected)`` of the columns where ``mask`` is true, a uniform random
    subset without replacement (random keys and a top-k). Returns ``(idx, valid)`` of shape
    ``(rows, k)`` whatever the number of columns (short rows are padded with invalid slots)."""
    from ._random import uniform

    rows, cols = mask.shape
    u = uniform(seed, stream, (rows, cols), torch.float32, mask.device)
    keys = torch.where(mask, u + 1.0, 0.0)  # in [1, 2): selected cells always rank first
    top, idx = keys.topk(min(k, cols), -1)
    valid = top > 0
    if k > cols:  # static length k
        pad = k - cols
        idx = torch.cat([idx, idx.new_zeros(rows, pad)], -1)
        valid = torch.cat([valid, valid.new_zeros(rows, pad)], -1)
    return torch.where(valid, idx, 0), valid


def sample_pairs(weights: Tensor, k: int, seed: Tensor, stream: int) -> Tensor:
    """At most ``k`` of each row's cells with ``weights > 0``, a uniform random subset without
    replacement; returns the 0/1 ``(B, M)`` mask of the kept cells."""
    idx, valid = random_subset(weights > 0, k, seed, stream)
    out = torch.zeros(weights.shape, dtype=weights.dtype, device=weights.device)
    return out.scatter_add(-1, idx, valid.to(weights.dtype))
