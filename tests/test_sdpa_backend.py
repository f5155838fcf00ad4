"""cuflash behind torch.nn.functional.scaled_dot_product_attention (cuflash.torch.sdpa).

CPU tests check which calls cuflash serves, the activation bookkeeping (the dispatcher's CUDA
kernels, SDPA's registry and backend order), and, with cuflash's kernels replaced by the float64
reference (``ref_kernels``), the layout and argument mapping: through the dispatcher (the CUDA
key reached by redispatch on CPU tensors) and through the aten ops' own autograd formula (the
same overrides registered for the CPU key). GPU tests run SDPA itself against PyTorch's kernels.
"""
import pytest

pytest.importorskip("torch", reason="needs PyTorch (optional dependency)")  # the cases below build tensors

from conftest import requires_gpu, requires_torch  # noqa: E402
from test_torch_integration import _cpu, ref_kernels  # noqa: E402,F401 (a fixture)

pytestmark = [requires_torch]

FWD = "_scaled_dot_product_flash_attention"
BWD = "_scaled_dot_product_flash_attention_backward"


@pytest.fixture
def sdpa(monkeypatch):
    """cuflash.torch.sdpa, inactive before and after the test."""
    import cuflash.torch.sdpa as s
    s.restore_sdpa()
    yield s
    s.restore_sdpa()


@pytest.fixture
def any_device(sdpa, monkeypatch):
    """CPU tensors pass the device check."""
    monkeypatch.setattr(sdpa, "_device_problem", lambda *xs: None)
    return sdpa


def _bhsd(b, h, s, d, dtype="bfloat16", seed=0, grad=False, contiguous=False):
    """(batch, nheads, seqlen, d) as SDPA gets it: a transposed view of (batch, seqlen, nheads, d)
    (the usual projection output), or a contiguous tensor."""
    x = _cpu(b, h, s, d, dtype=dtype, seed=seed) if contiguous else \
        _cpu(b, s, h, d, dtype=dtype, seed=seed).transpose(1, 2)
    return x.detach().requires_grad_(grad)


def _reference(q, k, v, causal, scale=None):
    """PyTorch's math SDPA in float64; causal aligned bottom-right (the flash ops' meaning)."""
    import warnings
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    mask = None
    if causal:
        with warnings.catch_warnings():  # seqlen_q > seqlen_k: rows without keys, handled here
            warnings.simplefilter("ignore")
            mask = causal_lower_right(q.shape[2], k.shape[2])._materialize(q.device)
        mask = mask | ~mask.any(-1, keepdim=True)  # rows that see no key: compared separately
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out, (q, k, v)


CASES = [  # b, h, hk, sq, sk, d, causal, contiguous
    (2, 4, 4, 7, 7, 16, True, False),
    (1, 6, 2, 5, 9, 8, False, True),     # GQA, cross lengths
    (2, 4, 1, 3, 8, 24, True, False),    # MQA, causal with seqlen_q < seqlen_k (bottom-right)
]


# ---------------------------------------------------------------------------------------------
# CPU: which calls cuflash serves

def _ok_args(**over):
    args = dict(query=_bhsd(1, 4, 5, 16), key=_bhsd(1, 2, 6, 16, seed=1), value=_bhsd(1, 2, 6, 16, seed=2),
                dropout_p=0.0, scale=None)
    args.update(over)
    return args


@pytest.mark.parametrize("over,why", [
    ({}, None),
    (dict(scale=0.3), None),
    (dict(dropout_p=0.1), "dropout"),
    (dict(query=_bhsd(1, 4, 5, 16, dtype="float32")), "dtypes"),
    (dict(query=_bhsd(1, 4, 5, 16, dtype="float16")), "dtypes"),
    (dict(query=_bhsd(1, 4, 5, 16)[0]), "4-dim"),
    (dict(value=_bhsd(1, 2, 6, 8)), "shapes"),
    (dict(query=_bhsd(1, 3, 5, 16)), "heads 3/2"),
    (dict(query=_bhsd(1, 4, 0, 16)), "seqlens 0/6"),
    (dict(query=_bhsd(1, 4, 5, 264)[..., :260], key=_bhsd(1, 2, 6, 260), value=_bhsd(1, 2, 6, 260)),
     "head dim 260"),
    (dict(key=_bhsd(1, 2, 6, 32)[..., ::2]), "last dim"),
    (dict(scale=0.0), "scale"),
    (dict(scale=-1.0), "scale"),
    (dict(scale=float("inf")), "scale"),
])
def test_unsupported(any_device, over, why):
    got = any_device._unsupported(**_ok_args(**over))
    assert (got is None) if why is None else (why in got), got


def test_device_check_rejects_cpu(sdpa):
    assert "CUDA" in sdpa._unsupported(**_ok_args())


def test_unsupported_backward(any_device):
    import torch
    q = _bhsd(1, 4, 5, 16)
    lse = torch.zeros(1, 4, 5)
    assert any_device._unsupported_backward(q, q, q, lse) is None
    assert "logsumexp" in any_device._unsupported_backward(q, q, q, lse.double())
    assert "logsumexp" in any_device._unsupported_backward(q, q, q, lse[..., :4])
    assert "unlike" in any_device._unsupported_backward(q.half(), q, q, lse)
    assert "last dim" in any_device._unsupported_backward(q, q, _bhsd(1, 4, 5, 32)[..., ::2], lse)


# ---------------------------------------------------------------------------------------------
# CPU: activation bookkeeping

def test_registered_as_cuflash(sdpa):
    import torch.nn.attention as att
    if not hasattr(att, "restore_flash_attention_impl"):
        pytest.skip("this PyTorch has no flash-attention registry with restore (PyTorch < 2.11)")
    assert "cuflash" in att.list_flash_attention_impls()
    att.activate_flash_attention_impl("cuflash")
    assert sdpa.sdpa_active() and att.current_flash_attention_impl() == "cuflash"
    att.restore_flash_attention_impl()
    assert not sdpa.sdpa_active() and att.current_flash_attention_impl() is None


def test_activate_restore_bookkeeping(sdpa):
    import torch
    from torch.library import _impls
    if torch.cuda.is_available():
        # PyTorch sets its backend order on its first SDPA choice in the process (cuDNN first on
        # sm_90 with a new cuDNN); activation makes that choice before it saves the order, so
        # make it here too, or this test passes only when an earlier one has.
        x = torch.empty(1, 1, 1, 8, dtype=torch.float16, device="cuda")
        torch._fused_sdp_choice(x, x, x)
    before = torch._C._get_sdp_priority_order()
    keys = {f"aten/{op}/CUDA" for op in (FWD, BWD)} | {f"aten/{FWD}/AutogradCUDA"}
    sdpa.activate_sdpa()
    assert not sdpa._active.dropout  # (PyTorch's dropout unless asked for)
    active = sdpa._active
    sdpa.activate_sdpa(dropout=True)  # again: still one override, cuflash's dropout asked for
    assert sdpa._active is active and active.dropout
    with pytest.raises(TypeError, match="dropout must be a bool, got str"):
        sdpa.activate_sdpa(dropout="yes")
    assert active.dropout
    sdpa.activate_sdpa()
    assert sdpa._active is active and not active.dropout
    assert sdpa.sdpa_active() and keys <= _impls
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{FWD}", "CUDA")
    order = torch._C._get_sdp_priority_order()
    assert order[0] == int(torch.nn.attention.SDPBackend.FLASH_ATTENTION) and sorted(order) == sorted(before)
    sdpa.restore_sdpa()
    sdpa.restore_sdpa()  # again: nothing to do
    assert not sdpa.sdpa_active() and not keys & _impls
    assert torch._C._get_sdp_priority_order() == before


def _cuda_keyset():
    import torch
    return torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)


def test_dispatcher_reaches_cuflash_only_while_active(any_device, ref_kernels):
    """The aten op's CUDA kernel (reached on CPU tensors by redispatching to the CUDA key) is
    cuflash's while active, and no longer cuflash's after restore."""
    import torch
    op = getattr(torch.ops.aten, FWD).default
    q, k, v = _bhsd(1, 2, 4, 8), _bhsd(1, 2, 4, 8, seed=1), _bhsd(1, 2, 4, 8, seed=2)
    any_device.activate_sdpa()
    out = op.redispatch(_cuda_keyset(), q, k, v, 0.0, True, scale=0.25)
    assert [c[:3] for c in ref_kernels] == [("attention", (1, 4, 2, 8), (1, 4, 2, 8))]
    torch.testing.assert_close(out[0].double(), _reference(q, k, v, True, 0.25)[0], atol=2e-2, rtol=0)
    any_device.restore_sdpa()
    with pytest.raises(Exception):  # PyTorch's kernel (or none, on a CPU build): not on CPU tensors
        op.redispatch(_cuda_keyset(), q, k, v, 0.0, True, scale=0.25)
    assert len(ref_kernels) == 1


