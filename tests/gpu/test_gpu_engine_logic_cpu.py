"""The GPU engine's logic on CPU, over the fakes of test_gpu_planning_cpu.py: word layouts, plan modes, the
symmetric pool and heap limit, streams, the unique-id bring-up and the environment set before NVSHMEM starts.
Each test failed on a mutant of the engine that the other CPU tests let through (a mutation review)."""

from __future__ import annotations

import dataclasses
import pickle
import types

import numpy as np
import pytest

from dask_pgas.distribution import Box
from dask_pgas.engines.base import ControlPlane, ReshapeSpec
from dask_pgas.geometry.cufftmp_layout import cufftmp_layout
from tests.gpu.test_gpu_planning_cpu import _fake_engine, _FakeControl, boxes_cover


def _byte_exact(shape, ins, outs, itemsize):
    """Simulate cuFFTMp on the 3-D word layout (C order): every rank's input and output 3-D box addresses exactly
    the bytes of its N-D box."""
    lay = cufftmp_layout(ins, outs, itemsize)
    rng = np.random.default_rng(1)
    glob = rng.integers(0, 256, int(np.prod(shape)) * itemsize, dtype=np.uint8).view(f"V{itemsize}").reshape(shape)
    g3 = glob.reshape(-1).view(np.uint8).view(f"V{lay.word_size}").reshape(lay.domain)
    origin = Box((0,) * len(shape), shape)
    for side, boxes in ((lay.input, ins), (lay.output, outs)):
        for (lo, up, _), box in zip(side, boxes):
            got = np.ascontiguousarray(g3[tuple(slice(a, b) for a, b in zip(lo, up))]).tobytes()
            want = np.ascontiguousarray(glob[box.relative_to(origin)]).tobytes() if not box.is_empty else b""
            assert got == want, (box, lo, up)
    return lay


def test_axes_merge_only_where_the_inner_axis_is_spanned_from_zero():
    """A box that reaches the end of the inner axis but starts past 0, over several rows, is not one contiguous
    run: the axes must not merge (slab tilings never show this: a hand-made tiling)."""
    shape = (3, 4)
    ins = [Box((0, 0), (1, 4)), Box((1, 2), (3, 4)), Box((1, 0), (2, 2)), Box((2, 0), (3, 2))]
    outs = [Box((0, 0), (1, 4)), Box((1, 0), (2, 4)), Box((2, 0), (3, 4)), Box((0, 0), (0, 0))]
    lay = _byte_exact(shape, ins, outs, 8)
    assert lay.domain == (1, 3, 2)  # not merged (16-byte words: 2 per row)
    boxes_cover(lay, 4)


def test_empty_output_boxes_are_marked():
    ins = [Box((0, 0), (2, 4)), Box((2, 0), (4, 4))]
    outs = [Box((0, 0), (4, 4)), Box((0, 0), (0, 4))]
    lay = cufftmp_layout(ins, outs, 8)
    assert lay.empty_input_ranks == () and lay.empty_output_ranks == (1,) and lay.has_empty
    assert lay.output[1][:2] == ((0, 0, 0), (0, 0, 0))


def test_unpackable_message_names_the_element_multiple():
    from dask_pgas.geometry.cufftmp_layout import UnsupportedLayout

    for itemsize, multiple in ((1, 4), (2, 2), (3, 4), (6, 2)):
        with pytest.raises(UnsupportedLayout, match=f"multiples of {multiple} elements"):
            cufftmp_layout([Box((0, 0), (2, 5)), Box((2, 0), (4, 5))],
                           [Box((0, 0), (4, 3)), Box((0, 3), (4, 5))], itemsize)


# -- plan modes and execution over fakes ---------------------------------------------------------------------
class _Two(ControlPlane):
    rank, size = 0, 2

    def allgather(self, obj):
        return [obj, obj]


def _cufftmp_plan(monkeypatch, eng, ins, outs, itemsize=8):
    from dask_pgas.engines import nvshmem as eng_mod

    eng.control = _Two()
    monkeypatch.setattr(eng_mod.NVSHMEMReshapePlan, "_create_cufftmp", lambda self: None)
    monkeypatch.setattr(eng_mod.NVSHMEMReshapePlan, "_make_cufftmp", lambda self: None)
    return eng.plan_reshape(ReshapeSpec(tuple(ins), tuple(outs), np.dtype(f"V{itemsize}"), "C", 0))


EMPTY_INS = (Box((0, 0), (4, 4)), Box((0, 0), (0, 4)))
EMPTY_OUTS = (Box((0, 0), (2, 4)), Box((2, 0), (4, 4)))


def test_empty_via_peer_routes_empty_boxes_around_cufftmp(monkeypatch):
    """DASK_PGAS_EMPTY_VIA_PEER=1 (agreed at bring-up): a reshape with an empty box on some rank takes the peer
    copies; without it, cuFFTMp; without peer access, a clear error that names the empty boxes."""
    from dask_pgas.errors import UnsupportedOperandError

    eng = _fake_engine(monkeypatch)
    assert _cufftmp_plan(monkeypatch, eng, EMPTY_INS, EMPTY_OUTS).mode == "cufftmp"
    eng.settings = dataclasses.replace(eng.settings, empty_via_peer=True)
    assert _cufftmp_plan(monkeypatch, eng, EMPTY_INS, EMPTY_OUTS).mode == "peer"
    # boxes without empties are not affected by the setting
    full = _cufftmp_plan(monkeypatch, eng, (Box((0, 0), (4, 2)), Box((0, 2), (4, 4))), EMPTY_OUTS)
    assert full.mode == "cufftmp"
    eng.peers_mapped = False
    with pytest.raises(UnsupportedOperandError, match=r"DASK_PGAS_EMPTY_VIA_PEER=1 .* empty on some ranks"):
        _cufftmp_plan(monkeypatch, eng, EMPTY_INS, EMPTY_OUTS)
    # a valid layout sent to peer copies by the setting that forces them: the refusal names that setting
    eng.settings = dataclasses.replace(eng.settings, empty_via_peer=False, force_peer=True)
    with pytest.raises(UnsupportedOperandError, match=r"DASK_PGAS_NVSHMEM_RESHAPE=peer sends this reshape"):
        _cufftmp_plan(monkeypatch, eng, (Box((0, 0), (4, 2)), Box((0, 2), (4, 4))), EMPTY_OUTS)


