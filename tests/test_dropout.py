"""Attention dropout (flash-attn semantics): elements of the softmax's P dropped after the softmax
and before P V, kept ones scaled by 1 / (1 - p), with a Philox4x32-10 mask that is a pure
function of (seed, offset, batch, head, row, key) (cuflash.reference's mapping,
templates/common/dropout.cuh).

CPU: Philox4x32-10 against Random123's known-answer vectors; the mask against its definition
written out element by element, its statistics and what it depends on; the reference's forward
against the explicit formula and its backward against finite differences; argument checks;
plans (never split, decode tile, GQA packing, fwd_ws or bwd_ws; reasons); rendering (no dropout
code in other variants) and offline compiles with no spills; the PyTorch and drop-in plumbing.

GPU (skipped without one): forward and gradients against the float64 reference with the same
mask (flash-attn's rule: 2x the same-precision error + 1e-5 forward, + 2e-4 gradients), the
kernel's mask read back bit for bit and its kept fraction, forward/backward mask consistency,
bitwise repeatability, different seeds, torch autograd and the generator, the drop-in's S_dmask.
"""
import math

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import reference
from cuflash.kernels import all_variants, bwd, fwd
from cuflash.plan import DeviceFacts, Problem, make_backward_plan, make_plan
from conftest import assert_compiled_clean, finite_diff, render_without_flag, requires_gpu, requires_torch

BF16 = np.dtype(ml_dtypes.bfloat16)
DEVICE = "cuda"


# ---------------------------------------------------------------------------------------------
# Philox4x32-10 and the mapping

# Random123's kat_vectors for philox4x32_10: (counter, key, result).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
    ((0xffffffff,) * 4, (0xffffffff,) * 2, (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
    ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
     (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1)),
]


@pytest.mark.parametrize("ctr,key,expected", KAT)
def test_philox_known_answers(ctr, key, expected):
    got = reference.philox4x32(np.array(ctr, dtype=np.uint64), np.array(key, dtype=np.uint64))
    assert got.dtype == np.uint32 and tuple(int(x) for x in got) == expected


def test_philox_broadcasts_and_checks_shapes():
    ctrs = np.array([c for c, _, _ in KAT[:2]], dtype=np.uint64)
    got = reference.philox4x32(ctrs, np.array([0, 0], dtype=np.uint64))  # one key for both counters
    assert tuple(int(x) for x in got[0]) == KAT[0][2]
    assert tuple(got[1]) != KAT[1][2]  # the second counter with key 0, not all-ones
    assert tuple(reference.philox4x32(np.zeros(4, np.uint64), np.zeros(2, np.uint64), rounds=7)) != KAT[0][2]
    with pytest.raises(ValueError, match="counter"):
        reference.philox4x32(np.zeros(3, np.uint64), np.zeros(2, np.uint64))


