"""The custom ops ``cuflash::attention_fwd`` / ``_bwd`` and ``cuflash::attention_varlen_fwd`` /
``_bwd`` (with fake implementations and autograd), the eager autograd.Function that runs the same
bodies, and the public :func:`attention` / :func:`attention_varlen`."""
import functools
import sys
from typing import Optional

import torch
from torch import Tensor
from torch.autograd import forward_ad as _forward_ad

import cuflash
import cuflash.backward
from cuflash import api, arrays
from cuflash.plan import cached_on_plans, chunk_piece_bounds, chunk_pieces

from . import node as _node
from . import plans


# ---------------------------------------------------------------------------------------------
# Argument helpers

def _window(window_size):
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}") from None
    return int(left), int(right)


def _extras(window_left, window_right, softcap, alibi_slopes, sinks=None, startend_row_indices=None,
            dropout_p=0.0, seed=0, offset=0):
    """Keyword arguments for the kernels' optional features, only where they differ from the
    defaults (a default call can take the backward's repeated-call path).
    ``seed``/``offset`` arrive as the custom ops carry them (signed 64-bit, see _s64)."""
    kw = {}
    if dropout_p:
        kw.update(dropout_p=float(dropout_p), seed=_u64(seed), offset=_u64(offset))
    if (window_left, window_right) != (-1, -1):
        kw["window_size"] = (window_left, window_right)
    if softcap:
        kw["softcap"] = float(softcap)
    if alibi_slopes is not None:
        kw["alibi_slopes"] = alibi_slopes
    if sinks is not None:
        kw["sinks"] = sinks
    if startend_row_indices is not None:
        kw["startend_row_indices"] = startend_row_indices
    return kw


def _s64(x: int) -> int:
    """A 64-bit unsigned Philox seed or offset as the signed int64 a custom op's ``int`` carries."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _u64(x: int) -> int:
    return x & ((1 << 64) - 1)


def _dropout_state(dropout_p, seed, offset, device, batch, nheads):
    """(dropout_p, seed, offset) of a call, seed and offset as the custom ops carry them (_s64).
    Without ``seed``, flash-attn's rule: the seed of the device's default CUDA generator
    (torch.manual_seed sets it) and its Philox offset, which is advanced past this call's
    counters (batch * nheads, rounded up to a multiple of 4 as PyTorch's philox_cuda_state does),
    so successive calls draw fresh masks and a re-seeded generator repeats them."""
    if seed is None and offset is None and type(dropout_p) in (int, float) and dropout_p == 0:
        return 0.0, 0, 0  # the common call, without the checks' cost
    dropout_p = cuflash.validate.dropout_p(dropout_p)
    if dropout_p == 0.0:
        cuflash.validate.seed_offset(seed, 0 if offset is None else offset, False)
        return 0.0, 0, 0
    if seed is None:
        if offset is not None:
            raise ValueError("offset needs seed: without seed both come from the default CUDA generator")
        gen = torch.cuda.default_generators[device.index if device.index is not None
                                            else torch.cuda.current_device()]
        seed, offset = gen.initial_seed(), gen.get_offset()
        gen.set_offset(offset + cuflash.reference.dropout_offset_increment(batch, nheads))
    seed, offset = cuflash.validate.seed_offset(seed, 0 if offset is None else offset, True)
    return dropout_p, _s64(seed), _s64(offset)


def _plain_cuda_tensors(*xs) -> bool:
    """Real CUDA tensors (no fake, functional or other tensor subclasses)."""
    return all(x is None or (type(x) is Tensor and x.is_cuda) for x in xs)


def _route(q, k, v, alibi_slopes=None, sinks=None, startend_row_indices=None) -> str:
    """How a call runs: "op", the custom op (torch.compile; fake, functional or other tensor
    subclasses; CPU tensors, which the op reports); "func", the op's bodies as an autograd.Function
    that torch.func's transforms accept (real CUDA tensors under torch.func.grad and the like);
    "autograd", the op's bodies as an eager
    autograd.Function (real CUDA tensors that need gradients, sinks included); "direct", the
    kernels alone."""
    if not (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor and q.is_cuda and k.is_cuda
            and v.is_cuda and _plain_cuda_tensors(alibi_slopes, sinks, startend_row_indices)):
        return "op"
    if torch.compiler.is_compiling():
        return "op"
    if torch._C._are_functorch_transforms_active():
        return "func"
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (sinks is not None and sinks.requires_grad)):
        return "autograd"
    return "direct"


# ---------------------------------------------------------------------------------------------
# Kernel calls (the bodies of the custom ops; real tensors only)

def _forward_kernel(q, k, v, out, causal, softmax_scale, window_left, window_right, softcap,
                    alibi_slopes, return_lse, sinks=None, startend_row_indices=None, dropout=(0.0, 0, 0)):
    extras = _extras(window_left, window_right, softcap, alibi_slopes, sinks, startend_row_indices, *dropout)
    if plans._log is not None:
        plans._record(q, k, causal, extras)
    return cuflash.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse, out=out,
                             **extras)


def _varlen_forward_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out,
                           causal, softmax_scale, window_left, window_right, softcap, alibi_slopes,
                           block_table, return_lse, sinks=None, dropout=(0.0, 0, 0)):
    extras = _extras(window_left, window_right, softcap, alibi_slopes, sinks, None, *dropout)
    if block_table is not None:
        extras["block_table"] = block_table
    if plans._log is not None:
        plans._record(q, k, causal, extras, varlen=True)
    return cuflash.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                    softmax_scale=softmax_scale, return_lse=return_lse, out=out, **extras)


def _backward_kernel(dout, q, k, v, out, lse, dq, dk, dv, causal, softmax_scale, window_left,
                     window_right, softcap, alibi_slopes, deterministic, sinks=None, startend_row_indices=None,
                     dropout=(0.0, 0, 0)):
    """(dq, dk, dv), or with ``sinks`` (dq, dk, dv, dsinks float32)."""
    extras = _extras(window_left, window_right, softcap, alibi_slopes, sinks, startend_row_indices, *dropout)
    return cuflash.backward.attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                                               deterministic=deterministic, dq=dq, dk=dk, dv=dv, **extras)


def _varlen_backward_kernel(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, dq, dk, dv, causal, softmax_scale, window_left,
                            window_right, softcap, alibi_slopes, deterministic, sinks=None, dropout=(0.0, 0, 0)):
    extras = _extras(window_left, window_right, softcap, alibi_slopes, sinks, None, *dropout)
    return cuflash.backward.attention_varlen_backward(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
        softmax_scale=softmax_scale, deterministic=deterministic, dq=dq, dk=dk, dv=dv, **extras)


def _into(buffers, results):
    """The gradient buffers the op allocated (their layout is the one its fake promises), filled
    with ``results`` where the backward returned other tensors."""
    for buf, got in zip(buffers, results if results is not None else buffers):
        if got is not buf:
            buf.copy_(got)
    return buffers


def _sink_grad(res, q, sinks):
    """The backward ops' fourth result: dsinks in the sinks' dtype (the backward's results
    ``res`` end with it in float32), or an empty float32 tensor without sinks."""
    if sinks is None:
        return q.new_empty((0,), dtype=torch.float32)
    return res[3].to(sinks.dtype)


def _sink_fake(q, sinks):
    return q.new_empty((0,), dtype=torch.float32) if sinks is None else sinks.new_empty(sinks.shape)


def _empty_like(x):
    """A contiguous tensor like x (torch.empty_like's fast path: a third of torch.empty's host
    time with shape, dtype and device spelled out)."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _last_dim_contiguous(x):
    """Gradients reaching a backward may be expanded or transposed views; the kernels need a unit
    stride in the last dim (the only copy made here, and only when needed)."""
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


# ---------------------------------------------------------------------------------------------
# Custom ops: dense

@torch.library.custom_op("cuflash::attention_fwd", mutates_args=())
def _attention_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: Optional[float],
                   window_left: int, window_right: int, softcap: float,
                   alibi_slopes: Optional[Tensor], deterministic: bool,
                   sinks: Optional[Tensor] = None,
                   startend_row_indices: Optional[Tensor] = None, dropout_p: float = 0.0, seed: int = 0,
                   offset: int = 0) -> tuple[Tensor, Tensor]:
    """(out, lse): out like q (contiguous), lse float32 (batch, nheads, seqlen_q).
    ``deterministic`` only matters to the backward pass. ``seed``/``offset``: the dropout's
    Philox state as signed 64-bit ints (_s64)."""
    return _fwd_body(q, k, v, causal, softmax_scale, window_left, window_right, softcap, alibi_slopes,
                     sinks=sinks, startend_row_indices=startend_row_indices, dropout_p=dropout_p, seed=seed,
                     offset=offset)


