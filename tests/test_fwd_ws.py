"""The warp-specialised Hopper forward (cuflash/kernels/fwd_ws.py, templates/fwd_ws/): offline
checks (every variant renders and compiles for sm_90a with no spills, no stack, a launch
register count that setmaxnreg's split can hand out, no serialized wgmma; the parameter struct
with its tensor maps; the tensor-map encoding's arguments, with a fake driver function), the
the plans that run it, and GPU checks against the float64 reference (skipped without an
sm_90 GPU: they are the first thing to run on one)."""
import ctypes
import os
import re
import shutil
import subprocess
from dataclasses import replace

import numpy as np
import pytest

from conftest import assert_compiled_clean, bf16_or_alone, fake_view, requires_sm90, requires_torch
from cuflash import codegen
from cuflash.kernels import all_variants, covering_sample, fwd_ws
from cuflash.kernels.fwd_ws import FwdWsVariant
from cuflash.kernels.params import ParamTable

VARIANTS = fwd_ws.variants(90, mods=False)
_MODDED = lambda v: v.softcap or v.alibi or v.varlen or v.cache or v.paged or v.sinks
FLASHMASK = [v for v in fwd_ws.variants(90) if v.flashmask and not _MODDED(v)]  # the planned tiles, with FlashMask
LOCAL = [v for v in fwd_ws.variants(90) if v.local and not _MODDED(v)]  # with a sliding window
# Softcap, ALiBi, varlen, KV cache, sinks: every planned tile with both modifiers on dense batches,
# packed sequences and a KV cache with a leftpad (bf16), the 192-row d=64 tile with varlen or a
# cache (with softcap or ALiBi d=64 takes 128-row tiles), and every dense planned tile with sinks.
MODS = [v for v in fwd_ws.variants(90) if v.dtype == "bf16" and not v.sinks and (
    v.softcap and v.alibi and v.cache == v.leftpad or (v.varlen or v.leftpad) and v.block_m == 192)] + [
    v for v in fwd_ws.variants(90) if v.dtype == "bf16" and v.sinks and not _MODDED(replace(v, sinks=False))
    and not v.local]
REG_FILE = 65536  # 32-bit registers per SM (and so per block with one block per SM)


# ---------------------------------------------------------------------------------------------
# Variants and registration

