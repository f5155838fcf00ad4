"""Tests for cuflash.reference (CPU only, NumPy)."""

import math

import ml_dtypes
import numpy as np
import pytest

from cuflash.reference import attention, check_close, max_abs_err


def _qkv(seed, b=2, sq=5, sk=7, h=4, hk=None, d=8, dtype=np.float64):
    rng = np.random.default_rng(seed)
    hk = h if hk is None else hk
    q = rng.standard_normal((b, sq, h, d)).astype(dtype)
    k = rng.standard_normal((b, sk, hk, d)).astype(dtype)
    v = rng.standard_normal((b, sk, hk, d)).astype(dtype)
    return q, k, v


def _naive(q, k, v, causal=False, scale=None, window=(-1, -1), softcap=0.0, alibi=None):
    """Per-(b, h, i) loop: softmax(q k^T * scale + mask) v, plus log-sum-exp."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    b_, sq, h_, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    left, right = window
    if causal:
        right = 0
    out = np.zeros(q.shape)
    lse = np.full((b_, h_, sq), np.inf)
    for b in range(b_):
        for h in range(h_):
            kh = h // (h_ // hk)
            for i in range(sq):
                scores, vals = [], []
                for j in range(sk):
                    c = i + sk - sq
                    if (left >= 0 and j < c - left) or (right >= 0 and j > c + right):
                        continue
                    s = float(q[b, i, h] @ k[b, j, kh]) * scale
                    if softcap > 0:
                        s = softcap * math.tanh(s / softcap)
                    if alibi is not None:
                        slope = alibi[h] if alibi.ndim == 1 else alibi[b, h]
                        s -= float(slope) * abs(c - j)
                    scores.append(s)
                    vals.append(v[b, j, kh])
                if not scores:
                    continue
                mx = max(scores)
                w = np.exp(np.array(scores) - mx)
                out[b, i, h] = (w[:, None] * np.array(vals)).sum(0) / w.sum()
                lse[b, h, i] = mx + math.log(w.sum())
    return out, lse


def _compare(seed, qkv_kw=None, **kw):
    q, k, v = _qkv(seed, **(qkv_kw or {}))
    out, lse = attention(q, k, v, return_lse=True, **kw)
    naive_kw = {"causal": kw.get("causal", False), "scale": kw.get("softmax_scale"),
                "window": kw.get("window_size", (-1, -1)), "softcap": kw.get("softcap", 0.0),
                "alibi": kw.get("alibi_slopes")}
    ref_out, ref_lse = _naive(q, k, v, **naive_kw)
    assert out.dtype == np.float64 and out.shape == q.shape
    assert lse.dtype == np.float64 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(ref_lse))
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-12)
    return out, lse


def test_noncausal():
    _compare(0)


def test_causal_sq_lt_sk():
    _compare(1, dict(sq=3, sk=9), causal=True)


def test_causal_sq_gt_sk_empty_rows():
    out, lse = _compare(2, dict(sq=9, sk=4), causal=True)
    # rows i < sq - sk see no key
    assert np.all(out[:, :5] == 0) and np.all(np.isinf(lse[:, :, :5]))
    assert np.all(np.isfinite(lse[:, :, 5:])) and np.any(out[:, 5:] != 0)


def test_causal_square():
    _compare(3, dict(sq=6, sk=6), causal=True)


def test_gqa():
    _compare(4, dict(h=6, hk=2), causal=True)


def test_mqa():
    _compare(5, dict(h=4, hk=1))


def test_gqa_head_mapping():
    q, k, v = _qkv(6, h=6, hk=2)
    out = attention(q, k, v)
    # heads 0..2 use kv head 0, heads 3..5 kv head 1
    for h in range(6):
        single = attention(q[:, :, h:h + 1], k[:, :, h // 3:h // 3 + 1], v[:, :, h // 3:h // 3 + 1])
        np.testing.assert_allclose(out[:, :, h:h + 1], single, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("window", [(3, 0), (2, 2), (0, 0), (-1, 1), (1, -1)])
@pytest.mark.parametrize("shape", [dict(sq=6, sk=9), dict(sq=9, sk=6)])
def test_windows(window, shape):
    _compare(7, shape, window_size=window)


def test_window_with_causal():
    _compare(8, dict(sq=6, sk=8), causal=True, window_size=(2, 3))


def test_softcap():
    q, k, v = _qkv(9)
    out_cap = _compare(9, softcap=0.5, softmax_scale=1.0)[0]
    assert max_abs_err(out_cap, attention(q, k, v, softmax_scale=1.0)) > 1e-2  # tanh matters
    _compare(10, softcap=50.0)


def test_alibi_per_head():
    rng = np.random.default_rng(11)
    slopes = rng.uniform(0.1, 1.0, size=(4,)).astype(np.float32)
    _compare(11, causal=True, alibi_slopes=slopes)
    _compare(12, alibi_slopes=slopes)


def test_alibi_per_batch_head():
    rng = np.random.default_rng(13)
    slopes = rng.uniform(0.1, 1.0, size=(2, 4)).astype(np.float32)
    _compare(13, dict(sq=4, sk=10), alibi_slopes=slopes, softcap=0.5)


def test_lse_matches_logsumexp():
    q, k, v = _qkv(14, sq=4, sk=6)
    _, lse = attention(q, k, v, return_lse=True, softmax_scale=0.3)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * 0.3
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(-1)), rtol=1e-12)


def test_inputs_as_lists():
    q, k, v = _qkv(15, b=1, sq=2, sk=3, h=1, d=4)
    np.testing.assert_allclose(attention(q.tolist(), k.tolist(), v.tolist()), attention(q, k, v))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_precision_same(dtype, causal):
    q, k, v = _qkv(16, sq=16, sk=24, d=32, dtype=dtype)
    out, lse = attention(q, k, v, causal=causal, precision="same", return_lse=True)
    ref, ref_lse = attention(q, k, v, causal=causal, return_lse=True)
    assert out.dtype == np.dtype(dtype) and out.shape == q.shape
    assert lse.dtype == np.float32 and ref.dtype == np.float64
    err = max_abs_err(out, ref)
    assert 1e-6 < err < 5e-2
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)


def test_bad_precision():
    q, k, v = _qkv(17)
    with pytest.raises(ValueError, match="precision"):
        attention(q, k, v, precision="float32")


def test_max_abs_err():
    a = np.array([1.0, 2.0, 3.0])
    assert max_abs_err(a, a + np.array([0.0, -0.5, 0.25])) == 0.5
    assert max_abs_err(a, np.array([1.0, np.nan, 3.0])) == math.inf
    assert max_abs_err(np.zeros((0, 3)), np.zeros((0, 3))) == 0.0


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_check_close(dtype):
    q, k, v = _qkv(18, sq=8, sk=12, d=16, dtype=dtype)
    ref_lp = attention(q, k, v, causal=True, precision="same")
    ok, err, bound = check_close(ref_lp, q, k, v, causal=True)
    assert ok and err <= bound
    bad = ref_lp.copy()
    bad[0, 3, 1, 2] += dtype(0.1)
    ok, err, bound = check_close(bad, q, k, v, causal=True)
    assert not ok and err > bound
    bad = ref_lp.copy()
    bad[1, 0, 0, 0] = np.nan
    ok, err, _ = check_close(bad, q, k, v, causal=True)
    assert not ok and err == math.inf
    with pytest.raises(ValueError, match="out"):
        check_close(ref_lp[:, :-1], q, k, v, causal=True)


def test_check_close_float32_out():
    q, k, v = _qkv(19, dtype=np.float16)
    out32 = attention(q, k, v).astype(np.float32)
    assert check_close(out32, q, k, v)[0]


def test_bad_inputs():
    q, k, v = _qkv(20, h=6, hk=4)
    with pytest.raises(ValueError, match="nheads"):
        attention(q, k, v)
    q, k, v = _qkv(21)
    with pytest.raises(ValueError, match="head dim"):
        attention(q, k[..., :4], v[..., :4])
    with pytest.raises(ValueError, match="rank"):
        attention(q[0], k, v)
    with pytest.raises(ValueError, match="v"):
        attention(q, k, v[:, :3])
    with pytest.raises(ValueError, match="batch"):
        attention(q, k[:1], v[:1])
    with pytest.raises(ValueError, match="alibi_slopes"):
        attention(q, k, v, alibi_slopes=np.ones(3, np.float32))
    with pytest.raises(ValueError, match="window_size"):
        attention(q, k, v, window_size=(1,))


def test_empty_seqlen_k():
    q, k, v = _qkv(22, sq=3, sk=0)
    out, lse = attention(q, k, v, return_lse=True)
    assert out.shape == q.shape and np.all(out == 0)
    assert lse.shape == (2, 4, 3) and np.all(lse == np.inf)
    out, lse = attention(q.astype(np.float16), k, v, return_lse=True, precision="same")
    assert out.dtype == np.float16 and lse.dtype == np.float32 and np.all(np.isinf(lse))


def test_empty_seqlen_q_and_batch():
    q, k, v = _qkv(23, sq=0, sk=5)
    out, lse = attention(q, k, v, return_lse=True)
    assert out.shape == (2, 0, 4, 8) and lse.shape == (2, 4, 0)
    q, k, v = _qkv(24, b=0)
    out, lse = attention(q, k, v, return_lse=True)
    assert out.shape == (0, 5, 4, 8) and lse.shape == (0, 4, 5)


def test_large_shapes_chunked():
    # decode: sq=1 with long sk, and a multi-block sq (row chunking) vs unchunked rows
    q, k, v = _qkv(25, b=1, sq=1, sk=131072, h=2, hk=1, d=16, dtype=np.float16)
    out = attention(q, k, v, causal=True, precision="same")
    assert out.shape == q.shape and np.all(np.isfinite(out.astype(np.float32)))
    q, k, v = _qkv(26, b=1, sq=300, sk=20000, h=1, d=4)  # 300*20000 > one block
    out = attention(q, k, v, causal=True)
    np.testing.assert_allclose(out[:, -2:], attention(q[:, -2:], k, v, causal=True), rtol=1e-12)
