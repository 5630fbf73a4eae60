"""CPU-side checks of the GPU engine (no GPU needed; CI runs these): cuFFTMp 3-D layout planning (padding, axis
merging, element packing, Fortran order, empty boxes), ctypes struct layouts, environment defaults, and clean
messages when the GPU libraries are missing."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import itertools
import threading

import numpy as np
import pytest

from dask_pgas.distribution import Box
from dask_pgas.engines.base import ControlPlane
from dask_pgas.geometry.cufftmp_layout import (
    UnsupportedLayout,
    cufftmp_layout,
    dense_strides,
    merge_axes,
    pack_words,
)


def slabs(shape, axis, nranks):
    n = shape[axis]
    out = []
    for i in range(nranks):
        lo, up = [0] * len(shape), list(shape)
        lo[axis], up[axis] = n * i // nranks, n * (i + 1) // nranks
        out.append(Box(lo, up))
    return out


def boxes_cover(layout, nranks):
    """Every rank's 3-D box has strides dense for its extents, and the boxes tile the 3-D domain."""
    for lo, up, st in (*layout.input, *layout.output):
        assert len(lo) == len(up) == len(st) == 3
        assert st == dense_strides([b - a for a, b in zip(lo, up)])
    for side in (layout.input, layout.output):
        total = sum(int(np.prod([b - a for a, b in zip(lo, up)])) for lo, up, _ in side)
        assert total == int(np.prod(layout.domain))


def test_2d_padded_to_3d():
    lay = cufftmp_layout(slabs((8, 6), 1, 2), slabs((8, 6), 0, 2), 8)
    assert lay.word_size == 8
    assert lay.domain == (1, 8, 6)
    assert lay.input[0] == ((0, 0, 0), (1, 8, 3), (24, 3, 1))
    assert lay.output[1] == ((0, 4, 0), (1, 8, 6), (24, 6, 1))
    boxes_cover(lay, 2)


def test_1d_padded():
    lay = cufftmp_layout([Box((0,), (5,)), Box((5,), (12,))], [Box((0,), (7,)), Box((7,), (12,))], 4)
    assert lay.domain == (1, 1, 12)
    assert lay.input[1][:2] == ((0, 0, 5), (1, 1, 12))


def test_widest_word_used():
    lay = cufftmp_layout(slabs((8192, 8192), 1, 2), slabs((8192, 8192), 0, 2), 8)
    assert lay.word_size == 16 and lay.domain == (1, 8192, 4096)


def test_merge_full_inner_axes():
    shape = (4, 3, 5, 2, 6)
    lay = cufftmp_layout(slabs(shape, 0, 2), slabs(shape, 2, 2), 8)
    # axes 3,4 are full everywhere -> merged; the result fits in 3-D
    boxes_cover(lay, 2)
    assert int(np.prod(lay.domain)) * lay.word_size == int(np.prod(shape)) * 8


def test_merge_axes_extent_one():
    boxes, dom = merge_axes([([0, 2], [1, 5]), ([1, 0], [2, 6])], [2, 6])
    assert dom == [12] and boxes == [([2], [5]), ([6], [12])]


def test_unmergeable_4d_raises():
    ins = [Box((0, 0, 0, 0), (2, 4, 4, 2)), Box((2, 0, 0, 0), (4, 4, 4, 2)),
           Box((0, 0, 0, 2), (2, 4, 4, 4)), Box((2, 0, 0, 2), (4, 4, 4, 4))]
    outs = [Box((0, 0, 0, 0), (4, 2, 2, 4)), Box((0, 2, 0, 0), (4, 4, 2, 4)),
            Box((0, 0, 2, 0), (4, 2, 4, 4)), Box((0, 2, 2, 0), (4, 4, 4, 4))]
    with pytest.raises(UnsupportedLayout, match="at most 3 axes"):
        cufftmp_layout(ins, outs, 8)


@pytest.mark.parametrize("itemsize,word", [(1, 16), (2, 16), (4, 16), (8, 16), (16, 16), (32, 16), (12, 16)])
def test_packing_when_bounds_allow(itemsize, word):
    shape = (6, 64)
    lay = cufftmp_layout(slabs(shape, 0, 2), slabs(shape, 1, 2), itemsize)
    assert lay.word_size == word
    assert lay.domain[-1] * word == 64 * itemsize


