r"""PML's samplers as pure index functions, and thin ``torch.utils.data.Sampler`` wrappers.

Each function is a pure function of (labels, sizes, an explicit ``torch.Generator``) and returns
index tensors: one epoch (or one fixed set) of dataset indices, int64 on the CPU. The same
generator state gives the same indices; drawing advances the generator, so the next call gives
the next epoch. They are host-side data-loading utilities: unlike the losses they read label
values (``unique``, data-dependent shapes) and are not meant to be compiled, but they are
vectorised (no Python loop over the samples of the dataset).

| function | PML 2.9.0 | returns |
|---|---|---|
| :func:`m_per_class` | ``MPerClassSampler`` | ``(len,)`` index stream; with ``batch_size`` it is ``len / batch_size`` whole batches |
| :func:`hierarchical` | ``HierarchicalSampler`` | a list of 1-D index tensors, one per batch |
| :func:`fixed_set_of_triplets` | ``FixedSetOfTriplets`` | ``(num_triplets, 3)`` anchor / positive / negative indices |
| :func:`fixed_set_of_pairs` | (PML 3's ``FixedSetOfPairs``) | ``(P, 2)`` positive and ``(Q, 2)`` negative pairs |
| :func:`tuples_to_weights`, :func:`weighted` | ``TuplesToWeightsSampler`` | ``(dataset_size,)`` weights; ``(num_samples,)`` draws |

The wrappers (:class:`MPerClassSampler`, :class:`HierarchicalSampler`, :class:`FixedSetOfTriplets`,
:class:`FixedSetOfPairs`, :class:`TuplesToWeightsSampler`) draw a fresh epoch from their generator
at every ``iter()`` and have PML's ``len()``. ``generator=None`` makes a generator seeded once from
torch's global generator (so ``torch.manual_seed`` makes them reproducible, as it does
``torch.utils.data.RandomSampler``).

Statistics follow PML's samplers (tests/test_samplers.py checks them side by side with PML over
many seeds); the random numbers themselves are torch's, not NumPy's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils.data import Sampler

from . import _checks
from . import tuples as _tuples

__all__ = [
    "FixedSetOfPairs",
    "FixedSetOfTriplets",
    "HierarchicalSampler",
    "LabelsLike",
    "MPerClassSampler",
    "TuplesToWeightsSampler",
    "fixed_set_of_pairs",
    "fixed_set_of_triplets",
    "hierarchical",
    "hierarchical_length",
    "m_per_class",
    "m_per_class_length",
    "tuples_to_weights",
    "weighted",
]

LabelsLike = Tensor | Sequence[int] | Sequence[Sequence[int]]
"""Labels: an integer tensor (any device), a list, or a NumPy array (also accepted at run time)."""

_BLOCK = 1 << 22  # elements of one random-key block (rows × population) in _random_subsets


# ----------------------------------------------------------------------------- validation


def _generator(generator: object, name: str = "generator") -> torch.Generator:
    if generator is None:
        raise ValueError(
            f"{name} is required: pass a torch.Generator (e.g. torch.Generator().manual_seed(0))"
        )
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"{name} must be a torch.Generator, got {type(generator).__name__}")
    if generator.device.type != "cpu":
        raise ValueError(
            f"{name} must be a CPU torch.Generator (samplers draw host-side indices), "
            f"got one on {generator.device}"
        )
    return generator


def _default_generator(generator: object) -> torch.Generator:
    """A wrapper's generator: the given one, or one seeded from torch's global generator."""
    if generator is None:
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        return torch.Generator().manual_seed(seed)
    return _generator(generator)


def _integer_tensor(labels: object, name: str, ndim: int, shape: str) -> Tensor:
    """``labels`` as a CPU int64 tensor of ``ndim`` dimensions with at least one element; a list
    or NumPy array (PML accepts both, and ``dataset.targets`` is often a list) is converted."""
    if not isinstance(labels, Tensor):
        if not isinstance(labels, (list, tuple)) and not hasattr(labels, "__array__"):
            raise TypeError(
                f"{name} must be a torch.Tensor (or a list / NumPy array) of integer class ids, "
                f"got {type(labels).__name__}"
            )
        try:
            labels = torch.as_tensor(labels)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(
                f"{name} could not be made a tensor of integer class ids: {e}"
            ) from None
    if labels.dtype.is_floating_point or labels.dtype.is_complex:
        raise TypeError(f"{name} must have an integer (or bool) dtype, got {labels.dtype}")
    if labels.ndim != ndim:
        raise ValueError(
            f"{name} must be {ndim}-D of shape {shape}, got shape {tuple(labels.shape)}"
        )
    if labels.numel() == 0:
        raise ValueError(
            f"{name} is empty (shape {tuple(labels.shape)}); at least one sample is required"
        )
    return labels.detach().to("cpu", torch.int64)


def _labels_1d(labels: object, name: str = "labels") -> Tensor:
    return _integer_tensor(labels, name, 1, "(dataset_size,)")


class _Groups(NamedTuple):
    """The dataset's samples grouped by class: ``order[starts[c] : starts[c] + counts[c]]`` are
    the indices of class ``c`` (classes in sorted label order), in dataset order."""

    order: Tensor
    starts: Tensor
    counts: Tensor


def _groups(class_ids: Tensor, num_classes: int) -> _Groups:
    order = torch.argsort(class_ids, stable=True)
    counts = torch.bincount(class_ids, minlength=num_classes)
    return _Groups(order, torch.cumsum(counts, 0) - counts, counts)


def _class_groups(labels: Tensor) -> _Groups:
    _, inverse = torch.unique(labels, return_inverse=True)
    return _groups(inverse, int(inverse.max()) + 1)


# ----------------------------------------------------------------------------- random helpers


def _uniform_below(high: Tensor, u: Tensor) -> Tensor:
    """``floor(u · high)`` clamped into ``[0, high)``: a uniform integer below ``high`` from a
    uniform float64 ``u`` in ``[0, 1)`` (bias below 2⁻⁵⁰ for any realistic ``high``)."""
    return (u * high).floor().long().clamp(min=0).minimum((high - 1).clamp(min=0))


def _choose(n: Tensor, k: int, g: torch.Generator) -> Tensor:
    """``(len(n), k)`` positions, row ``r`` a sample of ``k`` from ``range(n[r])`` in random order:
    without replacement where ``n[r] >= k``, with replacement where ``n[r] < k`` (PML's
    ``safe_random_choice``). Floyd's algorithm, vectorised over rows: ``k`` steps of row-wise ops."""
    rows = n.shape[0]
    nc = n[:, None]
    u = torch.rand(rows, k, generator=g, dtype=torch.float64)
    with_replacement = _uniform_below(nc, u)
    chosen = torch.empty(rows, k, dtype=torch.long)
    for step in range(k):  # Floyd: j runs over n-k .. n-1; draw t in [0, j]; take j if t is taken
        j = n - k + step
        t = _uniform_below(j + 1, u[:, step])
        taken = (chosen[:, :step] == t[:, None]).any(1)
        chosen[:, step] = torch.where(taken, j, t)
    out = torch.where(nc >= k, chosen, with_replacement)
    if k > 1:  # Floyd's order is not uniform: shuffle each row
        out = out.gather(1, torch.rand(rows, k, generator=g).argsort(1))
    return out


