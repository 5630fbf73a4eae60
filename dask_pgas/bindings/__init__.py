"""ctypes bindings of the C libraries the GPU engine needs, loaded lazily (nothing loads at import).

* :mod:`.cuda`: the few CUDA driver calls (``libcuda.so.1``) the engine needs (device selection, copies);
* :mod:`.nvshmem`: the NVSHMEM host API (``libnvshmem_host.so.3`` from ``nvidia-nvshmem-cu12``/``-cu13``);
* :mod:`.cufftmp`: cuFFTMp's reshape (``libcufftMp.so.11``/``.12`` from ``nvidia-cufftmp-cu12``/``-cu13``).

These are the only modules of dask_pgas that import :mod:`ctypes`. Every loader raises
:class:`LibraryNotFound` (an ImportError) naming the missing library or symbol, and for the wheels' libraries the
package extra that provides it.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["LazyLibrary", "LibraryNotFound", "extra_hint", "find_in_site_packages", "open_library"]

T = TypeVar("T")


class LibraryNotFound(ImportError):
    """A shared library (or one of its symbols) the GPU engine needs is not installed."""


def extra_hint() -> str:
    """How to install the GPU libraries: the wheels of the ``cuda13`` / ``cuda12`` extras (dask_pgas itself is
    not on PyPI, so ``dask_pgas[cuda13]`` works only from a checkout)."""
    return ("install the GPU wheels of your CUDA major: pip install cupy-cuda13x nvidia-nvshmem-cu13 "
            "nvidia-cufftmp-cu13 (CUDA 13) or cupy-cuda12x nvidia-nvshmem-cu12 nvidia-cufftmp-cu12 (CUDA 12); "
            'from a checkout: pip install -e ".[cuda13]"')


def find_in_site_packages(relpaths: list[str], env: str | None = None) -> str | None:
    """First existing file among ``relpaths`` under any ``sys.path`` entry (or the path in ``$env``)."""
    if env and os.environ.get(env):
        return os.path.realpath(os.environ[env])
    for base in sys.path:
        if not base or not os.path.isdir(base):
            continue
        for rel in relpaths:
            cand = os.path.join(base, rel)
            if os.path.exists(cand):
                # the real path: the same library reached through a symlinked folder must not load twice
                return os.path.realpath(cand)
    return None


class LazyLibrary(Generic[T]):
    """A library wrapper built on first call, once per process (thread-safe); ``reset()`` forgets it (tests)."""

    def __init__(self, factory: Callable[[str], T], find: Callable[[], str | None], missing: str) -> None:
        self._factory, self._find, self._missing = factory, find, missing
        self._lock = threading.Lock()
        self._instance: T | None = None

    def __call__(self) -> T:
        with self._lock:
            if self._instance is None:
                path = self._find()
                if path is None:
                    raise LibraryNotFound(f"{self._missing}; {extra_hint()}")
                self._instance = self._factory(path)
            return self._instance

    def reset(self) -> None:
        with self._lock:
            self._instance = None


def open_library(path: str, mode: int, what: str, signatures: dict, need: str) -> ctypes.CDLL:
    """``ctypes.CDLL(path, mode)`` with ``restype``/``argtypes`` set from ``signatures`` (name -> (restype,
    argtypes)); a library that does not load or lacks a symbol raises :class:`LibraryNotFound` naming it."""
    try:
        lib = ctypes.CDLL(path, mode=mode)
    except OSError as exc:
        raise LibraryNotFound(f"cannot load {what} {path}: {exc}; {extra_hint()}") from None
    for name, (restype, argtypes) in signatures.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise LibraryNotFound(f"symbol {name} is missing from {path}: {need} ({extra_hint()})") from None
        fn.restype, fn.argtypes = restype, argtypes
    return lib
