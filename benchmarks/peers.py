"""The peer libraries' loss code for the benchmark suite (``benchmarks/cases/bench_peers.py``).

The peers are optional: ``pip install -e '.[bench-peers]'`` installs open-clip-torch,
sentence-transformers, lightly, optax, jax and cut-cross-entropy. Nothing in the default test install
(``.[test,docs]``) needs them; every loader here raises :class:`PeerUnavailable` with the reason
(the package missing, or failing to import) and the suite skips the member with that reason
(``pytest.skip`` in the pytest suite; ``status: skipped`` in ``benchmarks.run``).

What each loader gives, and how:

- :func:`open_clip_loss`: open_clip's ``loss.py`` (``ClipLoss``, ``SigLipLoss``), executed from
  its file (``importlib.util.spec_from_file_location``) under a private module name. The package's
  ``open_clip/__init__.py`` imports its models, transforms and tokenizer, which import
  torchvision; ``loss.py`` itself imports only torch (horovod optionally).
- :func:`lightly_ntxent`: lightly's ``loss/ntx_ent_loss.py`` (``NTXentLoss``), from its file
  too. It imports ``lightly.models.modules.memory_bank`` (``MemoryBankModule``) and
  ``lightly.utils.dist``; ``lightly/__init__.py``, ``lightly/loss/__init__.py`` (every loss) and
  ``lightly.models.utils`` (imported by the memory bank) import torchvision. So the three files
  that NT-Xent runs (``utils/dist.py``, ``models/modules/memory_bank.py``, ``loss/ntx_ent_loss.py``)
  are executed from their paths, each while ``sys.modules`` maps the ``lightly.*`` names they
  import to the private modules already loaded (and ``lightly.models.utils``, which the memory
  bank only calls to gather across ranks, to a placeholder that raises on use); the previous
  ``sys.modules`` entries are restored right after, so a real ``import lightly`` elsewhere in the
  process is unaffected. With ``memory_bank_size=0`` (the default, what the suite measures) the
  memory bank passes its input through.
- :func:`sentence_transformers_losses`: ``MultipleNegativesRankingLoss`` and
  ``CachedMultipleNegativesRankingLoss``, imported normally (the package's init needs torch and
  transformers, not torchvision; it takes a few seconds, once per process).
- :func:`optax_ntxent`: ``optax.losses.ntxent`` and ``jax``, imported normally. Before jax is
  first imported, ``XLA_FLAGS`` gets ``--xla_cpu_multi_thread_eigen=false
  intra_op_parallelism_threads=1`` when one thread is asked for, so that XLA's CPU kernels run
  on one thread as torch's do (``torch.set_num_threads`` does not reach XLA).
- :func:`cut_cross_entropy`: Apple's Cut Cross-Entropy (``linear_cross_entropy(e, c, targets)``,
  the mean cross entropy of the logits ``e cᵀ``; used by ``benchmarks/cases/bench_class_tiles.py``
  and ``benchmarks/class_tiles.py``). Where the package imports (its ``linear_cross_entropy.py``
  imports ``cce.py``, hence triton, on Linux) it is used as is, with both impls: ``"cce"``, the
  memory-efficient Triton kernels (CUDA tensors only), and ``"torch_compile"``. Without triton
  (this CPU machine, CI) the package's init fails, so ``torch_compile.py`` (the
  ``torch.compile(fullgraph=True, dynamic=True)`` of the dense logits and ``F.cross_entropy``,
  CCE's own baseline and CPU path) is executed from its file with the three files it imports
  (``constants.py``, ``doc.py``, ``utils.py``: torch only), the ``cut_cross_entropy.*`` names
  aliased as for lightly; only ``"torch_compile"`` is then offered. A failed package import
  leaves no ``cut_cross_entropy`` module behind.

Nothing of the peers' code is copied here: the files are the installed packages' own. Every
outcome (the module, or the reason it is unavailable) is cached per process; :func:`forget`
clears the cache (the tests use it with a missing module name to check that absence is reported
cleanly).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

EXTRA = "bench-peers"
INSTALL = f"pip install -e '.[{EXTRA}]'"
PRIVATE = "benchmarks._peer_code"  # the package name under which the peer files are executed


@dataclass(frozen=True)
class Peer:
    """One peer library: its import name and its distribution (what pip installs)."""

    module: str
    distribution: str


# Modules the loaders look for, by short name (a test replaces one with a missing name to
# simulate its absence).
PEERS: dict[str, Peer] = {
    "open_clip": Peer("open_clip", "open-clip-torch"),
    "sentence_transformers": Peer("sentence_transformers", "sentence-transformers"),
    "lightly": Peer("lightly", "lightly"),
    "optax": Peer("optax", "optax"),
    "jax": Peer("jax", "jax"),
    "cut_cross_entropy": Peer("cut_cross_entropy", "cut-cross-entropy"),
}


class PeerUnavailable(ImportError):
    """A peer library is not installed or cannot be loaded; ``str()`` is the reason."""


def version(name: str) -> str | None:
    """The installed version of peer ``name`` (a :data:`PEERS` key), or ``None``."""
    try:
        return importlib.metadata.version(PEERS[name].distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _missing(peer: Peer, why: str | None = None) -> PeerUnavailable:
    what = f"{peer.module} ({peer.distribution})"
    detail = f"is not installed ({INSTALL})" if why is None else f"cannot be loaded: {why}"
    return PeerUnavailable(f"{what} {detail}")


def package_dir(name: str) -> Path:
    """The directory of peer ``name``'s package, found without importing it (a top-level
    package's ``find_spec`` runs no code of the package)."""
    peer = PEERS[name]
    try:
        spec = importlib.util.find_spec(peer.module)
    except (ImportError, ValueError) as err:
        raise _missing(peer, f"{type(err).__name__}: {err}") from err
    if spec is None or not spec.submodule_search_locations:
        raise _missing(peer)
    return Path(next(iter(spec.submodule_search_locations)))


