"""dask-mpi clusters as mpiexec subprocesses: a dask_mpi.initialize() script and the dask-mpi CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

pytestmark = [pytest.mark.dask, pytest.mark.timeout(180)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


def _mpiexec():
    return MPIEXEC if os.path.exists(MPIEXEC) else "mpiexec"


def test_dask_mpi_initialize_script():
    out = subprocess.run(
        [_mpiexec(), "-n", "5", sys.executable, os.path.join(ROOT, "examples", "dask_mpi_rechunk.py")],
        capture_output=True, text=True, timeout=150,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "rechunk OK" in out.stdout
    assert "PE 2" in out.stdout


def test_dask_mpi_cli_scheduler_file(tmp_path):
    import dask
    import dask.array as da
    from distributed import Client

    import dask_pgas

    sched = tmp_path / "scheduler.json"
    dask_mpi = os.path.join(os.path.dirname(sys.executable), "dask-mpi")
    log = open(tmp_path / "dask-mpi.log", "wb")
    proc = subprocess.Popen(
        [_mpiexec(), "-n", "4", dask_mpi, "--scheduler-file", str(sched), "--worker-class", "distributed.Worker",
         "--nthreads", "1", "--no-dashboard"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not sched.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        # (Client.shutdown() leaves the client's scheduler setting in dask.config: restore it for later tests)
        with dask.config.set(scheduler=dask.config.get("scheduler", None)), \
                Client(scheduler_file=str(sched), timeout=60) as client:
            client.wait_for_workers(3, timeout=60)
            world = dask_pgas.bootstrap(client)
            assert world.npes == 3
            x = da.random.random((90, 60), chunks=(90, 20))
            np.testing.assert_array_equal(dask_pgas.rechunk(x, (30, 60)).compute(), x.compute())
            dask_pgas.teardown(client)
            client.shutdown()
        proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(10)
        log.close()
