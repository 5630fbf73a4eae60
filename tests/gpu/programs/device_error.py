"""A sticky device error on one PE, provoked for real (mpirun -n K python device_error.py; K >= 1; no MPS: under
MPS one client's fault can take the others' contexts down too).

The last rank launches a kernel that writes to address 8 (CUDA error 700, an illegal address, sticky in its
context) while every rank holds symmetric arrays and a planned reshape. Then, on every rank alike:

- the next collective free raises ``DeviceError`` naming the last rank, instead of leaving the healthy PEs inside
  ``nvshmem_free`` (the agreement before every collective free);
- every later call of the engine raises ``DeviceError`` too: an allocation, the reshape's ``execute()`` and
  (with a cuFFTMp plan, whose destroy is collective) ``free()``;
- a free of two arrays leaves neither registered; ``finalize()`` returns, although two arrays of the broken engine
  are still referenced, and runs nothing collective on the device; ``initialize()`` afterwards is refused with a
  message that says to restart the process.

Prints ``CHECK name ok|FAIL ...`` per step (rank 0) and ``OK rank=R`` at the end on every rank; the caller runs
it under a timeout, so a hang fails. The processes then exit with NVSHMEM left up (the broken context cannot
take part in its finalize).
"""

from __future__ import annotations

import os
import sys
import traceback

os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import cupy as cp
import numpy as np
from mpi4py import MPI

import dask_pgas
from dask_pgas import errors
from dask_pgas.distribution import Box
from dask_pgas.reshape import Reshape
from dask_pgas.runtime import get_engine

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
FAULTY = SIZE - 1
FAILED: list[str] = []


def check(name, fn):
    """Run ``fn`` on every rank; the step passes when it passed on every rank (MPI stays healthy throughout)."""
    try:
        fn()
        ok, msg = True, ""
    except Exception as exc:
        ok, msg = False, f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    everyone = COMM.allgather((ok, msg))
    bad = [(r, m) for r, (o, m) in enumerate(everyone) if not o]
    if RANK == 0:
        print(f"CHECK {name} " + ("ok" if not bad else f"FAIL {bad[:2]}"), flush=True)
    if bad:
        FAILED.append(name)


def raises_device_error(call, *, naming_faulty: bool = True) -> str:
    try:
        call()
    except errors.DeviceError as exc:
        text = str(exc)
        if naming_faulty and f"on rank {FAULTY}" not in text:
            raise AssertionError(f"DeviceError without 'on rank {FAULTY}': {text}") from exc
        return text
    raise AssertionError("no DeviceError")


def main() -> None:
    dask_pgas.initialize(None, COMM, backends=["nvshmem"])
    eng = get_engine("nvshmem")
    n = 1 << 16
    cols = [Box((0, n * r // SIZE), (8, n * (r + 1) // SIZE)) for r in range(SIZE)]
    rows = [Box((8 * r // SIZE, 0), (8 * (r + 1) // SIZE, n)) for r in range(SIZE)]
    a = dask_pgas.allocate_symmetric_memory(cols[RANK].box_shape, cp, dtype="float64", make_symmetric=True)
    b, c, d = (dask_pgas.allocate_symmetric_memory((n,), cp, dtype="float64") for _ in range(3))
    a[...] = RANK
    r = Reshape(a, cols[RANK], rows[RANK])

    mode = []

    def healthy_first():
        r.plan()
        mode.append(r._plan.mode)
        out = r.execute()
        cp.cuda.Device().synchronize()
        want = np.repeat(np.arange(SIZE), np.diff([n * k // SIZE for k in range(SIZE + 1)]))
        assert np.array_equal(cp.asnumpy(out), np.broadcast_to(want, out.shape)), "wrong values before the fault"
        dask_pgas.free_symmetric_memory(out)

    check("healthy-reshape-before-the-fault", healthy_first)

    def fault():
        if RANK == FAULTY:
            poke = cp.RawKernel(r'extern "C" __global__ void poke(double *p) { p[0] = 1.0; }', "poke")
            poke((1,), (1,), (np.uint64(8),))  # asynchronous: the error shows at the next synchronize
        COMM.Barrier()

    check("fault-on-the-last-rank", fault)
    message = []

    def free_raises():
        before = dask_pgas.heap_usage()["allocations"]
        message.append(raises_device_error(lambda: dask_pgas.free_symmetric_memory(b, d)))
        after = dask_pgas.heap_usage()["allocations"]  # neither b nor d stays registered: they cannot be freed
        assert after == before - 2, (before, after)

    check("free-raises-device-error-everywhere", free_raises)
    if RANK == 0 and message:
        print(f"INFO DeviceError: {message[0]}", flush=True)

    def engine_refuses():
        assert eng.broken, "the engine is not marked broken"
        raises_device_error(lambda: dask_pgas.allocate_symmetric_memory((4,), cp, dtype="float32"))
        raises_device_error(r.execute)
        if mode == ["cufftmp"]:  # a made handle: its destroy is collective, so the free refuses
            raises_device_error(r.free)
        else:  # (1 PE: a local copy plan, nothing collective to free)
            r.free()
        if RANK == 0:
            print(f"INFO heap usage after the refused calls: {dask_pgas.heap_usage('nvshmem')}", flush=True)

    check("every-later-call-raises-device-error", engine_refuses)

    def finalize():
        assert a.size and c.size  # both still referenced, never freed: finalize() neither refuses nor frees them
        dask_pgas.finalize()
        assert not dask_pgas.is_initialized() and dask_pgas.heap_usage()["allocations"] == 0

    check("finalize-returns", finalize)

    def refused_again():
        try:
            dask_pgas.initialize(None, COMM, backends=["nvshmem"])
        except errors.BackendUnavailableError as exc:
            assert "left initialized in this process after a device error" in str(exc), exc
        else:
            raise AssertionError("initialize() after a device error was not refused")
        assert not dask_pgas.is_initialized()

    check("initialize-again-refused", refused_again)
    if FAILED:
        print(f"FAILED rank={RANK} {FAILED}", flush=True)
        sys.exit(1)
    COMM.Barrier()
    sys.stdout.write(f"OK rank={RANK}\n")
    sys.stdout.flush()


main()
