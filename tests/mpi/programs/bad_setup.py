"""Setup calls with bad input on some ranks: ``initialize`` and ``allocate_symmetric_memory`` must raise the same
exception on every rank (never leave the others waiting) and allocate nothing; plus ``get_context`` and the
nvmath-compatible allocation keywords (``skip_symmetric_check``, ``axis_order`` as a permutation).

Prints ``CASE {json}`` lines (from rank 0, gathered) like symmetric_memory.py, each with the exception every rank
is expected to raise. The ``initialize`` cases run one after the other in this process: a failed initialize
leaves nothing behind and ``finalize`` after it is a no-op. Needs >= 2 ranks; MPI backend.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
from _common import COMM, RANK, SIZE, all_ok, outcome_of, report_case, report_ok

import dask_pgas
from dask_pgas import errors, runtime
from dask_pgas.distribution import Box

os.environ.pop("DASK_PGAS_BACKEND", None)  # the default-backend case must see the built-in default
assert SIZE >= 2, "bad_setup needs at least 2 ranks"
LAST = SIZE - 1  # the odd rank out
GPU_STACK = "nvshmem" in dask_pgas.available_backends()


def case(name, fn, expect=None):
    outcome = outcome_of(fn)
    report_case(name, {**outcome, "expect": expect or "none", "heap": dask_pgas.heap_usage()["allocations"]})


# -- initialize ----------------------------------------------------------------------------------------------------
def init_case(name, backends, expect):
    """``initialize`` with this rank's ``backends``; whatever happens, finalize (collective, a no-op when the
    initialize failed everywhere) so the next case starts clean."""

    def run():
        try:
            dask_pgas.initialize(None, COMM, backends=backends)
            assert dask_pgas.initialized_backends() == ("mpi",), dask_pgas.initialized_backends()
        finally:
            failed_everywhere = not dask_pgas.is_initialized()
            dask_pgas.finalize()
            assert runtime.get_context() is None
            # a failed initialize must fail on every rank: nobody is left initialized
            assert COMM.allreduce(failed_everywhere) in (0, SIZE), "initialize failed on some ranks only"

    case(name, run, expect)


# (UnknownBackendError is a BackendUnavailableError and, as nvmath raises there, a ValueError)
init_case("unknown backend on one rank", ["mpj"] if RANK == LAST else ["mpi"], "UnknownBackendError")
init_case("unknown backend on every rank", ["shmem"], "UnknownBackendError")
init_case("empty backends on one rank", [] if RANK == LAST else ["mpi"], "UnknownBackendError")
assert issubclass(errors.UnknownBackendError, (errors.BackendUnavailableError, ValueError))


def nccl_is_ignored_with_a_warning():
    """nvmath's examples pass backends=["nvshmem", "nccl"] (NCCL serves its matmul): "nccl" is dropped with a
    warning that says why; alone it names nothing dask_pgas can start."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dask_pgas.initialize(None, COMM, backends=["mpi", "nccl"])
    try:
        assert dask_pgas.initialized_backends() == ("mpi",), dask_pgas.initialized_backends()
        said = [(str(w.message), w.filename) for w in caught if "nccl" in str(w.message)]
        assert len(said) == 1 and "matmul" in said[0][0] and said[0][1] == __file__, said  # (the caller's line)
    finally:
        dask_pgas.finalize()


case("nccl beside mpi is ignored with a warning", nccl_is_ignored_with_a_warning)
init_case("nccl alone", ["nccl"], "UnknownBackendError")
init_case("backends not a sequence on one rank", 5 if RANK == LAST else ["mpi"], "TypeError")
init_case("backend name not a string on one rank", [1] if RANK == LAST else ["mpi"], "TypeError")
init_case("different backends on different ranks", ["mpi", "nvshmem"] if RANK == LAST else ["mpi"],
          "BackendUnavailableError")
# the default resolves locally (["mpi"] without a GPU stack) and is then agreed: the same outcome everywhere
init_case("default backends on one rank, mpi on the others", None if RANK == 0 else ["mpi"],
          "BackendUnavailableError" if GPU_STACK else None)
