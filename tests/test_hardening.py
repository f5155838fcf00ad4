"""Issue 18's reproducers, one test each: bad input that once escaped validation (or crashed
cuflash.plan and the command line) now raises a TypeError/ValueError naming the argument before
anything is allocated, or gives the promised result. No GPU needed: hand-made device views stand
in for device arrays, and reaching an allocation or launch fails the call (conftest's
fake_views)."""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import cuflash
from cuflash import api, arrays, backward, compiler, validate
from cuflash.__main__ import main
from cuflash.arrays import View
from conftest import fake_view, requires_torch

REACHED = "validation passed"
Q, KV = (2, 4, 8, 64), (2, 6, 4, 64)


@pytest.fixture
def views(fake_views, monkeypatch):
    """Fake views, and the NumPy path's GPU lookup counts as reaching the device path."""
    def boom(*a, **k):
        raise AssertionError("validation passed: the device path was reached")
    monkeypatch.setattr(arrays, "current_device", boom)


def dev(shape, dtype="float16", device=0, strides=None):
    return fake_view(device, shape, dtype, strides)


# ---------------------------------------------------------------------------------------------
# PyTorch's repeated-call fast path: options it cannot hash go to the full checks

@requires_torch
@pytest.mark.parametrize("kw,name", [
    (dict(softmax_scale=[0.1]), "softmax_scale"), (dict(softmax_scale=np.array(0.1)), "softmax_scale"),
    (dict(num_splits=[2]), "num_splits"), (dict(causal=np.array(True)), "causal"),
    (dict(softcap=[1.0]), "softcap"), (dict(return_lse=[]), "return_lse"),
])
def test_torch_fast_path_unhashable_option_names_the_argument(views, monkeypatch, kw, name):
    import torch
    q, k = torch.zeros(Q, dtype=torch.float16), torch.zeros(KV, dtype=torch.float16)
    assert api._signature(q, k, k, None, **{**dict(causal=False, softmax_scale=None, return_lse=False,
                                                   num_splits=0, window_size=(-1, -1), softcap=0.0,
                                                   alibi_slopes=None), **kw}) is not None
    # CPU tensors seen as CUDA tensors on GPU 0, so the call gets past placement to the options
    real = arrays.view
    monkeypatch.setattr(arrays, "view", lambda x, n: View(
        1 << 20, tuple(x.shape), x.stride(), str(x.dtype)[6:], 0, "torch", x) if isinstance(x, torch.Tensor)
        else real(x, n))
    with pytest.raises(TypeError, match=rf"^{name} must be"):
        cuflash.attention(q, k, k, **kw)


# ---------------------------------------------------------------------------------------------
# Scalars the kernels receive in float32

@pytest.mark.parametrize("kw,name", [
    (dict(softmax_scale=1e39), "softmax_scale"), (dict(softmax_scale=1e-46), "softmax_scale"),
    (dict(softmax_scale=1e-40), "softmax_scale"),  # subnormal: flushed to zero in the kernels
    (dict(softmax_scale=3e38), "softmax_scale"),   # a float32, but times log2(e) it is not
    (dict(softcap=1e39), "softcap"), (dict(softcap=1e-40), "softcap"),
    (dict(softcap=1e30, softmax_scale=1e-30), "softmax_scale / softcap"),
])
def test_scale_and_softcap_must_be_normal_float32(views, kw, name):
    calls = {
        "attention": lambda: cuflash.attention(dev(Q), dev(KV), dev(KV), **kw),
        "plan": lambda: cuflash.plan(Q, KV, KV, num_sms=132, **kw),
        "backward": lambda: backward.attention_backward(dev(Q), dev(Q), dev(KV), dev(KV), dev(Q),
                                                        dev((2, 8, 4), "float32"), **kw),
    }
    for entry, call in calls.items():
        with pytest.raises(ValueError, match="float32") as ei:
            call()
        assert str(ei.value).startswith(name + " must be"), (entry, str(ei.value))
    assert cuflash.plan(Q, KV, KV, num_sms=132, softmax_scale=1e-30, softcap=1e-3).problem.softcap


