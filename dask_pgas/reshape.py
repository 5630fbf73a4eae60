"""Distributed reshape: change which rank holds which box of a global array.

Mirrors ``nvmath.distributed.reshape``: a stateful :class:`Reshape` (plan once, execute many times, free) and
the function form :func:`reshape`. Every rank passes its own operand and its own input and output boxes (or
a :class:`~dask_pgas.distribution.Slab` on every rank, whose boxes follow from the operands' shapes).
nvmath 1.0 renamed them ``nvmath.distributed.distribution.Redistribute`` / ``redistribute`` /
``RedistributeOptions``: those names are here too (also importable from :mod:`dask_pgas.distribution`).

All checks are collective: each rank describes its call, the descriptions are exchanged, and every rank runs
the same checks on the same data, so every rank raises the same exception and none is left waiting.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, fields
from typing import Any, Literal

import numpy as np

from . import errors
from . import runtime as _runtime
from ._arrays import array_info, from_host_view, host_view, is_host_tensor, package_of
from .distribution import Box, Slab
from .engines.base import Engine, ReshapePlan, ReshapeSpec
from .errors import (
    BackendUnavailableError,
    DeviceError,
    DistributionError,
    NotSymmetricMemoryError,
    OperandMismatchError,
    PackageUnavailableError,
    RuntimeStateError,
    SymmetricMemoryError,
    UnsupportedOperandError,
    carried_name,
)
from .geometry.boxes import bounding_box, tiling_error
from .memory import _allocate_internal, _allocation_of, _heap_position, _is_live, _was_freed, is_symmetric_memory
from .runtime import _control_plane, engine_for_package

__all__ = ["Redistribute", "RedistributeOptions", "Reshape", "ReshapeOptions", "redistribute", "reshape"]

_log = logging.getLogger("dask_pgas.reshape")


@dataclass
class ReshapeOptions:
    """Options of a reshape.

    Attributes:
        logger: where the object's steps are logged, at INFO as ``nvmath.distributed`` logs them: creation (global
            shape, dtype, package, boxes, engine), planning and its time, each ``execute()`` and its time, the
            release. Default: the ``dask_pgas.reshape`` logger, whose records reach the root logger's handlers
            (``logging.basicConfig(level=logging.INFO)`` shows them).
        blocking: ``True`` waits for completion; ``"auto"`` blocks for host operands and is stream-ordered
            (returns at once) for GPU operands.
    """

    logger: logging.Logger | None = None
    blocking: bool | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        if self.blocking not in (True, False, "auto"):
            raise ValueError(f"blocking must be True, False or 'auto', not {self.blocking!r}")
        # (nvmath checks nothing: any object with the Logger methods called here is used as it is)
        if self.logger is not None and not all(callable(getattr(self.logger, m, None)) for m in _LOGGER_METHODS):
            raise TypeError(f"logger must be a logging.Logger or have its methods {', '.join(_LOGGER_METHODS)} "
                            f"(or be None), not {type(self.logger).__name__}")


_OPTION_FIELDS = tuple(f.name for f in fields(ReshapeOptions))
_LOGGER_METHODS = ("debug", "info", "isEnabledFor")  # what the Reshape object calls


def _options(options: ReshapeOptions | dict | None) -> ReshapeOptions:
    """Local: the parsed options (raises ValueError/TypeError; the caller agrees on the error collectively)."""
    if options is None:
        return ReshapeOptions()
    if isinstance(options, dict):
        unknown = sorted(str(k) for k in options if k not in _OPTION_FIELDS)
        if unknown:
            raise TypeError(f"unknown ReshapeOptions field(s) {unknown}; the fields are {list(_OPTION_FIELDS)}")
        return ReshapeOptions(**options)
    if isinstance(options, ReshapeOptions):
        options._validate()  # fields may have been assigned after construction
        return options
    raise TypeError(f"options must be a ReshapeOptions or a dict, not {type(options).__name__}")


_NO_OPERAND: Any = object()  # no operand waits to be checked (see Reshape.reset_operand_unchecked)


def _count_alone() -> int:
    """What ``sys.getrefcount`` says of an object that only a list refers to, asked as
    :meth:`Reshape._recycled_result` asks (Python 3.14 counts fewer references on the stack than before)."""
    pool = [object()]
    i = 0
    return sys.getrefcount(pool[i])


_ALONE = _count_alone() if hasattr(sys, "getrefcount") else 0

_FREED_OPERAND = (
    "the operand was freed with free_symmetric_memory(); its memory may belong to another allocation now"
)


# exceptions that a description may carry from one rank to all (by name, so nothing is unpickled blindly; a
# subclass of one travels as it: errors.carried_name)
_RAISABLE = {
    cls.__name__: cls
    for cls in (
        DistributionError, UnsupportedOperandError, OperandMismatchError, SymmetricMemoryError,
        NotSymmetricMemoryError, BackendUnavailableError, PackageUnavailableError, RuntimeStateError, DeviceError,
        TypeError, ValueError, MemoryError,
    )
}


def _raise_first(descs: list[dict]) -> None:
    for rank, d in enumerate(descs):
        if d["error"] is not None:
            name, msg = d["error"]
            raise _RAISABLE.get(name, errors.CollectiveError)(f"rank {rank}: {msg}")


def _by_rank(values: list[Any]) -> str:
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))


def _agree(
    control: Any,
    error: tuple[type[BaseException], str] | None,
    call: str | None = None,
    same: tuple[str, Any] | None = None,
) -> None:
    """Collective: raise the first failing rank's error on every rank, or return on all of them.

    One ``ControlPlane.agree`` naming ``call`` (on the MPI engine one ``Allreduce`` of three integers; the
    messages travel only on failure). Every collective method opens with it, so a rank that skipped a call or
    made another (``plan()`` on one rank only) meets its peers at the next agreement and all raise
    :class:`~dask_pgas.errors.CollectiveMismatchError`, naming each rank's call and its local error if any.
    Steps inside a call (``call=None``) agree on local work that could fail on one rank only."""
    bad = control.agree(None if error is None else f"{carried_name(error[0], _RAISABLE)}: {error[1]}", call, same)
    if bad:
        rank, text = bad[0]
        name, _, msg = text.partition(": ")
        raise _RAISABLE.get(name, errors.CollectiveError)(f"rank {rank}: {msg}")


def _f_strided(array: np.ndarray) -> bool:
    """Whether a host array that is neither C- nor F-contiguous has increasing strides (an F-ordered array's
    strided view: ``np.asfortranarray(a)[::2]``), over the axes longer than one."""
    if array.flags.c_contiguous or array.flags.f_contiguous:
        return False
    strides = [abs(s) for s, n in zip(array.strides, array.shape) if n > 1]
    return strides == sorted(strides)


def _distribution(value: Any) -> Box | Slab:
    """A Slab as it is; a Box or a ``(lower, upper)`` pair as a Box."""
    return value if isinstance(value, Slab) else Box.from_any(value)


def _differing_ndims(ndims: list[int]) -> DistributionError:
    return DistributionError(f"boxes differ in dimensionality across ranks ({_by_rank(ndims)})")


def _resolve_slabs(descs: list[dict]) -> None:
    """Every rank's boxes for the Slab sides, worked out alike on every rank from every rank's description (it
    raises the same :class:`DistributionError` on all of them). A Slab input infers the global shape from the
    operands (the partition axis summed, the other extents equal); a Slab output splits the input's domain."""
    n = len(descs)
    for side, what in (("in", "input"), ("out", "output")):
        slabs = [d.get(f"{side}_slab") for d in descs]
        if any(slabs) and (not all(slabs) or len({s[0] for s in slabs}) > 1):
            names = [repr(Slab(*s)) if s else "Box" for s in slabs]
            raise DistributionError(f"the {what} distributions differ across ranks ({_by_rank(names)})")
    if descs[0].get("in_slab"):
        slab = Slab(descs[0]["in_slab"][0])
        shapes = [d["shape"] for d in descs]
        if len({len(sh) for sh in shapes}) > 1:
            raise DistributionError(f"the operands differ in dimensionality across ranks ({_by_rank(shapes)})")
        axis = slab.partition_dim
        if axis >= len(shapes[0]):
            raise DistributionError(f"{slab!r} splits axis {axis}; the operands are {len(shapes[0])}-D")
        if len({sh[:axis] + sh[axis + 1:] for sh in shapes}) > 1:
            raise DistributionError(
                f"the operands of {slab!r} must have the same extents off axis {axis} on every rank "
                f"({_by_rank(shapes)})"
            )
        whole = list(shapes[0])
        whole[axis] = sum(sh[axis] for sh in shapes)
        boxes = [slab.box(r, n, whole) for r in range(n)]
        if wrong := [r for r in range(n) if boxes[r].box_shape != shapes[r]]:
            raise DistributionError(
                f"the operands are no {slab!r} of a global array of shape {tuple(whole)}: "
                + "; ".join(f"rank {r} holds {shapes[r]}, its slab is {boxes[r].box_shape}" for r in wrong)
                + (f" (the first {whole[axis] % n} ranks hold one index more than the others on axis {axis})"
                   if whole[axis] % n else f" (every rank holds {whole[axis] // n} on axis {axis})")
            )
        for d, b in zip(descs, boxes):
            d["in"] = (b.lower, b.upper)
    if descs[0].get("out_slab"):
        slab = Slab(descs[0]["out_slab"][0])
        ins = [Box(*d["in"]) for d in descs]
        if len({b.ndim for b in ins}) > 1:  # (before the slab is worked out from them; _check_global's check)
            raise _differing_ndims([b.ndim for b in ins])
        full = [b for b in ins if not b.is_empty]
        if full and (start := bounding_box(full).lower) != (0,) * len(start):
            raise DistributionError(
                f"a {slab!r} output splits a global array from the origin; the input boxes start at {start}"
            )
        whole = tuple(max(b.upper[k] for b in (full or ins)) for k in range(ins[0].ndim))
        if slab.partition_dim >= len(whole):
            raise DistributionError(f"{slab!r} splits axis {slab.partition_dim}; the array is {len(whole)}-D")
        for r, d in enumerate(descs):
            b = slab.box(r, n, whole)
            d["out"] = (b.lower, b.upper)