def _keep_by_definition(seed, offset, b, h, nheads, i, j, p):
    """One element's keep bit, spelled out from the mapping in cuflash.reference."""
    hi = (offset + b * nheads + h) % (1 << 64)
    ctr = ((j // 16) * 32 + (i % 8) * 4 + (j % 8) // 2, i // 16, hi & 0xFFFFFFFF, hi >> 32)
    words = reference.philox4x32(np.array(ctr, np.uint64), np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint64))
    word = int(words[((i % 16) // 8) * 2 + (j % 16) // 8])
    bits = (word >> 16) if j % 2 else (word & 0xFFFF)
    return bits < round((1 - p) * 65536)


def test_mask_matches_its_definition(rng):
    seed, offset, p = 0xDEADBEEF12345678, (1 << 64) - 3, 0.3  # the offset sum wraps past 2^64
    rows, cols = np.arange(37), np.arange(5, 61)
    m = reference.dropout_keep_mask(seed, offset, 1, 2, 4, rows, cols, p)
    assert m.shape == (37, 56) and m.dtype == bool
    for i, j in zip(rng.integers(0, 37, 60), rng.integers(0, 56, 60)):
        assert m[i, j] == _keep_by_definition(seed, offset, 1, 2, 4, int(rows[i]), int(cols[j]), p)


def test_mask_depends_only_on_its_inputs():
    full = reference.dropout_keep_mask(7, 100, 0, 0, 4, range(64), range(96), 0.5)
    # Any subset of rows and keys gives the same bits (no tile dependence).
    np.testing.assert_array_equal(reference.dropout_keep_mask(7, 100, 0, 0, 4, range(17, 50), range(33, 90), 0.5),
                                  full[17:50, 33:90])
    # (offset, batch, head) enter as offset + batch * nheads + head.
    np.testing.assert_array_equal(reference.dropout_keep_mask(7, 96, 1, 0, 4, range(64), range(96), 0.5), full)
    for other in (reference.dropout_keep_mask(8, 100, 0, 0, 4, range(64), range(96), 0.5),
                  reference.dropout_keep_mask(7, 101, 0, 0, 4, range(64), range(96), 0.5),
                  reference.dropout_keep_mask(7, 100, 0, 1, 4, range(64), range(96), 0.5)):
        assert (other != full).mean() > 0.4  # independent masks differ in about half the elements


def test_fragment_tables_of_the_header_follow_the_mapping():
    """templates/common/dropout.cuh's tables, element by element of the mma.sync m16n8k16
    accumulator (lane 4 g + t holds rows g, g + 8 and columns 2t, 2t + 1 of each n8 tile, as
    c[0..3]), against the mapping: the call's lane index is (i % 8) * 4 + (j % 8) // 2, its word
    ((i % 16) // 8) * 2 + (j % 16) // 8 and the half j % 2, for query row i and key j."""
    words = "xyzw"
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for tile in range(2):  # n8 tiles 2 kk and 2 kk + 1 of one 16 x 16 block
            for e in range(4):
                r, c = g + 8 * (e >> 1), 8 * tile + 2 * t + (e & 1)
                # apply_dropout (S = Q K^T: rows are queries): its own lane's call; tile 2kk takes
                # x (e 0, 1) and z (e 2, 3), tile 2kk + 1 takes y and w; the half is e & 1.
                i, j = r, c
                word = ("xz" if tile == 0 else "yw")[e >> 1]
                assert lane == (i % 8) * 4 + (j % 8) // 2
                assert words.index(word) == ((i % 16) // 8) * 2 + (j % 16) // 8 and (e & 1) == j % 2
                # apply_dropout_t (S^T = K Q^T: rows are keys): the call of lane (2t + e') * 4 + g / 2
                # with e' = e & 1; word x, y (query tile 0; key g, g + 8), z, w (query tile 1); half g & 1.
                i, j = c, r
                word = ("xy" if tile == 0 else "zw")[e >> 1]
                assert (2 * t + (e & 1)) * 4 + (g >> 1) == (i % 8) * 4 + (j % 8) // 2
                assert words.index(word) == ((i % 16) // 8) * 2 + (j % 16) // 8 and (g & 1) == j % 2


@pytest.mark.parametrize("p", [0.0, 1e-6, 0.1, 0.5, 0.9, 0.999])
def test_mask_kept_fraction(p):
    n = 256 * 512
    m = reference.dropout_keep_mask(12345, 0, 3, 1, 8, range(256), range(512), p)
    keep = reference.dropout_threshold(p) / 65536
    assert abs(keep - (1 - p)) <= 1 / 65536
    sigma = math.sqrt(max(keep * (1 - keep), 1e-12) / n)
    assert abs(m.mean() - keep) <= 5 * sigma + 1e-12, (m.mean(), keep)


# ---------------------------------------------------------------------------------------------
# The reference with dropout

def _qkv(rng, b=2, sq=37, sk=45, h=4, hk=2, d=16):
    return rng.standard_normal((b, sq, h, d)), rng.standard_normal((b, sk, hk, d)), rng.standard_normal((b, sk, hk, d))


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (8, 3))])
def test_reference_forward_is_dropped_probabilities_times_v(rng, causal, window):
    q, k, v = _qkv(rng)
    p, seed, offset = 0.25, 99, 12
    out, lse = reference.attention(q, k, v, causal=causal, window_size=window, return_lse=True, dropout_p=p,
                                   seed=seed, offset=offset)
    _, lse0 = reference.attention(q, k, v, causal=causal, window_size=window, return_lse=True)
    np.testing.assert_array_equal(lse, lse0)  # the softmax's LSE has no dropout in it
    probs = reference.attention_probs(q, k, causal=causal, window_size=window, dropout_p=p, seed=seed, offset=offset)
    kept = np.where(probs >= 0, probs, 0.0) / (1 - p)
    vh = np.repeat(v, 2, axis=2)  # GQA: query head h reads KV head h // 2
    np.testing.assert_allclose(out, np.einsum("bhij,bjhd->bihd", kept, vh), atol=1e-12)
    for b in range(2):
        for h in range(4):
            np.testing.assert_array_equal(probs[b, h] >= 0, reference.dropout_keep_mask(
                seed, offset, b, h, 4, range(37), range(45), p) | (probs[b, h] == 0))
    np.testing.assert_array_equal(reference.attention(q, k, v, causal=causal, window_size=window, dropout_p=0.0,
                                                      seed=5), reference.attention(q, k, v, causal=causal,
                                                                                   window_size=window))


@pytest.mark.parametrize("block_n", [16, 32, 64])
def test_reference_probs_in_flash_attn_blocks(rng, block_n):
    """attention_probs(block_n=...): flash-attn's S_dmask magnitudes exp(s - m_j), m_j the row's
    maximum over key blocks j and later; flash-attn's normalisation (block j times
    exp(m_j - lse), its tests' normalize_flash_attn_S) gives the probabilities back."""
    q, k, v = _qkv(rng, b=1, sq=37, sk=150, h=2, hk=1, d=8)
    kw = dict(causal=True, dropout_p=0.25, seed=7, offset=3)
    probs = reference.attention_probs(q, k, **kw)
    raw = reference.attention_probs(q, k, block_n=block_n, **kw)
    np.testing.assert_array_equal(np.signbit(raw), np.signbit(probs))  # the same mask
    s = np.einsum("bihd,bjhd->bhij", q, np.repeat(k, 2, axis=2)) / math.sqrt(8)
    sq, sk = s.shape[-2:]
    s[..., np.arange(sk)[None, :] > np.arange(sq)[:, None] + sk - sq] = -np.inf  # causal, bottom right
    _, lse = reference.attention(q, k, v, causal=True, return_lse=True)
    blocks = range(0, sk, block_n)
    m = np.stack([s[..., j:].max(axis=-1) for j in blocks], axis=-1)  # max over blocks j.. (j at block starts)
    scale = np.repeat(np.exp(m - lse[..., None]), block_n, axis=-1)[..., :sk]
    np.testing.assert_allclose(np.abs(raw) * scale, np.abs(probs), rtol=1e-12, atol=1e-15)
    assert np.abs(raw).max() <= 1.0 and (np.abs(raw) > np.abs(probs)).any()


def test_reference_backward_matches_finite_differences(rng):
    q, k, v = _qkv(rng, b=1, sq=9, sk=11, h=2, hk=1, d=4)
    dout = rng.standard_normal(q.shape)
    kw = dict(causal=True, softcap=3.0, dropout_p=0.4, seed=2024, offset=8)
    grads = reference.attention_backward(dout, q, k, v, **kw)
    loss = lambda: float((reference.attention(q, k, v, **kw) * dout).sum())  # noqa: E731
    for g, fd in zip(grads, finite_diff(loss, [q, k, v])):
        np.testing.assert_allclose(g, fd, rtol=1e-5, atol=1e-6)
    # A different mask gives different gradients: the test above sees the mask.
    other = reference.attention_backward(dout, q, k, v, **dict(kw, seed=2025))
    assert max(np.abs(a - b).max() for a, b in zip(grads, other)) > 1e-3


def test_reference_varlen_uses_the_sequence_index(rng):
    q, k, v = (rng.standard_normal((n, 2, 8)) for n in (30, 40, 40))
    cu_q, cu_k = np.array([0, 12, 30], np.int32), np.array([0, 25, 40], np.int32)
    kw = dict(dropout_p=0.3, seed=1, offset=4)
    out = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=True, **kw)
    second = reference.attention(q[None, 12:30], k[None, 25:40], v[None, 25:40], causal=True, batch0=1, **kw)
    np.testing.assert_allclose(out[12:30], second[0], atol=1e-12)
    dout = rng.standard_normal(q.shape)
    g = reference.attention_varlen_backward(dout, q, k, v, cu_q, cu_k, causal=True, **kw)
    g1 = reference.attention_backward(dout[None, 12:30], q[None, 12:30], k[None, 25:40], v[None, 25:40],
                                      causal=True, batch0=1, **kw)
    np.testing.assert_allclose(g[0][12:30], g1[0][0], atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Arguments

@pytest.mark.parametrize("bad,exc", [(-0.1, ValueError), (1.0, ValueError), (float("nan"), ValueError),
                                     ("0.1", TypeError), (True, TypeError)])
def test_dropout_p_is_checked(rng, bad, exc):
    q, k, v = (x.astype(np.float16) for x in _qkv(rng))
    with pytest.raises(exc, match="dropout_p"):
        cuflash.attention(q, k, v, dropout_p=bad, seed=1)
    with pytest.raises(exc, match="dropout_p"):
        reference.attention(q, k, v, dropout_p=bad, seed=1)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(), ValueError, "needs seed"),
    (dict(seed=-1), ValueError, "seed must be in"),
    (dict(seed=1 << 64), ValueError, "seed must be in"),
    (dict(seed=1.0), TypeError, "seed must be an int"),
    (dict(seed=1, offset=-2), ValueError, "offset must be in"),
    (dict(seed=1, num_splits=2), ValueError, "num_splits=2"),
    (dict(seed=1, sinks=np.zeros(4, np.float32)), ValueError, "sinks"),
])
def test_dropout_options_are_checked_before_any_launch(rng, kw, exc, match):
    q, k, v = (x.astype(np.float16) for x in _qkv(rng))
    with pytest.raises(exc, match=match):
        cuflash.attention(q, k, v, dropout_p=0.1, **kw)


