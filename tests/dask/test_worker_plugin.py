"""The worker plugin's bookkeeping of runs and forgets, driven directly (no cluster)."""

from __future__ import annotations

import concurrent.futures
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("distributed")

from dask_pgas.errors import PGASWorldError
from dask_pgas.integration._worker_plugin import PGASWorkerPlugin

pytestmark = pytest.mark.dask


@pytest.fixture()
def plugin():
    worker = SimpleNamespace(handlers={}, stream_handlers={}, name="w0", address="tcp://w0")
    p = PGASWorkerPlugin()
    p.setup(worker)
    p.epoch, p.pe, p.npes = 1, 0, 2
    yield p
    p.teardown(worker)


def test_forget_after_the_run_ended_keeps_nothing(plugin):
    plugin._next_seq = 4
    plugin._done[3] = concurrent.futures.Future()
    plugin._signal(3, result="box")
    assert plugin._done[3].result() == "box"
    plugin._h_forget("pgas-rechunk-a", run=3, epoch=1)
    assert plugin._done == {} and plugin._dropped == set()


def test_forget_during_the_run_drops_its_result_and_wakes_waiters(plugin):
    plugin._next_seq = 4
    waiting = plugin._done[3] = concurrent.futures.Future()
    plugin._h_forget("pgas-rechunk-a", run=3, epoch=1)
    with pytest.raises(PGASWorldError, match="released before its collective ended"):
        waiting.result(timeout=1)
    assert plugin._dropped == {3}
    plugin._signal(3, result="box")  # the run ends: its result is not kept, and nothing is left behind
    assert plugin._done == {} and plugin._dropped == set()


def test_forget_before_the_run_started_here_marks_it_dropped(plugin):
    """A forget can overtake the start of its run. The run is marked dropped (so that, when it comes, it takes
    nothing a new attempt of the same rechunk staged since), and its output tasks find no result."""
    plugin._next_seq = 2
    plugin._h_forget("pgas-rechunk-a", run=3, epoch=1)
    assert plugin._dropped == {3}
    with pytest.raises(PGASWorldError, match="is not on"):  # an output task of the released attempt
        plugin.take("pgas-rechunk-a", 0, 1, 2, (), True, 3)
    assert plugin._done == {}


def test_forget_that_overtook_its_start_leaves_no_entry(plugin, monkeypatch):
    """The forget (batched stream) can arrive before the start (an RPC) of the run it names: the late start
    must not record the released run as the rechunk's newest, where nothing would ever remove it."""
    import asyncio

    def run(name, seq):
        plugin._signal(seq, result=None)
        return {"pe": 0, "seconds": 0.0}

    monkeypatch.setattr(plugin, "_run_and_signal", run)
    plugin._next_seq = 3
    plugin._h_forget("pgas-rechunk-a", run=3, epoch=1)
    asyncio.run(plugin._h_start("pgas-rechunk-a", 3, 1))
    assert not plugin._done and not plugin._dropped and not plugin._staged and not plugin._run_of


def test_forget_of_another_world_touches_no_run(plugin):
    plugin._next_seq = 4
    plugin._done[3] = concurrent.futures.Future()
    plugin._staged["pgas-rechunk-a"] = ("spec", (), ())
    plugin._h_forget("pgas-rechunk-a", run=3, epoch=0)
    assert set(plugin._done) == {3} and plugin._dropped == set() and plugin._staged == {}


class _Control:
    """An agreement among PEs of which one is dead: it never returns (here: until released)."""

    def __init__(self):
        import threading

        self.entered = threading.Event()
        self.release = threading.Event()

    def agree(self, error, call=None, same=None):
        self.entered.set()
        self.release.wait(30)
        return [(0, error)] if error else []


