"""Warp-specialised forward for Hopper (templates/fwd_ws/, sm_90a), after FlashAttention-3: a
producer warpgroup issues TMA tile loads that complete on mbarriers; two or three consumer
warpgroups of 64 query rows each run wgmma and the online softmax. Dense K/V, packed (varlen)
sequences, contiguous KV caches and paged ones whose pages hold whole K/V tiles or divide them; head dims 64,
128 and 256 (exactly), fp16/bf16, full, causal or a sliding window, softcap, ALiBi, sinks, FlashMask,
GQA, LSE. The planner runs it on sm_90 wherever it applies (plan._fwd_ws_blocker says where
not); ``run`` below launches it directly (dense batches), for tests.

The host side builds the three tensor maps (CUtensorMap, 128 opaque bytes each) with the CUDA
driver's ``cuTensorMapEncodeTiled`` through ctypes, and passes them by value inside the kernel's
one ``const __grid_constant__`` parameter struct.
"""
from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass
from typing import ClassVar

from . import DTYPES, KernelVariant
from .fwd import FLASHMASK_FIELDS, FLASHMASK_NS, SINK_FIELDS
from .params import TENSOR_MAP_BYTES, ParamTable, strides

HEAD_DIMS = (64, 128, 256)
BLOCK_M, BLOCK_N, STAGES = 128, 128, 2  # two consumer warpgroups of 64 rows; two K/V stages
PRODUCER_REGS = 24    # setmaxnreg of the producer warpgroup
GATHER_PRODUCER_REGS = 40  # of one whose 128 threads gather paged K/V rows (cp.async addresses), or
                           # that walks FlashMask blocks over persistent tiles
# Pages of fewer rows are gathered: at d=128 (H100) the gather runs at 436 TF/s whatever the page
# size, TMA boxes per page at 267 / 404 / 538 with pages of 16 / 32 / 64 rows.
GATHER_BELOW_ROWS = 64
MAX_CONSUMER_REGS = 240  # of a consumer's, with two (128 * 24 + 256 * 240 = 64512 <= 65536)
BOX_COLS = 64                           # one TMA box is 64 columns (128 bytes: the swizzle's width)
BARRIER_BYTES = 160                     # 2 + 4 * stages mbarriers of 8 bytes, two 16-byte tile slots (persistent), a
                                        # walk slot per stage (persistent FlashMask), two mbarriers of a second Q
                                        # tile (double_q), rounded up
MAX_SMEM = 232448                       # dynamic shared memory a block may have on sm_90 (227 KiB)
# An mbarrier wait longer than this many clock cycles traps (the launch fails instead of hanging
# on a phase that never completes): a debugging aid while changing the pipeline, e.g. 1 << 32
# (about 2 s). 0: waits never trap (a slow but legitimate wait, under a profiler's replay, must
# not fail).
HANG_TRAP_CYCLES = 0

PARAMS = ParamTable("FwdWsParams", (
    ("tma_q", "CUtensorMap"), ("tma_k", "CUtensorMap"), ("tma_v", "CUtensorMap"),
    ("o", "void*"), ("lse", "float*"),
    *strides("o", "sb", "ss", "sh"), *strides("lse", "sb", "sh", "sr"),
    ("seqlen_q", "int"), ("seqlen_k", "int"), ("ngroups", "int"),
    ("scale_log2", "float"),
    ("nheads", "int"), ("batch", "int"),  # the tile count of a persistent grid
))
# Persistent blocks: a zeroed int32 that hands out tiles (each launch leaves it zeroed), or null;
# the last field (launch.fire puts the stream's counter there).
PERSISTENT_FIELDS = (("tile_counter", "int*"),)
# A sliding window: its left and right sizes as the plan launches them (plan.window_eff); chunk
# variants (chunked attention on the band) take the chunk's length too (block_info.cuh's Chunk).
LOCAL_FIELDS = (("window_left", "int"), ("window_right", "int"))
CHUNK_FIELDS = (("attention_chunk", "int"),)
# Softcap: the scores become tanh(s * softcap_scale) (softcap_scale = scale / softcap; scale_log2
# is then softcap * log2 e). ALiBi: slope alibi_slopes[b * alibi_sb + h] * alibi_scale (in the
# raw scores' units). Varlen: sequence b owns rows cu_seqlens_q[b] .. of q and o and rows
# cu_seqlens_k[b] .. of k and v.
SOFTCAP_FIELDS = (("softcap_scale", "float"),)
ALIBI_FIELDS = (("alibi_slopes", "const float*"), ("alibi_sb", "long long"), ("alibi_scale", "float"))
VARLEN_FIELDS = (("cu_seqlens_q", "const int*"), ("cu_seqlens_k", "const int*"))
# A contiguous KV cache: batch b attends to seqlens_k[b] + seqlen_k keys (seqlens_k null: seqlen_k)
# in the cache's batch row kv_batch_idx[b] (null: b), from row kv_leftpad[b] with a leftpad.
CACHE_FIELDS = (("seqlens_k", "const int*"), ("kv_batch_idx", "const int*"))
LEFTPAD_FIELDS = (("kv_leftpad", "const int*"),)
# A paged KV cache: key row j of batch b is row j % page_size of page block_table[b *
# block_table_stride + j / page_size] (at most pages_per_seq pages); seqlens_k as for a cache.
PAGED_FIELDS = (("seqlens_k", "const int*"), ("block_table", "const int*"), ("block_table_stride", "int"),
                ("page_size", "int"), ("pages_per_seq", "int"))
