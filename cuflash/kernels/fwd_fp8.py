"""FP8 (e4m3) forward for Hopper (templates/fwd_fp8/, sm_90a): fwd_ws's warp-specialised kernel
with e4m3 wgmma products (k32) and FlashAttention-3's per-(batch, KV head) descales, out bf16.

8-bit wgmma operands must both be K-major, so the product O += P V reads V^T: ``VtVariant``
writes V transposed to (batch, heads_k, d, keys_pad) (keys_pad = seqlen_k rounded up to 128),
its keys permuted within groups of 32 into the order in which P's accumulator fragment holds
them (the templates say how), so P goes from the softmax to the product without shuffles. That
copy is one pass over V (a few microseconds against a prefill's milliseconds), made per call.

``run`` launches both on (batch, seqlen, heads, d) PyTorch float8_e4m3fn tensors; cuflash.attention
calls it for e4m3 inputs.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from . import KernelVariant
from .fwd_ws import LPT_BYTES, MAX_CONSUMER_REGS, MAX_SMEM, PRODUCER_REGS, tensor_map
from .params import TENSOR_MAP_BYTES, ParamTable, strides

HEAD_DIMS = (64, 128, 256)  # Q and K rows: 64 bytes (the 64-byte swizzle) or 128-byte blocks
BLOCK_M, STAGES = 128, 2
KEY_PAD = 128  # V^T's key dim is padded to this (its TMA boxes are 128 keys wide)
MAX_STAGES = 4
BARRIER_BYTES = 8 * (1 + 4 * MAX_STAGES)  # Q full; per stage K/V full and empty (the template asserts it fits)

PARAMS = ParamTable("FwdFp8Params", (
    ("tma_q", "CUtensorMap"), ("tma_k", "CUtensorMap"), ("tma_vt", "CUtensorMap"),
    ("o", "void*"), ("lse", "float*"),
    *strides("o", "sb", "ss", "sh"), *strides("lse", "sb", "sh", "sr"),
    ("q_descale", "const float*"), *strides("q_descale", "sb", "sh"),
    ("k_descale", "const float*"), *strides("k_descale", "sb", "sh"),
    ("v_descale", "const float*"), *strides("v_descale", "sb", "sh"),
    ("seqlen_q", "int"), ("seqlen_k", "int"), ("ngroups", "int"),
    ("scale_log2", "float"),
))

VT_PARAMS = ParamTable("VtParams", (
    ("v", "const void*"), *strides("v", "sb", "ss", "sh"), ("vt", "void*"),
    ("seqlen_k", "int"), ("heads_k", "int"), ("keys_pad", "int"),
))


@dataclass(frozen=True, kw_only=True)
class FwdFp8Variant(KernelVariant):
    """One FP8 forward kernel (``kind="fwd_fp8"``)."""

    family = "fwd_fp8"
    kind: ClassVar[str] = "fwd_fp8"
    params: ClassVar[ParamTable] = PARAMS
    dtype: ClassVar[str] = "e4m3"

    head_dim: int
    causal: bool = False
    block_n: int = 128
    stages: int = STAGES
    overlap: bool = True
    pingpong: bool = True
    # Causal: tiles in FlashAttention-3's LPT order (fwd_ws's, over L2 sections of LPT_BYTES).
    lpt: bool = False
    # O rescaled only when a row of the warp has a new running maximum (bitwise the same output).
    lazy_rescale: bool = False
    # A row's running maximum moves only when it grows by more than this many powers of 2 (0:
    # always), so that O is rescaled rarely (P then stays below 2^rescale_slack; e4m3 holds 448).
    rescale_slack: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.arch != 90:
            raise ValueError(f"fwd_fp8 is a Hopper kernel (sm_90a): arch must be 90, got {self.arch!r}")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {self.head_dim!r}")
        for f in ("causal", "overlap", "pingpong", "lpt", "lazy_rescale"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"{f} must be a bool, got {getattr(self, f)!r}")
        if not isinstance(self.rescale_slack, int) or isinstance(self.rescale_slack, bool) or not 0 <= self.rescale_slack <= 8:
            raise ValueError(f"rescale_slack must be an int in 0..8 (P < 2^8 fits e4m3), got {self.rescale_slack!r}")
        if self.lpt and not self.causal:
            raise ValueError("lpt orders causal tiles: it needs causal=True")
        if self.block_n != 128:  # (256 ran 4-6% slower without the overlap and spills with it: not kept)
            raise ValueError(f"block_n must be 128 (V^T tiles of one 128-byte row of keys), got {self.block_n!r}")
        if not isinstance(self.stages, int) or isinstance(self.stages, bool) or not 2 <= self.stages <= MAX_STAGES:
            raise ValueError(f"stages must be an int in 2..{MAX_STAGES}, got {self.stages!r}")
        if self.smem_bytes > MAX_SMEM:
            raise ValueError(f"{self.name} needs {self.smem_bytes} B of shared memory, more than {MAX_SMEM}")

    @functools.cached_property
    def name(self) -> str:
        sched = ("_overlap" if self.overlap else "") + ("_pingpong" if self.pingpong else "") + (
            "_lpt" if self.lpt else "") + ("_lazy" if self.lazy_rescale else "") + (
            f"_slack{self.rescale_slack}" if self.rescale_slack else "")
        return (f"fwd_fp8_d{self.head_dim}_e4m3_{'causal' if self.causal else 'full'}"
                f"_m{BLOCK_M}n{self.block_n}s{self.stages}{sched}_sm{self.arch}")

    @property
    def template(self) -> str:
        return "fwd_fp8/fwd_fp8.cu.j2"

    @property
    def target(self) -> str:
        return "90a"

    @property
    def threads(self) -> int:
        return 128 * 3  # the producer warpgroup, two consumer warpgroups

    @property
    def consumer_regs(self) -> int:
        pool = 65536 // self.threads // 8 * 8 * self.threads
        return min(MAX_CONSUMER_REGS, (pool - 128 * PRODUCER_REGS) // 256 // 8 * 8)

    @property
    def smem_bytes(self) -> int:
        """Q, kStages K and V^T tiles (1-byte elements), the mbarriers."""
        return (BLOCK_M + 2 * self.stages * self.block_n) * self.head_dim + BARRIER_BYTES

    def grid(self, batch: int, seqlen_q: int, nheads: int) -> tuple[int, int, int]:
        return (math.ceil(seqlen_q / BLOCK_M), nheads, batch)

    def constants(self) -> dict:
        return dict(head_dim=self.head_dim, block_m=BLOCK_M, block_n=self.block_n, stages=self.stages,
                    causal=self.causal, overlap=self.overlap, pingpong=self.pingpong, lpt=self.lpt,
                    lazy_rescale=self.lazy_rescale, rescale_slack=self.rescale_slack, lpt_bytes=LPT_BYTES,
                    producer_regs=PRODUCER_REGS, consumer_regs=self.consumer_regs, barrier_bytes=BARRIER_BYTES)


@dataclass(frozen=True, kw_only=True)
class VtVariant(KernelVariant):
    """V^T for the FP8 forward (``kind="fp8_vt"``): one block per (32 keys, KV head, batch)."""

    family = "fwd_fp8"
    kind: ClassVar[str] = "fp8_vt"
    params: ClassVar[ParamTable] = VT_PARAMS
    dtype: ClassVar[str] = "e4m3"

    head_dim: int

    def __post_init__(self):
        super().__post_init__()
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {self.head_dim!r}")

    @functools.cached_property
    def name(self) -> str:
        return f"fp8_vt_d{self.head_dim}_sm{self.arch}"

    @property
    def template(self) -> str:
        return "fwd_fp8/vt.cu.j2"

    @property
    def threads(self) -> int:
        return self.head_dim

    def grid(self, batch: int, seqlen_k: int, heads_k: int) -> tuple[int, int, int]:
        return (keys_pad(seqlen_k) // 32, heads_k, batch)

    def constants(self) -> dict:
        return dict(head_dim=self.head_dim)


@functools.lru_cache(maxsize=None)
def _vt_variant(head_dim: int) -> VtVariant:
    return VtVariant(head_dim=head_dim, arch=90)


def keys_pad(seqlen_k: int) -> int:
    """V^T's key dim: seqlen_k rounded up to KEY_PAD."""
    return max(1, math.ceil(seqlen_k / KEY_PAD)) * KEY_PAD


