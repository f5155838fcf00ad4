"""Chunked attention (``attention_chunk``, FlashAttention-3's; Llama 4's chunked layers): query i
sees only the keys of its chunk, positions c * floor((i + sk - sq) / c) ... + c - 1, within its
causal mask or window. The reference's mask against FlashAttention-3's own formula, the argument
checks, the plans, the band kernels' block rule written out on the host, and (on a GPU) every
forward path against the float64 reference: dense (the warp-specialised kernel and the standard
one), split and decode tiles, packed sequences, KV caches (contiguous and paged), cuflash.torch
and cuflash.flash_attn3 (gradients: test_chunk_backward.py)."""
import importlib

import numpy as np
import pytest

import cuflash
from conftest import requires_gpu, requires_torch


def fa3_chunk_visible(sq, sk, c):
    """FlashAttention-3's test rule (construct_chunk_mask), written independently: the chunk's
    left limit is i + sk - sq minus its remainder modulo c."""
    i = np.arange(sq)[:, None] + sk - sq
    left = i - np.mod(i, c)
    j = np.arange(sk)[None, :]
    return (j >= left) & (j < left + c)


def band_visible(sq, sk, causal, window):
    i = np.arange(sq)[:, None] + sk - sq
    j = np.arange(sk)[None, :]
    left, right = window
    right = 0 if causal else right
    vis = np.ones((sq, sk), bool)
    if left >= 0:
        vis &= j >= i - left
    if right >= 0:
        vis &= j <= i + right
    return vis


# ---------------------------------------------------------------------------------------------
# The reference's mask

@pytest.mark.parametrize("sq, sk, c", [(7, 7, 3), (5, 13, 4), (13, 5, 4), (1, 9, 4), (9, 9, 20), (16, 3, 1)])
@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (2, 1)), (True, (3, -1))])
def test_reference_applies_the_chunk(sq, sk, c, causal, window):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, n, 2, 8)).astype(np.float32) for n in (sq, sk, sk))
    out, lse = cuflash.reference.attention(q, k, v, causal=causal, window_size=window, attention_chunk=c,
                                           return_lse=True)
    vis = fa3_chunk_visible(sq, sk, c) & band_visible(sq, sk, causal, window)
    s = np.einsum("bihd,bjhd->bhij", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(8)
    s = np.where(vis, s, -np.inf)
    m = np.max(s, -1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0))
    l = p.sum(-1, keepdims=True)
    want = np.einsum("bhij,bjhd->bihd", np.where(l > 0, p / np.where(l > 0, l, 1), 0), v.astype(np.float64))
    np.testing.assert_allclose(out, want.astype(np.float32), rtol=1e-5, atol=1e-6)
    with np.errstate(divide="ignore"):
        np.testing.assert_allclose(lse, np.where(l[..., 0] > 0, m[..., 0] + np.log(l[..., 0]), np.inf), rtol=1e-6)


def test_reference_chunk_as_large_as_the_keys_changes_nothing():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, n, 2, 16)).astype(np.float32) for n in (30, 40, 40))
    for causal in (False, True):
        np.testing.assert_array_equal(cuflash.reference.attention(q, k, v, causal=causal, attention_chunk=40),
                                      cuflash.reference.attention(q, k, v, causal=causal))


# ---------------------------------------------------------------------------------------------
# Arguments and plans

planmod = importlib.import_module("cuflash.plan")  # (cuflash.plan is the function)
SHAPES = dict(q=(2, 1000, 8, 128), k=(2, 1000, 2, 128))


def _plan(chunk, q=(2, 1000, 8, 128), sk=1000, **kw):
    k = (q[0], sk, 2, q[3])
    return cuflash.plan(q, k, k, attention_chunk=chunk, num_sms=132, arch=kw.pop("arch", 90), **kw)


@pytest.mark.parametrize("bad, exc", [(1.5, TypeError), (True, TypeError), ("8", TypeError), (-1, ValueError),
                                      (2 ** 40, ValueError)])
