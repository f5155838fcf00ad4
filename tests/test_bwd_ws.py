"""The warp-specialised Hopper backward (cuflash/kernels/bwd_ws.py, templates/bwd_ws/): offline
checks (every variant compiles for sm_90a with no spills, no stack, no warning, a launch register
count that setmaxnreg can split), the plans that run it and the ones that say why not, and GPU
checks (skipped without an sm_90 GPU): gradients against the float64 reference with the rule of
tests/test_gpu_backward.py, dK and dV bitwise equal to the wgmma kernel's in deterministic mode
(the same products in the same order), bitwise repeatability, GQA, long sequences, strided
operands."""
import importlib
from dataclasses import replace

import numpy as np
import pytest

from conftest import (assert_compiled_clean, assert_warp_specialised_clean, bf16_or_alone, module_compiled, requires_sm90,
                      requires_torch)
from cuflash.kernels import all_variants, bwd_ws
from cuflash.kernels.bwd import MASKS, BwdRowVariant
from cuflash.kernels.bwd_ws import BwdWsVariant

# (softcap and ALiBi: tests/test_bwd_ws_mods.py; packed sequences: tests/test_bwd_ws_varlen.py)
DENSE = [v for v in bwd_ws.variants(90) if not v.varlen]
VARIANTS = [v for v in DENSE if v.family == "bwd_ws" and not (v.flashmask or v.softcap or v.alibi or v.lpt)
            and v.dq_groups == 1]
GROUPED = [v for v in DENSE if v.dq_groups > 1]  # deterministic without a mask in runs of key blocks, prep, convert
# (compiled: the dK/dV kernels in bf16, whose fp16 twins differ only in conversions; every prep and convert)
GROUPED_MAIN = [v for v in GROUPED if v.family == "bwd_ws" and v.dtype == "bf16"]
GROUPED_ROWS = [v for v in GROUPED if v.family != "bwd_ws"]
LPT = [v for v in DENSE if v.family == "bwd_ws" and v.lpt]  # causal blocks longest first (d = 128; d = 64 GQA)
FLASHMASK = [v for v in DENSE if v.family == "bwd_ws" and v.flashmask]
CONVERTS = [v for v in DENSE if v.family != "bwd_ws" and not v.swizzled and v.kind == "bwd_convert"
            and v.dq_groups == 1]  # (dq_t's: DQ_T_CONVERTS)
# Every way of adding dQ, each field given (planned() sets dq_early at d = 64, dq_writer at 128),
# and the ordered writer (planned deterministic at d = 128 only)
# (the atomic ones keep the variant's rotate: rotated as planned, and not rotated from the
# deterministic variants)
FLAGS = [dict(dq_early=e, dq_writer=w, dq_ordered=False, dq_t=False) for w in (False, True) for e in (False, True)] + [
    dict(dq_early=False, dq_writer=True, dq_ordered=True, rotate=False, dq_t=False, lpt=False)]
BULK = list(dict.fromkeys(x for v in VARIANTS if v.dq and not v.split_d for f in FLAGS
                          if (x := replace(v, **f)) not in VARIANTS))  # the unplanned ones (d = 256 has atomics only)
# 80-query steps with dQ^T (planned at d = 128), with and without dq_early and rotated walks, and
# deterministic (the ordered writer: a semaphore per 80-row step); not dq_early without rotation
# with a window (NVRTC 13.5 spills 4 B there; deterministic with a window keeps 64-query steps)
DQ_T_FLAGS = [dict(dq_t=True, dq_early=e, rotate=r) for e in (True, False) for r in (True, False)]
DQ_T = [v for v in [replace(bwd_ws.planned(128, dt, c, loc, det), **f) for dt in ("bf16", "fp16")
                    for c, loc in MASKS for det in (False, True) for f in DQ_T_FLAGS if not (det and f["rotate"])]
        if not (v.local and v.dq_early and not v.rotate)]
DQ_T_CONVERTS = [bwd_ws.convert(128, dt, dq_t=True) for dt in ("bf16", "fp16")]
plan_mod = importlib.import_module("cuflash.plan")  # the module (cuflash.plan is the function)
DT = {"bfloat16": "bf16", "float16": "fp16"}


