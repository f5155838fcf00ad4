"""Softcap and ALiBi in the warp-specialised Hopper backward (kernels/bwd_ws.py,
templates/bwd_ws/score_mods.cuh): offline checks (the variants, names and parameter structs, the
sources and structs of the variants without them unchanged, every new variant compiles for
sm_90a with no spills or stack, the launch fields), the plans that run them and the ones that
still say why not, and GPU checks (skipped without an sm_90 GPU): gradients against the float64
reference with flash-attn's rule, softcap and ALiBi crossed with the masks, GQA, head dims 64,
128 and 256, fp16/bf16 and the deterministic mode."""
import importlib
import math
from dataclasses import replace

import numpy as np
import pytest

from conftest import (assert_warp_specialised_clean, fake_view, module_compiled, record_launches, render_without_flag,
                      requires_sm90, requires_torch)
from cuflash import backward, codegen
from cuflash.kernels import all_variants, bwd_ws, head_dim_bucket
from cuflash.kernels.bwd_ws import ALIBI_FIELDS, FLASHMASK_PARAMS, PARAMS, SOFTCAP_FIELDS, BwdWsVariant
from cuflash.plan import DeviceFacts, Problem, make_backward_plan

plan_mod = importlib.import_module("cuflash.plan")  # the module (cuflash.plan is the function)

WS = [v for v in bwd_ws.variants(90) if v.family == "bwd_ws" and not v.varlen]  # (varlen: test_bwd_ws_varlen.py)
MODDED = [v for v in WS if (v.softcap or v.alibi) and not v.lpt and v.dq_groups == 1]  # (lpt, dq_groups: test_bwd_ws.py)
# Compiled here: the bf16 ones (fp16 differs only in its conversions; every variant of both was
# checked for spills with the GPU machine's NVRTC 13.0 ptxas when the modifiers were added).
COMPILED = [v for v in MODDED if v.dtype == "bf16"]
PLAIN = [v for v in WS if not (v.softcap or v.alibi)]


def test_variants():
    """Every head dim, dtype, mask and dQ mode with softcap, ALiBi and both (not both at d = 64:
    NO_SOFTCAP_ALIBI), as planned, in all_variants; none with mods=False or with FlashMask."""
    assert len({v.name for v in MODDED}) == len(MODDED) == 3 * 2 * 3 * 2 * 3 - 2 * 3 * 2
    assert set(MODDED) <= set(all_variants(90))
    assert not any(v.softcap or v.alibi for v in bwd_ws.variants(90, mods=False) if v.family == "bwd_ws")
    assert not any(v.flashmask for v in MODDED)
    assert not any(v.softcap and v.alibi and v.head_dim == 64 for v in MODDED)
    for v in MODDED:
        assert v == bwd_ws.planned(v.head_dim, v.dtype, v.causal, v.local, v.dq_ordered, 90, 0, v.softcap, v.alibi)
        mask = "local" if v.local else "causal" if v.causal else "full"
        mods = ("_softcap" if v.softcap else "") + ("_alibi" if v.alibi else "")
        assert f"_d{v.head_dim}_{v.dtype}_{mask}{mods}_" in v.name, v.name
        assert v.name == replace(v, softcap=False, alibi=False).name.replace(f"_{mask}_", f"_{mask}{mods}_", 1)


def test_params_appended_only_to_modded_variants():
    """The variants without softcap or ALiBi keep their structs (so their machine code); the
    others append softcap_scale, then the ALiBi fields, after the common ones."""
    for v in PLAIN:
        assert v.params == (FLASHMASK_PARAMS if v.flashmask else PARAMS), v.name
    for v in MODDED:
        extra = SOFTCAP_FIELDS * v.softcap + ALIBI_FIELDS * v.alibi
        assert v.params.fields == PARAMS.fields + extra, v.name
        assert v.params.struct_name == "BwdWsParams"
    assert [n for n, _ in SOFTCAP_FIELDS + ALIBI_FIELDS] == ["softcap_scale", "alibi_slopes", "alibi_sb", "alibi_scale"]


@pytest.mark.parametrize("flag", ["softcap", "alibi"])
def test_sources_of_other_variants_unchanged(flag):
    """The flags add nothing to the source of a variant without them (rendered with no flag at all)."""
    for v in PLAIN:
        src = render_without_flag(v, flag)
        assert "score_mods" not in src and "kSoftcap" not in src and "kAlibi" not in src, v.name


def test_modded_sources():
    """The softcap before the mask, the modified exponentials, the slope read only with ALiBi."""
    for v in MODDED:
        src = codegen.render(v).split('extern "C"')[1]
        assert ("apply_softcap<kQT>(s, softcap_scale);" in src) == v.softcap, v.name
        assert ("alibi_slopes[(long long)b * alibi_sb + h] * alibi_scale" in src) == v.alibi, v.name
        assert "exp_t(" not in src and "exp_mods_t<" in src and ("p_ds_mods_t<" in src) == (not v.split_d), v.name
        if v.softcap:
            assert src.index("apply_softcap<") < src.index("apply_mask_t<"), v.name


