"""The public surface, without MPI ranks: names, options, errors and single-process use."""

from __future__ import annotations

import ctypes
import pickle

import numpy as np
import pytest

import dask_pgas
from dask_pgas import errors
from dask_pgas._arrays import array_info, package_name
from dask_pgas.engines.base import ControlPlane
from dask_pgas.reshape import ReshapeOptions


def test_public_names():
    for name in ("initialize", "finalize", "allocate_symmetric_memory", "free_symmetric_memory", "Box", "Slab",
                 "Reshape", "ReshapeOptions", "heap_usage"):
        assert hasattr(dask_pgas, name), name
    assert callable(dask_pgas.reshape.reshape) and dask_pgas.distribution.Box is dask_pgas.Box


def test_nvmath_1_0_names():
    """nvmath 1.0 moved the reshape to ``distribution.redistribute`` / ``Redistribute`` / ``RedistributeOptions``:
    the same operation and options under those names (and argument names), loaded on first use."""
    import inspect

    from dask_pgas import distribution, reshape

    assert distribution.Redistribute is dask_pgas.Redistribute is reshape.Redistribute
    assert issubclass(distribution.Redistribute, dask_pgas.Reshape)
    assert distribution.redistribute is reshape.redistribute
    assert {"Redistribute", "RedistributeOptions", "redistribute"} <= set(dir(distribution))
    opts = distribution.RedistributeOptions(blocking=True)
    assert isinstance(opts, ReshapeOptions) and opts.blocking is True and opts.logger is None
    with pytest.raises(ValueError, match="blocking"):
        distribution.RedistributeOptions(blocking="sometimes")
    params = list(inspect.signature(distribution.redistribute).parameters)
    assert params == ["operand", "input_distribution", "output_distribution", "sync_symmetric_memory", "options",
                      "stream"]
    assert list(inspect.signature(reshape.reshape).parameters) == ["operand", "input_box", "output_box",
                                                                   "sync_symmetric_memory", "options", "stream"]
    init = inspect.signature(distribution.Redistribute).parameters
    assert list(init)[:3] == ["operand", "input_distribution", "output_distribution"]
    assert {"Box", "Slab", "Distribution", "ConvertDistributionError"} <= set(dir(distribution))
    with pytest.raises(AttributeError):
        distribution.BlockCyclic  # noqa: B018 (not provided: Box and Slab are the distributions here)


