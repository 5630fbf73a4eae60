"""pgas rechunk on a local MPI-backed cluster (3 worker ranks by default, ``DASK_PGAS_TEST_WORKERS``), against NumPy
and Dask's own rechunk."""

from __future__ import annotations

import re
import threading

import dask
import dask.array as da
import numpy as np
import pytest
from distributed import wait
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dask_pgas
from dask_pgas.errors import CollectiveError, UnsupportedOperandError
from dask_pgas.integration import PGASRechunkUnsupported

from ._xp import BACKEND, GPU_WORKERS, NWORKERS, chunk_type, host, on_device

pytestmark = [pytest.mark.dask, pytest.mark.timeout(300)]

# structs, with string fields too (CPU only): dtlib maps a field 'S2' to one MPI_CHAR, yet every byte must travel
STRUCTS = [np.dtype([("a", "<i4"), ("b", "<f8")]), np.dtype([("a", "<i2"), ("b", "S2")]),
           np.dtype([("a", "<i4"), ("b", "U3")])]
DTYPES = ["float64", "float32", "int16", "uint8", "complex64", "bool"] + ([] if GPU_WORKERS else [">i4", *STRUCTS])
cpu_only = pytest.mark.skipif(bool(GPU_WORKERS), reason="checks NumPy-chunk behaviour of the CPU world")


@pytest.fixture
def collective_plans():
    """Plans go through the collective even where they are local (``pgas.local-rechunk: False``): the tests of
    collective runs test one on a world of any size (on one PE every plan is local, on two some of theirs)."""
    with dask.config.set({"pgas.local-rechunk": False}):
        yield


def _chunks_for(draw, n):
    sizes, left = [], n
    while left:
        c = draw(st.integers(1, left))
        sizes.append(c)
        left -= c
    return tuple(sizes)


@st.composite
def cases(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 24 if ndim > 1 else 200)) for _ in range(ndim))
    dtype = draw(st.sampled_from(DTYPES))
    cin = tuple(_chunks_for(draw, n) for n in shape)
    cout = tuple(_chunks_for(draw, n) for n in shape)
    local = draw(st.booleans())  # pgas.local-rechunk: False sends even local plans through the collective
    return shape, np.dtype(dtype), cin, cout, local


class _tasks_run:
    """The keys of the tasks that finish inside a ``with`` block, read from the scheduler's task-stream record by
    its append count. (``get_task_stream`` of distributed 2025.1 picks records by their workers' stop times,
    shifted by an estimated clock offset: the last task of a ``wait`` just before the block was counted now and
    then; distributed 2026.8 counts appends, as here.)"""

    def __init__(self, client):
        self.client, self.keys = client, []

    def __enter__(self):
        def since(dask_scheduler, start=None):  # (a local function: pickled by value, for the scheduler's process)
            from distributed.diagnostics.task_stream import TaskStreamPlugin

            if TaskStreamPlugin.name not in dask_scheduler.plugins:
                dask_scheduler.add_plugin(TaskStreamPlugin(dask_scheduler))
            plugin = dask_scheduler.plugins[TaskStreamPlugin.name]
            if start is None:
                return plugin.index
            new = plugin.index - start
            assert new <= len(plugin.buffer), "the task stream dropped records: a longer stream is needed"
            return [record["key"] for record in list(plugin.buffer)[len(plugin.buffer) - new:]]

        self.since = since
        self.start = self.client.run_on_scheduler(since)
        return self

    def __exit__(self, *exc):
        keys = self.client.run_on_scheduler(self.since, start=self.start)
        self.keys = [tuple(k) if isinstance(k, list) else k for k in keys]  # (a tuple key may travel as a list)


def _reference(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.random(shape) * 100).astype(dtype)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=cases())
def test_matches_numpy(client, case):
    shape, dtype, cin, cout, local = case
    ref = _reference(shape, dtype)
    x = on_device(da.from_array(ref, chunks=cin))
    with dask.config.set({"pgas.local-rechunk": local}):
        y = dask_pgas.rechunk(x, cout)
    assert y.chunks == cout
    assert y.dtype == dtype and type(y._meta) is chunk_type()
    out = y.compute()
    if cout == cin:
        # as Dask: the array itself, whose non-contiguous from_array chunks a cluster computes in native byte
        # order (docs/upstream-byteorder.md); what pgas writes keeps the declared one
        assert y is x
        assert out.dtype in (dtype, dtype.newbyteorder("=")) and isinstance(out, chunk_type())
    else:
        assert out.dtype == dtype and isinstance(out, chunk_type())
    np.testing.assert_array_equal(host(out), ref)


@cpu_only
def test_the_array_s_own_chunks_give_the_array_itself(client):
    """As Dask: no rechunk at all (hypothesis met it with a big-endian array in column blocks, whose chunks the
    cluster computes in native byte order: see docs/upstream-byteorder.md)."""
    ref = _reference((13, 2), ">i4")
    x = da.from_array(ref, chunks=((7, 6), (1, 1)))
    for local in (False, True):
        with dask.config.set({"pgas.local-rechunk": local}):
            assert dask_pgas.rechunk(x, ((7, 6), (1, 1))) is x
            assert dask_pgas.rechunk(x, {0: (7, 6)}) is x
    y = dask_pgas.rechunk(x, ((13,), (1, 1)))  # a real one keeps the declared byte order
    assert y.compute().dtype == np.dtype(">i4")
    np.testing.assert_array_equal(y.compute(), ref)


@pytest.mark.parametrize(
    "spec",
    [{0: 7}, {1: -1}, {0: None, 1: 5}, (None, 9), -1, "auto", 13, ((10, 20, 30, 40), (50,))],
)
def test_chunk_forms_like_dask(client, spec):
    ref = _reference((100, 50), "float64")
    x = on_device(da.from_array(ref, chunks=(10, 25)))
    y = dask_pgas.rechunk(x, spec)
    assert y.chunks == x.rechunk(spec, method="tasks").chunks
    np.testing.assert_array_equal(host(y.compute()), ref)


def test_balance_and_limit(client):
    x = on_device(da.ones((1000, 10), chunks=(100, 10)))
    y = dask_pgas.rechunk(x, (400, -1), balance=True)
    assert y.chunks == x.rechunk((400, -1), balance=True, method="tasks").chunks
    y = dask_pgas.rechunk(x, {0: "auto"}, block_size_limit=8000)
    assert y.chunks == x.rechunk({0: "auto"}, block_size_limit=8000, method="tasks").chunks
    assert float(y.sum().compute()) == 10000


def test_same_chunks_is_noop(client):
    x = da.ones((10, 10), chunks=5)
    assert dask_pgas.rechunk(x, 5) is x


def test_same_unknown_chunks_is_noop(client):
    """Like Dask: a target equal to the current chunks returns the array itself, also with NaN chunk sizes."""
    x = da.ones((20, 4), chunks=5)
    nan = x[x[:, 0] > 0]
    for spec in (nan.chunks, {0: None}, (None, 4)):
        assert nan.rechunk(spec, method="tasks") is nan
        assert dask_pgas.rechunk(nan, spec) is nan


