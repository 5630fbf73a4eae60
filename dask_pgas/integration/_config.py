"""The ``pgas.*`` Dask config keys, read and checked in one place (defaults in ``dask_pgas/pgas.yaml``).

Each reader raises a ``ValueError`` that names the key and what it takes, so a bad value fails where it is read
(the client when it builds a rechunk, a worker's run, which every PE then agrees on) instead of deep inside.
"""

from __future__ import annotations

import math
import numbers
from datetime import timedelta
from typing import Any

import dask
from dask.utils import parse_bytes, parse_timedelta

__all__ = ["check_all", "duration", "setting"]


def _bad(key: str, value: Any, takes: str) -> ValueError:
    return ValueError(f"config pgas.{key} must be {takes}, got {value!r}")


def duration(value: Any, what: str) -> float:
    """``value`` (seconds, a string such as ``"120s"`` or a timedelta) as positive seconds."""
    try:
        seconds = None if isinstance(value, bool) else parse_timedelta(
            value if isinstance(value, (str, timedelta)) else float(value), "s")
    except (TypeError, ValueError, KeyError):
        seconds = None
    if seconds is None or not seconds > 0:
        raise ValueError(f"{what} must be a positive duration such as 120 or '120s', got {value!r}")
    return float(seconds)


def _number(value: Any) -> float | None:
    """``value`` as a finite float (numbers, NumPy numbers and numeric strings as the int()/float() reads
    before these checks took them), or None."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value) if isinstance(value, (numbers.Real, str)) else None
    except ValueError:
        return None
    return number if number is not None and math.isfinite(number) else None


def _flag(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise _bad(key, value, "true or false")


def setting(key: str) -> Any:
    """The checked value of config ``pgas.<key>`` (for durations: seconds)."""
    value = dask.config.get(f"pgas.{key}")
    if key == "fallback":
        if value not in ("raise", "tasks", "p2p"):
            raise _bad(key, value, "'raise', 'tasks' or 'p2p'")
        return value
    if key in ("collective-timeout", "bootstrap-timeout"):
        return duration(value, f"config pgas.{key}")
    if key == "plan-cache-size":
        number = _number(value)
        if number is None or number != int(number) or number < 1:
            raise _bad(key, value, "an integer >= 1 (engine plans kept per worker)")
        return int(number)
    if key == "buffer-growth":
        number = _number(value)
        if number is None or not number >= 1:
            raise _bad(key, value, "a number >= 1")
        return number
    if key == "output-pool":
        try:
            nbytes = parse_bytes(value) if isinstance(value, str) else int(value)
        except (TypeError, ValueError):
            nbytes = -1
        if isinstance(value, bool) or nbytes < 0:
            raise _bad(key, value, "a size such as '1GiB', or 0 to turn the pool off")
        return nbytes
    if key == "local-rechunk":
        return _flag(key, value)
    if key == "backends":
        if value is not None and not isinstance(value, (str, list, tuple)):
            raise _bad(key, value, "null or a list of backend names such as [mpi]")
        return value
    raise KeyError(f"no config key pgas.{key}")


KEYS = ("fallback", "backends", "collective-timeout", "bootstrap-timeout", "plan-cache-size", "buffer-growth",
        "output-pool", "local-rechunk")


def check_all() -> None:
    """Raise for the first ``pgas.*`` key of this process with a value it cannot take."""
    for key in KEYS:
        setting(key)