def _kind(operand: Any) -> str | None:
    """What the ranks compare for an operand's package: ``numpy``, ``cupy``, ``torch`` (on the GPU) or
    ``torch (CPU)`` (moved as its NumPy view); None for no array."""
    return "torch (CPU)" if is_host_tensor(operand) else package_of(operand)


def _dtype_name(operand: Any, dtype: np.dtype) -> Any:
    """What the ranks compare for an operand's dtype: a torch dtype's own name (NumPy sees both float8 types as
    ``V1``), else the NumPy dtype's string (fields in full for structured dtypes: their ``descr``, or their string
    where NumPy has no ``descr``, for fields out of offset order or overlapping)."""
    if package_of(operand) == "torch":
        return str(operand.dtype)
    if dtype.fields:
        try:
            return dtype.descr
        except ValueError:
            pass
    return str(dtype)


def _check_positions(positions: list[tuple[int, int] | None]) -> None:
    """GPU engines address a peer's operand at this rank's symmetric address: every rank's non-empty symmetric
    operand must start at the same place of the same allocation (not, say, different slices of one array).
    ``None``: empty, or in no allocation this registry knows (nothing to compare)."""
    if len({p for p in positions if p is not None}) > 1:
        where = "; ".join(
            f"rank {r}: " + (f"allocation #{p[0]} + {p[1]} bytes" if p else "empty or not from this registry")
            for r, p in enumerate(positions)
        )
        raise SymmetricMemoryError(
            f"the symmetric operands start at different places of the symmetric heap ({where}); the GPU reshape "
            "finds each peer's operand at this rank's address: pass the same allocation (at the same offset) on "
            "every rank"
        )