def test_dropout_rejects_caches_and_flashmask_in_the_plan():
    dev = DeviceFacts(132, 90)
    for extra, what in ((dict(kv="cache"), "KV cache"), (dict(num_splits=3), "num_splits=3"),
                        (dict(sinks=True), "sinks"), (dict(flashmask=2, flashmask_heads=1), "FlashMask")):
        with pytest.raises(ValueError, match=what):
            make_plan(Problem(2, 64, 128, 4, 4, 64, "bf16", dropout=True, **extra), dev)
    with pytest.raises(ValueError, match="KV cache"):
        make_backward_plan(Problem(2, 64, 128, 4, 4, 64, "bf16", dropout=True, kv="cache"), dev)


# ---------------------------------------------------------------------------------------------
# Plans

@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("sq,sk,h,hk,d,causal", [(1, 4096, 32, 8, 128, True), (2048, 2048, 16, 16, 128, True),
                                                   (64, 20000, 4, 4, 64, False), (1024, 1024, 8, 2, 256, False)])
def test_dropout_plan_runs_the_standard_kernel(arch, sq, sk, h, hk, d, causal):
    dev = DeviceFacts(132, arch)
    plan = make_plan(Problem(1, sq, sk, h, hk, d, "bf16", causal, dropout=True), dev)
    (launch,) = plan.launches
    v = launch.variant
    assert v.kind == "fwd" and v.dropout and not v.decode and plan.num_splits == 1 and not plan.pack_gqa
    assert launch.grid[1] == h  # query heads as launched: the mask's head index
    assert "dropout" in plan.reason
    if arch == 90 and d in fwd.WGMMA_TILES:
        assert v.mma == "wgmma" and "it has no dropout" in plan.reason
    plain = make_plan(Problem(1, sq, sk, h, hk, d, "bf16", causal), dev)
    assert not getattr(plain.launches[0].variant, "dropout", False) and "dropout" not in plain.reason


