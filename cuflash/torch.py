"""PyTorch integration: differentiable attention as ``torch.library`` custom ops, and an attention
backend for Hugging Face transformers.

    import cuflash.torch
    out = cuflash.torch.attention(q, k, v, causal=True)   # autograd and torch.compile aware

    cuflash.torch.register_transformers()                 # attn_implementation="cuFlash"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="cuFlash")

    with cuflash.torch.record_plans() as plans:           # which kernels ran, per shape
        model.generate(...)

The forward and backward passes are the custom ops ``cuflash::attention_fwd`` /
``cuflash::attention_bwd`` (and ``cuflash::attention_varlen_fwd`` / ``..._bwd``), each with a fake
(meta) implementation, so ``torch.compile(fullgraph=True)`` traces through them without a graph
break. Outside of autograd and compilation, :func:`attention` calls :func:`cuflash.attention`
directly (the dispatcher adds host time to every call, which matters when decoding).

This module imports torch; ``import cuflash`` alone never does.
"""
import contextlib
import threading
import warnings
import weakref
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

import cuflash

__all__ = ["attention", "attention_varlen", "register_transformers", "hf_attention_forward",
           "record_plans", "last_plans", "PlanRecord", "HF_NAME"]


# ---------------------------------------------------------------------------------------------
# Argument helpers

def _window(window_size):
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}") from None
    return int(left), int(right)


def _extras(window_left, window_right, softcap, alibi_slopes):
    """Keyword arguments for the kernels' optional features, only where they differ from the
    defaults: builds of cuflash without these features accept every call that does not use them."""
    kw = {}
    if (window_left, window_right) != (-1, -1):
        kw["window_size"] = (window_left, window_right)
    if softcap:
        kw["softcap"] = float(softcap)
    if alibi_slopes is not None:
        kw["alibi_slopes"] = alibi_slopes
    return kw


def _call(fn, what, *args, **kw):
    """``fn(*args, **kw)``; an optional feature that this cuflash build lacks becomes a clear
    NotImplementedError instead of a TypeError about a keyword argument."""
    try:
        return fn(*args, **kw)
    except TypeError as e:
        missing = [n for n in ("window_size", "softcap", "alibi_slopes", "block_table", "dq")
                   if n in kw and repr(n) in str(e) and "unexpected keyword" in str(e)]
        if missing:
            raise NotImplementedError(f"{what} in this cuflash build does not support "
                                      f"{', '.join(missing)}") from e
        raise


def _plain_cuda_tensors(*xs) -> bool:
    """Real CUDA tensors (no fake, functional or other tensor subclasses)."""
    return all(x is None or (type(x) is Tensor and x.is_cuda) for x in xs)


def _route(q, k, v, alibi_slopes=None) -> str:
    """How a call runs: "op", the custom op (torch.compile; fake, functional or other tensor
    subclasses; CPU tensors, which the op reports); "autograd", the op's bodies as an eager
    autograd.Function (real CUDA tensors that need gradients); "direct", the kernels alone."""
    if not (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor and q.is_cuda and k.is_cuda
            and v.is_cuda and (alibi_slopes is None or _plain_cuda_tensors(alibi_slopes))):
        return "op"
    if torch.compiler.is_compiling():
        return "op"
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return "autograd"
    return "direct"


def _wants_op(q, k, v, alibi_slopes=None) -> bool:
    """Go through the custom op (or its eager twin) rather than calling the kernels directly."""
    return _route(q, k, v, alibi_slopes) != "direct"


# ---------------------------------------------------------------------------------------------
# Plan log (off unless ``record_plans`` is active)

class PlanRecord(NamedTuple):
    """One distinct attention call seen while recording: ``plan`` is a :class:`cuflash.plan`
    result (None for varlen calls, which it does not describe)."""
    phase: str                  # "prefill" (seqlen_q > 1), "decode" (seqlen_q == 1) or "varlen"
    q_shape: tuple
    k_shape: tuple
    causal: bool
    plan: object

    @property
    def kernels(self) -> tuple:
        return tuple(self.plan.kernels) if self.plan is not None else ()

    @property
    def num_splits(self) -> int:
        return int(self.plan.num_splits) if self.plan is not None else 1

    def __str__(self):
        what = " + ".join(self.kernels) if self.plan is not None else "(varlen: no plan description)"
        return (f"{self.phase:7s} q={self.q_shape} k={self.k_shape} causal={self.causal}: {what}"
                f"{f' ({self.num_splits} splits)' if self.num_splits > 1 else ''}")


