"""Client-side entry points: ``bootstrap``, ``world``, ``teardown``."""

from __future__ import annotations

import logging
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any

from dask.utils import format_bytes

from ..errors import PGASWorldError
from ..runtime import without_unused_backends
from ._config import duration, setting
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
        """The PE of the worker at ``address`` (``ValueError`` when it is not a member of this world)."""
        try:
            return self.workers.index(address)
        except ValueError:
            raise ValueError(f"{address!r} is not a member of PGAS world #{self.epoch} "
                             f"(its workers: {list(self.workers)})") from None

    def heap_bytes(self) -> dict[str, int]:
        """Symmetric bytes held by each member, by address (from ``world(client, detail=True)``; empty
        without ``detail``)."""
        return {w: i.get("heap", {}).get("bytes", 0) for w, i in self.info.items() if isinstance(i, dict)}

    def __str__(self) -> str:
        state = f"BROKEN: {self.broken}" if self.broken else "ok"
        lines = [f"PGAS world #{self.epoch} ({', '.join(self.backends) or 'none'}; {state})"]
        for pe, w in enumerate(self.workers):
            extra = ""
            i = self.info.get(w)
            if isinstance(i, dict):
                extra = (f"  heap={format_bytes(i.get('heap', {}).get('bytes', 0))} runs={i.get('runs', 0)} "
                         f"collective={i.get('collective_seconds', 0.0):.3f}s "
                         f"idle-output-blocks={format_bytes(i.get('output_pool_idle', 0))} "
                         f"scratch={format_bytes(i.get('scratch_bytes', 0))}")
            lines.append(f"  PE {pe}: {w}{extra}")
        return "\n".join(lines)


def _client(client, call: str):
    if client is None:
        from distributed import default_client

        try:
            client = default_client()
        except ValueError:
            raise ValueError(
                f"dask_pgas.{call} needs a Dask client: none was passed and none is running in this process. Start "
                "one, e.g. Client(dask_pgas.LocalMPICluster(n_workers=4)) or Client(scheduler_file=...) for a "
                f"dask-mpi job, or pass it: dask_pgas.{call}(client)") from None
    if client.status in ("closing", "closed"):
        raise PGASWorldError(f"the client is {client.status}: use a connected client of the cluster")
    if on_its_event_loop(client):
        raise TypeError(
            "dask_pgas calls the scheduler synchronously and cannot run on the event loop of an asynchronous "
            f"Client: run it in a thread, e.g. await asyncio.to_thread(dask_pgas.{call}, client) (the same for "
            "every dask_pgas call that takes a client, and for building a rechunk), or use a synchronous Client"
        )
    return client


def on_its_event_loop(client) -> bool:
    """Whether this runs on an asynchronous client's event loop: there its scheduler calls return coroutines,
    and dask_pgas's client calls block on the scheduler (they took the coroutines for 'no world')."""
    return bool(getattr(client, "asynchronous", False))


def _world_from(d: dict) -> World:
    return World(d["epoch"], tuple(d["workers"]), tuple(d["backends"]), d["broken"], d.get("info", {}))


def bootstrap(client=None, *, backends=None, timeout=None) -> World:
    """Bring up the PGAS runtime on every worker of ``client``'s cluster and fix the world (idempotent).

    Registers the scheduler and worker plugins (idempotent, so several clients may call this), then, unless
    an intact world exists already, orders the workers by MPI rank (by name when they are not one MPI job) and
    initializes the runtime on each (on its collective thread): a workers-only MPI communicator, or an NVSHMEM
    unique id handed out by the scheduler when the workers are not one MPI job. ``backends`` defaults to config
    ``pgas.backends`` of this process (when null, the scheduler's), ``timeout`` to ``pgas.bootstrap-timeout`` of
    this process. Returns the :class:`World`.

    Raises:
        ValueError: ``timeout`` (or config ``pgas.bootstrap-timeout``) is not a positive duration, or config
            ``pgas.backends`` is not a backend name or list of them.
        PGASWorldError: the scheduler refused or the bring-up failed (the message says why, naming the worker).
        TypeError: called on the event loop of an asynchronous ``Client`` (run it in a thread).
    """
    if backends is None:  # this process's config (a key set with dask.config.set here)
        backends = setting("backends")
    if isinstance(backends, (str, list, tuple)) and all(isinstance(b, str) for b in backends):
        # nvmath's "nccl" dropped here, with the warning at the caller (the workers' would stay in their logs),
        # so that the world's backends are the ones its workers run
        backends = without_unused_backends([backends] if isinstance(backends, str) else list(backends), 3) or backends
    timeout = setting("bootstrap-timeout") if timeout is None else duration(timeout, "bootstrap(timeout=...)")
    client = _client(client, "bootstrap")
    client.register_plugin(PGASSchedulerPlugin())
    client.register_plugin(PGASWorkerPlugin())
    result = _ask(client, "pgas_bootstrap", backends=backends, timeout=timeout)
    if result["status"] != "OK":
        raise PGASWorldError(f"dask_pgas.bootstrap failed: {result['message']}")
    if result.get("warning"):
        warnings.warn(f"dask_pgas.bootstrap: {result['warning']}", RuntimeWarning, stacklevel=2)
    if backends is not None:
        wanted = [backends] if isinstance(backends, str) else list(backends)
        if wanted != list(result["backends"]):  # only an intact world, returned as is, differs
            logger.warning("dask_pgas.bootstrap(backends=%s): the cluster already has an intact PGAS world on %s, "
                           "returned as is; dask_pgas.teardown(client) first to change backends",
                           wanted, list(result["backends"]))
    return _world_from(result)


