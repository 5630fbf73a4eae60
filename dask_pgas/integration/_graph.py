"""The task graph of one pgas rechunk: P transfer tasks, one barrier, one output task per output chunk.

When no element changes PE (``ChunkPlan.is_local``: one PE, or output boxes that are the input boxes) there is
nothing to exchange: :func:`build_local_graph` makes one pinned task per output chunk that builds it straight
from its PE's input chunks (one copy, or a view when the chunk lies inside one input chunk), with no
collective, no symmetric staging and no barrier round trip through the scheduler.

Transfer and output tasks are :class:`PinnedTask` (a ``Task`` subclass that blocks fusion and carries its PE);
the scheduler plugin pins them to the PE's worker in ``update_graph``. Transfer tasks only stage references.
The scheduler starts the collective the moment the last transfer task is in memory (see ``_scheduler_plugin``);
the barrier task, which depends on all transfer tasks, only confirms that the run has started and returns its
number. The output tasks are therefore dispatched (and fetch the barrier's small result) while the collective
runs, and each waits on its worker for that run to end there: the Dask hops after the collective shrink to the
output tasks' completion (S1 on 2 cores: run end -> client 47 ms -> 12 ms). Waiting only for an already started
run, an output task never waits for another task, so concurrent rechunks cannot deadlock on task slots.

(One barrier per PE, so that output tasks need no data from another worker, was tried: its P x P small
fetches cost more than the one fetch per output worker they save, on 2 cores: S1 0.177 s instead of 0.162 s.)
"""

from __future__ import annotations

from typing import Any

from dask._task_spec import Task, TaskRef
from dask.highlevelgraph import MaterializedLayer

from ..errors import CollectiveError
from ._worker_plugin import RunSpec, agreed_error_class, copy_piece, get_plugin, piece_of, refuse_unmovable


class _Unfused(Task):
    """A task that low-level fusion leaves alone (its key and type reach the scheduler plugin)."""

    __slots__ = ()

    @property
    def block_fusion(self) -> bool:
        return True

    def rebuilt(self, key: Any, args: tuple) -> _Unfused:
        """This task as ``key``'s, with ``args`` for its arguments (its type, function and keywords kept)."""
        return type(self)(key, self.func, *args, **self.kwargs)


class PinnedTask(_Unfused):
    """A task that must run on the worker of PE ``pe`` of PGAS world ``epoch`` (never fused away)."""

    pe: int
    epoch: int
    npes: int

    __slots__ = tuple(__annotations__)

    def __init__(self, key: Any, func, /, *args: Any, pe: int, epoch: int, npes: int, **kwargs: Any) -> None:
        self.pe = pe
        self.epoch = epoch
        self.npes = npes
        super().__init__(key, func, *args, **kwargs)

    def rebuilt(self, key: Any, args: tuple) -> PinnedTask:
        return type(self)(key, self.func, *args, pe=self.pe, epoch=self.epoch, npes=self.npes, **self.kwargs)

    def copy(self):
        return self.rebuilt(self.key, self.args)

    def __repr__(self) -> str:
        return f"PinnedTask({self.key!r}, pe={self.pe})"


class PieceTask(_Unfused):
    """The part of one input chunk that goes to another PE than the rest of it (``chunk[slices]``).

    Sliced where the chunk is (the scheduler plugin restricts it, loosely, to a holder of the chunk), so Dask
    ships only the piece to its PE, not the whole chunk to every PE that takes a part of it.
    """

    __slots__ = ()


class BarrierTask(_Unfused):
    __slots__ = ()


def transfer(name: str, pe: int, epoch: int, npes: int, spec: RunSpec, pieces: tuple, *arrays: Any) -> int:
    """On PE ``pe``: hand references to this PE's input chunks to the plugin (no copy, no waiting)."""
    get_plugin().stage(name, pe, epoch, npes, spec, pieces, arrays)
    return pe