def test_bad_chunks_are_named(bad, exc):
    with pytest.raises(exc, match="attention_chunk"):
        _plan(bad)
    with pytest.raises(exc, match="attention_chunk"):
        cuflash.reference.attention(np.zeros((1, 4, 1, 8), np.float32), np.zeros((1, 4, 1, 8), np.float32),
                                    np.zeros((1, 4, 1, 8), np.float32), attention_chunk=bad)


def test_chunk_cannot_take_flashmask_nor_fp8():
    from cuflash import masks
    with pytest.raises(ValueError, match="attention_chunk cannot be combined with startend_row_indices"):
        _plan(64, causal=True, startend_row_indices=masks.causal_document([500, 500], batch=2))
    with pytest.raises(NotImplementedError, match="attention_chunk is not supported with float8_e4m3fn"):
        _plan(64, causal=True, dtype="float8_e4m3fn")


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("causal", [False, True])
def test_plan_runs_the_band_kernels(arch, causal):
    p = _plan(256, causal=causal, arch=arch)
    assert p.chunk_eff == 256 and p.launches[0].variant.local and "attention_chunk=256" in p.reason
    assert p.window_eff == ((-1, 0) if causal else (-1, -1))
    assert not p.pack_gqa
    decode = _plan(256, q=(2, 1, 8, 128), sk=5000, causal=causal, arch=arch)  # query heads packed as rows
    assert decode.pack_gqa and decode.chunk_eff == 256 and decode.launches[0].variant.chunk


def test_plan_drops_a_chunk_that_holds_every_key():
    p = _plan(1000, causal=True)
    assert p.chunk_eff == 0 and not p.local and "no chunk mask" in p.reason
    assert p.kernels == _plan(0, causal=True).kernels
    assert _plan(999, causal=True).chunk_eff == 999
    assert _plan(1000, q=(2, 1001, 8, 128), sk=1000).chunk_eff == 1000  # rows before the first key: a chunk of their own
    assert _plan(2**31 - 1024, q=(2, 1001, 8, 128), sk=1000).chunk_eff == 1000  # as launched: at most the keys
    assert _plan(1000, causal=True, kv_cache="contiguous").chunk_eff == 1000  # per-sequence lengths unknown


def test_decode_splits_count_the_chunk_tiles():
    whole = _plan(0, q=(1, 1, 8, 128), sk=32768, causal=True)
    chunked = _plan(1024, q=(1, 1, 8, 128), sk=32768, causal=True)
    assert chunked.n_blocks_per_split * chunked.num_splits <= planmod.cdiv(1024, 64) + 2 < whole.n_blocks_per_split * whole.num_splits


def test_backward_plan_is_the_pieces():
    """The backward plan of a chunked call is the varlen backward of its pieces (as cuflash.torch
    and cuflash.jax run it), the reason saying so; a chunk that holds every key is no mask."""
    p = _plan(256, causal=True, backward=True)  # q (2, 1000, 8, 128), 1000 keys: 2 x 5 pieces
    pieces_k = (2 * 5, 256, 2, 128)
    want = cuflash.plan((2 * 5, 256, 8, 128), pieces_k, pieces_k, causal=True, backward=True, varlen=True,
                        num_sms=132, arch=90)
    assert p.kernels == want.kernels and p.backward and p.problem.chunk == 0 and p.problem.varlen
    assert p.reason.startswith("attention_chunk=256: no backward kernel takes a chunk") and "2 sequence(s) cut into 5" in p.reason
    assert _plan(1000, causal=True, backward=True).kernels == _plan(0, causal=True, backward=True).kernels
    # (by shapes, a varlen plan cannot tell that queries and keys share their cu_seqlens: the
    # pieces are sized for max_seqlen_q queries, as when they do not)
    assert _plan(256, causal=True, backward=True, varlen=True).problem.seqlen_q == 1000


