"""Backward family (templates/bwd/): FlashAttention-2's backward in four kernels, launched in
this order on the caller's stream (cuflash/backward.py describes the algorithm):

1. ``bwd_prep`` (prep.cu.j2): D = rowsum(dO * O) and LSE * log2(e) per query row, padded rows,
   and a zeroed fp32 dQ accumulator when one is used;
2. ``bwd_dkdv_dq`` (dkdv.cu.j2; dkdv_wgmma.cu.j2 on sm_90a): dK and dV per key block, dQ added
   into the fp32 accumulator with atomics; or ``bwd_dkdv`` (no dQ) with ``deterministic=True``;
3. ``bwd_convert`` (convert.cu.j2): dQ = scale * accumulator in the input dtype; or, with
   ``deterministic=True``, ``bwd_dq`` (dq.cu.j2): dQ per query block, written once.

FlashMask (``flashmask = n``, cuflash.masks): the dK/dV and dQ kernels take the indices and the
per-key-block bounds of the FlashMask prep kernel (kernels/flashmask.py, launched first, once per
key-block size) and classify each (key block, query block) tile as the forward does
(templates/common/flashmask.cuh): skipped (no loads, no math, no dQ), masked element by element,
or plain.

Tiles compile with no spills under NVRTC 13.0 and 13.5 for sm_80 and sm_90 (checked in the CPU
tests).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from . import HEAD_DIM_BUCKETS, KernelVariant, tile_name
from .fwd import DROPOUT_FIELDS, FLASHMASK_FIELDS, FLASHMASK_NS
from .params import ParamTable, strides

ROW_KINDS = ("bwd_prep", "bwd_convert")
TILE_KINDS = ("bwd_dkdv", "bwd_dkdv_dq", "bwd_dq")

# dK/dV kernel tiles per head-dim bucket: (block_m query rows per step, block_n keys per block,
# warps, Q/dO stages, mma). In the mma.sync kernel every warp owns 16 keys (two warps share them
# above d = 128), so block_m sets the S^T and dP^T registers.
DKDV_TILES = {
    32: (64, 128, 8, 2, "sync"),
    64: (64, 128, 8, 2, "sync"),
    96: (32, 128, 8, 2, "sync"),
    128: (32, 128, 8, 2, "sync"),
    192: (32, 64, 8, 2, "sync"),
    256: (32, 64, 8, 2, "sync"),
}
# sm_90 at d = 64 and 128 without softcap or ALiBi: the wgmma kernel, two warpgroups of 64 keys,
# steps of 128 queries at d = 64 and 64 at d = 128 (its dK and dV accumulators leave no
# registers for a softcap's 1 - t^2 factors or ALiBi's bias).
DKDV_WGMMA_TILES = {64: (128, 128, 8, 2, "wgmma"), 128: (64, 128, 8, 2, "wgmma")}
# With a softcap at d = 256 the second Q/dO stage does not fit the registers.
DKDV_SOFTCAP_TILES = {256: (32, 64, 8, 1, "sync")}
# Deterministic dQ kernel tiles: (block_m, block_n, warps, K/V stages); every window, softcap
# and ALiBi combination fits them.
DQ_TILES = {
    32: (64, 128, 4, 2),
    64: (128, 64, 8, 2),
    96: (64, 64, 4, 2),
    128: (64, 64, 4, 2),
    192: (64, 32, 4, 2),
    256: (64, 32, 4, 2),
}
# FlashMask with a softcap at d = 32: the dQ kernel's 128-key tiles leave no registers for the
# per-column bounds next to the softcap's 1 - t^2 factors; 64 keys do.
DQ_FLASHMASK_SOFTCAP_TILES = {32: (64, 64, 4, 2)}
# Dropout at d = 32: the dQ kernel's 128-key tiles leave no registers for the Philox words (with a
# window, softcap and ALiBi it spilled 88-132 B under NVRTC 13.5); 64 keys do.
DQ_DROPOUT_TILES = {32: (64, 64, 4, 2)}
# FlashMask with a softcap at d = 128: the dK/dV kernel's second Q/dO stage leaves no registers
# for the per-column bounds next to the softcap's factors (NVRTC 13.0 spills the causal two-bound
# variant); one stage does.
DKDV_FLASHMASK_SOFTCAP_TILES = {128: (32, 128, 8, 1, "sync")}
DQ_GROUPS = (1, 2, 4)  # bwd_ws's runs of key blocks with ordered dQ (a divisor of 64: bwd_prep's semaphores)
ROW_PAD = 128          # LSE/D/dQ-accumulator rows are padded to a multiple of every block_m (bwd_ws dq_t: row_pad)
VARLEN_ROW_GAP = ROW_PAD + 4  # packed sequences: rows between sequence starts (stats_base, bwd.cuh)
PREP_ROWS_PER_BLOCK = 8  # one warp per row
CONVERT_THREADS = 256    # one thread per 8 output elements
INFO_BYTES = 48          # per-block scalars the dK/dV kernel stages in shared memory (bwd.cuh)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def row_floats(head_dim: int, main, last) -> int:
    """fp32 values per backward workspace row, for the dK/dV kernel ``main`` and the last kernel
    ``last``: LSE and D, and unless the deterministic dQ kernel writes dQ, the dQ accumulator's
    head dim once per run of key blocks (bwd_ws dq_groups)."""
    return 2 + (0 if last.kind == "bwd_dq" else head_dim * getattr(main, "dq_groups", 1))


def sem_words(rows: int, main) -> int:
    """int32 semaphores of ``main``'s ordered dQ adds over ``rows`` workspace rows: one per 64 rows
    and run of key blocks (cdiv: packed sequences' rows need not fill the last 64; a query block's
    semaphore is that of its first 64-aligned row, bwd.cuh); 0 without ordered adds."""
    return cdiv(rows, 64) * getattr(main, "dq_groups", 1) if getattr(main, "dq_ordered", False) else 0


def dkdv_tile(bucket: int, softcap: bool = False, alibi: bool = False,
              arch: int = 90) -> tuple[int, int, int, int, str]:
    """The dK/dV kernel's tile: DKDV_WGMMA_TILES on sm_90 where it has the bucket and there is
    no softcap or ALiBi; DKDV_SOFTCAP_TILES with a softcap where it has the bucket; else
    DKDV_TILES. Windows fit every tile."""
    if arch == 90 and bucket in DKDV_WGMMA_TILES and not (softcap or alibi):
        return DKDV_WGMMA_TILES[bucket]
    if softcap and bucket in DKDV_SOFTCAP_TILES:
        return DKDV_SOFTCAP_TILES[bucket]
    return DKDV_TILES[bucket]


_SCORE = (
    ("scale_log2", "float"), ("scale", "float"),
    ("cu_seqlens_q", "const int*"), ("cu_seqlens_k", "const int*"),
    ("window_left", "int"), ("window_right", "int"), ("softcap_scale", "float"),
    ("alibi_slopes", "const float*"), ("alibi_sb", "int"), ("alibi_scale", "float"),
)
_SHAPE = (("seqlen_q_arg", "int"), ("seqlen_k_arg", "int"), ("nheads", "int"), ("ngroups", "int"),
          ("head_dim", "int"), ("head_rows", "int"))
_QKVDO = (*strides("q", "sb", "ss", "sh"), *strides("k", "sb", "ss", "sh"), *strides("v", "sb", "ss", "sh"),
          *strides("do", "sb", "ss", "sh"))
PREP_PARAMS = ParamTable("BwdPrepParams", (
    ("dout", "const u16*"), ("out", "const u16*"), ("lse", "const float*"),
    ("lse2", "float*"), ("dsum", "float*"), ("dq_accum", "float*"), ("dq_sem", "int*"),
    *strides("do", "sb", "ss", "sh"), *strides("o", "sb", "ss", "sh"), *strides("lse", "sb", "sh", "ss"),
    ("seqlen_q_arg", "int"), ("nheads", "int"), ("head_dim", "int"), ("head_rows", "int"),
    ("cu_seqlens_q", "const int*"),
))
DKDV_PARAMS = ParamTable("BwdDkdvParams", (
    ("q", "const u16*"), ("k", "const u16*"), ("v", "const u16*"), ("dout", "const u16*"),
    ("lse2", "const float*"), ("dsum", "const float*"), ("dq_accum", "float*"), ("dk", "u16*"), ("dv", "u16*"),
    *_QKVDO, *strides("dk", "sb", "ss", "sh"), *strides("dv", "sb", "ss", "sh"), *_SHAPE, *_SCORE,
))
DQ_PARAMS = ParamTable("BwdDqParams", (
    ("q", "const u16*"), ("k", "const u16*"), ("v", "const u16*"), ("dout", "const u16*"),
    ("lse2", "const float*"), ("dsum", "const float*"), ("dq", "u16*"),
    *_QKVDO, *strides("dq", "sb", "ss", "sh"), *_SHAPE, *_SCORE,
))
# FlashMask variants (flashmask > 0) take the forward's FlashMask fields too, at the end: the
# indices with their element strides, query heads per index head, index heads, and the prep
# kernel's per-key-block bounds for this kernel's block_n.
DKDV_FM_PARAMS = ParamTable("BwdDkdvParams", DKDV_PARAMS.fields + FLASHMASK_FIELDS)
DQ_FM_PARAMS = ParamTable("BwdDqParams", DQ_PARAMS.fields + FLASHMASK_FIELDS)
# Dropout variants take the forward's dropout fields too, at the end (the call's Philox seed and
# offset, keep threshold and 1 / (1 - dropout_p)): the same mask is regenerated.
DKDV_DROPOUT_PARAMS = ParamTable("BwdDkdvParams", DKDV_PARAMS.fields + DROPOUT_FIELDS)
DQ_DROPOUT_PARAMS = ParamTable("BwdDqParams", DQ_PARAMS.fields + DROPOUT_FIELDS)
CONVERT_PARAMS = ParamTable("BwdConvertParams", (
    ("dq_accum", "const float*"), ("dq", "u16*"), *strides("dq", "sb", "ss", "sh"),
    ("seqlen_q_arg", "int"), ("nheads", "int"), ("head_dim", "int"), ("head_rows", "int"), ("scale", "float"),
    ("cu_seqlens_q", "const int*"),
))


@dataclass(frozen=True, kw_only=True)
class BwdRowVariant(KernelVariant):
    """A per-row backward kernel: ``bwd_prep`` or ``bwd_convert`` (no tile, no mask)."""

    family = "bwd"

    kind: str
    head_dim: int
    dtype: str
    # bwd_convert reading the warp-specialised backward's fragment-ordered accumulator (64 x 64
    # pieces in its registers' order, templates/common/bwd.cuh): head_dim exact.
    tiled: bool = False
    # The tiled bwd_convert for packed sequences: sequence b's pieces start at its padded rows
    # (stats_base in bwd.cuh), its dQ rows at token cu_seqlens_q[b]. (The untiled convert reads
    # cu_seqlens_q whenever it is given.)
    varlen: bool = False
    # The untiled bwd_convert reading rows whose 16-byte chunk c of row r sits at chunk c ^ (r & 7)
    # (the dQ accumulator of bwd_ws's dq_t variants): head_dim exact, a multiple of 32.
    swizzled: bool = False
    # bwd_prep: a packed sequence's rows are padded to a multiple of this (ROW_PAD, or bwd_ws
    # dq_t's 80-row steps; VARLEN_ROW_GAP leaves room for either); a dense batch's to head_rows.
    row_pad: int = ROW_PAD
    # bwd_ws's ordered dQ in runs of key blocks (BwdWsVariant.dq_groups, dense batches): bwd_prep
    # zeroes this many semaphores per 64 rows and no accumulator (the first block of a run to add
    # into a query block stores into the run's own); the tiled or swizzled bwd_convert sums them.
    dq_groups: int = 1

    def __post_init__(self):
        super().__post_init__()
        if self.kind not in ROW_KINDS:
            raise ValueError(f"kind must be one of {ROW_KINDS}, got {self.kind!r}")
        self._check_head_dim_dtype()
        if not isinstance(self.tiled, bool) or (self.tiled and (self.kind != "bwd_convert" or self.head_dim % 64)):
            raise ValueError(f"tiled must be a bool, and True only for bwd_convert at a head_dim that is a multiple "
                             f"of 64, got {self.tiled!r} ({self.kind}, head_dim {self.head_dim})")
        if not isinstance(self.varlen, bool) or (self.varlen and not self.tiled):
            raise ValueError(f"varlen must be a bool, and True only for the tiled bwd_convert, got {self.varlen!r}")
        if not isinstance(self.swizzled, bool) or (self.swizzled and (self.kind != "bwd_convert" or self.tiled
                                                                       or self.head_dim % 32)):
            raise ValueError(f"swizzled must be a bool, and True only for the untiled bwd_convert at a head_dim that "
                             f"is a multiple of 32, got {self.swizzled!r}")
        if (not isinstance(self.row_pad, int) or not 16 <= self.row_pad <= ROW_PAD or self.row_pad % 16
                or (self.row_pad != ROW_PAD and self.kind != "bwd_prep")):
            raise ValueError(f"row_pad must be a multiple of 16 up to {ROW_PAD}, other than {ROW_PAD} only for "
                             f"bwd_prep, got {self.row_pad!r}")
        if type(self.dq_groups) is not int or self.dq_groups not in DQ_GROUPS or self.dq_groups > 1 and (
                self.varlen or self.kind == "bwd_convert" and not (self.tiled or self.swizzled)):
            raise ValueError(f"dq_groups must be one of {DQ_GROUPS}, other than 1 only for bwd_prep and the tiled or "
                             f"swizzled bwd_convert of dense batches, got {self.dq_groups!r}")

    @property
    def params(self) -> ParamTable:
        return PREP_PARAMS if self.kind == "bwd_prep" else CONVERT_PARAMS

    @functools.cached_property
    def name(self) -> str:
        return (f"{self.kind}_d{self.head_dim}_{self.dtype}{'_tiled' if self.tiled else ''}"
                f"{'_varlen' if self.varlen else ''}{'_swz' if self.swizzled else ''}"
                f"{f'_r{self.row_pad}' if self.row_pad != ROW_PAD else ''}"
                f"{f'_g{self.dq_groups}' if self.dq_groups > 1 else ''}_sm{self.arch}")

    @property
    def template(self) -> str:
        return "bwd/prep.cu.j2" if self.kind == "bwd_prep" else "bwd/convert.cu.j2"

    @property
    def threads(self) -> int:
        return 32 * PREP_ROWS_PER_BLOCK if self.kind == "bwd_prep" else CONVERT_THREADS

    def grid(self, batch: int, seqlen_q: int, nheads: int, head_dim: int) -> tuple[int, int, int]:
        if self.kind == "bwd_prep":  # a warp per row of the padded rows
            return (cdiv(cdiv(seqlen_q, self.row_pad) * self.row_pad, PREP_ROWS_PER_BLOCK), nheads, batch)
        if self.tiled:  # a block per 64 x 64 piece
            return (cdiv(seqlen_q, 64) * (head_dim // 64), nheads, batch)
        return (cdiv(seqlen_q * nheads * (head_dim // 8), CONVERT_THREADS), 1, batch)

    def constants(self) -> dict:
        return dict(head_dim=self.head_dim, bf16=self.dtype == "bf16", warps=PREP_ROWS_PER_BLOCK,
                    threads=CONVERT_THREADS, varlen_row_gap=VARLEN_ROW_GAP, tiled=self.tiled, varlen=self.varlen,
                    swizzled=self.swizzled, row_pad=self.row_pad, dq_groups=self.dq_groups)


@dataclass(frozen=True, kw_only=True)
class BwdTileVariant(KernelVariant):
    """A tiled backward kernel: ``bwd_dkdv_dq`` / ``bwd_dkdv`` (a block per key block) or the
    deterministic ``bwd_dq`` (a block per query block). Head-dim columns are always predicated
    (a per-thread compare), so the real head dim never doubles the variant count."""

    family = "bwd"

    kind: str
    head_dim: int
    dtype: str
    block_m: int
    block_n: int
    warps: int
    stages: int
    causal: bool = False
    local: bool = False
    softcap: bool = False
    alibi: bool = False
    mma: str = "sync"
    flashmask: int = 0  # FlashMask bound columns per key (cuflash.masks), 0 = none
    dropout: bool = False  # attention dropout: the forward's mask regenerated (common/dropout.cuh)

    def __post_init__(self):
        super().__post_init__()
        if self.kind not in TILE_KINDS:
            raise ValueError(f"kind must be one of {TILE_KINDS}, got {self.kind!r}")
        self._check_head_dim_dtype()
        self._check_tile()
        if self.mma == "wgmma" and not (
                self.arch == 90 and self.kind in ("bwd_dkdv", "bwd_dkdv_dq") and not (self.softcap or self.alibi)
                and (self.block_n, self.warps, self.stages) == (128, 8, 2)
                and self.block_m * self.head_dim == 128 * 64 and self.head_dim in (64, 128)):
            raise ValueError("a wgmma backward variant is a dK/dV kernel for sm_90 at head-dim bucket 64 or 128 "
                             "with 64-query steps (or 128 at 64) over 128 keys, 8 warps, 2 stages, no softcap "
                             f"or ALiBi; got {self}")
        if self.flashmask and not (self.flashmask in (1, 2) if self.causal else self.flashmask in (2, 4)):
            raise ValueError(f"flashmask must be 0, or 1 or 2 with causal, 2 or 4 without; got {self.flashmask} "
                             f"with causal={self.causal}")
        if self.flashmask and (self.local or self.alibi):
            raise ValueError(f"a FlashMask backward variant has no window and no ALiBi; got {self}")
        if self.dropout and (self.flashmask or self.mma == "wgmma"):
            # The wgmma dK/dV kernel holds S^T and dP^T of 64 keys x its whole step at once: with
            # the Philox words and the sign-encoded P it spills (255 registers, 8-68 B at d = 64
            # and 128 under NVRTC 13.5), and its tiles cannot shrink (block_m * d = 128 * 64).
            raise ValueError(f"a dropout backward variant is an mma.sync kernel with no FlashMask; got {self}")

    @property
    def params(self) -> ParamTable:
        if self.kind == "bwd_dq":
            return DQ_FM_PARAMS if self.flashmask else DQ_DROPOUT_PARAMS if self.dropout else DQ_PARAMS
        return DKDV_FM_PARAMS if self.flashmask else DKDV_DROPOUT_PARAMS if self.dropout else DKDV_PARAMS

    @functools.cached_property
    def name(self) -> str:
        return tile_name(self.kind, self.head_dim, self.dtype, causal=self.causal, local=self.local,
                         softcap=self.softcap, alibi=self.alibi, even_head_dim=False, mma=self.mma,
                         kv="dense", block_m=self.block_m, block_n=self.block_n, warps=self.warps,
                         stages=self.stages, arch=self.arch, flashmask=self.flashmask, dropout=self.dropout)

    @property
    def template(self) -> str:
        if self.kind == "bwd_dq":
            return "bwd/dq.cu.j2"
        return "bwd/dkdv_wgmma.cu.j2" if self.mma == "wgmma" else "bwd/dkdv.cu.j2"

    @property
    def swizzled(self) -> bool:
        """wgmma reads 128-byte-swizzled tiles; the mma.sync kernels pad rows."""
        return self.mma == "wgmma"

    @property
    def smem_bytes(self) -> int:
        """Mirrors kSmemBytes in the template: K and V tiles, Q and dO per stage, the dS^T tile
        for dQ ([key][query]), LSE and D per stage, and the per-block scalars; the dQ kernel: Q,
        dO, and K and V per stage."""
        pad = 0 if self.swizzled else 8
        row = (self.head_dim + pad) * 2
        if self.kind == "bwd_dq":
            return 2 * self.block_m * row + 2 * self.stages * self.block_n * row
        ds = self.block_n * (self.block_m + pad) * 2 if self.kind == "bwd_dkdv_dq" else 0
        return (2 * self.block_n * row + 2 * self.stages * self.block_m * row + ds
                + 2 * self.stages * self.block_m * 4 + INFO_BYTES)

    @property
    def row_pad(self) -> int:
        """Rows of LSE, D and the dQ accumulator per head are padded to a multiple of this (as
        BwdWsVariant.row_pad): ROW_PAD, a multiple of every block_m here."""
        return ROW_PAD

    def grid(self, batch: int, seqlen_q: int, seqlen_k: int, nheads: int, nheads_k: int) -> tuple[int, int, int]:
        if self.kind == "bwd_dq":
            return (cdiv(seqlen_q, self.block_m), nheads, batch)
        return (cdiv(seqlen_k, self.block_n), nheads_k, batch)

    def constants(self) -> dict:
        return dict(head_dim=self.head_dim, block_m=self.block_m, block_n=self.block_n, warps=self.warps,
                    stages=self.stages, causal=self.causal, local=self.local, softcap=self.softcap,
                    alibi=self.alibi, bf16=self.dtype == "bf16", dq=self.kind == "bwd_dkdv_dq",
                    even_head_dim=False, swizzle=self.swizzled, varlen_row_gap=VARLEN_ROW_GAP, info_bytes=INFO_BYTES,
                    flashmask=self.flashmask, dropout=self.dropout)


def kernels(bucket: int, dtype: str, causal: bool, deterministic: bool, arch: int, local: bool = False,
            softcap: bool = False, alibi: bool = False, flashmask: int = 0,
            dropout: bool = False) -> tuple[KernelVariant, ...]:
    """The kernels one backward call launches, in launch order. ``causal``/``local`` are the
    mask as launched (a window that hides no key beyond the causal mask runs as causal);
    ``flashmask`` is the FlashMask bound columns per key (0 = none), whose prep kernels
    (kernels/flashmask.py) the plan adds; ``dropout``: attention dropout (same tiles)."""
    bm, bn, w, st, mma = (DKDV_FLASHMASK_SOFTCAP_TILES[bucket] if flashmask and softcap
                          and bucket in DKDV_FLASHMASK_SOFTCAP_TILES else dkdv_tile(bucket, softcap, alibi, arch))
    if dropout and mma == "wgmma":  # the wgmma kernel has no registers for dropout (BwdTileVariant)
        bm, bn, w, st, mma = DKDV_TILES[bucket]
    mods = dict(head_dim=bucket, dtype=dtype, arch=arch, causal=causal, local=local, softcap=softcap, alibi=alibi)
    if flashmask:
        mods["flashmask"] = flashmask
    if dropout:
        mods["dropout"] = True
    prep = BwdRowVariant(kind="bwd_prep", head_dim=bucket, dtype=dtype, arch=arch)
    if deterministic:
        qm, qn, qw, qst = (DQ_FLASHMASK_SOFTCAP_TILES.get(bucket, DQ_TILES[bucket]) if flashmask and softcap
                           else DQ_DROPOUT_TILES.get(bucket, DQ_TILES[bucket]) if dropout else DQ_TILES[bucket])
        return (prep, BwdTileVariant(kind="bwd_dkdv", block_m=bm, block_n=bn, warps=w, stages=st, mma=mma, **mods),
                BwdTileVariant(kind="bwd_dq", block_m=qm, block_n=qn, warps=qw, stages=qst, **mods))
    return (prep, BwdTileVariant(kind="bwd_dkdv_dq", block_m=bm, block_n=bn, warps=w, stages=st, mma=mma, **mods),
            BwdRowVariant(kind="bwd_convert", head_dim=bucket, dtype=dtype, arch=arch))


MASKS = ((False, False), (True, False), (False, True))  # (causal, local)
MODS = ((False, False), (True, False), (False, True), (True, True))  # (softcap, alibi)


def variants(arch: int, mods: bool = True) -> list[KernelVariant]:
    """Every backward variant that can launch on ``arch``: per head-dim bucket and dtype, every
    mask (full, causal, sliding window) with and without softcap and ALiBi, atomic and
    deterministic. ``mods=False`` leaves out the window, softcap and ALiBi variants."""
    out = []
    for bucket in HEAD_DIM_BUCKETS:
        for dtype in ("fp16", "bf16"):
            for causal, local in MASKS if mods else MASKS[:2]:
                for softcap, alibi in MODS if mods else MODS[:1]:
                    for det in (False, True):
                        out.extend(kernels(bucket, dtype, causal, det, arch, local, softcap, alibi))
    if mods:
        out += flashmask_variants(arch)
        out += dropout_variants(arch)
    return list(dict.fromkeys(out))


def dropout_variants(arch: int) -> list[KernelVariant]:
    """The dropout backward kernels: every mask, softcap and ALiBi, atomic and deterministic."""
    out = []
    for bucket in HEAD_DIM_BUCKETS:
        for dtype in ("fp16", "bf16"):
            for causal, local in MASKS:
                for softcap, alibi in MODS:
                    for det in (False, True):
                        out.extend(v for v in kernels(bucket, dtype, causal, det, arch, local, softcap, alibi,
                                                      dropout=True) if getattr(v, "dropout", False))
    return list(dict.fromkeys(out))


def flashmask_variants(arch: int) -> list[KernelVariant]:
    """The FlashMask backward kernels: per head-dim bucket and dtype, causal with n in (1, 2) or
    not with n in (2, 4), with and without softcap, atomic and deterministic (no window, no
    ALiBi: FlashMask rejects them)."""
    out = []
    for bucket in HEAD_DIM_BUCKETS:
        for dtype in ("fp16", "bf16"):
            for n in FLASHMASK_NS:
                for causal in (c for c in (False, True) if n in ((1, 2) if c else (2, 4))):
                    for softcap in (False, True):
                        for det in (False, True):
                            out.extend(kernels(bucket, dtype, causal, det, arch, softcap=softcap, flashmask=n))
    return list(dict.fromkeys(out))
