"""Attention backward pass (FlashAttention-2 algorithm): gradients of ``cuflash.attention``.

Given dO, the forward's inputs q, k, v, its output O and its LSE (fp32, natural log), the
gradients are, per query row i and key j (s = scale * q.k, masked scores are -inf):

    P = exp(s - LSE)      dV = P^T dO      dP = dO V^T      D_i = sum_c dO_ic O_ic
    dS = P * (dP - D)     dQ = scale * dS K                 dK = scale * dS^T Q

and with GQA the dK, dV of a KV head are summed over its query heads. The forward's score
modifiers carry over: with a softcap the scores are s = softcap * t, t = tanh(scale q.k /
softcap), and dS is multiplied by ds/d(q.k) / scale = 1 - t^2 (the kernels recompute t with the
forward's tanh and fold 1 - t^2 into P right after the exponential); ALiBi adds a bias with no
gradient; sliding windows mask and skip blocks exactly as the forward does (the window as
launched is plan.effective_window's, so the masks match the keys the LSE summed over).

Kernels (``templates/``), all on the caller's stream:

1. ``bwd_prep`` (bwd/prep.cu.j2): one warp per query row writes D and LSE * log2(e) into an fp32
   workspace padded to whole query blocks (padding rows: D = 0, LSE = +inf, so P = 0 there),
   and zeroes the row of the fp32 dQ accumulator when one is used. Packed (varlen) sequences
   each get their own padded rows (layout: stats_base in templates/common/bwd.cuh).
2. ``bwd_dkdv_dq`` / ``bwd_dkdv`` (bwd/dkdv.cu.j2): one block per (key block, KV head, batch) keeps
   its K and V tiles in shared memory and walks the query heads of its group and the query
   blocks that see its keys (causal: blocks entirely above the diagonal are skipped, blocks on
   it are masked). Per step it recomputes S^T = K Q^T with mma.sync, P^T = exp2(S^T c - LSE2),
   dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - D) and dK += dS^T Q, the accumulators in
   fp32 registers; P^T and dS^T go from the MMA outputs straight into the next MMA's operands.
   dK and dV are therefore complete in one block and written once: no atomics for them, GQA
   included. The ``_dq`` variant also stores dS^T in shared memory and adds dQ = dS K into an
   fp32 buffer with atomic adds. Each warp owns 16 keys x every column. At d = 64 and 128 on
   sm_90, without softcap or ALiBi, bwd/dkdv_wgmma.cu.j2 runs the same algorithm on Hopper's
   warpgroup MMA: two warpgroups of 64 keys, 128-byte-swizzled tiles read by wgmma.mma_async
   (S^T, dP^T and dQ from shared memory; dV and dK with P^T and dS^T from registers), and a
   swizzled dS^T tile from which each warpgroup computes a 64 x 64 piece of dQ.
3. ``bwd_convert`` (bwd/convert.cu.j2): dQ = scale * accumulator, in the input dtype.

``deterministic=True`` launches ``bwd_dkdv`` (no dQ) and, instead of atomics and the convert
kernel, ``bwd_dq`` (bwd/dq.cu.j2): one block per query block walks the K/V blocks it sees,
recomputing P and dS, and writes dQ once; every gradient is then bitwise repeatable.

Windows, softcap and ALiBi are template flags (Variant.local/softcap/alibi); varlen is a
runtime property of the same kernels (cu_seqlens pointers non-null, read on the device), and a
template flag of the warp-specialised ones (kernels/bwd_ws.py: BwdWsVariant.varlen and the tiled
bwd_convert's), whose tensor maps span every token of the packed tensors as one batch.

FlashMask (``startend_row_indices``, cuflash.masks) is a template flag too (Variant.flashmask =
n): the FlashMask prep kernel (kernels/flashmask.py) runs first and writes, per block of the
dK/dV kernel's keys (and of the deterministic dQ kernel's, where they differ), the min and max of
each bound column into the workspace after the fp32 rows; the dK/dV and dQ kernels then skip the
tiles the mask hides whole (no loads, no math, no dQ), mask the partly hidden ones element by
element (P = 0 there, as in the forward, whose LSE summed over the same keys) and run the rest
plain. The indices are read in place.

Attention sinks (``sinks``) need no kernel of their own: the forward's LSE holds the sink, so the
kernels' P = exp(s - LSE) is already the softmax with the sink's column, whose value is zero
(it adds nothing to O, dP or D). The sink's gradient, dsinks_h = -sum over batch and rows of
exp(sink_h - LSE_i) D_i, is reduced from the LSE and D rows that bwd_prep writes (padding rows:
LSE +inf, D 0, so they add 0), by a few operations of the caller's framework on its stream.
"""
from __future__ import annotations

import math
import sys
from typing import NamedTuple

import numpy as np

from . import api, arrays, compiler, validate
from .kernels.bwd import ROW_PAD, VARLEN_ROW_GAP, row_floats, sem_words
from .kernels.fwd_ws import tensor_map, tma_readable
from .kernels.params import TENSOR_MAP_BYTES, stride_values
from .launch import dropout_fields
from .plan import Problem, cached_on_plans, cdiv, chunk_piece_bounds, chunk_pieces, make_backward_plan

_LOG2E = math.log2(math.e)
_DTYPES = {"float16": "fp16", "bfloat16": "bf16"}


# ---------------------------------------------------------------------------------------------
# Validation

