"""Repeated calls from PyTorch: a call with the signature of an earlier successful one reuses its
checked plan and launch arguments. Each repeat must still compute the right answer for its own
(fresh) data, on the current stream, and every input the general path rejects must still be
rejected."""
import numpy as np
import pytest

from conftest import requires_gpu, requires_torch
from test_gpu_forward import check, to_np, torch_inputs

pytestmark = [requires_gpu, requires_torch]


@pytest.fixture
def no_general_path(monkeypatch):
    """Make the general path (views, checks, planning) fail loudly once armed."""
    from cuflash import api, validate

    def arm():
        def boom(*a, **k):
            raise AssertionError("the general path ran for a repeated call")
        monkeypatch.setattr(api, "_attention_device", boom)
        monkeypatch.setattr(validate, "operands", boom)
    return arm


# (b, sq, sk, h, hk, d, num_splits): standard kernel, split-KV decode (GQA-packed), a forced split
SHAPES = [(2, 77, 203, 4, 2, 64, 0), (1, 1, 4096, 32, 8, 128, 0), (2, 64, 1000, 4, 4, 128, 5)]


@pytest.mark.parametrize("b,sq,sk,h,hk,d,splits", SHAPES)
@pytest.mark.parametrize("given_out", [False, True])
@pytest.mark.parametrize("return_lse", [False, True])
def test_repeats_compute_fresh_data(rng, no_general_path, b, sq, sk, h, hk, d, splits, given_out, return_lse):
    import torch

    import cuflash
    from cuflash import api
    from cuflash.reference import attention as ref
    kw = dict(causal=True, num_splits=splits, return_lse=return_lse)
    first = torch_inputs(rng, b, sq, sk, h, hk, d, "bfloat16")
    cuflash.attention(*first, out=torch.empty_like(first[0]) if given_out else None, **kw)
    assert len(api._repeats) >= 1
    no_general_path()
    for _ in range(3):
        q, k, v = torch_inputs(rng, b, sq, sk, h, hk, d, "bfloat16")
        out = torch.full_like(q, float("nan")) if given_out else None
        res = cuflash.attention(q, k, v, out=out, **kw)
        o, lse = res if return_lse else (res, None)
        if given_out:
            assert o is out
        assert o.shape == q.shape and o.dtype == q.dtype and o.is_contiguous()
        check(o, q, k, v, causal=True)
        if return_lse:
            _, lse_ref = ref(to_np(q), to_np(k), to_np(v), causal=True, return_lse=True)
            assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
            np.testing.assert_allclose(lse.cpu().numpy(), lse_ref, rtol=1e-3, atol=2e-3)


def test_repeat_follows_the_current_stream(rng):
    """Decode (split-KV, workspace kept per stream) on two streams at once, repeated."""
    import torch

    import cuflash
    args = [torch_inputs(rng, 1, 1, 4096, 32, 8, 128, "bfloat16") for _ in range(2)]
    want = [cuflash.attention(*a, causal=True) for a in args]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = [[], []]
    for _ in range(20):
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                outs[i].append(cuflash.attention(*args[i], causal=True))
    torch.cuda.synchronize()
    for i in range(2):
        for o in outs[i]:
            assert torch.equal(o, want[i])


def test_repeat_inside_cuda_graph(rng):
    """A repeated split-KV call captured into a CUDA graph, replayed on new data."""
    import torch

    import cuflash
    q, k, v = torch_inputs(rng, 1, 1, 4096, 32, 8, 128, "bfloat16")
    out = torch.empty_like(q)
    cuflash.attention(q, k, v, causal=True, out=out)  # planned, compiled, workspace made
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cuflash.attention(q, k, v, causal=True, out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cuflash.attention(q, k, v, causal=True, out=out)
    for _ in range(3):
        q2, k2, v2 = torch_inputs(rng, 1, 1, 4096, 32, 8, 128, "bfloat16")
        q.copy_(q2), k.copy_(k2), v.copy_(v2)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check(out, q, k, v, causal=True)


def test_unaligned_repeat_takes_the_general_path(rng):
    """Same shapes and strides, but a pointer off 16 bytes: the call reads a padded copy."""
    import torch

    import cuflash
    q, k, v = torch_inputs(rng, 2, 50, 70, 4, 4, 64, "float16")
    cuflash.attention(q, k, v)
    base = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)
    q_off = base[1:].view(q.shape)  # 2-byte offset: same shape and strides
    q_off.copy_(q)
    assert q_off.data_ptr() % 16 and q_off.stride() == q.stride()
    check(cuflash.attention(q_off, k, v), q_off, k, v)