@pytest.mark.parametrize("deterministic", [False, True])
def test_dropout_backward_plan(deterministic):
    dev = DeviceFacts(132, 90)
    plan = make_backward_plan(Problem(2, 1024, 1024, 8, 8, 128, "bf16", True, deterministic=deterministic,
                                      dropout=True), dev)
    prep, main, last = (launch.variant for launch in plan.launches)
    assert main.family == "bwd" and main.mma == "sync" and main.dropout
    assert getattr(last, "dropout", False) == (last.kind == "bwd_dq")
    assert "no registers for dropout" in plan.reason and "dropout:" in plan.reason
    plain = make_backward_plan(Problem(2, 1024, 1024, 8, 8, 128, "bf16", True, deterministic=deterministic), dev)
    assert plain.launches[1].variant.family == "bwd_ws"  # what dropout keeps it from


def test_dropout_variants_are_refused_where_they_cannot_run():
    with pytest.raises(ValueError, match="dropout variant"):
        fwd.FwdVariant(kind="fwd_split", head_dim=64, dtype="bf16", block_m=64, block_n=64, warps=4, stages=1,
                       arch=80, dropout=True)
    with pytest.raises(ValueError, match="dropout backward variant"):
        bwd.BwdTileVariant(kind="bwd_dkdv", head_dim=64, dtype="bf16", block_m=128, block_n=128, warps=8,
                           stages=2, mma="wgmma", arch=90, dropout=True)


