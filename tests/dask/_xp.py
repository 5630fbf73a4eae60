"""The array package of the Dask suite: NumPy chunks on CPU workers (CI), CuPy chunks on GPU workers.

``DASK_PGAS_TEST_GPU_WORKERS=K`` runs the same tests on K GPU workers (one ``nvshmem`` PE each; several may share
one GPU) with CuPy chunks, results compared on the host; ``DASK_PGAS_TEST_WORKERS=K`` on K CPU workers (3 by
default), where a world of another size cuts other chunks between PEs, or (K = 1) plans nothing but local copies.
"""

from __future__ import annotations

import os

import numpy as np

GPU_WORKERS = int(os.environ.get("DASK_PGAS_TEST_GPU_WORKERS", "0") or 0)
NWORKERS = GPU_WORKERS or max(1, int(os.environ.get("DASK_PGAS_TEST_WORKERS", "3") or 3))  # CPU workers
BACKEND = "nvshmem" if GPU_WORKERS else "mpi"


def on_device(x):
    """A Dask array with the chunks of ``x`` moved to the GPU (CuPy) in GPU mode, else ``x``."""
    if not GPU_WORKERS:
        return x
    import cupy

    return x.map_blocks(cupy.asarray, dtype=x.dtype, meta=cupy.empty((0,) * x.ndim, dtype=x.dtype))


def host(a):
    """NumPy copy of a computed result (CuPy in GPU mode)."""
    return a.get() if type(a).__module__.startswith("cupy") else np.asarray(a)


def chunk_type():
    if GPU_WORKERS:
        import cupy

        return cupy.ndarray
    return np.ndarray