# ---------------------------------------------------------------------------------------------
# Bools must be bools

@pytest.mark.parametrize("name", ["causal", "return_lse"])
@pytest.mark.parametrize("value", ["no", [], 1, np.array(True), None])
def test_bool_options_must_be_bools(views, name, value):
    varlen = (dev((10, 8, 64)), dev((12, 4, 64)), dev((12, 4, 64)), dev((3,), "int32"), dev((3,), "int32"), 5, 6)
    calls = [lambda: cuflash.attention(dev(Q), dev(KV), dev(KV), **{name: value}),
             lambda: cuflash.attention_varlen(*varlen, **{name: value}),
             lambda: cuflash.attention_with_kvcache(dev((2, 1, 8, 64)), dev(KV), dev(KV), **{name: value}),
             lambda: cuflash.plan(Q, KV, KV, num_sms=132, **{name: value})]
    for call in calls:
        with pytest.raises(TypeError, match=rf"^{name} must be a bool, got {type(value).__name__}"):
            call()
    with pytest.raises(AssertionError, match=REACHED):  # NumPy bools are bools
        cuflash.attention(dev(Q), dev(KV), dev(KV), **{name: np.bool_(True)})


def test_deterministic_must_be_a_bool(views):
    with pytest.raises(TypeError, match="^deterministic must be a bool, got str"):
        backward.attention_backward(dev(Q), dev(Q), dev(KV), dev(KV), dev(Q), dev((2, 8, 4), "float32"),
                                    deterministic="no")


# ---------------------------------------------------------------------------------------------
# NumPy layouts and placement

def test_numpy_byte_strides_must_be_whole_elements():
    base = np.zeros(16384, np.float16)
    q = np.lib.stride_tricks.as_strided(base, shape=Q, strides=(4096, 1024, 128, 3))
    k = np.zeros(KV, np.float16)
    with pytest.raises(ValueError, match=r"^q must have strides in whole elements \(2 bytes\), "
                                         r"got byte strides \(4096, 1024, 128, 3\)"):
        cuflash.attention(q, k, k)
    odd_k = np.lib.stride_tricks.as_strided(base, shape=KV, strides=(4096, 1024, 128, 3))
    with pytest.raises(ValueError, match="^k must have strides in whole elements"):
        cuflash.plan(np.zeros(Q, np.float16), odd_k, k, num_sms=132)


@requires_torch
def test_cpu_tensors_are_refused_wherever_they_appear():
    """NumPy q with CPU-tensor k/v was accepted while a CPU-tensor q was not: CPU tensors are now
    refused in every position (NumPy arrays and other host DLPack producers are copied)."""
    import torch
    qn, kn = np.zeros(Q, np.float16), np.zeros(KV, np.float16)
    qt, kt = torch.zeros(Q, dtype=torch.float16), torch.zeros(KV, dtype=torch.float16)
    for args, name in (((qt, kn, kn), "q"), ((qn, kt, kn), "k"), ((qn, kn, kt), "v")):
        with pytest.raises(ValueError, match=rf"^{name} is a CPU tensor; move it to the GPU "
                                             rf"\(e\.g\. {name}\.cuda\(\)\)"):
            cuflash.attention(*args)
    with pytest.raises(ValueError, match="^alibi_slopes is a CPU tensor"):
        cuflash.attention(qn, kn, kn, alibi_slopes=torch.zeros(8))
    with pytest.raises(ValueError, match="^lse is a CPU tensor"):
        backward.attention_backward(qn, qn, kn, kn, qn, torch.zeros(2, 8, 4))


# ---------------------------------------------------------------------------------------------
# Sizes past what the kernels' 32-bit ints can index, refused before any allocation

