"""Benchmarks for cuflash: prefill TFLOP/s and decode TB/s against PyTorch SDPA, the cost
of sliding windows against full attention, and cuflash.jax under jax.jit against
jax.nn.dot_product_attention.

Timing uses CUDA events after warm-up, takes the median of many repeats and
rotates among several input sets whose total size exceeds 2x L2, so that
inputs are (mostly) read from HBM as they would be in a real model. The JAX
benchmark times with the wall clock instead (`time_sync`): CUDA events on
PyTorch's stream cannot bracket work on XLA's streams.
"""
from __future__ import annotations

import csv
import datetime
import functools
import json
import math
import os
import statistics
import time

_CEILINGS: dict = {}
_SDPA_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION")
_REF_ORDER = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")
DEFAULT_DECODE_SHAPES = tuple((h, hk, b, sk) for h, hk in ((32, 8), (28, 4))
                              for b in (1, 8, 64) for sk in (128, 600, 4096, 32768))
BACKWARD_FLOPS = 2.5  # the backward's FLOPs per forward FLOP (FA2's convention: 5 matmuls against 2)
JAX_IMPLS = ("cuflash_jax", "cudnn", "xla")  # cuflash.jax and jax.nn.dot_product_attention's two


def _torch():
    try:
        import torch
    except ImportError as e:
        raise RuntimeError("bench needs PyTorch with CUDA") from e
    if not torch.cuda.is_available():
        raise RuntimeError("bench needs PyTorch with CUDA")
    return torch


def _jax():
    """JAX with a CUDA GPU backend, set up to share the GPU with PyTorch."""
    # XLA's GPU client takes 75% of the GPU's memory when it starts unless told not to, which
    # would starve PyTorch in this process (the input sets and the cuflash.torch rows). The
    # variable is read when that client starts, so it is set before JAX's first use of the GPU;
    # a value the caller set stands.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import jax
    except ImportError as e:
        raise RuntimeError("bench jax needs JAX with a CUDA GPU backend (pip install 'jax[cuda13]')") from e
    try:
        jax.devices("gpu")
    except RuntimeError as e:
        raise RuntimeError(f"bench jax needs JAX with a CUDA GPU backend: {e}") from e
    return jax


def _flops(batch, seqlen, nheads, d, causal):
    """Forward FLOPs of attention with seqlen_q == seqlen_k, FlashAttention's count: two matmuls,
    4·b·s²·h·d, halved when causal."""
    return 4 * batch * seqlen * seqlen * nheads * d / (2 if causal else 1)


def time_cuda(fn, inputs_list, warmup=10, reps=50, batch=1, hide_launch=False, stats=None):
    """Median milliseconds per call of fn(*inputs), cycling through inputs_list.

    Each timed sample covers `batch` consecutive calls (batch=None picks a batch
    lasting ~1 ms, for tiny kernels). hide_launch=True queues a GPU sleep before
    each sample so the host can run ahead and the events see GPU time only.
    If `stats` is a dict, the host time per call (ms) is stored in stats["host_ms"].
    """
    torch = _torch()
    n, k = len(inputs_list), 1
    fn(*inputs_list[0])  # first call may compile / build plans: not timed at all
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(max(1, warmup)):
        fn(*inputs_list[k % n])
        k += 1
    host_ms = (time.perf_counter() - t0) * 1e3 / max(1, warmup)
    torch.cuda.synchronize()
    if batch is None:  # estimate GPU time per call, then aim for ~1 ms per sample
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(10):
            fn(*inputs_list[k % n])
            k += 1
        e.record()
        torch.cuda.synchronize()
        batch = max(1, min(200, int(1.0 / max(s.elapsed_time(e) / 10, 1e-4))))
    sleep = hide_launch and hasattr(torch.cuda, "_sleep")
    cycles = int(min(2e8, host_ms * batch * 1.5 * 2e6))  # ~2e6 SM cycles per ms
    events = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if sleep:
            torch.cuda._sleep(cycles)
        s.record()
        for _ in range(batch):
            fn(*inputs_list[k % n])
            k += 1
        e.record()
        events.append((s, e))
        if sleep:
            torch.cuda.synchronize()  # keep the sleep meaningful for the next sample
    torch.cuda.synchronize()
    if stats is not None:
        stats["host_ms"] = host_ms
    return statistics.median(s.elapsed_time(e) / batch for s, e in events)


