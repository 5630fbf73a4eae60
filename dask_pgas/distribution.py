"""Box distributions: the part of a global array that one process holds.

Mirrors ``nvmath.distributed.distribution.Box``: ``lower`` is inclusive, ``upper`` exclusive, both in global
coordinates, any number of dimensions; ``box_shape`` is its extent and ``shape(rank, global_shape)`` the local
shape as nvmath's ``Distribution.shape``. nvmath 1.0's names for the reshape, ``redistribute`` /
``Redistribute`` / ``RedistributeOptions``, are here too (loaded from :mod:`dask_pgas.reshape` on first use).
Pure Python: no MPI, CUDA or Dask here.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence

__all__ = ["Box", "Redistribute", "RedistributeOptions", "redistribute"]  # noqa: F822 (the last three: __getattr__)

#: nvmath 1.0 moved ``nvmath.distributed.reshape.reshape`` to ``nvmath.distributed.distribution.redistribute``
_REDISTRIBUTE = ("Redistribute", "RedistributeOptions", "redistribute")


def _coords(values: Iterable[int], name: str) -> tuple[int, ...]:
    try:
        out = tuple(operator.index(v) for v in values)
    except TypeError as exc:  # a ValueError, as nvmath raises for coordinates that are not integers
        raise ValueError(f"Box {name} must be a sequence of integers, got {values!r}") from exc
    return out


class Box:
    """A rectangular section ``[lower, upper)`` of a global array.

    >>> Box((0, 2), (4, 4)).box_shape
    (4, 2)
    """

    __slots__ = ("_lower", "_upper")

    def __init__(self, lower: Sequence[int], upper: Sequence[int]) -> None:
        lo, up = _coords(lower, "lower"), _coords(upper, "upper")
        if len(lo) != len(up):
            raise ValueError(f"Box lower {lo} and upper {up} have different lengths")
        if len(lo) == 0:
            raise ValueError("Box needs at least one dimension")
        if any(up_ < lo_ for lo_, up_ in zip(lo, up)):
            raise ValueError(f"Box upper {up} is below lower {lo} in some dimension; upper is exclusive")
        self._lower = lo
        self._upper = up

    @classmethod
    def from_any(cls, value: Box | Sequence[Sequence[int]]) -> Box:
        """A Box, or a ``(lower, upper)`` pair, as a Box."""
        if isinstance(value, Box):
            return value
        try:
            lower, upper = value
        except (TypeError, ValueError) as exc:
            raise TypeError(f"expected a Box or a (lower, upper) pair, got {value!r}") from exc
        return cls(lower, upper)

    @property
    def lower(self) -> tuple[int, ...]:
        return self._lower

    @property
    def upper(self) -> tuple[int, ...]:
        return self._upper

    @property
    def ndim(self) -> int:
        return len(self._lower)

    @property
    def box_shape(self) -> tuple[int, ...]:
        """The box's extent, ``upper - lower`` (as nvmath 1.0's ``Box.box_shape``)."""
        return tuple(up_ - lo_ for lo_, up_ in zip(self._lower, self._upper))

    def shape(self, rank: int, global_shape: Sequence[int] | None = None) -> tuple[int, ...]:
        """The local shape of process ``rank`` under this distribution, as nvmath's ``Distribution.shape``.

        A Box is one process's own piece, so ``rank`` must be this process's rank once the runtime is up (as in
        nvmath, the shape of a peer's piece cannot be known from this process's box). ``global_shape``, when
        given, must contain the box. Unlike nvmath, ``global_shape`` may be left out: a Box is never bound.
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be an integer >= 0, got {rank!r}")
        from .runtime import get_context  # (imports no MPI or CUDA)

        ctx = get_context()
        if ctx is not None and rank != ctx.rank:
            if rank >= ctx.nranks:
                raise ValueError(f"this is not a valid process rank: got rank={rank} with nranks={ctx.nranks}")
            raise RuntimeError(f"cannot calculate the local shape of peer process {rank} (this is rank {ctx.rank}) "
                               "with a Box distribution: a Box is the piece of the process that makes it")
        if global_shape is not None:
            whole = _coords(global_shape, "global_shape")
            inside = all(lo_ >= 0 and up_ <= n for lo_, up_, n in zip(self._lower, self._upper, whole))
            if len(whole) != self.ndim or not inside:
                raise ValueError(f"{self!r} does not fit in a global array of shape {whole}")
        return self.box_shape

    def to(self, cls: type, /, *, ndim: int | None = None, copy: bool = False) -> Box:
        """This distribution as one of type ``cls`` (as nvmath's ``Distribution.to``); a Box only converts to a
        Box (``ValueError`` for anything that is not a distribution class, as in nvmath)."""
        if not (isinstance(cls, type) and issubclass(cls, Box)):
            raise ValueError(f"{cls!r} is not a valid distribution: a Box converts only to a Box")
        if ndim is not None and ndim != self.ndim:
            raise ValueError(f"ndim argument ({ndim}) doesn't match this distribution's dimensionality ({self.ndim})")
        return self.copy() if copy else self

    @property
    def size(self) -> int:
        """Number of elements in the box."""
        return math.prod(self.box_shape)

    @property
    def is_empty(self) -> bool:
        return self.size == 0

    def intersection(self, other: Box) -> Box | None:
        """The common part of two boxes, or None when they share no element."""
        if other.ndim != self.ndim:
            raise ValueError(f"cannot intersect a {self.ndim}-D box with a {other.ndim}-D box")
        lo = tuple(max(a, b) for a, b in zip(self._lower, other._lower))
        up = tuple(min(a, b) for a, b in zip(self._upper, other._upper))
        if any(up_ <= lo_ for lo_, up_ in zip(lo, up)):
            return None
        return Box(lo, up)

    def relative_to(self, origin: Box) -> tuple[slice, ...]:
        """Slices that select this box inside an array holding ``origin``."""
        return tuple(slice(lo_ - o, up_ - o) for lo_, up_, o in zip(self._lower, self._upper, origin._lower))

    def __iter__(self):
        # lets ``lower, upper = box`` work, as with nvmath's list form
        yield self._lower
        yield self._upper

    def __getitem__(self, index: int) -> tuple[int, ...]:
        """``box[0]`` is ``lower`` and ``box[1]`` is ``upper`` (as in nvmath)."""
        if index in (0, -2):
            return self._lower
        if index in (1, -1):
            return self._upper
        raise IndexError(f"a Box has two items (lower, upper); index {index!r} is out of range")

    def copy(self) -> Box:
        """A new Box equal to this one (as nvmath's ``Distribution.copy``)."""
        return Box(self._lower, self._upper)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Box):
            return NotImplemented
        return self._lower == other._lower and self._upper == other._upper

    def __hash__(self) -> int:
        return hash((self._lower, self._upper))

    def __repr__(self) -> str:
        return f"Box({self._lower}, {self._upper})"

    def __str__(self) -> str:
        return f"Box(lower={self._lower}, upper={self._upper})"  # nvmath's form

    def __reduce__(self):
        return (Box, (self._lower, self._upper))


def __getattr__(name: str):
    if name in _REDISTRIBUTE:  # (reshape imports this module: loaded on first use, not at import)
        from . import reshape

        return getattr(reshape, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_REDISTRIBUTE})
