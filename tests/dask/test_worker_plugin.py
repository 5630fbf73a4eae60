"""The worker plugin's bookkeeping of runs and forgets, driven directly (no cluster)."""

from __future__ import annotations

import concurrent.futures
from types import SimpleNamespace

import pytest

pytest.importorskip("distributed")

from dask_pgas.integration._exceptions import PGASWorldError
from dask_pgas.integration._worker_plugin import PGASWorkerPlugin

pytestmark = pytest.mark.dask


@pytest.fixture()
def plugin():
    worker = SimpleNamespace(handlers={}, stream_handlers={}, name="w0", address="tcp://w0")
    p = PGASWorkerPlugin()
    p.setup(worker)
    p.epoch, p.pe, p.npes = 1, 0, 2
    yield p
    p.teardown(worker)


def test_forget_after_the_run_ended_keeps_nothing(plugin):
    plugin._next_seq = 4
    plugin._done[3] = concurrent.futures.Future()
    plugin._signal(3, result="box")
    assert plugin._done[3].result() == "box"
    plugin._h_forget("pgas-rechunk-a", run=3, epoch=1)
    assert plugin._done == {} and plugin._dropped == set()


def test_forget_during_the_run_drops_its_result_and_wakes_waiters(plugin):
    plugin._next_seq = 4
    waiting = plugin._done[3] = concurrent.futures.Future()
    plugin._h_forget("pgas-rechunk-a", run=3, epoch=1)
    with pytest.raises(PGASWorldError, match="released before its collective ended"):
        waiting.result(timeout=1)
    assert plugin._dropped == {3}
    plugin._signal(3, result="box")  # the run ends: its result is not kept, and nothing is left behind
    assert plugin._done == {} and plugin._dropped == set()


def test_forget_before_the_run_started_here_marks_it_dropped(plugin):
    """A forget can overtake the start of its run. The run is marked dropped (so that, when it comes, it takes
    nothing a new attempt of the same rechunk staged since), and its output tasks find no result."""
    plugin._next_seq = 2
    plugin._h_forget("pgas-rechunk-a", run=3, epoch=1)
    assert plugin._dropped == {3}
    with pytest.raises(PGASWorldError, match="is not on"):  # an output task of the released attempt
        plugin.take("pgas-rechunk-a", 0, 1, (), True, 3)
    assert plugin._done == {}


def test_forget_of_another_world_touches_no_run(plugin):
    plugin._next_seq = 4
    plugin._done[3] = concurrent.futures.Future()
    plugin._staged["pgas-rechunk-a"] = ("spec", (), ())
    plugin._h_forget("pgas-rechunk-a", run=3, epoch=0)
    assert set(plugin._done) == {3} and plugin._dropped == set() and plugin._staged == {}
