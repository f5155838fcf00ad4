"""Forward attention on the GPU against the float64 reference, with flash-attn's rule:
max|out - ref64| <= 2 * max|ref_lowp - ref64| + 1e-5, fresh random inputs, NaN-poisoned outputs."""
import numpy as np
import pytest

from conftest import requires_gpu, requires_torch, warm

pytestmark = [requires_gpu]

HEAD_DIMS = [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]
SEQLENS = [(113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256), (1024, 1024),
           (1023, 1024), (1024, 1023), (2048, 2048), (1, 239), (3, 799), (127, 513)]
DTYPES = ["float16", "bfloat16"]


@pytest.fixture(scope="session", autouse=True)
def _compile_everything():
    """Build every variant without window/softcap/ALiBi once, in parallel, before the tests
    (later calls hit the cache; the others compile when first used; conftest.warm)."""
    import cupy
    from cuflash.kernels import all_variants
    warm(all_variants(int(cupy.cuda.Device().compute_capability), mods=False, families=("fwd", "combine", "append")))


def torch_inputs(rng, b, sq, sk, h, hk, d, dtype):
    import torch
    tdt = getattr(torch, dtype)
    mk = lambda *s: torch.from_numpy(rng.standard_normal(s, dtype=np.float32)).to("cuda", tdt)
    return mk(b, sq, h, d), mk(b, sk, hk, d), mk(b, sk, hk, d)


def to_np(x):
    import ml_dtypes
    import torch
    if isinstance(x, torch.Tensor):
        dt = x.dtype
        a = x.detach().float().cpu().numpy()
        return a.astype(ml_dtypes.bfloat16) if dt == torch.bfloat16 else a.astype(
            np.float16 if dt == torch.float16 else np.float32)
    import cupy
    return cupy.asnumpy(x) if isinstance(x, cupy.ndarray) else np.asarray(x)


def check(out, q, k, v, **kw):
    from cuflash.reference import check_close
    ok, err, bound = check_close(to_np(out), to_np(q), to_np(k), to_np(v), **kw)
    assert ok, f"max error {err:.3g} exceeds bound {bound:.3g} ({kw})"


def run_poisoned(q, k, v, **kw):
    import torch
    import cuflash
    out = torch.full_like(q, float("nan"))
    res = cuflash.attention(q, k, v, out=out, **kw)
    assert (res[0] if isinstance(res, tuple) else res) is out
    return res


@requires_torch
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(113, 203), (128, 217), (1, 239), (512, 256), (127, 513)])
def test_head_dims(rng, dtype, d, causal, sq, sk):
    q, k, v = torch_inputs(rng, 2, sq, sk, 4, 4, d, dtype)
    out = run_poisoned(q, k, v, causal=causal)
    check(out, q, k, v, causal=causal)


@requires_torch
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SEQLENS)
def test_seqlens(rng, dtype, d, causal, sq, sk):
    b, h = (1, 2) if sq * sk > 1 << 20 else (2, 3)
    q, k, v = torch_inputs(rng, b, sq, sk, h, h, d, dtype)
    out, lse = run_poisoned(q, k, v, causal=causal, return_lse=True)
    check(out, q, k, v, causal=causal)
    from cuflash.reference import attention as ref
    _, lse_ref = ref(to_np(q), to_np(k), to_np(v), causal=causal, return_lse=True)
    got = lse.cpu().numpy()
    assert lse.shape == (b, h, sq) and lse.dtype.is_floating_point
    fin = np.isfinite(lse_ref)
    assert np.array_equal(np.isfinite(got), fin) and np.all(got[~fin] == np.inf)
    np.testing.assert_allclose(got[fin], lse_ref[fin], rtol=1e-3, atol=2e-3)


@requires_torch
@pytest.mark.parametrize("h,hk", [(8, 2), (8, 1), (6, 6)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 339), (113, 203), (256, 512), (1, 2048)])
def test_gqa_mqa(rng, h, hk, causal, sq, sk):
    q, k, v = torch_inputs(rng, 2, sq, sk, h, hk, 128, "bfloat16")
    out = run_poisoned(q, k, v, causal=causal)
    check(out, q, k, v, causal=causal)


@requires_torch
@pytest.mark.parametrize("causal", [False, True])
def test_fused_qkv_slices(rng, causal):
    """q, k, v sliced from one packed (b, s, 3, h, d) tensor: non-contiguous, read in place."""
    import torch
    qkv = torch.from_numpy(rng.standard_normal((2, 300, 3, 4, 64), dtype=np.float32)).to("cuda", torch.bfloat16)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    out = run_poisoned(q, k, v, causal=causal)
    check(out, q, k, v, causal=causal)
    # strided out (a slice of a wider buffer) is written in place too
    wide = torch.full((2, 300, 4, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    import cuflash
    cuflash.attention(q, k, v, causal=causal, out=wide[..., :64])
    check(wide[..., :64], q, k, v, causal=causal)
    assert torch.isnan(wide[..., 64:]).all()


@requires_torch
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 339), (64, 800), (3, 799), (1, 128), (128, 128)])
def test_forced_splits(rng, num_splits, causal, sq, sk):
    q, k, v = torch_inputs(rng, 2, sq, sk, 8, 2, 128, "float16")
    out, lse = run_poisoned(q, k, v, causal=causal, num_splits=num_splits, return_lse=True)
    check(out, q, k, v, causal=causal)
    from cuflash.reference import attention as ref
    _, lse_ref = ref(to_np(q), to_np(k), to_np(v), causal=causal, return_lse=True)
    np.testing.assert_allclose(lse.cpu().numpy(), lse_ref, rtol=1e-3, atol=2e-3)


