"""Argument checks shared by every entry point: ``attention``, ``attention_varlen``,
``attention_with_kvcache``, ``cuflash.plan`` and the backward.

Each check raises a TypeError (wrong kind of value) or a ValueError (wrong value) whose message
names the argument, what was expected and what was given. The checks read views
(``arrays.View``: pointer, shape, strides, dtype, device, framework) and plain values only, so
they run before anything is allocated or launched.
"""
from __future__ import annotations

import math
import numbers
import re

import numpy as np

from . import arrays
from .plan import MAX_SPLITS

SUPPORTED_DTYPES = ("float16", "bfloat16")
# The kernels take sizes as 32-bit ints and round them up to whole tiles (at most 256 rows) in
# 32-bit arithmetic, so every size keeps that headroom below 2**31. Strides are 64-bit.
MAX_SIZE = 2**31 - 1024
INT32_MAX = 2**31 - 1
SHAPE_ONLY = -2  # the device of a shape-only stand-in (cuflash.plan): it has no place
# The kernels compute in float32 with subnormals flushed to zero: scalars they receive must be
# normal float32 values.
_F32_TINY, _F32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
_LOG2E = math.log2(math.e)


def shape_str(v):
    return tuple(int(s) for s in v.shape)


def _type(x) -> str:
    return type(x).__name__


def show(x) -> str:
    """x for a message: str for numbers, repr otherwise, on one line (arrays print over several)
    and at most 80 characters."""
    text = " ".join((str(x) if isinstance(x, numbers.Number) else repr(x)).split())
    return text if len(text) <= 80 else text[:77] + "..."


# ---------------------------------------------------------------------------------------------
# Arrays

def view(x, name):
    """``arrays.view(x, name)``, refusing NumPy/CuPy arrays whose byte strides are not whole
    elements (a view keeps strides in elements); a Shape stand-in is its own view."""
    if type(x) is Shape:
        return x
    v = arrays.view(x, name)
    if v.framework in ("numpy", "cupy") and isinstance(getattr(v.array, "dtype", None), np.dtype):
        item, strides = v.array.dtype.itemsize, v.array.strides
        if any(s % item for s in strides):
            raise ValueError(f"{name} must have strides in whole elements ({item} bytes), "
                             f"got byte strides {tuple(strides)}")
    return v


def sizes(*named):
    """(name, value) pairs: each must fit the kernels' 32-bit sizes."""
    for name, n in named:
        if n > MAX_SIZE:
            raise ValueError(f"{name} must be at most {MAX_SIZE} (the kernels index with 32-bit ints), "
                             f"got {n}")


def same_place(*named):
    """(name, view) pairs: all in host memory or all on one GPU, the first one being the
    reference. Shape-only stand-ins have no place; PyTorch CPU tensors are refused anywhere."""
    ref = None
    for name, x in named:
        if x.device < 0 and x.framework == "torch":
            raise ValueError(f"{name} is a CPU tensor; move it to the GPU (e.g. {name}.cuda())")
        if x.device == SHAPE_ONLY:
            continue
        if ref is None:
            ref = name, x
        elif x.device != ref[1].device:
            _misplaced(name, x, *ref)


def _misplaced(name, x, n0, x0):
    if (x.device < 0) != (x0.device < 0):
        where = lambda y: "host memory" if y.device < 0 else f"GPU {y.device}"  # noqa: E731
        raise ValueError(f"{name} is in {where(x)} but {n0} is in {where(x0)}; "
                         "host arrays cannot be mixed with device arrays")
    raise ValueError(f"{name} is on GPU {x.device} but {n0} is on GPU {x0.device}; "
                     "all arrays must be on one device")


def _last_dim_contiguous(x, name, what="contiguous in its last dim (stride 1)"):
    if x.shape and x.shape[-1] > 1 and x.strides[-1] != 1 and 0 not in x.shape:
        raise ValueError(f"{name} must be {what}, got strides {tuple(x.strides)}")


