"""cuflash.torch: the custom ops (fake shapes, autograd, torch.compile), CUDA-graph capture, and
the Hugging Face transformers backend.

CPU tests run wherever PyTorch is installed: they check the op registrations on meta tensors and,
with the kernels replaced by a float64 PyTorch reference (``ref_kernels``), the plumbing around
them (autograd, ``torch.compile(fullgraph=True)``, ``opcheck``, masks and windows in the
transformers backend against transformers' SDPA backend). GPU tests run the real kernels.
"""
import contextlib
import math
import subprocess
import sys
import types

import pytest

from conftest import GPU_PROBLEM, _has, requires_gpu, requires_torch



requires_transformers = pytest.mark.skipif(not _has("transformers"),
                                           reason="needs transformers (optional dependency)")


# ---------------------------------------------------------------------------------------------
# A float64 PyTorch reference with flash-attn semantics (CPU or GPU), standing in for the kernels

def _scores(q, k, causal, softmax_scale, window_size, softcap, alibi_slopes, sinks=None, attention_chunk=0):
    """float64 (b, h, sq, sk) probabilities, lse, visibility and tanh(s/softcap) (flash-attn
    semantics: masks aligned bottom-right; ``attention_chunk`` c: keys in the query's chunk of c
    positions only); K/V heads repeated for GQA. ``sinks`` (h,): one more
    column per row in the softmax, with no value (the lse includes it)."""
    import torch
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    kf = k.double().repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kf) * scale
    t = None
    if softcap:
        t = torch.tanh(s / softcap)
        s = softcap * t
    i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=q.device)[None, :]
    if alibi_slopes is not None:
        sl = alibi_slopes.double() if alibi_slopes.dim() == 2 else alibi_slopes.double()[None]
        s = s - sl[:, :, None, None] * (i - j).abs()
    left, right = window_size
    right = 0 if causal else right
    vis = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if left >= 0:
        vis &= j >= i - left
    if right >= 0:
        vis &= j <= i + right
    if attention_chunk:
        start = i - i % attention_chunk  # (torch's % is non-negative for a positive divisor)
        vis &= (j >= start) & (j < start + attention_chunk)
    s = s.masked_fill(~vis, float("-inf"))
    if sinks is not None:
        col = sinks.double()[None, :, None, None].expand(b, h, sq, 1)
        lse = torch.logsumexp(torch.cat([s, col], dim=-1), dim=-1)
        return torch.exp(s - lse[..., None]), lse, scale, t
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return p, lse.masked_fill(~vis.any(-1), float("inf")), scale, t


def ref_attention(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                  alibi_slopes=None, sinks=None, attention_chunk=0):
    """(out like q's dtype, lse float32 (b, h, sq)); layout (b, s, h, d)."""
    import torch
    p, lse, _, _ = _scores(q, k, causal, softmax_scale, window_size, softcap, alibi_slopes, sinks, attention_chunk)
    vf = v.double().repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    return torch.einsum("bhqk,bkhd->bqhd", p, vf).to(q.dtype), lse.float()


def ref_attention_backward(dout, q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None):
    """(dq, dk, dv) in float64 from the textbook formulas (dS = P * (dP - rowsum(dO * O)))."""
    import torch
    h, hk = q.shape[2], k.shape[2]
    p, _, scale, t = _scores(q, k, causal, softmax_scale, window_size, softcap, alibi_slopes)
    vf = v.double().repeat_interleave(h // hk, dim=2)
    kf = k.double().repeat_interleave(h // hk, dim=2)
    do = dout.double()
    o = torch.einsum("bhqk,bkhd->bqhd", p, vf)
    dvf = torch.einsum("bhqk,bqhd->bkhd", p, do)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, vf)
    ds = p * (dp - (do * o).sum(-1).transpose(1, 2)[..., None])
    if t is not None:
        ds = ds * (1 - t * t)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kf) * scale
    dkf = torch.einsum("bhqk,bqhd->bkhd", ds, q.double()) * scale
    fold = lambda x: x.reshape(*x.shape[:2], hk, h // hk, x.shape[-1]).sum(3)
    return dq, fold(dkf), fold(dvf)


def _segments(cu_q, cu_k):
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return [(slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])) for i in range(len(cq) - 1)]


def ref_attention_varlen(q, k, v, cu_q, cu_k, **kw):
    import torch
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=torch.float32, device=q.device)
    for sq_, sk_ in _segments(cu_q, cu_k):
        if sq_.stop > sq_.start:
            o, l = ref_attention(q[None, sq_], k[None, sk_], v[None, sk_], **kw)
            out[sq_], lse[:, sq_] = o[0], l[0]
    return out, lse


def _ref_grads(fwd, dout, inputs):
    """Gradients by autograd through a float64 reference (outside the custom ops)."""
    import torch
    with torch.enable_grad():
        xs = [x.detach().double().requires_grad_() for x in inputs]
        o, _ = fwd(*xs)
        grads = torch.autograd.grad(o.double() if o.dtype != torch.float64 else o, xs, dout.double())
    return [g.to(x.dtype) for g, x in zip(grads, inputs)]


def _storage(*xs):
    """The kernels read data pointers: functorch's wrapped tensors (which have none) must not
    reach them."""
    for x in xs:
        x.data_ptr()


@pytest.fixture
def ref_kernels(monkeypatch):
    """cuflash's kernels replaced by ``ref_attention``: the torch-side plumbing runs on the CPU.
    Records the keyword arguments of each call in ``calls``."""
    import torch
    import cuflash
    calls = []

    def attention(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, out=None,
                  num_splits=0, **feat):
        calls.append(("attention", tuple(q.shape), tuple(k.shape), dict(causal=causal, **feat)))
        _storage(q, k, v)
        o, lse = ref_attention(q, k, v, causal, softmax_scale, **feat)
        o = out.copy_(o) if out is not None else o.contiguous()  # (a new contiguous tensor, as the kernels give)
        return (o, lse) if return_lse else o

    def attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, causal=False, softmax_scale=None,
                         return_lse=False, out=None, num_splits=0, block_table=None, **feat):
        calls.append(("varlen", tuple(q.shape), tuple(k.shape), dict(causal=causal, **feat)))
        _storage(q, k, v)
        assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
        assert isinstance(max_q, int) and isinstance(max_k, int)
        o, lse = ref_attention_varlen(q, k, v, cu_q, cu_k, causal=causal, softmax_scale=softmax_scale,
                                      **feat)
        o = out.copy_(o) if out is not None else o
        return (o, lse) if return_lse else o

    def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None,
                           deterministic=False, dq=None, dk=None, dv=None, **feat):
        calls.append(("backward", tuple(q.shape), tuple(k.shape), dict(causal=causal, **feat)))
        _storage(dout, q, k, v, out, lse)
        assert dout.stride(-1) == 1
        g = ref_attention_backward(dout, q, k, v, causal, softmax_scale, **feat)
        return tuple(x.to(y.dtype) if buf is None else buf.copy_(x) for buf, x, y in zip((dq, dk, dv), g, (q, k, v)))

    def attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, causal=False,
                                  softmax_scale=None, deterministic=False, dq=None, dk=None, dv=None,
                                  **feat):
        calls.append(("varlen_backward", tuple(q.shape), tuple(k.shape), dict(causal=causal, **feat)))
        _storage(dout, q, k, v, out, lse)
        for sq_, sk_ in _segments(cu_q, cu_k):
            g = ref_attention_backward(dout[None, sq_], q[None, sq_], k[None, sk_], v[None, sk_],
                                       causal, softmax_scale, **feat)
            for buf, x, rows in zip((dq, dk, dv), g, (sq_, sk_, sk_)):
                buf[rows] = x[0]
        return dq, dk, dv

    bwd = types.ModuleType("cuflash.backward")
    bwd.attention_backward = attention_backward
    bwd.attention_varlen_backward = attention_varlen_backward
    bwd._repeats, bwd._signature = {}, lambda *args: None  # (no prepared backward to repeat)
    monkeypatch.setattr(cuflash, "attention", attention)
    monkeypatch.setattr(cuflash, "attention_varlen", attention_varlen, raising=False)
    import cuflash.backward  # noqa: F401  the real module first: undoing the patch restores it
    monkeypatch.setattr(cuflash, "backward", bwd)
    monkeypatch.setitem(sys.modules, "cuflash.backward", bwd)
    return calls


def _cpu(*shape, dtype="float64", seed=0, grad=False):
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=getattr(torch, dtype)).requires_grad_(grad)


# ---------------------------------------------------------------------------------------------
# CPU: import and registration

def test_import_cuflash_does_not_import_torch():
    code = "import sys, cuflash; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=__file__.rsplit("/tests/", 1)[0])
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


