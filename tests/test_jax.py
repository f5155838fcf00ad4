"""cuflash.jax: attention under jax.jit, jax.grad, jax.checkpoint and jax.vmap.

The CPU tests run the JAX side for real (custom_vjp, buffer_callback, trace-time checks and
plans, head-dim padding, scratch outputs) with the kernels replaced by the NumPy reference
inside the callbacks, and check the callbacks' GPU code (views of XLA's buffers, launch
arguments, XLA's stream) against recording stand-ins for the kernels. The GPU tests compare
with the float64 reference under flash-attn's rules: the forward |out - ref64| <= 2 |ref_lp -
ref64| + 1e-5, gradients |g - ref64| <= 3 |ref_same - ref64| + 1e-4 (as tests/test_gpu_backward.py).
"""
import contextlib
import os
import types

import numpy as np
import pytest

from conftest import GPU_PROBLEM, record_launches

# JAX takes 75% of the GPU's memory at its first use unless told not to; the other test
# processes (pytest-xdist) and PyTorch in this one need theirs.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
jax = pytest.importorskip("jax", reason="needs JAX (optional dependency: pip install 'cuflash[jax]')")
jnp = jax.numpy

import cuflash.jax as cj  # noqa: E402
from cuflash import backward, reference  # noqa: E402
from cuflash.plan import DeviceFacts, make_backward_plan, make_plan  # noqa: E402

H100 = DeviceFacts(132, 90)


def _jax_gpu_problem():
    if GPU_PROBLEM is not None:
        return GPU_PROBLEM
    try:
        jax.devices("gpu")
        return None
    except RuntimeError as e:
        return f"JAX has no GPU backend ({e})"


JAX_GPU_PROBLEM = _jax_gpu_problem()
requires_jax_gpu = pytest.mark.skipif(JAX_GPU_PROBLEM is not None, reason=f"needs a CUDA GPU in JAX: {JAX_GPU_PROBLEM}")


def _mods(call, extra):
    """Reference keyword arguments of a checked call (cuflash.jax._Call) and its extra inputs."""
    kw = dict(causal=call.causal, softmax_scale=call.scale, window_size=call.window, softcap=call.softcap)
    if call.alibi_sb is not None:
        kw["alibi_slopes"] = extra[0]
    if call.flashmask:
        kw["startend_row_indices"] = extra[-1]
    return kw


@pytest.fixture
def numpy_kernels(monkeypatch):
    """Plans for an H100 and the NumPy reference instead of the kernels, run on JAX's CPU device;
    counts the callbacks run."""
    calls = {"fwd": 0, "bwd": 0}

    def fwd(call, plan, ctx, outs, ins, early, recipes):
        calls["fwd"] += 1
        q, k, v, *extra = [np.asarray(x) for x in ins]
        if call.total_q is None:
            o, lse = reference.attention(q, k, v, return_lse=True, **_mods(call, extra))
        else:
            o, lse = reference.attention_varlen(q, k, v, *extra[-2:], return_lse=True, **_mods(call, extra))
        np.asarray(outs[0])[...] = o.astype(q.dtype)
        np.asarray(outs[1])[...] = lse

    def bwd(call, plan, ctx, outs, ins, prepared):
        calls["bwd"] += 1
        dout, q, k, v, o, lse, *extra = [np.asarray(x) for x in ins]
        if call.total_q is None:
            grads = reference.attention_backward(dout, q, k, v, **_mods(call, extra))
        else:
            grads = reference.attention_varlen_backward(dout, q, k, v, *extra[-2:], **_mods(call, extra))
        for buf, g in zip(outs, grads):
            np.asarray(buf)[...] = g.astype(q.dtype)

    monkeypatch.setattr(cj, "_target", lambda: (H100, ()))
    monkeypatch.setattr(cj, "_run_forward", fwd)
    monkeypatch.setattr(cj, "_run_backward", bwd)
    cj._differentiable.cache_clear()
    with jax.default_device(jax.devices("cpu")[0]):
        yield calls
    cj._differentiable.cache_clear()
    jax.clear_caches()  # no jitted function traced here may be reused by a GPU test


def arr(rng, *shape, dtype="float16"):
    """Random normal values on JAX's default device (the CPU in the numpy_kernels tests)."""
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)


def np64(x):
    return np.asarray(x).astype(np.float64)


MODS = [
    dict(causal=False),
    dict(causal=True),
    dict(causal=True, window_size=(5, 0)),
    dict(causal=False, window_size=(3, 2), softcap=5.0),
    dict(causal=True, alibi=True),
]


# ---------------------------------------------------------------------------------------------
# The JAX side on the CPU, the kernels replaced by the NumPy reference

@pytest.mark.parametrize("mods", MODS)
@pytest.mark.parametrize("d", [20, 64])
def test_forward_and_grads_under_jit(numpy_kernels, rng, mods, d):
    mods = dict(mods)
    b, sq, sk, h, hk = 2, 9, 13, 4, 2
    q, k, v, w = arr(rng, b, sq, h, d), arr(rng, b, sk, hk, d), arr(rng, b, sk, hk, d), arr(rng, b, sq, h, d)
    extra = {}
    if mods.pop("alibi", False):
        extra["alibi_slopes"] = jnp.asarray(rng.random((b, h), dtype=np.float32))
    out = jax.jit(lambda q, k, v: cj.attention(q, k, v, **mods, **extra))(q, k, v)
    ref_kw = dict(mods, **{n: np.asarray(a) for n, a in extra.items()})
    args = [np.asarray(x) for x in (q, k, v)]
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(np64(out), reference.attention(*args, **ref_kw), rtol=2e-3, atol=2e-3)

    loss = lambda q, k, v: jnp.sum(cj.attention(q, k, v, **mods, **extra).astype(jnp.float32) * w)  # noqa: E731
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for g, r in zip(grads, reference.attention_backward(np.asarray(w), *args, **ref_kw)):
        assert g.dtype == q.dtype
        np.testing.assert_allclose(np64(g), r, rtol=5e-3, atol=5e-3)
    assert numpy_kernels == {"fwd": 2, "bwd": 1}


