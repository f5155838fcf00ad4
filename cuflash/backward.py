"""Attention backward pass (FlashAttention-2 algorithm): gradients of ``cuflash.attention``.

Given dO, the forward's inputs q, k, v, its output O and its LSE (fp32, natural log), the
gradients are, per query row i and key j (s = scale * q.k, masked scores are -inf):

    P = exp(s - LSE)      dV = P^T dO      dP = dO V^T      D_i = sum_c dO_ic O_ic
    dS = P * (dP - D)     dQ = scale * dS K                 dK = scale * dS^T Q

and with GQA the dK, dV of a KV head are summed over its query heads.

Kernels (``templates/``), all on the caller's stream:

1. ``bwd_prep`` (bwd_prep.cu.j2): one warp per query row writes D and LSE * log2(e) into an fp32
   workspace padded to whole query blocks (padding rows: D = 0, LSE = +inf, so P = 0 there),
   and zeroes the row of the fp32 dQ accumulator when one is used.
2. ``bwd_dkdv_dq`` / ``bwd_dkdv`` (bwd.cu.j2): one block per (key block, KV head, batch) keeps
   its K and V tiles in shared memory and walks the query heads of its group and the query
   blocks that see its keys (causal: blocks entirely above the diagonal are skipped, blocks on
   it are masked). Per step it recomputes S^T = K Q^T with mma.sync, P^T = exp2(S^T c - LSE2),
   dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - D) and dK += dS^T Q, the accumulators in
   fp32 registers; P^T and dS^T go from the MMA outputs straight into the next MMA's operands.
   dK and dV are therefore complete in one block and written once: no atomics for them, GQA
   included. The ``_dq`` variant also stores dS^T in shared memory and adds dQ = dS K into an
   fp32 buffer with atomic adds.
3. ``bwd_convert`` (bwd_convert.cu.j2): dQ = scale * accumulator, in the input dtype.

``deterministic=True`` launches ``bwd_dkdv`` (no dQ) and, instead of atomics and the convert
kernel, ``bwd_dq`` (bwd_dq.cu.j2): one block per query block walks the K/V blocks it sees,
recomputing P and dS, and writes dQ once; every gradient is then bitwise repeatable.
"""
from __future__ import annotations

import math

import numpy as np

from . import api, arrays, compiler
from .codegen import HEAD_DIM_BUCKETS, Variant
from .plan import cdiv, head_dim_bucket

