"""Backward pass on the GPU against the float64 reference, with flash-attn's rule for gradients:
max|grad - ref64| <= 3 * max|ref_same - ref64| + 1e-4 (ref_same rounds P, dS and the gradients
to the input dtype like a fused kernel, and forms D from the same-precision forward's output),
on fresh random inputs, gradients written into
NaN-poisoned buffers. Deterministic mode is checked for bitwise repeatability. Sliding windows,
softcap and ALiBi are crossed with causal, GQA and both dQ paths; attention_varlen_backward runs
on random packed lengths (empty and length-1 sequences included)."""
import numpy as np
import pytest

from conftest import requires_gpu, requires_torch, warm

pytestmark = [requires_gpu]

DTYPES = ["float16", "bfloat16"]
HEAD_DIMS = [32, 64, 80, 96, 128, 256]
SHAPES = [(113, 203), (128, 217), (1, 239), (239, 1)]
LONG_SHAPES = [(1024, 1024), (1023, 1024), (1024, 1023), (256, 512), (512, 256), (127, 513)]


@pytest.fixture(scope="session", autouse=True)
def _compile_everything():
    """Build every backward variant once, in parallel, before the tests (conftest.warm)."""
    import cupy
    from cuflash.kernels import bwd
    warm(bwd.variants(int(cupy.cuda.Device().compute_capability)))


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


def _mods_np(mods):
    """Window/softcap/ALiBi keyword arguments for the reference (slopes as NumPy)."""
    mods = dict(mods)
    if mods.get("alibi_slopes") is not None:
        mods["alibi_slopes"] = to_np(mods["alibi_slopes"])
    return mods


def _compare(grads, ref64, same, what):
    from cuflash.reference import max_abs_err
    for name, g, r, s in zip(("dq", "dk", "dv"), grads, ref64, same):
        g = to_np(g)
        assert g.shape == r.shape, (name, g.shape, r.shape)
        err, bound = max_abs_err(g, r), 3 * max_abs_err(s, r) + 1e-4
        assert err <= bound, f"{name}: max error {err:.3g} exceeds bound {bound:.3g} ({what})"


def check_grads(grads, dout, q, k, v, causal, softmax_scale=None, **mods):
    from cuflash.reference import attention_backward
    args = [to_np(x) for x in (dout, q, k, v)]
    kw = dict(causal=causal, softmax_scale=softmax_scale, **_mods_np(mods))
    ref64 = attention_backward(*args, **kw)
    same = attention_backward(*args, precision="same", **kw)
    _compare(grads, ref64, same, f"causal={causal} {mods if mods else ''}")


def run(dout, q, k, v, causal=False, softmax_scale=None, deterministic=False, poison=True, **mods):
    """Forward for out/lse, then the backward into NaN-filled gradient buffers. ``mods``:
    window_size, softcap, alibi_slopes (for both passes)."""
    import torch
    import cuflash
    from cuflash.backward import attention_backward
    out, lse = cuflash.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True, **mods)
    kw = {}
    if poison:
        kw = dict(dq=torch.full_like(q, float("nan")), dk=torch.full_like(k, float("nan")),
                  dv=torch.full_like(v, float("nan")))
    grads = attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                               deterministic=deterministic, **mods, **kw)
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


# ---------------------------------------------------------------------------------------------
# Sliding windows, softcap, ALiBi

WINDOWS = [(-1, -1), (48, 0), (48, 48), (0, 0)]
MODS = [(0.0, None), (50.0, None), (0.0, "h"), (50.0, "bh")]  # (softcap, ALiBi slopes shape)


def slopes(rng, kind, b, h):
    import torch
    if kind is None:
        return None
    shape = (h,) if kind == "h" else (b, h)
    return torch.from_numpy(rng.uniform(0.01, 0.3, size=shape).astype(np.float32)).cuda()


def mods_kw(rng, window, softcap, alibi, b, h):
    return dict(window_size=window, softcap=softcap, alibi_slopes=slopes(rng, alibi, b, h))