def _validate(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, dq, dk, dv,
              window_size, softcap, alibi_slopes, sinks):
    """attention's rules plus the backward's own arguments; views and checked values."""
    qv, kv, vv = validate.view(q, "q"), validate.view(k, "k"), validate.view(v, "v")
    validate.operands(qv, kv, vv)
    b, sq, h, d = qv.shape
    dov, ov, lv = _forward_results(dout, out, lse, qv, (b, h, sq), "(batch, nheads, seqlen_q)", "attention")
    grads = validate.grads(dq, dk, dv, qv, kv, vv)
    scale, causal, deterministic, mods = _options(causal, softmax_scale, deterministic, window_size, softcap,
                                                  alibi_slopes, b, qv)
    sv = validate.sinks(sinks, h, qv)
    return qv, kv, vv, dov, ov, lv, grads, scale, causal, deterministic, mods, sv


def _validate_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     causal, softmax_scale, deterministic, dq, dk, dv, window_size, softcap, alibi_slopes, sinks):
    """The rules of cuflash.attention_varlen (dense K/V) plus the backward's own arguments."""
    qv, kv, vv, cq, ck, _, batch, max_sq, max_sk = validate.varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, paged_ok=False)
    total_q, h, _ = qv.shape
    # The LSE/D/dQ-accumulator rows per head (head_rows in _backward_device) are a 32-bit argument.
    validate.sizes((f"total_q + {VARLEN_ROW_GAP} * batch (the backward's padded rows)",
                    total_q + VARLEN_ROW_GAP * batch))
    dov, ov, lv = _forward_results(dout, out, lse, qv, (h, total_q), "(nheads, total_q)", "attention_varlen")
    grads = validate.grads(dq, dk, dv, qv, kv, vv)
    scale, causal, deterministic, mods = _options(causal, softmax_scale, deterministic, window_size, softcap,
                                                  alibi_slopes, batch, qv)
    sv = validate.sinks(sinks, h, qv)
    return qv, kv, vv, dov, ov, lv, cq, ck, max_sq, max_sk, grads, scale, causal, deterministic, mods, sv


def _forward_results(dout, out, lse, qv, lse_shape, lse_layout, forward):
    """Views of dout and out (shaped like q) and of the forward's LSE."""
    dov, ov = validate.view(dout, "dout"), validate.view(out, "out")
    validate.like(dov, qv, "dout", "q")
    validate.like(ov, qv, "out", "q")
    return dov, ov, validate.lse(lse, lse_shape, lse_layout, qv, forward)


def _options(causal, softmax_scale, deterministic, window_size, softcap, alibi_slopes, batch, qv):
    scale = validate.scale(softmax_scale, qv.shape[-1])
    causal = validate.boolean(causal, "causal")
    deterministic = validate.boolean(deterministic, "deterministic")
    return scale, causal, deterministic, validate.mods(window_size, softcap, alibi_slopes, batch, qv.shape[-2],
                                                       qv, scale)


# ---------------------------------------------------------------------------------------------
# Entry points

