"""Does cuFFTMp accept a reshape where some PE owns an empty box? (run with mpirun -n 2 or more, under timeout)
Forces the cuFFTMp path (DASK_PGAS_EMPTY_VIA_PEER=0) and checks the values; exit 0 = accepted and correct."""

import os

os.environ["DASK_PGAS_EMPTY_VIA_PEER"] = "0"
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
import cupy as cp
import numpy as np
from mpi4py import MPI

import dask_pgas
from dask_pgas.distribution import Box
from dask_pgas.reshape import Reshape

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
dask_pgas.initialize(None, comm, backends=["nvshmem"])
n = 64
cuts_in = [0, 0] + [n * i // (size - 1) for i in range(1, size)]
cuts_out = [n * i // (size - 1) for i in range(size)] + [n]
ins = [Box((0, cuts_in[i]), (n, cuts_in[i + 1])) for i in range(size)]
outs = [Box((cuts_out[i], 0), (cuts_out[i + 1], n)) for i in range(size)]
g = np.arange(n * n, dtype=np.float64).reshape(n, n)
a = dask_pgas.allocate_symmetric_memory(ins[rank].box_shape, cp, make_symmetric=True)
if a.size:
    a.set(np.ascontiguousarray(g[:, cuts_in[rank]:cuts_in[rank + 1]]))
r = Reshape(a, ins[rank], outs[rank])
r.plan()
assert r._plan.mode == "cufftmp", r._plan.mode
out = r.execute()
cp.cuda.Device().synchronize()
ok = np.array_equal(out.get(), g[cuts_out[rank]:cuts_out[rank + 1]])
ok = comm.allreduce(ok, op=MPI.LAND)
dask_pgas.free_symmetric_memory(out, a)
r.free()
dask_pgas.finalize()
print(f"EMPTY_PROBE rank={rank} correct={ok}", flush=True)
raise SystemExit(0 if ok else 3)
