"""flash-attn 2.8's ``flash_attn.flash_attn_interface`` on cuflash's kernels (the functions are
re-exported by :mod:`cuflash.flash_attn`).

The functions keep flash-attn 2.8.x's signatures (names, positional order, defaults) and return
conventions: ``out``, or with ``return_attn_probs=True`` ``(out, softmax_lse, S_dmask)``, where
S_dmask is an empty tensor (shape (0,), q's dtype) as flash-attn returns it without dropout. The
dense and varlen functions are differentiable (:func:`cuflash.torch.attention` /
:func:`cuflash.torch.attention_varlen`, ``deterministic`` passed to their backward);
``flash_attn_with_kvcache`` is forward only, as in flash-attn (:func:`cuflash.attention_with_kvcache`).

``dropout_p`` (a float in [0, 1)) is flash-attn's attention dropout, its Philox seed and offset
taken from the default CUDA generator as flash-attn takes them (cuflash.torch.attention).
With dropout, ``return_attn_probs=True`` gives S_dmask as flash-attn does: q's dtype, (batch,
nheads, seqlen_q, seqlen_k) (varlen: (batch, nheads, max_seqlen_q, max_seqlen_k), zero past each
sequence), the dropped elements negated (``S_dmask >= 0`` is the kept mask), and magnitudes
relative to flash-attn's running row maximum over key blocks of :func:`_get_block_size_n` keys
(see :func:`cuflash.reference.attention_probs`), so flash-attn's ``normalize_flash_attn_S``
turns them into probabilities. The mask is the kernel's own, read back by extra launches, and
the magnitudes are computed with PyTorch in float32 on q's device: meant for tests (varlen calls
read cu_seqlens back to the host).

What cuflash does not do yet raises NotImplementedError naming the argument, never ignoring it:
the vLLM extra ``seqused_k`` with dense K/V in the private varlen forward or with dropout, and
``leftpad_k`` in the private varlen forward. vLLM's ``s_aux`` (attention sinks) runs as
``cuflash.torch.attention_varlen(..., sinks=s_aux)`` (``flash_attn_func`` takes it too:
transformers hands the varlen function's keywords to both). Lengths and flags are taken as
flash-attn's operators take them: ``max_seqlen_*`` as an int, a NumPy integer or a one-element
tensor (read back), ``causal`` / ``rotary_interleaved`` as bools or ints. Besides the functions,
the names libraries import from flash-attn's module are here: ``_wrapped_flash_attn_*`` (the
private entry points), the autograd Function classes ``FlashAttnFunc`` ...
``FlashAttnVarlenQKVPackedFunc`` (``apply`` with the forward's arguments calls the function),
``maybe_contiguous`` and ``round_multiple``. flash-attn's private entry points and its
extension's functions (below; the differences are listed in docs/torch.md) accept
``zero_tensors`` without zeroing the rows past the last sequence.
"""
import functools
import inspect
import os

import numpy as np
import torch

import cuflash
from cuflash import backward as backward_mod
from cuflash import validate
from cuflash.plan import seqused_bounds
from cuflash.torch import ops

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]


def maybe_contiguous(x):
    """flash-attn's helper: x with a contiguous last dim (a copy only where it is not)."""
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def round_multiple(x, m):
    """flash-attn's helper: x rounded up to a multiple of m."""
    return (x + m - 1) // m * m


# ---------------------------------------------------------------------------------------------
# flash-attn's argument conventions -> cuflash's

def _not_supported(what, hint):
    raise NotImplementedError(f"{what} is not supported by cuflash yet ({hint})")


class FlashAttnCheckError(ValueError, RuntimeError):
    """A bad argument that flash-attn refuses with a RuntimeError (its TORCH_CHECKs) and cuflash
    with a ValueError: both, so that either ``except`` catches it."""


def _paged_capacity_check(q, k, k_cache, cache_seqlens, block_table):
    """flash-attn's check that a paged cache's CUDA ``cache_seqlens`` (+ the new keys) fit what the
    block table addresses: read back from the device (a synchronisation, as in flash-attn; not
    while a CUDA graph is being captured, where the kernels' clamp to the table stands alone).
    Host-known lengths are checked by cuflash.attention_with_kvcache itself."""
    if (block_table is None or not isinstance(cache_seqlens, torch.Tensor) or not cache_seqlens.is_cuda
            or cache_seqlens.numel() == 0 or torch.cuda.is_current_stream_capturing()):
        return
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or k_cache.dim() != 4:
        return  # (cuflash.attention_with_kvcache names the bad argument)
    new = k.shape[1] if isinstance(k, torch.Tensor) and k.dim() == 4 else 0
    capacity = block_table.shape[1] * k_cache.shape[1]
    longest = int(cache_seqlens.max()) + new
    if longest > capacity:
        raise FlashAttnCheckError(
            f"Paged KV cache: max(cache_seqlens){' + seqlen_new' if new else ''} (= {longest}) exceeds the capacity "
            f"addressable by block_table (pages_per_seq * page_size = {block_table.shape[1]} * {k_cache.shape[1]} = "
            f"{capacity})")


