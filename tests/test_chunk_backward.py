"""Chunked attention with gradients (cuflash.torch): a call that records gradients runs as packed
sequences, each sequence cut at its chunks' first keys with the queries of each chunk
(cuflash.torch.ops._chunk_pieces), through attention_varlen's forward and backward. On the CPU:
the pieces give the chunk's mask exactly (the float64 reference's forward, LSE and gradients over
the pieces against its own chunk mask, dense and packed, queries before the first key and empty
sequences included). On a GPU: outputs and gradients against the float64 reference with the
chunk (flash-attn's rule), deterministic and not, with GQA, windows, softcap, ALiBi, sinks and
dropout, dense and packed."""
import numpy as np
import pytest

import cuflash
from conftest import requires_gpu, requires_torch

CASES = [(1, 7, 7, 3), (3, 5, 13, 4), (2, 13, 5, 4), (2, 1, 9, 4), (1, 9, 9, 20), (2, 16, 3, 1), (2, 40, 40, 8),
         (1, 33, 70, 16), (3, 70, 33, 16), (1, 64, 64, 64), (2, 0, 9, 4), (2, 9, 0, 4)]
MASKS = [(False, (-1, -1)), (True, (-1, -1)), (False, (2, 1)), (True, (3, -1)), (False, (-1, 2))]


def _pieces_np(q, k, varlen, c):
    from cuflash.torch import ops
    cu_q, cu_k, max_q, max_k, pieces = ops._chunk_pieces(q, k, varlen, c)
    cu_q, cu_k = cu_q.cpu().numpy(), cu_k.cpu().numpy()
    assert np.all(np.diff(cu_q) >= 0) and np.all(np.diff(cu_k) >= 0)
    assert np.diff(cu_q).max(initial=0) <= max_q and np.diff(cu_k).max(initial=0) <= max_k
    return cu_q, cu_k, pieces


@requires_torch
@pytest.mark.parametrize("b, sq, sk, c", CASES)
@pytest.mark.parametrize("causal, window", MASKS)
def test_pieces_give_the_chunk_mask(b, sq, sk, c, causal, window):
    """Dense operands: the reference over the pieces (forward, LSE, gradients) equals the
    reference with attention_chunk."""
    import torch
    rng = np.random.default_rng(sq * 1000 + sk * 10 + c)
    h, hk, d = 4, 2, 8
    q, k, v, do = (rng.standard_normal(s) for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d)))
    slopes = rng.uniform(0.1, 1.0, (b, h))
    cu_q, cu_k, pieces = _pieces_np(torch.from_numpy(q), torch.from_numpy(k), None, c)
    kw = dict(causal=causal, window_size=window, softcap=5.0)
    want, lse_want = cuflash.reference.attention(q, k, v, attention_chunk=c, return_lse=True, alibi_slopes=slopes,
                                                 **kw)
    flat = lambda x: x.reshape(-1, *x.shape[2:])
    slopes_p = np.repeat(slopes, pieces, axis=0)
    got, lse = cuflash.reference.attention_varlen(flat(q), flat(k), flat(v), cu_q, cu_k, return_lse=True,
                                                  alibi_slopes=slopes_p, **kw)
    np.testing.assert_allclose(got.reshape(q.shape), want, atol=1e-12)
    lse = lse.reshape(h, b, sq).transpose(1, 0, 2)
    assert np.array_equal(np.isinf(lse), np.isinf(lse_want))
    np.testing.assert_allclose(lse[np.isfinite(lse)], lse_want[np.isfinite(lse_want)], atol=1e-12)
    g_want = cuflash.reference.attention_backward(do, q, k, v, attention_chunk=c, alibi_slopes=slopes, **kw)
    g = cuflash.reference.attention_varlen_backward(flat(do), flat(q), flat(k), flat(v), cu_q, cu_k,
                                                    alibi_slopes=slopes_p, **kw)
    for x, y in zip(g, g_want):
        np.testing.assert_allclose(x.reshape(y.shape), y, atol=1e-12)


