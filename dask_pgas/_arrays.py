"""Engine-independent facts about array objects (NumPy, CuPy, torch) without importing CuPy or torch."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["ArrayInfo", "array_info", "package_name", "package_of", "to_numpy_dtype"]

_PACKAGES = ("numpy", "cupy", "torch")


def package_name(package: Any) -> str:
    """``numpy``/``cupy``/``torch`` given the module or its name."""
    name = package if isinstance(package, str) else getattr(package, "__name__", None)
    if name not in _PACKAGES:
        raise TypeError(f"package must be one of the modules {_PACKAGES} (or their names), got {package!r}")
    return name


def package_of(obj: Any) -> str | None:
    """The array package of ``obj`` or None when it is no array we know."""
    if isinstance(obj, np.ndarray):
        return "numpy"
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(obj, cupy.ndarray):
        return "cupy"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return "torch"
    return None


def to_numpy_dtype(dtype: Any) -> np.dtype:
    """NumPy dtype of a NumPy/CuPy dtype spec or a torch dtype."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        return np.dtype(torch.empty((), dtype=dtype).numpy().dtype) if dtype != torch.bfloat16 else np.dtype("V2")
    return np.dtype(dtype)


@dataclass(frozen=True)
class ArrayInfo:
    package: str
    shape: tuple[int, ...]
    dtype: np.dtype
    c_contiguous: bool
    f_contiguous: bool
    ptr: int
    nbytes: int
    device: int | None  # CUDA device ordinal, None on the host


def array_info(obj: Any) -> ArrayInfo:
    """Shape, dtype, layout and data pointer of a NumPy/CuPy array or torch tensor."""
    pkg = package_of(obj)
    if pkg is None:
        raise TypeError(f"expected a numpy.ndarray, cupy.ndarray or torch.Tensor, got {type(obj).__name__}")
    if pkg == "torch":
        shape = tuple(obj.shape)
        itemsize = obj.element_size()
        strides = tuple(s * itemsize for s in obj.stride())
        dtype = to_numpy_dtype(obj.dtype)
        c, f = _contiguity(shape, strides, itemsize)
        device = obj.device.index if obj.is_cuda else None
        return ArrayInfo(pkg, shape, dtype, c, f, obj.data_ptr(), obj.numel() * itemsize, device)
    flags = obj.flags
    if pkg == "numpy":
        ptr, device = obj.__array_interface__["data"][0], None
    else:
        ptr, device = obj.data.ptr, obj.device.id
    return ArrayInfo(
        pkg, tuple(obj.shape), np.dtype(obj.dtype), bool(flags.c_contiguous), bool(flags.f_contiguous), ptr,
        obj.nbytes, device,
    )


def _contiguity(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> tuple[bool, bool]:
    def dense(order):
        expect = itemsize
        for n, s in order:
            if n != 1 and s != expect:
                return False
            expect *= n
        return True

    if 0 in shape:
        return True, True
    pairs = list(zip(shape, strides))
    return dense(reversed(pairs)), dense(pairs)
