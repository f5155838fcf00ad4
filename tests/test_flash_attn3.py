"""FlashAttention-3's API on cuflash (cuflash/flash_attn3.py): argument mapping, the value head
dim's padding and pieces, flash_attn_combine (CPU, PyTorch), and GPU checks against the float64
reference and cuflash's own entry points."""
import numpy as np
import pytest

from conftest import requires_sm90

torch = pytest.importorskip("torch", reason="needs PyTorch (optional dependency)")

from cuflash import flash_attn3 as fa3  # noqa: E402


def _fa3_lse(lse):
    """The float64 reference's LSE (+inf for a row that sees no key) in FlashAttention-3's convention (-inf)."""
    return np.where(np.isposinf(lse), -np.inf, lse)


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
    for bad in (-1, 1.5, True):  # (sm_margin is a hint, checked as num_splits is; None and zeros pass)
        with pytest.raises(TypeError, match="sm_margin must be an int >= 0"):
            fa3.flash_attn_func(q, q, q, sm_margin=bad)
    for fine in (None, False, 0, 0.0, 8):
        fa3._hints(0, None, fine)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(TypeError, match="seqused_q must be an int32"):
        fa3.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 4, 4, seqused_q=torch.zeros(1))
    with pytest.raises(ValueError, match=r"seqused_k must have shape \(batch,\) = \(1,\)"):
        fa3.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 4, 4, seqused_k=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(TypeError, match="cu_seqlens_k must be a 1-dim int32"):
        fa3.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu.long(), 4, 4, seqused_k=torch.ones(1, dtype=torch.int32))
    with pytest.raises(TypeError, match="cu_seqlens_q must be a 1-dim int32"):
        fa3.flash_attn_with_kvcache(q[0], q, q, cu_seqlens_q=torch.zeros(2), max_seqlen_q=4)
    with pytest.raises(TypeError, match="max_seqlen_q must be an int"):
        fa3.flash_attn_with_kvcache(q[0], q, q, cu_seqlens_q=torch.tensor([0, 4], dtype=torch.int32))
    with pytest.raises(TypeError, match="num_splits"):
        fa3.flash_attn_func(q, q, q, num_splits=-1)
    with pytest.raises(ValueError, match="num_heads_q"):
        fa3.flash_attn_qkvpacked_func(torch.zeros(1, 4, 6, 64))
    assert fa3.get_scheduler_metadata(1, 1, 128, 8, 8, 128, torch.zeros(1)) is None


def test_fp8_dequantized_copies():
    """The FP8 calls the FP8 kernel does not take attend to bf16 copies of x * descale: per KV head
    (a query head takes its group's), per sequence when packed, dims of 1 broadcast; bad descales
    raise naming themselves."""
    fp8 = torch.float8_e4m3fn
    assert fa3._fp8_kernel_runs(torch.zeros(1, 1, 1, 128), torch.zeros(1, 1, 1, 128), (-1, -1), 0.0, 0)
    assert not fa3._fp8_kernel_runs(torch.zeros(1, 1, 1, 96), torch.zeros(1, 1, 1, 96), (-1, -1), 0.0, 0)
    assert not fa3._fp8_kernel_runs(torch.zeros(1, 1, 1, 64), torch.zeros(1, 1, 1, 64), (3, 0), 0.0, 0)
    assert not fa3._fp8_kernel_runs(torch.zeros(1, 1, 1, 64), torch.zeros(1, 1, 1, 64), (-1, -1), 5.0, 0)
    assert not fa3._fp8_kernel_runs(torch.zeros(1, 1, 1, 64), torch.zeros(1, 1, 1, 64), (-1, -1), 0.0, 7)
    q = (torch.randn(2, 3, 4, 8) * 4).to(fp8)
    k = (torch.randn(2, 5, 2, 8) * 4).to(fp8)
    qd, kd = torch.rand(2, 2) + 0.5, torch.rand(1, 1) + 0.5
    dq, dk, dv = fa3._dequantized_qkv(q, k, k, (qd, kd, None), 2)
    want_q = q.float() * qd.repeat_interleave(2, dim=1)[:, None, :, None]
    assert dq.dtype == torch.bfloat16 and torch.equal(dq, want_q.bfloat16())
    assert torch.equal(dk, (k.float() * kd).bfloat16()) and torch.equal(dv, k.float().bfloat16())
    seq_q = torch.tensor([0, 0, 1, 1, 1, 1])  # packed: tokens 0-1 of sequence 0, 2-5 of sequence 1 (5: past it)
    seq_k = torch.tensor([1, 1, 1])
    pq, pk, _ = fa3._dequantized_qkv(q[0].repeat(2, 1, 1), k[0, :3], k[0, :3], (qd, kd, None), 2, (seq_q, seq_k))
    per_tok = qd.repeat_interleave(2, dim=1)[seq_q.clamp(max=1)]
    assert torch.equal(pq, (q[0].repeat(2, 1, 1).float() * per_tok[:, :, None]).bfloat16())
    assert torch.equal(pk, (k[0, :3].float() * kd).bfloat16())
    with pytest.raises(ValueError, match="k_descale must be float32"):
        fa3._dequantized_qkv(q, k, k, (None, torch.ones(3, 2), None), 2)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fa3._dequantized_qkv(q, k.float(), k, (None, None, None), 2)
    with pytest.raises(ValueError, match="nheads"):
        fa3._dequantized_qkv(q[:, :, :3], k, k, (None, None, None), 2)
    # the copies record no gradients: FP8 is forward only
    assert not fa3._dequantized_qkv(q.requires_grad_(), k, k, (None, None, None), 2)[0].requires_grad


def test_kvcache_packed_queries_pad_and_gather(monkeypatch):
    """flash_attn_with_kvcache with cu_seqlens_q (CPU, the kernel call faked): q padded in front to
    max_seqlen_q rows per sequence, the dense call's rows gathered back to the tokens (LSE as
    (nheads, total_q)), tokens past the last sequence 0 / -inf (FlashAttention-3's LSE of a row
    that sees no key), the other arguments passed on."""
    import cuflash
    seen = {}

    def fake(q, k_cache, v_cache, k=None, v=None, **kw):
        seen.update(q=q.clone(), kw=kw)
        rows = torch.arange(q.shape[1], dtype=torch.float32)
        return q * 2, rows.expand(q.shape[0], q.shape[2], q.shape[1]) + 100 * torch.arange(q.shape[0])[:, None, None]
    monkeypatch.setattr(cuflash, "attention_with_kvcache", fake)
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    q = torch.randn(6, 3, 8)  # token 5 is past the last sequence
    out, lse = fa3.flash_attn_with_kvcache(q, torch.zeros(3, 16, 1, 8), torch.zeros(3, 16, 1, 8), cu_seqlens_q=cu,
                                           max_seqlen_q=4, causal=True, return_softmax_lse=True, num_splits=2)
    dense = seen["q"]
    assert dense.shape == (3, 4, 3, 8)
    assert torch.equal(dense[0, 2:], q[0:2]) and (dense[0, :2] == 0).all() and (dense[1] == 0).all()
    assert torch.equal(dense[2, 1:], q[2:5]) and (dense[2, :1] == 0).all()
    assert torch.equal(out[:5], 2 * q[:5]) and (out[5] == 0).all()
    assert lse.shape == (3, 6)
    assert lse[0].tolist() == [2, 3, 201, 202, 203, -float("inf")]
    assert seen["kw"]["causal"] and seen["kw"]["num_splits"] == 2 and seen["kw"]["return_lse"]
    # max_seqlen_q an upper bound (above total_q): read as total_q rows, the same tokens' outputs
    out2, _ = fa3.flash_attn_with_kvcache(q, torch.zeros(3, 16, 1, 8), torch.zeros(3, 16, 1, 8), cu_seqlens_q=cu,
                                          max_seqlen_q=10 ** 6, causal=True, return_softmax_lse=True)
    assert seen["q"].shape == (3, 6, 3, 8) and torch.equal(out2, out)


