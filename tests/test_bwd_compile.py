"""Backward pass on the CPU: every backward variant renders and compiles offline (NVRTC, no GPU)
for sm_80 and sm_90 with a clean ptxas report and shared memory within the per-block limit; the
float64 reference gradients agree with finite differences and with an independent per-row loop;
bad arguments to attention_backward raise before any allocation or launch."""
import os
import re
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest

from cuflash import backward, compiler, reference
from cuflash.arrays import View
from cuflash.codegen import HEAD_DIM_BUCKETS, render
from conftest import GPU_PROBLEM, fake_view

VARIANTS = backward.bwd_variants(80) + backward.bwd_variants(90)
SMEM_LIMIT = 227 * 1024  # per-block opt-in limit on sm_80 / sm_90
ELF = b"\x7fELF"


# ---------------------------------------------------------------------------------------------
# Variants, rendering, compilation

def test_variant_set_and_names():
    vs = backward.bwd_variants(90)
    # 6 buckets x 2 dtypes x (2 causal x {dkdv_dq, dkdv, dq} + prep + convert)
    assert len(vs) == len(HEAD_DIM_BUCKETS) * 2 * (2 * 3 + 2) == 96
    names = [v.name for v in vs]
    assert len(set(names)) == len(names) and all(n.endswith("_sm90") for n in names)
    assert set(names).isdisjoint(v.name for v in backward.bwd_variants(80))
    assert {v.kind for v in vs} == {"bwd_prep", "bwd_dkdv", "bwd_dkdv_dq", "bwd_dq", "bwd_convert"}
    for bucket in HEAD_DIM_BUCKETS:
        for det in (False, True):
            ks = backward.variants(bucket, "bf16", True, det, 90)
            assert [v.kind for v in ks] == (["bwd_prep", "bwd_dkdv", "bwd_dq"] if det
                                            else ["bwd_prep", "bwd_dkdv_dq", "bwd_convert"])
            assert all(v in vs for v in ks)


@pytest.mark.parametrize("v", backward.bwd_variants(90), ids=lambda v: v.name)
def test_render(v):
    src = render(v)
    assert "{{" not in src and "{%" not in src and "%}" not in src and "{#" not in src
    assert re.search(r'extern "C"\s+__global__\s+void\s+(__launch_bounds__\([^)]*\)\s*)?'
                     + re.escape(v.name) + r"\(", src)
    b = lambda x: "true" if x else "false"
    assert f"constexpr int kHeadDim = {v.head_dim};" in src
    assert f"constexpr bool kIsBF16 = {b(v.dtype == 'bf16')};" in src
    if v.kind in ("bwd_dkdv", "bwd_dkdv_dq", "bwd_dq"):
        for c in (f"constexpr int kBlockM = {v.block_m};", f"constexpr int kBlockN = {v.block_n};",
                  f"constexpr int kNWarps = {v.warps};", f"constexpr bool kIsCausal = {b(v.causal)};",
                  f"constexpr int kStages = {v.stages};", "constexpr bool kEvenHeadDim = false;"):
            assert c in src, c
    if v.kind in ("bwd_dkdv", "bwd_dkdv_dq"):
        assert f"constexpr bool kDqAtomic = {b(v.kind == 'bwd_dkdv_dq')};" in src


@pytest.fixture(scope="module")
def compiled():
    """Every backward variant compiled once (the first alone: NVRTC loads its builtins then)."""
    first, rest = VARIANTS[0], VARIANTS[1:]
    out = {first: compiler.compile_variant(first)}
    with ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as ex:
        out.update(zip(rest, ex.map(compiler.compile_variant, rest)))
    return out


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_variant_compiles_without_spills(compiled, v):
    c = compiled[v]
    assert c.cubin[:4] == ELF
    assert f"entry function '{v.name}'" in c.log and f"for 'sm_{v.arch}'" in c.log
    r = c.resources
    assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0), f"{v.name}: {r}\n{c.log}"
    assert 0 < r.registers <= 255 and r.static_smem == 0, r
    assert backward.smem_bytes(v) <= SMEM_LIMIT
    assert v.smem_bytes <= SMEM_LIMIT  # what the generic loader sets before backward raises it


