"""cuflash.plan: FA2's split-KV heuristic against hand-computed cases, GQA packing, head-dim
buckets, and plans made from shapes or NumPy arrays with no GPU."""
import dataclasses

import numpy as np
import pytest

import cuflash
from cuflash import api, arrays
from cuflash.plan import DeviceFacts, num_splits_heuristic


# ---------------------------------------------------------------------------------------------
# num_splits_heuristic(batch_nheads_mblocks, num_slots, num_n_blocks, max_splits=128)

def test_fa2_comment_example():
    # FA2's comment: 48 blocks on 108 SMs: 2 splits (96/108 = 0.89) beat 3 (144/216 = 0.67).
    # With 128 K/V blocks, 9 splits fill exactly 4 waves (432/108 = 4.0, efficiency 1.0), so
    # the threshold is 0.85; 2 is the smallest eligible count reaching it (1 gives 0.444).
    splits, table = num_splits_heuristic(48, 108, 128)
    assert splits == 2
    eff = dict(table)
    assert len(table) == 108  # min(128 max splits, 108 slots, 128 blocks)
    assert eff[1] == pytest.approx(48 / 108)
    assert eff[2] == pytest.approx(96 / 108)
    assert eff[3] == pytest.approx((144 / 108) / 2)
    assert eff[9] == pytest.approx(1.0)


@pytest.mark.parametrize("work,slots", [(87, 108), (88, 110), (4096, 264), (108, 108)])
def test_at_least_80_percent_full_is_one_split(work, slots):
    assert num_splits_heuristic(work, slots, 1000) == (1, ())


def test_just_below_80_percent_is_considered():
    # 86 < 86.4 = 0.8 * 108, so splitting is considered: 1..4 splits all give 0.796
    # (86s/108 waves), 5 gives 430/108 = 3.98 waves -> 0.995, and 0.796 < 0.85 * 0.995 -> 5.
    splits, table = num_splits_heuristic(86, 108, 1000)
    assert splits == 5 and len(table) == 108
    assert dict(table)[5] == pytest.approx(430 / 108 / 4)


def test_ineligible_split_counts():
    # 64 K/V blocks: ceil(64/8) = ceil(64/9) = 8 and ceil(64/11) = ceil(64/12) = 6, so 9 and 12
    # splits are the same as 8 and 11 and are ineligible. 1 block on 12 slots: efficiency s/12;
    # the best eligible is 11/12 (not 12/12), threshold 0.85 * 11/12 = 0.779 -> 10 (10/12 = 0.833).
    # (Were 12 eligible, the threshold would be 0.85 and the answer 11.)
    splits, table = num_splits_heuristic(1, 12, 64)
    assert splits == 10
    assert [s for s, e in table if e is None] == [9, 12]
    assert dict(table)[11] == pytest.approx(11 / 12)


def test_max_splits_caps():
    assert num_splits_heuristic(4, 264, 1) == (1, ((1, 4 / 264),))  # one K/V block: nothing to split
    splits, table = num_splits_heuristic(1, 264, 1000, max_splits=4)
    assert splits == 4 and [s for s, _ in table] == [1, 2, 3, 4]
    splits, table = num_splits_heuristic(1, 6, 1000)  # capped by the slots
    assert splits == 6 and len(table) == 6


# ---------------------------------------------------------------------------------------------
# Plans

def qwen_decode(sk, **kw):
    """Qwen2.5-7B decode step: 28 query heads on 4 KV heads, d=128, one new token, H100, with
    FlashAttention-2's split rule (the behaviour the explain command must reproduce)."""
    kw = {"causal": True, "num_sms": 132, "arch": 90, "heuristic": "fa2", **kw}
    return cuflash.plan((1, 1, 28, 128), (1, sk, 4, 128), (1, sk, 4, 128), **kw)