@requires_torch
@pytest.mark.parametrize("c", [1, 3, 8, 50])
@pytest.mark.parametrize("causal, window", MASKS)
@pytest.mark.parametrize("same", [False, True])
def test_packed_pieces_give_the_chunk_mask(c, causal, window, same):
    """Packed sequences (empty ones, more queries than keys and fewer), pieces made on the
    device side without a sync: the reference over the pieces equals its chunk mask per sequence.
    With the same cu_seqlens for queries and keys the pieces hold at most c queries."""
    import torch
    rng = np.random.default_rng(c)
    lens_k = [30, 0, 9, 17, 1, 40]
    lens_q = lens_k if same else [30, 0, 12, 5, 1, 0]
    cu_q_in = torch.tensor(np.cumsum([0] + lens_q), dtype=torch.int32)
    cu_k_in = cu_q_in if same else torch.tensor(np.cumsum([0] + lens_k), dtype=torch.int32)
    h, hk, d = 2, 1, 8
    q, k, v = (rng.standard_normal(s) for s in ((sum(lens_q), h, d), (sum(lens_k), hk, d), (sum(lens_k), hk, d)))
    do = rng.standard_normal(q.shape)
    varlen = (cu_q_in, cu_k_in, max(lens_q), max(lens_k))
    from cuflash.torch import ops
    _, _, max_q, max_k, _ = ops._chunk_pieces(torch.from_numpy(q), torch.from_numpy(k), varlen, c)
    if same:
        assert max_q <= c and max_k <= c
    cu_q, cu_k, _ = _pieces_np(torch.from_numpy(q), torch.from_numpy(k), varlen, c)
    kw = dict(causal=causal, window_size=window)
    cq, ck = cu_q_in.numpy(), cu_k_in.numpy()
    want = cuflash.reference.attention_varlen(q, k, v, cq, ck, attention_chunk=c, **kw)
    got = cuflash.reference.attention_varlen(q, k, v, cu_q, cu_k, **kw)
    np.testing.assert_allclose(got, want, atol=1e-12)
    g_want = cuflash.reference.attention_varlen_backward(do, q, k, v, cq, ck, attention_chunk=c, **kw)
    g = cuflash.reference.attention_varlen_backward(do, q, k, v, cu_q, cu_k, **kw)
    for x, y in zip(g, g_want):
        np.testing.assert_allclose(x, y, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# GPU: cuflash.torch with gradients against the float64 reference, buffers poisoned where given

def _leaves(rng, b, sq, sk, h, hk, d, dtype="bfloat16"):
    from test_gpu_forward import torch_inputs
    return [t.requires_grad_() for t in torch_inputs(rng, b, sq, sk, h, hk, d, dtype)]


def _check_all(out, grads, do, q, k, v, **kw):
    from test_gpu_forward import check
    from test_gpu_backward import check_grads
    check(out.detach(), q.detach(), k.detach(), v.detach(), **kw)
    causal = kw.pop("causal", False)
    check_grads(grads, do, q.detach(), k.detach(), v.detach(), causal, **kw)


@requires_gpu
@requires_torch
@pytest.mark.parametrize("sq, sk", [(1000, 1000), (700, 1500), (1500, 700)])
@pytest.mark.parametrize("c", [128, 300])
@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (-1, -1)), (False, (200, 50))])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("deterministic", [False, True])
def test_gpu_dense_gradients(rng, sq, sk, c, causal, window, d, deterministic):
    import torch
    import cuflash.torch as ct
    q, k, v = _leaves(rng, 2, sq, sk, 8, 2, d)
    out, lse = ct.attention(q, k, v, causal=causal, window_size=window, attention_chunk=c,
                            deterministic=deterministic, return_lse=True)
    assert out.shape == q.shape and out.is_contiguous() and lse.shape == (2, 8, sq) and lse.is_contiguous()
    with torch.no_grad():  # the chunk kernels: the same result up to rounding
        direct, lse_direct = ct.attention(q, k, v, causal=causal, window_size=window, attention_chunk=c,
                                          return_lse=True)
    assert (out - direct).abs().max().item() <= 2e-2
    fin = torch.isfinite(lse_direct)
    assert torch.equal(torch.isposinf(lse_direct), torch.isposinf(lse)) and torch.equal(fin, torch.isfinite(lse))
    assert (lse - lse_direct)[fin].abs().max().item() < 1e-3
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    if deterministic:
        assert all(torch.equal(a, b) for a, b in zip(grads, torch.autograd.grad(
            ct.attention(q, k, v, causal=causal, window_size=window, attention_chunk=c, deterministic=True),
            (q, k, v), do)))
    _check_all(out, grads, do, q, k, v, causal=causal, window_size=window, attention_chunk=c)