@pytest.mark.parametrize("v", [v for v in backward.bwd_variants(90)
                               if v.kind in ("bwd_dkdv", "bwd_dkdv_dq", "bwd_dq")], ids=lambda v: v.name)
def test_smem_bytes_matches_template(v):
    """backward.smem_bytes (what the launch asks for) equals the template's kSmemBytes: compile
    the template's constants with a static_assert (a fraction of a second, no kernel)."""
    src = render(v)
    consts = src[:src.index('// Element types and conversions')]
    check = consts + f'\nstatic_assert(kSmemBytes == {backward.smem_bytes(v)}, "smem mismatch");\n'
    compiler.compile_source(check, v.name + "_smem", 90)


# ---------------------------------------------------------------------------------------------
# Reference gradients

def _loss(dout, q, k, v, **kw):
    return float((reference.attention(q, k, v, **kw) * dout).sum())


def _finite_diff(dout, q, k, v, eps=1e-6, **kw):
    grads = []
    for x in (q, k, v):
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + eps
            up = _loss(dout, q, k, v, **kw)
            x[idx] = old - eps
            down = _loss(dout, q, k, v, **kw)
            x[idx] = old
            g[idx] = (up - down) / (2 * eps)
        grads.append(g)
    return grads


@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal", [
    (1, 5, 7, 4, 2, 3, False), (2, 7, 4, 2, 1, 5, True), (1, 3, 6, 2, 2, 4, True),
    (1, 6, 6, 3, 3, 2, True), (2, 1, 5, 2, 1, 3, False)])
def test_reference_matches_finite_differences(rng, b, sq, sk, h, hk, d, causal):
    q, k, v = (rng.standard_normal(s) for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d)))
    dout = rng.standard_normal((b, sq, h, d))
    got = reference.attention_backward(dout, q, k, v, causal=causal, softmax_scale=0.7)
    want = _finite_diff(dout, q, k, v, causal=causal, softmax_scale=0.7)
    for name, g, w in zip("qkv", got, want):
        assert g.dtype == np.float64
        np.testing.assert_allclose(g, w, atol=1e-7, rtol=1e-6, err_msg=f"d{name}")


