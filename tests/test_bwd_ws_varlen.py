"""Packed variable-length sequences (varlen) in the warp-specialised Hopper backward
(kernels/bwd_ws.py, templates/bwd_ws/): offline checks (the variants, names and parameter
structs, the sources and structs of the variants without varlen unchanged, every new variant
compiles for sm_90a with no spills or stack, the plans that run them with their reason, the
launch fields and tensor maps), and GPU checks (skipped without an sm_90 GPU):
attention_varlen_backward's gradients against the float64 reference with flash-attn's rule
(2x the same-precision error + 2e-4), on sequences that are empty, of one token, crossing tile
boundaries, with unequal query and key lengths, GQA, every mask, softcap and ALiBi, head dims 64,
128 and 256, fp16/bf16 and the deterministic mode (bitwise repeatable, and bitwise equal to the
dense kernel on equal lengths); each checks that the bwd_ws kernel ran."""
import importlib
from dataclasses import replace

import numpy as np
import pytest

from conftest import (assert_compiled_clean, assert_warp_specialised_clean, fake_view, record_launches,
                      render_without_flag, requires_sm90, requires_torch)
from cuflash import backward, codegen
from cuflash.kernels import all_variants, bwd_ws
from cuflash.kernels.bwd import CONVERT_PARAMS, PREP_PARAMS, BwdRowVariant
from cuflash.kernels.bwd_ws import (ALIBI_FIELDS, FLASHMASK_PARAMS, PARAMS, SOFTCAP_FIELDS, VARLEN_FIELDS,
                                    BwdWsVariant)
from cuflash.plan import DeviceFacts, Problem, forget_plans, make_backward_plan

plan_mod = importlib.import_module("cuflash.plan")  # the module (cuflash.plan is the function)

ALL = bwd_ws.variants(90)
VARLEN = [v for v in ALL if v.family == "bwd_ws" and v.varlen]
VARLEN_CONVERTS = [v for v in ALL if v.family != "bwd_ws" and v.varlen]
# Compiled here: the bf16 kernels (fp16 differs only in its conversions; every variant of both was
# checked for spills with the GPU machine's NVRTC 13.0 ptxas when varlen was added).
COMPILED = [v for v in VARLEN + VARLEN_CONVERTS if v.dtype == "bf16"]
DENSE = [v for v in ALL if not v.varlen]


def test_variants():
    """Every head dim, dtype, mask, dQ mode and score modifier (not softcap with ALiBi at d = 64)
    on packed sequences, as planned, and a tiled varlen bwd_convert per head dim and dtype; in
    all_variants, none with mods=False or with FlashMask."""
    assert len({v.name for v in VARLEN}) == len(VARLEN) == 3 * 2 * 3 * 2 * 4 - 2 * 3 * 2
    assert set(VARLEN + VARLEN_CONVERTS) <= set(all_variants(90))
    assert not any(v.varlen for v in bwd_ws.variants(90, mods=False))
    assert not any(v.flashmask for v in VARLEN)
    for v in VARLEN:
        assert v == bwd_ws.planned(v.head_dim, v.dtype, v.causal, v.local, v.dq_ordered, 90, 0, v.softcap, v.alibi,
                                   varlen=True)
        dense = replace(v, varlen=False).name
        mask = "local" if v.local else "causal" if v.causal else "full"
        mods = ("_softcap" if v.softcap else "") + ("_alibi" if v.alibi else "")
        assert v.name == dense.replace(f"_{mask}{mods}_", f"_{mask}{mods}_varlen_", 1), v.name
        assert v.grid(3, 500, 700, 8, 2) == replace(v, varlen=False).grid(3, 500, 700, 8, 2)
    assert sorted(v.name for v in VARLEN_CONVERTS) == sorted(
        f"bwd_convert_d{d}_{dt}_tiled_varlen_sm90" for d in (64, 128, 256) for dt in ("fp16", "bf16"))
    assert all(v == bwd_ws.convert(v.head_dim, v.dtype, 90, varlen=True) for v in VARLEN_CONVERTS)


