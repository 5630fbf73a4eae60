"""``dask_pgas.rechunk``: a Dask array rechunk done as ONE collective reshape over the PGAS world.

::

    input chunks (anywhere)        per PE (one per worker), pinned there             output chunks (on owners)
    ───────────────────────        ──────────────────────────────────────           ─────────────────────────
    x[0,0] x[0,1] ──┐
    x[1,0] x[1,1] ──┼─► transfer(pe): refs to the chunks of the PE's input Box (Dask moves only
       ...          │   chunks not already there: boxes are owner-aware, output boxes chunk-aligned;
                    │   an input box may cut a chunk, and then only the piece travels)
                    │          │ x P
                    │          │ the last one in memory ──► scheduler plugin: run id + global seq,
                    │          │                            pgas_start(seq) to every PE ─┐
                    │          ▼                                                         ▼
                    │   collective thread (one per worker, runs in seq order; not a task slot):
                    │     pack chunks -> symmetric input buffer (NVSHMEM) or local scratch (MPI: no copy
                    │       when one C-contiguous chunk IS the box)
                    │     plan.execute: ONE Alltoallw / NVSHMEM reshape   input Box[pe] ──► output Box[pe]
                    │     (watchdog: pgas.collective-timeout; a lost PE fails the run at once)
                    │          │
                    │   barrier <- all transfer(*): the run has started; returns its number at once
                    │          │
                    └─────► output(chunk) <- barrier, pinned to its owner: dispatched while the collective runs,
                                waits for the run to end on its PE, then a slice of the output Box ──► y[i,j]

When no element changes PE (one PE, or output boxes equal to the input boxes) the graph is one pinned task per
output chunk built straight from the PE's input chunks: no collective, no staging, no barrier (config
``pgas.local-rechunk``).

Planning (``dask_pgas.geometry.chunks``) turns the input grid into one input Box per PE and the output grid
into one chunk-aligned output Box per PE; the scheduler plugin pins tasks, orders collectives and fails them
when a member leaves. Cases the collective cannot do follow ``pgas.fallback``.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from typing import Any

import dask
import numpy as np

from ..errors import PGASRechunkUnsupported
from ._client import on_its_event_loop, scheduler_world
from ._config import check_all, setting
from ._worker_plugin import RunSpec

__all__ = ["array_expr_mode", "install", "installed", "rechunk", "uninstall"]

# name of a pgas rechunk output -> {output chunk index: PE}, so that a following rechunk knows the placement
_owners: OrderedDict[str, dict] = OrderedDict()
_owners_lock = threading.Lock()


def _original_rechunk():
    fn = sys.modules["dask.array.rechunk"].rechunk
    return getattr(fn, "__pgas_original__", fn)


def _dask_rechunk(x):
    """Dask's own rechunk for ``x``: an array-expression array's own method (the legacy function would turn it
    into a legacy array)."""
    from dask.array.core import Array

    return _original_rechunk() if isinstance(x, Array) else type(x).rechunk


def _fallback(x, chunks, reason: str, fix: str, threshold, block_size_limit, balance):
    policy = setting("fallback")
    if policy in ("tasks", "p2p"):
        return _dask_rechunk(x)(x, chunks, threshold=threshold, block_size_limit=block_size_limit,
                                balance=balance, method=policy)
    raise PGASRechunkUnsupported(" ".join(part for part in (
        f"method='pgas' cannot rechunk this array: {reason}.", fix,
        "Or set dask.config.set({'pgas.fallback': 'tasks'}) (or 'p2p') to use Dask's own rechunk in such cases.",
    ) if part))


def _normalize(x, chunks, block_size_limit):
    """``chunks`` normalised exactly as ``dask.array.rechunk.rechunk`` does it (dict/None/-1/'auto'), before
    balancing."""
    from dask.array.core import normalize_chunks
    from dask.array.utils import validate_axis

    if isinstance(chunks, dict):
        chunks = {validate_axis(c, x.ndim): v for c, v in chunks.items()}
        for i in range(x.ndim):
            if i not in chunks or chunks[i] is None:
                chunks[i] = x.chunks[i]
    if isinstance(chunks, (tuple, list)):
        chunks = tuple(lc if lc is not None else rc for lc, rc in zip(chunks, x.chunks))
    chunks = normalize_chunks(chunks, x.shape, limit=block_size_limit, dtype=x.dtype, previous_chunks=x.chunks)
    if len(chunks) != x.ndim:
        raise ValueError("Provided chunks are not consistent with shape")
    return chunks


def array_expr_mode() -> bool:
    """Whether ``dask.array`` runs in array-expression mode (fixed by ``array.query-planning`` when
    ``dask.array`` was first imported; setting the key later changes nothing)."""
    import dask.array
    import dask.array.core

    return dask.array.Array is not dask.array.core.Array


_EXPR_FIX = ("Set DASK_ARRAY__QUERY_PLANNING=False (or dask.config.set({'array.query-planning': False})) "
             "before dask.array is first imported.")


def _world(client, x=None) -> dict | None:
    """The cluster's world and, for ``x``, where its chunks already are (input chunk index -> PE)."""
    keys = None
    if x is not None:
        with _owners_lock:
            known = _owners.get(x.name)
        if known is None and x.npartitions <= 200_000:
            keys = list(dask.core.flatten(x.__dask_keys__()))
    world = scheduler_world(client, keys=keys)
    if world is None:  # no dask_pgas plugin on the scheduler: never bootstrapped
        return None
    if x is not None:
        if known is not None:
            world["locations"] = known
        else:
            world["locations"] = {tuple(key[1:]): pe for key, pe in world.get("locations", ())}
    return world