_SCHEDULERS_WITH_PLUGIN: set[str] = set()  # addresses of schedulers seen with the dask_pgas plugin


def _has_world_handler(dask_scheduler=None) -> bool:
    return "pgas_world" in dask_scheduler.handlers


def scheduler_world(client, **kwargs: Any) -> dict | None:
    """The scheduler plugin's description of the world (``describe_world``), or None when the scheduler has no
    dask_pgas plugin (:func:`bootstrap` never ran there). A scheduler not yet seen with the plugin is asked
    first whether it has one, so that a never-bootstrapped scheduler logs no missing-handler traceback."""
    address = client.scheduler.address
    if address not in _SCHEDULERS_WITH_PLUGIN:
        try:
            has = client.run_on_scheduler(_has_world_handler)
        except Exception:  # cannot tell (a scheduler refusing pickled functions): ask the handler itself
            has = True
        if not has:
            return None
        _SCHEDULERS_WITH_PLUGIN.add(address)
    d = _ask(client, "pgas_world", **kwargs)
    return d if isinstance(d, dict) else None  # (a scheduler without the handler answers None)


def _ask(client, handler: str, **kwargs: Any) -> Any:
    """The scheduler plugin's answer to ``handler``; a scheduler that does not answer (a comm failure or
    timeout: not "no world") raises :class:`PGASWorldError` naming it."""
    try:
        return client.sync(getattr(client.scheduler, handler), **kwargs)
    except (OSError, TimeoutError) as exc:  # (CommClosedError is an OSError)
        raise PGASWorldError(f"the scheduler at {client.scheduler.address} does not answer ({exc!r})") from None


def world(client=None, *, detail: bool = False) -> World | None:
    """The cluster's PGAS world (PE <-> worker), or None before :func:`bootstrap` and after :func:`teardown`.

    With ``detail`` every member also reports its symmetric heap use, runs and collective time.
    """
    client = _client(client, "world")
    d = scheduler_world(client, detail=detail)
    if d is None:
        return None
    if not d["workers"] and not d["broken"]:
        return None
    return _world_from(d)


def teardown(client=None) -> dict[str, int]:
    """Free every symmetric buffer and plan and finalize the runtime on all members (collective).

    Returns the symmetric bytes each worker still holds afterwards (all zero when clean).
    """
    client = _client(client, "teardown")
    described = scheduler_world(client)
    if described is None:
        raise PGASWorldError("no PGAS world to tear down: dask_pgas.bootstrap(client) never ran on this cluster")
    # through the client's stream, behind the graphs it sent: the scheduler checks for rechunks still to run
    # only once it has handled them (the call itself could overtake a graph submitted just before). Only to a
    # plugin that handles it: an unknown stream message makes the scheduler drop this client's stream.
    fence = f"pgas-fence-{uuid.uuid4().hex}" if described.get("fence") else None
    try:
        if fence is not None:
            client._send_to_scheduler({"op": "pgas-fence", "token": fence})
    except Exception as exc:  # (a closed client)
        raise PGASWorldError(f"the client cannot reach the scheduler ({exc!r}); the world was not torn down") from None
    try:
        result = _ask(client, "pgas_teardown", **({"fence": fence} if fence is not None else {}))
    except PGASWorldError as exc:  # the world may be there still
        raise PGASWorldError(f"{exc}; the world was not torn down") from None
    except Exception as exc:  # (the scheduler's handler raised: the world may still be up)
        raise PGASWorldError(f"the scheduler's teardown failed ({exc!r}); the world may still be up") from None
    if result["status"] != "OK":
        raise PGASWorldError(f"dask_pgas.teardown failed: {result['message']}")
    return {w: r["heap"].get("bytes", 0) + r["buffer_bytes"] for w, r in result["workers"].items()}