def barrier(name: str, epoch: int, *transfers: int) -> int:
    """Every transfer task is done: make sure the scheduler has started the run of ``name`` (normally its
    transition hook already has) and return the run's number, without waiting for the collective to end."""
    from distributed.utils import sync

    worker = get_plugin().worker
    result = sync(worker.loop, worker.scheduler.pgas_barrier, name=name, epoch=epoch)
    if result["status"] != "OK":  # (a reason with a class of its own, a bad config value, raises as that too)
        raise (agreed_error_class(cls) if (cls := result.get("class")) else CollectiveError)(result["message"])
    return result["run"]


def output(name: str, pe: int, epoch: int, npes: int, box_slices: tuple, whole: bool, run: int) -> Any:
    """On PE ``pe``: this output chunk, cut out of the PE's output box once run ``run`` has ended there."""
    return get_plugin().take(name, pe, epoch, npes, box_slices, whole, run)


#: the task functions whose first argument is the run's name (its keys are named after it too)
_NAMED = (transfer, barrier, output)


def _key_name(key: Any) -> str:
    return key[0] if isinstance(key, tuple) else str(key)


try:  # the function of the wrapper that dask.delayed(f)(y) puts around every task of y (see unwrapped)
    from dask._expr import ProhibitReuse

    _REUSE_WRAPPER = ProhibitReuse._identity
except (ImportError, AttributeError):  # older dask: no such wrapper
    _REUSE_WRAPPER = None


def unwrapped(run_spec: Any) -> _Unfused | None:
    """The task of this module inside the wrapper that dask's ``ProhibitReuse`` puts around every task of a
    collection passed positionally to ``dask.delayed(f)(y)`` (``Task(key + suffix, _identity, task)``, the inner
    task's own key unchanged), else None. Called on every task the scheduler receives: cheap checks first."""
    if (type(run_spec) is Task and _REUSE_WRAPPER is not None and run_spec.func is _REUSE_WRAPPER
            and len(run_spec.args) == 1 and not run_spec.kwargs and isinstance(run_spec.args[0], _Unfused)):
        return run_spec.args[0]
    return None


def rekeyed(task: _Unfused, key: Any) -> _Unfused:
    """``task`` as the task of ``key``, its own key with a suffix (see :func:`unwrapped`). A run's name in its
    tasks' arguments gets the same suffix: the scheduler names a run after its tasks' keys, the workers after
    those arguments, and they must agree (a suffixed graph computed beside the original runs on its own)."""
    suffix = _key_name(key)[len(_key_name(task.key)):]
    args = task.args
    if task.func in _NAMED:
        args = (args[0] + suffix, *args[1:])
    return task.rebuilt(key, args)


def assemble(pe: int, epoch: int, npes: int, shape: tuple, dtype: Any, package: str, pieces: tuple,
             *arrays: Any) -> Any:
    """On PE ``pe``: an output chunk of the array's ``dtype`` (an ``np.dtype``: ``dtype.str`` loses a struct's
    fields) built from input chunk pieces that are already on this PE (local plan). (Dask can hand over chunks
    whose byte order differs from the array's dtype.)"""
    import numpy as np

    get_plugin().check(pe, epoch, npes)
    refuse_unmovable(arrays, dtype, package)
    if len(pieces) == 1:
        view = arrays[0][pieces[0][0]]
        if view.shape == tuple(shape) and view.dtype == dtype:
            return view
    out = np.empty_like(arrays[0], shape=shape, dtype=dtype)
    for (chunk_slices, out_slices), arr in zip(pieces, arrays):
        copy_piece(out, out_slices, arr, chunk_slices)
    return out


def empty_chunk(meta: Any, shape: tuple) -> Any:
    import numpy as np
    from dask.array.utils import meta_from_array

    return np.empty_like(meta_from_array(meta), shape=shape)