@contextlib.contextmanager
def _aliased(modules: Mapping[str, types.ModuleType]) -> Iterator[None]:
    """``sys.modules`` maps each of ``modules``' names to its module for the duration; the
    previous entries (or their absence) are restored after."""
    absent = object()
    saved = {name: sys.modules.get(name, absent) for name in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name, previous in saved.items():
            if previous is absent:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous  # type: ignore[assignment]


def load_file(
    name: str, path: Path, aliases: Mapping[str, types.ModuleType] | None = None
) -> types.ModuleType:
    """Execute the Python file ``path`` as the module ``{PRIVATE}.{name}`` (not entered in
    ``sys.modules``), with ``aliases`` in ``sys.modules`` while it runs (the names its imports
    need); raises :class:`PeerUnavailable` when the file is missing or fails to import."""
    if not path.is_file():
        raise PeerUnavailable(f"{path} does not exist (another version of the package?)")
    spec = importlib.util.spec_from_file_location(f"{PRIVATE}.{name}", path)
    if spec is None or spec.loader is None:  # pragma: no cover - a .py path always has one
        raise PeerUnavailable(f"{path}: no loader")
    module = importlib.util.module_from_spec(spec)
    try:
        with _aliased(aliases or {}):
            spec.loader.exec_module(module)
    except Exception as err:
        raise PeerUnavailable(f"{path} failed to import: {type(err).__name__}: {err}") from err
    return module


def _package(name: str, **attrs: Any) -> types.ModuleType:
    """An empty stand-in package ``name`` (``__path__`` empty: nothing is imported through it)."""
    module = types.ModuleType(name)
    module.__path__ = []
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def _placeholder(name: str, why: str) -> types.ModuleType:
    """A module whose every attribute raises: for code paths the suite never takes."""
    module = types.ModuleType(name)

    def __getattr__(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise RuntimeError(f"{name}.{attr} is not loaded by benchmarks.peers ({why})")

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    return module


T = TypeVar("T")
_CACHE: dict[str, Any] = {}


def _cached(key: str, load: Callable[[], T]) -> T:
    """``load()``'s result, or the :class:`PeerUnavailable` it raised, once per process."""
    if key not in _CACHE:
        try:
            _CACHE[key] = load()
        except PeerUnavailable as err:
            _CACHE[key] = err
    outcome = _CACHE[key]
    if isinstance(outcome, PeerUnavailable):
        raise PeerUnavailable(str(outcome))
    return outcome


def forget() -> None:
    """Clear every cached outcome (the next call loads again)."""
    _CACHE.clear()


def open_clip_loss() -> types.ModuleType:
    """open_clip's ``loss.py`` (``ClipLoss``, ``SigLipLoss``), loaded without the package's
    init (which imports torchvision)."""
    return _cached(
        "open_clip", lambda: load_file("open_clip_loss", package_dir("open_clip") / "loss.py")
    )


def _load_lightly() -> types.ModuleType:
    root = package_dir("lightly")
    dist = load_file("lightly_dist", root / "utils" / "dist.py")
    utils = _placeholder("lightly.models.utils", "it imports torchvision; used across ranks only")
    memory_bank = load_file(
        "lightly_memory_bank",
        root / "models" / "modules" / "memory_bank.py",
        {
            "lightly": _package("lightly"),
            "lightly.utils": _package("lightly.utils", dist=dist),
            "lightly.utils.dist": dist,
            "lightly.models": _package("lightly.models", utils=utils),
            "lightly.models.utils": utils,
        },
    )
    modules = _package("lightly.models.modules", memory_bank=memory_bank)
    return load_file(
        "lightly_ntx_ent_loss",
        root / "loss" / "ntx_ent_loss.py",
        {
            "lightly": _package("lightly"),
            "lightly.utils": _package("lightly.utils", dist=dist),
            "lightly.utils.dist": dist,
            "lightly.models": _package("lightly.models", utils=utils, modules=modules),
            "lightly.models.modules": modules,
            "lightly.models.modules.memory_bank": memory_bank,
        },
    )


def lightly_ntxent() -> types.ModuleType:
    """lightly's ``loss/ntx_ent_loss.py`` (``NTXentLoss``), loaded without ``lightly``'s init
    (which imports torchvision)."""
    return _cached("lightly", _load_lightly)


def _import(name: str) -> types.ModuleType:
    """``import`` peer ``name``; absent or failing: :class:`PeerUnavailable`."""
    peer = PEERS[name]
    package_dir(name)  # not installed: the plain reason
    try:
        return importlib.import_module(peer.module)
    except Exception as err:
        raise _missing(peer, f"{type(err).__name__}: {err}") from err


def _load_sentence_transformers() -> types.SimpleNamespace:
    _import("sentence_transformers")
    try:
        from sentence_transformers.sentence_transformer import losses
    except Exception as err:
        raise _missing(PEERS["sentence_transformers"], f"{type(err).__name__}: {err}") from err
    return types.SimpleNamespace(
        MultipleNegativesRankingLoss=losses.MultipleNegativesRankingLoss,
        CachedMultipleNegativesRankingLoss=losses.CachedMultipleNegativesRankingLoss,
    )


def sentence_transformers_losses() -> types.SimpleNamespace:
    """sentence-transformers' ``MultipleNegativesRankingLoss`` and
    ``CachedMultipleNegativesRankingLoss``."""
    return _cached("sentence_transformers", _load_sentence_transformers)


SINGLE_THREAD_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def _load_optax(threads: int) -> types.SimpleNamespace:
    package_dir("jax")
    package_dir("optax")
    if "jax" not in sys.modules and threads == 1:
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_cpu_multi_thread_eigen" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} {SINGLE_THREAD_XLA_FLAGS}".strip()
    jax = _import("jax")
    optax = _import("optax")
    return types.SimpleNamespace(jax=jax, ntxent=optax.losses.ntxent)


def optax_ntxent(threads: int = 1) -> types.SimpleNamespace:
    """``jax`` and ``optax.losses.ntxent``; ``threads == 1``: XLA's CPU kernels on one thread
    (set before jax is first imported; a later call cannot change it)."""
    return _cached("optax", lambda: _load_optax(threads))


CCE_FILES = ("constants", "doc", "utils")  # what torch_compile.py imports from its package


def _cce_files() -> types.SimpleNamespace:
    """CCE's ``torch_compile.py`` and the three files it imports, without the package's init."""
    root = package_dir("cut_cross_entropy")
    deps = {name: load_file(f"cce_{name}", root / f"{name}.py") for name in CCE_FILES}
    package = _package("cut_cross_entropy", **deps)
    aliases = {"cut_cross_entropy": package}
    aliases.update({f"cut_cross_entropy.{name}": module for name, module in deps.items()})
    compiled = load_file("cce_torch_compile", root / "torch_compile.py", aliases)

    def linear_cross_entropy(e, c, targets, impl: str = "torch_compile"):
        if impl != "torch_compile":
            raise PeerUnavailable(
                f"cut_cross_entropy impl {impl!r} needs the package (triton); loaded here: "
                "torch_compile.py only"
            )
        return compiled.torch_compile_linear_cross_entropy(e, c, targets)

    return types.SimpleNamespace(
        linear_cross_entropy=linear_cross_entropy,
        impls=("torch_compile",),
        source="torch_compile.py (no triton)",
    )


def _load_cut_cross_entropy() -> types.SimpleNamespace:
    package_dir("cut_cross_entropy")  # not installed: the plain reason
    if importlib.util.find_spec("triton") is None:
        return _cce_files()
    before = set(sys.modules)
    try:
        package = importlib.import_module("cut_cross_entropy")
    except Exception:  # a broken triton: fall back to the files, leaving no partial package
        for name in set(sys.modules) - before:
            if name == "cut_cross_entropy" or name.startswith("cut_cross_entropy."):
                del sys.modules[name]
        return _cce_files()

    def linear_cross_entropy(e, c, targets, impl: str = "cce"):
        return package.linear_cross_entropy(e, c, targets, impl=impl)

    return types.SimpleNamespace(
        linear_cross_entropy=linear_cross_entropy,
        impls=("cce", "torch_compile"),
        source="package",
    )


def cut_cross_entropy() -> types.SimpleNamespace:
    """Apple's Cut Cross-Entropy: ``linear_cross_entropy(e, c, targets, impl)`` (mean reduction),
    ``impls`` (what ``impl`` may be here: ``"cce"``, CUDA only, where the package imports) and
    ``source`` (``"package"`` or ``"torch_compile.py (no triton)"``)."""
    return _cached("cut_cross_entropy", _load_cut_cross_entropy)


def cce_impl(device_type: str) -> str:
    """The CCE impl to time on a device of type ``device_type`` (``"cuda"``, ``"cpu"``): its
    Triton kernels (``"cce"``) on CUDA where the package imports, else ``"torch_compile"``."""
    return (
        "cce" if device_type == "cuda" and "cce" in cut_cross_entropy().impls else "torch_compile"
    )


LOADERS: dict[str, Callable[[], Any]] = {
    "open_clip": open_clip_loss,
    "sentence_transformers": sentence_transformers_losses,
    "lightly": lightly_ntxent,
    "optax": optax_ntxent,
    "cut_cross_entropy": cut_cross_entropy,
}


def unavailable(name: str) -> str | None:
    """Why peer ``name`` (a :data:`LOADERS` key) cannot be used here, or ``None``."""
    try:
        LOADERS[name]()
    except PeerUnavailable as err:
        return str(err)
    return None
