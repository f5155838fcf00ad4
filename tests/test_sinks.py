"""Attention sinks (gpt-oss; flash-attn's / vLLM's ``s_aux``): a learnable logit per query head
that joins each row's softmax as one more column with no value.

CPU: the float64 reference against gpt-oss's formulation (the sink concatenated as a score
column) and against finite differences (dq, dk, dv and dsinks); argument checks; plans (the
kernels, tiles and splits of the call without sinks, and the reason); variants without sinks
render exactly as with no sink flag at all, and sink variants compile with NVRTC for sm_80 and
sm_90 with no spills; the PyTorch autograd plumbing, the flash-attn drop-in and the transformers
backend with the reference standing in for the kernels.

GPU (skipped without one): forward against the float64 reference with flash-attn's rule (max
error <= 2x a same-precision reference's + 1e-5) and the LSE, into NaN-poisoned outputs: causal
and not, GQA/MQA, rows that see no key, split-KV (fused merge and combine kernel), decode,
windows/softcap/ALiBi, varlen, KV caches; backward (dq, dk, dv with the backward suite's rule,
dsinks against its float64 recomputation from the kernels' outputs and against the reference);
torch autograd of q, k, v and sinks; NumPy/CuPy sinks in bfloat16.
"""
import math
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import reference
from conftest import (assert_compiled_clean, fake_view, finite_diff, record_launches, render_without_flag, requires_gpu,
                      requires_torch)

H100 = dict(num_sms=132, arch=90)
BF16 = np.dtype(ml_dtypes.bfloat16)


# ---------------------------------------------------------------------------------------------
# The reference

def gptoss_attention(q, k, v, sinks, scale, causal=False, window=(-1, -1), softcap=0.0, slopes=None):
    """(out, lse) in float64 the way gpt-oss's reference ``sdpa`` forms them: scaled (softcapped,
    biased, masked) scores with the sink concatenated as a last column, softmax, that column
    dropped. Bottom-right aligned masks as in flash-attn."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    kk, vv = np.repeat(k, h // hk, axis=2), np.repeat(v, h // hk, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    i, j = np.arange(sq)[:, None] + sk - sq, np.arange(sk)[None]
    if slopes is not None:
        s = s - slopes[None, :, None, None] * np.abs(i - j)
    vis = np.ones((sq, sk), bool)
    left, right = window[0], 0 if causal else window[1]
    if left >= 0:
        vis &= j >= i - left
    if right >= 0:
        vis &= j <= i + right
    s = np.concatenate([np.where(vis, s, -np.inf), np.broadcast_to(sinks[None, :, None, None], (b, h, sq, 1))], -1)
    m = s.max(-1, keepdims=True)
    w = np.exp(s - m)
    lse = (m + np.log(w.sum(-1, keepdims=True)))[..., 0]
    w /= w.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", w[..., :-1], vv), lse


MODS = {
    "plain": dict(),
    "causal_gqa": dict(causal=True),
    "window_softcap_alibi": dict(causal=True, window_size=(2, 0), softcap=3.0, alibi=True),
    "no_key_rows": dict(causal=True, sq=9, sk=4),  # rows 0..4 see no key: out 0, LSE = sink
}


def _problem(rng, name, dtype=np.float64):
    kw = dict(MODS[name])
    sq, sk = kw.pop("sq", 5), kw.pop("sk", 7)
    b, h, hk, d = 2, 4, 2, 6
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d)))
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = rng.random(h)
    sinks = (rng.standard_normal(h) + math.log(sk)).astype(np.float32)  # the sink takes a fair share
    return q, k, v, sinks, kw


@pytest.mark.parametrize("name", sorted(MODS))
def test_reference_is_gptoss_formulation(rng, name):
    q, k, v, sinks, kw = _problem(rng, name)
    out, lse = reference.attention(q, k, v, sinks=sinks, return_lse=True, **kw)
    want, want_lse = gptoss_attention(q, k, v, sinks.astype(np.float64), q.shape[-1] ** -0.5,
                                      causal=kw.get("causal", False), window=kw.get("window_size", (-1, -1)),
                                      softcap=kw.get("softcap", 0.0), slopes=kw.get("alibi_slopes"))
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    if name == "no_key_rows":  # query i sees keys j <= i + sk - sq: rows 0..4 see none
        assert np.all(out[:, :5] == 0) and np.array_equal(lse[:, :, :5], np.broadcast_to(
            sinks.astype(np.float64)[None, :, None], (2, 4, 5)))


@pytest.mark.parametrize("name", ["causal_gqa", "window_softcap_alibi", "no_key_rows"])
def test_reference_gradients_match_finite_differences(rng, name):
    """dq, dk, dv and dsinks = -sum over batch and rows of exp(sink - LSE) * rowsum(dout * out)."""
    q, k, v, sinks, kw = _problem(rng, name)
    sinks = sinks.astype(np.float64)
    dout = rng.standard_normal(q.shape)
    loss = lambda: float((reference.attention(q, k, v, sinks=sinks, **kw) * dout).sum())  # noqa: E731
    want = finite_diff(loss, [q, k, v, sinks])
    got = reference.attention_backward(dout, q, k, v, sinks=sinks, **kw)
    assert len(got) == 4 and got[3].shape == (4,)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
    # the closed form, from the forward's output and LSE
    out, lse = reference.attention(q, k, v, sinks=sinks, return_lse=True, **kw)
    d_row = (dout * out).sum(-1).transpose(0, 2, 1)  # (b, h, sq)
    np.testing.assert_allclose(got[3], -(np.exp(sinks[None, :, None] - lse) * d_row).sum((0, 2)), rtol=1e-12,
                               atol=1e-14)
    # without sinks the gradients are three, as before
    assert len(reference.attention_backward(dout, q, k, v, **kw)) == 3


def test_reference_varlen_and_same_precision(rng):
    """Packed sequences (an empty one, one whose rows see no key) are each attended on their own,
    dsinks summed over them; precision="same" rounds dsinks to the sinks' dtype."""
    h, hk, d = 4, 2, 8
    cu_q, cu_k = np.array([0, 5, 5, 9, 12]), np.array([0, 7, 9, 9, 14])  # seq 2: 4 queries, no key
    q = rng.standard_normal((12, h, d)).astype(np.float32)
    k, v = (rng.standard_normal((14, hk, d)).astype(np.float32) for _ in range(2))
    dout = rng.standard_normal((12, h, d)).astype(np.float32)
    sinks = rng.standard_normal(h).astype(BF16)
    out, lse = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=True, sinks=sinks, return_lse=True)
    grads = reference.attention_varlen_backward(dout, q, k, v, cu_q, cu_k, causal=True, sinks=sinks)
    dsinks = np.zeros(h)
    for b in range(4):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o, l = reference.attention(q[None, qs], k[None, ks], v[None, ks], causal=True, sinks=sinks, return_lse=True)
        np.testing.assert_array_equal(out[qs], o[0])
        np.testing.assert_array_equal(lse[:, qs], l[0])
        g = reference.attention_backward(dout[None, qs], q[None, qs], k[None, ks], v[None, ks], causal=True,
                                         sinks=sinks)
        np.testing.assert_array_equal(grads[0][qs], g[0][0])
        dsinks += g[3]
    np.testing.assert_allclose(grads[3], dsinks, rtol=1e-12)
    assert np.all(out[5:9] == 0) and np.allclose(lse[:, 5:9], sinks.astype(np.float64)[:, None])
    same = reference.attention_varlen_backward(dout, q, k, v, cu_q, cu_k, causal=True, sinks=sinks,
                                               precision="same")
    assert same[3].dtype == BF16 and same[0].dtype == np.float32
    assert reference.max_abs_err(same[3], grads[3]) < 0.02 * np.abs(grads[3]).max()


