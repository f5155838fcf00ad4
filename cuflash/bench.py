"""Benchmarks for cuflash: prefill TFLOP/s and decode TB/s against PyTorch SDPA, the cost
of sliding windows against full attention, cuflash.jax under jax.jit against
jax.nn.dot_product_attention, and FlashMask masks against PyTorch's FlexAttention.

Timing uses CUDA events after warm-up, takes the median of many repeats and
rotates among several input sets whose total size exceeds 2x L2, so that
inputs are (mostly) read from HBM as they would be in a real model. The JAX
benchmark times with the wall clock instead (`time_steady`): CUDA events on
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

import numpy as np

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


def time_cuda(fn, inputs_list, warmup=10, reps=50, batch=1, hide_launch=False, stats=None, settle_s=0.0):
    """Median milliseconds per call of fn(*inputs), cycling through inputs_list.

    Each timed sample covers `batch` consecutive calls (batch=None picks a batch
    lasting ~1 ms, for tiny kernels). hide_launch=True queues a GPU sleep before
    each sample so the host can run ahead and the events see GPU time only.
    If `stats` is a dict, the host time per call (ms) is stored in stats["host_ms"].
    `settle_s` > 0: after the warm-up, calls run back to back for that many seconds first, so
    that the samples see the clock the GPU settles at under this load (its power limit), not
    the higher one it starts from (BENCHMARKS.md, "Under sustained load").
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
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < settle_s:
        for _ in range(8):  # a few calls between checks; the sync keeps the queue short
            fn(*inputs_list[k % n])
            k += 1
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


class _Batches:
    """Timed batches of calls fn(*inputs), cycling through inputs_list, each closed by one
    ``sync(out)`` on its last output; made after one untimed call (it may compile) and ``warmup``
    calls in one batch, whose ms per call is ``per_ms``."""

    def __init__(self, fn, inputs_list, sync, warmup):
        self.fn, self.inputs, self.sync, self.k = fn, inputs_list, sync, 1
        sync(fn(*inputs_list[0]))
        self.per_ms = self(max(1, warmup)) / max(1, warmup)

    def __call__(self, calls: int) -> float:
        """Wall-clock ms of ``calls`` calls and the wait for the last one."""
        fn, inputs, n, k = self.fn, self.inputs, len(self.inputs), self.k
        t0 = time.perf_counter()
        for i in range(k, k + calls):
            out = fn(*inputs[i % n])
        self.sync(out)
        self.k = k + calls
        return (time.perf_counter() - t0) * 1e3


def time_sync(fn, inputs_list, sync, warmup=3, reps=20, sample_ms=10.0):
    """Median wall-clock milliseconds per call of fn(*inputs), cycling through inputs_list.

    For asynchronous frameworks (JAX, PyTorch on CUDA): each sample issues a batch of calls and
    waits once, `sync(out)` on the last call's output (`jax.block_until_ready`; for PyTorch,
    `torch.cuda.synchronize`), so the GPU's work is timed to its end. The first call (which may
    compile) is not timed; the batch is sized from the warm-up so that a sample lasts about
    `sample_ms`, which makes the wait and the first launch a small part of it.
    """
    run = _Batches(fn, inputs_list, sync, warmup)
    batch = max(1, min(200, int(sample_ms / max(run.per_ms, 1e-3))))
    return statistics.median(run(batch) / batch for _ in range(reps))


def time_steady(fn, inputs_list, sync, warmup=3, reps=20, sample_ms=10.0):
    """(ms per call in steady state, ms fixed per batch) of fn(*inputs), cycling through
    inputs_list, for asynchronous frameworks (see time_sync). Each sample times a batch of n calls
    and one of 4n, each closed by one ``sync``; n is sized from the warm-up so that the short batch
    lasts about sample_ms / 4. The per-call time is the difference of the two batches' medians
    over the 3n calls between them: the cost of one more call in a stream of calls, as the layers
    of a model run. What the short batch takes beyond n such calls is paid once per batch (the
    first launch's latency, the final wait) whatever the batch holds."""
    run = _Batches(fn, inputs_list, sync, warmup)
    short = max(1, min(50, int(sample_ms / 4 / max(run.per_ms, 1e-3))))
    samples = [(run(short), run(4 * short)) for _ in range(max(1, reps))]
    t_short, t_long = (statistics.median(v) for v in zip(*samples))
    per_call = (t_long - t_short) / (3 * short)
    if per_call <= 0:
        raise RuntimeError(f"time_steady: {4 * short} calls took no longer than {short} ({t_long:.3f} against "
                           f"{t_short:.3f} ms, medians of {max(1, reps)}): too noisy to time; raise reps or sample_ms")
    return per_call, t_short - short * per_call


def time_interleaved(calls: dict, warmup=5, reps=90, settle_s=0.0, errors=None) -> dict:
    """Median milliseconds per call of each ``calls[name] = (fn, inputs_list)``, cycling through
    its inputs, with the samples of all of them interleaved: each pass times one call of each
    (CUDA events around it), the order rotated by one every pass. A GPU's clocks follow its
    power draw and temperature, and drift by 10% within seconds at the power limit (H200,
    BENCHMARKS.md), so implementations timed one after the other see different clocks;
    interleaved, every implementation's samples span the same stretch of time and their ratios
    compare like with like. Each fn is called once untimed first (it may compile) and
    ``warmup`` times; where a call raises, then or later, its result is None and
    ``errors[name]`` (if a dict is given) holds the exception. ``settle_s`` > 0: before the
    samples, passes of back-to-back calls run that long (time_cuda's settle_s)."""
    torch = _torch()
    live, k = {}, 0
    for name, (fn, inputs) in calls.items():
        try:
            for i in range(1 + max(0, warmup)):
                fn(*inputs[i % len(inputs)])
            torch.cuda.synchronize()
            live[name] = (fn, inputs)
        except Exception as e:  # unsupported shape, dtype or backend
            if errors is not None:
                errors[name] = e
    names = list(live)
    t0 = time.perf_counter()
    while names and time.perf_counter() - t0 < settle_s:
        for name in names:
            fn, inputs = live[name]
            fn(*inputs[k % len(inputs)])
        k += 1
        torch.cuda.synchronize()
    events = {name: [] for name in names}
    for p in range(reps if names else 0):
        for name in names[p % len(names):] + names[:p % len(names)]:
            if name not in events:
                continue
            fn, inputs = live[name]
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            try:
                fn(*inputs[(k + p) % len(inputs)])
            except Exception as exc:
                del events[name]
                if errors is not None:
                    errors[name] = exc
                continue
            e.record()
            events[name].append((s, e))
    torch.cuda.synchronize()
    return {name: statistics.median(s.elapsed_time(e) for s, e in events[name]) if name in events else None
            for name in calls}