def operands(q, k, v, same_batch=True, names=("q", "k", "v"), dtypes=SUPPORTED_DTYPES):
    """Rank, dtype, shape, size, layout and placement rules shared by every entry point (views
    of 4 dims: varlen calls pass their packed arrays seen as batches). A KV cache's batch dim may
    differ from q's (cache_batch_idx, pages): ``same_batch=False``. ``dtypes``: q's accepted dtypes
    (the FP8 path checks its own first and passes them)."""
    nq, nk, nv = names
    for name, x in ((nq, q), (nk, k), (nv, v)):
        if len(x.shape) != 4:
            raise ValueError(f"{name} must have 4 dims (batch, seqlen, nheads, headdim); "
                             f"got shape {shape_str(x)}")
    if q.dtype not in dtypes:
        raise TypeError(f"q must be float16 or bfloat16, got {q.dtype}; cast it first "
                        "(e.g. q.to(torch.bfloat16) or q.astype(cupy.float16))")
    for name, x in ((nk, k), (nv, v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}; cast it first")
    b, sq, h, d = q.shape
    if same_batch and k.shape[0] != b:
        raise ValueError(f"{nk} must have q's batch size {b}, got shape {shape_str(k)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"{nv} must have {nk}'s shape {shape_str(k)}, got {shape_str(v)}")
    if k.shape[3] != d:
        raise ValueError(f"{nk} must have q's head dim {d}, got {k.shape[3]} (q {shape_str(q)}, "
                         f"{nk} {shape_str(k)})")
    if not 1 <= d <= 256:
        raise ValueError(f"head dim (last dim of q and k) must be between 1 and 256, got {d}")
    hk = k.shape[2]
    if hk == 0 or h % hk:
        raise ValueError(f"nheads ({h}) must be divisible by nheads_k ({hk})")
    if max(q.shape) > MAX_SIZE or max(k.shape) > MAX_SIZE or b * h * sq > MAX_SIZE:  # names built only then
        sizes(*((f"{name}.shape[{i}]", n) for name, x in ((nq, q), (nk, k)) for i, n in enumerate(x.shape)),
              (f"{nq}'s batch * nheads * seqlen ({b} * {h} * {sq})", b * h * sq))
    for name, x in ((nq, q), (nk, k), (nv, v)):
        if x.shape[3] > 1 and x.strides[3] != 1:
            _last_dim_contiguous(x, name)
    same_place((nq, q), (nk, k), (nv, v))


def out(o, q, original=None, dtype=None):
    """A caller's ``out`` view for ``q``; ``original`` is the object the caller passed (host
    ``out`` must be a writable ndarray); ``dtype``: out's dtype when it is not q's (FP8's bf16)."""
    if o.framework == "dlpack":
        raise TypeError("out must be a PyTorch, CuPy or NumPy array (arrays written in place); "
                        f"got {_type(o.array[0])}")
    if o.framework != q.framework:
        raise TypeError(f"out must be a {q.framework} array like q, got a {o.framework} array")
    if original is not None and o.framework == "numpy" and not (
            isinstance(original, np.ndarray) and original.flags.writeable):
        raise TypeError(f"out in host memory must be a writable NumPy array, got {_type(original)}")
    if tuple(o.shape) != tuple(q.shape):
        raise ValueError(f"out must have q's shape {shape_str(q)}, got {shape_str(o)}")
    if dtype is not None and o.dtype != dtype:
        raise TypeError(f"out must be {dtype}, got {o.dtype}")
    if dtype is None and o.dtype != q.dtype:
        raise TypeError(f"out must have q's dtype {q.dtype}, got {o.dtype}")
    same_place(("q", q), ("out", o))
    _last_dim_contiguous(o, "out", "contiguous in its last dim")


_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8,
             "float8_e4m3fn": 1, "uint8": 1}


class _Layout:
    """An object NumPy reads as an array at a given address and layout (``__array_interface__``)."""

    def __init__(self, interface):
        self.__array_interface__ = interface


def _itemsize(v) -> int:
    return _ITEMSIZE.get(v.dtype) or np.dtype(v.dtype).itemsize


def _extent(v):
    """(first byte, one past the last byte) that view v spans (strides >= 0 in views here)."""
    last = 0
    for n, st in zip(v.shape, v.strides):
        last += (n - 1) * st
    return v.ptr, v.ptr + (last + 1) * _itemsize(v)


def _bytes_at(v):
    """A NumPy array of v's address and layout, one void item per element (its memory is never
    read): for np.shares_memory, which solves the overlap of two strided layouts exactly."""
    item = _itemsize(v)
    return np.asarray(_Layout(dict(shape=tuple(v.shape), typestr=f"|V{item}", data=(v.ptr, False),
                                   strides=tuple(st * item for st in v.strides), version=3)))


def out_apart(o, *named):
    """A device ``out`` that no two of its elements share (no zero stride) and that shares no
    memory with the arrays the kernels read while writing it (``named``: (name, view or None)
    pairs), as PyTorch refuses overlapping outputs; ``out`` may be q itself (each block writes
    the query rows it has read). Host ``out`` is written after the launch, from a copy."""
    if o.device < 0:
        return
    if any(st == 0 and n > 1 for n, st in zip(o.shape, o.strides)):
        raise ValueError(f"out must not have a zero stride (several elements at one address), got strides "
                         f"{tuple(o.strides)}")
    if 0 in o.shape:
        return
    lo, hi = _extent(o)
    for name, x in named:
        if x is None or x.device != o.device or 0 in x.shape:
            continue
        x_lo, x_hi = _extent(x)
        if x_hi <= lo or hi <= x_lo:  # (apart: the common case, decided without NumPy)
            continue
        if name == "q" and x.ptr == o.ptr and x.shape == o.shape and x.strides == o.strides:
            continue
        try:
            shared = np.shares_memory(_bytes_at(o), _bytes_at(x), max_work=100_000)
        except np.exceptions.TooHardError:  # (no answer within the work bound: taken as shared)
            shared = True
        if shared:
            raise ValueError(f"out must not share memory with {name} (the kernels read {name} while writing out)")


def like(x, ref, name, ref_name):
    """``x`` must have ``ref``'s shape, dtype and place, last dim contiguous (the backward's
    dout, out and gradient buffers)."""
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"{name} must have {ref_name}'s shape {shape_str(ref)}, got {shape_str(x)}")
    if x.dtype != ref.dtype:
        raise TypeError(f"{name} must have {ref_name}'s dtype {ref.dtype}, got {x.dtype}")
    if len(x.shape) >= 3:
        _last_dim_contiguous(x, name)
    same_place((ref_name, ref), (name, x))