def test_params_appended_only_to_varlen_variants():
    """The variants without varlen keep their structs (so their machine code); the varlen ones
    append cu_seqlens_q and cu_seqlens_k after every other field. The tiled converts keep the
    convert's struct (it has cu_seqlens_q)."""
    for v in DENSE:
        if v.family != "bwd_ws":  # converts, and dq_t's bwd_prep
            assert v.params == (PREP_PARAMS if v.kind == "bwd_prep" else CONVERT_PARAMS)
        elif v.flashmask:
            assert v.params == FLASHMASK_PARAMS, v.name
        else:
            assert v.params.fields == PARAMS.fields + SOFTCAP_FIELDS * v.softcap + ALIBI_FIELDS * v.alibi, v.name
    for v in VARLEN:
        extra = SOFTCAP_FIELDS * v.softcap + ALIBI_FIELDS * v.alibi + VARLEN_FIELDS
        assert v.params.fields == PARAMS.fields + extra and v.params.struct_name == "BwdWsParams", v.name
    assert all(v.params == CONVERT_PARAMS for v in VARLEN_CONVERTS)
    assert [n for n, _ in VARLEN_FIELDS] == ["cu_seqlens_q", "cu_seqlens_k"]


def test_sources_of_other_variants_unchanged():
    """The flag adds nothing to the source of a variant without it (rendered with no flag at all)."""
    for v in DENSE:
        src = render_without_flag(v, "varlen")
        if v.family == "bwd_ws":
            body = src.split('extern "C"')[1]
            assert "cu_seqlens" not in body and "k_rows" not in body and "kInfoKb" not in body, v.name
            assert "zero_rows" not in body, v.name  # (dense maps read zeros past each sequence)


def test_varlen_sources():
    """A block reads its sequence's bounds and leaves before any barrier exists; the TMA boxes
    start at the sequence's first token in batch 0; the LSE/D/dQ rows and semaphores are the
    sequence's; dK and dV are stored from its first key token; ALiBi's offset is per sequence."""
    for v in VARLEN:
        src = codegen.render(v).split('extern "C"')[1]
        leave = src.index("if (n0 >= k_rows.len) return;")
        assert leave < src.index("mbar_init(") and leave < src.index("__syncthreads()"), v.name
        assert "packed_rows(cu_seqlens_q, b), k_rows = packed_rows(cu_seqlens_k, b)" in src
        assert "stats_base(cu_seqlens_q, b, nheads, head_rows)" in src
        assert src.count("m0 + q_row0, h, 0)") == 2
        assert src.count("n0 + k_rows.start, hk, 0)") == 2
        assert "(long long)b * nheads * head_rows" not in src, v.name
        assert src.count("(long long)info_i32(sInfo, kInfoKb) * d") == 2
        assert "(row >> 6)" not in src and ("((row + 63) >> 6)" in src or not v.dq_ordered), v.name
        # ALiBi's offset seqlen_k - seqlen_q from the block's scalars (the two consumer paths, or
        # the split-d one), nothing with a softcap alone
        uses = src.count(" - info_i32(sInfo, kInfoSeqQ)")
        assert uses == v.alibi * (1 if v.split_d else 2), v.name
        assert "seqlen_k_arg - seqlen_q_arg" not in src
        # The next sequence's rows of a tail tile zeroed before any product reads them: Q and dO
        # once a step's stage has landed, K and V once they have, each then fenced for wgmma and
        # published to both consumer groups.
        full = src.index("mbar_wait<kHangTrap>(bar_full(st)")
        assert full < src.index("zero_q_tail(st, m0);", full) < src.index("issue_sdp(", full), v.name
        kv = src.index("mbar_wait<kHangTrap>(bar_kv, 0);")
        zero_kv = src.index("zero_rows(sK, kBlockN,", kv)
        assert zero_kv < src.index("fence_proxy_async();", zero_kv) < src.index("named_bar_sync<1, kConsumerThreads>();",
                                                                            zero_kv) < src.index("step(it,", kv)
        tail = src[src.index("auto zero_q_tail"):]
        assert tail.index("zero_rows(sdO(st)") < tail.index("fence_proxy_async();") < tail.index("named_bar_sync<1")
    for v in VARLEN_CONVERTS:
        src = codegen.render(v).split('extern "C"')[1]
        assert "if (mb * 64 >= seqlen_q_arg) return;" in src and "(qb & ~3) + (long long)kVarlenRowGap * b" in src