# dK/dV kernel tiles per head-dim bucket: (block_m query rows per step, block_n keys per block,
# warps, Q/dO stages). Every warp owns 16 keys (two warps share them above d = 128), so
# block_m sets the S^T and dP^T registers; these compile with no spills under NVRTC 13.0 and
# 13.5 for sm_80 and sm_90 (checked in the CPU tests).
DKDV_TILES = {
    32: (64, 128, 8, 2),
    64: (64, 128, 8, 2),
    96: (32, 128, 8, 2),
    128: (32, 128, 8, 2),
    192: (32, 64, 8, 2),
    256: (32, 64, 8, 2),
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
PREP_ROWS_PER_BLOCK = 8
CONVERT_THREADS = 256
_LOG2E = math.log2(math.e)
_DTYPES = {"float16": "fp16", "bfloat16": "bf16"}


def variants(bucket: int, dtype: str, causal: bool, deterministic: bool, arch: int) -> tuple[Variant, ...]:
    """The kernels one backward call launches, in launch order."""
    bm, bn, w, st = DKDV_TILES[bucket]
    prep = Variant("bwd_prep", bucket, dtype, arch=arch, warps=PREP_ROWS_PER_BLOCK)
    if deterministic:
        qm, qn, qw, qst = DQ_TILES[bucket]
        return (prep, Variant("bwd_dkdv", bucket, dtype, causal, False, bm, bn, w, arch, st),
                Variant("bwd_dq", bucket, dtype, causal, False, qm, qn, qw, arch, qst))
    return (prep, Variant("bwd_dkdv_dq", bucket, dtype, causal, False, bm, bn, w, arch, st),
            Variant("bwd_convert", bucket, dtype, arch=arch, warps=CONVERT_THREADS // 32))


def bwd_variants(arch: int) -> list[Variant]:
    """Every backward kernel variant that can launch on ``arch`` (what warmup/CI compile).
    Backward kernels always predicate head-dim columns (a per-thread compare), so the real head
    dim never doubles the variant count."""
    out = []
    for bucket in HEAD_DIM_BUCKETS:
        for dtype in ("fp16", "bf16"):
            for causal in (False, True):
                for det in (False, True):
                    out.extend(variants(bucket, dtype, causal, det, arch))
    return list(dict.fromkeys(out))


def smem_bytes(v: Variant) -> int:
    """Dynamic shared memory of a backward variant (mirrors kSmemBytes in its template)."""
    row = (v.head_dim + 8) * 2
    if v.kind in ("bwd_dkdv", "bwd_dkdv_dq"):
        ds = v.block_n * (v.block_m + 8) * 2 if v.kind == "bwd_dkdv_dq" else 0
        return 2 * v.block_n * row + 2 * v.stages * v.block_m * row + ds + 2 * v.stages * v.block_m * 4
    if v.kind == "bwd_dq":
        return 2 * v.block_m * row + 2 * v.stages * v.block_n * row
    return 0


# ---------------------------------------------------------------------------------------------
# Validation

def _check_like(x, like, name, like_name):
    """``x`` must have ``like``'s shape, dtype and place, last dim contiguous."""
    if tuple(x.shape) != tuple(like.shape):
        raise ValueError(f"{name} must have {like_name}'s shape {api._shape_str(like)}, got {api._shape_str(x)}")
    if x.dtype != like.dtype:
        raise TypeError(f"{name} must have {like_name}'s dtype {like.dtype}, got {x.dtype}")
    if len(x.shape) == 4 and x.shape[3] > 1 and x.strides[3] != 1 and 0 not in x.shape:
        raise ValueError(f"{name} must be contiguous in its last dim (stride 1), got strides {tuple(x.strides)}")
    api._check_same_place((like_name, like), (name, x))


def _check_grad_out(x, like, name, like_name, original):
    """A caller-provided gradient buffer: written in place, so it must be a plain array of the
    caller's framework with ``like``'s shape and dtype."""
    if x.framework == "dlpack":
        raise TypeError(f"{name} must be a PyTorch, CuPy or NumPy array (written in place); "
                        f"got {type(x.array[0]).__name__}")
    if x.framework != like.framework:
        raise TypeError(f"{name} must be a {like.framework} array like {like_name}, got a {x.framework} array")
    if x.framework == "numpy" and not (isinstance(original, np.ndarray) and original.flags.writeable):
        raise TypeError(f"{name} in host memory must be a writable NumPy array, got {type(original).__name__}")
    _check_like(x, like, name, like_name)


def _check_bool(value, name):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _validate(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, dq, dk, dv):
    qv, kv, vv = arrays.view(q, "q"), arrays.view(k, "k"), arrays.view(v, "v")
    api._check_operands(qv, kv, vv)
    dov, ov = arrays.view(dout, "dout"), arrays.view(out, "out")
    _check_like(dov, qv, "dout", "q")
    _check_like(ov, qv, "out", "q")
    lv = arrays.view(lse, "lse")
    b, sq, h, d = qv.shape
    if tuple(lv.shape) != (b, h, sq):
        raise ValueError(f"lse must have shape (batch, nheads, seqlen_q) = {(b, h, sq)}, got {api._shape_str(lv)}")
    if lv.dtype != "float32":
        raise TypeError(f"lse must be float32 (as attention(..., return_lse=True) returns it), got {lv.dtype}")
    api._check_same_place(("q", qv), ("lse", lv))
    grads = []
    for name, x, like, like_name in (("dq", dq, qv, "q"), ("dk", dk, kv, "k"), ("dv", dv, vv, "v")):
        if x is None:
            grads.append(None)
            continue
        g = arrays.view(x, name)
        _check_grad_out(g, like, name, like_name, x)
        grads.append(g)
    scale = api._check_scale(softmax_scale, d)
    api._check_causal(causal)
    _check_bool(deterministic, "deterministic")
    return qv, kv, vv, dov, ov, lv, grads, scale


# ---------------------------------------------------------------------------------------------
# Entry point

def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None,
                       deterministic=False, dq=None, dk=None, dv=None):
    """Gradients (dq, dk, dv) of ``out = cuflash.attention(q, k, v, causal=..., softmax_scale=...)``
    for the output gradient ``dout``.

    q, out, dout: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim),
    float16 or bfloat16, last dim contiguous, any other strides; lse: float32 (batch, nheads,
    seqlen_q) from ``attention(..., return_lse=True)``. Same masking rules as the forward
    (causal aligned bottom-right; a query row that sees no key gets zero gradient). With
    ``deterministic=True`` no atomics are used and repeated calls give bitwise equal gradients.
    ``dq``, ``dk``, ``dv``: optional arrays to write the gradients into. Returns the caller's
    array type (NumPy inputs are computed on the current GPU and come back as NumPy).
    """
    qv, kv, vv, dov, ov, lv, grads, scale = _validate(dout, q, k, v, out, lse, causal, softmax_scale,
                                                       deterministic, dq, dk, dv)
    causal, deterministic = bool(causal), bool(deterministic)
    if qv.device < 0:  # NumPy in, NumPy out: compute on the current GPU
        dev = api._current_device()
        on = lambda x: arrays.to_device(np.asarray(x.array), dev)
        res = attention_backward(on(dov), on(qv), on(kv), on(vv), on(ov), on(lv), causal=causal,
                                 softmax_scale=scale, deterministic=deterministic)
        result = []
        for r, given, like in zip(res, (dq, dk, dv), (qv, kv, vv)):
            r = arrays.hand_back(r, like)
            if given is not None:
                given[...] = r
                r = given
            result.append(r)
        return tuple(result)
    return _backward_device(dov, qv, kv, vv, ov, lv, grads, causal, scale, deterministic)


def _grad_buffer(given, like, d_pad):
    """(view the kernel writes, view to hand back): the caller's array when the kernel can
    write it in place, else a padded/aligned scratch copied into it afterwards."""
    final = given if given is not None else arrays.view(
        arrays.empty_like_framework(like, like.shape, like.dtype), "grad")
    if d_pad == like.shape[3] and api._aligned(final):
        return final, final
    scratch = arrays.view(arrays.empty_like_framework(like, (*like.shape[:3], d_pad), like.dtype), "grad")
    return scratch, final


def _backward_device(dov, qv, kv, vv, ov, lv, grads, causal, scale, deterministic):
    b, sq, h, d = qv.shape
    sk, hk = kv.shape[1], kv.shape[2]
    d_pad = -(-d // 8) * 8
    bufs = [_grad_buffer(g, like, d_pad) for g, like in zip(grads, (qv, kv, vv))]
    results = [final.array for _, final in bufs]
    if b == 0 or h == 0 or sq == 0 or sk == 0:
        # No query or no key: every gradient is zero (or empty).
        for r in results:
            if 0 not in r.shape:
                r[...] = 0
        return tuple(arrays.hand_back(r, like) for r, like in zip(results, (qv, kv, vv)))

    # Head dims that are not a multiple of 8, or unaligned operands, go through padded copies
    # (zero columns change no score and no gradient).
    ops = [x if d_pad == d and api._aligned(x) else api._padded(x, d_pad) for x in (qv, kv, vv, dov, ov)]
    bucket = head_dim_bucket(d_pad)
    dtype = _DTYPES[qv.dtype]
    dev = qv.device
    arch = api.device_facts(dev).arch
    kernels = variants(bucket, dtype, causal, deterministic, arch)

    sq_pad = cdiv(sq, ROW_PAD) * ROW_PAD
    rows = b * h * sq_pad
    n_acc = 0 if deterministic else rows * bucket
    ws = arrays.empty_like_framework(qv, (2 * rows + n_acc,), "float32")
    ws_ptr = arrays.device_ptr(ws)
    lse2_ptr, dsum_ptr = ws_ptr, ws_ptr + 4 * rows
    acc_ptr = ws_ptr + 8 * rows if not deterministic else 0

    (dq_k, _), (dk_k, _), (dv_k, _) = bufs
    with arrays.on_device(dev):
        _launch(kernels, ops, lv, (dq_k, dk_k, dv_k), (lse2_ptr, dsum_ptr, acc_ptr),
                (b, sq, sk, h, hk, d_pad, sq_pad), scale, arrays.stream_for(qv), dev)
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


def _launch(kernels, ops, lse, grads, ws, shape, scale, stream, device):
    q, k, v, do, o = ops
    dq, dk, dv = grads
    lse2, dsum, acc = ws
    b, sq, sk, h, hk, d, sq_pad = shape
    i32, f32 = np.int32, np.float32
    prep, main, last = kernels
    rows = b * h * sq_pad
    ls = lse.strides
    _kernel(prep, device)((cdiv(rows, PREP_ROWS_PER_BLOCK),), (prep.threads,),
                          (do.ptr, o.ptr, lse.ptr, lse2, dsum, acc, *_st(do), *_st(o), ls[0], ls[1], ls[2],
                           i32(rows), i32(sq), i32(h), i32(d), i32(sq_pad)), stream=stream)
    shape_args = (i32(sq), i32(sk), i32(h), i32(h // hk), i32(d), i32(sq_pad),
                  f32(scale * _LOG2E), f32(scale))
    common = (*_st(q), *_st(k), *_st(v), *_st(do))
    _kernel(main, device)((cdiv(sk, main.block_n), hk, b), (main.threads,),
                          (q.ptr, k.ptr, v.ptr, do.ptr, lse2, dsum, acc, dk.ptr, dv.ptr,
                           *common, *_st(dk), *_st(dv), *shape_args),
                          shared_mem=smem_bytes(main), stream=stream)
    if last.kind == "bwd_dq":
        _kernel(last, device)((cdiv(sq, last.block_m), h, b), (last.threads,),
                              (q.ptr, k.ptr, v.ptr, do.ptr, lse2, dsum, dq.ptr, *common, *_st(dq), *shape_args),
                              shared_mem=smem_bytes(last), stream=stream)
    else:
        chunks = b * sq * h * (d // 8)
        _kernel(last, device)((cdiv(chunks, CONVERT_THREADS),), (CONVERT_THREADS,),
                              (acc, dq.ptr, *_st(dq), chunks, i32(sq), i32(h), i32(d), i32(sq_pad), f32(scale)),
                              stream=stream)
