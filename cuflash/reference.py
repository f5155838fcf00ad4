"""NumPy reference attention with flash-attn (``flash_attn_func``) semantics.

Layout: q is (batch, seqlen_q, nheads, d); k and v are (batch, seqlen_k, nheads_k, d).
Query head h reads kv head h // (nheads // nheads_k) (GQA / MQA).  Scores are
``s = softmax_scale * q.k`` (scale defaults to d ** -0.5), optionally softcapped
(``softcap * tanh(s / softcap)``), then ALiBi adds ``-slope * |i + sk - sq - j|``.
Masks are aligned bottom-right: query i sees key j iff
``i + sk - sq - left <= j <= i + sk - sq + right`` (-1 = unbounded; causal sets
right = 0).  FlashMask's ``startend_row_indices`` (cuflash.masks: PaddlePaddle's column-wise
row intervals) mask further entries.  A row that sees no key outputs 0 and reports LSE = +inf.
Attention sinks (``sinks``: one logit per query head, gpt-oss / flash-attn's ``s_aux``) join
each row's softmax as one more column with no value, after the scale, softcap, ALiBi and masks:
out_i = sum_j exp(s_ij) v_j / (exp(sink) + sum_j exp(s_ij)), LSE_i = log(exp(sink) +
sum_j exp(s_ij)); a row that sees no key then outputs 0 with LSE = sink.

``precision="float64"`` computes everything in float64.  ``precision="same"``
mimics a fused kernel: float64 scores from the given inputs, row max m,
p = exp(s - m), l = sum of the unrounded p, then p is rounded to q's dtype,
O = (p @ v) / l in float64 and O is finally rounded to q's dtype.  The backward's
``precision="same"`` forms D = rowsum(dO * O) from that same rounded O (see
:func:`attention_backward`).
"""

import ml_dtypes
import numpy as np

# The library's own argument rules (types, window entries >= -1, softcap >= 0 and finite, scale
# positive and finite), so that the reference accepts exactly what cuflash.attention accepts.
from . import masks, validate

__all__ = ["attention", "attention_varlen", "attention_backward", "attention_varlen_backward",
           "max_abs_err", "check_close", "philox4x32", "dropout_keep_mask", "dropout_threshold",
           "dropout_offset_increment", "attention_probs", "attention_fp8"]

_BUDGET = 1 << 22  # max float64 elements of one score block (32 MiB)
_LOW_DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16),
               np.dtype(np.float32), np.dtype(np.float64))


def _validate(q, k, v, alibi_slopes):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name}: expected rank 4 (batch, seqlen, nheads, d), "
                             f"got rank {x.ndim} with shape {x.shape}")
    b, sq, h, d = q.shape
    if d == 0:
        raise ValueError(f"q: expected head dim d > 0, got shape {q.shape}")
    if k.shape[0] != b:
        raise ValueError(f"k: expected batch {b} (from q), got {k.shape[0]}")
    if k.shape[-1] != d:
        raise ValueError(f"k: expected head dim {d} (from q), got {k.shape[-1]}")
    if v.shape != k.shape:
        raise ValueError(f"v: expected shape {k.shape} (same as k), got {v.shape}")
    hk = k.shape[2]
    if hk == 0 or h % hk != 0:
        raise ValueError(f"k: nheads ({h}) must be a multiple of nheads_k, got nheads_k={hk}")
    if alibi_slopes is not None and alibi_slopes.shape not in ((h,), (b, h)):
        raise ValueError(f"alibi_slopes: expected shape ({h},) or ({b}, {h}), "
                         f"got {alibi_slopes.shape}")


def _out_dtype(precision, q):
    """The dtype of the results: float64, or q's dtype for ``precision="same"``."""
    if precision == "float64":
        return np.dtype(np.float64)
    if precision == "same":
        if q.dtype not in _LOW_DTYPES:
            raise ValueError(f"q: precision='same' needs a float16/bfloat16/float32/float64 "
                             f"dtype, got {q.dtype}")
        return q.dtype
    raise ValueError(f"precision: expected 'float64' or 'same', got {precision!r}")


def _check_mods(causal, softmax_scale, window_size, softcap, d):
    """The library's checks of the scalar arguments -> (scale, left, right, softcap); causal sets
    right = 0."""
    validate.boolean(causal, "causal")
    scale = validate.scale(softmax_scale, d)
    left, right = validate.window(window_size)
    return scale, left, 0 if causal else right, validate.softcap(softcap, scale)