def test_variants_of_each_arch():
    """The planned tiles: d 128 and 256 two consumer warpgroups of 64 rows with both schedules,
    d 64 three warpgroups with the overlap (and two for short causal problems, and two taking
    turns at the softmax, persistent, for dense problems of at most 4096 keys); fp16 and bf16,
    causal or not; persistent at d 128 for at most 1024 keys, and at d 256 causal; all within
    Hopper's 227 KB of shared memory."""
    assert len({v.name for v in VARIANTS}) == len(VARIANTS) == 24
    assert {(v.head_dim, v.block_m, v.causal, v.turn_softmax) for v in VARIANTS if v.persistent} == {
        (64, 128, False, True), (64, 128, True, True), (128, 128, False, False), (128, 128, True, False),
        (256, 128, True, False)}
    assert all(v.persistent and not v.overlap for v in VARIANTS if v.turn_softmax)
    assert {(v.head_dim, v.dtype, v.causal) for v in VARIANTS} == {
        (d, dt, c) for d in (64, 128, 256) for dt in ("fp16", "bf16") for c in (False, True)}
    assert fwd_ws.variants(80) == [] and fwd_ws.variants(89) == []
    modded = [v for v in fwd_ws.variants(90) if _MODDED(v)]
    assert sorted(fwd_ws.variants(90), key=str) == sorted(VARIANTS + FLASHMASK + LOCAL + modded, key=str)
    assert len(FLASHMASK) == 24 and len(LOCAL) == 8
    # softcap and ALiBi on dense batches, packed sequences and KV caches (with or without a
    # leftpad): every combination on every mask's planned tiles (d=64 with softcap or ALiBi: 128
    # rows), varlen and caches never persistent; FlashMask with softcap
    sources = {(False, False, False, False), (True, False, False, False), (False, True, False, False),
               (False, True, True, False), (False, False, False, True), (False, False, True, True)}
    assert {(v.softcap, v.alibi, v.varlen, v.cache, v.leftpad, v.paged, v.sinks) for v in modded} == {
        (c, a, *src, k) for c in (False, True) for a in (False, True) for src in sources
        for k in (False, True)} - {(False,) * 7}
    assert {v.local for v in modded} == {False, True} and {v.causal for v in modded} == {False, True}
    assert all(v.block_m == 128 for v in modded if v.head_dim == 64 and (v.softcap or v.alibi))
    assert not any((v.varlen or v.cache or v.paged) and v.persistent for v in modded)
    assert fwd_ws.planned(128, "bf16", True, 256, paged=True, leftpad=True, page_size=256).gather  # (a leftpad)
    assert not fwd_ws.planned(128, "bf16", True, 256, paged=True, page_size=256).gather
    assert {v.flashmask for v in modded if v.softcap} == {0, 1, 2, 4} and not any(v.flashmask and v.alibi for v in modded)
    for v in modded:
        tags = [t for t, on in (("_softcap", v.softcap), ("_alibi", v.alibi), ("_varlen", v.varlen),
                                ("_cache", v.cache), ("_leftpad", v.leftpad), ("_paged", v.paged),
                                ("_gather", v.gather), ("_sinks", v.sinks)) if on]
        assert "".join(tags) in v.name and all(t in v.name for t in tags)
        assert ("softcap_scale" in v.params.names) == v.softcap and ("alibi_slopes" in v.params.names) == v.alibi
        assert ("cu_seqlens_q" in v.params.names) == v.varlen and ("seqlens_k" in v.params.names) == (v.cache or v.paged)
        assert ("kv_leftpad" in v.params.names) == v.leftpad and ("block_table" in v.params.names) == v.paged
        assert ("sinks" in v.params.names) == v.sinks
        assert v.params.names[-1] == ("tile_counter" if v.persistent else v.params.names[-1])
    # sliding windows: the causal tiles (d=64: 128 rows up to 2048 queries), one block per tile
    assert {(v.head_dim, v.block_m, v.block_n, v.overlap, v.pingpong) for v in LOCAL} == {
        (64, 192, 128, True, False), (64, 128, 128, True, True), (128, 128, 128, True, True), (256, 128, 80, True, True)}
    assert all(not (v.causal or v.persistent or v.flashmask) and "_local_" in v.name for v in LOCAL)
    assert all(v.params.names[-2:] == ("window_left", "window_right") for v in LOCAL)
    assert {(v.causal, v.flashmask) for v in FLASHMASK} == {(True, 1), (True, 2), (False, 2), (False, 4)}
    # d=64 causal FlashMask: the short causal tile (128 rows, both schedules) at any length
    # (two K/V stages: the third of d=64's dense tile was not measured with FlashMask); d=128:
    # persistent blocks
    assert all(v.persistent == (v.head_dim == 128) for v in fwd_ws.variants(90) if v.flashmask)  # softcap too
    assert {replace(v, flashmask=0, persistent=False) for v in FLASHMASK} == {
        replace(v, stages=2) for v in VARIANTS if not v.persistent and not (v.head_dim == 64 and v.causal and v.block_m == 192)}
    tiles = {(v.head_dim, v.block_m, v.block_n, v.overlap, v.pingpong) for v in VARIANTS}
    assert tiles == {(64, 192, 128, True, False), (64, 128, 128, True, True), (64, 128, 128, False, True),
                     (128, 128, 128, True, True), (256, 128, 80, True, True)}
    for v in VARIANTS:
        # a third K/V stage only on d=64's 192-row tile without a mask, one block per tile
        assert (v.kind, v.family, v.target) == ("fwd_ws", "fwd_ws", "90a")
        assert v.stages == (3 if v.block_m == 192 and not (v.causal or v.local or v.persistent or v.flashmask) else 2)
        assert v.threads == 128 * (1 + v.block_m // 64)
        assert v.smem_bytes == ((v.block_m * (1 + v.own_o + v.double_q) + v.stages * 2 * v.block_n) * v.head_dim * 2
                                + fwd_ws.BARRIER_BYTES + 4 * 128 * v.consumers * v.turn_softmax) <= 227 << 10
        assert re.fullmatch(r"[A-Za-z0-9_]+", v.name)
    # d=64 causal from one query to 2048 over more keys than SHORT_D64's: the short causal tile
    short, long = (fwd_ws.planned(64, "bf16", True, sq, seqlen_k=8192) for sq in (2048, 2049))
    assert (short.block_m, long.block_m) == (128, 192) and not short.turn_softmax
    assert fwd_ws.planned(64, "bf16", False, 1, seqlen_k=8192).block_m == 192
    # persistent: from the keys (as many as queries unless given), d 64 (1024 keys) and 128 (2048;
    # 256: causal only, 1024)
    assert fwd_ws.planned(128, "bf16", True, 4096, seqlen_k=2048).persistent
    assert not fwd_ws.planned(128, "bf16", True, 512, seqlen_k=2049).persistent
    assert fwd_ws.planned(64, "bf16", True, 4096, seqlen_k=1024, softcap=True).persistent
    assert not fwd_ws.planned(64, "bf16", False, 512, seqlen_k=1025, softcap=True).persistent
    assert not fwd_ws.planned(256, "bf16", False, 128).persistent
    # dense d=64 up to 4096 keys, causal or not: SHORT_D64, persistent; beyond, 192-row tiles
    for causal in (False, True):
        for sq, sk in ((1, 4096), (4096, 4096), (8192, 1024)):
            v = fwd_ws.planned(64, "bf16", causal, sq, seqlen_k=sk)
            assert v.turn_softmax and v.persistent and (v.block_m, v.overlap) == (128, False)
        v = fwd_ws.planned(64, "bf16", causal, 4097)
        assert not (v.turn_softmax or v.persistent) and v.block_m == 192
    # ... but not with score modifiers, sinks, packed sequences or caches
    for mods in (dict(softcap=True), dict(alibi=True), dict(sinks=True), dict(varlen=True), dict(cache=True),
                 dict(local=True), dict(flashmask=2)):
        assert not fwd_ws.planned(64, "bf16", False, 1024, **mods).turn_softmax
    # FlashMask: persistent at d=128 at any length, not at d=64 (not measured)
    assert all(fwd_ws.planned(128, "bf16", True, sq, flashmask=1).persistent for sq in (128, 32768))
    assert not fwd_ws.planned(64, "bf16", True, 128, flashmask=1).persistent


def test_consumer_registers_fill_the_register_file():
    v2, v3 = FwdWsVariant(head_dim=128, dtype="bf16", arch=90), FwdWsVariant(head_dim=64, dtype="bf16", arch=90,
                                                                              block_m=192)
    assert (v2.consumer_regs, v3.consumer_regs) == (240, 160)
    g = FwdWsVariant(head_dim=128, dtype="bf16", arch=90, paged=True, gather=True)
    assert (g.producer_regs, g.consumer_regs) == (fwd_ws.GATHER_PRODUCER_REGS, 232)
    for v in (v2, v3, g):
        # setmaxnreg redistributes the registers the block launched with (168 per thread at 384
        # threads): an increase beyond them would wait forever
        assert v.producer_regs * 128 + v.consumer_regs * 128 * v.consumers <= REG_FILE // v.threads // 8 * 8 * v.threads


@pytest.mark.parametrize("kw", [dict(arch=80), dict(head_dim=96), dict(head_dim=192), dict(dtype="fp32"),
                                dict(block_m=96), dict(block_n=264), dict(stages=1), dict(causal=1),
                                dict(overlap=1), dict(pingpong="yes"), dict(pingpong=True, block_m=192),
                                dict(turn_softmax=True), dict(turn_softmax=1, pingpong=True),
                                dict(turn_softmax=True, pingpong=True, flashmask=2),
                                dict(turn_softmax=True, pingpong=True, paged=True, gather=True, block_n=128),
                                dict(flashmask=4, causal=True), dict(flashmask=1), dict(flashmask=3),
                                dict(flashmask=2, persistent=True, head_dim=256, block_n=80),
                                dict(flashmask=2, persistent=True, head_dim=64, block_m=192)])
def test_bad_variants_are_refused(kw):
    with pytest.raises(ValueError):
        FwdWsVariant(**{**dict(head_dim=128, dtype="bf16", arch=90), **kw})


def test_registered_and_planned_where_it_applies():
    """all_variants (warmup, the CI's covering sample) holds every fwd_ws variant; on sm_90 the
    planner runs it for dense K/V at d 64, 128 and 256 (with or without a sliding window, softcap,
    ALiBi, packed sequences), and keeps the other kernels elsewhere, saying why."""
    from dataclasses import replace
    from cuflash.plan import DeviceFacts, Problem, make_plan
    assert set(VARIANTS) <= set(all_variants(90)) and not any(v.family == "fwd_ws" for v in all_variants(80))
    sample = [v for v in covering_sample() if v.family == "fwd_ws"]
    assert {(v.head_dim, v.dtype) for v in sample} == {(d, dt) for d in (64, 128, 256) for dt in ("fp16", "bf16")}
    h100 = DeviceFacts(132, 90)
    for d in (64, 128, 256):
        for causal in (False, True):
            for sq in (1000, 4096):
                p = Problem(2, sq, 4096, 16, 4, d, "bf16", causal)
                plan = make_plan(p, h100)
                assert [l.variant.family for l in plan.launches] == ["fwd_ws"], plan
                v = plan.launches[0].variant
                assert v == fwd_ws.planned(d, "bf16", causal, sq, seqlen_k=4096) and v.persistent == (d == 64)
                assert (v.head_dim, v.causal, plan.launches[0].grid) == (
                    (d, causal, (132, 1, 1)) if d == 64 else (d, causal, (-(-sq // v.block_m), 16, 2)))
                if d == 64:
                    assert "turns at the exponentials" in plan.reason and "at most 4096" in plan.reason
                assert ("They keep two Q tiles" in plan.reason) == v.double_q == (d == 64)
                short = make_plan(replace(p, seqlen_k=1000), h100)
                v = short.launches[0].variant
                assert v == fwd_ws.planned(d, "bf16", causal, sq, seqlen_k=1000) and v.persistent == (d <= 128 or causal)
                if v.persistent:
                    assert short.launches[0].grid == (132, 1, 1) and "Persistent blocks" in short.reason
                assert "fwd_ws" in plan.reason and "TMA" in plan.reason
                assert make_plan(p, DeviceFacts(108, 80)).launches[0].variant.family == "fwd"
                win = make_plan(replace(p, window=(256, 0) if causal else (256, 100)), h100)
                v = win.launches[0].variant
                assert [l.variant.family for l in win.launches] == ["fwd_ws"] and v.local and not v.causal
                assert v == fwd_ws.planned(d, "bf16", False, sq, seqlen_k=4096, local=True) and not v.persistent
                assert "Sliding window" in win.reason
                for mods in (dict(softcap=True), dict(alibi=True), dict(varlen=True),
                             dict(softcap=True, alibi=True, varlen=True, window=(256, 0)), dict(kv="cache"),
                             dict(kv="cache", leftpad=True, softcap=True), dict(kv="paged", page_size=640),
                             dict(kv="paged", page_size=16), dict(kv="paged", page_size=48)):
                    # 640: whole tiles (TMA boxes); 16, 48: gathered (fewer than 64 rows, or neither
                    # holding nor dividing tiles)
                    plan = make_plan(replace(p, **mods), h100)
                    v = plan.launches[0].variant
                    assert [l.variant.family for l in plan.launches] == ["fwd_ws"], (mods, plan)
                    flags = {"softcap": False, "alibi": False, "varlen": False, "leftpad": False,
                             **{m: True for m in mods if m not in ("window", "kv", "page_size")}}
                    assert {f: getattr(v, f) for f in flags} == flags
                    assert (v.cache, v.paged) == (mods.get("kv") == "cache", mods.get("kv") == "paged")
                    assert v.block_m == 128 or not (v.softcap or v.alibi)  # d=64: no 192-row tile
                    assert not ((v.varlen or v.cache or v.paged) and v.persistent)
                    assert ("Packed sequences" in plan.reason) == v.varlen and ("maps are the cache's" in plan.reason) == v.cache
                    assert ("Paged KV cache" in plan.reason) == v.paged
                    assert v.gather == (mods.get("page_size") in (16, 48)) == ("cp.async" in plan.reason)
                for other, why in ((dict(kv="paged", page_size=256, varlen=True), "paged"),
                                   (dict(tma=False), "stride")):
                    plan = make_plan(replace(p, **other), h100)
                    assert all(l.variant.family != "fwd_ws" for l in plan.launches), (other, plan)
                    if plan.launches[0].variant.kind == "fwd" and plan.launches[0].variant.mma == "wgmma":
                        assert why in plan.reason, (other, plan.reason)
    for d in (96, 192, 120, 250):  # other head dims: other kernels
        plan = make_plan(Problem(2, 4096, 4096, 16, 16, d, "bf16"), h100)
        assert all(l.variant.family != "fwd_ws" for l in plan.launches), plan
    # decode and split-KV shapes keep their kernels
    for sq, sk in ((1, 4096), (8, 65536)):
        plan = make_plan(Problem(1, sq, sk, 32, 8, 128, "bf16"), h100)
        assert all(l.variant.family != "fwd_ws" for l in plan.launches), plan


def test_tma_readable():
    from types import SimpleNamespace as V
    assert fwd_ws.tma_readable(V(strides=(4096, 256, 64, 1)))
    assert not fwd_ws.tma_readable(V(strides=(4096, 256, 0, 1)))  # a broadcast (expanded) head
    assert not fwd_ws.tma_readable(V(strides=(1 << 40, 256, 64, 1)))
    assert not fwd_ws.tma_readable(V(strides=(4096, 256, 64, 2)))


# ---------------------------------------------------------------------------------------------
# Parameters: CUtensorMap fields in a ParamTable

def test_params_struct_holds_three_aligned_tensor_maps():
    t = fwd_ws.PARAMS
    assert [t.offset(n) for n in ("tma_q", "tma_k", "tma_v", "o")] == [0, 128, 256, 384]
    assert t.layout.size == 512 and t.layout.size <= 1024  # compiler.Kernel's parameter buffer
    src = t.cuda()
    assert f"static_assert(sizeof(FwdWsParams) == {t.layout.size}" in src
    assert "offsetof" not in src  # CUDA 13.0's NVRTC has no __builtin_offsetof
    assert "const CUtensorMap& tma_q = p.tma_q;" in t.unpack()


def test_tensor_map_fields_are_padded_to_128_and_checked():
    """C's layout with cuda.h's alignas(128) CUtensorMap: padding before each map, size rounded up."""
    t = ParamTable("T", (("a", "int"), ("m", "CUtensorMap"), ("p", "void*"), ("m2", "CUtensorMap"), ("x", "float")))
    assert [t.offset(n) for n in t.names] == [0, 128, 256, 384, 512]
    assert t.layout.size == 640
    maps = dict(m=bytes(range(128)), m2=b"\xee" * 128)
    raw = t.layout.pack(*t.values(a=7, p=5, x=1.5, **maps))
    assert raw[128:256] == maps["m"] and raw[384:512] == maps["m2"] and raw[4:128] == bytes(124)
    for bad in (b"\0" * 127, b"\0" * 129, bytearray(128), 0):
        with pytest.raises(TypeError, match="CUtensorMap"):
            t.values(a=7, p=5, x=1.5, m=bad, m2=maps["m2"])


def test_tables_without_tensor_maps_keep_their_layout():
    """Every other family's struct: C's layout as before (native codes, padded to 8), no offset checks."""
    from cuflash.kernels.params import _format
    tables = {v.params for arch in (80, 90) for v in all_variants(arch)}
    plain = [t for t in tables if all(c != "CUtensorMap" for _, c in t.fields)]
    # the warp-specialised families' structs (one per feature set) and the FP8 forward's hold tensor maps
    assert {t.struct_name for t in tables if t not in plain} == {"FwdWsParams", "BwdWsParams", "FwdFp8Params"} and len(plain) >= 4
    for t in plain:
        assert t.layout.format == "@" + "".join(_format(c) for _, c in t.fields) + "0q"
        assert "offsetof" not in t.cuda()


# ---------------------------------------------------------------------------------------------
# Tensor maps: cuTensorMapEncodeTiled's arguments, through a fake with the driver's signature

class FakeEncode:
    """A C function with cuTensorMapEncodeTiled's signature (ctypes callback) that records its
    arguments and writes a recognisable 128-byte map."""

    def __init__(self, rc=0):
        self.calls, self.rc = [], rc
        proto = ctypes.CFUNCTYPE(fwd_ws.ENCODE_RESTYPE, *fwd_ws.ENCODE_ARGTYPES)
        self.fn = proto(self._record)

    def _record(self, tmap, dtype, rank, addr, gdim, gstride, box, estride, interleave, swizzle, l2, oob):
        self.calls.append(dict(tmap=tmap, dtype=dtype, rank=rank, addr=addr, gdim=gdim[:rank],
                               gstride=gstride[:rank - 1], box=box[:rank], estride=estride[:rank],
                               interleave=interleave, swizzle=swizzle, l2=l2, oob=oob))
        ctypes.memmove(tmap, bytes((i * 7 + 3) % 256 for i in range(128)), 128)
        return self.rc


@pytest.mark.parametrize("dtype,code", [("bf16", 9), ("fp16", 6)])
def test_encode_tensor_map_arguments(dtype, code):
    fake = FakeEncode()
    b, s, h, d = 3, 1000, 8, 128
    strides = (s * h * d, h * d, d, 1)  # (batch, seqlen, heads, d) contiguous
    m = fwd_ws.encode_tensor_map(0x7F0000001000, (b, s, h, d), strides, dtype, 128, encode=fake.fn)
    assert m == bytes((i * 7 + 3) % 256 for i in range(128))
    (c,) = fake.calls
    assert c["tmap"] % 128 == 0  # the map is written to a 128-byte-aligned address
    assert (c["dtype"], c["rank"], c["addr"]) == (code, 4, 0x7F0000001000)
    assert c["gdim"] == [d, s, h, b]
    assert c["gstride"] == [h * d * 2, d * 2, s * h * d * 2]  # bytes: seqlen, heads, batch
    assert c["box"] == [64, 128, 1, 1] and c["estride"] == [1, 1, 1, 1]
    # interleave NONE, SWIZZLE_128B, L2_PROMOTION_L2_256B, FLOAT_OOB_FILL_NONE (zeros)
    assert (c["interleave"], c["swizzle"], c["l2"], c["oob"]) == (0, 3, 3, 0)


def test_encode_tensor_map_strided_views_and_options():
    fake = FakeEncode()
    # k sliced from a packed (b, s, 3, hk, d) qkv tensor: seqlen stride 3 * hk * d.
    b, s, hk, d = 2, 300, 4, 64
    fwd_ws.encode_tensor_map(1 << 20, (b, s, hk, d), (s * 3 * hk * d, 3 * hk * d, d, 1), "bf16", 128,
                             l2_promotion=128, encode=fake.fn)
    c = fake.calls[0]
    assert c["gdim"] == [d, s, hk, b] and c["gstride"] == [3 * hk * d * 2, d * 2, s * 3 * hk * d * 2]
    assert c["l2"] == 2 and c["box"] == [64, 128, 1, 1]


@pytest.mark.parametrize("args,match", [
    ((0x1008, (1, 64, 1, 64), (4096, 64, 64, 1), "bf16", 128), "16-byte aligned"),
    ((0x1000, (1, 64, 1, 64), (4096, 64, 64, 2), "bf16", 128), "contiguous"),
    ((0x1000, (1, 64, 3, 64), (64 * 3 * 68, 3 * 68, 68, 1), "bf16", 128), "multiples of 16"),
    ((0x1000, (1, 64, 1, 96), (96 * 64, 96, 96, 1), "bf16", 128), "multiple of 64"),
    ((0x1000, (1, 64, 1, 64), (4096, 64, 64, 1), "fp32", 128), "dtype"),
    ((0x1000, (1, 64, 1, 64), (4096, 64, 64, 1), "bf16", 257), "box_rows"),
    ((0x1000, (1, 0, 1, 64), (4096, 64, 64, 1), "bf16", 128), "every dim"),
])
def test_encode_tensor_map_refuses_what_tma_cannot_do(args, match):
    fake = FakeEncode()
    with pytest.raises(ValueError, match=match):
        fwd_ws.encode_tensor_map(*args, encode=fake.fn)
    assert not fake.calls


def test_encode_tensor_map_reports_driver_errors():
    with pytest.raises(RuntimeError, match="CUresult 1"):
        fwd_ws.encode_tensor_map(0x1000, (1, 64, 1, 64), (4096, 64, 64, 1), "bf16", 128, encode=FakeEncode(rc=1).fn)


# ---------------------------------------------------------------------------------------------
# Offline compilation (NVRTC, sm_90a)

@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_renders(v):
    src = codegen.render(v)
    assert "struct alignas(128) CUtensorMap" in src and "setmaxnreg.dec.sync.aligned.u32" in src
    assert f"constexpr int kProducerRegs = {v.producer_regs};" in src


@pytest.mark.parametrize("v", bf16_or_alone(VARIANTS + FLASHMASK + LOCAL + MODS), ids=lambda v: v.name)
def test_compiles_as_designed(compiled, v):
    """sm_90a cubin with no spills or stack; __launch_bounds__(384, 1) caps the launch at 168
    registers (65536 / 384, rounded down to 8), which setmaxnreg then splits into 24 per producer
    thread and 240 per consumer thread (the same register file); ptxas neither ignored setmaxnreg
    (warning C7508) nor serialized a wgmma; no static shared memory (the dynamic tiles start
    1024-byte aligned)."""
    c = compiled[v]
    r = assert_compiled_clean(c, v)
    assert r.registers <= 168 and r.registers * v.threads <= REG_FILE, r
    assert v.producer_regs * 128 + v.consumer_regs * (v.threads - 128) <= REG_FILE // v.threads // 8 * 8 * v.threads
    assert r.static_smem == 0, r
    assert "C7508" not in c.log and "setmaxnreg" not in c.log.lower(), c.log
    assert "serialized" not in c.log, c.log
    assert "warning" not in c.log.lower(), c.log


SCHEDULES = [dict(overlap=True), dict(pingpong=True), dict(overlap=True, pingpong=True),
             dict(pingpong=True, turn_softmax=True), dict(overlap=True, pingpong=True, turn_softmax=True)]
SCHEDULED = [FwdWsVariant(head_dim=d, dtype="bf16", causal=c, arch=90, **kw)
             for d in (64, 128) for c in (False, True) for kw in SCHEDULES]
# The planned tiles with persistent blocks (planned for at most 1024 keys at d 64 and 128 and at
# d 256 causal, 4096 on dense d=64's softmax-turn tile).
PERSISTENT = [replace(v, persistent=True) for v in VARIANTS if v.dtype == "bf16"]


@pytest.mark.parametrize("v", SCHEDULED, ids=lambda v: v.name)
def test_schedules_compile_as_designed(compiled, v):
    """The FlashAttention-3 schedules (not planned yet): no spills, no stack, no serialized
    wgmma, and named in the variant."""
    c = compiled[v]
    assert_compiled_clean(c, v)
    assert "serialized" not in c.log and "warning" not in c.log.lower(), c.log
    assert ("_overlap" in v.name) == v.overlap and ("_pingpong" in v.name) == v.pingpong
    assert ("_smturn" in v.name) == v.turn_softmax


@pytest.mark.parametrize("v", PERSISTENT, ids=lambda v: v.name)
def test_persistent_compiles_as_designed(compiled, v):
    c = compiled[v]
    assert_compiled_clean(c, v)
    assert "serialized" not in c.log and "warning" not in c.log.lower(), c.log
    assert v.name.endswith("_persistent_2q_sm90" if v.double_q else "_persistent_sm90")


def test_persistent_renders_the_tile_loop_only_when_asked():
    """The one-tile kernel renders without the tile loop and the Q-empty barrier (its machine
    code is the same as before persistent blocks existed); the persistent one walks tiles
    x, x + gridDim.x, ... and lets the producer reload Q after the consumers' epilogue."""
    one = codegen.render(fwd_ws.planned(128, "bf16", False, 4096))
    many = codegen.render(replace(fwd_ws.planned(128, "bf16", False, 4096), persistent=True))
    loops = ("for (int j = 0, t = blockIdx.x;; ++j)", "for (int j = 0;; ++j)")  # the producer's, the consumers'
    for loop in loops:
        assert loop not in one and many.count(loop) == 1
    assert "bar_q_empty" not in one and "kv0" not in one and "atomicAdd(tile_counter" not in one
    assert "mbar_wait<kHangTrap>(bar_q_empty_of(j), q_phase(j - kQBufs))" in many and "mbar_arrive(bar_q_empty)" in many
    assert "mbar_wait<kHangTrap>(bar_q_of(j), q_phase(j))" in many and "mbar_wait<kHangTrap>(bar_q, 0)" in one
    assert "constexpr int kQBufs = 1;" in one and "constexpr int kQBufs = 1;" in many
    two = codegen.render(replace(fwd_ws.planned(128, "bf16", False, 4096), persistent=True, double_q=True))
    assert "constexpr int kQBufs = 2;" in two and "constexpr bool kOwnO = false;" in two
    # Tiles handed out by an atomic counter that the launch's last increment zeroes again.
    assert "next = atomicAdd(tile_counter, 1);" in many and "atomicExch(tile_counter, 0)" in many
    assert "tile_counter" in fwd_ws.FwdWsVariant(head_dim=128, dtype="bf16", arch=90, persistent=True).params.names
    assert "constexpr bool kOwnO = false;" in one and "constexpr bool kOwnO = true;" in many


def test_persistent_stages_o_apart_where_shared_memory_allows():
    """Persistent blocks stage O in a buffer of their own (Q's tile is released before the
    epilogue) wherever Q, the K/V stages and O fit in 227 KiB: not at d=256 (128 x 80), whose
    tiles fill it, where O goes through Q's tile as before."""
    for d, c, sq, mods in ((64, False, 4096, {}), (64, True, 1024, {}), (64, False, 1024, dict(sinks=True)),
                           (128, False, 4096, {}), (128, True, 4096, {})):
        one = replace(fwd_ws.planned(d, "bf16", c, sq, seqlen_k=4096, **mods), persistent=False, double_q=False)
        v = replace(one, persistent=True)
        assert v.own_o and v.smem_bytes == one.smem_bytes + v.block_m * d * 2
        assert v.smem_bytes <= fwd_ws.MAX_SMEM
    v = fwd_ws.planned(256, "bf16", True, 4096)
    assert not replace(v, persistent=True).own_o and replace(v, persistent=True).smem_bytes == v.smem_bytes
    assert not fwd_ws.planned(128, "bf16", True, 4096).own_o  # one-tile blocks: never


def test_persistent_grid():
    v = fwd_ws.planned(128, "bf16", False, 4096)
    p = replace(v, persistent=True)
    assert v.grid(2, 1000, 16) == v.grid(2, 1000, 16, 132) == (8, 16, 2)
    assert p.grid(2, 1000, 16, 132) == (132, 1, 1) and p.grid(1, 100, 3, 132) == (3, 1, 1)
    with pytest.raises(ValueError, match="SM count"):
        p.grid(2, 1000, 16)


def test_schedules_render_their_barriers():
    plain = codegen.render(FwdWsVariant(head_dim=128, dtype="bf16", arch=90))
    both = codegen.render(FwdWsVariant(head_dim=128, dtype="bf16", arch=90, overlap=True, pingpong=True))
    assert "constexpr bool kOverlap = false;" in plain and "constexpr bool kPingPong = false;" in plain
    assert "constexpr bool kOverlap = true;" in both and "constexpr bool kPingPong = true;" in both


def _nvdisasm():
    """nvdisasm from $NVDISASM, PATH, $CUDA_PATH/bin or the nvidia-cuda-nvdisasm wheel
    (nvidia/cu13/bin), or None."""
    import importlib.util
    spec = importlib.util.find_spec("nvidia")
    wheels = [os.path.join(p, "cu13", "bin", "nvdisasm") for p in (spec.submodule_search_locations or [])] if spec else []
    for cand in (os.environ.get("NVDISASM"), shutil.which("nvdisasm"),
                 os.path.join(os.environ.get("CUDA_PATH", "/usr/local/cuda"), "bin", "nvdisasm"), *wheels):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


@pytest.mark.skipif(_nvdisasm() is None, reason="needs nvdisasm (pip install nvidia-cuda-nvdisasm, or set NVDISASM)")
@pytest.mark.parametrize("v", bf16_or_alone(VARIANTS), ids=lambda v: v.name)
def test_sass_roles(compiled, v, tmp_path):
    """In the machine code: the producer deallocates to 24 registers, the consumers allocate
    theirs (v.consumer_regs) and use fewer; TMA loads (UTMALDG), wgmma (HGMMA) and mbarrier waits
    are there."""
    path = tmp_path / "k.cubin"
    path.write_bytes(compiled[v].cubin)
    sass = subprocess.run([_nvdisasm(), "-c", str(path)], capture_output=True, text=True, check=True).stdout
    lines = sass.splitlines()
    alloc = [i for i, l in enumerate(lines) if "USETMAXREG.TRY_ALLOC" in l]
    dealloc = [i for i, l in enumerate(lines) if "USETMAXREG.DEALLOC" in l]
    assert len(alloc) == 1 and len(dealloc) == 1, "one setmaxnreg per role"
    assert f"{v.consumer_regs:#x}" in lines[alloc[0]] and f"{v.producer_regs:#x}" in lines[dealloc[0]]

    # The code from the consumers' allocation up to the producer's deallocation (or the end)
    # uses fewer registers than allocated. After the deallocation ptxas may lay out consumer
    # blocks too, so that region is not checked.
    end = dealloc[0] if alloc[0] < dealloc[0] else len(lines)
    used = max((int(x) for l in lines[alloc[0]:end] for x in re.findall(r"\bR(\d+)\b", l)), default=-1)
    assert used < v.consumer_regs, used
    assert "UTMALDG.4D" in sass and f"HGMMA.64x{v.block_n}x16.F32" in sass and "SYNCS.PHASECHK.TRANS64.TRYWAIT" in sass
    # Softmax turns: every turn (a bar.sync on a turn barrier up to the next bar.arrive) encloses
    # a softmax's exponentials, block_n / 2 per thread (ptxas would move them out otherwise).
    if v.turn_softmax:
        turns = [i for i, l in enumerate(lines) if re.search(r"BAR\.SYNC\S* R\d+, 0x100", l)]
        assert turns
        for i in turns:
            j = next(k for k in range(i + 1, len(lines)) if re.search(r"BAR\.ARV R\d+, 0x100", lines[k]))
            assert sum("MUFU.EX2" in l for l in lines[i:j]) >= v.block_n // 2, lines[i:j + 1]


# ---------------------------------------------------------------------------------------------
# On an sm_90 GPU: against the float64 reference with flash-attn's accuracy rule



def _inputs(rng, b, sq, sk, h, hk, d, dtype):
    import torch
    tdt = getattr(torch, dtype)
    mk = lambda *s: torch.from_numpy(rng.standard_normal(s, dtype=np.float32)).to("cuda", tdt)
    return mk(b, sq, h, d), mk(b, sk, hk, d), mk(b, sk, hk, d)


def to_np(x):
    """A torch tensor as a NumPy array of its dtype (bfloat16 through ml_dtypes)."""
    import ml_dtypes
    import torch
    a = x.detach().float().cpu().numpy()
    return a.astype(ml_dtypes.bfloat16 if x.dtype == torch.bfloat16 else np.float16)


def _check(out, lse, q, k, v, causal, **kw):
    from cuflash.reference import attention as ref, check_close
    ok, err, bound = check_close(to_np(out), to_np(q), to_np(k), to_np(v), causal=causal, **kw)
    assert ok, f"max error {err:.3g} exceeds bound {bound:.3g}"
    _, lse_ref = ref(to_np(q), to_np(k), to_np(v), causal=causal, return_lse=True, **kw)
    got = lse.cpu().numpy()
    fin = np.isfinite(lse_ref)
    assert np.array_equal(np.isfinite(got), fin) and np.all(got[~fin] == np.inf)
    np.testing.assert_allclose(got[fin], lse_ref[fin], rtol=1e-3, atol=2e-3)


def _run_poisoned(q, k, v, causal, **tile):
    import torch
    out = torch.full_like(q, float("nan"))
    res, lse = fwd_ws.run(q, k, v, causal=causal, out=out, return_lse=True, **tile)
    torch.cuda.synchronize()
    assert res is out
    return out, lse


# Each head dim with each tile the planner can pick for it (fwd_ws.TILES, SHORT_CAUSAL_D64,
# SHORT_D64, and d=64's 192-row tile with three K/V stages).
PLANNED_TILES = [(d, t) for d, t in fwd_ws.TILES.items()] + [(64, fwd_ws.SHORT_CAUSAL_D64), (64, fwd_ws.SHORT_D64),
                                                             (64, dict(fwd_ws.TILES[64], stages=3))]


def _tile_id(x):
    """A test id for a head dim or a tile of PLANNED_TILES."""
    if isinstance(x, int):
        return x
    t = {"block_m": 128, "stages": 2, **x}
    return "m{block_m}n{block_n}s{stages}".format(**t) + ("sm" if t.get("turn_softmax") else "")


@requires_sm90
@requires_torch
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d,tile", PLANNED_TILES, ids=_tile_id)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(128, 128), (113, 203), (256, 512), (512, 256), (1, 239), (1023, 1024),
                                   (2048, 2048)])
def test_gpu_matches_reference(rng, dtype, d, tile, causal, sq, sk):
    b, h = (1, 2) if sq * sk > 1 << 20 else (2, 3)
    q, k, v = _inputs(rng, b, sq, sk, h, h, d, dtype)
    out, lse = _run_poisoned(q, k, v, causal, **tile)
    _check(out, lse, q, k, v, causal)


@requires_sm90
@requires_torch
@pytest.mark.parametrize("d,tile", PLANNED_TILES, ids=_tile_id)
@pytest.mark.parametrize("window", [(0, 0), (5, 0), (100, 20), (-1, 37), (300, -1), (1000, 1000)])
@pytest.mark.parametrize("b,h,hk,sq,sk", [(2, 3, 3, 113, 203), (2, 4, 2, 700, 700), (1, 4, 1, 512, 300),
                                         (1, 2, 2, 1, 239)])
def test_gpu_sliding_window(rng, d, tile, window, b, h, hk, sq, sk):
    """Sliding windows (bottom-right aligned): the blocks outside the band are not walked, the
    ones on its edges are masked; rows that see no key get O = 0 and LSE = +inf."""
    q, k, v = _inputs(rng, b, sq, sk, h, hk, d, "bfloat16")
    import torch
    out = torch.full_like(q, float("nan"))
    res, lse = fwd_ws.run(q, k, v, out=out, return_lse=True, window_size=window, **tile)
    torch.cuda.synchronize()
    _check(out, lse, q, k, v, False, window_size=window)


@requires_sm90
@requires_torch
@pytest.mark.parametrize("window", [(64, 0), (200, 50)])
def test_gpu_planned_sliding_window(rng, window):
    """cuflash.attention plans fwd_ws for a window on sm_90 and matches the reference."""
    import cuflash
    q, k, v = _inputs(rng, 2, 1000, 1000, 8, 2, 128, "bfloat16")
    p = cuflash.plan(q, k, v, window_size=window)
    assert p.kernels[0].startswith("fwd_ws_d128_bf16_local_") and "Sliding window" in p.reason
    out, lse = cuflash.attention(q, k, v, window_size=window, return_lse=True)
    _check(out, lse, q, k, v, False, window_size=window)


@requires_sm90
@requires_torch
@pytest.mark.parametrize("h,hk", [(8, 2), (8, 1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(113, 203), (256, 512), (1, 339)])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_gqa(rng, h, hk, causal, sq, sk, d):
    q, k, v = _inputs(rng, 2, sq, sk, h, hk, d, "bfloat16")
    out, lse = _run_poisoned(q, k, v, causal, **fwd_ws.TILES[d])
    _check(out, lse, q, k, v, causal)


@requires_sm90
@requires_torch
@pytest.mark.parametrize("d,tile", PLANNED_TILES, ids=_tile_id)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("b,h,hk,sq,sk", [(3, 8, 2, 768, 768), (3, 6, 6, 1000, 1300), (2, 4, 1, 555, 300),
                                         (1, 2, 2, 1, 239), (5, 40, 8, 129, 129), (2, 16, 4, 200, 20000)])
def test_gpu_persistent_matches_one_tile_blocks(rng, d, tile, causal, b, h, hk, sq, sk):
    """Persistent blocks (more tiles than SMs in three of the shapes, so blocks walk several
    query tiles and carry stage phases across them; rows that see no key when causal with
    sq > sk), taking tiles from the counter or in a fixed order, compute what one-tile blocks
    compute, bitwise, and pass the reference check; a launch leaves the counter at 0 (the next
    launch on the stream finds every tile, checked by running three); with two Q tiles
    (double_q, where shared memory has room) too."""
    import torch
    q, k, v = _inputs(rng, b, sq, sk, h, hk, d, "bfloat16")
    one, one_lse = fwd_ws.run(q, k, v, causal=causal, return_lse=True, **tile)
    try:  # (two Q tiles and the K/V stages fit in shared memory)
        two_q = fwd_ws.FwdWsVariant(head_dim=d, dtype="bf16", arch=90, causal=causal, persistent=True, double_q=True,
                                    **tile).double_q
    except ValueError:
        two_q = False
    for dynamic, double_q in ((True, False), (True, False), (False, False), (True, False)) + (
            ((True, True), (False, True), (True, True)) if two_q else ()):
        out = torch.full_like(q, float("nan"))
        res, lse = fwd_ws.run(q, k, v, causal=causal, out=out, return_lse=True, persistent=True, dynamic=dynamic,
                              double_q=double_q, **tile)
        torch.cuda.synchronize()
        assert res is out and torch.equal(out, one) and torch.equal(lse, one_lse), (dynamic, double_q)
    _check(out, lse, q, k, v, causal)


@requires_sm90
@requires_torch
@pytest.mark.parametrize("d,tile", PLANNED_TILES, ids=_tile_id)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("tail", [1, 64, 65])
def test_gpu_partial_last_tiles(rng, d, tile, causal, persistent, tail):
    """Sequences whose last query tile has ``tail`` rows (1 and 64: only the first consumer
    warpgroup's rows lie in the sequence; 65: the first two): the output (poisoned before the
    launch) and the LSE pass the reference check; persistent blocks walk several such tiles."""
    sq = 2 * tile.get("block_m", 128) + tail
    q, k, v = _inputs(rng, 3, sq, 300, 4, 2, d, "bfloat16")
    out, lse = _run_poisoned(q, k, v, causal, persistent=persistent, **tile)
    _check(out, lse, q, k, v, causal)


@requires_sm90
@requires_torch
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_strided_qkv(rng, causal):
    """q, k, v sliced from one packed (b, s, 3, h, d) tensor: the tensor maps carry the strides."""
    import torch
    qkv = torch.from_numpy(rng.standard_normal((2, 300, 3, 4, 64), dtype=np.float32)).to("cuda", torch.bfloat16)
    q, k, v = qkv.unbind(2)
    out, lse = _run_poisoned(q, k, v, causal)
    _check(out, lse, q, k, v, causal)


@requires_sm90
@requires_torch
@pytest.mark.parametrize("kw", SCHEDULES, ids=lambda kw: "_".join(kw))
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(128, 128), (113, 203), (1, 239), (1023, 1024), (640, 2048)])
def test_gpu_schedules_match_plain(rng, kw, d, causal, sq, sk):
    """Overlap and ping-pong change when products are issued, not the arithmetic: the output and
    LSE equal the plain schedule's bitwise, and pass the reference check; GQA included."""
    import torch
    q, k, v = _inputs(rng, 2, sq, sk, 4, 2, d, "bfloat16")
    tile = dict(block_n=fwd_ws.TILES[d]["block_n"])
    out = torch.full_like(q, float("nan"))
    res, lse = fwd_ws.run(q, k, v, causal=causal, out=out, return_lse=True, **tile, **kw)
    plain, plain_lse = fwd_ws.run(q, k, v, causal=causal, return_lse=True, **tile)
    torch.cuda.synchronize()
    assert res is out and torch.equal(out, plain) and torch.equal(lse, plain_lse)
    _check(out, lse, q, k, v, causal)


def test_fire_gives_persistent_blocks_the_stream_counter_or_one_block_per_tile(monkeypatch):
    """launch.fire (kernels recorded, tensor maps stubbed): a persistent plan launches one block
    per SM with the stream's counter; without one (none can be made now, or fused=False as
    jax.jit calls it) the same kernel gets one block per tile and a null counter; a one-tile plan
    never asks for a counter."""
    from cuflash import compiler, launch
    from cuflash.plan import DeviceFacts, Problem, make_plan
    launched, asked = [], []

    class Kernel:
        def __init__(self, variant):
            self.table = variant.params

        def launch(self, grid, block, smem, stream, values, early=False):
            self.table.layout.pack(*values)
            launched.append((grid, dict(zip(self.table.names, values))))

    monkeypatch.setattr(compiler, "get_kernel", lambda variant, device: Kernel(variant))
    monkeypatch.setattr(fwd_ws, "tensor_map", lambda *a: bytes(fwd_ws.TENSOR_MAP_BYTES))
    counter = [0x7000]

    def counter_ptr(device, stream, need):
        asked.append((device, stream, need))
        return counter[0]
    monkeypatch.setattr(launch, "_counter_ptr", counter_ptr)
    for sk, persistent in ((1000, True), (4096, False)):
        plan = make_plan(Problem(2, 1000, sk, 16, 4, 128, "bf16", True), DeviceFacts(132, 90))
        assert plan.launches[0].variant.persistent == persistent
        q, k = fake_view(0, (2, 1000, 16, 128), "bfloat16"), fake_view(0, (2, sk, 4, 128), "bfloat16", ptr=2 << 20)
        r = launch.prepare(plan, q, k, k, q, 0.125, 0)
        tiles = (8 * 16 * 2, 1, 1)
        for fused, ptr in ((True, 0x7000), (True, 0), (False, 0x7000)):
            counter[0], launched[:], asked[:] = ptr, [], []
            launch.fire(r, 0, 9, q.ptr, k.ptr, k.ptr, q.ptr, 0, fused=fused)
            (grid, fields), = launched
            if not persistent:
                assert grid == (8, 16, 2) and "tile_counter" not in fields and asked == []
            elif fused and ptr:
                assert grid == (132, 1, 1) and fields["tile_counter"] == 0x7000 and asked == [(0, 9, 1)]
            else:
                assert grid == tiles and fields["tile_counter"] == 0 and asked == ([(0, 9, 1)] if fused else [])


def test_prepare_fills_score_modifier_and_varlen_fields(monkeypatch):
    """launch.prepare of planned fwd_ws calls (kernels stubbed): softcap sets softcap_scale and the
    softmax's scale; ALiBi the slopes' pointer, batch stride and 1 / that scale; varlen the
    cu_seqlens pointers, LSE strides of (nheads, total_q) and tensor maps spanning every token as
    one batch. Packed sequences without a single key fall back to the wgmma kernel (no map can
    span zero rows)."""
    import math
    from cuflash import compiler, launch
    from cuflash.plan import DeviceFacts, Problem, make_plan
    from cuflash.validate import batched

    class Kernel:
        def __init__(self, variant):
            self.table, self.variant = variant.params, variant
    monkeypatch.setattr(compiler, "get_kernel", lambda variant, device: Kernel(variant))
    b, mq, mk, h, hk, d, tq, tk = 4, 512, 500, 16, 4, 128, 1700, 1200
    plan = make_plan(Problem(b, mq, mk, h, hk, d, "bf16", True, softcap=True, alibi=True, varlen=True),
                     DeviceFacts(132, 90))
    assert plan.kernels == ("fwd_ws_d128_bf16_causal_softcap_alibi_varlen_m128n128s2_overlap_pingpong_sm90",)
    q = batched(fake_view(0, (tq, h, d), "bfloat16"), b, mq)
    k = batched(fake_view(0, (tk, hk, d), "bfloat16", ptr=8 << 20), b, mk)
    r = launch.prepare(plan, q, k, k, q, 0.125, 0, softcap=30.0, alibi=(0x5000, h), varlen=(0x6000, 0x7000, tq, tk))
    fields = dict(zip(r.kernel.table.names[5:], r.mid))
    assert math.isclose(fields["softcap_scale"], 0.125 / 30) and math.isclose(fields["scale_log2"], 30 * math.log2(math.e))
    assert (fields["alibi_slopes"], fields["alibi_sb"]) == (0x5000, h) and math.isclose(fields["alibi_scale"], 1 / 30)
    assert (fields["cu_seqlens_q"], fields["cu_seqlens_k"]) == (0x6000, 0x7000)
    assert (fields["lse_sb"], fields["lse_sh"], fields["lse_sr"]) == (1, tq, 1)
    assert (fields["o_sb"], fields["o_ss"], fields["o_sh"]) == (h * d, h * d, d)
    dtype, mq_, mk_, mv_ = r.maps
    assert mq_ == ((1, tq, h, d), (tq * h * d, h * d, d, 1), 128)
    assert mk_ == mv_ == ((1, tk, hk, d), (tk * hk * d, hk * d, d, 1), 128) and dtype == "bf16"
    assert r.grid == (4, 16, 4) and r.tiles is None
    empty = launch.prepare(plan, q, k, k, q, 0.125, 0, softcap=30.0, alibi=(0x5000, h), varlen=(0x6000, 0x7000, tq, 0))
    assert empty.maps is None and empty.kernel.variant.family == "fwd"


@pytest.mark.parametrize("arch,sq,splits", [(90, 512, 0), (80, 512, 0), (90, 1, 4)])
def test_recipe_with_other_cu_seqlens_is_the_recipe_prepared_with_them(monkeypatch, arch, sq, splits):
    """launch.with_pointers (a repeated attention_varlen with other cu_seqlens arrays) gives the
    Recipe that prepare makes with those pointers: fwd_ws, the standard kernel, and a split plan
    whose combine kernel reads cu_seqlens_q too."""
    from cuflash import compiler, launch
    from cuflash.plan import DeviceFacts, Problem, make_plan
    from cuflash.validate import batched

    class Kernel:
        def __init__(self, variant):
            self.table, self.variant = variant.params, variant
    monkeypatch.setattr(compiler, "get_kernel", lambda variant, device: Kernel(variant))
    b, mk, h, hk, d, tk = 4, 900, 16, 4, 128, 2000
    tq = b * sq
    plan = make_plan(Problem(b, sq, mk, h, hk, d, "bf16", sq > 1, splits, varlen=True), DeviceFacts(132, arch))
    q = batched(fake_view(0, (tq, h, d), "bfloat16"), b, sq)
    k = batched(fake_view(0, (tk, hk, d), "bfloat16", ptr=8 << 20), b, mk)
    first, second = ((launch.prepare(plan, q, k, k, q, 0.125, 0, varlen=(cu_q, cu_k, tq, tk)))
                     for cu_q, cu_k in ((0x6000, 0x7000), (0x9100, 0xA200)))
    moved = launch.with_pointers(first, cu_seqlens_q=0x9100, cu_seqlens_k=0xA200)
    assert moved.mid == second.mid != first.mid and moved.combine == second.combine
    assert moved.split == (splits > 1) and (not moved.split or moved.combine["cu_seqlens_q"] == 0x9100)
    assert moved._replace(mid=first.mid, combine=first.combine, kernel=None) == first._replace(kernel=None)


@pytest.mark.parametrize("arch,n", [(90, 1), (90, 4), (80, 2)])
def test_recipe_with_other_flashmask_arrays_is_the_recipe_prepared_with_them(monkeypatch, arch, n):
    """launch.with_flashmask (a repeated FlashMask call: other indices, a new bounds workspace)
    gives the Recipe that prepare makes with those pointers, prep kernel included."""
    from cuflash import compiler, launch
    from cuflash.plan import DeviceFacts, Problem, make_plan

    class Kernel:
        def __init__(self, variant):
            self.table, self.variant = variant.params, variant
    monkeypatch.setattr(compiler, "get_kernel", lambda variant, device: Kernel(variant))
    b, s, h, hk, d = 2, 1000, 8, 2, 128
    plan = make_plan(Problem(b, s, s, h, hk, d, "bf16", n == 1, flashmask=n, flashmask_heads=hk),
                     DeviceFacts(132, arch))
    q = fake_view(0, (b, s, h, d), "bfloat16")
    k = fake_view(0, (b, s, hk, d), "bfloat16", ptr=8 << 20)
    st = (hk * s * n, s * n, n, 1)
    first, second = (launch.prepare(plan, q, k, k, q, 0.125, 0, flashmask=(idx, st, hk, ws))
                     for idx, ws in ((0x6000, 0x7000), (0x9100, 0xA200)))
    moved = launch.with_flashmask(first, 0x9100, 0xA200)
    assert moved.prep[3] == second.prep[3] != first.prep[3] and moved.mid == second.mid != first.mid
    assert (moved.prep[3]["idx"], moved.prep[3]["out"]) == (0x9100, 0xA200)


@requires_torch
def test_repeat_fires_each_calls_cu_seqlens_and_indices(monkeypatch):
    """api._Repeat (a repeated call on PyTorch tensors) fires its Recipe with each call's own
    cu_seqlens, or FlashMask indices and a bounds buffer of its own: the Recipe prepare makes
    with those pointers, never the first call's."""
    import torch
    from cuflash import api, arrays, compiler, launch
    from cuflash.plan import DeviceFacts, Problem, make_plan
    from cuflash.validate import batched

    class Kernel:
        def __init__(self, variant):
            self.table, self.variant = variant.params, variant
    monkeypatch.setattr(compiler, "get_kernel", lambda variant, device: Kernel(variant))
    fired = []
    monkeypatch.setattr(launch, "fire", lambda r, dev, stream, *ptrs: fired.append(r))
    monkeypatch.setattr(launch, "workspace", lambda r, dev, stream, new: (None, None))
    monkeypatch.setattr(arrays, "torch_stream", lambda dev: 7)
    monkeypatch.setattr(arrays, "current_device_id", lambda: 0)
    b, s, h, hk, d = 3, 256, 8, 2, 128
    tq = tk = 600
    q, k = torch.zeros(tq, h, d, dtype=torch.bfloat16), torch.zeros(tk, hk, d, dtype=torch.bfloat16)
    qv, kv = (batched(fake_view(0, tuple(x.shape), "bfloat16"), b, s) for x in (q, k))

    plan = make_plan(Problem(b, s, s, h, hk, d, "bf16", True, varlen=True), DeviceFacts(132, 90))
    first = launch.prepare(plan, qv, kv, kv, qv, 0.125, 0, varlen=(0x6000, 0x7000, tq, tk))
    rep = api._Repeat(first, 0, None, True, [(0x6000, 0x7000, first)])
    cus = [tuple(torch.zeros(b + 1, dtype=torch.int32) for _ in range(2)) for _ in range(2)]
    for cu_q, cu_k in (*cus, cus[0]):
        rep(q, k, k, None, cu_q, cu_k)
        want = launch.prepare(plan, qv, kv, kv, qv, 0.125, 0, varlen=(cu_q.data_ptr(), cu_k.data_ptr(), tq, tk))
        assert fired[-1].mid == want.mid

    x = torch.zeros(1, hk, s, 1, dtype=torch.int32)
    qd, kd = fake_view(0, (1, s, h, d), "bfloat16"), fake_view(0, (1, s, hk, d), "bfloat16")
    plan = make_plan(Problem(1, s, s, h, hk, d, "bf16", True, flashmask=1, flashmask_heads=hk), DeviceFacts(132, 90))
    st = tuple(x.stride())
    first = launch.prepare(plan, qd, kd, kd, qd, 0.125, 0, flashmask=(0x6000, st, hk, 0x7000))
    n = max(plan.workspace_bytes // 4, 1)
    rep = api._Repeat(first, 0, None, True, fm_ints=n)
    indices = [torch.zeros_like(x) for _ in range(2)]
    for idx in indices:
        rep(q[:s].view(1, s, h, d), k[:s].view(1, s, hk, d), k[:s].view(1, s, hk, d), None, fm=idx)
        fields = fired[-1].prep[3]
        assert fields["idx"] == idx.data_ptr() and fields["out"] not in (0, 0x7000)
        want = launch.with_flashmask(first, idx.data_ptr(), fields["out"])
        assert fired[-1].mid == want.mid != first.mid


@pytest.fixture
def fired(monkeypatch):
    """The names of the main kernels launch.fire launches (as it does them)."""
    from cuflash import launch
    names, fire = [], launch.fire

    def record(r, *args, **kw):
        names.append(r.kernel.name)
        return fire(r, *args, **kw)
    monkeypatch.setattr(launch, "fire", record)
    return names


@requires_sm90
@requires_torch
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (100, 30))])
@pytest.mark.parametrize("softcap,alibi", [(0.0, None), (30.0, None), (0.0, "bh"), (20.0, "h")])
def test_gpu_planned_varlen_and_score_modifiers(rng, fired, d, causal, window, softcap, alibi):
    """attention_varlen plans fwd_ws on sm_90 with packed sequences (an empty one, a length-1 one,
    lengths crossing tiles), GQA, softcap and ALiBi, and matches the float64 reference with
    NaN-poisoned outputs; so does attention on the dense batch."""
    import torch
    import cuflash
    from cuflash import reference
    from test_gpu_varlen import check_against, ref_varlen, run_varlen, slopes, varlen_case
    q, k, v, cq, ck, mq, mk = varlen_case(rng, 5, 300, 437, 8, 2, d, "bfloat16" if d != 128 else "float16")
    a = slopes(rng, alibi, 5, 8)
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    out, lse = run_varlen(q, k, v, cq, ck, mq, mk, a, num_splits=1, **kw)  # (no split-KV for the small grid)
    assert fired[-1].startswith(f"fwd_ws_d{d}_") and "_varlen" in fired[-1]
    check_against(out, lse, *ref_varlen(q, k, v, cq, ck, a, kw))
    qd, kd, vd = _inputs(rng, 2, 333, 1000, 8, 2, d, "bfloat16")
    ad = slopes(rng, alibi, 2, 8)
    plan = cuflash.plan(qd, kd, vd, alibi_slopes=ad, num_splits=1, **kw)  # (no split-KV for the small grid)
    assert plan.kernels[0].startswith(f"fwd_ws_d{d}_") and ("_softcap" in plan.kernels[0]) == (softcap > 0)
    out = torch.full_like(qd, float("nan"))
    res, lse = cuflash.attention(qd, kd, vd, out=out, return_lse=True, alibi_slopes=ad, num_splits=1, **kw)
    assert fired[-1] == plan.kernels[0]
    args = [to_np(x) for x in (qd, kd, vd)]
    ra = None if ad is None else ad.cpu().numpy()
    ref, ref_lse = reference.attention(*args, alibi_slopes=ra, return_lse=True, **kw)
    same = reference.attention(*args, alibi_slopes=ra, precision="same", **kw)
    check_against(out, lse, ref, same, ref_lse)


