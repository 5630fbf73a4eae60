"""The scheduler plugin's bookkeeping of finished runs, driven directly (no cluster)."""

from __future__ import annotations

from typing import ClassVar

import pytest

pytest.importorskip("distributed")

from dask_pgas.integration._scheduler_plugin import PGASSchedulerPlugin, shared_gpu_warning

pytestmark = pytest.mark.dask


class _Scheduler:
    def __init__(self, workers):
        self.workers = dict.fromkeys(workers)
        self.tasks = {}
        self.sent = []

    def send_all(self, client_msgs, worker_msgs):
        self.sent.append(worker_msgs)


def _plugin():
    plugin = PGASSchedulerPlugin()
    plugin.scheduler = _Scheduler(["w0", "w1"])
    plugin.world, plugin.epoch = ("w0", "w1"), 1
    plugin._last_seq["pgas-rechunk-abc"] = 7
    return plugin


def test_rescheduled_barrier_keeps_the_run_results():
    """A barrier task leaving "processing" (stolen or rescheduled) must not make the workers drop its run's
    output box: its output tasks still wait for it (seen on 4 GPU workers: "the output ... is not on ...")."""
    plugin = _plugin()
    plugin.transition("pgas-barrier-abc", "processing", "released")
    plugin.transition("pgas-barrier-abc", "waiting", "released")
    assert plugin.scheduler.sent == [] and plugin._last_seq == {"pgas-rechunk-abc": 7}


@pytest.mark.parametrize("start, finish", [("memory", "released"), ("released", "forgotten")])
def test_released_barrier_forgets_its_run(start, finish):
    plugin = _plugin()
    plugin.transition("pgas-barrier-abc", start, finish)
    (msgs,) = plugin.scheduler.sent
    assert set(msgs) == {"w0", "w1"}
    assert msgs["w0"] == [{"op": "pgas-forget", "name": "pgas-rechunk-abc", "run": 7, "epoch": 1}]
    assert plugin._last_seq == {}


def test_closed_connection_during_a_run_reads_as_a_lost_member():
    """A member killed inside a collective may show up first as its start RPC's closed stream, before the
    scheduler removes it: the run fails with the same "left the PGAS world" error either way, and breaks
    the world."""
    import asyncio

    from distributed.comm.core import CommClosedError

    from dask_pgas.integration._scheduler_plugin import _Run

    class _Rpc:
        def __init__(self, addr):
            self.addr = addr

        async def pgas_start(self, **kwargs):
            if self.addr == "w1":
                raise CommClosedError("in <TCP (closed) ConnectionPool.pgas_start>: Stream is closed")
            await asyncio.sleep(10)  # w0 sits in the collective

    async def main():
        plugin = _plugin()
        plugin.scheduler.rpc = _Rpc
        run = _Run("pgas-rechunk-abc", 0, 120.0)  # (the watchdog timeout pgas.collective-timeout gives)
        return plugin, await asyncio.wait_for(plugin._collective(run, 1), 5)

    plugin, result = asyncio.run(main())
    assert result["status"] == "error"
    assert "worker w1 (PE 1) left the PGAS world: its connection closed" in result["message"]
    assert plugin.broken and "left the PGAS world" in plugin.broken
    assert plugin.scheduler.sent  # every member is told


def test_barrier_call_of_a_released_rechunk_starts_no_run():
    """A barrier task's late call, after Dask released the rechunk (a cancel), must not number a run: no
    transfer staged anything for it."""
    import asyncio

    plugin = _plugin()
    result = asyncio.run(plugin.barrier("pgas-rechunk-abc", 1))
    assert result["status"] == "error" and "released before its collective started" in result["message"]
    assert plugin._seq == 0 and plugin._runs == {}


def test_rechunk_released_during_its_run_gets_a_new_run():
    """Cancelled while its collective runs, then computed again: the new attempt gets a run of its own, and the
    old run's result, once it ends, is not handed to the new attempt's barrier."""
    import asyncio

    class _Rpc:
        release = None

        def __init__(self, addr):
            pass

        async def pgas_start(self, name, seq, epoch):
            await _Rpc.release.wait()
            return {"status": "OK", "pe": 0, "seconds": 0.0}

    async def main():
        _Rpc.release = asyncio.Event()
        plugin = _plugin()
        plugin._last_seq.clear()
        plugin._lock = asyncio.Lock()
        plugin.scheduler.rpc = _Rpc
        name = "pgas-rechunk-abc"
        first = plugin._start(name, 1)
        plugin.transition("pgas-barrier-abc", "waiting", "released")
        plugin.transition("pgas-barrier-abc", "released", "forgotten")  # the cancel
        assert plugin._runs == {} and plugin._describe()["active_runs"] == [name]
        assert (await plugin.teardown())["message"] == f"rechunks still running: {[name]}"
        second = plugin._start(name, 1)  # the new attempt's transfers are done
        assert (first.seq, second.seq) == (0, 1)
        _Rpc.release.set()
        await asyncio.gather(first.task, second.task)
        assert (await plugin.barrier(name, 1))["run"] == 1
        assert plugin._describe()["active_runs"] == []

    asyncio.run(main())