@pytest.mark.parametrize("causal, n, heads", [(True, 1, 4), (True, 2, 1), (False, 2, 2), (False, 4, 4)])
def test_flashmask_under_jit(numpy_kernels, rng, causal, n, heads):
    """startend_row_indices as a traced argument of the jitted function, forward and gradients
    against the reference with the same mask; the prep kernel's bounds are an int32 output of the
    forward callback, sized from the plan."""
    from cuflash import masks
    b, s, h, hk, d = 2, 11, 4, 2, 12 if n == 1 else 16  # 12: head dims padded to 16 around the call
    q, k, v, w = arr(rng, b, s, h, d), arr(rng, b, s, hk, d), arr(rng, b, s, hk, d), arr(rng, b, s, h, d)
    r = np.random.default_rng(n + heads)
    x = r.integers(0, s + 1, (b, heads, s, n)).astype(np.int32)
    if n > 1:  # each (start, end) pair ordered
        x[..., 0::2], x[..., 1::2] = np.minimum(x[..., 0::2], x[..., 1::2]), np.maximum(x[..., 0::2], x[..., 1::2])
    if not causal and n == 2:  # LTS, UTE
        x[..., 0], x[..., 1] = x[..., 1], x[..., 0]
    assert masks.to_dense(x, s, causal).any()
    fm = jnp.asarray(x)
    f = jax.jit(lambda q, k, v, fm: cj.attention(q, k, v, causal=causal, startend_row_indices=fm))
    out = f(q, k, v, fm)
    args = [np.asarray(a) for a in (q, k, v)]
    np.testing.assert_allclose(np64(out), reference.attention(*args, causal=causal, startend_row_indices=x),
                               rtol=2e-3, atol=2e-3)
    loss = lambda q, k, v, fm: jnp.sum(cj.attention(q, k, v, causal=causal, startend_row_indices=fm)  # noqa: E731
                                       .astype(jnp.float32) * w)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, fm)
    for g, want in zip(grads, reference.attention_backward(np.asarray(w), *args, causal=causal,
                                                           startend_row_indices=x)):
        np.testing.assert_allclose(np64(g), want, rtol=5e-3, atol=5e-3)
    assert numpy_kernels == {"fwd": 2, "bwd": 1}
    plan = make_plan(cj._problem(cj._Call(b, s, s, h, hk, 16, "fp16", causal, d ** -0.5, (-1, -1), 0.0, None, None,
                                          False, n, heads)), H100)
    assert plan.launches[0].variant.flashmask == n and plan.workspace_bytes
    assert f"tensor<{plan.workspace_bytes // 4}xi32>" in f.lower(q, k, v, fm).as_text()


