"""Kernel families. Each family is one module here and one template folder in ``templates/``:

| module | templates | kernels |
| --- | --- | --- |
| ``fwd.py`` | ``fwd/`` | forward and split-KV forward (mma.sync, and wgmma on sm_90a) |
| ``combine.py`` | ``combine/`` | log-sum-exp merge of split-KV partials |
| ``append.py`` | ``append/`` | KV-cache append (contiguous and paged caches) |
| ``bwd.py`` | ``bwd/`` | backward: prep (D, LSE), dK/dV(+dQ), deterministic dQ, dQ convert |
| ``flashmask.py`` | ``flashmask/`` | FlashMask prep: per-key-block min and max of ``startend_row_indices`` |
| ``fwd_ws.py`` | ``fwd_ws/`` | warp-specialised Hopper forward (TMA + mbarriers + wgmma, sm_90a); compiled and warmed up, not yet selected by the planner |
| ``fwd_fp8.py`` | ``fwd_fp8/`` | FP8 (e4m3) Hopper forward (fwd_ws's design with k32 e4m3 products) and its V^T copy |

A family module owns its keyword-only variant classes (the compile-time choices and the variant's
name, template, threads and shared memory), its tile tables, and its kernels' parameter tables
(``params.ParamTable``: the CUDA struct and the host packing). ``KernelVariant`` is their base.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

from .params import ParamTable

HEAD_DIM_BUCKETS = (32, 64, 96, 128, 192, 256)
DTYPES = ("fp16", "bf16")
MIN_ARCH = 80  # cp.async and mma.sync with bf16
MMAS = ("sync", "wgmma")  # warp-level mma.sync, or Hopper's warpgroup wgmma (sm_90a)
FAMILIES = ("fwd", "combine", "append", "bwd", "fwd_ws", "bwd_ws", "flashmask", "fwd_fp8")  # all_variants' default: every family


def head_dim_bucket(d: int) -> int:
    """The compiled head-dim bucket that holds head dim ``d``."""
    for b in HEAD_DIM_BUCKETS:
        if d <= b:
            return b
    raise ValueError(f"head dim must be at most {HEAD_DIM_BUCKETS[-1]}, got {d}")


@dataclass(frozen=True, kw_only=True)
class KernelVariant:
    """One compiled kernel. ``name`` is its extern "C" symbol and the stem of its cache file."""

    arch: int
    family: ClassVar[str]
    params: ClassVar[ParamTable]

    def __post_init__(self):
        if not isinstance(self.arch, int) or isinstance(self.arch, bool) or self.arch < MIN_ARCH:
            raise ValueError(f"arch must be an int >= {MIN_ARCH} (sm_{MIN_ARCH} or newer), got {self.arch!r}")

    def _check_head_dim_dtype(self):
        if self.head_dim not in HEAD_DIM_BUCKETS:
            raise ValueError(f"head_dim must be one of {HEAD_DIM_BUCKETS}, got {self.head_dim!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")

    def _check_tile(self):
        """A tiled attention kernel's choices: a known product, a mask that is causal or local
        (not both), and a positive tile."""
        if self.mma not in MMAS:
            raise ValueError(f"mma must be one of {MMAS}, got {self.mma!r}")
        if self.local and self.causal:
            raise ValueError("a local variant carries the causal bound as its window's right edge: "
                             "causal must be False")
        for f in ("block_m", "block_n", "warps", "stages"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise ValueError(f"{f} must be a positive int, got {getattr(self, f)!r}")

    @functools.cached_property
    def name(self) -> str:
        raise NotImplementedError

    @property
    def template(self) -> str:
        """The Jinja template, relative to ``templates/``."""
        raise NotImplementedError

    def constants(self) -> dict:
        """The values the template renders (compile-time constants only)."""
        raise NotImplementedError

    @property
    def target(self) -> str:
        """The compile target after ``sm_``: wgmma needs the arch-specific ``90a``."""
        return f"{self.arch}a" if getattr(self, "mma", "sync") == "wgmma" else str(self.arch)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of a launch."""
        return 0

    @property
    def smem_limit(self) -> int:
        """The most dynamic shared memory any launch of the variant asks for (the attribute set
        when the kernel is loaded)."""
        return self.smem_bytes