def _cache_rows(q, k_cache, v_cache, cache_batch_idx, block_table):
    """A contiguous cache of more batch rows than q's, without cache_batch_idx: rows 0 ... b - 1,
    as flash-attn reads them (a preallocated cache of the largest batch), as views (the new keys
    are written into the caller's cache)."""
    b = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 4 else None
    if (b is not None and cache_batch_idx is None and block_table is None and isinstance(k_cache, torch.Tensor)
            and isinstance(v_cache, torch.Tensor) and k_cache.dim() == 4 and k_cache.shape[0] > b
            and v_cache.shape[0] == k_cache.shape[0]):
        return k_cache[:b], v_cache[:b]
    return k_cache, v_cache


# flash-attn's switch to its Triton kernels on AMD GPUs; cuflash has no such path.
USE_TRITON_ROCM = os.getenv("FLASH_ATTENTION_TRITON_AMD_ENABLE", "FALSE") == "TRUE"


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """The key-block size of flash-attn 2.8's forward kernel for ``head_dim`` on ``device``'s GPU
    (its ``_get_block_size_n``): the blocks over which S_dmask's magnitudes take their running
    row maximum (flash-attn's tests normalise S_dmask with it)."""
    if not 0 < head_dim <= 256:
        raise ValueError(f"head_dim must be in 1..256, got {head_dim}")
    major, minor = torch.cuda.get_device_capability(device)
    if head_dim <= 32:
        return 128
    if head_dim <= 64:
        return 64 if is_dropout else 128
    if head_dim <= 96:
        return 64
    if head_dim <= 128:
        if major == 8 and minor > 0:  # sm86 / sm89
            return 64 if (not is_dropout and is_causal) else 32
        return 32 if is_dropout else 64
    return 64


def _kernel_keep(q, k, dropout_p, seed, offset, shape, varlen=None):
    """The kernel's own dropout mask (True = kept), read back: with q = k = 0 every key of a row
    has probability 1 / seqlen_k, and v = one-hot rows for keys c .. c + d - 1 puts
    kept / (seqlen_k (1 - p)) into out's d columns, so out > 0 is the mask of those keys (the mask
    is a function of (seed, offset, batch, head, row, key) only). ``shape`` (batch, nheads, rows,
    keys) bool on q's device; ``varlen`` = (cu_seqlens_q, cu_seqlens_k, starts_q, starts_k) with
    the starts as host lists."""
    d = q.shape[-1]
    q0, k0 = torch.zeros_like(q), torch.zeros(k.shape, dtype=q.dtype, device=q.device)
    keep = torch.zeros(shape, dtype=torch.bool, device=q.device)
    for c in range(0, shape[-1], d):
        w = min(d, shape[-1] - c)
        v, t = torch.zeros_like(k0), torch.arange(w, device=q.device)
        if varlen is None:
            v[:, c + t, :, t] = 1
            out = cuflash.attention(q0, k0, v, dropout_p=dropout_p, seed=seed, offset=offset)
            keep[..., c:c + w] = (out[..., :w] > 0).permute(0, 2, 1, 3)
            continue
        cu_q, cu_k, cq, ck = varlen
        for b in range(shape[0]):
            n = min(w, ck[b + 1] - ck[b] - c)
            if n > 0:
                v[ck[b] + c + t[:n], :, t[:n]] = 1
        out = cuflash.attention_varlen(q0, k0, v, cu_q, cu_k, shape[2], shape[3], dropout_p=dropout_p, seed=seed,
                                       offset=offset)
        for b in range(shape[0]):
            keep[b, :, :cq[b + 1] - cq[b], c:c + w] = (out[cq[b]:cq[b + 1], :, :w] > 0).permute(1, 0, 2)
    return keep