def test_chunk_pieces_rule():
    """The packed-sequence pieces that cuflash.torch and cuflash.jax differentiate: a leading piece
    and cdiv(max_seqlen_k, c) chunks per sequence, at most c queries each beyond the lead, c cut
    to the keys; too many for one launch is an error naming attention_chunk."""
    from cuflash.plan import chunk_pieces
    assert chunk_pieces(2, 1000, 1000, 128, 0, 8) == (128, 9, 128, 128)
    assert chunk_pieces(2, 1100, 1000, 128, 100, 8) == (128, 9, 128, 128)
    assert chunk_pieces(2, 1100, 1000, 128, 300, 8) == (128, 9, 300, 128)
    assert chunk_pieces(3, 50, 40, 10**6, 10, 8) == (40, 2, 40, 40)
    with pytest.raises(ValueError, match="attention_chunk=1 as packed sequences"):
        chunk_pieces(2, 10, 100_000, 1, 0, 8)
    with pytest.raises(ValueError, match="one cu_seqlens"):
        chunk_pieces(4000, 2**20, 2**20, 65536, 2**20, 32)


def _chunk_sample():
    """The chunk variants that plans launch for a spread of calls: sm_80 and sm_90, head dims 64,
    128, 256 (and 96: mma.sync only), prefill, decode and split, dense, packed, cached and paged."""
    out = []
    for arch in (80, 90):
        for d in (64, 96, 128, 256):
            for sq, sk, kw in ((1000, 1000, {}), (1, 8000, {}), (100, 3000, dict(num_splits=3)),
                               (500, 600, dict(varlen=True)), (64, 4000, dict(kv_cache="contiguous")),
                               (64, 4096, dict(kv_cache="paged", page_size=16)),
                               (1, 4096, dict(kv_cache="paged", page_size=256)),
                               (700, 700, dict(softcap=30.0)), (100, 3000, dict(num_splits=3, softcap=30.0)),
                               (64, 4096, dict(kv_cache="paged", page_size=16, softcap=30.0, num_splits=2))):
                p = _plan(300, q=(2, sq, 8, d), sk=sk, causal=True, arch=arch, **kw)
                out += [l.variant for l in p.launches if getattr(l.variant, "chunk", False)]
    return list(dict.fromkeys(out))


CHUNK_SAMPLE = _chunk_sample()


def test_sample_covers_every_chunk_kernel_kind():
    kinds = {(v.arch, getattr(v, "kind", v.family)) for v in CHUNK_SAMPLE}
    assert kinds >= {(80, "fwd"), (80, "fwd_split"), (90, "fwd_ws"), (90, "fwd_split")}
    assert any(getattr(v, "decode", False) for v in CHUNK_SAMPLE)
    assert any(getattr(v, "paged", False) or getattr(v, "kv", "") == "paged" for v in CHUNK_SAMPLE)


@pytest.mark.parametrize("v", CHUNK_SAMPLE, ids=lambda v: v.name)
def test_chunk_variant_compiles_without_spills(compiled, v):
    from conftest import assert_compiled_clean
    c = compiled[v]
    assert_compiled_clean(c, v)
    assert "chunk" in v.name and v.local


def test_chunk_changes_only_the_chunk_variants():
    """A chunk variant renders the chunk's code; the same variant without it renders none, so the
    kernels without a chunk are those of before (their machine code was compared when it came)."""
    from dataclasses import replace
    from cuflash import codegen
    for v in CHUNK_SAMPLE[:6]:
        src, plain = codegen.render(v), codegen.render(replace(v, chunk=False))
        assert "int attention_chunk;" in src and "const Chunk chunk{" in src
        assert "int attention_chunk;" not in plain and "const Chunk chunk{" not in plain


# ---------------------------------------------------------------------------------------------
# The band kernels' block rule (templates/common/block_info.cuh: KvBlocks with a Chunk; mask.cuh:
# apply_mask) written out: the K/V blocks [lo, hi) a tile walks hold every key its rows see, and
# the blocks in [left, full) need no mask.