class _Recorder:
    def __init__(self, log):
        self.log = log

    def sync_all_on_stream(self, stream):
        self.log.append(("sync", stream))

    def execute(self, handle, out, inp, workspace, stream):
        self.log.append(("execute", handle, out, inp, workspace, stream))


def test_cufftmp_exec_is_preceded_by_sync_all_and_gets_out_then_in(monkeypatch):
    """cufftMpExecReshapeAsync(handle, out, in, workspace, stream) writes into remote outputs: with
    sync_symmetric_memory, nvshmemx_sync_all_on_stream(stream) comes first on the same stream; without it, no
    sync. The output pointer goes before the input."""
    eng = _fake_engine(monkeypatch)
    plan = _cufftmp_plan(monkeypatch, eng, (Box((0, 0), (4, 2)), Box((0, 2), (4, 4))), EMPTY_OUTS)
    assert plan.mode == "cufftmp" and plan.layout.word_size == 16
    log = []
    eng.nv = types.SimpleNamespace(sync_all_on_stream=_Recorder(log).sync_all_on_stream)
    plan._cf, plan._handle = _Recorder(log), 77
    plan._run(0x1000, 0x2000, 5, True, 0)
    assert log == [("sync", 5), ("execute", 77, 0x2000, 0x1000, 0, 5)]
    log.clear()
    plan._run(0x1000, 0x2000, 5, False, 32)  # an aligned offset: still cuFFTMp
    assert log == [("execute", 77, 0x2000, 0x1000, 0, 5)]
    plan._handle = 0


def test_misaligned_operand_without_peer_access_is_refused(monkeypatch):
    """An operand at an offset that is not a multiple of the word size cannot go through cuFFTMp; without every
    peer's heap mapped there is no fallback: UnsupportedOperandError, before any collective."""
    from dask_pgas.errors import UnsupportedOperandError

    eng = _fake_engine(monkeypatch)
    eng.peers_mapped = False
    plan = _cufftmp_plan(monkeypatch, eng, (Box((0, 0), (4, 2)), Box((0, 2), (4, 4))), EMPTY_OUTS)
    log = []
    eng.nv = types.SimpleNamespace(sync_all_on_stream=_Recorder(log).sync_all_on_stream)
    plan._cf = _Recorder(log)
    with pytest.raises(UnsupportedOperandError, match="8 bytes past a 16-byte boundary"):
        plan._run(0x1008, 0x2000, 0, True, 8)
    assert log == []


class _Heaps:
    """One fake symmetric heap (host bytes) per PE, at different addresses; ``ptr`` maps an address of one PE's
    heap to the same place of another's, as nvshmem_ptr does."""

    def __init__(self, npes, nbytes=256):
        self.heaps = [np.zeros(nbytes, np.uint8) for _ in range(npes)]
        self.me = 0

    def base(self, pe):
        return self.heaps[pe].ctypes.data

    def ptr(self, p, pe):
        assert 0 <= p - self.base(self.me) < self.heaps[self.me].nbytes, "not an address of this PE's heap"
        return self.base(pe) + (p - self.base(self.me))

    def view(self, p, shape, itemsize, device, owner=None):
        for heap in self.heaps:
            if 0 <= p - heap.ctypes.data < heap.nbytes:
                start = p - heap.ctypes.data
                return heap[start: start + int(np.prod(shape)) * itemsize].view(f"V{itemsize}").reshape(shape)
        raise AssertionError(f"{p:#x} is in no heap")

    def sync_all_on_stream(self, stream):
        pass


