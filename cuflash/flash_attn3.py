"""FlashAttention-3's Python API (``flash_attn_interface``, the module of the ``flash_attn_3``
wheel) on cuflash's kernels, for switching by changing an import:

    from flash_attn_interface import flash_attn_func, flash_attn_varlen_func   # before
    from cuflash.flash_attn3 import flash_attn_func, flash_attn_varlen_func    # after

The functions keep FlashAttention-3's signatures, defaults and return conventions (``out``, or
``(out, softmax_lse)`` with ``return_attn_probs=True`` / ``return_softmax_lse=True``; the LSE of a
query row that sees no key is -inf, as FlashAttention-3's, where cuflash's kernels give +inf). The dense,
packed and qkv-packed functions are differentiable (cuflash.torch.attention /
attention_varlen); ``flash_attn_with_kvcache`` is forward only, as in FlashAttention-3.

- FP8: float8_e4m3fn q, k, v with ``q_descale``/``k_descale``/``v_descale`` ((batch, nheads_k)
  float32) run cuflash's FP8 forward (sm_90; head dims 64, 128 and 256; full or causal; bf16
  out; forward only) in flash_attn_func and flash_attn_qkvpacked_func. The FP8 calls that kernel
  does not take (a window, softcap, attention_chunk, other head dims, flash_attn_varlen_func)
  attend to bfloat16 copies of q, k and v times their descales (what FlashAttention-3 computes,
  without P rounded to e4m3): float32 intermediates of four times each input's bytes, then bf16
  copies of twice, and no FP8 speed-up; forward only, as the FP8 kernel.
- A value head dim other than the query's (DeepSeek's 192 / 128; up to 512): V is padded with
  zeros to q's head dim when narrower, and cut into pieces of q's head dim when wider (one
  attention call per piece, each recomputing the scores), then the output is cut back: copies
  and extra work that FlashAttention-3's own kernels do not need.
- Performance hints with no cuflash counterpart are accepted and not used: ``pack_gqa`` (the
  plan decides), ``num_splits`` of the differentiable functions (the plan decides; it is passed
  on where cuflash takes it: flash_attn_with_kvcache) and ``scheduler_metadata`` of
  :func:`get_scheduler_metadata` (which returns None: cuflash plans each call itself).
- ``attention_chunk`` (chunked attention) runs in every function; where FlashAttention-3's
  backward ignores it, cuflash's differentiates through the chunk (cuflash.torch.attention's rule).
- ``seqused_q`` / ``seqused_k`` of flash_attn_varlen_func: each sequence cut into three packed
  sequences (the used queries over the used keys, the rest over nothing) on the device, no copy
  of q, k or v and no sync (cuflash.plan.seqused_bounds).
- ``flash_attn_with_kvcache`` with ``cu_seqlens_q`` (packed queries): a dense call on a copy of q
  padded in front to ``max_seqlen_q`` rows (q rotated by PyTorch operations, with the new keys),
  its rows gathered back; ``cu_seqlens_k_new`` (packed new keys) is cuflash.attention_with_kvcache's.
- ``flash_attn_with_kvcache`` over float8_e4m3fn caches: bfloat16 copies of q, the caches and the
  new k, v, the descales folded into q and the output, the appended rows written back to the e4m3
  caches (copies of the rows a call can read, batch x (the longest sequence) rows, on each call:
  correct, not fast).
- ``qv`` (MLA's absorbed query: scores q.k + qv.v) in flash_attn_func and flash_attn_varlen_func:
  float32 PyTorch operations holding the whole score matrix (differentiable; correct, not fast;
  cu_seqlens read on the host).
  In flash_attn_with_kvcache (MLA decode over a latent cache: v_cache may be wider than k_cache):
  the new rows written with PyTorch operations, then the same arithmetic over each sequence's
  cache rows gathered at the whole capacity; no rotary tables there.
- Hints checked and not taken: ``num_splits``, ``pack_gqa`` and ``sm_margin`` (cuflash plans its
  own splits and leaves no SMs free).
- Not supported (NotImplementedError naming the argument): ``qv`` with FP8 inputs or (in
  flash_attn_with_kvcache) rotary tables; in flash_attn_with_kvcache, a value head dim other than
  q's without ``qv``. :func:`flash_attn_combine` merges split partials with PyTorch operations (no
  kernel of its own).
- Importing this module defines FlashAttention-3's operators ``torch.ops.flash_attn_3.fwd``,
  ``bwd``, ``fwd_combine`` and ``get_scheduler_metadata`` with its schemas on these functions and
  cuflash's backward (the end of this file), where FlashAttention-3 itself is not installed; its
  private ``_flash_attn_forward`` / ``_flash_attn_backward`` (FlashAttention-3's argument names)
  call the same two operator functions.
"""
from __future__ import annotations

import numbers

import torch

import cuflash
from cuflash.flash_attn.flash_attn_interface import _seqused, _softcap, _window
from cuflash.torch import ops

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func", "flash_attn_combine",
           "flash_attn_with_kvcache", "get_scheduler_metadata"]


def _refuse(**given):
    """NotImplementedError for each argument that is set (not None, 0 or False)."""
    for name, value in given.items():
        if value is not None and not (value is False or isinstance(value, (int, float)) and value == 0):
            raise NotImplementedError(f"{name} is not supported by cuflash's FlashAttention-3 API "
                                      f"(got {name}={cuflash.validate.show(value)})")


def _hints(num_splits, pack_gqa, sm_margin=0):
    """FlashAttention-3's scheduling hints, checked and not taken: cuflash plans its own splits and
    GQA packing, and leaves no SMs free (sm_margin; None or any zero too, as before it was a hint)."""
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise TypeError(f"num_splits must be an int >= 0, got {cuflash.validate.show(num_splits)}")
    if not (sm_margin in (None, False) or isinstance(sm_margin, numbers.Integral) and not isinstance(sm_margin, bool)
            and sm_margin >= 0):
        raise TypeError(f"sm_margin must be an int >= 0, got {cuflash.validate.show(sm_margin)}")
    if pack_gqa not in (None, True, False):
        raise TypeError(f"pack_gqa must be None or a bool, got {cuflash.validate.show(pack_gqa)}")


def _kernel_writes(out, q, k, v, descales=(None,) * 3, attention_chunk=0):
    """Whether the call can run its kernel straight into ``out`` (the fwd operator's given output):
    fp16/bf16 operands without descales or a chunk, V of q's and out's head dim (one kernel, no
    value pieces), no gradient recorded for q, k, v (the operator runs without autograd), and an
    ``out`` that every kernel can write (16-byte aligned, strides in multiples of 8 elements but
    the last, 1) and that shares no memory with q, k, v or itself (a new output, copied, would)."""
    if (out is None or q.dtype not in (torch.float16, torch.bfloat16) or any(x is not None for x in descales)
            or attention_chunk != 0 or not v.shape[-1] == q.shape[-1] == out.shape[-1]
            or (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)))):
        return False
    o = cuflash.arrays.view(out, "out")
    if (not cuflash.validate.aligned(o) or (o.shape[-1] > 1 and o.strides[-1] != 1)
            or any(st == 0 and n > 1 for n, st in zip(o.shape, o.strides))):
        return False
    return not any(_overlap(out, x) for x in (q, k, v))


def _overlap(a, b):
    """Whether the byte ranges that tensors a and b span intersect (on one device)."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    span = lambda x: x.data_ptr() + x.element_size() * (1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride())))  # noqa: E731
    return a.data_ptr() < span(b) and b.data_ptr() < span(a)


def _scale(d, softmax_scale):
    """The softmax scale: softmax_scale, or d ** -0.5 for None."""
    return d ** -0.5 if softmax_scale is None else softmax_scale


def _pad_last(x, width):
    """x zero-padded in its last dim to ``width`` (8-bit floats through a uint8 view)."""
    pad = width - x.shape[-1]
    if x.dtype == torch.float8_e4m3fn:
        return torch.nn.functional.pad(x.view(torch.uint8), (0, pad)).view(torch.float8_e4m3fn)
    return torch.nn.functional.pad(x, (0, pad))


def _value_pieces(run, q, k, v, softmax_scale):
    """``run(q, k, v, scale) -> (out, lse)`` with V's head dim made q's: V padded when narrower,
    cut into pieces of q's head dim when wider (each piece's output concatenated; the LSE is the
    scores', the same for every piece)."""
    d, dv = q.shape[-1], v.shape[-1]
    scale = _scale(d, softmax_scale)
    if dv == d:
        return run(q, k, v, scale)
    if dv < d:
        out, lse = run(q, k, _pad_last(v, d), scale)
        return out[..., :dv], lse
    outs, lse = [], None
    for j in range(0, dv, d):
        piece = v[..., j:j + d]
        out, lse = run(q, k, piece if piece.shape[-1] == d else _pad_last(piece, d), scale)
        outs.append(out)
    return torch.cat(outs, dim=-1)[..., :dv], lse


def _fp8_kernel_runs(q, v, window, softcap, attention_chunk):
    """Whether cuflash's FP8 forward takes this call (else: bf16 copies, _dequantized_qkv)."""
    from cuflash.kernels.fwd_fp8 import HEAD_DIMS
    return (q.shape[-1] in HEAD_DIMS and v.shape[-1] == q.shape[-1] and tuple(window) == (-1, -1)
            and not _softcap(softcap) and not attention_chunk)


