"""Backward pass on the CPU: every backward variant renders and compiles offline (NVRTC, no GPU)
for sm_80 and sm_90 with a clean ptxas report and shared memory within the per-block limit; the
float64 reference gradients agree with finite differences and with an independent per-row loop;
bad arguments to attention_backward raise before any allocation or launch."""
import re

import ml_dtypes
import numpy as np
import pytest

from cuflash import backward, compiler, reference
from cuflash.arrays import View
from cuflash.codegen import render
from cuflash.kernels import HEAD_DIM_BUCKETS, MMAS, bwd as family
from cuflash.kernels.bwd import BwdTileVariant
from cuflash.plan import DeviceFacts, Problem, make_backward_plan
from conftest import GPU_PROBLEM, check_same_precision, fake_view, finite_diff, naive_backward


# ---------------------------------------------------------------------------------------------
# Variants, rendering, compilation

def test_variant_set_and_names():
    vs = family.variants(90)
    # 6 buckets x 2 dtypes x (3 masks x 4 softcap/ALiBi x {dkdv_dq, dkdv, dq} + prep + convert), and
    # FlashMask's: 6 x 2 x 4 (causal, n) x 2 softcap x {dkdv_dq, dkdv, dq}, and dropout's: 6 x 2 x 3
    # masks x 4 softcap/ALiBi x {dkdv_dq, dkdv, dq}
    assert len(vs) == len(HEAD_DIM_BUCKETS) * 2 * (3 * 4 * 3 + 2 + 4 * 2 * 3 + 3 * 4 * 3) == 1176
    assert sum(getattr(v, "flashmask", 0) > 0 for v in vs) == 288
    assert sum(getattr(v, "dropout", False) for v in vs) == 432
    base = family.variants(90, mods=False)
    assert len(base) == len(HEAD_DIM_BUCKETS) * 2 * (2 * 3 + 2) == 96 and set(base) <= set(vs)
    assert not any(getattr(v, f, False) for v in base for f in ("local", "softcap", "alibi"))
    names = [v.name for v in vs]
    assert len(set(names)) == len(names) and all(n.endswith("_sm90") for n in names)
    assert set(names).isdisjoint(v.name for v in family.variants(80))
    assert {v.kind for v in vs} == {"bwd_prep", "bwd_dkdv", "bwd_dkdv_dq", "bwd_dq", "bwd_convert"}
    for bucket in HEAD_DIM_BUCKETS:
        for det in (False, True):
            ks = family.kernels(bucket, "bf16", True, det, 90)
            assert [v.kind for v in ks] == (["bwd_prep", "bwd_dkdv", "bwd_dq"] if det
                                            else ["bwd_prep", "bwd_dkdv_dq", "bwd_convert"])
            assert all(v in vs for v in ks)
            for local, softcap, alibi in ((True, False, False), (False, True, True), (True, True, False)):
                ks = family.kernels(bucket, "fp16", False, det, 90, local, softcap, alibi)
                assert all(v in vs for v in ks)
                assert all((v.local, v.softcap, v.alibi) == (local, softcap, alibi)
                           for v in ks if v.kind not in ("bwd_prep", "bwd_convert"))


def test_base_tiles_unchanged():
    """The mma.sync tiles without window/softcap/ALiBi are the verified ones; a flag only ever
    shrinks them."""
    for bucket in HEAD_DIM_BUCKETS:
        for softcap in (False, True):
            for alibi in (False, True):
                dk, dq = family.dkdv_tile(bucket, softcap, alibi, 80), family.DQ_TILES[bucket]
                if not (softcap or alibi):
                    assert dk == family.DKDV_TILES[bucket] and dq == family.DQ_TILES[bucket]
                assert dk[0] <= family.DKDV_TILES[bucket][0] and dq[0] <= family.DQ_TILES[bucket][0]
                assert family.ROW_PAD % dk[0] == 0 and family.ROW_PAD % dq[0] == 0