@requires_sm90
@requires_torch
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mask", [dict(causal=False), dict(causal=True), dict(causal=True, window_size=(100, 0))])
@pytest.mark.parametrize("sq,sk,sinks_dtype", [(333, 1000, "float32"), (1000, 300, "bfloat16"),
                                               (2048, 2048, "float16")])
def test_gpu_planned_sinks(rng, fired, d, mask, sq, sk, sinks_dtype):
    """Attention sinks run on fwd_ws (gpt-oss: d=64, a 128-token window every other layer), one
    block per tile and persistent (at most 1024 keys; d=64 causal 2048): NaN-poisoned outputs and
    the LSE (the sink included) match the float64 reference; with sk < sq causal, rows that see no
    key end with O = 0 and LSE = the sink."""
    import torch
    import cuflash
    from test_sinks import _sinks, check_forward
    q, k, v = _inputs(rng, 2, sq, sk, 8, 2, d, "bfloat16")
    sinks = _sinks(rng, 8, sk, sinks_dtype)
    plan = cuflash.plan(q, k, v, sinks=sinks, num_splits=1, **mask)  # (no split-KV for the small grids)
    assert plan.kernels[0].startswith(f"fwd_ws_d{d}_") and "_sinks" in plan.kernels[0]
    out = torch.full_like(q, float("nan"))
    res, lse = cuflash.attention(q, k, v, sinks=sinks, out=out, return_lse=True, num_splits=1, **mask)
    assert res is out and fired[-1] == plan.kernels[0]
    check_forward(out, lse, q, k, v, sinks, **mask)


