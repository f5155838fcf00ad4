"""attention_varlen, and the window_size / softcap / alibi_slopes keywords of every entry point,
reject bad input with a ValueError/TypeError naming the argument, the expected and the actual
value, before anything is allocated or launched (no GPU needed: hand-made device views stand in
for arrays, and any allocation or launch fails the test)."""
import contextlib

import numpy as np
import pytest

import cuflash
from cuflash import api, arrays
from cuflash.arrays import View
from cuflash.plan import DeviceFacts
from conftest import GPU_PROBLEM, fake_view


def dev(shape, dtype="float16", device=0, strides=None, ptr=1 << 20):
    return fake_view(device, shape, dtype, strides, ptr)


OUT_PTR = 1 << 36  # a valid out's address: apart from the inputs' (out must share no memory with them)


def i32(shape, device=0, strides=None):
    return dev(shape, "int32", device, strides)


def f32(shape, device=0, strides=None):
    return dev(shape, "float32", device, strides)


@pytest.fixture(autouse=True)
def views(fake_views):
    """Every test here runs on hand-made device views."""


REACHED = "validation passed: allocation or launch reached"  # conftest's fake_views

# Two packed sequences, 10 query rows and 12 key rows in all, 8 query heads on 2 K/V heads.
B, H, HK, D = 2, 8, 2, 64
Q, KV, CU = (10, H, D), (12, HK, D), (B + 1,)
MAX_Q, MAX_K = 6, 8
PAGED, TABLE = (20, 16, HK, D), (B, 4)  # pages of 16 keys, 4 pages per sequence: 64 keys


def varlen_args(**kw):
    args = dict(q=dev(Q), k=dev(KV), v=dev(KV), cu_seqlens_q=i32(CU), cu_seqlens_k=i32(CU),
                max_seqlen_q=MAX_Q, max_seqlen_k=MAX_K)
    args.update(kw)
    return args


def paged(**kw):
    """varlen_args() replacements for a paged K/V cache (plus ``kw``)."""
    args = dict(k=dev(PAGED), v=dev(PAGED), block_table=i32(TABLE))
    args.update(kw)
    return args


