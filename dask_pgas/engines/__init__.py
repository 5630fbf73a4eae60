"""Engines: the machinery behind one small interface (:mod:`dask_pgas.engines.base`).

``mpi``      CPU processes, mpi4py (``MPI.Win.Allocate`` symmetric memory, ``Alltoallw`` reshape).
``nvshmem``  GPUs, NVSHMEM symmetric heap and cuFFTMp reshape, reached through ctypes bindings.
"""

from .base import Allocation, ControlPlane, Engine, ReshapePlan, ReshapeSpec

__all__ = ["Allocation", "ControlPlane", "Engine", "ReshapePlan", "ReshapeSpec"]