def _magnitudes(q, k, causal, softmax_scale, window_size, softcap, alibi_slopes, block_n):
    """S_dmask's magnitudes for one dense batch, float32 (batch, nheads, seqlen_q, seqlen_k) on
    q's device: exp(s - m_j), s the masked scores (the forward's rules: scale, softcap, ALiBi
    -slope * |key - row's diagonal key|, causal and window bounds aligned bottom-right) and m_j the
    row's maximum over key blocks j and later of ``block_n`` keys (cuflash.reference.attention_probs
    with block_n, in float32 and PyTorch)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float().repeat_interleave(h // hk, dim=2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    rel = (torch.arange(sk, device=q.device)[None, :] - torch.arange(sq, device=q.device)[:, None]
           - (sk - sq))  # key minus the row's diagonal key
    if alibi_slopes is not None:
        slopes = alibi_slopes.float().to(q.device).reshape(-1, h)  # (1 or batch, nheads)
        s = s - slopes[:, :, None, None] * rel.abs()
    left, right = window_size
    right = 0 if causal else right
    visible = torch.ones_like(rel, dtype=torch.bool)
    if left >= 0:
        visible &= rel >= -left
    if right >= 0:
        visible &= rel <= right
    s = s.masked_fill(~visible, -torch.inf)
    nb = -(-sk // block_n)
    blocks = torch.nn.functional.pad(s, (0, nb * block_n - sk), value=-torch.inf)
    m = blocks.reshape(b, h, sq, nb, block_n).amax(-1).flip(-1).cummax(-1).values.flip(-1)  # max over blocks j..
    m = torch.where(torch.isfinite(m), m, 0.0).repeat_interleave(block_n, dim=-1)[..., :sk]
    return torch.exp(s - m)


def _s_dmask(q, batches, keep, causal, softmax_scale, window_size, softcap, alibi_slopes, block_n):
    """flash-attn's S_dmask with dropout (see the module's docstring), q's dtype on q's device:
    the magnitudes (_magnitudes) of each (batch index, q rows (1, sq, h, d), k rows (1, sk, hk,
    d)) in ``batches`` (the index a slice of the batch), negated where ``keep`` (batch, nheads,
    rows, keys) is False; ``block_n``: _get_block_size_n's."""
    mag = torch.zeros(keep.shape, dtype=torch.float32, device=q.device)
    for b, qb, kb in batches:
        sl = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b]
        with torch.no_grad():
            p = _magnitudes(qb, kb, causal, softmax_scale, window_size, softcap, sl, block_n)
        mag[b, :, :p.shape[2], :p.shape[3]] = p
    return torch.where(keep, mag, -mag).to(q.dtype)


def _draw(dropout_p, q, batch, return_attn_probs):
    """(seed, offset): drawn here when S_dmask must regenerate the mask, else (None, None) (the
    forward draws them)."""
    if not (return_attn_probs and dropout_p > 0):
        return None, None
    _, seed, offset = ops._dropout_state(dropout_p, None, None, q.device, batch, q.shape[-2])
    return ops._u64(seed), ops._u64(offset)


def _dense_probs(q, k, dropout_p, seed, offset, causal, softmax_scale, window, cap, alibi_slopes):
    """S_dmask of a dense call with dropout (the kernel's mask read back, the magnitudes computed)."""
    b, sq, h, _ = q.shape
    keep = _kernel_keep(q, k, dropout_p, seed, offset, (b, h, sq, k.shape[1]))
    return _s_dmask(q, [(slice(None), q, k)], keep, causal, softmax_scale, window, cap, alibi_slopes,
                    _get_block_size_n(q.device, q.shape[-1], True, causal))


def _varlen_probs(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, seed, offset, causal,
                  softmax_scale, window, cap, alibi_slopes):
    """S_dmask of a packed call with dropout (reads cu_seqlens back to the host)."""
    batch = cu_seqlens_q.shape[0] - 1
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    seqs = [(slice(i, i + 1), q[None, cq[i]:cq[i + 1]], k[None, ck[i]:ck[i + 1]]) for i in range(batch)]
    # the mask over the longest sequences' rows and keys (maxima may be upper bounds), then zeros
    longest = [min(m, max([hi - lo for lo, hi in zip(c, c[1:])], default=0))
               for c, m in ((cq, max_seqlen_q), (ck, max_seqlen_k))]
    keep = q.new_zeros((batch, q.shape[1], max_seqlen_q, max_seqlen_k), dtype=torch.bool)
    keep[..., :longest[0], :longest[1]] = _kernel_keep(q, k, dropout_p, seed, offset, (batch, q.shape[1], *longest),
                                                       varlen=(cu_seqlens_q, cu_seqlens_k, cq, ck))
    return _s_dmask(q, seqs, keep, causal, softmax_scale, window, cap, alibi_slopes,
                    _get_block_size_n(q.device, q.shape[-1], True, causal))