@pytest.mark.parametrize("sk", [40 + 64, 128])
def test_qwen_decode_short_context_single_kernel(sk):
    # 1*4*1 = 4 blocks on 264 slots, but block_n=128 gives a single K/V block: nothing to split
    p = qwen_decode(sk)
    assert len(p.kernels) == 1 and p.kernels[0].startswith("fwd_d128_bf16_full_m")
    assert p.kernels[0].endswith("_sm90")
    assert p.num_splits == 1 and p.workspace_bytes == 0
    assert "only 1 K/V block" in p.reason and "standard kernel" in p.reason
    assert "causal with seqlen_q=1 sees every key" in p.reason and not p.causal_eff


def test_qwen_decode_long_context_splits_5_ways():
    # ceil(552/128) = 5 K/V blocks, 4 splits is ineligible (ceil(5/4) == ceil(5/3) == 2),
    # efficiency 4s/264 is best at s=5 and nothing smaller reaches 85% of it.
    p = qwen_decode(40 + 512)
    assert p.kernels[0].startswith("fwd_split_d128_bf16_full_m16n64w4")
    assert p.kernels[1] == "combine_d128_bf16_sm90"
    assert p.kernels[0].startswith("fwd_split_") and p.kernels[1].startswith("combine_")
    assert p.num_splits == 5 and p.n_blocks_per_split == 2  # ceil(ceil(552 / 64) / 5): the kernel's 64-key tiles
    assert [s for s, e in p.efficiency if e is None] == [4]
    assert p.launches[0].grid == (1, 4, 5) and p.launches[1].grid == (7, 1, 1)
    assert p.workspace_bytes == 5 * (1 * 4 * 7) * (128 + 1) * 4
    for frag in ("1*4*1 = 4 blocks", "264 slots", "5 K/V blocks", "5 is the smallest eligible split count",
                 "num_splits_heuristic", "combine kernel"):
        assert frag in p.reason, frag
    text = str(p)
    assert all(name in text for name in p.kernels) and "num_splits=5" in text and "4:-" in text


def test_forced_num_splits():
    p1 = qwen_decode(40 + 512, num_splits=1)
    assert len(p1.launches) == 1 and p1.kernels[0].startswith("fwd_d128") and p1.num_splits == 1
    assert "num_splits=1 was requested" in p1.reason
    p7 = qwen_decode(40 + 512, num_splits=7)
    assert p7.num_splits == 7 and p7.kernels[0].startswith("fwd_split_") and p7.kernels[1].startswith("combine_")
    assert p7.launches[0].grid[2] == 7 and "2 split(s) get none" in p7.reason
    assert qwen_decode(128, num_splits=7).num_splits == 7  # forced even with one K/V block


def test_gqa_packing_only_for_one_query():
    p = qwen_decode(552)
    assert p.pack_gqa and p.seqlen_q_eff == 7 and p.nheads_eff == 4 and p.ngroups_eff == 1
    assert "seqlen_q/ngroups swap" in p.reason
    p2 = cuflash.plan((1, 2, 28, 128), (1, 552, 4, 128), (1, 552, 4, 128), causal=True, num_sms=132)
    assert not p2.pack_gqa and p2.seqlen_q_eff == 2 and p2.nheads_eff == 28 and p2.ngroups_eff == 7
    assert p2.causal_eff
    mha = cuflash.plan((1, 1, 8, 128), (1, 552, 8, 128), (1, 552, 8, 128), num_sms=132)
    assert not mha.pack_gqa and mha.seqlen_q_eff == 1


@pytest.mark.parametrize("num_sms", [16, 108, 132, 144])
@pytest.mark.parametrize("causal", [False, True])
def test_large_prefill_never_splits(num_sms, causal):
    s = (8, 2048, 16, 128)  # 8*16*32 = 4096 blocks
    p = cuflash.plan(s, s, s, causal=causal, num_sms=num_sms, arch=90)
    assert p.num_splits == 1 and len(p.launches) == 1 and p.efficiency == ()
    assert p.kernels[0].startswith("fwd_ws_d128_") and ">= 80% of the GPU" in p.reason


