"""torch.ops.flash_attn_3 on cuflash (cuflash/flash_attn3.py, the end): FlashAttention-3's schemas,
the fake kernels used in tracing, which function a fwd call goes to, the backward's value pieces
(CPU, PyTorch); on the GPU, the operators against the functions and the float64 reference, and
PyTorch's own FA3 adapter for SDPA running on them."""
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import requires_sm90

torch = pytest.importorskip("torch", reason="needs PyTorch (optional dependency)")

from cuflash import flash_attn3 as fa3  # noqa: E402

# (the operators' own tests: with FlashAttention-3 installed, the operators are its own)
ours = pytest.mark.skipif(importlib.util.find_spec("flash_attn_3") is not None,
                          reason="FlashAttention-3 is installed: its extension defines torch.ops.flash_attn_3")

# FlashAttention-3's promise (hopper/test_flash_attn.py, test_flash3_bw_compatibility): arguments
# are only ever added at the end with defaults, so these schemas keep working.
PROMISED = {
    "fwd": "flash_attn_3::fwd(Tensor q, Tensor k, Tensor v, Tensor(k_new!)? k_new=None, Tensor(v_new!)? v_new=None, "
           "Tensor? q_v=None, Tensor(out!)? out=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
           "Tensor? cu_seqlens_k_new=None, Tensor? seqused_q=None, Tensor? seqused_k=None, int? max_seqlen_q=None, "
           "int? max_seqlen_k=None, Tensor? page_table=None, Tensor? kv_batch_idx=None, Tensor? leftpad_k=None, "
           "Tensor? rotary_cos=None, Tensor? rotary_sin=None, Tensor? seqlens_rotary=None, Tensor? q_descale=None, "
           "Tensor? k_descale=None, Tensor? v_descale=None, float? softmax_scale=None, bool is_causal=False, "
           "int window_size_left=-1, int window_size_right=-1, int attention_chunk=0, float softcap=0., "
           "bool is_rotary_interleaved=False, Tensor? scheduler_metadata=None, int num_splits=0, "
           "bool? pack_gqa=None, int sm_margin=0) -> (Tensor(out!), Tensor, Tensor, Tensor)",
    "bwd": "flash_attn_3::bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
           "Tensor(dq!)? dq=None, Tensor(dk!)? dk=None, Tensor(dv!)? dv=None, Tensor? cu_seqlens_q=None, "
           "Tensor? cu_seqlens_k=None, Tensor? seqused_q=None, Tensor? seqused_k=None, int? max_seqlen_q=None, "
           "int? max_seqlen_k=None, float? softmax_scale=None, bool is_causal=False, int window_size_left=-1, "
           "int window_size_right=-1, float softcap=0., bool deterministic=False, int sm_margin=0) "
           "-> (Tensor(dq!), Tensor(dk!), Tensor(dv!), Tensor, Tensor, Tensor, Tensor, Tensor)",
    "fwd_combine": "flash_attn_3::fwd_combine(Tensor out_partial, Tensor lse_partial, Tensor(out!)? out=None, "
                   "ScalarType? out_dtype=None) -> (Tensor(out!), Tensor)",
    "get_scheduler_metadata": "flash_attn_3::get_scheduler_metadata(int batch_size, int max_seqlen_q, "
                              "int max_seqlen_k, int num_heads, int num_heads_k, int headdim, int headdim_v, "
                              "ScalarType qkv_dtype, Tensor seqused_k, Tensor? cu_seqlens_q=None, "
                              "Tensor? cu_seqlens_k=None, Tensor? cu_seqlens_k_new=None, Tensor? seqused_q=None, "
                              "Tensor? leftpad_k=None, int? page_size=None, int max_seqlen_k_new=0, "
                              "bool is_causal=False, int window_size_left=-1, int window_size_right=-1, "
                              "int attention_chunk=0, bool has_softcap=False, int num_splits=0, bool? pack_gqa=None, "
                              "int sm_margin=0) -> Tensor",
}


@ours
@pytest.mark.parametrize("name", sorted(PROMISED))
def test_schemas_are_flash_attention_3s(name):
    from torch._C import parse_schema
    schema = getattr(torch.ops.flash_attn_3, name).default._schema
    assert schema.is_backward_compatible_with(parse_schema(PROMISED[name]))


