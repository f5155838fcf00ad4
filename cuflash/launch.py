"""Plan + buffers -> kernel launches on the caller's stream. No synchronisation, no host copies."""
from __future__ import annotations

import math
import os

import numpy as np

from . import compiler
from .codegen import Variant
from .plan import Plan, cdiv

NO_CACHE = (0, 0, 0, 0)  # seqlens_k, kv_batch_idx, block_table pointers; block-table row stride
# Split-KV merges its partials in the split kernel (the last split of each query block, counted
# in a zeroed int per block that the kernel leaves zeroed); CUFLASH_FUSED_COMBINE=0 runs the
# separate combine kernel instead.
FUSED_COMBINE = os.environ.get("CUFLASH_FUSED_COMBINE", "1") != "0"
_counters: dict = {}  # (device, stream pointer) -> zeroed int32 CuPy array
_retired: list = []   # outgrown counter arrays, kept alive: kernels queued earlier may use them

_LOG2E = math.log2(math.e)


def _strides(view, pack: bool, ngroups: int):
    """(batch, row, head) strides in elements; with GQA packing a KV head's query heads are rows.
    Python ints reach the kernel as 64-bit values."""
    sb, ss, sh = view.strides[0], view.strides[1], view.strides[2]
    return (sb, sh, sh * ngroups) if pack else (sb, ss, sh)


def _scalars(plan: Plan, seqlen_k: int, softmax_scale: float, table_stride: int, page_size: int,
             softcap: float, alibi_sb: int, total_q: int):
    """The scalar arguments of a plan's launches (built once per plan and call shape): the
    problem's sizes, the cache's, and the varlen/mask/score-modifier group."""
    key = (seqlen_k, softmax_scale, table_stride, page_size, softcap, alibi_sb, total_q)
    hit = plan.memo.get(key)
    if hit is not None:
        return hit
    p, i32, f32 = plan.problem, np.int32, np.float32
    # With a softcap the softmax scales tanh(s * scale / softcap) by softcap.
    post = softcap if softcap > 0 else softmax_scale
    shape = (i32(plan.seqlen_q_eff), i32(seqlen_k), i32(plan.nheads_eff), i32(plan.ngroups_eff),
             i32(p.head_dim), f32(post * _LOG2E), i32(plan.num_splits), i32(plan.n_blocks_per_split))
    rows = p.batch * plan.nheads_eff * plan.seqlen_q_eff
    # Row i of (sequence b, head h) of the LSE: standard (batch, nheads, seqlen_q); varlen
    # (nheads, total_q), where a packed GQA group's rows are heads.
    per_token = plan.seqlen_q_eff if plan.pack_gqa else 1
    if total_q < 0:
        lse_strides = (plan.nheads_eff * plan.seqlen_q_eff, plan.seqlen_q_eff, 1)
    else:
        lse_strides = (1, per_token * total_q, total_q) if plan.pack_gqa else (1, total_q, 1)
    left, right = plan.window_eff
    tail = (i32(per_token), *lse_strides)
    mods = (i32(left), i32(right), f32(softmax_scale / softcap if softcap > 0 else 0.0))
    alibi = (i32(alibi_sb), f32(1.0 / post))
    combine = (i32(rows), i32(plan.nheads_eff), i32(plan.seqlen_q_eff), i32(p.head_dim), i32(plan.num_splits))
    if len(plan.memo) > 64:  # many distinct scales or KV lengths: keep the memo small
        plan.memo.clear()
    hit = plan.memo[key] = (shape, (i32(table_stride), i32(page_size)), combine, tail, mods, alibi)
    return hit


def _counter_ptr(device: int, stream, need: int) -> int:
    """A zeroed int32 buffer of at least ``need`` counters for split kernels on ``stream`` (one
    per stream: kernels on one stream run in order, and each leaves its counters zeroed), or 0
    when none can be made now (inside a CUDA graph capture): the combine kernel then runs."""
    buf = _counters.get((device, stream.ptr))
    if buf is not None and buf.size >= need:
        return buf.data.ptr
    import cupy
    try:
        if cupy.cuda.runtime.streamIsCapturing(stream.ptr):
            return 0
    except Exception:  # no capture query: allocate as usual
        pass
    if buf is not None:
        _retired.append(buf)
    with cupy.cuda.Device(device), stream:  # zeroed in stream order, before any kernel uses it
        buf = _counters[(device, stream.ptr)] = cupy.zeros(max(need, 1 << 14), dtype=cupy.int32)
    return buf.data.ptr