@requires_torch
def test_ops_registered():
    import torch
    import cuflash.torch  # noqa: F401
    for name in ("attention_fwd", "attention_bwd", "attention_varlen_fwd", "attention_varlen_bwd"):
        assert hasattr(torch.ops.cuflash, name), name


@requires_torch
@pytest.mark.parametrize("h,hk", [(8, 8), (8, 2)])
def test_fake_shapes_meta(h, hk):
    import torch
    import cuflash.torch as ct
    mk = lambda *s: torch.empty(*s, device="meta", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = mk(2, 17, h, 64), mk(2, 33, hk, 64), mk(2, 33, hk, 64)
    out, lse = ct.attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == (2, h, 17) and lse.dtype == torch.float32 and not lse.requires_grad
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape

    qv, kv, vv = mk(40, h, 64), mk(50, hk, 64), mk(50, hk, 64)
    cu = torch.empty(3, device="meta", dtype=torch.int32)
    out, lse = ct.attention_varlen(qv, kv, vv, cu, cu, 20, 25, causal=True, return_lse=True)
    assert out.shape == qv.shape and lse.shape == (h, 40)
    out.sum().backward()
    assert kv.grad.shape == kv.shape


@requires_torch
def test_fast_path_only_for_plain_cuda_inference():
    import torch
    from cuflash.torch import ops
    q = torch.empty(1, 4, 2, 8)
    assert ops._route(q, q, q) == "op"  # CPU tensors: through the op (which reports the CPU tensor)
    assert ops._route(torch.empty(1, 4, 2, 8, device="meta"), q, q) == "op"


@requires_torch
def test_cpu_tensor_error_is_cuflash_s():
    import torch
    import cuflash.torch as ct
    x = torch.zeros(1, 4, 2, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="CPU tensor"):
        ct.attention(x, x, x)


@requires_torch
def test_repeat_signature_keys_on_types_and_layout():
    """The key of cuflash.attention's repeated-call table: values with their types (True is not
    1), shapes, strides, dtypes and devices; None for calls the table never serves."""
    import torch
    from cuflash import api
    q = torch.zeros(2, 8, 4, 64, dtype=torch.float16)
    k = torch.zeros(2, 16, 2, 64, dtype=torch.float16)
    base = dict(out=None, causal=True, softmax_scale=None, return_lse=False, num_splits=0,
                window_size=(-1, -1), softcap=0.0, alibi_slopes=None)
    s0 = api._signature(q, k, k, **base)
    assert s0 is not None and s0 == api._signature(q.clone(), k.clone(), k.clone(), **base)
    for change in (dict(causal=1), dict(num_splits=False), dict(softcap=0), dict(return_lse=1),
                   dict(softmax_scale=0.125), dict(window_size=(3, 0)), dict(out=torch.empty_like(q))):
        assert api._signature(q, k, k, **{**base, **change}) != s0, change
    assert api._signature(q.transpose(1, 2).contiguous().transpose(1, 2), k, k, **base) != s0
    assert api._signature(q.to(torch.bfloat16), k, k, **base) != s0
    for skip in (dict(alibi_slopes=torch.ones(4)), dict(window_size=[-1, -1]), dict(window_size=(True, 0))):
        assert api._signature(q, k, k, **{**base, **skip}) is None, skip
    assert api._signature(q.numpy(), k, k, **base) is None
    assert api._signature(q, k.numpy(), k, **base) is None


@requires_torch
def test_extras_only_when_not_default():
    from cuflash.torch import ops
    assert ops._extras(-1, -1, 0.0, None) == {}
    assert ops._extras(3, 0, 30.0, None) == {"window_size": (3, 0), "softcap": 30.0}


@requires_torch
def test_calls_bind_to_cuflash_signatures():
    """The keyword arguments cuflash.torch passes exist in cuflash's entry points."""
    import inspect
    import cuflash
    from cuflash import backward
    extras = dict(window_size=(1, 0), softcap=1.0, alibi_slopes=None, sinks=None, dropout_p=0.1, seed=1, offset=2)
    inspect.signature(cuflash.attention).bind(1, 2, 3, causal=True, softmax_scale=None, return_lse=True, out=None,
                                              startend_row_indices=None, **extras)
    inspect.signature(cuflash.attention_varlen).bind(
        1, 2, 3, 4, 5, 6, 7, causal=True, softmax_scale=None, return_lse=True, out=None, block_table=None, **extras)
    grads = dict(causal=True, softmax_scale=None, deterministic=False, dq=None, dk=None, dv=None, **extras)
    inspect.signature(backward.attention_backward).bind(1, 2, 3, 4, 5, 6, startend_row_indices=None, **grads)
    inspect.signature(backward.attention_varlen_backward).bind(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, **grads)


# ---------------------------------------------------------------------------------------------
# CPU: plumbing with the reference kernels

@requires_torch
@pytest.mark.parametrize("causal", [False, True])
def test_autograd_plumbing(ref_kernels, causal):
    import torch
    import cuflash.torch as ct
    q, k, v = _cpu(2, 7, 4, 16, grad=True), _cpu(2, 11, 2, 16, seed=1, grad=True), _cpu(2, 11, 2, 16, seed=2, grad=True)
    out = ct.attention(q, k, v, causal=causal, softmax_scale=0.3)
    ref, _ = ref_attention(q, k, v, causal, 0.3)
    torch.testing.assert_close(out, ref)
    out.sum().backward()  # dout is an expanded tensor (stride 0): made contiguous for the kernel
    want = _ref_grads(lambda *x: ref_attention(*x, causal, 0.3), torch.ones_like(out), (q, k, v))
    for got, w in zip((q.grad, k.grad, v.grad), want):
        torch.testing.assert_close(got, w)
    assert [c[0] for c in ref_kernels] == ["attention", "backward"]


@requires_torch
def test_eager_autograd_function_plumbing(ref_kernels):
    """The autograd.Function that eager CUDA calls use: same forward, context and backward
    bodies as the custom op (run here on CPU tensors with the reference kernels)."""
    import torch
    from cuflash.torch import ops
    q, k, v = _cpu(2, 7, 4, 16, grad=True), _cpu(2, 11, 2, 16, seed=1, grad=True), _cpu(2, 11, 2, 16, seed=2, grad=True)
    out, lse = ops._EagerAttention.apply(q, k, v, True, 0.3, 5, 0, 0.0, None, False)
    ref, _ = ref_attention(q, k, v, True, 0.3, window_size=(5, 0))
    torch.testing.assert_close(out, ref)
    assert not lse.requires_grad
    dout = _cpu(2, 7, 4, 16, seed=3)
    out.backward(dout)
    want = _ref_grads(lambda *x: ref_attention(*x, True, 0.3, window_size=(5, 0)), dout, (q, k, v))
    for got, w in zip((q.grad, k.grad, v.grad), want):
        torch.testing.assert_close(got, w)
    assert [c[0] for c in ref_kernels] == ["attention", "backward"]
    assert ref_kernels[0][3]["window_size"] == (5, 0) and ref_kernels[1][3]["window_size"] == (5, 0)


@requires_torch
def test_prepared_backward_only_for_the_strides_it_was_made_for(ref_kernels, monkeypatch):
    """The eager Function of plain calls fires its prepared backward only for saved tensors with
    the strides it was made for. A saved-tensor hook (torch.autograd.graph.save_on_cpu) gives
    back contiguous copies of strided inputs (here q, k, v split from one packed tensor): those
    take the general backward."""
    import torch
    import cuflash
    from cuflash.torch import ops
    fired = []

    def grads(name):
        def run(dout, q, k, v, *args, **kwargs):
            fired.append(name)
            return tuple(torch.zeros_like(x) for x in (q, k, v))
        return run

    monkeypatch.setattr(cuflash.backward, "attention_backward", grads("general"))
    monkeypatch.setattr(cuflash.backward, "_repeats", {}, raising=False)  # no prepared launch on the CPU
    monkeypatch.setattr(cuflash.backward, "_signature", lambda *a: None, raising=False)
    base = _cpu(2, 7, 3, 4, 16, grad=True)
    p = ops._Prepared(True, 0.3, (-1, -1), 0.0, False)

    def step(hooks):
        q, k, v = base.unbind(2)
        with hooks:
            out, lse = ops._PreparedAttention.apply(q, k, v, p)
        torch.autograd.grad(out, base, torch.ones_like(out))
        return q, k, v, out, lse

    q, k, v, out, lse = step(contextlib.nullcontext())
    assert fired == ["general"] and q.stride() != q.contiguous().stride()
    p.bwd, p.bwd_strides = grads("prepared"), tuple(x.stride() for x in (q, k, v, out, lse))
    step(contextlib.nullcontext())
    assert fired == ["general", "prepared"]
    step(torch.autograd.graph.save_on_cpu(pin_memory=True))
    assert fired == ["general", "prepared", "general"]


@requires_torch
def test_eager_varlen_autograd_function_plumbing(ref_kernels):
    """The varlen autograd.Function of eager CUDA calls: the custom op's bodies, run here on CPU
    tensors with the reference kernels."""
    import torch
    from cuflash.torch import ops
    cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    q, k, v = (_cpu(12, 4, 16, seed=s, grad=True) for s in range(3))
    out, lse = ops._EagerVarlenAttention.apply(q, k, v, cu, cu, 7, 7, True, 0.3, -1, -1, 0.0, None, None, False)
    ref, _ = ref_attention_varlen(q, k, v, cu, cu, causal=True, softmax_scale=0.3)
    torch.testing.assert_close(out, ref)
    assert not lse.requires_grad
    dout = _cpu(12, 4, 16, seed=3)
    out.backward(dout)
    want = _ref_grads(lambda *x: ref_attention_varlen(*x, cu, cu, causal=True, softmax_scale=0.3), dout, (q, k, v))
    for got, w in zip((q.grad, k.grad, v.grad), want):
        torch.testing.assert_close(got, w)
    assert [c[0] for c in ref_kernels] == ["varlen", "varlen_backward"]


@requires_torch
@pytest.mark.parametrize("varlen", [False, True])
def test_torch_func_grad(ref_kernels, varlen):
    """torch.func.grad through the autograd.Functions that CUDA calls take under torch.func's
    transforms (run here on CPU tensors with the reference kernels, which like the real ones
    need tensors with storage, not functorch's wrappers) gives autograd's gradients. The eager
    Function (no setup_context) is refused by the transforms, hence the route."""
    import torch
    from cuflash.torch import ops
    q, k, v = _cpu(2, 7, 4, 16), _cpu(2, 7, 2, 16, seed=1), _cpu(2, 7, 2, 16, seed=2)
    if varlen:
        cu = torch.tensor([0, 7, 14], dtype=torch.int32)
        q, k, v = (x.reshape(14, *x.shape[2:]) for x in (q, k, v))
        attn = lambda q, k, v: ops._FuncVarlenAttention.apply(  # noqa: E731
            q, k, v, cu, cu, 7, 7, True, None, -1, -1, 0.0, None, None, False)[0]
        ref = lambda q, k, v: ref_attention_varlen(q, k, v, cu, cu, causal=True)  # noqa: E731
    else:
        attn = lambda q, k, v: ops._FuncAttention.apply(q, k, v, True, None, -1, -1, 0.0, None, False)[0]  # noqa: E731
        ref = lambda q, k, v: ref_attention(q, k, v, True)  # noqa: E731
    got = torch.func.grad(lambda q, k, v: attn(q, k, v).square().sum(), argnums=(0, 1, 2))(q, k, v)
    want = _ref_grads(ref, 2 * ref(q, k, v)[0], (q, k, v))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert [c[0] for c in ref_kernels] == (["varlen", "varlen_backward"] if varlen else ["attention", "backward"])
    args = (True, None, -1, -1, 0.0, None, False)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda q: ops._EagerAttention.apply(q, k, v, *args)[0].sum())(_cpu(2, 7, 4, 16))
    # a second order (grad of grad: hessians, meta-gradients) raises rather than giving zeros;
    # jacrev (a vmap over the backward) matches autograd's
    inner = lambda q: torch.func.grad(lambda q: attn(q, k, v).square().sum())(q).square().sum()  # noqa: E731
    with pytest.raises(RuntimeError, match="has no derivative"):
        torch.func.grad(inner)(q)
    jac = torch.func.jacrev(lambda q: attn(q, k, v).sum(-1))(q)
    torch.testing.assert_close(jac, torch.func.jacrev(lambda q: ref(q, k, v)[0].sum(-1))(q))
    linear = lambda q: torch.func.grad(lambda q: (attn(q, k, v) * 0.5).sum())(q).square().sum()  # noqa: E731
    with pytest.raises(RuntimeError, match="has no derivative"):  # (dout constant: tied to q through the saved)
        torch.func.grad(linear)(q)
    qg = q.detach().requires_grad_()
    g = torch.func.grad(lambda k: attn(qg, k, v).square().sum())(k)
    g.add_(1)  # (a new tensor: changed in place like any gradient)


