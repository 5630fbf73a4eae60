"""One local MPI-backed Dask cluster shared by the whole tests/dask session: 3 CPU worker ranks (an odd count),
or ``DASK_PGAS_TEST_GPU_WORKERS`` GPU workers (see ``_xp.py``)."""

from __future__ import annotations

import pytest

pytest.importorskip("distributed")


@pytest.fixture(scope="session")
def pgas_cluster():
    import dask_pgas

    from ._xp import BACKEND, GPU_WORKERS, NWORKERS

    cluster = dask_pgas.LocalMPICluster(
        n_workers=NWORKERS, env={"DASK_PGAS__COLLECTIVE_TIMEOUT": "60s"}, backends=[BACKEND],
        gpus=1 if GPU_WORKERS else 0,
    )
    yield cluster
    cluster.close()


@pytest.fixture()
def client(pgas_cluster):
    from distributed import Client

    with Client(pgas_cluster) as c:
        yield c
