"""FP8 (e4m3) attention forward: cuflash.attention with float8_e4m3fn q, k, v (FlashAttention-3's
FP8 forward, its descale arguments and its bf16 output).

Checks every argument before any launch, then runs kernels/fwd_fp8.py (V^T copy, forward) on q's
device and stream. Forward only: there is no FP8 backward (as in FlashAttention-3).
"""
from __future__ import annotations

import sys
from typing import NamedTuple

from . import arrays, validate
from .kernels import fwd_fp8
from .plan import cached_on_plans

FP8_DTYPES = ("float8_e4m3fn",)
OUT_DTYPE = "bfloat16"


def _dims(dims) -> str:
    return ", ".join(map(str, dims[:-1])) + f" and {dims[-1]}"


def _descale(x, name, b, hk, qv):
    """A (batch, nheads_k) float32 descale on q's device (dims of 1 broadcast), or None. Its values
    are read on the device (positive and finite, as scale factors are: not checked, which would
    need a synchronisation)."""
    if x is None:
        return None
    dv = validate.view(x, name)
    if dv.dtype != "float32":
        raise TypeError(f"{name} must be float32, got {dv.dtype}")
    if len(dv.shape) != 2 or dv.shape[0] not in (1, b) or dv.shape[1] not in (1, hk):
        raise ValueError(f"{name} must have shape (batch, nheads_k) = ({b}, {hk}) (a dim of 1 broadcasts), "
                         f"got {validate.shape_str(dv)}")
    validate.same_place(("q", qv), (name, dv))
    return dv


def _unsupported(**given):
    for name, (value, default) in given.items():
        same = value is default or isinstance(value, (bool, int, float, tuple)) and value == default
        if value is not None and not same:
            raise NotImplementedError(f"{name} is not supported with float8_e4m3fn inputs (cuflash's FP8 forward "
                                      f"has a causal mask, GQA and the descales; got {name}={validate.show(value)})")


