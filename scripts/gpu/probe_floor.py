"""Dask's own per-persist cost on GPU workers of ``LocalMPICluster``, with the workers' CPU binding as launched.

    python3 scripts/gpu/probe_floor.py --workers 1 --binding core     # Open MPI's default for <= 2 ranks
    python3 scripts/gpu/probe_floor.py --workers 1                    # LocalMPICluster's default (unbound)

Times (median of --repeats after a warm-up): a no-op ``map_blocks`` persist of 4 small CuPy chunks + ``wait``,
the same followed by a device synchronize on every worker (``client.run``), and ``client.run`` alone.
No PGAS world is needed (no bootstrap), so this runs without cuFFTMp.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid


def _identity(block):
    return block


def _affinity():
    import os

    return len(os.sched_getaffinity(0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--binding", default=None, help="OMPI_MCA_hwloc_base_binding_policy for the workers")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()

    import cupy
    import dask.array as da
    from distributed import Client, wait

    import dask_pgas
    from dask_pgas.cli import _sync_device, timed_persist

    env = {"OMPI_MCA_hwloc_base_binding_policy": args.binding} if args.binding else {}
    with dask_pgas.LocalMPICluster(n_workers=args.workers, gpus=1, bootstrap=False, env=env) as cluster, \
            Client(cluster) as client:
        cores = client.run(_affinity)
        x = da.map_blocks(lambda b: cupy.asarray(b), da.ones((4096, 4096), chunks=(4096, 1024)),
                          dtype="float64", meta=cupy.empty((0, 0))).persist()
        wait(x)
        out = {}
        for label, sync in (("persist", False), ("persist+sync", True)):
            out[label], _ = timed_persist(
                client, lambda: x.map_blocks(_identity, dtype=x.dtype, meta=x._meta, name=f"floor-{uuid.uuid4().hex}"),
                args.repeats, device_sync=sync, warmup=True)
        times = []
        for i in range(args.repeats + 1):
            t0 = time.perf_counter()
            client.run(_sync_device)
            if i:
                times.append(time.perf_counter() - t0)
        out["client.run"] = statistics.median(times)
        row = {"workers": args.workers, "binding": args.binding or "LocalMPICluster default",
               "cores_per_worker": sorted(cores.values())}
        row.update({k: round(v * 1e3, 2) for k, v in out.items()})
        print("FLOOR " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