def planned_fields(head_dim: int, causal: bool) -> dict:
    """The planned variant's fields beyond head dim, mask and arch (H200, BENCHMARKS.md): at d=64
    the lazy rescale (+2 to +10% from 2k keys; the LPT order gained nothing); at d=128 the
    rescale slack of 8 with the lazy rescale (+1 to +4% over exact rescaling), and causal tiles in
    the LPT order (with both: causal -3 to +5%, +5% at 8k keys, +2% at 16k); at d=256 the LPT order
    for causal tiles (+2 to +10% at 2k-8k keys), and exact rescaling (the lazy one lost 2-8%)."""
    if head_dim == 64:
        return dict(lazy_rescale=True)
    if head_dim == 128:
        return dict(lazy_rescale=True, rescale_slack=8, lpt=causal)
    return dict(lpt=causal)


@functools.lru_cache(maxsize=None)
def planned(head_dim: int, causal: bool, arch: int = 90) -> FwdFp8Variant:
    """The variant the planner runs for e4m3 inputs of this head dim and mask."""
    return FwdFp8Variant(head_dim=head_dim, causal=causal, arch=arch, **planned_fields(head_dim, causal))


def variants(arch: int, mods: bool = True) -> list[KernelVariant]:
    """The FP8 kernels cuflash.attention can launch on ``arch`` (sm_90 only; ``mods`` has no effect: they
    have no score modifiers)."""
    if arch != 90:
        return []
    return ([planned(d, c, arch) for d in HEAD_DIMS for c in (False, True)]
            + [VtVariant(head_dim=d, arch=arch) for d in HEAD_DIMS])


# ---------------------------------------------------------------------------------------------
# Launch (GPU)

