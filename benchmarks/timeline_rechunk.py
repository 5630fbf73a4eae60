"""Where the time of one S1 ``method="pgas"`` rechunk goes, on CPU workers of one host.

    python benchmarks/timeline_rechunk.py [--workers 4] [--n 8192] [--repeats 7]

For each repeat (after one warm-up) it stamps, in milliseconds from the client's ``persist`` call (one host,
so one wall clock for every process):
  * ``graph``: the rechunk's graph is built and sent (``persist`` returns),
  * ``scheduled``: the scheduler moved the first task to waiting (it received and ordered the graph),
  * ``staged``: the last transfer task is in memory (every PE has staged its input: the collective may start),
  * ``exchange``: the first and the last PE enter the collective, and the first and the last leave it
    (``dask_pgas.world(detail=True)``),
  * ``done``: ``wait`` returned on the client.
Beside it, on the same cluster: a persist of a trivial graph of one tiny task per input chunk (Dask's own floor
for a round trip through the scheduler and the workers). Medians over the repeats.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    import dask.array as da
    from bench_rechunk import trivial_graph  # (this folder is on the path when run as a script)
    from dask.core import flatten
    from distributed import Client, wait

    import dask_pgas
    from dask_pgas.cli import wait_forgotten

    n, p = args.n, args.workers
    b = -(-n // p)

    def scheduler_stamps(dask_scheduler, since, prefix):
        # (first time a key of this rechunk left "released", last time a transfer task reached memory)
        first = staged = None
        for key, start, finish, _, _, stamp in dask_scheduler.transition_log:
            name = key[0] if isinstance(key, tuple) else key
            if stamp < since or not str(name).startswith(prefix):
                continue
            if start == "released" and finish == "waiting" and first is None:
                first = stamp
            if str(name).startswith(prefix + "-transfer") and finish == "memory":
                staged = stamp
        return first, staged

    rows = []
    with dask_pgas.LocalMPICluster(n_workers=p, backends=["mpi"]) as cluster, Client(cluster) as client:
        x = da.random.random((n, n), chunks=(n, b)).persist()
        wait(x)
        for i in range(args.repeats + 1):
            t0 = time.time()
            y = dask_pgas.rechunk(x, (b, n)).persist()
            t1 = time.time()
            wait(y)
            t2 = time.time()
            first, staged = client.run_on_scheduler(scheduler_stamps, since=t0, prefix="pgas")
            infos = dask_pgas.world(client, detail=True).info.values()
            timings = [i["last_timings"] for i in infos]
            starts = [t["ended_at"] - t["execute"] for t in timings]
            ends = [t["ended_at"] for t in timings]
            keys = list(flatten(y.__dask_keys__()))
            del y  # the next repetition has the same keys: until these are forgotten, persist hands them back
            wait_forgotten(client, keys)  # (and the release would overlap the trivial graph's round trip)
            t3 = time.time()
            z = trivial_graph(x).persist()
            wait(z)
            t4 = time.time()
            trivial_keys = list(flatten(z.__dask_keys__()))
            del z
            wait_forgotten(client, trivial_keys)
            if i:

                def ms(t, t0=t0):
                    return (t - t0) * 1e3

                rows.append({
                    "graph": ms(t1), "scheduled": ms(first) if first else float("nan"),
                    "staged": ms(staged) if staged else float("nan"),
                    "exchange first in": ms(min(starts)), "exchange last in": ms(max(starts)),
                    "exchange first out": ms(min(ends)), "exchange last out": ms(max(ends)),
                    "done": ms(t2), "exchange (slowest PE)": max(t["execute"] for t in timings) * 1e3,
                    "trivial graph, done": (t4 - t3) * 1e3,
                })
    print(f"# S1 {n} x {n} float64 ({n * n * 8 / 2**20:.0f} MiB), {p} CPU workers, {os.cpu_count()} cores; "
          f"median of {args.repeats}, ms from persist()")
    for key in rows[0]:
        print(f"{key:24s} {statistics.median(r[key] for r in rows):8.1f}")


if __name__ == "__main__":
    main()