@pytest.mark.parametrize("d,bucket,kernel_d,dpred", [
    (40, 64, 40, True), (59, 64, 64, False), (64, 64, 64, False), (111, 128, 112, True),
    (128, 128, 128, False), (8, 32, 8, True), (160, 192, 160, True), (256, 256, 256, False),
])
def test_head_dim_buckets(d, bucket, kernel_d, dpred):
    p = cuflash.plan((2, 256, 8, d), (2, 256, 8, d), (2, 256, 8, d), num_sms=132, arch=90, num_splits=1)
    name = p.kernels[0]
    # the full head dims 64, 128 and 256 run the warp-specialised kernel on sm_90
    family = "fwd_ws" if kernel_d == bucket in (64, 128, 256) else "fwd"
    assert name.startswith(f"{family}_d{bucket}_") and ("_dpred" in name) == dpred
    assert p.problem.head_dim == kernel_d and p.launches[0].variant.head_dim == bucket


def test_plan_with_no_gpu_and_arch_spellings():
    s = (1, 128, 4, 64)
    for arch in (80, "80", "sm_80", "sm80", "SM_80"):
        p = cuflash.plan(s, s, s, num_sms=108, arch=arch, dtype="float16")
        assert p.device == DeviceFacts(108, 80) and p.kernels[0].endswith("_sm80")
        assert "_fp16_" in p.kernels[0]
    assert cuflash.plan(s, s, s, num_sms=108).device.arch == 90  # default arch


def test_plan_from_numpy_arrays():
    q, k = np.zeros((1, 1, 28, 128), np.float16), np.zeros((1, 552, 4, 128), np.float16)
    p = cuflash.plan(q, k, k, causal=True, num_sms=132, arch=90, heuristic="fa2")
    assert p == qwen_decode(552, dtype="float16") and p.problem.dtype == "fp16"
    assert p.kernels[0].startswith("fwd_split_d128_fp16_full_m16n64w4")
    assert p.kernels[1] == "combine_d128_fp16_sm90"


@pytest.mark.parametrize("kw,exc,match", [
    ({"heuristic": "other"}, ValueError, "heuristic must be 'cuflash' or 'fa2', got 'other'"),
    ({"num_sms": 0}, ValueError, "num_sms must be a positive int, got 0"),
    ({"num_sms": True}, ValueError, "num_sms must be a positive int"),
    ({"arch": "ampere"}, ValueError, "arch must look like"),
    ({"dtype": "float32"}, TypeError, "dtype must be one of"),
    ({"num_splits": 200}, ValueError, "num_splits"),
])
def test_plan_bad_arguments(kw, exc, match):
    s = (1, 128, 4, 64)
    with pytest.raises(exc, match=match):
        cuflash.plan(s, s, s, **{"num_sms": 132, **kw})


def test_plan_is_frozen():
    p = qwen_decode(552)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.num_splits = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.problem.seqlen_k = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.launches[0].grid = (1, 1, 1)
    assert hash(p) == hash(qwen_decode(552))


# ---------------------------------------------------------------------------------------------
# Regressions: cases that once misbehaved

def test_plan_rejects_non_bool_causal():
    with pytest.raises(TypeError, match="causal"):
        qwen_decode(552, causal="yes")


def test_plan_parses_arch_when_asking_the_gpu(monkeypatch):
    monkeypatch.setattr(arrays, "current_device", lambda: 0)
    monkeypatch.setattr(api, "device_facts", lambda dev: DeviceFacts(132, 90))
    s = (1, 128, 4, 64)
    p = cuflash.plan(s, s, s, arch="sm_80")
    assert p.device.arch == 80 and p.kernels[0].endswith("_sm80")


def test_empty_kv_reason_is_not_full_gpu():
    p = qwen_decode(0)
    assert p.num_splits == 1
    assert ">= 80%" not in p.reason