def _dequantized_qkv(q, k, v, descales, batch, seqs=(None, None)):
    """float8_e4m3fn q, k, v times their descales, as bfloat16 copies: what FlashAttention-3 attends
    to, for the calls cuflash's FP8 forward does not take. Dense (batch, seqlen, heads, d), or
    packed (total, heads, d) with ``seqs`` (each q token's and each k token's sequence); descales
    float32 (batch, nheads_k) (a dim of 1 broadcasts) or None; query head h takes its KV head's.
    Everything is checked before the first copy; the copies record no gradients."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype != torch.float8_e4m3fn:
            raise TypeError(f"q, k and v must all be float8_e4m3fn, got {name} {x.dtype}")
    hk = k.shape[-2]
    _check_descales(q, hk, v.shape[-2], descales, batch)
    outs = []
    with torch.no_grad():
        for x, scale, seq in zip((q, k, v), descales, (seqs[0], seqs[1], seqs[1])):
            y = x.to(torch.float32)
            if scale is not None:
                y *= _per_row_head(scale, x.shape[-2] // hk, seq)
            outs.append(y.to(torch.bfloat16))
    return outs


def _check_descales(q, hk, hv, descales, batch):
    """ValueError unless q's heads are a multiple of the KV heads (hk, hv) and each descale is None
    or float32 (batch, nheads_k) on q's device (a dim of 1 broadcasts)."""
    h = q.shape[-2]
    if hk == 0 or h % hk or hv != hk:
        raise ValueError(f"nheads ({h}) must be a multiple of k's and v's nheads_k ({hk}, {hv})")
    for name, x in zip(("q_descale", "k_descale", "v_descale"), descales):
        if x is not None and (not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 2
                              or x.shape[0] not in (1, batch) or x.shape[1] not in (1, hk) or x.device != q.device):
            raise ValueError(f"{name} must be float32 (batch, nheads_k) = ({batch}, {hk}) on {q.device} (a dim of 1 "
                             f"broadcasts), got {cuflash.validate.show(x)}")


def _per_row_head(scale, group, seq):
    """A (batch, nheads_k) descale as a factor of a dense (batch, seqlen, heads, d) tensor (``seq``
    None) or a packed (total, heads, d) one whose rows belong to sequences ``seq``: query head h
    takes KV head h // group's."""
    per_head = scale.repeat_interleave(group, dim=1) if scale.shape[1] > 1 else scale
    if seq is None:
        return per_head[:, None, :, None]
    return per_head[seq.clamp(max=scale.shape[0] - 1)][:, :, None]


def _sequence_of(cu_seqlens, rows):
    """Each of ``rows`` packed rows' sequence (int64 (rows,); rows past the last sequence get batch)."""
    return torch.searchsorted(cu_seqlens[1:], torch.arange(rows, dtype=cu_seqlens.dtype, device=cu_seqlens.device),
                              right=True)


def _fa3_lse(res, keys):
    """A call's result with its LSE in FlashAttention-3's convention: -inf for a query row that
    sees no key (cuflash's kernels give +inf there, flash-attn 2's convention), +inf only when the
    call has no keys at all (FlashAttention-3 fills that call's LSE with +inf). ``res``: out, or
    (out, lse); ``keys``: whether rows without a key are possible and the call has keys. Out of
    place: an autograd graph's saved LSE is not changed (the bwd operator maps -inf back)."""
    if not isinstance(res, tuple) or not keys:
        return res
    out, lse = res
    return out, torch.where(torch.isposinf(lse), float("-inf"), lse)


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                    pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False, *, _out=None):
    """FlashAttention-3's ``flash_attn_func``: q (batch, seqlen_q, nheads, d), k (batch, seqlen_k,
    nheads_k, d), v (batch, seqlen_k, nheads_k, dv). Returns out (batch, seqlen_q, nheads, dv), or
    (out, softmax_lse (batch, nheads, seqlen_q)) with ``return_attn_probs=True``. ``qv`` (batch,
    seqlen_q, nheads, dv): scores q.k + qv.v (MLA's absorbed query), in PyTorch operations.
    (``_out``: the fwd operator's output, which the kernel writes where :func:`_kernel_writes`.)"""
    _hints(num_splits, pack_gqa, sm_margin)
    window = _window(window_size)
    if qv is not None:
        _check_qv(q, k, v, qv, (q_descale, k_descale, v_descale))
        scale, chunk = _qv_options(q, softmax_scale, attention_chunk)
        out, lse = _qv_attention(q, k, v, qv, scale, causal, window, _softcap(softcap), chunk)
        return _fa3_lse((out, lse), 0 < k.shape[1] < q.shape[1]) if return_attn_probs else out
    given = (q_descale, k_descale, v_descale)
    if _kernel_writes(_out, q, k, v, given, attention_chunk):
        out, lse = ops._forward_kernel(q, k, v, _out, causal, _scale(q.shape[-1], softmax_scale), *window,
                                       _softcap(softcap), None, True)
        return _fa3_lse((out, lse), 0 < k.shape[1] < q.shape[1]) if return_attn_probs else out
    copies = q.dtype == torch.float8_e4m3fn and not _fp8_kernel_runs(q, v, window, softcap, attention_chunk)
    descales = (None,) * 3 if copies else given  # (bf16 copies carry their descales)

    def run(q, k, v, scale):
        return ops.attention(q, k, v, causal=causal, softmax_scale=scale, window_size=window, softcap=_softcap(softcap),
                             deterministic=deterministic, return_lse=True, q_descale=descales[0],
                             k_descale=descales[1], v_descale=descales[2], attention_chunk=attention_chunk)
    if copies:
        out, lse = ops.forward_only(ops.FP8_FORWARD_ONLY, lambda q, k, v, *ds: _value_pieces(run, *_dequantized_qkv(q, k, v, ds, q.shape[0]),
                                                                    softmax_scale), q, k, v, *given)
    else:
        out, lse = _value_pieces(run, q, k, v, softmax_scale)
    return _fa3_lse((out, lse), 0 < k.shape[1] < q.shape[1]) if return_attn_probs else out


def flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, q_descale=None, k_descale=None, v_descale=None,
                              window_size=(-1, -1), attention_chunk=0, softcap=0.0, deterministic=False,
                              num_heads_q=None, sm_margin=0, return_attn_probs=False):
    """FlashAttention-3's ``flash_attn_qkvpacked_func``: qkv (batch, seqlen, 3, nheads, d), or
    (batch, seqlen, nheads_q + 2 nheads_k, d) with ``num_heads_q``; split into q, k, v by views."""
    if qkv.dim() == 5:
        if qkv.shape[-3] != 3:
            raise ValueError(f"qkv must be (batch, seqlen, 3, nheads, d), got shape {tuple(qkv.shape)}")
        q, k, v = qkv.unbind(dim=-3)
    elif qkv.dim() == 4:
        if num_heads_q is None:
            raise ValueError("a 4-dim qkv (batch, seqlen, nheads_q + 2 * nheads_k, d) needs num_heads_q")
        hk = (qkv.shape[2] - num_heads_q) // 2
        if hk < 1 or 2 * hk + num_heads_q != qkv.shape[2]:
            raise ValueError(f"qkv's {qkv.shape[2]} heads are not num_heads_q ({num_heads_q}) + 2 * nheads_k")
        q, k, v = qkv.split([num_heads_q, hk, hk], dim=-2)
    else:
        raise ValueError(f"qkv must have 4 or 5 dims, got shape {tuple(qkv.shape)}")
    return flash_attn_func(q, k, v, softmax_scale, causal, None, q_descale, k_descale, v_descale, window_size,
                           attention_chunk, softcap, 1, None, deterministic, sm_margin, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                           v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False, *,
                           _out=None):
    """FlashAttention-3's ``flash_attn_varlen_func``: q (total_q, nheads, d), k (total_k, nheads_k,
    d), v (total_k, nheads_k, dv), cu_seqlens int32 (batch + 1,); or, with ``cu_seqlens_q`` /
    ``cu_seqlens_k`` None, q / k and v batched (batch, seqlen, heads, d) (with seqused). ``seqused_q``
    / ``seqused_k`` int32 (batch,): sequence b uses only the first seqused_q[b] / seqused_k[b] of
    its tokens (the other query rows get 0 and LSE -inf, the unused tokens no gradient, where
    max_seqlen_q / max_seqlen_k cover cu_seqlens' lengths). Returns out (total_q, nheads, dv), or
    (out, softmax_lse (nheads, total_q)) with ``return_attn_probs=True`` (batched q: out (batch,
    seqlen_q, nheads, dv), softmax_lse (batch, nheads, seqlen_q)). ``qv`` (total_q, nheads, dv):
    scores q.k + qv.v (MLA's absorbed query), in PyTorch operations per sequence (cu_seqlens read
    on the host: a sync). With ``cu_seqlens_q`` / ``cu_seqlens_k`` None, ``max_seqlen_q`` /
    ``max_seqlen_k`` are not read (as in FlashAttention-3). (``_out``: the fwd operator's output,
    which the kernel writes where :func:`_kernel_writes` and, for batched q, its rows are one packed
    view.)"""
    _hints(num_splits, pack_gqa, sm_margin)
    window = _window(window_size)
    batched_q = cu_seqlens_q is None
    if batched_q:
        cu_seqlens_q, q, max_seqlen_q = _batched_as_packed(q, "q")
        qv = qv.flatten(0, 1) if qv is not None and qv.dim() == 4 else qv
    if cu_seqlens_k is None:
        cu_seqlens_k, k, max_seqlen_k = _batched_as_packed(k, "k")
        v = v.flatten(0, 1) if v.dim() == 4 else v
    given_cu = (cu_seqlens_q, cu_seqlens_k)  # (the caller's sequences: the descales' and the output's batch)
    if seqused_q is not None or seqused_k is not None:
        cu_seqlens_q, cu_seqlens_k = _seqused(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)

    def run(q, k, v, scale):
        return ops.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                    softmax_scale=scale, window_size=window, softcap=_softcap(softcap),
                                    deterministic=deterministic, return_lse=True, attention_chunk=attention_chunk)
    descales = (q_descale, k_descale, v_descale)
    packed = _out if not batched_q or _out is None else _rows_view(_out)
    if (qv is None and packed is not None and _kernel_writes(packed, q, k, v, descales, attention_chunk)
            and type(max_seqlen_q) is int and type(max_seqlen_k) is int):
        out, lse = ops._varlen_forward_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, packed,
                                              causal, _scale(q.shape[-1], softmax_scale), *window, _softcap(softcap),
                                              None, None, True)
    elif qv is not None:
        _check_qv(q, k, v, qv, descales, same_batch=False)
        scale, chunk = _qv_options(q, softmax_scale, attention_chunk)
        out, lse = _qv_attention_varlen(q, k, v, qv, cu_seqlens_q, cu_seqlens_k, scale, causal, window,
                                        _softcap(softcap), chunk)
    elif q.dtype == torch.float8_e4m3fn or any(x is not None for x in descales):
        if q.dtype != torch.float8_e4m3fn:
            raise TypeError(f"q_descale, k_descale and v_descale apply to float8_e4m3fn q, k, v; q is {q.dtype}")
        def dequantized(q, k, v, *ds):  # each token's sequence, for its descale
            seqs = [_sequence_of(cu, x.shape[0]) for cu, x in zip(given_cu, (q, k))]
            return _value_pieces(run, *_dequantized_qkv(q, k, v, ds, given_cu[0].shape[0] - 1, seqs), softmax_scale)
        out, lse = ops.forward_only(ops.FP8_FORWARD_ONLY, dequantized, q, k, v, *descales)
    else:
        out, lse = _value_pieces(run, q, k, v, softmax_scale)
    if batched_q:
        b = given_cu[0].shape[0] - 1
        out = out.unflatten(0, (b, -1))
        lse = lse.unflatten(1, (b, -1)).transpose(0, 1)
    return _fa3_lse((out, lse), k.shape[0] > 0) if return_attn_probs else out


