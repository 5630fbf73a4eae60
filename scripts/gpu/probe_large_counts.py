"""Pieces past MPI's C-int counts under an MPI 3 library (Open MPI 4.1 on the GPU host): 3 ranks, 1-D uint8.

Rank 1 sends rank 0 a 3 GiB piece (a count of 3 * 2**30); rank 2 keeps a small box of its own. ``new``: the plan
must refuse it on every rank alike (UnsupportedOperandError). ``old``: the plan is told the library has large
counts, which shows what execute() did before the check (run under a timeout: a rank may be left waiting).
"""

import sys
import time

import numpy as np
from mpi4py import MPI

import dask_pgas
from dask_pgas.distribution import Box
from dask_pgas.engines import mpi as mpi_engine

mode = sys.argv[1]
comm = MPI.COMM_WORLD
rank = comm.rank
G = 2**30
ins = [Box((0,), (G,)), Box((G,), (5 * G,)), Box((5 * G,), (5 * G + 2**20,))]
outs = [Box((0,), (4 * G,)), Box((4 * G,), (5 * G,)), Box((5 * G,), (5 * G + 2**20,))]
if mode == "old":
    mpi_engine._large_counts = lambda: True
dask_pgas.initialize(None, comm, backends=["mpi"])
a = np.full(ins[rank].box_shape, rank, np.uint8)
t0 = time.perf_counter()
try:
    b = dask_pgas.reshape.reshape(a, ins[rank], outs[rank])
    ok = bool((b[:16] == 0).all()) if rank == 0 else True
    print(f"rank {rank}: reshaped in {time.perf_counter() - t0:.1f}s, ok={ok}", flush=True)
except Exception as exc:
    print(f"rank {rank}: {type(exc).__name__}: {str(exc)[:240]}", flush=True)
dask_pgas.finalize()
print(f"rank {rank}: finalized", flush=True)
