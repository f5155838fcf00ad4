"""Array interop: any DLPack/NumPy array -> a device view, and outputs in the caller's framework.

PyTorch in gives PyTorch out (allocated with torch's caching allocator, launched on torch's
current stream); CuPy in gives CuPy out on CuPy's current stream; other DLPack producers (JAX)
are viewed zero-copy through ``cupy.from_dlpack`` and get their own type back; NumPy arrays are
copied to the current GPU and a NumPy array comes back.
"""
from __future__ import annotations

import math
import sys
from typing import NamedTuple

import numpy as np

DTYPE_NAMES = {"float16": "fp16", "bfloat16": "bf16"}
CUDA_DEVICE_TYPES = (2, 3, 13)  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged


class View(NamedTuple):
    """What a kernel needs to know about one array (a tuple: cheap to build on every call)."""
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]   # in elements
    dtype: str                 # numpy-style name: "float16", "bfloat16", "float32", ...
    device: int                # CUDA ordinal, or -1 for host memory
    framework: str             # "torch", "cupy", "numpy" or "dlpack"
    array: object              # the object to keep alive / hand back (a CuPy array for dlpack)


def _torch_tensor(x) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _cupy_array(x) -> bool:
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(x, cupy.ndarray)


_torch_dtype_names: dict = {}