def test_checkpoint_recomputes_the_forward(numpy_kernels, rng):
    q, k, v = arr(rng, 1, 7, 2, 16), arr(rng, 1, 7, 2, 16), arr(rng, 1, 7, 2, 16)
    loss = lambda q, k, v: jnp.sum(cj.attention(q, k, v, causal=True).astype(jnp.float32) ** 2)  # noqa: E731
    remat = jax.checkpoint(loss, policy=jax.checkpoint_policies.nothing_saveable)
    text = str(jax.make_jaxpr(jax.value_and_grad(remat, argnums=(0, 1, 2)))(q, k, v))
    assert text.count("buffer_callback") == 3  # forward, forward again inside the remat, backward
    plain = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
    again = jax.jit(jax.value_and_grad(remat, argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_varlen_under_jit(numpy_kernels, rng):
    lens_q, lens_k = [5, 0, 1, 9], [7, 3, 0, 11]
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    d = 24
    q, k, v = arr(rng, cq[-1], 4, d), arr(rng, ck[-1], 2, d), arr(rng, ck[-1], 2, d)
    w = arr(rng, cq[-1], 4, d)
    mods = dict(causal=True, window_size=(4, 0))
    f = lambda q, k, v, cq, ck: cj.attention_varlen(q, k, v, cq, ck, max(lens_q), max(lens_k), **mods)  # noqa: E731
    out = jax.jit(f)(q, k, v, jnp.asarray(cq), jnp.asarray(ck))
    args = [np.asarray(x) for x in (q, k, v)]
    np.testing.assert_allclose(np64(out), reference.attention_varlen(*args, cq, ck, **mods), rtol=2e-3, atol=2e-3)
    loss = lambda q, k, v, cq, ck: jnp.sum(f(q, k, v, cq, ck).astype(jnp.float32) * w)  # noqa: E731
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, jnp.asarray(cq), jnp.asarray(ck))
    for g, r in zip(grads, reference.attention_varlen_backward(np.asarray(w), *args, cq, ck, **mods)):
        np.testing.assert_allclose(np64(g), r, rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("sq, sk, c", [(20, 20, 6), (9, 13, 4), (13, 9, 4), (1, 13, 4)])
@pytest.mark.parametrize("mods", [dict(causal=True), dict(causal=False), dict(causal=False, window_size=(3, 2)),
                                  dict(causal=True, alibi=True)])
def test_chunk_under_jit(numpy_kernels, rng, sq, sk, c, mods):
    """attention_chunk: forward and gradients (as packed sequences, one per chunk) against the
    reference with the chunk."""
    mods = dict(mods)
    b, h, hk, d = 2, 4, 2, 16
    q, k, v, w = arr(rng, b, sq, h, d), arr(rng, b, sk, hk, d), arr(rng, b, sk, hk, d), arr(rng, b, sq, h, d)
    extra = {}
    if mods.pop("alibi", False):
        extra["alibi_slopes"] = jnp.asarray(rng.random((b, h), dtype=np.float32))
    f = lambda q, k, v: cj.attention(q, k, v, attention_chunk=c, **mods, **extra)  # noqa: E731
    out = jax.jit(f)(q, k, v)
    ref_kw = dict(mods, attention_chunk=c, **{n: np.asarray(a) for n, a in extra.items()})
    args = [np.asarray(x) for x in (q, k, v)]
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(np64(out), reference.attention(*args, **ref_kw), rtol=2e-3, atol=2e-3)
    loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * w)  # noqa: E731
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for g, r in zip(grads, reference.attention_backward(np.asarray(w), *args, **ref_kw)):
        np.testing.assert_allclose(np64(g), r, rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("same", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_chunk_under_jit(numpy_kernels, rng, same, causal):
    lens_k = [7, 3, 0, 11]
    lens_q = lens_k if same else [5, 0, 1, 14]
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = cq if same else np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    d = 24
    q, k, v = arr(rng, cq[-1], 4, d), arr(rng, ck[-1], 2, d), arr(rng, ck[-1], 2, d)
    w = arr(rng, cq[-1], 4, d)
    mods = dict(causal=causal, attention_chunk=3)
    f = lambda q, k, v, cq, ck: cj.attention_varlen(q, k, v, cq, ck, max(lens_q), max(lens_k), **mods)  # noqa: E731
    out = jax.jit(f)(q, k, v, cq, ck)
    args = [np.asarray(x) for x in (q, k, v)]
    np.testing.assert_allclose(np64(out), reference.attention_varlen(*args, cq, ck, **mods), rtol=2e-3, atol=2e-3)
    loss = lambda q, k, v: jnp.sum(f(q, k, v, cq, ck).astype(jnp.float32) * w)  # noqa: E731
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for g, r in zip(grads, reference.attention_varlen_backward(np.asarray(w), *args, cq, ck, **mods)):
        np.testing.assert_allclose(np64(g), r, rtol=5e-3, atol=5e-3)


def test_vmap(numpy_kernels, rng):
    q, k, v = arr(rng, 3, 1, 5, 2, 8), arr(rng, 1, 6, 2, 8), arr(rng, 1, 6, 2, 8)
    out = jax.jit(jax.vmap(lambda q: cj.attention(q, k, v, causal=True)))(q)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(cj.attention(q[i], k, v, causal=True)))


def test_nothing_to_compute(numpy_kernels, rng):
    q, k = arr(rng, 2, 3, 2, 8), arr(rng, 2, 0, 2, 8)
    loss = lambda q, k, v: jnp.sum(cj.attention(q, k, v).astype(jnp.float32))  # noqa: E731
    assert not np.asarray(cj.attention(q, k, k)).any()
    assert not any(np.asarray(g).any() for g in jax.grad(loss, argnums=(0, 1, 2))(q, k, k))
    empty = jnp.zeros((0, 2, 8), jnp.float16)
    cu = jnp.zeros(3, jnp.int32)
    assert cj.attention_varlen(empty, empty, empty, cu, cu, 0, 0).shape == (0, 2, 8)
    assert numpy_kernels == {"fwd": 0, "bwd": 0}


def _bad(rng):
    q, k, v = arr(rng, 1, 4, 2, 8), arr(rng, 1, 4, 2, 8), arr(rng, 1, 4, 2, 8)
    cu = jnp.asarray([0, 4], jnp.int32)
    fm = jnp.full((1, 1, 4, 3), 4, jnp.int32)  # three bound columns: no mask has them
    flat = lambda x: x.reshape(4, 2, 8)  # noqa: E731
    return [
        (lambda q, s: cj.attention(q.astype(jnp.float32), k, v), TypeError, "q must be float16 or bfloat16"),
        (lambda q, s: cj.attention(q, k.astype(jnp.bfloat16), v), TypeError, "k must have q's dtype"),
        (lambda q, s: cj.attention(q, k[:, :, :1], v), ValueError, "v must have k's shape"),
        (lambda q, s: cj.attention(q, k, v, softmax_scale=s), TypeError,
         "softmax_scale must be a static Python value under jax.jit"),
        (lambda q, s: cj.attention(q, k, v, window_size=(s.astype(jnp.int32), 0)), TypeError,
         "window_size must be a static Python value"),
        (lambda q, s: cj.attention(q, k, v, softmax_scale=-1.0), ValueError, "softmax_scale"),
        (lambda q, s: cj.attention(q, k, v, causal=1), TypeError, "causal must be a bool"),
        (lambda q, s: cj.attention(q, k, v, window_size=(-2, 0)), ValueError, "window_size"),
        (lambda q, s: cj.attention(q, k, v, softcap=-1.0), ValueError, "softcap"),
        (lambda q, s: cj.attention(q, k, v, alibi_slopes=jnp.zeros(3, jnp.float32)), ValueError, "alibi_slopes"),
        (lambda q, s: cj.attention(q, k, v, alibi_slopes=jnp.zeros(2, jnp.float16)), TypeError, "alibi_slopes"),
        (lambda q, s: cj.attention(q, k, "v"), TypeError, "v must be a JAX array"),
        (lambda q, s: cj.attention_varlen(flat(q), flat(k), flat(v), cu, cu, s, 4), TypeError,
         "max_seqlen_q must be a static Python value"),
        (lambda q, s: cj.attention_varlen(flat(q), flat(k), flat(v), cu, cu, 4, -1), ValueError, "max_seqlen_k"),
        (lambda q, s: cj.attention_varlen(flat(q), flat(k), flat(v), cu.astype(jnp.int16), cu, 4, 4), TypeError,
         "cu_seqlens_q must be int32"),
        (lambda q, s: cj.attention_varlen(q, flat(k), flat(v), cu, cu, 4, 4), ValueError, "q must have 3 dims"),
        (lambda q, s: cj.attention(q, k, v, startend_row_indices=fm.astype(jnp.float32)), TypeError,
         "startend_row_indices must be int32"),
        (lambda q, s: cj.attention(q, k, v, startend_row_indices=fm[:, :, :3]), ValueError,
         r"startend_row_indices must have shape \(batch, 1 or nheads_k or nheads, seqlen_k, n\)"),
        (lambda q, s: cj.attention(q, k, v, causal=True, startend_row_indices=fm), ValueError,
         "the last dim of startend_row_indices must be 1 .LTS. or 2 .LTS, LTE. with causal=True"),
        (lambda q, s: cj.attention(q, k, v, window_size=(1, 1), startend_row_indices=fm[..., :2]), ValueError,
         "startend_row_indices cannot be combined with window_size"),
        (lambda q, s: cj.attention(q, k, v, startend_row_indices=fm.astype(jnp.float32), attention_chunk=2),
         ValueError, "attention_chunk"),  # (named before the indices' own checks, as cuflash.attention does)
        (lambda q, s: cj.attention(q, k, v, startend_row_indices=fm[..., :2], alibi_slopes=jnp.ones(2, jnp.float32)),
         ValueError, "startend_row_indices cannot be combined with alibi_slopes"),
        (lambda q, s: cj.attention(q, k, v, startend_row_indices=np.full((1, 1, 4, 2), 5, np.int32)), ValueError,
         r"startend_row_indices must lie in \[0, seqlen_q\] = \[0, 4\]"),  # NumPy: its values are checked
    ]


@pytest.mark.parametrize("case", range(23))
def test_arguments_checked_at_trace_time(numpy_kernels, rng, case):
    cases = _bad(rng)
    assert len(cases) == 23
    fn, error, match = cases[case]
    with pytest.raises(error, match=match):
        jax.jit(fn)(arr(rng, 1, 4, 2, 8), 0.5)
    assert numpy_kernels == {"fwd": 0, "bwd": 0}


@pytest.mark.skipif(JAX_GPU_PROBLEM is None, reason="JAX has a GPU here")
def test_without_a_gpu_the_trace_says_why(rng):
    q = arr(rng, 1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="needs JAX with a CUDA GPU backend"):
        jax.jit(lambda q: cj.attention(q, q, q))(q)


def test_scratch_outputs_from_the_plans(numpy_kernels, rng):
    """Split-KV partials and the backward's fp32 rows are outputs of the callbacks (XLA allocates
    them), sized from the plans made at trace time."""
    q, k = arr(rng, 1, 16, 2, 64), arr(rng, 1, 4096, 2, 64)
    plan = make_plan(cj._problem(_call(q, k)), H100)
    assert plan.num_splits > 1
    text = jax.jit(jax.grad(lambda q, k: jnp.sum(cj.attention(q, k, k).astype(jnp.float32)))).lower(q, k).as_text()
    assert f"tensor<{plan.workspace_bytes // 4}xf32>" in text
    floats = backward.workspace_floats(make_backward_plan(cj._problem(_call(q, k)), H100))
    assert f"tensor<{floats}xf32>" in text


def _call(q, k):
    b, sq, h, d = q.shape
    return cj._check(cj._shapes((q, "q"))[0], b, sq, k.shape[1], h, k.shape[2], False, None, (-1, -1), 0.0, None,
                     False, None)


# ---------------------------------------------------------------------------------------------
# The callbacks' GPU code on the CPU: XLA buffers and kernels replaced by recording stand-ins

class FakeBuffer:
    """What buffer_callback hands a GPU callback: shape, dtype, a CUDA pointer."""

    def __init__(self, shape, dtype, ptr):
        self.shape, self.dtype, self.ptr = tuple(shape), np.dtype(dtype), ptr

    def __dlpack_device__(self):
        return (2, 0)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, False), "version": 2}


