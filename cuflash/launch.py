"""Plan + buffers -> kernel launches on the caller's stream. No synchronisation, no host copies."""
from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import NamedTuple

from . import arrays, compiler, validate
from .kernels import fwd, fwd_ws
from .kernels.append import AppendVariant
from .kernels.params import stride_values
from .plan import Plan, make_plan

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
_counters: dict = {}  # (device, stream pointer) -> zeroed int32 CuPy array (_per_stream)
_retired: list = []   # outgrown per-stream buffers, kept alive: kernels queued earlier may use them

_LOG2E = math.log2(math.e)


def _strides(view, pack: bool, ngroups: int):
    """(batch, row, head) strides in elements; with GQA packing a KV head's query heads are rows."""
    sb, ss, sh = view.strides[0], view.strides[1], view.strides[2]
    return (sb, sh, sh * ngroups) if pack else (sb, ss, sh)


def _scalars(plan: Plan, seqlen_k: int, softmax_scale: float, table_stride: int, page_size: int,
             softcap: float, alibi_sb: int, total_q: int) -> tuple[dict, dict]:
    """The scalar fields of a plan's launches (built once per plan and call shape), by name: the
    forward kernel's (sizes, the cache's, the varlen/mask/score-modifier group) and the combine
    kernel's."""
    key = (seqlen_k, softmax_scale, table_stride, page_size, softcap, alibi_sb, total_q)
    hit = plan.memo.get(key)
    if hit is not None:
        return hit
    p = plan.problem
    # With a softcap the softmax scales tanh(s * scale / softcap) by softcap.
    post = softcap if softcap > 0 else softmax_scale
    rows = p.batch * plan.nheads_eff * plan.seqlen_q_eff
    # Row i of (sequence b, head h) of the LSE: standard (batch, nheads, seqlen_q); varlen
    # (nheads, total_q), where a packed GQA group's rows are heads.
    per_token = plan.seqlen_q_eff if plan.pack_gqa else 1
    if total_q < 0:
        lse_strides = (plan.nheads_eff * plan.seqlen_q_eff, plan.seqlen_q_eff, 1)
    else:
        lse_strides = (1, per_token * total_q, total_q) if plan.pack_gqa else (1, total_q, 1)
    lse = dict(lse_sb=lse_strides[0], lse_sh=lse_strides[1], lse_sr=lse_strides[2], q_rows_per_token=per_token)
    left, right = plan.window_eff
    fwd = dict(seqlen_q_arg=plan.seqlen_q_eff, seqlen_k_arg=seqlen_k, nheads=plan.nheads_eff,
               ngroups=plan.ngroups_eff, head_dim=p.head_dim, scale_log2=post * _LOG2E,
               num_splits=plan.num_splits, n_blocks_per_split=plan.n_blocks_per_split,
               block_table_stride=table_stride, page_size=page_size, window_left=left, window_right=right,
               softcap_scale=softmax_scale / softcap if softcap > 0 else 0.0, alibi_sb=alibi_sb,
               alibi_scale=1.0 / post, **lse)
    combine = dict(rows=rows, nheads=plan.nheads_eff, seqlen_q=plan.seqlen_q_eff, head_dim=p.head_dim,
                   num_splits=plan.num_splits, **lse)
    if len(plan.memo) > 64:  # many distinct scales or KV lengths: keep the memo small
        plan.memo.clear()
    hit = plan.memo[key] = (fwd, combine)
    return hit


def _capturing(stream: int) -> bool:
    import cupy
    try:
        return bool(cupy.cuda.runtime.streamIsCapturing(stream))
    except Exception:  # no capture query: treat as not capturing
        return False


_PER_THREAD = 2  # cudaStreamPerThread


