"""cuflash.plan with sliding windows, softcap, ALiBi and packed (varlen) batches: which window
bound is kept, how many K/V tiles a band reaches, which kernels run, when GQA is packed, and how
the split count follows the band. Numbers are computed by hand in the comments (no GPU needed)."""
import pytest

import cuflash
from cuflash.plan import DeviceFacts, Problem, band_tiles, effective_window, make_plan

H100 = dict(num_sms=132, arch=90)


def plan(q, k, **kw):
    return cuflash.plan(q, k, k, **{**H100, **kw})


# ---------------------------------------------------------------------------------------------
# effective_window(causal, window, seqlen_q, seqlen_k): bounds that hide no key become -1

@pytest.mark.parametrize("causal,window,sq,sk,expected", [
    (False, (-1, -1), 100, 100, (-1, -1)),
    (True, (-1, -1), 100, 100, (-1, 0)),     # causal is the right edge 0
    (True, (10, 5), 100, 100, (10, 0)),      # ... whatever right edge was asked for
    (True, (10, -1), 100, 100, (10, 0)),
    (False, (99, 0), 50, 100, (99, 0)),      # left 99 < seqlen_k: kept
    (False, (100, 0), 50, 100, (-1, 0)),     # left >= seqlen_k reaches past key 0: a causal mask
    (False, (5000, 3), 50, 100, (-1, 3)),
    (False, (5, 48), 50, 100, (5, 48)),      # right 48 < seqlen_q - 1 = 49: kept
    (False, (5, 49), 50, 100, (5, -1)),      # right >= seqlen_q - 1 reaches the last key
    (False, (5, 1000), 50, 100, (5, -1)),
    (False, (100, 49), 50, 100, (-1, -1)),   # hides nothing at all
    (True, (-1, -1), 1, 100, (-1, -1)),      # causal, one query: sees every key, no mask
    (True, (1000, -1), 1, 100, (-1, -1)),
    (True, (10, -1), 1, 100, (10, -1)),      # one query with a left edge: local, no right edge
    (False, (0, 0), 1, 0, (-1, -1)),         # no keys: nothing to hide
])
def test_effective_window(causal, window, sq, sk, expected):
    assert effective_window(causal, window, sq, sk) == expected


# ---------------------------------------------------------------------------------------------
# band_tiles(rows, window, seqlen_q, seqlen_k, block_n): the most K/V tiles a query block sees

@pytest.mark.parametrize("rows,window,sq,sk,bn,expected", [
    (64, (-1, -1), 1000, 1000, 128, 8),       # no left edge: every tile, ceil(1000 / 128)
    (64, (-1, 0), 1000, 1000, 128, 8),        # causal alone does not shrink the count
    (64, (256, 0), 1024, 1024, 128, 4),       # span 64 + 256 + 0 = 320 keys: ceil(320/128) + 1
    (16, (4095, -1), 1, 32768, 64, 65),       # decode: 1 + 4095 + 0 = 4096 keys: 64 + 1 of 512
    (64, (4095, -1), 1, 32768, 128, 33),      # the same band in 128-key blocks: 32 + 1 of 256
    (128, (10, 10), 4, 1000, 64, 2),          # rows capped by seqlen_q: 4 + 10 + 10 = 24 keys
    (64, (100, -1), 1024, 1024, 64, 16),      # no right edge: 64 + 100 + 1023 > all 16 tiles
    (64, (100, -1), 1024, 4096, 64, 20),      # 1187 keys: ceil(1187/64) + 1 = 20 of 64
    (64, (5000, 0), 100, 100, 64, 2),         # capped by the 2 tiles there are
    (16, (0, 0), 1, 1000, 64, 2),             # one key, but it may straddle two tiles
])
def test_band_tiles(rows, window, sq, sk, bn, expected):
    assert band_tiles(rows, window, sq, sk, bn) == expected


# ---------------------------------------------------------------------------------------------
# Kernels: "local", "softcap", "alibi" in the names where they apply

PREFILL = (2, 1024, 16, 128)  # 2*16*ceil(1024/64) = 512 blocks >= 0.8 * 264 slots: no split