def test_peer_copies_address_peers_through_the_output_block(monkeypatch):
    """The peer path pushes each piece into its PE's output block, which every PE has at the same place; a PE
    whose input is empty may pass a view anywhere (its position is never compared), and a pull through that
    pointer read the wrong bytes (a[0:0] where the others passed a[1:])."""
    import contextlib

    from dask_pgas.engines import nvshmem as eng_mod

    npes, item = 3, 8
    fake = _Heaps(npes)
    monkeypatch.setattr(eng_mod, "_word_view", fake.view)
    monkeypatch.setattr(eng_mod, "_StreamContext", lambda stream, device: contextlib.nullcontext())
    monkeypatch.setattr(eng_mod, "_copy", lambda dst, src: dst.__setitem__(Ellipsis, src))
    glob = np.arange(100.0, 108.0)
    ins = (Box((0,), (5,)), Box((0,), (0,)), Box((5,), (8,)))  # PE 1 holds nothing
    outs = (Box((0,), (2,)), Box((2,), (6,)), Box((6,), (8,)))
    src_at, dst_at = 8, 128  # operands one float64 into their allocation (heap offset 0); results at 128
    for pe in range(npes):
        heap = fake.heaps[pe].view(np.float64)
        heap[:] = -1.0
        heap[1: 1 + ins[pe].size] = glob[ins[pe].lower[0]: ins[pe].upper[0]]
    for pe in range(npes):  # each PE's part, in turn (the syncs around it are no-ops here)
        fake.me = pe
        plan = object.__new__(eng_mod.NVSHMEMReshapePlan)
        plan.spec = ReshapeSpec(ins, outs, np.dtype("f8"), "C", pe)
        plan.engine = types.SimpleNamespace(nv=fake, device=0)
        src = fake.base(pe) + (0 if ins[pe].is_empty else src_at)  # PE 1: a[0:0], not a[1:1]
        plan._run_peer(src, fake.base(pe) + dst_at, 0)
    for pe in range(npes):
        got = fake.heaps[pe].view(np.float64)[dst_at // item: dst_at // item + outs[pe].size]
        assert np.array_equal(got, glob[outs[pe].lower[0]: outs[pe].upper[0]]), (pe, got)


def test_control_plane_calls_run_in_the_engine_context():
    """The NVSHMEM control plane (Reshape's agreements, the Dask plugin's exchanges) calls nvshmem_barrier_all,
    malloc and free from whatever thread the caller runs on: inside drv.current(), as the engine's calls."""
    from dask_pgas.engines.nvshmem import NVSHMEMControl

    state = {"in": False}
    calls = []

    class _Ctx:
        def __enter__(self):
            state["in"] = True

        def __exit__(self, *exc):
            state["in"] = False

    class _NV:
        def my_pe(self):
            return 0

        def n_pes(self):
            return 1

        def malloc(self, n):
            calls.append(("malloc", state["in"]))
            return 4096

        def barrier_all(self):
            calls.append(("barrier_all", state["in"]))

        def free(self, p):
            calls.append(("free", state["in"]))

    class _Drv:
        current = _Ctx

        def __init__(self):
            self.mem = {}

        def memcpy(self, dst, src, n):
            pass

        def stream_synchronize(self, s):
            pass

    control = NVSHMEMControl(_NV(), _Drv(), capacity=64)
    calls.clear()
    payload = pickle.dumps(1)
    control._read = lambda pe, n: len(payload).to_bytes(8, "little") + (payload if n > 8 else b"")  # (host bytes)
    control.allgather(1)
    control.barrier()
    control.free()
    assert calls and all(inside for _, inside in calls), calls


def test_host_copy_mode_with_empty_boxes_of_different_shapes(monkeypatch):
    """Copy mode also covers ranks whose input and output are both empty, possibly of different shapes: nothing to
    copy (np.copyto would refuse to broadcast (0, 2) into (0, 5))."""
    eng = _fake_engine(monkeypatch)
    eng.control = _Two()
    ins = (Box((0, 0), (0, 2)), Box((0, 0), (4, 5)))
    outs = (Box((0, 0), (0, 5)), Box((0, 0), (4, 5)))
    plan = eng.plan_reshape(ReshapeSpec(ins, outs, np.dtype("f8"), "C", 0))
    assert plan.mode == "copy"
    plan.execute(np.zeros((0, 2)), np.zeros((0, 5)))


def test_staging_buffers_have_the_size_of_the_largest_piece_on_any_rank(monkeypatch):
    """nvshmem_malloc is collective and needs the same size on every PE: the staging buffers of host operands are
    sized by the largest box over all ranks, not by this rank's own pieces."""
    eng = _fake_engine(monkeypatch)
    ins = (Box((0, 0), (4, 1)), Box((0, 1), (4, 4)))
    outs = (Box((0, 0), (1, 4)), Box((1, 0), (4, 4)))
    plan = _cufftmp_plan(monkeypatch, eng, ins, outs, itemsize=4)  # rank 0: 16-byte pieces, rank 1: 48
    plan._staging()
    assert [c for c in eng.nv.calls if c[0] == "malloc"] == [("malloc", 48), ("malloc", 48)]
    plan.free()


# -- a device error on one PE before a collective free ------------------------------------------------------
class _PeerFailed(ControlPlane):
    """Two PEs; the other one's local step failed (a sticky CUDA error in its context)."""
    rank, size = 0, 2

    def allgather(self, obj):
        call, same, _ = obj
        return [obj, (call, same, "CudaError: cuCtxSynchronize failed: CUDA error 700 (an illegal memory access)")]


def test_a_device_error_on_another_pe_stops_every_pe_before_the_collective_free(monkeypatch):
    """engine.free and plan.free wait for the device and agree on it before nvshmem_free and cufftMpDestroyReshape
    (both collective): a PE whose synchronize fails makes every PE raise DeviceError there, none enters the
    collective call alone, and the engine refuses every later call (on every PE alike). Before, the failing PE
    raised alone and the others waited inside nvshmem_free."""
    from dask_pgas.errors import DeviceError

    eng = _fake_engine(monkeypatch, pool_bytes=0)
    block = eng.allocate(1000)
    plan = _cufftmp_plan(monkeypatch, eng, (Box((0, 0), (4, 2)), Box((0, 2), (4, 4))), EMPTY_OUTS)
    destroyed = []
    plan._cf = types.SimpleNamespace(destroy=destroyed.append)
    plan._handle, plan._made = 77, True
    eng.control = _PeerFailed()
    with pytest.raises(DeviceError, match=r"on rank 1 before a collective free \(CudaError: .*illegal memory access"):
        eng.free(block)
    for call in (plan.free, lambda: eng.allocate(10), lambda: eng.free(block)):
        with pytest.raises(DeviceError, match="on rank 1"):
            call()
    assert not [c for c in eng.nv.calls if c[0] == "free"] and destroyed == []
    assert eng.heap_info()["heap_allocations"] == 1  # still held, as on the other PE


def test_a_device_error_here_is_agreed_too(monkeypatch):
    """This PE's failed synchronize is reported to every PE (the message names this rank), not raised alone."""
    from dask_pgas.bindings.cuda import CudaError
    from dask_pgas.errors import DeviceError

    eng = _fake_engine(monkeypatch, pool_bytes=0)
    block = eng.allocate(1000)

    def sticky():
        raise CudaError("cuCtxSynchronize failed: CUDA error 700 (an illegal memory access)")

    eng.drv.ctx_synchronize = sticky
    seen = []
    eng.control = type("C", (ControlPlane,), {"rank": 0, "size": 2,
                                              "allgather": lambda self, o: seen.append(o) or [o, (*o[:2], None)]})()
    with pytest.raises(DeviceError, match=r"on rank 0 before a collective free \(CudaError"):
        eng.free(block)
    assert seen and seen[0][2].startswith("CudaError") and not [c for c in eng.nv.calls if c[0] == "free"]


def test_a_free_paired_with_another_step_is_a_mismatch_even_when_it_failed(monkeypatch):
    """The agreement before a free is named: a PE freeing alone meets a peer's other step as a mismatch on both
    (CollectiveMismatchError, the engine not marked broken on either), also when its synchronize failed. With a
    label compared only among ranks without an error, one PE ended broken and the other not."""
    from dask_pgas.bindings.cuda import CudaError
    from dask_pgas.errors import CollectiveMismatchError

    eng = _fake_engine(monkeypatch, pool_bytes=0)
    block = eng.allocate(1000)

    def sticky():
        raise CudaError("cuCtxSynchronize failed: CUDA error 700")

    eng.drv.ctx_synchronize = sticky
    eng.control = type("C", (ControlPlane,), {"rank": 0, "size": 2,
                                              "allgather": lambda self, o: [o, (None, None, None)]})()
    with pytest.raises(CollectiveMismatchError):
        eng.free(block)
    assert eng._broken is None


def test_engine_and_plan_calls_run_in_the_engine_context(monkeypatch):
    """allocate, free, plan_reshape, execute, plan free and finalize run inside drv.current() (the engine's CUDA
    context current in the calling thread)."""
    eng = _fake_engine(monkeypatch)
    entered = []

    class _Ctx:
        def __enter__(self):
            entered.append(True)

        def __exit__(self, *exc):
            entered.append(False)

    eng.drv.current = _Ctx
    eng.control = _Two()
    eng.free(eng.allocate(100))
    assert entered == [True, False, True, False]
    entered.clear()
    plan = eng.plan_reshape(ReshapeSpec((Box((0,), (4,)), Box((4,), (4,))), (Box((0,), (4,)), Box((4,), (4,))),
                                        np.dtype("f8"), "C", 0))
    assert entered == [True, False]
    plan.execute(np.zeros(4), np.zeros(4))
    plan.free()
    assert entered == [True, False] * 3
    entered.clear()
    eng.nv.finalize = eng.drv.stream_synchronize = lambda *args: None
    eng.finalize()
    assert entered[:1] == [True] and entered[-1:] == [False]


# -- the symmetric pool and the heap limit -------------------------------------------------------------------
def test_heap_limit_admits_an_allocation_that_reaches_it_exactly(monkeypatch):
    monkeypatch.setenv("NVSHMEM_MAX_MEMORY_PER_GPU", "1m")
    monkeypatch.setenv("NVSHMEM_CUMEM_GRANULARITY", "128k")
    eng = _fake_engine(monkeypatch, pool_bytes=0)
    limit = eng.settings.heap_limit
    a = eng.allocate(limit - 1000)
    b = eng.allocate(1000)  # exactly at the limit: allowed
    with pytest.raises(MemoryError):
        eng.allocate(1)
    eng.free(a)
    eng.free(b)


def test_pool_keeps_blocks_up_to_its_limit_inclusive_and_counts_reuse(monkeypatch):
    eng = _fake_engine(monkeypatch, pool_bytes=1000)
    a = eng.allocate(1000)
    eng.free(a)  # exactly the pool limit: kept
    assert eng.heap_info()["heap_bytes_cached"] == 1000 and not [c for c in eng.nv.calls if c[0] == "free"]
    b = eng.allocate(1000)  # reused: no longer counted as cached
    assert b.ptr == a.ptr and eng.heap_info()["heap_bytes_cached"] == 0
    assert eng._held() == 1000
    eng.free(b)
    assert eng.heap_info()["heap_bytes_cached"] == 1000
    eng._drain_pool()


def test_pool_limit_defaults_to_a_quarter_of_the_heap():
    from dask_pgas.engines.nvshmem import NVSHMEMSettings

    assert NVSHMEMSettings.from_env({}).pool_limit == 1 << 28
    assert NVSHMEMSettings.from_env({"NVSHMEM_SYMMETRIC_SIZE": "4g"}).pool_limit == 1 << 30
    no_pool = {"NVSHMEM_SYMMETRIC_SIZE": "4g", "DASK_PGAS_NVSHMEM_POOL_BYTES": "0"}
    assert NVSHMEMSettings.from_env(no_pool).pool_limit == 0


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", "y", "on", " 1 "])
def test_fixed_heap_spellings(value):
    from dask_pgas.engines.nvshmem import NVSHMEMSettings

    s = NVSHMEMSettings.from_env({"NVSHMEM_DISABLE_CUDA_VMM": value, "NVSHMEM_SYMMETRIC_SIZE": "2g"})
    assert not s.heap_grows and s.heap_limit == 2 << 30


def test_devices_are_told_apart_by_host_and_bus(monkeypatch):
    """Two PEs on different hosts whose GPUs have the same PCI bus id do not share a GPU: each needs room for its
    own block only."""
    import socket

    monkeypatch.setenv("NVSHMEM_CUMEM_GRANULARITY", "128k")
    eng = _fake_engine(monkeypatch, pool_bytes=0)
    need = 1000 + (128 << 10)
    mine = (socket.gethostname(), "0000:01:00.0", need, None)
    other = ("another-host", "0000:01:00.0", need, None)
    eng.control = type("C", (ControlPlane,), {"rank": 0, "size": 2, "allgather": lambda self, o: [mine, other]})()
    block = eng.allocate(1000)  # on one GPU together they would need 2 * need
    eng.control = _FakeControl()
    eng.free(block)


# -- agreements at bring-up ----------------------------------------------------------------------------------
HEAP_ENVS = [
    {"NVSHMEM_MAX_MEMORY_PER_GPU": "1m", "NVSHMEM_CUMEM_GRANULARITY": "128k", "NVSHMEM_SYMMETRIC_SIZE": "2m",
     "DASK_PGAS_NVSHMEM_POOL_BYTES": "4k", "DASK_PGAS_NVSHMEM_RESHAPE": "peer", "DASK_PGAS_EMPTY_VIA_PEER": "1"},
    {"NVSHMEM_DISABLE_CUDA_VMM": "1", "NVSHMEM_SYMMETRIC_SIZE": "3m", "NVSHMEM_CUMEM_GRANULARITY": "2m"},
]


@pytest.mark.parametrize("env", HEAP_ENVS)
def test_agreed_settings_read_every_variable(env):
    """The engine takes its settings from NVSHMEMSettings.agreed (not from_env): it must see every variable."""
    from dask_pgas.engines.nvshmem import NVSHMEMSettings

    assert NVSHMEMSettings.agreed(_FakeControl(), env) == NVSHMEMSettings.from_env(env)


@pytest.mark.parametrize("name,mine,theirs", [("NVSHMEM_MAX_MEMORY_PER_GPU", "1g", "2g"),
                                              ("NVSHMEM_CUMEM_GRANULARITY", "512m", "2m"),
                                              ("NVSHMEM_DISABLE_CUDA_VMM", "1", None)])
def test_heap_variables_must_match_on_every_rank(name, mine, theirs):
    from dask_pgas.engines.nvshmem import NVSHMEMSettings
    from dask_pgas.errors import BackendUnavailableError

    class Ctl(ControlPlane):
        rank, size = 0, 2

        def allgather(self, obj):
            raw, _, err = obj
            other = {**raw, name: theirs}
            return [obj, (other, NVSHMEMSettings.from_env(other), err)]

    with pytest.raises(BackendUnavailableError, match=f"rank 0: [^;]*{name}='{mine}'.*rank 1: [^;]*{name}="):
        NVSHMEMSettings.agreed(Ctl(), {name: mine})


def test_peer_access_is_agreed_by_every_pe(monkeypatch):
    """peers_mapped decides the peer fallback (a collective path): a PE that reaches its peers must still say no
    when another PE does not."""
    from dask_pgas.engines.nvshmem import NVSHMEMEngine
    from tests.gpu.test_gpu_planning_cpu import _FakeDrv, _FakeNV

    class NV(_FakeNV):
        def n_pes(self):
            return 2

    class Ctl(ControlPlane):
        rank, size = 0, 2

        def allgather(self, obj):
            return [obj, False] if isinstance(obj, bool) else [obj, obj]

    eng = NVSHMEMEngine(NV(), _FakeDrv(), 0, Ctl(), 2, expected=(0, 2))
    assert eng.peers_mapped is False


# -- streams ---------------------------------------------------------------------------------------------------
def _fake_packages(monkeypatch):
    import sys

    current = {"device": 0}  # the thread's current device; each device has its own current stream
    cupy_streams, torch_streams = {0: 4242, 1: 5151}, {0: 99, 1: 98}

    def switched(*args):  # the engine must not switch the thread's device to read a stream
        raise AssertionError("cupy.cuda.Device used")

    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=switched, get_current_stream=lambda d=-1: types.SimpleNamespace(
            ptr=cupy_streams[current["device"] if d == -1 else d])))
    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(
        current_stream=lambda d=None: types.SimpleNamespace(
            cuda_stream=torch_streams[current["device"] if d is None else d])))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "torch", torch)
    return current