class _QueueingRpc:
    """Members that run collectives one after another, each taking ``seconds``; a log of the starts sent."""

    seconds = 0.0
    log: ClassVar[list] = []
    ends: ClassVar[dict] = {}  # (addr, seq) -> loop time the run ends on that member

    def __init__(self, addr):
        self.addr = addr

    async def pgas_start(self, name, seq, epoch):
        import asyncio

        loop = asyncio.get_running_loop()
        _QueueingRpc.log.append((self.addr, "pgas_start"))
        begin = max(loop.time(), _QueueingRpc.ends.get((self.addr, seq - 1), 0.0))
        end = _QueueingRpc.ends[(self.addr, seq)] = begin + _QueueingRpc.seconds
        await asyncio.sleep(end - loop.time())
        return {"status": "OK", "pe": 0, "seconds": _QueueingRpc.seconds}


def test_runs_queued_behind_each_other_are_timed_from_their_own_start():
    """Three rechunks started together: each collective takes 0.3 s on the members, so the third ends after
    0.9 s. With a 0.5 s collective timeout none is late; the clock of a run starts when the run before it
    has ended (it used to start when the run was sent, which broke the world)."""
    import asyncio

    import dask

    async def main():
        plugin = _plugin()
        plugin._last_seq.clear()
        plugin.scheduler.rpc = _QueueingRpc
        _QueueingRpc.seconds, _QueueingRpc.log, _QueueingRpc.ends = 0.3, [], {}
        runs = [plugin._start(f"pgas-rechunk-{i}", 1) for i in range(3)]
        return plugin, await asyncio.gather(*(r.task for r in runs))

    with dask.config.set({"pgas.collective-timeout": "0.5s"}):
        plugin, results = asyncio.run(main())
    assert [r["status"] for r in results] == ["OK"] * 3, results
    assert plugin.broken is None


def test_a_run_that_overruns_its_own_turn_still_times_out():
    import asyncio

    import dask

    async def main():
        plugin = _plugin()
        plugin._last_seq.clear()
        plugin.scheduler.rpc = _QueueingRpc
        _QueueingRpc.seconds, _QueueingRpc.log, _QueueingRpc.ends = 0.6, [], {}
        return plugin, await asyncio.wait_for(plugin._start("pgas-rechunk-a", 1).task, 5)

    with dask.config.set({"pgas.collective-timeout": "0.3s"}):
        plugin, result = asyncio.run(main())
    assert result["status"] == "error" and "did not finish within pgas.collective-timeout" in result["message"]
    assert plugin.broken


def _transfers_done(plugin, name="abc", npes=2):
    from types import SimpleNamespace

    from dask_pgas.integration._graph import PinnedTask, transfer

    for pe in range(npes):
        key = (f"pgas-transfer-{name}", pe)
        plugin.scheduler.tasks[key] = SimpleNamespace(
            run_spec=PinnedTask(key, transfer, f"pgas-rechunk-{name}", pe, 1, None, (), pe=pe, epoch=1, npes=npes))
    for pe in range(npes):
        plugin.transition((f"pgas-transfer-{name}", pe), "processing", "memory")


def test_no_run_starts_on_a_world_that_is_being_torn_down():
    """The last transfer task of a rechunk landing while the members finalize gets an error, not a run sent
    to PEs that are tearing down."""
    import asyncio
    from types import SimpleNamespace

    class _Rpc(_QueueingRpc):
        gate = None

        async def pgas_teardown(self, force=False):
            _QueueingRpc.log.append((self.addr, "pgas_teardown"))
            await _Rpc.gate.wait()
            return {"status": "OK"}

        def __getattr__(self, op):  # the plugin's _call spells rpc(addr).__getattr__(op)
            return object.__getattribute__(self, op)

    async def main():
        plugin = _plugin()
        plugin._last_seq.clear()
        plugin._lock = asyncio.Lock()
        plugin.scheduler.rpc = _Rpc
        _QueueingRpc.log, _Rpc.gate = [], asyncio.Event()
        teardown = asyncio.ensure_future(plugin.teardown())
        await asyncio.sleep(0.01)  # pgas_teardown is in flight on both members
        _transfers_done(plugin)
        await asyncio.sleep(0.01)
        _Rpc.gate.set()
        plugin.scheduler.tasks["pgas-barrier-abc"] = SimpleNamespace(state="processing")
        return await teardown, await plugin.barrier("pgas-rechunk-abc", 1)

    done, barrier = asyncio.run(main())
    assert done["status"] == "OK"
    assert ("w0", "pgas_start") not in _QueueingRpc.log, _QueueingRpc.log
    assert barrier["status"] == "error" and "build the rechunk again" in barrier["message"]