def run(plan: Plan, q, k, v, o, lse_ptr: int, workspace, softmax_scale: float, stream, device: int,
        cache=NO_CACHE, seqlen_k: int | None = None, page_size: int = 0, softcap: float = 0.0,
        alibi=(0, 0), varlen=None):
    """Launch ``plan``. q, k, v, o are views (arrays.View); ``workspace`` is the pair of device
    pointers (fp32 partial O, fp32 partial LSE) when the plan splits, else None. For a KV cache,
    ``cache`` holds the (seqlens_k, kv_batch_idx, block_table) pointers and the block table's row
    stride, and ``seqlen_k`` is added to each seqlens_k entry (or is the key count without one).
    ``alibi`` is (slopes pointer, batch stride of the slopes); ``varlen`` is (cu_seqlens_q
    pointer, cu_seqlens_k pointer, total_q) for packed sequences, whose views then have token
    strides as batch strides."""
    p = plan.problem
    ngroups = p.nheads // p.nheads_k
    seqlens_ptr, batch_idx_ptr, table_ptr, table_stride = cache
    cu_q, cu_k, total_q = varlen if varlen is not None else (0, 0, -1)
    shape, table_args, combine, tail, mods, alibi_args = _scalars(
        plan, p.seqlen_k if seqlen_k is None else seqlen_k, softmax_scale, table_stride, page_size,
        softcap, alibi[1], total_q)
    kv = (seqlens_ptr, batch_idx_ptr, table_ptr, *table_args, cu_q, cu_k, *tail, *mods, alibi[0], *alibi_args)
    os_ = _strides(o, plan.pack_gqa, ngroups)
    common = (*_strides(q, plan.pack_gqa, ngroups), *_strides(k, False, 1), *_strides(v, False, 1))

    main = plan.launches[0]
    fn = compiler.get_kernel(main.variant, device)
    if plan.num_splits == 1 and main.variant.kind == "fwd":
        args = (q.ptr, k.ptr, v.ptr, o.ptr, lse_ptr, *common, *os_, *shape, *kv, 0, 0, 0)
        fn(main.grid, (main.threads,), args, shared_mem=main.smem, stream=stream)
        return
    o_acc_ptr, lse_acc_ptr = workspace
    g = main.grid
    counters = _counter_ptr(device, stream, g[0] * g[1] * p.batch) if FUSED_COMBINE else 0
    args = (q.ptr, k.ptr, v.ptr, o_acc_ptr, lse_acc_ptr, *common, *os_, *shape, *kv, o.ptr, lse_ptr, counters)
    fn(main.grid, (main.threads,), args, shared_mem=main.smem, stream=stream)
    if counters:
        return
    comb = plan.launches[1]
    args = (o_acc_ptr, lse_acc_ptr, o.ptr, lse_ptr, *os_, *combine, cu_q, *tail)
    compiler.get_kernel(comb.variant, device)(comb.grid, (comb.threads,), args, stream=stream)


def append_kv(k_new, v_new, k_cache, v_cache, seqlens_ptr: int, seqlen0: int, batch_idx_ptr: int,
              table, page_size: int, stream, device: int, arch: int):
    """Write new K/V rows into the caches at each sequence's current length (views in)."""
    b, s_new, hk, d = k_new.shape
    total = b * s_new * hk * (d // 8)
    variant = Variant("append", 0, "", arch=arch, warps=8, kv="paged" if page_size else "cache")
    i32 = np.int32
    args = (k_new.ptr, v_new.ptr, k_cache.ptr, v_cache.ptr,
            *_strides(k_new, False, 1), *_strides(v_new, False, 1),
            *_strides(k_cache, False, 1), *_strides(v_cache, False, 1),
            i32(b), i32(s_new), i32(hk), i32(d), seqlens_ptr, i32(seqlen0), batch_idx_ptr,
            table[0], i32(table[1]), i32(page_size))
    compiler.get_kernel(variant, device)((cdiv(total, 256),), (256,), args, stream=stream)