@pytest.mark.parametrize("sinks,exc,match", [
    (np.zeros(4, np.int32), TypeError, "sinks must be float32, bfloat16 or float16"),
    (np.zeros(3, np.float32), ValueError, r"sinks must have shape \(nheads,\) = \(4,\), got \(3,\)"),
    (np.array([0, 1, np.nan, 2], np.float32), ValueError, "sinks must be finite, got nan at head 2"),
])
def test_reference_rejects_bad_sinks(rng, sinks, exc, match):
    q, k, v, _, _ = _problem(rng, "plain")
    with pytest.raises(exc, match=match):
        reference.attention(q, k, v, sinks=sinks)


# ---------------------------------------------------------------------------------------------
# Argument checks: before anything is allocated or launched

@pytest.fixture
def no_launch(monkeypatch):
    from cuflash import api, arrays

    def boom(*a, **k):
        raise AssertionError("validation passed: the device path was reached")
    monkeypatch.setattr(api, "_attention_device", boom)
    monkeypatch.setattr(arrays, "to_device", boom)
    monkeypatch.setattr(api.launch, "fire", boom)


QH = (2, 4, 8, 64)  # q (batch, seqlen, nheads 8, d); k, v with 2 KV heads
KVH = (2, 6, 2, 64)


@pytest.mark.parametrize("sinks,exc,match", [
    (np.zeros(8, np.float64), TypeError, "sinks must be float32, bfloat16 or float16 .*got float64"),
    (np.zeros(8, np.int32), TypeError, "sinks must be float32, bfloat16 or float16 .*got int32"),
    (np.zeros(2, np.float32), ValueError, r"sinks must have shape \(nheads,\) = \(8,\), got \(2,\)"),
    (np.zeros((1, 8), np.float32), ValueError, r"sinks must have shape \(nheads,\) = \(8,\), got \(1, 8\)"),
    (np.zeros(16, np.float32)[::2], ValueError, r"sinks must be contiguous, got strides \(2,\)"),
    (np.array([0, 0, 0, np.inf, 0, 0, 0, 0], np.float32), ValueError, "sinks must be finite, got inf at head 3"),
    (np.array([0, np.nan, 0, 0, 0, 0, 0, 0], BF16), ValueError, "sinks must be finite, got nan at head 1"),
    ([0.0] * 8, TypeError, "sinks must be an array"),
])
def test_attention_rejects_bad_sinks(no_launch, sinks, exc, match):
    q, k = np.zeros(QH, np.float16), np.zeros(KVH, np.float16)
    with pytest.raises(exc, match=match):
        cuflash.attention(q, k, k, sinks=sinks)
    with pytest.raises(exc, match=match):
        cuflash.plan(q, k, k, sinks=sinks, **H100)
    with pytest.raises(exc, match=match):
        from cuflash.backward import attention_backward
        attention_backward(q, q, k, k, q, np.zeros((2, 8, 4), np.float32), sinks=sinks)


def test_sinks_must_be_on_qs_device(fake_views, no_launch):
    q, k = fake_view(0, QH), fake_view(0, KVH)
    with pytest.raises(ValueError, match="sinks is on GPU 1 but q is on GPU 0"):
        cuflash.attention(q, k, k, sinks=fake_view(1, (8,), "float32"))
    with pytest.raises(ValueError, match="sinks is in host memory but q is in GPU 0"):
        cuflash.attention(q, k, k, sinks=np.zeros(8, np.float32))
    cache = fake_view(0, (2, 64, 2, 64))
    with pytest.raises(ValueError, match=r"sinks must have shape \(nheads,\) = \(8,\), got \(4,\)"):
        cuflash.attention_with_kvcache(fake_view(0, (2, 1, 8, 64)), cache, cache, sinks=fake_view(0, (4,), "float32"))
    cu = fake_view(0, (3,), "int32")
    with pytest.raises(TypeError, match="sinks must be float32, bfloat16 or float16"):
        cuflash.attention_varlen(fake_view(0, (8, 8, 64)), fake_view(0, (12, 2, 64)), fake_view(0, (12, 2, 64)),
                                 cu, cu, 4, 6, sinks=fake_view(0, (8,), "int32"))


def test_flashmask_cannot_take_sinks(no_launch):
    from cuflash import masks
    q = np.zeros((1, 16, 4, 32), np.float16)
    idx = masks.causal(16)
    with pytest.raises(ValueError, match="startend_row_indices cannot be combined with sinks"):
        cuflash.attention(q, q, q, causal=True, startend_row_indices=idx, sinks=np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="startend_row_indices cannot be combined with sinks"):
        cuflash.plan(q, q, q, causal=True, startend_row_indices=idx, sinks=True, **H100)
    from cuflash.plan import DeviceFacts, Problem, make_plan
    with pytest.raises(ValueError, match="FlashMask.*cannot be combined with sinks"):
        make_plan(Problem(1, 16, 16, 4, 4, 32, "bf16", True, flashmask=1, flashmask_heads=1, sinks=True),
                  DeviceFacts(132, 90))


# ---------------------------------------------------------------------------------------------
# Plans