def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                       softcap=0.0, alibi_slopes=None, deterministic=False, dq=None, dk=None, dv=None,
                       sinks=None, startend_row_indices=None, dropout_p=0.0, seed=None, offset=0,
                       attention_chunk=0):
    """Gradients (dq, dk, dv) of ``out = cuflash.attention(q, k, v, causal=..., softmax_scale=...,
    window_size=..., softcap=..., alibi_slopes=...)`` for the output gradient ``dout``.

    q, out, dout: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim),
    float16 or bfloat16, last dim contiguous, any other strides; lse: float32 (batch, nheads,
    seqlen_q) from ``attention(..., return_lse=True)``. Same masking and score rules as the
    forward (causal and windows aligned bottom-right; a query row that sees no key gets zero
    gradient; ``softcap`` and ``alibi_slopes`` as in :func:`cuflash.attention`; the ALiBi bias
    has no gradient). With ``deterministic=True`` no atomics are used and repeated calls give
    bitwise equal gradients. ``dq``, ``dk``, ``dv``: optional arrays to write the gradients
    into. ``sinks``: the forward's attention sinks (as in :func:`cuflash.attention`; ``lse`` then
    holds them): the result is (dq, dk, dv, dsinks), dsinks float32 (nheads,) in q's framework.
    ``startend_row_indices``: the forward's FlashMask mask (as in :func:`cuflash.attention`:
    int32 (batch, 1 or nheads_k or nheads, seqlen_k, n) in q's framework and on its device, not
    with a window, ALiBi or sinks), read in place.
    ``dropout_p``, ``seed``, ``offset``: the forward's dropout (as in :func:`cuflash.attention`;
    the same three values regenerate the same mask): dv = (P Z / (1 - p))^T dout and
    dS = P (Z dP / (1 - p) - D), D = rowsum(dout * out) with out the forward's (dropped) output.
    ``attention_chunk``: the forward's (chunked attention; not with FlashMask or dropout): no
    backward kernel takes a chunk, so the gradients are those of the call as packed sequences,
    one per chunk (_chunked), as cuflash.torch and cuflash.jax differentiate it; ``dq``, ``dk``,
    ``dv`` are then written from the result.
    Returns the caller's array type (NumPy inputs are computed on the current GPU and come back
    as NumPy).
    """
    sig = None
    if (alibi_slopes is None and sinks is None and arrays.no_dropout(dropout_p, seed)
            and attention_chunk.__class__ is int and attention_chunk == 0):
        sig = _signature(dout, q, k, v, out, lse, dq, dk, dv, causal, softmax_scale, deterministic, window_size,
                         softcap, offset, startend_row_indices)
        r = arrays.repeat_lookup(_repeats, sig)
        if r is not None:
            res = r(dout, q, k, v, out, lse, dq, dk, dv, fm=startend_row_indices)
            if res is not None:
                return res
    qv, kv, vv, dov, ov, lv, grads, scale, causal, deterministic, mods, sv = _validate(
        dout, q, k, v, out, lse, causal, softmax_scale, deterministic, dq, dk, dv, window_size, softcap,
        alibi_slopes, sinks)
    drop = validate.dropout(dropout_p, seed, offset, 0, sv, startend_row_indices)
    chunk = _chunk(attention_chunk, startend_row_indices, drop)
    fm = None
    if startend_row_indices is not None:
        fm = validate.flashmask(startend_row_indices, qv, kv, causal, 0, mods, sv is not None)
    if qv.device < 0:  # NumPy in, NumPy out: compute on the current GPU
        dev = arrays.current_device()
        on = lambda x: None if x is None else arrays.to_device(np.asarray(x.array), dev)
        res = attention_backward(on(dov), on(qv), on(kv), on(vv), on(ov), on(lv), causal=causal,
                                 softmax_scale=scale, window_size=mods[0], softcap=mods[1],
                                 alibi_slopes=on(mods[2]), deterministic=deterministic, sinks=on(sv),
                                 startend_row_indices=on(fm), attention_chunk=chunk, **validate.dropout_kwargs(drop))
        return _host_results(res, (dq, dk, dv, None), (qv, kv, vv, qv))
    if chunk and not qv.shape[1] <= kv.shape[1] <= chunk:  # (else every query's chunk holds every key)
        return _chunked(dov, qv, kv, vv, ov, lv, grads, chunk, None,
                        dict(causal=causal, softmax_scale=scale, window_size=mods[0], softcap=mods[1],
                             deterministic=deterministic), mods[2], sv)
    return _backward_device(dov, qv, kv, vv, ov, lv, grads, causal, scale, deterministic, mods, sv=sv, fm=fm,
                            drop=drop, sig=sig)


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, deterministic=False, dq=None, dk=None, dv=None, sinks=None,
                              dropout_p=0.0, seed=None, offset=0, attention_chunk=0):
    """Gradients (dq, dk, dv) of ``out = cuflash.attention_varlen(q, k, v, cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)`` (dense K/V) for the output gradient ``dout``.

    q, out, dout: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim); lse: float32
    (nheads, total_q) from ``attention_varlen(..., return_lse=True)``; ``cu_seqlens_q``,
    ``cu_seqlens_k``: int32 device arrays (batch + 1,), read by the kernels on the device (no
    host synchronisation; well-formed offsets under the maxima are the caller's contract, as in
    the forward). Sequences may be empty. Other arguments as in :func:`attention_backward`
    (with ``sinks``: (dq, dk, dv, dsinks)); ALiBi slopes may be (nheads,) or (batch, nheads).
    Dropout: sequence b is batch b of the mask, as in the forward. ``attention_chunk`` as in
    :func:`attention_backward`.
    """
    sig = None
    if (alibi_slopes is None and sinks is None and arrays.no_dropout(dropout_p, seed)
            and max_seqlen_q.__class__ is int and max_seqlen_k.__class__ is int
            and attention_chunk.__class__ is int and attention_chunk == 0):
        sig = arrays.repeat_signature((q, k, v, dout, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k), window_size,
                                      ("varlen", max_seqlen_q, max_seqlen_k, causal, softmax_scale, deterministic,
                                       softcap, offset))
        r = arrays.repeat_lookup(_repeats, sig)
        if r is not None:
            res = r(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k)
            if res is not None:
                return res
    qv, kv, vv, dov, ov, lv, cq, ck, max_sq, max_sk, grads, scale, causal, deterministic, mods, sv = \
        _validate_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                         softmax_scale, deterministic, dq, dk, dv, window_size, softcap, alibi_slopes, sinks)
    drop = validate.dropout(dropout_p, seed, offset, 0, sv, None)
    chunk = _chunk(attention_chunk, None, drop)
    if qv.device < 0:  # NumPy in, NumPy out: compute on the current GPU
        dev = arrays.current_device()
        on = lambda x: None if x is None else arrays.to_device(np.asarray(x.array), dev)
        res = attention_varlen_backward(on(dov), on(qv), on(kv), on(vv), on(ov), on(lv), on(cq), on(ck),
                                        max_sq, max_sk, causal=causal, softmax_scale=scale,
                                        window_size=mods[0], softcap=mods[1], alibi_slopes=on(mods[2]),
                                        deterministic=deterministic, sinks=on(sv), attention_chunk=chunk,
                                        **validate.dropout_kwargs(drop))
        return _host_results(res, (dq, dk, dv, None), (qv, kv, vv, qv))
    if chunk:
        return _chunked(dov, qv, kv, vv, ov, lv, grads, chunk, (cq, ck, max_sq, max_sk),
                        dict(causal=causal, softmax_scale=scale, window_size=mods[0], softcap=mods[1],
                             deterministic=deterministic), mods[2], sv)
    return _backward_device(dov, qv, kv, vv, ov, lv, grads, causal, scale, deterministic, mods,
                            varlen=(cq, ck, max_sq, max_sk), sv=sv, drop=drop, sig=sig)


def _chunk(attention_chunk, startend_row_indices, drop):
    """The checked attention_chunk (0: none), refused with FlashMask or dropout, whose masks
    would not carry over to the pieces (_chunked)."""
    chunk = validate.attention_chunk(attention_chunk)
    validate.chunk_alone(chunk, startend_row_indices=startend_row_indices is not None, dropout_p=drop is not None)
    return chunk