def _random_subsets(rows: int, n: int, k: int, g: torch.Generator) -> Tensor:
    """``(rows, k)``: each row ``k`` distinct values of ``range(n)`` in random order (``k <= n``)."""
    if k * k <= n:  # few out of many: Floyd, O(k²) per row
        return _choose(torch.full((rows,), n, dtype=torch.long), k, g)
    step = max(1, _BLOCK // max(n, 1))
    parts = [
        torch.rand(min(step, rows - r), n, generator=g).argsort(1)[:, :k]
        for r in range(0, rows, step)
    ]
    return torch.cat(parts) if parts else torch.empty(0, k, dtype=torch.long)


def _draw(groups: _Groups, classes: Tensor, m: int, g: torch.Generator) -> Tensor:
    """``classes.shape + (m,)`` dataset indices: ``m`` samples of each listed class (with
    replacement only for classes smaller than ``m``)."""
    flat = classes.reshape(-1)
    pos = _choose(groups.counts[flat], m, g)
    return groups.order[groups.starts[flat, None] + pos].reshape(*classes.shape, m)


# ----------------------------------------------------------------------------- m per class


def _m_per_class_plan(
    labels: object, m: object, batch_size: object, length_before_new_iter: object
):
    y = _labels_1d(labels)
    m = _checks.integer(m, "m", minimum=1)
    if batch_size is not None:
        batch_size = _checks.integer(batch_size, "batch_size", minimum=1)
    length = _checks.integer(length_before_new_iter, "length_before_new_iter", minimum=1)
    groups = _class_groups(y)
    num_classes = groups.counts.shape[0]
    single_pass = m * num_classes
    if batch_size is None:  # whole passes over the classes
        if single_pass < length:
            length -= length % single_pass
        per_iter = num_classes
        num_iters = length // single_pass if single_pass < length else 1
        return groups, m, per_iter, num_iters, length
    if batch_size % m != 0:
        raise ValueError(
            f"batch_size must be a multiple of m (m samples of each of batch_size / m classes), "
            f"got batch_size={batch_size} and m={m}"
        )
    if single_pass < batch_size:
        raise ValueError(
            f"m * (number of classes) must be >= batch_size: a batch holds batch_size / m = "
            f"{batch_size // m} distinct classes but labels have {num_classes} "
            f"(m={m}, batch_size={batch_size})"
        )
    if length < batch_size:
        raise ValueError(
            f"length_before_new_iter must be >= batch_size, got length_before_new_iter={length} "
            f"and batch_size={batch_size}"
        )
    length -= length % batch_size
    return groups, m, batch_size // m, length // batch_size, length


def m_per_class_length(
    labels: LabelsLike,
    m: int,
    batch_size: int | None = None,
    *,
    length_before_new_iter: int = 100_000,
) -> int:
    """The number of indices :func:`m_per_class` returns: ``len()`` of PML's ``MPerClassSampler``.

    With ``batch_size``: ``length_before_new_iter`` rounded down to a multiple of ``batch_size``.
    Without: rounded down to a multiple of ``m · num_classes`` when that is smaller, else unchanged.
    Raises the same errors as :func:`m_per_class`.

    Example:
        >>> labels = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> pf.samplers.m_per_class_length(labels, 2, 4, length_before_new_iter=10)
        8
    """
    return _m_per_class_plan(labels, m, batch_size, length_before_new_iter)[-1]


def m_per_class(
    labels: LabelsLike,
    m: int,
    batch_size: int | None = None,
    *,
    generator: torch.Generator,
    length_before_new_iter: int = 100_000,
) -> Tensor:
    """One epoch of PML's ``MPerClassSampler``: a flat index stream of ``m`` samples per class.

    With ``batch_size``: the stream is ``len / batch_size`` batches back to back
    (``.view(-1, batch_size)`` gives them); each batch holds ``m`` samples of each of
    ``batch_size / m`` distinct classes drawn uniformly without replacement, and the stream's
    length is ``length_before_new_iter`` rounded down to a multiple of ``batch_size``. Without
    ``batch_size`` (PML's default): whole passes, each pass every class once in random order with
    ``m`` samples; the length is rounded down to a multiple of ``m · num_classes`` when that is
    smaller (batches cut from it do not keep the m-per-class structure). The ``m`` samples of a
    class are distinct when the class has at least ``m`` samples, else drawn with replacement
    (PML's ``safe_random_choice``).

    Args:
        labels: ``(dataset_size,)`` integer class ids (any values): a tensor on any device, a
            list or a NumPy array.
        m: samples per class in a batch.
        batch_size: the DataLoader's batch size, a multiple of ``m``; ``None`` as in PML.
        generator: a CPU ``torch.Generator``; drawing advances it.
        length_before_new_iter: PML's epoch length before rounding (default 100,000).

    Returns:
        ``(m_per_class_length(...),)`` int64 dataset indices on the CPU.

    Raises:
        ValueError: empty or non-1-D labels, ``batch_size`` not a multiple of ``m``, fewer than
            ``batch_size / m`` classes, ``length_before_new_iter < batch_size``, or
            a size below 1.
        TypeError: labels not an integer tensor, a size not an int, or ``generator`` not a
            ``torch.Generator``.

    Deviation from PML: with ``batch_size=None`` and ``m · num_classes > length_before_new_iter``
    PML's iterator yields a whole pass (``m · num_classes`` indices) although its ``len()`` says
    ``length_before_new_iter``; here the stream is always exactly ``len()`` long (the first
    ``length_before_new_iter`` indices of that pass).

    Example:
        >>> labels = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 3])
        >>> g = torch.Generator().manual_seed(0)
        >>> idx = pf.samplers.m_per_class(labels, 2, 4, generator=g, length_before_new_iter=10)
        >>> idx.shape
        torch.Size([8])
        >>> counts = [labels[b].bincount(minlength=4) for b in idx.view(-1, 4)]
        >>> all(sorted(c.tolist()) == [0, 0, 2, 2] for c in counts)  # 2 classes, 2 samples each
        True
    """
    g = _generator(generator)
    return _m_per_class_epoch(_m_per_class_plan(labels, m, batch_size, length_before_new_iter), g)


def _m_per_class_epoch(plan: tuple, g: torch.Generator) -> Tensor:
    groups, m, per_iter, num_iters, length = plan
    classes = _random_subsets(num_iters, groups.counts.shape[0], per_iter, g)
    return _draw(groups, classes, m, g).reshape(-1)[:length]


class MPerClassSampler(Sampler[int]):
    """PML's ``MPerClassSampler`` over :func:`m_per_class`: a fresh epoch at every ``iter()``.

    Use it as ``DataLoader(dataset, batch_size=batch_size, sampler=sampler)`` (the stream is a
    whole number of batches, so every batch keeps the m-per-class structure), or as
    ``batch_sampler=torch.utils.data.BatchSampler(sampler, batch_size, drop_last=True)``.
    ``len()`` is PML's. ``generator=None``: a generator seeded once from torch's global one.

    Example:
        >>> labels = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
        >>> s = pf.samplers.MPerClassSampler(labels, 2, batch_size=4, length_before_new_iter=8,
        ...                                  generator=torch.Generator().manual_seed(0))
        >>> len(s), len(list(s))
        (8, 8)
    """

    def __init__(
        self,
        labels: LabelsLike,
        m: int,
        batch_size: int | None = None,
        length_before_new_iter: int = 100_000,
        *,
        generator: torch.Generator | None = None,
    ) -> None:
        self.labels = _labels_1d(labels)
        self.m, self.batch_size, self.length_before_new_iter = m, batch_size, length_before_new_iter
        self._plan = _m_per_class_plan(self.labels, m, batch_size, length_before_new_iter)
        self.generator = _default_generator(generator)

    def __len__(self) -> int:
        return self._plan[-1]

    def __iter__(self) -> Iterator[int]:  # the grouping by class is computed once, in __init__
        return iter(_m_per_class_epoch(self._plan, self.generator).tolist())


# ----------------------------------------------------------------------------- hierarchical


class _Hierarchy(NamedTuple):
    groups: _Groups  # samples by (super label, inner label) class
    class_start: Tensor  # (S,) first class of each super label (classes sorted by super label)
    num_classes: Tensor  # (S,) classes per super label
    combos: Tensor  # (T, super_classes_per_batch) super-label tuples, PML's combinations order
    sub_batch_len: int
    samples_per_class: int | None  # None: "all"
    batches_per_super_tuple: int


def _hierarchy(
    labels,
    batch_size,
    samples_per_class,
    batches_per_super_tuple,
    super_classes_per_batch,
    inner_label,
    outer_label,
) -> _Hierarchy:
    y = _integer_tensor(
        labels, "labels", 2, "(dataset_size, num_levels) (one column per hierarchy level)"
    )
    batch_size = _checks.integer(batch_size, "batch_size", minimum=1)
    k = _checks.integer(super_classes_per_batch, "super_classes_per_batch", minimum=1)
    bpst = _checks.integer(batches_per_super_tuple, "batches_per_super_tuple", minimum=1)
    cols = y.shape[1]
    for name, col in (("inner_label", inner_label), ("outer_label", outer_label)):
        _checks.integer(col, name, minimum=-(1 << 62))
        if not -cols <= col < cols:
            raise IndexError(f"{name}={col} is not a column of labels (shape {tuple(y.shape)})")
    if batch_size % k != 0:
        raise ValueError(
            f"batch_size must be a multiple of super_classes_per_batch, got batch_size={batch_size} "
            f"and super_classes_per_batch={k}"
        )
    sub_batch_len = batch_size // k
    spc: int | None
    if isinstance(samples_per_class, str):
        if samples_per_class != "all":
            raise ValueError(
                f'samples_per_class must be an int or "all", got {samples_per_class!r}'
            )
        spc = None
    else:
        spc = _checks.integer(samples_per_class, "samples_per_class", minimum=1)
        if sub_batch_len % spc != 0:
            raise ValueError(
                f"batch_size / super_classes_per_batch = {sub_batch_len} must be a multiple of "
                f"samples_per_class={spc}"
            )
    supers, s_inv = torch.unique(y[:, outer_label], return_inverse=True)
    if supers.shape[0] < k:
        raise ValueError(
            f"labels have {supers.shape[0]} distinct super labels (column outer_label={outer_label}) "
            f"but a batch takes super_classes_per_batch={k}"
        )
    pairs, c_inv = torch.unique(
        torch.stack([s_inv, y[:, inner_label]], 1), dim=0, return_inverse=True
    )
    groups = _groups(c_inv, pairs.shape[0])
    num_classes = torch.bincount(pairs[:, 0], minlength=supers.shape[0])
    combos = torch.combinations(torch.arange(supers.shape[0]), r=k)
    if k == 1:
        combos = combos.reshape(-1, 1)
    return _Hierarchy(
        groups,
        torch.cumsum(num_classes, 0) - num_classes,
        num_classes,
        combos,
        sub_batch_len,
        spc,
        bpst,
    )


def hierarchical_length(
    labels: LabelsLike,
    batch_size: int,
    samples_per_class: int | str,
    *,
    batches_per_super_tuple: int = 4,
    super_classes_per_batch: int = 2,
    inner_label: int = 0,
    outer_label: int = 1,
) -> int:
    """The number of batches :func:`hierarchical` returns (``len()`` of PML's
    ``HierarchicalSampler``): ``C(S, super_classes_per_batch) · batches_per_super_tuple`` for ``S``
    distinct super labels.

    Example:
        >>> labels = torch.tensor([[0, 0], [1, 0], [2, 1], [3, 1], [4, 2], [5, 2]])
        >>> pf.samplers.hierarchical_length(labels, 4, 1, batches_per_super_tuple=2)
        6
    """
    h = _hierarchy(
        labels, batch_size, samples_per_class, batches_per_super_tuple, super_classes_per_batch,
        inner_label, outer_label,
    )  # fmt: skip
    return h.combos.shape[0] * h.batches_per_super_tuple


def hierarchical(
    labels: LabelsLike,
    batch_size: int,
    samples_per_class: int | str,
    *,
    generator: torch.Generator,
    batches_per_super_tuple: int = 4,
    super_classes_per_batch: int = 2,
    inner_label: int = 0,
    outer_label: int = 1,
) -> list[Tensor]:
    """One epoch of PML's ``HierarchicalSampler``: batches built from tuples of super labels.

    ``labels[:, outer_label]`` is a sample's super label and ``labels[:, inner_label]`` its class
    within it (a class is a (super label, inner label) pair). For every combination of
    ``super_classes_per_batch`` distinct super labels (``itertools.combinations`` of the sorted
    super labels) there are ``batches_per_super_tuple`` batches; a batch is one sub-batch of up to
    ``batch_size / super_classes_per_batch`` samples per super label of the tuple: its classes in
    random order, each taken with ``samples_per_class`` samples (with replacement only when the
    class is smaller) while they fit, or with all their samples for ``"all"`` (a class that does not
    fit in what is left is skipped, as PML does). Each batch is shuffled, then the batches are.

    With an int ``samples_per_class`` a super label with ``c`` classes fills
    ``min(c, sub_batch / samples_per_class) · samples_per_class`` places, so every batch has
    exactly ``batch_size`` samples when every super label has enough classes (then
    ``torch.stack`` gives a ``(num_batches, batch_size)`` tensor); otherwise, and with ``"all"``,
    batches can be shorter.

    Args:
        labels: ``(dataset_size, num_levels)`` integer labels, one column per hierarchy level.
        batch_size: samples per batch, a multiple of ``super_classes_per_batch``.
        samples_per_class: an int dividing ``batch_size / super_classes_per_batch``, or ``"all"``.
        generator: a CPU ``torch.Generator``; drawing advances it.
        batches_per_super_tuple: batches per combination of super labels (PML's default 4).
        super_classes_per_batch: super labels per batch (default 2).
        inner_label, outer_label: the columns of the class and of the super label.

    Returns:
        ``hierarchical_length(...)`` 1-D int64 index tensors on the CPU, one per batch.

    Raises:
        ValueError: labels not 2-D or empty, ``batch_size`` not a multiple of
            ``super_classes_per_batch``, the sub-batch not a multiple of ``samples_per_class``,
            fewer super labels than ``super_classes_per_batch``, or a size below 1.
        IndexError: ``inner_label``/``outer_label`` not a column of labels.
        TypeError: as :func:`m_per_class`.

    Example:
        >>> labels = torch.tensor([[c, c // 2] for c in range(6) for _ in range(3)])  # 6 classes, 3 supers
        >>> g = torch.Generator().manual_seed(0)
        >>> batches = pf.samplers.hierarchical(labels, 4, 2, generator=g, batches_per_super_tuple=2)
        >>> len(batches), [len(b) for b in batches]
        (6, [4, 4, 4, 4, 4, 4])
        >>> sorted(labels[batches[0], 1].bincount().tolist(), reverse=True)[:2]  # two super labels
        [2, 2]
    """
    g = _generator(generator)
    h = _hierarchy(
        labels, batch_size, samples_per_class, batches_per_super_tuple, super_classes_per_batch,
        inner_label, outer_label,
    )  # fmt: skip
    return _hierarchical_epoch(h, g)


def _hierarchical_epoch(h: _Hierarchy, g: torch.Generator) -> list[Tensor]:
    bpst, k = h.batches_per_super_tuple, h.combos.shape[1]
    num_batches = h.combos.shape[0] * bpst
    slot_super = h.combos.repeat_interleave(bpst, 0).reshape(-1)  # (num_batches·k,) sub-batch slots
    values, owners = [], []
    for s in range(h.num_classes.shape[0]):  # a loop over super labels; each draws all its slots
        slots = (slot_super == s).nonzero().reshape(-1)
        if slots.numel() == 0:
            continue
        n, c0 = int(h.num_classes[s]), int(h.class_start[s])
        if h.samples_per_class is not None:
            per_sub = min(n, h.sub_batch_len // h.samples_per_class)
            classes = _random_subsets(slots.numel(), n, per_sub, g) + c0
            idx = _draw(h.groups, classes, h.samples_per_class, g).reshape(slots.numel(), -1)
            values.append(idx.reshape(-1))
            owners.append(slots.repeat_interleave(idx.shape[1]))
            continue
        # "all": shuffled classes, each taken whole while it fits (a greedy pass over the order)
        perm = torch.rand(slots.numel(), n, generator=g).argsort(1)
        sizes = h.groups.counts[c0 + perm]
        used = torch.zeros(slots.numel(), dtype=torch.long)
        take = torch.zeros(slots.numel(), n, dtype=torch.bool)
        for j in range(n):
            take[:, j] = used + sizes[:, j] <= h.sub_batch_len
            used = used + torch.where(take[:, j], sizes[:, j], 0)
            if bool((used == h.sub_batch_len).all()):  # every sub-batch is full
                break
        chosen = torch.zeros_like(take).scatter_(1, perm, take)  # (slots, class of s)
        start, stop = (
            int(h.groups.starts[c0]),
            int(h.groups.starts[c0] + h.groups.counts[c0 : c0 + n].sum()),
        )
        members = h.groups.order[start:stop]
        member_class = torch.arange(n).repeat_interleave(h.groups.counts[c0 : c0 + n])
        row, col = chosen[:, member_class].nonzero(as_tuple=True)
        values.append(members[col])
        owners.append(slots[row])
    idx, owner = torch.cat(values), torch.cat(owners) // k
    # shuffle inside each batch (a random order, then a stable sort by batch), then the batches
    shuffled = torch.randperm(owner.numel(), generator=g)
    idx = idx[shuffled[owner[shuffled].argsort(stable=True)]]
    batches = torch.split(idx, torch.bincount(owner, minlength=num_batches).tolist())
    return [batches[i] for i in torch.randperm(num_batches, generator=g).tolist()]


class HierarchicalSampler(Sampler[list[int]]):
    """PML's ``HierarchicalSampler`` over :func:`hierarchical`, a batch sampler: use it as
    ``DataLoader(dataset, batch_sampler=sampler)``. Each ``iter()`` draws a fresh epoch of
    batches (lists of indices); ``len()`` is the number of batches, PML's.

    Example:
        >>> labels = torch.tensor([[c, c // 2] for c in range(6) for _ in range(3)])
        >>> s = pf.samplers.HierarchicalSampler(labels, 4, 2, generator=torch.Generator().manual_seed(0))
        >>> len(s), {len(b) for b in s}
        (12, {4})
    """

    def __init__(
        self,
        labels: LabelsLike,
        batch_size: int,
        samples_per_class: int | str,
        batches_per_super_tuple: int = 4,
        super_classes_per_batch: int = 2,
        inner_label: int = 0,
        outer_label: int = 1,
        *,
        generator: torch.Generator | None = None,
    ) -> None:
        self._plan = _hierarchy(
            labels, batch_size, samples_per_class, batches_per_super_tuple, super_classes_per_batch,
            inner_label, outer_label,
        )  # fmt: skip
        self.generator = _default_generator(generator)

    def __len__(self) -> int:
        return self._plan.combos.shape[0] * self._plan.batches_per_super_tuple

    def __iter__(self) -> Iterator[list[int]]:  # labels are grouped once, in __init__
        return iter([b.tolist() for b in _hierarchical_epoch(self._plan, self.generator)])


# ----------------------------------------------------------------------------- fixed sets


def _two_classes(num_classes: int, size: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """``size`` ordered pairs of distinct classes, uniform (PML: ``choice(labels, 2, replace=False)``)."""
    first = torch.randint(num_classes, (size,), generator=g)
    second = torch.randint(num_classes - 1, (size,), generator=g)
    return first, second + (second >= first).long()


def _one_of(groups: _Groups, classes: Tensor, g: torch.Generator) -> Tensor:
    u = torch.rand(classes.shape, generator=g, dtype=torch.float64)
    return groups.order[groups.starts[classes] + _uniform_below(groups.counts[classes], u)]


def fixed_set_of_triplets(
    labels: LabelsLike, num_triplets: int, *, generator: torch.Generator
) -> Tensor:
    """PML's ``FixedSetOfTriplets``: ``num_triplets`` (anchor, positive, negative) triplets drawn once.

    Each triplet draws two distinct classes uniformly (the anchor's and the negative's), then the
    anchor and positive as two samples of the anchor's class (distinct when it has two or more;
    a class of one sample gives ``anchor == positive``, as in PML) and the negative uniformly from
    the other class.

    Args:
        labels: ``(dataset_size,)`` integer class ids with at least two classes.
        num_triplets: rows of the set, at least 1.
        generator: a CPU ``torch.Generator``.

    Returns:
        ``(num_triplets, 3)`` int64 dataset indices; columns anchor, positive, negative.

    Example:
        >>> labels = torch.tensor([0, 0, 1, 1, 2])
        >>> t = pf.samplers.fixed_set_of_triplets(labels, 4, generator=torch.Generator().manual_seed(0))
        >>> t.shape, bool((labels[t[:, 0]] == labels[t[:, 1]]).all()), bool((labels[t[:, 0]] != labels[t[:, 2]]).all())
        (torch.Size([4, 3]), True, True)
    """
    g = _generator(generator)
    groups = _class_groups(_labels_1d(labels))
    num_triplets = _checks.integer(num_triplets, "num_triplets", minimum=1)
    if groups.counts.shape[0] < 2:
        raise ValueError(
            "labels must have at least 2 classes to form triplets (a negative needs another class)"
        )
    a_cls, n_cls = _two_classes(groups.counts.shape[0], num_triplets, g)
    ap = _draw(groups, a_cls, 2, g)
    return torch.cat([ap, _one_of(groups, n_cls, g)[:, None]], 1)


def fixed_set_of_pairs(
    labels: LabelsLike,
    num_pos_pairs: int,
    num_neg_pairs: int | None = None,
    *,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor]:
    """A fixed set of positive and negative pairs, drawn once (the pair analogue of
    :func:`fixed_set_of_triplets`, like PML 3's ``FixedSetOfPairs``).

    A positive pair draws a class uniformly among the classes with at least two samples, then two
    distinct samples of it; a negative pair draws two distinct classes uniformly, then one sample
    of each. The two lists together are a PML pair tuple: ``(pos[:, 0], pos[:, 1], neg[:, 0],
    neg[:, 1])`` is ``(a1, p, a2, n)`` over the dataset.

    Args:
        labels: ``(dataset_size,)`` integer class ids.
        num_pos_pairs: positive pairs (``>= 0``).
        num_neg_pairs: negative pairs (``>= 0``); ``None``: as many as positive pairs.
        generator: a CPU ``torch.Generator``.

    Returns:
        ``(pos_pairs, neg_pairs)``: ``(num_pos_pairs, 2)`` and ``(num_neg_pairs, 2)`` int64 indices.

    Raises:
        ValueError: no pairs asked for, positive pairs with no class of two samples, or negative
            pairs with a single class.

    Example:
        >>> labels = torch.tensor([0, 0, 1, 1, 2])
        >>> pos, neg = pf.samplers.fixed_set_of_pairs(labels, 3, 2, generator=torch.Generator().manual_seed(0))
        >>> pos.shape, neg.shape, bool((labels[pos[:, 0]] == labels[pos[:, 1]]).all())
        (torch.Size([3, 2]), torch.Size([2, 2]), True)
        >>> bool((pos[:, 0] != pos[:, 1]).all()), bool((labels[neg[:, 0]] != labels[neg[:, 1]]).all())
        (True, True)
    """
    g = _generator(generator)
    groups = _class_groups(_labels_1d(labels))
    num_pos = _checks.integer(num_pos_pairs, "num_pos_pairs", minimum=0)
    num_neg = (
        num_pos
        if num_neg_pairs is None
        else _checks.integer(num_neg_pairs, "num_neg_pairs", minimum=0)
    )
    if num_pos + num_neg == 0:
        raise ValueError("num_pos_pairs + num_neg_pairs must be >= 1")
    pairable = (groups.counts >= 2).nonzero().reshape(-1)
    if num_pos > 0 and pairable.numel() == 0:
        raise ValueError(
            "positive pairs need a class with at least 2 samples; every class of labels has one"
        )
    if num_neg > 0 and groups.counts.shape[0] < 2:
        raise ValueError("negative pairs need at least 2 classes; labels have one")
    pos = torch.empty(0, 2, dtype=torch.long)
    if num_pos > 0:
        pos_cls = pairable[torch.randint(pairable.numel(), (num_pos,), generator=g)]
        pos = _draw(groups, pos_cls, 2, g)
    neg = torch.empty(0, 2, dtype=torch.long)
    if num_neg > 0:
        a_cls, b_cls = _two_classes(groups.counts.shape[0], num_neg, g)
        neg = torch.stack([_one_of(groups, a_cls, g), _one_of(groups, b_cls, g)], 1)
    return pos, neg


class FixedSetOfTriplets(Sampler[int]):
    """PML's ``FixedSetOfTriplets``: the triplets of :func:`fixed_set_of_triplets` drawn once
    (``self.triplets``); each ``iter()`` yields them in a fresh random order, flattened (three
    consecutive indices per triplet: use a batch size that is a multiple of 3). ``len()`` is
    ``3 · num_triplets``.

    Example:
        >>> s = pf.samplers.FixedSetOfTriplets(torch.tensor([0, 0, 1, 1]), 5,
        ...                                    generator=torch.Generator().manual_seed(0))
        >>> len(s), sorted(list(s)) == sorted(s.triplets.reshape(-1).tolist())
        (15, True)
    """

    def __init__(
        self, labels: LabelsLike, num_triplets: int, *, generator: torch.Generator | None = None
    ) -> None:
        self.generator = _default_generator(generator)
        self.triplets = fixed_set_of_triplets(labels, num_triplets, generator=self.generator)

    def __len__(self) -> int:
        return self.triplets.numel()

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(self.triplets.shape[0], generator=self.generator)
        return iter(self.triplets[order].reshape(-1).tolist())


class FixedSetOfPairs(Sampler[int]):
    """The pairs of :func:`fixed_set_of_pairs` drawn once (``self.pos_pairs``, ``self.neg_pairs``);
    each ``iter()`` yields all pairs in a fresh random order (positive and negative mixed),
    flattened (two consecutive indices per pair: use an even batch size). ``len()`` is
    ``2 · (num_pos_pairs + num_neg_pairs)``.

    Example:
        >>> s = pf.samplers.FixedSetOfPairs(torch.tensor([0, 0, 1, 1]), 2, 3,
        ...                                 generator=torch.Generator().manual_seed(0))
        >>> len(s), len(list(s))
        (10, 10)
    """

    def __init__(
        self,
        labels: LabelsLike,
        num_pos_pairs: int,
        num_neg_pairs: int | None = None,
        *,
        generator: torch.Generator | None = None,
    ) -> None:
        self.generator = _default_generator(generator)
        self.pos_pairs, self.neg_pairs = fixed_set_of_pairs(
            labels, num_pos_pairs, num_neg_pairs, generator=self.generator
        )

    def __len__(self) -> int:
        return self.pos_pairs.numel() + self.neg_pairs.numel()

    def __iter__(self) -> Iterator[int]:
        pairs = torch.cat([self.pos_pairs, self.neg_pairs])
        order = torch.randperm(pairs.shape[0], generator=self.generator)
        return iter(pairs[order].reshape(-1).tolist())


# ----------------------------------------------------------------------------- tuples to weights


def tuples_to_weights(indices_tuple, dataset_size: int, *, indices: Tensor | None = None) -> Tensor:
    """Per-sample sampling weights from how often each sample appears in mined tuples: the pure part
    of PML's ``TuplesToWeightsSampler`` (its ``lmu.convert_to_weights`` scattered into the dataset).

    ``indices_tuple`` indexes a batch of ``len(indices)`` samples (``indices[i]`` is the dataset
    index of batch row ``i``; ``None``: the batch is the whole dataset in order). A sample's weight
    is its number of appearances over the largest count; dataset samples outside the batch get 0;
    a tuple with no entries gives every batch sample weight 1 (PML's rule).

    Args:
        indices_tuple: a PML index tuple ``(a, p, n)`` / ``(a1, p, a2, n)`` or a pmlfunc miner
            result (:mod:`pmlfunc.tuples`), over the batch.
        dataset_size: the number of samples in the dataset.
        indices: ``(batch,)`` dataset indices of the batch rows, or ``None``.

    Returns:
        ``(dataset_size,)`` float32 weights, for :func:`weighted` or
        ``torch.utils.data.WeightedRandomSampler``.

    Example:
        >>> a, p, n = torch.tensor([0, 0]), torch.tensor([1, 1]), torch.tensor([2, 3])
        >>> pf.samplers.tuples_to_weights((a, p, n), 5)
        tensor([1.0000, 1.0000, 0.5000, 0.5000, 0.0000])
        >>> pf.samplers.tuples_to_weights((a, p, n), 6, indices=torch.tensor([5, 4, 3, 2]))
        tensor([0.0000, 0.0000, 0.5000, 0.5000, 1.0000, 1.0000])
    """
    dataset_size = _checks.integer(dataset_size, "dataset_size", minimum=1)
    if indices is None:
        batch = dataset_size
        where = torch.arange(dataset_size)
    else:
        if (
            not isinstance(indices, Tensor)
            or indices.ndim != 1
            or indices.dtype not in (torch.int32, torch.int64)
        ):
            raise TypeError(
                "indices must be a 1-D int32/int64 tensor of dataset indices (one per batch row)"
            )
        where = indices.detach().to("cpu", torch.int64)
        _checks.in_range(where, 0, dataset_size, "indices", f"for dataset_size={dataset_size}")
        batch = where.numel()
    if (
        isinstance(indices_tuple, tuple)
        and not _tuples.is_mined(indices_tuple)
        and all(isinstance(x, Tensor) for x in indices_tuple)
    ):
        indices_tuple = tuple(x.detach().cpu() for x in indices_tuple)
    w = _tuples.sample_weights(indices_tuple, batch, torch.float32, "cpu")
    weights = torch.zeros(dataset_size)
    weights[where] = torch.ones(batch) if w is None else w.float().cpu()
    return weights


def weighted(weights: Tensor, num_samples: int, *, generator: torch.Generator) -> Tensor:
    """``num_samples`` dataset indices drawn with replacement with probability proportional to
    ``weights`` (what PML's ``TuplesToWeightsSampler`` yields: ``WeightedRandomSampler``).

    Example:
        >>> w = torch.tensor([0.0, 1.0, 0.0, 3.0])
        >>> idx = pf.samplers.weighted(w, 1000, generator=torch.Generator().manual_seed(0))
        >>> set(idx.tolist()) == {1, 3}, 600 < int((idx == 3).sum()) < 900
        (True, True)
    """
    g = _generator(generator)
    num_samples = _checks.integer(num_samples, "num_samples", minimum=1)
    if not isinstance(weights, Tensor) or weights.ndim != 1 or not weights.dtype.is_floating_point:
        raise TypeError(
            "weights must be a 1-D floating-point tensor (one weight per dataset sample)"
        )
    w = weights.detach().to("cpu", torch.float64)
    if w.numel() == 0:
        raise ValueError("weights is empty; at least one sample is required")
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError("weights must be finite and non-negative")
    if not bool((w > 0).any()):
        raise ValueError("weights are all zero: no sample can be drawn")
    return torch.multinomial(w, num_samples, replacement=True, generator=g)


class TuplesToWeightsSampler(Sampler[int]):
    """PML's ``TuplesToWeightsSampler`` with the model and miner outside: ``mine(indices)``
    returns the mined tuple over the batch ``dataset[indices]`` (for example: embed those samples
    with the model, then run a miner). Each ``iter()`` picks the batch (all samples in order, or
    ``subset_size`` random ones as PML does: without replacement when ``subset_size <=
    dataset_size``), calls ``mine``, keeps :func:`tuples_to_weights` in ``self.weights`` and yields
    ``len()`` draws of :func:`weighted`. ``len()``: ``subset_size`` or ``dataset_size``.

    Example:
        >>> def mine(indices):  # a stand-in for "embed dataset[indices], run a miner"
        ...     return torch.tensor([0]), torch.tensor([1]), torch.tensor([2])
        >>> s = pf.samplers.TuplesToWeightsSampler(mine, 6, generator=torch.Generator().manual_seed(0))
        >>> len(s), set(s) <= {0, 1, 2}, s.weights
        (6, True, tensor([1., 1., 1., 0., 0., 0.]))
    """

    def __init__(
        self,
        mine: Callable[[Tensor], object],
        dataset_size: int,
        subset_size: int | None = None,
        *,
        generator: torch.Generator | None = None,
    ) -> None:
        if not callable(mine):
            raise TypeError(
                f"mine must be a callable (indices -> indices_tuple), got {type(mine).__name__}"
            )
        self.mine = mine
        self.dataset_size = _checks.integer(dataset_size, "dataset_size", minimum=1)
        self.subset_size = (
            None if subset_size is None else _checks.integer(subset_size, "subset_size", minimum=1)
        )
        self.generator = _default_generator(generator)
        self.weights: Tensor | None = None

    def __len__(self) -> int:
        return self.subset_size or self.dataset_size

    def _batch(self) -> Tensor:
        n, k = self.dataset_size, self.subset_size
        if k is None:
            return torch.arange(n)
        if k <= n:
            return torch.randperm(n, generator=self.generator)[:k]
        return torch.randint(n, (k,), generator=self.generator)

    def __iter__(self) -> Iterator[int]:
        indices = self._batch()
        self.weights = tuples_to_weights(self.mine(indices), self.dataset_size, indices=indices)
        return iter(weighted(self.weights, len(self), generator=self.generator).tolist())
