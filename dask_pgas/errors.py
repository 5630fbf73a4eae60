"""Exception hierarchy of dask_pgas.

Every class subclasses a builtin (so ``except ValueError`` keeps working), is picklable (Dask ships errors from
workers to clients), and every message says what to do about it.
"""

from __future__ import annotations

import warnings
from collections.abc import Container

__all__ = [
    "BackendUnavailableError",
    "CollectiveError",
    "CollectiveMismatchError",
    "ConvertDistributionError",
    "DeviceError",
    "DistributionError",
    "NotInitializedError",
    "NotSymmetricMemoryError",
    "OperandMismatchError",
    "PGASError",
    "PGASRechunkUnsupported",
    "PGASWorldError",
    "PackageUnavailableError",
    "RuntimeStateError",
    "SymmetricMemoryError",
    "SymmetricMemoryLeakWarning",
    "UnknownBackendError",
    "UnsupportedOperandError",
]


class PGASError(Exception):
    """Base class of every error raised by dask_pgas."""


class NotInitializedError(PGASError, RuntimeError):
    """The PGAS runtime is used before ``dask_pgas.initialize()``."""


class RuntimeStateError(PGASError, RuntimeError):
    """The runtime is in the wrong state for the call (initialized twice, used after finalize, ...)."""


class BackendUnavailableError(PGASError, RuntimeError):
    """A requested backend cannot be used on this machine (library or device missing)."""


class UnknownBackendError(BackendUnavailableError, ValueError):
    """``backends`` names no backend of dask_pgas (or none at all); a ``ValueError``, as nvmath raises there."""


class PackageUnavailableError(BackendUnavailableError, ValueError):
    """No initialized backend takes arrays of this package (NumPy symmetric memory on a world of ``"nvshmem"``
    alone, CuPy on one of ``"mpi"`` alone); a ``ValueError``, as nvmath's refusal of a package it does not take."""


class DistributionError(PGASError, ValueError):
    """Boxes that do not describe a valid distribution (overlap, holes, mismatched domains or dimensions)."""


class ConvertDistributionError(DistributionError):
    """A distribution cannot be converted to the type asked for (``Distribution.to``), as nvmath's error of that
    name; a ``ValueError``."""


class UnsupportedOperandError(PGASError, TypeError):
    """An operand of a type, dtype, layout or memory kind the engine cannot use."""


class OperandMismatchError(UnsupportedOperandError, ValueError):
    """An operand whose shape or dtype does not match the plan's, whose dtype, package or GPU memory layout
    differs from the other ranks' operands, or whose shape or dtype was changed in place since the plan took it. A
    ``ValueError``, as ``nvmath.distributed`` raises there (and, as before, an :class:`UnsupportedOperandError`)."""


class SymmetricMemoryError(PGASError, ValueError):
    """Misuse of symmetric memory: double free, free of a view, mismatched sizes (a foreign array:
    :class:`NotSymmetricMemoryError`)."""


class NotSymmetricMemoryError(SymmetricMemoryError, TypeError):
    """A GPU operand that is not on the symmetric heap, or a ``free_symmetric_memory`` argument that is not an
    array from :func:`~dask_pgas.allocate_symmetric_memory`; also a ``TypeError``, as nvmath raises there."""


class CollectiveError(PGASError, RuntimeError):
    """A collective operation failed on one or more ranks (raised on every rank)."""


class CollectiveMismatchError(CollectiveError):
    """Ranks entered different collective calls (or the same call on different objects); raised on every rank of
    the mismatch instead of pairing the calls' unrelated exchanges.

    ``calls``: each rank's call, in rank order (None for a rank inside a step of a call), when the calls
    differ; None when the same call got different arguments."""

    calls: tuple[str | None, ...] | None = None


class DeviceError(CollectiveError):
    """A PE's CUDA context holds an error that does not go away (a kernel's illegal address is sticky), found
    before a collective step and raised on every rank (with an MPI control plane; in a world brought up from a
    unique id the broken PE fails alone, in the agreement's own device copy: see docs/design.md). The world
    cannot be used any more: every later collective call of its engine raises this too, ``finalize()`` releases
    nothing on the device, and the processes must restart to use their GPUs again."""


class SymmetricMemoryLeakWarning(UserWarning):
    """A symmetric allocation was garbage collected without ``free_symmetric_memory``.

    Shown by default (not a ``ResourceWarning``, which Python hides): the memory stays allocated until
    ``finalize()``, and a heap is small. It points at the line that allocated the memory."""


def carried_name(cls: type[BaseException], kept: Container[str]) -> str:
    """The name under which a local error of class ``cls`` travels to the other ranks: the first class of its MRO
    whose name the receiving side raises as such (``kept``), else its own name (which the receiver raises as its
    fallback class). A subclass thus arrives as its nearest kept base, not as the fallback."""
    return next((c.__name__ for c in cls.__mro__ if c.__name__ in kept), cls.__name__)


def warn_leak(message: str, origin: tuple[str, int] | None) -> None:
    """Warn from a finalizer, where no caller's frame means anything: at ``origin`` (file, line) instead."""
    if origin is None:
        warnings.warn(message, SymmetricMemoryLeakWarning, stacklevel=2)
    else:  # (no registry: every leaked allocation is reported, not only the first of its line)
        warnings.warn_explicit(message, SymmetricMemoryLeakWarning, origin[0], origin[1])


# -- the Dask integration's


class PGASWorldError(CollectiveError):
    """The cluster has no usable PGAS world: never bootstrapped, a member left, or a collective failed."""


class PGASRechunkUnsupported(PGASError, NotImplementedError):
    """A rechunk the collective path cannot do (and config ``pgas.fallback`` is ``"raise"``)."""