def _seqused_offsets(seqused_k, block_table):
    """cu_seqlens_k for vLLM's ``seqused_k`` with a paged cache (a paged sequence's keys are found
    through its block table row: cuflash reads only the key counts, offset differences, from
    cu_seqlens_k, so the counts' prefix sums serve)."""
    return torch.nn.functional.pad(torch.cumsum(seqused_k, 0, dtype=torch.int32), (1, 0))


def _seqused(cu_seqlens_q, cu_seqlens_k, seqused_q=None, seqused_k=None):
    """(cu_seqlens_q, cu_seqlens_k) of packed sequences that use only their first seqused_q[b]
    queries and seqused_k[b] keys (None: all), as cuflash.plan.seqused_bounds cuts them: three
    sequences per sequence (so per-sequence arguments repeat three times, and the batch limits of
    the grid apply to 3 * batch), computed on the device (no sync). Unused query rows get 0,
    unused keys no gradient, where max_seqlen_q / max_seqlen_k cover the cu_seqlens lengths (as
    flash-attn asks)."""
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(x, torch.Tensor) or x.dtype != torch.int32 or x.dim() != 1 or x.shape[0] < 1:
            raise TypeError(f"{name} must be a 1-dim int32 tensor (batch + 1,), got {validate.show(x)}")
    batch = cu_seqlens_q.shape[0] - 1
    if cu_seqlens_k.shape[0] != batch + 1:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length, got {batch + 1} and "
                         f"{cu_seqlens_k.shape[0]}")
    for name, x in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor) or x.dtype != torch.int32:
            raise TypeError(f"{name} must be an int32 tensor (batch,), got {validate.show(x)}")
        if tuple(x.shape) != (batch,):
            raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {tuple(x.shape)}")
        if x.device != cu_seqlens_q.device:
            raise ValueError(f"{name} must be on cu_seqlens_q's device {cu_seqlens_q.device}, got {x.device}")
    return seqused_bounds(torch, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)


def _window(window_size):
    """flash-attn's window_size -> cuflash's (left, right): a pair of ints, given as a tuple, a
    list or a 2-element integer array or tensor in host memory (read without waiting for the
    GPU; a CUDA tensor is a TypeError, since reading it would synchronise). flash-attn takes any
    negative bound as unbounded, cuflash wants -1 for it."""
    left, right = validate.window_pair(window_size)
    return max(left, -1), max(right, -1)


def _int(x):
    """A length as flash-attn's operators take it: a Python int, from a NumPy integer or a
    one-element integer tensor too (read back: a synchronisation for a CUDA tensor, as in
    flash-attn, whose operators convert it the same way); anything else as given (validated later)."""
    if isinstance(x, torch.Tensor) and x.numel() == 1 and not (x.is_floating_point() or x.is_complex()):
        return int(x.item())
    return int(x) if isinstance(x, np.integer) else x