@requires_torch
@pytest.mark.parametrize("sq,sk,b,h,hk", [(1, 339, 1, 28, 4), (64, 800, 2, 8, 8), (16, 20000, 1, 8, 2),
                                          (1, 131072, 1, 8, 1), (1, 552, 1, 28, 4)])
def test_decode_heuristic(rng, sq, sk, b, h, hk):
    """Shapes where the plan itself chooses split-KV (FA2's heuristic) or not."""
    import cuflash
    q, k, v = torch_inputs(rng, b, sq, sk, h, hk, 128, "bfloat16")
    p = cuflash.plan(q, k, v, causal=True)
    out = run_poisoned(q, k, v, causal=True)
    check(out, q, k, v, causal=True)
    assert len(p.kernels) == (2 if p.num_splits > 1 else 1)


@requires_torch
def test_empty_and_zero_length(rng):
    import torch
    import cuflash
    q, k, v = torch_inputs(rng, 2, 5, 0, 4, 4, 64, "bfloat16")
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == float("inf"))
    q0 = q[:, :0]
    assert cuflash.attention(q0, k, v).shape == q0.shape
    # causal with seqlen_q > seqlen_k: the first rows see no key and give 0, LSE +inf
    q, k, v = torch_inputs(rng, 1, 40, 8, 2, 2, 64, "float16")
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    assert torch.all(out[:, :32] == 0) and torch.all(lse[:, :, :32] == float("inf"))
    check(out, q, k, v, causal=True)


@requires_torch
def test_blocks_that_see_no_key_write_zeros_every_time(rng):
    """Causal with seqlen_q >> seqlen_k: whole query blocks see no key and run no K/V iteration.
    Their output must be exactly 0 on every call (a missing barrier once let Q data through)."""
    import torch
    import cuflash
    q, k, v = torch_inputs(rng, 60, 239, 1, 4, 4, 128, "bfloat16")
    out = torch.empty_like(q)
    for _ in range(100):
        out.fill_(float("nan"))
        cuflash.attention(q, k, v, causal=True, out=out)
        assert torch.all(out[:, :238] == 0)
    check(out, q, k, v, causal=True)


def test_cupy_and_numpy_inputs(rng):
    import cupy
    import ml_dtypes
    import cuflash
    for dt in (np.float16, ml_dtypes.bfloat16):
        qn = rng.standard_normal((2, 77, 4, 64)).astype(dt)
        kn = rng.standard_normal((2, 91, 2, 64)).astype(dt)
        vn = rng.standard_normal((2, 91, 2, 64)).astype(dt)
        on = cuflash.attention(qn, kn, vn, causal=True)
        assert isinstance(on, np.ndarray) and on.dtype == qn.dtype
        check(on, qn, kn, vn, causal=True)
        qc, kc, vc = (cupy.asarray(x) for x in (qn, kn, vn))
        out = cupy.full(qc.shape, np.nan, dtype=qc.dtype)
        oc = cuflash.attention(qc, kc, vc, causal=True, out=out)
        assert oc is out
        check(oc, qn, kn, vn, causal=True)


@requires_torch
def test_torch_stream_and_no_sync(rng):
    """The kernel runs on torch's current stream: work queued on a side stream is ordered."""
    import torch
    import cuflash
    q, k, v = torch_inputs(rng, 2, 256, 256, 4, 4, 64, "bfloat16")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        q2 = q * 1  # produced on s
        out = cuflash.attention(q2, k, v, causal=True)
        out2 = out * 1
    s.synchronize()
    check(out2, q, k, v, causal=True)


def test_jax_inputs(rng):
    jax = pytest.importorskip("jax", reason="JAX not installed")
    import jax.numpy as jnp
    import cuflash
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU backend here")
    qn = rng.standard_normal((1, 64, 2, 64)).astype(np.float16)
    q = jnp.asarray(qn)
    out = cuflash.attention(q, q, q, causal=True)
    assert isinstance(out, jax.Array)
    check(np.asarray(out), qn, qn, qn, causal=True)


@requires_torch
@pytest.mark.parametrize("shape", [(1, 1, 32, 8, 4096), (3, 1, 28, 4, 799), (2, 113, 4, 2, 2048)])
def test_fused_combine_matches_combine_kernel(rng, monkeypatch, shape):
    """The split kernel's fused merge (last split per query block) equals the combine kernel,
    bit for bit, and leaves its counters zeroed for the next call."""
    import cuflash
    from cuflash import launch
    b, sq, h, hk, sk = shape
    q, k, v = torch_inputs(rng, b, sq, sk, h, hk, 128, "bfloat16")
    fused = cuflash.attention(q, k, v, causal=True, num_splits=7, return_lse=True)
    monkeypatch.setattr(launch, "FUSED_COMBINE", False)
    plain = cuflash.attention(q, k, v, causal=True, num_splits=7, return_lse=True)
    import torch
    assert torch.equal(fused[0], plain[0]) and torch.equal(fused[1], plain[1]), "fused and separate combine differ"
    check(fused[0], q, k, v, causal=True)
    assert all(int(buf.sum()) == 0 for buf in launch._counters.values())