def test_repeat_still_rejects_what_the_general_path_rejects(rng):
    """Values equal to a cached call's but of another type (1 vs True) and changed inputs
    still meet the checks."""
    import torch

    import cuflash
    q, k, v = torch_inputs(rng, 2, 40, 60, 4, 2, 64, "bfloat16")
    cuflash.attention(q, k, v, causal=True, num_splits=0, softcap=0.0)
    with pytest.raises(TypeError, match="causal"):
        cuflash.attention(q, k, v, causal=1)
    with pytest.raises(TypeError, match="num_splits"):
        cuflash.attention(q, k, v, causal=True, num_splits=False)
    with pytest.raises(TypeError, match="dtype"):
        cuflash.attention(q, k.half(), v, causal=True)
    with pytest.raises(ValueError, match="batch"):
        cuflash.attention(q, k[:1], v[:1], causal=True)
    with pytest.raises(ValueError, match="out"):
        cuflash.attention(q, k, v, causal=True, out=torch.empty_like(q)[:, :10])
    with pytest.raises(ValueError, match="CPU"):
        cuflash.attention(q.cpu(), k.cpu(), v.cpu(), causal=True)


@pytest.mark.parametrize("b,sq,sk,h,hk,d,splits", SHAPES + [(2, 1, 128, 32, 8, 128, 0)])
@pytest.mark.parametrize("between", [None, "scale"])
def test_back_to_back_calls_see_the_previous_output(rng, b, sq, sk, h, hk, d, splits, between):
    """Forward kernels on sm_90 may start before the stream's previous kernel ends. A chain of
    calls queued without a sync, each taking the previous output (directly, or through a PyTorch
    kernel that scales it) as its queries, must read each query only once it is written: every
    step matches the reference for the queries it got."""
    import torch

    import cuflash
    q, k, v = torch_inputs(rng, b, sq, sk, h, hk, d, "bfloat16")
    qs = [q]
    for _ in range(6):
        out = cuflash.attention(qs[-1], k, v, causal=True, num_splits=splits)
        qs.append(out if between is None else out * 4)
    torch.cuda.synchronize()
    for q_in, q_out in zip(qs, qs[1:]):
        check(q_out if between is None else q_out / 4, q_in, k, v, causal=True)


# ---------------------------------------------------------------------------------------------
# The backward's repeated calls (cuflash.backward._repeats)

def _bwd_inputs(seed, b, sq, sk, h, hk, d, causal):
    import torch
    import cuflash
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v, do = mk(b, sq, h, d), mk(b, sk, hk, d), mk(b, sk, hk, d), mk(b, sq, h, d)
    o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    return do, q, k, v, o, lse


@pytest.mark.parametrize("d,causal,deterministic,given", [(64, True, False, False), (128, False, False, True),
                                                          (128, True, True, False), (96, True, True, True)])
def test_backward_repeats_compute_fresh_data(monkeypatch, d, causal, deterministic, given):
    """A second backward call with the first one's signature fires its prepared launches (the
    checks and the plan do not run) and computes its own data's gradients: bitwise the general
    path's when deterministic, within atomics' reordering otherwise."""
    import torch
    from cuflash import backward
    shape = (2, 200, 300, 4, 2, d)
    kw = dict(causal=causal, deterministic=deterministic)
    bufs = lambda x: dict(dq=torch.empty_like(x[1]), dk=torch.empty_like(x[2]), dv=torch.empty_like(x[3])) \
        if given else {}  # noqa: E731
    backward._repeats.clear()
    first = _bwd_inputs(0, *shape, causal)
    backward.attention_backward(*first, **kw, **bufs(first))
    assert len(backward._repeats) == 1
    second = _bwd_inputs(1, *shape, causal)
    with monkeypatch.context() as m:
        m.setattr(backward, "_validate", lambda *a: (_ for _ in ()).throw(AssertionError("general path")))
        got = backward.attention_backward(*second, **kw, **bufs(second))
    backward._repeats.clear()
    want = backward.attention_backward(*second, **kw)
    for name, x, y in zip(("dq", "dk", "dv"), got, want):
        assert x.shape == y.shape and x.is_contiguous(), name
        if deterministic:
            assert torch.equal(x, y), name
        else:
            err = (x.float() - y.float()).abs().max().item()
            assert err <= 1e-2 * y.float().abs().max().item(), (name, err)