def _flag(x):
    """A flag as flash-attn's operators take it: a bool, from an int or a NumPy bool/integer too."""
    return bool(x) if isinstance(x, (int, np.integer, np.bool_)) else x


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
                    return_attn_probs=False, *, s_aux=None):
    """flash-attn's ``flash_attn_func`` (differentiable): q (batch, seqlen_q, nheads, d), k, v
    (batch, seqlen_k, nheads_k, d). Returns out, or (out, softmax_lse (batch, nheads, seqlen_q),
    S_dmask) with ``return_attn_probs=True`` (S_dmask empty without dropout; see the module's
    docstring). ``s_aux``: attention sinks as in :func:`flash_attn_varlen_func` (transformers
    passes the varlen function's keywords to this one too)."""
    causal = _flag(causal)
    q, k, v = (_contiguous_last(x) for x in (q, k, v))
    window, cap = _window(window_size), _softcap(softcap)
    seed, offset = _draw(validate.dropout_p(dropout_p), q, q.shape[0], return_attn_probs)
    drop = {} if not dropout_p else dict(dropout_p=dropout_p, seed=seed, offset=offset)
    res = ops.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window, softcap=cap,
                        alibi_slopes=alibi_slopes, deterministic=deterministic,
                        return_lse=bool(return_attn_probs), **({} if s_aux is None else {"sinks": s_aux}), **drop)
    if return_attn_probs and seed is not None:
        return (*res, _dense_probs(q, k, dropout_p, seed, offset, causal, softmax_scale, window, cap, alibi_slopes))
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
    (batch,) key counts: of a paged cache (then ``cu_seqlens_k`` is not read and may be None), or,
    with dense K/V, the keys sequence b uses, the first seqused_k[b] of its cu_seqlens_k rows
    (cut as FlashAttention-3's seqused_k, see cuflash.flash_attn3), ``return_softmax_lse=True``
    returning (out, softmax_lse), and ``s_aux``, attention sinks: (nheads,) float32, bfloat16 or
    float16, one logit per query head joining each row's softmax as a column with no value
    (vLLM's semantics; softmax_lse includes it; differentiable here, vLLM's is not).
    With dropout and ``return_attn_probs=True``, S_dmask reads cu_seqlens back to the host.
    """
    max_seqlen_q, max_seqlen_k, causal = _int(max_seqlen_q), _int(max_seqlen_k), _flag(causal)
    if seqused_k is not None and block_table is not None:
        cu_seqlens_k = _seqused_offsets(seqused_k, block_table)
    elif seqused_k is not None:
        if dropout_p:
            _not_supported("seqused_k with dense K/V and dropout", "the dropout mask is drawn per sequence")
        cu_seqlens_q, cu_seqlens_k = _seqused(cu_seqlens_q, cu_seqlens_k, None, seqused_k)
        if isinstance(alibi_slopes, torch.Tensor) and alibi_slopes.dim() == 2:  # (batch, nheads): per sequence
            alibi_slopes = alibi_slopes.repeat_interleave(3, dim=0)
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
        return (*res, _varlen_probs(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, seed,
                                    offset, causal, softmax_scale, window, cap, alibi_slopes))
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
    rotated too), then q attends to the caches (from ``cache_leftpad`` on, when given). A
    contiguous cache of more batch rows than q's is read at rows 0 ... batch - 1 without
    ``cache_batch_idx``, as in flash-attn. Returns out, or (out, softmax_lse) with
    ``return_softmax_lse=True``. Lengths past a block table's
    capacity raise a ValueError (host lengths: an int, a NumPy array or a CPU tensor) or, for a
    CUDA ``cache_seqlens``, FlashAttnCheckError (a ValueError and flash-attn's RuntimeError) after
    reading it back as flash-attn does (a synchronisation; skipped while a CUDA graph is
    captured: the kernels clamp to the table)."""
    causal, rotary_interleaved = _flag(causal), _flag(rotary_interleaved)
    k_cache, v_cache = _cache_rows(q, k_cache, v_cache, cache_batch_idx, block_table)
    _paged_capacity_check(q, k, k_cache, cache_seqlens, block_table)
    q, k, v = (_contiguous_last(x) for x in (q, k, v))
    return cuflash.attention_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_seqlens=cache_seqlens,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table, causal=causal,
        softmax_scale=softmax_scale, num_splits=num_splits, return_lse=bool(return_softmax_lse),
        window_size=_window(window_size), softcap=_softcap(softcap), rotary_interleaved=rotary_interleaved,
        alibi_slopes=alibi_slopes)


# ---------------------------------------------------------------------------------------------
# flash-attn's private entry points, which libraries built on flash-attn call inside their own
# autograd Functions (ring attention, context parallelism), and its extension module
# (``flash_attn_gpu``, flash_attn_2_cuda's five functions with their positional arguments). No
# autograd graph is recorded; the gradients go into the caller's dq, dk, dv.

def _rng_state(q, seed, offset):
    """flash-attn's rng_state: int64 (2,) on q's device holding the dropout's Philox seed and
    offset (zeros without dropout). Filled on the device (no host copy to wait for); the host
    values ride along on the tensor, so the backward does not read them back."""
    rng = torch.zeros(2, dtype=torch.int64, device=q.device)
    if seed is not None:
        rng[0], rng[1] = ops._s64(seed), ops._s64(offset)
        rng._cuflash_seed_offset = (seed, offset)
    return rng


def _seed_offset(dropout_p, rng_state):
    """(seed, offset) of a backward with dropout from the forward's ``rng_state``: its host values
    when it is this module's, else read back from the device (a synchronisation)."""
    if not dropout_p:
        return {}
    if rng_state is None:
        raise ValueError("rng_state is required with dropout_p > 0: the forward's (seed, offset) regenerate "
                         "its dropout mask")
    seed, offset = getattr(rng_state, "_cuflash_seed_offset", None) or map(ops._u64, rng_state.tolist())
    return dict(dropout_p=dropout_p, seed=seed, offset=offset)


