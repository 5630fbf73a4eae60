"""End-to-end GPU rechunk (S1, CuPy chunks) beside a device-to-device copy of the same bytes, in one run.

    python benchmarks/bench_rechunk_gpu.py --workers 1 --sizes 512MiB,4GiB,16GiB
    python benchmarks/bench_rechunk_gpu.py --workers 2 --sizes 512MiB,2GiB     # two workers sharing one GPU

For each size: an N x N float64 array of column slabs (chunks (N, N/k), k = max(workers, 4)), made on the GPU
and persisted, rechunked to row slabs and back; each time is ``rechunk(...).persist()`` + ``wait`` end to end
(graph construction included) until every worker's GPU is idle, median of ``--repeats`` after a warm-up. Rows:

* ``pgas``: ``dask_pgas.rechunk`` as configured (one worker: a local plan, no collective);
* ``pgas-collective``: the same with ``pgas.local-rechunk: False`` (through the engine's staging buffers and
  plan; skipped where the staging would not fit in ``--heap-limit``);
* ``tasks`` and ``p2p``: Dask's own rechunks (sizes up to ``--tasks-limit``); with ``--p2p-cupy-fix`` the
  row is ``p2p+fix``: ``p2p`` with the one-line fix of docs/upstream-p2p-cupy.md applied on the workers
  (Dask 2026.8's ``p2p`` fails on CuPy chunks without it);
* ``dask-floor``: ``x.map_blocks(identity)`` persisted on the same chunks with its tasks restricted to the
  workers like pgas's pinned tasks (Dask's fixed cost, no data moved); ``dask-floor-queued``: the same without
  the restriction (Dask then queues them, two per worker thread at a time);
* ``copy``: a ``cupy`` device-to-device copy of the bytes of every worker on a GPU, done by one of them (CUDA
  events, median of 5; workers sharing a GPU share its bandwidth); the slowest GPU's. Bytes are counted once
  (a copy reads and writes each: about half the GPU's memory bandwidth).

At most two arrays of the size are alive at once (the input is regenerated for the check), so on one
139 GiB H200 sizes up to about 60 GiB fit.

Prints a table and one ``BENCH`` JSON line per size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_rechunk import time_method


def _random_block(block_info=None):
    import cupy

    info = block_info[None]
    rng = cupy.random.default_rng(hash(tuple(info["chunk-location"])) & 0xFFFF)
    return rng.random(info["chunk-shape"], dtype=cupy.float64)


def _identity(block):
    return block


def _keys(arr) -> list:
    from dask.core import flatten

    return list(flatten(arr.__dask_keys__()))


def one_size(client, nbytes: int, workers: int, args) -> dict:
    """One size: at most two arrays of it live at a time (input and output, or output and its way back), so
    the largest sizes fit; the input is regenerated (same values) where it is needed again."""
    import cupy
    import dask
    import dask.array as da
    from distributed import wait

    from dask_pgas.cli import device_copy_reference, timed_persist, wait_forgotten

    parts = max(workers, 4)
    n = max(int((nbytes / 8) ** 0.5) // parts * parts, parts)
    cols, rows = (n, n // parts), (n // parts, n)
    size = n * n * 8
    row: dict = {"workers": workers, "n": n, "bytes": size}
    # the reference first, while the GPU is empty (its two buffers are freed before the array is made)
    row["copy_s"] = device_copy_reference(client, size // workers)
    meta = cupy.empty((0, 0), dtype=cupy.float64)

    def make_x():
        grid = da.core.normalize_chunks(cols, (n, n))
        return da.map_blocks(_random_block, chunks=grid, dtype="float64", meta=meta, name=f"x-{n}")

    x = make_x().persist()
    wait(x)
    # every timed region ends when the workers' GPUs are idle (CuPy tasks return before their kernels end)
    # Dask's own cost for the same number of tasks: a no-op persist, restricted to the workers like pgas's
    # pinned tasks (unrestricted no-op tasks wait in the scheduler's queue, two per worker thread at a time)
    floor_workers = list(client.scheduler_info()["workers"])
    for label, restrict in (("dask-floor", floor_workers), ("dask-floor-queued", None)):
        row[f"{label}_s"], floor = timed_persist(
            client, lambda x=x: x.map_blocks(_identity, dtype=x.dtype, meta=meta, name=f"floor-{uuid.uuid4().hex}"),
            args.repeats, device_sync=True, warmup=True, workers=restrict)
        floor_keys, floor = _keys(floor), None  # its chunks are x's own arrays: drop them with x
        wait_forgotten(client, floor_keys)
    methods = [("pgas", {})]
    if 2 * size / workers * 1.3 <= dask.utils.parse_bytes(args.heap_limit):
        methods.append(("pgas-collective", {"pgas.local-rechunk": False}))
    if size <= dask.utils.parse_bytes(args.tasks_limit):
        methods += [("tasks", {}), ("p2p+fix" if args.p2p_cupy_fix else "p2p", {})]
    x_keys = _keys(x)
    for label, cfg in methods:
        method = "pgas" if label.startswith("pgas") else label.removesuffix("+fix")
        try:
            if x is None:
                x = make_x().persist()
                wait(x)
            with dask.config.set(cfg):
                fwd, y = time_method(client, x, rows, method, args.repeats, device_sync=True)
                x = None  # the way back needs only y: free the input first
                wait_forgotten(client, x_keys)
                back, z = time_method(client, y, cols, method, args.repeats, device_sync=True)
            y_keys, y = _keys(y), None
            wait_forgotten(client, y_keys)
            row[f"{label}_ok"] = bool(da.all(z == make_x()).compute())
            row[f"{label}_fwd_s"], row[f"{label}_back_s"] = fwd, back
            del z
        except Exception as exc:  # report and go on with the other methods
            row[f"{label}_error"] = f"{type(exc).__name__}: {exc}"
            y = None
    x = None
    client.run(lambda: cupy.get_default_memory_pool().free_all_blocks())
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--sizes", default="512MiB,4GiB,16GiB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tasks-limit", default="4GiB", help="largest size also run with Dask tasks and p2p")
    ap.add_argument("--heap-limit", default="8GiB", help="NVSHMEM heap per worker (pgas-collective rows)")
    ap.add_argument("--p2p-cupy-fix", action="store_true",
                    help="run p2p with the fix of docs/upstream-p2p-cupy.md applied on the workers")
    args = ap.parse_args()

    from dask.utils import format_bytes, parse_bytes
    from distributed import Client

    import dask_pgas

    ok = True
    with dask_pgas.LocalMPICluster(n_workers=args.workers, backends=["nvshmem"], gpus=1) as cluster, \
            Client(cluster) as client:
        print(f"{args.workers} GPU worker(s): {cluster.world}")
        if args.p2p_cupy_fix:
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "gpu"))
            import cloudpickle
            import repro_p2p_cupy

            cloudpickle.register_pickle_by_value(repro_p2p_cupy)  # the workers cannot import it
            client.run(repro_p2p_cupy._patch_mean_shard_size)
        print(f"{'size':>10} {'method':<16} {'cols->rows':>12} {'rows->cols':>12} {'of D2D copy':>14}  check")
        for size in args.sizes.split(","):
            row = one_size(client, parse_bytes(size), args.workers, args)
            gb = row["bytes"] / 1e9
            copy = row["copy_s"]
            print(f"{format_bytes(row['bytes']):>10} {'D2D copy':<16} {gb / copy:>7.1f} GB/s "
                  f"{'':>12} {'100%':>14}   ({copy * 1e3:.3f} ms)")
            for label in ("dask-floor", "dask-floor-queued"):
                floor = row[f"{label}_s"]
                print(f"{'':>10} {label:<17} {'':>11} {'':>12} {'':>14}   ({floor * 1e3:.1f} ms, no data moved)")
            for label in ("pgas", "pgas-collective", "tasks", "p2p", "p2p+fix"):
                if f"{label}_error" in row:
                    print(f"{'':>10} {label:<16} {row[label + '_error']}")
                    continue
                if f"{label}_fwd_s" not in row:
                    continue
                fwd, back = row[f"{label}_fwd_s"], row[f"{label}_back_s"]
                ok &= row[f"{label}_ok"]
                print(f"{'':>10} {label:<16} {gb / fwd:>7.1f} GB/s {gb / back:>7.1f} GB/s "
                      f"{copy / fwd:>6.0%} /{copy / back:>5.0%}  {'OK' if row[label + '_ok'] else 'WRONG'}"
                      f"   ({fwd * 1e3:.1f} / {back * 1e3:.1f} ms)")
            print("BENCH " + json.dumps(row), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
