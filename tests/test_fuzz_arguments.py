"""Randomised hostile arguments for every entry point. Each call either passes validation (and
reaches the first allocation, which the fixtures turn into an AssertionError) or raises a
TypeError/ValueError whose message names one of the arguments that were changed; the command
line exits with a non-zero code and one line on stderr. Seeded (CUFLASH_FUZZ_SEED shifts the
seeds, to explore further): a failure shows the seed, the call and the arguments."""
import math
import os
import re
import sys

import numpy as np
import pytest

import cuflash
from cuflash import api, arrays, backward, compiler
from cuflash.__main__ import main
from cuflash.arrays import View

REACHED = "validation passed"
SEED = int(os.environ.get("CUFLASH_FUZZ_SEED", "0"))
CALLS = 1000  # per entry point


@pytest.fixture
def reach(fake_views, monkeypatch):
    """Reaching an allocation, a launch or the GPU lookup of the NumPy path raises REACHED."""
    def boom(*a, **k):
        raise AssertionError("validation passed: the device path was reached")
    monkeypatch.setattr(arrays, "current_device", boom)
    monkeypatch.setattr(api, "_launch", boom)
    monkeypatch.setattr(api, "device_facts", boom)
    monkeypatch.setattr(api.arrays, "on_device", boom)
    monkeypatch.setattr(backward, "_backward_device", boom)


def view(shape, dtype="float16", device=0, framework="cupy", strides=None, ptr=1 << 20):
    strides = strides or tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return View(ptr, tuple(shape), tuple(strides), dtype, device, framework, None)


# Hostile values: wrong types, NaN/inf, huge and negative ints, lists, NumPy scalars and arrays,
# strings, None, bools for ints (some are valid for some arguments: those calls pass validation).
SCALARS = [None, True, False, np.bool_(False), 0, 1, -1, 7, 129, 2**31, 2**63, -2**40, 10**400, 0.0, -0.0, 1.5,
           1e-46, 1e-39, 1e39, float("nan"), float("inf"), -float("inf"), np.float32("nan"), np.float64(0.1),
           np.int64(2), np.int32(-2), np.array(0.1), np.array(True), np.array([1, 2]), "", "2", "no",
           "sm_90", b"1", [], [0.1], [2], (1, 2, 3), (True, 0), (0.5, 1), (-5, 0), (2**40, -1), (3, 0), {},
           object(), 1 + 2j, slice(1), np.zeros((2, 2), np.float16)]
DTYPES = ["float16", "bfloat16", "float32", "int32", "int64", "bool", "float64"]
SIZES = [0, 1, 2, 3, 5, 16, 2**31, 2**33]


def hostile_view(rng, good: View):
    """``good`` with one thing changed: a size, the rank, the dtype, a stride, the pointer, the
    device or the framework."""
    shape, strides = list(good.shape), list(good.strides)
    dtype, device, framework, ptr = good.dtype, good.device, good.framework, good.ptr
    kind = rng.integers(7)
    if kind == 0 and shape:
        shape[rng.integers(len(shape))] = int(rng.choice(SIZES))
        strides = None
    elif kind == 1:
        shape = shape[:-1] if rng.random() < 0.5 else shape + [2]
        strides = None
    elif kind == 2:
        dtype = str(rng.choice(DTYPES))
    elif kind == 3 and strides:
        strides[rng.integers(len(strides))] = int(rng.choice([0, 2, 3, 2**31, 2**40]))
    elif kind == 4:
        ptr += int(rng.choice([2, 4, 8]))
    elif kind == 5:
        device = int(rng.choice([-1, 1, 3]))
        framework = "numpy" if device < 0 else framework
    else:
        device, framework = -1, "torch"  # a CPU tensor
    return view(shape, dtype, device, framework, strides, ptr)


