"""User arguments -> validated Problem -> Plan -> launch, with flash-attn's semantics.

Everything up to the launch is checked before any kernel runs, so bad input raises a
ValueError/TypeError naming the argument and leaves ``out`` untouched.
"""
from __future__ import annotations

import functools
import math
import numbers
import sys
from typing import NamedTuple

import numpy as np

from . import arrays, launch
from .plan import MAX_SPLITS, DeviceFacts, Problem, make_plan

SUPPORTED_DTYPES = ("float16", "bfloat16")


def _shape_str(v):
    return tuple(int(s) for s in v.shape)


def _check_operands(q, k, v, same_batch=True, names=("q", "k", "v")):
    """Rank, dtype, shape and layout rules shared by every entry point (views in). A KV cache's
    batch dim may differ from q's (cache_batch_idx, pages): ``same_batch=False``."""
    nq, nk, nv = names
    for name, x in ((nq, q), (nk, k), (nv, v)):
        if len(x.shape) != 4:
            raise ValueError(f"{name} must have 4 dims (batch, seqlen, nheads, headdim); "
                             f"got shape {_shape_str(x)}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q must be float16 or bfloat16, got {q.dtype}; cast it first "
                        "(e.g. q.to(torch.bfloat16) or q.astype(cupy.float16))")
    for name, x in ((nk, k), (nv, v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}; cast it first")
    b, _, h, d = q.shape
    if same_batch and k.shape[0] != b:
        raise ValueError(f"{nk} must have q's batch size {b}, got shape {_shape_str(k)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"{nv} must have {nk}'s shape {_shape_str(k)}, got {_shape_str(v)}")
    if k.shape[3] != d:
        raise ValueError(f"{nk} must have q's head dim {d}, got {k.shape[3]} (q {_shape_str(q)}, "
                         f"{nk} {_shape_str(k)})")
    if not 1 <= d <= 256:
        raise ValueError(f"head dim (last dim of q and k) must be between 1 and 256, got {d}")
    hk = k.shape[2]
    if hk == 0 or h % hk:
        raise ValueError(f"nheads ({h}) must be divisible by nheads_k ({hk})")
    for name, x in ((nq, q), (nk, k), (nv, v)):
        if x.shape[3] > 1 and x.strides[3] != 1 and 0 not in x.shape:
            raise ValueError(f"{name} must be contiguous in its last dim (stride 1), "
                             f"got strides {tuple(x.strides)}")
    _check_same_place((nq, q), (nk, k), (nv, v))


def _check_same_place(*named):
    (n0, x0), *rest = named
    if x0.device == -2:  # shapes only (cuflash.plan)
        return
    for name, x in rest:
        if (x.device < 0) != (x0.device < 0):
            where = lambda y: "host memory" if y.device < 0 else f"GPU {y.device}"
            raise ValueError(f"{name} is in {where(x)} but {n0} is in {where(x0)}; "
                             "host arrays cannot be mixed with device arrays")
        if x.device != x0.device:
            raise ValueError(f"{name} is on GPU {x.device} but {n0} is on GPU {x0.device}; "
                             "all arrays must be on one device")
    if x0.framework == "torch" and x0.device < 0:
        raise ValueError(f"{n0} is a CPU tensor; move it to the GPU (e.g. {n0}.cuda())")


def _check_out(out, q, original=None):
    """``original`` is the object the caller passed (host ``out`` must be a writable ndarray)."""
    if out.framework == "dlpack":
        raise TypeError("out must be a PyTorch, CuPy or NumPy array (arrays written in place); "
                        f"got {type(out.array[0]).__name__}")
    if out.framework != q.framework:
        raise TypeError(f"out must be a {q.framework} array like q, got a {out.framework} array")
    if original is not None and out.framework == "numpy" and not (
            isinstance(original, np.ndarray) and original.flags.writeable):
        raise TypeError(f"out in host memory must be a writable NumPy array, got {type(original).__name__}")
    if tuple(out.shape) != tuple(q.shape):
        raise ValueError(f"out must have q's shape {_shape_str(q)}, got {_shape_str(out)}")
    if out.dtype != q.dtype:
        raise TypeError(f"out must have q's dtype {q.dtype}, got {out.dtype}")
    _check_same_place(("q", q), ("out", out))
    if out.shape[-1] > 1 and out.strides[-1] != 1 and 0 not in out.shape:
        raise ValueError(f"out must be contiguous in its last dim, got strides {tuple(out.strides)}")


def _check_scale(softmax_scale, d):
    if softmax_scale is None:
        return d ** -0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale}")
    return float(softmax_scale)


def _check_causal(causal):
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")


def _check_num_splits(num_splits):
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be an int, got {type(num_splits).__name__}")
    if not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be between 0 (heuristic) and {MAX_SPLITS}, got {num_splits}")
    return int(num_splits)


def _check_window(window_size):
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(isinstance(w, bool) or not isinstance(w, numbers.Integral) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= 0, or -1 for unbounded; got {window_size!r}")
    return (left, right)


def _check_softcap(softcap):
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number, got {type(softcap).__name__}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be >= 0 and finite (0 disables it), got {softcap}")
    return float(softcap)


def _check_alibi(alibi_slopes, batch, nheads, like):
    """(view, batch stride) of float32 slopes shaped (nheads,) or (batch, nheads), or (None, 0)."""
    if alibi_slopes is None:
        return None, 0
    a = alibi_slopes if isinstance(alibi_slopes, _Shape) else arrays.view(alibi_slopes, "alibi_slopes")
    if a.dtype != "float32":
        raise TypeError(f"alibi_slopes must be float32, got {a.dtype}")
    if tuple(a.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}), got {_shape_str(a)}")
    if nheads > 1 and a.strides[-1] != 1:
        raise ValueError(f"alibi_slopes must be contiguous in its last dim, got strides {tuple(a.strides)}")
    _check_same_place(("q", like), ("alibi_slopes", a))
    return a, (a.strides[0] if len(a.shape) == 2 else 0)


_NO_MODS = ((-1, -1), 0.0, None, 0)


def _check_mods(window_size, softcap, alibi_slopes, batch, nheads, like):
    """Window, softcap and ALiBi arguments -> (window, softcap, alibi view, alibi batch stride)."""
    if (alibi_slopes is None and type(window_size) is tuple and window_size == (-1, -1)
            and type(softcap) is float and softcap == 0.0):
        return _NO_MODS  # the defaults (the common case, kept cheap)
    window = _check_window(window_size)
    cap = _check_softcap(softcap)
    a, a_sb = _check_alibi(alibi_slopes, batch, nheads, like)
    return window, cap, a, a_sb


def _aligned(x) -> bool:
    """16-byte loads need an aligned base and batch/seq/head strides in multiples of 8 elements."""
    st, sh = x.strides, x.shape
    return (x.ptr % 16 == 0 and (st[0] % 8 == 0 or sh[0] <= 1) and (st[1] % 8 == 0 or sh[1] <= 1)
            and (st[2] % 8 == 0 or sh[2] <= 1))


# ---------------------------------------------------------------------------------------------
# Device facts

@functools.lru_cache(maxsize=None)
def device_facts(device: int) -> DeviceFacts:
    import cupy
    d = cupy.cuda.Device(device)
    return DeviceFacts(d.attributes["MultiProcessorCount"], int(d.compute_capability))


def _current_device() -> int:
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy.cuda.Device().id
    except Exception as e:  # no driver, no device
        raise RuntimeError(f"cuflash needs a CUDA GPU to run attention, and none is available ({e}). "
                           "cuflash.plan(..., num_sms=N) and offline compilation work without one.") from None
    raise RuntimeError("cuflash needs a CUDA GPU to run attention, and none is available.")


# ---------------------------------------------------------------------------------------------
# Entry point

def attention(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, out=None,
              num_splits=0, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """Scaled dot-product attention with flash-attn's ``flash_attn_func`` semantics.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim), float16
    or bfloat16, last dim contiguous, any other strides. nheads must be a multiple of nheads_k
    (MQA/GQA: K/V heads are shared by index, never copied). The causal mask is aligned to the
    bottom-right corner: query i sees keys j <= i + seqlen_k - seqlen_q; a row that sees no key
    gives 0 (and LSE +inf). Returns out (the caller's array type), or (out, lse) with
    ``return_lse=True``, lse being float32 (batch, nheads, seqlen_q) natural-log sum-exp.
    ``num_splits``: 0 lets the plan decide (cuflash's split rule for decode shapes, FA2's
    otherwise; see ``cuflash.plan``), 1 never splits, N > 1 splits K/V N ways.
    ``window_size=(left, right)``: query i sees keys i + sk - sq - left ... i + sk - sq + right
    (-1 = unbounded; causal sets right = 0). ``softcap > 0``: scores become
    softcap * tanh(score / softcap). ``alibi_slopes``: float32 (nheads,) or (batch, nheads),
    adding -slope * |i + sk - sq - j| to the scores.
    """
    sig = _signature(q, k, v, out, causal, softmax_scale, return_lse, num_splits, window_size, softcap,
                     alibi_slopes)
    if sig is not None:
        repeat = _repeats.get(sig)
        if repeat is not None:
            res = repeat(q, k, v, out)
            if res is not None:
                return res
    qv, kv, vv = arrays.view(q, "q"), arrays.view(k, "k"), arrays.view(v, "v")
    _check_operands(qv, kv, vv)
    ov = None
    if out is not None:
        ov = arrays.view(out, "out")
        _check_out(ov, qv, out)
    scale = _check_scale(softmax_scale, qv.shape[3])
    num_splits = _check_num_splits(num_splits)
    _check_causal(causal)
    mods = _check_mods(window_size, softcap, alibi_slopes, qv.shape[0], qv.shape[2], qv)

    if qv.device < 0:  # NumPy in, NumPy out: compute on the current GPU
        dev = _current_device()
        dev_array = lambda x: arrays.to_device(np.asarray(x.array), dev)
        res = attention(dev_array(qv), dev_array(kv), dev_array(vv), causal=causal,
                        softmax_scale=scale, return_lse=return_lse, num_splits=num_splits,
                        window_size=mods[0], softcap=mods[1],
                        alibi_slopes=None if mods[2] is None else dev_array(mods[2]))
        return _host_result(res, qv, out, return_lse)

    return _attention_device(qv, kv, vv, ov, bool(causal), scale, return_lse, num_splits, mods, sig)


def _host_result(res, qv, out, return_lse):
    """A device result handed back as NumPy, written into the caller's ``out`` when given."""
    o, lse = res if return_lse else (res, None)
    o = arrays.hand_back(o, qv)
    if out is not None:
        out[...] = o
        o = out
    return (o, arrays.hand_back(lse, qv)) if return_lse else o


def _padded(x, d_pad):
    """A zero-padded (…, d_pad) copy of a device view when the kernel cannot read it in place."""
    a = x.array[1] if x.framework == "dlpack" else x.array
    buf = arrays.empty_like_framework(x, (*x.shape[:-1], d_pad), x.dtype)
    buf[..., x.shape[-1]:] = 0
    buf[..., :x.shape[-1]] = a
    return arrays.view(buf, "copy")


def _outputs(qv, ov, return_lse):
    """The output view (``out`` or a new array in q's framework) and the LSE array or None:
    (batch, nheads, seqlen_q), or (nheads, total_q) for packed (3-dim) q."""
    if ov is None:
        ov = arrays.view(arrays.empty_like_framework(qv, qv.shape, qv.dtype), "out")
    lse_shape = (qv.shape[1], qv.shape[0]) if len(qv.shape) == 3 else (qv.shape[0], qv.shape[2], qv.shape[1])
    return ov, arrays.empty_like_framework(qv, lse_shape, "float32") if return_lse else None


def _result(o_view, given_out, lse_arr, qv, return_lse):
    """What the call returns: ``out`` itself, or the new output in the caller's framework."""
    o = o_view.array if given_out else arrays.hand_back(o_view.array, qv)
    return (o, arrays.hand_back(lse_arr, qv)) if return_lse else o


def _attention_device(qv, kv, vv, ov, causal, scale, return_lse, num_splits, mods, sig=None):
    b, sq, h, d = qv.shape
    sk, hk = kv.shape[1], kv.shape[2]
    o_view, lse_arr = _outputs(qv, ov, return_lse)
    if b == 0 or sq == 0 or h == 0:
        return _result(o_view, ov is not None, lse_arr, qv, return_lse)

    # Head dims that are not a multiple of 8, or unaligned operands, go through a padded copy
    # (as flash-attn does); everything else is read in place.
    d_pad = -(-d // 8) * 8
    in_place = [d_pad == d and _aligned(x) for x in (qv, kv, vv)]
    qk = [x if ok else _padded(x, d_pad) for x, ok in zip((qv, kv, vv), in_place)]
    direct_out = d_pad == d and _aligned(o_view)
    kernel_out = o_view if direct_out else arrays.view(
        arrays.empty_like_framework(qv, (b, sq, h, d_pad), qv.dtype), "out")

    window, cap, alibi, alibi_sb = mods
    problem = (b, sq, sk, h, hk, d_pad, arrays.DTYPE_NAMES[qv.dtype], causal, return_lse, num_splits,
               window, cap > 0, alibi is not None)
    recipe = _launch(problem, qv, *qk, kernel_out, lse_arr, scale, softcap=cap,
                     alibi=(alibi.ptr, alibi_sb) if alibi is not None else (0, 0))
    if not direct_out:
        o_view.array[...] = kernel_out.array[..., :d]
    elif sig is not None and all(in_place):  # read in place: the next such call can skip to here
        if len(_repeats) >= 1024:
            _repeats.clear()
        contiguous = qv.strides == (sq * h * d, h * d, d, 1)
        _repeats[sig] = _Repeat(recipe, qv.device, (b, h, sq) if return_lse else None, contiguous)
    return _result(o_view, ov is not None, lse_arr, qv, return_lse)


# ---------------------------------------------------------------------------------------------
# Repeated calls from PyTorch: a call whose shapes, strides, dtypes, devices and options were
# checked, planned and launched before reuses that launch's arguments, so it only reads the
# data pointers, allocates the output and launches.

_repeats: dict = {}  # signature (see _signature) -> _Repeat


def _signature(q, k, v, out, causal, softmax_scale, return_lse, num_splits, window_size, softcap,
               alibi_slopes):
    """Everything the checks, the plan and the launch arguments of an ``attention`` call on
    PyTorch CUDA tensors depend on, except the data pointers (values and their types: True is
    not 1); None for other calls. Calls with one signature pass the same checks and launch the
    same kernels with the same arguments."""
    torch = sys.modules.get("torch")
    if (torch is None or q.__class__ is not torch.Tensor or alibi_slopes is not None
            or window_size.__class__ is not tuple or len(window_size) != 2):
        return None
    w0, w1 = window_size
    if w0.__class__ is not int or w1.__class__ is not int:
        return None
    try:
        o = None if out is None else (out.shape, out.stride(), out.dtype, out.get_device())
        return (q.shape, q.stride(), q.dtype, q.get_device(), k.shape, k.stride(), k.dtype,
                k.get_device(), v.shape, v.stride(), v.dtype, v.get_device(), o,
                causal.__class__, causal, softmax_scale.__class__, softmax_scale, return_lse.__class__,
                return_lse, num_splits.__class__, num_splits, w0, w1, softcap.__class__, softcap)
    except (AttributeError, TypeError, RuntimeError):  # not all PyTorch tensors (or not strided)
        return None


class _Repeat(NamedTuple):
    recipe: launch.Recipe
    device: int
    lse_shape: tuple | None  # (batch, nheads, seqlen_q) when the LSE is returned
    q_contiguous: bool       # torch.empty_like(q) is then the contiguous output

    def __call__(self, q, k, v, out):
        """The call's result, or None when its pointers need the general path (alignment)."""
        qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
        op = 0 if out is None else out.data_ptr()
        if (qp | kp | vp | op) & 15:
            return None
        torch = sys.modules["torch"]
        if out is None:
            out = torch.empty_like(q) if self.q_contiguous else q.new_empty(q.shape)
            op = out.data_ptr()
        lse = None if self.lse_shape is None else q.new_empty(self.lse_shape, dtype=torch.float32)
        dev, recipe = self.device, self.recipe
        stream = arrays.torch_stream(dev)
        workspace, held = launch.workspace(  # a per-call workspace is held until its kernels are queued
            recipe, dev, stream, lambda n: q.new_empty((n,), dtype=torch.float32))
        args = (recipe, dev, stream, qp, kp, vp, op, 0 if lse is None else lse.data_ptr(), workspace)
        if _current_device_id() == dev:
            launch.fire(*args)
        else:
            with arrays.on_device(dev):
                launch.fire(*args)
        return (out, lse) if lse is not None else out


def _current_device_id() -> int:
    """The current CUDA device (CuPy's runtime call, bound on first use)."""
    global _current_device_id
    import cupy
    _current_device_id = cupy.cuda.runtime.getDevice
    return _current_device_id()


_plans: dict = {}


def _plan_for(fields: tuple, device: int, kv: str = "dense", varlen: bool = False):
    """The plan of a call, cached on the call's fields (so a repeated shape builds no Problem)."""
    key = (fields, device, kv, varlen)
    plan = _plans.get(key)
    if plan is None:
        (b, sq, sk, h, hk, d, dtype, causal, return_lse, num_splits, window, softcap, alibi) = fields
        problem = Problem(b, sq, sk, h, hk, d, dtype, causal, return_lse, num_splits, kv=kv,
                          window=window, softcap=softcap, alibi=alibi, varlen=varlen)
        if len(_plans) > 4096:
            _plans.clear()
        plan = _plans[key] = make_plan(problem, device_facts(device))
    return plan


def _launch(problem, like, q, k, v, o, lse_arr, scale, kv="dense", varlen_kv=False, **extra):
    """Plan ``problem`` (the tuple of Problem's first fields, see _plan_for) and launch it on
    ``like``'s stream; ``extra`` goes to launch.prepare (cache, softcap, ALiBi and varlen
    arguments). Returns the prepared launch (its Recipe)."""
    plan = _plan_for(problem, like.device, kv, varlen_kv)
    dev = like.device
    stream = arrays.stream_for(like)
    lse_ptr = arrays.device_ptr(lse_arr) if lse_arr is not None else 0
    with arrays.on_device(dev):
        recipe = launch.prepare(plan, q, k, v, o, scale, dev, **extra)
        workspace, held = launch.workspace(  # a per-call workspace is held until its kernels are queued
            recipe, dev, stream, lambda n: arrays.empty_like_framework(like, (n,), "float32"))
        launch.fire(recipe, dev, stream, q.ptr, k.ptr, v.ptr, o.ptr, lse_ptr, workspace)
    return recipe


# ---------------------------------------------------------------------------------------------
# KV cache

def _check_block_table(block_table, batch, like):
    """The view of an int32 (batch, pages_per_seq) block table with contiguous rows, on q's device."""
    bt = arrays.view(block_table, "block_table")
    if bt.dtype != "int32" or len(bt.shape) != 2 or bt.shape[0] != batch:
        raise ValueError(f"block_table must be int32 of shape ({batch}, pages_per_seq), "
                         f"got {bt.dtype} {_shape_str(bt)}")
    if bt.shape[1] > 1 and bt.strides[1] != 1:
        raise ValueError(f"block_table rows must be contiguous, got strides {tuple(bt.strides)}")
    _check_same_place(("q", like), ("block_table", bt))
    return bt


def _int32_vector(x, name, length, like):
    v = arrays.view(x, name)
    if v.dtype != "int32":
        raise TypeError(f"{name} must be int32, got {v.dtype}")
    if tuple(v.shape) != (length,):
        raise ValueError(f"{name} must have shape ({length},), got {_shape_str(v)}")
    if len(v.strides) and length > 1 and v.strides[0] != 1:
        raise ValueError(f"{name} must be contiguous, got strides {tuple(v.strides)}")
    _check_same_place(("q", like), (name, v))
    return v


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None,
                           cache_batch_idx=None, block_table=None, causal=False, softmax_scale=None,
                           num_splits=0, return_lse=False, out=None, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None):
    """Decode/append attention over a KV cache, with flash-attn's ``flash_attn_with_kvcache``
    semantics.

    q: (batch, seqlen_q, nheads, d). k_cache, v_cache: (batch_cache, capacity, nheads_k, d), or
    paged (num_pages, page_size, nheads_k, d) with ``block_table`` int32 (batch, pages_per_seq)
    and page_size a multiple of 16. New k, v (batch, seqlen_new, nheads_k, d) are written into
    the caches in place at positions cache_seqlens[b] ..., then each sequence attends to its
    cache_seqlens[b] + seqlen_new keys (causal: aligned bottom-right per sequence).
    ``cache_seqlens``: an int, or an int32 device array (batch,), or None for full caches.
    ``cache_batch_idx``: int32 (batch,) rows of a contiguous cache to use. Device arrays are the
    caller's contract, as in flash-attn: lengths must fit the cache and pages must exist.
    ``window_size``, ``softcap`` and ``alibi_slopes`` are those of :func:`attention`, aligned
    per sequence.
    """
    qv = arrays.view(q, "q")
    kc, vc = arrays.view(k_cache, "k_cache"), arrays.view(v_cache, "v_cache")
    _check_operands(qv, kc, vc, same_batch=False, names=("q", "k_cache", "v_cache"))
    if qv.device < 0:
        raise TypeError("attention_with_kvcache needs device arrays: the caches are updated in place")
    b, sq, h, d = qv.shape
    _, cap, hk, _ = kc.shape
    if d % 8:
        raise ValueError(f"head dim must be a multiple of 8 for a KV cache (it is updated in place), got {d}")
    for name, x in (("q", qv), ("k_cache", kc), ("v_cache", vc)):
        if not _aligned(x):
            raise ValueError(f"{name} must be 16-byte aligned with strides in multiples of 8 elements, "
                             f"got strides {tuple(x.strides)}")
    scale = _check_scale(softmax_scale, d)
    _check_causal(causal)
    num_splits = _check_num_splits(num_splits)
    window, softcap, alibi, alibi_sb = _check_mods(window_size, softcap, alibi_slopes, b, h, qv)

    paged = block_table is not None
    if paged:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table (a paged cache)")
        bt = _check_block_table(block_table, b, qv)
        if cap == 0 or cap % 16:
            raise ValueError(f"page size (k_cache.shape[1]) must be a positive multiple of 16, got {cap}")
        page_size, capacity, table = cap, bt.shape[1] * cap, (bt.ptr, bt.strides[0])
    else:
        page_size, capacity, table = 0, cap, (0, 0)
        if cache_batch_idx is None and kc.shape[0] != b:
            raise ValueError(f"k_cache must have q's batch size {b} (or pass cache_batch_idx), "
                             f"got shape {_shape_str(kc)}")
    batch_idx = _int32_vector(cache_batch_idx, "cache_batch_idx", b, qv).ptr if cache_batch_idx is not None else 0

    s_new = 0
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    if k is not None:
        kn, vn = arrays.view(k, "k"), arrays.view(v, "v")
        s_new = kn.shape[1] if len(kn.shape) == 4 else -1
        want = (b, s_new, hk, d)
        for name, x in (("k", kn), ("v", vn)):
            if tuple(x.shape) != want or x.dtype != qv.dtype:
                raise ValueError(f"{name} must be {qv.dtype} of shape (batch, seqlen_new, nheads_k, d) = "
                                 f"{want}, got {x.dtype} {_shape_str(x)}")
            if not _aligned(x) or (d > 1 and x.strides[3] != 1):
                raise ValueError(f"{name} must be contiguous in its last dim and 16-byte aligned, "
                                 f"got strides {tuple(x.strides)}")
            _check_same_place(("q", qv), (name, x))
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is required when appending k and v")

    if cache_seqlens is None:
        seqlens_ptr, seqlen_k_arg = 0, capacity
    elif isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        if not 0 <= cache_seqlens <= capacity - s_new:
            raise ValueError(f"cache_seqlens + seqlen_new must fit the cache: {cache_seqlens} + {s_new} "
                             f"> capacity {capacity}" if cache_seqlens >= 0 else
                             f"cache_seqlens must be >= 0, got {cache_seqlens}")
        seqlens_ptr, seqlen_k_arg = 0, int(cache_seqlens) + s_new
    else:
        seqlens_ptr, seqlen_k_arg = _int32_vector(cache_seqlens, "cache_seqlens", b, qv).ptr, s_new

    ov = None
    if out is not None:
        ov = arrays.view(out, "out")
        _check_out(ov, qv, out)
        if not _aligned(ov):
            raise ValueError("out must be 16-byte aligned with strides in multiples of 8 elements")
    o_view, lse_arr = _outputs(qv, ov, return_lse)
    if b and h:
        if s_new:
            with arrays.on_device(qv.device):
                launch.append_kv(kn, vn, kc, vc, seqlens_ptr, int(cache_seqlens) if not seqlens_ptr else 0,
                                 batch_idx, table, page_size, arrays.stream_for(qv), qv.device,
                                 device_facts(qv.device).arch)
        if sq:
            problem = (b, sq, capacity, h, hk, d, arrays.DTYPE_NAMES[qv.dtype], bool(causal),
                       return_lse, num_splits, window, softcap > 0, alibi is not None)
            _launch(problem, qv, qv, kc, vc, o_view, lse_arr, scale, kv="paged" if paged else "cache",
                    cache=(seqlens_ptr, batch_idx, *table), seqlen_k=seqlen_k_arg, page_size=page_size,
                    softcap=softcap, alibi=(alibi.ptr, alibi_sb) if alibi is not None else (0, 0))
    return _result(o_view, ov is not None, lse_arr, qv, return_lse)


# ---------------------------------------------------------------------------------------------
# Variable-length (packed) batches

def _batched(x, batch, max_len):
    """A packed (total, nheads, d) view seen as (batch, max_len, nheads, d) with the token stride
    as batch stride: the kernels offset sequence b by cu_seqlens[b] tokens."""
    st = x.strides
    return arrays.View(x.ptr, (batch, max_len, x.shape[1], x.shape[2]), (st[0], st[0], st[1], st[2]),
                       x.dtype, x.device, x.framework, x.array)


def _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k):
    """Views of two int32 (batch + 1,) contiguous cumulative-length vectors, and the batch."""
    cq, ck = arrays.view(cu_seqlens_q, "cu_seqlens_q"), arrays.view(cu_seqlens_k, "cu_seqlens_k")
    for name, c in (("cu_seqlens_q", cq), ("cu_seqlens_k", ck)):
        if c.dtype != "int32":
            raise TypeError(f"{name} must be int32, got {c.dtype}")
        if len(c.shape) != 1 or c.shape[0] < 1:
            raise ValueError(f"{name} must have shape (batch + 1,), got {_shape_str(c)}")
        if c.shape[0] > 1 and c.strides[0] != 1:
            raise ValueError(f"{name} must be contiguous, got strides {tuple(c.strides)}")
    if ck.shape != cq.shape:
        raise ValueError(f"cu_seqlens_k must have cu_seqlens_q's shape {_shape_str(cq)}, got {_shape_str(ck)}")
    return cq, ck, cq.shape[0] - 1


def _check_max_seqlen(value, name, limit, what):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value <= limit:
        raise ValueError(f"{name} must be between 0 and {what} ({limit}), got {value}")
    return int(value)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                     alibi_slopes=None, return_lse=False, num_splits=0, block_table=None, out=None):
    """Attention over packed variable-length sequences, with flash-attn's
    ``flash_attn_varlen_func`` semantics.

    q: (total_q, nheads, d); k, v: (total_k, nheads_k, d), or paged (num_pages, page_size,
    nheads_k, d) with ``block_table`` int32 (batch, pages_per_seq). ``cu_seqlens_q`` and
    ``cu_seqlens_k``: int32 device arrays (batch + 1,); sequence b owns rows cu_seqlens_q[b] to
    cu_seqlens_q[b+1] of q (and of k/v, or key rows 0.. of its pages). Sequences may be empty.
    ``max_seqlen_q``/``max_seqlen_k`` only size the grid; the kernels read every bound from
    cu_seqlens on the device, so nothing waits for the GPU. That the offsets are non-decreasing,
    start at 0, end at the tokens given and stay under the maxima is the caller's contract, as in
    flash-attn. Causal masks and windows align bottom-right per sequence. Returns out (total_q,
    nheads, d), or (out, lse) with lse float32 (nheads, total_q). Other arguments as in
    :func:`attention`; ALiBi slopes may be (nheads,) or (batch, nheads).
    """
    qv, kv, vv = arrays.view(q, "q"), arrays.view(k, "k"), arrays.view(v, "v")
    paged = block_table is not None
    if len(qv.shape) != 3:
        raise ValueError(f"q must have 3 dims (total_q, nheads, headdim), got shape {_shape_str(qv)}")
    k_dims = "4 dims (num_pages, page_size, nheads_k, headdim) with block_table" if paged else \
        "3 dims (total_k, nheads_k, headdim)"
    for name, x in (("k", kv), ("v", vv)):
        if len(x.shape) != (4 if paged else 3):
            raise ValueError(f"{name} must have {k_dims}, got shape {_shape_str(x)}")
    cq, ck, batch = _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k)
    total_q, h, d = qv.shape
    if paged:
        bt = _check_block_table(block_table, batch, qv)
        if kv.shape[1] == 0 or kv.shape[1] % 16:
            raise ValueError(f"page size (k.shape[1]) must be a positive multiple of 16, got {kv.shape[1]}")
        if d % 8:
            raise ValueError(f"head dim must be a multiple of 8 with a paged cache, got {d}")
        k_limit, k_what = bt.shape[1] * kv.shape[1], "pages_per_seq * page_size"
    else:
        k_limit, k_what = kv.shape[0], "total_k"
    max_sq = _check_max_seqlen(max_seqlen_q, "max_seqlen_q", total_q, "total_q")
    max_sk = _check_max_seqlen(max_seqlen_k, "max_seqlen_k", k_limit, k_what)
    # Head dims and last-dim strides on the arrays as given, then the dense API's rules on the
    # batched views (dtypes, heads, placement).
    if kv.shape[-1] != d:
        raise ValueError(f"k must have q's head dim {d}, got {kv.shape[-1]} (q {_shape_str(qv)}, k {_shape_str(kv)})")
    for name, x in (("q", qv), ("k", kv), ("v", vv)):
        if x.shape[-1] > 1 and x.strides[-1] != 1 and 0 not in x.shape:
            raise ValueError(f"{name} must be contiguous in its last dim (stride 1), "
                             f"got strides {tuple(x.strides)}")
    if paged:
        for name, x in (("q", qv), ("k", kv), ("v", vv)):
            if not _aligned(x if len(x.shape) == 4 else _batched(x, batch, 1)):
                raise ValueError(f"{name} must be 16-byte aligned with strides in multiples of 8 elements "
                                 f"with a paged cache, got strides {tuple(x.strides)}")
    q4 = _batched(qv, batch, max_sq)
    k4, v4 = (x if paged else _batched(x, batch, max_sk) for x in (kv, vv))
    if paged:
        _check_operands(q4, k4, v4, same_batch=False)
    else:
        if kv.shape != vv.shape:
            raise ValueError(f"v must have k's shape {_shape_str(kv)}, got {_shape_str(vv)}")
        _check_operands(q4, k4, v4)
    for name, c in (("cu_seqlens_q", cq), ("cu_seqlens_k", ck)) + ((("block_table", bt),) if paged else ()):
        _check_same_place(("q", qv), (name, c))
    ov = None
    if out is not None:
        ov = arrays.view(out, "out")
        _check_out(ov, qv, out)
    scale = _check_scale(softmax_scale, d)
    _check_causal(causal)
    num_splits = _check_num_splits(num_splits)
    window, cap, alibi, alibi_sb = _check_mods(window_size, softcap, alibi_slopes, batch, h, qv)

    if qv.device < 0:  # NumPy in, NumPy out: compute on the current GPU
        dev = _current_device()
        dev_array = lambda x: None if x is None else arrays.to_device(np.asarray(x.array), dev)
        res = attention_varlen(dev_array(qv), dev_array(kv), dev_array(vv), dev_array(cq), dev_array(ck),
                               max_sq, max_sk, causal=causal, softmax_scale=scale, window_size=window,
                               softcap=cap, alibi_slopes=dev_array(alibi), return_lse=return_lse,
                               num_splits=num_splits, block_table=dev_array(bt) if paged else None)
        return _host_result(res, qv, out, return_lse)

    o_view, lse_arr = _outputs(qv, ov, return_lse)
    if batch == 0 or total_q == 0 or h == 0 or max_sq == 0:
        if lse_arr is not None:
            lse_arr[...] = np.inf
        return _result(o_view, ov is not None, lse_arr, qv, return_lse)
    d_pad = -(-d // 8) * 8
    if not paged:
        q4, k4, v4 = (x if d_pad == d and _aligned(x) else _batched(_padded(y, d_pad), batch, n)
                      for x, y, n in ((q4, qv, max_sq), (k4, kv, max_sk), (v4, vv, max_sk)))
    o4 = _batched(o_view, batch, max_sq)
    direct_out = d_pad == d and _aligned(o4)
    kernel_out = o4 if direct_out else _batched(arrays.view(
        arrays.empty_like_framework(qv, (total_q, h, d_pad), qv.dtype), "out"), batch, max_sq)
    problem = (batch, max_sq, max_sk, h, kv.shape[-2], d_pad, arrays.DTYPE_NAMES[qv.dtype],
               bool(causal), return_lse, num_splits, window, cap > 0, alibi is not None)
    extra = dict(cache=(0, 0, bt.ptr, bt.strides[0]), page_size=kv.shape[1]) if paged else {}
    _launch(problem, qv, q4, k4, v4, kernel_out, lse_arr, scale, kv="paged" if paged else "dense", varlen_kv=True,
            softcap=cap,
            alibi=(alibi.ptr, alibi_sb) if alibi is not None else (0, 0),
            varlen=(cq.ptr, ck.ptr, total_q), **extra)
    if not direct_out:
        o_view.array[...] = kernel_out.array[..., :d]
    return _result(o_view, ov is not None, lse_arr, qv, return_lse)


# ---------------------------------------------------------------------------------------------
# Planning without running

class _Shape:
    """A shape-only stand-in for an array, so plans can be made from tuples."""

    def __init__(self, shape, dtype):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.strides = tuple(int(np.prod(self.shape[i + 1:])) for i in range(len(self.shape)))
        self.device = -2  # "anywhere": shapes carry no placement
        self.framework = "shape"


def _shape_view(x, name, dtype):
    return _Shape(x, dtype) if isinstance(x, (tuple, list)) else arrays.view(x, name)


def plan(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, num_splits=0,
         heuristic="cuflash", num_sms=None, arch=None, dtype="bfloat16", window_size=(-1, -1),
         softcap=0.0, alibi_slopes=None):
    """The plan ``attention(q, k, v, ...)`` would run: kernels, tiles, grids, splits and why.

    q, k, v may be arrays (any framework, NumPy included) or shape tuples (then ``dtype`` gives
    the element type). ``num_sms``/``arch`` describe the target GPU; without them the current
    GPU is asked. Works on machines with no GPU when ``num_sms`` is given. ``heuristic``:
    "cuflash" (default; decode splits tuned for cuflash's kernels) or "fa2" (FlashAttention-2's
    ``num_splits_heuristic``, to see what FA2 would do). ``window_size``, ``softcap`` and
    ``alibi_slopes`` (an array, a shape tuple, or True) are those of :func:`attention`.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype!r}")
    qv, kv, vv = (_shape_view(x, n, dtype) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    _check_operands(qv, kv, vv)
    _check_scale(softmax_scale, qv.shape[3])
    _check_causal(causal)
    num_splits = _check_num_splits(num_splits)
    b, sq, h, d = qv.shape
    if alibi_slopes is True or isinstance(alibi_slopes, (tuple, list)):
        alibi_slopes = _Shape((h,) if alibi_slopes is True else alibi_slopes, "float32")
    window, cap, alibi, _ = _check_mods(window_size, softcap, alibi_slopes, b, h, qv)
    if num_sms is None:
        dev = device_facts(qv.device if qv.device >= 0 else _current_device())
        facts = DeviceFacts(dev.num_sms, _parse_arch(arch) if arch is not None else dev.arch)
    else:
        if isinstance(num_sms, bool) or not isinstance(num_sms, numbers.Integral) or num_sms < 1:
            raise ValueError(f"num_sms must be a positive int, got {num_sms!r}")
        facts = DeviceFacts(int(num_sms), _parse_arch(arch) if arch is not None else 90)
    problem = Problem(b, sq, kv.shape[1], h, kv.shape[2], -(-d // 8) * 8,
                      arrays.DTYPE_NAMES[qv.dtype], bool(causal), bool(return_lse), num_splits,
                      heuristic, window=window, softcap=cap > 0, alibi=alibi is not None)
    return make_plan(problem, facts)


def _parse_arch(arch) -> int:
    """90, "90", "sm_90" or "sm90" -> 90."""
    s = str(arch).lower().removeprefix("sm_").removeprefix("sm")
    if not s.isdigit():
        raise ValueError(f"arch must look like 'sm_90' or 90, got {arch!r}")
    return int(s)