@pytest.mark.parametrize("bad, match", [
    (dict(varlen=1), "varlen must be a bool"),
    (dict(varlen=True, flashmask=2), "varlen must be a bool, and True only without FlashMask"),
])
def test_bad_variant(bad, match):
    kw = dict(kind="bwd_ws_dkdv_dq", head_dim=128, dtype="bf16", arch=90) | bad
    with pytest.raises(ValueError, match=match):
        BwdWsVariant(**kw)


@pytest.mark.parametrize("kw", [dict(tiled=False), dict(varlen=1)])
def test_bad_varlen_convert(kw):
    with pytest.raises(ValueError, match="varlen must be a bool, and True only for the tiled"):
        BwdRowVariant(**(dict(kind="bwd_convert", head_dim=128, dtype="bf16", arch=90, tiled=True, varlen=True) | kw))


@pytest.mark.parametrize("v", COMPILED, ids=lambda v: v.name)
def test_compiles_as_designed(compiled, v):
    """As tests/test_bwd_ws.py asks of every bwd_ws variant: no spills or stack, at most the 168
    registers of __launch_bounds__(384, 1), setmaxnreg honoured, no serialized wgmma, no static
    shared memory."""
    if v.family == "bwd_ws":
        assert_warp_specialised_clean(compiled[v], v)
    else:
        assert_compiled_clean(compiled[v], v)


# ---------------------------------------------------------------------------------------------
# Plans