def _fwd_body(q, k, v, causal, softmax_scale, window_left, window_right, softcap, alibi_slopes,
              deterministic=False, sinks=None, startend_row_indices=None, dropout_p=0.0, seed=0,
              offset=0):  # deterministic: taken like the op's inputs, used by the backward
    out = _empty_like(q)
    return _forward_kernel(q, k, v, out, causal, softmax_scale, window_left, window_right, softcap,
                           alibi_slopes, True, sinks, startend_row_indices, (dropout_p, seed, offset))


@_attention_fwd.register_fake
def _(q, k, v, causal, softmax_scale, window_left, window_right, softcap, alibi_slopes,
      deterministic, sinks=None, startend_row_indices=None, dropout_p=0.0, seed=0, offset=0):
    b, sq, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, sq), dtype=torch.float32)


@torch.library.custom_op("cuflash::attention_bwd", mutates_args=())
def _attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   causal: bool, softmax_scale: Optional[float], window_left: int,
                   window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
                   deterministic: bool,
                   sinks: Optional[Tensor] = None,
                   startend_row_indices: Optional[Tensor] = None, dropout_p: float = 0.0, seed: int = 0,
                   offset: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dsinks): contiguous, shaped like q, k and v; dsinks like the sinks, or an
    empty float32 tensor without them."""
    return _bwd_body(dout, q, k, v, out, lse, causal, softmax_scale, window_left, window_right,
                     softcap, alibi_slopes, deterministic, sinks, startend_row_indices, dropout_p, seed, offset)


def _bwd_body(dout, q, k, v, out, lse, causal, softmax_scale, window_left, window_right, softcap,
              alibi_slopes, deterministic, sinks=None, startend_row_indices=None, dropout_p=0.0, seed=0, offset=0):
    dq = _empty_like(q)
    dk = _empty_like(k)
    dv = _empty_like(v)
    res = _backward_kernel(_last_dim_contiguous(dout), q, k, v, out, lse, dq, dk, dv, causal,
                           softmax_scale, window_left, window_right, softcap, alibi_slopes,
                           deterministic, sinks, startend_row_indices, (dropout_p, seed, offset))
    return (*_into((dq, dk, dv), res), _sink_grad(res, q, sinks))


@_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, causal, softmax_scale, window_left, window_right, softcap,
      alibi_slopes, deterministic, sinks=None, startend_row_indices=None, dropout_p=0.0, seed=0, offset=0):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), _sink_fake(q, sinks)


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, window_left, window_right, softcap, alibi_slopes, det, *rest = inputs
    sinks, startend_row_indices, *dropout = (*rest, None, None, 0.0, 0, 0)[:5]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, sinks, startend_row_indices)
    ctx.args = (causal, softmax_scale, window_left, window_right, softcap)
    ctx.dropout = tuple(dropout)  # the same (dropout_p, seed, offset) regenerate the forward's mask
    ctx.deterministic = det
    ctx.n_inputs = len(inputs)  # the backward returns a gradient (or None) per input given
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # the LSE's gradient stays None (no zeros made per backward)


def _fwd_backward(ctx, dout, dlse, bwd=None, saved=None):
    """The gradients per input; ``saved``: ctx.saved_tensors, where the caller has unpacked them."""
    if dout is None:  # the output got no gradient (the LSE has none)
        return (None,) * ctx.n_inputs
    q, k, v, out, lse, alibi_slopes, sinks, startend_row_indices = saved or ctx.saved_tensors
    causal, softmax_scale, window_left, window_right, softcap = ctx.args
    dq, dk, dv, dsinks = (bwd or torch.ops.cuflash.attention_bwd)(
        dout, q, k, v, out, lse, causal, softmax_scale, window_left, window_right, softcap,
        alibi_slopes, ctx.deterministic, sinks, startend_row_indices, *ctx.dropout)
    grads = (dq, dk, dv, None, None, None, None, None, None, None, None if sinks is None else dsinks, None,
             None, None, None)
    return grads[:ctx.n_inputs]


_attention_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


class _Underivable(torch.autograd.Function):
    """The identity on a backward's gradients, with the tensors that backward read as inputs too;
    differentiating through it raises (see _first_order)."""
    @staticmethod
    def forward(ctx, n, *tensors):
        return tensors[:n]

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("cuflash's attention backward has no derivative: differentiating its gradients "
                           "(a double backward after create_graph=True) is not supported")


class _UnderivableFunc(torch.autograd.Function):
    """_Underivable with the separate setup_context that torch.func's transforms require (and a
    vmap rule: jacrev vmaps the backward)."""
    generate_vmap_rule = True

    @staticmethod
    def forward(n, *tensors):
        return tuple(t.clone() for t in tensors[:n])  # (new tensors: a caller may change them in place)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        return _Underivable.backward(ctx, *grads)


def _first_order(grads, *read):
    """A backward's gradients, for a backward run in grad mode (create_graph=True), tied to the
    tensors ``read`` that it computed them from: a double backward through them raises, as through
    PyTorch's own flash-attention backward, instead of silently leaving out their share."""
    return _Underivable.apply(len(grads), *grads, *read)


