"""Rechunk benchmark: ``method="pgas"`` beside Dask ``tasks`` and ``p2p`` on one cluster, and bare exchanges of
the same bytes on the same workers, all in the same run (scenarios of docs' performance anchors).

    python benchmarks/bench_rechunk.py                       # S1 (8192^2 float64), S3, S4 with 4 CPU workers
    python benchmarks/bench_rechunk.py --scenarios S1 --n 4096 --repeats 3
    python benchmarks/bench_rechunk.py --scenarios S1 --rounds 3    # methods take turns: fairer on a noisy box

Times are end to end: ``y = x.rechunk(chunks, method=m).persist(); wait(y)`` including graph construction,
on a persisted input, median of ``--repeats`` after one warm-up. GB/s = array bytes / time. S1 and S3 also
measure, in every round, a floor no rechunk on these workers can beat (one copy pass over the bytes plus Dask's
round trip for a trivial graph), and so the most any rechunk could show against the best peer in that round.
S1 also times, in every round and in the workers' own processes, its exchange done bare without Dask: one
``MPI.Alltoallw`` with subarray types, and the MPI engine's own exchange (packing and the local piece as a pgas
run does them); "pgas / faster bare" is pgas's end-to-end forward time against the faster of the two. Every
method's result is checked both ways on the last round (S4 above N = 8192: unchecked, said in the table).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics


# ------------------------------------------------------------------------------------------- bare exchanges
def _bare_exchanges(n: int, repeats: int) -> dict[str, list[float]]:
    """On a worker's collective thread (every worker at once): S1's exchange, column slab -> row slab of an
    n x n float64 on the PGAS world's communicator, done bare, without Dask, two ways:

    - ``alltoallw``: one ``MPI.Alltoallw`` with subarray types on both sides, this rank's own piece included;
    - ``engine``: the MPI engine's own plan (what a pgas run calls): contiguous runs as they are, strided pieces
      packed first where the MPI is slow with them, this rank's piece copied outside the ``Alltoallw``.

    Seconds of each repeat (barrier to barrier) after one warm-up; the two results are checked equal."""
    import time

    import numpy as np
    from mpi4py import MPI

    from dask_pgas import runtime
    from dask_pgas.distribution import Box
    from dask_pgas.engines.base import ReshapeSpec

    engine = runtime.get_engine("mpi")
    comm = engine.data_comm
    p, r = comm.size, comm.rank
    bounds = [n * i // p for i in range(p + 1)]
    width = bounds[r + 1] - bounds[r]
    stypes, rtypes, plan, error = [], [], None, None
    try:  # local set-up (MemoryError, say), agreed on below: no rank may wait alone in the first Barrier
        src = np.random.default_rng(r).random((n, width))
        out = {"alltoallw": np.zeros((width, n)), "engine": np.zeros((width, n))}
        for j in range(p):
            hj = bounds[j + 1] - bounds[j]
            stypes.append(MPI.DOUBLE.Create_subarray([n, width], [hj, width], [bounds[j], 0]).Commit())
            rtypes.append(MPI.DOUBLE.Create_subarray([width, n], [width, hj], [0, bounds[j]]).Commit())
        spec = ReshapeSpec(tuple(Box((0, bounds[j]), (n, bounds[j + 1])) for j in range(p)),
                           tuple(Box((bounds[j], 0), (bounds[j + 1], n)) for j in range(p)), np.dtype("f8"), "C", r)
        plan = engine.plan_reshape(spec)  # (local on the MPI engine)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    if bad := engine.control.agree(error):
        if plan is not None:
            plan.free()  # (local on the MPI engine)
        for t in stypes + rtypes:
            t.Free()
        raise RuntimeError(f"the bare exchanges cannot start on PE {bad[0][0]}: {bad[0][1]}")
    ones, zeros = [1] * p, [0] * p
    calls = {
        "alltoallw": lambda: comm.Alltoallw([src, (ones, zeros), stypes], [out["alltoallw"], (ones, zeros), rtypes]),
        "engine": lambda: plan.execute(src, out["engine"]),
    }
    times: dict[str, list[float]] = {k: [] for k in calls}
    try:
        for i in range(repeats + 1):
            for how, call in calls.items():
                comm.Barrier()
                t0 = time.perf_counter()
                call()
                comm.Barrier()
                if i:
                    times[how].append(time.perf_counter() - t0)
    finally:
        plan.free()
        for t in stypes + rtypes:
            t.Free()
    if not np.array_equal(out["alltoallw"], out["engine"]):
        raise AssertionError("the bare Alltoallw and the engine's exchange disagree")
    return times


async def _on_collective_thread(fn, *args, dask_worker=None):
    """(client.run) ``fn(*args)`` on the worker's PGAS collective thread, where its MPI calls belong, queued
    behind any run there; the worker's event loop stays free meanwhile (a plain function would block it)."""
    import asyncio

    from dask_pgas.integration._worker_plugin import get_plugin

    return await asyncio.wrap_future(get_plugin(dask_worker)._thread.submit(fn, *args))


