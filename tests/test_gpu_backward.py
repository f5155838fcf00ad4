"""Backward pass on the GPU against the float64 reference, with flash-attn's rule for gradients:
max|grad - ref64| <= 3 * max|ref_same - ref64| + 1e-4 (ref_same rounds P, dS and the gradients
to the input dtype like a fused kernel), on fresh random inputs, gradients written into
NaN-poisoned buffers. Deterministic mode is checked for bitwise repeatability."""
import numpy as np
import pytest

from conftest import requires_gpu, requires_torch

pytestmark = [requires_gpu]

DTYPES = ["float16", "bfloat16"]
HEAD_DIMS = [32, 64, 80, 96, 128, 256]
SHAPES = [(113, 203), (128, 217), (1, 239), (239, 1)]
LONG_SHAPES = [(1024, 1024), (1023, 1024), (1024, 1023), (256, 512), (512, 256), (127, 513)]


@pytest.fixture(scope="session", autouse=True)
def _compile_everything():
    """Build every backward variant once, in parallel, before the tests."""
    import cupy
    from cuflash.backward import bwd_variants
    from cuflash.compiler import warmup
    warmup(bwd_variants(int(cupy.cuda.Device().compute_capability)))


def to_np(x):
    import ml_dtypes
    try:
        import torch
        if isinstance(x, torch.Tensor):
            dt = x.dtype
            a = x.detach().float().cpu().numpy()
            return a.astype(ml_dtypes.bfloat16) if dt == torch.bfloat16 else a.astype(
                np.float16 if dt == torch.float16 else np.float32)
    except ImportError:
        pass
    import cupy
    return cupy.asnumpy(x) if isinstance(x, cupy.ndarray) else np.asarray(x)


def torch_inputs(rng, b, sq, sk, h, hk, d, dtype):
    import torch
    tdt = getattr(torch, dtype)
    mk = lambda *s: torch.from_numpy(rng.standard_normal(s, dtype=np.float32)).to("cuda", tdt)
    return mk(b, sq, h, d), mk(b, sk, hk, d), mk(b, sk, hk, d), mk(b, sq, h, d)


def check_grads(grads, dout, q, k, v, causal, softmax_scale=None):
    from cuflash.reference import attention_backward, max_abs_err
    args = [to_np(x) for x in (dout, q, k, v)]
    ref64 = attention_backward(*args, causal=causal, softmax_scale=softmax_scale)
    same = attention_backward(*args, causal=causal, softmax_scale=softmax_scale, precision="same")
    for name, g, r, s in zip(("dq", "dk", "dv"), grads, ref64, same):
        g = to_np(g)
        assert g.shape == r.shape, (name, g.shape, r.shape)
        err, bound = max_abs_err(g, r), 3 * max_abs_err(s, r) + 1e-4
        assert err <= bound, f"{name}: max error {err:.3g} exceeds bound {bound:.3g} (causal={causal})"


def run(dout, q, k, v, causal=False, softmax_scale=None, deterministic=False, poison=True):
    """Forward for out/lse, then the backward into NaN-filled gradient buffers."""
    import torch
    import cuflash
    from cuflash.backward import attention_backward
    out, lse = cuflash.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True)
    kw = {}
    if poison:
        kw = dict(dq=torch.full_like(q, float("nan")), dk=torch.full_like(k, float("nan")),
                  dv=torch.full_like(v, float("nan")))
    grads = attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                               deterministic=deterministic, **kw)
    if poison:
        assert all(g is kw[n] for g, n in zip(grads, ("dq", "dk", "dv")))
    return grads


@requires_torch
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SHAPES)
def test_head_dims(rng, deterministic, dtype, d, causal, sq, sk):
    q, k, v, dout = torch_inputs(rng, 2, sq, sk, 4, 4, d, dtype)
    grads = run(dout, q, k, v, causal=causal, deterministic=deterministic)
    check_grads(grads, dout, q, k, v, causal)


@requires_torch
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", LONG_SHAPES)
def test_seqlens(rng, deterministic, dtype, d, causal, sq, sk):
    q, k, v, dout = torch_inputs(rng, 1, sq, sk, 2, 2, d, dtype)
    grads = run(dout, q, k, v, causal=causal, deterministic=deterministic)
    check_grads(grads, dout, q, k, v, causal)


@requires_torch
@pytest.mark.parametrize("d", [40, 59, 111, 160, 192, 224])
@pytest.mark.parametrize("causal", [False, True])
def test_other_head_dims(rng, d, causal):
    """Head dims below their bucket (column predicates) and not a multiple of 8 (padded copies)."""
    q, k, v, dout = torch_inputs(rng, 2, 113, 203, 2, 2, d, "bfloat16")
    grads = run(dout, q, k, v, causal=causal)
    check_grads(grads, dout, q, k, v, causal)


@requires_torch
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("h,hk", [(8, 2), (8, 1), (6, 3)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(113, 203), (239, 1), (1, 239), (256, 256)])
def test_gqa_mqa(rng, deterministic, h, hk, causal, sq, sk):
    q, k, v, dout = torch_inputs(rng, 2, sq, sk, h, hk, 128, "bfloat16")
    grads = run(dout, q, k, v, causal=causal, deterministic=deterministic)
    check_grads(grads, dout, q, k, v, causal)


