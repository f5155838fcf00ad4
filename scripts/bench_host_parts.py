"""Where an eager forward + backward step's host time goes, cuflash.torch against SDPA's flash
ops (b=2, s=256, 8 heads, d=64, causal, bf16; host µs, median of seven interleaved rounds of
1000 calls). Run on one core too (``taskset -c 2 python ...``): the machine's cross-core thread
hand-offs move every figure by tens of µs.

    python scripts/bench_host_parts.py kinds   # trivial Python and C++ autograd Functions, SDPA, cuflash.torch,
                                               # SDPA with cuflash active (CUFLASH_CPP_NODE=0: without the C++ node)
    python scripts/bench_host_parts.py parts   # each body and piece alone, on the main thread
    python scripts/bench_host_parts.py sdpa    # SDPA's flash path on views, PyTorch's and cuflash's: forward alone and
                                               # the step, against cuflash.torch's
    python scripts/bench_host_parts.py busy    # a fixed Python loop in a trivial Function's forward or backward
    python scripts/bench_host_parts.py insitu  # cuflash.torch's bodies timed inside the step against alone

``kinds`` builds a C++ torch::autograd::Function with torch.utils.cpp_extension.load_inline
(-O3; g++ and ninja; ``EXT_DIR`` keeps the build)."""
import os
import statistics
import sys
import time

import torch

B, S, H, D = 2, 256, 8, 64
BF = dict(device="cuda", dtype=torch.bfloat16)
CPP = r'''
using namespace torch::autograd;
struct Triv : public Function<Triv> {
  static tensor_list forward(AutogradContext* ctx, at::Tensor q, at::Tensor k, at::Tensor v) {
    auto o = at::empty_like(q);
    auto lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
    ctx->save_for_backward({q, k, v, o, lse});
    ctx->mark_non_differentiable({lse});
    ctx->set_materialize_grads(false);
    return {o, lse};
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list g) {
    auto s = ctx->get_saved_variables();
    return {at::empty_like(s[0]), at::empty_like(s[1]), at::empty_like(s[2])};
  }
};
std::vector<at::Tensor> triv(at::Tensor q, at::Tensor k, at::Tensor v) { return Triv::apply(q, k, v); }
'''


def run(fn, n=1000):
    """Host µs per call over n back-to-back calls (bench.host_us, one round)."""
    from cuflash.bench import host_us
    return host_us(fn, reps=n, rounds=1)


def report(cases, rounds=7):
    """Each case is a call, or (call, on, off): on() and off() run around its rounds, untimed."""
    cases = {k: c if isinstance(c, tuple) else (c, None, None) for k, c in cases.items()}

    def timed(fn, on, off, n=1000):
        if on:
            on()
        try:
            return run(fn, n)
        finally:
            if off:
                off()

    for c in cases.values():
        timed(*c, n=200)
    res = {k: [] for k in cases}
    for _ in range(rounds):
        for name, c in cases.items():
            res[name].append(timed(*c))
    for name, r in res.items():
        print(f"{name:30s} median {statistics.median(r):7.1f} us  (min {min(r):.1f}, max {max(r):.1f})", flush=True)


N_BUSY = 1500


def busy():
    x = 0
    for i in range(N_BUSY):
        x += i
    return x


class Trivial(torch.autograd.Function):
    """cuflash.torch's eager Function's shape (five saved tensors, a non-differentiable LSE),
    allocation bodies; ``where`` adds the busy loop to the forward ("fwd") or backward ("bwd")."""
    @staticmethod
    def forward(ctx, q, k, v, where=None):
        if where == "fwd":
            busy()
        o, lse = torch.empty_like(q), q.new_empty((B, H, S), dtype=torch.float32)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.where = where
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        if ctx.where == "bwd":
            busy()
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