def bare_exchange_seconds(client, n: int, repeats: int, timeout: float = 300.0) -> dict[str, float]:
    """:func:`_bare_exchanges` on every worker at once: per way, the median over repeats of the slowest worker.

    Raises ``TimeoutError`` after ``timeout`` seconds: a rank whose call raised inside the timed loop leaves its
    peers in the collective (bare MPI has no agreement there), and the benchmark must fail, not wait."""
    import asyncio

    try:  # (client.run, with distributed's own deadline on the call)
        per_worker = list(client.sync(client._run, _on_collective_thread, _bare_exchanges, n, repeats,
                                      callback_timeout=timeout).values())
    except (TimeoutError, asyncio.TimeoutError) as exc:  # (one class since Python 3.11)
        raise TimeoutError(f"the bare exchanges did not end on every worker within {timeout:.0f} s (a rank's call "
                           "raised, or the MPI is stuck): their collective threads are blocked; close the "
                           "cluster") from exc
    return {how: statistics.median(max(w[how][i] for w in per_worker) for i in range(repeats))
            for how in per_worker[0]}


# ------------------------------------------------------------------------------------------- Dask methods
def time_method(client, x, chunks, method: str, repeats: int, device_sync: bool = False) -> tuple[float, object]:
    """Median end-to-end seconds of ``x.rechunk(chunks, method=method).persist()`` after one warm-up."""
    import dask_pgas
    from dask_pgas.cli import timed_persist

    def make():
        return dask_pgas.rechunk(x, chunks) if method == "pgas" else x.rechunk(chunks, method=method)

    return timed_persist(client, make, repeats, device_sync=device_sync, warmup=True)


def _copy_share(nbytes: int, start_at: float) -> float:
    """On a worker: seconds for one copy of ``nbytes`` between two already-touched buffers, started at the wall
    clock time ``start_at`` (one host, so every worker copies at the same moment)."""
    import time

    import numpy as np

    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    dst[...] = src  # touch every page first: pgas writes into recycled (already touched) output blocks
    time.sleep(max(start_at - time.time(), 0.0))
    t0 = time.perf_counter()
    dst[...] = src
    return time.perf_counter() - t0


def trivial_graph(x):
    """One tiny task per chunk of ``x`` (its first element): Dask's round trip through the scheduler and the
    workers with next to no data moved."""
    return x.map_blocks(lambda c: c[(slice(0, 1),) * c.ndim], chunks=(1,) * x.ndim)


def floor_seconds(client, x, repeats: int) -> dict:
    """What no Dask rechunk of ``x`` on these workers can beat, measured now: one copy pass over the bytes with
    every worker copying its share at once (each element is written to its new place at least once), and Dask's
    round trip for :func:`trivial_graph` (``persist`` to ``wait`` returning)."""
    import time

    from dask_pgas.cli import timed_persist

    workers = list(client.scheduler_info()["workers"])
    share = x.nbytes // len(workers)
    copies = []
    for _ in range(repeats):
        start_at = time.time() + 0.2
        copies.append(max(client.run(_copy_share, share, start_at).values()))
    trip, _ = timed_persist(client, lambda: trivial_graph(x), repeats, warmup=True)
    return {"copy": statistics.median(copies), "round_trip": trip}