def _problem(d=128, **kw):
    return Problem(4, 512, 500, 16, 4, d, "bf16", **(dict(causal=True, tma=True, varlen=True) | kw))


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("mask", [dict(causal=False), dict(causal=True), dict(causal=False, window=(100, 0))])
@pytest.mark.parametrize("softcap, alibi", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_planned_on_sm90(d, softcap, alibi, mask, deterministic):
    prob = _problem(d, softcap=softcap, alibi=alibi, deterministic=deterministic, **mask)
    p = make_backward_plan(prob, DeviceFacts(132, 90))
    main, last = p.launches[1].variant, p.launches[2].variant
    if softcap and alibi and d in bwd_ws.NO_SOFTCAP_ALIBI:
        assert main.family == "bwd" and "no registers for softcap and ALiBi together" in p.reason
        return
    assert plan_mod._bwd_ws_blocker(prob, d, 90) == ""
    assert main.family == "bwd_ws" and main.varlen and (main.softcap, main.alibi) == (softcap, alibi)
    assert main == bwd_ws.planned(d, "bf16", main.causal, main.local, deterministic, 90, 0, softcap, alibi, True)
    # (d = 128 with a causal or window mask, not deterministic: 80-query steps and their convert)
    assert main.dq_t == (d == 128 and not (deterministic or softcap or alibi) and (main.causal or main.local))
    assert main.dq_ordered == deterministic and last == bwd_ws.convert(d, "bf16", 90, varlen=True, dq_t=main.dq_t)
    assert p.launches[0].variant.row_pad == (80 if main.dq_t else 128)
    assert p.launches[1].grid == (-(-500 // main.block_n), 4, 4)
    assert "Packed sequences: " in p.reason and "leaves at once past its keys" in p.reason
    assert "padding rows of LSE (+inf) and D (0)" in p.reason


def test_other_archs_and_blockers_fall_back():
    """sm_80 and the blockers that remain (TMA-unreadable strides, dropout) still run the other
    backward kernels on packed sequences, and say why."""
    assert make_backward_plan(_problem(), DeviceFacts(108, 80)).launches[1].variant.family == "bwd"
    for kw, why in ((dict(tma=False), "stride the TMA cannot read"), (dict(dropout=True), "no dropout")):
        prob = _problem(**kw)
        p = make_backward_plan(prob, DeviceFacts(132, 90))
        assert p.launches[1].variant.family == "bwd" and "Packed sequences" not in p.reason
        assert why in plan_mod._bwd_ws_blocker(prob, 128, 90) and (why in p.reason or prob.dropout)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d", [64, 256])
def test_launch_fields(monkeypatch, d, deterministic):
    """backward.run of a planned varlen bwd_ws call (kernels and the driver's tensor maps stubbed):
    the dK/dV kernel gets the cu_seqlens pointers and tensor maps spanning every token of the
    packed tensors as one batch (token strides), its grid covers the longest sequence's keys;
    bwd_prep and the tiled varlen bwd_convert get cu_seqlens_q; the ordered mode's semaphores
    cover every 64 rows (rounded up) of the packed rows."""
    launched = record_launches(monkeypatch)
    maps = []
    monkeypatch.setattr(backward, "tensor_map", lambda *a: maps.append(a) or bytes(128))
    b, mq, mk, h, hk, tq, tk = 4, 512, 500, 6, 2, 1700, 1203
    plan = make_backward_plan(Problem(b, mq, mk, h, hk, d, "bf16", causal=True, alibi=True, varlen=True, tma=True,
                                      deterministic=deterministic), DeviceFacts(132, 90))
    main = plan.launches[1].variant
    assert main.family == "bwd_ws" and main.varlen
    q = fake_view(0, (tq, h, d), "bfloat16", strides=(3 * h * d, d, 1), ptr=1 << 24)  # token stride 3 h d
    do, o = (fake_view(0, (tq, h, d), "bfloat16", ptr=(i + 2) << 24) for i in range(2))
    k, v = (fake_view(0, (tk, hk, d), "bfloat16", ptr=(i + 4) << 24) for i in range(2))
    lse = fake_view(0, (h, tq), "float32", ptr=7 << 24)
    slopes = fake_view(0, (h,), "float32", ptr=8 << 24)
    cu = tuple(fake_view(0, (b + 1,), "int32", ptr=(i + 12) << 24) for i in range(2))
    grads = [fake_view(0, x.shape, "bfloat16", ptr=(20 + i) << 24) for i, x in enumerate((q, k, v))]
    backward.run(plan, (q, k, v, do, o), lse, grads, 9 << 24, 0.1, ((-1, -1), 0.0, slopes, 0), 5, 0, cu=cu)
    names = [n for n, _, _ in launched]
    assert names == [l.name for l in plan.launches] and names[2] == f"bwd_convert_d{d}_bf16_tiled_varlen_sm90"
    prep, f, conv = (x[2] for x in launched)
    assert (f["cu_seqlens_q"], f["cu_seqlens_k"]) == (12 << 24, 13 << 24)
    assert prep["cu_seqlens_q"] == conv["cu_seqlens_q"] == 12 << 24
    assert (f["seqlen_q_arg"], f["seqlen_k_arg"], f["nheads"], f["ngroups"]) == (mq, mk, h, h // hk)
    head_rows, rows = backward.stats_rows(b, mq, h, tq)
    assert f["head_rows"] == prep["head_rows"] == conv["head_rows"] == head_rows
    assert (f["dk_sb"], f["dk_ss"], f["dk_sh"]) == (hk * d, hk * d, d)  # token stride as batch stride
    assert (conv["dq_sb"], conv["dq_ss"]) == (h * d, h * d)
    # the maps, in the struct's order q, k, v, dout: (ptr, shape, strides, box rows, dtype)
    assert [m[1:] for m in maps] == [
        ((1, tq, h, d), (tq * 3 * h * d, 3 * h * d, d, 1), main.block_m, "bf16"),
        ((1, tk, hk, d), (tk * hk * d, hk * d, d, 1), main.block_n, "bf16"),
        ((1, tk, hk, d), (tk * hk * d, hk * d, d, 1), main.block_n, "bf16"),
        ((1, tq, h, d), (tq * h * d, h * d, d, 1), main.block_m, "bf16")]
    assert [m[0] for m in maps] == [1 << 24, 4 << 24, 5 << 24, 2 << 24]
    floats = backward.workspace_floats(plan, tq)
    sem = f["dq_sem"] if deterministic else 0
    if deterministic:  # the semaphores are the workspace's last cdiv(rows, 64) words
        assert sem == (9 << 24) + 4 * (floats - -(-rows // 64)) and rows % 64
    assert f["dq_accum"] == (9 << 24) + 8 * rows and f["lse2"] == 9 << 24 and f["dsum"] == (9 << 24) + 4 * rows


# ---------------------------------------------------------------------------------------------
# On an sm_90 GPU

# (query length, key length) per sequence: an empty query sequence with keys, an empty key
# sequence with queries, single tokens, lengths at and across the 64- and 128-row tiles, more
# queries than keys and the reverse.
LENGTHS = [(0, 5), (1, 1), (64, 128), (65, 129), (200, 70), (7, 0), (130, 300), (1, 239), (128, 64), (33, 33)]


@pytest.fixture
def ran(monkeypatch):
    """The names of the kernels the backward loads (compiler.get_kernel), to check bwd_ws ran."""
    from cuflash import compiler
    names, get = [], compiler.get_kernel
    monkeypatch.setattr(compiler, "get_kernel",
                        lambda variant, device: names.append(variant.name) or get(variant, device))
    return names


def _case(rng, lengths, h, hk, d, dtype, tail=0):
    """Packed q, k, v, dout (torch, CUDA) for (query, key) lengths and cu_seqlens (NumPy int32);
    ``tail`` extra tokens of k and v after the last sequence's."""
    import torch
    lq, lk = zip(*lengths)
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    tdt = getattr(torch, dtype)
    mk = lambda *s: torch.from_numpy(rng.standard_normal(s, dtype=np.float32)).to("cuda", tdt)  # noqa: E731
    return mk(int(cq[-1]), h, d), mk(int(ck[-1]) + tail, hk, d), mk(int(ck[-1]) + tail, hk, d), \
        mk(int(cq[-1]), h, d), cq, ck


def _run(ran, q, k, v, dout, cq, ck, *, deterministic=False, poison=True, **mods):
    """Forward (cuflash.attention_varlen) for out and LSE, then attention_varlen_backward into
    NaN-filled gradients; checks that the warp-specialised kernel and its varlen convert ran."""
    import torch
    import cuflash
    from cuflash.backward import attention_varlen_backward
    cqd, ckd = torch.from_numpy(cq).cuda(), torch.from_numpy(ck).cuda()
    mq, mk = int(np.diff(cq).max()), int(np.diff(ck).max())
    out, lse = cuflash.attention_varlen(q, k, v, cqd, ckd, mq, mk, return_lse=True, **mods)
    bufs = {}
    if poison:
        bufs = dict(dq=torch.full_like(q, float("nan")), dk=torch.full_like(k, float("nan")),
                    dv=torch.full_like(v, float("nan")))
    ran.clear()
    grads = attention_varlen_backward(dout, q, k, v, out, lse, cqd, ckd, mq, mk, deterministic=deterministic,
                                      **mods, **bufs)
    ws = [n for n in ran if n.startswith("bwd_ws_")]
    assert len(ws) == 1 and "_varlen_" in ws[0], ran
    assert ("_ordered_" in ws[0]) == deterministic, ws
    # (80-query dq_t steps: rows padded to 80 by bwd_prep, the swizzled rows' convert)
    dq_t = "_dqT" in ws[0]
    assert any(n.startswith("bwd_convert_") and n.endswith("_swz_sm90" if dq_t else "_tiled_varlen_sm90")
               for n in ran), ran
    assert any(n.startswith("bwd_prep_") and ("_r80_" in n) == dq_t for n in ran), ran
    return grads


def _check(grads, dout, q, k, v, cq, ck, **mods):
    """flash-attn's rule: each gradient within twice the same-precision reference's error of the
    float64 reference, plus 2e-4 (rows of k and v outside every sequence: untouched)."""
    from cuflash.reference import attention_varlen_backward, max_abs_err
    from test_gpu_backward import _mods_np, to_np
    nk = int(ck[-1])
    args = [to_np(x) for x in (dout, q, k[:nk], v[:nk])]
    kw = _mods_np(mods)
    ref64 = attention_varlen_backward(*args, cq, ck, **kw)
    same = attention_varlen_backward(*args, cq, ck, precision="same", **kw)
    for name, g, r, s in zip(("dq", "dk", "dv"), (grads[0], grads[1][:nk], grads[2][:nk]), ref64, same):
        err, bound = max_abs_err(to_np(g), r), 2 * max_abs_err(s, r) + 2e-4
        assert err <= bound, f"{name}: max error {err:.3g} exceeds bound {bound:.3g} ({mods})"


def _slopes(rng, kind, b, h):
    from test_bwd_ws_mods import _slopes
    return _slopes(rng, kind, b, h)


MASKS = {"full": dict(causal=False), "causal": dict(causal=True), "local": dict(window_size=(37, 5))}


@requires_sm90
@requires_torch
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_against_reference(rng, ran, d, dtype, mask, deterministic):
    """GQA 6/2 over LENGTHS, every mask and dQ mode."""
    q, k, v, dout, cq, ck = _case(rng, LENGTHS, 6, 2, d, dtype)
    grads = _run(ran, q, k, v, dout, cq, ck, deterministic=deterministic, **MASKS[mask])
    _check(grads, dout, q, k, v, cq, ck, **MASKS[mask])


@requires_sm90
@requires_torch
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("softcap, alibi", [(5.0, None), (0.0, "h"), (30.0, "bh")], ids=str)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_score_modifiers(rng, ran, d, softcap, alibi, mask, deterministic):
    """Softcap and ALiBi (per head, or per sequence and head) with every mask and dQ mode."""
    if softcap and alibi and d in bwd_ws.NO_SOFTCAP_ALIBI:
        pytest.skip(f"softcap with ALiBi at d = {d} runs on the other backward kernels")
    q, k, v, dout, cq, ck = _case(rng, LENGTHS, 4, 2, d, "bfloat16")
    mods = dict(MASKS[mask], softcap=softcap, alibi_slopes=_slopes(rng, alibi, len(LENGTHS), 4))
    grads = _run(ran, q, k, v, dout, cq, ck, deterministic=deterministic, **mods)
    _check(grads, dout, q, k, v, cq, ck, **mods)


@requires_sm90
@requires_torch
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_sequences_without_queries_or_keys_and_strided_tokens(rng, ran, d):
    """q, k, v sliced from packed (total, 3, h, d) tensors (token strides of 3 h d), k and v with
    tokens after the last sequence's: a sequence with keys but no query gets zero dk and dv, one
    with queries but no key zero dq; rows of dk, dv past the last sequence stay untouched."""
    import torch
    lengths = [(50, 70), (0, 20), (33, 0), (1, 1), (130, 257)]
    cq = np.concatenate([[0], np.cumsum([a for a, _ in lengths])]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum([b for _, b in lengths])]).astype(np.int32)
    total = int(ck[-1]) + 9
    qkv = torch.from_numpy(rng.standard_normal((total, 3, 4, d), dtype=np.float32)).to("cuda", torch.bfloat16)
    q, k, v = qkv[:cq[-1], 0], qkv[:, 1], qkv[:, 2]
    dout = torch.from_numpy(rng.standard_normal(q.shape, dtype=np.float32)).to("cuda", torch.bfloat16)
    dq, dk, dv = _run(ran, q, k, v, dout, cq, ck, causal=True)
    _check((dq, dk, dv), dout, q, k, v, cq, ck, causal=True)
    assert torch.all(dk[70:90] == 0) and torch.all(dv[70:90] == 0)
    assert torch.all(dq[50:83] == 0)
    assert torch.isnan(dk[ck[-1]:]).all() and torch.isnan(dv[ck[-1]:]).all()


@requires_sm90
@requires_torch
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_deterministic_is_bitwise_repeatable(rng, ran, d):
    import torch
    q, k, v, dout, cq, ck = _case(rng, LENGTHS, 8, 2, d, "bfloat16")
    mods = dict(window_size=(64, 0), softcap=30.0 if d != 64 else 0.0, alibi_slopes=_slopes(rng, "bh", len(LENGTHS), 8))
    first = [g.clone() for g in _run(ran, q, k, v, dout, cq, ck, deterministic=True, poison=False, **mods)]
    for _ in range(3):
        again = _run(ran, q, k, v, dout, cq, ck, deterministic=True, poison=False, **mods)
        for a, b in zip(again, first):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    _check(first, dout, q, k, v, cq, ck, **mods)


@requires_sm90
@requires_torch
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_equal_lengths_match_the_dense_kernel(rng, ran, monkeypatch, d, causal):
    """Equal lengths packed, deterministic: the same products in the same order as the dense
    bwd_ws call on the same rows, from the same out and LSE: bitwise equal."""
    import torch
    import cuflash
    from cuflash.backward import attention_backward, attention_varlen_backward
    from test_bwd_ws import _inputs
    b, sq, sk, h, hk = 3, 97, 130, 4, 2
    q, k, v, dout = _inputs(rng, b, sq, sk, h, hk, d, "bfloat16")
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    ran.clear()
    # (packed sequences have no 80-query steps and one run of key blocks: the dense call neither)
    with monkeypatch.context() as m:
        planned = bwd_ws.planned
        m.setattr(bwd_ws, "planned", lambda *a: replace(planned(*a), dq_t=False, dq_groups=1))
        forget_plans()
        dense = attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
    forget_plans()
    assert any(n.startswith("bwd_ws_") and "_varlen" not in n and "_dqT" not in n for n in ran), ran
    cq = torch.arange(b + 1, dtype=torch.int32, device="cuda") * sq
    ck = torch.arange(b + 1, dtype=torch.int32, device="cuda") * sk
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    lse_packed = lse.permute(1, 0, 2).reshape(h, -1)  # (nheads, total_q)
    ran.clear()
    packed = attention_varlen_backward(flat(dout), flat(q), flat(k), flat(v), flat(out), lse_packed, cq, ck, sq, sk,
                                       causal=causal, deterministic=True)
    assert any(n.startswith("bwd_ws_") and "_varlen_" in n for n in ran), ran
    for x, y in zip(packed, dense):
        assert torch.equal(x.view(torch.int16), flat(y).view(torch.int16))


@requires_sm90
@requires_torch
def test_gpu_long_sequences_against_the_other_kernels(rng, ran):
    """Many key blocks per sequence (GQA 16/2, d = 128, causal): the atomic dQ, dK and dV against
    the kernels planned without bwd_ws within the reference rule's scale."""
    import torch
    q, k, v, dout, cq, ck = _case(rng, [(1500, 2048), (2048, 1300), (1, 700)], 16, 2, 128, "bfloat16")
    a = _run(ran, q, k, v, dout, cq, ck, causal=True)
    saved = plan_mod.BWD_WS
    plan_mod.BWD_WS = False
    plan_mod.forget_plans()
    try:
        import cuflash
        from cuflash.backward import attention_varlen_backward
        cqd, ckd = torch.from_numpy(cq).cuda(), torch.from_numpy(ck).cuda()
        out, lse = cuflash.attention_varlen(q, k, v, cqd, ckd, 2048, 2048, causal=True, return_lse=True)
        ran.clear()
        w = attention_varlen_backward(dout, q, k, v, out, lse, cqd, ckd, 2048, 2048, causal=True)
        assert not any(n.startswith("bwd_ws_") for n in ran), ran
    finally:
        plan_mod.BWD_WS = saved
        plan_mod.forget_plans()
    for name, x, y in zip(("dq", "dk", "dv"), a, w):
        assert torch.isfinite(x).all(), name
        err = (x.float() - y.float()).abs().max().item()
        assert err <= 2e-2 * y.float().abs().max().item() + 1e-3, (name, err)