def test_packing_refused_with_clear_message():
    with pytest.raises(UnsupportedLayout, match="cannot be packed"):
        cufftmp_layout(slabs((4, 5), 0, 2), slabs((4, 5), 1, 2), 1)


def test_pack_words_bytes():
    w, boxes, dom = pack_words([([0], [6]), ([6], [10])], [10], 2)
    assert w == 4 and dom == [5] and boxes == [([0], [3]), ([3], [5])]


def test_fortran_reverses_axes():
    c = cufftmp_layout(slabs((6, 10), 0, 2), slabs((6, 10), 1, 2), 8, "C")
    f = cufftmp_layout(slabs((10, 6), 1, 2), slabs((10, 6), 0, 2), 8, "F")
    assert c == f


def test_empty_boxes_marked():
    ins = [Box((0, 0), (0, 4)), Box((0, 0), (4, 4))]
    outs = [Box((0, 0), (2, 4)), Box((2, 0), (4, 4))]
    lay = cufftmp_layout(ins, outs, 8)
    assert lay.empty_input_ranks == (0,) and lay.empty_output_ranks == ()
    assert lay.input[0][0] == lay.input[0][1] == (0, 0, 0)
    assert lay.has_empty


def test_offset_domain():
    ins = [Box((10, 5), (12, 9)), Box((12, 5), (14, 9))]
    outs = [Box((10, 5), (14, 7)), Box((10, 7), (14, 9))]
    lay = cufftmp_layout(ins, outs, 4)
    assert lay.input[0][0] == (0, 0, 0)
    boxes_cover(lay, 2)


def _reference_merge_check(shape, ins, outs, itemsize):
    """The 3-D word layout addresses the same bytes: map every element's global byte position through both."""
    lay = cufftmp_layout(ins, outs, itemsize)
    return lay


@pytest.mark.parametrize("seed", range(20))
def test_random_layouts_cover_domain(seed):
    rng = np.random.default_rng(seed)
    ndim = int(rng.integers(1, 5))
    shape = tuple(int(x) for x in rng.integers(1, 7, ndim))
    nranks = int(rng.integers(1, 4))
    axis_in, axis_out = int(rng.integers(0, ndim)), int(rng.integers(0, ndim))
    itemsize = int(rng.choice([1, 2, 4, 8, 16]))
    try:
        lay = cufftmp_layout(slabs(shape, axis_in, nranks), slabs(shape, axis_out, nranks), itemsize)
    except UnsupportedLayout:
        return
    boxes_cover(lay, nranks)
    assert int(np.prod(lay.domain)) * lay.word_size == int(np.prod(shape)) * itemsize


# -- ctypes layouts and bindings -----------------------------------------------------------------------------
def test_nvshmem_struct_layouts():
    from dask_pgas.bindings import nvshmem

    assert ctypes.sizeof(nvshmem.UniqueId) == 128
    assert ctypes.sizeof(nvshmem.InitAttr) == 144
    assert nvshmem.InitAttr.mpi_comm.offset == 8
    assert nvshmem.InitAttr.args.offset == 16
    uid_args = 16 + nvshmem._InitArgs.uid_args.offset
    assert uid_args == 24
    assert uid_args + nvshmem._UidArgs.id.offset == 32
    assert uid_args + nvshmem._UidArgs.myrank.offset == 40
    assert uid_args + nvshmem._UidArgs.nranks.offset == 44


def test_cufftmp_result_names_follow_cufft_h():
    """cufftResult values as cufft.h numbers them (13 NO_WORKSPACE, 14 NOT_IMPLEMENTED; 17-20 are CUDA 13's)."""
    from dask_pgas.bindings.cufftmp import CuFFTMpError

    for code, name in ((4, "INVALID_VALUE"), (13, "NO_WORKSPACE"), (14, "NOT_IMPLEMENTED"), (16, "NOT_SUPPORTED"),
                       (20, "NVSHMEM_FAILURE")):
        assert str(CuFFTMpError("cufftMpExecReshapeAsync", code)).endswith(f"CUFFT_{name} ({code})")


