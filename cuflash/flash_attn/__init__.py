"""flash-attn 2.8's Python API on cuflash's kernels, for switching by changing an import:

    from flash_attn import flash_attn_func, flash_attn_varlen_func      # before
    from cuflash.flash_attn import flash_attn_func, flash_attn_varlen_func  # after
    from cuflash.flash_attn.bert_padding import pad_input, unpad_input

The functions keep flash-attn 2.8.x's signatures (names, positional order, defaults; its
``flash_attn/flash_attn_interface.py``) and return conventions: ``out``, or with
``return_attn_probs=True`` ``(out, softmax_lse, S_dmask)``, where S_dmask is an empty tensor
(shape (0,), q's dtype) as flash-attn returns it without dropout. The dense and varlen functions
are differentiable (:func:`cuflash.torch.attention` / :func:`cuflash.torch.attention_varlen`,
``deterministic`` passed to their backward); ``flash_attn_with_kvcache`` is forward only, as in
flash-attn (:func:`cuflash.attention_with_kvcache`).

``dropout_p`` (a float in [0, 1)) is flash-attn's attention dropout, its Philox seed and offset
taken from the default CUDA generator as flash-attn takes them (cuflash.torch.attention).
With dropout, ``return_attn_probs=True`` gives S_dmask as float32 (batch, nheads, seqlen_q,
seqlen_k) (varlen: (batch, nheads, max_seqlen_q, max_seqlen_k), zero past each sequence): the
softmax's probabilities with the dropped elements negated, flash-attn's sign convention
(``S_dmask >= 0`` is the kept mask). Unlike flash-attn's, whose magnitudes follow its kernel's
running maxima (normalize_flash_attn_S undoes them), they are already normalised; and they are
computed by cuflash.reference on the host from the same seed and offset (float64, then copied:
slow and synchronising, meant for tests).

What cuflash does not do yet raises NotImplementedError naming the argument, never ignoring it:
the vLLM extra ``seqused_k`` without a ``block_table``. vLLM's ``s_aux`` (attention sinks) runs as
``cuflash.torch.attention_varlen(..., sinks=s_aux)``.
"""
import numpy as np
import torch

import cuflash
from cuflash import validate
from cuflash.torch import ops

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]


# ---------------------------------------------------------------------------------------------
# flash-attn's argument conventions -> cuflash's

def _not_supported(what, hint):
    raise NotImplementedError(f"{what} is not supported by cuflash yet ({hint})")


def _s_dmask(q, k, batches, dropout_p, seed, offset, causal, softmax_scale, window_size, softcap, alibi_slopes,
             shape):
    """flash-attn's S_dmask with dropout (see the module's docstring): float32 ``shape`` (batch,
    nheads, rows, keys) on q's device, from cuflash.reference.attention_probs of each (q, k) pair
    in ``batches`` (batch index, q rows (1, sq, h, d), k rows (1, sk, hk, d))."""
    from cuflash import reference
    out = np.zeros(shape, dtype=np.float32)
    slopes = None if alibi_slopes is None else alibi_slopes.detach().float().cpu().numpy()
    for b, qb, kb in batches:
        sl = None if slopes is None else (slopes if slopes.ndim == 1 else slopes[b:b + 1])
        p = reference.attention_probs(qb.detach().float().cpu().numpy(), kb.detach().float().cpu().numpy(),
                                      causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                      softcap=softcap, alibi_slopes=sl, dropout_p=dropout_p, seed=seed,
                                      offset=offset, batch0=b)
        out[b, :, :p.shape[2], :p.shape[3]] = p[0]
    return torch.from_numpy(out).to(q.device)


def _draw(dropout_p, q, batch, return_attn_probs):
    """(seed, offset): drawn here when S_dmask must regenerate the mask, else (None, None) (the
    forward draws them)."""
    if not (return_attn_probs and dropout_p > 0):
        return None, None
    _, seed, offset = ops._dropout_state(dropout_p, None, None, q.device, batch, q.shape[-2])
    return ops._u64(seed), ops._u64(offset)


