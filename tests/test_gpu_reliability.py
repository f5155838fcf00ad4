"""Reliability on the GPU: bitwise determinism under repetition (flash-attn's race-test shapes),
K/V and Q/O tensors past 2**31 elements (64-bit offsets), concurrent threads and streams racing
to compile and load kernels, NaN/inf propagation, zero-size inputs, several GPUs, and CUDA graph
capture. Random data is drawn on the GPU from generators seeded by the ``rng`` fixture."""
import math
import shutil
import threading

import numpy as np
import pytest

from conftest import requires_gpu, requires_torch
from test_gpu_forward import check, to_np

pytestmark = [requires_gpu, requires_torch]

RACE_SHAPES = [(1, 239), (239, 1), (3, 799), (799, 3), (1024, 128), (97, 97), (128, 128), (200, 200),
               (256, 256), (257, 257), (384, 384), (512, 512), (768, 768), (1024, 1024)]
REPEATS = 250


# ---------------------------------------------------------------------------------------------
# Helpers

def _gen(rng, device="cuda"):
    import torch
    g = torch.Generator(device=device)
    g.manual_seed(int(rng.integers(2**62)))
    return g


def _randn(g, shape, dtype="bfloat16", device="cuda", scale=1.0):
    import torch
    x = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
    if scale != 1.0:
        x *= scale
    return x.to(getattr(torch, dtype)) if dtype != "float32" else x


def _bitwise_ne(a, b):
    """Number of elements whose bits differ (a GPU scalar: no synchronisation)."""
    import torch
    idt = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return (a.contiguous().view(idt) != b.contiguous().view(idt)).sum()


def _repeat_mismatches(call, first, n=REPEATS):
    """Run ``call()`` n times back to back; count elements that differ bitwise from ``first``
    (a tuple of tensors), accumulated on the GPU and read back once."""
    import torch
    bad = torch.zeros((), dtype=torch.int64, device=first[0].device)
    for _ in range(n):
        for got, want in zip(call(), first):
            bad += _bitwise_ne(got, want)
    return int(bad)  # the only synchronisation


def _skip_unless_free(gib):
    import torch
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    if free < gib * 2**30:
        pytest.skip(f"needs {gib} GiB of free GPU memory, {free / 2**30:.1f} GiB free")


# ---------------------------------------------------------------------------------------------
# 1. Determinism

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", RACE_SHAPES)
def test_deterministic_race_shapes(rng, sq, sk, causal):
    """flash-attn's race-test shapes: 250 calls into one preallocated out are bitwise identical
    to the first (allocating) call, output and LSE."""
    import torch
    import cuflash
    g = _gen(rng)
    q = _randn(g, (60, sq, 4, 128))
    k, v = _randn(g, (60, sk, 4, 128)), _randn(g, (60, sk, 4, 128))
    out0, lse0 = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    assert not torch.isnan(out0).any() and not torch.isnan(lse0).any()
    out = torch.full_like(q, float("nan"))

    def call():
        res, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, out=out)
        assert res is out
        return out, lse

    bad = _repeat_mismatches(call, (out0, lse0))
    assert bad == 0, f"{bad} elements differed bitwise over {REPEATS} repeated calls"
    assert torch.equal(out, out0)


def test_deterministic_split_kv_decode(rng):
    """A decode shape that the plan splits (split-KV partials + combine): bitwise repeatable."""
    import torch
    import cuflash
    g = _gen(rng)
    q = _randn(g, (2, 1, 32, 128))
    k, v = _randn(g, (2, 4096, 8, 128)), _randn(g, (2, 4096, 8, 128))
    splits = 0 if cuflash.plan(q, k, v).num_splits > 1 else 4  # the heuristic's split, or a forced one
    assert cuflash.plan(q, k, v, num_splits=splits).num_splits > 1
    out0, lse0 = cuflash.attention(q, k, v, return_lse=True, num_splits=splits)
    check(out0, q, k, v)
    out = torch.empty_like(q)
    bad = _repeat_mismatches(lambda: cuflash.attention(q, k, v, return_lse=True, out=out, num_splits=splits),
                             (out0, lse0))
    assert bad == 0, f"{bad} elements differed bitwise over {REPEATS} repeated split-KV calls"