def test_mma_choice():
    """The wgmma dK/dV kernel runs d = 64 and 128 on sm_90, windows and deterministic mode
    included; softcap, ALiBi, other buckets and other archs run the mma.sync kernel (bwd/dkdv.cu.j2).
    Its source is bwd/dkdv_wgmma.cu.j2, compiled for sm_90a."""
    for bucket in HEAD_DIM_BUCKETS:
        for arch in (80, 90, 120):
            for causal, local, softcap, alibi in ((False, False, False, False), (True, False, False, False),
                                                  (False, True, False, False), (True, False, True, False),
                                                  (True, False, False, True)):
                for det in (False, True):
                    dk = family.kernels(bucket, "fp16", causal, det, arch, local, softcap, alibi)[1]
                    wg = arch == 90 and bucket in (64, 128) and not (softcap or alibi)
                    assert dk.mma == ("wgmma" if wg else "sync"), dk.name
                    assert dk.name.endswith(f"{'_wgmma' if wg else ''}_m{dk.block_m}n{dk.block_n}"
                                            f"w{dk.warps}s{dk.stages}_sm{arch}")
                    assert dk.target == (f"{arch}a" if wg else str(arch))
                    src = render(dk)
                    assert ("bwd/dkdv_wgmma.cu.j2" in src) == wg and ("wgmma.mma_async" in src) == wg
                    assert ("kSStride" in src) == (not wg)
    ok = dict(block_m=128, block_n=128, warps=8, stages=2, arch=90, mma="wgmma")
    v = lambda kind, d, **kw: BwdTileVariant(kind=kind, head_dim=d, dtype="fp16", **kw)  # noqa: E731
    assert v("bwd_dkdv_dq", 64, **ok).name.endswith("_wgmma_m128n128w8s2_sm90")
    for bad in (dict(softcap=True), dict(alibi=True), dict(arch=80), dict(block_m=32), dict(stages=1)):
        with pytest.raises(ValueError, match="wgmma"):
            v("bwd_dkdv_dq", 64, **{**ok, **bad})
    with pytest.raises(ValueError, match="wgmma"):  # 128-query steps only at d = 64
        v("bwd_dkdv", 128, **ok)
    with pytest.raises(ValueError, match="wgmma"):
        v("bwd_dq", 64, **ok)


@pytest.mark.parametrize("causal,window,sq,sk,want", [
    (False, (-1, -1), 10, 10, (False, False, (-1, -1))),
    (True, (-1, -1), 10, 10, (True, False, (-1, 0))),
    (False, (-1, 0), 10, 10, (True, False, (-1, 0))),
    (True, (3, 5), 10, 12, (False, True, (3, 0))),
    (False, (12, -1), 10, 12, (False, False, (-1, -1))),   # left edge past every key
    (False, (2, 9), 10, 12, (False, True, (2, -1))),       # right edge past every key
    (True, (-1, -1), 1, 12, (False, False, (-1, -1))),     # one query sees every key
    (False, (0, 0), 10, 10, (False, True, (0, 0)))])
def test_mask_as_launched(causal, window, sq, sk, want):
    plan = make_backward_plan(Problem(1, sq, sk, 2, 2, 64, "bf16", causal=causal, window=window), DeviceFacts(132, 90))
    local = plan.launches[1].variant.local
    assert (plan.causal_eff, local, plan.window_eff) == want
    assert plan.launches[1].variant.causal == plan.causal_eff


@pytest.mark.parametrize("v", family.variants(90), ids=lambda v: v.name)
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
                  f"constexpr int kStages = {v.stages};", "constexpr bool kEvenHeadDim = false;",
                  f"constexpr bool kIsLocal = {b(v.local)};", f"constexpr bool kSoftcap = {b(v.softcap)};",
                  f"constexpr bool kAlibi = {b(v.alibi)};"):
            assert c in src, c
    if v.kind in ("bwd_dkdv", "bwd_dkdv_dq"):
        assert f"constexpr bool kDqAtomic = {b(v.kind == 'bwd_dkdv_dq')};" in src


_SHAPES = {(v.kind, v.head_dim, v.block_m, v.block_n, v.stages, v.mma): v for arch in (80, 90)
           for v in family.variants(arch) if v.kind in family.TILE_KINDS}  # what kSmemBytes depends on