def test_variants():
    """d 64, 128 and 256, fp16/bf16, full/causal/local, atomic and deterministic dQ: 36 kernels,
    sm_90 only, all in all_variants (warmup and the CI's sample draw from it), within 227 KB; at
    d = 256 64 x 64 steps with the head dim split between the groups."""
    assert len({v.name for v in VARIANTS}) == len(VARIANTS) == 36
    assert bwd_ws.variants(80) == [] and len(bwd_ws.variants(90, mods=False)) == 24 + 6 + 2 + 2 + 24 + 4
    assert set(DQ_T_CONVERTS) <= set(bwd_ws.variants(90, mods=False))
    assert set(VARIANTS + CONVERTS + FLASHMASK) <= set(all_variants(90)) and len(FLASHMASK) == 48
    # FlashMask: atomic dQ; deterministic, causal at d = 64 and 128 the dQ writer's ordered adds,
    # elsewhere no dQ (the deterministic dQ kernel follows)
    assert all(v == bwd_ws.planned(v.head_dim, v.dtype, v.causal, False, v.dq_ordered or not v.dq, 90, v.flashmask)
               for v in FLASHMASK)
    assert sum(v.dq_ordered for v in FLASHMASK) == 8 and sum(not v.dq for v in FLASHMASK) == 16
    assert all(v.dq_writer and v.causal for v in FLASHMASK if v.dq_ordered)
    assert all(v.split_d or not v.causal for v in FLASHMASK if not v.dq)
    # the windowed walk but at d = 256; 80-query dQ^T steps at d = 128 with atomic dQ
    assert all(v.fm_window == (v.head_dim != 256) for v in FLASHMASK)
    assert all(v.dq_t == (v.head_dim == 128 and v.dq_writer and not v.dq_ordered) for v in FLASHMASK)
    assert sum(v.dq_t for v in FLASHMASK) == 8  # d = 128, two dtypes, four masks
    assert [(v.kind, v.tiled, v.head_dim) for v in CONVERTS] == [("bwd_convert", True, d) for d in (64, 128, 256)
                                                                 for _ in range(2)]
    for v in VARIANTS:
        assert v.smem_bytes <= 227 * 1024 and v.threads == 384
        if v.head_dim == 256:
            assert v.split_d and (v.block_m, v.block_n) == (64, 64) and not (v.dq_early or v.dq_writer)
        else:  # (d = 128 without deterministic mode: 80-query steps, dq_t)
            assert not v.split_d and v.block_n == 128 and v.block_m * v.head_dim == (80 * 128 if v.dq_t else 128 * 64)
            assert v.dq_t == (v.head_dim == 128 and not (v.dq_ordered and v.local))


def test_lpt_planned_from_2k_keys():
    """Key blocks longest first: planned causal from LPT_MIN_SEQLEN_K keys on dense batches with
    atomic dQ, at d = 128 without softcap (4 B spill) and at d = 64 with LPT_MIN_GROUPS_D64 query
    heads per KV head (softcap or ALiBi included), listed for warmup and CI in both dtypes, and in
    plans; the variant otherwise the plain-order one, and refused with ordered dQ, FlashMask or
    packed sequences."""
    import cuflash
    from cuflash import codegen
    lo, g = bwd_ws.LPT_MIN_SEQLEN_K, bwd_ws.LPT_MIN_GROUPS_D64
    assert sorted((v.head_dim, v.dtype, v.softcap, v.alibi) for v in LPT) == sorted(
        (d, dt, c, a) for d in (64, 128) for dt in ("bf16", "fp16")
        for c, a in ((False, False), (True, False), (False, True)) if not (c and d == 128))
    for v in LPT:
        assert v.causal and v.rotate and v.dq_writer and "_lpt_" in v.name
        mods = dict(softcap=v.softcap, alibi=v.alibi)
        assert v == bwd_ws.planned(v.head_dim, v.dtype, True, False, False, 90, **mods, seqlen_k=lo, ngroups=g)
        assert replace(v, lpt=False) == bwd_ws.planned(v.head_dim, v.dtype, True, False, False, 90, **mods)
        assert "kLptBytes" in codegen.render(v) and "kLptBytes" not in codegen.render(replace(v, lpt=False))
    for d, sk, groups, want in ((128, 0, 1, False), (128, lo - 1, 1, False), (128, lo, 1, True),
                                (128, 1 << 20, 1, True), (64, lo, g - 1, False), (64, lo, g, True),
                                (64, lo - 1, g, False), (256, lo, 8, False)):
        assert bwd_ws.planned(d, "bf16", True, False, False, seqlen_k=sk, ngroups=groups).lpt == want, (d, sk, groups)
    # the plan passes its key count and group count
    for d, h, hk, sk, want in ((128, 8, 2, lo - 1, False), (128, 8, 2, lo, True), (64, 8, 4, lo, False),
                               (64, 8, 2, lo, True)):
        p = cuflash.plan((1, sk, h, d), (1, sk, hk, d), (1, sk, hk, d), causal=True, num_sms=132, arch=90,
                         backward=True)
        assert p.launches[1].variant.lpt == want and ("longest first" in p.reason) == want, (d, h, hk, sk, p)
    for args, kw in (((128, "bf16", True, False, True), {}), ((128, "bf16", False, False, False), {}),
                     ((128, "bf16", False, True, False), {}), ((64, "bf16", True, False, True), {}),
                     ((128, "bf16", True, False, False), dict(softcap=True)),
                     ((128, "bf16", True, False, False), dict(varlen=True)),
                     ((64, "bf16", True, False, False), dict(varlen=True)),
                     ((128, "bf16", True, False, False), dict(flashmask=1))):
        assert not bwd_ws.planned(*args, seqlen_k=lo, ngroups=g, **kw).lpt, (args, kw)
    v = LPT[0]
    for bad in (dict(dq_ordered=True, rotate=False), dict(causal=False), dict(varlen=True)):
        with pytest.raises(ValueError, match="lpt must be a bool"):
            replace(v, **bad)


def test_planned_walks_rotate_with_atomic_dq_only():
    """Atomic dQ without FlashMask is planned with rotated walks (walk_step in the producer, the
    dQ writer and the consumers' loop), but for the 80-query steps without a mask; deterministic
    and FlashMask variants walk from step 0."""
    from cuflash import codegen
    for v in VARIANTS + FLASHMASK:
        plain_dq_t = v.dq_t and not (v.causal or v.local)
        assert v.rotate == (not v.dq_ordered and not v.flashmask and not plain_dq_t), v.name
        assert ("_rot_" in v.name) == v.rotate, v.name
        assert (codegen.render(v).count("walk_step(") == 3) == v.rotate, v.name