@pytest.mark.parametrize("q,kv,fragment", [
    (Q, (2, 2**31, 4, 64), "k.shape[1] must be at most 2147482624"),
    ((2, 2**31, 8, 64), KV, "q.shape[1] must be at most"),
    ((2**31, 4, 8, 64), (2**31, 6, 4, 64), "q.shape[0] must be at most"),
    ((2**16, 2**12, 2**4, 64), (2**16, 6, 2**4, 64), "q's batch * nheads * seqlen (65536 * 16 * 4096)"),
])
def test_sizes_beyond_32_bits_are_refused_up_front(views, q, kv, fragment):
    with pytest.raises(ValueError) as ei:
        cuflash.attention(dev(q), dev(kv), dev(kv))
    assert fragment in str(ei.value) and "32-bit" in str(ei.value)
    with pytest.raises(ValueError, match="32-bit"):
        cuflash.plan(q, kv, kv, num_sms=132)
    b, sq, h, _ = q
    with pytest.raises(ValueError, match="32-bit"):
        backward.attention_backward(dev(q), dev(q), dev(kv), dev(kv), dev(q), dev((b, h, sq), "float32"))


def test_sizes_beyond_32_bits_varlen_and_kvcache(views):
    table = dev((2, 2**27), "int32")  # 2**27 pages of 16 keys per sequence: 2**31 keys
    with pytest.raises(ValueError, match=r"^max_seqlen_k must be at most 2147482624 .*32-bit"):
        cuflash.attention_varlen(dev((10, 8, 64)), dev((64, 16, 4, 64)), dev((64, 16, 4, 64)), dev((3,), "int32"),
                                 dev((3,), "int32"), 5, 2**31, block_table=table)
    with pytest.raises(ValueError, match=r"^pages_per_seq \* page_size \(the cache's capacity\) must be at most"):
        cuflash.attention_with_kvcache(dev((2, 1, 8, 64)), dev((64, 16, 4, 64)), dev((64, 16, 4, 64)),
                                       block_table=table)
    with pytest.raises(ValueError, match=r"^total_q \+ 132 \* batch .*must be at most"):
        cu = dev((2**24 + 1,), "int32")
        backward.attention_varlen_backward(dev((2**31 - 2**12, 8, 64)), dev((2**31 - 2**12, 8, 64)),
                                           dev((12, 4, 64)), dev((12, 4, 64)), dev((2**31 - 2**12, 8, 64)),
                                           dev((8, 2**31 - 2**12), "float32"), cu, cu, 5, 6)


def test_32_bit_strides_of_block_table_and_alibi(views):
    with pytest.raises(ValueError, match="^block_table's row stride must be at most 2147483647"):
        cuflash.attention_with_kvcache(dev((2, 1, 8, 64)), dev((64, 16, 4, 64)), dev((64, 16, 4, 64)),
                                       block_table=dev((2, 4), "int32", strides=(2**31, 1)))
    with pytest.raises(ValueError, match="^alibi_slopes' batch stride must be at most 2147483647"):
        cuflash.attention(dev(Q), dev(KV), dev(KV), alibi_slopes=dev((2, 8), "float32", strides=(2**31, 1)))


# ---------------------------------------------------------------------------------------------
# cuflash.plan

@pytest.mark.parametrize("heuristic", ["cuflash", "fa2"])
@pytest.mark.parametrize("q,kv,why", [
    ((0, 1, 8, 64), (0, 128, 8, 64), "batch=0"), ((1, 0, 8, 64), (1, 128, 8, 64), "seqlen_q=0"),
    ((1, 1, 0, 64), (1, 128, 8, 64), "nheads=0"), ((0, 0, 0, 64), (0, 0, 8, 64), "batch=0, seqlen_q=0, nheads=0"),
])
def test_plan_with_nothing_to_compute_launches_nothing(q, kv, why, heuristic):
    p = cuflash.plan(q, kv, kv, num_sms=132, heuristic=heuristic, causal=True)
    assert p.launches == () and p.kernels == () and p.workspace_bytes == 0
    assert p.reason == f"{why}: nothing to compute, no kernel is launched."
    text = str(p)
    assert "launch " not in text and text.endswith("why: " + p.reason)