@cpu_only
@pytest.mark.parametrize("local", [True, False])
@pytest.mark.parametrize("dtype", STRUCTS, ids=str)
def test_structured_dtypes(client, dtype, local):
    """Struct dtypes keep their fields (not '|V12') through the collective and the local path, string fields
    byte for byte."""
    ref = _reference((60, 6), dtype)
    x = da.from_array(ref, chunks=(20, 6))
    with dask.config.set({"pgas.local-rechunk": local}):
        for target in ((7, 6), (10, 3)):  # an exchange, and a plan that is local with local-rechunk on
            y = dask_pgas.rechunk(x, target)
            assert y.name.startswith("pgas-rechunk-") and y.dtype == dtype
            out = y.compute()
            assert out.dtype == dtype
            np.testing.assert_array_equal(out, ref)


@cpu_only
def test_structs_with_padding_in_pooled_output_boxes(client):
    """An aligned struct and Dask's own field selection x[["a", "c"]] (a dtype with offsets), in output boxes big
    enough for the worker's output pool, which once lost their padding: the engine refused the box after the
    run's agreement, on some PEs only, and the world broke."""
    n = 2**17
    rec = np.zeros((3, n), [("a", "<i4"), ("b", "<f8"), ("c", "<i4")])
    rec["a"] = np.arange(3 * n).reshape(3, n)
    rec["c"] = -rec["a"]
    aligned = np.zeros((3, n), np.dtype([("a", "u1"), ("b", "<f8")], align=True))
    aligned["a"], aligned["b"] = rec["a"] % 251, rec["a"] * 0.5
    for x, ref in ((da.from_array(rec, chunks=(3, n // 4))[["a", "c"]], rec[["a", "c"]]),
                   (da.from_array(aligned, chunks=(3, n // 4)), aligned)):
        y = dask_pgas.rechunk(x, (1, n))
        assert y.dtype == ref.dtype
        out = y.compute()
        assert out.dtype == ref.dtype
        for field in ref.dtype.names:
            np.testing.assert_array_equal(out[field], ref[field])
    assert not dask_pgas.world().broken


@cpu_only
@pytest.mark.parametrize("chunks", [10, 20], ids=["pack", "zero-copy"])
def test_masked_arrays_follow_fallback(client, chunks):
    """The collective moves data, not masks: masked arrays follow pgas.fallback. (One 20-element chunk per PE
    once went zero-copy into the collective and broke the world.)"""
    ref = np.ma.masked_array(np.arange(60.0), mask=np.arange(60) % 3 == 0)
    x = da.from_array(ref, chunks=chunks, asarray=False)
    assert isinstance(x._meta, np.ma.MaskedArray)
    with pytest.raises(PGASRechunkUnsupported, match="masked"):
        dask_pgas.rechunk(x, 7)
    with dask.config.set({"pgas.fallback": "tasks"}):
        y = dask_pgas.rechunk(x, 7)
    expect = x.rechunk(7, method="tasks")
    assert not y.name.startswith("pgas") and y.chunks == expect.chunks
    got, want = y.compute(), expect.compute()
    assert isinstance(got, np.ma.MaskedArray) and np.ma.count_masked(got) == 20
    np.testing.assert_array_equal(np.ma.getmaskarray(got), np.ma.getmaskarray(want))
    np.testing.assert_array_equal(got.data, ref.data)
    # the world is intact and the collective still runs
    assert dask_pgas.world(client).broken is None
    plain = da.from_array(ref.data, chunks=chunks)
    np.testing.assert_array_equal(dask_pgas.rechunk(plain, 7).compute(), ref.data)


@cpu_only
@pytest.mark.parametrize("local", [True, False])
def test_masked_chunks_under_a_plain_meta_are_refused(client, local):
    """Chunks that are masked arrays under a plain ndarray _meta (Dask's default for map_blocks or from_delayed):
    the rechunk ran and dropped the masks (sums differed from tasks'). It now fails clearly, before any data
    moves, and the world and the input stay usable."""
    x = da.arange(60.0, chunks=20).map_blocks(np.ma.masked_greater, 50.0, meta=np.array(()))
    assert type(x._meta) is np.ndarray
    with dask.config.set({"pgas.local-rechunk": local}):
        with pytest.raises(UnsupportedOperandError, match="masked array, but the Dask array's meta is a plain ndarray"):
            dask_pgas.rechunk(x, 7).compute()
    assert dask_pgas.world(client).broken is None
    assert np.ma.count_masked(x.rechunk(7, method="tasks").compute()) == 9
    np.testing.assert_array_equal(dask_pgas.rechunk(da.arange(60.0, chunks=20), 7).compute(), np.arange(60.0))


@cpu_only
@pytest.mark.parametrize("local", [True, False])
def test_empty_output_chunks_keep_the_dtype(client, local):
    """Output chunks of zero size are made from the array's meta: they have its dtype (a string one here)."""
    ref = np.array([["ab", "cde", "f"]] * 4, dtype="U3")
    x = da.from_array(ref, chunks=(4, 1)).persist()
    with dask.config.set({"pgas.local-rechunk": local}):
        y = dask_pgas.rechunk(x, ((4,), (0, 2, 0, 1)))
        for j in (0, 2):
            got = y.blocks[0, j].compute()
            assert got.shape == (4, 0) and got.dtype == np.dtype("U3"), (j, got.dtype)
        np.testing.assert_array_equal(y.compute(), ref)


def test_recorded_owners_are_where_the_output_chunks_land(client):
    """The owners recorded for a rechunk's output (which place a next rechunk of it) are the PEs that hold
    its chunks once persisted."""
    from distributed import wait

    from dask_pgas.integration import _rechunk

    w = dask_pgas.world(client)
    n = 6 * max(w.npes, 2)  # (on one PE, 6 x 6 in one chunk would stay as it is: no rechunk, nothing recorded)
    x = on_device(da.from_array(_reference((n, n), "float64"), chunks=(n, 6))).persist()
    y = dask_pgas.rechunk(x, (6, n)).persist()
    assert y.name != x.name
    wait(y)
    pe_of = {addr: pe for pe, addr in enumerate(w.workers)}
    held = {key[1:]: pe_of[addrs[0]] for key, addrs in client.who_has(y).items()}
    assert _rechunk._owners[y.name] == held


@cpu_only
@pytest.mark.parametrize("local", [True, False])
def test_chunks_that_are_no_arrays_are_refused_by_name(client, local):
    """Chunks that are not arrays under an ndarray _meta (a map_blocks that returns lists) failed on the workers
    with "'list' object has no attribute 'dtype'"; the error now says what the chunk is and what to do."""
    x = da.arange(60.0, chunks=20).map_blocks(lambda b: b.tolist(), meta=np.array(()))
    with dask.config.set({"pgas.local-rechunk": local}):
        with pytest.raises(UnsupportedOperandError,
                           match=r"a chunk is a builtins\.list, but the Dask array's meta says numpy"):
            dask_pgas.rechunk(x, 7).compute()
    assert dask_pgas.world(client).broken is None


@pytest.mark.parametrize("local", [True, False])
def test_chunks_of_another_dtype_are_cast_only_when_no_value_is_lost(client, local):
    """Chunks whose dtype differs from the one declared (map_blocks(..., dtype=...) that lies): the rechunk cast
    them silently, truncating 2.75 to 2 where Dask's rechunk moves them unchanged. A cast that can lose data now
    fails clearly before any data moves; one that keeps every value (float32 into float64) is done."""
    ref = np.full((20, 12), 2.75)
    x = on_device(da.from_array(ref, chunks=(20, 4)))
    lying = x.map_blocks(lambda b: b, dtype="int32")  # the chunks stay float64
    with dask.config.set({"pgas.local-rechunk": local}):
        with pytest.raises(UnsupportedOperandError, match="casting float64 to int32 can lose or change values"):
            dask_pgas.rechunk(lying, (5, 12)).compute()
        narrow = x.map_blocks(lambda b: b.astype("float32"), dtype="float64")  # widened: every value kept
        got = dask_pgas.rechunk(narrow, (5, 12)).compute()
        # NumPy counts int64 -> float64 as "safe", but it rounds above 2**53: 2**53 + 1 came back as 2**53
        big = on_device(da.from_array(np.arange(2**53, 2**53 + 240).reshape(20, 12), chunks=(20, 4)))
        with pytest.raises(UnsupportedOperandError, match="casting int64 to float64 can lose or change values"):
            dask_pgas.rechunk(big.map_blocks(lambda b: b, dtype="float64"), (5, 12)).compute()
        # "safe" for NumPy, but bytes under a str dtype were decoded: b"\xff" raised a UnicodeDecodeError, whose
        # agreed error could not be made from one message, and that broke the world
        if not GPU_WORKERS:  # (CuPy has no string dtypes)
            raw = da.from_array(np.full((20, 12), b"\xff\xfe", dtype="S2"), chunks=(20, 4))
            with pytest.raises(UnsupportedOperandError, match=r"casting \|S2 to <U2 can lose or change values"):
                dask_pgas.rechunk(raw.map_blocks(lambda b: b, dtype="U2"), (5, 12)).compute()
    assert got.dtype == np.float64
    np.testing.assert_array_equal(host(got), ref)
    assert dask_pgas.world(client).broken is None


@pytest.mark.parametrize("local", [True, False])
def test_chunks_smaller_than_declared_are_refused(client, local):
    """A map_blocks whose blocks are narrower than the chunks it declares: the copies broadcast a (20, 1) block
    over the declared (20, 4), making up values where Dask's rechunk gives a visibly wrong shape."""
    x = on_device(da.from_array(np.arange(240.0).reshape(20, 12), chunks=(20, 4)))
    thin = x.map_blocks(lambda b: b[:, :1])  # declares (20, 4) blocks, returns (20, 1)
    with dask.config.set({"pgas.local-rechunk": local}):
        # (5, 12) moves data between PEs; (10, 4) stays on each PE: a local plan's tasks where local is on
        for chunks in ((5, 12), (10, 4)):
            with pytest.raises(UnsupportedOperandError,
                               match=r"a chunk has shape \(20, 1\), but the Dask array's chunks need"):
                dask_pgas.rechunk(thin, chunks).compute()
        np.testing.assert_array_equal(host(dask_pgas.rechunk(x, (5, 12)).compute()), np.arange(240.0).reshape(20, 12))
    assert dask_pgas.world(client).broken is None


@cpu_only
def test_fallback_chunks_equal_dasks_with_balance(client):
    """A fallback rechunks the caller's chunks with Dask's own rechunk: balancing twice gave other chunks."""
    cases = [
        (da.from_array(np.arange(7).astype(object), chunks=1), 2),  # object dtype
        (da.from_array(np.arange(10).astype(object), chunks=1), 3),
        (da.from_array(np.ma.masked_array(np.arange(7.0), mask=np.arange(7) % 2 == 0), chunks=1, asarray=False), 2),
    ]
    with dask.config.set({"pgas.fallback": "tasks"}):
        for x, spec in cases:
            expect = x.rechunk(spec, balance=True, method="tasks")
            y = dask_pgas.rechunk(x, spec, balance=True)
            assert y.chunks == expect.chunks, (x, spec)
            assert y.name == expect.name


def _incoming(client) -> int:
    return sum(client.run(lambda dask_worker: sum(e["total"] for e in dask_worker.transfer_incoming_log)).values())


def _moved_by_dask(client, make):
    """Bytes Dask moved between workers while ``make()`` was persisted, and the persisted result."""
    before = _incoming(client)
    y = make().persist()
    wait(y)
    return _incoming(client) - before, y


def test_output_chunks_on_owner_and_no_transfer_of_placed_input(client):
    world = dask_pgas.world(client)
    p = world.npes
    n = 60 * p
    x = on_device(da.random.random((n, n), chunks=(n, n // p))).persist()
    wait(x)
    moved, y = _moved_by_dask(client, lambda: dask_pgas.rechunk(x, (n // p, n)))
    assert moved < 10_000, f"Dask moved {moved} bytes of an already placed input"
    # every output chunk sits on one worker, the owner of its box; PEs each own one row slab here
    who = client.who_has(y)
    holders = [tuple(v) for v in who.values()]
    assert all(len(h) == 1 for h in holders)
    assert len({h[0] for h in holders}) == p
    assert {h[0] for h in holders} <= set(world.workers)
    # and back: the earlier pgas output's placement is known, nothing moves through Dask either
    moved, z = _moved_by_dask(client, lambda: dask_pgas.rechunk(y, (n, n // p)))
    assert moved < 10_000
    np.testing.assert_array_equal(host(z.compute()), host(x.compute()))


def test_chunk_cut_between_pes_ships_only_the_pieces(client):
    """One input chunk on one worker, cut into every PE's input box: Dask moves each PE its piece, not the
    whole chunk to every PE that takes a part of it."""
    world = dask_pgas.world(client)
    p = world.npes
    n = 90 * p
    x = on_device(da.random.random((n, n), chunks=(n, n))).persist()
    wait(x)
    moved, y = _moved_by_dask(client, lambda: dask_pgas.rechunk(x, (n // p, n)))
    nbytes = n * n * 8
    # the pieces of the other PEs: (p - 1) / p of the array (whole-chunk shipping moved (p - 1) times it)
    assert moved <= nbytes * (p - 1) / p + 100_000, f"Dask moved {moved} bytes for a {nbytes}-byte array"
    np.testing.assert_array_equal(host(y.compute()), host(x.compute()))
    if p == 1:  # (nothing to cut: the rechunk is x itself)
        return
    # a chunk shorter than declared is refused where it is cut, naming its own shape, not the piece's
    short = x.map_blocks(lambda block: block[:-1], dtype=x.dtype, meta=x._meta)
    with pytest.raises(UnsupportedOperandError, match=rf"a chunk has shape \({n - 1}, {n}\), but the Dask "
                       rf"array's chunks need at least \({n}, {n}\)"):
        dask_pgas.rechunk(short, (n // p, n)).compute()
    # and one that is no array, by name (slicing a list by a tuple failed with Python's own TypeError)
    lists = x.map_blocks(lambda block: block.tolist(), meta=x._meta)
    with pytest.raises(UnsupportedOperandError, match=r"a chunk is a builtins\.list"):
        dask_pgas.rechunk(lists, (n // p, n)).compute()
    assert dask_pgas.world(client).broken is None


def _runs(client) -> int:
    return sum(client.run(lambda dask_worker: dask_worker.plugins["dask-pgas"].runs).values())


@pytest.mark.parametrize("local", [True, False])
def test_local_plan_needs_no_collective(client, local):
    """Each PE's output chunks lie inside its own input slab: nothing crosses PEs, so by default no collective
    runs and Dask moves nothing; the output chunks are built on the PE that holds the slab."""
    p = dask_pgas.world(client).npes
    n = 40 * p
    ref = _reference((n, n), "float64")
    x = on_device(da.from_array(ref, chunks=(n, n // p))).persist()
    wait(x)
    slab_on = {k[2]: next(iter(v)) for k, v in client.who_has(x).items()}
    runs = _runs(client)
    before = client.run(lambda dask_worker: sum(e["total"] for e in dask_worker.transfer_incoming_log))
    with dask.config.set({"pgas.local-rechunk": local}):
        y = dask_pgas.rechunk(x, ((n // 4, n // 4, n // 2), n // p)).persist()
    wait(y)
    after = client.run(lambda dask_worker: sum(e["total"] for e in dask_worker.transfer_incoming_log))
    assert _runs(client) == runs + (0 if local else p)  # one run per PE
    assert sum(after.values()) - sum(before.values()) < 10_000
    for key, holders in client.who_has(y).items():
        assert list(holders) == [slab_on[key[2]]]
    np.testing.assert_array_equal(host(y.compute()), ref)


def test_lazy_composable(client):
    dask_pgas.install()
    try:
        ref = _reference((90, 60), "float64")
        x = on_device(da.from_array(ref, chunks=(90, 20)))
        total = (x.rechunk((30, 60), method="pgas") + 1).sum().compute()
        assert np.isclose(float(total), (ref + 1).sum())
        # two pgas rechunks in one graph
        a = x.rechunk((30, 60), method="pgas")
        b = (x * 2).rechunk((45, 30), method="pgas")
        got = (a + b.rechunk((30, 60), method="pgas")).compute()
        np.testing.assert_array_equal(host(got), 3 * ref)
        # persist, then keep computing on it
        p = a.persist()
        np.testing.assert_allclose(host((p.T @ p).compute()), ref.T @ ref)
    finally:
        dask_pgas.uninstall()


def _run_in_threads(work, n: int, timeout: float = 240) -> None:
    """``work(0)`` ... ``work(n - 1)`` at once, each in its own thread; fails if one raises or is still running
    after ``timeout`` seconds (a thread's exception only warned, and a hung thread went unnoticed)."""
    import time

    raised = []

    def run(i):
        try:
            work(i)
        except BaseException as exc:
            raised.append((i, exc))

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not raised, raised
    assert not [t for t in threads if t.is_alive()], f"threads still running after {timeout}s"


def test_concurrent_rechunks_from_two_threads(client):
    ref = _reference((120, 90), "float32")
    x = on_device(da.from_array(ref, chunks=(120, 10)))
    errors, results = [], {}

    def work(i):
        try:
            for k in range(4):
                y = dask_pgas.rechunk(x + i, (7 + i + k, 90))
                results[(i, k)] = y.compute()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    _run_in_threads(work, 2)
    assert not errors, errors
    assert len(results) == 8, sorted(results)
    for (i, _), got in results.items():
        np.testing.assert_array_equal(host(got), ref + i)


def _bookkeeping(client) -> dict:
    """What the scheduler and worker plugins still hold about rechunks (all empty when nothing is in flight)."""

    def scheduler_side(dask_scheduler):
        plugin = dask_scheduler.plugins["dask-pgas"]
        names = ("_runs", "_detached", "_finished", "_ready", "_pinned", "_barriers", "_last_seq")
        return {name: len(getattr(plugin, name)) for name in names}

    def worker_side(dask_worker):
        plugin = dask_worker.plugins["dask-pgas"]
        return {name: len(getattr(plugin, name)) for name in ("_done", "_dropped", "_staged", "_pending", "_run_of")}

    held = {"scheduler": client.run_on_scheduler(scheduler_side), **client.run(worker_side)}
    return {where: {k: n for k, n in counts.items() if n} for where, counts in held.items()}


def test_a_rechunk_passed_to_delayed_runs_its_collective(client, collective_plans):
    """``dask.delayed(f)(y)`` renames every task of y's graph and wraps each in a plain task (dask's
    ``ProhibitReuse``): the pinned tasks lost their pinning, and the renamed barrier was never recognised, so the
    run failed and left its staged inputs on the workers. Unwrapped by the scheduler plugin, the renamed graph
    runs its own collective, also beside the original's in one compute, and leaves nothing behind."""
    import time

    ref = _reference((24, 30), "float64")
    x = on_device(da.from_array(ref, chunks=(5, 7)))
    y = dask_pgas.rechunk(x, (8, 10))
    assert float(dask.delayed(lambda a: float(a.sum()))(y).compute()) == ref.sum()
    assert float(dask.delayed(lambda a: float(a[:5, 3:].sum()))(y[:5]).compute()) == ref[:5, 3:].sum()
    whole, total = dask.compute(y, dask.delayed(lambda a: float(a.sum()))(y))
    np.testing.assert_array_equal(host(whole), ref)
    assert total == ref.sum()
    del whole
    deadline = time.monotonic() + 30
    while (held := _bookkeeping(client)) != {"scheduler": {}, **{w: {} for w in client.run(lambda: 0)}}:
        assert time.monotonic() < deadline, held
        time.sleep(0.1)


def test_random_rechunks_cancels_and_chains_from_threads_leave_nothing_behind(client):
    """Three threads mix rechunks of persisted and lazy inputs, cancels followed by a recompute, chains of two
    rechunks, persists and runs through the collective; every result equals NumPy, and once all is released
    neither the scheduler nor any worker keeps a run, a staged input, a result or a pin."""
    import random
    import time

    ref = _reference((120, 90), "float64")
    errors, done = [], []
    config_lock = threading.Lock()

    def work(seed):
        rng = random.Random(seed)
        for i in range(10):
            done.append((seed, i))
            cin = (rng.choice([10, 30, 40, 120]), rng.choice([9, 30, 45, 90]))
            cout = (rng.choice([7, 20, 60, 120]), rng.choice([10, 30, 90]))
            x = on_device(da.from_array(ref, chunks=cin))
            if rng.random() < 0.3:
                x = x.persist()
            y = dask_pgas.rechunk(x, cout)
            op = rng.random()
            try:
                if op < 0.25:
                    fut = client.compute(y)
                    time.sleep(rng.uniform(0, 0.03))
                    fut.cancel()
                    np.testing.assert_array_equal(host(y.compute()), ref)
                elif op < 0.5:
                    np.testing.assert_array_equal(host((dask_pgas.rechunk(y, cin) + 1).compute()), ref + 1)
                elif op < 0.75:
                    kept = y.persist()
                    np.testing.assert_array_equal(host(kept.compute()), ref)
                    del kept
                else:  # (dask.config is global: threads that set and restore it at once left it False for
                    # the rest of the session; the setting is read when the graph is built)
                    with config_lock, dask.config.set({"pgas.local-rechunk": False}):
                        collective = dask_pgas.rechunk(x, cout)
                    np.testing.assert_array_equal(host(collective.compute()), ref)
            except Exception as exc:  # pragma: no cover - reported below
                errors.append((seed, i, op, cin, cout, exc))

    _run_in_threads(work, 3)
    assert not errors, errors
    assert len(done) == 30, sorted(done)
    deadline = time.monotonic() + 30
    while any(_bookkeeping(client).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any((held := _bookkeeping(client)).values()), held
    assert dask_pgas.world(client).broken is None


@cpu_only
def test_install_dispatch_and_passthrough(client):
    x = da.ones((40, 40), chunks=(40, 10))
    assert not dask_pgas.integration.installed()
    with pytest.raises(NotImplementedError):
        x.rechunk((10, 40), method="pgas")
    dask_pgas.install()
    dask_pgas.install()  # idempotent
    try:
        y = x.rechunk((10, 40), method="pgas")
        assert y.name.startswith("pgas-rechunk-")
        with dask.config.set({"array.rechunk.method": "pgas"}):
            assert x.rechunk((10, 40)).name.startswith("pgas-rechunk-")
            assert da.rechunk(x, (10, 40)).name.startswith("pgas-rechunk-")
        t = x.rechunk((10, 40), method="tasks")
        assert not any(str(k).startswith("('pgas") for k in dict(t.dask))
        p = x.rechunk((10, 40), method="p2p")
        assert "p2p" in p.name or "rechunk-p2p" in str(list(p.dask.layers))
        assert y.sum().compute() == 1600 and p.sum().compute() == 1600
    finally:
        dask_pgas.uninstall()
    assert not dask_pgas.integration.installed()


@cpu_only
def test_unsupported_cases_follow_fallback(client):
    x = da.ones((20, 20), chunks=5)
    nan = x[x[:, 0] > 0]  # unknown chunk sizes
    with pytest.raises(PGASRechunkUnsupported, match="compute_chunk_sizes"):  # chunks Dask could rechunk
        dask_pgas.rechunk(nan, {1: 10})
    with pytest.raises(ValueError, match="compute_chunk_sizes") as info:  # chunks Dask cannot: Dask's own error
        dask_pgas.rechunk(nan, (10, 10))
    assert not isinstance(info.value, PGASRechunkUnsupported)
    obj = da.from_array(np.array([object()] * 10, dtype=object), chunks=5)
    with pytest.raises(PGASRechunkUnsupported, match="objects"):
        dask_pgas.rechunk(obj, 10)
    record = da.from_array(np.zeros(10, [("a", "<i4"), ("b", "O")]), chunks=5)  # objects inside a struct
    with pytest.raises(PGASRechunkUnsupported, match="objects"):
        dask_pgas.rechunk(record, 10)
    with dask.config.set({"pgas.fallback": "tasks"}):
        y = dask_pgas.rechunk(nan, {1: 10})
        assert not y.name.startswith("pgas")
        assert y.chunks[1] == (10, 10)
    with dask.config.set({"pgas.fallback": "p2p"}):  # the method asked for, not tasks
        assert dask_pgas.rechunk(nan, {1: 10}).name == nan.rechunk({1: 10}, method="p2p").name
        assert dask_pgas.rechunk(nan, {1: 10}).name != nan.rechunk({1: 10}, method="tasks").name
    # balance=True with the chunks the array has: Dask's balanced chunks, not the array unchanged
    uneven = da.ones(10, chunks=((4, 4, 2),))
    assert dask_pgas.rechunk(uneven, uneven.chunks, balance=True).chunks == ((5, 5),)
    # the mode is fixed when dask.array is imported: the key set later changes nothing, in Dask or here
    with dask.config.set({"array.query-planning": True}):
        y = dask_pgas.rechunk(x, 10)
        assert y.name.startswith("pgas-rechunk-")
        assert y.chunks == x.rechunk(10, method="tasks").chunks
        assert float(y.sum().compute()) == 400
        assert not dask_pgas.integration.array_expr_mode()


@cpu_only
def test_argument_errors_and_edge_fallbacks_like_dask(client):
    """What Dask's rechunk refuses is refused the same way, with unknown chunk sizes too; an empty object-dtype
    array rechunks as Dask does; a fallback with ``balance=True`` warns once, as Dask alone does."""
    import warnings

    def same_error(array, spec, **kwargs):
        with pytest.raises(Exception) as theirs:
            array.rechunk(spec, method="tasks", **kwargs)
        with pytest.raises(type(theirs.value), match=re.escape(str(theirs.value))):
            dask_pgas.rechunk(array, spec, **kwargs)

    x = da.ones((12, 10), chunks=(12, 2))
    nan = x[x[:, 0] > 0]  # unknown chunk sizes along axis 0
    for spec in ({5: 2}, {1: (2, 2)}, {1: 2.5}, {0: (6, 6)}):  # Dask's own errors, not "compute_chunk_sizes()"
        same_error(nan, spec)
    same_error(nan, {1: 5}, block_size_limit="lots")
    for kwargs in ({"threshold": "bad"}, {"block_size_limit": "lots"}, {"block_size_limit": [1]}):
        same_error(x, (3, 10), **kwargs)
    # where Dask's rechunk does not look at them, neither does this: a no-op, one axis, unknown chunk sizes
    assert dask_pgas.rechunk(x, x.chunks, threshold="bad") is x
    line = da.ones(12, chunks=6)
    assert dask_pgas.rechunk(line, 4, threshold="bad", block_size_limit=[1]).chunks == ((4, 4, 4),)
    with dask.config.set({"pgas.fallback": "tasks"}):
        assert dask_pgas.rechunk(nan, {1: 5}, threshold="bad").chunks[1] == (5, 5)
    y = dask_pgas.rechunk(x, (3, 10), threshold=np.int64(4), block_size_limit=np.array(1e6))
    assert y.name.startswith("pgas-rechunk-") and float(y.sum().compute()) == 120
    empty = da.from_array(np.empty((0, 4), dtype=object), chunks=(1, 2))
    assert dask_pgas.rechunk(empty, (1, 4)).chunks == empty.rechunk((1, 4), method="tasks").chunks == ((0,), (4,))
    obj = da.from_array(np.array([object()] * 3, dtype=object), chunks=5)
    counts = []
    for run in (lambda: obj.rechunk((2,), balance=True, method="tasks"),
                lambda: dask_pgas.rechunk(obj, (2,), balance=True)):
        with dask.config.set({"pgas.fallback": "tasks"}), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
        counts.append(len(caught))
    assert counts[0] == counts[1] >= 1, counts
    if hasattr(np.dtypes, "StringDType"):  # NumPy 2: variable-width strings live outside the array
        strings = da.from_array(np.array(["a", "bb", "ccc"], dtype=np.dtypes.StringDType()), chunks=1)
        with pytest.raises(PGASRechunkUnsupported, match="fixed-width string dtype"):
            dask_pgas.rechunk(strings, 3)


_EXPR_SCRIPT = """
import sys
try:
    import dask, dask.array as da, numpy as np, pytest
except ImportError as e:  # dask < 2025.2 took array-expression mode from the separate dask-expr package
    if "dask_expr" in str(e):
        print("EXPR-UNAVAILABLE")
        sys.exit(0)
    raise
import dask_pgas
from dask_pgas.integration import PGASRechunkUnsupported
assert dask_pgas.integration.array_expr_mode()  # (da.array_expr_enabled() is dask >= 2025.5)
try:
    x = da.from_array(np.arange(64.0).reshape(8, 8), chunks=(8, 2))
except NotImplementedError:  # dask 2025.2's array expressions lack from_array
    print("EXPR-UNAVAILABLE")
    sys.exit(0)
with pytest.raises(PGASRechunkUnsupported, match="DASK_ARRAY__QUERY_PLANNING=False") as info:
    dask_pgas.rechunk(x, (2, 8))
assert "before dask.array is first imported" in str(info.value)
with pytest.raises(PGASRechunkUnsupported, match="array-expression mode"):
    dask_pgas.install()
assert not dask_pgas.integration.installed() and dask_pgas.integration.array_expr_mode()
with dask.config.set({"pgas.fallback": "tasks"}):
    y = dask_pgas.rechunk(x, (2, 8), balance=True)
expect = x.rechunk((2, 8), balance=True, method="tasks")
assert type(y) is type(x) and y.chunks == expect.chunks == ((2,) * 4, (8,))
np.testing.assert_array_equal(y.compute(), np.arange(64.0).reshape(8, 8))
print("EXPR-OK")
"""


def test_array_expression_mode_is_refused():
    """In array-expression mode (chosen when dask.array is imported) Array.rechunk never reaches
    dask.array.rechunk.rechunk: install() refuses, and rechunk follows pgas.fallback saying how to switch."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "DASK_ARRAY__QUERY_PLANNING": "True"}
    result = subprocess.run([sys.executable, "-c", _EXPR_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=120)
    if "EXPR-UNAVAILABLE" in result.stdout:
        pytest.skip("this dask has no usable array-expression mode (dask < 2025.3)")
    assert result.returncode == 0 and "EXPR-OK" in result.stdout, result.stdout + result.stderr


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=cases(), data=st.data())
def test_selections_match_numpy(client, case, data):
    """A selection of a pgas rechunk's result runs the exchange of the region it needs only (RechunkLayer's cull),
    or of everything when it needs every chunk; either way its values are NumPy's."""
    shape, dtype, cin, cout, local = case
    ref = _reference(shape, dtype)
    sel = []
    for n in shape:
        start = data.draw(st.integers(0, n - 1))
        sel.append(slice(start, data.draw(st.integers(start + 1, n)), data.draw(st.sampled_from([1, 1, 2]))))
    x = on_device(da.from_array(ref, chunks=cin))
    with dask.config.set({"pgas.local-rechunk": local}):
        y = dask_pgas.rechunk(x, cout)
    np.testing.assert_array_equal(host(y[tuple(sel)].compute()), ref[tuple(sel)])
    assert dask_pgas.world(client).broken is None


@pytest.mark.usefixtures("collective_plans")
def test_a_selection_runs_the_exchange_of_its_region_only(client):
    """y[:5].compute() computed every input chunk and ran the whole exchange (the barrier depends on every
    transfer task); now only the input chunks that meet the output chunks it needs, through a smaller run,
    whose output chunks lie on the PEs the full plan gives them."""
    from dask_pgas.integration._graph import RechunkLayer

    ref = _reference((60, 40), "float64")
    x = on_device(da.from_array(ref, chunks=(10, 20)))  # 12 chunks, 6 of them in rows 0-30
    y = dask_pgas.rechunk(x, (30, 40))
    assert isinstance(y.dask.layers[y.name], RechunkLayer)  # (a collective plan, not a local one)
    z = y[:5]
    culled = dict(z.__dask_graph__().cull(set(dask.core.flatten(z.__dask_keys__()))))
    assert sum(1 for k in culled if type(k) is tuple and k[0] == x.name) == 6
    with _tasks_run(client) as stream:
        np.testing.assert_array_equal(host(z.compute()), ref[:5])
    ran = stream.keys
    assert sum(1 for k in ran if type(k) is tuple and k[0] == x.name) == 6
    assert any(type(k) is str and k.startswith(f"pgas-barrier-{y.name[len('pgas-rechunk-'):]}-") for k in ran)
    # every output chunk: the whole run, as before
    np.testing.assert_array_equal(host(y.compute()), ref)
    assert dask_pgas.world(client).broken is None


@pytest.mark.usefixtures("collective_plans")
def test_a_selection_and_the_whole_result_computed_at_once_agree(client):
    """A selection's graph has output tasks of the whole rechunk's keys with other dependencies: computed at the
    same time, distributed keeps the first graph's tasks for the shared keys. Both results are right, in either
    order, and no run is left behind; so for two selections whose regions overlap."""
    from dask_pgas.integration._graph import RechunkLayer

    ref = _reference((60, 40), "float64")
    for order in ("whole first", "selection first", "two regions", "overlapping regions"):
        if order == "overlapping regions":  # (input rows of 15: a collective plan, not concatenations)
            y = dask_pgas.rechunk(on_device(da.from_array(ref, chunks=(15, 20))), (10, 40))
        else:
            y = dask_pgas.rechunk(on_device(da.from_array(ref, chunks=(10, 20))), (30, 40))
        assert isinstance(y.dask.layers[y.name], RechunkLayer), order  # (a collective plan)
        # (the block starts before the first compute: its barrier task may end while the second graph is built)
        with _tasks_run(client) as stream:
            if order == "whole first":
                futures, want = [client.compute(y), client.compute(y[:5])], [ref, ref[:5]]
            elif order == "selection first":
                futures, want = [client.compute(y[:5]), client.compute(y)], [ref[:5], ref]
            elif order == "two regions":
                futures, want = [client.compute(y[:5]), client.compute(y[40:])], [ref[:5], ref[40:]]
            else:  # rows 0-30 and 10-50: two region runs that share the output chunks of rows 10-30
                futures, want = [client.compute(y[:25]), client.compute(y[15:45])], [ref[:25], ref[15:45]]
            for got, expected in zip(client.gather(futures), want):
                np.testing.assert_array_equal(host(got), expected)
        del futures
        token = y.name[len("pgas-rechunk-"):]
        if order == "overlapping regions":  # two collective runs met on the shared keys: a region run and the
            # whole one (Dask 2026.8, whose cull sees the first region's tasks), or two region runs (2025.1)
            runs = {k for k in stream.keys if str(k).startswith(f"pgas-barrier-{token}")}
            assert len(runs) == 2, runs
        assert _no_tasks_left(client, token), order
    assert dask_pgas.world(client).broken is None


def _no_tasks_left(client, token: str) -> bool:
    """Whether the scheduler has forgotten every task of rechunk ``token`` (its release is asynchronous)."""
    import time

    def tasks_of(dask_scheduler, token=token):
        return [str(k) for k in dask_scheduler.tasks if token in str(k)]

    for _ in range(50):
        if not client.run_on_scheduler(tasks_of):
            return True
        time.sleep(0.1)
    return False


def test_a_selection_of_a_rechunk_the_client_persisted_reads_the_persisted_chunks(client):
    """client.persist(y), then y[:5] of the lazy y: the chunks are in memory with the whole run's tasks, and a
    region run's output tasks (the same keys, other dependencies) collided with them: distributed warned and kept
    the region run's transfer and barrier tasks on the scheduler for good. The selection now reads the
    persisted chunks, and runs nothing else."""
    ref = _reference((60, 40), "float64")
    y = dask_pgas.rechunk(on_device(da.from_array(ref, chunks=(10, 20))), (30, 40))
    held = client.persist(y)
    wait(held)
    with _tasks_run(client) as stream:
        np.testing.assert_array_equal(host(y[:5].compute()), ref[:5])
    assert not [k for k in stream.keys if "pgas" in str(k)]
    del held
    assert _no_tasks_left(client, y.name[len("pgas-rechunk-"):])
    # a selection held (or still computing), then the same selection again: the same region run, merged by
    # Dask (falling back to the whole run there made its tasks collide and stay)
    held = client.persist(y[:5])
    wait(held)
    np.testing.assert_array_equal(host(y[:5].compute()), ref[:5])
    future = client.compute(y[:5])
    np.testing.assert_array_equal(host((y[:5] + 1).compute()), ref[:5] + 1)
    np.testing.assert_array_equal(host(future.result()), ref[:5])
    del held, future
    assert _no_tasks_left(client, y.name[len("pgas-rechunk-"):])


def test_world_and_bootstrap_idempotent(client):
    w1 = dask_pgas.world(client)
    w2 = dask_pgas.bootstrap(client)
    assert w1 == w2 and w1.npes == NWORKERS and w1.backends == (BACKEND,)
    info = dask_pgas.world(client, detail=True)
    assert f"PE {NWORKERS - 1}" in str(info)
    # nvmath keeps the device initialize() was given: CPU workers give none (they reported 0)
    devices = set(client.run(lambda: dask_pgas.get_context().device_id).values())
    assert devices == ({None} if BACKEND == "mpi" else {0}), devices
    # sizes as Dask prints them (raw byte counts, "idle-output-blocks=16773632B", read badly)
    assert re.search(r"heap=\d+(\.\d+)? [kMG]?i?B runs=\d+ .* scratch=\d+(\.\d+)? [kMG]?i?B$", str(info), re.M), info
    assert set(info.info) == set(w1.workers)


def test_nvmaths_nccl_backend_is_dropped_at_bootstrap_with_a_warning(client):
    """backends=[..., "nccl"], as nvmath's examples pass it: the world's backends are the ones its workers run
    (it listed "nccl" beside them), and the warning reaches the caller (it stayed in the workers' logs)."""
    import warnings

    w1 = dask_pgas.world(client)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w2 = dask_pgas.bootstrap(client, backends=[*w1.backends, "nccl"])
    said = [(str(w.message), w.filename) for w in caught if "'nccl' is ignored" in str(w.message)]
    assert w2 == w1 and said and said[0][1] == __file__, said


def test_world_members_are_not_retired(client):
    w = dask_pgas.world(client)
    client.retire_workers(workers=[w.workers[0]], close_workers=False)
    assert w.workers[0] in client.scheduler_info()["workers"]
    assert dask_pgas.world(client).broken is None


def test_empty_and_zero_size_chunks(client):
    x = da.ones((0, 5), chunks=(1, 5))
    assert dask_pgas.rechunk(x, (1, 1)).shape == (0, 5)
    ref = _reference((10, 6), "float64")
    x = on_device(da.from_array(ref, chunks=((5, 0, 5), (6,))))
    np.testing.assert_array_equal(host(dask_pgas.rechunk(x, ((2, 8), (3, 0, 3))).compute()), ref)


@pytest.mark.usefixtures("collective_plans")
def test_bad_chunk_on_one_pe_fails_the_run_not_the_world(client):
    """A local failure while packing (here a chunk smaller than its declared shape) is agreed on by every PE
    before the collective: the rechunk raises, no PE is left waiting, and the world stays usable."""
    ref = _reference((60, 30), "float64")
    x = on_device(da.from_array(ref, chunks=(5, 30)))  # 12 chunks: none cut between 1, 2, 3 or 4 PEs

    def shrink_first(block, block_info=None):
        return block[:-1] if block_info[0]["chunk-location"][0] == 0 else block

    def plans():
        return {a: i["plans"] for a, i in dask_pgas.world(client, detail=True).info.items()}

    bad = x.map_blocks(shrink_first, dtype=x.dtype, meta=x._meta)  # lies about the shape of its first chunk
    before = plans()
    # One class whichever task reports it first (an output task, or the barrier after the run has ended: it
    # raised a CollectiveError of its own, and the PE's class could not be caught): the PE's own class, and a
    # CollectiveError of the run. Several times, as the order of the tasks' reports varies.
    for _ in range(4):
        with pytest.raises(UnsupportedOperandError, match=r"PE 0: UnsupportedOperandError: a chunk has shape "
                           r"\(4, 30\)") as info:
            dask_pgas.rechunk(bad, (60, 10)).compute()
        assert isinstance(info.value, CollectiveError)
    assert dask_pgas.world(client).broken is None
    assert plans() == before  # a run that failed its agreement keeps no plan, on any PE: the caches stay alike
    np.testing.assert_array_equal(host(dask_pgas.rechunk(x, (60, 10)).compute()), ref)


def test_a_failed_input_frees_the_staged_inputs_while_the_error_is_held(client):
    """One input chunk raises after the others were staged: the barrier errs, and the staged inputs must go at
    once, as Dask's own rechunk drops its intermediates (they stayed on the workers, outside Dask's memory
    accounting, for as long as the client held the erred result)."""
    import time

    from distributed import wait

    p = dask_pgas.world(client).npes
    ref = _reference((40, 20 * p), "float64")

    def late_failure(block, block_info=None):
        import time as _time

        if block_info[0]["chunk-location"][1] == p - 1:
            _time.sleep(1.0)  # the other PEs stage first
            raise RuntimeError("input failed on purpose")
        return block

    base = on_device(da.from_array(ref, chunks=(40, 20)))
    x = base.map_blocks(late_failure, dtype=ref.dtype, meta=base._meta)  # (CuPy chunks stay CuPy on GPU workers)
    fut = client.compute(dask_pgas.rechunk(x, (40 // p if p > 1 else 40, 20 * p)))
    wait(fut)
    assert fut.status == "error"

    def staged(dask_worker):
        return len(dask_worker.plugins["dask-pgas"]._staged)

    deadline = time.monotonic() + 10
    while sum(client.run(staged).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sum(client.run(staged).values()) == 0, client.run(staged)  # (the erred future is still held)
    del fut
    np.testing.assert_array_equal(host(dask_pgas.rechunk(on_device(da.from_array(ref, chunks=(40, 20))),
                                                         (40, 10)).compute()), ref)


def test_an_asynchronous_client_is_refused_on_its_event_loop_and_works_from_a_thread(client):
    """On an asynchronous client's event loop the client calls return coroutines: world() read that as 'no
    world', bootstrap() failed with a TypeError about a coroutine and rechunk() fell back saying the cluster
    had no world. They now say how to call them (in a thread), and that works."""
    import asyncio

    from distributed import Client

    epoch = dask_pgas.world(client).epoch
    x = on_device(da.from_array(_reference((20, 12), "float64"), chunks=(20, 4)))

    async def main():
        async with Client(client.scheduler.address, asynchronous=True) as ac:
            for name in ("world", "bootstrap", "teardown"):  # each names itself (all said bootstrap)
                with pytest.raises(TypeError, match=rf"asyncio\.to_thread\(dask_pgas\.{name}, client\)"):
                    getattr(dask_pgas, name)(ac)
            # a rechunk follows pgas.fallback (Dask's own rechunks of an app on the loop keep working with 'tasks')
            with pytest.raises(dask_pgas.errors.PGASRechunkUnsupported, match=r"asyncio\.to_thread"):
                dask_pgas.rechunk(x, (5, 12), client=ac)
            with dask.config.set({"pgas.fallback": "tasks"}):
                assert dask_pgas.rechunk(x, (5, 12), client=ac).name == x.rechunk((5, 12), method="tasks").name
            w = await asyncio.to_thread(dask_pgas.world, ac)
            y = await asyncio.to_thread(dask_pgas.rechunk, x, (5, 12), client=ac)
            return w, await ac.compute(y)

    w, result = asyncio.run(main())
    assert w is not None and w.epoch == epoch
    np.testing.assert_array_equal(host(result), _reference((20, 12), "float64"))


def test_cancelled_rechunk_computes_again(client, tmp_path):
    """Cancel a rechunk after one PE's transfer task is done, then compute it again with that PE last: the run
    must wait for every transfer of the new attempt (a stale 'ready' PE once started it too early)."""
    p = dask_pgas.world(client).npes
    if p < 2:
        pytest.skip("needs two PEs")
    import time

    flag = str(tmp_path / "second-attempt")
    ref = _reference((40, 20 * p), "float64")

    def paced(block, block_info=None):
        import os
        import time as _time

        first = block_info[0]["chunk-location"][1] == 0
        second_attempt = os.path.exists(flag)
        if first == second_attempt:  # attempt 1: block 0 fast, the rest slow; attempt 2: the other way round
            _time.sleep(1.5)
        return block

    x = on_device(da.from_array(ref, chunks=(40, 20)))
    x = x.map_blocks(paced, dtype=ref.dtype, meta=x._meta)
    y = dask_pgas.rechunk(x, (10, 20 * p))

    def transfers_in_memory(dask_scheduler):
        return sum(1 for k, ts in dask_scheduler.tasks.items()
                   if isinstance(k, tuple) and str(k[0]).startswith("pgas-transfer-") and ts.state == "memory")

    fut = client.compute(y)
    deadline = time.monotonic() + 60
    while client.run_on_scheduler(transfers_in_memory) == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    fut.cancel()
    del fut
    while client.run_on_scheduler(transfers_in_memory) and time.monotonic() < deadline:
        time.sleep(0.02)
    open(flag, "w").close()
    np.testing.assert_array_equal(host(y.compute()), ref)


def test_rechunk_cancelled_inside_its_collective_computes_again(client):
    """Cancel a rechunk while its collective runs (slowed by ``_delay``) and compute it again at once: the new
    attempt runs a collective of its own instead of being handed the cancelled run, whose result its workers had
    already been told to drop; afterwards no worker keeps the result of either run."""
    import time

    p = dask_pgas.world(client).npes
    if p < 2:
        pytest.skip("needs two PEs")
    ref = _reference((40, 20 * p), "float64")
    x = on_device(da.from_array(ref, chunks=(40, 20)))
    y = dask_pgas.rechunk(x, (10, 20 * p), _delay=1.5)

    def active_runs(dask_scheduler):
        return len(dask_scheduler.plugins["dask-pgas"]._runs)

    fut = client.compute(y)
    deadline = time.monotonic() + 60
    while client.run_on_scheduler(active_runs) == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not fut.done()
    fut.cancel()
    del fut
    np.testing.assert_array_equal(host(y.compute()), ref)

    def results_held(dask_worker):
        return len(dask_worker.plugins["dask-pgas"]._done)

    while sum(client.run(results_held).values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.run(results_held) == {w: 0 for w in dask_pgas.world(client).workers}
    assert dask_pgas.world(client).broken is None


@pytest.mark.parametrize("local", [True, False], ids=["local-plan", "collective"])
def test_computed_with_another_scheduler_says_so(client, local):
    """A pgas graph runs only on its cluster's workers: computed with the threaded scheduler it raises a clear
    error (it was distributed's bare ``ValueError('No worker found')``)."""
    from dask_pgas.errors import PGASWorldError

    x = on_device(da.arange(NWORKERS * 40, chunks=40).reshape(NWORKERS * 4, 10).rechunk((4, 10)))  # not persisted
    with dask.config.set({"pgas.local-rechunk": local}):
        y = dask_pgas.rechunk(x, (NWORKERS * 4, 5))
    with pytest.raises(PGASWorldError, match="another scheduler"):
        y.compute(scheduler="threads")
    assert host(y.compute()).sum() == host(x.sum().compute())  # the cluster computes it all the same


@pytest.mark.timeout(120)
@pytest.mark.parametrize("local", [True, False], ids=["local-plan", "collective"])
@pytest.mark.parametrize("other", [-1, 1], ids=["smaller", "larger"])
def test_built_for_a_cluster_of_another_size_says_so(client, monkeypatch, local, other):
    """A lazy pgas rechunk built with one cluster's client and computed on a cluster of another size (both
    worlds are #1) fails with that reason on the tasks it pins, not with "no input staged" from the collective
    of a PE the plan never had; the input stays computable and the world usable."""
    from dask_pgas.errors import PGASWorldError
    from dask_pgas.integration import _rechunk

    if NWORKERS + other < 1:
        pytest.skip("no smaller world than one PE")
    real = _rechunk._world

    def world_of_another_size(client, x=None):
        world = real(client, x)
        workers = list(world["workers"])
        world["workers"] = workers[:other] if other < 0 else workers + ["tcp://elsewhere:1"] * other
        return world

    x = on_device(da.arange(NWORKERS * 40, chunks=40).reshape(NWORKERS * 4, 10).rechunk((4, 10))).persist()
    with monkeypatch.context() as m, dask.config.set({"pgas.local-rechunk": local}):
        m.setattr(_rechunk, "_world", world_of_another_size)
        y = dask_pgas.rechunk(x, (NWORKERS * 4, 5))
    with pytest.raises(PGASWorldError, match=f"world of {NWORKERS + other} PEs but this cluster's world has "
                                             f"{NWORKERS}: it was built with another cluster's client"):
        y.compute()
    assert host(x.compute()).sum() == sum(range(NWORKERS * 40))
    assert dask_pgas.world(client).broken is None
    np.testing.assert_array_equal(host(dask_pgas.rechunk(x, (NWORKERS * 4, 5)).compute()), host(x.compute()))


@cpu_only
@pytest.mark.parametrize("shape, cin, spec", [
    ((), (), ()),                                          # 0-d
    ((0, 5), ((0,), (2, 3)), (None, 5)),                   # a zero-size axis
    ((3, 0, 4), ((1, 2), (0,), (4,)), (3, 0, 2)),
    ((6, 5), ((0, 3, 0, 3), (5,)), {0: 2, 1: (2, 0, 3)}),  # zero-length chunks in and out
    ((2, 3, 4, 5), ((1, 1), (3,), (1, 3), (5,)), (2, 1, 4, (2, 3))),  # 4-d, irregular
    ((1, 1, 1, 1, 1, 7), ((1,),) * 5 + ((3, 4),), (1, 1, 1, 1, 1, 7)),  # 6-d
])
@pytest.mark.parametrize("dtype", ["float16", "datetime64[ns]", ">M8[ns]", "timedelta64[s]", "S7", "U3"])
def test_edge_shapes_and_dtypes_like_dask(client, shape, cin, spec, dtype):
    """Shapes and dtypes at the edges (a parity review ran 541 such cases against Dask's tasks): the same
    chunks as Dask, the declared dtype kept (on a cluster the input's chunks of '>M8' arrive in native order,
    docs/upstream-byteorder.md, and Dask's own rechunk passes them on), every byte in place."""
    size = int(np.prod(shape))
    ref = (np.arange(size, dtype=np.int64) * 7919 % 1000).reshape(shape).astype(np.dtype(dtype))
    x = da.from_array(ref, chunks=cin) if shape else da.from_array(ref)
    y = dask_pgas.rechunk(x, spec)
    assert y.chunks == x.rechunk(spec, method="tasks").chunks
    out = y.compute()
    if y is not x:  # (a target equal to the input's chunks returns x itself, as in Dask: Dask computes that one)
        assert out.dtype == ref.dtype
    assert out.shape == ref.shape and out.astype(ref.dtype).tobytes() == ref.tobytes()