def test_default_stream_is_the_packages_current_stream(monkeypatch):
    """The package's current stream, of the engine's device when given: a thread that made another device
    current has another current stream there, which the engine cannot use."""
    from dask_pgas.engines.nvshmem import stream_handle

    current = _fake_packages(monkeypatch)
    assert stream_handle(None, "cupy") == 4242 and stream_handle(None, "torch") == 99
    assert stream_handle(None) == 0 and stream_handle(None, "numpy") == 0
    current["device"] = 1
    assert stream_handle(None, "cupy", 0) == 4242 and stream_handle(None, "torch", 0) == 99
    assert stream_handle(None, "cupy") == 5151 and current["device"] == 1


def test_execute_and_synchronize_use_the_resolved_stream(monkeypatch):
    """execute(stream=None) on a CuPy operand runs on CuPy's current stream; synchronize() then waits for that
    stream (the last one used), not the default stream."""
    _fake_packages(monkeypatch)
    eng = _fake_engine(monkeypatch)
    plan = _cufftmp_plan(monkeypatch, eng, (Box((0, 0), (4, 2)), Box((0, 2), (4, 4))), EMPTY_OUTS)
    log = []
    eng.nv = types.SimpleNamespace(sync_all_on_stream=_Recorder(log).sync_all_on_stream)
    plan._cf, plan._handle = _Recorder(log), 77
    Arr = type("ndarray", (), {"__module__": "cupy._core.core"})
    src, dst = Arr(), Arr()
    src.data, dst.data = types.SimpleNamespace(ptr=0x1000), types.SimpleNamespace(ptr=0x2000)
    plan.execute(src, dst)
    assert log == [("sync", 4242), ("execute", 77, 0x2000, 0x1000, 0, 4242)]
    synced = []
    eng.drv.stream_synchronize = synced.append
    plan.synchronize()
    plan.synchronize(7)
    assert synced == [4242, 7]
    plan._handle = 0


