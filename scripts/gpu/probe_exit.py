"""What a process does at exit when it never calls ``dask_pgas.finalize()`` on the NVSHMEM engine, as NVIDIA's nvmath
examples run (nvmath finalizes at exit by itself; dask_pgas does not, see docs/design.md).

    mpirun -n K python probe_exit.py --case freed|held|finalized [--cpu]

Every rank initializes ``["nvshmem"]``, reshapes a CuPy array on the symmetric heap once and checks the result,
then, by case: frees its symmetric arrays and returns without ``finalize()`` (``freed``), returns with them still
allocated and referenced until exit (``held``), or frees them and finalizes (``finalized``, the reference). Rank 0
prints ``EXITING case=C ranks=K`` once every rank got there; the caller times the exit under a timeout and keeps
the exit code and stderr (warnings, a hang, a crash in NVSHMEM's or MPI's exit handlers). ``--cpu``: the same on
the MPI engine with NumPy (a dry run of the program where there is no GPU).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

from mpi4py import MPI

import dask_pgas
from dask_pgas.distribution import Box


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=("freed", "held", "finalized"), required=True)
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args()
    case = args.case
    if args.cpu:
        import numpy as cp
    else:
        import cupy as cp
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    dask_pgas.initialize(None, comm, backends=["mpi" if args.cpu else "nvshmem"])
    n = 4 * size
    a = dask_pgas.allocate_symmetric_memory((n, 4), cp, dtype="float64")  # row slab of rank ``rank``
    a[...] = cp.arange(n * 4 * size, dtype=cp.float64).reshape(n * size, 4)[rank * n:(rank + 1) * n]
    b = dask_pgas.reshape.reshape(a, Box((rank * n, 0), ((rank + 1) * n, 4)), Box((0, 0), (n * size, 4))
                                  if rank == 0 else Box((0, 0), (0, 4)))
    if not args.cpu:
        cp.cuda.get_current_stream().synchronize()
    if rank == 0:
        want = cp.arange(n * 4 * size, dtype=cp.float64).reshape(n * size, 4)
        assert bool((b == want).all()), "the reshape gave wrong values"
    if case in ("freed", "finalized"):
        dask_pgas.free_symmetric_memory(a, b)
    else:  # referenced until the interpreter exits, as a script's module-level arrays are
        HELD.extend((a, b))
    if case == "finalized":
        dask_pgas.finalize()
    arrived = comm.gather(rank)  # (one line from rank 0: the ranks' own prints interleave under mpirun)
    if rank == 0:
        print(f"EXITING case={case} ranks={len(arrived)}", flush=True)
    sys.stdout.flush()


HELD: list = []


if __name__ == "__main__":
    main()
