"""Process-wide PGAS runtime: ``initialize`` / ``finalize`` and the engines they bring up.

Mirrors ``nvmath.distributed.initialize``. Each backend named in ``backends`` gets one engine:

* ``"mpi"``: CPU ranks of an mpi4py communicator; symmetric memory is NumPy;
* ``"nvshmem"``: one GPU per process; symmetric memory is CuPy or torch on the NVSHMEM heap.

NumPy operands (and torch CPU tensors, moved as their NumPy views) use the ``"mpi"`` engine when it is up, else
they are staged through the ``"nvshmem"`` engine; CuPy arrays and torch CUDA tensors need ``"nvshmem"``.
"""

from __future__ import annotations

import importlib
import os
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .engines.base import ControlPlane, Engine
from .errors import (
    BackendUnavailableError,
    NotInitializedError,
    PackageUnavailableError,
    RuntimeStateError,
    SymmetricMemoryError,
    UnknownBackendError,
)
from .process_group import MPIProcessGroup, ProcessGroup, communicator_of

__all__ = [
    "BACKENDS",
    "DistributedContext",
    "available_backends",
    "engine_for_package",
    "finalize",
    "get_context",
    "get_engine",
    "initialize",
    "initialized_backends",
    "is_initialized",
]

#: backend name -> "module:Class" of its engine (imported lazily: no MPI or CUDA import at package import)
BACKENDS: dict[str, str] = {
    "mpi": "dask_pgas.engines.mpi:MPIEngine",
    "nvshmem": "dask_pgas.engines.nvshmem:NVSHMEMEngine",
}

_lock = threading.RLock()
_engines: dict[str, Engine] = {}
_owner_pid: int | None = None
_communicator: Any = None  # the communicator initialize() was called with (None for an installed engine)
_device_id: int | None = None  # the device_id initialize() was given (reported by get_context, as nvmath keeps it)
_context: DistributedContext | None = None  # what get_context() returns: made whenever the engines change


@dataclass(frozen=True)
class DistributedContext:
    """What the initialized runtime runs on (``nvmath.distributed.DistributedContext`` counterpart).

    Attributes:
        device_id: CUDA device of the ``"nvshmem"`` backend on this process; without it, the ``device_id`` given
            to :func:`initialize` (None by default), which nvmath keeps whatever its backends.
        communicator: the mpi4py communicator given to :func:`initialize` (``MPI.COMM_WORLD`` by default); None
            when the engine was brought up without MPI (:func:`dask_pgas.initialize_from_uniqueid`).
        backends: the initialized backends, e.g. ``("mpi",)``.
        rank, nranks: this process's rank and the number of ranks in the PGAS world.
        nvshmem_available: whether the ``"nvshmem"`` backend is initialized (symmetric GPU memory).
        process_group: the :class:`~dask_pgas.process_group.MPIProcessGroup` given to :func:`initialize` (nvmath
            0.9 and 1.0 name the participating processes so), or one over ``communicator`` where a communicator
            was given; None when ``communicator`` is.
        nccl_comm: always None (as nvmath's without its ``"nccl"`` backend, which dask_pgas does not have).
    """

    device_id: int | None
    communicator: Any
    backends: tuple[str, ...]
    rank: int
    nranks: int
    nvshmem_available: bool
    process_group: ProcessGroup | None = None
    nccl_comm: None = None


#: nvmath backends that nothing here needs, accepted in ``backends`` (as nvmath's examples pass them) and ignored
_NOT_HERE = {"nccl": "nvmath uses NCCL for its distributed matmul (cuBLASMp), which dask_pgas does not have; "
                     "nothing here uses it"}


def _engine_class(name: str) -> type[Engine]:
    try:
        target = BACKENDS[name]
    except KeyError:
        raise UnknownBackendError(
            f"unknown backend {name!r}; choose from {sorted(BACKENDS)}"
        ) from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def _unavailable(name: str) -> str | None:
    try:
        return _engine_class(name).unavailable_reason()
    except BackendUnavailableError as exc:  # unknown name
        return str(exc)
    except Exception as exc:  # an optional dependency of that engine is missing or broken
        return f"{type(exc).__name__}: {exc}"


def available_backends() -> list[str]:
    """Backends that can be initialized in this process, best first."""
    return [name for name in ("nvshmem", "mpi") if _unavailable(name) is None]


