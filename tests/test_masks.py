"""FlashMask on the CPU: cuflash.masks (Paddle's startend_row_indices semantics and the mask
builders), the reference with a mask, plan.mask_tiles and the validation of the indices."""

import math

import numpy as np
import pytest

import cuflash
from cuflash import masks, reference, validate
from cuflash.plan import MASKED, SKIPPED, UNMASKED, mask_tiles, tile_classes


def _dense(seqlen, visible):
    """Hand-written mask: True (masked) where visible(i, j) is false."""
    return np.array([[not visible(i, j) for j in range(seqlen)] for i in range(seqlen)])


def _span(lengths):
    """Index of the span each position belongs to."""
    return np.repeat(np.arange(len(lengths)), lengths)


def _check_builder(x, causal, expected):
    assert x.dtype == np.int32 and x.ndim == 4 and x.shape[1] == 1
    got = masks.to_dense(x, x.shape[2], causal)
    np.testing.assert_array_equal(got, np.broadcast_to(expected, got.shape))


# ---------------------------------------------------------------------------------------------
# Builders against hand-written dense masks

@pytest.mark.parametrize("seqlen", [1, 7, 12])
def test_full_and_causal(seqlen):
    _check_builder(masks.full(seqlen, batch=2), False, _dense(seqlen, lambda i, j: True))
    _check_builder(masks.causal(seqlen), True, _dense(seqlen, lambda i, j: j <= i))


@pytest.mark.parametrize("window", [0, 1, 3, 20])
def test_sliding_window(window):
    _check_builder(masks.sliding_window(11, window), True, _dense(11, lambda i, j: i - window <= j <= i))


@pytest.mark.parametrize("lens", [[4, 3, 3], [1], [2, 1, 5, 1]])
def test_causal_document_and_document(lens):
    doc, n = _span(lens), sum(lens)
    _check_builder(masks.causal_document(lens), True, _dense(n, lambda i, j: doc[i] == doc[j] and j <= i))
    _check_builder(masks.document(lens, batch=3), False, _dense(n, lambda i, j: doc[i] == doc[j]))


def test_share_question():
    docs = [[4, 3, 3], [2, 1], [3, 2, 1, 2]]
    spans = [s for d in docs for s in d]
    doc = np.repeat(np.arange(len(docs)), [sum(d) for d in docs])
    span = _span(spans)
    question = np.concatenate([[k == 0 for k, n in enumerate(d) for _ in range(n)] for d in docs])
    expected = _dense(len(doc), lambda i, j: doc[i] == doc[j] and j <= i and (span[i] == span[j] or question[j]))
    _check_builder(masks.share_question(docs), True, expected)


@pytest.mark.parametrize("g, w", [(2, 1), (0, 2), (3, 0), (1, 15)])
def test_global_sliding_window(g, w):
    _check_builder(masks.global_sliding_window(13, g, w), False,
                   _dense(13, lambda i, j: abs(i - j) <= w or i < g or j < g))


@pytest.mark.parametrize("lens", [[4, 3, 3], [5], [2, 2, 1, 4]])
def test_causal_blockwise(lens):
    block = _span(lens)
    last = len(lens) - 1
    _check_builder(masks.causal_blockwise(lens), True,
                   _dense(sum(lens), lambda i, j: j <= i and (block[i] == block[j] or block[i] == last)))


@pytest.mark.parametrize("p", [0, 1, 5, 10])
def test_prefix_lm_causal(p):
    _check_builder(masks.prefix_lm_causal(10, p), False, _dense(10, lambda i, j: j <= i or j < p))


def test_prefix_lm_document():
    docs = [(3, 2), (2, 2), (5, 2), (4, 0)]
    doc = _span([n for n, _ in docs])
    start = np.repeat(np.cumsum([0] + [n for n, _ in docs])[:-1], [n for n, _ in docs])
    prefix = np.repeat([p for _, p in docs], [n for n, _ in docs])
    _check_builder(masks.prefix_lm_document(docs), False,
                   _dense(len(doc), lambda i, j: doc[i] == doc[j] and (j <= i or j < start[j] + prefix[j])))


@pytest.mark.parametrize("maskout", [[(2, 3), (6, 2)], [(0, 2)], [(3, 0), (4, 6)], []])
def test_qk_sparse(maskout):
    def visible(i, j):
        dropped = any(off <= i < off + n and j >= off for off, n in maskout)
        return j <= i and not dropped
    _check_builder(masks.qk_sparse(10, maskout), True, _dense(10, visible))


