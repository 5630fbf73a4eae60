"""Chunk grids <-> one Box per PE: the pure planning behind ``dask_pgas.rechunk``.

A Dask array's chunk grid (``chunks``: one tuple of sizes per axis) is cut into one input Box per PE and the
target grid into one output Box per PE, so that a single collective reshape moves the data:

* boxes are found by recursive bisection of the index space: the PEs are split in two groups and the region
  is cut at the chunk boundary closest to the groups' share of the volume (the axis with the best cut wins),
  so boxes are balanced and aligned to chunk boundaries;
* output boxes are always chunk-aligned (every output chunk is built on exactly one PE); with fewer output
  chunks than PEs some PEs get an empty output box;
* input boxes may cut through a chunk when a region holds a single chunk but several PEs (fewer input chunks
  than PEs), so every PE takes part in moving the data;
* owner awareness: when the location (PE) of input chunks is known, candidate input boxes are matched to the
  PEs that already hold most of their bytes, and output boxes to the PEs whose input box overlaps them most,
  so data already in place is neither moved by Dask first nor sent over the network. Of the candidate
  decompositions the one moving the fewest bytes wins, a byte that Dask moves to its box's PE counting
  :data:`DASK_BYTE_COST` times one the collective moves; so scattered inputs (a random placement) that Dask
  must gather anyway go straight to their output PE rather than through the collective afterwards;
* local plans: when the input boxes also fall on output chunk boundaries they are the output boxes too, so no
  element changes PE (``ChunkPlan.is_local``, always so with one PE) and no collective is needed.

Pure Python + NumPy (and dask.array's pure chunk helpers): no MPI, CUDA or distributed imports.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..distribution import Box

__all__ = [
    "ChunkPlan", "InputPiece", "OutputPiece", "bisect_boxes", "chunk_sources", "match_owners", "plan_chunks",
]

#: cost of a byte moved by Dask (to the PE of its input box, before the collective) relative to a byte moved
#: by the collective. Dask's transfers ran at about a tenth of the collective's speed on CPUs (S1: 0.6 against
#: 6 GB/s) and far less on GPUs; a lower figure keeps a few percent of placement noise from deciding.
DASK_BYTE_COST = 4.0

Chunks = tuple[tuple[int, ...], ...]
Index = tuple[int, ...]
Slices = tuple[slice, ...]


@dataclass(frozen=True)
class InputPiece:
    """Part of input chunk ``index`` (``chunk_slices`` of it) that lands at ``box_slices`` of a PE's box."""

    index: Index
    chunk_slices: Slices
    box_slices: Slices


@dataclass(frozen=True)
class OutputPiece:
    """Output chunk ``index`` is ``box_slices`` of its owner's output box."""

    index: Index
    box_slices: Slices


@dataclass(frozen=True)
class ChunkPlan:
    """Where every byte goes: one input and one output Box per PE and the chunk pieces of each."""

    shape: tuple[int, ...]
    chunks_in: Chunks
    chunks_out: Chunks
    input_boxes: tuple[Box, ...]
    output_boxes: tuple[Box, ...]
    #: per PE: the input chunk pieces packed into its input box
    inputs: tuple[tuple[InputPiece, ...], ...]
    #: per PE: the output chunks cut out of its output box
    outputs: tuple[tuple[OutputPiece, ...], ...]

    @property
    def npes(self) -> int:
        return len(self.input_boxes)

    def output_owner(self) -> dict[Index, int]:
        """Output chunk index -> PE (only non-empty chunks)."""
        return {p.index: pe for pe, pieces in enumerate(self.outputs) for p in pieces}

    def shared_chunks(self) -> set[Index]:
        """Input chunks that the input boxes share out between several PEs."""
        takers: dict[Index, set[int]] = {}
        for pe, pieces in enumerate(self.inputs):
            for p in pieces:
                takers.setdefault(p.index, set()).add(pe)
        return {index for index, pes in takers.items() if len(pes) > 1}

    @property
    def is_local(self) -> bool:
        """No element changes PE: every PE's output box is its input box (always so with one PE)."""
        return self.moved_elements() == 0

    def region_of(self, indices) -> Box:
        """The smallest box aligned to output chunk boundaries that holds the output chunks ``indices``."""
        bounds = _bounds(self.chunks_out)
        return Box(tuple(int(b[min(i[a] for i in indices)]) for a, b in enumerate(bounds)),
                   tuple(int(b[max(i[a] for i in indices) + 1]) for a, b in enumerate(bounds)))

    def restricted(self, region: Box) -> ChunkPlan:
        """The plan for the elements in ``region`` only (a box aligned to output chunk boundaries): each PE keeps
        the part of its boxes inside ``region`` (an empty box elsewhere), so every output chunk inside it is
        built on the same PE as in this plan, from a smaller exchange. Output chunks outside it have no piece."""
        if not _aligned(region, _bounds(self.chunks_out)):
            raise ValueError(f"{region} does not lie on output chunk boundaries")

        def clip(box: Box) -> Box:
            common = box.intersection(region)
            return common if common is not None else Box(region.lower, region.lower)

        return _plan_from_boxes(self.chunks_in, self.chunks_out, [clip(b) for b in self.input_boxes],
                                [clip(b) for b in self.output_boxes])

    def moved_elements(self) -> int:
        """Elements that change PE (what crosses the network)."""
        return sum(
            b.size - (b.intersection(self.output_boxes[pe]) or Box(b.lower, b.lower)).size
            for pe, b in enumerate(self.input_boxes)
        )


