"""Host time per forward + backward step of SDPA with cuflash active, in one process and
interleaved rounds: through the forward op's autograd override ("override"), the same with the
override bypassed (the aten op's autograd node and the CUDA-key kernels: "aten node"),
cuflash.torch.attention (also on transposed views, its output transposed back), and SDPA with
PyTorch's kernels. Run: python scripts/bench_sdpa_host.py"""
import statistics, time
import torch
import cuflash.torch as ct
import cuflash.torch.sdpa as sd
F = torch.nn.functional.scaled_dot_product_attention
bf = dict(device="cuda", dtype=torch.bfloat16)
g = torch.randn(2, 256, 8, 64, **bf).requires_grad_()
do = torch.randn(2, 256, 8, 64, **bf)
t, dot = g.transpose(1, 2), do.transpose(1, 2)
eager = sd._eager
def sdpa_step():
    return torch.autograd.grad(F(t, t, t, is_causal=True), g, dot)
def sdpa_fwd():
    return F(t, t, t, is_causal=True)
def ct_step():
    return torch.autograd.grad(ct.attention(g, g, g, causal=True), g, do)
def ct_transposed_step():  # cuflash.torch with the transposes an SDPA-layout graph would hold
    x = t.transpose(1, 2)
    return torch.autograd.grad(ct.attention(x, x, x, causal=True).transpose(1, 2), g, dot)
def mode(name):
    if name in ("override", "aten node", "override fwd", "aten node fwd"):
        ct.activate_sdpa()
        sd._eager = eager if name.startswith("override") else (lambda *a: None)
    else:
        ct.restore_sdpa()
CASES = {"override": sdpa_step, "aten node": sdpa_step, "cuflash.torch": ct_step,
         "cuflash.torch transposed": ct_transposed_step, "SDPA": sdpa_step,
         "override fwd": sdpa_fwd, "aten node fwd": sdpa_fwd, "SDPA fwd": sdpa_fwd}
res = {n: [] for n in CASES}
for r in range(7):
    for name, fn in CASES.items():
        mode(name)
        for _ in range(100): fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(1000): fn()
        torch.cuda.synchronize()
        res[name].append((time.perf_counter() - t0) * 1e3)
ct.restore_sdpa()
for n, v in res.items():
    print(f"{n:24s} median {statistics.median(v):7.1f} us  (min {min(v):.1f}, max {max(v):.1f})")