def test_deterministic_paged_kvcache(rng):
    """attention_with_kvcache over a paged cache, appending one token each call (the same
    rows at the same positions, so the call is idempotent): bitwise repeatable."""
    import torch
    import cuflash
    from test_gpu_kvcache import check_batches, make_case
    q, kc, vc, kn, vn, seqlens, kw, ks, vs, rows, lens = make_case(rng, 3, 1, 2000, 8, 2, 128, "paged16", 1)
    assert "block_table" in kw

    def call():
        return cuflash.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=True,
                                              return_lse=True, out=out, **kw)

    out = torch.empty_like(q)
    out0, lse0 = call()
    out0, lse0 = out0.clone(), lse0.clone()
    check_batches(out0, q, ks, vs, True)
    bad = _repeat_mismatches(call, (out0, lse0))
    assert bad == 0, f"{bad} elements differed bitwise over {REPEATS} repeated paged-cache calls"
    for i in range(q.shape[0]):
        assert torch.equal(rows(kc, i, int(lens[i])), ks[i]) and torch.equal(rows(vc, i, int(lens[i])), vs[i])


# ---------------------------------------------------------------------------------------------
# 2. Tensors past 2**31 elements

def _chunked_reference(q, k, v, causal, chunk=2**20, far_from=None):
    """Exact float32 attention on the GPU, online softmax over key chunks (batch 1). Returns
    out (sq, h, d) float32, lse (h, sq), and the softmax mass of keys >= far_from per row."""
    import torch
    _, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    G = h // hk
    scale = d ** -0.5
    # rows ordered (kv head, group member, query index): query head = g * G + j
    qg = q[0].float().view(sq, hk, G, d).permute(1, 2, 0, 3).reshape(hk, G * sq, d)
    R = G * sq
    m = torch.full((hk, R), -math.inf, device=q.device)
    l = torch.zeros((hk, R), device=q.device)
    l_far = torch.zeros((hk, R), device=q.device)
    acc = torch.zeros((hk, R, d), device=q.device)
    limit = (torch.arange(R, device=q.device) % sq) + (sk - sq)  # last visible key per row
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for c0 in range(0, sk, chunk):
            c1 = min(sk, c0 + chunk)
            kc = torch.empty((hk, c1 - c0, d), device=q.device).copy_(k[0, c0:c1].permute(1, 0, 2))
            s = torch.bmm(qg, kc.transpose(1, 2)).mul_(scale)  # (hk, R, n)
            del kc
            if causal:
                s.masked_fill_(torch.arange(c0, c1, device=q.device)[None, :] > limit[:, None], -math.inf)
            m_new = torch.maximum(m, s.amax(-1))
            alpha = torch.exp(m - m_new)
            p = s.sub_(m_new[..., None]).exp_()
            l = l * alpha + p.sum(-1)
            l_far = l_far * alpha
            if far_from is not None and c1 > far_from:
                l_far += p[..., max(0, far_from - c0):].sum(-1)
            vc = torch.empty((hk, c1 - c0, d), device=q.device).copy_(v[0, c0:c1].permute(1, 0, 2))
            acc = acc * alpha[..., None] + torch.bmm(p, vc)
            del vc, p, s
            m = m_new
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    out = (acc / l[..., None]).view(hk, G, sq, d).permute(2, 0, 1, 3).reshape(sq, h, d)
    lse = (m + torch.log(l)).reshape(h, sq)
    return out, lse, (l_far / l).reshape(h, sq)