def _floor_chunk(pos, c):
    return (pos // c) * c


def _kv_blocks(m0, bm, bn, sq, sk, diag, diag_lo, c):
    off = sk - sq

    def upper(r):
        u = r + diag
        return min(u, _floor_chunk(r + off, c) + c - 1) if c else u

    def lower(r):
        l = r + diag_lo
        return max(l, _floor_chunk(r + off, c)) if c else l
    hi = min(-(-sk // bn), -(-max(0, upper(m0 + bm - 1) + 1) // bn))
    lo = max(0, lower(m0)) // bn
    full = min(sk // bn, max(0, upper(m0) + 1) // bn)
    left = -(-lower(m0 + bm - 1) // bn)
    return lo, hi, full, left


@pytest.mark.parametrize("sq, sk", [(300, 2000), (1000, 1000), (64, 3000)])
@pytest.mark.parametrize("c", [1, 46, 100, 500])
@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (200, -1)), (False, (-1, 40))])
def test_split_block_count_covers_every_walk(sq, sk, c, causal, window):
    """The split kernel walks band_tiles' count from each block's lo: it must cover [lo, hi)."""
    left_w, right_w = window
    right_w = 0 if causal else right_w
    off = sk - sq
    diag = sk if right_w < 0 else off + right_w
    diag_lo = off - left_w if left_w >= 0 else -(1 << 30)
    eff = planmod.effective_window(causal, window, sq, sk)
    for bm, bn in ((64, 128), (64, 64), (16, 64)):
        n = planmod.band_tiles(bm, eff, sq, sk, bn, c)
        for m0 in range(0, sq, bm):
            lo, hi, _, _ = _kv_blocks(m0, bm, bn, sq, sk, diag, diag_lo, c)
            assert hi - lo <= n, (bm, bn, m0, lo, hi, n)


@pytest.mark.parametrize("sq, sk", [(300, 300), (77, 300), (300, 77), (1, 500), (129, 1000)])
@pytest.mark.parametrize("c", [1, 7, 64, 100, 128, 200, 1000])
@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (30, 40)), (True, (90, -1))])
@pytest.mark.parametrize("bm, bn", [(128, 128), (64, 64), (16, 64)])
def test_kernel_block_rule_is_exact(sq, sk, c, causal, window, bm, bn):
    left_w, right_w = window
    right_w = 0 if causal else right_w
    off = sk - sq
    diag = sk if right_w < 0 else off + right_w
    diag_lo = off - left_w if left_w >= 0 else -(1 << 30)
    vis = fa3_chunk_visible(sq, sk, c) & band_visible(sq, sk, causal, window)
    for m0 in range(0, sq, bm):
        rows = vis[m0:m0 + bm]
        lo, hi, full, left = _kv_blocks(m0, bm, bn, sq, sk, diag, diag_lo, c)
        seen = np.flatnonzero(rows.any(0))
        if seen.size:
            assert lo * bn <= seen[0] and seen[-1] < hi * bn, (m0, lo, hi, seen[[0, -1]])
        for n in range(max(lo, left), min(hi, full)):  # walked without a mask: every row sees every key
            assert rows[:, n * bn:(n + 1) * bn].all(), (m0, n)


# ---------------------------------------------------------------------------------------------
# GPU: the forward paths against the float64 reference (flash-attn's rule), outputs poisoned

def _inputs(rng, b, sq, sk, h, hk, d, dtype="bfloat16"):
    from test_gpu_forward import torch_inputs
    return torch_inputs(rng, b, sq, sk, h, hk, d, dtype)


def _check(out, q, k, v, **kw):
    from test_gpu_forward import check
    check(out, q, k, v, **kw)


@requires_gpu
@requires_torch
@pytest.mark.parametrize("sq, sk", [(1000, 1000), (700, 1500), (1500, 700), (300, 2500)])
@pytest.mark.parametrize("c", [64, 100, 256, 1000])
@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (-1, -1)), (False, (300, 50)), (True, (200, -1))])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_dense(rng, sq, sk, c, causal, window, d):
    import torch
    q, k, v = _inputs(rng, 2, sq, sk, 8, 2, d)
    out = torch.full_like(q, float("nan"))
    res, lse = cuflash.attention(q, k, v, causal=causal, window_size=window, attention_chunk=c, out=out,
                                 return_lse=True)
    assert res is out
    _check(out, q, k, v, causal=causal, window_size=window, attention_chunk=c)
    from test_gpu_forward import to_np
    _, want = cuflash.reference.attention(to_np(q), to_np(k), to_np(v), causal=causal, window_size=window,
                                          attention_chunk=c, return_lse=True)
    got = lse.cpu().numpy()
    assert np.array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-3, atol=1e-3)


