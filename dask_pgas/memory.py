"""Symmetric memory: collective allocation and free, and the registry that catches misuse.

Every allocation is recorded (in allocation order, which is the same on every rank because allocation is
collective). ``free_symmetric_memory`` refuses double frees, views and foreign arrays on every rank together.
An array dropped by the garbage collector without a free is reported (:class:`SymmetricMemoryLeakWarning`) and
stays allocated until :func:`dask_pgas.finalize`: freeing is collective and never runs from ``__del__``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import operator
import os
import sys
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._arrays import array_info, package_name, package_of, to_numpy_dtype
from .engines.base import Allocation, Engine
from .errors import (
    BackendUnavailableError,
    NotSymmetricMemoryError,
    PackageUnavailableError,
    SymmetricMemoryError,
    carried_name,
    warn_leak,
)
from .runtime import _control_plane, engine_for_package

__all__ = ["allocate_symmetric_memory", "free_symmetric_memory", "heap_usage", "is_symmetric_memory"]

logger = logging.getLogger("dask_pgas.memory")


@dataclass(eq=False)
class _Record:
    seq: int  # this process's key of the record
    number: int  # the allocation's number in its world: the same on every rank (compared across ranks)
    engine: Engine
    allocation: Allocation
    ref: weakref.ref  # the array allocate_symmetric_memory returned (what free_symmetric_memory takes)
    desc: str
    keep: weakref.ref  # lives exactly as long as the memory is referenced (see _register)
    origin: tuple[str, int] | None = None  # the caller's line that allocated it (the leak warning points there)
    collected: bool = False
    left_to_process: bool = False  # its owner gave it up on purpose (see left_to_process): no leak warning


#: attributes the GPU engine sets on the torch tensors it makes (its storage's keeper, an empty tensor's root)
_ENGINE_ATTRS = ("_dask_pgas_keeper", "_dask_pgas_root")

_lock = threading.RLock()
_seq = itertools.count()
_live: dict[int, _Record] = {}  # seq -> record, in allocation order
_by_id: dict[int, int] = {}  # id(array) -> seq (checked against the weakref)
_freed: dict[int, weakref.ref] = {}  # id(array) -> weakref, to name double frees


def _agree(control, error: str | None, payload: Any = None) -> list[Any]:
    """Allgather ``(error, payload)``; raise the first rank's error on every rank.

    ``error`` is a message (raised as :class:`SymmetricMemoryError`) or a pair ``(class name, message)`` for
    the few classes that keep their own type (:data:`_KEEP`)."""
    everything = control.allgather((error, payload))
    for rank, (err, _) in enumerate(everything):
        if err is not None:
            name, msg = err if isinstance(err, tuple) else ("", err)
            raise _KEEP.get(name, SymmetricMemoryError)(f"rank {rank}: {msg}")
    return [p for _, p in everything]


#: local errors raised with their own class on every rank (the others become SymmetricMemoryError)
_KEEP: dict[str, type[Exception]] = {cls.__name__: cls for cls in (BackendUnavailableError, PackageUnavailableError,
                                                                     NotSymmetricMemoryError)}
_MISUSE, _NOT_SYMMETRIC = SymmetricMemoryError.__name__, NotSymmetricMemoryError.__name__  # (_lookup's classes)


def _normalize_shape(shape: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(shape, int) or (hasattr(shape, "__index__") and getattr(shape, "ndim", 0) == 0):
        shape = (shape,)  # (an integer, or a 0-d integer array; a 1-d NumPy array is a sequence of sizes)
    out = tuple(operator.index(n) for n in shape)
    if any(n < 0 for n in out):
        raise ValueError(f"negative dimension in shape {out}")
    return out


def _normalize_axis_order(axis_order: Any, ndim: int) -> tuple[str, tuple[int, ...] | None]:
    """``("C" | "F", None)``, or ``("C", axes)`` for another permutation: allocate C order over the axes listed
    slowest first (``axes``), then transpose them back into place.

    A sequence follows ``nvmath.distributed.allocate_symmetric_memory``: the axes from the fastest varying
    (contiguous) to the slowest, so ``(1, 0)`` is C order and ``(0, 1)`` Fortran order of a matrix."""
    if axis_order is None:
        return "C", None
    if isinstance(axis_order, str):
        if axis_order not in ("C", "F"):
            raise ValueError(f"axis_order must be 'C', 'F' or a permutation of the axes, not {axis_order!r}")
        return axis_order, None
    try:
        order = tuple(operator.index(a) for a in axis_order)
    except TypeError:
        raise ValueError(
            f"axis_order must be 'C', 'F' or a permutation of the axes, not {axis_order!r}"
        ) from None
    if sorted(order) != list(range(ndim)):
        raise ValueError(
            f"axis_order {order} is not a permutation of the {ndim} axes {tuple(range(ndim))} (fastest varying "
            "axis first, as in nvmath.distributed)"
        )
    if order == tuple(reversed(range(ndim))):
        return "C", None
    if order == tuple(range(ndim)):
        return "F", None
    return "C", order[::-1]


def _default_dtype(pkg: str) -> Any:
    """The package's default element type, as nvmath: float64 for NumPy and CuPy, torch.get_default_dtype()."""
    if pkg == "torch":
        import torch

        return torch.get_default_dtype()
    return "float64"


