"""Probe: does an S1 exchange on CPU ranks get faster with several threads per rank, each running its own
``Alltoallw`` (on its own duplicate communicator) over a band of every piece?

    mpirun -n 4 python3 scripts/gpu/probe_threads.py [--n 8192] [--threads 1,2,4,8] [--reverse]

Each thread t moves rows [t*h/k, (t+1)*h/k) of every piece (h = the piece's rows), with subarray datatypes for
strided bands, and copies the same band of the piece that stays on this rank. The result is checked against the
slab a NumPy reference expects. Rates: the global array's bytes / time (median, max over ranks).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import threading
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_reshape_mpi import timed  # (median of the repeats after one warm-up, max over ranks)

from dask_pgas.distribution import Box
from dask_pgas.engines.mpi import subarray_type


def bands(lo: int, hi: int, k: int) -> list[tuple[int, int]]:
    edges = [lo + (hi - lo) * t // k for t in range(k + 1)]
    return list(itertools.pairwise(edges))


def threaded(fn, k: int) -> None:
    """fn(0), ..., fn(k - 1), each on its own thread (fn(0) inline when k == 1)."""
    if k == 1:
        fn(0)
        return
    threads = [threading.Thread(target=fn, args=(t,)) for t in range(k)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def band_plan(rank, ins, outs, t, k):
    """Thread t's part of the exchange: (send types, counts, receive types, counts, local band), boxes as
    :class:`Box` and bands of each piece's rows."""
    size, mi, mo = len(ins), ins[rank], outs[rank]
    st, rt = [MPI.DOUBLE] * size, [MPI.DOUBLE] * size
    sc, rc = [0] * size, [0] * size
    local = None

    def band(piece):
        lo, hi = bands(piece.lower[0], piece.upper[0], k)[t]
        return Box((lo, piece.lower[1]), (hi, piece.upper[1])) if lo < hi else None

    for q in range(size):
        piece = mi.intersection(outs[q])
        part = band(piece) if piece is not None else None
        if part is not None and q == rank:
            local = part
        elif part is not None:
            st[q], sc[q] = subarray_type(MPI.DOUBLE, mi, part, MPI.ORDER_C), 1
        piece = ins[q].intersection(mo) if q != rank else None
        part = band(piece) if piece is not None else None
        if part is not None:
            rt[q], rc[q] = subarray_type(MPI.DOUBLE, mo, part, MPI.ORDER_C), 1
    return st, sc, rt, rc, local


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--reverse", action="store_true")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, size, n = comm.rank, comm.size, args.n
    everything = Box((0, 0), (n, n))
    slabs = bands(0, n, size)
    ins = [Box((0, lo), (n, hi)) for lo, hi in slabs]
    outs = [Box((lo, 0), (hi, n)) for lo, hi in slabs]
    if args.reverse:
        ins, outs = outs, ins
    mi, mo = ins[rank], outs[rank]
    g = np.arange(n * n, dtype=np.float64).reshape(n, n)
    src = np.ascontiguousarray(g[mi.relative_to(everything)])
    want = g[mo.relative_to(everything)].copy()
    del g
    dst = np.ones(mo.box_shape)  # pages faulted in once, as the engine's output pool does
    counts = [int(t) for t in args.threads.split(",")]
    results = {}
    for k in counts:
        comms = [comm.Dup() for _ in range(k)]
        plans = [band_plan(rank, ins, outs, t, k) for t in range(k)]

        def work(t, comms=comms, plans=plans):
            st, sc, rt, rc, local = plans[t]
            zero = [0] * size
            comms[t].Alltoallw([src, (sc, zero), st], [dst, (rc, zero), rt])
            if local is not None:
                dst[local.relative_to(mo)] = src[local.relative_to(mi)]

        dst[...] = 1
        threaded(work, k)
        ok = comm.allreduce(bool(np.array_equal(dst, want)), op=MPI.LAND)
        results[f"Alltoallw x{k} threads"] = (timed(comm, lambda work=work, k=k: threaded(work, k), args.repeats), ok)
        for st, _, rt, _, _ in plans:
            for d in st + rt:
                if d != MPI.DOUBLE:
                    d.Free()
        for c in comms:
            c.Free()
    # a NumPy copy of this rank's slab on the same number of threads (memcpy speed)
    flat_src, flat_dst = src.reshape(-1), np.zeros(src.size)
    for k in counts:
        parts = bands(0, src.size, k)

        def cp(t, parts=parts):
            lo, hi = parts[t]
            flat_dst[lo:hi] = flat_src[lo:hi]

        threaded(cp, k)
        results[f"memcpy x{k}"] = (timed(comm, lambda cp=cp, k=k: threaded(cp, k), args.repeats), True)
    if rank == 0:
        print(
            f"# {MPI.Get_library_version().splitlines()[0]}; thread level {MPI.Query_thread()}; {size} ranks; "
            f"n={n}; {'rows->cols' if args.reverse else 'cols->rows'}"
        )
        for label, (t, ok) in results.items():
            print(f"{label:24s} {t * 1e3:8.1f} ms {n * n * 8 / t / 1e9:7.2f} GB/s  {'ok' if ok else 'WRONG'}")


if __name__ == "__main__":
    main()
