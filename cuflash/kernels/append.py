"""Append family (templates/append/): writes new K/V rows into a contiguous or paged KV cache in
place, at each sequence's current length, dropping rows past the cache's capacity. Rows are
copied as 16-byte chunks where every row is 16-byte aligned, element by element otherwise (head
dims that are not a multiple of 8). Rotary variants also rotate the new K rows by the rotary
embedding before writing them, and Q into a scratch copy (flash-attn's rotary_cos/rotary_sin)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from . import DTYPES, KernelVariant
from .params import ParamTable, strides

THREADS = 256  # one thread per 8-element chunk of a (sequence, row, head) of K and of V (or of Q)
CACHES = ("cache", "paged")
ROTARY = {"": 0, "interleaved": 1, "neox": 2}  # GPT-J pairs (0, 1), (2, 3) ... / GPT-NeoX halves

PARAMS = ParamTable("AppendParams", (
    ("k_new", "const u16*"), ("v_new", "const u16*"), ("k_cache", "u16*"), ("v_cache", "u16*"),
    *strides("kn", "sb", "ss", "sh"), *strides("vn", "sb", "ss", "sh"),
    *strides("kc", "sb", "ss", "sh"), *strides("vc", "sb", "ss", "sh"),
    ("batch", "int"), ("seqlen_new", "int"), ("nheads_k", "int"), ("head_dim", "int"),
    ("seqlens", "const int*"), ("seqlen0", "int"), ("kv_batch_idx", "const int*"),
    ("block_table", "const int*"), ("block_table_stride", "int"), ("page_size", "int"),
    ("capacity", "int"), ("vec", "int"),
    # rotary variants: the tables (seqlen_ro, rotary_dim / 2) and Q -> q_rot
    ("rotary_cos", "const u16*"), ("rotary_sin", "const u16*"), ("rotary_dim", "int"), ("seqlen_ro", "int"),
    ("q", "const u16*"), ("q_rot", "u16*"), *strides("q", "sb", "ss", "sh"), *strides("qr", "sb", "ss", "sh"),
    ("seqlen_q", "int"), ("nheads", "int"), ("q_rowwise", "int"),
    ("ro_seqlens", "const int*"),  # rotary positions' start per sequence (null: the cache position's)
    # packed new rows (cu_new non-null): k_new/v_new rows cu_new[b] ... cu_new[b + 1] - 1 are
    # sequence b's (seqlen_new: the rows), and seqlens_out[b] gets sequence b's cache length
    # after the append
    ("cu_new", "const int*"), ("seqlens_out", "int*"),
))


@dataclass(frozen=True, kw_only=True)
class AppendVariant(KernelVariant):
    family = "append"
    params = PARAMS

    kv: str  # "cache" (contiguous) or "paged"
    rotary: str = ""  # "", "interleaved" or "neox"
    dtype: str = ""   # the element type of a rotary variant (its arithmetic); "" without rotary

    def __post_init__(self):
        super().__post_init__()
        if self.kv not in CACHES:
            raise ValueError(f"kv must be one of {CACHES}, got {self.kv!r}")
        if self.rotary not in ROTARY:
            raise ValueError(f"rotary must be one of {tuple(ROTARY)}, got {self.rotary!r}")
        if (self.dtype in DTYPES) != bool(self.rotary):
            raise ValueError(f"a rotary append variant has a dtype in {DTYPES}, a plain one none; got "
                             f"rotary={self.rotary!r} dtype={self.dtype!r}")

    @functools.cached_property
    def name(self) -> str:
        rot = f"_rotary_{self.rotary}_{self.dtype}" if self.rotary else ""
        return f"append_{self.kv}{rot}_sm{self.arch}"

    @property
    def template(self) -> str:
        return "append/append.cu.j2"

    @property
    def threads(self) -> int:
        return THREADS

    def grid(self, chunks: int) -> tuple[int, int, int]:
        return (-(-chunks // THREADS), 1, 1)

    def constants(self) -> dict:
        return dict(paged=self.kv == "paged", threads=THREADS, rotary=ROTARY[self.rotary], bf16=self.dtype == "bf16")


def variants(arch: int, mods: bool = True) -> list[AppendVariant]:
    return [AppendVariant(kv=kv, arch=arch) for kv in CACHES] + [
        AppendVariant(kv=kv, rotary=r, dtype=dt, arch=arch) for kv in CACHES for r in ("interleaved", "neox")
        for dt in DTYPES]
