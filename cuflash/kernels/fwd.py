"""Forward family: the FlashAttention-2 forward kernel and its split-KV form (templates/fwd/),
on mma.sync everywhere and on Hopper's warpgroup MMA (wgmma, sm_90a) for the standard kernel.

Tiles are (block_m query rows, block_n keys per K/V tile, warps, K/V stages). Every variant
compiles with no register spills under NVRTC 13.0 and 13.5 (checked in the CPU tests).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from . import HEAD_DIM_BUCKETS, KernelVariant, tile_name
from .params import ParamTable, strides

KINDS = ("fwd", "fwd_split")
KV_SOURCES = ("dense", "cache", "paged")

# Standard kernel tiles per head-dim bucket (FA2 kernel_traits style), tuned on an H200
# (scripts/tune_tiles.py).
FWD_TILES = {
    32: (128, 128, 4, 1),
    64: (128, 96, 4, 2),
    96: (128, 64, 4, 2),
    128: (128, 48, 4, 2),
    192: (64, 64, 4, 1),
    256: (64, 64, 4, 1),
}
# Hopper (sm_90a): two warpgroups of 64 query rows share each K/V tile through wgmma, two K/V
# stages. Buckets that are multiples of 64 (the 128-byte swizzle's column block).
WGMMA_TILES = {64: (128, 128, 8, 2), 128: (128, 128, 8, 2), 192: (128, 64, 8, 2), 256: (128, 64, 8, 2)}
SPLIT_BLOCK_M, SPLIT_WARPS = 64, 4  # FA2's split-KV kernel: kBlockM 64, 4 warps
# The decode tile: one 16-row query tile per block (one token per sequence, or a GQA-packed
# group of at most 16 heads) whose 4 warps each take a quarter of every K/V tile's keys.
DECODE_BLOCK_M, DECODE_WARPS, DECODE_MAX_ROWS = 16, 4, 16
# An early-launched grid of one wave keeps one block per SM if each block asks for more than
# half of an sm_90 SM's 228 KB (see FwdVariant.smem_limit).
EXCLUSIVE_SMEM = 116 * 1024


def decode_tile(bucket: int) -> tuple[int, int, int, int]:
    """(block_m, block_n, warps, stages) of the decode tile: a three-deep pipeline of 64-key
    tiles (little math per byte: decode needs bytes in flight); one stage above d = 128, for
    shared memory."""
    return (DECODE_BLOCK_M, 64, DECODE_WARPS, 3 if bucket <= 128 else 1)


def fwd_tile(bucket: int, even: bool, arch: int, kv: str = "dense",
             mods: bool = False) -> tuple[int, int, int, int, str]:
    """The standard kernel's tile: (block_m, block_n, warps, stages, mma). On sm_90, buckets that
    are multiples of 64 run the wgmma kernel (WGMMA_TILES), whatever the K/V source and score
    modifiers. Otherwise mma.sync: FWD_TILES's second K/V stage is for sm_90 with the full head
    dim and dense K/V; column predicates, other archs and KV caches (per-batch lengths,
    block-table lookups) use one stage and at most 64 keys per tile (32 at d = 128), where the
    second stage's registers would spill. ``mods`` (a sliding window, softcap or ALiBi: bounds,
    slopes and tanh temporaries) needs registers a 128-row tile at d >= 96 does not have: 64 query
    rows, at most 64 keys per tile (32 at d >= 192), two stages where the base tile has them."""
    if arch == 90 and bucket in WGMMA_TILES:
        return (*WGMMA_TILES[bucket], "wgmma")
    bm, bn, w, st = FWD_TILES[bucket]
    tuned = even and arch >= 90 and kv == "dense"
    if mods:
        return (128 if bucket <= 64 else 64, 32 if bucket >= 192 else 64, w, 2 if tuned and bucket <= 128 else 1,
                "sync")
    if tuned:
        return (bm, bn, w, st, "sync")
    return (bm, 32 if bucket == 128 else min(bn, 64), w, 1, "sync")


def unaligned_leftpad_tile(tile: tuple) -> tuple:
    """The standard kernel's mma.sync tile over a cache read element by element with
    cache_leftpad: at most 32 keys per tile (at d = 96 the 64-key tile spilled 32 B under NVRTC
    13.0). wgmma tiles are unchanged."""
    bm, bn, w, st, mma = tile
    return tile if mma == "wgmma" else (bm, min(bn, 32), w, st, mma)


def split_block_n(d: int) -> int:
    """FA2's split-KV kBlockN (and the block_n of its heuristic): 256 / 128 / 64."""
    return 256 if d <= 64 else (128 if d <= 128 else 64)


