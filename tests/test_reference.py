"""Tests for cuflash.reference (CPU only, NumPy)."""

import math

import ml_dtypes
import numpy as np
import pytest

from cuflash import reference
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
    with pytest.raises(TypeError, match="window_size"):  # the library's rule: a pair of ints
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


# ---------------------------------------------------------------------------------------------
# Scalar arguments: the library's rules (cuflash.attention), in every public function

def _call(fn, **kw):
    """Call one public reference function on small float16 inputs with keyword arguments kw."""
    q, k, v = _qkv(27, b=2, sq=3, sk=4, h=2, d=8, dtype=np.float16)
    dout = q.copy()
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    cq, ck = np.array([0, 3, 6]), np.array([0, 4, 8])
    if fn == "attention":
        return reference.attention(q, k, v, **kw)
    if fn == "check_close":
        return reference.check_close(q, q, k, v, **kw)
    if fn == "attention_varlen":
        return reference.attention_varlen(flat(q), flat(k), flat(v), cq, ck, **kw)
    if fn == "attention_backward":
        return reference.attention_backward(dout, q, k, v, **kw)
    assert fn == "attention_varlen_backward"
    return reference.attention_varlen_backward(flat(dout), flat(q), flat(k), flat(v), cq, ck, **kw)


FUNCTIONS = ["attention", "check_close", "attention_varlen", "attention_backward", "attention_varlen_backward"]
BAD_SCALARS = {  # keyword arguments -> exception, fragments of its message
    "window_minus_2": (dict(window_size=(-2, 0)), ValueError, ["window_size", ">= 0", "-1", "(-2, 0)"]),
    "window_right": (dict(window_size=(3, -5)), ValueError, ["window_size", ">= 0", "(3, -5)"]),
    "window_float": (dict(window_size=(1.0, 0)), TypeError, ["window_size", "pair of ints", "(1.0, 0)"]),
    "window_bool": (dict(window_size=(True, 0)), TypeError, ["window_size", "pair of ints"]),
    "window_length": (dict(window_size=(1, 2, 3)), TypeError, ["window_size", "pair of ints", "(1, 2, 3)"]),
    "window_int": (dict(window_size=4), TypeError, ["window_size", "pair of ints", "4"]),
    "softcap_negative": (dict(softcap=-1.0), ValueError, ["softcap", ">= 0", "-1.0"]),
    "softcap_nan": (dict(softcap=float("nan")), ValueError, ["softcap", "finite", "nan"]),
    "softcap_inf": (dict(softcap=float("inf")), ValueError, ["softcap", "finite", "inf"]),
    "softcap_str": (dict(softcap="30"), TypeError, ["softcap", "real number", "str"]),
    "softcap_bool": (dict(softcap=True), TypeError, ["softcap", "real number", "bool"]),
    "softcap_none": (dict(softcap=None), TypeError, ["softcap", "real number", "NoneType"]),
    "scale_nan": (dict(softmax_scale=float("nan")), ValueError, ["softmax_scale", "positive finite", "nan"]),
    "scale_negative": (dict(softmax_scale=-1), ValueError, ["softmax_scale", "positive finite", "-1"]),
    "scale_zero": (dict(softmax_scale=0.0), ValueError, ["softmax_scale", "positive finite", "0.0"]),
    "scale_inf": (dict(softmax_scale=float("inf")), ValueError, ["softmax_scale", "positive finite", "inf"]),
    "scale_str": (dict(softmax_scale="0.1"), TypeError, ["softmax_scale", "real number", "str"]),
    "scale_bool": (dict(softmax_scale=True), TypeError, ["softmax_scale", "real number", "bool"]),
    "causal_int": (dict(causal=1), TypeError, ["causal must be a bool", "int"]),
    "causal_str": (dict(causal="yes"), TypeError, ["causal must be a bool", "str"]),
}


@pytest.mark.parametrize("case", list(BAD_SCALARS), ids=list(BAD_SCALARS))
@pytest.mark.parametrize("fn", FUNCTIONS)
def test_bad_scalar_arguments(fn, case):
    kw, exc, fragments = BAD_SCALARS[case]
    with pytest.raises(exc) as info:
        _call(fn, **kw)
    for f in fragments:
        assert f in str(info.value), (f, str(info.value))


def test_the_library_agrees_on_bad_scalars():
    """The same cases are rejected by cuflash's own checks with the same exception."""
    from cuflash import validate
    for kw, exc, _ in BAD_SCALARS.values():
        (name, value), = kw.items()
        check = {"window_size": validate.window, "softcap": lambda c: validate.softcap(c, 0.125),
                 "causal": lambda c: validate.boolean(c, "causal"),
                 "softmax_scale": lambda s: validate.scale(s, 8)}[name]
        with pytest.raises(exc):
            check(value)


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_good_scalar_arguments(fn):
    """What the library accepts: lists, NumPy integers, floats and bools, -1 = unbounded."""
    for kw in (dict(window_size=[2, -1]), dict(window_size=(np.int64(1), np.int32(0))),
               dict(softcap=np.float32(5.0)), dict(softcap=0), dict(softmax_scale=np.float32(0.3)),
               dict(softmax_scale=2), dict(causal=np.bool_(True)), dict(window_size=(-1, -1), softcap=0.0)):
        _call(fn, **kw)


def test_scalar_arguments_change_nothing_once_valid():
    """A list window and NumPy scalars give the results of the plain Python values."""
    q, k, v = _qkv(28, sq=6, sk=9)
    a = attention(q, k, v, window_size=(3, 1), softcap=2.0, softmax_scale=0.5)
    b = attention(q, k, v, window_size=[np.int64(3), 1], softcap=np.float32(2.0), softmax_scale=np.float64(0.5))
    np.testing.assert_array_equal(a, b)


def test_varlen_checks_arguments_without_sequences():
    """An empty batch (cu_seqlens = [0]) attends nothing but still checks its arguments."""
    z = np.zeros((0, 2, 8), np.float16)
    calls = (lambda **kw: reference.attention_varlen(z, z, z, [0], [0], **kw),
             lambda **kw: reference.attention_varlen_backward(z, z, z, z, [0], [0], **kw)[0])
    for call in calls:
        assert call().shape == (0, 2, 8)
        for kw, exc, match in ((dict(window_size=(-2, 0)), ValueError, "window_size"),
                               (dict(softcap=-1.0), ValueError, "softcap"),
                               (dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
                               (dict(causal=0), TypeError, "causal"),
                               (dict(precision="half"), ValueError, "precision"),
                               (dict(alibi_slopes=np.ones(3)), ValueError, "alibi_slopes")):
            with pytest.raises(exc, match=match):
                call(**kw)
    with pytest.raises(ValueError, match="q: expected rank 3"):
        reference.attention_varlen(z[None], z, z, [0], [0])
    with pytest.raises(ValueError, match="v: expected shape"):
        reference.attention_varlen_backward(z, z, z, z[:, :1], [0], [0])