@requires_gpu
@requires_torch
@pytest.mark.parametrize("d, dtype", [(256, "bfloat16"), (96, "float16"), (32, "bfloat16")])
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_gpu_other_head_dims_splits_and_softcap(rng, d, dtype, num_splits):
    import torch
    q, k, v = _inputs(rng, 1, 333, 1200, 4, 1, d, dtype)
    out = torch.full_like(q, float("nan"))
    cuflash.attention(q, k, v, causal=True, attention_chunk=160, softcap=20.0, num_splits=num_splits, out=out)
    _check(out, q, k, v, causal=True, attention_chunk=160, softcap=20.0)


@requires_gpu
@requires_torch
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_chunk_near_int_max(rng, causal):
    """A chunk near 2**31 with rows before the first key (seqlen_q > seqlen_k): those rows see no
    key, the others every key (the chunk's arithmetic must not overflow)."""
    import torch
    q, k, v = _inputs(rng, 1, 1100, 1000, 4, 2, 64)
    out = torch.full_like(q, float("nan"))
    cuflash.attention(q, k, v, causal=causal, attention_chunk=2**31 - 1024, out=out)
    _check(out, q, k, v, causal=causal, attention_chunk=2**31 - 1024)


@requires_gpu
@requires_torch
@pytest.mark.parametrize("b, sq, sk, h, hk, d, c, num_splits", [
    (1, 300, 2000, 1, 1, 128, 46, 0), (1, 300, 2000, 1, 1, 128, 46, 5), (2, 1000, 1000, 8, 2, 64, 500, 2),
    (2, 1000, 1000, 8, 2, 64, 300, 3), (1, 129, 3000, 4, 4, 128, 100, 7)])
def test_gpu_split_crossing_chunks(rng, b, sq, sk, h, hk, d, c, num_splits):
    """Non-causal split-KV calls whose query blocks cross chunk boundaries: each split walks its
    share of every chunk a block's rows see (no keys left out)."""
    import torch
    q, k, v = _inputs(rng, b, sq, sk, h, hk, d)
    out = torch.full_like(q, float("nan"))
    cuflash.attention(q, k, v, attention_chunk=c, num_splits=num_splits, out=out)
    _check(out, q, k, v, attention_chunk=c)


@requires_gpu
@requires_torch
@pytest.mark.parametrize("sk", [100, 4097, 20000])
@pytest.mark.parametrize("h, hk", [(8, 8), (8, 2), (8, 1)])
def test_gpu_decode(rng, sk, h, hk):
    import torch
    q, k, v = _inputs(rng, 3, 1, sk, h, hk, 128)
    for c in (1, 64, 1000):
        out = torch.full_like(q, float("nan"))
        cuflash.attention(q, k, v, causal=True, attention_chunk=c, out=out)
        _check(out, q, k, v, causal=True, attention_chunk=c)


@requires_gpu
@requires_torch
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_varlen(rng, causal):
    import torch
    from test_gpu_forward import to_np
    lens_q, lens_k = [300, 1, 0, 900, 77], [300, 500, 10, 1200, 40]
    cq = torch.tensor(np.cumsum([0] + lens_q), dtype=torch.int32, device="cuda")
    ck = torch.tensor(np.cumsum([0] + lens_k), dtype=torch.int32, device="cuda")
    q, k, v = _inputs(rng, 1, sum(lens_q), sum(lens_k), 6, 2, 128)
    q, k, v = q[0], k[0], v[0]
    out = torch.full_like(q, float("nan"))
    cuflash.attention_varlen(q, k, v, cq, ck, max(lens_q), max(lens_k), causal=causal, attention_chunk=128, out=out)
    want = cuflash.reference.attention_varlen(to_np(q), to_np(k), to_np(v), cq.cpu().numpy(), ck.cpu().numpy(),
                                              causal=causal, attention_chunk=128)
    same = cuflash.reference.attention_varlen(to_np(q), to_np(k), to_np(v), cq.cpu().numpy(), ck.cpu().numpy(),
                                              causal=causal, attention_chunk=128, precision="same")
    err = np.abs(to_np(out).astype(np.float64) - want).max()
    assert err <= 2 * np.abs(same.astype(np.float64) - want).max() + 1e-5


