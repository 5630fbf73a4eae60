"""GPU engine: NVSHMEM symmetric heap and cuFFTMp reshape, through the PyPI wheels (ctypes, no compiled code).

* Bring-up: unique-id bootstrap (rank 0 makes the id, it travels over mpi4py or by any other channel), so
  NVSHMEM's own MPI plugin (built for Open MPI only) is never used. :func:`initialize_from_uniqueid` brings the
  engine up without MPI at all (the Dask integration hands the id through the scheduler); its control plane then
  runs on NVSHMEM itself.
* Symmetric memory: ``nvshmem_malloc``/``nvshmem_free``, wrapped zero-copy as CuPy arrays or torch tensors;
  "is this on the heap" is ``nvshmem_ptr(p, my_pe) != NULL``.
* Reshape: one cuFFTMp reshape handle per plan (``CUFFT_COMM_NONE``) with the boxes described in 3-D words by
  :mod:`dask_pgas.geometry.cufftmp_layout`. A reshape in which every rank keeps its own box is a device copy (no
  collective). Layouts that cuFFTMp's 3-D words cannot express (element sizes that do not pack, boxes that do not
  reduce to 3 axes) fall back, when every peer's heap is mapped (one node), to device copies that push each piece
  into the peer's memory.
  NumPy operands are staged through symmetric buffers of the plan and come back as NumPy.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import pickle
import socket
import struct
import sys
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .._arrays import TORCH_INTS
from ..distribution import Box
from ..errors import (
    BackendUnavailableError,
    CollectiveError,
    DeviceError,
    RuntimeStateError,
    UnsupportedOperandError,
)
from .base import Allocation, ControlPlane, Engine, ReshapePlan, ReshapeSpec

__all__ = [
    "NVSHMEMControl",
    "NVSHMEMEngine",
    "NVSHMEMReshapePlan",
    "NVSHMEMSettings",
    "apply_env_defaults",
    "get_nvshmem_uniqueid",
    "initialize_from_uniqueid",
    "parse_size",
    "stream_handle",
]

# -- environment ------------------------------------------------------------------------------------------------
def parse_size(text: str | int | None, default: int = 1 << 30) -> int:
    """NVSHMEM-style size: ``1073741824``, ``512M``, ``4g``, ``1GiB`` (binary multiples)."""
    if text is None or text == "":
        return default
    if isinstance(text, int):
        return text
    s = str(text).strip().lower().removesuffix("ib").removesuffix("b")
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(float(s))


def apply_env_defaults(single_node: bool | None, environ: dict | None = None) -> dict[str, str]:
    """Set NVSHMEM's environment before it initializes; the user's own settings win.

    * ``NVSHMEM_DISABLE_NVLS=1`` unless the user set it to ``0`` explicitly (NVLink multicast can take a shared
      host's GPUs out of service);
    * one node (``single_node``): ``NVSHMEM_REMOTE_TRANSPORT=none`` and ``NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo``;
    * ``DASK_PGAS_HEAP_SIZE`` (e.g. ``4g``) becomes ``NVSHMEM_SYMMETRIC_SIZE`` unless that is set;
    * ``NVSHMEM_DISABLE_NCCL=1`` (the engine uses no NVSHMEM team collectives; silences a warning when several
      processes share a GPU).

    Returns the variables it set.
    """
    env = os.environ if environ is None else environ
    before = dict(env)
    if env.get("NVSHMEM_DISABLE_NVLS", "").strip() != "0":
        env["NVSHMEM_DISABLE_NVLS"] = "1"
    if single_node:
        env.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
        env.setdefault("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo")
    heap = env.get("DASK_PGAS_HEAP_SIZE")
    if heap:
        env.setdefault("NVSHMEM_SYMMETRIC_SIZE", heap)
    env.setdefault("NVSHMEM_DISABLE_NCCL", "1")
    return {k: v for k, v in env.items() if before.get(k) != v}


@dataclass(frozen=True)
class NVSHMEMSettings:
    """Environment that decides collective paths, read once at bring-up and agreed by every PE (ranks that took
    different paths would hang):

    * ``DASK_PGAS_NVSHMEM_RESHAPE=peer``: reshapes by peer copies, never cuFFTMp;
    * ``DASK_PGAS_EMPTY_VIA_PEER=1``: reshapes with empty boxes go around cuFFTMp (see docs/gpu-validation.md);
    * ``DASK_PGAS_NVSHMEM_POOL_BYTES`` (default a quarter of ``NVSHMEM_SYMMETRIC_SIZE``; 0 disables): how many
      bytes of freed blocks the symmetric pool keeps instead of ``nvshmem_free`` (collective).
    * ``heap_limit``: the bytes this engine lets its blocks reach on one PE. NVSHMEM 3.4 ends the process when
      its heap cannot grow (measured on the H200, docs/gpu-validation.md), so the engine refuses, on every PE
      alike, an allocation that would pass NVSHMEM's cap: ``NVSHMEM_MAX_MEMORY_PER_GPU`` (default 128 GiB) less
      two ``NVSHMEM_CUMEM_GRANULARITY`` (default 512 MiB) for NVSHMEM's own blocks and its rounding. (The
      engine's blocks: the control plane's small buffer and cuFFTMp's own allocations inside its plan are not
      counted, which is what that margin is for.) A fixed
      heap (``NVSHMEM_DISABLE_CUDA_VMM``) only returns NULL when full (round 13d: it even holds about 384 MiB
      more than asked), so there the limit is ``NVSHMEM_SYMMETRIC_SIZE`` itself (default 1 GiB): what the user
      asked for, and a NULL below it still raises ``MemoryError`` on every PE alike.
    * ``heap_grows`` (not ``NVSHMEM_DISABLE_CUDA_VMM``): the heap maps device memory as it grows, in
      ``granularity`` steps (``NVSHMEM_CUMEM_GRANULARITY``), so a growth needs free device memory on every PE:
      the engine checks it together before each ``nvshmem_malloc`` (see ``NVSHMEMEngine._check_device_memory``).
    """

    force_peer: bool = False
    empty_via_peer: bool = False
    pool_limit: int = (1 << 30) // 4
    heap_limit: int = (128 << 30) - (1 << 30)
    heap_grows: bool = True
    granularity: int = 512 << 20

    #: the variables each field is read from
    VARIABLES: ClassVar[dict[str, tuple[str, ...]]] = {
        "force_peer": ("DASK_PGAS_NVSHMEM_RESHAPE",),
        "empty_via_peer": ("DASK_PGAS_EMPTY_VIA_PEER",),
        "pool_limit": ("DASK_PGAS_NVSHMEM_POOL_BYTES", "NVSHMEM_SYMMETRIC_SIZE"),
        "heap_limit": ("NVSHMEM_MAX_MEMORY_PER_GPU", "NVSHMEM_DISABLE_CUDA_VMM", "NVSHMEM_SYMMETRIC_SIZE",
                       "NVSHMEM_CUMEM_GRANULARITY"),
        "heap_grows": ("NVSHMEM_DISABLE_CUDA_VMM",),
        "granularity": ("NVSHMEM_CUMEM_GRANULARITY",),
    }

    @classmethod
    def from_env(cls, environ: Mapping[str, str | None] | None = None) -> NVSHMEMSettings:
        env = os.environ if environ is None else environ
        pool = env.get("DASK_PGAS_NVSHMEM_POOL_BYTES")
        static = (env.get("NVSHMEM_DISABLE_CUDA_VMM") or "").strip().lower() in ("1", "true", "yes", "y", "on")
        cap = (parse_size(env.get("NVSHMEM_SYMMETRIC_SIZE")) if static
               else parse_size(env.get("NVSHMEM_MAX_MEMORY_PER_GPU"), 128 << 30))
        granularity = parse_size(env.get("NVSHMEM_CUMEM_GRANULARITY"), 512 << 20)
        return cls(
            force_peer=env.get("DASK_PGAS_NVSHMEM_RESHAPE") == "peer",
            empty_via_peer=env.get("DASK_PGAS_EMPTY_VIA_PEER") == "1",
            pool_limit=parse_size(env.get("NVSHMEM_SYMMETRIC_SIZE")) // 4 if not pool else parse_size(pool),
            heap_limit=cap if static else cap - 2 * granularity,
            heap_grows=not static,
            granularity=granularity,
        )

    @classmethod
    def agreed(cls, control: ControlPlane, environ: Mapping[str, str] | None = None, *,
               local_error: str | None = None) -> NVSHMEMSettings:
        """Collective: this PE's settings, once every PE has the same; else every PE raises the same
        :class:`BackendUnavailableError` naming the variable and its value on each rank. ``local_error`` (a
        failed local bring-up check) makes every PE raise too, in the same exchange."""
        env = os.environ if environ is None else environ
        raw = {name: env.get(name) for names in cls.VARIABLES.values() for name in names}
        mine, error = None, local_error
        if error is None:
            try:
                mine = cls.from_env(raw)
            except Exception as exc:  # reported to all ranks, never raised alone
                error = f"cannot read its settings: {type(exc).__name__}: {exc}"
        everyone = control.allgather((raw, mine, error))
        bad = [(r, e) for r, (_, _, e) in enumerate(everyone) if e]
        if bad:
            raise BackendUnavailableError(f"the nvshmem engine cannot start on rank {bad[0][0]}: {bad[0][1]}")
        for field, names in cls.VARIABLES.items():
            if len({getattr(s, field) for _, s, _ in everyone}) > 1:
                values = "; ".join(
                    f"rank {r}: " + ", ".join(f"{n}={'unset' if v[n] is None else repr(v[n])}" for n in names)
                    for r, (v, _, _) in enumerate(everyone)
                )
                raise BackendUnavailableError(
                    f"{' and '.join(names)} must be set alike on every rank (they decide collective paths); "
                    f"by rank: {values}"
                )
        return mine


# -- array helpers (CuPy and torch are imported only when used) -------------------------------------------------
def stream_handle(stream: Any, package: str | None = None, device: int | None = None) -> int:
    """Raw ``cudaStream_t`` of a CuPy/torch/cuda.core stream, an int handle, or the package's current stream (of
    ``device`` when given: the thread may have made another device current, whose stream the engine cannot use)."""
    if stream is None:
        if package == "cupy":
            import cupy

            # (CuPy keeps a current stream per device and thread; read without switching the thread's device)
            return int(cupy.cuda.get_current_stream(-1 if device is None else device).ptr)
        if package == "torch":
            import torch

            return int(torch.cuda.current_stream(device).cuda_stream)
        return 0
    if isinstance(stream, int):
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        value = proto() if callable(proto) else proto
        return int(value[1])
    for attr in ("ptr", "cuda_stream", "handle"):
        value = getattr(stream, attr, None)
        if value is not None:
            return int(value)
    raise TypeError(f"stream must be a CuPy, torch or cuda.core stream (or an object with __cuda_stream__, .ptr or "
                    f".handle) or an int handle, not {type(stream).__name__}")


def _ptr(array: Any) -> int:
    if isinstance(array, np.ndarray):
        return array.__array_interface__["data"][0]
    mod = type(array).__module__
    if mod.startswith("cupy"):
        return int(array.data.ptr)
    # torch reports data_ptr() == 0 for empty tensors; cuFFTMp and the peer path still need the symmetric address
    # of every PE's buffers (they derive peers' addresses from the local ones): the keeper as_array puts on the
    # tensor, and on its root, which every view of it (permute, view, reshape) has as ``_base`` (and which the
    # tensor keeps alive: a view made after the tensor is gone may report 0), holds it
    ptr = array.data_ptr()
    if not ptr:
        keeper = getattr(array, "_dask_pgas_keeper", None) or getattr(array._base, "_dask_pgas_keeper", None)
        ptr = keeper.ptr if keeper is not None else 0
    return int(ptr)


def _package(array: Any) -> str:
    if isinstance(array, np.ndarray):
        return "numpy"
    return "cupy" if type(array).__module__.startswith("cupy") else "torch"


class _CAI:
    """A raw device buffer exposing ``__cuda_array_interface__`` (bytes), for torch.as_tensor."""

    def __init__(self, ptr: int, nbytes: int, owner: Any) -> None:
        self.ptr = ptr
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None,
            "stream": None,
        }
        self._owner = owner


def _torch_dtype(torch: Any, dtype: Any) -> Any:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = np.dtype(dtype).name
    out = getattr(torch, name, None)
    if not isinstance(out, torch.dtype):
        raise UnsupportedOperandError(f"torch has no dtype matching {np.dtype(dtype)}")
    return out


def _word_view(ptr: int, shape: Sequence[int], itemsize: int, device: int) -> Any:
    """A C-ordered device array of ``shape`` + (words,) over raw memory, with the widest integer word that
    divides ``itemsize`` (for copies of any element type). CuPy if installed, else torch."""
    word = next(w for w in (8, 4, 2, 1) if itemsize % w == 0)
    full = (*shape, itemsize // word)
    nbytes = math.prod(full) * word
    if importlib.util.find_spec("cupy") is not None:
        import cupy

        mem = cupy.cuda.UnownedMemory(ptr, nbytes, None, device_id=device)
        return cupy.ndarray(full, dtype=f"<i{word}", memptr=cupy.cuda.MemoryPointer(mem, 0))
    import torch

    t = torch.as_tensor(_CAI(ptr, nbytes, None), device=f"cuda:{device}")
    return t.view(getattr(torch, TORCH_INTS[word])).view(full)


class _StreamContext:
    """Run CuPy/torch copies on a raw stream handle."""

    def __init__(self, handle: int, device: int) -> None:
        self.handle, self.device = handle, device
        self._ctx = None

    def __enter__(self):
        # the engine's device too: a thread other than the initializing one starts on device 0
        if importlib.util.find_spec("cupy") is not None:
            import cupy

            self._dev = cupy.cuda.Device(self.device)
            self._ctx = cupy.cuda.ExternalStream(self.handle, device_id=self.device)
        else:
            import torch

            self._dev = torch.cuda.device(self.device)
            self._ctx = torch.cuda.stream(torch.cuda.ExternalStream(self.handle, device=f"cuda:{self.device}"))
        self._dev.__enter__()
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            self._ctx.__exit__(*exc)
        finally:
            self._dev.__exit__(*exc)


def _on_device(method: Callable) -> Callable:
    """Run an engine or plan method with the engine's CUDA context current in the calling thread
    (:meth:`CudaDriver.current`): a Dask worker or a user calls from threads that did not initialize, where no
    context, or another device's, may be current."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.drv.current():
            return method(self, *args, **kwargs)

    return run