def test_nvshmem_host_calls_hold_the_lock():
    """The host API is serialized (one thread at a time): every bound call runs under the binding's lock."""
    import threading
    import types

    from dask_pgas.bindings import nvshmem

    nv = nvshmem.NVSHMEM.__new__(nvshmem.NVSHMEM)
    nv.lock = threading.RLock()
    held = {}

    def bound(name, result):
        def call(*args):
            held[name] = nv.lock._is_owned()
            return result

        return call

    names = {"nvshmem_my_pe": 0, "nvshmem_n_pes": 1, "nvshmem_malloc": 4096, "nvshmem_free": None,
             "nvshmem_ptr": 4096, "nvshmem_barrier_all": None, "nvshmemx_sync_all_on_stream": None,
             "nvshmem_getmem": None, "nvshmem_quiet": None, "nvshmemx_vendor_get_version_info": None,
             "nvshmemx_hostlib_finalize": None, "nvshmemx_get_uniqueid": 0}
    nv.lib = types.SimpleNamespace(**{name: bound(name, result) for name, result in names.items()})
    nv.my_pe(), nv.n_pes(), nv.version(), nv.get_uniqueid()
    nv.free(nv.malloc(8))
    nv.ptr(4096, 0), nv.barrier_all(), nv.sync_all_on_stream(0), nv.getmem(8192, 4096, 8, 0), nv.finalize()
    assert held == dict.fromkeys(names, True)


def test_cufftmp_calls_hold_the_nvshmem_lock():
    """cuFFTMp calls NVSHMEM inside its own calls (Make allocates symmetric memory): every bound cuFFTMp call runs
    under the NVSHMEM binding's lock, like NVSHMEM's own host calls."""
    import threading
    import types

    from dask_pgas.bindings import cufftmp

    cf = cufftmp.CuFFTMp.__new__(cufftmp.CuFFTMp)
    lock = threading.RLock()
    held = {}

    def bound(name):
        def call(*args):
            held[name] = lock._is_owned()
            return 0

        return call

    names = ["cufftMpCreateReshape", "cufftMpGetReshapeSize", "cufftMpExecReshapeAsync", "cufftMpDestroyReshape"]
    cf.lib, cf._make, cf._lock = types.SimpleNamespace(**{n: bound(n) for n in names}), bound("make"), lock
    h = cf.create()
    cf.make(h, 8, (0, 0, 0), (1, 1, 1), (1, 1, 1), (0, 0, 0), (1, 1, 1), (1, 1, 1))
    cf.workspace_size(h), cf.execute(h, 16, 32, 0, 0), cf.destroy(h)
    assert held == dict.fromkeys([*names, "make"], True)


class _FakeCuda:
    """libcuda's current-context calls, per thread as the driver keeps them."""

    def __init__(self):
        self.tls, self.sets = threading.local(), []

    def cuCtxGetCurrent(self, out):
        out._obj.value = getattr(self.tls, "ctx", None)
        return 0

    def cuCtxSetCurrent(self, ctx):
        self.tls.ctx = ctx.value
        self.sets.append(ctx.value)
        return 0


def test_driver_makes_the_engine_context_current_for_its_calls():
    """CudaDriver.current(): with no context current, the engine's becomes current and stays; with another one
    current (a context of the thread's own, another device), the engine's is current inside and the other one
    after; with the engine's current, nothing is set. Before, a thread with another context current ran the
    engine's copies and synchronizations in that context."""
    from dask_pgas.bindings.cuda import CudaDriver

    drv = CudaDriver.__new__(CudaDriver)
    drv.lib, drv._ctx = _FakeCuda(), ctypes.c_void_p(0xE)
    now = drv.lib.tls

    with drv.current():
        assert now.ctx == 0xE
    assert now.ctx == 0xE and drv.lib.sets == [0xE]  # none was current: it stays
    with drv.current(), drv.current():  # the engine's is current: nothing to do, nested or not
        pass
    assert drv.lib.sets == [0xE]
    now.ctx = 0xF  # another context
    with drv.current():
        assert now.ctx == 0xE
        with drv.current():
            assert now.ctx == 0xE
        assert now.ctx == 0xE
    assert now.ctx == 0xF and drv.lib.sets == [0xE, 0xE, 0xF]
    with pytest.raises(KeyError), drv.current():
        raise KeyError("inside")
    assert now.ctx == 0xF  # given back on an exception too


