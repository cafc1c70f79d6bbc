"""The self-supervised losses beside lightly's and the matmul floor: time and memory.

One pytest-benchmark group per loss and size, ``ssl-{loss}-b{B}-d{D}``, holding the
``pmlfunc`` member and, where lightly has the loss, the ``lightly`` member; the floor has its
own group ``ssl-floor-b{B}-d{D}``. ``B`` rows (``PMLFUNC_BENCH_SSL_BATCH``, 512) and ``D``
dimensions (``PMLFUNC_BENCH_SSL_DIM``, 128) each take one value or a comma-separated list (every
pair is measured: ``PMLFUNC_BENCH_SSL_BATCH=512,2048 PMLFUNC_BENCH_SSL_DIM=128,2048`` is the
issue's grid for the covariance losses); float32, one thread, forward + backward of every input:

=================================  ===========================================  ==============================================
loss                               input                                        lightly member (the same function)
=================================  ===========================================  ==============================================
``barlow_twins``                   two views ``(B, D)``                          ``BarlowTwinsLoss()``; pmlfunc with
                                                                                 ``unbiased=False, eps=1e-5`` (lightly's
                                                                                 ``F.batch_norm``)
``vicreg``                         two views ``(B, D)``                          ``VICRegLoss()``
``dino``                           2 teacher, 6 student views ``(B, V, D)``      ``DINOLoss(output_dim=D)`` on the views' lists
                                   (``D`` the output dimension)
``swav``                           2 high-, 4 low-resolution crops' scores      ``SwaVLoss()`` on the crops' lists
                                   ``(B, V, D)`` (``D`` prototypes, ``tanh``)
``koleo``                          ``(B, D)``                                    ``KoLeoLoss()``
``mmcr``                           ``(B, 2, D)`` (``K = 2`` views)               ``MMCRLoss()(z[:, :1], z[:, 1:])`` (it joins
                                                                                 its two arguments' views); pmlfunc with
                                                                                 ``normalize=False`` (lightly does not
                                                                                 normalise)
``sigreg``                         ``(B, D)``                                    ``SIGReg()`` (lejepa): its own random
                                                                                 directions when timed
``tico``                           two views ``(B, D)``, state ``tico_init(D)``  ``TiCoLoss(rho=20)(a, b,
                                                                                 update_covariance_matrix=False)``
``hypersphere``                    two views ``(B, D)``                          ``HypersphereLoss()``
``negative_cosine_similarity``     two views ``(B, D)``                          ``NegativeCosineSimilarity()``
``floor``                          two views ``(B, D)``                          (none: ``(Z_aᵀ Z_b).sum()`` and its backward)
=================================  ===========================================  ==============================================

pmlfunc's ``sigreg`` draws its directions from an explicit seed (``generator=`` a 0-d seed
tensor, :data:`benchmarks.common.SEED`): every step the same ones.

lightly is optional (``pip install -e '.[bench-peers]'``): its loss files are executed one by one
from the installed package (:func:`benchmarks.peers.load_file`, without ``lightly/__init__.py``,
which imports torchvision), each with the few ``lightly.*`` modules it imports (``utils/dist.py``;
DINO's ``models/modules/center.py``). Where lightly is absent or a file fails to load, the
lightly members are skipped with the reason; the pmlfunc and floor members always run.

Before a lightly member is measured (untimed and timed runs alike) its loss is checked equal to
the pmlfunc member's on the same inputs (relative ``1e-4``; the values only: lightly's TiCo
detaches the batch's covariance, so its gradient is not pmlfunc's). lightly's ``SIGReg`` draws
its own directions: the check swaps in pmlfunc's (the instance's ``_generate_unit_vectors``, as
``tests/test_self_supervised.py`` does); the timed instance draws its own with ``torch.randn``.

``extra_info["peak_tensor_mib"]`` is one step's live-tensor peak
(:func:`pmlfunc.memory.peak_tensor_bytes`). The untimed run (the normal ``pytest``) runs each
member at batch ``PMLFUNC_BENCH_SMOKE_SSL_BATCH`` (32) and the first ``D``.

Timed run::

    pytest benchmarks/cases/bench_self_supervised.py --benchmark-only \
        --benchmark-group-by=group --benchmark-columns=min,median,max,rounds
    PMLFUNC_BENCH_SSL_BATCH=512,2048 PMLFUNC_BENCH_SSL_DIM=128,2048 \
        pytest benchmarks/cases/bench_self_supervised.py --benchmark-only \
        -k "barlow_twins or vicreg or floor" --benchmark-columns=median
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable

import pytest
import torch

import pmlfunc as pf

from .. import common as C
from .. import peers as P

SSL_BATCH_VAR, SSL_DIM_VAR = "PMLFUNC_BENCH_SSL_BATCH", "PMLFUNC_BENCH_SSL_DIM"


def _env_ints(name: str, default: int) -> tuple[int, ...]:
    """``name``'s positive integers, one or comma-separated (``default`` when unset)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return (default,)
    values = tuple(int(v) for v in raw.split(",") if v.strip())
    if not values or min(values) <= 0:
        raise ValueError(f"{name} must be positive integers, comma-separated, got {raw!r}")
    return values


