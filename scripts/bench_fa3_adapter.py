"""SDPA through PyTorch's FA3 adapter (torch.nn.attention._fa3) registered on cuflash.flash_attn3,
against cuflash.flash_attn3.flash_attn_func on the same tensors, SDPA's own flash and cuDNN
kernels (timed before the adapter is registered; "n/a" where a backend refuses the shape), and
the time of one copy of the output (what torch.ops.flash_attn_3.fwd used to add when given
``out``, as the adapter does on every call). bf16, d = 128; CUDA events, median of 7 x 50 calls.
Needs a CUDA GPU and PyTorch 2.11+.

    PYTHONPATH=. python3 scripts/bench_fa3_adapter.py
"""
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, _fa3, sdpa_kernel

import cuflash.flash_attn3 as fa3

SHAPES = [  # (batch, query heads, KV heads, seqlen_q, seqlen_k, causal)
    (1, 16, 16, 8192, 8192, True), (4, 16, 16, 2048, 2048, True), (8, 32, 8, 1, 4096, False),
    (1, 32, 8, 1, 32768, False)]


def timed(fn, reps=50):
    """Median µs per call of ``fn`` over 7 rounds of ``reps`` calls."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(7):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        rounds.append(a.elapsed_time(b) * 1000 / reps)
    return statistics.median(rounds)


def sdpa_alone(backend, q, k, v, causal):
    """Median µs per SDPA call on ``backend`` (PyTorch's own kernels), or None where it refuses."""
    try:
        with sdpa_kernel(backend):
            return timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                enable_gqa=q.shape[1] != k.shape[1]))
    except RuntimeError:
        return None


def main():
    shapes = []
    for b, hq, hk, sq, sk, causal in SHAPES:
        q = torch.randn(b, hq, sq, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, hk, sk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        native = {name: sdpa_alone(be, q, k, v, causal) for name, be in (
            ("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION))}
        shapes.append((b, hq, hk, sq, sk, causal, q, k, v, native))
    handle = _fa3.register_flash_attention_fa3(module_path="cuflash.flash_attn3")
    try:
        for b, hq, hk, sq, sk, causal, q, k, v, native in shapes:
            qb, kb, vb = (x.transpose(1, 2) for x in (q, k, v))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal,  # noqa: E731
                                                              enable_gqa=hq != hk)
                adapter, ref = timed(sdpa), sdpa()
            function = timed(lambda: fa3.flash_attn_func(qb, kb, vb, causal=causal))
            out = fa3.flash_attn_func(qb, kb, vb, causal=causal)
            dst = torch.empty_like(q).transpose(1, 2)
            copy = timed(lambda: dst.copy_(out))
            own = " | ".join(f"SDPA {n} {'n/a' if t is None else f'{t:8.1f} us'}" for n, t in native.items())
            print(f"b{b} h{hq}/{hk} sq{sq} sk{sk} causal={causal}: SDPA via FA3 adapter {adapter:8.1f} us | "
                  f"flash_attn_func {function:8.1f} us | {own} | one copy of out {copy:6.1f} us | "
                  f"equal {torch.equal(ref.transpose(1, 2), out)}", flush=True)
    finally:
        handle.remove()


if __name__ == "__main__":
    main()
