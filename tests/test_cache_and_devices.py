"""The disk cache under concurrency (processes, threads) and where it lives; kernels loaded once
per (variant, device); arrays on different GPUs rejected; the `python -m cuflash` toolbox. No GPU.
(Corrupt and truncated entries are covered by test_compile.py.)"""
import fcntl
import multiprocessing as mp
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import cuflash
from cuflash import compiler
from cuflash.kernels.combine import CombineVariant
from conftest import fake_view

ROOT = str(Path(__file__).resolve().parents[1])
ELF = b"\x7fELF"
V = CombineVariant(head_dim=64, dtype="fp16", arch=90)  # compiles in ~0.1 s


@pytest.fixture
def cache(monkeypatch, tmp_path):
    d = tmp_path / "cache"  # not created: cubin_for makes it
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(d))
    return d


def only_entry(d, v=V):
    """The one valid entry for ``v`` in ``d``: no other .cubin, no temp files, magic + checksum ok."""
    assert sorted(p.name for p in d.glob("*.cubin")) == [compiler.cache_path(v).name]
    assert not list(d.glob(".*.tmp"))
    cubin = compiler._read_entry(compiler.cache_path(v))
    assert cubin is not None and cubin[:4] == ELF
    return cubin


# ---------------------------------------------------------------------------------------------
# Concurrency

def _child(root, cache_dir, barrier, results):
    sys.path.insert(0, root)
    os.environ["CUFLASH_CACHE_DIR"] = cache_dir
    from cuflash import compiler
    from cuflash.kernels.combine import CombineVariant
    v = CombineVariant(head_dim=64, dtype="fp16", arch=90)
    compiler.cache_path(v)  # NVRTC loaded and the key computed before the start line
    barrier.wait(timeout=60)
    results.put(compiler.cubin_for(v))


def test_processes_share_one_entry(cache):
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_child, args=(ROOT, str(cache), barrier, results)) for _ in range(4)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert all(g == got[0] for g in got)
    assert only_entry(cache) == got[0]
    assert compiler.cache_path(V).with_name(compiler.cache_path(V).name + ".lock").exists()


def test_threads_compile_once(cache, monkeypatch):
    calls, lock, real = [], threading.Lock(), compiler.compile_variant

    def counting(v):
        with lock:
            calls.append(v)
        time.sleep(0.05)  # keep the others waiting on the file lock
        return real(v)

    monkeypatch.setattr(compiler, "compile_variant", counting)
    start = threading.Barrier(8)

    def go(_):
        start.wait(timeout=30)
        return compiler.cubin_for(V)

    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(go, range(8)))
    assert calls == [V]
    assert all(g == got[0] for g in got) and only_entry(cache) == got[0]


def test_flock_excludes_other_open_files_in_one_process(tmp_path):
    """What the thread case relies on: flock belongs to the open file description."""
    path = tmp_path / "x.lock"
    with open(path, "a+b") as a, open(path, "a+b") as b:
        fcntl.flock(a, fcntl.LOCK_EX)
        with pytest.raises(BlockingIOError):
            fcntl.flock(b, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(a, fcntl.LOCK_UN)
        fcntl.flock(b, fcntl.LOCK_EX | fcntl.LOCK_NB)


# ---------------------------------------------------------------------------------------------
# Where the cache lives

def test_cache_location(monkeypatch, tmp_path):
    home, xdg, own = tmp_path / "home", tmp_path / "xdg", tmp_path / "own"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(own))
    assert compiler.cache_dir() == own
    cubin = compiler.cubin_for(V)
    assert only_entry(own) == cubin and not xdg.exists() and not home.exists()

    monkeypatch.delenv("CUFLASH_CACHE_DIR")
    assert compiler.cache_dir() == xdg / "cuflash"
    assert compiler.cubin_for(V) == cubin and only_entry(xdg / "cuflash") == cubin
    assert not home.exists()

    monkeypatch.setenv("CUFLASH_CACHE_DIR", "")  # empty means unset
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert compiler.cache_dir() == home / ".cache" / "cuflash"


# ---------------------------------------------------------------------------------------------
# Loaded kernels: one per (variant, device), with a fake loader

@pytest.fixture
def loads(monkeypatch):
    seen, lock = [], threading.Lock()

    def fake_load(v, device):
        time.sleep(0.01)
        with lock:
            seen.append((v, device))
        return object()

    monkeypatch.setattr(compiler, "_load", fake_load)
    monkeypatch.setattr(compiler, "_loaded", {})
    return seen


def test_kernel_loaded_once_per_device(loads):
    k0, k1 = compiler.get_kernel(V, 0), compiler.get_kernel(V, 1)
    assert loads == [(V, 0), (V, 1)] and k0 is not k1
    for _ in range(3):
        assert compiler.get_kernel(V, 0) is k0 and compiler.get_kernel(V, 1) is k1
    assert len(loads) == 2