def _default_communicator():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _requested(backends: Any) -> tuple[list[str], bool]:
    """This rank's backend names (local, no communication) and whether they are the automatic default."""
    if backends is None:
        env = os.environ.get("DASK_PGAS_BACKEND")
        if env:
            backends = [b.strip() for b in env.split(",") if b.strip()]
        else:
            return (["nvshmem"] if _unavailable("nvshmem") is None else ["mpi"]), True
    if isinstance(backends, str):
        backends = [backends]
    try:
        names = list(dict.fromkeys(backends))
    except TypeError:
        raise TypeError(f"backends must be a sequence of backend names, not {type(backends).__name__}") from None
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"backend names are strings such as 'mpi' or 'nvshmem', got {name!r}")
        if name not in BACKENDS and name not in _NOT_HERE:
            raise UnknownBackendError(f"unknown backend {name!r}; choose from {sorted(BACKENDS)}")
    kept = without_unused_backends(names, stacklevel=5)  # (warns at initialize()'s caller)
    if not kept:
        ignored = [name for name in names if name in _NOT_HERE]
        raise UnknownBackendError(f"backends must name at least one of {sorted(BACKENDS)}"
                                  + (f" ({ignored[0]!r} alone: {_NOT_HERE[ignored[0]]})" if ignored else ""))
    return kept, False


def without_unused_backends(names: list[str], stacklevel: int = 2) -> list[str]:
    """``names`` less nvmath's backends that nothing here uses (``"nccl"``), each dropped with a warning at
    ``stacklevel``; no warning when nothing else is left (the caller refuses that, saying why)."""
    kept = [name for name in names if name not in _NOT_HERE]
    if kept:
        for name in names:
            if name in _NOT_HERE:
                warnings.warn(f"backend {name!r} is ignored: {_NOT_HERE[name]}", stacklevel=stacklevel)
    return kept


def _local_setup(backends: Any) -> tuple[type[Exception] | None, str, list[str], bool, dict[str, str]]:
    """Everything ``initialize`` decides on this rank before talking to the others, errors included (returned,
    never raised: the caller exchanges them so that every rank raises the same exception)."""
    names: list[str] = []
    default = False
    problems: dict[str, str] = {}
    try:
        if _engines:
            raise RuntimeStateError(
                f"dask_pgas is already initialized with backends {sorted(_engines)}; "
                "call dask_pgas.finalize() before initializing again"
            )
        names, default = _requested(backends)
        # with the default, every rank may fall back to "mpi" (when the ranks' defaults differ): check it too
        for name in dict.fromkeys([*names, "mpi"] if default else names):
            why = _unavailable(name)
            if why:
                problems[name] = why
    except (BackendUnavailableError, RuntimeStateError, TypeError) as exc:
        return type(exc), str(exc), names, default, problems
    except Exception as exc:  # unexpected: still reported to every rank
        return BackendUnavailableError, f"{type(exc).__name__}: {exc}", names, default, problems
    return None, "", names, default, problems