def _common_offset(positions: list[tuple[int, int] | None]) -> int | None:
    """The byte offset into its allocation at which every rank's non-empty symmetric operand starts (agreed by
    :func:`_check_positions`), or None: the same on every rank, so engines may decide collective steps by it."""
    return next((p[1] for p in positions if p is not None), None)


class Reshape:
    """A planned redistribution of ``operand`` from ``input_box`` to ``output_box`` (all ranks call it).

    Args:
        operand: this rank's piece: a NumPy array or torch CPU tensor (any rank count, MPI or staged through the
            GPU), or a CuPy array / torch CUDA tensor on the symmetric heap (``"nvshmem"`` backend). Its shape is
            the input box's.
        input_box: the part of the global array this rank holds (a :class:`Box` or a ``(lower, upper)`` pair), or
            a :class:`~dask_pgas.distribution.Slab` on every rank (the global shape is then inferred from the
            operands, and each rank's operand must have its slab's shape).
        output_box: the part this rank will hold after the reshape (a Box, or a Slab on every rank).
        options: :class:`ReshapeOptions` or a dict of its fields; ``blocking`` must be the same on every rank.
        stream: accepted for ``nvmath.distributed`` compatibility (nvmath orders the constructor's own copy of a
            host operand on it; this constructor makes none). As in nvmath, :meth:`execute` runs on the stream
            given to it, else on the operand package's current stream at that call; :meth:`plan` takes one too,
            and launches no stream work here.

    The result of :meth:`execute` is a new array of the output box's shape, of the operand's package (a torch CPU
    tensor for a torch CPU operand, which is moved as its NumPy view), in the plan's memory order: F where every
    rank's operand is F-ordered, else C. When the operand is symmetric memory the result is symmetric memory too
    (padded to the largest output box) and must be freed with :func:`dask_pgas.free_symmetric_memory`.

    :meth:`plan`, :meth:`reset_operand` and :meth:`execute` agree on their preconditions across ranks before any
    collective step, so a misuse on one rank (``execute()`` after ``free()`` or :meth:`release_operand`, with a
    freed symmetric operand) raises the same exception on every rank. Each collective call opens by naming
    itself and its object (``Reshape#3.execute()``, numbered in creation order per world, alike on every rank): ranks
    in different calls (``execute()`` before ``plan()`` on one rank, or on another object) all raise
    :class:`~dask_pgas.errors.CollectiveMismatchError`. After
    :func:`dask_pgas.finalize` they raise :class:`RuntimeStateError`; :meth:`release_operand` and :meth:`free`
    stay usable.
    """

    def __init__(
        self,
        operand: Any,
        /,
        input_box: Box | Any,
        output_box: Box | Any,
        *,
        options: ReshapeOptions | dict | None = None,
        stream: Any = None,
    ) -> None:
        self._plan: ReshapePlan | None = None
        self._results: list[Any] = []
        self._freed = False
        self._released: str | bool = False  # or what dropped the operand
        self._pending: Any = _NO_OPERAND
        control = _control_plane()
        desc, engine, parsed = self._describe(operand, input_box, output_box, options)
        control.agree(None, "Reshape()")  # every rank is in this call, or all raise
        # numbered alike on every rank of this world (one count for Reshape and Redistribute objects)
        # (one name for both classes: a Redistribute on some ranks and a Reshape on others are one object)
        self._name = f"Reshape#{control.number('Reshape') + 1}"
        np_dtype = desc.pop("np_dtype", None)  # local only (a dtype's metadata may not even pickle)
        descs = control.allgather(desc)
        _raise_first(descs)
        _resolve_slabs(descs)
        self._check_global(descs)
        self.options: ReshapeOptions = parsed
        self.logger = self.options.logger or _log
        self._engine: Engine = engine
        self._label: str = desc["package"]  # what the user passed: "numpy", "cupy", "torch", "torch (CPU)"
        # torch CPU operands are reshaped as their NumPy views, and the results viewed back as tensors; a torch
        # operand's own dtype types its results (NumPy sees bfloat16 and the float8 types as raw bytes only)
        self._host_tensor: bool = desc["host_tensor"]
        self._tensor_dtype: Any = operand.dtype if desc["package"] in ("torch", "torch (CPU)") else None
        self._dtype_name = desc["dtype"]
        self._package: str = "numpy" if desc["host"] else desc["package"]  # the engines' view of the operand
        self._symmetric: bool = desc["symmetric"]
        self._offset: int | None = _common_offset([d["position"] for d in descs])
        self._spec = ReshapeSpec(
            input_boxes=tuple(Box(*d["in"]) for d in descs),
            output_boxes=tuple(Box(*d["out"]) for d in descs),
            dtype=np_dtype,
            order=self._order(descs),
            rank=control.rank,
        )
        # _source: the user's array; _operand: the same array (a torch CPU tensor's NumPy view), or its copy in the
        # plan's memory order (_copied), refreshed from _source at every execute (so in-place updates of the
        # user's array count on every rank alike)
        self._source: Any = operand
        self._operand: Any = self._local(operand)
        self._copied = False
        if not all(d["c"] if self._spec.order == "C" else d["f"] for d in descs):
            # some rank copies its operand into the plan's order: a failure there (no memory) reaches every rank
            error = None
            try:
                self._operand = self._conform(self._operand)
                self._copied = not desc[self._spec.order.lower()]
            except Exception as exc:
                error = (type(exc), str(exc))
            _agree(control, error)
        # the registered allocation holding the operand, if any: checked at each execute (its address alone could
        # belong to a newer allocation once it is freed)
        self._tracked = _allocation_of(operand)
        if self.logger.isEnabledFor(logging.INFO):  # (the global shape is worked out only for the log)
            domain = bounding_box(self._spec.input_boxes)
            self.logger.info(
                "%s (rank %d of %d): global shape %s, %s %s operand%s, %s -> %s, order %s, on the %s engine: created",
                self._name, control.rank, self._spec.nranks, domain.box_shape if domain else "(empty)",
                self._label, self._spec.dtype, " (symmetric memory)" if self._symmetric else "",
                self._spec.input_box, self._spec.output_box, self._spec.order, engine.name,
            )

    # -- collective validation ------------------------------------------------------------------------------
    @staticmethod
    def _describe(
        operand: Any, input_box: Any, output_box: Any, options: Any = None
    ) -> tuple[dict, Engine | None, ReshapeOptions | None]:
        kind = _kind(operand)
        host_tensor = kind == "torch (CPU)"
        desc: dict[str, Any] = {"error": None, "in": None, "out": None, "host_tensor": host_tensor, "package": kind}
        engine, parsed = None, None
        try:
            parsed = _options(options)
            desc["blocking"] = parsed.blocking
            # a Box is this rank's piece; a Slab's boxes follow from every rank's operand shape (resolved after
            # the exchange, alike on every rank)
            ibox, obox = _distribution(input_box), _distribution(output_box)
            for side, dist in (("in", ibox), ("out", obox)):
                if isinstance(dist, Slab):
                    desc[f"{side}_slab"] = (dist.partition_dim, dist.ndim)
                else:
                    desc[side] = (dist.lower, dist.upper)
            if desc["package"] is None:
                raise UnsupportedOperandError(
                    f"operand must be a numpy.ndarray, cupy.ndarray or torch.Tensor, not {type(operand).__name__}"
                )
            if _was_freed(operand):  # its memory may belong to another allocation now
                raise SymmetricMemoryError(_FREED_OPERAND + ": pass a live array")
            # a torch CPU tensor is moved as its NumPy view: never symmetric memory, its result an ordinary tensor
            info = array_info(host_view(operand) if host_tensor else operand)
            engine = engine_for_package(info.package)
            desc.update(  # (a torch operand's dtype by its torch name: NumPy sees both float8 types as V1)
                dtype=_dtype_name(operand, info.dtype), np_dtype=info.dtype,
                c=info.c_contiguous, f=info.f_contiguous, host=info.package == "numpy",
                f_strided=info.package == "numpy" and _f_strided(host_view(operand) if host_tensor else operand),
                symmetric=not host_tensor and (engine.on_heap(operand) or is_symmetric_memory(operand)),
            )
            desc["position"] = _heap_position(operand) if desc["symmetric"] else None
            if info.dtype.hasobject:
                raise UnsupportedOperandError("object arrays cannot be reshaped across processes")
            desc["shape"] = tuple(info.shape)
            ndims = {d.ndim for d in (ibox, obox) if d.ndim is not None}
            if len(ndims) > 1:
                raise DistributionError(f"input {ibox} and output {obox} differ in dimensionality")
            if ndims and len(info.shape) not in ndims:
                raise DistributionError(f"the operand is {len(info.shape)}-D; the distributions are {ndims.pop()}-D")
            if isinstance(ibox, Box) and tuple(info.shape) != ibox.box_shape:
                raise DistributionError(
                    f"operand shape {tuple(info.shape)} does not match its input box {ibox} (shape {ibox.box_shape})"
                )
            on_gpu = engine.requires_symmetric_operands and info.package in engine.packages
            if on_gpu and not desc["symmetric"]:
                raise NotSymmetricMemoryError(
                    f"the {info.package} operand is not on the symmetric heap; allocate it with "
                    "dask_pgas.allocate_symmetric_memory (or copy it there)"
                )
            if on_gpu and not (info.c_contiguous or info.f_contiguous):
                raise UnsupportedOperandError(
                    "a non-contiguous GPU operand cannot be reshaped in place; pass a contiguous symmetric array"
                )
        except Exception as exc:  # every local failure is reported to all ranks, never raised alone
            desc["error"] = (carried_name(type(exc), _RAISABLE), str(exc))
        return desc, engine, parsed

    @staticmethod
    def _check_global(descs: list[dict]) -> None:
        blocking = [d.get("blocking", "auto") for d in descs]
        if any(b != blocking[0] for b in blocking):
            raise ValueError(f"options are inconsistent across processes (blocking: {_by_rank(blocking)})")
        ndims = [len(d["in"][0]) for d in descs] + [len(d["out"][0]) for d in descs]
        if len(set(ndims)) > 1:
            raise _differing_ndims(ndims[: len(descs)])
        for key, what in (("package", "array packages"), ("dtype", "dtypes")):
            values = [d[key] for d in descs]
            if any(v != values[0] for v in values):
                raise OperandMismatchError(f"operands have different {what} across ranks ({_by_rank(values)})")
        sym = [d["symmetric"] for d in descs]
        if any(sym) and not all(sym):
            raise SymmetricMemoryError(
                "the operand is symmetric memory on ranks "
                f"{[r for r, s in enumerate(sym) if s]} but not on ranks {[r for r, s in enumerate(sym) if not s]}; "
                "pass symmetric memory on every rank or on none"
            )
        if all(sym) and not descs[0]["host"]:
            _check_positions([d["position"] for d in descs])
        ins = [Box(*d["in"]) for d in descs]
        outs = [Box(*d["out"]) for d in descs]
        for boxes, what in ((ins, "input boxes"), (outs, "output boxes")):
            msg = tiling_error(boxes, what)
            if msg:
                raise DistributionError(msg)
        din, dout = bounding_box(ins), bounding_box(outs)
        if din != dout:
            raise DistributionError(
                f"input boxes cover {din} but output boxes cover {dout}: both must tile the same global domain"
            )
        order = Reshape._order(descs)
        dense = [d["c"] if order == "C" else d["f"] for d in descs]
        if not descs[0]["host"] and not all(dense):
            # host operands are copied into the order; GPU operands cannot be, and one rank alone must not raise
            raise OperandMismatchError(  # (a ValueError, as nvmath's for layouts that differ across processes)
                f"GPU operands must all be {order}-contiguous; they are not on ranks "
                f"{[r for r, ok in enumerate(dense) if not ok]}"
            )

    @staticmethod
    def _order(descs: list[dict]) -> str:
        """The plan's memory order: C where every operand is C-contiguous, else F where every one is F-contiguous
        or a strided view laid out as F (increasing strides, as nvmath tells F from C), else C."""
        if all(d["c"] for d in descs):
            return "C"
        if all(d["f"] or d.get("f_strided") for d in descs):
            return "F"
        return "C"

    def _local(self, operand: Any) -> Any:
        """What the engine moves: the operand itself, or a torch CPU tensor's NumPy view (no copy)."""
        return host_view(operand) if self._host_tensor else operand

    def _conform(self, operand: Any) -> Any:
        """The (local) operand in the plan's memory order (a copy only for host operands in another layout)."""
        info = array_info(operand)
        dense = info.c_contiguous if self._spec.order == "C" else info.f_contiguous
        if dense:
            return operand
        if self._package != "numpy":
            raise UnsupportedOperandError(f"GPU operand is not {self._spec.order}-contiguous like the other ranks'")
        return np.asarray(operand, order=self._spec.order)

    # -- local state checks ---------------------------------------------------------------------------------
    def _operand_mismatch(self) -> str | None:
        """Local, before ``execute``'s agreement: why the operand no longer fits the plan (a NumPy array's shape,
        dtype and strides can be changed in place), or None."""
        try:
            info = array_info(self._source)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        spec = self._spec
        if (info.shape != spec.input_box.box_shape or info.dtype != spec.dtype
                or (self._tensor_dtype is not None and self._source.dtype != self._tensor_dtype)):
            return (f"the operand was changed in place to shape {info.shape} and dtype "
                    f"{_dtype_name(self._source, info.dtype)}; the plan needs {spec.input_box.box_shape} and "
                    f"{self._dtype_name}")
        if not self._copied and not (info.c_contiguous if spec.order == "C" else info.f_contiguous):
            return f"the operand is no longer {spec.order}-contiguous, as it was when planned"
        return None

    def _runtime_error(self) -> str | None:
        """Local: why the plan's engine is no longer the runtime's, or None (``finalize`` is collective, so every
        rank reaches the same verdict without an exchange; an exchange would use the freed communicator)."""
        if not any(e is self._engine for e in _runtime._engines.values()):
            return "the runtime was finalized; create a new Reshape"
        if not _runtime.is_initialized():
            return "this Reshape belongs to the runtime of a parent process; create a new one after initialize()"
        return None

    def _check_runtime(self) -> None:
        if (why := self._runtime_error()) is not None:
            raise RuntimeStateError(why)

    def _freed_error(self) -> tuple[type[BaseException], str] | None:
        return (RuntimeStateError, "this Reshape was freed; create a new one") if self._freed else None

    # -- public API -----------------------------------------------------------------------------------------
    @property
    def spec(self) -> ReshapeSpec:
        return self._spec

    def plan(self, stream: Any = None) -> None:
        """Plan the reshape (collective). Calling it again does nothing (locally: no rank waits for another).

        Args:
            stream: accepted for ``nvmath.distributed`` compatibility; planning here launches no stream work.
        """
        self._check_runtime()
        if self._plan is not None:  # free() clears the plan, so a freed object always reaches the agreement
            return
        control = _control_plane()
        self._agree_call(control, self._freed_error(), "plan")
        # the MPI engine builds its plans locally: one rank failing (no memory for its pack buffer) must not leave
        # the others to their next collective; a GPU engine's plan fails on every rank alike, and then so does this
        plan, error = None, None
        self.logger.info("%s: planning", self._name)
        t0 = time.perf_counter()
        try:
            plan = self._engine.plan_reshape(self._spec)
        except Exception as exc:
            error = (type(exc), str(exc))
        try:
            _agree(control, error)
        except BaseException:
            if plan is not None:
                plan.free()
            raise
        self._plan = plan
        self.logger.info("%s: planned in %.3f ms", self._name, (time.perf_counter() - t0) * 1e3)

    def reset_operand(self, operand: Any, *, stream: Any = None) -> None:
        """Use a new operand of the same shape, dtype, package and memory kind (collective).

        Args:
            operand: the new operand (not None: :meth:`release_operand` drops the operand).
            stream: accepted for ``nvmath.distributed`` compatibility; a host operand in another memory order
                is copied on the host.
        """
        self._check_runtime()
        error, vetted = self._freed_error(), None
        if error is None:
            error, vetted = self._vet(operand)
        self._agree_call(_control_plane(), error, "reset_operand")
        if self._symmetric and self._package != "numpy":  # known alike on every rank: all exchange, or none
            positions = _control_plane().allgather(_heap_position(operand))
            _check_positions(positions)
            self._offset = _common_offset(positions)
        self._adopt(vetted)

    def reset_operand_unchecked(self, operand: Any, *, stream: Any = None) -> None:
        """:meth:`reset_operand` without its exchange (nvmath 1.0's name): local, for loops that swap operands
        known to fit.

        Unlike nvmath's, it is not unchecked altogether: the next :meth:`execute` checks the operand locally as
        :meth:`reset_operand` does (package, dtype, shape, memory kind, layout) before its own agreement, so a
        wrong operand raises there on every rank. An ``execute()`` that raises drops an operand given this way
        (as :meth:`release_operand` does), so the next one raises until :meth:`reset_operand` gives another.
        What is skipped is the comparison of the ranks' symmetric GPU operands: they must lie at the same place
        of the symmetric heap on every rank (the same allocation, as :func:`allocate_symmetric_memory` gives).

        Args:
            operand: the new operand.
            stream: accepted for ``nvmath.distributed`` compatibility.
        """
        self._check_runtime()
        if self._freed:  # local, and no collective waits on it: the peers' next call of this object raises too
            raise RuntimeStateError("this Reshape was freed; create a new one")
        if operand is None:
            raise ValueError("reset_operand_unchecked() needs an operand; use release_operand() to release one")
        self._source = self._operand = self._tracked = None
        self._pending = operand
        self._released = False

    def _vet(self, operand: Any) -> tuple[tuple[type[BaseException], str] | None, tuple | None]:
        """Local: why ``operand`` cannot replace the operand (as an error to agree on), or how it would
        (``(operand, local view, conformed, allocation)`` for :meth:`_adopt`)."""
        try:
            if operand is None:
                raise ValueError(
                    "reset_operand() needs an operand; use release_operand() to release the current one"
                )
            tracked = None
            if (kind := _kind(operand)) != self._label:
                raise UnsupportedOperandError(f"new operand must be {self._label}, like the first, not {kind}")
            if _was_freed(operand):  # its memory may belong to another allocation now
                raise SymmetricMemoryError(_FREED_OPERAND + ": pass a live array")
            local = self._local(operand)
            info = array_info(local)
            dtype = _dtype_name(operand, info.dtype)
            if info.shape != self._spec.input_box.box_shape or dtype != self._dtype_name:
                raise OperandMismatchError(
                    f"new operand has shape {info.shape} and dtype {dtype}; the plan needs "
                    f"{self._spec.input_box.box_shape} and {self._dtype_name}"
                )
            if not self._host_tensor:
                tracked = _allocation_of(operand)
                symmetric = self._engine.on_heap(operand) or tracked is not None
                if symmetric != self._symmetric:
                    raise (NotSymmetricMemoryError if self._symmetric else SymmetricMemoryError)(
                        "new operand must " + ("" if self._symmetric else "not ")
                        + "be symmetric memory, like the first"
                    )
            return None, (operand, local, self._conform(local), tracked)
        except Exception as exc:  # reported to all ranks, never raised alone
            return (type(exc), str(exc)), None

    def _adopt(self, vetted: tuple) -> None:
        operand, local, conformed, tracked = vetted
        self._source, self._operand, self._tracked = operand, conformed, tracked
        self._copied = conformed is not local
        self._pending = _NO_OPERAND
        self._released = False

    def release_operand(self) -> None:
        """Drop this object's references to the operand (and to a copy made of it), so that its memory can be
        released; :meth:`execute` then raises on every rank until :meth:`reset_operand` gives a new operand.

        Local (no communication, nothing that could leave a peer waiting): a rank that released alone is caught
        by the agreement of the next :meth:`execute`. Releasing twice, or after :meth:`free` (which drops the
        references too), does nothing."""
        if self._released or self._freed:
            self.logger.debug("the operand was released already; nothing to do")
            return
        self._drop_operand("release_operand()")

    def _drop_operand(self, why: str) -> None:
        self._source = self._operand = None
        self._tracked = None
        self._pending = _NO_OPERAND
        self._released = why

    def execute(self, stream: Any = None, release_workspace: bool = False, sync_symmetric_memory: bool = True) -> Any:
        """Run the reshape (collective) and return this rank's output box as a new array.

        Args:
            stream: CUDA stream (CuPy/torch stream or raw handle) for GPU operands (default: the operand
                package's current stream, as in nvmath); ignored on CPU.
            release_workspace: accepted for ``nvmath.distributed`` compatibility and ignored: the MPI engine has
                no workspace, and the GPU engine's cuFFTMp workspace (none in practice) lives until :meth:`free`.
            sync_symmetric_memory: synchronize symmetric memory across ranks before the reshape (GPU engine).
        """
        self._check_runtime()
        error, vetted = self._freed_error(), None
        if error is None:
            if self._plan is None:
                error = (RuntimeStateError, "call plan() before execute()")
            elif self._released:
                error = (
                    RuntimeStateError,
                    f"execute() cannot run after {self._released}; give a new operand with reset_operand() first",
                )
            elif self._pending is not _NO_OPERAND:  # reset_operand_unchecked: checked here, as reset_operand does
                error, vetted = self._vet(self._pending)
            elif self._tracked is not None and not _is_live(self._tracked):
                error = (SymmetricMemoryError, _FREED_OPERAND + ": give a live one with reset_operand()")
            elif (why := self._operand_mismatch()) is not None:
                error = (OperandMismatchError, why)
        local = self._source  # what the engine moves this time (refreshes a conforming copy)
        if error is None and vetted is None and self._host_tensor:
            try:  # a fresh view of the tensor (set_ may have given it other storage)
                local = self._local(self._source)
            except Exception as exc:
                error = (type(exc), str(exc))
        if error is None:
            try:  # a GPU stream the engine cannot use raises here, on every rank, not inside the collective
                stream = self._engine.resolve_stream(stream, self._package)
            except Exception as exc:
                error = (type(exc), f"execute(stream=...): {exc}")
        # the only exchange on the hot path when all is well; sync_symmetric_memory decides a collective step
        try:
            sync = ("sync_symmetric_memory", bool(sync_symmetric_memory))
        except Exception as exc:  # reported to all ranks, never raised alone
            sync = ("sync_symmetric_memory", None)
            error = error or (TypeError, f"sync_symmetric_memory must be True or False ({type(exc).__name__}: {exc})")
        if error is None and self._symmetric:
            error = self._offset_error(vetted)
        shape, order = self._spec.output_box.box_shape, self._spec.order
        result = None
        if error is None and not self._symmetric:  # local: allocated before the agreement, which covers its failure
            try:
                result = self._recycled_result()
                if result is None:
                    result = self._engine.empty(shape, self._spec.dtype, self._package, order)
            except Exception as exc:
                error = (type(exc), str(exc))
        try:
            self._agree_call(_control_plane(), error, "execute", sync)
        except BaseException:
            if self._pending is not _NO_OPERAND:  # an unchecked reset that did not pass: dropped (see there)
                self._drop_operand("the execute() that refused the operand of reset_operand_unchecked() (it was "
                                   "dropped)")
            raise
        if vetted is not None:
            self._adopt(vetted)  # (its conforming copy, if any, was made from the operand just now)
        elif self._copied:
            np.copyto(self._operand, local)  # refresh the conforming copy: in-place updates count
        else:
            self._operand = local
        if self._symmetric:  # collective (agreed inside): after the agreement
            # every rank knows every output box: the common padded size needs no exchange
            padded = max(b.size for b in self._spec.output_boxes) * self._spec.dtype.itemsize
            dtype = self._spec.dtype if self._tensor_dtype is None else self._tensor_dtype
            result = _allocate_internal(self._engine, padded, shape, dtype, self._package, order)
        blocking = self.options.blocking
        blocks = blocking is True or (blocking == "auto" and self._package == "numpy")
        self.logger.info("%s: execute() starts (%s, sync_symmetric_memory=%s)", self._name,
                         "blocking" if blocks else "stream-ordered: returns before the GPU is done", sync[1])
        t0 = time.perf_counter()
        self._plan.execute(self._operand, result, stream=stream, sync_symmetric_memory=sync[1],
                           operand_offset=self._offset)
        self._remember(result)
        if blocks:
            self._plan.synchronize(stream)
        self.logger.info("%s: execute() %s in %.3f ms", self._name, "ended" if blocks else "enqueued",
                         (time.perf_counter() - t0) * 1e3)
        return from_host_view(result, self._tensor_dtype) if self._host_tensor else result

    def _offset_error(self, vetted: tuple | None) -> tuple[type[BaseException], str] | None:
        """Local, before :meth:`execute`'s agreement: why the plan cannot move the symmetric operand where it
        starts in its allocation (an engine that needs aligned words and cannot copy around them), or why an
        operand given by :meth:`reset_operand_unchecked` (``vetted``) cannot take the path that the agreed offset
        chose: its offset differs in the bytes that choose it."""
        offset = self._offset
        try:
            if vetted is not None and offset is not None:
                position = _heap_position(vetted[0])
                alignment = self._plan.operand_alignment
                if position is not None and (position[1] - offset) % alignment:
                    raise SymmetricMemoryError(
                        f"the operand given to reset_operand_unchecked() starts {position[1]} bytes into its "
                        f"allocation and the plan's operand {offset} bytes in; the plan moves {alignment}-byte "
                        "words, so the two offsets must differ by a multiple of that: give it with "
                        "reset_operand(), which agrees on the operand's place across ranks"
                    )
            if offset is not None:
                self._plan.refuse_offset(offset)
        except Exception as exc:  # reported to all ranks, never raised alone
            return type(exc), str(exc)
        return None

    _POOL = 2  # results kept for reuse: enough for ``b = r.execute()`` in a loop

    def _recycled_result(self) -> Any:
        """A previous result that nobody but this object references any more (no view, no name), else None.

        A fresh result costs page faults on first touch (about as much as the exchange itself on a CPU);
        recycling makes ``b = r.execute()`` in a loop run at the speed of the exchange. A result that its last
        holder changed in place (``b.shape = -1``, ``b.dtype = ...``, read-only) is dropped instead: it no longer
        fits the plan, and the engine would refuse it on this rank only, inside the exchange.
        """
        pool = self._results
        for i in range(len(pool)):
            # references: the pool's list (and getrefcount's argument, as far as the interpreter counts it:
            # _ALONE); anything more is the caller's
            if sys.getrefcount(pool[i]) <= _ALONE:
                result, spec = pool.pop(i), self._spec
                flags = result.flags
                if (result.shape == spec.output_box.box_shape and result.dtype == spec.dtype and flags.writeable
                        and (flags.c_contiguous if spec.order == "C" else flags.f_contiguous)):
                    pool.append(result)
                    return result
                return None
        return None

    def _remember(self, result: Any) -> None:
        if not self._symmetric and self._package == "numpy" and hasattr(sys, "getrefcount"):
            if not any(r is result for r in self._results):
                self._results.append(result)
            del self._results[: -self._POOL]

    def free(self) -> None:
        """Release the plan and the references to the operand (collective). Idempotent.

        The first ``free()`` (before :func:`dask_pgas.finalize`) opens with the agreement that every rank is in
        it, planned or not. On a mismatch it raises; the object is then freed on every rank if every rank was in
        a call of this object (one rank left a ``with`` block by an exception while the others were in
        ``execute()``, say), else left as it was."""
        if not self._freed and self._runtime_error() is None:
            self._agree_call(_control_plane(), None, "free")
        self._release()

    def _release(self) -> None:
        """``free()`` after its agreement: drop the references; free the plan once (collective on a GPU engine,
        and every rank holds one or none: planning agrees on its outcome)."""
        self._results = []
        self._source = self._operand = None
        self._tracked = None
        self._pending = _NO_OPERAND
        if self._freed:
            return
        self._freed = True
        if self._plan is not None:
            plan, self._plan = self._plan, None
            plan.free()
        self.logger.info("%s: resources released", self._name)

    def _agree_call(self, control: Any, error: tuple[type[BaseException], str] | None, method: str,
                    same: tuple[str, Any] | None = None) -> None:
        """The agreement that opens ``method`` (see :func:`_agree`). When it finds the ranks in different calls,
        all of them on this object (one rank left a ``with`` block by an exception and is in ``free()`` while
        the others are in ``execute()``), every rank frees the object right there and raises: every rank has
        then made one call, so their next collective calls meet again (a later ``free()`` does nothing)."""
        try:
            _agree(control, error, f"{self._name}.{method}()", same)
        except errors.CollectiveMismatchError as exc:
            prefix = f"{self._name}."
            if exc.calls and all(c is not None and c.startswith(prefix) for c in exc.calls):
                self._release()  # the same decision on every rank: each sees every call
                exc.args = (f"{exc.args[0]}; {self._name} is freed on every rank",)
            raise

    def __enter__(self) -> Reshape:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            self.free()
            return
        # leaving by an exception: the peers may be in another call of this object; free() then meets them,
        # frees the object on every rank and raises there, and this rank's own exception goes on, with a note
        try:
            self.free()
        except errors.CollectiveMismatchError as mismatch:
            if not self._freed:
                raise
            if hasattr(exc, "add_note"):  # Python >= 3.11
                exc.add_note(f"dask_pgas: leaving the with block of {self._name}: {mismatch}")


