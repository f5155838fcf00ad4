"""Host time of a Python torch.autograd.Function shaped like cuflash.torch's eager one (four
inputs, two outputs, five saved tensors, one gradient back, allocations only) against a C++ op
with a C++ autograd node of the same shape (SDPA's CPU flash op), on tiny CPU tensors: what the
Python Function itself costs the autograd engine, without a GPU. Median µs of seven rounds.
Run: python scripts/bench_function_floor.py"""
import time, statistics, torch
torch.set_num_threads(1)
q, k, v = (torch.randn(1, 1, 1, 8, requires_grad=True) for _ in range(3))

class F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, p):
        o = torch.empty_like(q); lse = q.new_empty((1, 1, 1))
        ctx.save_for_backward(q, k, v, o, lse); ctx.p = p
        ctx.mark_non_differentiable(lse); ctx.set_materialize_grads(False)
        return o, lse
    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None

def t(fn, n=20000):
    for _ in range(500): fn()
    r = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n): fn()
        r.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(r)

fb_py = lambda: torch.autograd.grad(F.apply(q, k, v, None)[0], (q, k, v), torch.ones(1, 1, 1, 8))
fw_py = lambda: F.apply(q, k, v, None)
sd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
fb_c = lambda: torch.autograd.grad(sd(q, k, v)[0], (q, k, v), torch.ones(1, 1, 1, 8))
fw_c = lambda: sd(q, k, v)
with torch.no_grad():
    fw_c_ng = t(lambda: sd(q, k, v))
print(f"python Function: forward {t(fw_py):.2f}, forward+grad {t(fb_py):.2f} us")
print(f"C++ op (SDPA CPU flash): forward {t(fw_c):.2f} (no grad {fw_c_ng:.2f}), forward+grad {t(fb_c):.2f} us")
print(torch.__version__)