# -- unique-id bootstrap and the environment NVSHMEM starts with ---------------------------------------------
class _FakeLib:
    def __init__(self):
        self.calls, self.flags, self.attr = [], None, None

    def __getattr__(self, name):
        def call(*args):
            self.calls.append(name)
            if name == "nvshmemx_hostlib_init_attr":
                self.flags = args[0]
            return 2 if name == "nvshmemx_init_status" else 0
        return call


def _bound_nvshmem():
    import threading

    from dask_pgas.bindings import nvshmem

    nv = nvshmem.NVSHMEM.__new__(nvshmem.NVSHMEM)
    nv.lock, nv.lib = threading.RLock(), _FakeLib()
    return nv


@pytest.mark.parametrize("size", [0, 127, 129, 256])
def test_uniqueid_of_the_wrong_size_is_refused_before_nvshmem(size):
    nv = _bound_nvshmem()
    with pytest.raises(ValueError, match="128 bytes"):
        nv.init_with_uniqueid(bytes(size), 0, 1)
    assert nv.lib.calls == []


def test_uniqueid_init_attr_versions_and_flags():
    """What nvshmemx_hostlib_init_attr gets: the V1 struct versions (valid for NVSHMEM 3.4 and 3.8, see
    docs/notes) and NVSHMEMX_INIT_WITH_UNIQUEID (8), after set_attr_uniqueid_args."""
    import ctypes
    import struct

    nv = _bound_nvshmem()
    assert nv.init_with_uniqueid(bytes(range(128)), 1, 2) == 2
    assert nv.lib.calls == ["nvshmemx_set_attr_uniqueid_args", "nvshmemx_hostlib_init_attr", "nvshmemx_init_status"]
    assert nv.lib.flags == 8
    raw = ctypes.string_at(ctypes.addressof(nv._attr), 144)
    assert struct.unpack_from("<i", raw, 0)[0] == 0x10090
    assert struct.unpack_from("<i", raw, 16)[0] == 0x10080
    assert struct.unpack_from("<i", raw, 24)[0] == 0x10018
    assert bytes(nv._uid) == bytes(range(128))