def test_plan_runs_sinks_on_fwd_ws():
    q, k = (2, 1024, 16, 128), (2, 1024, 4, 128)
    ws = cuflash.plan(q, k, k, causal=True, **H100)
    p = cuflash.plan(q, k, k, causal=True, sinks=True, **H100)
    assert ws.kernels[0].startswith("fwd_ws_") and "_sinks" not in ws.kernels[0]
    assert p.kernels == (ws.kernels[0].replace("_causal_", "_causal_sinks_"),)
    assert replace(ws.launches[0].variant, sinks=True) == p.launches[0].variant
    assert "the warp-specialised kernel (fwd_ws" in p.reason
    assert "sink logit joins the softmax" in p.reason and "sinks" in str(p).splitlines()[0]
    from cuflash.plan import DeviceFacts, Problem, _fwd_ws_blocker
    assert _fwd_ws_blocker(Problem(2, 1024, 1024, 16, 4, 128, "bf16", True, sinks=True), True, 128, False) == ""
    # with the wgmma kernel asked for directly, the same tile with and without sinks
    from cuflash.plan import make_plan
    no_ws = make_plan(Problem(2, 1024, 1024, 16, 4, 128, "bf16", True, tma=False), DeviceFacts(132, 90))
    sink = make_plan(Problem(2, 1024, 1024, 16, 4, 128, "bf16", True, tma=False, sinks=True), DeviceFacts(132, 90))
    assert sink.kernels == ("fwd_d128_bf16_causal_sinks_wgmma_m128n128w8s2_sm90",)
    assert replace(no_ws.launches[0].variant, sinks=True) == sink.launches[0].variant


@pytest.mark.parametrize("kw", [
    dict(q=(1, 1, 64, 64), k=(1, 4096, 8, 64)),                                  # gpt-oss decode: split
    dict(q=(1, 1, 64, 64), k=(1, 4096, 8, 64), window=(127, 0), causal=True),    # sliding window decode
    dict(q=(2, 300, 8, 128), k=(2, 300, 2, 128), causal=True, arch=80),           # sm_80 prefill
    dict(q=(2, 300, 8, 96), k=(2, 300, 2, 96), softcap=True, alibi=True),        # mma.sync on sm_90
    dict(q=(4, 64, 8, 128), k=(4, 800, 2, 128), num_splits=5),                   # FA2's split tile
    dict(q=(3, 1, 28, 128), k=(3, 2048, 4, 128), kv="paged", causal=True),       # paged decode
    dict(q=(3, 200, 8, 64), k=(3, 300, 8, 64), kv="cache", causal=True),
    dict(q=(5, 100, 8, 64), k=(5, 120, 2, 64), varlen=True, causal=True),
    dict(q=(2, 7, 4, 64), k=(2, 0, 4, 64)),                                        # no key
])
def test_sinks_keep_the_plan(kw):
    """Sinks change the variant (the flag and its name) and the reason, never the tiles, grids,
    splits or workspace; split plans carry the sink in split 0."""
    from cuflash.plan import DeviceFacts, Problem, make_plan
    kw = dict(kw)
    (b, sq, h, d), (_, sk, hk, _) = kw.pop("q"), kw.pop("k")
    arch = kw.pop("arch", 90)
    p0 = Problem(b, sq, sk, h, hk, d, "bf16", tma=False, **kw)  # tma=False: the wgmma kernel on sm_90
    plain, sink = make_plan(p0, DeviceFacts(132, arch)), make_plan(replace(p0, sinks=True), DeviceFacts(132, arch))
    assert [replace(l.variant, sinks=True) if l.variant.family == "fwd" else l.variant for l in plain.launches] \
        == [l.variant for l in sink.launches]
    assert [(l.grid, l.threads, l.smem) for l in plain.launches] == [(l.grid, l.threads, l.smem) for l in sink.launches]
    assert (plain.num_splits, plain.workspace_bytes) == (sink.num_splits, sink.workspace_bytes)
    assert "_sinks_" in sink.kernels[0] and "sink logit joins the softmax" in sink.reason
    assert ("split 0 carries it" in sink.reason) == (sink.num_splits > 1)
    if sk == 0:
        assert "LSE the sink" in sink.reason


def test_backward_plan_says_how_dsinks_is_made():
    q, k = (2, 256, 8, 64), (2, 256, 2, 64)
    p = cuflash.plan(q, k, k, causal=True, backward=True, sinks=True, **H100)
    assert p.kernels == cuflash.plan(q, k, k, causal=True, backward=True, **H100).kernels
    assert "dsinks = -sum over batch and rows of exp(sink - LSE) * D" in p.reason


# ---------------------------------------------------------------------------------------------
# Code generation: variants without sinks are what they were; sink variants compile cleanly

def _fwd_sample():
    from cuflash.kernels import covering_sample
    return [v for v in covering_sample() if v.family == "fwd" and not v.sinks][::4]


@pytest.mark.parametrize("v", _fwd_sample(), ids=lambda v: v.name)
def test_variant_without_sinks_renders_as_with_no_sink_flag(v):
    """A template given no ``sinks`` at all (Jinja's default, lenient undefined) renders the same
    source as ``sinks=False``: the flag adds nothing to variants without sinks, so their cubins
    are the ones compiled before sinks existed."""
    from cuflash import codegen
    from cuflash.kernels import fwd
    assert not set(fwd.SINK_FIELDS) & set(v.params.fields)
    src = render_without_flag(v, "sinks")
    assert "sink" not in src
    if not v.flashmask and not v.dropout:  # the twin with sinks: its own name (and cache file), the sink's code
        twin = replace(v, sinks=True)
        assert "_sinks_" in twin.name and twin.name.replace("_sinks", "", 1) == v.name
        t = codegen.render(twin)
        assert "sink_logit(sinks, sinks_dtype, h * sinks_sh + row * sinks_sr)" in t and "int sinks_sr;" in t


def test_flashmask_variant_cannot_have_sinks():
    from cuflash.kernels.fwd import FwdVariant
    with pytest.raises(ValueError, match="no sinks"):
        FwdVariant(kind="fwd", head_dim=64, dtype="bf16", causal=True, block_m=128, block_n=128, warps=8, stages=2,
                   arch=90, mma="wgmma", flashmask=1, sinks=True)


def _gptoss_variants():
    """Kernels gpt-oss's attention runs (64 query heads, 8 KV heads, d = 64): causal prefill on
    sm_90, the 128-token sliding window on sm_80 and split-KV decode on both."""
    from cuflash.plan import DeviceFacts, Problem, make_plan
    out = []
    for arch, sq, sk, window in ((90, 2048, 2048, (-1, -1)), (80, 2048, 2048, (127, 0)), (90, 1, 4096, (-1, -1)),
                                 (80, 1, 4096, (-1, -1))):
        p = Problem(1, sq, sk, 64, 8, 64, "bf16", True, window=window, sinks=True)
        out.append(make_plan(p, DeviceFacts(132, arch)).launches[0].variant)
    return out


