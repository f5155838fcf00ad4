"""FlashMask in the backward kernels. CPU: the FlashMask dK/dV (mma.sync and wgmma) and dQ variants
render and compile offline (NVRTC, no GPU) for sm_80 and sm_90a with no spills, backward plans add
the FlashMask prep launches and reject what the forward rejects, the launch arguments (indices read
in place, per-key-block bounds laid out after the fp32 rows) reach the right kernels in the right
order, bad arguments raise before any launch, the tile rule holds for the backward's tiles, and
cuflash.torch carries the indices to the backward. GPU (named ``test_gpu_*``): dq, dk and dv
against the float64 reference with flash-attn's rule (max error <= 2 x the same-precision
reference's + 2e-4), on fresh random inputs, into NaN-poisoned gradient buffers, for every builder
in cuflash.masks and random intervals, causal and not, GQA, softcap, both dtypes and both products
(wgmma at d = 64 and 128 on sm_90, mma.sync otherwise); deterministic mode bitwise repeatable."""
import dataclasses
import importlib

import numpy as np
import pytest

import cuflash
from cuflash import backward, codegen, masks, reference
from cuflash.kernels import bwd
from cuflash.kernels.bwd import BwdTileVariant
from cuflash.kernels.flashmask import FlashMaskPrepVariant
from cuflash.plan import DeviceFacts, Problem, make_backward_plan
from conftest import (assert_compiled_clean, assert_warp_specialised_clean, fake_view, record_launches, requires_gpu,
                      requires_sm90, requires_torch, warm)
from test_flashmask_kernels import _builders, _kernel_mask

H100 = dict(num_sms=132)


# ---------------------------------------------------------------------------------------------
# Variants, rendering, offline compilation

def _tile(kind, d, arch, n, causal, softcap=False):
    """The FlashMask variant of ``kind`` that a backward plan launches."""
    ks = bwd.kernels(d, "bf16", causal, kind != "bwd_dkdv_dq", arch, softcap=softcap, flashmask=n)
    return next(v for v in ks if v.kind == kind)


# Every kind at head dims 64 and 128 (wgmma on sm_90 without softcap) and 256 (mma.sync), each n on
# both archs, softcap crossed in: what the offline compile must find clean.
SAMPLE = list(dict.fromkeys(
    _tile(kind, d, arch, n, causal, softcap)
    for arch in (80, 90) for kind in ("bwd_dkdv_dq", "bwd_dkdv", "bwd_dq")
    for d, softcap in ((64, False), (128, False), (128, True), (256, True))
    for n, causal in ((1, True), (2, True), (2, False), (4, False))
    if (d, n) in ((64, 1), (64, 4), (128, 2), (128, 4), (256, 1), (256, 2)) or (n == 2 and not causal and d == 64)))


def test_sample_crosses_both_products_every_n_and_kind():
    got = {(v.arch, v.kind, v.mma, v.flashmask) for v in SAMPLE}
    for arch in (80, 90):
        for kind in ("bwd_dkdv_dq", "bwd_dkdv", "bwd_dq"):
            assert {n for a, k, _, n in got if (a, k) == (arch, kind)} == {1, 2, 4}
    assert {(k, n) for a, k, m, n in got if m == "wgmma"} >= {(k, n) for k in ("bwd_dkdv_dq", "bwd_dkdv")
                                                             for n in (1, 2, 4)}
    assert any(v.softcap for v in SAMPLE) and all(v.arch == 80 or v.mma == "sync" for v in SAMPLE if v.softcap)


@pytest.mark.parametrize("v", SAMPLE + [FlashMaskPrepVariant(columns=n, arch=a) for a in (80, 90) for n in (1, 2, 4)],
                         ids=lambda v: v.name)
def test_flashmask_backward_variant_compiles_without_spills(compiled, v):
    assert_compiled_clean(compiled[v], v)


def test_variants_are_named_checked_and_rendered():
    for arch in (80, 90):
        vs = bwd.flashmask_variants(arch)
        tiles = [v for v in vs if v.kind in bwd.TILE_KINDS]
        assert len(tiles) == 6 * 2 * 4 * 2 * 3 and all(v.flashmask and f"_fm{v.flashmask}_" in v.name for v in tiles)
        assert set(vs) <= set(bwd.variants(arch)) and not set(vs) & set(bwd.variants(arch, mods=False)) - {
            v for v in vs if v.kind in bwd.ROW_KINDS}
        assert all(v.params is (bwd.DQ_FM_PARAMS if v.kind == "bwd_dq" else bwd.DKDV_FM_PARAMS) for v in tiles)
        assert all(not (v.local or v.alibi) for v in tiles)
        assert {v.mma for v in tiles} == ({"sync", "wgmma"} if arch == 90 else {"sync"})
    # the FlashMask fields follow the plain struct's, which is unchanged
    for fm, plain in ((bwd.DKDV_FM_PARAMS, bwd.DKDV_PARAMS), (bwd.DQ_FM_PARAMS, bwd.DQ_PARAMS)):
        assert fm.names[:len(plain.names)] == plain.names and fm.names[len(plain.names):][-1] == "fm_blocks"
    for v in SAMPLE:
        src = codegen.render(v)
        assert f"constexpr int kFlashMask = {v.flashmask};" in src and "fm_blocks" in src
        assert ("apply_flashmask<" in src) == (v.kind == "bwd_dq")
        assert ("apply_flashmask_t<" in src) == (v.kind != "bwd_dq")
        plain = dataclasses.replace(v, flashmask=0)
        assert "_fm" not in plain.name and "kFlashMask" not in codegen.render(plain)
        assert "flashmask" not in codegen.render(plain) and plain.params in (bwd.DKDV_PARAMS, bwd.DQ_PARAMS)
    base = dict(kind="bwd_dkdv", head_dim=64, dtype="bf16", block_m=64, block_n=128, warps=8, stages=2, arch=80)
    for bad in (dict(flashmask=4, causal=True), dict(flashmask=1), dict(flashmask=3), dict(flashmask=2, alibi=True),
                dict(flashmask=2, local=True)):
        with pytest.raises(ValueError):
            BwdTileVariant(**{**base, **bad})
    BwdTileVariant(**{**base, "flashmask": 2, "softcap": True})  # softcap is fine