def test_fallback_calls_pytorch_kernel(any_device, ref_kernels, monkeypatch):
    """Calls cuflash cannot serve go to the kernel that was there before, with the same
    arguments and dispatch keys."""
    import torch
    seen = []

    class Kernel:
        def __init__(self, name):
            self.name = name

        def call_boxed(self, keyset, *args, **kwargs):
            seen.append((self.name, keyset, args, kwargs))
            return "pytorch"

    any_device.activate_sdpa()
    kernels = {any_device._FWD: Kernel("fwd"), any_device._BWD: Kernel("bwd")}
    monkeypatch.setattr(any_device._active, "kernels", kernels)
    q = _bhsd(1, 2, 4, 8)
    fwd, bwd = getattr(torch.ops.aten, FWD).default, getattr(torch.ops.aten, BWD).default
    ks = _cuda_keyset()
    assert any_device._forward_impl(ks, q, q, q, 0.25, True, scale=0.5) == "pytorch"
    assert any_device._forward_impl(ks, q, q, q, 0.0, False, True) == "pytorch"
    assert any_device._forward_impl(ks, q.float(), q.float(), q.float()) == "pytorch"
    lse = torch.zeros(1, 2, 4)
    assert any_device._backward_impl(ks, q, q, q, q, q, lse, None, None, 4, 4, 0.25, True, lse, lse,
                                     scale=0.5) == "pytorch"
    assert [s[0] for s in seen] == ["fwd", "fwd", "fwd", "bwd"] and not ref_kernels
    assert seen[0][1:] == (ks, (q, q, q, 0.25, True, False), dict(scale=0.5))
    assert seen[3][2][10:12] == (0.25, True) and seen[3][3] == dict(scale=0.5)
    with pytest.raises(Exception):  # through the dispatcher too (the real op checks the result)
        fwd.redispatch(ks, q, q, q, 0.25, True)
    monkeypatch.setattr(any_device._active, "kernels", {})
    with pytest.raises(NotImplementedError, match="dropout_p=0.25"):
        bwd.redispatch(ks, q, q, q, q, q, lse, None, None, 4, 4, 0.25, True, lse, lse)


def test_pytorch_kernel_takes_undefined_tensors():
    """The fallback hands PyTorch's kernel the backward's arguments as it got them: the flash
    forward returns no cum_seq tensors (None), and call_boxed passes None on as undefined."""
    import torch
    seen = []
    lib = torch.library.Library("aten", "IMPL", "CPU")
    try:
        lib.impl(BWD, lambda ks, *a, **kw: seen.append((a, kw)) or a[1:4], "CPU", with_keyset=True)
        kernel = torch.library.get_kernel(f"aten::{BWD}", "CPU")
        q, lse = _bhsd(1, 2, 4, 8), torch.zeros(1, 2, 4)
        ks = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
        res = kernel.call_boxed(ks, q, q, q, q, q, lse, None, None, 4, 4, 0.25, True, lse, lse, scale=0.5)
    finally:
        lib._destroy()
    (args, kwargs), = seen
    assert args[6] is None and args[7] is None and args[10:12] == (0.25, True) and kwargs == dict(scale=0.5)
    assert all(r is q for r in res)


# ---------------------------------------------------------------------------------------------
# CPU: the mapping onto cuflash's calls

@pytest.mark.parametrize("b,h,hk,sq,sk,d,causal,contiguous", CASES + [(1, 2, 2, 6, 4, 8, True, True)])
def test_forward_mapping(any_device, ref_kernels, b, h, hk, sq, sk, d, causal, contiguous):
    import torch
    q = _bhsd(b, h, sq, d, contiguous=contiguous)
    k, v = (_bhsd(b, hk, sk, d, seed=i, contiguous=contiguous) for i in (1, 2))
    res = any_device._forward(q, k, v, causal, None)
    out, lse, cq, ck, max_q, max_k, rng, unused, debug = res
    assert ref_kernels == [("attention", (b, sq, h, d), (b, sk, hk, d), dict(causal=causal))]
    assert out.shape == q.shape and out.stride() == torch.empty_like(q).stride() and out.dtype == q.dtype
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    assert (cq, ck, max_q, max_k) == (None, None, sq, sk)
    assert (rng.shape, rng.dtype, unused.shape, unused.dtype) == ((2,), torch.uint64, (), torch.uint64)
    assert debug.shape == (0,) and debug.dtype == q.dtype
    want, _ = _reference(q, k, v, causal)
    seen = torch.ones(sq, dtype=torch.bool) if not causal else torch.arange(sq) + sk - sq >= 0
    torch.testing.assert_close(out.double()[:, :, seen], want[:, :, seen], atol=2e-2, rtol=0)
    assert (out[:, :, ~seen] == 0).all() and (lse[:, :, ~seen] == float("inf")).all()


@pytest.mark.parametrize("b,h,hk,sq,sk,d,causal,contiguous", CASES)
def test_backward_mapping(any_device, ref_kernels, b, h, hk, sq, sk, d, causal, contiguous):
    import torch
    q = _bhsd(b, h, sq, d, contiguous=contiguous)
    k, v = (_bhsd(b, hk, sk, d, seed=i, contiguous=contiguous) for i in (1, 2))
    out, lse = any_device._forward(q, k, v, causal, 0.3)[:2]
    dout = _cpu(b, h, sq, d, dtype="bfloat16", seed=3)
    grads = any_device._backward(dout, q, k, v, out, lse, causal, 0.3)
    assert ref_kernels[-1][:4] == ("backward", (b, sq, h, d), (b, sk, hk, d), dict(causal=causal))
    want, leaves = _reference(q, k, v, causal, 0.3)
    torch.autograd.backward(want, dout.double())
    for g, x, leaf in zip(grads, (q, k, v), leaves):
        assert g.shape == x.shape and g.stride() == torch.empty_like(x).stride() and g.dtype == x.dtype
        torch.testing.assert_close(g.double(), leaf.grad, atol=3e-2, rtol=0)


def test_backward_copies_expanded_grad(any_device, ref_kernels):
    """An expanded output gradient (stride 0 in the last dim) is copied, as the custom op does."""
    import torch
    q = _bhsd(1, 2, 4, 8)
    out, lse = any_device._forward(q, q, q, False, None)[:2]
    ones = torch.ones((), dtype=q.dtype).expand(q.shape)
    grads = any_device._backward(ones, q, q, q, out, lse, False, None)
    assert all(torch.isfinite(g).all() for g in grads)


# ---------------------------------------------------------------------------------------------
# CPU: the flash ops of varlen_attn and nested tensors (aten::_flash_attention_forward/_backward)

VFWD, VBWD = "_flash_attention_forward", "_flash_attention_backward"


def _packed(lens, h, d, seed):
    import torch
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return _cpu(sum(lens), h, d, dtype="bfloat16", seed=seed), cu


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("causal,window", [(False, (None, None)), (True, (None, None)), (False, (3, 1))])
def test_flash_ops_mapping(any_device, ref_kernels, varlen, causal, window):
    """The flash ops on (batch, seqlen, nheads, d) or packed tensors reach cuflash's attention
    (attention_varlen with cum_seq_q / cum_seq_k) and its backward while active, through the
    dispatcher's CUDA key, with the scale, the window and bottom-right causal masks; the LSE is
    (batch, nheads, seqlen_q), or (nheads, total_q) packed, as PyTorch's kernel gives it."""
    import torch
    any_device.activate_sdpa()
    fwd, bwd = getattr(torch.ops.aten, VFWD).default, getattr(torch.ops.aten, VBWD).default
    kw = dict(scale=0.3, window_size_left=window[0], window_size_right=window[1])
    left, right = (-1 if w is None else w for w in window)
    if varlen:
        (q, cu_q), (k, cu_k), (v, _) = _packed([5, 0, 7], 4, 16, 0), _packed([6, 3, 9], 2, 16, 1), \
            _packed([6, 3, 9], 2, 16, 2)
        args = (q, k, v, cu_q, cu_k, 7, 9)
        lse_shape = (4, 12)
    else:
        q, k, v = _cpu(2, 5, 4, 16, dtype="bfloat16"), _cpu(2, 9, 2, 16, dtype="bfloat16", seed=1), \
            _cpu(2, 9, 2, 16, dtype="bfloat16", seed=2)
        args, lse_shape = (q, k, v, None, None, 5, 9), (2, 4, 5)
    out, lse, rng, unused, debug = fwd.redispatch(_cuda_keyset(), *args, 0.0, causal, False, **kw)
    name = "varlen" if varlen else "attention"
    assert ref_kernels[-1][:3] == (name, tuple(q.shape), tuple(k.shape))
    assert ref_kernels[-1][3]["causal"] == causal and ref_kernels[-1][3].get("window_size", (-1, -1)) == (left, right)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == lse_shape and lse.dtype == torch.float32
    assert (rng.shape, rng.dtype, unused.shape, debug.shape) == ((2,), torch.uint64, (), (0,))
    import cuflash  # (its kernels are the reference here: the same call, made directly)
    opts = dict(causal=causal, softmax_scale=0.3, window_size=(left, right), return_lse=True)
    want = cuflash.attention_varlen(*args, **opts) if varlen else cuflash.attention(q, k, v, **opts)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    dout = torch.ones_like(q)
    grads = bwd.redispatch(_cuda_keyset(), dout, q, k, v, out, lse, *args[3:], 0.0, causal, rng, unused, **kw)
    assert ref_kernels[-1][:3] == ("varlen_backward" if varlen else "backward", tuple(q.shape), tuple(k.shape))
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert all(g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in grads)