def test_fp8_kvcache_through_bf16_copies(monkeypatch):
    """float8_e4m3fn caches (CPU, the kernel call faked): the bf16 call sees q times q_descale *
    k_descale of its KV head, the caches and new k, v as their exact bf16 values; its output is
    multiplied by v_descale; the e4m3 caches are rewritten from the copies the call appended to
    (untouched rows unchanged); mixed dtypes and bad descales are refused before any work."""
    import cuflash
    seen = {}

    def fake(q, k_cache, v_cache, k=None, v=None, **kw):
        seen.update(q=q.clone(), dtypes=(k_cache.dtype, v_cache.dtype, k.dtype, v.dtype), kw=kw)
        k_cache[:, 3] = k[:, 0]  # the append
        v_cache[:, 3] = v[:, 0]
        return torch.ones(q.shape, dtype=torch.bfloat16), torch.zeros(q.shape[0], q.shape[2], q.shape[1])
    monkeypatch.setattr(cuflash, "attention_with_kvcache", fake)
    e4 = torch.float8_e4m3fn
    f8 = lambda *s: (torch.randn(*s) * 3).to(e4)  # noqa: E731
    q, kc, vc, kn, vn = f8(2, 1, 4, 8), f8(2, 6, 2, 8), f8(2, 6, 2, 8), f8(2, 1, 2, 8), f8(2, 1, 2, 8)
    before = kc.clone()
    qd, kd, vd = torch.tensor([[0.5, 2.0], [1.0, 4.0]]), torch.tensor([[2.0, 0.25]]), torch.tensor([[3.0], [0.5]])
    out, lse = fa3.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=3, q_descale=qd, k_descale=kd,
                                           v_descale=vd, causal=True, return_softmax_lse=True)
    assert seen["dtypes"] == (torch.bfloat16,) * 4 and seen["kw"]["causal"]
    per_head = (qd * kd).repeat_interleave(2, dim=1)  # query heads 0, 1 -> KV head 0; 2, 3 -> 1
    torch.testing.assert_close(seen["q"].float(), (q.float() * per_head[:, None, :, None]).bfloat16().float())
    assert out.dtype == torch.bfloat16 and torch.equal(out[0].float(), torch.full((1, 4, 8), 3.0))
    assert torch.equal(out[1].float(), torch.full((1, 4, 8), 0.5)) and lse.shape == (2, 4, 1)
    assert torch.equal(kc[:, 3], kn[:, 0]) and torch.equal(vc[:, 3], vn[:, 0])
    assert torch.equal(kc[:, :3], before[:, :3]) and torch.equal(kc[:, 4:], before[:, 4:])
    with pytest.raises(ValueError, match="k and v must be given together"):
        fa3.flash_attn_with_kvcache(q, kc, vc, kn, None, cache_seqlens=3)
    with pytest.raises(TypeError, match="cu_seqlens_q must be a 1-dim int32 tensor"):
        fa3.flash_attn_with_kvcache(q[:, 0], kc, vc, cu_seqlens_q=[0, 1, 2], max_seqlen_q=1)
    with pytest.raises(TypeError, match="all float8_e4m3fn, got k_cache torch.bfloat16"):
        fa3.flash_attn_with_kvcache(q, kc.bfloat16(), vc, cache_seqlens=3)
    with pytest.raises(ValueError, match="v_descale must be float32"):
        fa3.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=3, v_descale=torch.ones(3, 2))
    with pytest.raises(NotImplementedError, match="k_descale"):
        fa3.flash_attn_with_kvcache(q.bfloat16(), kc.bfloat16(), vc.bfloat16(), k_descale=kd)