@pytest.mark.parametrize("v", list(_SHAPES.values()), ids=lambda v: v.name)
def test_smem_bytes_matches_template(v):
    """smem_bytes (what the launch asks for) equals the template's kSmemBytes: compile
    the template's constants with a static_assert (a fraction of a second, no kernel)."""
    src = render(v)
    consts = src[:src.index('// Element types and conversions')]
    check = consts + f'\nstatic_assert(kSmemBytes == {v.smem_bytes}, "smem mismatch");\n'
    compiler.compile_source(check, v.name + "_smem", 90)


# ---------------------------------------------------------------------------------------------
# Reference gradients

def _loss(dout, q, k, v, **kw):
    return float((reference.attention(q, k, v, **kw) * dout).sum())


def _finite_diff(dout, q, k, v, eps=1e-6, **kw):
    return finite_diff(lambda: _loss(dout, q, k, v, **kw), (q, k, v), eps)


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


@pytest.mark.parametrize("sq,sk,h,hk,causal", [(9, 13, 4, 2, True), (13, 9, 4, 1, True),
                                              (8, 8, 2, 2, False), (1, 17, 6, 3, True)])
def test_reference_matches_naive_loop(rng, sq, sk, h, hk, causal):
    d = 8
    q, k, v = (rng.standard_normal(s) for s in ((2, sq, h, d), (2, sk, hk, d), (2, sk, hk, d)))
    dout = rng.standard_normal((2, sq, h, d))
    got = reference.attention_backward(dout, q, k, v, causal=causal)
    want = naive_backward(dout, q, k, v, d ** -0.5, right=0 if causal else -1)
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
    check_same_precision(low, ref, dt)


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
KWARGS = ("causal", "softmax_scale", "deterministic", "dq", "dk", "dv", "window_size", "softcap", "alibi_slopes")


@pytest.fixture
def no_launch(fake_views, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("validation passed: allocation or launch reached")
    monkeypatch.setattr(backward, "_prepare", boom)
    monkeypatch.setattr(backward, "_backward_device", boom)


def _args(**over):
    a = dict(dout=fake_view(0, Q), q=fake_view(0, Q), k=fake_view(0, KV), v=fake_view(0, KV),
             out=fake_view(0, Q), lse=fake_view(0, LSE, "float32"))
    kw = {key: over.pop(key) for key in list(over) if key in KWARGS}
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
    "window_type": (dict(window_size=(3,)), TypeError, ["window_size", "pair of ints", "(3,)"]),
    "window_float": (dict(window_size=(3.0, 0)), TypeError, ["window_size", "pair of ints"]),
    "window_value": (dict(window_size=(-2, 0)), ValueError, ["window_size", ">= 0", "-1", "(-2, 0)"]),
    "softcap_negative": (dict(softcap=-1.0), ValueError, ["softcap", ">= 0", "-1.0"]),
    "softcap_type": (dict(softcap="30"), TypeError, ["softcap", "real number", "str"]),
    "softcap_nan": (dict(softcap=float("nan")), ValueError, ["softcap", "finite"]),
    "alibi_dtype": (dict(alibi_slopes=fake_view(0, (8,), "float16")), TypeError, ["alibi_slopes", "float32", "float16"]),
    "alibi_shape": (dict(alibi_slopes=fake_view(0, (3, 8), "float32")), ValueError,
                    ["alibi_slopes", "(8,) or (2, 8)", "(3, 8)"]),
    "alibi_strided": (dict(alibi_slopes=fake_view(0, (2, 8), "float32", strides=(16, 2))), ValueError,
                      ["alibi_slopes", "contiguous", "(16, 2)"]),
    "alibi_device": (dict(alibi_slopes=fake_view(1, (8,), "float32")), ValueError, ["alibi_slopes", "GPU 1", "GPU 0"]),
    "alibi_host": (dict(alibi_slopes=fake_view(-1, (8,), "float32")), ValueError, ["alibi_slopes", "host memory"]),
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
                                dict(dq=fake_view(0, Q), dk=fake_view(0, KV), dv=fake_view(0, KV)),
                                dict(window_size=(16, 0), softcap=30.0, alibi_slopes=fake_view(0, (2, 8), "float32")),
                                dict(window_size=[-1, 4], causal=True, alibi_slopes=fake_view(0, (8,), "float32"))])
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
    tiles = [t[:4] for t in family.DKDV_TILES.values()] + list(family.DQ_TILES.values())
    for table in (family.DKDV_TILES, family.DQ_TILES):
        assert sorted(table) == list(HEAD_DIM_BUCKETS)
    tiles += [t[:4] for table in (family.DKDV_WGMMA_TILES, family.DKDV_SOFTCAP_TILES) for t in table.values()]
    for bm, bn, w, st in tiles:
        assert family.ROW_PAD % bm == 0 and bn % 16 == 0 and w in (4, 8) and st in (1, 2)
    for table in (family.DKDV_TILES, family.DKDV_WGMMA_TILES, family.DKDV_SOFTCAP_TILES):
        assert all(t[4] in MMAS for t in table.values())
    assert all(t[4] == "wgmma" for t in family.DKDV_WGMMA_TILES.values())


