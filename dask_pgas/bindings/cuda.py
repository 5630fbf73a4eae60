"""The few CUDA driver API calls the GPU engine needs (``libcuda.so.1``, present wherever a driver is)."""

from __future__ import annotations

import ctypes
import threading

from . import LibraryNotFound

__all__ = ["CudaDriver", "CudaError", "driver"]

_lock = threading.Lock()
_driver: CudaDriver | None = None


class CudaError(RuntimeError):
    pass


class CudaDriver:
    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise LibraryNotFound(f"the CUDA driver (libcuda.so.1) is not available: {exc}") from None
        lib = self.lib
        vp, c_int, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        sigs = {
            "cuInit": [ctypes.c_uint],
            "cuDeviceGetCount": [ctypes.POINTER(c_int)],
            "cuDeviceGet": [ctypes.POINTER(c_int), c_int],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(vp), c_int],
            "cuCtxSetCurrent": [vp],
            "cuCtxGetCurrent": [ctypes.POINTER(vp)],
            "cuCtxSynchronize": [],
            "cuMemcpy": [ctypes.c_uint64, ctypes.c_uint64, sz],
            "cuMemcpyAsync": [ctypes.c_uint64, ctypes.c_uint64, sz, vp],
            "cuStreamSynchronize": [vp],
            "cuGetErrorString": [c_int, ctypes.POINTER(ctypes.c_char_p)],
            "cuMemGetInfo_v2": [ctypes.POINTER(sz), ctypes.POINTER(sz)],
            "cuDeviceGetPCIBusId": [ctypes.c_char_p, c_int, c_int],
        }
        for name, args in sigs.items():
            try:
                fn = getattr(lib, name)
            except AttributeError:
                raise LibraryNotFound(f"the CUDA driver (libcuda.so.1) has no {name}: update the NVIDIA driver"
                                      ) from None
            fn.argtypes = args
            fn.restype = c_int
        self._init = False

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(msg))
            raise CudaError(f"{what} failed: CUDA error {rc} ({(msg.value or b'?').decode()})")

    def init(self) -> None:
        if not self._init:
            self.check(self.lib.cuInit(0), "cuInit")
            self._init = True

    def device_count(self) -> int:
        self.init()
        n = ctypes.c_int()
        self.check(self.lib.cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
        return n.value

    def make_current(self, ordinal: int) -> None:
        """Retain device ``ordinal``'s primary context (the one CuPy and torch use) and make it current."""
        self.init()
        dev = ctypes.c_int()
        self.check(self.lib.cuDeviceGet(ctypes.byref(dev), ordinal), f"cuDeviceGet({ordinal})")
        ctx = ctypes.c_void_p()
        self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        self.check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self._ctx, self._dev = ctx, dev.value

    def current(self) -> _Current:
        """``with drv.current():`` runs the calls inside with the engine's primary context current in this thread
        (driver, NVSHMEM and cuFFTMp calls act on the current context). A thread with no context keeps it
        afterwards, as after CuPy's or torch's first call there; a thread where another context is current (a
        context of its own, or another device made current by CuPy or torch) gets that one back."""
        return _Current(self)

    def memcpy(self, dst: int, src: int, nbytes: int) -> None:
        if nbytes:
            with self.current():
                self.check(self.lib.cuMemcpy(dst, src, nbytes), "cuMemcpy")

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        if nbytes:
            with self.current():
                self.check(self.lib.cuMemcpyAsync(dst, src, nbytes, ctypes.c_void_p(stream or None)),
                           "cuMemcpyAsync")

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device made current by :meth:`make_current`, as ``cudaMemGetInfo`` counts
        them (every process's use)."""
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        with self.current():
            self.check(self.lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
        return free.value, total.value

    def pci_bus_id(self) -> str:
        """The PCI bus id of the device made current by :meth:`make_current` (the same in every process that
        shares it, whatever ``CUDA_VISIBLE_DEVICES`` numbers it)."""
        buf = ctypes.create_string_buffer(32)
        self.check(self.lib.cuDeviceGetPCIBusId(buf, len(buf), self._dev), "cuDeviceGetPCIBusId")
        return buf.value.decode()

    def ctx_synchronize(self) -> None:
        with self.current():
            self.check(self.lib.cuCtxSynchronize(), "cuCtxSynchronize")

    def stream_synchronize(self, stream: int) -> None:
        with self.current():
            self.check(self.lib.cuStreamSynchronize(ctypes.c_void_p(stream or None)), "cuStreamSynchronize")


class _Current:
    """:meth:`CudaDriver.current` (a class, not a generator: it wraps every ``execute()``). Nests: an inner one
    finds the engine's context current and does nothing."""

    __slots__ = ("drv", "prev")

    def __init__(self, drv: CudaDriver) -> None:
        self.drv, self.prev = drv, None

    def __enter__(self) -> None:
        drv = self.drv
        ctx = getattr(drv, "_ctx", None)
        if ctx is None:  # before make_current: nothing to switch to
            return
        cur = ctypes.c_void_p()
        drv.check(drv.lib.cuCtxGetCurrent(ctypes.byref(cur)), "cuCtxGetCurrent")
        if cur.value != ctx.value:
            drv.check(drv.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
            if cur.value:
                self.prev = cur

    def __exit__(self, *exc: object) -> None:
        if self.prev is not None:
            prev, self.prev = self.prev, None
            self.drv.check(self.drv.lib.cuCtxSetCurrent(prev), "cuCtxSetCurrent")


def driver() -> CudaDriver:
    global _driver
    with _lock:
        if _driver is None:
            _driver = CudaDriver()
        return _driver
