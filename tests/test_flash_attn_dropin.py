"""cuflash.flash_attn, the flash-attn drop-in: signatures against flash-attn 2.8's, the mapping
onto cuflash.torch (recorded on CPU tensors), the arguments that raise NotImplementedError, the
return conventions, and the bert_padding helpers. GPU tests run the drop-in against the float64
reference (cuflash.reference), forward and backward."""
import inspect

import numpy as np
import pytest

from conftest import requires_gpu, requires_torch
from test_torch_integration import _cpu, _ref_grads, ref_attention, ref_attention_varlen, ref_kernels  # noqa: F401

pytestmark = [requires_torch]

# ---------------------------------------------------------------------------------------------
# Upstream signatures: flash-attn v2.8.3, flash_attn/flash_attn_interface.py and
# flash_attn/bert_padding.py (Dao-AILab/flash-attention, tag v2.8.3; both files are the same
# from v2.8.0 to v2.8.3.post1). (name, default), REQ for a required argument; all positional or
# keyword.

REQ = inspect.Parameter.empty
_DENSE_TAIL = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
               ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
               ("deterministic", False), ("return_attn_probs", False)]
UPSTREAM = {
    "flash_attn_func": [("q", REQ), ("k", REQ), ("v", REQ)] + _DENSE_TAIL,
    "flash_attn_kvpacked_func": [("q", REQ), ("kv", REQ)] + _DENSE_TAIL,
    "flash_attn_qkvpacked_func": [("qkv", REQ)] + _DENSE_TAIL,
    "flash_attn_varlen_func": [("q", REQ), ("k", REQ), ("v", REQ), ("cu_seqlens_q", REQ),
                               ("cu_seqlens_k", REQ), ("max_seqlen_q", REQ), ("max_seqlen_k", REQ)]
                              + _DENSE_TAIL + [("block_table", None)],
    "flash_attn_varlen_kvpacked_func": [("q", REQ), ("kv", REQ), ("cu_seqlens_q", REQ),
                                        ("cu_seqlens_k", REQ), ("max_seqlen_q", REQ),
                                        ("max_seqlen_k", REQ)] + _DENSE_TAIL,
    "flash_attn_varlen_qkvpacked_func": [("qkv", REQ), ("cu_seqlens", REQ), ("max_seqlen", REQ)]
                                        + _DENSE_TAIL,
    "flash_attn_with_kvcache": [
        ("q", REQ), ("k_cache", REQ), ("v_cache", REQ), ("k", None), ("v", None),
        ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None),
        ("cache_batch_idx", None), ("cache_leftpad", None), ("block_table", None),
        ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0),
        ("rotary_interleaved", True), ("alibi_slopes", None), ("num_splits", 0),
        ("return_softmax_lse", False)],
}
UPSTREAM_BERT_PADDING = {
    "index_first_axis": [("input", REQ), ("indices", REQ)],  # IndexFirstAxis.apply upstream
    "index_put_first_axis": [("values", REQ), ("indices", REQ), ("first_axis_dim", REQ)],
    "unpad_input": [("hidden_states", REQ), ("attention_mask", REQ), ("unused_mask", None)],
    "pad_input": [("hidden_states", REQ), ("indices", REQ), ("batch", REQ), ("seqlen", REQ)],
    "unpad_input_for_concatenated_sequences": [("hidden_states", REQ),
                                               ("attention_mask_in_length", REQ)],
}
# Keyword-only extras beyond upstream: vLLM's fork (vllm_flash_attn) names for varlen calls.
EXTRAS = {"flash_attn_varlen_func": [("seqused_k", None), ("return_softmax_lse", False),
                                     ("s_aux", None)],
          "flash_attn_func": [("s_aux", None)]}  # (transformers passes the varlen function's keywords)


