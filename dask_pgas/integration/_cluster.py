"""``LocalMPICluster``: a scheduler plus N MPI worker ranks on this machine, for laptops, CI and notebooks.

The scheduler runs as a subprocess (``python -m distributed.cli.dask_scheduler``); the workers are one MPI job
(``mpiexec -n N python -m dask_pgas.integration._worker_main``) with the ``mpiexec`` found next to the Python
interpreter or on ``PATH``. Output of both goes to log files (``cluster.logs()``), so closing prints nothing.
On start the PGAS world is bootstrapped (``bootstrap=False`` to skip). ``close()`` tears the world down
collectively, shuts the scheduler and workers down and kills whatever is left: no processes stay behind, and
if the launching process dies without closing, the scheduler and workers notice within a second and exit a
few seconds later.
The worker ranks unlink MPICH's per-job shared-memory file in ``/dev/shm`` as soon as MPI is up, so that a
killed job leaves none behind.
A cluster that is dropped without ``close()`` (garbage-collected, or the interpreter exits) has its processes
killed; its temporary directory (logs, scheduler file, worker spill space) is removed then and at ``close()``
(``cluster.logs()`` keeps working: it returns what the logs held at close).
GPU workers (``gpus=N``) get no host memory limit by default (``memory_limit=None``): Dask sizes CuPy chunks as
if they were host memory and would spill or pause on device bytes; CPU workers default to ``"auto"``.
The scheduler and the workers start with the Dask config of the process that makes the cluster, as a Nanny's
worker or an ``SSHCluster`` does (``DASK_INTERNAL_INHERIT_CONFIG``): ``pgas.*`` keys set with
``dask.config.set`` before the cluster starts apply there; ``DASK_*`` variables (in ``env`` or the
environment) win over it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import operator
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

from dask.system import CPU_COUNT  # (affinity and cgroup quotas counted)
from distributed.core import Status

from ..errors import PGASWorldError
from . import _orphan_guard
from ._config import MAX_SECONDS

__all__ = ["LocalMPICluster"]


def _mpiexec() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(here):
        return here
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if found is None:
        raise RuntimeError("mpiexec not found: pip install mpich (or load your MPI module)")
    return found


def _launcher(mpiexec: str) -> tuple[str, int | None]:
    """``("openmpi" | "mpich" | "", major version or None)`` from ``mpiexec --version`` (hydra prints
    ``Version: 5.0.2``, Open MPI ``mpiexec (Open MPI) 5.0.3`` or ``(OpenRTE) 4.1.6``)."""
    try:
        version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30,
                                 stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.SubprocessError):
        return "", None
    if "Open MPI" in version or "OpenRTE" in version:
        kind, found = "openmpi", re.search(r"\((?:Open MPI|OpenRTE)\)\s*(\d+)\.", version)
    elif "HYDRA" in version:
        kind, found = "mpich", re.search(r"^\s*Version:\s*(\d+)\.", version, re.M)
    else:
        return "", None
    return kind, int(found.group(1)) if found else None


def _oversubscription_warning(launcher: tuple[str, int | None], n_workers: int, cores: int) -> str | None:
    """Why ``n_workers`` ranks will crawl on ``cores`` cores with this launcher's MPI, or None: MPICH before 5.0
    spins in every wait, so ranks beyond the cores starve the ones with work (a 512 MiB ``Alltoall`` on 4 ranks
    of 2 cores: 668 ms with MPICH 4.2.3, 36 ms with 5.0.2)."""
    kind, major = launcher
    if kind != "mpich" or major is None or major >= 5 or n_workers <= cores:
        return None
    return (f"LocalMPICluster: {n_workers} workers on {cores} core{'s' if cores != 1 else ''} with MPICH {major}.x, "
            "whose ranks spin while they wait: collectives will run many times slower than with one worker per "
            f"core; use at most {cores} workers, or MPICH 5 or later (pip install 'mpich>=5')")


def _launcher_env(kind: str, env: dict[str, str]) -> dict[str, str]:
    """``env`` plus the defaults of a launcher of this ``kind`` (:func:`_launcher`; the caller's own settings win).

    Open MPI's ``mpiexec`` binds each rank to ONE core when it starts two ranks or fewer (and to a socket
    otherwise). A Dask worker is several threads (event loop, task threads, the collective thread, CUDA's):
    pinned to one core they take turns, and every scheduler round trip gets slower. Workers are left unbound
    (``OMPI_MCA_hwloc_base_binding_policy=none``, i.e. ``--bind-to none``); MPICH's hydra binds nothing by
    default.
    """
    env = dict(env)
    if kind == "openmpi":
        env.setdefault("OMPI_MCA_hwloc_base_binding_policy", "none")
    return env


_LOG_TAIL = 1 << 20  # bytes of each log kept by ``logs()`` after close
_ERROR_TAIL = 4000  # characters of a log quoted in a start error


def _read_log(path: str, limit: int = _LOG_TAIL) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - limit))
        text = f.read().decode(errors="replace")
    return text if size <= limit else f"[... {size - limit} bytes left out ...]\n{text}"


def _stop_client(client) -> None:
    """Close ``client`` and stop its IO-loop thread.

    ``Client.shutdown()`` leaves the client closed, so a later ``Client.close()`` returns at once without stopping the
    loop thread it started (distributed 2026.8 has no public call for that): each close would leak a thread and
    its sockets. ``LoopRunner.stop()`` only stops a loop the runner created itself."""
    try:
        client.close(timeout=10)
    except Exception:
        pass
    runner = getattr(client, "_loop_runner", None)
    if runner is not None:
        try:
            runner.stop()
        except Exception:  # pragma: no cover
            pass


def _kill(procs: list, logs: list) -> None:
    """SIGTERM, then SIGKILL, every process group still running; close the logs. An interrupt during the wait
    after SIGTERM still sends the SIGKILL."""

    def signal_and_wait(sig) -> None:
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        for p in alive:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass

    try:
        signal_and_wait(signal.SIGTERM)
    finally:
        signal_and_wait(signal.SIGKILL)
        for log in logs:
            log.close()


def _cleanup(stop: threading.Event, lock: threading.RLock, procs: list, logs: list, directory: str) -> None:
    """The end of a cluster (``close()``, or a cluster dropped unclosed): stop the watcher, kill what is left and
    remove the temporary directory. Holds no reference to the cluster (``weakref.finalize``)."""
    with lock:  # the watcher starts no new worker job after this
        stop.set()
    try:
        _kill(procs, logs)
    finally:  # (a second Ctrl-C inside the kill's waits: this runs once, so the directory goes now or never)
        shutil.rmtree(directory, ignore_errors=True)


def _watch(ref: weakref.ref, stop: threading.Event, lock: threading.RLock) -> None:
    """The watcher thread: holds the cluster only for one step, so an unreferenced cluster is collected."""
    while not stop.wait(0.2):
        with lock:
            if stop.is_set():
                return
            cluster = ref()
            if cluster is None:
                return
            try:
                cluster._watch_step()
            finally:
                del cluster  # (the cluster's finalizer may run here, in this thread, once the lock is released)


def _inherited_config() -> dict[str, str]:
    """The variable that hands this process's Dask config to the cluster's processes (only the ``pgas`` keys
    when the rest holds values JSON cannot carry)."""
    import dask

    for config in (dask.config.global_config, {"pgas": dask.config.get("pgas", {})}):
        try:
            return {"DASK_INTERNAL_INHERIT_CONFIG": dask.config.serialize(config)}
        except (TypeError, ValueError):
            continue
    return {}


def _check_arguments(n_workers: Any, threads_per_worker: Any, memory_limit: Any, gpus: Any, timeout: Any) -> None:
    """Refuse, before anything starts, what the scheduler or the worker job would fail on only later (or take
    silently: ``threads_per_worker=0`` is "all cores", ``gpus=1`` on a machine without GPUs started CPU workers)."""
    from distributed.worker_memory import parse_memory_limit

    for name, value, least in (("n_workers", n_workers, 1), ("threads_per_worker", threads_per_worker, 1),
                               ("gpus", gpus, 0)):
        try:
            ok = not isinstance(value, bool) and operator.index(value) >= least
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and 0 < timeout <= MAX_SECONDS):
        raise ValueError(f"timeout must be a positive number of seconds (at most {MAX_SECONDS:.0e}), got {timeout!r}")
    try:  # as each worker will read it
        limit = parse_memory_limit(memory_limit, int(threads_per_worker), logger=logging.getLogger(__name__))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"memory_limit={memory_limit!r}: {exc} (a size such as '4GiB', a fraction of the "
                         "memory, 'auto', or 0 for none)") from None
    if limit is not None and limit < 0:
        raise ValueError(f"memory_limit={memory_limit!r} is negative (0 means no limit)")
    if gpus:
        from ..bindings.cuda import driver

        try:
            visible, why = driver().device_count(), ""
        except Exception as exc:  # no CUDA driver
            visible, why = 0, f" ({exc})"
        if visible < gpus:
            raise ValueError(f"gpus={gpus}, but this machine shows {visible} GPU{'s' if visible != 1 else ''}{why}; "
                             "gpus=0 starts CPU workers")


class _Done:
    """``close()``'s and ``wait_for_workers()``'s result inside an event loop, done already: ``Client.shutdown``
    awaits ``cluster.close()``, an asynchronous client's ``wait_for_workers`` the cluster's."""

    def __await__(self):
        return iter(())

    def _ipython_display_(self) -> None:
        """Nothing shown for it in Jupyter, whose cells run inside an event loop: ``cluster.close()`` as a
        cell's last line displayed ``<..._Done at 0x...>`` (a synchronous distributed cluster returns None)."""


def _done_for_caller() -> _Done | None:
    """What a call that finished synchronously returns: an awaitable already done where an event loop runs in
    this thread (a coroutine may await it), else None."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return None
    return _Done()


class LocalMPICluster:
    """A local Dask cluster whose workers are the ranks of one MPI job.

    >>> with LocalMPICluster(n_workers=4) as cluster, Client(cluster) as client:   # doctest: +SKIP
    ...     y = dask_pgas.rechunk(x, (1000, -1)).persist()

    Args:
        n_workers: MPI ranks of the worker job, one ``distributed.Worker`` each (one PE each). Fixed for the
            cluster's life: an MPI job does not grow or shrink (``scale`` to another size and ``adapt`` raise).
        threads_per_worker: task threads per worker (the collective runs on a thread of its own).
        memory_limit: each worker's memory limit, as ``distributed.Worker`` reads it, except ``"auto"``, which
            shares the machine's memory among the workers as ``LocalCluster`` does; None: ``"auto"`` for CPU
            workers, none for GPU workers.
        bootstrap: bring the PGAS world up on start (:func:`dask_pgas.bootstrap`).
        backends: the world's backends (default config ``pgas.backends``).
        mpiexec_args: extra arguments for ``mpiexec`` before ``-n``: a sequence of strings, or one string split
            as a shell would (``"--bind-to none"``).
        env: environment variables for the scheduler and the workers (strings), over this process's.
        timeout: seconds to wait for the scheduler and the workers (the bootstrap waits config
            ``pgas.bootstrap-timeout``).
        restart_workers: start a new worker job when the running one ends (a rank died): MPI takes the whole
            job down; the world then must be bootstrapped again.
        gpus: the GPUs to use: worker ``k`` sees GPU ``k mod gpus`` as its device 0 (of this process's
            ``CUDA_VISIBLE_DEVICES`` when set: entry ``k mod gpus`` of it), so more workers than GPUs share
            them; 0 for CPU workers.
        dashboard_address: where the scheduler serves Dask's dashboard, as ``LocalCluster`` takes it (``":8787"``,
            another port when that one is taken; ``":0"`` any port); None: no dashboard. It needs ``bokeh``
            (``pip install bokeh``); without it the scheduler runs without one and :attr:`dashboard_link` is
            empty. (The scheduler's HTTP server, ``/health`` and ``/metrics`` among its routes, runs either way:
            without a dashboard on any free port of 127.0.0.1.)

    Not a ``distributed.deploy.Cluster``: besides ``Client(cluster)`` it offers ``scheduler_address``,
    ``dashboard_link``, ``get_client()``, ``wait_for_workers()``, ``get_logs()`` / ``logs()``, ``worker_pids()``,
    ``close()``, ``world``, and ``scale``/``adapt`` only to refuse another size.
    """

    def __init__(
        self,
        n_workers: int = 2,
        *,
        threads_per_worker: int = 1,
        memory_limit: str | None = None,
        bootstrap: bool = True,
        backends: Any = None,
        mpiexec_args: str | Sequence[str] = (),
        env: dict[str, str] | None = None,
        timeout: float = 120.0,
        restart_workers: bool = True,
        gpus: int = 0,
        dashboard_address: str | None = ":8787",
    ) -> None:
        if memory_limit is None:  # Dask counts CuPy chunks as host memory: no host limit to spill them by
            memory_limit = "0" if gpus else "auto"
        _check_arguments(n_workers, threads_per_worker, memory_limit, gpus, timeout)
        if memory_limit == "auto":  # the machine's memory shared among the workers, as LocalCluster does (each
            # worker alone would take its share of the cores' memory: 4 workers on 2 cores, twice the machine's)
            from distributed.worker_memory import parse_memory_limit

            memory_limit = str(parse_memory_limit("auto", 1, n_workers, logger=logging.getLogger(__name__)) or 0)
        if isinstance(mpiexec_args, str):  # (unpacked as is, it gave mpiexec one argument per character)
            mpiexec_args = shlex.split(mpiexec_args)
        try:
            mpiexec_args = tuple(mpiexec_args)  # (a generator is read once, here)
        except TypeError:
            mpiexec_args = (mpiexec_args,)
        if not all(isinstance(a, str) for a in mpiexec_args):
            raise ValueError(f"mpiexec_args must be strings (a sequence, or one string), got {mpiexec_args!r}")
        if dashboard_address is not None and not isinstance(dashboard_address, str):
            raise ValueError(f"dashboard_address must be a string such as ':8787' (or None for no dashboard), got "
                             f"{dashboard_address!r}")
        bad_env = [(k, v) for k, v in (env or {}).items()
                   if not (isinstance(k, str) and isinstance(v, (str, bytes, os.PathLike)))]
        if bad_env:
            raise ValueError(f"env must map variable names to strings, got {dict(bad_env)!r} (write numbers as "
                             "'1', not 1)")
        self.n_workers = n_workers
        self._timeout = timeout
        self._dashboard_address = dashboard_address
        self.status = Status.created
        self.world = None
        self.restarts = 0
        self._restart_workers = restart_workers
        self._watcher: threading.Thread | None = None
        self._closed_logs: dict[str, str] | None = None
        self._dir = tempfile.mkdtemp(prefix="dask-pgas-cluster-")
        self.scheduler_file = os.path.join(self._dir, "scheduler.json")
        self._env = {**os.environ, **_inherited_config(), **(env or {})}
        self._env.setdefault("PYTHONUNBUFFERED", "1")
        self._env[_orphan_guard.ENV] = str(os.getpid())  # scheduler and workers exit if this process dies
        if gpus:  # worker k sees only GPU (node-local rank k mod gpus), as its device 0
            self._env["DASK_PGAS_BIND_GPUS"] = str(gpus)
        self._procs: list[subprocess.Popen] = []
        self._logs: list = []
        self._stop = threading.Event()
        self._lock = threading.RLock()
        # the cleanup runs once: at close(), when the cluster is garbage-collected, or at interpreter exit
        self._finalizer = weakref.finalize(self, _cleanup, self._stop, self._lock, self._procs, self._logs,
                                           self._dir)
        try:
            self._scheduler = self._spawn(
                "scheduler",
                [sys.executable, "-m", "distributed.cli.dask_scheduler", "--scheduler-file", self.scheduler_file,
                 "--host", "127.0.0.1", "--port", "0",
                 # (without a dashboard the scheduler still serves HTTP routes, /health and /metrics among them, at
                 # 8787 unless told otherwise: any free local port then, taking none a dashboard elsewhere wants)
                 *(("--dashboard-address", dashboard_address) if dashboard_address else
                   ("--dashboard-address", "127.0.0.1:0", "--no-dashboard")),
                 "--preload", "dask_pgas.integration._orphan_guard"],
                {**self._env, _orphan_guard.DIR_ENV: self._dir},  # removed by the scheduler if orphaned
            )
            self._wait_for_file(timeout)
            mpiexec = _mpiexec()
            launcher = _launcher(mpiexec)
            self._worker_env = _launcher_env(launcher[0], self._env)
            slow = _oversubscription_warning(launcher, n_workers, CPU_COUNT)
            if slow:
                warnings.warn(slow, RuntimeWarning, stacklevel=2)
            self._worker_cmd = [
                mpiexec, *mpiexec_args, "-n", str(n_workers), sys.executable,
                "-m", "dask_pgas.integration._worker_main", "--scheduler-file", self.scheduler_file,
                "--nthreads", str(threads_per_worker), "--memory-limit", str(memory_limit),
                "--local-directory", self._dir,
            ]
            self._workers = self._spawn("workers", self._worker_cmd, self._worker_env)
            from distributed import Client

            with Client(self.scheduler_address, timeout=timeout, set_as_default=False) as client:
                self._wait_for_workers(client, timeout)
                if bootstrap:
                    from ._client import bootstrap as _bootstrap

                    try:
                        self.world = _bootstrap(client, backends=backends)
                    except PGASWorldError as exc:  # (a worker that died in the bring-up shows as a closed comm)
                        raise PGASWorldError(f"{exc}\n{self._workers_output()}") from None
            self.status = Status.running
            self._watcher = threading.Thread(target=_watch, args=(weakref.ref(self), self._stop, self._lock),
                                             name="LocalMPICluster-watch", daemon=True)
            self._watcher.start()
        except BaseException:
            self.status = Status.closed
            self._finalizer()  # the error quotes the logs: the directory goes
            raise

    # ------------------------------------------------------------------ processes
    def _watch_step(self) -> None:
        """One MPI rank dying takes the whole MPI job down (MPICH's hydra kills the others): start a new job
        of workers, so the cluster keeps computing; the PGAS world stays broken until bootstrapped again."""
        if self._scheduler.poll() is not None and self.status == Status.running:
            # workers started now would wait for it for ever: the cluster is done (close() cleans up)
            self.status = Status.failed
            logging.getLogger(__name__).warning(
                "LocalMPICluster: the scheduler exited (code %s); close this cluster and start a new one",
                self._scheduler.returncode)
        if self._workers.poll() is None:
            return
        if self.status != Status.running or not self._restart_workers:
            return
        self.restarts += 1
        self._workers = self._spawn(f"workers-{self.restarts}", self._worker_cmd, self._worker_env)

    def _spawn(self, what: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(os.path.join(self._dir, f"{what}.log"), "wb")
        self._logs.append(log)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self._env if env is None else env,
                                start_new_session=True, stdin=subprocess.DEVNULL)
        self._procs.append(proc)
        return proc

    def _log_tail(self, what: str) -> str:
        try:
            return _read_log(os.path.join(self._dir, f"{what}.log"), _ERROR_TAIL)
        except OSError:
            return ""

    def _workers_output(self, wait: float = 3.0) -> str:
        """The MPI worker job's state and last output, for an error of the bring-up: given ``wait`` seconds to
        exit, as the job does when one of its ranks died (its launcher then stops the others)."""
        try:
            code = self._workers.wait(wait)
        except subprocess.TimeoutExpired:
            state = "is still running"
        else:
            state = f"exited (exit code {code})"
        return f"the MPI worker job {state}; its output ends:\n{self._log_tail('workers')}"

    def _wait_for_file(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._scheduler.poll() is not None:
                raise RuntimeError(f"the scheduler exited at start:\n{self._log_tail('scheduler')}")
            try:
                with open(self.scheduler_file) as f:
                    self._info = json.load(f)
                return
            except (OSError, ValueError):
                time.sleep(0.05)
        raise TimeoutError(f"no scheduler after {timeout}s:\n{self._log_tail('scheduler')}")

    def _wait_for_workers(self, client, timeout: float) -> None:
        """Wait for ``n_workers`` workers; fail at once, quoting its output, if the worker job (or the scheduler)
        exits first (a bad ``mpiexec_args`` or ``memory_limit``)."""
        try:
            from distributed.exceptions import WorkerStartTimeoutError
        except ImportError:  # distributed < 2025.10 raises its (asyncio) TimeoutError
            from distributed import TimeoutError as WorkerStartTimeoutError

        deadline = time.monotonic() + timeout
        while True:
            for proc, what in ((self._workers, "workers"), (self._scheduler, "scheduler")):
                if proc.poll() is not None:
                    raise RuntimeError(f"the {'MPI worker job' if what == 'workers' else what} exited at start "
                                       f"(exit code {proc.returncode}):\n{self._log_tail(what)}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.n_workers} workers did not start within {timeout}s:\n"
                                   f"{self._log_tail('workers')}")
            try:
                client.wait_for_workers(self.n_workers, timeout=min(left, 0.5))
                return
            except WorkerStartTimeoutError:
                pass

    @property
    def scheduler_address(self) -> str:
        return self._info["address"]

    @property
    def dashboard_link(self) -> str:
        """The dashboard's address (Dask's ``distributed.dashboard.link`` template), or "" without one."""
        import importlib.util

        from distributed.utils import clean_dashboard_address, format_dashboard_link

        # (the scheduler's HTTP server, named "dashboard", also runs without bokeh, serving only /health and
        # /metrics; the scheduler runs in this environment, so it has bokeh where this process has it)
        port = getattr(self, "_info", {}).get("services", {}).get("dashboard")
        if not port or not self._dashboard_address or importlib.util.find_spec("bokeh") is None:
            return ""
        # the host it was asked to listen on, where that is one host (as LocalCluster's link); every interface
        # (":8787", "0.0.0.0:0") is reached through the loopback
        host = clean_dashboard_address(self._dashboard_address)[0]["address"]
        return format_dashboard_link(host if host not in ("", "0.0.0.0", "::", "[::]") else "127.0.0.1", port)

    def scale(self, n: int) -> None:
        """The workers are the ranks of one MPI job: only their number is accepted."""
        if n != self.n_workers:
            raise NotImplementedError(
                f"a LocalMPICluster's {self.n_workers} workers are the ranks of one MPI job, which cannot grow or "
                f"shrink: close it and start LocalMPICluster(n_workers={n})"
            )

    def adapt(self, *args, **kwargs) -> None:
        """Refused: the workers are one MPI job of a fixed size (see :meth:`scale`)."""
        raise NotImplementedError(
            "a LocalMPICluster's workers are the ranks of one MPI job of a fixed size: it cannot adapt"
        )

    def get_client(self):
        """This process's current client of this cluster, else a new ``Client(self)`` (as
        ``distributed.deploy.Cluster.get_client``)."""
        from distributed import Client

        try:
            current = Client.current()
        except ValueError:
            current = None
        if current is not None and current.scheduler is not None and current.status == "running" \
                and current.scheduler.address == self.scheduler_address:
            return current
        return Client(self)

    def wait_for_workers(self, n_workers: int | None = None, timeout: float | None = None):
        """Block until ``n_workers`` (default: all of the MPI job's) are connected to the scheduler, as
        ``distributed.deploy.Cluster.wait_for_workers`` (``client.wait_for_workers`` of a client of this cluster
        calls it); more than the job has can never come and is refused. (Construction already waited for every
        rank; after a rank died, the restarted worker job comes back.)"""
        n = self.n_workers if n_workers is None else n_workers
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"wait_for_workers(n_workers={n_workers!r}): a positive number of workers")
        if n > self.n_workers:
            raise ValueError(f"wait_for_workers(n_workers={n_workers!r}): this LocalMPICluster's MPI job has "
                             f"{self.n_workers} worker ranks, and cannot grow (see scale())")
        if self.status != Status.running:
            raise RuntimeError(f"wait_for_workers: the LocalMPICluster is {self.status.name}")
        from distributed import Client

        # by address (a client of the cluster object would call this method again), connecting within the wait
        with Client(self.scheduler_address, timeout=timeout if timeout is not None else self._timeout,
                    set_as_default=False) as client:
            client.wait_for_workers(n, timeout=timeout)
        # Waited here, also where an event loop runs in this thread: in Jupyter (whose cells run inside one) a
        # coroutine would be dropped unawaited, and no wait would happen. An asynchronous client's
        # ``await client.wait_for_workers(n)`` (which distributed hands to this method) awaits the done result.
        return _done_for_caller()

    def get_logs(self) -> dict[str, str]:
        """The scheduler's and the worker jobs' output by process: ``"scheduler"``, ``"workers"`` (the MPI job's
        ranks together), then ``"workers-1"``... for restarted jobs (after ``close()``: what it was then, the last
        MiB each). Like ``distributed.deploy.Cluster.get_logs``, a dict of texts, but keyed by process, not by
        ``"Scheduler"`` and worker address."""
        if self._closed_logs is not None:
            return dict(self._closed_logs)
        out = {}
        for name in ("scheduler", "workers", *(f"workers-{i}" for i in range(1, self.restarts + 1))):
            try:
                out[name] = _read_log(os.path.join(self._dir, f"{name}.log"))
            except OSError:
                pass
        return out

    def logs(self) -> str:
        """:meth:`get_logs` as one text, each process's output under a ``--- name ---`` line."""
        return "\n".join(f"--- {name} ---\n{text}" for name, text in self.get_logs().items())

    def worker_pids(self) -> list[int]:
        """PIDs of the MPI worker processes (children of mpiexec, or of its per-node proxy)."""
        pids = []
        try:
            out = subprocess.run(["pgrep", "-P", str(self._workers.pid)], capture_output=True, text=True).stdout
        except OSError:  # pragma: no cover
            return pids
        for child in out.split():
            grand = subprocess.run(["pgrep", "-P", child], capture_output=True, text=True).stdout.split()
            pids.extend(int(g) for g in grand) if grand else pids.append(int(child))
        return pids

    # ------------------------------------------------------------------ closing
    def close(self, timeout: float = 30.0) -> None:
        """Tear the world down, shut the scheduler and workers down, kill what is left and remove the temporary
        directory. Interrupted (Ctrl-C), it still kills every process; closing again is a no-op. (Called from a
        coroutine, as ``Client.shutdown`` does, it returns an awaitable that is already done.)"""
        self._close(timeout)
        return _done_for_caller()

    def _close(self, timeout: float) -> None:
        if self.status == Status.closed:
            return
        self.status = Status.closing
        try:
            with self._lock:  # the watcher starts no new worker job from here on
                self._stop.set()
            if self._watcher is not None and self._watcher is not threading.current_thread():
                self._watcher.join(5)
            deadline = time.monotonic() + timeout
            if self._scheduler.poll() is None:
                self._shutdown(timeout)
            else:  # nobody tells the workers to go: they would wait for their scheduler until killed
                deadline = time.monotonic()
            for proc in self._procs:
                try:
                    proc.wait(max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    pass
        finally:
            try:
                _kill(self._procs, self._logs)
                self._closed_logs = self.get_logs()
            finally:
                self._finalizer()
                self.status = Status.closed

    def _shutdown(self, timeout: float) -> None:
        """Tear an intact world down (collectively) and shut the scheduler and workers down, through a client
        that is not made the default one and whose IO-loop thread ends with it. The teardown gets what is left
        of ``timeout`` (an unresponsive worker held close() for the scheduler's own 120 s); the processes are
        killed after it either way."""
        from distributed import Client

        from ._client import world

        start = time.monotonic()
        try:
            client = Client(self.scheduler_address, timeout=min(10, timeout), set_as_default=False)
        except Exception:
            return
        try:
            try:
                w = world(client)
                if w is not None and not w.broken:
                    left = max(timeout - (time.monotonic() - start), 1.0)
                    client.sync(client.scheduler.pgas_teardown, callback_timeout=left)
            except Exception:
                pass
            try:
                client.shutdown()
            except Exception:
                pass
        finally:
            _stop_client(client)

    def __enter__(self) -> LocalMPICluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        addr = getattr(self, "_info", {}).get("address", "?")
        return f"LocalMPICluster({addr!r}, workers={self.n_workers}, status={self.status.name})"

    def _repr_html_(self) -> str:
        """Jupyter (and ``Client._repr_html_``, which embeds it)."""
        import html

        rows = [
            ("Scheduler", getattr(self, "_info", {}).get("address", "?")),
            ("Workers", f"{self.n_workers} MPI ranks" + (f" ({self.restarts} restarts)" if self.restarts else "")),
            ("Status", self.status.name),
            ("Dashboard", self.dashboard_link or ("off" if not self._dashboard_address
                                                  else "not running (it needs bokeh)")),
            ("PGAS world at start", "not bootstrapped" if self.world is None else
             f"#{self.world.epoch}, {self.world.npes} PEs, {', '.join(self.world.backends)}"),
        ]
        body = "".join(f"<tr><th style='text-align: left;'>{html.escape(k)}</th>"
                       f"<td style='text-align: left;'>{html.escape(str(v))}</td></tr>" for k, v in rows)
        return f"<div><strong>{html.escape(type(self).__name__)}</strong><table>{body}</table></div>"
