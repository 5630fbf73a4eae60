"""The scheduler side: the PGAS world (PE <-> worker), task pinning, the global order of collectives, failures.

* ``pgas_bootstrap`` fixes the world (workers ordered by MPI rank; by name when they are not one MPI job), and
  brings the runtime up on every member (a workers-only communicator, or an NVSHMEM unique id made on PE 0 and
  handed to all);
* ``update_graph`` pins transfer and output tasks of pgas rechunks to their PE's worker
  (``worker_restrictions``, ``loose_restrictions=False``) before the scheduler transitions them;
* the ``transition`` hook starts a run the moment the last transfer task of a rechunk is in memory: it numbers
  the run and tells every member to run it; members run collectives strictly in that order on their collective
  thread. ``pgas_barrier`` (called by the barrier task) returns the run's number at once (starting the
  run if needed; a run that already failed fatally returns its error). A watchdog fails the run when it does
  not end within ``pgas.collective-timeout``;
* ``remove_worker`` fails in-flight runs at once, marks the world broken, errs the barriers and the tasks pinned
  to the lost worker that wait for it (no-worker), and unpins the rest (they fail where they run);
  ``valid_workers_downscaling`` and a guarded ``retire_workers`` keep members from being retired.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
import weakref
from typing import Any

from dask.utils import parse_timedelta
from distributed.comm import CommClosedError
from distributed.core import Status
from distributed.diagnostics.plugin import SchedulerPlugin

from ..errors import PGASWorldError
from ._config import duration, problem, setting

logger = logging.getLogger("dask_pgas.integration")

PLUGIN_NAME = "dask-pgas"

_SCHEDULERS: weakref.WeakSet = weakref.WeakSet()  # the schedulers of this process with the plugin


def schedulers_here() -> list:
    """The schedulers running in this process with the dask_pgas plugin (one in a scheduler process; a
    LocalCluster's, in its client's process)."""
    return list(_SCHEDULERS)


class _Run:
    def __init__(self, name: str, seq: int, timeout: float) -> None:
        self.name = name
        self.seq = seq
        self.timeout = timeout  # its watchdog's (config pgas.collective-timeout, read once when it is numbered)
        loop = asyncio.get_running_loop()
        self.failed: asyncio.Future = loop.create_future()
        self.ended: asyncio.Future = loop.create_future()  # its collective has ended on every member (or failed)
        self.after: asyncio.Future | None = None  # the previous run's ``ended``: members run this one after it
        self.task: asyncio.Future | None = None
        self.error: str | None = None  # why it could not start
        self.error_class: str | None = None  # the builtin class of that reason, if it has one (a bad config value)

    def fail(self, message: str) -> None:
        if not self.failed.done():
            self.failed.set_result(message)


def shared_gpu_warning(members: dict[str, tuple[str | None, str | None, int | None]]) -> str | None:
    """A warning when the PEs of a host share fewer GPUs than its workers see, else None. ``members`` maps each
    worker to (host name, its PE's GPU, how many GPUs it sees); workers without a GPU are left out. Workers not
    given a GPU each (no per-worker ``CUDA_VISIBLE_DEVICES``) all take their device 0, the same GPU; sharing on
    purpose (several workers, one GPU visible to each) is not warned about."""
    hosts: dict[str | None, list[tuple[str, int]]] = {}
    for host, gpu, visible in members.values():
        if gpu is not None:
            hosts.setdefault(host, []).append((gpu, visible or 0))
    lines = []
    for host, pes in hosts.items():
        gpus = {gpu for gpu, _ in pes}
        seen = max(visible for _, visible in pes)
        if len(pes) > len(gpus) and seen > len(gpus):
            lines.append(f"{len(pes)} PEs on {host} share {len(gpus)} GPU(s) while its workers see {seen}")
    if not lines:
        return None
    return ("; ".join(lines) + ": give each worker a GPU of its own with CUDA_VISIBLE_DEVICES (dask-cuda and "
            "LocalMPICluster(gpus=N) do it; docs/dask.md, 'Which GPU a PE uses')")


def _failed(replies: dict[str, Any]) -> dict[str, Any]:
    """The workers whose reply (a handler's dict, or the exception its call raised) is not OK."""
    return {w: r for w, r in replies.items() if not isinstance(r, dict) or r.get("status") != "OK"}


def _why(reply: Any) -> str:
    """What a failed reply says (see :func:`_failed`)."""
    if isinstance(reply, CommClosedError):  # (the worker's process died, or its connection broke)
        return f"{type(reply).__name__}: {reply}: did its process die? Its output says why"
    if isinstance(reply, BaseException):
        return f"{type(reply).__name__}: {reply}"
    if isinstance(reply, dict) and "message" in reply:
        return reply["message"]
    # (distributed answers None to an operation the worker has no handler for)
    return (f"it answered {reply!r}: does it run another version of dask_pgas? The scheduler and every worker "
            "need the same")


#: how a broken world is left, whatever broke it (a lost member can also be found first by a run's closed connection)
_REBUILD = ("dask_pgas.bootstrap(client) builds a new world; workers that cannot leave this one (a member left, or "
            "one is stuck inside a collective: MPI collectives cannot be cancelled) refuse it, saying so, and must be "
            "restarted first (client.restart(), or close the cluster and start a new one; a LocalMPICluster whose "
            "worker died restarts its workers by itself)")


def _missing_ranks(infos: dict) -> set[int]:
    """Ranks of the workers' one MPI job without a worker here, beyond the ranks the job keeps for others (0 and
    1, dask-mpi's scheduler and client; none in LocalMPICluster's job); empty when the workers are not the ranks
    of one MPI job."""
    sizes = {i["mpi_size"] for i in infos.values()}
    ranks = [i["mpi_rank"] for i in infos.values()]
    if len(sizes) != 1 or None in sizes or None in ranks:
        return set()
    others = {r for i in infos.values() for r in i.get("non_worker_ranks", (0, 1))}
    return set(range(sizes.pop())) - set(ranks) - others


class PGASSchedulerPlugin(SchedulerPlugin):
    """Registered by :func:`dask_pgas.bootstrap`; one per scheduler (idempotent)."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        self.world: tuple[str, ...] = ()
        self.epoch = 0
        self.backends: tuple[str, ...] = ()
        self.broken: str | None = None
        self._seq = 0
        self._runs: dict[str, _Run] = {}  # run name -> its run in flight
        # runs still in flight whose rechunk Dask released (a cancel): a new attempt gets a run of its own
        self._detached: set[_Run] = set()
        self._pinned: dict[Any, str] = {}  # key -> worker address
        self._barriers: set = set()  # barrier keys of graphs on this scheduler
        self._ready: dict[str, set] = {}  # run name -> PEs whose transfer task is in memory
        self._finished: dict[str, dict] = {}  # run name -> result of its last run (for its barrier tasks)
        self._last_seq: dict[str, int] = {}  # run name -> number of its last run (its workers' state)
        self._tail: asyncio.Future | None = None  # ``ended`` of the last numbered run
        self._lock: asyncio.Lock | None = None
        # fence tokens a client sent through its stream (after its graphs) -> set once the scheduler handled it
        self._fences: dict[str, asyncio.Event] = {}

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        _SCHEDULERS.add(scheduler)
        self._lock = asyncio.Lock()
        scheduler.handlers.update(
            {
                "pgas_bootstrap": self.bootstrap,
                "pgas_world": self.describe_world,
                "pgas_barrier": self.barrier,
                "pgas_teardown": self.teardown,
            }
        )
        scheduler.stream_handlers["pgas-fence"] = self._fence
        # Explicit client.retire_workers(workers=[...]) skips valid_workers_downscaling: guard it too.
        original = scheduler.handlers.get("retire_workers")
        if original is not None and not getattr(original, "__pgas_guard__", False):

            async def retire_workers(workers=None, *, names=None, **kwargs):
                if self.world and not self.broken:
                    members = set(self.world)
                    by_name = {str(ws.name): a for a, ws in scheduler.workers.items()}
                    asked = list(workers or []) + [by_name.get(str(n), "") for n in (names or [])]
                    refused = sorted(a for a in asked if a in members)
                    if refused:
                        logger.warning("dask_pgas: not retiring PGAS world members %s (call "
                                       "dask_pgas.teardown(client) first)", refused)
                        if workers is not None:
                            workers = [w for w in workers if w not in members]
                        if names is not None:
                            names = [n for n in names if by_name.get(str(n)) not in members]
                        if not workers and not names:
                            return {}
                return await original(workers=workers, names=names, **kwargs)

            retire_workers.__pgas_guard__ = True
            scheduler.handlers["retire_workers"] = retire_workers

    # ---------------------------------------------------------------- world
    def _describe(self) -> dict:
        return {
            "epoch": self.epoch,
            "workers": list(self.world),
            "backends": list(self.backends),
            "broken": self.broken,
            "active_runs": self._active(),
            "fence": True,  # (teardown's fence is handled: a scheduler without the handler drops the client)
        }

    async def describe_world(self, detail: bool = False, keys: list | None = None) -> dict:
        out = self._describe()
        if keys is not None:  # where these keys are in memory, as PEs (one round trip for rechunk planning)
            pe_of = {w: pe for pe, w in enumerate(self.world)}
            out["locations"] = []
            for key in keys:
                ts = self.scheduler.tasks.get(key if not isinstance(key, list) else tuple(key))
                pes = [pe_of[ws.address] for ws in (ts.who_has or ()) if ws.address in pe_of] if ts else []
                if pes:
                    out["locations"].append((key, min(pes)))
        if detail and self.world:
            alive = [w for w in self.world if w in self.scheduler.workers]
            infos = await self._call(alive, "pgas_info", timeout=10)
            out["info"] = infos
        return out

    def _in_flight(self) -> list[_Run]:
        return [*self._runs.values(), *self._detached]

    def _active(self) -> list[str]:
        """Names of the rechunks with a run in flight (detached ones included: their workers are still in it)."""
        return sorted({r.name for r in self._in_flight()})

    def _unfinished(self) -> list[str]:
        """Rechunks with a pinned task (transfer, output, local-plan chunk) or a barrier still to run: they need
        the world (an output task takes its run's result from its worker's plugin), so a teardown would fail
        them. Results already in memory are ordinary arrays and do not count."""
        names = set()
        for key in [*self._pinned, *self._barriers]:
            ts = self.scheduler.tasks.get(key)
            if ts is not None and ts.state in ("waiting", "queued", "no-worker", "processing"):
                names.add(key[0] if isinstance(key, tuple) else key)
        return sorted(names)

    async def _call(self, workers, op: str, timeout: float | None = None, each: dict | None = None,
                    **kwargs) -> dict[str, Any]:
        """Each worker's reply to ``op`` (called with ``kwargs`` and its own ``each[worker]``), or the exception it
        raised; a worker that has not answered within ``timeout`` gets a ``TimeoutError`` (the others' replies
        are kept, and the call itself never raises for it: a bare timeout reached the client as "the scheduler
        does not answer")."""
        each = each or {}
        tasks = {w: asyncio.ensure_future(self.scheduler.rpc(w).__getattr__(op)(**{**kwargs, **each.get(w, {})}))
                 for w in workers}
        pending = set()
        if tasks:
            _, pending = await asyncio.wait(tasks.values(), timeout=timeout)
            for task in pending:
                task.cancel()
        limit = f"{timeout:.1f}".rstrip("0").rstrip(".") if pending else ""
        return {
            w: TimeoutError(f"{w} did not answer {op} within {limit}s") if task in pending
            else task.exception() or task.result()
            for w, task in tasks.items()
        }

    #: seconds bootstrap waits for ranks of the workers' MPI job that have not registered yet
    RANKS_GRACE = 10.0
    #: seconds teardown waits for the members to free their buffers and finalize
    TEARDOWN_TIMEOUT = 120.0

    async def bootstrap(self, backends: list | None = None, timeout: Any = None) -> dict:
        timeout = setting("bootstrap-timeout") if timeout is None else duration(timeout, "the bootstrap timeout")
        if (bad := problem("collective-timeout")) is not None:  # read by every run's watchdog
            return {"status": "error", "message": f"{bad} (on the scheduler)"}
        async with self._lock:
            if self.world and not self.broken and all(w in self.scheduler.workers for w in self.world):
                return {"status": "OK", **self._describe()}
            if runs := self._active():
                return {"status": "error", "message": f"rechunks still running: {runs}"}
            workers = list(self.scheduler.workers)
            if not workers:
                return {"status": "error", "message": "the cluster has no workers yet; wait_for_workers first"}
            loop = asyncio.get_running_loop()
            grace = loop.time() + min(timeout, self.RANKS_GRACE)
            while True:
                infos = await self._call(workers, "pgas_info", timeout=timeout)
                bad = {w: i for w, i in infos.items() if isinstance(i, BaseException)}
                if any(isinstance(i, TimeoutError) for i in bad.values()):
                    return {"status": "error", "message": f"the workers did not describe themselves within the "
                            f"bootstrap timeout ({timeout}s)"}
                if bad:
                    w, exc = next(iter(bad.items()))
                    return {"status": "error",
                            "message": f"worker {w} did not answer ({exc!r}); is the plugin set up?"}
                missing = _missing_ranks(infos)
                if not missing or loop.time() >= grace:
                    break
                # ranks of the workers' MPI job still registering (a restarted worker job): a world of the
                # ones here would hold part of the job, for good
                await asyncio.sleep(0.2)
                workers = list(self.scheduler.workers)
            poisoned = [w for w, i in infos.items() if i["poisoned"]]
            if poisoned:
                return {
                    "status": "error",
                    "message": f"workers {poisoned} hold a collective that never returned (a peer died, or the "
                    "watchdog gave up on it after pgas.collective-timeout): their MPI state cannot be reused. "
                    "Restart the cluster (close it and start a new one).",
                }
            ranks = {w: i["mpi_rank"] for w, i in infos.items()}
            everywhere = set.intersection(*(set(i["available"]) for i in infos.values()))  # (backends all can run)
            if backends is None:
                try:
                    backends = setting("backends")
                except ValueError as exc:
                    return {"status": "error", "message": f"{exc} (on the scheduler)"}
            if backends is None:
                backends = ["nvshmem"] if "nvshmem" in everywhere else ["mpi"]
            backends = [backends] if isinstance(backends, str) else list(backends)
            processes: dict = {}
            for w, i in infos.items():
                processes.setdefault((i["host"], i["process"]), []).append(w)
            if shared := [ws for ws in processes.values() if len(ws) > 1]:
                # one PGAS runtime per process: bringing up one PE per thread waits for ever (NVSHMEM)
                return {
                    "status": "error",
                    "message": f"workers {sorted(shared[0])} are threads of one process (a LocalCluster with "
                    "processes=False?): a PGAS world needs one process per worker",
                }
            nannies = sorted(w for w, i in infos.items() if i["nanny_in_mpi_job"])
            if nannies and "mpi" in backends:
                return {
                    "status": "error",
                    "message": f"workers {nannies} run under a Nanny inside an MPI job (dask-mpi's default): the "
                    "Nanny's worker process is not an MPI rank, and starting MPI there would abort it. Start the "
                    "workers with dask-mpi --worker-class distributed.Worker, or dask_mpi.initialize() (its default "
                    "worker_class, not distributed.Nanny)",
                }
            # ranks of two MPI jobs can be distinct too, and a group over them would wait for ever: one job has one size
            sizes = sorted({i["mpi_size"] for i in infos.values()} - {None})
            mpi_world = (len(sizes) == 1 and all(r is not None for r in ranks.values())
                         and len(set(ranks.values())) == len(ranks))
            if mpi_world:
                order = sorted(workers, key=lambda w: ranks[w])
            elif backends == ["nvshmem"]:
                order = sorted(workers, key=lambda w: (infos[w]["name"], w))
            else:
                return {
                    "status": "error",
                    "message": "the workers are not processes of one MPI job"
                    + (f" (their MPI jobs have sizes {sizes})" if len(sizes) > 1 else "")
                    + (f", and such workers run backends=['nvshmem'] only (not {backends})" if "nvshmem" in everywhere
                       else " and the 'nvshmem' backend is not available on all of them")
                    + ": start the workers with dask_pgas.LocalMPICluster, dask-mpi (--worker-class "
                    "distributed.Worker) or one mpiexec, or use GPU workers with NVSHMEM",
                }
            # A previous world is torn down collectively first (and ends before: no run may start on it): an intact
            # one, or a broken one whose members are all still here, none inside a collective (none is poisoned,
            # checked above). A broken world that lost a member cannot be: its members refuse init, saying so.
            if self.world and (not self.broken or self._recoverable(infos)):
                old, forced, self.world = list(self.world), bool(self.broken), ()
                res = await self._call(old, "pgas_teardown", timeout=timeout, force=forced)
                errors = _failed(res)
                if forced and errors:
                    w, r = next(iter(errors.items()))
                    return {"status": "error", "message": f"the broken world #{self.epoch} could not be torn down "
                            f"on {w} ({_why(r)}); restart the cluster"}
            elif not mpi_world and (held := [w for w in order if infos[w]["initialized"] and infos[w]["broken"]]):
                # such a worker refuses init (its broken world cannot be torn down); the workers' bring-up check
                # would refuse it too, but this says why, names every such worker and starts no new world
                return {"status": "error", "message": f"workers {held} still hold PGAS world #{self.epoch}, which "
                        f"cannot be torn down collectively ({self.broken or 'it is not recoverable'}); restart them "
                        "(client.restart(), or restart the cluster), then bootstrap again"}
            self.epoch += 1
            self._seq = 0
            self._tail = None
            self._ready.clear()
            self._last_seq.clear()
            epoch = self.epoch
            step = "pgas_init"  # (the step a timeout names)
            if mpi_world:
                res = await self._call(
                    order, step, timeout=timeout,
                    epoch=epoch, ranks=[ranks[w] for w in order], backends=backends,
                )
            else:
                # one host: NVSHMEM's one-node defaults (no remote transport, bootstrap over loopback), as the
                # MPI path sets them from the ranks' host names
                hosts = [infos[w].get("host") for w in order]
                single = len(set(hosts)) == 1
                pes = {w: {"pe": pe} for pe, w in enumerate(order)}
                # the lowest PE of each host holds the host lock through the init (bindings.nvshmem.host_lock)
                leads = {w: {"pe": pe, "first_on_host": hosts.index(hosts[pe]) == pe} for pe, w in enumerate(order)}
                deadline = time.monotonic() + timeout  # (the three steps together, as the one init above)

                def left() -> float:
                    return max(deadline - time.monotonic(), 0.0)

                # NVSHMEM's unique-id init has no agreement before it: every worker does its local steps
                # first, and none enters the init unless all of them passed
                step = "pgas_check_bring_up"
                res = await self._call(order, step, timeout=left(), each=pes, npes=len(order), single_node=single)
                if not _failed(res):
                    # (a failure here, of PE 0 alone, is reported as a failed init: no PE was started)
                    step = "pgas_uniqueid"
                    res = await self._call(order[:1], step, timeout=left(), single_node=single)
                    if isinstance(uid := res[order[0]], bytes):  # (else an error, or another version's answer)
                        step = "pgas_init"
                        res = await self._call(order, step, timeout=left(), each=leads, epoch=epoch, ranks=None,
                                               backends=backends, uid=uid, npes=len(order), single_node=single)
            if late := [w for w, r in res.items() if isinstance(r, TimeoutError)]:
                self.world, self.broken = tuple(order), (f"bootstrap of world #{epoch} timed out after {timeout:g}s: "
                                                         f"{', '.join(late)} did not answer {step}")
                return {"status": "error", "message": self.broken}
            if errors := _failed(res):
                w, r = next(iter(errors.items()))
                self.world, self.broken = tuple(order), f"bootstrap failed on {w}: {_why(r)}"
                return {"status": "error", "message": self.broken}
            for pe, w in enumerate(order):
                if res[w]["pe"] != pe:  # (the members did initialize: a broken world, ended as the others are)
                    self.world, self.broken = tuple(order), f"worker {w} became PE {res[w]['pe']}, expected {pe}"
                    return {"status": "error", "message": self.broken}
            self.world = tuple(order)
            self.backends = tuple(backends)
            self.broken = None
            logger.info("dask_pgas: PGAS world #%d with %d PEs: %s", epoch, len(order), order)
            warning = shared_gpu_warning(
                {w: (infos[w].get("host"), res[w].get("gpu"), res[w].get("visible_gpus")) for w in order}
            )
            if missing:
                note = (f"ranks {sorted(missing)} of the workers' MPI job have no worker on this scheduler (waited "
                        f"{min(timeout, self.RANKS_GRACE):g}s): the world has the {len(order)} that registered")
                warning = f"{warning}; {note}" if warning else note
            if warning:
                logger.warning("dask_pgas: %s", warning)
            return {"status": "OK", **self._describe(), **({"warning": warning} if warning else {})}

    def _recoverable(self, infos: dict) -> bool:
        """Whether the broken world can still be torn down collectively: every member is here (``infos``, the
        members' ``pgas_info``), holds this world (a bootstrap that failed part way leaves some members without
        it: they would return from the teardown at once while the others wait in its collective frees) and none
        is, or was when the world broke, inside a collective."""
        return all(
            isinstance(i := infos.get(w), dict) and i["initialized"] and i["epoch"] == self.epoch
            and not i["poisoned"] and i["busy_for"] is None
            for w in self.world
        )

    #: seconds a teardown waits for its client's fence (every graph that client sent before it, handled)
    FENCE_TIMEOUT = 60.0

    def _fence(self, token: str, client: str | None = None) -> None:
        """(a client's stream) Every message that client sent before this one has been handled: the stream's
        handlers run one after the other, ``update-graph`` included, so its graphs are on the scheduler now."""
        self._fences.setdefault(token, asyncio.Event()).set()
        while len(self._fences) > 64:  # (fences whose teardown never came, or came and gave up: the oldest go)
            del self._fences[next(iter(self._fences))]

    async def teardown(self, fence: str | None = None) -> dict:
        """``fence``: a token the client sent through its stream right before this call (which travels on another
        connection and could overtake the graphs it sent first: a rechunk it had just submitted would be missed
        by the checks below, and fail once the world is gone)."""
        if fence is not None:
            event = self._fences.setdefault(fence, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), self.FENCE_TIMEOUT)
            except asyncio.TimeoutError:
                return {"status": "error", "message": f"the client's earlier messages did not reach the scheduler "
                        f"within {self.FENCE_TIMEOUT:g} s; nothing was torn down"}
            finally:
                self._fences.pop(fence, None)
        async with self._lock:
            if runs := self._active():
                return {"status": "error", "message": f"rechunks still running: {runs}"}
            if self.world and not self.broken and (pending := self._unfinished()):
                return {"status": "error", "message": f"rechunks still running: tasks of {pending[:5]}"
                        + (f" and {len(pending) - 5} more" if len(pending) > 5 else "")
                        + " have yet to run on the world; wait for their results (or release them) first"}
            if not self.world:
                return {"status": "OK", "workers": {}}
            members = [w for w in self.world if w in self.scheduler.workers]
            broken = self.broken
            if broken:
                infos = await self._call(members, "pgas_info", timeout=parse_timedelta("30s"))
                if not self._recoverable(infos):
                    self.world, self.backends = (), ()
                    return {"status": "error", "message": f"the world is broken ({broken}) and a member left or "
                            "is stuck inside a collective, so it cannot be torn down collectively; it is dropped."
                            + ("" if _REBUILD in broken else f" {_REBUILD}")}  # (a break's message says it)
            # the world ends now, before the members finalize: a rechunk whose last transfer task lands
            # meanwhile gets a clear error instead of a run on PEs that are tearing down
            self.world = ()
            self.backends = ()
            res = await self._call(members, "pgas_teardown", timeout=self.TEARDOWN_TIMEOUT, force=bool(broken))
            if late := [w for w, r in res.items() if isinstance(r, TimeoutError)]:
                return {"status": "error", "message": f"the members {late} did not finish tearing the world down "
                        f"within {self.TEARDOWN_TIMEOUT:g} s; the world is dropped. dask_pgas.bootstrap(client) "
                        "builds a new one (members still inside the old one refuse it: then restart the cluster)"}
            if errors := _failed(res):
                return {"status": "error", "message": "; ".join(f"{w}: {_why(r)}" for w, r in errors.items())}
            self.broken = None  # (the broken world is gone: there is no world now)
            return {"status": "OK", "workers": res}

    # ---------------------------------------------------------------- runs
    async def barrier(self, name: str, epoch: int) -> dict:
        """Called by the barrier task: the number of the run of ``name`` (started now unless the transition
        hook already started it when the last transfer task finished), at once; output tasks then wait on
        their own worker for the run to end there."""
        run = self._runs.get(name)
        if run is None:
            if name in self._finished:  # the run has ended already
                result = self._finished[name]
                if result.get("fatal") is False:  # failed on every PE alike before any data moved: its output
                    return {"status": "OK", "run": result["run"]}  # tasks raise the PEs' own (agreed) error
                return result
            ts = self.scheduler.tasks.get("pgas-barrier-" + name[len("pgas-rechunk-"):])
            if ts is None or ts.state != "processing":  # a late call from a barrier task Dask has released
                return {"status": "error", "message": f"{name} was released before its collective started"}
            run = self._start(name, epoch)
        if run.error is not None:
            return {"status": "error", "message": run.error, "class": run.error_class}
        return {"status": "OK", "run": run.seq}

    def _start(self, name: str, epoch: int) -> _Run:
        """Number the run of ``name`` and tell every member to run it (all transfer tasks are done)."""
        self._ready.pop(name, None)
        seq = self._seq
        try:  # the watchdog's, read once: a bad value refuses the run before it is numbered
            timeout, bad = setting("collective-timeout"), None
        except ValueError as exc:
            timeout, bad = 0.0, f"{exc} (on the scheduler)"
        run = _Run(name, seq, timeout)
        if self.broken:
            error = self.broken
        elif epoch != self.epoch or not self.world:
            error = (f"{name} was built for PGAS world #{epoch}; the cluster runs "
                     f"#{self.epoch if self.world else 'none'}: build the rechunk again")
        elif missing := [w for w in self.world if w not in self.scheduler.workers]:
            error = f"PGAS world members {missing} are gone"
        elif bad is not None:
            error, run.error_class = bad, "ValueError"
        else:
            error = None
            self._seq += 1
        run.error = error
        if error is None:
            self._last_seq[name] = seq
            run.after, self._tail = self._tail, run.ended
        self._runs[name] = run
        run.task = asyncio.ensure_future(self._drive(run, epoch))
        return run

    async def _drive(self, run: _Run, epoch: int) -> dict:
        name = run.name
        try:
            if run.error is not None:
                return {"status": "error", "message": run.error, "class": run.error_class}
            try:
                result = await self._collective(run, epoch)
            except Exception as exc:  # the run is numbered and output tasks wait for it: never leave it open
                self._break(f"pgas rechunk {name}: the scheduler could not drive the collective: {exc!r}")
                result = {"status": "error", "message": self.broken}
        finally:
            if not run.ended.done():
                run.ended.set_result(None)
            current = self._runs.get(name) is run
            if current:
                del self._runs[name]
            self._detached.discard(run)
        if current:  # (a released run's result is not wanted)
            self._finished[name] = result
            while len(self._finished) > 1000:  # small dicts; the oldest go first
                self._finished.pop(next(iter(self._finished)))
        return result

    async def _collective(self, run: _Run, epoch: int) -> dict:
        name, seq = run.name, run.seq
        if run.failed.done():  # the world broke (_break fails every run in flight) since numbering: send nothing
            return {"status": "error", "message": self.broken}
        timeout = run.timeout
        tasks = {
            asyncio.ensure_future(self.scheduler.rpc(w).pgas_start(name=name, seq=seq, epoch=epoch)): w
            for w in self.world
        }
        remaining_tasks = set(tasks)
        loop = asyncio.get_running_loop()
        # Members run collectives one after another: the clock of this run starts when the previous one has
        # ended (a run queued behind others is not late), and the previous run has a watchdog of its own.
        after = run.after
        deadline = None
        message = None
        fatal = True
        infos = []
        try:
            while remaining_tasks:
                if deadline is None and (after is None or after.done()):
                    deadline = loop.time() + timeout
                left = None if deadline is None else deadline - loop.time()
                if left is not None and left <= 0:
                    late = sorted(tasks[t] for t in remaining_tasks)
                    message = (f"{name}: the collective did not finish within pgas.collective-timeout="
                               f"{timeout}s on {late}")
                    break
                waiting = remaining_tasks | {run.failed} | ({after} if deadline is None else set())
                done, _ = await asyncio.wait(waiting, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if run.failed.done():
                    message = f"{name}: {run.failed.result()}"
                    break
                for t in done & remaining_tasks:
                    remaining_tasks.discard(t)
                    try:
                        r = t.result()
                    except OSError as exc:  # CommClosedError: the worker died (its removal may come later)
                        message = (f"{name}: {self._left(tasks[t])}: its connection closed during the "
                                   f"collective ({exc!r})")
                        break
                    except Exception as exc:
                        message = f"{name}: worker {tasks[t]} failed during the collective: {exc!r}"
                        break
                    if r["status"] != "OK":
                        message, fatal = r["message"], r.get("fatal", True)
                        break
                    infos.append(r)
                if message:
                    break
        finally:
            for t in remaining_tasks:
                t.cancel()
        if message is None:
            return {"status": "OK", "run": seq, "seconds": max(i["seconds"] for i in infos)}
        if fatal:
            self._break(f"pgas rechunk {message}")
            return {"status": "error", "message": self.broken}
        return {"status": "error", "message": message, "fatal": False, "run": seq}

    def _left(self, worker: str) -> str:
        """The one error for a lost member, whichever way the scheduler learns of it (its removal, or its
        start request's closed connection)."""
        return f"worker {worker} (PE {self.world.index(worker)}) left the PGAS world"

    def _break(self, message: str) -> None:
        if self.broken:
            return
        self.broken = (f"{message}. The PGAS world #{self.epoch} is broken; the input arrays stay computable with "
                       f"method='tasks'/'p2p'. {_REBUILD}")
        logger.error("dask_pgas: %s", self.broken)
        for run in self._in_flight():
            run.fail(message)
        self._tell_members({"op": "pgas-fail", "message": self.broken, "epoch": self.epoch})

    def _tell_members(self, msg: dict) -> None:
        """Send ``msg`` on the batched stream of every member that is still here (no reply)."""
        if msgs := {w: [msg] for w in self.world if w in self.scheduler.workers}:
            self.scheduler.send_all({}, msgs)

    # ---------------------------------------------------------------- scheduler hooks
    def update_graph(self, scheduler, *, tasks=(), **kwargs) -> None:
        from ._graph import BarrierTask, PieceTask, PinnedTask, rekeyed, unwrapped

        for key in tasks:
            ts = scheduler.tasks.get(key)
            if ts is not None and (inner := unwrapped(ts.run_spec)) is not None:
                # dask.delayed(f)(y) renamed y's tasks and wrapped each in a plain task: unwrapped, the pinning
                # below sees them, and the run takes the renamed keys' name on the workers too
                ts.run_spec = rekeyed(inner, key)
            if ts is not None and isinstance(ts.run_spec, BarrierTask):
                self._barriers.add(key)
                if self.world and not self.broken:
                    # on a member: a barrier recomputed after its worker left would start the run again
                    # (with its inputs consumed); a member's loss breaks the world anyway
                    ts.worker_restrictions = set(self.world)
                    ts.loose_restrictions = False
                continue
            if ts is not None and isinstance(ts.run_spec, PieceTask):
                # slice where the chunk is (unrestricted, a task with one small dependency group may be
                # queued and placed anywhere, shipping the whole chunk first); loose: any worker if it moved
                holders = {ws.address for dep in ts.dependencies for ws in (dep.who_has or ())}
                if holders:
                    ts.worker_restrictions = holders
                    ts.loose_restrictions = True
                continue
            if ts is None or not isinstance(ts.run_spec, PinnedTask):
                continue
            spec = ts.run_spec
            if self.broken or spec.epoch != self.epoch or spec.npes != len(self.world):
                continue  # the task itself raises a clear error wherever it runs
            addr = self.world[spec.pe]
            ts.worker_restrictions = {addr}
            ts.loose_restrictions = False
            self._pinned[key] = addr

    def transition(self, key, start, finish, *args, **kwargs) -> None:
        transfer = (type(key) is tuple and len(key) == 2 and isinstance(key[0], str)
                    and key[0].startswith("pgas-transfer-"))
        if transfer and start == "memory":  # released or lost (a cancel, a dead worker): not ready any more
            self._ready.get("pgas-rechunk-" + key[0][len("pgas-transfer-"):], set()).discard(key[1])
        if transfer and finish == "memory":
            # the last transfer task of a run is done: start the collective now, without waiting for the
            # barrier task to be scheduled and to gather its inputs (it then only collects the result)
            ts = self.scheduler.tasks.get(key)
            spec = ts.run_spec if ts is not None else None
            name = "pgas-rechunk-" + key[0][len("pgas-transfer-"):]
            from ._graph import PinnedTask

            if isinstance(spec, PinnedTask) and name not in self._runs:
                ready = self._ready.setdefault(name, set())
                ready.add(key[1])
                if len(ready) == spec.npes:
                    self._finished.pop(name, None)
                    self._start(name, spec.epoch)
            return
        if finish == "forgotten":
            self._pinned.pop(key, None)
            self._barriers.discard(key)
        if finish == "erred" and isinstance(key, str) and key.startswith("pgas-barrier-"):
            # the run failed, or never starts (an input erred): the inputs staged on the workers serve nothing
            # now, but the barrier stays erred while the client holds it, and they stayed with it, outside Dask's
            # memory accounting. (The run's own bookkeeping goes when the barrier is released or forgotten.)
            name = "pgas-rechunk-" + key[len("pgas-barrier-"):]
            self._tell_members({"op": "pgas-forget", "name": name, "run": None, "epoch": self.epoch})
        done_with = finish == "forgotten" or (finish == "released" and start == "memory")
        if done_with and isinstance(key, str) and key.startswith("pgas-barrier-"):
            # every output task is done with the run's results: the workers can drop them. (Not when the
            # barrier task leaves "processing" to be rescheduled, e.g. stolen: its run's outputs still wait.)
            name = "pgas-rechunk-" + key[len("pgas-barrier-"):]
            seq = self._last_seq.pop(name, None)
            self._ready.pop(name, None)
            self._finished.pop(name, None)
            if (run := self._runs.pop(name, None)) is not None:  # cancelled while its collective runs
                self._detached.add(run)
            self._tell_members({"op": "pgas-forget", "name": name, "run": seq, "epoch": self.epoch})

    def remove_worker(self, scheduler, worker: str, *, stimulus_id: str, **kwargs) -> None:
        if worker not in self.world:
            return
        if getattr(scheduler, "status", None) in (Status.closing, Status.closed) and not self._in_flight():
            # the cluster is shutting down (a dask-mpi job at its end, without teardown): nothing is lost
            logger.info("dask_pgas: the scheduler is closing; PGAS world #%d ends with it", self.epoch)
            self.world, self.backends = (), ()
            return
        self._break(self._left(worker))
        exc = PGASWorldError(self.broken)  # every member's removal re-checks: tasks may have moved meanwhile
        recs: dict = {}
        for key, addr in list(self._pinned.items()):
            ts = scheduler.tasks.get(key)
            if ts is None or addr != worker:
                continue
            ts.worker_restrictions = None
            ts.loose_restrictions = True
            if ts.state == "no-worker":
                try:
                    recs.update(
                        scheduler.transition(
                            key, "erred", stimulus_id=stimulus_id, cause=key,
                            exception=pickle.dumps(exc), traceback=None,
                            exception_text=str(exc), traceback_text="",
                        )
                    )
                except Exception as e:  # pragma: no cover - defensive
                    logger.warning("dask_pgas: could not fail %s: %r", key, e)
        if recs:
            scheduler.transitions(recs, stimulus_id=stimulus_id)
        # With MPI the whole job often goes down with one rank: no worker may be left to report the failure,
        # so the scheduler errs the barriers itself (the error reaches every dependent and the client).
        for key in list(self._barriers):
            self._err(scheduler, key, exc, stimulus_id)

    @staticmethod
    def _err(scheduler, key, exc: BaseException, stimulus_id: str) -> None:
        ts = scheduler.tasks.get(key)
        if ts is None or ts.state in ("memory", "erred", "forgotten"):
            return
        blob = pickle.dumps(exc)
        kwargs = {"cause": key, "exception": blob, "traceback": None,
                  "exception_text": str(exc), "traceback_text": ""}
        try:
            if ts.state == "processing":
                recs = scheduler.transition(key, "erred", stimulus_id=stimulus_id,
                                            worker=ts.processing_on.address, **kwargs)
                scheduler.transitions(recs, stimulus_id=stimulus_id)
            elif ts.state in ("no-worker", "queued"):
                recs = scheduler.transition(key, "erred", stimulus_id=stimulus_id, **kwargs)
                scheduler.transitions(recs, stimulus_id=stimulus_id)
            elif ts.state in ("waiting", "released"):
                ts.exception, ts.traceback = blob, None
                ts.exception_text, ts.traceback_text = str(exc), ""
                ts.exception_blame = ts
                if ts.state == "waiting":
                    scheduler.transitions({key: "released"}, stimulus_id=stimulus_id)
                if ts.state == "released":
                    scheduler.transitions({key: "erred"}, stimulus_id=stimulus_id)
        except Exception as e:  # pragma: no cover - defensive: never break the scheduler
            logger.warning("dask_pgas: could not fail %s: %r", key, e)

    def valid_workers_downscaling(self, scheduler, workers: list) -> list:
        if self.broken:
            return workers
        members = set(self.world)
        return [ws for ws in workers if ws.address not in members]
