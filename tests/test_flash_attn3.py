"""FlashAttention-3's API on cuflash (cuflash/flash_attn3.py): argument mapping, the value head
dim's padding and pieces, flash_attn_combine (CPU, PyTorch), and GPU checks against the float64
reference and cuflash's own entry points."""
import numpy as np
import pytest

from conftest import requires_sm90, requires_torch

torch = pytest.importorskip("torch", reason="needs PyTorch (optional dependency)")

from cuflash import flash_attn3 as fa3  # noqa: E402


def test_value_pieces_pad_and_cut():
    """dv < d: V padded with zeros, the output cut back; dv > d: V in pieces of d (the last padded),
    one call each with q's scale; the scale defaults to d ** -0.5."""
    calls = []

    def run(q, k, v, scale):
        calls.append((v.shape[-1], scale, v.clone()))
        return v[:, :, :1].expand(-1, -1, q.shape[2], -1) * 0 + v.sum(1, keepdim=True)[:, :, :1], torch.zeros(1)

    q = torch.zeros(1, 3, 2, 64)
    k = torch.zeros(1, 5, 1, 64)
    for dv, pieces in ((32, 1), (64, 1), (200, 4)):
        calls.clear()
        v = torch.randn(1, 5, 1, dv)
        out, _ = fa3._value_pieces(run, q, k, v, None)
        assert out.shape[-1] == dv and len(calls) == pieces
        assert all(c[0] == 64 and c[1] == 64 ** -0.5 for c in calls)
        got = torch.cat([c[2] for c in calls], dim=-1)
        assert torch.equal(got[..., :dv], v) and (got[..., dv:] == 0).all()
    calls.clear()
    fa3._value_pieces(run, q, k, torch.randn(1, 5, 1, 64), 0.3)
    assert calls[0][1] == 0.3


def test_refused_arguments_name_themselves():
    q = torch.zeros(1, 4, 2, 64)
    for kw, name in ((dict(qv=q), "qv"), (dict(sm_margin=4), "sm_margin")):
        with pytest.raises(NotImplementedError, match=name):
            fa3.flash_attn_func(q, q, q, **kw)
    with pytest.raises(NotImplementedError, match="seqused_q"):
        fa3.flash_attn_varlen_func(q[0], q[0], q[0], None, None, 4, 4, seqused_q=torch.zeros(1))
    with pytest.raises(NotImplementedError, match="cu_seqlens_q"):
        fa3.flash_attn_with_kvcache(q, q, q, cu_seqlens_q=torch.zeros(2))
    with pytest.raises(TypeError, match="num_splits"):
        fa3.flash_attn_func(q, q, q, num_splits=-1)
    with pytest.raises(ValueError, match="num_heads_q"):
        fa3.flash_attn_qkvpacked_func(torch.zeros(1, 4, 6, 64))
    assert fa3.get_scheduler_metadata(1, 1, 128, 8, 8, 128, torch.zeros(1)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_combine_against_its_definition(dtype):
    """FlashAttention-3's test: non-contiguous partials, splits with LSE -inf adding nothing."""
    g = torch.Generator().manual_seed(0)
    s, b, h, n, d = 5, 3, 4, 33, 40
    out_partial = torch.randn(2 * s, b, h, n, d, generator=g).transpose(2, 3)[:s]
    lse_partial = torch.randn(s, b, 2 * h, n, generator=g).transpose(-1, -2)[:, :, :, :h]
    lse_partial[s // 2:, :1] = -float("inf")
    out, lse = fa3.flash_attn_combine(out_partial, lse_partial, out_dtype=dtype)
    o64, l64 = out_partial.double(), lse_partial.double()
    lse_ref = torch.logsumexp(l64, 0)
    ref = (torch.exp(l64 - lse_ref).unsqueeze(-1) * o64).sum(0)
    assert out.dtype == dtype and out.shape == (b, n, h, d) and lse.shape == (b, n, h)
    assert (lse.double() - lse_ref).abs().max() < 1e-5
    assert (out.double() - ref).abs().max() <= 2 * (ref.to(dtype).double() - ref).abs().max() + 1e-5
    lse_partial[:, 1] = -float("inf")  # a row every split left empty: 0, LSE -inf
    out, lse = fa3.flash_attn_combine(out_partial, lse_partial)
    assert (out[1] == 0).all() and torch.isinf(lse[1]).all()
    buf = torch.empty(b, n, h, d, dtype=torch.bfloat16)
    res, _ = fa3.flash_attn_combine(out_partial, lse_partial, out=buf)
    assert res is buf


# ---------------------------------------------------------------------------------------------
# GPU

def _rand(*shape, dtype=torch.bfloat16, requires_grad=False):
    return torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=requires_grad)


@requires_sm90
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_func_matches_cuflash_torch(causal):
    """Same output, LSE and gradients as cuflash.torch.attention (the same kernels; the deterministic
    backward, so that the two gradients are bitwise comparable)."""
    import cuflash.torch as cft
    q, k, v = _rand(2, 300, 8, 128, requires_grad=True), _rand(2, 400, 2, 128, requires_grad=True), \
        _rand(2, 400, 2, 128, requires_grad=True)
    out, lse = fa3.flash_attn_func(q, k, v, causal=causal, window_size=(-1, -1), deterministic=True,
                                   return_attn_probs=True)
    ref, ref_lse = cft.attention(q, k, v, causal=causal, deterministic=True, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    g = torch.randn_like(out)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(out, (q, k, v), g),
                                                 torch.autograd.grad(ref, (q, k, v), g)))