def _eager_function(name, body, setup_context, backward, bwd_body, functorch=False):
    """A custom op's forward, autograd context and backward as a plain autograd.Function, for
    eager calls on real CUDA tensors: the same kernels without the custom-op dispatch (compiled
    code and fake tensors use the op). The forward takes ``ctx`` itself: with a separate
    ``setup_context``, ``Function.apply`` binds the arguments to the forward's signature through
    ``inspect`` on every call. ``functorch=True``: with the separate ``setup_context`` that
    torch.func's transforms (grad, jacrev, ...) require, and the backward custom op (its
    saved tensors are functorch's wrappers, which only the dispatcher unwraps); vmap is not
    supported (the kernels are not batching rules)."""
    def forward(ctx, *args):
        output = body(*args)
        setup_context(ctx, args, output)
        return output

    def backward_(ctx, dout, dlse):
        if dout is None or not torch.is_grad_enabled():
            return backward(ctx, dout, dlse, bwd_body)
        # create_graph=True: the saved tensors unpacked once (a non-reentrant checkpoint's hooks
        # allow one unpack) for the backward and for tying its gradients to them
        saved = ctx.saved_tensors
        return _first_order(backward(ctx, dout, dlse, bwd_body, saved), dout, *saved)
    attrs = {"forward": staticmethod(forward), "backward": staticmethod(backward_)}
    if functorch:
        def func_backward(ctx, dout, dlse):  # the op: the dispatcher unwraps functorch's tensors
            saved = ctx.saved_tensors
            with torch.no_grad():  # no_grad keeps the op's autograd out
                grads = backward(ctx, dout, dlse, saved=saved)
            if dout is None or not torch.is_grad_enabled():
                return grads
            # an outer transform differentiating these gradients (grad of grad) raises, as in eager:
            # they are tied to every tensor they were computed from
            tied = [g for g in grads if g is not None]
            tied = iter(_UnderivableFunc.apply(len(tied), *tied, dout, *(x for x in saved if x is not None)))
            return tuple(None if g is None else next(tied) for g in grads)
        attrs.update(forward=staticmethod(body), setup_context=staticmethod(setup_context),
                     backward=staticmethod(func_backward))
    return type(name, (torch.autograd.Function,), attrs)


_EagerAttention = _eager_function("_EagerAttention", _fwd_body, _fwd_setup_context, _fwd_backward, _bwd_body)
_FuncAttention = _eager_function("_FuncAttention", _fwd_body, _fwd_setup_context, _fwd_backward, _bwd_body,
                                 functorch=True)


# ---------------------------------------------------------------------------------------------
# Custom ops: varlen (packed sequences)

@torch.library.custom_op("cuflash::attention_varlen_fwd", mutates_args=())
def _attention_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                          cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                          softmax_scale: Optional[float], window_left: int, window_right: int,
                          softcap: float, alibi_slopes: Optional[Tensor],
                          block_table: Optional[Tensor], deterministic: bool,
                          sinks: Optional[Tensor] = None, dropout_p: float = 0.0, seed: int = 0,
                          offset: int = 0) -> tuple[Tensor, Tensor]:
    """(out, lse): out like q (total_q, nheads, d), contiguous; lse float32 (nheads, total_q)."""
    return _varlen_fwd_body(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                            window_left, window_right, softcap, alibi_slopes, block_table, deterministic, sinks,
                            dropout_p, seed, offset)


def _varlen_fwd_body(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                     window_left, window_right, softcap, alibi_slopes, block_table, deterministic, sinks=None,
                     dropout_p=0.0, seed=0, offset=0):  # deterministic: used by the backward
    out = _empty_like(q)
    return _varlen_forward_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  out, causal, softmax_scale, window_left, window_right, softcap,
                                  alibi_slopes, block_table, True, sinks, (dropout_p, seed, offset))


@_attention_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
      window_left, window_right, softcap, alibi_slopes, block_table, deterministic, sinks=None, dropout_p=0.0,
      seed=0, offset=0):
    total_q, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((h, total_q), dtype=torch.float32)