class _PlanLog(list):
    def __init__(self, callback):
        super().__init__()
        self.callback = callback
        self.seen = set()
        self.lock = threading.Lock()


_log: Optional[_PlanLog] = None
_last_log: Optional[_PlanLog] = None


@contextlib.contextmanager
def record_plans(callback: Optional[Callable[[PlanRecord], None]] = None):
    """Record the plan of every distinct attention shape run through this module inside the
    ``with`` block (``cuflash.torch.attention``, ``attention_varlen`` and the transformers
    backend), in order of first use; ``callback(record)`` is called for each new one.

        with cuflash.torch.record_plans() as plans:
            model.generate(...)
        for r in plans: print(r)

    Costs a set lookup per call while active and nothing otherwise."""
    global _log, _last_log
    prev, log = _log, _PlanLog(callback)
    _log = log
    try:
        yield log
    finally:
        _log = prev
        _last_log = log


def last_plans() -> list:
    """The records of the active ``record_plans`` block, or else of the last one."""
    log = _log if _log is not None else _last_log
    return list(log) if log is not None else []


def _record(q, k, causal, extras, varlen=False):
    log = _log
    if log is None:
        return
    win = extras.get("window_size", (-1, -1))
    key = (varlen, tuple(q.shape), tuple(k.shape), q.dtype, bool(causal), win,
           extras.get("softcap", 0.0), "alibi_slopes" in extras)
    with log.lock:
        if key in log.seen:
            return
        log.seen.add(key)
    plan = None
    if not varlen:
        plan_kw = {n: extras[n] for n in ("window_size", "softcap") if n in extras}
        try:
            plan = cuflash.plan(q, k, k, causal=bool(causal), **plan_kw)
        except TypeError:  # a plan that does not depend on these features
            plan = cuflash.plan(q, k, k, causal=bool(causal))
    phase = "varlen" if varlen else ("decode" if q.shape[1] == 1 else "prefill")
    rec = PlanRecord(phase, tuple(q.shape), tuple(k.shape), bool(causal), plan)
    with log.lock:
        log.append(rec)
    if log.callback is not None:
        log.callback(rec)


# ---------------------------------------------------------------------------------------------
# Kernel calls (the bodies of the custom ops; real tensors only)

def _forward_kernel(q, k, v, out, causal, softmax_scale, window_left, window_right, softcap,
                    alibi_slopes, return_lse):
    extras = _extras(window_left, window_right, softcap, alibi_slopes)
    if _log is not None:
        _record(q, k, causal, extras)
    return _call(cuflash.attention, "cuflash.attention", q, k, v, causal=causal,
                 softmax_scale=softmax_scale, return_lse=return_lse, out=out, **extras)


def _varlen_forward_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out,
                           causal, softmax_scale, window_left, window_right, softcap, alibi_slopes,
                           block_table, return_lse):
    fn = getattr(cuflash, "attention_varlen", None)
    if fn is None:
        raise NotImplementedError("this cuflash build has no attention_varlen")
    extras = _extras(window_left, window_right, softcap, alibi_slopes)
    if block_table is not None:
        extras["block_table"] = block_table
    if _log is not None:
        _record(q, k, causal, extras, varlen=True)
    return _call(fn, "cuflash.attention_varlen", q, k, v, cu_seqlens_q, cu_seqlens_k,
                 max_seqlen_q, max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
                 return_lse=return_lse, out=out, **extras)


def _backward_module():
    try:
        from cuflash import backward
    except ImportError as e:
        raise NotImplementedError("this cuflash build has no backward pass (cuflash.backward): "
                                  "attention is forward-only here") from e
    return backward


