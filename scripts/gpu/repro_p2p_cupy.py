"""Minimal reproduction, without dask_pgas: Dask's ``p2p`` rechunk of an array of CuPy chunks.

    python scripts/gpu/repro_p2p_cupy.py [--patched]

Plain ``distributed.LocalCluster`` workers (processes, one thread each), a 2048 x 2048 float64 array of
column slabs made with CuPy, rechunked to row slabs with ``method="p2p"``, for 1 and 2 workers and with P2P's
disk storage on and off. Each case prints OK (the result equals the NumPy reference) or the client's error
with its whole chain of causes, and the first worker-side traceback that mentions the failure. Meant as the
body of an upstream report, so it uses nothing but dask, distributed, numpy and cupy.

``--patched`` first replaces, on every worker, ``distributed.shuffle._core._mean_shard_size`` (which sizes
shards with ``memoryview(shard)``, something device memory does not support) by one that asks the shard for
its ``nbytes``: the candidate fix.
"""

from __future__ import annotations

import logging
import traceback


def _cupy_block(block):
    import cupy

    return cupy.asarray(block)


def _patch_mean_shard_size() -> None:
    """On a worker: size shards by ``nbytes`` where they have it (CuPy), else as before."""
    from distributed.shuffle import _core

    original = getattr(_core, "_original_mean_shard_size", _core._mean_shard_size)

    def mean_shard_size(shards) -> int:
        from dask.core import flatten

        items = [s for s in flatten(shards, container=(tuple, list)) if not isinstance(s, int)][:10]
        sizes = [getattr(s, "nbytes", None) for s in items]
        if all(isinstance(n, int) for n in sizes):
            return sum(sizes) // len(sizes) if sizes else 0
        return original(shards)

    _core._original_mean_shard_size = original
    _core._mean_shard_size = mean_shard_size


def one_case(workers: int, disk: bool, patched: bool) -> str:
    import cupy
    import dask
    import dask.array as da
    import numpy as np
    from distributed import Client, LocalCluster

    n = 2048
    reference = np.random.default_rng(0).random((n, n))
    with dask.config.set({"distributed.p2p.storage.disk": disk}), \
            LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        if patched:
            client.run(_patch_mean_shard_size)
        x = da.from_array(reference, chunks=(n, n // 4)).map_blocks(
            _cupy_block, meta=cupy.empty((0, 0), dtype=reference.dtype)).persist()
        y = x.rechunk((n // 4, n), method="p2p")
        try:
            out = y.compute()
        except Exception as exc:
            chain = "".join(traceback.format_exception(exc))
            return f"FAILED\n{chain}"
        got = cupy.asnumpy(out) if isinstance(out, cupy.ndarray) else np.asarray(out)
        return f"OK (result type {type(out).__module__}.{type(out).__name__}, equal: {np.array_equal(got, reference)})"


def main() -> None:
    import argparse

    import cupy
    import dask
    import distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patched", action="store_true", help="try the candidate fix on the workers first")
    patched = parser.parse_args().patched
    logging.basicConfig(level=logging.WARNING)
    print(f"dask {dask.__version__}, distributed {distributed.__version__}, cupy {cupy.__version__}", flush=True)
    for workers in (1, 2):
        for disk in (True, False):
            print(f"--- p2p rechunk of CuPy chunks, {workers} worker(s), p2p disk storage {disk}"
                  f"{', _mean_shard_size patched' if patched else ''}:", flush=True)
            print(one_case(workers, disk, patched), flush=True)


if __name__ == "__main__":
    main()
