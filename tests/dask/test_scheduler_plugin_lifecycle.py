"""The scheduler plugin's failure handling driven directly, with stand-ins for the scheduler and the workers' RPCs
(no cluster; each test well under a second, but the ranks-grace ones, ~0.5 s). Each failed on a mutant of the
plugin that the other tests let through (a mutation review)."""

from __future__ import annotations

import asyncio
import pickle
from types import SimpleNamespace

import pytest

pytest.importorskip("distributed")

from distributed.core import Status

from dask_pgas.errors import PGASWorldError
from dask_pgas.integration._scheduler_plugin import PGASSchedulerPlugin, _Run

pytestmark = pytest.mark.dask


def _info(addr, rank, size, **kw):
    """What a worker's pgas_info answers (the fields bootstrap reads)."""
    return {"address": addr, "name": f"mpi-rank-{rank}", "host": "h", "process": addr, "mpi_rank": rank,
            "mpi_size": size, "nanny_in_mpi_job": False, "available": ["mpi"], "initialized": False,
            "pe": None, "epoch": None, "poisoned": False, "busy_for": None, **kw}


class _Scheduler:
    def __init__(self, workers):
        self.workers = dict.fromkeys(workers)
        self.tasks = {}
        self.sent = []
        self.handlers = {}
        self.stream_handlers = {}
        self.calls = []  # (worker, op, kwargs)
        self.status = Status.running
        self.erred = []  # (key, kwargs) of transition(key, "erred")
        self.batches = []  # recommendations passed to transitions()

    def send_all(self, client_msgs, worker_msgs):
        self.sent.append(worker_msgs)

    def transition(self, key, finish, **kwargs):
        self.erred.append((key, finish, kwargs))
        return {}

    def transitions(self, recs, stimulus_id):
        self.batches.append(dict(recs))
        for key, finish in recs.items():  # enough of Dask for _err's waiting -> released -> erred
            self.tasks[key].state = finish


def _fake_rpc(sched, answers):
    """``answers[op]`` is a function (addr, **kwargs) -> reply, or a coroutine function (an exception instance
    is raised)."""

    class _Rpc:
        def __init__(self, addr):
            self.addr = addr

        def __getattr__(self, op):
            async def call(**kwargs):
                sched.calls.append((self.addr, op, kwargs))
                r = answers[op](self.addr, **kwargs)
                if asyncio.iscoroutine(r):
                    r = await r
                if isinstance(r, BaseException):
                    raise r
                return r

            return call

    return _Rpc


def _mpi_init(addr, ranks, **kwargs):
    return {"status": "OK", "pe": ranks.index(int(addr[1:])), "npes": len(ranks)}


async def _plugin(workers):
    plugin = PGASSchedulerPlugin()
    sched = _Scheduler(workers)
    await plugin.start(sched)
    return plugin, sched


def test_bootstrap_waits_for_ranks_of_the_job_still_registering():
    """A restarted LocalMPICluster job: ranks 0 and 1 are here, rank 2 registers 0.5 s later. bootstrap waits
    for it (up to RANKS_GRACE) and builds a world of all three, without a warning."""

    async def main():
        plugin, sched = await _plugin(["w0", "w1"])
        infos = {}
        sched.rpc = _fake_rpc(sched, {"pgas_info": lambda a, **k: infos.setdefault(a, _info(a, int(a[1:]), 3)),
                                      "pgas_init": _mpi_init})
        asyncio.get_running_loop().call_later(0.5, sched.workers.__setitem__, "w2", None)
        return await plugin.bootstrap(backends=["mpi"], timeout=30)

    result = asyncio.run(main())
    assert result["status"] == "OK", result
    assert result["workers"] == ["w0", "w1", "w2"] and "warning" not in result