@requires_torch
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_is_bitwise_repeatable(rng, d, causal):
    import torch
    q, k, v, dout = torch_inputs(rng, 2, 1023, 1024, 8, 2, d, "bfloat16")
    first = [g.clone() for g in run(dout, q, k, v, causal=causal, deterministic=True, poison=False)]
    import cuflash
    from cuflash.backward import attention_backward
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    for _ in range(20):
        again = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
        for a, b in zip(again, first):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    check_grads(first, dout, q, k, v, causal)


@requires_torch
def test_atomic_and_deterministic_agree(rng):
    import torch
    q, k, v, dout = torch_inputs(rng, 2, 300, 400, 4, 2, 128, "float16")
    a = run(dout, q, k, v, causal=True)
    b = run(dout, q, k, v, causal=True, deterministic=True)
    # dK and dV come from the same arithmetic either way; dQ differs in summation order
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=2e-3, rtol=1e-2)


@requires_torch
@pytest.mark.parametrize("deterministic", [False, True])
def test_softmax_scale_and_causal_rows_without_keys(rng, deterministic):
    import torch
    q, k, v, dout = torch_inputs(rng, 2, 200, 40, 4, 2, 64, "bfloat16")
    grads = run(dout, q, k, v, causal=True, softmax_scale=0.3, deterministic=deterministic)
    check_grads(grads, dout, q, k, v, True, softmax_scale=0.3)
    assert torch.all(grads[0][:, :160] == 0)  # rows 0..159 see no key


@requires_torch
@pytest.mark.parametrize("causal", [False, True])
def test_strided_inputs_and_outputs(rng, causal):
    """q, k, v sliced from one packed (b, s, 3, h, d) tensor; gradients written into slices of
    wider buffers in place, the rest of those buffers untouched."""
    import torch
    import cuflash
    from cuflash.backward import attention_backward
    qkv = torch.from_numpy(rng.standard_normal((2, 300, 3, 4, 64), dtype=np.float32)).to("cuda", torch.bfloat16)
    q, k, v = qkv.unbind(2)
    dout = torch.from_numpy(rng.standard_normal((2, 300, 4, 64), dtype=np.float32)).to("cuda", torch.bfloat16)
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    wide = torch.full((3, 2, 300, 4, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal=causal,
                                    dq=wide[0, ..., :64], dk=wide[1, ..., :64], dv=wide[2, ..., :64])
    assert dq.data_ptr() == wide[0].data_ptr()
    check_grads((dq, dk, dv), dout, q, k, v, causal)
    assert torch.isnan(wide[..., 64:]).all()


@requires_torch
def test_new_outputs_are_torch(rng):
    import torch
    q, k, v, dout = torch_inputs(rng, 1, 64, 96, 2, 1, 32, "float16")
    grads = run(dout, q, k, v, poison=False)
    assert all(isinstance(g, torch.Tensor) and g.dtype == torch.float16 for g in grads)
    assert [tuple(g.shape) for g in grads] == [tuple(q.shape), tuple(k.shape), tuple(v.shape)]
    check_grads(grads, dout, q, k, v, False)


@requires_torch
def test_zero_sizes(rng):
    import torch
    import cuflash
    from cuflash.backward import attention_backward
    q, k, v, dout = torch_inputs(rng, 2, 5, 0, 4, 4, 64, "bfloat16")
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse)
    assert torch.all(dq == 0) and dk.shape == k.shape and dv.shape == v.shape
    q0, d0 = q[:, :0], dout[:, :0]
    k, v = torch_inputs(rng, 2, 5, 7, 4, 4, 64, "bfloat16")[1:3]
    out, lse = cuflash.attention(q0, k, v, return_lse=True)
    dq, dk, dv = attention_backward(d0, q0, k, v, out, lse)
    assert dq.shape == q0.shape and torch.all(dk == 0) and torch.all(dv == 0)


def test_cupy_and_numpy_inputs(rng):
    import cupy
    import ml_dtypes
    import cuflash
    from cuflash.backward import attention_backward
    for dt in (np.float16, ml_dtypes.bfloat16):
        qn = rng.standard_normal((2, 77, 4, 64)).astype(dt)
        kn = rng.standard_normal((2, 91, 2, 64)).astype(dt)
        vn = rng.standard_normal((2, 91, 2, 64)).astype(dt)
        don = rng.standard_normal((2, 77, 4, 64)).astype(dt)
        qc, kc, vc, doc = (cupy.asarray(x) for x in (qn, kn, vn, don))
        out, lse = cuflash.attention(qc, kc, vc, causal=True, return_lse=True)
        dq = cupy.full(qc.shape, np.nan, dtype=qc.dtype)
        grads = attention_backward(doc, qc, kc, vc, out, lse, causal=True, dq=dq)
        assert grads[0] is dq and all(isinstance(g, cupy.ndarray) for g in grads)
        check_grads(grads, doc, qc, kc, vc, True)
        gn = attention_backward(don, qn, kn, vn, cupy.asnumpy(out), cupy.asnumpy(lse), causal=True)
        assert all(isinstance(g, np.ndarray) and g.dtype == qn.dtype for g in gn)
        check_grads(gn, don, qn, kn, vn, True)