class _Args:
    """Validated arguments of a dense call: arrays, result dtype, scale, window and softcap, and
    the ALiBi slopes as float64 (batch, nheads) or None."""

    def __init__(self, q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes, precision,
                 startend_row_indices=None, sinks=None, dropout=None, batch0=0, chunk=0):
        self.q, self.k, self.v = np.asarray(q), np.asarray(k), np.asarray(v)
        self.chunk = validate.attention_chunk(chunk)
        slopes = None if alibi_slopes is None else np.asarray(alibi_slopes, dtype=np.float64)
        _validate(self.q, self.k, self.v, slopes)
        batch, sq, nheads, d = self.q.shape
        self.sinks = _sinks(sinks, nheads)
        self.scale, self.left, self.right, self.softcap = _check_mods(
            causal, softmax_scale, window_size, softcap, d)
        self.causal = causal
        self.flashmask = None if startend_row_indices is None else np.asarray(startend_row_indices)
        if self.flashmask is not None:
            validate.check_startend_row_indices(self.flashmask, batch, nheads, sq, self.k.shape[1], causal,
                                                nheads_k=self.k.shape[2], window=validate.window(window_size))
        self.out_dtype = _out_dtype(precision, self.q)
        self.slopes = None if slopes is None else np.broadcast_to(slopes, (batch, nheads))
        same = precision == "same"
        self.rnd = (lambda x: x.astype(self.out_dtype).astype(np.float64)) if same else (lambda x: x)
        # Dropout: (dropout_p, seed, offset) or None; batch b of these arrays is batch (varlen:
        # sequence) batch0 + b of the call whose mask is regenerated.
        self.dropout, self.batch0 = dropout, batch0
        self.rp = 1.0 if dropout is None else 1.0 / (1.0 - dropout[0])

    def keep(self, b, hs, i0, i1, sk):
        """The dropout mask Z (1.0 = kept, 0.0 = dropped) of query rows i0:i1, keys 0:sk of query
        heads ``hs`` in batch b, as (G, r, sk) float64; the scalar 1.0 without dropout."""
        if self.dropout is None:
            return 1.0
        p, seed, offset = self.dropout
        nheads = self.q.shape[2]
        return np.stack([dropout_keep_mask(seed, offset, self.batch0 + b, h, nheads, range(i0, i1), range(sk), p)
                         for h in range(nheads)[hs]]).astype(np.float64)

    def blocks(self):
        """Per (batch b, KV head g, block of query rows i0:i1): b, g, the query heads hs of g,
        i0, i1, and in float64 qg (G, r, d), kg and vg (sk, d), the masked scores s (G, r, sk)
        and the softcap's derivative (see :func:`_scores`)."""
        q, k, v = self.q, self.k, self.v
        batch, sq, nheads, _ = q.shape
        sk, nheads_k = k.shape[1], k.shape[2]
        group = nheads // nheads_k
        if sk == 0 or sq == 0:
            return
        rows = max(1, _BUDGET // (group * sk))  # query rows per block
        for b in range(batch):
            for g in range(nheads_k):
                hs = slice(g * group, (g + 1) * group)
                kg = k[b, :, g].astype(np.float64)  # (sk, d)
                vg = v[b, :, g].astype(np.float64)
                slopes = None if self.slopes is None else self.slopes[b, hs]
                for i0 in range(0, sq, rows):
                    i1 = min(sq, i0 + rows)
                    qg = q[b, i0:i1, hs].astype(np.float64).transpose(1, 0, 2)  # (G, r, d)
                    s, dcap = _scores(qg, kg, self.scale, self.softcap, slopes, i0, i1, sq, sk,
                                      self.left, self.right, self._flashmask(b, g, hs, i0, i1), self.chunk)
                    yield b, g, hs, i0, i1, qg, kg, vg, s, dcap

    def sink(self, hs):
        """The sinks of query heads ``hs`` as (G, 1, 1) float64, or None."""
        return None if self.sinks is None else self.sinks[hs, None, None]

    def _flashmask(self, b, g, hs, i0, i1):
        """FlashMask's dense mask of query rows i0:i1 for KV head g's query heads hs, (G or 1, r,
        sk), True = masked; None without startend_row_indices. The indices' heads are the query
        heads, the KV heads or one for all."""
        x = self.flashmask
        if x is None:
            return None
        nheads, nheads_k = self.q.shape[2], self.k.shape[2]
        heads = hs if x.shape[1] == nheads else slice(g, g + 1) if x.shape[1] == nheads_k else slice(0, 1)
        return masks.to_dense(x[b:b + 1, heads], self.q.shape[1], self.causal, rows=(i0, i1))[0]


def _scores(qg, kg, scale, softcap, slopes, i0, i1, sq, sk, left, right, masked=None, chunk=0):
    """Masked scores (G, r, sk) of query rows i0:i1 of a KV head's group, and the softcap's
    derivative d(softcap * t) / d(scale * q.k) = 1 - t^2 (1.0 without a softcap). ``masked``
    (True = masked, broadcast to (G, r, sk)) hides more entries (FlashMask); ``chunk`` > 0 hides
    the keys outside each row's chunk (attention_chunk)."""
    s = np.matmul(qg, kg.T) * scale
    dcap = 1.0
    if softcap > 0:
        t = np.tanh(s / softcap)
        s, dcap = softcap * t, 1.0 - t * t
    j = np.arange(sk)
    diag = (np.arange(i0, i1) + sk - sq)[:, None]  # key aligned with row i
    if slopes is not None:
        s = s - slopes[:, None, None] * np.abs(diag - j)
    visible = np.ones((i1 - i0, sk), dtype=bool)
    if left >= 0:
        visible &= j >= diag - left
    if right >= 0:
        visible &= j <= diag + right
    if chunk:
        start = diag - diag % chunk  # floor to the chunk (Python's % is non-negative for chunk > 0)
        visible &= (j >= start) & (j < start + chunk)
    if masked is not None:
        visible = visible & ~masked
    return np.where(visible, s, -np.inf), dcap


def _sinks(sinks, nheads):
    """Attention sinks as float64 (nheads,), or None, with the library's rules (validate.sinks:
    float32, bfloat16 or float16, shape (nheads,), finite), float64 allowed as for q."""
    if sinks is None:
        return None
    a = np.asarray(sinks)
    if a.dtype not in _LOW_DTYPES:
        raise TypeError(f"sinks must be float32, bfloat16 or float16 (float64 in the reference), got {a.dtype}")
    if a.shape != (nheads,):
        raise ValueError(f"sinks must have shape (nheads,) = ({nheads},), got {a.shape}")
    a = a.astype(np.float64)
    if not np.isfinite(a).all():
        h = int(np.argmax(~np.isfinite(a)))
        raise ValueError(f"sinks must be finite, got {a[h]} at head {h}")
    return a


def _softmax_parts(s, sink=None):
    """Row max m (0 for rows that see no key), p = exp(s - m) (0 where masked) and l = sum(p).
    ``sink`` (G, 1, 1): each row's softmax has one more column, the sink, with no value: m is at
    least the sink and l gains exp(sink - m), which a fused kernel adds unrounded (no P V term)."""
    m = s.max(axis=-1, keepdims=True)
    if sink is not None:
        m = np.maximum(m, sink)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    return m, p, (l if sink is None else l + np.exp(sink - m))


def _output(p, l, vg, rnd, rp=1.0):
    """The forward's output before its final rounding: (rnd(p) @ v) / l from p = exp(s - m) and
    the unrounded l = sum(p), as a fused kernel rounds p for its P V product (rows with l = 0
    give 0; NaN scores propagate, as in FA2). With dropout p arrives with the dropped elements
    zeroed (l still sums them all) and ``rp`` = 1 / (1 - dropout_p) scales O with 1 / l, as the
    kernel does in its epilogue."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(l == 0, 0.0, np.matmul(rnd(p), vg) / l * rp)


def attention(q, k, v, *, causal=False, softmax_scale=None, return_lse=False,
              window_size=(-1, -1), softcap=0.0, alibi_slopes=None, precision="float64",
              startend_row_indices=None, sinks=None, dropout_p=0.0, seed=None, offset=0, batch0=0,
              attention_chunk=0):
    """Reference attention; returns out (like q) or (out, lse) with lse (batch, nheads, seqlen_q).

    Arguments follow cuflash.attention's rules: ``causal`` a bool, ``softmax_scale`` None or a
    positive finite real, ``window_size`` a pair of ints >= -1, ``softcap`` a finite real >= 0;
    anything else raises TypeError (wrong type) or ValueError (bad value).
    ``startend_row_indices`` is FlashMask's int32 (batch, 1 or nheads_k or nheads, seqlen_k, n)
    mask (cuflash.masks; not combined with a window, as in Paddle), which cuflash.attention does
    not run yet: the reference applies it for tests. ``sinks``: attention sinks, (nheads,) float32,
    bfloat16 or float16 (see the module's docstring); rows that see no key then report LSE = sink.
    ``dropout_p`` > 0 (with ``seed`` and ``offset``, see dropout_keep_mask) drops elements of the
    probabilities P after the softmax and scales the kept ones by 1 / (1 - dropout_p), as
    flash-attn does: out = (P Z / (1 - dropout_p)) v with the mask Z regenerated from (seed,
    offset, batch0 + b, h, i, j); the LSE is the softmax's (dropout does not change it).
    ``attention_chunk`` = c > 0: row i sees only keys c * floor((i + sk - sq) / c) ... + c - 1 (within
    its causal mask or window), as FlashAttention-3's attention_chunk.
    """
    a = _Args(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes, precision,
              startend_row_indices, sinks, _dropout_tuple(dropout_p, seed, offset), batch0, attention_chunk)
    batch, sq, nheads, d = a.q.shape
    out = np.zeros((batch, sq, nheads, d), dtype=np.float64)
    lse = np.full((batch, nheads, sq), np.inf, dtype=np.float64)
    if a.sinks is not None:  # no key at all (seqlen_k = 0): only the sink
        lse[...] = a.sinks[None, :, None]
    for b, _, hs, i0, i1, _, _, vg, s, _ in a.blocks():
        m, p, l = _softmax_parts(s, a.sink(hs))
        with np.errstate(divide="ignore"):  # rows that see no key: LSE = +inf
            lse[b, hs, i0:i1] = np.where(l == 0, np.inf, m + np.log(l))[..., 0]
        out[b, i0:i1, hs] = _output(p * a.keep(b, hs, i0, i1, s.shape[-1]), l, vg, a.rnd, a.rp).transpose(1, 0, 2)
    out = out.astype(a.out_dtype)
    lse_dtype = np.float64 if precision == "float64" else np.float32
    return (out, lse.astype(lse_dtype)) if return_lse else out


def attention_fp8(q, k, v, *, causal=False, softmax_scale=None, q_descale=None, k_descale=None, v_descale=None,
                  return_lse=False, precision="float64", rescale_slack=0):
    """Reference of cuflash.attention's FP8 forward: q, k, v e4m3 arrays (ml_dtypes.float8_e4m3fn;
    their values are used exactly), descales (batch, nheads_k) (a dim of 1 broadcasts; None: 1).
    Scores (q . k) * q_descale * k_descale * softmax_scale, causal bottom-right, out = P V *
    v_descale / l. ``precision="float64"``: all in float64, out float64; ``"same"`` mimics the
    kernel's roundings: an online softmax over blocks of 128 keys walked from the last block down
    (the kernel's order), p = exp(s - running max) rounded to e4m3 for P V, l summed from the
    unrounded p, out rounded to bfloat16 (arithmetic otherwise in float64); with ``rescale_slack``
    (the kernel variant's), a row's running maximum moves only when it grows by more than
    2^rescale_slack. Returns out, or (out, lse) (float64, natural log, +inf for rows that see no
    key)."""
    if precision not in ("float64", "same"):
        raise ValueError(f"precision must be 'float64' or 'same', got {precision!r}")
    q64, k64, v64 = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    b, sq, h, d = q64.shape
    sk, hk = k64.shape[1], k64.shape[2]
    if k64.shape != (b, sk, hk, d) or v64.shape != k64.shape or h % hk:
        raise ValueError(f"shapes q {q64.shape}, k {k64.shape}, v {v64.shape}: k and v alike, nheads a multiple of "
                         "nheads_k")
    scale = validate.scale(softmax_scale, d)
    ones = np.ones((b, hk))
    qd, kd, vd = (ones if x is None else np.broadcast_to(np.asarray(x, dtype=np.float64), (b, hk))
                  for x in (q_descale, k_descale, v_descale))
    out = np.zeros((b, sq, h, d))
    lse = np.full((b, h, sq), np.inf)
    visible = np.ones((sq, sk), dtype=bool)
    if causal:
        visible = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
    for bi in range(b):
        for hi in range(h):
            g = hi // (h // hk)
            s = np.where(visible, (q64[bi, :, hi] @ k64[bi, :, g].T) * (scale * qd[bi, g] * kd[bi, g]), -np.inf)
            if precision == "same":
                m, l, acc = np.full((sq, 1), -np.inf), np.zeros((sq, 1)), np.zeros((sq, d))
                for j0 in range(-(-sk // 128) * 128 - 128, -1, -128):
                    sj = s[:, j0:j0 + 128]
                    m_new = np.maximum(m, sj.max(axis=1, keepdims=True))
                    if rescale_slack:
                        with np.errstate(invalid="ignore"):
                            m_new = np.where(m_new - m <= rescale_slack * np.log(2), m, m_new)
                    m_use = np.where(np.isfinite(m_new), m_new, 0.0)
                    alpha = np.exp(np.where(np.isfinite(m), m - m_use, -np.inf))
                    p = np.exp(sj - m_use)
                    l = l * alpha + p.sum(axis=1, keepdims=True)
                    acc = acc * alpha + p.astype(ml_dtypes.float8_e4m3fn).astype(np.float64) @ v64[bi, j0:j0 + 128, g]
                    m = m_new
                m = np.where(np.isfinite(m), m, 0.0)
            else:
                m = s.max(axis=1, initial=-np.inf, keepdims=True)
                m = np.where(np.isfinite(m), m, 0.0)
                p = np.exp(s - m)
                l = p.sum(axis=1, keepdims=True)
                acc = p @ v64[bi, :, g]
            with np.errstate(divide="ignore", invalid="ignore"):
                out[bi, :, hi] = np.where(l > 0, acc * vd[bi, g] / l, 0.0)
                lse[bi, hi] = np.where(l[:, 0] > 0, m[:, 0] + np.log(l[:, 0]), np.inf)
    if precision == "same":
        out = out.astype(ml_dtypes.bfloat16)
    return (out, lse) if return_lse else out


def apply_rotary(x, cos, sin, positions, interleaved=True):
    """flash-attn's rotary embedding (``rotary_cos``/``rotary_sin`` of flash_attn_with_kvcache) in
    float64. x: (batch, seqlen, nheads, d); cos, sin: (seqlen_ro, rotary_dim / 2); positions: ints
    (batch, seqlen), row i of sequence b being rotated by cos/sin[positions[b, i]]. The first
    rotary_dim columns rotate: pairs (2f, 2f + 1) when ``interleaved`` (GPT-J), (f, f +
    rotary_dim / 2) otherwise (GPT-NeoX), as (a, b) -> (a cos - b sin, b cos + a sin); the other
    columns pass through. Returns float64."""
    x = np.asarray(x).astype(np.float64)
    cos, sin = np.asarray(cos).astype(np.float64), np.asarray(sin).astype(np.float64)
    if cos.ndim != 2 or sin.shape != cos.shape or 2 * cos.shape[1] > x.shape[-1]:
        raise ValueError(f"cos and sin must have one shape (seqlen_ro, rotary_dim / 2) with rotary_dim <= "
                         f"{x.shape[-1]}, got {cos.shape} and {sin.shape}")
    positions = np.asarray(positions)
    if positions.shape != x.shape[:2] or positions.min(initial=0) < 0 or positions.max(initial=0) >= cos.shape[0]:
        raise ValueError(f"positions must be (batch, seqlen) = {x.shape[:2]} in [0, {cos.shape[0]}), "
                         f"got shape {positions.shape}")
    rd = 2 * cos.shape[1]
    c, s = cos[positions][:, :, None, :], sin[positions][:, :, None, :]
    lo, hi = (slice(0, rd, 2), slice(1, rd, 2)) if interleaved else (slice(0, rd // 2), slice(rd // 2, rd))
    out = x.copy()
    a, b = x[..., lo], x[..., hi]
    out[..., lo] = a * c - b * s
    out[..., hi] = b * c + a * s
    return out


def max_abs_err(a, b) -> float:
    """max |a - b| computed in float64; any NaN (or inf - inf) gives inf."""
    diff = np.abs(np.asarray(a).astype(np.float64) - np.asarray(b).astype(np.float64))
    if diff.size == 0:
        return 0.0
    if np.isnan(diff).any():
        return float("inf")
    return float(diff.max())


def check_close(out, q, k, v, *, rtol_factor=2.0, atol=1e-5, **kwargs):
    """flash-attn's test rule: |out - ref64| <= rtol_factor * |ref_lp - ref64| + atol.

    Returns (ok, err, bound); ``kwargs`` are forwarded to :func:`attention` (and checked by it).
    """
    out, q = np.asarray(out), np.asarray(q)
    if out.shape != q.shape:
        raise ValueError(f"out: expected shape {q.shape} (same as q), got {out.shape}")
    kwargs.pop("return_lse", None)
    ref64 = attention(q, k, v, precision="float64", **kwargs)
    ref_lp = attention(q, k, v, precision="same", **kwargs)
    err = max_abs_err(out, ref64)
    bound = rtol_factor * max_abs_err(ref_lp, ref64) + atol
    return bool(err <= bound), err, float(bound)


def _sequences(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, precision, mods):
    """Packed arguments, checked up front (also when no sequence will be attended) -> q, k, v as
    arrays, the result dtype and per sequence (its q rows, its k rows, its ALiBi slopes)."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    cq, ck = np.asarray(cu_seqlens_q, dtype=np.int64), np.asarray(cu_seqlens_k, dtype=np.int64)
    if cq.shape != ck.shape or cq.ndim != 1 or cq.size < 1:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must be (batch + 1,) vectors, got "
                         f"{cq.shape} and {ck.shape}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError(f"{name}: expected rank 3 (total, nheads, d), "
                             f"got rank {x.ndim} with shape {x.shape}")
    _validate(q[None], k[None], v[None], None)
    _check_mods(d=q.shape[-1], **mods)
    out_dtype = _out_dtype(precision, q)
    batch, h = cq.size - 1, q.shape[1]
    slopes = None if alibi_slopes is None else np.asarray(alibi_slopes, dtype=np.float64)
    if slopes is not None and slopes.shape not in ((h,), (batch, h)):
        raise ValueError(f"alibi_slopes: expected shape ({h},) or ({batch}, {h}), got {slopes.shape}")
    seqs = [(slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1]),
             None if slopes is None else (slopes if slopes.ndim == 1 else slopes[b])) for b in range(batch)]
    return q, k, v, out_dtype, seqs


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, softmax_scale=None,
                     return_lse=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                     precision="float64", sinks=None, dropout_p=0.0, seed=None, offset=0, attention_chunk=0):
    """Reference for packed variable-length batches (flash-attn's ``flash_attn_varlen_func``).

    q is (total_q, nheads, d), k and v (total_k, nheads_k, d); sequence b holds rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and cu_seqlens_k[b]:cu_seqlens_k[b+1] of k and v.
    Every sequence is attended independently (causal and windows aligned bottom-right per
    sequence); rows of empty sequences do not exist. Returns out (like q) or (out, lse) with
    lse (nheads, total_q). ``alibi_slopes`` may be (nheads,) or (batch, nheads); the other
    keyword arguments are those of :func:`attention` (dropout: sequence b is batch b of the mask).
    """
    mods = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap)
    q, k, v, out_dtype, seqs = _sequences(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, precision, mods)
    _sinks(sinks, q.shape[1])
    out = np.zeros(q.shape, dtype=out_dtype)
    lse = np.full((q.shape[1], q.shape[0]), np.inf,
                  dtype=np.float64 if precision == "float64" else np.float32)
    for b, (qs, ks, s) in enumerate(seqs):
        o, l = attention(q[None, qs], k[None, ks], v[None, ks], return_lse=True, alibi_slopes=s,
                         precision=precision, sinks=sinks, dropout_p=dropout_p, seed=seed, offset=offset,
                         batch0=b, attention_chunk=attention_chunk, **mods)
        out[qs], lse[:, qs] = o[0], l[0]
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                       softcap=0.0, alibi_slopes=None, precision="float64", startend_row_indices=None,
                       sinks=None, dropout_p=0.0, seed=None, offset=0, batch0=0, attention_chunk=0):
    """Reference gradients (dq, dk, dv) of :func:`attention` (same masking, FlashMask's
    ``startend_row_indices`` and ``attention_chunk`` included, score and argument rules) for the output gradient
    ``dout`` (shaped like q); with ``sinks``, (dq, dk, dv, dsinks).

    With s the scores after softcap and ALiBi, P = exp(s - lse) (0 where masked and on rows
    that see no key), O = P v and D = rowsum(dout * O): dv = P^T dout, dP = dout v^T,
    dS = P (dP - D), and with a softcap (t = tanh(scale q.k / softcap)) dS *= 1 - t^2;
    dq = scale dS k, dk = scale dS^T q. The ALiBi bias has no gradient. With GQA a KV head's dk,
    dv are summed over its query heads. With attention sinks the LSE holds the sink, and the
    formulas above are unchanged (the sink's column has no value: it adds nothing to O or dP);
    the sink's own probability P_i = exp(sink - lse_i) gives dsinks = -sum over batch and rows
    of P_i D_i (d out_i / d sink = -P_i out_i).
    With dropout (``dropout_p``, ``seed``, ``offset``, ``batch0`` as in :func:`attention`, the
    same mask Z): O = (P Zs) v with Zs = Z / (1 - dropout_p), so dv = (P Zs)^T dout and
    dL/dP = Zs dP; the softmax's backward gives dS = P (Zs dP - D), where D = rowsum(dout * O)
    = sum_j P_j Zs_j dP_j, since O already holds the dropout (flash-attn's backward).
    ``precision="float64"`` computes everything in float64 and returns float64.
    ``precision="same"`` mimics a fused kernel: D is formed from the output that the forward
    stores, i.e. that of ``attention(..., precision="same")`` (p = exp(s - m) rounded to q's
    dtype before the P V product, divided by the unrounded row sum, the result rounded to q's
    dtype); P is rounded to q's dtype for dv, dS is rounded to q's dtype for dq and dk,
    accumulation is float64 and the gradients are rounded to q's dtype (dsinks to the sinks'
    dtype, from D of that rounded output). (The forward's rounding
    of p matters in D: with few keys per row, dS = P (dP - D) cancels and D's error is the
    gradients' largest; scripts/bwd_rounding_study.py measures it.)
    """
    a = _Args(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes, precision,
              startend_row_indices, sinks, _dropout_tuple(dropout_p, seed, offset), batch0, attention_chunk)
    grads = _backward(a, dout)
    out = tuple(g.astype(a.out_dtype) for g in grads[:3])
    return out if sinks is None else (*out, _sink_grad(grads[3], sinks, precision))


