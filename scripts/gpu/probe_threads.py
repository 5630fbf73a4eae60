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


def inter(a, b):
    r0, r1, c0, c1 = max(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), min(a[3], b[3])
    return (r0, r1, c0, c1) if r0 < r1 and c0 < c1 else None


def subarray(whole, piece):
    shape = [whole[1] - whole[0], whole[3] - whole[2]]
    sizes = [piece[1] - piece[0], piece[3] - piece[2]]
    starts = [piece[0] - whole[0], piece[2] - whole[2]]
    return MPI.DOUBLE.Create_subarray(shape, sizes, starts).Commit()


def band_plan(rank, ins, outs, t, k):
    """Thread t's part of the exchange: (send types, counts, receive types, counts, local band)."""
    size, mi, mo = len(ins), ins[rank], outs[rank]
    st, rt = [MPI.DOUBLE] * size, [MPI.DOUBLE] * size
    sc, rc = [0] * size, [0] * size
    local = None
    for q in range(size):
        p = inter(mi, outs[q])
        lo, hi = bands(p[0], p[1], k)[t] if p else (0, 0)
        if lo < hi and q == rank:
            local = (lo, hi, p[2], p[3])
        elif lo < hi:
            st[q], sc[q] = subarray(mi, (lo, hi, p[2], p[3])), 1
        p = inter(ins[q], mo)
        lo, hi = bands(p[0], p[1], k)[t] if p and q != rank else (0, 0)
        if lo < hi:
            rt[q], rc[q] = subarray(mo, (lo, hi, p[2], p[3])), 1
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
    # boxes as (row0, row1, col0, col1) of the global array
    slabs = bands(0, n, size)
    ins = [(0, n, lo, hi) for lo, hi in slabs]
    outs = [(lo, hi, 0, n) for lo, hi in slabs]
    if args.reverse:
        ins, outs = outs, ins
    mi, mo = ins[rank], outs[rank]
    g = np.arange(n * n, dtype=np.float64).reshape(n, n)
    src = np.ascontiguousarray(g[mi[0] : mi[1], mi[2] : mi[3]])
    want = g[mo[0] : mo[1], mo[2] : mo[3]].copy()
    del g
    dst = np.ones((mo[1] - mo[0], mo[3] - mo[2]))  # pages faulted in once, as the engine's output pool does
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
                r0, r1, c0, c1 = local
                dst[r0 - mo[0] : r1 - mo[0], c0 - mo[2] : c1 - mo[2]] = src[
                    r0 - mi[0] : r1 - mi[0], c0 - mi[2] : c1 - mi[2]
                ]

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