def grads(dq, dk, dv, qv, kv, vv):
    """Views of the caller's optional gradient buffers (None where not given): written in place,
    so each must be a plain array of the caller's framework shaped like its operand."""
    result = []
    for name, x, ref, ref_name in (("dq", dq, qv, "q"), ("dk", dk, kv, "k"), ("dv", dv, vv, "v")):
        if x is None:
            result.append(None)
            continue
        g = view(x, name)
        if g.framework == "dlpack":
            raise TypeError(f"{name} must be a PyTorch, CuPy or NumPy array (written in place); "
                            f"got {_type(g.array[0])}")
        if g.framework != ref.framework:
            raise TypeError(f"{name} must be a {ref.framework} array like {ref_name}, got a {g.framework} array")
        if g.framework == "numpy" and not (isinstance(x, np.ndarray) and x.flags.writeable):
            raise TypeError(f"{name} in host memory must be a writable NumPy array, got {_type(x)}")
        like(g, ref, name, ref_name)
        result.append(g)
    return result


def lse(x, shape, layout, q, producer):
    """The forward's LSE for the backward: float32 ``shape`` (named ``layout``) on q's place."""
    lv = view(x, "lse")
    if tuple(lv.shape) != shape:
        raise ValueError(f"lse must have shape {layout} = {shape}, got {shape_str(lv)}")
    if lv.dtype != "float32":
        raise TypeError(f"lse must be float32 (as {producer}(..., return_lse=True) returns it), got {lv.dtype}")
    same_place(("q", q), ("lse", lv))
    return lv


def aligned(x) -> bool:
    """16-byte loads need an aligned base and every stride but the last (batch/seq/head, or a packed
    view's token/head) in multiples of 8 elements."""
    return x.ptr % 16 == 0 and all(st % 8 == 0 or n <= 1 for st, n in zip(x.strides[:-1], x.shape[:-1]))


def batched(x, batch, max_len):
    """A packed (total, nheads, d) view seen as (batch, max_len, nheads, d) with the token stride
    as batch stride: the kernels offset sequence b by cu_seqlens[b] tokens."""
    st = x.strides
    return arrays.View(x.ptr, (batch, max_len, x.shape[1], x.shape[2]), (st[0], st[0], st[1], st[2]),
                       x.dtype, x.device, x.framework, x.array)


def block_table(table, batch, q):
    """The view of an int32 (batch, pages_per_seq) block table with contiguous rows, on q's place."""
    bt = view(table, "block_table")
    if bt.dtype != "int32" or len(bt.shape) != 2 or bt.shape[0] != batch:
        raise ValueError(f"block_table must be int32 of shape ({batch}, pages_per_seq), "
                         f"got {bt.dtype} {shape_str(bt)}")
    if bt.shape[1] > 1 and bt.strides[1] != 1:
        raise ValueError(f"block_table rows must be contiguous, got strides {tuple(bt.strides)}")
    if bt.strides[0] > INT32_MAX:
        raise ValueError(f"block_table's row stride must be at most {INT32_MAX} (a 32-bit kernel "
                         f"argument), got {bt.strides[0]}")
    same_place(("q", q), ("block_table", bt))
    return bt


def int32_vector(x, name, length, q, dims="(batch,)"):
    """The view of a contiguous int32 (length,) array on q's place (cache_seqlens, cache_batch_idx);
    ``dims`` names the shape in messages."""
    v = view(x, name)
    if v.dtype != "int32":
        raise TypeError(f"{name} must be int32, got {v.dtype}")
    if tuple(v.shape) != (length,):
        raise ValueError(f"{name} must have shape {dims} = ({length},), got {shape_str(v)}")
    if len(v.strides) and length > 1 and v.strides[0] != 1:
        raise ValueError(f"{name} must be contiguous, got strides {tuple(v.strides)}")
    same_place(("q", q), (name, v))
    return v


def cu_seqlens(cu_seqlens_q, cu_seqlens_k):
    """Views of two int32 (batch + 1,) contiguous cumulative-length vectors, and the batch."""
    cq, ck = view(cu_seqlens_q, "cu_seqlens_q"), view(cu_seqlens_k, "cu_seqlens_k")
    for name, c in (("cu_seqlens_q", cq), ("cu_seqlens_k", ck)):
        if c.dtype != "int32":
            raise TypeError(f"{name} must be int32, got {c.dtype}")
        if len(c.shape) != 1 or c.shape[0] < 1:
            raise ValueError(f"{name} must have shape (batch + 1,), got {shape_str(c)}")
        if c.shape[0] > 1 and c.strides[0] != 1:
            raise ValueError(f"{name} must be contiguous, got strides {tuple(c.strides)}")
    if ck.shape != cq.shape:
        raise ValueError(f"cu_seqlens_k must have cu_seqlens_q's shape {shape_str(cq)}, got {shape_str(ck)}")
    return cq, ck, cq.shape[0] - 1


