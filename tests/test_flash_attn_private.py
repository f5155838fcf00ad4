"""flash-attn's private entry points in cuflash.flash_attn.flash_attn_interface (_flash_attn_forward,
_flash_attn_varlen_forward, _flash_attn_backward, _flash_attn_varlen_backward) and its extension
module's functions (flash_attn_gpu.fwd, varlen_fwd, bwd, varlen_bwd, fwd_kvcache), which libraries
built on flash-attn call inside their own autograd Functions. CPU: signatures against flash-attn's
(main branch, 2026-08), the retired generator slot, softmax_d's layouts, rng_state. GPU: the same
results as the public functions (bitwise: the same kernels), the backward replaying the forward's
dropout from rng_state, and the float64 reference."""
import inspect

import numpy as np
import pytest

from conftest import requires_gpu, requires_torch

pytestmark = [requires_torch]

REQ = inspect.Parameter.empty
# flash-attn's flash_attn/flash_attn_interface.py (main, 2026-08-15): (name, default)
UPSTREAM = {
    "_flash_attn_forward": [("q", REQ), ("k", REQ), ("v", REQ), ("dropout_p", REQ), ("softmax_scale", REQ),
                            ("causal", REQ), ("window_size_left", REQ), ("window_size_right", REQ),
                            ("softcap", REQ), ("alibi_slopes", REQ), ("return_softmax", REQ)],
    "_flash_attn_varlen_forward": [
        ("q", REQ), ("k", REQ), ("v", REQ), ("cu_seqlens_q", REQ), ("cu_seqlens_k", REQ), ("max_seqlen_q", REQ),
        ("max_seqlen_k", REQ), ("dropout_p", REQ), ("softmax_scale", REQ), ("causal", REQ),
        ("window_size_left", -1), ("window_size_right", -1), ("softcap", 0.0), ("alibi_slopes", None),
        ("return_softmax", False), ("block_table", None), ("leftpad_k", None), ("seqused_k", None),
        ("zero_tensors", False), ("num_splits", 0)],
    "_flash_attn_backward": [
        ("dout", REQ), ("q", REQ), ("k", REQ), ("v", REQ), ("out", REQ), ("softmax_lse", REQ), ("dq", REQ),
        ("dk", REQ), ("dv", REQ), ("dropout_p", REQ), ("softmax_scale", REQ), ("causal", REQ),
        ("window_size_left", REQ), ("window_size_right", REQ), ("softcap", REQ), ("alibi_slopes", REQ),
        ("deterministic", REQ), ("rng_state", None)],
    "_flash_attn_varlen_backward": [
        ("dout", REQ), ("q", REQ), ("k", REQ), ("v", REQ), ("out", REQ), ("softmax_lse", REQ), ("dq", REQ),
        ("dk", REQ), ("dv", REQ), ("cu_seqlens_q", REQ), ("cu_seqlens_k", REQ), ("max_seqlen_q", REQ),
        ("max_seqlen_k", REQ), ("dropout_p", REQ), ("softmax_scale", REQ), ("causal", REQ),
        ("window_size_left", REQ), ("window_size_right", REQ), ("softcap", REQ), ("alibi_slopes", REQ),
        ("deterministic", REQ), ("rng_state", None), ("zero_tensors", False)],
}
# flash_attn_2_cuda's functions (csrc/flash_attn/flash_api.cpp): positional argument counts
GPU_ARGS = {"fwd": 13, "varlen_fwd": 22, "bwd": 19, "varlen_bwd": 24, "fwd_kvcache": 20}


@pytest.mark.parametrize("name", sorted(UPSTREAM))
def test_signature(name):
    from cuflash.flash_attn import flash_attn_interface as fi
    params = list(inspect.signature(getattr(fi, name)).parameters.values())
    n = len(UPSTREAM[name])
    assert [(p.name, p.default) for p in params[:n]] == UPSTREAM[name]
    assert all(p.kind == inspect.Parameter.KEYWORD_ONLY for p in params[n:])  # (out=, for flash_attn_gpu)


@pytest.mark.parametrize("name", sorted(GPU_ARGS))
def test_extension_functions(name):
    from cuflash.flash_attn.flash_attn_interface import flash_attn_gpu
    params = inspect.signature(getattr(flash_attn_gpu, name)).parameters.values()
    assert sum(p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params) == GPU_ARGS[name]