@requires_gpu
@requires_torch
@pytest.mark.parametrize("mod", ["softcap", "alibi", "alibi_batch", "sinks", "qkv_packed"])
def test_gpu_gradients_with_modifiers(rng, mod):
    import torch
    import cuflash.torch as ct
    b, s, h, hk, d, c = 2, 900, 6, 3, 128, 256
    kw = dict(causal=True, attention_chunk=c)
    if mod == "qkv_packed":  # views of one (b, s, 3, h, d) tensor, as flash_attn_qkvpacked_func takes them
        from test_gpu_forward import torch_inputs
        qkv = torch.stack(torch_inputs(rng, b, s, s, h, h, d, "bfloat16"), dim=2).requires_grad_()
        q, k, v = qkv.unbind(2)
    else:
        q, k, v = _leaves(rng, b, s, s, h, hk, d)
    if mod == "softcap":
        kw["softcap"] = 15.0
    elif mod.startswith("alibi"):
        kw["alibi_slopes"] = torch.rand((b, h) if mod == "alibi_batch" else (h,), device="cuda") * 0.2
    sinks = torch.randn(h, device="cuda", requires_grad=True) if mod == "sinks" else None
    out = ct.attention(q, k, v, sinks=sinks, **kw)
    do = torch.randn_like(out)
    leaves = (qkv,) if mod == "qkv_packed" else (q, k, v) + ((sinks,) if sinks is not None else ())
    grads = torch.autograd.grad(out, leaves, do)
    if mod == "qkv_packed":
        grads = grads[0].unbind(2)
    qd, kd, vd = (x.detach() for x in (q, k, v))
    from test_gpu_forward import check, to_np
    np_kw = {n: (to_np(x) if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    extra = {} if sinks is None else {"sinks": to_np(sinks.detach())}
    check(out.detach(), qd, kd, vd, **np_kw, **extra)
    args = [to_np(x) for x in (do, qd, kd, vd)]
    ref64 = cuflash.reference.attention_backward(*args, **np_kw, **extra)
    same = cuflash.reference.attention_backward(*args, precision="same", **np_kw, **extra)
    from test_gpu_backward import _compare
    _compare(grads[:3], ref64[:3], same[:3], mod)
    if sinks is not None:
        err = abs(grads[3].cpu().double().numpy() - ref64[3]).max()
        assert err <= 3 * abs(same[3].astype(np.float64) - ref64[3]).max() + 1e-3, err


@requires_gpu
@requires_torch
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("same", [False, True])
def test_gpu_packed_gradients(rng, causal, same):
    import torch
    import cuflash.torch as ct
    from test_gpu_forward import to_np
    lens_k = [300, 1, 0, 900, 77, 513]
    lens_q = lens_k if same else [300, 1, 0, 700, 100, 513]
    cq = torch.tensor(np.cumsum([0] + lens_q), dtype=torch.int32, device="cuda")
    ck = cq if same else torch.tensor(np.cumsum([0] + lens_k), dtype=torch.int32, device="cuda")
    q, k, v = (t[0].detach().requires_grad_() for t in _leaves(rng, 1, sum(lens_q), sum(lens_k), 6, 2, 128))
    out = ct.attention_varlen(q, k, v, cq, ck, max(lens_q), max(lens_k), causal=causal, attention_chunk=128)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    args = [to_np(x.detach()) for x in (q, k, v)] + [cq.cpu().numpy(), ck.cpu().numpy()]
    want = cuflash.reference.attention_varlen(*args, causal=causal, attention_chunk=128)
    same_out = cuflash.reference.attention_varlen(*args, causal=causal, attention_chunk=128, precision="same")
    err = np.abs(to_np(out.detach()).astype(np.float64) - want).max()
    assert err <= 2 * np.abs(same_out.astype(np.float64) - want).max() + 1e-5
    ref64 = cuflash.reference.attention_varlen_backward(to_np(do), *args, causal=causal, attention_chunk=128)
    same_g = cuflash.reference.attention_varlen_backward(to_np(do), *args, causal=causal, attention_chunk=128,
                                                         precision="same")
    from test_gpu_backward import _compare
    _compare(grads, ref64, same_g, f"packed causal={causal}")


@requires_gpu
@requires_torch
def test_gpu_dropout_gradients(rng):
    """Dropout with a chunk and gradients draws the mask of the pieces as packed sequences
    (sequence p of the mask = piece p): output and gradients against the reference over the same
    pieces and seed; the same seed repeats them, the generator's offset moves past the pieces."""
    import torch
    import cuflash.torch as ct
    from cuflash.torch import ops
    from test_gpu_forward import to_np
    b, s, h, d, c = 2, 600, 4, 64, 200
    q, k, v = _leaves(rng, b, s, s, h, h, d)
    out = ct.attention(q, k, v, causal=True, attention_chunk=c, dropout_p=0.2, seed=1234, offset=8)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    again = ct.attention(q, k, v, causal=True, attention_chunk=c, dropout_p=0.2, seed=1234, offset=8)
    with torch.no_grad():  # the same mask without gradients (activation checkpointing's recompute)
        no_grad = ct.attention(q, k, v, causal=True, attention_chunk=c, dropout_p=0.2, seed=1234, offset=8)
    assert torch.equal(out, again) and torch.equal(out, no_grad)
    cu_q, cu_k, _, _, _ = ops._chunk_pieces(q, k, None, c)
    flat = lambda x: to_np(x.detach()).reshape(-1, h, d)
    args = [flat(q), flat(k), flat(v), cu_q.cpu().numpy(), cu_k.cpu().numpy()]
    kw = dict(causal=True, dropout_p=0.2, seed=1234, offset=8)
    want = cuflash.reference.attention_varlen(*args, **kw)
    same = cuflash.reference.attention_varlen(*args, precision="same", **kw)
    err = np.abs(flat(out).astype(np.float64) - want).max()
    assert err <= 2 * np.abs(same.astype(np.float64) - want).max() + 1e-5
    ref64 = cuflash.reference.attention_varlen_backward(flat(do), *args, **kw)
    same_g = cuflash.reference.attention_varlen_backward(flat(do), *args, precision="same", **kw)
    from test_gpu_backward import _compare
    _compare([g.reshape(-1, h, d) for g in grads], ref64, same_g, "dropout")
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    before = gen.get_offset()
    ct.attention(q, k, v, causal=True, attention_chunk=c, dropout_p=0.2)
    assert gen.get_offset() - before == cuflash.reference.dropout_offset_increment(len(cu_q) - 1, h)


@requires_gpu
@requires_torch
def test_gpu_paged_cache_is_forward_only(rng):
    """A chunked call on a paged cache (block_table) where gradients are recorded: the output as
    without them, and a backward through it raises (no silently missing gradient)."""
    import torch
    import cuflash.torch as ct
    q = _leaves(rng, 1, 20, 20, 4, 2, 64)[0][0]
    kc, vc = (torch.randn(4, 256, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device="cuda")
    cq = torch.tensor([0, 10, 20], dtype=torch.int32, device="cuda")
    ck = torch.tensor([0, 512, 1000], dtype=torch.int32, device="cuda")
    out = ct.attention_varlen(q, kc, vc, cq, ck, 10, 512, causal=True, block_table=table, attention_chunk=100)
    with torch.no_grad():
        assert torch.equal(out, ct.attention_varlen(q, kc, vc, cq, ck, 10, 512, causal=True, block_table=table,
                                                    attention_chunk=100))
    with pytest.raises(NotImplementedError, match="block_table"):
        out.sum().backward()


@requires_gpu
@requires_torch
def test_gpu_errors_before_any_work(rng):
    import torch
    import cuflash.torch as ct
    q, k, v = _leaves(rng, 2, 300, 300, 4, 2, 64)
    with pytest.raises(ValueError, match="startend_row_indices"):
        ct.attention(q, k, v, attention_chunk=64,
                     startend_row_indices=torch.zeros(2, 1, 300, 1, dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match="alibi_slopes"):
        ct.attention(q, k, v, attention_chunk=64, alibi_slopes=torch.zeros(3, 4, device="cuda"))
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    before = gen.get_offset()
    with pytest.raises(ValueError, match="batch"):
        ct.attention(q, k[:1], v[:1], attention_chunk=64, dropout_p=0.1)
    with pytest.raises(ValueError, match="sinks"):
        ct.attention(q, k, v, attention_chunk=64, dropout_p=0.1, sinks=torch.zeros(4, device="cuda"))
    assert gen.get_offset() == before
    with pytest.raises(TypeError, match="attention_chunk"):
        ct.attention(q, k, v, attention_chunk=64.0)


@requires_gpu
@requires_torch
def test_gpu_flash_attn3_gradients(rng):
    """cuflash.flash_attn3 with attention_chunk differentiates through the chunk (FlashAttention-3's
    own backward ignores it): its gradients are cuflash.torch's, bitwise (deterministic)."""
    import torch
    import cuflash.torch as ct
    from cuflash import flash_attn3
    q, k, v = _leaves(rng, 2, 500, 500, 4, 2, 128)
    do = torch.randn_like(q)
    a = torch.autograd.grad(flash_attn3.flash_attn_func(q, k, v, causal=True, attention_chunk=200,
                                                               deterministic=True), (q, k, v), do)
    b = torch.autograd.grad(ct.attention(q, k, v, causal=True, attention_chunk=200, deterministic=True),
                            (q, k, v), do)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@requires_torch
def test_shape_errors_name_the_arguments():
    """Checked on the call as given, before any piece is made (CPU tensors: shapes only)."""
    import torch
    from cuflash.torch import ops
    q, k = torch.zeros(2, 30, 4, 8), torch.zeros(2, 30, 2, 8)
    chk = lambda q, k, v, varlen=None, alibi=None, sinks=None: ops._check_chunked_shapes(
        q, k, v, varlen, (-1, -1), 0.0, alibi, None, sinks)
    chk(q, k, k, sinks=torch.zeros(4))
    with pytest.raises(ValueError, match="batch"):
        chk(q, k[:1], k[:1])
    with pytest.raises(ValueError, match="sinks"):
        chk(q, k, k, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="alibi_slopes"):
        chk(q, k, k, alibi=torch.zeros(3, 4))
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    flat = lambda x: x.reshape(-1, *x.shape[2:])
    chk(flat(q), flat(k), flat(k), (cu, cu, 20, 20))
    with pytest.raises(TypeError, match="cu_seqlens_k"):
        chk(flat(q), flat(k), flat(k), (cu, cu.long(), 20, 20))
    with pytest.raises(ValueError, match="same length"):
        chk(flat(q), flat(k), flat(k), (cu, cu[:2], 20, 20))
    with pytest.raises(TypeError, match="max_seqlen_q"):
        chk(flat(q), flat(k), flat(k), (cu, cu, 20.0, 20))
    with pytest.raises(ValueError, match="alibi_slopes"):
        chk(flat(q), flat(k), flat(k), (cu, cu, 20, 20), alibi=torch.zeros(3, 4))


@requires_torch
def test_too_many_pieces_name_the_chunk():
    """A chunk so small that the pieces outgrow one launch: a ValueError naming attention_chunk,
    before anything is made (meta tensors: no memory)."""
    import torch
    from cuflash.torch import ops
    q, k = torch.empty(2, 10, 1, 8, device="meta"), torch.empty(2, 200_000, 1, 8, device="meta")
    with pytest.raises(ValueError, match="attention_chunk=1 as packed sequences"):
        ops._chunk_pieces(q, k, None, 1)
    assert ops._chunk_pieces(q, k, None, 8)[4] == 25_001


@requires_torch
def test_chunked_glue_against_the_reference(monkeypatch):
    """_chunked's own steps on the CPU (the packed-sequence call replaced by the float64
    reference): the pieces, ALiBi's (batch, nheads) slopes repeated per piece, the output's shape
    and the lse's (batch, nheads, seqlen_q) layout, against the reference with the chunk."""
    import torch
    from cuflash.torch import ops
    calls = []

    def varlen_ref(q, k, v, cu_q, cu_k, max_q, max_k, *, alibi_slopes=None, return_lse=False, sinks=None,
                   deterministic=False, dropout_p=0.0, seed=None, offset=None, **kw):
        calls.append((cu_q.shape[0] - 1, max_q, max_k))
        assert np.diff(cu_q.numpy()).max() <= max_q and np.diff(cu_k.numpy()).max() <= max_k
        o, l = cuflash.reference.attention_varlen(q.detach().numpy(), k.numpy(), v.numpy(), cu_q.numpy(), cu_k.numpy(),
                                                  alibi_slopes=None if alibi_slopes is None else alibi_slopes.numpy(),
                                                  return_lse=True, **kw)
        return torch.from_numpy(o), torch.from_numpy(l)
    monkeypatch.setattr(ops, "attention_varlen", varlen_ref)
    rng = np.random.default_rng(0)
    for b, sq, sk, c in [(2, 50, 50, 16), (3, 30, 70, 20), (2, 70, 30, 8)]:
        q, k, v = (torch.from_numpy(rng.standard_normal(s)) for s in ((b, sq, 4, 8), (b, sk, 2, 8), (b, sk, 2, 8)))
        slopes = torch.from_numpy(rng.uniform(0.1, 1, (b, 4)).astype(np.float32))
        kw = dict(causal=sq <= sk, window_size=(-1, -1), softcap=0.0, softmax_scale=None)
        out, lse = ops._chunked(q.requires_grad_(), k, v, None, alibi_slopes=slopes, deterministic=False,
                                return_lse=True, sinks=None, dropout_p=0.0, seed=None, offset=None,
                                attention_chunk=c, **kw)
        want, lse_want = cuflash.reference.attention(q.detach().numpy(), k.numpy(), v.numpy(), attention_chunk=c,
                                                     alibi_slopes=slopes.numpy(), return_lse=True, **kw)
        assert out.shape == q.shape and lse.shape == (b, 4, sq) and lse.is_contiguous()
        np.testing.assert_allclose(out.numpy(), want, atol=1e-12)
        assert np.array_equal(np.isposinf(lse.numpy()), np.isposinf(lse_want))
        fin = np.isfinite(lse_want)
        np.testing.assert_allclose(lse.numpy()[fin], lse_want[fin], atol=1e-12)
        assert calls[-1][0] == b * (-(-sk // c) + 1)


@requires_gpu
@requires_torch
def test_gpu_hf_llama4_chunked_layers():
    """A small Llama 4 text model (chunks of 128 tokens, every other layer full attention) on the
    GPU in bfloat16, 2 x 600 tokens, one sequence left-padded: the cuflash backend's logits and a
    training step's loss and gradients against SDPA's (transformers' own chunked mask); greedy
    generation with a cache across a chunk boundary (200 -> 320 tokens), each step's logits
    against SDPA's over the whole generated sequence."""
    import importlib.util
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("needs transformers (optional dependency)")
    import torch
    import transformers
    if not hasattr(transformers, "Llama4TextConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Llama 4")
    from transformers import Llama4ForCausalLM, Llama4TextConfig
    import cuflash.torch as ct
    ct.register_transformers()
    models = []
    for attn in ("cuFlash", "sdpa"):
        cfg = Llama4TextConfig(vocab_size=512, hidden_size=256, intermediate_size=256, intermediate_size_mlp=256,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=4,
                               attention_chunk_size=128, no_rope_layer_interval=2, initializer_range=0.05,
                               num_local_experts=1)
        torch.manual_seed(0)
        models.append(Llama4ForCausalLM._from_config(cfg, attn_implementation=attn, dtype=torch.bfloat16).cuda())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 512, (2, 600), generator=g).cuda()
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    with torch.no_grad():
        a, b = (m.eval()(ids, attention_mask=mask).logits.float() for m in models)
    keep = mask.bool()
    err = (a - b)[keep].abs().max().item()
    assert err < 0.05 * b[keep].abs().max().item(), err
    grads, losses = [], []
    for m in models:
        m.train().zero_grad()
        loss = m(ids[:1], labels=ids[:1]).loss
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.float().flatten() for p in m.parameters() if p.grad is not None]))
    assert abs(losses[0] - losses[1]) < 1e-2 * abs(losses[1])
    cos = torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0).item()
    assert cos > 0.99, cos
    with torch.no_grad():
        prompt = ids[:1, :200]
        gen = models[0].eval().generate(prompt, max_new_tokens=120, do_sample=False, pad_token_id=0, eos_token_id=None,
                                        output_logits=True, return_dict_in_generate=True)
        full = models[1].eval()(gen.sequences).logits.float()
    steps = torch.stack(gen.logits, dim=1)[0].float()  # (new tokens, vocab): step t predicts token 200 + t
    want = full[0, 199:199 + steps.shape[0]]
    err = (steps - want).abs().max().item()
    assert err < 0.05 * want.abs().max().item(), err


# ---------------------------------------------------------------------------------------------
# cuflash.attention_backward / attention_varlen_backward with attention_chunk (the array API)

def test_array_backward_chunk_refusals():
    """attention_chunk in the array API's backward: checked like the forward's, and refused with
    FlashMask or dropout (their masks would not carry over to the pieces), before any work."""
    from cuflash.backward import attention_backward
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 8, 2, 8)).astype(np.float16) for _ in range(3))
    lse = np.zeros((1, 2, 8), np.float32)
    with pytest.raises((TypeError, ValueError), match="attention_chunk"):
        attention_backward(q, q, k, v, q, lse, attention_chunk=-3)
    with pytest.raises(ValueError, match="attention_chunk cannot be combined with dropout_p"):
        attention_backward(q, q, k, v, q, lse, attention_chunk=4, dropout_p=0.1, seed=1)
    idx = np.full((1, 1, 8, 1), 8, np.int32)
    with pytest.raises(ValueError, match="attention_chunk cannot be combined with startend_row_indices"):
        attention_backward(q, q, k, v, q, lse, causal=True, attention_chunk=4, startend_row_indices=idx)