@pytest.mark.parametrize("kw,mask,mods", [
    (dict(), "full", ""),
    (dict(causal=True), "causal", ""),
    (dict(window_size=(256, 0)), "local", ""),
    (dict(window_size=(256, -1), causal=True), "local", ""),
    (dict(window_size=(-1, 0)), "causal", ""),   # the causal window
    (dict(window_size=(2000, 0)), "causal", ""),  # left past key 0
    (dict(window_size=(1024, 1023)), "full", ""),  # hides nothing
    (dict(window_size=(2000, -1), causal=True), "causal", ""),
    (dict(softcap=30.0), "full", "_softcap"),
    (dict(alibi_slopes=True, causal=True), "causal", "_alibi"),
    (dict(softcap=30.0, alibi_slopes=(2, 16)), "full", "_softcap_alibi"),
    (dict(softcap=30.0, alibi_slopes=(16,), window_size=(128, 128)), "local", "_softcap_alibi"),
    (dict(softcap=0.0, window_size=(-1, -1)), "full", ""),
])
@pytest.mark.parametrize("arch", [90, 80])
def test_prefill_kernel_names(kw, mask, mods, arch):
    p = plan(PREFILL, PREFILL, **{**kw, "arch": arch})
    if arch == 90:  # the warp-specialised kernel, persistent at 1024 keys (not with a window)
        kernel = (f"fwd_ws_d128_bf16_{mask}{mods}_m128n128s2_overlap_pingpong"
                  f"{'' if mask == 'local' else '_persistent'}_sm90")
    else:  # mma.sync, one K/V stage: 32 keys at d=128, or 64 rows x 64 keys with a window/softcap/ALiBi
        kernel = f"fwd_d128_bf16_{mask}{mods}_" + ("m64n64" if mods or mask == "local" else "m128n32") + "w4s1_sm80"
    assert p.kernels == (kernel,) and p.num_splits == 1
    block_m = p.launches[0].variant.block_m
    grid = (132, 1, 1) if "_persistent" in kernel else (1024 // block_m, 16, 2)
    assert p.launches[0].grid == grid and block_m == (64 if "_m64" in kernel else 128)


def test_local_window_plan_fields():
    p = plan(PREFILL, PREFILL, window_size=(256, 0))
    assert p.window_eff == (256, 0) and p.local and not p.causal_eff
    v = p.launches[0].variant
    assert v.local and not v.causal and not v.softcap and not v.alibi
    c = plan(PREFILL, PREFILL, window_size=(2000, 0))
    assert c.window_eff == (-1, 0) and c.causal_eff
    assert c.launches[0].variant.causal and not c.launches[0].variant.local
    assert "hides no key beyond the causal mask." in c.reason
    f = plan(PREFILL, PREFILL, window_size=(1024, 1023))
    assert f.window_eff == (-1, -1) and not f.local and not f.causal_eff
    assert "hides no key beyond the sequence: no window mask." in f.reason


def test_str_mentions_window_softcap_alibi():
    text = str(plan(PREFILL, PREFILL, window_size=(256, 0), softcap=30.0, alibi_slopes=True))
    first = text.splitlines()[0]
    assert "window=(256, 0)" in first and " softcap" in first and " alibi" in first
    assert "fwd_ws_d128_bf16_local_softcap_alibi_m128n128s2_overlap_pingpong_sm90" in text
    assert "softcapped (softcap * tanh(s / softcap)) and biased by ALiBi (-slope * distance)" in text
    plain = str(plan(PREFILL, PREFILL))
    assert "window=" not in plain and "softcap" not in plain and "alibi" not in plain


def test_reason_mentions_the_band():
    p = plan(PREFILL, PREFILL, window_size=(256, 0))
    assert ("window (256, 0) runs as a local band (256, 0): K/V tiles outside it are never loaded."
            in p.reason)


# ---------------------------------------------------------------------------------------------
# GQA decode packing: kept with softcap (and with windows that hide nothing), not with a
# window or ALiBi (their masks and biases depend on the query position and head)

DEC_Q, DEC_KV = (1, 1, 28, 128), (1, 4096, 4, 128)  # 4096 keys = 64 decode tiles of 64


def test_softcap_keeps_gqa_packing():
    # packed: 4 blocks of 7 rows; splits min(132 // 4 = 33, max(64 // 4, min(64 // 2, 16)) = 16)
    # = 16 of 4 tiles
    p = plan(DEC_Q, DEC_KV, softcap=50.0)
    assert p.pack_gqa and (p.seqlen_q_eff, p.nheads_eff, p.ngroups_eff) == (7, 4, 1)
    assert p.num_splits == 16 and p.n_blocks_per_split == 4
    assert p.kernels == ("fwd_split_d128_bf16_full_softcap_m16n64w4s3_sm90", "combine_d128_bf16_sm90")
    assert p.launches[0].grid == (1, 4, 16) and "seqlen_q/ngroups swap" in p.reason


def test_alibi_prevents_gqa_packing():
    # 28 blocks of 1 row: min(132 // 28 = 4, 64 // 2 = 32) = 4 splits of 16 tiles
    p = plan(DEC_Q, DEC_KV, alibi_slopes=True)
    assert not p.pack_gqa and (p.seqlen_q_eff, p.nheads_eff, p.ngroups_eff) == (1, 28, 7)
    assert p.num_splits == 4 and p.n_blocks_per_split == 16
    assert p.kernels == ("fwd_split_d128_bf16_full_alibi_m16n64w4s3_sm90", "combine_d128_bf16_sm90")
    assert p.launches[0].grid == (1, 28, 4) and p.launches[1].grid == (7, 1, 1)
    assert "seqlen_q/ngroups swap" not in p.reason


def test_window_keeps_gqa_packing():
    # window (1024, 0), one query: (1024, -1); the band is 1 + 1024 keys -> ceil(1025/64) + 1 = 18
    # tiles; 4 packed blocks of 7 rows: min(132 // 4 = 33, max(18 // 4, min(18 // 2, 16)) = 9) = 9
    # splits of 2 tiles. Every packed row is the one query, so the band masks them alike.
    p = plan(DEC_Q, DEC_KV, window_size=(1024, 0))
    assert p.window_eff == (1024, -1) and p.local
    assert p.pack_gqa and (p.seqlen_q_eff, p.nheads_eff, p.ngroups_eff) == (7, 4, 1)
    assert p.num_splits == 9 and p.n_blocks_per_split == 2
    assert p.kernels[0] == "fwd_split_d128_bf16_local_m16n64w4s3_sm90"
    assert "18 K/V tiles of 64 keys" in p.reason and "get none" not in p.reason


@pytest.mark.parametrize("window", [(-1, -1), (4096, 0), (8192, 8192)])
def test_window_that_hides_nothing_keeps_packing(window):
    p = plan(DEC_Q, DEC_KV, window_size=window)
    assert p.window_eff == (-1, -1) and p.pack_gqa and p.seqlen_q_eff == 7
    assert p.kernels[0] == "fwd_split_d128_bf16_full_m16n64w4s3_sm90" and p.num_splits == 16


# ---------------------------------------------------------------------------------------------
# Sliding-window decode: splits over the band's tiles, not the cache

SW_Q, SW_KV = (1, 1, 28, 128), (1, 32768, 4, 128)  # 32k keys: 512 tiles of 64, 256 blocks of 128


def test_sliding_window_decode_splits_over_the_band():
    # window (4095, 0), one query -> (4095, -1): 1 + 4095 = 4096 keys, at most 64 + 1 = 65 tiles
    # of 64. 4 packed blocks (7 query heads per KV head as rows): min(132 // 4 = 33,
    # max(65 // 4, min(65 // 2, 16)) = 16) = 16, normalised to 13 splits of 5 tiles. Without the
    # window the same call splits 32 ways over 512 tiles (min(33, max(128, 16)) = 33 -> 32 of 16).
    p = plan(SW_Q, SW_KV, window_size=(4095, 0))
    assert p.window_eff == (4095, -1) and p.pack_gqa
    assert p.num_splits == 13 and p.n_blocks_per_split == 5
    assert p.n_blocks_per_split * p.num_splits < 512 // 4
    assert p.kernels == ("fwd_split_d128_bf16_local_m16n64w4s3_sm90", "combine_d128_bf16_sm90")
    assert p.launches[0].grid == (1, 4, 13) and p.launches[1].grid == (7, 1, 1)
    assert p.workspace_bytes == 13 * 28 * (128 + 1) * 4
    for frag in ("runs as a local band (4095, -1)", "4 block(s) of 16 query rows", "65 K/V tiles of 64 keys",
                 "one block per SM (33)", "at least two and beyond 16 splits at least four (16)", "13 splits",
                 "Each split walks 5 K/V block(s) of 64 keys"):
        assert frag in p.reason, frag
    assert p.efficiency == ()  # cuflash's decode rule has no wave table
    full = plan(SW_Q, SW_KV)
    assert full.pack_gqa and full.num_splits == 32 and full.n_blocks_per_split == 16  # 512 / 32


def test_sliding_window_decode_fa2_counts_every_block():
    # FA2's rule sees all ceil(32768 / 128) = 256 blocks: up to min(128, 264, 256) = 128 splits.
    # 4 packed blocks: efficiency 4s/264 up to s = 66; 64 splits (0.970) is the smallest within 85%
    # of the best eligible count's.
    p = plan(SW_Q, SW_KV, window_size=(4095, 0), heuristic="fa2")
    assert p.num_splits == 64 and len(p.efficiency) == 128
    assert dict(p.efficiency)[64] == pytest.approx(64 * 4 / 264)
    assert "block_n=128 gives 256 K/V blocks" in p.reason
    assert "64 is the smallest eligible split count" in p.reason
    # the kernel still walks only the band: ceil(65 / 64) = 2 tiles of 64 per split, 31 splits none
    assert p.n_blocks_per_split == 2 and p.launches[0].grid == (1, 4, 64)
    assert p.kernels == ("fwd_split_d128_bf16_local_m16n64w4s3_sm90", "combine_d128_bf16_sm90")


def test_windowed_short_prefill_splits_over_the_band():
    # 32 queries (no decode tile), 28 heads: 28 blocks of 64 rows on 264 slots. Window (1024, 0)
    # is kept; a 64-row block sees 32 + 1024 keys: ceil(1056 / 128) + 1 = 10 of 256 blocks.
    # cuflash: FA2's formula over 10 blocks: eligible 1..5 and 10; best 28*5/264 = 0.530 (5 and
    # 10 tie); 4 gives 0.424 < 0.85 * 0.530 -> 5 splits of 2 blocks.
    q, kv = (1, 32, 28, 128), (1, 32768, 4, 128)
    p = plan(q, kv, window_size=(1024, 0))
    assert p.window_eff == (1024, 0) and p.num_splits == 5 and len(p.efficiency) == 10
    assert p.n_blocks_per_split == 2 and p.launches[0].grid == (1, 28, 5)
    assert p.kernels == ("fwd_split_d128_bf16_local_m64n128w4s1_sm90", "combine_d128_bf16_sm90")
    assert "block_n=128 gives 10 K/V blocks" in p.reason and "5 is the smallest eligible" in p.reason
    # FA2 over all 256 blocks: 8 splits (as for the decode above); the kernel still walks the
    # 10-block band, ceil(10 / 8) = 2 per split, so 8 - 5 = 3 splits get none
    f = plan(q, kv, window_size=(1024, 0), heuristic="fa2")
    assert f.num_splits == 8 and len(f.efficiency) == 128 and f.n_blocks_per_split == 2
    assert "block_n=128 gives 256 K/V blocks" in f.reason and "3 split(s) get none" in f.reason


def test_decode_reason_names_what_fa2_would_pick():
    p = plan(SW_Q, SW_KV, window_size=(4095, 0))
    fa2 = plan(SW_Q, SW_KV, window_size=(4095, 0), heuristic="fa2")
    assert f"FA2's rule would pick {fa2.num_splits}: heuristic='fa2'" in p.reason


def test_causal_window_decode_is_local():
    # causal with a left edge: right 0 -> -1 for one query, left 4095 kept
    p = plan(SW_Q, SW_KV, causal=True, window_size=(4095, -1))
    assert p.window_eff == (4095, -1) and p.local and not p.causal_eff
    assert p.pack_gqa and p.num_splits == 13 and p.kernels[0] == "fwd_split_d128_bf16_local_m16n64w4s3_sm90"


# ---------------------------------------------------------------------------------------------
# Packed (varlen) problems: planned for the maximum lengths, bounds from cu_seqlens

def test_varlen_problem_reason_mentions_cu_seqlens():
    # 4 sequences of at most 512 queries: 4*16*8 = 512 blocks fill the GPU: one standard launch
    p = make_plan(Problem(4, 512, 2048, 16, 4, 128, "bf16", causal=True, varlen=True), DeviceFacts(132, 90))
    assert ("varlen: 4 packed sequences of at most 512 queries and 2048 keys; each block reads its "
            "sequence's bounds from cu_seqlens." in p.reason)
    assert p.kernels == ("fwd_ws_d128_bf16_causal_varlen_m128n128s2_overlap_pingpong_sm90",)
    assert p.launches[0].grid == (4, 16, 4) and "Packed sequences: the tensor maps span every token" in p.reason
    assert "varlen (max lengths)" in str(p).splitlines()[0]
    dense = make_plan(Problem(4, 512, 2048, 16, 4, 128, "bf16", causal=True), DeviceFacts(132, 90))
    assert "cu_seqlens" not in dense.reason and "varlen" not in str(dense)


def test_varlen_decode_with_window_and_alibi():
    # 3 sequences of one query, 32 heads on 8, paged keys up to 8192, window (511, 0) -> (511, -1):
    # 512 keys -> 8 + 1 = 9 tiles; 3*32 = 96 blocks: min(132 // 96 = 1, ...) = 1: no split
    p = make_plan(Problem(3, 1, 8192, 32, 8, 128, "fp16", window=(511, 0), alibi=True, kv="paged",
                          varlen=True), DeviceFacts(132, 90))
    assert p.window_eff == (511, -1) and not p.pack_gqa and p.num_splits == 1
    assert p.kernels == ("fwd_d128_fp16_local_alibi_paged_m16n64w4s3_sm90",)
    assert "9 K/V tiles of 64 keys" in p.reason and "cu_seqlens" in p.reason
    text = str(p).splitlines()[0]
    assert "window=(511, 0)" in text and "alibi" in text and "varlen" in text