@ours
def test_fake_kernels_give_the_shapes():
    """Traced (FakeTensor) calls: out (q's rows, v's head dim; bf16 for e4m3), the LSE dense (batch,
    nheads, seqlen_q) or packed (nheads, total_q), a given out returned as itself, the backward's
    gradients shaped as their inputs and its statistics as the LSE."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    ops = torch.ops.flash_attn_3
    with FakeTensorMode():
        q = torch.empty(2, 5, 8, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 7, 2, 64, dtype=torch.bfloat16, device="cuda")
        v = torch.empty(2, 7, 2, 96, dtype=torch.bfloat16, device="cuda")
        out, lse, oa, la = ops.fwd(q, k, v, is_causal=True)
        assert out.shape == (2, 5, 8, 96) and out.dtype == torch.bfloat16 and lse.shape == (2, 8, 5)
        assert lse.dtype == torch.float32 and oa.numel() == la.numel() == 0
        given = torch.empty(2, 5, 8, 96, dtype=torch.bfloat16, device="cuda")
        assert ops.fwd(q, k, v, out=given)[0] is given
        e4m3 = q.to(torch.float8_e4m3fn)
        assert ops.fwd(e4m3, k.to(e4m3.dtype), k.to(e4m3.dtype))[0].dtype == torch.bfloat16
        packed = torch.empty(10, 8, 64, dtype=torch.float16, device="cuda")
        cu = torch.empty(3, dtype=torch.int32, device="cuda")
        out, lse, *_ = ops.fwd(packed, packed[:, :2], packed[:, :2], cu_seqlens_q=cu, cu_seqlens_k=cu,
                               max_seqlen_q=5, max_seqlen_k=5)
        assert out.shape == (10, 8, 64) and lse.shape == (8, 10)
        res = ops.bwd(q, q, k, k, q, lse.new_empty(2, 8, 5))
        assert [tuple(x.shape) for x in res] == [(2, 5, 8, 64), (2, 7, 2, 64), (2, 7, 2, 64), (2, 8, 5), (2, 8, 5),
                                                 (0,), (0,), (0,)]
        dq = torch.empty_like(q)
        assert ops.bwd(q, q, k, k, q, lse.new_empty(2, 8, 5), dq=dq)[0] is dq
        out, lse = ops.fwd_combine(torch.empty(3, 2, 5, 8, 64, device="cuda"), torch.empty(3, 2, 5, 8, device="cuda"),
                                   out_dtype=torch.bfloat16)
        assert out.shape == (2, 5, 8, 64) and out.dtype == torch.bfloat16 and lse.shape == (2, 5, 8)
        meta = ops.get_scheduler_metadata(2, 5, 7, 8, 2, 64, 64, torch.bfloat16, cu[:2])
        assert meta.dtype == torch.int32 and meta.numel() == 0


def _record(monkeypatch):
    """fa3's three functions replaced by recorders returning zeros of the output's shape."""
    calls = []

    def recorder(name):
        def run(q, k, v, *args, **kwargs):
            calls.append((name, args, kwargs))
            rows = (*q.shape[:-1], v.shape[-1])
            return torch.zeros(rows, dtype=q.dtype), torch.zeros(1)
        return run
    for name in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"):
        monkeypatch.setattr(fa3, name, recorder(name))
    return calls


def test_fwd_goes_to_the_function_of_its_arguments(monkeypatch):
    """Dense operands: flash_attn_func; sequence arguments: flash_attn_varlen_func; a KV-cache
    argument, or seqused_k over batched keys of q's head dim: flash_attn_with_kvcache with seqused_k
    as the cache lengths (with a page table and cu_seqlens_k: the lengths cu_seqlens_k gives); the
    maxima of batched operands are their seqlens; sm_margin is not passed on; a given out is
    written; a wrong out raises before any call."""
    calls = _record(monkeypatch)
    q, k = torch.ones(2, 5, 4, 64), torch.ones(2, 7, 2, 64)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    fa3._fwd_op(q, k, k, is_causal=True, window_size_left=3, window_size_right=0, softcap=2.0)
    name, args, _ = calls[-1]
    assert name == "flash_attn_func" and args[1] is True and args[6] == (3, 0) and args[8] == 2.0
    fa3._fwd_op(q[0], k[0], k[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4)
    assert calls[-1][0] == "flash_attn_varlen_func"
    used = torch.tensor([3, 7], dtype=torch.int32)
    fa3._fwd_op(q, k, k, seqused_k=used, max_seqlen_q=2, max_seqlen_k=7, sm_margin=8)
    name, args, kw = calls[-1]
    assert name == "flash_attn_with_kvcache" and args[5] is used and args[11] is None and args[25] == 0
    fa3._fwd_op(q, k, torch.ones(2, 7, 2, 32), seqused_k=used, max_seqlen_q=2, max_seqlen_k=7)
    name, args, _ = calls[-1]  # (another value head dim: the varlen function's value pieces)
    assert name == "flash_attn_varlen_func" and args[2:4] == (5, 7) and args[5] is used
    fa3._fwd_op(q, k, k, k_new=k[:, :1], v_new=k[:, :1])
    assert calls[-1][0] == "flash_attn_with_kvcache"
    table = torch.zeros(2, 1, dtype=torch.int32)
    fa3._fwd_op(q[0], k, k, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, page_table=table)
    name, args, _ = calls[-1]
    assert name == "flash_attn_with_kvcache" and args[5].tolist() == [3, 4] and args[8] is table
    fa3._fwd_op(q[0], k[0], k[0], cu_seqlens_q=cu, seqused_q=used, seqused_k=used, max_seqlen_q=4, max_seqlen_k=4)
    assert calls[-1][0] == "flash_attn_varlen_func"
    out = torch.full((2, 5, 4, 64), 7.0)
    res = fa3._fwd_op(q, k, k, out=out)
    assert res[0] is out and (out == 0).all()
    n = len(calls)
    for bad in (torch.zeros(2, 5, 4, 32), torch.zeros(2, 5, 4, 64, dtype=torch.float16)):
        with pytest.raises(ValueError, match=r"out must be torch.float32 of shape \(2, 5, 4, 64\)"):
            fa3._fwd_op(q, k, k, out=bad)
    assert len(calls) == n
    with pytest.raises(NotImplementedError, match="seqused_q"):
        fa3._fwd_op(q, k, k, k_new=k[:, :1], v_new=k[:, :1], seqused_q=used)
    # The operator's default scale is q's head dim's, also with q_v (FlashAttention-3's C++
    # default; its Python functions pass (d + dv) ** -0.5 themselves); a given scale is kept.
    qv = torch.ones(2, 5, 4, 32)
    fa3._fwd_op(q, k, torch.ones(2, 7, 2, 32), q_v=qv)
    name, args, _ = calls[-1]
    assert name == "flash_attn_func" and args[0] == 64 ** -0.5 and args[2] is qv
    fa3._fwd_op(q, k, torch.ones(2, 7, 2, 32), q_v=qv, softmax_scale=0.3)
    assert calls[-1][1][0] == 0.3
    fa3._fwd_op(q, k, k)
    assert calls[-1][1][0] is None  # (no q_v: the functions' default is the operator's)


def test_private_entry_points_are_the_operators(monkeypatch):
    """FlashAttention-3's private _flash_attn_forward / _flash_attn_backward (TransformerEngine
    imports them): FlashAttention-3's parameter names in its order, each argument handed to the
    fwd / bwd operator in place; the backward returns the operator's softmax_d."""
    import inspect
    fwd_names = ["q", "k", "v", "k_new", "v_new", "qv", "out_", "cu_seqlens_q", "cu_seqlens_k", "cu_seqlens_k_new",
                 "seqused_q", "seqused_k", "max_seqlen_q", "max_seqlen_k", "page_table", "kv_batch_idx", "leftpad_k",
                 "rotary_cos", "rotary_sin", "seqlens_rotary", "q_descale", "k_descale", "v_descale", "softmax_scale",
                 "causal", "window_size_left", "window_size_right", "attention_chunk", "softcap",
                 "rotary_interleaved", "scheduler_metadata", "num_splits", "pack_gqa", "sm_margin"]
    bwd_names = ["dout", "q", "k", "v", "out", "softmax_lse", "cu_seqlens_q", "cu_seqlens_k", "sequed_q", "sequed_k",
                 "max_seqlen_q", "max_seqlen_k", "dq", "dk", "dv", "softmax_scale", "is_causal", "window_size_left",
                 "window_size_right", "softcap", "deterministic", "sm_margin"]
    assert list(inspect.signature(fa3._flash_attn_forward).parameters) == fwd_names
    assert list(inspect.signature(fa3._flash_attn_backward).parameters) == bwd_names
    # Each argument lands on the operator's parameter of the same meaning (FlashAttention-3's
    # operator names a few of them differently).
    fwd_op, bwd_op = (list(inspect.signature(f).parameters) for f in (fa3._fwd_op, fa3._bwd_op))
    got = {}
    monkeypatch.setattr(fa3, "_fwd_op", lambda *a: got.setdefault("fwd", a) and ("out", "lse", "acc", "lse_acc"))
    monkeypatch.setattr(fa3, "_bwd_op", lambda *a: got.setdefault("bwd", a) and ("dq", "dk", "dv", "softmax_d"))
    assert fa3._flash_attn_forward(*fwd_names) == ("out", "lse", "acc", "lse_acc")
    renamed = {"qv": "q_v", "out_": "out", "causal": "is_causal", "rotary_interleaved": "is_rotary_interleaved"}
    assert [renamed.get(n, n) for n in got["fwd"]] == fwd_op
    assert fa3._flash_attn_backward(*bwd_names) == "softmax_d"
    assert [{"sequed_q": "seqused_q", "sequed_k": "seqused_k"}.get(n, n) for n in got["bwd"]] == bwd_op


