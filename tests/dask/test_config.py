"""The ``pgas.*`` config keys and the arguments of the Dask API are checked before anything runs (no cluster)."""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import pytest

import dask_pgas
from dask_pgas.integration import _config
from dask_pgas.integration._client import World

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("plan-cache-size", 0),  # evicted (and freed) the plan it had just built: a broken world
        ("plan-cache-size", -1),
        ("plan-cache-size", "abc"),
        ("plan-cache-size", True),
        ("buffer-growth", 0.5),
        ("buffer-growth", "fast"),
        ("output-pool", -5),
        ("output-pool", "bogus"),
        ("local-rechunk", "maybe"),
        ("collective-timeout", "bogus"),
        ("collective-timeout", 0),
        ("collective-timeout", True),  # what Dask makes of DASK_PGAS__COLLECTIVE_TIMEOUT=true: not 1 s
        ("collective-timeout", "1e10"),  # past what a thread's wait takes: every output task raised OverflowError
        ("collective-timeout", float("inf")),
        ("plan-cache-size", 16.5),
        ("bootstrap-timeout", "-1s"),
        ("fallback", "nope"),
        ("backends", 3),
    ],
)
def test_a_bad_value_names_its_key(key, value):
    with dask.config.set({f"pgas.{key}": value}):
        with pytest.raises(ValueError, match=f"config pgas.{key} must be"):
            _config.setting(key)
        with pytest.raises(ValueError, match=f"pgas.{key}"):
            _config.check_all()
        # and rechunk refuses it before it looks for a client or builds a graph
        with pytest.raises(ValueError, match=f"pgas.{key}"):
            dask_pgas.rechunk(da.ones((4, 4), chunks=2), (4, 1))


def test_good_values():
    _config.check_all()  # the defaults of pgas.yaml
    with dask.config.set({"pgas.output-pool": "2KiB", "pgas.local-rechunk": "false", "pgas.plan-cache-size": 1,
                          "pgas.collective-timeout": "90s", "pgas.bootstrap-timeout": 5, "pgas.buffer-growth": 1}):
        assert _config.setting("output-pool") == 2048
        assert _config.setting("local-rechunk") is False
        assert _config.setting("collective-timeout") == 90.0 and _config.setting("bootstrap-timeout") == 5.0
        assert _config.setting("buffer-growth") == 1.0 and _config.setting("plan-cache-size") == 1
    with dask.config.set({"pgas.output-pool": 0, "pgas.local-rechunk": True}):
        assert _config.setting("output-pool") == 0 and _config.setting("local-rechunk") is True
    with dask.config.set({"pgas.plan-cache-size": np.int64(4), "pgas.buffer-growth": np.float32(1.5)}):
        assert _config.setting("plan-cache-size") == 4 and _config.setting("buffer-growth") == 1.5
    # what the int()/float() reads before these checks took: integral floats and numeric strings
    with dask.config.set({"pgas.plan-cache-size": 16.0, "pgas.buffer-growth": "2"}):
        assert _config.setting("plan-cache-size") == 16 and _config.setting("buffer-growth") == 2.0
    with dask.config.set({"pgas.plan-cache-size": "8", "pgas.buffer-growth": "1.25"}):
        assert _config.setting("plan-cache-size") == 8 and _config.setting("buffer-growth") == 1.25


@pytest.mark.parametrize("timeout", [-1, 0, "bogus", "-5s", float("nan"), float("inf"), 2e9])
def test_bootstrap_refuses_a_bad_timeout_before_looking_for_a_client(timeout):
    with pytest.raises(ValueError, match=r"bootstrap\(timeout=...\) must be a positive duration"):
        dask_pgas.bootstrap(timeout=timeout)


def test_local_mpi_cluster_refuses_env_values_that_are_not_strings():
    with pytest.raises(ValueError, match="env must map variable names to strings"):
        dask_pgas.LocalMPICluster(n_workers=1, env={"OMP_NUM_THREADS": 1})


def test_pe_of_names_a_worker_that_is_not_a_member():
    world = World(3, ("tcp://a:1", "tcp://b:2"), ("mpi",))
    assert world.pe_of("tcp://b:2") == 1
    with pytest.raises(ValueError, match=r"'tcp://c:3' is not a member of PGAS world #3"):
        world.pe_of("tcp://c:3")
    assert world.heap_bytes() == {}


def test_initialize_refuses_what_is_not_an_mpi_communicator():
    """nvmath's own MPIProcessGroup (or anything without mpi4py's methods) is refused with a TypeError that says
    what to pass, before any exchange."""
    from dask_pgas.process_group import communicator_of

    class NvmathLikeGroup:  # nvmath.distributed.MPIProcessGroup's surface: rank, nranks, *_buffer, no Allgather
        rank, nranks = 0, 1

    for other in (NvmathLikeGroup(), object(), 3):
        with pytest.raises(TypeError, match=r"dask_pgas\.MPIProcessGroup"):
            communicator_of(other)
        with pytest.raises(TypeError, match=r"dask_pgas\.MPIProcessGroup"):
            dask_pgas.initialize(None, other, backends=["mpi"])


def test_defaults_survive_a_config_block_around_the_first_import():
    """The integration loads lazily and registers its defaults on first import; a ``dask.config.set`` block
    around that import (as docs/dask.md suggests for LocalMPICluster) removed the whole pgas section on exit,
    and every later rechunk raised a bare KeyError: 'pgas'."""
    import subprocess
    import sys

    code = (
        "import dask, dask.array as da, dask_pgas\n"
        "x = da.ones(10, chunks=5)\n"
        "with dask.config.set({'pgas.fallback': 'tasks'}):\n"
        "    assert dask_pgas.rechunk(x, 2).chunks == ((2,) * 5,)\n"
        "with dask.config.set({'pgas.fallback': 'tasks'}):\n"
        "    assert dask_pgas.rechunk(x, 2).chunks == ((2,) * 5,)\n"
        "try:\n"
        "    dask_pgas.rechunk(x, 2)\n"
        "except dask_pgas.errors.PGASRechunkUnsupported:\n"
        "    pass  # (no client here, and pgas.fallback is back to its default: raise)\n"
        "assert dask.config.get('pgas.fallback') == 'raise'\n"
        "print('OK')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]
