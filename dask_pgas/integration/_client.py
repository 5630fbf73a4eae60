"""Client-side entry points: ``bootstrap``, ``world``, ``teardown``."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ._exceptions import PGASWorldError
from ._scheduler_plugin import PGASSchedulerPlugin
from ._worker_plugin import PGASWorkerPlugin

__all__ = ["World", "bootstrap", "teardown", "world"]

logger = logging.getLogger("dask_pgas.integration")


@dataclass(frozen=True)
class World:
    """The PGAS world of a cluster: PE ``i`` is the worker at ``workers[i]``."""

    epoch: int
    workers: tuple[str, ...]
    backends: tuple[str, ...]
    broken: str | None = None
    info: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def npes(self) -> int:
        return len(self.workers)

    def pe_of(self, address: str) -> int:
        return self.workers.index(address)

    def heap_bytes(self) -> dict[str, int]:
        """Symmetric bytes held by each member (from ``world(client, detail=True)``)."""
        return {w: i.get("heap", {}).get("bytes", 0) for w, i in self.info.items() if isinstance(i, dict)}

    def __str__(self) -> str:
        state = f"BROKEN: {self.broken}" if self.broken else "ok"
        lines = [f"PGAS world #{self.epoch} ({', '.join(self.backends) or 'none'}; {state})"]
        for pe, w in enumerate(self.workers):
            extra = ""
            i = self.info.get(w)
            if isinstance(i, dict):
                extra = f"  heap={i.get('heap', {}).get('bytes', 0)}B runs={i.get('runs', 0)}"
            lines.append(f"  PE {pe}: {w}{extra}")
        return "\n".join(lines)


def _client(client):
    if client is None:
        from distributed import default_client

        client = default_client()
    return client


def _world_from(d: dict) -> World:
    return World(d["epoch"], tuple(d["workers"]), tuple(d["backends"]), d["broken"], d.get("info", {}))


def bootstrap(client=None, *, backends=None, timeout=None) -> World:
    """Bring up the PGAS runtime on every worker of ``client``'s cluster and fix the world (idempotent).

    Registers the scheduler and worker plugins (idempotent, so several clients may call this), then, unless
    an intact world exists already, orders the workers by MPI rank and initializes the runtime on each (on its
    collective thread): a workers-only MPI communicator, or an NVSHMEM unique id handed out by the scheduler
    when the workers are not one MPI job. Returns the :class:`World`.
    """
    client = _client(client)
    client.register_plugin(PGASSchedulerPlugin())
    client.register_plugin(PGASWorkerPlugin())
    result = client.sync(client.scheduler.pgas_bootstrap, backends=backends, timeout=timeout)
    if result["status"] != "OK":
        raise PGASWorldError(f"dask_pgas.bootstrap failed: {result['message']}")
    if backends is not None:
        wanted = [backends] if isinstance(backends, str) else list(backends)
        if wanted != list(result["backends"]):  # only an intact world, returned as is, differs
            logger.warning("dask_pgas.bootstrap(backends=%s): the cluster already has an intact PGAS world on %s, "
                           "returned as is; dask_pgas.teardown(client) first to change backends",
                           wanted, list(result["backends"]))
    return _world_from(result)


def world(client=None, *, detail: bool = False) -> World | None:
    """The cluster's PGAS world (PE <-> worker), or None before :func:`bootstrap`.

    With ``detail`` every member also reports its symmetric heap use, runs and collective time.
    """
    client = _client(client)
    try:
        d = client.sync(client.scheduler.pgas_world, detail=detail)
    except Exception:
        return None
    if not isinstance(d, dict):  # no ``pgas_world`` handler on the scheduler: never bootstrapped
        return None
    if not d["workers"] and not d["broken"]:
        return None
    return _world_from(d)


def teardown(client=None) -> dict[str, int]:
    """Free every symmetric buffer and plan and finalize the runtime on all members (collective).

    Returns the symmetric bytes each worker still holds afterwards (all zero when clean).
    """
    client = _client(client)
    try:
        result = client.sync(client.scheduler.pgas_teardown)
    except Exception as exc:
        raise PGASWorldError(f"no PGAS world to tear down ({exc}); call dask_pgas.bootstrap(client)") from None
    if result["status"] != "OK":
        raise PGASWorldError(f"dask_pgas.teardown failed: {result['message']}")
    return {w: r["heap"].get("bytes", 0) + r["buffer_bytes"] for w, r in result["workers"].items()}
