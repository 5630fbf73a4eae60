"""The ``pgas.*`` Dask config defaults (``dask_pgas/pgas.yaml``), registered with Dask on ``import dask_pgas``,
as Dask's own packages register theirs: ``dask.config.get("pgas.fallback")`` works before the integration loads."""

from __future__ import annotations

import os

import dask.config
import yaml

with open(os.path.join(os.path.dirname(__file__), "pgas.yaml")) as _f:
    DEFAULTS: dict = yaml.safe_load(_f)  # {"pgas": {...}}

dask.config.update_defaults(DEFAULTS)
