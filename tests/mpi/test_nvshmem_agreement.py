"""The GPU engine agrees on every rank-local step before each collective: driven on CPU ranks with fakes of the
CUDA driver, NVSHMEM and cuFFTMp whose collectives are MPI barriers (``programs/nvshmem_agreement.py``). A rank that
skipped a collective would leave the others blocked: the launch then times out and fails."""

from __future__ import annotations

import re

import pytest

from tests.mpirun import json_lines, run_cases

pytestmark = pytest.mark.mpi

EXPECTED = {
    "settings: DASK_PGAS_NVSHMEM_RESHAPE differs": "BackendUnavailableError",
    "settings: DASK_PGAS_EMPTY_VIA_PEER differs": "BackendUnavailableError",
    "settings: DASK_PGAS_NVSHMEM_POOL_BYTES differs": "BackendUnavailableError",
    "settings: NVSHMEM_SYMMETRIC_SIZE differs": "BackendUnavailableError",
    "settings: unreadable pool size on one rank": "BackendUnavailableError",
    "bring-up: NVSHMEM numbers one rank wrongly": "BackendUnavailableError",
    "bring-up: making the device current fails on one rank": "BackendUnavailableError",
    "bring-up: NVSHMEM does not initialize on one rank": "BackendUnavailableError",
    "bring-up: NVSHMEM's init raises on one rank": "BackendUnavailableError",
    "bring-up: again after NVSHMEM's init raised": "BackendUnavailableError",
    "bring-up: a device given on one rank only": "none",
    "bring-up: only the host's first rank holds the host lock": "none",
    "settings: the same values spelled differently": "none",
    "settings: DASK_PGAS_NVSHMEM_RESHAPE read once at bring-up": "none",
    "settings: DASK_PGAS_NVSHMEM_POOL_BYTES read once at bring-up": "none",
    "execute: host-to-device copy fails on one rank": "CollectiveError",
    "execute: healthy after the failed upload": "none",
    "execute: device-to-host copy fails on one rank": "CollectiveError",
    "plan: loading cuFFTMp fails on one rank": "CollectiveError",
    "plan: cufftMpCreateReshape fails on one rank": "CollectiveError",
    "plan: healthy after the failed create": "none",
    "plan: cufftMpMakeReshape fails on one rank": "CollectiveError",
    "plan: the handles made where Make completed are left": "none",
    "plan: healthy after the failed make": "none",
    "plan: cufftMpMakeReshape fails on every rank": "CollectiveError",
    "plan: healthy after the make that failed everywhere": "none",
    "plan: cufftMpGetReshapeSize fails on one rank": "CollectiveError",
    "plan: healthy after the failed workspace query": "none",
    "plan: cufftMpDestroyReshape fails on one rank": "CollectiveError",
    "plan: no leak after the failed destroy": "none",
    "free: the device fails before a collective free on one rank": "DeviceError",
    "free: every later call is refused on every rank": "DeviceError",
    "free: (the processes restart)": "none",
    "free: the device fails before a plan's collective free on one rank": "DeviceError",
    "free: the plan's blocks and handle are left on every rank": "none",
    "free: (the processes restart again)": "none",
    "free: healthy after the failed frees": "none",
    "peer: viewing memory fails on one rank": "CollectiveError",
    "peer: healthy after the failed copy": "none",
    "plan: cuFFTMp asks one rank for a workspace": "none",
    "plan: a workspace past the heap cap is refused on every rank": "MemoryError",
    "plan: healthy after the refused workspace": "none",
    "execute: the second staging buffer is past the heap cap": "MemoryError",
    "execute: a misaligned operand takes the peer copies on every rank": "none",
    "execute: an aligned operand runs cuFFTMp on every rank": "none",
    "execute: no leak after the refused staging": "none",
    "dtype: torch has no such dtype, on every rank": "SymmetricMemoryError",
    "dtype: no leak after the refused dtype": "none",
    "dtype: torch has no such dtype, on one rank": "SymmetricMemoryError",
    "dtype: library-internal allocation frees its block when the view fails": "UnsupportedOperandError",
    "dtype: no leak after the failed internal view": "none",
    "view: fails on one rank after the dtype check": "SymmetricMemoryError",
    "view: no leak after the failed view": "none",
    "uniqueid: bring-up while the backend is initialized": "RuntimeStateError",
    "control: the scratch buffer cannot grow": "MemoryError",
    "plugin: the result is synchronized before the run ends": "none",
    "plugin: staging buffers cannot grow, heap full on every PE": "_RunError",
    "plugin: no leak after the failed growth": "none",
    "plugin: heap full when grown buffers must grow again": "_RunError",
    "plugin: no leak after the failed regrowth": "none",
    "device memory: one rank's GPU is short": "MemoryError",
    "device memory: healthy after the refused growth": "none",
    "device memory: PEs sharing a GPU need room for all of them": "MemoryError",
    "device memory: a shared GPU with room for all": "none",
    "device memory: short until the package caches are released": "none",
    "device memory: releasing the caches fails on one rank": "none",
    "plugin: staging buffers cannot grow, one GPU short": "_RunError",
    "plugin: no leak after the GPU-short growth": "none",
    "plugin: copying the result out fails on one PE": "none",
    "plugin: no leak after the failed copy": "none",
    "plugin: a device error while the staging buffers grow is fatal": "DeviceError",
    "plugin: (the processes restart)": "none",
    "plugin: no leak after the device error": "none",
    "teardown: the device fails on one rank, with a cached plan and buffers": "DeviceError",
    "teardown: a later initialize is refused": "BackendUnavailableError",
    "teardown: (the processes restart)": "none",
    "finalize: a plan's free finds the device broken on one rank": "DeviceError",
    "finalize: a later initialize is refused after it": "BackendUnavailableError",
    "finalize: (the processes restart)": "none",
    "finalize: the device fails on one rank": "DeviceError",
    "finalize: a later initialize is refused": "BackendUnavailableError",
}


