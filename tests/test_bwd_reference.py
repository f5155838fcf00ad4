"""Reference gradients with sliding windows, softcap, ALiBi and packed (varlen) sequences, on the
CPU: float64 gradients agree with central finite differences of reference.attention and with
an independent per-row loop; the varlen reference is the dense one per sequence."""
import ml_dtypes
import numpy as np
import pytest

from cuflash import reference
from conftest import check_same_precision, finite_diff, naive_backward  # shared reference checks


def _inputs(rng, b, sq, sk, h, hk, d):
    q, k, v = (rng.standard_normal(s) for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d)))
    return rng.standard_normal((b, sq, h, d)), q, k, v


# (b, sq, sk, h, hk, d, causal, window, softcap, alibi shape or None)
FD_CASES = [
    (1, 5, 7, 2, 1, 3, False, (2, 1), 0.0, None),
    (1, 7, 5, 2, 2, 4, False, (1, 0), 0.0, None),
    (2, 6, 6, 2, 1, 3, True, (2, -1), 0.0, None),
    (1, 6, 8, 2, 2, 3, False, (0, 0), 0.0, None),
    (1, 4, 9, 2, 1, 4, False, (-1, 2), 0.0, None),
    (1, 5, 6, 2, 1, 3, False, (-1, -1), 1.5, None),
    (2, 5, 4, 2, 2, 3, True, (-1, -1), 0.8, None),
    (1, 5, 7, 2, 1, 3, False, (-1, -1), 0.0, "h"),
    (2, 6, 5, 2, 2, 3, True, (-1, -1), 0.0, "bh"),
    (2, 6, 7, 4, 2, 3, False, (2, 2), 1.2, "bh"),
    (1, 1, 6, 2, 1, 4, True, (1, 0), 2.0, "h"),
]


@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal,window,softcap,alibi", FD_CASES)
def test_reference_matches_finite_differences(rng, b, sq, sk, h, hk, d, causal, window, softcap, alibi):
    dout, q, k, v = _inputs(rng, b, sq, sk, h, hk, d)
    slopes = None if alibi is None else rng.uniform(0.1, 1.0, (h,) if alibi == "h" else (b, h))
    kw = dict(causal=causal, softmax_scale=0.7, window_size=window, softcap=softcap, alibi_slopes=slopes)
    got = reference.attention_backward(dout, q, k, v, **kw)
    want = finite_diff(lambda: float((reference.attention(q, k, v, **kw) * dout).sum()), (q, k, v))
    for name, g, w in zip("qkv", got, want):
        assert g.dtype == np.float64
        np.testing.assert_allclose(g, w, atol=1e-7, rtol=1e-6, err_msg=f"d{name}")


@pytest.mark.parametrize("sq,sk,h,hk,window,causal,softcap,alibi", [
    (9, 13, 4, 2, (3, 2), False, 0.0, False), (13, 9, 4, 1, (4, -1), True, 5.0, True),
    (8, 8, 2, 2, (0, 0), False, 2.0, True), (1, 17, 6, 3, (5, 0), False, 0.0, True),
    (17, 5, 2, 1, (-1, 1), False, 3.0, False), (12, 12, 2, 1, (-1, -1), False, 30.0, True)])
def test_reference_matches_naive_loop(rng, sq, sk, h, hk, window, causal, softcap, alibi):
    d = 8
    dout, q, k, v = _inputs(rng, 2, sq, sk, h, hk, d)
    slopes = rng.uniform(0.05, 0.5, (2, h)) if alibi else None
    got = reference.attention_backward(dout, q, k, v, causal=causal, window_size=window, softcap=softcap,
                                       alibi_slopes=slopes)
    left, right = window[0], (0 if causal else window[1])
    want = naive_backward(dout, q, k, v, d ** -0.5, left, right, softcap, slopes)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-12, rtol=1e-10)


