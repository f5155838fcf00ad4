"""FlashMask forward and backward on the shapes and masks of PaddlePaddle's own FlashMask tests:
query and key lengths that differ by one or two around tile edges (causal masks aligned
bottom-right), a batch of 2840 short sequences, indices with one head or one per KV head,
GQA and MQA, and Paddle's mask generators as they scale their documents and windows to the key
length and clip every bound to seqlen_q. The generators below are written from Paddle's
documented semantics (each bound a row index in [0, seqlen_q]).

Each case checks ``cuflash.torch.attention(..., startend_row_indices=...)``'s output and
gradients against a float32 PyTorch reference on the GPU with flash-attn's rule: the error may
be at most twice that of the same computation in the inputs' precision, plus a small atol."""
import math

import numpy as np
import pytest

from conftest import requires_gpu, requires_torch


# ---------------------------------------------------------------------------------------------
# Mask generators: int32 (batch, heads, seqlen_k, n) NumPy indices and the causal flag. Lengths
# are given for 8192 keys and scaled to seqlen_k (as Paddle's tests do).

def _scaled(xs, sk):
    return [int(x * sk / 8192) for x in xs] if sk != 8192 else list(xs)


def _out(cols, b, h, sk, sq):
    x = np.stack([np.asarray(c, np.int64) for c in cols], -1).reshape(1, 1, sk, len(cols))
    return np.ascontiguousarray(np.broadcast_to(np.clip(x, 0, sq), (b, h, sk, len(cols)))).astype(np.int32)


def _docs(sk):
    d = _scaled([2538, 1742, 3213], sk)
    d[-1] += sk - sum(d)  # the last document takes the padding
    return d


def sliding_window(b, sq, sk, h):
    w = int(1024 * sk / 8192) if sk != 8192 else 1024
    return _out([np.arange(w, sk + w)], b, h, sk, sq), True


def causal_document(b, sq, sk, h):
    d = _docs(sk)
    return _out([np.repeat(np.cumsum(d), d)], b, h, sk, sq), True


def document(b, sq, sk, h):
    d = _docs(sk)
    ends, starts = np.cumsum(d), np.cumsum([0] + d[:-1])
    return _out([np.repeat(ends, d), np.repeat(starts, d)], b, h, sk, sq), False


def share_question(b, sq, sk, h):
    d = _scaled([2538, 1742, 3213], sk)
    total = sum(d)
    cols = [total] * d[0]  # the question: seen by every answer
    end = d[0]
    for n in d[1:]:
        end += n
        cols += [end] * n
    cols += [end] * (sk - total)
    return _out([cols], b, h, sk, sq), True


def global_sliding_window(b, sq, sk, h, g=16):
    left, right = _scaled([512, 512], sk)
    lts = np.minimum(np.arange(left + 1, sk + left + 1), sq)
    lts[:g] = sq
    uts = np.full(sk, g)
    uts[:g + right + 1] = 0
    ute = np.arange(-right, sk - right)
    ute[:g + right + 1] = 0
    return _out([lts, np.full(sk, sq), uts, ute], b, h, sk, sq), False


def causal_blockwise(b, sq, sk, h):
    d = _scaled([2538, 1742, 3213], sk)
    pad = sk - sum(d)
    ends = np.cumsum(d)
    start = list(np.repeat(ends, d)) + [ends[-1]] * pad
    end = [ends[-2]] * ends[-2] + [ends[-1]] * d[-1] + [sk] * pad
    return _out([start, end], b, h, sk, sq), True


def prefix_lm_document(b, sq, sk, h):
    docs = [tuple(_scaled(p, sk)) for p in ((1024, 2538), (1742, 1742), (512, 3213))]
    total = sum(n for _, n in docs)
    lens = [n for _, n in docs]
    lts = list(np.repeat(np.cumsum(lens), lens)) + [total] * (sk - total)
    ute, at = [], 0
    for p, n in docs:
        ute += [at] * p + list(range(at + p, at + n))
        at += n
    ute += [total] * (sk - total)
    return _out([lts, ute], b, h, sk, sq), False


def prefix_lm_causal(b, sq, sk, h):
    p = _scaled([1024], sk)[0]
    return _out([np.full(sk, sk), [0] * p + list(range(p, sk))], b, h, sk, sq), False