def _no_generator(gen):
    if gen is not None:
        raise RuntimeError("flash-attn: the RNG `generator` argument is no longer supported and must be None; "
                           "dropout (when enabled) uses the default CUDA generator.")


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                        alibi_slopes, return_softmax, *, out=None):
    """flash-attn's ``_flash_attn_forward``: (out, softmax_lse (batch, nheads, seqlen_q), S_dmask,
    rng_state), S_dmask as :func:`flash_attn_func` returns it with ``return_attn_probs`` (empty
    without dropout), rng_state as flash-attn's (see _rng_state)."""
    causal = _flag(causal)
    q, k, v = (_contiguous_last(x) for x in (q, k, v))
    window, cap = _window((window_size_left, window_size_right)), _softcap(softcap)
    seed, offset = _draw(validate.dropout_p(dropout_p), q, q.shape[0], True)
    drop = {} if seed is None else dict(dropout_p=dropout_p, seed=seed, offset=offset)
    o, lse = cuflash.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window, softcap=cap,
                               alibi_slopes=alibi_slopes, return_lse=True, out=out, **drop)
    mask = (_dense_probs(q, k, dropout_p, seed, offset, causal, softmax_scale, window, cap, alibi_slopes)
            if return_softmax and seed is not None else q.new_empty((0,)))
    return o, lse, mask, _rng_state(q, seed, offset)


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                               alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None, zero_tensors=False, num_splits=0, *, out=None):
    """flash-attn's ``_flash_attn_varlen_forward``: (out, softmax_lse (nheads, total_q), S_dmask,
    rng_state), as :func:`flash_attn_varlen_func` (``seqused_k`` with a ``block_table``);
    ``zero_tensors`` is accepted (cuflash writes every output row). ``leftpad_k`` raises
    NotImplementedError; ``num_splits > 1`` with a ``block_table`` FlashAttnCheckError, as
    flash-attn refuses it."""
    if leftpad_k is not None:
        _not_supported("leftpad_k in a varlen call", "flash_attn_with_kvcache's cache_leftpad serves KV caches")
    if block_table is not None and num_splits > 1:  # (flash-attn's rule, kept for its callers)
        raise FlashAttnCheckError(f"num_splits > 1 is not supported for varlen paged KV, got num_splits={num_splits}")
    if seqused_k is not None:
        if block_table is None:
            _not_supported("seqused_k without a block_table in _flash_attn_varlen_forward",
                           "flash_attn_varlen_func takes it with dense K/V")
        cu_seqlens_k = _seqused_offsets(seqused_k, block_table)
    max_seqlen_q, max_seqlen_k, causal = _int(max_seqlen_q), _int(max_seqlen_k), _flag(causal)
    q, k, v = (_contiguous_last(x) for x in (q, k, v))
    window, cap = _window((window_size_left, window_size_right)), _softcap(softcap)
    batch = cu_seqlens_q.shape[0] - 1
    seed, offset = _draw(validate.dropout_p(dropout_p), q, batch, True)
    drop = {} if seed is None else dict(dropout_p=dropout_p, seed=seed, offset=offset)
    o, lse = cuflash.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                      softmax_scale=softmax_scale, window_size=window, softcap=cap,
                                      alibi_slopes=alibi_slopes, return_lse=True, num_splits=num_splits,
                                      block_table=block_table, out=out, **drop)
    mask = (_varlen_probs(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, seed, offset,
                          causal, softmax_scale, window, cap, alibi_slopes)
            if return_softmax and seed is not None else q.new_empty((0,)))
    return o, lse, mask, _rng_state(q, seed, offset)


