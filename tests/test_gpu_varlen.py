"""Variable-length batches, sliding windows, softcap and ALiBi on the GPU, across attention,
attention_varlen and attention_with_kvcache; each crossed with causal, GQA and a forced split-KV,
against the float64 reference with flash-attn's rule (outputs NaN-poisoned before launch)."""
import numpy as np
import pytest

from conftest import requires_gpu, requires_torch
from test_gpu_forward import to_np, torch_inputs

pytestmark = [requires_gpu, requires_torch]

WINDOWS = [(-1, -1), (37, 0), (37, 37), (0, 0)]
MODS = [(0.0, None), (50.0, None), (0.0, "h"), (50.0, "bh")]  # (softcap, ALiBi slopes shape)
SPLITS = [0, 1, 7]


def slopes(rng, kind, b, h):
    import torch
    if kind is None:
        return None
    shape = (h,) if kind == "h" else (b, h)
    return torch.from_numpy(rng.uniform(0.01, 0.3, size=shape).astype(np.float32)).cuda()


def check_against(out, lse, ref, ref_same, ref_lse):
    from cuflash.reference import max_abs_err
    err, bound = max_abs_err(to_np(out), ref), 2 * max_abs_err(ref_same, ref) + 1e-5
    assert err <= bound, f"max error {err:.3g} exceeds bound {bound:.3g}"
    if lse is not None:
        got = to_np(lse).astype(np.float64)
        fin = np.isfinite(ref_lse)
        assert np.array_equal(np.isfinite(got), fin) and np.all(got[~fin] == np.inf)
        np.testing.assert_allclose(got[fin], ref_lse[fin], rtol=1e-3, atol=2e-3)


# ---------------------------------------------------------------------------------------------
# Dense attention()