def test_backward_repeat_through_autograd_and_misaligned_pointers():
    """Eager autograd steps reuse the prepared backward (one entry for the shape), and a call
    whose pointers are not 16-byte aligned falls back to the general path (padded copies)."""
    import torch
    import cuflash.torch as ct
    from cuflash import backward
    backward._repeats.clear()
    grads = []
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(seed)
        q, k, v = (torch.randn(2, 130, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                   for _ in range(3))
        ct.attention(q, k, v, causal=True, deterministic=True).float().square().sum().backward()
        grads.append((q, k, v))
    assert len(backward._repeats) == 1
    q, k, v = (x.detach().clone().requires_grad_() for x in grads[-1])
    ct.attention(q, k, v, causal=True, deterministic=True).float().square().sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip((q, k, v), grads[-1]))
    # misaligned: the same signature (shape, strides) with pointers off by 2 bytes
    do, q, k, v, o, lse = _bwd_inputs(5, 2, 130, 130, 4, 4, 64, True)
    buf = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)
    q_odd = buf[1:].view(q.shape).copy_(q)
    want = backward.attention_backward(do, q, k, v, o, lse, causal=True, deterministic=True)
    got = backward.attention_backward(do, q_odd, k, v, o, lse, causal=True, deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# ---------------------------------------------------------------------------------------------
# The eager autograd path of plain calls (cuflash.torch.ops._PreparedAttention)

@pytest.mark.parametrize("cpp_node", [False, True])
@pytest.mark.parametrize("kw", [dict(causal=True, deterministic=True),
                                dict(causal=False, softmax_scale=0.2, window_size=(40, 7), softcap=20.0,
                                     deterministic=True),
                                dict(causal=True)])
def test_prepared_autograd_steps(monkeypatch, kw, cpp_node):
    """Repeated training steps fire the forward's and the backward's prepared launches (neither
    general path runs after the first step) and give the general path's results for their own
    data: bitwise with deterministic=True, within the atomics' reordering otherwise. An output
    gradient laid out unlike the output takes the general backward. ``cpp_node``: the same with
    the C++ backward node (CUFLASH_CPP_NODE=1), which fires the prepared backward from the second
    step on."""
    import torch
    import cuflash.torch as ct
    from cuflash import api, backward
    from cuflash.torch import ops

    def step(seed, general=False, dout_t=False):
        g = torch.Generator(device="cuda").manual_seed(seed)
        mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        q, k, v = (x.requires_grad_() for x in (mk(2, 150, 4, 64), mk(2, 190, 2, 64), mk(2, 190, 2, 64)))
        do = mk(2, 4, 150, 64).transpose(1, 2) if dout_t else mk(2, 150, 4, 64)
        if general:  # the custom op's bodies (the eager Function of calls with extras)
            wl, wr = kw.get("window_size", (-1, -1))
            out, _ = ops._EagerAttention.apply(q, k, v, kw["causal"], kw.get("softmax_scale"), wl, wr,
                                               kw.get("softcap", 0.0), None, kw.get("deterministic", False))
        else:
            out = ct.attention(q, k, v, **kw)
        return (out.detach(), *torch.autograd.grad(out, (q, k, v), do))

    def same(got, want):
        for x, y in zip(got, want):
            assert x.shape == y.shape and x.is_contiguous()
            if kw.get("deterministic"):
                assert torch.equal(x, y)
            else:
                assert (x.float() - y.float()).abs().max().item() <= 1e-2 * y.float().abs().max().item()

    from cuflash.torch import node
    if cpp_node and node.module() is None:
        pytest.skip(f"the C++ node cannot be built here: {node._state['why']}")
    monkeypatch.setenv("CUFLASH_CPP_NODE", "1" if cpp_node else "0")
    ops._prepared.clear()
    step(0)
    (p,) = ops._prepared.values()
    assert p.fwd is not None and p.bwd is not None
    boom = lambda *a, **k: (_ for _ in ()).throw(AssertionError("general path"))  # noqa: E731
    for seed in (1, 2):
        with monkeypatch.context() as m:
            m.setattr(api, "_attention_device", boom)
            m.setattr(backward, "_validate", boom)
            got = step(seed)
        same(got, step(seed, general=True))
    same(step(3, dout_t=True), step(3, general=True, dout_t=True))
    assert len(ops._prepared) == 1 and bool(p.program) == cpp_node


def test_prepared_autograd_returns_the_lse():
    """return_lse on the prepared path: the LSE of cuflash.attention, float32, without a
    gradient; the output's gradient flows as without it."""
    import torch
    import cuflash
    import cuflash.torch as ct
    q, k, v = (torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.float16).requires_grad_() for _ in range(3))
    for _ in range(2):  # the first call makes the prepared launches, the second fires them
        out, lse = ct.attention(q, k, v, causal=True, return_lse=True)
    want_out, want_lse = cuflash.attention(q.detach(), k.detach(), v.detach(), causal=True, return_lse=True)
    assert out.requires_grad and not lse.requires_grad and lse.dtype == torch.float32
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    out.float().sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v))