def initialize(
    device_id: int | None = None,
    process_group: Any = None,
    backends: Sequence[str] | None = None,
    *,
    communicator: Any = None,
) -> None:
    """Bring up the PGAS runtime on every rank of ``process_group`` (collective).

    Args:
        device_id: CUDA device for the ``"nvshmem"`` backend (default: the local rank on the node, modulo the
            number of visible devices). Ignored by ``"mpi"``.
        process_group: an :class:`~dask_pgas.process_group.MPIProcessGroup` (as nvmath 0.9 and 1.0 take) or an
            mpi4py communicator (default ``MPI.COMM_WORLD``); the runtime works on a duplicate.
        communicator: the same, by the name nvmath's earlier releases gave it (give one of the two).
        backends: backends to start, from ``"mpi"`` and ``"nvshmem"``. Default: the environment variable
            ``DASK_PGAS_BACKEND`` (a name, or names separated by commas) where it is set; else ``["nvshmem"]``
            when a GPU, CuPy or torch, and the NVSHMEM/cuFFTMp libraries are present on every rank, else
            ``["mpi"]``.
            ``"nccl"`` (which nvmath's examples pass for its distributed matmul) is accepted and ignored, with a
            warning.

    Every rank's request is checked locally, then the ranks exchange their findings once (one allgather) and
    all raise the same exception or none does: a bad ``backends`` value on one rank, or different backends on
    different ranks, never leaves the other ranks waiting.

    Raises:
        RuntimeStateError: already initialized on some rank (call :func:`finalize` first).
        CollectiveMismatchError: called again in a running world while other ranks are in another collective
            call (raised on every rank of the world).
        BackendUnavailableError: different backends on different ranks, or a backend that cannot run here (on
            any rank); says which rank and what is missing. An unknown or empty ``backends`` raises its
            subclass :class:`UnknownBackendError`, also a ``ValueError`` (as nvmath's).
        TypeError: ``backends`` is not a sequence of names, or ``process_group`` and ``communicator`` are two
            different objects (on any rank); the group is not an MPI one (local: without a communicator there is
            nothing to agree over).
    """
    global _owner_pid, _communicator, _device_id
    group = process_group if process_group is not None else communicator
    both = process_group is not None and communicator is not None and process_group is not communicator
    with _lock:
        comm = communicator_of(group) if group is not None else _default_communicator()
        if is_initialized() and _same_ranks(comm, _communicator):
            # initializing the running world again: ranks making another call there meet this one and all raise
            # (with another communicator, e.g. a part of the world, only its ranks are here: the exchange below)
            _control_plane().agree(None, "initialize()")
        local = _local_setup(backends)
        if both and local[0] is None:  # (the process group given is the one this rank agrees over)
            local = (TypeError, "initialize() takes the process group once: give process_group (nvmath 0.9, 1.0) "
                     "or communicator (earlier nvmath), not both", *local[2:])
        everywhere = comm.allgather(local)  # the one exchange: every rank decides alike
        for rank, (cls, message, *_) in enumerate(everywhere):
            if cls is not None:
                raise cls(f"rank {rank}: {message}")
        requests = [names for _, _, names, _, _ in everywhere]
        names = requests[0]
        if any(r != names for r in requests):
            if all(default for *_, default, _ in everywhere):
                names = ["mpi"]  # the automatic choice differs between ranks: the backend every rank can run
            else:
                by_rank = "; ".join(f"rank {r}: {req}" for r, req in enumerate(requests))
                raise BackendUnavailableError(
                    f"ranks asked for different backends ({by_rank}); pass the same backends=[...] on every rank"
                )
        bad = [(rank, name, p[name]) for rank, (*_, p) in enumerate(everywhere) for name in names if name in p]
        if bad:
            rank, name, why = bad[0]
            raise BackendUnavailableError(f"backend {name!r} is unavailable on rank {rank}: {why}")
        started: dict[str, Engine] = {}
        try:
            for name in names:
                started[name] = _engine_class(name).create(device_id=device_id, communicator=comm)
        except BaseException:
            for engine in reversed(list(started.values())):
                engine.finalize()
            raise
        _engines.update(started)
        _owner_pid = os.getpid()
        _communicator = comm
        _device_id = device_id
        _new_context(group if isinstance(group, MPIProcessGroup) else MPIProcessGroup(comm))


def install_engine(engine: Engine) -> None:
    """Register an engine brought up by other means (e.g. NVSHMEM from a unique id handed out by Dask)."""
    global _owner_pid
    with _lock:
        if engine.name in _engines:
            raise RuntimeStateError(f"backend {engine.name!r} is already initialized; call finalize() first")
        _engines[engine.name] = engine
        _owner_pid = os.getpid()
        _new_context(_context.process_group if _context is not None else None)


def finalize() -> None:
    """Free every symmetric allocation still registered and tear down the engines (collective).

    Raises :class:`SymmetricMemoryError` on every rank, finalizing nothing, while any rank still references a
    symmetric array (or a view of one) that was not freed: its memory would be freed under it. Allocations
    whose arrays were garbage collected unfreed are freed here."""
    global _owner_pid, _communicator, _device_id, _context
    from .memory import _free_all, _in_use

    with _lock:
        if not _engines:
            return
        if is_initialized():  # every rank is in this call, or all raise; and none frees arrays still in use
            if bad := _control_plane().agree(_in_use(), "finalize()"):
                said: dict[str, list[int]] = {}  # the same text from many ranks, said once
                for r, e in bad:
                    said.setdefault(e, []).append(r)
                raise SymmetricMemoryError("; ".join(
                    f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {e}" for e, rs in said.items()
                ) + "; nothing was finalized")
        try:
            for engine in _engines.values():
                _free_all(engine)
        finally:
            engines = list(_engines.values())
            _engines.clear()
            _owner_pid = None
            _communicator = None
            _device_id = None
            _context = None
            first = None
            for engine in reversed(engines):  # every engine, whatever one of them raised (agreed: on every rank)
                try:
                    engine.finalize()
                except Exception as exc:
                    first = first or exc
            if first is not None:
                raise first