@pytest.fixture
def recorded(monkeypatch):
    """Launches recorded as (kernel name, stream, {field: value}) instead of run. XLA may nest
    the callback's capture in its graphs: plain launches only (no early launch)."""
    launched = record_launches(monkeypatch, early_ok=False)
    monkeypatch.setattr(cj.arrays, "on_device", lambda dev: contextlib.nullcontext())
    return launched


def _counting(monkeypatch, module, name):
    """Calls of module.name (still run), counted in the returned list's length."""
    calls, fn = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(1) or fn(*a, **kw))
    return calls


def _buffers(shapes, dtypes, base):
    return [FakeBuffer(s, t, base + (i << 24)) for i, (s, t) in enumerate(zip(shapes, dtypes))]


@pytest.mark.parametrize("merge_counters", [False, True])
def test_forward_callback_launches_on_xla_stream(recorded, monkeypatch, merge_counters):
    """A split-KV forward: partials into XLA's scratch output; with a counters output (what
    _counters asks for when the split kernel merges its splits itself), zeroed on the stream, one
    launch merges them, else the combine kernel runs."""
    zeroed = []
    monkeypatch.setattr(cj.launch, "zero_async", lambda ptr, n, stream: zeroed.append((ptr, n, stream, len(recorded))))
    b, sq, sk, h, d = 1, 16, 4096, 2, 64
    call = cj._Call(b, sq, sk, h, h, d, "bf16", False, 0.125, (-1, -1), 0.0, None, None, False)
    plan = make_plan(cj._problem(call), H100)
    assert plan.num_splits > 1 and cj._counters(plan) == plan.launches[0].grid[0] * plan.launches[0].grid[1]
    recipes, prepares = {}, _counting(monkeypatch, cj.launch, "prepare")
    for base in (1 << 32, 1 << 40):  # the second call, on other buffers, fires the kept recipe
        ins = _buffers([(b, sq, h, d), (b, sk, h, d), (b, sk, h, d)], ["float16"] * 3, base)
        shapes = [(b, sq, h, d), (b, h, sq), (plan.workspace_bytes // 4,)] + [(cj._counters(plan),)] * merge_counters
        outs = _buffers(shapes, ["float16", "float32", "float32", "int32"], base + (1 << 36))
        recorded.clear()
        zeroed.clear()
        cj._run_forward(call, plan, types.SimpleNamespace(stream=777), outs, ins, False, recipes)
        split, s1, f1 = recorded[0]
        assert s1 == 777 and "split" in split
        assert (f1["q"], f1["k"], f1["v"]) == tuple(x.ptr for x in ins)
        assert f1["o"] == outs[2].ptr  # partials into XLA's scratch
        assert (f1["q_sb"], f1["q_ss"], f1["q_sh"]) == (sq * h * d, h * d, d)
        if merge_counters:  # zeroed before the one launch, which merges into out and lse
            assert len(recorded) == 1 and f1["counters"] == outs[3].ptr
            assert zeroed == [(outs[3].ptr, 4 * cj._counters(plan), 777, 0)]
            assert (f1["o_final"], f1["lse_final"]) == (outs[0].ptr, outs[1].ptr)
        else:  # no counter buffer: the combine kernel merges
            (combine, s2, f2), = recorded[1:]
            assert s2 == 777 and "combine" in combine and f1["counters"] == 0 and zeroed == []
            assert (f2["o_acc"], f2["o"], f2["lse"]) == (outs[2].ptr, outs[0].ptr, outs[1].ptr)
    assert len(recipes) == 1 and len(prepares) == 1


def test_persistent_forward_takes_tiles_from_a_zeroed_xla_counter(recorded, monkeypatch, request):
    """Persistent blocks count tiles in an int32 output of the callback, zeroed on XLA's stream
    right before the launch."""
    from test_fwd_ws import FakeEncode
    from cuflash.kernels import fwd_ws
    # the Q/K/V tensor maps without a driver; the made-up maps leave tensor_map's memo with the test
    monkeypatch.setattr(fwd_ws, "_driver_encode", lambda: FakeEncode().fn)
    fwd_ws.tensor_map.cache_clear()
    request.addfinalizer(fwd_ws.tensor_map.cache_clear)
    zeroed = []
    monkeypatch.setattr(cj.launch, "zero_async", lambda ptr, n, stream: zeroed.append((ptr, n, stream, len(recorded))))
    call = cj._Call(16, 1024, 1024, 16, 16, 128, "bf16", True, 0.1, (-1, -1), 0.0, None, None, False)
    plan = make_plan(cj._problem(call), H100)
    assert cj._persistent(plan) and not plan.workspace_bytes
    ins = _buffers([(16, 1024, 16, 128)] * 3, ["bfloat16"] * 3, 1 << 32)
    outs = _buffers([(16, 1024, 16, 128), (16, 16, 1024), (1,)], ["bfloat16", "float32", "int32"], 1 << 36)
    recipes = {}
    cj._run_forward(call, plan, types.SimpleNamespace(stream=31), outs, ins, False, recipes)
    (name, stream, f), = recorded
    assert "persistent" in name and stream == 31
    assert f["tile_counter"] == outs[2].ptr and zeroed == [(outs[2].ptr, 4, 31, 0)]  # zeroed before the launch
    outs = _buffers([(16, 1024, 16, 128), (16, 16, 1024), (1,)], ["bfloat16", "float32", "int32"], 1 << 40)
    cj._run_forward(call, plan, types.SimpleNamespace(stream=32), outs, ins, False, recipes)
    assert recorded[1][2]["tile_counter"] == outs[2].ptr and zeroed[1] == (outs[2].ptr, 4, 32, 1)


def test_persistent_plans_get_a_counter_output(numpy_kernels, rng):
    q = arr(rng, 2, 128, 4, 64)
    assert cj._persistent(make_plan(cj._problem(_call(q, q)), H100))
    assert "tensor<1xi32>" in jax.jit(lambda q: cj.attention(q, q, q)).lower(q).as_text()
    q = arr(rng, 1, 16, 2, 64)
    assert not cj._persistent(make_plan(cj._problem(_call(q, q)), H100))
    assert "tensor<1xi32>" not in jax.jit(lambda q: cj.attention(q, q, q)).lower(q).as_text()


def test_varlen_callbacks_read_cu_seqlens_and_write_xla_buffers(recorded, monkeypatch):
    batch, total_q, total_k, h, hk, d = 3, 40, 50, 4, 2, 32
    call = cj._Call(batch, 20, 30, h, hk, d, "fp16", True, 0.2, (-1, 0), 0.0, 0, total_q, True)
    cu = [(batch + 1,), (batch + 1,)]
    ins = _buffers([(total_q, h, d), (total_k, hk, d), (total_k, hk, d), (h,), *cu],
                   ["float16"] * 3 + ["float32", "int32", "int32"], 1 << 32)
    outs = _buffers([(total_q, h, d), (h, total_q)], ["float16", "float32"], 1 << 36)
    recipes, plan = {}, make_plan(cj._problem(call), H100)
    prepares = _counting(monkeypatch, cj.launch, "prepare")
    for base in (1 << 32, 1 << 40):  # other slopes and cu_seqlens: the recipe re-pointed at them
        ins = _buffers([(total_q, h, d), (total_k, hk, d), (total_k, hk, d), (h,), *cu],
                       ["float16"] * 3 + ["float32", "int32", "int32"], base)
        recorded.clear()
        cj._run_forward(call, plan, types.SimpleNamespace(stream=5), outs, ins, False, recipes)
        (_, stream, f), = recorded
        assert stream == 5 and f["o"] == outs[0].ptr and f["lse"] == outs[1].ptr
        assert (f["cu_seqlens_q"], f["cu_seqlens_k"], f["alibi_slopes"]) == (ins[4].ptr, ins[5].ptr, ins[3].ptr)
        assert (f["q_sb"], f["k_sb"]) == (h * d, hk * d)  # token strides as batch strides
    assert len(recipes) == 1 and len(prepares) == 1

    recorded.clear()
    plan = make_backward_plan(cj._problem(call), H100)
    ws = backward.workspace_floats(plan, total_q)
    bins = _buffers([(total_q, h, d), (total_q, h, d), (total_k, hk, d), (total_k, hk, d), (total_q, h, d),
                     (h, total_q), (h,), *cu], ["float16"] * 5 + ["float32"] * 2 + ["int32"] * 2, 1 << 32)
    prepared, first, runs = {}, bins, _counting(monkeypatch, backward, "run")
    # the second call, on other buffers but the same slopes, fires the kept launches; the third, with
    # other slopes, prepares them anew
    for base in (1 << 32, 1 << 40, 1 << 44):
        bins = _buffers([(total_q, h, d), (total_q, h, d), (total_k, hk, d), (total_k, hk, d), (total_q, h, d),
                         (h, total_q), (h,), *cu], ["float16"] * 5 + ["float32"] * 2 + ["int32"] * 2, base)
        bins[6] = first[6] if base < 1 << 44 else bins[6]
        bouts = _buffers([(total_q, h, d), (total_k, hk, d), (total_k, hk, d), (ws,)], ["float16"] * 3 + ["float32"],
                         base + (1 << 36))
        recorded.clear()
        cj._run_backward(call, plan, types.SimpleNamespace(stream=9), bouts, bins, prepared)
        assert [s for _, s, _ in recorded] == [9, 9, 9]
        prep, main, last = (f for _, _, f in recorded)
        assert (prep["dout"], prep["out"], prep["lse"]) == (bins[0].ptr, bins[4].ptr, bins[5].ptr)
        assert prep["lse2"] == bouts[3].ptr and prep["dq_accum"] == 0  # deterministic: no accumulator
        assert (main["q"], main["k"], main["v"], main["dk"], main["dv"]) == (bins[1].ptr, bins[2].ptr, bins[3].ptr,
                                                                              bouts[1].ptr, bouts[2].ptr)
        assert (main["cu_seqlens_q"], main["alibi_slopes"]) == (bins[7].ptr, bins[6].ptr)
        assert last["dq"] == bouts[0].ptr
    assert len(prepared) == 1 and len(runs) == 2


def test_flashmask_callbacks_read_the_indices_in_place(recorded, monkeypatch, request):
    """FlashMask: the forward's prep kernel reads startend_row_indices from XLA's input and writes
    its per-block bounds into the callback's int32 output, which the attention kernel reads; other
    buffers re-point the kept recipe. The backward's prep and dK/dV kernels read the same input."""
    from test_fwd_ws import FakeEncode
    from cuflash.kernels import fwd_ws
    monkeypatch.setattr(fwd_ws, "_driver_encode", lambda: FakeEncode().fn)
    fwd_ws.tensor_map.cache_clear()
    request.addfinalizer(fwd_ws.tensor_map.cache_clear)
    monkeypatch.setattr(cj.launch, "zero_async", lambda ptr, n, stream: None)
    b, s, h, hk, d = 2, 1000, 4, 2, 128
    call = cj._Call(b, s, s, h, hk, d, "bf16", True, 0.1, (-1, -1), 0.0, None, None, False, 1, hk)
    plan = make_plan(cj._problem(call), H100)
    ws, counters = plan.workspace_bytes // 4, cj._counters(plan)
    assert plan.launches[0].variant.flashmask == 1 and ws > 0
    recipes, prepares = {}, _counting(monkeypatch, cj.launch, "prepare")
    for base in (1 << 32, 1 << 40):
        ins = _buffers([(b, s, h, d), (b, s, hk, d), (b, s, hk, d), (b, hk, s, 1)], ["bfloat16"] * 3 + ["int32"], base)
        outs = _buffers([(b, s, h, d), (b, h, s), (ws,)] + [(counters,)] * bool(counters),
                        ["bfloat16", "float32", "int32", "int32"], base + (1 << 36))
        recorded.clear()
        cj._run_forward(call, plan, types.SimpleNamespace(stream=3), outs, ins, False, recipes)
        (prep_name, s1, prep), (name, s2, f) = recorded
        assert "flashmask_prep" in prep_name and "fm1" in name and s1 == s2 == 3
        assert (prep["idx"], prep["out"]) == (ins[3].ptr, outs[2].ptr)
        assert (f["fm_idx"], f["fm_blocks"], f["o"], f["lse"]) == (ins[3].ptr, outs[2].ptr, outs[0].ptr, outs[1].ptr)
        assert f.get("tile_counter", 0) == (outs[3].ptr if counters else 0)
    assert len(recipes) == 1 and len(prepares) == 1

    plan = make_backward_plan(cj._problem(call), H100)
    floats, prepared = backward.workspace_floats(plan), {}
    for base in (1 << 32, 1 << 40):  # the second call fires the kept launches on other buffers
        bins = _buffers([(b, s, h, d), (b, s, h, d), (b, s, hk, d), (b, s, hk, d), (b, s, h, d), (b, h, s),
                         (b, hk, s, 1)], ["bfloat16"] * 5 + ["float32", "int32"], base)
        bouts = _buffers([(b, s, h, d), (b, s, hk, d), (b, s, hk, d), (floats,)], ["bfloat16"] * 3 + ["float32"],
                         base + (1 << 36))
        recorded.clear()
        cj._run_backward(call, plan, types.SimpleNamespace(stream=9), bouts, bins, prepared)
        preps = [f for n, _, f in recorded if "flashmask_prep" in n]
        mains = [f for n, _, f in recorded if "fm_idx" in f]
        assert preps and mains and {st for _, st, _ in recorded} == {9}
        assert all(f["idx"] == bins[6].ptr and bouts[3].ptr < f["out"] < bouts[3].ptr + 4 * floats for f in preps)
        assert all(f["fm_idx"] == bins[6].ptr and f["fm_blocks"] in {p["out"] for p in preps} for f in mains)
    assert len(prepared) == 1


def test_callback_refuses_host_buffers():
    buf = FakeBuffer((1,), "float16", 0)
    buf.__dlpack_device__ = lambda: (1, 0)
    with pytest.raises(RuntimeError, match="runs on CUDA GPUs"):
        cj._device(buf)


# ---------------------------------------------------------------------------------------------
# On the GPU

def _check_forward(out, q, k, v, **kw):
    ok, err, bound = reference.check_close(np.asarray(out), np.asarray(q), np.asarray(k), np.asarray(v), **kw)
    assert ok, f"max error {err:.3g} exceeds bound {bound:.3g} ({kw})"


def _check_grads(grads, ref64, same, what):
    for name, g, r, s in zip(("dq", "dk", "dv"), grads, ref64, same):
        err, bound = reference.max_abs_err(np.asarray(g), r), 3 * reference.max_abs_err(s, r) + 1e-4
        assert err <= bound, f"{name}: max error {err:.3g} exceeds bound {bound:.3g} ({what})"


def _gpu_case(rng, mods, b, sq, sk, h, hk, d, dtype):
    mods = dict(mods)
    q, k, v, w = (arr(rng, b, n, hh, d, dtype=dtype) for n, hh in ((sq, h), (sk, hk), (sk, hk), (sq, h)))
    slopes = None
    if mods.pop("alibi", False):
        slopes = jnp.asarray(rng.random(h, dtype=np.float32))
        mods["alibi_slopes"] = slopes
    ref_mods = dict(mods, **({} if slopes is None else {"alibi_slopes": np.asarray(slopes)}))
    return q, k, v, w, mods, ref_mods


GPU_SHAPES = [(2, 113, 203, 4, 2, 64), (1, 256, 256, 4, 4, 128), (2, 77, 77, 2, 1, 36),  # head dim padded to 40
              (1, 1, 4096, 8, 2, 128)]  # split-KV: partials in XLA's scratch output, combine kernel


@requires_jax_gpu
@pytest.mark.parametrize("mods,dtype", [(m, "bfloat16") for m in MODS] + [(MODS[1], "float16")])
@pytest.mark.parametrize("b,sq,sk,h,hk,d", GPU_SHAPES)
def test_gpu_forward_and_grads(rng, mods, dtype, b, sq, sk, h, hk, d):
    _check_forward_and_grads(*_gpu_case(rng, mods, b, sq, sk, h, hk, d, dtype))


def _check_forward_and_grads(q, k, v, w, mods, ref_mods):
    """cuflash.jax.attention under jit and grad against the reference (flash-attn's rule)."""
    out = jax.jit(lambda q, k, v: cj.attention(q, k, v, **mods))(q, k, v)
    _check_forward(out, q, k, v, **ref_mods)
    loss = lambda q, k, v: jnp.sum(cj.attention(q, k, v, **mods).astype(jnp.float32) * w)  # noqa: E731
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    args = [np.asarray(x) for x in (w, q, k, v)]
    _check_grads(grads, reference.attention_backward(*args, **ref_mods),
                 reference.attention_backward(*args, precision="same", **ref_mods), ref_mods)


@requires_jax_gpu
@pytest.mark.parametrize("mods", [MODS[0], MODS[1], MODS[3], MODS[4]])
@pytest.mark.parametrize("b,sq,sk,h,hk,d,c", [(2, 600, 600, 4, 2, 64, 128), (1, 300, 700, 4, 4, 128, 200),
                                             (2, 500, 260, 2, 1, 128, 100)])
def test_gpu_chunk_forward_and_grads(rng, mods, b, sq, sk, h, hk, d, c):
    q, k, v, w, mods, ref_mods = _gpu_case(rng, mods, b, sq, sk, h, hk, d, "bfloat16")
    mods["attention_chunk"] = ref_mods["attention_chunk"] = c
    _check_forward_and_grads(q, k, v, w, mods, ref_mods)


@requires_jax_gpu
def test_gpu_checkpoint_and_deterministic(rng):
    q, k, v, w, _, _ = _gpu_case(rng, {}, 2, 300, 300, 4, 2, 64, "bfloat16")
    loss = lambda q, k, v: jnp.sum(cj.attention(q, k, v, causal=True, deterministic=True)  # noqa: E731
                                   .astype(jnp.float32) * w)
    plain = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
    remat = jax.jit(jax.value_and_grad(jax.checkpoint(loss), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(remat)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@requires_jax_gpu
def test_gpu_varlen(rng):
    lens_q, lens_k = np.array([100, 0, 1, 230, 17]), np.array([120, 5, 0, 256, 17])
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q, k, v, w = (arr(rng, n, hh, 64, dtype="bfloat16") for n, hh in ((cq[-1], 6), (ck[-1], 2), (ck[-1], 2),
                                                                       (cq[-1], 6)))
    mods = dict(causal=True, window_size=(63, 0))
    f = lambda q, k, v, cq, ck: cj.attention_varlen(q, k, v, cq, ck, 230, 256, **mods)  # noqa: E731
    cqd, ckd = jnp.asarray(cq), jnp.asarray(ck)
    out = jax.jit(f)(q, k, v, cqd, ckd)
    args = [np.asarray(x) for x in (q, k, v)]
    ref64 = reference.attention_varlen(*args, cq, ck, **mods)
    lp = reference.attention_varlen(*args, cq, ck, precision="same", **mods)
    assert reference.max_abs_err(np.asarray(out), ref64) <= 2 * reference.max_abs_err(lp, ref64) + 1e-5
    loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) * w)  # noqa: E731
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, cqd, ckd)
    bargs = [np.asarray(w), *args, cq, ck]
    _check_grads(grads, reference.attention_varlen_backward(*bargs, **mods),
                 reference.attention_varlen_backward(*bargs, precision="same", **mods), "varlen")


@requires_jax_gpu
def test_gpu_repeated_steps_see_fresh_data(rng):
    """A jitted step (possibly replayed from XLA's command buffers) computes on each call's data."""
    step = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(cj.attention(q, k, v, causal=True)
                                                              .astype(jnp.float32) ** 2), argnums=(0, 1, 2)))
    for _ in range(3):
        q, k, v, w, _, _ = _gpu_case(rng, {}, 2, 128, 128, 4, 4, 64, "bfloat16")
        _, grads = step(q, k, v)
        dout = (2 * cj.attention(q, k, v, causal=True).astype(jnp.float32)).astype(jnp.bfloat16)
        args = [np.asarray(x) for x in (dout, q, k, v)]
        _check_grads(grads, reference.attention_backward(*args, causal=True),
                     reference.attention_backward(*args, causal=True, precision="same"), "repeat")