@requires_torch
def test_autocast_runs_float32_inputs_in_its_dtype(ref_kernels):
    """Under torch.autocast float32 q, k, v run in autocast's dtype, as scaled_dot_product_attention
    does (output in that dtype, gradients back in float32); outside it they reach cuflash's dtype
    check."""
    import torch
    import cuflash.torch as ct
    q, k, v = (_cpu(2, 7, 4, 16, seed=i).float().requires_grad_() for i in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ct.attention(q, k, v, causal=True)
        packed = ct.attention_varlen(q[0], k[0], v[0], torch.tensor([0, 7], dtype=torch.int32),
                                     torch.tensor([0, 7], dtype=torch.int32), 7, 7, causal=True)
    assert out.dtype == packed.dtype == torch.bfloat16
    assert [c[0] for c in ref_kernels] == ["attention", "varlen"]
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and torch.isfinite(q.grad).all()


@requires_torch
def test_reference_kernel_fixture_leaves_the_real_backward():
    """After the tests above that patch cuflash.backward (ref_kernels), cuflash.torch reaches the
    real module again (it looks the module up as cuflash.backward on each call)."""
    import sys
    import cuflash
    import cuflash.torch  # noqa: F401
    assert cuflash.backward is sys.modules["cuflash.backward"]
    assert cuflash.backward.attention_backward.__module__ == "cuflash.backward"


@requires_torch
def test_varlen_autograd_plumbing(ref_kernels):
    import torch
    import cuflash.torch as ct
    cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    q, k, v = (_cpu(12, 4, 16, seed=s, grad=True) for s in range(3))
    out = ct.attention_varlen(q, k, v, cu, cu, 7, 7, causal=True)
    torch.testing.assert_close(out, ref_attention_varlen(q, k, v, cu, cu, causal=True)[0])
    out.square().sum().backward()
    assert q.grad.shape == q.shape and [c[0] for c in ref_kernels] == ["varlen", "varlen_backward"]


@requires_torch
def test_opcheck(ref_kernels):
    import torch
    import cuflash.torch  # noqa: F401
    q, k, v = _cpu(2, 5, 4, 8, grad=True), _cpu(2, 9, 2, 8, seed=1, grad=True), _cpu(2, 9, 2, 8, seed=2, grad=True)
    args = (q, k, v, True, None, -1, -1, 0.0, None, False)
    torch.library.opcheck(torch.ops.cuflash.attention_fwd.default, args)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    qv, kv, vv = (_cpu(8, 4, 8, seed=s, grad=True) for s in range(3))
    args = (qv, kv, vv, cu, cu, 5, 5, True, 0.5, -1, -1, 0.0, None, None, False)
    torch.library.opcheck(torch.ops.cuflash.attention_varlen_fwd.default, args)


@requires_torch
def test_compile_fullgraph_plumbing(ref_kernels):
    """No graph break around the ops (aot_eager: no C++ compiler needed on the CPU)."""
    import torch
    import cuflash.torch as ct

    def f(q, k, v):
        return ct.attention(q, k, v, causal=True, window_size=(3, 0)).sin().sum()

    q, k, v = _cpu(1, 6, 2, 8, grad=True), _cpu(1, 6, 2, 8, seed=1, grad=True), _cpu(1, 6, 2, 8, seed=2, grad=True)
    torch._dynamo.reset()
    fc = torch.compile(f, fullgraph=True, backend="aot_eager")
    fc(q, k, v).backward()
    got = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    f(q, k, v).backward()
    for a, x in zip(got, (q, k, v)):
        torch.testing.assert_close(a, x.grad)
    assert {c[3].get("window_size") for c in ref_kernels} == {(3, 0)}


@requires_torch
def test_record_plans(ref_kernels, monkeypatch):
    import torch
    import cuflash
    import cuflash.torch as ct
    real_plan = cuflash.plan
    monkeypatch.setattr(cuflash, "plan", lambda q, k, v, **kw: real_plan(
        tuple(q.shape), tuple(k.shape), tuple(v.shape), num_sms=132, **kw))
    seen = []
    with ct.record_plans(callback=seen.append) as plans:
        for sk in (100, 100, 1000):  # the repeated shape is recorded once
            q = torch.zeros(1, 1, 32, 128, dtype=torch.bfloat16)
            k = torch.zeros(1, sk, 8, 128, dtype=torch.bfloat16)
            ct.attention(q, k, k)
        ct.attention(torch.zeros(1, 64, 32, 128), torch.zeros(1, 64, 8, 128), torch.zeros(1, 64, 8, 128),
                     causal=True)
    assert ct.last_plans() == plans == seen and len(plans) == 3
    assert [r.phase for r in plans] == ["decode", "decode", "prefill"]
    assert plans[1].num_splits > 1 and len(plans[1].kernels) == 2 and "splits" in str(plans[1])
    n = len(plans)
    ct.attention(torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2, 8))
    assert len(ct.last_plans()) == n  # not recording outside the block


