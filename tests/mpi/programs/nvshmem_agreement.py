"""The GPU engine's agreements on CPU ranks: the real ``nvshmem`` engine, plans and front end, over fakes of the CUDA
driver, NVSHMEM and cuFFTMp. The fakes' collective calls (nvshmem_malloc/free/barrier, cufftMpMakeReshape/Exec/
Destroy, init/finalize) are MPI barriers on a communicator of their own, so a rank that skips one while the others
enter it leaves them blocked, and the launcher's timeout fails the test.

Prints one ``CASE {json}`` line per rank and case (like bad_inputs.py), with what the fakes saw. ``CASES=word``
runs only the cases whose name contains it. Needs >= 2 ranks.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import importlib.machinery
import os
import sys
import types

import numpy as np
from _common import COMM, RANK, SIZE, outcome_of, report_case, report_ok

import dask_pgas
from dask_pgas import memory
from dask_pgas.bindings import LibraryNotFound, cuda, cufftmp, nvshmem
from dask_pgas.distribution import Box
from dask_pgas.engines.base import Allocation
from dask_pgas.engines.nvshmem import NVSHMEMEngine
from dask_pgas.errors import DeviceError
from dask_pgas.reshape import reshape
from dask_pgas.runtime import get_engine

assert SIZE >= 2, "nvshmem_agreement needs at least 2 ranks"
LIB = COMM.Dup()  # the fake libraries' own collectives: never the engine's control plane
LAST = SIZE - 1  # the rank that fails
LEFT_INITIALIZED = 0  # inits that no rank may finalize (see bring_up_raising_on_last)


class FakeNV:
    def __init__(self):
        self.live, self.calls = {}, collections.Counter()

    def get_uniqueid(self):
        return bytes(128)

    status = 2  # what nvshmemx_init_status() reports on this rank after init

    raises = False  # NVSHMEM's init raises on this rank after its collective part

    first_on_host = None  # what the engine told the last init (the host's first PE holds the host lock)

    def init_with_uniqueid(self, uid, rank, nranks, *, first_on_host=None):
        self.calls["init"] += 1
        self.first_on_host = first_on_host
        LIB.Barrier()
        if self.raises:
            raise RuntimeError("injected: init raised after joining")
        return self.status

    def finalize(self):
        self.calls["finalize"] += 1
        LIB.Barrier()

    wrong_pe = False  # this rank's NVSHMEM reports another PE number than asked for

    def my_pe(self):
        return (RANK + 1) % SIZE if self.wrong_pe else RANK

    def n_pes(self):
        return SIZE

    full = False  # the symmetric heap has no room left (on every PE alike, as NVSHMEM's heaps are symmetric)
    max_block = None  # bytes: larger blocks do not fit (on every PE alike)

    def malloc(self, nbytes):
        self.calls["malloc"] += 1
        sizes = LIB.allgather(nbytes)  # NVSHMEM requires the same size on every PE (else undefined behaviour)
        if len(set(sizes)) > 1:
            raise AssertionError(f"nvshmem_malloc called with different sizes by rank: {sizes}")
        if self.full or (self.max_block is not None and nbytes > self.max_block):
            raise MemoryError(f"nvshmem_malloc({nbytes}) failed: the symmetric heap is full (fake)")
        buf = np.zeros(max(nbytes, 1), np.uint8)
        self.live[buf.ctypes.data] = buf
        return buf.ctypes.data

    def free(self, ptr):
        self.calls["free"] += 1
        LIB.Barrier()
        del self.live[ptr]

    def ptr(self, ptr, pe):
        return ptr  # every PE's heap "mapped"

    def barrier_all(self):
        LIB.Barrier()

    def sync_all_on_stream(self, stream):
        LIB.Barrier()


class FakeDriver:
    fail = None  # "h2d" or "d2h": this rank's copies in that direction raise; "device": make_current raises;
    #              "sync": ctx_synchronize raises (a sticky error in the context)
    free = 1 << 50  # bytes free on this rank's GPU
    bus = f"0000:{RANK + 1:02x}:00.0"  # this rank's GPU (one per rank unless a case shares one)

    def mem_get_info(self):
        return self.free, 1 << 50

    def pci_bus_id(self):
        return self.bus

    def make_current(self, device):
        if self.fail == "device":
            raise RuntimeError(f"cuCtxSetCurrent({device}) failed (fake)")

    def device_count(self):
        return 1

    def memcpy(self, dst, src, nbytes):
        if self.fail == ("h2d" if dst in NV.live else "d2h"):
            raise RuntimeError(f"cuMemcpy failed (fake, {self.fail})")
        ctypes.memmove(dst, src, nbytes)

    def memcpy_async(self, dst, src, nbytes, stream):
        self.memcpy(dst, src, nbytes)

    def stream_synchronize(self, stream):
        pass

    syncs_ok = 0  # with fail == "sync": this many synchronizes succeed first (the error appears later)

    def ctx_synchronize(self):
        if self.fail == "sync":
            if self.syncs_ok:
                self.syncs_ok -= 1
                return
            raise RuntimeError("cuCtxSynchronize failed: CUDA error 700 (an illegal memory access, fake)")

    def current(self):
        return contextlib.nullcontext()


class FakeCuFFTMp:
    """As measured on the H200 (scripts/gpu/probe_handle.py): Make and the Destroy of a made handle are collective,
    the Destroy of a handle that was never made is local. ``handles``: this rank's live handles -> made."""

    fail = None  # "create", "make", "workspace", "execute" or "destroy": this rank's call raises (collectives: after
    #              the barrier, i.e. a Make that fails on one rank completes on the others)
    workspace = 0  # bytes of workspace this rank's plans ask for
    last_workspace = None  # the workspace pointer of the last execute

    def __init__(self):
        self.calls = collections.Counter()
        self.handles, self._next = {}, 1

    def create(self):
        self.calls["create"] += 1
        if self.fail == "create":
            raise RuntimeError("cufftMpCreateReshape failed (fake)")
        handle, self._next = self._next, self._next + 1
        self.handles[handle] = False
        return handle

    def make(self, handle, word, *boxes):
        self.calls["make"] += 1
        LIB.Barrier()
        if self.fail == "make":
            raise RuntimeError("cufftMpMakeReshape failed (fake)")
        self.handles[handle] = True

    def workspace_size(self, handle):
        if self.fail == "workspace":
            raise RuntimeError("cufftMpGetReshapeSize failed (fake)")
        return self.workspace

    def execute(self, handle, out, inp, workspace, stream):
        self.calls["execute"] += 1
        self.last_workspace = workspace
        LIB.Barrier()

    def destroy(self, handle):
        self.calls["destroy"] += 1
        if self.handles.pop(handle):
            LIB.Barrier()
        if self.fail == "destroy":
            raise RuntimeError("cufftMpDestroyReshape failed (fake)")


