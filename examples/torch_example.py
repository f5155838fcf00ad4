"""cuflash with PyTorch: causal GQA attention in bf16, checked against PyTorch's SDPA.

    python examples/torch_example.py
"""
import os
import sys

try:
    import torch
except ImportError:
    sys.exit("This example needs PyTorch with CUDA (pip install torch); it is not installed.")
if not torch.cuda.is_available():
    sys.exit("This example needs a CUDA GPU, and PyTorch sees none.")
try:
    import cuflash
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import cuflash

b, s, h, hk, d = 2, 2048, 16, 4, 128  # GQA: 4 query heads share each K/V head
q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
k = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
v = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)

out = cuflash.attention(q, k, v, causal=True)  # (batch, seqlen, nheads, headdim), like flash-attn

# SDPA wants (batch, nheads, seqlen, headdim) and, without enable_gqa, as many K/V heads as query
# heads. Its is_causal is aligned top-left, which equals flash-attn's bottom-right when sq == sk.
kr, vr = (x.repeat_interleave(h // hk, dim=2) for x in (k, v))
ref = torch.nn.functional.scaled_dot_product_attention(
    q.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2), is_causal=True).transpose(1, 2)
print(f"max |cuflash - SDPA| = {(out.float() - ref.float()).abs().max().item():.2e}")
print(cuflash.plan(q, k, v, causal=True))