# ---------------------------------------------------------------------------------------------
# CPU: the transformers backend against transformers' SDPA backend (reference kernels)

def _tiny_qwen2(attn, dtype="float32", device="cpu", seed=0, **over):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config
    import cuflash.torch as ct
    ct.register_transformers()
    cfg = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
               initializer_range=0.1, tie_word_embeddings=False)
    cfg.update(over)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**cfg), attn_implementation=attn,
                                             dtype=getattr(torch, dtype))
    return model.to(device).eval()


def _tiny_gpt_oss(attn, dtype="float32", device="cpu", seed=0, **over):
    """A random gpt-oss-shaped model (sliding-window and full layers, attention sinks, a
    mixture of experts), larger sinks than its initialisation gives so that they matter."""
    import torch
    import transformers
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no gpt-oss (4.55 or newer has)")
    from transformers import AutoModelForCausalLM, GptOssConfig
    import cuflash.torch as ct
    ct.register_transformers()
    cfg = dict(vocab_size=512, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=16,
               num_local_experts=2, num_experts_per_tok=2, initializer_range=0.1, tie_word_embeddings=False)
    cfg.update(over)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(GptOssConfig(**cfg), attn_implementation=attn,
                                             dtype=getattr(torch, dtype))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return model.to(device).eval()


def _pair(**over):
    """The same weights under the cuflash and the sdpa backend."""
    a = _tiny_qwen2("cuFlash", **over)
    b = _tiny_qwen2("sdpa", **over)
    b.load_state_dict(a.state_dict())
    return a, b


@requires_torch
@requires_transformers
def test_hf_gpt_oss_sinks_and_windows_match_eager(ref_kernels):
    """A gpt-oss-shaped model on the cuflash backend (reference kernels standing in) gives eager
    attention's logits and greedy tokens: s_aux reaches the kernels as sinks, sliding layers as
    a window of sliding_window - 1 keys to the left."""
    import torch
    a = _tiny_gpt_oss("cuFlash")
    b = _tiny_gpt_oss("eager")
    b.load_state_dict(a.state_dict())
    ids = torch.randint(1, 512, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(a(ids).logits, b(ids).logits, rtol=1e-5, atol=1e-5)
        ta = a.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
        tb = b.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(ta, tb)
    assert all("sinks" in c[3] for c in ref_kernels)
    assert {c[3].get("window_size", (-1, -1)) for c in ref_kernels if c[1][1] > 1} == {(15, 15), (-1, -1)}


@requires_torch
@requires_transformers
def test_hf_registration():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    import cuflash.torch as ct
    assert ct.register_transformers() == "cuFlash"
    assert AttentionInterface()["cuFlash"] is ct.hf_attention_forward
    assert "cuFlash" in AttentionMaskInterface()
    model = _tiny_qwen2("cuFlash")
    assert model.config._attn_implementation == "cuFlash"
    with pytest.raises(ValueError, match="flash"):
        ct.register_transformers("cuflash")  # transformers would look for a flash-attn build


@requires_torch
@requires_transformers
def test_hf_logits_and_generate_match_sdpa(ref_kernels):
    import torch
    a, b = _pair()
    ids = torch.randint(1, 512, (1, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(a(ids).logits, b(ids).logits, rtol=1e-5, atol=1e-5)
        ta = a.generate(ids, max_new_tokens=12, do_sample=False)
        tb = b.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(ta, tb)
    kinds = {(c[0], c[1][1] == 1, c[3]["causal"]) for c in ref_kernels}
    assert kinds == {("attention", False, True), ("attention", True, False)}  # prefill, decode


@requires_torch
@requires_transformers
def test_hf_left_padding_uses_varlen(ref_kernels):
    import torch
    a, b = _pair()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 512, (2, 15), generator=g)
    mask = torch.ones(2, 15, dtype=torch.long)
    mask[0, :6] = 0  # left padding
    with torch.no_grad():
        la, lb = a(ids, attention_mask=mask).logits, b(ids, attention_mask=mask).logits
        torch.testing.assert_close(la[0, 6:], lb[0, 6:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(la[1], lb[1], rtol=1e-5, atol=1e-5)
        ta = a.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        tb = b.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(ta, tb)
    assert {c[0] for c in ref_kernels} == {"varlen"}


@requires_torch
@requires_transformers
def test_hf_sliding_window_matches_sdpa(ref_kernels):
    import torch
    a, b = _pair(use_sliding_window=True, sliding_window=5, max_window_layers=0,
                 layer_types=["sliding_attention", "sliding_attention"])
    ids = torch.randint(1, 512, (1, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(a(ids).logits, b(ids).logits, rtol=1e-5, atol=1e-5)
        ta = a.generate(ids, max_new_tokens=6, do_sample=False)
        tb = b.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(ta, tb)
    # prefill runs with the window; the sliding cache then holds at most 5 keys, all visible
    assert {c[3].get("window_size") for c in ref_kernels if c[1][1] > 1} == {(4, 4)}
    assert {c[2][1] for c in ref_kernels if c[1][1] == 1} == {5}


@requires_torch
@requires_transformers
def test_hf_packed_position_ids_use_varlen(ref_kernels):
    """Two sequences packed in one row (position_ids restart): each attends only to itself."""
    import torch
    a, b = _pair()
    ids = torch.randint(1, 512, (1, 12), generator=torch.Generator().manual_seed(4))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        la = a(ids, position_ids=pos).logits
        l1 = b(ids[:, :5]).logits
        l2 = b(ids[:, 5:]).logits
    torch.testing.assert_close(la, torch.cat([l1, l2], dim=1), rtol=1e-5, atol=1e-5)
    assert {c[0] for c in ref_kernels} == {"varlen"}


@requires_torch
@requires_transformers
@pytest.mark.parametrize("padded", [False, True])
def test_hf_training_step_plumbing(ref_kernels, padded):
    import torch
    a, b = _pair()
    a.train(), b.train()
    ids = torch.randint(1, 512, (2, 10), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, 7:] = 0  # right padding, as in training batches
    labels = ids.masked_fill(mask == 0, -100)  # padded rows differ by design (0 in cuflash)
    a(ids, attention_mask=mask, labels=labels).loss.backward()
    b(ids, attention_mask=mask, labels=labels).loss.backward()
    ga, gb = dict(a.named_parameters()), dict(b.named_parameters())
    for n in ga:
        torch.testing.assert_close(ga[n].grad, gb[n].grad, rtol=1e-4, atol=1e-5, msg=n)
    assert {c[0] for c in ref_kernels} == ({"varlen", "varlen_backward"} if padded else
                                           {"attention", "backward"})


@requires_torch
@requires_transformers
@pytest.mark.parametrize("padded", [False, True])
def test_hf_dropout_goes_to_cuflash(monkeypatch, padded):
    """A model's attention_dropout reaches cuflash as dropout_p in training (dense and, with
    padding, varlen calls), and no dropout in eval."""
    import torch
    from cuflash.torch import hf
    calls = []

    def record(name):
        def fn(q, *args, **kw):
            calls.append((name, kw.get("dropout_p")))
            return torch.zeros_like(q)
        return fn
    monkeypatch.setattr(hf, "attention", record("attention"))
    monkeypatch.setattr(hf, "attention_varlen", record("varlen"))
    model = _tiny_qwen2("cuFlash", attention_dropout=0.25)
    ids = torch.arange(1, 7)[None].repeat(2, 1)
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]]) if padded else None
    kind = "varlen" if padded else "attention"
    model.train()(ids, attention_mask=mask)
    assert calls == [(kind, 0.25)] * 2  # one call per layer
    calls.clear()
    model.eval()(ids, attention_mask=mask)
    assert calls == [(kind, None)] * 2


@requires_torch
@requires_transformers
def test_hf_dropout_with_sinks_is_refused(monkeypatch):
    """gpt-oss (attention sinks) with attention dropout in training: a clear error before any
    kernel (cuflash has no dropout with sinks)."""
    import torch
    from cuflash.torch import hf
    monkeypatch.setattr(hf, "attention", lambda *a, **k: pytest.fail("reached cuflash"))
    model = _tiny_gpt_oss("cuFlash", attention_dropout=0.1).train()
    with pytest.raises(NotImplementedError, match="sinks"):
        model(torch.arange(1, 7)[None])


@requires_torch
@pytest.mark.parametrize("padded", [False, True])
def test_hf_chunked_attention(ref_kernels, padded):
    """Llama 4's chunked attention (config.attention_chunk_size, on the layers that
    config.layer_types calls chunked): below a chunk of keys causal attention; from a chunk on,
    a call whose keys are its own queries runs with attention_chunk (chunks counted from each
    sequence's first token, past left padding), output and gradients; a call with earlier keys
    (a cache) is refused before any kernel, not attention across chunks; a full-attention layer
    of the same config attends over every key."""
    import types
    import torch
    from cuflash.torch.hf import hf_attention_forward
    cfg = types.SimpleNamespace(attention_chunk_size=4, layer_types=["chunked_attention", "full_attention"])
    chunked, full = (types.SimpleNamespace(config=cfg, layer_idx=i, is_causal=True) for i in (0, 1))
    for n in (3, 4, 6, 11):
        q, k, v = (_cpu(2, 2, n, 8, seed=s, grad=True) for s in range(3))  # (batch, heads, seqlen, d)
        mask = None
        if padded:  # batch 1 left-padded by 2 tokens
            mask = torch.ones(2, n, dtype=torch.long)
            mask[1, :2] = 0
        out, _ = hf_attention_forward(chunked, q, k, v, mask, scaling=0.3)
        for b in range(2):
            pad = 2 if padded and b == 1 else 0
            x = [t[b:b + 1, :, pad:].transpose(1, 2) for t in (q, k, v)]
            want, _ = ref_attention(*x, True, 0.3, attention_chunk=4)
            torch.testing.assert_close(out[b:b + 1, pad:], want)
            if b == 0:
                g = torch.autograd.grad(out[0].sum(), (q, k, v))
                gw = torch.autograd.grad(want.sum(), (q, k, v))
                for a, w in zip(g, gw):
                    torch.testing.assert_close(a[:1], w[:1])
        out_full, _ = hf_attention_forward(full, q, k, v, None, scaling=0.3)
        torch.testing.assert_close(out_full, ref_attention(*(t.transpose(1, 2) for t in (q, k, v)), True, 0.3)[0])
    calls = len(ref_kernels)
    q, k, v = (_cpu(1, 2, 6, 8, seed=s) for s in range(3))
    with pytest.raises(NotImplementedError, match="over 6 keys with 1 new tokens"):  # a padding mask counts its keys
        hf_attention_forward(chunked, q[:, :, :1], k, v, torch.ones(1, 6, dtype=torch.bool), scaling=0.3)
    with pytest.raises(NotImplementedError, match="attention_chunk_size=4"):
        hf_attention_forward(chunked, q[:, :, 3:], k, v, None, scaling=0.3)
    assert len(ref_kernels) == calls


@requires_torch
@pytest.mark.parametrize("sq", [1, 3, 5, 7])
def test_hf_padded_keys_without_causal_mask(ref_kernels, sq):
    """Cross-attention over a padded encoder (queries of another length than the keys) and an
    encoder's own attention (sq == kv_len): the 2D mask is the keys'; every query row matches
    SDPA with that key mask, padded rows included."""
    import types
    import torch
    from cuflash.torch.hf import hf_attention_forward
    module = types.SimpleNamespace(is_causal=False)
    q = _cpu(2, 4, sq, 8)
    k, v = _cpu(2, 2, 5, 8, seed=1), _cpu(2, 2, 5, 8, seed=2)
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]])  # encoder rows padded on the left, on the right
    out, _ = hf_attention_forward(module, q, k, v, mask, scaling=0.3)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask[:, None, None, :].bool(), scale=0.3)
    torch.testing.assert_close(out, want.transpose(1, 2))
    assert ref_kernels[-1][0] == "varlen"


