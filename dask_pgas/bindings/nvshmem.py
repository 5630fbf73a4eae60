"""ctypes binding of the NVSHMEM host API (``libnvshmem_host.so.3`` of ``nvidia-nvshmem-cu12``/``-cu13``).

Only what the GPU engine uses: unique-id bootstrap (no MPI inside NVSHMEM), symmetric malloc/free, ``nvshmem_ptr``,
barriers, on-stream synchronisation and host-side get. ``nvshmem_init``/``nvshmem_finalize`` are static inline in the
headers, so the ``nvshmemx_hostlib_*`` entry points are bound instead. The host API is serialized by a lock.
"""

from __future__ import annotations

import ctypes
import os
import threading

from . import LazyLibrary, find_in_site_packages, open_library

__all__ = [
    "ATTR_SIZE",
    "INIT_WITH_UNIQUEID",
    "NVSHMEM",
    "UNIQUEID_SIZE",
    "InitAttr",
    "UniqueId",
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

    def init_with_uniqueid(self, uid: bytes, rank: int, nranks: int) -> int:
        if len(uid) != UNIQUEID_SIZE:
            raise ValueError(f"an NVSHMEM unique id has {UNIQUEID_SIZE} bytes, got {len(uid)}")
        self._uid = UniqueId.from_buffer_copy(uid)  # kept alive: attr points at it
        self._attr = attr = InitAttr()
        ctypes.memset(ctypes.addressof(attr), 0, ATTR_SIZE)
        attr.version = _ATTR_VERSION
        attr.args.version = _ARGS_VERSION
        attr.args.uid_args.version = _UID_ARGS_VERSION
        with self.lock:
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
        with self.lock:
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