def split_tile_n(bucket: int, local: bool = False, softcap: bool = False, alibi: bool = False,
                 kv: str = "dense", unaligned: bool = False, chunk: bool = False) -> int:
    """Keys per K/V tile of the split-KV kernel (outside decode): FA2's block_n, but at most 64
    (32 above d = 128) where its registers spill at FA2's tile: a window with softcap and ALiBi
    together, or a window with either of them over a paged cache (block-table lookups); and at
    most 128 when the cache's rows are read element by element (``unaligned``) or the band is
    cut into chunks (``chunk``), whose 256-key tiles at d = 64 spill."""
    heavy = local and ((softcap and alibi) or (kv == "paged" and (softcap or alibi)))
    n = (64 if bucket <= 128 else 32) if heavy else split_block_n(bucket)
    return min(n, 128) if unaligned or chunk else n


PARAMS = ParamTable("FwdParams", (
    ("q", "const u16*"), ("k", "const u16*"), ("v", "const u16*"),
    ("o", "void*"), ("lse", "float*"),  # split kernel: the fp32 partial O and LSE
    *strides("q", "sb", "ss", "sh"), *strides("k", "sb", "ss", "sh"),
    *strides("v", "sb", "ss", "sh"), *strides("o", "sb", "ss", "sh"),
    ("seqlen_q_arg", "int"), ("seqlen_k_arg", "int"), ("nheads", "int"), ("ngroups", "int"),
    ("head_dim", "int"), ("scale_log2", "float"), ("num_splits", "int"), ("n_blocks_per_split", "int"),
    ("seqlens_k", "const int*"), ("kv_batch_idx", "const int*"), ("block_table", "const int*"),
    ("block_table_stride", "int"), ("page_size", "int"),
    ("cu_seqlens_q", "const int*"), ("cu_seqlens_k", "const int*"), ("q_rows_per_token", "int"),
    *strides("lse", "sb", "sh", "sr"),
    ("window_left", "int"), ("window_right", "int"), ("softcap_scale", "float"),
    ("alibi_slopes", "const float*"), ("alibi_sb", "int"), ("alibi_scale", "float"),
    ("o_final", "void*"), ("lse_final", "float*"), ("counters", "int*"),  # split kernel: the merge
))
# The per-call data pointers: the first five fields and the last three (launch.fire fills them).
DATA_HEAD, DATA_TAIL = 5, 3
assert PARAMS.names[:DATA_HEAD] == ("q", "k", "v", "o", "lse")
assert PARAMS.names[-DATA_TAIL:] == ("o_final", "lse_final", "counters")
# FlashMask variants (flashmask > 0) take these fields too, before the trailing data pointers:
# the indices (batch, fm heads, seqlen_k, n) with element strides, query heads per index head,
# and the prep kernel's per-key-block bounds (kernels/flashmask.py: min and max of each column
# per (batch, index head, block of kBlockN keys)).
FLASHMASK_FIELDS = (("fm_idx", "const int*"), *strides("fm", "sb", "sh", "ss", "sc"), ("fm_hdiv", "int"),
                    ("fm_heads", "int"), ("fm_blocks", "const int*"))
FLASHMASK_PARAMS = ParamTable("FwdParams", PARAMS.fields[:-DATA_TAIL] + FLASHMASK_FIELDS + PARAMS.fields[-DATA_TAIL:])
FLASHMASK_NS = (1, 2, 4)  # bound columns per key: 1 or 2 with causal, 2 or 4 without
# Attention-sink variants (sinks=True) take these fields too, before the trailing data pointers:
# the sink logits (one per query head, in their own dtype: SINK_DTYPES) and the index of row i
# of head h as launched, h * sinks_sh + i * sinks_sr (packed GQA rows are query heads).
SINK_FIELDS = (("sinks", "const void*"), ("sinks_dtype", "int"), ("sinks_sh", "int"), ("sinks_sr", "int"))
SINK_PARAMS = ParamTable("FwdParams", PARAMS.fields[:-DATA_TAIL] + SINK_FIELDS + PARAMS.fields[-DATA_TAIL:])
SINK_DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2}  # sinks_dtype (templates/common/sinks.cuh)
# Paged variants take the block table's column count too (after the sink fields, before the
# trailing data pointers): the kernel never reads a page index past it, whatever the key counts
# on the device say. Leftpad variants (a KV cache) take cache_leftpad: sequence b's keys start at
# its cache row kv_leftpad[b] (found through the block table in a paged cache).
PAGED_FIELDS = (("pages_per_seq", "int"),)
LEFTPAD_FIELDS = (("kv_leftpad", "const int*"),)
# Dropout variants take the call's Philox seed and offset (64-bit words, as two's complement),
# the 16-bit keep threshold and 1 / (1 - dropout_p) (templates/common/dropout.cuh).
DROPOUT_FIELDS = (("dropout_seed", "long long"), ("dropout_offset", "long long"), ("dropout_keep", "int"),
                  ("dropout_scale", "float"))