@pytest.mark.parametrize("q,kv,exc,fragment", [
    (Q, (2, -1, 4, 64), ValueError, "k must have sizes >= 0, got (2, -1, 4, 64)"),
    (Q, (2, 6, -4, 64), ValueError, "k must have sizes >= 0"),
    ((2, 4, 8, 64.7), KV, TypeError, "q must be an array or a shape tuple of ints, got (2, 4, 8, 64.7)"),
    ((2, "4", 8, 64), KV, TypeError, "q must be an array or a shape tuple of ints"),
    ((True, 4, 8, 64), KV, TypeError, "q must be an array or a shape tuple of ints"),
    ((2, None, 8, 64), KV, TypeError, "q must be an array or a shape tuple of ints"),
    (Q, (2, 6, 4), ValueError, "k must have 4 dims"),
    (np.zeros(Q, np.float16), KV, TypeError,
     "q, k and v must be all arrays or all shape tuples, got q: ndarray, k: tuple"),
])
def test_plan_checks_shape_tuples_like_arrays(q, kv, exc, fragment):
    with pytest.raises(exc) as ei:
        cuflash.plan(q, kv, kv, num_sms=132)
    assert fragment in str(ei.value), str(ei.value)


@pytest.mark.parametrize("arch,want", [(80, 80), ("sm_80", 80), ("90", 90), ("sm_90", 90), ("sm_90a", 90),
                                       ("SM90A", 90), (np.int64(86), 86), (100, 100)])
def test_plan_arch_spellings(arch, want):
    p = cuflash.plan(Q, KV, KV, num_sms=132, arch=arch)
    assert p.device.arch == want and p.kernels[0].endswith(f"_sm{want}")


@pytest.mark.parametrize("arch,fragment", [(75, "80 (sm_80) or newer"), ("sm_75", "80 (sm_80) or newer"),
                                           ("sm_7", "must look like"), ("foo", "must look like"),
                                           (90.0, "must look like"), (True, "must look like"),
                                           ("sm_90b", "must look like"), (1000, "80 (sm_80) or newer")])
def test_plan_rejects_old_or_malformed_arch(arch, fragment):
    with pytest.raises(ValueError, match="^arch must") as ei:
        cuflash.plan(Q, KV, KV, num_sms=132, arch=arch)
    assert fragment in str(ei.value) and repr(arch) in str(ei.value)


@pytest.mark.parametrize("value,exc", [(["fa2"], TypeError), (None, TypeError), ("FA2", ValueError)])
def test_plan_heuristic_must_be_a_known_name(value, exc):
    with pytest.raises(exc, match=r"^heuristic must be 'cuflash' or 'fa2', got "):
        cuflash.plan(Q, KV, KV, num_sms=132, heuristic=value)


# ---------------------------------------------------------------------------------------------
# The command line: one error line and a non-zero exit, never a traceback