def _params(fn):
    return [(p.name, p.default, p.kind) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", sorted(UPSTREAM))
def test_signature_is_flash_attn_2_8s(name):
    import cuflash.flash_attn as fa
    got = _params(getattr(fa, name))
    n = len(UPSTREAM[name])
    assert [(a, d) for a, d, _ in got[:n]] == UPSTREAM[name]
    assert all(kind == inspect.Parameter.POSITIONAL_OR_KEYWORD for _, _, kind in got[:n])
    assert [(a, d) for a, d, _ in got[n:]] == EXTRAS.get(name, [])
    assert all(kind == inspect.Parameter.KEYWORD_ONLY for _, _, kind in got[n:])


@pytest.mark.parametrize("name", sorted(UPSTREAM_BERT_PADDING))
def test_bert_padding_signature(name):
    from cuflash.flash_attn import bert_padding
    got = _params(getattr(bert_padding, name))
    assert [(a, d) for a, d, _ in got] == UPSTREAM_BERT_PADDING[name]


def test_exports():
    import cuflash.flash_attn as fa
    from cuflash.flash_attn import bert_padding
    assert sorted(fa.__all__) == sorted(UPSTREAM)
    assert sorted(bert_padding.__all__) == sorted(UPSTREAM_BERT_PADDING)


# ---------------------------------------------------------------------------------------------
# The mapping onto cuflash.torch, recorded

@pytest.fixture
def recorded(monkeypatch):
    """cuflash.torch.ops.attention / attention_varlen and cuflash.attention_with_kvcache replaced
    by recorders returning zeros: calls[i] = (function, positional args, keyword args)."""
    import torch
    import cuflash
    from cuflash.torch import ops
    calls = []

    def result(q, lse_shape, return_lse):
        out = torch.zeros_like(q)
        return (out, torch.zeros(lse_shape)) if return_lse else out

    def attention(q, k, v, **kw):
        calls.append(("attention", (q, k, v), kw))
        b, sq, h, _ = q.shape
        return result(q, (b, h, sq), kw["return_lse"])

    def attention_varlen(q, k, v, *args, **kw):
        calls.append(("varlen", (q, k, v) + args, kw))
        return result(q, (q.shape[1], q.shape[0]), kw["return_lse"])

    def with_kvcache(q, k_cache, v_cache, k=None, v=None, **kw):
        calls.append(("kvcache", (q, k_cache, v_cache, k, v), kw))
        b, sq, h, _ = q.shape
        return result(q, (b, h, sq), kw["return_lse"])

    monkeypatch.setattr(ops, "attention", attention)
    monkeypatch.setattr(ops, "attention_varlen", attention_varlen)
    monkeypatch.setattr(cuflash, "attention_with_kvcache", with_kvcache)
    return calls


def _is_view(x, base, index):
    """x is base[index] as a view: same storage, pointer and strides (no copy was made)."""
    want = base[index]
    return (x.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
            and x.data_ptr() == want.data_ptr() and x.stride() == want.stride()
            and x.shape == want.shape)


FEATURES = dict(softmax_scale=0.25, causal=True, window_size=(7, 0), softcap=30.0,
                deterministic=True)
MAPPED = dict(softmax_scale=0.25, causal=True, window_size=(7, 0), softcap=30.0,
              deterministic=True, alibi_slopes=None, return_lse=False)


def test_dense_maps_every_argument(recorded):
    from cuflash.flash_attn import flash_attn_func
    slopes = _cpu(4, dtype="float32")
    q, k, v = _cpu(2, 5, 4, 8), _cpu(2, 6, 2, 8), _cpu(2, 6, 2, 8)
    flash_attn_func(q, k, v, 0.0, 0.25, True, (7, 0), 30.0, slopes, True, False)  # positionally
    (fn, args, kw), = recorded
    assert fn == "attention" and all(a is b for a, b in zip(args, (q, k, v)))
    assert kw == {**MAPPED, "alibi_slopes": slopes}


@pytest.mark.parametrize("packed", ["qkv", "kv"])
def test_dense_packed_pass_views(recorded, packed):
    import cuflash.flash_attn as fa
    if packed == "qkv":
        qkv = _cpu(2, 5, 3, 4, 8)
        fa.flash_attn_qkvpacked_func(qkv, **FEATURES)
        views = [(qkv, (slice(None), slice(None), i)) for i in range(3)]
    else:
        q, kv = _cpu(2, 5, 4, 8), _cpu(2, 6, 2, 2, 8)
        fa.flash_attn_kvpacked_func(q, kv, **FEATURES)
        views = [(kv, (slice(None), slice(None), i)) for i in range(2)]
    (fn, args, kw), = recorded
    assert fn == "attention" and kw == MAPPED
    for x, (base, index) in zip(args[-len(views):], views):
        assert _is_view(x, base, index)


@pytest.mark.parametrize("packed", [None, "qkv", "kv"])
def test_varlen_maps_and_packed_pass_views(recorded, packed):
    import torch
    import cuflash.flash_attn as fa
    cu_q, cu_k = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    if packed is None:
        q, k, v = _cpu(5, 4, 8), _cpu(9, 2, 8), _cpu(9, 2, 8)
        fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 5, **FEATURES)
        want, views = (q, k, v, cu_q, cu_k, 3, 5), []
    elif packed == "qkv":
        qkv = _cpu(5, 3, 4, 8)
        fa.flash_attn_varlen_qkvpacked_func(qkv, cu_q, 3, **FEATURES)
        want, views = (cu_q, cu_q, 3, 3), [(qkv, (slice(None), i)) for i in range(3)]
    else:
        q, kv = _cpu(5, 4, 8), _cpu(9, 2, 2, 8)
        fa.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 3, 5, **FEATURES)
        want, views = (cu_q, cu_k, 3, 5), [(kv, (slice(None), i)) for i in range(2)]
    (fn, args, kw), = recorded
    assert fn == "varlen" and kw == {**MAPPED, "block_table": None}
    assert all(a is b for a, b in zip(args[-len(want):], want))
    for x, (base, index) in zip(args[3 - len(views):3], views):
        assert _is_view(x, base, index)


def test_kvcache_maps_every_argument(recorded):
    import torch
    from cuflash.flash_attn import flash_attn_with_kvcache
    q, kc, vc = _cpu(2, 1, 4, 8), _cpu(2, 16, 2, 8), _cpu(2, 16, 2, 8)
    k, v = _cpu(2, 1, 2, 8), _cpu(2, 1, 2, 8)
    seqlens, idx = torch.tensor([3, 5], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32)
    cos, sin, pad = torch.zeros(16, 4), torch.ones(16, 4), torch.tensor([0, 1], dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cos, sin, cache_seqlens=seqlens, cache_batch_idx=idx,
                                       cache_leftpad=pad, softmax_scale=0.25, causal=True, window_size=[7, -3],
                                       softcap=-1.0, rotary_interleaved=False, num_splits=3,
                                       return_softmax_lse=True)
    (fn, args, kw), = recorded
    assert fn == "kvcache" and all(a is b for a, b in zip(args, (q, kc, vc, k, v)))
    assert kw == dict(rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens, cache_batch_idx=idx,
                      cache_leftpad=pad, block_table=None, causal=True, softmax_scale=0.25, num_splits=3,
                      return_lse=True, window_size=(7, -1), softcap=0.0, rotary_interleaved=False,
                      alibi_slopes=None)
    assert out.shape == q.shape and lse.shape == (2, 4, 1)


def test_seqused_k_with_block_table_becomes_offsets(recorded):
    import torch
    from cuflash.flash_attn import flash_attn_varlen_func
    q, pages = _cpu(3, 4, 8), _cpu(4, 16, 2, 8)
    cu_q = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    table = torch.arange(6, dtype=torch.int32).reshape(3, 2) % 4
    used = torch.tensor([3, 0, 20], dtype=torch.int32)
    out, lse = flash_attn_varlen_func(q, pages, pages, cu_q, None, 1, 20, block_table=table,
                                      seqused_k=used, return_softmax_lse=True)
    (_, args, kw), = recorded
    assert args[4].tolist() == [0, 3, 3, 23] and args[4].dtype == torch.int32
    assert kw["block_table"] is table and kw["return_lse"]
    assert out.shape == q.shape and lse.shape == (4, 3)


def test_last_dim_made_contiguous(recorded):
    """flash-attn copies operands whose last dim is strided; so does the drop-in."""
    from cuflash.flash_attn import flash_attn_func
    q = _cpu(2, 5, 8, 4).transpose(-1, -2)  # (2, 5, 4, 8), last-dim stride 4
    k = _cpu(2, 6, 2, 8)
    flash_attn_func(q, k, k)
    (_, args, _), = recorded
    assert args[0].stride(-1) == 1 and args[0].equal(q) and args[1] is k


