"""FlashMask in the forward kernels: the prep kernel and the flashmask variants compile clean
offline (NVRTC, no GPU), plans route FlashMask to the warp-specialised kernel on sm_90 (else the
standard one) with the prep launch,
attention rejects the options it cannot be combined with before any launch, and (on a GPU) the
outputs and LSE match the float64 reference with flash-attn's rule for every builder in
cuflash.masks."""
import dataclasses
import importlib

import numpy as np
import pytest

import cuflash
from cuflash import codegen, masks
from cuflash.kernels import covering_sample
from cuflash.kernels.flashmask import FlashMaskPrepVariant
from cuflash.kernels.fwd import FLASHMASK_PARAMS, PARAMS, FwdVariant, flashmask_tile, flashmask_variants
from conftest import assert_compiled_clean, assert_warp_specialised_clean, requires_gpu, requires_sm90, requires_torch

PREP = [FlashMaskPrepVariant(columns=n, arch=a) for a in (80, 90) for n in (1, 2, 4)]
# The covering sample's FlashMask variants: each n on both archs (mma.sync and wgmma on sm_90).
SAMPLE = [v for v in covering_sample() if getattr(v, "flashmask", 0)]


def test_sample_has_every_n_on_both_archs():
    got = {(v.arch, v.flashmask, getattr(v, "mma", "wgmma")) for v in SAMPLE}
    for arch in (80, 90):
        assert {n for a, n, _ in got if a == arch} == {1, 2, 4}
    assert any(m == "wgmma" for *_, m in got)


@pytest.mark.parametrize("v", PREP + SAMPLE, ids=lambda v: v.name)
def test_flashmask_variant_compiles_without_spills(compiled, v):
    assert_compiled_clean(compiled[v], v)


def test_flashmask_variants_are_named_and_checked():
    vs = flashmask_variants(90)
    assert len({v.name for v in vs}) == len(vs) and all(f"_fm{v.flashmask}" in v.name for v in vs)
    assert all(v.params is FLASHMASK_PARAMS for v in vs)
    plain = FwdVariant(kind="fwd", head_dim=64, dtype="bf16", block_m=128, block_n=64, warps=4, stages=1, arch=80)
    assert plain.params is PARAMS and "_fm" not in plain.name and "kFlashMask" not in codegen.render(plain)
    src = codegen.render(vs[0])
    assert "kFlashMask" in src and "fm_blocks" in src
    base = dict(kind="fwd", head_dim=64, dtype="bf16", block_m=128, block_n=64, warps=4, stages=1, arch=80)
    for bad in (dict(flashmask=4, causal=True), dict(flashmask=1), dict(flashmask=3),
                dict(flashmask=2, kind="fwd_split", block_m=64), dict(flashmask=2, kv="cache"),
                dict(flashmask=2, alibi=True), dict(flashmask=2, local=True)):
        with pytest.raises(ValueError):
            FwdVariant(**{**base, **bad})
    # the FlashMask fields sit before the trailing data pointers
    assert FLASHMASK_PARAMS.names[-3:] == PARAMS.names[-3:]
    assert FLASHMASK_PARAMS.names[:len(PARAMS.names) - 3] == PARAMS.names[:-3]


# ---------------------------------------------------------------------------------------------
# Plans

def _plan(q=(2, 512, 8, 64), hk=2, arch=90, **kw):
    k = (q[0], q[1], hk, q[3])
    return cuflash.plan(q, k, k, num_sms=132, arch=arch, **kw)


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("causal, x", [(True, masks.causal_document([100, 300, 112], batch=2)),
                                       (True, masks.causal_blockwise([200, 200, 112], batch=2)),
                                       (False, masks.document([100, 412], batch=2)),
                                       (False, masks.global_sliding_window(512, 16, 64, batch=2))])