@requires_jax_gpu
def test_gpu_split_forward_repeats_with_fresh_counters(rng):
    """Split-KV forwards merge through counters that XLA allocates afresh for every call (zeroed
    on the stream first): repeated calls of one jitted function, in one XLA program and apart,
    each give their own data's attention."""
    f = jax.jit(lambda q, k, v: cj.attention(q, k, v))
    twice = jax.jit(lambda q, k, v, k2, v2: (cj.attention(q, k, v), cj.attention(q, k2, v2)))
    for _ in range(3):
        q, k, v, _, _, _ = _gpu_case(rng, {}, 2, 3, 4096, 8, 2, 128, "bfloat16")
        assert "xi32>" in f.lower(q, k, v).as_text()  # the merge counters, an output of the callback
        _check_forward(f(q, k, v), q, k, v)
        k2, v2 = arr(rng, 2, 4096, 2, 128, dtype="bfloat16"), arr(rng, 2, 4096, 2, 128, dtype="bfloat16")
        a, b = twice(q, k, v, k2, v2)
        _check_forward(a, q, k, v)
        _check_forward(b, q, k2, v2)


HOST_TRANSFER_MARKS = ("is_host_transfer", "send(", "recv(", "infeed", "outfeed", "xla_python_gpu_callback",
                       "xla_ffi_python_gpu_callback", "S(5)")


