"""Where the time of one S1 ``method="pgas"`` rechunk goes, on CPU workers of one host (or GPU workers: ``--gpu``).

    python benchmarks/timeline_rechunk.py [--workers 4] [--n 8192] [--repeats 7] [--cpu] [--gpu]

For each repeat (after one warm-up) it stamps, in milliseconds from the client's ``persist`` call (one host,
so one wall clock for every process):
  * ``graph``: the rechunk's graph is built and sent (``persist`` returns),
  * ``scheduled``: the scheduler moved the first task to waiting (it received and ordered the graph),
  * ``staged``: the last transfer task is in memory (every PE has staged its input: the collective may start),
  * ``barrier dispatched`` / ``barrier in memory``: the barrier task went to a worker / came back (it returns
    once the run has started, so with a long exchange it normally comes back inside it),
  * ``exchange``: the first and the last PE enter the collective, and the first and the last leave it
    (``dask_pgas.world(detail=True)``),
  * ``outputs dispatched`` / ``outputs in memory``: the first output task went to its worker / the last one
    came back,
  * ``done``: ``wait`` returned on the client.
Beside it, on the same cluster: a persist of a trivial graph of one tiny task per input chunk (Dask's own floor
for a round trip through the scheduler and the workers). Medians over the repeats.

``--cpu`` adds the CPU time each rechunk cost (ms, user + system, from psutil's per-thread times read before
``persist`` and after ``wait``, so the reading calls themselves are in it; the kernel counts in 10 ms ticks, so
these rows are means over the repeats): the client process, the scheduler process, the workers' event loops (their
main threads, all workers together), their collective threads, and every other worker thread. On a box with
fewer cores than processes this shows how much of the cores Dask's side takes beside the exchange.

``--gpu``: CuPy chunks on GPU workers sharing the host's GPUs (``LocalMPICluster(gpus=1)``, NVSHMEM engine). The
exchange stamps are then host times around the engine's ``execute`` (which ends with the stream synchronized).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def _thread_cpu(dask_worker=None, dask_scheduler=None) -> dict[str, float]:
    """CPU seconds so far of this process's threads, by class: main (the event loop), collective, other."""
    import threading

    import psutil

    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {"main": 0.0, "collective": 0.0, "other": 0.0}
    for t in psutil.Process().threads():
        name = names.get(t.id, "")
        kind = "main" if name == "MainThread" else "collective" if name.startswith("pgas-collective") else "other"
        out[kind] += t.user_time + t.system_time
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--cpu", action="store_true", help="also the CPU time of each process class per rechunk")
    ap.add_argument("--gpu", action="store_true", help="CuPy chunks on GPU workers (the NVSHMEM engine)")
    args = ap.parse_args()

    import dask.array as da
    import psutil
    from bench_rechunk import trivial_graph  # (this folder is on the path when run as a script)
    from dask.core import flatten
    from distributed import Client, wait

    import dask_pgas
    from dask_pgas.cli import wait_forgotten

    n, p = args.n, args.workers
    b = -(-n // p)

    def scheduler_stamps(dask_scheduler, since, prefix):
        # per step of the run, the earliest or latest stamp of the scheduler's transition log that marks it
        first, last = {}, {}
        for key, start, finish, _, _, stamp in dask_scheduler.transition_log:
            name = str(key[0] if isinstance(key, tuple) else key)
            if stamp < since:
                continue
            step = None
            if name.startswith(prefix + "-transfer") and finish == "memory":
                step = "staged"
            elif name.startswith(prefix + "-barrier") and finish in ("processing", "memory"):
                step = "barrier " + ("dispatched" if finish == "processing" else "in memory")
            elif name.startswith(prefix + "-rechunk") and finish in ("processing", "memory"):
                step = "outputs " + ("dispatched" if finish == "processing" else "in memory")
            if name.startswith(prefix) and start == "released" and finish == "waiting":
                first.setdefault("scheduled", stamp)
            if step:
                first.setdefault(step, stamp)
                last[step] = stamp
        return {"scheduled": first.get("scheduled"), "staged": last.get("staged"),
                "barrier dispatched": first.get("barrier dispatched"),
                "barrier in memory": first.get("barrier in memory"),
                "outputs dispatched": first.get("outputs dispatched"),
                "outputs in memory": last.get("outputs in memory")}

    def cpu_now(client):
        workers = client.run(_thread_cpu)
        here = psutil.Process().cpu_times()
        return {"client": here.user + here.system,
                "scheduler": sum(client.run_on_scheduler(_thread_cpu).values()),
                **{f"workers' {k}": sum(w[k] for w in workers.values()) for k in ("main", "collective", "other")}}

    rows = []
    cluster_args = {"backends": ["nvshmem"], "gpus": 1} if args.gpu else {"backends": ["mpi"]}
    with dask_pgas.LocalMPICluster(n_workers=p, **cluster_args) as cluster, Client(cluster) as client:
        x = da.random.random((n, n), chunks=(n, b))
        if args.gpu:
            import cupy

            x = x.map_blocks(cupy.asarray, dtype=x.dtype, meta=cupy.empty((0, 0), dtype=x.dtype))
        x = x.persist()
        wait(x)
        for i in range(args.repeats + 1):
            cpu0 = cpu_now(client) if args.cpu else None
            t0 = time.time()
            y = dask_pgas.rechunk(x, (b, n)).persist()
            t1 = time.time()
            wait(y)
            t2 = time.time()
            cpu1 = cpu_now(client) if args.cpu else None
            stamps = client.run_on_scheduler(scheduler_stamps, since=t0, prefix="pgas")
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
                    return (t - t0) * 1e3 if t is not None else float("nan")

                row = {"graph": ms(t1), **{step: ms(t) for step, t in stamps.items()},
                       "exchange first in": ms(min(starts)), "exchange last in": ms(max(starts)),
                       "exchange first out": ms(min(ends)), "exchange last out": ms(max(ends)),
                       "done": ms(t2)}
                rows.append({**dict(sorted(row.items(), key=lambda kv: kv[1])),
                             "exchange (slowest PE)": max(t["execute"] for t in timings) * 1e3,
                             "trivial graph, done": (t4 - t3) * 1e3,
                             **({f"cpu: {k}": (cpu1[k] - cpu0[k]) * 1e3 for k in cpu0} if args.cpu else {})})
    cpu_note = "; cpu: mean ms of CPU time per rechunk" if args.cpu else ""
    kind = "GPU workers (CuPy)" if args.gpu else "CPU workers"
    print(f"# S1 {n} x {n} float64 ({n * n * 8 / 2**20:.0f} MiB), {p} {kind}, {os.cpu_count()} cores; "
          f"median of {args.repeats}, ms from persist(){cpu_note}")
    for key in rows[0]:  # (CPU times tick in 10 ms steps: their mean, not their median)
        value = (statistics.mean if key.startswith("cpu: ") else statistics.median)(r[key] for r in rows)
        print(f"{key:24s} {value:8.1f}")


if __name__ == "__main__":
    main()