def test_no_start_is_sent_once_the_world_broke():
    """A member lost between a run's numbering and its first step: the survivors get the failure and no
    start after it (a start arriving after the failure would enter a collective with a dead peer)."""
    import asyncio

    async def main():
        plugin = _plugin()
        plugin._last_seq.clear()
        plugin.scheduler.rpc = _QueueingRpc
        _QueueingRpc.log = []
        _transfers_done(plugin)  # numbers run 0; its driver has not run yet
        plugin.scheduler.workers.pop("w1")
        plugin.remove_worker(plugin.scheduler, "w1", stimulus_id="test")
        result = await asyncio.wait_for(plugin._runs["pgas-rechunk-abc"].task, 5)
        return plugin, result

    plugin, result = asyncio.run(main())
    assert _QueueingRpc.log == [], _QueueingRpc.log
    assert result["status"] == "error" and "left the PGAS world" in result["message"]
    assert [m["w0"][0]["op"] for m in plugin.scheduler.sent] == ["pgas-fail"]


def test_members_leaving_a_closing_scheduler_end_the_world_quietly(caplog):
    """A dask-mpi job that ends without teardown closes the scheduler, which removes every worker: that is no
    failure, and used to log 'left the PGAS world ... is broken' at ERROR level."""
    import logging

    from distributed.core import Status

    plugin = _plugin()
    plugin.scheduler.status = Status.closing
    with caplog.at_level(logging.INFO, logger="dask_pgas"):
        plugin.remove_worker(plugin.scheduler, "w0", stimulus_id="test")
        plugin.remove_worker(plugin.scheduler, "w1", stimulus_id="test")
    assert plugin.broken is None and plugin.world == () and plugin.scheduler.sent == []
    assert [r.levelname for r in caplog.records] == ["INFO"], caplog.records
    plugin = _plugin()  # a running scheduler losing a member: the world breaks
    plugin.remove_worker(plugin.scheduler, "w1", stimulus_id="test")
    assert plugin.broken and "left the PGAS world" in plugin.broken


def test_barriers_run_on_world_members():
    """A barrier on a worker outside the world, lost with it, would be recomputed and start the run again
    with its inputs consumed: barriers are restricted to the members."""
    from types import SimpleNamespace

    from dask_pgas.integration._graph import BarrierTask, barrier

    plugin = _plugin()
    ts = SimpleNamespace(run_spec=BarrierTask("pgas-barrier-abc", barrier, "pgas-rechunk-abc", 1),
                         worker_restrictions=None, loose_restrictions=True)
    plugin.scheduler.tasks["pgas-barrier-abc"] = ts
    plugin.update_graph(plugin.scheduler, tasks=["pgas-barrier-abc"])
    assert ts.worker_restrictions == {"w0", "w1"} and ts.loose_restrictions is False


@pytest.mark.parametrize("members, expected", [
    # dask-cuda or LocalMPICluster(gpus=4): a GPU each
    ({f"w{i}": ("h", f"gpu{i}", 4) for i in range(4)}, None),
    # several workers on one GPU on purpose: each sees only that one (LocalMPICluster(gpus=1), MPS)
    ({f"w{i}": ("h", "gpu0", 1) for i in range(4)}, None),
    # CPU workers (MPI engine): no GPU to compare
    ({f"w{i}": ("h", None, None) for i in range(3)}, None),
    # four unbound workers of an 8-GPU host all took their device 0
    ({f"w{i}": ("h", "gpu0", 8) for i in range(4)}, "4 PEs on h share 1 GPU(s) while its workers see 8"),
    # two hosts, only the second unbound
    ({"a0": ("a", "g0", 2), "a1": ("a", "g1", 2), "b0": ("b", "g0", 2), "b1": ("b", "g0", 2)},
     "2 PEs on b share 1 GPU(s) while its workers see 2"),
])
def test_shared_gpu_warning(members, expected):
    """bootstrap warns when a host's PEs share fewer GPUs than its workers see (workers not given a GPU each,
    so every PE took its worker's device 0), and only then."""
    warning = shared_gpu_warning(members)
    if expected is None:
        assert warning is None
    else:
        assert warning.startswith(expected) and "CUDA_VISIBLE_DEVICES" in warning


