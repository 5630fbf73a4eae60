"""LocalMPICluster's launcher defaults: Open MPI ranks are left unbound, the caller's settings win."""

from __future__ import annotations

import stat
from types import SimpleNamespace

import pytest

pytest.importorskip("distributed")

from dask_pgas.integration._cluster import _launcher, _launcher_env

KEY = "OMPI_MCA_hwloc_base_binding_policy"


def _fake_mpiexec(tmp_path, banner: str) -> str:
    path = tmp_path / "mpiexec"
    path.write_text(f"#!/bin/sh\necho '{banner}'\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_open_mpi_workers_are_not_bound(tmp_path):
    mpiexec = _fake_mpiexec(tmp_path, "mpiexec (OpenRTE) 4.1.6")
    env = _launcher_env(_launcher(mpiexec)[0], {"A": "1"})
    assert env == {"A": "1", KEY: "none"}


def test_user_binding_wins(tmp_path):
    mpiexec = _fake_mpiexec(tmp_path, "mpiexec (Open MPI) 5.0.3")
    assert _launcher_env(_launcher(mpiexec)[0], {KEY: "core"})[KEY] == "core"


def test_mpich_env_untouched(tmp_path):
    mpiexec = _fake_mpiexec(tmp_path, "HYDRA build details:")
    assert _launcher_env(_launcher(mpiexec)[0], {"A": "1"}) == {"A": "1"}


def test_real_launcher_env_is_a_copy():
    from dask_pgas.integration._cluster import _mpiexec

    env = {"A": "1"}
    out = _launcher_env(_launcher(_mpiexec())[0], env)
    assert out is not env and out["A"] == "1" and env == {"A": "1"}


class _FakeClient:
    """Answers every scheduler call with ``reply`` (what ``Client.sync`` returns)."""

    def __init__(self, reply):
        from types import SimpleNamespace

        self.reply = reply
        self.status = "running"
        self.scheduler = SimpleNamespace(address="tcp://fake:1", pgas_world=None, pgas_bootstrap=None)

    def sync(self, func, **kwargs):
        return self.reply

    def run_on_scheduler(self, func):  # the scheduler has the plugin's handlers
        return True

    def register_plugin(self, plugin):
        pass


def test_world_before_bootstrap_is_none():
    """A scheduler that answers ``pgas_world`` with None, or with an empty world, has none (a scheduler without
    the plugin at all: test_never_bootstrapped_cluster_follows_fallback)."""
    from dask_pgas.integration import world

    assert world(_FakeClient(None)) is None
    assert world(_FakeClient({"epoch": 0, "workers": [], "backends": [], "broken": None})) is None


def test_bootstrap_warns_when_an_intact_world_has_other_backends(caplog):
    from dask_pgas.integration import bootstrap

    intact = {"status": "OK", "epoch": 1, "workers": ["tcp://a:1"], "backends": ["mpi"], "broken": None}
    with caplog.at_level("WARNING", logger="dask_pgas"):
        assert bootstrap(_FakeClient(intact), backends=["mpi"]).backends == ("mpi",)
        assert not [r for r in caplog.records if r.name.startswith("dask_pgas")]
        assert bootstrap(_FakeClient(intact), backends="nvshmem").backends == ("mpi",)
    assert "['nvshmem']" in caplog.text and "['mpi']" in caplog.text


@pytest.mark.parametrize("kwargs, message", [
    ({"n_workers": 0}, "n_workers must be an integer >= 1, got 0"),
    ({"n_workers": 1.5}, "n_workers must be an integer >= 1"),
    ({"n_workers": True}, "n_workers must be an integer >= 1"),
    ({"threads_per_worker": 0}, "threads_per_worker must be an integer >= 1"),
    ({"memory_limit": "bogus"}, "memory_limit='bogus': Could not interpret 'bogus'"),
    ({"memory_limit": "-1GiB"}, "is negative"),
    ({"gpus": -1}, "gpus must be an integer >= 0"),
    ({"gpus": 10**6}, r"gpus=1000000, but this machine shows \d+ GPU"),
    ({"timeout": 0}, "timeout must be a positive number"),
    ({"timeout": float("inf")}, r"timeout must be a positive number of seconds \(at most 1e\+09\), got inf"),
    ({"mpiexec_args": ("-n", 2)}, "mpiexec_args must be strings"),
    ({"mpiexec_args": None}, "mpiexec_args must be strings"),
    ({"mpiexec_args": (a for a in ("-v", 3))}, "mpiexec_args must be strings"),  # a generator, read once
    ({"dashboard_address": 8787}, "dashboard_address must be a string such as ':8787'"),
])
def test_bad_arguments_are_refused_before_anything_starts(kwargs, message, monkeypatch):
    """Each used to start a scheduler and an MPI job first, then fail with a worker's traceback, or start
    something else than asked (threads_per_worker=0: all cores; gpus=1 without a GPU: CPU workers)."""
    import tempfile

    import numpy as np

    import dask_pgas

    made = []
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: made.append(a) or "/nonexistent")
    with pytest.raises(ValueError, match=message):
        dask_pgas.LocalMPICluster(**{"n_workers": 1, **kwargs})
    assert not made  # nothing was started
    from dask_pgas.integration._cluster import _check_arguments

    _check_arguments(np.int64(2), np.int32(1), "auto", 0, 1)  # integer-likes are integers


