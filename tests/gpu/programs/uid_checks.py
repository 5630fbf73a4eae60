"""Bring-up WITHOUT MPI: rank 0 writes an NVSHMEM unique id to a file, the others read it, every process calls
dask_pgas.initialize_from_uniqueid; the control plane (collective validation) then runs on NVSHMEM itself.
Launch with any launcher that sets OMPI_COMM_WORLD_RANK/SIZE (or PMI_RANK/PMI_SIZE, or RANK/WORLD_SIZE);
this program never imports mpi4py."""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def env_int(*names):
    for n in names:
        if n in os.environ:
            return int(os.environ[n])
    raise SystemExit(f"none of {names} is set")


RANK = env_int("OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK")
SIZE = env_int("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "WORLD_SIZE")
ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
UIDFILE = ARGS[0] if ARGS else "/tmp/dask_pgas_uid.bin"
NO_RESHAPE = "--no-reshape" in sys.argv  # NVSHMEM only (before cuFFTMp is staged)

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

import dask_pgas  # noqa: E402
from dask_pgas import errors  # noqa: E402
from dask_pgas.distribution import Box  # noqa: E402
from dask_pgas.reshape import Reshape  # noqa: E402
from dask_pgas.runtime import get_engine  # noqa: E402

if RANK == 0:
    uid = dask_pgas.get_nvshmem_uniqueid(single_node=True)
    with open(UIDFILE + ".tmp", "wb") as f:
        f.write(uid)
    os.replace(UIDFILE + ".tmp", UIDFILE)
else:
    deadline = time.time() + 60
    while not os.path.exists(UIDFILE):
        if time.time() > deadline:
            raise SystemExit("no unique id file")
        time.sleep(0.05)
    uid = open(UIDFILE, "rb").read()
# the local steps alone (what the Dask bootstrap agrees on before any worker enters NVSHMEM's init)
assert dask_pgas.check_uniqueid_bring_up(RANK, SIZE, single_node=True) == RANK % cp.cuda.runtime.getDeviceCount()
dask_pgas.initialize_from_uniqueid(uid, RANK, SIZE, single_node=True)
try:
    dask_pgas.check_uniqueid_bring_up(RANK, SIZE, single_node=True)
    raise AssertionError("check_uniqueid_bring_up passed while the backend is up")
except errors.RuntimeStateError:
    pass
eng = get_engine("nvshmem")
assert type(eng.control).__name__ == "NVSHMEMControl", type(eng.control)
got = eng.control.allgather({"rank": RANK, "blob": "x" * (100_000 if RANK == SIZE - 1 else 10)})
assert [g["rank"] for g in got] == list(range(SIZE)) and len(got[-1]["blob"]) == 100_000
assert eng.control.allgather(RANK * 3) == [3 * r for r in range(SIZE)]
# peers on another node are not mapped: their slots come through nvshmem_getmem (forced here, one node)
mapped, eng.control.nv.ptr = eng.control.nv.ptr, lambda addr, pe: 0 if pe != RANK else mapped(addr, pe)
try:
    got = eng.control.allgather({"rank": RANK, "blob": "y" * (200_000 if RANK == 0 else 5)})
    assert [g["rank"] for g in got] == list(range(SIZE)) and len(got[0]["blob"]) == 200_000, got
finally:
    del eng.control.nv.ptr  # (the instance attribute: the method again)
n = 96
ins = [Box((0, n * i // SIZE), (n, n * (i + 1) // SIZE)) for i in range(SIZE)]
outs = [Box((n * i // SIZE, 0), (n * (i + 1) // SIZE, n)) for i in range(SIZE)]
g = np.arange(n * n, dtype=np.float64).reshape(n, n)
a = dask_pgas.allocate_symmetric_memory(ins[RANK].box_shape, cp, make_symmetric=True)
a.set(np.ascontiguousarray(g[:, n * RANK // SIZE: n * (RANK + 1) // SIZE]))
for _ in range(0 if NO_RESHAPE else 3):
    with Reshape(a, ins[RANK], outs[RANK]) as r:
        r.plan()
        out = r.execute()
        cp.cuda.Device().synchronize()
        assert np.array_equal(out.get(), g[n * RANK // SIZE: n * (RANK + 1) // SIZE]), "wrong values"
        dask_pgas.free_symmetric_memory(out)
# a bad input on one rank raises on every rank (validation over the NVSHMEM control plane)
try:
    Reshape(a, ins[RANK], outs[RANK] if RANK else Box((0, 0), (1, 1)))
except errors.DistributionError:
    pass
else:
    raise AssertionError("bad boxes did not raise")
dask_pgas.free_symmetric_memory(a)
assert dask_pgas.heap_usage("nvshmem")["allocations"] == 0
dask_pgas.finalize()
print(f"OK rank={RANK} uid-bootstrap control=NVSHMEMControl status={eng.status} reshape={not NO_RESHAPE}", flush=True)
