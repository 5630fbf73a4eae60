"""xarray on top: ``DataArray.chunk`` and ``Dataset.chunk`` of Dask-backed variables call ``Array.rechunk``, so
with :func:`dask_pgas.install` and config ``array.rechunk.method: pgas`` they run one collective per variable,
with the coordinates, dimension names and attributes xarray keeps beside the data."""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import pytest

import dask_pgas

from ._xp import host, on_device

xr = pytest.importorskip("xarray")  # (the test extra installs it; the GPU machine has none)

pytestmark = [pytest.mark.dask, pytest.mark.timeout(300)]


@pytest.fixture
def pgas_method():
    dask_pgas.install()
    try:
        with dask.config.set({"array.rechunk.method": "pgas"}):
            yield
    finally:
        dask_pgas.uninstall()


def _runs(client) -> int:
    """Collective runs so far on PE 0 of the world."""
    info = dask_pgas.world(client, detail=True).info
    return next(iter(info.values())).get("runs", 0)


def _rechunked_by_pgas(var) -> bool:
    return var.data.name.startswith("pgas-rechunk-")  # (the name of every pgas rechunk's output)


def test_dataarray_and_dataset_chunk_run_pgas(client, pgas_method):
    ref = np.random.default_rng(3).random((60, 44))
    coords = {"y": np.arange(60) * 0.5, "x": np.arange(44) - 7}
    a = xr.DataArray(on_device(da.from_array(ref, chunks=(60, 11))), dims=("y", "x"), coords=coords,
                     name="t", attrs={"units": "K"}).persist()

    b = a.chunk({"y": 20, "x": -1})
    assert _rechunked_by_pgas(b) and b.chunks == ((20, 20, 20), (44,))
    assert b.attrs == {"units": "K"} and b.name == "t" and b.dims == ("y", "x")
    np.testing.assert_array_equal(b.y.values, coords["y"])
    np.testing.assert_array_equal(host(b.data.compute()), ref)
    # lazy and composable: a reduction over the rechunked variable, by dimension name
    np.testing.assert_allclose(host(b.mean("x").data.compute()), ref.mean(axis=1))

    with dask.config.set({"pgas.local-rechunk": False}):  # (collective runs on a world of any size, counted)
        ds = xr.Dataset({"t": a, "u": a * 2 + 1}).chunk({"y": 15, "x": 44})
    assert all(_rechunked_by_pgas(v) for v in ds.data_vars.values()), ds
    assert ds.chunks == {"y": (15, 15, 15, 15), "x": (44,)}
    before = _runs(client)
    t, u = dask.compute(ds.t.data, ds.u.data)
    np.testing.assert_array_equal(host(t), ref)
    np.testing.assert_array_equal(host(u), ref * 2 + 1)
    assert _runs(client) - before == 2  # one collective per variable
    back = ds.chunk({"y": -1, "x": 11})  # and back to column slabs
    assert _rechunked_by_pgas(back.t)
    np.testing.assert_array_equal(host(back.t.data.compute()), ref)


def test_chunk_without_install_stays_dask(client):
    """Opt-in: without install() the config value is not consulted by dask_pgas, and xarray's chunk runs Dask's
    own rechunk (``tasks``) whatever else is set."""
    a = xr.DataArray(on_device(da.from_array(np.arange(120.0).reshape(12, 10), chunks=(12, 5))), dims=("y", "x"))
    b = a.chunk({"y": 4, "x": -1})
    assert not _rechunked_by_pgas(b)
    np.testing.assert_array_equal(host(b.data.compute()), np.arange(120.0).reshape(12, 10))


def test_chunk_takes_pgas_only_where_the_config_says_so(client):
    """Installed, dask_pgas is consulted only for ``array.rechunk.method: pgas``: with ``tasks`` (or no setting)
    xarray's chunk runs Dask's own rechunk; after ``uninstall()`` the config value ``pgas`` is Dask's unknown
    method again."""
    ref = np.arange(120.0).reshape(12, 10)
    a = xr.DataArray(on_device(da.from_array(ref, chunks=(12, 5))), dims=("y", "x"))
    dask_pgas.install()
    try:
        for method in ("tasks", None):
            with dask.config.set({"array.rechunk.method": method}):
                b = a.chunk({"y": 4, "x": -1})
            assert not _rechunked_by_pgas(b), method
            np.testing.assert_array_equal(host(b.data.compute()), ref)
        with dask.config.set({"array.rechunk.method": "pgas"}):
            assert _rechunked_by_pgas(a.chunk({"y": 4, "x": -1}))
    finally:
        dask_pgas.uninstall()
    with dask.config.set({"array.rechunk.method": "pgas"}), \
            pytest.raises(NotImplementedError, match="Unknown rechunking method 'pgas'"):
        a.chunk({"y": 4, "x": -1})