class _DeafClient:
    status = "running"

    def __init__(self, exc):
        self.exc = exc
        self.scheduler = SimpleNamespace(address="tcp://deaf:1", pgas_world=None, pgas_teardown=None)

    def run_on_scheduler(self, func):
        return True

    def _send_to_scheduler(self, msg):  # (teardown's fence; the stream itself is fine)
        pass

    def sync(self, func, **kwargs):
        raise self.exc


@pytest.mark.parametrize("exc", [OSError("Stream is closed"), TimeoutError("no reply")])
def test_world_of_a_scheduler_that_does_not_answer_raises(exc):
    """world() and teardown() of a scheduler that does not answer raise PGASWorldError naming it, instead of
    a bare comm error (or None, which reads as 'no world' and makes a caller bootstrap)."""
    from dask_pgas.errors import PGASWorldError
    from dask_pgas.integration import teardown, world

    with pytest.raises(PGASWorldError, match=r"the scheduler at tcp://deaf:1 does not answer"):
        world(_DeafClient(exc))
    with pytest.raises(PGASWorldError, match=r"does not answer"):
        teardown(_DeafClient(exc))


def test_teardown_that_loses_the_scheduler_does_not_say_there_is_no_world():
    """The scheduler answered that it has a world, then dropped the teardown call: teardown said "no PGAS world
    to tear down ... call bootstrap", though the world may be there still."""
    from dask_pgas.errors import PGASWorldError
    from dask_pgas.integration import teardown

    class DeafToTeardown(_DeafClient):
        def sync(self, func, **kwargs):
            if func is self.scheduler.pgas_world:
                return {"epoch": 1, "workers": ["w0"], "backends": ["mpi"], "broken": None}
            raise self.exc

    client = DeafToTeardown(OSError("Stream is closed"))
    client.scheduler.pgas_world, client.scheduler.pgas_teardown = object(), object()
    with pytest.raises(PGASWorldError, match=r"does not answer .*the world was not torn down") as info:
        teardown(client)
    assert "no PGAS world" not in str(info.value)


def test_teardown_from_a_closed_client_says_so():
    """The fence teardown sends through the client's stream first: a closed client cannot send it (distributed's
    ClosedClientError, a RuntimeError, is newer than the oldest distributed supported; older ones raise others)."""
    from dask_pgas.errors import PGASWorldError
    from dask_pgas.integration import teardown

    class Closed(_DeafClient):
        def sync(self, func, **kwargs):
            return {"epoch": 1, "workers": ["w0"], "backends": ["mpi"], "broken": None, "fence": True}

        def _send_to_scheduler(self, msg):
            raise RuntimeError("Client is closed. Can't send pgas-fence message.")

    client = Closed(None)
    client.scheduler.pgas_world = object()
    with pytest.raises(PGASWorldError, match=r"cannot reach the scheduler .*the world was not torn down"):
        teardown(client)