# ---------------------------------------------------------------------------------------------
# Plans

def _bwd_plan(arch=90, deterministic=False, n=1, causal=True, heads=1, d=128, **kw):
    return make_backward_plan(Problem(2, 300, 333, 8, 2, d, "bf16", causal=causal, deterministic=deterministic,
                                      flashmask=n, flashmask_heads=heads, **kw), DeviceFacts(132, arch))


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_plan_adds_the_prep_launches(arch, deterministic, d):
    p = _bwd_plan(arch, deterministic, n=2, causal=False, heads=2, d=d)
    prep, main, last, *fm = (l.variant for l in p.launches)
    assert prep.kind == "bwd_prep" and main.flashmask == 2 and not main.causal
    ws = arch == 90  # the warp-specialised kernel: atomic dQ; deterministic, no dQ (not causal here)
    dq_kernel = deterministic  # the deterministic dQ kernel follows
    assert main.family == ("bwd_ws" if ws else "bwd")
    assert main.mma == ("wgmma" if ws else "sync")
    if ws:
        assert main.kind == ("bwd_ws_dkdv" if dq_kernel else "bwd_ws_dkdv_dq")
        assert main.dq_ordered == (deterministic and not dq_kernel)
    assert (last.kind, getattr(last, "flashmask", 0)) == (("bwd_dq", 2) if dq_kernel else ("bwd_convert", 0))
    assert getattr(main, "dq_t", False) == (ws and d == 128 and not deterministic)  # 80-query steps with dQ^T
    assert getattr(main, "fm_window", False) == (ws and d != 256)  # the windowed walk
    assert getattr(last, "tiled", False) == (ws and not dq_kernel and not getattr(main, "dq_t", False))
    assert getattr(last, "swizzled", False) == getattr(main, "dq_t", False)
    assert ("with this FlashMask mask the dK/dV kernel adds no dQ" in p.reason) == (ws and dq_kernel)
    assert ("fully masked takes no turn" in p.reason) == (ws and deterministic and not dq_kernel)
    sizes = [main.block_n] + ([last.block_n] if dq_kernel and last.block_n != main.block_n else [])
    assert [v.family for v in fm] == ["flashmask"] * len(sizes) and all(v.columns == 2 for v in fm)
    assert [l.grid for l in p.launches[3:]] == [(-(-333 // bn), 2, 2) for bn in sizes]
    fm_bytes = sum(4 * 2 * 2 * -(-333 // bn) * 2 * 2 for bn in sizes)
    rows = 2 * 8 * (320 if getattr(main, "dq_t", False) else 384)  # LSE and D, and without the deterministic dQ kernel the dQ
    # accumulator, for 300 queries in steps of 80 or 128 rows
    sems = 0  # no ordered adds, so no semaphores
    assert p.workspace_bytes == 4 * rows * (2 + (0 if dq_kernel else d)) + fm_bytes + sems
    assert backward.workspace_floats(p) == p.workspace_bytes // 4
    assert f"startend_row_indices (FlashMask, n=2, causal=False): {fm[0].name} runs first" in p.reason
    assert f"({fm_bytes} B;" in p.reason and "skip" in p.reason


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal, n", [(True, 1), (True, 2), (False, 2), (False, 4)])
def test_deterministic_plans(d, causal, n):
    """Deterministic FlashMask on sm_90: causal at d = 64 and 128 the dQ writer's ordered adds
    (semaphores after the bounds, bwd_convert last); otherwise bwd_ws without dQ, then bwd_dq."""
    p = _bwd_plan(90, True, n=n, causal=causal, d=d)
    prep, main, last, *fm = (l.variant for l in p.launches)
    ordered = causal and d != 256
    assert main.family == "bwd_ws" and main.flashmask == n and main.dq_ordered == ordered
    assert main.kind == ("bwd_ws_dkdv_dq" if ordered else "bwd_ws_dkdv")
    assert last.kind == ("bwd_convert" if ordered else "bwd_dq")
    rows = 2 * 8 * 384
    fm_bytes = sum(l.grid[0] * l.grid[1] * l.grid[2] * 2 * n * 4 for l in p.launches[3:])
    assert p.workspace_bytes == 4 * rows * (2 + (d if ordered else 0)) + fm_bytes + (4 * rows // 64 if ordered else 0)
    assert ("fully masked takes no turn" in p.reason) == ordered


def test_plan_causal_follows_the_caller_for_one_query():
    # one query row sees every key under bottom-right causal, but n=1's columns need the causal variant
    p = make_backward_plan(Problem(1, 1, 300, 2, 2, 64, "bf16", causal=True, flashmask=1, flashmask_heads=1),
                           DeviceFacts(132, 90))
    assert p.launches[1].variant.causal and p.launches[1].variant.flashmask == 1


@pytest.mark.parametrize("kw, what", [(dict(window=(8, 0)), "window_size"), (dict(alibi=True), "alibi_slopes"),
                                      (dict(sinks=True), "sinks"), (dict(varlen=True), "varlen")])
def test_backward_plan_rejects_combinations(kw, what):
    with pytest.raises(ValueError, match=f"startend_row_indices.*{what}"):
        _bwd_plan(**kw)


@pytest.mark.parametrize("kw, what", [(dict(alibi_slopes=True), "alibi_slopes"), (dict(sinks=True), "sinks"),
                                      (dict(window_size=(8, 0)), "window_size")])
def test_cuflash_plan_backward_rejects_combinations(kw, what):
    q, k = (2, 512, 8, 64), (2, 512, 2, 64)
    with pytest.raises(ValueError, match=f"startend_row_indices.*{what}"):
        cuflash.plan(q, k, k, causal=True, backward=True, startend_row_indices=(2, 1, 512, 1), arch=90, **H100, **kw)


def test_cuflash_plan_backward_counts_the_dkdv_tiles():
    q, k = (2, 512, 8, 128), (2, 512, 2, 128)
    x = masks.causal_document([100, 300, 112], batch=2)
    p = cuflash.plan(q, k, k, causal=True, backward=True, deterministic=True, startend_row_indices=x, arch=90, **H100)
    main = p.launches[1].variant
    assert main.kind == "bwd_ws_dkdv_dq" and main.dq_ordered and main.flashmask == 1
    from cuflash.plan import mask_tiles
    t = mask_tiles(x, 512, 512, main.block_m, main.block_n, True)
    assert f"{t.skipped * 8} skipped, {t.masked * 8} masked, {t.unmasked * 8} unmasked" in p.reason
    assert t.skipped > 0 and "not run FlashMask" not in p.reason


# ---------------------------------------------------------------------------------------------
# Launch arguments (kernels recorded instead of run)

@pytest.mark.parametrize("deterministic", [False, True])
def test_launch_arguments(monkeypatch, deterministic):
    launched = record_launches(monkeypatch)
    monkeypatch.setattr(backward, "tensor_map", lambda *a: bytes(128))  # bwd_ws's maps (no driver here)
    plan = _bwd_plan(90, deterministic, n=4, causal=False, heads=8, d=128)
    b, sq, sk, h, hk, d = 2, 300, 333, 8, 2, 128
    q, do, o = (fake_view(0, (b, sq, h, d), "bfloat16", ptr=(i + 1) << 24) for i in range(3))
    k, v = (fake_view(0, (b, sk, hk, d), "bfloat16", ptr=(i + 4) << 24) for i in range(2))
    lse = fake_view(0, (b, h, sq), "float32", ptr=7 << 24)
    fm = fake_view(0, (b, h, sk, 4), "int32", strides=(h * sk * 4, 4, h * 4, 1), ptr=8 << 24)  # (b, s, h, n) storage
    ws = 9 << 24
    grads = [fake_view(0, x.shape, "bfloat16", ptr=(10 + i) << 24) for i, x in enumerate((q, k, v))]
    backward.run(plan, (q, k, v, do, o), lse, grads, ws, 0.1, ((-1, -1), 0.0, None, 0), 5, 0, fm=fm)
    names = [n for n, _, _ in launched]
    n_prep = len(plan.launches) - 3
    assert names == [l.name for l in plan.launches[3:]] + [l.name for l in plan.launches[:3]]
    assert all(s == 5 for _, s, _ in launched)
    _, rows = backward.stats_rows(b, sq, h, pad=backward.row_pad(plan))  # (whole 80-row steps with dq_t)
    at = ws + 4 * rows * (2 + (0 if deterministic else d))  # the bounds follow the fp32 rows
    outs = []
    for (_, _, f), (launch, bn, ints) in zip(launched[:n_prep], backward._flashmask_preps(plan)):
        assert (f["idx"], f["idx_sb"], f["idx_sh"], f["idx_ss"], f["idx_sc"]) == (8 << 24, *fm.strides)
        assert (f["out"], f["block_n"], f["seqlen_k"], f["heads"]) == (at, bn, sk, h)
        assert ints == b * h * -(-sk // bn) * 2 * 4
        outs.append((bn, at))
        at += 4 * ints
    assert at == ws + 4 * backward.workspace_floats(plan) == ws + plan.workspace_bytes
    blocks = dict(outs)
    for (name, _, f), launch in zip(launched[n_prep + 1:], plan.launches[1:3]):
        if launch.variant.kind == "bwd_convert":
            assert "fm_idx" not in f
            continue
        assert (f["fm_idx"], f["fm_sb"], f["fm_sh"], f["fm_ss"], f["fm_sc"]) == (8 << 24, *fm.strides)
        assert (f["fm_hdiv"], f["fm_heads"], f["fm_blocks"]) == (1, h, blocks[launch.variant.block_n])
    with pytest.raises(ValueError, match="needs startend_row_indices"):
        backward.run(plan, (q, k, v, do, o), lse, grads, ws, 0.1, ((-1, -1), 0.0, None, 0), 5, 0)


# ---------------------------------------------------------------------------------------------
# Argument checks: before anything is allocated or launched

def _np_args(b=2, sq=8, sk=8, h=4, hk=2, d=16):
    z = lambda *s: np.zeros(s, np.float16)  # noqa: E731
    return (z(b, sq, h, d), z(b, sq, h, d), z(b, sk, hk, d), z(b, sk, hk, d), z(b, sq, h, d),
            np.zeros((b, h, sq), np.float32))


@pytest.mark.parametrize("x, kw, exc, msg", [
    (masks.causal(8, batch=2), dict(window_size=(3, 0)), ValueError, "startend_row_indices.*window_size"),
    (masks.causal(8, batch=2), dict(alibi_slopes=np.ones(4, np.float32)), ValueError, "startend_row_indices.*alibi"),
    (masks.causal(8, batch=2), dict(sinks=np.zeros(4, np.float32)), ValueError, "startend_row_indices.*sinks"),
    (np.zeros((2, 1, 8, 4), np.int32), {}, ValueError, "last dim of startend_row_indices"),
    (np.zeros((2, 3, 8, 1), np.int32), {}, ValueError, "startend_row_indices must have shape"),
    (np.zeros((2, 1, 8, 1), np.int64), {}, TypeError, "startend_row_indices must be int32"),
    (np.full((2, 1, 8, 1), 9, np.int32), {}, ValueError, r"startend_row_indices must lie in \[0, seqlen_q\]"),
])
def test_attention_backward_checks_before_launch(monkeypatch, x, kw, exc, msg):
    def boom(*a, **k):
        raise AssertionError("validation passed: device path reached")
    monkeypatch.setattr(backward, "_backward_device", boom)
    monkeypatch.setattr(cuflash.arrays, "current_device", boom)
    grads = [np.full_like(a, 7) for a in _np_args()[1:4]]
    with pytest.raises(exc, match=msg):
        backward.attention_backward(*_np_args(), causal=True, startend_row_indices=x, dq=grads[0], dk=grads[1],
                                    dv=grads[2], **kw)
    assert all((g == 7).all() for g in grads)


def test_attention_backward_reaches_the_device_path_with_the_view(fake_views, monkeypatch):
    seen = {}

    def device(*a, fm=None, **k):
        seen["fm"] = fm
        return "ran"
    monkeypatch.setattr(backward, "_backward_device", device)
    q, k = fake_view(0, (2, 8, 4, 16)), fake_view(0, (2, 8, 2, 16))
    x = fake_view(0, (2, 2, 8, 2), "int32", ptr=3 << 20)
    assert backward.attention_backward(q, q, k, k, q, fake_view(0, (2, 4, 8), "float32"), causal=True,
                                       startend_row_indices=x) == "ran"
    assert seen["fm"] is x  # read in place: the caller's array, not a copy


# ---------------------------------------------------------------------------------------------
# The tile rule at the backward's tiles: prep's per-block min/max, flashmask_class and the element
# rule (written out in NumPy by test_flashmask_kernels._kernel_mask) give the dense mask exactly

_BWD_TILES = sorted({(v.block_m, v.block_n) for a in (80, 90) for v in bwd.flashmask_variants(a)
                     if v.kind in bwd.TILE_KINDS})


def test_bwd_tiles_are_known():
    assert (64, 128) in _BWD_TILES and (32, 64) in _BWD_TILES and (128, 64) in _BWD_TILES


@pytest.mark.parametrize("bm, bn", _BWD_TILES)
@pytest.mark.parametrize("causal, n", [(True, 1), (True, 2), (False, 2), (False, 4)])
def test_kernel_rule_is_exact_at_backward_tiles(bm, bn, causal, n):
    x = _random_intervals(np.random.default_rng(bm * 1000 + bn + n), 1, 1, 300, 300, n, causal)
    # the intervals alone (the causal mask is apply_mask_t's)
    np.testing.assert_array_equal(_kernel_mask(x, 300, causal, bm, bn), _interval_mask(x, 300, causal))


def _interval_mask(x, sq, causal):
    """The rows that the intervals of startend_row_indices mask, without the causal mask:
    bool (batch, heads, sq, sk), True = masked."""
    b, h, sk, _ = x.shape
    out = np.zeros((b, h, sq, sk), bool)
    i = np.arange(sq)[:, None]
    for s, e in masks.intervals(x, sq, causal):
        out |= (i >= s[:, :, None, :]) & (i < e[:, :, None, :])
    return out


def _random_intervals(rng, b, heads, sq, sk, n, causal):
    """Random startend_row_indices with empty intervals, intervals of one row, columns masked
    whole and runs of equal columns (so that whole tiles are skipped or plain)."""
    kind = rng.integers(0, 6, (b, heads, sk))
    run = np.repeat(rng.integers(0, sq + 1, (b, heads, -(-sk // 64))), 64, axis=-1)[..., :sk]
    lo = np.where(kind == 2, run, rng.integers(0, sq + 1, (b, heads, sk)))  # runs of equal starts
    hi = np.minimum(lo + rng.choice([0, 1, 5, sq], (b, heads, sk)), sq)  # empty, one row, a few, to the end
    lo, hi = np.where(kind == 0, 0, lo), np.where(kind == 0, sq, hi)      # the whole column
    lo, hi = np.where(kind == 1, sq, lo), np.where(kind == 1, sq, hi)    # nothing
    if causal:
        cols = [lo] if n == 1 else [lo, hi]
    elif n == 2:  # LTS, UTE: rows >= LTS and rows < UTE
        ute = rng.integers(0, sq + 1, (b, heads, sk))
        ute = np.where(kind == 1, 0, np.where(kind == 3, 1, ute))
        cols = [lo, np.minimum(ute, lo)]
    else:
        uts = rng.integers(0, sq + 1, (b, heads, sk))
        ute = np.minimum(uts + rng.choice([0, 1, 7], (b, heads, sk)), sq)
        cols = [lo, hi, uts, ute]
    return np.stack(cols, axis=-1).astype(np.int32)


def test_random_intervals_are_valid_and_varied():
    rng = np.random.default_rng(0)
    for causal, n in ((True, 1), (True, 2), (False, 2), (False, 4)):
        x = _random_intervals(rng, 2, 3, 200, 257, n, causal)
        cuflash.validate.check_startend_row_indices(x, 2, 6, 200, 257, causal, nheads_k=3)
        dense = _interval_mask(x, 200, causal)
        cols = dense.all(axis=2), (~dense).all(axis=2)  # keys masked for every row / for none
        assert cols[0].any() and cols[1].any()
        one_row = dense.sum(axis=2) == 1
        assert one_row.any()


# ---------------------------------------------------------------------------------------------
# cuflash.torch: the indices reach the forward and the backward (the reference standing in for
# the kernels, on CPU tensors), and the gradients are autograd's through a dense-mask formulation

@pytest.fixture
def fm_ref_kernels(monkeypatch):
    import cuflash.backward  # noqa: F401  the real module first: undoing the patch restores it
    import sys
    import types
    import torch
    calls = []
    T = lambda a, like: torch.from_numpy(np.ascontiguousarray(a)).to(like.dtype)  # noqa: E731
    npy = lambda x: None if x is None else x.detach().numpy()  # noqa: E731

    def attention(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, out=None, **feat):
        calls.append(("attention", feat))
        o, lse = reference.attention(npy(q), npy(k), npy(v), causal=causal, softmax_scale=softmax_scale,
                                     return_lse=True, startend_row_indices=npy(feat.get("startend_row_indices")))
        o = T(o, q) if out is None else out.copy_(T(o, q))
        return (o, torch.from_numpy(lse).float()) if return_lse else o

    def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, deterministic=False,
                           dq=None, dk=None, dv=None, **feat):
        calls.append(("backward", feat))
        res = reference.attention_backward(npy(dout), npy(q), npy(k), npy(v), causal=causal,
                                           softmax_scale=softmax_scale,
                                           startend_row_indices=npy(feat.get("startend_row_indices")))
        return tuple(b.copy_(T(g, b)) for b, g in zip((dq, dk, dv), res))

    bwd_module = types.ModuleType("cuflash.backward")
    bwd_module.attention_backward = attention_backward
    monkeypatch.setattr(cuflash, "attention", attention)
    monkeypatch.setattr(cuflash, "backward", bwd_module)
    monkeypatch.setitem(sys.modules, "cuflash.backward", bwd_module)
    return calls


@requires_torch
@pytest.mark.parametrize("causal, x", [(True, masks.causal_document([3, 4], batch=2)),
                                       (False, masks.prefix_lm_document([(4, 2), (3, 1)], batch=2))])
def test_torch_autograd_plumbing(fm_ref_kernels, causal, x):
    import torch
    import cuflash.torch as ct
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 7, 4, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    dout = torch.randn(2, 7, 4, 8, generator=g, dtype=torch.float64)
    xt = torch.from_numpy(x)
    out = ct.attention(q, k, v, causal=causal, startend_row_indices=xt)
    out.backward(dout)
    hidden = torch.from_numpy(masks.to_dense(x, 7, causal))  # (b, 1, sq, sk), True = masked
    if causal:
        hidden = hidden | torch.ones(7, 7, dtype=torch.bool).triu(1)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * 8 ** -0.5
    want_out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s.masked_fill(hidden, float("-inf")), -1), v)
    want = torch.autograd.grad(want_out, (q, k, v), dout)
    torch.testing.assert_close(out, want_out)
    for got, w in zip((q.grad, k.grad, v.grad), want):
        torch.testing.assert_close(got, w)
    assert [c[0] for c in fm_ref_kernels] == ["attention", "backward"]
    assert all(c[1]["startend_row_indices"] is xt for c in fm_ref_kernels)


@requires_torch
def test_torch_op_schema_takes_the_indices():
    import torch
    importlib.import_module("cuflash.torch")  # registers the ops
    for op in (torch.ops.cuflash.attention_fwd, torch.ops.cuflash.attention_bwd):
        args = {a.name: a for a in op.default._schema.arguments}
        assert str(args["startend_row_indices"].type) == "Optional[Tensor]"


# ---------------------------------------------------------------------------------------------
# GPU: gradients against the float64 reference, outputs poisoned

@pytest.fixture(scope="module")
def _fm_kernels():
    """Every FlashMask backward variant (and the forward's) of this GPU, compiled in parallel once
    (conftest.warm)."""
    import cupy
    from cuflash.kernels import fwd
    arch = int(cupy.cuda.Device().compute_capability)
    warm(bwd.flashmask_variants(arch) + fwd.flashmask_variants(arch)
         + [FlashMaskPrepVariant(columns=n, arch=arch) for n in (1, 2, 4)])


def _check(rng, b, sq, sk, h, hk, d, dtype, causal, x, deterministic=False, **kw):
    """Forward (out, lse) with the mask, then the backward into NaN-filled buffers; dq, dk and dv
    against the float64 reference: max error <= 2 x the same-precision reference's + 2e-4.
    Returns the gradients."""
    import torch
    from cuflash.reference import max_abs_err
    from test_gpu_backward import to_np, torch_inputs
    q, k, v, dout = torch_inputs(rng, b, sq, sk, h, hk, d, dtype)
    xt = torch.from_numpy(np.ascontiguousarray(x)).cuda()
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, startend_row_indices=xt, **kw)
    bufs = dict(dq=torch.full_like(q, float("nan")), dk=torch.full_like(k, float("nan")),
                dv=torch.full_like(v, float("nan")))
    grads = backward.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic,
                                        startend_row_indices=xt, **kw, **bufs)
    assert all(g is bufs[n] for g, n in zip(grads, ("dq", "dk", "dv")))
    args = [to_np(t) for t in (dout, q, k, v)]
    ref = dict(causal=causal, startend_row_indices=x, **kw)
    ref64 = reference.attention_backward(*args, **ref)
    same = reference.attention_backward(*args, precision="same", **ref)
    for name, g, r, s in zip(("dq", "dk", "dv"), grads, ref64, same):
        err, bound = max_abs_err(to_np(g), r), 2 * max_abs_err(s, r) + 2e-4
        assert err <= bound, f"{name}: max error {err:.3g} exceeds bound {bound:.3g}"
    return grads


@requires_gpu
@requires_torch
@pytest.mark.usefixtures("_fm_kernels")
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("name, causal, x", _builders(300), ids=lambda a: a if isinstance(a, str) else None)
def test_gpu_builders(rng, name, causal, x, d, deterministic):
    _check(rng, 2, 300, 300, 4, 2, d, "bfloat16", causal, np.concatenate([x, x]), deterministic)


@requires_sm90
@requires_torch
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("name, causal, x", [b for b in _builders(1100) if b[0] in (
    "causal_document", "share_question", "global_sliding_window", "prefix_lm_document", "random_eviction")],
    ids=lambda a: a if isinstance(a, str) else None)
def test_gpu_bwd_ws_longer(rng, name, causal, x, d):
    """The warp-specialised backward (sm_90, atomic dQ) over many query blocks, some left out: GQA."""
    p = _bwd_plan(90, False, n=x.shape[-1], causal=causal, d=d)
    assert p.launches[1].variant.family == "bwd_ws" and p.launches[1].variant.flashmask == x.shape[-1]
    _check(rng, 1, 1100, 1100, 4, 2, d, "bfloat16", causal, x)


@requires_gpu
@requires_torch
@pytest.mark.usefixtures("_fm_kernels")
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d, dtype", [(64, "float16"), (128, "bfloat16"), (96, "float16"), (256, "bfloat16")])
@pytest.mark.parametrize("causal, n", [(True, 1), (True, 2), (False, 2), (False, 4)])
def test_gpu_random_intervals(rng, causal, n, d, dtype, deterministic):
    """Empty intervals, one-row intervals, keys masked for every row (their dk, dv are 0) and
    runs of equal columns (whole tiles skipped or plain), per query head."""
    x = _random_intervals(np.random.default_rng(d + n), 2, 4, 317, 317, n, causal)
    grads = _check(rng, 2, 317, 317, 4, 2, d, dtype, causal, x, deterministic)
    dense = masks.to_dense(x, 317, causal)  # (b, 4 heads, sq, sk); query heads 2g, 2g + 1 read KV head g
    hidden = dense.reshape(2, 2, 2, 317, 317).all(axis=(2, 3))  # keys no query head of the group sees
    assert hidden.any()
    import torch
    for g in grads[1:]:
        assert torch.all(g.transpose(1, 2)[torch.from_numpy(hidden).cuda()] == 0)


@requires_gpu
@requires_torch
@pytest.mark.usefixtures("_fm_kernels")
@pytest.mark.parametrize("heads", [1, 2, 8])  # broadcast, per KV head (GQA), per query head
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_gqa_and_per_head_indices(rng, heads, d):
    x = masks.random_eviction(257, 40, seed=1, batch=2, nheads=heads)
    _check(rng, 2, 257, 257, 8, 2, d, "float16", True, x)
    _check(rng, 2, 257, 257, 8, 2, d, "float16", True, x, deterministic=True)


@requires_gpu
@requires_torch
@pytest.mark.usefixtures("_fm_kernels")
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("deterministic", [False, True])
def test_gpu_softcap_and_mqa(rng, d, deterministic):
    x = masks.global_sliding_window(200, 5, 30, batch=1)
    _check(rng, 1, 200, 200, 6, 1, d, "bfloat16", False, x, deterministic, softcap=30.0)
    x = masks.causal_document([50, 90, 60], batch=1)
    _check(rng, 1, 200, 200, 6, 1, d, "float16", True, x, deterministic, softcap=20.0)


@requires_gpu
@requires_torch
@pytest.mark.usefixtures("_fm_kernels")
@pytest.mark.parametrize("d", [40, 80, 192])
def test_gpu_other_head_dims(rng, d):
    x = masks.document([50, 70, 9], batch=1)
    _check(rng, 1, 129, 129, 2, 2, d, "float16", False, x)
    _check(rng, 1, 129, 129, 2, 2, d, "bfloat16", False, x, deterministic=True)


@requires_gpu
@requires_torch
@pytest.mark.usefixtures("_fm_kernels")
@pytest.mark.parametrize("sq, sk", [(100, 333), (333, 100), (1, 300), (1023, 1024)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_gpu_unequal_lengths(rng, sq, sk, deterministic):
    x = np.random.default_rng(5).integers(0, sq + 1, (2, 1, sk, 1)).astype(np.int32)  # LTS per key
    _check(rng, 2, sq, sk, 4, 2, 128, "bfloat16", True, x, deterministic)
    y = _random_intervals(np.random.default_rng(6), 2, 1, sq, sk, 4, False)
    _check(rng, 2, sq, sk, 4, 2, 64, "bfloat16", False, y, deterministic)


def _documents_per_head(causal, n, seqlen, docs, masked):
    """Indices (1, len(docs), seqlen, n) of one document mask per query head (docs[h]: its
    document lengths), with the keys in `masked` (a slice) masked for every row in every head:
    causal n = 1 causal_document, n = 2 causal_blockwise; otherwise n = 2 document, n = 4 the same
    as LTS, LTE = seqlen, UTS = 0, UTE."""
    heads = []
    for lens in docs:
        if causal:
            x = (masks.causal_document if n == 1 else masks.causal_blockwise)(lens)
        else:
            x = masks.document(lens)
            if n == 4:
                x = np.concatenate([x[..., :1], np.full_like(x[..., :1], seqlen), np.zeros_like(x[..., :1]),
                                    x[..., 1:]], axis=-1)
        x = x.copy()
        x[0, 0, masked, 0] = 0  # LTS = 0: rows from 0 on
        if n > 1 and (causal or n == 4):
            x[0, 0, masked, 1] = seqlen  # LTE
        heads.append(x)
    return np.ascontiguousarray(np.concatenate(heads, axis=1), dtype=np.int32)


@requires_gpu
@requires_torch
@pytest.mark.usefixtures("_fm_kernels")
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d", [64, 96, 128])  # 96: the mma.sync kernels (bwd/dkdv.cu.j2)
@pytest.mark.parametrize("causal, n", [(True, 1), (True, 2), (False, 2), (False, 4)])
def test_gpu_walk_ends_differ_per_head(rng, causal, n, d, deterministic):
    """Key blocks whose query rows are masked for every key over long stretches at either end of
    their range, other stretches in each of the two query heads of a KV head (a step is left out
    only where both heads' tiles are), and key blocks masked for every row (their dK and dV are
    0): 1,500 tokens, many query blocks."""
    docs = [[300, 700, 500], [900, 100, 500], [1500], [200] * 7 + [100]]
    x = _documents_per_head(causal, n, 1500, docs, slice(512, 896))
    grads = _check(rng, 1, 1500, 1500, 4, 2, d, "bfloat16", causal, x, deterministic)
    for g in grads[1:]:
        assert bool((g[:, 512:896] == 0).all())


@requires_gpu
@requires_torch
@pytest.mark.usefixtures("_fm_kernels")
@pytest.mark.parametrize("d", [64, 128, 96])
@pytest.mark.parametrize("causal, n", [(True, 2), (False, 4)])
def test_gpu_deterministic_is_bitwise_repeatable(rng, d, causal, n):
    import torch
    from test_gpu_backward import torch_inputs
    x = _random_intervals(np.random.default_rng(1), 2, 2, 1023, 1023, n, causal)
    first = _check(rng, 2, 1023, 1023, 4, 2, d, "bfloat16", causal, x, deterministic=True)
    q, k, v, dout = torch_inputs(rng, 2, 1023, 1023, 4, 2, d, "bfloat16")
    xt = torch.from_numpy(x).cuda()
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, startend_row_indices=xt)
    once = [g.clone() for g in backward.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                            deterministic=True, startend_row_indices=xt)]
    for _ in range(10):
        again = backward.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True,
                                            startend_row_indices=xt)
        for a, b in zip(again, once):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert all(g.shape == o.shape for g, o in zip(first, once))


@requires_gpu
@requires_torch
@pytest.mark.usefixtures("_fm_kernels")
def test_gpu_torch_autograd(rng):
    """cuflash.torch.attention with the mask: q.grad, k.grad, v.grad against the reference; the
    indices get no gradient and are not copied."""
    import torch
    import cuflash.torch as ct
    from cuflash.reference import max_abs_err
    from test_gpu_backward import to_np, torch_inputs
    q, k, v, dout = torch_inputs(rng, 2, 300, 300, 4, 2, 128, "bfloat16")
    for t in (q, k, v):
        t.requires_grad_()
    x = masks.share_question([[100, 50, 50], [60, 40]], batch=2)
    xt = torch.from_numpy(x).cuda()
    ct.attention(q, k, v, causal=True, startend_row_indices=xt).backward(dout)
    args = [to_np(t) for t in (dout, q, k, v)]
    ref64 = reference.attention_backward(*args, causal=True, startend_row_indices=x)
    same = reference.attention_backward(*args, causal=True, startend_row_indices=x, precision="same")
    for g, r, s in zip((q.grad, k.grad, v.grad), ref64, same):
        assert max_abs_err(to_np(g), r) <= 2 * max_abs_err(s, r) + 2e-4


# ---------------------------------------------------------------------------------------------
# The planned FlashMask bwd_ws variants against their other walks (bwd_ws.flipped): fm_window (the
# same steps found 32 at a time, or one at a time) and, at d = 128 with atomic dQ, dq_t (80-query
# steps with dQ^T, or 64-query steps)

TRIALS = [("fm_window",), ("dq_t",), ("fm_window", "dq_t")]


_trial = importlib.import_module("cuflash.kernels.bwd_ws").flipped


# Every FlashMask bwd_ws variant of sm_90 in bf16 with each trial's fields flipped, where they apply
TRIED = list(dict.fromkeys(
    t for v in importlib.import_module("cuflash.kernels.bwd_ws").variants(90)
    if getattr(v, "flashmask", 0) and v.dtype == "bf16" for m in TRIALS if (t := _trial(v, m)) != v))


@pytest.mark.parametrize("v", TRIED, ids=lambda v: v.name)
def test_trial_variant_compiles_clean(compiled, v):
    assert_warp_specialised_clean(compiled[v], v)


def test_trial_variants_are_named_checked_and_rendered():
    from cuflash.kernels import bwd_ws
    both = TRIED + [v for v in bwd_ws.variants(90) if getattr(v, "flashmask", 0) and v.dtype == "bf16"]
    assert {(v.head_dim, v.flashmask, v.dq, v.dq_ordered, v.fm_window, v.dq_t) for v in both} >= {
        (64, 1, True, True, True, False), (64, 1, True, True, False, False), (128, 2, True, False, True, False),
        (128, 4, False, False, True, False), (128, 4, False, False, False, False), (256, 1, True, False, True, False),
        (256, 1, True, False, False, False), (128, 1, True, False, False, True), (128, 2, True, False, True, True),
        (128, 2, True, False, False, False)}
    for v in both:
        assert (f"_fm{v.flashmask}w_" in v.name) == v.fm_window and ("_dqT_m80" in v.name) == v.dq_t
        src, planned = codegen.render(v), codegen.render(dataclasses.replace(v, fm_window=False))
        assert ("fm_next(walk, fm_part)" in src and "next_step(" not in src) == v.fm_window
        assert "next_step(" in planned and "fm_walk" not in planned and "fm_part" not in planned
    with pytest.raises(ValueError, match="fm_window"):
        bwd_ws.BwdWsVariant(kind="bwd_ws_dkdv_dq", head_dim=128, dtype="bf16", arch=90, fm_window=True)


@pytest.fixture
def _trial_plan():
    """Yields a switch of bwd_ws.planned to the trial fields flipped (None: as planned) for FlashMask
    backwards, and drops every plan and prepared launch made meanwhile when the test ends, however
    it ends."""
    from cuflash.kernels import bwd_ws
    from cuflash.plan import forget_plans
    planned = bwd_ws.planned

    def switch(fields):
        bwd_ws.planned = (lambda *a, **k: (lambda v: _trial(v, fields) if v.flashmask else v)(planned(*a, **k))) \
            if fields else planned
        forget_plans()
    try:
        yield switch
    finally:
        bwd_ws.planned = planned
        forget_plans()


@requires_sm90
@requires_torch
@pytest.mark.parametrize("mods", TRIALS, ids=lambda m: "+".join(m))
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("name, causal, x", [b for b in _builders(1100) if b[0] in (
    "causal_document", "share_question", "global_sliding_window", "prefix_lm_document", "random_eviction",
    "causal_blockwise", "qk_sparse")], ids=lambda a: a if isinstance(a, str) else None)
def test_gpu_trial_variant_matches_the_planned_one(rng, _trial_plan, name, causal, x, d, deterministic, mods):
    """The planned variant against its other walk on the same inputs (8 query heads on one KV head:
    walks of up to 8 x 9, 8 x 14 or 8 x 18 steps, so several windows): both within flash-attn's rule of the
    reference; with the same steps (dq_t as planned) dK and dV bitwise equal, dQ too where its adds
    are ordered (atomic adds may come in another order)."""
    import torch
    problem = Problem(1, 1100, 1100, 8, 1, d, "bf16", causal=causal, deterministic=deterministic,
                      flashmask=x.shape[-1], flashmask_heads=1)
    planned = make_backward_plan(problem, DeviceFacts(132, 90)).launches[1].variant
    assert planned.family == "bwd_ws" and planned.flashmask == x.shape[-1], planned
    if _trial(planned, mods) == planned:
        pytest.skip(f"{'+'.join(mods)} does not apply to {planned.name}")
    if len(mods) > 1 and any(_trial(planned, mods) == _trial(planned, (m,)) for m in mods):
        pytest.skip(f"{'+'.join(mods)} flips only one field of {planned.name}: run by that field's case")
    seed = int(rng.integers(1 << 30))
    grads = {}
    for trial in (None, mods):
        _trial_plan(trial)
        main = make_backward_plan(problem, DeviceFacts(132, 90)).launches[1].variant
        assert main == (_trial(planned, mods) if trial else planned), main
        grads[trial is not None] = _check(np.random.default_rng(seed), 1, 1100, 1100, 8, 1, d, "bfloat16", causal,
                                          x, deterministic)
    if _trial(planned, mods).dq_t == planned.dq_t:  # the same steps
        for i, g in enumerate(("dq", "dk", "dv")):
            if i or deterministic:
                assert torch.equal(grads[False][i].view(torch.int16), grads[True][i].view(torch.int16)), g