@pytest.mark.parametrize("bad, match", [
    (dict(softcap=1), "softcap must be a bool"), (dict(alibi=None), "alibi must be a bool"),
    (dict(softcap=True, flashmask=2), "softcap must be a bool, and True only without FlashMask"),
    (dict(alibi=True, flashmask=2), "alibi must be a bool, and True only without FlashMask"),
    (dict(softcap=True, alibi=True, head_dim=64), "softcap and alibi together"),
])
def test_bad_variant(bad, match):
    kw = dict(kind="bwd_ws_dkdv_dq", head_dim=128, dtype="bf16", arch=90) | bad
    with pytest.raises(ValueError, match=match):
        BwdWsVariant(**kw)


@pytest.fixture(scope="module")
def compiled(compile_variants):
    return module_compiled(compile_variants, COMPILED)


@pytest.mark.parametrize("v", COMPILED, ids=lambda v: v.name)
def test_compiles_as_designed(compiled, v):
    """As tests/test_bwd_ws.py asks of every bwd_ws variant: no spills or stack, at most the 168
    registers of __launch_bounds__(384, 1), setmaxnreg honoured, no serialized wgmma, no static
    shared memory."""
    assert_warp_specialised_clean(compiled[v], v)


# ---------------------------------------------------------------------------------------------
# Plans

