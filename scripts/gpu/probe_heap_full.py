"""What a full NVSHMEM heap does: allocate growing blocks under a capped heap and report each outcome.

    NVSHMEM_SYMMETRIC_SIZE=128m NVSHMEM_MAX_MEMORY_PER_GPU=2g mpirun -n 2 python3 scripts/gpu/probe_heap_full.py
"""

from mpi4py import MPI

import dask_pgas

dask_pgas.initialize(None, MPI.COMM_WORLD, backends=["nvshmem"])
for n in (64 << 20, 960 << 20, 1536 << 20, 64 << 20, 1024 << 20):
    try:
        a = dask_pgas.allocate_symmetric_memory((n,), "cupy", dtype="uint8")
        print(f"HEAP rank={MPI.COMM_WORLD.rank} {n >> 20} MiB: allocated", flush=True)
        dask_pgas.free_symmetric_memory(a)
    except Exception as exc:
        print(f"HEAP rank={MPI.COMM_WORLD.rank} {n >> 20} MiB: {type(exc).__name__}: {exc}", flush=True)
dask_pgas.finalize()
print(f"HEAP rank={MPI.COMM_WORLD.rank} finalized", flush=True)