def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, table=None, paged_ok=True):
    """The packed-batch rules of attention_varlen and its backward: views (q, k, v, cu_q, cu_k,
    block table or None), batch, max_seqlen_q and max_seqlen_k. ``table`` is the caller's
    block_table (paged K/V); ``paged_ok=False`` for the backward, which has no paged K/V."""
    qv, kv, vv = view(q, "q"), view(k, "k"), view(v, "v")
    paged = table is not None
    if len(qv.shape) != 3:
        raise ValueError(f"q must have 3 dims (total_q, nheads, headdim), got shape {shape_str(qv)}")
    k_dims = ("4 dims (num_pages, page_size, nheads_k, headdim) with block_table" if paged else
              "3 dims (total_k, nheads_k, headdim)" + ("" if paged_ok else " (the backward has no paged K/V)"))
    for name, x in (("k", kv), ("v", vv)):
        if len(x.shape) != (4 if paged else 3):
            raise ValueError(f"{name} must have {k_dims}, got shape {shape_str(x)}")
    cq, ck, batch = cu_seqlens(cu_seqlens_q, cu_seqlens_k)
    total_q, h, d = qv.shape
    sizes(("q.shape[0] (total_q)", total_q), ("k.shape[0]", kv.shape[0]),
          ("batch (cu_seqlens_q.shape[0] - 1)", batch))
    bt = None
    if paged:
        bt = block_table(table, batch, qv)
        if kv.shape[1] == 0:
            raise ValueError(f"page size (k.shape[1]) must be positive, got {kv.shape[1]}")
        k_limit, k_what = bt.shape[1] * kv.shape[1], "pages_per_seq * page_size"
    else:
        k_limit, k_what = kv.shape[0], "total_k"
    max_sq = max_seqlen(max_seqlen_q, "max_seqlen_q", total_q, "total_q")
    max_sk = max_seqlen(max_seqlen_k, "max_seqlen_k", k_limit, k_what)
    # Head dims and last-dim strides on the arrays as given, then the dense rules on the batched
    # views (dtypes, heads, sizes, placement).
    if kv.shape[-1] != d:
        raise ValueError(f"k must have q's head dim {d}, got {kv.shape[-1]} "
                         f"(q {shape_str(qv)}, k {shape_str(kv)})")
    for name, x in (("q", qv), ("k", kv), ("v", vv)):
        _last_dim_contiguous(x, name)
    if paged:
        # Head dims that are not a multiple of 8 read the pages element by element (q is copied).
        for name, x in (("q", qv), ("k", kv), ("v", vv)) if d % 8 == 0 else ():
            if not aligned(x if len(x.shape) == 4 else batched(x, batch, 1)):
                raise ValueError(f"{name} must be 16-byte aligned with strides in multiples of 8 elements "
                                 f"with a paged cache, got strides {tuple(x.strides)}")
        operands(batched(qv, batch, max_sq), kv, vv, same_batch=False)
    else:
        if kv.shape != vv.shape:
            raise ValueError(f"v must have k's shape {shape_str(kv)}, got {shape_str(vv)}")
        operands(batched(qv, batch, max_sq), batched(kv, batch, max_sk), batched(vv, batch, max_sk))
    for name, c in (("cu_seqlens_q", cq), ("cu_seqlens_k", ck)):
        same_place(("q", qv), (name, c))
    return qv, kv, vv, cq, ck, bt, batch, max_sq, max_sk


# ---------------------------------------------------------------------------------------------
# Scalars

def _is_int(x) -> bool:
    return type(x) is int or (isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_)))