def test_fwd_qv_default_scale_is_the_operators():
    """With q_v and no softmax_scale, the operator attends at q's head dim's scale (FlashAttention-3's
    C++ default), not the functions' (d + dv) ** -0.5; q_v's route runs PyTorch operations, so this
    runs anywhere."""
    g = torch.Generator().manual_seed(0)
    q, qv = torch.randn(1, 6, 2, 64, generator=g), torch.randn(1, 6, 2, 256, generator=g)
    k, v = torch.randn(1, 9, 1, 64, generator=g), torch.randn(1, 9, 1, 256, generator=g)
    got = fa3._fwd_op(q, k, v, q_v=qv)[0]
    assert torch.equal(got, fa3.flash_attn_func(q, k, v, qv=qv, softmax_scale=64 ** -0.5))
    assert not torch.allclose(got, fa3.flash_attn_func(q, k, v, qv=qv), atol=1e-3)


def _kernel_recorders(monkeypatch):
    """The kernels of the functions' plain routes (ops._forward_kernel, ops._varlen_forward_kernel,
    cuflash.attention_with_kvcache) replaced by recorders of (the output given, the arguments that
    describe the attention) that fill that output (or a new one) with 1 and return it, with an LSE."""
    import cuflash
    given = []

    def result(q, out, lse_shape, what):
        given.append((out, what))
        o = torch.empty(q.shape, dtype=q.dtype) if out is None else out
        return o.fill_(1.0), torch.zeros(lse_shape)

    # (causal, scale, window left and right, softcap, ALiBi[, max_seqlen_q, max_seqlen_k, block table])
    monkeypatch.setattr(fa3.ops, "_forward_kernel", lambda q, k, v, out, *a, **kw: result(
        q, out, (q.shape[0], q.shape[2], q.shape[1]), a[:6]))
    monkeypatch.setattr(fa3.ops, "_varlen_forward_kernel", lambda q, k, v, cq, ck, mq, mk, out, *a, **kw: result(
        q, out, (q.shape[1], q.shape[0]), a[:6] + (mq, mk, a[6])))
    monkeypatch.setattr(cuflash, "attention_with_kvcache", lambda q, *a, out=None, **kw: result(
        q, out, (q.shape[0], q.shape[2], q.shape[1]), sorted(kw.items(), key=str)))
    return given