def _sink_grad(dsinks, sinks, precision):
    """float64 dsinks as returned: float64, or in the sinks' dtype for ``precision="same"``."""
    return dsinks if precision == "float64" else dsinks.astype(np.asarray(sinks).dtype)


def _backward(a, dout):
    """float64 (dq, dk, dv, dsinks or None) of the call ``a`` (an _Args) for ``dout``."""
    dout = np.asarray(dout)
    if dout.shape != a.q.shape:
        raise ValueError(f"dout: expected shape {a.q.shape} (same as q), got {dout.shape}")
    rnd, scale = a.rnd, a.scale
    dq = np.zeros(a.q.shape, dtype=np.float64)
    dk = np.zeros(a.k.shape, dtype=np.float64)
    dv = np.zeros(a.v.shape, dtype=np.float64)
    dsinks = None if a.sinks is None else np.zeros(a.sinks.shape)
    for b, g, hs, i0, i1, qg, kg, vg, s, dcap in a.blocks():
        dog = dout[b, i0:i1, hs].astype(np.float64).transpose(1, 0, 2)
        sink = a.sink(hs)
        m, p, l = _softmax_parts(s, sink)
        z = a.keep(b, hs, i0, i1, s.shape[-1])
        o = rnd(_output(p * z, l, vg, rnd, a.rp))  # the forward's output (stored in q's dtype)
        with np.errstate(divide="ignore", invalid="ignore"):
            p = np.where(l == 0, 0.0, p / l)  # exp(s - lse); empty rows give 0
        dsum = (dog * o).sum(axis=-1, keepdims=True)
        if sink is not None:  # the sink's probability exp(sink - lse) times D, over the rows
            dsinks[hs] -= (np.exp(sink - m) / l * dsum).sum(axis=(1, 2))
        zs = z * a.rp  # Z / (1 - dropout_p)
        dv[b, :, g] += np.matmul(rnd(p * zs).transpose(0, 2, 1), dog).sum(axis=0)
        dp = np.matmul(dog, vg.T)
        ds = rnd(p * (zs * dp - dsum) * dcap)
        dq[b, i0:i1, hs] = (scale * np.matmul(ds, kg)).transpose(1, 0, 2)
        dk[b, :, g] += scale * np.matmul(ds.transpose(0, 2, 1), qg).sum(axis=0)
    return dq, dk, dv, dsinks