# ---------------------------------------------------------------------------------------------
# Rendering and offline compiles

def test_only_dropout_variants_carry_dropout_code():
    from cuflash import codegen
    for arch in (80, 90):
        vs = all_variants(arch, families=("fwd", "bwd"))
        drop = [v for v in vs if getattr(v, "dropout", False)]
        assert len(drop) == len(fwd.dropout_variants(arch)) + len(bwd.dropout_variants(arch)) > 0
        assert all("_dropout" in v.name for v in drop)
        for v in vs[::97]:  # a spread of the others: not a token of dropout code
            if not getattr(v, "dropout", False):
                src = codegen.render(v)
                assert "dropout" not in src.lower() and "philox" not in src.lower(), v.name
        for v in drop[::41]:
            src = codegen.render(v)
            assert "philox4x32_10" in src and "kDropout = true" in src


def _no_dropout_sample():
    from cuflash.kernels import covering_sample
    return [v for v in covering_sample() if v.family in ("fwd", "bwd") and hasattr(v, "dropout") and not v.dropout][::3]


@pytest.mark.parametrize("v", _no_dropout_sample(), ids=lambda v: v.name)
def test_variant_without_dropout_renders_as_with_no_dropout_flag(v):
    """A template given no ``dropout`` at all (Jinja's default, lenient undefined) renders the
    same source as ``dropout=False``: the flag adds nothing to variants without dropout, so their
    cubins are the ones compiled (and checked on GPUs) before dropout existed. (When dropout was
    added, all 19240 such variants of sm_80 and sm_90 were also compared with the templates of
    the commit before.)"""
    assert not set(fwd.DROPOUT_FIELDS) & set(v.params.fields)
    src = render_without_flag(v, "dropout")
    assert "dropout" not in src.lower() and "philox" not in src.lower()


def _heavy_dropout_variants():
    """Per arch: each dropout kernel kind at the two largest head dims with every modifier (the
    most registers; every variant is compiled by ``python -m cuflash warmup --all --check``)."""
    out = []
    for arch in (80, 90):
        for v in fwd.dropout_variants(arch) + bwd.dropout_variants(arch):
            heavy = v.dtype == "bf16" and not v.even_head_dim if v.family == "fwd" else v.dtype == "fp16"
            if heavy and v.head_dim in (128, 256) and v.local and v.softcap and v.alibi:
                out.append(v)
    return out


@pytest.mark.parametrize("v", _heavy_dropout_variants(), ids=lambda v: v.name)
def test_dropout_variant_compiles_without_spills(compile_variants, v):
    assert_compiled_clean(compile_variants([v])[v], v)


# ---------------------------------------------------------------------------------------------
# PyTorch and drop-in plumbing (no GPU needed)

@requires_torch
def test_torch_seed_offset_plumbing():
    import torch
    from cuflash.torch import ops
    for x in (0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1):
        assert ops._u64(ops._s64(x)) == x and -(1 << 63) <= ops._s64(x) < 1 << 63
    assert ops._dropout_state(0.2, 1 << 63, 5, torch.device("cpu"), 2, 4) == (0.2, -(1 << 63), 5)
    assert ops._dropout_state(0.0, None, None, torch.device("cpu"), 2, 4) == (0.0, 0, 0)
    with pytest.raises(ValueError, match="offset needs seed"):
        ops._dropout_state(0.2, None, 3, torch.device("cpu"), 2, 4)
    q = torch.zeros(1, 8, 2, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="dropout_p"):
        cuflash.torch.attention(q, q, q, dropout_p=1.0)
    from cuflash.flash_attn import flash_attn_func
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attn_func(q, q, q, 1.5)
    assert reference.dropout_offset_increment(3, 5) == 16
    for op in (torch.ops.cuflash.attention_fwd, torch.ops.cuflash.attention_bwd, torch.ops.cuflash.attention_varlen_fwd,
               torch.ops.cuflash.attention_varlen_bwd):
        args = [(a.name, str(a.type)) for a in op.default._schema.arguments][-3:]
        assert args == [("dropout_p", "float"), ("seed", "int"), ("offset", "int")], op