def is_initialized() -> bool:
    """Whether this process has an initialized runtime (:func:`initialize` ran here, not in a parent before a
    fork, and :func:`finalize` has not). Local, not collective."""
    return bool(_engines) and _owner_pid == os.getpid()


def initialized_backends() -> tuple[str, ...]:
    """The backends the initialized runtime runs, e.g. ``("mpi",)``; empty before :func:`initialize`. Local."""
    return tuple(_engines)


def get_context() -> DistributedContext | None:
    """The initialized runtime's :class:`DistributedContext`, or None before :func:`initialize` (and after
    :func:`finalize`), as ``nvmath.distributed.get_context``: the same object on every call while the runtime
    runs the same engines, its ``process_group`` the one given to :func:`initialize`. Local, not collective.

    Raises:
        RuntimeStateError: in a forked child of an initialized process (it must initialize itself).
    """
    with _lock:
        if not _engines:
            return None
        _require()
        return _context


def _new_context(group: ProcessGroup | None) -> None:
    """Describe the engines now running (under ``_lock``), with the process group they run over (None without
    a communicator: an engine brought up from a unique id alone)."""
    global _context
    first = next(iter(_engines.values()))
    nvshmem = _engines.get("nvshmem")
    _context = DistributedContext(
        device_id=getattr(nvshmem, "device", None) if nvshmem is not None else _device_id,
        communicator=_communicator,
        backends=tuple(_engines),
        rank=first.rank,
        nranks=first.nranks,
        nvshmem_available=nvshmem is not None,
        process_group=group if _communicator is not None else None,
    )


def _same_ranks(comm: Any, world: Any) -> bool:
    """Local: whether mpi4py communicator ``comm`` holds the same processes as ``world`` (False when that cannot
    be told: no world over MPI, e.g. one brought up from an NVSHMEM unique id, or a world communicator the
    caller has freed since, as the Dask worker plugin does)."""
    if world is None or not hasattr(comm, "Compare"):
        return False
    from mpi4py import MPI

    try:
        return comm.Compare(world) != MPI.UNEQUAL
    except MPI.Exception:
        return False


def _control_plane() -> ControlPlane:
    """The control plane on which every public collective call opens (the first engine's)."""
    return next(iter(_require().values())).control


def _require() -> dict[str, Engine]:
    if not _engines:
        raise NotInitializedError(
            "dask_pgas is not initialized: call dask_pgas.initialize(backends=[...]) on every rank first"
        )
    if _owner_pid != os.getpid():
        raise RuntimeStateError(
            "dask_pgas was initialized in a parent process; a forked child must call dask_pgas.initialize() itself"
        )
    return _engines


def get_engine(name: str) -> Engine:
    engines = _require()
    try:
        return engines[name]
    except KeyError:
        raise BackendUnavailableError(
            f"backend {name!r} was not initialized (initialized: {sorted(engines)}); "
            f"pass backends=[..., {name!r}] to dask_pgas.initialize()"
        ) from None


def engine_for_package(package: str, *, allocation: bool = False) -> Engine:
    """The engine for arrays of ``package``: the one whose symmetric memory they are, else (for reshape
    operands only) one that stages them."""
    engines = _require().values()
    native = [e for e in engines if package in e.packages]
    staged = [] if allocation else [e for e in engines if package in e.operand_packages]
    if native or staged:
        return (native or staged)[0]
    need = "nvshmem" if package in ("cupy", "torch") else "mpi"
    hint = ""
    if allocation and package == "torch" and "mpi" in _engines:  # (nvmath's torch symmetric memory is on GPUs)
        hint = ("; on the mpi engine symmetric memory is NumPy (torch.from_numpy() of it is a tensor over it), and "
                "torch CPU tensors are reshape operands as they are, symmetric or not")
    raise PackageUnavailableError(
        f"no initialized backend handles {package} arrays (initialized: {sorted(_engines)}); "
        f"initialize with backends=[{need!r}]{hint}"
    )