@ours
def test_fwd_kernel_writes_the_given_out(monkeypatch):
    """The fwd operator's given out goes to the kernel of a plain call (dense, packed, batched
    varlen whose rows are one view of out, a KV-cache decode), which writes it: the operator
    returns out itself and makes no copy, and the kernel is asked for the attention that the call
    without out asks for (scale, window, softcap, lengths). A call the kernel cannot write in place
    (batched varlen rows that are no view of out, a value head dim other than q's, an out that
    overlaps v or is not 16-byte aligned) gets a new output, copied into out."""
    given = _kernel_recorders(monkeypatch)
    h = torch.float16
    q, k = torch.zeros(2, 5, 4, 64, dtype=h), torch.zeros(2, 7, 2, 64, dtype=h)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    used = torch.tensor([3, 7], dtype=torch.int32)

    def check(expect_given, *args, **kw):
        out = torch.full(kw.pop("shape", (2, 5, 4, 64)), 7.0, dtype=h)
        out = kw.pop("layout", lambda x: x)(out)
        res = fa3._fwd_op(*args, out=out, **kw)
        assert res[0] is out and bool((out == 1).all())
        seen, what = given.pop()
        assert (seen is not None and seen.data_ptr() == out.data_ptr()) == expect_given, seen
        fa3._fwd_op(*args, **kw)
        assert given.pop()[1] == what  # (the call without out)
    mods = dict(is_causal=True, window_size_left=3, window_size_right=0, softcap=2.0)
    check(True, q, k, k, **mods)
    check(True, q, k, k, window_size_left=-5, softmax_scale=0.3)
    check(True, q[0], k[0], k[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4,
          shape=(5, 4, 64), **mods)
    check(True, q, k, k, cu_seqlens_k=cu[:3], max_seqlen_k=4)  # batched q, packed k: out's rows one view
    check(True, q, k, k, seqused_k=used, **mods)  # a decode over a cache
    # SDPA's layout (batch, heads, seqlen, d) seen as (batch, seqlen, heads, d): batched varlen rows are no view
    sdpa_like = dict(shape=(2, 4, 5, 64), layout=lambda x: x.transpose(1, 2))
    check(True, q, k, k, **sdpa_like)  # (the dense kernel takes any strides)
    check(False, q, k, k, cu_seqlens_k=cu[:3], max_seqlen_k=4, **sdpa_like)
    check(False, q, k, torch.zeros(2, 7, 2, 32, dtype=h), shape=(2, 5, 4, 32))  # V padded to q's head dim
    check(False, q, k, k, shape=(2 * 5 * 4 * 64 + 1,), layout=lambda x: x[1:].view(2, 5, 4, 64))  # 2 bytes off
    buf = torch.zeros(2, 7, 4, 64, dtype=h)
    res = fa3._fwd_op(q, k, buf[:, 2:, :2], out=buf[:, 2:])  # out over v's memory
    seen = given.pop()[0]
    assert seen is None or seen.data_ptr() != buf[:, 2:].data_ptr()  # (a new output, copied)
    assert res[0].data_ptr() == buf[:, 2:].data_ptr() and bool((buf[:, 2:] == 1).all())


def test_kernel_writes_only_plain_calls():
    """_kernel_writes: fp16/bf16, no descales or chunk, V of q's and out's head dim, no gradient
    recorded, an out 16-byte aligned with strides in multiples of 8 elements (the last 1), without
    repeated elements, sharing no memory with q, k or v."""
    q = torch.zeros(1, 3, 2, 64, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    assert fa3._kernel_writes(out, q, q, q)
    assert not fa3._kernel_writes(None, q, q, q)
    assert not fa3._kernel_writes(out, q, q, q, (torch.ones(1), None, None))
    assert not fa3._kernel_writes(out, q, q, q, attention_chunk=2)
    assert not fa3._kernel_writes(out[..., :32], q, q, q[..., :32])
    e4m3 = q.to(torch.float8_e4m3fn)
    assert not fa3._kernel_writes(out, e4m3, e4m3, e4m3)
    leaf = q.clone().requires_grad_()
    assert not fa3._kernel_writes(out, leaf, q, q)
    with torch.no_grad():
        assert fa3._kernel_writes(out, leaf, q, q)
    assert not fa3._kernel_writes(q, q, q, q) and not fa3._kernel_writes(out, q, out[:, 1:], q)
    assert fa3._kernel_writes(out[:, 1:], q[:, 1:], out[:, :1], q)  # (rows before out's: no overlap)
    assert not fa3._kernel_writes(torch.empty(1, 1, 2, 64, dtype=q.dtype).expand(1, 3, 2, 64), q, q, q)
    wide = torch.empty(1, 3, 2, 68, dtype=q.dtype)[..., :64]  # a head stride of 68 elements
    assert not fa3._kernel_writes(wide, q, q, q)
    assert fa3._kernel_writes(torch.empty(1, 3, 2, 72, dtype=q.dtype)[..., :64], q, q, q)


def _math_attention(q, k, v, scale, causal):
    """Dense attention in float64 PyTorch operations (GQA by repeated heads; causal aligned
    bottom-right; a row that sees no key: 0, LSE -inf as FlashAttention-3's)."""
    g = q.shape[2] // k.shape[2]
    kr, vr = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1), -float("inf"))
    empty = torch.isneginf(s).all(-1, keepdim=True)
    p = s.masked_fill(empty, 0.0).softmax(-1).masked_fill(empty, 0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, vr), torch.logsumexp(s, -1)