@requires_torch
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("softcap,alibi", MODS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("deterministic", [False, True])
def test_window_softcap_alibi(rng, window, softcap, alibi, causal, d, deterministic):
    """Every mask x score-modifier kernel flavour, GQA, both dQ paths (sk > sq: keys before the
    band; then sq > sk: rows that see no key)."""
    dtype = "float16" if deterministic else "bfloat16"
    for sq, sk in ((113, 203), (203, 113)):
        q, k, v, dout = torch_inputs(rng, 2, sq, sk, 4, 2, d, dtype)
        mods = mods_kw(rng, window, softcap, alibi, 2, 4)
        grads = run(dout, q, k, v, causal=causal, deterministic=deterministic, **mods)
        check_grads(grads, dout, q, k, v, causal, **mods)


@requires_torch
@pytest.mark.parametrize("window", [(17, 0), (100, 5), (0, 0), (-1, 30), (64, -1)])
@pytest.mark.parametrize("sq,sk", [(1, 239), (239, 1), (256, 256), (128, 217), (217, 128)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_window_shapes(rng, window, sq, sk, deterministic):
    """Band edges at and across block boundaries, one-row and one-key problems; softcap and
    ALiBi ride along on the deterministic path."""
    q, k, v, dout = torch_inputs(rng, 2, sq, sk, 4, 4, 64, "bfloat16")
    mods = dict(window_size=window)
    if deterministic:
        mods.update(softcap=50.0, alibi_slopes=slopes(rng, "h", 2, 4))
    grads = run(dout, q, k, v, deterministic=deterministic, **mods)
    check_grads(grads, dout, q, k, v, False, **mods)


@requires_torch
@pytest.mark.parametrize("d", [32, 40, 59, 96, 128, 160, 192, 256])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("deterministic", [False, True])
def test_mods_head_dims(rng, d, dtype, deterministic):
    """The window + softcap + ALiBi kernels of every head-dim bucket (40, 160: column predicates
    below the bucket; 59: padded copies)."""
    q, k, v, dout = torch_inputs(rng, 2, 150, 190, 4, 2, d, dtype)
    mods = mods_kw(rng, (40, 10), 50.0, "bh", 2, 4)
    grads = run(dout, q, k, v, deterministic=deterministic, **mods)
    check_grads(grads, dout, q, k, v, False, **mods)


@requires_torch
@pytest.mark.parametrize("h,hk", [(8, 2), (8, 1), (6, 3)])
@pytest.mark.parametrize("window", [(32, 0), (32, 32)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_mods_gqa_mqa(rng, h, hk, window, deterministic):
    """Per-head ALiBi slopes while a K/V block walks its group's query heads."""
    q, k, v, dout = torch_inputs(rng, 2, 177, 177, h, hk, 128, "bfloat16")
    mods = mods_kw(rng, window, 30.0, "bh", 2, h)
    grads = run(dout, q, k, v, causal=window[1] == 0, deterministic=deterministic, **mods)
    check_grads(grads, dout, q, k, v, window[1] == 0, **mods)


@requires_torch
def test_mods_deterministic_is_bitwise_repeatable(rng):
    import torch
    import cuflash
    from cuflash.backward import attention_backward
    q, k, v, dout = torch_inputs(rng, 2, 511, 700, 8, 2, 128, "bfloat16")
    mods = mods_kw(rng, (200, 0), 50.0, "h", 2, 8)
    first = [g.clone() for g in run(dout, q, k, v, deterministic=True, poison=False, **mods)]
    out, lse = cuflash.attention(q, k, v, return_lse=True, **mods)
    for _ in range(10):
        again = attention_backward(dout, q, k, v, out, lse, deterministic=True, **mods)
        for a, b in zip(again, first):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    check_grads(first, dout, q, k, v, False, **mods)
    atomic = run(dout, q, k, v, poison=False, **mods)
    for x, y in zip(atomic, first):
        torch.testing.assert_close(x, y, atol=2e-2, rtol=2e-2)


@requires_torch
def test_window_that_hides_nothing_matches_the_plain_call(rng):
    """A window reaching past every key runs the plain kernels: same bits as no window."""
    import torch
    q, k, v, dout = torch_inputs(rng, 1, 100, 150, 2, 2, 64, "float16")
    a = run(dout, q, k, v, deterministic=True, poison=False)
    b = run(dout, q, k, v, deterministic=True, poison=False, window_size=(150, 99))
    c = run(dout, q, k, v, causal=True, deterministic=True, poison=False)
    e = run(dout, q, k, v, deterministic=True, poison=False, window_size=(-1, 0))
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    for x, y in zip(c, e):
        assert torch.equal(x, y)


# ---------------------------------------------------------------------------------------------
# attention_varlen_backward

def varlen_case(rng, b, max_q, max_k, h, hk, d, dtype):
    """Random packed lengths in [0, max]; the maxima are reached, one query sequence is empty,
    one has a single row, one key sequence is empty and one has a single key."""
    import torch
    lq, lk = rng.integers(0, max_q + 1, size=b), rng.integers(0, max_k + 1, size=b)
    lq[0], lk[0] = max_q, max_k
    lq[1], lq[2], lk[3], lk[4] = 0, 1, 0, 1
    perm = rng.permutation(b)
    lq, lk = lq[perm], lk[perm]
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    tdt = getattr(torch, dtype)
    mk = lambda *s: torch.from_numpy(rng.standard_normal(s, dtype=np.float32)).to("cuda", tdt)
    q, k, v = mk(int(cq[-1]), h, d), mk(int(ck[-1]), hk, d), mk(int(ck[-1]), hk, d)
    return q, k, v, mk(int(cq[-1]), h, d), cq, ck


def run_varlen(dout, q, k, v, cq, ck, causal=False, deterministic=False, poison=True, **mods):
    import torch
    import cuflash
    from cuflash.backward import attention_varlen_backward
    cqd, ckd = torch.from_numpy(cq).cuda(), torch.from_numpy(ck).cuda()
    mq, mk = int(np.diff(cq).max()), int(np.diff(ck).max())
    out, lse = cuflash.attention_varlen(q, k, v, cqd, ckd, mq, mk, causal=causal, return_lse=True, **mods)
    kw = {}
    if poison:
        kw = dict(dq=torch.full_like(q, float("nan")), dk=torch.full_like(k, float("nan")),
                  dv=torch.full_like(v, float("nan")))
    grads = attention_varlen_backward(dout, q, k, v, out, lse, cqd, ckd, mq, mk, causal=causal,
                                      deterministic=deterministic, **mods, **kw)
    if poison:
        assert all(g is kw[n] for g, n in zip(grads, ("dq", "dk", "dv")))
    return grads


def check_varlen(grads, dout, q, k, v, cq, ck, causal, **mods):
    from cuflash.reference import attention_varlen_backward
    args = [to_np(x) for x in (dout, q, k, v)]
    kw = dict(causal=causal, **_mods_np(mods))
    ref64 = attention_varlen_backward(*args, cq, ck, **kw)
    same = attention_varlen_backward(*args, cq, ck, precision="same", **kw)
    _compare(grads, ref64, same, f"varlen causal={causal} {mods}")


@requires_torch
@pytest.mark.parametrize("window", [(-1, -1), (40, 0), (40, 40)])
@pytest.mark.parametrize("softcap,alibi", [(0.0, None), (50.0, "bh"), (0.0, "h")])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen(rng, window, softcap, alibi, causal, d, deterministic):
    dtype = "bfloat16" if d == 128 else "float16"
    q, k, v, dout, cq, ck = varlen_case(rng, 7, 230, 256, 6, 2, d, dtype)
    mods = mods_kw(rng, window, softcap, alibi, 7, 6)
    grads = run_varlen(dout, q, k, v, cq, ck, causal=causal, deterministic=deterministic, **mods)
    check_varlen(grads, dout, q, k, v, cq, ck, causal, **mods)


@requires_torch
@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen_equals_dense_for_equal_lengths(rng, deterministic):
    """Equal lengths packed: the same kernels on the same rows as the dense call, from the same
    out and LSE (deterministic: bitwise; atomic: up to the order of the dQ additions)."""
    import torch
    import cuflash
    from cuflash.backward import attention_backward, attention_varlen_backward
    q, k, v, dout = torch_inputs(rng, 3, 97, 130, 4, 2, 64, "bfloat16")
    mods = mods_kw(rng, (40, 3), 50.0, "bh", 3, 4)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **mods)
    dense = attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **mods)
    cq = torch.arange(4, dtype=torch.int32, device="cuda") * 97
    ck = torch.arange(4, dtype=torch.int32, device="cuda") * 130
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    lse_packed = lse.permute(1, 0, 2).reshape(4, -1)  # (nheads, total_q)
    packed = attention_varlen_backward(flat(dout), flat(q), flat(k), flat(v), flat(out), lse_packed, cq, ck,
                                       97, 130, deterministic=deterministic, **mods)
    for x, y in zip(packed, dense):
        if deterministic:
            assert torch.equal(x, flat(y))
        else:
            torch.testing.assert_close(x, flat(y), atol=2e-2, rtol=2e-2)
    check_grads(dense, dout, q, k, v, False, **mods)


@requires_torch
def test_varlen_strided_and_sequences_without_queries_or_keys(rng):
    """q, k, v sliced from one packed (total, 3, h, d) tensor; a sequence with keys but no query
    gets zero dk, dv; tokens past the last sequence are left untouched."""
    import torch
    lens_q, lens_k = [50, 0, 33, 1], [70, 20, 0, 1]
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    total = 100
    qkv = torch.from_numpy(rng.standard_normal((total, 3, 4, 64), dtype=np.float32)).to("cuda", torch.bfloat16)
    q, k, v = qkv[:cq[-1], 0], qkv[:, 1], qkv[:, 2]
    dout = torch.from_numpy(rng.standard_normal(q.shape, dtype=np.float32)).to("cuda", torch.bfloat16)
    dq, dk, dv = run_varlen(dout, q, k, v, cq, ck, causal=True)
    check_varlen((dq, dk[:ck[-1]], dv[:ck[-1]]), dout, q, k[:ck[-1]], v[:ck[-1]], cq, ck, True)
    assert torch.all(dk[70:90] == 0) and torch.all(dv[70:90] == 0)
    assert torch.isnan(dk[ck[-1]:]).all() and torch.isnan(dv[ck[-1]:]).all()


@requires_torch
@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen_nan_in_the_next_sequence(rng, monkeypatch, d, causal, deterministic):
    """A sequence's tail query and key blocks also load the next sequence's first tokens (masked
    out; on sm_90 the warp-specialised kernel's TMA tiles at d = 64, 128, 256), the last one the
    tokens after it. NaN there (the middle sequence's own q, k, v and dout; 7 tokens after the
    last sequence) must not reach the other sequences' gradients: 0 * NaN in dV += P^T dO,
    dK += dS^T Q or dQ += dS K would."""
    import torch
    from cuflash import backward
    fired, fire = [], backward.fire
    monkeypatch.setattr(backward, "fire", lambda ls, *a: (fired.extend(la.kernel.name for la in ls), fire(ls, *a))[1])
    lq, lk = [200, 77, 300], [300, 77, 500]
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    mk = lambda n, h: torch.from_numpy(rng.standard_normal((n, h, d), dtype=np.float32)).to("cuda", torch.bfloat16)
    q, dout, k, v = mk(int(cq[-1]) + 7, 8), mk(int(cq[-1]) + 7, 8), mk(int(ck[-1]) + 7, 2), mk(int(ck[-1]) + 7, 2)
    for x, c in ((q, cq), (dout, cq), (k, ck), (v, ck)):
        x[c[1]:c[2]] = float("nan")  # sequence 1: its own gradients are NaN, the others' must not be
        x[c[-1]:] = float("nan")
    dq, dk, dv = run_varlen(dout, q, k, v, cq, ck, causal=causal, deterministic=deterministic)
    if torch.cuda.get_device_capability() == (9, 0) and d != 96:
        assert any(n.startswith("bwd_ws_") for n in fired), fired
    for i in (0, 2):
        rq, rk = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        for name, g in (("dq", dq[rq]), ("dk", dk[rk]), ("dv", dv[rk])):
            assert bool(torch.isfinite(g).all()), f"{name} of sequence {i}"
        one = lambda x, r: x[r].contiguous()
        check_varlen((dq[rq], dk[rk], dv[rk]), one(dout, rq), one(q, rq), one(k, rk), one(v, rk),
                     np.array([0, lq[i]], np.int32), np.array([0, lk[i]], np.int32), causal)


@requires_torch
def test_varlen_deterministic_is_bitwise_repeatable(rng):
    import torch
    q, k, v, dout, cq, ck = varlen_case(rng, 6, 256, 256, 8, 2, 128, "bfloat16")
    mods = mods_kw(rng, (64, 0), 50.0, "bh", 6, 8)
    first = [g.clone() for g in run_varlen(dout, q, k, v, cq, ck, deterministic=True, poison=False, **mods)]
    for _ in range(5):
        again = run_varlen(dout, q, k, v, cq, ck, deterministic=True, poison=False, **mods)
        for a, b in zip(again, first):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    check_varlen(first, dout, q, k, v, cq, ck, False, **mods)


def test_varlen_cupy_and_numpy_inputs(rng):
    import cupy
    import ml_dtypes
    import cuflash
    from cuflash.backward import attention_varlen_backward
    cq, ck = np.array([0, 40, 40, 77], np.int32), np.array([0, 33, 90, 91], np.int32)
    for dt in (np.float16, ml_dtypes.bfloat16):
        qn, don = (rng.standard_normal((77, 4, 64)).astype(dt) for _ in range(2))
        kn, vn = (rng.standard_normal((91, 2, 64)).astype(dt) for _ in range(2))
        slopes_n = rng.uniform(0.01, 0.3, 4).astype(np.float32)
        kw = dict(causal=True, window_size=(20, 0), softcap=50.0)
        dev = [cupy.asarray(x) for x in (qn, kn, vn, don, cq, ck, slopes_n)]
        qc, kc, vc, doc, cqc, ckc, sc = dev
        out, lse = cuflash.attention_varlen(qc, kc, vc, cqc, ckc, 40, 57, return_lse=True, alibi_slopes=sc, **kw)
        grads = attention_varlen_backward(doc, qc, kc, vc, out, lse, cqc, ckc, 40, 57, alibi_slopes=sc, **kw)
        assert all(isinstance(g, cupy.ndarray) for g in grads)
        check_varlen(grads, doc, qc, kc, vc, cq, ck, True, window_size=(20, 0), softcap=50.0, alibi_slopes=slopes_n)
        gn = attention_varlen_backward(don, qn, kn, vn, cupy.asnumpy(out), cupy.asnumpy(lse), cq, ck, 40, 57,
                                       alibi_slopes=slopes_n, **kw)
        assert all(isinstance(g, np.ndarray) and g.dtype == qn.dtype for g in gn)
        check_varlen(gn, don, qn, kn, vn, cq, ck, True, window_size=(20, 0), softcap=50.0, alibi_slopes=slopes_n)


@requires_torch
def test_varlen_zero_sizes(rng):
    import torch
    from cuflash.backward import attention_varlen_backward
    q, k, v, dout = (torch.zeros(s, device="cuda", dtype=torch.float16) for s in
                     ((0, 4, 64), (5, 2, 64), (5, 2, 64), (0, 4, 64)))
    z = torch.zeros(3, device="cuda", dtype=torch.int32)
    ck = torch.tensor([0, 2, 5], device="cuda", dtype=torch.int32)
    lse = torch.zeros(4, 0, device="cuda")
    dq, dk, dv = attention_varlen_backward(dout, q, k, v, dout, lse, z, ck, 0, 3)
    assert dq.shape == (0, 4, 64) and torch.all(dk == 0) and torch.all(dv == 0)


# ---------------------------------------------------------------------------------------------
# Through torch autograd (cuflash.torch passes window, softcap and ALiBi to the backward)

@requires_torch
@pytest.mark.parametrize("deterministic", [False, True])
def test_torch_autograd_mods_dense_and_varlen(rng, deterministic):
    import torch
    import cuflash.torch as ct
    q, k, v, dout = torch_inputs(rng, 2, 150, 170, 4, 2, 64, "bfloat16")
    mods = mods_kw(rng, (30, 0), 40.0, "bh", 2, 4)
    for x in (q, k, v):
        x.requires_grad_()
    ct.attention(q, k, v, deterministic=deterministic, **mods).backward(dout)
    check_grads((q.grad, k.grad, v.grad), dout, q.detach(), k.detach(), v.detach(), False, **mods)

    qp, kp, vp, dop, cq, ck = varlen_case(rng, 6, 200, 220, 4, 2, 64, "float16")
    mods = mods_kw(rng, (50, 10), 30.0, "h", 6, 4)
    for x in (qp, kp, vp):
        x.requires_grad_()
    out = ct.attention_varlen(qp, kp, vp, torch.from_numpy(cq).cuda(), torch.from_numpy(ck).cuda(),
                              int(np.diff(cq).max()), int(np.diff(ck).max()), causal=True,
                              deterministic=deterministic, **mods)
    out.backward(dop)
    check_varlen((qp.grad, kp.grad, vp.grad), dop, qp.detach(), kp.detach(), vp.detach(), cq, ck, True, **mods)
