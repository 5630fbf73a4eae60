"""Processes of a :class:`~dask_pgas.LocalMPICluster` exit when the process that started the cluster is gone.

The scheduler (as a ``--preload`` module) and every worker rank watch the launcher's PID, given in
``DASK_PGAS_LAUNCHER_PID``: a driver killed without closing its cluster (``kill``, a timeout, a crashed
kernel) leaves no scheduler or worker behind holding memory or a GPU.

MPICH 5 keeps named shared-memory files per job and node under ``/dev/shm`` (``mpich_shm_*``) until the rank
that made them finalizes; a job killed or interrupted before that leaves them behind. :func:`unlink_mpi_names`
unlinks them as soon as MPI is up on a worker (every worker rank of a ``LocalMPICluster`` at start, every worker
of a PGAS world at bootstrap, dask-mpi's included): the ranks keep their mappings and nothing is left to remove.
Orphaned, the scheduler and the worker ranks also remove the cluster's temporary directory (the scheduler's
``DASK_PGAS_CLUSTER_DIR``, the workers' local directory), whichever of them is still able to: a scheduler that
hangs leaves it to the ranks.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

ENV = "DASK_PGAS_LAUNCHER_PID"
DIR_ENV = "DASK_PGAS_CLUSTER_DIR"  # the scheduler's: the cluster's temporary directory, removed if orphaned


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (killed, not yet reaped by its parent) is gone too."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - exists, owned by someone else
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # (the name, in parentheses, may hold spaces)
    except FileNotFoundError:  # gone meanwhile; or no /proc at all (not Linux), and kill() said it exists
        return not os.path.isdir("/proc/self")
    except (OSError, IndexError):  # pragma: no cover
        return True


def mpi_shm_files(pids, deleted: bool = False) -> set[str]:
    """Named shared-memory files of the MPI library (``/dev/shm/mpich_*``) mapped by these processes; with
    ``deleted``, also those unlinked since, as ``/proc`` names them (``"<path> (deleted)"``)."""
    found: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    fields = line.split(maxsplit=5)
                    path = fields[5].rstrip("\n") if len(fields) == 6 else ""
                    if path.startswith("/dev/shm/mpich_") and (deleted or not path.endswith(" (deleted)")):
                        found.add(path)
        except OSError:  # gone, or not Linux
            pass
    return found


def unlink_mpi_names() -> None:
    """Unlink the named shared-memory files of this process's MPI job (MPICH 5's ``/dev/shm/mpich_shm_*``, and
    ``mpich_vci_*`` with several VCIs), keeping the mappings. Safe once MPI is initialized in the world model
    (``MPI_Init``, as mpi4py does it): every rank of the node mapped them during ``MPI_Init``, whose closing
    barrier runs through them, and nothing opens them by name later (in the sessions model, ``MPI.Session``, a
    rank that comes later would). The segments of windows (``mpich_shar_tmp*``) are left alone: MPICH unlinks
    each once every rank attached it. MPICH 4 unlinks its files itself; other MPIs make none."""
    for path in mpi_shm_files([os.getpid()]):
        if not os.path.basename(path).startswith("mpich_shar_tmp"):
            try:
                os.unlink(path)  # (the mappings stay valid until their processes unmap them)
            except OSError:  # another rank of the node unlinked it first
                pass


def watch_launcher(interval: float = 1.0, directory: str | None = None) -> None:
    """Start a daemon thread that ends this process once the launcher PID (if set) no longer exists; then it
    also removes ``directory`` (the cluster's temporary one, which the launcher would have removed at close)."""
    pid = int(os.environ.get(ENV, "0") or 0)
    if pid <= 0:
        return

    def loop() -> None:
        while _alive(pid):
            time.sleep(interval)
        # the launcher is gone: nobody will close this process (MPI's named file went at start)
        if directory:
            time.sleep(2 * interval)  # the other processes of the cluster (watching too) are gone by then
            shutil.rmtree(directory, ignore_errors=True)
        os._exit(0)

    threading.Thread(target=loop, name="dask-pgas-orphan-guard", daemon=True).start()


def dask_setup(scheduler) -> None:  # ``--preload`` hook of the scheduler process
    watch_launcher(directory=os.environ.get(DIR_ENV) or None)