def _chunked(dov, qv, kv, vv, ov, lv, grads, chunk, varlen, kw, alibi, sv):
    """The gradients of a chunked call (attention_chunk = ``chunk``) on the GPU: the call as
    packed sequences (cuflash.plan.chunk_pieces: each sequence cut at its chunks' first keys, with
    the queries whose positions lie in each chunk, so that causal masks, windows and ALiBi align
    as within the chunk), their bounds made on the device (no sync), through
    attention_varlen_backward on (total, heads, d) views of the operands. The forward's LSE, over
    each row's chunk, is the pieces' own. ``varlen``: None (dense operands) or (cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k) views and ints; ``kw``: the checked options."""
    arr = lambda x: None if x is None else x.array[1] if x.framework == "dlpack" else x.array  # noqa: E731
    torch = qv.framework == "torch"
    if torch:
        xp = sys.modules["torch"]
        arange = lambda n: xp.arange(n, dtype=xp.int32, device=f"cuda:{qv.device}")  # noqa: E731
    else:
        import cupy as xp
        arange = lambda n: xp.arange(n, dtype=xp.int32)  # noqa: E731
    h = qv.shape[-2]
    with arrays.on_device(qv.device):
        if varlen is None:
            b, sq, sk = qv.shape[0], qv.shape[1], kv.shape[1]
            steps = arange(b + 1)
            cu_q, cu_k, max_sq, max_sk, lead = steps * sq, steps * sk, sq, sk, max(0, sq - sk)
            flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
            lse = (lv.array.permute(1, 0, 2) if torch else arr(lv).transpose(1, 0, 2)).reshape(h, -1)
        else:
            cu_q, cu_k, max_sq, max_sk = arr(varlen[0]), arr(varlen[1]), varlen[2], varlen[3]
            b = cu_q.shape[0] - 1
            lead = 0 if cu_q is cu_k and max_sq == max_sk else max_sq  # (the queries before a sequence's first key)
            flat, lse = (lambda x: x), arr(lv)
        c, per_seq, max_q, max_k = chunk_pieces(b, max_sq, max_sk, chunk, lead, h)
        pieces_q, pieces_k = chunk_piece_bounds(xp, cu_q, cu_k, arange(per_seq) * c)
        alibi = arr(alibi)
        if alibi is not None and alibi.ndim == 2:  # (batch, nheads): each piece its sequence's
            alibi = alibi.repeat_interleave(per_seq, dim=0) if torch else alibi.repeat(per_seq, axis=0)
        res = attention_varlen_backward(*(flat(arr(x)) for x in (dov, qv, kv, vv, ov)), lse, pieces_q, pieces_k,
                                        max_q, max_k, alibi_slopes=alibi, sinks=arr(sv), **kw)
        out = []
        for r, g, like in zip(res, grads, (qv, kv, vv)):
            r = r.reshape(like.shape)
            if g is not None:
                g.array[...] = r
                r = g.array
            out.append(arrays.hand_back(r, like))
    return tuple(out) + tuple(arrays.hand_back(r, qv) for r in res[3:])


def _host_results(res, given, likes):
    result = []
    for r, g, like in zip(res, given, likes):
        r = arrays.hand_back(r, like)
        if g is not None:
            g[...] = r
            r = g
        result.append(r)
    return tuple(result)


def _grad_buffer(given, like, d_pad):
    """(view the kernel writes, view to hand back): the caller's array when the kernel can
    write it in place, else a padded/aligned scratch copied into it afterwards."""
    final = given if given is not None else arrays.view(
        arrays.empty_like_framework(like, like.shape, like.dtype), "grad")
    if d_pad == like.shape[-1] and validate.aligned(final):
        return final, final
    scratch = arrays.view(arrays.empty_like_framework(like, (*like.shape[:-1], d_pad), like.dtype), "grad")
    return scratch, final


def _as_batches(x):
    """A 4-dim view as it is; a packed (total, nheads, d) one as a single batch (token strides)."""
    return x if len(x.shape) == 4 else validate.batched(x, 1, x.shape[0])


def _tma_readable(x) -> bool:
    """Whether bwd_ws's tensor maps can read a 4-dim view, or a packed one as a single batch."""
    return tma_readable(_as_batches(x))


def _padded(x, d_pad):
    """A zero-padded (..., d_pad) copy of a device view (any rank) that the kernels cannot read
    in place."""
    a = x.array[1] if x.framework == "dlpack" else x.array
    buf = arrays.empty_like_framework(x, (*x.shape[:-1], d_pad), x.dtype)
    buf[..., x.shape[-1]:] = 0
    buf[..., :x.shape[-1]] = a
    return arrays.view(buf, "copy")