def _bart_pair():
    """A tiny BART (float64) under the cuflash and the sdpa backend, with the same weights."""
    import torch
    from transformers import BartConfig, BartForConditionalGeneration
    import cuflash.torch as ct
    ct.register_transformers()
    models = []
    for attn in ("cuFlash", "sdpa"):
        cfg = BartConfig(vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                         decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64)
        torch.manual_seed(0)
        models.append(BartForConditionalGeneration._from_config(cfg, attn_implementation=attn, dtype=torch.float64).eval())
    return models


@requires_torch
@requires_transformers
@pytest.mark.parametrize("dec_len", [4, 12])
def test_hf_bart_padded_encoder_matches_sdpa(ref_kernels, dec_len):
    """An encoder-decoder (BART) with a padded encoder batch: the encoder's attention and the
    decoder's cross-attention (decoder length unlike the encoder's) match SDPA's logits."""
    import torch
    models = _bart_pair()
    g = torch.Generator().manual_seed(0)
    ids, dec = torch.randint(3, 100, (2, 9), generator=g), torch.randint(3, 100, (2, dec_len), generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    with torch.no_grad():
        a, b = (m(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits for m in models)
    torch.testing.assert_close(a, b)
    assert any(c[0] == "varlen" for c in ref_kernels)


@requires_torch
@requires_transformers
@pytest.mark.parametrize("enc_len,dec_len", [(9, 4), (4, 9)])
def test_hf_bart_without_a_mask_matches_sdpa(ref_kernels, enc_len, dec_len):
    """No attention_mask (no padding): the decoder's cross-attention sees every encoder token, also
    where the encoder's output is longer than the decoder's input (transformers' bidirectional
    mask is not a static cache's)."""
    import torch
    models = _bart_pair()
    g = torch.Generator().manual_seed(0)
    ids, dec = torch.randint(3, 100, (2, enc_len), generator=g), torch.randint(3, 100, (2, dec_len), generator=g)
    with torch.no_grad():
        a, b = (m(input_ids=ids, decoder_input_ids=dec).logits for m in models)
    torch.testing.assert_close(a, b)
    assert all(c[2][1] in (enc_len, dec_len) for c in ref_kernels)  # (every key: none cut)


@requires_torch
@requires_transformers
def test_hf_inference_mode_matches_sdpa(ref_kernels):
    """Under torch.inference_mode (inference tensors have no version counter): a batch-1 prefill
    (its position_ids read once per pass) and a left-padded batch give SDPA's logits."""
    import torch
    a, b = _pair()
    ids = torch.randint(1, 512, (1, 23), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(a(ids).logits, b(ids).logits, rtol=1e-5, atol=1e-5)
    ids = torch.randint(1, 512, (2, 15), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 15, dtype=torch.long)
    mask[0, :6] = 0
    with torch.inference_mode():
        la, lb = a(ids, attention_mask=mask).logits, b(ids, attention_mask=mask).logits
    torch.testing.assert_close(la[:, -1], lb[:, -1], rtol=1e-5, atol=1e-5)


@requires_torch
@requires_transformers
def test_hf_forward_float32_queries_dtype_position_bias_and_determinism(ref_kernels, monkeypatch):
    """As transformers' flash backend: float32 queries (PEFT's float32 layer norms) run in the
    dtype of the module's first Linear weight; FLASH_ATTENTION_DETERMINISTIC=1 is the default of
    deterministic; a position_bias (T5's) goes through transformers' SDPA function, not an error."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from cuflash.torch import hf
    from cuflash.torch.hf import hf_attention_forward
    seen = []  # (q's dtype, the options) of each call of cuflash.torch.attention
    monkeypatch.setattr(hf, "attention", lambda q, k, v, **kw: seen.append((q.dtype, kw)) or q.new_zeros(q.shape))

    class Attn(torch.nn.Module):
        is_causal = True

        def __init__(self, dtype):
            super().__init__()
            self.q_proj = torch.nn.Linear(8, 8, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
    hf_attention_forward(Attn(torch.bfloat16), q, k, v, None)
    assert seen[-1][0] == torch.bfloat16 and seen[-1][1]["deterministic"] is False
    monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "1")
    hf_attention_forward(Attn(torch.float32), q, k, v, None)
    assert seen[-1][0] == torch.float32 and seen[-1][1]["deterministic"] is True
    hf_attention_forward(Attn(torch.float32), q, k, v, None, deterministic=False)
    assert seen[-1][1]["deterministic"] is False
    bias, calls = torch.randn(1, 2, 5, 5, generator=g), len(seen)
    monkeypatch.setattr(hf, "_warned", set())  # (the warning is once per process)
    with pytest.warns(UserWarning, match="position_bias"):
        got, _ = hf_attention_forward(Attn(torch.float32), q, k, v, None, position_bias=bias)
    want, _ = sdpa_attention_forward(Attn(torch.float32), q, k, v, None, is_causal=True, position_bias=bias)
    torch.testing.assert_close(got, want)
    assert len(seen) == calls
    # over a cache (3 new queries, 8 keys, no padding): bottom-right causal, as every other call
    kc, vc = (torch.randn(1, 2, 8, 8, generator=g) for _ in range(2))
    bias = torch.randn(1, 2, 3, 8, generator=g)
    got, _ = hf_attention_forward(Attn(torch.float32), q[:, :, :3], kc, vc, None, position_bias=bias, scaling=1.0)
    seen_keys = torch.arange(8)[None, :] <= torch.arange(3)[:, None] + 5
    want = torch.nn.functional.scaled_dot_product_attention(q[:, :, :3], kc, vc, scale=1.0, attn_mask=torch.where(
        seen_keys, bias, float("-inf"))).transpose(1, 2)
    torch.testing.assert_close(got, want)
    # a static cache of 12 slots of which 8 are keys (the 2D mask's length), the bias over every slot
    ks, vs = (torch.cat([x, torch.randn(1, 2, 4, 8, generator=g)], dim=2) for x in (kc, vc))
    bias12 = torch.cat([bias, torch.randn(1, 2, 3, 4, generator=g)], dim=-1)
    got, _ = hf_attention_forward(Attn(torch.float32), q[:, :, :3], ks, vs, torch.ones(1, 8, dtype=torch.bool),
                                  position_bias=bias12, scaling=1.0)
    torch.testing.assert_close(got, want)


@requires_torch
@requires_transformers
def test_hf_llama4_chunked_attention(ref_kernels):
    """A tiny Llama 4 text model (chunks of 8 tokens; layer 1 of 2 full attention, as Llama 4's
    NoPE layers): below a chunk and on a longer first input (batched, left-padded) its logits
    match SDPA's, and so do a training step's gradients and a greedy generation past several
    chunks (its chunked layers' caches keep 7 tokens; each step gets its chunk's keys from the
    mask function); several new tokens over such a cache run through SDPA with transformers' mask
    (not attending across chunks)."""
    import torch
    import transformers
    if not hasattr(transformers, "Llama4TextConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Llama 4")
    from transformers import Llama4ForCausalLM, Llama4TextConfig
    import cuflash.torch as ct
    ct.register_transformers()
    models = []
    for attn in ("cuFlash", "sdpa"):  # a config each: the model keeps its implementation there
        cfg = Llama4TextConfig(vocab_size=128, hidden_size=64, intermediate_size=64, intermediate_size_mlp=64,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                               attention_chunk_size=8, initializer_range=0.1, no_rope_layers=[1, 0])
        torch.manual_seed(0)
        models.append(Llama4ForCausalLM._from_config(cfg, attn_implementation=attn, dtype=torch.float64).eval())
    assert models[0].config._attn_implementation == "cuFlash"
    assert models[0].config.layer_types == ["chunked_attention", "full_attention"]
    ids = torch.randint(1, 128, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        first = models[0](ids, use_cache=True)
        torch.testing.assert_close(first.logits, models[1](ids).logits)
        assert ref_kernels  # cuflash ran
        long = torch.randint(1, 128, (2, 21), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(long)
        mask[1, :5] = 0  # left padding
        got, want = (m(long, attention_mask=mask).logits for m in models)
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1, 5:], want[1, 5:])
        # after a 9-token prompt, a one-token step (position 9, chunk 1: its row of keys) and then
        # two tokens over the chunked cache (transformers' 4D mask through SDPA), as SDPA's own
        caches = [m(long[:1, :9], use_cache=True).past_key_values for m in models]
        for new in (ids[:, :1], ids[:, 1:3]):
            got, want = (m(new, past_key_values=c) for m, c in zip(models, caches))
            torch.testing.assert_close(got.logits, want.logits)
        gen = [m.generate(long, attention_mask=mask, max_new_tokens=19, do_sample=False, pad_token_id=0,
                          eos_token_id=None, output_logits=True, return_dict_in_generate=True) for m in models]
        assert torch.equal(gen[0].sequences, gen[1].sequences)
        for a, b in zip(gen[0].logits, gen[1].logits):
            torch.testing.assert_close(a[0], b[0])
            torch.testing.assert_close(a[1], b[1])
    grads = []
    for m in models:
        m.train().zero_grad()
        m(long[:1], labels=long[:1]).loss.backward()
        grads.append([p.grad for p in m.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def _tiny_llama4_pair(chunk=8, no_rope=(1, 0)):
    """Tiny Llama 4 text models (float64) with the cuflash backend and with SDPA, same weights."""
    import torch
    from transformers import Llama4ForCausalLM, Llama4TextConfig
    import cuflash.torch as ct
    ct.register_transformers()
    models = []
    for attn in ("cuFlash", "sdpa"):
        cfg = Llama4TextConfig(vocab_size=128, hidden_size=64, intermediate_size=64, intermediate_size_mlp=64,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                               attention_chunk_size=chunk, initializer_range=0.1, no_rope_layers=list(no_rope))
        torch.manual_seed(0)
        models.append(Llama4ForCausalLM._from_config(cfg, attn_implementation=attn, dtype=torch.float64).eval())
    return models


@requires_torch
@requires_transformers
@pytest.mark.parametrize("case", ["static", "static_padded", "static_short", "static_short_padded", "right_padded",
                                  "batch1", "short_prompt", "long_padding", "all_ones"])
@pytest.mark.parametrize("no_rope", [(1, 0), (1, 1)])
def test_hf_llama4_generation_cases(ref_kernels, case, no_rope):
    """Greedy generation across chunk boundaries (chunks of 8) in the ways transformers runs it:
    static caches (with and without a padding mask: their empty slots are no keys), left and
    right padding, one sequence, a prompt shorter than a chunk: tokens and logits as SDPA's."""
    import torch
    import transformers
    if not hasattr(transformers, "Llama4TextConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Llama 4")
    models = _tiny_llama4_pair(no_rope=no_rope)
    ids = torch.randint(1, 128, (2, 21), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    kw = dict(cache_implementation="static") if case.startswith("static") else {}
    if case in ("static", "batch1"):
        mask = None
    if case == "batch1":
        ids = ids[:1]
    if case.startswith("static_short") or case == "short_prompt":
        ids, mask = ids[:, :5], (None if case == "static_short" else torch.tensor([[1] * 5, [0, 0, 1, 1, 1]]))
    if case == "right_padded":
        mask = torch.ones_like(ids)
        mask[1, -3:] = 0
    if case == "long_padding":
        mask[1, :13] = 0
    if case == "all_ones":
        mask = torch.ones_like(ids)
    run = lambda m: m.generate(ids, attention_mask=mask, max_new_tokens=19, do_sample=False, pad_token_id=0,  # noqa
                               eos_token_id=None, output_logits=True, return_dict_in_generate=True, **kw)
    with torch.no_grad():
        try:
            want = run(models[1])
        except TypeError as e:  # (transformers 5.17's static-cache generation of Llama 4 fails with SDPA too)
            pytest.skip(f"transformers {transformers.__version__} cannot run this with SDPA: {e}")
        gen = [run(models[0]), want]
    rows = slice(0, 1) if case == "right_padded" else slice(None)  # (as flash-attn's backends, cuflash
    # gives padded query rows zeros, where SDPA attends from them: right padding's next token differs)
    assert torch.equal(gen[0].sequences[rows], gen[1].sequences[rows])
    for a, b in zip(gen[0].logits, gen[1].logits):
        torch.testing.assert_close(a[rows], b[rows])


def _load_example():
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                        "hf_generate.py")
    spec = importlib.util.spec_from_file_location("hf_generate_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_example_exits_cleanly_without_gpu():
    if GPU_PROBLEM is None:
        pytest.skip("a GPU is present: the example runs for real (see test_gpu_example)")
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, os.path.join(root, "examples", "hf_generate.py")],
                       capture_output=True, text=True, cwd=root)
    assert r.returncode == 0 and "needs" in r.stdout and not r.stderr, (r.stdout, r.stderr)


@requires_torch
@requires_transformers
@pytest.mark.parametrize("batch", [1, 2])
def test_example_logic_on_cpu(ref_kernels, monkeypatch, batch):
    """The example's generate / compare / plan summary, with the reference kernels and plans
    made for a 132-SM GPU."""
    import cuflash
    real_plan = cuflash.plan
    monkeypatch.setattr(cuflash, "plan", lambda q, k, v, **kw: real_plan(
        tuple(q.shape), tuple(k.shape), tuple(v.shape), num_sms=132, **kw))
    ex = _load_example()
    cfg = ex.tiny_qwen2_config(hidden_size=256, intermediate_size=512, num_attention_heads=8,
                               num_key_value_heads=2, head_dim=32, vocab_size=512)
    lines = []
    seq, seq_ref, plans = ex.run(prompt_len=40, new_tokens=30, batch=batch, device="cpu",
                                 dtype="float32", config=cfg, out=lines.append)
    assert "tokens agree" in lines[1], lines
    text = "\n".join(lines)
    if batch == 1:
        assert "prefill" in text and "decode" in text and "seqlen_k 40..69" not in text
        assert [r.phase for r in plans][0] == "prefill"
    else:
        assert {r.phase for r in plans} == {"varlen"}


# ---------------------------------------------------------------------------------------------
# GPU

def _cuda(g, *shape, dtype="bfloat16", grad=False):
    import torch
    x = torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(getattr(torch, dtype))
    return x.requires_grad_(grad)


def _gen(seed):
    import torch
    return torch.Generator(device="cuda").manual_seed(seed)


def _np(x):
    from test_gpu_forward import to_np
    return to_np(x)


@requires_gpu
@requires_torch
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("sq,sk,h,hk,d,causal", [(113, 203, 4, 4, 64, True), (1, 339, 8, 2, 128, False),
                                                 (256, 256, 8, 2, 128, True), (64, 800, 4, 1, 96, False)])
def test_gpu_forward_matches_cuflash(dtype, sq, sk, h, hk, d, causal):
    """Both paths (direct call without autograd, custom op with it) run the same kernels."""
    import torch
    import cuflash
    import cuflash.torch as ct
    g = _gen(sq * 1000 + sk)
    q, k, v = _cuda(g, 2, sq, h, d, dtype=dtype), _cuda(g, 2, sk, hk, d, dtype=dtype), _cuda(g, 2, sk, hk, d, dtype=dtype)
    want, wlse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    with torch.no_grad():
        got, lse = ct.attention(q, k, v, causal=causal, return_lse=True)
    assert torch.equal(got, want) and torch.equal(lse, wlse)
    for x in (q, k, v):
        x.requires_grad_()
    got, lse = ct.attention(q, k, v, causal=causal, return_lse=True)
    assert got.requires_grad and got.is_contiguous()
    assert torch.equal(got.detach(), want) and torch.equal(lse, wlse)
    from test_gpu_forward import check
    check(got.detach(), q.detach(), k.detach(), v.detach(), causal=causal)


@requires_gpu
@requires_torch
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("sq,sk,h,hk,d,causal", [(113, 203, 4, 4, 64, True), (128, 128, 4, 2, 128, True),
                                                 (97, 161, 6, 2, 128, False), (256, 512, 4, 1, 64, False),
                                                 (33, 65, 2, 2, 96, True)])
def test_gpu_gradients_vs_reference(dtype, sq, sk, h, hk, d, causal):
    """Autograd gradients against the float64 reference, with flash-attn's backward rule:
    max|grad - ref64| <= 3 * max|ref_same_precision - ref64| + 1e-4."""
    import cuflash.torch as ct
    from cuflash import reference
    g = _gen(7 * sq + sk)
    q, k, v = (_cuda(g, 2, n, hh, d, dtype=dtype, grad=True) for n, hh in ((sq, h), (sk, hk), (sk, hk)))
    out = ct.attention(q, k, v, causal=causal)
    dout = _cuda(g, *out.shape, dtype=dtype)
    out.backward(dout)
    args = [_np(x.detach()) for x in (dout, q, k, v)]
    ref64 = reference.attention_backward(*args, causal=causal, softmax_scale=None, precision="float64")
    ref_lp = reference.attention_backward(*args, causal=causal, softmax_scale=None, precision="same")
    from cuflash.reference import max_abs_err
    for name, got, r64, rlp in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), ref64, ref_lp):
        err, bound = max_abs_err(_np(got), r64), 3 * max_abs_err(rlp, r64) + 1e-4
        assert err <= bound, f"{name}: max error {err:.3g} exceeds {bound:.3g}"