# ---------------------------------------------------------------------------------------------
# GPU

def _t(rng, *shape, dtype="bfloat16"):
    import torch
    return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to(DEVICE, getattr(torch, dtype))


def to_np(x):
    import torch
    a = x.detach().float().cpu().numpy()
    return a.astype({torch.bfloat16: BF16, torch.float16: np.float16}.get(x.dtype, np.float32))


def _within(got, ref64, same, atol, what):
    """flash-attn's rule: max|got - ref64| <= 2 * max|same - ref64| + atol."""
    err, bound = reference.max_abs_err(got, ref64), 2 * reference.max_abs_err(same, ref64) + atol
    assert err <= bound, f"{what}: max error {err:.3g} exceeds bound {bound:.3g}"


SHAPES = [  # sq, sk, h, hk, d, causal, dtype
    (113, 203, 4, 4, 64, False, "bfloat16"),
    (128, 217, 8, 2, 128, True, "float16"),
    (239, 113, 4, 2, 128, True, "bfloat16"),   # rows that see no key
    (113, 211, 4, 4, 96, True, "bfloat16"),    # mma.sync on sm_90
    (256, 512, 4, 1, 256, False, "float16"),
    (108, 256, 2, 2, 59, False, "bfloat16"),   # padded head dim
    (3, 799, 8, 2, 32, True, "float16"),
]


@requires_gpu
@requires_torch
@pytest.mark.parametrize("sq,sk,h,hk,d,causal,dtype", SHAPES)
def test_gpu_dropout_forward(rng, sq, sk, h, hk, d, causal, dtype):
    import torch
    q, k, v = _t(rng, 2, sq, h, d, dtype=dtype), _t(rng, 2, sk, hk, d, dtype=dtype), _t(rng, 2, sk, hk, d, dtype=dtype)
    kw = dict(causal=causal, dropout_p=0.17, seed=0x123456789ABCDEF0, offset=(1 << 64) - 5)
    out = torch.full_like(q, float("nan"))
    res, lse = cuflash.attention(q, k, v, out=out, return_lse=True, **kw)
    assert res is out
    args = [to_np(x) for x in (q, k, v)]
    ref, lse_ref = reference.attention(*args, return_lse=True, **kw)
    same = reference.attention(*args, precision="same", **kw)
    _within(to_np(out), ref, same, 1e-5, f"out {kw}")
    np.testing.assert_allclose(to_np(lse), lse_ref, rtol=1e-3, atol=2e-3)
    again = cuflash.attention(q, k, v, **kw)
    assert torch.equal(again, out)  # bitwise repeatable with the same seed and offset
    other = cuflash.attention(q, k, v, **dict(kw, seed=kw["seed"] + 1))
    assert not torch.equal(other, out)


@requires_gpu
@requires_torch
@pytest.mark.parametrize("d,p", [(64, 0.1), (128, 0.5), (128, 0.9)])
def test_gpu_dropout_mask_read_back_bit_for_bit(d, p):
    """q = 0 makes P uniform (1 / sk) and v = the identity puts P Z / (1 - p) into out: out > 0
    is the kernel's mask, which must be the reference's bit for bit, with the kept fraction
    within 5 sigma of 1 - p."""
    import torch
    b, sq, h, sk = 2, 300, 4, d
    q = torch.zeros(b, sq, h, d, dtype=torch.bfloat16, device=DEVICE)
    k = torch.zeros(b, sk, h, d, dtype=torch.bfloat16, device=DEVICE)
    v = torch.eye(d, dtype=torch.bfloat16, device=DEVICE)[None, :, None].expand(b, sk, h, d).contiguous()
    seed, offset = 77, 40
    out = cuflash.attention(q, k, v, dropout_p=p, seed=seed, offset=offset)
    got = (out > 0).cpu().numpy()  # (b, sq, h, d = key)
    for bi in range(b):
        for hi in range(h):
            np.testing.assert_array_equal(got[bi, :, hi], reference.dropout_keep_mask(
                seed, offset, bi, hi, h, range(sq), range(sk), p), err_msg=f"batch {bi} head {hi}")
    kept = reference.dropout_threshold(p) / 65536
    assert abs(got.mean() - kept) <= 5 * math.sqrt(kept * (1 - kept) / got.size)
    scale = float(out.max()) * sk * (1 - p)
    assert abs(scale - 1) < 1e-2  # kept elements scaled by 1 / (1 - p)