def rechunk(
    x,
    chunks: Any = "auto",
    threshold: int | None = None,
    block_size_limit: int | None = None,
    balance: bool = False,
    method: str | None = None,
    *,
    client=None,
    _delay: float = 0.0,
):
    """Rechunk ``x`` like ``x.rechunk(chunks, ...)``, moving the data in ONE collective reshape.

    Accepts every ``chunks`` form of :meth:`dask.array.Array.rechunk` (ints, tuples, dict by axis, ``-1``,
    ``None``, ``"auto"``, ``balance``; a ``method`` other than ``"pgas"`` goes to Dask's own rechunk).
    Lazy: returns a Dask array; the collective runs when it is computed.
    Needs a PGAS world on the cluster of ``client`` (default: the current client), see
    :func:`dask_pgas.bootstrap`. Unsupported cases follow config ``pgas.fallback``.
    """
    from dask.array.core import Array, new_da_object
    from dask.array.rechunk import _balance_chunksizes, _validate_rechunk, plan_rechunk
    from dask.base import tokenize
    from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

    from ..geometry.chunks import plan_chunks
    from ._graph import RechunkLayer, build_graph, build_local_graph

    args = (threshold, block_size_limit, balance)
    if method not in (None, "pgas"):  # same signature as Array.rechunk: other methods are Dask's
        return _dask_rechunk(x)(x, chunks, *args, method=method)
    check_all()  # a bad pgas.* value fails here, naming its key, not inside a worker's run
    if not isinstance(x, Array):
        if array_expr_mode():
            return _fallback(x, chunks, "dask.array runs in array-expression mode (array.query-planning)",
                             _EXPR_FIX, *args)
        raise TypeError(f"dask_pgas.rechunk needs a dask array, not {type(x).__name__}")
    if x.ndim > 0 and all(s == 0 for s in x.shape):
        return x
    # Dask's own normalisation: its errors are the errors Dask's rechunk raises, also with unknown chunk sizes.
    # Fallbacks get the caller's ``chunks``: Dask normalises and balances them itself (balancing twice would
    # also warn twice), so this balances only once no fallback is left.
    target = _normalize(x, chunks, block_size_limit)
    if not balance and target == x.chunks:  # as Dask: the array itself, also with unknown chunk sizes
        return x
    _validate_rechunk(x.chunks, target)  # (balancing keeps the sums it checks)
    # Dask's plan of intermediate steps, not used here: what its rechunk refuses in threshold and
    # block_size_limit, and where, is refused the same way (it checks neither with unknown chunk sizes)
    plan_rechunk(x.chunks, target, x.dtype.itemsize, threshold, block_size_limit)
    if any(np.isnan(s) for s in x.shape) or any(np.isnan(c) for axis in x.chunks for c in axis):
        return _fallback(x, chunks, "the input has unknown (NaN) chunk sizes",
                         "Call x.compute_chunk_sizes() first.", *args)
    if x.ndim == 0 or x.size == 0:  # nothing to move, whatever the dtype: Dask's graph of (empty) chunks
        return _original_rechunk()(x, chunks, *args, method="tasks")
    if x.dtype.kind == "T":  # NumPy 2's StringDType: chunks point at strings kept elsewhere in the process
        return _fallback(x, chunks, f"dtype {x.dtype} keeps variable-width strings outside the array",
                         "Use a fixed-width string dtype (x.astype('U<n>') or 'S<n>').", *args)
    if x.dtype.hasobject:
        return _fallback(x, chunks, f"dtype {x.dtype} holds Python objects", "Use a numeric dtype.", *args)
    if isinstance(x._meta, np.ma.MaskedArray):
        return _fallback(x, chunks, "masked arrays (numpy.ma) are not supported: the collective moves the data, "
                         "not the mask", "Rechunk the data (x.map_blocks(np.ma.getdata)) and the mask "
                         "(x.map_blocks(np.ma.getmaskarray)) separately.", *args)
    package = type(x._meta).__module__.split(".")[0]
    if package not in ("numpy", "cupy"):
        return _fallback(x, chunks, f"chunks of type {type(x._meta).__name__} are not supported",
                         "Use NumPy or CuPy chunks.", *args)
    if client is None:
        try:
            from distributed import default_client

            client = default_client()
        except (ImportError, ValueError):
            return _fallback(x, chunks, "there is no Dask distributed client",
                             "Start one on a cluster with a PGAS world (dask_pgas.LocalMPICluster + "
                             "dask_pgas.bootstrap(client)).", *args)
    if on_its_event_loop(client):
        return _fallback(x, chunks, "it was called on the event loop of an asynchronous Client, and building a pgas "
                         "rechunk asks the scheduler synchronously",
                         "Build it in a thread: y = await asyncio.to_thread(dask_pgas.rechunk, x, chunks).", *args)
    world = _world(client, x)
    if world and world["broken"]:  # (a member left: world() shows it broken too)
        return _fallback(x, chunks, world["broken"], "", *args)  # (it says how to recover)
    if not world or not world["workers"]:
        return _fallback(x, chunks, "the cluster has no PGAS world",
                         "Call dask_pgas.bootstrap(client); when it refuses, its message says why this cluster "
                         "cannot have one (its workers must be the ranks of one MPI job, or GPU workers).", *args)
    if package == "cupy" and "nvshmem" not in world["backends"]:
        return _fallback(x, chunks, "CuPy chunks need the 'nvshmem' backend on GPU workers",
                         "Tear this world down (dask_pgas.teardown(client)) and bootstrap GPU workers with "
                         "backends=['nvshmem'].", *args)
    if package == "numpy" and "mpi" not in world["backends"]:
        return _fallback(x, chunks, "NumPy chunks on a GPU-only world",
                         "Use CuPy chunks (x.map_blocks(cupy.asarray)), or tear this world down "
                         "(dask_pgas.teardown(client)) and bootstrap with backends=['nvshmem', 'mpi'] (workers that "
                         "are the ranks of one MPI job).", *args)
    if balance:
        target = tuple(_balance_chunksizes(c) for c in target)
    npes = len(world["workers"])
    plan = plan_chunks(x.chunks, target, npes, world["locations"])
    spec = RunSpec(plan.input_boxes, plan.output_boxes, x.dtype, package, float(_delay))
    local_ok = setting("local-rechunk")
    local = plan.is_local and not _delay and local_ok
    token = tokenize(x, target, "pgas", world["epoch"], npes, spec, local)
    name = f"pgas-rechunk-{token}"
    owner = plan.output_owner()
    if local:  # (one task per output chunk: Dask culls it as it culls its own rechunk)
        layer = MaterializedLayer(build_local_graph(x, plan, name, world["epoch"], package))
    else:  # (a selection of the result runs the exchange of its region only)
        layer = RechunkLayer(build_graph(x, plan, name, world["epoch"], spec), x, plan, owner, name,
                             world["epoch"], spec, local_ok)
    with _owners_lock:
        _owners[name] = owner
        while len(_owners) > 64:
            _owners.popitem(last=False)
    graph = HighLevelGraph.from_collections(name, layer, dependencies=[x])
    return new_da_object(graph, name, target, meta=x._meta, dtype=x.dtype)