@pytest.mark.parametrize("sq,sk", [(6, 9), (9, 6)])
@pytest.mark.parametrize("dv", [64, 40, 160])
def test_bwd_value_pieces_add_up(dv, sq, sk, monkeypatch):
    """A value head dim other than q's: the backward of each piece of q's head dim (the last
    zero-padded), dq and dk summed, dv put together, equal the gradients of the whole (float64;
    cuflash's backward replaced by FlashAttention's backward formula, which reads each piece's
    out and the LSE); softmax_d is rowsum(dout * out) and the second statistic the LSE in log2
    units. Causal with more queries than keys: the rows that see no key have FlashAttention-3's LSE
    -inf (cuflash's backward takes +inf there: without that mapping their P is NaN)."""
    from cuflash import backward

    def lse_backward(dout, q, k, v, out, lse, *, dq, dk, dv, causal, softmax_scale, **kw):
        """FlashAttention's backward from the given out and LSE (P = exp(S - lse), D = rowsum(dout out))."""
        g = q.shape[2] // k.shape[2]
        kr, vr = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
        s = torch.einsum("bqhd,bkhd->bhqk", q, kr) * softmax_scale
        if causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(s.shape[-1] - s.shape[-2] + 1),
                              -float("inf"))
        p = torch.exp(s - lse[..., None])
        dp = torch.einsum("bqhd,bkhd->bhqk", dout, vr)
        ds = p * (dp - (dout * out).sum(-1).transpose(1, 2)[..., None])
        dq.copy_(torch.einsum("bhqk,bkhd->bqhd", ds, kr) * softmax_scale)
        fold = lambda x: x.unflatten(2, (k.shape[2], g)).sum(3)  # noqa: E731
        dk.copy_(fold(torch.einsum("bhqk,bqhd->bkhd", ds, q)) * softmax_scale)
        dv.copy_(fold(torch.einsum("bhqk,bqhd->bkhd", p, dout)))
    monkeypatch.setattr(backward, "attention_backward", lse_backward)
    torch.manual_seed(dv)
    q, k = torch.randn(2, sq, 4, 64, dtype=torch.float64), torch.randn(2, sk, 2, 64, dtype=torch.float64)
    v = torch.randn(2, sk, 2, dv, dtype=torch.float64)
    scale = 0.11
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = _math_attention(*x, scale, True)
    assert torch.isneginf(lse).any() == (sq > sk)
    dout = torch.randn_like(out)
    want = torch.autograd.grad(out, x, dout)
    res = fa3._bwd_op(dout, q, k, v, out.detach(), lse.detach(), softmax_scale=scale, is_causal=True)
    for got, ref in zip(res[:3], want):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(res[3], (dout * out).sum(-1).transpose(1, 2).float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res[4], torch.where(torch.isneginf(lse), 0.0, lse * 1.4426950408889634))
    assert all(x.numel() == 0 for x in res[5:])