BATCHES = _env_ints(SSL_BATCH_VAR, 512)
DIMS = _env_ints(SSL_DIM_VAR, 128)
SMOKE_BATCH = C.env_int("PMLFUNC_BENCH_SMOKE_SSL_BATCH", 32)
THREADS = C.bench_threads()
LOSSES = (
    "barlow_twins", "vicreg", "dino", "swav", "koleo", "mmcr", "sigreg", "tico",
    "hypersphere", "negative_cosine_similarity",
)  # fmt: skip
# (teacher or high-resolution views, the others); mmcr: K views of one sample, no second input
VIEWS = {"dino": (2, 6), "swav": (2, 4), "mmcr": (2,)}
SINGLE = ("koleo", "sigreg", "mmcr")  # one input tensor
SIGREG_SEED = torch.tensor(C.SEED)
PARITY_RTOL = 1e-4


def pytest_generate_tests(metafunc) -> None:
    if "impl" not in metafunc.fixturenames:
        return
    smoke = C.timing_disabled(metafunc.config)
    sizes = [(SMOKE_BATCH, DIMS[0])] if smoke else [(b, d) for b in BATCHES for d in DIMS]
    params = []
    for b, d in sizes:
        for loss in (*LOSSES, "floor"):
            group = pytest.mark.benchmark(group=f"ssl-{loss}-b{b}-d{d}")
            for impl in ("pmlfunc", "lightly") if loss != "floor" else ("floor",):
                name = loss if impl == "pmlfunc" else f"{loss}-{impl}"
                params.append(pytest.param(b, d, loss, impl, id=f"b{b}-d{d}-{name}", marks=group))
    metafunc.parametrize(("batch", "dim", "loss", "impl"), params)