def test_large_kv_64bit_offsets(rng):
    """K and V each hold more than 2**31 elements (batch 1, 8 KV heads, d=128, bf16). Keys that
    dominate the softmax sit past element 2**31, so offsets that wrap would change the output."""
    import torch
    import cuflash
    _skip_unless_free(24)
    hk, G, d = 8, 4, 128
    h = hk * G
    boundary = 2**31 // (hk * d)  # first key row whose every element lies past 2**31
    sk = boundary + 64
    g = _gen(rng)
    k = v = None
    try:
        k = torch.randn((1, sk, hk, d), generator=g, device="cuda", dtype=torch.bfloat16)
        v = torch.randn((1, sk, hk, d), generator=g, device="cuda", dtype=torch.bfloat16)
        assert k.numel() > 2**31 and v.numel() > 2**31
        u = torch.randn((hk, d), generator=g, device="cuda")
        # needle keys aligned with each KV head's query direction (scores ~20 vs ~N(0, 1))
        for pos, c in ((sk - 1, 2.0), (sk - 40, 1.95), (boundary, 1.9), (boundary - 1, 1.85), (1000, 1.8)):
            k[0, pos] = (c * u).to(torch.bfloat16)
            v[0, pos] = _randn(g, (hk, d), scale=0.5)
        for sq, causal in ((1, False), (3, True)):
            q = (u.repeat_interleave(G, 0)[None, None] + 0.3 * _randn(g, (1, sq, h, d), "float32")).to(torch.bfloat16)
            # the split-KV path: the heuristic's split, or a forced one on GPUs where it would not split
            splits = 0 if cuflash.plan(q, k, v, causal=causal).num_splits > 1 else 8
            assert cuflash.plan(q, k, v, causal=causal, num_splits=splits).num_splits > 1
            out = torch.full_like(q, float("nan"))
            _, lse = cuflash.attention(q, k, v, causal=causal, out=out, return_lse=True, num_splits=splits)
            ref, ref_lse, far = _chunked_reference(q, k, v, causal, far_from=boundary)
            assert far.min().item() > 0.2, "the keys past 2**31 should carry much of the softmax mass"
            assert ref.abs().max().item() > 0.1
            err = (out[0].float() - ref).abs().max().item()
            assert err <= 2e-2, f"sq={sq} causal={causal}: max error {err:.3g} > 2e-2"
            lse_err = (lse[0] - ref_lse).abs().max().item()
            assert lse_err <= 2e-3 * max(1.0, ref_lse.abs().max().item()), f"LSE error {lse_err:.3g}"
            del q, out, lse, ref, ref_lse, far
    finally:
        del k, v
        torch.cuda.empty_cache()


def _rows_reference(q, k, v, causal, r0, r1):
    """Exact float32 attention for query rows r0..r1 of batch 0 (keys few enough to take at
    once, nheads == nheads_k): out (r1 - r0, h, d), lse (h, r1 - r0)."""
    import torch
    sq, sk, d = q.shape[1], k.shape[1], q.shape[3]
    s = torch.einsum("nhd,jhd->hnj", q[0, r0:r1].float(), k[0].float()) * d ** -0.5
    if causal:
        last = torch.arange(r0, r1, device=q.device)[:, None] + (sk - sq)
        s.masked_fill_(torch.arange(sk, device=q.device)[None, :] > last, -math.inf)
    m = s.amax(-1, keepdim=True)
    empty = m == -math.inf
    p = torch.exp(s - torch.where(empty, torch.zeros_like(m), m))
    l = p.sum(-1, keepdim=True)
    o = torch.einsum("hnj,jhd->nhd", p / torch.where(empty, torch.ones_like(l), l), v[0].float())
    lse = torch.where(empty, torch.full_like(m, math.inf), m + torch.log(l))[..., 0]
    return o, lse