def test_prepared_autograd_saved_tensors_with_other_strides():
    """A saved-tensor hook may give the backward contiguous copies of strided inputs
    (torch.autograd.graph.save_on_cpu): the prepared backward of the strided layout must not run
    on them. Gradients those of contiguous inputs (within bf16 rounding of the LSE and output)."""
    import torch
    import cuflash.torch as ct
    from cuflash.torch import ops
    g = torch.Generator(device="cuda").manual_seed(0)
    kw = dict(causal=True, deterministic=True)
    do = torch.randn(2, 150, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g)

    def packed():  # q, k, v split from one (batch, seqlen, 3, heads, d) tensor: strided views
        x = torch.randn(2, 150, 3, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        return x, x.unbind(2)

    ops._prepared.clear()
    x, (q, k, v) = packed()
    torch.autograd.grad(ct.attention(q, k, v, **kw), x, do)  # makes the prepared launches
    (p,) = ops._prepared.values()
    assert p.bwd is not None
    x, (q, k, v) = packed()
    with torch.autograd.graph.save_on_cpu(pin_memory=True):
        out = ct.attention(q, k, v, **kw)
    (got,) = torch.autograd.grad(out, x, do)
    qc, kc, vc = (t.detach().contiguous().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(ct.attention(qc, kc, vc, **kw), (qc, kc, vc), do)
    want = torch.stack(want, 2).float()
    assert (got.float() - want).abs().max().item() <= 1e-2 * want.abs().max().item()


def _lengths(rng, b, total, longest):
    """b sequence lengths in [0, longest] summing to ``total``, ``longest`` among them (so calls
    with other lengths keep the totals and maxima: the same repeat signature)."""
    rest = total - longest
    while True:
        parts = rng.integers(0, longest + 1, size=b - 2)
        last = rest - int(parts.sum())
        if 0 <= last <= longest:
            return rng.permutation(np.concatenate([[longest], parts, [last]])).astype(np.int64)


@pytest.mark.parametrize("d,causal,window,splits", [(64, False, (-1, -1), 0), (128, True, (-1, -1), 0),
                                                    (128, False, (32, 16), 0), (64, True, (-1, -1), 3)])
def test_varlen_repeats_read_the_new_cu_seqlens(rng, monkeypatch, d, causal, window, splits):
    """attention_varlen and attention_varlen_backward repeated with new cu_seqlens arrays (other
    lengths, the same totals and maxima) compute the new sequences' results, without the general
    path; the poisoned output and gradient buffers are all written."""
    import torch

    import cuflash
    from cuflash import api, backward, validate
    from test_gpu_backward import check_varlen
    from test_gpu_varlen import check_against, ref_varlen
    b, h, hk, total_q, total_k, mq, mk = 5, 4, 2, 700, 820, 250, 300
    tdt = torch.bfloat16 if d == 128 else torch.float16
    kw = dict(causal=causal, window_size=window)
    kept = []

    def call(poison):
        lq, lk = _lengths(rng, b, total_q, mq), _lengths(rng, b, total_k, mk)
        cq, ck = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lq, lk))
        q, dout = (torch.randn(total_q, h, d, device="cuda", dtype=tdt) for _ in range(2))
        k, v = (torch.randn(total_k, hk, d, device="cuda", dtype=tdt) for _ in range(2))
        cqd, ckd = torch.from_numpy(cq).cuda(), torch.from_numpy(ck).cuda()
        kept.append((cqd, ckd))  # alive: each call's arrays at pointers no earlier call had
        out = torch.full_like(q, float("nan")) if poison else None
        o, lse = cuflash.attention_varlen(q, k, v, cqd, ckd, mq, mk, return_lse=True, out=out, num_splits=splits,
                                          **kw)
        grads = [torch.full_like(x, float("nan")) for x in (q, k, v)] if poison else [None] * 3
        res = backward.attention_varlen_backward(dout, q, k, v, o, lse, cqd, ckd, mq, mk, dq=grads[0], dk=grads[1],
                                                 dv=grads[2], **kw)
        return (q, k, v, dout, cq, ck), o, lse, res

    call(False), call(True)  # checked, planned, kept (without and with the caller's buffers)
    n_fwd, n_bwd = len(api._repeats), len(backward._repeats)
    assert n_fwd >= 2 and n_bwd >= 2

    def boom(*a, **k):
        raise AssertionError("the general path ran for a repeated call")
    monkeypatch.setattr(validate, "varlen", boom)
    monkeypatch.setattr(backward, "_validate_varlen", boom)
    for poison in (True, False, True):
        (q, k, v, dout, cq, ck), o, lse, grads = call(poison)
        ref, same, ref_lse = ref_varlen(q, k, v, cq, ck, None, kw)
        check_against(o, lse, ref, same, ref_lse)
        check_varlen(grads, dout, q, k, v, cq, ck, causal, window_size=window)
    assert (len(api._repeats), len(backward._repeats)) == (n_fwd, n_bwd)
    assert len({t.data_ptr() for pair in kept for t in pair}) == 2 * len(kept)