@requires_sm90
@requires_torch
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_planned_varlen_sinks(rng, fired, d):
    """Packed sequences with sinks (an empty one, a length-1 one) on fwd_ws against the reference."""
    from test_gpu_varlen import run_varlen, varlen_case
    from test_sinks import _sinks, check_forward
    q, k, v, cq, ck, mq, mk = varlen_case(rng, 5, 300, 437, 8, 2, d, "bfloat16")
    sinks = _sinks(rng, 8, 437)
    out, lse = run_varlen(q, k, v, cq, ck, mq, mk, None, causal=True, sinks=sinks, num_splits=1)
    assert fired[-1].startswith(f"fwd_ws_d{d}_") and "_varlen_sinks" in fired[-1]
    check_forward(out, lse, q, k, v, sinks, varlen=(cq, ck), causal=True)


@requires_sm90
@requires_torch
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_varlen_long_sequences_plan_fwd_ws(rng, fired, causal, d):
    """Packed sequences of up to 2300 queries (d=64: the 192-row tile when causal past 2048) run
    fwd_ws, per-sequence bottom-right causal, against the reference."""
    from test_gpu_varlen import check_against, ref_varlen, run_varlen, varlen_case
    q, k, v, cq, ck, mq, mk = varlen_case(rng, 3, 2300, 2100, 4, 2, d, "bfloat16")
    out, lse = run_varlen(q, k, v, cq, ck, mq, mk, None, causal=causal)
    assert fired[-1] == fwd_ws.planned(d, "bf16", causal, mq, seqlen_k=mk, varlen=True).name
    check_against(out, lse, *ref_varlen(q, k, v, cq, ck, None, dict(causal=causal)))