@pytest.mark.parametrize("nranks", [2, 3])
def test_gpu_engine_agrees_before_collectives(nranks):
    result, outcomes = run_cases("nvshmem_agreement.py", nranks, timeout=120)  # hangs fail; ranks agree
    assert {name: o["raised"] for name, o in outcomes.items()} == EXPECTED, result.stdout[-6000:]
    for name, outcome in outcomes.items():
        if name.startswith("settings: ") and name.endswith(" differs"):  # names the variable, values by rank
            variable = name.split()[1]
            for rank in range(nranks):
                assert re.search(f"rank {rank}: [^;]*{variable}=", outcome["message"]), outcome
    calls: dict[str, list[dict]] = {}
    for o in json_lines(result, "CASE"):
        calls.setdefault(o["case"], []).append(o["calls"])
    never = {  # collectives no rank may enter after the local failure (nor Destroy after an incomplete Make)
        "execute: host-to-device copy fails on one rank": ("execute",),
        "plan: loading cuFFTMp fails on one rank": ("make",),
        "plan: cufftMpCreateReshape fails on one rank": ("make",),
        "plan: cufftMpMakeReshape fails on one rank": ("destroy",),
        "bring-up: making the device current fails on one rank": ("init",),
        "dtype: torch has no such dtype, on every rank": ("malloc",),
        "dtype: torch has no such dtype, on one rank": ("malloc",),
        "plan: a workspace past the heap cap is refused on every rank": ("malloc", "execute"),
        "execute: a misaligned operand takes the peer copies on every rank": ("execute",),
        "device memory: one rank's GPU is short": ("malloc",),
        "device memory: PEs sharing a GPU need room for all of them": ("malloc",),
        # a device error found before a collective free: no rank enters nvshmem_free, Destroy or NVSHMEM's finalize
        "free: the device fails before a collective free on one rank": ("free",),
        "free: every later call is refused on every rank": ("free", "malloc", "make", "execute"),
        "free: the device fails before a plan's collective free on one rank": ("free", "destroy"),
        "plugin: a device error while the staging buffers grow is fatal": ("execute",),  # (set-up frees/mallocs)
        "finalize: the device fails on one rank": ("free", "destroy", "finalize"),
        "finalize: a plan's free finds the device broken on one rank": ("free", "destroy", "finalize"),
    }
    raised = outcomes["bring-up: NVSHMEM's init raises on one rank"]["message"]
    assert f"on rank {nranks - 1}: RuntimeError: injected" in raised and "restart these processes" in raised, raised
    never["bring-up: NVSHMEM's init raises on one rank"] = ("finalize",)  # (collective: the raising rank is gone)
    never["bring-up: again after NVSHMEM's init raised"] = ("init",)
    again = outcomes["bring-up: again after NVSHMEM's init raised"]["message"]
    assert f"left initialized in this process by a failed bring-up (init raised on rank {nranks - 1})" in again
    for name, forbidden in never.items():
        assert not [c for c in calls[name] for f in forbidden if c.get(f)], (name, calls[name])
    aligned = calls["execute: an aligned operand runs cuFFTMp on every rank"]
    assert len(aligned) == nranks and all(c.get("execute") for c in aligned), aligned
    # handles are destroyed where that cannot hang: after a failed Create on the ranks that created one (Destroy of
    # an unmade handle is local), after a Make that failed everywhere, or a failed size query, on every rank
    def destroys(name):  # per rank: ``calls`` lists each case's ranks in rank order (rank 0 prints the gather)
        return {rank: c.get("destroy", 0) for rank, c in enumerate(calls[name])}

    for name in ("plan: loading cuFFTMp fails on one rank", "plan: cufftMpCreateReshape fails on one rank"):
        assert destroys(name) == {r: int(r != nranks - 1) for r in range(nranks)}, (name, destroys(name))
    assert destroys("plan: cufftMpMakeReshape fails on every rank") == dict.fromkeys(range(nranks), 1)
    assert destroys("plan: cufftMpGetReshapeSize fails on one rank") == dict.fromkeys(range(nranks), 1)
    # the refused workspace's plan is destroyed on every rank (collective, so all or none)
    assert all(c.get("destroy") == 1 for c in calls["plan: a workspace past the heap cap is refused on every rank"])