def _copy(dst: Any, src: Any) -> None:
    if type(dst).__module__.startswith("cupy"):
        dst[...] = src
    else:
        dst.copy_(src)


# -- control plane over NVSHMEM ---------------------------------------------------------------------------------
class NVSHMEMControl(ControlPlane):
    """Allgather of small pickled objects without MPI: each PE writes ``len + payload`` into its slot of a
    symmetric scratch buffer, ``nvshmem_barrier_all``, then reads every peer's slot (peer-mapped memory, or
    ``nvshmem_getmem`` into the second half of its own buffer: NVSHMEM takes host memory as the local side of a
    get only once registered), and a last barrier lets the slot be reused. Payloads larger than a slot grow the
    buffer collectively (every PE sees the same lengths, so every PE decides the same)."""

    def __init__(self, nv: Any, drv: Any, capacity: int = 1 << 16) -> None:
        self.nv, self.drv = nv, drv
        self.rank, self.size = nv.my_pe(), nv.n_pes()
        self._lock = threading.RLock()
        self.capacity = capacity
        self.buf = nv.malloc(2 * capacity)  # the slot, then the landing area of gets from unmapped peers

    def _write(self, blob: bytes) -> None:
        host = np.frombuffer(blob, dtype=np.uint8)
        self.drv.memcpy(self.buf, host.__array_interface__["data"][0], len(blob))
        self.drv.stream_synchronize(0)  # a pageable H2D copy may return before its DMA lands

    def _read(self, pe: int, nbytes: int) -> bytes:
        host = np.empty(nbytes, dtype=np.uint8)
        dst = host.__array_interface__["data"][0]
        if pe == self.rank:
            self.drv.memcpy(dst, self.buf, nbytes)
        else:
            peer = self.nv.ptr(self.buf, pe)
            if peer:
                self.drv.memcpy(dst, peer, nbytes)
            else:  # another node: get into symmetric memory, then copy to the host
                self.nv.getmem(self.buf + self.capacity, self.buf, nbytes, pe)
                self.drv.memcpy(dst, self.buf + self.capacity, nbytes)
        return host.tobytes()

    def allgather(self, obj: Any) -> list[Any]:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        header = struct.pack("<Q", len(data))
        # (NVSHMEM's host calls act on the current context: a user's or a Dask worker's thread may have another)
        with self._lock, self.drv.current():
            fits = 8 + len(data) <= self.capacity
            self._write(header + (data if fits else b""))
            self.nv.barrier_all()
            lengths = [struct.unpack("<Q", self._read(pe, 8))[0] for pe in range(self.size)]
            need = 8 + max(lengths)
            if need > self.capacity:
                self.nv.barrier_all()  # every PE has read the lengths
                self.nv.free(self.buf)
                self.buf = 0  # never freed twice (finalize frees self.buf)
                capacity = 1 << (need - 1).bit_length()
                try:
                    self.buf = self.nv.malloc(2 * capacity)
                except MemoryError:  # (a fixed heap's NULL, on every PE alike; a growing heap ends the process
                    # instead, see NVSHMEMSettings) keep a working control plane
                    self.buf = self.nv.malloc(2 * self.capacity)
                    raise
                self.capacity = capacity
                self._write(header + data)
                self.nv.barrier_all()
            out = [pickle.loads(self._read(pe, 8 + n)[8:]) for pe, n in enumerate(lengths)]
            self.nv.barrier_all()  # slots may be overwritten from now on
        return out

    def barrier(self) -> None:
        with self.drv.current():
            self.nv.barrier_all()

    def free(self) -> None:
        if self.buf:
            with self.drv.current():
                self.nv.free(self.buf)
            self.buf = 0


