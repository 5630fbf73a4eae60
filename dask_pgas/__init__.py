"""dask_pgas: redistribute arrays across GPUs or MPI ranks in one collective reshape.

The PGAS core mirrors ``nvmath.distributed``::

    import dask_pgas
    from dask_pgas.distribution import Box

    dask_pgas.initialize(backends=["mpi"])          # or ["nvshmem"] on GPUs
    b = dask_pgas.reshape.reshape(a, Box(...), Box(...))   # nvmath 1.0: dask_pgas.distribution.redistribute
    dask_pgas.finalize()
"""

from . import _defaults as _defaults  # (registers the pgas.* Dask config defaults)
from . import distribution, errors, process_group, reshape
from ._version import __version__
from .distribution import Box, Slab
from .engines.nvshmem import check_uniqueid_bring_up, get_nvshmem_uniqueid, initialize_from_uniqueid
from .memory import allocate_symmetric_memory, free_symmetric_memory, heap_usage
from .process_group import MPIProcessGroup, ProcessGroup
from .reshape import Redistribute, RedistributeOptions, Reshape, ReshapeOptions
from .runtime import (
    DistributedContext,
    available_backends,
    finalize,
    get_context,
    initialize,
    initialized_backends,
    is_initialized,
)

__all__ = [
    "Box",
    "DistributedContext",
    "MPIProcessGroup",
    "ProcessGroup",
    "Redistribute",
    "RedistributeOptions",
    "Reshape",
    "ReshapeOptions",
    "Slab",
    "__version__",
    "allocate_symmetric_memory",
    "available_backends",
    "check_uniqueid_bring_up",
    "distribution",
    "errors",
    "finalize",
    "free_symmetric_memory",
    "get_context",
    "get_nvshmem_uniqueid",
    "heap_usage",
    "initialize",
    "initialize_from_uniqueid",
    "initialized_backends",
    "is_initialized",
    "process_group",
    "reshape",
]

# The Dask integration, loaded on first use (importing dask_pgas stays free of distributed and never patches
# Dask): dask_pgas.bootstrap / world / teardown / rechunk / install / uninstall / LocalMPICluster.
_INTEGRATION = ("LocalMPICluster", "World", "bootstrap", "install", "rechunk", "teardown", "uninstall", "world")
__all__ += _INTEGRATION  # (``from dask_pgas import *`` loads them)


def __dir__() -> list[str]:
    return sorted({*globals(), *_INTEGRATION})


def __getattr__(name: str):
    if name in _INTEGRATION:
        from . import integration

        return getattr(integration, name)
    raise AttributeError(f"module 'dask_pgas' has no attribute {name!r}")