def test_large_q_and_out_64bit_offsets(rng):
    """Q and the output hold more than 2**31 elements (standard kernel, 2M query rows); every
    row, including those past element 2**31, is written and correct (NaN-poisoned out)."""
    import torch
    import cuflash
    _skip_unless_free(24)
    h, d, sk = 8, 128, 80
    sq = 2**31 // (h * d) + 64
    g = _gen(rng)
    q = out = None
    try:
        q = _randn(g, (1, sq, h, d), scale=0.5)
        assert q.numel() > 2**31
        k, v = _randn(g, (1, sk, h, d)), _randn(g, (1, sk, h, d))
        out = torch.empty_like(q)
        for causal in (False, True):
            out.fill_(float("nan"))
            _, lse = cuflash.attention(q, k, v, causal=causal, out=out, return_lse=True)
            assert len(cuflash.plan(q, k, v, causal=causal).kernels) == 1
            worst, worst_lse = 0.0, 0.0
            chunk = 2**18
            for r0 in range(0, sq, chunk):
                r1 = min(sq, r0 + chunk)
                o, ref_lse = _rows_reference(q, k, v, causal, r0, r1)
                got = out[0, r0:r1].float()
                assert not torch.isnan(got).any(), f"rows {r0}..{r1} were not written (causal={causal})"
                worst = max(worst, (got - o).abs().max().item())
                gl = lse[0, :, r0:r1]
                inf = torch.isinf(ref_lse)
                assert torch.equal(torch.isinf(gl), inf) and bool((gl[inf] > 0).all())
                if (~inf).any():
                    worst_lse = max(worst_lse, (gl[~inf] - ref_lse[~inf]).abs().max().item())
                del o, got, ref_lse
            assert worst <= 2e-2, f"causal={causal}: max error {worst:.3g} > 2e-2"
            assert worst_lse <= 2e-3, f"causal={causal}: max LSE error {worst_lse:.3g}"
    finally:
        del q, out
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# 3. Threads and streams

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, d, dtype, causal, num_splits, compiled on first use)
THREAD_CONFIGS = [
    (2, 128, 200, 4, 4, 64, "bfloat16", True, 0, False),
    (1, 77, 300, 4, 2, 40, "bfloat16", False, 0, True),    # d=40: bucket 64 with column predicates
    (1, 77, 300, 4, 2, 40, "float16", True, 0, False),
    (2, 65, 130, 2, 1, 72, "float16", False, 0, False),    # d=72: bucket 96 with column predicates
    (1, 50, 333, 4, 4, 72, "bfloat16", True, 3, True),     # forced 3-way split
    (2, 1, 400, 8, 2, 128, "bfloat16", True, 0, False),    # decode, GQA packed
    (1, 50, 333, 4, 4, 128, "float16", False, 3, False),
    (2, 33, 33, 3, 3, 256, "bfloat16", True, 0, False),
    (1, 100, 100, 2, 2, 32, "float16", False, 1, False),
    (1, 3, 799, 4, 2, 96, "float16", True, 0, False),
]
N_THREADS, CALLS_PER_THREAD = 8, 20


def _config_variants(cfg):
    """The kernels a config's call launches: a split plan's combine kernel only runs when the
    split kernel does not merge its splits itself."""
    import cuflash
    from cuflash import launch
    b, sq, sk, h, hk, d, dtype, causal, splits, _ = cfg
    p = cuflash.plan((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), causal=causal, num_splits=splits,
                     dtype=dtype)
    return {l.variant for l in p.launches if not (launch.FUSED_COMBINE and l.variant.family == "combine")}