def attention_varlen_backward(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False,
                              softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, precision="float64", sinks=None, dropout_p=0.0, seed=None,
                              offset=0, attention_chunk=0):
    """Reference gradients (dq, dk, dv) of :func:`attention_varlen` for packed sequences: q, dout
    (total_q, nheads, d), k, v (total_k, nheads_k, d); every sequence is differentiated on its
    own (causal and windows aligned per sequence). Rows of k and v outside every sequence get
    zero gradient. ``alibi_slopes`` may be (nheads,) or (batch, nheads); the other keyword
    arguments are those of :func:`attention_backward` (with ``sinks``, (dq, dk, dv, dsinks),
    dsinks summed over the sequences).
    """
    mods = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap)
    q, k, v, out_dtype, seqs = _sequences(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, precision, mods)
    dsinks = _sinks(sinks, q.shape[1])
    dsinks = None if dsinks is None else np.zeros_like(dsinks)
    dout = np.asarray(dout)
    if dout.shape != q.shape:
        raise ValueError(f"dout: expected shape {q.shape} (same as q), got {dout.shape}")
    grads = [np.zeros(x.shape, dtype=out_dtype) for x in (q, k, v)]
    drop = _dropout_tuple(dropout_p, seed, offset)
    for b, (qs, ks, s) in enumerate(seqs):
        g = _backward(_Args(q[None, qs], k[None, ks], v[None, ks], causal, softmax_scale, window_size, softcap, s,
                            precision, sinks=sinks, dropout=drop, batch0=b, chunk=attention_chunk), dout[None, qs])
        for out, x, sl in zip(grads, g, (qs, ks, ks)):
            out[sl] = x[0]
        if dsinks is not None:
            dsinks += g[3]
    grads = tuple(grads)
    return grads if sinks is None else (*grads, _sink_grad(dsinks, sinks, precision))


