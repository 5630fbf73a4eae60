"""A dask-mpi job whose workers form the PGAS world.

    mpiexec -n 5 python examples/dask_mpi_rechunk.py

Rank 0 runs the scheduler, rank 1 this client code, ranks 2..4 one ``distributed.Worker`` each (the worker IS
the MPI process: no Nanny); any ``-n`` of at least 3 works, with ``n - 2`` workers. ``dask_pgas.bootstrap``
builds a communicator of the worker ranks only and brings the PGAS runtime up on each worker;
``dask_pgas.rechunk`` then moves the data in one collective.

It prints the world and ``rechunk OK (...)`` and exits with status 0. After that, distributed may log
``CommClosedError ... Stream is closed`` tracebacks from workers whose connection to the scheduler closed
first while dask-mpi shut the job down: a dask-mpi script without dask_pgas prints them too (docs/dask.md).
"""

import dask_mpi
from mpi4py import MPI

if MPI.COMM_WORLD.size < 3:
    raise SystemExit("dask_mpi_rechunk.py needs at least 3 MPI ranks (scheduler, client, one worker or more)"
                     if MPI.COMM_WORLD.rank == 0 else 1)  # (the message once; every rank exits with status 1)
dask_mpi.initialize(nthreads=1, worker_class="distributed.Worker", dashboard=False)

import dask.array as da  # noqa: E402
import numpy as np  # noqa: E402
from distributed import Client  # noqa: E402

import dask_pgas  # noqa: E402

with Client() as client:
    client.wait_for_workers(MPI.COMM_WORLD.size - 2, timeout=120)  # every worker rank, so the world is all of them
    world = dask_pgas.bootstrap(client)
    print(world, flush=True)
    n, parts = 3000, max(world.npes, 2)  # (two slabs at least: with one worker the rechunk still moves data)
    x = da.random.random((n, n), chunks=(n, n // parts)).persist()
    y = dask_pgas.rechunk(x, (n // parts, n)).persist()  # column slabs -> row slabs, one collective
    ok = np.array_equal(y.compute(), x.compute())
    print("rechunk", "OK" if ok else "WRONG", y.chunks[0], flush=True)
    dask_pgas.teardown(client)  # free symmetric memory collectively before the job ends