def test_threads_and_streams(rng, monkeypatch, tmp_path):
    """8 threads, each on its own torch stream, 20 calls each over mixed shapes, dtypes and head
    dims, racing to load kernels (the loaded-kernel dict is cleared) and to compile a few
    variants that are in no disk cache yet; every result is checked after the join."""
    import torch
    import cuflash
    from cuflash import compiler

    # A fresh disk cache holding every variant the calls need except those of the
    # "compiled on first use" configs, which the threads must build themselves.
    fresh = set().union(*(_config_variants(c) for c in THREAD_CONFIGS if c[-1]))
    others = set().union(*(_config_variants(c) for c in THREAD_CONFIGS if not c[-1]))
    fresh -= others
    assert fresh
    compiler.warmup(sorted(others, key=lambda v: v.name))
    cached = {v: compiler.cache_path(v) for v in others}
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    for v, path in cached.items():
        if path.exists():  # (an unwritable cache directory keeps kernels in memory only)
            shutil.copyfile(path, compiler.cache_path(v))
    assert not any(compiler.cache_path(v).exists() for v in fresh)
    compiler._loaded.clear()

    seeds = [int(s) for s in rng.integers(2**62, size=N_THREADS)]
    barrier = threading.Barrier(N_THREADS)
    results = [[] for _ in range(N_THREADS)]
    errors = []

    def worker(t):
        try:
            stream = torch.cuda.Stream()
            g = torch.Generator(device="cuda")
            g.manual_seed(seeds[t])
            barrier.wait()
            with torch.cuda.stream(stream):
                for j in range(CALLS_PER_THREAD):
                    cfg = THREAD_CONFIGS[(t + j) % len(THREAD_CONFIGS)]
                    b, sq, sk, h, hk, d, dtype, causal, splits, _ = cfg
                    q = _randn(g, (b, sq, h, d), dtype)
                    k, v = _randn(g, (b, sk, hk, d), dtype), _randn(g, (b, sk, hk, d), dtype)
                    out = torch.full_like(q, float("nan")) if j % 3 == 0 else None
                    res, lse = cuflash.attention(q, k, v, causal=causal, num_splits=splits,
                                                 return_lse=True, out=out)
                    assert out is None or res is out
                    results[t].append((cfg, q, k, v, res, lse))
            stream.synchronize()
        except BaseException as e:  # re-raised in the main thread
            errors.append((t, e))
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(N_THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:  # report the root cause, not the threads released by barrier.abort()
        t, e = next((x for x in errors if not isinstance(x[1], threading.BrokenBarrierError)), errors[0])
        raise AssertionError(f"thread {t} failed: {type(e).__name__}: {e}") from e
    torch.cuda.synchronize()

    from cuflash.reference import check_close
    for t in range(N_THREADS):
        assert len(results[t]) == CALLS_PER_THREAD
        for cfg, q, k, v, out, lse in results[t]:
            causal = cfg[7]
            ok, err, bound = check_close(to_np(out), to_np(q), to_np(k), to_np(v), causal=causal)
            assert ok, f"thread {t}, config {cfg}: max error {err:.3g} exceeds bound {bound:.3g}"
            assert not torch.isnan(lse).any(), f"thread {t}, config {cfg}: NaN in LSE"
    for v in fresh:
        assert compiler.cache_path(v).exists(), f"{v.name} was not compiled into the fresh cache"
        assert (v.name, torch.cuda.current_device()) in compiler._loaded


# ---------------------------------------------------------------------------------------------
# 4. NaN and inf

def _ieee_reference(q, k, v, causal, lowp=None):
    """float64 attention with IEEE NaN/inf propagation: a row is NaN iff one of its visible
    scores is NaN or +inf; a row whose visible scores are all -inf gives 0 and LSE +inf.
    Explicit sums (no BLAS: inf inputs must not depend on a BLAS kernel's arithmetic).
    ``lowp``: round P and the output to that dtype, as a fused kernel does (precision="same").

    cuflash.reference.attention cannot be the oracle here: its ``where(l > 0, ...)`` turns rows
    with a NaN score into 0 with LSE +inf (NaN > 0 is False), where flash-attn gives NaN."""
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    group = h // hk
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    visible = (j <= i + sk - sq) if causal else np.ones((sq, sk), dtype=bool)
    out = np.zeros((b, sq, h, d))
    lse = np.full((b, h, sq), np.inf)
    with np.errstate(all="ignore"):
        for bi in range(b):
            for hi in range(h):
                g = hi // group
                s = (q[bi, :, hi, None, :] * k[bi, None, :, g, :]).sum(-1) * d ** -0.5
                s = np.where(visible, s, -np.inf)
                m = s.max(-1, keepdims=True)  # NaN if a visible score is NaN
                empty = m == -np.inf
                p = np.exp(s - np.where(empty, 0.0, m))
                l = p.sum(-1, keepdims=True)
                pv = p.astype(lowp).astype(np.float64) if lowp is not None else p
                o = (pv[:, :, None] * v[bi, None, :, g, :]).sum(1) / l
                out[bi, :, hi] = np.where(empty, 0.0, o)
                lse[bi, hi] = np.where(empty, np.inf, m + np.log(l))[:, 0]
    if lowp is not None:
        out = out.astype(lowp).astype(np.float64)
    return out, lse


@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(77, 77), (1, 300)])
def test_nan_inf_propagation(rng, sq, sk, causal, num_splits):
    """NaN in a query row, -inf in a query element, +inf / -inf / NaN in key elements: the NaN
    rows of the output are exactly the reference's, the others meet the usual bound."""
    import ml_dtypes
    import torch
    import cuflash
    from cuflash import reference
    b, h, hk, d = 2, 4, 2, 64
    qn = rng.standard_normal((b, sq, h, d), dtype=np.float32)
    kn = rng.standard_normal((b, sk, hk, d), dtype=np.float32)
    vn = rng.standard_normal((b, sk, hk, d), dtype=np.float32)
    qn[0, min(10, sq - 1), 3, 7] = np.nan        # a NaN query row (head 3, KV head 1)
    qn[1, min(3, sq - 1), 2, 0] = -np.inf        # scores of +-inf for every key of that row
    kn[0, 30, 0, 5] = np.inf                     # key 30: +inf or -inf scores (sign of q)
    kn[1, 50, 0, 9] = -np.inf
    kn[1, min(70, sk - 1), 1, 4] = np.nan        # a NaN key: NaN scores where visible
    q, k, v = (torch.from_numpy(x).to("cuda", torch.bfloat16) for x in (qn, kn, vn))
    out = torch.full_like(q, 1000.0)  # rows left unwritten would fail the bound
    _, lse = cuflash.attention(q, k, v, causal=causal, num_splits=num_splits, return_lse=True, out=out)
    torch.cuda.synchronize()  # must finish (no hang)
    got, got_lse = to_np(out).astype(np.float64), lse.cpu().numpy()
    qb, kb, vb = to_np(q), to_np(k), to_np(v)

    ref64, ref_lse = _ieee_reference(qb, kb, vb, causal)
    ref_lp, _ = _ieee_reference(qb, kb, vb, causal, lowp=ml_dtypes.bfloat16)
    want_nan = np.isnan(ref64).any(-1)  # (b, sq, h)
    assert want_nan.any() and not want_nan.all()
    got_nan = np.isnan(got).any(-1)
    assert np.array_equal(got_nan, want_nan), (
        f"NaN rows (b, i, h): got {np.argwhere(got_nan).tolist()}, want {np.argwhere(want_nan).tolist()}")
    assert np.isnan(got[got_nan]).all(), "a NaN row should be NaN in every column"
    # the library reference's NaN rows (from +inf scores) are among them
    with np.errstate(all="ignore"):
        lib = reference.attention(qb, kb, vb, causal=causal, precision="float64")
    assert not (np.isnan(lib).any(-1) & ~want_nan).any()

    fin = ~want_nan
    assert np.isfinite(got[fin]).all()
    err = float(np.abs(got[fin] - ref64[fin]).max())
    bound = 2 * float(np.abs(ref_lp[fin] - ref64[fin]).max()) + 1e-5
    assert err <= bound, f"finite rows: max error {err:.3g} exceeds bound {bound:.3g}"

    lse_nan = want_nan.transpose(0, 2, 1)  # (b, h, sq)
    assert np.array_equal(np.isnan(got_lse), lse_nan)
    ok = ~lse_nan
    assert np.array_equal(np.isposinf(got_lse[ok]), np.isposinf(ref_lse[ok]))
    fl = ok & np.isfinite(ref_lse)
    np.testing.assert_allclose(got_lse[fl], ref_lse[fl], rtol=1e-3, atol=2e-3)