# ---------------------------------------------------------------------------------------------
# Attention dropout: the element -> random-number mapping (templates/common/dropout.cuh is the
# same rule in CUDA; the two must change together).
#
# Random numbers come from Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as
# 1, 2, 3", SC'11; Random123), a counter-based generator: one call maps a 128-bit counter and a
# 64-bit key to four 32-bit words, so any element's bits can be recomputed anywhere, in any order.
# A dropout call has a 64-bit ``seed`` (the key: low word, high word) and a 64-bit ``offset``.
# Element (query row i, key j) of (batch b, query head h) of a call with nheads query heads
# takes its 16 bits from the call with counter
#     c0 = (j // 16) * 32 + (i % 8) * 4 + (j % 8) // 2
#     c1 = i // 16
#     (c2, c3) = low and high words of the 64-bit sum offset + b * nheads + h (mod 2^64)
# namely word ((i % 16) // 8) * 2 + (j % 16) // 8 of the four, its low 16 bits for even j and its
# high 16 bits for odd j. The element is kept iff those bits are below the threshold
# keep = round((1 - dropout_p) * 65536) (so it is kept with probability keep / 65536), and a
# kept element is scaled by 1 / (1 - dropout_p) as in flash-attn. b is the sequence index of a
# varlen batch, i and j count from each sequence's first query and key. The mapping depends on
# nothing else: not on tiles, warps or which kernel runs, so the forward and every backward
# kernel regenerate the same mask. It is built so that one lane of an mma.sync m16n8k16
# accumulator (rows g, g + 8 and keys 2t, 2t + 1 of two n8 tiles: lane = 4 g + t) needs exactly
# one call per 16 x 16 block of P; a call's offsets then advance by at least batch * nheads
# (dropout_offset_increment) so that successive calls never reuse a counter.