def test_fp8_kvcache_copies_only_the_rows_it_reads(monkeypatch):
    """float8_e4m3fn paged caches (CPU, the kernel call faked as the append kernel and a reader):
    the bf16 call gets copies of the pages each block-table row lists up to the longest sequence
    plus its new rows (max(cache_seqlens) + s_new rows: 2 pages of 4 here, not the 40-page pool)
    with a table addressing them; the appended rows reach the right rows of the pool, every other
    row of it untouched. A contiguous cache with cache_batch_idx: its batch rows, that many rows
    (every row with rotary tables, whose rules read the capacity)."""
    import cuflash
    seen = {}

    def fake(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None, cache_batch_idx=None, **kw):
        seen.update(shape=tuple(k_cache.shape), table=block_table, idx=cache_batch_idx)
        for b in range(k.shape[0]):
            for i in range(k.shape[1]):
                pos = int(cache_seqlens[b]) + i
                if block_table is None:
                    k_cache[b, pos], v_cache[b, pos] = k[b, i], v[b, i]
                else:
                    page = k_cache.shape[1]
                    k_cache[block_table[b, pos // page], pos % page] = k[b, i]
                    v_cache[block_table[b, pos // page], pos % page] = v[b, i]
        return torch.zeros(q.shape, dtype=torch.bfloat16)
    monkeypatch.setattr(cuflash, "attention_with_kvcache", fake)
    e4 = torch.float8_e4m3fn
    f8 = lambda *s: (torch.randn(*s) * 3).to(e4)  # noqa: E731
    pool_k, pool_v = f8(40, 4, 2, 8), f8(40, 4, 2, 8)
    table = torch.tensor([[7, 3, 30, 31], [12, 0, 33, 34]], dtype=torch.int32)
    lens = torch.tensor([5, 2], dtype=torch.int32)
    q, kn, vn = f8(2, 2, 4, 8), f8(2, 2, 2, 8), f8(2, 2, 2, 8)
    k0, v0 = pool_k.clone(), pool_v.clone()
    fa3.flash_attn_with_kvcache(q, pool_k, pool_v, kn, vn, cache_seqlens=lens, page_table=table)
    assert seen["shape"] == (4, 4, 2, 8) and seen["table"].tolist() == [[0, 1], [2, 3]] and seen["idx"] is None
    want_k, want_v = k0.clone(), v0.clone()
    for b, i in ((0, 0), (0, 1), (1, 0), (1, 1)):
        pos = int(lens[b]) + i
        want_k[table[b, pos // 4], pos % 4], want_v[table[b, pos // 4], pos % 4] = kn[b, i], vn[b, i]
    assert torch.equal(pool_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(pool_v.view(torch.uint8), want_v.view(torch.uint8))
    cache_k, cache_v = f8(5, 16, 2, 8), f8(5, 16, 2, 8)
    c0 = cache_k.clone()
    idx = torch.tensor([4, 1], dtype=torch.int32)
    fa3.flash_attn_with_kvcache(q, cache_k, cache_v, kn, vn, cache_seqlens=lens, cache_batch_idx=idx)
    assert seen["shape"] == (2, 7, 2, 8) and seen["idx"] is None and seen["table"] is None
    want = c0.clone()
    want[4, 5:7], want[1, 2:4] = kn[0], kn[1]
    assert torch.equal(cache_k.view(torch.uint8), want.view(torch.uint8))
    # With rotary tables the rows rotate by rules that read the capacity: every row is copied.
    cos = torch.ones(16, 4, dtype=torch.bfloat16)
    fa3.flash_attn_with_kvcache(q, cache_k, cache_v, kn, vn, rotary_cos=cos, rotary_sin=cos, cache_seqlens=lens,
                                cache_batch_idx=idx)
    assert seen["shape"] == (2, 16, 2, 8)


def test_kvcache_batch_idx_picks_page_table_rows(monkeypatch):
    """FlashAttention-3's cache_batch_idx with a page_table (CPU, the kernel call faked): sequence
    b reads the table's row cache_batch_idx[b]; bad types are refused before the call; a
    scheduler_metadata tensor is accepted and not used."""
    import cuflash
    seen = {}
    monkeypatch.setattr(cuflash, "attention_with_kvcache", lambda q, kc, vc, k=None, v=None, **kw: seen.update(kw))
    table = torch.arange(12, dtype=torch.int32).reshape(4, 3)
    idx = torch.tensor([2, 0], dtype=torch.int32)
    q, cache = torch.zeros(2, 1, 2, 8), torch.zeros(12, 16, 1, 8)
    fa3.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=5, page_table=table, cache_batch_idx=idx,
                                scheduler_metadata=torch.zeros(4, dtype=torch.int32))  # (a hint, not used)
    assert torch.equal(seen["block_table"], table[[2, 0]]) and seen["cache_batch_idx"] is None
    with pytest.raises(TypeError, match="scheduler_metadata must be None or a tensor"):
        fa3.flash_attn_with_kvcache(q, cache, cache, scheduler_metadata="auto")
    with pytest.raises(TypeError, match="cache_batch_idx must be an int32 tensor"):
        fa3.flash_attn_with_kvcache(q, cache, cache, page_table=table, cache_batch_idx=idx.long())
    with pytest.raises(ValueError, match=r"cache_batch_idx \(batch,\) = \(2,\), got shapes \(4, 3\) and \(3,\)"):
        fa3.flash_attn_with_kvcache(q, cache, cache, page_table=table, cache_batch_idx=idx.repeat(2)[:3])
    fa3.flash_attn_with_kvcache(q, cache, cache, page_table=table, cache_batch_idx=torch.tensor([9, -1], dtype=torch.int32))
    assert torch.equal(seen["block_table"], table[[3, 0]])  # (out-of-range rows: clamped, never read past)


@pytest.mark.parametrize("causal,window,softcap,chunk", [(False, (-1, -1), 0.0, 0), (True, (-1, -1), 0.0, 0),
                                                         (False, (3, 1), 5.0, 0), (True, (-1, -1), 0.0, 4)])
@pytest.mark.parametrize("sq,sk", [(5, 9), (9, 5)])
def test_qv_against_the_reference(causal, window, softcap, chunk, sq, sk):
    """qv (CPU): the scores q.k + qv.v are those of q' = [q, qv] against k' = [k, v] (the float64
    reference, V zero-padded to q''s width), with GQA, masks, softcap and rows that see no key (0,
    LSE -inf as FlashAttention-3's); the packed form per sequence, rows past the last sequence 0 /
    -inf; gradients
    flow to q, k, v and qv; bad qv is refused."""
    from cuflash import reference
    gen = torch.Generator().manual_seed(sq + 3 * causal + chunk)
    b, h, hk, d, dv = 2, 4, 2, 8, 16
    q, qv = torch.randn(b, sq, h, d, generator=gen), torch.randn(b, sq, h, dv, generator=gen)
    k, v = torch.randn(b, sk, hk, d, generator=gen), torch.randn(b, sk, hk, dv, generator=gen)
    for x in (q, qv, k, v):
        x.requires_grad_()
    out, lse = fa3.flash_attn_func(q, k, v, causal=causal, qv=qv, window_size=window, softcap=softcap,
                                   attention_chunk=chunk, return_attn_probs=True)
    qq, kk = torch.cat([q, qv], -1).detach().double().numpy(), torch.cat([k, v], -1).detach().double().numpy()
    vv = torch.nn.functional.pad(v, (0, d)).detach().double().numpy()
    ref, ref_lse = reference.attention(qq, kk, vv, causal=causal, window_size=window, softcap=softcap,
                                       attention_chunk=chunk, softmax_scale=(d + dv) ** -0.5, return_lse=True)
    np.testing.assert_allclose(out.detach().numpy(), ref[..., :dv], atol=1e-5)
    np.testing.assert_allclose(lse.detach().numpy(), _fa3_lse(ref_lse), atol=1e-5)
    out.sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, qv, k, v))
    cu_q = torch.tensor([0, sq, 2 * sq], dtype=torch.int32)
    cu_k = torch.tensor([0, sk, 2 * sk], dtype=torch.int32)
    packed = lambda x, extra=0: torch.cat([x.detach().flatten(0, 1), torch.zeros(extra, *x.shape[2:])])  # noqa: E731
    o2, l2 = fa3.flash_attn_varlen_func(packed(q, 1), packed(k), packed(v), cu_q, cu_k, sq, sk, causal=causal,
                                        qv=packed(qv, 1), window_size=window, softcap=softcap, attention_chunk=chunk,
                                        return_attn_probs=True)
    torch.testing.assert_close(o2[:-1], out.detach().flatten(0, 1))
    torch.testing.assert_close(l2[:, :-1], lse.detach().transpose(0, 1).flatten(1))
    assert (o2[-1] == 0).all() and torch.isneginf(l2[:, -1]).all()
    with pytest.raises(ValueError, match=r"qv must have shape \(2, \d+, 4, 16\)"):
        fa3.flash_attn_func(q, k, v, qv=qv[..., :4])
    with pytest.raises(ValueError, match="k must have q's head dim 8 and batch"):
        fa3.flash_attn_func(q, k[:1], v[:1], qv=qv)
    with pytest.raises(ValueError, match="attention_chunk"):
        fa3.flash_attn_func(q, k, v, qv=qv, attention_chunk=-2)
    with pytest.raises(ValueError, match="cu_seqlens_q must be 3 non-decreasing offsets from 0"):
        fa3.flash_attn_varlen_func(packed(q, 1), packed(k), packed(v), cu_q + 1, cu_k, sq, sk, qv=packed(qv, 1))
    with pytest.raises(NotImplementedError, match="qv with float8_e4m3fn"):
        fa3.flash_attn_func(q, k, v, qv=qv, q_descale=torch.ones(2, 2))


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=requires_sm90)])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("mask", [dict(causal=True), dict(window_size=(2, 1), attention_chunk=3)])
def test_qv_kvcache_against_the_reference(paged, dev, mask):
    """flash_attn_with_kvcache with qv (MLA decode over a latent cache wider than the rope cache):
    packed new keys appended at cache_seqlens[b] + i (through the page table, or the rows
    cache_batch_idx picks), every other row untouched, and each packed query sequence's output and
    LSE the float64 reference's of [q, qv] . [k, v] over its keys cache_leftpad[b] ... (masks
    aligned bottom-right, the chunk counted from the leftpad); bad arguments refused before any
    row is written."""
    from cuflash import reference
    gen = torch.Generator().manual_seed(5 + paged)
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(dev)  # noqa: E731
    b, h, hk, d, dv, page, cap = 3, 4, 1, 8, 16, 4, 16
    lens_q, lens_new, old, lead = [2, 1, 3], [2, 0, 3], [5, 0, 9], [2, 0, 3]
    if paged:
        kc, vc = rnd(b * cap // page + 2, page, hk, d), rnd(b * cap // page + 2, page, hk, dv)
        table = torch.randperm(b * cap // page + 2, generator=gen)[:b * cap // page].reshape(b, -1).int().to(dev)
        extra = dict(page_table=table)
        rows = lambda c, i, n: c[table[i][torch.arange(n, device=dev) // page].long(),  # noqa: E731
                                 torch.arange(n, device=dev) % page]
    else:
        kc, vc = rnd(b + 2, cap, hk, d), rnd(b + 2, cap, hk, dv)
        idx = torch.tensor([3, 0, 4], dtype=torch.int32, device=dev)
        extra = dict(cache_batch_idx=idx)
        rows = lambda c, i, n: c[int(idx[i]), :n]  # noqa: E731
    k0, v0 = kc.clone(), vc.clone()
    cu = lambda n: torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32, device=dev)  # noqa: E731
    q, qv = rnd(sum(lens_q), h, d), rnd(sum(lens_q), h, dv)
    kn, vn = rnd(sum(lens_new), hk, d), rnd(sum(lens_new), hk, dv)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
    out, lse = fa3.flash_attn_with_kvcache(q, kc, vc, kn, vn, qv=qv, cache_seqlens=i32(old),
                                           cache_leftpad=i32(lead), cu_seqlens_q=cu(lens_q),
                                           cu_seqlens_k_new=cu(lens_new), max_seqlen_q=3, return_softmax_lse=True,
                                           **mask, **extra)
    assert out.shape == (sum(lens_q), h, dv) and lse.shape == (h, sum(lens_q))
    cq, ck = cu(lens_q), cu(lens_new)
    for i in range(b):
        n = old[i] + lens_new[i]
        assert torch.equal(rows(kc, i, n)[old[i]:], kn[ck[i]:ck[i + 1]])
        assert torch.equal(rows(vc, i, n)[old[i]:], vn[ck[i]:ck[i + 1]])
        assert torch.equal(rows(kc, i, old[i]), rows(k0, i, old[i]))
        ks, vs = rows(kc, i, n)[lead[i]:], rows(vc, i, n)[lead[i]:]
        qs = slice(int(cq[i]), int(cq[i + 1]))
        f64 = lambda x: x.detach().double().cpu().numpy()[None]  # noqa: E731
        o, l = reference.attention(f64(torch.cat([q[qs], qv[qs]], -1)), f64(torch.cat([ks, vs], -1)),
                                   f64(torch.nn.functional.pad(vs, (0, d))), softmax_scale=(d + dv) ** -0.5,
                                   return_lse=True, **mask)
        np.testing.assert_allclose(out[qs].cpu().numpy(), o[0, ..., :dv], atol=1e-5)
        np.testing.assert_allclose(lse[:, qs].cpu().numpy(), _fa3_lse(l[0]), atol=1e-5)
    untouched = torch.ones(kc.shape[:2], dtype=torch.bool, device=dev)
    for i in range(b):
        j = torch.arange(old[i], old[i] + lens_new[i], device=dev)
        untouched[(table[i][j // page].long(), j % page) if paged else (int(idx[i]), j)] = False
    assert torch.equal(kc[untouched], k0[untouched]) and torch.equal(vc[untouched], v0[untouched])
    with pytest.raises(NotImplementedError, match="rotary_cos"):
        fa3.flash_attn_with_kvcache(q, kc, vc, qv=qv, rotary_cos=rnd(16, 2), rotary_sin=rnd(16, 2),
                                    cu_seqlens_q=cu(lens_q), max_seqlen_q=3, **extra)
    k1 = kc.clone()
    call = dict(cache_seqlens=i32(old), cu_seqlens_q=cu(lens_q), cu_seqlens_k_new=cu(lens_new), max_seqlen_q=3, **extra)
    for bad, err, match in ((dict(cache_leftpad=i32([0, 0])), ValueError, "cache_leftpad must have shape"),
                            (dict(cache_seqlens=i32(old).long()), TypeError, "cache_seqlens must be an int32"),
                            (dict(cu_seqlens_k_new=cu([1, 1])), ValueError, "cu_seqlens_k_new must have shape"),
                            (dict(attention_chunk=-2), ValueError, "attention_chunk"),
                            (dict(softmax_scale="a"), TypeError, "softmax_scale")):
        with pytest.raises(err, match=match):
            fa3.flash_attn_with_kvcache(q, kc, vc, kn, vn, qv=qv, **{**call, **bad})
        assert torch.equal(kc, k1)


def _seqused_reference(q, k, v, cu_q, cu_k, used_q, used_k, dout, causal, window):
    """Forward and gradients of sequences that use their first used_q[b] / used_k[b] tokens, from
    the float64 reference over the used tokens alone; zeros elsewhere."""
    from cuflash import reference
    out, dq, dk, dv = (np.zeros(x.shape) for x in (q, q, k, v))
    lse = np.full((q.shape[1], q.shape[0]), np.inf)
    for b in range(len(cu_q) - 1):
        qs = slice(cu_q[b], cu_q[b] + min(max(used_q[b], 0), cu_q[b + 1] - cu_q[b]))
        ks = slice(cu_k[b], cu_k[b] + min(max(used_k[b], 0), cu_k[b + 1] - cu_k[b]))
        if qs.stop == qs.start:
            continue
        one_q = np.array([0, qs.stop - qs.start], np.int32)
        one_k = np.array([0, ks.stop - ks.start], np.int32)
        kw = dict(causal=causal, window_size=window)
        out[qs], lse[:, qs] = reference.attention_varlen(q[qs], k[ks], v[ks], one_q, one_k, return_lse=True, **kw)
        dq[qs], dk_b, dv_b = reference.attention_varlen_backward(dout[qs], q[qs], k[ks], v[ks], one_q, one_k, **kw)
        dk[ks], dv[ks] = dk_b, dv_b
    return out, lse, dq, dk, dv


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (5, 2))])
def test_seqused_cut_matches_used_tokens(causal, window):
    """plan.seqused_bounds' three sequences per sequence give, through the float64 varlen
    reference, the used tokens' attention and gradients exactly and zeros for every unused token,
    counts past a sequence's length or below 0 clamped; empty sequences included."""
    from cuflash import reference
    from cuflash.plan import seqused_bounds
    rng = np.random.default_rng(0)
    lens_q, lens_k = [7, 0, 12, 5, 9], [9, 4, 3, 0, 20]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    used_q = np.array([4, 0, 12, 7, 1], np.int32)   # 7 > 5: clamped
    used_k = np.array([9, 2, 1, -3, 13], np.int32)  # -3: none
    h, hk, d = 4, 2, 16
    q, dout = rng.standard_normal((2, cu_q[-1], h, d))
    k, v = rng.standard_normal((2, cu_k[-1], hk, d))
    pq, pk = seqused_bounds(torch, torch.from_numpy(cu_q), torch.from_numpy(cu_k), torch.from_numpy(used_q),
                            torch.from_numpy(used_k))
    assert pq.dtype == torch.int32 and pk.dtype == torch.int32 and len(pq) == len(pk) == 3 * len(lens_q) + 1
    assert bool((pq[1:] >= pq[:-1]).all()) and bool((pk[1:] >= pk[:-1]).all())
    assert pq[-1] == cu_q[-1] and pk[-1] == cu_k[-1]
    pq, pk = pq.numpy(), pk.numpy()
    kw = dict(causal=causal, window_size=window)
    out, lse = reference.attention_varlen(q, k, v, pq, pk, return_lse=True, **kw)
    dq, dk, dv = reference.attention_varlen_backward(dout, q, k, v, pq, pk, **kw)
    want = _seqused_reference(q, k, v, cu_q, cu_k, used_q, used_k, dout, causal, window)
    for got, ref in zip((out, lse, dq, dk, dv), want):
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)
    assert (out[cu_q[0] + 4:cu_q[1]] == 0).all() and (dk[cu_k[4] + 13:] == 0).all()


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
    out_partial[s // 2:, :1] = float("nan")  # splits of LSE -inf add nothing, whatever they hold
    out, _ = fa3.flash_attn_combine(out_partial, lse_partial, out_dtype=dtype)
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
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_varlen_seqused_against_reference(causal, d):
    """flash_attn_varlen_func with seqused_q / seqused_k (FlashAttention-3's test passes both on
    every call): output, LSE and gradients of the used tokens within flash-attn's rule of the
    float64 reference over the used tokens alone; the unused query rows 0 (LSE -inf,
    FlashAttention-3's for a row that sees no key) and the unused tokens' gradients 0; the
    caller's cu_seqlens and counts untouched."""
    torch.manual_seed(d + causal)
    lens_q, lens_k = [300, 1, 0, 129, 77], [257, 300, 5, 129, 500]
    used_q = torch.tensor([290, 1, 0, 64, 70], dtype=torch.int32, device="cuda")
    used_k = torch.tensor([200, 0, 5, 129, 13], dtype=torch.int32, device="cuda")
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32, device="cuda")
    saved = [x.clone() for x in (cu_q, cu_k, used_q, used_k)]
    q = _rand(int(cu_q[-1]), 6, d, requires_grad=True)
    k, v = _rand(int(cu_k[-1]), 2, d, requires_grad=True), _rand(int(cu_k[-1]), 2, d, requires_grad=True)
    out, lse = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), seqused_q=used_q,
                                          seqused_k=used_k, causal=causal, return_attn_probs=True)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert all(torch.equal(a, b) for a, b in zip((cu_q, cu_k, used_q, used_k), saved))
    f64 = [x.detach().double().cpu().numpy() for x in (q, k, v, dout)]
    host = [x.cpu().numpy() for x in (cu_q, cu_k, used_q, used_k)]
    want = list(_seqused_reference(*f64[:3], *host, f64[3], causal, (-1, -1)))
    want[1] = _fa3_lse(want[1])
    for name, got, ref in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), want):
        got = got.detach().double().cpu().numpy()
        finite = np.isfinite(ref)
        assert (np.isfinite(got) == finite).all(), name
        tol = 2e-2 if name in ("out", "lse") else 6e-2
        np.testing.assert_allclose(got[finite], ref[finite], rtol=0, atol=tol, err_msg=name)
        assert (got[~finite] == ref[~finite]).all(), name