def boolean(value, name):
    """A bool (or NumPy bool), never a truthy stand-in: "no" and [] are not False."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {_type(value)}")
    return bool(value)


def max_seqlen(value, name, limit, what):
    """A varlen maximum: an upper bound on the sequences' lengths, as in flash-attn (callers pass
    a fixed bound, e.g. the model's context, to avoid reading the offsets back); one above
    ``limit`` (``what``: the rows there are) is read as ``limit``, which no sequence can exceed."""
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {_type(value)}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0 (an upper bound on the sequence lengths; {what} is {limit}), "
                         f"got {value}")
    sizes((name, value))
    return min(int(value), limit)


def num_splits(n):
    if not _is_int(n):
        raise TypeError(f"num_splits must be an int, got {_type(n)}")
    if not 0 <= n <= MAX_SPLITS:
        raise ValueError(f"num_splits must be between 0 (heuristic) and {MAX_SPLITS}, got {n}")
    return int(n)


def attention_chunk(x):
    """FlashAttention-3's ``attention_chunk``: an int >= 0 (0: none); with c > 0 query i sees only
    the keys of its chunk, positions [c * floor((i + sk - sq) / c), + c), within its mask."""
    if not _is_int(x):
        raise TypeError(f"attention_chunk must be an int, got {_type(x)}")
    if not 0 <= x <= MAX_SIZE:
        raise ValueError(f"attention_chunk must be 0 (none) or a chunk length in keys, in [1, {MAX_SIZE}], got {x}")
    return int(x)


def chunk_alone(chunk, **others):
    """ValueError naming attention_chunk and the first of ``others`` (name=given) that is given:
    the options a chunked call cannot take."""
    for name, given in others.items():
        if chunk and given:
            raise ValueError(f"attention_chunk cannot be combined with {name}, got attention_chunk={chunk}")


def _real(x, name):
    if type(x) is float:  # (the usual argument, without the ABC check below)
        return x
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {_type(x)}")
    try:
        return float(x)
    except OverflowError:  # an int beyond any float
        return math.inf


def _f32_normal(x: float) -> bool:
    return _F32_TINY <= abs(x) <= _F32_MAX


def scale(softmax_scale, d):
    """The softmax scale (default headdim ** -0.5): positive and finite, and a normal float32
    also times log2(e) (the kernels' exp2-domain factor)."""
    if softmax_scale is None:
        return d ** -0.5
    s = _real(softmax_scale, "softmax_scale")
    if not math.isfinite(s) or s <= 0:
        raise ValueError(f"softmax_scale must be a positive finite number, got {show(softmax_scale)}")
    if not (_f32_normal(s) and _f32_normal(s * _LOG2E)):
        raise ValueError("softmax_scale must be a positive finite number in float32's normal range "
                         f"(the kernels compute in float32), got {show(softmax_scale)}")
    return s


def host_ints(x, name, device_ok=False):
    """An integer array in host memory as a NumPy array (NumPy arrays, CPU tensors and host
    DLPack producers); None when ``x`` is not an array, or (``device_ok``) is a device array that
    the caller reads on the device. Otherwise a device array raises a TypeError: reading it on
    the host would wait for the GPU, and no call path here does."""
    if isinstance(x, np.ndarray):
        a = x
    elif device_ok and _on_device(x):
        return None
    elif arrays._torch_tensor(x):
        if x.device.type != "cpu":
            raise TypeError(f"{name} must be in host memory (ints, a NumPy array or a CPU tensor), got a tensor "
                            f"on {x.device}: reading it would wait for the GPU")
        if x.dtype.is_floating_point or x.dtype.is_complex:
            return np.zeros(0, dtype=np.float32)  # not integers (bf16 has no NumPy form): the caller says so
        a = x.numpy()
    elif arrays._cupy_array(x) or hasattr(x, "__cuda_array_interface__"):
        raise TypeError(f"{name} must be in host memory (ints, a NumPy array or a CPU tensor), got a device "
                        f"{_type(x)}: reading it would wait for the GPU")
    elif hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        if int(x.__dlpack_device__()[0]) in arrays.CUDA_DEVICE_TYPES:
            raise TypeError(f"{name} must be in host memory (ints, a NumPy array or a CPU tensor), got a device "
                            f"{_type(x)}: reading it would wait for the GPU")
        a = np.from_dlpack(x)
    else:
        return None
    return a


def _on_device(x) -> bool:
    """x is an array in device memory (a CUDA tensor, a CuPy array, a CUDA DLPack producer or
    one of cuflash's own device views)."""
    if type(x) is arrays.View:
        return x.device >= 0
    if arrays._torch_tensor(x):
        return x.device.type != "cpu"
    if arrays._cupy_array(x) or hasattr(x, "__cuda_array_interface__"):
        return True
    return (hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__")
            and int(x.__dlpack_device__()[0]) in arrays.CUDA_DEVICE_TYPES)


def window_pair(window_size):
    """flash-attn's window_size as two Python ints, range unchecked: a tuple or list of two ints
    (NumPy ints and 0-d integer arrays of host memory included), or a 2-element integer array in
    host memory (NumPy, a CPU tensor). A device array is a TypeError (see host_ints): converting it
    would synchronise with the GPU."""
    if type(window_size) in (tuple, list) and len(window_size) == 2 and all(type(w) is int for w in window_size):
        return window_size[0], window_size[1]  # (the usual form: every call passes here)

    def bad():
        return TypeError(f"window_size must be a pair of ints (left, right), got {show(window_size)}")
    a = host_ints(window_size, "window_size")
    if a is not None:
        if a.dtype.kind not in "iu" or a.shape != (2,):
            raise bad()
        return int(a[0]), int(a[1])
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise bad()
    out = []
    for w in window_size:
        if _is_int(w):
            out.append(int(w))
            continue
        a = host_ints(w, "window_size")
        if a is None or a.dtype.kind not in "iu" or a.shape != ():
            raise bad()
        out.append(int(a))
    return tuple(out)


def window(window_size):
    """cuflash's window: window_pair's forms, each entry >= -1 (-1 = unbounded)."""
    left, right = window_pair(window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= 0, or -1 for unbounded; got {show(window_size)}")
    return (left, right)


def softcap(cap, scale_):
    """The softcap (0 disables it). The kernels compute tanh(score * scale / softcap) and
    multiply by softcap (times log2(e)) in float32, so each of those must be a normal float32."""
    c = _real(cap, "softcap")
    if not math.isfinite(c) or c < 0:
        raise ValueError(f"softcap must be >= 0 and finite (0 disables it), got {show(cap)}")
    if c > 0 and not all(_f32_normal(x) for x in (c, c * _LOG2E, 1 / c)):
        raise ValueError("softcap must be 0 or in float32's normal range (the kernels compute in "
                         f"float32), got {show(cap)}")
    if c > 0 and not _f32_normal(scale_ / c):
        raise ValueError("softmax_scale / softcap must be in float32's normal range (the kernels "
                         "compute tanh(score * softmax_scale / softcap) in float32), "
                         f"got {show(scale_)} / {show(cap)}")
    return c


class Shape:
    """A shape-only stand-in for an array, so plans can be made from tuples."""

    def __init__(self, shape, dtype, name):
        if not all(_is_int(s) for s in shape):
            raise TypeError(f"{name} must be an array or a shape tuple of ints, got {show(tuple(shape))}")
        if any(s < 0 for s in shape):
            raise ValueError(f"{name} must have sizes >= 0, got {show(tuple(shape))}")
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.strides = arrays.contiguous_strides(self.shape)
        self.ptr = 0
        self.device = SHAPE_ONLY
        self.framework = "shape"
        self.array = None


def alibi(alibi_slopes, batch, nheads, q):
    """(view, batch stride) of float32 slopes shaped (nheads,) or (batch, nheads), or (None, 0).
    ``alibi_slopes`` may be a Shape (cuflash.plan)."""
    if alibi_slopes is None:
        return None, 0
    a = alibi_slopes if isinstance(alibi_slopes, Shape) else view(alibi_slopes, "alibi_slopes")
    if a.dtype != "float32":
        raise TypeError(f"alibi_slopes must be float32, got {a.dtype}")
    if tuple(a.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}), got {shape_str(a)}")
    if nheads > 1 and a.strides[-1] != 1:
        raise ValueError(f"alibi_slopes must be contiguous in its last dim, got strides {tuple(a.strides)}")
    batch_stride = a.strides[0] if len(a.shape) == 2 else 0
    if batch_stride > INT32_MAX:
        raise ValueError(f"alibi_slopes' batch stride must be at most {INT32_MAX} (a 32-bit kernel "
                         f"argument), got {batch_stride}")
    same_place(("q", q), ("alibi_slopes", a))
    return a, batch_stride


SINK_DTYPES = ("float32", "bfloat16", "float16")


def sinks(x, nheads, q=None):
    """The view of attention sinks (one logit per query head: (nheads,) float32, bfloat16 or
    float16, contiguous, on q's place unless q is None), or None. ``x`` may be a Shape
    (cuflash.plan). Values in
    host memory (NumPy) must be finite; device values are not read (no host synchronisation), so
    a non-finite sink on the device is the caller's contract."""
    if x is None:
        return None
    s = x if isinstance(x, Shape) else view(x, "sinks")
    if s.dtype not in SINK_DTYPES:
        raise TypeError(f"sinks must be float32, bfloat16 or float16 (one logit per query head), got {s.dtype}")
    if tuple(s.shape) != (nheads,):
        raise ValueError(f"sinks must have shape (nheads,) = ({nheads},), got {shape_str(s)}")
    if nheads > 1 and s.strides[0] != 1:
        raise ValueError(f"sinks must be contiguous, got strides {tuple(s.strides)}")
    if s.framework == "numpy":
        bad = ~np.isfinite(s.array.astype(np.float64))
        if bad.any():
            h = int(np.argmax(bad))
            raise ValueError(f"sinks must be finite, got {s.array[h]} at head {h}")
    if q is not None:
        same_place(("q", q), ("sinks", s))
    return s


NO_MODS = ((-1, -1), 0.0, None, 0)


def mods(window_size, cap, alibi_slopes, batch, nheads, q, scale_):
    """Window, softcap and ALiBi arguments -> (window, softcap, alibi view, alibi batch stride);
    ``scale_`` is the checked softmax scale."""
    if (alibi_slopes is None and type(cap) is float and cap == 0.0 and type(window_size) is tuple
            and len(window_size) == 2 and type(window_size[0]) is int and type(window_size[1]) is int
            and window_size == (-1, -1)):
        return NO_MODS  # the defaults (the common case, kept cheap; == only on ints)
    w = window(window_size)
    c = softcap(cap, scale_)
    a, a_sb = alibi(alibi_slopes, batch, nheads, q)
    return w, c, a, a_sb


# ---------------------------------------------------------------------------------------------
# cuflash.plan's own arguments

def dtype_name(dtype):
    if not isinstance(dtype, str) or dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype must be one of {SUPPORTED_DTYPES}, got {show(dtype)}")
    return dtype


def heuristic(h):
    if not isinstance(h, str):
        raise TypeError(f"heuristic must be 'cuflash' or 'fa2', got {show(h)}")
    if h not in ("cuflash", "fa2"):
        raise ValueError(f"heuristic must be 'cuflash' or 'fa2', got {show(h)}")
    return h


KV_CACHES = {None: "dense", "contiguous": "cache", "paged": "paged"}


def plan_source(varlen, kv_cache, page_size, cache_leftpad, backward):
    """cuflash.plan's K/V source: (varlen, Problem.kv, page_size, leftpad). ``kv_cache`` None,
    "contiguous" (attention_with_kvcache without a block table) or "paged" (with one; then
    ``page_size``, rows per page: any positive count); ``cache_leftpad`` only with a cache
    (attention_with_kvcache's); ``varlen`` (attention_varlen) with dense K/V or a paged cache; no
    backward over a cache."""
    varlen = boolean(varlen, "varlen")
    leftpad = boolean(cache_leftpad, "cache_leftpad")
    if not (kv_cache is None or isinstance(kv_cache, str)) or kv_cache not in KV_CACHES:
        raise ValueError(f"kv_cache must be None, 'contiguous' or 'paged', got {show(kv_cache)}")
    kv = KV_CACHES[kv_cache]
    if kv == "paged":
        if not _is_int(page_size) or page_size < 1:
            raise ValueError(f"page_size must be a positive int with kv_cache='paged', got {show(page_size)}")
    elif page_size is not None:
        raise ValueError(f"page_size goes with kv_cache='paged', got page_size={show(page_size)} and "
                         f"kv_cache={show(kv_cache)}")
    if leftpad and (kv == "dense" or varlen):
        raise ValueError(f"cache_leftpad goes with kv_cache='contiguous' or 'paged' and varlen=False, got "
                         f"kv_cache={show(kv_cache)}, varlen={varlen}")
    if varlen and kv == "cache":
        raise ValueError("varlen=True cannot be combined with kv_cache='contiguous': packed sequences read dense "
                         "K/V or a paged cache (attention_varlen's block_table)")
    if backward and kv != "dense":
        raise ValueError(f"backward=True has no KV cache (kv_cache={show(kv_cache)}): the backward reads dense K/V")
    return varlen, kv, int(page_size or 0), leftpad


def num_sms(n):
    """A GPU's SM count (cuflash.plan's target): a positive int, at most 2**16."""
    if not _is_int(n) or n < 1:
        raise ValueError(f"num_sms must be a positive int, got {show(n)}")
    if n > 2**16:
        raise ValueError(f"num_sms must be at most 65536 (an SM count), got {show(n)}")
    return int(n)


_ARCH = re.compile(r"(?:sm_?)?(\d{2,3})a?", re.IGNORECASE)


def arch(a) -> int:
    """80, "80", "sm_80", "sm80", "sm_90a" (Hopper's arch-specific features: cuflash picks
    them itself) -> 80 or 90. cuflash needs compute capability 8.0 or newer."""
    m = _ARCH.fullmatch(a) if isinstance(a, str) else None
    if _is_int(a) or m:
        cc = int(a) if m is None else int(m.group(1))
        if 80 <= cc <= 999:
            return cc
        raise ValueError(f"arch must be 80 (sm_80) or newer: cuflash's kernels need compute capability "
                         f"8.0+, got {show(a)}")
    raise ValueError(f"arch must look like 'sm_90' or 90, got {show(a)}")


# ---------------------------------------------------------------------------------------------
# FlashMask (cuflash.masks, cuflash.plan, cuflash.reference)

# The row-bound columns of startend_row_indices by its last dim, with causal=True and False
# (PaddlePaddle's flashmask_attention).
FLASHMASK_COLUMNS = {True: {1: "LTS", 2: "LTS, LTE"}, False: {2: "LTS, UTE", 4: "LTS, LTE, UTS, UTE"}}


def check_startend_row_indices(x, batch, nheads, seqlen_q, seqlen_k, causal, *, nheads_k=None,
                               window=(-1, -1), alibi=False, num_splits=0, sinks=False):
    """FlashMask's int32 ``startend_row_indices`` of shape (batch, 1 or nheads_k or nheads,
    seqlen_k, n), n in {1, 2} with causal=True and {2, 4} without -> its view (a ``Shape`` stays
    one). Row bounds are checked when the values are on the host (NumPy): each in
    [0, seqlen_q], and LTS <= LTE, UTS <= UTE where both are given. As in Paddle, a window
    cannot be combined with the indices (build it into them: cuflash.masks.sliding_window), nor
    can ALiBi (``alibi``: slopes were given), attention sinks (``sinks``: they were given) or
    ``num_splits > 1``; these are named first."""
    nheads_k = nheads if nheads_k is None else nheads_k
    name = "startend_row_indices"
    if tuple(window) != (-1, -1):
        raise ValueError(f"{name} cannot be combined with window_size (as in Paddle's flashmask_attention), "
                         f"got window_size={show(tuple(window))}: build the window into the indices "
                         "(cuflash.masks.sliding_window)")
    if alibi:
        raise ValueError(f"{name} cannot be combined with alibi_slopes")
    if sinks:
        raise ValueError(f"{name} cannot be combined with sinks (attention sinks)")
    if num_splits > 1:
        raise ValueError(f"{name} cannot be combined with num_splits={num_splits}")
    v = x if isinstance(x, Shape) else view(x, name)
    if v.dtype != "int32":
        raise TypeError(f"{name} must be int32, got {v.dtype}")
    ns = FLASHMASK_COLUMNS[bool(causal)]
    heads = "|".join(str(h) for h in dict.fromkeys((1, nheads_k, nheads)))
    shape = shape_str(v)
    if len(shape) != 4:
        raise ValueError(f"{name} must have 4 dims (batch, heads, seqlen_k, n), got shape {shape}")
    if shape[0] != batch or shape[1] not in (1, nheads_k, nheads) or shape[2] != seqlen_k:
        raise ValueError(f"{name} must have shape (batch, 1 or nheads_k or nheads, seqlen_k, n) = "
                         f"({batch}, {heads}, {seqlen_k}, {'|'.join(map(str, ns))}), got {shape}")
    if shape[3] not in ns:
        raise ValueError(f"the last dim of {name} must be " + " or ".join(f"{n} ({c})" for n, c in ns.items())
                         + f" with causal={bool(causal)}, got {shape[3]}")
    if v.framework == "numpy" and v.array.size:
        a = v.array
        bad = (a < 0) | (a > seqlen_q)
        if bad.any():
            at = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"{name} must lie in [0, seqlen_q] = [0, {seqlen_q}], got {a[at]} at {at}")
        cols = ns[shape[3]].split(", ")
        for s, e in (("LTS", "LTE"), ("UTS", "UTE")):
            if s in cols and e in cols:
                lo, hi = a[..., cols.index(s)], a[..., cols.index(e)]
                if (lo > hi).any():
                    at = tuple(int(i) for i in np.argwhere(lo > hi)[0])
                    raise ValueError(f"{name} must have {s} <= {e} in every key column, got {s}={lo[at]} > "
                                     f"{e}={hi[at]} at (batch, head, key) = {at}")
    return v