# Chunk variants (chunked attention on a local band) take the chunk's length in keys.
CHUNK_FIELDS = (("attention_chunk", "int"),)


@functools.lru_cache(maxsize=None)
def _params(flashmask: bool, sinks: bool, paged: bool, leftpad: bool, dropout: bool = False,
            chunk: bool = False) -> ParamTable:
    """The struct of a variant: PARAMS with the optional field groups before the trailing data
    pointers, in a fixed order (so each combination has one layout)."""
    if flashmask:
        return FLASHMASK_PARAMS
    extra = (SINK_FIELDS if sinks else ()) + (PAGED_FIELDS if paged else ()) + (LEFTPAD_FIELDS if leftpad else ())
    extra += (DROPOUT_FIELDS if dropout else ()) + (CHUNK_FIELDS if chunk else ())
    if not extra:
        return PARAMS
    return ParamTable("FwdParams", PARAMS.fields[:-DATA_TAIL] + extra + PARAMS.fields[-DATA_TAIL:])


@dataclass(frozen=True, kw_only=True)
class FwdVariant(KernelVariant):
    """A forward (``kind="fwd"``) or split-KV forward (``"fwd_split"``) kernel."""

    family = "fwd"

    kind: str
    head_dim: int             # bucket, one of HEAD_DIM_BUCKETS
    dtype: str                # "fp16" or "bf16"
    block_m: int
    block_n: int
    warps: int
    stages: int               # K/V shared-memory buffers
    causal: bool = False
    even_head_dim: bool = False  # the real head dim equals the bucket: no column predicates
    kv: str = "dense"         # K/V source: "dense" tensors, a "cache" with per-batch lengths, "paged" cache
    local: bool = False       # sliding-window mask (window bounds are launch arguments)
    softcap: bool = False     # softcap * tanh(s / softcap) on the scores
    alibi: bool = False       # ALiBi bias -slope * |i + sk - sq - j|
    mma: str = "sync"         # products: warp-level mma.sync, or Hopper's warpgroup wgmma (sm_90a)
    flashmask: int = 0        # FlashMask bound columns per key (cuflash.masks), 0 = none
    sinks: bool = False       # attention sinks: each row's softmax starts from its head's sink logit
    leftpad: bool = False     # a KV cache whose sequences start at row cache_leftpad[b]
    kv_unaligned: bool = False  # cache/paged K/V read element by element (head dims not a multiple of 8)
    dropout: bool = False     # attention dropout on P (templates/common/dropout.cuh)
    chunk: bool = False       # chunked attention on a local band (the chunk length is a launch argument)

    def __post_init__(self):
        super().__post_init__()
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        self._check_head_dim_dtype()
        if self.kv not in KV_SOURCES:
            raise ValueError(f"kv must be one of {KV_SOURCES}, got {self.kv!r}")
        self._check_tile()
        if self.block_m % 16 or self.block_n % 16 or (self.block_m > 16 and self.block_m % (16 * self.warps)):
            raise ValueError(f"block_m must be 16 or a multiple of 16 * warps and block_n a multiple of 16, "
                             f"got {self.block_m}x{self.block_n} with {self.warps} warps")
        if self.mma == "wgmma" and not (self.arch == 90 and self.kind == "fwd" and self.head_dim % 64 == 0
                                        and self.block_m == 16 * self.warps and self.warps % 4 == 0
                                        and self.stages >= 2):
            raise ValueError("a wgmma forward variant is a standard kernel (kind 'fwd') for sm_90 with a head-dim "
                             "bucket that is a multiple of 64, 64 query rows per warpgroup (block_m = 16 * warps, "
                             f"warps a multiple of 4) and at least two K/V stages; got {self}")
        if self.flashmask and not (self.flashmask in (1, 2) if self.causal else self.flashmask in (2, 4)):
            raise ValueError(f"flashmask must be 0, or 1 or 2 with causal, 2 or 4 without; got {self.flashmask} "
                             f"with causal={self.causal}")
        if self.flashmask and (self.kind != "fwd" or self.kv != "dense" or self.local or self.alibi or self.decode
                               or self.sinks):
            raise ValueError("a FlashMask variant is a standard kernel (kind 'fwd', not the decode tile) over dense "
                             f"K/V with no window, no ALiBi and no sinks; got {self}")

        if self.leftpad and self.kv == "dense":
            raise ValueError(f"a leftpad variant reads a KV cache (kv 'cache' or 'paged'); got {self}")
        if self.dropout and (self.kind != "fwd" or self.kv != "dense" or self.decode or self.flashmask or self.sinks):
            # Dropout is for training: no KV cache, no split (flash-attn's rule), no decode tile
            # (its warps split the keys), no FlashMask or sinks (not combined in flash-attn either).
            raise ValueError("a dropout variant is a standard kernel (kind 'fwd', not the decode tile) over dense "
                             f"K/V with no FlashMask and no sinks; got {self}")
        if self.chunk and not self.local:
            raise ValueError(f"a chunk variant is a local (band) kernel, got {self}")
        if self.kv_unaligned and (self.kv == "dense" or self.even_head_dim or self.decode):
            raise ValueError("an unaligned-K/V variant reads a cache or paged cache whose head dim is below its "
                             f"bucket (not the decode tile); got {self}")

    @property
    def params(self) -> ParamTable:
        return _params(bool(self.flashmask), self.sinks, self.kv == "paged", self.leftpad, self.dropout, self.chunk)

    @functools.cached_property
    def name(self) -> str:
        return tile_name(self.kind, self.head_dim, self.dtype, causal=self.causal, local=self.local,
                         softcap=self.softcap, alibi=self.alibi, even_head_dim=self.even_head_dim,
                         mma=self.mma, kv=self.kv, block_m=self.block_m, block_n=self.block_n,
                         warps=self.warps, stages=self.stages, arch=self.arch, flashmask=self.flashmask,
                         sinks=self.sinks, leftpad=self.leftpad, kv_unaligned=self.kv_unaligned,
                         dropout=self.dropout, chunk=self.chunk)

    @property
    def template(self) -> str:
        return "fwd/fwd_wgmma.cu.j2" if self.mma == "wgmma" else "fwd/fwd.cu.j2"

    @property
    def decode(self) -> bool:
        """The decode tile: one 16-row query tile whose warps split each K/V tile's keys."""
        return self.block_m == DECODE_BLOCK_M and self.warps > 1

    @property
    def swizzled(self) -> bool:
        """Shared tiles in the 128-byte swizzle rather than padded rows: wgmma's, and the decode
        tile's at head-dim buckets 64 and 128, whose rows then start on 128-byte lines so no
        cp.async row is requested from L2 twice."""
        return self.mma == "wgmma" or (self.decode and self.head_dim in (64, 128))

    @property
    def smem_bytes(self) -> int:
        """Q tile and K/V tiles per stage, 2-byte elements, in rows of d + 8 (padded) or d
        (swizzled: the output staging fits in the tiles)."""
        row = self.head_dim if self.swizzled else self.head_dim + 8
        return (self.block_m + 2 * self.block_n * self.stages) * row * 2

    @property
    def smem_limit(self) -> int:
        """The decode tile's split kernel on sm_90 may ask for EXCLUSIVE_SMEM: an early launch of
        a grid of at most one wave (see launch.prepare) whose blocks are placed while the previous
        grid's still run must not put two blocks on an SM that had room."""
        if self.kind == "fwd_split" and self.decode and self.arch >= 90:
            return max(self.smem_bytes, EXCLUSIVE_SMEM)
        return self.smem_bytes

    def constants(self) -> dict:
        return dict(head_dim=self.head_dim, block_m=self.block_m, block_n=self.block_n, warps=self.warps,
                    stages=self.stages, causal=self.causal, local=self.local, softcap=self.softcap,
                    alibi=self.alibi, split=self.kind == "fwd_split", bf16=self.dtype == "bf16",
                    even_head_dim=self.even_head_dim, kv_cache=self.kv != "dense", paged=self.kv == "paged",
                    swizzle=self.swizzled, split_n=self.decode, flashmask=self.flashmask, sinks=self.sinks,
                    leftpad=self.leftpad, kv_unaligned=self.kv_unaligned, dropout=self.dropout, chunk=self.chunk)