def test_kernel_loaded_once_per_device_from_threads(loads):
    w = CombineVariant(head_dim=128, dtype="bf16", arch=90)
    start = threading.Barrier(8)

    def go(i):
        start.wait(timeout=30)
        return compiler.get_kernel(w, i % 2), compiler.get_kernel(w, 1 - i % 2)

    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(go, range(8)))
    assert sorted(loads, key=lambda x: x[1]) == [(w, 0), (w, 1)]
    by_dev = {(i % 2, j): pair[j] for i, pair in enumerate(got) for j in (0, 1)}
    assert len({id(k) for k in by_dev.values()}) == 2  # one object per device, shared by all


# ---------------------------------------------------------------------------------------------
# Arrays on different GPUs, through the public entry points (test_validation.py has the checkers)

def fake(device, shape, dtype="float16"):
    return fake_view(device, shape, dtype)


@pytest.fixture
def views(fake_views):
    """cuflash sees hand-made Views as arrays; nothing may be allocated or launched."""


Q, KV = (2, 4, 8, 64), (2, 6, 4, 64)


@pytest.mark.parametrize("devs,msg", [
    ((0, 1, 1, 0), "k is on GPU 1 but q is on GPU 0"),
    ((1, 1, 1, 0), "out is on GPU 0 but q is on GPU 1"),
])
def test_attention_rejects_mixed_gpus(views, devs, msg):
    q, k, v, o = (fake(d, s) for d, s in zip(devs, (Q, KV, KV, Q)))
    with pytest.raises(ValueError, match=msg):
        cuflash.attention(q, k, v, out=o)


@pytest.mark.parametrize("arg", ["k_cache", "k", "cache_seqlens", "cache_batch_idx", "block_table", "out"])
def test_kvcache_rejects_mixed_gpus(views, arg):
    dev = lambda name: 1 if name == arg else 0
    paged = arg == "block_table"
    cache_shape = (4, 16, 4, 64) if paged else (3, 32, 4, 64)
    kw = dict(k_cache=fake(dev("k_cache"), cache_shape), v_cache=fake(0, cache_shape),
              cache_batch_idx=fake(dev("cache_batch_idx"), (2,), "int32"),
              cache_seqlens=fake(dev("cache_seqlens"), (2,), "int32"), out=fake(dev("out"), (2, 1, 8, 64)))
    if paged:
        kw.update(block_table=fake(1, (2, 2), "int32"), cache_batch_idx=None)
    if arg == "k":
        kw.update(k=fake(1, (2, 1, 4, 64)), v=fake(0, (2, 1, 4, 64)), cache_seqlens=0)
    with pytest.raises(ValueError, match=f"{arg} is on GPU 1 but q is on GPU 0"):
        cuflash.attention_with_kvcache(fake(0, (2, 1, 8, 64)), **kw)


# ---------------------------------------------------------------------------------------------
# python -m cuflash without a GPU

def cli(cache_dir, *args):
    env = dict(os.environ, PYTHONPATH=ROOT, CUFLASH_CACHE_DIR=str(cache_dir))
    return subprocess.run([sys.executable, "-m", "cuflash", *args], env=env, capture_output=True,
                          text=True, timeout=300)


def test_cli_toolbox(tmp_path):
    from conftest import GPU_PROBLEM
    d = tmp_path / "cli-cache"
    r = cli(d, "info")
    assert r.returncode == 0, r.stderr
    assert f"cache: {d}" in r.stdout
    if GPU_PROBLEM:
        assert "GPU: none" in r.stdout

    r = cli(d, "warmup", "--arch", "sm_90", "--head-dim", "64", "--family", "combine", "--family", "append")
    assert r.returncode == 0, r.stderr + r.stdout[-2000:]
    m = re.search(r"compiled (\d+) kernels for sm_90 in [\d.]+ s", r.stdout)
    assert m, r.stdout[-500:]
    n = int(m.group(1))
    from cuflash.kernels import append
    # combine d64 fp16/bf16, every append kernel (contiguous/paged, plain or rotary per dtype)
    assert n == 2 + len(append.variants(90)) and len(list(d.glob("*.cubin"))) == n

    r = cli(d, "cache", "list")
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and lines[-1] == f"{n} kernels in {d}"
    assert len([ln for ln in lines if ln.endswith(".cubin")]) == n
    r = cli(d, "cache", "clear")
    assert r.returncode == 0 and f"removed {n} kernels" in r.stdout and not list(d.glob("*.cubin"))
    assert cli(d, "cache", "list").stdout.splitlines()[-1] == f"0 kernels in {d}"

    r = cli(d, "explain", "--preset", "qwen2.5-7b")
    assert r.returncode == 0 and "fwd_split" in r.stdout and "combine" in r.stdout, r.stderr

    if GPU_PROBLEM:
        r = cli(d, "warmup")
        assert r.returncode != 0 and "--arch" in r.stderr and "Traceback" not in r.stderr, r.stderr
        r = cli(d, "demo")
        assert r.returncode == 0 and "No GPU here" in r.stdout, r.stderr