def scenario(client, name: str, shape, chunks_in, chunks_out, methods, repeats, check=True, rounds=1,
             floor=False, bare=False) -> dict:
    """Forward and back times of every method. With ``rounds`` > 1 the methods take turns (pgas, tasks, p2p;
    tasks, p2p, pgas; p2p, pgas, tasks; ...) so a box that slows down or speeds up mid-run, and what one method
    leaves behind for the next, weigh on all of them alike; each figure is then the median of the rounds'
    medians. With ``floor``, each round also measures :func:`floor_seconds`; with
    ``bare`` (S1's slabs), each round also times the exchange bare on the workers (:func:`bare_exchange_seconds`)."""
    import dask.array as da
    import numpy as np
    from distributed import wait

    x = da.random.random(shape, chunks=chunks_in).persist()
    wait(x)
    nbytes = int(np.prod(shape)) * 8
    row = {"scenario": name, "shape": list(shape), "bytes": nbytes,
           "chunks_in": [len(c) for c in x.chunks], "chunks_out": None}
    times: dict = {m: ([], []) for m in methods}
    floors, bares = [], []
    for i in range(rounds):
        if floor:
            floors.append(floor_seconds(client, x, repeats))
        if bare:
            bares.append(bare_exchange_seconds(client, shape[0], repeats))
        # each round starts with the next method: whatever a method leaves on the workers (p2p's shuffle
        # cleanup slows the next rechunk by 10-30 ms here) falls on every method in turn, not always on the same
        for method in methods[i % len(methods):] + methods[:i % len(methods)]:
            if f"{method}_error" in row:
                continue
            try:
                fwd, y = time_method(client, x, chunks_out, method, repeats)
                row["chunks_out"] = [len(c) for c in y.chunks]
                back, z = time_method(client, y, chunks_in, method, repeats)
                if check and i == rounds - 1:  # both directions: a wrong forward result undone by the back one
                    row[f"{method}_ok"] = bool(da.all(z == x).compute()) and bool(
                        da.all(y == x.rechunk(chunks_out, method="tasks")).compute())
                times[method][0].append(fwd)
                times[method][1].append(back)
                del y, z
            except Exception as exc:  # report and go on with the other methods
                row[f"{method}_error"] = f"{type(exc).__name__}: {exc}"
    peers = [times[m][0] for m in ("tasks", "p2p") if m in times and f"{m}_error" not in row and times[m][0]]
    if "pgas" in times and "pgas_error" not in row and peers:
        # each round's own ratio (forward): how much the verdict depends on the round it is read from
        row["pgas_over_best_peer_by_round"] = [
            min(p[i] for p in peers) / t for i, t in enumerate(times["pgas"][0]) if all(len(p) > i for p in peers)
        ]
        # each round's bound on that ratio: its best peer over the least any rechunk could take in that round
        row["best_peer_over_floor_by_round"] = [
            min(p[i] for p in peers) / (f["copy"] + f["round_trip"]) for i, f in enumerate(floors)
            if all(len(p) > i for p in peers)
        ]
    if bares and "pgas" in times and "pgas_error" not in row:
        # each round's pgas forward against that round's faster bare exchange (the same bytes, same layout)
        row["pgas_over_bare_by_round"] = [min(b.values()) / t for t, b in zip(times["pgas"][0], bares)]
    for how in ("alltoallw", "engine") if bares else ():
        row[f"{how}_GBps"] = nbytes / statistics.median(b[how] for b in bares) / 1e9
    if floors:
        row["floor_copy_s"] = statistics.median(f["copy"] for f in floors)
        row["floor_round_trip_s"] = statistics.median(f["round_trip"] for f in floors)
    for method, (fwds, backs) in times.items():
        if f"{method}_error" in row:
            continue
        fwd, back = statistics.median(fwds), statistics.median(backs)
        row[f"{method}_fwd_GBps"] = nbytes / fwd / 1e9
        row[f"{method}_back_GBps"] = nbytes / back / 1e9
        row[f"{method}_fwd_s"] = fwd
        row[f"{method}_back_s"] = back
    del x
    return row


