"""Rendering: every variant a plan can launch renders to CUDA C++ with its constants set, its
name as the extern "C" symbol, and no Jinja syntax left over."""
import re

import pytest

from cuflash import codegen
from cuflash.codegen import render
from cuflash.kernels import all_variants as every_variant
from cuflash.kernels.combine import CombineVariant
from cuflash.kernels.fwd import FwdVariant, decode_tile


def all_variants(arch, mods=True):
    return every_variant(arch, mods, families=("fwd", "combine", "append"))


VARIANTS = all_variants(90)
# Rendered one by one: every variant without attention sinks, and one in 16 of their sink twins
# (which differ by the sink's initial softmax state only; tests/test_sinks.py checks the rest).
RENDERED = [v for v in VARIANTS if not getattr(v, "sinks", False)] + [
    v for v in VARIANTS if getattr(v, "sinks", False)][::16]


def test_templates_folder_is_found():
    d = codegen.templates_dir()
    assert d.is_dir() and (d / "fwd" / "fwd.cu.j2").is_file() and (d / "combine" / "combine.cu.j2").is_file()
    assert (d / "common").is_dir()


def test_variant_set_and_unique_names():
    # 10 append (contiguous and paged cache; plain, or rotary interleaved/NeoX x 2 dtypes)
    # + 6 buckets x 2 dtypes x
    # (2 with and without sinks x 3 masks (full, causal, local) x 4 score modifiers (none, softcap,
    #  ALiBi, both) x (3 K/V sources x {fwd, fwd_split} x (2 even + 1 decode tile)
    #  + cache_leftpad (cache, paged): {fwd, fwd_split} x (2 even + 1 decode tile)
    #  + unaligned K/V (cache, paged, with or without cache_leftpad) x {fwd, fwd_split}, predicated
    #    head dim only)
    #  + 1 combine + FlashMask: 2 masks (full, causal) x 2 n x 2 softcap x 2 even
    #  + dropout: 3 masks x 4 score modifiers x 2 even, standard kernel over dense K/V)
    assert len(VARIANTS) == 10 + 6 * 2 * (2 * 3 * 4 * (3 * 2 * 3 + 2 * 2 * 3 + 4 * 2) + 1 + 2 * 2 * 2 * 2 + 3 * 4 * 2)
    assert len(all_variants(90, mods=False)) == 10 + 6 * 2 * (2 * (3 * 2 * 3 + 2 * 2 * 3 + 4 * 2) + 1)
    names = [v.name for v in VARIANTS]
    assert len(set(names)) == len(names)
    assert len(set(VARIANTS)) == len(VARIANTS)
    assert all(n.endswith("_sm90") for n in names)
    assert set(names).isdisjoint(v.name for v in all_variants(80))


@pytest.mark.parametrize("v", RENDERED, ids=lambda v: v.name)
def test_render(v):
    src = render(v)
    assert "{{" not in src and "{%" not in src and "%}" not in src and "{#" not in src
    assert re.search(r'extern "C"\s+__global__\s+void\s+(__launch_bounds__\([^)]*\)\s*)?'
                     + re.escape(v.name) + r"\(", src), "kernel name is not the extern \"C\" symbol"
    b = lambda x: "true" if x else "false"
    if v.family == "append":
        assert f"constexpr bool kPaged = {b(v.kv == 'paged')};" in src
        return
    consts = [f"constexpr int kHeadDim = {v.head_dim};", f"constexpr bool kIsBF16 = {b(v.dtype == 'bf16')};"]
    if v.family == "combine":
        consts.append("constexpr int kNWarps = 4;")
    else:
        consts += [f"constexpr int kBlockM = {v.block_m};", f"constexpr int kBlockN = {v.block_n};",
                   f"constexpr int kNWarps = {v.warps};", f"constexpr bool kIsCausal = {b(v.causal)};",
                   f"constexpr bool kIsSplit = {b(v.kind == 'fwd_split')};",
                   f"constexpr bool kEvenHeadDim = {b(v.even_head_dim)};",
                   f"constexpr bool kKVCache = {b(v.kv != 'dense')};",
                   f"constexpr bool kPaged = {b(v.kv == 'paged')};",
                   f"constexpr int kStages = {v.stages};",
                   f"constexpr bool kIsLocal = {b(v.local)};", f"constexpr bool kSoftcap = {b(v.softcap)};",
                   f"constexpr bool kAlibi = {b(v.alibi)};"]
    for c in consts:
        assert c in src, c
    assert ("sink_logit(" in src) == getattr(v, "sinks", False)
    assert len(re.findall(r"constexpr int kHeadDim = ", src)) == 1
    assert render(v) is src  # cached per variant


TILE = dict(block_m=128, block_n=64, warps=4, stages=1, arch=90)


def test_bad_variants_rejected():
    with pytest.raises(ValueError, match="kind"):
        FwdVariant(kind="bwd", head_dim=64, dtype="fp16", **TILE)
    with pytest.raises(ValueError, match="head_dim must be one of .* got 80"):
        FwdVariant(kind="fwd", head_dim=80, dtype="fp16", **TILE)
    with pytest.raises(ValueError, match="dtype"):
        FwdVariant(kind="fwd", head_dim=64, dtype="fp32", **TILE)
    with pytest.raises(ValueError, match="causal must be False"):
        FwdVariant(kind="fwd", head_dim=64, dtype="fp16", causal=True, local=True, **TILE)
    with pytest.raises(ValueError, match="arch must be an int >= 80"):
        CombineVariant(head_dim=64, dtype="fp16", arch=75)
    with pytest.raises(ValueError, match="block_m must be"):
        FwdVariant(kind="fwd", head_dim=64, dtype="fp16", **{**TILE, "block_m": 0})


def test_variants_are_keyword_only_with_no_default_tile():
    """A variant names its whole tile: there is no 0 x 0 default."""
    with pytest.raises(TypeError):
        FwdVariant("fwd", 64, "bf16")
    with pytest.raises(TypeError, match="block_m"):
        FwdVariant(kind="fwd", head_dim=64, dtype="bf16", arch=90)


@pytest.mark.parametrize("bucket,swizzled", [(32, False), (64, True), (96, False), (128, True), (192, False),
                                             (256, False)])
def test_decode_tile_layout(bucket, swizzled):
    """The decode tile (16 rows, 4 warps; standard and split-KV kernels) keeps its K/V rows
    128-byte aligned through the swizzle where the head dim allows it (64-column blocks, three
    stages): unpadded tiles, sized so."""
    bm, bn, w, st = decode_tile(bucket)
    for kind in ("fwd", "fwd_split"):
        v = FwdVariant(kind=kind, head_dim=bucket, dtype="bf16", even_head_dim=True, block_m=bm, block_n=bn, warps=w,
                       stages=st, arch=90)
        assert v.decode
        sw = swizzled
        assert v.swizzled is sw
        assert f"constexpr bool kSwizzle = {str(sw).lower()};" in render(v)
        row = bucket if sw else bucket + 8
        assert v.smem_bytes == (bm + 2 * bn * st) * row * 2
    prefill = FwdVariant(kind="fwd", head_dim=bucket, dtype="bf16", block_m=128, block_n=64, warps=4, arch=80, stages=2)
    assert not prefill.swizzled and "constexpr bool kSwizzle = false;" in render(prefill)