# ---------------------------------------------------------------------------------------------
# 5. Zero-size inputs

@pytest.mark.parametrize("d", [64, 59])
def test_zero_size_attention(rng, d):
    """batch 0 / seqlen_q 0 / nheads 0 give empty results; seqlen_k 0 gives out 0 and LSE +inf
    (flash-attn: out.zero_(), lse.fill_(inf)), written into a poisoned out too."""
    import torch
    import cuflash
    g = _gen(rng)
    for b, sq, sk, h, hk in ((0, 5, 7, 4, 4), (2, 0, 7, 4, 2), (2, 0, 0, 4, 4), (2, 5, 7, 0, 1)):
        q, k, v = _randn(g, (b, sq, h, d)), _randn(g, (b, sk, hk, d)), _randn(g, (b, sk, hk, d))
        for out in (None, torch.empty_like(q)):
            res, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, out=out)
            assert res.shape == q.shape and res.dtype == q.dtype and res.device == q.device
            assert out is None or res is out
            assert lse.shape == (b, h, sq) and lse.dtype == torch.float32 and lse.device == q.device
    for sq, h, hk in ((5, 4, 4), (1, 8, 2), (40, 4, 1)):
        q = _randn(g, (2, sq, h, d))
        k = v = _randn(g, (2, 0, hk, d))
        for causal in (False, True):
            for splits in (0, 1, 3):
                out = torch.full_like(q, float("nan"))
                res, lse = cuflash.attention(q, k, v, causal=causal, num_splits=splits, return_lse=True, out=out)
                assert res is out
                assert torch.all(out == 0), f"seqlen_k=0 sq={sq} causal={causal} splits={splits}: out not 0"
                assert lse.shape == (2, h, sq) and torch.all(lse == math.inf)
                fresh = cuflash.attention(q, k, v, causal=causal, num_splits=splits)
                assert torch.all(fresh == 0)


