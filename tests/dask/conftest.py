"""One local MPI-backed Dask cluster (3 worker ranks: an odd count) shared by the whole tests/dask session."""

from __future__ import annotations

import pytest

pytest.importorskip("distributed")


@pytest.fixture(scope="session")
def pgas_cluster():
    import dask_pgas

    cluster = dask_pgas.LocalMPICluster(n_workers=3, env={"DASK_PGAS__COLLECTIVE_TIMEOUT": "60s"})
    yield cluster
    cluster.close()


@pytest.fixture()
def client(pgas_cluster):
    from distributed import Client

    with Client(pgas_cluster) as c:
        yield c