def _backward_device(dov, qv, kv, vv, ov, lv, grads, causal, scale, deterministic, mods, varlen=None, sv=None,
                     fm=None, drop=None, sig=None):
    """The gradients of a checked call on the GPU. ``sig``: the call's repeat signature
    (_signature), under which its prepared launches are kept when they read and write the
    caller's arrays in place."""
    if varlen is None:
        b, sq, h, d = qv.shape
        sk, hk = kv.shape[1], kv.shape[2]
    else:
        cq, ck, sq, sk = varlen
        b, (total_q, h, d), hk = cq.shape[0] - 1, qv.shape, kv.shape[1]
    d_pad = -(-d // 8) * 8
    bufs = [_grad_buffer(g, like, d_pad) for g, like in zip(grads, (qv, kv, vv))]
    results = [final.array for _, final in bufs]
    if b == 0 or h == 0 or sq == 0 or sk == 0 or 0 in qv.shape or 0 in kv.shape:
        # No query or no key: every gradient is zero (or empty); a sink then takes all of every
        # row's weight, whose output is 0 (D = 0): dsinks is zero too.
        if sv is not None:
            results.append(arrays.empty_like_framework(qv, (h,), "float32"))
        for r in results:
            if 0 not in r.shape:
                r[...] = 0
        return tuple(arrays.hand_back(r, like) for r, like in zip(results, (qv, kv, vv, qv)))

    # Head dims that are not a multiple of 8, or unaligned operands, go through padded copies
    # (zero columns change no score and no gradient).
    ops = [x if d_pad == d and validate.aligned(x) else _padded(x, d_pad) for x in (qv, kv, vv, dov, ov)]
    window, cap, alibi, _ = mods
    dev = qv.device
    plan = make_backward_plan(Problem(b, sq, sk, h, hk, d_pad, _DTYPES[qv.dtype], causal=causal, window=window,
                                      softcap=cap > 0, alibi=alibi is not None, varlen=varlen is not None,
                                      deterministic=deterministic, sinks=sv is not None, dropout=drop is not None,
                                      tma=all(_tma_readable(x) for x in ops[:4]),
                                      flashmask=0 if fm is None else fm.shape[3],
                                      flashmask_heads=0 if fm is None else fm.shape[1]), api.device_facts(dev))
    total_q = None if varlen is None else qv.shape[0]
    ws = arrays.empty_like_framework(qv, (workspace_floats(plan, total_q),), "float32")
    head_rows, rows = stats_rows(b, sq, h, total_q, row_pad(plan))
    if sv is not None and varlen is not None:
        # Packed sequences leave rows between their padded rows unwritten: give them the padding
        # rows' LSE +inf and D 0, so that the dsinks reduction over every row adds 0 there.
        ws[:rows] = float("inf")
        ws[rows:2 * rows] = 0
    with arrays.on_device(dev):
        prepared = run(plan, ops, lv, [g for g, _ in bufs], arrays.device_ptr(ws), scale, mods,
                       arrays.stream_for(qv), dev, None if varlen is None else varlen[:2], fm, drop)
        out = []
        for (kern, final), like in zip(bufs, (qv, kv, vv)):
            if kern is not final:
                final.array[...] = kern.array[..., :d]
            out.append(final.array)
        if sv is not None:
            out.append(_dsinks(ws, rows, (h, head_rows) if varlen is not None else (b, h, head_rows), sv))
    del ws  # the framework's allocator orders the free after the launches on this stream
    if sig is not None and all(x is y for x, y in zip(ops, (qv, kv, vv, dov, ov))) and all(
            kern is final for kern, final in bufs):
        arrays.repeat_keep(_repeats, sig, _Repeat(prepared, dev, workspace_floats(plan, total_q),
                                                  tuple(g is None for g in grads)))
    return tuple(arrays.hand_back(r, like) for r, like in zip(out, (qv, kv, vv, qv)))


# ---------------------------------------------------------------------------------------------
# Repeated calls from PyTorch (as cuflash.attention's): a call whose shapes, strides, dtypes,
# devices and options were checked, planned and launched before fires the same prepared
# launches with its own data pointers.

_repeats: dict = cached_on_plans({})  # signature (see _signature) -> _Repeat


def _signature(dout, q, k, v, out, lse, dq, dk, dv, causal, softmax_scale, deterministic, window_size, softcap,
               offset, startend_row_indices=None):
    """Everything the checks, the plan and the launch arguments of an attention_backward call
    on PyTorch CUDA tensors (no ALiBi, sinks or dropout) depend on, except the data pointers
    (arrays.repeat_signature); None for other calls."""
    return arrays.repeat_signature((q, k, v, dout, out, lse, dq, dk, dv, startend_row_indices), window_size,
                                   (causal, softmax_scale, deterministic, softcap, offset))


class _Repeat(NamedTuple):
    launches: tuple          # _prepare's
    device: int
    ws_floats: int
    allocate: tuple          # (dq, dk, dv): made here (contiguous, like the first call's) where True

    def __call__(self, dout, q, k, v, out, lse, dq, dk, dv, cu_q=None, cu_k=None, fm=None):
        """The call's (dq, dk, dv), or None when its pointers need the general path (alignment);
        ``cu_q``, ``cu_k``: packed sequences' cu_seqlens; ``fm``: FlashMask's indices."""
        torch = sys.modules["torch"]
        grads = [torch.empty_like(x, memory_format=torch.contiguous_format) if new else g
                 for new, g, x in zip(self.allocate, (dq, dk, dv), (q, k, v))]
        ptrs = dict(q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), dout=dout.data_ptr(), out=out.data_ptr(),
                    lse=lse.data_ptr(), dq=grads[0].data_ptr(), dk=grads[1].data_ptr(), dv=grads[2].data_ptr())
        if sum(p & 15 for p in ptrs.values()):
            return None
        if cu_q is not None:
            ptrs["cu_q"], ptrs["cu_k"] = cu_q.data_ptr(), cu_k.data_ptr()
        if fm is not None:
            ptrs["fm"] = fm.data_ptr()
        ws = q.new_empty((self.ws_floats,), dtype=torch.float32)
        ptrs["ws"] = ws.data_ptr()
        dev = self.device
        if arrays.current_device_id() == dev:
            fire(self.launches, ptrs, arrays.torch_stream(dev))
        else:
            with arrays.on_device(dev):
                fire(self.launches, ptrs, arrays.torch_stream(dev))
        return tuple(grads)


def _dsinks(ws, rows, shape, sv):
    """dsinks_h = -sum over batch and rows of exp(sink_h - LSE_i) D_i (float32 (nheads,), in the
    framework of ``ws``, on its current stream), from the backward workspace's first ``rows``
    floats (LSE * log2(e), as bwd_prep writes them) and the next ``rows`` (D), laid out as
    ``shape``: (batch, nheads, rows per head), or (nheads, rows per head) for packed sequences."""
    a = sv.array[1] if sv.framework == "dlpack" else sv.array
    if arrays._torch_tensor(ws):
        import torch as xp
        sink = (a if isinstance(a, xp.Tensor) else xp.from_dlpack(a)).detach().float()
    else:
        import cupy as xp
        a = a if isinstance(a, xp.ndarray) else xp.from_dlpack(a)  # sinks from another framework
        # bf16 is the upper half of a float32: widen its bits (no bf16 arithmetic needed)
        sink = ((a.view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32) if sv.dtype == "bfloat16"
                else a.astype(xp.float32))
    lse2, dsum = ws[:rows].reshape(shape), ws[rows:2 * rows].reshape(shape)
    w = xp.exp2((sink * _LOG2E).reshape(-1, 1) - lse2) * dsum  # padding rows: exp2(-inf) * 0 = 0
    w = w.sum(-1)
    return -(w if len(shape) == 2 else w.sum(0))