@pytest.mark.parametrize("mode", ["dense", "paged16"])
def test_zero_size_kvcache(rng, mode):
    """attention_with_kvcache with cache_seqlens=0 and no new keys: out 0, LSE +inf, the cache
    untouched (flash-attn); also batch 0 and seqlen_q 0 give empty results."""
    import torch
    import cuflash
    from test_gpu_kvcache import make_case
    q, kc, vc, _, _, _, kw, _, _, rows, _ = make_case(rng, 2, 3, 100, 4, 2, 128, mode, 0)
    kc0, vc0 = kc.clone(), vc.clone()
    zeros = torch.zeros(2, dtype=torch.int32, device="cuda")
    for seqlens in (0, zeros):
        for causal in (False, True):
            for splits in (0, 1, 3):
                out = torch.full_like(q, float("nan"))
                res, lse = cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=causal,
                                                          num_splits=splits, return_lse=True, out=out, **kw)
                assert res is out
                assert torch.all(out == 0), f"cache_seqlens=0 causal={causal} splits={splits}: out not 0"
                assert lse.shape == (2, 4, 3) and torch.all(lse == math.inf)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
    # seqlen_q 0: nothing to attend, but the new keys are still written (as documented)
    kn, vn = _randn(_gen(rng), (2, 2, 2, 128)), _randn(_gen(rng), (2, 2, 2, 128))
    res = cuflash.attention_with_kvcache(q[:, :0], kc, vc, kn, vn, cache_seqlens=zeros, **kw)
    assert res.shape == (2, 0, 4, 128)
    for i in range(2):
        assert torch.equal(rows(kc, i, 2), kn[i]) and torch.equal(rows(vc, i, 2), vn[i])
    # batch 0
    if mode == "dense":
        e = cuflash.attention_with_kvcache(q[:0], kc[:0], vc[:0], cache_seqlens=0)
        assert e.shape == (0, 3, 4, 128)


# ---------------------------------------------------------------------------------------------
# 6. Several GPUs