# ---------------------------------------------------------------------------------------------
# cuflash's own decode split rule (the default): about one block per SM, >= 2 tiles per split

@pytest.mark.parametrize("h,hk,b,sk,splits", [
    (28, 4, 1, 104, 1),     # 2 tiles of 64 keys: not worth a second launch
    (28, 4, 1, 552, 3),     # 9 tiles: min(132 // 4, 9 // 2) = 4, normalised to 3 splits of 3 tiles
    (32, 8, 1, 4096, 16),   # 132 // 8 = 16 blocks per KV head
    (32, 8, 1, 32768, 16),
    (28, 4, 1, 32768, 32),  # 132 // 4 = 33 -> 32 (same 16 tiles per split)
    (32, 8, 8, 4096, 2),
    (32, 8, 64, 4096, 1),   # 512 blocks already fill the GPU
])
def test_cuflash_decode_rule(h, hk, b, sk, splits):
    p = cuflash.plan((b, 1, h, 128), (b, sk, hk, 128), (b, sk, hk, 128), causal=True, num_sms=132, arch=90)
    assert p.num_splits == splits
    assert ("FA2's rule would pick" in p.reason) and ("decode" in p.reason)
    assert len(p.kernels) == (2 if splits > 1 else 1)


def test_qwen_explain_defaults_agree_with_fa2_on_the_motivating_question():
    short = cuflash.plan((1, 1, 28, 128), (1, 104, 4, 128), (1, 104, 4, 128), causal=True, num_sms=132)
    long = cuflash.plan((1, 1, 28, 128), (1, 552, 4, 128), (1, 552, 4, 128), causal=True, num_sms=132)
    assert len(short.kernels) == 1 and len(long.kernels) == 2 and long.num_splits > 1


def test_unknown_heuristic_rejected():
    with pytest.raises(ValueError, match="heuristic must be 'cuflash' or 'fa2'"):
        qwen_decode(552, heuristic="other")


@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_plan_names_its_kernels_and_why(deterministic):
    """cuflash.plan(..., backward=True) plans the backward: prep, dK/dV (the warp-specialised
    kernel on sm_90 at d=128, mma.sync on sm_80), and atomic dQ + convert or, deterministic, the
    dQ kernel (sm_80) or the warp-specialised kernel's ordered dQ adds + convert (sm_90)."""
    import cuflash
    for arch, mma in ((90, "bwd_ws_"), (80, "_dpred_m")):
        p = cuflash.plan((2, 1000, 16, 128), (2, 1000, 4, 128), (2, 1000, 4, 128), causal=True, num_sms=132,
                         arch=arch, backward=True, deterministic=deterministic)
        assert p.backward and str(p).startswith("cuflash backward plan:")
        kinds = [l.variant.kind.replace("bwd_ws_", "bwd_") for l in p.launches]
        assert kinds == (["bwd_prep", "bwd_dkdv", "bwd_dq"] if deterministic and arch == 80
                         else ["bwd_prep", "bwd_dkdv_dq", "bwd_convert"])
        assert mma in p.launches[1].name and f"deterministic={deterministic}" in str(p)
        assert p.launches[1].grid == (8, 4, 2)  # 1000 keys in blocks of 128, KV heads, batch
        assert ("bitwise repeatable" in p.reason) == deterministic
    with pytest.raises(TypeError, match="backward must be a bool"):
        cuflash.plan((1, 8, 2, 64), (1, 8, 2, 64), (1, 8, 2, 64), num_sms=132, backward="yes")