def _backward_kernel(dout, q, k, v, out, lse, dq, dk, dv, causal, softmax_scale, window_left,
                     window_right, softcap, alibi_slopes, deterministic):
    bwd = _backward_module()
    extras = _extras(window_left, window_right, softcap, alibi_slopes)
    return _call(bwd.attention_backward, "cuflash.backward.attention_backward", dout, q, k, v,
                 out, lse, causal=causal, softmax_scale=softmax_scale, deterministic=deterministic,
                 dq=dq, dk=dk, dv=dv, **extras)


def _varlen_backward_kernel(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, dq, dk, dv, causal, softmax_scale, window_left,
                            window_right, softcap, alibi_slopes, deterministic):
    fn = getattr(_backward_module(), "attention_varlen_backward", None)
    if fn is None:
        raise NotImplementedError("this cuflash build has no varlen backward "
                                  "(cuflash.backward.attention_varlen_backward): "
                                  "attention_varlen is forward-only here")
    extras = _extras(window_left, window_right, softcap, alibi_slopes)
    return _call(fn, "cuflash.backward.attention_varlen_backward", dout, q, k, v, out, lse,
                 cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                 softmax_scale=softmax_scale, deterministic=deterministic, dq=dq, dk=dk, dv=dv,
                 **extras)


def _into(buffers, results):
    """The gradient buffers the op allocated (their layout is the one its fake promises), filled
    with ``results`` where the backward returned other tensors."""
    for buf, got in zip(buffers, results if results is not None else buffers):
        if got is not buf:
            buf.copy_(got)
    return buffers


def _last_dim_contiguous(x):
    """Gradients reaching a backward may be expanded or transposed views; the kernels need a unit
    stride in the last dim (the only copy made here, and only when needed)."""
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


# ---------------------------------------------------------------------------------------------
# Custom ops: dense

@torch.library.custom_op("cuflash::attention_fwd", mutates_args=())
def _attention_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: Optional[float],
                   window_left: int, window_right: int, softcap: float,
                   alibi_slopes: Optional[Tensor], deterministic: bool) -> tuple[Tensor, Tensor]:
    """(out, lse): out like q (contiguous), lse float32 (batch, nheads, seqlen_q).
    ``deterministic`` only matters to the backward pass."""
    return _fwd_body(q, k, v, causal, softmax_scale, window_left, window_right, softcap, alibi_slopes)


def _fwd_body(q, k, v, causal, softmax_scale, window_left, window_right, softcap, alibi_slopes,
              deterministic=False):  # deterministic: taken like the op's inputs, used by the backward
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return _forward_kernel(q, k, v, out, causal, softmax_scale, window_left, window_right, softcap,
                           alibi_slopes, True)


@_attention_fwd.register_fake
def _(q, k, v, causal, softmax_scale, window_left, window_right, softcap, alibi_slopes,
      deterministic):
    b, sq, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, sq), dtype=torch.float32)


@torch.library.custom_op("cuflash::attention_bwd", mutates_args=())
def _attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   causal: bool, softmax_scale: Optional[float], window_left: int,
                   window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
                   deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv), contiguous, shaped like q, k and v."""
    return _bwd_body(dout, q, k, v, out, lse, causal, softmax_scale, window_left, window_right,
                     softcap, alibi_slopes, deterministic)


def _bwd_body(dout, q, k, v, out, lse, causal, softmax_scale, window_left, window_right, softcap,
              alibi_slopes, deterministic):
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    res = _backward_kernel(_last_dim_contiguous(dout), q, k, v, out, lse, dq, dk, dv, causal,
                           softmax_scale, window_left, window_right, softcap, alibi_slopes,
                           deterministic)
    return _into((dq, dk, dv), res)


@_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, causal, softmax_scale, window_left, window_right, softcap,
      alibi_slopes, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, window_left, window_right, softcap, alibi_slopes, det = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes)
    ctx.args = (causal, softmax_scale, window_left, window_right, softcap)
    ctx.deterministic = det
    ctx.mark_non_differentiable(lse)


def _fwd_backward(ctx, dout, dlse, bwd=None):
    q, k, v, out, lse, alibi_slopes = ctx.saved_tensors
    causal, softmax_scale, window_left, window_right, softcap = ctx.args
    dq, dk, dv = (bwd or torch.ops.cuflash.attention_bwd)(
        dout, q, k, v, out, lse, causal, softmax_scale, window_left, window_right, softcap,
        alibi_slopes, ctx.deterministic)
    return dq, dk, dv, None, None, None, None, None, None, None


_attention_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The custom op's forward, autograd context and backward as a plain autograd.Function, for
    eager calls on real CUDA tensors: the same kernels without the custom-op dispatch (about
    0.2 ms of host time per call). Compiled code and fake tensors use the op."""

    forward = staticmethod(_fwd_body)
    setup_context = staticmethod(_fwd_setup_context)

    @staticmethod
    def backward(ctx, dout, dlse):
        return _fwd_backward(ctx, dout, dlse, _bwd_body)


