"""User arguments -> validated Problem -> Plan -> launch, with flash-attn's semantics.

Everything up to the launch is checked before any kernel runs, so bad input raises a
ValueError/TypeError naming the argument and leaves ``out`` untouched.
"""
from __future__ import annotations

import functools
import numbers
import sys
from typing import NamedTuple

import numpy as np

from . import arrays, fp8, launch
from . import validate
from .plan import DeviceFacts, Problem, cached_on_plans, empty_plan, make_backward_plan, make_plan, with_flashmask

# validate.aligned and validate.batched are used by the launch paths here and in backward.py
_aligned, _batched = validate.aligned, validate.batched


# ---------------------------------------------------------------------------------------------
# Device facts

@functools.lru_cache(maxsize=None)
def device_facts(device: int) -> DeviceFacts:
    import cupy
    d = cupy.cuda.Device(device)
    return DeviceFacts(d.attributes["MultiProcessorCount"], int(d.compute_capability))


# ---------------------------------------------------------------------------------------------
# Entry point

def attention(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, out=None,
              num_splits=0, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, startend_row_indices=None,
              sinks=None, dropout_p=0.0, seed=None, offset=0, q_descale=None, k_descale=None, v_descale=None,
              attention_chunk=0):
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
    ``attention_chunk=c > 0`` (FlashAttention-3's, Llama 4's chunked attention): query i sees
    only the keys of its chunk, positions c * floor((i + sk - sq) / c) to that + c - 1, within
    the causal mask or window; not with startend_row_indices. (No backward kernel takes it:
    cuflash.torch differentiates a chunked call as packed sequences, one per chunk.)
    ``startend_row_indices``: a FlashMask mask (cuflash.masks), int32 (batch, 1 or nheads_k or
    nheads, seqlen_k, n) in q's framework and on its device (NumPy with NumPy q); not with a
    window, ALiBi, sinks or num_splits > 1.
    ``sinks``: attention sinks (gpt-oss, flash-attn's ``s_aux``), one logit per query head,
    (nheads,) float32, bfloat16 or float16 on q's device: each row's softmax gets one more
    column, exp(sink), with no value (compared with the scaled, softcapped, biased scores, in
    natural-log units), so out_i = sum_j exp(s_ij) v_j / (exp(sink) + sum_j exp(s_ij)) and the
    LSE includes it; a row that sees no key gives 0 and LSE = sink.
    ``dropout_p``: attention dropout (flash-attn's): a float in [0, 1); elements of the softmax's
    probabilities are dropped and the kept ones scaled by 1 / (1 - dropout_p). The mask is a pure
    function of ``seed`` and ``offset`` (ints in [0, 2**64); seed is required when dropout_p > 0)
    and of (batch, head, row, key): cuflash.reference.dropout_keep_mask regenerates it, and
    cuflash.backward.attention_backward with the same seed and offset differentiates the same
    mask. A call uses the counters of offsets offset ... offset + batch * nheads - 1, so the next
    independent call should pass offset + reference.dropout_offset_increment(batch, nheads) (or a
    new seed). Not with a KV cache, num_splits > 1, sinks or startend_row_indices.

    FP8 (FlashAttention-3's FP8 forward, sm_90 only): q, k, v float8_e4m3fn PyTorch CUDA tensors
    (CuPy has no 8-bit float dtype), head dim 64, 128 or 256, full or causal, GQA, ``return_lse``; the scores
    are (q . k) * q_descale * k_descale * softmax_scale and the output (P V) * v_descale, the
    descales float32 (batch, nheads_k) arrays (a dim of 1 broadcasts; None: 1). The output is
    bfloat16 (``out`` too); P is rounded to e4m3 for its product. Forward only; the other
    options raise NotImplementedError. Each call also writes a transposed copy of V (one pass
    over V, scratch of V's size).
    """
    if q_descale is not None or k_descale is not None or v_descale is not None or fp8.is_e4m3(q):
        _no_fp8_chunk(attention_chunk)
        return _attention_fp8(q, k, v, causal, softmax_scale, return_lse, out, num_splits, window_size, softcap,
                              alibi_slopes, startend_row_indices, sinks, dropout_p,
                              (q_descale, k_descale, v_descale))
    sig = None if sinks is not None or not arrays.no_dropout(dropout_p, seed) else _signature(
        q, k, v, out, causal, softmax_scale, return_lse, num_splits, window_size, softcap, alibi_slopes,
        startend_row_indices, offset, attention_chunk)
    if sig is not None:
        repeat = arrays.repeat_lookup(_repeats, sig)
        if repeat is not None:
            res = repeat(q, k, v, out, fm=startend_row_indices)
            if res is not None:
                return res
    qv, kv, vv = validate.view(q, "q"), validate.view(k, "k"), validate.view(v, "v")
    if qv.dtype.startswith("float8"):
        _no_fp8_chunk(attention_chunk)
        return _attention_fp8(q, k, v, causal, softmax_scale, return_lse, out, num_splits, window_size, softcap,
                              alibi_slopes, startend_row_indices, sinks, dropout_p,
                              (q_descale, k_descale, v_descale), (qv, kv, vv))
    validate.operands(qv, kv, vv)
    ov = None
    if out is not None:
        ov = validate.view(out, "out")
        validate.out(ov, qv, out)
        validate.out_apart(ov, ("q", qv), ("k", kv), ("v", vv))
    scale = validate.scale(softmax_scale, qv.shape[3])
    num_splits = validate.num_splits(num_splits)
    causal = validate.boolean(causal, "causal")
    return_lse = validate.boolean(return_lse, "return_lse")
    mods = validate.mods(window_size, softcap, alibi_slopes, qv.shape[0], qv.shape[2], qv, scale)
    sv = validate.sinks(sinks, qv.shape[2], qv)
    drop = validate.dropout(dropout_p, seed, offset, num_splits, sv, startend_row_indices)
    chunk = validate.attention_chunk(attention_chunk)
    validate.chunk_alone(chunk, startend_row_indices=startend_row_indices is not None)
    fm = None
    if startend_row_indices is not None:
        fm = validate.flashmask(startend_row_indices, qv, kv, causal, num_splits, mods, sv is not None)

    if qv.device < 0:  # NumPy in, NumPy out: compute on the current GPU
        dev = arrays.current_device()
        dev_array = lambda x: arrays.to_device(np.asarray(x.array), dev)
        res = attention(dev_array(qv), dev_array(kv), dev_array(vv), causal=causal,
                        softmax_scale=scale, return_lse=return_lse, num_splits=num_splits,
                        window_size=mods[0], softcap=mods[1],
                        alibi_slopes=None if mods[2] is None else dev_array(mods[2]),
                        startend_row_indices=None if fm is None else dev_array(fm),
                        sinks=None if sv is None else dev_array(sv), attention_chunk=chunk,
                        **validate.dropout_kwargs(drop))
        return _host_result(res, qv, out, return_lse)

    return _attention_device(qv, kv, vv, ov, causal, scale, return_lse, num_splits, mods, sig, fm, sv, drop, chunk)


def _no_fp8_chunk(attention_chunk):
    if validate.attention_chunk(attention_chunk):
        from . import fp8
        fp8._unsupported(attention_chunk=(attention_chunk, 0))


def _attention_fp8(q, k, v, causal, softmax_scale, return_lse, out, num_splits, window_size, softcap, alibi_slopes,
                   startend_row_indices, sinks, dropout_p, descales, views=None):
    """attention's FP8 path (cuflash/fp8.py); descales with fp16/bf16 inputs are a TypeError."""
    qv = views[0] if views else None if fp8.is_e4m3(q) else validate.view(q, "q")
    if qv is not None and not qv.dtype.startswith("float8"):
        raise TypeError(f"q_descale, k_descale and v_descale apply to float8_e4m3fn q, k, v; q is {qv.dtype}")
    return fp8.attention_fp8(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse, out=out,
                             num_splits=num_splits, window_size=window_size, softcap=softcap,
                             alibi_slopes=alibi_slopes, startend_row_indices=startend_row_indices, sinks=sinks,
                             dropout_p=dropout_p, q_descale=descales[0], k_descale=descales[1],
                             v_descale=descales[2], views=views)


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


def _sink_arg(sv):
    """What launch.prepare takes for attention sinks: (pointer, dtype name), or None."""
    return None if sv is None else (sv.ptr, sv.dtype)


def _attention_device(qv, kv, vv, ov, causal, scale, return_lse, num_splits, mods, sig=None, fm=None, sv=None,
                      drop=None, chunk=0):
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
               window, cap > 0, alibi is not None, sv is not None)
    recipe = _launch(problem, qv, *qk, kernel_out, lse_arr, scale, softcap=cap,
                     alibi=(alibi.ptr, alibi_sb) if alibi is not None else (0, 0), fm=fm, sinks=_sink_arg(sv),
                     dropout=drop, chunk=chunk)
    if not direct_out:
        o_view.array[...] = kernel_out.array[..., :d]
    elif sig is not None and all(in_place) and drop is None:  # read in place: the next such call can skip to here
        arrays.repeat_keep(_repeats, sig, _Repeat(
            recipe, qv.device, (b, h, sq) if return_lse else None, qv.strides == arrays.contiguous_strides(qv.shape),
            fm_ints=0 if fm is None else max(recipe.plan.workspace_bytes // 4, 1)))
    return _result(o_view, ov is not None, lse_arr, qv, return_lse)


# ---------------------------------------------------------------------------------------------
# Repeated calls from PyTorch: a call whose shapes, strides, dtypes, devices and options were
# checked, planned and launched before reuses that launch's arguments, so it only reads the
# data pointers, allocates the output and launches.

_repeats: dict = cached_on_plans({})  # signature (see _signature) -> _Repeat


def _signature(q, k, v, out, causal, softmax_scale, return_lse, num_splits, window_size, softcap,
               alibi_slopes, startend_row_indices=None, offset=0, attention_chunk=0):
    """Everything the checks, the plan and the launch arguments of an ``attention`` call on
    PyTorch CUDA tensors depend on, except the data pointers (arrays.repeat_signature); None for
    other calls (ALiBi included). Calls with one signature pass the same checks and launch the
    same kernels with the same arguments. (``offset``, the dropout's, is checked and unused
    without dropout.)"""
    if alibi_slopes is not None:
        return None
    return arrays.repeat_signature((q, k, v, out, startend_row_indices), window_size,
                                   (causal, softmax_scale, return_lse, num_splits, softcap, offset, attention_chunk))


class _Repeat(NamedTuple):
    recipe: launch.Recipe
    device: int
    lse_shape: tuple | None  # (batch, nheads, seqlen_q), or (nheads, total_q) packed, when the LSE is returned
    q_contiguous: bool       # q is C-contiguous: torch.empty_like(q) is then the contiguous output
    # Packed sequences: a one-item list holding (cu_seqlens_q pointer, cu_seqlens_k pointer, the
    # recipe with them); a call with other cu_seqlens arrays makes the recipe with theirs and keeps
    # it for the calls after it (the tuple is replaced whole: threads sharing the entry each read
    # a consistent one).
    packed: list | None = None
    fm_ints: int = 0  # FlashMask: the int32 words of its per-key-block bounds (allocated per call)

    def __call__(self, q, k, v, out, cu_q=None, cu_k=None, fm=None):
        """The call's result, or None when its pointers need the general path (alignment)."""
        torch = sys.modules["torch"]
        ops = arrays.repeat_operands(q, k, v, out,
                                     lambda: torch.empty_like(q) if self.q_contiguous else q.new_empty(q.shape))
        if ops is None:
            return None
        qp, kp, vp, op, out = ops
        lse = None if self.lse_shape is None else q.new_empty(self.lse_shape, dtype=torch.float32)
        dev, recipe = self.device, self.recipe
        if self.packed is not None:
            cq, ck = cu_q.data_ptr(), cu_k.data_ptr()
            held = self.packed[0]
            if held[0] != cq or held[1] != ck:
                held = self.packed[0] = (cq, ck, launch.with_pointers(recipe, cu_seqlens_q=cq, cu_seqlens_k=ck))
            recipe = held[2]
        fm_ws = None  # FlashMask's bounds, held until the launches are queued
        if self.fm_ints:
            fm_ws = q.new_empty((self.fm_ints,), dtype=torch.int32)
            recipe = launch.with_flashmask(recipe, fm.data_ptr(), fm_ws.data_ptr())
        stream = arrays.torch_stream(dev)
        workspace, held = launch.workspace(  # a per-call workspace is held until its kernels are queued
            recipe, dev, stream, lambda n: q.new_empty((n,), dtype=torch.float32))
        args = (recipe, dev, stream, qp, kp, vp, op, 0 if lse is None else lse.data_ptr(), workspace)
        if arrays.current_device_id() == dev:
            launch.fire(*args)
        else:
            with arrays.on_device(dev):
                launch.fire(*args)
        return (out, lse) if lse is not None else out


_plans: dict = cached_on_plans({})


def _plan_for(fields: tuple, device: int, kv: str = "dense", varlen: bool = False, flashmask=(0, 0),
              leftpad: bool = False, dropout: bool = False, page_size: int = 0, chunk: int = 0):
    """The plan of a call, cached on the call's fields (so a repeated shape builds no Problem);
    ``flashmask`` is (bound columns, heads) of startend_row_indices, or (0, 0); ``leftpad``: a
    KV cache with cache_leftpad; ``dropout``: attention dropout; ``page_size``: a paged
    cache's rows per page; ``chunk``: attention_chunk."""
    key = (fields, device, kv, varlen, flashmask, leftpad, dropout, page_size, chunk)
    plan = _plans.get(key)
    if plan is None:
        (b, sq, sk, h, hk, d, dtype, causal, return_lse, num_splits, window, softcap, alibi, sinks) = fields
        problem = Problem(b, sq, sk, h, hk, d, dtype, causal, return_lse, num_splits, kv=kv,
                          window=window, softcap=softcap, alibi=alibi, varlen=varlen, flashmask=flashmask[0],
                          flashmask_heads=flashmask[1], sinks=sinks, leftpad=leftpad, dropout=dropout,
                          page_size=page_size, chunk=chunk)
        if len(_plans) > 4096:
            _plans.clear()
        plan = _plans[key] = make_plan(problem, device_facts(device))
    return plan


def _launch(problem, like, q, k, v, o, lse_arr, scale, kv="dense", varlen_kv=False, fm=None, leftpad_kv=False,
            chunk=0, plan=None, **extra):
    """Plan ``problem`` (the tuple of Problem's first fields, see _plan_for) and launch it on
    ``like``'s stream; ``extra`` goes to launch.prepare (cache, softcap, ALiBi and varlen
    arguments); ``fm`` is the view of FlashMask's startend_row_indices or None. Returns the
    prepared launch (its Recipe). ``plan``: the plan of these arguments where the caller made it
    already (_launch_plan)."""
    plan = plan or _launch_plan(problem, like, kv, varlen_kv, fm, leftpad_kv, chunk, extra)
    dev = like.device
    stream = arrays.stream_for(like)
    lse_ptr = arrays.device_ptr(lse_arr) if lse_arr is not None else 0
    fm_ws = None  # the prep kernel's per-key-block bounds, held until the launches are queued
    if fm is not None:
        fm_ws = arrays.empty_like_framework(like, (max(plan.workspace_bytes // 4, 1),), "int32")
        extra["flashmask"] = (fm.ptr, fm.strides, fm.shape[1], arrays.device_ptr(fm_ws))
    with arrays.on_device(dev):
        recipe = launch.prepare(plan, q, k, v, o, scale, dev, **extra)
        workspace, held = launch.workspace(  # a per-call workspace is held until its kernels are queued
            recipe, dev, stream, lambda n: arrays.empty_like_framework(like, (n,), "float32"))
        launch.fire(recipe, dev, stream, q.ptr, k.ptr, v.ptr, o.ptr, lse_ptr, workspace)
    return recipe


def _launch_plan(problem, like, kv="dense", varlen_kv=False, fm=None, leftpad_kv=False, chunk=0, extra=None):
    """The plan _launch runs for these arguments (cached: a later _launch finds it)."""
    extra = extra or {}
    return _plan_for(problem, like.device, kv, varlen_kv, (fm.shape[3], fm.shape[1]) if fm is not None else (0, 0),
                     leftpad_kv, extra.get("dropout") is not None, extra.get("page_size", 0) if kv == "paged" else 0,
                     chunk)


# ---------------------------------------------------------------------------------------------
# KV cache

def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, rotary_cos=None, rotary_sin=None,
                           cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                           causal=False, softmax_scale=None, num_splits=0, return_lse=False, out=None,
                           window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None,
                           sinks=None, attention_chunk=0, rotary_seqlens=None, cu_seqlens_k_new=None):
    """Decode/append attention over a KV cache, with flash-attn's ``flash_attn_with_kvcache``
    semantics.

    q: (batch, seqlen_q, nheads, d). k_cache, v_cache: (batch_cache, capacity, nheads_k, d), or
    paged (num_pages, page_size, nheads_k, d) with ``block_table`` int32 (batch, pages_per_seq),
    pages of any number of rows. New k, v (batch, seqlen_new, nheads_k, d) are written into
    the caches in place at positions cache_seqlens[b] ..., then each sequence attends to its
    cache_seqlens[b] + seqlen_new keys (causal: aligned bottom-right per sequence).
    ``cache_seqlens``: an int, an int32 device array (batch,), a host integer array (batch,)
    (NumPy or a CPU tensor: checked on the host, then copied to the device), or None for full
    caches. ``cache_batch_idx``: int32 (batch,) rows of a contiguous cache to use.
    ``cache_leftpad``: int32 (batch,) device array: sequence b's cache starts at row
    cache_leftpad[b] (rows before it are ignored; cache_seqlens[b] still counts from row 0, so it
    attends to cache_seqlens[b] + seqlen_new - cache_leftpad[b] keys); in a paged cache, rows of
    the sequence as the block table lays it out (FlashAttention-3's).
    ``rotary_cos``, ``rotary_sin`` (seqlen_ro, rotary_dim / 2) in q's dtype, seqlen_ro >= the
    capacity: with new k, its first rotary_dim columns are rotated at positions cache_seqlens[b] + i
    before they are written, and q's at the same positions when causal or local, else all at
    cache_seqlens[b] (the caller's q is not modified: a rotated copy is attended);
    ``rotary_interleaved``: pairs (0, 1), (2, 3) ... (GPT-J) when True, (i, i + rotary_dim / 2)
    (GPT-NeoX) when False. ``rotary_seqlens`` (FlashAttention-3's): int32 (batch,) device array,
    the rotary positions then start at rotary_seqlens[b] instead of cache_seqlens[b] (the rows
    are still written at cache_seqlens[b] ...); not read without rotary tables.
    ``cu_seqlens_k_new`` (FlashAttention-3's): int32 (batch + 1,) device array; new k, v are then
    packed (total_new, nheads_k, d), sequence b's rows cu_seqlens_k_new[b] ... appended at
    cache_seqlens[b] ..., and it attends to cache_seqlens[b] + its own new rows (counted on the
    device, no sync). Any head dim from 1 to 256, contiguous or paged. Device arrays are the
    caller's contract, as in flash-attn (lengths must fit the cache and pages must exist); the
    kernels never read past a block table nor write past a cache's capacity whatever they say.
    ``window_size``, ``softcap``, ``alibi_slopes``, ``sinks`` and ``attention_chunk`` are those of
    :func:`attention`, aligned per sequence.
    """
    qv = validate.view(q, "q")
    kc, vc = validate.view(k_cache, "k_cache"), validate.view(v_cache, "v_cache")
    validate.operands(qv, kc, vc, same_batch=False, names=("q", "k_cache", "v_cache"))
    if qv.device < 0:
        raise TypeError("attention_with_kvcache needs device arrays: the caches are updated in place")
    b, sq, h, d = qv.shape
    _, cap, hk, _ = kc.shape
    # A head dim that is not a multiple of 8 reads and writes the caches element by element in
    # place (their rows are not 16-byte aligned); q and out then go through padded copies.
    d_pad = -(-d // 8) * 8
    unaligned = d_pad != d
    for name, x in (("q", qv), ("k_cache", kc), ("v_cache", vc)):
        if not unaligned and not _aligned(x):
            raise ValueError(f"{name} must be 16-byte aligned with strides in multiples of 8 elements, "
                             f"got strides {tuple(x.strides)}")
    scale = validate.scale(softmax_scale, d)
    causal = validate.boolean(causal, "causal")
    return_lse = validate.boolean(return_lse, "return_lse")
    num_splits = validate.num_splits(num_splits)
    window, softcap, alibi, alibi_sb = validate.mods(window_size, softcap, alibi_slopes, b, h, qv, scale)
    sv = validate.sinks(sinks, h, qv)
    chunk = validate.attention_chunk(attention_chunk)

    paged = block_table is not None
    if paged:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table (a paged cache)")
        bt = validate.block_table(block_table, b, qv)
        if cap == 0:
            raise ValueError(f"page size (k_cache.shape[1]) must be positive, got {cap}")
        page_size, capacity, table = cap, bt.shape[1] * cap, (bt.ptr, bt.strides[0])
        validate.sizes(("pages_per_seq * page_size (the cache's capacity)", capacity))
        where = f" (block_table's pages_per_seq * page_size = {bt.shape[1]} * {cap})"
    else:
        page_size, capacity, table, where = 0, cap, (0, 0), ""
        if cache_batch_idx is None and kc.shape[0] != b:
            raise ValueError(f"k_cache must have q's batch size {b} (or pass cache_batch_idx), "
                             f"got shape {validate.shape_str(kc)}")
    batch_idx = (validate.int32_vector(cache_batch_idx, "cache_batch_idx", b, qv).ptr
                 if cache_batch_idx is not None else 0)
    leftpad = validate.int32_vector(cache_leftpad, "cache_leftpad", b, qv) if cache_leftpad is not None else None

    s_new, kn, vn = 0, None, None
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    cu_new = None
    if cu_seqlens_k_new is not None:
        if k is None:
            raise ValueError("cu_seqlens_k_new needs new k and v (packed (total_new, nheads_k, d)) to append")
        cu_new = validate.int32_vector(cu_seqlens_k_new, "cu_seqlens_k_new", b + 1, qv, "(batch + 1,)")
    if k is not None:
        kn, vn = validate.view(k, "k"), validate.view(v, "v")
        packed = cu_new is not None
        rows = (kn.shape[0] if len(kn.shape) == 3 else -1) if packed else (kn.shape[1] if len(kn.shape) == 4 else -1)
        want, dims = ((rows, hk, d), "(total_new, nheads_k, d)") if packed else ((b, rows, hk, d),
                                                                              "(batch, seqlen_new, nheads_k, d)")
        for name, x in (("k", kn), ("v", vn)):
            if tuple(x.shape) != want or x.dtype != qv.dtype:
                raise ValueError(f"{name} must be {qv.dtype} of shape {dims} = {want}, got {x.dtype} "
                                 f"{validate.shape_str(x)}")
            if (not unaligned and not _aligned(x)) or (d > 1 and x.strides[-1] != 1):
                raise ValueError(f"{name} must be contiguous in its last dim and 16-byte aligned, "
                                 f"got strides {tuple(x.strides)}")
            validate.same_place(("q", qv), (name, x))
        validate.sizes(("k.shape[0] (total_new)" if packed else "k.shape[1] (seqlen_new)", rows))
        s_new = 0 if packed else rows
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is required when appending k and v")
    rotary = _rotary(rotary_cos, rotary_sin, rotary_interleaved, k is not None, qv, d, capacity)
    ro_seqlens = (validate.int32_vector(rotary_seqlens, "rotary_seqlens", b, qv).ptr
                  if rotary_seqlens is not None else 0)

    seqlen0 = 0
    if cache_seqlens is None:
        seqlens_ptr, seqlen_k_arg = 0, capacity
    elif isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, (bool, np.bool_)):
        _fits(np.asarray([int(cache_seqlens)]), s_new, capacity, where, scalar=True)
        seqlen0 = int(cache_seqlens)
        seqlens_ptr, seqlen_k_arg = 0, seqlen0 + s_new
    elif (host := validate.host_ints(cache_seqlens, "cache_seqlens", device_ok=True)) is not None:
        if host.dtype.kind not in "iu":
            raise TypeError(f"cache_seqlens must be int32, got {host.dtype}")
        if host.shape != (b,):
            raise ValueError(f"cache_seqlens must have shape (batch,) = ({b},), got {tuple(host.shape)}")
        _fits(host, s_new, capacity, where)
        seqlens_ptr, seqlen_k_arg = None, s_new  # uploaded below, once nothing else can fail
    else:
        seqlens_ptr, seqlen_k_arg = validate.int32_vector(cache_seqlens, "cache_seqlens", b, qv).ptr, s_new

    ov = None
    if out is not None:
        ov = validate.view(out, "out")
        validate.out(ov, qv, out)
        if not unaligned and not _aligned(ov):
            raise ValueError("out must be 16-byte aligned with strides in multiples of 8 elements")
        validate.out_apart(ov, ("q", qv), ("k_cache", kc), ("v_cache", vc), ("k", kn), ("v", vn))
    o_view, lse_arr = _outputs(qv, ov, return_lse)
    if b and h:
        held = None  # an uploaded cache_seqlens, kept alive until the kernels are queued
        if seqlens_ptr is None:
            held = _upload_int32(host, qv)
            seqlens_ptr = arrays.device_ptr(held)
        # The query the kernel reads: q itself, a zero-padded copy (head dims not a multiple of 8),
        # or the rotated copy that the append kernel writes (already padded).
        q_in = qv
        if rotary is not None:
            q_in = arrays.view(arrays.empty_like_framework(qv, (b, sq, h, d_pad), qv.dtype), "q_rot")
        elif unaligned and sq:
            q_in = _padded(qv, d_pad)
        packed_rows = None
        if cu_new is not None:  # the append counts each sequence's keys (seqlens_out) for the attention
            held_lens = arrays.empty_like_framework(qv, (b,), "int32")
            packed_rows = (b, cu_new.ptr, arrays.device_ptr(held_lens))
        problem = (b, sq, capacity, h, hk, d, arrays.DTYPE_NAMES[qv.dtype], causal,
                   return_lse, num_splits, window, softcap > 0, alibi is not None, sv is not None)
        kv_kind = "paged" if paged else "cache"
        # planned before the append, so that a refused plan (e.g. its grid) writes no cache row
        plan = _launch_plan(problem, qv, kv_kind, leftpad_kv=leftpad is not None, chunk=chunk,
                            extra=dict(page_size=page_size)) if sq else None
        if s_new or packed_rows or (rotary is not None and sq):
            rowwise = _rotary_rowwise(causal, window, sq, alibi is not None, capacity) or chunk > 0
            with arrays.on_device(qv.device):
                launch.append_kv(kn, vn, kc, vc, seqlens_ptr, seqlen0, batch_idx, table, page_size, capacity,
                                 arrays.stream_for(qv), qv.device, device_facts(qv.device).arch,
                                 rotary=None if rotary is None else (*rotary, qv, q_in, rowwise),
                                 ro_seqlens_ptr=ro_seqlens, packed=packed_rows)
        if packed_rows:
            seqlens_ptr, seqlen_k_arg = packed_rows[2], 0
        if sq:
            direct_out = not unaligned
            kernel_out = o_view if direct_out else arrays.view(
                arrays.empty_like_framework(qv, (b, sq, h, d_pad), qv.dtype), "out")
            _launch(problem, qv, q_in, kc, vc, kernel_out, lse_arr, scale, kv=kv_kind, plan=plan,
                    leftpad_kv=leftpad is not None,
                    cache=(seqlens_ptr, batch_idx, *table), seqlen_k=seqlen_k_arg, page_size=page_size,
                    softcap=softcap, alibi=(alibi.ptr, alibi_sb) if alibi is not None else (0, 0),
                    sinks=_sink_arg(sv), pages_per_seq=bt.shape[1] if paged else 0,
                    leftpad=leftpad.ptr if leftpad is not None else 0, chunk=chunk)
            if not direct_out:
                o_view.array[...] = kernel_out.array[..., :d]
        del held
    return _result(o_view, ov is not None, lse_arr, qv, return_lse)


def _fits(seqlens, s_new, capacity, where, scalar=False):
    """Host-known cache lengths: each >= 0 and, with the seqlen_new appended keys, within the
    cache's capacity (a paged cache's: what its block table can address)."""
    low = int(seqlens.min()) if seqlens.size else 0
    if low < 0:
        raise ValueError(f"cache_seqlens must be >= 0, got {low}")
    high = int(seqlens.max()) if seqlens.size else 0
    if high + s_new > capacity:
        raise ValueError(f"cache_seqlens + seqlen_new must fit the cache: {'' if scalar else 'max '}{high} + {s_new} "
                         f"> capacity {capacity}{where}")


def _upload_int32(values, like):
    """A host integer array as an int32 device array of ``like``'s framework, copied on its
    stream without waiting for the GPU (a pinned staging buffer for PyTorch, which its caching
    host allocator keeps until the copy is done; CuPy stages pageable memory itself)."""
    a = np.ascontiguousarray(values, dtype=np.int32)
    if like.framework == "torch":
        import torch
        return torch.from_numpy(a).pin_memory().to(f"cuda:{like.device}", non_blocking=True)
    import cupy
    with cupy.cuda.Device(like.device):
        buf = cupy.empty(a.shape, dtype=cupy.int32)
        buf.set(a, stream=cupy.cuda.ExternalStream(arrays.stream_for(like)))
    return buf


def _rotary(cos, sin, interleaved, appending, qv, d, capacity):
    """Checked rotary tables: None, or (cos view, sin view, interleaved)."""
    if cos is None and sin is None:
        return None
    if (cos is None) != (sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    interleaved = validate.boolean(interleaved, "rotary_interleaved")
    if not appending:
        raise ValueError("rotary_cos and rotary_sin need new k and v to append (as in flash-attn, the rotation "
                         "is applied to the appended keys and to q)")
    cv, sv = validate.view(cos, "rotary_cos"), validate.view(sin, "rotary_sin")
    for name, x in (("rotary_cos", cv), ("rotary_sin", sv)):
        if x.dtype != qv.dtype:
            raise TypeError(f"{name} must have q's dtype {qv.dtype}, got {x.dtype}")
        if len(x.shape) != 2 or x.shape[1] < 1 or 2 * x.shape[1] > d or x.shape[0] < capacity:
            raise ValueError(f"{name} must have shape (seqlen_ro, rotary_dim / 2) with rotary_dim <= head dim {d} "
                             f"and seqlen_ro >= the cache's capacity {capacity}, got {validate.shape_str(x)}")
        if x.shape[1] > 1 and x.strides[1] != 1 or x.strides[0] != x.shape[1]:
            raise ValueError(f"{name} must be contiguous, got strides {tuple(x.strides)}")
        validate.same_place(("q", qv), (name, x))
    if tuple(sv.shape) != tuple(cv.shape):
        raise ValueError(f"rotary_sin must have rotary_cos's shape {validate.shape_str(cv)}, got "
                         f"{validate.shape_str(sv)}")
    validate.sizes(("rotary_cos.shape[0] (seqlen_ro)", cv.shape[0]))
    return cv, sv, interleaved


def _rotary_rowwise(causal, window, seqlen_q, alibi, capacity) -> bool:
    """flash-attn's rule for q's rotary positions (mha_fwd_kvcache): query row i sits at
    cache_seqlens[b] + i when the kernel is causal or local, else every row at cache_seqlens[b].
    It drops causal for one query row without ALiBi, sets a causal window's right edge to 0, and
    drops window edges of the cache's capacity or more; what is left is causal or local iff an
    edge is >= 0."""
    left, right = window
    if causal and not (seqlen_q == 1 and not alibi):
        right = 0
    left = -1 if left >= capacity else left
    right = -1 if right >= capacity else right
    return left >= 0 or right >= 0


# ---------------------------------------------------------------------------------------------
# Variable-length (packed) batches

def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                     alibi_slopes=None, return_lse=False, num_splits=0, block_table=None, out=None,
                     sinks=None, dropout_p=0.0, seed=None, offset=0, attention_chunk=0):
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
    :func:`attention`; ALiBi slopes may be (nheads,) or (batch, nheads). Dropout: sequence b is
    batch b of the mask, rows and keys counted from the sequence's first (not with block_table).
    """
    sig = None
    if (block_table is None and alibi_slopes is None and sinks is None and arrays.no_dropout(dropout_p, seed)
            and max_seqlen_q.__class__ is int and max_seqlen_k.__class__ is int):
        sig = arrays.repeat_signature((q, k, v, out, cu_seqlens_q, cu_seqlens_k), window_size,
                                      ("varlen", max_seqlen_q, max_seqlen_k, causal, softmax_scale, return_lse,
                                       num_splits, softcap, offset, attention_chunk))
        repeat = arrays.repeat_lookup(_repeats, sig)
        if repeat is not None:
            res = repeat(q, k, v, out, cu_seqlens_q, cu_seqlens_k)
            if res is not None:
                return res
    qv, kv, vv, cq, ck, bt, batch, max_sq, max_sk = validate.varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table)
    paged = bt is not None
    total_q, h, d = qv.shape
    ov = None
    if out is not None:
        ov = validate.view(out, "out")
        validate.out(ov, qv, out)
        validate.out_apart(ov, ("q", qv), ("k", kv), ("v", vv))
    scale = validate.scale(softmax_scale, d)
    causal = validate.boolean(causal, "causal")
    return_lse = validate.boolean(return_lse, "return_lse")
    num_splits = validate.num_splits(num_splits)
    window, cap, alibi, alibi_sb = validate.mods(window_size, softcap, alibi_slopes, batch, h, qv, scale)
    sv = validate.sinks(sinks, h, qv)
    drop = validate.dropout(dropout_p, seed, offset, num_splits, sv, None)
    chunk = validate.attention_chunk(attention_chunk)
    if drop is not None and paged:
        raise ValueError("dropout_p > 0 cannot be combined with block_table (a paged KV cache): dropout is for "
                         "training, where flash-attn has no KV cache")

    if qv.device < 0:  # NumPy in, NumPy out: compute on the current GPU
        dev = arrays.current_device()
        dev_array = lambda x: None if x is None else arrays.to_device(np.asarray(x.array), dev)
        res = attention_varlen(dev_array(qv), dev_array(kv), dev_array(vv), dev_array(cq), dev_array(ck),
                               max_sq, max_sk, causal=causal, softmax_scale=scale, window_size=window,
                               softcap=cap, alibi_slopes=dev_array(alibi), return_lse=return_lse,
                               num_splits=num_splits, block_table=dev_array(bt) if paged else None,
                               sinks=dev_array(sv), attention_chunk=chunk, **validate.dropout_kwargs(drop))
        return _host_result(res, qv, out, return_lse)

    o_view, lse_arr = _outputs(qv, ov, return_lse)
    if batch == 0 or total_q == 0 or h == 0 or max_sq == 0:
        if lse_arr is not None:
            lse_arr[...] = np.inf
        return _result(o_view, ov is not None, lse_arr, qv, return_lse)
    q4 = _batched(qv, batch, max_sq)
    k4, v4 = (x if paged else _batched(x, batch, max_sk) for x in (kv, vv))
    d_pad = -(-d // 8) * 8
    if not paged:
        q4, k4, v4 = (x if d_pad == d and _aligned(x) else _batched(_padded(y, d_pad), batch, n)
                      for x, y, n in ((q4, qv, max_sq), (k4, kv, max_sk), (v4, vv, max_sk)))
    elif d_pad != d:  # the pages are read element by element in place; q goes through a padded copy
        q4 = _batched(_padded(qv, d_pad), batch, max_sq)
    o4 = _batched(o_view, batch, max_sq)
    direct_out = d_pad == d and _aligned(o4)
    kernel_out = o4 if direct_out else _batched(arrays.view(
        arrays.empty_like_framework(qv, (total_q, h, d_pad), qv.dtype), "out"), batch, max_sq)
    problem = (batch, max_sq, max_sk, h, kv.shape[-2], d if paged else d_pad, arrays.DTYPE_NAMES[qv.dtype],
               causal, return_lse, num_splits, window, cap > 0, alibi is not None, sv is not None)
    extra = dict(cache=(0, 0, bt.ptr, bt.strides[0]), page_size=kv.shape[1], pages_per_seq=bt.shape[1]) if paged else {}
    in_place = all(x.ptr == y.ptr for x, y in ((q4, qv), (k4, kv), (v4, vv)))
    recipe = _launch(problem, qv, q4, k4, v4, kernel_out, lse_arr, scale, kv="paged" if paged else "dense",
                     varlen_kv=True, softcap=cap, alibi=(alibi.ptr, alibi_sb) if alibi is not None else (0, 0),
                     varlen=(cq.ptr, ck.ptr, total_q, kv.shape[0]), sinks=_sink_arg(sv), dropout=drop, chunk=chunk,
                     **extra)
    if not direct_out:
        o_view.array[...] = kernel_out.array[..., :d]
    elif sig is not None and in_place:  # read in place: the next such call can skip to here
        arrays.repeat_keep(_repeats, sig, _Repeat(
            recipe, qv.device, (h, total_q) if return_lse else None, qv.strides == arrays.contiguous_strides(qv.shape),
            [(cq.ptr, ck.ptr, recipe)]))
    return _result(o_view, ov is not None, lse_arr, qv, return_lse)


# ---------------------------------------------------------------------------------------------
# Planning without running

def _plan_operands(q, k, v, dtype):
    """Views of plan's q, k, v: all arrays, or all shape tuples (of ``dtype``)."""
    tuples = [isinstance(x, (tuple, list)) for x in (q, k, v)]
    if any(tuples) and not all(tuples):
        raise TypeError("q, k and v must be all arrays or all shape tuples, got "
                        + ", ".join(f"{n}: {type(x).__name__}" for n, x in zip("qkv", (q, k, v))))
    if tuples[0]:
        return (validate.Shape(x, dtype, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    return (validate.view(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))


FP8_NAMES = ("float8_e4m3fn",)


def _plan_fp8(q, k, v, causal, softmax_scale, return_lse, num_splits, num_sms, arch, window_size, softcap,
              alibi_slopes, backward, startend_row_indices, sinks, dropout_p, varlen, kv_cache):
    """plan's answer for float8_e4m3fn operands (arrays, or shapes with dtype="float8_e4m3fn")."""
    from . import fp8
    shapes = []
    for name, x in (("q", q), ("k", k), ("v", v)):
        shape = tuple(x) if isinstance(x, (tuple, list)) else tuple(validate.view(x, name).shape)
        if len(shape) != 4 or not all(validate._is_int(n) and n >= 0 for n in shape):
            raise ValueError(f"{name} must be a 4-dim (batch, seqlen, nheads, headdim) shape, got {shape}")
        shapes.append(shape)
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, (tuple, list)) and not str(getattr(x, "dtype", "")).endswith(FP8_NAMES):
            raise TypeError(f"{name} must be float8_e4m3fn like q, got {getattr(x, 'dtype', type(x).__name__)}")
    (b, sq, h, d), (_, sk, hk, _) = shapes[0], shapes[1]
    if shapes[2] != shapes[1] or shapes[1][0] != b or shapes[1][3] != d or hk == 0 or h % hk:
        raise ValueError(f"q {shapes[0]}, k {shapes[1]}, v {shapes[2]}: k and v alike, q's batch and head dim, "
                         "nheads a multiple of nheads_k")
    validate.scale(softmax_scale, d)
    fp8._unsupported(window_size=(tuple(window_size) if isinstance(window_size, (tuple, list)) else window_size,
                                  (-1, -1)), softcap=(softcap, 0.0), alibi_slopes=(alibi_slopes, None),
                     startend_row_indices=(startend_row_indices, None), sinks=(sinks, None), dropout_p=(dropout_p, 0.0),
                     backward=(backward, False), varlen=(varlen, False), kv_cache=(kv_cache, None))
    if validate.num_splits(num_splits) > 1:
        raise NotImplementedError(f"num_splits > 1 is not supported with float8_e4m3fn inputs, got {num_splits}")
    arch = None if arch is None else validate.arch(arch)
    if num_sms is None:
        dev = device_facts(arrays.current_device())
        facts = DeviceFacts(dev.num_sms, arch or dev.arch)
    else:
        facts = DeviceFacts(validate.num_sms(num_sms), arch or 90)
    return fp8.make_plan(b, sq, sk, h, hk, d, validate.boolean(causal, "causal"),
                         validate.boolean(return_lse, "return_lse"), facts)


def plan(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, num_splits=0,
         heuristic="cuflash", num_sms=None, arch=None, dtype="bfloat16", window_size=(-1, -1),
         softcap=0.0, alibi_slopes=None, backward=False, deterministic=False, startend_row_indices=None,
         sinks=None, dropout_p=0.0, varlen=False, kv_cache=None, page_size=None, cache_leftpad=False,
         attention_chunk=0):
    """The plan ``attention(q, k, v, ...)`` would run: kernels, tiles, grids, splits and why; with
    ``backward=True``, the plan of its backward (``attention_backward(..., deterministic=...)``).

    q, k, v may be arrays (any framework, NumPy included) or shape tuples (then ``dtype`` gives
    the element type). ``num_sms``/``arch`` describe the target GPU (``arch``: 80, "sm_80", 90,
    "sm_90", "sm_90a", ...; 8.0 or newer); without them the current GPU is asked. Works on
    machines with no GPU when ``num_sms`` is given. A call with nothing to compute (batch,
    seqlen_q or nheads 0) gives a plan that launches nothing. ``heuristic``:
    "cuflash" (default; decode splits tuned for cuflash's kernels) or "fa2" (FlashAttention-2's
    ``num_splits_heuristic``, to see what FA2 would do). ``window_size``, ``softcap``,
    ``alibi_slopes``, ``sinks`` (each of the last two an array, a shape tuple, or True) and
    ``attention_chunk`` are those of :func:`attention`; a plan with sinks takes the kernels and tiles of the call
    without them and says how the sink joins the softmax. ``dropout_p`` > 0: the plan of a
    call with dropout (the standard kernel, never split; no fwd_ws or bwd_ws, the reason says why).

    ``startend_row_indices`` (FlashMask, cuflash.masks: an int32 array or a shape tuple) is
    checked; the plan is the FlashMask one (forward: the prep kernel and the standard kernel with
    the mask; backward: the prep kernel, once per key-block size, and the backward's kernels with
    the mask) and the reason gains a sentence on the tiles the kernel that walks K/V (the
    backward's: the dK/dV kernel) skips, masks and leaves unmasked (counted from the values when
    they are a NumPy array; a shape or a device array gives the tile count only).

    Packed sequences and KV caches: with ``varlen=True`` the plan is that of
    :func:`attention_varlen` for sequences of at most q's and k's seqlen (q, k, v then read as
    (batch, max_seqlen, heads, d)); ``kv_cache="contiguous"`` that of
    :func:`attention_with_kvcache` over a cache of k's seqlen rows (its batch may differ from
    q's: cache_batch_idx), with ``cache_leftpad=True`` when it has one; ``kv_cache="paged"`` with a
    block table of ``page_size``-row pages, k's seqlen then being the keys a sequence can hold
    (pages_per_seq * page_size; with ``varlen=True``, max_seqlen_k).

    float8_e4m3fn operands (arrays, or shapes with ``dtype="float8_e4m3fn"``) give the plan of
    attention's FP8 forward (sm_90 only; its other options raise NotImplementedError, as there).
    """
    if (isinstance(dtype, str) and dtype in FP8_NAMES
            or not isinstance(q, (tuple, list)) and str(getattr(q, "dtype", "")).endswith(FP8_NAMES)):
        _no_fp8_chunk(attention_chunk)
        return _plan_fp8(q, k, v, causal, softmax_scale, return_lse, num_splits, num_sms, arch, window_size, softcap,
                         alibi_slopes, backward, startend_row_indices, sinks, dropout_p, varlen, kv_cache)
    dtype = validate.dtype_name(dtype)
    varlen, kv_source, page_size, leftpad = validate.plan_source(varlen, kv_cache, page_size, cache_leftpad,
                                                                 validate.boolean(backward, "backward"))
    qv, kv, vv = _plan_operands(q, k, v, dtype)
    validate.operands(qv, kv, vv, same_batch=kv_source != "cache")
    scale = validate.scale(softmax_scale, qv.shape[3])
    causal = validate.boolean(causal, "causal")
    return_lse = validate.boolean(return_lse, "return_lse")
    num_splits = validate.num_splits(num_splits)
    heuristic = validate.heuristic(heuristic)
    backward = validate.boolean(backward, "backward")
    deterministic = validate.boolean(deterministic, "deterministic")
    b, sq, h, d = qv.shape
    if alibi_slopes is True or isinstance(alibi_slopes, (tuple, list)):
        alibi_slopes = validate.Shape((h,) if alibi_slopes is True else alibi_slopes, "float32", "alibi_slopes")
    mods = validate.mods(window_size, softcap, alibi_slopes, b, h, qv, scale)
    window, cap, alibi, _ = mods
    if sinks is True or isinstance(sinks, (tuple, list)):
        sinks = validate.Shape((h,) if sinks is True else sinks, "float32", "sinks")
    sv = validate.sinks(sinks, h, qv)
    dropout = validate.dropout_p(dropout_p) > 0
    chunk = validate.attention_chunk(attention_chunk)
    validate.chunk_alone(chunk, startend_row_indices=startend_row_indices is not None)
    fm = None
    if startend_row_indices is not None:
        fm = startend_row_indices
        if isinstance(fm, (tuple, list)):
            fm = validate.Shape(fm, "int32", "startend_row_indices")
        fm = validate.flashmask(fm, qv, kv, causal, 0 if backward else num_splits, mods, sv is not None)
    arch = None if arch is None else validate.arch(arch)
    if num_sms is None:
        dev = device_facts(qv.device if qv.device >= 0 else arrays.current_device())
        facts = DeviceFacts(dev.num_sms, arch or dev.arch)
    else:
        facts = DeviceFacts(validate.num_sms(num_sms), arch or 90)
    # (the kernels read a cache's rows at its own head dim; other operands go through copies padded to 8)
    problem = Problem(b, sq, kv.shape[1], h, kv.shape[2], d if kv_source != "dense" else -(-d // 8) * 8,
                      arrays.DTYPE_NAMES[qv.dtype], causal, return_lse, num_splits,
                      heuristic, window=window, softcap=cap > 0, alibi=alibi is not None,
                      deterministic=deterministic, sinks=sv is not None, dropout=dropout,
                      flashmask=fm.shape[3] if fm is not None else 0,
                      flashmask_heads=fm.shape[1] if fm is not None else 0, varlen=varlen, kv=kv_source,
                      page_size=page_size, leftpad=leftpad, chunk=chunk)
    result = empty_plan(problem, facts) or (make_backward_plan if backward else make_plan)(problem, facts)
    if fm is not None:
        result = with_flashmask(result, fm.shape, fm.array if fm.framework == "numpy" else None)
    return result