@requires_gpu
@requires_torch
@pytest.mark.parametrize("sq,sk,h,hk,d,causal,deterministic,dtype", [
    (113, 203, 4, 2, 64, True, False, "float16"),
    (239, 113, 4, 4, 128, True, True, "bfloat16"),
    (256, 256, 8, 2, 128, False, False, "bfloat16"),
    (128, 300, 8, 8, 96, False, True, "float16"),
    (127, 513, 2, 1, 256, True, False, "bfloat16"),
])
def test_gpu_dropout_backward(rng, sq, sk, h, hk, d, causal, deterministic, dtype):
    import torch
    from cuflash.backward import attention_backward
    q, k, v = _t(rng, 2, sq, h, d, dtype=dtype), _t(rng, 2, sk, hk, d, dtype=dtype), _t(rng, 2, sk, hk, d, dtype=dtype)
    dout = _t(rng, 2, sq, h, d, dtype=dtype)
    kw = dict(causal=causal, dropout_p=0.3, seed=31337, offset=1024)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    bufs = dict(dq=torch.full_like(q, float("nan")), dk=torch.full_like(k, float("nan")),
                dv=torch.full_like(v, float("nan")))
    res = attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **kw, **bufs)
    args = [to_np(x) for x in (dout, q, k, v)]
    ref64 = reference.attention_backward(*args, **kw)
    same = reference.attention_backward(*args, precision="same", **kw)
    for name, g, r, s in zip(("dq", "dk", "dv"), res, ref64, same):
        _within(to_np(g), r, s, 2e-4, f"{name} {kw} deterministic={deterministic}")
    # Forward/backward consistency: against another mask the gradients are far off.
    wrong = reference.attention_backward(*args, **dict(kw, seed=31338))
    assert reference.max_abs_err(to_np(res[2]), wrong[2]) > 10 * (2 * reference.max_abs_err(same[2], ref64[2]) + 2e-4)
    if deterministic:
        again = attention_backward(dout, q, k, v, out, lse, deterministic=True, **kw)
        assert all(torch.equal(a, b) for a, b in zip(again, res))


@requires_gpu
@requires_torch
def test_gpu_dropout_varlen(rng):
    import torch
    from cuflash.backward import attention_varlen_backward
    lq, lk = np.array([0, 37, 130, 1]), np.array([5, 0, 200, 64])
    cu = lambda n: torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32, device=DEVICE)  # noqa: E731
    cu_q, cu_k = cu(lq), cu(lk)
    h, hk, d = 4, 2, 64
    q, k, v = _t(rng, int(lq.sum()), h, d), _t(rng, int(lk.sum()), hk, d), _t(rng, int(lk.sum()), hk, d)
    dout = _t(rng, int(lq.sum()), h, d)
    kw = dict(causal=True, dropout_p=0.2, seed=5, offset=0)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, int(lq.max()), int(lk.max()), return_lse=True, **kw)
    args = [to_np(x) for x in (q, k, v)] + [cu_q.cpu().numpy(), cu_k.cpu().numpy()]
    _within(to_np(out), reference.attention_varlen(*args, **kw),
            reference.attention_varlen(*args, precision="same", **kw), 1e-5, "varlen out")
    res = attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, int(lq.max()), int(lk.max()), **kw)
    bargs = [to_np(dout)] + args
    ref64 = reference.attention_varlen_backward(*bargs, **kw)
    same = reference.attention_varlen_backward(*bargs, precision="same", **kw)
    for name, g, r, s in zip(("dq", "dk", "dv"), res, ref64, same):
        _within(to_np(g), r, s, 2e-4, f"varlen {name}")


