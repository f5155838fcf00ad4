"""Bad input to cuflash.attention raises before any launch, with a message naming the argument,
the expected and the actual value, and leaves ``out`` bitwise untouched. NumPy inputs run all
validation on the CPU; mixing host/device or GPUs is checked on fake views."""
import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import api, arrays, validate
from cuflash.arrays import View
from conftest import GPU_PROBLEM

F16, BF16 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
DTYPES = pytest.mark.parametrize("dt", [F16, BF16], ids=["float16", "bfloat16"])
Q, KV = (2, 4, 8, 64), (2, 6, 4, 64)


@pytest.fixture(autouse=True)
def _no_launch(monkeypatch):
    """Reaching the device path at all means validation let bad input through."""
    def boom(*a, **k):
        raise AssertionError("validation passed: the device path was reached")
    monkeypatch.setattr(api, "_attention_device", boom)
    monkeypatch.setattr(arrays, "to_device", boom)
    monkeypatch.setattr(api.launch, "fire", boom)


def z(shape, dt=F16):
    return np.zeros(shape, dt)


def strided(shape, dt=F16):
    """A view of `shape` whose last dim is not contiguous (np.swapaxes of the last two dims)."""
    return np.swapaxes(z((*shape[:2], shape[3], shape[2]), dt), 2, 3)


def poisoned(shape, dt, rng):
    """Random bits, so that any write to it shows up bitwise."""
    return np.frombuffer(rng.bytes(int(np.prod(shape)) * dt.itemsize), dt).reshape(shape).copy()


def other(dt):
    return BF16 if dt == F16 else F16


# name -> dt -> (q, k, v, kwargs, exception, fragments the message must contain)
CASES = {
    "q_rank": lambda dt: (z(Q[:3], dt), z(KV, dt), z(KV, dt), {}, ValueError, ["q ", "4 dims", "(2, 4, 8)"]),
    "k_rank": lambda dt: (z(Q, dt), z((1, *KV), dt), z(KV, dt), {}, ValueError, ["k ", "4 dims", "(1, 2, 6, 4, 64)"]),
    "v_rank": lambda dt: (z(Q, dt), z(KV, dt), z(KV[1:], dt), {}, ValueError, ["v ", "4 dims", "(6, 4, 64)"]),
    "batch": lambda dt: (z(Q, dt), z((3, 6, 4, 64), dt), z((3, 6, 4, 64), dt), {}, ValueError,
                         ["k ", "batch size 2", "(3, 6, 4, 64)"]),
    "kv_shape": lambda dt: (z(Q, dt), z(KV, dt), z((2, 5, 4, 64), dt), {}, ValueError,
                            ["v ", "k's shape (2, 6, 4, 64)", "(2, 5, 4, 64)"]),
    "qk_head_dim": lambda dt: (z(Q, dt), z((2, 6, 4, 32), dt), z((2, 6, 4, 32), dt), {}, ValueError,
                               ["k ", "head dim 64", "got 32"]),
    "head_dim_264": lambda dt: (z((2, 4, 8, 264), dt), z((2, 6, 4, 264), dt), z((2, 6, 4, 264), dt), {},
                                ValueError, ["head dim", "256", "264"]),
    "head_dim_0": lambda dt: (z((2, 4, 8, 0), dt), z((2, 6, 4, 0), dt), z((2, 6, 4, 0), dt), {},
                              ValueError, ["head dim", "between 1 and 256", "got 0"]),
    "nheads": lambda dt: (z((2, 4, 6, 64), dt), z(KV, dt), z(KV, dt), {}, ValueError,
                          ["nheads (6)", "divisible", "nheads_k (4)"]),
    "nheads_k_0": lambda dt: (z(Q, dt), z((2, 6, 0, 64), dt), z((2, 6, 0, 64), dt), {}, ValueError,
                              ["nheads (8)", "nheads_k (0)"]),
    "k_dtype": lambda dt: (z(Q, dt), z(KV, other(dt)), z(KV, dt), {}, TypeError,
                           ["k ", f"q's dtype {dt.name}", f"got {other(dt).name}", "cast"]),
    "v_dtype": lambda dt: (z(Q, dt), z(KV, dt), z(KV, np.float32), {}, TypeError,
                           ["v ", f"q's dtype {dt.name}", "got float32", "cast"]),
    "q_strided": lambda dt: (strided(Q, dt), z(KV, dt), z(KV, dt), {}, ValueError,
                             ["q ", "last dim", "stride 1", "(2048, 512, 1, 8)"]),
    "k_strided": lambda dt: (z(Q, dt), strided(KV, dt), z(KV, dt), {}, ValueError,
                             ["k ", "last dim", "stride 1", "(1536, 256, 1, 4)"]),
    "v_strided": lambda dt: (z(Q, dt), z(KV, dt), strided(KV, dt), {}, ValueError,
                             ["v ", "last dim", "stride 1", "(1536, 256, 1, 4)"]),
    "scale_nan": lambda dt: (z(Q, dt), z(KV, dt), z(KV, dt), {"softmax_scale": float("nan")}, ValueError,
                             ["softmax_scale", "finite", "nan"]),
    "scale_inf": lambda dt: (z(Q, dt), z(KV, dt), z(KV, dt), {"softmax_scale": float("inf")}, ValueError,
                             ["softmax_scale", "finite", "inf"]),
    "scale_-inf_np": lambda dt: (z(Q, dt), z(KV, dt), z(KV, dt), {"softmax_scale": np.float32("-inf")},
                                 ValueError, ["softmax_scale", "finite", "-inf"]),
    "scale_zero": lambda dt: (z(Q, dt), z(KV, dt), z(KV, dt), {"softmax_scale": 0.0}, ValueError,
                              ["softmax_scale", "positive", "0.0"]),
    "scale_negative": lambda dt: (z(Q, dt), z(KV, dt), z(KV, dt), {"softmax_scale": -0.5}, ValueError,
                                  ["softmax_scale", "positive", "-0.5"]),
    "scale_str": lambda dt: (z(Q, dt), z(KV, dt), z(KV, dt), {"softmax_scale": "0.125"}, TypeError,
                             ["softmax_scale", "real number", "str"]),
    "splits_-1": lambda dt: (z(Q, dt), z(KV, dt), z(KV, dt), {"num_splits": -1}, ValueError,
                             ["num_splits", "between 0", "128", "got -1"]),
    "splits_129": lambda dt: (z(Q, dt), z(KV, dt), z(KV, dt), {"num_splits": 129}, ValueError,
                              ["num_splits", "between 0", "128", "got 129"]),
    "splits_1.5": lambda dt: (z(Q, dt), z(KV, dt), z(KV, dt), {"num_splits": 1.5}, TypeError,
                              ["num_splits", "an int", "float"]),
    "causal_str": lambda dt: (z(Q, dt), z(KV, dt), z(KV, dt), {"causal": "yes"}, TypeError,
                              ["causal", "a bool", "str"]),
    "out_shape": lambda dt: (z(Q, dt), z(KV, dt), z(KV, dt), {"out": (2, 4, 8, 32)}, ValueError,
                             ["out ", "q's shape (2, 4, 8, 64)", "got (2, 4, 8, 32)"]),
    "out_dtype": lambda dt: (z(Q, dt), z(KV, dt), z(KV, dt), {"out": np.float32}, TypeError,
                             ["out ", f"q's dtype {dt.name}", "got float32"]),
    "out_other_lowp": lambda dt: (z(Q, dt), z(KV, dt), z(KV, dt), {"out": other(dt)}, TypeError,
                                  ["out ", f"q's dtype {dt.name}", f"got {other(dt).name}"]),
    "out_strided": lambda dt: (z(Q, dt), z(KV, dt), z(KV, dt), {"out": "strided"}, ValueError,
                               ["out ", "last dim", "(2048, 512, 1, 8)"]),
    "out_not_array": lambda dt: (z(Q, dt), z(KV, dt), z(KV, dt), {"out": "list"}, TypeError,
                                 ["out ", "must be an array", "list"]),
}