def call_varlen(args):
    args = dict(args)
    pos = [args.pop(n) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")]
    return cuflash.attention_varlen(*pos, **args)


def check_message(ei, fragments):
    msg = str(ei.value)
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in message {msg!r}"


# name -> (arguments replaced in varlen_args(), exception, fragments of the message)
CASES = {
    # ranks
    "q_rank": (dict(q=dev((B, 5, H, D))), ValueError,
               ["q must have 3 dims (total_q, nheads, headdim), got shape (2, 5, 8, 64)"]),
    "k_rank_dense": (dict(k=dev((B, 6, HK, D))), ValueError,
                     ["k must have 3 dims (total_k, nheads_k, headdim), got shape (2, 6, 2, 64)"]),
    "v_rank_dense": (dict(v=dev((12, HK))), ValueError,
                     ["v must have 3 dims (total_k, nheads_k, headdim), got shape (12, 2)"]),
    "k_rank_paged": (dict(block_table=i32(TABLE)), ValueError,
                     ["k must have 4 dims (num_pages, page_size, nheads_k, headdim) with block_table",
                      "got shape (12, 2, 64)"]),
    "v_rank_paged": (paged(v=dev(KV)), ValueError,
                     ["v must have 4 dims (num_pages, page_size, nheads_k, headdim) with block_table",
                      "got shape (12, 2, 64)"]),
    # cu_seqlens
    "cu_q_not_array": (dict(cu_seqlens_q=[0, 4, 10]), TypeError, ["cu_seqlens_q must be an array", "got list"]),
    "cu_q_dtype": (dict(cu_seqlens_q=dev(CU, "int64")), TypeError, ["cu_seqlens_q must be int32, got int64"]),
    "cu_k_dtype": (dict(cu_seqlens_k=f32(CU)), TypeError, ["cu_seqlens_k must be int32, got float32"]),
    "cu_q_rank_2": (dict(cu_seqlens_q=i32((3, 1))), ValueError,
                    ["cu_seqlens_q must have shape (batch + 1,), got (3, 1)"]),
    "cu_k_rank_0": (dict(cu_seqlens_k=i32(())), ValueError, ["cu_seqlens_k must have shape (batch + 1,), got ()"]),
    "cu_q_empty": (dict(cu_seqlens_q=i32((0,))), ValueError, ["cu_seqlens_q must have shape (batch + 1,), got (0,)"]),
    "cu_q_strided": (dict(cu_seqlens_q=i32(CU, strides=(2,))), ValueError,
                     ["cu_seqlens_q must be contiguous, got strides (2,)"]),
    "cu_k_strided": (dict(cu_seqlens_k=i32(CU, strides=(-1,))), ValueError,
                     ["cu_seqlens_k must be contiguous, got strides (-1,)"]),
    "cu_shapes_differ": (dict(cu_seqlens_k=i32((B + 2,))), ValueError,
                         ["cu_seqlens_k must have cu_seqlens_q's shape (3,), got (4,)"]),
    # block_table and pages
    "table_not_array": (paged(block_table=[[0, 1, 2, 3]] * 2), TypeError,
                        ["block_table must be an array", "got list"]),
    "table_dtype": (paged(block_table=dev(TABLE, "int64")), ValueError,
                    ["block_table must be int32 of shape (2, pages_per_seq), got int64 (2, 4)"]),
    "table_rank": (paged(block_table=i32((8,))), ValueError,
                   ["block_table must be int32 of shape (2, pages_per_seq), got int32 (8,)"]),
    "table_batch": (paged(block_table=i32((B + 1, 4))), ValueError,
                    ["block_table must be int32 of shape (2, pages_per_seq), got int32 (3, 4)"]),
    "table_not_contiguous": (paged(block_table=i32(TABLE, strides=(1, 2))), ValueError,
                             ["block_table rows must be contiguous, got strides (1, 2)"]),
    "page_size_0": (paged(k=dev((20, 0, HK, D)), v=dev((20, 0, HK, D))), ValueError,
                    ["page size (k.shape[1]) must be positive, got 0"]),
    # max_seqlen_q / max_seqlen_k
    "max_q_float": (dict(max_seqlen_q=6.0), TypeError, ["max_seqlen_q must be an int, got float"]),
    "max_q_bool": (dict(max_seqlen_q=True), TypeError, ["max_seqlen_q must be an int, got bool"]),
    "max_k_none": (dict(max_seqlen_k=None), TypeError, ["max_seqlen_k must be an int, got NoneType"]),
    "max_k_str": (dict(max_seqlen_k="8"), TypeError, ["max_seqlen_k must be an int, got str"]),
    "max_q_negative": (dict(max_seqlen_q=-1), ValueError,
                       ["max_seqlen_q must be >= 0 (an upper bound on the sequence lengths; total_q is 10), got -1"]),
    "max_k_negative": (dict(max_seqlen_k=np.int64(-3)), ValueError,
                       ["max_seqlen_k must be >= 0", "total_k is 12), got -3"]),
    "max_k_negative_paged": (paged(max_seqlen_k=-1), ValueError,
                             ["max_seqlen_k must be >= 0", "pages_per_seq * page_size is 64), got -1"]),
    "max_q_beyond_int32": (dict(max_seqlen_q=2 ** 31), ValueError, ["max_seqlen_q must be at most"]),
    # shapes, dtypes, heads
    "v_shape_dense": (dict(v=dev((11, HK, D))), ValueError, ["v must have k's shape (12, 2, 64), got (11, 2, 64)"]),
    "v_shape_paged": (paged(v=dev((20, 32, HK, D))), ValueError,
                      ["v must have k's shape (20, 16, 2, 64), got (20, 32, 2, 64)"]),
    "q_dtype": (dict(q=f32(Q)), TypeError, ["q must be float16 or bfloat16, got float32", "cast it first"]),
    "k_dtype": (dict(k=dev(KV, "bfloat16")), TypeError, ["k must have q's dtype float16, got bfloat16"]),
    "v_dtype": (dict(v=dev(KV, "bfloat16")), TypeError, ["v must have q's dtype float16, got bfloat16"]),
    "k_dtype_paged": (paged(k=dev(PAGED, "bfloat16")), TypeError,
                      ["k must have q's dtype float16, got bfloat16"]),
    "nheads": (dict(q=dev((10, 6, D)), k=dev((12, 4, D)), v=dev((12, 4, D))), ValueError,
               ["nheads (6) must be divisible by nheads_k (4)"]),
    "nheads_k_0": (dict(k=dev((12, 0, D)), v=dev((12, 0, D))), ValueError,
                   ["nheads (8) must be divisible by nheads_k (0)"]),
    "nheads_paged": (paged(k=dev((20, 16, 3, D)), v=dev((20, 16, 3, D))), ValueError,
                     ["nheads (8) must be divisible by nheads_k (3)"]),
    "head_dims_differ": (dict(k=dev((12, HK, 32)), v=dev((12, HK, 32))), ValueError,
                         ["k must have q's head dim 64, got 32"]),
    "head_dim_264": (dict(q=dev((10, H, 264)), k=dev((12, HK, 264)), v=dev((12, HK, 264))), ValueError,
                     ["head dim (last dim of q and k) must be between 1 and 256, got 264"]),
    "q_last_dim_strided": (dict(q=dev(Q, strides=(H * D, 1, H))), ValueError,
                           ["q must be contiguous in its last dim (stride 1)"]),
    "k_last_dim_strided": (dict(k=dev(KV, strides=(HK * D, 1, HK))), ValueError,
                           ["k must be contiguous in its last dim (stride 1)"]),
    # placement
    "k_other_gpu": (dict(k=dev(KV, device=1)), ValueError, ["k is on GPU 1 but q is on GPU 0", "one device"]),
    "cu_q_other_gpu": (dict(cu_seqlens_q=i32(CU, device=1)), ValueError,
                       ["cu_seqlens_q is on GPU 1 but q is on GPU 0; all arrays must be on one device"]),
    "cu_k_other_gpu": (dict(cu_seqlens_k=i32(CU, device=3)), ValueError,
                       ["cu_seqlens_k is on GPU 3 but q is on GPU 0"]),
    "cu_k_host": (dict(cu_seqlens_k=i32(CU, device=-1)), ValueError,
                  ["cu_seqlens_k is in host memory but q is in GPU 0", "cannot be mixed"]),
    "table_other_gpu": (paged(block_table=i32(TABLE, device=1)), ValueError,
                        ["block_table is on GPU 1 but q is on GPU 0"]),
    # out
    "out_shape": (dict(out=dev((10, H, 32))), ValueError, ["out must have q's shape (10, 8, 64), got (10, 8, 32)"]),
    "out_4_dims": (dict(out=dev((B, MAX_Q, H, D))), ValueError,
                   ["out must have q's shape (10, 8, 64), got (2, 6, 8, 64)"]),
    "out_dtype": (dict(out=dev(Q, "bfloat16")), TypeError, ["out must have q's dtype float16, got bfloat16"]),
    "out_framework_torch": (dict(out=dev(Q)._replace(framework="torch")), TypeError,
                            ["out must be a cupy array like q, got a torch array"]),
    "out_framework_numpy": (dict(out=dev(Q)._replace(framework="numpy")), TypeError,
                            ["out must be a cupy array like q, got a numpy array"]),
    "out_other_gpu": (dict(out=dev(Q, device=1)), ValueError, ["out is on GPU 1 but q is on GPU 0"]),
    "out_last_dim_strided": (dict(out=dev(Q, strides=(H * D, 1, H))), ValueError,
                             ["out must be contiguous in its last dim, got strides (512, 1, 8)"]),
    # the arguments shared with attention()
    "scale_zero": (dict(softmax_scale=0.0), ValueError, ["softmax_scale must be a positive finite number, got 0.0"]),
    "scale_str": (dict(softmax_scale="0.1"), TypeError, ["softmax_scale must be a real number, got str"]),
    "causal_str": (dict(causal="yes"), TypeError, ["causal must be a bool, got str"]),
    "splits_129": (dict(num_splits=129), ValueError, ["num_splits must be between 0 (heuristic) and 128, got 129"]),
    "splits_float": (dict(num_splits=2.0), TypeError, ["num_splits must be an int, got float"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_varlen_rejects(case):
    kw, exc, fragments = CASES[case]
    with pytest.raises(exc) as ei:
        call_varlen(varlen_args(**kw))
    check_message(ei, fragments)


# ---------------------------------------------------------------------------------------------
# window_size, softcap, alibi_slopes: the same checks and messages on every entry point. Every
# call has batch 2 and 8 query heads, so ALiBi slopes are (8,) or (2, 8) everywhere.

ATT_Q, ATT_KV = (B, 4, H, D), (B, 6, HK, D)
CACHE_Q, CACHE = (B, 1, H, D), (B, 128, HK, D)


def call_attention(**kw):
    return cuflash.attention(dev(ATT_Q), dev(ATT_KV), dev(ATT_KV), **kw)


def call_kvcache(**kw):
    return cuflash.attention_with_kvcache(dev(CACHE_Q), dev(CACHE), dev(CACHE), cache_seqlens=100, **kw)


def call_varlen_mods(**kw):
    return call_varlen(varlen_args(**kw))


def call_varlen_paged(**kw):
    return call_varlen(varlen_args(**paged(**kw)))


def host_copy(x):
    """A NumPy array with a fake view's shape, dtype and strides (cuflash.plan reads tuples as
    shapes, and hand-made views are named tuples)."""
    item = np.dtype(x.dtype).itemsize
    base = np.zeros(1 + sum((n - 1) * abs(s) for n, s in zip(x.shape, x.strides)), x.dtype)
    return np.lib.stride_tricks.as_strided(base, x.shape, tuple(s * item for s in x.strides))


def call_plan(**kw):
    if isinstance(kw.get("alibi_slopes"), View):
        kw["alibi_slopes"] = host_copy(kw["alibi_slopes"])
    return cuflash.plan(ATT_Q, ATT_KV, ATT_KV, num_sms=132, arch=90, **kw)


ENTRY_POINTS = {"attention": call_attention, "attention_with_kvcache": call_kvcache,
                "attention_varlen": call_varlen_mods, "attention_varlen_paged": call_varlen_paged,
                "plan": call_plan}

PAIR = "window_size must be a pair of ints (left, right), got "
WINDOW_RANGE = "window_size entries must be >= 0, or -1 for unbounded; got "
SOFTCAP_RANGE = "softcap must be >= 0 and finite (0 disables it), got "
ALIBI_SHAPE = "alibi_slopes must have shape (8,) or (2, 8), got "

MOD_CASES = {
    "window_int": (dict(window_size=5), TypeError, [PAIR + "5"]),
    "window_none": (dict(window_size=None), TypeError, [PAIR + "None"]),
    "window_triple": (dict(window_size=(1, 2, 3)), TypeError, [PAIR + "(1, 2, 3)"]),
    "window_single": (dict(window_size=[4]), TypeError, [PAIR + "[4]"]),
    "window_float": (dict(window_size=(1.5, 0)), TypeError, [PAIR + "(1.5, 0)"]),
    "window_str": (dict(window_size=("8", 0)), TypeError, [PAIR + "('8', 0)"]),
    "window_bool": (dict(window_size=(True, 0)), TypeError, [PAIR + "(True, 0)"]),
    "window_float_array": (dict(window_size=np.array([4.0, 0.0])), TypeError, [PAIR + "array([4., 0.])"]),
    "window_array_3": (dict(window_size=np.array([4, 0, 1])), TypeError, [PAIR + "array([4, 0, 1])"]),
    "window_left_-2": (dict(window_size=(-2, 0)), ValueError, [WINDOW_RANGE + "(-2, 0)"]),
    "window_right_-5": (dict(window_size=[16, -5]), ValueError, [WINDOW_RANGE + "[16, -5]"]),
    "softcap_negative": (dict(softcap=-1.0), ValueError, [SOFTCAP_RANGE + "-1.0"]),
    "softcap_negative_int": (dict(softcap=-30), ValueError, [SOFTCAP_RANGE + "-30"]),
    "softcap_inf": (dict(softcap=float("inf")), ValueError, [SOFTCAP_RANGE + "inf"]),
    "softcap_nan": (dict(softcap=np.float32("nan")), ValueError, [SOFTCAP_RANGE + "nan"]),
    "softcap_str": (dict(softcap="30"), TypeError, ["softcap must be a real number, got str"]),
    "softcap_none": (dict(softcap=None), TypeError, ["softcap must be a real number, got NoneType"]),
    "softcap_bool": (dict(softcap=True), TypeError, ["softcap must be a real number, got bool"]),
    "softcap_complex": (dict(softcap=1j), TypeError, ["softcap must be a real number, got complex"]),
    "alibi_float16": (dict(alibi_slopes=dev((H,), "float16")), TypeError,
                      ["alibi_slopes must be float32, got float16"]),
    "alibi_float64": (dict(alibi_slopes=dev((B, H), "float64")), TypeError,
                      ["alibi_slopes must be float32, got float64"]),
    "alibi_nheads": (dict(alibi_slopes=f32((H - 1,))), ValueError, [ALIBI_SHAPE + "(7,)"]),
    "alibi_batch": (dict(alibi_slopes=f32((B + 1, H))), ValueError, [ALIBI_SHAPE + "(3, 8)"]),
    "alibi_transposed": (dict(alibi_slopes=f32((H, B))), ValueError, [ALIBI_SHAPE + "(8, 2)"]),
    "alibi_rank_3": (dict(alibi_slopes=f32((1, B, H))), ValueError, [ALIBI_SHAPE + "(1, 2, 8)"]),
    "alibi_strided": (dict(alibi_slopes=f32((H,), strides=(2,))), ValueError,
                      ["alibi_slopes must be contiguous in its last dim, got strides (2,)"]),
    "alibi_strided_2d": (dict(alibi_slopes=f32((B, H), strides=(1, B))), ValueError,
                         ["alibi_slopes must be contiguous in its last dim, got strides (1, 2)"]),
    "alibi_other_gpu": (dict(alibi_slopes=f32((H,), device=1)), ValueError,
                        ["alibi_slopes is on GPU 1 but q is on GPU 0; all arrays must be on one device"]),
    "alibi_host": (dict(alibi_slopes=f32((H,), device=-1)), ValueError,
                   ["alibi_slopes is in host memory but q is in GPU 0", "cannot be mixed"]),
    "alibi_not_array": (dict(alibi_slopes=0.5), TypeError, ["alibi_slopes must be an array", "got float"]),
}

# cuflash.plan describes shapes, not placements, and takes a tuple as the slopes' shape
PLAN_SKIPS = {"alibi_other_gpu", "alibi_host"}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("case", sorted(MOD_CASES))
def test_mods_rejected_everywhere(entry, case):
    if entry == "plan" and case in PLAN_SKIPS:
        pytest.skip("cuflash.plan takes shapes: no placement to check")
    kw, exc, fragments = MOD_CASES[case]
    with pytest.raises(exc) as ei:
        ENTRY_POINTS[entry](**kw)
    check_message(ei, fragments)


@pytest.mark.parametrize("slopes,fragment", [((7,), "(7,)"), ((3, 8), "(3, 8)"), ([8, 2], "(8, 2)")])
def test_plan_alibi_shape_tuples(slopes, fragment):
    with pytest.raises(ValueError) as ei:
        call_plan(alibi_slopes=slopes)
    check_message(ei, [ALIBI_SHAPE + fragment])
    for ok in (True, (H,), (B, H), np.ones((B, H), np.float32)):  # True means (nheads,)
        assert call_plan(alibi_slopes=ok).problem.alibi


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("kw", [
    dict(window_size=(0, 0)), dict(window_size=[np.int64(-1), 7]), dict(window_size=(-1, -1)),
    dict(softcap=0), dict(softcap=np.float32(30.0)), dict(softcap=1e-30),
    dict(alibi_slopes=f32((H,))), dict(alibi_slopes=f32((B, H))), dict(alibi_slopes=f32((B, H), strides=(16, 1))),
], ids=["window_0_0", "window_np_int", "window_none", "softcap_0", "softcap_np", "softcap_tiny",
        "alibi_h", "alibi_bh", "alibi_padded_rows"])
def test_valid_mods_pass_validation(entry, kw):
    """Valid values get through every check: the call reaches allocation (or, for plan, returns)."""
    if entry == "plan":
        assert call_plan(**kw).problem is not None
        return
    with pytest.raises(AssertionError, match=REACHED):
        ENTRY_POINTS[entry](**kw)


# ---------------------------------------------------------------------------------------------
# Valid varlen calls: everything is checked before the first allocation, and what reaches the
# launch is the planned packed problem.

def test_valid_varlen_reaches_allocation_first():
    for kw in ({}, paged(), dict(max_seqlen_q=10, max_seqlen_k=12), paged(max_seqlen_k=64),
               dict(max_seqlen_q=np.int32(1), max_seqlen_k=np.int64(0)), dict(return_lse=True),
               dict(k=dev((12, H, D)), v=dev((12, H, D))), dict(q=dev((10, H, 40)), k=dev((12, HK, 40)), v=dev((12, HK, 40)))):
        with pytest.raises(AssertionError, match=REACHED):
            call_varlen(varlen_args(**kw))


@pytest.fixture
def launches(monkeypatch):
    """Record what reaches launch.prepare (then stop), on a pretend 132-SM sm_90 GPU."""
    seen = []

    def record(plan, *args, **kw):
        seen.append((plan, kw))
        raise AssertionError(REACHED)
    monkeypatch.setattr(api, "device_facts", lambda device: DeviceFacts(132, 90))
    monkeypatch.setattr(arrays, "on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(arrays, "stream_for", lambda like: None)
    monkeypatch.setattr(api.launch, "prepare", record)
    return seen


def test_valid_varlen_with_out_reaches_launch_with_packed_problem(launches):
    # `out` given and no LSE: nothing to allocate, so the call gets as far as the launch
    with pytest.raises(AssertionError, match=REACHED):
        call_varlen(varlen_args(out=dev(Q, ptr=OUT_PTR), causal=True, window_size=(3, 0), softcap=20.0,
                                alibi_slopes=f32((B, H))))
    (plan, kw), = launches
    p = plan.problem
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.nheads, p.head_dim) == (B, MAX_Q, MAX_K, H, D)
    assert p.varlen and p.kv == "dense" and p.causal and p.window == (3, 0) and p.softcap and p.alibi
    assert kw["softcap"] == 20.0 and kw["alibi"] == (1 << 20, H) and kw["varlen"] == (1 << 20, 1 << 20, Q[0], KV[0])


@pytest.mark.parametrize("paged_cache", [False, True], ids=["dense", "paged"])
def test_max_seqlen_above_the_rows_is_an_upper_bound(launches, paged_cache):
    """max_seqlen_q / max_seqlen_k above the rows there are (a fixed bound such as the model's
    context, which flash-attn takes): read as those rows, which no sequence can exceed."""
    kw = paged(out=dev(Q, ptr=OUT_PTR)) if paged_cache else dict(out=dev(Q, ptr=OUT_PTR))
    with pytest.raises(AssertionError, match=REACHED):
        call_varlen(varlen_args(max_seqlen_q=4096, max_seqlen_k=np.int64(4096), **kw))
    (plan, _), = launches
    assert (plan.problem.seqlen_q, plan.problem.seqlen_k) == (Q[0], 64 if paged_cache else KV[0])


def test_valid_paged_varlen_reaches_launch(launches):
    with pytest.raises(AssertionError, match=REACHED):
        call_varlen(varlen_args(**paged(out=dev(Q, ptr=OUT_PTR), max_seqlen_k=64)))
    (plan, kw), = launches
    assert plan.problem.kv == "paged" and plan.problem.seqlen_k == 64
    assert kw["page_size"] == 16 and kw["cache"] == (0, 0, 1 << 20, 4)


# ---------------------------------------------------------------------------------------------
# Empty batches and empty sequences: validated, then returned without a launch.

class Out:
    """What a caller's `out` array hands back (the fake view's array)."""


def empty_case(batch, total_q, paged_cache):
    out = dev((total_q, H, D), ptr=OUT_PTR)._replace(array=Out())
    kw = dict(q=dev((total_q, H, D)), cu_seqlens_q=i32((batch + 1,)), cu_seqlens_k=i32((batch + 1,)),
              max_seqlen_q=0, out=out)
    if paged_cache:
        kw.update(paged(block_table=i32((batch, 4))), max_seqlen_k=64)
    return varlen_args(**kw), out


@pytest.mark.parametrize("paged_cache", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("batch,total_q", [(0, 0), (0, 10), (B, 0)], ids=["no_sequences", "no_sequences_rows", "no_queries"])
def test_empty_varlen_returns_out_without_launch(batch, total_q, paged_cache):
    args, out = empty_case(batch, total_q, paged_cache)
    assert call_varlen(args) is out.array  # no allocation, no launch (fake_views would raise)


def test_empty_varlen_still_validated():
    args, _ = empty_case(0, 0, False)
    with pytest.raises(ValueError) as ei:
        call_varlen({**args, "max_seqlen_q": -1})
    check_message(ei, ["max_seqlen_q must be >= 0", "total_q is 0), got -1"])
    with pytest.raises(ValueError) as ei:
        call_varlen({**args, "block_table": i32((1, 4)), "k": dev((4, 16, HK, D)), "v": dev((4, 16, HK, D))})
    check_message(ei, ["block_table must be int32 of shape (0, pages_per_seq), got int32 (1, 4)"])
    with pytest.raises(ValueError) as ei:
        call_varlen({**args, "alibi_slopes": f32((1, H))})
    check_message(ei, ["alibi_slopes must have shape (8,) or (0, 8), got (1, 8)"])
    with pytest.raises(TypeError) as ei:
        call_varlen({**args, "softcap": "x"})
    check_message(ei, ["softcap must be a real number, got str"])


def test_empty_varlen_with_lse_allocates_only_after_validation():
    args, _ = empty_case(0, 0, False)
    with pytest.raises(AssertionError, match=REACHED):  # the LSE array is the first allocation
        call_varlen({**args, "return_lse": True})


# ---------------------------------------------------------------------------------------------
# Host (NumPy) arrays: validated on the CPU like device views

def test_varlen_numpy_without_gpu(monkeypatch):
    monkeypatch.undo()
    q, kv = np.zeros(Q, np.float16), np.zeros(KV, np.float16)
    cu = np.array([0, 4, 10], np.int32), np.array([0, 5, 12], np.int32)
    with pytest.raises(TypeError) as ei:
        cuflash.attention_varlen(q, kv, kv, cu[0], cu[1].astype(np.int64), MAX_Q, MAX_K)
    check_message(ei, ["cu_seqlens_k must be int32, got int64"])
    with pytest.raises(ValueError) as ei:
        cuflash.attention_varlen(q, kv, kv, cu[0], cu[1], MAX_Q, MAX_K, window_size=(-3, 0))
    check_message(ei, [WINDOW_RANGE + "(-3, 0)"])
    if GPU_PROBLEM is not None:  # a valid call gets as far as asking for a GPU
        with pytest.raises(RuntimeError, match="none is available"):
            cuflash.attention_varlen(q, kv, kv, cu[0], cu[1], MAX_Q, MAX_K, causal=True,
                                     window_size=(2, 0), softcap=5.0, alibi_slopes=np.ones(H, np.float32))


# ---------------------------------------------------------------------------------------------
# Messages quote the caller's arrays; alignment and head counts are checked before any allocation

@pytest.mark.parametrize("kw,fragment", [
    (dict(k=dev((12, HK, 32)), v=dev((12, HK, 32))), "k (12, 2, 32)"),
    (dict(q=dev(Q, strides=(H * D, 1, H))), "got strides (512, 1, 8)"),
], ids=["head_dim_shapes", "last_dim_strides"])
def test_varlen_messages_quote_packed_shapes(kw, fragment):
    with pytest.raises(ValueError) as ei:
        call_varlen(varlen_args(**kw))
    check_message(ei, [fragment])


def test_paged_varlen_alignment_checked_before_allocation():
    with pytest.raises(ValueError, match="16-byte aligned"):
        call_varlen(varlen_args(**paged(k=dev(PAGED, ptr=(1 << 20) + 2))))


@pytest.mark.parametrize("kv_shape", [KV, (12, H, D)], ids=["gqa", "mha"])
def test_dense_varlen_problem_has_kv_heads(launches, kv_shape):
    with pytest.raises(AssertionError, match=REACHED):
        call_varlen(varlen_args(k=dev(kv_shape), v=dev(kv_shape), out=dev(Q, ptr=OUT_PTR)))
    (plan, _), = launches
    assert plan.problem.nheads_k == kv_shape[1]
    assert plan.ngroups_eff == H // kv_shape[1]
