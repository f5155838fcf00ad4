"""Plan + buffers -> kernel launches on the caller's stream. No synchronisation, no host copies."""
from __future__ import annotations

import math
import os
from typing import NamedTuple

import numpy as np

from . import arrays, compiler
from .codegen import Variant
from .plan import Plan, cdiv

NO_CACHE = (0, 0, 0, 0)  # seqlens_k, kv_batch_idx, block_table pointers; block-table row stride
# Split-KV merges its partials in the split kernel (the last split of each query block, counted
# in a zeroed int per block that the kernel leaves zeroed); CUFLASH_FUSED_COMBINE=0 runs the
# separate combine kernel instead.
FUSED_COMBINE = os.environ.get("CUFLASH_FUSED_COMBINE", "1") != "0"
# Forward kernels on sm_90 launch with programmatic stream serialisation: a grid may start while
# the stream's previous kernel finishes (the kernel waits for it with griddepcontrol.wait before
# touching memory, and lets the next grid start once its K/V loop is done), which hides the launch
# gap between back-to-back kernels. CUFLASH_EARLY_LAUNCH=0 launches them plainly.
EARLY_LAUNCH = os.environ.get("CUFLASH_EARLY_LAUNCH", "1") != "0"
_counters: dict = {}  # (device, stream pointer) -> zeroed int32 CuPy array
_retired: list = []   # outgrown per-stream buffers, kept alive: kernels queued earlier may use them

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


def _capturing(stream: int) -> bool:
    import cupy
    try:
        return bool(cupy.cuda.runtime.streamIsCapturing(stream))
    except Exception:  # no capture query: treat as not capturing
        return False


def _per_stream(table: dict, device: int, stream: int, need: int, make):
    """A cached device buffer of at least ``need`` elements for kernels on ``stream`` (kernels
    on one stream run in order, so one buffer per stream is enough), made by ``make(size)``
    on ``device``; None inside a CUDA graph capture, where nothing is cached."""
    buf = table.get((device, stream))
    if buf is not None and buf.size >= need:
        return buf
    if _capturing(stream):
        return None
    import cupy
    if buf is not None:
        _retired.append(buf)
        need = max(need, 2 * buf.size)  # grow geometrically: few buffers are ever retired
    # Allocated (and zeroed) in stream order: CuPy's pool hands out blocks per stream.
    with cupy.cuda.Device(device), cupy.cuda.Stream.from_external(_RawStream(stream)):
        buf = table[(device, stream)] = make(need)
    return buf


class _RawStream:
    """A raw stream pointer speaking the CUDA stream protocol (``Stream.from_external``)."""
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def _new_counters(n: int):
    import cupy
    return cupy.zeros(max(n, 1 << 14), dtype=cupy.int32)


def _new_workspace(n: int):
    import cupy
    return cupy.empty(max(n, 1 << 16), dtype=cupy.float32)


def _counter_ptr(device: int, stream: int, need: int) -> int:
    """A zeroed int32 buffer of at least ``need`` counters for split kernels on ``stream`` (each
    kernel leaves its counters zeroed), or 0 when none can be made now (inside a CUDA graph
    capture): the combine kernel then runs."""
    buf = _per_stream(_counters, device, stream, need, _new_counters)
    return 0 if buf is None else buf.data.ptr


WORKSPACE_CACHE_BYTES = 32 << 20  # split workspaces up to this size are kept per stream
_workspaces: dict = {}  # (device, stream pointer) -> fp32 CuPy array


def workspace(r: "Recipe", device: int, stream: int, new_array):
    """((partial O pointer, partial LSE pointer), buffer) of a split launch's fp32 workspace, or
    (None, None) when the launch does not split: a buffer kept per stream when small (decode),
    else ``new_array(n_floats)`` from the caller's allocator for this call (also inside a graph
    capture), which the caller holds until the launch is queued."""
    if not r.split:
        return None, None
    buf = None
    if 4 * r.ws_floats <= WORKSPACE_CACHE_BYTES:
        buf = _per_stream(_workspaces, device, stream, r.ws_floats, _new_workspace)
    if buf is None:
        buf = new_array(r.ws_floats)
    ptr = arrays.device_ptr(buf)
    return (ptr, ptr + 4 * r.ws_lse), buf


class Recipe(NamedTuple):
    """A plan's launches with every argument but the data pointers worked out: what a repeated
    call with the same shapes, strides and options reuses (see ``fire``)."""
    plan: Plan
    kernel: object             # compiler.Kernel of the main launch
    params: object             # its struct.Struct
    grid: tuple
    block: tuple
    smem: int
    mid: tuple                 # arguments between the five leading pointers and the trailing three
    split: bool                # partial outputs in a workspace, merged by LSE
    combine: tuple             # the combine kernel's arguments after its four pointers (split plans)
    n_counters: int            # merge counters (one per query block)
    ws_floats: int             # workspace size: partial outputs, then partial LSEs
    ws_lse: int                # where the partial LSEs start
    early: bool                # launch with programmatic stream serialisation (see EARLY_LAUNCH)