def _make_out(spec, q, dt, rng):
    """The `out` argument: a poisoned array like q unless the case describes its own."""
    if spec is None:
        return poisoned(q.shape, dt, rng)
    if spec == "list":
        return [0.0] * 8
    if spec == "strided":
        base = poisoned((*q.shape[:2], q.shape[3], q.shape[2]), dt, rng)
        return np.swapaxes(base, 2, 3)
    if isinstance(spec, tuple):
        return poisoned(spec, dt, rng)
    return poisoned(q.shape, np.dtype(spec), rng)


@DTYPES
@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises_and_leaves_out_untouched(case, dt, rng):
    q, k, v, kw, exc, fragments = CASES[case](dt)
    out = _make_out(kw.pop("out", None), q, dt, rng)
    before = None if isinstance(out, list) else out.tobytes()
    with pytest.raises(exc) as ei:
        cuflash.attention(q, k, v, out=out, **kw)
    msg = str(ei.value)
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in message {msg!r}"
    if before is not None:
        assert out.tobytes() == before, "out was written by a failing call"
    # without `out` the same error (out is never what makes operand checks fail)
    if not case.startswith("out_"):
        with pytest.raises(exc):
            cuflash.attention(q, k, v, **kw)


@pytest.mark.parametrize("bad", [np.float32, np.float64, np.int32, np.int64, np.uint16])
def test_unsupported_dtype_says_to_cast(bad, rng):
    q, k, v = z(Q, bad), z(KV, bad), z(KV, bad)
    out = poisoned(Q, np.dtype(bad), rng)
    before = out.tobytes()
    with pytest.raises(TypeError) as ei:
        cuflash.attention(q, k, v, out=out)
    msg = str(ei.value)
    assert "q must be float16 or bfloat16" in msg and np.dtype(bad).name in msg and "cast" in msg, msg
    assert out.tobytes() == before