# ---------------------------------------------------------------------------------------------
# Launch

def stats_rows(batch: int, seqlen_q: int, nheads: int, total_q: int | None = None,
               pad: int = ROW_PAD) -> tuple[int, int]:
    """(rows per head, rows) of the fp32 LSE/D/dQ-accumulator workspace (the layout of stats_base in
    templates/common/bwd.cuh): dense (batch, nheads, seqlen_q padded to ``pad``, the plan's
    row_pad); packed sequences (``total_q`` given) (nheads, head_rows), sequence b at
    (cu_seqlens_q[b] rounded down to 4) + VARLEN_ROW_GAP * b."""
    if total_q is None:
        head_rows = cdiv(seqlen_q, pad) * pad
        return head_rows, batch * nheads * head_rows
    head_rows = cdiv(total_q + VARLEN_ROW_GAP * batch, 4) * 4
    return head_rows, nheads * head_rows


def row_pad(plan) -> int:
    """What a dense backward ``plan`` pads each head's workspace rows to: its dK/dV kernel's
    row_pad (ROW_PAD, or bwd_ws dq_t's 80-row steps)."""
    return plan.launches[1].variant.row_pad


def workspace_floats(plan, total_q: int | None = None) -> int:
    """The 4-byte words of workspace a backward ``plan`` needs: LSE and D rows, the dQ
    accumulator (none when the deterministic dQ kernel writes dQ), FlashMask's int32 bounds, then
    the ordered dQ writer's int32 semaphores (one per 64 rows); ``total_q`` for packed sequences."""
    p = plan.problem
    _, rows = stats_rows(p.batch, p.seqlen_q, p.nheads, total_q, row_pad(plan))
    return _sem_word(plan, rows) + sem_words(rows, plan.launches[1].variant)


def _sem_word(plan, rows: int) -> int:
    """The workspace word where the ordered dQ writer's semaphores start (after every other part)."""
    return rows * _row_floats(plan) + sum(n for *_, n in _flashmask_preps(plan))


def _ordered(plan) -> bool:
    """Whether the dK/dV kernel adds dQ in a fixed order (deterministic, through its dQ writer)."""
    return getattr(plan.launches[1].variant, "dq_ordered", False)


def _accumulates(plan) -> bool:
    """Whether dQ goes through the fp32 accumulator (and bwd_convert), not the deterministic dQ
    kernel."""
    return plan.launches[2].variant.kind != "bwd_dq"


def _row_floats(plan) -> int:
    """fp32 values per workspace row: LSE and D, and the dQ accumulator's head dim."""
    return row_floats(plan.launches[0].variant.head_dim, plan.launches[1].variant, plan.launches[2].variant)


def _flashmask_preps(plan):
    """(prep launch, key-block size, int32 count) of each FlashMask prep launch of a backward plan
    (plan.make_backward_plan: after the three kernels, the dK/dV kernel's key blocks first, then
    the deterministic dQ kernel's where they differ); their bounds follow the fp32 rows in the
    workspace in this order."""
    p = plan.problem
    if not p.flashmask:
        return []
    main, last = plan.launches[1].variant, plan.launches[2].variant
    sizes = dict.fromkeys((main.block_n, last.block_n) if last.kind == "bwd_dq" else (main.block_n,))
    heads = p.flashmask_heads or 1
    return [(l, bn, l.variant.workspace_ints(p.batch, heads, p.seqlen_k, bn))
            for l, bn in zip(plan.launches[3:], sizes)]