def test_start_that_the_world_failure_overtook_enters_no_collective(plugin, monkeypatch):
    """pgas_start travels on an RPC connection and pgas-fail on the batched stream, so the fail can arrive
    first, at an idle worker. The late start must not enter an agreement with the dead peer (it would block
    the collective thread for good, on a worker not marked poisoned)."""
    import asyncio

    from dask_pgas import runtime

    control = _Control()
    engine = SimpleNamespace(control=control, requires_symmetric_operands=False)
    monkeypatch.setattr(runtime, "initialized_backends", lambda: ("mpi",))
    monkeypatch.setattr(runtime, "get_engine", lambda name: engine)

    async def main():
        plugin._h_fail("worker w1 (PE 1) left the PGAS world", epoch=1)
        return await asyncio.wait_for(plugin._h_start("pgas-rechunk-a", 0, 1), 5)

    try:
        reply = asyncio.run(main())
    finally:
        control.release.set()
    assert not control.entered.is_set()
    assert reply["status"] == "error" and reply["fatal"] and "left the PGAS world" in reply["message"]
    # a run already queued on the thread when the fail arrives gives up before its agreement as well
    plugin._staged["pgas-rechunk-b"] = ("spec", (), ())
    with pytest.raises(PGASWorldError, match="left the PGAS world"):
        plugin._run("pgas-rechunk-b", 1)
    assert not control.entered.is_set()


def test_run_queued_behind_others_is_waited_for_from_its_own_start(plugin):
    """An output task's backstop timeout counts from its run's start on this PE, not from its dispatch:
    a run queued behind earlier runs is not late."""
    import threading
    import time

    plugin._next_seq = 3
    done = plugin._done[2] = concurrent.futures.Future()
    plugin._current = (1, time.monotonic())  # run 1 is on the collective thread; run 2 waits behind it

    def collective_thread():
        time.sleep(0.6)  # run 1 takes longer than the timeout below
        plugin._current = (2, time.monotonic())
        time.sleep(0.2)  # run 2 takes less
        plugin._current = None
        plugin._signal(2, result="box")

    t = threading.Thread(target=collective_thread)
    t.start()
    try:
        assert plugin._wait(done, 2, "pgas-rechunk-a", timeout=0.4) == "box"
    finally:
        t.join()
    # a run that began here and never ends: the backstop fires timeout seconds after its start
    plugin._next_seq = 4
    stuck = plugin._done[3] = concurrent.futures.Future()
    plugin._current = (3, time.monotonic())
    t0 = time.monotonic()
    with pytest.raises(PGASWorldError, match="did not finish"):
        plugin._wait(stuck, 3, "pgas-rechunk-b", timeout=0.3)
    assert 0.25 < time.monotonic() - t0 < 2


@pytest.mark.parametrize("finish", ["memory", "error", "released"])
def test_transfer_cancelled_while_it_staged_leaves_no_input(plugin, finish):
    """A transfer task executing when its rechunk is cancelled can stage after the rechunk's forget reached
    the worker (the forget comes before the batch's free-keys): the staged input is dropped when the
    cancelled task is released here, not kept until the same rechunk runs again."""
    key = ("pgas-transfer-a", 0)
    tasks = {}
    plugin.worker.state = SimpleNamespace(tasks=tasks)
    plugin._h_forget("pgas-rechunk-a", run=None, epoch=1)  # the cancel reaches the worker first
    plugin.stage("pgas-rechunk-a", 0, 1, 2, "spec", (), (bytearray(10),))  # then the task thread stages
    tasks[key] = SimpleNamespace(state="cancelled")
    plugin.transition(key, "executing", "cancelled")  # free-keys: still executing
    plugin.transition(key, "cancelled", "released")  # (a no-op while it executes)
    assert "pgas-rechunk-a" in plugin._staged
    tasks[key].state = "released"  # the execution ends: Dask releases the cancelled task
    plugin.transition(key, "cancelled", finish)
    assert plugin._staged == {}