def _naive_backward(dout, q, k, v, causal, scale):
    """One query row at a time, with the softmax Jacobian written out (independent of the
    blocked reference)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for bi in range(b):
        for hi in range(h):
            g = hi // (h // hk)
            for i in range(sq):
                keys = [j for j in range(sk) if not causal or j <= i + sk - sq]
                if not keys:
                    continue
                s = np.array([scale * q[bi, i, hi] @ k[bi, j, g] for j in keys])
                p = np.exp(s - s.max())
                p /= p.sum()
                jac = np.diag(p) - np.outer(p, p)  # d softmax / d s
                dp = np.array([dout[bi, i, hi] @ v[bi, j, g] for j in keys])
                ds = jac @ dp
                for n, j in enumerate(keys):
                    dv[bi, j, g] += p[n] * dout[bi, i, hi]
                    dq[bi, i, hi] += scale * ds[n] * k[bi, j, g]
                    dk[bi, j, g] += scale * ds[n] * q[bi, i, hi]
    return dq, dk, dv


@pytest.mark.parametrize("sq,sk,h,hk,causal", [(9, 13, 4, 2, True), (13, 9, 4, 1, True),
                                              (8, 8, 2, 2, False), (1, 17, 6, 3, True)])
def test_reference_matches_naive_loop(rng, sq, sk, h, hk, causal):
    d = 8
    q, k, v = (rng.standard_normal(s) for s in ((2, sq, h, d), (2, sk, hk, d), (2, sk, hk, d)))
    dout = rng.standard_normal((2, sq, h, d))
    got = reference.attention_backward(dout, q, k, v, causal=causal)
    want = _naive_backward(dout, q, k, v, causal, d ** -0.5)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-12, rtol=1e-10)


def test_reference_rows_that_see_no_key_give_zero_gradient(rng):
    q, k, v = (rng.standard_normal(s) for s in ((1, 10, 2, 8), (1, 4, 2, 8), (1, 4, 2, 8)))
    dout = rng.standard_normal(q.shape)
    dq, dk, dv = reference.attention_backward(dout, q, k, v, causal=True)
    assert np.all(dq[:, :6] == 0) and np.abs(dq[:, 6:]).max() > 0
    # the hidden rows change nothing in dk, dv
    _, dk2, dv2 = reference.attention_backward(dout[:, 6:], q[:, 6:], k, v, causal=True)
    np.testing.assert_allclose(dk, dk2, atol=1e-12)
    np.testing.assert_allclose(dv, dv2, atol=1e-12)
    # no key at all
    dq, dk, dv = reference.attention_backward(dout, q, k[:, :0], v[:, :0])
    assert np.all(dq == 0) and dk.shape == (1, 0, 2, 8)


@pytest.mark.parametrize("dt", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_reference_same_precision(rng, dt):
    q, k, v, dout = (rng.standard_normal(s).astype(dt) for s in
                     ((2, 33, 4, 16), (2, 47, 2, 16), (2, 47, 2, 16), (2, 33, 4, 16)))
    low = reference.attention_backward(dout, q, k, v, causal=True, precision="same")
    ref = reference.attention_backward(dout, q, k, v, causal=True)
    tol = 0.05 if dt == np.float16 else 0.2
    for lo, r in zip(low, ref):
        assert lo.dtype == np.dtype(dt) and r.dtype == np.float64
        err = reference.max_abs_err(lo, r)
        assert 0 < err < tol * max(1.0, np.abs(r).max()), err


def test_reference_gqa_sums_over_group(rng):
    q = rng.standard_normal((1, 5, 4, 8))
    k, v = rng.standard_normal((1, 6, 1, 8)), rng.standard_normal((1, 6, 1, 8))
    dout = rng.standard_normal(q.shape)
    dq, dk, dv = reference.attention_backward(dout, q, k, v)
    kk, vv = np.repeat(k, 4, axis=2), np.repeat(v, 4, axis=2)
    dq4, dk4, dv4 = reference.attention_backward(dout, q, kk, vv)
    np.testing.assert_allclose(dq, dq4, atol=1e-12)
    np.testing.assert_allclose(dk[:, :, 0], dk4.sum(axis=2), atol=1e-12)
    np.testing.assert_allclose(dv[:, :, 0], dv4.sum(axis=2), atol=1e-12)


def test_reference_rejects_bad_arguments():
    z = np.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match=r"dout: expected shape \(1, 4, 2, 8\)"):
        reference.attention_backward(z[:, :3], z, z, z)
    with pytest.raises(ValueError, match="precision"):
        reference.attention_backward(z, z, z, z, precision="half")


# ---------------------------------------------------------------------------------------------
# Argument validation (fake device views: nothing is allocated or launched)

Q, KV, LSE = (2, 4, 8, 64), (2, 6, 4, 64), (2, 8, 4)


@pytest.fixture
def no_launch(fake_views, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("validation passed: allocation or launch reached")
    monkeypatch.setattr(backward, "_launch", boom)
    monkeypatch.setattr(backward, "_backward_device", boom)


def _args(**over):
    a = dict(dout=fake_view(0, Q), q=fake_view(0, Q), k=fake_view(0, KV), v=fake_view(0, KV),
             out=fake_view(0, Q), lse=fake_view(0, LSE, "float32"))
    kw = {key: over.pop(key) for key in list(over) if key in ("causal", "softmax_scale", "deterministic",
                                                              "dq", "dk", "dv")}
    a.update(over)
    return a, kw


def _torch_view(shape, dtype="float16"):
    v = fake_view(0, shape, dtype)
    return View(v.ptr, v.shape, v.strides, v.dtype, v.device, "torch", None)


BAD = {
    "dout_shape": (dict(dout=fake_view(0, (2, 5, 8, 64))), ValueError, ["dout", "q's shape (2, 4, 8, 64)", "(2, 5, 8, 64)"]),
    "dout_dtype": (dict(dout=fake_view(0, Q, "bfloat16")), TypeError, ["dout", "float16", "bfloat16"]),
    "dout_strided": (dict(dout=fake_view(0, Q, strides=(4096, 1024, 128, 2))), ValueError, ["dout", "contiguous", "(4096, 1024, 128, 2)"]),
    "dout_device": (dict(dout=fake_view(1, Q)), ValueError, ["dout", "GPU 1", "GPU 0"]),
    "out_shape": (dict(out=fake_view(0, (2, 4, 8, 32))), ValueError, ["out", "q's shape", "(2, 4, 8, 32)"]),
    "out_dtype": (dict(out=fake_view(0, Q, "float32")), TypeError, ["out", "float16", "float32"]),
    "lse_shape": (dict(lse=fake_view(0, (2, 4, 8), "float32")), ValueError, ["lse", "(2, 8, 4)", "(2, 4, 8)"]),
    "lse_dtype": (dict(lse=fake_view(0, LSE, "float16")), TypeError, ["lse", "float32", "float16"]),
    "lse_host": (dict(lse=fake_view(-1, LSE, "float32")), ValueError, ["lse", "host memory"]),
    "q_k_head_dim": (dict(k=fake_view(0, (2, 6, 4, 32)), v=fake_view(0, (2, 6, 4, 32))), ValueError, ["k ", "head dim 64"]),
    "heads": (dict(k=fake_view(0, (2, 6, 3, 64)), v=fake_view(0, (2, 6, 3, 64))), ValueError, ["nheads (8)", "nheads_k (3)"]),
    "q_dtype": (dict(q=fake_view(0, Q, "float32")), TypeError, ["q must be float16 or bfloat16", "float32"]),
    "dq_shape": (dict(dq=fake_view(0, KV)), ValueError, ["dq", "q's shape", "(2, 6, 4, 64)"]),
    "dk_dtype": (dict(dk=fake_view(0, KV, "bfloat16")), TypeError, ["dk", "k's dtype float16", "bfloat16"]),
    "dv_shape": (dict(dv=fake_view(0, Q)), ValueError, ["dv", "v's shape (2, 6, 4, 64)"]),
    "dv_framework": (dict(dv=_torch_view(KV)), TypeError, ["dv", "cupy array like v", "torch"]),
    "dk_device": (dict(dk=fake_view(1, KV)), ValueError, ["dk", "GPU 1"]),
    "causal": (dict(causal=1), TypeError, ["causal must be a bool", "int"]),
    "deterministic": (dict(deterministic="yes"), TypeError, ["deterministic must be a bool", "str"]),
    "scale_negative": (dict(softmax_scale=-0.5), ValueError, ["softmax_scale", "positive", "-0.5"]),
    "scale_type": (dict(softmax_scale="0.1"), TypeError, ["softmax_scale", "real number", "str"]),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_arguments_raise_before_launch(no_launch, case):
    over, exc, fragments = BAD[case]
    a, kw = _args(**dict(over))
    with pytest.raises(exc) as info:
        backward.attention_backward(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], **kw)
    msg = str(info.value)
    for f in fragments:
        assert f in msg, (f, msg)


@pytest.mark.parametrize("kw", [{}, dict(causal=True, deterministic=True, softmax_scale=0.3),
                                dict(dq=fake_view(0, Q), dk=fake_view(0, KV), dv=fake_view(0, KV))])
def test_good_arguments_reach_the_device_path(no_launch, kw):
    a, _ = _args()
    with pytest.raises(AssertionError, match="validation passed"):
        backward.attention_backward(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], **kw)


def test_not_an_array():
    z = np.zeros(Q, np.float16)
    with pytest.raises(TypeError, match="dout must be an array"):
        backward.attention_backward("x", z, np.zeros(KV, np.float16), np.zeros(KV, np.float16), z,
                                    np.zeros(LSE, np.float32))


@pytest.mark.skipif(GPU_PROBLEM is None, reason="checks the message given without a GPU")
def test_numpy_inputs_need_a_gpu():
    z, kv = np.zeros(Q, np.float16), np.zeros(KV, np.float16)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        backward.attention_backward(z, z, kv, kv, z, np.zeros(LSE, np.float32))


def test_tiles_cover_every_bucket():
    for table in (backward.DKDV_TILES, backward.DQ_TILES):
        assert sorted(table) == list(HEAD_DIM_BUCKETS)
        for bm, bn, w, st in table.values():
            assert backward.ROW_PAD % bm == 0 and bn % 16 == 0 and w in (4, 8) and st in (1, 2)