def _rows_view(out):
    """out (batch, seqlen, nheads, d) as a view of its rows (batch * seqlen, nheads, d), or None
    where its strides make that a copy."""
    b, s = out.shape[:2]
    return out.flatten(0, 1) if b == 1 or s == 1 or out.stride(0) == s * out.stride(1) else None


def _check_qv(q, k, v, qv, descales, same_batch=True):
    """The operands of a qv call: q, k, v, qv tensors of q's dtype and place; k with q's head dim
    (and, ``same_batch``, q's batch: dense calls), v with k's leading dims; qv shaped as q with v's
    head dim. FP8 has no qv (nor in FlashAttention-3)."""
    if q.dtype == torch.float8_e4m3fn or any(x is not None for x in descales):
        raise NotImplementedError("qv with float8_e4m3fn inputs (descales) is not supported (nor in FlashAttention-3)")
    for name, x in (("q", q), ("k", k), ("v", v), ("qv", qv)):
        if not isinstance(x, torch.Tensor) or x.dtype != q.dtype or x.device != q.device or x.dim() != q.dim():
            raise ValueError(f"{name} must be a {q.dim()}-dim {q.dtype} tensor on {q.device} (q's), got "
                             f"{cuflash.validate.show(x)}")
    if k.shape[-1] != q.shape[-1] or v.shape[:-1] != k.shape[:-1] or same_batch and k.shape[0] != q.shape[0]:
        raise ValueError(f"k must have q's head dim {q.shape[-1]}{' and batch' if same_batch else ''} and v k's leading "
                         f"dims, got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    want = (*q.shape[:-1], v.shape[-1])
    if tuple(qv.shape) != want:
        raise ValueError(f"qv must have shape {want} (q's, with v's head dim), got {tuple(qv.shape)}")


def _qv_options(q, softmax_scale, chunk):
    """softmax_scale (None: (d + dv) ** -0.5, chosen later) and attention_chunk, checked as cuflash
    checks them."""
    scale = None if softmax_scale is None else cuflash.validate.scale(softmax_scale, q.shape[-1])
    return scale, cuflash.validate.attention_chunk(chunk)


def _qv_attention(q, k, v, qv, scale, causal, window, softcap, chunk):
    """FlashAttention-3's qv (MLA's absorbed query) on dense (batch, seqlen, heads, ·) operands:
    softmax(scale * (q.k + qv.v)) v with flash-attn's masks (bottom-right causal band, window,
    attention_chunk) and softcap, in float32 PyTorch operations (differentiable; the score matrix
    is held whole: correct, not fast). scale defaults to (d + dv) ** -0.5. Returns (out in q's
    dtype, lse (batch, heads, seqlen_q): +inf where a row sees no key)."""
    sq, sk = q.shape[1], k.shape[1]
    one = torch.ones(1, dtype=torch.int64, device=q.device)
    seen = _seen(sq, sk, one * sk, one * 0, causal, window, chunk)
    return _qv_core(q, k, v, qv, scale, softcap, seen)


def _seen(sq, sk, lengths, leads, causal, window, chunk):
    """Which keys each query sees, (batch, 1, sq, sk): sequence b's keys leads[b] ... lengths[b] - 1
    of sk rows, its last query aligned with its last key (bottom-right), flash-attn's causal band
    or window and attention_chunk counted from leads[b] (cache_leftpad)."""
    dev = lengths.device
    col = torch.arange(sk, device=dev)[None, None]
    lengths, leads = lengths[:, None, None], leads[:, None, None]
    row = lengths - sq + torch.arange(sq, device=dev)[None, :, None]  # the key aligned with each query
    seen = (col >= leads) & (col < lengths)
    left, right = window[0], 0 if causal else window[1]
    if left >= 0:
        seen = seen & (col >= row - left)
    if right >= 0:
        seen = seen & (col <= row + right)
    if chunk:
        start = row - (row - leads) % chunk
        seen = seen & (col >= start) & (col < start + chunk)
    return seen[:, None]


def _qv_core(q, k, v, qv, scale, softcap, seen):
    """softmax(scale * (q.k + qv.v)) v over dense (batch, seqlen, heads, ·) operands where ``seen``
    (broadcast to (batch, heads, sq, sk)), in float32 PyTorch operations; (out in q's dtype, lse
    (batch, heads, sq): +inf where a row sees no key)."""
    d, h, hk = q.shape[-1], q.shape[2], k.shape[2]
    if hk == 0 or h % hk or v.shape[2] != hk:
        raise ValueError(f"nheads ({h}) must be a multiple of k's and v's nheads_k ({hk}, {v.shape[2]})")
    scale = (d + v.shape[-1]) ** -0.5 if scale is None else scale
    f = torch.float32
    kf, vf = (x.to(f).repeat_interleave(h // hk, dim=2) for x in (k, v))
    s = (torch.einsum("bqhd,bkhd->bhqk", q.to(f), kf) + torch.einsum("bqhd,bkhd->bhqk", qv.to(f), vf)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    empty = torch.isneginf(lse)
    p = torch.exp(s - torch.where(empty, 0.0, lse)[..., None])  # (a row that sees no key: all 0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vf).to(q.dtype)
    return out, torch.where(empty, float("inf"), lse)


def _qv_kvcache(q, k_cache, v_cache, k, v, qv, cache_seqlens, cache_batch_idx, cache_leftpad, page_table,
                cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, scale, causal, window, softcap, chunk, return_lse):
    """flash_attn_with_kvcache with qv (MLA's absorbed query; v_cache may be wider than k_cache, as
    MLA's latent cache): new k, v written at cache_seqlens[b] + i with PyTorch operations
    (_appended_rows: one sync), then _qv_core over each sequence's cache rows gathered at the
    cache's whole capacity (copies of every sequence's rows: correct, not fast), its keys
    cache_leftpad[b] ... cache_seqlens[b] + its new keys, queries aligned bottom-right (packed
    queries through the front-padded layout of _front_padded)."""
    packed = cu_seqlens_q is not None
    batch, dev = (cu_seqlens_q.shape[0] - 1) if packed else q.shape[0], q.device
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(x, torch.Tensor) or x.dtype != q.dtype or x.device != q.device or x.dim() != 4:
            raise ValueError(f"{name} must be a 4-dim {q.dtype} tensor on {q.device} (q's), got "
                             f"{cuflash.validate.show(x)}")
    hk, d, dv = k_cache.shape[-2], k_cache.shape[-1], v_cache.shape[-1]
    if v_cache.shape[:-1] != k_cache.shape[:-1] or q.shape[-1] != d:
        raise ValueError(f"k_cache must have q's head dim {q.shape[-1]} and v_cache k_cache's leading dims, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if not isinstance(qv, torch.Tensor) or qv.dtype != q.dtype or qv.device != q.device \
            or tuple(qv.shape) != (*q.shape[:-1], dv):
        raise ValueError(f"qv must be {q.dtype} of shape {(*q.shape[:-1], dv)} (q's, with v_cache's head dim) on "
                         f"{q.device}, got {cuflash.validate.show(qv)}")
    vectors = (("cache_leftpad", cache_leftpad, (batch,)), ("cache_batch_idx", cache_batch_idx, (batch,)),
               ("cu_seqlens_k_new", cu_seqlens_k_new, (batch + 1,)), ("page_table", page_table, (batch, None)),
               ("cache_seqlens", None if isinstance(cache_seqlens, int) else cache_seqlens, (batch,)))
    for name, x, shape in vectors:
        if x is None:
            continue
        if not isinstance(x, torch.Tensor) or x.dtype != torch.int32 or x.device != q.device:
            raise TypeError(f"{name} must be an int32 tensor on q's device {q.device}, got {cuflash.validate.show(x)}")
        if x.dim() != len(shape) or any(n is not None and n != m for n, m in zip(shape, x.shape)):
            raise ValueError(f"{name} must have shape {shape} (None: any), got {tuple(x.shape)}")
    if isinstance(cache_seqlens, bool) or isinstance(cache_seqlens, int) and cache_seqlens < 0:
        raise TypeError(f"cache_seqlens must be an int >= 0 or an int32 tensor, got {cuflash.validate.show(cache_seqlens)}")
    paged = page_table is not None
    if paged:  # (device indices are the caller's contract: clamped, never read past the pool)
        page_table = page_table.clamp(0, k_cache.shape[0] - 1)
    elif cache_batch_idx is not None:
        cache_batch_idx = cache_batch_idx.clamp(0, k_cache.shape[0] - 1)
    elif k_cache.shape[0] != batch:
        raise ValueError(f"k_cache must have q's batch size {batch} (or pass cache_batch_idx), got "
                         f"{cuflash.validate.show(k_cache)}")
    cap = page_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    new = torch.zeros(batch, dtype=torch.int64, device=dev)
    if k is not None:
        lead_dims = k.shape[:1] if cu_seqlens_k_new is not None else (batch, k.shape[1] if k.dim() == 4 else -1)
        for name, x, width in (("k", k, d), ("v", v, dv)):
            if tuple(x.shape) != (*lead_dims, hk, width) or x.dtype != q.dtype or x.device != q.device:
                raise ValueError(f"{name} must be {q.dtype} of shape {(*lead_dims, hk, width)} on {q.device}, got "
                                 f"{cuflash.validate.show(x)}")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is required when appending k and v")
        rows, at, src = _appended_rows(k_cache, k, (cache_seqlens, cache_batch_idx, page_table, cu_seqlens_k_new))
        k_cache[rows, at] = k.reshape(-1, hk, d)[src]
        v_cache[rows, at] = v.reshape(-1, hk, dv)[src]
        new += (cu_seqlens_k_new[1:] - cu_seqlens_k_new[:-1]) if cu_seqlens_k_new is not None else k.shape[1]
    if cache_seqlens is None:
        lengths = torch.full((batch,), cap, dtype=torch.int64, device=dev)
    else:
        lengths = (torch.as_tensor(cache_seqlens).to(dev, torch.int64) + new).clamp(max=cap)
    leads = cache_leftpad.to(torch.int64) if cache_leftpad is not None else torch.zeros_like(lengths)
    if paged:
        keys, values = (c[page_table.long()].flatten(1, 2) for c in (k_cache, v_cache))
    else:
        rows = cache_batch_idx.long() if cache_batch_idx is not None else torch.arange(batch, device=dev)
        keys, values = k_cache[rows], v_cache[rows]
    if packed:
        layout = _front_padded(cu_seqlens_q, q.shape[0], max_seqlen_q)
        q, qv = (_padded_rows(x, layout, batch, max_seqlen_q) for x in (q, qv))
    seen = _seen(q.shape[1], cap, lengths, leads, causal, window, chunk)
    out, lse = _qv_core(q, keys, values, qv, scale, softcap, seen)
    if packed:
        out, lse = _packed_rows(out, lse, layout, batch)
    return (out, lse) if return_lse else out


def _qv_attention_varlen(q, k, v, qv, cu_seqlens_q, cu_seqlens_k, scale, causal, window, softcap, chunk):
    """_qv_attention per packed sequence (cu_seqlens read on the host); rows past the last
    sequence get 0 and LSE +inf. Returns (out (total_q, heads, dv), lse (heads, total_q))."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 1:
            raise TypeError(f"{name} must be a 1-dim int32 tensor (batch + 1,), got {cuflash.validate.show(cu)}")
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for name, offsets, total in (("cu_seqlens_q", cq, q.shape[0]), ("cu_seqlens_k", ck, k.shape[0])):
        if len(offsets) != len(cq) or offsets[0] != 0 or any(a > b for a, b in zip(offsets, offsets[1:])) \
                or offsets[-1] > total:
            raise ValueError(f"{name} must be {len(cq)} non-decreasing offsets from 0 to at most {total} (with qv "
                             f"they are read on the host), got {offsets}")
    outs, lses = [], []
    for i in range(len(cq) - 1):
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        o, l = _qv_attention(q[qs][None], k[ks][None], v[ks][None], qv[qs][None], scale, causal, window, softcap,
                             chunk)
        outs.append(o[0])
        lses.append(l[0])
    rest = q.shape[0] - (cq[-1] if cq else 0)
    outs.append(q.new_zeros(rest, q.shape[1], v.shape[-1]))
    lses.append(torch.full((q.shape[1], rest), float("inf"), device=q.device))
    return torch.cat(outs), torch.cat(lses, dim=1)


def _batched_as_packed(x, name):
    """A batched (batch, seqlen, heads, d) operand of flash_attn_varlen_func without cu_seqlens:
    (cu_seqlens (batch + 1,) int32 on its device, x as (batch * seqlen, heads, d), seqlen). Its
    max_seqlen is not read (FlashAttention-3 reads the maxima only for packed operands: a caller may
    pass max(seqused) there); the seqlen takes its place."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"{name} must be (batch, seqlen, heads, d) when cu_seqlens_{name} is None, got "
                         f"{cuflash.validate.show(x)}")
    b, s = x.shape[:2]
    return torch.arange(b + 1, dtype=torch.int32, device=x.device) * s, x.flatten(0, 1), s


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """FlashAttention-3's ``flash_attn_combine``: merge the partial outputs of key splits.
    out_partial float32 (num_splits, batch, seqlen, nheads, d), lse_partial float32 (num_splits,
    batch, seqlen, nheads) -> (out (batch, seqlen, nheads, d) in ``out_dtype`` (default
    float32), lse (batch, seqlen, nheads)); a split whose LSE is -inf adds nothing. PyTorch
    operations (float32), written into ``out`` when given; the splits are added one at a time
    into one float32 accumulator, so that no temporary of the partials' size is made (they can
    be most of a GPU's memory)."""
    if out_partial.dtype != torch.float32 or lse_partial.dtype != torch.float32:
        raise TypeError(f"out_partial and lse_partial must be float32, got {out_partial.dtype} and {lse_partial.dtype}")
    if out_partial.dim() != 5 or tuple(lse_partial.shape) != tuple(out_partial.shape[:4]):
        raise ValueError(f"out_partial must be (num_splits, batch, seqlen, nheads, d) and lse_partial (num_splits, "
                         f"batch, seqlen, nheads), got {tuple(out_partial.shape)} and {tuple(lse_partial.shape)}")
    dtype = out_dtype or (out.dtype if out is not None else torch.float32)
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"out_dtype must be float32, float16 or bfloat16, got {dtype}")
    if out is not None and (out.dtype != dtype or tuple(out.shape) != tuple(out_partial.shape[1:])):
        raise ValueError(f"out must be {dtype} of shape {tuple(out_partial.shape[1:])}, got {out.dtype} "
                         f"{tuple(out.shape)}")
    lse = torch.logsumexp(lse_partial, dim=0)
    weight = torch.exp(lse_partial - lse).unsqueeze(-1)
    weight = torch.where(torch.isfinite(weight), weight, torch.zeros_like(weight))
    merged = out_partial.new_zeros(out_partial.shape[1:])
    for s in range(out_partial.shape[0]):  # (a split of weight 0 adds nothing, NaN partials included)
        merged += torch.where(weight[s] != 0, weight[s] * out_partial[s], 0.0)
    if out is None:
        return merged.to(dtype), lse
    out.copy_(merged)
    return out, lse


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                            cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                            scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                            return_softmax_lse=False, *, _out=None):
    """FlashAttention-3's ``flash_attn_with_kvcache`` (forward only): new k, v appended to the
    caches in place at ``cache_seqlens`` (rotated with ``rotary_cos``/``rotary_sin`` at positions
    from ``rotary_seqlens``, default ``cache_seqlens``), then q attends to them; ``page_table`` is
    a paged cache's block table. ``cu_seqlens_k_new``: k, v packed (total_new, nheads_k, d).
    ``cu_seqlens_q`` (with ``max_seqlen_q``): q packed (total_q, nheads, d), each sequence's
    queries aligned to the end of its keys as in the dense call; run as a dense call on a copy of
    q padded in front to max_seqlen_q rows (q rotated by PyTorch operations), its rows gathered
    back. Returns out, or (out, softmax_lse) with ``return_softmax_lse=True`` (varlen:
    softmax_lse (nheads, total_q)). (``_out``: the fwd operator's output, which the kernel of a
    dense q writes where :func:`_kernel_writes`.)"""
    _hints(num_splits, pack_gqa, sm_margin)
    if scheduler_metadata is not None and not isinstance(scheduler_metadata, torch.Tensor):
        raise TypeError(f"scheduler_metadata must be None or a tensor (a hint cuflash does not need), got "
                        f"{cuflash.validate.show(scheduler_metadata)}")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    _check_query_layout(q, cu_seqlens_q, max_seqlen_q)
    if cu_seqlens_q is not None:  # (an upper bound: no sequence has more than total_q rows)
        max_seqlen_q = min(max_seqlen_q, q.shape[0])
    keys = any(isinstance(x, torch.Tensor) and x.numel() > 0 for x in (k_cache, k))  # (for _fa3_lse)
    if page_table is not None and cache_batch_idx is not None:
        page_table, cache_batch_idx = _table_rows(page_table, cache_batch_idx, q, cu_seqlens_q), None
    if qv is not None:
        _refuse(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, rotary_cos=rotary_cos,
                rotary_sin=rotary_sin)
        if torch.float8_e4m3fn in (q.dtype, k_cache.dtype, v_cache.dtype):
            raise NotImplementedError("qv with float8_e4m3fn inputs is not supported (nor in FlashAttention-3)")
        if cu_seqlens_q is None and q.dim() != 4:
            raise ValueError(f"q must be (batch, seqlen_q, nheads, d), got {cuflash.validate.show(q)}")
        softmax_scale, attention_chunk = _qv_options(q, softmax_scale, attention_chunk)
        return _fa3_lse(_qv_kvcache(q, k_cache, v_cache, k, v, qv, cache_seqlens, cache_batch_idx, cache_leftpad,
                                    page_table, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, softmax_scale, causal,
                                    _window(window_size), _softcap(softcap), attention_chunk, return_softmax_lse), keys)
    if torch.float8_e4m3fn in (q.dtype, k_cache.dtype, v_cache.dtype):
        def run(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_batch_idx, page_table):
            return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, None, rotary_cos, rotary_sin, cache_seqlens,
                                           cache_batch_idx, cache_leftpad, page_table, cu_seqlens_q, cu_seqlens_k_new,
                                           max_seqlen_q, rotary_seqlens, None, None, None, softmax_scale, causal,
                                           window_size, attention_chunk, softcap, rotary_interleaved, None,
                                           num_splits, pack_gqa, 0, return_softmax_lse)
        appended = (cache_seqlens, cache_batch_idx, page_table, cu_seqlens_k_new)
        return _fp8_kvcache(run, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, (q_descale, k_descale, v_descale),
                            cu_seqlens_q, appended)
    _refuse(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    if v_cache.shape[-1] != q.shape[-1]:
        raise NotImplementedError(f"a value head dim ({v_cache.shape[-1]}) other than the query's ({q.shape[-1]}) "
                                  "is not supported by cuflash's flash_attn_with_kvcache")
    kw = dict(cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=page_table, causal=causal,
              softmax_scale=softmax_scale, num_splits=num_splits, return_lse=bool(return_softmax_lse),
              window_size=_window(window_size), softcap=_softcap(softcap), attention_chunk=attention_chunk,
              cu_seqlens_k_new=cu_seqlens_k_new)
    if cu_seqlens_q is None:
        if _kernel_writes(_out, q, k_cache, v_cache):
            kw["out"] = _out
        return _fa3_lse(cuflash.attention_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=rotary_cos,
                                                       rotary_sin=rotary_sin, cache_seqlens=cache_seqlens,
                                                       rotary_interleaved=rotary_interleaved,
                                                       rotary_seqlens=rotary_seqlens, **kw), keys)
    return _fa3_lse(_kvcache_varlen_q(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, rotary_seqlens,
                                      cu_seqlens_q, max_seqlen_q, rotary_interleaved, page_table, kw), keys)


def _check_query_layout(q, cu_seqlens_q, max_seqlen_q):
    """flash_attn_with_kvcache's q: dense (max_seqlen_q None or q's seqlen), or packed (total_q,
    nheads, d) with an int32 cu_seqlens_q (batch + 1,) on q's device and an int max_seqlen_q."""
    if cu_seqlens_q is None:
        if max_seqlen_q is not None and max_seqlen_q != q.shape[1]:
            raise ValueError(f"max_seqlen_q ({max_seqlen_q}) must be q's seqlen ({q.shape[1]}) without cu_seqlens_q")
        return
    if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.dim() != 1 \
            or cu_seqlens_q.shape[0] < 1 or cu_seqlens_q.device != q.device:
        raise TypeError(f"cu_seqlens_q must be a 1-dim int32 tensor (batch + 1,) on q's device {q.device}, got "
                        f"{cuflash.validate.show(cu_seqlens_q)}")
    if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int) or max_seqlen_q < 0:
        raise TypeError(f"max_seqlen_q must be an int >= 0 with cu_seqlens_q, got {cuflash.validate.show(max_seqlen_q)}")
    if q.dim() != 3:
        raise ValueError(f"q must be (total_q, nheads, d) with cu_seqlens_q, got shape {tuple(q.shape)}")