def test_flash_ops_fallback(any_device, ref_kernels, monkeypatch):
    """Flash-op calls cuflash does not take (dropout, the debug mask, seqused_k, ALiBi, a block
    table or any other keyword argument given, cum_seq for one side only, other dtypes) go to
    PyTorch's kernel with their arguments as given."""
    import torch
    seen = []

    class Kernel:
        def __init__(self, name):
            self.name = name

        def call_boxed(self, keyset, *args, **kwargs):
            seen.append((self.name, args, kwargs))
            return "pytorch"

    any_device.activate_sdpa()
    monkeypatch.setattr(any_device._active, "kernels", {any_device._VFWD: Kernel("fwd"), any_device._VBWD: Kernel("bwd")})
    ks = _cuda_keyset()
    q = _cpu(1, 4, 2, 8, dtype="bfloat16")
    (p, cu) = _packed([4], 2, 8, 0)
    fwd = any_device._flash_forward_impl
    assert fwd(ks, q, q, q, None, None, 4, 4, 0.1, True, False) == "pytorch"
    assert fwd(ks, q, q, q, None, None, 4, 4, 0.0, True, True) == "pytorch"
    assert fwd(ks, p, p, p, cu, cu, 4, 4, 0.0, True, False, seqused_k=cu[1:]) == "pytorch"
    assert fwd(ks, q, q, q, None, None, 4, 4, 0.0, True, False, alibi_slopes=torch.ones(2)) == "pytorch"
    assert fwd(ks, p, p, p, cu, cu, 4, 4, 0.0, True, False, block_table=cu, num_splits=1) == "pytorch"
    assert fwd(ks, p, p, p, cu, None, 4, 4, 0.0, True, False) == "pytorch"
    assert fwd(ks, q.float(), q.float(), q.float(), None, None, 4, 4, 0.0, True, False) == "pytorch"
    lse = torch.zeros(1, 2, 4)
    assert any_device._flash_backward_impl(ks, q, q, q, q, q, lse, None, None, 4, 4, 0.1, True, lse, lse,
                                           scale=0.5) == "pytorch"
    assert any_device._flash_backward_impl(ks, q, q, q, q, q, lse.double(), None, None, 4, 4, 0.0, True, lse, lse,
                                           scale=0.5) == "pytorch"
    assert [s[0] for s in seen] == ["fwd"] * 7 + ["bwd"] * 2 and not ref_kernels
    assert seen[0][1] == (q, q, q, None, None, 4, 4, 0.1, True, False) and seen[0][2] == {}
    assert seen[2][1][3] is cu and seen[2][2]["seqused_k"].tolist() == [4]
    assert seen[7][1][10:12] == (0.1, True) and seen[7][2] == dict(scale=0.5)
    # (a negative window edge is unbounded, as in PyTorch's kernel)
    assert any_device._window_of(dict(window_size_left=-5, window_size_right=None)) == (-1, -1)


@pytest.fixture
def cpu_overrides(any_device):
    """The CUDA overrides also registered for the CPU key (where these aten ops have no kernel),
    so the ops run on CPU tensors under autograd and torch.compile."""
    import torch
    lib = torch.library.Library("aten", "IMPL", "CPU")
    lib.impl(FWD, any_device._forward_impl, "CPU", with_keyset=True)
    lib.impl(BWD, any_device._backward_impl, "CPU", with_keyset=True)
    yield any_device
    lib._destroy()


@pytest.fixture
def cpu_autograd(cpu_overrides, monkeypatch):
    """The forward's autograd override also registered for the CPU key, with PyTorch's CPU
    autograd kernel as its fallback, and CPU tensors taken for real CUDA ones (ops._route)."""
    import types
    import torch
    from cuflash.torch import ops
    s = cpu_overrides
    monkeypatch.setattr(s, "_active", types.SimpleNamespace(
        autograd=torch.library.get_kernel(f"aten::{FWD}", "AutogradCPU"), kernels={}, remove=lambda: None,
        dropout=False))

    def route(q, k, v):
        if type(q) is not torch.Tensor or torch.compiler.is_compiling():
            return "op"
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        return "autograd" if grad else "direct"

    monkeypatch.setattr(ops, "_route", route)
    s._served.clear()
    lib = torch.library.Library("aten", "IMPL", "AutogradCPU")
    lib.impl(FWD, s._autograd_impl, "AutogradCPU", with_keyset=True)
    yield s
    lib._destroy()
    s._served.clear()


def _grad_nodes(t):
    """The names of the autograd nodes behind t."""
    seen, todo = [], [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and type(node).__name__ not in seen:
            seen.append(type(node).__name__)
            todo += [n for n, _ in node.next_functions]
    return seen


def test_eager_autograd_runs_cuflash_function(cpu_autograd, ref_kernels, monkeypatch):
    """An eager forward that needs gradients runs cuflash's eager Function (its backward node,
    not the aten op's), checked once per layout; gradients agree with float64 autograd."""
    import torch
    checks = []
    unsupported = cpu_autograd._unsupported
    monkeypatch.setattr(cpu_autograd, "_unsupported", lambda *a: checks.append(1) or unsupported(*a))
    b, h, hk, sq, sk, d = 2, 4, 2, 5, 7, 16
    q = _bhsd(b, h, sq, d, grad=True)
    k, v = _bhsd(b, hk, sk, d, seed=1, grad=True), _bhsd(b, hk, sk, d, seed=2, grad=True)
    placeholders = []
    for _ in range(2):
        for x in (q, k, v):
            x.grad = None
        res = getattr(torch.ops.aten, FWD)(q, k, v, is_causal=True, scale=0.4)
        nodes = _grad_nodes(res[0])
        assert "_PreparedAttentionBackward" in nodes and not any("FlashAttention" in n for n in nodes), nodes
        assert res[0].shape == q.shape and res[1].shape == (b, h, sq) and res[4:6] == (sq, sk)
        placeholders.append(res[6:])
        assert res[0].stride() == torch.empty_like(q).stride()  # (laid out as query, as PyTorch's kernel does)
        grads = torch.autograd.grad(res[0].float().sin().sum(), (q, k, v))
        for x, g in zip((q, k, v), grads):
            assert g.stride() == torch.empty_like(x).stride()  # (as its input, as PyTorch's kernel does)
            x.grad = g
    assert [c[0] for c in ref_kernels] == ["attention", "backward"] * 2 and len(checks) == 1
    # rng_state, unused and the debug mask (never read without dropout): one set, kept
    assert all(x is y for x, y in zip(*placeholders)) and placeholders[0][0].shape == (2,)
    want, leaves = _reference(q, k, v, True, 0.4)
    want.sin().sum().backward()
    for x, leaf in zip((q, k, v), leaves):
        torch.testing.assert_close(x.grad.double(), leaf.grad, atol=5e-2, rtol=0)


def test_eager_repeat_path_plumbing(cpu_autograd, ref_kernels):
    """The repeat path of the eager Function on SDPA's tensors: the prepared launches get SDPA's
    tensors as they are, with an output and gradients the Function allocated like q, k and v
    (here batch-1 chunks of a longer sequence, whose batch stride is not the contiguous one), and
    the Function returns those very tensors. The prepared launches are stand-ins recording what
    they were given."""
    import torch
    full = [_cpu(1, 12, 2, 8, dtype="bfloat16", seed=i) for i in range(3)]  # (batch, seqlen, nheads, d)
    q, k, v = (x[:, 6:].transpose(1, 2).detach().requires_grad_() for x in full)
    op = getattr(torch.ops.aten, FWD)
    out = op(q, k, v, is_causal=True)[0]  # the first call (the general path) makes the _Prepared
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))  # (an output gradient laid out as out)
    p, = [x for x in cpu_autograd._served.values() if x is not None]
    seen = {}

    def fwd(*args):
        seen["fwd"] = args
        return args[3].fill_(1.0), torch.zeros(q.shape[:3])

    def bwd(*args):
        seen["bwd"] = args
        return tuple(g.fill_(2.0) for g in args[6:9])
    def same(a, b):  # (saved tensors come back as other Python objects of the same memory)
        return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
    p.fwd, p.bwd = fwd, bwd
    out = op(q, k, v, is_causal=True)[0]
    assert all(map(same, seen["fwd"][:3], (q, k, v))) and out is seen["fwd"][3]
    assert out.stride() == torch.empty_like(q).stride() and bool((out == 1).all())
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert all(map(same, seen["bwd"][1:5], (q, k, v, out)))
    for x, g, given in zip((q, k, v), grads, seen["bwd"][6:9]):
        assert g is given and g.stride() == torch.empty_like(x).stride() and bool((g == 2).all())


