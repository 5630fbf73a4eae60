"""``dask-pgas``: command line of dask_pgas.

``dask-pgas demo`` starts a local MPI-backed Dask cluster (CPU workers, or one worker per GPU when GPUs are
present), rechunks an array of about 1 GiB from column slabs to row slabs and back with ``method="pgas"``,
checks the result and prints the GB/s beside Dask's ``tasks`` and ``p2p`` on the same cluster and array.
``dask-pgas world --scheduler-file F`` bootstraps (if needed) and shows the PGAS world of a running cluster.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import statistics
import sys
import time
import traceback

from dask.utils import parse_bytes


def _gpu_count() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def wait_forgotten(client, keys: list, timeout: float = 60.0, what: str = "the previous repetition") -> None:
    """Wait until the scheduler dropped ``keys`` (after the last reference went), so a rerun recomputes."""
    deadline = time.monotonic() + timeout
    while any(client.sync(client.scheduler.who_has, keys=keys).values()):
        if time.monotonic() > deadline:  # a rerun would reuse them and time nothing
            raise TimeoutError(
                f"after {timeout:g} s the cluster still holds {len(keys)} keys of {what}: a variable still refers "
                "to that result (in a notebook, from an earlier run of the same cell: delete it or set it to None), "
                "or the computation returns its input (a rechunk that changes nothing), so there is nothing to time")
        time.sleep(0.01)


def _sync_device() -> None:
    import cupy

    cupy.cuda.Device().synchronize()


def timed_persist(client, make, repeats: int, *, device_sync: bool = False, warmup: bool = False,
                  workers: list | None = None):
    """Median seconds of ``make().persist()`` + ``wait`` end to end (graph construction included), and the last
    result. ``device_sync`` also waits for every worker's GPU (CuPy tasks return before their kernels finish).
    ``workers`` restricts the tasks to those workers (restricted tasks skip the scheduler's queue, as pinned
    pgas tasks do). A task that fails raises here: a failed method is never timed."""
    from dask.core import flatten
    from distributed import futures_of, wait

    # a result held before the first run (released just now, or still referred to) would be handed back
    wait_forgotten(client, list(flatten(make().__dask_keys__())), 5.0, "the result before its first run")
    times, result = [], None
    try:
        for i in range(repeats + int(warmup)):
            if result is not None:
                done, result = list(flatten(result.__dask_keys__())), None
                wait_forgotten(client, done)
            t0 = time.perf_counter()
            result = make().persist() if workers is None else client.persist(make(), workers=workers)
            wait(result)
            if device_sync:
                client.run(_sync_device)
            elapsed = time.perf_counter() - t0
            # wait() returns for erred futures too: a failed method must not be timed (checked outside the timed
            # span; no reference to a future outlives the check, or wait_forgotten would wait for ever)
            erred = [f for f in futures_of(result) if f.status == "error"]
            if erred:
                erred[0].result()  # raises the task's exception
            if i or not warmup:
                times.append(elapsed)
    except BaseException as exc:
        # an interrupted or failed run: its traceback (IPython keeps the last one) keeps this frame and those of
        # the calls below (``wait``'s holds the futures too), which must not keep the result alive, or the next
        # run of the same computation would find it held
        result = erred = None
        traceback.clear_frames(exc.__traceback__)  # (all but this running frame)
        raise
    return statistics.median(times), result


def device_copy_seconds(nbytes: int, repeats: int = 5) -> float:
    """Median seconds of a device-to-device copy of ``nbytes`` on this worker's GPU (CUDA events); the two
    buffers go back to the device afterwards."""
    import cupy

    src = cupy.ones(nbytes // 8, dtype=cupy.float64)
    dst = cupy.empty_like(src)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for i in range(repeats + 1):
        start.record()
        cupy.copyto(dst, src)
        stop.record()
        stop.synchronize()
        if i:
            times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    del src, dst
    cupy.get_default_memory_pool().free_all_blocks()
    return statistics.median(times)


def truncated(v: float, digits: int = 1) -> float:
    """``v`` cut (not rounded) to ``digits`` decimals, so that a ratio shows as it counts: 4.996 as 4.9."""
    return math.floor(v * 10**digits + 1e-9) / 10**digits  # (+1e-9: 0.57 * 100 is 56.99999999999999)


def ratio_text(v: float) -> str:
    return f"{truncated(v):.1f}x"


def device_copy_reference(client, nbytes_per_worker: int) -> float:
    """Seconds of the device-to-device copy that bounds a rechunk of ``nbytes_per_worker`` on every worker.
    Workers that share a GPU (the same host and PCI bus id in the PGAS world's description) share its memory
    bandwidth, so one of them copies the bytes of all of them (copies run one worker at a time would each get
    the whole GPU and overstate it); the slowest GPU's time."""
    import dask_pgas

    by_gpu: dict = {}
    for worker, info in dask_pgas.world(client, detail=True).info.items():
        gpu = info.get("gpu") if isinstance(info, dict) else None
        by_gpu.setdefault((info["host"], gpu) if gpu else worker, []).append(worker)  # (unknown: its own)
    return max(client.run(device_copy_seconds, len(ws) * nbytes_per_worker, workers=[ws[0]])[ws[0]]
               for ws in by_gpu.values())


def demo(args: argparse.Namespace) -> int:
    import dask.array as da
    from dask.utils import format_bytes
    from distributed import Client, wait

    import dask_pgas

    gpus = 0 if args.cpu else _gpu_count()
    workers = args.workers or (gpus or 4)
    nbytes = args.size
    parts = max(workers, 4)  # slabs: with fewer than 4 workers several per worker (1 worker: no no-op rechunk)
    n = max(int((nbytes / 8) ** 0.5) // parts * parts, parts)
    cols, rows = (n, n // parts), (n // parts, n)
    s = "s" if workers > 1 else ""
    kind = f"{workers} GPU worker{s}" if gpus else f"{workers} CPU worker{s} (MPI rank{s})"
    print(f"dask-pgas demo: {n} x {n} float64 ({format_bytes(n * n * 8)}), {kind}")
    print(f"  column slabs {cols} -> row slabs {rows} -> column slabs, median of {args.repeats}", flush=True)
    if nbytes < SMALL_DEMO:
        print(f"  (under {format_bytes(SMALL_DEMO)} the times are mostly Dask's fixed cost per graph, not the data\n"
              "   moved: a larger --size compares the methods' speed)", flush=True)
    t0 = time.perf_counter()
    with dask_pgas.LocalMPICluster(n_workers=workers, backends=["nvshmem"] if gpus else ["mpi"],
                                   gpus=gpus) as cluster, \
            Client(cluster) as client:
        print(f"  cluster up in {time.perf_counter() - t0:.1f}s: {cluster.world}", flush=True)
        dask_pgas.install()
        x = da.random.random((n, n), chunks=cols)
        if gpus:
            import cupy

            x = x.map_blocks(cupy.asarray)
        x = x.persist()
        wait(x)
        gb = n * n * 8 / 1e9
        results = {}
        # each method's row as soon as it is measured (the three together take most of a minute at 1 GiB)
        print(f"  {'method':<7} {'cols->rows':>12} {'rows->cols':>12}  check", flush=True)
        for method in ("pgas", "tasks", "p2p") if not args.pgas_only else ("pgas",):
            try:
                # after one warm-up each: the first call of a method plans, touches fresh memory and, on GPU
                # workers, grows the symmetric heap, at a cost that differs between methods
                fwd, y = timed_persist(client, lambda x=x, m=method: x.rechunk(rows, method=m), args.repeats,
                                       device_sync=bool(gpus), warmup=True)
                back, z = timed_persist(client, lambda y=y, m=method: y.rechunk(cols, method=m), args.repeats,
                                        device_sync=bool(gpus), warmup=True)
                ok = bool(da.all(z == x).compute()) and bool(da.all(y == x.rechunk(rows, method="tasks")).compute())
                del y, z
            except Exception as exc:  # a peer method not available on this cluster
                results[method] = exc
                print(f"  {method:<7} {'n/a':>12} {'n/a':>12}  {type(exc).__name__}: {exc}", flush=True)
            else:
                results[method] = (fwd, back, ok)
                print(f"  {method:<7} {gb / fwd:>8.2f} GB/s {gb / back:>8.2f} GB/s  {'OK' if ok else 'WRONG'}",
                      flush=True)
        copy = None
        if gpus:  # the same bytes copied on the workers' GPUs: the ceiling of any GPU rechunk
            copy = device_copy_reference(client, n * n * 8 // workers)
        good = [r for r in results.values() if not isinstance(r, Exception)]
        if "pgas" in results and not isinstance(results["pgas"], Exception):
            peers = [r for m, r in results.items() if m != "pgas" and not isinstance(r, Exception)]
            p = results["pgas"]
            if peers:  # each direction against the faster peer in that direction
                fwd_x, back_x = (min(r[d] for r in peers) / p[d] for d in (0, 1))
                print(f"  pgas vs faster of tasks/p2p: {ratio_text(fwd_x)} cols->rows, {ratio_text(back_x)} rows->cols")
            if copy:
                print(f"  device-to-device copy of the same bytes: {gb / copy:.2f} GB/s; pgas reaches "
                      f"{copy / p[0]:.0%} (cols->rows) and {copy / p[1]:.0%} (rows->cols) of it")
        del x
        dask_pgas.uninstall()
    return 0 if good and all(r[2] for r in good) and "pgas" in results and \
        not isinstance(results["pgas"], Exception) else 1


def _not_a_scheduler_file(path: str) -> str | None:
    """Why ``path`` cannot be a scheduler file (JSON with the scheduler's ``address``), or None."""
    import json

    if not os.path.isfile(path):
        return "it is a directory" if os.path.isdir(path) else "it is not a regular file"
    try:
        with open(path) as f:
            address = json.load(f).get("address")
    except (OSError, ValueError, AttributeError) as exc:
        return f"no JSON object in it ({type(exc).__name__}: {exc}); is the scheduler still writing it?"
    if not isinstance(address, str) or not address:
        return "it holds no scheduler address"
    # an address Dask cannot use ("tcp://host" without a port, an unknown scheme): refused before a Client is
    # made (distributed 2025.1's half-made Client then deadlocked in its __del__)
    from distributed.comm.addressing import parse_address, parse_host_port
    from distributed.comm.registry import get_backend

    try:
        scheme, location = parse_address(address)
        get_backend(scheme)
        if scheme in ("tcp", "tls"):
            parse_host_port(location)
    except ValueError as exc:
        return f"its address {address!r} is unusable ({exc})"
    return None


def show_world(args: argparse.Namespace) -> int:
    from distributed import Client

    import dask_pgas

    try:
        client = Client(scheduler_file=args.scheduler_file, timeout=args.timeout)
    except OSError as exc:  # a stale file: the scheduler that wrote it is gone
        print(f"dask-pgas world: no scheduler answers at the address in {args.scheduler_file} ({exc})",
              file=sys.stderr)
        return 1
    with client:
        try:
            dask_pgas.bootstrap(client)
            print(dask_pgas.world(client, detail=True))
        except dask_pgas.errors.PGASError as exc:  # a refused bootstrap says why: no traceback
            print(f"dask-pgas world: {exc}", file=sys.stderr)
            return 1
    return 0


def _at_least(minimum: int, parse, what: str, unit: str = "", maximum: float = float("inf")):
    """An argparse type: ``parse(text)`` (a ValueError or OverflowError is "not {what}"), from ``minimum`` to
    ``maximum``."""

    def convert(text: str) -> int:
        try:
            n = parse(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if not n >= minimum:  # (NaN too)
            raise argparse.ArgumentTypeError(f"must be at least {minimum}{unit}, got {text!r}")
        if not n <= maximum:  # (infinity too)
            raise argparse.ArgumentTypeError(f"must be at most {maximum:g}{unit}, got {text!r}")
        return n

    return convert


#: arrays smaller than this measure Dask's per-graph cost more than the data movement (the demo says so)
SMALL_DEMO = 64 * 2**20
_size = _at_least(8, parse_bytes, "a size (e.g. 64MiB, 1GiB)", " bytes", maximum=2**50)
_positive = _at_least(1, int, "an integer")
_seconds = _at_least(1, float, "a number of seconds", " s", maximum=1e6)


class _NoInterruptedGatherNoise(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" for distributed's ``AllExit``: a client closed
    while it gathered (Ctrl-C during ``compute()``) leaves such tasks behind (distributed's ``Client._gather``
    stops waiting at the first one and never retrieves the others); and tornado's report of the ``NameError``
    that ``distributed.utils.sync`` raises when Ctrl-C comes before its coroutine started. The interruption
    itself is reported."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info:
            return True
        from distributed.client import AllExit

        error = record.exc_info[1]
        # distributed's sync(): a Ctrl-C before its coroutine started makes its cancel callback read a variable
        # not yet assigned (tornado logs it as "Exception in callback ... sync.<locals>.cancel")
        race = isinstance(error, NameError) and "free variable 'future'" in str(error)
        return not (isinstance(error, AllExit) or race)


_INTERRUPTED_GATHER_NOISE = _NoInterruptedGatherNoise()  # one instance: adding it again is a no-op


def main(argv: list[str] | None = None) -> int:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="dask-pgas",
        description="Redistribute Dask arrays in one collective: a demo on a local MPI-backed cluster, and the "
                    "PGAS world of a running one.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    text = "rechunk ~1 GiB column slabs -> row slabs and back; compare with tasks/p2p"
    p = sub.add_parser("demo", help=text, description=text[0].upper() + text[1:] + ".")
    p.add_argument("--size", type=_size, default="1GiB", help="array size (default 1GiB; e.g. 64MiB for CI)")
    p.add_argument("--workers", type=_positive, default=None, help="workers (default: one per GPU, else 4)")
    p.add_argument("--repeats", type=_positive, default=3, help="timed repetitions per method and direction; "
                   "the median is shown (default 3)")
    p.add_argument("--cpu", action="store_true", help="CPU workers even when GPUs are present")
    p.add_argument("--pgas-only", action="store_true", help="skip the tasks/p2p comparison")
    p.set_defaults(func=demo)
    text = "bootstrap and show the PGAS world of a running cluster"
    w = sub.add_parser("world", help=text, description=text[0].upper() + text[1:] + ".")
    w.add_argument("--scheduler-file", required=True, help="the file dask-mpi or dask scheduler wrote")
    w.add_argument("--timeout", type=_seconds, default=30.0, help="seconds to wait for the scheduler (default 30)")
    w.set_defaults(func=show_world)
    args = parser.parse_args(argv)
    if args.command == "world":
        if not os.path.exists(args.scheduler_file):
            # distributed would wait for the file for ever; dask-mpi removes it when its cluster shuts down
            w.error(f"no scheduler file {args.scheduler_file}: start the cluster first (dask-mpi "
                    "--scheduler-file ...), or check the path")
        # a file just created may not be written yet (distributed retries such a read briefly too)
        deadline = time.monotonic() + min(args.timeout, 2.0)
        while (why := _not_a_scheduler_file(args.scheduler_file)) is not None and os.path.isfile(
                args.scheduler_file) and time.monotonic() < deadline:
            time.sleep(0.05)
        if why is not None:
            w.error(f"{args.scheduler_file} is not a scheduler file: {why}")
    for logger in ("asyncio", "tornado.application"):
        logging.getLogger(logger).addFilter(_INTERRUPTED_GATHER_NOISE)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("dask-pgas: interrupted", file=sys.stderr)
        # A Client interrupted while it connected or closed can be left unclosed in a reference cycle. Collected
        # only at interpreter exit, after the IO-loop threads stopped, its __del__ then waits for that loop
        # (once in ~45 interrupts at start-up: over 60 s). Collected now, it closes on a running loop.
        gc.collect()
        return 130


if __name__ == "__main__":
    sys.exit(main())