@requires_torch
def test_create_graph_through_checkpoint(ref_kernels, monkeypatch):
    """The eager Function of the custom op's bodies (ALiBi) with create_graph=True inside a
    non-reentrant checkpoint, whose hooks allow one unpack of each saved tensor: gradients as
    without either, and differentiating them again raises."""
    import torch
    import torch.utils.checkpoint as checkpoint
    import cuflash.torch as ct
    from cuflash.torch import ops
    monkeypatch.setattr(ops, "_route", lambda *a, **kw: "autograd" if torch.is_grad_enabled() else "direct")
    q, k, v = (_cpu(1, 6, 2, 8, seed=i, grad=True) for i in range(3))
    slopes = torch.tensor([0.1, 0.2], dtype=torch.float64)

    def loss(q, k, v):
        return ct.attention(q, k, v, causal=True, alibi_slopes=slopes).square().sum()

    got = torch.autograd.grad(checkpoint.checkpoint(loss, q, k, v, use_reentrant=False), (q, k, v),
                              create_graph=True)
    want = torch.autograd.grad(loss(q, k, v), (q, k, v))
    for a, b in zip(got, want):
        assert a.requires_grad
        torch.testing.assert_close(a, b)
    with pytest.raises(RuntimeError, match="has no derivative"):
        torch.autograd.grad(got[0].square().sum() + q.sum(), q)