def test_bootstrap_refuses_workers_stuck_in_an_old_collective():
    """A worker whose collective never returned (poisoned): bootstrap refuses at once, saying the cluster must
    be restarted, and initializes nothing."""

    async def main():
        plugin, sched = await _plugin(["w0", "w1"])
        sched.rpc = _fake_rpc(sched, {
            "pgas_info": lambda a, **k: _info(a, int(a[1:]), 2, poisoned=a == "w1"),
            "pgas_init": _mpi_init})
        return sched, await plugin.bootstrap(backends=["mpi"], timeout=30)

    sched, result = asyncio.run(main())
    assert result["status"] == "error"
    assert "['w1'] hold a collective that never returned" in result["message"]
    assert "Restart the cluster" in result["message"]
    assert not [c for c in sched.calls if c[1] == "pgas_init"]


def test_bootstrap_maps_each_worker_to_the_pe_it_became_and_refuses_a_mismatch():
    """The PE a member reports after init must be its place in the world; otherwise the world is refused
    (tasks pinned to PE i would run on another PE's worker)."""

    async def main(swap):
        plugin, sched = await _plugin(["w0", "w1"])

        def init(addr, ranks, **kwargs):
            r = _mpi_init(addr, ranks)
            if swap:
                r["pe"] = 1 - r["pe"]
            return r

        sched.rpc = _fake_rpc(sched, {"pgas_info": lambda a, **k: _info(a, int(a[1:]), 2), "pgas_init": init})
        return plugin, await plugin.bootstrap(backends=["mpi"], timeout=30)

    plugin, ok = asyncio.run(main(False))
    assert ok["status"] == "OK" and ok["workers"] == ["w0", "w1"]  # ordered by MPI rank
    plugin, bad = asyncio.run(main(True))
    assert bad["status"] == "error" and "became PE 1, expected 0" in bad["message"]
    # the members did initialize: the world is kept, broken, so that teardown or bootstrap ends it collectively
    # (as after any other failed bootstrap; it was dropped and its members never finalized)
    assert plugin.broken and plugin.world == ("w0", "w1")


def test_a_broken_world_that_cannot_be_torn_down_is_not_replaced():
    """Rebuilding a broken world whose members are all here starts with a forced collective teardown; when a
    member fails it, bootstrap must stop and say to restart the cluster (a new world on top of a half-freed one
    would hang), initializing nothing."""

    async def main():
        plugin, sched = await _plugin(["w0", "w1"])
        plugin.world, plugin.epoch, plugin.backends = ("w0", "w1"), 1, ("mpi",)
        plugin.broken = "pgas rechunk x: injected. The PGAS world #1 is broken"
        held = {"initialized": True, "epoch": 1}
        sched.rpc = _fake_rpc(sched, {
            "pgas_info": lambda a, **k: _info(a, int(a[1:]), 2, **held),
            "pgas_teardown": lambda a, force: ({"status": "OK"} if a == "w0"
                                               else {"status": "error", "message": "finalize failed"}),
            "pgas_init": _mpi_init})
        return sched, await plugin.bootstrap(backends=["mpi"], timeout=30)

    sched, result = asyncio.run(main())
    assert [(w, k["force"]) for w, op, k in sched.calls if op == "pgas_teardown"] == [("w0", True), ("w1", True)]
    assert result["status"] == "error"
    assert "could not be torn down on w1 (finalize failed); restart the cluster" in result["message"]
    assert not [c for c in sched.calls if c[1] == "pgas_init"]


def test_a_call_to_the_members_keeps_the_replies_and_times_out_only_the_late_ones():
    """A member that does not answer in time made the whole call raise a bare TimeoutError, losing the others'
    replies; where a caller did not catch it (world(detail=True), teardown's check of a broken world, a
    bootstrap's teardown of the old world) the client read it as "the scheduler does not answer"."""

    async def info(addr):
        await asyncio.sleep(5 if addr == "w1" else 0)
        return _info(addr, int(addr[1:]), 2)

    async def main():
        plugin, sched = await _plugin(["w0", "w1"])
        sched.rpc = _fake_rpc(sched, {"pgas_info": info})
        return await plugin._call(["w0", "w1"], "pgas_info", timeout=0.2)

    replies = asyncio.run(main())
    assert replies["w0"]["mpi_rank"] == 0
    assert isinstance(replies["w1"], TimeoutError) and "w1 did not answer pgas_info within 0.2s" in str(replies["w1"])