def test_bwd_checks_its_operands():
    q, lse = torch.zeros(1, 4, 2, 64), torch.zeros(1, 2, 4)
    with pytest.raises(ValueError, match=r"dk must be torch.float32 of shape \(1, 4, 2, 64\)"):
        fa3._bwd_op(q, q, q, q, q, lse, dk=torch.zeros(1, 4, 2, 32))
    v = torch.zeros(1, 4, 2, 96)
    with pytest.raises(ValueError, match=r"out must be torch.float32 of shape \(1, 4, 2, 96\) \(q's rows, v's head"):
        fa3._bwd_op(torch.zeros(1, 4, 2, 96), q, q, v, q, lse)
    with pytest.raises(ValueError, match="dout must be torch.float32"):
        fa3._bwd_op(q.half(), q, q, q, q, lse)


def _rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


@ours
@requires_sm90
def test_gpu_fwd_is_the_functions():
    """The operator's three routes give the functions' outputs and LSEs bitwise; a given out (also
    in SDPA's layout, as PyTorch's FA3 adapter gives it, and on the varlen and decode routes) is
    written with the functions' values and returned."""
    ops = torch.ops.flash_attn_3
    q, k, v = _rand(2, 300, 8, 128), _rand(2, 400, 2, 128), _rand(2, 400, 2, 128)
    out, lse, *_ = ops.fwd(q, k, v, is_causal=True, window_size_left=100, window_size_right=-1)
    ref, ref_lse = fa3.flash_attn_func(q, k, v, causal=True, window_size=(100, -1), return_attn_probs=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    given = torch.empty_like(q)
    assert ops.fwd(q, k, v, out=given)[0] is given
    assert torch.equal(given, fa3.flash_attn_func(q, k, v))
    sdpa_out = torch.full((2, 8, 300, 128), float("nan"), dtype=q.dtype, device="cuda").transpose(1, 2)
    mods = dict(softmax_scale=0.07, is_causal=True, window_size_left=100, window_size_right=-1, softcap=5.0)
    assert ops.fwd(q, k, v, out=sdpa_out, **mods)[0] is sdpa_out  # (PyTorch's FA3 adapter's layout)
    assert torch.equal(sdpa_out, fa3.flash_attn_func(q, k, v, 0.07, True, window_size=(100, -1), softcap=5.0))
    cu_q = torch.tensor([0, 100, 100, 300], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 150, 260, 400], dtype=torch.int32, device="cuda")
    out, lse, *_ = ops.fwd(q[0], k[0], v[0], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=200,
                           max_seqlen_k=150, is_causal=True)
    ref, ref_lse = fa3.flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 200, 150, causal=True,
                                              return_attn_probs=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    given = torch.full_like(q[0], float("nan"))
    assert ops.fwd(q[0], k[0], v[0], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=200, max_seqlen_k=150,
                   is_causal=True, out=given)[0] is given and torch.equal(given, ref)
    lens = torch.tensor([37, 399], dtype=torch.int32, device="cuda")
    kc, vc, kn = k.clone(), v.clone(), _rand(2, 1, 2, 128)
    out, lse, *_ = ops.fwd(q[:, :1], kc, vc, k_new=kn, v_new=kn, seqused_k=lens, is_causal=True)
    kc2, vc2 = k.clone(), v.clone()
    ref, ref_lse = fa3.flash_attn_with_kvcache(q[:, :1], kc2, vc2, kn, kn, cache_seqlens=lens, causal=True,
                                               return_softmax_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    given = torch.full_like(q[:, :1], float("nan"))
    assert ops.fwd(q[:, :1], kc, vc, seqused_k=lens + 1, is_causal=True, out=given)[0] is given
    assert torch.equal(given, fa3.flash_attn_with_kvcache(q[:, :1], kc, vc, cache_seqlens=lens + 1, causal=True))


@ours
@requires_sm90
@pytest.mark.parametrize("case", ["dense", "taller", "packed", "seqused", "dv256"])
def test_gpu_bwd_matches_autograd(case):
    """The backward operator's dq, dk, dv: bitwise those of the functions' autograd (deterministic
    backward) for dense and packed calls and seqused; for a value head dim twice q's, within
    flash-attn's rule of the float64 gradients. "taller" (causal, more queries than keys) and
    seqused have rows that see no key, whose LSE the forward returns as -inf."""
    ops = torch.ops.flash_attn_3
    torch.manual_seed(0)
    d, dv = 128, 256 if case == "dv256" else 128
    if case in ("dense", "taller", "dv256"):
        q, k, v = _rand(2, 300 if case == "taller" else 200, 8, d), _rand(2, 260, 2, d), _rand(2, 260, 2, dv)
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = fa3.flash_attn_func(*x, causal=True, deterministic=True, return_attn_probs=True)
        assert bool(torch.isneginf(lse).any()) == (case == "taller") and not torch.isposinf(lse).any()
        seq = {}
    else:
        q, k, v = _rand(400, 8, d), _rand(520, 2, d), _rand(520, 2, dv)
        cu_q = torch.tensor([0, 200, 200, 400], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, 260, 300, 520], dtype=torch.int32, device="cuda")
        seq = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=200, max_seqlen_k=260)
        if case == "seqused":
            seq.update(seqused_q=torch.tensor([150, 0, 199], dtype=torch.int32, device="cuda"),
                       seqused_k=torch.tensor([260, 7, 100], dtype=torch.int32, device="cuda"))
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = fa3.flash_attn_varlen_func(*x, seq["cu_seqlens_q"], seq["cu_seqlens_k"], 200, 260,
                                              seq.get("seqused_q"), seq.get("seqused_k"), causal=True,
                                              deterministic=True, return_attn_probs=True)
    dout = torch.randn_like(out)
    want = torch.autograd.grad(out, x, dout)
    dq = torch.full_like(q, float("nan"))
    res = ops.bwd(dout, q, k, v, out.detach(), lse.detach(), dq=dq, is_causal=True, deterministic=True, **seq)
    assert res[0] is dq and all(bool(torch.isfinite(g).all()) for g in res[:3])
    if case != "dv256":
        assert all(torch.equal(a, b) for a, b in zip(res[:3], want))
    else:
        x64 = [t.double().cpu().requires_grad_() for t in (q, k, v)]
        o64, _ = _math_attention(*x64, d ** -0.5, True)
        g64 = torch.autograd.grad(o64, x64, dout.double().cpu())
        x16 = [t.clone().requires_grad_() for t in (q, k, v)]
        g = q.shape[2] // k.shape[2]
        s = torch.einsum("bqhd,bkhd->bhqk", x16[0], x16[1].repeat_interleave(g, dim=2)) * d ** -0.5
        s = s.masked_fill(torch.ones(200, 260, dtype=torch.bool, device="cuda").triu(61), -float("inf"))
        o16 = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), x16[2].repeat_interleave(g, dim=2))
        g16 = torch.autograd.grad(o16, x16, dout)
        for a, b64, b16 in zip(res[:3], g64, g16):
            assert (a.double().cpu() - b64).abs().max() <= 2 * (b16.double().cpu() - b64).abs().max() + 2e-4
    dsum = (dout.float() * out.float()).sum(-1)
    torch.testing.assert_close(res[3], dsum.transpose(-1, -2) if dsum.dim() == 3 else dsum.T, rtol=1e-4, atol=1e-3)