# ---------------------------------------------------------------------------------------------
# Custom ops: varlen (packed sequences)

@torch.library.custom_op("cuflash::attention_varlen_fwd", mutates_args=())
def _attention_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                          cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                          softmax_scale: Optional[float], window_left: int, window_right: int,
                          softcap: float, alibi_slopes: Optional[Tensor],
                          block_table: Optional[Tensor], deterministic: bool) -> tuple[Tensor, Tensor]:
    """(out, lse): out like q (total_q, nheads, d), contiguous; lse float32 (nheads, total_q)."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return _varlen_forward_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  out, causal, softmax_scale, window_left, window_right, softcap,
                                  alibi_slopes, block_table, True)


@_attention_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
      window_left, window_right, softcap, alibi_slopes, block_table, deterministic):
    total_q, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((h, total_q), dtype=torch.float32)


@torch.library.custom_op("cuflash::attention_varlen_bwd", mutates_args=())
def _attention_varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                          max_seqlen_k: int, causal: bool, softmax_scale: Optional[float],
                          window_left: int, window_right: int, softcap: float,
                          alibi_slopes: Optional[Tensor],
                          deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    res = _varlen_backward_kernel(_last_dim_contiguous(dout), q, k, v, out, lse, cu_seqlens_q,
                                  cu_seqlens_k, max_seqlen_q, max_seqlen_k, dq, dk, dv, causal,
                                  softmax_scale, window_left, window_right, softcap, alibi_slopes,
                                  deterministic)
    return _into((dq, dk, dv), res)


@_attention_varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
      softmax_scale, window_left, window_right, softcap, alibi_slopes, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, window_left, window_right, softcap,
     alibi_slopes, block_table, det) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, alibi_slopes)
    ctx.args = (max_q, max_k, causal, softmax_scale, window_left, window_right, softcap)
    ctx.paged = block_table is not None
    ctx.deterministic = det
    ctx.mark_non_differentiable(lse)


def _varlen_backward(ctx, dout, dlse):
    if ctx.paged:
        raise NotImplementedError("attention_varlen with a block_table (a paged KV cache) has no "
                                  "backward pass; run it under torch.no_grad()")
    q, k, v, out, lse, cu_q, cu_k, alibi_slopes = ctx.saved_tensors
    max_q, max_k, causal, softmax_scale, window_left, window_right, softcap = ctx.args
    dq, dk, dv = torch.ops.cuflash.attention_varlen_bwd(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, softmax_scale, window_left,
        window_right, softcap, alibi_slopes, ctx.deterministic)
    return (dq, dk, dv) + (None,) * 12


_attention_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


# ---------------------------------------------------------------------------------------------
# Public functions

def attention(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, deterministic=False, return_lse=False):
    """Differentiable :func:`cuflash.attention` for torch tensors, with flash-attn's
    ``flash_attn_func`` semantics (no dropout).

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim); float16 or
    bfloat16 CUDA tensors, last dim contiguous (other strides are free). ``window_size=(left,
    right)`` (-1 = unbounded), ``softcap`` (0 = off) and ``alibi_slopes`` ((nheads,) or (batch,
    nheads), float32) follow flash-attn. ``deterministic`` asks the backward pass for a
    deterministic reduction. Returns out (contiguous, like q), or (out, lse) with
    ``return_lse=True`` (lse float32 (batch, nheads, seqlen_q), not differentiable).

    Under ``torch.compile`` (or on fake tensors) this runs the ``cuflash::attention_fwd`` custom
    op (backward: ``cuflash::attention_bwd``); eager calls that need gradients run the same
    bodies as a ``torch.autograd.Function``; others call :func:`cuflash.attention` directly.
    """
    window_left, window_right = _window(window_size)
    softcap = float(softcap or 0.0)
    route = _route(q, k, v, alibi_slopes)
    if route == "direct":
        return _forward_kernel(q, k, v, None, causal, softmax_scale, window_left, window_right,
                               softcap, alibi_slopes, return_lse)
    args = (q, k, v, bool(causal), softmax_scale, window_left, window_right, softcap, alibi_slopes,
            bool(deterministic))
    if route == "op":
        out, lse = torch.ops.cuflash.attention_fwd(*args)
    else:
        out, lse = _EagerAttention.apply(*args)
    return (out, lse) if return_lse else out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                     softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                     deterministic=False, return_lse=False, block_table=None):
    """Differentiable :func:`cuflash.attention_varlen` (flash-attn's ``flash_attn_varlen_func``).

    q: (total_q, nheads, d); k, v: (total_k, nheads_k, d) (or a paged cache with
    ``block_table``, forward only); ``cu_seqlens_q``/``cu_seqlens_k``: int32 (batch + 1,)
    cumulative lengths on the GPU; ``max_seqlen_q``/``max_seqlen_k``: Python ints. Each sequence
    is attended on its own (causal and windows aligned bottom-right per sequence). Returns out,
    or (out, lse) with lse float32 (nheads, total_q). The backward pass needs
    ``cuflash.backward.attention_varlen_backward``.
    """
    window_left, window_right = _window(window_size)
    softcap = float(softcap or 0.0)
    if not _wants_op(q, k, v, alibi_slopes):
        return _varlen_forward_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                      int(max_seqlen_k), None, causal, softmax_scale, window_left,
                                      window_right, softcap, alibi_slopes, block_table, return_lse)
    out, lse = torch.ops.cuflash.attention_varlen_fwd(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, bool(causal),
        softmax_scale, window_left, window_right, softcap, alibi_slopes, block_table,
        bool(deterministic))
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# Hugging Face transformers

_warned: set = set()


def _warn_once(key, message):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


class _PerTensorMemo:
    """Remembers results per (tensor, version, extra) for the last few tensors: every layer of a
    forward pass gets the same mask / position_ids tensor (one per layer type), so their
    host-side lengths are read once per pass, not once per layer."""

    def __init__(self, size=4):
        self.size, self.entries = size, []  # [(weakref, key, value)], most recent last

    def get(self, t, extra, compute):
        """``compute(t)``, or its remembered value for the same tensor, version and ``extra``."""
        if torch.compiler.is_compiling():
            return compute(t)
        key = (t._version, extra)
        for ref, k, value in self.entries:
            if ref() is t and k == key:
                return value
        value = compute(t)
        self.entries = [e for e in self.entries if e[0]() is not None][-(self.size - 1):]
        self.entries.append((weakref.ref(t), key, value))
        return value


_mask_memo, _mask_q_memo, _posid_memo = _PerTensorMemo(), _PerTensorMemo(), _PerTensorMemo()


def _unpad_data(mask):
    """(batch, seqlen) mask -> (flat indices of kept tokens, cu_seqlens int32, max length)."""
    mask = mask.bool()
    seqlens = mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    max_len = int(seqlens.max()) if seqlens.numel() else 0  # host read, once per pass
    cu = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return indices, cu, max_len


def _packed_data(position_ids):
    """Batch-1 position_ids of several packed sequences -> (cu_seqlens, max length), or None
    when they are one increasing sequence (read on the host once per pass)."""
    pos = position_ids.reshape(-1)
    starts = (pos == pos.min()).nonzero().flatten().to(torch.int32)
    if starts.numel() <= 1:
        return None
    total = torch.tensor([pos.numel()], dtype=torch.int32, device=pos.device)
    cu = torch.cat([starts, total])
    if int(cu[0]) != 0:
        return None
    return cu, int(cu.diff().max())


def _gather_rows(x, flat_idx, seqlen):
    """x[b, s] for flat indices b * seqlen + s: one gather, whatever x's strides."""
    return x[flat_idx // seqlen, flat_idx % seqlen]


def _sdpa_fallback(module, query, key, value, attention_mask, dropout, scaling, sliding_window,
                   softcap, causal, kwargs, why):
    """PyTorch SDPA through transformers' own backend, for masks cuflash cannot express."""
    if softcap:
        raise NotImplementedError(f"cuflash backend: {why}, and the SDPA fallback has no softcap")
    _warn_once(why, f"cuflash backend: {why}; using PyTorch SDPA for these calls")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    if attention_mask is not None and attention_mask.dim() == 2:
        # padding mask (batch, kv_len) -> boolean (batch, 1, q_len, kv_len) with the causal and
        # sliding-window limits aligned bottom-right; rows that see no key output zeros
        b, _, sq, _ = query.shape
        mask = attention_mask.bool()
        if key.shape[2] > mask.shape[1]:  # static cache longer than the mask
            key, value = key[:, :, :mask.shape[1]], value[:, :, :mask.shape[1]]
        sk = key.shape[2]
        i = torch.arange(sq, device=query.device)[:, None] + (sk - sq)
        j = torch.arange(sk, device=query.device)[None, :]
        vis = mask[:, None, None, :].expand(b, 1, sq, sk)
        if causal:
            vis = vis & (j <= i)
        if sliding_window is not None and sk > sliding_window:
            vis = vis & (j >= i - (sliding_window - 1)) & (j <= i + (sliding_window - 1))
        empty = ~vis.any(dim=-1, keepdim=True)
        out, _ = sdpa_attention_forward(module, query, key, value, vis | empty, dropout=dropout,
                                        scaling=scaling, is_causal=False, **kwargs)
        return out.masked_fill(empty[:, 0, :, :, None], 0), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, is_causal=causal, **kwargs)


def hf_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                         sliding_window=None, softcap=None, is_causal=None, **kwargs):
    """A transformers attention function (``AttentionInterface``) running cuflash.

    query (batch, nheads, q_len, d), key/value (batch, nheads_k, kv_len, d) -> (attn_output
    (batch, q_len, nheads, d), None). Masks come from transformers' flash-attention mask
    function (registered with the backend): None when there is no padding, else a (batch, kv_len)
    padding mask, run through ``attention_varlen``.
    """
    if kwargs.get("output_attentions", False):
        _warn_once("output_attentions", "cuflash backend does not return attention weights "
                   "(output_attentions=True); they are None")
    if dropout:
        raise NotImplementedError(f"cuflash backend has no attention dropout (got {dropout}); "
                                  "use model.eval() or attention_dropout=0.0")
    for name in ("s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"cuflash backend does not support {name}")

    b, h, sq, d = query.shape
    sk = key.shape[2]
    if query.dtype == torch.float32:  # as transformers' flash backend: run in the autocast dtype
        dev = query.device.type
        if torch.is_autocast_enabled(dev):
            dt = torch.get_autocast_dtype(dev)
            query, key, value = query.to(dt), key.to(dt), value.to(dt)
    v_head_dim = value.shape[-1]
    if v_head_dim != d:  # e.g. MLA: pad V to the query head dim, crop the output
        value = torch.nn.functional.pad(value, [0, d - v_head_dim])

    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    causal = causal and sq > 1  # one query row, aligned bottom-right, sees every key
    # transformers' flash convention: a window of `sliding_window` tokens including the current
    # one is flash-attn's window_size=(sliding_window - 1, sliding_window - 1)
    window = (sliding_window - 1, sliding_window - 1) if (
        sliding_window is not None and sk > sliding_window) else (-1, -1)
    cap = float(softcap) if softcap else 0.0
    det = bool(kwargs.get("deterministic") or False)
    feats = dict(causal=causal, softmax_scale=scaling, window_size=window, softcap=cap,
                 deterministic=det)

    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # views
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    position_ids = kwargs.get("position_ids")
    has_varlen = hasattr(cuflash, "attention_varlen")

    if attention_mask is not None and attention_mask.dim() != 2:
        return _crop(_sdpa_fallback(module, query, key, value, attention_mask, dropout, scaling,
                                    sliding_window, cap, causal, _fwd_kwargs(kwargs),
                                    "a prepared 4D attention mask is not supported"), v_head_dim)

    training = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    no_varlen = ("this build lacks cuflash.attention_varlen" if not has_varlen else
                 "this build lacks a varlen backward pass" if training and not _has_varlen_backward()
                 else None)

    if attention_mask is not None:  # padding: unpad, run varlen, pad back
        if no_varlen:
            return _crop(_sdpa_fallback(module, query, key, value, attention_mask, dropout,
                                        scaling, sliding_window, cap, causal, _fwd_kwargs(kwargs),
                                        f"padding masks need varlen attention and {no_varlen}"),
                         v_head_dim)
        mask = attention_mask
        if k.shape[1] > mask.shape[1]:  # a static cache longer than the tokens seen
            k, v = k[:, :mask.shape[1]], v[:, :mask.shape[1]]
        kv_len = k.shape[1]
        idx_k, cu_k, max_k = _mask_memo.get(mask, None, _unpad_data)
        k_u, v_u = _gather_rows(k, idx_k, kv_len), _gather_rows(v, idx_k, kv_len)
        if sq == kv_len:
            idx_q, cu_q, max_q = idx_k, cu_k, max_k
            q_u = _gather_rows(q, idx_q, sq)
        elif sq == 1:
            idx_q = None
            cu_q, max_q = torch.arange(b + 1, dtype=torch.int32, device=q.device), 1
            q_u = q[:, 0]
        else:  # queries are the last sq positions (left padding)
            idx_q, cu_q, max_q = _mask_q_memo.get(mask, sq, lambda m: _unpad_data(m[:, -sq:]))
            q_u = _gather_rows(q, idx_q, sq)
        o_u = attention_varlen(q_u, k_u, v_u, cu_q, cu_k, max_q, max_k, **feats)
        if idx_q is None:
            out = o_u.view(b, 1, h, d)
        else:
            out = o_u.new_zeros((b * sq, h, d)).index_copy(0, idx_q, o_u).view(b, sq, h, d)
        return _crop((out, None), v_head_dim)

    packed = None
    if cu_q is not None and cu_k is not None and max_q is not None and max_k is not None:
        packed = (cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k))
    elif position_ids is not None and b == 1 and sq > 1 and sq == sk:
        pk = _posid_memo.get(position_ids, None, _packed_data)
        if pk is not None:
            packed = (pk[0], pk[0], pk[1], pk[1])
    if packed is not None:  # several sequences packed in one row: each attends on its own
        if no_varlen:
            raise NotImplementedError("cuflash backend: packed sequences (cu_seq_lens or "
                                      "position_ids restarting within a row) need varlen "
                                      f"attention, and {no_varlen}")
        o = attention_varlen(q.reshape(b * sq, h, d), k.reshape(b * sk, k.shape[2], d),
                             v.reshape(b * sk, v.shape[2], d), *packed, **feats)
        return _crop((o.view(b, sq, h, d), None), v_head_dim)

    out = attention(q, k, v, **feats)
    return _crop((out, None), v_head_dim)