def _bounds(chunks: Chunks) -> list[np.ndarray]:
    return [np.concatenate(([0], np.cumsum(c, dtype=np.int64))) for c in chunks]


def _bisect(
    lo: tuple[int, ...],
    up: tuple[int, ...],
    npes: int,
    bounds: list[np.ndarray],
    split_chunks: bool,
    out: list[tuple[tuple[int, ...], tuple[int, ...]]],
    prefer_axis: int | None = None,
) -> None:
    if npes == 1:
        out.append((lo, up))
        return
    ext = [u - lo_ for lo_, u in zip(lo, up)]
    if math.prod(ext) == 0:
        out.extend([(lo, up)] + [(lo, lo)] * (npes - 1))
        return
    share = (npes // 2) / npes
    best = None  # (not the preferred axis, error, -chunks on axis, axis, cut)
    for ax, b in enumerate(bounds):
        if ext[ax] < 2:
            continue
        i = int(np.searchsorted(b, lo[ax], side="right"))
        j = int(np.searchsorted(b, up[ax], side="left"))
        interior = b[i:j]  # chunk boundaries strictly inside (lo, up)
        if interior.size == 0:
            continue
        target = lo[ax] + share * ext[ax]
        k = int(np.searchsorted(interior, target))
        for c in interior[max(k - 1, 0) : k + 1]:
            key = (ax != prefer_axis, abs((int(c) - lo[ax]) / ext[ax] - share), -interior.size, ax, int(c))
            if best is None or key < best:
                best = key
    if best is None:
        if not split_chunks:
            # one chunk for several PEs and chunks must stay whole: one PE builds it, the others get nothing
            out.extend([(lo, up)] + [(lo, lo)] * (npes - 1))
            return
        if prefer_axis is not None and ext[prefer_axis] >= 2:  # slabs along the preferred axis, as above
            ax = prefer_axis
        else:
            ax = max(range(len(ext)), key=lambda a: (ext[a], -a))
        if ext[ax] < 2:
            out.extend([(lo, up)] + [(lo, lo)] * (npes - 1))
            return
        cut = lo[ax] + min(max(round(share * ext[ax]), 1), ext[ax] - 1)
    else:
        _, _, _, ax, cut = best
    frac = (cut - lo[ax]) / ext[ax]
    p1 = min(max(round(npes * frac), 1), npes - 1)
    up1 = tuple(cut if a == ax else u for a, u in enumerate(up))
    lo2 = tuple(cut if a == ax else lo_ for a, lo_ in enumerate(lo))
    _bisect(lo, up1, p1, bounds, split_chunks, out, prefer_axis)
    _bisect(lo2, up, npes - p1, bounds, split_chunks, out, prefer_axis)


def bisect_boxes(
    chunks: Chunks, npes: int, *, split_chunks: bool = False, prefer_axis: int | None = None
) -> list[Box]:
    """``npes`` boxes tiling the array of ``chunks``, balanced by volume and aligned to chunk boundaries.

    With ``split_chunks`` a region holding a single chunk but several PEs is cut inside the chunk (so every PE
    gets data); otherwise such PEs get an empty box. ``prefer_axis`` cuts along that axis whenever it can
    (slabs), otherwise the best-balanced cut wins.
    """
    if npes < 1:
        raise ValueError(f"need at least one PE, got {npes}")
    shape = tuple(int(sum(c)) for c in chunks)
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    _bisect((0,) * len(shape), shape, npes, _bounds(chunks), split_chunks, out, prefer_axis)
    return [Box(lo, up) for lo, up in out]


def match_owners(weights: np.ndarray) -> list[int]:
    """Greedy matching of boxes (rows) to PEs (columns) by decreasing weight; returns PE -> box."""
    n = weights.shape[0]
    pe_to_box = [-1] * n
    used_box = [False] * n
    order = np.argsort(-weights, axis=None, kind="stable")
    left = n
    for flat in order:
        if left == 0:
            break
        box, pe = divmod(int(flat), n)
        if used_box[box] or pe_to_box[pe] != -1:
            continue
        pe_to_box[pe] = box
        used_box[box] = True
        left -= 1
    return pe_to_box


def _aligned(box: Box, bounds: list[np.ndarray]) -> bool:
    """Whether every face of ``box`` lies on a chunk boundary (``bounds`` from :func:`_bounds`)."""
    if box.is_empty:
        return True
    return all(
        int(b[np.searchsorted(b, lo)]) == lo and int(b[np.searchsorted(b, up)]) == up
        for b, lo, up in zip(bounds, box.lower, box.upper)
    )


def _axis_pieces(axis_chunks: tuple[int, ...], lo: int, up: int, bounds: np.ndarray | None = None
                 ) -> list[tuple[int, slice]]:
    """(chunk index, slice of that chunk) of the chunks along one axis that intersect ``[lo, up)``.

    Dask's ``old_to_new`` over the chunks that can meet ``[lo, up)`` only (found in the axis' cumulative
    ``bounds``), so the cost follows the box, not the axis."""
    from dask.array.rechunk import old_to_new

    b = _bounds((axis_chunks,))[0] if bounds is None else bounds
    i = int(np.searchsorted(b, lo, side="right")) - 1  # the last chunk that starts at or before lo
    j = int(np.searchsorted(b, up, side="left"))  # chunks i .. j-1 cover [lo, up)
    start, stop = int(b[i]), int(b[j])
    (per_new,) = old_to_new((axis_chunks[i:j],), ((lo - start, up - lo, stop - up),))
    return [(i + k, s) for k, s in per_new[1] if s.stop > s.start]


def _box_pieces(chunks: Chunks, box: Box, bounds: list[np.ndarray] | None = None
                ) -> list[tuple[Index, Slices, Slices]]:
    """(chunk index, slices of the chunk, slices of the box) for every chunk meeting ``box``."""
    import itertools

    if box.is_empty:
        return []
    bounds = _bounds(chunks) if bounds is None else bounds
    per_axis = []
    for ax, (lo, up) in enumerate(zip(box.lower, box.upper)):
        pieces = []
        for i, s in _axis_pieces(chunks[ax], lo, up, bounds[ax]):
            start = int(bounds[ax][i]) + s.start - lo
            pieces.append((i, s, slice(start, start + s.stop - s.start)))
        per_axis.append(pieces)
    return [tuple(zip(*parts)) for parts in itertools.product(*per_axis)]


def plan_chunks(
    chunks_in: Chunks,
    chunks_out: Chunks,
    npes: int,
    input_locations: Mapping[Index, int] | None = None,
) -> ChunkPlan:
    """Plan a rechunk from ``chunks_in`` to ``chunks_out`` over ``npes`` PEs.

    ``input_locations`` maps input chunk indices to the PE that already holds them (a persisted array, or
    the output of an earlier pgas rechunk); boxes are then given to the PEs holding most of their bytes.
    """
    chunks_in = tuple(tuple(int(c) for c in axis) for axis in chunks_in)
    chunks_out = tuple(tuple(int(c) for c in axis) for axis in chunks_out)
    locs = tuple(sorted(input_locations.items())) if input_locations else ()
    return _plan_cached(chunks_in, chunks_out, int(npes), locs)


@lru_cache(maxsize=64)
def _plan_cached(chunks_in: Chunks, chunks_out: Chunks, npes: int, locs: tuple) -> ChunkPlan:
    shape = tuple(sum(c) for c in chunks_in)
    if shape != tuple(sum(c) for c in chunks_out):
        raise ValueError(f"input chunks cover shape {shape}, output chunks {tuple(sum(c) for c in chunks_out)}")
    out_boxes = bisect_boxes(chunks_out, npes, split_chunks=False)
    # candidate input decompositions: balanced, or (up to 64 PEs) slabs along each axis; the one that moves the
    # fewest bytes (Dask's moves weighted by DASK_BYTE_COST, the collective's) wins, the balanced one on a tie
    owner_grid = None
    if locs:
        owner_grid = np.full(tuple(len(c) for c in chunks_in), -1, dtype=np.int64)
        index = np.array([k for k, _ in locs], dtype=np.int64).reshape(len(locs), len(chunks_in))
        pes = np.array([v for _, v in locs], dtype=np.int64)
        ok = (pes >= 0) & (pes < npes)
        owner_grid[tuple(index[ok].T)] = pes[ok]
    bounds_in, bounds_out = _bounds(chunks_in), _bounds(chunks_out)
    best = None
    total = float(math.prod(shape))
    candidates = (None, *range(len(shape))) if npes <= 64 else (None,)
    for prefer in candidates:
        boxes = bisect_boxes(chunks_in, npes, split_chunks=True, prefer_axis=prefer)
        weights = np.zeros((npes, npes))
        if owner_grid is not None:
            for k, b in enumerate(boxes):
                if b.is_empty:
                    continue
                sel, overlap = [], np.ones(())
                for bo, lo_, up_ in zip(bounds_in, b.lower, b.upper):
                    i = int(np.searchsorted(bo, lo_, side="right")) - 1
                    j = int(np.searchsorted(bo, up_, side="left"))
                    sel.append(slice(i, j))
                    # elements of each chunk along this axis that lie in the box (a box may cut a chunk)
                    width = np.minimum(bo[i + 1 : j + 1], up_) - np.maximum(bo[i:j], lo_)
                    overlap = np.multiply.outer(overlap, width.astype(np.float64))
                own, sz = owner_grid[tuple(sel)].ravel(), overlap.ravel()
                known = own >= 0
                weights[k] = np.bincount(own[known], weights=sz[known], minlength=npes)[:npes]
        order = match_owners(weights)
        local = sum(weights[order[pe], pe] for pe in range(npes))
        boxes = [boxes[k] for k in order]
        if all(_aligned(b, bounds_out) for b in boxes):
            # the input boxes are output-chunk-aligned too: they are the output boxes, nothing crosses PEs
            outs, stay = list(boxes), total
        else:
            overlap = np.zeros((npes, npes))
            for k, ob in enumerate(out_boxes):
                for pe, ib in enumerate(boxes):
                    common = ob.intersection(ib)
                    if common is not None:
                        overlap[k, pe] = common.size
            out_order = match_owners(overlap)
            stay = sum(overlap[out_order[pe], pe] for pe in range(npes))
            outs = [out_boxes[k] for k in out_order]
        cost = DASK_BYTE_COST * (total - local) + (total - stay)
        score = (-cost, prefer is None)
        if best is None or score > best[0]:
            best = (score, boxes, outs)
    _, in_boxes, out_boxes = best
    return _plan_from_boxes(chunks_in, chunks_out, in_boxes, out_boxes)


def _plan_from_boxes(chunks_in: Chunks, chunks_out: Chunks, in_boxes, out_boxes) -> ChunkPlan:
    """The plan of these boxes (output boxes aligned to output chunks): the chunk pieces of every box."""
    bounds_in, bounds_out = _bounds(chunks_in), _bounds(chunks_out)
    inputs = tuple(tuple(InputPiece(i, cs, bs) for i, cs, bs in _box_pieces(chunks_in, b, bounds_in))
                   for b in in_boxes)
    outputs = []
    for ob in out_boxes:
        pieces = []
        for index, chunk_slices, box_slices in _box_pieces(chunks_out, ob, bounds_out):
            # output boxes are chunk-aligned: each chunk lies whole inside one box
            full = all(s.start == 0 and s.stop == chunks_out[ax][index[ax]] for ax, s in enumerate(chunk_slices))
            if not full:  # pragma: no cover - guarded by bisect_boxes(split_chunks=False) and restricted()
                raise AssertionError(f"output chunk {index} is split between PEs")
            pieces.append(OutputPiece(index, box_slices))
        outputs.append(tuple(pieces))
    return ChunkPlan(
        shape=tuple(sum(c) for c in chunks_in),
        chunks_in=chunks_in,
        chunks_out=chunks_out,
        input_boxes=tuple(in_boxes),
        output_boxes=tuple(out_boxes),
        inputs=inputs,
        outputs=tuple(outputs),
    )


def chunk_sources(chunks_in: Chunks, chunks_out: Chunks):
    """For every output chunk (C order): ``(index, [(input index, input chunk slices, output chunk slices)])``.

    Dask's own ``old_to_new`` intersection per axis; zero-width pieces are left out.
    """
    import itertools

    from dask.array.rechunk import old_to_new

    per_axis = []
    for axis in old_to_new(chunks_in, chunks_out):
        lists = []
        for pieces in axis:
            placed, pos = [], 0
            for i, s in pieces:
                width = s.stop - s.start
                if width:
                    placed.append((i, s, slice(pos, pos + width)))
                pos += width
            lists.append(placed)
        per_axis.append(lists)
    for index in np.ndindex(*(len(c) for c in chunks_out)):
        parts = itertools.product(*(per_axis[ax][i] for ax, i in enumerate(index)))
        yield index, [tuple(zip(*part)) for part in parts]