@requires_sm90
@pytest.mark.parametrize("route", ["dense", "varlen", "kvcache"])
def test_gpu_lse_of_rows_without_keys_merges(route):
    """FlashAttention-3's LSE of a query row that sees no key is -inf, so that partial results over
    key splits merge with flash_attn_combine (context parallelism's use): causal attention over all
    keys equals the merge of its first half (a window that reaches each query's own position) and
    its second half (causal, more queries than keys: the first half of the rows see none of them)."""
    torch.manual_seed(1)
    b, s, h, d = 2, 384, 4, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    full, full_lse = fa3.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    halves = ((k[:, :s // 2], v[:, :s // 2], dict(window_size=(-1, s // 2))),
              (k[:, s // 2:], v[:, s // 2:], dict(causal=True)))
    outs, lses = [], []
    for kk, vv, mask in halves:
        if route == "dense":
            o, lse = fa3.flash_attn_func(q, kk, vv, return_attn_probs=True, **mask)
        elif route == "varlen":
            cu = lambda n: torch.arange(b + 1, dtype=torch.int32, device="cuda") * n  # noqa: E731
            o, lse = fa3.flash_attn_varlen_func(q.flatten(0, 1), kk.flatten(0, 1), vv.flatten(0, 1), cu(s),
                                                cu(s // 2), s, s // 2, return_attn_probs=True, **mask)
            o, lse = o.unflatten(0, (b, s)), lse.unflatten(1, (b, s)).transpose(0, 1)
        else:
            o, lse = fa3.flash_attn_with_kvcache(q, kk.contiguous(), vv.contiguous(), return_softmax_lse=True, **mask)
        outs.append(o.float())
        lses.append(lse.transpose(1, 2))
    assert not torch.isinf(lses[0]).any() and torch.isneginf(lses[1][:, :s // 2]).all()
    assert not torch.isinf(lses[1][:, s // 2:]).any()
    out, lse = fa3.flash_attn_combine(torch.stack(outs), torch.stack(lses), out_dtype=torch.bfloat16)
    torch.testing.assert_close(out, full, atol=2e-2, rtol=0)
    torch.testing.assert_close(lse, full_lse.transpose(1, 2), atol=1e-3, rtol=0)
    empty = torch.zeros(b, 0, h, d, device="cuda", dtype=torch.bfloat16)
    assert torch.isposinf(fa3.flash_attn_func(q, empty, empty, return_attn_probs=True)[1]).all()  # (no keys at all)


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


def _rotate_neox(x, cos, sin, pos):
    """x (batch, s, heads, d) rotated in its first 2 * cos.shape[1] columns at positions pos
    (batch, s), GPT-NeoX halves, in float32 (flash-attn's rotary arithmetic)."""
    r = cos.shape[1]
    c, s = cos.float()[pos][:, :, None], sin.float()[pos][:, :, None]
    x1, x2, rest = x[..., :r].float(), x[..., r:2 * r].float(), x[..., 2 * r:]
    return torch.cat([(x1 * c - x2 * s).to(x.dtype), (x1 * s + x2 * c).to(x.dtype), rest], dim=-1)


@requires_sm90
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_kvcache_rotary_seqlens(causal):
    """flash_attn_with_kvcache's rotary_seqlens: new keys written at cache_seqlens[b] + i but
    rotated at rotary_seqlens[b] + i, q at rotary_seqlens[b] (+ i when causal); the same call
    with rotary_seqlens = cache_seqlens is the call without it, bitwise."""
    import cuflash
    torch.manual_seed(causal)
    b, cap, hk, h, d, s_new = 3, 256, 2, 8, 128, 4
    cos_sin = torch.rand(cap, 32, device="cuda") * 6.3
    cos, sin = torch.cos(cos_sin).bfloat16(), torch.sin(cos_sin).bfloat16()
    lens = torch.tensor([0, 100, 250], dtype=torch.int32, device="cuda")
    ro = torch.tensor([7, 3, 200], dtype=torch.int32, device="cuda")
    q, kn, vn = _rand(b, s_new, h, d), _rand(b, s_new, hk, d), _rand(b, s_new, hk, d)
    kc, vc = _rand(b, cap, hk, d), _rand(b, cap, hk, d)
    kc1, vc1, kc2, vc2, kc3, vc3 = kc.clone(), vc.clone(), kc.clone(), vc.clone(), kc.clone(), vc.clone()
    kw = dict(rotary_cos=cos, rotary_sin=sin, causal=causal, rotary_interleaved=False, return_softmax_lse=True)
    out, lse = fa3.flash_attn_with_kvcache(q, kc1, vc1, kn, vn, cache_seqlens=lens, rotary_seqlens=ro, **kw)
    # the same attention with q and the new keys rotated by hand and no rotary tables
    steps = torch.arange(s_new, device="cuda")
    pos = (ro.long()[:, None] + steps).clamp(max=cap - 1)
    q_pos = pos if causal else ro.long()[:, None].expand(b, s_new)
    kn_rot = _rotate_neox(kn, cos, sin, pos)
    ref, ref_lse = cuflash.attention_with_kvcache(_rotate_neox(q, cos, sin, q_pos), kc2, vc2, kn_rot, vn,
                                                  cache_seqlens=lens, causal=causal, return_lse=True)
    for j in range(b):
        n = min(s_new, cap - int(lens[j]))
        rows = slice(int(lens[j]), int(lens[j]) + n)
        torch.testing.assert_close(kc1[j, rows], kn_rot[j, :n], atol=1e-2, rtol=1e-2)
        assert torch.equal(vc1[j, rows], vn[j, :n])
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=0)
    # rotary_seqlens = cache_seqlens: the call without it
    same = fa3.flash_attn_with_kvcache(q, kc3, vc3, kn, vn, cache_seqlens=lens, rotary_seqlens=lens.clone(), **kw)
    plain = fa3.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), kn, vn, cache_seqlens=lens, **kw)
    assert torch.equal(same[0], plain[0]) and torch.equal(same[1], plain[1])


@requires_sm90
@pytest.mark.parametrize("case", ["window", "softcap", "chunk", "d96", "varlen"])
def test_gpu_fp8_beyond_the_fp8_kernel(case):
    """FP8 calls that the FP8 forward does not take (FlashAttention-3's test file makes them:
    random chunks, windows, softcap, head dims 96/192, packed sequences) run on the dequantized
    inputs: within bf16's error of the float64 reference of q * q_descale, ... ."""
    from cuflash import reference
    torch.manual_seed(len(case))
    d = 96 if case == "d96" else 128
    b, s, h, hk = 2, 300, 4, 2
    q, k, v = ((torch.randn(b, s, n, d, device="cuda") * 2).to(torch.float8_e4m3fn) for n in (h, hk, hk))
    qd, kd, vd = (torch.rand(b, hk, device="cuda") + 0.5 for _ in range(3))
    kw = dict(window_size=(40, 3)) if case == "window" else dict(softcap=15.0) if case == "softcap" else \
        dict(attention_chunk=77) if case == "chunk" else {}
    deq = [x.float().cpu().double().numpy() * dd.repeat_interleave(x.shape[2] // hk, 1).cpu().double().numpy()[:, None, :, None]
           for x, dd in ((q, qd), (k, kd), (v, vd))]
    if case == "varlen":
        cu = torch.tensor([0, s, 2 * s], dtype=torch.int32, device="cuda")
        out = fa3.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, s, s, causal=True,
                                         q_descale=qd, k_descale=kd, v_descale=vd).reshape(b, s, h, d)
    else:
        out = fa3.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd, **kw)
    ref = reference.attention(*deq, causal=True, **kw)
    assert out.dtype == torch.bfloat16
    np.testing.assert_allclose(out.float().cpu().numpy(), ref, rtol=0, atol=4e-2 * float(np.abs(ref).max()))


@requires_sm90
@pytest.mark.parametrize("causal,rotary", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("paged", [False, True])
def test_gpu_kvcache_packed_queries_and_keys(causal, rotary, paged):
    """flash_attn_with_kvcache with cu_seqlens_q and cu_seqlens_k_new (FlashAttention-3's varlen
    decode/append): each sequence's output, LSE and cache rows as the dense call of that sequence
    alone gives them; cache rows outside the appended ones untouched."""
    torch.manual_seed(2 * causal + rotary + 4 * paged)
    b, cap, hk, h, d = 4, 512, 2, 6, 128
    lens_q, lens_new = [3, 1, 0, 7], [5, 1, 0, 7]
    cache_lens = torch.tensor([10, 0, 300, 100], dtype=torch.int32, device="cuda")
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_new)]), dtype=torch.int32, device="cuda")
    q, kn, vn = _rand(sum(lens_q), h, d), _rand(sum(lens_new), hk, d), _rand(sum(lens_new), hk, d)
    angle = torch.rand(cap, 32, device="cuda") * 6.3
    cos, sin = (torch.cos(angle).bfloat16(), torch.sin(angle).bfloat16()) if rotary else (None, None)
    if paged:
        kc, vc = _rand(4 * b, 128, hk, d), _rand(4 * b, 128, hk, d)
        table = torch.randperm(4 * b, dtype=torch.int32, device="cuda").reshape(b, 4)
    else:
        kc, vc, table = _rand(b, cap, hk, d), _rand(b, cap, hk, d), None
    k1, v1 = kc.clone(), vc.clone()
    kw = dict(causal=causal, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False, return_softmax_lse=True)
    out, lse = fa3.flash_attn_with_kvcache(q, k1, v1, kn, vn, cache_seqlens=cache_lens, page_table=table,
                                           cu_seqlens_q=cu_q, cu_seqlens_k_new=cu_k, max_seqlen_q=max(lens_q), **kw)
    assert out.shape == q.shape and lse.shape == (h, q.shape[0])
    k2, v2 = kc.clone(), vc.clone()
    for j in range(b):
        if lens_new[j] == 0:
            continue
        qs, ks = slice(int(cu_q[j]), int(cu_q[j + 1])), slice(int(cu_k[j]), int(cu_k[j + 1]))
        one = dict(kw, rotary_cos=cos, rotary_sin=sin)
        if paged:
            o, l = fa3.flash_attn_with_kvcache(q[qs][None], k2, v2, kn[ks][None], vn[ks][None],
                                               cache_seqlens=cache_lens[j:j + 1], page_table=table[j:j + 1], **one)
        else:
            o, l = fa3.flash_attn_with_kvcache(q[qs][None], k2[j:j + 1], v2[j:j + 1], kn[ks][None], vn[ks][None],
                                               cache_seqlens=cache_lens[j:j + 1], **one)
        if lens_q[j]:
            torch.testing.assert_close(out[qs], o[0], atol=2e-2, rtol=0)
            torch.testing.assert_close(lse[:, qs], l[0], atol=2e-2, rtol=0)
    torch.testing.assert_close(k1, k2, atol=1e-2, rtol=1e-2)  # (rotations in PyTorch and in the kernel)
    assert torch.equal(v1, v2)


def test_varlen_batched_operands_and_fp8_forward_only(monkeypatch):
    """flash_attn_varlen_func without cu_seqlens takes batched q / k, v (FlashAttention-3's
    seqused with batched tensors): packed views with cu_seqlens = arange * seqlen, the output and
    LSE shaped back; an FP8 call through bf16 copies records a node whose backward raises (CPU,
    the kernels faked)."""
    calls = []

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        calls.append((cu_q.tolist(), cu_k.tolist(), max_q, max_k, q.dtype))
        lse = torch.arange(q.shape[0], dtype=torch.float32).expand(q.shape[1], -1)
        return q.float().to(torch.bfloat16) * 1, lse
    monkeypatch.setattr(fa3.ops, "attention_varlen", varlen)
    q, k = torch.randn(2, 3, 4, 8), torch.randn(2, 5, 2, 8)
    out, lse = fa3.flash_attn_varlen_func(q, k, k, None, None, None, None, seqused_k=torch.tensor([5, 2],
                                          dtype=torch.int32), return_attn_probs=True)
    (cu_q, cu_k, max_q, max_k, _), = calls
    assert cu_q == [0, 3, 3, 3, 6, 6, 6] and cu_k == [0, 5, 5, 5, 7, 7, 10] and (max_q, max_k) == (3, 5)
    assert out.shape == (2, 3, 4, 8) and torch.equal(out.float(), q.bfloat16().float())
    assert lse.shape == (2, 4, 3) and lse[1, 0].tolist() == [3, 4, 5]
    # Batched operands' maxima are not read (FlashAttention-3 reads them for packed ones only), and
    # sm_margin is a hint not taken.
    fa3.flash_attn_varlen_func(q, k, k, None, None, 4, 9, seqused_k=torch.tensor([5, 2], dtype=torch.int32),
                               sm_margin=8)
    assert calls[-1][:4] == calls[0][:4]
    q8 = (torch.randn(6, 4, 8) * 4).to(torch.float8_e4m3fn).requires_grad_()
    k8 = (torch.randn(10, 2, 8) * 4).to(torch.float8_e4m3fn)
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    out = fa3.flash_attn_varlen_func(q8, k8, k8, cu, torch.tensor([0, 5, 10], dtype=torch.int32), 3, 5,
                                     q_descale=torch.full((2, 2), 0.5))
    assert calls[-1][4] == torch.bfloat16 and out.requires_grad
    torch.testing.assert_close(out.float(), (q8.detach().float() * 0.5).bfloat16().float())
    with pytest.raises(NotImplementedError, match="forward only"):
        out.float().sum().backward()


@pytest.mark.parametrize("interleaved", [False, True])
def test_packed_query_rotation(interleaved, monkeypatch):
    """The packed-query KV-cache path rotates q and the new keys as flash-attn's apply_rotary_emb
    does (float32 arithmetic), positions past the tables clamped to their last row as the append
    kernel does; the rotary arguments are checked as attention_with_kvcache checks them."""
    import cuflash
    from cuflash.flash_attn.layers.rotary import apply_rotary_emb
    torch.manual_seed(interleaved)
    x = torch.randn(7, 3, 16).bfloat16()
    angle = torch.rand(10, 4) * 6.3
    cos, sin = torch.cos(angle).bfloat16(), torch.sin(angle).bfloat16()
    pos = torch.tensor([0, 3, 9, 2, 2, 5, 1])
    want = apply_rotary_emb(x.unsqueeze(1), cos, sin, interleaved, seqlen_offsets=pos).squeeze(1)
    assert torch.equal(fa3._rotated(x, cos, sin, interleaved, pos), want)
    assert torch.equal(fa3._rotated(x, cos, sin, interleaved, pos + 40)[2], fa3._rotated(x, cos, sin, interleaved, pos)[2])
    monkeypatch.setattr(cuflash, "attention_with_kvcache", lambda q, *a, **kw: (q, None))
    cu = torch.tensor([0, 2], dtype=torch.int32)
    q, kc = torch.randn(2, 3, 16).bfloat16(), torch.zeros(1, 10, 1, 16).bfloat16()
    kn = torch.zeros(1, 1, 1, 16).bfloat16()
    with pytest.raises(ValueError, match="rotary_cos and rotary_sin must be given together"):
        fa3.flash_attn_with_kvcache(q, kc, kc, kn, kn, rotary_cos=cos, cache_seqlens=1, cu_seqlens_q=cu, max_seqlen_q=2)
    with pytest.raises(TypeError, match="rotary_cos must have q's dtype"):
        fa3.flash_attn_with_kvcache(q, kc, kc, kn, kn, rotary_cos=cos.float(), rotary_sin=sin.float(), cache_seqlens=1,
                                    cu_seqlens_q=cu, max_seqlen_q=2)


@requires_sm90
def test_gpu_fp8_kvcache_large_pool():
    """An FP8 paged cache whose page pool is far larger than what the call reads (a serving
    engine's pool): the call copies the listed pages up to the longest sequence, not the pool
    (the memory it allocates stays under the pool's bf16 size / 16), its output is the bf16
    call's on the dequantized pool, and the appended rows land in the pool."""
    torch.manual_seed(5)
    e4 = torch.float8_e4m3fn
    n_pages, page, hk, h, d, b = 8192, 16, 8, 16, 128, 2
    pool_k = (torch.randn(n_pages, page, hk, d, device="cuda") * 2).to(e4)
    pool_v = (torch.randn(n_pages, page, hk, d, device="cuda") * 2).to(e4)
    table = torch.randperm(n_pages, device="cuda")[:b * 64].reshape(b, 64).int()
    lens = torch.tensor([300, 77], dtype=torch.int32, device="cuda")
    q, kn, vn = ((torch.randn(b, 1, n, d, device="cuda") * 2).to(e4) for n in (h, hk, hk))
    kb, vb = pool_k.bfloat16(), pool_v.bfloat16()
    want = fa3.flash_attn_with_kvcache(q.bfloat16(), kb, vb, kn.bfloat16(), vn.bfloat16(), cache_seqlens=lens,
                                       page_table=table, causal=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fa3.flash_attn_with_kvcache(q, pool_k, pool_v, kn, vn, cache_seqlens=lens, page_table=table, causal=True)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < kb.numel() * 2 * 2 // 16
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(pool_k.view(torch.uint8), kb.to(e4).view(torch.uint8))
    assert torch.equal(pool_v.view(torch.uint8), vb.to(e4).view(torch.uint8))


@requires_sm90
@pytest.mark.parametrize("paged,packed,rotary", [(False, False, True), (True, False, True), (True, True, True),
                                                 (False, False, False), (True, False, False)])
def test_gpu_fp8_kvcache(paged, packed, rotary):
    """float8_e4m3fn caches (FlashAttention-3's FP8 KV cache) with descales, new keys (rotated or
    not), and when paged pages of 4 rows with a cache_leftpad: the bf16 output of the bf16 call on
    the e4m3 values with the descales applied by hand, the same LSE, the new rows appended to the
    e4m3 caches (the other rows untouched); packed queries too; without rotary, against float64
    attention of the descaled e4m3 values."""
    torch.manual_seed(11 + paged + 2 * packed + 4 * rotary)
    e4 = torch.float8_e4m3fn
    b, hk, h, d, cap, s_new, page = 3, 2, 6, 128, 256, 3, 4
    f8 = lambda *s: (torch.randn(*s, device="cuda") * 2).to(e4)  # noqa: E731
    if paged:
        kc, vc = f8(b * cap // page + 5, page, hk, d), f8(b * cap // page + 5, page, hk, d)
        table = torch.randperm(b * cap // page + 5, device="cuda")[:b * cap // page].reshape(b, -1).int()
        leftpad = torch.tensor([5, 0, 99], dtype=torch.int32, device="cuda")
    else:
        kc, vc, table, leftpad = f8(b, cap, hk, d), f8(b, cap, hk, d), None, None
    q, kn, vn = f8(b, s_new, h, d), f8(b, s_new, hk, d), f8(b, s_new, hk, d)
    ds = [torch.rand(b, hk, device="cuda") + 0.5 for _ in range(3)]
    angle = torch.rand(cap, 32, device="cuda") * 6.3
    lens = torch.tensor([250, 0, 100], dtype=torch.int32, device="cuda")
    kw = dict(cache_seqlens=lens, cache_leftpad=leftpad, page_table=table, causal=True, return_softmax_lse=True,
              rotary_cos=torch.cos(angle).bfloat16() if rotary else None,
              rotary_sin=torch.sin(angle).bfloat16() if rotary else None)
    k8, v8 = kc.clone(), vc.clone()
    extra = dict(cu_seqlens_q=torch.arange(0, b * s_new + 1, s_new, dtype=torch.int32, device="cuda"),
                 max_seqlen_q=s_new) if packed else {}
    out, lse = fa3.flash_attn_with_kvcache(q.reshape(b * s_new, h, d) if packed else q, k8, v8, kn, vn,
                                           q_descale=ds[0], k_descale=ds[1], v_descale=ds[2], **kw, **extra)
    assert out.dtype == torch.bfloat16
    g = h // hk
    qb = (q.float() * (ds[0] * ds[1]).repeat_interleave(g, 1)[:, None, :, None]).bfloat16()
    kb, vb = kc.bfloat16(), vc.bfloat16()
    o, l = fa3.flash_attn_with_kvcache(qb, kb, vb, kn.bfloat16(), vn.bfloat16(), **kw)
    o = (o.float() * ds[2].repeat_interleave(g, 1)[:, None, :, None]).bfloat16()
    if packed:
        l = l.permute(1, 0, 2).reshape(h, b * s_new)
    torch.testing.assert_close(out.reshape(o.shape).float(), o.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, l, atol=2e-2, rtol=0)
    assert torch.equal(v8, vb.to(e4))
    if packed:  # (the packed path rotates the new keys with PyTorch operations: within an e4m3 unit)
        torch.testing.assert_close(k8.float(), kb.to(e4).float(), atol=0.07, rtol=0.07)
    else:
        assert torch.equal(k8, kb.to(e4))
    if rotary:
        return
    for i in range(b):  # float64: softmax(d^-0.5 (q qd kd) k^T) (v vd) over rows leftpad ... len + s_new,
        # q qd kd rounded to bf16 as the kernel reads it (the scores of q qd . k kd; a bf16 input)
        n, lead = int(lens[i]) + s_new, int(leftpad[i]) if paged else 0
        j = torch.arange(lead, n, device="cuda")
        ks, vs = ((c[table[i][j // page].long(), j % page] if paged else c[i, j]).double() for c in (k8, v8))
        vs = vs * ds[2][i][None, :, None].double()
        qs = (q[i].float() * (ds[0][i] * ds[1][i]).repeat_interleave(g)[None, :, None]).bfloat16().double()
        sc = torch.einsum("qhd,khd->hqk", qs, ks.repeat_interleave(g, 1)) * d ** -0.5
        sc = sc.masked_fill(torch.arange(n - lead, device="cuda")[None] > torch.arange(n - lead - s_new, n - lead,
                                                                                      device="cuda")[:, None], -torch.inf)
        ref = torch.einsum("hqk,khd->qhd", torch.softmax(sc, -1), vs.repeat_interleave(g, 1))
        torch.testing.assert_close(out[i].double(), ref, atol=3e-2, rtol=3e-2)