MASKS = ((False, False), (True, False), (False, True))  # (causal, local)
MODS = ((False, False), (True, False), (False, True), (True, True))  # (softcap, alibi)


def variants(arch: int, mods: bool = True) -> list[FwdVariant]:
    """Every forward variant a plan can launch on ``arch``. ``mods=False`` leaves out the
    window/softcap/ALiBi and attention-sink variants."""
    out = []
    for bucket in HEAD_DIM_BUCKETS:
        for dtype in ("fp16", "bf16"):
            for causal, local in MASKS if mods else MASKS[:2]:
                for softcap, alibi in MODS if mods else MODS[:1]:
                    m = dict(head_dim=bucket, dtype=dtype, causal=causal, local=local, softcap=softcap,
                             alibi=alibi, arch=arch)
                    for even in (False, True):
                        for kv in KV_SOURCES:
                            bm, bn, w, st, mma = fwd_tile(bucket, even, arch, kv, local or softcap or alibi)
                            out.append(FwdVariant(kind="fwd", even_head_dim=even, kv=kv, block_m=bm, block_n=bn,
                                                  warps=w, stages=st, mma=mma, **m))
                            out.append(FwdVariant(kind="fwd_split", even_head_dim=even, kv=kv,
                                                  block_m=SPLIT_BLOCK_M,
                                                  block_n=split_tile_n(bucket, local, softcap, alibi, kv),
                                                  warps=SPLIT_WARPS, stages=1, **m))
                            if even:
                                bm, bn, w, st = decode_tile(bucket)
                                for kind in KINDS:
                                    out.append(FwdVariant(kind=kind, even_head_dim=even, kv=kv, block_m=bm,
                                                          block_n=bn, warps=w, stages=st, **m))
    # KV-cache features: cache_leftpad on contiguous and paged caches; element-wise K/V loads for
    # cache and paged variants below their bucket (head dims that are not a multiple of 8).
    out += [replace(v, leftpad=True) for v in out if v.kv != "dense"]
    out += [replace(v, kv_unaligned=True, block_n=split_tile_n(v.head_dim, v.local, v.softcap, v.alibi, v.kv, True)
                    if v.kind == "fwd_split" else
                    unaligned_leftpad_tile((v.block_m, v.block_n, v.warps, v.stages, v.mma))[1] if v.leftpad
                    else v.block_n)
            for v in out if v.kv != "dense" and not v.even_head_dim and not v.decode]
    if mods:
        out += [replace(v, sinks=True) for v in out]  # sinks cross everything but FlashMask
        out += flashmask_variants(arch)
        out += dropout_variants(arch)
    return out


