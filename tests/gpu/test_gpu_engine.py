"""GPU tests (marker ``gpu``): skipped cleanly unless a CUDA GPU, CuPy and the NVSHMEM/cuFFTMp libraries are
present. They launch the programs in ``tests/gpu/programs`` under mpirun/mpiexec (1 and 2 PEs on the visible
GPUs; several PEs may share one GPU) with a timeout each."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

PROGRAMS = Path(__file__).parent / "programs"
ROOT = Path(__file__).resolve().parents[2]


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


def launch(program: str, nranks: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    exe = shutil.which("mpirun") or shutil.which("mpiexec")
    extra = ["--allow-run-as-root", "--oversubscribe"] if "open" in _flavour(exe) else []
    cmd = [exe, *extra, "-n", str(nranks), sys.executable, "-u", str(PROGRAMS / program), *args]
    env = {**os.environ, "NVSHMEM_DISABLE_NVLS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} hung for {timeout} s\n{out[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def _flavour(exe: str) -> str:
    try:
        return subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout.lower()
    except Exception:
        return ""


def assert_ok(res: subprocess.CompletedProcess, nranks: int) -> None:
    ok = [line for line in res.stdout.splitlines() if line.startswith("OK rank=")]
    assert res.returncode == 0 and len(ok) == nranks, f"{' '.join(res.args)} -> {res.returncode}\n{res.stdout[-8000:]}"


@pytest.mark.parametrize("nranks", [1, 2])
def test_gpu_checks(nranks):
    assert_ok(launch("gpu_checks.py", nranks), nranks)


@pytest.mark.parametrize("nranks", [1, 2])
def test_uniqueid_bringup_without_mpi(nranks, tmp_path):
    assert_ok(launch("uid_checks.py", nranks, str(tmp_path / "uid.bin")), nranks)