def inputs(loss: str, batch: int, dim: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(C.SEED)
    if loss in VIEWS:
        views = tuple(torch.randn(batch, v, dim, generator=g) for v in VIEWS[loss])
        return tuple(v.tanh() for v in views) if loss == "swav" else views
    if loss in SINGLE:
        return (torch.randn(batch, dim, generator=g),)
    return torch.randn(batch, dim, generator=g), torch.randn(batch, dim, generator=g)


def pmlfunc_loss(loss: str, dim: int) -> Callable[..., torch.Tensor]:
    """The pmlfunc member's loss of the measured inputs (the function lightly's is checked
    equal to)."""
    if loss == "dino":
        state = pf.losses.dino_init(dim)
        # the student's views: the teacher's two crops first, then four more
        return lambda t, s: pf.losses.dino(t.detach(), s, state)[0]
    if loss == "tico":
        state = pf.losses.tico_init(dim)
        return lambda a, b: pf.losses.tico(a, b, state)[0]
    if loss == "barlow_twins":  # lightly's F.batch_norm: the biased variance, ε = 1e-5
        return lambda a, b: pf.losses.barlow_twins(a, b, unbiased=False, eps=1e-5)
    if loss == "mmcr":
        return lambda z: pf.losses.mmcr(z, normalize=False)
    if loss == "sigreg":
        return lambda x: pf.losses.sigreg(x, generator=SIGREG_SEED)
    if loss == "floor":
        return lambda a, b: (a.T @ b).sum()
    return getattr(pf.losses, loss)


# --- lightly's loss files, loaded one by one ---------------------------------------------------

LIGHTLY_FILES = {
    "barlow_twins": ("barlow_twins_loss.py", "BarlowTwinsLoss"),
    "vicreg": ("vicreg_loss.py", "VICRegLoss"),
    "dino": ("dino_loss.py", "DINOLoss"),
    "swav": ("swav_loss.py", "SwaVLoss"),
    "koleo": ("koleo_loss.py", "KoLeoLoss"),
    "mmcr": ("mmcr_loss.py", "MMCRLoss"),
    "sigreg": ("lejepa_loss.py", "SIGReg"),
    "tico": ("tico_loss.py", "TiCoLoss"),
    "hypersphere": ("hypersphere_loss.py", "HypersphereLoss"),
    "negative_cosine_similarity": ("negative_cosine_similarity.py", "NegativeCosineSimilarity"),
}
_LOADED: dict[str, types.ModuleType | P.PeerUnavailable] = {}


def _package(name: str, **attrs: object) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []  # type: ignore[attr-defined]
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def _load_lightly(path: str) -> types.ModuleType:
    """lightly's ``loss/<path>``, executed from its file with the ``lightly.*`` modules it
    imports (``utils/dist.py``, ``models/modules/center.py``) served by their files."""
    root = P.package_dir("lightly")
    dist = P.load_file("lightly_dist", root / "utils" / "dist.py")
    center = P.load_file("lightly_center", root / "models" / "modules" / "center.py")
    utils = _package("lightly.utils", dist=dist)
    modules = _package("lightly.models.modules", center=center)
    aliases = {
        "lightly": _package("lightly", utils=utils),
        "lightly.utils": utils,
        "lightly.utils.dist": dist,
        "lightly.models": _package("lightly.models", modules=modules),
        "lightly.models.modules": modules,
        "lightly.models.modules.center": center,
    }
    return P.load_file(f"lightly_{path[:-3]}", root / "loss" / path, aliases)


def lightly_class(loss: str) -> type:
    """lightly's module class for ``loss``; :class:`benchmarks.peers.PeerUnavailable` with the
    reason when lightly is absent or the file fails to load (cached per process)."""
    path, name = LIGHTLY_FILES[loss]
    if path not in _LOADED:
        try:
            _LOADED[path] = _load_lightly(path)
        except P.PeerUnavailable as err:
            _LOADED[path] = err
    outcome = _LOADED[path]
    if isinstance(outcome, P.PeerUnavailable):
        raise P.PeerUnavailable(str(outcome))
    return getattr(outcome, name)


def lightly_loss(
    loss: str, dim: int, *, same_directions: bool = False
) -> Callable[..., torch.Tensor]:
    """lightly's loss of the measured inputs (a scalar). ``same_directions``: SIGReg with
    pmlfunc's directions (the parity check) instead of its own ``torch.randn``."""
    cls = lightly_class(loss)
    if loss == "dino":
        dino = cls(output_dim=dim)
        return lambda t, s: dino(list(t.detach().unbind(1)), list(s.unbind(1)))
    if loss == "swav":
        swav = cls()
        return lambda h, lo: swav(list(h.unbind(1)), list(lo.unbind(1))).sum()  # shape (1,)
    if loss == "mmcr":
        mmcr = cls()
        return lambda z: mmcr(z[:, :1], z[:, 1:])  # its two arguments' views, concatenated
    if loss == "tico":
        tico = cls(rho=20.0)  # pmlfunc's default (lightly's is 8)
        return lambda a, b: tico(a, b, update_covariance_matrix=False)
    if loss == "sigreg":
        sigreg = cls()
        if same_directions:
            from pmlfunc.losses.self_supervised import _sigreg_directions

            a = _sigreg_directions(SIGREG_SEED, dim, sigreg.num_vectors).float()
            sigreg._generate_unit_vectors = lambda device, dtype, num_features: a.to(device, dtype)
        return sigreg
    return cls()


def _check_equal(loss: str, dim: int, tensors: tuple[torch.Tensor, ...]) -> None:
    """lightly's loss equals pmlfunc's on ``tensors`` (relative ``PARITY_RTOL``)."""
    with torch.no_grad():
        want = pmlfunc_loss(loss, dim)(*tensors)
        got = lightly_loss(loss, dim, same_directions=True)(*tensors)
    scale = max(1.0, abs(float(want)))
    assert abs(float(got) - float(want)) <= PARITY_RTOL * scale, (
        f"{loss}: lightly {float(got)!r} != pmlfunc {float(want)!r}"
    )


def bench_self_supervised(benchmark, request, batch: int, dim: int, loss: str, impl: str) -> None:
    tensors = inputs(loss, batch, dim)
    if impl == "lightly":
        try:
            fn = lightly_loss(loss, dim)
        except P.PeerUnavailable as err:
            pytest.skip(f"lightly: {err}")
        _check_equal(loss, dim, tensors)
    else:
        fn = pmlfunc_loss(loss, dim)

    def step() -> torch.Tensor:
        leaves = [t.detach().requires_grad_() for t in tensors]
        value = fn(*leaves)
        value.backward()
        return value.detach()

    value, _ = C.measure_tensor_peak(benchmark, request, step, THREADS)
    benchmark.extra_info.update(
        impl=impl, case=f"ssl-{loss}", loss=loss, batch=batch, dim=dim, threads=THREADS,
        lightly_version=P.version("lightly") if impl == "lightly" else None,
        loss_value=float(value),
    )  # fmt: skip
    assert value.ndim == 0 and torch.isfinite(value)
