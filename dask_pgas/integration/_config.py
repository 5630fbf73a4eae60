"""The ``pgas.*`` Dask config keys, read and checked in one place (defaults in ``dask_pgas/pgas.yaml``).

:func:`setting` raises a ``ValueError`` that names the key and what it takes, so a bad value fails where it is read
(the client when it builds a rechunk, a worker's run, which every PE then agrees on) instead of deep inside.
Strings are read as Dask reads environment variables (``dask.config.interpret_value``) and durations and sizes
with Dask's parsers.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import dask
from dask.utils import parse_bytes, parse_timedelta

from .._defaults import DEFAULTS  # (registered with Dask on ``import dask_pgas``)

__all__ = ["DEFAULTS", "check_all", "duration", "problem", "setting"]


#: the longest duration taken (about 31 years): thread waits refuse timeouts past ``threading.TIMEOUT_MAX``
MAX_SECONDS = 1e9


def duration(value: Any, what: str) -> float:
    """``value`` (seconds, a string such as ``"120s"`` or a timedelta) as positive seconds, at most
    :data:`MAX_SECONDS`."""
    try:
        seconds = None if isinstance(value, bool) else parse_timedelta(value, "s")
    except (TypeError, ValueError, KeyError):
        seconds = None
    if seconds is None or not 0 < seconds <= MAX_SECONDS:
        raise ValueError(f"{what} must be a positive duration such as 120 or '120s' (at most {MAX_SECONDS:.0e} s), "
                         f"got {value!r}")
    return float(seconds)


#: what a reader returns for a value it cannot take (None is a value: ``backends: null``)
_BAD: Any = object()


def _number(value: Any) -> float | None:
    """``value`` as a finite float (numbers, NumPy numbers and numeric strings, as int()/float() took them), or
    None."""
    if isinstance(value, str):
        value = dask.config.interpret_value(value.strip())
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        return None
    return float(value)


def _choice(value: Any) -> Any:
    return value if value in ("raise", "tasks", "p2p") else _BAD


def _backends(value: Any) -> Any:
    return value if value is None or isinstance(value, (str, list, tuple)) else _BAD


def _positive_int(value: Any) -> Any:
    number = _number(value)
    return int(number) if number is not None and number == int(number) and number >= 1 else _BAD


def _at_least_one(value: Any) -> Any:
    number = _number(value)
    return number if number is not None and number >= 1 else _BAD


def _size(value: Any) -> Any:
    if isinstance(value, bool):
        return _BAD
    try:
        nbytes = parse_bytes(value) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        return _BAD
    return nbytes if nbytes >= 0 else _BAD


def _flag(value: Any) -> Any:
    if isinstance(value, str):
        value = dask.config.interpret_value(value.strip())
    return bool(value) if isinstance(value, bool) or value in (0, 1) else _BAD


def _seconds(value: Any) -> Any:
    try:
        return duration(value, "")
    except ValueError:
        return _BAD


#: key -> (reader: the value, or _BAD; what the key takes)
_KEYS: dict[str, tuple[Callable[[Any], Any], str]] = {
    "fallback": (_choice, "'raise', 'tasks' or 'p2p'"),
    "backends": (_backends, "null or a list of backend names such as [mpi]"),
    "collective-timeout": (_seconds, f"a positive duration such as 120 or '120s' (at most {MAX_SECONDS:.0e} s)"),
    "bootstrap-timeout": (_seconds, f"a positive duration such as 120 or '120s' (at most {MAX_SECONDS:.0e} s)"),
    "plan-cache-size": (_positive_int, "an integer >= 1 (engine plans kept per worker)"),
    "buffer-growth": (_at_least_one, "a number >= 1"),
    "output-pool": (_size, "a size such as '1GiB', or 0 to turn the pool off"),
    "local-rechunk": (_flag, "true or false"),
}


_MISSING = object()


def setting(key: str) -> Any:
    """The checked value of config ``pgas.<key>`` (for durations: seconds)."""
    read, takes = _KEYS[key]
    value = dask.config.get(f"pgas.{key}", _MISSING)
    if value is _MISSING:
        # a ``dask.config.set({"pgas.<key>": ...})`` block around dask_pgas's first import removes the
        # whole pgas section on exit, the defaults with it: put the missing defaults back (user values stay)
        dask.config.update(dask.config.config, DEFAULTS, priority="old")
        value = dask.config.get(f"pgas.{key}")
    result = read(value)
    if result is _BAD:
        raise ValueError(f"config pgas.{key} must be {takes}, got {value!r}")
    return result


def problem(key: str) -> str | None:
    """Why config ``pgas.<key>`` of this process cannot be used, or None."""
    try:
        setting(key)
    except ValueError as exc:
        return str(exc)
    return None


def check_all() -> None:
    """Raise for the first ``pgas.*`` key of this process with a value it cannot take."""
    for key in _KEYS:
        setting(key)
