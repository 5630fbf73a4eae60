"""The scheduler plugin's bookkeeping of finished runs, driven directly (no cluster)."""

from __future__ import annotations

import pytest

pytest.importorskip("distributed")

from dask_pgas.integration._scheduler_plugin import PGASSchedulerPlugin

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
        run = _Run("pgas-rechunk-abc", 0)
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