@pytest.mark.parametrize("window,want", [
    ((-1, -1), (-1, -1)), ([5, 0], (5, 0)), ((-7, 3), (-1, 3)), ((4, -100), (4, -1)),
    ("tensor", (9, 2)), ("tensor0d", (9, 2)), ("numpy", (9, 2)),
])
def test_window_forms(recorded, window, want):
    import torch
    from cuflash.flash_attn import flash_attn_func
    window = {"tensor": torch.tensor([9, 2]), "tensor0d": (torch.tensor(9), torch.tensor(2)),
              "numpy": np.array([9, 2], dtype=np.int64)}.get(window, window) \
        if isinstance(window, str) else window
    q = _cpu(1, 3, 2, 8)
    flash_attn_func(q, q, q, window_size=window)
    assert recorded[0][2]["window_size"] == want


@pytest.mark.parametrize("window", [(1.5, 0), (1, 2, 3), 4, None, "tensor_float", "tensor_3"])
def test_bad_windows_are_type_errors(recorded, window):
    import torch
    from cuflash.flash_attn import flash_attn_func
    window = {"tensor_float": torch.tensor([1.0, 0.0]), "tensor_3": torch.tensor([1, 0, 2])}.get(
        window, window) if isinstance(window, str) else window
    q = _cpu(1, 3, 2, 8)
    with pytest.raises(TypeError, match="window_size"):
        flash_attn_func(q, q, q, window_size=window)
    assert not recorded


# ---------------------------------------------------------------------------------------------
# Arguments cuflash does not support yet

def _dense_calls():
    import torch
    import cuflash.flash_attn as fa
    q, kv, qkv = _cpu(1, 3, 2, 8), _cpu(1, 3, 2, 2, 8), _cpu(1, 3, 3, 2, 8)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    return {
        "flash_attn_func": lambda **kw: fa.flash_attn_func(q, q, q, **kw),
        "flash_attn_kvpacked_func": lambda **kw: fa.flash_attn_kvpacked_func(q, kv, **kw),
        "flash_attn_qkvpacked_func": lambda **kw: fa.flash_attn_qkvpacked_func(qkv, **kw),
        "flash_attn_varlen_func": lambda **kw: fa.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 3, 3, **kw),
        "flash_attn_varlen_kvpacked_func": lambda **kw: fa.flash_attn_varlen_kvpacked_func(q[0], kv[0], cu, cu, 3, 3, **kw),
        "flash_attn_varlen_qkvpacked_func": lambda **kw: fa.flash_attn_varlen_qkvpacked_func(qkv[0], cu, 3, **kw),
    }


@pytest.mark.parametrize("name", sorted(set(UPSTREAM) - {"flash_attn_with_kvcache"}))
def test_dropout_is_passed_on(recorded, name):
    """dropout_p reaches cuflash.torch, which takes the seed and offset from the default CUDA
    generator (seed=None, offset=None); 0 passes nothing; outside [0, 1) nothing runs."""
    call = _dense_calls()[name]
    for bad in (1.0, -0.5):
        with pytest.raises(ValueError, match="dropout_p must be a float in"):
            call(dropout_p=bad)
    assert not recorded
    call(dropout_p=0.1)
    assert {n: recorded[0][2][n] for n in ("dropout_p", "seed", "offset")} == dict(dropout_p=0.1, seed=None,
                                                                                 offset=None)
    call(dropout_p=0.0)  # flash-attn's evaluation setting
    assert len(recorded) == 2 and "dropout_p" not in recorded[1][2]


def test_dense_seqused_k_cuts_sequences(recorded):
    """vLLM's seqused_k with dense K/V: sequence b attends to the first seqused_k[b] keys of its
    cu_seqlens_k rows (plan.seqused_bounds' three sequences per sequence, on the tensors' device);
    with dropout it raises before anything runs."""
    import torch
    from cuflash.flash_attn import flash_attn_varlen_func
    q, k = _cpu(5, 2, 8), _cpu(7, 2, 8)
    cu_q, cu_k = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([0, 4, 7], dtype=torch.int32)
    flash_attn_varlen_func(q, k, k, cu_q, cu_k, 3, 4, seqused_k=torch.tensor([2, 9], dtype=torch.int32))
    (_, args, _), = recorded
    assert args[3].tolist() == [0, 3, 3, 3, 5, 5, 5] and args[4].tolist() == [0, 2, 2, 4, 7, 7, 7]
    assert args[5:7] == (3, 4) and cu_q.tolist() == [0, 3, 5]
    slopes = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # (batch, nheads): each sequence's three pieces take its row
    flash_attn_varlen_func(q, k, k, cu_q, cu_k, 3, 4, alibi_slopes=slopes, seqused_k=torch.tensor([2, 9], dtype=torch.int32))
    assert recorded[-1][2]["alibi_slopes"].tolist() == [[1.0, 2.0]] * 3 + [[3.0, 4.0]] * 3
    recorded.pop()
    with pytest.raises(NotImplementedError, match="seqused_k with dense K/V and dropout"):
        flash_attn_varlen_func(q, k, k, cu_q, cu_k, 3, 4, 0.1, seqused_k=torch.tensor([2, 9], dtype=torch.int32))
    assert len(recorded) == 1


def test_varlen_s_aux_is_sinks(recorded):
    """vLLM's s_aux (attention sinks) runs as cuflash.torch.attention_varlen(..., sinks=s_aux)."""
    import torch
    from cuflash.flash_attn import flash_attn_varlen_func
    q, cu, s_aux = _cpu(3, 2, 8), torch.tensor([0, 3], dtype=torch.int32), torch.zeros(2)
    flash_attn_varlen_func(q, q, q, cu, cu, 3, 3, s_aux=s_aux)
    flash_attn_varlen_func(q, q, q, cu, cu, 3, 3)
    assert recorded[0][2]["sinks"] is s_aux and "sinks" not in recorded[1][2]


def test_dense_s_aux_is_sinks(recorded):
    """s_aux on flash_attn_func too (transformers hands the varlen function's keywords to it):
    cuflash.torch.attention(..., sinks=s_aux)."""
    import torch
    from cuflash.flash_attn import flash_attn_func
    q, s_aux = _cpu(1, 3, 2, 8), torch.zeros(2)
    flash_attn_func(q, q, q, s_aux=s_aux)
    flash_attn_func(q, q, q)
    assert recorded[0][2]["sinks"] is s_aux and "sinks" not in recorded[1][2]