def _no_cufftmp():
    raise LibraryNotFound("libcufftMp is missing (fake)")


NV, DRV, CF = FakeNV(), FakeDriver(), FakeCuFFTMp()
nvshmem.load = lambda: NV
cuda.driver = lambda: DRV
cufftmp.load = lambda: CF
NVSHMEMEngine.unavailable_reason = classmethod(lambda cls: None)
# a torch stand-in with float64 only, for the dtype checks (never used as an array here)
torch = types.ModuleType("torch")
torch.__spec__ = importlib.machinery.ModuleSpec("torch", None)
torch.dtype = type("dtype", (), {})
torch.float64, torch.Tensor = torch.dtype(), type("Tensor", (), {})
torch.cuda = types.SimpleNamespace(is_available=lambda: False)
sys.modules["torch"] = torch
SETTINGS = ("DASK_PGAS_NVSHMEM_RESHAPE", "DASK_PGAS_EMPTY_VIA_PEER", "DASK_PGAS_NVSHMEM_POOL_BYTES",
            "NVSHMEM_SYMMETRIC_SIZE")
for name in SETTINGS:
    os.environ.pop(name, None)


def case(name, fn):
    """Run ``fn`` on every rank and report its outcome and the fakes' call counts; reset the injected failures."""
    if os.environ.get("CASES", "") not in name:
        return
    before = NV.calls.copy(), CF.calls.copy()
    outcome = outcome_of(fn)
    DRV.fail = CF.fail = None
    DRV.free, DRV.bus = FakeDriver.free, FakeDriver.bus
    cufftmp.load = lambda: CF
    calls = {k: v for k, v in ((NV.calls - before[0]) + (CF.calls - before[1])).items() if v}
    report_case(name, {**outcome, "calls": calls, "initialized": dask_pgas.is_initialized()})


def initialize():
    dask_pgas.initialize(None, COMM, backends=["nvshmem"])


# -- settings that decide collective paths are agreed at bring-up ------------------------------------------------
def bring_up_with(**env):
    """Bring the engine up with ``env`` set in this rank's environment, and back down; every failure must leave
    neither an engine nor an initialized NVSHMEM behind."""
    os.environ.update(env)
    try:
        initialize()
        dask_pgas.finalize()
    finally:
        for name in env:
            os.environ.pop(name, None)
        assert not dask_pgas.is_initialized(), "a failed bring-up left an engine installed"
        assert NV.calls["init"] == NV.calls["finalize"] + LEFT_INITIALIZED, f"NVSHMEM left initialized: {NV.calls}"
        assert not NV.live, f"symmetric memory left allocated: {len(NV.live)} block(s)"


case("settings: DASK_PGAS_NVSHMEM_RESHAPE differs",
     lambda: bring_up_with(**({"DASK_PGAS_NVSHMEM_RESHAPE": "peer"} if RANK == 0 else {})))
case("settings: DASK_PGAS_EMPTY_VIA_PEER differs",
     lambda: bring_up_with(DASK_PGAS_EMPTY_VIA_PEER="1" if RANK == LAST else "0"))
case("settings: DASK_PGAS_NVSHMEM_POOL_BYTES differs",
     lambda: bring_up_with(DASK_PGAS_NVSHMEM_POOL_BYTES="0" if RANK == LAST else "64m"))
