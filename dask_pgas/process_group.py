"""Process groups, as in ``nvmath.distributed.process_group`` (nvmath 0.9 and 1.0): the processes that run
dask_pgas's collective operations, passed to :func:`dask_pgas.initialize` and shown as
``get_context().process_group``.

Only MPI groups exist here: the engines agree and exchange over an mpi4py communicator, so a group must have
one. (nvmath also takes a ``torch.distributed`` group; :func:`dask_pgas.initialize` refuses other groups with a
``TypeError`` that says so.) The collectives below are the small set nvmath's groups offer, for code written
against them; dask_pgas itself does not use them.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from enum import IntEnum
from typing import Any, TypeVar

import numpy as np

__all__ = ["MPIProcessGroup", "ProcessGroup", "ReductionOp"]

T = TypeVar("T")


class ReductionOp(IntEnum):
    """Element-wise reductions of :meth:`ProcessGroup.allreduce_buffer`."""

    SUM = 0
    MIN = 1
    MAX = 2


class ProcessGroup(ABC):
    """A set of processes running dask_pgas operations together (``nvmath.distributed.ProcessGroup``)."""

    @property
    @abstractmethod
    def rank(self) -> int:
        """This process's index in the group."""

    @property
    @abstractmethod
    def nranks(self) -> int:
        """The number of processes in the group."""

    @abstractmethod
    def broadcast_buffer(self, array: np.ndarray, *, root: int = 0) -> None:
        """Collective: overwrite ``array`` on every process with ``root``'s."""

    @abstractmethod
    def allreduce_buffer(self, array: np.ndarray, *, op: ReductionOp) -> None:
        """Collective: reduce ``array`` element-wise across the group, in place."""

    @abstractmethod
    def allreduce_object(self, obj: T, *, op: Callable[[T, T], T]) -> T:
        """Collective: every process's ``obj`` reduced pairwise by ``op``; the result on every process."""


class MPIProcessGroup(ProcessGroup):
    """The processes of an mpi4py communicator (``nvmath.distributed.MPIProcessGroup``)."""

    def __init__(self, mpi_comm: Any) -> None:
        if not _is_communicator(mpi_comm):
            raise TypeError(f"MPIProcessGroup needs an mpi4py communicator, not {type(mpi_comm).__name__}")
        self._comm = mpi_comm

    @property
    def communicator(self) -> Any:
        """The mpi4py communicator of the group."""
        return self._comm

    @property
    def rank(self) -> int:
        return self._comm.Get_rank()

    @property
    def nranks(self) -> int:
        return self._comm.Get_size()

    def broadcast_buffer(self, array: np.ndarray, *, root: int = 0) -> None:
        self._comm.Bcast(array, root=root)

    def allreduce_buffer(self, array: np.ndarray, *, op: ReductionOp) -> None:
        from mpi4py import MPI

        ops = {ReductionOp.SUM: MPI.SUM, ReductionOp.MIN: MPI.MIN, ReductionOp.MAX: MPI.MAX}
        self._comm.Allreduce(MPI.IN_PLACE, array, op=ops[ReductionOp(op)])

    def allreduce_object(self, obj: T, *, op: Callable[[T, T], T]) -> T:
        return self._comm.allreduce(obj, op=op)

    def __repr__(self) -> str:
        return f"MPIProcessGroup(rank={self.rank}, nranks={self.nranks})"


def _is_communicator(obj: Any) -> bool:
    """Whether ``obj`` is an mpi4py communicator (whoever made one has imported ``mpi4py.MPI``: no import here)."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and isinstance(obj, mpi.Comm)


def communicator_of(group: Any) -> Any:
    """The mpi4py communicator behind ``group`` (an :class:`MPIProcessGroup` or a communicator itself)."""
    if isinstance(group, MPIProcessGroup):
        return group.communicator
    if not _is_communicator(group):
        raise TypeError(
            f"dask_pgas runs on MPI process groups only, not on a {type(group).__name__}: every rank must pass "
            "dask_pgas.MPIProcessGroup(comm) or an mpi4py communicator"
        )
    return group