def test_a_teardown_that_times_out_on_a_member_says_so():
    """A member that does not finish its teardown: the scheduler's timeout reached the client as a bare
    TimeoutError, read there as "the scheduler does not answer"; it is the scheduler's answer now."""

    async def slow(addr, force):
        await asyncio.sleep(5 if addr == "w1" else 0)
        return {"status": "OK", "heap": {}, "buffer_bytes": 0}

    async def main():
        plugin, sched = await _plugin(["w0", "w1"])
        plugin.world, plugin.epoch, plugin.backends = ("w0", "w1"), 1, ("mpi",)
        plugin.TEARDOWN_TIMEOUT = 0.2
        sched.rpc = _fake_rpc(sched, {"pgas_teardown": slow})
        return plugin, await plugin.teardown()

    plugin, result = asyncio.run(main())
    assert result["status"] == "error" and "did not finish tearing the world down within 0.2 s" in result["message"]
    assert plugin.world == ()


def test_a_closing_scheduler_losing_a_member_mid_run_still_fails_the_run():
    """The scheduler closes while a run is inside its collective: that is a failure (its output tasks wait for
    it), not the quiet end of a dask-mpi job."""

    async def main():
        plugin, sched = await _plugin(["w0", "w1"])
        plugin.world, plugin.epoch = ("w0", "w1"), 1
        run = _Run("pgas-rechunk-abc", 0, 60.0)
        plugin._runs[run.name] = run
        sched.status = Status.closing
        plugin.remove_worker(sched, "w1", stimulus_id="test")
        return plugin, run

    plugin, run = asyncio.run(main())
    assert plugin.broken and "left the PGAS world" in plugin.broken
    assert run.failed.done() and "left the PGAS world" in run.failed.result()


def test_removing_a_member_errs_its_pinned_tasks_and_the_barriers():
    """With MPI every rank may go down with the one that died, so no worker is left to report: the scheduler
    itself errs the lost member's pinned tasks that can no longer run (no-worker) and every pending barrier
    (waiting, queued or processing), with the world's error."""

    async def main():
        plugin, sched = await _plugin(["w0", "w1"])
        plugin.world, plugin.epoch = ("w0", "w1"), 1
        for key, state in [(("pgas-transfer-a", 1), "no-worker"), (("pgas-transfer-a", 0), "no-worker")]:
            sched.tasks[key] = SimpleNamespace(state=state, worker_restrictions={key[1]}, loose_restrictions=False)
            plugin._pinned[key] = f"w{key[1]}"
        sched.tasks["pgas-barrier-a"] = SimpleNamespace(state="waiting")
        sched.tasks["pgas-barrier-b"] = SimpleNamespace(state="processing",
                                                        processing_on=SimpleNamespace(address="w0"))
        plugin._barriers |= {"pgas-barrier-a", "pgas-barrier-b"}
        del sched.workers["w1"]
        plugin.remove_worker(sched, "w1", stimulus_id="test")
        return plugin, sched

    _, sched = asyncio.run(main())
    erred = {key: kw for key, finish, kw in sched.erred if finish == "erred"}
    assert ("pgas-transfer-a", 1) in erred  # pinned to the lost member, no-worker
    assert ("pgas-transfer-a", 0) not in erred  # pinned to a member still here
    assert "pgas-barrier-b" in erred and erred["pgas-barrier-b"]["worker"] == "w0"
    exc = pickle.loads(erred[("pgas-transfer-a", 1)]["exception"])
    assert isinstance(exc, PGASWorldError) and "left the PGAS world" in str(exc)
    # the waiting barrier: released, then erred, carrying the same error
    assert sched.tasks["pgas-barrier-a"].state == "erred"
    assert "left the PGAS world" in sched.tasks["pgas-barrier-a"].exception_text