def test_missing_libraries_messages(monkeypatch, tmp_path):
    from dask_pgas import bindings
    from dask_pgas.bindings import cufftmp, nvshmem

    monkeypatch.setattr("sys.path", [str(tmp_path)])
    monkeypatch.delenv("DASK_PGAS_NVSHMEM_LIB", raising=False)
    monkeypatch.delenv("DASK_PGAS_CUFFTMP_LIB", raising=False)
    nvshmem.load.reset()
    cufftmp.load.reset()
    with pytest.raises(bindings.LibraryNotFound, match=r"libnvshmem_host.so.3.*nvidia-nvshmem-cu13"):
        nvshmem.load()
    with pytest.raises(ImportError, match=r"cuFFTMp.*nvidia-cufftmp-cu13"):
        cufftmp.load()


def test_unavailable_reason_names_the_extra():
    from dask_pgas.engines.nvshmem import NVSHMEMEngine

    reason = NVSHMEMEngine.unavailable_reason()
    if importlib.util.find_spec("cupy") is None and importlib.util.find_spec("torch") is None:
        assert reason is not None and "pip install cupy-cuda13x nvidia-nvshmem-cu13" in reason
    else:  # pragma: no cover - depends on the machine
        assert reason is None or isinstance(reason, str)


def test_install_hint_names_the_wheels_of_the_gpu_extras():
    """The hint names packages one can install from PyPI (dask_pgas itself is not there): exactly the wheels of
    the cuda13 and cuda12 extras."""
    import os
    import re

    from dask_pgas.bindings import extra_hint

    tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:  # (the package may run from a checkout)
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    hint = extra_hint()
    for extra in ("cuda13", "cuda12"):
        wheels = [re.match(r"[A-Za-z0-9_.-]+", r).group() for r in extras[extra]]
        assert len(wheels) == 3 and " ".join(wheels) in hint, (extra, wheels, hint)
    assert "dask_pgas[" not in hint


def test_import_is_light_and_public_names():
    import dask_pgas

    assert callable(dask_pgas.get_nvshmem_uniqueid) and callable(dask_pgas.initialize_from_uniqueid)
    assert "mpi" in dask_pgas.runtime.BACKENDS and "nvshmem" in dask_pgas.runtime.BACKENDS