@requires_gpu
@requires_torch
@pytest.mark.parametrize("mods", [dict(), dict(alibi_slopes=True)], ids=["prepared", "alibi"])
def test_gpu_double_backward_raises(mods):
    """Gradients taken with create_graph=True match the plain ones; differentiating them again
    raises (cuflash's backward has no derivative) rather than leaving out their share. Both eager
    Functions: the prepared one (plain calls) and the custom op's bodies (ALiBi)."""
    import torch
    import cuflash.torch as ct
    g = _gen(3)
    q, k, v = (_cuda(g, 2, 64, 4, 64, dtype="bfloat16", grad=True) for _ in range(3))
    if mods:
        mods = dict(alibi_slopes=torch.rand(4, device="cuda"))
    loss = lambda: ct.attention(q, k, v, causal=True, deterministic=True, **mods).float().square().sum()  # noqa: E731
    want = torch.autograd.grad(loss(), (q, k, v))
    got = torch.autograd.grad(loss(), (q, k, v), create_graph=True)
    for a, b in zip(got, want):
        assert a.requires_grad and torch.equal(a, b)
    with pytest.raises(RuntimeError, match="has no derivative"):
        torch.autograd.grad(sum(x.float().square().sum() for x in got) + q.float().sum(), q)


@requires_gpu
@requires_torch
@pytest.mark.parametrize("varlen", [False, True])
def test_gpu_torch_func_grad(varlen):
    """torch.func.grad of a loss through cuflash.torch.attention / attention_varlen on CUDA
    tensors gives autograd's gradients bit for bit (deterministic backward)."""
    import torch
    import cuflash.torch as ct
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 150, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    cu = torch.tensor([0, 100, 300], dtype=torch.int32, device="cuda")
    if varlen:
        q, k, v = (x.reshape(300, 4, 64) for x in (q, k, v))
        attn = lambda q, k, v: ct.attention_varlen(q, k, v, cu, cu, 200, 200, causal=True,  # noqa: E731
                                                   deterministic=True)
    else:
        attn = lambda q, k, v: ct.attention(q, k, v, causal=True, deterministic=True)  # noqa: E731
    loss = lambda q, k, v: attn(q, k, v).float().square().sum()  # noqa: E731
    got = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    want = torch.autograd.grad(loss(*leaves), leaves)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@requires_gpu