def _softmax_d(dout, out, rows, dropout_p):
    """flash-attn's softmax_d, D = (1 - dropout_p) rowsum(dout * out) in float32 (flash-attn keeps
    it scaled by the keep probability): (batch, nheads, seqlen_q rounded up to 128) for dense
    (batch, seqlen_q, nheads, d) operands; for packed (total_q, nheads, d) ones, (nheads, total_q +
    128 * batch) with sequence b's rows from cu_seqlens_q[b] + 128 b (``rows``: (cu_seqlens_q,
    batch)). Padding is zero. Products and sums in float32 (no TF32), taken over views of a few
    million elements at a time, so that no operand is copied whole and the float32 temporaries
    stay small."""
    seq_dim = dout.dim() - 3  # (dense: each batch's rows in turn)
    step = max(1, (1 << 24) // (dout.shape[-2] * dout.shape[-1]))
    parts = [(dout[b][i:i + step].float() * out[b][i:i + step].float()).sum(-1) if seq_dim else
             (dout[i:i + step].float() * out[i:i + step].float()).sum(-1)
             for b in (range(dout.shape[0]) if seq_dim else [None]) for i in range(0, dout.shape[seq_dim], step)]
    d = torch.cat(parts) if parts else dout.new_zeros((0, dout.shape[-2]), dtype=torch.float32)
    d = d.reshape(dout.shape[:-1]) * (1.0 - dropout_p)
    if rows is None:
        sq = d.shape[1]
        return torch.nn.functional.pad(d.transpose(1, 2), (0, -(-sq // 128) * 128 - sq))
    cu, batch = rows
    total, h = d.shape
    seq = torch.searchsorted(cu[1:].long(), torch.arange(total, device=d.device), right=True)
    res = d.new_zeros((h, total + 128 * batch))
    res[:, torch.arange(total, device=d.device) + 128 * seq] = d.t()
    return res


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    """flash-attn's ``_flash_attn_backward``: the gradients into ``dq``, ``dk``, ``dv`` (each may be
    None: then made and, as in flash-attn, not returned); returns softmax_d (_softmax_d). With
    dropout, ``rng_state`` is the forward's."""
    causal = _flag(causal)
    dout, q, k, v, out = (_contiguous_last(x) for x in (dout, q, k, v, out))
    backward_mod.attention_backward(
        dout, q, k, v, out, softmax_lse, causal=causal, softmax_scale=softmax_scale,
        window_size=_window((window_size_left, window_size_right)), softcap=_softcap(softcap),
        alibi_slopes=alibi_slopes, deterministic=deterministic, dq=dq, dk=dk, dv=dv,
        **_seed_offset(dropout_p, rng_state))
    return _softmax_d(dout, out, None, dropout_p)


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
                                window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
                                zero_tensors=False):
    """flash-attn's ``_flash_attn_varlen_backward``: as :func:`_flash_attn_backward` for packed
    sequences; softmax_d (nheads, total_q + 128 * batch)."""
    max_seqlen_q, max_seqlen_k, causal = _int(max_seqlen_q), _int(max_seqlen_k), _flag(causal)
    dout, q, k, v, out = (_contiguous_last(x) for x in (dout, q, k, v, out))
    backward_mod.attention_varlen_backward(
        dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
        softmax_scale=softmax_scale, window_size=_window((window_size_left, window_size_right)),
        softcap=_softcap(softcap), alibi_slopes=alibi_slopes, deterministic=deterministic, dq=dq, dk=dk, dv=dv,
        **_seed_offset(dropout_p, rng_state))
    return _softmax_d(dout, out, (cu_seqlens_q, cu_seqlens_q.shape[0] - 1), dropout_p)


class _FlashAttnGpu:
    """flash-attn's extension module (``flash_attn_gpu``, i.e. flash_attn_2_cuda): ``fwd``,
    ``varlen_fwd``, ``bwd``, ``varlen_bwd`` and ``fwd_kvcache`` with its positional arguments and
    results (lists), on the functions above. The retired ``generator`` slot must be None, as on
    flash-attn's main branch (a RuntimeError otherwise)."""

    @staticmethod
    def fwd(q, k, v, out, alibi_slopes, p_dropout, softmax_scale, is_causal, window_size_left, window_size_right,
            softcap, return_softmax, gen=None):
        _no_generator(gen)
        return list(_flash_attn_forward(q, k, v, p_dropout, softmax_scale, is_causal, window_size_left,
                                        window_size_right, softcap, alibi_slopes, return_softmax, out=out))

    @staticmethod
    def varlen_fwd(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table, alibi_slopes,
                   max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal, window_size_left,
                   window_size_right, softcap, return_softmax, gen=None, num_splits=0):
        _no_generator(gen)
        return list(_flash_attn_varlen_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, is_causal,
            window_size_left, window_size_right, softcap, alibi_slopes, return_softmax, block_table, leftpad_k,
            seqused_k, zero_tensors, num_splits, out=out))

    @staticmethod
    def bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, alibi_slopes, p_dropout, softmax_scale, is_causal,
            window_size_left, window_size_right, softcap, deterministic, gen=None, rng_state=None):
        _no_generator(gen)
        dq, dk, dv = (torch.empty_like(x) if g is None else g for g, x in ((dq, q), (dk, k), (dv, v)))
        d = _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, p_dropout, softmax_scale, is_causal,
                                 window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state)
        return [dq, dk, dv, d]

    @staticmethod
    def varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                   max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal, window_size_left,
                   window_size_right, softcap, deterministic, gen=None, rng_state=None):
        _no_generator(gen)
        dq, dk, dv = (torch.empty_like(x) if g is None else g for g, x in ((dq, q), (dk, k), (dv, v)))
        d = _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                        max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, is_causal,
                                        window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                                        rng_state, zero_tensors)
        return [dq, dk, dv, d]

    @staticmethod
    def fwd_kvcache(q, kcache, vcache, k, v, seqlens_k, rotary_cos, rotary_sin, cache_batch_idx, leftpad_k,
                    block_table, alibi_slopes, out, softmax_scale, is_causal, window_size_left, window_size_right,
                    softcap, is_rotary_interleaved, num_splits):
        kcache, vcache = _cache_rows(q, kcache, vcache, cache_batch_idx, block_table)
        _paged_capacity_check(q, k, kcache, seqlens_k, block_table)
        q, k, v = (_contiguous_last(x) for x in (q, k, v))
        return list(cuflash.attention_with_kvcache(
            q, kcache, vcache, k, v, rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_seqlens=seqlens_k,
            cache_batch_idx=cache_batch_idx, cache_leftpad=leftpad_k, block_table=block_table, causal=is_causal,
            softmax_scale=softmax_scale, num_splits=num_splits, return_lse=True, out=out,
            window_size=_window((window_size_left, window_size_right)), softcap=_softcap(softcap),
            rotary_interleaved=is_rotary_interleaved, alibi_slopes=alibi_slopes))