def dropout_tile(bucket: int, even: bool, arch: int) -> tuple[int, int, int, int, str]:
    """The dropout kernel's tile: the standard kernel's tile with score modifiers (the Philox
    words and their temporaries need the registers a modifier does); wgmma's on sm_90."""
    return fwd_tile(bucket, even, arch, "dense", True)


def dropout_variants(arch: int) -> list[FwdVariant]:
    """The dropout forward variants: standard kernel, dense K/V, every mask and score modifier."""
    out = []
    for bucket in HEAD_DIM_BUCKETS:
        for dtype in ("fp16", "bf16"):
            for causal, local in MASKS:
                for softcap, alibi in MODS:
                    for even in (False, True):
                        bm, bn, w, st, mma = dropout_tile(bucket, even, arch)
                        out.append(FwdVariant(kind="fwd", head_dim=bucket, dtype=dtype, causal=causal, local=local,
                                              softcap=softcap, alibi=alibi, even_head_dim=even, block_m=bm,
                                              block_n=bn, warps=w, stages=st, mma=mma, arch=arch, dropout=True))
    return out


def flashmask_tile(bucket: int, even: bool, arch: int) -> tuple[int, int, int, int, str]:
    """The FlashMask kernel's tile: the standard kernel's tile for dense K/V, where the per-column
    bounds and the tile's class (skip, mask, plain) need registers as a score modifier does."""
    return fwd_tile(bucket, even, arch, "dense", True)


def flashmask_variants(arch: int) -> list[FwdVariant]:
    """The FlashMask forward variants: dense K/V, causal with n in (1, 2) or not with n in (2, 4),
    with and without softcap."""
    out = []
    for bucket in HEAD_DIM_BUCKETS:
        for dtype in ("fp16", "bf16"):
            for causal, ns in ((False, (2, 4)), (True, (1, 2))):
                for softcap in (False, True):
                    for even in (False, True):
                        bm, bn, w, st, mma = flashmask_tile(bucket, even, arch)
                        for n in ns:
                            out.append(FwdVariant(kind="fwd", head_dim=bucket, dtype=dtype, causal=causal,
                                                  softcap=softcap, even_head_dim=even, block_m=bm, block_n=bn,
                                                  warps=w, stages=st, mma=mma, arch=arch, flashmask=n))
    return out
