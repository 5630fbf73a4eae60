"""ctypes binding of the NVSHMEM host API (``libnvshmem_host.so.3`` of ``nvidia-nvshmem-cu12``/``-cu13``).

Only what the GPU engine uses: unique-id bootstrap (no MPI inside NVSHMEM), symmetric malloc/free, ``nvshmem_ptr``,
barriers, on-stream synchronisation and host-side get. ``nvshmem_init``/``nvshmem_finalize`` are static inline in the
headers, so the ``nvshmemx_hostlib_*`` entry points are bound instead. The host API is serialized by a lock; the
init and finalize of NVSHMEM jobs on one host are kept apart by a file lock (:func:`host_lock`).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator

from . import LazyLibrary, find_in_site_packages, open_library

__all__ = [
    "ATTR_SIZE",
    "INIT_WITH_UNIQUEID",
    "NVSHMEM",
    "UNIQUEID_SIZE",
    "InitAttr",
    "UniqueId",
    "host_lock",
    "library_path",
    "load",
]

UNIQUEID_SIZE = 128
ATTR_SIZE = 144
INIT_WITH_UNIQUEID = 8
_UID_VERSION = 0x10080
_ATTR_VERSION = 0x10090
_ARGS_VERSION = 0x10080
_UID_ARGS_VERSION = 0x10018


class UniqueId(ctypes.Structure):
    """``nvshmemx_uniqueid_t`` (128 bytes): int version; char internal[124]."""

    _fields_ = [("version", ctypes.c_int), ("internal", ctypes.c_char * 124)]


class _UidArgs(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_int),
        ("id", ctypes.POINTER(UniqueId)),
        ("myrank", ctypes.c_int),
        ("nranks", ctypes.c_int),
    ]


class _InitArgs(ctypes.Structure):
    _fields_ = [("version", ctypes.c_int), ("uid_args", _UidArgs), ("content", ctypes.c_char * 96)]


class InitAttr(ctypes.Structure):
    """``nvshmemx_init_attr_t`` (144 bytes, V1 layout valid for NVSHMEM 3.4 and 3.8).

    version @0, mpi_comm @8, args @16 (args.version @16, uid_args.version @24, uid_args.id @32, myrank @40,
    nranks @44).
    """

    _fields_ = [("version", ctypes.c_int), ("mpi_comm", ctypes.c_void_p), ("args", _InitArgs)]


def library_path() -> str | None:
    return find_in_site_packages(
        ["nvidia/nvshmem/lib/libnvshmem_host.so.3"], env="DASK_PGAS_NVSHMEM_LIB"
    )




# -- NVSHMEM jobs side by side on one host ----------------------------------------------------------------------
# With several PEs on one GPU and no MPS ("limited MPG", init status 3), NVSHMEM's init has the GPU's first PE
# create a POSIX shared-memory slab named "mps_shm_<that PE's number>", which the GPU's other PEs then open, write
# their CUDA IPC event handles into and read each other's from; its on-stream barriers use the slab from then on.
# The name is the same in every NVSHMEM job on the host (/dev/shm is one namespace, and the create unlinks any
# slab of that name first), so two jobs whose inits overlap meet in one slab: NVSHMEM exits the process ("cuda
# failed with mapping of buffer object failed", an IPC event handle of the other job: GPU rounds 12a, 34a and 35
# saw it when several Dask clusters started at once), or the two jobs' barriers share one counter. Finalize
# unlinks the name. So the host's first PE holds this lock exclusively through its init, which returns only once
# every PE of its job has passed the slab's set-up (NVSHMEM's init ends in barriers), and every PE holds it shared
# through finalize. Only jobs that take the lock are kept apart (other NVSHMEM programs do not), and one that
# waits longer than HOST_LOCK_WAIT goes ahead without it, with a warning: the lock never makes a bring-up fail.
HOST_LOCK_NAME = "dask-pgas-nvshmem.lock"
HOST_LOCK_WAIT = 60.0  # seconds; another job's init takes about 1 s (0.6 s alone, a few with 16 PEs on one GPU)


def _host_lock_path() -> str:
    """In /dev/shm where there is one (the namespace whose names collide), else the temporary directory."""
    shm = "/dev/shm"
    folder = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()
    return os.path.join(folder, HOST_LOCK_NAME)


@contextlib.contextmanager
def host_lock(exclusive: bool) -> Iterator[None]:
    """Hold the host's NVSHMEM init lock (exclusive for a job's init, shared for a finalize) for the ``with`` body.

    Waits at most :data:`HOST_LOCK_WAIT` seconds, then goes on without it; a lock file that cannot be opened or
    locked is skipped alike. It never raises: the callers are about to enter a collective that the other PEs are
    already waiting in."""
    log = logging.getLogger(__name__)
    path = _host_lock_path()
    what = "init" if exclusive else "finalize"
    fd = taken = None
    try:  # (one try for the file's life: an interrupt while waiting closes it too)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            with contextlib.suppress(OSError):  # (other users' jobs take it too; the umask may have narrowed it)
                os.fchmod(fd, 0o666)
            t0 = time.monotonic()
            taken = _flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, HOST_LOCK_WAIT)
            waited = time.monotonic() - t0
        except OSError as exc:  # no lock file here, or a file system without flock (ENOLCK): go on without it
            log.debug("NVSHMEM host lock %s not used: %s", path, exc)
        if taken is False:
            holder = "unknown"
            with contextlib.suppress(OSError):
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or holder
            log.warning("NVSHMEM %s went ahead without the host lock %s after %.0f s (held by %s): an NVSHMEM job "
                        "starting on this host at the same time may clash with it", what, path, waited, holder)
        elif taken:
            if exclusive:  # named in another job's warning (a full /dev/shm only loses the name)
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"pid {os.getpid()}".encode(), 0)
            if waited > 1.0:
                log.info("NVSHMEM %s waited %.1f s for another job's init on this host", what, waited)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # (releases the lock)


def _flock(fd: int, mode: int, limit: float) -> bool:
    """``flock(fd, mode)``, retried for at most ``limit`` seconds; whether it was taken."""
    deadline = time.monotonic() + limit
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


class NVSHMEM:
    """The loaded host library. Methods raise RuntimeError on a failing return code."""

    def __init__(self, path: str) -> None:
        vp, c_int, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        sigs = {
            "nvshmemx_get_uniqueid": (c_int, [ctypes.POINTER(UniqueId)]),
            "nvshmemx_set_attr_uniqueid_args": (
                c_int, [c_int, c_int, ctypes.POINTER(UniqueId), ctypes.POINTER(InitAttr)]
            ),
            "nvshmemx_hostlib_init_attr": (c_int, [ctypes.c_uint, ctypes.POINTER(InitAttr)]),
            "nvshmemx_hostlib_finalize": (None, []),
            "nvshmemx_init_status": (c_int, []),
            "nvshmem_my_pe": (c_int, []),
            "nvshmem_n_pes": (c_int, []),
            "nvshmem_malloc": (vp, [sz]),
            "nvshmem_free": (None, [vp]),
            "nvshmem_ptr": (vp, [vp, c_int]),
            "nvshmem_barrier_all": (None, []),
            "nvshmemx_sync_all_on_stream": (None, [vp]),
            "nvshmem_getmem": (None, [vp, vp, sz, c_int]),
            "nvshmem_quiet": (None, []),
            "nvshmemx_vendor_get_version_info": (None, [ctypes.POINTER(c_int)] * 3),
        }
        self.lib = open_library(path, os.RTLD_NOW | os.RTLD_GLOBAL, "NVSHMEM host library", sigs,
                                "a newer nvidia-nvshmem is needed")
        self.path = path
        self.lock = threading.RLock()

    # -- bootstrap -------------------------------------------------------------------------------------------
    def version(self) -> tuple[int, int, int]:
        a, b, c = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        with self.lock:
            self.lib.nvshmemx_vendor_get_version_info(ctypes.byref(a), ctypes.byref(b), ctypes.byref(c))
        return a.value, b.value, c.value

    def get_uniqueid(self) -> bytes:
        uid = UniqueId()
        uid.version = _UID_VERSION
        with self.lock:
            rc = self.lib.nvshmemx_get_uniqueid(ctypes.byref(uid))
        if rc != 0:
            raise RuntimeError(f"nvshmemx_get_uniqueid failed ({rc})")
        return ctypes.string_at(ctypes.addressof(uid), UNIQUEID_SIZE)

    def init_with_uniqueid(self, uid: bytes, rank: int, nranks: int, *, first_on_host: bool | None = None) -> int:
        """NVSHMEM's collective init from a unique id; returns ``nvshmemx_init_status()``. The host's first PE
        (``first_on_host``, default rank 0) holds :func:`host_lock` through it."""
        if len(uid) != UNIQUEID_SIZE:
            raise ValueError(f"an NVSHMEM unique id has {UNIQUEID_SIZE} bytes, got {len(uid)}")
        self._uid = UniqueId.from_buffer_copy(uid)  # kept alive: attr points at it
        self._attr = attr = InitAttr()
        ctypes.memset(ctypes.addressof(attr), 0, ATTR_SIZE)
        attr.version = _ATTR_VERSION
        attr.args.version = _ARGS_VERSION
        attr.args.uid_args.version = _UID_ARGS_VERSION
        lead = rank == 0 if first_on_host is None else first_on_host
        with host_lock(exclusive=True) if lead else contextlib.nullcontext(), self.lock:
            rc = self.lib.nvshmemx_set_attr_uniqueid_args(rank, nranks, ctypes.byref(self._uid), ctypes.byref(attr))
            if rc != 0:
                raise RuntimeError(f"nvshmemx_set_attr_uniqueid_args failed ({rc})")
            rc = self.lib.nvshmemx_hostlib_init_attr(INIT_WITH_UNIQUEID, ctypes.byref(attr))
            if rc != 0:
                raise RuntimeError(
                    f"nvshmemx_hostlib_init_attr failed ({rc}); set NVSHMEM_DEBUG=INFO for details"
                )
            return self.lib.nvshmemx_init_status()

    def finalize(self) -> None:
        with host_lock(exclusive=False), self.lock:
            self.lib.nvshmemx_hostlib_finalize()

    def my_pe(self) -> int:
        with self.lock:
            return self.lib.nvshmem_my_pe()

    def n_pes(self) -> int:
        with self.lock:
            return self.lib.nvshmem_n_pes()

    # -- memory ----------------------------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> int:
        with self.lock:
            ptr = self.lib.nvshmem_malloc(max(int(nbytes), 1))
        if not ptr:
            raise MemoryError(
                f"nvshmem_malloc({nbytes}) failed: the symmetric heap is full; raise NVSHMEM_SYMMETRIC_SIZE "
                "(or DASK_PGAS_HEAP_SIZE) before initialize()"
            )
        return ptr

    def free(self, ptr: int) -> None:
        with self.lock:
            self.lib.nvshmem_free(ctypes.c_void_p(ptr))

    def ptr(self, ptr: int, pe: int) -> int:
        with self.lock:  # reads the heap's mappings, which a concurrent nvshmem_malloc may be growing
            return self.lib.nvshmem_ptr(ctypes.c_void_p(ptr), pe) or 0

    # -- synchronisation and host RMA ------------------------------------------------------------------------
    def barrier_all(self) -> None:
        with self.lock:
            self.lib.nvshmem_barrier_all()

    def sync_all_on_stream(self, stream: int) -> None:
        with self.lock:
            self.lib.nvshmemx_sync_all_on_stream(ctypes.c_void_p(stream or None))

    def getmem(self, dst: int, src: int, nbytes: int, pe: int) -> None:
        with self.lock:
            self.lib.nvshmem_getmem(ctypes.c_void_p(dst), ctypes.c_void_p(src), nbytes, pe)
            self.lib.nvshmem_quiet()


#: the NVSHMEM host library, loaded on first use
load = LazyLibrary(
    NVSHMEM, library_path,
    "the NVSHMEM host library libnvshmem_host.so.3 was not found (package nvidia-nvshmem-cu13 or -cu12, "
    "folder nvidia/nvshmem/lib)",
)