def test_forward_in_cpp_only_for_plain_autograd(cpu_autograd, ref_kernels, monkeypatch):
    """The autograd kernel tries node.cpp's fast_forward (a stand-in here) first, and not under
    forward-mode AD, a __torch_dispatch__ mode, compiled autograd or with dropout; where it
    answers None the Python path serves the call."""
    import sys
    import types
    import torch
    from torch.autograd import forward_ad
    from torch.utils._python_dispatch import TorchDispatchMode
    q, k, v = (_bhsd(1, 2, 5, 8, seed=i, grad=True) for i in range(3))
    op = getattr(torch.ops.aten, FWD)
    calls, answer = [], []

    def fast(query, key, value, is_causal, scale):
        calls.append((query, is_causal, scale))
        return answer[0] if answer else None
    monkeypatch.setattr(cpu_autograd, "_fast", fast)
    ref = op(q, k, v, is_causal=True)[0]  # None from the stand-in: the Python path
    assert len(calls) == 1 and calls[0][0] is q and calls[0][1:] == (True, None)
    answer.append((torch.full_like(q, 3.0), torch.zeros(1, 2, 5)))
    res = op(q, k, v, is_causal=True, scale=0.5)
    assert len(calls) == 2 and calls[1][2] == 0.5 and res[0] is answer[0][0] and res[1] is answer[0][1]
    assert tuple(res[4:6]) == (5, 5)

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with forward_ad.dual_level():
        op(q, k, v, is_causal=True)
    with Mode():
        op(q, k, v, is_causal=True)
    monkeypatch.setitem(sys.modules, "torch._dynamo.compiled_autograd",
                        types.SimpleNamespace(compiled_autograd_enabled=True))
    op(q, k, v, is_causal=True)
    monkeypatch.delitem(sys.modules, "torch._dynamo.compiled_autograd")
    with pytest.raises(NotImplementedError):  # (dropout_p=1: PyTorch's kernels, none on CPU here)
        op(q, k, v, 1.0, is_causal=True)
    assert len(calls) == 2
    assert torch.equal(op(q, k, v, is_causal=True)[0], answer[0][0]) and len(calls) == 3
    assert ref.shape == q.shape


def test_double_backward_raises(cpu_autograd, ref_kernels):
    """Gradients taken with create_graph=True work; differentiating them again raises, as through
    PyTorch's own flash backward (cuflash's backward has no derivative), not silently zero."""
    import torch
    q = _bhsd(1, 2, 5, 8, grad=True)
    k, v = _bhsd(1, 2, 5, 8, seed=1, grad=True), _bhsd(1, 2, 5, 8, seed=2, grad=True)
    out = getattr(torch.ops.aten, FWD)(q, k, v, is_causal=True)[0]
    dq, = torch.autograd.grad(out.float().square().sum(), q, create_graph=True)
    assert dq.requires_grad and torch.isfinite(dq).all()
    with pytest.raises(RuntimeError, match="has no derivative"):
        torch.autograd.grad(dq.float().square().sum() + q.float().sum(), q)


def test_autograd_falls_back_to_pytorch(cpu_autograd, ref_kernels, monkeypatch):
    """Calls without gradients, with dropout, the debug mask or operands cuflash does not serve
    take PyTorch's autograd kernel, with the same arguments and dispatch keys."""
    import torch
    seen = []

    class Kernel:
        def call_boxed(self, keyset, *args, **kwargs):
            seen.append((args, kwargs))
            return "pytorch"

    monkeypatch.setattr(cpu_autograd._active, "autograd", Kernel())
    q = _bhsd(1, 2, 4, 8, grad=True)
    ks = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradCPU)
    impl = cpu_autograd._autograd_impl
    with torch.no_grad():
        assert impl(ks, q, q, q, 0.0, True) == "pytorch"
    assert impl(ks, q, q, q, 1.0, True, scale=0.5) == "pytorch"  # (dropout_p cuflash refuses)
    assert impl(ks, q, q, q, 0.0, False, True) == "pytorch"
    assert impl(ks, q.float(), q.float(), q.float()) == "pytorch"
    assert impl(ks, q, q, q, 0.0, False, scale=-1.0) == "pytorch"
    c = _bhsd(1, 2, 4, 8, grad=True, contiguous=True)  # (its output would not be laid out as PyTorch's)
    assert impl(ks, c, c, c, 0.0, True) == "pytorch"
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):  # (a FLOP counter, selective checkpointing: they see the aten ops)
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode():
        assert impl(ks, q, q, q, 0.0, True) == "pytorch"
    assert seen[1] == ((q, q, q, 1.0, True, False), dict(scale=0.5)) and len(seen) == 7 and not ref_kernels


@pytest.fixture
def ref_dropout(monkeypatch):
    """cuflash's forward and backward replaced by cuflash.reference (float64, dropout included) on
    CPU tensors, and the default CUDA generator's (seed, offset) by (5, 7) (ops._dropout_state);
    records each kernel call's keywords and each generator draw."""
    import sys
    import types
    import torch
    import cuflash
    from cuflash import reference
    from cuflash.torch import ops
    calls, draws = [], []

    def np64(x):
        return x.detach().double().numpy()

    def attention(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, out=None, **feat):
        calls.append(("attention", feat))
        o, lse = reference.attention(np64(q), np64(k), np64(v), causal=causal, softmax_scale=softmax_scale,
                                     return_lse=True, **feat)
        o = torch.from_numpy(o).to(q.dtype)
        o = out.copy_(o) if out is not None else o.contiguous()
        return (o, torch.from_numpy(lse).float()) if return_lse else o

    def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, deterministic=False,
                           dq=None, dk=None, dv=None, **feat):
        calls.append(("backward", feat))
        g = reference.attention_backward(np64(dout), np64(q), np64(k), np64(v), causal=causal,
                                         softmax_scale=softmax_scale, **feat)
        return tuple(torch.from_numpy(x).to(y.dtype) if buf is None else buf.copy_(torch.from_numpy(x))
                     for buf, x, y in zip((dq, dk, dv), g, (q, k, v)))

    def dropout_state(dropout_p, seed, offset, device, batch, nheads):
        draws.append((dropout_p, seed, offset, batch, nheads))
        return dropout_p, 5, 7

    bwd = types.ModuleType("cuflash.backward")
    bwd.attention_backward = attention_backward
    bwd._repeats, bwd._signature = {}, lambda *args: None
    monkeypatch.setattr(cuflash, "attention", attention)
    import cuflash.backward  # noqa: F401  the real module first: undoing the patch restores it
    monkeypatch.setattr(cuflash, "backward", bwd)
    monkeypatch.setitem(sys.modules, "cuflash.backward", bwd)
    monkeypatch.setattr(ops, "_dropout_state", dropout_state)
    return calls, draws


@pytest.fixture
def cpu_dropout(cpu_autograd, ref_dropout, monkeypatch):
    """cpu_autograd with cuflash's dropout asked for (activate_sdpa(dropout=True))."""
    monkeypatch.setattr(cpu_autograd._active, "dropout", True)
    return ref_dropout


def test_eager_dropout_runs_cuflash(cpu_autograd, cpu_dropout):
    """An eager call with dropout that needs gradients runs cuflash's dropout through cuflash's
    eager Function, whose backward gets the forward's seed and offset; the call draws (seed,
    offset) from the generator once, for its batch and query heads.
    Output and gradients are the reference's with that mask; the output is laid out as SDPA's
    (a transposed view of (batch, seqlen, nheads, d))."""
    import numpy as np
    import torch
    from cuflash import reference
    calls, draws = cpu_dropout
    b, h, hk, sq, sk, d, p = 2, 4, 2, 6, 9, 8, 0.3
    q = _bhsd(b, h, sq, d, grad=True)
    k, v = _bhsd(b, hk, sk, d, seed=1, grad=True), _bhsd(b, hk, sk, d, seed=2, grad=True)
    dout = _bhsd(b, h, sq, d, seed=3)
    op = getattr(torch.ops.aten, FWD)
    res = op(q, k, v, p, is_causal=True, scale=0.4)
    nodes = _grad_nodes(res[0])
    assert "_EagerAttentionBackward" in nodes and not any("FlashAttention" in n for n in nodes), nodes
    assert res[0].shape == q.shape and res[0].transpose(1, 2).is_contiguous() and res[1].shape == (b, h, sq)
    grads = torch.autograd.grad(res[0], (q, k, v), dout)
    assert draws == [(p, None, None, b, h)]
    dropout = dict(dropout_p=p, seed=5, offset=7)
    assert [c for c in calls] == [("attention", dropout), ("backward", dropout)]
    args = [x.detach().transpose(1, 2).double().numpy() for x in (q, k, v)]
    kw = dict(causal=True, softmax_scale=0.4, **dropout)
    want = reference.attention(*args, **kw)
    np.testing.assert_allclose(res[0].detach().transpose(1, 2).double().numpy(), want, atol=2e-2)
    want = reference.attention_backward(dout.transpose(1, 2).double().numpy(), *args, **kw)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g.transpose(1, 2).double().numpy(), w, atol=5e-2)
    out = op(q, k, v, p, is_causal=True, scale=0.4)[0]
    assert calls[-1] == ("attention", dropout) and len(calls) == 3 and len(draws) == 2
    assert torch.equal(out, res[0])
    assert not reference.dropout_keep_mask(5, 7, 0, 0, h, range(sq), range(sk), p).all()  # (some dropped)