def test_lengths_and_flags_as_flash_attn_ops_take_them(recorded):
    """flash-attn's operators take a max_seqlen given as a one-element tensor or a NumPy integer
    (transformers' packed-sequence path passes ``position_ids.max() + 1``), and causal and
    rotary_interleaved given as ints: the functions pass ints and bools on, on every route."""
    import numpy as np
    import torch
    from cuflash.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
    q, cu = _cpu(3, 2, 8), torch.tensor([0, 3], dtype=torch.int32)
    flash_attn_varlen_func(q, q, q, cu, cu, torch.tensor(3), np.int64(3), causal=1)
    _, args, kw = recorded[-1]
    assert args[5:7] == (3, 3) and all(type(a) is int for a in args[5:7]) and kw["causal"] is True
    flash_attn_func(q[None], q[None], q[None], causal=np.bool_(True))
    assert recorded[-1][2]["causal"] is True
    flash_attn_with_kvcache(q[None], q[None], q[None], causal=1, rotary_interleaved=0)
    kw = recorded[-1][2]
    assert kw["causal"] is True and kw["rotary_interleaved"] is False


def test_kvcache_larger_cache_reads_its_first_rows(recorded):
    """A contiguous cache preallocated for a larger batch, without cache_batch_idx: flash-attn reads
    rows 0 ... batch - 1; the drop-in hands those rows on as views (appends land in the caller's
    cache). With cache_batch_idx or a block table the cache goes on whole."""
    import torch
    from cuflash.flash_attn import flash_attn_with_kvcache
    from cuflash.flash_attn.flash_attn_interface import flash_attn_gpu
    q, kc, vc = _cpu(2, 1, 2, 8), _cpu(5, 6, 2, 8), _cpu(5, 6, 2, 8)
    flash_attn_with_kvcache(q, kc, vc, cache_seqlens=3)
    _, (_, k_cache, v_cache, _, _), _ = recorded[-1]
    assert _is_view(k_cache, kc, slice(0, 2)) and _is_view(v_cache, vc, slice(0, 2))
    idx = torch.tensor([4, 1], dtype=torch.int32)
    flash_attn_with_kvcache(q, kc, vc, cache_seqlens=3, cache_batch_idx=idx)
    assert recorded[-1][1][1] is kc and recorded[-1][2]["cache_batch_idx"] is idx
    flash_attn_gpu.fwd_kvcache(q, kc, vc, None, None, torch.tensor([3, 3], dtype=torch.int32), None, None, None,
                               None, None, None, None, None, False, -1, -1, 0.0, False, 0)
    assert _is_view(recorded[-1][1][1], kc, slice(0, 2))


def test_names_other_libraries_import(recorded):
    """flash-attn's module-level names that libraries import besides the functions: the
    ``_wrapped_*`` entry points, its autograd Function classes (``Cls.apply`` with the forward's
    arguments: the function's, then is_grad_enabled), maybe_contiguous and round_multiple;
    bert_padding's Function classes and index_first_axis_residual; rotary's apply_rotary_emb_func."""
    import torch
    from cuflash.flash_attn import bert_padding, flash_attn_interface as fi
    from cuflash.flash_attn.layers import rotary
    assert fi._wrapped_flash_attn_forward is fi._flash_attn_forward
    assert fi._wrapped_flash_attn_varlen_backward is fi._flash_attn_varlen_backward
    q, cu = _cpu(1, 3, 2, 8), torch.tensor([0, 3], dtype=torch.int32)
    out = fi.FlashAttnFunc.apply(q, q, q, 0.0, 0.5, True, (-1, -1), 0.0, None, False, False, True)
    name, _, kw = recorded[-1]
    assert name == "attention" and kw["softmax_scale"] == 0.5 and kw["causal"] is True and out.shape == q.shape
    res = fi.FlashAttnVarlenFunc.apply(q[0], q[0], q[0], cu, cu, 3, 3, 0.0, None, False, (-1, -1), 0.0, None, False,
                                       True, None, False)
    assert recorded[-1][0] == "varlen" and len(res) == 3  # (out, lse, S_dmask): return_softmax
    fi.FlashAttnQKVPackedFunc.apply(torch.stack((q, q, q), dim=2), 0.0, None, False, (-1, -1), 0.0, None, False,
                                    False, True)
    assert recorded[-1][0] == "attention"
    seen = []

    class Probe(fi.FlashAttnFunc):
        _fn = staticmethod(lambda q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_softmax: seen.append(torch.is_grad_enabled()))
    Probe.apply(*(None,) * 11, False)
    Probe.apply(*(None,) * 11, True)
    with torch.no_grad():
        Probe.apply(*(None,) * 11, True)
    assert seen == [False, True, False]
    with pytest.raises(TypeError, match=r"FlashAttnVarlenFunc.apply takes 17 arguments .* got 16"):
        fi.FlashAttnVarlenFunc.apply(q[0], q[0], q[0], cu, cu, 3, 3, 0.0, None, False, (-1, -1), 0.0, None, False,
                                     True, False)  # (an older caller's: no block_table)
    assert [fi._arity(c._fn) for c in (fi.FlashAttnFunc, fi.FlashAttnKVPackedFunc, fi.FlashAttnQKVPackedFunc,
                                       fi.FlashAttnVarlenFunc, fi.FlashAttnVarlenKVPackedFunc,
                                       fi.FlashAttnVarlenQKVPackedFunc)] == [12, 11, 10, 17, 15, 12]
    x = _cpu(2, 5)
    assert fi.maybe_contiguous(x) is x and fi.maybe_contiguous(x.t()).is_contiguous() and fi.round_multiple(9, 8) == 16
    idx = torch.tensor([3, 1])
    assert bert_padding.IndexFirstAxis.apply(x.t(), idx).equal(x.t()[idx])
    assert bert_padding.IndexPutFirstAxis.apply(x, idx, 4)[3].equal(x[0])
    rows, whole = bert_padding.IndexFirstAxisResidual.apply(x.t(), idx)
    assert rows.equal(x.t()[idx]) and whole is not None and whole.equal(x.t())
    assert rotary.apply_rotary_emb_func is rotary.apply_rotary_emb


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_torch_reference_is_apply_rotary_emb(interleaved):
    """flash-attn's PyTorch reference (apply_rotary_emb_torch, rotate_half) rotates as
    apply_rotary_emb does at positions 0 ... seqlen - 1 (float64: no rounding between them)."""
    import torch
    from cuflash.flash_attn.layers.rotary import apply_rotary_emb, apply_rotary_emb_torch, rotate_half
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 16, generator=g, dtype=torch.float64)
    angle = torch.rand(5, 3, generator=g, dtype=torch.float64) * 6
    got = apply_rotary_emb_torch(x, angle.cos(), angle.sin(), interleaved)
    want = apply_rotary_emb(x, angle.cos(), angle.sin(), interleaved)
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-6, atol=1e-6)
    assert got[..., 6:].equal(x[..., 6:])
    h = torch.arange(4.0)
    assert rotate_half(h).tolist() == [-2, -3, 0, 1] and rotate_half(h, True).tolist() == [-1, 0, -3, 2]