def rotated_rounds(timers: dict, rounds: int) -> dict:
    """Median ms of each timer (name -> a callable returning ms, or None where it cannot run)
    over ``rounds`` rounds, the order rotated by one each round. A GPU's clocks follow its power
    draw with some delay, so a timer run right after a heavy kernel reads slower than one run
    after a light one (up to 10% at 16 x 1k rows on an H200, BENCHMARKS.md): a fixed order would
    favour the same implementation on every row."""
    names = list(timers)
    got = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            ms = timers[n]()
            if ms is not None:
                got[n].append(ms)
    return {n: statistics.median(v) if v else None for n, v in got.items()}


def _note_error(row: dict, e):
    """A row's ``error``: cuflash's exception, if it raised."""
    if e is not None:
        row.update(error=f"{type(e).__name__}: {e}")


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
    """Median ms of SDPA with one backend forced (time_cuda); None if the backend refuses."""
    try:
        return time_cuda(_sdpa_on(torch, backend, causal, gqa), sets_t, warmup, reps, **kw)
    except Exception:  # unsupported shape/dtype/GQA for this backend
        return None


def _sdpa_on(torch, backend, causal, gqa):
    """SDPA (q, k, v) -> out with one backend forced (it raises where the backend refuses)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    attn = _sdpa(torch, causal, gqa)

    def call(q, k, v):
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return attn(q, k, v)
    return call


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


GRID_HEAD_DIMS = (64, 128, 256)  # the prefill, backward and jax grids' head dims (model dim 2048)


def check_gqa(head_dims, gqa, model_dim=2048):
    """ValueError unless ``gqa`` (query heads per KV head) divides every head dim's query heads."""
    bad = [d for d in head_dims if gqa < 1 or (model_dim // d) % gqa]
    if bad:
        raise ValueError(f"gqa {gqa} does not divide the query heads ({model_dim} // head dim) at head dim "
                         + ", ".join(map(str, bad)))


def _prefill_grid(dtypes, head_dims, causal, shapes, model_dim, quick, gqa=1):
    """(dtype, d, causal, batch, seqlen, nheads, (b, s, h, d), (b, s, h // gqa, d)) over
    FlashAttention's grid: q's shape and K/V's, with ``gqa`` query heads per KV head."""
    check_gqa(head_dims, gqa, model_dim)
    if quick:
        dtypes, shapes = ("bfloat16",), ((8, 2048),)
    for dt in dtypes:
        for d in head_dims:
            h = model_dim // d
            for c in causal:
                for b, s in shapes:
                    yield dt, d, c, b, s, h, (b, s, h, d), (b, s, h // gqa, d)


def bench_prefill(dtypes=("bfloat16", "float16"), head_dims=GRID_HEAD_DIMS, causal=(False, True),
                  shapes=((16, 1024), (8, 2048), (4, 4096), (2, 8192), (1, 16384)),
                  model_dim=2048, reps=30, warmup=5, quick=False, verbose=True, rounds=3, settle=0.0, gqa=1):
    """Forward prefill sweep (sq == sk; ``gqa`` query heads per KV head, SDPA with enable_gqa
    then); returns one dict per config. cuflash and SDPA's flash and cuDNN backends are timed
    with their samples interleaved (time_interleaved: ``rounds`` x ``reps`` passes of one call
    each), after ``settle`` seconds of back-to-back calls."""
    torch = _torch()
    import cuflash
    gemm = measure_ceilings()["gemm_tflops"]
    rows = []
    for dt, d, c, b, s, h, shp, kshp in _prefill_grid(dtypes, head_dims, causal, shapes, model_dim, quick, gqa):
        sets = _make_sets(torch, (shp, kshp, kshp), getattr(torch, dt),
                          extra_bytes=b * s * h * d * 2)
        q, k, v = sets[0]
        row = dict(dtype=dt, d=d, causal=c, batch=b, seqlen=s, nheads=h, nheads_k=kshp[2])
        row["kernels"], _ = _plan(cuflash, q, k, v, c)
        flops = _flops(b, s, h, d, c)
        tf = lambda ms: flops / ms / 1e9 if ms else None  # noqa: E731
        sets_t = [tuple(t.transpose(1, 2) for t in x) for x in sets]
        calls, errors = {}, {}
        try:
            row["max_diff_vs_sdpa"] = _max_diff(torch, cuflash.attention(q, k, v, causal=c),
                                                q, k, v, c, gqa > 1)
            calls["cuflash"] = (lambda q, k, v: cuflash.attention(q, k, v, causal=c), sets)
        except Exception as e:
            errors["cuflash"] = e
        for name, backend in (("flash", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION")):
            calls[name] = (_sdpa_on(torch, backend, c, gqa > 1), sets_t)
        ms = time_interleaved(calls, warmup, rounds * reps, settle, errors)
        _note_error(row, errors.get("cuflash"))
        row["cuflash_ms"] = ms.get("cuflash")
        row["cuflash_tflops"] = tf(row["cuflash_ms"])
        row["flash_tflops"] = tf(ms.get("flash"))
        row["cudnn_tflops"] = tf(ms.get("cudnn"))
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


def bench_backward(dtypes=("bfloat16", "float16"), head_dims=GRID_HEAD_DIMS, causal=(False, True),
                   shapes=((16, 1024), (8, 2048), (4, 4096), (2, 8192), (1, 16384)),
                   model_dim=2048, reps=20, warmup=3, quick=False, verbose=True, deterministic=False,
                   rounds=3, settle=0.0, gqa=1):
    """Backward sweep on the prefill grid: cuflash.backward.attention_backward against the
    backward of SDPA's flash (FA2) and cuDNN backends (gradients of a saved forward), their
    samples interleaved (time_interleaved: ``rounds`` x ``reps`` passes of one call
    each), after ``settle`` seconds of back-to-back calls. FLOPs = 2.5 x the forward's (FA2's convention: 5
    matmuls against 2).
    ``deterministic``: cuflash's deterministic mode (no atomics; SDPA's backends as usual).
    ``gqa``: query heads per KV head (SDPA with enable_gqa)."""
    torch = _torch()
    import cuflash
    from cuflash.backward import attention_backward
    rows = []
    for dt, d, c, b, s, h, shp, kshp in _prefill_grid(dtypes, head_dims, causal, shapes, model_dim, quick, gqa):
        sets = _make_sets(torch, (shp, kshp, kshp, shp), getattr(torch, dt), min_sets=2)
        row = dict(dtype=dt, d=d, causal=c, batch=b, seqlen=s, nheads=h, nheads_k=kshp[2])
        flops = BACKWARD_FLOPS * _flops(b, s, h, d, c)
        tf = lambda ms: flops / ms / 1e9 if ms else None  # noqa: E731

        calls, errors = {}, {}
        try:
            saved = [(do, q, k, v, *cuflash.attention(q, k, v, causal=c, return_lse=True)) for q, k, v, do in sets]
            calls["cuflash"] = (lambda do, q, k, v, o, lse: attention_backward(
                do, q, k, v, o, lse, causal=c, deterministic=deterministic), saved)
        except Exception as e:
            errors["cuflash"] = e
        for name, backend in (("flash", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION")):
            call = _sdpa_backward_call(torch, backend, sets, c, gqa > 1)
            if call is not None:
                calls[name] = call
        ms = time_interleaved(calls, warmup, rounds * reps, settle, errors)
        _note_error(row, errors.get("cuflash"))
        row["cuflash_ms"] = ms.get("cuflash")
        row["flash_tflops"], row["cudnn_tflops"] = tf(ms.get("flash")), tf(ms.get("cudnn"))
        row["cuflash_tflops"] = tf(row["cuflash_ms"])
        row["ratio_flash"] = _div(row["cuflash_tflops"], row["flash_tflops"])
        row["ratio_cudnn"] = _div(row["cuflash_tflops"], row["cudnn_tflops"])
        row["frac_gemm"] = None
        _emit(rows, row, "prefill", verbose)
        del sets
        torch.cuda.empty_cache()
    return rows


def _sdpa_backward_call(torch, backend, sets, causal, gqa=False):
    """(fn, inputs) for time_interleaved that time SDPA's backward with one backend forced:
    per input set (q, k, v, dout) of cuflash's layout, the saved forward (out, q, k, v, dout) in
    SDPA's layout, and autograd.grad of out. None where the backend refuses."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    try:
        with sdpa_kernel(getattr(SDPBackend, backend)):
            saved = []
            for q, k, v, do in sets:
                q, k, v = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
                saved.append((_sdpa(torch, causal, gqa)(q, k, v), q, k, v, do.transpose(1, 2)))
    except Exception:  # unsupported shape/dtype for this backend
        return None
    return lambda o, q, k, v, do: torch.autograd.grad(o, (q, k, v), do, retain_graph=True), saved


def bench_jax(dtypes=("bfloat16", "float16"), head_dims=GRID_HEAD_DIMS, causal=(False, True),
              shapes=((16, 1024), (8, 2048), (4, 4096), (2, 8192), (1, 16384)),
              model_dim=2048, reps=20, warmup=3, quick=False, verbose=True, rounds=3):
    """cuflash.jax.attention under jax.jit against jax.nn.dot_product_attention with
    implementation="cudnn" and "xla", on the prefill grid, and cuflash.torch.attention at the
    same shapes in the same process. Two rows per shape: "fwd" (the forward) and "fwd+bwd"
    (jax.jit of jax.vjp applied to a fixed random output cotangent do: the gradients w.r.t. q, k
    and v; for PyTorch, torch.autograd.grad(out, (q, k, v), do): the same work), counted as
    (1 + 2.5) x the forward's FLOPs.
    Every implementation is timed by `time_steady` (ms per call in a stream of calls; the fixed
    ms per synchronised batch into ``<name>_fixed_ms``), the four in ``rounds`` rotated rounds
    (rotated_rounds); max |diff| is against cuDNN's output (XLA's
    where cuDNN is unavailable). An implementation that fails (a shape or dtype it refuses, out
    of memory) gets no timing and its error in row["errors"]."""
    torch, jax = _torch(), _jax()
    import jax.dlpack
    rows = []
    for dt, d, c, b, s, h, shp, _ in _prefill_grid(dtypes, head_dims, causal, shapes, model_dim, quick):
        # q, k, v and the cotangent do, made by PyTorch and seen by JAX through DLPack without a
        # copy: every implementation reads the same inputs, so their outputs can be compared.
        sets_t = _make_sets(torch, (shp,) * 4, getattr(torch, dt), min_sets=2)
        sets_j = [tuple(jax.dlpack.from_dlpack(t) for t in x) for x in sets_t]
        for backward in (False, True):
            row = {"dtype": dt, "d": d, "causal": c, "batch": b, "seqlen": s, "nheads": h,
                   "pass": "fwd+bwd" if backward else "fwd", "errors": {}}
            # leaves that need gradients, on the same memory
            tsets = [(*(t.detach().requires_grad_() for t in x[:3]), x[3]) for x in sets_t] if backward else sets_t
            torch_impl = ("cuflash_torch", functools.partial(_torch_fn, torch, c, d ** -0.5, backward), tsets,
                          lambda _: torch.cuda.synchronize())
            outs = _jax_row(row, sets_j, c, d ** -0.5, backward, warmup, reps, rounds, extra=(torch_impl,))
            _jax_summary(row, outs, (1 + BACKWARD_FLOPS if backward else 1) * _flops(b, s, h, d, c))
            _emit(rows, row, "jax", verbose)
            del outs, tsets
        del sets_t, sets_j
        torch.cuda.empty_cache()
    return rows


def _jax_fn(name, causal, scale, backward):
    """One JAX implementation as a jitted fn(q, k, v, do) on (batch, seqlen, nheads, d) arrays:
    the output, or with backward=True the gradients (dq, dk, dv) for the output cotangent do
    (jax.vjp), which run the forward and the backward."""
    import jax
    if name == "cuflash_jax":
        import cuflash.jax as cj
        attn = lambda q, k, v: cj.attention(q, k, v, causal=causal, softmax_scale=scale)  # noqa: E731
    else:  # jax.nn's own: cuDNN's fused kernel ("cudnn") or XLA's unfused computation ("xla")
        attn = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
            q, k, v, scale=scale, is_causal=causal, implementation=name)
    if not backward:
        return jax.jit(lambda q, k, v, do: attn(q, k, v))

    def grads(q, k, v, do):  # do as the output's cotangent: the work of torch.autograd.grad(out, (q, k, v), do)
        return jax.vjp(attn, q, k, v)[1](do)
    return jax.jit(grads)


def _torch_fn(torch, causal, scale, backward):
    """cuflash.torch.attention as fn(q, k, v, do): the output, or with backward=True the
    gradients of sum(out * do) through autograd (q, k, v must require gradients)."""
    import cuflash.torch as ct
    attn = lambda q, k, v: ct.attention(q, k, v, causal=causal, softmax_scale=scale)  # noqa: E731
    if not backward:
        return lambda q, k, v, do: attn(q, k, v)
    return lambda q, k, v, do: torch.autograd.grad(attn(q, k, v), (q, k, v), do)


def _jax_row(row, sets, causal, scale, backward, warmup=3, reps=20, rounds=1, extra=()):
    """Times the JAX implementations (JAX_IMPLS) on sets of JAX arrays (q, k, v, do), and the
    ``extra`` ones given as (name, make, sets, sync), in ``rounds`` rotated rounds into
    row[name + "_ms"]; returns their outputs on sets[0], by name."""
    import jax
    impls = [(name, functools.partial(_jax_fn, name, causal, scale, backward), sets, jax.block_until_ready)
             for name in JAX_IMPLS] + list(extra)
    outs = {}
    timers = {name: _sync_timer(row, outs, name, make, s, sync, warmup, reps) for name, make, s, sync in impls}
    row.update({f"{name}_ms": ms for name, ms in rotated_rounds(timers, rounds).items()})
    return outs


def _sync_timer(row, outs, name, make, sets, sync, warmup, reps):
    """A rotated_rounds timer of make()'s fn over sets (time_steady's ms per call; its fixed ms per
    batch, the median over rounds, into row[name + "_fixed_ms"]), after one call whose output
    on sets[0] goes to outs[name]. Where making, calling or timing it fails (a refused shape or
    dtype, no GPU backend, out of memory), row["errors"][name] gets the error's first line and
    the timer gives None."""
    def note(e):
        lines = str(e).strip().splitlines()
        row["errors"][name] = f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]

    try:
        fn = make()
        out = fn(*sets[0])
        sync(out)
        outs[name] = out
    except Exception as e:
        note(e)
        return lambda: None

    fixed = []

    def timer():
        if name in row["errors"]:
            return None
        try:
            ms, fixed_ms = time_steady(fn, sets, sync, warmup, reps)
        except Exception as e:
            note(e)
            return None
        fixed.append(fixed_ms)
        row[f"{name}_fixed_ms"] = statistics.median(fixed)
        return ms
    return timer


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
    sets = q = k = v = None  # not del: run() refers to sets
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
    differentiable ``cuflash.torch.attention`` (without and with gradients, its forward alone and
    forward + backward), SDPA with cuflash behind its flash path (``activate_sdpa``), and SDPA with
    PyTorch's kernels on the same tensors for scale."""
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
    do2 = torch.randn_like(q2)
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
        ("cuflash.torch.attention, requires_grad (autograd)", "b=2, s=256, 8 heads, d=64",
         lambda: ct.attention(g2, g2, g2, causal=True), lambda: sdpa(tg2, tg2, tg2, is_causal=True), (q2, q2)),
        ("cuflash.torch.attention, forward + backward (autograd.grad)", "b=2, s=256, 8 heads, d=64",
         lambda: torch.autograd.grad(ct.attention(g2, g2, g2, causal=True), g2, do2),
         lambda: torch.autograd.grad(sdpa(tg2, tg2, tg2, is_causal=True), g2, do2.transpose(1, 2)), (q2, q2)),
    ]
    # SDPA itself with cuflash behind its flash path (activate_sdpa): SDPA's dispatch to the
    # flash op, whose overridden autograd kernel runs cuflash's eager autograd Function
    sdpa_fwd = lambda: sdpa(tg2, tg2, tg2, is_causal=True)  # noqa: E731
    sdpa_bwd = lambda: torch.autograd.grad(sdpa(tg2, tg2, tg2, is_causal=True), g2, do2.transpose(1, 2))  # noqa: E731
    active = [("SDPA with cuflash active (activate_sdpa), requires_grad (forward)", "b=2, s=256, 8 heads, d=64",
               sdpa_fwd, sdpa_fwd, (q2, q2)),
              ("SDPA with cuflash active, forward + backward (autograd.grad)", "b=2, s=256, 8 heads, d=64",
               sdpa_bwd, sdpa_bwd, (q2, q2))]
    rows = []
    for (name, shape, fn, ref, (q, k)), on in [(c, False) for c in cases] + [(c, True) for c in active]:
        if on:
            ct.activate_sdpa()  # timed with cuflash behind SDPA; "sdpa_us" with PyTorch's kernels
            try:
                us = host_us(fn)
            finally:
                ct.restore_sdpa()
        else:
            us = host_us(fn)
        row = dict(call=name, shape=shape, cuflash_us=us, sdpa_us=host_us(ref) if ref else None,
                   kernels="+".join(cuflash.plan(q, k, k, causal=True).kernels))
        _emit(rows, row, "overhead", verbose)
    return rows


# ---------------------------------------------------------------------------------------------
# FlashMask masks against FlexAttention and SDPA with a dense mask (bench mask)

MASK_FAMILIES = ("document", "causal_document", "share_question", "prefix_lm_document",
                 "global_sliding_window", "causal_blockwise", "qk_sparse", "random_eviction")
QUICK_MASK_FAMILIES = ("causal_document", "global_sliding_window", "random_eviction")
MASK_IMPLS = ("cuflash", "flex", "sdpa")
# cuflash.torch.attention_varlen on the same documents, for the families that are one block (or
# causal triangle) per document: what plain attention costs on those lengths, FlashMask's bound.
VARLEN_FAMILIES = ("document", "causal_document")


def _split(rng, total, parts, minimum):
    """``parts`` random ints >= minimum summing to ``total`` (uniform proportions on top of the
    minimum: a Dirichlet(1, ..., 1) draw, as random cut points give)."""
    if parts < 1 or parts * minimum > total:
        raise ValueError(f"cannot split {total} into {parts} parts of at least {minimum}")
    extra = rng.multinomial(total - parts * minimum, rng.dirichlet(np.ones(parts)))
    return [int(minimum + x) for x in extra]


def mask_family(name, seqlen, nheads=16, seed=0):
    """(startend_row_indices, causal, description) of one FlashMask family for a square
    ``seqlen`` mask, built by cuflash.masks with the bench's parameters: documents of random
    lengths averaging 2048 tokens, windows of min(1024, seqlen // 8) keys, and so on; seeded by
    (seed, family, seqlen), so a run is repeatable. random_eviction differs per head (nheads);
    the others are shared by all heads (heads dim 1)."""
    return _mask_family(name, seqlen, nheads, seed)[:3]


def _mask_family(name, seqlen, nheads=16, seed=0):
    """mask_family's (indices, causal, description) and the document lengths of the
    VARLEN_FAMILIES (None for the others)."""
    from . import masks
    s = int(seqlen)
    key = MASK_FAMILIES.index(name) if name in MASK_FAMILIES else -1
    rng = np.random.default_rng([seed, key + 1, s])
    docs = lambda mean: _split(rng, s, max(2, s // mean), 16)  # noqa: E731
    w = min(1024, s // 8)
    if name == "causal":  # the causal mask alone: the reference row of each sequence length
        return masks.causal(s), True, "causal", None
    if name == "document":
        lens = docs(2048)
        return masks.document(lens), False, f"{len(lens)} documents, mean {s // len(lens)}", lens
    if name == "causal_document":
        lens = docs(2048)
        return masks.causal_document(lens), True, f"{len(lens)} documents, mean {s // len(lens)}", lens
    if name == "share_question":  # each document: a question, then 3 answers that each see it
        lens = docs(4096)
        return (masks.share_question([_split(rng, n, 4, 4) for n in lens]), True,
                f"{len(lens)} documents of a question + 3 answers", None)
    if name == "prefix_lm_document":  # each document's prefix: 10% to 50% of it
        lens = docs(2048)
        return (masks.prefix_lm_document([(n, int(rng.integers(n // 10, n // 2 + 1))) for n in lens]), False,
                f"{len(lens)} documents, prefixes 10-50%", None)
    if name == "global_sliding_window":
        g = min(128, s // 16)
        return masks.global_sliding_window(s, g, w), False, f"{g} global tokens, window {w}", None
    if name == "causal_blockwise":  # in-context examples of about 1024 tokens, the last one the query
        lens = docs(1024)
        return masks.causal_blockwise(lens), True, f"{len(lens)} blocks, mean {s // len(lens)}", None
    if name == "qk_sparse":  # 4 spans of seqlen/16 queries, one at a random place in each quarter
        n, quarter = s // 16, s // 4
        spans = [(q * quarter + int(rng.integers(1, quarter - n + 1)), n) for q in range(4)]
        return masks.qk_sparse(s, spans), True, f"4 spans of {n}", None
    if name == "random_eviction":
        return (masks.random_eviction(s, s // 2, seed=int(rng.integers(2 ** 31)), nheads=nheads), True,
                f"evictions from row {s // 2}, per head", None)
    raise ValueError(f"unknown mask family {name!r}; expected one of {', '.join(MASK_FAMILIES)}")


def mask_pairs(startend_row_indices, seqlen, causal, nheads):
    """The number of (query, key) pairs a square FlashMask mask leaves visible, over batch and
    ``nheads`` heads (indices with one head count for every head). Each key column has at most
    two masked row intervals: the mask's own (cuflash.masks.intervals), and with causal=True its
    one lower interval and the causal mask's rows [0, j), so a column's masked rows are the
    union of two intervals."""
    from . import masks
    a = np.asarray(startend_row_indices)
    ivals = masks.intervals(a, seqlen, causal)
    if causal:
        start = ivals[0][0]
        ivals.append((np.zeros_like(start), np.broadcast_to(np.arange(a.shape[2]), start.shape)))
    (s0, e0), (s1, e1) = ivals
    both = np.maximum(np.minimum(e0, e1) - np.maximum(s0, s1), 0)
    masked = np.maximum(e0 - s0, 0) + np.maximum(e1 - s1, 0) - both
    return int((seqlen - masked).sum()) * (nheads // a.shape[1])


def mask_tile_fill(startend_row_indices, seqlen, causal, nheads, block_m, block_n):
    """The share of the (query, key) pairs in the tiles a FlashMask forward of block_m x block_n
    tiles computes (those it does not skip: cuflash.plan.mask_tiles) that the mask keeps visible:
    1 when every computed tile is whole, lower as partly masked tiles carry masked pairs. A
    family's TF/s over the visible pairs can reach at most this share of the kernel's rate on
    whole tiles."""
    from .plan import mask_tiles
    a = np.asarray(startend_row_indices)
    t = mask_tiles(a, seqlen, seqlen, block_m, block_n, causal)
    computed = (t.masked + t.unmasked) * block_m * block_n * (nheads // a.shape[1])
    return _div(mask_pairs(a, seqlen, causal, nheads), computed)


def mask_flops(pairs, d, backward=False):
    """FLOPs of attention over ``pairs`` visible (query, key) pairs (all heads and batches): two
    matmuls of d multiply-adds per pair forward, 4 * pairs * d (bench._flops' count, restricted to
    the pairs the mask keeps); forward + backward 1 + BACKWARD_FLOPS = 3.5 times that."""
    return (1 + BACKWARD_FLOPS if backward else 1) * 4 * pairs * d


def _mask_columns(torch, idx, seqlen, causal, nheads):
    """The masked row intervals of a FlashMask tensor on its device as four int32 (batch, nheads,
    seqlen_k) contiguous tensors (LT start, LT end, UT start, UT end), the n=4 form of
    cuflash.masks.intervals: query i is masked in column j iff LTS <= i < LTE or UTS <= i < UTE
    (with causal=True the UT interval is empty, the causal mask being applied apart)."""
    b, h, sk, n = idx.shape
    if h not in (1, nheads):
        raise ValueError(f"bench mask takes startend_row_indices with 1 or {nheads} heads, got {h}")
    col = [idx[..., c].expand(b, nheads, sk) for c in range(n)]
    full, zero = torch.full_like(col[0], seqlen), torch.zeros_like(col[0])
    if causal:
        cols = (col[0], full if n == 1 else col[1], full, full)
    elif n == 2:
        cols = (col[0], full, zero, col[1])
    else:
        cols = col
    return [c.to(torch.int32).contiguous() for c in cols]


def _mask_mods(cols):
    """FlexAttention mask_mods (True = visible) reading the interval tensors ``cols`` of
    _mask_columns by (batch, head, key) on their device: (causal, non-causal). The tensors are
    filled in place for each mask, so that every mask of a sequence length runs the same two
    functions: torch.compile then compiles Flex once per (length, causal, pass), not once per
    mask (the mask's data is read by the kernels at run time)."""
    lts, lte, uts, ute = cols

    def causal(b, h, q_idx, kv_idx):  # square masks: key j <= query i
        return (kv_idx <= q_idx) & ((q_idx < lts[b, h, kv_idx]) | (q_idx >= lte[b, h, kv_idx]))

    def full(b, h, q_idx, kv_idx):
        return (((q_idx < lts[b, h, kv_idx]) | (q_idx >= lte[b, h, kv_idx]))
                & ((q_idx < uts[b, h, kv_idx]) | (q_idx >= ute[b, h, kv_idx])))
    return causal, full


def _dense_visible(torch, cols, seqlen, causal, heads):
    """The dense boolean mask of SDPA, True = visible, (batch, heads, seqlen, seqlen) built on the
    columns' device from _mask_columns' tensors (their first ``heads`` heads: 1 for a mask shared
    by every head, which SDPA broadcasts). Built in place, so the peak is two such masks."""
    i = torch.arange(seqlen, device=cols[0].device)[:, None]
    lts, lte, uts, ute = (c[:, :heads, None, :] for c in cols)
    vis = i < lts
    vis |= i >= lte
    if causal:
        vis &= torch.arange(seqlen, device=i.device) <= i
    else:
        vis &= (i < uts) | (i >= ute)
    return vis


def _grad_fn(torch, attn, backward):
    """fn(q, k, v, do): attn's output, or with backward=True the gradients of sum(out * do) with
    respect to q, k and v through autograd (forward and backward both run)."""
    if not backward:
        return lambda q, k, v, do: attn(q, k, v)
    return lambda q, k, v, do: torch.autograd.grad(attn(q, k, v), (q, k, v), do)


def _cuflash_mask_attn(causal, idx, backward):
    """cuflash.torch.attention with the FlashMask indices (none for the plain causal row), as
    attn(q, k, v), and the name of the API called. A cuflash.torch.attention that does not take
    startend_row_indices runs the forward through cuflash.attention, which is what
    cuflash.torch.attention calls for tensors that need no gradient; the fwd+bwd pass has no such
    fallback and reports the error."""
    import inspect
    import cuflash
    import cuflash.torch as ct
    kw = {} if idx is None else {"startend_row_indices": idx}
    name, fn = "cuflash.torch.attention", ct.attention
    if kw and not backward and "startend_row_indices" not in inspect.signature(ct.attention).parameters:
        name, fn = "cuflash.attention", cuflash.attention
    return (lambda q, k, v: fn(q, k, v, causal=causal, **kw)), name


def _varlen_attn(torch, docs, batch, causal, device):
    """cuflash.torch.attention_varlen over the documents ``docs`` (lengths, the same in every
    batch entry) as attn(q, k, v) on (batch, seqlen, heads, d) tensors: the batch's tokens as one
    packed sequence of batch * len(docs) documents, the output (batch, seqlen, heads, d)."""
    import cuflash.torch as ct
    lens = np.tile(np.asarray(docs, dtype=np.int64), batch)
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)).to(device)
    longest = int(max(docs))

    def attn(q, k, v):
        b, s, h, d = q.shape
        out = ct.attention_varlen(q.reshape(b * s, h, d), k.reshape(b * s, k.shape[2], d),
                                  v.reshape(b * s, v.shape[2], d), cu, cu, longest, longest, causal=causal)
        return out.reshape(b, s, h, d)
    return attn


def _bhsd(attn):
    """attn on (batch, heads, seqlen, d) views of (batch, seqlen, heads, d) tensors, its output
    seen in (batch, seqlen, heads, d) again."""
    return lambda q, k, v: attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def _first_line(e):
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def _free_cached(torch):
    """Give the CUDA caching allocator's free blocks back (after a big mask, or a failure out of
    memory); nothing without CUDA."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _mask_measure(torch, row, outs, name, make, sets, warmup, reps):
    """row[name + "_ms"] = time_cuda of make()'s fn over sets, outs[name] = its result on sets[0];
    on failure (refused, not compiled, out of memory) row[name + "_ms"] = None and
    row["errors"][name] = the error's first line, and the run goes on."""
    row[f"{name}_ms"] = None
    try:
        fn = make()
        outs[name] = fn(*sets[0])  # the first call compiles: not timed (time_cuda's own first call neither)
        row[f"{name}_ms"] = time_cuda(fn, sets, warmup, reps)
    except Exception as e:
        outs.pop(name, None)
        row["errors"][name] = _first_line(e)
        _free_cached(torch)  # what an out-of-memory failure left cached goes back


def _fwd_tile_fill(a, s, causal, nheads, q, idx, plain):
    """mask_tile_fill of indices ``a`` with the tiles of the forward cuflash plans for q's shape
    (the plain causal kernel's for the reference row), or None where planning fails."""
    import cuflash
    try:
        v = cuflash.plan(q, q, q, causal=causal, startend_row_indices=None if plain else idx).launches[0].variant
        return mask_tile_fill(a, s, causal, nheads, v.block_m, v.block_n)
    except Exception:  # a shape cuflash refuses: the row's cuflash timing reports it
        return None


def _mask_summary(row, outs, flops, causal_tflops, causal_fill=None):
    """TF/s of each implementation on the visible pairs' FLOPs (and of cuflash's varlen call where
    the row has one), cuflash's ratios to Flex, SDPA, its varlen call and its plain causal TF/s at
    the same length and pass (``causal_tflops``), that last ratio counted on the elements of the
    tiles the forward computes (frac_causal_tiles: times the plain causal row's tile fill
    ``causal_fill`` over the row's own), and max |diff| of cuflash's, SDPA's and the varlen call's
    results (output, or dq, dk, dv) against Flex's."""
    for name in (*MASK_IMPLS, "varlen"):
        ms = row.get(f"{name}_ms")
        row[f"{name}_tflops"] = flops / ms / 1e9 if ms else None
    row["ratio_flex"] = _div(row["cuflash_tflops"], row["flex_tflops"])
    row["ratio_sdpa"] = _div(row["cuflash_tflops"], row["sdpa_tflops"])
    row["frac_causal"] = _div(row["cuflash_tflops"], causal_tflops)
    row["frac_varlen"] = _div(row["cuflash_tflops"], row["varlen_tflops"])
    fill = row.get("fwd_tile_fill")
    row["frac_causal_tiles"] = None if row["frac_causal"] is None or not fill or not causal_fill else \
        row["frac_causal"] * causal_fill / fill
    for name in ("cuflash", "sdpa", "varlen"):
        a, b = outs.get(name), outs.get("flex")
        if a is None or b is None:
            row[f"max_diff_{name}"] = None
            continue
        a, b = ((x,) if not isinstance(x, (tuple, list)) else x for x in (a, b))
        row[f"max_diff_{name}"] = max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))
    if row["errors"]:
        row["error"] = "; ".join(f"{n}: {e}" for n, e in row["errors"].items())


def _dynamo_limits(torch):
    """torch._dynamo settings for the Flex compiles: a recompile limit well above the bench's
    compiles (shapes x causal x pass), and a failure, not a silent fall back to eager Flex (which
    would materialise the scores), should a limit still be hit. Names that this PyTorch lacks are
    left out."""
    import torch._dynamo
    config = torch._dynamo.config
    have = getattr(config, "_config", None) or vars(config)
    want = {}
    for names, value in ((("recompile_limit", "cache_size_limit"), 64),  # newer name first
                         (("accumulated_recompile_limit", "accumulated_cache_size_limit"), 1024),
                         (("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"), True)):
        name = next((n for n in names if n in have), None)
        if name:
            want[name] = value
    return config.patch(**want)


def bench_mask(seqlens=(8192, 32768), families=MASK_FAMILIES, batch=1, nheads=16, d=128, dtype="bfloat16",
               reps=10, warmup=3, quick=False, compile=True, seed=0, verbose=True):
    """FlashMask masks (cuflash.masks' families) in cuflash against PyTorch FlexAttention under
    torch.compile and SDPA with the dense boolean mask, forward ("fwd") and forward + backward
    ("fwd+bwd", torch.autograd.grad of sum(out * do) w.r.t. q, k, v), at each sequence length;
    a plain causal row first at each length (cuflash without indices, Flex with the causal
    mask_mod, SDPA with is_causal=True) is the reference of frac_causal. For the document families
    (VARLEN_FAMILIES) cuflash.torch.attention_varlen on the same documents runs too ("varlen";
    frac_varlen: the FlashMask call's TF/s over it), the rate of plain attention on sequences
    of those lengths.

    FLOPs count the visible (query, key) pairs only: 4 * pairs * d forward, 2.5 times more for the
    backward (bench backward's convention). Flex's BlockMask comes from create_block_mask on a
    mask_mod that indexes the same startend_row_indices tensor on the device, and SDPA's dense
    mask is built from it too, so that the three see one mask; max |diff| compares cuflash's and
    SDPA's results with Flex's. An implementation that fails (no FlashMask in cuflash's backward
    yet, out of memory) gets no timing and its error in row["errors"]; the run goes on.
    ``compile=False`` runs Flex eagerly and builds its block mask without torch.compile (for
    small CPU runs: eager Flex materialises the scores)."""
    torch = _torch()
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if quick:
        seqlens, families = (8192,), QUICK_MASK_FAMILIES
    flex = torch.compile(flex_attention, dynamic=False) if compile else flex_attention
    F = torch.nn.functional.scaled_dot_product_attention
    from torch.nn.attention import SDPBackend, sdpa_kernel
    # SDPA's fused backends only: its math fallback would materialise the (batch, heads, s, s)
    # scores (tens of GB and seconds a call at 32k): a mask no fused backend takes is reported.
    # The dense mask goes to the memory-efficient or cuDNN kernel; the causal row may use flash.
    fused = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    sdpa_backends = {False: fused, True: [SDPBackend.FLASH_ATTENTION] + fused}
    rows = []
    with _dynamo_limits(torch):
        for s in seqlens:
            shp = (batch, s, nheads, d)
            sets = _make_sets(torch, (shp,) * 4, getattr(torch, dtype), min_sets=2)  # q, k, v, do
            # leaves that need gradients, on the same memory, for the fwd+bwd pass
            grad_sets = [(*(t.detach().requires_grad_() for t in x[:3]), x[3]) for x in sets]
            dev = sets[0][0].device
            cols = [torch.empty((batch, nheads, s), dtype=torch.int32, device=dev) for _ in range(4)]
            mods = _mask_mods(cols)
            causal_tflops, causal_fill = {}, None
            for fam in ("causal", *families):
                a, c, desc, docs = _mask_family(fam, s, nheads, seed)
                a = np.broadcast_to(a, (batch,) + a.shape[1:]).copy()
                idx = torch.from_numpy(a).to(dev)
                for dst, src in zip(cols, _mask_columns(torch, idx, s, c, nheads)):
                    dst.copy_(src)
                pairs = mask_pairs(a, s, c, nheads)
                errors = {}
                try:
                    block_mask = create_block_mask(mods[0] if c else mods[1], batch, nheads, s, s,
                                                   device=dev, _compile=compile)
                except Exception as e:
                    block_mask, errors["flex"] = None, f"create_block_mask: {_first_line(e)}"
                plain = fam == "causal"
                dense = None
                if not plain:
                    try:
                        dense = _dense_visible(torch, cols, s, c, a.shape[1])
                    except Exception as e:  # out of memory
                        errors["sdpa"] = f"dense mask: {_first_line(e)}"
                        _free_cached(torch)
                fill = _fwd_tile_fill(a, s, c, nheads, sets[0][0], idx, plain)
                if plain:
                    causal_fill = fill
                for backward in (False, True):
                    pas = "fwd+bwd" if backward else "fwd"
                    row = {"family": fam, "mask": desc, "seqlen": s, "batch": batch, "nheads": nheads, "d": d,
                           "dtype": dtype, "causal": c, "n": a.shape[-1], "mask_heads": a.shape[1], "pass": pas,
                           "pairs": pairs, "pairs_frac": pairs / (batch * nheads * s * s), "errors": dict(errors)}
                    run = grad_sets if backward else sets
                    outs = {}
                    attn, row["cuflash_api"] = _cuflash_mask_attn(c, None if plain else idx, backward)
                    row["fwd_tile_fill"] = fill
                    _mask_measure(torch, row, outs, "cuflash", lambda: _grad_fn(torch, attn, backward),
                                  run, warmup, reps)
                    if block_mask is None:
                        row["flex_ms"] = None
                    else:
                        bm = block_mask
                        _mask_measure(torch, row, outs, "flex", lambda: _grad_fn(
                            torch, _bhsd(lambda q, k, v: flex(q, k, v, block_mask=bm)), backward), run, warmup, reps)
                    if plain or dense is not None:
                        sdpa = (lambda q, k, v: F(q, k, v, is_causal=True)) if plain else \
                            (lambda q, k, v: F(q, k, v, attn_mask=dense))
                        with sdpa_kernel(sdpa_backends[plain]):
                            _mask_measure(torch, row, outs, "sdpa", lambda: _grad_fn(torch, _bhsd(sdpa), backward),
                                          run, warmup, reps)
                    else:
                        row["sdpa_ms"] = None
                    row["varlen_ms"] = None
                    if docs is not None:
                        varlen = _varlen_attn(torch, docs, batch, c, dev)
                        _mask_measure(torch, row, outs, "varlen", lambda: _grad_fn(torch, varlen, backward),
                                      run, warmup, reps)
                    flops = mask_flops(pairs, d, backward)
                    if plain:
                        causal_tflops[pas] = flops / row["cuflash_ms"] / 1e9 if row["cuflash_ms"] else None
                    _mask_summary(row, outs, flops, causal_tflops.get(pas), causal_fill)
                    _emit(rows, row, "mask", verbose)
                    del outs
                dense = block_mask = idx = None  # not del: the SDPA lambda refers to dense
                _free_cached(torch)
            del sets, grad_sets, cols, mods
            _free_cached(torch)
    return rows


_f = lambda fmt: lambda x: "-" if x is None else format(x, fmt)  # noqa: E731
_pct = lambda x: "-" if x is None else f"{100 * x:.0f}%"  # noqa: E731


_COLUMNS = {
    "prefill": [("dtype", "dtype", str), ("d", "d", str), ("causal", "causal", lambda x: "Y" if x else "N"),
                ("b", "batch", str), ("s", "seqlen", str),
                ("heads", None, lambda r: f"{r['nheads']}/{r.get('nheads_k', r['nheads'])}"),
                ("cuflash TF/s", "cuflash_tflops", _f(".1f")),
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
    "mask": [("family", "family", str), ("s", "seqlen", str), ("pass", "pass", str),
             ("kept", "pairs_frac", lambda x: "-" if x is None else f"{100 * x:.1f}%"),
             ("cuflash TF/s", "cuflash_tflops", _f(".1f")), ("Flex TF/s", "flex_tflops", _f(".1f")),
             ("SDPA TF/s", "sdpa_tflops", _f(".1f")), ("xFlex", "ratio_flex", _f(".2f")),
             ("%causal", "frac_causal", _pct), ("varlen TF/s", "varlen_tflops", _f(".1f")),
             ("%varlen", "frac_varlen", _pct), ("tile fill", "fwd_tile_fill", _pct),
             ("%causal tiles", "frac_causal_tiles", _pct),
             ("diff vs Flex", "max_diff_cuflash", _f(".1e")),
             ("failed", "errors", lambda e: ",".join(e) if e else "-")],
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


PLOT_IMPLS = ("cuflash", "flash", "cudnn", "cuflash_jax", "xla", "cuflash_torch")


def plot(rows, kind, path, impls=PLOT_IMPLS):
    """TFLOP/s (prefill, jax) or TB/s (decode) vs sequence length, one line per implementation
    (the rows' ``<impl>_tflops`` / ``<impl>_tbps`` for each of ``impls`` they have); for mask,
    bars per mask family (_plot_mask)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("plot needs matplotlib (pip install matplotlib)") from e
    if kind not in ("prefill", "decode", "jax", "mask"):
        raise ValueError(f"--plot draws prefill, decode, jax or mask sweeps, not {kind}")
    if kind == "mask":
        return _plot_mask(plt, rows, path)
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
        for impl in impls:
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


def _plot_mask(plt, rows, path):
    """bench mask's rows as grouped bars: TF/s of cuflash, Flex and SDPA per mask family, one
    panel per (sequence length, pass), with 85% of cuflash's plain causal TF/s (the target of the
    masked rows) as a dashed line and cuflash's varlen call on the same documents as a black
    tick over its family. A missing bar is an implementation that failed."""
    seqlens = sorted({r["seqlen"] for r in rows})
    passes = [p for p in ("fwd", "fwd+bwd") if any(r["pass"] == p for r in rows)]
    fig, axes = plt.subplots(max(1, len(seqlens)), max(1, len(passes)), squeeze=False,
                             figsize=(7 * max(1, len(passes)), 4.2 * max(1, len(seqlens))))
    labels = {"cuflash": "cuflash", "flex": "FlexAttention (torch.compile)", "sdpa": "SDPA, dense mask"}
    width = 0.8 / len(MASK_IMPLS)
    for ax_row, s in zip(axes, seqlens):
        for ax, p in zip(ax_row, passes):
            rs = [r for r in rows if r["seqlen"] == s and r["pass"] == p]
            for k, impl in enumerate(MASK_IMPLS):
                xs = [i + (k - (len(MASK_IMPLS) - 1) / 2) * width for i in range(len(rs))]
                ax.bar(xs, [r.get(f"{impl}_tflops") or 0 for r in rs], width, label=labels[impl])
            varlen = [(i, r["varlen_tflops"]) for i, r in enumerate(rs) if r.get("varlen_tflops")]
            if varlen:
                ax.scatter(*zip(*varlen), marker="_", s=900, linewidths=2, color="black", zorder=3,
                           label="cuflash varlen, same documents")
            ref = next((r["cuflash_tflops"] for r in rs if r["family"] == "causal" and r.get("cuflash_tflops")), None)
            if ref:
                ax.axhline(0.85 * ref, color="gray", linestyle="--", linewidth=1,
                           label="85% of cuflash causal")
            ax.set_xticks(range(len(rs)))
            ax.set_xticklabels([r["family"].replace("_", " ") for r in rs], rotation=30, ha="right", fontsize=8)
            ax.set_title(f"s={s}, {p}")
            ax.set_ylabel("TFLOP/s (visible pairs)")
            ax.grid(True, axis="y", alpha=0.3)
    # One legend under the panels (inside a panel it covers bars and the varlen ticks).
    handles = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=len(handles), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