PHILOX_M = (0xD2511F53, 0xCD9E8D57)   # Philox4x32 multipliers
PHILOX_W = (0x9E3779B9, 0xBB67AE85)   # Weyl key increments (golden ratio, sqrt(3) - 1)
_U32 = np.uint64(0xFFFFFFFF)


def philox4x32(counter, key, rounds=10):
    """Philox4x32-``rounds`` in NumPy uint32 arithmetic: ``counter`` (..., 4) and ``key`` (..., 2)
    unsigned 32-bit words (broadcast together) -> (..., 4) uint32. Each round: (hi0, lo0) =
    M0 * c0, (hi1, lo1) = M1 * c2 (64-bit products), c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0);
    the key gains (W0, W1) between rounds."""
    c = np.asarray(counter, dtype=np.uint64) & _U32
    k = np.asarray(key, dtype=np.uint64) & _U32
    if c.shape[-1:] != (4,) or k.shape[-1:] != (2,):
        raise ValueError(f"counter must be (..., 4) and key (..., 2) words, got {c.shape} and {k.shape}")
    shape = np.broadcast_shapes(c.shape[:-1], k.shape[:-1])
    c0, c1, c2, c3 = (np.broadcast_to(c[..., n], shape).copy() for n in range(4))
    k0, k1 = (np.broadcast_to(k[..., n], shape).copy() for n in range(2))
    m0, m1 = np.uint64(PHILOX_M[0]), np.uint64(PHILOX_M[1])
    for r in range(rounds):
        if r:
            k0 = (k0 + np.uint64(PHILOX_W[0])) & _U32
            k1 = (k1 + np.uint64(PHILOX_W[1])) & _U32
        p0, p1 = m0 * c0, m1 * c2  # < 2^64: exact in uint64
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _U32, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _U32
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


