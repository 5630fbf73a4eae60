"""LocalMPICluster's start failures, restart_workers=False, the kill escalation, the worker ranks' own orphan
guard and the shared-memory files of restarted jobs. Each failed on a mutant of the launcher that the other tests
let through (a mutation review)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest

import dask_pgas
from dask_pgas.integration import _cluster
from dask_pgas.integration._orphan_guard import _alive

from ._mpi_files import mpi_names_unlinked

pytestmark = [pytest.mark.dask, pytest.mark.timeout(240)]


def test_kill_escalates_to_sigkill_for_a_process_that_ignores_sigterm():
    """_kill (close(), and a cluster dropped unclosed) must not leave a process that ignores SIGTERM (a rank
    stuck in a collective, a handler that swallows it) running."""
    proc = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                             "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint(flush=True)\ntime.sleep(120)"],
                            stdout=subprocess.PIPE, start_new_session=True)
    try:
        proc.stdout.readline()  # its handler is in place
        t0 = time.monotonic()
        _cluster._kill([proc], [])
        assert proc.poll() == -signal.SIGKILL
        assert time.monotonic() - t0 < 15
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.parametrize("what", ["scheduler", "workers"])
def test_a_failed_start_fails_fast_and_leaves_nothing(what, monkeypatch):
    """The scheduler (or the worker job) exits at start: the start fails at once, quoting it, and the processes
    already started and the temporary directory are gone when the error is raised (not when the half-made
    cluster is garbage-collected)."""
    import tempfile

    spawned, dirs = [], []
    spawn, mkdtemp = _cluster.LocalMPICluster._spawn, tempfile.mkdtemp
    monkeypatch.setattr(_cluster.LocalMPICluster, "_spawn",
                        lambda self, *a, **k: spawned.append(spawn(self, *a, **k)) or spawned[-1])
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: dirs.append(mkdtemp(*a, **k)) or dirs[-1])
    kwargs = {"n_workers": 1, "bootstrap": False, "timeout": 60}
    if what == "scheduler":
        monkeypatch.setattr(sys, "executable", "/bin/false")  # the scheduler's command fails at once
        match = "the scheduler exited at start"
    else:
        kwargs["mpiexec_args"] = "--no-such-flag"
        match = "worker job exited at start"
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=match) as failed:
        dask_pgas.LocalMPICluster(**kwargs)
    monkeypatch.undo()
    assert time.monotonic() - t0 < 15
    assert spawned and all(p.poll() is not None for p in spawned), [p.args[:3] for p in spawned]
    assert dirs and not os.path.exists(dirs[0])
    del failed


def test_a_worker_that_dies_in_the_bring_up_is_quoted_in_the_error(tmp_path, monkeypatch):
    """A rank that dies inside bootstrap's init shows to the scheduler as a closed connection only: the message
    asks whether the process died, the start's PGASWorldError adds the worker job's end (its exit and last output,
    where the cause is), and nothing is left."""
    import tempfile

    from dask_pgas.errors import PGASWorldError

    (tmp_path / "die_in_bring_up.py").write_text(
        "import os\n\n\ndef dask_setup(worker):\n"
        "    if worker.name != 'mpi-rank-1':\n        return\n"
        "    import dask_pgas\n\n"
        "    def die(*args, **kwargs):\n"
        "        print('stand-in: rank 1 died in the bring-up', flush=True)\n        os._exit(3)\n\n"
        "    dask_pgas.initialize = die\n")
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": path, "DASK_DISTRIBUTED__WORKER__PRELOAD": "['die_in_bring_up']"}
    dirs, mkdtemp = [], tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: dirs.append(mkdtemp(*a, **k)) or dirs[-1])
    with pytest.raises(PGASWorldError, match=r"(?s)bootstrap failed on .*CommClosedError.*did its process die\? "
                       r"Its output says why\nthe MPI worker job exited \(exit code [^0]\d*\); its output ends:.*"
                       r"stand-in: rank 1 died in the bring-up"):
        dask_pgas.LocalMPICluster(n_workers=2, backends=["mpi"], env=env, timeout=60)
    monkeypatch.undo()
    assert dirs and not os.path.exists(dirs[0])


def test_restart_workers_false_leaves_a_dead_worker_job_dead():
    """restart_workers=False: a rank that dies takes the MPI job down and no new job is started."""
    from distributed import Client

    with dask_pgas.LocalMPICluster(n_workers=2, bootstrap=False, restart_workers=False) as cluster, \
            Client(cluster) as client:
        victim = cluster.worker_pids()[0]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while cluster._workers.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cluster._workers.poll() is not None
        time.sleep(2)  # the watcher looks every 0.2 s
        assert cluster.restarts == 0 and len(cluster._procs) == 2
        assert not client.scheduler_info()["workers"]


def test_worker_ranks_watch_the_launcher_themselves():
    """The driver is killed while the scheduler cannot act on it (stopped here; busy or hung alike): the worker
    ranks, watching the launcher PID themselves, exit all the same, and remove the cluster's temporary directory
    (which only the scheduler removed: one was left in /tmp per run)."""
    import json

    program = ("import json, sys, time, dask_pgas\n"
               "c = dask_pgas.LocalMPICluster(n_workers=2, bootstrap=False)\n"
               "print(json.dumps([c._scheduler.pid, c.worker_pids(), c._dir]), flush=True)\n"
               "time.sleep(300)\n")
    driver = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
    scheduler = directory = None
    try:
        scheduler, ranks, directory = json.loads(driver.stdout.readline())
        os.kill(scheduler, signal.SIGSTOP)
        driver.kill()
        driver.wait(30)
        deadline = time.monotonic() + 15
        while (any(_alive(p) for p in ranks) or os.path.exists(directory)) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [p for p in ranks if _alive(p)]
        kept = os.path.exists(directory)
    finally:
        driver.kill()
        driver.wait()
        if scheduler is not None:
            os.kill(scheduler, signal.SIGKILL)
        if directory is not None:  # (when the test failed before the ranks removed it)
            shutil.rmtree(directory, ignore_errors=True)
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"worker ranks {left} outlived their launcher"
    assert not kept, f"the cluster's directory {directory} outlived it"


def test_a_restarted_worker_job_that_dies_too_leaves_no_shared_memory_files():
    """Every worker job, restarted ones too, unlinks MPICH's /dev/shm file as soon as its ranks are up: MPICH
    leaves it behind a killed job, and a job may die again."""
    from distributed import Client

    with dask_pgas.LocalMPICluster(n_workers=2, bootstrap=False) as cluster, Client(cluster) as client:
        for restarts in (1, 2):
            mpi_names_unlinked(cluster.worker_pids())
            os.kill(cluster.worker_pids()[0], signal.SIGKILL)
            deadline = time.monotonic() + 30
            while cluster.restarts < restarts and time.monotonic() < deadline:
                time.sleep(0.1)
            assert cluster.restarts == restarts
            while time.monotonic() < deadline + 30:  # the new job's ranks are the workers (past MPI_Init)
                try:
                    if sorted(client.run(os.getpid).values()) == sorted(cluster.worker_pids()):
                        break
                except Exception:  # a worker of the dead job, not yet removed
                    pass
                time.sleep(0.2)
            else:
                pytest.fail(f"the ranks of restarted job {restarts} did not all register")
        mpi_names_unlinked(cluster.worker_pids())


def test_more_workers_than_cores_under_mpich_4_warns_at_the_caller(monkeypatch):
    monkeypatch.setattr(_cluster, "_launcher", lambda mpiexec: ("mpich", 4))
    monkeypatch.setattr(_cluster, "CPU_COUNT", 1)
    with pytest.warns(RuntimeWarning, match="2 workers on 1 core with MPICH 4.x") as caught:
        cluster = dask_pgas.LocalMPICluster(n_workers=2, bootstrap=False)
    cluster.close()
    # (pytest.warns records every warning in the block, a background thread's too: the launcher's is the one)
    assert [w.filename for w in caught if "MPICH 4.x" in str(w.message)] == [__file__]


def test_auto_memory_limit_shares_the_machine_among_the_workers(client):
    """LocalMPICluster's default ``"auto"`` on CPU workers: the workers hold the machine's memory together, as
    LocalCluster's do. Each rank used to read ``"auto"`` alone (its share of the cores' memory): 4 workers on 2
    cores were given twice the machine, and Dask's spill, pause and terminate thresholds came far too late."""
    import logging

    from distributed.worker_memory import parse_memory_limit

    from ._xp import GPU_WORKERS, NWORKERS

    if GPU_WORKERS:
        pytest.skip("GPU workers get no host memory limit")
    if os.environ.get("DASK_PGAS_TEST_CLUSTER"):
        pytest.skip("not a LocalMPICluster")
    limits = list(client.run(lambda dask_worker: dask_worker.memory_manager.memory_limit).values())
    share = parse_memory_limit("auto", 1, NWORKERS, logger=logging.getLogger(__name__))
    assert limits == [share] * NWORKERS, (limits, share)


