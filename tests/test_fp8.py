"""FP8 (e4m3) forward (cuflash/fp8.py, cuflash/kernels/fwd_fp8.py, templates/fwd_fp8/): offline
checks (every variant compiles for sm_90a with no spills; the key order of V^T against the
accumulator and A-fragment layouts; the reference), argument checks, and GPU checks against the
float64 reference (skipped without an sm_90 GPU and PyTorch)."""
import math

import ml_dtypes
import numpy as np
import pytest

from conftest import assert_compiled_clean, requires_sm90, requires_torch
from cuflash import compiler, reference
from cuflash.kernels import fwd_fp8
from cuflash.kernels.fwd_fp8 import FwdFp8Variant, VtVariant

E4M3 = ml_dtypes.float8_e4m3fn


# ---------------------------------------------------------------------------------------------
# Offline

@pytest.mark.parametrize("v", fwd_fp8.variants(90) + [FwdFp8Variant(head_dim=128, stages=4, arch=90)],
                         ids=lambda v: v.name)
def test_variants_compile_clean(v):
    """Every variant compiles for its target with no spills or stack; the forward's consumers get
    the registers setmaxnreg hands them (240 with the producer's 24)."""
    c = compiler.compile_variant(v)
    assert_compiled_clean(c, v)
    if isinstance(v, FwdFp8Variant):
        assert v.target == "90a" and v.consumer_regs == 240 and v.smem_bytes <= fwd_fp8.MAX_SMEM


def test_variants_and_names():
    assert fwd_fp8.variants(80) == [] and fwd_fp8.variants(89) == []
    names = [v.name for v in fwd_fp8.variants(90)]
    assert len(set(names)) == len(names) == 9
    for bad in (dict(lpt=True), dict(rescale_slack=9), dict(rescale_slack=True)):
        with pytest.raises(ValueError):
            FwdFp8Variant(head_dim=128, arch=90, **bad)
    assert fwd_fp8.planned(128, True).name == "fwd_fp8_d128_e4m3_causal_m128n128s2_overlap_pingpong_lpt_lazy_slack8_sm90"
    assert fwd_fp8.planned(256, False).name == "fwd_fp8_d256_e4m3_full_m128n128s2_overlap_pingpong_sm90"
    for bad in (dict(head_dim=96), dict(head_dim=128, block_n=256), dict(head_dim=128, arch=80),
                dict(head_dim=128, causal=1), dict(head_dim=128, stages=1), dict(head_dim=128, stages=5),
                dict(head_dim=256, stages=4)):
        with pytest.raises(ValueError):
            FwdFp8Variant(**{"arch": 90, **bad})
    with pytest.raises(ValueError):
        VtVariant(head_dim=96, arch=90)


def _kappa(s):
    """The key in k-slot s of a 32-key step of V^T (templates/fwd_fp8/*.cu.j2)."""
    return (s & 16) + ((s >> 1) & 1) * 8 + ((s >> 2) & 3) * 2 + (s & 1)


def test_vt_key_order_matches_the_fragments():
    """Simulate one warp: thread (g, q) holds accumulator columns 8 j + 2 q + {0, 1} of rows g and
    g + 8 (S's n8 tiles j = 0..3 of a 32-key step); pack_p puts tiles (0, 1) in registers 0/1 and
    (2, 3) in 2/3, four bytes each in order; the A fragment of m16n8k32 reads register r of thread
    (g, q) as columns 4 q + {0..3} (+16 for r >= 2). Every slot must hold the key kappa(slot), so P
    V^T with V^T's slots holding V[kappa(slot)] is P V."""
    seen = {}
    for q in range(4):
        for r in range(4):  # register: 0 row g tiles 0-1, 1 row g+8 tiles 0-1, 2 row g tiles 2-3, 3 row g+8 tiles 2-3
            tiles = (0, 1) if r < 2 else (2, 3)
            keys = [8 * j + 2 * q + e for j in tiles for e in (0, 1)]
            slots = [(16 if r >= 2 else 0) + 4 * q + i for i in range(4)]
            for key, slot in zip(keys, slots):
                seen[(r % 2, slot)] = key
    assert sorted(seen) == [(rh, s) for rh in (0, 1) for s in range(32)]
    assert all(key == _kappa(slot) for (_, slot), key in seen.items())
    assert sorted(_kappa(s) for s in range(32)) == list(range(32))