@pytest.mark.parametrize("v", _gptoss_variants(), ids=lambda v: v.name)
def test_sink_variant_compiles_without_spills(compiled, v):
    assert v.sinks
    assert_compiled_clean(compiled[v], v)


@pytest.mark.parametrize("sq,hk,num_splits,fields", [
    (1, 2, 3, (4, 1)),   # one query, 8 heads on 2 KV heads: row i of KV head h is query head h * 4 + i
    (5, 2, 1, (1, 0)),   # rows are queries: the sink of head h
    (5, 8, 4, (1, 0)),
])
def test_launch_passes_the_sinks(monkeypatch, sq, hk, num_splits, fields):
    """The sink fields of the forward's parameter struct, as launch.prepare and fire pack them
    (kernels recorded instead of run)."""
    from cuflash import launch
    from cuflash.plan import DeviceFacts, Problem, make_plan
    launched = record_launches(monkeypatch)
    plan = make_plan(Problem(2, sq, 300, 8, hk, 64, "bf16", num_splits=num_splits, sinks=True, tma=False),
                     DeviceFacts(132, 90))
    q, k = fake_view(0, (2, sq, 8, 64), "bfloat16"), fake_view(0, (2, 300, hk, 64), "bfloat16", ptr=2 << 20)
    r = launch.prepare(plan, q, k, k, q, 0.125, 0, sinks=(7 << 20, "bfloat16"))
    launch.fire(r, 0, 9, q.ptr, k.ptr, k.ptr, q.ptr, 0, (3 << 20, 4 << 20) if r.split else None, fused=False)
    name, _, f = launched[0]
    assert "_sinks_" in name and plan.pack_gqa == (fields[0] > 1)
    assert (f["sinks"], f["sinks_dtype"], f["sinks_sh"], f["sinks_sr"]) == (7 << 20, 2, *fields)
    assert [n.startswith("combine") for n, _, _ in launched[1:]] == [True] * (num_splits > 1)
    with pytest.raises(ValueError, match="needs the sinks"):
        launch.prepare(plan, q, k, k, q, 0.125, 0)


# ---------------------------------------------------------------------------------------------
# PyTorch plumbing on the CPU, the float64 reference standing in for the kernels

def _np(x):
    """A CPU tensor as NumPy (bfloat16 as ml_dtypes.bfloat16), or None."""
    import torch
    if x is None:
        return None
    return x.detach().float().numpy().astype(BF16) if x.dtype == torch.bfloat16 else x.detach().numpy()


@pytest.fixture
def sink_ref_kernels(monkeypatch):
    """cuflash.attention, attention_varlen and the backward replaced by cuflash.reference on CPU
    tensors (sinks included); calls are recorded with their keyword arguments."""
    import cuflash.backward  # noqa: F401  the real module first: undoing the patch restores it
    import sys
    import types
    import torch
    calls = []
    T = lambda a, like: torch.from_numpy(np.ascontiguousarray(a)).to(like.dtype)  # noqa: E731

    def attention(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, out=None, num_splits=0,
                  sinks=None, **feat):
        calls.append(("attention", dict(feat, sinks=sinks)))
        o, lse = reference.attention(_np(q), _np(k), _np(v), causal=causal, softmax_scale=softmax_scale,
                                     sinks=_np(sinks), return_lse=True, **feat)
        o = T(o, q) if out is None else out.copy_(T(o, q))
        return (o, torch.from_numpy(lse).float()) if return_lse else o

    def attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, causal=False, softmax_scale=None, return_lse=False,
                         out=None, num_splits=0, sinks=None, **feat):
        calls.append(("varlen", dict(feat, sinks=sinks)))
        o, lse = reference.attention_varlen(_np(q), _np(k), _np(v), _np(cu_q), _np(cu_k), causal=causal,
                                            softmax_scale=softmax_scale, sinks=_np(sinks), return_lse=True, **feat)
        o = T(o, q) if out is None else out.copy_(T(o, q))
        return (o, torch.from_numpy(lse).float()) if return_lse else o

    def _grads(res, bufs, sinks):
        out = tuple(b.copy_(T(g, b)) for b, g in zip(bufs, res))
        return out if sinks is None else (*out, torch.from_numpy(res[3]).float())

    def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, deterministic=False,
                           dq=None, dk=None, dv=None, sinks=None, **feat):
        calls.append(("backward", dict(feat, sinks=sinks)))
        res = reference.attention_backward(_np(dout), _np(q), _np(k), _np(v), causal=causal,
                                           softmax_scale=softmax_scale, sinks=_np(sinks), **feat)
        return _grads(res, (dq, dk, dv), sinks)

    def attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, causal=False,
                                  softmax_scale=None, deterministic=False, dq=None, dk=None, dv=None, sinks=None,
                                  **feat):
        calls.append(("varlen_backward", dict(feat, sinks=sinks)))
        res = reference.attention_varlen_backward(_np(dout), _np(q), _np(k), _np(v), _np(cu_q), _np(cu_k),
                                                  causal=causal, softmax_scale=softmax_scale, sinks=_np(sinks), **feat)
        return _grads(res, (dq, dk, dv), sinks)

    bwd = types.ModuleType("cuflash.backward")
    bwd.attention_backward = attention_backward
    bwd.attention_varlen_backward = attention_varlen_backward
    monkeypatch.setattr(cuflash, "attention", attention)
    monkeypatch.setattr(cuflash, "attention_varlen", attention_varlen)
    monkeypatch.setattr(cuflash, "backward", bwd)
    monkeypatch.setitem(sys.modules, "cuflash.backward", bwd)
    return calls


def _torch_gptoss(q, k, v, sinks, causal, scale=None):
    """gpt-oss's formulation in torch float64 (autograd through it gives the expected gradients)."""
    import torch
    b, sq, h, d = q.shape
    sk, g = k.shape[1], h // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(g, 2)) * (scale or d ** -0.5)
    if causal:
        i, j = torch.arange(sq)[:, None] + sk - sq, torch.arange(sk)[None]
        s = s.masked_fill(j > i, float("-inf"))
    s = torch.cat([s, sinks.double()[None, :, None, None].expand(b, h, sq, 1)], -1)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1)[..., :-1], v.repeat_interleave(g, 2))