@requires_jax_gpu
def test_gpu_compiled_hlo_has_no_host_transfer(rng):
    q, k, v, w, _, _ = _gpu_case(rng, {}, 1, 64, 64, 2, 2, 64, "bfloat16")
    loss = lambda q, k, v: jnp.sum(cj.attention(q, k, v, causal=True).astype(jnp.float32) * w)  # noqa: E731
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
    assert text.count("xla_buffer_python_gpu_callback") >= 2
    assert not [m for m in HOST_TRANSFER_MARKS if m in text]


def _flashmask_heads(name, heads, batch):
    """(indices (batch, heads, 1000, n), causal): a cuflash.masks family over 1000 tokens, its
    documents (or window) other in each head."""
    from cuflash import masks
    s = 1000

    def one(i):
        return {"causal_document": (masks.causal_document([300 + 50 * i, 200, 500 - 50 * i], batch), True),
                "causal_blockwise": (masks.causal_blockwise([250, 250 + 40 * i, 500 - 40 * i], batch), True),
                "global_sliding_window": (masks.global_sliding_window(s, 16 + 8 * i, 100 + 20 * i, batch), False),
                "share_question": (masks.share_question([[300, 100 + 20 * i, 100], [200 - 20 * i, 300]], batch), True),
                "prefix_lm_document": (masks.prefix_lm_document([(600, 100 + 30 * i), (400, 50)], batch), False)}[name]
    cases = [one(i) for i in range(heads)]
    return np.ascontiguousarray(np.concatenate([x for x, _ in cases], axis=1)), cases[0][1]