@torch.library.custom_op("cuflash::attention_varlen_bwd", mutates_args=())
def _attention_varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                          max_seqlen_k: int, causal: bool, softmax_scale: Optional[float],
                          window_left: int, window_right: int, softcap: float,
                          alibi_slopes: Optional[Tensor], deterministic: bool,
                          sinks: Optional[Tensor] = None, dropout_p: float = 0.0, seed: int = 0,
                          offset: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dsinks), as cuflash::attention_bwd."""
    return _varlen_bwd_body(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            causal, softmax_scale, window_left, window_right, softcap, alibi_slopes, deterministic,
                            sinks, dropout_p, seed, offset)


def _varlen_bwd_body(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                     softmax_scale, window_left, window_right, softcap, alibi_slopes, deterministic, sinks=None,
                     dropout_p=0.0, seed=0, offset=0):
    dq = _empty_like(q)
    dk = _empty_like(k)
    dv = _empty_like(v)
    res = _varlen_backward_kernel(_last_dim_contiguous(dout), q, k, v, out, lse, cu_seqlens_q,
                                  cu_seqlens_k, max_seqlen_q, max_seqlen_k, dq, dk, dv, causal,
                                  softmax_scale, window_left, window_right, softcap, alibi_slopes,
                                  deterministic, sinks, (dropout_p, seed, offset))
    return (*_into((dq, dk, dv), res), _sink_grad(res, q, sinks))


@_attention_varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
      softmax_scale, window_left, window_right, softcap, alibi_slopes, deterministic, sinks=None, dropout_p=0.0,
      seed=0, offset=0):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), _sink_fake(q, sinks)


def _varlen_setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, window_left, window_right, softcap,
     alibi_slopes, block_table, det, *rest) = inputs
    sinks, *dropout = (*rest, None, 0.0, 0, 0)[:4]
    ctx.dropout = tuple(dropout)  # the same (dropout_p, seed, offset) regenerate the forward's mask
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, alibi_slopes, sinks)
    ctx.n_inputs = len(inputs)
    ctx.args = (max_q, max_k, causal, softmax_scale, window_left, window_right, softcap)
    ctx.paged = block_table is not None
    ctx.deterministic = det
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _varlen_backward(ctx, dout, dlse, bwd=None, saved=None):
    if dout is None:
        return (None,) * ctx.n_inputs
    if ctx.paged:
        raise NotImplementedError("attention_varlen with a block_table (a paged KV cache) has no "
                                  "backward pass; run it under torch.no_grad()")
    q, k, v, out, lse, cu_q, cu_k, alibi_slopes, sinks = saved or ctx.saved_tensors
    max_q, max_k, causal, softmax_scale, window_left, window_right, softcap = ctx.args
    dq, dk, dv, dsinks = (bwd or torch.ops.cuflash.attention_varlen_bwd)(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, softmax_scale, window_left,
        window_right, softcap, alibi_slopes, ctx.deterministic, sinks, *ctx.dropout)
    return ((dq, dk, dv) + (None,) * 12 + (None if sinks is None else dsinks,) + (None,) * 3)[:ctx.n_inputs]


_attention_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


_EagerVarlenAttention = _eager_function("_EagerVarlenAttention", _varlen_fwd_body, _varlen_setup_context,
                                        _varlen_backward, _varlen_bwd_body)
_FuncVarlenAttention = _eager_function("_FuncVarlenAttention", _varlen_fwd_body, _varlen_setup_context,
                                       _varlen_backward, _varlen_bwd_body, functorch=True)


# ---------------------------------------------------------------------------------------------
# The eager autograd path of a plain dense call (no ALiBi, sinks, FlashMask or dropout): per call
# layout, the prepared launches of cuflash.attention's and cuflash.backward's repeat paths are
# kept side by side, and a Function of four inputs fires the forward's in its forward and the
# backward's in its backward, without the custom op's argument handling on either side.

class _Prepared:
    """The options of one plain call layout and its prepared forward and backward: ``fwd`` and
    ``bwd`` are the repeat objects of cuflash.api and cuflash.backward, None until a general call
    has made them; ``bwd_strides``, the strides of the saved (q, k, v, out, lse) that ``bwd`` was
    made for. ``sdpa``: the Function's tensors are SDPA's (batch, nheads, seqlen, d), transposed
    views of contiguous (batch, seqlen, nheads, d) memory; the repeat objects are made on
    cuflash's views of them and, as they read only data pointers, take SDPA's tensors as they
    are. The output and the gradients are then allocated by the Function, like q, k and v
    (``torch.empty_like``, which keeps a dense tensor's strides), and given to the launches."""
    __slots__ = ("causal", "scale", "window", "softcap", "deterministic", "fwd", "bwd", "bwd_strides", "sdpa",
                 "program", "fallback", "fast")

    def __init__(self, causal, scale, window, softcap, deterministic, sdpa=False):
        self.causal, self.scale, self.window, self.softcap = causal, scale, window, softcap
        self.deterministic, self.fwd, self.bwd, self.bwd_strides = deterministic, None, None, None
        self.sdpa = sdpa
        # The C++ node's program (node.program) once ``bwd`` exists, False where it cannot be
        # made; ``fallback``: the Python backward it calls for what the program does not cover.
        self.program, self.fallback = None, None
        # SDPA's calls: whether node.cpp's fast_forward runs this layout's forwards (node.keep_forward),
        # None until the C++ program exists (and again once node.cpp's full table dropped it).
        self.fast = None


def _bshd(*xs):
    """(batch, nheads, seqlen, d) tensors as cuflash's (batch, seqlen, nheads, d): views."""
    return tuple(x.transpose(1, 2) for x in xs)


_prepared: dict = cached_on_plans({})  # arrays.repeat_signature of (q, k, v) and the options -> _Prepared


def _plain_scale(softmax_scale) -> bool:
    """Whether a prepared call can take this scale: None or a Python number (anything else goes
    through the general path, whose checks name it)."""
    return softmax_scale is None or softmax_scale.__class__ in (float, int)


def _prepared_for(q, k, v, causal, softmax_scale, window, softcap, deterministic):
    """The _Prepared of a plain call's layout and options, or None where the call takes the
    custom op's bodies (a scale that is not a number: their checks name it)."""
    if not _plain_scale(softmax_scale):
        return None
    key = arrays.repeat_signature((q, k, v), window, (causal, softmax_scale, softcap, deterministic))
    if key is None:
        return None
    p = _prepared.get(key)
    if p is None:
        if len(_prepared) >= 1024:
            _prepared.clear()
        p = _prepared[key] = _Prepared(causal, softmax_scale, window, softcap, deterministic)
    return p


def _prepared_forward(q, k, v, p):
    """(out, lse) of a prepared call: the repeat path's launches, or the general path (the first
    call of a layout, or pointers the repeat path does not take), which makes them."""
    # p.sdpa: the output is allocated here like q (its strides, whatever those of its size-1
    # dims), given to the launches as cuflash's view of it, and returned as it is, a new tensor.
    o = torch.empty_like(q) if p.sdpa else None
    res = p.fwd(q, k, v, o) if p.fwd is not None else None
    if res is None:
        qa, ka, va, oa = _bshd(q, k, v, o) if p.sdpa else (q, k, v, None)
        res = cuflash.attention(qa, ka, va, causal=p.causal, softmax_scale=p.scale, window_size=p.window,
                                softcap=p.softcap, return_lse=True, out=oa)
        if p.fwd is None:
            p.fwd = api._repeats.get(api._signature(qa, ka, va, oa, p.causal, p.scale, True, 0, p.window,
                                                    p.softcap, None))
        if p.sdpa:
            res = (o, res[1])
    return res


def _prepared_backward(p, dout, q, k, v, out, lse):
    """(dq, dk, dv) of a prepared call's backward: the repeat path's launches where they hold, else
    the general path, which makes them (the C++ node's program is made from them: _prepared_apply).
    The Python node's backward, and the C++ node's for what its program does not cover."""
    # The backward's prepared launches hold for an output gradient laid out as the output, and
    # for saved tensors with the strides they were made for: a saved-tensor hook (e.g.
    # torch.autograd.graph.save_on_cpu) may give back contiguous copies of strided inputs.
    usual = dout.dtype == out.dtype and dout.stride() == out.stride()
    strides = (q.stride(), k.stride(), v.stride(), out.stride(), lse.stride())
    grads = tuple(torch.empty_like(x) for x in (q, k, v)) if p.sdpa else (None, None, None)
    res = (p.bwd(dout, q, k, v, out, lse, *grads)
           if usual and p.bwd is not None and strides == p.bwd_strides else None)
    if res is None:
        args = _bshd(_last_dim_contiguous(dout), q, k, v, out) + (lse,) if p.sdpa else (
            _last_dim_contiguous(dout), q, k, v, out, lse)
        given = _bshd(*grads) if p.sdpa else grads
        res = cuflash.backward.attention_backward(
            *args, causal=p.causal, softmax_scale=p.scale, window_size=p.window, softcap=p.softcap,
            deterministic=p.deterministic, dq=given[0], dk=given[1], dv=given[2])
        if usual and p.bwd is None:
            p.bwd = cuflash.backward._repeats.get(cuflash.backward._signature(
                *args, *given, p.causal, p.scale, p.deterministic, p.window, p.softcap, 0))
            p.bwd_strides = strides
        if p.sdpa:
            res = grads
    if torch.is_grad_enabled():  # (create_graph=True)
        res = _first_order(res[:3], dout, q, k, v, out)
    return tuple(res[:3])


class _PreparedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, p):
        out, lse = _prepared_forward(q, k, v, p)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.prepared = p
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # the LSE's gradient stays None
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None:  # the output got no gradient
            return None, None, None, None
        return (*_prepared_backward(ctx.prepared, dout, *ctx.saved_tensors), None)