case("settings: NVSHMEM_SYMMETRIC_SIZE differs", lambda: bring_up_with(NVSHMEM_SYMMETRIC_SIZE=f"{RANK + 1}g"))
case("settings: unreadable pool size on one rank",
     lambda: bring_up_with(**({"DASK_PGAS_NVSHMEM_POOL_BYTES": "lots"} if RANK == LAST else {})))
def bring_up_as_wrong_pe():
    NV.wrong_pe = RANK == LAST
    try:
        bring_up_with()
    finally:
        NV.wrong_pe = False


case("bring-up: NVSHMEM numbers one rank wrongly", bring_up_as_wrong_pe)


def bring_up_failing_on_last(obj, attr, value):
    """Bring-up with ``obj.attr = value`` on the last rank: a step before NVSHMEM's collective init, or init's
    outcome, fails there only; every rank must raise (none left inside NVSHMEM's init or the first exchange)."""
    if RANK == LAST:
        setattr(obj, attr, value)
    try:
        bring_up_with()
    finally:
        obj.__dict__.pop(attr, None)


case("bring-up: making the device current fails on one rank", lambda: bring_up_failing_on_last(DRV, "fail", "device"))
case("bring-up: NVSHMEM does not initialize on one rank", lambda: bring_up_failing_on_last(NV, "status", 1))


def bring_up_raising_on_last():
    """NVSHMEM's init raised on the last rank after its collective part: the PEs where it came up took it down
    with a collective finalize that waited forever for that rank. No rank finalizes; every rank raises."""
    global LEFT_INITIALIZED
    if RANK == LAST:
        NV.raises = True
    LEFT_INITIALIZED += 1
    try:
        initialize()
    finally:
        NV.__dict__.pop("raises", None)
        assert not dask_pgas.is_initialized(), "a failed bring-up left an engine installed"


case("bring-up: NVSHMEM's init raises on one rank", bring_up_raising_on_last)


def bring_up_again_after_init_raised():
    """NVSHMEM stays initialized where its init came up: a second bring-up in these processes would init it
    again, waiting for PEs that are not in it. Every rank refuses, before NVSHMEM's init."""
    from dask_pgas.engines import nvshmem as engine_module

    assert engine_module._left_up_by, "the failed bring-up was not recorded"
    try:
        initialize()
    finally:
        engine_module._left_up_by = None  # (the fake's NVSHMEM has no state: the next cases may bring it up)
        assert not dask_pgas.is_initialized()


case("bring-up: again after NVSHMEM's init raised", bring_up_again_after_init_raised)


def bring_up_with_device_on_last():
    """``device_id`` given on the last rank only (the others pick theirs): no rank skips a collective step."""
    dask_pgas.initialize(0 if RANK == LAST else None, COMM, backends=["nvshmem"])
    dask_pgas.finalize()


case("bring-up: a device given on one rank only", bring_up_with_device_on_last)


def bring_up_marks_the_first_rank_on_the_host():
    """Only the host's first rank holds the host lock through NVSHMEM's init (the test's ranks share one host)."""
    bring_up_with()
    assert NV.first_on_host is (RANK == 0), (RANK, NV.first_on_host)


case("bring-up: only the host's first rank holds the host lock", bring_up_marks_the_first_rank_on_the_host)
case("settings: the same values spelled differently",
     lambda: bring_up_with(NVSHMEM_SYMMETRIC_SIZE="1g" if RANK else "1073741824", DASK_PGAS_NVSHMEM_RESHAPE="auto"))


def read_once(name, value):
    """``name=value`` set on rank 0 after bring-up changes nothing: plan modes and the pool follow the agreed
    settings (the defaults: cuFFTMp, and a pool that keeps the plan's staging buffers)."""
    initialize()
    try:
        if RANK == 0:
            os.environ[name] = value
        col = Box((0, 4 * RANK), (4 * SIZE, 4 * RANK + 4))
        row = Box((4 * RANK, 0), (4 * RANK + 4, 4 * SIZE))
        with dask_pgas.Reshape(np.zeros(col.box_shape), col, row) as r:
            r.plan()
            assert r._plan.mode == "cufftmp", r._plan.mode
            r.execute()
        cached = get_engine("nvshmem").heap_info()["heap_bytes_cached"]
        assert cached > 0, "the staging buffers were not kept by the pool"
    finally:
        os.environ.pop(name, None)
        dask_pgas.finalize()


case("settings: DASK_PGAS_NVSHMEM_RESHAPE read once at bring-up",
     lambda: read_once("DASK_PGAS_NVSHMEM_RESHAPE", "peer"))
case("settings: DASK_PGAS_NVSHMEM_POOL_BYTES read once at bring-up",
     lambda: read_once("DASK_PGAS_NVSHMEM_POOL_BYTES", "0"))

# -- host operands and cuFFTMp planning: a local failure is agreed before the next collective ------------------
initialize()
ENGINE = get_engine("nvshmem")
N = 4 * SIZE


def col(rank=RANK):
    return Box((0, 4 * rank), (N, 4 * rank + 4))


def row(rank=RANK):
    return Box((4 * rank, 0), (4 * rank + 4, N))