# Gathered pages: the page pools' element strides (page, row, head) and, last (launch.fire sets
# them per call, as it encodes the other variants' K/V maps), their addresses.
GATHER_FIELDS = (*strides("k", "sp", "ss", "sh"), *strides("v", "sp", "ss", "sh"),
                 ("k_pages", "const void*"), ("v_pages", "const void*"))


@dataclass(frozen=True, kw_only=True)
class FwdWsVariant(KernelVariant):
    """One warp-specialised forward kernel (``kind="fwd_ws"``)."""

    family = "fwd_ws"
    kind: ClassVar[str] = "fwd_ws"

    head_dim: int             # 64, 128 or 256: the real head dim (no column predicates)
    dtype: str                # "fp16" or "bf16"
    causal: bool = False
    # A sliding window (bottom-right aligned, as the other forward kernels): the walk covers the
    # K/V blocks inside the band, masking those on its edges.
    local: bool = False
    # Chunked attention on the band (attention_chunk; local only): each row sees only its chunk.
    chunk: bool = False
    block_m: int = BLOCK_M
    block_n: int = BLOCK_N
    stages: int = STAGES
    # FlashAttention-3's schedules (BENCHMARKS.md, steps 2 and 3): ``overlap`` issues each tile's
    # S = QK^T with the previous tile's P V and runs the softmax while P V is in flight;
    # ``pingpong`` makes the two consumer warpgroups take turns issuing their products (named
    # barriers), so one's softmax runs while the other's products use the tensor cores.
    overlap: bool = False
    pingpong: bool = False
    # With ``pingpong``: the turns are taken around each softmax's exponentials rather than
    # around the products' issue (cuDNN's order at d = 64, where the exponentials keep the MUFU
    # unit busy as long as the products keep the tensor cores).
    turn_softmax: bool = False
    # FlashAttention-3's persistent blocks: at most one block per SM, each taking query tiles
    # from an atomic counter (``tile_counter``; null: a fixed order) in the one-tile launch order
    # (query block fastest, then head, then batch; causal: longest tiles first within sections of
    # heads, LPT_BYTES), so that the producer loads the next tile's Q
    # and first K/V while the consumers finish the last, and no block pays a cold start per tile.
    # FlashMask: at d = 64 and 128 on 128-row tiles, in FlashMask's launch order (planned at d = 128).
    persistent: bool = False
    # Persistent: two Q tiles, tile j's in tile j & 1, so that the producer loads the next tile's
    # Q while the consumers work on this one (with one, only after this tile's last S = Q K^T or
    # its epilogue); O is then staged in the tile's own Q tile (not own_o).
    double_q: bool = False
    # FlashMask bound columns per key (cuflash.masks; 1 or 2 with causal, 2 or 4 without), 0 =
    # none: the walk leaves out fully masked K/V blocks and masks the partly masked ones.
    flashmask: int = 0
    # Score modifiers, applied in registers before the mask: softcap (softcap * tanh(s / softcap))
    # and ALiBi (-slope * |i + seqlen_k - seqlen_q - j|), as the other forward kernels do.
    softcap: bool = False
    alibi: bool = False
    # Packed variable-length sequences (cu_seqlens_q, cu_seqlens_k): the tensor maps span all the
    # tokens, a block reads its sequence's bounds and starts its TMA boxes at the sequence's first
    # row; rows past the sequence's end are loaded (another sequence's, or zeros) but masked (keys)
    # or never stored (queries). One block per query tile of the longest sequence.
    varlen: bool = False
    # A contiguous KV cache (flash_attn_with_kvcache's): the K/V maps are the cache's; a block
    # reads its key count (seqlens_k), cache row (kv_batch_idx) and, with ``leftpad``, its first
    # key row (cache_leftpad). One block per query tile.
    cache: bool = False
    leftpad: bool = False
    # A paged KV cache whose pages hold whole K/V tiles or whose tiles hold whole pages (pages_fit):
    # the K/V maps are the page pool's, and the producer looks each tile's pages up in the block table.
    paged: bool = False
    # Paged: the producer warpgroup's 128 threads gather each K/V tile's rows with cp.async instead
    # of TMA boxes per page (FlashAttention-3's path for pages the TMA cannot read whole tiles of):
    # any page size and cache_leftpad (``leftpad``), one copy instruction per 16 bytes rather than
    # per page and 64 columns.
    gather: bool = False
    # Attention sinks (fwd.py's SINK_FIELDS): each row's softmax starts from its head's sink logit.
    sinks: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.arch != 90:
            raise ValueError(f"fwd_ws is a Hopper kernel (sm_90a): arch must be 90, got {self.arch!r}")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {self.head_dim!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for f in ("causal", "local", "chunk", "overlap", "pingpong", "turn_softmax", "persistent", "double_q", "softcap",
                  "alibi", "varlen", "cache", "leftpad", "paged", "gather", "sinks"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"{f} must be a bool, got {getattr(self, f)!r}")
        if self.turn_softmax and (not self.pingpong or self.flashmask or self.gather):
            raise ValueError(f"turn_softmax is a ping-pong schedule without FlashMask or gathered pages: it needs "
                             f"pingpong=True, flashmask=0 and gather=False, got pingpong={self.pingpong}, "
                             f"flashmask={self.flashmask!r}, gather={self.gather}")
        if self.pingpong and self.block_m != 128:
            raise ValueError(f"pingpong takes turns between two consumer warpgroups: block_m must be 128, "
                             f"got {self.block_m}")
        for f in ("block_m", "block_n", "stages"):
            if not isinstance(getattr(self, f), int) or isinstance(getattr(self, f), bool):
                raise ValueError(f"{f} must be an int, got {getattr(self, f)!r}")
        if self.block_m % 64 or not 64 <= self.block_m <= 256 or self.block_n % 16 or not 16 <= self.block_n <= 256:
            raise ValueError(f"block_m must be 64, 128, 192 or 256 (64 rows per consumer warpgroup) and block_n "
                             f"a multiple of 16 up to 256 (a TMA box's rows), got {self.block_m}x{self.block_n}")
        if self.stages < 2:
            raise ValueError(f"stages must be at least 2, got {self.stages!r}")
        if self.double_q and not (self.persistent and self.smem_bytes <= MAX_SMEM
                                  and self._barrier_area <= BARRIER_BYTES):
            raise ValueError(f"double_q (two Q tiles) needs persistent blocks and room in shared memory (at most "
                             f"{MAX_SMEM} B, and {BARRIER_BYTES} B for the mbarriers and slots), got "
                             f"persistent={self.persistent}, {self.smem_bytes} B, {self._barrier_area} B")
        if self.flashmask and not (self.flashmask in FLASHMASK_NS[:2] if self.causal else
                                   self.flashmask in FLASHMASK_NS[1:]) or self.flashmask and self.persistent and not (
                                   self.head_dim <= 128 and self.block_m == 128 and self.overlap and self.stages == 2):
            raise ValueError(f"flashmask must be 0, or 1 or 2 with causal, 2 or 4 without, and persistent only at head "
                             f"dims up to 128 on 128-row tiles with the overlap and two stages (beyond, the walk's "
                             f"state spills; the others are untested); got {self.flashmask!r} (causal={self.causal}, "
                             f"persistent={self.persistent}, head_dim={self.head_dim}, block_m={self.block_m}, "
                             f"overlap={self.overlap}, stages={self.stages})")
        if self.local and (self.causal or self.flashmask or self.persistent):
            raise ValueError(f"local (a sliding window) excludes causal, flashmask and persistent, got causal="
                             f"{self.causal}, flashmask={self.flashmask!r}, persistent={self.persistent}")
        if (self.varlen + self.cache + self.paged > 1 or (self.varlen or self.cache or self.paged)
                and (self.flashmask or self.persistent)):
            raise ValueError(f"varlen, cache and paged exclude each other, flashmask and persistent, got varlen="
                             f"{self.varlen}, cache={self.cache}, paged={self.paged}, flashmask={self.flashmask!r}, "
                             f"persistent={self.persistent}")
        if self.gather and not (self.paged and self.block_n <= 128):
            raise ValueError(f"gather needs paged (a paged KV cache) and block_n <= 128 (a row per producer "
                             f"thread), got paged={self.paged}, block_n={self.block_n}")
        if self.leftpad and not (self.cache or self.gather):
            raise ValueError(f"leftpad needs cache (a contiguous KV cache) or gather (a paged one's rows looked up "
                             f"one by one), got cache={self.cache}, gather={self.gather}")
        if self.chunk and not self.local:
            raise ValueError("chunk needs local (chunked attention runs on the band's masks)")
        if self.sinks and self.flashmask:
            raise ValueError(f"sinks exclude flashmask, got flashmask={self.flashmask!r}")

    @functools.cached_property
    def params(self) -> ParamTable:
        """The common fields, then each feature's own (the tile counter last: launch.fire sets it)."""
        return ParamTable("FwdWsParams", PARAMS.fields + LOCAL_FIELDS * self.local + CHUNK_FIELDS * self.chunk
                          + FLASHMASK_FIELDS * bool(self.flashmask) + SOFTCAP_FIELDS * self.softcap
                          + ALIBI_FIELDS * self.alibi + VARLEN_FIELDS * self.varlen + CACHE_FIELDS * self.cache
                          + LEFTPAD_FIELDS * self.leftpad + PAGED_FIELDS * self.paged + SINK_FIELDS * self.sinks
                          + PERSISTENT_FIELDS * self.persistent + GATHER_FIELDS * self.gather)

    @functools.cached_property
    def name(self) -> str:
        mask = ("chunk" if self.chunk else "local") if self.local else "causal" if self.causal else "full"
        sched = ("_overlap" if self.overlap else "") + ("_pingpong" if self.pingpong else "") + (
            "_smturn" if self.turn_softmax else "") + ("_persistent" if self.persistent else "") + (
            "_2q" if self.double_q else "") + (f"_fm{self.flashmask}" if self.flashmask else "")
        mods = ("_softcap" if self.softcap else "") + ("_alibi" if self.alibi else "") + (
            "_varlen" if self.varlen else "") + ("_cache" if self.cache else "") + ("_leftpad" if self.leftpad else "") + (
            "_paged" if self.paged else "") + ("_gather" if self.gather else "") + ("_sinks" if self.sinks else "")
        return (f"fwd_ws_d{self.head_dim}_{self.dtype}_{mask}{mods}"
                f"_m{self.block_m}n{self.block_n}s{self.stages}{sched}_sm{self.arch}")

    @property
    def template(self) -> str:
        return "fwd_ws/fwd_ws.cu.j2"

    @property
    def target(self) -> str:
        return "90a"  # wgmma and setmaxnreg

    @property
    def consumers(self) -> int:
        return self.block_m // 64

    @property
    def threads(self) -> int:
        return 128 * (1 + self.consumers)  # the producer warpgroup, then the consumers

    @property
    def producer_regs(self) -> int:
        """setmaxnreg of the producer warpgroup (persistent FlashMask: its warp keeps the walk's and the
        tile order's state across tiles, which spills in 24)."""
        return GATHER_PRODUCER_REGS if self.gather or self.persistent and self.flashmask else PRODUCER_REGS

    @property
    def consumer_regs(self) -> int:
        """setmaxnreg of each consumer warpgroup: what the register file leaves them after the
        producer's, a multiple of 8, at most MAX_CONSUMER_REGS (240 for two, 160 for three; a
        gathering producer leaves two 232). The block launches with the registers __launch_bounds__ gives each
        thread (65536 / threads, a multiple of 8: 168 at 384 threads); setmaxnreg moves them between
        warpgroups, and an increase that the released ones do not cover waits forever."""
        pool = 65536 // self.threads // 8 * 8 * self.threads
        return min(MAX_CONSUMER_REGS, (pool - 128 * self.producer_regs) // (128 * self.consumers) // 8 * 8)

    @property
    def zero_tail(self) -> bool:
        """Packed sequences and KV caches: a tail K/V tile's rows past the keys are other tokens
        (NaN in an unwritten cache row, say), whose V rows the kernel zeroes before P V (0 * NaN is
        NaN); dense batches read zeros there (the tensor map's bounds)."""
        return self.varlen or self.cache or self.paged and not self.gather  # (gather zero-fills them)

    @property
    def own_o(self) -> bool:
        """Persistent blocks stage O in a buffer of their own where shared memory has room for one
        (so Q's tile is released before the epilogue), else in Q's tile; with two Q tiles
        (double_q) always in the tile's own Q tile."""
        return self.persistent and not self.double_q and (
            self._tiles_bytes + self._o_bytes + BARRIER_BYTES + self._turn_bytes + self._fm_bytes <= MAX_SMEM)

    @property
    def _barrier_area(self) -> int:
        """Bytes of the mbarrier area the template uses (at most BARRIER_BYTES): Q, K/V full and
        empty and Q empty (or the tail's) barriers, the tile slots (persistent), the walk slots
        (FlashMask), the second Q tile's two barriers (double_q), the turns' scale (turn_softmax):
        the template's kTurnOffset - kBarOffset plus the scale's word, which it static_asserts."""
        return ((2 + 4 * self.stages) * 8 + (32 if self.persistent else 8 if self.zero_tail else 0)
                + 4 * self.stages * bool(self.flashmask) + 16 * self.double_q + 4 * self.turn_softmax)

    @property
    def _tiles_bytes(self) -> int:  # Q (two with double_q) and the K and V stages
        return ((1 + self.double_q) * self.block_m + 2 * self.stages * self.block_n) * self.head_dim * 2

    @property
    def _o_bytes(self) -> int:  # O's staging, a Q-shaped tile
        return self.block_m * self.head_dim * 2

    @property
    def _turn_bytes(self) -> int:  # turn_softmax: a word per consumer thread
        return 4 * 128 * self.consumers * self.turn_softmax

    @property
    def _fm_bytes(self) -> int:  # FlashMask: a partly masked K/V block's bounds per stage (int32)
        return self.stages * self.block_n * self.flashmask * 4

    @property
    def smem_bytes(self) -> int:
        """Q, kStages K and V tiles (2-byte elements), O's staging (own_o), the mbarriers, then
        (FlashMask) a partly masked K/V block's bounds per stage (int32), or (gather) the (page, row)
        of each row of a K/V tile (int32 pairs), or (turn_softmax) a word per consumer thread."""
        return (self._tiles_bytes + (self._o_bytes if self.own_o else 0) + BARRIER_BYTES
                + self._fm_bytes + self.block_n * 8 * self.gather + self._turn_bytes)

    def grid(self, batch: int, seqlen_q: int, nheads: int, num_sms: int = 0) -> tuple[int, int, int]:
        """One block per query tile; persistent: one per SM (``num_sms``), or per tile if fewer."""
        tiles = (math.ceil(seqlen_q / self.block_m), nheads, batch)
        if not self.persistent:
            return tiles
        if num_sms < 1:
            raise ValueError(f"a persistent grid needs the SM count, got num_sms={num_sms!r}")
        return (max(1, min(math.prod(tiles), num_sms)), 1, 1)

    def constants(self) -> dict:
        return dict(head_dim=self.head_dim, block_m=self.block_m, block_n=self.block_n, stages=self.stages,
                    causal=self.causal, local=self.local, chunk=self.chunk, bf16=self.dtype == "bf16",
                    overlap=self.overlap,
                    pingpong=self.pingpong, turn_softmax=self.turn_softmax,
                    persistent=self.persistent, own_o=self.own_o, double_q=self.double_q, flashmask=self.flashmask,
                    softcap=self.softcap, alibi=self.alibi, varlen=self.varlen, cache=self.cache,
                    leftpad=self.leftpad, paged=self.paged, gather=self.gather, sinks=self.sinks, zero_tail=self.zero_tail,
                    barrier_bytes=BARRIER_BYTES, lpt_bytes=LPT_BYTES,
                    producer_regs=self.producer_regs,
                    consumer_regs=self.consumer_regs, hang_trap_cycles=HANG_TRAP_CYCLES)


# The planned tiles, after a sweep on an H200 (BENCHMARKS.md): d 128 and 256 take 128 query
# rows in two consumer warpgroups with both FlashAttention-3 schedules, and K/V tiles of 128 and
# 80 keys (256: two stages of 80-key K and V tiles fill shared memory); d 64 takes 192 rows in three
# warpgroups with the intra-warpgroup overlap (ping-pong needs two), except causal attention
# over at most 2048 queries, where the larger diagonal share of 192-row tiles costs more than
# it saves and 128-row tiles run faster; and dense d 64 over at most 4096 keys (SHORT_D64).
TILES = {64: dict(block_m=192, block_n=128, overlap=True), 128: dict(block_n=128, overlap=True, pingpong=True),
         256: dict(block_n=80, overlap=True, pingpong=True)}
SHORT_CAUSAL_D64 = dict(block_m=128, block_n=128, overlap=True, pingpong=True)
# Dense d=64 over at most SHORT_D64_MAX_KEYS keys, causal or not, without score modifiers, packed
# sequences or caches: 128-row persistent tiles whose ping-pong turns are the softmax's
# exponentials (turn_softmax; +4 to +5% over the tiles above up to 4k keys, slower from 8k:
# BENCHMARKS.md).
SHORT_D64 = dict(block_m=128, block_n=128, pingpong=True, turn_softmax=True)
SHORT_D64_MAX_KEYS = 4096
# Persistent blocks where each query tile walks few K/V blocks (at most this many keys), so that
# a one-tile block's start (its Q and first K/V loads) and end are a large share of its time:
# d 64 (BENCHMARKS.md: +7 to +12% at 1k keys, within +-3% at 2k, slower beyond); d=128 up to 2k
# keys (+11% at 2k in an H200 A/B of 2026-11-28, +3% at 4k, even at 8k; 4k not planned yet);
# d=64 causal up to 2k keys, where its 128-row tiles gain 8% at 2k; d=256 causal only (+2% at 1k
# keys in the LPT order, slower from 2k; without a mask slower everywhere).
PERSISTENT_MAX_KEYS = 1024
PERSISTENT_MAX_KEYS_D128 = 2048
PERSISTENT_MAX_KEYS_D64_CAUSAL = 2048
# Causal tiles (persistent blocks' and the grid of one-tile blocks alike, FlashMask and KV caches
# aside) run in sections of (head, batch) pairs whose K/V fit in this many bytes of L2, longest
# tiles first within a section (FlashAttention-3's LPT order; BENCHMARKS.md: +1 to +13% from 2k
# keys).
LPT_BYTES = 16 << 20


def pages_fit(page_size: int, block_n: int) -> bool:
    """Whether a paged cache's pages suit a K/V tile of block_n keys: whole tiles per page (one TMA
    box each), or whole pages per tile (a box per page, each a multiple of the 128-byte swizzle's
    8 rows)."""
    return page_size > 0 and (page_size % block_n == 0 or block_n % page_size == 0 and page_size % 8 == 0)


def gathers(page_size: int, head_dim: int) -> bool:
    """Whether the plan gathers a paged cache's K/V tiles with cp.async (FwdWsVariant.gather) rather
    than loading them as TMA boxes: pages of fewer than 64 rows (one 2-KB box per page and 64
    columns costs more than the gather: BENCHMARKS.md), or pages that neither hold nor divide tiles."""
    return page_size > 0 and (page_size < GATHER_BELOW_ROWS or not pages_fit(page_size, TILES[head_dim]["block_n"]))


def persistent_max_keys(head_dim: int, causal: bool, turn_softmax: bool = False) -> int:
    """The most keys for which the plan takes persistent blocks at this head dim and mask, on
    SHORT_D64's softmax-turn tile (``turn_softmax``) or the others."""
    if turn_softmax:
        return SHORT_D64_MAX_KEYS
    if head_dim == 256:
        return PERSISTENT_MAX_KEYS if causal else 0
    if head_dim == 128:
        return PERSISTENT_MAX_KEYS_D128
    return PERSISTENT_MAX_KEYS_D64_CAUSAL if head_dim == 64 and causal else PERSISTENT_MAX_KEYS


def planned(head_dim: int, dtype: str, causal: bool, seqlen_q: int, arch: int = 90,
            flashmask: int = 0, seqlen_k: int | None = None, local: bool = False, softcap: bool = False,
            alibi: bool = False, varlen: bool = False, cache: bool = False, leftpad: bool = False,
            paged: bool = False, sinks: bool = False, page_size: int = 0, chunk: bool = False) -> FwdWsVariant:
    """The variant the planner runs for a problem with these head dim, dtype, mask, queries and
    keys (default: as many as queries; ``flashmask``: FlashMask's bound columns per key, 0 = none;
    ``local``: a sliding window, on the causal tiles, one block per query tile; ``softcap``,
    ``alibi``: score modifiers; ``varlen``: packed sequences, seqlen_q and seqlen_k their maxima;
    ``cache``, ``leftpad``: a contiguous KV cache, seqlen_k its capacity; ``paged``: a paged one;
    varlen and caches take one block per query tile; ``sinks``: attention sinks; ``chunk``:
    chunked attention on the local band)."""
    # d=64 causal with FlashMask, or with softcap or ALiBi: 128-row tiles at any length (in the
    # 192-row tile's 160 registers per consumer thread, NVRTC 13.0 spills the causal FlashMask walk
    # and some softcap/ALiBi variants).
    gather = paged and (leftpad or gathers(page_size, head_dim))  # (a leftpad shifts rows off the pages' boxes)
    # (Gathered pages: the producer's 40 registers leave three consumer warpgroups too few.)
    keys = seqlen_q if seqlen_k is None else seqlen_k
    plain = not (flashmask or local or softcap or alibi or varlen or cache or paged or sinks)
    short = head_dim == 64 and ((causal or local) and (flashmask or seqlen_q <= 2048) or softcap or alibi or gather)
    tile = (SHORT_D64 if head_dim == 64 and plain and keys <= SHORT_D64_MAX_KEYS
            else SHORT_CAUSAL_D64 if short else TILES[head_dim])
    # FlashMask at d=128: persistent blocks at any length (a median +1.9% forward over bench
    # mask's families at 8k and 32k keys, within about +-3% of noise per family: BENCHMARKS.md);
    # d=64: +0.7% median on its causal tiles, not planned.
    persistent = (flashmask and head_dim == 128 or not (flashmask or local or varlen or cache or paged)
                  and keys <= persistent_max_keys(head_dim, causal, tile is SHORT_D64))
    # Two Q tiles on the d=64 softmax-turn tile (persistent up to SHORT_D64_MAX_KEYS): causal +10%
    # at 1k keys, +4% at 2k, +1% at 4k; without a mask +3%, +1%, -1% (H200, BENCHMARKS.md); at
    # d=128 within +-1%, and for FlashMask +1% median (-4 to +3% by family), not planned.
    double_q = persistent and tile is SHORT_D64
    if tile.get("block_m") == 192 and not (causal or local or persistent or flashmask):
        # Without a mask the 192-row d=64 tile leaves room for a third K/V stage (123 KB of shared
        # memory): +1.4 to +2.9% from 2k keys up (BENCHMARKS.md; dense, and so packed sequences,
        # caches and sinks); causal and persistent, no gain; FlashMask not measured.
        tile = dict(tile, stages=3)
    return FwdWsVariant(head_dim=head_dim, dtype=dtype, causal=causal, local=local, chunk=chunk, arch=arch,
                        flashmask=flashmask,
                        persistent=persistent, double_q=double_q, softcap=softcap, alibi=alibi, varlen=varlen,
                        cache=cache, leftpad=leftpad, paged=paged, gather=gather, sinks=sinks, **tile)


def variants(arch: int, mods: bool = True) -> list[FwdWsVariant]:
    """The fwd_ws variants the planner can pick on ``arch``: sm_90 only; ``mods=False`` leaves out
    the sliding-window, softcap, ALiBi, varlen, KV-cache, sink and FlashMask ones."""
    if arch != 90:
        return []
    shapes = [(sq, sk) for sq in (1, 4096) for sk in (1024, 2048, 4096, 8192)]
    # dense and FlashMask (which composes with softcap)
    dense = [planned(d, dt, c, sq, arch, n, sk, softcap=cap) for d in HEAD_DIMS for dt in DTYPES
             for c in (False, True) for sq, sk in shapes
             for n in (0, *(FLASHMASK_NS[:2] if c else FLASHMASK_NS[1:]) * mods) for cap in (False, True)[:1 + bool(n)]]
    if not mods:
        return list(dict.fromkeys(dense))
    # Every mask (full, causal, local) with every combination of softcap, ALiBi and sinks, on dense
    # batches, packed sequences, contiguous KV caches (with or without a leftpad) and paged ones
    # (with or without a leftpad).
    sources = (dict(), dict(varlen=True), dict(cache=True), dict(cache=True, leftpad=True), dict(paged=True),
               dict(paged=True, page_size=16), dict(paged=True, leftpad=True))  # (pages of 16, a leftpad: gathered)
    modded = [planned(d, dt, c, sq, arch, seqlen_k=sk, local=loc, softcap=cap, alibi=ali, sinks=snk, **src)
              for d in HEAD_DIMS for dt in DTYPES for c, loc in ((False, False), (True, False), (False, True))
              for sq, sk in shapes for cap in (False, True) for ali in (False, True) for snk in (False, True)
              for src in sources]
    return list(dict.fromkeys(dense + modded))


# ---------------------------------------------------------------------------------------------
# Tensor maps (host, CUDA driver)

# cuda.h enum values (CUDA 12/13 driver API, unchanged since 12.0).
CU_TENSOR_MAP_DATA_TYPE = {"fp16": 6, "bf16": 9, "e4m3": 0}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _BFLOAT16 / _UINT8
ELEMENT_BYTES = {"fp16": 2, "bf16": 2, "e4m3": 1}
CU_TENSOR_MAP_INTERLEAVE_NONE = 0
CU_TENSOR_MAP_SWIZZLE = {64: 2, 128: 3}  # CU_TENSOR_MAP_SWIZZLE_64B / _128B, by the box's row bytes
CU_TENSOR_MAP_L2_PROMOTION = {0: 0, 64: 1, 128: 2, 256: 3}  # NONE, L2_64B, L2_128B, L2_256B
CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0  # out-of-bounds elements read as zeros
RANK = 4  # (d, seqlen, heads, batch), innermost first


# cuTensorMapEncodeTiled's C signature: CUresult (CUtensorMap* tensorMap, CUtensorMapDataType,
# cuuint32_t tensorRank, void* globalAddress, const cuuint64_t* globalDim,
# const cuuint64_t* globalStrides, const cuuint32_t* boxDim, const cuuint32_t* elementStrides,
# CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
# the enums are C ints, CUresult too.
ENCODE_RESTYPE = ctypes.c_int
ENCODE_ARGTYPES = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                   ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                   ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int)


@functools.lru_cache(maxsize=1)
def _driver_encode():
    """cuTensorMapEncodeTiled from the CUDA driver (libcuda.so.1), typed as above."""
    fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    fn.argtypes, fn.restype = list(ENCODE_ARGTYPES), ENCODE_RESTYPE
    return fn


def encode_tensor_map(ptr: int, shape: tuple, strides: tuple, dtype: str, box_rows: int, *,
                      l2_promotion: int = 256, encode=None, box_bytes: int = 128) -> bytes:
    """The 128-byte CUtensorMap of a (batch, seqlen, heads, d) tensor of 2-byte elements (1-byte
    for "e4m3") at device address ``ptr`` with element strides ``strides`` (the last one 1): a
    4-D map with dims (d, seqlen, heads, batch), byte strides (seqlen, heads, batch), boxes of
    ``box_bytes`` (128, or 64 with the 64-byte swizzle) of columns (64 elements, or 128 e4m3) x
    ``box_rows`` rows x 1 head x 1 batch, the 128-byte swizzle, no interleave, L2 promotion
    ``l2_promotion`` bytes and zero fill out of bounds (so a tile past the sequence's end reads
    zeros). ``encode`` replaces the driver's cuTensorMapEncodeTiled (tests)."""
    if ptr % 16:
        raise ValueError(f"the base address must be 16-byte aligned, got {ptr:#x}")
    code, global_dim, global_strides, box_dim, element_strides, l2 = _encode_args(
        tuple(int(x) for x in shape), tuple(int(x) for x in strides), dtype, box_rows, l2_promotion, box_bytes)
    # The driver writes the map to an address aligned to 64 bytes at least (cuda.h aligns the
    # type to 128): over-allocate and align.
    buf = ctypes.create_string_buffer(TENSOR_MAP_BYTES + 128)
    addr = ctypes.addressof(buf) + (-ctypes.addressof(buf) % 128)
    fn = encode or _driver_encode()
    rc = fn(addr, code, RANK, ptr, global_dim, global_strides, box_dim, element_strides,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE[box_bytes], l2, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if rc:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {rc} (shape {shape}, strides {strides}, "
                           f"{dtype}, box {box_bytes // ELEMENT_BYTES[dtype]} x {box_rows})")
    return ctypes.string_at(addr, TENSOR_MAP_BYTES)


@functools.lru_cache(maxsize=256)
def _encode_args(shape: tuple, strides: tuple, dtype: str, box_rows: int, l2_promotion: int,
                 box_bytes: int = 128) -> tuple:
    """encode_tensor_map's checked arguments apart from the address, as the driver takes them:
    (data type, dims, byte strides, box, element strides, L2 promotion). Remembered per shape, so
    a call on new buffers of a known shape (a training step's fresh activations) builds and
    checks nothing again; the arrays are only read by the driver."""
    b, s, h, d = shape
    sb, ss, sh, sd = strides
    if dtype not in CU_TENSOR_MAP_DATA_TYPE:
        raise ValueError(f"dtype must be one of {tuple(CU_TENSOR_MAP_DATA_TYPE)}, got {dtype!r}")
    if sd != 1:
        raise ValueError(f"the head dim must be contiguous (stride 1), got stride {sd}")
    if min(b, s, h, d) < 1 or max(b, s, h, d) > 1 << 31:
        raise ValueError(f"every dim must be in 1 .. 2^31, got {shape}")
    if box_bytes not in CU_TENSOR_MAP_SWIZZLE:
        raise ValueError(f"box_bytes must be one of {tuple(CU_TENSOR_MAP_SWIZZLE)}, got {box_bytes}")
    elem = ELEMENT_BYTES[dtype]
    box_cols = box_bytes // elem
    if d % box_cols:
        raise ValueError(f"the head dim must be a multiple of {box_cols}, got {d}")
    byte_strides = (ss * elem, sh * elem, sb * elem)  # dims 1, 2, 3 (dim 0's stride is the element size)
    for st in byte_strides:
        if st <= 0 or st % 16 or st >= 1 << 40:
            raise ValueError(f"byte strides must be positive multiples of 16 below 2^40, got {byte_strides}")
    if not 1 <= box_rows <= 256:
        raise ValueError(f"box_rows must be in 1 .. 256, got {box_rows}")
    if l2_promotion not in CU_TENSOR_MAP_L2_PROMOTION:
        raise ValueError(f"l2_promotion must be one of {tuple(CU_TENSOR_MAP_L2_PROMOTION)}, got {l2_promotion}")
    return (CU_TENSOR_MAP_DATA_TYPE[dtype], (ctypes.c_uint64 * RANK)(d, s, h, b),
            (ctypes.c_uint64 * (RANK - 1))(*byte_strides), (ctypes.c_uint32 * RANK)(box_cols, box_rows, 1, 1),
            (ctypes.c_uint32 * RANK)(1, 1, 1, 1), CU_TENSOR_MAP_L2_PROMOTION[l2_promotion])


def tma_readable(view) -> bool:
    """Whether the TMA can read a (batch, seqlen, heads, d) view in place: what encode_tensor_map
    asks beyond the 16-byte alignment every in-place operand already has (positive strides
    below 2^40 bytes)."""
    return view.strides[3] == 1 and all(0 < s * 2 < 1 << 40 for s in view.strides[:3])


@functools.lru_cache(maxsize=256)
def tensor_map(ptr: int, shape: tuple, strides: tuple, box_rows: int, dtype: str, box_bytes: int = 128) -> bytes:
    """encode_tensor_map, remembered: a repeated call on the same buffers (a training loop's
    preallocated activations, a benchmark) skips the driver call. The map holds only the address,
    shape and strides, so a reused address with the same shape is the same map."""
    return encode_tensor_map(ptr, shape, strides, dtype, box_rows, box_bytes=box_bytes)


# ---------------------------------------------------------------------------------------------
# A direct launch (GPU), for the tests: the kernel alone, without the planner.

_LOG2E = 1.4426950408889634


def run(q, k, v, *, causal: bool = False, softmax_scale: float | None = None, out=None, return_lse: bool = False,
        dynamic: bool = True, window_size: tuple[int, int] | None = None, **variant):
    """Attention with the fwd_ws kernel on (batch, seqlen, heads, d) CUDA arrays (PyTorch or
    CuPy) of fp16/bf16, d 64, 128 or 256, nheads a multiple of k's heads. Returns out, or (out, lse)
    with lse (batch, nheads, seqlen_q) fp32. ``variant``: FwdWsVariant fields (block_n, overlap,
    pingpong, ...); ``dynamic=False`` makes persistent blocks take tiles in a fixed order;
    ``window_size`` (left, right): a sliding window as the kernel takes it (-1: unbounded on that
    side; not causal). Minimal checks: this is a test entry point, not the public API."""
    from .. import arrays, compiler, launch
    qv, kv, vv = arrays.view(q, "q"), arrays.view(k, "k"), arrays.view(v, "v")
    dtype = arrays.DTYPE_NAMES.get(qv.dtype)
    b, sq, h, d = qv.shape
    sk, hk = kv.shape[1], kv.shape[2]
    if dtype is None or kv.dtype != qv.dtype or vv.dtype != qv.dtype:
        raise ValueError("q, k, v must be float16 or bfloat16, all the same")
    if d not in HEAD_DIMS or kv.shape != (b, sk, hk, d) or vv.shape != kv.shape or h % hk:
        raise ValueError(f"shapes q {qv.shape}, k {kv.shape}, v {vv.shape}: d must be 64, 128 or 256, k and v alike, "
                         "nheads a multiple of k's heads")
    if out is None:
        out = arrays.empty_like_framework(qv, qv.shape, qv.dtype)
    ov = arrays.view(out, "out")
    if ov.shape != qv.shape or ov.dtype != qv.dtype or ov.strides[3] != 1 or ov.ptr % 16 or any(
            s % 8 for s in ov.strides[:3]):
        raise ValueError("out must be like q, 16-byte aligned rows")
    lse = arrays.empty_like_framework(qv, (b, h, sq), "float32") if return_lse else None
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    variant = FwdWsVariant(head_dim=d, dtype=dtype, causal=bool(causal), arch=90, local=window_size is not None,
                           **variant)
    with arrays.on_device(qv.device):
        kernel = compiler.get_kernel(variant, qv.device)
        from ..api import device_facts
        grid = variant.grid(b, sq, h, device_facts(qv.device).num_sms)
        kernel(grid, (variant.threads,), arrays.stream_for(qv), shared_mem=variant.smem_bytes,
               tma_q=encode_tensor_map(qv.ptr, qv.shape, qv.strides, dtype, variant.block_m),
               tma_k=encode_tensor_map(kv.ptr, kv.shape, kv.strides, dtype, variant.block_n),
               tma_v=encode_tensor_map(vv.ptr, vv.shape, vv.strides, dtype, variant.block_n),
               o=ov.ptr, lse=arrays.device_ptr(lse) if lse is not None else 0,
               o_sb=ov.strides[0], o_ss=ov.strides[1], o_sh=ov.strides[2],
               lse_sb=h * sq, lse_sh=sq, lse_sr=1,
               seqlen_q=sq, seqlen_k=sk, ngroups=h // hk, nheads=h, batch=b, scale_log2=scale * _LOG2E,
               **({"tile_counter": launch._counter_ptr(qv.device, arrays.stream_for(qv), 1) if dynamic else 0}
                  if variant.persistent else {}),
               **(dict(window_left=window_size[0], window_right=window_size[1]) if variant.local else {}))
    return (out, lse) if return_lse else out