@pytest.mark.parametrize("bad, match", [
    (dict(arch=80), "arch must be 90"), (dict(head_dim=96), "head_dim must be one of"),
    (dict(kind="bwd_dq"), "kind must be"), (dict(causal=True, local=True), "not both"),
    (dict(dtype="fp32"), "dtype must be"),
    (dict(kind="bwd_ws_dkdv", dq_early=True), "dq_early"), (dict(kind="bwd_ws_dkdv", dq_writer=True), "dq_writer"),
    (dict(dq_writer=1), "dq_writer must be a bool"),
    (dict(head_dim=256, dq_early=True), "at head_dim 256"), (dict(head_dim=256, dq_writer=True), "at head_dim 256"),
    (dict(dq_ordered=True), "needs dq_writer=True"), (dict(flashmask=1), "flashmask must be"),
    (dict(flashmask=4, causal=True), "flashmask must be"), (dict(flashmask=2, kind="bwd_ws_dkdv", local=True), "flashmask must be"),
    (dict(head_dim=256, flashmask=2, dq_ordered=True), "flashmask must be"),
    (dict(flashmask=2, dq_writer=True, dq_ordered=True), "flashmask must be"), (dict(kind="bwd_ws_dkdv", dq_ordered=True), "dq_ordered"),
    (dict(rotate=True, dq_writer=True, dq_ordered=True), "rotate must be"), (dict(rotate=True, flashmask=2), "rotate must be"),
    (dict(kind="bwd_ws_dkdv", rotate=True), "rotate must be"), (dict(rotate=1), "rotate must be a bool"),
    (dict(dq_t=True), "dq_t must be"),
    (dict(dq_t=True, dq_writer=True, dq_ordered=True, causal=True, flashmask=1), "dq_t must be"),
    (dict(dq_t=True, dq_writer=True, softcap=True), "dq_t must be"),
    (dict(dq_t=True, dq_writer=True, head_dim=64), "dq_t must be"), (dict(dq_t=1, dq_writer=True), "dq_t must be"),
    (dict(dq_t=True, dq_writer=True, dq_ordered=True, varlen=True), "dq_t must be"),
    (dict(dq_groups=2, dq_writer=True), "dq_groups must be"), (dict(dq_groups=3, dq_writer=True, dq_ordered=True), "dq_groups"),
    (dict(dq_groups=2, dq_writer=True, dq_ordered=True, causal=True), "dq_groups must be"),
    (dict(dq_groups=4, dq_writer=True, dq_ordered=True, varlen=True), "dq_groups must be"),
    (dict(dq_groups=2.0, dq_writer=True, dq_ordered=True), "dq_groups must be"),
    (dict(dq_groups=True, dq_writer=True, dq_ordered=True), "dq_groups must be"),
])
def test_bad_variant(bad, match):
    kw = dict(kind="bwd_ws_dkdv_dq", head_dim=128, dtype="bf16", arch=90) | bad
    with pytest.raises(ValueError, match=match):
        BwdWsVariant(**kw)


@pytest.mark.parametrize("kw", [dict(kind="bwd_prep"), dict(head_dim=96), dict(tiled=1)])
def test_bad_tiled_convert(kw):
    """The tiled bwd_convert reads 64 x 64 pieces: a convert at a head dim that is a multiple of 64."""
    with pytest.raises(ValueError, match="tiled must be a bool"):
        BwdRowVariant(**(dict(kind="bwd_convert", head_dim=128, dtype="bf16", arch=90, tiled=True) | kw))


@pytest.mark.parametrize("kw", [dict(kind="bwd_convert"), dict(kind="bwd_convert", tiled=True, varlen=True),
                                dict(kind="bwd_prep", dq_groups=3), dict(kind="bwd_prep", dq_groups=8),
                                dict(kind="bwd_prep", dq_groups=2.0)])
def test_bad_grouped_row_kernel(kw):
    """Runs of key blocks (dq_groups) in dense batches only, read by the tiled or swizzled convert."""
    with pytest.raises(ValueError, match="dq_groups must be"):
        BwdRowVariant(**(dict(head_dim=128, dtype="bf16", arch=90, dq_groups=2) | kw))


@pytest.mark.parametrize("kw", [dict(tiled=True), dict(kind="bwd_prep"), dict(swizzled=1)])
def test_bad_swizzled_convert(kw):
    with pytest.raises(ValueError, match="swizzled must be a bool"):
        BwdRowVariant(**(dict(kind="bwd_convert", head_dim=128, dtype="bf16", arch=90, swizzled=True) | kw))


def test_dq_t_variant():
    """80-query steps and rows padded to whole steps; the shared memory fits sm_90's
    227 KB; its convert reads swizzled rows; planned at d = 128 unless deterministic."""
    from cuflash import backward
    for v in DQ_T:
        assert (v.block_m, v.block_n, v.row_pad) == (80, 128, 80) and not v.overlap and "_dqT_m80n128" in v.name, v
        assert v.smem_bytes <= 227 * 1024
    assert all(v.row_pad == 128 for v in VARIANTS if not v.dq_t) and all(v.swizzled for v in DQ_T_CONVERTS)
    assert backward.stats_rows(2, 1000, 8, pad=80) == (1040, 2 * 8 * 1040)
    assert _plan(128, causal=False).launches[1].variant.dq_t and _plan(128, deterministic=True).launches[1].variant.dq_t
    assert not _plan(128, causal=False, deterministic=True, window_size=(100, 0)).launches[1].variant.dq_t
    assert "Steps of 80 query rows" in _plan(128).reason and "Steps of 80" not in _plan(64).reason