def prepare(plan: Plan, q, k, v, o, softmax_scale: float, device: int, cache=NO_CACHE,
            seqlen_k: int | None = None, page_size: int = 0, softcap: float = 0.0, alibi=(0, 0),
            varlen=None) -> Recipe:
    """The launch arguments of ``plan`` for views q, k, v, o (their strides; pointers are given
    to ``fire``). For a KV cache, ``cache`` holds the (seqlens_k, kv_batch_idx, block_table)
    pointers and the block table's row stride, and ``seqlen_k`` is added to each seqlens_k entry
    (or is the key count without one). ``alibi`` is (slopes pointer, batch stride of the slopes);
    ``varlen`` is (cu_seqlens_q pointer, cu_seqlens_k pointer, total_q) for packed sequences,
    whose views then have token strides as batch strides."""
    p = plan.problem
    ngroups = p.nheads // p.nheads_k
    seqlens_ptr, batch_idx_ptr, table_ptr, table_stride = cache
    cu_q, cu_k, total_q = varlen if varlen is not None else (0, 0, -1)
    shape, table_args, combine, tail, mods, alibi_args = _scalars(
        plan, p.seqlen_k if seqlen_k is None else seqlen_k, softmax_scale, table_stride, page_size,
        softcap, alibi[1], total_q)
    kv = (seqlens_ptr, batch_idx_ptr, table_ptr, *table_args, cu_q, cu_k, *tail, *mods, alibi[0], *alibi_args)
    os_ = _strides(o, plan.pack_gqa, ngroups)
    mid = (*_strides(q, plan.pack_gqa, ngroups), *_strides(k, False, 1), *_strides(v, False, 1), *os_, *shape, *kv)
    main = plan.launches[0]
    kernel = compiler.get_kernel(main.variant, device)
    params = kernel.params((0, 0, 0, 0, 0, *mid, 0, 0, 0))
    split = not (plan.num_splits == 1 and main.variant.kind == "fwd")
    rows = p.batch * plan.nheads_eff * plan.seqlen_q_eff
    n_o = plan.num_splits * rows * main.variant.head_dim if split else 0
    early = EARLY_LAUNCH and main.variant.arch >= 90
    alone = early and math.prod(main.grid) <= plan.device.num_sms  # one wave: keep a block per SM
    smem = max(main.smem, compiler.exclusive_smem(main.variant)) if alone else main.smem
    return Recipe(plan, kernel, params, (*main.grid, 1, 1)[:3], (main.threads, 1, 1), smem, mid,
                  split, (*os_, *combine, cu_q, *tail), main.grid[0] * main.grid[1] * p.batch,
                  n_o + plan.num_splits * rows if split else 0, n_o, early)


def fire(r: Recipe, device: int, stream: int, q: int, k: int, v: int, o: int, lse: int, workspace=None):
    """Launch a prepared plan on ``stream`` (a raw pointer) for these data pointers;
    ``workspace`` is the (partial O, partial LSE) pointer pair when the plan splits."""
    if not r.split:
        r.kernel.launch(r.params, r.grid, r.block, r.smem, stream, (q, k, v, o, lse, *r.mid, 0, 0, 0), r.early)
        return
    o_acc, lse_acc = workspace
    counters = _counter_ptr(device, stream, r.n_counters) if FUSED_COMBINE else 0
    r.kernel.launch(r.params, r.grid, r.block, r.smem, stream,
                    (q, k, v, o_acc, lse_acc, *r.mid, o, lse, counters), r.early)
    if counters:
        return
    comb = r.plan.launches[1]
    compiler.get_kernel(comb.variant, device)(comb.grid, (comb.threads,), (o_acc, lse_acc, o, lse, *r.combine),
                                              stream=stream)


def run(plan: Plan, q, k, v, o, lse_ptr: int, workspace, softmax_scale: float, stream: int, device: int,
        **extra):
    """Launch ``plan`` for views q, k, v, o on ``stream`` (a raw pointer); ``workspace`` is the
    pointer pair from ``workspace()`` when the plan splits, else None; ``extra`` as in prepare."""
    fire(prepare(plan, q, k, v, o, softmax_scale, device, **extra), device, stream,
         q.ptr, k.ptr, v.ptr, o.ptr, lse_ptr, workspace)


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
