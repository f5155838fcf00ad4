"""Combine family (templates/combine/): merges the fp32 partial outputs and LSEs of a split-KV
forward by log-sum-exp, when the split kernel cannot merge them itself (a first call inside a
CUDA graph capture, where no merge counters can be made, or CUFLASH_FUSED_COMBINE=0)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from . import HEAD_DIM_BUCKETS, KernelVariant
from .params import ParamTable, strides

ROWS_PER_BLOCK = 4  # output rows per block: 128 threads, four columns of a row each
WARPS = 4

PARAMS = ParamTable("CombineParams", (
    ("o_acc", "const float*"), ("lse_acc", "const float*"), ("o", "u16*"), ("lse", "float*"),
    *strides("o", "sb", "ss", "sh"),
    ("rows", "int"), ("nheads", "int"), ("seqlen_q", "int"), ("head_dim", "int"), ("num_splits", "int"),
    ("cu_seqlens_q", "const int*"), ("q_rows_per_token", "int"),
    *strides("lse", "sb", "sh", "sr"),
))


@dataclass(frozen=True, kw_only=True)
class CombineVariant(KernelVariant):
    family = "combine"
    params = PARAMS

    head_dim: int
    dtype: str

    def __post_init__(self):
        super().__post_init__()
        self._check_head_dim_dtype()

    @functools.cached_property
    def name(self) -> str:
        return f"combine_d{self.head_dim}_{self.dtype}_sm{self.arch}"

    @property
    def template(self) -> str:
        return "combine/combine.cu.j2"

    @property
    def threads(self) -> int:
        return 32 * WARPS

    def grid(self, rows: int) -> tuple[int, int, int]:
        return (-(-rows // ROWS_PER_BLOCK), 1, 1)

    def constants(self) -> dict:
        return dict(head_dim=self.head_dim, bf16=self.dtype == "bf16", warps=WARPS, rows_per_block=ROWS_PER_BLOCK)


def variants(arch: int, mods: bool = True) -> list[CombineVariant]:
    return [CombineVariant(head_dim=b, dtype=t, arch=arch) for b in HEAD_DIM_BUCKETS for t in ("fp16", "bf16")]
