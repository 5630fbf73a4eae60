"""Symmetric memory on every rank: allocation rules, the free registry, leaks, finalize, runtime state errors.

Prints ``CASE {json}`` lines (from rank 0, gathered) like bad_inputs.py. Works on any rank count.
"""

from __future__ import annotations

import gc
import warnings

import numpy as np
from _common import COMM, RANK, SIZE, initialize, options, outcome_of, report_case, report_ok

import dask_pgas
from dask_pgas import Reshape, errors
from dask_pgas.distribution import Box
from dask_pgas.reshape import reshape

opts = options()
PKG = opts.package


def case(name, fn, expect=None):
    report_case(name, {**outcome_of(fn), "expect": expect or "none"})


# -- runtime state ----------------------------------------------------------------------------------------------
case("use before initialize", lambda: dask_pgas.allocate_symmetric_memory((2,), PKG), "NotInitializedError")
case("unknown backend", lambda: dask_pgas.initialize(None, COMM, backends=["shmem"]), "UnknownBackendError")
if opts.backend == "mpi":
    # on a machine without a GPU stack (CI) nvshmem must be refused with a reason; with one, skip
    if "nvshmem" not in dask_pgas.available_backends():
        case("unavailable backend", lambda: dask_pgas.initialize(None, COMM, backends=["nvshmem"]),
             "BackendUnavailableError")
initialize(opts)
case("initialize twice", lambda: initialize(opts), "RuntimeStateError")


def dtype_for(name):
    if PKG == "torch":
        import torch

        return getattr(torch, name)
    return name


def _assert_empty():
    usage = dask_pgas.heap_usage()
    assert usage["allocations"] == 0 and usage["bytes"] == 0, usage


# -- allocation ----------------------------------------------------------------------------------------------------
def equal_sizes():
    a = dask_pgas.allocate_symmetric_memory((3, 4), PKG, dtype=dtype_for("float32"))
    b = dask_pgas.allocate_symmetric_memory((5,), PKG, dtype=dtype_for("int64"), axis_order="F")
    assert tuple(a.shape) == (3, 4) and tuple(b.shape) == (5,)
    assert dask_pgas.heap_usage()["allocations"] == 2
    a[...] = 1
    dask_pgas.free_symmetric_memory(a, b)
    assert dask_pgas.heap_usage()["allocations"] == 0


case("equal sizes allocate and free", equal_sizes)


def padded():
    a = dask_pgas.allocate_symmetric_memory((RANK + 1, 2), PKG, make_symmetric=True)
    assert tuple(a.shape) == (RANK + 1, 2)
    itemsize = a.element_size() if PKG == "torch" else a.itemsize  # (the package's default dtype: float32 in torch)
    assert dask_pgas.heap_usage()["bytes"] == SIZE * 2 * itemsize, dask_pgas.heap_usage()
    dask_pgas.free_symmetric_memory(a)


case("make_symmetric pads to the largest", padded)
if SIZE > 1:
    case("different sizes without make_symmetric",
         lambda: dask_pgas.allocate_symmetric_memory((RANK + 1,), PKG), "SymmetricMemoryError")
case("empty allocation", lambda: dask_pgas.free_symmetric_memory(dask_pgas.allocate_symmetric_memory((0, 3), PKG)))


def refused_dtype(dtype):
    """The dtype is checked before the collective allocation: every rank raises and no block is left behind."""
    eng = dask_pgas.runtime.get_engine(opts.backend)
    blocks = (lambda: len(eng._windows)) if opts.backend == "mpi" else (lambda: eng.heap_info()["heap_allocations"])
    before = blocks()
    try:
        dask_pgas.allocate_symmetric_memory((4,), PKG, dtype=dtype)
    finally:
        assert blocks() == before, "a refused allocation left a symmetric block allocated"


case("object dtype is refused before allocating", lambda: refused_dtype(object), "SymmetricMemoryError")
if SIZE > 1:
    case("object dtype on one rank only", lambda: refused_dtype(object if RANK == SIZE - 1 else "float64"),
         "SymmetricMemoryError")