def test_env_defaults():
    from dask_pgas.engines.nvshmem import apply_env_defaults

    env = {}
    apply_env_defaults(True, env)
    assert env["NVSHMEM_DISABLE_NVLS"] == "1" and env["NVSHMEM_REMOTE_TRANSPORT"] == "none"
    assert env["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] == "lo"
    env = {"NVSHMEM_DISABLE_NVLS": "0", "NVSHMEM_REMOTE_TRANSPORT": "ibrc", "DASK_PGAS_HEAP_SIZE": "4g"}
    apply_env_defaults(True, env)
    assert env["NVSHMEM_DISABLE_NVLS"] == "0" and env["NVSHMEM_REMOTE_TRANSPORT"] == "ibrc"
    assert env["NVSHMEM_SYMMETRIC_SIZE"] == "4g"
    env = {"NVSHMEM_DISABLE_NVLS": "yes"}
    apply_env_defaults(False, env)
    assert env["NVSHMEM_DISABLE_NVLS"] == "1" and "NVSHMEM_REMOTE_TRANSPORT" not in env


@pytest.mark.parametrize("text,value", [("1073741824", 1 << 30), ("4g", 4 << 30), ("512M", 512 << 20),
                                        ("2GiB", 2 << 30), (None, 1 << 30)])
def test_parse_size(text, value):
    from dask_pgas.engines.nvshmem import parse_size

    assert parse_size(text) == value


def test_stream_handle_forms():
    from dask_pgas.engines.nvshmem import stream_handle

    class CupyLike:
        ptr = 1234

    class TorchLike:
        cuda_stream = 99

    class Proto:
        def __cuda_stream__(self):
            return (0, 77)

    assert stream_handle(5) == 5 and stream_handle(None) == 0
    assert stream_handle(CupyLike()) == 1234 and stream_handle(TorchLike()) == 99 and stream_handle(Proto()) == 77
    with pytest.raises(TypeError):
        stream_handle("default")


def test_layout_is_byte_exact_against_numpy():
    """Simulate cuFFTMp on the 3-D word description with NumPy: the bytes land where the N-D reshape says."""
    rng = np.random.default_rng(0)
    for shape, ax_in, ax_out, dtype, order, n in itertools.product(
        [(6, 8), (4, 3, 8), (2, 3, 4, 8)], [0, 1], [0, -1], ["int8", "float16", "float64", "complex128"], "CF",
        [1, 2, 3],
    ):
        dt = np.dtype(dtype)
        ins, outs = slabs(shape, ax_in, n), slabs(shape, ax_out % len(shape), n)
        try:
            lay = cufftmp_layout(ins, outs, dt.itemsize, order)
        except UnsupportedLayout:
            continue
        glob = rng.integers(0, 256, int(np.prod(shape)) * dt.itemsize, dtype=np.uint8).view(dt).reshape(shape)
        word = np.dtype(f"V{lay.word_size}")
        # the global array as seen by cuFFTMp: C order of the (reversed for F) axes, as 3-D words
        flat = np.ascontiguousarray(glob if order == "C" else glob.T).reshape(-1)
        g3 = flat.view(np.uint8).view(word).reshape(lay.domain)
        for r in range(n):
            lo, up, _ = lay.output[r]
            got = g3[tuple(slice(a, b) for a, b in zip(lo, up))]
            want = np.asarray(glob[outs[r].relative_to(Box((0,) * len(shape), shape))], order=order)
            want_bytes = (want if order == "C" else want.T).tobytes() if want.size else b""
            assert np.ascontiguousarray(got).tobytes() == want_bytes, (shape, ax_in, ax_out, dtype, order, n, r)


# -- engine logic with fake NVSHMEM/CUDA objects (no GPU) ----------------------------------------------------
class _FakeNV:
    def __init__(self):
        self.next, self.live, self.calls = 4096, {}, []

    def malloc(self, n):
        if sum(self.live.values()) + max(n, 1) > 1 << 20:
            raise MemoryError("full")
        ptr, self.next = self.next, self.next + max(n, 1) + 256
        self.live[ptr] = max(n, 1)
        self.calls.append(("malloc", n))
        return ptr

    def free(self, ptr):
        del self.live[ptr]
        self.calls.append(("free", ptr))

    def my_pe(self):
        return 0

    def n_pes(self):
        return 1

    def ptr(self, p, pe):
        return p


class _FakeDrv:
    free = 1 << 40

    def current(self):
        return contextlib.nullcontext()

    def ctx_synchronize(self):
        pass

    def mem_get_info(self):
        return self.free, 1 << 40

    def pci_bus_id(self):
        return "0000:01:00.0"


class _FakeControl(ControlPlane):
    rank, size = 0, 1

    def allgather(self, obj):
        return [obj]


def _fake_engine(monkeypatch, pool_bytes=None):
    import threading

    from dask_pgas.engines.nvshmem import NVSHMEMEngine, NVSHMEMSettings

    if pool_bytes is None:
        monkeypatch.delenv("DASK_PGAS_NVSHMEM_POOL_BYTES", raising=False)
    else:
        monkeypatch.setenv("DASK_PGAS_NVSHMEM_POOL_BYTES", str(pool_bytes))
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "4m")
    eng = NVSHMEMEngine.__new__(NVSHMEMEngine)
    eng.nv, eng.drv, eng.control, eng.device, eng.my_pe, eng.status = _FakeNV(), _FakeDrv(), _FakeControl(), 0, 0, 2
    eng._allocs, eng._pool, eng._pool_bytes, eng._plans, eng._lock = {}, {}, 0, [], threading.RLock()
    eng.peers_mapped, eng.settings = True, NVSHMEMSettings.from_env()
    return eng


def test_symmetric_pool_reuses_blocks(monkeypatch):
    eng = _fake_engine(monkeypatch)
    a = eng.allocate(1000)
    eng.free(a)
    assert eng.heap_info()["heap_bytes_cached"] == 1000 and eng.heap_info()["heap_allocations"] == 0
    b = eng.allocate(1000)
    assert b.ptr == a.ptr and [c for c in eng.nv.calls if c[0] == "malloc"] == [("malloc", 1000)]
    c = eng.allocate(2000)
    assert c.ptr != a.ptr
    eng.free(b)
    eng.free(c)
    eng._drain_pool()
    assert not eng.nv.live and eng.heap_info()["heap_bytes_cached"] == 0


