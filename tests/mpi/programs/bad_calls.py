"""Misused Reshape calls (options, call order, freed operands, finalize) raise the same exception on every rank.

Prints one ``CASE {json}`` line per rank and case (gathered on rank 0, like bad_inputs.py) with the exception's
class and message (or "none") and the expected class; a case expecting "none" checks its results against NumPy
on every rank. After each case a valid reshape proves nobody is stuck. Ends with ``HEAP {json}`` lines (every
rank's heap must be empty) and the OK lines. NumPy operands on the MPI backend; needs >= 2 ranks.
``--only TEXT`` runs the cases whose name contains TEXT (to look at one case on its own).
"""

from __future__ import annotations

import contextlib
import json
import sys

import numpy as np
from _common import COMM, RANK, SIZE, initialize, options, outcome_of, report_case, report_ok

import dask_pgas
from dask_pgas import Reshape, ReshapeOptions, errors
from dask_pgas.distribution import Box
from dask_pgas.reshape import reshape

opts = options(lambda p: p.add_argument("--only", default=""))
assert SIZE >= 2, "bad_calls needs at least 2 ranks"
assert opts.package == "numpy", "bad_calls runs NumPy operands"
initialize(opts)
N = 4 * SIZE  # global shape (N, N): column slabs -> row slabs
GLOBAL = np.arange(N * N, dtype=np.float64).reshape(N, N)


def col(rank=RANK):
    return Box((0, 4 * rank), (N, 4 * rank + 4))


def row(rank=RANK):
    return Box((4 * rank, 0), (4 * rank + 4, N))


def piece(box, g=GLOBAL, order="C"):
    return np.array(g[tuple(slice(lo, up) for lo, up in zip(box.lower, box.upper))], order=order)


def symmetric(box, g=GLOBAL):
    a = dask_pgas.allocate_symmetric_memory(box.box_shape, np)
    a[...] = piece(box, g)
    return a


def release(*arrays):
    sym = [a for a in arrays if a is not None and dask_pgas.memory.is_symmetric_memory(a)]
    if sym:
        dask_pgas.free_symmetric_memory(*sym)


def case(name, fn, expect="none"):
    if opts.only not in name:
        return
    report_case(name, {**outcome_of(fn), "expect": expect})
    if not dask_pgas.is_initialized():  # a case that finalized leaves the world down: bring it up again
        initialize(opts)
    # the world still works: a valid reshape right after
    b = reshape(piece(col()), col(), row())
    assert COMM.allreduce(bool(np.array_equal(b, piece(row())))), "world broken after case " + name


def planned(operand=None):
    r = Reshape(piece(col()) if operand is None else operand, col(), row())
    r.plan()
    return r


# -- D5: options are checked inside the exchanged description -----------------------------------------------------
case("options: invalid blocking on one rank", lambda: reshape(
    piece(col()), col(), row(), options={"blocking": "yes"} if RANK == 1 else None), "ValueError")
case("options: unknown field on one rank", lambda: reshape(
    piece(col()), col(), row(), options={"block": True} if RANK == 1 else None), "TypeError")
case("options: not options on one rank", lambda: reshape(
    piece(col()), col(), row(), options=42 if RANK == 1 else None), "TypeError")


def mutated_options():
    o = ReshapeOptions()
    if RANK == SIZE - 1:
        o.blocking = "never"  # assigned after construction: __post_init__ did not see it
    Reshape(piece(col()), col(), row(), options=o).free()


case("options: ReshapeOptions made invalid after construction on one rank", mutated_options, "ValueError")
case("options: blocking differs across ranks", lambda: reshape(
    piece(col()), col(), row(), options={"blocking": True} if RANK == 1 else None), "ValueError")


# -- D6: call-order preconditions are agreed on before the collective -----------------------------------------------
def execute_without_plan_on_one_rank():
    with Reshape(piece(col()), col(), row()) as r:
        if RANK != 1:
            r.plan()  # meets rank 1's execute() at the agreement and raises its error
        r.execute()


case("execute without plan() on one rank", execute_without_plan_on_one_rank, "CollectiveMismatchError")


