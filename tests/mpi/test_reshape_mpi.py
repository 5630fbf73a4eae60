"""Multi-rank reshape tests: each launches ``mpiexec -n K`` once and runs many cases inside."""

from __future__ import annotations

import os
import random
import re

import pytest

from tests.gpu import unavailable_reason
from tests.mpirun import check, run_cases, run_mpi

pytestmark = pytest.mark.mpi


def _engines():
    """(backend, package) pairs the collective-check programs run on: the MPI engine everywhere, the NVSHMEM
    engine with CuPy and torch CUDA operands where a GPU stack is present (the GPU host)."""
    why = unavailable_reason()
    gpu = [pytest.mark.gpu, pytest.mark.skipif(why is not None, reason=f"GPU engine unavailable: {why}")]
    return [pytest.param(("mpi", "numpy"), id="mpi-numpy"),
            pytest.param(("nvshmem", "cupy"), id="nvshmem-cupy", marks=gpu),
            pytest.param(("nvshmem", "torch"), id="nvshmem-torch", marks=gpu)]


def _engine_args(engine) -> list[str]:
    backend, package = engine
    if package == "torch":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("torch has no CUDA here")
    return ["--backend", backend, "--package", package]


@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
def test_random_layouts_against_numpy(nranks):
    examples = {1: 60, 2: 80, 3: 80, 4: 60}[nranks]
    check(run_mpi("reshape_suite.py", nranks, "--examples", str(examples), timeout=300), nranks)


def test_random_layouts_from_a_new_seed_each_run():
    """The suite above draws the same (derandomized) cases every run, as every rank must; this one draws them
    from a new seed each run, at 5 ranks (odd, more than the box's cores; 60 examples take about 4 s with MPICH 5,
    a minute with MPICH 4, whose waiting ranks spin). ``DASK_PGAS_FUZZ_SEED`` replays a seed; a failure names it."""
    seed = int(os.environ.get("DASK_PGAS_FUZZ_SEED") or random.SystemRandom().randrange(2**31))
    result = run_mpi("reshape_suite.py", 5, "--examples", "60", "--seed", str(seed), timeout=300)
    try:
        check(result, 5)
    except AssertionError as exc:
        raise AssertionError(f"DASK_PGAS_FUZZ_SEED={seed} replays this: {exc}") from None
    assert f"seed={seed}" in result.stdout


@pytest.mark.parametrize("nranks", [1, 3])
def test_torch_cpu_tensors_against_numpy(nranks):
    """torch CPU tensors (as nvmath takes them), reshaped as their NumPy views: every dtype, bfloat16, float8
    and complex32 included, strided and F-ordered, come back as torch CPU tensors of the same dtype.
    (torch is not among the test extras: CI skips this; it runs where torch is installed, and on the GPU host.)"""
    pytest.importorskip("torch")
    check(run_mpi("reshape_suite.py", nranks, "--package", "torch-cpu", "--examples", "60", timeout=300), nranks)


@pytest.mark.parametrize("pack", ["never", "always"])
def test_random_layouts_with_and_without_packing(pack):
    """Both ways of sending strided pieces (packed first, as MPICH wants; as subarrays, as Open MPI wants) against
    NumPy, whichever the MPI library here would pick by itself."""
    result = run_mpi("reshape_suite.py", 3, "--examples", "40", timeout=300, env={"DASK_PGAS_MPI_PACK": pack})
    check(result, 3)


@pytest.mark.parametrize("engine", _engines())
@pytest.mark.parametrize("nranks", [2, 3])
def test_bad_inputs_raise_the_same_error_on_every_rank(nranks, engine):
    _, outcomes = run_cases("bad_inputs.py", nranks, *_engine_args(engine), timeout=180)  # hangs fail; ranks agree
    # each case's class, pinned: a check that went missing would surface later, as another class (a Slab that
    # does not fit raised OperandMismatchError at execute() without its own check)
    expected = dict(BAD_INPUTS)
    if engine[0] == "nvshmem":  # the GPU operand off the heap is refused on its rank (a TypeError, as nvmath's);
        # a host operand beside symmetric ones only by the global check
        expected["an operand off the symmetric heap on one rank"] = "NotSymmetricMemoryError"
    assert {name: outcome["raised"] for name, outcome in outcomes.items()} == expected, outcomes
    assert all(outcome["message"].strip() for outcome in outcomes.values() if outcome["raised"] != "none")
    # the slab's rule, said as it is (it said "the first 0 ranks hold one index more" for an even split)
    assert f"(every rank holds {4 * nranks} on axis 0)" in outcomes["operands do not form the slab"]["message"]


