"""Variant -> CUDA C++ source, rendered from the Jinja2 templates in ``templates/``.

Jinja only sets constants and includes the shared partials (fwd_wgmma.cu.j2 and bwd_wgmma.cu.j2
also replace named blocks of fwd.cu.j2 and bwd.cu.j2: the products); all logic is plain CUDA C++.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import jinja2

HEAD_DIM_BUCKETS = (32, 64, 96, 128, 192, 256)
KINDS = ("fwd", "fwd_split", "combine", "append",
         "bwd_prep", "bwd_dkdv", "bwd_dkdv_dq", "bwd_dq", "bwd_convert")
DTYPES = ("fp16", "bf16")
KV_SOURCES = ("dense", "cache", "paged")
MMAS = ("sync", "wgmma")


def templates_dir() -> Path:
    """The installed copy (``cuflash/templates``) or the source tree's top-level ``templates/``."""
    here = Path(__file__).resolve().parent
    for cand in (here / "templates", here.parent / "templates"):
        if (cand / "fwd" / "fwd.cu.j2").is_file():
            return cand
    raise FileNotFoundError(f"cuflash templates not found next to {here}")


@dataclass(frozen=True)
class Variant:
    """One compiled kernel. ``name`` is its extern "C" symbol and the stem of its cache file."""

    kind: str                 # "fwd", "fwd_split" or "combine"
    head_dim: int             # bucket, one of HEAD_DIM_BUCKETS
    dtype: str                # "fp16" or "bf16"
    causal: bool = False
    even_head_dim: bool = False  # the real head dim equals the bucket: no column predicates
    block_m: int = 0
    block_n: int = 0
    warps: int = 4
    arch: int = 90
    stages: int = 1           # K/V shared-memory buffers
    kv: str = "dense"         # K/V source: "dense" tensors, a "cache" with per-batch lengths, "paged" cache
    local: bool = False       # sliding-window mask (window bounds are launch arguments)
    softcap: bool = False     # softcap * tanh(s / softcap) on the scores
    alibi: bool = False       # ALiBi bias -slope * |i + sk - sq - j|
    mma: str = "sync"         # products: warp-level mma.sync, or Hopper's warpgroup wgmma (sm_90a)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.kv not in KV_SOURCES:
            raise ValueError(f"kv must be one of {KV_SOURCES}, got {self.kv!r}")
        if self.local and self.causal:
            raise ValueError("a local variant carries the causal bound as its window's right edge: "
                             "causal must be False")
        if self.mma not in MMAS:
            raise ValueError(f"mma must be one of {MMAS}, got {self.mma!r}")
        if self.mma == "wgmma" and not self._wgmma_fits():
            raise ValueError(
                "a wgmma variant is a forward kernel for sm_90 with a head-dim bucket that is a multiple of "
                "64, 64 query rows per warpgroup (block_m = 16 * warps, warps a multiple of 4) and at least "
                "two K/V stages, or a dK/dV kernel for sm_90 at head-dim bucket 64 or 128 with 64-query "
                f"steps (or 128 at 64) over 128 keys, 8 warps, 2 stages, no softcap or ALiBi; got {self}")
        if self.kind == "append":  # copies 16-byte chunks: no head-dim or dtype specialisation
            return
        if self.head_dim not in HEAD_DIM_BUCKETS:
            raise ValueError(f"head_dim must be one of {HEAD_DIM_BUCKETS}, got {self.head_dim}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")

    def _wgmma_fits(self) -> bool:
        """The shapes the wgmma templates are written for (their static_asserts, checked early)."""
        if self.arch != 90:
            return False
        if self.kind == "fwd":
            return (self.head_dim % 64 == 0 and self.block_m == 16 * self.warps and self.warps % 4 == 0
                    and self.stages >= 2)
        return (self.kind in ("bwd_dkdv", "bwd_dkdv_dq") and not (self.softcap or self.alibi)
                and (self.block_n, self.warps, self.stages) == (128, 8, 2)
                and self.block_m * self.head_dim == 128 * 64 and self.head_dim in (64, 128))

    @functools.cached_property
    def name(self) -> str:
        paged = "" if self.kv == "dense" else f"_{self.kv}"
        if self.kind == "append":
            return f"append{paged}_sm{self.arch}"
        if self.kind == "combine":
            return f"combine_d{self.head_dim}_{self.dtype}_sm{self.arch}"
        if self.kind in ("bwd_prep", "bwd_convert"):  # row kernels: no tile, no mask
            return f"{self.kind}_d{self.head_dim}_{self.dtype}_sm{self.arch}"
        mask = "local" if self.local else ("causal" if self.causal else "full")
        mods = ("_softcap" if self.softcap else "") + ("_alibi" if self.alibi else "")
        even = "" if self.even_head_dim else "_dpred"
        layout = "" if self.mma == "sync" else f"_{self.mma}"
        return (f"{self.kind}_d{self.head_dim}_{self.dtype}_{mask}{mods}{even}{layout}{paged}"
                f"_m{self.block_m}n{self.block_n}w{self.warps}s{self.stages}_sm{self.arch}")

    @property
    def target(self) -> str:
        """The compile target after ``sm_``: wgmma needs the arch-specific ``90a``."""
        return f"{self.arch}a" if self.mma == "wgmma" else str(self.arch)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def swizzled(self) -> bool:
        """Shared tiles in the 128-byte swizzle rather than padded rows: wgmma's, and the decode
        tile's (16 query rows shared by several warps; standard and split-KV kernels) at head-dim
        buckets 64 and 128. Rows then start on 128-byte lines, so no cp.async row is requested
        from L2 twice: on an H100 this took batch-64 decode from 5-6% behind cuDNN to level with
        it. (The split kernel measured slower swizzled until its tiles were 128-byte aligned past
        its static shared memory.)"""
        return self.mma == "wgmma" or (self.kind in ("fwd", "fwd_split") and self.block_m == 16 and self.warps > 1
                                       and self.head_dim in (64, 128))

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: Q tile and K/V tiles per stage, 2-byte elements, in rows of d + 8
        (padded) or d (swizzled)."""
        if self.kind in ("combine", "append"):
            return 0
        if self.swizzled:  # the output staging (padded rows) fits in the tiles
            return (self.block_m + 2 * self.block_n * self.stages) * self.head_dim * 2
        return (self.block_m + 2 * self.block_n * self.stages) * (self.head_dim + 8) * 2


@functools.lru_cache(maxsize=None)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )


@functools.lru_cache(maxsize=None)
def render(variant: Variant) -> str:
    """CUDA C++ source of one variant."""
    template = {"combine": "combine/combine.cu.j2", "append": "append/append.cu.j2",
                "bwd_prep": "bwd/prep.cu.j2", "bwd_dkdv": "bwd/dkdv.cu.j2", "bwd_dkdv_dq": "bwd/dkdv.cu.j2",
                "bwd_dq": "bwd/dq.cu.j2", "bwd_convert": "bwd/convert.cu.j2"}.get(variant.kind, "fwd/fwd.cu.j2")
    if variant.mma == "wgmma":
        template = "bwd/dkdv_wgmma.cu.j2" if variant.kind.startswith("bwd") else "fwd/fwd_wgmma.cu.j2"
    return _environment().get_template(template).render(
        name=variant.name,
        head_dim=variant.head_dim,
        block_m=variant.block_m,
        block_n=variant.block_n,
        warps=variant.warps,
        stages=variant.stages,
        causal=variant.causal,
        local=variant.local,
        softcap=variant.softcap,
        alibi=variant.alibi,
        split=variant.kind == "fwd_split",
        bf16=variant.dtype == "bf16",
        even_head_dim=variant.even_head_dim,
        kv_cache=variant.kv != "dense",
        paged=variant.kv == "paged",
        swizzle=variant.swizzled,
    )