@requires_sm90
@pytest.mark.parametrize("d,dv", [(192, 128), (64, 256), (64, 160)])
def test_gpu_value_head_dim_against_reference(d, dv):
    """DeepSeek's 192 / 128 and wider values (pieces): output and gradients within flash-attn's rule
    of the float64 reference (dense attention with the value's own head dim)."""
    q, k = _rand(2, 200, 4, d, requires_grad=True), _rand(2, 260, 2, d, requires_grad=True)
    v = _rand(2, 260, 2, dv, requires_grad=True)
    out = fa3.flash_attn_func(q, k, v, causal=True)
    assert out.shape == (2, 200, 4, dv)

    def ref(dtype):
        qq, kk, vv = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
        kr, vr = kk.repeat_interleave(2, dim=2), vv.repeat_interleave(2, dim=2)
        s = torch.einsum("bqhd,bkhd->bhqk", qq, kr) * d ** -0.5
        s = s.masked_fill(torch.ones(200, 260, dtype=torch.bool, device="cuda").triu(260 - 200 + 1), -float("inf"))
        o = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1).to(dtype), vr)
        return o, qq, kk, vv
    g = torch.randn_like(out)
    o64, *x64 = ref(torch.float64)
    o16, *x16 = ref(torch.bfloat16)
    assert (out.double() - o64).abs().max() <= 2 * (o16.double() - o64).abs().max() + 1e-5
    grads = torch.autograd.grad(out, (q, k, v), g)
    g64, g16 = torch.autograd.grad(o64, x64, g.double()), torch.autograd.grad(o16, x16, g)
    for a, b64, b16 in zip(grads, g64, g16):
        assert (a.double() - b64).abs().max() <= 2 * (b16.double() - b64).abs().max() + 2e-4


@requires_sm90
def test_gpu_fp8_with_descales():
    """e4m3 inputs with descales run cuflash's FP8 forward (bf16 out), qkv-packed too."""
    import cuflash
    qkv = _rand(2, 257, 3, 4, 128).to(torch.float8_e4m3fn)
    q, k, v = qkv.unbind(2)
    ds = torch.rand(2, 4, device="cuda") + 0.5
    out, lse = fa3.flash_attn_func(q, k, v, causal=True, q_descale=ds, k_descale=ds, v_descale=ds,
                                   return_attn_probs=True)
    ref, ref_lse = cuflash.attention(q, k, v, causal=True, q_descale=ds, k_descale=ds, v_descale=ds, return_lse=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert torch.equal(fa3.flash_attn_qkvpacked_func(qkv, causal=True, q_descale=ds, k_descale=ds, v_descale=ds), ref)


@requires_sm90
def test_gpu_varlen_and_kvcache():
    """flash_attn_varlen_func is cuflash.torch.attention_varlen; flash_attn_with_kvcache appends to
    a paged cache through page_table and attends as cuflash.attention_with_kvcache does."""
    import cuflash
    import cuflash.torch as cft
    cu = torch.tensor([0, 100, 100, 357], dtype=torch.int32, device="cuda")
    q, k, v = _rand(357, 8, 128), _rand(357, 2, 128), _rand(357, 2, 128)
    out, lse = fa3.flash_attn_varlen_func(q, k, v, cu, cu, 257, 257, causal=True, return_attn_probs=True)
    ref, ref_lse = cft.attention_varlen(q, k, v, cu, cu, 257, 257, causal=True, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    table = torch.arange(12, dtype=torch.int32, device="cuda").reshape(3, 4)
    kp, vp = _rand(12, 64, 2, 128), _rand(12, 64, 2, 128)
    kp2, vp2 = kp.clone(), vp.clone()
    lens = torch.tensor([10, 200, 0], dtype=torch.int32, device="cuda")
    qd, kn, vn = _rand(3, 1, 8, 128), _rand(3, 1, 2, 128), _rand(3, 1, 2, 128)
    out, lse = fa3.flash_attn_with_kvcache(qd, kp, vp, kn, vn, cache_seqlens=lens, page_table=table, causal=True,
                                           return_softmax_lse=True)
    ref, ref_lse = cuflash.attention_with_kvcache(qd, kp2, vp2, kn, vn, cache_seqlens=lens, block_table=table,
                                                  causal=True, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse) and torch.equal(kp, kp2) and torch.equal(vp, vp2)
    np.testing.assert_array_equal(lens.cpu().numpy(), [10, 200, 0])  # (the caller's lengths are not moved)