@requires_gpu
@requires_torch
@pytest.mark.parametrize("mode", ["dense", "paged16", "paged256"])
@pytest.mark.parametrize("sq", [1, 64])
def test_gpu_kvcache(rng, mode, sq):
    """Per-sequence cache lengths: each sequence's chunks follow its own key count."""
    import torch
    from test_gpu_kvcache import make_case
    from test_gpu_forward import to_np
    from cuflash.reference import check_close
    q, kc, vc, kn, vn, seqlens, kw, ks, vs, _, _ = make_case(rng, 3, sq, 3000, 8, 2, 128, mode, sq)
    out = torch.full_like(q, float("nan"))
    cuflash.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=True, attention_chunk=500,
                                   out=out, **kw)
    for i in range(q.shape[0]):
        ok, err, bound = check_close(to_np(out[i:i + 1]), to_np(q[i:i + 1]), to_np(ks[i][None]), to_np(vs[i][None]),
                                     causal=True, attention_chunk=500)
        assert ok, f"batch {i}: max error {err:.3g} exceeds bound {bound:.3g}"


@requires_gpu
@requires_torch
def test_gpu_torch_chunk_and_no_op_chunk():
    """cuflash.torch: without gradients the chunk kernels (as cuflash.attention); a chunk that
    holds every key runs as no chunk (bitwise), gradients included. (Gradients with a chunk:
    test_chunk_backward.py.)"""
    import torch
    import cuflash.torch as ct
    rng = np.random.default_rng(3)
    q, k, v = (t.requires_grad_() for t in _inputs(rng, 2, 500, 500, 4, 4, 64))
    with torch.no_grad():
        out = ct.attention(q, k, v, causal=True, attention_chunk=128)
    assert torch.equal(out, cuflash.attention(q.detach(), k.detach(), v.detach(), causal=True, attention_chunk=128))
    _check(out, q.detach(), k.detach(), v.detach(), causal=True, attention_chunk=128)
    short = ct.attention(q, k, v, causal=True, attention_chunk=500)  # the chunk holds every key: no mask
    short.sum().backward()
    assert torch.equal(short, ct.attention(q, k, v, causal=True)) and q.grad is not None


@requires_gpu
@requires_torch
@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (-1, -1)), (False, (100, 20))])
def test_gpu_flash_attn3(rng, causal, window):
    """cuflash.flash_attn3 takes attention_chunk as FlashAttention-3 does, against its own rule."""
    import torch
    from cuflash import flash_attn3
    q, k, v = _inputs(rng, 2, 400, 600, 6, 3, 128)
    c = int(rng.integers(1, 1200))
    out, lse = flash_attn3.flash_attn_func(q, k, v, causal=causal, window_size=window, attention_chunk=c,
                                           return_attn_probs=True)
    vis = fa3_chunk_visible(400, 600, c) & band_visible(400, 600, causal, window)
    s = torch.einsum("bihd,bjhd->bhij", q.float(), k.repeat_interleave(2, 2).float()) / 128 ** 0.5
    s = s.masked_fill(~torch.from_numpy(vis).cuda(), float("-inf"))
    want = torch.einsum("bhij,bjhd->bihd", torch.softmax(s, -1).nan_to_num(0.0), v.repeat_interleave(2, 2).float())
    assert (out.float() - want).abs().max().item() < 2e-2
    kv = cuflash.attention_with_kvcache(q[:, -1:].contiguous(), k.contiguous(), v.contiguous(), causal=causal,
                                        window_size=window, attention_chunk=c)
    got = flash_attn3.flash_attn_with_kvcache(q[:, -1:].contiguous(), k.contiguous(), v.contiguous(), causal=causal,
                                              window_size=window, attention_chunk=c)
    assert torch.equal(kv, got)