def test_grids_beyond_cuda_limits_are_refused_or_folded():
    """Heads beyond 65535 (grid y) or a forced split count whose batch x splits passes 65535
    (grid z) raise a ValueError before anything is allocated; the split heuristic never picks
    more splits than grid z can hold. Persistent blocks (sm_90, at most 1024 keys; d = 128: 2048)
    walk any number of tiles from a grid of one block per SM (d = 64 dense: at most 4096 keys)."""
    import cuflash
    with pytest.raises(ValueError, match=r"grid of \(1, 70000, 1\).*at most"):
        cuflash.plan((1, 128, 70000, 128), (1, 2100, 70000, 128), (1, 2100, 70000, 128), num_sms=132)
    p = cuflash.plan((1, 128, 70000, 64), (1, 4096, 70000, 64), (1, 4096, 70000, 64), num_sms=132)
    assert p.launches[0].grid == (132, 1, 1) and p.launches[0].variant.persistent
    p = cuflash.plan((1, 128, 70000, 64), (1, 128, 70000, 64), (1, 128, 70000, 64), num_sms=132)
    assert p.launches[0].grid == (132, 1, 1) and p.launches[0].variant.persistent
    with pytest.raises(ValueError, match=r"grid of .*131072\).*fewer splits"):
        cuflash.plan((1024, 1, 8, 64), (1024, 4096, 8, 64), (1024, 4096, 8, 64), num_sms=132, num_splits=128)
    with pytest.raises(ValueError, match=r"grid of .*70000\)"):
        cuflash.plan((70000, 16, 2, 128), (70000, 2100, 2, 128), (70000, 2100, 2, 128), num_sms=132)
    p = cuflash.plan((4000, 1, 8, 128), (4000, 65536, 8, 128), (4000, 65536, 8, 128), num_sms=132)
    assert p.launches[0].grid[2] <= 65535


def test_forget_plans_drops_derived_caches(monkeypatch):
    """forget_plans clears the planner's caches and every cache derived from plans (api's per-call
    plans and repeated launches, the backward's repeated launches), so that a changed switch takes
    effect on the next call."""
    import importlib
    plan_mod = importlib.import_module("cuflash.plan")
    backward = importlib.import_module("cuflash.backward")
    for cache in (api._plans, api._repeats, backward._repeats):
        monkeypatch.setitem(cache, "key", "entry")
    cuflash.plan((1, 8, 2, 64), (1, 8, 2, 64), (1, 8, 2, 64), num_sms=132, arch=90)
    cuflash.plan((1, 8, 2, 64), (1, 8, 2, 64), (1, 8, 2, 64), num_sms=132, arch=90, backward=True)
    assert plan_mod.make_plan.cache_info().currsize > 0 and plan_mod.make_backward_plan.cache_info().currsize > 0
    plan_mod.forget_plans()
    assert not api._plans and not api._repeats and not backward._repeats
    assert plan_mod.make_plan.cache_info().currsize == plan_mod.make_backward_plan.cache_info().currsize == 0


def test_short_dense_prefills_are_not_split_on_sm90():
    """sm_90: a dense prefill of 128-512 queries over at most 512 keys runs fwd_ws in one launch
    where FA2's rule would split; decode, KV caches, packed sequences, windows, shorter query
    blocks, more keys, sm_80 and heuristic='fa2' keep their splits."""
    from cuflash.plan import Problem, make_plan
    h100, a100 = DeviceFacts(132, 90), DeviceFacts(108, 80)

    def splits(sq=256, sk=256, dev=h100, **kw):
        return make_plan(Problem(1, sq, sk, 32, 8, 128, "bf16", causal=True, **kw), dev)
    p = splits()
    assert p.num_splits == 1 and p.kernels[0].startswith("fwd_ws_") and "at most 512 keys" in p.reason
    assert splits(heuristic="fa2").num_splits == 2
    assert splits(dev=a100).num_splits == splits(dev=a100, heuristic="fa2").num_splits  # (sm_80: FA2's rule)
    for kw in (dict(sq=32, sk=512, kv="cache"), dict(sq=64, sk=512), dict(varlen=True), dict(window=(64, 0)),
               dict(sq=1, sk=4096), dict(sq=256, sk=4096)):
        fa2 = splits(heuristic="fa2", **kw).num_splits
        assert fa2 == 1 or splits(**kw).num_splits > 1, kw