def execute_without_plan():
    with Reshape(piece(col()), col(), row()) as r:
        r.execute()


case("execute without plan() on every rank", execute_without_plan, "RuntimeStateError")


def execute_after_free(ranks):
    r = planned()
    try:
        if RANK in ranks:
            r.free()  # on one rank: meets the others' execute() (a mismatch) and leaves r as it was
        r.execute()
    finally:
        r.free()


case("execute after free() on one rank", lambda: execute_after_free({1}), "CollectiveMismatchError")
case("execute after free() on every rank", lambda: execute_after_free(set(range(SIZE))), "RuntimeStateError")


def reset_after_free_on_one_rank():
    r = planned()
    try:
        if RANK == 1:
            r.free()
        r.reset_operand(piece(col()))
    finally:
        r.free()


case("reset_operand after free() on one rank", reset_after_free_on_one_rank, "CollectiveMismatchError")


# -- ranks in different collective calls: every rank raises CollectiveMismatchError, and the world stays usable ----
def allocate_beside_reshape():
    a = None
    try:
        if RANK == 1:
            a = dask_pgas.allocate_symmetric_memory(col().box_shape, np)
        else:
            reshape(piece(col()), col(), row())
    finally:
        release(a)


case("allocate_symmetric_memory on one rank, reshape on the others", allocate_beside_reshape,
     "CollectiveMismatchError")


def executes_of_different_objects():
    r1, r2 = planned(), planned()
    try:
        (r2 if RANK == 1 else r1).execute()
    finally:
        r1.free()
        r2.free()


case("execute() of different Reshape objects", executes_of_different_objects, "CollectiveMismatchError")


def free_beside_execute():
    a = symmetric(col())
    try:
        with planned() as r:
            if RANK == 0:
                dask_pgas.free_symmetric_memory(a)
                a = None
            else:
                r.execute()
    finally:
        release(a)


case("free_symmetric_memory on one rank, execute on the others", free_beside_execute, "CollectiveMismatchError")


def finalize_beside_execute():
    with planned() as r:
        if RANK == SIZE - 1:
            dask_pgas.finalize()
        else:
            r.execute()


case("finalize on one rank, execute on the others", finalize_beside_execute, "CollectiveMismatchError")


def sync_differs():
    with planned() as r:
        r.execute(sync_symmetric_memory=RANK != 1)  # decides a collective step on the GPU engine


case("execute(sync_symmetric_memory=) differs across ranks", sync_differs, "CollectiveMismatchError")


def sync_not_a_truth_value():
    with planned() as r:
        r.execute(sync_symmetric_memory=np.array([True, False]) if RANK == 1 else True)  # bool() raises on rank 1


case("execute(sync_symmetric_memory=) has no truth value on one rank", sync_not_a_truth_value, "TypeError")


def plan_after_free_on_one_rank():
    r = Reshape(piece(col()), col(), row())
    if RANK == SIZE - 1:
        r.free()
    try:
        r.plan()
    finally:
        r.free()


case("plan after free() on one rank", plan_after_free_on_one_rank, "CollectiveMismatchError")


def exception_inside_with_on_one_rank(planned_first):
    """A rank leaves a ``with Reshape`` block by its own exception while the others go on to the next call of
    the object: its ``free()`` meets their call, the object is freed on every rank, every rank has made one call,
    and the next collective call meets on every rank (the harness's valid reshape after the case)."""
    try:
        with Reshape(piece(col()), col(), row()) as r:
            if planned_first:
                r.plan()
            if RANK == 1:
                raise KeyError("an error of the user's code on rank 1")
            if not planned_first:
                r.plan()
            r.execute()
    except KeyError as exc:  # rank 1: its own error comes through, with a note on what the others were doing
        assert RANK == 1, exc
        notes = getattr(exc, "__notes__", None)
        assert notes is None or any(f"{r._name}.free()" in n and "is freed on every rank" in n for n in notes), notes
    except errors.CollectiveMismatchError as exc:  # the others: rank 1 is in free()
        assert RANK != 1 and f"rank 1: {r._name}.free()" in str(exc) and "is freed on every rank" in str(exc), exc
    else:
        raise AssertionError("no exception on this rank")
    assert r._freed
    r.free()  # does nothing now, on every rank