def run_cli(capsys, *argv):
    """(exit code, stdout, stderr) of ``python -m cuflash argv`` run in-process."""
    try:
        main(list(argv))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (print(e.code, file=sys.stderr) or 1)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv,fragment", [
    (["explain", "--head-dim", "0"], "--head-dim: expected an int between 1 and 256, got 0"),
    (["explain", "--head-dim", "300"], "--head-dim: expected an int between 1 and 256, got 300"),
    (["explain", "--nheads", "7", "--nheads-k", "3"], "nheads (7) must be divisible by nheads_k (3)"),
    (["explain", "--nheads-k", "0"], "nheads (32) must be divisible by nheads_k (0)"),
    (["explain", "--num-splits", "129"], "--num-splits: expected an int between 0 and 128, got 129"),
    (["explain", "--num-sms", "0"], "--num-sms: expected an int >= 1, got 0"),
    (["explain", "--arch", "foo"], "arch must look like 'sm_90' or 90, got 'foo'"),
    (["explain", "--arch", "sm_75"], "arch must be 80 (sm_80) or newer"),
    (["explain", "--seqlen-k", "-5"], "--seqlen-k: expected an int >= 0, got -5"),
    (["explain", "--prompt", "-100"], "--prompt: expected an int >= 0, got -100"),
    (["explain", "--seqlen-k", "2147483648"], "k.shape[1] must be at most"),
    (["explain", "--batch", "x"], "--batch: expected an int, got 'x'"),
    (["warmup", "--arch", "foo"], "arch must look like"),
    (["warmup", "--arch", "sm_7"], "arch must look like"),
    (["warmup", "--head-dim", "300", "--arch", "90"], "--head-dim: expected an int between 1 and 256"),
    (["warmup", "--head-dim", "0", "--arch", "90"], "--head-dim: expected an int between 1 and 256, got 0"),
])
def test_cli_errors_are_one_line(capsys, argv, fragment):
    code, out, err = run_cli(capsys, *argv)
    assert code != 0 and out == ""
    assert err.count("\n") == 1 and err.startswith("cuflash: error: ") and fragment in err, err