def _has_varlen_backward() -> bool:
    try:
        from cuflash import backward
    except ImportError:
        return False
    return hasattr(backward, "attention_varlen_backward")


def _fwd_kwargs(kwargs):
    return {n: x for n, x in kwargs.items() if n not in ("sliding_window", "softcap")}


def _crop(res, v_head_dim):
    out, w = res
    return (out[..., :v_head_dim] if out.shape[-1] != v_head_dim else out), w


HF_NAME = "cuFlash"


def register_transformers(name: str = HF_NAME) -> str:
    """Register cuflash as the transformers attention implementation ``name`` (default
    ``"cuFlash"``), with transformers' flash-attention mask function (None without padding, else
    a 2D padding mask). Then ``from_pretrained(..., attn_implementation="cuFlash")`` or
    ``model.set_attn_implementation("cuFlash")``. Returns ``name``.

    The name must not contain the lowercase substring "flash": transformers takes any such
    implementation name for a flash-attn build and tries to load one (from the flash_attn
    package or a hub kernel repository) when a model is created with it.
    """
    if "flash" in name:
        raise ValueError(f"transformers treats attention implementations whose name contains "
                         f"'flash' as flash-attn builds and tries to load one for {name!r}; "
                         f"register cuflash under another name (default {HF_NAME!r})")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    AttentionInterface.register(name, hf_attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name