def failing(where, what):
    """One reshape of NumPy operands with ``what`` failing on the last rank (``where``: DRV, CF or "load")."""
    if RANK == LAST:
        if where == "load":
            cufftmp.load = _no_cufftmp
        else:
            where.fail = what
    result = reshape(np.zeros(col().box_shape), col(), row())
    assert result.shape == row().box_shape


def healthy():
    """A valid reshape right after a case: nobody is stuck, nothing leaked (heap blocks, cuFFTMp handles)."""
    result = reshape(np.zeros(col().box_shape), col(), row())
    assert result.shape == row().box_shape
    assert ENGINE.heap_info()["heap_allocations"] == 0, ENGINE.heap_info()
    assert not CF.handles, f"cuFFTMp handles left: {CF.handles}"


def failing_everywhere(where, what):
    """``failing`` with ``what`` failing on every rank."""
    where.fail = what
    reshape(np.zeros(col().box_shape), col(), row())


def leaked_handles(made):
    """After a Make that completed on some ranks only, every rank keeps its one handle: made where Make completed
    (its Destroy would wait for the others), unmade where it failed (its state is unknown). Forgets them, so that
    later cases start clean."""
    assert list(CF.handles.values()) == [made], CF.handles
    CF.handles.clear()


case("execute: host-to-device copy fails on one rank", lambda: failing(DRV, "h2d"))
case("execute: healthy after the failed upload", healthy)
case("execute: device-to-host copy fails on one rank", lambda: failing(DRV, "d2h"))
case("plan: loading cuFFTMp fails on one rank", lambda: failing("load", None))
case("plan: cufftMpCreateReshape fails on one rank", lambda: failing(CF, "create"))
case("plan: healthy after the failed create", healthy)
case("plan: cufftMpMakeReshape fails on one rank", lambda: failing(CF, "make"))
case("plan: the handles made where Make completed are left", lambda: leaked_handles(RANK != LAST))
case("plan: healthy after the failed make", healthy)
case("plan: cufftMpMakeReshape fails on every rank", lambda: failing_everywhere(CF, "make"))
case("plan: healthy after the make that failed everywhere", healthy)
case("plan: cufftMpGetReshapeSize fails on one rank", lambda: failing(CF, "workspace"))
case("plan: healthy after the failed workspace query", healthy)
case("plan: cufftMpDestroyReshape fails on one rank", lambda: failing(CF, "destroy"))
case("plan: no leak after the failed destroy", healthy)


def free_block_with_sticky_error():
    """A block allocated on every rank, freed with the last rank's context broken, the pool off (so the free is
    nvshmem_free, collective): every rank raises DeviceError before it (the last one must not raise alone, the
    others must not enter nvshmem_free)."""
    settings = ENGINE.settings
    ENGINE.settings = dataclasses.replace(settings, pool_limit=0)
    LEFT.append(ENGINE.allocate(1 << 20))
    if RANK == LAST:
        DRV.fail = "sync"
    try:
        ENGINE.free(LEFT[-1])
    finally:
        ENGINE.settings = settings


def refused_after_the_device_error():
    """The engine refuses every later call on every rank (the world cannot be used any more): no rank enters a
    collective with a broken peer. Nothing was freed: the block is left on every rank, and no nvshmem_free ran."""
    assert ENGINE.heap_info()["heap_allocations"] == len(LEFT), ENGINE.heap_info()
    assert NV.calls["free"] == FREES_BEFORE[0], (NV.calls["free"], FREES_BEFORE)
    for call in (lambda: ENGINE.allocate(64), lambda: ENGINE.free(LEFT[-1]),
                 lambda: reshape(np.zeros(col().box_shape), col(), row())):
        try:
            call()
        except DeviceError:
            continue
        raise AssertionError("a call of the broken engine did not raise DeviceError")
    raise DeviceError(ENGINE._broken)  # (the case's outcome: the same class on every rank)


def restart():
    """Stands in for restarting the processes (what a real broken context needs), so that later cases run: the
    engine is usable again and the blocks and handles left behind are dropped."""
    ENGINE._broken = None
    for ptr, nbytes in list(ENGINE._allocs.items()):
        ENGINE._release(Allocation(nbytes=nbytes, ptr=ptr, handle=ptr))
    LEFT.clear()
    CF.handles.clear()


def plan_blocks_left(handle_made):
    """After a plan's free failed everywhere, every rank keeps the plan's two staging blocks and its handle."""
    assert ENGINE.heap_info()["heap_allocations"] == 2, ENGINE.heap_info()
    assert list(CF.handles.values()) == [handle_made], CF.handles


LEFT: list = []  # blocks left allocated by a device error
FREES_BEFORE = [NV.calls["free"]]
case("free: the device fails before a collective free on one rank", free_block_with_sticky_error)
case("free: every later call is refused on every rank", refused_after_the_device_error)
case("free: (the processes restart)", restart)
case("free: the device fails before a plan's collective free on one rank", lambda: failing(DRV, "sync"))
case("free: the plan's blocks and handle are left on every rank", lambda: plan_blocks_left(True))
case("free: (the processes restart again)", restart)
case("free: healthy after the failed frees", healthy)