def dropout_threshold(dropout_p) -> int:
    """The 16-bit keep threshold of ``dropout_p``: an element is kept iff its 16 random bits are
    below it (probability threshold / 65536)."""
    return int(round((1.0 - float(dropout_p)) * 65536.0))


def dropout_offset_increment(batch: int, nheads: int) -> int:
    """How far a dropout call's offset must advance for the next call to share no counter with
    it: batch * nheads (rounded up to a multiple of 4, as PyTorch's Philox offsets are)."""
    return -(-batch * nheads // 4) * 4


def _u64(x, name):
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) or not 0 <= int(x) < 1 << 64:
        raise ValueError(f"{name} must be an int in [0, 2**64), got {x!r}")
    return int(x)


def dropout_keep_mask(seed, offset, b, h, nheads, rows, cols, dropout_p):
    """The dropout mask (True = kept) of query rows ``rows`` and keys ``cols`` (int arrays or
    ranges: positions within the sequence) of batch (or varlen sequence) ``b``, query head ``h``
    of a call with ``nheads`` query heads, as (len(rows), len(cols)) bool (see the mapping above)."""
    seed, offset = _u64(seed, "seed"), _u64(offset, "offset")
    i = np.asarray(rows, dtype=np.uint64)[:, None]
    j = np.asarray(cols, dtype=np.uint64)[None, :]
    hi = (offset + int(b) * int(nheads) + int(h)) & ((1 << 64) - 1)
    c0 = (j // 16) * np.uint64(32) + (i % 8) * np.uint64(4) + (j % 8) // 2
    c1 = np.broadcast_to(i // 16, c0.shape)
    ctr = np.stack([c0, c1, np.full(c0.shape, hi & 0xFFFFFFFF, np.uint64),
                    np.full(c0.shape, hi >> 32, np.uint64)], axis=-1)
    words = philox4x32(ctr, np.array([seed & 0xFFFFFFFF, seed >> 32], dtype=np.uint64))
    w = ((i % 16) // 8) * 2 + (j % 16) // 8
    word = np.take_along_axis(words, np.broadcast_to(w, c0.shape)[..., None].astype(np.int64), axis=-1)[..., 0]
    bits = (word.astype(np.uint64) >> ((j % 2) * np.uint64(16))) & np.uint64(0xFFFF)
    return bits < np.uint64(dropout_threshold(dropout_p))


def _dropout_tuple(dropout_p, seed, offset):
    """(dropout_p, seed, offset) checked with the library's rules, or None for dropout_p = 0."""
    p = validate.dropout_p(dropout_p)
    if p == 0.0:
        return None
    if seed is None:
        raise ValueError("dropout_p > 0 needs seed (an int in [0, 2**64)): the mask is a function of it")
    return p, _u64(seed, "seed"), _u64(offset, "offset")


def attention_probs(q, k, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, dropout_p=0.0, seed=None, offset=0, batch0=0, block_n=None):
    """The attention probabilities P = softmax(scores) of :func:`attention` as float64 (batch,
    nheads, seqlen_q, seqlen_k) (0 where masked and on rows that see no key), with flash-attn's
    ``S_dmask`` convention for dropout: a dropped element is negated, so ``P >= 0`` is the mask
    (kept, including the zeros of masked positions) and ``abs(P)`` the probabilities before
    dropout.

    ``block_n``: give flash-attn's unnormalised magnitudes instead, exp(s - m_j) for the keys of
    block j (blocks of ``block_n`` keys from key 0), m_j being the maximum of the row's scores over
    blocks j and later: flash-attn's kernel visits the key blocks from the last one down and
    stores P relative to its running maximum (its tests' normalize_flash_attn_S undoes that)."""
    v = np.asarray(k)  # shapes only: P does not depend on v
    a = _Args(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes, "float64",
              dropout=_dropout_tuple(dropout_p, seed, offset), batch0=batch0)
    batch, sq, nheads, _ = a.q.shape
    out = np.zeros((batch, nheads, sq, a.k.shape[1]), dtype=np.float64)
    for b, _, hs, i0, i1, _, _, _, s, _ in a.blocks():
        if block_n:
            sk = s.shape[-1]
            nb = -(-sk // block_n)
            pad = np.pad(s, [(0, 0)] * (s.ndim - 1) + [(0, nb * block_n - sk)], constant_values=-np.inf)
            m = pad.reshape(*s.shape[:-1], nb, block_n).max(axis=-1)
            m = np.maximum.accumulate(m[..., ::-1], axis=-1)[..., ::-1]  # max over blocks j..
            m = np.where(np.isfinite(m), m, 0.0)
            p = np.exp(s - np.repeat(m, block_n, axis=-1)[..., :sk])
        else:
            _, p, l = _softmax_parts(s)
            with np.errstate(divide="ignore", invalid="ignore"):
                p = np.where(l == 0, 0.0, p / l)
        z = a.keep(b, hs, i0, i1, s.shape[-1])
        out[b, hs, i0:i1] = np.where(np.asarray(z) != 0, p, -p)
    return out