def _table_rows(page_table, cache_batch_idx, q, cu_seqlens_q):
    """FlashAttention-3's cache_batch_idx with a page table: sequence b reads the table's row
    cache_batch_idx[b], so the rows are gathered on the device (batch x pages_per_seq int32; no
    sync) and the call takes them as its block table. Indices are the caller's contract (as the
    other device arrays): they are clamped to the table's rows, never read past it."""
    for name, x in (("page_table", page_table), ("cache_batch_idx", cache_batch_idx)):
        if not isinstance(x, torch.Tensor) or x.dtype != torch.int32 or x.device != q.device:
            raise TypeError(f"{name} must be an int32 tensor on q's device {q.device}, got {cuflash.validate.show(x)}")
    batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
    if page_table.dim() != 2 or page_table.shape[0] == 0 or tuple(cache_batch_idx.shape) != (batch,):
        raise ValueError(f"page_table must be (batch_cache, pages_per_seq) and cache_batch_idx (batch,) = ({batch},), "
                         f"got shapes {tuple(page_table.shape)} and {tuple(cache_batch_idx.shape)}")
    return page_table.index_select(0, cache_batch_idx.clamp(0, page_table.shape[0] - 1))


def _appended_rows(k_cache, k, appended):
    """Where the call appends the new keys k: (cache rows, rows in them) of sequence b's new row i
    at position cache_seqlens[b] + i, through the block table when paged, those within the
    capacity only (as the append kernel writes them), and the rows of k (flattened to (rows,
    heads, d)) that go there. One sync (the positions' mask)."""
    seq, pos, inside = _append_positions(k, appended, k_cache.device)
    rows, at, fits = _cache_slots(k_cache, seq, pos, appended[2], appended[1])
    inside &= fits
    return rows[inside], at[inside], torch.arange(seq.shape[0], device=k_cache.device)[inside]