# -- peer copies (the fallback of layouts cuFFTMp cannot take): NumPy views of the fake heap stand in for CuPy's ---
@contextlib.contextmanager
def peer_copies_on_host(fail=False):
    """Plans in peer mode whose device views are NumPy views of the fake heap (which maps every peer's heap onto
    the local one, so the values are not checked here); ``fail``: making a view raises on the last rank."""
    import math

    import dask_pgas.engines.nvshmem as nvshmem_engine

    saved = nvshmem_engine._word_view, nvshmem_engine._StreamContext, nvshmem_engine._copy, ENGINE.settings

    def word_view(ptr, shape, itemsize, device, owner=None):
        if fail and RANK == LAST:
            raise RuntimeError("cannot view the peer's memory (fake)")
        word = next(w for w in (8, 4, 2, 1) if itemsize % w == 0)
        full = (*shape, itemsize // word)
        raw = (ctypes.c_char * (math.prod(full) * word)).from_address(ptr)
        return np.frombuffer(raw, dtype=f"<i{word}").reshape(full)

    nvshmem_engine._word_view = word_view
    nvshmem_engine._StreamContext = lambda handle, device: contextlib.nullcontext()
    nvshmem_engine._copy = np.copyto
    ENGINE.settings = dataclasses.replace(saved[3], force_peer=True)
    try:
        yield
    finally:
        nvshmem_engine._word_view, nvshmem_engine._StreamContext, nvshmem_engine._copy, ENGINE.settings = saved


def peer_reshape(fail=False):
    with peer_copies_on_host(fail):
        with dask_pgas.Reshape(np.zeros(col().box_shape), col(), row()) as r:
            r.plan()
            assert r._plan.mode == "peer", r._plan.mode
            assert r.execute().shape == row().box_shape
    assert ENGINE.heap_info()["heap_allocations"] == 0, ENGINE.heap_info()


case("peer: viewing memory fails on one rank", lambda: peer_reshape(fail=True))
case("peer: healthy after the failed copy", peer_reshape)


def misaligned_offset(offset):
    """A cuFFTMp plan of 16-byte words given an operand ``offset`` bytes into its allocation (agreed across ranks:
    Reshape passes the offset its position check found). At 8, every rank takes the peer copies, also the last,
    whose own pointer is aligned here (a rank whose piece is empty passes a view nobody compares): no rank may
    enter cuFFTMp's exec alone. At 0 every rank runs cuFFTMp."""
    with peer_copies_on_host():
        ENGINE.settings = dataclasses.replace(ENGINE.settings, force_peer=False)
        with dask_pgas.Reshape(np.zeros(col().box_shape), col(), row()) as r:
            r.plan()
            plan = r._plan
            assert plan.mode == "cufftmp" and plan.layout.word_size == 16, (plan.mode, plan.layout)
            a, b = ENGINE.allocate(plan.nbytes_in + 16), ENGINE.allocate(plan.nbytes_out)
            try:
                plan._run(a.ptr + (offset if RANK != LAST else 0), b.ptr, 0, True, offset)
            finally:
                ENGINE.free(a)
                ENGINE.free(b)


case("execute: a misaligned operand takes the peer copies on every rank", lambda: misaligned_offset(8))
case("execute: an aligned operand runs cuFFTMp on every rank", lambda: misaligned_offset(0))


def with_workspace(limit=None):
    """cuFFTMp asks only the last rank for a workspace: every rank allocates that size, executes with it and frees
    it. With a heap ``limit`` below it the engine refuses it on every rank before the collective malloc."""
    settings = ENGINE.settings
    CF.workspace = 4096 if RANK == LAST else 0
    if limit is not None:
        ENGINE._drain_pool()  # a pooled block of that size would be reused: no growth, no check
        ENGINE.settings = dataclasses.replace(settings, heap_limit=limit)
    try:
        healthy()
        assert CF.last_workspace, "cuFFTMp executed without the workspace"
    finally:
        CF.workspace, CF.last_workspace, ENGINE.settings = 0, None, settings


case("plan: cuFFTMp asks one rank for a workspace", with_workspace)
case("plan: a workspace past the heap cap is refused on every rank", lambda: with_workspace(limit=1024))
case("plan: healthy after the refused workspace", healthy)


def staging_past_the_cap():
    """NumPy operands go through two symmetric staging buffers. With room for one only, the second is refused on
    every rank; the first must be freed with it (it leaked, counted against the cap until finalize)."""
    settings = ENGINE.settings
    ENGINE._drain_pool()
    size = N * 4 * 8  # the largest box, in bytes: each staging buffer
    ENGINE.settings = dataclasses.replace(settings, heap_limit=ENGINE._held() + size + size // 2)
    try:
        reshape(np.zeros(col().box_shape), col(), row())
    finally:
        ENGINE.settings = settings


case("execute: the second staging buffer is past the heap cap", staging_past_the_cap)
case("execute: no leak after the refused staging", healthy)


# -- a dtype the package cannot view is refused before the collective allocation -------------------------------
def refused(dtype, internal=False):
    if internal:
        memory._allocate_internal(ENGINE, 64, (8,), np.dtype(dtype), "torch", "C")
    else:
        dask_pgas.allocate_symmetric_memory((8,), "torch", dtype=dtype)


def no_leak():
    assert ENGINE.heap_info()["heap_allocations"] == 0, ENGINE.heap_info()
    assert dask_pgas.heap_usage()["allocations"] == 0, dask_pgas.heap_usage()


case("dtype: torch has no such dtype, on every rank", lambda: refused("S8"))
case("dtype: no leak after the refused dtype", no_leak)
case("dtype: torch has no such dtype, on one rank", lambda: refused("S8" if RANK == LAST else "float64"))
case("dtype: library-internal allocation frees its block when the view fails", lambda: refused("S8", True))
case("dtype: no leak after the failed internal view", no_leak)


def view_fails_on_one_rank():
    """The dtype passes everywhere but viewing the block fails on one rank only: every rank frees it together."""
    def as_array(allocation, shape, dtype, package, order="C"):
        if RANK == LAST:
            raise RuntimeError("cannot view the block (fake)")
        return np.zeros(shape)

    ENGINE.as_array = as_array
    try:
        dask_pgas.allocate_symmetric_memory((8,), "torch", dtype="float64")
    finally:
        del ENGINE.as_array


case("view: fails on one rank after the dtype check", view_fails_on_one_rank)
case("view: no leak after the failed view", no_leak)


# -- bring-up from a unique id while the backend is up: refused before NVSHMEM is touched -------------------------
def uniqueid_while_initialized():
    from dask_pgas.engines.nvshmem import initialize_from_uniqueid

    calls, live = NV.calls.copy(), set(NV.live)
    try:
        initialize_from_uniqueid(bytes(128), RANK, SIZE, 0)
    finally:
        assert NV.calls["init"] - calls["init"] == NV.calls["finalize"] - calls["finalize"], "NVSHMEM left initialized"
        assert set(NV.live) == live, "symmetric memory left allocated"


case("uniqueid: bring-up while the backend is initialized", uniqueid_while_initialized)


# -- the NVSHMEM control plane (bring-up without MPI): a payload that cannot grow its buffer -----------------------
def control_cannot_grow():
    """The control plane's scratch buffer must grow for a large payload but the heap has no room (on every PE):
    every PE raises MemoryError, and the control plane keeps a live buffer (no dangling pointer freed twice)."""
    from dask_pgas.engines.nvshmem import NVSHMEMControl

    ctl = NVSHMEMControl(NV, DRV, capacity=1024)
    NV.max_block = 4096
    try:
        ctl.allgather(bytes(8192))
    finally:
        NV.max_block = None
        assert ctl.buf in NV.live, "the control plane's buffer is not a live block"
        assert len(ctl.allgather(RANK)) == SIZE
        ctl.free()


case("control: the scratch buffer cannot grow", control_cannot_grow)


# -- the heap grows only where every GPU has the memory for it ---------------------------------------------------
def device_short(free=None, bus=None, released=None, short=True, release_fails=False):
    """A 64-byte symmetric allocation with ``free`` bytes free on the GPU (every rank, or the last one when
    ``free`` is a dict) and the GPU ``bus`` shared by every rank; ``released``: free bytes once the package caches
    are given back; ``short``: whether the first look finds a GPU short (then every rank releases its caches once);
    ``release_fails``: releasing them raises on the last rank (which must still look again with the others).
    Still short: every rank raises the same MemoryError before the collective malloc."""
    import dask_pgas.engines.nvshmem as nvshmem_engine

    release = nvshmem_engine._release_package_caches
    calls = []

    def fake_release():
        calls.append(1)
        if released is not None:
            DRV.free = released
        if release_fails and RANK == LAST:
            raise RuntimeError("cannot release the package caches (fake)")

    ENGINE._drain_pool()  # a pooled 64-byte block would be reused: no growth, no check
    nvshmem_engine._release_package_caches = fake_release
    if isinstance(free, dict):
        DRV.free = free.get(RANK, FakeDriver.free)
    elif free is not None:
        DRV.free = free
    if bus is not None:
        DRV.bus = bus
    try:
        ENGINE.free(ENGINE.allocate(64))
    finally:
        nvshmem_engine._release_package_caches = release
        assert len(calls) == int(short), calls


NEED = 64 + ENGINE.settings.granularity  # what growing the heap by 64 bytes asks of a GPU
case("device memory: one rank's GPU is short", lambda: device_short({LAST: NEED - 1}))
case("device memory: healthy after the refused growth", healthy)
case("device memory: PEs sharing a GPU need room for all of them",
     lambda: device_short(SIZE * NEED - 1, bus="0000:41:00.0"))
case("device memory: a shared GPU with room for all",
     lambda: device_short(SIZE * NEED, bus="0000:41:00.0", short=False))
case("device memory: short until the package caches are released",
     lambda: device_short({LAST: NEED - 1}, released=NEED))
case("device memory: releasing the caches fails on one rank",
     lambda: device_short({LAST: NEED - 1}, released=NEED, release_fails=True))


# -- the Dask worker plugin: staging buffers that cannot grow fail that rechunk only, not the world -------------
@contextlib.contextmanager
def stand_in_plugin(as_array=None):
    """The worker plugin of this rank on a stand-in worker (no Dask), its buffers host arrays of the fake heap;
    its plans and buffers are freed collectively on the way out (the plugin's teardown, without finalizing the
    runtime)."""
    from dask_pgas.integration._worker_plugin import PGASWorkerPlugin

    worker = types.SimpleNamespace(name=f"w{RANK}", address=f"fake://{RANK}", handlers={}, stream_handlers={})
    plugin = PGASWorkerPlugin()
    plugin.setup(worker)
    plugin.pe, plugin.epoch, plugin.npes = RANK, 0, SIZE
    ENGINE._drain_pool()  # blocks kept from earlier cases would let a growth succeed without a malloc
    ENGINE.check_dtype = lambda dtype, package: None  # no CuPy here: the buffers are host arrays of the fake heap
    ENGINE.as_array = as_array or (lambda allocation, shape, dtype, package, order="C": np.zeros(shape, dtype))
    try:
        yield plugin
    finally:
        NV.full, DRV.free = False, FakeDriver.free
        for plan in plugin._plans.values():  # a run that executed cached its plan (with its host staging)
            plan.free()
        plugin._plans.clear()
        for kind in sorted(plugin._buffers):
            memory.free_symmetric_memory(plugin._buffers.pop(kind))
        plugin.teardown(worker)
        del ENGINE.check_dtype, ENGINE.as_array


def run_spec(dtype):
    from dask_pgas.integration._worker_plugin import RunSpec

    return RunSpec(tuple(map(col, range(SIZE))), tuple(map(row, range(SIZE))), dtype, "numpy")


def stage_and_run(plugin, spec):
    plugin.stage("run", RANK, 0, SIZE, spec, ((tuple(slice(None) for _ in range(2)),) * 2,),
                 (np.zeros(spec.input_boxes[RANK].box_shape),))
    return plugin._run("run", 0)


def plugin_run(grown_before, device=False):
    """One rechunk run on the worker plugin whose staging buffers cannot grow because the heap is full everywhere
    (or one rank's GPU is short): every PE raises the non-fatal run error, the world stays usable, nothing leaks."""
    with stand_in_plugin() as plugin:
        if grown_before:
            plugin._grow_buffers(run_spec("float32"), 1.25)  # half the bytes of the run below
        if device:  # the heap has room but the last rank's GPU has not
            DRV.free = 1 << 20 if RANK == LAST else FakeDriver.free
        else:
            NV.full = True
        try:
            stage_and_run(plugin, run_spec("float64"))
        except Exception as exc:
            assert getattr(exc, "fatal", True) is False, f"a fatal error: {exc!r}"
            assert plugin.broken is None, plugin.broken
            assert "NVSHMEM_MAX_MEMORY_PER_GPU" in str(exc), str(exc)
            assert not device or f"PEs [{LAST}]" in str(exc), str(exc)
            raise


class _NoCopy(np.ndarray):
    """A staging buffer whose copies fail while ``failing`` (the result's device memory is gone)."""

    failing = False

    def copy(self, *args, **kwargs):
        if _NoCopy.failing:
            raise MemoryError("out of memory copying the result (fake)")
        return np.asarray(self).copy(*args, **kwargs)


def copy_out_fails_on_one_rank():
    """The collective ends everywhere, then copying the result out of the staging buffer fails on the last rank
    only: that rank's run fails with the non-fatal run error, the others have their result, and the next run of
    every rank is healthy (nobody is left inside a collective)."""
    with stand_in_plugin(lambda allocation, shape, dtype, package, order="C": np.zeros(shape, dtype).view(_NoCopy)
                         ) as plugin:
        spec = run_spec("float64")
        _NoCopy.failing = RANK == LAST
        try:
            stage_and_run(plugin, spec)
            assert RANK != LAST, "the failed copy raised nothing"
        except Exception as exc:
            assert RANK == LAST, f"rank {RANK} raised {exc!r}"
            assert getattr(exc, "fatal", True) is False and "could not be copied" in str(exc), repr(exc)
            assert plugin.broken is None, plugin.broken
        finally:
            _NoCopy.failing = False
        _, result = stage_and_run(plugin, spec)
        assert type(result) is np.ndarray and result.shape == row().box_shape, (type(result), result.shape)


def result_synchronized_before_the_run_ends():
    """The result is copied out of the staging buffer on the collective thread's stream, and the output tasks read
    it from other threads (streams that need not follow that one): the run reports it only after a synchronize
    that comes after the copy."""
    log = []

    class _Logged(np.ndarray):
        def copy(self, *args, **kwargs):
            log.append("copy")
            return np.asarray(self).copy(*args, **kwargs)

    DRV.stream_synchronize = lambda stream: log.append("sync")
    try:
        with stand_in_plugin(lambda allocation, shape, dtype, package, order="C": np.zeros(shape, dtype).view(_Logged)
                             ) as plugin:
            stage_and_run(plugin, run_spec("float64"))
        assert "copy" in log and "sync" in log[log.index("copy"):], log
    finally:
        del DRV.stream_synchronize


case("plugin: the result is synchronized before the run ends", result_synchronized_before_the_run_ends)
case("plugin: staging buffers cannot grow, heap full on every PE", lambda: plugin_run(False))
case("plugin: no leak after the failed growth", no_leak)
case("plugin: heap full when grown buffers must grow again", lambda: plugin_run(True))
case("plugin: no leak after the failed regrowth", no_leak)
case("plugin: staging buffers cannot grow, one GPU short", lambda: plugin_run(False, device=True))
case("plugin: no leak after the GPU-short growth", no_leak)
case("plugin: copying the result out fails on one PE", copy_out_fails_on_one_rank)
case("plugin: no leak after the failed copy", no_leak)


def device_error_in_growth():
    """The staging buffers grow, and freeing the old one finds the last rank's device broken: every PE raises
    DeviceError, which is fatal for the world (not the non-fatal "cannot grow, give the workers more room")."""
    with stand_in_plugin() as plugin:
        plugin._grow_buffers(run_spec("float32"), 1.25)  # half the bytes of the run below
        if RANK == LAST:
            DRV.fail = "sync"
        try:
            stage_and_run(plugin, run_spec("float64"))
        except DeviceError as exc:
            assert getattr(exc, "fatal", True) is True, repr(exc)
            raise
        finally:  # the plugin's way out frees its plans and buffers: on a usable engine (see restart)
            DRV.fail, ENGINE._broken = None, None


case("plugin: a device error while the staging buffers grow is fatal", device_error_in_growth)
case("plugin: (the processes restart)", restart)
case("plugin: no leak after the device error", no_leak)


def finalize_with_device_error(syncs_ok: int = 0):
    """finalize() finds the last rank's device broken: every rank raises DeviceError, nothing collective runs
    on the device (NVSHMEM is not finalized), and the runtime is down. With ``syncs_ok``, finalize()'s first
    look at the device passes, but a plan's free finds it broken (a kernel failed in between): the plans left
    are abandoned, the same way."""
    global LEFT_INITIALIZED
    r = None
    if syncs_ok:
        r = dask_pgas.Reshape(np.zeros(col().box_shape), col(), row())
        r.plan()
    if RANK == LAST:
        DRV.fail, DRV.syncs_ok = "sync", syncs_ok
    LEFT_INITIALIZED += 1
    finalizes = NV.calls["finalize"]
    try:
        dask_pgas.finalize()
    finally:
        DRV.syncs_ok = 0
        assert NV.calls["finalize"] == finalizes, "NVSHMEM was finalized with a broken device"
        assert not dask_pgas.is_initialized()
        del r


def initialize_after_the_device_error():
    """NVSHMEM stays initialized after a device error: a later bring-up in these processes is refused."""
    from dask_pgas.engines import nvshmem as engine_module

    assert "after a device error" in (engine_module._left_up_by or ""), engine_module._left_up_by
    try:
        initialize()
    finally:
        engine_module._left_up_by = None
        NV.live.clear()  # (left on the broken device by design: the fake forgets them)
        assert not dask_pgas.is_initialized()


def teardown_with_device_error():
    """The plugin's teardown (the scheduler's, of a world a device error broke) with a cached plan and grown
    buffers, the last rank's device broken: every PE raises DeviceError once, its caches are dropped, and the
    runtime is down all the same (before, each call freed one thing more and the runtime stayed up)."""
    global LEFT_INITIALIZED
    with stand_in_plugin() as plugin:
        stage_and_run(plugin, run_spec("float64"))  # caches the run's plan and grows the buffers
        assert plugin._plans and plugin._buffers
        if RANK == LAST:
            DRV.fail = "sync"
        LEFT_INITIALIZED += 1
        try:
            plugin._teardown(force=True)
        finally:
            assert not plugin._plans and not plugin._buffers, (plugin._plans, plugin._buffers)
            assert not dask_pgas.is_initialized()
            assert plugin.epoch is None
            DRV.fail = None
            ENGINE.check_dtype, ENGINE.as_array = None, None  # (the stand-in's way out deletes them)


def initialize_again():
    global ENGINE
    initialize()
    ENGINE = get_engine("nvshmem")


case("teardown: the device fails on one rank, with a cached plan and buffers", teardown_with_device_error)
case("teardown: a later initialize is refused", initialize_after_the_device_error)
case("teardown: (the processes restart)", initialize_again)
case("finalize: a plan's free finds the device broken on one rank", lambda: finalize_with_device_error(syncs_ok=1))
case("finalize: a later initialize is refused after it", initialize_after_the_device_error)
case("finalize: (the processes restart)", initialize_again)
case("finalize: the device fails on one rank", finalize_with_device_error)
case("finalize: a later initialize is refused", initialize_after_the_device_error)
dask_pgas.finalize()  # (nothing to do: the case above took the runtime down)
assert not NV.live, f"symmetric memory leaked: {len(NV.live)} block(s)"
# every init was finalized, but the one that raised on a rank: that one is left, on every rank, by design
assert NV.calls["init"] == NV.calls["finalize"] + LEFT_INITIALIZED, NV.calls
report_ok()