@pytest.mark.parametrize(
    "local, gpus, visible, expected",
    [
        (0, 2, None, "0"), (3, 2, None, "1"), (1, 2, "", "1"),  # no mask: GPU k mod gpus
        (0, 2, "2,3", "2"), (3, 2, "2,3", "3"), (1, 1, "5", "5"),  # within the launcher's own mask
        (1, 2, "GPU-aaaa, GPU-bbbb", "GPU-bbbb"),  # UUIDs, spaces around them
        (2, 3, "4,5", "2"),  # (a mask shorter than gpus: LocalMPICluster refuses it before starting)
    ],
)
def test_gpu_workers_pick_their_gpu_within_the_launcher_s_mask(local, gpus, visible, expected):
    """LocalMPICluster(gpus=N) replaced the caller's CUDA_VISIBLE_DEVICES: under "2,3" its workers took GPUs 0
    and 1 (a docs review)."""
    from dask_pgas.integration._worker_main import worker_gpu

    assert worker_gpu(local, gpus, visible) == expected


@pytest.mark.parametrize(
    "banner, expected",
    [
        ("HYDRA build details:\n    Version:                                 4.2.3\n    Release Date: 2024",
         ("mpich", 4)),
        ("HYDRA build details:\n    Version:                                 5.0.2", ("mpich", 5)),
        ("mpiexec (OpenRTE) 4.1.6\n\nReport bugs to http://www.open-mpi.org/community/help/", ("openmpi", 4)),
        ("mpiexec (Open MPI) 5.0.3", ("openmpi", 5)),
        ("HYDRA build details:", ("mpich", None)),
        ("Intel(R) MPI Library for Linux", ("", None)),
    ],
)
def test_the_launcher_s_kind_and_major_version(tmp_path, banner, expected):
    assert _launcher(_fake_mpiexec(tmp_path, banner)) == expected


def test_more_workers_than_cores_under_mpich_4_is_said_to_crawl():
    """MPICH 4.x ranks spin while they wait: 4 ranks on 2 cores ran a 512 MiB Alltoall 18x slower than with
    MPICH 5 (2026-12-05)."""
    from dask_pgas.integration._cluster import _oversubscription_warning as why

    message = why(("mpich", 4), 4, 2)
    assert "4 workers on 2 cores with MPICH 4.x" in message and "mpich>=5" in message and "at most 2" in message
    assert why(("mpich", 4), 2, 2) is None  # one per core
    assert why(("mpich", 5), 6, 2) is None  # MPICH 5 yields
    assert why(("mpich", None), 6, 2) is None and why(("openmpi", 4), 6, 2) is None and why(("", None), 6, 2) is None


def test_mpi_names_are_unlinked_but_not_the_segments_of_windows(tmp_path, monkeypatch):
    """Once MPI is up a worker unlinks its job's named files (MPICH 5's ``mpich_shm_*``, ``mpich_vci_*``), not a
    window's segment (``mpich_shar_tmp*``: MPICH unlinks it once every rank attached it; unlinked earlier, a
    rank still attaching would fail)."""
    from dask_pgas.integration import _orphan_guard

    names = ["mpich_shm_1a2b_0", "mpich_vci_1a2b_0", "mpich_shar_tmpAbC123"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    monkeypatch.setattr(_orphan_guard, "mpi_shm_files", lambda pids: {str(tmp_path / n) for n in names})
    _orphan_guard.unlink_mpi_names()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mpich_shar_tmpAbC123"]


def test_a_second_interrupt_during_the_kill_still_kills_and_cleans(tmp_path, monkeypatch):
    """Ctrl-C twice while a cluster starts: the second one landed in the wait after SIGTERM, so the SIGKILL pass
    and the removal of the cluster's directory never ran (the cleanup runs once: the directory stayed)."""
    import signal
    import subprocess
    import threading

    from dask_pgas.integration import _cluster

    sent = []
    monkeypatch.setattr(_cluster.os, "killpg", lambda pid, sig: sent.append(sig))

    class Proc:
        pid, waits = 12345, 0

        def poll(self):
            return None  # still running: each pass signals it

        def wait(self, timeout):
            self.waits += 1
            if self.waits == 1:
                raise KeyboardInterrupt  # the second Ctrl-C
            raise subprocess.TimeoutExpired("mpiexec", timeout)

    log = open(tmp_path / "x.log", "w")
    directory = tmp_path / "cluster"
    directory.mkdir()
    with pytest.raises(KeyboardInterrupt):
        _cluster._cleanup(threading.Event(), threading.RLock(), [Proc()], [log], str(directory))
    assert sent == [signal.SIGTERM, signal.SIGKILL] and log.closed and not directory.exists()