init_case("mpi as a plain string", "mpi", None)
if not GPU_STACK:
    init_case("unavailable backend on every rank", ["nvshmem"], "BackendUnavailableError")


def twice():
    dask_pgas.initialize(None, COMM, backends=["mpi"])
    try:
        dask_pgas.initialize(None, COMM, backends=["mpi"])
    finally:
        assert dask_pgas.is_initialized(), "a refused second initialize must leave the runtime as it was"
        dask_pgas.finalize()


case("initialize twice", twice, "RuntimeStateError")


def again_beside_reshape():
    """initialize() again on one rank while the others reshape: without the opening agreement the first waited
    on the user's communicator and the others on the runtime's, for ever."""
    dask_pgas.initialize(None, COMM, backends=["mpi"])
    try:
        if RANK == LAST:
            dask_pgas.initialize(None, COMM, backends=["mpi"])
        else:
            box = Box((RANK,), (RANK + 1,))
            dask_pgas.reshape.reshape(np.zeros(1), box, box)
    finally:
        dask_pgas.finalize()


case("initialize again on one rank, reshape on the others", again_beside_reshape, "CollectiveMismatchError")


def again_on_part_of_the_world():
    """initialize() again on a communicator holding only part of the running world: only its ranks are in the
    call, so none may wait for the rest of the world (it is refused there, as on the whole world)."""
    dask_pgas.initialize(None, COMM, backends=["mpi"])
    part = COMM.Split(0 if RANK < LAST else 1)
    try:
        refused = True
        if RANK < LAST:
            try:
                dask_pgas.initialize(None, part, backends=["mpi"])
                refused = False
            except errors.RuntimeStateError:
                pass
        assert all_ok(refused), "initialize() on part of a running world was not refused"
    finally:
        part.Free()
        dask_pgas.finalize()


case("initialize again on part of the world", again_on_part_of_the_world)


# -- get_context ---------------------------------------------------------------------------------------------------
def context():
    assert runtime.get_context() is None, "get_context() before initialize must be None"
    dask_pgas.initialize(None, COMM, backends=["mpi"])
    try:
        ctx = runtime.get_context()
        assert isinstance(ctx, runtime.DistributedContext), ctx
        assert ctx.backends == ("mpi",) and ctx.rank == RANK and ctx.nranks == SIZE, ctx
        assert ctx.communicator is COMM and ctx.device_id is None and ctx.nvshmem_available is False, ctx
        assert ctx.process_group.communicator is COMM and runtime.get_context() is ctx, ctx
        try:
            ctx.rank = 99
        except dataclasses.FrozenInstanceError:
            pass
        else:
            raise AssertionError("DistributedContext must be frozen")
    finally:
        dask_pgas.finalize()
    assert runtime.get_context() is None, "get_context() after finalize must be None"
    dask_pgas.initialize(None, COMM, backends=["mpi"])  # a new runtime: a new context
    try:
        assert runtime.get_context() is not ctx and runtime.get_context().communicator is COMM, runtime.get_context()
    finally:
        dask_pgas.finalize()


case("get_context before, during and after initialize", context)