def run(plan, ops, lse, grads, ws_ptr: int, scale: float, mods, stream: int, device: int, cu=None, fm=None,
        dropout=None):
    """Launch the backward ``plan`` on ``stream`` (a raw pointer) for device views the kernels read
    and write in place (head dim ``plan.problem.head_dim``, 16-byte aligned, strides in multiples
    of 8 elements): ops = (q, k, v, dout, out), grads = (dq, dk, dv), lse; ``ws_ptr`` is an fp32
    workspace of ``workspace_floats(plan, total_q)``; ``mods`` as validate.mods gives them. Packed
    sequences: 3-dim views and ``cu`` = (cu_seqlens_q, cu_seqlens_k) views. ``fm``: the view of
    FlashMask's startend_row_indices for a FlashMask plan. ``dropout``: (dropout_p, seed, offset) of
    a plan with dropout. Allocates nothing. Returns the prepared launches (_prepare), which
    ``fire`` launches again for other data pointers of the same shapes and strides."""
    p = plan.problem
    b, sq, sk, h, hk, d = p.batch, p.seqlen_q, p.seqlen_k, p.nheads, p.nheads_k, p.head_dim
    head_rows, rows = stats_rows(b, sq, h, None if cu is None else ops[0].shape[0], row_pad(plan))
    lse2, dsum = _Ptr("ws"), _Ptr("ws", 4 * rows)
    acc = _Ptr("ws", 8 * rows) if _accumulates(plan) else 0
    sem = _Ptr("ws", 4 * _sem_word(plan, rows)) if _ordered(plan) else 0
    fm_args = None
    if p.flashmask:
        if fm is None:
            raise ValueError(f"{plan.launches[1].name} needs startend_row_indices (run's fm=)")
        fm_args = _flashmask_args(plan, fm, 4 * rows * _row_floats(plan))
    packed = None
    if cu is not None:  # packed views as (batch, max_seqlen, nheads, d) with token batch strides
        packed = (ops[0].shape[0], ops[1].shape[0])  # total_q, total_k (bwd_ws's tensor maps span them)
        ops = [validate.batched(x, b, n) for x, n in zip(ops, (sq, sk, sk, sq, sq))]
        grads = [validate.batched(g, b, n) for g, n in zip(grads, (sq, sk, sk))]
        lse_st = (lse.strides[1], lse.strides[0], lse.strides[1])  # row i of (sequence b, head h)
        cu_ptrs, cu = (cu[0].ptr, cu[1].ptr), (_Ptr("cu_q"), _Ptr("cu_k"))
    else:
        cu_ptrs = None
        lse_st = tuple(lse.strides)
        cu = (0, 0)
    _, cap, alibi, alibi_sb = mods
    left, right = plan.window_eff
    post = cap if cap > 0 else scale  # the factor the softmax applies to the raw scores
    score = dict(scale_log2=post * _LOG2E, scale=scale, cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], window_left=left,
                 window_right=right, softcap_scale=scale / cap if cap > 0 else 0.0,
                 alibi_slopes=alibi.ptr if alibi is not None else 0, alibi_sb=alibi_sb, alibi_scale=1.0 / post)
    kernels = tuple(launch.variant for launch in plan.launches)
    prepared = _prepare(_launch_specs(kernels[:3], ops, lse, lse_st, grads, (lse2, dsum, acc, sem),
                                      (b, sq, sk, h, hk, d, head_rows), score, fm_args,
                                      dropout_fields(kernels[1], dropout), packed), device)
    fire(prepared, _pointers(ops, lse, grads, ws_ptr, cu_ptrs, None if fm is None else fm.ptr), stream)
    return prepared