def test_random_eviction():
    seqlen, start = 32, 20
    x = masks.random_eviction(seqlen, start, seed=3, batch=2, nheads=3)
    assert x.shape == (2, 3, seqlen, 1) and x.dtype == np.int32
    np.testing.assert_array_equal(x, masks.random_eviction(seqlen, start, seed=3, batch=2, nheads=3))
    assert not np.array_equal(x[0, 0], x[1, 2])
    dense = masks.to_dense(x, seqlen, True)
    causal = masks.to_dense(masks.causal(seqlen), seqlen, True)[0, 0]
    for b in range(2):
        for h in range(3):
            lts = x[b, h, :, 0]
            evicted = lts < seqlen
            assert evicted.sum() == seqlen - start and not evicted[-1]  # one key per row from start on
            assert (lts[evicted] >= start).all() and (lts > np.arange(seqlen)).all()
            np.testing.assert_array_equal(dense[b, h, :start], causal[:start])  # rows before start: causal
            # an evicted key stays masked for every later row
            i = np.arange(seqlen)[:, None]
            np.testing.assert_array_equal(dense[b, h], causal | (i >= lts))


def test_builders_reproduce_paddles_documented_indices():
    """The index examples of Paddle's flashmask_attention documentation (seqlen 10)."""
    cases = [
        (masks.causal(10), [[10] * 10]),
        (masks.sliding_window(10, 2), [[3, 4, 5, 6, 7, 8, 9, 10, 10, 10]]),
        (masks.causal_document([4, 3, 3]), [[4, 4, 4, 4, 7, 7, 7, 10, 10, 10]]),
        (masks.document([4, 3, 3]), [[4, 4, 4, 4, 7, 7, 7, 10, 10, 10], [0, 0, 0, 0, 4, 4, 4, 7, 7, 7]]),
        (masks.share_question([[4, 3, 3]]), [[10, 10, 10, 10, 7, 7, 7, 10, 10, 10]]),
        (masks.global_sliding_window(10, 2, 1), [[10, 10, 4, 5, 6, 7, 8, 9, 10, 10], [10] * 10,
                                                [0, 0, 0, 0, 2, 2, 2, 2, 2, 2], [0, 0, 0, 0, 3, 4, 5, 6, 7, 8]]),
        (masks.causal_blockwise([4, 3, 3]), [[4, 4, 4, 4, 10, 10, 10, 10, 10, 10], [7, 7, 7, 7] + [10] * 6]),
        (masks.prefix_lm_document([(3, 2), (2, 2), (5, 2)]), [[3, 3, 3, 5, 5, 10, 10, 10, 10, 10],
                                                             [0, 0, 2, 3, 3, 5, 5, 7, 8, 9]]),
        (masks.prefix_lm_causal(10, 5), [[10] * 10, [0, 0, 0, 0, 0, 5, 6, 7, 8, 9]]),
    ]
    for x, cols in cases:
        np.testing.assert_array_equal(x[0, 0].T, cols)


def test_builder_arguments_are_checked():
    for call in (lambda: masks.causal_document([]), lambda: masks.document([3, 0]),
                 lambda: masks.sliding_window(8, -1), lambda: masks.prefix_lm_causal(8, 9),
                 lambda: masks.qk_sparse(8, [(4, 2), (3, 1)]), lambda: masks.qk_sparse(8, [(6, 3)]),
                 lambda: masks.random_eviction(8, 0), lambda: masks.global_sliding_window(8, -1, 2),
                 lambda: masks.prefix_lm_document([(3, 4)]), lambda: masks.share_question([])):
        with pytest.raises(ValueError):
            call()


# ---------------------------------------------------------------------------------------------
# to_dense: Paddle's semantics on hand-made examples

def _one(cols):
    """One column list per bound -> int32 (1, 1, seqlen_k, n)."""
    return np.array(cols, dtype=np.int32).T[None, None]