def view(x, name: str) -> View:
    """Describe ``x`` without copying. Raises TypeError for things that are not arrays."""
    if _torch_tensor(x):
        dtype = _torch_dtype_names.get(x.dtype)
        if dtype is None:
            dtype = _torch_dtype_names[x.dtype] = str(x.dtype).removeprefix("torch.")
        if x.is_cuda:
            dev = x.get_device()
        elif x.device.type == "cpu":
            dev = -1
        else:
            raise TypeError(f"{name} must be a CUDA tensor, got a tensor on {x.device}")
        return View(x.data_ptr(), tuple(x.shape), x.stride(), dtype, dev, "torch", x)
    if _cupy_array(x):
        item = x.dtype.itemsize
        return View(x.data.ptr, x.shape, tuple(s // item for s in x.strides), x.dtype.name,
                    x.device.id, "cupy", x)
    if isinstance(x, np.ndarray):
        item = x.dtype.itemsize
        return View(x.ctypes.data, x.shape, tuple(s // item for s in x.strides), x.dtype.name,
                    -1, "numpy", x)
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        dev_type, dev_id = x.__dlpack_device__()
        if int(dev_type) not in CUDA_DEVICE_TYPES:
            return view(np.from_dlpack(x), name)  # host memory: handled like NumPy
        import cupy
        c = cupy.from_dlpack(x)
        v = view(c, name)
        return View(v.ptr, v.shape, v.strides, v.dtype, v.device, "dlpack", (x, c))
    raise TypeError(f"{name} must be an array (PyTorch, CuPy, JAX, NumPy or any DLPack producer), "
                    f"got {type(x).__name__}")


# ---------------------------------------------------------------------------------------------
# Streams and allocation in the caller's framework (needs a GPU)

def stream_for(v: View) -> int:
    """The caller's current stream (a raw pointer) to launch on: torch's for PyTorch arrays,
    CuPy's otherwise, each the current stream of the array's device (not of the current device:
    JAX never sets CuPy's, and a stream belongs to one device)."""
    if v.framework == "torch":
        return torch_stream(v.device)
    import cupy
    return cupy.cuda.get_current_stream(v.device if v.device >= 0 else -1).ptr


def torch_stream(device: int) -> int:
    """torch's current stream on ``device``, as a raw pointer (without a Stream object where
    torch offers that)."""
    global torch_stream
    import torch
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    torch_stream = raw or (lambda d: torch.cuda.current_stream(d).cuda_stream)
    return torch_stream(device)


def on_device(device: int):
    """Make ``device`` current for a launch (kernels are loaded per device)."""
    import cupy
    return cupy.cuda.Device(device)


def empty_like_framework(v: View, shape, dtype: str):
    """An uninitialised device array in ``v``'s framework (NumPy/JAX inputs get CuPy scratch)."""
    if v.framework == "torch":
        import torch
        return torch.empty(shape, dtype=getattr(torch, dtype), device=f"cuda:{v.device}")
    import cupy
    with cupy.cuda.Device(v.device):
        return cupy.empty(shape, dtype=_cupy_dtype(dtype))


def _cupy_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def to_device(x: np.ndarray, device: int):
    """Copy a host array to ``device`` (NumPy inputs)."""
    import cupy
    with cupy.cuda.Device(device):
        return cupy.asarray(x)


def device_ptr(a) -> int:
    if _torch_tensor(a):
        return a.data_ptr()
    return a.data.ptr


def hand_back(result, like: View):
    """Return a device result in the framework of ``like``'s caller."""
    if like.framework == "numpy":
        import cupy
        return cupy.asnumpy(result)
    if like.framework == "dlpack":
        original = like.array[0]
        mod = type(original).__module__.split(".")[0]
        if mod in ("jax", "jaxlib"):
            import jax
            return jax.dlpack.from_dlpack(result)
        return result
    return result


def current_device() -> int:
    """The current CUDA device, or a RuntimeError saying there is none."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy.cuda.Device().id
    except Exception as e:  # no driver, no device
        raise RuntimeError(f"cuflash needs a CUDA GPU to run attention, and none is available ({e}). "
                           "cuflash.plan(..., num_sms=N) and offline compilation work without one.") from None
    raise RuntimeError("cuflash needs a CUDA GPU to run attention, and none is available.")


def current_device_id() -> int:
    """The current CUDA device (CuPy's runtime call, bound on first use)."""
    global current_device_id
    import cupy
    current_device_id = cupy.cuda.runtime.getDevice
    return current_device_id()


def contiguous_strides(shape) -> tuple:
    """The element strides of a C-contiguous array of ``shape``."""
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def no_dropout(dropout_p, seed) -> bool:
    """A call without dropout as the repeated-call paths take it: dropout_p a plain 0, no seed."""
    return dropout_p.__class__ in (int, float) and dropout_p == 0 and seed is None


def repeat_keep(table: dict, sig, value) -> None:
    """Keep ``value`` under ``sig`` in a repeat table, which is emptied when it holds 1024."""
    if len(table) >= 1024:
        table.clear()
    table[sig] = value


def repeat_lookup(table: dict, sig):
    """What ``table`` keeps under the repeat signature ``sig``, or None: for no signature, and for
    an option that cannot be hashed or compared (the general path's checks then name it)."""
    if sig is None:
        return None
    try:
        return table.get(sig)
    except Exception:
        return None


def repeat_operands(q, k, v, out, new_out):
    """The data pointers (q, k, v, out) and the output of a repeated call on PyTorch tensors,
    ``new_out()`` made when ``out`` is None; None when a pointer is not 16-byte aligned or
    ``out`` is in the storage of k, v or (unless it is q itself) q (the general path then
    decides: validate.out_apart)."""
    qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
    op = 0 if out is None else out.data_ptr()
    if (qp | kp | vp | op) & 15:
        return None
    if out is not None:
        mine = out.untyped_storage().data_ptr()
        if mine in (k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr()) or (
                mine == q.untyped_storage().data_ptr() and (op != qp or out.stride() != q.stride())):
            return None
    if out is None:
        out = new_out()
        op = out.data_ptr()
    return qp, kp, vp, op, out


def repeat_signature(tensors, window_size, options):
    """The key under which a call from PyTorch reuses an earlier call's checks, plan and launch
    arguments: each tensor's shape, strides, dtype and device (None stays None), the window as
    two ints and each option's type and value (True is not 1). None when the first tensor is not
    a plain torch.Tensor, another is not a strided PyTorch tensor, or the window is not a tuple
    of two ints: such calls take the general path."""
    torch = sys.modules.get("torch")
    if (torch is None or tensors[0].__class__ is not torch.Tensor or window_size.__class__ is not tuple
            or len(window_size) != 2):
        return None
    w0, w1 = window_size
    if w0.__class__ is not int or w1.__class__ is not int:
        return None
    try:
        layouts = tuple(None if x is None else (x.shape, x.stride(), x.dtype, x.get_device()) for x in tensors)
    except (AttributeError, TypeError, RuntimeError):  # not all PyTorch tensors (or not strided)
        return None
    return layouts, w0, w1, tuple((x.__class__, x) for x in options)