def _problem(d=128, softcap=False, alibi=False, **kw):
    return Problem(2, 1000, 1000, 8, 2, d, "bf16", **(dict(causal=True, tma=True) | kw), softcap=softcap,
                   alibi=alibi)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("softcap, alibi", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_planned_on_sm90(d, softcap, alibi, deterministic):
    p = make_backward_plan(_problem(d, softcap, alibi, deterministic=deterministic), DeviceFacts(132, 90))
    main = p.launches[1].variant
    if softcap and alibi and d in bwd_ws.NO_SOFTCAP_ALIBI:
        assert main.family == "bwd" and main.softcap and main.alibi
        assert f"at head dim {d} it has no registers for softcap and ALiBi together" in p.reason
        return
    assert main.family == "bwd_ws" and (main.softcap, main.alibi) == (softcap, alibi)
    assert main.dq_ordered == deterministic and p.launches[2].variant.kind == "bwd_convert"
    assert main == bwd_ws.planned(d, "bf16", True, False, deterministic, 90, 0, softcap, alibi)
    assert "warp-specialised kernel (bwd_ws" in p.reason
    assert f"{main.kind} recomputes the scores as the forward formed them" in p.reason
    assert ("softcapped (softcap * tanh(s / softcap))" in p.reason) == softcap
    assert ("1 - tanh^2" in p.reason) == softcap
    assert ("biased by ALiBi (-slope * distance)" in p.reason) == alibi


@pytest.mark.parametrize("kw, why", [
    (dict(tma=False), "stride the TMA cannot read"),
    (dict(dropout=True), "no dropout"), (dict(d=96), "head dims 64, 128 and 256 only"),
    (dict(causal=True, flashmask=1), "no softcap with FlashMask"),
])
def test_still_blocked(kw, why):
    """What bwd_ws still cannot run falls back to the other backward kernels, with softcap and
    ALiBi (FlashMask: softcap only, as FlashMask takes no ALiBi), and the blocker says why."""
    alibi = "flashmask" not in kw
    prob = _problem(softcap=True, alibi=alibi, **kw)
    p = make_backward_plan(prob, DeviceFacts(132, 90))
    main = p.launches[1].variant
    assert main.family == "bwd" and main.softcap and main.alibi == alibi
    assert why in plan_mod._bwd_ws_blocker(prob, head_dim_bucket(prob.head_dim), 90)
    sm80 = make_backward_plan(_problem(softcap=True, alibi=True), DeviceFacts(108, 80))
    assert sm80.launches[1].variant.family == "bwd"


def test_fallback_reason_names_the_blocker():
    """On sm_90 at d = 64 and 128 the mma.sync fallback says why neither wgmma kernel runs."""
    p = make_backward_plan(_problem(softcap=True, alibi=True, tma=False), DeviceFacts(132, 90))
    assert p.launches[1].variant.mma == "sync"
    assert ("the wgmma kernel has no registers for softcap/ALiBi; not the warp-specialised kernel: an operand has a "
            "stride the TMA cannot read") in p.reason


def test_launch_fields(monkeypatch):
    """backward.run fills the new fields as the other backward kernels get them: softcap_scale =
    scale / softcap, scale_log2 = softcap log2 e, the slopes' pointer and batch stride, and
    alibi_scale = 1 / softcap."""
    launched = record_launches(monkeypatch)
    monkeypatch.setattr(backward, "tensor_map", lambda *a: bytes(128))  # bwd_ws's maps (no driver here)
    b, sq, sk, h, hk, d = 2, 300, 333, 8, 2, 128
    plan = make_backward_plan(Problem(b, sq, sk, h, hk, d, "bf16", causal=True, softcap=True, alibi=True, tma=True),
                              DeviceFacts(132, 90))
    assert plan.launches[1].variant.family == "bwd_ws"
    q, do, o = (fake_view(0, (b, sq, h, d), "bfloat16", ptr=(i + 1) << 24) for i in range(3))
    k, v = (fake_view(0, (b, sk, hk, d), "bfloat16", ptr=(i + 4) << 24) for i in range(2))
    lse = fake_view(0, (b, h, sq), "float32", ptr=7 << 24)
    slopes = fake_view(0, (b, h), "float32", ptr=8 << 24)
    grads = [fake_view(0, x.shape, "bfloat16", ptr=(10 + i) << 24) for i, x in enumerate((q, k, v))]
    backward.run(plan, (q, k, v, do, o), lse, grads, 9 << 24, 0.1, ((-1, -1), 30.0, slopes, h), 5, 0)
    name, _, f = launched[1]
    assert name == plan.launches[1].name and "_causal_softcap_alibi_" in name
    assert f["softcap_scale"] == pytest.approx(0.1 / 30.0)
    assert f["scale_log2"] == pytest.approx(30.0 * math.log2(math.e))
    assert (f["alibi_slopes"], f["alibi_sb"]) == (8 << 24, h) and f["alibi_scale"] == pytest.approx(1 / 30.0)
    assert f["scale"] == pytest.approx(0.1)


# ---------------------------------------------------------------------------------------------
# On an sm_90 GPU

def _check(grads, dout, q, k, v, **mods):
    """flash-attn's rule: each gradient within twice the same-precision reference's error of the
    float64 reference, plus 2e-4."""
    from cuflash.reference import attention_backward, max_abs_err
    from test_gpu_backward import _mods_np, to_np
    args = [to_np(x) for x in (dout, q, k, v)]
    kw = _mods_np(mods)
    ref64 = attention_backward(*args, **kw)
    same = attention_backward(*args, precision="same", **kw)
    for name, g, r, s in zip(("dq", "dk", "dv"), grads, ref64, same):
        err, bound = max_abs_err(to_np(g), r), 2 * max_abs_err(s, r) + 2e-4
        assert err <= bound, f"{name}: max error {err:.3g} exceeds bound {bound:.3g} ({mods})"


def _slopes(rng, kind, b, h):
    import torch
    if kind is None:
        return None
    shape = (h,) if kind == "h" else (b, h)
    return torch.from_numpy(rng.uniform(0.01, 0.3, size=shape).astype(np.float32)).cuda()


CASES = [  # (b, sq, sk, h, hk)
    (2, 113, 203, 4, 4), (2, 203, 113, 4, 2), (1, 1, 239, 2, 2), (1, 239, 1, 2, 1), (2, 256, 384, 6, 3),
]
MODS = [(5.0, None), (0.0, "h"), (30.0, "bh")]  # (softcap, ALiBi slopes' shape)


@requires_sm90
@requires_torch
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("mask", ["full", "causal", "local"])
@pytest.mark.parametrize("softcap, alibi", MODS, ids=str)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_gpu_against_reference(rng, case, d, dtype, softcap, alibi, mask, deterministic):
    from test_bwd_ws import _backward, _inputs
    b, sq, sk, h, hk = case
    if softcap and alibi and d in bwd_ws.NO_SOFTCAP_ALIBI:
        pytest.skip(f"softcap with ALiBi at d = {d} runs on the other backward kernels")
    q, k, v, dout = _inputs(rng, b, sq, sk, h, hk, d, dtype)
    mods = dict(causal=mask == "causal", window_size=(37, 5) if mask == "local" else (-1, -1), softcap=softcap,
                alibi_slopes=_slopes(rng, alibi, b, h))
    grads = _backward(q, k, v, dout, deterministic=deterministic, **mods)  # checks that bwd_ws ran
    _check(grads, dout, q, k, v, **mods)


@requires_sm90
@requires_torch
@pytest.mark.parametrize("softcap, alibi", MODS, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_long_against_other_kernels(rng, d, causal, softcap, alibi):
    """2k x 2k with GQA 16/2 (many steps through both stages): the atomic dQ, dK and dV against
    the kernels planned without bwd_ws (which have softcap and ALiBi) within the reference rule's
    scale, and deterministic mode bitwise repeatable."""
    import torch
    from test_bwd_ws import _backward, _inputs
    if softcap and alibi and d in bwd_ws.NO_SOFTCAP_ALIBI:
        pytest.skip(f"softcap with ALiBi at d = {d} runs on the other backward kernels")
    q, k, v, dout = _inputs(rng, 1, 2048, 2048, 16, 2, d, "bfloat16")
    mods = dict(causal=causal, softcap=softcap, alibi_slopes=_slopes(rng, alibi, 1, 16))
    a = _backward(q, k, v, dout, **mods)
    w = _backward(q, k, v, dout, ws=False, **mods)
    for name, x, y in zip(("dq", "dk", "dv"), a, w):
        assert torch.isfinite(x).all(), name
        err = (x.float() - y.float()).abs().max().item()
        assert err <= 2e-2 * y.float().abs().max().item() + 1e-3, (name, err)
    first = _backward(q, k, v, dout, deterministic=True, **mods)
    again = _backward(q, k, v, dout, deterministic=True, **mods)
    assert all(torch.equal(x, y) for x, y in zip(first, again))
