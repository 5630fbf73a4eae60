"""Process-wide PGAS runtime: ``initialize`` / ``finalize`` and the engines they bring up.

Mirrors ``nvmath.distributed.initialize``. Each backend named in ``backends`` gets one engine:

* ``"mpi"``: CPU ranks of an mpi4py communicator; symmetric memory is NumPy;
* ``"nvshmem"``: one GPU per process; symmetric memory is CuPy or torch on the NVSHMEM heap.

NumPy operands use the ``"mpi"`` engine when it is up, else they are staged through the ``"nvshmem"`` engine;
CuPy/torch operands need ``"nvshmem"``.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Sequence
from typing import Any

from .engines.base import Engine
from .errors import BackendUnavailableError, NotInitializedError, RuntimeStateError

__all__ = [
    "BACKENDS",
    "available_backends",
    "engine_for_package",
    "finalize",
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


def _engine_class(name: str) -> type[Engine]:
    try:
        target = BACKENDS[name]
    except KeyError:
        raise BackendUnavailableError(
            f"unknown backend {name!r}; choose from {sorted(BACKENDS)}"
        ) from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def _unavailable(name: str) -> str | None:
    try:
        return _engine_class(name).unavailable_reason()
    except ImportError as exc:  # an optional dependency of that engine is missing
        return f"{exc}"


def available_backends() -> list[str]:
    """Backends that can be initialized in this process, best first."""
    return [name for name in ("nvshmem", "mpi") if _unavailable(name) is None]


def _default_communicator():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def initialize(
    device_id: int | None = None,
    communicator: Any = None,
    backends: Sequence[str] | None = None,
) -> None:
    """Bring up the PGAS runtime on every rank of ``communicator`` (collective).

    Args:
        device_id: CUDA device for the ``"nvshmem"`` backend (default: the local rank on the node, modulo the
            number of visible devices). Ignored by ``"mpi"``.
        communicator: an mpi4py communicator (default ``MPI.COMM_WORLD``); the runtime works on a duplicate.
        backends: backends to start, from ``"mpi"`` and ``"nvshmem"``. Default: ``["nvshmem"]`` when a GPU and
            the NVSHMEM/cuFFTMp libraries are present, else ``["mpi"]``.

    Raises:
        RuntimeStateError: already initialized (call :func:`finalize` first).
        BackendUnavailableError: a requested backend cannot run here (on any rank); says what is missing.
    """
    global _owner_pid
    with _lock:
        if _engines:
            raise RuntimeStateError(
                f"dask_pgas is already initialized with backends {sorted(_engines)}; "
                "call dask_pgas.finalize() before initializing again"
            )
        comm = communicator if communicator is not None else _default_communicator()
        if backends is None:
            env = os.environ.get("DASK_PGAS_BACKEND")
            if env:
                backends = [b.strip() for b in env.split(",") if b.strip()]
            else:
                backends = ["nvshmem"] if _unavailable("nvshmem") is None else ["mpi"]
                # every rank must pick the same default
                choices = comm.allgather(tuple(backends))
                if len(set(choices)) > 1:
                    backends = ["mpi"]
        if isinstance(backends, str):
            backends = [backends]
        names = list(dict.fromkeys(backends))
        if not names:
            raise BackendUnavailableError("backends must name at least one of 'mpi', 'nvshmem'")
        problems = {name: _unavailable(name) for name in names}
        local = {k: v for k, v in problems.items() if v}
        everywhere = comm.allgather(local)
        bad = [(rank, name, why) for rank, p in enumerate(everywhere) for name, why in p.items()]
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


def install_engine(engine: Engine) -> None:
    """Register an engine brought up by other means (e.g. NVSHMEM from a unique id handed out by Dask)."""
    global _owner_pid
    with _lock:
        if engine.name in _engines:
            raise RuntimeStateError(f"backend {engine.name!r} is already initialized; call finalize() first")
        _engines[engine.name] = engine
        _owner_pid = os.getpid()


def finalize() -> None:
    """Free every symmetric allocation still registered and tear down the engines (collective)."""
    global _owner_pid
    from .memory import _free_all

    with _lock:
        if not _engines:
            return
        try:
            for engine in _engines.values():
                _free_all(engine)
        finally:
            engines = list(_engines.values())
            _engines.clear()
            _owner_pid = None
            for engine in reversed(engines):
                engine.finalize()


def is_initialized() -> bool:
    return bool(_engines) and _owner_pid == os.getpid()


def initialized_backends() -> tuple[str, ...]:
    return tuple(_engines)


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
    raise BackendUnavailableError(
        f"no initialized backend handles {package} arrays (initialized: {sorted(_engines)}); "
        f"initialize with backends=[{need!r}]"
    )
