"""S1 on the GPU: 8192 x 8192 float64, column slabs -> row slabs, on P PEs (mpirun -n P).

Prints, from the same run: ``Reshape.execute()`` (the public API, including its result allocation and free),
the bare cuFFTMp reshape through the binding (``nvshmemx_sync_all_on_stream`` + ``cufftMpExecReshapeAsync``) on
the same boxes, and a device-to-device copy of this PE's bytes. CUDA events, median of ``--repeat`` after
``--warmup``; GB/s = global payload bytes / the slowest PE's time. One JSON line ``BENCH {...}`` on rank 0,
with ``api_ok`` / ``bare_ok``: whether each path's result equals each PE's output box of the global array
(element (i, j) holds i * n + j); the run fails when one does not.

    mpirun -n P python benchmarks/bench_gpu_reshape.py [--n 8192] [--repeat 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import numpy as np
from mpi4py import MPI

try:
    import cupy as cp
except ImportError:  # (--help works without CuPy; a run says what it needs)
    cp = None

import dask_pgas
from dask_pgas.distribution import Box, Slab
from dask_pgas.reshape import Reshape


def slabs(n: int, p: int, axis: int) -> list[Box]:
    return [Slab(axis).box(r, p, (n, n)) for r in range(p)]


def global_indices(box: Box, n: int):
    """The ``box`` section of the n x n array whose element (i, j) holds its flat index ``i * n + j``
    (exact in float64 up to n = 2**26)."""
    rows = cp.arange(box.lower[0], box.upper[0], dtype=cp.float64)[:, None]
    cols = cp.arange(box.lower[1], box.upper[1], dtype=cp.float64)[None, :]
    return rows * n + cols


def timed(fn, stream, warmup: int, repeat: int, after=None) -> float:
    """Median milliseconds of ``fn()`` between CUDA events on ``stream``; ``after(result)`` runs outside the
    timed window (e.g. freeing the result)."""
    for _ in range(warmup):
        res = fn()
        stream.synchronize()
        if after:
            after(res)
    times = []
    for _ in range(repeat):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        MPI.COMM_WORLD.Barrier()
        a.record(stream)
        res = fn()
        b.record(stream)
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b))
        if after:
            after(res)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    if cp is None:
        raise SystemExit("bench_gpu_reshape.py needs CuPy and a GPU (pip install -e '.[cuda13]' or '.[cuda12]')")
    comm = MPI.COMM_WORLD
    rank, p = comm.Get_rank(), comm.Get_size()
    dask_pgas.initialize(None, comm, backends=["nvshmem"])
    from dask_pgas.runtime import get_engine

    engine = get_engine("nvshmem")
    n, dtype = args.n, np.float64
    ins, outs = slabs(n, p, 1), slabs(n, p, 0)
    stream = cp.cuda.Stream(non_blocking=True)
    src = dask_pgas.allocate_symmetric_memory(ins[rank].box_shape, cp, dtype=dtype, make_symmetric=True)
    src[...] = global_indices(ins[rank], n)  # every PE's values differ: a misplaced piece shows
    cp.cuda.Device().synchronize()

    # 1. the public API
    r = Reshape(src, ins[rank], outs[rank], stream=stream)
    r.plan()

    # execute() allocates its (symmetric) result; freeing it is the caller's step, outside the timed window
    t_api = timed(lambda: r.execute(stream=stream), stream, args.warmup, args.repeat,
                  after=dask_pgas.free_symmetric_memory)
    mode = r._plan.mode

    # 2. bare cuFFTMp on the same boxes (through the binding, no front end)
    from dask_pgas.bindings import cufftmp
    from dask_pgas.geometry.cufftmp_layout import cufftmp_layout

    cf = cufftmp.load()
    lay = cufftmp_layout(ins, outs, 8, "C")
    h = cf.create()
    cf.make(h, lay.word_size, *lay.input[rank], *lay.output[rank])
    nbytes = max(b.size for b in ins + outs) * 8
    buf_in, buf_out = engine.nv.malloc(nbytes), engine.nv.malloc(nbytes)
    cp.cuda.runtime.memcpy(buf_in, src.data.ptr, src.nbytes, 3)
    sh = stream.ptr

    def bare():
        engine.nv.sync_all_on_stream(sh)
        cf.execute(h, buf_out, buf_in, 0, sh)

    t_bare = timed(bare, stream, args.warmup, args.repeat)
    # both results against the reference: this PE's output box of the global array
    out = r.execute(stream=stream)
    stream.synchronize()
    expected = global_indices(outs[rank], n)
    api_ok = bool(cp.array_equal(out, expected))
    check = cp.empty_like(out)
    cp.cuda.runtime.memcpy(check.data.ptr, buf_out, out.nbytes, 3)
    bare_ok = bool(cp.array_equal(check, expected))
    dask_pgas.free_symmetric_memory(out)

    # 3. device-to-device copy of this PE's bytes
    dst = cp.empty_like(src)

    def d2d():
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, 3, sh)

    t_copy = timed(d2d, stream, args.warmup, args.repeat)

    cf.destroy(h)
    engine.nv.free(buf_in)
    engine.nv.free(buf_out)
    r.free()
    dask_pgas.free_symmetric_memory(src)
    worst = [comm.allreduce(float(t), op=MPI.MAX) for t in (t_api, t_bare, t_copy)]
    api_ok, bare_ok = (comm.allreduce(ok, op=MPI.LAND) for ok in (api_ok, bare_ok))
    total = n * n * 8
    if rank == 0:
        t_api, t_bare, t_copy = (float(x) for x in worst)
        row = dict(
            pes=p, n=n, mode=mode, status=engine.status, api_ms=round(t_api, 4), bare_ms=round(t_bare, 4),
            copy_ms=round(t_copy, 4), api_GBps=round(total / t_api / 1e6, 1), bare_GBps=round(total / t_bare / 1e6, 1),
            copy_GBps=round(total / t_copy / 1e6, 1), api_vs_bare=round(t_bare / t_api, 3),
            api_ok=api_ok, bare_ok=bare_ok,
            mps=bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")), repeat=args.repeat,
        )
        print("BENCH " + json.dumps(row), flush=True)
    dask_pgas.finalize()
    if not (api_ok and bare_ok):  # (the same verdict on every PE: a failing step, not a hang)
        raise SystemExit(f"PE {rank}: a result differs from the reference (api_ok={api_ok}, bare_ok={bare_ok})")


if __name__ == "__main__":
    main()