# -- free registry -------------------------------------------------------------------------------------------------
def double_free():
    a = dask_pgas.allocate_symmetric_memory((4,), PKG)
    dask_pgas.free_symmetric_memory(a)
    dask_pgas.free_symmetric_memory(a)


case("double free", double_free, "SymmetricMemoryError")


def view_free():
    a = dask_pgas.allocate_symmetric_memory((4, 4), PKG)
    try:
        dask_pgas.free_symmetric_memory(a[1:])
    finally:
        dask_pgas.free_symmetric_memory(a)


case("free of a view", view_free, "SymmetricMemoryError")


def foreign_free():
    if PKG == "numpy":
        other = np.zeros(4)
    elif PKG == "cupy":
        import cupy

        other = cupy.zeros(4)
    else:
        import torch

        other = torch.zeros(4, device="cuda")
    dask_pgas.free_symmetric_memory(other)


case("free of a foreign array", foreign_free, "NotSymmetricMemoryError")


def one_rank_foreign():
    a = dask_pgas.allocate_symmetric_memory((4,), PKG)
    try:
        dask_pgas.free_symmetric_memory(a if RANK != SIZE - 1 else [1, 2])
    finally:
        dask_pgas.free_symmetric_memory(a)


case("one rank frees something else", one_rank_foreign, "NotSymmetricMemoryError")


def different_allocations():
    a = dask_pgas.allocate_symmetric_memory((4,), PKG)
    b = dask_pgas.allocate_symmetric_memory((4,), PKG)
    try:
        dask_pgas.free_symmetric_memory(a if RANK == 0 else b)
    finally:
        dask_pgas.free_symmetric_memory(a, b)


if SIZE > 1:
    case("ranks free different allocations", different_allocations, "SymmetricMemoryError")


# -- freed operands are refused, never read (on every backend and package) ---------------------------------------
N = 4 * SIZE  # global shape (N, N): column slabs -> row slabs
COL = Box((0, 4 * RANK), (N, 4 * RANK + 4))
ROW = Box((4 * RANK, 0), (4 * RANK + 4, N))


def filled(value):
    a = dask_pgas.allocate_symmetric_memory(COL.box_shape, PKG, dtype=dtype_for("float64"))
    a[...] = value
    return a


def release(*arrays):
    sym = [a for a in arrays if a is not None and dask_pgas.memory.is_symmetric_memory(a)]
    if sym:
        dask_pgas.free_symmetric_memory(*sym)


def reshape_of_freed(ranks, view=False):
    """After a free, a new allocation of the same size may take the freed memory's address: reshape() read it
    when given a view of the freed array. The ranks in ``ranks`` pass the freed array (or a view of a view of it);
    the others a live one."""
    a = filled(1.0)
    v = a.T.T if view else a
    live = filled(2.0)
    dask_pgas.free_symmetric_memory(a)
    junk = filled(-5.0)  # may take the freed memory's place
    b = None
    try:
        b = reshape(v if RANK in ranks else live, COL, ROW)
    finally:
        release(live, junk, b)


def execute_after_operand_freed(view):
    """The same for a planned Reshape whose operand (or the allocation its view operand looks into) is freed."""
    a = filled(1.0)
    r = Reshape(a.T.T if view else a, COL, ROW)
    r.plan()
    dask_pgas.free_symmetric_memory(a)
    junk = filled(-5.0)
    b = None
    try:
        b = r.execute()
    finally:
        r.free()
        release(junk, b)


case("reshape of a freed symmetric operand", lambda: reshape_of_freed(set(range(SIZE))), "SymmetricMemoryError")
case("reshape of a view of a freed symmetric array", lambda: reshape_of_freed(set(range(SIZE)), True),
     "SymmetricMemoryError")
case("execute after its symmetric operand was freed", lambda: execute_after_operand_freed(False),
     "SymmetricMemoryError")
case("execute after a view operand's allocation was freed", lambda: execute_after_operand_freed(True),
     "SymmetricMemoryError")