case("an exception inside `with Reshape` on one rank, after plan()", lambda: exception_inside_with_on_one_rank(True))
case("an exception inside `with Reshape` on one rank, before plan()",
     lambda: exception_inside_with_on_one_rank(False))


def plan_twice_on_one_rank():
    with Reshape(piece(col()), col(), row()) as r:
        r.plan()
        if RANK == 0:
            r.plan()  # a no-op: no rank waits for it
        assert np.array_equal(r.execute(), piece(row()))


case("plan() twice on one rank", plan_twice_on_one_rank)


def reset_none_on_one_rank():
    with planned() as r:
        r.reset_operand(None if RANK == 1 else piece(col()))


case("reset_operand(None) on one rank", reset_none_on_one_rank, "ValueError")


# -- D7: freed symmetric operands: symmetric_memory.py (on every backend and package)


def redistribute_beside_reshape():
    """nvmath 1.0's name on some ranks, the 0.x name on others: one object (they were told apart by name)."""
    from dask_pgas.reshape import Redistribute

    cls = Redistribute if RANK == 0 else Reshape
    with cls(piece(col()), col(), row()) as r:
        r.plan()
        assert np.array_equal(r.execute(), piece(row()))


case("Redistribute on one rank, Reshape on the others", redistribute_beside_reshape)


def operand_changed_in_place_on_one_rank(change):
    """NumPy lets an array's shape or dtype change in place: a rank whose operand no longer fits the plan says so
    before the exchange, so every rank raises (the others were left waiting in the exchange)."""
    a = piece(col())
    with planned(a) as r:
        b = r.execute()
        assert np.array_equal(b, piece(row()))
        if RANK == 1:
            if change == "shape":
                a.shape = (4, N)
            elif change == "strides":  # (deprecated in NumPy 2.4, still possible) now F-ordered, not C
                import warnings

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    a.strides = (a.itemsize, a.itemsize * a.shape[0])
            else:
                a.dtype = np.int64
        r.execute()


case("execute after the operand's shape changed in place on one rank",
     lambda: operand_changed_in_place_on_one_rank("shape"), "OperandMismatchError")
case("execute after the operand's dtype changed in place on one rank",
     lambda: operand_changed_in_place_on_one_rank("dtype"), "OperandMismatchError")
case("execute after the operand's strides changed in place on one rank",
     lambda: operand_changed_in_place_on_one_rank("strides"), "OperandMismatchError")


def reset_to_freed_on_one_rank():
    a, c = symmetric(col()), symmetric(col())
    dask_pgas.free_symmetric_memory(c)
    try:
        with planned(a) as r:
            r.reset_operand(c if RANK == 1 else a)
    finally:
        release(a)


case("reset_operand to a freed symmetric array on one rank", reset_to_freed_on_one_rank, "SymmetricMemoryError")


def symmetric_operand_reset_and_executed():
    a, c = symmetric(col()), symmetric(col(), GLOBAL + 1)
    results = []
    try:
        with planned(a) as r:
            results.append(r.execute())
            r.reset_operand(c)
            dask_pgas.free_symmetric_memory(a)  # no longer the operand: fine
            a = None
            results.append(r.execute())
        assert np.array_equal(results[0], piece(row())) and np.array_equal(results[1], piece(row(), GLOBAL + 1))
    finally:
        release(a, c, *results)


case("symmetric operand: reset, free the old one, execute", symmetric_operand_reset_and_executed)


# -- P4: release_operand ---------------------------------------------------------------------------------------------
def execute_after_release(ranks):
    with planned() as r:
        if RANK in ranks:
            r.release_operand()
        r.execute()


case("execute after release_operand()", lambda: execute_after_release(set(range(SIZE))), "RuntimeStateError")
case("execute after release_operand() on one rank", lambda: execute_after_release({1}), "RuntimeStateError")