@pytest.mark.parametrize("d,causal,n,heads", [(128, True, 1, 1), (64, False, 2, 2), (128, False, 4, 2)])
def test_flashmask_repeats_read_the_new_indices(rng, monkeypatch, d, causal, n, heads):
    """cuflash.attention and attention_backward with FlashMask repeated with new index arrays of
    the same shape (other masks) compute the new masks' results without the general path, into
    poisoned buffers."""
    import torch

    import cuflash
    from cuflash import backward, reference, validate
    from cuflash.reference import max_abs_err
    from test_flashmask_backward import _random_intervals
    b, s, h, hk = 2, 333, 4, 2
    kept = []

    def call(poison):
        x = _random_intervals(rng, b, heads, s, s, n, causal)
        q, k, v, dout = torch_inputs(rng, b, s, s, h, hk, d, "bfloat16") + (
            torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16),)
        xt = torch.from_numpy(x).cuda()
        kept.append(xt)  # alive: each call's indices at a pointer no earlier call had
        out = torch.full_like(q, float("nan")) if poison else None
        o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, out=out, startend_row_indices=xt)
        bufs = [torch.full_like(t, float("nan")) for t in (q, k, v)] if poison else [None] * 3
        grads = backward.attention_backward(dout, q, k, v, o, lse, causal=causal, startend_row_indices=xt,
                                            dq=bufs[0], dk=bufs[1], dv=bufs[2])
        return (q, k, v, dout, x), o, grads

    call(False), call(True)  # checked, planned, kept (without and with the caller's buffers)

    def boom(*a, **k):
        raise AssertionError("the general path ran for a repeated call")
    monkeypatch.setattr(validate, "flashmask", boom)
    for poison in (True, False):
        (q, k, v, dout, x), o, grads = call(poison)
        check(o, q, k, v, causal=causal, startend_row_indices=x)
        args = [to_np(t) for t in (dout, q, k, v)]
        ref64 = reference.attention_backward(*args, causal=causal, startend_row_indices=x)
        same = reference.attention_backward(*args, causal=causal, startend_row_indices=x, precision="same")
        for name, g, r, sm in zip(("dq", "dk", "dv"), grads, ref64, same):
            err, bound = max_abs_err(to_np(g), r), 2 * max_abs_err(sm, r) + 2e-4
            assert err <= bound, f"{name}: max error {err:.3g} exceeds bound {bound:.3g}"
    assert len({t.data_ptr() for t in kept}) == len(kept)
