"""One Dask worker per MPI rank: ``mpiexec -n N python -m dask_pgas.integration._worker_main --scheduler-file F``.

The worker IS the MPI process (``distributed.Worker``, not a Nanny: a Nanny's child is not an MPI process).
MPI is initialized (``MPI_THREAD_MULTIPLE``) before the worker starts; the PGAS runtime itself comes up later,
in the explicit ``dask_pgas.bootstrap(client)`` step. A worker left inside a collective whose peer died exits
without ``MPI_Finalize`` (which would wait for that peer forever), as does one whose world was never torn down
(the scheduler went away, e.g. its launcher died). The MPI library's named file in ``/dev/shm`` is unlinked as
soon as MPI is up, so that neither that nor a killed job leaves it behind.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys


def worker_gpu(local_rank: int, gpus: int, visible: str | None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` of the worker of this node-local rank: entry ``local_rank mod gpus`` of the
    launcher's own mask when it has one (``"2,3"``, UUIDs), so that a mask narrows the GPUs instead of being
    replaced; GPU ``local_rank mod gpus`` otherwise."""
    entries = [e.strip() for e in (visible or "").split(",") if e.strip()]
    k = local_rank % gpus
    return entries[k] if k < len(entries) else str(k)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scheduler-file", required=True)
    parser.add_argument("--nthreads", type=int, default=1)
    parser.add_argument("--memory-limit", default="auto")
    parser.add_argument("--local-directory", default=None)
    args = parser.parse_args(argv)

    from distributed import Worker

    from . import _worker_plugin

    # every rank of this job is a worker (dask-mpi's jobs keep ranks 0 and 1 for the scheduler and the client):
    # bootstrap waits for all of them after a restart of the job. (A module flag, not an environment variable:
    # processes that tasks start are no ranks of this job.)
    _worker_plugin.every_rank_a_worker = True
    gpus = int(os.environ.get("DASK_PGAS_BIND_GPUS", "0") or 0)
    if gpus:  # one GPU per worker, chosen by node-local rank, before anything starts CUDA
        local = int(os.environ.get("MPI_LOCALRANKID", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")))
        os.environ["CUDA_VISIBLE_DEVICES"] = worker_gpu(local, gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))

    from mpi4py import MPI  # initializes MPI in this (main) thread

    from ._orphan_guard import unlink_mpi_names, watch_launcher

    unlink_mpi_names()  # a job killed or interrupted leaves no file in /dev/shm
    watch_launcher(directory=args.local_directory)  # (LocalMPICluster's temporary directory)

    rank = MPI.COMM_WORLD.Get_rank()
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(name)s %(levelname)s: %(message)s")
    state = {"poisoned": False}

    async def run() -> None:
        async with Worker(
            scheduler_file=args.scheduler_file,
            nthreads=args.nthreads,
            name=f"mpi-rank-{rank}",
            memory_limit=args.memory_limit,
            local_directory=args.local_directory,
        ) as worker:
            await worker.finished()
            plugin = worker.plugins.get("dask-pgas")
            state["poisoned"] = bool(plugin is not None and plugin.poisoned)

    try:
        asyncio.run(run())
    except (KeyboardInterrupt, asyncio.CancelledError):  # pragma: no cover
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    from dask_pgas import runtime

    # a peer died inside a collective, or the world was not torn down: no MPI_Finalize (it would wait for the
    # peer or run collectives; MPI's named file in /dev/shm went at start)
    if state["poisoned"] or runtime.is_initialized():
        os._exit(0)


if __name__ == "__main__":
    main()