def time_sync(fn, inputs_list, sync, warmup=3, reps=20, sample_ms=10.0):
    """Median wall-clock milliseconds per call of fn(*inputs), cycling through inputs_list.

    For asynchronous frameworks (JAX, PyTorch on CUDA): each sample issues a batch of calls and
    waits once, `sync(out)` on the last call's output (`jax.block_until_ready`; for PyTorch,
    `torch.cuda.synchronize`), so the GPU's work is timed to its end. The first call (which may
    compile) is not timed; the batch is sized from the warm-up so that a sample lasts about
    `sample_ms`, which makes the wait and the first launch a small part of it.
    """
    n, k = len(inputs_list), 1
    sync(fn(*inputs_list[0]))
    t0 = time.perf_counter()
    for _ in range(max(1, warmup)):
        out = fn(*inputs_list[k % n])
        k += 1
    sync(out)
    per_ms = (time.perf_counter() - t0) * 1e3 / max(1, warmup)
    batch = max(1, min(200, int(sample_ms / max(per_ms, 1e-3))))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(batch):
            out = fn(*inputs_list[k % n])
            k += 1
        sync(out)
        samples.append((time.perf_counter() - t0) * 1e3 / batch)
    return statistics.median(samples)


def _make_sets(torch, shapes, dtype, extra_bytes=0, min_sets=4):
    """Enough random input sets that their total exceeds max(2*L2, 120 MB)."""
    elem = torch.empty((), dtype=dtype).element_size()
    per = sum(math.prod(s) for s in shapes) * elem + extra_bytes
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or (50 << 20)
    n = max(min_sets, math.ceil(max(2 * l2, 120 << 20) / per))
    free, _ = torch.cuda.mem_get_info()
    n = max(1, min(n, int(0.4 * free) // per, 1024))
    return [tuple(torch.randn(s, device="cuda", dtype=dtype) for s in shapes) for _ in range(n)]


def _sdpa(torch, causal, gqa):
    F = torch.nn.functional.scaled_dot_product_attention
    kw = {"enable_gqa": True} if gqa else {}
    return lambda q, k, v: F(q, k, v, is_causal=causal, **kw)


def _time_sdpa(torch, backend, sets_t, causal, gqa, warmup, reps, **kw):
    """Median ms of SDPA with one backend forced; None if the backend refuses."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    try:
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return time_cuda(_sdpa(torch, causal, gqa), sets_t, warmup, reps, **kw)
    except Exception:  # unsupported shape/dtype/GQA for this backend
        return None


def _max_diff(torch, out, q, k, v, causal, gqa):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for backend in _REF_ORDER:
        try:
            with sdpa_kernel(getattr(SDPBackend, backend)):
                ref = _sdpa(torch, causal, gqa)(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            return (out.float() - ref.transpose(1, 2).float()).abs().max().item()
        except Exception:
            continue
    return None


def _plan(cuflash, q, k, v, causal):
    try:
        p = cuflash.plan(q, k, v, causal=causal)
        return "+".join(p.kernels), getattr(p, "num_splits", None)
    except AttributeError:
        return None, None
    except Exception as e:  # a labelling failure must not stop the sweep
        return f"plan failed: {type(e).__name__}", None


def _div(a, b):
    return a / b if a is not None and b else None


def measure_ceilings(reps=20, refresh=False):
    """Copy TB/s (read+write), read-only TB/s (fp32 sum) and bf16 GEMM TFLOP/s (8192^3)."""
    if _CEILINGS and not refresh:
        return dict(_CEILINGS)
    torch = _torch()
    free, _ = torch.cuda.mem_get_info()
    nbytes = min(2 << 30, int(free * 0.4)) // 4 * 4
    src = torch.empty(nbytes // 4, device="cuda", dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    _CEILINGS["copy_tbps"] = 2 * nbytes / time_cuda(lambda a, b: b.copy_(a), [(src, dst)], 3, reps) / 1e9
    _CEILINGS["read_tbps"] = nbytes / time_cuda(torch.sum, [(src,)], 3, reps) / 1e9  # pure read
    del src, dst
    ab = [(torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16),) * 2]
    _CEILINGS["gemm_tflops"] = 2 * 8192 ** 3 / time_cuda(torch.mm, ab, warmup=5, reps=reps) / 1e9
    del ab
    torch.cuda.empty_cache()
    return dict(_CEILINGS)


def _emit(rows, row, kind, verbose):
    rows.append(row)
    if verbose:
        print(format_table([row], kind).splitlines()[-1], row.get("error", ""), flush=True)


def _prefill_grid(dtypes, head_dims, causal, shapes, model_dim, quick):
    """(dtype, d, causal, batch, seqlen, nheads, (b, s, h, d)) over FlashAttention's grid."""
    if quick:
        dtypes, shapes = ("bfloat16",), ((8, 2048),)
    for dt in dtypes:
        for d in head_dims:
            for c in causal:
                for b, s in shapes:
                    h = model_dim // d
                    yield dt, d, c, b, s, h, (b, s, h, d)


def bench_prefill(dtypes=("bfloat16", "float16"), head_dims=(64, 128, 256), causal=(False, True),
                  shapes=((16, 1024), (8, 2048), (4, 4096), (2, 8192), (1, 16384)),
                  model_dim=2048, reps=30, warmup=5, quick=False, verbose=True):
    """Forward prefill sweep (sq == sk, nheads_k == nheads); returns one dict per config."""
    torch = _torch()
    import cuflash
    gemm = measure_ceilings()["gemm_tflops"]
    rows = []
    for dt, d, c, b, s, h, shp in _prefill_grid(dtypes, head_dims, causal, shapes, model_dim, quick):
        sets = _make_sets(torch, (shp, shp, shp), getattr(torch, dt),
                          extra_bytes=b * s * h * d * 2)
        q, k, v = sets[0]
        row = dict(dtype=dt, d=d, causal=c, batch=b, seqlen=s, nheads=h)
        row["kernels"], _ = _plan(cuflash, q, k, v, c)
        flops = _flops(b, s, h, d, c)
        tf = lambda ms: flops / ms / 1e9 if ms else None  # noqa: E731
        try:
            row["max_diff_vs_sdpa"] = _max_diff(torch, cuflash.attention(q, k, v, causal=c),
                                                q, k, v, c, False)
            row["cuflash_ms"] = time_cuda(lambda q, k, v: cuflash.attention(q, k, v, causal=c),
                                          sets, warmup, reps)
        except Exception as e:
            row.update(cuflash_ms=None, error=f"{type(e).__name__}: {e}")
        sets_t = [tuple(t.transpose(1, 2) for t in x) for x in sets]
        row["cuflash_tflops"] = tf(row["cuflash_ms"])
        row["flash_tflops"] = tf(_time_sdpa(torch, "FLASH_ATTENTION", sets_t, c, False, warmup, reps))
        row["cudnn_tflops"] = tf(_time_sdpa(torch, "CUDNN_ATTENTION", sets_t, c, False, warmup, reps))
        row["ratio_flash"] = _div(row["cuflash_tflops"], row["flash_tflops"])
        row["ratio_cudnn"] = _div(row["cuflash_tflops"], row["cudnn_tflops"])
        row["frac_gemm"] = _div(row["cuflash_tflops"], gemm)
        _emit(rows, row, "prefill", verbose)
        del sets, sets_t, q, k, v
        torch.cuda.empty_cache()
    return rows


def bench_decode(shapes=None, reps=20, warmup=10, d=128, dtype="bfloat16", causal=True,
                 max_kv_gb=40.0, verbose=True):
    """Single-token decode (sq=1) over shapes = [(nheads, nheads_k, batch, seqlen_k), ...].

    cuflash is called with `causal` (bottom-right: same as full attention for sq=1);
    SDPA with is_causal=False. Timings hide host launch overhead (GPU time only);
    the host time per cuflash call is reported as cuflash_host_us.
    """
    torch = _torch()
    import cuflash
    ceil = measure_ceilings()
    tdt = getattr(torch, dtype)
    elem = torch.empty((), dtype=tdt).element_size()
    rows = []
    for h, hk, b, sk in shapes or DEFAULT_DECODE_SHAPES:
        kv = 2 * b * sk * hk * d * elem
        if kv > max_kv_gb * 1e9 or kv > 0.8 * torch.cuda.mem_get_info()[0]:
            if verbose:
                print(f"skip h={h}/{hk} b={b} sk={sk}: K+V {kv / 1e9:.1f} GB", flush=True)
            continue
        total = kv + 2 * b * h * d * elem
        sets = _make_sets(torch, ((b, 1, h, d), (b, sk, hk, d), (b, sk, hk, d)), tdt,
                          extra_bytes=b * h * d * elem)
        q, k, v = sets[0]
        gqa = hk != h
        row = dict(nheads=h, nheads_k=hk, batch=b, seqlen_k=sk, d=d, dtype=dtype, kv_bytes=total)
        row["kernels"], row["num_splits"] = _plan(cuflash, q, k, v, causal)
        kw = dict(batch=None, hide_launch=True)
        st = {}
        try:
            row["max_diff_vs_sdpa"] = _max_diff(torch, cuflash.attention(q, k, v, causal=causal),
                                                q, k, v, False, gqa)
            ms = time_cuda(lambda q, k, v: cuflash.attention(q, k, v, causal=causal),
                           sets, warmup, reps, stats=st, **kw)
        except Exception as e:
            ms, row["error"] = None, f"{type(e).__name__}: {e}"
        sets_t = [tuple(t.transpose(1, 2) for t in x) for x in sets]
        for name, t in (("cuflash", ms),
                        ("flash", _time_sdpa(torch, "FLASH_ATTENTION", sets_t, False, gqa, warmup, reps, **kw)),
                        ("cudnn", _time_sdpa(torch, "CUDNN_ATTENTION", sets_t, False, gqa, warmup, reps, **kw))):
            row[f"{name}_us"] = t * 1e3 if t else None
            row[f"{name}_tbps"] = total / t / 1e9 if t else None
        row["cuflash_host_us"] = st["host_ms"] * 1e3 if st else None
        row["frac_copy"] = _div(row["cuflash_tbps"], ceil["copy_tbps"])
        row["frac_read"] = _div(row["cuflash_tbps"], ceil["read_tbps"])
        _emit(rows, row, "decode", verbose)
        del sets, sets_t, q, k, v
        torch.cuda.empty_cache()
    return rows


def bench_backward(dtypes=("bfloat16", "float16"), head_dims=(64, 128), causal=(False, True),
                   shapes=((16, 1024), (8, 2048), (4, 4096), (2, 8192), (1, 16384)),
                   model_dim=2048, reps=20, warmup=3, quick=False, verbose=True):
    """Backward sweep on the prefill grid: cuflash.backward.attention_backward against the
    backward of SDPA's flash (FA2) and cuDNN backends, each timed alone (gradients of a saved
    forward). FLOPs = 2.5 x the forward's (FA2's convention: 5 matmuls against 2)."""
    torch = _torch()
    import cuflash
    from cuflash.backward import attention_backward
    rows = []
    for dt, d, c, b, s, h, shp in _prefill_grid(dtypes, head_dims, causal, shapes, model_dim, quick):
        sets = _make_sets(torch, (shp, shp, shp, shp), getattr(torch, dt), min_sets=2)
        row = dict(dtype=dt, d=d, causal=c, batch=b, seqlen=s, nheads=h)
        flops = BACKWARD_FLOPS * _flops(b, s, h, d, c)
        tf = lambda ms: flops / ms / 1e9 if ms else None  # noqa: E731
        try:
            saved = [(do, q, k, v, *cuflash.attention(q, k, v, causal=c, return_lse=True))
                     for q, k, v, do in sets]
            fn = lambda do, q, k, v, o, lse: attention_backward(do, q, k, v, o, lse, causal=c)  # noqa: E731
            row["cuflash_ms"] = time_cuda(fn, saved, warmup, reps)
            del saved
        except Exception as e:
            row.update(cuflash_ms=None, error=f"{type(e).__name__}: {e}")
        for name, backend in (("flash", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION")):
            row[f"{name}_tflops"] = tf(_time_sdpa_backward(torch, backend, sets, c, warmup, reps))
        row["cuflash_tflops"] = tf(row["cuflash_ms"])
        row["ratio_flash"] = _div(row["cuflash_tflops"], row["flash_tflops"])
        row["ratio_cudnn"] = _div(row["cuflash_tflops"], row["cudnn_tflops"])
        row["frac_gemm"] = None
        _emit(rows, row, "prefill", verbose)
        del sets
        torch.cuda.empty_cache()
    return rows


def _time_sdpa_backward(torch, backend, sets, causal, warmup, reps):
    """Median ms of one SDPA backend's backward (autograd.grad of a saved forward), or None."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    try:
        with sdpa_kernel(getattr(SDPBackend, backend)):
            saved = []
            for q, k, v, do in sets:
                q, k, v = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
                saved.append((_sdpa(torch, causal, False)(q, k, v), q, k, v, do.transpose(1, 2)))
            fn = lambda o, q, k, v, do: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)  # noqa: E731
            return time_cuda(fn, saved, warmup, reps)
    except Exception:  # unsupported shape/dtype for this backend
        return None


def bench_jax(dtypes=("bfloat16", "float16"), head_dims=(64, 128, 256), causal=(False, True),
              shapes=((16, 1024), (8, 2048), (4, 4096), (2, 8192), (1, 16384)),
              model_dim=2048, reps=20, warmup=3, quick=False, verbose=True):
    """cuflash.jax.attention under jax.jit against jax.nn.dot_product_attention with
    implementation="cudnn" and "xla", on the prefill grid, and cuflash.torch.attention at the
    same shapes in the same process. Two rows per shape: "fwd" (the forward) and "fwd+bwd"
    (jax.jit(jax.grad(loss)) of loss = sum(out * do) for a fixed random do, w.r.t. q, k and v;
    for PyTorch, torch.autograd.grad of the same), counted as (1 + 2.5) x the forward's FLOPs.
    Every implementation is timed by `time_sync`; max |diff| is against cuDNN's output (XLA's
    where cuDNN is unavailable). An implementation that fails (a shape or dtype it refuses, out
    of memory) gets no timing and its error in row["errors"]."""
    torch, jax = _torch(), _jax()
    import jax.dlpack
    rows = []
    for dt, d, c, b, s, h, shp in _prefill_grid(dtypes, head_dims, causal, shapes, model_dim, quick):
        # q, k, v and the cotangent do, made by PyTorch and seen by JAX through DLPack without a
        # copy: every implementation reads the same inputs, so their outputs can be compared.
        sets_t = _make_sets(torch, (shp,) * 4, getattr(torch, dt), min_sets=2)
        sets_j = [tuple(jax.dlpack.from_dlpack(t) for t in x) for x in sets_t]
        for backward in (False, True):
            row = {"dtype": dt, "d": d, "causal": c, "batch": b, "seqlen": s, "nheads": h,
                   "pass": "fwd+bwd" if backward else "fwd", "errors": {}}
            outs = _jax_row(row, sets_j, c, d ** -0.5, backward, warmup, reps)
            # leaves that need gradients, on the same memory
            tsets = [(*(t.detach().requires_grad_() for t in x[:3]), x[3]) for x in sets_t] if backward else sets_t
            _measure(row, outs, "cuflash_torch", functools.partial(_torch_fn, torch, c, d ** -0.5, backward),
                     tsets, lambda _: torch.cuda.synchronize(), warmup, reps)
            _jax_summary(row, outs, (1 + BACKWARD_FLOPS if backward else 1) * _flops(b, s, h, d, c))
            _emit(rows, row, "jax", verbose)
            del outs, tsets
        del sets_t, sets_j
        torch.cuda.empty_cache()
    return rows


def _jax_fn(name, causal, scale, backward):
    """One JAX implementation as a jitted fn(q, k, v, do) on (batch, seqlen, nheads, d) arrays:
    the output, or with backward=True the gradients (dq, dk, dv) of sum(out * do), which run the
    forward and the backward."""
    import jax
    import jax.numpy as jnp
    if name == "cuflash_jax":
        import cuflash.jax as cj
        attn = lambda q, k, v: cj.attention(q, k, v, causal=causal, softmax_scale=scale)  # noqa: E731
    else:  # jax.nn's own: cuDNN's fused kernel ("cudnn") or XLA's unfused computation ("xla")
        attn = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
            q, k, v, scale=scale, is_causal=causal, implementation=name)
    if not backward:
        return jax.jit(lambda q, k, v, do: attn(q, k, v))
    loss = lambda q, k, v, do: jnp.sum(attn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))  # noqa: E731
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _torch_fn(torch, causal, scale, backward):
    """cuflash.torch.attention as fn(q, k, v, do): the output, or with backward=True the
    gradients of sum(out * do) through autograd (q, k, v must require gradients)."""
    import cuflash.torch as ct
    attn = lambda q, k, v: ct.attention(q, k, v, causal=causal, softmax_scale=scale)  # noqa: E731
    if not backward:
        return lambda q, k, v, do: attn(q, k, v)
    return lambda q, k, v, do: torch.autograd.grad(attn(q, k, v), (q, k, v), do)


def _jax_row(row, sets, causal, scale, backward, warmup=3, reps=20):
    """Times the JAX implementations (JAX_IMPLS) on sets of JAX arrays (q, k, v, do) into row;
    returns their outputs on sets[0], by name."""
    import jax
    outs = {}
    for name in JAX_IMPLS:
        _measure(row, outs, name, functools.partial(_jax_fn, name, causal, scale, backward), sets,
                 jax.block_until_ready, warmup, reps)
    return outs


def _measure(row, outs, name, make, sets, sync, warmup, reps):
    """row[name + "_ms"] = time_sync of make() over sets, and outs[name] = its output on sets[0];
    if it fails, row[name + "_ms"] = None and row["errors"][name] = the error's first line."""
    row[f"{name}_ms"] = None
    try:
        fn = make()
        out = fn(*sets[0])
        sync(out)
        outs[name] = out
        row[f"{name}_ms"] = time_sync(fn, sets, sync, warmup, reps)
    except Exception as e:  # refused shape or dtype, no GPU backend, out of memory: report, go on
        lines = str(e).strip().splitlines()
        row["errors"][name] = f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def _as_jax(x):
    """A JAX array of x; a torch tensor through DLPack (without a copy if it is contiguous)."""
    import jax.dlpack
    return jax.dlpack.from_dlpack(x.detach().contiguous()) if hasattr(x, "detach") else x


def _max_abs_diff(a, b):
    """max |a - b| in float32 over two arrays or two tuples of arrays (JAX or torch)."""
    import jax.numpy as jnp
    a, b = ((x,) if not isinstance(x, (tuple, list)) else x for x in (a, b))
    return max(float(jnp.max(jnp.abs(_as_jax(x).astype(jnp.float32) - _as_jax(y).astype(jnp.float32))))
               for x, y in zip(a, b))


def _jax_summary(row, outs, flops):
    """TFLOP/s of each implementation, cuflash.jax's ratios to cuDNN, XLA and cuflash.torch, and
    max |diff| of the others against cuDNN's output (XLA's where cuDNN failed)."""
    for name in (*JAX_IMPLS, "cuflash_torch"):
        ms = row.get(f"{name}_ms")
        row[f"{name}_tflops"] = flops / ms / 1e9 if ms else None
    for other in ("cudnn", "xla", "cuflash_torch"):
        row[f"ratio_{other}"] = _div(row["cuflash_jax_tflops"], row[f"{other}_tflops"])
    ref = next((n for n in ("cudnn", "xla") if n in outs), None)
    row["diff_ref"] = ref
    for name in ("cuflash_jax", "cuflash_torch", "xla"):
        ok = ref is not None and name != ref and name in outs
        row[f"max_diff_{name}"] = _max_abs_diff(outs[name], outs[ref]) if ok else None
    if row["errors"]:
        row["error"] = "; ".join(f"{n}: {e}" for n, e in row["errors"].items())


def bench_window(batch=1, seqlen=32768, d=128, model_dim=2048, windows=(4096, 1024),
                 dtype="bfloat16", reps=10, warmup=3, verbose=True):
    """Sliding-window attention against full attention at one long sequence length: a window
    of w keys should cost about the fraction of (query, key) pairs it keeps, w/s of full
    non-causal attention (K/V tiles outside the band are skipped, not masked)."""
    torch = _torch()
    import cuflash
    h = model_dim // d
    shp = (batch, seqlen, h, d)
    sets = _make_sets(torch, (shp, shp, shp), getattr(torch, dtype), min_sets=2)
    q, k, v = sets[0]
    i = torch.arange(seqlen, dtype=torch.float64)

    def pairs(left, right):  # (query, key) pairs the mask keeps, over all rows
        lo = (i - left).clamp(min=0) if left >= 0 else torch.zeros_like(i)
        hi = (i + right).clamp(max=seqlen - 1) if right >= 0 else torch.full_like(i, seqlen - 1)
        return float((hi - lo + 1).clamp(min=0).sum())

    def run(window, causal):
        fn = lambda q, k, v: cuflash.attention(q, k, v, causal=causal, window_size=window)  # noqa: E731
        return time_cuda(fn, sets, warmup, reps)

    full = run((-1, -1), False)
    rows = []
    for w in windows:
        for window, causal in (((-1, -1), True), ((w, 0), True), ((w, w), False)):
            if window == (-1, -1) and w != windows[0]:
                continue
            ms = run(window, causal)
            kept = pairs(window[0], 0 if causal else window[1]) / seqlen ** 2
            row = dict(dtype=dtype, d=d, batch=batch, seqlen=seqlen, nheads=h, window=list(window),
                       causal=causal, cuflash_ms=ms, full_ms=full, time_frac=ms / full, pairs_frac=kept,
                       tflops=4 * batch * h * d * kept * seqlen ** 2 / ms / 1e9,
                       kernels=_plan(cuflash, q, k, v, causal)[0] if window == (-1, -1) else
                       "+".join(cuflash.plan(q, k, v, causal=causal, window_size=window).kernels))
            _emit(rows, row, "window", verbose)
    del sets, q, k, v
    torch.cuda.empty_cache()
    return rows


def host_us(fn, reps=300, rounds=7):
    """Median host microseconds per call of fn() over ``rounds`` runs of ``reps`` back-to-back
    calls (synchronised between rounds): a call's Python, allocation and launch cost, as long as
    its GPU work is shorter (the launch queue never fills)."""
    torch = _torch()
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        per.append((time.perf_counter() - t0) / reps * 1e6)
        torch.cuda.synchronize()
    return sorted(per)[rounds // 2]


def bench_overhead(verbose=True):
    """Host time per call of repeated calls (kernels compiled, plans cached) from PyTorch:
    ``cuflash.attention`` on the standard and split-KV paths, with ``out=`` and the LSE, the
    differentiable ``cuflash.torch.attention`` (a torch.library custom op), and SDPA on the same
    tensors for scale."""
    torch = _torch()
    import cuflash
    import cuflash.torch as ct
    bf = dict(device="cuda", dtype=torch.bfloat16)
    q1, k1, v1 = (torch.randn(s, **bf) for s in ((1, 1, 32, 128), (1, 4096, 8, 128), (1, 4096, 8, 128)))
    q2 = torch.randn(2, 256, 8, 64, **bf)
    out2 = torch.empty_like(q2)
    t1 = [x.transpose(1, 2) for x in (q1, k1, v1)]
    t2 = q2.transpose(1, 2)
    g2 = q2.clone().requires_grad_()
    tg2 = g2.transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    cases = [
        ("decode", "b=1, 32/8 heads, d=128, 4096 keys", lambda: cuflash.attention(q1, k1, v1, causal=True),
         lambda: sdpa(*t1, enable_gqa=True), (q1, k1)),
        ("prefill, out=", "b=2, s=256, 8 heads, d=64", lambda: cuflash.attention(q2, q2, q2, causal=True, out=out2),
         lambda: sdpa(t2, t2, t2, is_causal=True), (q2, q2)),
        ("prefill", "b=2, s=256, 8 heads, d=64", lambda: cuflash.attention(q2, q2, q2, causal=True),
         lambda: sdpa(t2, t2, t2, is_causal=True), (q2, q2)),
        ("prefill, return_lse", "b=2, s=256, 8 heads, d=64",
         lambda: cuflash.attention(q2, q2, q2, causal=True, return_lse=True), None, (q2, q2)),
        ("cuflash.torch.attention", "b=2, s=256, 8 heads, d=64",
         lambda: ct.attention(q2, q2, q2, causal=True), None, (q2, q2)),
        ("cuflash.torch.attention, requires_grad (custom op + autograd)", "b=2, s=256, 8 heads, d=64",
         lambda: ct.attention(g2, g2, g2, causal=True), lambda: sdpa(tg2, tg2, tg2, is_causal=True), (q2, q2)),
    ]
    rows = []
    for name, shape, fn, ref, (q, k) in cases:
        row = dict(call=name, shape=shape, cuflash_us=host_us(fn), sdpa_us=host_us(ref) if ref else None,
                   kernels="+".join(cuflash.plan(q, k, k, causal=True).kernels))
        _emit(rows, row, "overhead", verbose)
    return rows


_f = lambda fmt: lambda x: "-" if x is None else format(x, fmt)  # noqa: E731
_pct = lambda x: "-" if x is None else f"{100 * x:.0f}%"  # noqa: E731


_COLUMNS = {
    "prefill": [("dtype", "dtype", str), ("d", "d", str), ("causal", "causal", lambda x: "Y" if x else "N"),
                ("b", "batch", str), ("s", "seqlen", str), ("cuflash TF/s", "cuflash_tflops", _f(".1f")),
                ("flash TF/s", "flash_tflops", _f(".1f")), ("cuDNN TF/s", "cudnn_tflops", _f(".1f")),
                ("xflash", "ratio_flash", _f(".2f")), ("xcuDNN", "ratio_cudnn", _f(".2f")),
                ("%GEMM", "frac_gemm", _pct), ("kernels", "kernels", lambda x: x or "-")],
    "decode": [("heads", None, lambda r: f"{r['nheads']}/{r['nheads_k']}"), ("b", "batch", str),
               ("sk", "seqlen_k", str), ("cuflash us", "cuflash_us", _f(".1f")), ("flash us", "flash_us", _f(".1f")),
               ("cuDNN us", "cudnn_us", _f(".1f")), ("cuflash TB/s", "cuflash_tbps", _f(".2f")),
               ("cuDNN TB/s", "cudnn_tbps", _f(".2f")), ("%copy", "frac_copy", _pct), ("%read", "frac_read", _pct),
               ("kernels/splits", None, lambda r: f"{r.get('kernels') or '-'} / {r.get('num_splits') or '-'}")],
    "jax": [("dtype", "dtype", str), ("d", "d", str), ("causal", "causal", lambda x: "Y" if x else "N"),
            ("b", "batch", str), ("s", "seqlen", str), ("pass", "pass", str),
            ("cuflash.jax TF/s", "cuflash_jax_tflops", _f(".1f")), ("cuDNN TF/s", "cudnn_tflops", _f(".1f")),
            ("XLA TF/s", "xla_tflops", _f(".1f")), ("cuflash.torch TF/s", "cuflash_torch_tflops", _f(".1f")),
            ("xcuDNN", "ratio_cudnn", _f(".2f")), ("xXLA", "ratio_xla", _f(".2f")),
            ("xtorch", "ratio_cuflash_torch", _f(".2f")),
            ("diff jax", "max_diff_cuflash_jax", _f(".1e")), ("diff torch", "max_diff_cuflash_torch", _f(".1e")),
            ("diff xla", "max_diff_xla", _f(".1e")), ("diff vs", "diff_ref", lambda x: x or "-"),
            ("failed", "errors", lambda e: ",".join(e) if e else "-")],
    "overhead": [("call", "call", str), ("shape", "shape", str), ("cuflash host us", "cuflash_us", _f(".1f")),
                 ("SDPA host us", "sdpa_us", _f(".1f")), ("kernels", "kernels", str)],
    "window": [("s", "seqlen", str), ("heads", "nheads", str), ("d", "d", str),
               ("window", "window", lambda w: f"({w[0]}, {w[1]})"), ("causal", "causal", lambda x: "Y" if x else "N"),
               ("ms", "cuflash_ms", _f(".3f")), ("full ms", "full_ms", _f(".3f")),
               ("time / full", "time_frac", _f(".3f")), ("pairs / full", "pairs_frac", _f(".3f")),
               ("TF/s", "tflops", _f(".1f")), ("kernels", "kernels", lambda x: x or "-")],
}


def format_table(rows, kind):
    """Fixed-width markdown table of the important columns of a benchmark's rows (`kind`: a key of _COLUMNS)."""
    cols = _COLUMNS[kind]
    cells = [[fn(r) if key is None else fn(r.get(key)) for _, key, fn in cols] for r in rows]
    heads = [name for name, _, _ in cols]
    w = [max([len(heads[i])] + [len(c[i]) for c in cells]) for i in range(len(cols))]
    line = lambda vals: "| " + " | ".join(v.rjust(w[i]) for i, v in enumerate(vals)) + " |"  # noqa: E731
    return "\n".join([line(heads), "|" + "|".join("-" * (x + 1) + ":" for x in w) + "|"] + [line(c) for c in cells])


def env_info():
    """GPU name, SM count, compute capability, torch/cupy versions, date, ceilings if measured."""
    info = {"date": datetime.datetime.now().isoformat(timespec="seconds")}
    try:
        import torch
        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info.update(gpu=p.name, sms=p.multi_processor_count, cc=f"{p.major}.{p.minor}",
                        l2_bytes=getattr(p, "L2_cache_size", None), cuda=torch.version.cuda)
    except ImportError:
        info["torch"] = None
    try:
        import cupy
        info["cupy"] = cupy.__version__
    except ImportError:
        info["cupy"] = None
    if _CEILINGS:
        info["ceilings"] = dict(_CEILINGS)
    return info


def write_results(rows, path):
    """JSON ({"env": ..., "rows": [...]}) if path ends in .json, else CSV."""
    if str(path).endswith(".json"):
        with open(path, "w") as f:
            json.dump({"env": env_info(), "rows": rows}, f, indent=1)
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=keys)
        wr.writeheader()
        wr.writerows(rows)


def plot(rows, kind, path):
    """TFLOP/s (prefill, jax) or TB/s (decode) vs sequence length, one line per implementation."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("plot needs matplotlib (pip install matplotlib)") from e
    if kind not in ("prefill", "decode", "jax"):
        raise ValueError(f"--plot draws prefill, decode or jax sweeps, not {kind}")
    if kind in ("prefill", "jax"):  # jax rows: one panel per pass too
        key, x, unit = (lambda r: f"{r['dtype']} d={r['d']} {'causal' if r['causal'] else 'full'}"
                        + (f" {r['pass']}" if "pass" in r else "")), "seqlen", "tflops"
    else:
        key, x, unit = (lambda r: f"h={r['nheads']}/{r['nheads_k']} b={r['batch']}"), "seqlen_k", "tbps"
    groups = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r)
    ncol = min(3, len(groups)) or 1
    nrow = math.ceil(len(groups) / ncol) or 1
    fig, axes = plt.subplots(nrow, ncol, figsize=(5 * ncol, 3.6 * nrow), squeeze=False)
    for ax, (title, rs) in zip(axes.flat, groups.items()):
        rs = sorted(rs, key=lambda r: r[x])
        for impl in ("cuflash", "flash", "cudnn", "cuflash_jax", "xla", "cuflash_torch"):
            pts = [(r[x], r.get(f"{impl}_{unit}")) for r in rs if r.get(f"{impl}_{unit}") is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl.replace("_", "."))
        ax.set_xscale("log", base=2)
        ax.set_title(title)
        ax.set_xlabel(x)
        ax.set_ylabel("TFLOP/s" if unit == "tflops" else "TB/s")
        ax.grid(True, alpha=0.3)
        ax.legend()
    for ax in list(axes.flat)[len(groups):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