def _prepared_apply(q, k, v, p):
    """(out, lse) of a prepared call that needs gradients: with the C++ node where it is on
    and its program is made (node.py), else through _PreparedAttention (also under forward-mode
    AD, whose tangents the node does not carry, and where compiled autograd is on, which a C++
    node must describe to it: node.cpp does not)."""
    if p.program is None and p.bwd is not None:  # (decided once per layout, after its first backward)
        p.program = _node.program_for(p.bwd, p.bwd_strides) or False
        p.fallback = functools.partial(_prepared_backward, p)
    if not p.program or not _node_allowed():
        return _PreparedAttention.apply(q, k, v, p)
    with torch.no_grad():  # (as inside a Function's forward: nothing it runs is recorded)
        out, lse = _prepared_forward(q, k, v, p)
    _node.module().attach(q, k, v, out, lse, p.program, p.fallback)
    return out, lse


def _node_allowed() -> bool:
    """Whether the C++ node may be recorded: no forward-mode AD level (its tangents) and no
    compiled autograd (which a C++ node must describe itself to)."""
    return _forward_ad._current_level < 0 and not _compiled_autograd()


def _plain_autograd() -> bool:
    """_node_allowed, and no torch.func transform or __torch_dispatch__ mode is active: what a call
    recorded with the C++ node and made outside Python (node.cpp's fast_forward) must know first."""
    return (_node_allowed() and not torch._C._are_functorch_transforms_active()
            and not torch._C._len_torch_dispatch_stack())