def _per_stream(table: dict, device: int, stream: int, need: int, make):
    """A cached device buffer of at least ``need`` elements for kernels on ``stream`` (kernels
    on one stream run in order, so one buffer per stream is enough), made by ``make(size)``
    on ``device``; None inside a CUDA graph capture, where nothing is cached, and on the per-thread
    default stream, whose handle (2) names another stream in each thread (and a thread's id can
    be another's once it ends): the caller then allocates for the call, in stream order."""
    key = (device, stream)
    buf = table.get(key)
    if buf is not None and buf.size >= need:
        return buf
    if stream == _PER_THREAD or _capturing(stream):
        return None
    import cupy
    if buf is not None:
        _retired.append(buf)
        need = max(need, 2 * buf.size)  # grow geometrically: few buffers are ever retired
    # Allocated (and zeroed) in stream order: CuPy's pool hands out blocks per stream.
    with cupy.cuda.Device(device), cupy.cuda.Stream.from_external(_RawStream(stream)):
        buf = table[key] = make(need)
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


def zero_async(ptr: int, nbytes: int, stream: int):
    """Zero ``nbytes`` of device memory at ``ptr``, in order on ``stream`` (a raw pointer)."""
    import cupy
    cupy.cuda.runtime.memsetAsync(ptr, 0, nbytes, stream)


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
_workspaces: dict = {}  # (device, stream pointer) -> fp32 CuPy array (_per_stream)


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
    grid: tuple
    block: tuple
    smem: int
    mid: tuple                 # the struct's fields between its leading and trailing data pointers
    split: bool                # partial outputs in a workspace, merged by LSE
    combine: dict              # the combine kernel's fields but its four data pointers (split plans)
    n_counters: int            # merge counters (one per query block)
    ws_floats: int             # workspace size: partial outputs, then partial LSEs
    ws_lse: int                # where the partial LSEs start
    early: bool                # launch with programmatic stream serialisation (see EARLY_LAUNCH)
    maps: tuple | None = None  # fwd_ws: what its tensor maps need besides the pointers (see fire)
    prep: tuple | None = None  # FlashMask: (prep kernel, grid, block, its fields by name), launched first
    tiles: tuple | None = None  # persistent fwd_ws: the one-block-per-tile grid, run without a tile counter


def with_pointers(r: Recipe, **pointers) -> Recipe:
    """``r`` with the named pointer fields of its main launch (cu_seqlens_q, ...) set to other
    pointers, in its combine kernel's fields too where it has them: the launch of a repeated call
    whose shapes and strides are those of ``r``'s but whose such arrays are others. (Both kinds of
    forward struct hold five fields before ``mid``: q, k, v, o, lse or three maps, o, lse.)"""
    table = r.kernel.table
    mid = list(r.mid)
    for name, ptr in pointers.items():
        mid[table.index(name) - fwd.DATA_HEAD] = ptr
    combine = {n: pointers.get(n, x) for n, x in r.combine.items()}
    return r._replace(mid=tuple(mid), combine=combine)


def with_flashmask(r: Recipe, idx: int, ws: int) -> Recipe:
    """``r`` (a FlashMask plan's) reading startend_row_indices at ``idx`` and keeping its prep
    kernel's per-key-block bounds at ``ws`` (int32, plan.workspace_bytes)."""
    kernel, grid, block, fields = r.prep
    return with_pointers(r, fm_idx=idx, fm_blocks=ws)._replace(prep=(kernel, grid, block, dict(fields, idx=idx, out=ws)))