def dropout_p(p):
    """The attention-dropout probability: a real in [0, 1) (1 would drop everything and scale by
    1 / 0), as a float."""
    x = _real(p, "dropout_p")
    if not 0.0 <= x < 1.0:  # NaN fails too
        raise ValueError(f"dropout_p must be a float in [0, 1), got {show(p)}")
    return x


def seed_offset(seed, offset, needed):
    """The dropout call's Philox (seed, offset), each an int in [0, 2**64): the mask is a pure
    function of them (cuflash.reference.dropout_keep_mask). ``needed``: dropout_p > 0, where a
    missing seed is an error (a seed the caller does not know could not recompute the mask in
    the backward)."""
    out = []
    for name, x in (("seed", seed), ("offset", offset)):
        if x is None and name == "seed" and not needed:
            out.append(0)
            continue
        if x is None:
            raise ValueError("dropout_p > 0 needs seed (an int in [0, 2**64)): the mask is a function of "
                             "(seed, offset), which the backward needs too")
        if not _is_int(x):
            raise TypeError(f"{name} must be an int, got {_type(x)}")
        if not 0 <= x < 1 << 64:
            raise ValueError(f"{name} must be in [0, 2**64), got {x}")
        out.append(int(x))
    return tuple(out)


def dropout(p, seed, offset, num_splits, sv, startend_row_indices):
    """(dropout_p, seed, offset) after their checks, or None without dropout; what dropout cannot
    be combined with is named (flash-attn applies dropout in training only: no split, no cache)."""
    p = dropout_p(p)
    seed, offset = seed_offset(seed, offset, p > 0)
    if p == 0:
        return None
    for bad, what in ((num_splits > 1, f"num_splits={num_splits}"), (sv is not None, "sinks (attention sinks)"),
                      (startend_row_indices is not None, "startend_row_indices (FlashMask)")):
        if bad:
            raise ValueError(f"dropout_p > 0 cannot be combined with {what}")
    return p, seed, offset


def dropout_kwargs(drop) -> dict:
    """dropout()'s result as the keyword arguments of an entry point."""
    return {} if drop is None else dict(dropout_p=drop[0], seed=drop[1], offset=drop[2])


def flashmask(indices, qv, kv, causal, num_splits, mods, sinks=False):
    """The view of ``startend_row_indices`` after its checks (the options it cannot be combined
    with are named first)."""
    window, _, alibi, _ = mods
    fm = check_startend_row_indices(indices, qv.shape[0], qv.shape[2], qv.shape[1], kv.shape[1], causal,
                                    nheads_k=kv.shape[2], window=window, alibi=alibi is not None,
                                    num_splits=num_splits, sinks=sinks)
    same_place(("q", qv), ("startend_row_indices", fm))
    return fm