def _window(window_size):
    """flash-attn's window_size -> cuflash's (left, right): a pair of ints, given as a tuple, a
    list or a 2-element integer array or tensor in host memory (read without waiting for the
    GPU; a CUDA tensor is a TypeError, since reading it would synchronise). flash-attn takes any
    negative bound as unbounded, cuflash wants -1 for it."""
    left, right = validate.window_pair(window_size)
    return max(left, -1), max(right, -1)


def _softcap(softcap):
    """flash-attn turns softcapping off for softcap <= 0; cuflash wants 0 for off."""
    return float(softcap) if softcap > 0 else 0.0


def _contiguous_last(x):
    """flash-attn copies an operand whose last dim is not contiguous; cuflash needs a unit stride
    there and reads every other stride in place."""
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def _with_probs(res, q):
    """(out, softmax_lse) -> flash-attn's (out, softmax_lse, S_dmask), S_dmask being the empty
    (0,) tensor that flash-attn returns when there is no dropout."""
    out, lse = res
    return out, lse, q.new_empty((0,))


# ---------------------------------------------------------------------------------------------
# Dense batches (batch, seqlen, nheads, headdim)

def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """flash-attn's ``flash_attn_func`` (differentiable): q (batch, seqlen_q, nheads, d), k, v
    (batch, seqlen_k, nheads_k, d). Returns out, or (out, softmax_lse (batch, nheads, seqlen_q),
    S_dmask) with ``return_attn_probs=True`` (S_dmask empty without dropout; see the module's
    docstring)."""
    q, k, v = (_contiguous_last(x) for x in (q, k, v))
    window, cap = _window(window_size), _softcap(softcap)
    seed, offset = _draw(validate.dropout_p(dropout_p), q, q.shape[0], return_attn_probs)
    drop = {} if not dropout_p else dict(dropout_p=dropout_p, seed=seed, offset=offset)
    res = ops.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window, softcap=cap,
                        alibi_slopes=alibi_slopes, deterministic=deterministic,
                        return_lse=bool(return_attn_probs), **drop)
    if return_attn_probs and seed is not None:
        b, sq, h, _ = q.shape
        mask = _s_dmask(q, k, [(i, q[i:i + 1], k[i:i + 1]) for i in range(b)], dropout_p, seed, offset, causal,
                        softmax_scale, window, cap, alibi_slopes, (b, h, sq, k.shape[1]))
        return (*res, mask)
    return _with_probs(res, q) if return_attn_probs else res


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """flash-attn's ``flash_attn_kvpacked_func``: kv (batch, seqlen_k, 2, nheads_k, d), split
    into k and v by views (no copies)."""
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """flash-attn's ``flash_attn_qkvpacked_func``: qkv (batch, seqlen, 3, nheads, d), split into
    q, k and v by views (no copies)."""
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale,
                           causal, window_size, softcap, alibi_slopes, deterministic,
                           return_attn_probs)


# ---------------------------------------------------------------------------------------------
# Packed variable-length batches (total, nheads, headdim)

