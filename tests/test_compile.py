"""Offline NVRTC compilation (no GPU) of a covering sample of the kernel variants for sm_80 and
sm_90 with a clean ptxas resource report, and the disk cache: hits, corrupt entries, unusable
directories, keys. Every variant is compiled by ``python -m cuflash warmup --all --check``."""
import os
import warnings

import pytest

from cuflash import compiler
from cuflash.kernels import covering_sample, features
from cuflash.kernels.combine import CombineVariant
from conftest import assert_compiled_clean

VARIANTS = covering_sample()
ELF = b"\x7fELF"
SMEM_LIMIT = {80: 163 * 1024, 90: 227 * 1024}  # per-block opt-in limit (A100 / H100)


def test_sample_is_printed_and_covers_every_kind_and_feature_pair():
    """The sample is deterministic, small, and crosses what the full set crosses."""
    import itertools
    from cuflash.kernels import all_variants
    assert [v.name for v in covering_sample()] == [v.name for v in VARIANTS]
    print(f"\ncovering sample: {len(VARIANTS)} variants\n" + "\n".join(v.name for v in VARIANTS))
    for arch in (80, 90):
        full = all_variants(arch)
        sample = [v for v in VARIANTS if v.arch == arch]
        assert len(sample) < len(full) / 10
        kinds = lambda vs: {(getattr(v, "kind", v.family), getattr(v, "head_dim", 0), getattr(v, "dtype", ""))
                            for v in vs}
        assert kinds(sample) == kinds(full)
        pairs = lambda vs: {p for v in vs for p in itertools.combinations(sorted(features(v)), 2)}
        assert pairs(sample) == pairs(full)


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_variant_compiles_without_spills(compiled, v):
    r = assert_compiled_clean(compiled[v], v)
    assert v.smem_limit <= SMEM_LIMIT[v.arch]
    if getattr(v, "swizzled", False):  # dynamic shared memory follows the static: tiles start on a 128-byte line
        assert r.static_smem % 128 == 0, r
    if v.family == "bwd":
        assert r.static_smem == 0, r


def test_compile_variants_compiles_each_variant_once(compile_variants, monkeypatch):
    """conftest's session cache: a variant asked for again (or twice in one list) is not rebuilt."""
    vs = [CombineVariant(head_dim=32, dtype="bf16", arch=80), CombineVariant(head_dim=64, dtype="bf16", arch=80)]
    first = compile_variants(vs + vs[:1])
    assert list(first) == vs and all(first[v].cubin[:4] == ELF for v in vs)
    monkeypatch.setattr(compiler, "compile_all", lambda todo: pytest.fail(f"recompiled {todo}"))
    again = compile_variants(vs[::-1])
    assert list(again) == vs[::-1] and all(again[v] is first[v] for v in vs)


WGMMA_SMEM = {64: 80 << 10, 128: 160 << 10, 192: 144 << 10, 256: 192 << 10}  # Q + 2 stages of K and V


@pytest.mark.parametrize("v", [v for v in VARIANTS if getattr(v, "mma", "") == "wgmma"], ids=lambda v: v.name)
def test_wgmma_variant_as_designed(compiled, v):
    """sm_90a cubin, two warpgroups (plus the producer's in bwd_ws), the designed shared memory (forward; under sm_90's 227 KiB),
    and no wgmma that ptxas had to serialize (it warns when an accumulator is touched while in
    flight)."""
    log = compiled[v].log
    assert v.target == "90a" and "for 'sm_90a'" in log and v.threads == (384 if v.family == "bwd_ws" else 256)
    if v.family == "fwd":
        assert v.smem_bytes == WGMMA_SMEM[v.head_dim] <= 227 << 10
    assert "serialized" not in log, log


def test_nvrtc_library_chosen_by_environment(monkeypatch, tmp_path):
    """CUFLASH_NVRTC names the NVRTC library to load (its builtins found beside it); a path that
    is not a file is refused, naming the variable."""
    import ctypes
    default = compiler._NVRTC._find(ctypes)
    version = compiler.nvrtc_version()
    monkeypatch.setattr(compiler, "_nvrtc_instance", None)
    monkeypatch.setenv("CUFLASH_NVRTC", default)
    assert compiler.nvrtc_version() == version
    assert compiler.compile_source('extern "C" __global__ void k(int* x) { *x = 1; }', "k", 90).cubin
    monkeypatch.setattr(compiler, "_nvrtc_instance", None)
    monkeypatch.setenv("CUFLASH_NVRTC", str(tmp_path / "libnvrtc.so.13"))
    with pytest.raises(RuntimeError, match="CUFLASH_NVRTC must name an NVRTC library file"):
        compiler.nvrtc_version()


def test_compile_error_is_reported():
    with pytest.raises(RuntimeError, match=r"NVRTC failed to compile broken for sm_90:\n.*error"):
        compiler.compile_source('extern "C" __global__ void broken() { int x = ; }', "broken", 90)


# ---------------------------------------------------------------------------------------------
# Disk cache

SMALL = CombineVariant(head_dim=32, dtype="fp16", arch=80)  # compiles in a fraction of a second


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path))
    return tmp_path


def entries(d):
    return sorted(p.name for p in d.glob("*.cubin"))


def _no_compile(monkeypatch):
    def fail(v):
        raise AssertionError(f"compiled {v.name} although it is cached")
    monkeypatch.setattr(compiler, "compile_variant", fail)