def test_cli_error_in_a_real_process():
    """No traceback and exit code 1 from ``python -m cuflash`` itself (this checkout's package)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-m", "cuflash", "explain", "--nheads", "7", "--nheads-k", "3"],
                       cwd=root, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr == "cuflash: error: nheads (7) must be divisible by nheads_k (3)\n"


@pytest.mark.parametrize("argv,fragment", [
    (["--batch", "0"], "why: batch=0: nothing to compute, no kernel is launched."),
    (["--seqlen-q", "0"], "why: seqlen_q=0: nothing to compute"),
    (["--seqlen-k", "0"], "seqlen_k=0 heads=32/32"),
    (["--nheads", "8", "--nheads-k", "2", "--seqlen-k", "100"], "heads=8/2"),
    (["--arch", "sm_90a", "--seqlen-k", "100"], "_sm90 "),
])
def test_cli_explain_edge_shapes(capsys, argv, fragment):
    code, out, err = run_cli(capsys, "explain", *argv)
    assert code == 0 and err == "" and fragment in out, out


@pytest.mark.parametrize("torch_module", [None, "no cuda"])
def test_cli_bench_without_pytorch_or_cuda(capsys, monkeypatch, torch_module):
    if torch_module is None:
        monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    else:
        fake = type(sys)("torch")
        fake.cuda = type(sys)("torch.cuda")
        fake.cuda.is_available = lambda: False
        monkeypatch.setitem(sys.modules, "torch", fake)
    code, out, err = run_cli(capsys, "bench", "decode")
    assert code == 1 and err == "cuflash: error: bench needs PyTorch with CUDA\n"


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_warmup_ctrl_c_cancels_pending_compiles(capsys, monkeypatch, cache):
    import threading
    from concurrent.futures import ThreadPoolExecutor
    started, lock, cancelled = [], threading.Lock(), threading.Event()
    shutdown = ThreadPoolExecutor.shutdown

    def shutdown_then_release(self, wait=True, *, cancel_futures=False):
        shutdown(self, wait=False, cancel_futures=cancel_futures)
        if cancel_futures:
            cancelled.set()
        if wait:
            shutdown(self, wait=True)

    def compile_once(v):  # Ctrl-C comes during the first compile; the others under way finish
        with lock:        # only once the pending ones were cancelled, however loaded the machine
            started.append(v)
            first = len(started) == 1
        if first:
            raise KeyboardInterrupt
        assert cancelled.wait(30)
        return b"cubin"
    monkeypatch.setattr(ThreadPoolExecutor, "shutdown", shutdown_then_release)
    monkeypatch.setattr(compiler, "cubin_for", compile_once)
    code, out, err = run_cli(capsys, "warmup", "--arch", "sm_90", "--head-dim", "64")
    assert code == 130 and err == "cuflash: interrupted\n"
    workers = min(16, os.cpu_count() or 1)  # compiler.warmup's threads
    # each thread blocks in its compile until the cancel, the interrupted one in its next: the
    # rest (over 400 kernels) never started
    assert len(started) <= workers + 1
    assert out.endswith("\n") and "compiled" not in out


def test_warmup_reports_cached_kernels_apart(capsys, monkeypatch, cache):
    built = set()  # cache paths "written"
    monkeypatch.setattr(compiler, "cubin_for", lambda v: built.add(compiler.cache_path(v)) or b"cubin")
    monkeypatch.setattr(compiler, "_read_entry", lambda path: b"cubin" if path in built else None)
    code, out, _ = run_cli(capsys, "warmup", "--arch", "sm_90", "--head-dim", "64", "--dtype", "float16")
    n = len(built)
    assert code == 0 and n > 10 and f"compiled {n} kernels for sm_90 in " in out
    code, out, _ = run_cli(capsys, "warmup", "--arch", "sm_90", "--head-dim", "64", "--dtype", "float16")
    assert code == 0 and len(built) == n and f"compiled 0 kernels ({n} already cached) for sm_90" in out


def test_warmup_dtype_filters_cover_every_variant():
    """--dtype bfloat16, float16 and float8_e4m3fn together select every variant (those without a
    dtype, FlashMask's prep and the plain append, in each), so a sweep can be split by dtype; the
    FP8 kernels only under float8_e4m3fn."""
    import argparse
    from cuflash.__main__ import _selected
    from cuflash.kernels import all_variants
    for arch in (80, 90):
        parts = [_selected(argparse.Namespace(family=None, preset=None, head_dim=None, dtype=dt), arch)
                 for dt in ("bfloat16", "float16", "float8_e4m3fn")]
        assert set(parts[0]) | set(parts[1]) | set(parts[2]) == set(all_variants(arch))
        assert {v.family for v in set(parts[0]) & set(parts[1])} == {"append", "flashmask"}
        assert {v.family for v in set(parts[2]) - set(parts[0])} == ({"fwd_fp8"} if arch == 90 else set())


def test_empty_plan_is_not_local():
    p = cuflash.plan((0, 1, 8, 64), (0, 128, 8, 64), (0, 128, 8, 64), num_sms=132, window_size=(4, 0))
    assert p.launches == () and p.local is False


def test_out_that_overlaps_an_input_is_refused_before_launch(views, monkeypatch):
    """An out that shares memory with k or v (the kernels read them while writing it), that is a
    strided view interleaved with q's elements, or with a zero stride (several elements at one
    address) is a ValueError naming the array, as PyTorch refuses overlapping outputs; out = q
    itself, and out interleaved with (not sharing) q's elements, are taken."""
    from cuflash.plan import DeviceFacts
    monkeypatch.setattr(api, "device_facts", lambda d: DeviceFacts(132, 90))
    monkeypatch.setattr(api, "_launch", lambda *a, **k: (_ for _ in ()).throw(AssertionError("launch reached")))
    q = fake_view(0, (2, 64, 8, 64), ptr=1 << 20)
    k = fake_view(0, (2, 64, 8, 64), ptr=1 << 24)
    for out, name in ((k, "k"), (fake_view(0, (2, 64, 8, 64), ptr=(1 << 24) + 4096), "k"),
                      (fake_view(0, (2, 64, 8, 64), strides=(0, 512, 64, 1), ptr=1 << 26), "zero stride")):
        with pytest.raises(ValueError, match=f"out must not (share memory with {name}|have a {name})"):
            api.attention(q, k, k, out=out)
    qkv = (2, 64, 3, 8, 64)  # q, k, v interleaved in one packed tensor, out = q: taken
    strides = (64 * 3 * 8 * 64, 3 * 8 * 64, 64, 1)
    packed = [fake_view(0, (2, 64, 8, 64), strides=strides, ptr=(1 << 28) + 2 * j * 8 * 64) for j in range(3)]
    assert qkv[2] == len(packed)
    for out in (packed[0], q):
        with pytest.raises(AssertionError, match="reached"):
            api.attention(packed[0] if out is packed[0] else q, packed[1], packed[2], out=out)
    with pytest.raises(ValueError, match="out must not share memory with k"):
        api.attention(packed[0], packed[1], packed[2], out=packed[1])