# ---------------------------------------------------------------------------------------------
# attention_varlen_backward: argument validation (fake device views)

VQ, VKV, VLSE, CU = (10, 8, 64), (14, 4, 64), (8, 10), (4,)  # 3 sequences


def _vargs(**over):
    a = dict(dout=fake_view(0, VQ), q=fake_view(0, VQ), k=fake_view(0, VKV), v=fake_view(0, VKV),
             out=fake_view(0, VQ), lse=fake_view(0, VLSE, "float32"), cu_seqlens_q=fake_view(0, CU, "int32"),
             cu_seqlens_k=fake_view(0, CU, "int32"), max_seqlen_q=6, max_seqlen_k=9)
    kw = {key: over.pop(key) for key in list(over) if key in KWARGS}
    a.update(over)
    return a, kw


def _call_varlen(a, kw):
    return backward.attention_varlen_backward(
        a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], a["cu_seqlens_q"], a["cu_seqlens_k"],
        a["max_seqlen_q"], a["max_seqlen_k"], **kw)


VBAD = {
    "q_rank": (dict(q=fake_view(0, (2, 5, 8, 64))), ValueError, ["q must have 3 dims", "(2, 5, 8, 64)"]),
    "k_paged": (dict(k=fake_view(0, (4, 16, 4, 64)), v=fake_view(0, (4, 16, 4, 64))), ValueError,
                ["k must have 3 dims", "paged", "(4, 16, 4, 64)"]),
    "v_shape": (dict(v=fake_view(0, (13, 4, 64))), ValueError, ["v must have k's shape (14, 4, 64)", "(13, 4, 64)"]),
    "k_head_dim": (dict(k=fake_view(0, (14, 4, 32)), v=fake_view(0, (14, 4, 32))), ValueError, ["k must have q's head dim 64", "32"]),
    "heads": (dict(k=fake_view(0, (14, 3, 64)), v=fake_view(0, (14, 3, 64))), ValueError, ["nheads (8)", "nheads_k (3)"]),
    "q_dtype": (dict(q=fake_view(0, VQ, "float32")), TypeError, ["q must be float16 or bfloat16", "float32"]),
    "k_dtype": (dict(k=fake_view(0, VKV, "bfloat16")), TypeError, ["k must have q's dtype float16", "bfloat16"]),
    "q_strided": (dict(q=fake_view(0, VQ, strides=(1024, 128, 2))), ValueError, ["q", "contiguous", "(1024, 128, 2)"]),
    "cu_dtype": (dict(cu_seqlens_q=fake_view(0, CU, "int64")), TypeError, ["cu_seqlens_q must be int32", "int64"]),
    "cu_rank": (dict(cu_seqlens_k=fake_view(0, (2, 2), "int32")), ValueError, ["cu_seqlens_k", "(batch + 1,)", "(2, 2)"]),
    "cu_mismatch": (dict(cu_seqlens_k=fake_view(0, (5,), "int32")), ValueError, ["cu_seqlens_k", "cu_seqlens_q's shape (4,)", "(5,)"]),
    "cu_strided": (dict(cu_seqlens_q=fake_view(0, CU, "int32", strides=(2,))), ValueError, ["cu_seqlens_q", "contiguous"]),
    "cu_device": (dict(cu_seqlens_k=fake_view(1, CU, "int32")), ValueError, ["cu_seqlens_k", "GPU 1", "GPU 0"]),
    "cu_host": (dict(cu_seqlens_q=fake_view(-1, CU, "int32")), ValueError, ["cu_seqlens_q", "host memory"]),
    "max_q_negative": (dict(max_seqlen_q=-2), ValueError, ["max_seqlen_q must be >= 0", "total_q is 10", "-2"]),
    "max_k_type": (dict(max_seqlen_k=9.0), TypeError, ["max_seqlen_k must be an int", "float"]),
    "max_k_negative": (dict(max_seqlen_k=-1), ValueError, ["max_seqlen_k", "total_k is 14", "-1"]),
    "dout_shape": (dict(dout=fake_view(0, (9, 8, 64))), ValueError, ["dout", "q's shape (10, 8, 64)", "(9, 8, 64)"]),
    "out_dtype": (dict(out=fake_view(0, VQ, "bfloat16")), TypeError, ["out", "float16", "bfloat16"]),
    "out_strided": (dict(out=fake_view(0, VQ, strides=(1024, 128, 2))), ValueError, ["out", "contiguous"]),
    "lse_dense_layout": (dict(lse=fake_view(0, (3, 8, 6), "float32")), ValueError,
                         ["lse", "(nheads, total_q) = (8, 10)", "(3, 8, 6)"]),
    "lse_transposed": (dict(lse=fake_view(0, (10, 8), "float32")), ValueError, ["lse", "(8, 10)", "(10, 8)"]),
    "lse_dtype": (dict(lse=fake_view(0, VLSE, "float16")), TypeError, ["lse must be float32", "float16"]),
    "dq_shape": (dict(dq=fake_view(0, VKV)), ValueError, ["dq", "q's shape (10, 8, 64)", "(14, 4, 64)"]),
    "dk_dtype": (dict(dk=fake_view(0, VKV, "bfloat16")), TypeError, ["dk", "k's dtype float16", "bfloat16"]),
    "dv_framework": (dict(dv=_torch_view(VKV)), TypeError, ["dv", "cupy array like v", "torch"]),
    "causal": (dict(causal="no"), TypeError, ["causal must be a bool", "str"]),
    "deterministic": (dict(deterministic=0), TypeError, ["deterministic must be a bool", "int"]),
    "scale": (dict(softmax_scale=0.0), ValueError, ["softmax_scale", "positive", "0.0"]),
    "window": (dict(window_size=(4, -3)), ValueError, ["window_size", "-1 for unbounded", "(4, -3)"]),
    "softcap": (dict(softcap=True), TypeError, ["softcap", "real number", "bool"]),
    "alibi_batch": (dict(alibi_slopes=fake_view(0, (2, 8), "float32")), ValueError,
                    ["alibi_slopes", "(8,) or (3, 8)", "(2, 8)"]),
}