def release_then_reset():
    with planned() as r:
        r.release_operand()
        r.release_operand()  # twice: nothing to do
        assert r._operand is None and r._source is None
        r.reset_operand(piece(col(), GLOBAL * 3))
        assert np.array_equal(r.execute(), piece(row(), GLOBAL * 3))
    r.release_operand()  # after free(): nothing to do


case("release_operand, reset_operand, execute", release_then_reset)


def release_drops_the_reference():
    import weakref

    a = piece(col())
    r = planned(a)
    ref = weakref.ref(a)
    r.release_operand()
    del a
    alive = ref() is not None
    r.free()
    assert not alive, "release_operand() kept a reference to the operand"


case("release_operand drops the reference", release_drops_the_reference)


# -- D10: a rank whose operand was copied to conform sees in-place updates like the others --------------------------
def inplace_updates(make):
    a = make(piece(col()))
    with Reshape(a, col(), row()) as r:
        r.plan()
        first = r.execute()
        assert np.array_equal(first, piece(row()))
        for k in (2, 3):
            a[...] = piece(col(), GLOBAL * k + 1)  # in place, on every rank
            assert np.array_equal(r.execute(), piece(row(), GLOBAL * k + 1)), f"update {k} not seen"


case("mixed C/F layouts: in-place updates seen on every rank",
     lambda: inplace_updates(lambda x: np.asfortranarray(x) if RANK == 0 else x))
case("non-contiguous operand on one rank: in-place updates seen",
     lambda: inplace_updates(lambda x: np.repeat(x, 2, axis=1)[:, ::2] if RANK == 1 else x))


def reset_to_other_layout():
    with planned() as r:
        b = piece(col(), GLOBAL * 5)
        new = np.asfortranarray(b) if RANK == 0 else b
        r.reset_operand(new)
        assert np.array_equal(r.execute(), piece(row(), GLOBAL * 5))
        new[...] = 7
        assert np.array_equal(r.execute(), np.full(row().box_shape, 7.0))


case("reset_operand to another layout: in-place updates seen", reset_to_other_layout)


def results_changed_in_place_on_one_rank():
    """Results are recycled once dropped; one that its holder reshaped, retyped or froze in place on one rank is
    not (the engine would refuse it there alone, inside the exchange, and the other ranks would wait)."""

    def freeze(b):
        b.flags.writeable = False

    changes = (lambda b: setattr(b, "shape", (-1,)), lambda b: setattr(b, "dtype", np.int64), freeze)
    with planned() as r:
        for change in changes:
            for _ in range(3):
                b = r.execute()
                assert np.array_equal(b, piece(row())), "a recycled result came out wrong"
                if RANK == 1:
                    change(b)
                del b


case("results changed in place on one rank, then dropped: later executes right", results_changed_in_place_on_one_rank)


# -- P1-P3: nvmath.distributed signatures ----------------------------------------------------------------------------
def nvmath_signatures():
    a = piece(col())
    with Reshape(a, col(), row(), options=ReshapeOptions(blocking=True)) as r:
        r.plan(None)
        r.plan(stream=None)
        assert np.array_equal(r.execute(None), piece(row()))
        assert np.array_equal(r.execute(None, True), piece(row()))  # stream, release_workspace
        assert np.array_equal(r.execute(None, False, True), piece(row()))  # ..., sync_symmetric_memory
        out = r.execute(stream=None, release_workspace=True, sync_symmetric_memory=False)
        assert np.array_equal(out, piece(row()))
        r.reset_operand(piece(col(), GLOBAL - 1), stream=None)
        assert np.array_equal(r.execute(), piece(row(), GLOBAL - 1))
        try:
            r.reset_operand(a, None)  # stream is keyword-only, as in nvmath
        except TypeError:
            pass
        else:
            raise AssertionError("reset_operand accepted stream positionally")


case("nvmath signatures: plan(stream), execute(stream, release_workspace, sync), reset_operand(*, stream)",
     nvmath_signatures)


