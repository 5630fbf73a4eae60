"""Dask integration: a PGAS world on a Dask cluster and ``rechunk`` as one collective reshape.

Importing this package loads the ``pgas.*`` config defaults; it never patches Dask (see :func:`install`).
"""

from __future__ import annotations

import dask

from ..errors import PGASRechunkUnsupported, PGASWorldError
from ._client import World, bootstrap, teardown, world
from ._cluster import LocalMPICluster
from ._config import DEFAULTS
from ._rechunk import array_expr_mode, install, installed, rechunk, uninstall

dask.config.update_defaults(DEFAULTS)

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
