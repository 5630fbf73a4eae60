"""Launch a test program under ``mpiexec -n K`` with a timeout, so a hang fails instead of blocking."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

PROGRAMS = Path(__file__).parent / "mpi" / "programs"


def mpiexec() -> str:
    exe = shutil.which("mpiexec", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    if exe is None:
        pytest.fail("mpiexec not found: install the project with its dependencies (the mpich wheel provides it)")
    return exe


def run_mpi(program: str | Path, nranks: int, *args: str, timeout: float = 180, env: dict | None = None):
    """Run ``program`` on ``nranks`` ranks; return the CompletedProcess, failing the test on a timeout."""
    path = Path(program)
    if not path.is_absolute():
        path = PROGRAMS / path
    cmd = [mpiexec(), "-n", str(nranks), sys.executable, "-u", str(path), *args]
    root = str(Path(__file__).resolve().parents[1])
    full_env = {
        **os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "NVSHMEM_DISABLE_NVLS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        # Open MPI (the GPU machine's MPI) refuses root and more ranks than cores unless told; MPICH ignores these
        "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_rmaps_base_oversubscribe": "1",
        **(env or {}),
    }
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} hung for {timeout} s (killed)\nstdout:\n{out[-4000:]}\nstderr:\n{err[-4000:]}")
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    return result


def check(result, nranks: int) -> None:
    """Assert the program exited 0 and every rank printed its OK line (ranks' lines may run together when the
    launcher forwards their output: seen with Open MPI, ``OK rank=0OK rank=1``)."""
    ok = set(re.findall(r"OK rank=(\d+)", result.stdout))
    assert result.returncode == 0 and ok == {str(r) for r in range(nranks)}, (
        f"{' '.join(result.args)} exited {result.returncode} with {len(ok)}/{nranks} OK lines\n"
        f"stdout:\n{result.stdout[-6000:]}\nstderr:\n{result.stderr[-6000:]}"
    )


def json_lines(result, tag: str) -> list:
    return [json.loads(line[len(tag) + 1 :]) for line in result.stdout.splitlines() if line.startswith(tag + " ")]


def agreed_outcomes(result, nranks: int) -> dict[str, dict]:
    """``CASE`` lines grouped by case; asserts every rank reported each case, all with the same exception class
    and message. Returns one outcome per case."""
    by_case: dict[str, list[dict]] = {}
    for outcome in json_lines(result, "CASE"):
        by_case.setdefault(outcome["case"], []).append(outcome)
    for name, outcomes in by_case.items():
        assert sorted(o["rank"] for o in outcomes) == list(range(nranks)), f"{name}: not reported by every rank"
        raised = {(o["raised"], o["message"]) for o in outcomes}
        assert len(raised) == 1, f"{name}: ranks disagree: {raised}"
    return {name: outcomes[0] for name, outcomes in by_case.items()}


def run_cases(program: str, nranks: int, *args: str, timeout: float = 180):
    """Run a case program under ``mpiexec -n nranks`` (a hang fails the test instead of blocking), check that
    every rank ended OK, and return the result and its agreed outcomes (:func:`agreed_outcomes`)."""
    result = run_mpi(program, nranks, *args, timeout=timeout)
    check(result, nranks)
    return result, agreed_outcomes(result, nranks)
