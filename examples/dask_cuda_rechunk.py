"""A dask-cuda cluster (one worker per GPU, not launched by MPI) whose workers form an NVSHMEM PGAS world.

    python examples/dask_cuda_rechunk.py [--size 4GiB]

``LocalCUDACluster`` starts one Nanny worker per visible GPU. ``dask_pgas.bootstrap`` picks the ``nvshmem``
backend (every worker has a GPU), creates an NVSHMEM unique id on PE 0 and hands it to the others through the
scheduler; ``x.rechunk(..., method="pgas")`` then moves the CuPy chunks in one collective reshape. Needs
dask-cuda, CuPy and the NVSHMEM/cuFFTMp wheels (see the README).
"""

import argparse
import math

import dask
import dask.array as da
from dask.utils import format_bytes, parse_bytes
from distributed import Client, wait

import dask_pgas
from dask_pgas.cli import timed_persist


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB", help="array size (float64), default 1GiB")
    args = parser.parse_args()
    try:  # (after the arguments: --help works anywhere)
        import cupy
        from dask_cuda import LocalCUDACluster
    except ImportError as exc:
        parser.exit(1, f"{parser.prog}: {exc}; this example needs dask-cuda and CuPy on a GPU machine: pip install "
                       'dask-cuda, and from the checkout pip install -e ".[cuda13]" (or ".[cuda12]")\n')

    dask_pgas.install()  # x.rechunk(..., method="pgas") and config array.rechunk.method: pgas
    with LocalCUDACluster(dashboard_address=None) as cluster, Client(cluster) as client:
        world = dask_pgas.bootstrap(client)
        parts = max(world.npes, 4)  # slabs (with one worker several, so that the rechunk is not a no-op)
        n = math.isqrt(parse_bytes(args.size) // 8) // parts * parts
        print(world, f"\n{n} x {n} float64 ({format_bytes(n * n * 8)}), column slabs -> row slabs", flush=True)
        x = da.random.random((n, n), chunks=(n, n // parts)).map_blocks(cupy.asarray).persist()  # CuPy column slabs
        wait(x)
        rows = (n // parts, n)
        ok = True
        for method in ("pgas", "tasks"):
            seconds, y = timed_persist(client, lambda m=method: x.rechunk(rows, method=m), 3, device_sync=True,
                                       warmup=True)
            same = bool(da.all(y == x).compute())
            ok &= same
            print(f"{method:6s} {n * n * 8 / seconds / 1e9:8.2f} GB/s  {'OK' if same else 'WRONG'}  "
                  f"chunks {type(y.blocks[0, 0].compute()).__name__} of {type(y._meta).__module__}", flush=True)
            del y
        with dask.config.set({"array.rechunk.method": "pgas"}):
            z = x.rechunk(rows).rechunk((n, n // parts))
            same = bool(da.all(z == x).compute())
            ok &= same
            print("round trip", "OK" if same else "WRONG", flush=True)
        dask_pgas.teardown(client)  # free the symmetric memory collectively before the cluster goes
    return 0 if ok else 1


if __name__ == "__main__":  # (the Nanny workers start by spawning: the script must not run again in them)
    raise SystemExit(main())