def _compiled_autograd() -> bool:
    """Whether compiled autograd (torch._dynamo.compiled_autograd) is on, if it was imported."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return ca is not None and bool(getattr(ca, "compiled_autograd_enabled", False)
                                   or getattr(ca, "in_compiled_autograd_region", False))


def _apply(route, eager, func, op, args):
    """(out, lse) of the forward on ``route`` (see _route): the eager Function, the torch.func
    one, or the custom op."""
    if route == "autograd":
        return eager.apply(*args)
    return func.apply(*args) if route == "func" else op(*args)


# ---------------------------------------------------------------------------------------------
# Public functions

def _autocast(q, k, v):
    """Under torch.autocast, float32 q, k, v in autocast's dtype (as scaled_dot_product_attention,
    which autocast runs in its lower precision); otherwise as given."""
    if isinstance(q, torch.Tensor) and q.dtype == torch.float32 and torch.is_autocast_enabled(q.device.type):
        dt = torch.get_autocast_dtype(q.device.type)
        return tuple(x.to(dt) if isinstance(x, torch.Tensor) and x.dtype == torch.float32 else x for x in (q, k, v))
    return q, k, v


def attention(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, deterministic=False, return_lse=False, sinks=None, startend_row_indices=None,
              dropout_p=0.0, seed=None, offset=None, *, q_descale=None, k_descale=None, v_descale=None,
              attention_chunk=0):
    """Differentiable :func:`cuflash.attention` for torch tensors, with flash-attn's
    ``flash_attn_func`` semantics.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim); float16 or
    bfloat16 CUDA tensors, last dim contiguous (other strides are free). ``window_size=(left,
    right)`` (-1 = unbounded), ``softcap`` (0 = off) and ``alibi_slopes`` ((nheads,) or (batch,
    nheads), float32) follow flash-attn. ``deterministic`` asks the backward pass for a
    deterministic reduction. ``sinks``: attention sinks, (nheads,) float32, bfloat16 or float16
    (as :func:`cuflash.attention`), differentiable: their gradient comes in the sinks' dtype.
    ``startend_row_indices``: a FlashMask mask (cuflash.masks; int32 CUDA tensor (batch, 1 or
    nheads_k or nheads, seqlen_k, n), as :func:`cuflash.attention`), in the forward and the
    backward; it gets no gradient.
    ``dropout_p``: attention dropout as in flash-attn (a float in [0, 1); not with a KV cache,
    sinks or FlashMask). The mask's Philox ``seed`` and ``offset`` (ints in [0, 2**64)) are the
    arguments when given (``offset`` defaults to 0), else flash-attn's: the seed of the device's
    default CUDA generator (``torch.manual_seed``) and its offset, advanced past the call's
    counters, so each call draws a new mask. The backward reuses the forward's seed and offset
    (saved for it). The generator is read on the host: a call captured in a CUDA graph replays
    the mask of the capture (pass a seed per replay outside the graph if that matters).
    Returns out (contiguous, like q), or (out, lse) with ``return_lse=True`` (lse float32 (batch,
    nheads, seqlen_q), not differentiable).

    Under ``torch.compile`` (or on fake tensors) this runs the ``cuflash::attention_fwd`` custom
    op (backward: ``cuflash::attention_bwd``); eager calls that need gradients run the same
    bodies as a ``torch.autograd.Function`` (one that torch.func's grad, jacrev and the like
    accept while they are active; not vmap); others call :func:`cuflash.attention` directly.

    float8_e4m3fn q, k, v (with the optional ``q_descale``, ``k_descale``, ``v_descale``) run
    :func:`cuflash.attention`'s FP8 forward (bfloat16 out): forward only, so where gradients are
    recorded the output's backward raises NotImplementedError (as FlashAttention-3's); not traced
    by torch.compile (a graph break).
    ``attention_chunk`` > 0 (chunked attention, as :func:`cuflash.attention`): without gradients to
    record or dropout, cuflash.attention's chunk kernels; otherwise the call as packed sequences
    (each sequence cut at its chunks' first keys with the queries of each chunk) through
    :func:`attention_varlen`'s forward and backward, the lse given back as (batch, nheads,
    seqlen_q); dropout draws the mask of those pieces (piece p as batch p), with or without
    gradients. Not traced by torch.compile (a graph break). A chunk that holds every key (seqlen_q <= seqlen_k <=
    attention_chunk) is no mask: such calls run as without it.
    """
    q, k, v = _autocast(q, k, v)
    # (isinstance, not __class__: torch.compile's tracer folds it for the default 0)
    if not (_int_arg(attention_chunk) and attention_chunk == 0):
        if (q_descale is not None or k_descale is not None or v_descale is not None
                or startend_row_indices is not None or q.dtype == torch.float8_e4m3fn):
            return _attention_fp8(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes, return_lse,
                                  sinks, startend_row_indices, dropout_p, (q_descale, k_descale, v_descale),
                                  attention_chunk)  # (its checks name what a chunk cannot take)
        if not (_int_arg(attention_chunk) and attention_chunk > 0 and q.dim() == 4 and k.dim() == 4
                and q.shape[1] <= k.shape[1] <= attention_chunk):
            return _chunked(q, k, v, None, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                            softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                            return_lse=return_lse, sinks=sinks, dropout_p=dropout_p, seed=seed, offset=offset,
                            attention_chunk=attention_chunk)
        attention_chunk = 0  # every query's chunk holds every key: plain attention
    if q_descale is not None or k_descale is not None or v_descale is not None or q.dtype == torch.float8_e4m3fn:
        return _attention_fp8(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes, return_lse, sinks,
                              startend_row_indices, dropout_p, (q_descale, k_descale, v_descale))
    window_left, window_right = _window(window_size)
    softcap = float(softcap or 0.0)
    dropout = _dropout_state(dropout_p, seed, offset, q.device, q.shape[0], q.shape[-2])
    route = _route(q, k, v, alibi_slopes, sinks, startend_row_indices)
    if route == "direct":
        return _forward_kernel(q, k, v, None, causal, softmax_scale, window_left, window_right,
                               softcap, alibi_slopes, return_lse, sinks, startend_row_indices, dropout)
    if (route == "autograd" and alibi_slopes is None and sinks is None and startend_row_indices is None
            and not dropout[0] and plans._log is None):
        p = _prepared_for(q, k, v, bool(causal), softmax_scale, (window_left, window_right), softcap,
                          bool(deterministic))
        if p is not None:
            out, lse = _prepared_apply(q, k, v, p)
            return (out, lse) if return_lse else out
    args = (q, k, v, bool(causal), softmax_scale, window_left, window_right, softcap, alibi_slopes,
            bool(deterministic), sinks, startend_row_indices) + (dropout if dropout[0] else ())
    out, lse = _apply(route, _EagerAttention, _FuncAttention, torch.ops.cuflash.attention_fwd, args)
    return (out, lse) if return_lse else out


def _int_arg(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@torch.compiler.disable
def _chunked(q, k, v, varlen, *, causal, softmax_scale, window_size, softcap, alibi_slopes, deterministic,
             return_lse, sinks, dropout_p, seed, offset, attention_chunk, block_table=None):
    """attention / attention_varlen with attention_chunk > 0. Without gradients to record and
    without dropout: the chunk kernels of cuflash.attention(_varlen). Otherwise as packed
    sequences (cuflash has no chunk mask in its backward kernels): every sequence cut at its
    chunks' first keys, with the queries of each chunk (_chunk_pieces), through the differentiable
    attention_varlen, forward and backward. Causal masks, windows and ALiBi are bottom-right
    aligned per piece exactly as per chunk (each piece's last query sits at its last key's
    position), so the two agree up to rounding. Dropout always takes the pieces, so that its mask
    (piece p as batch p) does not depend on whether gradients are recorded (activation
    checkpointing recomputes a forward with them). A paged cache (block_table) is forward only.
    ``varlen``: None (dense (batch, seqlen, nheads, d) operands) or (cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k)."""
    chunk = cuflash.validate.attention_chunk(attention_chunk)
    grads = torch.is_grad_enabled() and any(isinstance(x, Tensor) and x.requires_grad for x in (q, k, v, sinks))
    drop = cuflash.validate.dropout_p(dropout_p)
    kw = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
              alibi_slopes=alibi_slopes, return_lse=return_lse, sinks=sinks, attention_chunk=chunk)
    if block_table is not None:  # (dropout is refused there)
        fn = lambda q, k, v, sinks: cuflash.attention_varlen(q, k, v, *varlen, block_table=block_table,
                                                             dropout_p=dropout_p, **dict(kw, sinks=sinks))
        return forward_only("attention_varlen with a block_table (a paged KV cache) has no backward", fn, q, k, v,
                            sinks)
    if not grads and not drop:
        return cuflash.attention(q, k, v, **kw) if varlen is None else cuflash.attention_varlen(q, k, v, *varlen, **kw)
    _check_chunked_shapes(q, k, v, varlen, window_size, softcap, alibi_slopes, softmax_scale, sinks)
    if drop and seed is None and offset is not None:  # (before the generator moves)
        raise ValueError("offset needs seed: without seed both come from the default CUDA generator")
    if drop and sinks is not None:
        raise ValueError("dropout_p > 0 cannot be combined with sinks (attention sinks)")
    if drop and seed is not None:
        cuflash.validate.seed_offset(seed, 0 if offset is None else offset, True)
    cu_q, cu_k, max_q, max_k, pieces = _chunk_pieces(q, k, varlen, chunk)
    if alibi_slopes is not None and alibi_slopes.dim() == 2:  # (batch, nheads): each piece its sequence's
        alibi_slopes = alibi_slopes.repeat_interleave(pieces, dim=0)
    flat = (lambda x: x.flatten(0, 1)) if varlen is None else (lambda x: x)
    out, lse = attention_varlen(flat(q), flat(k), flat(v), cu_q, cu_k, max_q, max_k, causal=causal,
                                softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                                alibi_slopes=alibi_slopes, deterministic=deterministic, return_lse=True,
                                sinks=sinks, dropout_p=dropout_p, seed=seed, offset=offset)
    if varlen is None:  # (h, b * sq) -> (b, h, sq), as the dense call returns it
        out = out.view(q.shape[:-1] + out.shape[-1:])
        lse = lse.view(lse.shape[0], q.shape[0], q.shape[1]).transpose(0, 1).contiguous()
    return (out, lse) if return_lse else out


class _ForwardOnly(torch.autograd.Function):
    """A forward whose backward raises NotImplementedError(why) (a call on a paged cache, FP8):
    recorded so that a backward through it fails instead of leaving the inputs' gradients
    silently short."""

    @staticmethod
    def forward(ctx, why, fn, *inputs):
        ctx.why = why
        res = fn(*inputs)
        if isinstance(res, tuple):
            ctx.mark_non_differentiable(res[1])
        return res

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(ctx.why)


FP8_FORWARD_ONLY = "FP8 (float8_e4m3fn) attention is forward only (no backward)"


def forward_only(why, fn, *inputs):
    """fn(*inputs); where gradients are recorded for an input, through _ForwardOnly(why)."""
    if torch.is_grad_enabled() and any(isinstance(x, Tensor) and x.requires_grad for x in inputs):
        return _ForwardOnly.apply(why, fn, *inputs)
    return fn(*inputs)


def _check_chunked_shapes(q, k, v, varlen, window_size, softcap, alibi_slopes, softmax_scale, sinks):
    """The checks on the shapes of a chunked call as given, before its pieces are made (the call
    on the pieces checks dtypes, strides and placement, with the same messages, but would name
    the pieces' shapes)."""
    shape = lambda x, n: cuflash.validate.Shape(tuple(x.shape), str(x.dtype).rsplit(".", 1)[-1], n)
    if varlen is None:
        qs, ks, vs = shape(q, "q"), shape(k, "k"), shape(v, "v")
        batch = qs.shape[0]
    else:
        qs, ks, vs = (shape(x.unsqueeze(0) if x.dim() == 3 else x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
        for name, cu in (("cu_seqlens_q", varlen[0]), ("cu_seqlens_k", varlen[1])):
            if not isinstance(cu, Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 1:
                raise TypeError(f"{name} must be a 1-D int32 tensor of batch + 1 offsets, got "
                                f"{cuflash.validate.show(cu)}")
        if varlen[0].shape != varlen[1].shape:
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                             f"{varlen[0].shape[0]} and {varlen[1].shape[0]}")
        cuflash.validate.max_seqlen(varlen[2], "max_seqlen_q", qs.shape[1], "total_q")
        cuflash.validate.max_seqlen(varlen[3], "max_seqlen_k", ks.shape[1], "total_k")
        batch = varlen[0].shape[0] - 1
    cuflash.validate.operands(qs, ks, vs, dtypes=(qs.dtype,))
    cuflash.validate.mods(window_size, softcap, None if alibi_slopes is None else shape(alibi_slopes, "alibi_slopes"),
                          batch, qs.shape[2], qs, cuflash.validate.scale(softmax_scale, qs.shape[3]))
    if sinks is not None:
        cuflash.validate.sinks(shape(sinks, "sinks"), qs.shape[2])


def _chunk_pieces(q, k, varlen, chunk):
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, pieces per sequence) of chunked
    attention as packed sequences (cuflash.plan.chunk_pieces), made on the device (no sync, no
    host copy: capturable). Pieces may be empty. max_seqlen_k must bound every sequence's keys
    (flash-attn's contract: with a smaller one, pieces would miss rows)."""
    if varlen is None:
        b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        steps = torch.arange(b + 1, dtype=torch.int32, device=q.device)
        varlen = (steps * sq, steps * sk, sq, sk)
        lead = max(0, sq - sk)  # the most queries before a sequence's first key
    else:  # the same cu_seqlens for queries and keys: none (else not known without a sync)
        same = varlen[0] is varlen[1] and int(varlen[2]) == int(varlen[3])
        # the maxima no higher than the rows there are (cuflash.validate.max_seqlen's reading)
        rows_k = k.shape[0] if k.dim() == 3 else int(varlen[3])
        varlen = (*varlen[:2], min(int(varlen[2]), q.shape[0]), min(int(varlen[3]), rows_k))
        lead = 0 if same else varlen[2]
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = varlen
    c, per_seq, max_q, max_k = chunk_pieces(cu_seqlens_q.shape[0] - 1, int(max_seqlen_q), int(max_seqlen_k), chunk,
                                            lead, q.shape[-2])
    ends = torch.arange(per_seq, dtype=torch.int32, device=cu_seqlens_q.device) * c
    return (*chunk_piece_bounds(torch, cu_seqlens_q, cu_seqlens_k, ends), max_q, max_k, per_seq)


@torch.compiler.disable
def _attention_fp8(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes, return_lse, sinks,
                   startend_row_indices, dropout_p, descales, attention_chunk=0):
    """attention's FP8 path: cuflash.attention's FP8 forward; where gradients are recorded, an
    output whose backward raises (FlashAttention-3's FP8 is forward only too). With
    attention_chunk, the chunk's own refusals of FP8 and FlashMask."""
    if attention_chunk:
        cuflash.validate.chunk_alone(cuflash.validate.attention_chunk(attention_chunk),
                                     startend_row_indices=startend_row_indices is not None)
        if any(x is not None for x in descales) or q.dtype == torch.float8_e4m3fn:
            api._no_fp8_chunk(attention_chunk)
    def fn(q, k, v, sinks):
        return cuflash.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                 softcap=softcap, alibi_slopes=alibi_slopes, return_lse=return_lse, sinks=sinks,
                                 startend_row_indices=startend_row_indices, dropout_p=dropout_p,
                                 q_descale=descales[0], k_descale=descales[1], v_descale=descales[2])
    return forward_only(FP8_FORWARD_ONLY, lambda q, k, v, sinks, *_: fn(q, k, v, sinks), q, k, v, sinks, *descales)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                     softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                     deterministic=False, return_lse=False, block_table=None, sinks=None, dropout_p=0.0, seed=None,
                     offset=None, *, attention_chunk=0):
    """Differentiable :func:`cuflash.attention_varlen` (flash-attn's ``flash_attn_varlen_func``).

    q: (total_q, nheads, d); k, v: (total_k, nheads_k, d) (or a paged cache with
    ``block_table``, forward only); ``cu_seqlens_q``/``cu_seqlens_k``: int32 (batch + 1,)
    cumulative lengths on the GPU; ``max_seqlen_q``/``max_seqlen_k``: Python ints. Each sequence
    is attended on its own (causal and windows aligned bottom-right per sequence). ``sinks`` as
    in :func:`attention` (differentiable). Returns out, or (out, lse) with lse float32 (nheads,
    total_q).
    ``dropout_p``, ``seed``, ``offset`` as in :func:`attention` (sequence b is batch b of the
    mask; the generator's offset advances by batch * nheads; not with ``block_table``).
    ``attention_chunk`` > 0: chunked attention per sequence (as :func:`attention`; with gradients,
    each sequence's chunks as packed sequences of their own).
    """
    q, k, v = _autocast(q, k, v)
    if not (_int_arg(attention_chunk) and attention_chunk == 0):
        return _chunked(q, k, v, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), causal=causal,
                        softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                        alibi_slopes=alibi_slopes, deterministic=deterministic, return_lse=return_lse, sinks=sinks,
                        dropout_p=dropout_p, seed=seed, offset=offset, attention_chunk=attention_chunk,
                        block_table=block_table)
    window_left, window_right = _window(window_size)
    softcap = float(softcap or 0.0)
    batch = max(cu_seqlens_q.shape[0] - 1, 0) if hasattr(cu_seqlens_q, "shape") else 0
    dropout = _dropout_state(dropout_p, seed, offset, q.device, batch, q.shape[-2])
    route = _route(q, k, v, alibi_slopes, sinks)
    if route == "direct":
        return _varlen_forward_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                      int(max_seqlen_k), None, causal, softmax_scale, window_left,
                                      window_right, softcap, alibi_slopes, block_table, return_lse, sinks, dropout)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, bool(causal), softmax_scale,
            window_left, window_right, softcap, alibi_slopes, block_table, bool(deterministic), sinks
            ) + (dropout if dropout[0] else ())
    if route != "op" and not _plain_cuda_tensors(cu_seqlens_q, cu_seqlens_k, block_table):
        route = "op"
    out, lse = _apply(route, _EagerVarlenAttention, _FuncVarlenAttention, torch.ops.cuflash.attention_varlen_fwd,
                      args)
    return (out, lse) if return_lse else out
