"""GPU tests; :func:`unavailable_reason` decides whether they run here."""

from __future__ import annotations

import shutil


def unavailable_reason() -> str | None:
    """Why the GPU engine's tests cannot run on this machine (None when they can)."""
    try:
        from dask_pgas.engines.nvshmem import NVSHMEMEngine
    except ImportError as exc:  # pragma: no cover
        return str(exc)
    if shutil.which("mpirun") is None and shutil.which("mpiexec") is None:
        return "no mpirun/mpiexec on PATH"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "the GPU programs use CuPy"
    return NVSHMEMEngine.unavailable_reason()