def _append_positions(k, appended, dev):
    """(sequence, position) of each new key row of k (dense (batch, s_new, ...) or packed by
    cu_seqlens_k_new), and whether it belongs to a sequence (packed rows past the last one
    do not)."""
    cache_seqlens, _, _, cu_new = appended
    if cu_new is not None:
        batch = cu_new.shape[0] - 1
        seq = _sequence_of(cu_new, k.shape[0])
        inside = seq < batch
        seq = seq.clamp(max=max(batch - 1, 0))
        i = torch.arange(k.shape[0], device=dev) - cu_new[seq]
    else:
        batch, s_new = k.shape[:2]
        seq = torch.arange(batch, device=dev).repeat_interleave(s_new)
        i = torch.arange(s_new, device=dev).repeat(batch)
        inside = torch.ones_like(seq, dtype=torch.bool)
    if isinstance(cache_seqlens, int):
        start = torch.full((max(batch, 1),), cache_seqlens, device=dev)
    else:
        start = torch.as_tensor(cache_seqlens).to(dev, torch.int64)
    return seq, start[seq] + i, inside


def _cache_slots(cache, seq, pos, table, batch_idx):
    """(cache rows, rows in them) of sequence ``seq``'s position ``pos`` (through the block table
    when paged, else the cache's batch row batch_idx[seq] or seq), and whether the position is
    within the cache's capacity."""
    if table is not None:
        page = cache.shape[1]
        fits = (pos >= 0) & (pos < table.shape[1] * page)
        col = (pos // page).clamp(0, table.shape[1] - 1)
        return table[seq, col].long(), pos % page, fits
    fits = (pos >= 0) & (pos < cache.shape[1])
    return (batch_idx[seq].long() if batch_idx is not None else seq), pos, fits


def _fp8_cache_window(k_cache, v_cache, k, appended, rotary):
    """bfloat16 copies of the e4m3 cache rows the call can read, and the cache_batch_idx and
    page_table that address them: the first L rows of each sequence, L = max(cache_seqlens) plus
    the new rows (one sync to read it; the capacity when cache_seqlens is None or not a
    sequence of ints), of the sequence's batch row or of the pages its block-table row lists (in
    table order, so that a copy never spans more than batch x L rows however large the page pool).
    With rotary tables (``rotary``) L is the capacity: the rotary rules depend on it. Arguments of
    types the call refuses get whole-cache copies: the call's checks then name them."""
    cache_seqlens, batch_idx, table, cu_new = appended
    bf16 = torch.bfloat16
    tensors_ok = all(x is None or isinstance(x, torch.Tensor) and x.dtype == torch.int32
                     and x.device == k_cache.device for x in (batch_idx, table))
    if not tensors_ok or 0 in k_cache.shape[:2] or (table is not None and (table.dim() != 2 or 0 in table.shape)):
        return k_cache.to(bf16), v_cache.to(bf16), batch_idx, table
    cap = table.shape[1] * k_cache.shape[1] if table is not None else k_cache.shape[1]
    n_new = 0 if k is None else k.shape[0] if cu_new is not None else k.shape[1]
    length = cap
    if not rotary:  # (with rotary tables the capacity: the rotary rules read it)
        try:
            if isinstance(cache_seqlens, int):
                length = cache_seqlens + n_new
            elif cache_seqlens is not None:
                lens = torch.as_tensor(cache_seqlens)
                if not lens.is_floating_point() and lens.numel():
                    length = int(lens.max()) + n_new
        except (TypeError, ValueError, RuntimeError):  # (the call's own checks say what is wrong)
            pass
    length = max(1, min(length, cap))
    if table is None:
        rows = k_cache[:, :length]
        if batch_idx is not None:
            idx = batch_idx.clamp(0, k_cache.shape[0] - 1).long()
            return rows[idx].to(bf16), v_cache[:, :length][idx].to(bf16), None, None
        return rows.to(bf16), v_cache[:, :length].to(bf16), None, None
    cols = -(-length // k_cache.shape[1])
    pages = table[:, :cols].clamp(0, k_cache.shape[0] - 1).long().flatten()
    copy_table = torch.arange(pages.shape[0], dtype=torch.int32, device=k_cache.device).view(table.shape[0], cols)
    return k_cache[pages].to(bf16), v_cache[pages].to(bf16), None, copy_table


def _fp8_kvcache(run, q, k_cache, v_cache, k, v, cos, sin, descales, cu_seqlens_q, appended):
    """flash_attn_with_kvcache over float8_e4m3fn caches: ``run`` (the bfloat16 call) on bfloat16
    copies of q, the caches and the new k, v (e4m3 values are exact in bfloat16), q times its and
    k's descales, the output times v's (the scores and the softmax are those of the descaled
    values), then the rows the call appended (_appended_rows of ``appended``: cache_seqlens,
    cache_batch_idx, page_table, cu_seqlens_k_new) written back to the e4m3 caches, rounded (the
    attention saw them before that rounding); no other row is written. The output is bfloat16, as
    FlashAttention-3's. Copies of the rows the call can read on each call (_fp8_cache_window):
    correct, not fast."""
    e4m3 = torch.float8_e4m3fn
    given = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)) + ((("k", k), ("v", v)) if k is not None else ())
    for name, x in given:
        if x.dtype != e4m3:
            raise TypeError(f"an FP8 KV cache needs q, k_cache, v_cache (and k, v) all float8_e4m3fn, got {name} "
                            f"{x.dtype}")
    packed = cu_seqlens_q is not None
    batch = cu_seqlens_q.shape[0] - 1 if packed else q.shape[0]
    hk = k_cache.shape[-2]
    _check_descales(q, hk, v_cache.shape[-2], descales, batch)
    seq = _sequence_of(cu_seqlens_q, q.shape[0]) if packed and any(x is not None for x in descales) else None
    bf16 = torch.bfloat16
    with torch.no_grad():
        q_in = q.to(bf16)
        if descales[0] is not None or descales[1] is not None:
            qk = (descales[0] if descales[0] is not None else 1.0) * (descales[1] if descales[1] is not None else 1.0)
            q_in = (q.to(torch.float32) * _per_row_head(qk, q.shape[-2] // hk, seq)).to(bf16)
        kc, vc, copy_idx, copy_table = _fp8_cache_window(k_cache, v_cache, k, appended,
                                                         cos is not None or sin is not None)
        res = run(q_in, kc, vc, *(None if x is None else x.to(bf16) for x in (k, v, cos, sin)), copy_idx, copy_table)
        out = res[0] if isinstance(res, tuple) else res
        if descales[2] is not None:
            out.mul_(_per_row_head(descales[2], q.shape[-2] // hk, seq))
        if k is not None:  # the appended rows, from the copies to the caches
            seq_new, pos, inside = _append_positions(k, appended, k_cache.device)
            rows, at, fits = _cache_slots(k_cache, seq_new, pos, appended[2], appended[1])
            rows_c, at_c, fits_c = _cache_slots(kc, seq_new, pos, copy_table, copy_idx)
            inside &= fits & fits_c
            rows, at, rows_c, at_c = rows[inside], at[inside], rows_c[inside], at_c[inside]
            k_cache[rows, at] = kc[rows_c, at_c].to(e4m3)
            v_cache[rows, at] = vc[rows_c, at_c].to(e4m3)
    return res


def _kvcache_varlen_q(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens, rotary_seqlens, cu_seqlens_q, max_seqlen_q,
                      interleaved, page_table, kw):
    """flash_attn_with_kvcache with packed queries: rotated (PyTorch operations, with the new
    keys, at rotary_seqlens or cache_seqlens), padded in front to (batch, max_seqlen_q) rows so
    that each sequence's last query is the dense call's last row, attended, gathered back."""
    batch, total, dev = cu_seqlens_q.shape[0] - 1, q.shape[0], q.device
    tokens = torch.arange(total, dtype=torch.int32, device=dev)
    layout = _front_padded(cu_seqlens_q, total, max_seqlen_q)
    seq_c = layout[0]
    if cos is not None or sin is not None:  # (checked as attention_with_kvcache checks them)
        qv = cuflash.validate.view(q, "q")
        capacity = k_cache.shape[1] * (page_table.shape[1] if page_table is not None else 1)
        cos, sin, interleaved = cuflash.api._rotary(cos, sin, interleaved, k is not None, qv, q.shape[-1], capacity)
        cos, sin = cos.array, sin.array
        if cache_seqlens is None or isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
            cache_seqlens = torch.full((batch,), cache_seqlens or 0, dtype=torch.int32, device=dev)
        elif not (isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.is_cuda):  # a host array
            host = torch.as_tensor(cache_seqlens)
            if host.is_floating_point() or host.is_complex() or host.dtype == torch.bool or tuple(host.shape) != (batch,):
                raise ValueError(f"cache_seqlens must be integers of shape (batch,) = ({batch},), got "
                                 f"{cuflash.validate.show(cache_seqlens)}")
            cache_seqlens = host.to(device=dev, dtype=torch.int32)
        cuflash.validate.int32_vector(cache_seqlens, "cache_seqlens", batch, qv)
        if rotary_seqlens is not None:
            cuflash.validate.int32_vector(rotary_seqlens, "rotary_seqlens", batch, qv)
        start = cache_seqlens if rotary_seqlens is None else rotary_seqlens
        rowwise = cuflash.api._rotary_rowwise(kw["causal"], kw["window_size"], max_seqlen_q, False, capacity) or \
            kw["attention_chunk"]
        q = _rotated(q, cos, sin, interleaved, start[seq_c] + (tokens - cu_seqlens_q[seq_c] if rowwise else 0))
        cu_new = kw["cu_seqlens_k_new"]
        if cu_new is not None:  # packed new keys: each row's sequence and index in it
            rows = torch.arange(k.shape[0], dtype=torch.int32, device=dev)
            seq_k = _sequence_of(cu_new, k.shape[0]).clamp(max=max(batch - 1, 0))
            k = _rotated(k, cos, sin, interleaved, start[seq_k] + rows - cu_new[seq_k])
        else:
            pos = start[:, None] + torch.arange(k.shape[1], dtype=torch.int32, device=dev)
            k = _rotated(k.flatten(0, 1), cos, sin, interleaved, pos.flatten()).unflatten(0, k.shape[:2])
    res = cuflash.attention_with_kvcache(_padded_rows(q, layout, batch, max_seqlen_q), k_cache, v_cache, k, v,
                                         cache_seqlens=cache_seqlens, **kw)
    return _packed_rows(*(res if kw["return_lse"] else (res, None)), layout, batch)


def _front_padded(cu_seqlens_q, total, max_seqlen_q):
    """Each of ``total`` packed query tokens' place in a (batch + 1, max_seqlen_q) layout padded in
    front (each sequence's last query on the last row, so that causal masks, windows and chunks
    align as in a dense call): (its sequence clamped to the batch, its row, whether it has one,
    the batch row it is written to: tokens outside every sequence or past max_seqlen_q go to the
    spare row ``batch``, never read)."""
    batch, dev = cu_seqlens_q.shape[0] - 1, cu_seqlens_q.device
    tokens = torch.arange(total, dtype=torch.int32, device=dev)
    seq = _sequence_of(cu_seqlens_q, total)
    lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    seq_c = seq.clamp(max=max(batch - 1, 0))
    row = max_seqlen_q - lens[seq_c] + tokens - cu_seqlens_q[seq_c]
    valid = (seq < batch) & (row >= 0) & (row < max_seqlen_q)
    return seq_c, row.clamp(0, max(max_seqlen_q - 1, 0)), valid, torch.where(valid, seq, batch)


def _padded_rows(x, layout, batch, max_seqlen_q):
    """Packed (total, heads, ·) rows in _front_padded's dense (batch, max_seqlen_q, heads, ·)
    layout (zeros elsewhere)."""
    _, row_w, _, seq_w = layout
    dense = x.new_zeros((batch + 1, max_seqlen_q) + tuple(x.shape[1:]))
    dense[seq_w, row_w] = x
    return dense[:batch]


def _packed_rows(out, lse, layout, batch):
    """A dense call's out (batch, max_seqlen_q, heads, dv) and lse (batch, heads, max_seqlen_q) or
    None back at the packed tokens of _front_padded's ``layout``: (out (total, heads, dv), lse
    (heads, total)) or out alone; tokens outside every sequence get 0 and LSE +inf."""
    seq_c, row_w, valid, _ = layout
    total, heads, dev = valid.shape[0], out.shape[2], valid.device
    gathered = out[seq_c, row_w] if batch else out.new_zeros((total,) + tuple(out.shape[2:]))
    out = torch.where(valid[:, None, None], gathered, torch.zeros((), dtype=out.dtype, device=dev))
    if lse is None:
        return out
    lse = lse[seq_c, :, row_w] if batch else torch.zeros((total, heads), dtype=torch.float32, device=dev)
    return out, torch.where(valid[:, None], lse, float("inf")).transpose(0, 1).contiguous()


def _rotated(x, cos, sin, interleaved, pos):
    """x (rows, heads, d) with its first 2 * cos.shape[1] columns rotated at positions pos (rows,),
    clamped to the tables' rows as the append kernel clamps them (apply_rotary_emb's arithmetic:
    float32, then x's dtype)."""
    from cuflash.flash_attn.layers.rotary import apply_rotary_emb
    pos = pos.long().clamp(0, cos.shape[0] - 1)
    return apply_rotary_emb(x.unsqueeze(1), cos, sin, interleaved, seqlen_offsets=pos).squeeze(1)


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                           cache_seqlens, qkv_dtype=torch.bfloat16, headdim_v=None, cu_seqlens_q=None,
                           cu_seqlens_k_new=None, cache_leftpad=None, page_size=None, max_seqlen_k_new=0,
                           causal=False, window_size=(-1, -1), attention_chunk=0, has_softcap=False, num_splits=0,
                           pack_gqa=None, sm_margin=0):
    """FlashAttention-3's ``get_scheduler_metadata``: None, as cuflash plans each call itself
    (``cuflash.plan`` says how); flash_attn_with_kvcache takes that None back."""
    return None


# torch.ops.flash_attn_3: FlashAttention-3's operators (flash_api.cpp's TORCH_LIBRARY), with the
# schemas FlashAttention-3 promises to stay compatible with (hopper/test_flash_attn.py's
# test_flash3_bw_compatibility; FlashAttention-3's own bwd has since returned five tensors,
# softmax_d first, where this one returns dq, dk, dv first), for code that calls the operators
# rather than the functions: PyTorch's FA3 adapter for SDPA
# (torch.nn.attention._fa3.register_flash_attention_fa3, given module_path="cuflash.flash_attn3").
# Fake kernels give FakeTensor shapes; as FlashAttention-3's, fwd and bwd return aliases of
# mutable inputs, which torch.compile's graph capture refuses in custom operators, so compiled
# code calls the functions above (custom operators of cuflash.torch). They are defined only where
# FlashAttention-3 itself is not installed (its own extension defines the namespace; a second
# definition would fail at its import).
_SCHEMAS = {
    "fwd": "fwd(Tensor q, Tensor k, Tensor v, Tensor(k_new!)? k_new=None, Tensor(v_new!)? v_new=None, "
           "Tensor? q_v=None, Tensor(out!)? out=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
           "Tensor? cu_seqlens_k_new=None, Tensor? seqused_q=None, Tensor? seqused_k=None, int? max_seqlen_q=None, "
           "int? max_seqlen_k=None, Tensor? page_table=None, Tensor? kv_batch_idx=None, Tensor? leftpad_k=None, "
           "Tensor? rotary_cos=None, Tensor? rotary_sin=None, Tensor? seqlens_rotary=None, Tensor? q_descale=None, "
           "Tensor? k_descale=None, Tensor? v_descale=None, float? softmax_scale=None, bool is_causal=False, "
           "int window_size_left=-1, int window_size_right=-1, int attention_chunk=0, float softcap=0., "
           "bool is_rotary_interleaved=False, Tensor? scheduler_metadata=None, int num_splits=0, "
           "bool? pack_gqa=None, int sm_margin=0) -> (Tensor(out!), Tensor, Tensor, Tensor)",
    "bwd": "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, Tensor(dq!)? dq=None, "
           "Tensor(dk!)? dk=None, Tensor(dv!)? dv=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
           "Tensor? seqused_q=None, Tensor? seqused_k=None, int? max_seqlen_q=None, int? max_seqlen_k=None, "
           "float? softmax_scale=None, bool is_causal=False, int window_size_left=-1, int window_size_right=-1, "
           "float softcap=0., bool deterministic=False, int sm_margin=0) "
           "-> (Tensor(dq!), Tensor(dk!), Tensor(dv!), Tensor, Tensor, Tensor, Tensor, Tensor)",
    "fwd_combine": "fwd_combine(Tensor out_partial, Tensor lse_partial, Tensor(out!)? out=None, "
                   "ScalarType? out_dtype=None) -> (Tensor(out!), Tensor)",
    "get_scheduler_metadata": "get_scheduler_metadata(int batch_size, int max_seqlen_q, int max_seqlen_k, "
                              "int num_heads, int num_heads_k, int headdim, int headdim_v, ScalarType qkv_dtype, "
                              "Tensor seqused_k, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
                              "Tensor? cu_seqlens_k_new=None, Tensor? seqused_q=None, Tensor? leftpad_k=None, "
                              "int? page_size=None, int max_seqlen_k_new=0, bool is_causal=False, "
                              "int window_size_left=-1, int window_size_right=-1, int attention_chunk=0, "
                              "bool has_softcap=False, int num_splits=0, bool? pack_gqa=None, int sm_margin=0) "
                              "-> Tensor",
}


def _lse_shape(q, cu_seqlens_q):
    """The operators' LSE (and per-row statistics) shape: (batch, nheads, seqlen_q), or (nheads,
    total_q) for packed queries."""
    return (q.shape[-2], q.shape[0]) if cu_seqlens_q is not None else (q.shape[0], q.shape[2], q.shape[1])


def _fwd_shapes(q, v, cu_seqlens_q):
    """The fwd operator's output shape and dtype (q's rows, v's head dim; bf16 for FP8 inputs) and
    its LSE's shape."""
    dtype = torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype
    return (*q.shape[:-1], v.shape[-1]), dtype, _lse_shape(q, cu_seqlens_q)


def _fwd_op(q, k, v, k_new=None, v_new=None, q_v=None, out=None, cu_seqlens_q=None, cu_seqlens_k=None,
            cu_seqlens_k_new=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
            page_table=None, kv_batch_idx=None, leftpad_k=None, rotary_cos=None, rotary_sin=None, seqlens_rotary=None,
            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, is_causal=False, window_size_left=-1,
            window_size_right=-1, attention_chunk=0, softcap=0.0, is_rotary_interleaved=False,
            scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0):
    """flash_attn_3::fwd. A call with a KV-cache argument (new keys, a page table, cache indices,
    leftpad, rotary tables), or with seqused_k over batched keys of q's head dim (a decode over a
    cache), is flash_attn_with_kvcache's (seqused_k the cache lengths; with a page table and
    cu_seqlens_k, the lengths cu_seqlens_k's); one with other sequence arguments
    flash_attn_varlen_func's; the rest flash_attn_func's. ``max_seqlen_q`` / ``max_seqlen_k`` of
    batched operands are their seqlens (FlashAttention-3 does not read them there); ``sm_margin``
    (SMs left free) is a hint cuflash does not take, as ``num_splits`` and ``pack_gqa``; the default
    softmax scale is q's head dim's, ``q_v`` or not. Returns
    (out, softmax_lse, out_accum, softmax_lse_accum); cuflash merges splits itself, so the two
    accumulators are empty. A given ``out`` is checked first; the kernel writes it where the call
    runs one kernel over fp16/bf16 operands of q's head dim (no value pieces, descales or chunk;
    batched varlen rows one view of it), other routes' results are copied into it."""
    shape, dtype, _ = _fwd_shapes(q, v, cu_seqlens_q)
    # FlashAttention-3's operator scales by q's head dim alone, with q_v too (its Python functions,
    # which cuflash's functions follow, default to (d + dv) ** -0.5 with qv).
    if q_v is not None:
        softmax_scale = _scale(q.shape[-1], softmax_scale)
    if out is not None and (tuple(out.shape) != shape or out.dtype != dtype or out.device != q.device):
        raise ValueError(f"out must be {dtype} of shape {shape} on {q.device}, got {cuflash.validate.show(out)}")
    window, descales = (window_size_left, window_size_right), (q_descale, k_descale, v_descale)
    cache_args = (k_new, v_new, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin)
    max_seqlen_q, max_seqlen_k = _batched_lengths(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    decode = seqused_k is not None and cu_seqlens_k is None and seqused_q is None and v.shape[-1] == q.shape[-1]
    with torch.no_grad():
        if any(x is not None for x in cache_args) or decode:
            _refuse(seqused_q=seqused_q)
            if seqused_k is None and cu_seqlens_k is not None:
                seqused_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
            res, lse = flash_attn_with_kvcache(
                q, k, v, k_new, v_new, q_v, rotary_cos, rotary_sin, seqused_k, kv_batch_idx, leftpad_k, page_table,
                cu_seqlens_q, cu_seqlens_k_new, None if cu_seqlens_q is None else max_seqlen_q, seqlens_rotary,
                *descales, softmax_scale, is_causal, window, attention_chunk, softcap, is_rotary_interleaved,
                scheduler_metadata, num_splits, pack_gqa, 0, return_softmax_lse=True, _out=out)
        elif any(x is not None for x in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)):
            _refuse(cu_seqlens_k_new=cu_seqlens_k_new, seqlens_rotary=seqlens_rotary)
            res, lse = flash_attn_varlen_func(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, softmax_scale,
                is_causal, q_v, *descales, window, attention_chunk, softcap, num_splits, pack_gqa, False, 0,
                return_attn_probs=True, _out=out)
        else:
            _refuse(cu_seqlens_k_new=cu_seqlens_k_new, seqlens_rotary=seqlens_rotary)
            res, lse = flash_attn_func(q, k, v, softmax_scale, is_causal, q_v, *descales, window, attention_chunk,
                                       softcap, num_splits, pack_gqa, False, 0, return_attn_probs=True, _out=out)
    if out is not None:  # (the kernel wrote it, or a route that makes its own output is copied)
        res = out if res.data_ptr() == out.data_ptr() else out.copy_(res)
    none = q.new_empty(0, dtype=torch.float32)
    return res, lse, none, none.clone()


def _batched_lengths(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """max_seqlen_q / max_seqlen_k with a batched operand's (no cu_seqlens) made its seqlen: FlashAttention-3
    reads the maxima only for packed operands (a caller may pass max(seqused_k) there)."""
    return (q.shape[1] if cu_seqlens_q is None and q.dim() == 4 else max_seqlen_q,
            k.shape[1] if cu_seqlens_k is None and k.dim() == 4 else max_seqlen_k)


def _fwd_fake(q, k, v, k_new=None, v_new=None, q_v=None, out=None, cu_seqlens_q=None, *args, **kwargs):
    shape, dtype, lse = _fwd_shapes(q, v, cu_seqlens_q)
    none = q.new_empty(0, dtype=torch.float32)
    return (q.new_empty(shape, dtype=dtype) if out is None else out), q.new_empty(lse, dtype=torch.float32), none, \
        none.clone()


def _bwd_op(dout, q, k, v, out, softmax_lse, dq=None, dk=None, dv=None, cu_seqlens_q=None, cu_seqlens_k=None,
            seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None,
            is_causal=False, window_size_left=-1, window_size_right=-1, softcap=0.0, deterministic=False,
            sm_margin=0):
    """flash_attn_3::bwd: dq, dk, dv (written into those given) of the forward whose ``out`` and
    ``softmax_lse`` are given (cuflash.backward's kernels), then softmax_d = rowsum(dout * out) and
    the LSE in log2 units, shaped as the LSE (float32 PyTorch operations: FlashAttention-3 returns
    its own), and three empty tensors where FlashAttention-3 returns its float32 accumulators. A
    value head dim other than q's: V, out and dout are cut into pieces of q's head dim (the last
    zero-padded), each piece's dq and dk added (dS is linear in the pieces' dP - D)."""
    from cuflash import backward
    want = (*q.shape[:-1], v.shape[-1])
    for name, x in (("dout", dout), ("out", out)):
        if tuple(x.shape) != want or x.dtype != q.dtype or x.device != q.device:
            raise ValueError(f"{name} must be {q.dtype} of shape {want} (q's rows, v's head dim) on {q.device}, got "
                             f"{cuflash.validate.show(x)}")
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    for name, g, x in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if g.shape != x.shape or g.dtype != x.dtype or g.device != x.device:
            raise ValueError(f"{name} must be {x.dtype} of shape {tuple(x.shape)} on {x.device}, got "
                             f"{cuflash.validate.show(g)}")
    kw = dict(causal=is_causal, softmax_scale=softmax_scale, window_size=_window((window_size_left, window_size_right)),
              softcap=_softcap(softcap), deterministic=deterministic)
    varlen = any(x is not None for x in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k))
    # FlashAttention-3's -inf for a row that saw no key is cuflash's backward's +inf (its P = 0)
    lse = torch.where(torch.isneginf(softmax_lse), float("inf"), softmax_lse) \
        if isinstance(softmax_lse, torch.Tensor) and softmax_lse.is_floating_point() else softmax_lse
    max_seqlen_q, max_seqlen_k = _batched_lengths(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if varlen:
        if cu_seqlens_q is None:  # batched q: packed rows, the LSE as (nheads, total_q)
            cu_seqlens_q, _, max_seqlen_q = _batched_as_packed(q, "q")
            lse = lse.transpose(0, 1).flatten(1)
        if cu_seqlens_k is None:
            cu_seqlens_k, _, max_seqlen_k = _batched_as_packed(k, "k")
        if seqused_q is not None or seqused_k is not None:
            cu_seqlens_q, cu_seqlens_k = _seqused(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
        rows = lambda x: x.flatten(0, 1) if x.dim() == 4 else x  # noqa: E731

        def run(do, o, vv, *grads):  # (batched gradients that flatten to no view: written through copies)
            into = [g if g.dim() == 3 or g.is_contiguous() else torch.empty(g.shape, dtype=g.dtype, device=g.device)
                    for g in grads]
            backward.attention_varlen_backward(rows(do), rows(q), rows(k), rows(vv), rows(o), lse, cu_seqlens_q,
                                               cu_seqlens_k, max_seqlen_q, max_seqlen_k, dq=rows(into[0]),
                                               dk=rows(into[1]), dv=rows(into[2]), **kw)
            for g, t in zip(grads, into):
                if t is not g:
                    g.copy_(t)
    else:
        def run(do, o, vv, gq, gk, gv):
            return backward.attention_backward(do, q, k, vv, o, lse, dq=gq, dk=gk, dv=gv, **kw)
    with torch.no_grad():
        d = q.shape[-1]
        if v.shape[-1] == d:
            run(dout, out, v, dq, dk, dv)
        else:
            for j in range(0, v.shape[-1], d):
                w = min(d, v.shape[-1] - j)
                piece = [_pad_last(x[..., j:j + w], d).contiguous() for x in (dout, out, v)]
                gq, gk, gv = (torch.empty_like(x) for x in (q, k, piece[2]))
                run(*piece, gq, gk, gv)
                dv[..., j:j + w] = gv[..., :w]
                if j == 0:
                    dq.copy_(gq), dk.copy_(gk)
                else:
                    dq.add_(gq), dk.add_(gk)
        softmax_d = torch.linalg.vecdot(dout.float(), out.float())
        softmax_d = softmax_d.transpose(0, 1) if softmax_d.dim() == 2 else softmax_d.transpose(1, 2)
    none = q.new_empty(0, dtype=torch.float32)
    lse_log2 = torch.where(torch.isneginf(softmax_lse), 0.0, softmax_lse * 1.4426950408889634)  # (as FA3's)
    return dq, dk, dv, softmax_d.contiguous(), lse_log2, none, none.clone(), none.clone()


def _bwd_fake(dout, q, k, v, out, softmax_lse, dq=None, dk=None, dv=None, cu_seqlens_q=None, *args, **kwargs):
    none = q.new_empty(0, dtype=torch.float32)
    stats = q.new_empty(_lse_shape(q, cu_seqlens_q), dtype=torch.float32)
    return (torch.empty_like(q) if dq is None else dq, torch.empty_like(k) if dk is None else dk,
            torch.empty_like(v) if dv is None else dv, stats, torch.empty_like(stats), none, none.clone(),
            none.clone())


def _flash_attn_forward(q, k, v, k_new=None, v_new=None, qv=None, out_=None, cu_seqlens_q=None, cu_seqlens_k=None,
                        cu_seqlens_k_new=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
                        page_table=None, kv_batch_idx=None, leftpad_k=None, rotary_cos=None, rotary_sin=None,
                        seqlens_rotary=None, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                        causal=False, window_size_left=-1, window_size_right=-1, attention_chunk=0, softcap=0.0,
                        rotary_interleaved=True, scheduler_metadata=None, num_splits=1, pack_gqa=None, sm_margin=0):
    """FlashAttention-3's private ``_flash_attn_forward`` (which libraries such as TransformerEngine
    call): the fwd operator's call under these names, (out, softmax_lse, out_accum,
    softmax_lse_accum); forward only (no autograd graph)."""
    return _fwd_op(q, k, v, k_new, v_new, qv, out_, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q,
                   seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin,
                   seqlens_rotary, q_descale, k_descale, v_descale, softmax_scale, causal, window_size_left,
                   window_size_right, attention_chunk, softcap, rotary_interleaved, scheduler_metadata, num_splits,
                   pack_gqa, sm_margin)


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None, sequed_q=None,
                         sequed_k=None, max_seqlen_q=None, max_seqlen_k=None, dq=None, dk=None, dv=None,
                         softmax_scale=None, is_causal=False, window_size_left=-1, window_size_right=-1, softcap=0.0,
                         deterministic=False, sm_margin=0):
    """FlashAttention-3's private ``_flash_attn_backward``: the bwd operator's call under these names
    (``sequed_*`` is FlashAttention-3's spelling of seqused_*); the gradients go into dq, dk, dv;
    returns softmax_d."""
    return _bwd_op(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k,
                   max_seqlen_q, max_seqlen_k, softmax_scale, is_causal, window_size_left, window_size_right, softcap,
                   deterministic, sm_margin)[3]


def _combine_op(out_partial, lse_partial, out=None, out_dtype=None):
    """flash_attn_3::fwd_combine: flash_attn_combine."""
    return flash_attn_combine(out_partial, lse_partial, out, out_dtype)


def _combine_fake(out_partial, lse_partial, out=None, out_dtype=None):
    dtype = out_dtype or (out.dtype if out is not None else torch.float32)
    return (out_partial.new_empty(out_partial.shape[1:], dtype=dtype) if out is None else out,
            lse_partial.new_empty(lse_partial.shape[1:]))


def _metadata_op(batch_size, max_seqlen_q, max_seqlen_k, num_heads, num_heads_k, headdim, headdim_v, qkv_dtype,
                 seqused_k, *args, **kwargs):
    """flash_attn_3::get_scheduler_metadata: an empty int32 tensor on seqused_k's device (cuflash plans
    each call itself; fwd accepts the tensor back as a hint)."""
    return seqused_k.new_empty(0, dtype=torch.int32)


def _define_ops():
    """Defines torch.ops.flash_attn_3's four operators (CUDA kernels and fake ones for tracing),
    unless FlashAttention-3 is installed (its extension defines them) or they exist already. The
    library is kept on the cuflash package, so that reloading this module keeps the operators
    (they go when their library is collected)."""
    import importlib.util
    if importlib.util.find_spec("flash_attn_3") is not None or hasattr(torch.ops.flash_attn_3, "fwd"):
        return getattr(cuflash, "_flash_attn_3_library", None)
    lib = torch.library.Library("flash_attn_3", "FRAGMENT")
    for name, op, fake in (("fwd", _fwd_op, _fwd_fake), ("bwd", _bwd_op, _bwd_fake),
                           ("fwd_combine", _combine_op, _combine_fake),
                           ("get_scheduler_metadata", _metadata_op, _metadata_op)):
        lib.define(_SCHEMAS[name])
        lib.impl(name, op, "CUDA")
        torch.library.register_fake(f"flash_attn_3::{name}", fake, lib=lib)
    cuflash._flash_attn_3_library = lib
    return lib


_LIBRARY = _define_ops()