@requires_gpu
@requires_torch
@pytest.mark.parametrize("framework", ["torch", "cupy", "numpy"])
@pytest.mark.parametrize("packed", [False, True])
def test_gpu_array_backward_with_chunk(rng, framework, packed):
    """cuflash.attention_backward (dense, seqlen_q != seqlen_k) and attention_varlen_backward
    (packed, an empty sequence) with attention_chunk, on the forward's output and LSE
    (cuflash.attention(_varlen) with the chunk), in PyTorch, CuPy and NumPy arrays: gradients
    within flash-attn's rule of the float64 reference with the chunk; given dq, dk, dv written."""
    import cupy
    import torch
    from test_gpu_backward import _compare
    from test_gpu_forward import to_np
    h, hk, d, c = 6, 2, 64, 128
    # (CuPy arrays from NumPy's: CuPy reads a bfloat16 PyTorch tensor as a void dtype)
    conv = {"torch": lambda x: x, "cupy": lambda x: cupy.asarray(to_np(x)), "numpy": to_np}[framework]
    ints = lambda x: x.cpu().numpy() if isinstance(x, torch.Tensor) else cupy.asnumpy(x)  # noqa: E731
    if packed:
        lens_q, lens_k = [300, 0, 700, 100], [300, 5, 500, 400]
        cu_q, cu_k = (torch.tensor(np.cumsum([0] + x), dtype=torch.int32, device="cuda") for x in (lens_q, lens_k))
        q, k, v = (t[0].detach() for t in _leaves(rng, 1, sum(lens_q), sum(lens_k), h, hk, d))
        cus = {"torch": lambda x: x, "cupy": lambda x: cupy.asarray(ints(x)), "numpy": ints}[framework]
        extra = (cus(cu_q), cus(cu_k), max(lens_q), max(lens_k))
    else:
        q, k, v = (t.detach() for t in _leaves(rng, 2, 700, 450, h, hk, d))
        extra = ()
    kw = dict(causal=True, window_size=(200, -1), attention_chunk=c)
    q, k, v = (conv(x) for x in (q, k, v))
    fwd = cuflash.attention_varlen if packed else cuflash.attention
    from cuflash.backward import attention_backward, attention_varlen_backward
    bwd = attention_varlen_backward if packed else attention_backward
    out, lse = fwd(q, k, v, *extra, return_lse=True, **kw)
    do = conv(torch.randn(q.shape, device="cuda").to(torch.bfloat16))
    given = [conv(torch.full(x.shape, float("nan"), device="cuda").to(torch.bfloat16)) for x in (q, k, v)]
    grads = bwd(do, q, k, v, out, lse, *extra, dq=given[0], dk=given[1], dv=given[2], **kw)
    assert all(g is x for g, x in zip(grads, given)) and all(type(g) is type(q) for g in grads)
    args = [to_np(x) for x in (do, q, k, v)] + [ints(x) if not isinstance(x, np.ndarray) else x for x in extra[:2]]
    ref = cuflash.reference.attention_varlen_backward if packed else cuflash.reference.attention_backward
    ref64 = ref(*args, **kw)
    same = ref(*args, precision="same", **kw)
    _compare(grads, ref64, same, f"{framework} packed={packed}")
    again = bwd(do, q, k, v, out, lse, *extra, **kw)  # (new gradient arrays)
    _compare(again, ref64, same, f"{framework} packed={packed}, new arrays")
