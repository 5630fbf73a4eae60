"""The CPU benchmarks run, small, and report what they claim to (so a change elsewhere cannot leave them broken)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..mpirun import run_mpi

pytestmark = [pytest.mark.dask, pytest.mark.timeout(300)]

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _run(*args: str) -> str:
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=240, cwd=BENCH.parent)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out.stdout


def test_bench_rechunk_small(tmp_path):
    rows_file = tmp_path / "rows.json"
    stdout = _run(str(BENCH / "bench_rechunk.py"), "--workers", "2", "--n", "256", "--s3-n", "2521",
                  "--scenarios", "S1,S3", "--repeats", "1", "--rounds", "2", "--json", str(rows_file))
    rows = {r["scenario"]: r for r in json.loads(rows_file.read_text())}
    assert set(rows) == {"S1", "S3"}
    for row in rows.values():
        assert not [k for k in row if k.endswith("_error")], row
        for method in ("pgas", "tasks", "p2p"):
            assert row[f"{method}_ok"] is True, row  # every method's result checked against the input
            assert row[f"{method}_fwd_GBps"] > 0 and row[f"{method}_back_GBps"] > 0
    # S1's bare exchanges, timed on the workers in each round: a subarray Alltoallw and the engine's own call
    assert rows["S1"]["alltoallw_GBps"] > 0 and rows["S1"]["engine_GBps"] > 0 and rows["S1"]["chunks_out"] == [2, 1]
    assert len(rows["S1"]["pgas_over_bare_by_round"]) == 2 and "alltoallw_GBps" not in rows["S3"]
    assert "S1: pgas / the round's faster bare exchange (forward)" in stdout
    assert stdout.count("pgas OK, tasks OK, p2p OK |") == 2, stdout  # the results column
    assert rows["S3"]["chunks_in"] == [1, 2] and rows["S3"]["chunks_out"] == [2, 1]  # 2503 and 1667 do not divide
    assert "| S1 | 256x256 |" in stdout and "| S3 | 2521x2521 |" in stdout
    for row in rows.values():  # the floor no rechunk can beat, and the bound it sets on the ratio
        assert 0 < row["floor_copy_s"] and 0 < row["floor_round_trip_s"], row
        assert len(row["best_peer_over_floor_by_round"]) == 2 and min(row["best_peer_over_floor_by_round"]) > 0
        assert len(row["pgas_over_best_peer_by_round"]) == 2  # (the second round starts with tasks)
    assert "S1: floor " in stdout and "S1: the most any rechunk could reach" in stdout


_BARE_FAILS_ON_ONE_RANK = """
import os, sys, time
from distributed import Client
import bench_rechunk
import dask_pgas

def break_engine_calls():  # (this worker only) the MPI engine's execute raises before its collective
    from dask_pgas.engines.mpi import MPIReshapePlan

    def execute(self, *args, **kwargs):
        raise RuntimeError("injected")
    MPIReshapePlan.execute = execute

with dask_pgas.LocalMPICluster(n_workers=2, backends=["mpi"]) as cluster, Client(cluster) as client:
    pe1 = dask_pgas.world(client).workers[1]
    client.run(break_engine_calls, workers=[pe1])
    t0 = time.monotonic()
    try:
        bench_rechunk.bare_exchange_seconds(client, 64, 1, timeout=15)
    except TimeoutError as exc:
        print("raised after", round(time.monotonic() - t0), "s:", exc, flush=True)
"""


def test_bench_bare_exchanges_fail_instead_of_waiting(tmp_path):
    # one rank's call raises inside the timed loop while its peer sits in the collective: a timeout, not a hang
    script = tmp_path / "bare_fails.py"
    script.write_text(_BARE_FAILS_ON_ONE_RANK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=200, env=env)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "did not end on every worker within 15 s" in out.stdout, out.stdout + out.stderr[-4000:]
    assert int(out.stdout.split("raised after", 1)[1].split()[0]) < 60, out.stdout


def test_timeline_rechunk_small():
    stdout = _run(str(BENCH / "timeline_rechunk.py"), "--workers", "2", "--n", "256", "--repeats", "2", "--cpu")
    stamps = dict(line.rsplit(None, 1) for line in stdout.splitlines() if line and not line.startswith("#"))
    stamps = {key.strip(): float(value) for key, value in stamps.items()}
    cpu = {key: stamps.pop(key) for key in list(stamps) if key.startswith("cpu: ")}
    assert set(stamps) == {"graph", "scheduled", "staged", "barrier dispatched", "barrier in memory",
                           "exchange first in", "exchange last in", "exchange first out", "exchange last out",
                           "outputs dispatched", "outputs in memory", "done", "exchange (slowest PE)",
                           "trivial graph, done"}, stdout
    assert all(math.isfinite(v) and v >= 0 for v in stamps.values()), stdout
    assert set(cpu) == {"cpu: client", "cpu: scheduler", "cpu: workers' main", "cpu: workers' collective",
                        "cpu: workers' other"}, stdout
    assert all(math.isfinite(v) and v >= 0 for v in cpu.values()), stdout  # (10 ms ticks: may read 0)
    # the stamps after the scheduler has the graph follow the run's steps (each waits for the one before)
    order = ["scheduled", "staged", "exchange first in", "exchange last out", "outputs in memory", "done"]
    assert stamps["staged"] <= stamps["barrier dispatched"] <= stamps["barrier in memory"], stdout
    assert stamps["barrier in memory"] <= stamps["outputs dispatched"] <= stamps["outputs in memory"], stdout
    assert stamps["exchange first in"] <= stamps["exchange last in"] <= stamps["exchange last out"], stdout
    assert stamps["exchange first out"] <= stamps["exchange last out"], stdout
    assert [stamps[k] for k in order] == sorted(stamps[k] for k in order), stdout


@pytest.mark.parametrize("direction", [[], ["--reverse"]], ids=["cols-to-rows", "rows-to-cols"])
def test_bench_reshape_mpi_small(direction):
    result = run_mpi(BENCH / "bench_reshape_mpi.py", 2, "--n", "256", "--repeats", "1", *direction, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "(result matches bare Alltoallw: True)" in result.stdout, result.stdout
    assert "Reshape.execute()" in result.stdout
