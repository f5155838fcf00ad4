"""attention_with_kvcache on the GPU: appends into contiguous and paged caches, per-sequence
lengths, cache_batch_idx, GQA, causal, forced splits; checked against the float64 reference
with flash-attn's rule, and the caches checked element by element."""
import numpy as np
import pytest

from conftest import paged_cache, requires_gpu, requires_torch
from test_gpu_forward import to_np

pytestmark = [requires_gpu, requires_torch]

SHAPES = [(1, 128), (1, 339), (3, 1024), (64, 800), (64, 256), (3, 799), (64, 2048), (16, 20000),
          (1, 131072), (128, 128)]


def make_case(rng, b, sq, sk, h, hk, d, mode, s_new, dtype="bfloat16"):
    """Inputs plus, per batch, the key/value rows the call must attend to."""
    import torch
    tdt = getattr(torch, dtype)
    rnd = lambda *s: torch.from_numpy(rng.standard_normal(s, dtype=np.float32)).to("cuda", tdt)
    lens = rng.integers(max(s_new, 1), sk + 1, size=b)
    lens[0] = sk
    old = lens - s_new
    cap = sk + 5
    q = rnd(b, sq, h, d)
    k_new = rnd(b, s_new, hk, d) if s_new else None
    v_new = rnd(b, s_new, hk, d) if s_new else None
    kw = {}
    if mode.startswith("paged"):
        page = int(mode[5:])
        k_cache, v_cache, kw["block_table"], rows = paged_cache(rng, rnd, b, -(-cap // page), page, hk, d, 3)
    else:
        nb = b + 2 if mode == "batch_idx" else b
        k_cache, v_cache = rnd(nb, cap, hk, d), rnd(nb, cap, hk, d)
        idx = np.arange(b)
        if mode == "batch_idx":
            idx = rng.permutation(nb)[:b]
            kw["cache_batch_idx"] = torch.from_numpy(idx.astype(np.int32)).cuda()
        rows = lambda c, i, n: c[idx[i], :n]
    # expected keys: the old cache rows, then the appended ones
    ks, vs = [], []
    for i in range(b):
        kk, vv = rows(k_cache, i, int(old[i])), rows(v_cache, i, int(old[i]))
        if s_new:
            kk, vv = torch.cat([kk, k_new[i]]), torch.cat([vv, v_new[i]])
        ks.append(kk.clone())
        vs.append(vv.clone())
    return q, k_cache, v_cache, k_new, v_new, torch.from_numpy(old.astype(np.int32)).cuda(), kw, ks, vs, rows, lens


def check_batches(out, q, ks, vs, causal):
    from cuflash.reference import check_close
    for i in range(q.shape[0]):
        ok, err, bound = check_close(to_np(out[i:i + 1]), to_np(q[i:i + 1]), to_np(ks[i][None]),
                                     to_np(vs[i][None]), causal=causal)
        assert ok, f"batch {i}: max error {err:.3g} exceeds bound {bound:.3g}"


@pytest.mark.parametrize("sq,sk", SHAPES)
@pytest.mark.parametrize("mode", ["dense", "batch_idx", "paged16", "paged64", "paged256"])
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache(rng, sq, sk, mode, causal):
    import torch
    import cuflash
    if sk >= 20000 and mode not in ("dense", "paged256"):
        pytest.skip("long caches: covered by the dense and paged256 modes (keeps the run short)")
    b = 1 if sk >= 20000 else 2
    h, hk = (8, 2) if sq < 64 else (4, 4)
    s_new = sq if sq <= 64 else 0
    q, kc, vc, kn, vn, seqlens, kw, ks, vs, rows, lens = make_case(rng, b, sq, sk, h, hk, 128, mode, s_new)
    out = torch.full_like(q, float("nan"))
    res = cuflash.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=causal, out=out, **kw)
    assert res is out
    check_batches(out, q, ks, vs, causal)
    for i in range(b):  # the cache now holds exactly the expected rows
        assert torch.equal(rows(kc, i, int(lens[i])), ks[i]) and torch.equal(rows(vc, i, int(lens[i])), vs[i])


@pytest.mark.parametrize("mode", ["dense", "batch_idx", "paged16", "paged64", "paged256"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_kvcache_chunked_prefill(rng, mode, causal, d):
    """A chunk of 256 new tokens appended to caches of up to 900 rows: enough query blocks to fill
    the GPU, so the standard kernel runs (on sm_90 the wgmma kernel, whose loads then apply the
    per-sequence lengths, cache_batch_idx and page lookups)."""
    import torch
    import cuflash
    b, sq, sk, h, hk = 4, 256, 900, 16, 4
    assert cuflash.plan((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), causal=causal).num_splits == 1
    q, kc, vc, kn, vn, seqlens, kw, ks, vs, rows, lens = make_case(rng, b, sq, sk, h, hk, d, mode, sq)
    out = torch.full_like(q, float("nan"))
    cuflash.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=causal, out=out, **kw)
    check_batches(out, q, ks, vs, causal)
    for i in range(b):
        assert torch.equal(rows(kc, i, int(lens[i])), ks[i]) and torch.equal(rows(vc, i, int(lens[i])), vs[i])


@pytest.mark.parametrize("mode,d", [("dense", 128), ("batch_idx", 64), ("paged16", 128), ("paged64", 256),
                                    ("paged256", 128)])
@pytest.mark.parametrize("sq,num_splits", [(1, 0), (256, 3), (256, 1), (200, 1)])
def test_kvcache_nan_past_the_keys(rng, mode, d, sq, num_splits):
    """Cache rows past each sequence's keys hold NaN (a cache made with torch.empty): decode, the
    split kernels and the standard kernels zero-fill them, as FlashAttention-2 does; the
    warp-specialised forward (sm_90, chunked prefill without a split) zeroes the V rows of its
    tail tile once loaded (TMA boxes), or zero-fills them (gathered pages), so 0 * NaN never
    reaches P V. The output is finite and right."""
    import torch
    import cuflash
    b, sk, h, hk = 3, 700, 8, 2
    q, kc, vc, kn, vn, seqlens, kw, ks, vs, rows, lens = make_case(rng, b, sq, sk, h, hk, d, mode, sq)
    for i in range(b):  # from the first appended row: the append overwrites [old, old + sq)
        if mode.startswith("paged"):
            page = kc.shape[1]
            j = torch.arange(int(lens[i]) - sq, kw["block_table"].shape[1] * page, device="cuda")
            at = (kw["block_table"][i][j // page].long(), j % page)
        else:
            at = (int(kw["cache_batch_idx"][i]) if "cache_batch_idx" in kw else i, slice(int(lens[i]) - sq, None))
        kc[at] = float("nan")
        vc[at] = float("nan")
    out = cuflash.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=True,
                                         num_splits=num_splits, **kw)
    if torch.cuda.get_device_capability() == (9, 0) and sq >= 200 and num_splits == 1:
        paged = mode.startswith("paged")
        shape = (kc.shape[0], kc.shape[1], hk, d) if not paged else (b, kw["block_table"].shape[1] * kc.shape[1], hk, d)
        plan = cuflash.plan(tuple(q.shape), shape, shape, causal=True, num_splits=1,
                            kv_cache="paged" if paged else "contiguous", page_size=kc.shape[1] if paged else None)
        assert plan.kernels[0].startswith("fwd_ws_"), plan.kernels  # the kernel that loads past the keys
    assert bool(torch.isfinite(out).all())
    check_batches(out, q, ks, vs, True)


@pytest.mark.parametrize("num_splits", [0, 1, 3, 128])
@pytest.mark.parametrize("h,hk", [(8, 8), (8, 2), (8, 1)])
def test_kvcache_splits_and_heads(rng, num_splits, h, hk):
    import torch
    import cuflash
    q, kc, vc, kn, vn, seqlens, kw, ks, vs, _, _ = make_case(rng, 3, 1, 700, h, hk, 64, "paged16", 1, "float16")
    out, lse = cuflash.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=True,
                                              num_splits=num_splits, return_lse=True, **kw)
    check_batches(out, q, ks, vs, True)
    assert torch.isfinite(lse).all()


def test_kvcache_int_seqlens_and_no_append(rng):
    import torch
    import cuflash
    q, kc, vc, _, _, _, _, _, _, _, _ = make_case(rng, 2, 4, 300, 4, 2, 128, "dense", 0)
    out = cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=250, causal=True)
    check_batches(out, q, [kc[i, :250] for i in range(2)], [vc[i, :250] for i in range(2)], True)
    full = cuflash.attention_with_kvcache(q, kc, vc)  # no lengths: the whole cache
    ref = cuflash.attention(q, kc, vc)
    assert torch.equal(full, ref)


def test_kvcache_matches_plan(rng):
    """attention_with_kvcache dispatches through the same plan (split-KV for long decode)."""
    import cuflash
    q, kc, vc, kn, vn, seqlens, kw, ks, vs, _, _ = make_case(rng, 1, 1, 4000, 28, 4, 128, "dense", 1)
    out = cuflash.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=True)
    check_batches(out, q, ks, vs, True)