# ---------------------------------------------------------------------------------------------
# Return conventions and gradients, end to end with the float64 reference kernels

def test_return_attn_probs(ref_kernels):
    import torch
    from cuflash.flash_attn import flash_attn_func, flash_attn_varlen_func
    q, k, v = _cpu(2, 5, 4, 8), _cpu(2, 7, 2, 8, seed=1), _cpu(2, 7, 2, 8, seed=2)
    out = flash_attn_func(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor)
    out, lse, s_dmask = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    ref, ref_lse = ref_attention(q, k, v, True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    assert s_dmask.shape == (0,) and s_dmask.dtype == q.dtype  # as flash-attn without dropout

    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    qv = _cpu(5, 4, 8)
    assert isinstance(flash_attn_varlen_func(qv, qv, qv, cu, cu, 3, 3), torch.Tensor)
    out, lse = flash_attn_varlen_func(qv, qv, qv, cu, cu, 3, 3, return_softmax_lse=True)
    assert lse.shape == (4, 5)
    out3 = flash_attn_varlen_func(qv, qv, qv, cu, cu, 3, 3, return_attn_probs=True,
                                  return_softmax_lse=True)
    assert len(out3) == 3 and out3[2].shape == (0,)
    torch.testing.assert_close(out3[1], lse)


def test_qkvpacked_gradients(ref_kernels):
    """Gradients reach the packed tensor through the views (dqkv[:, :, i] = dq, dk, dv)."""
    import torch
    from cuflash.flash_attn import flash_attn_qkvpacked_func
    qkv = _cpu(2, 6, 3, 4, 8, grad=True)
    out = flash_attn_qkvpacked_func(qkv, causal=True, window_size=torch.tensor([3, 0]))
    dout = _cpu(2, 6, 4, 8, seed=5)
    out.backward(dout)
    ref = lambda q, k, v: ref_attention(q, k, v, True, window_size=(3, 0))
    want = _ref_grads(ref, dout, [qkv[:, :, i] for i in range(3)])
    for i, w in enumerate(want):
        torch.testing.assert_close(qkv.grad[:, :, i], w)
    assert [c[0] for c in ref_kernels] == ["attention", "backward"]
    assert ref_kernels[0][3]["window_size"] == (3, 0)


def test_varlen_kvpacked_gradients(ref_kernels):
    import torch
    from cuflash.flash_attn import flash_attn_varlen_kvpacked_func
    cu_q, cu_k = torch.tensor([0, 3, 3, 5], dtype=torch.int32), torch.tensor([0, 4, 6, 9], dtype=torch.int32)
    q, kv = _cpu(5, 4, 8, grad=True), _cpu(9, 2, 2, 8, seed=1, grad=True)
    out = flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 3, 4, causal=True)
    torch.testing.assert_close(out, ref_attention_varlen(q, kv[:, 0], kv[:, 1], cu_q, cu_k, causal=True)[0])
    out.sum().backward()
    assert q.grad.shape == q.shape and kv.grad.shape == kv.shape
    assert [c[0] for c in ref_kernels] == ["varlen", "varlen_backward"]


def test_compile_fullgraph(ref_kernels):
    """torch.compile traces through the drop-in (packed views, window, return_attn_probs)."""
    import torch
    from cuflash.flash_attn import flash_attn_qkvpacked_func

    def f(qkv):
        out, lse, _ = flash_attn_qkvpacked_func(qkv, 0.0, None, True, (3, -2), return_attn_probs=True)
        return out.square().sum() + lse.sum()

    qkv = _cpu(1, 6, 3, 2, 8, grad=True)
    torch._dynamo.reset()
    torch.compile(f, fullgraph=True, backend="aot_eager")(qkv).backward()
    got = qkv.grad.clone()
    qkv.grad = None
    f(qkv).backward()
    torch.testing.assert_close(got, qkv.grad)
    assert {c[3].get("window_size") for c in ref_kernels} == {(3, -1)}  # causal bounds the right


# ---------------------------------------------------------------------------------------------
# bert_padding

def _mask():
    import torch
    return torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 1]])


def test_unpad_pad_round_trip():
    import torch
    from cuflash.flash_attn.bert_padding import pad_input, unpad_input
    x, mask = _cpu(4, 5, 3, 2), _mask()
    x_u, indices, cu, max_seqlen, seqused = unpad_input(x, mask)
    assert x_u.shape == (mask.sum(), 3, 2) and indices.dtype == torch.int64
    assert cu.tolist() == [0, 3, 3, 8, 11] and cu.dtype == torch.int32
    assert max_seqlen == 5 and isinstance(max_seqlen, int)
    assert seqused.tolist() == [3, 0, 5, 3] and seqused.dtype == torch.int32
    torch.testing.assert_close(x_u, x.reshape(20, 3, 2)[mask.flatten().bool()])
    y = pad_input(x_u, indices, 4, 5)
    assert y.shape == x.shape
    torch.testing.assert_close(y, x * mask[:, :, None, None])
    # boolean masks and masks of other nonzero values give the same result
    assert unpad_input(x, mask.bool())[2].equal(cu)
    assert unpad_input(x, mask * 7)[1].equal(indices)


def test_unpad_unused_mask():
    import torch
    from cuflash.flash_attn.bert_padding import unpad_input
    x, mask = _cpu(4, 5, 3), _mask()
    unused = torch.zeros_like(mask)
    unused[0, 3] = unused[1, 0] = 1
    x_u, indices, cu, max_seqlen, seqused = unpad_input(x, mask, unused)
    assert cu.tolist() == [0, 4, 5, 10, 13] and max_seqlen == 5
    assert seqused.tolist() == [3, 0, 5, 3]  # the attention_mask tokens only
    assert indices[:5].tolist() == [0, 1, 2, 3, 5]