# -- the host lock: NVSHMEM jobs' inits on one host kept apart (NVSHMEM names a shared-memory slab per GPU alike in
# every job: see dask_pgas/bindings/nvshmem.py)
def _lock_state(path) -> str:
    """How the host lock at ``path`` is held, seen through a file description of its own: "free", "shared" or
    "exclusive" (flock conflicts between two descriptions in one process as between processes)."""
    import fcntl
    import os

    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return "free"
        except BlockingIOError:
            pass
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return "shared"
        except BlockingIOError:
            return "exclusive"
    finally:
        os.close(fd)


@pytest.fixture()
def host_lock_path(monkeypatch, tmp_path):
    from dask_pgas.bindings import nvshmem

    path = str(tmp_path / nvshmem.HOST_LOCK_NAME)
    monkeypatch.setattr(nvshmem, "_host_lock_path", lambda: path)
    return path


def _seen_during(nv, name, path):
    """Record the host lock's state whenever the fake library's ``name`` is called."""
    seen, call = [], nv.lib.__getattr__

    class Lib(type(nv.lib)):
        def __getattr__(self, attr):
            if attr == name:
                seen.append(_lock_state(path))
            return call(attr)

    nv.lib.__class__ = Lib
    return seen


@pytest.mark.parametrize("rank, first_on_host, held", [(0, None, "exclusive"), (1, None, "free"),
                                                       (3, True, "exclusive"), (0, False, "free")])
def test_the_hosts_first_pe_holds_the_host_lock_through_nvshmems_init(host_lock_path, rank, first_on_host, held):
    import os

    nv = _bound_nvshmem()
    seen = _seen_during(nv, "nvshmemx_hostlib_init_attr", host_lock_path)
    assert nv.init_with_uniqueid(bytes(128), rank, 4, first_on_host=first_on_host) == 2
    assert seen == [held]
    assert _lock_state(host_lock_path) == "free"  # released when init returns
    if held == "exclusive":  # the holder is named, for another job's warning
        with open(host_lock_path) as f:
            assert f.read() == f"pid {os.getpid()}"


def test_a_failed_init_releases_the_host_lock(host_lock_path, monkeypatch):
    nv = _bound_nvshmem()
    monkeypatch.setattr(type(nv.lib), "nvshmemx_hostlib_init_attr", lambda self, *a: 7, raising=False)
    with pytest.raises(RuntimeError, match=r"nvshmemx_hostlib_init_attr failed \(7\)") as info:
        nv.init_with_uniqueid(bytes(128), 0, 2)
    assert info.value.__context__ is None
    assert _lock_state(host_lock_path) == "free"


def test_the_host_lock_never_raises_before_the_collective_init(host_lock_path, monkeypatch):
    """The other PEs are already inside NVSHMEM's init: a lock file that cannot take the holder's name (a full
    /dev/shm) must not make this PE raise before it."""
    import os

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    nv = _bound_nvshmem()
    seen = _seen_during(nv, "nvshmemx_hostlib_init_attr", host_lock_path)
    assert nv.init_with_uniqueid(bytes(128), 0, 2) == 2
    assert seen == ["exclusive"]