def attention_fp8(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, out=None, num_splits=0,
                  window_size=(-1, -1), softcap=0.0, alibi_slopes=None, startend_row_indices=None, sinks=None,
                  dropout_p=0.0, q_descale=None, k_descale=None, v_descale=None, views=None):
    """cuflash.attention's FP8 path (its docstring says what is supported); ``views``: q, k and v's
    views when the caller has made them."""
    given = (q_descale, k_descale, v_descale)
    sig = _signature(q, k, v, out, causal, softmax_scale, return_lse, num_splits, window_size, softcap, alibi_slopes,
                     startend_row_indices, sinks, dropout_p, given)
    repeat = arrays.repeat_lookup(_repeats, sig)
    if repeat is not None:
        res = repeat(q, k, v, out, given)
        if res is not None:
            return res
    qv, kv, vv = views or (validate.view(q, "q"), validate.view(k, "k"), validate.view(v, "v"))
    for name, x in (("q", qv), ("k", kv), ("v", vv)):  # (before operands: its message is for fp16/bf16)
        if x.dtype not in FP8_DTYPES:
            raise TypeError(f"{name} must be float8_e4m3fn like q (FP8 attention takes q, k and v in e4m3), "
                            f"got {x.dtype}")
    validate.operands(qv, kv, vv, dtypes=FP8_DTYPES)
    b, sq, h, d = qv.shape
    sk, hk = kv.shape[1], kv.shape[2]
    if d not in fwd_fp8.HEAD_DIMS:
        raise ValueError(f"FP8 attention takes head dims {_dims(fwd_fp8.HEAD_DIMS)}, got {d}")
    for name, x in (("q", qv), ("k", kv)):  # read by the TMA: 16-byte aligned rows, positive strides
        if x.ptr % 16 or any(s <= 0 or s % 16 or s >= 1 << 40 for s in x.strides[:3]):
            raise ValueError(f"{name} must start 16-byte aligned with positive batch, seqlen and head strides in "
                             f"multiples of 16 elements (FP8 operands are read by the TMA), got strides "
                             f"{tuple(x.strides)}")
    scale = validate.scale(softmax_scale, d)
    causal = validate.boolean(causal, "causal")
    return_lse = validate.boolean(return_lse, "return_lse")
    _unsupported(window_size=(tuple(window_size) if isinstance(window_size, (tuple, list)) else window_size, (-1, -1)),
                 softcap=(softcap, 0.0), alibi_slopes=(alibi_slopes, None),
                 startend_row_indices=(startend_row_indices, None), sinks=(sinks, None), dropout_p=(dropout_p, 0.0))
    if validate.num_splits(num_splits) > 1:
        raise NotImplementedError(f"num_splits > 1 is not supported with float8_e4m3fn inputs, got {num_splits}")
    descales = tuple(_descale(x, n, b, hk, qv) for x, n in
                     ((q_descale, "q_descale"), (k_descale, "k_descale"), (v_descale, "v_descale")))
    if qv.device < 0:
        raise TypeError("FP8 attention takes device arrays (PyTorch CUDA tensors), got host arrays")
    ov = None
    if out is not None:
        ov = validate.view(out, "out")
        validate.out(ov, qv, out, dtype=OUT_DTYPE)
        if ov.ptr % 16 or any(s % 8 and n > 1 for s, n in zip(ov.strides[:3], ov.shape[:3])):
            raise ValueError(f"out must start 16-byte aligned, contiguous in its last dim, with strides in multiples "
                             f"of 8 elements, got strides {tuple(ov.strides)}")
        validate.out_apart(ov, ("q", qv), ("k", kv), ("v", vv))
    from .api import device_facts
    if device_facts(qv.device).arch != 90:
        raise NotImplementedError(f"FP8 attention runs on sm_90 (Hopper) GPUs; GPU {qv.device} is "
                                  f"sm_{device_facts(qv.device).arch}")

    o = ov.array if ov is not None else arrays.empty_like_framework(qv, qv.shape, OUT_DTYPE)
    ov = arrays.view(o, "out")
    lse = arrays.empty_like_framework(qv, (b, h, sq), "float32") if return_lse else None
    if b and sq and h:
        if sk == 0:  # no key: O = 0, LSE = +inf (as the bf16 kernels give)
            o[...] = 0
            if lse is not None:
                lse[...] = float("inf")
        else:
            recipe = fwd_fp8.prepare(qv, kv, vv, ov, (h * sq, sq, 1), scale, causal, descales, qv.device)
            with arrays.on_device(qv.device):
                vt = arrays.empty_like_framework(qv, (recipe.vt_bytes,), "uint8")
                fwd_fp8.fire(recipe, arrays.stream_for(qv), qv.ptr, kv.ptr, vv.ptr, ov.ptr,
                             arrays.device_ptr(lse) if lse is not None else 0, arrays.device_ptr(vt),
                             tuple(0 if x is None else x.ptr for x in descales))
            if sig is not None:  # the next call of this signature can skip to the launch
                arrays.repeat_keep(_repeats, sig, _Repeat(recipe, qv.device, (b, h, sq) if return_lse else None))
    res = o if out is not None else arrays.hand_back(o, qv)
    return (res, arrays.hand_back(lse, qv)) if return_lse else res


# ---------------------------------------------------------------------------------------------
# Repeated calls from PyTorch (as cuflash.api's): a call whose shapes, strides, dtypes, devices and
# options passed the checks above and launched before reuses that launch's arguments, so it only
# reads the data pointers, allocates the output and the V^T scratch, and launches.

_repeats: dict = cached_on_plans({})  # signature (see _signature) -> _Repeat


