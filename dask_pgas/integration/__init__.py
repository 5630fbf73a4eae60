"""Dask integration: a PGAS world on a Dask cluster and ``rechunk`` as one collective reshape.

The ``pgas.*`` config defaults are registered by ``import dask_pgas``; this package never patches Dask (see
:func:`install`).
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
