"""What a fixed NVSHMEM heap (``NVSHMEM_DISABLE_CUDA_VMM=1``) takes, and what ``nvshmem_malloc`` does past it.

Brings NVSHMEM up through the bindings alone (no cuFFTMp), then either allocates and frees one block of each of
``--sizes`` MiB in turn, or with ``--fill M`` keeps blocks of M MiB until one fails:

    NVSHMEM_DISABLE_CUDA_VMM=1 mpirun -n 1 python3 scripts/gpu/probe_static_heap.py --sizes 512,1000,1024,1100
    NVSHMEM_DISABLE_CUDA_VMM=1 NVSHMEM_SYMMETRIC_SIZE=256m mpirun -n 2 python3 scripts/gpu/probe_static_heap.py --fill 8

Prints one ``STATIC`` line per step; run it under ``timeout`` (a crash or a hang is the answer too).
"""

from __future__ import annotations

import argparse
import os

from mpi4py import MPI

from dask_pgas.bindings import nvshmem
from dask_pgas.bindings.cuda import driver

ap = argparse.ArgumentParser()
ap.add_argument("--sizes", default="", help="MiB per allocation, each freed before the next")
ap.add_argument("--fill", type=float, default=0, help="MiB per block, kept until an allocation fails")
args = ap.parse_args()
comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size


def say(msg: str) -> None:
    print(f"STATIC rank={rank}/{size} {msg}", flush=True)


drv = driver()
drv.make_current(0)
free0 = drv.mem_get_info()[0]
nv = nvshmem.load()
uid = comm.bcast(nv.get_uniqueid() if rank == 0 else None, root=0)
status = nv.init_with_uniqueid(uid, rank, size)
say(f"init status={status} NVSHMEM_DISABLE_CUDA_VMM={os.environ.get('NVSHMEM_DISABLE_CUDA_VMM')} "
    f"NVSHMEM_SYMMETRIC_SIZE={os.environ.get('NVSHMEM_SYMMETRIC_SIZE')} "
    f"device memory taken by init: {(free0 - drv.mem_get_info()[0]) / 2**20:.0f} MiB")
for mib in (float(s) for s in args.sizes.split(",") if s):
    try:
        ptr = nv.malloc(int(mib * 2**20))
        say(f"malloc {mib:g} MiB: ok")
        nv.free(ptr)
    except MemoryError as exc:
        say(f"malloc {mib:g} MiB: MemoryError (NULL): {exc}")
if args.fill:
    blocks = []
    while True:
        try:
            blocks.append(nv.malloc(int(args.fill * 2**20)))
        except MemoryError:
            break
    say(f"fill: {len(blocks)} blocks of {args.fill:g} MiB = {len(blocks) * args.fill:g} MiB before a NULL")
    for ptr in blocks:
        nv.free(ptr)
    say("fill: freed")
nv.finalize()
say("finalized")
