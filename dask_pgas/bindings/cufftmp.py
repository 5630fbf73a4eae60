"""ctypes binding of cuFFTMp's distributed reshape (``libcufftMp.so.12`` of ``nvidia-cufftmp-cu13``,
``libcufftMp.so.11`` of ``nvidia-cufftmp-cu12``).

Traps handled here: the exported ``cufftMpMakeReshape`` is the OLD ABI, so
``__cufftMpMakeReshape_11_4`` (strides beside the boxes) is bound; the library is loaded with
``RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND`` because it exports the same ``cufft*`` names as ``libcufft`` (which CuPy or
torch may have loaded); NVSHMEM's host library is loaded first (RTLD_GLOBAL) so cuFFTMp shares it.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

from . import LazyLibrary, find_in_site_packages, open_library
from . import nvshmem as _nvshmem

__all__ = ["CUFFT_COMM_NONE", "CuFFTMp", "CuFFTMpError", "library_path", "load"]

CUFFT_COMM_NONE = 1

# cufftResult (cufft.h): 10, 12 and 15 exist in CUDA 12 only, 17-20 in CUDA 13 only; no value changed meaning
_RESULTS = {
    0: "CUFFT_SUCCESS", 1: "CUFFT_INVALID_PLAN", 2: "CUFFT_ALLOC_FAILED", 3: "CUFFT_INVALID_TYPE",
    4: "CUFFT_INVALID_VALUE", 5: "CUFFT_INTERNAL_ERROR", 6: "CUFFT_EXEC_FAILED", 7: "CUFFT_SETUP_FAILED",
    8: "CUFFT_INVALID_SIZE", 9: "CUFFT_UNALIGNED_DATA", 10: "CUFFT_INCOMPLETE_PARAMETER_LIST",
    11: "CUFFT_INVALID_DEVICE", 12: "CUFFT_PARSE_ERROR", 13: "CUFFT_NO_WORKSPACE", 14: "CUFFT_NOT_IMPLEMENTED",
    15: "CUFFT_LICENSE_ERROR", 16: "CUFFT_NOT_SUPPORTED", 17: "CUFFT_MISSING_DEPENDENCY",
    18: "CUFFT_NVRTC_FAILURE", 19: "CUFFT_NVJITLINK_FAILURE", 20: "CUFFT_NVSHMEM_FAILURE",
}

_CANDIDATES = [
    "nvidia/cufftmp/cu13/lib/libcufftMp.so.12",
    "nvidia/cufftmp/cu12/lib/libcufftMp.so.11",
    "nvidia/cufftmp/lib/libcufftMp.so.12",
    "nvidia/cufftmp/lib/libcufftMp.so.11",
]


class CuFFTMpError(RuntimeError):
    def __init__(self, what: str, code: int) -> None:
        super().__init__(f"{what} failed with {_RESULTS.get(code, 'cufftResult')} ({code})")
        self.code = code


def library_path() -> str | None:
    return find_in_site_packages(_CANDIDATES, env="DASK_PGAS_CUFFTMP_LIB")


_LL3 = ctypes.c_longlong * 3


class CuFFTMp:
    def __init__(self, path: str) -> None:
        # the NVSHMEM host library must be in the process first (RTLD_GLOBAL); its lock serialises every call
        # below too: cuFFTMp calls NVSHMEM inside them (Make allocates and synchronises symmetric memory)
        self._lock = _nvshmem.load().lock
        mode = os.RTLD_NOW | os.RTLD_LOCAL | getattr(os, "RTLD_DEEPBIND", 0)
        vp, c_int, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        p_ll = ctypes.POINTER(ctypes.c_longlong)
        sigs = {
            "cufftMpCreateReshape": (c_int, [ctypes.POINTER(vp)]),
            "__cufftMpMakeReshape_11_4": (c_int, [vp, sz, c_int, p_ll, p_ll, p_ll, p_ll, p_ll, p_ll, vp, c_int]),
            "cufftMpGetReshapeSize": (c_int, [vp, ctypes.POINTER(sz)]),
            "cufftMpExecReshapeAsync": (c_int, [vp, vp, vp, vp, vp]),
            "cufftMpDestroyReshape": (c_int, [vp]),
        }
        self.lib = open_library(path, mode, "cuFFTMp", sigs, "cuFFTMp >= 11.4 is needed")
        self.path = path
        self._make = getattr(self.lib, "__cufftMpMakeReshape_11_4")

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise CuFFTMpError(what, rc)

    def create(self) -> int:
        h = ctypes.c_void_p()
        with self._lock:
            rc = self.lib.cufftMpCreateReshape(ctypes.byref(h))
        self._check(rc, "cufftMpCreateReshape")
        return h.value

    def make(
        self,
        handle: int,
        element_size: int,
        lower_in: Sequence[int], upper_in: Sequence[int], strides_in: Sequence[int],
        lower_out: Sequence[int], upper_out: Sequence[int], strides_out: Sequence[int],
    ) -> None:
        """Collective. 3-D boxes in global coordinates, strides in elements (row-major, decreasing)."""
        arrays = [_LL3(*map(int, v)) for v in (lower_in, upper_in, strides_in, lower_out, upper_out, strides_out)]
        with self._lock:
            rc = self._make(ctypes.c_void_p(handle), element_size, 3, *arrays, None, CUFFT_COMM_NONE)
        self._check(rc, "cufftMpMakeReshape")

    def workspace_size(self, handle: int) -> int:
        n = ctypes.c_size_t()
        with self._lock:
            rc = self.lib.cufftMpGetReshapeSize(ctypes.c_void_p(handle), ctypes.byref(n))
        self._check(rc, "cufftMpGetReshapeSize")
        return n.value

    def execute(self, handle: int, out: int, inp: int, workspace: int, stream: int) -> None:
        with self._lock:
            rc = self.lib.cufftMpExecReshapeAsync(
                ctypes.c_void_p(handle), ctypes.c_void_p(out), ctypes.c_void_p(inp),
                ctypes.c_void_p(workspace or None), ctypes.c_void_p(stream or None),
            )
        self._check(rc, "cufftMpExecReshapeAsync")

    def destroy(self, handle: int) -> None:
        with self._lock:
            rc = self.lib.cufftMpDestroyReshape(ctypes.c_void_p(handle))
        self._check(rc, "cufftMpDestroyReshape")


#: the cuFFTMp library, loaded on first use
load = LazyLibrary(
    CuFFTMp, library_path,
    "cuFFTMp (libcufftMp.so.12 from nvidia-cufftmp-cu13, or libcufftMp.so.11 from nvidia-cufftmp-cu12) was not found",
)