def hostile(rng, good):
    """A hostile replacement for the argument whose valid value is ``good``."""
    if isinstance(good, View) and rng.random() < 0.75:
        return hostile_view(rng, good)
    if isinstance(good, tuple) and good and all(isinstance(s, int) for s in good) and rng.random() < 0.6:
        shape = list(good)  # plan's shape tuples
        shape[rng.integers(len(shape))] = SCALARS[rng.integers(len(SCALARS))]
        return tuple(shape)
    return SCALARS[rng.integers(len(SCALARS))]


# name -> the other words a message may use for that argument: its dims, and the arguments whose
# expected shape it sets (changing q's heads makes the given alibi_slopes the wrong shape)
SHAPED_BY_Q = ["nheads", "head dim", "total_q", "batch", "seqlen", "k", "v", "k_cache", "v_cache", "out",
               "dout", "lse", "dq", "alibi_slopes", "block_table", "cache_batch_idx", "cache_seqlens",
               "max_seqlen_q"]
ALIASES = {
    "q": SHAPED_BY_Q, "k": ["nheads_k", "head dim", "total_k", "page size", "v", "dk", "dv", "max_seqlen_k"],
    "v": ["dv"], "k_cache": ["nheads_k", "head dim", "page size", "cache", "capacity", "v_cache", "k", "v"],
    "cu_seqlens_q": ["batch", "cu_seqlens_k", "alibi_slopes", "block_table"],
    "block_table": ["pages_per_seq", "capacity", "max_seqlen_k", "cache"],
    "cache_seqlens": ["seqlen_new"],
}


def _bool(x):
    return isinstance(x, (bool, np.bool_))


def _int(x):
    return isinstance(x, (int, np.integer)) and not _bool(x)


def _real(x):
    return isinstance(x, (int, float, np.integer, np.floating)) and not _bool(x)


F32_TINY, F32_MAX = 1.1754944e-38, 3.4028235e38
# name -> True for values the argument can never take, whatever the others are (an oracle kept
# independent of cuflash.validate: a call with such a value must be rejected)
INVALID = {
    "causal": lambda x: not _bool(x), "return_lse": lambda x: not _bool(x),
    "deterministic": lambda x: not _bool(x),
    "num_splits": lambda x: not (_int(x) and 0 <= x <= 128),
    "softmax_scale": lambda x: x is not None and not (_real(x) and F32_TINY <= x <= F32_MAX / math.log2(math.e)),
    "softcap": lambda x: not (_real(x) and (x == 0 or F32_TINY <= x <= F32_MAX / math.log2(math.e))),
    "window_size": lambda x: not ((isinstance(x, (tuple, list)) and len(x) == 2
                                   and all(_int(w) and w >= -1 for w in x))
                                  or (isinstance(x, np.ndarray) and x.shape == (2,) and x.dtype.kind in "iu"
                                      and bool((x >= -1).all()))),  # a 2-int host array is a pair too
    "heuristic": lambda x: not (isinstance(x, str) and x in ("cuflash", "fa2")),
    "num_sms": lambda x: x is not None and not (_int(x) and 1 <= x <= 2**16),
    "dtype": lambda x: not (isinstance(x, str) and x in ("float16", "bfloat16")),
    "max_seqlen_q": lambda x: not (_int(x) and x >= 0), "max_seqlen_k": lambda x: not (_int(x) and x >= 0),
}


def check_accepted(where, changed, args):
    """A call that passed validation had no value INVALID rules out."""
    invalid = [n for n in changed if n in INVALID and INVALID[n](args[n])]
    assert not invalid, f"{where}: accepted an invalid {invalid}"


def names_argument(msg, changed, args):
    """The message names a changed argument (or, when an optional one became None, which is
    valid and changes what the others must be, any argument)."""
    if any(args[name] is None for name in changed):
        changed = list(args)
    words = [w for name in changed for w in [name, *ALIASES.get(name, [])]]
    return any(re.search(rf"(?<![\w.]){re.escape(w)}(?!\w)", msg) for w in words)


def varlen_args():
    return dict(q=view((10, 8, 64)), k=view((12, 4, 64)), v=view((12, 4, 64)), cu_seqlens_q=view((3,), "int32"),
                cu_seqlens_k=view((3,), "int32"), max_seqlen_q=5, max_seqlen_k=6)