def test_prepare_fills_kv_cache_fields(monkeypatch):
    """launch.prepare of a planned fwd_ws call on a contiguous KV cache (kernels stubbed): the
    cache's pointers, the kernel's seqlen_k (the appended tokens, added to each cache_seqlens),
    the leftpad pointer, and tensor maps over the caches as they are."""
    from cuflash import compiler, launch
    from cuflash.plan import DeviceFacts, Problem, make_plan

    class Kernel:
        def __init__(self, variant):
            self.table, self.variant = variant.params, variant
    monkeypatch.setattr(compiler, "get_kernel", lambda variant, device: Kernel(variant))
    b, sq, cap, h, hk, d = 4, 512, 3000, 16, 4, 128
    plan = make_plan(Problem(b, sq, cap, h, hk, d, "bf16", True, kv="cache", leftpad=True), DeviceFacts(132, 90))
    assert plan.kernels == ("fwd_ws_d128_bf16_causal_cache_leftpad_m128n128s2_overlap_pingpong_sm90",)
    q = fake_view(0, (b, sq, h, d), "bfloat16")
    kc = fake_view(0, (b + 2, cap, hk, d), "bfloat16", ptr=8 << 20)
    r = launch.prepare(plan, q, kc, kc, q, 0.125, 0, cache=(0x100, 0x200, 0, 0), seqlen_k=sq, leftpad=0x300)
    fields = dict(zip(r.kernel.table.names[5:], r.mid))
    assert (fields["seqlens_k"], fields["kv_batch_idx"], fields["kv_leftpad"], fields["seqlen_k"]) == (
        0x100, 0x200, 0x300, sq)
    assert r.maps[2] == ((b + 2, cap, hk, d), tuple(kc.strides), 128) and r.grid == (4, 16, 4)


