"""dask-mpi clusters as mpiexec subprocesses: a dask_mpi.initialize() script and the dask-mpi CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ._mpi_files import mpi_names_unlinked

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
            # the workers unlinked MPICH's /dev/shm file at bootstrap: an interrupted job leaves none
            mpi_names_unlinked(client.run(os.getpid).values())
            # dask-mpi's job keeps rank 0 (and, with initialize(), 1) for others: not waited for at bootstrap
            info = dask_pgas.world(client, detail=True).info.values()
            assert [list(i["non_worker_ranks"]) for i in info] == [[0, 1]] * 3
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


def _dask_mpi(tmp_path, name, n, *args):
    """``mpiexec -n n dask-mpi --scheduler-file ...`` in its own session, its output in a log."""
    log = open(tmp_path / f"{name}.log", "wb")
    cmd = [_mpiexec(), "-n", str(n), os.path.join(os.path.dirname(sys.executable), "dask-mpi"),
           "--scheduler-file", str(tmp_path / "scheduler.json"), "--nthreads", "1", "--no-dashboard", *args]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log


def _connect(tmp_path, n_workers):
    from distributed import Client

    sched = tmp_path / "scheduler.json"
    deadline = time.monotonic() + 60
    while not sched.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    client = Client(scheduler_file=str(sched), timeout=60)
    client.wait_for_workers(n_workers, timeout=60)
    return client


def _end(*jobs):
    """Stop the jobs as a user's Ctrl-C would (SIGINT to the session: killed at once, the Nanny's worker
    processes left their semaphores in /dev/shm, 12 a run); SIGKILL what is left after 20 s."""
    for proc, _ in jobs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
    for proc, log in jobs:
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


def test_dask_mpi_nanny_workers_are_refused_not_killed(tmp_path):
    """dask-mpi's default workers run under a Nanny: the worker process inherits the job's launcher variables
    without being a rank, and the MPI probe of bootstrap started MPI there, which aborted it (the Nanny
    restarted it, its data lost). Now bootstrap refuses at once, says what to pass, and no worker restarts."""
    import dask_pgas
    from dask_pgas.errors import PGASWorldError

    job = _dask_mpi(tmp_path, "nanny", 3)
    try:
        with _connect(tmp_path, 2) as client:
            before = set(client.scheduler_info()["workers"])
            with pytest.raises(PGASWorldError, match=r"run under a Nanny inside an MPI job.*--worker-class "
                                                     r"distributed.Worker"):
                dask_pgas.bootstrap(client)
            time.sleep(2)
            assert set(client.scheduler_info()["workers"]) == before
    finally:
        _end(job)


def test_workers_of_two_mpi_jobs_are_refused_at_once(tmp_path):
    """A second dask-mpi job adding workers (--no-scheduler) gives ranks that can all differ from the first
    job's: bootstrap took them for one job and waited in MPI until its timeout, leaving a broken world."""
    import dask_pgas
    from dask_pgas.errors import PGASWorldError

    first = _dask_mpi(tmp_path, "first", 2, "--worker-class", "distributed.Worker")  # scheduler + worker at rank 1
    jobs = [first]
    try:
        with _connect(tmp_path, 1) as client:
            jobs.append(_dask_mpi(tmp_path, "second", 1, "--worker-class", "distributed.Worker", "--no-scheduler"))
            client.wait_for_workers(2, timeout=60)  # the second job's worker is its rank 0
            t0 = time.monotonic()
            with pytest.raises(PGASWorldError, match=r"not processes of one MPI job \(their MPI jobs have sizes "
                                                     r"\[1, 2\]\)"):
                dask_pgas.bootstrap(client, timeout="60s")
            assert time.monotonic() - t0 < 20
    finally:
        _end(*jobs)