@pytest.mark.parametrize("cols, causal, expected", [
    # causal, LTS: column 0 masked from row 2, column 1 from row 4 (never), column 2 from row 3
    ([[2, 4, 3, 4]], True, ["0111", "0011", "1001", "1010"]),
    # causal, LTS, LTE: rows in [LTS, LTE), and the causal mask
    ([[1, 2, 2, 4], [3, 3, 4, 4]], True, ["0111", "1011", "1111", "0010"]),
    # not causal, LTS, UTE: rows >= LTS or rows < UTE
    ([[2, 4, 4, 1], [0, 1, 4, 0]], False, ["0110", "0011", "1011", "1011"]),
    # not causal, LTS, LTE, UTS, UTE: rows in [LTS, LTE) or [UTS, UTE)
    ([[3, 1, 4, 2], [4, 2, 4, 3], [0, 0, 1, 0], [1, 0, 3, 0]], False, ["1000", "0110", "0011", "1000"]),
])
def test_to_dense_semantics(cols, causal, expected):
    """Hand-made 4 x 4 examples, one per (causal, n); expected rows as strings, 1 = masked."""
    got = masks.to_dense(_one(cols), 4, causal)[0, 0]
    np.testing.assert_array_equal(got, np.array([[c == "1" for c in row] for row in expected]))


def test_to_dense_causal_is_bottom_right_and_rows():
    # seqlen_q 2 < seqlen_k 4: query i sees key j <= i + 2; LTS = 1 for key 0 masks row 1
    x = _one([[1, 2, 2, 2]])
    got = masks.to_dense(x, 2, True)[0, 0]
    np.testing.assert_array_equal(got, np.array([[0, 0, 0, 1], [1, 0, 0, 0]], dtype=bool))
    np.testing.assert_array_equal(masks.to_dense(x, 2, True, rows=(1, 2))[0, 0], got[1:])


def test_to_dense_heads_and_batch():
    x = np.stack([masks.causal_document([2, 2])[0], masks.causal(4)[0]])  # (2, 1, 4, 1)
    x = np.concatenate([x, np.full_like(x, 4)], axis=1)  # a second head: plain causal
    got = masks.to_dense(x, 4, True)
    assert got.shape == (2, 2, 4, 4)
    causal = np.triu(np.ones((4, 4), dtype=bool), 1)
    assert got[0, 0, 2, 0] and not got[1, 0, 2, 0]
    for b, h in ((0, 1), (1, 0), (1, 1)):
        np.testing.assert_array_equal(got[b, h], causal)


# ---------------------------------------------------------------------------------------------
# The reference with a mask against a plain NumPy softmax

def _naive(q, k, v, dense, scale, dout=None):
    """softmax(q k^T * scale, masked entries excluded) v per (batch, head), with LSE, and with
    ``dout`` the gradients (dq, dk, dv) from the textbook formulas; ``dense`` (batch, nheads,
    sq, sk) True = masked. Rows without a visible key give 0 and LSE +inf."""
    b_, sq, h_, d = q.shape
    hk = k.shape[2]
    out, lse = np.zeros(q.shape), np.full((b_, h_, sq), np.inf)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for b in range(b_):
        for h in range(h_):
            g = h // (h_ // hk)
            s = q[b, :, h] @ k[b, :, g].T * scale
            s[dense[b, h]] = -np.inf
            m = s.max(axis=1, keepdims=True)
            m[~np.isfinite(m)] = 0
            e = np.exp(s - m)
            l = e.sum(axis=1, keepdims=True)
            p = np.divide(e, l, out=np.zeros_like(e), where=l > 0)
            out[b, :, h] = p @ v[b, :, g]
            with np.errstate(divide="ignore"):
                lse[b, h] = np.where(l[:, 0] > 0, m[:, 0] + np.log(l[:, 0]), np.inf)
            if dout is not None:
                do = dout[b, :, h]
                dv[b, :, g] += p.T @ do
                dp = do @ v[b, :, g].T
                ds = p * (dp - (do * out[b, :, h]).sum(axis=1, keepdims=True))
                dq[b, :, h] = ds @ k[b, :, g] * scale
                dk[b, :, g] += ds.T @ q[b, :, h] * scale
    return out, lse, (dq, dk, dv)