@ours
@requires_sm90
@pytest.mark.parametrize("used_q", [False, True])
def test_gpu_batched_seqused_against_reference(used_q):
    """Batched q, k, v with seqused_k (fwd: the KV-cache route, a decode over cache lengths) or with
    seqused_q too (the varlen route), maxima given as the used counts' as callers do, then bwd with
    the same arguments: output, LSE and gradients of the used tokens within tolerance of the
    float64 reference over the used tokens alone, zeros elsewhere."""
    import numpy as np
    from test_flash_attn3 import _seqused_reference
    ops = torch.ops.flash_attn_3
    torch.manual_seed(used_q)
    b, sq, sk, h, hk, d = 3, 96, 300, 8, 2, 128
    q, k, v = _rand(b, sq, h, d), _rand(b, sk, hk, d), _rand(b, sk, hk, d)
    uk = torch.tensor([300, 96, 150], dtype=torch.int32, device="cuda")
    uq = torch.tensor([96, 40, 0], dtype=torch.int32, device="cuda") if used_q else None
    seq = dict(seqused_q=uq, seqused_k=uk, max_seqlen_q=96, max_seqlen_k=300 if used_q else 150)
    out, lse, *_ = ops.fwd(q, k, v, is_causal=True, **seq)
    dout = _rand(b, sq, h, d)
    dq, dk, dv, *_ = ops.bwd(dout, q, k, v, out, lse, is_causal=True, **seq)
    flat = [x.flatten(0, 1).double().cpu().numpy() for x in (q, k, v, dout)]
    cu_q, cu_k = np.arange(b + 1, dtype=np.int32) * sq, np.arange(b + 1, dtype=np.int32) * sk
    host_uq = uq.cpu().numpy() if used_q else np.full(b, sq, np.int32)
    want = _seqused_reference(*flat[:3], cu_q, cu_k, host_uq, uk.cpu().numpy(), flat[3], True, (-1, -1))
    got = (out.flatten(0, 1), lse.transpose(0, 1).flatten(1), dq.flatten(0, 1), dk.flatten(0, 1), dv.flatten(0, 1))
    for name, g, ref in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        g = g.double().cpu().numpy()
        finite = np.isfinite(ref)
        assert (np.isfinite(g) == finite).all(), name
        np.testing.assert_allclose(g[finite], ref[finite], rtol=0, atol=2e-2 if name in ("out", "lse") else 6e-2,
                                   err_msg=name)