def build_graph(x, plan, name: str, epoch: int, spec: RunSpec, key_name: str | None = None) -> dict:
    """Tasks of one pgas rechunk of ``x`` following ``plan`` (a :class:`~dask_pgas.geometry.chunks.ChunkPlan`):
    run ``name``, output keys ``(key_name or name, *index)``."""
    import numpy as np

    token = name[len("pgas-rechunk-"):]
    tname, bname = f"pgas-transfer-{token}", f"pgas-barrier-{token}"
    dsk: dict = {}
    cut = plan.shared_chunks()
    for pe, pieces in enumerate(plan.inputs):
        key = (tname, pe)
        refs, slices = [], []
        for p in pieces:
            ref, chunk_slices = _source(dsk, x, token, (pe,), p.index, p.chunk_slices, p.index in cut,
                                        spec.package)
            refs.append(ref)
            slices.append((chunk_slices, p.box_slices))
        dsk[key] = PinnedTask(key, transfer, name, pe, epoch, plan.npes, spec, tuple(slices), *refs, pe=pe, epoch=epoch,
                              npes=plan.npes)
    dsk[bname] = BarrierTask(bname, barrier, name, epoch, *(TaskRef((tname, pe)) for pe in range(plan.npes)))
    done = set()
    key_name = key_name or name
    for pe, pieces in enumerate(plan.outputs):
        box = plan.output_boxes[pe]
        for p in pieces:
            key = (key_name, *p.index)
            whole = tuple(s.stop - s.start for s in p.box_slices) == box.box_shape
            dsk[key] = PinnedTask(key, output, name, pe, epoch, plan.npes, p.box_slices, whole, TaskRef(bname),
                                  pe=pe, epoch=epoch, npes=plan.npes)
            done.add(p.index)
    for index in np.ndindex(*(len(c) for c in plan.chunks_out)):
        if index not in done:  # chunks without elements
            key = (key_name, *index)
            shape = tuple(plan.chunks_out[a][i] for a, i in enumerate(index))
            dsk[key] = Task(key, empty_chunk, x._meta, shape)
    return dsk


def _source(dsk: dict, x, token: str, tag: tuple, index: tuple, chunk_slices: tuple, cut: bool, package: str):
    """A reference to input chunk ``index`` and the slices of it to read; for a chunk ``cut`` between PEs, a
    :class:`PieceTask` (keyed by ``tag``) that slices it where it is, so that only the part travels."""
    ref = TaskRef((x.name, *index))
    if not cut:
        return ref, chunk_slices
    key = (f"pgas-piece-{token}", *tag, *index)
    dsk[key] = PieceTask(key, piece_of, ref, chunk_slices, x.dtype, package)
    return TaskRef(key), tuple(slice(0, s.stop - s.start) for s in chunk_slices)


def build_local_graph(x, plan, name: str, epoch: int, package: str, key_name: str | None = None) -> dict:
    """Tasks of a pgas rechunk whose ``plan`` moves nothing between PEs: one pinned task per output chunk (keys
    ``(key_name or name, *index)``)."""
    from ..geometry.chunks import chunk_sources

    owner = plan.output_owner()
    token = name[len("pgas-rechunk-"):]
    cut = plan.shared_chunks()
    dsk: dict = {}
    for index, pieces in chunk_sources(plan.chunks_in, plan.chunks_out):
        key = (key_name or name, *index)
        shape = tuple(plan.chunks_out[a][i] for a, i in enumerate(index))
        pe = owner.get(index)
        if pe is None or not pieces:  # chunks without elements
            dsk[key] = Task(key, empty_chunk, x._meta, shape)
            continue
        refs, slices = [], []
        for src, chunk_slices, out_slices in pieces:
            ref, chunk_slices = _source(dsk, x, token, index, src, chunk_slices, src in cut, package)
            refs.append(ref)
            slices.append((chunk_slices, out_slices))
        dsk[key] = PinnedTask(key, assemble, pe, epoch, plan.npes, shape, x.dtype, package, tuple(slices), *refs,
                              pe=pe, epoch=epoch, npes=plan.npes)
    return dsk