MODS = dict(causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
            alibi_slopes=view((8,), "float32"))
Q, KV, LSE = (2, 4, 8, 64), (2, 6, 4, 64), (2, 8, 4)

# entry point -> (call(args), valid arguments); the arguments are passed by name
ENTRIES = {
    "attention": (lambda a: cuflash.attention(**a), dict(
        q=view(Q), k=view(KV), v=view(KV), out=view(Q, ptr=1 << 36), return_lse=False, num_splits=0, **MODS)),
    "attention_varlen": (lambda a: cuflash.attention_varlen(**a), dict(
        **varlen_args(), out=view((10, 8, 64), ptr=1 << 36), return_lse=True, num_splits=3, block_table=None, **MODS)),
    "attention_varlen_paged": (lambda a: cuflash.attention_varlen(**a), dict(
        varlen_args(), k=view((8, 16, 4, 64)), v=view((8, 16, 4, 64)), block_table=view((2, 4), "int32"), **MODS)),
    "attention_with_kvcache": (lambda a: cuflash.attention_with_kvcache(**a), dict(
        q=view((2, 1, 8, 64)), k_cache=view((3, 128, 4, 64)), v_cache=view((3, 128, 4, 64)),
        k=view((2, 1, 4, 64)), v=view((2, 1, 4, 64)), cache_seqlens=view((2,), "int32"),
        cache_batch_idx=view((2,), "int32"), out=view((2, 1, 8, 64), ptr=1 << 36), return_lse=False, num_splits=0, **MODS)),
    "attention_with_kvcache_paged": (lambda a: cuflash.attention_with_kvcache(**a), dict(
        q=view((2, 1, 8, 64)), k_cache=view((20, 16, 4, 64)), v_cache=view((20, 16, 4, 64)),
        block_table=view((2, 4), "int32"), cache_seqlens=7, **MODS)),
    "attention_backward": (lambda a: backward.attention_backward(**a), dict(
        dout=view(Q), q=view(Q), k=view(KV), v=view(KV), out=view(Q), lse=view(LSE, "float32"),
        deterministic=False, dq=view(Q), dk=view(KV), dv=view(KV), **MODS)),
    "attention_varlen_backward": (lambda a: backward.attention_varlen_backward(**a), dict(
        **varlen_args(), dout=view((10, 8, 64)), out=view((10, 8, 64)), lse=view((8, 10), "float32"),
        deterministic=True, **MODS)),
    "plan": (lambda a: cuflash.plan(**a), dict(
        q=Q, k=KV, v=KV, causal=True, softmax_scale=0.1, return_lse=False, num_splits=0, heuristic="fa2",
        num_sms=132, arch="sm_90", dtype="float16", window_size=(-1, -1), softcap=0.0, alibi_slopes=(2, 8))),
}


def torch_entry(monkeypatch):
    """attention on PyTorch tensors (its repeated-call fast path first): CPU tensors seen as CUDA
    tensors on GPU 0, so the calls get past placement."""
    torch = pytest.importorskip("torch", reason="needs PyTorch (optional dependency)")
    real = api.arrays.view
    monkeypatch.setattr(api.arrays, "view", lambda x, n: View(
        1 << 20, tuple(x.shape), x.stride(), str(x.dtype)[6:], 0, "torch", x) if isinstance(x, torch.Tensor)
        else real(x, n))
    q, kv = torch.zeros(Q, dtype=torch.float16), torch.zeros(KV, dtype=torch.float16)
    good = dict(ENTRIES["attention"][1], q=q, k=kv, v=kv, out=None, alibi_slopes=None)
    return ENTRIES["attention"][0], good


