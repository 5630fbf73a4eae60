"""The worker side: one plugin per worker owns this process's PGAS runtime, buffers, plans and runs.

Every collective (bring-up, reshape, teardown) runs on ONE dedicated daemon thread per worker, in the global
order the scheduler hands out (``seq``), never on the event loop and never in a task slot. Tasks only stage
references to their chunks (``stage``) or take their output slice (``take``). An output task may wait for its
own run to end on this worker, but only for a run that has already started (all its transfer tasks are done),
so it never waits for another task.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import socket
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from distributed import WorkerPlugin

from ..errors import (
    CollectiveError,
    CollectiveMismatchError,
    DeviceError,
    PGASWorldError,
    RuntimeStateError,
    SymmetricMemoryError,
    UnsupportedOperandError,
)
from ._config import setting

#: The GPU of a PE is the one its worker's tasks allocate on: CUDA device 0 of what the worker sees. Launchers that
#: give each worker a GPU of its own do it with CUDA_VISIBLE_DEVICES (dask-cuda puts the worker's GPU first in a
#: rotated list, LocalMPICluster(gpus=N) shows one), so the symmetric heap lies on the GPU that holds the chunks.
#: (The core's default, the node-local rank modulo the visible GPUs, would put PE k of a dask-cuda cluster on the
#: k-th GPU of its rotated list: two PEs on one GPU, neither beside its chunks.)
WORKER_DEVICE = 0

logger = logging.getLogger("dask_pgas.integration")

PLUGIN_NAME = "dask-pgas"

#: True in the processes of a worker job whose every rank is a worker (LocalMPICluster's, set by _worker_main);
#: otherwise the job is taken for dask-mpi's, whose ranks 0 and 1 are the scheduler and the client
every_rank_a_worker = False


@dataclass(frozen=True)
class RunSpec:
    """What every PE needs to know about one rechunk run (small; carried by every transfer task)."""

    input_boxes: tuple
    output_boxes: tuple
    dtype: Any  # a numpy dtype (structured ones included: a dtype string would lose their fields)
    package: str
    delay: float = 0.0  # testing only: sleep this long inside the collective (to kill a worker there)

    @property
    def plan_key(self) -> tuple:
        return (self.input_boxes, self.output_boxes, self.dtype)


#: the pgas.* keys a run reads on the worker (collective-timeout: by its output tasks)
_RUN_KEYS = ("plan-cache-size", "buffer-growth", "output-pool", "collective-timeout")


class _RunError(CollectiveError):
    """A run failed on every rank together before any data moved (the world stays usable).

    Where every failing PE raised one public class (an :class:`UnsupportedOperandError` for a chunk of the wrong
    dtype, say), the error is of :func:`agreed_error_class`'s subclass of both, so the client catches it by that
    class as well as by :class:`CollectiveError`, whichever PE's task reports it."""

    fatal = False


_AGREED_CLASSES: dict[str, type[_RunError]] = {}
_AGREED_LOCK = threading.Lock()
#: builtins an agreed error never derives from: ones this module's waits catch themselves, or Python's signals
_NOT_AGREED = frozenset({"TimeoutError", "StopIteration", "StopAsyncIteration"})


def public_error_name(exc: BaseException) -> str | None:
    """The name of the first class of ``exc``'s MRO that a run's error may also derive from (see
    :func:`agreed_error_class`): one of :mod:`dask_pgas.errors`, or a builtin exception (CuPy's
    ``OutOfMemoryError`` gives ``MemoryError``); None when there is none."""
    import builtins

    from .. import errors

    for cls in type(exc).__mro__:
        name = cls.__name__
        public = ((name in errors.__all__ and getattr(errors, name) is cls)
                  or (cls.__module__ == "builtins" and getattr(builtins, name, None) is cls))
        if public and agreed_error_class(name) is not _RunError:
            return name
    return None


def _agreed_failure(control: Any, errors: list[tuple[int, str]], local_class: str | None) -> _RunError:
    """Collective (every PE is at the same failed agreement): one more exchange, of the failing PEs' classes
    (:func:`public_error_name`), so that every PE raises the same error, of their class when they agree."""
    gathered = control.allgather(local_class)
    classes = {gathered[r] for r, _ in errors}
    return agreed_error_class(classes.pop() if len(classes) == 1 else None)(
        "; ".join(f"PE {r}: {e}" for r, e in errors))


def agreed_error_class(name: str | None) -> type[_RunError]:
    """The class of a run failure whose failing PEs all raised the exception class called ``name``: a subclass
    of that class (one of :mod:`dask_pgas.errors` or a builtin exception) and of :class:`_RunError`, named
    ``Run`` + ``name`` in this module; :class:`_RunError` itself for None, another name, a
    :class:`CollectiveError` (a world's failure is not a run's), a base of :class:`_RunError`, one of
    ``_NOT_AGREED``, or a class that cannot be made from one message (``UnicodeDecodeError`` takes five
    arguments) or pickled. The same on every process: it depends on the name only."""
    import builtins
    import pickle

    from .. import errors

    if not name or name in _NOT_AGREED:
        return _RunError
    cls = _AGREED_CLASSES.get(name)
    if cls is not None:
        return cls
    base = getattr(errors, name) if name in errors.__all__ else getattr(builtins, name, None)
    if not (isinstance(base, type) and issubclass(base, Exception)) \
            or issubclass(base, CollectiveError) or issubclass(_RunError, base):  # (their own meaning, or bases)
        return _RunError
    with _AGREED_LOCK:  # (one class per name in a process: the collective thread and unpickling may race)
        if name in _AGREED_CLASSES:
            return _AGREED_CLASSES[name]
        try:  # (found by name through this module's ``__getattr__``, so instances and the class pickle by
            # reference; entered before the probe, which looks it up so)
            cls = _AGREED_CLASSES[name] = type(f"Run{name}", (base, _RunError), {
                "__module__": __name__, "__doc__": _RunError.__doc__,
                "__str__": _RunError.__str__})  # (the base's own, as OSError's, would come first in the MRO)
            probe = cls("PE 0: probe")
            if type(pickle.loads(pickle.dumps(probe))) is not cls or str(probe) != "PE 0: probe":
                raise TypeError("does not survive pickling")
        except Exception:  # instance layouts that conflict, a constructor of several arguments, ...
            cls = _AGREED_CLASSES[name] = _RunError
    return cls


