"""Start several GPU LocalMPICluster worlds at once on one GPU, again and again, and keep what a failed start says.

Rounds 12a and 34a each saw one 4-worker Dask suite die at bootstrap while four suites brought NVSHMEM up side by
side (a worker closed its connection in ``pgas_init``); started alone, it never failed. This probe repeats only
that part: ``--clusters`` processes each start ``LocalMPICluster(n_workers=--workers, gpus=1)`` (which bootstraps),
rechunk a small CuPy array once, check it against NumPy and close. Since ee30776 a failed start quotes the MPI
worker job's exit code and last output, which this probe prints in full.

    python3 scripts/gpu/probe_side_by_side.py --clusters 4 --workers 4 --rounds 5
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
import traceback


def one_cluster(tag: str, workers: int, cpu: bool, queue) -> None:
    t0 = time.perf_counter()
    try:
        import dask.array as da
        import numpy as np
        from distributed import Client

        import dask_pgas

        kw = {"gpus": 0, "backends": ["mpi"]} if cpu else {"gpus": 1, "backends": ["nvshmem"]}
        with dask_pgas.LocalMPICluster(n_workers=workers, dashboard_address=None, **kw) as c:
            up = time.perf_counter() - t0
            with Client(c) as client:
                ref = np.arange(512 * 384, dtype=np.float64).reshape(512, 384)
                x = da.from_array(ref, chunks=(512, 48))
                if not cpu:
                    import cupy

                    x = x.map_blocks(cupy.asarray)
                y = dask_pgas.rechunk(x, (64, 384)).compute()
                ok = bool(np.array_equal(y if cpu else y.get(), ref))
                pes = dask_pgas.world(client).npes
            queue.put((tag, "ok" if ok else "WRONG", f"up {up:.1f}s, {pes} PEs, total {time.perf_counter() - t0:.1f}s"))
    except BaseException as e:  # the probe reports every failure, whatever it is
        queue.put((tag, "FAIL", f"after {time.perf_counter() - t0:.1f}s: {type(e).__name__}: {e}\n"
                   + "".join(traceback.format_exception(e)[-6:])))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clusters", type=int, default=4)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cpu", action="store_true", help="CPU workers and the MPI engine (to try the probe itself)")
    a = p.parse_args()
    import dask_pgas

    print(f"package {os.path.dirname(dask_pgas.__file__)}", flush=True)
    ctx = mp.get_context("spawn")
    failed = 0
    for r in range(a.rounds):
        q = ctx.Queue()
        procs = [ctx.Process(target=one_cluster, args=(f"round {r} cluster {k}", a.workers, a.cpu, q))
                 for k in range(a.clusters)]
        for pr in procs:
            pr.start()
        results = [q.get(timeout=300) for _ in procs]
        for pr in procs:
            pr.join(30)
        for tag, what, text in sorted(results):
            print(f"{what:5s} {tag}: {text}", flush=True)
            failed += what != "ok"
    print(f"side by side: {a.rounds} rounds of {a.clusters} clusters x {a.workers} workers, {failed} failed",
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