@requires_jax_gpu
@pytest.mark.parametrize("d, heads", [(64, 2), (128, 4), (128, 1)])  # per KV head, per query head, broadcast
@pytest.mark.parametrize("name", ["causal_document", "causal_blockwise", "global_sliding_window", "share_question",
                                  "prefix_lm_document"])
def test_gpu_flashmask_forward_and_grads(rng, name, d, heads):
    """FlashMask under jit and grad, startend_row_indices a traced argument (another mask in each
    of its heads), against the float64 reference; the same jitted function on other indices (held
    in another buffer) computes their mask."""
    b, s, h, hk = 2, 1000, 4, 2
    x, causal = _flashmask_heads(name, heads, b)
    q, k, v, w = (arr(rng, b, s, hh, d, dtype="bfloat16") for hh in (h, hk, hk, h))
    f = jax.jit(lambda q, k, v, fm: cj.attention(q, k, v, causal=causal, startend_row_indices=fm))
    fm = jnp.asarray(x)
    _check_forward(f(q, k, v, fm), q, k, v, causal=causal, startend_row_indices=x)
    loss = lambda q, k, v, fm: jnp.sum(cj.attention(q, k, v, causal=causal, startend_row_indices=fm)  # noqa: E731
                                       .astype(jnp.float32) * w)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, fm)
    args = [np.asarray(a) for a in (w, q, k, v)]
    ref = dict(causal=causal, startend_row_indices=x)
    _check_grads(grads, reference.attention_backward(*args, **ref),
                 reference.attention_backward(*args, precision="same", **ref), name)
    other = np.ascontiguousarray(x[:, ::-1])  # the heads' masks in the other order
    fm2 = jnp.asarray(other)
    assert fm2.unsafe_buffer_pointer() != fm.unsafe_buffer_pointer() and (heads == 1 or (other != x).any())
    _check_forward(f(q, k, v, fm2), q, k, v, causal=causal, startend_row_indices=other)


