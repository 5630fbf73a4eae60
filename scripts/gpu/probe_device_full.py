"""What NVSHMEM does when the GPU's memory runs out below its heap cap (CuPy arrays or other processes hold it).

One PE, or every rank of ``mpirun -n P`` sharing the GPU, brings NVSHMEM up through the bindings alone (no cuFFTMp),
leaves about ``--leave`` GiB of the device free with a CuPy array, then asks for symmetric blocks of growing size:

    python3 scripts/gpu/probe_device_full.py --leave 6 --sizes 2,12,1
    mpirun -n 2 python3 scripts/gpu/probe_device_full.py --leave 6 --sizes 2,5,1

Prints one ``DEVFULL`` line per step; run it under ``timeout`` (a crash or a hang is the answer too).
"""

from __future__ import annotations

import argparse
import os

import cupy

from dask_pgas.bindings import nvshmem
from dask_pgas.bindings.cuda import driver

ap = argparse.ArgumentParser()
ap.add_argument("--leave", type=float, default=6.0, help="GiB of device memory to leave free")
ap.add_argument("--sizes", default="2,12,1", help="GiB per symmetric allocation, in order")
args = ap.parse_args()
try:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
except ImportError:  # pragma: no cover
    comm = None
rank, size = (comm.rank, comm.size) if comm else (0, 1)


def say(msg: str) -> None:
    free, _ = cupy.cuda.runtime.memGetInfo()
    print(f"DEVFULL rank={rank}/{size} free={free / 2**30:.1f}GiB {msg}", flush=True)


drv = driver()
drv.make_current(0)
say(f"before init (cuMemGetInfo {drv.mem_get_info()[0] / 2**30:.1f}GiB free, bus {drv.pci_bus_id()})")
nv = nvshmem.load()
uid = nv.get_uniqueid() if rank == 0 else None
if comm:
    uid = comm.bcast(uid, root=0)
status = nv.init_with_uniqueid(uid, rank, size)
say(f"init status={status} NVSHMEM_SYMMETRIC_SIZE={os.environ.get('NVSHMEM_SYMMETRIC_SIZE')}")
filler = None
if rank == 0:  # the GPU is shared: one filler leaves --leave GiB for every rank together
    free, _ = cupy.cuda.runtime.memGetInfo()
    filler = cupy.empty(max(0, int(free - args.leave * 2**30)), dtype=cupy.uint8)
if comm:
    comm.Barrier()
say("filled")
for gib in (float(s) for s in args.sizes.split(",")):
    nbytes = int(gib * 2**30)
    try:
        ptr = nv.malloc(nbytes)
        say(f"malloc {gib} GiB: ok")
        cupy.cuda.runtime.memset(ptr, 1, nbytes)
        cupy.cuda.runtime.deviceSynchronize()
        say(f"malloc {gib} GiB: memset ok")
        nv.free(ptr)
        say(f"free {gib} GiB: ok")
    except Exception as exc:
        say(f"malloc {gib} GiB: {type(exc).__name__}: {exc}")
del filler
nv.finalize()
say("finalized")