@pytest.mark.parametrize("case", list(VBAD), ids=list(VBAD))
def test_varlen_bad_arguments_raise_before_launch(no_launch, case):
    over, exc, fragments = VBAD[case]
    a, kw = _vargs(**dict(over))
    with pytest.raises(exc) as info:
        _call_varlen(a, kw)
    msg = str(info.value)
    for f in fragments:
        assert f in msg, (f, msg)


@pytest.mark.parametrize("kw", [{}, dict(causal=True, deterministic=True, softmax_scale=0.3),
                                dict(dq=fake_view(0, VQ), dk=fake_view(0, VKV), dv=fake_view(0, VKV)),
                                dict(window_size=(16, 0), softcap=30.0, alibi_slopes=fake_view(0, (3, 8), "float32")),
                                dict(alibi_slopes=fake_view(0, (8,), "float32"), max_seqlen_q=0, max_seqlen_k=14)])
def test_varlen_good_arguments_reach_the_device_path(no_launch, kw):
    kw = dict(kw)
    a, _ = _vargs(**{n: kw.pop(n) for n in ("max_seqlen_q", "max_seqlen_k") if n in kw})
    with pytest.raises(AssertionError, match="validation passed"):
        _call_varlen(a, kw)


def test_varlen_signature_matches_the_torch_integration():
    """cuflash.torch calls attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=, softmax_scale=, deterministic=, dq=, dk=,
    dv=, window_size=, softcap=, alibi_slopes=)."""
    import inspect
    sig = inspect.signature(backward.attention_varlen_backward)
    names = list(sig.parameters)
    assert names[:10] == ["dout", "q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k",
                          "max_seqlen_q", "max_seqlen_k"]
    for kw in ("causal", "softmax_scale", "deterministic", "dq", "dk", "dv", "window_size", "softcap",
               "alibi_slopes"):
        assert sig.parameters[kw].kind is inspect.Parameter.KEYWORD_ONLY, kw
    dense = inspect.signature(backward.attention_backward)
    # FlashMask is dense-only, as attention_varlen has no startend_row_indices either
    assert [n for n in dense.parameters if dense.parameters[n].kind is inspect.Parameter.KEYWORD_ONLY
            and n != "startend_row_indices"] == \
        [n for n in names if sig.parameters[n].kind is inspect.Parameter.KEYWORD_ONLY]
    assert "startend_row_indices" in dense.parameters and "startend_row_indices" not in sig.parameters


