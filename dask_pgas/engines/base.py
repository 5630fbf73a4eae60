"""The interface every engine implements, and the plan description handed to it.

The front end (:mod:`dask_pgas.runtime`, :mod:`dask_pgas.memory`, :mod:`dask_pgas.reshape`) validates input
collectively and keeps the registry of symmetric allocations; an engine only moves bytes:

* ``allocate``/``free``: one symmetric allocation of the same byte size on every rank (collective);
* ``as_array``: a zero-copy array of some package over an allocation;
* ``plan_reshape``: a :class:`ReshapePlan` for a fully validated :class:`ReshapeSpec` (collective), executed
  many times and freed collectively.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from .._arrays import to_numpy_dtype
from ..distribution import Box
from ..errors import CollectiveMismatchError, UnsupportedOperandError

__all__ = ["Allocation", "ControlPlane", "Engine", "ReshapePlan", "ReshapeSpec"]


class ControlPlane(ABC):
    """Host-side exchange of small Python objects among the ranks of one PGAS world.

    Used for collective validation (every rank sees every rank's description and raises the same error).
    """

    rank: int
    size: int

    @abstractmethod
    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""

    def barrier(self) -> None:
        self.allgather(None)

    def agree(
        self, error: str | None, call: str | None = None, same: tuple[str, Any] | None = None
    ) -> list[tuple[int, str]]:
        """Collective: the ranks whose local step failed, with their messages, the same list on every rank
        (empty when all succeeded), so that every rank raises or none does.

        ``call`` names the public collective call this agreement opens (each one's first exchange passes it;
        the steps inside a call pass None); ``same`` is an optional ``(label, value)`` of an argument that
        every rank must pass alike. Ranks that name different calls, or different values, raise
        :class:`CollectiveMismatchError` on every rank: the calls' own exchanges would pair up wrongly or hang."""
        everything = self.allgather((call, same, error))
        _check_calls(everything)
        return [(r, e) for r, (_, _, e) in enumerate(everything) if e]

    def number(self, kind: str) -> int:
        """The next number (0, 1, ...) of ``kind`` in this world. Local: objects every rank makes collectively
        (symmetric allocations, Reshape objects) get the same number on every rank of this world, whatever
        each process made in the worlds it had before (a per-process count would differ between them)."""
        counters = self.__dict__.setdefault("_numbers", {})
        return next(counters.setdefault(kind, itertools.count()))

    def free(self) -> None:  # noqa: B027 - optional hook
        """Release communication resources (collective)."""


def _check_calls(everything: list[tuple[str | None, tuple[str, Any] | None, str | None]]) -> None:
    """Raise :class:`CollectiveMismatchError` when the ranks' ``(call, same, error)`` differ in call or in same."""
    if len({c for c, _, _ in everything}) > 1:
        by_rank = "; ".join(
            f"rank {r}: {c or 'a step inside a collective call'}" + (f" (which failed there: {e})" if e else "")
            for r, (c, _, e) in enumerate(everything)
        )
        mismatch = CollectiveMismatchError(
            f"ranks are in different collective calls ({by_rank}); every rank must make the same collective "
            "calls, on the same objects, in the same order"
        )
        mismatch.calls = tuple(c for c, _, _ in everything)
        raise mismatch
    # a rank whose local step failed may have no value to compare (its error is what every rank raises then)
    if len({repr(s) for _, s, e in everything if not e}) > 1:
        label = next(s[0] for _, s, _ in everything if s is not None)
        by_rank = "; ".join(f"rank {r}: {s[1] if s else None!r}" for r, (_, s, _) in enumerate(everything))
        raise CollectiveMismatchError(
            f"ranks called {everything[0][0]} with different {label} ({by_rank}); pass the same on every rank"
        )


@dataclass(frozen=True)
class ReshapeSpec:
    """A validated reshape: every rank's input and output box, the element type and the memory order.

    Local arrays are dense (C or Fortran order, the same on every rank) with the shape of the rank's box.
    """

    input_boxes: tuple[Box, ...]
    output_boxes: tuple[Box, ...]
    dtype: np.dtype
    order: str
    rank: int

    def __post_init__(self) -> None:
        if len(self.input_boxes) != len(self.output_boxes):
            raise ValueError("one input and one output box per rank are needed")
        if self.order not in ("C", "F"):
            raise ValueError(f"order must be 'C' or 'F', not {self.order!r}")
        object.__setattr__(self, "dtype", np.dtype(self.dtype))

    @property
    def nranks(self) -> int:
        return len(self.input_boxes)

    @property
    def input_box(self) -> Box:
        return self.input_boxes[self.rank]

    @property
    def output_box(self) -> Box:
        return self.output_boxes[self.rank]

    @property
    def max_nbytes(self) -> int:
        """Largest input or output piece over all ranks, in bytes (sizes symmetric buffers)."""
        return max(b.size for b in (*self.input_boxes, *self.output_boxes)) * self.dtype.itemsize


@dataclass(eq=False)
class Allocation:
    """One symmetric allocation: ``nbytes`` on every rank, at ``ptr`` locally; ``handle`` is the engine's."""

    nbytes: int
    ptr: int
    handle: Any = field(repr=False)


class ReshapePlan(ABC):
    """A planned reshape: ``execute`` as often as needed, then ``free`` (collective)."""

    spec: ReshapeSpec

    @abstractmethod
    def execute(self, src: Any, dst: Any, *, stream: Any = None, sync_symmetric_memory: bool = True,
                operand_offset: int | None = None) -> None:
        """Move ``src`` (the local input box) into ``dst`` (the local output box). Collective.

        ``src`` and ``dst`` are dense arrays in ``spec.order`` of a package the engine accepts. ``operand_offset``
        is where the ranks' non-empty symmetric ``src`` starts in its allocation (bytes; the same on every rank,
        None when unknown: then ``src`` starts its allocation or is not symmetric); ``dst`` starts its own.
        """

    #: the operand offsets this plan tells apart: two offsets of a symmetric ``src`` that differ by a multiple of
    #: it take the same path (a GPU plan that moves words of this many bytes)
    operand_alignment: int = 1

    def refuse_offset(self, offset: int) -> None:
        """Raise when this plan cannot move a symmetric ``src`` that starts ``offset`` bytes into its allocation
        (the offset the ranks agreed on, so it raises alike on every rank). Local; ``Reshape`` asks before its
        agreement, so no rank allocates a result or enters the collective for an operand the plan refuses.
        The default refuses no offset."""
        return None

    def synchronize(self, stream: Any = None) -> None:
        """Wait until this plan's last ``execute`` (on ``stream``, else on the stream it ran on) is complete.
        Local. An engine whose ``execute`` returns complete (MPI) has nothing to wait for."""
        return None

    @abstractmethod
    def free(self) -> None:
        """Release the plan's resources (collective)."""


class Engine(ABC):
    """One PGAS backend of an initialized world."""

    name: ClassVar[str]
    #: array packages this engine allocates symmetric memory for, e.g. ("numpy",) or ("cupy", "torch")
    packages: ClassVar[tuple[str, ...]]
    #: array packages accepted as reshape operands besides ``packages`` (host arrays on the MPI engine, staged
    #: through the heap on a GPU engine: numpy)
    operand_packages: ClassVar[tuple[str, ...]]

    control: ControlPlane

    @property
    def rank(self) -> int:
        return self.control.rank

    @property
    def nranks(self) -> int:
        return self.control.size

    @classmethod
    @abstractmethod
    def unavailable_reason(cls) -> str | None:
        """None when the engine can run here, otherwise why not and how to fix it."""

    @classmethod
    @abstractmethod
    def create(cls, *, device_id: int | None, communicator: Any) -> Engine:
        """Collective over ``communicator`` (an mpi4py communicator): bring the engine up on every rank."""

    #: True when operands of ``packages`` must lie on the symmetric heap (GPU engines)
    requires_symmetric_operands: ClassVar[bool] = False

    #: why this engine cannot be used any more (a device error agreed on every rank), else None; set on every
    #: rank alike (with an MPI control plane), after which every collective call of the engine raises
    #: :class:`~dask_pgas.errors.DeviceError` (``finalize`` returns without touching the device)
    _broken: str | None = None

    @property
    def broken(self) -> str | None:
        """Why this engine cannot be used any more, or None: its allocations cannot be freed (nor need to be
        before ``finalize()``)."""
        return self._broken

    @abstractmethod
    def allocate(self, nbytes: int) -> Allocation:
        """Collective: ``nbytes`` (equal on every rank) of symmetric memory."""

    @abstractmethod
    def free(self, allocation: Allocation) -> None:
        """Collective: release an allocation (every rank frees the same ones in the same order)."""

    def check_dtype(self, dtype: Any, package: str) -> None:
        """Local, allocates nothing: raise (:class:`UnsupportedOperandError` or the package's own error) unless
        :meth:`as_array` can view symmetric memory as ``dtype`` arrays of ``package``. Called before the
        collective ``allocate`` so that a bad dtype is agreed on and nothing leaks."""
        if to_numpy_dtype(dtype).hasobject:
            raise UnsupportedOperandError(
                f"symmetric memory cannot hold Python objects (dtype {to_numpy_dtype(dtype)}); use a numeric dtype"
            )

    @abstractmethod
    def as_array(
        self, allocation: Allocation, shape: Sequence[int], dtype: Any, package: str, order: str = "C"
    ) -> Any:
        """A zero-copy array of ``package`` viewing the start of ``allocation``."""

    @abstractmethod
    def on_heap(self, array: Any) -> bool:
        """Whether the array's memory lies on this engine's symmetric heap."""

    @abstractmethod
    def plan_reshape(self, spec: ReshapeSpec) -> ReshapePlan:
        """Collective: a plan for a validated spec."""

    def resolve_stream(self, stream: Any, package: str) -> Any:
        """The stream a plan's ``execute`` gets for operands of ``package`` (raises ``TypeError`` for one it
        cannot use): called before the call's agreement, so a bad stream on one rank raises on every rank. CPU
        engines ignore streams."""
        return None

    def empty(self, shape: Sequence[int], dtype: Any, package: str, order: str = "C") -> Any:
        """An ordinary (not symmetric) local array for results of operands off the heap."""
        if package != "numpy":
            raise NotImplementedError(f"{self.name} engine cannot allocate {package} arrays")
        return np.empty(shape, dtype=dtype, order=order)

    def heap_info(self) -> dict[str, int]:
        """Engine-level heap facts (for example the NVSHMEM heap size); may be empty."""
        return {}

    @abstractmethod
    def finalize(self) -> None:
        """Collective: tear the engine down (the front end has freed every allocation first)."""