def test_resumed_transfer_keeps_its_input(plugin):
    """A cancelled transfer task that Dask asks for again resumes: what it stages is the new attempt's."""
    key = ("pgas-transfer-a", 0)
    plugin.worker.state = SimpleNamespace(tasks={key: SimpleNamespace(state="resumed")})
    plugin.stage("pgas-rechunk-a", 0, 1, 2, "spec", (), (bytearray(10),))
    plugin.transition(key, "cancelled", "waiting")
    plugin.transition(("pgas-transfer-a", 0), "memory", "released")  # the normal end of a transfer task
    assert "pgas-rechunk-a" in plugin._staged


def test_memory_pressure_gives_back_what_dask_cannot_spill(monkeypatch):
    """Idle output blocks are capped at a tenth of the worker's memory limit, and dropped (with the packing
    scratch) when the worker is paused or past Dask's spill threshold."""
    import numpy as np
    from distributed.core import Status

    process = {"rss": 0}
    memory = SimpleNamespace(memory_limit=100 * 2**20, memory_spill_fraction=0.7, memory_pause_fraction=0.8)
    worker = SimpleNamespace(handlers={}, stream_handlers={}, name="w0", address="tcp://w0", status=Status.running,
                             memory_manager=memory, monitor=SimpleNamespace(get_process_memory=lambda: process["rss"]))
    p = PGASWorkerPlugin()
    p.setup(worker)
    try:
        assert p._pool.limit() == 10 * 2**20
        blocks = [p._pool.empty((2**20,), np.uint8) for _ in range(12)]  # 12 MiB
        del blocks
        assert p._pool.idle == 10 * 2**20  # the last two found the pool full
        p._scratch(5 * 2**20)
        assert p._trim() == 0 and p._pool.idle == 10 * 2**20  # nothing to give back yet
        process["rss"] = 75 * 2**20  # past the spill threshold
        assert p._trim() == 15 * 2**20 and p._pool.idle == 0 and p._scratch_buf is None
        process["rss"] = 0
        blocks = [p._pool.empty((2**20,), np.uint8)]
        del blocks
        worker.status = Status.paused
        assert p._trim() == 2**20 and p._pool.idle == 0
    finally:
        p.teardown(worker)