def qk_sparse(b, sq, sk, h):
    pairs = [tuple(_scaled(p, sk)) for p in ((1024, 538), (2358, 1700))]
    start, end, last = [], [], 0
    for off, n in pairs:
        start += [sk] * (off - last) + list(range(off, off + n))
        end += [sk] * (off - last) + [off + n] * n
        last = off + n
    start += [sk] * (sk - last)
    end += [sk] * (sk - last)
    return _out([start, end], b, h, sk, sq), True


def random_eviction(b, sq, sk, h, seed=0):
    """From row start_row on, each row evicts one earlier key: that key's LTS is the row."""
    rng = np.random.default_rng(seed)
    start_row = int(4096 * sk / 8192) if sk != 8192 else 4096
    x = np.full((b, h, sk, 1), sk + 1, np.int64)
    for bi in range(b):
        for hi in range(h):
            pos = rng.choice(sk - 1, sk - start_row, replace=False)
            rows = np.arange(start_row, sk)
            pos = np.concatenate([pos[pos < rows - 1], pos[pos >= rows - 1]])
            x[bi, hi, pos, 0] = rows
    return np.clip(x, 0, sq).astype(np.int32), True


GENERATORS = {f.__name__: f for f in (sliding_window, causal_document, document, share_question,
                                       global_sliding_window, causal_blockwise, prefix_lm_document,
                                       prefix_lm_causal, qk_sparse, random_eviction)}
GENERATORS["full"] = lambda b, sq, sk, h: (None, False)
GENERATORS["causal"] = lambda b, sq, sk, h: (None, True)


def test_generators_give_valid_indices():
    """Every generator's bounds lie in [0, seqlen_q], with start <= end where both are given."""
    import cuflash
    for name, gen in GENERATORS.items():
        for sq, sk in ((300, 300), (127, 128), (128, 127), (1, 128), (32, 32)):
            x, causal = gen(2, sq, sk, 3)
            if x is not None:
                cuflash.validate.check_startend_row_indices(x, 2, 3, sq, sk, causal)
    x, _ = causal_document(1, 8192, 8192, 1)
    assert list(np.unique(x)) == [2538, 4280, 8192]


@requires_torch
@pytest.mark.parametrize("sq, sk", [(300, 300), (127, 128), (128, 127), (1, 128)])
def test_reference_mask_is_cuflash_masks_reading(sq, sk):
    """The GPU test's dense mask (torch, here on the CPU) is cuflash.masks.to_dense's, bottom-right
    causal band included, per index head broadcast over the query heads of its group."""
    from cuflash import masks
    for name, gen in GENERATORS.items():
        x, causal = gen(2, sq, sk, 2)
        keep = _dense_keep(x, causal, 2, 4, sq, sk, "cpu").numpy()
        if x is None:
            want = np.ones((1, 1, sq, sk), bool)
            if causal:
                want &= np.arange(sk)[None, :] <= np.arange(sq)[:, None] + sk - sq
        else:
            want = ~masks.to_dense(x, sq, causal).repeat(2, 1)
        assert np.array_equal(keep, np.broadcast_to(want, keep.shape)), name


# ---------------------------------------------------------------------------------------------
# Shapes: (batch, seqlen_q, seqlen_k, nheads, nheads_kv), Paddle's list; of its product of short
# lengths a fixed sample (every length appears).

SHAPES = [(2840, 32, 32, 16, 4), (1, 300, 300, 16, 16), (2, 8192, 8192, 14, 1), (1, 128, 127, 1, 1),
          (1, 127, 128, 1, 1), (2, 16383, 16384, 4, 1), (2, 16384, 16383, 4, 1), (2, 16383, 16385, 4, 1),
          (2, 16385, 16383, 4, 1), (2, 4096, 4224, 6, 2), (2, 4224, 4096, 6, 6), (2, 4224, 4224, 6, 1)]
_QS = [1, 64, 128, 256, 239, 799, 113, 108, 384, 640, 512, 1024, 1023]
_KS = [128, 192, 256, 203, 217, 211, 512, 1024, 1023]
SHAPES += [(9, sq, _KS[i % len(_KS)], 6, (6, 2, 1)[i % 3]) for i, sq in enumerate(_QS)]