def allocate_symmetric_memory(
    shape: int | Sequence[int],
    package: Any,
    *,
    dtype: Any = None,
    axis_order: str | Sequence[int] | None = "C",
    make_symmetric: bool = False,
    skip_symmetric_check: bool = False,
    logger: logging.Logger | None = None,
) -> Any:
    """Allocate an array of ``package`` on the symmetric heap of every rank (collective).

    Args:
        shape: local shape on this rank.
        package: ``numpy`` (``"mpi"`` backend), ``cupy`` or ``torch`` (``"nvshmem"`` backend); module or name.
        dtype: element type (default: the package's, float64 for NumPy/CuPy, ``torch.get_default_dtype()``).
        axis_order: ``"C"``, ``"F"`` or a permutation of the axes listing them from the fastest varying to the
            slowest, as in nvmath (``(1, 0)`` is C order, ``(0, 1)`` Fortran order of a matrix; other
            permutations give an array that is neither C nor F contiguous).
        make_symmetric: pad every rank's allocation to the largest request. Without it, different byte sizes on
            different ranks raise :class:`SymmetricMemoryError` on every rank.
        skip_symmetric_check: accepted for nvmath compatibility: no error for different sizes on different
            ranks. dask_pgas still exchanges the sizes (one small allgather) and pads to the largest, so the
            allocation stays symmetric and collective. Cannot be combined with ``make_symmetric=True``.

    Every argument is checked on every rank and the findings exchanged before anything is allocated: bad input
    on one rank (an unknown package, a bad dtype or shape, ``make_symmetric`` or the backend differing between
    ranks) raises the same exception on every rank and allocates nothing.

    The array must be released with :func:`free_symmetric_memory` on every rank.
    """
    log = logger or globals()["logger"]
    control = _control_plane()  # the same control plane on every rank, whatever package each rank asked for
    error: Any = None
    engine, nbytes, desc, dims, pkg, order, axes = None, 0, "", (), "", "C", None
    flags = (bool(make_symmetric), bool(skip_symmetric_check))
    try:
        pkg = package_name(package)
        engine = engine_for_package(pkg, allocation=True)
        dims = _normalize_shape(shape)
        if dtype is None:
            dtype = _default_dtype(pkg)
        np_dtype = to_numpy_dtype(dtype)
        engine.check_dtype(dtype, pkg)  # before the collective allocate: a bad dtype leaks nothing
        order, axes = _normalize_axis_order(axis_order, len(dims))
        if make_symmetric and skip_symmetric_check:
            raise ValueError("skip_symmetric_check=True cannot be combined with make_symmetric=True")
        nbytes = math.prod(dims) * np_dtype.itemsize
        desc = f"{pkg} {dims} {np_dtype}"
    except BackendUnavailableError as exc:  # reported to all ranks, never raised alone
        error = (carried_name(type(exc), _KEEP), str(exc))
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    with _lock:
        control.agree(None, "allocate_symmetric_memory()")  # every rank is in this call, or all raise
        everything = _agree(control, error, (nbytes, flags, engine.name if engine else None))
        sizes = [n for n, _, _ in everything]
        if len({f for _, f, _ in everything}) > 1:
            by_rank = "; ".join(f"rank {r}: make_symmetric={f[0]} skip_symmetric_check={f[1]}"
                                for r, (_, f, _) in enumerate(everything))
            raise SymmetricMemoryError(
                f"ranks passed different make_symmetric/skip_symmetric_check ({by_rank}); pass the same values "
                "on every rank"
            )
        if len({e for _, _, e in everything}) > 1:
            by_rank = "; ".join(f"rank {r}: {e}" for r, (_, _, e) in enumerate(everything))
            raise SymmetricMemoryError(
                f"ranks asked for arrays of packages served by different backends ({by_rank}); every rank must "
                "allocate from the same backend"
            )
        if len(set(sizes)) > 1:
            if not (make_symmetric or skip_symmetric_check):
                raise SymmetricMemoryError(
                    f"ranks asked for different sizes {sizes} (bytes, by rank); pass make_symmetric=True to pad "
                    "every allocation to the largest"
                )
            log.debug("symmetric allocation padded from %d to %d bytes on this rank", nbytes, max(sizes))
        assert engine is not None  # every rank found one, or _agree raised
        allocation = engine.allocate(max(sizes))
        array, error = None, None
        try:
            base_shape = dims if axes is None else tuple(dims[a] for a in axes)
            array = engine.as_array(allocation, base_shape, dtype, pkg, order)
            if axes is not None:  # each base axis back to its place: the inverse permutation
                back = tuple(int(a) for a in np.argsort(axes))
                base, array = array, array.permute(*back) if pkg == "torch" else array.transpose(back)
                for attr in _ENGINE_ATTRS:  # what the engine noted on its tensor goes to the one returned
                    if hasattr(base, attr):
                        setattr(array, attr, getattr(base, attr))
        except Exception as exc:  # agreed before the collective free: no rank frees alone
            error = f"{type(exc).__name__}: {exc}"
        if bad := control.agree(error):
            engine.free(allocation)
            raise SymmetricMemoryError(f"rank {bad[0][0]}: {bad[0][1]}")
        _register(engine, allocation, array, desc)
    log.debug("allocated symmetric %s (%d bytes on every rank)", desc, allocation.nbytes)
    return array


