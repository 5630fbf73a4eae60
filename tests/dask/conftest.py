"""One local Dask cluster shared by the whole tests/dask session: 3 CPU worker ranks of ``LocalMPICluster`` (an odd
count; ``DASK_PGAS_TEST_WORKERS`` for another), or ``DASK_PGAS_TEST_GPU_WORKERS`` GPU workers (see ``_xp.py``). With
``DASK_PGAS_TEST_CLUSTER=local`` the GPU workers are ``distributed.LocalCluster`` Nanny processes instead, not MPI
processes: the PGAS world then comes up from an NVSHMEM unique id handed out through the scheduler.
``DASK_PGAS_TEST_CLUSTER=dask-cuda`` takes the same path with dask-cuda's own ``LocalCUDACluster`` (its defaults,
and ``pgas.backends`` left to choose)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("distributed")


@pytest.fixture(scope="session", autouse=True)
def _sizeof_off_the_global_random():
    """dask's ``sizeof`` samples long lists with the ``random`` module's global generator, and runs on the client's
    IO loop thread (sizing each message it sends): while hypothesis draws an example on the main thread, that
    moves the global state, and hypothesis takes it for a strategy using ``random`` (a deprecation warning now,
    an error once it is removed). Here it samples with a generator of its own."""
    import random

    import dask.sizeof

    dask.sizeof.random = random.Random(0)
    yield
    dask.sizeof.random = random


def _nanny_cluster(n_workers: int, kind: str):
    """GPU workers that are not one MPI job, with a PGAS world made from an NVSHMEM unique id handed out by the
    scheduler: ``distributed.LocalCluster`` Nanny processes (``kind`` "local", backend named), or dask-cuda's
    ``LocalCUDACluster`` as a user starts it ("dask-cuda": one worker per GPU, default backends)."""
    from distributed import Client, LocalCluster

    import dask_pgas

    os.environ.setdefault("DASK_PGAS__COLLECTIVE_TIMEOUT", "60s")  # inherited by the worker processes
    if kind == "dask-cuda":
        from dask_cuda import LocalCUDACluster

        cluster, backends = LocalCUDACluster(n_workers=n_workers, dashboard_address=None), None
    else:
        cluster = LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True, memory_limit=0,
                               dashboard_address=None)
        backends = ["nvshmem"]
    with Client(cluster) as client:
        world = dask_pgas.bootstrap(client, backends=backends)
        sizes = {w: i["mpi_size"] for w, i in dask_pgas.world(client, detail=True).info.items()}
    # not one MPI job (a worker that touched mpi4py is an MPI singleton: a world of its own), on NVSHMEM
    if any(n not in (None, 1) for n in sizes.values()) or list(world.backends) != ["nvshmem"]:
        cluster.close()
        raise RuntimeError(f"expected workers outside one MPI job on nvshmem, got MPI world sizes {sizes} and "
                           f"backends {world.backends}")
    return cluster


@pytest.fixture(scope="session")
def pgas_cluster():
    import dask_pgas

    from ._xp import BACKEND, GPU_WORKERS, NWORKERS

    kind = os.environ.get("DASK_PGAS_TEST_CLUSTER")
    if GPU_WORKERS and kind in ("local", "dask-cuda"):
        cluster = _nanny_cluster(NWORKERS, kind)
    else:
        cluster = dask_pgas.LocalMPICluster(
            n_workers=NWORKERS, env={"DASK_PGAS__COLLECTIVE_TIMEOUT": "60s"}, backends=[BACKEND],
            gpus=1 if GPU_WORKERS else 0, dashboard_address=None,  # (8787 stays free for the tests' own clusters)
        )
    yield cluster
    cluster.close()
    keep = os.environ.get("DASK_PGAS_TEST_CLUSTER_LOG")  # the scheduler's and workers' output, for the GPU rounds
    if keep and hasattr(cluster, "logs"):
        with open(keep, "a") as f:
            f.write(cluster.logs())


@pytest.fixture()
def client(pgas_cluster):
    from distributed import Client

    with Client(pgas_cluster) as c:
        yield c