def test_symmetric_pool_disabled_and_drained_when_full(monkeypatch):
    eng = _fake_engine(monkeypatch, pool_bytes=0)
    a = eng.allocate(100)
    eng.free(a)
    assert not eng.nv.live and eng.heap_info()["heap_bytes_cached"] == 0
    eng = _fake_engine(monkeypatch, pool_bytes=1 << 20)
    blocks = [eng.allocate(300_000) for _ in range(3)]
    for blk in blocks:
        eng.free(blk)
    assert eng.heap_info()["heap_bytes_cached"] == 900_000
    big = eng.allocate(500_000)  # does not fit beside the cached blocks: the pool is drained first
    assert eng.heap_info()["heap_bytes_cached"] == 0 and list(eng.nv.live.values()) == [500_000]
    eng.free(big)


def test_heap_cap_refuses_before_the_collective_malloc(monkeypatch):
    """NVSHMEM ends the process when its heap cannot grow: the engine refuses such an allocation itself (the same
    on every PE), after dropping its pooled blocks, without calling nvshmem_malloc."""
    from dask_pgas.engines.nvshmem import NVSHMEMSettings

    monkeypatch.setenv("NVSHMEM_MAX_MEMORY_PER_GPU", "1m")
    monkeypatch.setenv("NVSHMEM_CUMEM_GRANULARITY", "128k")  # two of them are kept back: 768 KiB for the engine
    eng = _fake_engine(monkeypatch, pool_bytes=1 << 20)
    assert eng.heap_info()["heap_limit"] == 768 << 10
    eng.free(eng.allocate(300_000))
    assert eng.heap_info()["heap_bytes_cached"] == 300_000
    big = eng.allocate(600_000)  # fits once the pooled block is dropped
    assert eng.heap_info()["heap_bytes_cached"] == 0 and list(eng.nv.live.values()) == [600_000]
    mallocs = len([c for c in eng.nv.calls if c[0] == "malloc"])
    with pytest.raises(MemoryError, match="NVSHMEM_MAX_MEMORY_PER_GPU"):
        eng.allocate(200_000)  # the fake NVSHMEM would still take it
    assert len([c for c in eng.nv.calls if c[0] == "malloc"]) == mallocs
    eng.free(big)
    eng._drain_pool()
    # a fixed heap (no CUDA VMM) returns NULL when full instead: its limit is NVSHMEM_SYMMETRIC_SIZE itself (4m in
    # _fake_engine), and NVSHMEM's default 1 GiB heap is usable as it is (once a limit of 0: every block refused)
    monkeypatch.setenv("NVSHMEM_DISABLE_CUDA_VMM", "1")
    assert NVSHMEMSettings.from_env().heap_limit == 4 << 20
    monkeypatch.delenv("NVSHMEM_SYMMETRIC_SIZE")
    assert NVSHMEMSettings.from_env().heap_limit == 1 << 30
    eng.settings = NVSHMEMSettings.from_env()
    with pytest.raises(MemoryError, match=r"fixed \(NVSHMEM_DISABLE_CUDA_VMM\).*raise NVSHMEM_SYMMETRIC_SIZE"):
        eng.allocate((1 << 30) + 1)
    eng.free(eng.allocate(1 << 20))


def test_device_memory_is_checked_before_the_heap_grows(monkeypatch):
    """A growing heap maps GPU memory inside nvshmem_malloc: with too little free, the engine first gives the
    packages' cached blocks back, then refuses without calling nvshmem_malloc (its own pool stays: freed heap
    memory stays mapped). A fixed heap (no CUDA VMM) was mapped at bring-up and is not checked."""
    import dask_pgas.engines.nvshmem as nvshmem_engine
    from dask_pgas.engines.nvshmem import NVSHMEMSettings

    released = []
    monkeypatch.setattr(nvshmem_engine, "_release_package_caches", lambda: released.append(1))
    monkeypatch.setenv("NVSHMEM_CUMEM_GRANULARITY", "128k")
    eng = _fake_engine(monkeypatch, pool_bytes=1 << 20)
    eng.free(eng.allocate(1000))
    eng.drv.free = 2000 + (128 << 10) - 1  # one byte short of the block and a granule
    mallocs = len([c for c in eng.nv.calls if c[0] == "malloc"])
    with pytest.raises(MemoryError, match=r"GPU 0000:01:00.0 .*PEs \[0\]"):
        eng.allocate(2000)
    assert released == [1] and eng.heap_info()["heap_bytes_cached"] == 1000
    assert len([c for c in eng.nv.calls if c[0] == "malloc"]) == mallocs
    eng.drv.free += 1
    eng.free(eng.allocate(2000))
    monkeypatch.setenv("NVSHMEM_DISABLE_CUDA_VMM", "1")
    eng.settings, eng.drv.free = NVSHMEMSettings.from_env(), 0
    eng.free(eng.allocate(3000))
    assert released == [1]
    eng._drain_pool()