def test_cache_write_then_hit(cache, monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cubin = compiler.cubin_for(SMALL)
    assert cubin[:4] == ELF
    assert entries(cache) == [compiler.cache_path(SMALL).name]
    assert compiler.cache_path(SMALL).parent == cache
    assert compiler.cache_path(SMALL).name.startswith(SMALL.name + "-")
    assert not list(cache.glob(".*.tmp"))  # temp file renamed into place
    _no_compile(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compiler.cubin_for(SMALL) == cubin
    assert entries(cache) == [compiler.cache_path(SMALL).name]


@pytest.mark.parametrize("damage", ["empty", "truncate_header", "truncate_half", "flip_payload",
                                    "flip_hash", "bad_magic"])
def test_corrupt_entry_is_rebuilt(cache, monkeypatch, damage):
    cubin = compiler.cubin_for(SMALL)
    path = compiler.cache_path(SMALL)
    data = bytearray(path.read_bytes())
    head = len(compiler._MAGIC)
    if damage == "empty":
        data = b""
    elif damage == "truncate_header":
        data = data[:head + 32]  # header intact, no payload
    elif damage == "truncate_half":
        data = data[:len(data) // 2]
    else:
        i = {"flip_payload": head + 32 + len(cubin) // 2, "flip_hash": head + 5, "bad_magic": 0}[damage]
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="is corrupt; rebuilding it"):
        rebuilt = compiler.cubin_for(SMALL)
    assert rebuilt[:4] == ELF
    stored = path.read_bytes()
    assert stored[:head] == compiler._MAGIC and stored[head + 32:] == rebuilt
    _no_compile(monkeypatch)  # and the rebuilt entry is a valid hit
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compiler.cubin_for(SMALL) == rebuilt


def test_unusable_cache_dir_warns_and_still_compiles(monkeypatch, tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a regular file")
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(blocker / "cache"))
    with pytest.warns(RuntimeWarning) as rec:
        cubin = compiler.cubin_for(SMALL)
    assert cubin[:4] == ELF
    msgs = [str(w.message) for w in rec]
    assert any("is not usable" in m and str(blocker / "cache") in m for m in msgs), msgs
    assert blocker.read_text() == "a regular file"


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_cache_dir_warns_and_still_compiles(monkeypatch, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(ro))
    try:
        with pytest.warns(RuntimeWarning, match="is not usable"):
            assert compiler.cubin_for(SMALL)[:4] == ELF
    finally:
        ro.chmod(0o755)


def test_cache_key_depends_on_version_options_and_arch(cache, monkeypatch):
    key = compiler.cache_key(SMALL)
    assert key == compiler.cache_key(SMALL) and len(key) == 20
    assert compiler.cache_key(CombineVariant(head_dim=32, dtype="fp16", arch=90)) != key
    assert compiler.cache_key(CombineVariant(head_dim=32, dtype="bf16", arch=80)) != key
    with monkeypatch.context() as m:
        m.setattr(compiler, "__version__", compiler.__version__ + ".post1")
        assert compiler.cache_key(SMALL) != key
        assert compiler.cache_path(SMALL) != cache / f"{SMALL.name}-{key}.cubin"
    with monkeypatch.context() as m:
        m.setattr(compiler, "NVRTC_OPTIONS", compiler.NVRTC_OPTIONS + ("-lineinfo",))
        assert compiler.cache_key(SMALL) != key
    with monkeypatch.context() as m:
        m.setattr(compiler, "nvrtc_version", lambda: (99, 0))
        assert compiler.cache_key(SMALL) != key
    assert compiler.cache_key(SMALL) == key  # everything restored


def test_version_change_misses_the_cache(cache, monkeypatch):
    compiler.cubin_for(SMALL)
    monkeypatch.setattr(compiler, "__version__", "0.0.0-test")
    compiler.cubin_for(SMALL)  # a new entry, the old one left alone
    assert len(entries(cache)) == 2


def test_warmup_fills_the_cache(cache):
    vs = [CombineVariant(head_dim=d, dtype="bf16", arch=90) for d in (32, 64, 96)]
    seen = []
    compiled, cached = compiler.warmup(vs + vs[:1], workers=2, progress=lambda i, n, v: seen.append((i, n)))
    assert compiled == vs and cached == [] and sorted(seen) == [(1, 3), (2, 3), (3, 3)]
    assert entries(cache) == sorted(compiler.cache_path(v).name for v in vs)
    assert compiler.warmup(vs[::-1], workers=2) == ([], vs[::-1])  # a second run finds them cached


# Triples of features that the pairwise sample need not cross, found spilling by the full
# sweep (warmup --all --check) at FA2's split tile: a window with ALiBi or softcap over a paged cache.
HEAVY_SPLITS = [v for v in __import__("cuflash.kernels.fwd", fromlist=["variants"]).variants(90)
                if v.kind == "fwd_split" and not v.decode and v.local and v.kv == "paged" and v.dtype == "bf16"
                and (v.softcap != v.alibi) and v.head_dim in (64, 256) and v.even_head_dim]


@pytest.mark.parametrize("v", HEAVY_SPLITS, ids=lambda v: v.name)
def test_heavy_split_variants_compile_without_spills(compiled, v):
    assert v.block_n == (64 if v.head_dim <= 128 else 32)
    assert_compiled_clean(compiled[v], v)