def test_dropout_left_to_pytorch(cpu_autograd, cpu_dropout, monkeypatch):
    """Calls with dropout cuflash leaves to PyTorch's autograd kernel: all unless activation asked
    for cuflash's dropout, and then those without gradients (a compiled graph's forward runs so,
    and hands its rng_state to PyTorch's backward), a dropout_p cuflash refuses, under a CUDA
    graph capture (PyTorch's kernels draw a new mask per replay), a __torch_dispatch__ mode or
    forward-mode AD, on contiguous (batch, nheads, seqlen, d) operands, and inside a backward
    without saved-tensor hooks (a reentrant checkpoint's recompute, whose forward ran without
    gradients) though not with them (a non-reentrant one's); none of them draws from the
    generator."""
    import torch
    from torch.autograd import forward_ad
    from torch.utils._python_dispatch import TorchDispatchMode
    calls, draws = cpu_dropout
    seen = []

    class Kernel:
        def call_boxed(self, keyset, *args, **kwargs):
            seen.append(args[3])
            return "pytorch"

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(cpu_autograd._active, "autograd", Kernel())
    q = _bhsd(1, 2, 4, 8, grad=True)
    ks = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradCPU)
    impl = cpu_autograd._autograd_impl
    assert impl(ks, q, q, q, 1.0, True) == "pytorch"
    monkeypatch.setattr(cpu_autograd._active, "dropout", False)  # (not asked for: the default)
    assert impl(ks, q, q, q, 0.01, True) == "pytorch"
    monkeypatch.setattr(cpu_autograd._active, "dropout", True)
    with torch.no_grad():
        assert impl(ks, q, q, q, 0.05, True) == "pytorch"
    assert impl(ks, *(x.detach() for x in (q, q, q)), 0.06, True) == "pytorch"
    with Mode():
        assert impl(ks, q, q, q, 0.1, True) == "pytorch"
    with forward_ad.dual_level():
        assert impl(ks, q, q, q, 0.2, True) == "pytorch"
    assert impl(ks, q, q, q, 0.3, True, True) == "pytorch"  # (return_debug_mask)
    c = _bhsd(1, 2, 4, 8, grad=True, contiguous=True)  # (its output would not be laid out as PyTorch's)
    assert impl(ks, c, c, c, 0.35, True) == "pytorch"
    served = []

    class Recompute(torch.autograd.Function):  # (a checkpoint's recompute runs inside a backward)
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            with torch.enable_grad():
                served.append(impl(ks, q, q, q, 0.36, True))  # reentrant: no saved-tensor hooks
                with torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x):  # non-reentrant
                    served.append(impl(ks, q, q, q, 0.37, True)[0].shape)
            return g

    Recompute.apply(q.detach().requires_grad_()).sum().backward()
    assert served == ["pytorch", q.shape] and len(draws) == 1
    draws.clear()
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert impl(ks, q, q, q, 0.4, True) == "pytorch"
    assert seen == [1.0, 0.01, 0.05, 0.06, 0.1, 0.2, 0.3, 0.35, 0.36, 0.4] and not draws


def test_backward_op_refuses_cuflash_dropout_state(any_device, monkeypatch):
    """The flash backward op called with dropout on the rng_state of a forward cuflash served (a
    direct call of the ops; autograd never does this) raises before any work: PyTorch's backward
    would apply another mask."""
    import torch
    monkeypatch.setattr(any_device, "_placeholders", {})
    q = _bhsd(1, 2, 4, 8)
    seed, offset, _ = any_device._held_placeholders(q)
    lse = torch.zeros(1, 2, 4)
    ks = _cuda_keyset()
    with pytest.raises(ValueError, match="philox_seed: this rng_state comes from a forward that cuflash served"):
        any_device._backward_impl(ks, q, q, q, q, q, lse, None, None, 4, 4, 0.1, True, seed, offset)


# (eager calls with the autograd override: test_eager_autograd_runs_cuflash_function)
@pytest.mark.parametrize("compiled, autograd_override", [(False, False), (True, False), (True, True)])
def test_autograd_formula_plumbing(cpu_overrides, ref_kernels, request, compiled, autograd_override):
    """The aten op's derivative (the one SDPA's flash path uses) feeds cuflash's backward with
    cuflash's forward results; eager and compiled (aot_eager: fake tensors from the op's meta
    function, then the real kernels) agree with float64 autograd; under torch.compile the
    autograd override hands the call to PyTorch's autograd kernel (eager: test above)."""
    import torch
    if autograd_override:
        request.getfixturevalue("cpu_autograd")
    b, h, hk, sq, sk, d = 2, 4, 2, 6, 6, 16
    q = _bhsd(b, h, sq, d, grad=True)
    k, v = _bhsd(b, hk, sk, d, seed=1, grad=True), _bhsd(b, hk, sk, d, seed=2, grad=True)

    def f(q, k, v):
        return getattr(torch.ops.aten, FWD)(q, k, v, is_causal=True, scale=0.4)[0].float().sin().sum()

    if compiled:
        torch._dynamo.reset()
        f = torch.compile(f, fullgraph=True, backend="aot_eager")
    f(q, k, v).backward()
    assert [c[0] for c in ref_kernels] == ["attention", "backward"]
    want, leaves = _reference(q, k, v, True, 0.4)
    want.sin().sum().backward()
    for x, leaf in zip((q, k, v), leaves):
        torch.testing.assert_close(x.grad.double(), leaf.grad, atol=5e-2, rtol=0)


# ---------------------------------------------------------------------------------------------
# GPU: SDPA itself

def _cuda_bhsd(g, b, h, s, d, dtype="bfloat16"):
    import torch
    x = torch.randn(b, s, h, d, generator=g, device="cuda", dtype=torch.float32)
    return x.to(getattr(torch, dtype)).transpose(1, 2).requires_grad_()


def _kernels(fn):
    """(result of fn(), names of the CUDA kernels it ran)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        res = fn()
        torch.cuda.synchronize()
    return res, {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


def _is_cuflash(names):
    return any(n.startswith(("fwd_", "bwd_")) for n in names)


def _fwd_bwd(q, k, v, dout, **kw):
    import torch
    import torch.nn.functional as F
    for x in (q, k, v):
        x.grad = None
    out = F.scaled_dot_product_attention(q, k, v, **kw)
    out.backward(dout)
    return [out.detach().clone()] + [x.grad.clone() for x in (q, k, v)]


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


@requires_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("b,h,hk,sq,sk,d,causal", [
    (2, 8, 8, 256, 256, 128, True), (2, 16, 4, 200, 200, 64, True), (2, 4, 4, 113, 203, 64, False),
    (1, 8, 2, 1, 300, 128, False), (2, 4, 4, 97, 97, 40, True)])
def test_gpu_sdpa_matches_pytorch(sdpa, dtype, b, h, hk, sq, sk, d, causal):
    """Forward and backward through F.scaled_dot_product_attention (flash backend forced), with
    flash-attn's rule against float64: cuflash's error at most 2x (outputs) and 3x + 1e-4
    (gradients) PyTorch's own flash kernel's."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    g = torch.Generator(device="cuda").manual_seed(sq * 31 + sk)
    q = _cuda_bhsd(g, b, h, sq, d, dtype)
    k, v = _cuda_bhsd(g, b, hk, sk, d, dtype), _cuda_bhsd(g, b, hk, sk, d, dtype)
    dout = torch.randn(b, h, sq, d, generator=g, device="cuda").to(q.dtype)
    kw = dict(is_causal=causal, enable_gqa=h != hk)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        pt, names = _kernels(lambda: _fwd_bwd(q, k, v, dout, **kw))
        assert not _is_cuflash(names)
        sdpa.activate_sdpa()
        got, names = _kernels(lambda: _fwd_bwd(q, k, v, dout, **kw))
        assert _is_cuflash(names) and not any("flash_fwd" in n or "flash_bwd" in n for n in names), names
    with sdpa_kernel(SDPBackend.MATH):
        ref = _fwd_bwd(*(x.detach().double().requires_grad_() for x in (q, k, v)), dout.double(), **kw)
    for name, a, p, r, (factor, tol) in zip(("out", "dq", "dk", "dv"), got, pt, ref,
                                            [(2, 1e-5)] + [(3, 1e-4)] * 3):
        assert _max_err(a, r) <= factor * _max_err(p, r) + tol, name


