"""Append family (templates/append/): writes new K/V rows into a contiguous or paged KV cache in
place, at each sequence's current length. Rows are copied as raw 16-byte chunks, so one kernel
serves every head dim (a multiple of 8) and dtype."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from . import KernelVariant
from .params import ParamTable, strides

THREADS = 256  # one thread per 16-byte chunk of a (sequence, row, head) of K and of V
CACHES = ("cache", "paged")

PARAMS = ParamTable("AppendParams", (
    ("k_new", "const u16*"), ("v_new", "const u16*"), ("k_cache", "u16*"), ("v_cache", "u16*"),
    *strides("kn", "sb", "ss", "sh"), *strides("vn", "sb", "ss", "sh"),
    *strides("kc", "sb", "ss", "sh"), *strides("vc", "sb", "ss", "sh"),
    ("batch", "int"), ("seqlen_new", "int"), ("nheads_k", "int"), ("head_dim", "int"),
    ("seqlens", "const int*"), ("seqlen0", "int"), ("kv_batch_idx", "const int*"),
    ("block_table", "const int*"), ("block_table_stride", "int"), ("page_size", "int"),
))


@dataclass(frozen=True, kw_only=True)
class AppendVariant(KernelVariant):
    family = "append"
    params = PARAMS

    kv: str  # "cache" (contiguous) or "paged"

    def __post_init__(self):
        super().__post_init__()
        if self.kv not in CACHES:
            raise ValueError(f"kv must be one of {CACHES}, got {self.kv!r}")

    @functools.cached_property
    def name(self) -> str:
        return f"append_{self.kv}_sm{self.arch}"

    @property
    def template(self) -> str:
        return "append/append.cu.j2"

    @property
    def threads(self) -> int:
        return THREADS

    def grid(self, chunks: int) -> tuple[int, int, int]:
        return (-(-chunks // THREADS), 1, 1)

    def constants(self) -> dict:
        return dict(paged=self.kv == "paged", threads=THREADS)


def variants(arch: int, mods: bool = True) -> list[AppendVariant]:
    return [AppendVariant(kv=kv, arch=arch) for kv in CACHES]