def __getattr__(attr: str) -> Any:
    """``Run<name>``: the agreed error classes, made on first use, so that they and their instances pickle by
    reference in any process."""
    if attr.startswith("Run") and (cls := agreed_error_class(attr[3:])) is not _RunError:
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


class _CollectiveThread:
    """One daemon thread executing submitted callables in order (a stuck MPI call must not block exit)."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.busy_since: float | None = None
        #: the call running when the world failed has not returned (it may wait for a dead peer for ever)
        self.stuck = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, *args, future: concurrent.futures.Future | None = None) -> concurrent.futures.Future:
        fut = future or concurrent.futures.Future()
        self._queue.put((fut, fn, args))
        return fut

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            self.busy_since = time.monotonic()
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:
                fut.set_exception(exc)
            finally:
                with self._lock:
                    self.busy_since = None
                    self.stuck = False

    def mark_stuck(self) -> None:
        """The world failed: a call running now may never return; ``stuck`` until it does."""
        with self._lock:
            if self.busy_since is not None:
                self.stuck = True

    def stop(self) -> None:
        self._queue.put(None)


class _Lease:
    """Exposes a pooled block's bytes (``np.asarray(lease)`` keeps the lease as ``base`` of every view)."""

    __slots__ = ("__array_interface__", "__weakref__")

    def __init__(self, raw) -> None:
        self.__array_interface__ = {
            "shape": (raw.nbytes,),
            "typestr": "|u1",
            "data": (raw.ctypes.data, False),
            "strides": None,
            "version": 3,
        }


class _OutputPool:
    """Recycles the host memory of output boxes once Dask has dropped every chunk cut from them.

    A fresh ``np.empty`` per run costs a page fault per page inside the collective (about half the time of
    the transfer itself on a 2-core box); a block goes back to the pool when the last view of it dies. Idle
    blocks are capped by config ``pgas.output-pool`` (0 disables the pool) and by a tenth of the worker's
    memory limit (Dask cannot spill them), and the plugin empties the pool when the worker's memory runs high
    and at teardown. Blocks leased before a :meth:`clear` do not come back to the pool when their chunks die.
    """

    #: share of the worker's memory limit that idle blocks may take at most
    SHARE = 0.1

    def __init__(self, memory_limit: int | None = None) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list] = {}
        self.idle = 0
        self._generation = 0  # bumped by clear(): blocks leased before it are not taken back
        self.memory_limit = memory_limit

    def limit(self) -> int:
        limit = setting("output-pool")
        if self.memory_limit:
            limit = min(limit, int(self.memory_limit * self.SHARE))
        return limit

    def empty(self, shape, dtype):
        import math

        import numpy as np

        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        limit = self.limit()
        if nbytes < 2**20 or nbytes > limit or dtype.hasobject:
            return np.empty(shape, dtype)
        with self._lock:
            blocks = self._free.get(nbytes)
            raw = blocks.pop() if blocks else None
            if raw is not None:
                self.idle -= nbytes
            generation = self._generation
        if raw is None:
            raw = np.empty(nbytes, np.uint8)
        # the lease is bytes, viewed as the dtype: an array interface's ``descr`` cannot carry a struct's
        # padding or field offsets (an aligned struct, or Dask's own x[["a", "c"]], would come back another dtype)
        lease = _Lease(raw)
        out = np.asarray(lease).view(dtype).reshape(shape)
        import weakref

        weakref.finalize(lease, self._release, raw, limit, generation)
        return out

    def _release(self, raw, limit: int, generation: int) -> None:
        with self._lock:
            if generation == self._generation and self.idle + raw.nbytes <= limit:
                self._free.setdefault(raw.nbytes, []).append(raw)
                self.idle += raw.nbytes

    def clear(self) -> int:
        """Drop the idle blocks; returns their bytes."""
        with self._lock:
            freed, self.idle = self.idle, 0
            self._free.clear()
            self._generation += 1
        return freed


def _mpi_identity() -> tuple[int | None, int | None]:
    """(rank, size) in MPI_COMM_WORLD when this process is an MPI process, else (None, None)."""
    mod = sys.modules.get("mpi4py.MPI")
    if mod is None:
        return None, None
    try:
        if not mod.Is_initialized() or mod.Is_finalized():
            return None, None
        return mod.COMM_WORLD.Get_rank(), mod.COMM_WORLD.Get_size()
    except Exception:  # pragma: no cover - broken MPI
        return None, None


