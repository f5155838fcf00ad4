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
runtime property of the same kernels (cu_seqlens pointers non-null, read on the device).
"""
from __future__ import annotations

import math

import numpy as np

from . import api, arrays, compiler, validate
from .codegen import HEAD_DIM_BUCKETS, Variant
from .plan import cdiv, effective_window, head_dim_bucket

# dK/dV kernel tiles per head-dim bucket: (block_m query rows per step, block_n keys per block,
# warps, Q/dO stages, mma). In the mma.sync kernel (bwd/dkdv.cu.j2) every warp owns 16 keys (two warps
# share them above d = 128), so block_m sets the S^T and dP^T registers. These compile with no
# spills under NVRTC 13.0 and 13.5 for sm_80 and sm_90 (checked in the CPU tests).
DKDV_TILES = {
    32: (64, 128, 8, 2, "sync"),
    64: (64, 128, 8, 2, "sync"),
    96: (32, 128, 8, 2, "sync"),
    128: (32, 128, 8, 2, "sync"),
    192: (32, 64, 8, 2, "sync"),
    256: (32, 64, 8, 2, "sync"),
}
# Deterministic dQ kernel tiles: (block_m, block_n, warps, K/V stages).
DQ_TILES = {
    32: (64, 128, 4, 2),
    64: (128, 64, 8, 2),
    96: (64, 64, 4, 2),
    128: (64, 64, 4, 2),
    192: (64, 32, 4, 2),
    256: (64, 32, 4, 2),
}
ROW_PAD = 128          # LSE/D/dQ-accumulator rows are padded to a multiple of every block_m
VARLEN_ROW_GAP = ROW_PAD + 4  # packed sequences: rows between sequence starts (kVarlenRowGap, bwd.cuh)
PREP_ROWS_PER_BLOCK = 8
CONVERT_THREADS = 256
_LOG2E = math.log2(math.e)
_DTYPES = {"float16": "fp16", "bfloat16": "bf16"}


MASKS = ((False, False), (True, False), (False, True))  # (causal, local)
MODS = ((False, False), (True, False), (False, True), (True, True))  # (softcap, alibi)


# sm_90 at d = 64 and 128 without softcap or ALiBi: the wgmma kernel (bwd/dkdv_wgmma.cu.j2), two
# warpgroups of 64 keys, steps of 128 queries at d = 64 and 64 at d = 128 (its dK and dV
# accumulators leave no registers for a softcap's 1 - t^2 factors or ALiBi's bias).
DKDV_WGMMA_TILES = {64: (128, 128, 8, 2, "wgmma"), 128: (64, 128, 8, 2, "wgmma")}
# With a softcap at d = 256 the second Q/dO stage does not fit the registers (NVRTC 13.0 and
# 13.5, sm_80 and sm_90).
DKDV_SOFTCAP_TILES = {256: (32, 64, 8, 1, "sync")}


def dkdv_tile(bucket: int, softcap: bool = False, alibi: bool = False,
              arch: int = 90) -> tuple[int, int, int, int, str]:
    """The dK/dV kernel's tile: DKDV_WGMMA_TILES on sm_90 where it has the bucket and there is
    no softcap or ALiBi; DKDV_SOFTCAP_TILES with a softcap where it has the bucket; else
    DKDV_TILES. Windows fit every tile."""
    if arch == 90 and bucket in DKDV_WGMMA_TILES and not (softcap or alibi):
        return DKDV_WGMMA_TILES[bucket]
    if softcap and bucket in DKDV_SOFTCAP_TILES:
        return DKDV_SOFTCAP_TILES[bucket]
    return DKDV_TILES[bucket]


def dq_tile(bucket: int, softcap: bool = False, alibi: bool = False) -> tuple[int, int, int, int]:
    """The deterministic dQ kernel's tile: DQ_TILES (every window/softcap/ALiBi combination fits
    them with no spills)."""
    return DQ_TILES[bucket]


def variants(bucket: int, dtype: str, causal: bool, deterministic: bool, arch: int, local: bool = False,
             softcap: bool = False, alibi: bool = False) -> tuple[Variant, ...]:
    """The kernels one backward call launches, in launch order. ``causal``/``local`` are the
    mask as launched (plan.effective_window: a window that hides no key beyond the causal mask
    runs as causal)."""
    bm, bn, w, st, mma = dkdv_tile(bucket, softcap, alibi, arch)
    mods = dict(local=local, softcap=softcap, alibi=alibi)
    dkdv = dict(mods, mma=mma)
    prep = Variant("bwd_prep", bucket, dtype, arch=arch, warps=PREP_ROWS_PER_BLOCK)
    if deterministic:
        qm, qn, qw, qst = dq_tile(bucket, softcap, alibi)
        return (prep, Variant("bwd_dkdv", bucket, dtype, causal, False, bm, bn, w, arch, st, **dkdv),
                Variant("bwd_dq", bucket, dtype, causal, False, qm, qn, qw, arch, qst, **mods))
    return (prep, Variant("bwd_dkdv_dq", bucket, dtype, causal, False, bm, bn, w, arch, st, **dkdv),
            Variant("bwd_convert", bucket, dtype, arch=arch, warps=CONVERT_THREADS // 32))


def bwd_variants(arch: int, mods: bool = True) -> list[Variant]:
    """Every backward kernel variant that can launch on ``arch`` (what warmup/CI compile):
    per head-dim bucket and dtype, every mask (full, causal, sliding window) with and without
    softcap and ALiBi, atomic and deterministic. ``mods=False`` leaves out the window, softcap
    and ALiBi variants. Backward kernels always predicate head-dim columns (a per-thread
    compare), so the real head dim never doubles the variant count."""
    out = []
    for bucket in HEAD_DIM_BUCKETS:
        for dtype in ("fp16", "bf16"):
            for causal, local in MASKS if mods else MASKS[:2]:
                for softcap, alibi in MODS if mods else MODS[:1]:
                    for det in (False, True):
                        out.extend(variants(bucket, dtype, causal, det, arch, local, softcap, alibi))
    return list(dict.fromkeys(out))


def smem_bytes(v: Variant) -> int:
    """Dynamic shared memory of a backward variant (mirrors kSmemBytes in its template)."""
    pad = 0 if v.swizzled else 8  # padded rows, or wgmma's 128-byte swizzle
    row = (v.head_dim + pad) * 2
    if v.kind in ("bwd_dkdv", "bwd_dkdv_dq"):
        extra = v.block_n * (v.block_m + pad) * 2 if v.kind == "bwd_dkdv_dq" else 0  # dS^T, [key][query], for dQ
        return 2 * v.block_n * row + 2 * v.stages * v.block_m * row + extra + 2 * v.stages * v.block_m * 4 + 48
    if v.kind == "bwd_dq":
        return 2 * v.block_m * row + 2 * v.stages * v.block_n * row
    return 0


# ---------------------------------------------------------------------------------------------
# Validation

def _validate(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, dq, dk, dv,
              window_size, softcap, alibi_slopes):
    """attention's rules plus the backward's own arguments; views and checked values."""
    qv, kv, vv = validate.view(q, "q"), validate.view(k, "k"), validate.view(v, "v")
    validate.operands(qv, kv, vv)
    b, sq, h, d = qv.shape
    dov, ov, lv = _forward_results(dout, out, lse, qv, (b, h, sq), "(batch, nheads, seqlen_q)", "attention")
    grads = validate.grads(dq, dk, dv, qv, kv, vv)
    scale, causal, deterministic, mods = _options(causal, softmax_scale, deterministic, window_size, softcap,
                                                  alibi_slopes, b, qv)
    return qv, kv, vv, dov, ov, lv, grads, scale, causal, deterministic, mods


def _validate_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     causal, softmax_scale, deterministic, dq, dk, dv, window_size, softcap, alibi_slopes):
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
    return qv, kv, vv, dov, ov, lv, cq, ck, max_sq, max_sk, grads, scale, causal, deterministic, mods


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
                       softcap=0.0, alibi_slopes=None, deterministic=False, dq=None, dk=None, dv=None):
    """Gradients (dq, dk, dv) of ``out = cuflash.attention(q, k, v, causal=..., softmax_scale=...,
    window_size=..., softcap=..., alibi_slopes=...)`` for the output gradient ``dout``.

    q, out, dout: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim),
    float16 or bfloat16, last dim contiguous, any other strides; lse: float32 (batch, nheads,
    seqlen_q) from ``attention(..., return_lse=True)``. Same masking and score rules as the
    forward (causal and windows aligned bottom-right; a query row that sees no key gets zero
    gradient; ``softcap`` and ``alibi_slopes`` as in :func:`cuflash.attention`; the ALiBi bias
    has no gradient). With ``deterministic=True`` no atomics are used and repeated calls give
    bitwise equal gradients. ``dq``, ``dk``, ``dv``: optional arrays to write the gradients
    into. Returns the caller's array type (NumPy inputs are computed on the current GPU and
    come back as NumPy).
    """
    qv, kv, vv, dov, ov, lv, grads, scale, causal, deterministic, mods = _validate(
        dout, q, k, v, out, lse, causal, softmax_scale, deterministic, dq, dk, dv, window_size, softcap,
        alibi_slopes)
    if qv.device < 0:  # NumPy in, NumPy out: compute on the current GPU
        dev = api._current_device()
        on = lambda x: None if x is None else arrays.to_device(np.asarray(x.array), dev)
        res = attention_backward(on(dov), on(qv), on(kv), on(vv), on(ov), on(lv), causal=causal,
                                 softmax_scale=scale, window_size=mods[0], softcap=mods[1],
                                 alibi_slopes=on(mods[2]), deterministic=deterministic)
        return _host_results(res, (dq, dk, dv), (qv, kv, vv))
    return _backward_device(dov, qv, kv, vv, ov, lv, grads, causal, scale, deterministic, mods)


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, deterministic=False, dq=None, dk=None, dv=None):
    """Gradients (dq, dk, dv) of ``out = cuflash.attention_varlen(q, k, v, cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)`` (dense K/V) for the output gradient ``dout``.

    q, out, dout: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim); lse: float32
    (nheads, total_q) from ``attention_varlen(..., return_lse=True)``; ``cu_seqlens_q``,
    ``cu_seqlens_k``: int32 device arrays (batch + 1,), read by the kernels on the device (no
    host synchronisation; well-formed offsets under the maxima are the caller's contract, as in
    the forward). Sequences may be empty. Other arguments as in :func:`attention_backward`;
    ALiBi slopes may be (nheads,) or (batch, nheads).
    """
    qv, kv, vv, dov, ov, lv, cq, ck, max_sq, max_sk, grads, scale, causal, deterministic, mods = \
        _validate_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                         softmax_scale, deterministic, dq, dk, dv, window_size, softcap, alibi_slopes)
    if qv.device < 0:  # NumPy in, NumPy out: compute on the current GPU
        dev = api._current_device()
        on = lambda x: None if x is None else arrays.to_device(np.asarray(x.array), dev)
        res = attention_varlen_backward(on(dov), on(qv), on(kv), on(vv), on(ov), on(lv), on(cq), on(ck),
                                        max_sq, max_sk, causal=causal, softmax_scale=scale,
                                        window_size=mods[0], softcap=mods[1], alibi_slopes=on(mods[2]),
                                        deterministic=deterministic)
        return _host_results(res, (dq, dk, dv), (qv, kv, vv))
    return _backward_device(dov, qv, kv, vv, ov, lv, grads, causal, scale, deterministic, mods,
                            varlen=(cq, ck, max_sq, max_sk))


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
    if d_pad == like.shape[-1] and _aligned(final):
        return final, final
    scratch = arrays.view(arrays.empty_like_framework(like, (*like.shape[:-1], d_pad), like.dtype), "grad")
    return scratch, final


def _aligned(x) -> bool:
    """api._aligned for 4-dim views and for packed (total, nheads, d) ones (token stride checked)."""
    return api._aligned(x if len(x.shape) == 4 else api._batched(x, 1, x.shape[0]))


def _padded(x, d_pad):
    """A zero-padded (..., d_pad) copy of a device view (any rank) that the kernels cannot read
    in place."""
    a = x.array[1] if x.framework == "dlpack" else x.array
    buf = arrays.empty_like_framework(x, (*x.shape[:-1], d_pad), x.dtype)
    buf[..., x.shape[-1]:] = 0
    buf[..., :x.shape[-1]] = a
    return arrays.view(buf, "copy")


def mask_of(causal: bool, window, seqlen_q: int, seqlen_k: int):
    """(causal, local, (left, right)) as the kernels run them: the forward's effective window
    (plan.effective_window), so the backward masks exactly the keys its LSE summed over."""
    left, right = effective_window(causal, window, seqlen_q, seqlen_k)
    causal_eff = left < 0 and right == 0
    return causal_eff, (left, right) != (-1, -1) and not causal_eff, (left, right)


def _backward_device(dov, qv, kv, vv, ov, lv, grads, causal, scale, deterministic, mods, varlen=None):
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
        # No query or no key: every gradient is zero (or empty).
        for r in results:
            if 0 not in r.shape:
                r[...] = 0
        return tuple(arrays.hand_back(r, like) for r, like in zip(results, (qv, kv, vv)))

    # Head dims that are not a multiple of 8, or unaligned operands, go through padded copies
    # (zero columns change no score and no gradient).
    ops = [x if d_pad == d and _aligned(x) else _padded(x, d_pad) for x in (qv, kv, vv, dov, ov)]
    window, cap, alibi, alibi_sb = mods
    causal, local, (left, right) = mask_of(causal, window, sq, sk)
    bucket = head_dim_bucket(d_pad)
    dtype = _DTYPES[qv.dtype]
    dev = qv.device
    arch = api.device_facts(dev).arch
    kernels = variants(bucket, dtype, causal, deterministic, arch, local, cap > 0, alibi is not None)

    # LSE/D/dQ-accumulator rows (the layout of stats_base in templates/common/bwd.cuh): dense
    # (batch, nheads, seqlen_q padded to ROW_PAD); packed sequences (nheads, head_rows) with
    # sequence b at (cu_seqlens_q[b] rounded down to 4) + VARLEN_ROW_GAP * b.
    if varlen is None:
        head_rows = cdiv(sq, ROW_PAD) * ROW_PAD
        rows = b * h * head_rows
    else:
        head_rows = cdiv(total_q + VARLEN_ROW_GAP * b, 4) * 4
        rows = h * head_rows
    n_acc = 0 if deterministic else rows * bucket
    ws = arrays.empty_like_framework(qv, (2 * rows + n_acc,), "float32")
    ws_ptr = arrays.device_ptr(ws)
    lse2_ptr, dsum_ptr = ws_ptr, ws_ptr + 4 * rows
    acc_ptr = ws_ptr + 8 * rows if not deterministic else 0

    if varlen is not None:  # packed views as (batch, max_seqlen, nheads, d) with token batch strides
        ops = [api._batched(x, b, n) for x, n in zip(ops, (sq, sk, sk, sq, sq))]
        kern_grads = [api._batched(g, b, n) for (g, _), n in zip(bufs, (sq, sk, sk))]
        ls = lv.strides
        lse_st = (ls[1], ls[0], ls[1])  # row i of (sequence b, head h) at cu_seqlens_q[b] * ls[1] + ...
        cu = (cq.ptr, ck.ptr)
    else:
        kern_grads = [g for g, _ in bufs]
        lse_st = tuple(lv.strides)
        cu = (0, 0)
    post = cap if cap > 0 else scale  # the factor the softmax applies to the raw scores
    score = (np.float32(post * _LOG2E), np.float32(scale), *cu, np.int32(left), np.int32(right),
             np.float32(scale / cap if cap > 0 else 0.0), alibi.ptr if alibi is not None else 0,
             np.int32(alibi_sb), np.float32(1.0 / post))
    with arrays.on_device(dev):
        _launch(kernels, ops, lv, lse_st, kern_grads, (lse2_ptr, dsum_ptr, acc_ptr),
                (b, sq, sk, h, hk, d_pad, head_rows), score, arrays.stream_for(qv), dev)
    out = []
    for (kern, final), like in zip(bufs, (qv, kv, vv)):
        if kern is not final:
            final.array[...] = kern.array[..., :d]
        out.append(final.array)
    del ws  # the framework's allocator orders the free after the launches on this stream
    return tuple(arrays.hand_back(r, like) for r, like in zip(out, (qv, kv, vv)))


# ---------------------------------------------------------------------------------------------
# Launch

_smem_set: set[tuple[str, int]] = set()


def _kernel(v: Variant, device: int):
    """The loaded kernel, with its dynamic shared-memory limit raised to what it uses."""
    fn = compiler.get_kernel(v, device)
    key = (v.name, device)
    if key not in _smem_set:
        need = smem_bytes(v)
        if need > 48 * 1024:
            from cupy_backends.cuda.api import driver
            driver.funcSetAttribute(fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, need)
        _smem_set.add(key)
    return fn


def _st(x):
    return tuple(x.strides[:3])  # (batch, seq, head) strides in elements, 64-bit


def _launch(kernels, ops, lse, lse_st, grads, ws, shape, score, stream, device):
    """``score``: (scale_log2, scale, cu_seqlens_q, cu_seqlens_k, window_left, window_right,
    softcap_scale, alibi pointer, alibi batch stride, alibi_scale), the kernels' trailing
    arguments from scale_log2 on."""
    q, k, v, do, o = ops
    dq, dk, dv = grads
    lse2, dsum, acc = ws
    b, sq, sk, h, hk, d, head_rows = shape
    i32, f32 = np.int32, np.float32
    prep, main, last = kernels
    cu_q = score[2]
    _kernel(prep, device)((cdiv(cdiv(sq, ROW_PAD) * ROW_PAD, PREP_ROWS_PER_BLOCK), h, b), (prep.threads,),
                          (do.ptr, o.ptr, lse.ptr, lse2, dsum, acc, *_st(do), *_st(o), *lse_st,
                           i32(sq), i32(h), i32(d), i32(head_rows), cu_q), stream=stream)
    shape_args = (i32(sq), i32(sk), i32(h), i32(h // hk), i32(d), i32(head_rows))
    common = (*_st(q), *_st(k), *_st(v), *_st(do))
    _kernel(main, device)((cdiv(sk, main.block_n), hk, b), (main.threads,),
                          (q.ptr, k.ptr, v.ptr, do.ptr, lse2, dsum, acc, dk.ptr, dv.ptr,
                           *common, *_st(dk), *_st(dv), *shape_args, *score),
                          shared_mem=smem_bytes(main), stream=stream)
    if last.kind == "bwd_dq":
        _kernel(last, device)((cdiv(sq, last.block_m), h, b), (last.threads,),
                              (q.ptr, k.ptr, v.ptr, do.ptr, lse2, dsum, dq.ptr, *common, *_st(dq),
                               *shape_args, *score),
                              shared_mem=smem_bytes(last), stream=stream)
    else:
        _kernel(last, device)((cdiv(sq * h * (d // 8), CONVERT_THREADS), 1, b), (CONVERT_THREADS,),
                              (acc, dq.ptr, *_st(dq), i32(sq), i32(h), i32(d), i32(head_rows), f32(score[1]),
                               cu_q), stream=stream)