@requires_torch
@pytest.mark.parametrize("sinks_dtype", ["float32", "bfloat16"])
def test_torch_autograd_plumbing(sink_ref_kernels, sinks_dtype):
    """cuflash.torch.attention: the sinks reach the forward and the backward, and sinks.grad (in
    the sinks' dtype) is d loss / d sinks, as autograd through gpt-oss's formulation gives it."""
    import torch
    import cuflash.torch as ct
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 9, 2, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sinks = (torch.randn(4, generator=g) + 2).to(getattr(torch, sinks_dtype)).requires_grad_()
    dout = torch.randn(2, 6, 4, 8, generator=g, dtype=torch.float64)
    out = ct.attention(q, k, v, causal=True, sinks=sinks)
    out.backward(dout)
    want = torch.autograd.grad(_torch_gptoss(q, k, v, sinks, True), (q, k, v, sinks), dout)
    torch.testing.assert_close(out, _torch_gptoss(q, k, v, sinks, True))
    for got, w in zip((q.grad, k.grad, v.grad), want):
        torch.testing.assert_close(got, w)
    assert sinks.grad.dtype == sinks.dtype
    torch.testing.assert_close(sinks.grad, want[3].to(sinks.dtype))
    assert [c[0] for c in sink_ref_kernels] == ["attention", "backward"]
    assert all(torch.equal(c[1]["sinks"], sinks) for c in sink_ref_kernels)
    # only the sinks need a gradient: autograd still runs the backward
    sinks.grad = None
    ct.attention(q.detach(), k.detach(), v.detach(), causal=True, sinks=sinks).backward(dout)
    torch.testing.assert_close(sinks.grad, want[3].to(sinks.dtype))


