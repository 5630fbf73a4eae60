"""Pure geometry: Box and tiling checks (no MPI)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_pgas.distribution import Box, ConvertDistributionError, Slab
from dask_pgas.geometry.boxes import bounding_box, tiling_error


def test_box_basics():
    b = Box((0, 2), (4, 4))
    assert b.box_shape == (4, 2) and b.ndim == 2 and b.size == 8 and not b.is_empty
    assert b == Box([0, 2], np.array([4, 4])) and hash(b) == hash(Box((0, 2), (4, 4)))
    assert pickle.loads(pickle.dumps(b)) == b
    lower, upper = b
    assert (lower, upper) == ((0, 2), (4, 4))
    assert Box.from_any(((0, 0), (1, 1))) == Box((0, 0), (1, 1))
    assert Box((1, 1), (1, 5)).is_empty


def test_box_indexes_and_copies_like_nvmath():
    b = Box((0, 2), (4, 6))
    assert (b[0], b[1], b[-1]) == ((0, 2), (4, 6), (4, 6))
    with pytest.raises(IndexError):
        b[2]
    c = b.copy()
    assert c == b and c is not b and hash(c) == hash(b)


def test_box_shape_and_to_like_nvmath():
    """nvmath's ``Distribution.shape(rank, global_shape)`` is a method (the extent is ``box_shape``, as in nvmath
    1.0), and ``to(Box)`` converts to itself. Without a runtime any rank is taken as this process's own."""
    b = Box((0, 2), (4, 6))
    assert b.shape(0) == b.shape(3, (4, 8)) == b.shape(1, global_shape=[5, 6]) == (4, 4)
    for rank in (-1, 1.0, True, "0"):
        with pytest.raises(ValueError, match="rank must be an integer"):
            b.shape(rank)
    for whole in [(4, 5), (4,), (4, 6, 1)]:
        with pytest.raises(ValueError, match="does not fit"):
            b.shape(0, whole)
    assert b.to(Box) is b and b.to(Box, ndim=2) is b
    c = b.to(Box, copy=True)
    assert c == b and c is not b
    # nvmath 1.0 promotes to more dimensions with trailing size-1 ones, never to fewer
    assert b.to(Box, ndim=3) == Box((0, 2, 0), (4, 6, 1)) and b.to(Box, ndim=4).box_shape == (4, 4, 1, 1)
    assert b.to(Box, ndim=np.int64(3)) == Box((0, 2, 0), (4, 6, 1)) and b.to(Box, ndim=np.int64(2)) is b
    for ndim in (1, 0, 2.0, True):
        with pytest.raises(ValueError, match="ndim"):
            b.to(Box, ndim=ndim)
    for other in (tuple, "Box", None):  # not a distribution class: ValueError, as nvmath's _to_checks
        with pytest.raises(ValueError, match="not a valid distribution"):
            b.to(other)
    assert str(b) == "Box(lower=(0, 2), upper=(4, 6))" and repr(b) == "Box((0, 2), (4, 6))"


def test_slab_follows_nvmath_partition_rule():
    """nvmath's rule: the first s % P processes hold s // P + 1 indices of the partition axis, the others s // P,
    in rank order; the other axes whole."""
    assert [Slab.Y.box(r, 3, (4, 10)) for r in range(3)] == [
        Box((0, 0), (4, 4)), Box((0, 4), (4, 7)), Box((0, 7), (4, 10))]
    assert [Slab.X.box(r, 4, (2, 5)).box_shape for r in range(4)] == [(1, 5), (1, 5), (0, 5), (0, 5)]
    assert Slab.Z.box(1, 2, (3, 1, 5)) == Box((0, 0, 3), (3, 1, 5))
    assert [Slab(0).box(r, 5, (7,)).lower for r in range(5)] == [(0,), (2,), (4,), (5,), (6,)]
    with pytest.raises(ValueError, match="no such axis"):
        Slab.Z.box(0, 2, (4, 4))
    with pytest.raises(ValueError, match="not a valid process rank"):
        Slab.X.box(2, 2, (4,))


