"""FlashMask family (templates/flashmask/): the prep kernel of a FlashMask forward. It reduces
``startend_row_indices`` (batch, heads, seqlen_k, n) to the min and max of each bound column over
every block of ``block_n`` keys (the forward's K/V tile), so that the forward can classify a
(query block, key block) tile as skipped, masked element by element, or unmasked from 4n ints
(the paper's Algorithm 1; cuflash.plan.tile_classes is the same rule on the host)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from . import KernelVariant
from .params import ParamTable, strides

WARPS = 1  # one warp per key block: its lanes stride over the block's keys

PARAMS = ParamTable("FlashMaskPrepParams", (
    ("idx", "const int*"), *strides("idx", "sb", "sh", "ss", "sc"),
    ("out", "int*"), ("seqlen_k", "int"), ("block_n", "int"), ("heads", "int"),
))


@dataclass(frozen=True, kw_only=True)
class FlashMaskPrepVariant(KernelVariant):
    """Grid (key blocks, index heads, batch); block (b, h, nb) writes out[((b * heads + h) *
    n_blocks + nb) * 2n + 2c + {0: min, 1: max}] for column c, over keys nb * block_n ... that are
    < seqlen_k."""

    family = "flashmask"
    params = PARAMS

    columns: int  # n: 1, 2 or 4

    def __post_init__(self):
        super().__post_init__()
        if self.columns not in (1, 2, 4):
            raise ValueError(f"columns must be 1, 2 or 4, got {self.columns!r}")

    @functools.cached_property
    def name(self) -> str:
        return f"flashmask_prep_n{self.columns}_sm{self.arch}"

    @property
    def template(self) -> str:
        return "flashmask/prep.cu.j2"

    @property
    def threads(self) -> int:
        return 32 * WARPS

    def grid(self, batch: int, heads: int, seqlen_k: int, block_n: int) -> tuple[int, int, int]:
        return (-(-seqlen_k // block_n), heads, batch)

    def workspace_ints(self, batch: int, heads: int, seqlen_k: int, block_n: int) -> int:
        return batch * heads * -(-seqlen_k // block_n) * 2 * self.columns

    def constants(self) -> dict:
        return dict(columns=self.columns)


def variants(arch: int, mods: bool = True) -> list[FlashMaskPrepVariant]:
    return [FlashMaskPrepVariant(columns=n, arch=arch) for n in (1, 2, 4)] if mods else []
