"""Random box layouts, dtypes, dimensionalities and memory orders against a NumPy reference.

Every rank runs the same hypothesis examples (derandomized) and the verdict of each example is agreed with an
allreduce, so all ranks pass or fail together. Run: mpiexec -n K python reshape_suite.py [--backend ...]

``--seed S`` draws the examples from seed ``S`` instead (a fuzz run: new cases each seed, the same on every rank,
as generation depends only on the seed and the agreed verdicts; no shrinking, which is timed).
"""

from __future__ import annotations

import random
import sys

import numpy as np
from _common import (
    COMM,
    RANK,
    SIZE,
    TORCH_ONLY,
    all_ok,
    initialize,
    options,
    partition,
    report_ok,
    to_device,
    to_numpy,
    torch_cpu,
)
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

import dask_pgas
from dask_pgas.distribution import Box, Slab
from dask_pgas.reshape import Reshape

opts = options(lambda parser: parser.add_argument("--seed", type=int, default=None))
initialize(opts)


def drawn(test):
    """``test`` with its examples drawn from ``--seed`` when given (else derandomized, the same every run)."""
    return test if opts.seed is None else seed(opts.seed)(test)

COMMON = ["bool", "int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64", "complex64",
          "complex128"]
# structs with string fields: dtlib maps a field 'S2' to one MPI_CHAR, yet every byte of it must travel
STRING_STRUCTS = [np.dtype([("a", "<i2"), ("b", "S2")]), np.dtype([("a", "<i4"), ("b", "U3")])]
# x87 extended precision: MPI_LONG_DOUBLE moves 10 of its 16 bytes, yet every byte must travel
EXTENDED = ["longdouble", "clongdouble", np.dtype([("a", "i1"), ("b", "longdouble")], align=True)]
# fields out of offset order, and overlapping ones: NumPy has no ``descr`` for them
UNORDERED = [np.dtype({"names": ["x", "y"], "formats": ["u1", "<i2"], "offsets": [4, 0], "itemsize": 8}),
             np.dtype({"names": ["w", "h"], "formats": ["<i4", "<i2"], "offsets": [0, 2], "itemsize": 4})]
HOST_ONLY = ["uint16", "uint32", "uint64", ">f8", "<i4", "S5", "V3",
             np.dtype([("a", "i1"), ("b", "<f8")]), np.dtype([("a", "i1"), ("b", "<f8")], align=True),
             *STRING_STRUCTS, *EXTENDED, *UNORDERED]
DTYPES = [np.dtype(d) for d in COMMON + (HOST_ONLY if opts.package == "numpy" else [])]
# (NumPy dtype, torch dtype name or None): torch CPU tensors also take NumPy's unsigned types and the types NumPy
# lacks, generated as raw bytes of their size and viewed as that torch type
ELEMENTS = [(d, None) for d in DTYPES]
if opts.package == "torch-cpu":
    ELEMENTS += [(np.dtype(d), None) for d in ("uint16", "uint32", "uint64")]
if opts.package in ("torch", "torch-cpu"):
    ELEMENTS += [(np.dtype(raw_dtype), name) for name, raw_dtype in TORCH_ONLY.items()]
# NumPy symmetric memory exists on the mpi backend only (nvshmem stages NumPy operands through the GPU heap)
HOST_KINDS = ["plain", "symmetric", "strided"] if opts.backend == "mpi" else ["plain", "strided"]
KINDS = {"numpy": HOST_KINDS, "torch-cpu": ["plain", "strided"]}.get(opts.package, ["symmetric"])


