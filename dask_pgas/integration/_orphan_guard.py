"""Processes of a :class:`~dask_pgas.LocalMPICluster` exit when the process that started the cluster is gone.

The scheduler (as a ``--preload`` module) and every worker rank watch the launcher's PID, given in
``DASK_PGAS_LAUNCHER_PID``: a driver killed without closing its cluster (``kill``, a timeout, a crashed
kernel) leaves no scheduler or worker behind holding memory or a GPU.
"""

from __future__ import annotations

import os
import threading
import time

ENV = "DASK_PGAS_LAUNCHER_PID"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - exists, owned by someone else
        return True
    return True


def watch_launcher(interval: float = 1.0) -> None:
    """Start a daemon thread that ends this process once the launcher PID (if set) no longer exists."""
    pid = int(os.environ.get(ENV, "0") or 0)
    if pid <= 0:
        return

    def loop() -> None:
        while _alive(pid):
            time.sleep(interval)
        os._exit(0)  # the launcher is gone: nobody will close this process (and MPI may not finalize)

    threading.Thread(target=loop, name="dask-pgas-orphan-guard", daemon=True).start()


def dask_setup(scheduler) -> None:  # ``--preload`` hook of the scheduler process
    watch_launcher()
