"""Each bad input must raise the same exception on every rank, and leave the world usable.

Prints one ``CASE {json}`` line per rank and case (the exception's class and message, or "none"); the pytest
side checks that every rank raised the same. After each case a valid reshape proves nobody is stuck.
Needs >= 2 ranks.
"""

from __future__ import annotations

import numpy as np
from _common import COMM, RANK, SIZE, initialize, options, outcome_of, report_case, report_ok

import dask_pgas
from dask_pgas.distribution import Box, Slab
from dask_pgas.reshape import reshape

opts = options()
assert SIZE >= 2, "bad_inputs needs at least 2 ranks"
initialize(opts)
GPU = opts.package != "numpy"
N = 4 * SIZE  # global shape (N, N): column slabs -> row slabs


def col(rank=RANK):
    return Box((0, 4 * rank), (N, 4 * rank + 4))


def row(rank=RANK):
    return Box((4 * rank, 0), (4 * rank + 4, N))


def operand(shape, dtype="float64", symmetric=GPU):
    if symmetric:
        dt = dtype
        if opts.package == "torch":
            import torch

            dt = getattr(torch, np.dtype(dtype).name)
        return dask_pgas.allocate_symmetric_memory(shape, opts.package, dtype=dt, make_symmetric=True)
    return np.zeros(shape, dtype=dtype)


def release(*arrays):
    sym = [a for a in arrays if dask_pgas.memory.is_symmetric_memory(a)]
    if sym:
        dask_pgas.free_symmetric_memory(*sym)


def case(name, fn):
    report_case(name, outcome_of(fn))
    # the world still works: a valid reshape right after
    a = operand(col().box_shape)
    b = reshape(a, col(), row())
    ok = b.shape == row().box_shape
    release(a, b)
    assert COMM.allreduce(ok), "world broken after case " + name


def run(a, ibox, obox):
    try:
        b = reshape(a, ibox, obox)
        release(b)
    finally:
        release(a)


case("dimensionality differs across ranks", lambda: run(
    operand((N, 4)) if RANK else operand((N, 4, 1)),
    col() if RANK else Box((0, 0, 0), (N, 4, 1)),
    row() if RANK else Box((0, 0, 0), (4, N, 1)),
))
case("input and output box dimensionality differ", lambda: run(
    operand(col().box_shape), col(), Box((4 * RANK, 0, 0), (4 * RANK + 4, N, 1)) if RANK == SIZE - 1 else row()
))
case("operand shape differs from its input box", lambda: run(
    operand((N, 3) if RANK == 1 else (N, 4)), col(), row()
))
case("input boxes overlap", lambda: run(
    operand((N, 5) if RANK == 0 else (N, 4)), Box((0, 0), (N, 5)) if RANK == 0 else col(), row()
))
case("input boxes leave a hole", lambda: run(
    operand((N, 3) if RANK == 0 else (N, 4)), Box((0, 0), (N, 3)) if RANK == 0 else col(),
    row(),
))
case("input and output domains differ", lambda: run(
    operand(col().box_shape), col(), Box((4 * RANK, 0), (4 * RANK + 4, N + 1))
))
case("dtypes differ across ranks", lambda: run(
    operand(col().box_shape, "float32" if RANK == 1 else "float64"), col(), row()
))


def with_operand(fn):
    """``fn(a)`` with ``a`` allocated on every rank (a collective allocation on the GPU engine), freed after."""
    a = operand(col().box_shape)
    try:
        release(fn(a))
    finally:
        release(a)


case("operand is not an array on one rank", lambda: with_operand(
    lambda a: reshape(a if RANK != 1 else [[0.0] * 4] * N, col(), row())))
case("box given as a malformed pair on one rank", lambda: run(
    operand(col().box_shape), ((0, 0, 0),) if RANK == 0 else col(), row()
))
# Slab distributions: each rank's boxes follow from every rank's operand shape, checked alike on every rank
case("operands do not form the slab", lambda: run(  # rank 0 holds one row too few, the last one too many
    operand((N - 1 if RANK == 0 else N + 1 if RANK == SIZE - 1 else N, 4)), Slab.X, Slab.Y
))
case("Slab on some ranks, Box on others", lambda: run(
    operand(col().box_shape), Slab.Y if RANK else col(), row()
))
case("Slab output over boxes away from the origin", lambda: run(
    operand(row().box_shape), Box((4 * RANK + 1, 0), (4 * RANK + 5, N)), Slab.Y
))
case("Slab operands differ in dimensionality across ranks", lambda: run(  # off-axis extents alike: (4,)
    operand((4, 3) if RANK == 0 else (4,)), Slab.Y, Slab.X
))
case("Slab output over input boxes of different dimensionality", lambda: run(  # a NumPy error on every rank
    operand((4, N) if RANK == 0 else (4, N, 1)), row() if RANK == 0 else Box((4 * RANK, 0, 0), (4 * RANK + 4, N, 1)),
    Slab.X
))
case("Slab extents off its axis differ across ranks", lambda: run(
    operand((4, N + 1) if RANK == 1 else (4, N)), Slab.X, row()
))


def mixed_memory():
    """Symmetric memory is allocated collectively; one rank then passes an array that is not on the heap."""
    sym = dask_pgas.allocate_symmetric_memory(col().box_shape, opts.package, make_symmetric=True)
    try:
        other = _off_heap(col().box_shape) if GPU else np.zeros(col().box_shape)
        run_plain = sym if RANK != 1 else other
        b = reshape(run_plain, col(), row())
        release(b)
    finally:
        dask_pgas.free_symmetric_memory(sym)


def _off_heap(shape):
    if opts.package == "cupy":
        import cupy

        return cupy.zeros(shape)
    import torch

    return torch.zeros(shape, dtype=torch.float64, device="cuda")


case("an operand off the symmetric heap on one rank", mixed_memory)
case("options' logger is not a logger on one rank", lambda: with_operand(  # (first used after the exchange)
    lambda a: reshape(a, col(), row(), options={"logger": "not-a-logger"} if RANK == 0 else None)))


def unpicklable_dtype_metadata():
    """Not a bad input: a dtype whose metadata does not pickle, on one rank, is float64 like the others' and
    reshapes (the description exchange pickled it, and failed on that rank alone). NumPy operands on every
    engine (the GPU engine stages them), so the GPU engines' runs check it too (they reshaped plain operands)."""
    dtype = np.dtype(np.float64, metadata={"hook": lambda: 0}) if RANK == 0 else np.float64
    a = np.full(col().box_shape, RANK, dtype)
    b = reshape(a, col(), row())
    got = b.get() if hasattr(b, "get") else np.asarray(b)  # (a CuPy result where the engine returns one)
    ok = bool((got == np.repeat(np.arange(SIZE, dtype=np.float64), 4)[None, :]).all())
    release(a, b)
    assert ok, "wrong result"


case("a dtype's metadata does not pickle on one rank (not an error)", unpicklable_dtype_metadata)


usage = dask_pgas.heap_usage()
assert usage["allocations"] == 0, f"symmetric memory leaked: {usage}"
dask_pgas.finalize()
report_ok()