@pytest.mark.parametrize("entry", sorted(ENTRIES) + ["attention_torch"])
def test_hostile_arguments(reach, monkeypatch, entry):
    call, good = torch_entry(monkeypatch) if entry == "attention_torch" else ENTRIES[entry]
    seed = sum(map(ord, entry)) + SEED
    rng = np.random.default_rng(seed)
    try:
        call(dict(good))
    except AssertionError as e:  # the valid call passes validation
        assert REACHED in str(e)
    outcomes = {"reached": 0, "rejected": 0}
    for i in range(CALLS):
        args = dict(good)
        changed = [str(n) for n in rng.choice(sorted(good), size=int(rng.integers(1, 4)), replace=False)]
        for name in changed:
            args[name] = hostile(rng, good[name])
        where = f"seed {seed} call {i}: {entry}({', '.join(f'{n}={args[n]!r}' for n in changed)})"
        try:
            result = call(args)
        except AssertionError as e:
            assert REACHED in str(e), where
            check_accepted(where, changed, args)
            outcomes["reached"] += 1
        except (TypeError, ValueError) as e:
            assert names_argument(str(e), changed, args), f"{where}: {type(e).__name__}: {e}"
            assert "\n" not in str(e), where
            outcomes["rejected"] += 1
        except Exception as e:  # noqa: BLE001 (the point of the test)
            pytest.fail(f"{where} raised {type(e).__name__}: {e}")
        else:
            assert entry == "plan" and result.problem is not None, where
            check_accepted(where, changed, args)
            outcomes["reached"] += 1
    assert outcomes["rejected"] > CALLS // 2, outcomes


# ---------------------------------------------------------------------------------------------
# The command line

CLI_OPTIONS = {
    "explain": ["--preset", "--batch", "--seqlen-q", "--seqlen-k", "--prompt", "--new-tokens", "--nheads",
                "--nheads-k", "--head-dim", "--dtype", "--num-splits", "--heuristic", "--num-sms", "--arch",
                "--no-causal", "--window", "--attention-chunk"],
    "warmup": ["--arch", "--preset", "--head-dim", "--dtype"],
}
CLI_VALUES = ["-1", "0", "1", "2", "3", "7", "64", "129", "300", "2147483648", "1e3", "1.5", "x", "", "nan",
              "sm_7", "sm_75", "sm_90", "sm_90a", "90", "80", "foo", "fa2", "cuflash", "float16", "float32",
              "llama3-8b", "none", "-0", "--", "sm_80"]


def test_hostile_command_lines(monkeypatch, capsys):
    """explain and warmup with random options and values (warmup's compiles, and its build of the
    C++ autograd node where PyTorch is installed, are stubbed out: that build prints its progress
    on stderr the first time)."""
    import cuflash.__main__ as cli
    monkeypatch.setattr(compiler, "warmup", lambda variants, progress=None: ([], list(variants)))
    monkeypatch.setattr(cli, "_warmup_torch_node", lambda: None)
    rng = np.random.default_rng(18 + SEED)
    for i in range(300):
        cmd = str(rng.choice(sorted(CLI_OPTIONS)))
        argv = [cmd]
        for _ in range(int(rng.integers(1, 4))):
            option = str(rng.choice(CLI_OPTIONS[cmd]))
            argv += [option] + ([] if option == "--no-causal" else
                                [str(rng.choice(CLI_VALUES)) for _ in range(int(rng.integers(1, 3)))])
        if cmd == "warmup" and "--arch" not in argv:
            argv += ["--arch", "sm_80"]
        try:
            main(argv)
            code = 0
        except SystemExit as e:
            code = e.code
        except BaseException as e:  # noqa: BLE001 (the point of the test)
            pytest.fail(f"call {i}: python -m cuflash {' '.join(argv)} raised {type(e).__name__}: {e}")
        out, err = capsys.readouterr()
        where = f"call {i}: python -m cuflash {' '.join(argv)}"
        if code == 0:
            assert err == "" and out, where
        else:
            assert isinstance(code, int) and code > 0, f"{where}: exit {code!r}"
            assert err.startswith("cuflash: error: ") and err.count("\n") == 1, f"{where}: {err!r}"
            assert "Traceback" not in err, where
