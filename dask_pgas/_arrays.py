"""Engine-independent facts about array objects (NumPy, CuPy, torch) without importing CuPy or torch."""

from __future__ import annotations

import functools
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "ArrayInfo", "array_info", "from_host_view", "host_view", "is_host_tensor", "package_name", "package_of",
    "to_numpy_dtype",
]

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
    """NumPy dtype of a NumPy/CuPy dtype spec or a torch dtype; a torch dtype NumPy lacks (``bfloat16``, the
    float8 types, ``complex32``) is raw bytes of its size (``V2``, ``V1``, ``V4``)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        return _torch_to_numpy(dtype)
    return np.dtype(dtype)


@functools.cache  # (execute() asks it for every torch operand; torch has a few dozen dtypes)
def _torch_to_numpy(dtype: Any) -> np.dtype:
    import torch

    with warnings.catch_warnings():  # torch warns that complex32 is experimental
        warnings.simplefilter("ignore")
        probe = torch.empty((), dtype=dtype)
    try:
        return np.dtype(probe.numpy().dtype)
    except TypeError:  # torch refuses .numpy() for dtypes NumPy has no match for
        return np.dtype(f"V{probe.element_size()}")


def is_host_tensor(obj: Any) -> bool:
    """Whether ``obj`` is a torch tensor in host memory (reshaped as its NumPy view, like a NumPy operand)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor) and obj.device.type == "cpu"


#: torch integer types by element size: the view through which torch and NumPy share elements NumPy has no type
#: for, and raw words of any element type
TORCH_INTS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def host_view(tensor: Any) -> np.ndarray:
    """A NumPy array sharing the memory of a torch CPU tensor (its shape and strides; no copy unless the tensor
    carries a lazy conjugate or negation bit). Elements NumPy has no type for come as raw bytes (``V2`` for
    ``bfloat16``): a reshape only moves them."""
    torch = sys.modules["torch"]
    t = tensor.detach().resolve_conj().resolve_neg()
    dtype = to_numpy_dtype(t.dtype)
    if dtype.kind != "V":
        return t.numpy()
    return t.view(getattr(torch, TORCH_INTS[dtype.itemsize])).numpy().view(dtype)


def from_host_view(array: np.ndarray, dtype: Any) -> Any:
    """The torch CPU tensor of ``dtype`` (a torch dtype) sharing ``array``'s memory: the inverse of
    :func:`host_view`. The tensor keeps ``array`` referenced while it lives."""
    torch = sys.modules["torch"]
    if array.dtype.kind != "V":
        return torch.from_numpy(array)
    return torch.from_numpy(array.view(TORCH_INTS[array.dtype.itemsize])).view(dtype)


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