# -- engine -----------------------------------------------------------------------------------------------------
class NVSHMEMEngine(Engine):
    """One GPU per process; symmetric memory on the NVSHMEM heap; reshape by cuFFTMp."""

    name: ClassVar[str] = "nvshmem"
    packages: ClassVar[tuple[str, ...]] = ("cupy", "torch")
    operand_packages: ClassVar[tuple[str, ...]] = ("numpy",)
    requires_symmetric_operands: ClassVar[bool] = True

    def __init__(self, nv: Any, drv: Any, device: int, control: ControlPlane | None, status: int,
                 expected: tuple[int, int] | None = None) -> None:
        self.nv, self.drv, self.device, self.status = nv, drv, device, status
        self.control = control if control is not None else NVSHMEMControl(nv, drv)
        error = None
        if expected is not None and (nv.my_pe(), nv.n_pes()) != expected:
            error = f"NVSHMEM came up as PE {nv.my_pe()} of {nv.n_pes()}, expected {expected[0]} of {expected[1]}"
        try:
            self.settings = NVSHMEMSettings.agreed(self.control, local_error=error)
        except BaseException:
            if control is None:  # every PE raises here together: the collective free is safe
                self.control.free()
            raise
        self.my_pe = nv.my_pe()
        self._allocs: dict[int, int] = {}  # ptr -> nbytes, engine-wide (user and internal)
        self._pool: dict[int, list[int]] = {}  # nbytes -> freed blocks kept for reuse
        self._pool_bytes = 0
        self._plans: list[NVSHMEMReshapePlan] = []
        self._lock = threading.RLock()
        reach = all(self.my_pe == pe or nv.ptr(self._probe(), pe) for pe in range(nv.n_pes()))
        self.peers_mapped = all(self.control.allgather(bool(reach)))

    def _probe(self) -> int:
        ctl = self.control
        if isinstance(ctl, NVSHMEMControl):
            return ctl.buf
        if not hasattr(self, "_probe_buf"):
            self._probe_buf = self.nv.malloc(64)
        return self._probe_buf

    # -- availability and bring-up --------------------------------------------------------------------------
    @classmethod
    def unavailable_reason(cls) -> str | None:
        from ..bindings import LibraryNotFound, cufftmp, extra_hint, nvshmem

        if importlib.util.find_spec("cupy") is None and importlib.util.find_spec("torch") is None:
            return f"the nvshmem backend needs CuPy or torch: {extra_hint()}"
        if nvshmem.library_path() is None:
            return f"NVSHMEM (libnvshmem_host.so.3 from nvidia-nvshmem-cu13/-cu12) is not installed: {extra_hint()}"
        if cufftmp.library_path() is None:
            return f"cuFFTMp (libcufftMp from nvidia-cufftmp-cu13/-cu12) is not installed: {extra_hint()}"
        try:
            from ..bindings.cuda import driver

            if driver().device_count() < 1:
                return "no CUDA device is visible (CUDA_VISIBLE_DEVICES?)"
            nvshmem.load()
            cufftmp.load()
        except (LibraryNotFound, RuntimeError, OSError) as exc:
            return str(exc)
        return None

    @classmethod
    def _bring_up(cls, uid: bytes, rank: int, nranks: int, device: int, control: ControlPlane | None,
                  first_on_host: bool | None = None) -> NVSHMEMEngine:
        def not_initialized(status: int) -> str:
            return f"NVSHMEM did not initialize (status {status}); set NVSHMEM_DEBUG=INFO"

        if control is None:  # no channel to the other PEs before NVSHMEM is up: a local failure raises alone
            # (callers agree on check_uniqueid_bring_up, the same local steps, first)
            drv, nv = _local_steps(device)
            status = nv.init_with_uniqueid(uid, rank, nranks, first_on_host=first_on_host)
            if status < 2:
                raise BackendUnavailableError(not_initialized(status))
        else:
            # a PE that failed alone would leave the others inside NVSHMEM's collective init (or, after it, inside
            # the engine's first exchange): agree on the local steps before it, and on its outcome after it
            error = None
            try:
                drv, nv = _local_steps(device)
            except Exception as exc:  # reported to every PE, never raised alone
                error = f"{type(exc).__name__}: {exc}"
            _raise_unavailable(control.agree(error))
            returned = False
            try:
                status = nv.init_with_uniqueid(uid, rank, nranks, first_on_host=first_on_host)
                returned = True
                if status < 2:
                    error = not_initialized(status)
            except Exception as exc:  # reported to every PE, never raised alone
                error = f"{type(exc).__name__}: {exc}"
            outcomes = control.allgather((error, returned))
            if bad := [(r, e) for r, (e, _) in enumerate(outcomes) if e]:
                raised = [(r, e) for r, (e, came) in enumerate(outcomes) if not came]
                if not raised:  # NVSHMEM came up, even partly, everywhere: down together
                    nv.finalize()
                    _raise_unavailable(bad)
                # where init raised, NVSHMEM's state is unknown: a collective finalize could wait for it forever
                global _left_up_by
                left = [r for r, (_, came) in enumerate(outcomes) if came]
                _left_up_by = f"by a failed bring-up (init raised on rank {raised[0][0]})"
                _raise_unavailable(raised, f". NVSHMEM's init raised there, so it cannot be finalized collectively "
                                           f"and stays as it is on ranks {left}: restart these processes")
        try:
            return cls(nv, drv, device, control, status, expected=(rank, nranks))
        except BaseException:
            nv.finalize()  # no half-initialized NVSHMEM (the engine's bring-up checks fail on every PE together)
            raise

    @classmethod
    def create(cls, *, device_id: int | None = None, communicator: Any) -> NVSHMEMEngine:
        from mpi4py import MPI

        from ..bindings.cuda import driver
        from .mpi import MPIControl

        comm = communicator
        # (first: a process where NVSHMEM was left up must not touch the device again, not even to make rank 0's
        # unique id, and every rank refuses alike)
        everyone = comm.allgather((socket.gethostname(), _left_up_by))
        _raise_unavailable([(r, f"NVSHMEM was left initialized in this process {why}; restart the process")
                            for r, (_, why) in enumerate(everyone) if why])
        hosts = [host for host, _ in everyone]
        apply_env_defaults(single_node=len(set(hosts)) == 1)
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)  # collective: on every rank, whether or not it needs it
        local_rank = local.Get_rank()
        local.Free()
        if device_id is None:
            device_id = local_rank % driver().device_count()
        control = MPIControl(comm)
        error = None
        uid = None
        if comm.Get_rank() == 0:
            try:
                from ..bindings import nvshmem
                from ..bindings.cuda import driver as _drv

                _drv().make_current(device_id)
                uid = nvshmem.load().get_uniqueid()
            except Exception as exc:
                error = f"rank 0 could not make an NVSHMEM unique id: {exc}"
        uid, error = comm.bcast((uid, error), root=0)
        if error:
            control.free()
            raise BackendUnavailableError(error)
        try:
            rank = comm.Get_rank()
            return cls._bring_up(uid, rank, comm.Get_size(), device_id, control,
                                 first_on_host=hosts.index(hosts[rank]) == rank)
        except BaseException:
            control.free()
            raise

    # -- memory ---------------------------------------------------------------------------------------------
    # Freed blocks are kept for reuse (a symmetric pool): allocate/free are collective and run in the same order
    # with the same sizes on every PE, so every PE's pool holds the same blocks and a reused block is symmetric
    # (same heap offset everywhere). This takes nvshmem_malloc/free (collective, with barriers: milliseconds
    # when several PEs share a GPU) out of repeated Reshape.execute() calls. settings.pool_limit
    # (DASK_PGAS_NVSHMEM_POOL_BYTES, agreed at bring-up) caps what is kept.
    @_on_device
    def allocate(self, nbytes: int) -> Allocation:
        self._refuse_if_broken()
        with self._lock:
            blocks = self._pool.get(nbytes)
            if blocks:
                ptr = blocks.pop()
                self._pool_bytes -= nbytes
            else:
                ptr = self._malloc(nbytes)
            self._allocs[ptr] = nbytes
        return Allocation(nbytes=nbytes, ptr=ptr, handle=ptr)

    def _malloc(self, nbytes: int) -> int:
        """Collective ``nvshmem_malloc`` (the caller holds the lock), refused before the call, on every PE alike
        (same blocks, same agreed limit), when it would take the heap past ``settings.heap_limit``; pooled
        blocks are dropped first."""
        if self._held() + nbytes > self.settings.heap_limit and self._pool_bytes:
            self._drain_pool()  # every PE drains at the same point (identical pools)
        if self._held() + nbytes > self.settings.heap_limit:
            why, knob = (("NVSHMEM ends the process past its cap", "NVSHMEM_MAX_MEMORY_PER_GPU")
                         if self.settings.heap_grows else
                         ("the heap is fixed (NVSHMEM_DISABLE_CUDA_VMM)", "NVSHMEM_SYMMETRIC_SIZE"))
            raise MemoryError(
                f"the symmetric heap cannot take {nbytes} more bytes: {self._held()} are allocated and {why} "
                f"(dask_pgas stops at {self.settings.heap_limit}); raise {knob} before initialize(), or use "
                "smaller pieces"
            )
        self._check_device_memory(nbytes)
        try:
            return self.nv.malloc(nbytes)
        except MemoryError:  # a fixed heap (no CUDA VMM) can still return NULL below the limit
            if not self._pool_bytes:
                raise
            self._drain_pool()
            return self.nv.malloc(nbytes)

    def _check_device_memory(self, nbytes: int) -> None:
        """Collective (inside the collective ``_malloc``): refuse, on every PE alike, a heap growth that the GPUs'
        free memory cannot back. NVSHMEM 3.4 maps device memory inside ``nvshmem_malloc`` and, when
        ``cuMemCreate`` fails there, ends the process (its peers too, in the same call: measured on the H200,
        docs/gpu-validation.md round 7). Free memory differs by PE (CuPy and torch pools, other processes), so
        every PE reports its device's and every PE decides from all reports; PEs that share a GPU (same host and
        PCI bus id) need room for all of their blocks together. The check asks room for the whole block and a
        granule: NVSHMEM keeps freed heap memory mapped and may reuse it, so near a full GPU this can refuse a
        block that would have fitted, never the reverse. When short, every PE gives CuPy's and torch's cached
        blocks back and looks once more (dropping the engine's pool would not help: the memory stays mapped)."""
        if not self.settings.heap_grows:
            return  # a fixed heap was mapped whole at bring-up
        need = nbytes + self.settings.granularity  # NVSHMEM maps whole granules
        for attempt in range(2):
            try:
                free, _ = self.drv.mem_get_info()
                mine = (socket.gethostname(), self.drv.pci_bus_id(), free, None)
            except Exception as exc:  # reported to every PE, never raised alone
                mine = (socket.gethostname(), None, 0, f"{type(exc).__name__}: {exc}")
            everyone = self.control.allgather(mine)
            if errors := [(pe, err) for pe, (_, _, _, err) in enumerate(everyone) if err]:
                raise CollectiveError(f"PE {errors[0][0]} cannot read its free device memory: {errors[0][1]}")
            devices: dict[tuple, list[int]] = {}
            for pe, (host, bus, _, _) in enumerate(everyone):
                devices.setdefault((host, bus), []).append(pe)
            free_by = {key: min(everyone[pe][2] for pe in pes) for key, pes in devices.items()}
            short = [(key, pes, free_by[key]) for key, pes in devices.items() if free_by[key] < need * len(pes)]
            if not short:
                return
            if attempt == 0:  # the same decision on every PE: all release, then all look again
                try:
                    _release_package_caches()
                except Exception:  # best effort: a PE that raised here would miss the next allgather
                    pass
        from dask.utils import format_bytes

        (host, bus), pes, free = short[0]
        raise MemoryError(
            f"the GPU {bus} on {host} has {format_bytes(free)} free, and growing the symmetric heap by "
            f"{format_bytes(nbytes)} needs about {format_bytes(need * len(pes))} there (PEs {pes} use it, "
            f"{format_bytes(need)} each with NVSHMEM's granule): free GPU memory (arrays held by CuPy or torch, "
            "other processes), use fewer PEs per GPU, or move smaller pieces"
        )

    def _held(self) -> int:
        """Bytes of NVSHMEM's heap held by this engine: live blocks and pooled ones."""
        return sum(self._allocs.values()) + self._pool_bytes

    @_on_device
    def free(self, allocation: Allocation) -> None:
        self._synchronize_for_free()
        self._release(allocation)

    def _refuse_if_broken(self) -> None:
        if self._broken:
            raise DeviceError(self._broken)

    def _synchronize_for_free(self) -> None:
        """Collective: wait for the device (like ``cudaFree``, no stream may still use memory about to be freed or
        reused) and agree on the outcome, so that a PE whose context holds an error (a kernel's illegal address
        is sticky) raises with every other PE instead of leaving them inside the collective free alone. Then
        every PE raises :class:`DeviceError`, and from then on at every collective call of this engine (with an
        MPI control plane: in a unique-id world the agreement itself goes through the device, so the broken PE
        raises alone and its peers wait for the Dask watchdog; see docs/design.md). The agreement is
        named, so that a PE freeing alone meets the others' other steps as a mismatch, not as a match."""
        self._refuse_if_broken()
        # named like a call (not a step): every PE compares the name, a PE whose synchronize failed too
        if bad := _step_errors(self.control, self.drv.ctx_synchronize,
                               "synchronizing the device before a collective free"):
            self._broken = (f"the device failed on rank {bad[0][0]} before a collective free ({bad[0][1]}); this "
                            "world cannot be used any more: finalize, then restart the processes to use their GPUs")
            raise DeviceError(self._broken)

    def _release(self, allocation: Allocation) -> None:
        """Pool or free ``allocation`` (collective, after :meth:`_synchronize_for_free` on every PE)."""
        with self._lock:
            self._allocs.pop(allocation.handle, None)
            if self._pool_bytes + allocation.nbytes <= self.settings.pool_limit:
                self._pool.setdefault(allocation.nbytes, []).append(allocation.handle)
                self._pool_bytes += allocation.nbytes
                return
        self.nv.free(allocation.handle)

    def _drain_pool(self) -> None:
        """Free the pooled blocks (collective; the pools are alike on every PE)."""
        if not self._pool:
            return
        self._synchronize_for_free()
        with self._lock:
            pool, self._pool, self._pool_bytes = self._pool, {}, 0
        for blocks in pool.values():
            for ptr in blocks:
                self.nv.free(ptr)

    def check_dtype(self, dtype: Any, package: str) -> None:
        super().check_dtype(dtype, package)
        if package == "cupy":
            import cupy

            cupy.ndarray((0,), dtype=np.dtype(dtype))  # CuPy's own dtype check on array creation; allocates nothing
        elif package == "torch":
            import torch

            _torch_dtype(torch, dtype)
        else:
            raise UnsupportedOperandError(f"the nvshmem engine allocates cupy or torch arrays, not {package}")

    def as_array(
        self, allocation: Allocation, shape: Sequence[int], dtype: Any, package: str, order: str = "C"
    ) -> Any:
        shape = tuple(int(n) for n in shape)
        if package == "cupy":
            import cupy

            dt = np.dtype(dtype)
            nbytes = math.prod(shape) * dt.itemsize
            mem = cupy.cuda.UnownedMemory(allocation.ptr, max(nbytes, 1), allocation, device_id=self.device)
            return cupy.ndarray(shape, dtype=dt, memptr=cupy.cuda.MemoryPointer(mem, 0), order=order)
        if package == "torch":
            import torch

            tdt = _torch_dtype(torch, dtype)
            itemsize = torch.empty((), dtype=tdt).element_size()
            count = math.prod(shape)
            keeper = _CAI(allocation.ptr, count * itemsize, allocation)
            raw = torch.as_tensor(keeper, device=f"cuda:{self.device}")  # its storage holds keeper till it dies
            t = raw.view(tdt)
            if order == "F" and len(shape) > 1:
                t = t.view(tuple(reversed(shape))).permute(*reversed(range(len(shape))))
            else:
                t = t.view(shape)
            # keeper: for the registry (alive while any view of the memory is), and the address of an empty t
            t._dask_pgas_keeper = keeper
            if count == 0 and t._base is not None:
                # what views of t report as their _base: its Python object lives only while something holds
                # it, so t does (else the attribute goes with it)
                t._base._dask_pgas_keeper = keeper
                t._dask_pgas_root = t._base
            return t
        raise UnsupportedOperandError(f"the nvshmem engine allocates cupy or torch arrays, not {package}")

    def resolve_stream(self, stream: Any, package: str) -> Any:
        """The raw handle of ``stream`` (default: the package's current stream); None for host operands, which
        are staged with synchronous copies."""
        return None if package == "numpy" else stream_handle(stream, package, self.device)

    def on_heap(self, array: Any) -> bool:
        if isinstance(array, np.ndarray):
            return False
        try:
            ptr = _ptr(array)
        except Exception:
            return False
        return ptr != 0 and self.nv.ptr(ptr, self.my_pe) != 0

    def heap_info(self) -> dict[str, int]:
        with self._lock:
            return {
                "heap_size": parse_size(os.environ.get("NVSHMEM_SYMMETRIC_SIZE")),
                "heap_bytes_in_use": sum(self._allocs.values()),
                "heap_allocations": len(self._allocs),
                "heap_bytes_cached": self._pool_bytes,
                "heap_limit": self.settings.heap_limit,
            }

    # -- reshape --------------------------------------------------------------------------------------------
    @_on_device
    def plan_reshape(self, spec: ReshapeSpec) -> NVSHMEMReshapePlan:
        self._refuse_if_broken()
        plan = NVSHMEMReshapePlan(self, spec)
        with self._lock:
            self._plans.append(plan)
        return plan

    @_on_device
    def finalize(self) -> None:
        """Collective. After a :class:`DeviceError` nothing collective runs on the device (the broken context
        cannot take part): plans and blocks are left, NVSHMEM stays initialized, and a later ``initialize()``
        in this process is refused; the error is raised here when this call is what found it."""
        with self._lock:
            plans, self._plans = list(self._plans), []
        if self._broken:
            self._finalize_broken(plans)
            return
        try:
            self._synchronize_for_free()  # one agreed look at the device before the collective steps below
            for plan in plans:
                plan.free()
            self._drain_pool()
        except DeviceError:  # found here (by any of the agreed steps): on every PE alike
            self._finalize_broken(plans)
            raise
        if getattr(self, "_probe_buf", 0):
            self.nv.free(self._probe_buf)
            self._probe_buf = 0
        try:
            self.drv.stream_synchronize(0)
            self.control.barrier()
        finally:
            self.control.free()
            self.nv.finalize()

    def _finalize_broken(self, plans: list[NVSHMEMReshapePlan]) -> None:
        """``finalize()`` after a :class:`DeviceError`: nothing collective on the device, NVSHMEM left up."""
        global _left_up_by
        _left_up_by = f"after a device error ({self._broken})"
        for plan in plans:
            plan._abandon()
        if not isinstance(self.control, NVSHMEMControl):  # (an MPI communicator: healthy, collective)
            self.control.free()