def test_padding_gradients():
    import torch
    from cuflash.flash_attn.bert_padding import pad_input, unpad_input
    x, mask = _cpu(4, 5, 3, grad=True), _mask()
    x_u, indices, *_ = unpad_input(x, mask)
    w = _cpu(*x_u.shape, seed=1)
    (x_u * w).sum().backward()
    torch.testing.assert_close(x.grad, pad_input(w, indices, 4, 5))
    assert x.grad[mask == 0].abs().sum() == 0

    h = _cpu(*x_u.shape, seed=2, grad=True)
    g = _cpu(4, 5, 3, seed=3)
    (pad_input(h, indices, 4, 5) * g).sum().backward()
    torch.testing.assert_close(h.grad, g.reshape(20, 3)[indices])


def test_index_helpers():
    import torch
    from cuflash.flash_attn.bert_padding import index_first_axis, index_put_first_axis
    x, idx = _cpu(6, 2, 3), torch.tensor([4, 0, 2])
    assert index_first_axis(x, idx).equal(x[idx])
    y = index_put_first_axis(x[:3], idx, 6)
    assert y.shape == (6, 2, 3) and y[idx].equal(x[:3]) and y[[1, 3, 5]].abs().sum() == 0


def test_unpad_concatenated_sequences():
    import torch
    from cuflash.flash_attn.bert_padding import unpad_input_for_concatenated_sequences
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    x = _cpu(3, 6, 4)
    x_u, indices, cu, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths)
    assert cu.tolist() == [0, 2, 5, 8, 10, 16] and cu.dtype == torch.int32 and max_seqlen == 6
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10] + list(range(12, 18))
    assert x_u.equal(x.reshape(18, 4)[indices])


# ---------------------------------------------------------------------------------------------
# GPU: the drop-in against the float64 reference

def _np(x):
    import ml_dtypes
    import torch
    a = x.detach().float().cpu().numpy()
    return a.astype(ml_dtypes.bfloat16 if x.dtype == torch.bfloat16 else np.float16)


def _gpu(rng, *shape, dtype="bfloat16", grad=False):
    import torch
    x = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to("cuda", getattr(torch, dtype))
    return x.requires_grad_(grad)


def _check_out(out, q, k, v, **kw):
    from cuflash.reference import check_close
    ok, err, bound = check_close(_np(out), _np(q), _np(k), _np(v), **kw)
    assert ok, f"max error {err:.3g} exceeds {bound:.3g} ({kw})"


def _check_grads(grads, dout, q, k, v, **kw):
    """flash-attn's rule for gradients: |g - ref64| <= 3 |ref_same - ref64| + 1e-4."""
    from cuflash.reference import attention_backward, max_abs_err
    args = [_np(x) for x in (dout, q, k, v)]
    ref64 = attention_backward(*args, **kw)
    same = attention_backward(*args, precision="same", **kw)
    for name, g, r, s in zip(("dq", "dk", "dv"), grads, ref64, same):
        err, bound = max_abs_err(_np(g), r), 3 * max_abs_err(s, r) + 1e-4
        assert err <= bound, f"{name}: {err:.3g} > {bound:.3g} ({kw})"


@requires_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("sq,sk,h,hk,d,causal", [(128, 128, 4, 4, 64, True), (77, 190, 8, 2, 128, False),
                                                 (190, 77, 4, 1, 96, True)])
def test_gpu_flash_attn_func(rng, dtype, sq, sk, h, hk, d, causal):
    from cuflash.flash_attn import flash_attn_func
    q, k, v = _gpu(rng, 2, sq, h, d, dtype=dtype, grad=True), _gpu(rng, 2, sk, hk, d, dtype=dtype, grad=True), \
        _gpu(rng, 2, sk, hk, d, dtype=dtype, grad=True)
    out, lse, s_dmask = flash_attn_func(q, k, v, causal=causal, window_size=(48, 16),
                                        return_attn_probs=True)
    _check_out(out, q, k, v, causal=causal, window_size=(48, 16))
    assert lse.shape == (2, h, sq) and s_dmask.numel() == 0
    dout = _gpu(rng, 2, sq, h, d, dtype=dtype)
    out.backward(dout)
    _check_grads((q.grad, k.grad, v.grad), dout, q, k, v, causal=causal, window_size=(48, 16))


@requires_gpu
def test_gpu_qkvpacked_backward(rng):
    import torch
    from cuflash.flash_attn import flash_attn_qkvpacked_func
    qkv = _gpu(rng, 2, 150, 3, 4, 64, grad=True)
    out = flash_attn_qkvpacked_func(qkv, causal=True, deterministic=True)
    q, k, v = (qkv[:, :, i] for i in range(3))
    _check_out(out, q, k, v, causal=True)
    dout = _gpu(rng, 2, 150, 4, 64)
    out.backward(dout)
    _check_grads([qkv.grad[:, :, i] for i in range(3)], dout, q, k, v, causal=True)
    first = qkv.grad.clone()
    qkv.grad = None
    flash_attn_qkvpacked_func(qkv, causal=True, deterministic=True).backward(dout)
    assert torch.equal(qkv.grad, first)  # deterministic backward: bitwise repeatable


@requires_gpu
def test_gpu_varlen_with_bert_padding(rng):
    """Padded batch -> unpad_input -> flash_attn_varlen_func -> pad_input, against the dense
    reference per sequence; gradients through the padding helpers."""
    import torch
    from cuflash.flash_attn import flash_attn_varlen_func
    from cuflash.flash_attn.bert_padding import pad_input, unpad_input
    from cuflash.reference import attention_varlen
    b, s, h, d = 3, 96, 4, 64
    lengths = torch.tensor([96, 1, 50])
    mask = (torch.arange(s)[None] < lengths[:, None]).cuda()
    x = _gpu(rng, b, s, 3, h, d, grad=True)
    x_u, indices, cu, max_s, _ = unpad_input(x, mask)
    q, k, v = x_u[:, 0], x_u[:, 1], x_u[:, 2]
    out_u = flash_attn_varlen_func(q, k, v, cu, cu, max_s, max_s, causal=True)
    ref64 = attention_varlen(_np(q), _np(k), _np(v), cu.cpu().numpy(), cu.cpu().numpy(), causal=True)
    same = attention_varlen(_np(q), _np(k), _np(v), cu.cpu().numpy(), cu.cpu().numpy(), causal=True,
                            precision="same")
    from cuflash.reference import max_abs_err
    assert max_abs_err(_np(out_u), ref64) <= 2 * max_abs_err(same, ref64) + 1e-5
    out = pad_input(out_u, indices, b, s)
    assert out.shape == (b, s, h, d) and out[~mask].abs().sum() == 0
    out.sum().backward()
    assert x.grad.shape == x.shape and x.grad[~mask].abs().sum() == 0
    assert torch.isfinite(x.grad).all() and x.grad[mask].abs().sum() > 0