def test_plan_routes_flashmask(arch, causal, x):
    """sm_90: the warp-specialised forward; sm_80: the standard kernel; the prep kernel reduces the
    indices per block of the forward's keys, in a workspace with room for either kernel's blocks."""
    p = _plan(arch=arch, causal=causal, startend_row_indices=x)
    v, prep = (l.variant for l in p.launches)
    n = x.shape[-1]
    assert v.kind == ("fwd_ws" if arch == 90 else "fwd") and v.flashmask == n and v.causal == causal
    assert p.num_splits == 1 and prep.family == "flashmask" and prep.columns == n
    assert p.launches[1].grid == (-(-512 // v.block_n), 1, 2)
    bn_std = flashmask_tile(64, True, arch)[1]
    assert p.workspace_bytes == 4 * 2 * max(-(-512 // b) for b in (v.block_n, bn_std)) * 2 * n
    assert "startend_row_indices (FlashMask" in p.reason
    assert ("warp-specialised forward (fwd_ws" in p.reason) == (arch == 90)
    assert ("the standard forward kernel (never split" in p.reason) == (arch == 80)
    assert "skipped" in p.reason and "not run FlashMask" not in p.reason


def test_fwd_ws_flashmask_walk_is_published_by_the_producer():
    """The producer's warp works out the walk (a ballot over 32 blocks' bounds) and writes each
    visited block, with its class and whether it is the walk's last (the next one is found
    first), into its stage's slot before the K barrier's arrival; the consumers read the slots
    (and a -1 end for an empty walk) instead of reading bounds to walk themselves."""
    import re
    from cuflash import codegen
    from cuflash.kernels import fwd_ws
    for v in (v for v in fwd_ws.variants(90) if v.flashmask and v.dtype == "bf16"):
        src = codegen.render(v)
        calls = re.findall(r"\bvisit\(([^()]*)\)", src)
        assert calls == ["blocks.hi - 1, cls", "n - 1, cls_after"], (v.name, calls)  # the producer's loop only
        assert "kv_slot[s] = 4 * n + 2 * (after < blocks.lo) + (cls == kFmMasked);" in src
        assert "if (i == i_first) {" in src and "kv_slot[i % kStages] = -1;" in src
        assert src.count("peek(0)") == 3 and "return kv_slot[stage(i)];" in src  # non-overlap loop, overlap test and first
        assert "fm_class(n) == kFmMasked" not in src  # the consumers' class comes from the slot


def test_fwd_ws_flashmask_bounds_are_staged_in_shared_memory():
    """The producer's warp copies a partly masked block's bounds into the block's stage (each lane
    arrives on the K barrier after its copies); the consumers read them there, not from global memory,
    and release the K stage only after the softmax that reads them. Shared memory holds one
    block's bounds per stage."""
    from cuflash import codegen
    from cuflash.kernels import fwd_ws
    for v in (v for v in fwd_ws.variants(90) if v.flashmask and v.dtype == "bf16"):
        src = codegen.render(v)
        kernel = src.split('extern "C"')[1]
        assert kernel.count("flashmask_stage<kBlockN, kFlashMask>(") == 1, v.name
        assert "if (cls == kFmMasked)" in kernel and "cp.async.wait_all;" in src
        assert "mbar_init(bar_k_full(s), 1 + 32);" in kernel
        assert "apply_flashmask_staged<kNT, kFlashMask, kIsCausal>(" in kernel and "apply_flashmask<" not in kernel
        softmax = kernel.split("auto softmax = ")[1].split("\n    };")[0]
        assert softmax.rstrip().endswith("mbar_arrive(bar_k_empty(s));"), v.name
        # only there (persistent blocks: and at an empty walk's end, a stage used with no copy)
        assert kernel.count("mbar_arrive(bar_k_empty(") == 1 + v.persistent, v.name
        assert v.persistent == ("wait_full(bar_v_full(s), phase(0));\n      mbar_arrive(bar_k_empty(s));" in kernel)
        plain = dataclasses.replace(v, flashmask=0)
        assert v.smem_bytes == plain.smem_bytes + v.stages * v.block_n * v.flashmask * 4 <= fwd_ws.MAX_SMEM
    for v in (v for v in fwd_ws.variants(90) if not v.flashmask and v.dtype == "bf16"):
        kernel = codegen.render(v).split('extern "C"')[1]
        softmax = kernel.split("auto softmax = ")[1].split("\n    };")[0]
        assert [x.strip() for x in softmax.splitlines() if x.strip()][1] == "mbar_arrive(bar_k_empty(s));", v.name


def test_plan_flashmask_softcap_runs_the_warp_specialised_kernel():
    p = _plan(arch=90, causal=True, softcap=5.0, startend_row_indices=(2, 1, 512, 1))
    v = p.launches[0].variant
    assert v.kind == "fwd_ws" and v.softcap and v.flashmask == 1 and v.block_m == 128
    assert "softcapped" in p.reason and "warp-specialised" in p.reason


@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_plan_flashmask_persistent_blocks_at_d128(softcap):
    """sm_90 at d = 128: persistent blocks, at most one per SM (fewer with fewer query tiles), and the
    reason says so; d = 64: one block per query tile."""
    x = masks.causal_document([100, 300, 112], batch=2)
    for seqlen, grid in ((512, (64, 1, 1)), (8192, (132, 1, 1))):  # 4 x 8 x 2 tiles; 64 x 8 x 2
        p = _plan(q=(2, seqlen, 8, 128), causal=True, softcap=softcap,
                  startend_row_indices=np.tile(x, (1, 1, seqlen // 512, 1)))
        v = p.launches[0].variant
        assert v.kind == "fwd_ws" and v.persistent and v.flashmask == 1 and p.launches[0].grid == grid
        assert "persistent blocks (at most one per SM) take from an atomic counter" in p.reason
    p = _plan(q=(2, 512, 8, 64), causal=True, softcap=softcap, startend_row_indices=x)
    v = p.launches[0].variant
    assert not v.persistent and p.launches[0].grid == (4, 8, 2) and "the grid runs every" in p.reason


def test_plan_flashmask_never_splits_or_packs():
    # decode-like shapes would split or pack GQA heads as rows without FlashMask
    k = (1, 4096, 2, 128)
    p = cuflash.plan((1, 1, 8, 128), k, k, num_sms=132, arch=90, causal=True,
                     startend_row_indices=np.full((1, 1, 4096, 1), 1, np.int32))
    assert p.num_splits == 1 and not p.pack_gqa and p.launches[0].variant.flashmask == 1
    assert p.launches[0].variant.causal  # the columns' meaning follows the caller's causal
    assert p.launches[0].variant.block_m > 16  # not the decode tile


def test_plans_cache_per_n():
    a = _plan(causal=True, startend_row_indices=(2, 1, 512, 1))
    b = _plan(causal=True, startend_row_indices=(2, 1, 512, 2))
    c = _plan(causal=True)
    assert a.launches[0].variant.flashmask == 1 and b.launches[0].variant.flashmask == 2
    assert c.launches[0].variant.family != "flashmask" and not getattr(c.launches[0].variant, "flashmask", 0)


def test_plan_heads_of_the_indices_size_the_prep_grid():
    p = _plan(causal=True, startend_row_indices=(2, 8, 512, 1))
    assert p.launches[1].grid[1:] == (8, 2)


# ---------------------------------------------------------------------------------------------
# Validation: rejected before any launch, the message naming both arguments

@pytest.mark.parametrize("kw, what", [(dict(window_size=(8, 0)), "window_size"),
                                      (dict(alibi_slopes=np.ones(4, np.float32)), "alibi_slopes"),
                                      (dict(num_splits=2), "num_splits")])
def test_attention_rejects_combinations(kw, what):
    q = np.full((2, 8, 4, 16), np.nan, np.float16)
    k = np.zeros((2, 8, 2, 16), np.float16)
    out = np.full_like(q, 7)
    with pytest.raises(ValueError, match=f"startend_row_indices.*{what}"):
        cuflash.attention(q, k, k, causal=True, out=out, startend_row_indices=masks.causal(8, batch=2), **kw)
    assert (out == 7).all()


@pytest.mark.parametrize("kw, what", [(dict(alibi_slopes=True), "alibi_slopes"), (dict(num_splits=3), "num_splits"),
                                      (dict(window_size=(8, 0)), "window_size")])
def test_plan_rejects_combinations(kw, what):
    with pytest.raises(ValueError, match=f"startend_row_indices.*{what}"):
        _plan(causal=True, startend_row_indices=(2, 1, 512, 1), **kw)


@pytest.mark.parametrize("x, exc, msg", [
    (np.zeros((2, 1, 8, 4), np.int32), ValueError, "last dim of startend_row_indices"),
    (np.zeros((2, 3, 8, 1), np.int32), ValueError, "must have shape"),
    (np.zeros((2, 1, 8, 1), np.int64), TypeError, "must be int32"),
    (np.full((2, 1, 8, 1), 9, np.int32), ValueError, r"must lie in \[0, seqlen_q\]"),
])
def test_attention_checks_the_indices(x, exc, msg):
    q = np.zeros((2, 8, 4, 16), np.float16)
    k = np.zeros((2, 8, 2, 16), np.float16)
    with pytest.raises(exc, match=msg):
        cuflash.attention(q, k, k, causal=True, startend_row_indices=x)


def test_planner_problem_rejects_other_sources():
    from cuflash.plan import DeviceFacts, Problem, make_plan
    for kw in (dict(kv="cache"), dict(varlen=True), dict(alibi=True), dict(num_splits=2), dict(window=(4, 0))):
        with pytest.raises(ValueError, match="startend_row_indices"):
            make_plan(Problem(1, 64, 64, 2, 2, 64, "bf16", causal=True, flashmask=1, flashmask_heads=1, **kw),
                      DeviceFacts(132, 90))


# ---------------------------------------------------------------------------------------------
# GPU: outputs and LSE against the float64 reference (flash-attn's rule), outputs poisoned

def _builders(s):
    """(name, causal, indices of batch 1) for every builder in cuflash.masks at seqlen s."""
    return [
        ("full", False, masks.full(s)), ("causal", True, masks.causal(s)),
        ("sliding_window", True, masks.sliding_window(s, 37)),
        ("document", False, masks.document([s // 3, s - s // 3 - 5, 5])),
        ("causal_document", True, masks.causal_document([s // 4, s // 2, s - s // 4 - s // 2])),
        ("share_question", True, masks.share_question([[s // 4, s // 8, s // 8], [s // 4, s - 2 * (s // 4) - 2 * (s // 8)]])),
        ("prefix_lm_causal", False, masks.prefix_lm_causal(s, s // 3)),
        ("prefix_lm_document", False, masks.prefix_lm_document([(s // 2, s // 5), (s - s // 2, 7)])),
        ("global_sliding_window", False, masks.global_sliding_window(s, 9, 40)),
        ("causal_blockwise", True, masks.causal_blockwise([s // 3, s // 3, s - 2 * (s // 3)])),
        ("qk_sparse", True, masks.qk_sparse(s, [(s // 8, s // 8), (s // 2, s // 16)])),
        ("random_eviction", True, masks.random_eviction(s, s // 4, seed=3)),
    ]


def _run(rng, b, s, h, hk, d, dtype, causal, x, **kw):
    import torch
    from cuflash.reference import check_close
    from test_gpu_forward import to_np, torch_inputs
    q, k, v = torch_inputs(rng, b, s, s, h, hk, d, dtype)
    xt = torch.from_numpy(np.ascontiguousarray(x)).cuda()
    out = torch.full_like(q, float("nan"))
    res, lse = cuflash.attention(q, k, v, causal=causal, out=out, return_lse=True, startend_row_indices=xt, **kw)
    assert res is out
    qn, kn, vn = to_np(q), to_np(k), to_np(v)
    ok, err, bound = check_close(to_np(out), qn, kn, vn, causal=causal, startend_row_indices=x, **kw)
    assert ok, f"max error {err:.3g} exceeds bound {bound:.3g}"
    _, lse_ref = cuflash.reference.attention(qn, kn, vn, causal=causal, return_lse=True, startend_row_indices=x,
                                             **kw)
    got = lse.cpu().numpy()
    assert np.array_equal(np.isinf(got), np.isinf(lse_ref))
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(got[fin], lse_ref[fin], rtol=1e-3, atol=1e-3)


@requires_gpu
@requires_torch
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("name, causal, x", _builders(300), ids=lambda a: a if isinstance(a, str) else None)
def test_gpu_builders(rng, name, causal, x, d):
    _run(rng, 2, 300, 4, 2, d, "bfloat16", causal, np.concatenate([x, x]))


@requires_sm90
@requires_torch
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("name, causal, x", [b for b in _builders(1500) if b[0] in (
    "causal_document", "share_question", "global_sliding_window", "qk_sparse", "prefix_lm_document",
    "random_eviction")], ids=lambda a: a if isinstance(a, str) else None)
def test_gpu_fwd_ws_longer(rng, name, causal, x, d, dtype):
    """The warp-specialised forward (sm_90) over many K/V blocks, some never loaded: GQA, both
    dtypes, every head dim it has."""
    kernel = _plan(q=(1, 1500, 8, d), hk=2, causal=causal, startend_row_indices=x).launches[0].variant
    assert kernel.kind == "fwd_ws" and kernel.flashmask == x.shape[-1]
    _run(rng, 1, 1500, 8, 2, d, dtype, causal, x)


@requires_gpu
@requires_torch
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("name, causal, x", [b for b in _builders(700) if b[0] in (
    "causal_document", "share_question", "global_sliding_window", "random_eviction")],
    ids=lambda a: a if isinstance(a, str) else None)
def test_gpu_strided_indices_are_read_in_place(rng, name, causal, x, d):
    """Indices whose bound columns are outermost in memory (a (batch, heads, n, seqlen_k) tensor
    seen transposed) give bitwise the output of their contiguous copy: the kernels read them
    through their strides (on sm_90 the forward's producer copies a block's bounds element by
    element into shared memory)."""
    import torch
    from test_gpu_forward import torch_inputs
    q, k, v = torch_inputs(rng, 2, 700, 700, 4, 2, d, "bfloat16")
    xt = torch.from_numpy(np.ascontiguousarray(np.concatenate([x, x]))).cuda()
    strided = xt.transpose(2, 3).contiguous().transpose(2, 3)
    assert torch.equal(strided, xt) and (x.shape[-1] == 1 or not strided.is_contiguous())
    want = cuflash.attention(q, k, v, causal=causal, startend_row_indices=xt)
    got = cuflash.attention(q, k, v, causal=causal, startend_row_indices=strided)
    assert torch.equal(got, want)


@requires_gpu
@requires_torch
@pytest.mark.parametrize("heads", [1, 2, 8])  # broadcast, per KV head (GQA), per query head
def test_gpu_gqa_and_per_head_indices(rng, heads):
    s = 257
    x = masks.random_eviction(s, 40, seed=1, batch=2, nheads=heads)
    _run(rng, 2, s, 8, 2, 96, "float16", True, x)


@requires_gpu
@requires_torch
def test_gpu_softcap_and_mqa(rng):
    x = masks.global_sliding_window(200, 5, 30, batch=1)
    _run(rng, 1, 200, 6, 1, 256, "bfloat16", False, x, softcap=30.0)


@requires_gpu
@requires_torch
@pytest.mark.parametrize("d", [40, 192])
def test_gpu_odd_head_dims(rng, d):
    x = masks.document([50, 70, 9], batch=1)
    _run(rng, 1, 129, 2, 2, d, "float16", False, x)


@requires_gpu
@requires_torch
@pytest.mark.parametrize("sq, sk", [(100, 333), (333, 100), (1, 300)])
def test_gpu_unequal_lengths(rng, sq, sk):
    import torch
    from cuflash.reference import check_close
    from test_gpu_forward import to_np, torch_inputs
    q, k, v = torch_inputs(rng, 2, sq, sk, 4, 2, 64, "bfloat16")
    x = np.random.default_rng(5).integers(0, sq + 1, (2, 1, sk, 1)).astype(np.int32)  # LTS per key
    out = torch.full_like(q, float("nan"))
    cuflash.attention(q, k, v, causal=True, out=out, startend_row_indices=torch.from_numpy(x).cuda())
    ok, err, bound = check_close(to_np(out), to_np(q), to_np(k), to_np(v), causal=True, startend_row_indices=x)
    assert ok, f"max error {err:.3g} exceeds bound {bound:.3g}"


# ---------------------------------------------------------------------------------------------
# The kernel's rule on the host: prep's per-block min/max, flashmask_class and apply_flashmask
# (templates/flashmask/prep.cu.j2, templates/common/flashmask.cuh) written out in NumPy give the
# dense mask of the intervals exactly, tile by tile

def _kernel_mask(x, sq, causal, bm, bn):
    """The interval mask (batch, heads, sq, sk) as the kernel applies it: a skipped tile is all
    masked, a plain one all visible, a masked one element by element."""
    b, h, sk, n = x.shape
    x = x.astype(np.int64)
    out = np.zeros((b, h, sq, sk), bool)
    i = np.arange(sq)[:, None]

    def element(cols):  # mask of rows i against columns cols (.., k, n)
        a = [cols[..., c][:, :, None, :] for c in range(n)]
        if causal:
            return (i >= a[0]) & (True if n == 1 else i < a[1])
        if n == 2:
            return (i >= a[0]) | (i < a[1])
        return ((i >= a[0]) & (i < a[1])) | ((i >= a[2]) & (i < a[3]))

    dense = element(x)
    for nb in range(-(-sk // bn)):
        blk = x[:, :, nb * bn:(nb + 1) * bn]
        mn, mx = blk.min(axis=2), blk.max(axis=2)  # (b, h, n)
        for m0 in range(0, sq, bm):
            r0, r1 = m0, min(m0 + bm, sq)
            full = np.zeros((b, h), bool)
            part = np.zeros((b, h), bool)

            def interval(s_min, s_max, e_min, e_max):
                nonlocal full, part
                full = full | ((r0 >= s_max) & (r1 <= e_min))
                part = part | ((r0 < e_max) & (r1 > s_min))
            if causal and n == 1:
                interval(mn[..., 0], mx[..., 0], sq, sq)
            elif causal or n == 4:
                interval(mn[..., 0], mx[..., 0], mn[..., 1], mx[..., 1])
                if n == 4:
                    interval(mn[..., 2], mx[..., 2], mn[..., 3], mx[..., 3])
            else:
                interval(mn[..., 0], mx[..., 0], sq, sq)
                interval(0, 0, mn[..., 1], mx[..., 1])
            tile = (slice(None), slice(None), slice(r0, r1), slice(nb * bn, (nb + 1) * bn))
            elem = dense[tile]
            out[tile] = np.where(full[:, :, None, None], True, np.where(part[:, :, None, None], elem, False))
    return out


@pytest.mark.parametrize("bm, bn", [(128, 64), (64, 32), (128, 128), (16, 64)])
@pytest.mark.parametrize("name, causal, x", _builders(300) + [("random", True, np.random.default_rng(2).integers(
    0, 301, (1, 1, 300, 1)).astype(np.int32))], ids=lambda a: a if isinstance(a, str) else None)
def test_kernel_rule_is_exact(name, causal, x, bm, bn):
    want = masks.to_dense(x, 300, False) if not causal else None
    if causal:  # the intervals alone (the causal mask is apply_mask's)
        want = np.zeros((1, 1, 300, 300), bool)
        for s, e in masks.intervals(x, 300, True):
            i = np.arange(300)[:, None]
            want |= (i >= s[:, :, None, :]) & (i < e[:, :, None, :])
    np.testing.assert_array_equal(_kernel_mask(x, 300, causal, bm, bn), want)


# ---------------------------------------------------------------------------------------------
# Persistent FlashMask forward blocks (planned at d = 128, on trial at d = 64): FwdWsVariant(persistent=True)
# with FlashMask at d = 64 and 128 on 128-row tiles, each block walking query tiles in the one-tile
# grid's order, an empty walk's end taking a stage

def _persistent(v):
    return dataclasses.replace(v, persistent=True)


PERSISTENT = [_persistent(v) for v in importlib.import_module("cuflash.kernels.fwd_ws").variants(90)
              if v.flashmask and v.dtype == "bf16" and v.block_m == 128 and v.head_dim <= 128]


@pytest.mark.parametrize("v", PERSISTENT, ids=lambda v: v.name)
def test_persistent_flashmask_variant_compiles_clean(compiled, v):
    assert_warp_specialised_clean(compiled[v], v)


def test_persistent_flashmask_variants_are_checked_and_rendered():
    from cuflash.kernels import fwd_ws
    assert len(PERSISTENT) == 14 and all(v.own_o and v.producer_regs == fwd_ws.GATHER_PRODUCER_REGS for v in PERSISTENT)
    for v in PERSISTENT:
        src = codegen.render(v)
        assert "auto tile_at" in src and "kv0 += max(i_end, 1)" in src and "if (!kOverlap || i_end == 0)" in src
    base = fwd_ws.FwdWsVariant(head_dim=128, dtype="bf16", arch=90, causal=True, flashmask=1, persistent=True,
                               overlap=True, pingpong=True)
    for bad in (dict(head_dim=256, block_n=80), dict(head_dim=64, block_m=192, pingpong=False), dict(overlap=False),
                dict(stages=3)):
        with pytest.raises(ValueError, match="persistent only at head dims up to 128"):
            dataclasses.replace(base, **bad)


@requires_sm90
@requires_torch
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("name, causal, x", [b for b in _builders(1100) if b[0] in (
    "causal_document", "share_question", "global_sliding_window", "prefix_lm_document", "random_eviction",
    "causal_blockwise", "qk_sparse", "document")] + [
    ("empty_tiles", True, np.full((1, 1, 1100, 1), 500, dtype=np.int32))],  # rows from 500 see no key
    ids=lambda a: a if isinstance(a, str) else None)
def test_gpu_persistent_flashmask_matches_one_tile_blocks(rng, monkeypatch, name, causal, x, d):
    """Persistent FlashMask blocks, with one Q tile and with two (double_q), against one-tile
    blocks on the same inputs, all on 128-row tiles (d = 64 without causal plans 192): O and LSE
    bitwise equal (the same walks in the same order), with more query tiles than SMs (each block takes several tiles, through the tile
    counter) and as one block per tile (no counter: a first call inside a CUDA graph capture takes
    that path; here launch.fire's fused=False); query tiles whose walk is empty (empty_tiles)."""
    import torch
    from cuflash import launch
    from cuflash.kernels import fwd_ws
    from cuflash.plan import forget_plans
    from test_gpu_forward import torch_inputs
    b, h, hk = 3, 48, 6  # 9 query tiles x 48 heads x 3 = 1296 tiles
    q, k, v = torch_inputs(rng, b, 1100, 1100, h, hk, d, "bfloat16")
    xb = np.ascontiguousarray(np.concatenate([x] * b))
    xt = torch.from_numpy(xb).cuda()
    got = {}
    planned = fwd_ws.planned
    modes = ("one-tile blocks", "persistent", "persistent, one block per tile", "two Q tiles",
             "two Q tiles, one block per tile")
    for mode in modes:
        persistent, double_q = mode != "one-tile blocks", mode.startswith("two Q")
        monkeypatch.setattr(fwd_ws, "planned", lambda *a, **kw: (lambda w: dataclasses.replace(
            w, block_m=128, pingpong=True, persistent=persistent, double_q=double_q) if w.flashmask else w)(
            planned(*a, **kw)))
        if mode.endswith("one block per tile"):
            fire = launch.fire
            monkeypatch.setattr(launch, "fire", lambda *a, **kw: fire(*a, **{**kw, "fused": False}))
        forget_plans()
        try:
            kernel = _plan(q=(b, 1100, h, d), hk=hk, causal=causal, startend_row_indices=xb).launches[0].variant
            assert kernel.kind == "fwd_ws" and (kernel.persistent, kernel.double_q) == (persistent, double_q), kernel
            assert kernel.block_m == 128, kernel
            out = torch.full_like(q, float("nan"))
            got[mode] = cuflash.attention(q, k, v, causal=causal, out=out, return_lse=True, startend_row_indices=xt)
        finally:
            monkeypatch.undo()
            forget_plans()
    for mode in modes[1:]:
        assert torch.equal(got[mode][0].view(torch.int16), got["one-tile blocks"][0].view(torch.int16)), mode
        assert torch.equal(got[mode][1], got["one-tile blocks"][1]), mode
    _run(rng, 1, 1100, 8, 2, d, "bfloat16", causal, x)  # (the planned kernel against the reference)