def _s3_size(text: str) -> int:
    """S3's N: at or below 2503 its chunks (N, 2503) -> (1667, N) are one chunk both ways, and a rechunk that
    changes nothing returns its input, whose keys a repetition would wait for Dask to forget for ever."""
    n = int(text)
    if n <= 2503:
        raise argparse.ArgumentTypeError(f"S3 needs N > 2503 (its input chunks are 2503 wide), got {n}")
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--n", type=int, default=8192, help="S1 size (N x N float64)")
    ap.add_argument("--s3-n", type=_s3_size, default=10007,
                    help="S3 size (N x N float64, chunks (N, 2503) -> (1667, N)); more than 2503")
    ap.add_argument("--s4-n", type=int, default=16384)
    ap.add_argument("--scenarios", default="S1,S1-1MiB,S1-16MiB,S3,S4")
    ap.add_argument("--methods", default="pgas,tasks,p2p")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1,
                    help="let the methods take turns this many times (a noisy box weighs on all alike)")
    ap.add_argument("--worker-profiler", choices=("on", "off"), default="on",
                    help="Dask's statistical profiler on the workers (on is Dask's default; off speeds up the "
                    "tasks and p2p methods by 15-30%% on 2 cores and pgas by nothing measurable)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args()

    from distributed import Client

    import dask_pgas
    from dask_pgas.cli import ratio_text, truncated

    p = args.workers
    if "S1" in args.scenarios.split(",") and args.n % p:  # (before the cluster starts)
        raise SystemExit(f"S1: --n {args.n} is not a multiple of the {p} workers (the slabs would be {p + 1}, and "
                         f"the bare exchange's {p})")
    methods = args.methods.split(",")
    wanted = args.scenarios.split(",")
    rows = []
    env = {"DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": str(args.worker_profiler == "on")}
    with dask_pgas.LocalMPICluster(n_workers=p, backends=["mpi"], env=env) as cluster, Client(cluster) as client:
        print(f"# {p} CPU workers, {os.cpu_count()} cores, Dask worker profiler {args.worker_profiler}; "
              f"{cluster.world}", flush=True)
        for name in wanted:
            if name.startswith("S1"):
                if name == "S1":
                    n = args.n
                else:  # bytes per worker
                    per = {"S1-1MiB": 2**20, "S1-16MiB": 2**24}[name]
                    n = int((per * p / 8) ** 0.5) // p * p
                b = n // p
                row = scenario(client, name, (n, n), (n, b), (b, n), methods, args.repeats, rounds=args.rounds,
                               floor=True, bare="pgas" in methods)
            elif name == "S3":
                n = args.s3_n  # prime; chunk sizes that do not divide it
                row = scenario(client, name, (n, n), (n, 2503), (1667, n), methods, args.repeats,
                               rounds=args.rounds, floor=True)
            elif name == "S4":
                n = args.s4_n
                row = scenario(client, name, (n, n), (128, 128), (-(-n // p), n), methods,
                               max(1, min(args.repeats, 3)), check=n <= 8192)
            else:
                raise SystemExit(f"unknown scenario {name}")
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print("| scenario | shape | pgas fwd / back GB/s | tasks fwd / back | p2p fwd / back | pgas / best peer | "
          "bare Alltoallw / engine exchange GB/s | pgas / faster bare | faster bare / best peer | results |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        def fb(m, r=r):
            if f"{m}_fwd_GBps" not in r:
                return r.get(f"{m}_error", "-")[:40]
            return f"{r[f'{m}_fwd_GBps']:.2f} / {r[f'{m}_back_GBps']:.2f}"
        peers = [r[f"{m}_fwd_GBps"] for m in ("tasks", "p2p") if f"{m}_fwd_GBps" in r]
        ratio = f"{ratio_text(r['pgas_fwd_GBps'] / max(peers))} fwd" if peers and "pgas_fwd_GBps" in r else "-"
        bare = max(r.get("alltoallw_GBps", 0), r.get("engine_GBps", 0))
        pct = f"{100 * r['pgas_fwd_GBps'] / bare:.0f}% fwd" if bare and "pgas_fwd_GBps" in r else "-"
        # the most any rechunk that moves the bytes through MPI could show against Dask in this run
        ceiling = ratio_text(bare / max(peers)) if bare and peers else "-"
        bares = f"{r['alltoallw_GBps']:.2f} / {r['engine_GBps']:.2f}" if bare else "-"
        checked = ", ".join(f"{m} {'OK' if r[f'{m}_ok'] else 'WRONG'}" if f"{m}_ok" in r else f"{m} unchecked"
                            for m in ("pgas", "tasks", "p2p") if f"{m}_fwd_GBps" in r)
        print(f"| {r['scenario']} | {'x'.join(map(str, r['shape']))} | {fb('pgas')} | {fb('tasks')} | {fb('p2p')} | "
              f"{ratio} | {bares} | {pct} | {ceiling} | {checked} |")
    for r in rows:
        if "floor_copy_s" in r:
            pgas = f"; pgas forward {1e3 * r['pgas_fwd_s']:.0f} ms" if "pgas_fwd_s" in r else ""
            print(f"{r['scenario']}: floor {1e3 * (r['floor_copy_s'] + r['floor_round_trip_s']):.0f} ms = one copy "
                  f"pass {1e3 * r['floor_copy_s']:.0f} ms (every worker its share at once) + Dask round trip "
                  f"{1e3 * r['floor_round_trip_s']:.0f} ms{pgas}")
        for key, what, least in (
            ("pgas_over_best_peer_by_round", "pgas / best peer by round (forward)", 5),
            ("pgas_over_bare_by_round", "pgas / the round's faster bare exchange (forward)", 0.5),
            ("best_peer_over_floor_by_round", "the most any rechunk could reach (best peer / floor) by round", 5),
        ):
            if values := r.get(key):
                def show(v, least=least):
                    return ratio_text(v) if least > 1 else f"{truncated(100 * v, 0):.0f}%"

                print(f"{r['scenario']}: {what}: {' '.join(map(show, values))}; at least {show(least)} in "
                      f"{sum(v >= least for v in values)} of {len(values)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