def prepare(plan: Plan, q, k, v, o, softmax_scale: float, device: int, cache=NO_CACHE,
            seqlen_k: int | None = None, page_size: int = 0, softcap: float = 0.0, alibi=(0, 0),
            varlen=None, flashmask=None, sinks=None, pages_per_seq: int = 0, leftpad: int = 0,
            dropout=None) -> Recipe:
    """The launch arguments of ``plan`` for views q, k, v, o (their strides; pointers are given
    to ``fire``). For a KV cache, ``cache`` holds the (seqlens_k, kv_batch_idx, block_table)
    pointers and the block table's row stride, and ``seqlen_k`` is added to each seqlens_k entry
    (or is the key count without one). ``alibi`` is (slopes pointer, batch stride of the slopes);
    ``varlen`` is (cu_seqlens_q pointer, cu_seqlens_k pointer, total_q, total_k) for packed
    sequences, whose views then have token strides as batch strides. ``flashmask`` is (startend_row_indices
    pointer, its four element strides, its head count, pointer of an int32 workspace of
    plan.workspace_bytes) for a FlashMask plan; the Recipe then holds these pointers. ``sinks`` is
    (pointer, dtype name) of the attention sinks of a plan with sinks (held by the Recipe too).
    ``pages_per_seq`` is the block table's column count (paged plans: the kernel reads no page
    index past it); ``leftpad`` the pointer of cache_leftpad (leftpad plans). ``dropout`` is
    (dropout_p, seed, offset) of a plan with dropout."""
    p = plan.problem
    if plan.launches[0].variant.kind == "fwd_ws":
        # (No tensor map can span packed sequences without a single key: the wgmma kernel runs.)
        if all(fwd_ws.tma_readable(x) for x in (q, k, v)) and (varlen is None or varlen[3] > 0):
            return _prepare_ws(plan, q, k, v, o, softmax_scale, device, flashmask, softcap, alibi, varlen, cache,
                               seqlen_k, leftpad, page_size, pages_per_seq, sinks)
        plan = make_plan(replace(p, tma=False), plan.device)  # the wgmma kernel reads any strides
    ngroups = p.nheads // p.nheads_k
    seqlens_ptr, batch_idx_ptr, table_ptr, table_stride = cache
    cu_q, cu_k, total_q = varlen[:3] if varlen is not None else (0, 0, -1)
    scalars, combine = _scalars(plan, p.seqlen_k if seqlen_k is None else seqlen_k, softmax_scale, table_stride,
                                page_size, softcap, alibi[1], total_q)
    o_strides = stride_values("o", _strides(o, plan.pack_gqa, ngroups))
    main = plan.launches[0]
    kernel = compiler.get_kernel(main.variant, device)
    values = kernel.table.values(
        q=0, k=0, v=0, o=0, lse=0, o_final=0, lse_final=0, counters=0,
        **stride_values("q", _strides(q, plan.pack_gqa, ngroups)), **stride_values("k", _strides(k, False, 1)),
        **stride_values("v", _strides(v, False, 1)), **o_strides, **scalars,
        seqlens_k=seqlens_ptr, kv_batch_idx=batch_idx_ptr, block_table=table_ptr, cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k, alibi_slopes=alibi[0], **_flashmask_fields(plan, flashmask),
        **_sink_fields(plan, sinks), **_cache_fields(main.variant, pages_per_seq, leftpad),
        **dropout_fields(main.variant, dropout), **({"attention_chunk": plan.chunk_eff} if main.variant.chunk else {}))
    split = splits(plan)
    rows = p.batch * plan.nheads_eff * plan.seqlen_q_eff
    n_o = plan.num_splits * rows * main.variant.head_dim if split else 0
    early, smem = _early_smem(plan, main)
    return Recipe(plan, kernel, (*main.grid, 1, 1)[:3], (main.threads, 1, 1), smem,
                  values[fwd.DATA_HEAD:-fwd.DATA_TAIL], split, dict(combine, **o_strides, cu_seqlens_q=cu_q),
                  merge_counters(plan), n_o + plan.num_splits * rows if split else 0, n_o, early,
                  prep=_flashmask_prep(plan, flashmask, device))


def splits(plan: Plan) -> bool:
    """Whether ``plan``'s main launch writes split-KV partials to a workspace (to be merged by its
    last split, or by the combine kernel): a split plan, or a decode tile's launch."""
    kind = plan.launches[0].variant.kind
    return kind != "fwd_ws" and not (plan.num_splits == 1 and kind == "fwd")