def _release_package_caches() -> None:
    """Give the blocks CuPy's and torch's allocators keep cached (allocated, unused) back to the device."""
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        cupy.get_default_memory_pool().free_all_blocks()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _local_steps(device: int) -> tuple[Any, Any]:
    """The bring-up's steps before NVSHMEM's collective init, all local: refuse a process where NVSHMEM was left
    up, make ``device`` current (for CuPy and torch too), load NVSHMEM. Returns the driver and the library."""
    from ..bindings import nvshmem
    from ..bindings.cuda import driver

    if _left_up_by:  # (a second init there would wait for PEs that are not in it)
        raise BackendUnavailableError(f"NVSHMEM was left initialized in this process {_left_up_by}; restart the "
                                      "process")
    drv = driver()
    drv.make_current(device)
    _use_device_in_packages(device)
    return drv, nvshmem.load()


def _use_device_in_packages(device: int) -> None:
    cupy = sys.modules.get("cupy")
    if cupy is None and importlib.util.find_spec("cupy") is not None:
        import cupy
    if cupy is not None:
        cupy.cuda.Device(device).use()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.set_device(device)


class NVSHMEMReshapePlan(ReshapePlan):
    """Modes: ``"copy"`` (every rank keeps its box: a device copy), ``"cufftmp"``, ``"peer"`` (device copies
    that push pieces into peer-mapped symmetric memory), chosen identically on every rank."""

    @property
    def drv(self) -> Any:
        """The engine's CUDA driver (as ``engine.drv``: :func:`_on_device` reads it on engines and plans alike)."""
        return self.engine.drv

    def __init__(self, engine: NVSHMEMEngine, spec: ReshapeSpec) -> None:
        from ..geometry.cufftmp_layout import UnsupportedLayout, cufftmp_layout

        self.engine, self.spec = engine, spec
        self._handle = 0
        self._made = False  # Make completed here: Destroy is collective from then on
        self._workspace: Allocation | None = None
        self._stage: tuple[Allocation, Allocation] | None = None
        self._last_stream = 0
        self._freed = False
        item = spec.dtype.itemsize
        self.nbytes_in = spec.input_box.size * item
        self.nbytes_out = spec.output_box.size * item
        self.layout = None
        if all(i == o or (i.is_empty and o.is_empty) for i, o in zip(spec.input_boxes, spec.output_boxes)):
            # every rank keeps its box (or there is nothing at all): a local copy, no collective; cuFFTMp
            # refuses to execute a reshape of an empty domain (CUFFT_INVALID_VALUE, seen on the H200)
            self.mode = "copy"
            _trace(spec.rank, f"plan mode=copy in={spec.input_box} out={spec.output_box}")
            return
        reason = None
        try:
            self.layout = cufftmp_layout(spec.input_boxes, spec.output_boxes, item, spec.order)
        except UnsupportedLayout as exc:
            reason = str(exc)
        settings = engine.settings
        if self.layout is not None and not settings.force_peer and not (self.layout.has_empty
                                                                          and settings.empty_via_peer):
            self.mode = "cufftmp"
        elif engine.peers_mapped:
            self.mode = "peer"
        else:
            if reason is None:  # (a valid layout that a setting sent to peer copies)
                reason = ("DASK_PGAS_NVSHMEM_RESHAPE=peer sends this reshape to peer copies" if settings.force_peer
                          else "DASK_PGAS_EMPTY_VIA_PEER=1 sends this reshape, whose boxes are empty on some ranks, "
                          "to peer copies")
            raise UnsupportedOperandError(f"{reason} (and the peer-copy fallback needs every PE's heap mapped, i.e. "
                                          "one node)")
        _trace(spec.rank, f"plan mode={self.mode} in={spec.input_box} out={spec.output_box} "
                          f"word={self.layout.word_size if self.layout else None}")
        if self.mode == "cufftmp":
            self._set_up_cufftmp()
            ws = max(engine.control.allgather(getattr(self, "_ws_local", 0)))
            _trace(spec.rank, f"plan workspace={ws}")
            if ws:
                try:
                    self._workspace = engine.allocate(ws)
                except (MemoryError, CollectiveError):  # refused on every PE alike (heap cap, GPU memory, an
                    self.free()                           # unreadable free size) before the collective malloc
                    raise

    def _set_up_cufftmp(self) -> None:
        """Create and make the handle (and size its workspace), each step agreed before the next, so no rank
        enters the collective Make alone. On failure every rank raises the same :class:`CollectiveError`, and
        ``free()`` destroys the handles where that cannot hang. cuFFTMp 12 on the H200
        (scripts/gpu/probe_handle.py, docs/gpu-validation.md round 16): Destroy of a handle never made returns at
        once on a rank alone, and so does Destroy after a Make that failed on every rank; a Make refused on one
        rank (a bad box) leaves the others blocked inside it, so the boxes must be valid everywhere: every rank
        computes them from the same agreed layout."""
        control = self.engine.control
        try:
            _agreed(control, "preparing the cuFFTMp reshape", self._create_cufftmp)
            _agreed(control, "planning the cuFFTMp reshape", self._make_cufftmp)
        except CollectiveError:
            made = control.allgather(self._made)  # the same on every rank: they all raise here
            if any(made) and not all(made):
                # Make completed on some ranks only: their handles hold collective state whose Destroy would wait
                # for the ranks without it, and the failed ones' state is unknown. Not seen (a bad Make fails
                # before its collective part, on the H200); every rank leaves its handle.
                self._handle = 0
            self.free()
            raise

    def _create_cufftmp(self) -> None:
        """Local: load cuFFTMp and create the handle."""
        from ..bindings import cufftmp

        self._cf = cufftmp.load()
        self._handle = self._cf.create()

    def _make_cufftmp(self) -> None:
        """Collective (cufftMpMakeReshape); then the local workspace size."""
        cf, lay, me = self._cf, self.layout, self.spec.rank
        lo_i, up_i, st_i = lay.input[me]
        lo_o, up_o, st_o = lay.output[me]
        cf.make(self._handle, lay.word_size, lo_i, up_i, st_i, lo_o, up_o, st_o)
        self._made = True
        ws = cf.workspace_size(self._handle)
        if ws:  # in practice 0; a rank needing one makes every rank allocate the same size
            self._ws_local = ws

    # -- execution ------------------------------------------------------------------------------------------
    def _staging(self) -> tuple[int, int]:
        if self._stage is None:
            size = max(self.spec.max_nbytes, 1)
            first = self.engine.allocate(size)
            try:
                second = self.engine.allocate(size)
            except BaseException:  # refused alike on every PE (agreed inside allocate): every PE frees the first
                self.engine.free(first)
                raise
            self._stage = (first, second)
        return self._stage[0].ptr, self._stage[1].ptr

    @_on_device
    def execute(self, src: Any, dst: Any, *, stream: Any = None, sync_symmetric_memory: bool = True,
                operand_offset: int | None = None) -> None:
        if self._freed:
            raise RuntimeError("this plan was freed")
        self.engine._refuse_if_broken()
        pkg = _package(src)
        if pkg == "numpy":
            self._execute_host(src, dst)
            return
        handle = stream_handle(stream, pkg, self.engine.device)  # (Reshape.execute passes the resolved int)
        self._last_stream = handle
        self._run(_ptr(src), _ptr(dst), handle, sync_symmetric_memory, operand_offset or 0)

    def _execute_host(self, src: np.ndarray, dst: np.ndarray) -> None:
        if self.mode == "copy":
            if self.nbytes_out:  # else both boxes are empty, possibly of different shapes
                np.copyto(dst, src)
            return
        drv, control = self.drv, self.engine.control
        s_in, s_out = self._staging()
        _trace(self.spec.rank, f"execute (host operands) mode={self.mode}")

        def upload() -> None:
            drv.memcpy(s_in, _ptr(src), self.nbytes_in)
            drv.stream_synchronize(0)

        def run_and_download() -> None:
            self._run(s_in, s_out, 0, True)
            drv.stream_synchronize(0)
            drv.memcpy(_ptr(dst), s_out, self.nbytes_out)

        # every rank's input is on the heap before anyone enters the collective _run
        _agreed(control, "copying the reshape input to the GPU", upload)
        _agreed(control, "the reshape", run_and_download)

    def _run(self, src: int, dst: int, stream: int, sync: bool, offset: int = 0) -> None:
        if self.mode == "copy":
            self.drv.memcpy_async(dst, src, self.nbytes_out, stream)
        elif self.mode == "cufftmp":
            word = self.layout.word_size
            if offset % word:
                # a view at an offset inside its allocation: cuFFTMp's kernels move words of this size and need
                # them aligned. Decided by the offset every rank agreed on (not the local pointer: a rank whose
                # piece is empty may pass another view), so every PE takes the same path
                self.refuse_offset(offset)  # (Reshape asked before its agreement already)
                _trace(self.spec.rank, f"execute: pointers not {word}-byte aligned, peer copies")
                self._run_peer(src, dst, stream)
                return
            if sync:
                self.engine.nv.sync_all_on_stream(stream)
            self._cf.execute(self._handle, dst, src, self._workspace.ptr if self._workspace else 0, stream)
        else:
            self._run_peer(src, dst, stream)

    @property
    def operand_alignment(self) -> int:
        return self.layout.word_size if self.mode == "cufftmp" else 1

    def refuse_offset(self, offset: int) -> None:
        """An operand off cuFFTMp's word boundary takes the peer copies, which need every peer's heap mapped."""
        word = self.operand_alignment
        if offset % word and not self.engine.peers_mapped:
            raise UnsupportedOperandError(
                f"the operand starts {offset % word} bytes past a {word}-byte boundary, and cuFFTMp moves "
                f"{word}-byte words here; pass a view that starts at a multiple of {word} bytes into its "
                "allocation (or the allocation itself)")

    def _run_peer(self, src: int, dst: int, stream: int) -> None:
        """Device copies that push each piece of this PE's input into its output PE's ``dst``, through that PE's
        mapped heap. Peers are addressed through ``dst``, which is at the same place of the heap on every PE (a
        block made collectively: the plan's staging, a Reshape result, the Dask buffers), never through ``src``:
        a PE whose input is empty may pass a view anywhere, and reads nothing."""
        spec, eng = self.spec, self.engine
        item = spec.dtype.itemsize

        def bounds(box: Box) -> Box:
            return box if spec.order == "C" else Box(box.lower[::-1], box.upper[::-1])

        my_in = bounds(spec.input_box)
        eng.nv.sync_all_on_stream(stream)
        try:
            with _StreamContext(stream, eng.device):
                in_view = None
                for pe, out_box in enumerate(spec.output_boxes):
                    out_box = bounds(out_box)
                    if out_box.is_empty or my_in.is_empty:
                        continue
                    piece = my_in.intersection(out_box)
                    if piece is None:
                        continue
                    if in_view is None:
                        in_view = _word_view(src, my_in.box_shape, item, eng.device)
                    base = dst if pe == spec.rank else eng.nv.ptr(dst, pe)
                    out_view = _word_view(base, out_box.box_shape, item, eng.device)
                    _copy(out_view[piece.relative_to(out_box)], in_view[piece.relative_to(my_in)])
        finally:
            # a PE reads its output only once every push into it is done; a PE whose copies failed still takes
            # part (the others' streams wait for it here), then raises
            eng.nv.sync_all_on_stream(stream)

    def synchronize(self, stream: Any = None) -> None:
        handle = self._last_stream if stream is None else stream_handle(stream)
        self.drv.stream_synchronize(handle)

    def _abandon(self) -> None:
        """Freed without touching the device (after a :class:`DeviceError`): the handle and blocks are left."""
        self._freed, self._handle, self._workspace, self._stage = True, 0, None, None

    @_on_device
    def free(self) -> None:
        if self._freed:
            return
        self._freed = True
        eng = self.engine
        with eng._lock:
            if self in eng._plans:
                eng._plans.remove(self)
        # a made handle on every PE or on none (_set_up_cufftmp); one never made is destroyed locally
        error, collective = None, bool(self._handle) and self._made
        if collective or self._workspace is not None or self._stage is not None:  # alike on every PE
            eng._synchronize_for_free()  # on failure every PE raises here, before any collective step
        if self._handle:
            handle, self._handle = self._handle, 0
            try:
                self._cf.destroy(handle)
            except Exception as exc:  # the buffers below are freed on every PE all the same (collective frees)
                error = f"{type(exc).__name__}: {exc}"
                if not collective:  # only a failed set-up gets here, and raises its agreed error on every rank
                    warnings.warn(f"destroying an unmade cuFFTMp handle failed: {error}", RuntimeWarning,
                                  stacklevel=2)
        if self._workspace is not None:
            eng._release(self._workspace)
            self._workspace = None
        if self._stage is not None:
            for a in self._stage:
                eng._release(a)
            self._stage = None
        if collective and (bad := eng.control.agree(error)):
            raise CollectiveError(f"destroying the cuFFTMp reshape failed on rank {bad[0][0]}: {bad[0][1]}")