@requires_sm90
@requires_torch
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mode", ["plain", "batch_idx", "leftpad"])
@pytest.mark.parametrize("causal,window,softcap", [(True, (-1, -1), 0.0), (False, (-1, -1), 30.0),
                                                   (False, (200, 0), 0.0)])
def test_gpu_kvcache_chunk_runs_fwd_ws(rng, fired, d, mode, causal, window, softcap):
    """A chunk of 300 new tokens appended to contiguous caches (per-sequence lengths, an empty
    one; cache_batch_idx; cache_leftpad) runs fwd_ws on sm_90 and matches the float64 reference
    over each sequence's keys, with NaN-poisoned outputs."""
    import torch
    import cuflash
    from cuflash.reference import check_close
    b, sq, h, hk, cap = 3, 300, 8, 2, 1100
    rnd = lambda *s: torch.from_numpy(rng.standard_normal(s, dtype=np.float32)).to("cuda", torch.bfloat16)
    old = np.array([700, 0, 237], dtype=np.int32)
    lead = np.array([50, 0, 237], dtype=np.int32) if mode == "leftpad" else np.zeros(b, np.int32)
    nb = b + 2 if mode == "batch_idx" else b
    idx = rng.permutation(nb)[:b].astype(np.int32) if mode == "batch_idx" else np.arange(b, dtype=np.int32)
    q, kc, vc, kn, vn = rnd(b, sq, h, d), rnd(nb, cap, hk, d), rnd(nb, cap, hk, d), rnd(b, sq, hk, d), rnd(b, sq, hk, d)
    ks = [torch.cat([kc[idx[i], lead[i]:old[i]], kn[i]]) for i in range(b)]
    vs = [torch.cat([vc[idx[i], lead[i]:old[i]], vn[i]]) for i in range(b)]
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    extra = {}
    if mode == "batch_idx":
        extra["cache_batch_idx"] = torch.from_numpy(idx).cuda()
    if mode == "leftpad":
        extra["cache_leftpad"] = torch.from_numpy(lead).cuda()
    out = torch.full_like(q, float("nan"))
    cuflash.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=torch.from_numpy(old).cuda(), out=out,
                                   num_splits=1, **extra, **kw)
    assert fired[-1].startswith(f"fwd_ws_d{d}_") and "_cache" in fired[-1]
    assert ("_leftpad" in fired[-1]) == (mode == "leftpad")
    for i in range(b):
        ok, err, bound = check_close(to_np(out[i:i + 1]), to_np(q[i:i + 1]), to_np(ks[i][None]), to_np(vs[i][None]),
                                     **kw)
        assert ok, f"sequence {i}: max error {err:.3g} exceeds bound {bound:.3g}"