SHARD_MAP_CHILD = r"""
import os, sys
sys.path.insert(0, {tests!r})
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
import test_jax as T
from cuflash import reference
cj = T.cj
cj._target = lambda: (T.H100, ())

def fwd(call, plan, ctx, outs, ins, early, recipes):
    q, k, v, *extra = [np.asarray(x) for x in ins]
    o, lse = reference.attention(q, k, v, return_lse=True, **T._mods(call, extra))
    np.asarray(outs[0])[...] = o.astype(q.dtype)
    np.asarray(outs[1])[...] = lse

def bwd(call, plan, ctx, outs, ins, prepared):
    dout, q, k, v, o, lse, *extra = [np.asarray(x) for x in ins]
    for buf, g in zip(outs, reference.attention_backward(dout, q, k, v, **T._mods(call, extra))):
        np.asarray(buf)[...] = g.astype(q.dtype)
cj._run_forward, cj._run_backward = fwd, bwd
assert len(jax.devices()) == 2
mesh = Mesh(np.array(jax.devices()), ("d",))
rng = np.random.default_rng(0)
q, k = (jnp.asarray(rng.standard_normal(s, dtype=np.float32), jnp.float32).astype(jnp.float16)
        for s in ((4, 8, 4, 16), (4, 12, 2, 16)))

def loss(q, k, causal):
    return jnp.sum(cj.attention(q, k, k, causal=causal).astype(jnp.float32) ** 2)
for causal, specs in ((True, (P("d"), P("d"))), (False, (P(None, "d"), P()))):
    want = jax.grad(loss, argnums=(0, 1))(q, k, causal)
    got = jax.jit(jax.shard_map(lambda q, k: jax.grad(loss, argnums=(0, 1))(q, k, causal), mesh=mesh,
                                in_specs=specs, out_specs=specs))(q, k)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=1e-2, rtol=0)
try:
    jax.jit(jax.shard_map(lambda q, k: cj.attention(q, k, k), mesh=mesh, in_specs=(P("d"), P("d")),
                          out_specs=P()))(q, k)
    raise SystemExit("a replicated out_specs for a varying output was accepted")
except ValueError as e:
    assert "out_specs" in str(e), e
print("ok")
"""


def test_shard_map_forward_and_gradients():
    """Inside shard_map over two (CPU) devices the outputs vary over the manual axes their
    operands vary over (so JAX's replication check holds and the custom_vjp's cotangent types
    match their primals): gradients of batch-sharded operands, and of a key/value operand
    replicated while q is split by rows (its gradient summed over the two shards), equal those of
    the unsharded call; an out_specs that claims a replicated output is refused. (A child process:
    JAX's CPU device count is fixed at its start.)"""
    import subprocess
    import sys
    if not hasattr(jax, "shard_map"):
        pytest.skip("this JAX has no jax.shard_map")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                           os.environ.get("PYTHONPATH", "")]))
    code = SHARD_MAP_CHILD.format(tests=os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]