def _math64(q, k, v, dout, is_causal=False, scale=None, enable_gqa=False):
    """(out, dq, dk, dv) in float64 of SDPA's definition with a causal mask aligned bottom-right (as
    the flash kernels align it when seqlen_q != seqlen_k); a row that sees no key gives 0 and no
    gradient (flash-attn's convention)."""
    import torch
    x = [t.detach().double().requires_grad_() for t in (q, k, v)]
    qq, kk, vv = x
    if enable_gqa:
        g = qq.shape[1] // kk.shape[1]
        kk, vv = kk.repeat_interleave(g, dim=1), vv.repeat_interleave(g, dim=1)
    sq, sk = qq.shape[2], kk.shape[2]
    s = qq @ kk.transpose(-1, -2) * (qq.shape[-1] ** -0.5 if scale is None else scale)
    seen = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if is_causal:
        seen = seen.tril(sk - sq)
    rows = seen.any(-1, keepdim=True)
    s = torch.where(rows, s.masked_fill(~seen, -float("inf")), 0.0)
    out = (s.softmax(-1) * rows) @ vv
    return [out.detach()] + list(torch.autograd.grad(out, x, dout.double()))


# PyTorch's grid for its flash kernel against the math one (test/test_transformers.py,
# test_flash_attention_vs_math_ref_grads), sampled, without dropout (its own tests above) and
# without causal calls of seqlen_q != seqlen_k (which SDPA's flash backend refuses).
_PT_GRID = [dict(b=b, sq=sq, sk=sk, d=d, causal=c, dtype=dt, scale=sc, gqa=g, heads=hh)
            for b in (1, 8) for sq in (4, 8, 64, 143, 256, 512, 1024, 2048)
            for sk in (4, 8, 64, 128, 256, 587, 1024, 2048) for d in (8, 16, 21, 32, 64, 72, 96, 128, 160, 192, 203, 256)
            for c in (True, False) for dt in ("float16", "bfloat16") for sc in (None, "l1") for g in (True, False)
            for hh in ((16, 8), (10, 2)) if not (c and sq != sk)]