# Compiled here: every prep and convert; of the dK/dV kernels, all with CUFLASH_TEST_ALL_VARIANTS=1,
# else the bf16 ones and the fp16 ones without a bf16 twin (conftest.bf16_or_alone).
COMPILED_MAIN = bf16_or_alone(VARIANTS + BULK + FLASHMASK + DQ_T + LPT + GROUPED_MAIN)
COMPILED_ROWS = CONVERTS + DQ_T_CONVERTS + GROUPED_ROWS


@pytest.fixture(scope="module")
def compiled(compile_variants):
    return module_compiled(compile_variants, COMPILED_MAIN + COMPILED_ROWS)


@pytest.mark.parametrize("v", COMPILED_ROWS, ids=lambda v: v.name)
def test_tiled_convert_compiles(compiled, v):
    assert_compiled_clean(compiled[v], v)


@pytest.mark.parametrize("v", COMPILED_MAIN, ids=lambda v: v.name)
def test_compiles_as_designed(compiled, v):
    """No spills or stack; __launch_bounds__(384, 1) caps the launch at 168 registers, which
    setmaxnreg splits into 24 per producer thread and 240 per consumer thread; ptxas neither
    ignored setmaxnreg (C7508) nor serialized a wgmma; no static shared memory."""
    assert_warp_specialised_clean(compiled[v], v)