def test_generator_slot_must_be_none():
    from cuflash.flash_attn.flash_attn_interface import flash_attn_gpu
    bad = object()
    with pytest.raises(RuntimeError, match="generator` argument is no longer supported"):
        flash_attn_gpu.fwd(None, None, None, None, None, 0.0, 1.0, True, -1, -1, 0.0, False, bad)
    with pytest.raises(RuntimeError, match="generator` argument is no longer supported"):
        flash_attn_gpu.bwd(*[None] * 10, 0.0, 1.0, True, -1, -1, 0.0, False, bad, None)
    with pytest.raises(RuntimeError, match="generator` argument is no longer supported"):
        flash_attn_gpu.varlen_fwd(*[None] * 10, 1, 1, 0.0, 1.0, False, True, -1, -1, 0.0, False, bad)
    with pytest.raises(RuntimeError, match="generator` argument is no longer supported"):
        flash_attn_gpu.varlen_bwd(*[None] * 12, 1, 1, 0.0, 1.0, False, True, -1, -1, 0.0, False, bad, None)


def test_paged_varlen_refuses_splits_as_flash_attn():
    """num_splits > 1 with a block table in _flash_attn_varlen_forward: flash-attn's RuntimeError
    (also a ValueError), before anything is read."""
    import torch
    from cuflash.flash_attn.flash_attn_interface import FlashAttnCheckError, _flash_attn_varlen_forward
    x = torch.zeros(4, 1, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="num_splits > 1 is not supported for varlen paged KV") as caught:
        _flash_attn_varlen_forward(x, x, x, cu, cu, 4, 4, 0.0, 1.0, False, block_table=torch.zeros(1, 1), num_splits=2)
    assert isinstance(caught.value, ValueError) and issubclass(FlashAttnCheckError, RuntimeError)


def test_softmax_d_layouts():
    """Dense: (batch, nheads, seqlen_q rounded up to 128); packed: (nheads, total_q + 128 batch),
    sequence b's rows from cu_seqlens_q[b] + 128 b; zero padding."""
    import torch
    from cuflash.flash_attn.flash_attn_interface import _softmax_d
    g = torch.Generator().manual_seed(0)
    dout, out = torch.randn(2, 130, 3, 8, generator=g), torch.randn(2, 130, 3, 8, generator=g)
    d = _softmax_d(dout, out, None, 0.25)
    want = 0.75 * (dout * out).sum(-1).transpose(1, 2)  # (flash-attn's: scaled by the keep probability)
    assert d.shape == (2, 3, 256) and torch.allclose(d[..., :130], want) and not d[..., 130:].any()
    assert torch.equal(_softmax_d(dout[:, :0], out[:, :0], None, 0.0), torch.zeros(2, 3, 0))
    strided = _softmax_d(dout.transpose(0, 1).contiguous().transpose(0, 1), out, None, 0.25)  # (views, no copy)
    assert torch.equal(strided, d)
    cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    dout, out = torch.randn(12, 3, 8, generator=g), torch.randn(12, 3, 8, generator=g)
    d = _softmax_d(dout, out, (cu, 3), 0.0)
    rows = (dout * out).sum(-1).t()
    assert d.shape == (3, 12 + 3 * 128)
    for b in range(3):
        s, e = int(cu[b]), int(cu[b + 1])
        assert torch.allclose(d[:, s + 128 * b:e + 128 * b], rows[:, s:e])
    assert d.count_nonzero() == rows.count_nonzero()


def test_rng_state():
    """The seed and offset ride on the forward's rng_state; a tensor without them is read back."""
    import torch
    from cuflash.flash_attn.flash_attn_interface import _rng_state, _seed_offset
    q = torch.zeros(1)
    r = _rng_state(q, 2 ** 64 - 5, 12)
    assert r.tolist() == [-5, 12] and _seed_offset(0.1, r) == dict(dropout_p=0.1, seed=2 ** 64 - 5, offset=12)
    assert _seed_offset(0.1, r.clone()) == dict(dropout_p=0.1, seed=2 ** 64 - 5, offset=12)  # (read back)
    assert _seed_offset(0.0, None) == {} and not _rng_state(q, None, None).any()
    with pytest.raises(ValueError, match="rng_state"):
        _seed_offset(0.1, None)


# ---------------------------------------------------------------------------------------------
# GPU

def _gpu(rng, *shape, dtype="bfloat16"):
    import torch
    return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to("cuda", getattr(torch, dtype))


def _leaf(x):
    return x.detach().clone().requires_grad_()


