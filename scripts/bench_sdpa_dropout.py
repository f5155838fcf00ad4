"""GPU time of F.scaled_dot_product_attention with and without attention dropout (bf16, eager,
q/k/v transposed views of (batch, seqlen, nheads, d) as a model's projections give them):
PyTorch's flash and cuDNN kernels against cuflash's (``activate_sdpa(dropout=True)``). Forward
alone and forward + backward; median of 30 calls timed with CUDA events, in ms.

    python scripts/bench_sdpa_dropout.py [dropout_p]   # default 0.1
"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cuflash.torch

SHAPES = [(4, 16, 2048, 128, True), (2, 16, 4096, 128, True), (8, 16, 1024, 64, False), (1, 32, 8192, 128, True)]
RUNS = [("flash", SDPBackend.FLASH_ATTENTION, False), ("cudnn", SDPBackend.CUDNN_ATTENTION, False),
        ("cuflash", SDPBackend.FLASH_ATTENTION, True)]


def median_ms(fn, n=30):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(n):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[n // 2]


def main():
    p = float(sys.argv[1]) if len(sys.argv) > 1 else 0.1
    print(f"{torch.cuda.get_device_name()}, PyTorch {torch.__version__}, bf16, ms (forward / forward + backward)")
    print("| b | h | s | d | causal | dropout_p | " + " | ".join(name for name, _, _ in RUNS) + " |")
    print("|" + " --- |" * (6 + len(RUNS)))
    for b, h, s, d, causal in SHAPES:
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
                   for _ in range(3))
        dout = torch.randn_like(q)
        for drop in (0.0, p):
            cells = []
            for name, backend, cuflash_on in RUNS:
                if cuflash_on:
                    cuflash.torch.activate_sdpa(dropout=True)
                else:
                    cuflash.torch.restore_sdpa()

                def fwd():
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=causal)

                try:
                    cells.append(f"{median_ms(fwd):.3f} / {median_ms(lambda: fwd().backward(dout)):.3f}")
                except RuntimeError as e:  # (a backend that refuses the call)
                    cells.append(f"n/a ({str(e).splitlines()[0][:40]})")
            cuflash.torch.restore_sdpa()
            print(f"| {b} | {h} | {s} | {d} | {causal} | {drop} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