def _raise_unavailable(bad: list[tuple[int, str]], more: str = "") -> None:
    """Raise, on every PE alike, the first failure of an agreed bring-up step (``control.agree``'s list)."""
    if bad:
        raise BackendUnavailableError(f"the nvshmem engine cannot start on rank {bad[0][0]}: {bad[0][1]}{more}")


#: why NVSHMEM stays initialized in this process, after a failed bring-up or a device error (None: it does not)
_left_up_by: str | None = None


def _trace(rank: int, msg: str) -> None:
    """``DASK_PGAS_NVSHMEM_TRACE=1``: diagnostic lines for plans and executions on stderr (diagnosing hangs)."""
    if os.environ.get("DASK_PGAS_NVSHMEM_TRACE") == "1":
        print(f"[dask_pgas nvshmem pe {rank}] {msg}", file=sys.stderr, flush=True)


def _step_errors(control: ControlPlane, step: Callable[[], Any], call: str | None = None) -> list[tuple[int, str]]:
    """Run ``step`` on every rank and agree on the outcome (``control.agree``, named ``call`` when given): the
    ranks whose step failed, with their errors, the same list everywhere; empty when it passed on every rank."""
    error = None
    try:
        step()
    except Exception as exc:  # reported to all ranks, never raised alone
        error = f"{type(exc).__name__}: {exc}"
    return control.agree(error, call)