@requires_gpu
@pytest.mark.parametrize("dropout_p", [0.0, 0.17])
@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (40, 9)), (False, (-1, -1))])
def test_gpu_dense_as_the_public_function(rng, causal, window, dropout_p):
    """_flash_attn_forward and _flash_attn_backward (and flash_attn_gpu.fwd / bwd) give what
    flash_attn_func and its autograd give (deterministic, the generator re-seeded: bitwise), the
    backward replaying the forward's dropout from rng_state (also read back from a copy)."""
    import torch
    from cuflash.flash_attn import flash_attn_func
    from cuflash.flash_attn import flash_attn_interface as fi
    q, k, v = _gpu(rng, 2, 150, 8, 64), _gpu(rng, 2, 190, 2, 64), _gpu(rng, 2, 190, 2, 64)
    dout = _gpu(rng, 2, 150, 8, 64)
    kw = dict(softmax_scale=0.2, causal=causal, softcap=0.0, alibi_slopes=None)
    torch.manual_seed(7)
    out, lse, _, rng_state = fi._flash_attn_forward(q, k, v, dropout_p, window_size_left=window[0],
                                                    window_size_right=window[1], return_softmax=False, **kw)
    assert lse.shape == (2, 8, 150) and rng_state.dtype == torch.int64
    torch.manual_seed(7)
    ql, kl, vl = _leaf(q), _leaf(k), _leaf(v)
    ref, ref_lse, _ = flash_attn_func(ql, kl, vl, dropout_p, window_size=window, deterministic=True,
                                      return_attn_probs=True, **kw)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    ref.backward(dout)
    for state in (rng_state, rng_state.clone()):
        grads = [torch.full_like(x, float("nan")) for x in (q, k, v)]
        d = fi._flash_attn_backward(dout, q, k, v, out, lse, *grads, dropout_p, window_size_left=window[0],
                                    window_size_right=window[1], deterministic=True, rng_state=state, **kw)
        for g, want in zip(grads, (ql.grad, kl.grad, vl.grad)):
            assert torch.equal(g, want)
        want_d = (1 - dropout_p) * (dout.float() * out.float()).sum(-1).transpose(1, 2)
        assert torch.allclose(d[..., :150], want_d, rtol=1e-5, atol=1e-5) and not d[..., 150:].any()
    torch.manual_seed(7)
    res = fi.flash_attn_gpu.fwd(q, k, v, None, None, dropout_p, 0.2, causal, *window, 0.0, False, None)
    assert torch.equal(res[0], out) and torch.equal(res[1], lse)
    dq, dk, dv, _ = fi.flash_attn_gpu.bwd(dout, q, k, v, out, lse, None, None, None, None, dropout_p, 0.2, causal,
                                          *window, 0.0, True, None, res[3])
    assert torch.equal(dq, ql.grad) and torch.equal(dk, kl.grad) and torch.equal(dv, vl.grad)