# -- numbering: Reshape objects and allocations are numbered per world, not per process --------------------------
def numbered_per_world():
    """Rank 0 first has a world of its own (a Reshape and an allocation there), then every rank joins one world:
    its calls name the same objects on every rank."""
    from mpi4py import MPI

    dask_pgas.finalize()
    if RANK == 0:
        dask_pgas.initialize(None, MPI.COMM_SELF, backends=[opts.backend])
        alone = dask_pgas.allocate_symmetric_memory((2, 2), np)
        reshape(np.ones((2, 2)), Box((0, 0), (2, 2)), Box((0, 0), (2, 2)))
        dask_pgas.free_symmetric_memory(alone)
        dask_pgas.finalize()
    initialize(opts)
    a, b = symmetric(col()), None
    try:
        with planned(a) as r:
            b = r.execute()
            assert np.array_equal(b, piece(row()))
    finally:
        release(a, b)


case("numbering restarts with each world (a rank that had a world of its own before)", numbered_per_world)


# -- local work after a call's opening agreement, failing on one rank: agreed before the next collective step -------
def failing_on(rank, obj, name):
    """Make ``obj.name`` raise MemoryError on ``rank`` only (a context manager)."""

    @contextlib.contextmanager
    def patched():
        saved = obj.__dict__.get(name)
        if RANK == rank:
            def fail(*args, **kwargs):
                raise MemoryError("no memory (injected)")
            setattr(obj, name, fail)
        try:
            yield
        finally:
            if RANK == rank:
                if saved is None:
                    delattr(obj, name)
                else:
                    setattr(obj, name, saved)

    return patched()


def plan_fails_on_one_rank():
    from dask_pgas.engines import mpi as engine

    with failing_on(1, engine, "MPIReshapePlan"), Reshape(piece(col()), col(), row()) as r:
        r.plan()  # built locally by the MPI engine
        r.execute()


case("plan() fails on one rank (the MPI engine plans locally)", plan_fails_on_one_rank, "MemoryError")


def result_allocation_fails_on_one_rank():
    with Reshape(piece(col()), col(), row()) as r:
        r.plan()
        failed = None
        with failing_on(1, r._engine, "empty"):
            try:
                r.execute()
            except MemoryError as exc:
                failed = exc
        assert np.array_equal(r.execute(), piece(row()))  # usable afterwards, on every rank
        if failed is not None:
            raise failed


case("execute() cannot allocate its result on one rank", result_allocation_fails_on_one_rank, "MemoryError")


def conforming_copy_fails_on_one_rank():
    operand = np.asfortranarray(piece(col())) if RANK == 1 else piece(col())  # rank 1 copies into C order
    with failing_on(1, Reshape, "_conform"):
        Reshape(operand, col(), row()).free()


case("the conforming copy fails on one rank", conforming_copy_fails_on_one_rank, "MemoryError")


# -- D8: after finalize ----------------------------------------------------------------------------------------------
def after_finalize(method, reinitialize=False):
    r = planned()
    dask_pgas.finalize()
    if reinitialize:
        initialize(opts)
    {"execute": r.execute, "plan": r.plan, "reset_operand": lambda: r.reset_operand(piece(col()))}[method]()


case("execute after finalize()", lambda: after_finalize("execute"), "RuntimeStateError")
case("execute after finalize() and initialize()", lambda: after_finalize("execute", True), "RuntimeStateError")
case("reset_operand after finalize()", lambda: after_finalize("reset_operand"), "RuntimeStateError")


def unplanned_plan_after_finalize():
    r = Reshape(piece(col()), col(), row())
    dask_pgas.finalize()
    r.plan()


case("plan after finalize()", unplanned_plan_after_finalize, "RuntimeStateError")


def context_exit_after_finalize():
    with Reshape(piece(col()), col(), row()) as r:
        r.plan()
        dask_pgas.finalize()
        r.release_operand()
    # free() ran in __exit__ without touching the finalized runtime's communicators


case("free() and release_operand() after finalize()", context_exit_after_finalize)


usage = dask_pgas.heap_usage()
lines = COMM.gather("HEAP " + json.dumps({"rank": RANK, **usage}) + "\n")
if RANK == 0:
    sys.stdout.write("".join(lines))
    sys.stdout.flush()
assert usage["allocations"] == 0, f"symmetric memory leaked: {usage}"
dask_pgas.finalize()
report_ok()
