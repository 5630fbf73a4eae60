"""Shared by the MPI test programs: command-line options, array packages, NumPy references."""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import sys

import numpy as np
from mpi4py import MPI

import dask_pgas

# diagnosing a hang: DASK_PGAS_TEST_DUMP_AFTER=50 prints every thread's stack after 50 s and exits
if os.environ.get("DASK_PGAS_TEST_DUMP_AFTER"):
    faulthandler.dump_traceback_later(float(os.environ["DASK_PGAS_TEST_DUMP_AFTER"]), exit=True)

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


def options(extra=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="mpi", choices=["mpi", "nvshmem"])
    # torch-cpu: torch CPU tensors (reshaped as their NumPy views, any backend); torch: symmetric CUDA tensors
    parser.add_argument("--package", default="numpy", choices=["numpy", "cupy", "torch", "torch-cpu"])
    parser.add_argument("--examples", type=int, default=40)
    if extra:
        extra(parser)
    return parser.parse_args()


def initialize(opts) -> None:
    dask_pgas.initialize(None, COMM, backends=[opts.backend])


def to_numpy(array):
    """Host copy of a NumPy/CuPy array or torch tensor (bytes preserved)."""
    if isinstance(array, np.ndarray):
        return array
    if type(array).__module__.startswith("cupy"):
        return array.get()
    return torch_bytes(array.cpu())


# integers of each element size: how a test sees torch elements NumPy has no type for (bfloat16, float8, ...)
_INTS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}
# torch dtypes NumPy lacks, as the raw-bytes NumPy dtype a test generates them in
TORCH_ONLY = {"bfloat16": "V2", "float8_e4m3fn": "V1", "float8_e5m2": "V1", "complex32": "V4"}


def torch_bytes(tensor) -> np.ndarray:
    """A host tensor as NumPy, elements NumPy lacks as raw bytes of their size (``V2`` for bfloat16)."""
    import torch

    try:
        return tensor.numpy()
    except TypeError:  # no NumPy dtype: the same bytes through an integer of the element's size
        n = tensor.element_size()
        return tensor.view(getattr(torch, _INTS[n])).numpy().view(f"V{n}")


def torch_cpu(host: np.ndarray, torch_dtype=None):
    """A torch CPU tensor sharing ``host``'s memory (shape and strides); raw ``V`` elements become ``torch_dtype``."""
    import torch

    if host.dtype.kind != "V":
        return torch.from_numpy(host)
    return torch.from_numpy(host.view(_INTS[host.dtype.itemsize])).view(getattr(torch, torch_dtype))


def to_device(host: np.ndarray, like):
    """Copy ``host`` into the existing device array ``like`` (same shape, dtype, order)."""
    if isinstance(like, np.ndarray):
        like[...] = host
    elif type(like).__module__.startswith("cupy"):
        like.set(host)
    else:
        import torch

        host = np.ascontiguousarray(host)
        if host.dtype.kind == "V":  # a torch type NumPy lacks: copy the bytes through an integer of its size
            ints = _INTS[host.dtype.itemsize]
            host, like_ints = host.view(ints), like.view(getattr(torch, ints))
        else:
            like_ints = like
        like_ints.copy_(torch.from_numpy(host).reshape(like.shape))
    return like


def partition(shape, nranks, rnd: random.Random):
    """A random tiling of ``shape`` into ``nranks`` boxes (some may be empty) by repeated bisection."""
    boxes = [(tuple(0 for _ in shape), tuple(shape))]
    while len(boxes) < nranks:
        i = rnd.randrange(len(boxes))
        lo, up = boxes.pop(i)
        axis = rnd.randrange(len(shape))
        cut = rnd.randint(lo[axis], up[axis])
        a_up = list(up)
        a_up[axis] = cut
        b_lo = list(lo)
        b_lo[axis] = cut
        boxes += [(lo, tuple(a_up)), (tuple(b_lo), up)]
    rnd.shuffle(boxes)
    return boxes


def all_ok(ok: bool) -> bool:
    return COMM.allreduce(bool(ok), op=MPI.LAND)


def report_ok(**info) -> None:
    lines = COMM.gather(f"OK rank={RANK} " + " ".join(f"{k}={v}" for k, v in info.items()) + "\n")
    if RANK == 0:  # one writer: lines of several ranks never interleave
        sys.stdout.write("".join(lines))
        sys.stdout.flush()


def outcome_of(fn) -> dict:
    """What ``fn()`` did on this rank: the exception class and message it raised, or none."""
    try:
        fn()
    except Exception as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": "none", "message": ""}


def report_case(name: str, outcome: dict) -> None:
    """Gather every rank's ``outcome`` of case ``name``; rank 0 prints them as ``CASE`` lines (one writer, so the
    ranks' lines never interleave; ``tests.mpirun.agreed_outcomes`` reads them)."""
    outcomes = COMM.gather({"case": name, "rank": RANK, **outcome})
    if RANK == 0:
        sys.stdout.write("".join("CASE " + json.dumps(o) + "\n" for o in outcomes))
        sys.stdout.flush()