def test_a_lock_file_that_cannot_be_locked_is_skipped(host_lock_path, monkeypatch):
    """A file system without flock (ENOLCK, the temporary directory on NFS where there is no /dev/shm): the first
    PE goes on into the init, as the other PEs already did, instead of raising alone before it."""
    import errno
    import fcntl

    from dask_pgas.bindings import nvshmem

    def no_locks(fd, mode):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(nvshmem, "fcntl", types.SimpleNamespace(
        LOCK_EX=fcntl.LOCK_EX, LOCK_SH=fcntl.LOCK_SH, LOCK_NB=fcntl.LOCK_NB, flock=no_locks))
    nv = _bound_nvshmem()
    seen = _seen_during(nv, "nvshmemx_hostlib_init_attr", host_lock_path)
    assert nv.init_with_uniqueid(bytes(128), 0, 2) == 2
    nv.finalize()
    assert seen == ["free"]
    assert nv.lib.calls[-1] == "nvshmemx_hostlib_finalize"


def test_an_interrupted_wait_for_the_host_lock_closes_its_file(host_lock_path, monkeypatch):
    """Ctrl-C (or any error that is no OSError) while a PE waits for the host lock: the lock file's descriptor is
    closed, not left open in a process that may go on (a notebook's kernel)."""
    import fcntl
    import os

    import psutil

    from dask_pgas.bindings import nvshmem

    def interrupted(fd, mode):
        raise KeyboardInterrupt

    def lock_fds():  # (only the lock file's: the session's Dask cluster, if any, opens sockets meanwhile)
        return [f.fd for f in psutil.Process().open_files() if f.path == os.path.realpath(host_lock_path)]

    with nvshmem.host_lock(exclusive=True):  # (lock_fds sees the file while it is open)
        assert lock_fds()
    assert lock_fds() == []
    monkeypatch.setattr(nvshmem, "fcntl", types.SimpleNamespace(
        LOCK_EX=fcntl.LOCK_EX, LOCK_SH=fcntl.LOCK_SH, LOCK_NB=fcntl.LOCK_NB, flock=interrupted))
    with pytest.raises(KeyboardInterrupt):
        with nvshmem.host_lock(exclusive=True):
            pass
    assert os.path.exists(host_lock_path)  # (the file was opened: the interrupt came in the wait)
    assert lock_fds() == []


def test_finalize_holds_the_host_lock_shared(host_lock_path):
    nv = _bound_nvshmem()
    seen = _seen_during(nv, "nvshmemx_hostlib_finalize", host_lock_path)
    nv.finalize()
    assert seen == ["shared"]
    assert _lock_state(host_lock_path) == "free"


def test_init_waits_for_another_jobs_init_on_the_host(host_lock_path):
    """Another job's first PE holds the lock (here: another file description) for 0.3 s: init starts after it."""
    import fcntl
    import os
    import threading
    import time

    fd = os.open(host_lock_path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    threading.Timer(0.3, os.close, (fd,)).start()
    nv = _bound_nvshmem()
    t0 = time.monotonic()
    nv.init_with_uniqueid(bytes(128), 0, 2)
    assert time.monotonic() - t0 >= 0.3
    assert nv.lib.calls[1] == "nvshmemx_hostlib_init_attr"


def test_init_goes_ahead_after_the_wait_and_says_who_held_the_lock(host_lock_path, monkeypatch, caplog):
    """The lock never makes a bring-up fail: past HOST_LOCK_WAIT, init goes ahead with a warning."""
    import fcntl
    import logging
    import os

    from dask_pgas.bindings import nvshmem

    fd = os.open(host_lock_path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b"pid 4242")
        monkeypatch.setattr(nvshmem, "HOST_LOCK_WAIT", 0.2)
        nv = _bound_nvshmem()
        with caplog.at_level(logging.WARNING, logger=nvshmem.__name__):
            assert nv.init_with_uniqueid(bytes(128), 0, 2) == 2
            nv.finalize()  # shared: blocked alike, goes ahead alike
    finally:
        os.close(fd)
    assert nv.lib.calls[-1] == "nvshmemx_hostlib_finalize"
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and all("went ahead without the host lock" in w and "pid 4242" in w for w in warned)


_JOB = """
import sys, threading, time
from dask_pgas.bindings import nvshmem

class Lib:  # NVSHMEM's init takes 0.3 s; record when this job's first PE was inside it
    def __getattr__(self, name):
        def call(*args):
            if name == "nvshmemx_hostlib_init_attr":
                t0 = time.time(); time.sleep(0.3); print(t0, time.time(), flush=True)
            return 2 if name == "nvshmemx_init_status" else 0
        return call

nvshmem._host_lock_path = lambda: sys.argv[1]
nv = nvshmem.NVSHMEM.__new__(nvshmem.NVSHMEM)
nv.lock, nv.lib = threading.RLock(), Lib()
nv.init_with_uniqueid(bytes(128), 0, 4)
"""


def test_the_inits_of_jobs_started_together_on_a_host_do_not_overlap(host_lock_path):
    """Three processes, each the first PE of its own job, start NVSHMEM's init at once: one at a time."""
    import itertools
    import subprocess
    import sys

    jobs = [subprocess.Popen([sys.executable, "-c", _JOB, host_lock_path], stdout=subprocess.PIPE, text=True)
            for _ in range(3)]
    spans = sorted(tuple(map(float, job.communicate(timeout=60)[0].split())) for job in jobs)
    assert [job.returncode for job in jobs] == [0, 0, 0]
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans)), spans