#: variables an MPI launcher gives its ranks (MPICH/Hydra, PMIx, Open MPI); a Nanny's worker process inherits them
_LAUNCHER_VARS = ("PMI_RANK", "PMI_FD", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")


def _nanny_child_of_mpi_job(worker) -> bool:
    """Whether this worker is the child process of a Nanny inside an MPI job (dask-mpi's default): it inherits
    the job's launcher variables but is not one of its ranks, and MPI_Init there aborts the process."""
    return getattr(worker, "nanny", None) is not None and any(v in os.environ for v in _LAUNCHER_VARS)


def _process_of(worker) -> int:
    """This worker's process (workers of a ``LocalCluster(processes=False)`` share one)."""
    return os.getpid()


def _host_of(worker) -> str:
    """This worker's host name (workers of one host share NVSHMEM's host-wide state)."""
    return socket.gethostname()


class PGASWorkerPlugin(WorkerPlugin):
    """Owns the PGAS runtime of one worker. Registered by :func:`dask_pgas.bootstrap`."""

    name = PLUGIN_NAME
    idempotent = True

    @property
    def poisoned(self) -> bool:
        """A collective that was running when the world failed never returned: this process cannot join a new
        world (nor finalize MPI). It stops being so if that collective does return."""
        return self._thread.stuck

    def setup(self, worker) -> None:
        from ._orphan_guard import unlink_mpi_names

        # a worker that is an MPI rank (dask-mpi's, too): an interrupted or killed job leaves no file in /dev/shm
        unlink_mpi_names()
        self.worker = worker
        self._thread = _CollectiveThread(f"pgas-collective-{worker.name}")
        self.pe: int | None = None
        self.epoch: int | None = None
        self.npes = 0
        self.broken: str | None = None
        # _staged, _done and _dropped are shared by the event loop, task threads and the collective thread
        self._lock = threading.Lock()
        self._staged: dict[str, tuple] = {}
        self._pending: dict[int, tuple[str, concurrent.futures.Future]] = {}
        # run seq -> resolved with this PE's output box when its run ends here (dropped when Dask forgets it)
        self._done: dict[int, concurrent.futures.Future] = {}
        # runs Dask released (a cancel) before they ended here: they still run, in order, but keep no result
        # and take no input staged since (that belongs to the next attempt of the same rechunk)
        self._dropped: set[int] = set()
        # rechunk name -> its latest run here (a rechunk Dask computes again gets a new run before the old one's
        # barrier is forgotten)
        self._run_of: dict[str, int] = {}
        self._next_seq = 0
        self._current: tuple[int, float] | None = None  # (seq, monotonic start) of the run on the thread
        self._buffers: dict[str, Any] = {}
        self._scratch_buf = None
        self._plans: OrderedDict = OrderedDict()
        memory = getattr(worker, "memory_manager", None)
        self._pool = _OutputPool(getattr(memory, "memory_limit", None))
        loop = getattr(worker, "periodic_callbacks", None)
        if loop is not None:  # (not on the stand-in workers of unit tests)
            from tornado.ioloop import PeriodicCallback

            if (old := loop.pop("pgas-trim", None)) is not None:
                old.stop()
            loop["pgas-trim"] = PeriodicCallback(self._trim, 200)
            loop["pgas-trim"].start()
        self.runs = 0
        self.collective_seconds = 0.0
        worker.handlers.update(
            {
                "pgas_info": self._h_info,
                "pgas_init": self._h_init,
                "pgas_check_bring_up": self._h_check_bring_up,
                "pgas_start": self._h_start,
                "pgas_teardown": self._h_teardown,
                "pgas_uniqueid": self._h_uniqueid,
            }
        )
        worker.stream_handlers.update({"pgas-forget": self._h_forget, "pgas-fail": self._h_fail})

    def teardown(self, worker) -> None:
        # Not collective (workers close one at a time): memory goes with the process, on purpose (no leak
        # warning for the staging buffers at exit). dask_pgas.teardown(client) frees everything collectively
        # beforehand.
        from ..memory import left_to_process

        trim = getattr(worker, "periodic_callbacks", {}).pop("pgas-trim", None)
        try:
            if trim is not None:
                trim.stop()
            left_to_process(*self._buffers.values())
        finally:
            self._thread.stop()

    def transition(self, key, start: str, finish: str, **kwargs) -> None:
        """A transfer task cancelled while it executed (its rechunk was released) may have staged after the
        rechunk's ``pgas-forget`` reached this worker: drop that input once the task is released here."""
        if start != "cancelled" or not (type(key) is tuple and isinstance(key[0], str)
                                        and key[0].startswith("pgas-transfer-")):
            return
        ts = self.worker.state.tasks.get(key)
        if ts is not None and ts.state not in ("released", "forgotten"):  # still executing, or resumed
            return
        with self._lock:
            self._staged.pop("pgas-rechunk-" + key[0][len("pgas-transfer-"):], None)

    # ---------------------------------------------------------------- state seen by tasks
    def check(self, pe: int, epoch: int, npes: int) -> None:
        if self.broken:
            raise PGASWorldError(self.broken)
        if self.epoch is None:
            raise PGASWorldError(
                f"worker {self.worker.address} is not part of a PGAS world; call dask_pgas.bootstrap(client)"
            )
        if epoch != self.epoch:
            raise PGASWorldError(
                f"this rechunk was planned for PGAS world #{epoch} but the cluster now runs world #{self.epoch} "
                "(dask_pgas.bootstrap ran again): build the rechunk again"
            )
        if npes != self.npes:  # (the same epoch number on another cluster)
            raise PGASWorldError(
                f"this rechunk was planned for a PGAS world of {npes} PEs but this cluster's world has "
                f"{self.npes}: it was built with another cluster's client; build it again with this one's"
            )
        if pe != self.pe:
            raise PGASWorldError(
                f"a task pinned to PE {pe} ran on {self.worker.address} (PE {self.pe}); the scheduler plugin "
                "is missing: call dask_pgas.bootstrap(client) before computing"
            )

    def stage(self, name: str, pe: int, epoch: int, npes: int, spec: RunSpec, pieces: tuple, arrays: tuple) -> None:
        self.check(pe, epoch, npes)
        with self._lock:
            self._staged[name] = (spec, pieces, arrays)

    def take(self, name: str, pe: int, epoch: int, npes: int, box_slices: tuple, whole: bool, run: int) -> Any:
        """This PE's slice of run ``run``'s output box; waits for the run to end here.

        Output tasks depend on the barrier task, which returns once the scheduler has started the run, so
        Dask dispatches them while the collective runs; they wait only for that running collective, never for
        other tasks, and a failed or broken run wakes them with its error.
        """
        self.check(pe, epoch, npes)
        with self._lock:
            done = self._done.get(run)
            if done is None and run >= self._next_seq and run not in self._dropped:  # not started here yet
                done = self._done[run] = concurrent.futures.Future()
        if done is None:  # it ran here and was forgotten since
            raise PGASWorldError(
                f"the output of {name} is not on {self.worker.address}; it was released or the world was "
                "re-bootstrapped: compute the rechunk again"
            )
        timeout = setting("collective-timeout") + 30  # (checked by the run too, before its collective)
        result = self._wait(done, run, name, timeout)
        # a view: the box is this run's own array (results never alias the symmetric buffers), so a copy per
        # chunk would only double the memory traffic; the box's memory goes back to the pool with its last chunk
        return result if whole else result[box_slices]

    def _wait(self, done: concurrent.futures.Future, run: int, name: str, timeout: float) -> Any:
        """The result of run ``run`` here. The scheduler's watchdog fails a run that hangs (and wakes this
        wait); as a backstop the wait gives up ``timeout`` seconds after the run began on this PE, not
        counting the time it spent queued behind earlier runs."""
        deadline = None
        while True:
            now = time.monotonic()
            if deadline is None:
                current = self._current
                if current is not None and current[0] >= run:
                    deadline = (current[1] if current[0] == run else now) + timeout
                elif self._next_seq > run and current is None:  # ended between the two reads
                    deadline = now + timeout
            try:
                return done.result(timeout=min(1.0, timeout) if deadline is None else max(deadline - now, 0.0))
            except concurrent.futures.TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise PGASWorldError(
                        f"{name} did not finish on {self.worker.address} within {timeout:.0f}s"
                    ) from None

    # ---------------------------------------------------------------- handlers (event loop)
    def heap_bytes(self) -> int:
        # (a copy first: the collective thread may grow the buffers meanwhile)
        return sum(int(b.nbytes) for b in list(self._buffers.values()))

    async def _h_info(self) -> dict:
        from .. import runtime

        rank, size = _mpi_identity()
        nanny_in_mpi_job = _nanny_child_of_mpi_job(self.worker)
        try:
            if nanny_in_mpi_job:  # not the mpi backend's probe: importing mpi4py.MPI would start MPI and abort
                available = [b for b in ("nvshmem",) if runtime._unavailable(b) is None]
            else:
                available = runtime.available_backends()
        except Exception as exc:  # pragma: no cover
            available = []
            logger.warning("dask_pgas: could not list backends: %s", exc)
        try:
            from ..memory import heap_usage

            heap = heap_usage()
        except Exception:  # pragma: no cover
            heap = {}
        return {
            "address": self.worker.address,
            "name": str(self.worker.name),
            "host": _host_of(self.worker),
            "process": _process_of(self.worker),
            "mpi_rank": rank,
            "mpi_size": size,
            "non_worker_ranks": [] if every_rank_a_worker else [0, 1],
            "nanny_in_mpi_job": nanny_in_mpi_job,
            "available": available,
            "initialized": runtime.is_initialized(),
            "backends": list(runtime.initialized_backends()),
            "pe": self.pe,
            "epoch": self.epoch,
            "poisoned": self.poisoned,
            "broken": self.broken,
            "buffer_bytes": self.heap_bytes(),
            "heap": heap,
            "plans": len(self._plans),
            "output_pool_idle": self._pool.idle,
            "scratch_bytes": 0 if self._scratch_buf is None else int(self._scratch_buf.nbytes),
            **_gpu_identity(),
            "runs": self.runs,
            "last_timings": getattr(self, "last_timings", None),
            "collective_seconds": self.collective_seconds,
            "busy_for": None if self._thread.busy_since is None else time.monotonic() - self._thread.busy_since,
        }

    async def _h_init(self, epoch: int, ranks: list | None, backends: list | None, uid: bytes | None = None,
                      pe: int | None = None, npes: int | None = None, single_node: bool | None = None,
                      first_on_host: bool | None = None) -> dict:
        reply = await self._on_thread(self._init, epoch, ranks, backends, uid, pe, npes, single_node, first_on_host)
        return reply if reply["status"] != "OK" else {**reply, "pe": self.pe, "npes": self.npes, **_gpu_identity()}

    async def _h_start(self, name: str, seq: int, epoch: int) -> dict:
        if epoch != self.epoch:
            return {"status": "error", "fatal": True,
                    "message": f"{self.worker.address} is in world #{self.epoch}, not #{epoch}"}
        if self.broken:  # a start that the world's failure overtook (it travels on another connection)
            return {"status": "error", "fatal": True, "message": f"PE {self.pe} ({self.worker.address}): {self.broken}"}
        with self._lock:
            # A rechunk whose keys Dask released while its barrier task was running, then computed again (a cancel
            # and a resubmission of the same keys), gets a new run before the scheduler forgets the old one, and
            # the forget then names only the new run: the old run's output box would stay here for good. No
            # output task can take it any more (the barrier answers with the newest run), so it goes now. (One
            # that has not ended here is left to the forget on its way: that wakes its waiters with an error.)
            previous = self._run_of.get(name)
            if previous is not None and previous != seq and (left := self._done.get(previous)) is not None \
                    and left.done():
                del self._done[previous]
            if seq not in self._dropped:  # (a forget that overtook this start has nothing left to remove)
                self._run_of[name] = seq
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._pending[seq] = (name, fut)
        while self._next_seq in self._pending:  # submit in the global order, whatever the arrival order
            nm, f = self._pending.pop(self._next_seq)
            with self._lock:  # before _next_seq moves on: take() tells "not yet" from "forgotten"
                if self._next_seq not in self._dropped:
                    self._done.setdefault(self._next_seq, concurrent.futures.Future())
            self._thread.submit(self._run_and_signal, nm, self._next_seq, future=f)
            self._next_seq += 1
        try:
            info = await asyncio.wrap_future(fut)
        except Exception as exc:
            return {"status": "error", "fatal": getattr(exc, "fatal", True),
                    "message": f"PE {self.pe} ({self.worker.address}): {type(exc).__name__}: {exc}"}
        return {"status": "OK", **info}

    async def _on_thread(self, fn: Any, *args: Any) -> dict:
        """Run ``fn(*args)`` on the collective thread: an OK reply, or its error as the reply's message."""
        try:
            await asyncio.wrap_future(self._thread.submit(fn, *args))
        except Exception as exc:
            return {"status": "error", "message": f"{type(exc).__name__}: {exc}"}
        return {"status": "OK"}

    async def _h_teardown(self, force: bool = False) -> dict:
        reply = await self._on_thread(self._teardown, force)
        return reply if reply["status"] != "OK" else {**reply, **(await self._h_info())}

    async def _h_check_bring_up(self, pe: int, npes: int, single_node: bool | None = None) -> dict:
        """The local steps of a unique-id bring-up, before any worker enters NVSHMEM's init (which has no
        agreement of its own: a worker that failed alone would leave the others waiting inside it)."""
        return await self._on_thread(self._check_bring_up, pe, npes, single_node)

    async def _h_uniqueid(self, single_node: bool | None = None) -> bytes:
        import dask_pgas

        return await asyncio.wrap_future(self._thread.submit(
            lambda: dask_pgas.get_nvshmem_uniqueid(WORKER_DEVICE, single_node=single_node)))

    def _h_forget(self, name: str, run: int | None = None, epoch: int | None = None) -> None:
        """Dask is done with rechunk ``name`` (its barrier task was released or forgotten, or erred: ``run``
        None, staged input only): drop what it staged here and the result of its run ``run``. A run that has not
        ended here yet (the rechunk was cancelled while its collective ran) is marked dropped: it still runs in
        its turn, as every PE must, but keeps nothing, and output tasks still waiting for it wake with an
        error."""
        with self._lock:  # (one lock with _signal: a run ends here either before this or after it)
            self._staged.pop(name, None)
            if run is not None and self._run_of.get(name) == run:
                del self._run_of[name]
            if run is not None and epoch == self.epoch:  # run numbers restart with every world
                released = self._done.pop(run, None)  # the output box goes with its last chunk
                if run >= self._next_seq or (released is not None and not released.done()):
                    self._dropped.add(run)
                    if released is not None:
                        released.set_exception(PGASWorldError(f"{name} was released before its collective ended"))

    def _h_fail(self, message: str, epoch: int) -> None:
        if epoch == self.epoch:
            self.broken = message
            # Stuck, maybe, in a collective with a dead peer. (Runs queued behind it, and starts waiting in
            # _pending, give up before their agreement: they are failed here, or _run finds the world broken.)
            self._thread.mark_stuck()
            with self._lock:
                self._staged.clear()
            error = PGASWorldError(message)
            for _, fut in self._pending.values():  # runs waiting for an earlier one that will never come
                if not fut.done():
                    fut.set_exception(error)
            self._pending.clear()
            self._fail_waiting(error)

    def _fail_waiting(self, exc: BaseException) -> None:
        with self._lock:
            waiting, self._done = list(self._done.values()), {}
            self._dropped.clear()
            self._run_of.clear()
        for fut in waiting:
            if not fut.done():
                fut.set_exception(exc)

    # ---------------------------------------------------------------- collective thread
    def _usable(self) -> None:
        if self.poisoned:
            raise PGASWorldError(
                f"worker {self.worker.address} has a collective that never returned (a peer died, or the "
                "watchdog gave up on it); its MPI "
                "state cannot be reused: restart the workers (close the cluster and start a new one)"
            )

    def _check_bring_up(self, pe: int, npes: int, single_node: bool | None) -> None:
        import dask_pgas

        from .. import runtime

        self._usable()
        if runtime.is_initialized():  # (the scheduler tore the last world down first: this one is not its member)
            raise RuntimeStateError(f"worker {self.worker.address} still has a PGAS runtime up (world #{self.epoch}, "
                                    "or one started outside bootstrap) that bootstrap cannot tear down alone: "
                                    "restart the worker")
        dask_pgas.check_uniqueid_bring_up(pe, npes, WORKER_DEVICE, single_node=single_node)

    def _init(self, epoch, ranks, backends, uid, pe, npes, single_node=None, first_on_host=None) -> None:
        import dask_pgas

        from .. import runtime

        self._usable()
        if runtime.is_initialized():
            self._teardown()
        if uid is None:
            from mpi4py import MPI

            world = MPI.COMM_WORLD
            group = world.Get_group()
            sub = group.Incl(list(ranks))
            comm = world.Create_group(sub, tag=epoch % 32768)  # collective over the members only
            group.Free()
            sub.Free()
            try:
                # (a device only for NVSHMEM: get_context() reports the one given, and CPU workers have none)
                dask_pgas.initialize(WORKER_DEVICE if "nvshmem" in backends else None, communicator=comm,
                                     backends=backends)
                self.pe, self.npes = comm.Get_rank(), comm.Get_size()
            finally:
                comm.Free()
        else:
            dask_pgas.initialize_from_uniqueid(uid, pe, npes, WORKER_DEVICE, single_node=single_node,
                                               first_on_host=first_on_host)
            self.pe, self.npes = pe, npes
        self.epoch = epoch
        self.broken = None
        self._next_seq = 0
        self.runs, self.collective_seconds = 0, 0.0  # (world(detail=True) reports this world's)
        self._pending.clear()
        self._fail_waiting(PGASWorldError(f"the PGAS world was bootstrapped again (world #{epoch})"))

    def _teardown(self, force: bool = False) -> None:
        """Free this PE's plans and buffers and finalize, collectively. A broken world only with ``force``: the
        scheduler found every member present and none inside a collective."""
        from .. import runtime
        from ..memory import free_symmetric_memory

        if not runtime.is_initialized():
            return
        if self.poisoned or (self.broken and not force):
            raise PGASWorldError(
                f"{self.worker.address} holds PGAS world #{self.epoch}, which is broken ({self.broken}) and cannot be "
                "torn down collectively (a member left, or one is stuck inside a collective): restart the workers "
                "(close the cluster and start a new one)"
            )
        error = None
        try:
            for plan in self._plans.values():
                plan.free()
            for kind in sorted(self._buffers):
                free_symmetric_memory(self._buffers.pop(kind))
        except DeviceError as exc:  # (agreed: on every PE) nothing more is freed on the device; finalize all the same
            error = exc
        self._plans.clear()
        self._buffers.clear()
        with self._lock:
            self._staged.clear()
            self._done.clear()
            self._dropped.clear()
            self._run_of.clear()
        self._pool.clear()
        self._scratch_buf = None
        try:
            runtime.finalize()
        except DeviceError as exc:
            error = error or exc
        self.epoch = None
        self.pe = None
        if error is not None:
            raise error

    def _buffers_of(self, needs: dict[str, int], package: str, growth: float) -> list[Any]:
        """Symmetric byte buffers of at least ``needs[kind]`` bytes each; one that grows takes at least ``growth``
        times its current size (collective then: the same decision everywhere). Every buffer that must grow is
        freed before any is allocated, so the heap never holds an old buffer beside a new one (fewer holes in
        NVSHMEM's heap, whose cap counts its extent)."""
        from ..memory import allocate_symmetric_memory, free_symmetric_memory

        sizes = {}
        for kind, nbytes in needs.items():
            current = self._buffers.get(kind)
            if current is None or current.nbytes < nbytes:
                sizes[kind] = max(nbytes, int((current.nbytes if current is not None else 0) * growth), 1)
        for kind in sizes:
            if (current := self._buffers.pop(kind, None)) is not None:
                free_symmetric_memory(current)
        for kind, size in sizes.items():
            need = max(needs[kind], 1)
            try:
                self._buffers[kind] = allocate_symmetric_memory((size,), package, dtype="uint8")
            except MemoryError:
                # the heap's cap or the GPUs' free memory refused the grown size, on every PE alike (both are
                # agreed decisions): the exact need may still fit, and every PE asks for it
                if size <= need:
                    raise
                self._buffers[kind] = allocate_symmetric_memory((need,), package, dtype="uint8")
        return [self._buffers[kind] for kind in needs]

    def _trim(self) -> int:
        """When the worker is paused, or its process memory is past Dask's spill threshold, give back the memory
        Dask cannot spill: the output pool's idle blocks and the packing scratch. (Otherwise a worker paused by
        idle pooled blocks would never run the output tasks pinned to it.) Returns the bytes dropped."""
        from distributed.core import Status

        if not self._pool.idle and self._scratch_buf is None:  # nothing to give back: no memory sample
            return 0
        worker = self.worker
        memory = getattr(worker, "memory_manager", None)
        limit = getattr(memory, "memory_limit", None)
        high = worker.status == Status.paused  # (Dask's own check against the pause threshold)
        spill = getattr(memory, "memory_spill_fraction", None)
        if not high and limit and spill:
            high = worker.monitor.get_process_memory() > spill * limit
        if not high:
            return 0
        dropped = self._pool.clear()
        scratch, self._scratch_buf = self._scratch_buf, None  # (a run using it keeps its own reference)
        dropped += scratch.nbytes if scratch is not None else 0
        if dropped:
            logger.info("dask_pgas: worker memory is high; released %d idle bytes of rechunk buffers", dropped)
        return dropped

    def _scratch(self, nbytes: int):
        """Local (not symmetric) packing memory for engines whose operands need not be on the heap."""
        import numpy as np

        buf = self._scratch_buf  # (read once: _trim may drop it from the event loop meanwhile)
        if buf is None or buf.nbytes < nbytes:
            self._scratch_buf = None
            self._scratch_buf = buf = np.empty(nbytes, np.uint8)
        return buf

    def _plan(self, engine, spec: RunSpec) -> tuple[tuple, Any, bool]:
        """``(key, plan, new)``: the engine's plan for ``spec``, from the cache or new. A new plan enters the cache
        only in :meth:`_keep`, once the run's agreement has passed."""
        from ..engines.base import ReshapeSpec

        key = (engine.name, *spec.plan_key)
        plan = self._plans.get(key)
        if plan is not None:
            return key, plan, False
        plan = engine.plan_reshape(
            ReshapeSpec(spec.input_boxes, spec.output_boxes, spec.dtype, "C", self.pe)
        )
        return key, plan, True

    def _keep(self, key: tuple, plan: Any, cache_size: int) -> None:
        """After the run's agreement: ``plan`` is the most recently used, and the least recently used beyond
        ``cache_size`` are freed. Only runs that passed their agreement touch the cache, so every PE holds the same
        plans in the same order and evicts the same ones at the same run (an NVSHMEM plan's free is collective;
        an MPI plan is built locally and may fail on one PE only)."""
        self._plans[key] = plan
        self._plans.move_to_end(key)
        while len(self._plans) > cache_size:
            _, old = self._plans.popitem(last=False)
            old.free()

    def _run_and_signal(self, name: str, seq: int) -> dict:
        self._current = (seq, time.monotonic())
        try:
            info, result = self._run(name, seq)
        except BaseException as exc:
            self._signal(seq, exc=exc)
            raise
        finally:
            self._current = None
        self._signal(seq, result=result)
        return info

    def _signal(self, seq: int, result: Any = None, exc: BaseException | None = None) -> None:
        """Wake the output tasks waiting for run ``seq``; a dropped run's result is not kept."""
        with self._lock:
            self._dropped.discard(seq)
            done = self._done.get(seq)
            if done is not None and not done.done():
                if exc is not None:
                    done.set_exception(exc)
                else:
                    done.set_result(result)

    def _run(self, name: str, seq: int) -> tuple[dict, Any]:
        from .. import runtime

        with self._lock:
            dropped = seq in self._dropped
            staged = None if dropped else self._staged.pop(name, None)
        if self.broken:  # a peer is gone (or the world failed): no agreement could complete
            raise PGASWorldError(self.broken)
        engines = [runtime.get_engine(b) for b in runtime.initialized_backends()]
        control = engines[0].control
        local_error, local_class, cfg = None, None, {}
        if dropped:
            local_error = f"{name} was released (cancelled) before its collective ran on PE {self.pe}"
        elif staged is None:
            local_error = f"no input staged for {name} on PE {self.pe}"
        else:
            try:  # this worker's config for the run, read once and checked before the first agreement (a PE
                # whose value is bad must not raise after it)
                cfg = {key: setting(key) for key in _RUN_KEYS}
            except ValueError as exc:
                local_error, local_class = f"{exc} (on {self.worker.address})", public_error_name(exc)
        # Symmetric buffers grow collectively from the spec, so with such an engine in the world every rank
        # first agrees that it holds the spec; otherwise one agreement after the local preparation suffices.
        # (The same choice everywhere: it depends on the world, not on this run.)
        buffers = None
        if any(e.requires_symmetric_operands for e in engines):
            if errors := control.agree(local_error):
                raise _agreed_failure(control, errors, local_class)
            try:  # plans are freed collectively there, and buffers grow collectively: the PEs' values must agree
                # (the output pool and the output tasks' backstop are local: those may differ)
                control.agree(None, same=("pgas config", (cfg["plan-cache-size"], cfg["buffer-growth"])))
            except CollectiveMismatchError as exc:
                raise _RunError(f"the workers' pgas.* config differs ({exc}); give every worker the same "
                                "values") from exc
            try:
                buffers = self._grow_buffers(staged[0], cfg["buffer-growth"])
            except DeviceError:  # (agreed: every PE) the world cannot be used any more: fatal, not a capacity issue
                raise
            except (MemoryError, SymmetricMemoryError, CollectiveError) as exc:
                # Sized from the agreed spec, on heaps of one size with one allocation history (every
                # allocation is collective, and the engine agrees on the GPUs' free memory before it grows the
                # heap): every PE fails here alike, before any data moved.
                raise _RunError(
                    f"the symmetric staging buffers cannot grow for this rechunk ({exc}); rechunk less at once, or "
                    "give the workers more room: a larger heap (NVSHMEM_MAX_MEMORY_PER_GPU / NVSHMEM_SYMMETRIC_SIZE "
                    "before they start) or more free GPU memory"
                ) from exc
        t0 = time.perf_counter()
        key = plan = src = dst = None
        new = False
        if local_error is None:
            # Local work: a failure here (a chunk of the wrong dtype, no memory) is agreed on below, so no PE
            # enters the collective while another has given up.
            try:
                key, plan, new = self._plan(runtime.engine_for_package(staged[0].package), staged[0])
                src, dst = self._prepare(*staged, buffers)
            except DeviceError:  # (the engine refuses on every PE alike) fatal
                raise
            except Exception as exc:
                local_error, local_class = f"{type(exc).__name__}: {exc}", public_error_name(exc)
        if errors := control.agree(local_error):
            failure = _agreed_failure(control, errors, local_class)
            if new:  # never cached. Every PE has built it (an NVSHMEM plan is built collectively, or fails on
                plan.free()  # every PE), so a collective free is met everywhere; an MPI plan's free is local
            raise failure
        self._keep(key, plan, cfg["plan-cache-size"])
        # -- the one collective
        t1 = time.perf_counter()
        plan.execute(src, dst)
        self.last_timings = {"prepare": t1 - t0, "execute": time.perf_counter() - t1, "ended_at": time.time()}
        # -- results live in ordinary (non-symmetric) arrays, so the buffers are free for the next run. The
        # collective has ended on every PE: a failure of this local copy (no GPU memory left for the result)
        # fails this PE's part of the rechunk, not the world.
        try:
            result = dst
            if buffers:
                result = dst.copy()
                # the copy (and the exchange before it) are stream-ordered; the output tasks read the result from
                # other threads, whose streams (CuPy's per-thread default stream, a non-blocking one) need not
                # follow this one: the result is complete before the run is reported done
                plan.synchronize()
        except Exception as exc:
            raise _RunError(
                f"the result could not be copied out of the symmetric buffer ({type(exc).__name__}: {exc}); free "
                "device memory or rechunk less at once"
            ) from exc
        self.runs += 1
        dt = time.perf_counter() - t0
        self.collective_seconds += dt
        return {"pe": self.pe, "seconds": dt}, result

    def _grow_buffers(self, spec: RunSpec, growth: float) -> tuple[Any, Any] | None:
        """The symmetric staging buffers for ``spec`` (grown collectively by at least ``growth``, same sizes
        everywhere), or None when its engine takes operands off the heap."""
        import numpy as np

        from .. import runtime

        engine = runtime.engine_for_package(spec.package)
        if not engine.requires_symmetric_operands:
            return None
        item = np.dtype(spec.dtype).itemsize
        needs = {"in": max(b.size for b in spec.input_boxes) * item,
                 "out": max(b.size for b in spec.output_boxes) * item}
        return tuple(self._buffers_of(needs, engine.packages[0], growth))

    def _prepare(self, spec: RunSpec, pieces: tuple, arrays: tuple, buffers: tuple | None) -> tuple[Any, Any]:
        """Local: this PE's input box packed from its chunk pieces and its output box: in the symmetric
        ``buffers`` when given (NVSHMEM), else in local scratch memory and a pooled NumPy array (MPI; no copy
        when one C-contiguous chunk is the box); both checked against the plan's boxes and dtype, so that the
        engine's own check cannot fail after the run's agreement."""
        import numpy as np

        if spec.delay:
            time.sleep(spec.delay)
        dtype = np.dtype(spec.dtype)
        refuse_unmovable(arrays, dtype, spec.package)
        in_box = spec.input_boxes[self.pe]
        out_box = spec.output_boxes[self.pe]
        src = None
        if buffers is None and len(pieces) == 1:
            chunk_slices, box_slices = pieces[0]
            view = arrays[0][chunk_slices]
            if (type(view) is np.ndarray and view.shape == in_box.box_shape and view.dtype == dtype
                    and view.flags.c_contiguous):
                src = view
        if src is None:  # operands off the heap (MPI) pack into local scratch memory: no collective
            buf = buffers[0] if buffers else self._scratch(in_box.size * dtype.itemsize)
            src = buf[: in_box.size * dtype.itemsize].view(dtype).reshape(in_box.box_shape)
            for (chunk_slices, box_slices), arr in zip(pieces, arrays):
                copy_piece(src, box_slices, arr, chunk_slices)
        if buffers:
            dst = buffers[1][: out_box.size * dtype.itemsize].view(dtype).reshape(out_box.box_shape)
        else:  # (an engine that takes operands off the heap: the MPI one, NumPy chunks)
            dst = self._pool.empty(out_box.box_shape, dtype)
        for what, array, box in (("input", src, in_box), ("output", dst, out_box)):
            if tuple(array.shape) != box.box_shape or array.dtype != dtype:
                raise ValueError(f"PE {self.pe}'s {what} box came out as {tuple(array.shape)} {array.dtype}; the "
                                 f"plan needs {box.box_shape} {dtype}")
        return src, dst


def refuse_unmovable(arrays: tuple, dtype: Any, package: str) -> None:
    """Raise for chunks a pgas rechunk would change while moving them (or cannot move), before any data moves.

    - Chunks that are not arrays of the array's ``package`` (its ``_meta``'s: NumPy or CuPy).
    - Masked arrays under a plain ``_meta`` (Dask's default for ``from_delayed``; ``map_blocks(..., meta=...)``): the
      collective and the local copies move data, not masks. (A masked ``_meta`` makes ``rechunk`` follow
      ``pgas.fallback`` before any task runs.)
    - Chunks of another dtype than the array's (a ``map_blocks`` or ``from_delayed`` that declared a wrong one):
      packing them into the array's dtype casts them. A cast that keeps every value (byte order, a wider type) is
      done; one that can lose or change data (2.75 into an integer, ``'hello'`` into ``'U2'``, 2**53 + 1 into
      float64, a date into a finer unit that cannot hold it, bytes or numbers into ``str``) raises instead of
      changing values silently, where Dask's own rechunk would move the chunks unchanged.
    """
    import numpy as np

    from .._arrays import package_of

    for a in arrays:
        if package_of(a) != package:
            raise UnsupportedOperandError(
                f"a chunk is a {type(a).__module__}.{type(a).__qualname__}, but the Dask array's meta says "
                f"{package} arrays: a pgas rechunk moves arrays of the meta's package. Make "
                "the chunks match the meta (map_blocks(np.asarray) or map_blocks(cupy.asarray), or declare "
                "meta=... in from_delayed/map_blocks), or rechunk with method='tasks'"
            )
        if isinstance(a, np.ma.MaskedArray):
            raise UnsupportedOperandError(
                "a chunk is a numpy masked array, but the Dask array's meta is a plain ndarray: a pgas rechunk "
                "moves data, not masks. Give the array a masked meta (e.g. map_blocks(..., "
                "meta=np.ma.masked_array([]))), which makes rechunk follow pgas.fallback, or rechunk with "
                "method='tasks'"
            )
        if a.dtype != dtype and not keeps_every_value(a.dtype, dtype):
            raise UnsupportedOperandError(
                f"a chunk has dtype {a.dtype}, but the Dask array declares {dtype}: a pgas rechunk moves the "
                f"array's dtype, and casting {a.dtype} to {dtype} can lose or change values. Declare the chunks' "
                "real dtype (map_blocks(..., dtype=...)), cast them first (x.astype(...)), or rechunk with "
                "method='tasks'"
            )


def _short_chunk(shape: tuple, need: tuple) -> UnsupportedOperandError:
    return UnsupportedOperandError(
        f"a chunk has shape {tuple(shape)}, but the Dask array's chunks need at least {need} there: a pgas "
        "rechunk would fill the rest with made-up values. Make the blocks match the chunks the array declares "
        "(map_blocks(..., chunks=...)), or rechunk with method='tasks'"
    )


def piece_of(chunk: Any, chunk_slices: tuple, dtype: Any, package: str) -> Any:
    """``chunk[chunk_slices]`` (the part of an input chunk cut between PEs), refusing first what the PE that
    stages it would refuse (:func:`refuse_unmovable`), and a chunk too small for the slices: the piece would come
    out short, and its PE could only name the piece's shape."""
    refuse_unmovable((chunk,), dtype, package)
    need = tuple(s.stop for s in chunk_slices)
    if any(have < stop for have, stop in zip(chunk.shape, need)) or len(chunk.shape) != len(need):
        raise _short_chunk(chunk.shape, need)
    return chunk[chunk_slices]


def copy_piece(dst: Any, dst_slices: tuple, chunk: Any, chunk_slices: tuple) -> None:
    """``dst[dst_slices] = chunk[chunk_slices]``, refusing a chunk smaller than its array's chunks declare (a
    ``map_blocks`` whose blocks differ from the chunks it declared), which the assignment would broadcast into
    made-up values."""
    part, region = chunk[chunk_slices], dst[dst_slices]
    if part.shape != region.shape:
        raise _short_chunk(chunk.shape, tuple(s.stop for s in chunk_slices))
    region[...] = part


def keeps_every_value(src: Any, dst: Any) -> bool:
    """Whether casting ``src`` to ``dst`` (NumPy dtypes) keeps every value: NumPy's "safe" casting, less the
    casts it counts as safe that are not: an integer into a float (or complex) whose mantissa is narrower than
    it (int64 into float64 rounds above 2**53), and a datetime or timedelta into another unit (a finer one
    overflows), and any cast into or out of text, bytes or raw data of another kind (an ``S`` chunk under a
    ``U`` dtype is decoded, a number under one is formatted: Dask's own rechunk moves such chunks unchanged).
    Structured dtypes field by field, subarrays by their base."""
    import numpy as np

    src, dst = np.dtype(src), np.dtype(dst)
    if np.can_cast(src, dst, casting="equiv"):  # the same, or another byte order
        return True
    if src.subdtype is not None or dst.subdtype is not None:
        if src.subdtype is None or dst.subdtype is None or src.subdtype[1] != dst.subdtype[1]:
            return False
        return keeps_every_value(src.subdtype[0], dst.subdtype[0])
    if src.names is not None or dst.names is not None:
        return (src.names == dst.names
                and all(keeps_every_value(src.fields[n][0], dst.fields[n][0]) for n in src.names))
    if not np.can_cast(src, dst, casting="safe"):
        return False
    if (src.kind in "SUV" or dst.kind in "SUV") and src.kind != dst.kind:
        return False
    if src.kind in "mM" or dst.kind in "mM":
        return False  # (other units: "equiv" above took the same unit)
    if src.kind in "iu" and dst.kind in "fc":
        digits = np.finfo(dst).nmant + 1  # (a complex dtype's finfo is its components')
        return src.itemsize * 8 - (src.kind == "i") <= digits
    return True


def _gpu_identity() -> dict:
    """This PE's GPU (``gpu``: its PCI bus id, the same in every process that shares it) and how many GPUs its
    worker sees (``visible_gpus``), for the scheduler's check that workers were given a GPU each and for
    ``world(detail=True)``; empty without the nvshmem backend (or when the driver cannot say)."""
    from .. import runtime

    if "nvshmem" not in runtime.initialized_backends():
        return {}
    from ..bindings.cuda import driver

    try:
        drv = driver()
        return {"gpu": drv.pci_bus_id(), "visible_gpus": drv.device_count()}
    except Exception as exc:  # advisory only: the world is up either way
        logger.warning("dask_pgas: could not identify this PE's GPU: %s", exc)
        return {}


def get_plugin(worker=None) -> PGASWorkerPlugin:
    """The PGAS plugin of this worker, or an error that says how to get one."""
    from distributed import get_worker

    if worker is None:
        try:
            worker = get_worker()
        except ValueError:  # not on a distributed worker
            raise PGASWorldError(
                "a pgas rechunk runs on the workers of the Dask cluster it was built for; it was computed with "
                "another scheduler (compute it with that cluster's client)"
            ) from None
    plugin = worker.plugins.get(PLUGIN_NAME)
    if plugin is None:
        raise PGASWorldError(
            f"worker {worker.address} has no dask_pgas plugin: call dask_pgas.bootstrap(client) first"
        )
    return plugin
