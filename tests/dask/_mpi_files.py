"""MPICH's per-job shared-memory file in /dev/shm, as the tests look at it."""

from __future__ import annotations

import os


def _mpich() -> bool:
    """An MPICH (hydra) launcher of 5.0 or later: MPICH 4.x unlinks its /dev/shm files as soon as every rank has
    mapped them, so only from 5.0 on does a job hold named files that a killed job would leave behind."""
    from dask_pgas.integration._cluster import _launcher, _mpiexec

    kind, major = _launcher(_mpiexec())
    return kind == "mpich" and (major is None or major >= 5)


def mpi_names_unlinked(pids) -> None:
    """The ranks unlinked MPICH's named files of their job as soon as MPI was up (a killed or interrupted job
    leaves none in /dev/shm): they map them, as deleted, and /dev/shm has no name of theirs (the segments of
    windows, ``mpich_shar_tmp*``, are MPICH's own to unlink)."""
    from dask_pgas.integration._orphan_guard import mpi_shm_files

    mapped = {path for path in mpi_shm_files(pids, deleted=True) if "/mpich_shar_tmp" not in path}
    named = [path for path in mapped if not path.endswith(" (deleted)") and os.path.exists(path)]
    assert not named, mapped
    assert mapped or not _mpich(), f"no MPICH file mapped by {pids}"