def test_a_host_lock_file_that_cannot_be_made_is_skipped(monkeypatch):
    from dask_pgas.bindings import nvshmem

    monkeypatch.setattr(nvshmem, "_host_lock_path", lambda: "/nonexistent-folder/x.lock")
    nv = _bound_nvshmem()
    assert nv.init_with_uniqueid(bytes(128), 0, 2) == 2
    nv.finalize()
    assert nv.lib.calls == ["nvshmemx_set_attr_uniqueid_args", "nvshmemx_hostlib_init_attr", "nvshmemx_init_status",
                            "nvshmemx_hostlib_finalize"]


@pytest.mark.parametrize("single_node", [True, None])
def test_initialize_from_uniqueid_sets_the_environment_before_nvshmem(monkeypatch, single_node):
    import os

    from dask_pgas.bindings import cuda, nvshmem
    from dask_pgas.engines import nvshmem as eng_mod

    monkeypatch.setattr(os, "environ", {"DASK_PGAS_HEAP_SIZE": "2g"})
    seen = {}

    def bring_up(uid, rank, nranks, device, control, first_on_host=None):
        raise RuntimeError("stop here")

    # the environment as NVSHMEM's library first sees it (loaded by the local steps, before the init)
    monkeypatch.setattr(cuda, "driver", lambda: types.SimpleNamespace(make_current=lambda device: None))
    monkeypatch.setattr(nvshmem, "load", lambda: seen.update(os.environ))
    monkeypatch.setattr(eng_mod.NVSHMEMEngine, "_bring_up", staticmethod(bring_up))
    with pytest.raises(RuntimeError, match="stop here"):
        eng_mod.initialize_from_uniqueid(bytes(128), 0, 1, 0, single_node=single_node)
    assert seen["NVSHMEM_DISABLE_NVLS"] == "1" and seen["NVSHMEM_DISABLE_NCCL"] == "1"
    assert seen["NVSHMEM_SYMMETRIC_SIZE"] == "2g"
    assert (seen.get("NVSHMEM_REMOTE_TRANSPORT"), seen.get("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME")) == (
        ("none", "lo") if single_node else (None, None))


@pytest.mark.parametrize("first_on_host", [True, False, None])
def test_initialize_from_uniqueid_hands_first_on_host_to_the_bring_up(monkeypatch, first_on_host):
    """Which rank holds the host lock through the init is the caller's to say (bootstrap knows the workers'
    hosts); left out, the binding takes rank 0."""
    from dask_pgas.engines import nvshmem as eng_mod

    seen = []

    def bring_up(uid, rank, nranks, device, control, first_on_host=None):
        seen.append((rank, control, first_on_host))
        raise RuntimeError("stop here")

    monkeypatch.setattr(eng_mod, "check_uniqueid_bring_up", lambda rank, nranks, device_id, single_node: 0)
    monkeypatch.setattr(eng_mod.NVSHMEMEngine, "_bring_up", staticmethod(bring_up))
    with pytest.raises(RuntimeError, match="stop here"):
        eng_mod.initialize_from_uniqueid(bytes(128), 2, 4, first_on_host=first_on_host)
    assert seen == [(2, None, first_on_host)]


def test_env_defaults_keep_the_users_heap_and_nccl_settings():
    from dask_pgas.engines.nvshmem import apply_env_defaults

    env = {"DASK_PGAS_HEAP_SIZE": "4g", "NVSHMEM_SYMMETRIC_SIZE": "8g", "NVSHMEM_DISABLE_NCCL": "0",
           "NVSHMEM_DISABLE_NVLS": " 0 "}
    assert apply_env_defaults(False, env) == {}
    assert env["NVSHMEM_SYMMETRIC_SIZE"] == "8g" and env["NVSHMEM_DISABLE_NCCL"] == "0"
    assert env["NVSHMEM_DISABLE_NVLS"] == " 0 "
    env = {}
    assert apply_env_defaults(False, env) == {"NVSHMEM_DISABLE_NVLS": "1", "NVSHMEM_DISABLE_NCCL": "1"}


def test_check_uniqueid_bring_up_does_the_local_steps_and_refuses_what_would_hang(monkeypatch):
    """The unique-id bring-up's local steps, without NVSHMEM's collective init (which has no agreement of its own):
    the device (default: the rank modulo the visible GPUs) made current and the library loaded, or a clear error
    where this process cannot take part: a rank outside the world, NVSHMEM left up in this process."""
    from dask_pgas.bindings import cuda, nvshmem
    from dask_pgas.engines import nvshmem as eng_mod
    from dask_pgas.errors import BackendUnavailableError

    made, loaded, packages = [], [], []
    driver = types.SimpleNamespace(device_count=lambda: 2, make_current=made.append)
    monkeypatch.setattr(cuda, "driver", lambda: driver)
    monkeypatch.setattr(nvshmem, "load", lambda: loaded.append(1))
    monkeypatch.setattr(eng_mod, "apply_env_defaults", lambda single_node: None)
    # (CuPy and torch take the same device: faked too, since the host running this may have fewer than 2 GPUs)
    monkeypatch.setattr(eng_mod, "_use_device_in_packages", packages.append)
    assert eng_mod.check_uniqueid_bring_up(3, 4) == 1 and made == packages == [1] and loaded == [1]
    assert eng_mod.check_uniqueid_bring_up(3, 4, 0) == 0 and made == packages == [1, 0]
    with pytest.raises(ValueError, match=r"rank 4 is not in range\(4\)"):
        eng_mod.check_uniqueid_bring_up(4, 4)
    monkeypatch.setattr(eng_mod, "_left_up_by", "by a failed bring-up (init raised on rank 1)")
    with pytest.raises(BackendUnavailableError, match="left initialized in this process by a failed bring-up"):
        eng_mod.check_uniqueid_bring_up(0, 4)
    assert made == packages == [1, 0]  # (refused before the device is touched)