def is_e4m3(x) -> bool:
    """Whether ``x`` is a float8_e4m3fn PyTorch tensor (without importing PyTorch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor) and x.dtype == torch.float8_e4m3fn


def _signature(q, k, v, out, causal, softmax_scale, return_lse, num_splits, window_size, softcap, alibi_slopes,
               startend_row_indices, sinks, dropout_p, descales):
    """What the checks and the launch arguments of an FP8 call on PyTorch tensors depend on, but
    the data pointers (arrays.repeat_signature); None for calls given an option FP8 refuses (the
    general path raises)."""
    if alibi_slopes is not None or startend_row_indices is not None or sinks is not None:
        return None
    return arrays.repeat_signature((q, k, v, out, *descales), window_size,
                                   (causal, softmax_scale, return_lse, num_splits, softcap, dropout_p))


class _Repeat(NamedTuple):
    recipe: object           # kernels/fwd_fp8.Recipe
    device: int
    lse_shape: tuple | None  # (batch, nheads, seqlen_q) when the LSE is returned

    def __call__(self, q, k, v, out, descales):
        """The call's result, or None when it needs the general path (a pointer the TMA cannot
        read, or another planned variant)."""
        r = self.recipe
        if fwd_fp8.planned(r.variant.head_dim, r.variant.causal) is not r.variant:
            return None
        torch = sys.modules["torch"]
        ops = arrays.repeat_operands(q, k, v, out, lambda: q.new_empty(q.shape, dtype=torch.bfloat16))
        if ops is None:
            return None
        qp, kp, vp, op, out = ops
        lse = None if self.lse_shape is None else q.new_empty(self.lse_shape, dtype=torch.float32)
        vt = q.new_empty((r.vt_bytes,), dtype=torch.uint8)  # held until the launches are queued
        args = (r, arrays.torch_stream(self.device), qp, kp, vp, op, 0 if lse is None else lse.data_ptr(),
                vt.data_ptr(), tuple(0 if x is None else x.data_ptr() for x in descales))
        if arrays.current_device_id() == self.device:
            fwd_fp8.fire(*args)
        else:
            with arrays.on_device(self.device):
                fwd_fp8.fire(*args)
        return (out, lse) if lse is not None else out


def make_plan(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, causal, return_lse, facts):
    """The plan of an FP8 call of these sizes on a device described by ``facts``: the V^T copy,
    then the FP8 forward, and why."""
    from .plan import Launch, Plan, Problem, cdiv
    if head_dim not in fwd_fp8.HEAD_DIMS:
        raise ValueError(f"FP8 attention takes head dims {_dims(fwd_fp8.HEAD_DIMS)}, got {head_dim}")
    if facts.arch != 90:
        raise NotImplementedError(f"FP8 attention runs on sm_90 (Hopper) GPUs, not sm_{facts.arch}")
    problem = Problem(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, "e4m3", causal, return_lse, 1)
    v, vt = fwd_fp8.planned(head_dim, causal), fwd_fp8.VtVariant(head_dim=head_dim, arch=90)
    kp = fwd_fp8.keys_pad(seqlen_k)
    scratch = batch * nheads_k * head_dim * kp
    runs = batch and seqlen_q and nheads and seqlen_k
    launches = (Launch(vt, vt.grid(batch, seqlen_k, nheads_k), vt.threads, 0),
                Launch(v, v.grid(batch, seqlen_q, nheads), v.threads, v.smem_bytes)) if runs else ()
    reason = (f"float8_e4m3fn inputs run the FP8 forward (FlashAttention-3's): first {vt.name} writes V^T "
              f"({scratch} B of scratch: (batch, heads_k, d, {kp} keys), the keys of each group of 32 in the order "
              f"P's accumulator fragment holds them, as 8-bit wgmma reads both operands K-major), then {v.name} "
              f"runs {fwd_fp8.BLOCK_M}-row query tiles over {v.block_n}-key K/V tiles with e4m3 wgmma products "
              f"(fp32 accumulators, P rounded to e4m3, bf16 out), never split (num_splits > 1 is not supported "
              f"with e4m3)" if runs else "nothing to compute (an empty dim)")
    return Plan(problem, facts, launches, 1, cdiv(seqlen_k, v.block_n), False, seqlen_q, nheads,
                nheads // max(nheads_k, 1), causal, (-1, -1), scratch if runs else 0, (), reason)
