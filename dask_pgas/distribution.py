"""Distributions: the part of a global array that each process holds.

Mirrors ``nvmath.distributed.distribution``. A :class:`Box` is one process's own piece: ``lower`` is inclusive,
``upper`` exclusive, both in global coordinates, any number of dimensions; ``box_shape`` is its extent. A
:class:`Slab` (``Slab.X``, ``Slab.Y``, ``Slab.Z``) partitions the global array along one axis, the first
``s % P`` processes holding one more index than the others, in rank order; a reshape infers the global shape
from the operands. ``shape(rank, global_shape)`` is the local shape, as nvmath's ``Distribution.shape``.
nvmath 1.0's names for the reshape, ``redistribute`` / ``Redistribute`` / ``RedistributeOptions``, are here too
(loaded from :mod:`dask_pgas.reshape` on first use). Pure Python: no MPI, CUDA or Dask here.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from typing import ClassVar

from .errors import ConvertDistributionError, NotInitializedError

__all__ = [  # noqa: F822 (the last three: __getattr__)
    "Box",
    "ConvertDistributionError",
    "Distribution",
    "Redistribute",
    "RedistributeOptions",
    "Slab",
    "redistribute",
]

#: nvmath 1.0 moved ``nvmath.distributed.reshape.reshape`` to ``nvmath.distributed.distribution.redistribute``
_REDISTRIBUTE = ("Redistribute", "RedistributeOptions", "redistribute")


def _coords(values: Iterable[int], name: str) -> tuple[int, ...]:
    try:
        out = tuple(operator.index(v) for v in values)
    except TypeError as exc:  # a ValueError, as nvmath raises for coordinates that are not integers
        raise ValueError(f"{name} must be a sequence of integers, got {values!r}") from exc
    if any(not -(2**63) <= v < 2**63 for v in out):  # (geometry runs on int64)
        raise ValueError(f"{name} must be integers within 64 bits, got {values!r}")
    return out


def _nranks() -> int:
    from .runtime import get_context  # (imports no MPI or CUDA)

    ctx = get_context()
    if ctx is None:
        raise NotInitializedError("dask_pgas is not initialized: call dask_pgas.initialize(backends=[...]) on "
                                  "every rank first (Slab.box(rank, nranks, global_shape) needs no runtime)")
    return ctx.nranks


def _check_rank(rank: int, nranks: int | None) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be an integer >= 0, got {rank!r}")
    if nranks is not None and rank >= nranks:
        raise ValueError(f"this is not a valid process rank: got rank={rank} with nranks={nranks}")


def _check_to(cls: object, ndim: int | None, own_ndim: int | None) -> int | None:
    """Check ``Distribution.to``'s arguments; returns ``ndim`` as a Python int (or None)."""
    if not (isinstance(cls, type) and issubclass(cls, Distribution) and cls is not Distribution):
        raise ValueError(f"{cls!r} is not a valid distribution")
    if ndim is not None:
        try:
            ok = not isinstance(ndim, bool) and operator.index(ndim) >= 1  # (NumPy integers too)
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"ndim must be an integer >= 1, got {ndim!r}")
        ndim = operator.index(ndim)
    if ndim is not None and own_ndim is not None and ndim < own_ndim:
        raise ValueError(f"ndim argument ({ndim}) is below this distribution's dimensionality ({own_ndim}): a "
                         "distribution can be promoted to more dimensions (trailing size-1 ones), never fewer")
    return ndim


class Distribution:
    """How a global array is split across processes (the base of :class:`Box` and :class:`Slab`)."""

    __slots__ = ()

    @property
    def ndim(self) -> int | None:
        raise NotImplementedError

    def shape(self, rank: int, global_shape: Sequence[int] | None = None) -> tuple[int, ...]:
        raise NotImplementedError

    def to(self, cls: type, /, *, ndim: int | None = None, copy: bool = False) -> Distribution:
        raise NotImplementedError

    def copy(self) -> Distribution:
        raise NotImplementedError


class Box(Distribution):
    """A rectangular section ``[lower, upper)`` of a global array.

    >>> Box((0, 2), (4, 4)).box_shape
    (4, 2)
    """

    __slots__ = ("_lower", "_upper")

    def __init__(self, lower: Sequence[int], upper: Sequence[int]) -> None:
        lo, up = _coords(lower, "Box lower"), _coords(upper, "Box upper")
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
        _check_rank(rank, None)
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
        """This distribution as one of type ``cls`` (as nvmath's ``Distribution.to``): a Box converts only to a
        Box (:class:`ConvertDistributionError` for another distribution, ``ValueError`` for anything that is not
        a distribution class, as in nvmath). A larger ``ndim`` promotes it with trailing size-1 dimensions (as
        nvmath 1.0): ``Box((0, 0), (4, 2)).to(Box, ndim=3)`` is ``Box((0, 0, 0), (4, 2, 1))``."""
        ndim = _check_to(cls, ndim, self.ndim)
        if not issubclass(cls, Box):
            raise ConvertDistributionError(f"a Box cannot be converted to {cls.__name__}: it is one process's piece")
        if ndim is not None and ndim > self.ndim:
            extra = ndim - self.ndim
            return Box(self._lower + (0,) * extra, self._upper + (1,) * extra)
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