def _plan(d=128, causal=True, arch=90, **kw):
    import cuflash
    return cuflash.plan((2, 1000, 8, d), (2, 1000, 2, d), (2, 1000, 2, d), causal=causal, num_sms=132,
                        arch=arch, backward=True, **kw)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_planned_on_sm90(d, deterministic):
    p = _plan(d, deterministic=deterministic)
    main = p.launches[1].variant
    ordered = deterministic  # deterministic dQ by the ordered writer (d = 256: ordered atomics)
    assert main.family == "bwd_ws" and main.dq and main.causal
    assert main.dq_ordered == ordered and main.dq_writer == main.dq_early == (d != 256)
    assert [la.variant.kind for la in p.launches[::2]] == ["bwd_prep", "bwd_dq" if deterministic and not ordered
                                                          else "bwd_convert"]
    # reads the fragment-ordered accumulator, or dq_t's swizzled rows
    assert getattr(p.launches[2].variant, "tiled", False) == (main.dq and not main.dq_t)
    assert p.launches[2].variant.swizzled == main.dq_t == (d == 128)
    assert p.launches[1].grid == ((16 if d == 256 else 8), 2, 2) and p.launches[1].threads == 384
    assert "warp-specialised kernel (bwd_ws" in p.reason
    assert ("each on half the head dim" in p.reason) == (d == 256)
    assert ("a semaphore lets the key blocks add in turn, from the last key block" in p.reason) == ordered
    rows = 2 * 8 * (1040 if main.dq_t else 1024)  # LSE, D and (except with bwd_dq) the dQ accumulator, semaphores
    assert p.workspace_bytes == 4 * rows * (2 + (0 if deterministic and not ordered else d)) + (4 * rows // 64) * ordered


@pytest.mark.parametrize("d", [64, 128, 256])
def test_dq_groups_planned(d):
    """Deterministic without a mask on dense batches of at most DQ_GROUPS_MAX_KEYS keys: the
    ordered adds in runs of key blocks, each with its own accumulator and semaphores (the
    workspace holds them), bwd_prep zeroing their semaphores and no accumulator, bwd_convert
    summing them; one run with a mask, packed sequences, atomic dQ or more keys."""
    import cuflash
    from cuflash.backward import workspace_floats
    p = _plan(d, causal=False, deterministic=True)  # 1000 keys: 8 key blocks (d = 256: 16)
    prep, main, conv = (la.variant for la in p.launches)
    g = 4 if d == 256 else 2
    assert main.dq_ordered and main.dq_groups == prep.dq_groups == conv.dq_groups == g
    assert f"_g{g}_" in main.name and f"_g{g}_" in prep.name and f"_g{g}_" in conv.name
    assert f"in {g} runs of consecutive blocks" in p.reason
    # runs of at most SPREAD_RUN blocks (here 4) take the spread order, where the head dim has it
    assert ("take the spread order" in p.reason) == (bwd_ws.SPREAD_RUN[d] >= 4)
    rows = 2 * 8 * (1040 if main.dq_t else 1024)
    assert p.workspace_bytes == 4 * rows * (2 + g * d) + 4 * (rows // 64) * g == 4 * workspace_floats(p)
    for kw in (dict(causal=True), dict(window_size=(100, 100)), dict(deterministic=False)):
        q = _plan(d, **(dict(causal=False, deterministic=True) | kw))
        assert all(la.variant.dq_groups == 1 for la in q.launches), kw
        assert "runs of consecutive blocks" not in q.reason
    shape = lambda n: (1, n, 8, d)
    keys = bwd_ws.DQ_GROUPS_PLANNED[d][1]
    for n, runs in ((keys, g), (keys + 1, 1)):
        x = cuflash.plan(shape(1000), (1, n, 2, d), (1, n, 2, d), num_sms=132, arch=90, backward=True,
                         deterministic=True)
        assert x.launches[1].variant.dq_ordered and x.launches[1].variant.dq_groups == runs
        y = cuflash.plan((1, n, 8, d), (1, 1000, 2, d), (1, 1000, 2, d), num_sms=132, arch=90, backward=True,
                         deterministic=True)  # as many queries: each run's accumulator is as large as dQ
        assert y.launches[1].variant.dq_groups == runs
    assert [bwd_ws.dq_groups(64, n) for n in (1, 128, 129, 512, 8192, 8193)] == [1, 1, 2, 2, 2, 1]
    assert [bwd_ws.dq_groups(256, n) for n in (64, 128, 193, 4096, 4097)] == [1, 2, 4, 4, 1]
    assert bwd_ws.dq_groups(128, 1000, 8192) == 2 and bwd_ws.dq_groups(128, 1000, 8193) == 1
    for n in (0, 1):  # no key (planned as before: one run) or one key block
        x = cuflash.plan((2, 100, 8, d), (2, n, 2, d), (2, n, 2, d), num_sms=132, arch=90, backward=True,
                         deterministic=True)
        assert x.launches[1].variant.dq_groups == 1
    # every count of runs a plan can pick is in variants() (warmed up, compiled in CI)
    names = {v.name for v in all_variants(90)}
    for n in range(1, bwd_ws.DQ_GROUPS_PLANNED[d][1] + 1, 37):
        x = cuflash.plan((2, 100, 8, d), (2, n, 2, d), (2, n, 2, d), num_sms=132, arch=90, backward=True,
                         deterministic=True)
        assert {la.variant.name for la in x.launches} <= names, n


def test_dq_groups_render():
    """The first block to add into a query block in a run's order stores its dQ (the writer's bulk
    copy; at d = 256 the consumers' stores), the others add; every role walks from the block's
    start; runs of at most SPREAD_RUN blocks take the spread order where the head dim has it; one
    run renders none of it."""
    from cuflash import codegen
    for v in GROUPED_MAIN:
        src = codegen.render(v)
        assert src.count("walk_step(") == (4 if v.split_d else 3) and "kInfoRun" in src, v.name  # (d = 256: the turn warp)
        # (d = 256 has no dQ writer: its consumers store; the writer's code is there but never runs)
        assert ("store_frag(dq_run_acc" in src) == v.split_d and (v.split_d or "if (dq_store(it)) bulk_store_f32(dqa" in src), v.name
        assert ("kSpreadRun = " in src) == (bwd_ws.SPREAD_RUN[v.head_dim] > 0), v.name
    for v in VARIANTS:
        src = codegen.render(v)
        assert "dq_run_acc" not in src and "bulk_store_f32(dqa" not in src and "kInfoRun]" not in src, v.name


@pytest.mark.parametrize("kw, why", [
    (dict(softcap=30.0, startend_row_indices=(2, 1, 1000, 1)), "no softcap with FlashMask"),
    (dict(d=96), "head dims 64, 128 and 256 only"),
    (dict(d=120), "head dims 64, 128 and 256 only"), (dict(d=192), "head dims 64, 128 and 256 only"),
])
def test_not_planned_says_why(kw, why):
    p = _plan(**kw)
    assert p.launches[1].variant.family == "bwd"
    if p.launches[1].variant.mma == "wgmma":
        assert why in p.reason
    assert _plan(arch=80).launches[1].variant.family == "bwd"


def test_turned_off(monkeypatch):
    monkeypatch.setattr(plan_mod, "BWD_WS", False)
    plan_mod.forget_plans()
    try:
        p = _plan()
        assert p.launches[1].variant.mma == "wgmma" and "CUFLASH_BWD_WS=0" in p.reason
    finally:
        monkeypatch.undo()
        plan_mod.forget_plans()


# ---------------------------------------------------------------------------------------------
# On an sm_90 GPU



def _inputs(rng, b, sq, sk, h, hk, d, dtype):
    import torch
    mk = lambda *s: torch.from_numpy(rng.standard_normal(s, dtype=np.float32)).to("cuda", getattr(torch, dtype))
    return mk(b, sq, h, d), mk(b, sk, hk, d), mk(b, sk, hk, d), mk(b, sq, h, d)


def _backward(q, k, v, dout, *, ws=True, deterministic=False, flags=None, **mods):
    """Forward, then the backward into NaN-filled gradients, with the warp-specialised dK/dV
    kernel (checked to be the one planned; ``flags``: BwdWsVariant fields such as dq_bulk) or,
    ws=False, the wgmma kernel. The plans and what was derived from them are forgotten on the way
    in and out, so that the call runs the kernel the switches select."""
    import torch
    import cuflash
    from cuflash.backward import attention_backward
    saved, planned = plan_mod.BWD_WS, bwd_ws.planned
    plan_mod.BWD_WS = ws
    if flags:
        plan_mod.bwd_ws.planned = lambda *a: replace(planned(*a), **flags)
    plan_mod.forget_plans()
    try:
        out, lse = cuflash.attention(q, k, v, return_lse=True, **mods)
        p = cuflash.plan(q, k, v, backward=True, deterministic=deterministic, **mods)
        assert (p.launches[1].variant.family == "bwd_ws") == ws, p
        for f, x in (flags or {}).items():
            assert getattr(p.launches[1].variant, f) == x, p
        bufs = dict(dq=torch.full_like(q, float("nan")), dk=torch.full_like(k, float("nan")),
                    dv=torch.full_like(v, float("nan")))
        return attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **mods, **bufs)
    finally:
        plan_mod.BWD_WS, plan_mod.bwd_ws.planned = saved, planned
        plan_mod.forget_plans()


def _check(grads, q, k, v, dout, **mods):
    from test_gpu_backward import check_grads
    causal = mods.pop("causal", False)
    check_grads(grads, dout, q, k, v, causal, **mods)


CASES = [  # (b, sq, sk, h, hk)
    (2, 113, 203, 4, 4), (2, 203, 113, 4, 2), (1, 1, 239, 2, 2), (1, 239, 1, 2, 1), (1, 640, 640, 8, 1),
    (2, 256, 384, 6, 3),
]


@requires_sm90
@requires_torch
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("mask", ["full", "causal", "local"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_gpu_against_reference(rng, case, d, dtype, mask, deterministic):
    b, sq, sk, h, hk = case
    q, k, v, dout = _inputs(rng, b, sq, sk, h, hk, d, dtype)
    mods = dict(causal=mask == "causal", window_size=(37, 5) if mask == "local" else (-1, -1))
    grads = _backward(q, k, v, dout, deterministic=deterministic, **mods)
    _check(grads, q, k, v, dout, **mods)


@requires_sm90
@requires_torch
@pytest.mark.parametrize("mask", ["full", "causal", "local"])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_deterministic_bitwise_equals_wgmma_kernel(rng, d, mask):
    """Deterministic mode: the same products in the same order as bwd/dkdv_wgmma.cu.j2, so dK and
    dV are bitwise the wgmma kernel's; dQ (added in order by the dQ writer, where the wgmma plan
    has the bwd_dq kernel) within the reference rule's scale of it."""
    import torch
    q, k, v, dout = _inputs(rng, 2, 1000, 1100, 8, 2, d, "bfloat16")
    mods = dict(causal=mask == "causal", window_size=(300, 0) if mask == "local" else (-1, -1))
    a = _backward(q, k, v, dout, deterministic=True, flags=dict(dq_t=False, dq_groups=1), **mods)  # (the wgmma kernel's steps)
    w = _backward(q, k, v, dout, ws=False, deterministic=True, **mods)
    assert torch.equal(a[1], w[1]) and torch.equal(a[2], w[2])
    assert torch.isfinite(a[0]).all()
    assert (a[0].float() - w[0].float()).abs().max().item() <= 1e-2 * w[0].float().abs().max().item()


@requires_sm90
@requires_torch
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_long_against_wgmma_kernel(rng, d, causal):
    """4k x 4k with GQA 16/2: many steps through both stages and both dS^T tiles; the atomic dQ
    against the kernel planned without bwd_ws (wgmma; mma.sync at d = 256) within the reference
    rule's scale."""
    import torch
    q, k, v, dout = _inputs(rng, 1, 4096, 4096, 16, 2, d, "bfloat16")
    a = _backward(q, k, v, dout, causal=causal)
    w = _backward(q, k, v, dout, ws=False, causal=causal)
    for name, x, y in zip(("dq", "dk", "dv"), a, w):
        assert torch.isfinite(x).all(), name
        err = (x.float() - y.float()).abs().max().item()
        assert err <= 2e-2 * y.float().abs().max().item() + 1e-3, (name, err)


@requires_sm90
@requires_torch
@pytest.mark.parametrize("mask", ["full", "causal", "local"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_deterministic_repeats_bitwise(rng, d, mask):
    """50 repeats bitwise equal: at d = 128 the dQ writer's adds come in the semaphores' order
    (key blocks from the first without a mask, from the last with one); elsewhere bwd_dq writes dQ."""
    import torch
    q, k, v, dout = _inputs(rng, 2, 777, 901, 8, 2, d, "bfloat16")
    mods = dict(causal=mask == "causal", window_size=(200, 50) if mask == "local" else (-1, -1))
    first = _backward(q, k, v, dout, deterministic=True, **mods)
    for _ in range(50):
        again = _backward(q, k, v, dout, deterministic=True, **mods)
        assert all(torch.equal(x, y) for x, y in zip(first, again))


@requires_sm90
@requires_torch
@pytest.mark.parametrize("groups", [2, 4])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_dq_groups(rng, d, groups):
    """Deterministic dQ in runs of key blocks, uneven ones (11 key blocks, d = 256: 22), with GQA
    and padding rows (700 queries): against the float64 reference, against one run within the
    rule's scale (the walks differ, so dK and dV sum in another order too), 3 repeats bitwise."""
    import torch
    q, k, v, dout = _inputs(rng, 2, 700, 1400, 4, 2, d, "bfloat16")
    grads = _backward(q, k, v, dout, deterministic=True, flags=dict(dq_groups=groups))
    _check(grads, q, k, v, dout)
    one = _backward(q, k, v, dout, deterministic=True, flags=dict(dq_groups=1))
    for name, x, y in zip(("dq", "dk", "dv"), grads, one):
        err = (x.float() - y.float()).abs().max().item()
        assert err <= 1e-2 * y.float().abs().max().item() + 1e-6, (name, err)
    for _ in range(3):
        again = _backward(q, k, v, dout, deterministic=True, flags=dict(dq_groups=groups))
        assert all(torch.equal(x, y) for x, y in zip(grads, again))


@requires_sm90
@requires_torch
@pytest.mark.parametrize("mask", ["full", "causal", "local"])
@pytest.mark.parametrize("d", [128])
def test_gpu_ordered_dq_many_blocks(rng, d, mask):
    """More key blocks than SMs over several heads (1 x 16k keys, 128 blocks per KV head, 4
    query heads each): the ordered dQ against the atomic one within the reference rule's scale,
    dK and dV bitwise equal, and 5 repeats bitwise equal."""
    import torch
    q, k, v, dout = _inputs(rng, 1, 2048, 16384, 8, 2, d, "bfloat16")
    mods = dict(causal=mask == "causal", window_size=(3000, 100) if mask == "local" else (-1, -1))
    steps = dict(dq_t=mask != "local")  # (as planned deterministic: 80-query steps but with a window)
    first = _backward(q, k, v, dout, deterministic=True, flags=steps, **mods)
    atomic = _backward(q, k, v, dout, flags=dict(rotate=False, **steps), **mods)  # the same walk and steps
    assert torch.equal(first[1], atomic[1]) and torch.equal(first[2], atomic[2])
    err = (first[0].float() - atomic[0].float()).abs().max().item()
    assert err <= 1e-2 * atomic[0].float().abs().max().item() + 1e-6, err
    for _ in range(5):
        again = _backward(q, k, v, dout, deterministic=True, **mods)
        assert all(torch.equal(x, y) for x, y in zip(first, again))


@requires_sm90
@requires_torch
@pytest.mark.parametrize("mask", ["full", "causal", "local"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("case", [(2, 300, 700, 8, 2), (1, 1500, 1500, 4, 4), (3, 1, 520, 4, 1)], ids=str)
def test_gpu_rotated_walks(rng, case, d, mask):
    """Atomic dQ walks each key block's steps from a different one (rotate; planned but for d = 128
    without a mask): the same gradients as the walk from the first step, within the fp32
    reordering of the sums, and the reference check."""
    import torch
    b, sq, sk, h, hk = case
    q, k, v, dout = _inputs(rng, b, sq, sk, h, hk, d, "bfloat16")
    mods = dict(causal=mask == "causal", window_size=(250, 30) if mask == "local" else (-1, -1))
    main = cuflash_plan(q, k, v, **mods).launches[1].variant  # (one query row: planned without a mask)
    assert main.rotate == (not main.dq_t or main.causal or main.local)
    rot = _backward(q, k, v, dout, flags=dict(rotate=True), **mods)
    plain = _backward(q, k, v, dout, flags=dict(rotate=False), **mods)
    for name, x, y in zip(("dq", "dk", "dv"), rot, plain):
        assert torch.isfinite(x).all(), name
        err = (x.float() - y.float()).abs().max().item()
        assert err <= 1e-2 * y.float().abs().max().item() + 1e-6, (name, err)
    if sq * sk <= 300 * 700:
        _check(rot, q, k, v, dout, **mods)


def cuflash_plan(q, k, v, **mods):
    import cuflash
    return cuflash.plan(q, k, v, backward=True, **mods)


@requires_sm90
@requires_torch
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_strided_operands(rng, d):
    """q, k, v sliced from one packed (b, s, 3, h, d) tensor: row strides of 3 h d elements."""
    import torch
    qkv = torch.from_numpy(rng.standard_normal((2, 300, 3, 4, d), dtype=np.float32)).to("cuda", torch.float16)
    q, k, v = qkv.unbind(2)
    dout = torch.from_numpy(rng.standard_normal((2, 300, 4, d), dtype=np.float32)).to("cuda", torch.float16)
    grads = _backward(q, k, v, dout, causal=True)
    _check(grads, q, k, v, dout, causal=True)


@requires_sm90
@requires_torch
@pytest.mark.parametrize("mask", ["full", "causal", "local"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("case", [(2, 113, 203, 4, 4), (1, 640, 640, 8, 1), (1, 2048, 2048, 16, 2)], ids=str)
@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: "+".join(k for k, x in f.items() if x) or "atomic")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_dq_variants(rng, dtype, flags, case, d, mask):
    """dQ added with 16-byte atomics into the fragment-ordered accumulator, by a producer warp from
    a staged tile (dq_writer; in a fixed order: dq_ordered), dQ's product issued before dK's
    (dq_early): against the reference, and dK, dV bitwise the planned variant's (only the dQ adds
    differ)."""
    import torch
    b, sq, sk, h, hk = case
    q, k, v, dout = _inputs(rng, b, sq, sk, h, hk, d, dtype)
    mods = dict(causal=mask == "causal", window_size=(300, 7) if mask == "local" else (-1, -1))
    grads = _backward(q, k, v, dout, flags=flags, **mods)
    # the same walk: the flags' rotate, or the planned variant's (not rotated with 80-query steps
    # without a mask)
    rotate = flags.get("rotate", bwd_ws.planned(d, DT[dtype], mods["causal"], mask == "local", False).rotate)
    plain = _backward(q, k, v, dout, flags=dict(rotate=rotate, dq_t=False), **mods)
    assert torch.equal(grads[1], plain[1]) and torch.equal(grads[2], plain[2])
    if sq * sk <= 640 * 640:
        _check(grads, q, k, v, dout, **mods)
    else:
        err = (grads[0].float() - plain[0].float()).abs().max().item()
        assert err <= 1e-2 * plain[0].float().abs().max().item(), err


@requires_sm90
@requires_torch
@pytest.mark.parametrize("flags", DQ_T_FLAGS, ids=lambda f: "+".join(k for k, x in f.items() if x))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", [(2, 113, 203, 4, 4), (2, 203, 113, 4, 2), (1, 1, 239, 2, 2), (1, 239, 1, 2, 1),
                                  (1, 640, 640, 8, 1), (2, 80, 128, 2, 2), (1, 161, 300, 6, 3)], ids=str)
@pytest.mark.parametrize("mask", ["full", "causal", "local"])
def test_gpu_dq_t(rng, case, dtype, flags, mask):
    """80-query steps with dQ^T = K^T dS^T (dq_t): gradients against the float64 reference,
    including rows past the last whole step and keys past the last block, with every mask."""
    b, sq, sk, h, hk = case
    q, k, v, dout = _inputs(rng, b, sq, sk, h, hk, 128, dtype)
    mods = dict(causal=mask == "causal", window_size=(97, 13) if mask == "local" else (-1, -1))
    grads = _backward(q, k, v, dout, flags=flags, **mods)
    _check(grads, q, k, v, dout, **mods)


@requires_sm90
@requires_torch
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d, mod", [(64, "none"), (64, "alibi"), (64, "softcap"), (128, "none"), (128, "alibi")])
@pytest.mark.parametrize("case", [c for c in CASES if c[1] > 1] + [(1, 8192, 8192, 5, 5), (3, 2048, 2100, 6, 2)],
                         ids=str)
def test_gpu_lpt(rng, case, d, mod, dtype):
    """Causal key blocks launched longest first (lpt) against the plain launch order: dK and dV
    bitwise (each key block sums its own), dQ within rounding (its adds come in another order);
    the small cases against the float64 reference too. 8192 queries of 5 heads (8 MB of Q, dO and
    dQ rows per pair): a section of 4 (batch, head) pairs and a last of 1; 3 x 2 pairs of 3 query
    heads each: 5 and 1 (at d = 64 the sections are twice as wide). (One query row is not causal:
    it sees every key.) Softcap at d = 64 only (the d = 128 variant is not planned: it spills)."""
    import torch
    b, sq, sk, h, hk = case
    q, k, v, dout = _inputs(rng, b, sq, sk, h, hk, d, dtype)
    mods = dict(causal=True)
    if mod == "alibi":
        mods["alibi_slopes"] = torch.from_numpy(rng.uniform(0.01, 0.5, (b, h)).astype(np.float32)).cuda()
    if mod == "softcap":
        mods["softcap"] = 20.0
    got = _backward(q, k, v, dout, flags=dict(lpt=True), **mods)
    ref = _backward(q, k, v, dout, flags=dict(lpt=False), **mods)
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])
    assert torch.isfinite(got[0]).all()
    err = (got[0].float() - ref[0].float()).abs().max().item()
    assert err <= 1e-2 * ref[0].float().abs().max().item(), err
    if sq * sk <= 640 * 640:
        _check(got, q, k, v, dout, **mods)


@requires_sm90
@requires_torch
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_dq_t_long(rng, causal):
    """dq_t at 4096 queries (52 steps of 80, 4160 rows per head) and GQA: dK and dV within
    rounding of the 64-query kernel's (the products are summed in another order), dQ too."""
    import torch
    q, k, v, dout = _inputs(rng, 2, 4096, 4096, 16, 4, 128, "bfloat16")
    got = _backward(q, k, v, dout, flags=dict(dq_t=True), causal=causal)
    ref = _backward(q, k, v, dout, flags=dict(dq_t=False), causal=causal)
    for x, y in zip(got, ref):
        assert torch.isfinite(x).all()
        err = (x.float() - y.float()).abs().max().item()
        assert err <= 1e-2 * y.float().abs().max().item(), err


@requires_sm90
@requires_torch
@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("mask", ["full", "causal", "local"])
def test_gpu_dq_t_deterministic(rng, mask, early):
    """dq_t with the ordered dQ writer (deterministic; a semaphore per 80-row step): against the
    reference, and bitwise repeatable over more key blocks than SMs."""
    import torch
    mods = dict(causal=mask == "causal", window_size=(97, 13) if mask == "local" else (-1, -1))
    flags = dict(dq_t=True, dq_early=early)
    for case in ((2, 203, 113, 4, 2), (1, 161, 300, 6, 3)):
        q, k, v, dout = _inputs(rng, *case, 128, "bfloat16")
        _check(_backward(q, k, v, dout, deterministic=True, flags=flags, **mods), q, k, v, dout, **mods)
    q, k, v, dout = _inputs(rng, 1, 2000, 16384, 8, 2, 128, "bfloat16")
    mods["window_size"] = (3000, 100) if mask == "local" else (-1, -1)
    first = _backward(q, k, v, dout, deterministic=True, flags=flags, **mods)
    for _ in range(10):
        again = _backward(q, k, v, dout, deterministic=True, flags=flags, **mods)
        assert all(torch.equal(x, y) for x, y in zip(first, again))