def test_kvcache_plan_refused_before_any_cache_row_is_written(views, monkeypatch):
    """A KV-cache call whose plan is refused (here its grid: 70,000 sequences) raises before the
    append kernel writes new rows into the caches."""
    from cuflash.plan import DeviceFacts
    monkeypatch.setattr(api, "device_facts", lambda d: DeviceFacts(132, 90))
    appended = []
    monkeypatch.setattr(api.launch, "append_kv", lambda *a, **k: appended.append(1))
    monkeypatch.setattr(arrays, "empty_like_framework", lambda v, shape, dt: None)
    monkeypatch.setattr(api, "_outputs", lambda qv, ov, r: (fake_view(0, qv.shape, ptr=1 << 28), None))
    b = 70000
    q, kc, kn = fake_view(0, (b, 1, 8, 128)), fake_view(0, (b, 64, 8, 128), ptr=1 << 32), fake_view(0, (b, 1, 8, 128), ptr=1 << 40)
    with pytest.raises(ValueError, match="grid"):
        api.attention_with_kvcache(q, kc, kc, kn, kn, cache_seqlens=3)
    assert appended == []


@requires_torch
def test_repeated_torch_call_with_an_overlapping_out_takes_the_checked_path():
    """The repeated-call path (same layouts as an earlier call) sends an out in k's, v's or
    (unless it is q itself) q's storage to the general path, whose exact check decides."""
    import torch
    qkv = torch.zeros(2, 64, 3, 8, 64, dtype=torch.float16)
    q, k, v = qkv.unbind(2)
    new = lambda: torch.empty_like(q)  # noqa: E731
    assert arrays.repeat_operands(q, k, v, None, new)[3] != 0
    assert arrays.repeat_operands(q, k, v, torch.empty_like(q), new) is not None
    assert arrays.repeat_operands(q, k, v, k, new) is None
    assert arrays.repeat_operands(q, k, v, q, new) is None  # (q in k's storage: the general path's exact check)
    q2, k2, v2 = (torch.zeros(2, 64, 8, 64, dtype=torch.float16) for _ in range(3))
    assert arrays.repeat_operands(q2, k2, v2, q2, new) is not None  # out = q: each block writes the rows it read
    big = torch.zeros(2 * q2.numel(), dtype=torch.float16)
    shifted = big[64:64 + q2.numel()].view(q2.shape)  # out half over q's rows: the general path
    assert arrays.repeat_operands(big[:q2.numel()].view(q2.shape), k2, v2, shifted, new) is None


def test_per_thread_default_stream_gets_no_cached_buffer(monkeypatch):
    """The per-thread default stream's handle (2) names a different stream in each thread: the
    split-KV workspace and merge counters cached per stream are not cached for it (the call
    allocates its own; counters 0: the combine kernel merges), so two threads never share one."""
    from cuflash import launch
    monkeypatch.setattr(launch, "_capturing", lambda stream: False)
    made = []
    assert launch._per_stream({}, 0, 2, 4, lambda n: made.append(n)) is None and made == []
    assert launch._counter_ptr(0, 2, 4) == 0


def test_cupy_launch_stream_is_the_arrays_devices(monkeypatch):
    """A CuPy (or JAX, through CuPy) array on GPU 1 launches on GPU 1's current stream, not on
    the current device's (JAX never makes its device CuPy's current one)."""
    cupy = pytest.importorskip("cupy")
    asked = []
    monkeypatch.setattr(cupy.cuda, "get_current_stream",
                        lambda device_id=-1: asked.append(device_id) or type("S", (), {"ptr": 77})())
    assert arrays.stream_for(fake_view(1, (2, 8))) == 77 and asked == [1]