def test_defaults_match_the_plain_call(rng):
    dout, q, k, v = _inputs(rng, 2, 9, 11, 4, 2, 8)
    for causal in (False, True):
        a = reference.attention_backward(dout, q, k, v, causal=causal)
        b = reference.attention_backward(dout, q, k, v, causal=causal, window_size=(-1, -1), softcap=0.0,
                                         alibi_slopes=None)
        c = reference.attention_backward(dout, q, k, v, window_size=(-1, 0) if causal else (-1, -1),
                                         alibi_slopes=np.zeros(4))
        for x, y, z in zip(a, b, c):
            np.testing.assert_array_equal(x, y)
            np.testing.assert_allclose(x, z, atol=1e-14)


def test_window_rows_without_keys_give_zero_gradient(rng):
    # sk < sq with a window (2, 0): rows i < sq - sk see no key
    dout, q, k, v = _inputs(rng, 1, 10, 4, 2, 2, 8)
    dq, dk, dv = reference.attention_backward(dout, q, k, v, window_size=(2, 0))
    assert np.all(dq[:, :6] == 0) and np.abs(dq[:, 6:]).max() > 0
    # keys outside every row's band get zero dk, dv
    dout, q, k, v = _inputs(rng, 1, 3, 12, 2, 2, 8)
    dq, dk, dv = reference.attention_backward(dout, q, k, v, window_size=(1, 0))
    assert np.all(dk[:, :8] == 0) and np.all(dv[:, :8] == 0) and np.abs(dk[:, 8:]).max() > 0


@pytest.mark.parametrize("dt", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_reference_same_precision_with_mods(rng, dt):
    q, k, v, dout = (rng.standard_normal(s).astype(dt) for s in
                     ((2, 33, 4, 16), (2, 47, 2, 16), (2, 47, 2, 16), (2, 33, 4, 16)))
    kw = dict(window_size=(9, 3), softcap=5.0, alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4], np.float32))
    low = reference.attention_backward(dout, q, k, v, precision="same", **kw)
    ref = reference.attention_backward(dout, q, k, v, **kw)
    check_same_precision(low, ref, dt)


@pytest.mark.parametrize("dt", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("sk", [2, 3, 40])
def test_same_precision_d_uses_the_same_precision_forward_output(rng, dt, sk):
    """D = rowsum(dO * O) is formed from the output that the same-precision forward returns (P
    rounded before its P V product, as the kernels' forward stores it), not from round(P V):
    with few keys per row dS = P (dP - D) cancels and D's rounding is the gradients' largest
    (issue 18: a 2-key bf16 backward missed the rule against a reference without it)."""
    dout, q, k, v = (rng.standard_normal(s).astype(dt) for s in ((2, 9, 2, 16), (2, 9, 2, 16), (2, sk, 1, 16),
                                                                  (2, sk, 1, 16)))
    kw = dict(window_size=(-1, 0), softmax_scale=0.3)
    got = reference.attention_backward(dout, q, k, v, precision="same", **kw)
    rnd = lambda x: np.asarray(x, np.float64).astype(dt).astype(np.float64)  # noqa: E731
    o = reference.attention(q, k, v, precision="same", **kw).astype(np.float64)
    _, lse = reference.attention(q, k, v, return_lse=True, **kw)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    vis = np.arange(sk)[None] <= np.arange(9)[:, None] + sk - 9
    for b in range(2):
        for h in range(2):
            qh, kh, vh, doh = (x[b, :, hh].astype(np.float64) for x, hh in ((q, h), (k, 0), (v, 0), (dout, h)))
            with np.errstate(invalid="ignore"):
                p = np.where(vis, np.exp(0.3 * qh @ kh.T - lse[b, h][:, None]), 0.0)
            ds = rnd(p * (doh @ vh.T - (doh * o[b, :, h]).sum(-1, keepdims=True)))
            dq[b, :, h] = 0.3 * ds @ kh
            dk[b, :, 0] += 0.3 * ds.T @ qh
            dv[b, :, 0] += rnd(p).T @ doh
    for g, w in zip(got, (dq, dk, dv)):
        np.testing.assert_allclose(g.astype(np.float64), rnd(w), rtol=1e-2, atol=1e-6)
        assert np.mean(g.astype(np.float64) == rnd(w)) > 0.97  # bitwise but for a few roundings


def test_softcap_changes_the_gradient(rng):
    dout, q, k, v = _inputs(rng, 1, 8, 8, 2, 2, 8)
    q *= 4  # large scores: the cap matters
    a = reference.attention_backward(dout, q, k, v)
    b = reference.attention_backward(dout, q, k, v, softcap=1.0)
    assert reference.max_abs_err(a[0], b[0]) > 1e-3
    c = reference.attention_backward(dout, q, k, v, softcap=1e6)  # a huge cap is no cap
    for x, y in zip(a, c):
        np.testing.assert_allclose(x, y, atol=1e-8)


# ---------------------------------------------------------------------------------------------
# Varlen

def _packed(rng, lens_q, lens_k, h, hk, d):
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = rng.standard_normal((cq[-1], h, d))
    k, v = rng.standard_normal((ck[-1], hk, d)), rng.standard_normal((ck[-1], hk, d))
    return rng.standard_normal(q.shape), q, k, v, cq, ck


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(3, 1)),
                                dict(softcap=2.0, causal=True), dict(alibi="h"), dict(alibi="bh", window_size=(2, 0))])