@pytest.mark.parametrize("dtype", [
    [("a", "u1"), ("b", "<f8")],  # aligned below: 7 bytes of padding after 'a'
    {"names": ["a", "c"], "formats": ["<i4", "<i4"], "offsets": [0, 12], "itemsize": 16},  # Dask's x[["a", "c"]]
    {"names": ["b", "a"], "formats": ["<i4", "<i4"], "offsets": [4, 0], "itemsize": 8},  # fields out of order
    ">c16",
])
def test_pooled_output_blocks_keep_the_dtype(plugin, dtype):
    """Output boxes of 1 MiB or more come from the pool: the exact dtype, padding and offsets included (an array
    interface's descr lost them, so the engine refused the box after the run's agreement)."""
    import numpy as np

    dt = np.dtype(dtype, align=isinstance(dtype, list))
    shape = (3, 2**20 // dt.itemsize)
    for _ in range(2):  # a fresh block, then the same block again from the pool
        out = plugin._pool.empty(shape, dt)
        assert out.dtype == dt and out.shape == shape and out.flags.c_contiguous
        del out
    assert plugin._pool.idle == shape[0] * shape[1] * dt.itemsize


def test_blocks_leased_before_a_clear_do_not_refill_the_pool(plugin):
    """Teardown (or high memory) empties the pool; the chunks of earlier results that die afterwards used to
    refill it up to its cap, so a torn-down worker kept that memory."""
    import numpy as np

    shape = (2**20 // 8,)
    kept = [plugin._pool.empty(shape, np.float64) for _ in range(2)]
    again = plugin._pool.empty(shape, np.float64)
    del again  # back to the pool
    assert plugin._pool.idle == 2**20
    assert plugin._pool.clear() == 2**20
    del kept  # leased before the clear: not taken back
    assert plugin._pool.idle == 0
    out = plugin._pool.empty(shape, np.float64)  # leased after it: recycled as before
    del out
    assert plugin._pool.idle == 2**20


def test_a_rechunk_computed_again_drops_its_old_output(plugin, monkeypatch):
    """Keys released while the barrier task ran, then computed again, start a second run of the same rechunk
    before the scheduler forgets the first, and its forget names only the second: the first run's output box
    stayed in _done for good (seen once in a cancel storm). It goes when the new run starts."""
    import asyncio

    def run(name, seq):  # the collective, as far as the bookkeeping sees it
        plugin._signal(seq, result=f"box of run {seq}")
        return {"pe": 0, "seconds": 0.0}

    monkeypatch.setattr(plugin, "_run_and_signal", run)

    async def main():
        assert (await plugin._h_start("pgas-rechunk-a", 0, 1))["status"] == "OK"
        assert plugin._done[0].result() == "box of run 0"
        assert (await plugin._h_start("pgas-rechunk-a", 1, 1))["status"] == "OK"

    asyncio.run(main())
    assert list(plugin._done) == [1]
    plugin._h_forget("pgas-rechunk-a", run=1, epoch=1)
    assert not plugin._done and not plugin._run_of and not plugin._dropped


def test_a_failed_world_drops_the_staged_inputs(plugin):
    """Inputs staged for runs that will never start hold the chunks outside Dask's memory accounting: a world
    failure drops them (a failure of another world does not)."""
    plugin._staged["pgas-rechunk-a"] = ("spec", (), (bytearray(10),))
    plugin._h_fail("worker w1 (PE 1) left the PGAS world", epoch=0)
    assert "pgas-rechunk-a" in plugin._staged and plugin.broken is None
    plugin._h_fail("worker w1 (PE 1) left the PGAS world", epoch=1)
    assert plugin._staged == {} and "left the PGAS world" in plugin.broken


def test_teardown_drops_every_run_and_staged_input(plugin, monkeypatch):
    from dask_pgas import runtime

    monkeypatch.setattr(runtime, "is_initialized", lambda: True)
    monkeypatch.setattr(runtime, "finalize", lambda: None)
    plugin._staged["pgas-rechunk-a"] = ("spec", (), (bytearray(10),))
    plugin._done[0] = concurrent.futures.Future()
    plugin._dropped.add(1)
    plugin._run_of["pgas-rechunk-a"] = 0
    plugin._teardown()
    assert not plugin._staged and not plugin._done and not plugin._dropped and not plugin._run_of
    assert plugin.epoch is None and plugin.pe is None


@pytest.mark.parametrize("src, dst, keeps", [
    ("f4", "f8", True), (">f8", "<f8", True), ("i4", "i8", True), ("u4", "i8", True), ("b1", "f2", True),
    ("i4", "f8", True), ("u4", "f8", True), ("i2", "f4", True), ("u1", "f2", True), ("S5", "S7", True),
    ("f8", "c16", True), ("M8[s]", ">M8[s]", True),
    ("f8", "f4", False), ("f8", "i4", False), ("U3", "U2", False), ("u8", "i8", False),
    # NumPy's "safe", yet values change: integers past the float's mantissa, dates into another unit
    ("i8", "f8", False), ("u8", "f8", False), ("i8", "c16", False), ("i4", "f4", False), ("i2", "f2", False),
    ("M8[s]", "M8[ns]", False), ("m8[ms]", "m8[us]", False),
    # "safe" too, but bytes decoded and numbers formatted: another kind of value (b'\xff' raised on decoding)
    ("S2", "U2", False), ("i1", "U4", False), ("b1", "S5", False), ("u1", "S3", False), ("U2", "U5", True),
    ([("a", "i4"), ("b", "f4")], [("a", "f8"), ("b", "f8")], True),
    ([("a", "i8"), ("b", "f4")], [("a", "f8"), ("b", "f8")], False),
    ([("a", "i4")], [("b", "i8")], False), (("i4", (2,)), ("f8", (2,)), True), (("i8", (2,)), ("f8", (2,)), False),
])
def test_casts_that_keep_every_value(src, dst, keeps):
    from dask_pgas.integration._worker_plugin import keeps_every_value

    assert keeps_every_value(np.dtype(src), np.dtype(dst)) is keeps


@pytest.mark.parametrize("name, base", [("UnsupportedOperandError", "dask_pgas.errors"), ("ValueError", "builtins"),
                                        ("MemoryError", "builtins"), ("OSError", "builtins")])
def test_an_agreed_run_error_is_of_the_pes_class_and_a_collective_error_after_pickling(name, base):
    """Every failing PE raised one class: the run's error is of that class and of the run's CollectiveError,
    also once Dask has pickled it to the client (a class made at run time is rebuilt there by name)."""
    import importlib
    import pickle

    import cloudpickle

    from dask_pgas.errors import CollectiveError
    from dask_pgas.integration._worker_plugin import agreed_error_class

    err = agreed_error_class(name)(f"PE 0: {name}: a chunk; PE 2: {name}: another")
    for dumps, loads in ((pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)):
        back = loads(dumps(err))
        assert type(back) is type(err) is agreed_error_class(name)
        assert isinstance(back, getattr(importlib.import_module(base), name))
        assert isinstance(back, CollectiveError)
        assert str(back) == str(err) and back.fatal is False  # (OSError's own str and reduce do not take over)
    assert pickle.loads(pickle.dumps(type(err))) is type(err)  # the class itself, by reference (Run<name>)
    assert type(err).__name__ == f"Run{name}"  # (not the name of the class it derives from)


@pytest.mark.parametrize("name", [None, "CollectiveError", "DeviceError", "PGASWorldError", "PGASError",
                                  "Exception", "KeyboardInterrupt", "print", "NoSuchError", "UnicodeDecodeError",
                                  "TimeoutError", "StopIteration"])
def test_other_run_errors_stay_plain_collective_errors(name):
    """Mixed classes (None), world failures (not a run's), bases of the run's error, names that are no
    exception class, classes whose constructor takes more than a message (a UnicodeDecodeError there made the
    raise itself fail, which broke the world) and builtins the plugin's waits catch themselves (an agreed
    TimeoutError would look like a wait's timeout) give the run's own error class."""
    from dask_pgas.integration._worker_plugin import _RunError, agreed_error_class

    assert agreed_error_class(name) is _RunError


def test_the_class_a_failing_pe_reports_is_public_and_exact():
    """The name a PE sends is of a class of dask_pgas.errors or builtins, found along the MRO (CuPy's
    OutOfMemoryError is a MemoryError; a UnicodeDecodeError a UnicodeError), never a look-alike of a builtin's
    name."""
    from dask_pgas.errors import OperandMismatchError
    from dask_pgas.integration._worker_plugin import public_error_name

    class OutOfMemoryError(MemoryError):
        pass

    ValueErrorLookAlike = type("ValueError", (Exception,), {})
    assert public_error_name(OutOfMemoryError()) == "MemoryError"
    assert public_error_name(UnicodeDecodeError("ascii", b"\xff", 0, 1, "ordinal not in range")) == "UnicodeError"
    assert public_error_name(OperandMismatchError("x")) == "OperandMismatchError"
    assert public_error_name(TimeoutError()) == "OSError"
    assert public_error_name(ValueErrorLookAlike()) is None
    assert public_error_name(RuntimeError()) is None  # (a base of the run's own error: nothing to add)


def test_buffers_grow_to_the_exact_need_when_the_grown_size_is_refused(plugin, monkeypatch):
    """``pgas.buffer-growth`` asks for more than the run needs; where the heap's cap (or the GPUs' free memory)
    refuses that size on every PE alike, every PE asks for the exact need instead of failing a rechunk that
    fits. (Limit 1000 bytes, buffers of 440 each, a run that needs 450 each: 1.25 x 440 = 550 twice would not
    fit, 450 twice does.) Both old buffers are freed before either new one is allocated."""
    from dask_pgas import memory

    held, limit = {}, 1000

    def allocate(shape, package, dtype):
        n = shape[0]
        if sum(held.values()) + n > limit:
            raise MemoryError(f"the symmetric heap cannot take {n} more bytes")
        a = np.zeros(n, np.uint8)
        held[id(a)] = n
        return a

    def free(a):
        del held[id(a)]

    peak = [0]

    def allocate_and_watch(shape, package, dtype):
        a = allocate(shape, package, dtype)
        peak[0] = max(peak[0], sum(held.values()))
        return a

    monkeypatch.setattr(memory, "allocate_symmetric_memory", allocate_and_watch)
    monkeypatch.setattr(memory, "free_symmetric_memory", free)
    plugin._buffers_of({"in": 440, "out": 440}, "cupy", 1.25)
    peak[0] = 0
    grown = plugin._buffers_of({"in": 450, "out": 450}, "cupy", 1.25)
    assert [b.nbytes for b in grown] == [550, 450]  # the first grew as configured; the second to the need
    assert peak[0] == 1000  # never an old buffer beside a new one (550 + 440 before)
    assert plugin._buffers_of({"in": 300, "out": 450}, "cupy", 1.25) == grown  # no growth: the same buffers
    with pytest.raises(MemoryError):  # a need that does not fit still fails, as before
        plugin._buffers_of({"in": 450, "out": 600}, "cupy", 1.25)
    plugin._buffers.clear()


_CLOSE = """
import sys
from types import SimpleNamespace

import dask_pgas
from dask_pgas.integration._worker_plugin import PGASWorkerPlugin

dask_pgas.initialize(backends=["mpi"])
worker = SimpleNamespace(handlers={}, stream_handlers={}, name="w0", address="tcp://w0")
plugin = PGASWorkerPlugin()
plugin.setup(worker)
plugin._buffers_of({"in": 4000, "out": 6000}, "numpy", 1.0)
mine = dask_pgas.allocate_symmetric_memory((8,), "numpy", dtype="float64")  # a user's array
if sys.argv[1] == "close":
    plugin.teardown(worker)
"""


@pytest.mark.parametrize("close", [True, False])
def test_a_closing_worker_leaves_its_buffers_to_the_process_without_leak_warnings(close):
    """A worker closes alone (workers close one at a time), so its staging buffers cannot be freed collectively
    and go with the process: GPU workers of a LocalCUDACluster closed without dask_pgas.teardown printed a
    SymmetricMemoryLeakWarning for each, pointing into threading.py. The plugin's teardown gives them up on
    purpose; a symmetric array of the user's own is still reported at exit (and, without the teardown, the
    buffers too: the warning itself is intact)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _CLOSE, "close" if close else "keep"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    leaks = [line for line in out.stderr.splitlines() if "SymmetricMemoryLeakWarning" in line]
    sizes = sorted(int(line.split(" bytes)")[0].rsplit(", ", 1)[1]) for line in leaks)
    assert sizes == ([64] if close else [64, 4000, 6000]), out.stderr


def test_a_worker_with_a_runtime_up_fails_the_bring_up_check(plugin, monkeypatch):
    """A worker that still has a runtime up when a unique-id bootstrap asks it to check its local steps (the
    scheduler tears its own world down first: this one it does not know) refuses, saying to restart it; the
    init would have torn the runtime down alone, a collective on one worker. Nothing NVSHMEM is touched."""
    import dask_pgas
    from dask_pgas import runtime
    from dask_pgas.errors import RuntimeStateError

    checked = []
    monkeypatch.setattr(dask_pgas, "check_uniqueid_bring_up", lambda *args, **kwargs: checked.append(args))
    monkeypatch.setattr(runtime, "is_initialized", lambda: True)
    with pytest.raises(RuntimeStateError, match=r"still has a PGAS runtime up .* restart the worker"):
        plugin._check_bring_up(0, 2, True)
    assert checked == []
    monkeypatch.setattr(runtime, "is_initialized", lambda: False)
    plugin._check_bring_up(1, 2, True)
    assert checked == [(1, 2, 0)]