@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("softcap,alibi", MODS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,hk", [(4, 4), (8, 2)])
@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("sq,sk", [(113, 203), (1, 239), (256, 128)])
def test_dense_mods(rng, window, softcap, alibi, causal, h, hk, splits, sq, sk):
    import torch
    import cuflash
    from cuflash import reference
    dtype = "bfloat16" if (sq + splits) % 2 else "float16"
    q, k, v = torch_inputs(rng, 2, sq, sk, h, hk, 64, dtype)
    a = slopes(rng, alibi, 2, h)
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    out = torch.full_like(q, float("nan"))
    res, lse = cuflash.attention(q, k, v, out=out, return_lse=True, num_splits=splits, alibi_slopes=a, **kw)
    assert res is out
    args = [to_np(x) for x in (q, k, v)]
    ra = None if a is None else a.cpu().numpy()
    ref, ref_lse = reference.attention(*args, alibi_slopes=ra, return_lse=True, **kw)
    same = reference.attention(*args, alibi_slopes=ra, precision="same", **kw)
    check_against(out, lse, ref, same, ref_lse)


@pytest.mark.parametrize("window", [(4095, 0), (100, 100)])
def test_decode_window_splits(rng, window):
    """Sliding-window decode over a long cache: the band's tiles only, spread over splits."""
    import cuflash
    from cuflash import reference
    q, k, v = torch_inputs(rng, 1, 1, 20000, 28, 4, 128, "bfloat16")
    plan = cuflash.plan(q, k, v, causal=True, window_size=window)
    assert "local" in plan.kernels[0]
    # (4095, 0): 65 tiles of 64 keys over 13 splits (4 blocks of the 7 query heads of a KV head
    # packed as rows); (100, 100): 3 tiles, too few to split
    assert plan.pack_gqa and plan.num_splits == (13 if window == (4095, 0) else 1), str(plan)
    out, lse = cuflash.attention(q, k, v, causal=True, window_size=window, return_lse=True)
    args = [to_np(x) for x in (q, k, v)]
    ref, ref_lse = reference.attention(*args, causal=True, window_size=window, return_lse=True)
    same = reference.attention(*args, causal=True, window_size=window, precision="same")
    check_against(out, lse, ref, same, ref_lse)


# ---------------------------------------------------------------------------------------------
# attention_varlen()

def varlen_case(rng, b, max_q, max_k, h, hk, d, dtype, same_lengths=False):
    import torch
    lq = rng.integers(0, max_q + 1, size=b)
    lk = lq.copy() if same_lengths else rng.integers(0, max_k + 1, size=b)
    lq[0], lk[0] = max_q, max_k              # the maxima are reached
    if b > 2:
        lq[1], lk[1] = 0, rng.integers(0, max_k + 1)  # an empty query sequence
        lq[2] = min(1, max_q)                 # a length-1 sequence
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    tdt = getattr(torch, dtype)
    mk = lambda *s: torch.from_numpy(rng.standard_normal(s, dtype=np.float32)).to("cuda", tdt)
    q, k, v = mk(int(cq[-1]), h, d), mk(int(ck[-1]), hk, d), mk(int(ck[-1]), hk, d)
    return q, k, v, cq, ck, int(lq.max()), int(lk.max())


def run_varlen(q, k, v, cq, ck, mq, mk, a, **kw):
    import torch
    import cuflash
    out = torch.full_like(q, float("nan"))
    res, lse = cuflash.attention_varlen(q, k, v, torch.from_numpy(cq).cuda(), torch.from_numpy(ck).cuda(),
                                        mq, mk, out=out, return_lse=True, alibi_slopes=a, **kw)
    assert res is out and tuple(lse.shape) == (q.shape[1], q.shape[0])
    return out, lse


def ref_varlen(q, k, v, cq, ck, a, kw, block_kv=None):
    from cuflash import reference
    kw = {n: x for n, x in kw.items() if n != "num_splits"}
    args = [to_np(x) for x in (q, k, v)]
    if block_kv is not None:
        args[1:] = block_kv
    ra = None if a is None else a.cpu().numpy()
    ref, ref_lse = reference.attention_varlen(*args, cq, ck, alibi_slopes=ra, return_lse=True, **kw)
    same = reference.attention_varlen(*args, cq, ck, alibi_slopes=ra, precision="same", **kw)
    return ref, same, ref_lse


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_nan_in_the_next_sequence(rng, d, causal):
    """A sequence's tail K/V tile also loads the next sequence's first tokens (masked). NaN there
    (that sequence's own data) must not reach this sequence's output: 0 * NaN in P V would. No
    split (three sequences would split), so that on sm_90 the warp-specialised kernel runs."""
    import torch
    from cuflash import reference
    lk = np.array([300, 77, 500], np.int32)
    cq = np.array([0, 256, 512, 768], np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    mk = lambda *s: torch.from_numpy(rng.standard_normal(s, dtype=np.float32)).to("cuda", torch.bfloat16)
    q, k, v = mk(768, 8, d), mk(int(ck[-1]), 2, d), mk(int(ck[-1]), 2, d)
    k[ck[1]:ck[2]] = float("nan")  # sequence 1: its own output is NaN, the others' must not be
    v[ck[1]:ck[2]] = float("nan")
    out, lse = run_varlen(q, k, v, cq, ck, 256, 500, None, causal=causal, num_splits=1)
    if torch.cuda.get_device_capability() == (9, 0):  # the kernel whose tail tiles load the next tokens
        import cuflash
        plan = cuflash.plan((3, 256, 8, d), (3, 500, 2, d), (3, 500, 2, d), causal=causal, varlen=True, num_splits=1)
        assert plan.kernels[0].startswith("fwd_ws_"), plan.kernels
    for i in (0, 2):
        rows = slice(cq[i], cq[i + 1])
        assert bool(torch.isfinite(out[rows]).all()), f"sequence {i}"
        args = [to_np(x[s]) for x, s in ((q, rows), (k, slice(ck[i], ck[i + 1])), (v, slice(ck[i], ck[i + 1])))]
        ref = reference.attention(*[a[None] for a in args], causal=causal)[0]
        same = reference.attention(*[a[None] for a in args], causal=causal, precision="same")[0]
        check_against(out[rows], None, ref, same, None)


@pytest.mark.parametrize("chunk", [0, 64])
def test_varlen_maxima_as_upper_bounds(rng, chunk):
    """max_seqlen_q / max_seqlen_k far above the rows (a fixed bound, as callers pass the model's
    context to avoid a sync; flash-attn takes it): the output, LSE and gradients of the true maxima
    (within bf16 rounding: the plans may differ), through cuflash.torch (autograd, chunked or not)
    and flash-attn's varlen function."""
    import torch
    import cuflash.torch as ct
    from cuflash.flash_attn import flash_attn_varlen_func
    q, k, v, cq, ck, mq, mk = varlen_case(rng, 4, 97, 150, 8, 2, 128, "bfloat16")
    cu_q, cu_k = torch.from_numpy(cq).cuda(), torch.from_numpy(ck).cuda()
    dout = torch.randn_like(q)
    results = []
    for maxima in ((mq, mk), (1 << 20, 1 << 20)):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = ct.attention_varlen(*x, cu_q, cu_k, *maxima, causal=True, return_lse=True,
                                       attention_chunk=chunk, deterministic=True)
        results.append((out, lse, *torch.autograd.grad(out, x, dout)))
        if not chunk:
            results[-1] += (flash_attn_varlen_func(q, k, v, cu_q, cu_k, *maxima, causal=True),)
    for a, b in zip(*results):  # (the plans may differ: within bf16 rounding)
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("max_q,max_k", [(113, 203), (128, 217), (1, 239), (3, 799), (127, 513),
                                         (1024, 1023), (1, 147)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,hk", [(4, 4), (6, 2)])
@pytest.mark.parametrize("d", [64, 128, 80])
def test_varlen(rng, max_q, max_k, causal, h, hk, d):
    dtype = "bfloat16" if (max_q + d) % 2 else "float16"
    q, k, v, cq, ck, mq, mk = varlen_case(rng, 5, max_q, max_k, h, hk, d, dtype)
    out, lse = run_varlen(q, k, v, cq, ck, mq, mk, None, causal=causal)
    check_against(out, lse, *ref_varlen(q, k, v, cq, ck, None, dict(causal=causal)))


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("softcap,alibi", MODS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("max_q,max_k", [(113, 203), (1, 339)])
def test_varlen_mods(rng, window, softcap, alibi, causal, splits, max_q, max_k):
    q, k, v, cq, ck, mq, mk = varlen_case(rng, 4, max_q, max_k, 8, 2, 64, "bfloat16")
    a = slopes(rng, alibi, 4, 8)
    kw = dict(causal=causal, window_size=window, softcap=softcap, num_splits=splits)
    out, lse = run_varlen(q, k, v, cq, ck, mq, mk, a, **kw)
    check_against(out, lse, *ref_varlen(q, k, v, cq, ck, a, kw))


def test_varlen_decode_uses_split_plan(rng):
    """max_seqlen_q == 1 (one new token per sequence) runs the GQA-packed split-KV decode."""
    import torch
    import cuflash
    from cuflash.api import device_facts
    from cuflash.plan import Problem, make_plan
    q, k, v, cq, ck, mq, mk = varlen_case(rng, 3, 1, 5000, 32, 8, 128, "bfloat16")
    plan = make_plan(Problem(3, mq, mk, 32, 8, 128, "bf16", True, varlen=True), device_facts(0))
    assert plan.pack_gqa and plan.num_splits > 1, str(plan)
    out, lse = run_varlen(q, k, v, cq, ck, mq, mk, None, causal=True)
    check_against(out, lse, *ref_varlen(q, k, v, cq, ck, None, dict(causal=True)))


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("max_q,max_k", [(1, 339), (113, 203)])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_paged(rng, page, max_q, max_k, causal):
    import torch
    q, _, _, cq, ck, mq, mk = varlen_case(rng, 4, max_q, max_k, 8, 2, 64, "float16")
    lk = np.diff(ck)
    per_seq = -(-max(mk, 1) // page)
    n_pages = 4 * per_seq + 2
    rnd = lambda *s: torch.from_numpy(rng.standard_normal(s, dtype=np.float32)).to("cuda", torch.float16)
    kc, vc = rnd(n_pages, page, 2, 64), rnd(n_pages, page, 2, 64)
    table = rng.permutation(n_pages)[:4 * per_seq].reshape(4, per_seq).astype(np.int32)
    # the same keys, packed, for the reference
    rows = lambda c: np.concatenate([to_np(c)[table[b][np.arange(n) // page], np.arange(n) % page]
                                     for b, n in enumerate(lk)])
    import cuflash
    out = torch.full_like(q, float("nan"))
    res, lse = cuflash.attention_varlen(q, kc, vc, torch.from_numpy(cq).cuda(), torch.from_numpy(ck).cuda(),
                                        mq, mk, causal=causal, block_table=torch.from_numpy(table).cuda(),
                                        out=out, return_lse=True)
    check_against(out, lse, *ref_varlen(q, None, None, cq, ck, None, dict(causal=causal),
                                        block_kv=(rows(kc), rows(vc))))


def test_varlen_host_arrays_and_empty_batch(rng):
    """NumPy in, NumPy out; a batch with no tokens gives empty outputs and no launch."""
    import ml_dtypes
    import cuflash
    from cuflash import reference
    cq, ck = np.array([0, 5, 5, 12], np.int32), np.array([0, 9, 9, 9], np.int32)
    mk_ = lambda *s: rng.standard_normal(s).astype(np.float16)
    q, k, v = mk_(12, 4, 32), mk_(9, 2, 32), mk_(9, 2, 32)
    out, lse = cuflash.attention_varlen(q, k, v, cq, ck, 7, 9, causal=True, return_lse=True)
    assert isinstance(out, np.ndarray) and lse.shape == (4, 12)
    ref, ref_lse = reference.attention_varlen(q, k, v, cq, ck, causal=True, return_lse=True)
    same = reference.attention_varlen(q, k, v, cq, ck, causal=True, precision="same")
    check_against(out, lse, ref, same, ref_lse)
    assert np.all(out[5:] == 0) and np.all(lse[:, 5:] == np.inf)  # sequence 2 has no keys
    z = np.zeros((0, 4, 32), np.float16)
    o0 = cuflash.attention_varlen(z, z[:, :2], z[:, :2], np.zeros(1, np.int32), np.zeros(1, np.int32), 0, 0)
    assert o0.shape == (0, 4, 32)


# ---------------------------------------------------------------------------------------------
# attention_with_kvcache()

@pytest.mark.parametrize("window", [(-1, -1), (60, 0), (0, 0)])
@pytest.mark.parametrize("softcap,alibi", MODS)
@pytest.mark.parametrize("sq", [1, 4])
@pytest.mark.parametrize("splits", [0, 5])
def test_kvcache_mods(rng, window, softcap, alibi, sq, splits):
    import torch
    import cuflash
    from cuflash import reference
    b, h, hk, d, cap = 3, 8, 2, 64, 400
    q, kc, vc = torch_inputs(rng, b, sq, cap, h, hk, d, "bfloat16")
    lens = np.array([cap, 123, 7], np.int32)
    a = slopes(rng, alibi, b, h)
    kw = dict(causal=True, window_size=window, softcap=softcap)
    out = torch.full_like(q, float("nan"))
    cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=torch.from_numpy(lens).cuda(), out=out,
                                   num_splits=splits, alibi_slopes=a, **kw)
    qn, kn, vn = (to_np(x) for x in (q, kc, vc))
    for i in range(b):
        ai = None if a is None else (a.cpu().numpy() if a.dim() == 1 else a[i:i + 1].cpu().numpy())
        args = (qn[i:i + 1], kn[i:i + 1, :lens[i]], vn[i:i + 1, :lens[i]])
        ref = reference.attention(*args, alibi_slopes=ai, **kw)
        same = reference.attention(*args, alibi_slopes=ai, precision="same", **kw)
        check_against(out[i:i + 1], None, ref, same, None)


@pytest.mark.parametrize("d", [40, 59, 111])
def test_varlen_head_dim_padded(rng, d):
    """Head dims that are not multiples of 8 go through padded copies of the packed arrays."""
    q, k, v, cq, ck, mq, mk = varlen_case(rng, 4, 113, 203, 6, 2, d, "float16")
    out, lse = run_varlen(q, k, v, cq, ck, mq, mk, None, causal=True)
    check_against(out, lse, *ref_varlen(q, k, v, cq, ck, None, dict(causal=True)))