@pytest.mark.parametrize("address", [":0", "127.0.0.2:0", None, "", "without bokeh"])
def test_dashboard_and_logs_as_local_cluster_gives_them(address, monkeypatch):
    """The scheduler ran with --no-dashboard, always: no dashboard for notebook users. It now serves one where
    LocalCluster would (bokeh installed: the test extra has it), at ``dashboard_link``; ``dashboard_address=None``
    turns it off, and then the scheduler's HTTP server (/health, /metrics, ...) takes any free port, not 8787, which a
    dashboard elsewhere may want (distributed warned "Port 8787 is already in use" there). ``get_logs()`` gives
    the processes' output by name, as distributed's clusters do."""
    import contextlib
    import importlib.util
    import socket
    import urllib.request

    from distributed import Client

    held = contextlib.ExitStack()
    if not address:  # 8787 taken by someone else, where it can be taken here (as tornado binds: SO_REUSEADDR)
        taker = held.enter_context(socket.socket())
        taker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            taker.bind(("", 8787))
            taker.listen()
        except OSError:
            pass

    if address == "without bokeh":  # (the link is made here, in the process that has or lacks bokeh)
        address, find_spec = ":0", importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bokeh" else
                            find_spec(name, *a))
    elif address:
        assert importlib.util.find_spec("bokeh") is not None, "the test extra installs bokeh"
    with held, dask_pgas.LocalMPICluster(n_workers=1, dashboard_address=address, bootstrap=False) as cluster, \
            Client(cluster) as client:
        html = client._repr_html_()
        if not address:  # (the scheduler's HTTP server runs all the same, without the dashboard's pages)
            assert cluster.dashboard_link == "" and "off" in cluster._repr_html_()
            assert cluster._info["services"]["dashboard"] != 8787
            assert "already in use" not in cluster.get_logs()["scheduler"]  # (8787 is taken, here or elsewhere)
        elif importlib.util.find_spec("bokeh") is None:
            assert cluster.dashboard_link == "" and "it needs bokeh" in cluster._repr_html_()
        else:
            link = cluster.dashboard_link  # (on the host asked for: one that listens on 127.0.0.2 only was
            host = "127.0.0.2" if address.startswith("127.0.0.2") else "127.0.0.1"  # linked at 127.0.0.1)
            assert link.startswith(f"http://{host}:") and link in html, (link, html)
            with urllib.request.urlopen(link, timeout=30) as page:
                assert page.status == 200
        logs = cluster.get_logs()
        assert set(logs) == {"scheduler", "workers"} and "Scheduler at" in logs["scheduler"], list(logs)
        assert cluster.logs().startswith("--- scheduler ---\n")
    assert set(cluster.get_logs()) == {"scheduler", "workers"}  # (as they were at close)
    t0 = time.monotonic()  # (it waited for distributed's connect timeout, 30 s, and raised OSError)
    with pytest.raises(RuntimeError, match="LocalMPICluster is closed"):
        cluster.wait_for_workers(timeout=2)
    assert time.monotonic() - t0 < 2