def _agreed(control: ControlPlane, what: str, step: Callable[[], Any]) -> None:
    """Run ``step`` on every rank, then raise the same :class:`CollectiveError` everywhere if it failed on any rank.
    A rank whose step failed must not go on to a collective alone: agree before each one."""
    if bad := _step_errors(control, step):
        raise CollectiveError(f"{what} failed on rank {bad[0][0]}: {bad[0][1]}")


# -- bring-up without MPI ---------------------------------------------------------------------------------------
def get_nvshmem_uniqueid(device_id: int | None = None, *, single_node: bool | None = None) -> bytes:
    """A fresh NVSHMEM unique id (128 bytes) for :func:`initialize_from_uniqueid`.

    Call it in the process that will be rank 0 (NVSHMEM starts the bootstrap listener in this process), then
    hand the bytes to every rank by any channel and call :func:`initialize_from_uniqueid` everywhere (rank 0
    included). It first sets NVSHMEM's environment defaults (:func:`apply_env_defaults`): among them
    ``NVSHMEM_DISABLE_NVLS=1`` unless the user set it to ``0``, and with ``single_node=True``
    ``NVSHMEM_REMOTE_TRANSPORT=none`` and ``NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo`` where the user has not set them.
    """
    apply_env_defaults(single_node)
    # (the bring-up's local steps: refused where NVSHMEM was left up, as every bring-up is)
    _, nv = _local_steps(0 if device_id is None else device_id)
    return nv.get_uniqueid()