@requires_gpu
def test_gpu_kvcache(rng):
    import torch
    from cuflash.flash_attn import flash_attn_with_kvcache
    b, cap, h, hk, d = 2, 256, 8, 2, 128
    q = _gpu(rng, b, 1, h, d)
    kc, vc = _gpu(rng, b, cap, hk, d), _gpu(rng, b, cap, hk, d)
    k, v = _gpu(rng, b, 1, hk, d), _gpu(rng, b, 1, hk, d)
    seqlens = torch.tensor([100, 255], dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=True,
                                       return_softmax_lse=True)
    assert lse.shape == (b, h, 1)
    for i, n in enumerate((101, 256)):
        assert torch.equal(kc[i, n - 1], k[i, 0]) and torch.equal(vc[i, n - 1], v[i, 0])
        _check_out(out[i:i + 1], q[i:i + 1], kc[i:i + 1, :n], vc[i:i + 1, :n], causal=True)


# ---------------------------------------------------------------------------------------------
# layers.rotary.apply_rotary_emb (flash-attn's, in PyTorch) against cuflash.reference.apply_rotary

def _angles(n, half, seed=4):
    import torch
    a = _cpu(n, half, seed=seed) * 3
    return torch.cos(a), torch.sin(a)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offsets", ["int", "tensor"])
def test_apply_rotary_emb_matches_reference(interleaved, offsets):
    import torch
    from cuflash import reference
    from cuflash.flash_attn.layers.rotary import apply_rotary_emb
    x = _cpu(3, 7, 2, 10)
    cos, sin = _angles(20, 3)  # rotary_dim 6 of 10
    off = 5 if offsets == "int" else torch.tensor([0, 13, 4], dtype=torch.int32)
    pos = np.arange(7)[None, :] + (np.full((3, 1), 5) if offsets == "int" else off.numpy()[:, None])
    want = reference.apply_rotary(x.numpy(), cos.numpy(), sin.numpy(), np.minimum(pos, 19), interleaved)
    want[pos >= 20] = x.numpy()[pos >= 20]  # positions past cos's rows are not rotated
    got = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=off)
    assert got.dtype == x.dtype and got.shape == x.shape
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)  # float32 arithmetic
    y = x.clone()
    assert apply_rotary_emb(y, cos, sin, interleaved=interleaved, inplace=True, seqlen_offsets=off) is y
    torch.testing.assert_close(y, got)


def test_apply_rotary_emb_varlen_and_gradient():
    import torch
    from cuflash.flash_attn.layers.rotary import apply_rotary_emb
    x = _cpu(2, 6, 3, 8)
    cos, sin = _angles(16, 4)  # rotary_dim 8: every feature
    off = torch.tensor([2, 9])
    dense = apply_rotary_emb(x, cos, sin, seqlen_offsets=off)
    cu = torch.tensor([0, 6, 12], dtype=torch.int32)
    packed = apply_rotary_emb(x.reshape(12, 3, 8), cos, sin, seqlen_offsets=off, cu_seqlens=cu, max_seqlen=6)
    torch.testing.assert_close(packed, dense.reshape(12, 3, 8))
    # a rotation: the gradient of <R x, g> is R^T g, the rotation by the negated angles
    xg = x.clone().requires_grad_()
    g = _cpu(2, 6, 3, 8, seed=5)
    (apply_rotary_emb(xg, cos, sin, seqlen_offsets=off) * g).sum().backward()
    torch.testing.assert_close(xg.grad, apply_rotary_emb(g, cos, -sin, seqlen_offsets=off), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["qkv5", "gqa4", "q_kv"])