def test_get_client_and_wait_for_workers_as_distributed_clusters_offer_them(client):
    """Notebook code written for distributed's clusters calls ``cluster.get_client()`` and
    ``cluster.wait_for_workers(n)``: they were missing. The current client of the cluster is returned, and a
    wait for more workers than the MPI job has is refused at once instead of timing out."""
    from distributed import Client

    from ._xp import NWORKERS

    cluster = client.cluster
    if not isinstance(cluster, dask_pgas.LocalMPICluster):
        pytest.skip("not a LocalMPICluster")
    with client.as_current():
        assert cluster.get_client() is client
    other = Client(cluster.scheduler_address, set_as_default=False)  # the current one when entered
    try:
        with other.as_current():
            assert cluster.get_client() is other
    finally:
        other.close()
    cluster.wait_for_workers()
    cluster.wait_for_workers(1, timeout=30)
    with pytest.raises(ValueError, match=f"has {NWORKERS} worker ranks"):
        cluster.wait_for_workers(NWORKERS + 1)
    client.wait_for_workers(NWORKERS, timeout=30)  # (distributed's client hands this to the cluster's method)
    with pytest.raises(ValueError, match=f"has {NWORKERS} worker ranks"):
        client.wait_for_workers(NWORKERS + 1, timeout=30)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="a positive number of workers"):
            cluster.wait_for_workers(bad)

    async def asynchronous() -> None:  # an asynchronous client's wait is awaited (it was None there)
        async with Client(cluster, asynchronous=True, set_as_default=False) as aclient:
            await aclient.wait_for_workers(NWORKERS, timeout=30)
            await cluster.wait_for_workers(1, timeout=30)
        # a plain call where an event loop runs (Jupyter's cells): it waits, it does not hand back a coroutine
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # ("coroutine ... was never awaited")
            assert not asyncio.iscoroutine(cluster.wait_for_workers(NWORKERS, timeout=30))
            with pytest.raises(ValueError, match=f"has {NWORKERS} worker ranks"):
                cluster.wait_for_workers(NWORKERS + 1)

    asyncio.run(asynchronous())
