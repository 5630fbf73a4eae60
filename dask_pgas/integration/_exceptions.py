"""Errors of the Dask integration. Builtin subclasses, picklable, each message says what to do."""

from __future__ import annotations

from ..errors import CollectiveError, PGASError

__all__ = ["PGASRechunkUnsupported", "PGASWorldError"]


class PGASWorldError(CollectiveError):
    """The cluster has no usable PGAS world: never bootstrapped, a member left, or a collective failed."""


class PGASRechunkUnsupported(PGASError, NotImplementedError):
    """A rechunk the collective path cannot do (and config ``pgas.fallback`` is ``"raise"``)."""
