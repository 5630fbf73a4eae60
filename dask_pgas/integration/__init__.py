"""Dask integration: a PGAS world on a Dask cluster and ``rechunk`` as one collective reshape.

The ``pgas.*`` config defaults are registered by ``import dask_pgas``. Importing this package patches nothing:
:func:`install` patches ``dask.array.rechunk`` on request, and the scheduler plugin (registered by
:func:`bootstrap`) guards the scheduler's ``retire_workers`` handler.
"""

from __future__ import annotations

from ..errors import PGASRechunkUnsupported, PGASWorldError
from ._client import World, bootstrap, teardown, world
from ._cluster import LocalMPICluster
from ._rechunk import array_expr_mode, install, installed, rechunk, uninstall

__all__ = [
    "LocalMPICluster",
    "PGASRechunkUnsupported",
    "PGASWorldError",
    "World",
    "array_expr_mode",
    "bootstrap",
    "install",
    "installed",
    "rechunk",
    "teardown",
    "uninstall",
    "world",
]