def _flashmask_args(plan, fm, at: int):
    """(prep launches with their fields, the dK/dV kernel's FlashMask fields, the dQ kernel's) of a
    FlashMask plan, for the indices' view ``fm`` (role "fm") and the int32 bounds ``at`` bytes into
    the workspace."""
    p = plan.problem
    heads = fm.shape[1]
    idx = _Ptr("fm")
    fields = dict(fm_idx=idx, fm_sb=fm.strides[0], fm_sh=fm.strides[1], fm_ss=fm.strides[2], fm_sc=fm.strides[3],
                  fm_hdiv=p.nheads // heads, fm_heads=heads)
    preps, blocks = [], {}
    for launch, bn, n in _flashmask_preps(plan):
        preps.append((launch, dict(idx=idx, idx_sb=fm.strides[0], idx_sh=fm.strides[1], idx_ss=fm.strides[2],
                                   idx_sc=fm.strides[3], out=_Ptr("ws", at), seqlen_k=p.seqlen_k, block_n=bn,
                                   heads=heads)))
        blocks[bn] = _Ptr("ws", at)
        at += 4 * n
    main, last = plan.launches[1].variant, plan.launches[2].variant
    return (preps, dict(fields, fm_blocks=blocks[main.block_n]),
            dict(fields, fm_blocks=blocks[last.block_n]) if last.kind == "bwd_dq" else {})


def _st(prefix: str, x) -> dict:
    """An operand's (batch, seq, head) strides in elements, named as the parameter structs do."""
    return stride_values(prefix, x.strides)


class _Ptr(NamedTuple):
    """A pointer field of a launch, resolved when it fires: operand ``role``'s data pointer (q, k,
    v, dout, out, lse, dq, dk, dv, ws: the fp32 workspace, cu_q, cu_k: packed sequences'
    cu_seqlens, or fm: FlashMask's startend_row_indices) plus ``offset`` bytes."""
    role: str
    offset: int = 0


class _Map(NamedTuple):
    """A TMA tensor-map field, encoded when the launch fires (it holds operand ``role``'s
    pointer): the operand's shape and strides, the box's rows and the dtype."""
    role: str
    shape: tuple
    strides: tuple
    rows: int
    dtype: str


def _pointers(ops, lse, grads, ws_ptr: int, cu=None, fm=None) -> dict:
    """The data pointers of a backward call by role (see _Ptr); ``cu``: the (cu_seqlens_q,
    cu_seqlens_k) pointers of packed sequences; ``fm``: FlashMask's startend_row_indices pointer."""
    q, k, v, do, o = ops
    dq, dk, dv = grads
    ptrs = dict(q=q.ptr, k=k.ptr, v=v.ptr, dout=do.ptr, out=o.ptr, lse=lse.ptr, dq=dq.ptr, dk=dk.ptr, dv=dv.ptr,
                ws=ws_ptr, fm=fm)
    if cu is not None:
        ptrs["cu_q"], ptrs["cu_k"] = cu
    return ptrs


def _launch_specs(kernels, ops, lse, lse_st, grads, ws, shape, score, fm=None, drop=None, packed=None) -> list:
    """(variant, grid, fields) of each launch of a backward, in order; pointer fields are _Ptr and
    tensor maps _Map (pointers given as ints, ALiBi's slopes, stay fixed: calls with them do not
    repeat). ``ws`` = (lse2, dsum, dQ accumulator, dQ semaphores)
    fields; ``score``: the kernels' scale, varlen, window, softcap and ALiBi fields by name; ``fm``: FlashMask's (prep launches, dK/dV
    fields, dQ fields) from _flashmask_args, or None; ``drop``: the dropout fields of the dK/dV and
    dQ kernels (launch.dropout_fields), or None; ``packed``: (total_q, total_k) of packed sequences
    (ops are then batched views with token batch strides), or None."""
    q, k, v, do, o = ops
    dq, dk, dv = grads
    lse2, dsum, acc, sem = ws
    b, sq, sk, h, hk, d, head_rows = shape
    prep, main, last = kernels
    cu_q = score["cu_seqlens_q"]
    rows = dict(seqlen_q_arg=sq, nheads=h, head_dim=d, head_rows=head_rows)
    out = []
    fm_main, fm_last = {}, {}
    if fm is not None:
        preps, fm_main, fm_last = fm
        out += [(launch.variant, launch.grid, fields) for launch, fields in preps
                if launch.grid[0] > 0]  # no key block: nothing to reduce
    # (dense: every padded row, which may be more than seqlen_q's multiple of 128)
    # (with runs of key blocks, dq_groups, a run's first adds store: no accumulator to zero)
    out.append((prep, prep.grid(b, sq if cu_q else head_rows, h, d), dict(
        dout=_Ptr("dout"), out=_Ptr("out"), lse=_Ptr("lse"), lse2=lse2, dsum=dsum,
        dq_accum=acc if prep.dq_groups == 1 else 0, dq_sem=sem,
        **_st("do", do), **_st("o", o), lse_sb=lse_st[0], lse_sh=lse_st[1], lse_ss=lse_st[2], **rows, cu_seqlens_q=cu_q)))
    common = dict(q=_Ptr("q"), k=_Ptr("k"), v=_Ptr("v"), dout=_Ptr("dout"), lse2=lse2, dsum=dsum, **_st("q", q),
                  **_st("k", k), **_st("v", v), **_st("do", do), **rows, seqlen_k_arg=sk, ngroups=h // hk, **score)
    grads_kv = dict(dk=_Ptr("dk"), dv=_Ptr("dv"), **_st("dk", dk), **_st("dv", dv))
    if main.family == "bwd_ws":  # q, k, v, dout through TMA tensor maps (boxes: a step's rows, a block's keys)
        def tmap(role, x, box, total):
            if packed is None:
                return _Map(role, tuple(x.shape), tuple(x.strides), box, main.dtype)
            # packed sequences: every token as one batch of (total, heads, d) (x's batch stride is
            # the token stride); the kernel starts a sequence's boxes at its first token
            return _Map(role, (1, total, *x.shape[2:]), (total * x.strides[1], *x.strides[1:]), box, main.dtype)
        tq, tk = packed or (0, 0)
        maps = {f"tma_{n}": tmap(role, x, box, total)
                for n, role, x, box, total in (("q", "q", q, main.block_m, tq), ("k", "k", k, main.block_n, tk),
                                               ("v", "v", v, main.block_n, tk), ("do", "dout", do, main.block_m, tq))}
        # the score and varlen fields it has: softcap's, ALiBi's and cu_seqlens only in the variants with them
        fields = (("scale_log2", "scale", "window_left", "window_right") + ("softcap_scale",) * main.softcap
                  + ("alibi_slopes", "alibi_sb", "alibi_scale") * main.alibi
                  + ("cu_seqlens_q", "cu_seqlens_k") * main.varlen)
        out.append((main, main.grid(b, sq, sk, h, hk), dict(
            **maps, lse2=lse2, dsum=dsum, dq_accum=acc, dq_sem=sem, **grads_kv, seqlen_q_arg=sq, nheads=h,
            head_rows=head_rows, seqlen_k_arg=sk, ngroups=h // hk, **fm_main, **{f: score[f] for f in fields})))
    else:
        out.append((main, main.grid(b, sq, sk, h, hk), dict(dq_accum=acc, **grads_kv, **common, **fm_main,
                                                            **(drop or {}))))
    if last.kind == "bwd_dq":
        out.append((last, last.grid(b, sq, sk, h, hk), dict(dq=_Ptr("dq"), **_st("dq", dq), **common, **fm_last,
                                                            **(drop or {}))))
    else:
        out.append((last, last.grid(b, sq, h, d), dict(dq_accum=acc, dq=_Ptr("dq"), **_st("dq", dq), **rows,
                                                       scale=score["scale"], cu_seqlens_q=cu_q)))
    return out


_PLACEHOLDERS = {_Ptr: 0, _Map: bytes(TENSOR_MAP_BYTES)}  # what a slot holds until it fires


class _Launch(NamedTuple):
    """One prepared launch: the loaded kernel, grid, block, shared memory, its struct's values
    in order, and the (index, _Ptr or _Map) of the values filled in when it fires."""
    kernel: object
    grid: tuple
    block: tuple
    smem: int
    values: tuple
    slots: tuple


def _prepare(specs, device: int) -> tuple:
    """_Launch of each (variant, grid, fields) of _launch_specs, on ``device``."""
    out = []
    for var, grid, fields in specs:
        table = var.params
        slots = tuple((table.index(n), x) for n, x in fields.items() if x.__class__ in _PLACEHOLDERS)
        values = table.values(**{n: _PLACEHOLDERS.get(x.__class__, x) for n, x in fields.items()})
        out.append(_Launch(compiler.get_kernel(var, device), (*grid, 1, 1)[:3], (var.threads, 1, 1), var.smem_bytes,
                           values, slots))
    return tuple(out)


def fire(launches, ptrs: dict, stream: int):
    """Launch prepared launches on ``stream`` for the data pointers ``ptrs`` (by role)."""
    for la in launches:
        values = list(la.values)
        for i, x in la.slots:
            values[i] = (ptrs[x.role] + x.offset if x.__class__ is _Ptr
                         else tensor_map(ptrs[x.role], x.shape, x.strides, x.rows, x.dtype))
        la.kernel.launch(la.grid, la.block, la.smem, stream, values)