@requires_sm90
@requires_torch
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("page", [1, 16, 24, 32, 64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_paged_kvcache_chunk(rng, fired, d, page, causal):
    """A chunk of 256 new tokens appended to paged caches (pages in random order): fwd_ws where the
    pages hold whole K/V tiles or divide them (TMA boxes, pages of at least 64 rows) or gathered
    with cp.async (smaller pages, or pages that neither hold nor divide tiles); against the
    float64 reference over each sequence's keys."""
    import torch
    import cuflash
    from test_gpu_kvcache import check_batches, make_case
    b, sq, sk, h, hk = 3, 256, 900, 8, 2
    q, kc, vc, kn, vn, seqlens, kw, ks, vs, rows, lens = make_case(rng, b, sq, sk, h, hk, d, f"paged{page}", sq)
    out = torch.full_like(q, float("nan"))
    cuflash.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=causal, out=out, num_splits=1,
                                   **kw)
    assert "_paged" in fired[-1] and fired[-1].startswith("fwd_ws_"), fired[-1]
    assert ("_gather" in fired[-1]) == fwd_ws.gathers(page, d), fired[-1]
    check_batches(out, q, ks, vs, causal)
    for i in range(b):
        assert torch.equal(rows(kc, i, int(lens[i])), ks[i]) and torch.equal(rows(vc, i, int(lens[i])), vs[i])


def test_double_q_needs_persistent_blocks_and_room():
    """Two Q tiles: persistent blocks only, where Q, the second Q tile and the K/V stages fit (not at
    d = 256) and the mbarrier area holds the second Q tile's two barriers (not three stages with
    softmax turns); every variant the planner can pick keeps within the mbarrier area."""
    base = dict(head_dim=64, dtype="bf16", arch=90, pingpong=True, turn_softmax=True)
    assert fwd_ws.FwdWsVariant(**base, persistent=True, double_q=True).double_q
    for bad in (dict(persistent=False), dict(persistent=True, stages=3)):
        with pytest.raises(ValueError, match="double_q"):
            fwd_ws.FwdWsVariant(**base, **{**bad, "double_q": True})
    with pytest.raises(ValueError, match="double_q"):
        fwd_ws.FwdWsVariant(head_dim=256, dtype="bf16", arch=90, block_n=80, overlap=True, pingpong=True, causal=True,
                            persistent=True, double_q=True)
    assert all(v._barrier_area <= fwd_ws.BARRIER_BYTES for v in fwd_ws.variants(90))