def test_multi_gpu(rng):
    import torch
    import cuflash
    from cuflash import compiler
    from test_gpu_kvcache import check_batches, make_case
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"needs 2 GPUs, {n} visible")
    g1 = _gen(rng, "cuda:1")
    q = _randn(g1, (2, 100, 8, 128), device="cuda:1")
    k, v = _randn(g1, (2, 300, 2, 128), device="cuda:1"), _randn(g1, (2, 300, 2, 128), device="cuda:1")

    with torch.cuda.device(1):
        out = cuflash.attention(q, k, v, causal=True)
    assert out.device == torch.device("cuda:1")
    torch.cuda.synchronize(1)
    check(out, q, k, v, causal=True)
    assert any(dev == 1 for _, dev in compiler._loaded), "no kernel was loaded for device 1"

    # operands on two devices
    k0 = k.to("cuda:0")
    with pytest.raises(ValueError, match=r"\bk is on GPU 0 but q is on GPU 1"):
        cuflash.attention(q, k0, v)
    with pytest.raises(ValueError, match=r"\bv is on GPU 0 but q is on GPU 1"):
        cuflash.attention(q, k, v.to("cuda:0"))
    with pytest.raises(ValueError, match=r"\bout is on GPU 0 but q is on GPU 1"):
        cuflash.attention(q, k, v, out=torch.empty_like(q, device="cuda:0"))

    # device 0 current, tensors on device 1: runs on device 1 (standard and split-KV kernels)
    with torch.cuda.device(0):
        for splits in (1, 3):
            out, lse = cuflash.attention(q, k, v, causal=True, num_splits=splits, return_lse=True)
            assert out.device == torch.device("cuda:1") and lse.device == torch.device("cuda:1")
            assert torch.cuda.current_device() == 0
            torch.cuda.synchronize(1)
            check(out, q, k, v, causal=True)
        qd = q[:, :1].contiguous()  # decode, GQA packed, heuristic split
        out = cuflash.attention(qd, k, v)
        torch.cuda.synchronize(1)
        check(out, qd, k, v)

    # KV cache on device 1 with device 0 current
    with torch.cuda.device(1):
        qc, kc, vc, kn, vn, seqlens, kw, ks, vs, rows, lens = make_case(rng, 2, 1, 500, 8, 2, 128, "paged16", 1)
    with torch.cuda.device(0):
        out = cuflash.attention_with_kvcache(qc, kc, vc, kn, vn, cache_seqlens=seqlens, causal=True, **kw)
        assert out.device == torch.device("cuda:1")
    torch.cuda.synchronize(1)
    with torch.cuda.device(1):
        check_batches(out, qc, ks, vs, True)
        for i in range(2):
            assert torch.equal(rows(kc, i, int(lens[i])), ks[i])


# ---------------------------------------------------------------------------------------------
# 7. CUDA graphs

def test_cuda_graph_capture_and_replay(rng):
    """The standard kernel and a split-KV decode (num_splits=4, with combine and a workspace)
    captured in one CUDA graph after a warm-up call; replays on new data copied into the captured
    inputs match eager calls bitwise."""
    import torch
    import cuflash
    g = _gen(rng)
    q1 = _randn(g, (2, 256, 8, 128))
    k1, v1 = _randn(g, (2, 256, 8, 128)), _randn(g, (2, 256, 8, 128))
    q2 = _randn(g, (2, 1, 16, 128))
    k2, v2 = _randn(g, (2, 1000, 4, 128)), _randn(g, (2, 1000, 4, 128))
    assert cuflash.plan(q1, k1, v1, causal=True, num_splits=1).num_splits == 1
    p2 = cuflash.plan(q2, k2, v2, num_splits=4)
    assert p2.num_splits == 4 and len(p2.kernels) == 2
    out1, out2 = torch.empty_like(q1), torch.empty_like(q2)

    def calls():
        _, l1 = cuflash.attention(q1, k1, v1, causal=True, num_splits=1, out=out1, return_lse=True)
        _, l2 = cuflash.attention(q2, k2, v2, num_splits=4, out=out2, return_lse=True)
        return l1, l2

    side = torch.cuda.Stream()  # warm-up (loads the kernels) on a side stream, as torch advises
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        calls()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lse1, lse2 = calls()

    for r in range(3):
        for x in (q1, k1, v1, q2, k2, v2):
            x.copy_(_randn(g, tuple(x.shape)))
        out1.fill_(float("nan"))
        out2.fill_(float("nan"))
        graph.replay()
        e1, el1 = cuflash.attention(q1, k1, v1, causal=True, num_splits=1, return_lse=True)
        e2, el2 = cuflash.attention(q2, k2, v2, num_splits=4, return_lse=True)
        torch.cuda.synchronize()
        assert torch.equal(out1, e1) and torch.equal(lse1, el1), f"replay {r}: standard kernel differs from eager"
        assert torch.equal(out2, e2) and torch.equal(lse2, el2), f"replay {r}: split-KV differs from eager"
        assert int(_bitwise_ne(out1, e1) + _bitwise_ne(out2, e2)) == 0
        if r == 0:
            check(out1, q1, k1, v1, causal=True)
            check(out2, q2, k2, v2)
