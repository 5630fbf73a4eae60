"""S1 on CPU ranks: N x N float64, column slabs -> row slabs, through ``Reshape.execute()``.

Beside it, in the same run and on the same bytes:
  * a bare ``MPI.Alltoallw`` with hand-built subarray datatypes on both sides, this rank's piece included (the
    engine's own call differs: contiguous runs go as they are, strided pieces are packed first where the MPI is
    slow with them, and this rank's piece is copied outside the ``Alltoallw``; on MPICH it is the faster one),
  * a bare ``MPI.Alltoall`` of pre-packed contiguous blocks,
  * a NumPy copy of the local slab (memcpy speed).

    mpiexec -n 4 python benchmarks/bench_reshape_mpi.py [--n 8192] [--repeats 5] [--reverse]

Rates are the global array's bytes / time (median of the repeats after one warm-up, max over ranks).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import dask_pgas
from dask_pgas.distribution import Box


def timed(comm, fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--reverse", action="store_true", help="row slabs -> column slabs instead")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, size, n = comm.rank, comm.size, args.n
    if n % size:
        raise SystemExit(f"--n must be divisible by the number of ranks ({size})")
    w = n // size
    in_box, out_box = Box((0, rank * w), (n, (rank + 1) * w)), Box((rank * w, 0), ((rank + 1) * w, n))
    if args.reverse:
        in_box, out_box = out_box, in_box
    a = np.random.default_rng(rank).random(in_box.box_shape)
    total = n * n * 8

    dask_pgas.initialize(None, comm, backends=["mpi"])
    plan = dask_pgas.Reshape(a, in_box, out_box)
    plan.plan()
    results = {}
    holder = {}
    results["Reshape.execute()"] = timed(comm, lambda: holder.__setitem__("b", plan.execute()), args.repeats)

    # bare Alltoallw with the same subarray datatypes
    send = [MPI.DOUBLE.Create_subarray([n, w], [w, w], [p * w, 0]).Commit() for p in range(size)]
    recv = [MPI.DOUBLE.Create_subarray([w, n], [w, w], [0, p * w]).Commit() for p in range(size)]
    if args.reverse:
        send, recv = recv, send
    out = np.empty(out_box.box_shape)
    ones, zeros = [1] * size, [0] * size
    results["bare MPI.Alltoallw"] = timed(
        comm, lambda: comm.Alltoallw([a, (ones, zeros), send], [out, (ones, zeros), recv]), args.repeats
    )
    # bare Alltoall of packed blocks
    packed, unpacked = np.empty((size, w, w)), np.empty((size, w, w))
    results["bare MPI.Alltoall (packed)"] = timed(comm, lambda: comm.Alltoall(packed, unpacked), args.repeats)
    # local memcpy of the same bytes (each rank copies its slab)
    copy_dst = np.empty_like(a)
    results["numpy copy (memcpy)"] = timed(comm, lambda: np.copyto(copy_dst, a), args.repeats)

    ok = np.array_equal(holder["b"], out)
    ok = comm.allreduce(ok, op=MPI.LAND)
    for dt in send + recv:
        dt.Free()
    plan.free()
    dask_pgas.finalize()
    if rank == 0:
        ref = results["bare MPI.Alltoallw"]
        direction = "row->column" if args.reverse else "column->row"
        print(f"S1 {direction} slabs: {n}x{n} float64 = {total / 2**20:.0f} MiB on {size} ranks "
              f"(result matches bare Alltoallw: {ok})")
        print(f"{'method':32s} {'time [ms]':>10s} {'GB/s':>8s} {'vs Alltoallw':>13s}")
        for name, t in results.items():
            print(f"{name:32s} {t * 1e3:10.1f} {total / t / 1e9:8.2f} {ref / t:12.0%}")


if __name__ == "__main__":
    main()