def _passes_in_a_fresh_interpreter(code: str) -> None:
    """Run ``code`` in a new Python process (this one may have loaded distributed or hold a client already)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_integration_names_are_listed_but_loaded_on_first_use():
    """``dir()``, tab completion and ``import *`` show the Dask integration; a bare import still loads no
    distributed (a fresh interpreter: this one may have loaded it already)."""
    _passes_in_a_fresh_interpreter(
        "import sys, dask, dask_pgas\n"
        "assert 'distributed' not in sys.modules\n"
        "assert dask.config.get('pgas.fallback') == 'raise'  # the pgas.* defaults, registered on import\n"
        "names = ('LocalMPICluster', 'World', 'bootstrap', 'install', 'rechunk', 'teardown', 'uninstall', 'world')\n"
        "assert set(names) <= set(dir(dask_pgas)) and set(names) <= set(dask_pgas.__all__)\n"
        "assert 'distributed' not in sys.modules\n"
        "ns = {}\n"
        "exec('from dask_pgas import *', ns)\n"
        "assert ns['rechunk'] is dask_pgas.rechunk and ns['Reshape'] is dask_pgas.Reshape\n"
    )


def test_integration_calls_without_a_client_say_how_to_get_one():
    """``dask_pgas.world()`` in a process with no Dask client: Dask's "No clients found" named neither the call
    nor the cluster to start; the error (still a ``ValueError``, as Dask's) now says both."""
    _passes_in_a_fresh_interpreter(
        "import dask_pgas\n"
        "for call in (dask_pgas.world, dask_pgas.bootstrap, dask_pgas.teardown):\n"
        "    try:\n"
        "        call()\n"
        "    except ValueError as e:\n"
        "        assert f'dask_pgas.{call.__name__} needs a Dask client' in str(e), e\n"
        "        assert 'LocalMPICluster' in str(e) and e.__suppress_context__, e\n"
        "    else:\n"
        "        raise AssertionError(call)\n"
    )


def test_errors_are_builtin_subclasses_and_pickle():
    for cls, base in [(errors.DistributionError, ValueError), (errors.NotInitializedError, RuntimeError),
                      (errors.UnsupportedOperandError, TypeError), (errors.SymmetricMemoryError, ValueError),
                      (errors.OperandMismatchError, ValueError), (errors.OperandMismatchError, TypeError),
                      (errors.CollectiveMismatchError, errors.CollectiveError),
                      (errors.PGASWorldError, RuntimeError), (errors.PGASRechunkUnsupported, NotImplementedError)]:
        exc = cls("what to do")
        assert isinstance(exc, base) and isinstance(exc, errors.PGASError)
        again = pickle.loads(pickle.dumps(exc))
        assert type(again) is cls and str(again) == "what to do"


class _Canned(ControlPlane):
    """Rank 0 of a control plane whose other ranks' contributions are given (the allgather path, as NVSHMEM's)."""

    rank, size = 0, 3

    def __init__(self, others):
        self.others = others

    def allgather(self, obj):
        return [obj, *self.others]


def test_agreement_names_the_call_and_refuses_different_calls():
    same = _Canned([("Reshape#2.execute()", None, None), ("Reshape#2.execute()", None, "RuntimeStateError: freed")])
    assert same.agree(None, "Reshape#2.execute()") == [(2, "RuntimeStateError: freed")]
    assert _Canned([(None, None, None), (None, None, "x")]).agree(None) == [(2, "x")]  # steps inside name none
    other = _Canned([("Reshape#2.plan()", None, None), ("allocate_symmetric_memory()", None, "ValueError: bad shape")])
    with pytest.raises(errors.CollectiveMismatchError) as info:
        other.agree(None, "Reshape#2.execute()")
    assert str(info.value).startswith(
        "ranks are in different collective calls (rank 0: Reshape#2.execute(); rank 1: Reshape#2.plan(); rank 2: "
        "allocate_symmetric_memory() (which failed there: ValueError: bad shape))"
    )
    with pytest.raises(errors.CollectiveMismatchError, match="rank 1: a step inside a collective call"):
        _Canned([(None, None, None), ("finalize()", None, None)]).agree(None, "finalize()")
    # the same call with an argument that must agree, passed differently
    flags = _Canned([("R#1.execute()", ("sync", False), None), ("R#1.execute()", ("sync", True), None)])
    with pytest.raises(errors.CollectiveMismatchError) as info:
        flags.agree(None, "R#1.execute()", ("sync", True))
    assert str(info.value) == (
        "ranks called R#1.execute() with different sync (rank 0: True; rank 1: False; rank 2: True); pass the same "
        "on every rank"
    )


def test_agreement_compares_arguments_only_of_ranks_without_a_local_error():
    # rank 1 could not even form its value (its error is what every rank raises), so nothing is mismatched
    failed = _Canned([("R#1.execute()", ("sync", None), "TypeError: no truth value"),
                      ("R#1.execute()", ("sync", True), None)])
    assert failed.agree(None, "R#1.execute()", ("sync", True)) == [(1, "TypeError: no truth value")]


def test_numbers_are_per_world():
    """A process numbers allocations and Reshape objects per world (control plane), so a rank that had a world
    of its own before names the same objects as its peers in the next world."""
    first, second = _Canned([]), _Canned([])
    assert [first.number("Reshape") for _ in range(3)] == [0, 1, 2] and first.number("allocation") == 0
    assert second.number("Reshape") == 0 and second.number("allocation") == 0


def test_options():
    assert ReshapeOptions().blocking == "auto"
    with pytest.raises(ValueError):
        ReshapeOptions(blocking="sometimes")


def test_array_info_layouts():
    a = np.zeros((3, 4), order="F")
    info = array_info(a)
    assert info.f_contiguous and not info.c_contiguous and info.shape == (3, 4) and info.nbytes == 96
    assert not array_info(a[:, ::2]).f_contiguous
    with pytest.raises(TypeError):
        array_info([1, 2])
    assert package_name(np) == "numpy"
    with pytest.raises(TypeError):
        package_name("pandas")


def test_not_initialized_message():
    with pytest.raises(errors.NotInitializedError, match="initialize"):
        dask_pgas.allocate_symmetric_memory((2,), np)
    assert dask_pgas.heap_usage()["allocations"] == 0


def test_heap_position_names_the_allocation_and_offset():
    from mpi4py import MPI

    from dask_pgas.memory import _heap_position

    dask_pgas.initialize(communicator=MPI.COMM_SELF, backends=["mpi"])
    try:
        a = dask_pgas.allocate_symmetric_memory((8, 4), np)
        seq, offset = _heap_position(a)
        assert offset == 0 and _heap_position(a[2:]) == (seq, 2 * 4 * 8) and _heap_position(a[1:, 3]) == (seq, 56)
        assert _heap_position(np.zeros(3)) is None
        dask_pgas.free_symmetric_memory(a)
        assert _heap_position(a) is None  # freed: in no live allocation
    finally:
        dask_pgas.finalize()


def test_symmetric_shapes_as_numpy_integers_and_arrays():
    """The shape may be an int, a NumPy integer (0-d arrays too) or a sequence of them, a NumPy array included
    (as ``np.empty`` takes them); a 1-d array was taken for one size and refused."""
    from mpi4py import MPI

    dask_pgas.initialize(communicator=MPI.COMM_SELF, backends=["mpi"])
    try:
        for shape, expect in ((np.array([2, 3]), (2, 3)), (np.int64(5), (5,)), (np.array(4), (4,)),
                              ([np.int32(2), 3], (2, 3))):
            a = dask_pgas.allocate_symmetric_memory(shape, np)
            assert a.shape == expect == np.empty(shape).shape, shape
            dask_pgas.free_symmetric_memory(a)
    finally:
        dask_pgas.finalize()


def test_allocations_and_reshapes_are_numbered_per_world():
    """Numbers compared across ranks (free_symmetric_memory's, the position check's, Reshape#n) start again with
    each world: a process that had a world before names the same objects as a process that had none."""
    from mpi4py import MPI

    from dask_pgas.memory import _heap_position
    from dask_pgas.reshape import Reshape

    names = []
    for _ in range(2):
        dask_pgas.initialize(communicator=MPI.COMM_SELF, backends=["mpi"])
        try:
            a = dask_pgas.allocate_symmetric_memory((2,), np)
            assert _heap_position(a) == (0, 0)
            with Reshape(np.zeros(2), ((0,), (2,)), ((0,), (2,))) as r:
                names.append(r._name)
            dask_pgas.free_symmetric_memory(a)
        finally:
            dask_pgas.finalize()
    assert names == ["Reshape#1", "Reshape#1"]


def test_memory_in_use_follows_the_keeper_not_the_array_returned():
    """A torch view keeps only the storage, not the tensor allocate_symmetric_memory returned: finalize() freed the
    memory under a live slice once that tensor was gone (round 24, torch on NVSHMEM). The registry follows the
    object that lives as long as the memory (the storage's owner); here a stand-in keeper."""
    import gc
    import warnings

    from mpi4py import MPI

    from dask_pgas import errors, memory
    from dask_pgas.runtime import get_engine

    class Keeper:
        pass

    class Noted(np.ndarray):  # takes the attribute the GPU engine notes on its torch tensors
        pass

    dask_pgas.initialize(None, MPI.COMM_SELF, ["mpi"])
    try:
        engine = get_engine("mpi")
        keeper = Keeper()
        allocation = engine.allocate(64)
        array = engine.as_array(allocation, (8,), "float64", "numpy").view(Noted)
        array._dask_pgas_keeper = keeper
        memory._register(engine, allocation, array, "test")  # (finalize frees it)
        del array
        gc.collect()
        assert memory._in_use() is not None  # the keeper (the storage) is alive: in use
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del keeper
            gc.collect()
        assert memory._in_use() is None and dask_pgas.heap_usage()["collected_unfreed"] == 1
        assert any(issubclass(w.category, errors.SymmetricMemoryLeakWarning) for w in caught)
    finally:
        dask_pgas.finalize()


def test_a_leaked_allocation_is_reported_by_default_at_the_line_that_allocated_it(tmp_path):
    """The leak warning was a ResourceWarning, which Python hides: a user saw nothing. It pointed at weakref's
    finalizer. It now shows under Python's default filters, once per leaked allocation, at the user's line."""
    import subprocess
    import sys

    script = tmp_path / "leaky.py"
    script.write_text(
        "import gc, dask_pgas\n"
        "from mpi4py import MPI\n"
        "dask_pgas.initialize(None, MPI.COMM_SELF, ['mpi'])\n"
        "for _ in range(2):\n"
        "    a = dask_pgas.allocate_symmetric_memory((8,), 'numpy', dtype='float32')  # line 5\n"
        "    del a\n"
        "    gc.collect()\n"
        "print(dask_pgas.heap_usage()['collected_unfreed'])\n"
        "dask_pgas.finalize()\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2"]
    leaks = [line for line in out.stderr.splitlines() if "SymmetricMemoryLeakWarning" in line]
    assert len(leaks) == 2, out.stderr
    assert all(line.startswith(f"{script}:5: SymmetricMemoryLeakWarning: symmetric memory (numpy (8,) float32")
               for line in leaks), leaks


def test_initialize_takes_the_process_group_by_either_name():
    """nvmath 0.9 and 1.0 name initialize's second argument ``process_group``; earlier releases ``communicator``.
    Both names work, giving both raises (every rank, through the exchange), and ProcessGroup is public."""
    from mpi4py import MPI

    assert issubclass(dask_pgas.MPIProcessGroup, dask_pgas.ProcessGroup)
    for kwargs in ({"process_group": dask_pgas.MPIProcessGroup(MPI.COMM_SELF)}, {"process_group": MPI.COMM_SELF},
                   {"communicator": MPI.COMM_SELF}):
        dask_pgas.initialize(None, backends=["mpi"], **kwargs)
        try:
            assert dask_pgas.get_context().nranks == 1
        finally:
            dask_pgas.finalize()
    other = MPI.COMM_SELF.Dup()
    try:
        with pytest.raises(TypeError, match=r"rank 0: initialize\(\) takes the process group once"):
            dask_pgas.initialize(None, MPI.COMM_SELF, ["mpi"], communicator=other)
    finally:
        other.Free()
    assert not dask_pgas.is_initialized()


def test_single_process_reshape_in_this_process():
    """One rank (MPI singleton): a reshape is a re-slice of the whole array."""
    from mpi4py import MPI

    dask_pgas.initialize(None, MPI.COMM_SELF, backends=["mpi"])
    try:
        a = np.arange(12.0).reshape(3, 4)
        out = dask_pgas.reshape.reshape(a, dask_pgas.Box((0, 0), (3, 4)), dask_pgas.Box((0, 0), (3, 4)))
        assert np.array_equal(out, a) and out is not a
        with pytest.raises(errors.RuntimeStateError):
            dask_pgas.initialize(None, MPI.COMM_SELF, backends=["mpi"])
    finally:
        dask_pgas.finalize()
    assert not dask_pgas.is_initialized()


def test_after_a_device_error_no_array_of_the_broken_engine_blocks_finalize(monkeypatch):
    """A free that finds the device broken (DeviceError, raised on every rank alike; here the MPI engine plays
    the NVSHMEM engine's part) leaves none of the arrays it was given registered, and finalize() neither refuses
    for arrays of a broken engine that are still referenced nor tries to free them (nothing can be freed any
    more): "finalize, then restart the processes" works as the error says. Before, the second array of the
    free stayed registered, and finalize() raised SymmetricMemoryError for it and for the third."""
    from mpi4py import MPI

    from dask_pgas import memory
    from dask_pgas.runtime import get_engine

    dask_pgas.initialize(None, MPI.COMM_SELF, backends=["mpi"])
    eng = get_engine("mpi")
    really_free, calls = eng.free, []
    allocations = []
    try:
        a, b, c = [dask_pgas.allocate_symmetric_memory((4,), np, dtype="f8") for _ in range(3)]
        allocations = [rec.allocation for rec in memory._live.values()]

        def fails_once(allocation):  # any other failure: the arrays after it stay registered, to be freed again
            monkeypatch.setattr(eng, "free", really_free)
            really_free(allocation)
            raise RuntimeError("injected")

        monkeypatch.setattr(eng, "free", fails_once)
        with pytest.raises(RuntimeError, match="injected"):
            dask_pgas.free_symmetric_memory(a, b)
        assert not eng.broken and dask_pgas.heap_usage()["allocations"] == 2  # b and c

        def free(allocation):  # as NVSHMEMEngine._synchronize_for_free after a sticky error on some rank
            calls.append(allocation)
            eng._broken = "the device failed on rank 0 before a collective free (CudaError: ...)"
            raise errors.DeviceError(eng._broken)

        monkeypatch.setattr(eng, "free", free)
        d = dask_pgas.allocate_symmetric_memory((4,), np, dtype="f8")
        allocations.append(memory._live[max(memory._live)].allocation)
        with pytest.raises(errors.DeviceError, match="before a collective free"):
            dask_pgas.free_symmetric_memory(b, d)
        assert eng.broken and dask_pgas.heap_usage()["allocations"] == 1  # c's, still referenced
        dask_pgas.finalize()  # not refused for c, and c is not freed
        c[...] = 1.0  # (its memory is still there)
        assert not dask_pgas.is_initialized() and len(calls) == 1 and c.sum() == 4
    finally:
        if dask_pgas.is_initialized():
            dask_pgas.finalize()
        for allocation in allocations[1:]:  # (the windows this test's engine left; a's went at its failed free)
            really_free(allocation)


def test_steps_are_logged_at_info_and_mismatches_are_value_errors(caplog):
    """As nvmath: each step of a Reshape is logged at INFO (creation, planning, every execute, the release), and a
    new operand of another shape or dtype is a ValueError (still an UnsupportedOperandError, as before)."""
    import logging

    from mpi4py import MPI

    dask_pgas.initialize(None, MPI.COMM_SELF, backends=["mpi"])
    try:
        a = np.arange(6.0).reshape(2, 3)
        box = dask_pgas.Box((0, 0), (2, 3))
        with caplog.at_level(logging.INFO, logger="dask_pgas.reshape"):
            with dask_pgas.Reshape(a, box, box) as r:
                r.plan()
                r.execute()
                for bad in (np.zeros((3, 2)), np.zeros((2, 3), np.float32)):
                    with pytest.raises(ValueError, match="the plan needs") as info:
                        r.reset_operand(bad)
                    assert isinstance(info.value, errors.UnsupportedOperandError)
        steps = [m for m in caplog.messages if m.startswith(r._name)]
        assert [m.split(": ", 1)[1].split(" in ")[0] for m in steps] == [
            "global shape (2, 3), numpy float64 operand, Box(lower=(0, 0), upper=(2, 3)) -> "
            "Box(lower=(0, 0), upper=(2, 3)), order C, on the mpi engine: created", "planning", "planned",
            "execute() starts (blocking, sync_symmetric_memory=True)", "execute() ended", "resources released"], steps
        assert all(rec.levelno == logging.INFO for rec in caplog.records if rec.name == "dask_pgas.reshape")
    finally:
        dask_pgas.finalize()


def test_a_logger_like_object_is_taken_as_nvmath_takes_any():
    """nvmath's ReshapeOptions checks nothing, so a logger-like adapter (structlog's, loguru's) works there; here
    any object with the methods the Reshape calls is used, and other values are still refused."""
    from mpi4py import MPI

    class Recorder:
        def __init__(self):
            self.said = []

        def isEnabledFor(self, level):
            return True

        def info(self, msg, *args):
            self.said.append(msg % args)

        debug = info

    log = Recorder()
    dask_pgas.initialize(None, MPI.COMM_SELF, backends=["mpi"])
    try:
        a = np.arange(6.0).reshape(2, 3)
        box = dask_pgas.Box((0, 0), (2, 3))
        out = dask_pgas.reshape.reshape(a, box, box, options={"logger": log})
        assert np.array_equal(out, a)
        assert any(m.endswith("created") for m in log.said) and any("resources released" in m for m in log.said)
        for bad in ("not-a-logger", object()):
            with pytest.raises(TypeError, match=r"logger must be a logging\.Logger or have its methods"):
                ReshapeOptions(logger=bad)
    finally:
        dask_pgas.finalize()


def test_results_are_recycled_only_when_dropped():
    from mpi4py import MPI

    dask_pgas.initialize(None, MPI.COMM_SELF, backends=["mpi"])
    try:
        a = np.arange(6.0).reshape(2, 3)
        box = dask_pgas.Box((0, 0), (2, 3))
        with dask_pgas.Reshape(a, box, box) as r:
            r.plan()
            first = r.execute()
            view = first[0]
            del first  # still referenced through the view: must not be reused
            second = r.execute()
            third = r.execute()
            assert len({id(view.base), id(second), id(third)}) == 3
            view[...] = -1  # writing through the view must not touch later results
            assert np.array_equal(second, a) and np.array_equal(third, a)
            third_id = id(third)
            del third  # now unreferenced: recycled by the next execute
            fourth = r.execute()
            assert id(fourth) == third_id and np.array_equal(fourth, a)
            assert fourth is not second
    finally:
        dask_pgas.finalize()


def test_gpu_operands_in_mixed_layouts_fail_on_every_rank():
    """Rank 0 F-contiguous, rank 1 C-contiguous GPU operands: the global check (run identically on every
    rank) refuses them, so no rank raises alone after the agreement while the others plan."""
    from dask_pgas.errors import OperandMismatchError, SymmetricMemoryError
    from dask_pgas.reshape import Reshape

    def desc(lo, up, c, f, position=(3, 0)):
        return {"error": None, "in": ((lo, 0), (up, 4)), "out": ((0, lo), (4, up)), "package": "cupy",
                "host": False, "dtype": "<f8", "symmetric": True, "c": c, "f": f, "position": position}

    descs = [desc(0, 2, False, True), desc(2, 4, True, False)]
    with pytest.raises(OperandMismatchError, match=r"C-contiguous.*ranks \[0\]") as mixed:
        Reshape._check_global(descs)
    assert isinstance(mixed.value, ValueError)  # as nvmath's for layouts that differ across processes
    Reshape._check_global([desc(0, 2, True, True), desc(2, 4, True, False)])  # all C: fine
    Reshape._check_global([dict(d, package="numpy", host=True) for d in descs])  # host operands: copied into order
    # GPU engines find a peer's operand at this rank's symmetric address: different slices of one array refused
    with pytest.raises(SymmetricMemoryError, match=r"rank 0: allocation #3 \+ 0 bytes; rank 1: allocation #3 \+ 64"):
        Reshape._check_global([desc(0, 2, True, True), desc(2, 4, True, False, (3, 64))])
    Reshape._check_global([dict(d, package="numpy", host=True)
                           for d in (desc(0, 2, True, True), desc(2, 4, True, True, None))])
    Reshape._check_global([desc(0, 2, True, True), desc(2, 4, True, False, None)])  # empty: nothing to compare


def test_packing_strided_sends_follows_the_mpi_library(monkeypatch):
    from mpi4py import MPI

    from dask_pgas.engines import mpi as engine

    monkeypatch.delenv("DASK_PGAS_MPI_PACK", raising=False)
    monkeypatch.setattr(MPI, "Get_library_version", lambda: "MPICH Version: 4.3.2 ...")
    assert engine._pack_strided_sends() is True
    monkeypatch.setattr(MPI, "Get_library_version", lambda: "Open MPI v4.1.6, package: ...")
    assert engine._pack_strided_sends() is False
    monkeypatch.setenv("DASK_PGAS_MPI_PACK", "always")
    assert engine._pack_strided_sends() is True
    monkeypatch.setenv("DASK_PGAS_MPI_PACK", "bogus")
    with pytest.warns(UserWarning, match="DASK_PGAS_MPI_PACK"):
        assert engine._pack_strided_sends() is False  # auto, under Open MPI


def test_torch_cpu_tensors_are_moved_as_numpy_views():
    """A torch CPU operand is moved as a NumPy view of its memory (no copy) and the result viewed back as a tensor
    of the same torch dtype, also for the dtypes NumPy lacks (raw bytes of their size)."""
    torch = pytest.importorskip("torch")
    from dask_pgas._arrays import from_host_view, host_view, is_host_tensor, to_numpy_dtype

    assert is_host_tensor(torch.zeros(2)) and not is_host_tensor(np.zeros(2))
    for dtype, expect in [(torch.float32, np.dtype("float32")), (torch.bfloat16, np.dtype("V2")),
                          (torch.float8_e4m3fn, np.dtype("V1")), (torch.complex32, np.dtype("V4")),
                          (torch.uint16, np.dtype("uint16"))]:
        assert to_numpy_dtype(dtype) == expect, dtype
        t = torch.arange(12).reshape(3, 4).to(dtype).T  # a strided (F-ordered) view
        view = host_view(t)
        assert view.dtype == expect and view.shape == (4, 3) and view.ctypes.data == t.data_ptr()
        assert view.strides == tuple(s * t.element_size() for s in t.stride())
        back = from_host_view(view, dtype)
        assert back.dtype == dtype and back.data_ptr() == t.data_ptr() and back.stride() == t.stride()
    # a lazily conjugated tensor is resolved (a copy), so the bytes moved are the conjugate's
    z = torch.tensor([1 + 2j, 3 - 1j]).conj()
    assert np.array_equal(host_view(z), np.array([1 - 2j, 3 + 1j], dtype=np.complex64))


def test_boxes_past_mpi_int_counts_are_refused_at_planning_before_mpi_4(monkeypatch):
    """Before MPI 4 (Open MPI 4.1 is an MPI 3.1) Alltoallw counts and byte displacements are C ints: a piece
    past 2**31 - 1 made mpi4py raise inside execute(), after the agreement, on the ranks with such pieces only.
    The plan refuses it (plans are agreed on); with MPI 4's large counts (MPICH 4+, as here) it plans. A plan
    only reads the boxes: no memory is touched."""
    from mpi4py import MPI

    from dask_pgas.distribution import Box
    from dask_pgas.engines import mpi as mpi_engine
    from dask_pgas.engines.base import ReshapeSpec

    G = 2**30
    ins = (Box((0,), (G,)), Box((G,), (5 * G,)))
    outs = (Box((0,), (4 * G,)), Box((4 * G,), (5 * G,)))
    from types import SimpleNamespace

    engine = SimpleNamespace(data_comm=MPI.COMM_SELF)
    spec = ReshapeSpec(ins, outs, np.dtype(np.uint8), "C", 0)
    monkeypatch.setattr(mpi_engine, "_large_counts", lambda: False)
    with pytest.raises(errors.UnsupportedOperandError, match=r"up to 3221225472; .*C ints, up to 2\*\*31 - 1"):
        mpi_engine.MPIReshapePlan(engine, spec)  # 3 GiB of bytes from rank 1: a count of 3 * 2**30
    # the same 4 GiB box in 8-byte elements: 3 * 2**27 elements at a byte offset of 2**30, within C ints
    eights = ReshapeSpec(tuple(Box((b.lower[0] // 8,), (b.upper[0] // 8,)) for b in ins),
                         tuple(Box((b.lower[0] // 8,), (b.upper[0] // 8,)) for b in outs), np.dtype(np.uint64), "C", 0)
    mpi_engine.MPIReshapePlan(engine, eights).free()
    monkeypatch.setattr(mpi_engine, "_large_counts", lambda: True)
    plan = mpi_engine.MPIReshapePlan(engine, spec)
    assert plan._recv_counts[1] == 3 * G  # the piece from rank 1, counted past 2**31 - 1
    plan.free()


# -- from a mutation review of the core: each failed on a mutant that every other test let through
@pytest.fixture
def self_world():
    from mpi4py import MPI

    dask_pgas.initialize(None, MPI.COMM_SELF, backends=["mpi"])
    yield
    dask_pgas.finalize()


def test_object_operands_are_refused(self_world):
    a = np.empty((2, 3), dtype=object)
    box = dask_pgas.Box((0, 0), (2, 3))
    with pytest.raises(errors.UnsupportedOperandError, match="object arrays"):
        dask_pgas.Reshape(a, box, box)


def test_freeing_the_same_array_twice_in_one_call_is_refused(self_world):
    a = dask_pgas.allocate_symmetric_memory((4,), np)
    with pytest.raises(errors.SymmetricMemoryError, match="passed twice"):
        dask_pgas.free_symmetric_memory(a, a)
    assert dask_pgas.heap_usage()["allocations"] == 1  # nothing was freed
    dask_pgas.free_symmetric_memory(a)
    assert dask_pgas.heap_usage()["allocations"] == 0


def test_views_of_a_freed_permuted_allocation_are_refused(self_world):
    """axis_order other than C/F returns a transposed view; a view taken of it names the inner base array
    (NumPy collapses bases), which must be marked freed too."""
    a = dask_pgas.allocate_symmetric_memory((3, 4, 5), np, axis_order=(0, 2, 1))
    v = a[0]
    assert v.base is not a
    dask_pgas.free_symmetric_memory(a)
    box = dask_pgas.Box((0, 0), v.shape)
    with pytest.raises(errors.SymmetricMemoryError, match="freed"):
        dask_pgas.Reshape(v, box, box)


def test_freed_windows_are_no_longer_on_the_heap(self_world):
    from dask_pgas import runtime

    a = dask_pgas.allocate_symmetric_memory((4,), np)
    ptr = a.__array_interface__["data"][0]
    engine = runtime._engines["mpi"]
    assert engine.on_heap(a)
    dask_pgas.free_symmetric_memory(a)
    # an ordinary array that happens to get the freed address (never read here)
    stale = np.ctypeslib.as_array((ctypes.c_double * 4).from_address(ptr))
    assert not engine.on_heap(stale) and not dask_pgas.memory.is_symmetric_memory(stale)


@pytest.mark.parametrize(("pack", "packed"), [("always", True), ("never", False)])
def test_strided_send_pieces_are_packed_or_sent_as_subarrays(monkeypatch, pack, packed):
    from types import SimpleNamespace

    from mpi4py import MPI

    from dask_pgas.distribution import Box
    from dask_pgas.engines import mpi as mpi_engine
    from dask_pgas.engines.base import ReshapeSpec

    monkeypatch.setenv("DASK_PGAS_MPI_PACK", pack)
    # rank 0 holds rows 0-3 of a (4, 4) array and sends columns 2-3 of them (strided in C order) to rank 1
    spec = ReshapeSpec((Box((0, 0), (4, 4)), Box((4, 0), (4, 4))),
                       (Box((0, 0), (4, 2)), Box((0, 2), (4, 4))), np.dtype(np.float64), "C", 0)
    plan = mpi_engine.MPIReshapePlan(SimpleNamespace(data_comm=MPI.COMM_SELF), spec)
    try:
        assert (plan._pack_buffer is not None) == packed
        assert plan._send_counts[1] == (8 if packed else 1)
        # a contiguous piece (whole rows) is never packed
        rows = ReshapeSpec(spec.input_boxes, (Box((0, 0), (2, 4)), Box((2, 0), (4, 4))), spec.dtype, "C", 0)
        plan2 = mpi_engine.MPIReshapePlan(SimpleNamespace(data_comm=MPI.COMM_SELF), rows)
        assert plan2._pack_buffer is None and plan2._send_displs[1] == 2 * 4 * 8
        plan2.free()
    finally:
        plan.free()


def test_empty_shapes_are_both_c_and_f_contiguous():
    from dask_pgas._arrays import _contiguity

    # torch.empty(0, 3).stride() == (3, 1): an empty GPU piece must not force a memory order on the plan
    assert _contiguity((0, 3), (24, 8), 8) == (True, True)
    assert _contiguity((2, 3), (24, 8), 8) == (True, False)
    assert _contiguity((2, 3), (8, 16), 8) == (False, True)


def test_a_package_no_backend_takes_is_a_value_error_as_in_nvmath(self_world):
    """nvmath refuses symmetric memory of a package it does not take with a ``ValueError``: the same class here
    (also a ``BackendUnavailableError``, which it was alone before) for a package the world's backends do not
    take, for allocations and reshape operands alike."""
    with pytest.raises(ValueError, match="no initialized backend handles cupy arrays") as caught:
        dask_pgas.allocate_symmetric_memory((2,), "cupy")
    assert isinstance(caught.value, errors.PackageUnavailableError)
    assert isinstance(caught.value, errors.BackendUnavailableError)
    assert dask_pgas.runtime.engine_for_package("numpy").name == "mpi"
    with pytest.raises(errors.PackageUnavailableError, match="initialize with backends=\\['nvshmem'\\]"):
        dask_pgas.runtime.engine_for_package("cupy")


def test_a_reshape_operand_no_backend_takes_keeps_its_class_through_the_agreement(self_world, monkeypatch):
    """(The operand's description carries its error to every rank by class name: an unknown name became a
    ``CollectiveError``.) A CuPy operand on an mpi world, as this CPU machine can give none."""
    monkeypatch.setattr(dask_pgas.reshape, "engine_for_package",
                        lambda package: dask_pgas.runtime.engine_for_package("cupy"))
    box = dask_pgas.Box((0,), (2,))
    with pytest.raises(errors.PackageUnavailableError, match="no initialized backend handles cupy arrays"):
        dask_pgas.Reshape(np.zeros(2), box, box)


def test_a_local_error_of_a_subclass_travels_as_its_nearest_kept_class(self_world, monkeypatch):
    """The ranks carry a local error by class name: a subclass the receiving table does not list arrives as its
    nearest listed base (it became the fallback, ``CollectiveError``, and so lost what callers catch it by)."""

    class Refused(errors.UnsupportedOperandError):
        pass

    def refuse(package):
        raise Refused("refused by a subclass")

    monkeypatch.setattr(dask_pgas.reshape, "engine_for_package", refuse)
    box = dask_pgas.Box((0,), (2,))
    with pytest.raises(errors.UnsupportedOperandError, match="refused by a subclass") as caught:
        dask_pgas.Reshape(np.zeros(2), box, box)
    assert not isinstance(caught.value, errors.CollectiveError)
    assert errors.carried_name(Refused, {"TypeError"}) == "TypeError"
    assert errors.carried_name(RuntimeError, {"TypeError"}) == "RuntimeError"  # (the receiver's fallback then)


def test_torch_symmetric_memory_on_the_mpi_engine_is_refused_with_the_cpu_way(self_world):
    """nvmath's ``allocate_symmetric_memory(shape, torch)`` makes GPU tensors; on the mpi engine the refusal says
    what a CPU port does instead, and that way works: a tensor over symmetric NumPy memory is an operand."""
    torch = pytest.importorskip("torch")
    with pytest.raises(errors.BackendUnavailableError, match=r"torch\.from_numpy\(\) of it is a tensor over it"):
        dask_pgas.allocate_symmetric_memory((4, 2), torch)
    a = dask_pgas.allocate_symmetric_memory((4, 2), np)
    a[...] = np.arange(8).reshape(4, 2)
    box = dask_pgas.Box((0, 0), (4, 2))
    out = dask_pgas.reshape.reshape(torch.from_numpy(a), box, box)
    assert isinstance(out, torch.Tensor) and np.array_equal(out.numpy(), a)
    dask_pgas.free_symmetric_memory(a)


def test_freeing_an_array_not_on_the_heap_is_also_a_type_error(self_world):
    """nvmath raises TypeError when asked to free a CPU array; the error here (still a SymmetricMemoryError, a
    ValueError) is caught by ``except TypeError`` too, for plain arrays and objects that are no array."""
    for other in (np.zeros(3), [1, 2]):
        with pytest.raises(errors.NotSymmetricMemoryError) as info:
            dask_pgas.free_symmetric_memory(other)
        assert isinstance(info.value, TypeError) and isinstance(info.value, errors.SymmetricMemoryError)


def test_operand_offsets_are_checked_before_the_result_is_allocated(self_world, monkeypatch):
    """A plan that cannot move its symmetric operand at the agreed offset (cuFFTMp's words off their boundary,
    with no peer copies to fall back on) refuses before execute()'s agreement: no result is allocated, so none
    leaks. An operand given by reset_operand_unchecked() is never compared across ranks: one whose offset would
    take another path than the agreed one (the plan moves 16-byte words here) is refused, on every rank; one
    that differs by whole words runs."""
    from dask_pgas.engines import mpi as mpi_engine

    a = dask_pgas.allocate_symmetric_memory((8,), np)
    a[:] = np.arange(8.0)
    box = dask_pgas.Box((0,), (4,))
    try:
        with dask_pgas.Reshape(a[0:4], box, box) as r:
            r.plan()
            assert r._offset == 0
            monkeypatch.setattr(mpi_engine.MPIReshapePlan, "operand_alignment", 16, raising=False)
            r.reset_operand_unchecked(a[1:5])
            with pytest.raises(errors.SymmetricMemoryError, match="starts 8 bytes into its allocation"):
                r.execute()
            r.reset_operand_unchecked(a[2:6])  # 16 bytes in: the same path
            out = r.execute()
            assert np.array_equal(out, np.arange(2.0, 6.0))
            dask_pgas.free_symmetric_memory(out)

            def refuse(self, offset):
                raise errors.UnsupportedOperandError(f"not at {offset}")

            monkeypatch.setattr(mpi_engine.MPIReshapePlan, "refuse_offset", refuse)
            before = dask_pgas.heap_usage()["allocations"]
            with pytest.raises(errors.UnsupportedOperandError, match="rank 0: not at 0"):
                r.execute()
            assert dask_pgas.heap_usage()["allocations"] == before
    finally:
        dask_pgas.free_symmetric_memory(a)