@requires_gpu
@pytest.mark.parametrize("case", __import__("random").Random(2011).sample(_PT_GRID, 40),
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_gpu_sdpa_pytorch_grid(sdpa, case):
    """PyTorch's own grid of shapes for its flash kernel (batch, 4-2048 queries and keys, head dims
    8-256 including 21 and 203, causal, scale 1/d, GQA, 16/8 and 10/2 heads), a seeded sample:
    through F.scaled_dot_product_attention with cuflash active, forward and backward within
    flash-attn's rule of PyTorch's flash kernel's error against float64."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    c = case
    h, hk = c["heads"] if c["gqa"] else (c["heads"][0],) * 2
    g = torch.Generator(device="cuda").manual_seed(c["sq"] * 7 + c["sk"] * 3 + c["d"])
    q = _cuda_bhsd(g, c["b"], h, c["sq"], c["d"], c["dtype"])
    k, v = (_cuda_bhsd(g, c["b"], hk, c["sk"], c["d"], c["dtype"]) for _ in range(2))
    dout = torch.randn(c["b"], h, c["sq"], c["d"], generator=g, device="cuda").to(q.dtype)
    kw = dict(is_causal=c["causal"], scale=1 / c["d"] if c["scale"] == "l1" else None, enable_gqa=c["gqa"])
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        try:
            pt = _fwd_bwd(q, k, v, dout, **kw)
        except RuntimeError as e:  # (SDPA's own checks refuse the flash backend before any kernel)
            pytest.skip(f"PyTorch's flash backend refuses this call: {str(e).splitlines()[0]}")
        sdpa.activate_sdpa()
        got, names = _kernels(lambda: _fwd_bwd(q, k, v, dout, **kw))
        sdpa.restore_sdpa()
    assert _is_cuflash(names), names
    ref = _math64(q, k, v, dout, **kw)
    for name, a, p, r, tol in zip(("out", "dq", "dk", "dv"), got, pt, ref, (1e-5, 2e-4, 2e-4, 2e-4)):
        assert _max_err(a, r) <= 2 * _max_err(p, r) + tol, (name, _max_err(a, r), _max_err(p, r))


@requires_gpu
def test_gpu_eager_repeats_on_sequence_chunks(sdpa):
    """Eager calls that need gradients, repeated (the prepared launches after the first call), on
    batch-1 chunks of a longer sequence (q.chunk along the sequence: a batch stride that is not
    the contiguous one) and on whole tensors: outputs and gradients equal to PyTorch's flash
    kernels' within its own rounding on every call, laid out as PyTorch lays them out, and an
    output that can be changed in place."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    g = torch.Generator(device="cuda").manual_seed(11)
    full = [torch.randn(1, 512, 8, 64, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3)]
    chunks = [[x[:, i:i + 256].transpose(1, 2).detach().requires_grad_() for x in full] for i in (0, 256)]
    whole = [x[:, :256].contiguous().transpose(1, 2).detach().requires_grad_() for x in full]
    for q, k, v in chunks + [whole] * 3:
        dout = torch.randn(q.shape, generator=g, device="cuda").to(q.dtype)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            want = _fwd_bwd(q, k, v, dout, is_causal=True)
            sdpa.activate_sdpa()
            try:
                got = _fwd_bwd(q, k, v, dout, is_causal=True)
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                assert out.stride() == torch.empty_like(q).stride()
                out.mul_(1.0)  # (a new tensor, not a view made inside the Function)
            finally:
                sdpa.restore_sdpa()
        for name, a, w in zip(("out", "dq", "dk", "dv"), got, want):
            assert _max_err(a, w) <= 2e-2, name


@requires_gpu
def test_gpu_lse_and_lower_right_causal_match_pytorch(sdpa):
    """The op called directly, causal with seqlen_q != seqlen_k (bottom-right on this op, as
    causal_lower_right sends it): LSE and output against PyTorch's own kernel."""
    import torch
    from torch.nn.attention.bias import causal_lower_right
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (_cuda_bhsd(g, 2, 4, s, 64).detach() for s in (77, 300, 300))
    op = getattr(torch.ops.aten, FWD)
    want = op(q, k, v, is_causal=True)
    sdpa.activate_sdpa()
    got, names = _kernels(lambda: op(q, k, v, is_causal=True))
    assert _is_cuflash(names)
    torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=1e-3, rtol=1e-4)
    mask = causal_lower_right(77, 300)
    out, names = _kernels(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert _is_cuflash(names)
    torch.testing.assert_close(out, want[0], atol=2e-2, rtol=0)


def _varlen_reference(q, k, v, cu_q, cu_k, window, dout, scale=None):
    """Per-sequence float64 attention (math SDPA) with a (left, right) window aligned bottom-right
    ((-1, 0): causal), and its gradients."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    outs = []
    for i in range(cu_q.shape[0] - 1):
        a, b, c, e = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        qs, ks, vs = (x.transpose(0, 1)[None] for x in (q[a:b], k[c:e], v[c:e]))
        rel = torch.arange(e - c, device=q.device)[None] - torch.arange(b - a, device=q.device)[:, None] - (e - c - b + a)
        mask = ((rel >= -window[0]) | (window[0] < 0)) & ((rel <= window[1]) | (window[1] < 0))
        seen = mask.any(-1, keepdim=True)  # rows that see no key: 0 (computed over every key, then dropped)
        with sdpa_kernel(SDPBackend.MATH):
            o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask | ~seen, scale=scale,
                                                                 enable_gqa=True)
        outs.append(torch.where(seen, o, 0)[0].transpose(0, 1))
    out = torch.cat(outs)
    return [out.detach()] + list(torch.autograd.grad(out, (q, k, v), dout.double()))


def _varlen_kw(window, scale=None):
    """varlen_attn's keyword arguments for a window, or None where this PyTorch's varlen_attn
    cannot express it (early versions took is_causal, not window_size)."""
    import inspect
    from torch.nn.attention import varlen
    params = inspect.signature(varlen.varlen_attn).parameters
    kw = dict(scale=scale, **({"enable_gqa": True} if "enable_gqa" in params else {}))
    if "window_size" in params:
        return dict(kw, window_size=window)
    if window in ((-1, -1), (-1, 0)) and "is_causal" in params:
        return dict(kw, is_causal=window == (-1, 0))
    return None


@requires_gpu
@pytest.mark.parametrize("window,scale", [((-1, -1), None), ((-1, 0), None), ((-1, 0), 0.1), ((4, 0), None),
                                          ((-1, 4), None), ((0, 0), None), ((0, -1), None), ((8, 2), 0.1),
                                          ((1025, 1025), None)])
def test_gpu_varlen_attn_runs_cuflash(sdpa, window, scale):
    """torch.nn.attention.varlen.varlen_attn (PyTorch's packed-sequence attention, which calls
    aten::_flash_attention_forward and _backward), forward and backward, with GQA, windows (as
    PyTorch's own tests take them) and a scale: cuflash's kernels while active, PyTorch's after
    restore; within flash-attn's rule of float64 against PyTorch's own kernel's error (outputs
    2x + 1e-5, gradients 3x + 1e-4)."""
    import torch
    varlen = pytest.importorskip("torch.nn.attention.varlen", reason="needs PyTorch's varlen_attn")
    kw = _varlen_kw(window, scale)
    if kw is None:
        pytest.skip(f"this PyTorch's varlen_attn takes no window_size={window}")
    g = torch.Generator(device="cuda").manual_seed(11 + window[0] + 3 * window[1])
    lens_q, lens_k = ([100, 1, 257, 64], [100, 1, 257, 64]) if window[1] == 0 else ([100, 1, 257, 64], [120, 33, 257, 5])
    cu_q, cu_k = (torch.tensor([0] + x, device="cuda").cumsum(0).int() for x in (lens_q, lens_k))
    mk = lambda n, h: torch.randn(n, h, 128, generator=g, device="cuda").bfloat16().requires_grad_()  # noqa: E731
    hk = 2 if "enable_gqa" in kw else 8  # (GQA where this PyTorch's varlen_attn takes it)
    q, k, v = mk(sum(lens_q), 8), mk(sum(lens_k), hk), mk(sum(lens_k), hk)
    dout = torch.randn(q.shape, generator=g, device="cuda").bfloat16()

    def run():
        out = varlen.varlen_attn(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **kw)
        return [out.detach()] + list(torch.autograd.grad(out, (q, k, v), dout))
    pt, names = _kernels(run)
    assert not _is_cuflash(names)
    sdpa.activate_sdpa()
    got, names = _kernels(run)
    assert _is_cuflash(names) and not any("flash_fwd" in n or "flash_bwd" in n for n in names), names
    ref = _varlen_reference(q, k, v, cu_q, cu_k, window, dout, scale)
    for name, a, p, r, (factor, tol) in zip(("out", "dq", "dk", "dv"), got, pt, ref, [(2, 1e-5)] + [(3, 1e-4)] * 3):
        assert _max_err(a, r) <= factor * _max_err(p, r) + tol, name
    sdpa.restore_sdpa()
    _, names = _kernels(run)
    assert not _is_cuflash(names)


@requires_gpu
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (4, 4)])
def test_gpu_varlen_attn_batch_invariance(sdpa, window):
    """PyTorch's varlen batch-invariance test, on cuflash: the sequences of a packed batch in
    another order give each sequence the same output and gradients."""
    import torch
    from torch.nn.attention import varlen
    kw = _varlen_kw(window)
    if kw is None:
        pytest.skip(f"this PyTorch's varlen_attn takes no window_size={window}")
    kw.pop("enable_gqa", None)
    g = torch.Generator(device="cuda").manual_seed(13)
    lens = [128, 64, 128, 64]
    seqs = [[torch.randn(n, 2, 128, generator=g, device="cuda").bfloat16().requires_grad_() for _ in range(3)]
            for n in lens]
    grads_out = [torch.randn(n, 2, 128, generator=g, device="cuda").bfloat16() for n in lens]
    sdpa.activate_sdpa()

    def run(order):
        q, k, v = (torch.cat([seqs[i][j] for i in order]) for j in range(3))
        cu = torch.tensor([0] + [lens[i] for i in order], device="cuda").cumsum(0).int()
        out = varlen.varlen_attn(q, k, v, cu, cu, 128, 128, **kw)
        grads = torch.autograd.grad(out, (q, k, v), torch.cat([grads_out[i] for i in order]))
        return [dict(zip(order, x.split([lens[i] for i in order]))) for x in (out, *grads)]
    first, names = _kernels(lambda: run([0, 1, 2, 3]))
    assert _is_cuflash(names)
    for order in ([2, 0, 3, 1], [3, 2, 1, 0]):
        for a, b in zip(first, run(order)):
            for i in range(4):
                torch.testing.assert_close(a[i], b[i])


@requires_gpu
def test_gpu_flash_op_dense_and_nested(sdpa):
    """aten::_flash_attention_forward on (batch, seqlen, nheads, d) tensors, causal bottom-right:
    cuflash's output and LSE against PyTorch's kernel; SDPA on nested (jagged) tensors, which
    calls the packed form of that op, runs cuflash too."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    g = torch.Generator(device="cuda").manual_seed(12)
    q, k, v = (torch.randn(2, s, 4, 64, generator=g, device="cuda").bfloat16() for s in (77, 300, 300))
    op = getattr(torch.ops.aten, VFWD)
    want = op(q, k, v, None, None, 77, 300, 0.0, True, False, scale=0.1)
    sdpa.activate_sdpa()
    got, names = _kernels(lambda: op(q, k, v, None, None, 77, 300, 0.0, True, False, scale=0.1))
    assert _is_cuflash(names)
    torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=1e-3, rtol=1e-4)
    parts = [torch.randn(n, 4, 64, generator=g, device="cuda").bfloat16() for n in (37, 130, 5)]
    nt = torch.nested.nested_tensor(parts, layout=torch.jagged).transpose(1, 2)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out, names = _kernels(lambda: F.scaled_dot_product_attention(nt, nt, nt, is_causal=True))
    assert _is_cuflash(names), names
    for part, o in zip(parts, out.transpose(1, 2).unbind()):
        x = part.transpose(0, 1)[None]
        torch.testing.assert_close(o, F.scaled_dot_product_attention(x, x, x, is_causal=True)[0].transpose(0, 1),
                                   atol=2e-2, rtol=0)