def reshape(
    operand: Any,
    input_box: Box | Any,
    output_box: Box | Any,
    sync_symmetric_memory: bool = True,
    options: ReshapeOptions | dict | None = None,
    stream: Any = None,
) -> Any:
    """Redistribute ``operand`` from ``input_box`` to ``output_box`` on every rank (collective).

    A convenience wrapper of :class:`Reshape`; returns this rank's output box as a new array.
    """
    return _once(Reshape, operand, input_box, output_box, sync_symmetric_memory, options, stream)


def _once(cls: type[Reshape], operand: Any, input_box: Any, output_box: Any, sync_symmetric_memory: bool,
          options: Any, stream: Any) -> Any:
    """The function forms: plan, execute once and free."""
    with cls(operand, input_box, output_box, options=options, stream=stream) as r:
        r.plan(stream=stream)
        return r.execute(stream=stream, sync_symmetric_memory=sync_symmetric_memory)


@dataclass
class RedistributeOptions(ReshapeOptions):
    """nvmath 1.0's name for :class:`ReshapeOptions` (the same fields: ``logger``, ``blocking``)."""


class Redistribute(Reshape):
    """nvmath 1.0's name for :class:`Reshape` (``nvmath.distributed.distribution.Redistribute``): the same object,
    with the distributions named ``input_distribution`` and ``output_distribution``. A distribution is a
    :class:`Box` (or a ``(lower, upper)`` pair), or a :class:`~dask_pgas.distribution.Slab` on every rank, as for
    :class:`Reshape`."""

    def __init__(
        self,
        operand: Any,
        /,
        input_distribution: Box | Any,
        output_distribution: Box | Any,
        *,
        options: ReshapeOptions | dict | None = None,
        stream: Any = None,
    ) -> None:
        super().__init__(operand, input_distribution, output_distribution, options=options, stream=stream)


def redistribute(
    operand: Any,
    input_distribution: Box | Any,
    output_distribution: Box | Any,
    sync_symmetric_memory: bool = True,
    options: ReshapeOptions | dict | None = None,
    stream: Any = None,
) -> Any:
    """nvmath 1.0's name for :func:`reshape` (``nvmath.distributed.distribution.redistribute``)."""
    return _once(Redistribute, operand, input_distribution, output_distribution, sync_symmetric_memory, options, stream)
