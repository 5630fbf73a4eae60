"""Rechunks whose collectives queue behind each other on the members (the shared cluster)."""

from __future__ import annotations

import dask.array as da
import numpy as np
import pytest

import dask_pgas

from ._xp import host, on_device

pytestmark = [pytest.mark.dask, pytest.mark.timeout(120)]


def test_runs_queued_behind_each_other_are_not_late(client):
    """Three rechunks computed together start three runs at once; every member runs them one after another.
    Each collective takes 1 s (``_delay``) against a 2 s collective timeout, so the third ends about 3 s after
    it was sent: it is not late, and the world stays intact (the watchdog used to count the queueing too,
    break the world and poison every worker)."""
    import dask

    p = dask_pgas.world(client).npes
    if p < 2:
        pytest.skip("needs two PEs")
    ref = np.arange(40 * 20 * p, dtype=np.float64).reshape(40, 20 * p)
    x = on_device(da.from_array(ref, chunks=(40, 20))).persist()

    def set_timeout(value):
        dask.config.set({"pgas.collective-timeout": value})

    client.run_on_scheduler(set_timeout, "2s")
    try:
        ys = [dask_pgas.rechunk(x + i, (10, 20 * p), _delay=1.0) for i in range(3)]
        for i, got in enumerate(client.gather(client.compute(ys))):
            np.testing.assert_array_equal(host(got), ref + i)
    finally:
        client.run_on_scheduler(set_timeout, "120s")
    world = dask_pgas.world(client)
    assert world.broken is None
    assert not any(client.run(lambda dask_worker: dask_worker.plugins["dask-pgas"].poisoned).values())