@requires_gpu
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_gpu_varlen_as_the_public_function(rng, dropout_p):
    import torch
    from cuflash.flash_attn import flash_attn_varlen_func
    from cuflash.flash_attn import flash_attn_interface as fi
    cu_q = torch.tensor([0, 70, 70, 201], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 33, 90, 300], dtype=torch.int32, device="cuda")
    q, k, v, dout = _gpu(rng, 201, 4, 128), _gpu(rng, 300, 4, 128), _gpu(rng, 300, 4, 128), _gpu(rng, 201, 4, 128)
    args = (cu_q, cu_k, 131, 210, dropout_p)
    torch.manual_seed(3)
    out, lse, _, rng_state = fi._flash_attn_varlen_forward(q, k, v, *args, None, True)
    torch.manual_seed(3)
    ql, kl, vl = _leaf(q), _leaf(k), _leaf(v)
    ref, ref_lse, _ = flash_attn_varlen_func(ql, kl, vl, *args, causal=True, deterministic=True,
                                             return_attn_probs=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    ref.backward(dout)
    grads = [torch.full_like(x, float("nan")) for x in (q, k, v)]
    d = fi._flash_attn_varlen_backward(dout, q, k, v, out, lse, *grads, *args, None, True, -1, -1, 0.0, None, True,
                                       rng_state)
    for g, want in zip(grads, (ql.grad, kl.grad, vl.grad)):
        assert torch.equal(g, want)
    rows = (1 - dropout_p) * (dout.float() * out.float()).sum(-1).t()
    assert d.shape == (4, 201 + 3 * 128)
    assert torch.allclose(d[:, :70], rows[:, :70], rtol=1e-5, atol=1e-5)
    assert torch.allclose(d[:, 70 + 256:201 + 256], rows[:, 70:], rtol=1e-5, atol=1e-5)
    torch.manual_seed(3)
    res = fi.flash_attn_gpu.varlen_fwd(q, k, v, None, cu_q, cu_k, None, None, None, None, 131, 210, dropout_p, None,
                                       False, True, -1, -1, 0.0, False, None)
    assert torch.equal(res[0], out) and torch.equal(res[1], lse)
    dq, dk, dv, _ = fi.flash_attn_gpu.varlen_bwd(dout, q, k, v, out, lse, None, None, None, cu_q, cu_k, None, 131, 210,
                                                 dropout_p, None, False, True, -1, -1, 0.0, True, None,
                                                 res[3].clone())
    assert torch.equal(dq, ql.grad) and torch.equal(dk, kl.grad) and torch.equal(dv, vl.grad)


@requires_gpu
def test_gpu_ring_of_two_chunks(rng):
    """The use these entry points serve: attention over two chunks of keys, each with
    _flash_attn_forward, merged by their LSE, is attention over all keys (the float64
    reference's rule)."""
    import torch
    from cuflash.flash_attn import flash_attn_interface as fi
    from cuflash.reference import check_close
    from test_flash_attn_dropin import _np
    q, k, v = _gpu(rng, 2, 256, 4, 64), _gpu(rng, 2, 512, 4, 64), _gpu(rng, 2, 512, 4, 64)
    parts = [fi._flash_attn_forward(q, k[:, s:s + 256], v[:, s:s + 256], 0.0, 0.125, False, -1, -1, 0.0, None, False)
             for s in (0, 256)]
    for (o, _, _, _), s in zip(parts, (0, 256)):  # each chunk: flash-attn's rule
        ok, err, bound = check_close(_np(o), _np(q), _np(k[:, s:s + 256]), _np(v[:, s:s + 256]), softmax_scale=0.125)
        assert ok, (s, err, bound)
    lse = torch.logaddexp(parts[0][1], parts[1][1])
    out = sum(o.float() * torch.exp(l - lse).transpose(1, 2)[..., None] for o, l, _, _ in parts).to(q.dtype)
    ok, err, bound = check_close(_np(out), _np(q), _np(k), _np(v), softmax_scale=0.125)
    # the merge rounds each chunk's output to bf16 before adding them (weights summing to 1): one
    # more rounding, at most 2^-9 max |v|, than the rule's single call makes
    assert err <= bound + 2.0 ** -9 * float(np.abs(_np(v).astype(np.float32)).max()), (err, bound)
    # the backward as ring attention runs it: each chunk's gradients from the merged out and LSE
    dout = _gpu(rng, 2, 256, 4, 64)
    dq, dk, dv = torch.zeros_like(q), torch.empty_like(k), torch.empty_like(v)
    for s in (0, 256):
        dq_s = torch.empty_like(q)
        fi._flash_attn_backward(dout, q, k[:, s:s + 256], v[:, s:s + 256], out, lse, dq_s, dk[:, s:s + 256],
                                dv[:, s:s + 256], 0.0, 0.125, False, -1, -1, 0.0, None, False)
        dq += dq_s
    whole = [torch.empty_like(x) for x in (q, k, v)]
    fi._flash_attn_backward(dout, q, k, v, out, lse, *whole, 0.0, 0.125, False, -1, -1, 0.0, None, False)
    for got, want in zip((dq, dk, dv), whole):
        assert (got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()


@requires_gpu
def test_gpu_kvcache_entry(rng):
    import torch
    import cuflash
    from cuflash.flash_attn.flash_attn_interface import flash_attn_gpu
    q, kc, vc = _gpu(rng, 2, 5, 8, 128), _gpu(rng, 2, 256, 2, 128), _gpu(rng, 2, 256, 2, 128)
    lens = torch.tensor([17, 200], dtype=torch.int32, device="cuda")
    out, lse = flash_attn_gpu.fwd_kvcache(q, kc, vc, None, None, lens, None, None, None, None, None, None, None,
                                          0.1, True, 30, 0, 0.0, True, 0)
    want, want_lse = cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, softmax_scale=0.1, causal=True,
                                                    window_size=(30, 0), return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