flash_attn_gpu = _FlashAttnGpu()


# ---------------------------------------------------------------------------------------------
# Names other libraries import from flash-attn's module: the private entry points under the names
# flash-attn gives their torch.library operators (``_wrapped_*``), and its autograd Function
# classes, which they call as ``FlashAttnFunc.apply(...)`` with the arguments of the class's
# forward (those of the function, then is_grad_enabled).

_wrapped_flash_attn_forward = _flash_attn_forward
_wrapped_flash_attn_varlen_forward = _flash_attn_varlen_forward
_wrapped_flash_attn_backward = _flash_attn_backward
_wrapped_flash_attn_varlen_backward = _flash_attn_varlen_backward


@functools.cache
def _arity(fn):
    """flash-attn 2.8's forward arguments of the class of function ``fn``: its positional ones, then
    is_grad_enabled."""
    return 1 + sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in inspect.signature(fn).parameters.values())


class _Applied:
    """``apply(*args, is_grad_enabled)``: the class's function on args (differentiable through
    cuflash.torch), autograd recording only where both is_grad_enabled and the grad mode allow.
    Exactly flash-attn 2.8's arguments (a TypeError otherwise, as its Function's forward raises:
    an older caller's last argument is not taken for is_grad_enabled)."""
    _fn = None

    @classmethod
    def apply(cls, *args):
        if len(args) != _arity(cls._fn):
            raise TypeError(f"{cls.__name__}.apply takes {_arity(cls._fn)} arguments (flash-attn 2.8's: those of "
                            f"{cls._fn.__name__}, then is_grad_enabled), got {len(args)}")
        *args, is_grad_enabled = args
        with torch.set_grad_enabled(bool(is_grad_enabled) and torch.is_grad_enabled()):
            return cls._fn(*args)


class FlashAttnFunc(_Applied):
    """apply(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
    deterministic, return_softmax, is_grad_enabled): :func:`flash_attn_func`."""
    _fn = staticmethod(flash_attn_func)


class FlashAttnKVPackedFunc(_Applied):
    """apply(q, kv, dropout_p, ..., return_softmax, is_grad_enabled): :func:`flash_attn_kvpacked_func`."""
    _fn = staticmethod(flash_attn_kvpacked_func)


class FlashAttnQKVPackedFunc(_Applied):
    """apply(qkv, dropout_p, ..., return_softmax, is_grad_enabled): :func:`flash_attn_qkvpacked_func`."""
    _fn = staticmethod(flash_attn_qkvpacked_func)


class FlashAttnVarlenFunc(_Applied):
    """apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, ...,
    return_softmax, block_table, is_grad_enabled): :func:`flash_attn_varlen_func`."""
    _fn = staticmethod(flash_attn_varlen_func)


class FlashAttnVarlenKVPackedFunc(_Applied):
    """apply(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, ...,
    return_softmax, is_grad_enabled): :func:`flash_attn_varlen_kvpacked_func`."""
    _fn = staticmethod(flash_attn_varlen_kvpacked_func)


class FlashAttnVarlenQKVPackedFunc(_Applied):
    """apply(qkv, cu_seqlens, max_seqlen, dropout_p, ..., return_softmax, is_grad_enabled):
    :func:`flash_attn_varlen_qkvpacked_func`."""
    _fn = staticmethod(flash_attn_varlen_qkvpacked_func)
