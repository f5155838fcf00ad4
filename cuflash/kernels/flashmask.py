"""FlashMask family (templates/flashmask/). The prep kernel reduces ``startend_row_indices``
(batch, heads, seqlen_k, n) to the min and max of each bound column over every block of
``block_n`` keys (the forward's K/V tile), so that the attention kernels can classify a (query
block, key block) tile as skipped, masked element by element, or unmasked from 4n ints (the
paper's Algorithm 1; cuflash.plan.tile_classes is the same rule on the host). The order kernel
then sorts each (batch, index head)'s units of the warp-specialised kernels' grids (query tiles,
or key blocks) by the cost of their walks, longest first, and those kernels take their units in
that order."""
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


ORDER_PARAMS = ParamTable("FlashMaskOrderParams", (
    ("blocks", "const int*"), ("order", "int*"), ("seqlen_q", "int"), ("seqlen_k", "int"), ("block_m", "int"),
    ("block_n", "int"), ("heads", "int"), ("n_blocks", "int"), ("units", "int"),
))
ORDER_THREADS = 512
ORDER_SMEM = 48 * 1024  # the most dynamic shared memory the order kernel takes (no opt-in needed)


@dataclass(frozen=True, kw_only=True)
class FlashMaskOrderVariant(KernelVariant):
    """Grid (index heads, batch); block (h, b) reads the prep kernel's bounds of (b, h) and writes
    a permutation of its units (``by_key``: the backward's key blocks, each walking the query
    blocks of ``block_m`` rows that see it; else the forward's query tiles of ``block_m`` rows,
    each walking the key blocks it sees) to order[(b * heads + h) * units ...], the costliest
    walk first (templates/flashmask/order.cu.j2)."""

    family = "flashmask"
    params = ORDER_PARAMS

    columns: int  # n: 1 or 2 with causal, 2 or 4 without
    causal: bool
    by_key: bool

    def __post_init__(self):
        super().__post_init__()
        if self.columns not in ((1, 2) if self.causal else (2, 4)):
            raise ValueError(f"columns must be 1 or 2 with causal, 2 or 4 without, got columns={self.columns!r}, "
                             f"causal={self.causal!r}")

    @functools.cached_property
    def name(self) -> str:
        return (f"flashmask_order_n{self.columns}{'_causal' if self.causal else ''}_"
                f"{'keys' if self.by_key else 'queries'}_sm{self.arch}")

    @property
    def template(self) -> str:
        return "flashmask/order.cu.j2"

    @property
    def threads(self) -> int:
        return ORDER_THREADS

    @property
    def smem_bytes(self) -> int:
        return ORDER_SMEM

    def grid(self, batch: int, heads: int) -> tuple[int, int, int]:
        return (heads, batch, 1)

    def shared_bytes(self, seqlen_k: int, block_n: int, units: int) -> int:
        """The dynamic shared memory of a launch: the bounds of every key block and a cost per unit."""
        return 4 * (-(-seqlen_k // block_n) * 2 * self.columns + units)

    def constants(self) -> dict:
        return dict(columns=self.columns, causal=self.causal, by_key=self.by_key, threads=ORDER_THREADS)


def variants(arch: int, mods: bool = True) -> list[KernelVariant]:
    if not mods:
        return []
    return [FlashMaskPrepVariant(columns=n, arch=arch) for n in (1, 2, 4)] + [
        FlashMaskOrderVariant(columns=n, causal=c, by_key=k, arch=arch)
        for c in (True, False) for n in ((1, 2) if c else (2, 4)) for k in (False, True)]