if SIZE > 1:
    case("reshape of a freed symmetric operand on one rank", lambda: reshape_of_freed({1}), "SymmetricMemoryError")
    case("reshape of a view of a freed symmetric array on one rank", lambda: reshape_of_freed({1}, True),
         "SymmetricMemoryError")


def result_padded_to_the_largest_output_box():
    """A symmetric operand's result is symmetric memory of the same byte size on every rank (the largest output
    box), also where this rank's output box is smaller or empty: rank 0 gathers the whole array."""
    a = filled(float(RANK))
    b = None
    try:
        b = reshape(a, COL, Box((0, 0), (N, N)) if RANK == 0 else Box((N, N), (N, N)))
        rec = dask_pgas.memory._live[dask_pgas.memory._allocation_of(b)]
        sizes = COMM.allgather(rec.allocation.nbytes)
        assert sizes == [N * N * 8] * SIZE, sizes
    finally:
        release(a, b)


case("a symmetric result is padded to the largest output box", result_padded_to_the_largest_output_box)
case("no symmetric memory left after the freed-operand cases", _assert_empty)


def heap_usage_while_a_peer_is_late():
    """heap_usage() is local: it answers while this rank's allocation waits for a late peer (a Dask worker
    asks it on its event loop while its collective thread allocates)."""
    import threading
    import time

    held, took, usage = [], 0.0, {"allocations": 0}
    if RANK == 0:
        time.sleep(1.5)
        held.append(dask_pgas.allocate_symmetric_memory((4,), PKG))
    else:
        thread = threading.Thread(target=lambda: held.append(dask_pgas.allocate_symmetric_memory((4,), PKG)))
        thread.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        usage = dask_pgas.heap_usage()
        took = time.monotonic() - t0
        thread.join()
    dask_pgas.free_symmetric_memory(*held)  # (on every rank before any check can raise)
    assert took < 0.5 and usage["allocations"] == 0, f"heap_usage() waited {took:.2f}s and saw {usage}"


if SIZE > 1 and opts.backend == "mpi":  # (the allocating thread would need the GPU context on nvshmem)
    case("heap_usage does not wait for a collective in flight", heap_usage_while_a_peer_is_late)


def leak_reported():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = dask_pgas.allocate_symmetric_memory((8,), PKG)
        del a
        gc.collect()
    kinds = [w.category for w in caught]
    assert errors.SymmetricMemoryLeakWarning in kinds, kinds
    usage = dask_pgas.heap_usage()
    assert usage["allocations"] == 1 and usage["collected_unfreed"] == 1, usage


case("garbage-collected allocation is reported, not freed", leak_reported)


def finalize_while_in_use(keep):
    """finalize() would free memory that arrays still point into (the next access crashed the process):
    every rank refuses, finalizing nothing, when any rank keeps such an array or a view of one."""
    a = dask_pgas.allocate_symmetric_memory((8,), PKG)
    a[...] = RANK + 1
    held = None
    if keep == "array" or (keep == "view on rank 0" and RANK == 0):
        held = a if keep == "array" else a[2:5]
    del a
    try:
        dask_pgas.finalize()
    finally:
        assert dask_pgas.is_initialized()
        if held is not None:
            count = held.numel() if PKG == "torch" else held.size
            assert float(held.sum()) == (RANK + 1) * count  # still readable
        if keep == "array":
            dask_pgas.free_symmetric_memory(held)


case("finalize refuses while a symmetric array is in use", lambda: finalize_while_in_use("array"),
     "SymmetricMemoryError")
case("finalize refuses while one rank keeps a view", lambda: finalize_while_in_use("view on rank 0"),
     "SymmetricMemoryError")
gc.collect()  # (the view is gone: its allocation was garbage collected unfreed, with the one of leak_reported)
dask_pgas.finalize()  # frees the leaked allocations collectively
case("finalize freed what was left", lambda: _assert_empty())
initialize(opts)
case("heap empty after re-initialize", _assert_empty)
dask_pgas.finalize()
dask_pgas.finalize()  # idempotent
report_ok()