@requires_torch
def test_gpu_torch_compile_fullgraph():
    import torch
    import cuflash.torch as ct
    g = _gen(11)
    q, k, v = _cuda(g, 2, 128, 8, 64), _cuda(g, 2, 256, 2, 64), _cuda(g, 2, 256, 2, 64)

    def f(q, k, v):
        return ct.attention(q * 0.5, k, v, causal=True).float().square()

    torch._dynamo.reset()
    fc = torch.compile(f, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(fc(q, k, v), f(q, k, v))
    for x in (q, k, v):
        x.requires_grad_()
    fc(q, k, v).sum().backward()
    got = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    f(q, k, v).sum().backward()
    for a, x in zip(got, (q, k, v)):
        torch.testing.assert_close(a, x.grad)


def _capture(fn):
    """torch's recipe: warm up on a side stream (kernels get compiled and loaded), then capture."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = fn()
    return graph, res


@requires_gpu
@requires_torch
@pytest.mark.parametrize("shape", ["prefill", "split_decode"])
def test_gpu_cuda_graph_out(shape):
    """cuflash.attention(q, k, v, out=o) captured in a torch CUDA graph; replays on new data
    copied into the static inputs match fresh eager calls bitwise."""
    import torch
    import cuflash
    g = _gen(12)
    if shape == "prefill":
        (b, sq, sk, h, hk, d), causal = (2, 512, 512, 16, 4, 128), True
    else:
        (b, sq, sk, h, hk, d), causal = (1, 1, 4096, 32, 8, 128), False
    q, k, v = _cuda(g, b, sq, h, d), _cuda(g, b, sk, hk, d), _cuda(g, b, sk, hk, d)
    plan = cuflash.plan(q, k, v, causal=causal)
    if shape == "split_decode":
        assert plan.num_splits > 1 and len(plan.kernels) == 2, str(plan)
    o = torch.empty_like(q)
    graph, _ = _capture(lambda: cuflash.attention(q, k, v, causal=causal, out=o))
    for r in range(3):
        for x in (q, k, v):
            x.copy_(_cuda(g, *x.shape))
        o.fill_(float("nan"))
        graph.replay()
        want = cuflash.attention(q, k, v, causal=causal)
        torch.cuda.synchronize()
        assert torch.equal(o, want), f"replay {r} differs from eager ({plan.kernels})"
    from test_gpu_forward import check
    check(o, q, k, v, causal=causal)


@requires_gpu
@requires_torch
def test_gpu_cuda_graph_torch_attention():
    """cuflash.torch.attention (outputs allocated inside the capture, in the graph's pool)."""
    import torch
    import cuflash
    import cuflash.torch as ct
    g = _gen(13)
    q, k, v = _cuda(g, 1, 1, 32, 128), _cuda(g, 1, 4096, 8, 128), _cuda(g, 1, 4096, 8, 128)
    with torch.no_grad():
        graph, out = _capture(lambda: ct.attention(q, k, v))
        for _ in range(2):
            for x in (q, k, v):
                x.copy_(_cuda(g, *x.shape))
            graph.replay()
            assert torch.equal(out, cuflash.attention(q, k, v))


# ---------------------------------------------------------------------------------------------
# GPU: transformers generate, cuflash against SDPA

def _greedy(model, ids, n, **kw):
    import torch
    with torch.no_grad():
        r = model.generate(ids, max_new_tokens=n, do_sample=False, output_logits=True,
                           return_dict_in_generate=True, pad_token_id=0, **kw)
    return r.sequences, torch.stack(r.logits, dim=1).float()


@requires_gpu
@requires_torch
@requires_transformers
@pytest.mark.parametrize("padded", [False, True])
def test_gpu_hf_generate_matches_sdpa(padded):
    """Greedy tokens from a tiny random Qwen2 in bf16 agree between cuflash and SDPA. A token may
    differ only at a near-tie: where SDPA's own logits for the two tokens are within 0.05 (bf16
    logits are rounded to 2^-8 relative; both backends round differently). Logits of a
    teacher-forced forward over the SDPA sequence obey flash-attn's rule against a float32 copy
    of the model: |cuflash - fp32| <= 2 |sdpa - fp32| + 1e-3."""
    import torch
    over = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                intermediate_size=2048, num_hidden_layers=2, vocab_size=4096)
    a = _tiny_qwen2("cuFlash", dtype="bfloat16", device="cuda", **over)
    b = _tiny_qwen2("sdpa", dtype="bfloat16", device="cuda", **over)
    b.load_state_dict(a.state_dict())
    import cuflash
    if padded and not hasattr(cuflash, "attention_varlen"):
        pytest.skip("padded prompts need cuflash.attention_varlen (else the backend uses SDPA)")
    ids = torch.randint(1, 4096, (2 if padded else 1, 150), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(0))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :37] = 0
    _check_generation(a, b, _tiny_qwen2("sdpa", dtype="float32", device="cuda", **over), ids, mask, 64)


def _check_generation(a, b, ref, ids, mask, n):
    """Greedy generation of model ``a`` (cuflash) against ``b`` (PyTorch's attention, same bf16
    weights): the same tokens up to the first step where they differ, and there only at a tie at
    bf16 precision of b's logits; then the logits of a teacher-forced forward over b's sequence
    obey flash-attn's rule against ``ref``, a float32 copy: |a - ref| <= 2 |b - ref| + 1e-3."""
    import torch
    ref.load_state_dict({n_: p.float() for n_, p in a.state_dict().items()})
    kw = {"attention_mask": mask}
    sa, la = _greedy(a, ids, n, **kw)
    sb, lb = _greedy(b, ids, n, **kw)
    diff = (sa != sb).any(dim=0).nonzero()
    if diff.numel():
        t = int(diff[0]) - ids.shape[1]
        for row in range(ids.shape[0]):
            ta, tb = int(sa[row, ids.shape[1] + t]), int(sb[row, ids.shape[1] + t])
            if ta != tb:
                margin = float(lb[row, t, tb] - lb[row, t, ta])
                # a tie at bf16 precision: within two rounding steps of the logit's magnitude
                step = torch.finfo(torch.bfloat16).eps * 2.0 ** math.floor(math.log2(abs(float(lb[row, t, tb]))))
                assert margin <= 2 * step, f"row {row} step {t}: token {ta} vs {tb}, margin {margin:.3f}"
    fkw = {"attention_mask": torch.cat([mask, torch.ones_like(sb[:, ids.shape[1]:])], dim=1)}
    with torch.no_grad():
        l_ref = ref(sb, **fkw).logits
        l_a, l_b = a(sb, **fkw).logits.float(), b(sb, **fkw).logits.float()
    keep = fkw["attention_mask"].bool()
    err_a = (l_a - l_ref).abs()[keep].max().item()
    err_b = (l_b - l_ref).abs()[keep].max().item()
    assert err_a <= 2 * err_b + 1e-3, f"cuflash logits error {err_a:.3g} vs PyTorch's {err_b:.3g}"


@requires_gpu
@requires_torch
@requires_transformers
@pytest.mark.parametrize("padded", [False, True])
def test_gpu_hf_gpt_oss_generate_matches_eager(padded):
    """A random gpt-oss-shaped model in bf16 (attention sinks, sliding-window layers of 64 tokens,
    a 150-token prompt) generates with cuflash's kernels as with transformers' eager attention
    (_check_generation's rules), and cuflash's kernels ran with sinks."""
    import torch
    over = dict(hidden_size=512, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                head_dim=64, sliding_window=64, vocab_size=4096)
    a = _tiny_gpt_oss("cuFlash", dtype="bfloat16", device="cuda", **over)
    b = _tiny_gpt_oss("eager", dtype="bfloat16", device="cuda", **over)
    b.load_state_dict(a.state_dict())
    ids = torch.randint(1, 4096, (2 if padded else 1, 150), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(0))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :37] = 0
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.no_grad():
        a(ids, attention_mask=mask)
        torch.cuda.synchronize()
    ran = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    assert any(n.startswith("fwd_") and "_sinks_" in n for n in ran), sorted(ran)
    _check_generation(a, b, _tiny_gpt_oss("eager", dtype="float32", device="cuda", **over), ids, mask, 32)


@requires_gpu
@requires_torch
@requires_transformers
@pytest.mark.parametrize("padded", [False, True])
def test_gpu_hf_training_step_with_dropout(padded):
    """A tiny bf16 Qwen2 with attention_dropout=0.1 in training runs cuflash's dropout kernels
    (forward and backward, dense or through the padded varlen path); loss and gradients are
    finite, the same torch seed repeats the loss bitwise and another seed changes it (the mask
    follows torch's CUDA generator, as flash-attn's does; the gradients' atomic adds, here and in
    PyTorch's embedding backward, are not bitwise repeatable)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    over = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64, intermediate_size=512,
                vocab_size=4096, attention_dropout=0.1)
    model = _tiny_qwen2("cuFlash", dtype="bfloat16", device="cuda", **over).train()
    ids = torch.randint(1, 4096, (2, 150), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :37] = 0
    labels = ids.masked_fill(mask == 0, -100)

    def step(seed):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        loss, grads = step(0)
        torch.cuda.synchronize()
    ran = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    assert any(n.startswith("fwd_") and "_dropout_" in n for n in ran), sorted(ran)
    assert any(n.startswith("bwd_") and "_dropout_" in n for n in ran), sorted(ran)
    assert torch.isfinite(loss) and grads and all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(step(0)[0], loss) and not torch.equal(step(1)[0], loss)
