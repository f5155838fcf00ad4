"""Warp-specialised dK/dV(+dQ) backward kernel for Hopper (templates/bwd_ws/, sm_90a), after
FlashAttention-3: a producer warpgroup loads the block's K and V once and, per step, the Q and dO
tiles by TMA and the rows' LSE and D by bulk copies into two stages on mbarriers; two consumer
warpgroups of 64 keys each run the wgmma kernel's products (bwd/dkdv_wgmma.cu.j2) with no
block-wide barrier. At d = 256 (``split_d``) a block has 64 keys and the two groups split the head
dim of dK, dV and dQ instead, with P^T and dS^T through shared memory. It replaces the second of
the backward's three kernels (kernels/bwd.py): ``bwd_prep`` before it is the same; after it runs
``bwd_convert`` reading dQ's fragment-ordered accumulator (``dq_t``: swizzled rows; ``convert()``), or, deterministic
without dQ, ``bwd_dq``. Dense batches or packed sequences (varlen), head dims 64, 128 and 256
(exactly), fp16/bf16, full, causal or sliding-window masks, GQA, softcap and ALiBi; the planner
says where it does not apply (plan._bwd_ws_blocker).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import ClassVar

from . import DTYPES, KernelVariant
from .bwd import DQ_GROUPS, INFO_BYTES, MASKS, MODS, ROW_PAD, VARLEN_ROW_GAP, BwdRowVariant
from .fwd import FLASHMASK_FIELDS, FLASHMASK_NS
from .fwd_ws import HANG_TRAP_CYCLES, MAX_CONSUMER_REGS, PRODUCER_REGS
from .params import ParamTable, strides

HEAD_DIMS = (64, 128, 256)
BLOCK_N = {64: 128, 128: 128, 256: 64}  # keys per block: two consumer warpgroups of 64 (d = 256: shared)
BLOCK_M = {64: 128, 128: 64, 256: 64}   # query rows per step (the S^T accumulators: 64 keys x block_m)
LPT_BYTES = 32 << 20                    # L2 bytes of Q, dO and dQ rows per section of the lpt launch order
LPT_MIN_SEQLEN_K = 2048                 # keys from which planned() launches causal key blocks longest first
LPT_MIN_GROUPS_D64 = 4                  # at d = 64, only with this many query heads per KV head (GQA)
# planned(): deterministic dQ without a mask in this many runs of key blocks, up to this many keys,
# per head dim (H200, bf16: BENCHMARKS.md, "Runs of key blocks")
DQ_GROUPS_PLANNED = {64: (2, 8192), 128: (2, 8192), 256: (4, 4096)}
DQ_T_BLOCK_M = 80                       # query rows per step of the dq_t variants (d = 128)
# dq_groups: runs of at most this many key blocks take the spread order (templates/bwd_ws/dkdv_ws.cu.j2,
# run_pos), whose blocks may wait for blocks of their run launched after them; 0: none, at d = 128,
# where it lost (H200, bf16, deterministic over atomic: d = 64 1k-2k keys 0.91 -> 0.95-0.97, d = 256
# 2k 0.85 -> 0.90, d = 128 1k-2k 0.92 -> 0.87-0.89; BENCHMARKS.md)
SPREAD_RUN = {64: 8, 128: 0, 256: 8}
BARRIER_BYTES = 64         # K/V full, per Q/dO stage full and empty, dq_writer's full and empty: <= 7 of 8 bytes
STAGES = 2                 # Q/dO/LSE/D stages
# Head dims without softcap and ALiBi together: at d = 64 a step's 128 query columns of S^T and
# dP^T leave no registers for both (NVCC 13.0 spilled 4-16 B in half of those variants).
NO_SOFTCAP_ALIBI = (64,)

PARAMS = ParamTable("BwdWsParams", (
    ("tma_q", "CUtensorMap"), ("tma_k", "CUtensorMap"), ("tma_v", "CUtensorMap"), ("tma_do", "CUtensorMap"),
    ("lse2", "const float*"), ("dsum", "const float*"), ("dq_accum", "float*"), ("dq_sem", "int*"),
    ("dk", "u16*"), ("dv", "u16*"), *strides("dk", "sb", "ss", "sh"), *strides("dv", "sb", "ss", "sh"),
    ("seqlen_q_arg", "int"), ("seqlen_k_arg", "int"), ("nheads", "int"), ("ngroups", "int"), ("head_rows", "int"),
    ("scale_log2", "float"), ("scale", "float"), ("window_left", "int"), ("window_right", "int"),
))
FLASHMASK_PARAMS = ParamTable("BwdWsParams", PARAMS.fields + FLASHMASK_FIELDS)
# Score modifiers, as the other backward kernels take them (kernels/bwd.py): softcap_scale =
# scale / softcap (scale_log2 is then softcap * log2 e); the ALiBi slope of (batch b, head h) is
# alibi_slopes[b * alibi_sb + h] * alibi_scale (1 / the factor the softmax applies to the raw
# scores). Appended only to the variants that have them, so the others' structs stay as they are.
SOFTCAP_FIELDS = (("softcap_scale", "float"),)
ALIBI_FIELDS = (("alibi_slopes", "const float*"), ("alibi_sb", "int"), ("alibi_scale", "float"))
# Packed sequences (varlen): sequence b owns tokens cu_seqlens_q[b] .. of q and dout and
# cu_seqlens_k[b] .. of k, v, dk and dv (appended after the score modifiers' fields).
VARLEN_FIELDS = (("cu_seqlens_q", "const int*"), ("cu_seqlens_k", "const int*"))


@dataclass(frozen=True, kw_only=True)
class BwdWsVariant(KernelVariant):
    """One warp-specialised dK/dV kernel: ``kind`` "bwd_ws_dkdv_dq" (dQ added with atomics) or
    "bwd_ws_dkdv" (deterministic: dQ has its own kernel)."""

    family = "bwd_ws"
    mma: ClassVar[str] = "wgmma"
    stages: ClassVar[int] = STAGES

    kind: str
    head_dim: int             # 64, 128 or 256: the real head dim (no column predicates)
    dtype: str                # "fp16" or "bf16"
    causal: bool = False
    local: bool = False
    # dQ = dS K issued before dK += dS^T Q, so that dQ's adds into the fp32 buffer overlap dK's
    # product (FlashAttention-3's order); by default dK is issued with dV and the adds wait for
    # both.
    dq_early: bool = False
    # dQ staged by the consumers in shared memory and added into the fp32 buffer by a warp of the
    # producer warpgroup with one bulk reduce-add per step, so that no consumer waits on the adds
    # (FlashAttention-3's dQ writer). Every variant's dQ accumulator but dq_t's is fragment-ordered
    # (templates/common/bwd.cuh), so the tiled ``bwd_convert`` (convert()) follows it.
    dq_writer: bool = False
    # Deterministic dQ through the writer (at d = 256 the consumers' atomics): a semaphore per
    # query block lets the key blocks add their dQ in a fixed order, each after the previous one's
    # adds are complete (FlashAttention-3's deterministic mode); with a causal or local mask the
    # key blocks run from the last.
    dq_ordered: bool = False
    # Ordered dQ without a mask on dense batches in this many runs of consecutive key blocks, each
    # with an fp32 accumulator and semaphores of its own and its walk starting at another query
    # block (1: one run, the whole head). At a wave's start each key block waits for the ones
    # before it in its run, so runs shorten that staircase; runs of at most SPREAD_RUN blocks
    # instead spread their walks' starts and take each query block's adds in the order the blocks
    # reach it (no staircase). bwd_convert sums the accumulators in a fixed order, and the first
    # to add into a query block stores where the others add, so nothing is zeroed.
    dq_groups: int = 1
    # FlashMask bound columns per key (cuflash.masks; 1 or 2 with causal, 2 or 4 without), 0 =
    # none: every role leaves out the fully masked steps, the consumers mask the partly masked
    # ones. Atomic dQ, none (kind "bwd_ws_dkdv"), or with causal the dQ writer's ordered adds,
    # whose turns then count only the key blocks whose tile is not left out.
    flashmask: int = 0
    # Each key block walks its query steps from a different one (step j of the walk is step
    # (j + rot) mod the step count, rot spreading a head's key blocks over its query blocks), so
    # that the blocks running together add their dQ into different rows. Atomic dQ, no FlashMask.
    rotate: bool = False
    # The forward's score modifiers, recomputed with S^T: softcap (scores softcap * tanh(s * scale /
    # softcap); dS^T takes the derivative 1 - tanh^2) and ALiBi (-slope * |i + seqlen_k - seqlen_q - j|).
    # Not with FlashMask (a FlashMask softcap runs on the other backward kernels), and not both at
    # d = 64 (NO_SOFTCAP_ALIBI).
    softcap: bool = False
    alibi: bool = False
    # Packed variable-length sequences (cu_seqlens_q, cu_seqlens_k; FlashAttention-3's varlen):
    # the tensor maps span every token as one batch, a block reads its sequence's bounds and
    # leaves at once past its keys, and its rows of LSE, D and the dQ accumulator are the
    # sequence's padded ones (bwd.cuh's stats_base). Not with FlashMask.
    varlen: bool = False
    # d = 128: steps of 80 query rows (FlashAttention-3's tile without a mask), with dQ^T = K^T
    # dS^T (the head dim as wgmma's M, FlashAttention-3's dQ_swapAB) and dS kept as rows of
    # queries; the dQ writer's adds (ordered: a semaphore per step) into an accumulator of rows
    # with swizzled chunks (``convert(swizzled=True)``), padded to ``row_pad`` rows per head or
    # packed sequence (whole steps; ``prep()``). No softcap; packed sequences and FlashMask only
    # without the ordered adds.
    dq_t: bool = False
    # Causal, atomic dQ, dense batches: key blocks launched longest first within sections of
    # (batch, KV head) pairs whose Q, dO and dQ rows fit in LPT_BYTES of L2 (FlashAttention-3's
    # LPT order), instead of each pair's blocks in turn.
    lpt: bool = False
    # FlashMask: each warp classifies its walk's steps 32 at a time, once per 32, and keeps the
    # live ones and the partly masked ones as two bit masks that it pops, instead of classifying
    # the next 32 steps at every step (and each step's tile twice more). The same steps in the
    # same order.
    fm_window: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.arch != 90:
            raise ValueError(f"bwd_ws is a Hopper kernel (sm_90a): arch must be 90, got {self.arch!r}")
        if self.kind not in ("bwd_ws_dkdv_dq", "bwd_ws_dkdv"):
            raise ValueError(f"kind must be 'bwd_ws_dkdv_dq' or 'bwd_ws_dkdv', got {self.kind!r}")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {self.head_dim!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for f in ("dq_early", "dq_writer", "dq_ordered"):
            if not isinstance(getattr(self, f), bool) or (getattr(self, f) and not self.dq):
                raise ValueError(f"{f} must be a bool, and True only with kind 'bwd_ws_dkdv_dq', "
                                 f"got {getattr(self, f)!r}")
        if self.split_d and (self.dq_early or self.dq_writer):
            raise ValueError("at head_dim 256 dQ is added with atomics, issued before dK and dV: "
                             "dq_early and dq_writer must be False")
        if self.dq_ordered and not (self.dq_writer or (self.split_d and self.dq)):
            raise ValueError("dq_ordered orders the dQ writer's adds (at head_dim 256 the atomic ones): "
                             "it needs dq_writer=True")
        if self.flashmask and not ((not self.dq_ordered or self.dq_writer and self.causal) and not self.local
                                   and self.flashmask in (FLASHMASK_NS[:2] if self.causal else FLASHMASK_NS[1:])):
            raise ValueError(f"flashmask must be 0, or 1 or 2 with causal, 2 or 4 without, with atomic dQ, none, or "
                             f"(causal) the dQ writer's ordered adds, and no window; got {self.flashmask!r}")
        if not isinstance(self.rotate, bool) or self.rotate and (self.dq_ordered or self.flashmask or not self.dq):
            raise ValueError(f"rotate must be a bool, True only with atomic dQ and no FlashMask, got {self.rotate!r}")
        if type(self.dq_groups) is not int or self.dq_groups not in DQ_GROUPS or self.dq_groups > 1 and not (
                self.dq_ordered and not (self.causal or self.local or self.varlen or self.flashmask)):
            raise ValueError(f"dq_groups must be one of {DQ_GROUPS}, other than 1 only with ordered dQ (dq_ordered) "
                             f"without a mask, FlashMask or packed sequences; got {self.dq_groups!r}")
        if not isinstance(self.causal, bool) or not isinstance(self.local, bool) or (self.causal and self.local):
            raise ValueError(f"causal and local must be bools, not both True, got {self.causal!r}, {self.local!r}")
        for f in ("softcap", "alibi"):
            if not isinstance(getattr(self, f), bool) or (getattr(self, f) and self.flashmask):
                raise ValueError(f"{f} must be a bool, and True only without FlashMask, got {getattr(self, f)!r}")
        if not isinstance(self.varlen, bool) or (self.varlen and self.flashmask):
            raise ValueError(f"varlen must be a bool, and True only without FlashMask, got {self.varlen!r}")
        if self.softcap and self.alibi and self.head_dim in NO_SOFTCAP_ALIBI:
            raise ValueError(f"softcap and alibi together need registers that head_dim {self.head_dim} lacks")
        if not isinstance(self.dq_t, bool) or self.dq_t and not (
                self.head_dim == 128 and self.dq_writer and not (
                    self.softcap or (self.varlen or self.flashmask) and self.dq_ordered)):
            raise ValueError(f"dq_t must be a bool, True only at head_dim 128 with the dQ writer (packed sequences "
                             f"and FlashMask: unordered), without softcap; got {self.dq_t!r}")

        if not isinstance(self.lpt, bool) or self.lpt and not (
                self.causal and self.dq and not (self.dq_ordered or self.flashmask or self.varlen)):
            raise ValueError(f"lpt must be a bool, True only causal with atomic dQ, no FlashMask and no packed "
                             f"sequences; got {self.lpt!r}")
        if not isinstance(self.fm_window, bool) or self.fm_window and not self.flashmask:
            raise ValueError(f"fm_window must be a bool, True only with FlashMask; got {self.fm_window!r}")

    @functools.cached_property
    def params(self) -> ParamTable:
        """The common fields, then FlashMask's, softcap's, ALiBi's and varlen's where the variant
        has them."""
        if not (self.softcap or self.alibi or self.varlen):
            return FLASHMASK_PARAMS if self.flashmask else PARAMS
        return ParamTable("BwdWsParams", PARAMS.fields + SOFTCAP_FIELDS * self.softcap + ALIBI_FIELDS * self.alibi
                          + VARLEN_FIELDS * self.varlen)

    @property
    def block_m(self) -> int:
        return DQ_T_BLOCK_M if self.dq_t else BLOCK_M[self.head_dim]

    @property
    def row_pad(self) -> int:
        """Rows of LSE, D and the dQ accumulator per head are padded to a multiple of this (whole
        steps; bwd_prep gives padding rows LSE +inf and D 0): ROW_PAD, or dq_t's 80-row step (a
        multiple of 8, as its swizzled rows need; its semaphores are one per step)."""
        return self.block_m if self.dq_t else ROW_PAD

    @property
    def block_n(self) -> int:
        return BLOCK_N[self.head_dim]

    @property
    def split_d(self) -> bool:
        """The consumer groups split the head dim (d = 256: a group's dK and dV over all of it
        would not fit in its registers)."""
        return self.head_dim == 256

    @property
    def overlap(self) -> bool:
        """dV += P^T dO issued while dS^T is formed: at d = 128 (at d = 64 the step's 128 query
        columns of S^T, dP^T and P^T together spill)."""
        return self.head_dim == 128 and not self.dq_t  # (80 query columns: one pass)

    @property
    def dq(self) -> bool:
        return self.kind == "bwd_ws_dkdv_dq"

    @functools.cached_property
    def name(self) -> str:
        mask = "local" if self.local else ("causal" if self.causal else "full")
        mask += ("_softcap" if self.softcap else "") + ("_alibi" if self.alibi else "")  # as tile_name does
        mask += "_varlen" if self.varlen else ""
        bulk = (("_dqwriter" if self.dq_writer else "") + ("_dqearly" if self.dq_early else "")
                + ("_ordered" if self.dq_ordered else "") + (f"_g{self.dq_groups}" if self.dq_groups > 1 else "")
                + (f"_fm{self.flashmask}" if self.flashmask else "") + ("w" if self.fm_window else "")
                + ("_lpt" if self.lpt else "") + ("_rot" if self.rotate else "") + ("_dqT" if self.dq_t else ""))
        return f"{self.kind}_d{self.head_dim}_{self.dtype}_{mask}{bulk}_m{self.block_m}n{self.block_n}_sm{self.arch}"

    @property
    def template(self) -> str:
        return "bwd_ws/dkdv_ws.cu.j2"

    @property
    def target(self) -> str:
        return "90a"  # wgmma and setmaxnreg

    @property
    def threads(self) -> int:
        return 384  # the producer warpgroup, then two consumer warpgroups

    @property
    def smem_bytes(self) -> int:
        """Mirrors kSmemBytes in the template: K and V tiles, Q and dO per stage, two dS^T tiles
        (dQ variant; split_d: two P^T and two dS^T tiles), LSE and D per stage, the dQ staging
        tile (dq_writer), the per-block scalars, the mbarriers."""
        tile_q = self.block_m * self.head_dim * 2
        ds = self.block_n * self.block_m * 2 if self.dq or self.split_d else 0
        dq_stage = self.block_m * self.head_dim * 4 if self.dq_writer else 0
        return (2 * self.block_n * self.head_dim * 2 + 2 * STAGES * tile_q + (4 if self.split_d else 2) * ds
                + 2 * STAGES * self.block_m * 4 + dq_stage + INFO_BYTES + BARRIER_BYTES)

    @property
    def zero_tail(self) -> bool:
        """Packed sequences: the consumers zero a tail tile's rows past its sequence (the next
        sequence's tokens) in shared memory before reading them (0 * NaN there would reach this
        sequence's dQ, dK and dV)."""
        return self.varlen

    def grid(self, batch: int, seqlen_q: int, seqlen_k: int, nheads: int, nheads_k: int) -> tuple[int, int, int]:
        return (-(-seqlen_k // self.block_n), nheads_k, batch)

    def constants(self) -> dict:
        return dict(head_dim=self.head_dim, block_m=self.block_m, block_n=self.block_n, split_d=self.split_d,
                    causal=self.causal, local=self.local, bf16=self.dtype == "bf16", dq=self.dq,
                    dq_early=self.dq_early, dq_writer=self.dq_writer,
                    dq_ordered=self.dq_ordered, dq_groups=self.dq_groups, flashmask=self.flashmask, rotate=self.rotate, overlap=self.overlap,
                    softcap=self.softcap, alibi=self.alibi, varlen=self.varlen, zero_tail=self.zero_tail, dq_t=self.dq_t,
                    lpt=self.lpt, lpt_bytes=LPT_BYTES, fm_window=self.fm_window, spread_run=SPREAD_RUN[self.head_dim],
                    producer_regs=PRODUCER_REGS, consumer_regs=MAX_CONSUMER_REGS, hang_trap_cycles=HANG_TRAP_CYCLES,
                    info_bytes=INFO_BYTES, barrier_bytes=BARRIER_BYTES, varlen_row_gap=VARLEN_ROW_GAP)


def planned(head_dim: int, dtype: str, causal: bool, local: bool, deterministic: bool,
            arch: int = 90, flashmask: int = 0, softcap: bool = False, alibi: bool = False,
            varlen: bool = False, seqlen_k: int = 0, ngroups: int = 1, seqlen_q: int = 0) -> BwdWsVariant:
    """The variant a backward plan launches for these head dim, dtype, mask and dQ mode: at d = 64
    and 128 the dQ writer with dQ's product issued early, at d = 256 (no room for the writer's
    tile) atomics; deterministic, the same adds in a fixed order (the fastest of the dQ variants
    on an H200 at each, and the ordered adds faster than the deterministic dQ kernel:
    BENCHMARKS.md, scripts/bench_bwd_ws.py); atomic dQ without FlashMask with rotated step walks
    (+2 to +7% at d = 128 and 256 on an H200; starting within the group's first query head:
    with GQA 4, +12 to +55% at d = 256, +2 to +14% at d = 128 causal), except the 80-query steps
    without a mask (rotated walks 0 to 10% slower there). ``flashmask``: FlashMask's bound columns per key;
    deterministic with FlashMask, the dQ writer's ordered adds where the mask is causal at d = 64
    and 128, elsewhere dK and dV only (kind "bwd_ws_dkdv"; the deterministic dQ kernel follows):
    without causal the ordered adds were slower than the dQ kernel on an H200 (a key block that
    every query block sees, global tokens or a prefix, holds up the others' turns), and at d = 256
    the consumers' ordered atomics take a turn on every step. ``softcap``, ``alibi``: the
    forward's score modifiers (the same dQ modes); ``varlen``: packed sequences (the same dQ
    modes). FlashMask at d = 64 and 128: each warp classifies a window of 32 steps at once
    (``fm_window``; forward + backward on bench mask's families, one process each: d = 128 H200 +2
    to +11%, deterministic H100 0 to +9%, d = 64 H100 +4 to +12%, deterministic +1 to +9% (one
    reading of -37% that a recheck put at +9%); d = 256 H100 -14 to +10%, so not there). At d = 128
    without softcap: 80-query steps with dQ^T (``dq_t``; H200, bf16: +3 to +11% without a mask, +4
    to +5% causal from 4k queries, -1 to +1% causal at 1k-2k; deterministic -1 to +9%; FlashMask
    with atomic dQ +2 to +13%, with fm_window +9 to +23% over neither; BENCHMARKS.md), except
    deterministic with a window or FlashMask (NVRTC 13.5 spills 4 B in the window's variant; the
    FlashMask variant takes unordered adds only), packed sequences but causal or windowed ones
    without deterministic mode (without a mask the packed variant spills 8 B), and ALiBi but on
    dense batches without a window (softcap, and ALiBi with a window or packed sequences, spill 4
    to 72 B). Causal from
    LPT_MIN_SEQLEN_K keys on dense batches with atomic dQ, at d = 128 without softcap (4 B spill)
    and at d = 64 with at least LPT_MIN_GROUPS_D64 query heads per KV head (``ngroups``): key
    blocks launched longest first (``lpt``; H200: d = 128 +2 to +8% from 2k to 16k keys, 0 at 1k,
    +1 to +15% with GQA 32/8; d = 64 with GQA 32/8 +3 to +22%, without GQA -1 to -11% on an
    H100; d = 256 -4 to +8% either way). Deterministic without a mask on dense batches: the ordered
    adds in runs of key blocks (``dq_groups``, dq_groups(); H200, bf16, over one run: d = 128 +1 to
    +11% from 1k to 8k keys, d = 64 +4 to +13%, d = 256 +4 to +17% up to 4k)."""
    dq = not (deterministic and flashmask and (head_dim == 256 or not causal))
    dq_t = head_dim == 128 and not (softcap or deterministic and (local or varlen or flashmask)
                                    or varlen and not (causal or local) or alibi and (local or varlen))
    fm_window = bool(flashmask) and head_dim != 256
    lpt = (causal and not (deterministic or flashmask or varlen) and seqlen_k >= LPT_MIN_SEQLEN_K
           and (head_dim == 128 and not softcap or head_dim == 64 and ngroups >= LPT_MIN_GROUPS_D64))
    groups = (dq_groups(head_dim, seqlen_k, seqlen_q) if dq and deterministic
              and not (causal or local or flashmask or varlen) else 1)
    return BwdWsVariant(kind="bwd_ws_dkdv_dq" if dq else "bwd_ws_dkdv", head_dim=head_dim, dtype=dtype,
                        causal=causal, local=local, arch=arch, dq_early=dq and head_dim != 256,
                        dq_writer=dq and head_dim != 256, dq_ordered=dq and deterministic, dq_groups=groups,
                        flashmask=flashmask,
                        rotate=not (deterministic or flashmask or dq_t and not (causal or local)), softcap=softcap,
                        alibi=alibi, varlen=varlen,
                        dq_t=dq_t, lpt=lpt, fm_window=fm_window)


FLIPPABLE = ("fm_window", "dq_t")


def flipped(variant: BwdWsVariant, fields) -> BwdWsVariant:
    """A FlashMask ``variant`` with the bool fields named in ``fields`` (FLIPPABLE) flipped where
    the flip gives a valid variant (dq_t: d = 128 with the dQ writer's unordered adds), else as it
    is: the other side of an A/B trial against the planned variant."""
    if unknown := set(fields) - set(FLIPPABLE):
        raise ValueError(f"fields must be among {FLIPPABLE}, got {sorted(unknown)}")
    ok = {"fm_window": bool(variant.flashmask),
          "dq_t": bool(variant.flashmask) and variant.head_dim == 128 and variant.dq_writer and not variant.dq_ordered}
    return replace(variant, **{f: not getattr(variant, f) for f in fields if ok[f]})


def dq_groups(head_dim: int, seqlen_k: int, seqlen_q: int = 0) -> int:
    """Runs of key blocks for deterministic dQ without a mask (BwdWsVariant.dq_groups): as
    DQ_GROUPS_PLANNED gives them up to its number of keys and queries (past it a head's walk is
    long against its staircase, and each run's accumulator, as large as dQ in fp32, would cost
    memory for little), else 1; fewer where there are fewer key blocks than runs."""
    groups, max_len = DQ_GROUPS_PLANNED[head_dim]
    if seqlen_k > max_len or seqlen_q > max_len:
        return 1
    blocks = -(-seqlen_k // BLOCK_N[head_dim])
    return max(g for g in DQ_GROUPS if g <= min(groups, max(1, blocks)))


def prep(variant: BwdWsVariant, base: BwdRowVariant) -> BwdRowVariant:
    """The ``bwd_prep`` before ``variant``: ``base`` with its packed sequences' rows padded to
    the variant's steps, and with ``dq_groups`` its semaphores per 64 rows."""
    return replace(base, row_pad=variant.row_pad, dq_groups=variant.dq_groups)


def convert(head_dim: int, dtype: str, arch: int = 90, varlen: bool = False, dq_t: bool = False,
            dq_groups: int = 1) -> BwdRowVariant:
    """The ``bwd_convert`` after a bwd_ws kernel that adds dQ: it reads the fragment-ordered
    accumulator (``varlen``: each packed sequence's padded rows), or after a ``dq_t`` kernel the
    rows with swizzled chunks; it sums ``dq_groups`` accumulators (BwdWsVariant.dq_groups)."""
    if dq_t:
        return BwdRowVariant(kind="bwd_convert", head_dim=head_dim, dtype=dtype, arch=arch, swizzled=True,
                             dq_groups=dq_groups)
    return BwdRowVariant(kind="bwd_convert", head_dim=head_dim, dtype=dtype, arch=arch, tiled=True, varlen=varlen,
                         dq_groups=dq_groups)


def _grouped(main: BwdWsVariant, arch: int) -> list[KernelVariant]:
    """A dq_groups variant with its bwd_prep and bwd_convert (as plan.make_backward_plan picks them)."""
    base = BwdRowVariant(kind="bwd_prep", head_dim=main.head_dim, dtype=main.dtype, arch=arch)
    return [main, prep(main, base), convert(main.head_dim, main.dtype, arch, dq_t=main.dq_t, dq_groups=main.dq_groups)]


def variants(arch: int, mods: bool = True) -> list[KernelVariant]:
    """Every bwd_ws variant a plan can launch on ``arch`` (sm_90 only), and the tiled
    ``bwd_convert`` kernels after them; ``mods=False`` leaves out the sliding-window, FlashMask,
    softcap, ALiBi and varlen ones."""
    if arch != 90:
        return []
    return [planned(d, dt, c, loc, det, arch) for d in HEAD_DIMS for dt in DTYPES
            for c, loc in (MASKS if mods else MASKS[:2]) for det in (False, True)] + [
        convert(d, dt, arch) for d in HEAD_DIMS for dt in DTYPES] + [
        convert(128, dt, arch, dq_t=True) for dt in DTYPES] + [
        BwdRowVariant(kind="bwd_prep", head_dim=128, dtype=dt, arch=arch, row_pad=DQ_T_BLOCK_M) for dt in DTYPES] + [
        # deterministic without a mask in runs of key blocks (softcap and ALiBi too; every count
        # of runs planned: fewer than DQ_GROUPS_PLANNED's where a head has fewer key blocks), with
        # their bwd_prep and bwd_convert
        *dict.fromkeys(w for d in HEAD_DIMS for dt in DTYPES for cap, ali in (MODS if mods else MODS[:1])
                       if not (cap and ali and d in NO_SOFTCAP_ALIBI)
                       for g in DQ_GROUPS[1:] if g <= DQ_GROUPS_PLANNED[d][0]
                       for w in _grouped(planned(d, dt, False, False, True, arch, softcap=cap, alibi=ali,
                                                 seqlen_k=g * BLOCK_N[d]), arch))] + [
        # causal blocks longest first (from LPT_MIN_SEQLEN_K keys; d = 64 with GQA), with softcap or ALiBi
        planned(d, dt, True, False, False, arch, softcap=cap, alibi=ali, seqlen_k=LPT_MIN_SEQLEN_K,
                ngroups=LPT_MIN_GROUPS_D64) for d in (64, 128) for dt in DTYPES for cap, ali in MODS[:3]
        if (mods or not (cap or ali)) and not (cap and d == 128)] + [
        planned(d, dt, c, False, det, arch, n) for d in HEAD_DIMS for dt in DTYPES for c in (False, True)
        for n in (FLASHMASK_NS[:2] if c else FLASHMASK_NS[1:]) for det in (False, True) if mods] + [
        # every mask and dQ mode with softcap, ALiBi and both (kernels/bwd.py's MODS after the first)
        planned(d, dt, c, loc, det, arch, softcap=cap, alibi=ali) for d in HEAD_DIMS for dt in DTYPES
        for c, loc in MASKS for det in (False, True) for cap, ali in MODS[1:]
        if mods and not (cap and ali and d in NO_SOFTCAP_ALIBI)] + [
        # packed sequences: every mask, dQ mode and score modifier, and their bwd_convert
        planned(d, dt, c, loc, det, arch, softcap=cap, alibi=ali, varlen=True) for d in HEAD_DIMS for dt in DTYPES
        for c, loc in MASKS for det in (False, True) for cap, ali in MODS
        if mods and not (cap and ali and d in NO_SOFTCAP_ALIBI)] + [
        convert(d, dt, arch, varlen=True) for d in HEAD_DIMS for dt in DTYPES if mods]