class Slab(Distribution):
    """The global array split along axis ``partition_dim``, in rank order: with ``s`` indices on that axis and
    ``P`` processes, the first ``s % P`` processes hold ``s // P + 1`` of them and the others ``s // P`` (some
    hold none when ``s < P``). ``Slab.X``, ``Slab.Y`` and ``Slab.Z`` split axes 0, 1 and 2.

    As in nvmath, a reshape from or to a Slab infers the global shape from the operands (all other extents equal
    on every rank, the partition axis summed), and every rank's operand must have its slab's shape. Unlike
    nvmath's, a Slab is never bound to a global shape: ``shape(rank, global_shape)`` needs the global shape.

    >>> Slab.Y.shape(0, (4, 10))  # doctest: +SKIP   (rank 0 of 3 processes)
    (4, 4)
    """

    __slots__ = ("_ndim", "_partition_dim")
    X: ClassVar[Slab]
    Y: ClassVar[Slab]
    Z: ClassVar[Slab]

    def __init__(self, partition_dim: int, ndim: int | None = None) -> None:
        if isinstance(partition_dim, bool) or not isinstance(partition_dim, int) or partition_dim < 0:
            raise ValueError(f"partition_dim must be an integer >= 0, got {partition_dim!r}")
        if ndim is not None:
            if isinstance(ndim, bool) or not isinstance(ndim, int) or ndim < 1:
                raise ValueError(f"ndim must be an integer >= 1, got {ndim!r}")
            if partition_dim >= ndim:
                raise ValueError(f"partition_dim ({partition_dim}) must be < ndim ({ndim})")
        self._partition_dim = partition_dim
        self._ndim = ndim

    @property
    def partition_dim(self) -> int:
        """The axis the array is split along."""
        return self._partition_dim

    @property
    def ndim(self) -> int | None:
        """The dimensionality it applies to; None for any (``Slab.X`` and the like)."""
        return self._ndim

    @property
    def name(self) -> str:
        return {0: "Slab.X", 1: "Slab.Y", 2: "Slab.Z"}.get(self._partition_dim, "Slab")

    def box(self, rank: int, nranks: int, global_shape: Sequence[int]) -> Box:
        """The part of an array of ``global_shape`` that process ``rank`` of ``nranks`` holds (pure: no runtime
        needed)."""
        _check_rank(rank, nranks)
        whole = _coords(global_shape, "global_shape")
        if self._ndim is not None and len(whole) != self._ndim:
            raise ValueError(f"{self} does not apply to a {len(whole)}-D global shape {whole}")
        if self._partition_dim >= len(whole):
            raise ValueError(f"{self} splits axis {self._partition_dim}; the global shape {whole} has no such axis")
        s = whole[self._partition_dim]
        start = rank * (s // nranks) + min(rank, s % nranks)
        size = s // nranks + (rank < s % nranks)
        lower = [0] * len(whole)
        upper = list(whole)
        lower[self._partition_dim], upper[self._partition_dim] = start, start + size
        return Box(lower, upper)

    def shape(self, rank: int, global_shape: Sequence[int] | None = None) -> tuple[int, ...]:
        """The local shape of process ``rank`` for an array of ``global_shape`` (needs the runtime, for the
        number of processes)."""
        if global_shape is None:
            raise RuntimeError(f"{self} is not bound to a global shape: pass global_shape")
        nranks = _nranks()
        return self.box(rank, nranks, global_shape).box_shape

    def to(self, cls: type, /, *, ndim: int | None = None, copy: bool = False) -> Slab:
        """As one of type ``cls`` (as nvmath's ``Distribution.to``): a Slab converts to a Slab (of ``ndim``
        dimensions when given: at least its own, as nvmath 1.0 promotes with trailing size-1 dimensions); to a
        Box only inside a reshape, where the global shape is known (:class:`ConvertDistributionError` here)."""
        ndim = _check_to(cls, ndim, self._ndim)
        if not issubclass(cls, Slab):
            raise ConvertDistributionError(
                f"{self} names no Box before the global shape is known: a reshape converts it (or use "
                "Slab.box(rank, nranks, global_shape))"
            )
        if ndim is not None and self._partition_dim >= ndim:
            raise ValueError(f"ndim ({ndim}) must be greater than the partition dimension ({self._partition_dim})")
        if copy or (ndim is not None and ndim != self._ndim):
            return Slab(self._partition_dim, ndim if ndim is not None else self._ndim)
        return self

    def copy(self) -> Slab:
        return Slab(self._partition_dim, self._ndim)

    def __eq__(self, other: object) -> bool:
        """Slabs split the same axis (an unknown dimensionality matches any, as in nvmath)."""
        if not isinstance(other, Slab):
            return NotImplemented
        return self._partition_dim == other._partition_dim and (
            self._ndim is None or other._ndim is None or self._ndim == other._ndim
        )

    def __hash__(self) -> int:
        return self._partition_dim

    def __repr__(self) -> str:
        return self.name if self._ndim is None and self._partition_dim < 3 else str(self)

    def __str__(self) -> str:
        return f"Slab(partition_dim={self._partition_dim}, ndim={self._ndim})"  # nvmath's form

    def __reduce__(self):
        return (Slab, (self._partition_dim, self._ndim))


Slab.X, Slab.Y, Slab.Z = Slab(0), Slab(1), Slab(2)


def __getattr__(name: str):
    if name in _REDISTRIBUTE:  # (reshape imports this module: loaded on first use, not at import)
        from . import reshape

        return getattr(reshape, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_REDISTRIBUTE})