def _cases():
    """(shape, generator, index heads, d): every shape with every generator at d = 64 or 128 and
    one or nheads_kv index heads alternating, so that each combination appears."""
    out = []
    for i, shape in enumerate(SHAPES):
        for j, name in enumerate(GENERATORS):
            ih = (1, shape[4])[(i + j) % 2]
            d = (64, 128)[(i + j // 2) % 2]
            big = shape[1] * shape[2] * shape[0] * shape[3] > 2 ** 31
            if big and (i + j) % 4:  # the largest shapes: a quarter of the generators
                continue
            out.append(pytest.param(shape, name, ih, d, id=f"{'x'.join(map(str, shape))}-{name}-h{ih}-d{d}"))
    return out


def _dense_keep(x, causal, b, h, sq, sk, device):
    """Boolean (b, h or 1, sq, sk) of the visible pairs (torch, on the GPU)."""
    import torch
    rows = torch.arange(sq, device=device).view(1, 1, sq, 1)
    cols = torch.arange(sk, device=device).view(1, 1, 1, sk)
    keep = torch.ones(1, 1, sq, sk, dtype=torch.bool, device=device)
    if causal:
        keep = keep & (cols <= rows + sk - sq)
    if x is None:
        return keep
    xt = torch.from_numpy(x).to(device).long().transpose(2, 3)  # (b, hi, n, sk)
    col = lambda c: xt[:, :, c].unsqueeze(2)  # (b, hi, 1, sk)
    n = x.shape[-1]
    masked = rows >= col(0)
    if (causal and n == 2) or (not causal and n == 4):
        masked = masked & (rows < col(1))
    if not causal:
        if n == 4:
            masked = masked | ((rows >= col(2)) & (rows < col(3)))
        else:
            masked = masked | (rows < col(1))
    keep = keep & ~masked
    return keep.repeat_interleave(h // x.shape[1], 1)


def _reference(q, k, v, keep, do, upcast):
    """flash-attn's attention_ref and its gradients: in float32 (upcast) or in the inputs'
    precision; rows that see no key give 0. Computed a few batch elements at a time, so that a
    chunk's float32 scores stay near 1 GiB (the 16k-key shapes need 4 GiB per element)."""
    import torch
    dt, (b, sq, h, d), sk = q.dtype, q.shape, k.shape[1]
    g = h // k.shape[2]
    step = max(1, 2 ** 28 // (h * sq * sk))
    outs, grads = [], []
    for i in range(0, b, step):
        leaves = [t[i:i + step].detach().clone().requires_grad_() for t in (q, k, v)]
        qc, kc, vc = ((t.float() if upcast else t).transpose(1, 2) for t in leaves)
        kc, vc = kc.repeat_interleave(g, 1), vc.repeat_interleave(g, 1)
        s = torch.matmul(qc / math.sqrt(d), kc.transpose(-1, -2))
        s = s.masked_fill(~(keep[i:i + step] if keep.shape[0] > 1 else keep), float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)
        o = torch.matmul(p.to(vc.dtype), vc).transpose(1, 2).to(dt)
        grads.append(torch.autograd.grad(o, leaves, do[i:i + step]))
        outs.append(o.detach())
        del s, p
    return torch.cat(outs), [torch.cat(gs) for gs in zip(*grads)]


@requires_gpu
@requires_torch
@pytest.mark.parametrize("shape, name, index_heads, d", _cases())
def test_gpu_paddle_case(shape, name, index_heads, d):
    import torch
    import cuflash.torch as ct
    b, sq, sk, h, hk = shape
    gen = torch.Generator(device="cuda").manual_seed(2024)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=gen)
    q, k, v = mk(b, sq, h, d), mk(b, sk, hk, d), mk(b, sk, hk, d)
    x, causal = GENERATORS[name](b, sq, sk, index_heads)
    keep = _dense_keep(x, causal, b, h, sq, sk, "cuda")
    idx = None if x is None else torch.from_numpy(x).cuda()

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = ct.attention(*leaves, causal=causal, startend_row_indices=idx)
    do = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=gen)
    grads = torch.autograd.grad(out, leaves, do)
    ref, grads_ref = _reference(q, k, v, keep, do, upcast=True)
    pt, grads_pt = _reference(q, k, v, keep, do, upcast=False)

    def rule(got, want, same, extra=0.0):
        atol = 2 * (want + 0.3 - 0.3 - want).abs().max().item() + extra
        err, bound = (got - want).abs().max().item(), 2 * (same - want).abs().max().item() + atol
        return err <= bound + 1e-5, err, bound

    ok, err, bound = rule(out.float(), ref.float(), pt.float())
    assert ok, f"output: max error {err:.3g} > bound {bound:.3g}"
    for what, g, gr, gp in zip("qkv", grads, grads_ref, grads_pt):
        assert torch.isfinite(g).all(), f"d{what} has non-finite values"
        ok, err, bound = rule(g.float(), gr.float(), gp.float(), 2e-4)
        assert ok, f"d{what}: max error {err:.3g} > bound {bound:.3g}"