@pytest.mark.parametrize(
    "ins,outs,itemsize,mode",
    [
        ([Box((0, 0), (4, 4)), Box((4, 0), (4, 4))], [Box((0, 0), (4, 4)), Box((0, 0), (0, 0))], 8, "copy"),
        ([Box((0, 0), (0, 5)), Box((0, 0), (0, 5))], [Box((0, 0), (0, 2)), Box((0, 2), (0, 5))], 4, "copy"),
        ([Box((0, 0), (4, 2)), Box((0, 2), (4, 4))], [Box((0, 0), (2, 4)), Box((2, 0), (4, 4))], 8, "cufftmp"),
        ([Box((0, 0), (4, 3)), Box((0, 3), (4, 5))], [Box((0, 0), (2, 5)), Box((2, 0), (4, 5))], 1, "peer"),
    ],
)
def test_plan_mode_decisions(monkeypatch, ins, outs, itemsize, mode):
    from dask_pgas.engines import nvshmem as eng_mod
    from dask_pgas.engines.base import ReshapeSpec

    monkeypatch.delenv("DASK_PGAS_NVSHMEM_RESHAPE", raising=False)
    eng = _fake_engine(monkeypatch)
    eng.control = type("C", (ControlPlane,), {"rank": 0, "size": 2, "allgather": lambda self, o: [o, o]})()
    monkeypatch.setattr(eng_mod.NVSHMEMReshapePlan, "_create_cufftmp", lambda self: None)
    monkeypatch.setattr(eng_mod.NVSHMEMReshapePlan, "_make_cufftmp", lambda self: None)
    spec = ReshapeSpec(tuple(ins), tuple(outs), np.dtype(f"V{itemsize}"), "C", 0)
    plan = eng.plan_reshape(spec)
    assert plan.mode == mode


def test_unpackable_without_peer_access_is_a_clear_error(monkeypatch):
    from dask_pgas.engines.base import ReshapeSpec
    from dask_pgas.errors import UnsupportedOperandError

    eng = _fake_engine(monkeypatch)
    eng.peers_mapped = False
    eng.control = type("C", (ControlPlane,), {"rank": 0, "size": 2, "allgather": lambda self, o: [o, o]})()
    ins = (Box((0, 0), (4, 3)), Box((0, 3), (4, 5)))
    outs = (Box((0, 0), (2, 5)), Box((2, 0), (4, 5)))
    with pytest.raises(UnsupportedOperandError, match="cannot be packed"):
        eng.plan_reshape(ReshapeSpec(ins, outs, np.dtype("i1"), "C", 0))


def test_open_library_sets_signatures_and_names_what_is_missing():
    import ctypes
    import ctypes.util
    import os

    from dask_pgas.bindings import LibraryNotFound, open_library

    libc = ctypes.util.find_library("c") or "libc.so.6"
    lib = open_library(libc, os.RTLD_NOW, "libc", {"strlen": (ctypes.c_size_t, [ctypes.c_char_p])}, "a libc")
    assert lib.strlen(b"abcd") == 4
    with pytest.raises(LibraryNotFound, match=r"symbol no_such_symbol_xyz is missing .*newer.*cuda13"):
        open_library(libc, os.RTLD_NOW, "libc", {"no_such_symbol_xyz": (None, [])}, "a newer libc")
    with pytest.raises(LibraryNotFound, match=r"cannot load foo /nonexistent/libfoo.so"):
        open_library("/nonexistent/libfoo.so", os.RTLD_NOW, "foo", {}, "")