# ---------------------------------------------------------------------------- dispatch from Array.rechunk
_install_lock = threading.Lock()


def installed() -> bool:
    return hasattr(sys.modules.get("dask.array.rechunk") and sys.modules["dask.array.rechunk"].rechunk,
                   "__pgas_original__")


def install() -> None:
    """Make ``x.rechunk(..., method="pgas")`` and config ``array.rechunk.method: pgas`` use :func:`rechunk`.

    Opt-in and idempotent; ``"tasks"`` and ``"p2p"`` (and the automatic choice) are passed through untouched.
    Undo with :func:`uninstall`. Raises :class:`PGASRechunkUnsupported` in array-expression mode, whose
    ``Array.rechunk`` never calls ``dask.array.rechunk.rechunk`` (``method="pgas"`` would silently run tasks).
    """
    import importlib

    if array_expr_mode():
        raise PGASRechunkUnsupported(
            "dask_pgas.install() cannot add method='pgas': dask.array runs in array-expression mode "
            "(array.query-planning), whose Array.rechunk would silently run method='tasks' instead. " + _EXPR_FIX
        )
    module = importlib.import_module("dask.array.rechunk")  # the module: ``dask.array.rechunk`` is the function
    with _install_lock:
        if hasattr(module.rechunk, "__pgas_original__"):
            return
        original = module.rechunk

        def rechunk_with_pgas(x, chunks="auto", threshold=None, block_size_limit=None, balance=False,
                              method=None):
            if (method or dask.config.get("array.rechunk.method", None)) == "pgas":
                return rechunk(x, chunks, threshold=threshold, block_size_limit=block_size_limit,
                               balance=balance)
            return original(x, chunks, threshold=threshold, block_size_limit=block_size_limit,
                            balance=balance, method=method)

        rechunk_with_pgas.__doc__ = original.__doc__
        rechunk_with_pgas.__wrapped__ = original
        rechunk_with_pgas.__pgas_original__ = original
        module.rechunk = rechunk_with_pgas
        package = sys.modules["dask.array"]
        if getattr(package, "rechunk", None) is original:
            package.rechunk = rechunk_with_pgas


def uninstall() -> None:
    """Undo :func:`install`."""
    module = sys.modules.get("dask.array.rechunk")
    with _install_lock:
        if module is None or not hasattr(module.rechunk, "__pgas_original__"):
            return
        wrapper = module.rechunk
        module.rechunk = wrapper.__pgas_original__
        package = sys.modules["dask.array"]
        if getattr(package, "rechunk", None) is wrapper:
            package.rechunk = wrapper.__pgas_original__