@requires_gpu
def test_gpu_default_order_and_restore(sdpa):
    """Without sdpa_kernel, an activated SDPA call runs cuflash (flash is moved ahead of cuDNN,
    which PyTorch prefers on sm_90/sm_100); restore brings PyTorch's kernels and order back."""
    import torch
    import torch.nn.functional as F
    g = torch.Generator(device="cuda").manual_seed(6)
    q, k, v = (_cuda_bhsd(g, 2, 8, 256, 128).detach() for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    order = torch._C._get_sdp_priority_order()
    sdpa.activate_sdpa()
    got, names = _kernels(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert _is_cuflash(names), names
    torch.testing.assert_close(got, want, atol=2e-2, rtol=0)
    sdpa.restore_sdpa()
    _, names = _kernels(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert not _is_cuflash(names) and torch._C._get_sdp_priority_order() == order


@requires_gpu
def test_gpu_fallbacks_run_pytorch(sdpa):
    """fp32 (never sent to flash) runs PyTorch's kernels; so does dropout (cuflash's asked for)
    under a CUDA graph capture, whose replays draw new masks (PyTorch's graph-safe Philox state),
    and dropout when cuflash's was not asked for."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    g = torch.Generator(device="cuda").manual_seed(7)
    sdpa.activate_sdpa(dropout=True)
    q, k, v = (_cuda_bhsd(g, 2, 4, 128, 64, "float32") for _ in range(3))
    out, names = _kernels(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert not _is_cuflash(names) and torch.isfinite(out).all()
    q, k, v = (_cuda_bhsd(g, 2, 4, 128, 64) for _ in range(3))
    dout = torch.randn_like(q)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()

    def step():  # (with gradients: the calls cuflash's dropout would serve outside a capture)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # (warm-up outside the capture)
            step()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            res = step()
    _, names = _kernels(graph.replay)
    first = [x.clone() for x in res]
    graph.replay()
    torch.cuda.synchronize()
    assert not _is_cuflash(names) and all(torch.isfinite(x).all() for x in res)
    assert not torch.equal(first[0], res[0]) and not torch.equal(first[1], res[1])
    sdpa.activate_sdpa()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        def run():
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True).float().sum().backward()
        _, names = _kernels(run)
    assert not _is_cuflash(names) and torch.isfinite(q.grad).all()


@requires_gpu
@pytest.mark.parametrize("dtype,b,h,hk,sq,sk,d,causal,p", [
    ("bfloat16", 2, 4, 4, 256, 256, 64, True, 0.2), ("float16", 2, 8, 2, 113, 203, 128, False, 0.1),
    ("bfloat16", 1, 4, 4, 97, 97, 40, True, 0.5)])
def test_gpu_sdpa_dropout(sdpa, dtype, b, h, hk, sq, sk, d, causal, p):
    """SDPA with dropout runs cuflash once activated with dropout=True, forward and backward (the profiler shows
    its kernels): the mask is cuflash's, drawn from the default CUDA generator's seed and offset
    at the call; output and gradients are within flash-attn's rule of cuflash.reference with that
    mask. The generator's offset advances (the next call draws another mask) and torch.manual_seed
    repeats the masks."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from cuflash import reference
    from test_dropout import _within, to_np
    g = torch.Generator(device="cuda").manual_seed(sq * 7 + sk)
    q, dout = _cuda_bhsd(g, b, h, sq, d, dtype), _cuda_bhsd(g, b, h, sq, d, dtype).detach()
    k, v = _cuda_bhsd(g, b, hk, sk, d, dtype), _cuda_bhsd(g, b, hk, sk, d, dtype)
    gen = torch.cuda.default_generators[q.device.index]
    sdpa.activate_sdpa(dropout=True)
    kw = dict(dropout_p=p, is_causal=causal, enable_gqa=hk != h)
    torch.manual_seed(1234)
    seed, offset = gen.initial_seed(), gen.get_offset()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        (out, *grads), names = _kernels(lambda: _fwd_bwd(q, k, v, dout, **kw))
        assert _is_cuflash(names), names
        assert gen.get_offset() > offset
        again = F.scaled_dot_product_attention(q, k, v, **kw)
        torch.manual_seed(1234)
        same = F.scaled_dot_product_attention(q, k, v, **kw)
    assert torch.equal(same, out) and not torch.equal(again, out)
    args = [to_np(x.transpose(1, 2)) for x in (q, k, v)]
    rkw = dict(causal=causal, dropout_p=p, seed=seed, offset=offset)
    _within(to_np(out.transpose(1, 2)), reference.attention(*args, **rkw),
            reference.attention(*args, precision="same", **rkw), 1e-5, "out")
    do = to_np(dout.transpose(1, 2))
    ref64 = reference.attention_backward(do, *args, **rkw)
    ref_same = reference.attention_backward(do, *args, precision="same", **rkw)
    for name, got, r, s in zip(("dq", "dk", "dv"), grads, ref64, ref_same):
        _within(to_np(got.transpose(1, 2)), r, s, 2e-4, name)


@requires_gpu
def test_gpu_torch_compile(sdpa):
    import torch
    import torch.nn.functional as F
    g = torch.Generator(device="cuda").manual_seed(8)
    q, k, v = _cuda_bhsd(g, 2, 16, 256, 128), _cuda_bhsd(g, 2, 4, 256, 128), _cuda_bhsd(g, 2, 4, 256, 128)

    def f(q, k, v):
        out = F.scaled_dot_product_attention(q * 0.5, k, v, is_causal=True, enable_gqa=True)
        return out.float().square().sum()

    sdpa.activate_sdpa()
    eager = [f(q, k, v)]
    eager[0].backward()
    eager += [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    torch._dynamo.reset()
    fc = torch.compile(f, fullgraph=True)

    def run():
        loss = fc(q, k, v)
        loss.backward()
        return loss
    loss, names = _kernels(run)
    assert _is_cuflash(names), names
    for a, b in zip([loss] + [x.grad for x in (q, k, v)], eager):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@requires_gpu
@pytest.mark.parametrize("how", ["reentrant", "non-reentrant", "restored before backward"])
def test_gpu_sdpa_dropout_checkpoint_and_restore(sdpa, how):
    """With cuflash's dropout asked for, a step whose forward and backward see different masks
    would give wrong gradients silently; none does. A reentrant checkpoint's forward runs without
    gradients (PyTorch's dropout), so its recompute takes PyTorch's too: the gradients are
    those of the same step without cuflash. A non-reentrant checkpoint recomputes with the same
    generator state, and a forward taken before restore_sdpa() keeps cuflash's backward: the
    gradients are those of the same step on cuflash without either."""
    import torch
    import torch.nn.functional as F
    import torch.utils.checkpoint as cp
    from torch.nn.attention import SDPBackend, sdpa_kernel
    g = torch.Generator(device="cuda").manual_seed(21)
    q, k, v = (_cuda_bhsd(g, 2, 8, 512, 128) for _ in range(3))
    dout = torch.randn(2, 8, 512, 128, device="cuda", dtype=torch.bfloat16, generator=g)

    def f(q, k, v):
        return F.scaled_dot_product_attention(q * 1.0, k, v, dropout_p=0.2, is_causal=True)

    def step(cuflash_on, run, restore=False):
        if cuflash_on:
            sdpa.activate_sdpa(dropout=True)
        else:
            sdpa.restore_sdpa()
        torch.manual_seed(99)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = run()
        if restore:
            sdpa.restore_sdpa()
        for x in (q, k, v):
            x.grad = None
        out.backward(dout)  # (a reentrant checkpoint takes .backward() only)
        return (out.detach(), *(x.grad for x in (q, k, v)))

    if how == "reentrant":
        want = step(False, lambda: f(q, k, v))
        got, names = _kernels(lambda: step(True, lambda: cp.checkpoint(f, q, k, v, use_reentrant=True)))
        assert not _is_cuflash(names), names
    else:
        want = step(True, lambda: f(q, k, v))
        run = (lambda: cp.checkpoint(f, q, k, v, use_reentrant=False)) if how == "non-reentrant" else \
            (lambda: f(q, k, v))
        got, names = _kernels(lambda: step(True, run, restore=how == "restored before backward"))
        assert _is_cuflash(names), names
    for a, b in zip(got, want):  # (the same masks: differences of dQ's atomic adds' order at most)
        assert (a.float() - b.float()).abs().max() <= 1e-2 * b.float().abs().max()


@requires_gpu
def test_gpu_torch_compile_dropout_is_pytorchs(sdpa):
    """Under torch.compile a call with dropout runs PyTorch's kernels (cuflash's dropout asked
    for or not), forward and backward (the compiled forward runs without gradients and hands
    PyTorch's rng_state to the backward op): activated or not, the same seed gives bitwise the
    same loss and the same gradients up to the order of dQ's atomic adds (another mask would
    move them far more)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    g = torch.Generator(device="cuda").manual_seed(10)
    q, k, v = (_cuda_bhsd(g, 2, 4, 256, 64) for _ in range(3))

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.25, is_causal=True).float().square().sum()

    torch._dynamo.reset()
    fc = torch.compile(f, fullgraph=True)
    runs = []
    for active in (True, False):
        if active:
            sdpa.activate_sdpa(dropout=True)
        else:
            sdpa.restore_sdpa()
        for x in (q, k, v):
            x.grad = None
        torch.manual_seed(3)

        def run():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # (both runs on the flash op)
                loss = fc(q, k, v)
            loss.backward()
            return loss
        loss, names = _kernels(run)
        assert not _is_cuflash(names), names
        runs.append([loss] + [x.grad.clone() for x in (q, k, v)])
    assert torch.equal(runs[0][0], runs[1][0])  # the loss: the same forward kernel and mask
    for a, b in zip(runs[0][1:], runs[1][1:]):  # (dQ's adds may be atomic: their order may differ)
        assert (a.float() - b.float()).abs().max() <= 1e-2 * b.float().abs().max()


@requires_gpu
def test_gpu_cuda_graph(sdpa):
    """An activated SDPA call captured in a CUDA graph replays cuflash on new inputs, bitwise
    equal to eager calls."""
    import torch
    import torch.nn.functional as F
    from test_torch_integration import _capture
    g = torch.Generator(device="cuda").manual_seed(9)
    q, k, v = (_cuda_bhsd(g, 2, 16, 512, 128).detach() for _ in range(3))
    sdpa.activate_sdpa()
    graph, out = _capture(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    for _ in range(2):
        for x in (q, k, v):
            x.copy_(torch.randn(x.shape, generator=g, device="cuda"))
        _, names = _kernels(graph.replay)
        assert _is_cuflash(names)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.testing.assert_close(out, want, atol=0, rtol=0)


@requires_gpu
def test_gpu_transformers_sdpa_backend(sdpa):
    """transformers' own "sdpa" backend (no padding: no mask, so SDPA's flash path) runs cuflash
    once activated, with logits close to PyTorch's."""
    pytest.importorskip("transformers")
    import torch
    from test_torch_integration import _tiny_qwen2
    model = _tiny_qwen2("sdpa", dtype="bfloat16", device="cuda")
    ids = torch.randint(0, 512, (2, 64), device="cuda")
    with torch.no_grad():
        want = model(ids).logits.float()
        sdpa.activate_sdpa()
        got, names = _kernels(lambda: model(ids).logits.float())
    assert _is_cuflash(names), names
    torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