def tile_name(kind: str, head_dim: int, dtype: str, *, causal: bool, local: bool, softcap: bool,
              alibi: bool, even_head_dim: bool, mma: str, kv: str, block_m: int, block_n: int,
              warps: int, stages: int, arch: int, flashmask: int = 0, sinks: bool = False,
              leftpad: bool = False, kv_unaligned: bool = False, dropout: bool = False, chunk: bool = False) -> str:
    """The name of a tiled attention kernel (forward or backward): kind, bucket, dtype, mask,
    score modifiers (attention sinks included), column predicates, product, K/V source, tile and
    arch."""
    mask = ("chunk" if chunk else "local") if local else ("causal" if causal else "full")
    mods = ("_softcap" if softcap else "") + ("_alibi" if alibi else "")
    even = "" if even_head_dim else "_dpred"
    layout = "" if mma == "sync" else f"_{mma}"
    source = "" if kv == "dense" else f"_{kv}"
    source += ("_leftpad" if leftpad else "") + ("_unaligned" if kv_unaligned else "")
    mods += f"_fm{flashmask}" if flashmask else ""
    mods += "_sinks" if sinks else ""
    mods += "_dropout" if dropout else ""
    return (f"{kind}_d{head_dim}_{dtype}_{mask}{mods}{even}{layout}{source}"
            f"_m{block_m}n{block_n}w{warps}s{stages}_sm{arch}")


def all_variants(arch: int, mods: bool = True, families=FAMILIES) -> list:
    """Every kernel variant a plan can launch on ``arch``, family by family (what warmup
    compiles; fwd_ws is compiled and warmed up though no plan launches it yet). ``mods=False``
    leaves out the window/softcap/ALiBi variants."""
    import importlib
    out = []
    for f in families:  # a family is the module of that name here, with variants(arch, mods)
        out.extend(importlib.import_module(f"{__name__}.{f}").variants(arch, mods))
    return list(dict.fromkeys(out))


def features(v) -> frozenset:
    """The compile-time features of a variant, as names (what a covering sample must cross)."""
    f = {v.family, getattr(v, "kind", v.family), getattr(v, "dtype", "")}
    for flag in ("causal", "local", "softcap", "alibi", "even_head_dim", "swizzled", "decode", "sinks", "leftpad",
                 "kv_unaligned", "rotary", "dropout", "varlen"):
        if getattr(v, flag, False):
            f.add(flag)
    kind, kv = getattr(v, "kind", ""), getattr(v, "kv", "dense")
    if kv != "dense":
        f.add(kv)
    if getattr(v, "mma", "sync") == "wgmma":
        f.add("wgmma")
    if kind == "fwd_split":
        f.add("split")
    if getattr(v, "flashmask", 0):
        f.add(f"flashmask{v.flashmask}")
    if kind in ("bwd_dkdv", "bwd_dq"):
        f.add("deterministic")
    f.discard("")
    return frozenset(f)


def covering_sample(archs=(80, 90)) -> list:
    """A small deterministic set of variants that compiles every kernel kind at every head-dim
    bucket and dtype on every arch at least once, and every pair of features (causal, local,
    softcap, ALiBi, split, cache, paged, even head dim, swizzle, wgmma, decode, deterministic, ...)
    together at least once per arch where some variant has both. Greedy set cover, ties broken by
    name."""
    import itertools
    out = []
    for arch in archs:
        pool = sorted(all_variants(arch), key=lambda v: v.name)
        feats = {v: features(v) for v in pool}
        need = set()
        for v, f in feats.items():
            need.add(("kind", getattr(v, "kind", v.family), getattr(v, "head_dim", 0), getattr(v, "dtype", "")))
            need.update(itertools.combinations(sorted(f), 2))
        covers = {v: {r for r in need if (r[0] == "kind" and r == ("kind", getattr(v, "kind", v.family),
                                                                      getattr(v, "head_dim", 0), getattr(v, "dtype", "")))
                      or (r[0] != "kind" and r[0] in f and r[1] in f)} for v, f in feats.items()}
        while need:
            best = max(pool, key=lambda v: len(covers[v] & need))
            out.append(best)
            need -= covers[best]
    return out
