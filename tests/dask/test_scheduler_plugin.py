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