def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None, *, seqused_k=None,
                           return_softmax_lse=False, s_aux=None):
    """flash-attn's ``flash_attn_varlen_func`` (differentiable without ``block_table``): q
    (total_q, nheads, d), k, v (total_k, nheads_k, d) or a paged cache (num_pages, page_size,
    nheads_k, d) with ``block_table``. Returns out, or (out, softmax_lse (nheads, total_q),
    empty S_dmask) with ``return_attn_probs=True``.

    Keyword-only extras from vLLM's fork (not in upstream flash-attn 2.8): ``seqused_k`` int32
    (batch,) key counts of a paged cache (then ``cu_seqlens_k`` is not read and may be None; a
    dense K/V with ``seqused_k`` raises NotImplementedError), ``return_softmax_lse=True``
    returning (out, softmax_lse), and ``s_aux``, attention sinks: (nheads,) float32, bfloat16 or
    float16, one logit per query head joining each row's softmax as a column with no value
    (vLLM's semantics; softmax_lse includes it; differentiable here, vLLM's is not).
    With dropout and ``return_attn_probs=True``, S_dmask reads cu_seqlens back to the host.
    """
    if seqused_k is not None:
        if block_table is None:
            _not_supported("seqused_k without a block_table", "dense K/V rows of sequence b are "
                           "cu_seqlens_k[b] to cu_seqlens_k[b + 1]; seqused_k needs a paged cache")
        # A paged sequence's keys are found through its block-table row: cuflash reads only the
        # key counts (offset differences) from cu_seqlens_k, so the counts' prefix sums serve.
        cu_seqlens_k = torch.nn.functional.pad(torch.cumsum(seqused_k, 0, dtype=torch.int32), (1, 0))
    q, k, v = (_contiguous_last(x) for x in (q, k, v))
    window, cap = _window(window_size), _softcap(softcap)
    batch = cu_seqlens_q.shape[0] - 1
    seed, offset = _draw(validate.dropout_p(dropout_p), q, batch, return_attn_probs)
    drop = {} if not dropout_p else dict(dropout_p=dropout_p, seed=seed, offset=offset)
    res = ops.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               causal=causal, softmax_scale=softmax_scale, window_size=window, softcap=cap,
                               alibi_slopes=alibi_slopes, deterministic=deterministic,
                               return_lse=bool(return_attn_probs or return_softmax_lse),
                               block_table=block_table, **({} if s_aux is None else {"sinks": s_aux}), **drop)
    if return_attn_probs and seed is not None:
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        seqs = [(i, q[None, cq[i]:cq[i + 1]], k[None, ck[i]:ck[i + 1]]) for i in range(batch)]
        mask = _s_dmask(q, k, seqs, dropout_p, seed, offset, causal, softmax_scale, window, cap, alibi_slopes,
                        (batch, q.shape[1], max_seqlen_q, max_seqlen_k))
        return (*res, mask)
    return _with_probs(res, q) if return_attn_probs else res  # out, or (out, lse) for vLLM


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p=0.0, softmax_scale=None, causal=False,
                                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                    deterministic=False, return_attn_probs=False):
    """flash-attn's ``flash_attn_varlen_kvpacked_func``: kv (total_k, 2, nheads_k, d), split into
    k and v by views (no copies)."""
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash-attn's ``flash_attn_varlen_qkvpacked_func``: qkv (total, 3, nheads, d), split into
    q, k and v by views (no copies); ``cu_seqlens``/``max_seqlen`` serve queries and keys."""
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens,
                                  max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
                                  window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


# ---------------------------------------------------------------------------------------------
# KV cache (forward only, as in flash-attn)

def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash-attn's ``flash_attn_with_kvcache``: new k, v are appended to the caches in place at
    ``cache_seqlens`` (rotated by ``rotary_cos``/``rotary_sin`` when given, q then attending
    rotated too), then q attends to the caches (from ``cache_leftpad`` on, when given). Returns
    out, or (out, softmax_lse) with ``return_softmax_lse=True``. Lengths past a block table's
    capacity raise a ValueError when cuflash can see them on the host (an int, a NumPy array or a
    CPU tensor); flash-attn reads a device ``cache_seqlens`` back to check it (a synchronisation),
    cuflash does not: its kernels clamp to the table instead."""
    q, k, v = (_contiguous_last(x) for x in (q, k, v))
    return cuflash.attention_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_seqlens=cache_seqlens,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table, causal=causal,
        softmax_scale=softmax_scale, num_splits=num_splits, return_lse=bool(return_softmax_lse),
        window_size=_window(window_size), softcap=_softcap(softcap), rotary_interleaved=rotary_interleaved,
        alibi_slopes=alibi_slopes)