def test_varlen_host_arrays_are_validated(no_launch):
    """Host arrays pass the same checks (a bad lse raises before any GPU is needed)."""
    z = np.zeros(VQ, np.float16)
    kv = np.zeros(VKV, np.float16)
    cu = np.array([0, 4, 4, 10], np.int32)
    cuk = np.array([0, 5, 9, 14], np.int32)
    with pytest.raises(ValueError, match=r"lse must have shape \(nheads, total_q\)"):
        backward.attention_varlen_backward(z, z, kv, kv, z, np.zeros((10, 8), np.float32), cu, cuk, 6, 5)


# ---------------------------------------------------------------------------------------------
# Prepared launches (what a repeated call fires): the same launches as a fresh run's

@pytest.mark.parametrize("arch,d,deterministic,causal", [(90, 128, False, True), (90, 64, True, False),
                                                         (90, 128, True, False), (90, 256, True, False),
                                                         (80, 96, False, False), (80, 128, True, True)])
def test_prepared_launches_fired_anew_match_a_fresh_run(monkeypatch, arch, d, deterministic, causal):
    """backward.run's prepared launches, fired with another call's pointers (fire), launch
    exactly what a fresh run with those pointers launches: every field, tensor maps included
    (encoded here by a stand-in that writes its arguments into the 128 bytes)."""
    import struct
    from conftest import record_launches
    launched = record_launches(monkeypatch)
    monkeypatch.setattr(backward, "tensor_map", lambda ptr, shape, strides, rows, dtype: struct.pack(
        "<Q8qq", ptr, *shape, *strides, rows).ljust(128, b"\0"))
    b, sq, sk, h, hk = 2, 300, 333, 8, 2
    plan = make_backward_plan(Problem(b, sq, sk, h, hk, d, "bf16", causal=causal, deterministic=deterministic),
                              DeviceFacts(132, arch))

    def views(base):
        q, do, o = (fake_view(0, (b, sq, h, d), "bfloat16", ptr=base + (i << 24)) for i in range(3))
        k, v = (fake_view(0, (b, sk, hk, d), "bfloat16", ptr=base + ((i + 3) << 24)) for i in range(2))
        lse = fake_view(0, (b, h, sq), "float32", ptr=base + (5 << 24))
        grads = [fake_view(0, x.shape, "bfloat16", ptr=base + ((6 + i) << 24)) for i, x in enumerate((q, k, v))]
        return (q, k, v, do, o), lse, grads, base + (9 << 24)

    first = views(1 << 40)
    prepared = backward.run(plan, *first, 0.1, ((-1, -1), 0.0, None, 0), 5, 0)
    second = views(2 << 40)
    fresh = launched[len(prepared):]
    assert not fresh
    backward.run(plan, *second, 0.1, ((-1, -1), 0.0, None, 0), 5, 0)
    fresh = launched[len(prepared):]
    backward.fire(prepared, backward._pointers(*second), 5)
    again = launched[2 * len(prepared):]
    assert [n for n, _, _ in again] == [n for n, _, _ in fresh] == [la.name for la in plan.launches[:3]]
    assert again == fresh
    (q, k, v, do, o), lse, (dq, dk, dv), ws = second  # the fields are the second call's pointers
    _, rows = backward.stats_rows(b, sq, h, pad=backward.row_pad(plan))  # (whole 80-row steps with dq_t)
    assert rows == b * h * (320 if arch == 90 and d == 128 else 384)
    prep, main, last = (f for _, _, f in fresh)
    # deterministic: no dQ accumulator (the dQ kernel writes dQ), except on sm_90 (bwd_ws at d = 64,
    # 128 and 256): the accumulator and, after it, the ordered adds' semaphores (one per 64 rows)
    # without a mask in runs of key blocks (333 keys: 3 blocks, 2 runs; d = 256: 6 blocks, 4 runs),
    # an accumulator and semaphores per run, which bwd_prep does not zero (a run's first adds store)
    ordered = deterministic and arch == 90 and d in (64, 128, 256)
    dq_kernel = deterministic and not ordered
    runs = (4 if d == 256 else 2) if ordered and not causal else 1
    assert getattr(plan.launches[1].variant, "dq_groups", 1) == plan.launches[0].variant.dq_groups == runs
    assert (prep["dout"], prep["out"], prep["lse"], prep["lse2"], prep["dsum"], prep["dq_accum"], prep["dq_sem"]) == (
        do.ptr, o.ptr, lse.ptr, ws, ws + 4 * rows, 0 if dq_kernel or runs > 1 else ws + 8 * rows,
        ws + 4 * rows * (2 + d * runs) if ordered else 0)
    assert (main["dk"], main["dv"], main["lse2"], main["dsum"]) == (dk.ptr, dv.ptr, ws, ws + 4 * rows)
    assert plan.workspace_bytes == 4 * backward.workspace_floats(plan) == 4 * rows * (
        2 + (0 if dq_kernel else d * runs)) + (4 * rows // 64 * runs if ordered else 0)
    if ordered:
        assert main["dq_sem"] == prep["dq_sem"] and main["dq_accum"] == ws + 8 * rows == last["dq_accum"]
    if "tma_q" in main:
        assert [struct.unpack_from("<Q", main[f"tma_{n}"])[0] for n in ("q", "k", "v", "do")] == [
            q.ptr, k.ptr, v.ptr, do.ptr]
    else:
        assert (main["q"], main["k"], main["v"], main["dout"]) == (q.ptr, k.ptr, v.ptr, do.ptr)
    assert last["dq"] == dq.ptr


@pytest.mark.parametrize("arch,d,deterministic,causal", [(90, 128, False, True), (90, 64, True, False),
                                                         (80, 96, False, True)])
def test_prepared_varlen_launches_take_the_new_cu_seqlens(monkeypatch, arch, d, deterministic, causal):
    """Packed sequences: the prepared launches fired with another call's pointers launch what a
    fresh run with them launches, cu_seqlens_q and cu_seqlens_k included (a repeated
    attention_varlen_backward may get other cu_seqlens arrays of the same shape)."""
    import struct
    from conftest import record_launches
    launched = record_launches(monkeypatch)
    monkeypatch.setattr(backward, "tensor_map", lambda ptr, shape, strides, rows, dtype: struct.pack(
        "<Q8qq", ptr, *shape, *strides, rows).ljust(128, b"\0"))
    b, max_sq, max_sk, h, hk, total_q, total_k = 3, 200, 260, 8, 2, 410, 500
    plan = make_backward_plan(Problem(b, max_sq, max_sk, h, hk, d, "bf16", causal=causal, deterministic=deterministic,
                                      varlen=True), DeviceFacts(132, arch))

    def views(base):
        q, do, o = (fake_view(0, (total_q, h, d), "bfloat16", ptr=base + (i << 24)) for i in range(3))
        k, v = (fake_view(0, (total_k, hk, d), "bfloat16", ptr=base + ((i + 3) << 24)) for i in range(2))
        lse = fake_view(0, (h, total_q), "float32", ptr=base + (5 << 24))
        grads = [fake_view(0, x.shape, "bfloat16", ptr=base + ((6 + i) << 24)) for i, x in enumerate((q, k, v))]
        cu = tuple(fake_view(0, (b + 1,), "int32", ptr=base + ((10 + i) << 24)) for i in range(2))
        return (q, k, v, do, o), lse, grads, base + (9 << 24), cu

    def run(vs):
        ops, lse, grads, ws, cu = vs
        return backward.run(plan, ops, lse, grads, ws, 0.1, ((-1, -1), 0.0, None, 0), 5, 0, cu)

    first, second = views(1 << 40), views(2 << 40)
    prepared = run(first)
    run(second)
    fresh = launched[len(prepared):]
    ops, lse, grads, ws, cu = second
    backward.fire(prepared, backward._pointers(ops, lse, grads, ws, (cu[0].ptr, cu[1].ptr)), 5)
    again = launched[2 * len(prepared):]
    assert again == fresh
    cu_fields = [(f.get("cu_seqlens_q"), f.get("cu_seqlens_k")) for _, _, f in again]
    assert all(x in (None, cu[0].ptr) for x, _ in cu_fields) and all(y in (None, cu[1].ptr) for _, y in cu_fields)
    assert sum(x == cu[0].ptr for x, _ in cu_fields) == len(again)  # every launch reads cu_seqlens_q


@pytest.mark.parametrize("arch,d,deterministic,causal,n", [(90, 128, False, True, 1), (90, 64, True, False, 2),
                                                           (80, 96, True, True, 2)])
def test_prepared_flashmask_launches_take_the_new_indices(monkeypatch, arch, d, deterministic, causal, n):
    """FlashMask: the prepared launches fired with another call's pointers launch what a fresh
    run with them launches: startend_row_indices read from the new array, the per-key-block
    bounds kept in the new workspace (a repeated attention_backward with FlashMask)."""
    import struct
    from conftest import record_launches
    launched = record_launches(monkeypatch)
    monkeypatch.setattr(backward, "tensor_map", lambda ptr, shape, strides, rows, dtype: struct.pack(
        "<Q8qq", ptr, *shape, *strides, rows).ljust(128, b"\0"))
    b, sq, sk, h, hk = 2, 300, 333, 8, 2
    plan = make_backward_plan(Problem(b, sq, sk, h, hk, d, "bf16", causal=causal, deterministic=deterministic,
                                      flashmask=n, flashmask_heads=hk), DeviceFacts(132, arch))

    def views(base):
        q, do, o = (fake_view(0, (b, sq, h, d), "bfloat16", ptr=base + (i << 24)) for i in range(3))
        k, v = (fake_view(0, (b, sk, hk, d), "bfloat16", ptr=base + ((i + 3) << 24)) for i in range(2))
        lse = fake_view(0, (b, h, sq), "float32", ptr=base + (5 << 24))
        grads = [fake_view(0, x.shape, "bfloat16", ptr=base + ((6 + i) << 24)) for i, x in enumerate((q, k, v))]
        fm = fake_view(0, (b, hk, sk, n), "int32", ptr=base + (10 << 24))
        return (q, k, v, do, o), lse, grads, base + (9 << 24), fm

    def run(vs):
        ops, lse, grads, ws, fm = vs
        return backward.run(plan, ops, lse, grads, ws, 0.1, ((-1, -1), 0.0, None, 0), 5, 0, None, fm)

    first, second = views(1 << 40), views(2 << 40)
    prepared = run(first)
    run(second)
    fresh = launched[len(prepared):]
    ops, lse, grads, ws, fm = second
    backward.fire(prepared, backward._pointers(ops, lse, grads, ws, None, fm.ptr), 5)
    again = launched[2 * len(prepared):]
    assert again == fresh
    preps = [f for name, _, f in again if "flashmask" in name]
    assert preps and all(f["idx"] == fm.ptr and ws <= f["out"] < ws + plan.workspace_bytes for f in preps)
    readers = [f["fm_idx"] for _, _, f in again if "fm_idx" in f]  # the dK/dV kernel (and the dQ kernel's)
    assert readers and set(readers) == {fm.ptr}