def test_slab_api_like_nvmath():
    assert (Slab.X.partition_dim, Slab.Y.partition_dim, Slab.Z.partition_dim) == (0, 1, 2)
    assert Slab.X.ndim is None and Slab(1, ndim=3).ndim == 3 and Slab(1, 3).name == "Slab.Y"
    assert Slab(1, ndim=3) == Slab.Y and Slab(1, 2) != Slab(1, 3) and Slab.X != Slab.Y and Slab.X != Box((0,), (1,))
    assert str(Slab.Y) == "Slab(partition_dim=1, ndim=None)" and repr(Slab.Y) == "Slab.Y"
    assert pickle.loads(pickle.dumps(Slab(2, 4))) == Slab(2, 4)
    assert Slab.X.to(Slab) is Slab.X and Slab.X.to(Slab, ndim=2) == Slab(0, 2) and Slab.X.to(Slab, ndim=2).ndim == 2
    assert Slab.X.to(Slab, copy=True) is not Slab.X
    assert Slab(0, 2).to(Slab, ndim=3).ndim == 3 and Slab(0, 2).to(Slab, ndim=2).ndim == 2
    assert Slab.X.to(Slab, ndim=np.int32(2)) == Slab(0, 2) and type(Slab.X.to(Slab, ndim=np.int32(2)).ndim) is int
    with pytest.raises(ValueError, match="never fewer"):
        Slab(0, 3).to(Slab, ndim=2)
    for bad in [(-1, None), (True, None), (2, 2), (0, 0)]:
        with pytest.raises(ValueError):
            Slab(*bad)
    with pytest.raises(ConvertDistributionError):
        Slab.X.to(Box)
    with pytest.raises(ConvertDistributionError):
        Box((0,), (1,)).to(Slab)
    with pytest.raises(ValueError, match="not a valid distribution"):
        Slab.X.to(tuple)
    with pytest.raises(RuntimeError, match="global_shape"):
        Slab.X.shape(0)
    import dask_pgas  # (not initialized in this process: these tests start no runtime)

    assert dask_pgas.get_context() is None
    with pytest.raises(dask_pgas.errors.NotInitializedError, match="initialize"):  # as every other call before it
        Slab.X.shape(0, (4, 4))


@pytest.mark.parametrize(
    ("lower", "upper", "error"),
    [((0,), (1, 2), ValueError), ((2,), (1,), ValueError), ((), (), ValueError), ((0.5,), (1,), ValueError),
     (3, 4, ValueError), ((0,), (2**63,), ValueError), ((-(2**63) - 1,), (0,), ValueError)],
)
def test_box_rejects(lower, upper, error):
    with pytest.raises(error):
        Box(lower, upper)


def test_intersection_and_relative_slices():
    a, b = Box((0, 0), (4, 4)), Box((2, 3), (6, 8))
    assert a.intersection(b) == Box((2, 3), (4, 4))
    assert a.intersection(Box((4, 0), (5, 4))) is None
    assert Box((2, 3), (4, 4)).relative_to(b) == (slice(0, 2), slice(0, 1))
    with pytest.raises(ValueError):
        a.intersection(Box((0,), (1,)))


def test_tiling_errors_name_the_ranks():
    good = [Box((0, 0), (2, 4)), Box((2, 0), (4, 4)), Box((0, 0), (0, 0))]
    assert tiling_error(good) is None
    assert bounding_box(good) == Box((0, 0), (4, 4))
    overlap = [Box((0, 0), (3, 4)), Box((2, 0), (4, 4))]
    assert "ranks 0 and 1 overlap" in tiling_error(overlap)
    hole = [Box((0, 0), (1, 4)), Box((2, 0), (4, 4))]
    assert "holes" in tiling_error(hole)
    assert bounding_box([Box((1,), (1,))]) is None


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_tiling_error_matches_a_dense_count(data):
    ndim = data.draw(st.integers(1, 3))
    nboxes = data.draw(st.integers(1, 6))
    boxes = []
    for _ in range(nboxes):
        lo = data.draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim))
        ext = data.draw(st.lists(st.integers(0, 3), min_size=ndim, max_size=ndim))
        boxes.append(Box(lo, [a + b for a, b in zip(lo, ext)]))
    grid = np.zeros((8,) * ndim, dtype=int)
    for b in boxes:
        grid[tuple(slice(lo_, up_) for lo_, up_ in zip(b.lower, b.upper))] += 1
    bbox = bounding_box(boxes)
    if bbox is None:
        assert tiling_error(boxes) is None
        return
    inside = grid[tuple(slice(lo_, up_) for lo_, up_ in zip(bbox.lower, bbox.upper))]
    exact = bool((inside == 1).all())
    assert (tiling_error(boxes) is None) == exact


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_contiguous_offset_matches_numpy(data):
    from dask_pgas.geometry.boxes import contiguous_offset

    ndim = data.draw(st.integers(1, 4))
    shape = data.draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim))
    origin = data.draw(st.lists(st.integers(-3, 3), min_size=ndim, max_size=ndim))
    whole = Box(origin, [o + n for o, n in zip(origin, shape)])
    lo = [data.draw(st.integers(o, o + n - 1)) for o, n in zip(origin, shape)]
    up = [data.draw(st.integers(a + 1, o + n)) for a, o, n in zip(lo, origin, shape)]
    piece = Box(lo, up)
    order = data.draw(st.sampled_from("CF"))
    index = np.arange(int(np.prod(shape))).reshape(shape, order=order)  # memory position of each element
    positions = np.sort(index[piece.relative_to(whole)].ravel())
    runs = bool(np.all(np.diff(positions) == 1))
    got = contiguous_offset(whole, piece, order)
    assert (got is not None) == runs
    if got is not None:
        assert got == positions[0]