def test_cache_clear_keeps_other_files(tmp_path):
    (tmp_path / "notes.txt").write_text("not a kernel")
    assert cli(tmp_path, "cache", "clear").returncode == 0
    assert (tmp_path / "notes.txt").exists()


def test_kernel_parameters_pack_like_the_generated_struct():
    """A parameter table packs with C alignment (pointers and 64-bit ints on 8 bytes, int32 and
    float32 on 4, the end padded to 8) and generates the CUDA struct with the same offsets; the
    field types, not the values' Python types, decide the width, so an int32 field cannot carry a
    64-bit value."""
    import struct

    import numpy as np
    from cuflash.kernels.params import ParamTable
    t = ParamTable("P", (("a", "long long"), ("b", "int"), ("c", "const int*"), ("d", "float"), ("e", "int")))
    st = t.layout
    assert st.format == "@qiQfi0q" and st.size == 32
    buf = bytearray(st.size)
    st.pack_into(buf, 0, *t.values(a=1 << 40, b=np.int32(-3), c=7, d=0.5, e=9))
    assert struct.unpack_from("<q", buf, 0)[0] == 1 << 40 and struct.unpack_from("<i", buf, 8)[0] == -3
    assert struct.unpack_from("<Q", buf, 16)[0] == 7 and struct.unpack_from("<f", buf, 24)[0] == 0.5
    assert struct.unpack_from("<i", buf, 28)[0] == 9
    src = t.cuda()
    assert "static_assert(sizeof(P) == 32" in src and src.index("const int* c;") < src.index("float d;")
    with pytest.raises(struct.error):
        st.pack(*t.values(a=0, b=1 << 31, c=0, d=0.0, e=0))  # out of int32's range
    with pytest.raises(TypeError, match="missing \\['e'\\], unknown \\['x'\\]"):
        t.values(a=0, b=0, c=0, d=0.0, x=1)


def test_every_kernel_struct_compiles_with_its_host_layout():
    """Each family's generated struct and its static_assert compile for the device: host and
    device agree on the size."""
    from cuflash.kernels import append, bwd, combine, fwd
    tables = (fwd.PARAMS, combine.PARAMS, append.PARAMS, bwd.PREP_PARAMS, bwd.DKDV_PARAMS, bwd.DQ_PARAMS,
              bwd.CONVERT_PARAMS)
    src = "typedef unsigned short u16;\n" + "\n".join(t.cuda() for t in tables)
    compiler.compile_source(src + '\nextern "C" __global__ void k() {}\n', "structs", 80)


def test_early_launch_config_is_cuda_h_layout():
    """cuLaunchKernelEx's structs as cuda.h lays them out: CUlaunchAttribute is 72 bytes (id, 4
    pad bytes, a 64-byte value union), CUlaunchConfig 56 (seven uints, then stream, attribute
    pointer and count on 8-byte boundaries); the one attribute allows programmatic stream
    serialisation."""
    import ctypes
    ex = compiler._LaunchEx(0)
    C, A = type(ex.config), type(ex.attr)
    assert ctypes.sizeof(A) == 72 and A.value.offset == 8
    assert ctypes.sizeof(C) == 56 and (C.stream.offset, C.attrs.offset, C.num_attrs.offset) == (32, 40, 48)
    assert ex.attr.id == 6 and ex.attr.value[0] == 1 and ex.config.num_attrs == 1
    assert ctypes.addressof(ex.config.attrs.contents) == ctypes.addressof(ex.attr)


def test_early_launched_decode_split_blocks_stay_alone_on_an_sm():
    """An early-launched decode split grid asks for over half of an sm_90 SM's 228 KB of shared
    memory (and at most the 227 KB a block may have), so two of its blocks never share an SM;
    other kernels and archs ask for their own size."""
    from cuflash.plan import DeviceFacts, Problem, make_plan
    sm = 228 * 1024
    for arch, sq, want in ((90, 1, True), (80, 1, False), (90, 256, False)):
        plan = make_plan(Problem(1, sq, 32768, 32, 8, 128, "bf16", num_splits=0 if sq == 1 else 4),
                         DeviceFacts(132, arch))
        v = plan.launches[0].variant
        assert v.kind == "fwd_split", plan.kernels
        ask = v.smem_limit
        assert (2 * (ask + 1024) > sm) == want and ask <= 227 * 1024, (v.name, ask)
