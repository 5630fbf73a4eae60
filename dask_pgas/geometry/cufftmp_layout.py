"""How an N-D reshape of any element size is described to cuFFTMp (3-D boxes of 4, 8 or 16-byte words).

Pure functions (no CUDA): the GPU engine calls :func:`cufftmp_layout` on every rank with the same, validated boxes,
so every rank derives the same 3-D description. Steps:

1. Fortran order: reverse the axes (cuFFTMp's strides are row-major).
2. Shift coordinates so the global domain (the bounding box of the non-empty boxes) starts at 0.
3. Merge neighbouring axes ``(i, i+1)`` wherever every non-empty box either spans axis ``i+1`` entirely or has
   extent 1 on axis ``i``: the two axes then address one contiguous run per box.
4. Express the innermost axis in bytes and cut it into the widest word (16, 8 or 4 bytes) that divides every box's
   innermost bounds: 1- and 2-byte elements are packed, 32-byte elements are split, and so on.
5. Pad to 3 axes in front (lower 0, upper 1). More than 3 axes left: :class:`UnsupportedLayout`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..distribution import Box

__all__ = ["CuFFTMpLayout", "UnsupportedLayout", "cufftmp_layout", "dense_strides", "merge_axes", "pack_words"]

WORDS = (16, 8, 4)


class UnsupportedLayout(ValueError):
    """The boxes cannot be described to cuFFTMp (too many unmergeable axes or an unpackable element size)."""


@dataclass(frozen=True)
class CuFFTMpLayout:
    """Per-rank 3-D input/output boxes (lower, upper, strides) in words of ``word_size`` bytes."""

    word_size: int
    input: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...]
    output: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...]
    domain: tuple[int, int, int]
    empty_input_ranks: tuple[int, ...]
    empty_output_ranks: tuple[int, ...]

    @property
    def has_empty(self) -> bool:
        return bool(self.empty_input_ranks or self.empty_output_ranks)


def dense_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides (in elements) of a dense array of ``shape``; extents of 0 count as 1."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(out))


def merge_axes(
    boxes: Sequence[tuple[Sequence[int], Sequence[int]]], domain: Sequence[int]
) -> tuple[list[tuple[list[int], list[int]]], list[int]]:
    """Merge neighbouring axes where every box allows it. ``boxes`` are (lower, upper) pairs relative to a domain
    starting at 0 (non-empty boxes only). Returns the merged boxes and the merged domain extents."""
    boxes = [(list(lo), list(up)) for lo, up in boxes]
    dom = list(domain)
    i = len(dom) - 2
    while i >= 0:
        inner = dom[i + 1]
        ok = all((lo[i + 1] == 0 and up[i + 1] == inner) or (up[i] - lo[i] <= 1) for lo, up in boxes)
        if ok:
            for lo, up in boxes:
                a = lo[i] * inner + lo[i + 1]
                # with extent <= 1 on axis i the run is [lo_i*inner + lo_{i+1}, lo_i*inner + up_{i+1})
                b = (up[i] - 1) * inner + up[i + 1] if up[i] > lo[i] else a
                lo[i : i + 2] = [a]
                up[i : i + 2] = [b]
            dom[i : i + 2] = [dom[i] * inner]
        i -= 1
    return boxes, dom


def pack_words(
    boxes: Sequence[tuple[Sequence[int], Sequence[int]]], domain: Sequence[int], itemsize: int
) -> tuple[int, list[tuple[list[int], list[int]]], list[int]]:
    """Re-express the innermost axis in words of 16, 8 or 4 bytes (the widest that divides every bound)."""
    edges = {domain[-1] * itemsize}
    for lo, up in boxes:
        edges.add(lo[-1] * itemsize)
        edges.add(up[-1] * itemsize)
    for w in WORDS:
        if all(e % w == 0 for e in edges):
            break
    else:
        raise UnsupportedLayout(
            f"cuFFTMp moves 4, 8 or 16-byte words; elements of {itemsize} bytes cannot be packed into words "
            f"because the innermost box bounds (in bytes: {sorted(edges)}) are not all multiples of 4; use boxes "
            "whose innermost bounds are multiples of "
            f"{4 // math.gcd(4, itemsize)} elements, or a wider dtype"
        )
    out = []
    for lo, up in boxes:
        out.append(([*lo[:-1], lo[-1] * itemsize // w], [*up[:-1], up[-1] * itemsize // w]))
    return w, out, [*domain[:-1], domain[-1] * itemsize // w]


def _box_bounds(box: Box, order: str) -> tuple[list[int], list[int]]:
    lo, up = list(box.lower), list(box.upper)
    if order == "F":
        lo.reverse()
        up.reverse()
    return lo, up


def cufftmp_layout(
    input_boxes: Sequence[Box], output_boxes: Sequence[Box], itemsize: int, order: str = "C"
) -> CuFFTMpLayout:
    """The 3-D cuFFTMp description of a validated reshape (see the module docstring)."""
    if order not in ("C", "F"):
        raise ValueError(f"order must be 'C' or 'F', not {order!r}")
    nranks = len(input_boxes)
    all_boxes = list(input_boxes) + list(output_boxes)
    ndim = all_boxes[0].ndim
    full = [(i, _box_bounds(b, order)) for i, b in enumerate(all_boxes) if not b.is_empty]
    empty_in = tuple(r for r, b in enumerate(input_boxes) if b.is_empty)
    empty_out = tuple(r for r, b in enumerate(output_boxes) if b.is_empty)
    if not full:  # nothing anywhere
        zero = ((0, 0, 0), (0, 0, 0), (1, 1, 1))
        return CuFFTMpLayout(4, (zero,) * nranks, (zero,) * nranks, (0, 0, 0), empty_in, empty_out)
    base = [min(lo[d] for _, (lo, _) in full) for d in range(ndim)]
    top = [max(up[d] for _, (_, up) in full) for d in range(ndim)]
    rel = [([a - o for a, o in zip(lo, base)], [b - o for b, o in zip(up, base)]) for _, (lo, up) in full]
    domain = [t - b for t, b in zip(top, base)]
    merged, mdom = merge_axes(rel, domain)
    word, packed, pdom = pack_words(merged, mdom, itemsize)
    if len(pdom) > 3:
        raise UnsupportedLayout(
            f"cuFFTMp reshapes at most 3 axes; these {ndim}-D boxes leave {len(pdom)} axes after merging the "
            "axes that every box spans entirely (a box must span all but its 3 outermost non-mergeable axes)"
        )
    pad = 3 - len(pdom)
    domain3 = tuple([1] * pad + pdom)
    result: list = [None] * (2 * nranks)
    for (i, _), (lo, up) in zip(full, packed):
        lo3 = tuple([0] * pad + lo)
        up3 = tuple([1] * pad + up)
        result[i] = (lo3, up3, dense_strides([b - a for a, b in zip(lo3, up3)]))
    for i in range(2 * nranks):
        if result[i] is None:
            result[i] = ((0, 0, 0), (0, 0, 0), (1, 1, 1))
    return CuFFTMpLayout(word, tuple(result[:nranks]), tuple(result[nranks:]), domain3, empty_in, empty_out)
