"""GPU tests (marker ``gpu``): skipped cleanly unless a CUDA GPU, CuPy and the NVSHMEM/cuFFTMp libraries are
present. They launch the programs in ``tests/gpu/programs`` under mpirun/mpiexec (1 and 2 PEs on the visible
GPUs; several PEs may share one GPU) with a timeout each."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.mpirun import check, run_mpi

pytestmark = pytest.mark.gpu

PROGRAMS = Path(__file__).parent / "programs"


def _reason() -> str | None:
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


_why = _reason()
if _why is not None:
    pytest.skip(f"GPU engine unavailable: {_why}", allow_module_level=True)


@pytest.mark.parametrize("nranks", [1, 2])
def test_gpu_checks(nranks):
    check(run_mpi(PROGRAMS / "gpu_checks.py", nranks, timeout=240), nranks)


@pytest.mark.parametrize("nranks", [1, 2])
def test_uniqueid_bringup_without_mpi(nranks, tmp_path):
    check(run_mpi(PROGRAMS / "uid_checks.py", nranks, str(tmp_path / "uid.bin"), timeout=240), nranks)