@requires_torch
def test_torch_varlen_autograd_and_opcheck(sink_ref_kernels):
    import torch
    import cuflash.torch as ct
    g = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    q, k, v = (torch.randn(12, 4, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sinks = torch.randn(4, generator=g, requires_grad=True)
    out = ct.attention_varlen(q, k, v, cu, cu, 7, 7, causal=True, sinks=sinks)
    out.square().sum().backward()
    want = torch.zeros(4, dtype=torch.float64)
    for s in (slice(0, 5), slice(5, 12)):
        x = [t.detach()[None, s].requires_grad_() for t in (q, k, v)]
        sk = sinks.detach().double().requires_grad_()
        want += torch.autograd.grad(_torch_gptoss(*x, sk, True).square().sum(), sk)[0]
    torch.testing.assert_close(sinks.grad, want.float())
    assert [c[0] for c in sink_ref_kernels] == ["varlen", "varlen_backward"]
    # the custom op's schema, fake and autograd registrations with sinks given
    qd, kd, vd = (torch.randn(2, 5, 4, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    args = (qd, kd, vd, True, None, -1, -1, 0.0, None, False, torch.randn(4, generator=g, requires_grad=True))
    torch.library.opcheck(torch.ops.cuflash.attention_fwd.default, args)


@requires_torch
def test_transformers_backend_and_drop_in_pass_s_aux(sink_ref_kernels):
    """transformers' gpt-oss passes its sinks as s_aux to the attention function; vLLM passes them
    as s_aux to flash_attn_varlen_func: both run as sinks."""
    import torch
    from cuflash.flash_attn import flash_attn_varlen_func
    from cuflash.torch.hf import hf_attention_forward
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 4, 6, 8, generator=g, dtype=torch.float64) for _ in range(3))  # (b, h, s, d)
    sinks = torch.randn(4, generator=g)
    out, _ = hf_attention_forward(None, q, k, v, None, scaling=0.3, is_causal=True, s_aux=sinks)
    want = _torch_gptoss(*(x.transpose(1, 2) for x in (q, k, v)), sinks, True, scale=0.3)
    torch.testing.assert_close(out, want)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    out, lse = flash_attn_varlen_func(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, 6, 6,
                                      softmax_scale=0.3, causal=True, s_aux=sinks, return_softmax_lse=True)
    torch.testing.assert_close(out, want[0])
    assert lse.shape == (4, 6) and torch.equal(sink_ref_kernels[-1][1]["sinks"], sinks)


# ---------------------------------------------------------------------------------------------
# GPU: the kernels against the float64 reference

DEVICE = "cuda"  # where the GPU tests make their tensors

def _t(rng, *shape, dtype="bfloat16"):
    import torch
    return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to(DEVICE, getattr(torch, dtype))


def _sinks(rng, h, sk, dtype="float32"):
    """Sinks near log(seqlen_k), so that they take a fair share of each row's softmax (a sink
    the kernels dropped would show far beyond the tolerances)."""
    import torch
    s = rng.standard_normal(h).astype(np.float32) + math.log(max(sk, 2))
    return torch.from_numpy(s).to(DEVICE, getattr(torch, dtype))


def to_np(x):
    import sys
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        a = x.detach().float().cpu().numpy()
        return a.astype({torch.bfloat16: BF16, torch.float16: np.float16}.get(x.dtype, np.float32))
    if isinstance(x, np.ndarray):
        return x
    import cupy
    return cupy.asnumpy(x) if isinstance(x, cupy.ndarray) else np.asarray(x)


def _within(got, ref64, same, atol, what):
    """flash-attn's rule: max|got - ref64| <= 2 * max|same - ref64| + atol."""
    err, bound = reference.max_abs_err(got, ref64), 2 * reference.max_abs_err(same, ref64) + atol
    assert err <= bound, f"{what}: max error {err:.3g} exceeds bound {bound:.3g}"


def check_forward(out, lse, q, k, v, sinks, varlen=None, **kw):
    """out against the float64 reference (flash-attn's rule) and lse against its LSE (the sink
    included). ``varlen``: (cu_seqlens_q, cu_seqlens_k) for packed sequences."""
    args = [to_np(x) for x in (q, k, v)] + ([to_np(c) for c in varlen] if varlen else [])
    fn = reference.attention_varlen if varlen else reference.attention
    kw = dict(kw, sinks=to_np(sinks))
    ref, lse_ref = fn(*args, return_lse=True, **kw)
    same = fn(*args, precision="same", **kw)
    _within(to_np(out), ref, same, 1e-5, f"out ({kw})")
    got = to_np(lse)
    assert got.shape == lse_ref.shape and np.isfinite(got).all()
    np.testing.assert_allclose(got, lse_ref, rtol=1e-3, atol=2e-3)


def _poisoned(x):
    import torch
    return torch.full_like(x, float("nan"))


def _mods_np(kw):
    return {n: (to_np(x) if n == "alibi_slopes" else x) for n, x in kw.items()}


@requires_gpu
@requires_torch
@pytest.mark.parametrize("sq,sk,h,hk,d,causal,dtype,sinks_dtype", [
    (113, 203, 4, 4, 64, False, "bfloat16", "float32"),
    (128, 217, 8, 2, 128, True, "float16", "bfloat16"),
    (239, 113, 4, 2, 128, True, "bfloat16", "float32"),     # rows 0..125 see no key
    (113, 203, 4, 4, 96, True, "bfloat16", "float16"),      # mma.sync on sm_90
    (1024, 1024, 8, 1, 64, True, "bfloat16", "bfloat16"),   # MQA (fwd_ws on sm_90)
    (113, 203, 2, 2, 59, False, "float16", "float32"),      # head dim through a padded copy
    (3, 799, 8, 2, 40, True, "bfloat16", "float32"),        # column predicates
])
def test_gpu_forward(rng, sq, sk, h, hk, d, causal, dtype, sinks_dtype):
    q, k, v = _t(rng, 2, sq, h, d, dtype=dtype), _t(rng, 2, sk, hk, d, dtype=dtype), _t(rng, 2, sk, hk, d, dtype=dtype)
    sinks = _sinks(rng, h, sk, sinks_dtype)
    out = _poisoned(q)
    res, lse = cuflash.attention(q, k, v, causal=causal, sinks=sinks, out=out, return_lse=True)
    assert res is out
    check_forward(out, lse, q, k, v, sinks, causal=causal)
    if causal and sq > sk:  # rows that see no key: out 0, LSE = the sink
        empty = sq - sk
        assert bool((out[:, :empty] == 0).all())
        np.testing.assert_allclose(to_np(lse)[:, :, :empty], np.broadcast_to(
            to_np(sinks).astype(np.float32)[None, :, None], (2, h, empty)), rtol=1e-5, atol=1e-6)


@requires_gpu
@requires_torch
@pytest.mark.parametrize("sq,sk,num_splits,causal,fused", [
    (64, 800, 2, False, True), (64, 800, 7, True, True), (64, 800, 7, True, False),
    (1, 339, 3, True, True), (1, 339, 3, False, False), (1, 339, 128, False, True),  # decode tile, GQA packed
    (3, 799, 5, True, True),
])
def test_gpu_splits(rng, monkeypatch, sq, sk, num_splits, causal, fused):
    """Split-KV: split 0 carries the sink, merged by the split kernel (fused) or by the combine
    kernel; with 128 splits most get no key and write the neutral element."""
    from cuflash import launch
    monkeypatch.setattr(launch, "FUSED_COMBINE", fused)
    q, k, v = _t(rng, 2, sq, 8, 128, dtype="float16"), _t(rng, 2, sk, 2, 128, dtype="float16"), \
        _t(rng, 2, sk, 2, 128, dtype="float16")
    sinks = _sinks(rng, 8, sk)
    out = _poisoned(q)
    _, lse = cuflash.attention(q, k, v, causal=causal, sinks=sinks, num_splits=num_splits, out=out, return_lse=True)
    check_forward(out, lse, q, k, v, sinks, causal=causal)


@requires_gpu
@requires_torch
@pytest.mark.parametrize("b,sk,h,hk,d", [(1, 4096, 64, 8, 64), (4, 552, 28, 4, 128), (2, 100, 8, 8, 64)])
def test_gpu_decode(rng, b, sk, h, hk, d):
    """One query per sequence (gpt-oss: 64 query heads on 8 KV heads, d = 64), as planned: a KV
    head's query heads run as rows of the decode tile, each with its own sink."""
    q, k, v = _t(rng, b, 1, h, d), _t(rng, b, sk, hk, d), _t(rng, b, sk, hk, d)
    sinks = _sinks(rng, h, sk, "bfloat16")
    p = cuflash.plan(q, k, v, causal=True, sinks=sinks)
    assert p.pack_gqa == (h > hk) and "_sinks" in p.kernels[0]
    out = _poisoned(q)
    _, lse = cuflash.attention(q, k, v, causal=True, sinks=sinks, out=out, return_lse=True)
    check_forward(out, lse, q, k, v, sinks, causal=True)


@requires_gpu
@requires_torch
@pytest.mark.parametrize("mods", [
    dict(window_size=(127, 0), causal=True),   # gpt-oss's sliding window
    dict(softcap=30.0),
    dict(alibi=True, causal=True),
    dict(window_size=(64, 16), softcap=20.0, num_splits=3),
])
def test_gpu_window_softcap_alibi(rng, mods):
    """The sink is compared with the scaled, softcapped, ALiBi-biased and masked scores."""
    import torch
    mods = dict(mods)
    split = {"num_splits": mods.pop("num_splits")} if "num_splits" in mods else {}
    if mods.pop("alibi", False):
        mods["alibi_slopes"] = torch.rand(8, device=DEVICE) * 0.1
    q, k, v = _t(rng, 2, 300, 8, 64), _t(rng, 2, 350, 2, 64), _t(rng, 2, 350, 2, 64)
    sinks = _sinks(rng, 8, 128)
    out = _poisoned(q)
    _, lse = cuflash.attention(q, k, v, sinks=sinks, out=out, return_lse=True, **mods, **split)
    check_forward(out, lse, q, k, v, sinks, **_mods_np(mods))


def _varlen_lengths(rng, batch, max_q, max_k, empty_keys=True):
    """cu_seqlens (int32 CUDA) of random lengths: an empty sequence, one query-only sequence (its
    rows see no key) and random others."""
    import torch
    lq = rng.integers(1, max_q + 1, batch)
    lk = rng.integers(1, max_k + 1, batch)
    lq[0], lk[0] = 0, 0
    if empty_keys:
        lk[1] = 0
    cu = lambda n: torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32, device=DEVICE)  # noqa: E731
    return cu(lq), cu(lk), int(lq.max()), int(lk.max())


@requires_gpu
@requires_torch
@pytest.mark.parametrize("paged,max_q,causal", [(False, 97, True), (False, 1, False), (True, 64, True),
                                                (True, 1, True)])
def test_gpu_varlen(rng, paged, max_q, causal):
    import torch
    h, hk, d, batch = 8, 2, 128, 5
    cu_q, cu_k, mq, mk = _varlen_lengths(rng, batch, max_q, 300)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    q, k, v = _t(rng, total_q, h, d), _t(rng, total_k, hk, d), _t(rng, total_k, hk, d)
    sinks = _sinks(rng, h, 150)
    out = _poisoned(q)
    if not paged:
        _, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, mq, mk, causal=causal, sinks=sinks, out=out,
                                          return_lse=True)
    else:  # the same keys in pages of 16 rows, pages in a shuffled order
        page, per_seq = 16, -(-mk // 16)
        order = torch.from_numpy(rng.permutation(batch * per_seq).astype(np.int32)).to(DEVICE)
        table = order.view(batch, per_seq)
        k_pages = torch.zeros(batch * per_seq, page, hk, d, device=DEVICE, dtype=q.dtype)
        v_pages = torch.zeros_like(k_pages)
        for b in range(batch):
            n = int(cu_k[b + 1] - cu_k[b])
            for j in range(0, n, page):
                m = min(page, n - j)
                k_pages[table[b, j // page], :m] = k[int(cu_k[b]) + j:int(cu_k[b]) + j + m]
                v_pages[table[b, j // page], :m] = v[int(cu_k[b]) + j:int(cu_k[b]) + j + m]
        _, lse = cuflash.attention_varlen(q, k_pages, v_pages, cu_q, cu_k, mq, mk, causal=causal, sinks=sinks,
                                          block_table=table, out=out, return_lse=True)
    check_forward(out, lse, q, k, v, sinks, varlen=(cu_q, cu_k), causal=causal)


@requires_gpu
@requires_torch
@pytest.mark.parametrize("paged", [False, True])
def test_gpu_kvcache(rng, paged):
    """Decode into a KV cache (one new token appended per sequence, per-sequence lengths), GQA."""
    import torch
    b, h, hk, d, cap = 3, 16, 2, 64, 512
    lens = torch.tensor([0, 200, 470], dtype=torch.int32, device=DEVICE)
    q, k_new, v_new = _t(rng, b, 1, h, d), _t(rng, b, 1, hk, d), _t(rng, b, 1, hk, d)
    k_cache, v_cache = _t(rng, b, cap, hk, d), _t(rng, b, cap, hk, d)
    sinks = _sinks(rng, h, 256, "bfloat16")
    out = _poisoned(q)
    kw = dict(cache_seqlens=lens, causal=True, sinks=sinks, out=out, return_lse=True)
    if paged:
        page = 64
        table = torch.arange(b * cap // page, dtype=torch.int32, device=DEVICE).flip(0).view(b, cap // page)
        kp = torch.empty(b * cap // page, page, hk, d, device=DEVICE, dtype=q.dtype)
        vp = torch.empty_like(kp)
        kp[table.flatten().long()] = k_cache.reshape(-1, page, hk, d)
        vp[table.flatten().long()] = v_cache.reshape(-1, page, hk, d)
        _, lse = cuflash.attention_with_kvcache(q, kp, vp, k_new, v_new, block_table=table, **kw)
        k_cache = kp[table.flatten().long()].reshape(b, cap, hk, d)
        v_cache = vp[table.flatten().long()].reshape(b, cap, hk, d)
    else:
        _, lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, **kw)
    for i in range(b):  # each sequence against its cache_seqlens + 1 keys (the new one appended)
        n = int(lens[i]) + 1
        sl = slice(i, i + 1)
        check_forward(out[sl], lse[sl], q[sl], k_cache[sl, :n], v_cache[sl, :n], sinks, causal=True)


def _check_dsinks(dsinks, dout, out, lse, sinks, ref64, same, what, rtol=1e-4):
    """dsinks against its float64 recomputation from the kernels' own out and LSE
    (-sum exp(sink - LSE) * rowsum(dout * out); tight: only fp32 sums differ, and the rounding to
    the sinks' dtype, which ``rtol`` covers), and against the
    reference with the gradients' rule plus 2% of its largest value (a sum over every row of
    rounding errors of the output: the kernels' and the same-precision reference's are
    independent, so their ratio has no bound)."""
    import torch
    got = dsinks.detach().double().cpu()
    o, do, l, s = (x.detach().double() for x in (out, dout, lse, sinks))
    d_row = (do * o).sum(-1)
    if o.dim() == 4:  # (b, sq, h) against lse (b, h, sq)
        terms = torch.exp(s[None, :, None] - l) * d_row.transpose(1, 2)
        terms = terms.transpose(0, 1).reshape(len(s), -1)
    else:  # packed: (total_q, h) against lse (h, total_q)
        terms = torch.exp(s[:, None] - l) * d_row.t()
    expect = -terms.sum(1).cpu()
    assert torch.allclose(got, expect, rtol=rtol, atol=rtol * float(terms.abs().sum(1).max()) + 1e-6), \
        f"{what}: dsinks {got} against {expect}"
    err, bound = reference.max_abs_err(got.numpy(), ref64), \
        3 * reference.max_abs_err(same, ref64) + 2e-4 + 0.02 * np.abs(ref64).max()
    assert err <= bound, f"{what}: dsinks max error {err:.3g} exceeds bound {bound:.3g}"


def _check_grads(grads, ref64, same, what):
    """The backward suite's rule (tests/test_gpu_backward.py): 3x the same-precision error + 1e-4."""
    for name, g, r, s in zip(("dq", "dk", "dv"), grads, ref64, same):
        err, bound = reference.max_abs_err(to_np(g), r), 3 * reference.max_abs_err(s, r) + 1e-4
        assert err <= bound, f"{name}: max error {err:.3g} exceeds bound {bound:.3g} ({what})"


@requires_gpu
@requires_torch
@pytest.mark.parametrize("sq,sk,h,hk,d,causal,deterministic,dtype", [
    (113, 203, 4, 2, 64, True, False, "float16"),
    (239, 113, 4, 4, 128, True, True, "bfloat16"),   # rows without keys
    (256, 256, 8, 2, 128, False, False, "bfloat16"),
    (128, 300, 8, 8, 96, False, True, "float16"),
])
def test_gpu_backward(rng, sq, sk, h, hk, d, causal, deterministic, dtype):
    import torch
    from cuflash.backward import attention_backward
    q, k, v = _t(rng, 2, sq, h, d, dtype=dtype), _t(rng, 2, sk, hk, d, dtype=dtype), _t(rng, 2, sk, hk, d, dtype=dtype)
    dout = _t(rng, 2, sq, h, d, dtype=dtype)
    sinks = _sinks(rng, h, sk)
    out, lse = cuflash.attention(q, k, v, causal=causal, sinks=sinks, return_lse=True)
    bufs = dict(dq=_poisoned(q), dk=_poisoned(k), dv=_poisoned(v))
    res = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic, sinks=sinks, **bufs)
    assert len(res) == 4 and all(r is bufs[n] for r, n in zip(res, ("dq", "dk", "dv")))
    assert res[3].dtype == torch.float32 and res[3].shape == (h,)
    args = [to_np(x) for x in (dout, q, k, v)]
    ref64 = reference.attention_backward(*args, causal=causal, sinks=to_np(sinks))
    same = reference.attention_backward(*args, causal=causal, sinks=to_np(sinks), precision="same")
    _check_grads(res[:3], ref64, same, f"causal={causal}")
    _check_dsinks(res[3], dout, out, lse, sinks, ref64[3], same[3], f"causal={causal}")
    if deterministic:
        again = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, sinks=sinks)
        assert all(torch.equal(a, b) for a, b in zip(again, res))


@requires_gpu
@requires_torch
def test_gpu_varlen_backward(rng):
    """Packed sequences: the rows between sequences' padded rows in the backward's workspace are
    filled so that the dsinks reduction adds nothing there."""
    from cuflash.backward import attention_varlen_backward
    h, hk, d = 8, 2, 64
    cu_q, cu_k, mq, mk = _varlen_lengths(rng, 6, 150, 200)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    q, k, v, dout = _t(rng, total_q, h, d), _t(rng, total_k, hk, d), _t(rng, total_k, hk, d), _t(rng, total_q, h, d)
    sinks = _sinks(rng, h, 100)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, mq, mk, causal=True, sinks=sinks, return_lse=True)
    res = attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, causal=True, sinks=sinks,
                                    dq=_poisoned(q), dk=_poisoned(k), dv=_poisoned(v))
    args = [to_np(x) for x in (dout, q, k, v, cu_q, cu_k)]
    ref64 = reference.attention_varlen_backward(*args, causal=True, sinks=to_np(sinks))
    same = reference.attention_varlen_backward(*args, causal=True, sinks=to_np(sinks), precision="same")
    _check_grads(res[:3], ref64, same, "varlen")
    _check_dsinks(res[3], dout, out, lse, sinks, ref64[3], same[3], "varlen")


@requires_gpu
@requires_torch
@pytest.mark.parametrize("sinks_dtype", ["float32", "bfloat16"])
def test_gpu_torch_autograd(rng, sinks_dtype):
    """cuflash.torch.attention: gradients of q, k, v and the sinks (a parameter in its own dtype)."""
    import cuflash.torch as ct
    q, k, v = (x.requires_grad_() for x in (_t(rng, 2, 200, 8, 64), _t(rng, 2, 200, 2, 64), _t(rng, 2, 200, 2, 64)))
    sinks = _sinks(rng, 8, 200, sinks_dtype).requires_grad_()
    dout = _t(rng, 2, 200, 8, 64)
    out, lse = ct.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    out.backward(dout)
    assert sinks.grad.dtype == sinks.dtype and sinks.grad.shape == (8,)
    check_forward(out, lse, q, k, v, sinks, causal=True)
    args = [to_np(x) for x in (dout, q, k, v)]
    ref64 = reference.attention_backward(*args, causal=True, sinks=to_np(sinks))
    same = reference.attention_backward(*args, causal=True, sinks=to_np(sinks), precision="same")
    _check_grads((q.grad, k.grad, v.grad), ref64, same, "torch")
    _check_dsinks(sinks.grad.float(), dout, out, lse, sinks.detach(), ref64[3], same[3], "torch",
                  rtol=2 ** -8 if sinks_dtype == "bfloat16" else 1e-4)


@requires_gpu
@requires_torch
def test_gpu_torch_varlen_autograd_and_drop_in(rng):
    import torch
    import cuflash.torch as ct
    from cuflash.flash_attn import flash_attn_varlen_func
    cu_q, cu_k, mq, mk = _varlen_lengths(rng, 4, 120, 120, empty_keys=False)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    q, k, v = _t(rng, total_q, 8, 64), _t(rng, total_k, 2, 64), _t(rng, total_k, 2, 64)
    sinks = _sinks(rng, 8, 60).requires_grad_()
    dout = _t(rng, total_q, 8, 64)
    out = ct.attention_varlen(q, k, v, cu_q, cu_k, mq, mk, causal=True, sinks=sinks)
    out.backward(dout)
    args = [to_np(x) for x in (dout, q, k, v, cu_q, cu_k)]
    ref64 = reference.attention_varlen_backward(*args, causal=True, sinks=to_np(sinks))
    same = reference.attention_varlen_backward(*args, causal=True, sinks=to_np(sinks), precision="same")
    _, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, mq, mk, causal=True, sinks=sinks.detach(),
                                      return_lse=True)
    _check_dsinks(sinks.grad, dout, out, lse, sinks.detach(), ref64[3], same[3], "torch varlen")
    with torch.no_grad():
        fa, fa_lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True, s_aux=sinks,
                                            return_softmax_lse=True)
    check_forward(fa, fa_lse, q, k, v, sinks, varlen=(cu_q, cu_k), causal=True)