@requires_gpu
@requires_torch
def test_gpu_dropout_torch_autograd_and_generator(rng):
    import torch
    import cuflash.torch  # noqa: F401 (a module of its own: not imported by cuflash)
    q, k, v = (_t(rng, 2, 128, 4, 64).requires_grad_() for _ in range(3))
    dout = _t(rng, 2, 128, 4, 64)
    kw = dict(causal=True, dropout_p=0.25, seed=11, offset=4)
    out = cuflash.torch.attention(q, k, v, **kw)
    out.backward(dout)
    args = [to_np(x) for x in (q, k, v)]
    _within(to_np(out), reference.attention(*args, **kw), reference.attention(*args, precision="same", **kw), 1e-5,
            "torch out")
    ref64 = reference.attention_backward(to_np(dout), *args, **kw)
    same = reference.attention_backward(to_np(dout), *args, precision="same", **kw)
    for name, g, r, s in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), ref64, same):
        _within(to_np(g), r, s, 2e-4, f"torch {name}")
    # Without a seed: the default CUDA generator's, its offset advanced per call.
    with torch.no_grad():
        torch.manual_seed(0)
        a, b = (cuflash.torch.attention(q, k, v, dropout_p=0.25) for _ in range(2))
        torch.manual_seed(0)
        c = cuflash.torch.attention(q, k, v, dropout_p=0.25)
    assert torch.equal(a, c) and not torch.equal(a, b)


@requires_gpu
@requires_torch
def test_gpu_dropout_flash_attn_dropin_s_dmask(rng):
    """S_dmask as flash-attn returns it: q's dtype, dropped elements negated, magnitudes relative
    to the running maximum over key blocks of _get_block_size_n keys. Normalised as flash-attn's
    tests do, its kept part times V / (1 - p) is the kernel's output."""
    import torch
    from cuflash.flash_attn import flash_attn_func
    from cuflash.flash_attn.flash_attn_interface import _get_block_size_n
    q, k, v = _t(rng, 2, 113, 4, 64), _t(rng, 2, 203, 2, 64), _t(rng, 2, 203, 2, 64)
    p = 0.3
    out, lse, s_dmask = flash_attn_func(q, k, v, p, None, True, return_attn_probs=True)
    assert s_dmask.shape == (2, 4, 113, 203) and s_dmask.dtype == q.dtype
    kh, vh = (x.float().repeat_interleave(2, dim=2) for x in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q.float(), kh) / 8.0
    visible = torch.ones(113, 203, dtype=torch.bool, device=DEVICE).tril(203 - 113)  # causal, bottom right
    s = s.masked_fill(~visible, -torch.inf)
    bn = _get_block_size_n(q.device, 64, True, True)
    m = torch.stack([s[..., j:].amax(-1) for j in range(0, 203, bn)], -1)  # max over blocks j..
    scale = torch.exp(m - torch.logsumexp(s, -1, keepdim=True)).repeat_interleave(bn, -1)[..., :203]
    probs = s_dmask.float().abs() * scale
    assert (probs.sum(-1) - 1).abs().max().item() < 2e-2  # normalised rows
    kept = torch.where(s_dmask >= 0, probs, 0.0) / (1 - p)
    expected = torch.einsum("bhij,bjhd->bihd", kept, vh)
    assert (out.float() - expected).abs().max().item() < 2e-2
    assert abs((s_dmask >= 0)[..., visible].float().mean().item() - (1 - p)) < 0.02


@requires_gpu
@requires_torch
def test_gpu_dropout_varlen_s_dmask_with_upper_bound_maxima(rng):
    """flash_attn_varlen_func's S_dmask when max_seqlen_q / max_seqlen_k are upper bounds above the
    rows (flash-attn sizes S_dmask by them): the exact maxima's S_dmask in its corner, zeros
    elsewhere, and the same output (the same seed)."""
    import torch
    from cuflash.flash_attn import flash_attn_varlen_func
    cu_q = torch.tensor([0, 50, 50, 170], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 90, 100, 300], dtype=torch.int32, device=DEVICE)
    q, k, v = _t(rng, 1, 170, 4, 64)[0], _t(rng, 1, 300, 2, 64)[0], _t(rng, 1, 300, 2, 64)[0]
    results = []
    for maxima in ((120, 200), (1000, 4096)):
        torch.manual_seed(7)
        results.append(flash_attn_varlen_func(q, k, v, cu_q, cu_k, *maxima, 0.2, causal=True,
                                              return_attn_probs=True))
    (out, lse, s), (out_b, lse_b, s_b) = results
    assert s_b.shape == (3, 4, 1000, 4096) and s.shape == (3, 4, 120, 200)
    assert torch.equal(s_b[:, :, :120, :200], s) and not s_b[:, :, 120:].any() and not s_b[..., 200:].any()
    torch.testing.assert_close(out_b, out, atol=2e-2, rtol=0)
    torch.testing.assert_close(lse_b, lse, atol=1e-3, rtol=0)