def test_varlen_reference_is_the_dense_one_per_sequence(rng, kw):
    kw = dict(kw)
    lens_q, lens_k = [5, 0, 1, 7, 3], [4, 6, 0, 9, 3]
    dout, q, k, v, cq, ck = _packed(rng, lens_q, lens_k, 4, 2, 8)
    alibi = kw.pop("alibi", None)
    slopes = None if alibi is None else rng.uniform(0.1, 0.5, (4,) if alibi == "h" else (5, 4))
    got = reference.attention_varlen_backward(dout, q, k, v, cq, ck, alibi_slopes=slopes, **kw)
    assert [g.shape for g in got] == [q.shape, k.shape, v.shape]
    for b in range(5):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        s = None if slopes is None else (slopes if slopes.ndim == 1 else slopes[b])
        want = reference.attention_backward(dout[None, qs], q[None, qs], k[None, ks], v[None, ks],
                                            alibi_slopes=s, **kw)
        for g, w, sl in zip(got, want, (qs, ks, ks)):
            np.testing.assert_array_equal(g[sl], w[0])
    # sequence 1 has keys but no query, sequence 2 a query but no key: zero gradients
    assert np.all(got[1][ck[1]:ck[2]] == 0) and np.all(got[2][ck[1]:ck[2]] == 0)
    assert np.all(got[0][cq[2]:cq[3]] == 0)


def test_varlen_reference_matches_finite_differences(rng):
    lens_q, lens_k = [3, 1, 0, 4], [5, 2, 3, 3]
    dout, q, k, v, cq, ck = _packed(rng, lens_q, lens_k, 2, 1, 3)
    slopes = rng.uniform(0.1, 0.5, (4, 2))
    kw = dict(window_size=(2, 1), softcap=1.5, alibi_slopes=slopes, softmax_scale=0.8)
    got = reference.attention_varlen_backward(dout, q, k, v, cq, ck, **kw)
    want = finite_diff(lambda: float((reference.attention_varlen(q, k, v, cq, ck, **kw) * dout).sum()), (q, k, v))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-7, rtol=1e-6)


def test_varlen_reference_same_precision_and_bad_arguments(rng):
    dout, q, k, v, cq, ck = _packed(rng, [4, 2], [3, 5], 2, 2, 8)
    low = reference.attention_varlen_backward(*(x.astype(np.float16) for x in (dout, q, k, v)), cq, ck,
                                              causal=True, precision="same")
    assert all(g.dtype == np.float16 for g in low)
    with pytest.raises(ValueError, match="cu_seqlens"):
        reference.attention_varlen_backward(dout, q, k, v, cq, ck[:-1])
    with pytest.raises(ValueError, match="dout"):
        reference.attention_varlen_backward(dout[:-1], q, k, v, cq, ck)
