"""What cuFFTMp's reshape handle does when its set-up fails part-way (is Destroy collective before Make?).

Brings NVSHMEM up through the bindings alone, loads cuFFTMp, then one scenario per run (``--case``):

    unmade      every rank creates a handle; rank 0 alone destroys it without Make, then the others
    badmake     every rank creates a handle and calls Make with an invalid box (lower > upper) on every rank;
                then every rank destroys it
    onebad      as badmake, but only rank 0's box is invalid (the others' boxes describe a valid reshape)

Prints one ``HANDLE`` line per step with its time; run it under ``timeout`` (a hang is the answer too):

    timeout 30 mpirun -n 2 python3 scripts/gpu/probe_handle.py --case unmade
"""

from __future__ import annotations

import argparse
import time

from mpi4py import MPI

from dask_pgas.bindings import cufftmp, nvshmem
from dask_pgas.bindings.cuda import driver

ap = argparse.ArgumentParser()
ap.add_argument("--case", choices=["unmade", "badmake", "onebad"], required=True)
args = ap.parse_args()
comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size


def say(msg: str) -> None:
    print(f"HANDLE case={args.case} rank={rank}/{size} {msg}", flush=True)


def timed(what: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        fn()
        say(f"{what}: ok in {time.perf_counter() - t0:.3f}s")
    except Exception as exc:
        say(f"{what}: {type(exc).__name__}: {exc} after {time.perf_counter() - t0:.3f}s")


drv = driver()
drv.make_current(0)
nv = nvshmem.load()
uid = comm.bcast(nv.get_uniqueid() if rank == 0 else None, root=0)
say(f"init status={nv.init_with_uniqueid(uid, rank, size)}")
cf = cufftmp.load()
handle = cf.create()
say("created")
# a 1-D reshape of 8 * size words, in 3-D form: rank r holds [8r, 8r+8) before and after (a valid layout)
n = 8
lo, up, st = (0, 0, n * rank), (1, 1, n * rank + n), (n, n, 1)  # strides of the local (1, 1, 8) box
if args.case == "unmade":
    comm.Barrier()
    if rank == 0:
        timed("destroy without make, rank 0 alone", lambda: cf.destroy(handle))
    comm.Barrier()
    say("barrier after rank 0's destroy passed")
    if rank != 0:
        timed("destroy without make", lambda: cf.destroy(handle))
else:
    bad = args.case == "badmake" or rank == 0
    box = ((0, 0, n * rank + n), (1, 1, n * rank)) if bad else (lo, up)
    timed(f"make ({'invalid' if bad else 'valid'} box)", lambda: cf.make(handle, 8, *box, st, *box, st))
    comm.Barrier()
    say("barrier after make passed")
    timed("destroy after make", lambda: cf.destroy(handle))
comm.Barrier()
nv.finalize()
say("finalized")
