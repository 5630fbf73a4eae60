"""Checks on sets of boxes (does a list of per-rank boxes tile one global domain exactly?) and where a box lies
contiguously inside another (:func:`contiguous_offset`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..distribution import Box

__all__ = ["bounding_box", "contiguous_offset", "tiling_error"]


def bounding_box(boxes: Sequence[Box]) -> Box | None:
    """Smallest box holding every non-empty box, or None when all are empty."""
    full = [b for b in boxes if not b.is_empty]
    if not full:
        return None
    lo = np.min([b.lower for b in full], axis=0)
    up = np.max([b.upper for b in full], axis=0)
    return Box(lo.tolist(), up.tolist())


def tiling_error(boxes: Sequence[Box], what: str = "boxes") -> str | None:
    """None when the non-empty boxes tile their bounding box exactly (no overlap, no hole), else a message
    naming the first offending ranks."""
    full = [(rank, b) for rank, b in enumerate(boxes) if not b.is_empty]
    if len(full) < 2:
        return None
    ranks = np.array([r for r, _ in full])
    lo = np.array([b.lower for _, b in full], dtype=np.int64)
    up = np.array([b.upper for _, b in full], dtype=np.int64)
    # pairwise overlap, vectorised in blocks of rows to bound memory for thousands of ranks
    n, step = len(full), max(1, 4_000_000 // max(1, len(full) * lo.shape[1]))
    for start in range(0, n, step):
        a_lo, a_up = lo[start : start + step, None, :], up[start : start + step, None, :]
        inter = np.all(np.maximum(a_lo, lo[None]) < np.minimum(a_up, up[None]), axis=2)
        idx = np.arange(start, min(start + step, n))
        inter[np.arange(len(idx)), idx] = False
        hit = np.argwhere(inter)
        if len(hit):
            i, j = idx[hit[0, 0]], hit[0, 1]
            return (
                f"{what} of ranks {ranks[i]} and {ranks[j]} overlap: {full[i][1]} and {full[j][1]}"
            )
    bbox = bounding_box([b for _, b in full])
    covered = int(np.prod(up - lo, axis=1, dtype=object).sum())
    if covered != bbox.size:
        return (
            f"{what} leave holes: they cover {covered} of the {bbox.size} elements of their bounding box "
            f"{bbox}"
        )
    return None


def contiguous_offset(whole: Box, piece: Box, order: str = "C") -> int | None:
    """Element offset of ``piece`` inside a dense array holding ``whole`` when the piece is one contiguous run
    of that array's memory (``order`` "C" or "F"), else None."""
    shape, lower = list(piece.box_shape), [p - w for p, w in zip(piece.lower, whole.lower)]
    full = list(whole.box_shape)
    if order == "F":
        shape, lower, full = shape[::-1], lower[::-1], full[::-1]
    k = next((i for i, n in enumerate(shape) if n != 1), len(shape))
    if any(shape[i] != full[i] for i in range(k + 1, len(shape))):
        return None
    offset, stride = 0, 1
    for i in reversed(range(len(full))):
        offset += lower[i] * stride
        stride *= full[i]
    return offset