def nvmath_process_group():
    """nvmath 0.9 / 1.0 style: initialize with an MPIProcessGroup; the context names it, with its collectives."""
    from dask_pgas.process_group import ReductionOp

    class TaggedGroup(dask_pgas.MPIProcessGroup):  # a user's subclass, with state of its own
        tag = None

    given = TaggedGroup(COMM)
    given.tag = RANK
    dask_pgas.initialize(None, given, backends=["mpi"])
    try:
        ctx = runtime.get_context()
        group = ctx.process_group
        # the group given, as nvmath's context holds it (a new plain MPIProcessGroup lost the subclass's tag),
        # in the same context on every call
        assert group is given and group.tag == RANK and runtime.get_context() is ctx, (group, ctx)
        assert ctx.communicator is COMM and group.communicator is COMM and ctx.nccl_comm is None, ctx
        assert (group.rank, group.nranks) == (RANK, SIZE), group
        buf = np.array([RANK + 1, -RANK], dtype=np.int64)
        group.allreduce_buffer(buf, op=ReductionOp.SUM)
        assert list(buf) == [SIZE * (SIZE + 1) // 2, -SIZE * (SIZE - 1) // 2], buf
        for op, want in ((ReductionOp.MIN, 0), (ReductionOp.MAX, SIZE - 1)):
            buf = np.array([RANK], dtype=np.float64)
            group.allreduce_buffer(buf, op=op)
            assert buf[0] == want, (op, buf)
        buf = np.full(3, RANK, dtype=np.int32)
        group.broadcast_buffer(buf, root=LAST)
        assert (buf == LAST).all(), buf
        assert group.allreduce_object({RANK}, op=lambda a, b: a | b) == set(range(SIZE))
        out = dask_pgas.reshape.reshape(np.full((1, 2), RANK), Box((RANK, 0), (RANK + 1, 2)),
                                        Box((0, 2 * RANK // SIZE), (SIZE, 2 * (RANK + 1) // SIZE)))
        assert out.shape == (SIZE, 2 * (RANK + 1) // SIZE - 2 * RANK // SIZE), out.shape
        assert ctx.device_id is None, ctx
    finally:
        dask_pgas.finalize()
    assert runtime.get_context() is None
    # nvmath keeps the device id it was given, whatever its backends: so does the context here
    dask_pgas.initialize(RANK % 2, COMM, backends=["mpi"])
    try:
        assert runtime.get_context().device_id == RANK % 2, runtime.get_context()
    finally:
        dask_pgas.finalize()
    assert runtime.get_context() is None


case("initialize with nvmath's MPIProcessGroup", nvmath_process_group)


class TorchLikeGroup(dask_pgas.process_group.ProcessGroup):
    rank = property(lambda self: RANK)
    nranks = property(lambda self: SIZE)

    def broadcast_buffer(self, array, *, root=0):
        raise NotImplementedError

    def allreduce_buffer(self, array, *, op):
        raise NotImplementedError

    def allreduce_object(self, obj, *, op):
        raise NotImplementedError


# refused on every rank alike (each rank passes the same kind of group; a local check, nothing to agree over)
case("initialize with a process group that is not MPI's",
     lambda: dask_pgas.initialize(None, TorchLikeGroup(), backends=["mpi"]), "TypeError")

# -- allocate_symmetric_memory -------------------------------------------------------------------------------------
dask_pgas.initialize(None, COMM, backends=["mpi"])
ENGINE = runtime.get_engine("mpi")


def alloc_case(name, fn, expect=None):
    """Runs ``fn``; afterwards no symmetric block may be left (refused allocations allocate nothing, accepted
    ones are freed by ``fn``)."""

    def run():
        before = len(ENGINE._windows)
        try:
            fn()
        finally:
            assert len(ENGINE._windows) == before, "a symmetric block was left allocated"

    case(name, run, expect)


def allocate(*args, **kwargs):
    return dask_pgas.allocate_symmetric_memory(*args, **kwargs)


def allocate_and_free(*args, check=None, **kwargs):
    a = allocate(*args, **kwargs)
    try:
        if check is not None:
            check(a)
    finally:
        dask_pgas.free_symmetric_memory(a)


# (a BackendUnavailableError, and a ValueError as nvmath's refusal of a package)
alloc_case("package without a backend on one rank",
           lambda: allocate_and_free((4,), "cupy" if RANK == LAST else np), "PackageUnavailableError")
alloc_case("package without a backend on every rank", lambda: allocate_and_free((4,), "cupy"),
           "PackageUnavailableError")
alloc_case("invalid package object on one rank",
           lambda: allocate_and_free((4,), np.random if RANK == LAST else np), "SymmetricMemoryError")
alloc_case("make_symmetric on one rank only",
           lambda: allocate_and_free((4 + RANK,), np, make_symmetric=(RANK == 0)), "SymmetricMemoryError")
alloc_case("make_symmetric on one rank only, equal sizes",
           lambda: allocate_and_free((4,), np, make_symmetric=(RANK == 0)), "SymmetricMemoryError")
alloc_case("skip_symmetric_check on one rank only",
           lambda: allocate_and_free((4,), np, skip_symmetric_check=(RANK == LAST)), "SymmetricMemoryError")
alloc_case("skip_symmetric_check with make_symmetric",
           lambda: allocate_and_free((4,), np, make_symmetric=True, skip_symmetric_check=True),
           "SymmetricMemoryError")


def skip_equal(a):
    assert a.shape == (3, 4) and a.dtype == np.float64, (a.shape, a.dtype)
    a[...] = RANK


alloc_case("skip_symmetric_check with equal sizes",
           lambda: allocate_and_free((3, 4), np, skip_symmetric_check=True, check=skip_equal))


def skip_padded(a):
    assert a.shape == (RANK + 1,), a.shape
    assert dask_pgas.heap_usage()["bytes"] == SIZE * 8, dask_pgas.heap_usage()  # padded to the largest


alloc_case("skip_symmetric_check with different sizes pads",
           lambda: allocate_and_free((RANK + 1,), np, skip_symmetric_check=True, check=skip_padded))
alloc_case("negative dimension on one rank",
           lambda: allocate_and_free((-1,) if RANK == LAST else (1,), np), "SymmetricMemoryError")
alloc_case("bad dtype on one rank",
           lambda: allocate_and_free((4,), np, dtype="float99" if RANK == LAST else None), "SymmetricMemoryError")


def default_dtype(a):
    assert a.dtype == np.float64, a.dtype


alloc_case("default dtype of numpy is float64", lambda: allocate_and_free((2,), np, check=default_dtype))


def nvmath_strides(shape, axis_order, itemsize):
    """Element strides as nvmath.distributed computes them for a sequence axis_order (fastest axis first)."""
    strides, stride = [0] * len(shape), 1
    for axis in axis_order:
        strides[axis] = stride
        stride *= shape[axis]
    return tuple(s * itemsize for s in strides)


def layout(shape, axis_order, flag=None):
    def check(a):
        assert a.shape == shape, (a.shape, shape)
        assert a.strides == nvmath_strides(shape, axis_order, a.itemsize), (a.strides, axis_order)
        if flag:
            assert a.flags[flag], a.flags
        a[...] = np.arange(a.size).reshape(shape)  # the whole block is usable
        assert np.array_equal(a, np.arange(a.size).reshape(shape))
        assert dask_pgas.memory.is_symmetric_memory(a)

    return lambda: allocate_and_free(shape, np, axis_order=axis_order, dtype="int32", check=check)


alloc_case("axis_order (1, 0) is C order", layout((3, 5), (1, 0), "C_CONTIGUOUS"))
alloc_case("axis_order (0, 1) is Fortran order", layout((3, 5), (0, 1), "F_CONTIGUOUS"))
alloc_case("axis_order as a permutation", layout((2, 3, 4), (1, 0, 2)))
alloc_case("axis_order as another permutation", layout((2, 3, 4), [2, 0, 1]))
alloc_case("axis_order not a permutation on one rank",
           lambda: allocate_and_free((2, 3), np, axis_order=(0, 0) if RANK == LAST else "C"), "SymmetricMemoryError")
alloc_case("axis_order of the wrong length on one rank",
           lambda: allocate_and_free((2, 3), np, axis_order=(0, 1, 2) if RANK == LAST else (1, 0)),
           "SymmetricMemoryError")
alloc_case("axis_order of a bad type on one rank",
           lambda: allocate_and_free((2, 3), np, axis_order=3.5 if RANK == LAST else "F"), "SymmetricMemoryError")

# the world still works after every refused call: one valid allocation, then an empty heap
alloc_case("valid allocation after the refused ones", lambda: allocate_and_free((4,), np))
usage = dask_pgas.heap_usage()
assert usage["allocations"] == 0 and usage["bytes"] == 0, f"symmetric memory leaked: {usage}"
dask_pgas.finalize()
assert runtime.get_context() is None
report_ok(heap=dask_pgas.heap_usage()["allocations"])