def test_a_broken_world_is_torn_down_only_when_every_member_holds_it_idle():
    """A forced teardown is collective over the old members: each must be there, hold that world (a bootstrap
    that failed part way leaves members without it, which would return at once while the others wait), and not
    be inside a collective."""
    plugin = _plugin()

    def info(**kw):
        return {"initialized": True, "epoch": 1, "poisoned": False, "busy_for": None, **kw}

    assert plugin._recoverable({"w0": info(), "w1": info()})
    assert not plugin._recoverable({"w0": info()})  # a member left
    assert not plugin._recoverable({"w0": info(), "w1": RuntimeError("no answer")})
    assert not plugin._recoverable({"w0": info(), "w1": info(initialized=False, epoch=None)})
    assert not plugin._recoverable({"w0": info(), "w1": info(epoch=0)})  # still in an older world
    assert not plugin._recoverable({"w0": info(), "w1": info(poisoned=True)})
    assert not plugin._recoverable({"w0": info(busy_for=3.0), "w1": info()})


def test_ranks_of_the_worker_job_that_have_not_registered():
    """A bootstrap right after LocalMPICluster restarted its worker job built a world of the ranks registered so
    far, for good; it now waits for the others (beyond dask-mpi's scheduler and client ranks 0 and 1)."""
    from dask_pgas.integration._scheduler_plugin import _missing_ranks

    def infos(size, ranks, others=(0, 1)):
        return {f"w{r}": {"mpi_size": size, "mpi_rank": r, "non_worker_ranks": list(others)} for r in ranks}

    assert _missing_ranks(infos(4, [0, 1, 2, 3], ())) == set()
    # LocalMPICluster's job (every rank a worker), ranks still registering: rank 0 or 1 too (they were never
    # waited for, and a world without them was built for good)
    assert _missing_ranks(infos(4, [0, 3], ())) == {1, 2}
    assert _missing_ranks(infos(4, [2, 3], ())) == {0, 1}
    assert _missing_ranks(infos(2, [1], ())) == {0}
    assert _missing_ranks(infos(5, [2, 3, 4])) == set()  # dask_mpi.initialize(): scheduler 0, client 1
    assert _missing_ranks(infos(4, [1, 2, 3])) == set()  # the dask-mpi CLI: scheduler 0
    assert _missing_ranks(infos(5, [2, 4])) == {3}
    assert _missing_ranks({"a": {"mpi_size": None, "mpi_rank": None}}) == set()  # not MPI processes


def test_teardown_waits_for_the_rechunks_whose_tasks_still_need_the_world():
    """teardown refused only while a run was inside its collective: output tasks still to take a finished run's
    result, or local-plan tasks, failed when it went ahead (with a message blaming a release). Results in memory
    (their barrier and transfers released) do not hold it up."""
    import asyncio
    from types import SimpleNamespace

    plugin = _plugin()
    plugin._pinned[("pgas-output-abc", 0)] = "w0"
    plugin._barriers.add("pgas-barrier-abc")
    plugin.scheduler.tasks[("pgas-output-abc", 0)] = SimpleNamespace(state="waiting")
    plugin.scheduler.tasks["pgas-barrier-abc"] = SimpleNamespace(state="released")
    plugin.world = ("w0", "w1")

    async def teardown():
        plugin._lock = asyncio.Lock()
        return await plugin.teardown()

    result = asyncio.run(teardown())
    assert result["status"] == "error" and "pgas-output-abc" in result["message"], result
    assert plugin.world == ("w0", "w1")
    assert plugin._unfinished() == ["pgas-output-abc"]
    plugin.scheduler.tasks[("pgas-output-abc", 0)].state = "memory"
    assert plugin._unfinished() == []


def test_a_transfer_leaving_memory_is_not_ready_any_more():
    """A transfer result released or lost before its run started no longer counts toward starting the run."""
    plugin = _plugin()
    plugin._ready["pgas-rechunk-abc"] = {0, 1}
    plugin.transition(("pgas-transfer-abc", 0), "memory", "released")
    assert plugin._ready == {"pgas-rechunk-abc": {1}}