def _mask_heads(x, nheads, nheads_k, sq, causal):
    """The dense mask per query head (the indices' heads are 1, nheads_k or nheads)."""
    hm = x.shape[1]
    idx = [h if hm == nheads else h // (nheads // nheads_k) if hm == nheads_k else 0 for h in range(nheads)]
    return masks.to_dense(x, sq, causal)[:, idx]


@pytest.mark.parametrize("causal, n", [(True, 1), (True, 2), (False, 2), (False, 4)])
@pytest.mark.parametrize("mask_heads", ["one", "kv", "q"])
@pytest.mark.parametrize("sq", [9, 6])
def test_reference_matches_dense_softmax(causal, n, mask_heads, sq):
    rng = np.random.default_rng(n + 10 * causal + sq)
    b, sk, h, hk, d = 2, 9, 4, 2, 8
    q, k, v = (rng.standard_normal(s) for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d)))
    hm = {"one": 1, "kv": hk, "q": h}[mask_heads]
    x = _random_indices(rng, (b, hm, sk), n, causal, sq)
    dout = rng.standard_normal(q.shape)
    want_out, want_lse, grads = _naive(q, k, v, _mask_heads(x, h, hk, sq, causal), d ** -0.5, dout=dout)
    out, lse = reference.attention(q, k, v, causal=causal, return_lse=True, startend_row_indices=x)
    np.testing.assert_allclose(out, want_out, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
    np.testing.assert_allclose(lse[np.isfinite(lse)], want_lse[np.isfinite(want_lse)], atol=1e-12)
    for got, want in zip(reference.attention_backward(dout, q, k, v, causal=causal, startend_row_indices=x), grads):
        np.testing.assert_allclose(got, want, atol=1e-12)


def test_reference_fully_masked_rows_give_zero_and_inf_lse():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 6, 2, 8)) for _ in range(3))
    x = masks.qk_sparse(6, [(0, 2)])  # rows 0 and 1 see no key
    out, lse = reference.attention(q, k, v, causal=True, return_lse=True, startend_row_indices=x)
    assert (out[0, :2] == 0).all() and np.isinf(lse[0, :, :2]).all() and np.isfinite(lse[0, :, 2:]).all()
    ok, err, bound = reference.check_close(out.astype(np.float16), q.astype(np.float16), k.astype(np.float16),
                                           v.astype(np.float16), causal=True, startend_row_indices=x)
    assert err < 1e-2


def test_reference_with_full_mask_equals_plain_attention():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 7, 2, 8)) for _ in range(3))
    np.testing.assert_array_equal(reference.attention(q, k, v, startend_row_indices=masks.full(7, batch=2)),
                                  reference.attention(q, k, v))
    np.testing.assert_array_equal(
        reference.attention(q, k, v, causal=True, startend_row_indices=masks.causal(7, batch=2)),
        reference.attention(q, k, v, causal=True))
    # a sliding window built into the indices equals flash-attn's window_size=(w, 0)
    np.testing.assert_allclose(
        reference.attention(q, k, v, causal=True, startend_row_indices=masks.sliding_window(7, 2, batch=2)),
        reference.attention(q, k, v, causal=True, window_size=(2, 0)), atol=1e-15)


# ---------------------------------------------------------------------------------------------
# Tile classification