_LOG2E = 1.4426950408889634


def _descale_fields(name: str, x) -> dict:
    """A (batch, heads_k) float32 descale's pointer and strides (broadcast dims stride 0), or null."""
    if x is None:
        return {name: 0, f"{name}_sb": 0, f"{name}_sh": 0}
    sb, sh = x.strides
    return {name: x.ptr, f"{name}_sb": sb if x.shape[0] > 1 else 0, f"{name}_sh": sh if x.shape[1] > 1 else 0}


class Recipe(NamedTuple):
    """An FP8 call's two launches (V^T copy, forward) with every argument but the data pointers
    worked out: what a repeated call with the same shapes, strides and options reuses (fire)."""
    variant: FwdFp8Variant
    vt_kernel: object
    vt_grid: tuple
    vt_block: tuple
    vt_values: tuple   # VtParams' fields in order (v and vt given to fire)
    kernel: object
    grid: tuple
    block: tuple
    smem: int
    values: tuple      # FwdFp8Params' fields in order (the maps, o, lse and descale pointers given to fire)
    maps: tuple        # (shape, strides, box rows, box bytes) of Q's, K's and V^T's tensor maps
    vt_bytes: int      # V^T's scratch: b * hk * d * keys_pad(sk) bytes


# The fields fire fills per call, by name: V^T's source and scratch; Q's, K's and V^T's tensor
# maps, the output, the LSE and the three descales.
_VT_POINTERS = tuple(VT_PARAMS.index(n) for n in ("v", "vt"))
_POINTERS = tuple(PARAMS.index(n) for n in ("tma_q", "tma_k", "tma_vt", "o", "lse", "q_descale", "k_descale",
                                            "v_descale"))
_NO_MAP = bytes(TENSOR_MAP_BYTES)


def prepare(qv, kv, vv, ov, lse_strides: tuple, scale: float, causal: bool, descales: tuple, device: int) -> Recipe:
    """The launches on views (cuflash.arrays.View) already checked: q (b, sq, h, d), k, v (b, sk,
    hk, d) e4m3 with contiguous last dims and 16-byte-aligned rows, o bf16 like q, ``descales``
    three (batch or 1, heads_k or 1) float32 views or None (their strides; pointers go to fire)."""
    from .. import compiler
    b, sq, h, d = qv.shape
    sk, hk = kv.shape[1], kv.shape[2]
    kp = keys_pad(sk)
    variant, vt_variant = planned(d, causal), _vt_variant(d)
    qd, kd, vd = descales
    vt_values = VT_PARAMS.values(v=0, v_sb=vv.strides[0], v_ss=vv.strides[1], v_sh=vv.strides[2], vt=0, seqlen_k=sk,
                                 heads_k=hk, keys_pad=kp)
    values = PARAMS.values(
        tma_q=_NO_MAP, tma_k=_NO_MAP, tma_vt=_NO_MAP, o=0, lse=0,
        o_sb=ov.strides[0], o_ss=ov.strides[1], o_sh=ov.strides[2],
        lse_sb=lse_strides[0], lse_sh=lse_strides[1], lse_sr=lse_strides[2],
        **_descale_fields("q_descale", qd), **_descale_fields("k_descale", kd), **_descale_fields("v_descale", vd),
        seqlen_q=sq, seqlen_k=sk, ngroups=h // hk, scale_log2=scale * _LOG2E)
    maps = ((tuple(qv.shape), tuple(qv.strides), BLOCK_M, min(d, 128)),
            (tuple(kv.shape), tuple(kv.strides), variant.block_n, min(d, 128)),
            ((b, d, hk, kp), (hk * d * kp, kp, d * kp, 1), d, 128))
    return Recipe(variant, compiler.get_kernel(vt_variant, device), (*vt_variant.grid(b, sk, hk),),
                  (vt_variant.threads, 1, 1), vt_values, compiler.get_kernel(variant, device),
                  (*variant.grid(b, sq, h),), (variant.threads, 1, 1), variant.smem_bytes, values, maps,
                  b * hk * d * kp)


def fire(r: Recipe, stream: int, q: int, k: int, v: int, o: int, lse: int, vt: int, descales: tuple) -> None:
    """Launch a prepared FP8 call on ``stream`` (a raw pointer) for these data pointers; ``vt``:
    r.vt_bytes of scratch; ``descales``: the three descale pointers (0 for none)."""
    vt_values = list(r.vt_values)
    for i, ptr in zip(_VT_POINTERS, (v, vt)):
        vt_values[i] = ptr
    r.vt_kernel.launch(r.vt_grid, r.vt_block, 0, stream, tuple(vt_values))
    mq, mk, mv = r.maps
    values = list(r.values)
    for i, x in zip(_POINTERS, (tensor_map(q, *mq[:3], "e4m3", mq[3]), tensor_map(k, *mk[:3], "e4m3", mk[3]),
                                tensor_map(vt, *mv[:3], "e4m3", mv[3]), o, lse, *descales)):
        values[i] = x
    r.kernel.launch(r.grid, r.block, r.smem, stream, values)