def _e4m3(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(E4M3)


def test_reference_descales_and_rounding():
    """The descales act as scaled inputs would (in float64); "same" (P rounded to e4m3, out to
    bf16) stays close to float64; causal rows that see no key give 0 and LSE +inf."""
    rng = np.random.default_rng(3)
    b, sq, sk, h, hk, d = 2, 37, 53, 4, 2, 128
    q, k, v = _e4m3(rng, (b, sq, h, d)), _e4m3(rng, (b, sk, hk, d)), _e4m3(rng, (b, sk, hk, d))
    qd, kd, vd = (rng.uniform(0.5, 2.0, (b, hk)) for _ in range(3))
    out, lse = reference.attention_fp8(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True,
                                       softmax_scale=0.1)
    g = np.repeat(np.arange(hk), h // hk)
    q64 = q.astype(np.float64) * (qd * kd)[:, None, g, None]
    v64 = v.astype(np.float64) * vd[:, None, :, None]
    ref, ref_lse = reference.attention(q64, k.astype(np.float64), v64, softmax_scale=0.1, return_lse=True)
    assert np.abs(out - ref).max() < 1e-12 and np.abs(lse - ref_lse).max() < 1e-12
    same = reference.attention_fp8(q, k, v, precision="same")
    f64 = reference.attention_fp8(q, k, v)
    assert same.dtype == ml_dtypes.bfloat16 and 0 < reference.max_abs_err(same, f64) < 0.05
    o, l = reference.attention_fp8(_e4m3(rng, (1, 5, 1, 128)), _e4m3(rng, (1, 2, 1, 128)), _e4m3(rng, (1, 2, 1, 128)),
                                   causal=True, return_lse=True)
    assert (o[0, :3] == 0).all() and np.isinf(l[0, 0, :3]).all() and np.isfinite(l[0, 0, 3:]).all()


# ---------------------------------------------------------------------------------------------
# Argument checks (a GPU is needed for device tensors; these run before any launch)

def _torch_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch


@requires_torch
def test_descales_need_fp8_inputs():
    """A descale with fp16/bf16 inputs is a TypeError naming them (before any device work)."""
    import torch
    import cuflash
    q = torch.zeros(1, 4, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="q_descale, k_descale and v_descale apply to float8_e4m3fn"):
        cuflash.attention(q, q, q, q_descale=torch.ones(1, 2))


@requires_torch
def test_fp8_host_tensors_are_refused():
    import torch
    import cuflash
    q = torch.zeros(1, 4, 2, 128).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="CPU tensor"):
        cuflash.attention(q, q, q)


# ---------------------------------------------------------------------------------------------
# GPU

SHAPES = [(1, 1, 1), (2, 113, 203), (1, 128, 128), (2, 256, 512), (1, 1023, 1024), (1, 640, 128), (1, 239, 1),
          (1, 1000, 3000)]


def _inputs(torch, rng, b, sq, sk, h, hk, d, scale=1.0):
    mk = lambda s: torch.from_numpy(_e4m3(rng, s, scale).view(np.uint8)).cuda().view(torch.float8_e4m3fn)  # noqa: E731
    return mk((b, sq, h, d)), mk((b, sk, hk, d)), mk((b, sk, hk, d))


def _np(t):
    return t.view(__import__("torch").uint8).cpu().numpy().view(E4M3)


def _same(q, k, v, causal=False, slack=None, **kw):
    """The kernel-like reference of e4m3 tensors, with the planned variant's rescale slack."""
    d = q.shape[-1]
    slack = fwd_fp8.planned(d, causal).rescale_slack if slack is None else slack
    return reference.attention_fp8(_np(q), _np(k), _np(v), causal=causal, precision="same", rescale_slack=slack, **kw)


@requires_sm90
@requires_torch
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("b,sq,sk", SHAPES)
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("descale", [False, True])
def test_gpu_against_reference(d, causal, b, sq, sk, heads, descale, rng):
    """Output within flash-attn's rule of the float64 reference (against the kernel-like "same"
    reference's error); LSE within what the products' accumulation allows (e4m3 wgmma keeps
    fewer mantissa bits than fp32 as it sums: 2^-11 of the row's largest sum of |q_i k_i|, in
    the scores' units); out poisoned before the call; a second call bitwise equal."""
    import torch
    import cuflash
    h, hk = heads
    q, k, v = _inputs(torch, rng, b, sq, sk, h, hk, d)
    ds = {}
    if descale:
        ds = {n: torch.from_numpy(rng.uniform(0.25, 2.0, (b, hk))).float().cuda()
              for n in ("q_descale", "k_descale", "v_descale")}
    out = torch.full((b, sq, h, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    res, lse = cuflash.attention(q, k, v, causal=causal, out=out, return_lse=True, **ds)
    assert res is out
    ref_ds = {n: x.cpu().numpy() for n, x in ds.items()}
    f64, lse64 = reference.attention_fp8(_np(q), _np(k), _np(v), causal=causal, return_lse=True, **ref_ds)
    same = _same(q, k, v, causal, **ref_ds)
    o = out.float().cpu().numpy()
    err, bound = reference.max_abs_err(o, f64), 2 * reference.max_abs_err(same, f64) + 1e-5
    assert err <= bound, (err, bound)
    l = lse.cpu().numpy()
    fin = np.isfinite(lse64)
    qa, ka = np.abs(_np(q).astype(np.float64)), np.abs(_np(k).astype(np.float64))
    g = np.repeat(np.arange(hk), h // hk)
    qkd = np.ones((b, hk)) if not descale else ref_ds["q_descale"] * ref_ds["k_descale"]
    abs_s = np.einsum("bqhd,bkhd->bhqk", qa, ka[:, :, g]).max(axis=3, initial=0) * d ** -0.5 * qkd[:, g, None]
    assert (np.isinf(l) == ~fin).all() and (np.abs(l[fin] - lse64[fin]) <= 2.0 ** -11 * abs_s[fin] + 1e-4).all()
    again = cuflash.attention(q, k, v, causal=causal, **ds)
    assert torch.equal(again, out)


@requires_sm90
@requires_torch
@pytest.mark.parametrize("given_out", [False, True])
def test_gpu_repeated_calls(given_out, rng, monkeypatch):
    """A call of a signature seen before takes the repeated-call path (no argument view is made)
    and computes, on new tensors, descales and outputs of the same layout, what the general path
    computes (bitwise; the general path after forget_plans, which empties the repeat table); a
    pointer the TMA cannot read takes the general path, whose error it gets."""
    import torch
    import cuflash
    from cuflash import fp8
    from cuflash.plan import forget_plans
    b, sq, sk, h, hk, d = 2, 130, 260, 4, 2, 128
    ds = lambda: {n: torch.from_numpy(rng.uniform(0.25, 2.0, (b, hk))).float().cuda()  # noqa: E731
                  for n in ("q_descale", "k_descale", "v_descale")}
    new_out = lambda: torch.full((b, sq, h, d), float("nan"), dtype=torch.bfloat16, device="cuda")  # noqa: E731
    call = lambda q, k, v, kw: cuflash.attention(q, k, v, causal=True, return_lse=True,  # noqa: E731
                                                 out=new_out() if given_out else None, **kw)
    call(*_inputs(torch, rng, b, sq, sk, h, hk, d), ds())
    assert len(fp8._repeats) >= 1
    runs = [(_inputs(torch, rng, b, sq, sk, h, hk, d), ds()) for _ in range(3)]
    with monkeypatch.context() as m:
        m.setattr(fp8.validate, "view", lambda *a: pytest.fail("the repeated call made a view"))
        repeated = [call(*qkv, kw) for qkv, kw in runs]
    for (qkv, kw), (out, lse) in zip(runs, repeated):
        forget_plans()
        assert not fp8._repeats
        want, want_lse = call(*qkv, kw)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
        f64 = reference.attention_fp8(*map(_np, qkv), causal=True, **{n: x.cpu().numpy() for n, x in kw.items()})
        same = _same(*qkv, True, **{n: x.cpu().numpy() for n, x in kw.items()})
        err = reference.max_abs_err(out.float().cpu().numpy(), f64)
        assert err <= 2 * reference.max_abs_err(same, f64) + 1e-5
    q, k, v = runs[0][0]
    raw = torch.empty(q.numel() + 16, dtype=torch.uint8, device="cuda")
    q1 = raw[1:1 + q.numel()].view(torch.float8_e4m3fn).view(q.shape)  # q's layout, not 16-byte aligned
    with pytest.raises(ValueError, match="16-byte aligned"):
        call(q1, k, v, runs[0][1])


@requires_sm90
@requires_torch
def test_gpu_strided_and_gqa_views(rng):
    """q, k, v as views of packed qkv (strided heads and rows), MQA; default scale and output."""
    import torch
    import cuflash
    b, s, h, d = 2, 300, 4, 128
    qkv = torch.from_numpy(_e4m3(rng, (b, s, h + 2, d)).view(np.uint8)).cuda().view(torch.float8_e4m3fn)
    q, k, v = qkv[:, :, :h], qkv[:, :, h:h + 1], qkv[:, :, h + 1:]
    out = cuflash.attention(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16 and out.shape == (b, s, h, d)
    f64 = reference.attention_fp8(_np(q.contiguous()), _np(k.contiguous()), _np(v.contiguous()), causal=True)
    same = _same(q.contiguous(), k.contiguous(), v.contiguous(), True)
    assert reference.max_abs_err(out.float().cpu().numpy(), f64) <= 2 * reference.max_abs_err(same, f64) + 1e-5


@requires_sm90
@requires_torch
def test_gpu_bad_arguments_leave_out_untouched():
    import torch
    import cuflash
    q = torch.zeros(1, 8, 2, 128, device="cuda").to(torch.float8_e4m3fn)
    out = torch.full((1, 8, 2, 128), 7.0, dtype=torch.bfloat16, device="cuda")
    cases = [
        (dict(k=q.to(torch.bfloat16)), TypeError, "k must be float8_e4m3fn"),
        (dict(q_descale=torch.ones(1, 3, device="cuda")), ValueError, r"q_descale must have shape \(batch, nheads_k\)"),
        (dict(v_descale=torch.ones(1, 2, device="cuda", dtype=torch.float16)), TypeError, "v_descale must be float32"),
        (dict(window_size=(4, 4)), NotImplementedError, "window_size"),
        (dict(softcap=5.0), NotImplementedError, "softcap"),
        (dict(num_splits=2), NotImplementedError, "num_splits"),
        (dict(sinks=torch.zeros(2, device="cuda")), NotImplementedError, "sinks"),
        (dict(k=torch.zeros(3, 1, 8, 2, 128, device="cuda").to(torch.float8_e4m3fn)[:, 0]), ValueError,
         "k must have q's batch size"),
        (dict(out=torch.empty(1, 8, 2, 128, device="cuda", dtype=torch.float16)), TypeError, "out must be bfloat16"),
    ]
    for extra, exc, match in cases:
        args = dict(k=q, v=q, out=out)
        args.update(extra)
        k, v, o = args.pop("k"), args.pop("v"), args.pop("out")
        with pytest.raises(exc, match=match):
            cuflash.attention(q, k, v, out=o, **args)
    odd = torch.zeros(4096, device="cuda").to(torch.float8_e4m3fn).as_strided((1, 8, 2, 128), (17, 256, 128, 1))
    with pytest.raises(ValueError, match="multiples of 16"):  # (a size-1 dim's stride too: the TMA reads it)
        cuflash.attention(odd, q, q, out=out)
    q96 = torch.zeros(1, 8, 2, 96, device="cuda").to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="head dims 64, 128 and 256"):
        cuflash.attention(q96, q96, q96)
    torch.cuda.synchronize()
    assert (out == 7).all()


@requires_sm90
@requires_torch
def test_gpu_empty_shapes():
    import torch
    import cuflash
    q = torch.zeros(2, 5, 2, 128, device="cuda").to(torch.float8_e4m3fn)
    k = torch.zeros(2, 0, 2, 128, device="cuda").to(torch.float8_e4m3fn)
    o, lse = cuflash.attention(q, k, k, return_lse=True)
    assert (o == 0).all() and torch.isinf(lse).all()
    o = cuflash.attention(q[:, :0], q, q)
    assert o.shape == (2, 0, 2, 128)


def test_fire_fills_the_pointer_fields_by_name(monkeypatch):
    """fire gives each launch its recipe's values with the call's pointers in their named fields: v
    and vt in VtParams; Q's, K's and V^T's tensor maps (of the call's pointers), o, lse and the three
    descales in FwdFp8Params."""
    launched = []

    class Kernel:
        def launch(self, grid, block, smem, stream, values):
            launched.append((stream, list(values)))
    monkeypatch.setattr(fwd_fp8, "tensor_map", lambda ptr, *a: ("map", ptr))
    vt_names, names = fwd_fp8.VT_PARAMS.names, fwd_fp8.PARAMS.names
    r = fwd_fp8.Recipe(None, Kernel(), (1, 1, 1), (128, 1, 1), tuple(f"r.{n}" for n in vt_names), Kernel(),
                       (1, 1, 1), (384, 1, 1), 0, tuple(f"r.{n}" for n in names), ((0,) * 4,) * 3, 0)
    fwd_fp8.fire(r, 7, 101, 102, 103, 104, 105, 106, (107, 108, 109))
    (s_vt, vt_values), (s, values) = launched
    assert s_vt == s == 7
    given = dict(v=103, vt=106)
    assert vt_values == [given.get(n, f"r.{n}") for n in vt_names]
    given = dict(tma_q=("map", 101), tma_k=("map", 102), tma_vt=("map", 106), o=104, lse=105, q_descale=107,
                 k_descale=108, v_descale=109)
    assert values == [given.get(n, f"r.{n}") for n in names]


def test_keys_pad():
    assert [fwd_fp8.keys_pad(n) for n in (0, 1, 128, 129, 1000)] == [128, 128, 128, 256, 1024]
    assert math.prod(VtVariant(head_dim=128, arch=90).grid(2, 129, 3)) == 8 * 3 * 2


@requires_sm90
@requires_torch
def test_gpu_torch_ops_forward_only(rng):
    """cuflash.torch.attention runs the FP8 forward (descales passed on); where gradients are
    recorded, the same output, whose backward raises (FlashAttention-3's FP8 is forward only)."""
    import torch
    import cuflash
    import cuflash.torch as cft
    q, k, v = _inputs(torch, rng, 2, 130, 150, 4, 2, 128)
    vd = torch.full((2, 2), 0.5, device="cuda")
    out, lse = cft.attention(q, k, v, causal=True, return_lse=True, v_descale=vd)
    ref, ref_lse = cuflash.attention(q, k, v, causal=True, return_lse=True, v_descale=vd)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    qg = q.detach().requires_grad_()
    out_g = cft.attention(qg, k, v, causal=True, v_descale=vd)
    assert torch.equal(out_g, out) and out_g.requires_grad
    with pytest.raises(NotImplementedError, match="forward only"):
        out_g.float().sum().backward()
    out_d = cft.attention(q, k, v, causal=True, v_descale=vd.clone().requires_grad_())  # a descale alone
    with pytest.raises(NotImplementedError, match="forward only"):
        out_d.float().sum().backward()


def test_plan_of_fp8_shapes():
    """cuflash.plan with dtype="float8_e4m3fn" (no GPU): the V^T copy, then the FP8 forward, the
    scratch as workspace, and why; what the FP8 path does not do raises as attention does."""
    import cuflash
    p = cuflash.plan((2, 1000, 16, 128), (2, 3000, 4, 128), (2, 3000, 4, 128), causal=True,
                     dtype="float8_e4m3fn", num_sms=132)
    assert p.kernels == ("fp8_vt_d128_sm90", "fwd_fp8_d128_e4m3_causal_m128n128s2_overlap_pingpong_lpt_lazy_slack8_sm90")
    assert p.launches[0].grid == (3072 // 32, 4, 2) and p.launches[1].grid == (8, 16, 2)
    assert p.workspace_bytes == 2 * 4 * 128 * 3072 and "FP8 forward" in p.reason and p.num_splits == 1
    assert "e4m3" in str(p)
    assert cuflash.plan((1, 0, 2, 256), (1, 5, 2, 256), (1, 5, 2, 256), dtype="float8_e4m3fn",
                        num_sms=132).launches == ()
    kw = dict(dtype="float8_e4m3fn", num_sms=132)
    s = (1, 64, 2, 128)
    for extra, exc in ((dict(backward=True), NotImplementedError), (dict(window_size=(8, 0)), NotImplementedError),
                       (dict(num_splits=4), NotImplementedError), (dict(arch=80), NotImplementedError)):
        with pytest.raises(exc):
            cuflash.plan(s, s, s, **kw, **extra)
    with pytest.raises(ValueError, match="head dims 64, 128 and 256"):
        cuflash.plan((1, 64, 2, 80), (1, 64, 2, 80), (1, 64, 2, 80), **kw)
    with pytest.raises(ValueError, match="k and v alike"):
        cuflash.plan(s, s, (1, 64, 2, 256), **kw)


TRIALS = [dict(lazy_rescale=False, rescale_slack=0), dict(lazy_rescale=True), dict(lazy_rescale=True, rescale_slack=8),
          dict(lpt=True), dict(lpt=False), dict(stages=3), dict(stages=4), dict(pingpong=False), dict(overlap=False)]


@requires_sm90
@requires_torch
@pytest.mark.parametrize("trial", TRIALS, ids=lambda t: "-".join(f"{k}={v}" for k, v in t.items()))
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_trial_variants(trial, d, causal, rng, monkeypatch):
    """Variants measured against the planned one (scripts/bench_fp8.py --variants): within
    flash-attn's rule of the reference; those that compute the same values (lazy_rescale,
    lpt, stages, the schedules) bitwise equal to the planned variant; inputs of twice the usual
    spread, so that P has dominant entries."""
    import torch
    import cuflash
    if trial.get("lpt") and not causal:
        pytest.skip("lpt orders causal tiles")
    if trial.get("stages") == 4 and d == 256:
        pytest.skip("four stages of d=256 tiles do not fit in shared memory")
    q, k, v = _inputs(torch, rng, 2, 700, 900, 4, 2, d, scale=2.0)
    planned = cuflash.attention(q, k, v, causal=causal)
    fields = {**fwd_fp8.planned_fields(d, causal), **trial}
    fields["lpt"] = fields.get("lpt", False) and causal
    monkeypatch.setattr(fwd_fp8, "planned", lambda hd, c, arch=90: FwdFp8Variant(head_dim=hd, causal=c, arch=arch,
                                                                              **fields))
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    f64, lse64 = reference.attention_fp8(_np(q), _np(k), _np(v), causal=causal, return_lse=True)
    same = _same(q, k, v, causal, slack=fields.get("rescale_slack", 0))
    assert reference.max_abs_err(out.float().cpu().numpy(), f64) <= 2 * reference.max_abs_err(same, f64) + 1e-5
    assert np.abs(lse.cpu().numpy() - lse64).max() < 0.05
    if fields.get("rescale_slack", 0) == fwd_fp8.planned_fields(d, causal).get("rescale_slack", 0):
        assert torch.equal(out, planned)


def test_argument_checks_before_any_launch(fake_views):
    """The FP8 path's checks on hand-made device views (no GPU): each bad argument raises naming
    itself before anything is allocated or launched."""
    from conftest import fake_view
    import cuflash
    q = fake_view(0, (1, 8, 2, 128), "float8_e4m3fn")
    ok = dict(k=q, v=q)
    cases = [
        (dict(k=fake_view(0, (1, 8, 2, 128), "bfloat16")), TypeError, "k must be float8_e4m3fn"),
        (dict(k=fake_view(0, (3, 8, 2, 128), "float8_e4m3fn")), ValueError, "k must have q's batch size"),
        (dict(v=fake_view(0, (1, 9, 2, 128), "float8_e4m3fn")), ValueError, "v must have k's shape"),
        (dict(k=fake_view(0, (1, 8, 3, 128), "float8_e4m3fn"), v=fake_view(0, (1, 8, 3, 128), "float8_e4m3fn")),
         ValueError, "divisible by nheads_k"),
        (dict(q_descale=fake_view(0, (1, 3), "float32")), ValueError, r"q_descale must have shape \(batch, nheads_k\)"),
        (dict(v_descale=fake_view(0, (1, 2), "float16")), TypeError, "v_descale must be float32"),
        (dict(window_size=(4, 4)), NotImplementedError, "window_size"),
        (dict(num_splits=2), NotImplementedError, "num_splits"),
        (dict(out=fake_view(0, (1, 8, 2, 128), "float16")), TypeError, "out must be bfloat16"),
        (dict(out=fake_view(0, (1, 8, 2, 64), "bfloat16")), ValueError, "out must have q's shape"),
        (dict(out=fake_view(0, (1, 8, 2, 128), "bfloat16", strides=(2048, 256, 128, 1), ptr=(1 << 20) + 8)),
         ValueError, "out must start 16-byte aligned"),
    ]
    for extra, exc, match in cases:
        args = dict(ok, **extra)
        with pytest.raises(exc, match=match):
            cuflash.attention(q, args.pop("k"), args.pop("v"), **args)
    odd = fake_view(0, (1, 8, 2, 128), "float8_e4m3fn", strides=(17, 256, 128, 1))
    with pytest.raises(ValueError, match="multiples of 16"):
        cuflash.attention(odd, q, q)
    q96 = fake_view(0, (1, 8, 2, 96), "float8_e4m3fn")
    with pytest.raises(ValueError, match="head dims 64, 128 and 256"):
        cuflash.attention(q96, q96, q96)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        cuflash.attention(fake_view(0, (1, 8, 2, 128), "float8_e4m3fn", strides=(4096, 512, 256, 2)), q, q)