@ours
@requires_sm90
def test_gpu_pytorch_fa3_adapter_runs_on_cuflash():
    """PyTorch's FA3 adapter (torch.nn.attention._fa3, given module_path="cuflash.flash_attn3")
    sends SDPA's flash calls to these operators: output and gradients within flash-attn's rule of
    float64, and the calls reach cuflash. Run in a child process, so the dispatcher override stays
    out of the other tests."""
    fa3_adapter = pytest.importorskip("torch.nn.attention._fa3", reason="this PyTorch has no FA3 adapter")
    if not hasattr(fa3_adapter, "register_flash_attention_fa3"):
        pytest.skip("this PyTorch's FA3 adapter has no register_flash_attention_fa3")
    code = textwrap.dedent("""
        import torch, torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel, SDPBackend
        from torch.nn.attention import _fa3
        import cuflash.flash_attn3 as fa3
        calls = []
        for name in ("flash_attn_func",):
            f = getattr(fa3, name)
            setattr(fa3, name, lambda *a, _f=f, **k: (calls.append(1), _f(*a, **k))[1])
        handle = _fa3.register_flash_attention_fa3(module_path="cuflash.flash_attn3")
        torch.manual_seed(0)
        q, k, v = (torch.randn(2, 8, 300, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), g)
        handle.remove()
        def ref(dtype):
            x = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
            o = F.scaled_dot_product_attention(*x, is_causal=True)
            return o, torch.autograd.grad(o, x, g.to(dtype))
        with sdpa_kernel(SDPBackend.MATH):
            o64, g64 = ref(torch.float64)
            o16, g16 = ref(torch.bfloat16)
        assert calls, "cuflash was not called"
        assert (out.double() - o64).abs().max() <= 2 * (o16.double() - o64).abs().max() + 1e-5
        for a, b64, b16 in zip(grads, g64, g16):
            assert (a.double() - b64).abs().max() <= 2 * (b16.double() - b64).abs().max() + 2e-4
        print("ok", len(calls))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr
