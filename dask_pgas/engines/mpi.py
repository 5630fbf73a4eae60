"""CPU engine on mpi4py: ``MPI.Win.Allocate`` symmetric memory and an ``Alltoallw`` reshape.

The plan lays out, once, the piece this rank sends each peer (a box of the local input) and the piece it receives
(a box of the local output): contiguous pieces as element runs at a byte offset, strided receive pieces as subarray
datatypes, strided send pieces as subarray types or packed first (:func:`_pack_strided_sends`: then every send
piece is packed, as ``Alltoallw`` takes one send buffer); ``execute`` is then
a single ``Alltoallw`` plus a NumPy copy of the piece that stays on this rank. Element types come from
``mpi4py.util.dtlib`` when it covers every byte of an element, raw bytes otherwise.
"""

from __future__ import annotations

import os
import warnings
import zlib
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from ..distribution import Box
from ..errors import UnsupportedOperandError
from ..geometry.boxes import contiguous_offset
from .base import Allocation, ControlPlane, Engine, ReshapePlan, ReshapeSpec

__all__ = ["MPIControl", "MPIEngine", "MPIReshapePlan", "subarray_type"]


class MPIControl(ControlPlane):
    """Control plane over a private duplicate of an mpi4py communicator."""

    def __init__(self, communicator: Any) -> None:
        self.comm = communicator.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()

    def allgather(self, obj: Any) -> list[Any]:
        return self.comm.allgather(obj)

    def barrier(self) -> None:
        self.comm.Barrier()

    def agree(
        self, error: str | None, call: str | None = None, same: tuple[str, Any] | None = None
    ) -> list[tuple[int, str]]:
        # one Allreduce on the hot path: a failure flag, and a code of the call (and of ``same``) with its negation
        # (their maxima show whether every rank passed the same); the messages travel only when something differs
        from mpi4py import MPI

        code = zlib.crc32(repr((call, same)).encode()) if call or same else 0
        flags = np.array([1 if error else 0, code, -code], dtype=np.int64)
        self.comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
        if flags[0] or flags[1] != -flags[2]:
            return super().agree(error, call, same)
        return []

    def free(self) -> None:
        from mpi4py import MPI

        if self.comm != MPI.COMM_NULL:
            self.comm.Free()


def _element_type(dtype: np.dtype):
    """The MPI type of one ``dtype`` element and whether the caller owns (must free) it.

    dtlib's type is used only when it covers every byte of the element (size and extent equal to the
    itemsize): it maps some dtypes to fewer bytes (``'S5'`` or a struct's ``'S2'`` field to one MPI_CHAR) or
    leaves holes (aligned structs). Nor for x87 extended precision anywhere in the element: MPI_LONG_DOUBLE's
    size is the itemsize, but MPICH moves only its 10 significant bytes, not the padding. Every other dtype
    moves as raw bytes, which is byte-exact for all."""
    from mpi4py import MPI
    from mpi4py.util import dtlib

    datatype = None
    if not _has_extended_float(dtype):
        try:
            datatype = dtlib.from_numpy_dtype(dtype)
        except (ValueError, TypeError, KeyError, MPI.Exception):  # unmapped (void, byte-swapped, ...), or a
            pass  # type this MPI lacks (Open MPI 4.1's dtlib raises MPI_ERR_TYPE for float16)
    if datatype is not None:
        if datatype.size == dtype.itemsize and datatype.extent == dtype.itemsize:
            if datatype.is_predefined:
                return datatype, False
            return datatype.Commit(), True
        if not datatype.is_predefined:
            datatype.Free()
    return MPI.BYTE.Create_contiguous(dtype.itemsize).Commit(), True


def _has_extended_float(dtype: np.dtype) -> bool:
    """Whether ``dtype`` (or a field, at any depth, or a subarray's base) is ``longdouble``/``clongdouble``
    wider than ``double``."""
    if dtype.subdtype is not None:
        return _has_extended_float(dtype.subdtype[0])
    if dtype.fields:
        return any(_has_extended_float(field[0]) for field in dtype.fields.values())
    return dtype.type in (np.longdouble, np.clongdouble) and np.finfo(np.longdouble).bits > 64


def subarray_type(base, whole: Box, piece: Box, order):
    """The committed MPI datatype of ``piece`` of ``whole`` (global boxes) in a buffer laid out as ``whole`` in
    ``order`` (``MPI.ORDER_C`` or ``MPI.ORDER_FORTRAN``), with ``base`` elements; the caller frees it."""
    starts = [p - w for p, w in zip(piece.lower, whole.lower)]
    return base.Create_subarray(list(whole.box_shape), list(piece.box_shape), starts, order=order).Commit()


_PACK_CHOICES = ("auto", "always", "never")
_INT_MAX = 2**31 - 1


def _large_counts() -> bool:
    """Whether ``Alltoallw`` takes counts and byte displacements past ``2**31 - 1``: MPI 4's large-count calls,
    which mpi4py 4 uses when the library has them (MPICH 4 and later; not Open MPI 4.1, an MPI 3.1)."""
    from mpi4py import MPI

    return MPI.Get_version() >= (4, 0)


def _pack_strided_sends() -> bool:
    """Whether this rank's plans pack their send pieces into a contiguous buffer first when any is strided (all of
    them: ``Alltoallw`` takes one send buffer).

    ``DASK_PGAS_MPI_PACK``: ``always``, ``never`` or ``auto`` (the default: pack except under Open MPI). MPICH
    sends strided subarrays several times slower than it receives them (0.92 s against 0.14 s for the two
    directions of S1 on 4 ranks, 2 cores), while Open MPI 4.1 sends them faster than packing first does (S1 row
    slabs -> column slabs on 4 ranks, 16 cores: 42 ms for the bare ``Alltoallw``, 63 ms packed). The choice
    only lays out this rank's send buffer, so ranks may differ; an unknown value counts as ``auto``."""
    from mpi4py import MPI

    choice = os.environ.get("DASK_PGAS_MPI_PACK", "auto").strip().lower()
    if choice not in _PACK_CHOICES:
        warnings.warn(f"DASK_PGAS_MPI_PACK={choice!r} is not one of {_PACK_CHOICES}; using 'auto'", stacklevel=2)
        choice = "auto"
    if choice != "auto":
        return choice == "always"
    return not MPI.Get_library_version().startswith("Open MPI")


class MPIReshapePlan(ReshapePlan):
    """One ``Alltoallw`` per execute. Pieces contiguous in memory travel as plain element runs; where a send
    piece is strided and the MPI library sends those slowly, every send piece is packed first into a buffer of
    the plan (one send buffer; see :func:`_pack_strided_sends`); strided receive pieces use subarray datatypes."""

    def __init__(self, engine: MPIEngine, spec: ReshapeSpec) -> None:
        from mpi4py import MPI

        self.spec = spec
        self._comm = engine.data_comm
        order = MPI.ORDER_C if spec.order == "C" else MPI.ORDER_FORTRAN
        base, self._owns_base = _element_type(spec.dtype)
        if not self._owns_base:
            base = base.Dup().Commit()
            self._owns_base = True
        self._base = base
        nranks, me, item = spec.nranks, spec.rank, spec.dtype.itemsize
        my_in, my_out = spec.input_box, spec.output_box
        self._send_types, self._recv_types = [base] * nranks, [base] * nranks
        self._send_counts, self._recv_counts = [0] * nranks, [0] * nranks
        self._send_displs, self._recv_displs = [0] * nranks, [0] * nranks
        self._derived = []
        self._local: tuple[tuple[slice, ...], tuple[slice, ...]] | None = None
        sends = []
        for peer in range(nranks):
            piece = my_in.intersection(spec.output_boxes[peer])
            if piece is not None:
                if peer == me:
                    self._local = (piece.relative_to(my_in), piece.relative_to(my_out))
                else:
                    sends.append((peer, piece, contiguous_offset(my_in, piece, spec.order)))
            piece = spec.input_boxes[peer].intersection(my_out)
            if piece is not None and peer != me:
                offset = contiguous_offset(my_out, piece, spec.order)
                if offset is None:
                    self._recv_types[peer] = self._subarray(base, my_out, piece, order)
                    self._recv_counts[peer] = 1
                else:
                    self._recv_counts[peer], self._recv_displs[peer] = piece.size, offset * item
        # (peer's piece, its slices in the input, byte offset in the pack buffer)
        self._pack: list[tuple[Box, tuple[slice, ...], int]] = []
        self._pack_buffer: np.ndarray | None = None
        packing = any(offset is None for _, _, offset in sends) and _pack_strided_sends()
        position = 0
        for peer, piece, offset in sends:
            self._send_counts[peer] = piece.size
            if packing:
                self._pack.append((piece, piece.relative_to(my_in), position))
                self._send_displs[peer] = position
                position += piece.size * item
            elif offset is None:  # a strided piece sent as it lies
                self._send_types[peer] = self._subarray(base, my_in, piece, order)
                self._send_counts[peer] = 1
            else:
                self._send_displs[peer] = offset * item
        if packing:
            self._pack_buffer = np.empty(position, dtype=np.uint8)
        # Counts and byte displacements are C ints before MPI 4: past them mpi4py raises inside execute(), after
        # the agreement, on the ranks with such pieces only. Refused here instead, where plans are agreed on.
        worst = max(*self._send_counts, *self._recv_counts, *self._send_displs, *self._recv_displs)
        if worst > _INT_MAX and not _large_counts():
            from mpi4py import MPI

            self.free()
            first = (MPI.Get_library_version().split("\x00")[0].splitlines() or [""])[0]
            library = " ".join(first.split(",")[0].split())  # "Open MPI v4.1.6", "MPICH Version: 5.0.2"
            raise UnsupportedOperandError(
                f"rank {me}'s pieces need Alltoallw counts or byte offsets up to {worst}; {library} (MPI "
                f"{'.'.join(map(str, MPI.Get_version()))}) takes them as C ints, up to 2**31 - 1: use more ranks "
                "(smaller boxes) or an MPI 4 library (MPICH 4 or later, e.g. the mpich wheel; Open MPI 5 is still an "
                "MPI 3.1)"
            )

    def _subarray(self, base, whole, piece, order):
        dt = subarray_type(base, whole, piece, order)
        self._derived.append(dt)
        return dt

    def _flat(self, array: np.ndarray, shape: Sequence[int], what: str) -> np.ndarray:
        if array.shape != tuple(shape) or array.dtype != self.spec.dtype:
            raise ValueError(f"{what} must have shape {tuple(shape)} and dtype {self.spec.dtype}, got "
                             f"{array.shape} {array.dtype}")
        flags = array.flags
        if not (flags.c_contiguous if self.spec.order == "C" else flags.f_contiguous):
            raise ValueError(f"{what} must be {self.spec.order}-contiguous")
        return array.reshape(-1, order=self.spec.order).view(np.uint8)

    def execute(self, src: Any, dst: Any, *, stream: Any = None, sync_symmetric_memory: bool = True,
                operand_offset: int | None = None) -> None:
        if self._comm is None:
            raise RuntimeError("this plan was freed")
        sbuf = self._flat(src, self.spec.input_box.box_shape, "source")
        rbuf = self._flat(dst, self.spec.output_box.box_shape, "destination")
        raw = np.dtype((np.void, self.spec.dtype.itemsize))  # byte-exact copies: no string or float semantics
        if self._pack_buffer is not None:
            source, order = src.view(raw), self.spec.order
            for piece, slices, position in self._pack:
                run = self._pack_buffer[position : position + piece.size * raw.itemsize]
                run.view(raw).reshape(piece.box_shape, order=order)[...] = source[slices]
            sbuf = self._pack_buffer
        # Every rank takes part, even with nothing to send or receive: peers' plans count on it.
        self._comm.Alltoallw(
            [sbuf, (self._send_counts, self._send_displs), self._send_types],
            [rbuf, (self._recv_counts, self._recv_displs), self._recv_types],
        )
        if self._local is not None:
            src_sl, dst_sl = self._local
            dst.view(raw)[dst_sl] = src.view(raw)[src_sl]

    def free(self) -> None:
        self._pack_buffer = None
        for dt in self._derived:
            dt.Free()
        self._derived.clear()
        if self._owns_base:
            self._base.Free()
            self._owns_base = False
        self._comm = None


class MPIEngine(Engine):
    """CPU ranks of an mpi4py communicator."""

    name: ClassVar[str] = "mpi"
    packages: ClassVar[tuple[str, ...]] = ("numpy",)
    operand_packages: ClassVar[tuple[str, ...]] = ("numpy",)

    def __init__(self, communicator: Any) -> None:
        self.control = MPIControl(communicator)
        self.data_comm = self.control.comm.Dup()
        self._windows: dict[int, tuple[int, Any]] = {}  # ptr -> (nbytes, window)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            from mpi4py import MPI  # noqa: F401
        except ImportError as exc:
            return f"mpi4py with an MPI library is needed ({exc}); pip install mpi4py mpich"
        return None

    @classmethod
    def create(cls, *, device_id: int | None = None, communicator: Any) -> MPIEngine:
        return cls(communicator)

    def allocate(self, nbytes: int) -> Allocation:
        from mpi4py import MPI

        win = MPI.Win.Allocate(nbytes, 1, comm=self.data_comm)
        memory = win.tomemory()
        ptr = MPI.Get_address(memory) if nbytes else 0
        if nbytes:
            self._windows[ptr] = (nbytes, win)
        return Allocation(nbytes=nbytes, ptr=ptr, handle=(win, memory))

    def free(self, allocation: Allocation) -> None:
        win, _ = allocation.handle
        self._windows.pop(allocation.ptr, None)
        win.Free()

    def as_array(
        self, allocation: Allocation, shape: Sequence[int], dtype: Any, package: str, order: str = "C"
    ) -> np.ndarray:
        if package != "numpy":
            raise ValueError(f"the mpi engine allocates numpy arrays, not {package}")
        _, memory = allocation.handle
        dtype = np.dtype(dtype)
        if allocation.nbytes == 0:
            return np.ndarray(tuple(shape), dtype=dtype, order=order)
        return np.ndarray(tuple(shape), dtype=dtype, buffer=memory, order=order)

    def on_heap(self, array: Any) -> bool:
        if not isinstance(array, np.ndarray) or array.size == 0:
            return False
        ptr = array.__array_interface__["data"][0]
        return any(lo <= ptr < lo + n for lo, (n, _) in self._windows.items())

    def plan_reshape(self, spec: ReshapeSpec) -> MPIReshapePlan:
        return MPIReshapePlan(self, spec)

    def finalize(self) -> None:
        self.data_comm.Free()
        self.control.free()