def check_uniqueid_bring_up(
    rank: int, nranks: int, device_id: int | None = None, *, single_node: bool | None = None
) -> int:
    """The local steps of :func:`initialize_from_uniqueid`, without its collective init: raise here when this
    process cannot take part (NVSHMEM already up or left up, no such device, the library does not load).

    NVSHMEM's unique-id init has no agreement before it: a rank that fails alone leaves the others waiting inside
    it. Call this on every rank, agree over the channel that carries the id, and only then initialize.
    Returns the CUDA device the rank will use.
    """
    from .. import runtime
    from ..bindings.cuda import driver

    if not 0 <= rank < nranks:
        raise ValueError(f"rank {rank} is not in range({nranks})")
    if NVSHMEMEngine.name in runtime.initialized_backends():  # before NVSHMEM is touched: nothing to undo
        raise RuntimeStateError(
            f"backend {NVSHMEMEngine.name!r} is already initialized; call finalize() first"
        )
    apply_env_defaults(single_node)
    if device_id is None:
        device_id = rank % driver().device_count()
    _local_steps(device_id)
    return device_id


def initialize_from_uniqueid(
    uid: bytes, rank: int, nranks: int, device_id: int | None = None, *, single_node: bool | None = None,
    first_on_host: bool | None = None,
) -> None:
    """Bring up the ``"nvshmem"`` backend from a unique id delivered by other means (collective over the
    ``nranks`` processes; no MPI needed). The control plane then runs on NVSHMEM itself.

    Args:
        uid: bytes from :func:`get_nvshmem_uniqueid` (made in rank 0's process).
        rank, nranks: this process's PE number and the number of PEs.
        device_id: CUDA device (default ``rank`` modulo the visible devices).
        single_node: all ranks on one host: set the single-node NVSHMEM defaults.
        first_on_host: this rank is the lowest of the ranks on its host (default: rank 0 is, no other is). That
            rank holds the host lock (:func:`dask_pgas.bindings.nvshmem.host_lock`) through NVSHMEM's init, which
            keeps two jobs' inits on one host apart; give it on every rank when the ranks span several hosts.

    NVSHMEM's init has no agreement before it: a rank whose local steps fail here raises alone and leaves the
    others inside the init. Where the ranks can talk, run :func:`check_uniqueid_bring_up` on every rank first
    and call this only when all of them passed (as :func:`dask_pgas.bootstrap` does).
    """
    from .. import runtime

    device_id = check_uniqueid_bring_up(rank, nranks, device_id, single_node=single_node)
    engine = NVSHMEMEngine._bring_up(bytes(uid), rank, nranks, device_id, None, first_on_host)
    runtime.install_engine(engine)