@pytest.mark.parametrize("thing", [None, 3, "q", [[1.0]]])
def test_non_array_operand(thing):
    with pytest.raises(TypeError, match=r"^q must be an array .*got " + type(thing).__name__):
        cuflash.attention(thing, z(KV), z(KV))


@pytest.mark.skipif(GPU_PROBLEM is None, reason="a GPU is present: valid NumPy calls would run")
@DTYPES
@pytest.mark.parametrize("with_out", [False, True])
def test_valid_numpy_call_without_gpu(dt, with_out, rng):
    q, k, v = (poisoned(s, dt, rng) for s in (Q, KV, KV))
    out = poisoned(Q, dt, rng) if with_out else None
    before = out.tobytes() if with_out else None
    with pytest.raises(RuntimeError) as ei:
        cuflash.attention(q, k, v, causal=True, out=out)
    msg = str(ei.value)
    assert "GPU" in msg and "none is available" in msg, msg
    if with_out:
        assert out.tobytes() == before


# ---------------------------------------------------------------------------------------------
# Placement: host/device mixing and GPU ordinals, on fake views (no GPU needed to build them)

def fake(device, framework=None, shape=(2, 4, 8, 64), dtype="float16"):
    framework = framework or ("numpy" if device < 0 else "cupy")
    strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    return View(1 << 20, tuple(shape), strides, dtype, device, framework, None)


@pytest.mark.parametrize("devs,fragments", [
    ((-1, 0, -1), ["k is in GPU 0", "q is in host memory", "cannot be mixed"]),
    ((0, 0, -1), ["v is in host memory", "q is in GPU 0", "cannot be mixed"]),
    ((0, 1, 0), ["k is on GPU 1", "q is on GPU 0", "one device"]),
    ((2, 2, 3), ["v is on GPU 3", "q is on GPU 2", "one device"]),
])
def test_mixed_placement(devs, fragments):
    named = [(n, fake(d)) for n, d in zip("qkv", devs)]
    with pytest.raises(ValueError) as ei:
        validate.same_place(*named)
    for frag in fragments:
        assert frag in str(ei.value), str(ei.value)
    with pytest.raises(ValueError, match=fragments[0]):  # and through the full operand check
        validate.operands(*(fake(d, shape=s) for d, s in zip(devs, (Q, KV, KV))))


@pytest.mark.parametrize("devs", [(-1, -1, -1), (0, 0, 0), (3, 3, 3)])
def test_same_placement_passes(devs):
    validate.same_place(*[(n, fake(d)) for n, d in zip("qkv", devs)])


def test_torch_cpu_tensor_is_rejected():
    with pytest.raises(ValueError, match=r"q is a CPU tensor; move it to the GPU \(e\.g\. q\.cuda\(\)\)"):
        validate.same_place(*[(n, fake(-1, "torch")) for n in "qkv"])


@pytest.mark.parametrize("q,out,exc,fragments", [
    (fake(0), fake(1), ValueError, ["out is on GPU 1", "q is on GPU 0"]),
    (fake(0), fake(-1, "cupy"), ValueError, ["out is in host memory", "q is in GPU 0"]),
    (fake(0), fake(-1, "numpy"), TypeError, ["out must be a cupy array", "got a numpy array"]),
    (fake(-1), fake(0, "cupy"), TypeError, ["out must be a numpy array", "got a cupy array"]),
    (fake(0, "torch"), fake(0, "cupy"), TypeError, ["out must be a torch array", "got a cupy array"]),
])
def test_out_placement_and_framework(q, out, exc, fragments):
    with pytest.raises(exc) as ei:
        validate.out(out, q)
    for frag in fragments:
        assert frag in str(ei.value), str(ei.value)


def test_out_dlpack_only_producer_is_rejected():
    class Producer:  # a JAX-like array: DLPack, not writable in place
        pass
    out = View(1 << 20, Q, (2048, 512, 64, 1), "float16", 0, "dlpack", (Producer(), None))
    with pytest.raises(TypeError, match=r"out must be a PyTorch, CuPy or NumPy array .*got Producer"):
        validate.out(out, fake(0))


class _HostDLPack:
    """A host-memory DLPack producer that is not a NumPy array and has no item assignment."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_out_host_dlpack_producer_is_rejected_before_launch(monkeypatch):
    monkeypatch.setattr(arrays, "current_device", lambda: 0)  # pretend a GPU: reach the device path
    q, k, v = z(Q), z(KV), z(KV)
    with pytest.raises(TypeError, match="out"):
        cuflash.attention(q, k, v, out=_HostDLPack(z(Q)))