def merge_counters(plan: Plan) -> int:
    """The int32 counters through which a split launch of ``plan`` merges its own splits (one per
    batch, head and query block; the Recipe's n_counters), 0 where the plan does not split."""
    main = plan.launches[0]
    return main.grid[0] * main.grid[1] * plan.problem.batch if splits(plan) else 0


def _flashmask_prep(plan: Plan, flashmask, device: int):
    """The FlashMask prep launch of a FlashMask plan (kernel, grid, block, fields), else None."""
    main = plan.launches[0].variant
    if not main.flashmask:
        return None
    ptr, st, heads, ws = flashmask
    pl = plan.launches[1]
    return (compiler.get_kernel(pl.variant, device), pl.grid, (pl.threads,),
            dict(idx=ptr, idx_sb=st[0], idx_sh=st[1], idx_ss=st[2], idx_sc=st[3], out=ws,
                 seqlen_k=plan.problem.seqlen_k, block_n=main.block_n, heads=heads))


def _flashmask_fields(plan: Plan, flashmask) -> dict:
    """The FlashMask fields of the forward's struct (none for other variants)."""
    if not plan.launches[0].variant.flashmask:
        return {}
    if flashmask is None:
        raise ValueError(f"{plan.launches[0].name} needs startend_row_indices (prepare's flashmask=)")
    ptr, st, heads, ws = flashmask
    return dict(fm_idx=ptr, fm_sb=st[0], fm_sh=st[1], fm_ss=st[2], fm_sc=st[3],
                fm_hdiv=plan.problem.nheads // heads, fm_heads=heads, fm_blocks=ws)


def _cache_fields(variant, pages_per_seq: int, leftpad: int) -> dict:
    """The paged and leftpad fields of the forward's struct (none for other variants)."""
    out = {}
    if getattr(variant, "kv", "dense") == "paged":
        if pages_per_seq <= 0:
            raise ValueError(f"{variant.name} needs the block table's column count (prepare's pages_per_seq=)")
        out["pages_per_seq"] = pages_per_seq
    if getattr(variant, "leftpad", False):
        if not leftpad:
            raise ValueError(f"{variant.name} needs cache_leftpad (prepare's leftpad=)")
        out["kv_leftpad"] = leftpad
    return out


def _i64(x: int) -> int:
    """A 64-bit unsigned word as the signed long long that carries its bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


def dropout_fields(variant, dropout) -> dict:
    """The dropout fields of a forward or backward struct (none for other variants): the Philox
    seed and offset, the 16-bit keep threshold and 1 / (1 - dropout_p) (templates/common/dropout.cuh,
    cuflash.reference.dropout_keep_mask)."""
    if not getattr(variant, "dropout", False):
        return {}
    if dropout is None:
        raise ValueError(f"{variant.name} needs (dropout_p, seed, offset) (prepare's dropout=)")
    from .reference import dropout_threshold
    p, seed, offset = dropout
    return dict(dropout_seed=_i64(seed), dropout_offset=_i64(offset), dropout_keep=dropout_threshold(p),
                dropout_scale=1.0 / (1.0 - p))


def _sink_fields(plan: Plan, sinks) -> dict:
    """The attention-sink fields of the forward's struct (none for other variants): the sink of
    row i of head h as launched is at h * sinks_sh + i * sinks_sr, i.e. h (rows are queries), or
    h * G + i when a KV head's G query heads run as its rows (GQA packing)."""
    if not plan.launches[0].variant.sinks:
        return {}
    if sinks is None:
        raise ValueError(f"{plan.launches[0].name} needs the sinks (prepare's sinks=)")
    ptr, dtype = sinks
    g = plan.seqlen_q_eff if plan.pack_gqa else 1
    return dict(sinks=ptr, sinks_dtype=fwd.SINK_DTYPES[dtype], sinks_sh=g, sinks_sr=1 if plan.pack_gqa else 0)


def _prepare_ws(plan: Plan, q, k, v, o, softmax_scale: float, device: int, flashmask=None, softcap: float = 0.0,
                alibi=(0, 0), varlen=None, cache=NO_CACHE, seqlen_k: int | None = None, leftpad: int = 0,
                page_size: int = 0, pages_per_seq: int = 0, sinks=None) -> Recipe:
    """The Recipe of a fwd_ws launch: its struct's fields after o and lse, and the shapes,
    strides and boxes of its three tensor maps (encoded in ``fire``: they hold the pointers);
    the other arguments as ``prepare`` takes them. Varlen: the maps span all the tokens of the
    packed tensors, as one batch."""
    p, main = plan.problem, plan.launches[0]
    w = main.variant
    kernel = compiler.get_kernel(w, device)
    post = softcap if softcap > 0 else softmax_scale  # what the softmax multiplies the scores by
    kv_box = min(page_size, w.block_n) if w.paged else w.block_n  # small pages: one box per page
    boxes = ((q, w.block_m), (k, kv_box), (v, kv_box))
    if varlen is None:
        lse_strides = (p.nheads * p.seqlen_q, p.seqlen_q, 1)
        maps = tuple((tuple(x.shape), tuple(x.strides), box) for x, box in boxes)
        if w.gather:  # K/V through pointers (fire puts them in the last two fields), not maps
            maps = (maps[0], None, None)
    else:
        # LSE (nheads, total_q): sequence b's row i at cu_seqlens_q[b] + i. The maps: every token
        # as one batch of (total, heads, d), the views' batch strides being token strides.
        cu_q, cu_k, total_q, total_k = varlen
        lse_strides = (1, total_q, 1)
        maps = tuple(((1, n, *x.shape[2:]), (n * x.strides[1], *x.strides[1:]), box)
                     for (x, box), n in zip(boxes, (total_q, total_k, total_k)))
    mods = {}
    if w.softcap:
        mods["softcap_scale"] = softmax_scale / softcap
    if w.alibi:
        mods.update(alibi_slopes=alibi[0], alibi_sb=alibi[1], alibi_scale=1.0 / post)
    if w.varlen:
        mods.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    if w.cache:
        mods.update(seqlens_k=cache[0], kv_batch_idx=cache[1], **_cache_fields(w, 0, leftpad))
    if w.paged:
        if not (w.gather or fwd_ws.pages_fit(page_size, w.block_n)) or pages_per_seq <= 0:
            raise ValueError(f"{w.name} needs pages of a multiple or a divisor of {w.block_n} rows (a multiple of 8) "
                             f"and the block table's column count, got page_size={page_size}, "
                             f"pages_per_seq={pages_per_seq}")
        mods.update(seqlens_k=cache[0], block_table=cache[2], block_table_stride=cache[3], page_size=page_size,
                    pages_per_seq=pages_per_seq, **_cache_fields(w, 0, leftpad))
    if w.gather:
        mods.update({f"{x}_{d}": st for x, view in (("k", k), ("v", v))
                     for d, st in zip(("sp", "ss", "sh"), view.strides[:3])}, k_pages=0, v_pages=0)
    values = kernel.table.values(
        tma_q=bytes(fwd_ws.TENSOR_MAP_BYTES), tma_k=bytes(fwd_ws.TENSOR_MAP_BYTES),
        tma_v=bytes(fwd_ws.TENSOR_MAP_BYTES), o=0, lse=0, **stride_values("o", _strides(o, False, 1)),
        **dict(zip(("lse_sb", "lse_sh", "lse_sr"), lse_strides)), seqlen_q=p.seqlen_q,
        seqlen_k=p.seqlen_k if seqlen_k is None else seqlen_k,
        ngroups=p.nheads // p.nheads_k, nheads=p.nheads, batch=p.batch, scale_log2=post * _LOG2E,
        **_flashmask_fields(plan, flashmask), **_sink_fields(plan, sinks), **({"tile_counter": 0} if w.persistent else {}),
        **(dict(zip(("window_left", "window_right"), plan.window_eff)) if w.local else {}),
        **({"attention_chunk": plan.chunk_eff} if w.chunk else {}), **mods)
    early, smem = _early_smem(plan, main)
    tiles = (math.ceil(p.seqlen_q / w.block_m) * p.nheads * p.batch, 1, 1) if w.persistent else None
    return Recipe(plan, kernel, main.grid, (main.threads, 1, 1), smem, values[5:], False, {}, 0, 0, 0, early,
                  (p.dtype, *maps), _flashmask_prep(plan, flashmask, device), tiles)


NO_MAP = bytes(fwd_ws.TENSOR_MAP_BYTES)  # the K/V map fields of a kernel that gathers pages (unread)


def _early_smem(plan: Plan, main) -> tuple[bool, int]:
    """Whether the main launch starts early (EARLY_LAUNCH, sm_90), and its dynamic shared memory:
    a grid of at most one wave that starts early asks for the variant's most, so that no second
    block lands on an SM beside it."""
    early = EARLY_LAUNCH and main.variant.arch >= 90
    alone = early and math.prod(main.grid) <= plan.device.num_sms
    return early, main.variant.smem_limit if alone else main.smem


def fire(r: Recipe, device: int, stream: int, q: int, k: int, v: int, o: int, lse: int, workspace=None,
         fused: bool = True, counter: int = 0):
    """Launch a prepared plan on ``stream`` (a raw pointer) for these data pointers;
    ``workspace`` is the (partial O, partial LSE) pointer pair when the plan splits. ``fused=False``
    merges the splits with the combine kernel and runs persistent blocks as one block per tile (no
    per-stream counter buffer is made) unless ``counter`` points at zeroed int32 counters that the
    caller provides: the persistent blocks' tile counter, or a split launch's merge counters
    (``r.n_counters``; the last split of each query block then merges them)."""
    if r.prep is not None and r.prep[1][0] > 0:  # no key block: nothing to reduce
        kernel, grid, block, fields = r.prep
        kernel(grid, block, stream, **fields)
    if r.maps is not None:
        dtype, mq, mk, mv = r.maps
        grid, mid = r.grid, r.mid
        if r.tiles is not None:  # persistent: tiles from the stream's counter, or one block per tile
            counter = counter or (_counter_ptr(device, stream, 1) if fused else 0)
            grid, mid = (grid, (*mid[:-1], counter)) if counter else (r.tiles, mid)
        if mk is None:  # gathered pages: K/V pointers in the last two fields, no maps
            kv_maps, mid = (NO_MAP, NO_MAP), (*mid[:-2], k, v)
        else:
            kv_maps = (fwd_ws.tensor_map(k, *mk, dtype), fwd_ws.tensor_map(v, *mv, dtype))
        r.kernel.launch(grid, r.block, r.smem, stream, (fwd_ws.tensor_map(q, *mq, dtype), *kv_maps, o, lse, *mid),
                        r.early)
        return
    if not r.split:
        r.kernel.launch(r.grid, r.block, r.smem, stream, (q, k, v, o, lse, *r.mid, 0, 0, 0), r.early)
        return
    o_acc, lse_acc = workspace
    counters = counter or (_counter_ptr(device, stream, r.n_counters) if fused and FUSED_COMBINE else 0)
    r.kernel.launch(r.grid, r.block, r.smem, stream, (q, k, v, o_acc, lse_acc, *r.mid, o, lse, counters), r.early)
    if counters:
        return
    comb = r.plan.launches[1]
    compiler.get_kernel(comb.variant, device)(comb.grid, (comb.threads,), stream, o_acc=o_acc, lse_acc=lse_acc,
                                              o=o, lse=lse, **r.combine)


def run(plan: Plan, q, k, v, o, lse_ptr: int, workspace, softmax_scale: float, stream: int, device: int,
        **extra):
    """Launch ``plan`` for views q, k, v, o on ``stream`` (a raw pointer); ``workspace`` is the
    pointer pair from ``workspace()`` when the plan splits, else None; ``extra`` as in prepare."""
    fire(prepare(plan, q, k, v, o, softmax_scale, device, **extra), device, stream,
         q.ptr, k.ptr, v.ptr, o.ptr, lse_ptr, workspace)


def append_kv(k_new, v_new, k_cache, v_cache, seqlens_ptr: int, seqlen0: int, batch_idx_ptr: int,
              table, page_size: int, capacity: int, stream, device: int, arch: int, rotary=None,
              ro_seqlens_ptr: int = 0, packed=None):
    """Write new K/V rows into the caches at each sequence's current length (views in), dropping
    rows at or past ``capacity``. ``rotary`` is None or (cos view, sin view, interleaved, q view,
    q_rot view, q_rowwise): K is rotated before it is written, and Q into q_rot, in the same launch,
    at positions from ``ro_seqlens_ptr`` (int32 per sequence) where not 0, else the cache's.
    ``packed``: None (k_new, v_new (batch, seqlen_new, nheads_k, d)), or (batch, cu_new pointer,
    seqlens_out pointer) for packed (total_new, nheads_k, d) rows, sequence b's from cu_new[b],
    the lengths after the append written to seqlens_out."""
    if packed is None:
        b, s_new, hk, d = k_new.shape
        kn_st, vn_st, cu_new, seqlens_out = _strides(k_new, False, 1), _strides(v_new, False, 1), 0, 0
    else:
        (s_new, hk, d), (b, cu_new, seqlens_out) = k_new.shape, packed
        kn_st, vn_st = (0, *k_new.strides[:2]), (0, *v_new.strides[:2])
    vec = d % 8 == 0 and all(validate.aligned(x) for x in (k_new, v_new, k_cache, v_cache))
    rot = dict(rotary_cos=0, rotary_sin=0, rotary_dim=0, seqlen_ro=0, q=0, q_rot=0, seqlen_q=0, nheads=0,
               q_rowwise=0, ro_seqlens=0, **stride_values("q", (0, 0, 0)), **stride_values("qr", (0, 0, 0)))
    q_items = 0
    kind = ""
    if rotary is not None:
        cos, sin, interleaved, q, q_rot, rowwise = rotary
        kind = "interleaved" if interleaved else "neox"
        rot.update(rotary_cos=cos.ptr, rotary_sin=sin.ptr, rotary_dim=2 * cos.shape[1], seqlen_ro=cos.shape[0],
                   q=q.ptr, q_rot=q_rot.ptr, seqlen_q=q.shape[1], nheads=q.shape[2], q_rowwise=int(rowwise),
                   ro_seqlens=ro_seqlens_ptr,
                   **stride_values("q", _strides(q, False, 1)), **stride_values("qr", _strides(q_rot, False, 1)))
        q_items = q.shape[0] * q.shape[1] * q.shape[2] * -(-d // 8)
    variant = AppendVariant(kv="paged" if page_size else "cache", rotary=kind,
                            dtype=arrays.DTYPE_NAMES[k_new.dtype] if kind else "", arch=arch)
    items = max((1 if packed else b) * s_new * hk * -(-d // 8) + q_items, b if packed else 0)
    if items == 0:
        return
    compiler.get_kernel(variant, device)(
        variant.grid(items), (variant.threads,), stream,
        k_new=k_new.ptr, v_new=v_new.ptr, k_cache=k_cache.ptr, v_cache=v_cache.ptr,
        **stride_values("kn", kn_st), **stride_values("vn", vn_st),
        **stride_values("kc", _strides(k_cache, False, 1)), **stride_values("vc", _strides(v_cache, False, 1)),
        batch=b, seqlen_new=s_new, nheads_k=hk, head_dim=d, seqlens=seqlens_ptr, seqlen0=seqlen0,
        kv_batch_idx=batch_idx_ptr, block_table=table[0], block_table_stride=table[1], page_size=page_size,
        capacity=capacity, vec=int(vec), cu_new=cu_new, seqlens_out=seqlens_out, **rot)