class RechunkLayer(MaterializedLayer):
    """The graph of a collective pgas rechunk, culled by region: computing some of its output chunks (a
    selection, ``y[:10, :10].compute()``) runs the exchange of the smallest chunk-aligned box holding them only
    (:meth:`~dask_pgas.geometry.chunks.ChunkPlan.restricted`: each PE keeps its part of that box, so every chunk
    is built on the PE the full plan gives it), reading only the input chunks that meet the box, instead of
    the whole input and the whole exchange (the barrier depends on every transfer task)."""

    def __init__(self, dsk: dict, x, plan, owner: dict, name: str, epoch: int, spec: RunSpec,
                 local_ok: bool) -> None:
        super().__init__(dsk)
        # (owner: ``plan.output_owner()``; local_ok: pgas.local-rechunk when built)
        self._rebuild = (x, plan, owner, name, epoch, spec, local_ok)

    def cull(self, keys, all_hlg_keys):
        from dask._task_spec import cull

        x, plan, owner, name, epoch, spec, local_ok = self._rebuild
        wanted = [k[1:] for k in keys if type(k) is tuple and k and k[0] == name and k[1:] in owner]
        if len(wanted) in (0, len(owner)):  # (chunks without elements only, or none: no run; or every chunk)
            return super().cull(keys, all_hlg_keys)
        region = plan.region_of(wanted)
        if not any(region.lower) and region.upper == plan.shape:  # (every element: the whole run)
            return super().cull(keys, all_hlg_keys)
        from dataclasses import replace

        from dask.base import tokenize

        part = plan.restricted(region)
        run = f"{name}-{tokenize(region.lower, region.upper)}"  # (a run of its own: ``pgas-rechunk-<token>``)
        if part.is_local and not spec.delay and local_ok:
            dsk = build_local_graph(x, part, run, epoch, spec.package, key_name=name)
        else:
            dsk = build_graph(x, part, run, epoch, replace(spec, input_boxes=part.input_boxes,
                                                            output_boxes=part.output_boxes), key_name=name)
        if not _region_run_fits(name, wanted, dsk):  # tasks of these keys with the whole run's dependencies
            return super().cull(keys, all_hlg_keys)
        # The new run's keys are in no other layer's ``all_hlg_keys`` (Dask 2025.1's default cull finds a task's
        # dependencies among those only, and lost the run's barrier and transfer tasks): Dask's own cull by the
        # tasks' dependencies, from this layer's keys asked for (never a chunk outside the region: its task here
        # is a stand-in).
        inside = part.output_owner()
        kept = cull(dsk, [k for k in keys if k in dsk and (type(k) is not tuple or k[0] != name
                                                          or k[1:] not in owner or k[1:] in inside)])
        return (MaterializedLayer(kept, annotations=self.annotations),
                {k: set(task.dependencies) for k, task in kept.items()})


def _region_run_fits(name: str, wanted: list, dsk: dict) -> bool:
    """Whether the region run ``dsk`` may give these output chunks of rechunk ``name``: none of them has a task
    on the scheduler already, or those that have are this same region run's (the same dependencies: Dask merges
    them). A task of such a key with other dependencies (the whole run's, after ``client.persist(y)`` and then
    ``y[:5]``, or ``y`` still being computed) would collide with the region run's output task of the same key,
    and distributed would keep the region run's other tasks on the scheduler for good.

    Dask 2026.8 materializes (and culls) a graph on the scheduler, in its ``update_graph``, where the scheduler's
    own tasks answer (so also on a client whose scheduler runs in its process); Dask 2025.1 on the client, where
    otherwise only its futures tell (taken as the whole run's; a graph of another client, or a compute still
    running, is not seen there)."""
    from ._scheduler_plugin import schedulers_here

    keys = [(name, *index) for index in wanted]
    schedulers = schedulers_here()
    if schedulers:  # (the scheduler's own tasks: the exact answer)
        try:
            return not any((ts := scheduler.tasks.get(k)) is not None
                           and {d.key for d in ts.dependencies} != set(dsk[k].dependencies)
                           for scheduler in schedulers for k in keys)
        except RuntimeError:  # a set changed size during iteration: Dask 2026.8 culls on an offload thread while
            return False  # the event loop changes the tasks; the whole run is right whatever is there
    try:
        from distributed import default_client

        futures = default_client().futures
    except (ImportError, ValueError):  # no client here (on the scheduler)
        return True
    return not any(k in futures for k in keys)
