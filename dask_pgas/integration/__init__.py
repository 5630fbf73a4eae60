"""Dask integration: a PGAS world on a Dask cluster and ``rechunk`` as one collective reshape.

Importing this package loads the ``pgas.*`` config defaults; it never patches Dask (see :func:`install`).
"""

from __future__ import annotations

import os

import dask
import yaml

with open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "pgas.yaml")) as _f:
    dask.config.update_defaults(yaml.safe_load(_f))

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