def test_members_are_kept_from_downscaling_and_retirement_by_name():
    """Adaptive/auto retirement (valid_workers_downscaling) and client.retire_workers(names=...) leave the
    members of an intact world alone; a broken world does not hold its members."""

    async def main():
        plugin, sched = await _plugin(["w0", "w1", "x"])
        retired = []

        async def original(workers=None, *, names=None, **kwargs):
            retired.append((workers, names))
            return {}

        sched.handlers["retire_workers"] = original
        await plugin.start(sched)  # guard the handler
        for a, n in [("w0", "mpi-rank-0"), ("w1", "mpi-rank-1"), ("x", "extra")]:
            sched.workers[a] = SimpleNamespace(name=n, address=a)
        plugin.world = ("w0", "w1")
        await sched.handlers["retire_workers"](names=["mpi-rank-0", "extra"])
        await sched.handlers["retire_workers"](names=["mpi-rank-1"])
        return plugin, sched, retired

    plugin, sched, retired = asyncio.run(main())
    assert retired == [(None, ["extra"])]
    wss = list(sched.workers.values())
    assert [ws.address for ws in plugin.valid_workers_downscaling(sched, wss)] == ["x"]
    plugin.broken = "lost"
    assert plugin.valid_workers_downscaling(sched, wss) == wss


def test_a_bootstrap_that_timed_out_leaves_a_broken_world_that_the_next_bootstrap_replaces():
    """A member does not finish init within the bootstrap timeout: the world is recorded broken (some members may
    hold it, others not), so the next bootstrap initializes again instead of returning it as an intact world."""
    slow = {"w1"}

    async def main():
        plugin, sched = await _plugin(["w0", "w1"])

        async def init_reply(addr, ranks, **kwargs):
            if addr in slow:
                await asyncio.sleep(5)
            return _mpi_init(addr, ranks)

        sched.rpc = _fake_rpc(sched, {"pgas_info": lambda a, **k: _info(a, int(a[1:]), 2), "pgas_init": init_reply})
        first = await plugin.bootstrap(backends=["mpi"], timeout=0.3)
        broken = plugin._describe()
        slow.clear()
        second = await plugin.bootstrap(backends=["mpi"], timeout=5)
        return sched, first, broken, second

    sched, first, broken, second = asyncio.run(main())
    assert first["status"] == "error" and "timed out after 0.3s" in (first["message"] or "")
    assert broken["broken"] and broken["epoch"] == 1
    assert second["status"] == "OK" and second["epoch"] == 2 and second["broken"] is None
    assert len([c for c in sched.calls if c[1] == "pgas_init"]) == 4


def test_bootstrap_waits_for_rank_0_of_a_local_mpi_cluster_job():
    """LocalMPICluster's workers are ranks 0..n-1 of their job (no rank kept for others): a restarted job whose
    rank 0 registers 0.5 s after the others gets a world of all three (rank 0 was taken for dask-mpi's
    scheduler and never waited for)."""

    async def main():
        plugin, sched = await _plugin(["w1", "w2"])
        sched.rpc = _fake_rpc(sched, {"pgas_info": lambda a, **k: _info(a, int(a[1:]), 3, non_worker_ranks=[]),
                                      "pgas_init": _mpi_init})
        asyncio.get_running_loop().call_later(0.5, sched.workers.__setitem__, "w0", None)
        return await plugin.bootstrap(backends=["mpi"], timeout=30)

    result = asyncio.run(main())
    assert result["status"] == "OK" and result["workers"] == ["w0", "w1", "w2"], result
