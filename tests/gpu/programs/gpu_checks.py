"""GPU engine checks on K PEs (mpirun -n K python gpu_checks.py): symmetric memory with CuPy and torch, fixed
reshapes through every plan mode (copy, cuFFTMp, peer), NumPy staging, streams, bad inputs raising on every
rank, empty boxes, heap empty at the end, finalize and initialize again. Prints ``OK rank=R`` on success and
``CHECK name ok|FAIL ...`` lines."""

from __future__ import annotations

import dataclasses
import os
import sys
import traceback

os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import cupy as cp
import numpy as np
from mpi4py import MPI

import dask_pgas
from dask_pgas import errors
from dask_pgas.distribution import Box
from dask_pgas.reshape import Reshape
from dask_pgas.runtime import get_engine

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
FAILED = []


def check(name, fn):
    try:
        fn()
        ok = True
        msg = ""
    except Exception as exc:
        ok = False
        msg = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    everyone = COMM.allgather((ok, msg))
    if RANK == 0:
        bad = [(r, m) for r, (o, m) in enumerate(everyone) if not o]
        print(f"CHECK {name} " + ("ok" if not bad else f"FAIL {bad[:2]}"), flush=True)
    if not all(o for o, _ in everyone):
        FAILED.append(name)


def slabs(shape, axis, sizes=None):
    n = shape[axis]
    cuts = [n * i // SIZE for i in range(SIZE + 1)] if sizes is None else sizes
    boxes = []
    for i in range(SIZE):
        lo, up = [0] * len(shape), list(shape)
        lo[axis], up[axis] = cuts[i], cuts[i + 1]
        boxes.append(Box(lo, up))
    return boxes


def glob(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def piece(g, box, order="C"):
    return np.asarray(g[box.relative_to(Box((0,) * g.ndim, g.shape))], order=order)


def sym(host, package="cupy", order="C"):
    if package == "cupy":
        a = dask_pgas.allocate_symmetric_memory(host.shape, cp, dtype=host.dtype, axis_order=order,
                                                make_symmetric=True)
        a.set(np.asarray(host, order=order)) if host.size else None
        return a
    import torch

    tdt = torch.from_numpy(np.empty(0, host.dtype)).dtype
    t = dask_pgas.allocate_symmetric_memory(host.shape, torch, dtype=tdt, axis_order=order, make_symmetric=True)
    if host.size:
        t.copy_(torch.from_numpy(np.ascontiguousarray(host)).reshape(t.shape))
    return t


def host(a):
    if isinstance(a, np.ndarray):
        return a
    if type(a).__module__.startswith("cupy"):
        return cp.asnumpy(a)
    return a.cpu().numpy()


def run_reshape(shape, dtype, ins, outs, package="cupy", order="C", expect_mode=None, stream=None):
    g = glob(shape, dtype, seed=len(shape) + SIZE)
    src = sym(piece(g, ins[RANK], order), package, order) if package != "numpy" else piece(g, ins[RANK], order)
    with Reshape(src, ins[RANK], outs[RANK], stream=stream) as r:
        r.plan()
        if expect_mode is not None:
            assert r._plan.mode == expect_mode, f"mode {r._plan.mode}, expected {expect_mode}"
        for _ in range(2):
            out = r.execute(stream=stream)
            if package != "numpy":
                if stream is not None:
                    (stream.synchronize() if hasattr(stream, "synchronize") else cp.cuda.Device().synchronize())
                else:
                    cp.cuda.Device().synchronize()
            got = host(out)
            want = piece(g, outs[RANK], order)
            assert got.shape == want.shape, (got.shape, want.shape)
            assert np.array_equal(np.ascontiguousarray(got).reshape(-1).view(np.uint8),
                                  np.ascontiguousarray(want).reshape(-1).view(np.uint8)), "wrong values"
            if package != "numpy":
                dask_pgas.free_symmetric_memory(out)
        mode = r._plan.mode
    if package != "numpy":
        dask_pgas.free_symmetric_memory(src)
    return mode


def main():
    dask_pgas.initialize(None, COMM, backends=["nvshmem"])
    eng = get_engine("nvshmem")
    if RANK == 0:
        print(f"INFO status={eng.status} peers_mapped={eng.peers_mapped} device={eng.device} "
              f"nvshmem={eng.nv.version()} heap={eng.heap_info()}", flush=True)

    def symmetric_cupy():
        a = dask_pgas.allocate_symmetric_memory((3, 5), cp, dtype="float32")
        assert isinstance(a, cp.ndarray) and a.shape == (3, 5) and a.dtype == np.float32
        a[...] = RANK
        assert eng.on_heap(a) and not eng.on_heap(cp.zeros(4))
        assert dask_pgas.memory.is_symmetric_memory(a)
        info = dask_pgas.heap_usage("nvshmem")
        assert info["allocations"] == 1 and info["heap_size"] > 0, info
        dask_pgas.free_symmetric_memory(a)
        for bad in (a, cp.zeros(3)):
            try:
                dask_pgas.free_symmetric_memory(bad)
            except errors.SymmetricMemoryError:
                pass
            else:
                raise AssertionError("free of a freed/foreign array did not raise")
        f = dask_pgas.allocate_symmetric_memory((4, 6), cp, dtype="complex128", axis_order="F")
        assert f.flags.f_contiguous
        try:
            dask_pgas.free_symmetric_memory(f[1:])
        except errors.SymmetricMemoryError:
            pass
        else:
            raise AssertionError("free of a view did not raise")
        dask_pgas.free_symmetric_memory(f)
        try:
            one = dask_pgas.allocate_symmetric_memory((RANK + 1,), cp)
        except errors.SymmetricMemoryError:
            if SIZE == 1:
                raise
        else:
            assert SIZE == 1, "different sizes without make_symmetric did not raise"
            dask_pgas.free_symmetric_memory(one)

    def symmetric_torch():
        import torch

        t = dask_pgas.allocate_symmetric_memory((4, 3), torch, dtype=torch.float64)
        assert isinstance(t, torch.Tensor) and t.is_cuda and t.shape == (4, 3)
        t.fill_(1.5)
        assert float(t.sum()) == 18.0 and eng.on_heap(t) and not eng.on_heap(torch.zeros(3, device="cuda"))
        b = dask_pgas.allocate_symmetric_memory((2, 3), torch, dtype=torch.bfloat16, axis_order="F")
        assert b.dtype == torch.bfloat16 and b.stride() == (1, 2)
        dask_pgas.free_symmetric_memory(t, b)
        refused_dtype(torch, "S8")  # torch has no bytes dtype

    def refused_dtype(package, dtype):
        # checked before the collective allocation: every rank raises, nothing is allocated
        before = eng.heap_info()["heap_allocations"]
        try:
            dask_pgas.allocate_symmetric_memory((4,), package, dtype=dtype)
        except errors.SymmetricMemoryError:
            pass
        else:
            raise AssertionError(f"dtype {dtype} was not refused for {package.__name__}")
        assert eng.heap_info()["heap_allocations"] == before, eng.heap_info()

    check("symmetric-memory-cupy", symmetric_cupy)
    check("object-dtype-refused-cupy", lambda: refused_dtype(cp, object))
    check("symmetric-memory-torch", symmetric_torch)

    shape = (1001, 1001) if SIZE > 1 else (257, 129)
    c2r = (slabs(shape, 1), slabs(shape, 0))
    multi = "cufftmp" if SIZE > 1 else "copy"
    check("2d-float64-cols-to-rows", lambda: run_reshape(shape, "float64", *c2r, expect_mode=multi))
    check("2d-float64-F-order", lambda: run_reshape(shape, "float64", *c2r, order="F", expect_mode=multi))
    check("2d-complex128-torch", lambda: run_reshape(shape, "complex128", *c2r, package="torch"))
    check("2d-numpy-staged", lambda: run_reshape(shape, "float32", *c2r, package="numpy", expect_mode=multi))
    s3 = (30, 22, 17)
    check("3d-x-to-z-float32", lambda: run_reshape(s3, "float32", slabs(s3, 0), slabs(s3, 2)))
    check("3d-int8-packed", lambda: run_reshape((6, 10, 64), "int8", slabs((6, 10, 64), 0),
                                                 slabs((6, 10, 64), 1), expect_mode=multi))
    check("3d-float16-packed-F", lambda: run_reshape((8, 6, 12), "float16", slabs((8, 6, 12), 2),
                                                      slabs((8, 6, 12), 0), order="F"))
    s5 = (4, 3, 5, 2, 6)
    check("5d-merged-float64", lambda: run_reshape(s5, "float64", slabs(s5, 0), slabs(s5, 2), expect_mode=multi))
    check("odd-itemsize-peer-or-copy", lambda: run_reshape((9, 7), "int8", *(slabs((9, 7), 1), slabs((9, 7), 0)),
                                                           package="numpy"))
    st = cp.cuda.Stream(non_blocking=True)
    check("cupy-stream", lambda: run_reshape(shape, "float64", *c2r, stream=st))
    check("raw-stream-handle", lambda: run_reshape(shape, "float64", *c2r, stream=st.ptr))

    def torch_stream():
        import torch

        ts = torch.cuda.Stream()
        run_reshape(shape, "float64", *c2r, package="torch", stream=ts)

    check("torch-stream", torch_stream)
    # empty boxes on some ranks: rank 0 owns nothing on input, the last rank nothing on output
    if SIZE > 1:
        n = 64
        ins = slabs((n, n), 1, [0, 0] + [n * i // (SIZE - 1) for i in range(1, SIZE)])
        outs = slabs((n, n), 0, [n * i // (SIZE - 1) for i in range(SIZE)] + [n])
        check("empty-boxes", lambda: run_reshape((n, n), "float64", ins, outs))
        check("empty-boxes-numpy", lambda: run_reshape((n, n), "int16", ins, outs, package="numpy"))
    check("all-empty-domain-torch", lambda: run_reshape((0, 5), "float32", slabs((0, 5), 1), slabs((0, 5), 0),
                                                        package="torch", expect_mode="copy"))
    if SIZE > 1:
        check("empty-boxes-torch", lambda: run_reshape((n, n), "float64", ins, outs, package="torch"))
    agreed = eng.settings  # DASK_PGAS_NVSHMEM_RESHAPE=peer, as if set on every rank at bring-up
    eng.settings = dataclasses.replace(agreed, force_peer=True)
    check("peer-forced", lambda: run_reshape(shape, "float64", *c2r, expect_mode="peer" if SIZE > 1 else "copy"))
    check("peer-forced-torch-F", lambda: run_reshape(s3, "complex64", slabs(s3, 0), slabs(s3, 2), package="torch",
                                                     order="F"))
    eng.settings = agreed

    def local_failures_agreed():
        # a local step fails on the last rank only: nobody enters the collective after it, every rank raises
        from dask_pgas.bindings import cufftmp

        def injected(*args):
            raise RuntimeError("injected failure")

        def upload_fails(dst, src, nbytes):
            (injected if eng.nv.ptr(dst, eng.my_pe) else real_memcpy)(dst, src, nbytes)

        real_memcpy, cf = eng.drv.memcpy, cufftmp.load()
        for obj, name, fake in ((eng.drv, "memcpy", upload_fails), (cf, "create", injected)):
            if RANK == SIZE - 1:
                setattr(obj, name, fake)
            try:
                run_reshape(shape, "float32", *c2r, package="numpy", expect_mode="cufftmp")
            except errors.CollectiveError:
                pass
            else:
                raise AssertionError(f"{name} failing on one rank did not raise")
            finally:
                obj.__dict__.pop(name, None)
        run_reshape(shape, "float32", *c2r, package="numpy", expect_mode="cufftmp")

    if SIZE > 1:
        check("local-failures-agreed", local_failures_agreed)

    def peer_copy_failure_agreed():
        # peer mode, host operands: making a device view fails on the last rank between the two on-stream syncs;
        # that rank must still enqueue the closing sync (else the others' streams wait for it forever), then every
        # rank raises the same CollectiveError; the next peer reshape is healthy
        from dask_pgas.engines import nvshmem as nvshmem_engine

        real_view, agreed = nvshmem_engine._word_view, eng.settings

        def failing_view(*args, **kwargs):
            raise RuntimeError("injected failure")

        eng.settings = dataclasses.replace(agreed, force_peer=True)
        try:
            if RANK == SIZE - 1:
                nvshmem_engine._word_view = failing_view
            try:
                run_reshape(shape, "float64", *c2r, package="numpy", expect_mode="peer")
            except errors.CollectiveError as exc:
                assert "injected failure" in str(exc), exc
            else:
                raise AssertionError("a view failing on one rank did not raise")
            finally:
                nvshmem_engine._word_view = real_view
            cp.cuda.Device().synchronize()  # would hang had the failing rank skipped the closing sync
            run_reshape(shape, "float64", *c2r, package="numpy", expect_mode="peer")
            run_reshape(shape, "float64", *c2r, package="cupy", expect_mode="peer")
        finally:
            eng.settings = agreed

    if SIZE > 1 and eng.peers_mapped:
        check("peer-copy-failure-agreed", peer_copy_failure_agreed)

    def bad_inputs():
        # a CuPy array not on the heap, on one rank only: every rank raises
        a = sym(np.zeros((4, 4)))
        op = a if RANK != SIZE - 1 else cp.zeros((4, 4))
        b = Box((4 * RANK, 0), (4 * RANK + 4, 4))
        try:
            Reshape(op, b, b)
        except errors.SymmetricMemoryError:
            pass
        else:
            raise AssertionError("off-heap operand did not raise")
        # overlapping boxes
        try:
            Reshape(a, Box((0, 0), (4, 4)), Box((0, 0), (4, 4)))
        except errors.DistributionError:
            assert SIZE > 1
        else:
            assert SIZE == 1
        dask_pgas.free_symmetric_memory(a)

    check("bad-inputs-raise-everywhere", bad_inputs)

    def symmetric_positions_agreed():
        # cuFFTMp and the peer path find a peer's operand at this rank's symmetric address: different slices of
        # one symmetric array on different ranks must raise on every rank (in the constructor and in
        # reset_operand), and execute() with sync_symmetric_memory differing across ranks too
        a = sym(np.arange(32.0).reshape(8, 4))
        b = Box((4 * RANK, 0), (4 * RANK + 4, 4))
        try:
            mine = a[4:] if RANK == SIZE - 1 else a[:4]
            try:
                Reshape(mine, b, b)
            except errors.SymmetricMemoryError as exc:
                assert SIZE > 1 and f"rank {SIZE - 1}: allocation #" in str(exc), exc
            else:
                assert SIZE == 1, "operands at different heap offsets did not raise"
            with Reshape(a[:4], b, b) as r:
                r.plan()
                try:
                    r.reset_operand(mine)
                except errors.SymmetricMemoryError:
                    assert SIZE > 1
                else:
                    assert SIZE == 1, "reset_operand to different heap offsets did not raise"
                try:
                    out = r.execute(sync_symmetric_memory=RANK != SIZE - 1)
                except errors.CollectiveMismatchError as exc:
                    assert SIZE > 1 and "sync_symmetric_memory" in str(exc), exc
                else:
                    assert SIZE == 1
                    dask_pgas.free_symmetric_memory(out)
                out = r.execute()  # still usable (with the first operand where the reset was refused)
                assert cp.array_equal(out, a[:4] if SIZE > 1 else mine)
                dask_pgas.free_symmetric_memory(out)
        finally:
            dask_pgas.free_symmetric_memory(a)

    check("symmetric-positions-agreed", symmetric_positions_agreed)

    def misaligned_reshape(n, ins, outs, mine, empty_here=None, plan_check=None):
        # a reshape of a view 8 bytes into its allocation (the same offset on every rank), of [-1, mine...];
        # empty_here: the empty view this rank passes instead (its place is never compared)
        g = np.arange(n, dtype=np.float64)
        a = sym(np.concatenate([[-1.0], mine(g)]))
        try:
            with Reshape(a[1:] if empty_here is None else empty_here(a), ins[RANK], outs[RANK]) as r:
                r.plan()
                assert r._offset == 8, r._offset
                if plan_check is not None:
                    plan_check(r._plan)
                out = r.execute()
                cp.cuda.Device().synchronize()
                assert np.array_equal(cp.asnumpy(out), piece(g, outs[RANK])), cp.asnumpy(out)
                dask_pgas.free_symmetric_memory(out)
        finally:
            dask_pgas.free_symmetric_memory(a)

    def misaligned_view_operand():
        # the boxes' bounds are all even, so the plan moves 16-byte words: the operand's pointers are not
        # 16-byte aligned, so the reshape takes the peer copies (it ran cuFFTMp's double2 kernels on them)
        n = 4 * SIZE
        ins = [Box((4 * r,), (4 * r + 4,)) for r in range(SIZE)]
        outs = [Box((max(4 * r - 2, 0),), (4 * r + 2 if r < SIZE - 1 else n,)) for r in range(SIZE)]

        def sixteen_byte_words(plan):
            if SIZE > 1:
                assert plan.mode == "cufftmp" and plan.layout.word_size == 16, (
                    plan.mode, plan.layout and plan.layout.word_size)

        misaligned_reshape(n, ins, outs, lambda g: g[4 * RANK: 4 * RANK + 4], plan_check=sixteen_byte_words)

    check("misaligned-view-operand", misaligned_view_operand)

    def misaligned_view_with_an_empty_rank():
        # as above, but rank 0's piece is empty (a zero-length view, whose heap position nobody compares): the
        # choice between cuFFTMp and peer copies must come from the offset the ranks agreed on, not from each
        # rank's own pointer, or rank 0 alone would enter cuFFTMp
        if SIZE < 2:
            return
        n = 4 * (SIZE - 1)
        ins = [Box((0,), (0,))] + [Box((4 * (r - 1),), (4 * r,)) for r in range(1, SIZE)]
        bounds = [0] + [4 * r - 2 for r in range(1, SIZE)] + [n]
        outs = [Box((bounds[r],), (bounds[r + 1],)) for r in range(SIZE)]
        # rank 0's empty view at the others' offset, at the allocation's start, and at its end: the peer copies
        # address the peers through the output block, never through rank 0's pointer (they pulled through it)
        for empty in (lambda a: a[1:1], lambda a: a[0:0], lambda a: a[5:5]):
            misaligned_reshape(n, ins, outs, lambda g: g[4 * (RANK - 1): 4 * RANK] if RANK else np.zeros(4),
                               empty_here=empty if RANK == 0 else None)

    check("misaligned-view-with-an-empty-rank", misaligned_view_with_an_empty_rank)

    def unchecked_reset_to_another_offset():
        # reset_operand_unchecked() compares nothing across ranks: an operand whose offset would take another path
        # than the plan's agreed one (cuFFTMp's 16-byte words, 8 bytes off) raises on every rank; reset_operand()
        # agrees on the new offset, and the reshape then takes the peer copies
        if SIZE < 2:
            return
        n = 4 * SIZE
        ins = [Box((4 * r,), (4 * r + 4,)) for r in range(SIZE)]
        outs = [Box((max(4 * r - 2, 0),), (4 * r + 2 if r < SIZE - 1 else n,)) for r in range(SIZE)]
        g = np.arange(n, dtype=np.float64)
        mine = g[4 * RANK: 4 * RANK + 4]
        a = sym(np.concatenate([mine, [-1.0, -1.0]]))
        b = sym(np.concatenate([[-1.0], mine, [-1.0]]))
        try:
            with Reshape(a[:4], ins[RANK], outs[RANK]) as r:
                r.plan()
                assert r._plan.mode == "cufftmp" and r._plan.operand_alignment == 16, r._plan.mode
                r.reset_operand_unchecked(b[1:5])
                try:
                    r.execute()
                except errors.SymmetricMemoryError as exc:
                    assert "reset_operand_unchecked()" in str(exc), exc
                else:
                    raise AssertionError("an unchecked operand 8 bytes off did not raise")
                r.reset_operand(b[1:5])
                assert r._offset == 8, r._offset
                out = r.execute()
                cp.cuda.Device().synchronize()
                assert np.array_equal(cp.asnumpy(out), piece(g, outs[RANK])), cp.asnumpy(out)
                dask_pgas.free_symmetric_memory(out)
        finally:
            dask_pgas.free_symmetric_memory(a, b)

    check("unchecked-reset-to-another-offset", unchecked_reset_to_another_offset)

    def streams_as_nvmath():
        # execute() without a stream runs on the package's current stream at that call (as nvmath), not on the
        # constructor's; a stream the engine cannot use, on one rank, raises on every rank before the collective
        s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
        g = glob(shape, "float64", seed=7)
        a = sym(piece(g, c2r[0][RANK]))
        cp.cuda.Device().synchronize()  # (s1 and s2 do not wait for the legacy stream that filled a)
        try:
            with Reshape(a, c2r[0][RANK], c2r[1][RANK], stream=s1) as r:
                r.plan()
                with s2:
                    out = r.execute()
                try:
                    assert r._plan._last_stream == s2.ptr, (r._plan._last_stream, s1.ptr, s2.ptr)
                    s2.synchronize()  # (glob's random bytes hold NaNs: compare bytes)
                    assert np.array_equal(cp.asnumpy(out).view(np.uint8), piece(g, c2r[1][RANK]).view(np.uint8))
                finally:
                    dask_pgas.free_symmetric_memory(out)
                try:
                    out = r.execute(stream="not a stream" if RANK == SIZE - 1 else None)
                except TypeError as exc:
                    assert f"rank {SIZE - 1}: execute(stream=...)" in str(exc), exc
                else:
                    dask_pgas.free_symmetric_memory(out)
                    raise AssertionError("a bad stream did not raise")
                out = r.execute()  # still usable
                dask_pgas.free_symmetric_memory(out)
        finally:
            dask_pgas.free_symmetric_memory(a)

    check("streams-as-nvmath", streams_as_nvmath)

    def empty_torch_views_keep_their_address():
        # an empty torch tensor reports data_ptr() 0; the engine needs its symmetric address, also through a
        # permuted allocation (axis_order) and views of it
        import torch

        from dask_pgas.engines.nvshmem import _ptr

        n = 0 if RANK == 0 else 1  # empty on rank 0 only: padded to the others' size, so it has an address
        t = dask_pgas.allocate_symmetric_memory((n, 3, 2), torch, dtype=torch.float32, axis_order=(2, 0, 1),
                                                make_symmetric=True)
        u = dask_pgas.allocate_symmetric_memory((n, 3, 2), torch, dtype=torch.float32, make_symmetric=True)
        try:
            if SIZE > 1:
                assert _ptr(t) != 0 and _ptr(u) != 0, (_ptr(t), _ptr(u))
                assert _ptr(u.view(n, 6)) == _ptr(u) == _ptr(u.permute(2, 0, 1))
        finally:
            dask_pgas.free_symmetric_memory(t, u)

    check("empty-torch-views-keep-their-address", empty_torch_views_keep_their_address)

    def another_context_current():
        # a thread where another CUDA context is current (one of its own here; in a program that drives two GPUs,
        # the other device's): the engine's calls run in the engine's context and give the thread's back
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")

        def current():
            c = ctypes.c_void_p()
            assert lib.cuCtxGetCurrent(ctypes.byref(c)) == 0
            return c.value

        def ok(rc, what):
            assert rc == 0, f"{what}: CUDA error {rc}"

        ins, outs = c2r
        g = glob(shape, "float64", seed=11)
        src = sym(piece(g, ins[RANK]))
        cp.cuda.Device().synchronize()
        dev, other = ctypes.c_int(), ctypes.c_void_p()
        ok(lib.cuDeviceGet(ctypes.byref(dev), eng.device), "cuDeviceGet")
        create = getattr(lib, "cuCtxCreate_v2", None)
        if create is not None:
            ok(create(ctypes.byref(other), 0, dev), "cuCtxCreate_v2")
        else:  # CUDA 13 headers name only the v4 entry point
            ok(lib.cuCtxCreate_v4(ctypes.byref(other), None, 0, dev), "cuCtxCreate_v4")
        popped = ctypes.c_void_p()
        try:
            assert current() == other.value
            r = Reshape(src, ins[RANK], outs[RANK])
            r.plan()
            assert current() == other.value, "plan() left another context current"
            out = r.execute()
            r._plan.synchronize()
            assert current() == other.value, "execute() left another context current"
            ok(lib.cuCtxPopCurrent_v2(ctypes.byref(popped)), "cuCtxPopCurrent")  # check the values in CuPy's
            got, want = host(out), piece(g, outs[RANK])  # random bytes: NaNs among them, so compare bytes
            assert got.shape == want.shape and got.tobytes() == want.tobytes(), "wrong values"
            ok(lib.cuCtxPushCurrent_v2(other), "cuCtxPushCurrent")
            dask_pgas.free_symmetric_memory(out, src)
            r.free()
            assert current() == other.value, "free() left another context current"
        finally:
            if current() == other.value:
                lib.cuCtxPopCurrent_v2(ctypes.byref(popped))
            lib.cuCtxDestroy_v2(other)

    check("another-context-current", another_context_current)

    def heap_empty():
        u = dask_pgas.heap_usage("nvshmem")
        assert u["allocations"] == 0, u

    check("heap-empty", heap_empty)
    dask_pgas.finalize()

    def reinit():
        if SIZE > 1:  # settings that differ across ranks: refused everywhere, NVSHMEM finalized again
            os.environ["DASK_PGAS_EMPTY_VIA_PEER"] = "1" if RANK == 0 else "0"
            try:
                dask_pgas.initialize(None, COMM, backends=["nvshmem"])
            except errors.BackendUnavailableError as exc:
                assert "DASK_PGAS_EMPTY_VIA_PEER" in str(exc), exc
            else:
                raise AssertionError("different DASK_PGAS_EMPTY_VIA_PEER on the ranks did not raise")
            finally:
                os.environ.pop("DASK_PGAS_EMPTY_VIA_PEER")
            assert not dask_pgas.is_initialized()
        dask_pgas.initialize(None, COMM, backends=["nvshmem"])
        run_reshape(shape, "float64", *c2r)
        dask_pgas.finalize()
        # last (rank 0 made a unique id that no init uses): a device that does not exist on the last rank only
        # (the others pick theirs); every rank raises before NVSHMEM's collective init, nobody is left inside it
        try:
            dask_pgas.initialize(4096 if RANK == SIZE - 1 else None, COMM, backends=["nvshmem"])
        except errors.BackendUnavailableError as exc:
            assert f"rank {SIZE - 1}" in str(exc), exc
        else:
            raise AssertionError("a device that does not exist on one rank did not raise")
        assert not dask_pgas.is_initialized()

    if os.environ.get("GPU_CHECK_REINIT", "1") == "1":
        check("finalize-then-initialize-again", reinit)
    if FAILED:
        print(f"FAILED rank={RANK} {FAILED}", flush=True)
        sys.exit(1)
    COMM.Barrier()
    sys.stdout.write(f"OK rank={RANK}\n")  # one write: the launcher may interleave a print's text and newline
    sys.stdout.flush()


main()