def _random_indices(rng, shape, n, causal, sq):
    """Random valid indices of n bounds in [0, sq] over keys ``shape`` (batch, heads, seqlen_k):
    ordered pairs (start <= end) where they form an interval, half the time sorted along the keys
    (runs of equal bounds, as documents give); empty intervals and bounds 0 and sq included."""
    def bounds():
        a = rng.integers(0, sq + 1, size=shape)
        return np.sort(a, axis=-1) if rng.random() < 0.5 else a
    if n == 1:
        cols = [bounds()]
    elif n == 2 and not causal:  # LTS, UTE: mostly the upper interval above the lower one
        a, c = bounds(), bounds()
        cols = [np.maximum(a, c), np.minimum(a, c)] if rng.random() < 0.8 else [a, c]
    else:
        cols = []
        for _ in range(n // 2):
            a, c = bounds(), bounds()
            cols += [np.minimum(a, c), np.maximum(a, c)]
    return np.stack(cols, axis=-1).astype(np.int32)


def _brute_force(x, sq, sk, bm, bn, causal):
    """The paper's per-tile rule written out with loops over tiles and columns."""
    b_, h_, _, n = x.shape
    out = np.zeros((b_, h_, math.ceil(sq / bm), math.ceil(sk / bn)), dtype=np.int8)
    for b in range(b_):
        for h in range(h_):
            ivs = masks.intervals(x[b:b + 1, h:h + 1], sq, causal)
            for m in range(out.shape[2]):
                r0, r1 = m * bm, min(m * bm + bm, sq)
                for t in range(out.shape[3]):
                    c0, c1 = t * bn, min(t * bn + bn, sk)
                    full = part = False
                    for start, end in ivs:
                        s, e = start[0, 0, c0:c1], end[0, 0, c0:c1]
                        full |= r0 >= max(s) and r1 <= min(e)
                        part |= r0 < max(e) and r1 > min(s)
                    if causal:
                        full |= c0 > r1 - 1 + sk - sq
                        part |= c1 - 1 > r0 + sk - sq
                    out[b, h, m, t] = SKIPPED if full else MASKED if part else UNMASKED
    return out


@pytest.mark.parametrize("causal, n", [(True, 1), (True, 2), (False, 2), (False, 4)])
@pytest.mark.parametrize("sq, sk, bm, bn", [(16, 16, 4, 4), (13, 17, 4, 3), (20, 9, 8, 4), (5, 5, 8, 8)])
def test_tile_classes_brute_force_and_conservative(causal, n, sq, sk, bm, bn):
    rng = np.random.default_rng(sq * 31 + sk + n)
    for trial in range(8):
        x = _random_indices(rng, (2, 2, sk), n, causal, sq)
        cls = tile_classes(x, sq, sk, bm, bn, causal)
        np.testing.assert_array_equal(cls, _brute_force(x, sq, sk, bm, bn, causal))
        dense = masks.to_dense(x, sq, causal)
        for (b, h, m, t), c in np.ndenumerate(cls):
            tile = dense[b, h, m * bm:(m + 1) * bm, t * bn:(t + 1) * bn]
            if c == SKIPPED:
                assert tile.all()
            if c == UNMASKED:
                assert not tile.any()
        counts = mask_tiles(x, sq, sk, bm, bn, causal)
        assert counts == tuple(int((cls == c).sum()) for c in (SKIPPED, MASKED, UNMASKED))
        assert counts.total == cls.size


def test_mask_tiles_causal_document():
    # two documents of 64 tokens, tiles of 32 (a 4 x 4 grid): in each document's 2 x 2 tiles the
    # diagonal two are masked, the one below unmasked, the one above skipped (causal); the 8
    # tiles across documents are skipped
    x = masks.causal_document([64, 64])
    assert mask_tiles(x, 128, 128, 32, 32, True) == (10, 4, 2)
    assert mask_tiles(masks.causal(128), 128, 128, 32, 32, True) == (6, 4, 6)
    assert mask_tiles(masks.full(128), 128, 128, 32, 32, False) == (0, 0, 16)
    assert mask_tiles(masks.document([64, 64]), 128, 128, 32, 32, False) == (8, 0, 8)
    assert mask_tiles(masks.full(8)[:, :, :0], 8, 0, 4, 4, False) == (0, 0, 0)


# ---------------------------------------------------------------------------------------------
# cuflash.plan

SHAPES = dict(q=(2, 512, 8, 64), k=(2, 512, 2, 64), v=(2, 512, 2, 64))


def _plan(**kw):
    return cuflash.plan(SHAPES["q"], SHAPES["k"], SHAPES["v"], num_sms=132, arch=90, **kw)


def test_plan_counts_tiles_from_the_indices():
    x = np.concatenate([masks.causal_document([100, 300, 112]), masks.causal(512)])
    p = _plan(causal=True, startend_row_indices=x)
    v = p.launches[0].variant
    assert v.flashmask == 1 and v.kind == "fwd_ws" and p.launches[1].variant.family == "flashmask"
    t = mask_tiles(x, 512, 512, v.block_m, v.block_n, True)
    n = 2 * 8 * math.ceil(512 / v.block_m) * math.ceil(512 / v.block_n)
    assert (f"FlashMask: {n} tiles of {v.block_m} x {v.block_n} (batch 2 x 8 heads): {t.skipped * 8} skipped, "
            f"{t.masked * 8} masked, {t.unmasked * 8} unmasked") in p.reason
    assert "not run FlashMask" not in p.reason
    # per KV head indices count once per query head of the group
    p2 = _plan(causal=True, startend_row_indices=np.repeat(x, 2, axis=1))
    assert f"{t.skipped * 8} skipped" in p2.reason


def test_plan_with_a_shape_gives_the_tile_count_only():
    p = _plan(causal=False, startend_row_indices=(2, 1, 512, 4))
    assert "FlashMask:" in p.reason and "depends on the indices' values" in p.reason
    pb = _plan(causal=True, backward=True, startend_row_indices=masks.causal(512, batch=2))
    v = pb.launches[1].variant
    assert f"tiles of {v.block_m} x {v.block_n}" in pb.reason and "skipped" in pb.reason
    assert v.flashmask == 1 and pb.launches[-1].variant.family == "flashmask"
    assert "not run FlashMask" not in pb.reason


# ---------------------------------------------------------------------------------------------
# Validation

def _check(x, causal=True, sq=8, **kw):
    return validate.check_startend_row_indices(x, 2, 4, sq, 8, causal, nheads_k=2, **kw)


@pytest.mark.parametrize("x, causal, exc, msg", [
    ([[1]], True, TypeError, "startend_row_indices must be an array"),
    (np.zeros((2, 1, 8, 1), np.int64), True, TypeError, "startend_row_indices must be int32, got int64"),
    (np.zeros((2, 8, 1), np.int32), True, ValueError, "must have 4 dims (batch, heads, seqlen_k, n), got shape (2, 8, 1)"),
    (np.zeros((3, 1, 8, 1), np.int32), True, ValueError,
     "must have shape (batch, 1 or nheads_k or nheads, seqlen_k, n) = (2, 1|2|4, 8, 1|2), got (3, 1, 8, 1)"),
    (np.zeros((2, 3, 8, 1), np.int32), True, ValueError, "got (2, 3, 8, 1)"),
    (np.zeros((2, 1, 7, 2), np.int32), False, ValueError, "= (2, 1|2|4, 8, 2|4), got (2, 1, 7, 2)"),
    (np.zeros((2, 1, 8, 4), np.int32), True, ValueError,
     "the last dim of startend_row_indices must be 1 (LTS) or 2 (LTS, LTE) with causal=True, got 4"),
    (np.zeros((2, 1, 8, 1), np.int32), False, ValueError,
     "must be 2 (LTS, UTE) or 4 (LTS, LTE, UTS, UTE) with causal=False, got 1"),
    (np.full((2, 1, 8, 1), 9, np.int32), True, ValueError, "must lie in [0, seqlen_q] = [0, 8], got 9 at (0, 0, 0, 0)"),
    (np.full((2, 1, 8, 2), -1, np.int32), False, ValueError, "got -1 at (0, 0, 0, 0)"),
])
def test_validation_errors(x, causal, exc, msg):
    with pytest.raises(exc) as e:
        _check(x, causal)
    assert msg in str(e.value)


def test_validation_order_of_bounds_and_window():
    x = np.zeros((2, 4, 8, 2), np.int32)
    x[1, 3, 5] = (6, 4)
    with pytest.raises(ValueError, match=r"LTS <= LTE in every key column, got LTS=6 > LTE=4 at \(batch, head, key\) = \(1, 3, 5\)"):
        _check(x, True)
    _check(x, False)  # n=2 without causal is LTS, UTE: no order between them
    y = np.zeros((2, 2, 8, 4), np.int32)
    y[0, 1, 2] = (0, 0, 3, 2)
    with pytest.raises(ValueError, match="UTS <= UTE"):
        _check(y, False)
    with pytest.raises(ValueError, match="cannot be combined with window_size"):
        _check(masks.causal(8, batch=2), True, window=(3, 0))
    with pytest.raises(ValueError, match="cannot be combined with window_size"):
        reference.attention(*(np.zeros((2, 8, 4, 8)),) * 3, causal=True, window_size=(2, 0),
                            startend_row_indices=masks.causal(8, batch=2))


def test_validation_accepts_shapes_and_valid_arrays():
    assert _check(validate.Shape((2, 4, 8, 2), "int32", "startend_row_indices"), False).shape == (2, 4, 8, 2)
    assert _check(masks.causal_document([3, 5], batch=2)).shape == (2, 1, 8, 1)
    with pytest.raises(ValueError, match="must lie in"):  # bounds are seqlen_q's, not seqlen_k's
        _check(masks.causal(8, batch=2), sq=6)
    with pytest.raises(TypeError, match="must be int32"):
        _plan(startend_row_indices=np.zeros((2, 1, 512, 2)))
    with pytest.raises(ValueError, match="last dim"):
        _plan(causal=True, startend_row_indices=(2, 1, 512, 4))
    with pytest.raises(TypeError, match="shape tuple of ints"):
        _plan(startend_row_indices=(2, 1, 512.0, 2))


# ---------------------------------------------------------------------------------------------
# The picture

def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = masks.plot(masks.causal_document([20, 30, 14]), 64, True, tmp_path / "m.png", block=(16, 16))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'cuflash\[plot\]'"):
        masks.plot(masks.causal(8), 8, True, tmp_path / "m.png")