def main():
    what = sys.argv[1] if len(sys.argv) > 1 else "kinds"
    import cuflash.torch as ct
    from cuflash.torch import ops
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (torch.randn(B, S, H, D, **BF, requires_grad=True) for _ in range(3))
    qt, kt, vt = (torch.randn(B, H, S, D, **BF, requires_grad=True) for _ in range(3))
    g, gt = torch.randn(B, S, H, D, **BF), torch.randn(B, H, S, D, **BF)

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True),
                                       (qt, kt, vt), gt)

    def cf():
        return torch.autograd.grad(ct.attention(q, k, v, causal=True), (q, k, v), g)

    def views_fwd():  # as models call it: SDPA on (batch, seqlen, nheads, d) leaves seen as (batch, nheads, seqlen, d)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)),
                                                                    is_causal=True)

    def sdpa_views():  # its output seen back as (batch, seqlen, nheads, d): the output's gradient has its strides
        return torch.autograd.grad(views_fwd().transpose(1, 2), (q, k, v), g)

    cf(), sdpa()
    p = ops._prepared_for(q, k, v, True, None, (-1, -1), 0.0, False)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out, lse = p.fwd(qd, kd, vd, None)
    if what == "kinds":
        import cuflash.torch.sdpa as sd
        from torch.utils.cpp_extension import load_inline
        ext = load_inline("cuflash_trivial_function_o3", cpp_sources=CPP, functions=["triv"],
                          extra_cflags=["-O3"], build_directory=os.environ.get("EXT_DIR") or None)
        report({"python Function (trivial)": lambda: torch.autograd.grad(Trivial.apply(q, k, v)[0], (q, k, v), g),
                "C++ Function (trivial)": lambda: torch.autograd.grad(ext.triv(q, k, v)[0], (q, k, v), g),
                "SDPA flash": sdpa, "cuflash.torch": cf, "SDPA flash on views": sdpa_views,
                "SDPA on views, cuflash active": (sdpa_views, sd.activate_sdpa, sd.restore_sdpa)})
    elif what == "sdpa":
        import cuflash.torch.sdpa as sd

        def active(fn):
            return fn, sd.activate_sdpa, sd.restore_sdpa
        report({"SDPA on views, forward": views_fwd, "SDPA on views, forward, cuflash active": active(views_fwd),
                "cuflash.torch, forward": lambda: ct.attention(q, k, v, causal=True),
                "SDPA on views, step": sdpa_views, "SDPA on views, step, cuflash active": active(sdpa_views),
                "cuflash.torch, step": cf}, rounds=5)
    elif what == "parts":
        from cuflash import arrays, backward as bw
        a = torch.ops.aten
        qtd, ktd, vtd = qt.detach(), kt.detach(), vt.detach()
        sout, slse, cq, ck, mq, mk, ps, po, _ = a._scaled_dot_product_flash_attention(qtd, ktd, vtd, 0.0, True)
        r = p.bwd
        ws = qd.new_empty((r.ws_floats,), dtype=torch.float32)
        grads = [torch.empty_like(x) for x in (qd, kd, vd)]
        ptrs = dict(q=qd.data_ptr(), k=kd.data_ptr(), v=vd.data_ptr(), dout=g.data_ptr(), out=out.data_ptr(),
                    lse=lse.data_ptr(), dq=grads[0].data_ptr(), dk=grads[1].data_ptr(), dv=grads[2].data_ptr(),
                    ws=ws.data_ptr())
        stream = arrays.torch_stream(q.device.index)
        print("backward kernels:", ", ".join(la.kernel.name for la in r.launches))

        def allocs():
            [torch.empty_like(x, memory_format=torch.contiguous_format) for x in (qd, kd, vd)]
            qd.new_empty((r.ws_floats,), dtype=torch.float32)

        def fwd_grad_sdpa():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

        report({"fwd+bwd cuflash.torch": cf, "fwd+bwd SDPA": sdpa,
                "fwd (grad) cuflash.torch": lambda: ct.attention(q, k, v, causal=True),
                "fwd (grad) SDPA": fwd_grad_sdpa,
                "fwd body (prepared)": lambda: p.fwd(qd, kd, vd, None),
                "fwd op SDPA (no grad)": lambda: a._scaled_dot_product_flash_attention(qtd, ktd, vtd, 0.0, True),
                "bwd body (prepared)": lambda: r(g, qd, kd, vd, out, lse, None, None, None),
                "bwd op SDPA": lambda: a._scaled_dot_product_flash_attention_backward(
                    gt, qtd, ktd, vtd, sout, slse, cq, ck, mq, mk, 0.0, True, ps, po),
                "bwd allocations (3 + ws)": allocs,
                "bwd launches (fire)": lambda: bw.fire(r.launches, ptrs, stream)})
    elif what == "busy":
        cases = {f"busy loop in {w}": (lambda w=w: torch.autograd.grad(Trivial.apply(q, k, v, w)[0], (q, k, v), g))
                 for w in ("neither", "fwd", "bwd")}
        report(dict(cases, **{"busy loop alone": busy}))
    elif what == "insitu":
        acc = dict.fromkeys(("fwd", "bwd"), 0)
        f0, b0 = p.fwd, p.bwd

        def timed(fn, key):
            def call(*a):
                t = time.perf_counter_ns()
                res = fn(*a)
                acc[key] += time.perf_counter_ns() - t
                return res
            return call

        for _ in range(5):
            p.fwd, p.bwd = f0, b0
            step = run(cf)
            p.fwd, p.bwd = timed(f0, "fwd"), timed(b0, "bwd")
            acc.update(fwd=0, bwd=0)
            step_timed = run(cf)
            loop = {x: acc[x] / 1e6 for x in acc}
            p.fwd, p.bwd = f0, b0
            fa, ba = run(lambda: f0(qd, kd, vd, None)), run(lambda: b0(g, qd, kd, vd, out, lse, None, None, None))
            print(f"step {step:6.1f} (timed {step_timed:6.1f}) | in the step: fwd body {loop['fwd']:5.1f} "
                  f"bwd body {loop['bwd']:5.1f} | alone: fwd body {fa:5.1f} bwd body {ba:5.1f}", flush=True)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
