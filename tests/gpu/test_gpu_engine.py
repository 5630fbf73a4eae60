"""GPU tests (marker ``gpu``): skipped cleanly unless a CUDA GPU, CuPy and the NVSHMEM/cuFFTMp libraries are
present. They launch the programs in ``tests/gpu/programs`` under mpirun/mpiexec (1 and 2 PEs on the visible
GPUs; several PEs may share one GPU) with a timeout each."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu import unavailable_reason
from tests.mpirun import check, run_mpi

pytestmark = pytest.mark.gpu

PROGRAMS = Path(__file__).parent / "programs"


_why = unavailable_reason()
if _why is not None:
    pytest.skip(f"GPU engine unavailable: {_why}", allow_module_level=True)


@pytest.mark.parametrize("nranks", [1, 2])
def test_gpu_checks(nranks):
    check(run_mpi(PROGRAMS / "gpu_checks.py", nranks, timeout=240), nranks)


@pytest.mark.parametrize("nranks", [1, 2])
def test_uniqueid_bringup_without_mpi(nranks, tmp_path):
    check(run_mpi(PROGRAMS / "uid_checks.py", nranks, str(tmp_path / "uid.bin"), timeout=240), nranks)