@pytest.mark.parametrize("xpos", [False, True])
def test_rotary_embedding_module_and_in_place_rotations(layout, xpos):
    """flash-attn's RotaryEmbedding: tables in float32 of the positions times 1 / base **
    (2i / dim) (XPos: q's scaled by scale ** ((p - seqlen // 2) / scale_base), k's divided), q and
    k rotated in place by apply_rotary_emb_qkv_ / apply_rotary_emb_kv_ (v untouched), an int
    offset or (batch,) offsets with max_seqlen; gradients through the in-place rotation are those
    of the out-of-place one (the rotation back)."""
    import torch
    from cuflash.flash_attn.layers.rotary import RotaryEmbedding, apply_rotary_emb
    b, s, h, hk, d, dim = 2, 6, 4, 2, 16, 8
    rope = RotaryEmbedding(dim, base=500.0, interleaved=True, scale_base=64 if xpos else None)
    pos = torch.arange(20, dtype=torch.float32)
    ang = torch.outer(pos, 1.0 / 500.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    cos, sin, cos_k, sin_k = torch.cos(ang), torch.sin(ang), torch.cos(ang), torch.sin(ang)
    if xpos:
        scale = ((torch.arange(0, dim, 2) + 0.4 * dim) / (1.4 * dim))[None] ** ((pos - 20 // 2) / 64)[:, None]
        cos, sin, cos_k, sin_k = cos * scale, sin * scale, cos_k / scale, sin_k / scale
    off = torch.tensor([3, 11])
    rot = lambda x, c, s_: apply_rotary_emb(x, c, s_, interleaved=True, seqlen_offsets=off)  # noqa: E731
    if layout == "q_kv":
        q, kv = _cpu(b, s, h, d), _cpu(b, s, 2, hk, d, seed=1)
        want_q, want_k = rot(q, cos, sin), rot(kv[:, :, 0], cos_k, sin_k)
        qg, kvg = (x.clone().requires_grad_() for x in (q, kv))
        q2, kv2 = rope(qg * 1, kvg * 1, seqlen_offset=off, max_seqlen=20)
        torch.testing.assert_close(q2, want_q)
        torch.testing.assert_close(kv2[:, :, 0], want_k)
        torch.testing.assert_close(kv2[:, :, 1], kv[:, :, 1])
        g = _cpu(b, s, 2, hk, d, seed=3)
        (kv2 * g).sum().backward()
        torch.testing.assert_close(kvg.grad[:, :, 0], rot(g[:, :, 0], cos_k, -sin_k), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(kvg.grad[:, :, 1], g[:, :, 1])
        return
    if layout == "qkv5":
        qkv = _cpu(b, s, 3, h, d)
        parts, nq = (qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]), None
    else:
        qkv = _cpu(b, s, h + 2 * hk, d)
        parts, nq = (qkv[:, :, :h], qkv[:, :, h:h + hk], qkv[:, :, h + hk:]), h
    want = [rot(parts[0], cos, sin), rot(parts[1], cos_k, sin_k), parts[2]]
    x = qkv.clone().requires_grad_()
    y = x * 1
    assert rope(y, seqlen_offset=off, max_seqlen=20, num_heads_q=nq) is y
    got = (y[:, :, 0], y[:, :, 1], y[:, :, 2]) if nq is None else (y[:, :, :h], y[:, :, h:h + hk], y[:, :, h + hk:])
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w)
    g = _cpu(*y.shape, seed=4)
    (y * g).sum().backward()
    gp = (g[:, :, 0], g[:, :, 1], g[:, :, 2]) if nq is None else (g[:, :, :h], g[:, :, h:h + hk], g[:, :, h + hk:])
    xp = (x.grad[:, :, 0], x.grad[:, :, 1], x.grad[:, :, 2]) if nq is None else \
        (x.grad[:, :, :h], x.grad[:, :, h:h + hk], x.grad[:, :, h + hk:])
    for a, w in zip(xp, (rot(gp[0], cos, -sin), rot(gp[1], cos_k, -sin_k), gp[2])):
        torch.testing.assert_close(a, w, rtol=1e-6, atol=1e-6)
    # an int offset grows the tables; a later call with the same length reuses them
    rope2 = RotaryEmbedding(dim, base=500.0, interleaved=True, scale_base=64 if xpos else None, pos_idx_in_fp32=True)
    rope2(qkv.clone(), seqlen_offset=5, num_heads_q=nq)
    assert rope2._seq_len_cached == s + 5 and rope2._cos_cached.dtype == qkv.dtype


def test_rotary_qkv_refuses_bad_packing():
    from cuflash.flash_attn.layers.rotary import apply_rotary_emb_kv_, apply_rotary_emb_qkv_
    cos, sin = _angles(8, 4)
    with pytest.raises(ValueError, match="num_heads_q"):
        apply_rotary_emb_qkv_(_cpu(1, 4, 8, 16), cos, sin)
    with pytest.raises(ValueError, match="are not num_heads_q"):
        apply_rotary_emb_qkv_(_cpu(1, 4, 7, 16), cos, sin, num_heads_q=4)
    with pytest.raises(ValueError, match="kv must be"):
        apply_rotary_emb_kv_(_cpu(1, 4, 3, 2, 16), cos, sin)


def test_apply_rotary_emb_rejects_bad_tables():
    from cuflash.flash_attn.layers.rotary import apply_rotary_emb
    cos, sin = _angles(8, 6)
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rotary_emb(_cpu(1, 4, 1, 8), cos, sin)  # rotary_dim 12 > 8
    with pytest.raises(ValueError, match="exceeds the 8 rows"):
        apply_rotary_emb(_cpu(1, 4, 1, 16), cos, sin, seqlen_offsets=5)
    with pytest.raises(ValueError, match="one shape"):
        apply_rotary_emb(_cpu(1, 4, 1, 16), cos, sin[:, :2])


# ---------------------------------------------------------------------------------------------
# S_dmask's magnitudes (flash-attn's running-maximum convention), against the float64 reference

@pytest.mark.parametrize("sq,sk,causal,window,softcap,alibi", [
    (37, 150, True, (-1, -1), 0.0, None),
    (150, 37, True, (-1, -1), 0.0, "batch"),
    (64, 64, False, (20, 3), 0.0, "heads"),
    (50, 90, False, (-1, -1), 5.0, None),
    (33, 70, True, (10, -1), 0.0, None),
])
@pytest.mark.parametrize("block_n", [32, 64])
def test_s_dmask_magnitudes_match_reference(sq, sk, causal, window, softcap, alibi, block_n):
    import torch
    from cuflash import reference
    from cuflash.flash_attn.flash_attn_interface import _magnitudes, _s_dmask
    q, k = _cpu(2, sq, 4, 16, dtype="float32"), _cpu(2, sk, 2, 16, seed=1, dtype="float32")
    slopes = {None: None, "heads": torch.rand(4, generator=torch.Generator().manual_seed(2)),
              "batch": torch.rand(2, 4, generator=torch.Generator().manual_seed(3))}[alibi]
    kw = dict(causal=causal, softmax_scale=0.3, window_size=window, softcap=softcap)
    want = np.abs(reference.attention_probs(q.numpy(), k.numpy(), alibi_slopes=None if slopes is None
                                            else slopes.numpy(), block_n=block_n, **kw))
    got = _magnitudes(q, k, causal, 0.3, window, softcap, slopes, block_n)
    assert got.dtype == torch.float32 and got.shape == (2, 4, sq, sk)
    np.testing.assert_allclose(got.numpy(), want, rtol=2e-5, atol=1e-6)
    # negated where dropped; the varlen form (per-sequence slices) fills the same rows
    keep = torch.rand(2, 4, sq, sk, generator=torch.Generator().manual_seed(4)) > 0.3
    dense = _s_dmask(q, [(slice(None), q, k)], keep, causal, 0.3, window, softcap, slopes, block_n)
    per_seq = _s_dmask(q, [(slice(b, b + 1), q[b:b + 1], k[b:b + 1]) for b in range(2)], keep, causal, 0.3,
                       window, softcap, slopes, block_n)
    torch.testing.assert_close(dense, per_seq)
    assert torch.equal(dense >= 0, keep | (got == 0))


def test_version_and_the_triton_rotary_entry_point():
    """flash_attn.__version__ (version checks read it) and ops.triton.rotary.apply_rotary, with
    conjugate the rotation by the negative angles."""
    import torch
    import cuflash.flash_attn as fa
    from cuflash.flash_attn.layers.rotary import apply_rotary_emb
    from cuflash.flash_attn.ops.triton.rotary import apply_rotary
    assert fa.__version__.startswith("2.")
    x = _cpu(2, 5, 3, 8)
    cos, sin = _angles(9, 4)
    torch.testing.assert_close(apply_rotary(x, cos, sin, seqlen_offsets=2, interleaved=True),
                               apply_rotary_emb(x, cos, sin, interleaved=True, seqlen_offsets=2))
    back = apply_rotary(apply_rotary(x, cos, sin, seqlen_offsets=2), cos, sin, seqlen_offsets=2, conjugate=True)
    torch.testing.assert_close(back, x, rtol=1e-6, atol=1e-6)