def global_array(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if dtype == np.bool_:
        return rng.integers(0, 2, n).astype(bool).reshape(shape)
    raw = rng.integers(0, 256, n * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def same_bytes(a, b) -> bool:
    """Bitwise equality (NaN payloads included); for structured dtypes field by field (padding is no data)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.fields:
        return all(same_bytes(a[name], b[name]) for name in a.dtype.names)
    a, b = np.ascontiguousarray(raw(a)), np.ascontiguousarray(raw(b))
    return np.array_equal(a.view(np.uint8), b.view(np.uint8))


def raw(a):
    """Byte view (void elements): copies through it are byte-exact for every dtype."""
    return a.view(np.dtype((np.void, a.dtype.itemsize)))


def piece(glob, box, order):
    return np.asarray(raw(glob)[box.relative_to(Box((0,) * glob.ndim, glob.shape))], order=order).view(glob.dtype)


def make_operand(local, kind, order, torch_name=None):
    if kind == "strided":
        holder = np.empty((*local.shape, 2), dtype=local.dtype)
        raw(holder)[..., 0] = raw(local)
        local = holder[..., 0]
    if opts.package == "torch-cpu":
        return torch_cpu(local, torch_name)
    if kind in ("plain", "strided"):
        return local
    dtype = local.dtype if opts.package != "torch" else _torch_dtype(local.dtype, torch_name)
    op = dask_pgas.allocate_symmetric_memory(local.shape, opts.package, dtype=dtype, axis_order=order,
                                             make_symmetric=True)
    return to_device(local, op)


def _torch_dtype(dtype, torch_name=None):
    import torch

    return getattr(torch, torch_name) if torch_name else torch.from_numpy(np.empty(0, dtype)).dtype


@st.composite
def cases(draw):
    ndim = draw(st.integers(1, 4))
    limit = {1: 40, 2: 12, 3: 7, 4: 5}[ndim]
    shape = tuple(draw(st.lists(st.integers(0, limit), min_size=ndim, max_size=ndim)))
    return dict(
        shape=shape,
        element=draw(st.sampled_from(ELEMENTS)),
        order=draw(st.sampled_from("CF")),
        kind=draw(st.sampled_from(KINDS)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def matches(result, expect, torch_name=None) -> bool:
    """Local check that never raises: a rank that raised here would skip the collectives that follow."""
    try:
        if opts.package == "torch-cpu":  # a torch CPU tensor comes back, of the operand's torch type
            import torch

            want = getattr(torch, torch_name) if torch_name else torch.from_numpy(np.empty(0, expect.dtype)).dtype
            if not isinstance(result, torch.Tensor) or result.device.type != "cpu" or result.dtype != want:
                print(f"rank {RANK}: result is {type(result).__name__} {getattr(result, 'dtype', '')}, not a torch "
                      f"CPU tensor of {want}", file=sys.stderr)
                return False
        return same_bytes(to_numpy(result), expect)
    except Exception as exc:
        print(f"rank {RANK}: comparing the result raised {type(exc).__name__}: {exc}", file=sys.stderr)
        return False


def run_case(case):
    seen = COMM.allgather(repr(case))
    assert len(set(seen)) == 1, f"ranks drew different examples: {seen}"
    rnd = random.Random(case["seed"])
    ins, outs = partition(case["shape"], SIZE, rnd), partition(case["shape"], SIZE, rnd)
    dtype, torch_name = case["element"]
    glob = global_array(case["shape"], dtype, case["seed"])
    my_in, my_out = Box(*ins[RANK]), Box(*outs[RANK])
    local = piece(glob, my_in, case["order"])
    operand = make_operand(local, case["kind"], case["order"], torch_name)
    expect = piece(glob, my_out, "C")
    symmetric = case["kind"] == "symmetric"
    ok, why = True, ""
    try:
        with Reshape(operand, my_in, my_out) as plan:
            plan.plan()
            for attempt in range(2):  # plan once, execute twice
                result = plan.execute()
                if not matches(result, expect, torch_name):
                    ok, why = False, f"execute #{attempt} differs from the reference"
                if symmetric:
                    dask_pgas.free_symmetric_memory(result)
            if case["kind"] == "plain":  # a new operand through reset_operand
                glob2 = global_array(case["shape"], dtype, case["seed"] + 1)
                local2 = piece(glob2, my_in, case["order"])
                plan.reset_operand(make_operand(local2, "plain", case["order"], torch_name))
                if not matches(plan.execute(), piece(glob2, my_out, "C"), torch_name):
                    ok, why = False, "execute after reset_operand differs from the reference"
        if symmetric:
            dask_pgas.free_symmetric_memory(operand)
    except Exception as exc:  # a local failure must still reach the verdict that every rank agrees on
        ok, why = False, f"raised {type(exc).__name__}: {exc}"
    verdict = all_ok(ok)
    assert verdict, f"rank {RANK}: {why or 'another rank failed'} in {case}, boxes in={ins} out={outs}"


@settings(
    max_examples=opts.examples, derandomize=opts.seed is None, database=None, deadline=None,
    phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck), print_blob=False,
)
@drawn
@given(case=cases())
def test_random_layouts(case):
    run_case(case)


@st.composite
def slab_cases(draw):
    """A global shape and, for each side, a Slab of one of its axes or random boxes."""
    ndim = draw(st.integers(1, 3))
    limit = {1: 30, 2: 11, 3: 6}[ndim]
    return dict(
        shape=tuple(draw(st.lists(st.integers(0, limit), min_size=ndim, max_size=ndim))),
        element=draw(st.sampled_from(ELEMENTS)),
        order=draw(st.sampled_from("CF")),
        kind=draw(st.sampled_from(KINDS)),
        seed=draw(st.integers(0, 2**32 - 1)),
        sides=draw(st.sampled_from([("slab", "slab"), ("slab", "box"), ("box", "slab")])),
        axes=(draw(st.integers(0, ndim - 1)), draw(st.integers(0, ndim - 1))),
    )


@settings(
    max_examples=max(opts.examples // 3, 5), derandomize=opts.seed is None, database=None, deadline=None,
    phases=[Phase.generate], suppress_health_check=list(HealthCheck), print_blob=False,
)
@drawn
@given(case=slab_cases())
def test_slabs(case):
    """Redistribute between Slab distributions (nvmath 1.0's Slab.X -> Slab.Y) and boxes, against NumPy: the
    global shape is inferred from the operands on every rank."""
    rnd = random.Random(case["seed"])
    dtype, torch_name = case["element"]
    glob = global_array(case["shape"], dtype, case["seed"])
    dists, boxes = [], []
    for kind, axis in zip(case["sides"], case["axes"]):
        if kind == "slab":
            slab = Slab(axis)
            dists.append(slab)
            boxes.append(slab.box(RANK, SIZE, case["shape"]))
        else:
            box = Box(*partition(case["shape"], SIZE, rnd)[RANK])
            dists.append(box)
            boxes.append(box)
    local = piece(glob, boxes[0], case["order"])
    operand = make_operand(local, case["kind"], case["order"], torch_name)
    ok, why = True, ""
    try:
        result = dask_pgas.distribution.redistribute(operand, *dists)
        if not matches(result, piece(glob, boxes[1], "C"), torch_name):
            ok, why = False, "differs from the reference"
        if case["kind"] == "symmetric":
            dask_pgas.free_symmetric_memory(result, operand)
    except Exception as exc:
        ok, why = False, f"raised {type(exc).__name__}: {exc}"
    assert all_ok(ok), f"rank {RANK}: {why or 'another rank failed'} in {case}, distributions {dists}"


# fixed cases the random search might miss: the seed, a single rank owning everything, all-empty domain,
# structs with string fields
def fixed_cases():
    cases = [((4, 4), "C", "float64"), ((1000, 3), "F", "int32"), ((0, 5), "C", "float32")]
    if opts.package == "numpy":
        cases += [((24, 5), order, dtype) for order, dtype in zip("CF", STRING_STRUCTS)]
    for shape, order, dtype in cases:
        run_case(dict(shape=shape, element=(np.dtype(dtype), None), order=order, kind=KINDS[0], seed=7))


def nvmath_names():
    """One random layout through each name nvmath has had for the operation: 0.x's ``reshape.reshape`` (its
    optional arguments given positionally, as nvmath allows) and 1.0's ``distribution.redistribute`` /
    ``Redistribute`` / ``RedistributeOptions`` (keyword names ``input_distribution`` / ``output_distribution``),
    each against the NumPy reference; ``Box.shape(rank, global_shape)`` is this rank's local shape."""
    from dask_pgas import distribution, reshape

    shape, dtype = (13, 7), np.dtype("int32")
    rnd = random.Random(11)
    ins, outs = partition(shape, SIZE, rnd), partition(shape, SIZE, rnd)
    glob = global_array(shape, dtype, 11)
    my_in, my_out = Box(*ins[RANK]), Box(*outs[RANK])
    local, expect = piece(glob, my_in, "C"), piece(glob, my_out, "C")
    ok, why = my_in.shape(RANK, shape) == local.shape, "Box.shape(rank, global_shape) is not the local shape"
    for peer, error in [((RANK + 1) % SIZE, RuntimeError), (SIZE, ValueError)]:  # (as nvmath's Box.shape)
        if peer != RANK:
            try:
                my_in.shape(peer, shape)
                ok, why = False, f"Box.shape({peer}) on rank {RANK} of {SIZE} did not raise"
            except error:
                pass
    forms = {
        "reshape.reshape, positional": lambda: reshape.reshape(local, my_in, my_out, True, {"blocking": True}, None),
        "distribution.redistribute": lambda: distribution.redistribute(
            local, input_distribution=my_in, output_distribution=my_out,
            options=distribution.RedistributeOptions(blocking=True)),
    }

    def stateful():
        with distribution.Redistribute(local, input_distribution=my_in, output_distribution=my_out) as r:
            r.plan()
            return r.execute()

    forms["distribution.Redistribute"] = stateful
    for name, run in forms.items():
        try:
            if not matches(run(), expect):
                ok, why = False, f"{name} differs from the reference"
        except Exception as exc:  # every rank still reaches the verdict below
            ok, why = False, f"{name} raised {type(exc).__name__}: {exc}"
    assert all_ok(ok), f"rank {RANK}: {why or 'another rank failed'}, boxes in={ins} out={outs}"


def torch_cpu_rules():
    """What a torch CPU operand does beyond the random layouts, each agreed on every rank: in-place updates and a
    storage swapped in by ``set_`` are seen by the next ``execute()``; a tensor that requires grad is reshaped (the
    result does not); ``reset_operand`` refuses a NumPy array on every rank; NumPy on one rank and torch on
    another is refused on every rank."""
    import torch

    from dask_pgas.errors import OperandMismatchError, UnsupportedOperandError

    shape = (6, 5)
    rnd = random.Random(5)
    ins, outs = partition(shape, SIZE, rnd), partition(shape, SIZE, rnd)
    my_in, my_out = Box(*ins[RANK]), Box(*outs[RANK])
    glob = torch.arange(30, dtype=torch.float64).reshape(shape)

    def part(t, box):
        return t[tuple(slice(lo, up) for lo, up in zip(box.lower, box.upper))]

    checks = {}

    def expect(name, got, want):
        checks[name] = isinstance(got, torch.Tensor) and torch.equal(got, want)

    def expect_raise(name, error, fn, says):
        try:
            fn()
            checks[name] = False
        except error as exc:
            checks[name] = says in str(exc)

    x = part(glob, my_in).clone().requires_grad_(True)
    with Reshape(x, my_in, my_out) as r:
        r.plan()
        first = r.execute()
        expect("requires_grad operand", first, part(glob, my_out))
        checks["result needs no grad"] = not first.requires_grad
        with torch.no_grad():
            x.mul_(2)
        expect("in-place update", r.execute(), 2 * part(glob, my_out))
        with torch.no_grad():
            x.set_(part(glob, my_in).clone() + 100)
        expect("storage swapped by set_", r.execute(), part(glob, my_out) + 100)
        expect_raise("reset_operand(numpy) refused", UnsupportedOperandError,
                     lambda: r.reset_operand(part(glob, my_in).numpy()),
                     "must be torch (CPU), like the first, not numpy")
    # the float8 types: both one byte, told apart by their torch names
    e4 = part(glob, my_in).to(torch.float8_e4m3fn)
    with Reshape(e4, my_in, my_out) as r:
        r.plan()
        got = r.execute()
        checks["float8 result type"] = got.dtype == torch.float8_e4m3fn
        expect("float8 bytes", got.view(torch.uint8), part(glob, my_out).to(torch.float8_e4m3fn).view(torch.uint8))
        expect_raise("reset_operand(other float8) refused", OperandMismatchError,
                     lambda: r.reset_operand(e4.to(torch.float8_e5m2)), "torch.float8_e4m3fn")
    if SIZE > 1:
        mixed = part(glob, my_in).numpy() if RANK == 0 else part(glob, my_in).clone()
        expect_raise("numpy and torch across ranks", OperandMismatchError, lambda: Reshape(mixed, my_in, my_out),
                     "rank 0: numpy, rank 1: torch (CPU)")
        f8 = e4 if RANK == 0 else e4.to(torch.float8_e5m2)
        expect_raise("float8 types across ranks", OperandMismatchError, lambda: Reshape(f8, my_in, my_out),
                     "rank 0: torch.float8_e4m3fn, rank 1: torch.float8_e5m2")
    failed = [name for name, ok in checks.items() if not ok]
    assert all_ok(not failed), f"rank {RANK}: {failed or 'another rank failed'}"


def unchecked_resets():
    """``reset_operand_unchecked`` (nvmath 1.0), every package: a fitting operand is used by the next execute();
    one that does not fit on one rank makes that execute raise on every rank and drops the operand everywhere,
    and a checked reset then works again."""
    from dask_pgas.errors import OperandMismatchError, RuntimeStateError

    shape, dtype = (9, 6), np.dtype("float64")
    rnd = random.Random(3)
    ins, outs = partition(shape, SIZE, rnd), partition(shape, SIZE, rnd)
    my_in, my_out = Box(*ins[RANK]), Box(*outs[RANK])
    globs = [global_array(shape, dtype, seed) for seed in (1, 2, 3)]
    operands = [make_operand(piece(g, my_in, "C"), KINDS[0], "C") for g in globs]
    symmetric = KINDS[0] == "symmetric"
    wrong = make_operand(np.zeros((my_in.box_shape[0] + 1, *my_in.box_shape[1:])), "plain", "C") if RANK == 0 \
        else operands[2]
    checks, results = {}, []

    def outcome(fn, says=""):
        try:
            fn()
            return "none"
        except Exception as exc:
            return type(exc).__name__ if says in str(exc) else f"{type(exc).__name__}: {exc}"

    with Reshape(operands[0], my_in, my_out) as r:
        r.plan()
        results.append(r.execute())
        r.reset_operand_unchecked(operands[1])
        results.append(r.execute())
        checks["unchecked reset used"] = matches(results[-1], piece(globs[1], my_out, "C"))
        if not symmetric:  # (a host array off the heap: with a symmetric plan that is a memory-kind error too)
            r.reset_operand_unchecked(wrong)
            checks["a wrong operand raises at execute"] = outcome(r.execute) == OperandMismatchError.__name__
            # (the message names what dropped it: the user never called release_operand())
            checks["and is dropped everywhere"] = outcome(
                r.execute, "after the execute() that refused the operand of reset_operand_unchecked()"
            ) == RuntimeStateError.__name__
        r.reset_operand(operands[2])
        results.append(r.execute())
        checks["checked reset after"] = matches(results[-1], piece(globs[2], my_out, "C"))
    r2 = Reshape(operands[0], my_in, my_out)
    r2.free()
    checks["unchecked reset after free raises here"] = outcome(lambda: r2.reset_operand_unchecked(operands[1])) \
        == RuntimeStateError.__name__
    if symmetric:
        dask_pgas.free_symmetric_memory(*results, *operands)
    failed = [name for name, ok in checks.items() if not ok]
    assert all_ok(not failed), f"rank {RANK}: {failed or 'another rank failed'}"


def result_memory_order():
    """Operands that are both C- and F-contiguous (one row each) give C-ordered results, as NumPy would."""
    n = 2 * SIZE
    glob = np.arange(SIZE * n, dtype=np.float64).reshape(SIZE, n)
    my_in, my_out = Box((RANK, 0), (RANK + 1, n)), Box((0, 2 * RANK), (SIZE, 2 * RANK + 2))  # rows -> columns
    out = dask_pgas.reshape.reshape(piece(glob, my_in, "C"), my_in, my_out)
    ok = out.flags.c_contiguous and np.array_equal(out, piece(glob, my_out, "C"))
    assert all_ok(ok), f"rank {RANK}: the result of C- and F-contiguous operands is not C-ordered"
    # Strided views of F-ordered arrays (increasing strides, neither C- nor F-contiguous) give an F-ordered
    # result, as nvmath orders by strides; views of C-ordered ones a C-ordered result.
    glob = np.arange(4 * SIZE * n, dtype=np.float64).reshape(2 * SIZE, 2 * n)
    my_in, my_out = Box((2 * RANK, 0), (2 * RANK + 2, 2 * n)), Box((0, 4 * RANK), (2 * SIZE, 4 * RANK + 4))
    for order in ("F", "C"):
        wide = np.zeros((2, 4 * n), order=order)  # every other column is the operand
        operand = wide[:, ::2]
        operand[...] = piece(glob, my_in, "C")
        out = dask_pgas.reshape.reshape(operand, my_in, my_out)
        ok = (not operand.flags.c_contiguous and not operand.flags.f_contiguous
              and out.flags[f"{order}_CONTIGUOUS"] and np.array_equal(out, piece(glob, my_out, "C")))
        assert all_ok(ok), f"rank {RANK}: the result of {order}-strided views is not {order}-ordered and right"


if opts.package == "numpy":  # (host operands: the MPI engine)
    result_memory_order()
fixed_cases()
unchecked_resets()
if opts.package == "numpy":
    nvmath_names()
if opts.package == "torch-cpu":
    torch_cpu_rules()
test_random_layouts()
test_slabs()
usage = dask_pgas.heap_usage()
assert usage["allocations"] == 0, f"symmetric memory leaked: {usage}"
dask_pgas.finalize()
report_ok(examples=opts.examples, backend=opts.backend, package=opts.package,
          **({} if opts.seed is None else {"seed": opts.seed}))