@requires_gpu
def test_gpu_numpy_bf16_sinks_forward_and_backward(rng):
    """NumPy in, NumPy out (computed through CuPy): bfloat16 sinks read by the kernel in their own
    dtype, and dsinks reduced by CuPy (bf16 widened to float32 by its bits)."""
    from cuflash.backward import attention_backward
    q, k, v, dout = (rng.standard_normal(s).astype(BF16) for s in ((2, 77, 4, 64), (2, 130, 2, 64), (2, 130, 2, 64),
                                                                    (2, 77, 4, 64)))
    sinks = (rng.standard_normal(4) + math.log(130)).astype(BF16)
    out, lse = cuflash.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    ok, err, bound = reference.check_close(out, q, k, v, causal=True, sinks=sinks)
    assert ok, (err, bound)
    np.testing.assert_allclose(lse, reference.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)[1],
                               rtol=1e-3, atol=2e-3)
    res = attention_backward(dout, q, k, v, out, lse, causal=True, sinks=sinks)
    assert isinstance(res[3], np.ndarray) and res[3].dtype == np.float32
    ref64 = reference.attention_backward(dout, q, k, v, causal=True, sinks=sinks)
    same = reference.attention_backward(dout, q, k, v, causal=True, sinks=sinks, precision="same")
    _check_grads(res[:3], ref64, same, "numpy")
    d_row = (dout.astype(np.float64) * out.astype(np.float64)).sum(-1).transpose(0, 2, 1)
    expect = -(np.exp(sinks.astype(np.float64)[None, :, None] - lse) * d_row).sum((0, 2))
    np.testing.assert_allclose(res[3], expect, rtol=1e-4, atol=1e-4 * np.abs(expect).max() + 1e-6)