def _register(engine: Engine, allocation: Allocation, array: Any, desc: str) -> None:
    """Record a new allocation. Its keeper lives as long as anything references the memory: for NumPy and CuPy
    the array the engine made (every view keeps that base), for torch the object its storage holds, which the
    engine notes on the tensor (a view keeps only the storage: the tensor returned can die while a slice of it
    is in use)."""
    keeper = getattr(array, "_dask_pgas_keeper", None)
    if keeper is None:
        *_, keeper = _chain(array)
    seq = next(_seq)
    rec = _Record(seq, _control_plane().number("allocation"), engine, allocation, weakref.ref(array), desc,
                  weakref.ref(keeper), _caller())
    _live[seq] = rec
    _by_id[id(array)] = seq
    weakref.finalize(keeper, _collected, seq)


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _caller() -> tuple[str, int] | None:
    """(file, line) of the innermost frame outside this package: where the user's code allocated."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
    return None if frame is None else (frame.f_code.co_filename, frame.f_lineno)


def left_to_process(*arrays: Any) -> None:
    """Local: these arrays (as :func:`allocate_symmetric_memory` returned them; anything else is ignored) go with
    the process, unfreed, on purpose. For an owner that shuts down alone and so cannot free collectively (a
    Dask worker closing: workers close one at a time): they are not reported as leaks when collected, or at
    exit. Takes no lock (as :func:`heap_usage`): the allocator holds it while it waits for the other ranks, and
    a closing worker must not wait for a collective that may never end."""
    for array in arrays:
        seq = _by_id.get(id(array))
        rec = _live.get(seq) if seq is not None else None
        if rec is not None and rec.ref() is array:
            rec.left_to_process = True


def _collected(seq: int) -> None:
    rec = _live.get(seq)
    if rec is None:  # freed properly
        return
    rec.collected = True
    if rec.left_to_process:
        return
    warn_leak(
        f"symmetric memory ({rec.desc}, {rec.allocation.nbytes} bytes) was garbage collected without "
        "free_symmetric_memory(); it stays allocated until dask_pgas.finalize()",
        rec.origin,
    )


def _chain(array: Any):
    """``array`` and the arrays it is a view of, outermost first (NumPy's and CuPy's ``base``, torch's ``_base``)."""
    while array is not None:
        yield array
        base = getattr(array, "_base" if package_of(array) == "torch" else "base", None)
        array = base if base is not None and package_of(base) is not None else None


def _was_freed(array: Any) -> bool:
    """Whether ``array`` was returned by :func:`allocate_symmetric_memory` and freed since, or is a view of such
    an array: its memory is gone, or belongs to a later allocation at the same address (local)."""
    for a in _chain(array):
        ref = _freed.get(id(a))
        if ref is not None and ref() is a:
            return True
    return False


def _lookup(array: Any) -> tuple[_Record | None, tuple[str, str] | None]:
    """The live allocation whose memory ``array`` is (or views), and why ``array`` cannot be freed, as a ``(class
    name, message)`` error of :func:`_agree` (None when it is the array :func:`allocate_symmetric_memory`
    returned; :class:`NotSymmetricMemoryError`, a ``TypeError`` too as nvmath's, for a non-array or an array
    not on the heap). Local."""
    seq = _by_id.get(id(array))
    if seq is not None:
        rec = _live.get(seq)
        if rec is not None and rec.ref() is array:
            return rec, None
    if _was_freed(array):
        return None, (_MISUSE, "this array was already freed (double free)")
    if package_of(array) is None:
        return None, (_NOT_SYMMETRIC, f"expected an array returned by allocate_symmetric_memory, got "
                      f"{type(array).__name__}")
    rec = _record_at(array_info(array).ptr)
    if rec is not None:
        return rec, (_MISUSE, f"the array is a view of symmetric memory ({rec.desc}); free the array that "
                     "allocate_symmetric_memory returned")
    return None, (_NOT_SYMMETRIC, "the array was not allocated by dask_pgas.allocate_symmetric_memory")


def _record_at(ptr: int) -> _Record | None:
    """The live (non-empty) allocation whose memory holds address ``ptr``, or None. Local."""
    for rec in _live.values():
        lo = rec.allocation.ptr
        if rec.allocation.nbytes and lo <= ptr < lo + rec.allocation.nbytes:
            return rec
    return None


def _heap_position(array: Any) -> tuple[int, int] | None:
    """Where ``array``'s data starts in symmetric memory: (allocation number, byte offset in it), numbers that
    are the same on every rank for the same place (allocations are collective); None when it is empty (never
    read: there is nothing to place) or in no live allocation. Local."""
    try:
        info = array_info(array)
    except Exception:
        return None
    if not info.nbytes:
        return None
    with _lock:
        rec = _record_at(info.ptr)
    return None if rec is None else (rec.number, info.ptr - rec.allocation.ptr)


def is_symmetric_memory(array: Any) -> bool:
    """Whether ``array`` is (a view into) memory from :func:`allocate_symmetric_memory`; local, not collective."""
    return _allocation_of(array) is not None


def _allocation_of(array: Any) -> int | None:
    """Local: the registry key of the live allocation that holds ``array`` (the array
    :func:`allocate_symmetric_memory` returned, or a view into its memory), or None. A caller that keeps the key
    can tell later whether that allocation is still live (:func:`_is_live`), also when a new allocation has
    taken its address since."""
    with _lock:
        rec, _ = _lookup(array)
    return None if rec is None else rec.seq


def _is_live(seq: int) -> bool:
    return seq in _live


def _in_use() -> str | None:
    """Local, at finalize: the registered allocations whose arrays are still referenced (finalize would free
    their memory under them: the next access would crash the process), or None. A view keeps its NumPy base
    array, and so its allocation, referenced."""
    # (an engine broken by a device error frees nothing at finalize: its arrays keep their memory)
    if not any(rec.keep() is not None and not rec.engine.broken for rec in list(_live.values())):
        return None
    import gc

    gc.collect()  # arrays left only in unreachable cycles are not in use
    with _lock:
        used = [rec.desc for rec in _live.values() if rec.keep() is not None and not rec.engine.broken]
    if not used:
        return None
    return (f"{len(used)} symmetric array(s) still in use ({', '.join(used)}): free them with "
            "free_symmetric_memory() before finalize() (a Reshape whose symmetric operand was not freed keeps it)")


def free_symmetric_memory(*arrays: Any) -> None:
    """Free arrays allocated by :func:`allocate_symmetric_memory` (collective: every rank passes its own
    arrays of the same allocations, in the same order).

    Raises :class:`SymmetricMemoryError` on every rank, freeing nothing, when any rank passes a view, an array
    freed before, or a different set of allocations; its subclass :class:`NotSymmetricMemoryError` (also a
    ``TypeError``, as nvmath's for a CPU array) for an array not allocated here, or an object that is no array.
    """
    with _lock:
        control = _control_plane()
        records, error = [], None
        for i, array in enumerate(arrays):
            try:
                rec, err = _lookup(array)
            except Exception as exc:  # reported to all ranks, never raised alone
                rec, err = None, (_MISUSE, f"{type(exc).__name__}: {exc}")
            if err is not None:
                error = (err[0], f"argument {i}: {err[1]}")
                break
            records.append(rec)
        if error is None and len({r.seq for r in records}) != len(records):
            error = "the same array is passed twice"
        control.agree(None, "free_symmetric_memory()")  # every rank is in this call, or all raise
        seqs = _agree(control, error, [r.number for r in records])
        if len({tuple(s) for s in seqs}) > 1:
            raise SymmetricMemoryError(
                f"ranks free different allocations (allocation numbers by rank: {seqs}); every rank must free "
                "its arrays of the same allocations in the same order"
            )
        for i, (rec, array) in enumerate(zip(records, arrays)):
            _forget_as_freed(rec, array)
            try:
                rec.engine.free(rec.allocation)
            except BaseException:
                # a device error (raised on every rank: the engine is broken for good) leaves none of the broken
                # engine's arrays of this call registered: they can never be freed, and finalize() must not wait
                # for them; the others stay registered, to be freed again
                for later, other in zip(records[i + 1:], arrays[i + 1:]):
                    if later.engine.broken:
                        _forget_as_freed(later, other)
                raise


def _forget_as_freed(rec: _Record, array: Any) -> None:
    _forget(rec)
    for a in _chain(array):  # (views of it may name it, or only an array it was made from)
        _freed[id(a)] = weakref.ref(a, functools.partial(_drop_freed, id(a)))


def _drop_freed(key: int, _ref: weakref.ref) -> None:
    _freed.pop(key, None)


def _forget(rec: _Record) -> None:
    _live.pop(rec.seq, None)
    arr = rec.ref()
    if arr is not None and _by_id.get(id(arr)) == rec.seq:
        del _by_id[id(arr)]


def _allocate_internal(engine: Engine, padded_nbytes: int, shape: Sequence[int], dtype: Any, package: str,
                       order: str) -> Any:
    """Symmetric allocation made by the library itself (a reshape result): ``padded_nbytes`` on every rank, a
    size every caller knows globally (no exchange), viewed as this rank's ``shape``."""
    dims = tuple(shape)
    with _lock:
        allocation = engine.allocate(padded_nbytes)
        try:
            array = engine.as_array(allocation, dims, dtype, package, order)
        except BaseException:  # the arguments are the same on every rank (a spec all agreed on): so is this
            engine.free(allocation)
            raise
        _register(engine, allocation, array, f"{package} {dims} {to_numpy_dtype(dtype)}")
    return array


def _free_all(engine: Engine) -> None:
    """Collective, at finalize: free what is left of ``engine``'s allocations, in allocation order."""
    with _lock:
        left = [rec for rec in _live.values() if rec.engine is engine]
        for rec in left:  # forgotten first: a free that raises (a device error, on every rank) leaves none behind
            _forget(rec)
        if engine.broken:  # nothing can be freed (every rank alike): the blocks stay, as the engine's finalize says
            return
        if left:
            logger.warning(
                "finalize() frees %d symmetric allocation(s) never freed explicitly: %s",
                len(left), ", ".join(r.desc for r in left),
            )
        for rec in left:
            engine.free(rec.allocation)


def heap_usage(backend: str | None = None) -> dict[str, int]:
    """Live symmetric allocations of this rank: count, bytes, how many were garbage collected unfreed, plus
    (with ``backend``) the engine's own figures, for example the NVSHMEM heap size. Local; works before
    ``initialize`` and after ``finalize`` too (then everything is zero)."""
    from .runtime import _engines as engines

    # A snapshot without _lock: allocate and free hold it across their agreements, which wait for the other
    # ranks, and this local call (a Dask worker's info handler, on its event loop) must not wait with them.
    recs = [r for r in list(_live.values()) if backend is None or r.engine.name == backend]
    out = {
        "allocations": len(recs),
        "bytes": sum(r.allocation.nbytes for r in recs),
        "collected_unfreed": sum(r.collected for r in recs),
    }
    if backend is not None and backend in engines:
        out.update(engines[backend].heap_info())
    return out