BAD_INPUTS = {
    "operand is not an array on one rank": "UnsupportedOperandError",
    "box given as a malformed pair on one rank": "TypeError",
    "options' logger is not a logger on one rank": "TypeError",
    "dimensionality differs across ranks": "DistributionError",
    "input and output box dimensionality differ": "DistributionError",
    "input and output domains differ": "DistributionError",
    "input boxes leave a hole": "DistributionError",
    "input boxes overlap": "DistributionError",
    "operand shape differs from its input box": "DistributionError",
    "dtypes differ across ranks": "OperandMismatchError",  # a ValueError, as nvmath's for dtypes across processes
    "an operand off the symmetric heap on one rank": "SymmetricMemoryError",
    "operands do not form the slab": "DistributionError",
    "Slab on some ranks, Box on others": "DistributionError",
    "Slab output over boxes away from the origin": "DistributionError",
    "Slab operands differ in dimensionality across ranks": "DistributionError",
    "Slab output over input boxes of different dimensionality": "DistributionError",
    "Slab extents off its axis differ across ranks": "DistributionError",
    "a dtype's metadata does not pickle on one rank (not an error)": "none",
}


@pytest.mark.parametrize("engine", _engines())
@pytest.mark.parametrize("nranks", [1, 3])
def test_symmetric_memory_rules(nranks, engine):
    _, outcomes = run_cases("symmetric_memory.py", nranks, *_engine_args(engine), timeout=180)  # no hang; agreed
    assert len(outcomes) >= (22 if nranks > 1 else 18), sorted(outcomes)
    wrong = [outcome for outcome in outcomes.values() if outcome["raised"] != outcome["expect"]]
    assert not wrong, wrong
    # what every rank says alike is said once (each rank's copy made the message as long as the world)
    in_use = outcomes["finalize refuses while a symmetric array is in use"]["message"]
    ranks = "ranks 0, 1, 2" if nranks == 3 else "rank 0"
    assert in_use.startswith(f"{ranks}: 1 symmetric array(s) still in use"), in_use
    assert in_use.count("still in use") == 1, in_use
    # a freed operand (or a view into freed memory) is refused by name, never read
    freed = [name for name in outcomes if "freed symmetric" in name or "was freed" in name or "allocation was" in name]
    assert len(freed) == (6 if nranks > 1 else 4), freed
    for name in freed:
        message = outcomes[name]["message"]
        assert "the operand was freed with free_symmetric_memory()" in message, (name, message)
        if name.endswith("on one rank"):
            assert "rank 1: the operand was freed" in message, (name, message)


def test_seed_example_runs_as_written():
    from pathlib import Path

    example = Path(__file__).parents[2] / "examples" / "reshape_columns_to_rows.py"
    result = run_mpi(example, 2, timeout=120)
    assert result.returncode == 0, result.stderr
    # the two ranks print concurrently (print's newline is a separate write), so count, do not parse lines
    out = result.stdout
    assert "[0] B:" in out and "[1] B:" in out, out
    assert len(re.findall(r"\[0\. 0\. 1\. 1\.\]", out)) == 4, out
    assert len(re.findall(r"\[[-0-9. ]+\]", out.replace("[0] B:", "").replace("[1] B:", ""))) == 4, out


def test_slab_example_runs_as_written():
    from pathlib import Path

    example = Path(__file__).parents[2] / "examples" / "redistribute_slabs.py"
    result = run_mpi(example, 3, timeout=120)
    assert result.returncode == 0, result.stderr
    for rank, shape in enumerate([(10, 3, 3), (10, 2, 3), (10, 2, 3)]):
        assert f"[{rank}] X slab " in result.stdout and f"-> Y slab {shape}: checked" in result.stdout, result.stdout
