"""The FP8 (e4m3) forward against cuflash's bf16 forward and SDPA's cuDNN backend (bf16), or FP8
kernel variants against each other, in one process (needs an sm_90 GPU and PyTorch).

    python scripts/bench_fp8.py [--head-dim 128 256] [--json F] [--plot F.png]
    python scripts/bench_fp8.py --variants [--head-dim 128]
    python scripts/bench_fp8.py --from-json F --plot F.png     # a plot of saved rows (no GPU)

Model dim 2048 (16 heads at d = 128, 8 at d = 256), batch x seqlen 16 x 1k ... 1 x 16k, full and
causal; bf16 inputs cast to e4m3 for the FP8 calls (no descales). Each shape: the implementations
timed in three alternating rounds (CUDA events around 10 back-to-back calls, median of 10 such
after 3 warm-up calls), the best round kept; TF/s counts 4 b h s^2 d (halved causal). ``--variants``: cuflash.attention with
the planned FwdFp8Variant's fields overridden by each of VARIANTS in turn."""
import argparse
import functools
import json

SHAPES = ((16, 1024), (8, 2048), (4, 4096), (2, 8192), (1, 16384))
VARIANTS = {"planned": {}, "lazy": dict(lazy_rescale=True), "lazy slack8": dict(lazy_rescale=True, rescale_slack=8),
            "lpt": dict(lpt=True), "lpt lazy slack8": dict(lpt=True, lazy_rescale=True, rescale_slack=8),
            "3 stages": dict(stages=3), "no ping-pong": dict(pingpong=False)}


def plot(rows, path):
    """TF/s against tokens per sequence, a panel per head dim and mask (cuflash.bench.plot)."""
    from cuflash import bench
    flat = [dict(dtype="e4m3 vs bf16", d=r["d"], causal=r["causal"], seqlen=r["seqlen"],
                 **{f"{IMPLS[n]}_tflops": t for n, t in r["tflops"].items()}) for r in rows]
    bench.plot(flat, "prefill", path, impls=tuple(IMPLS.values()))


# The implementations' names in the rows -> their line labels in the plot.
IMPLS = {"fp8": "cuflash_fp8", "bf16": "cuflash_bf16", "cudnn bf16": "sdpa_cudnn_bf16"}


def median_ms(fn, reps=10, calls=10):
    """The median over ``reps`` of the time per call of ``calls`` back-to-back calls (the host
    queues the calls ahead of the GPU, as in a model's forward)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[reps // 2]


def host_us(fn, calls=200):
    """Host time per call of ``fn`` on inputs too small to keep the GPU busy (wall time / calls)."""
    import time
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def with_variant(fields, fn):
    """fn() with fwd_fp8.planned giving the planned variant with ``fields`` overridden."""
    planned = fwd_fp8.planned
    # (one object per (d, causal), as the planner's: repeated calls check that the variant they
    # kept is the planned one, so that both sides of an A/B take the same repeated-call path)
    fwd_fp8.planned = functools.lru_cache(maxsize=None)(lambda d, c, arch=90: fwd_fp8.FwdFp8Variant(
        head_dim=d, causal=c, arch=arch, **{**dict(fwd_fp8.planned_fields(d, c)), **fields}))
    try:
        return fn()
    finally:
        fwd_fp8.planned = planned


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head-dim", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--plot", help="a PNG of TF/s per shape (matplotlib)")
    ap.add_argument("--from-json", help="plot the rows of a saved --json file instead of measuring")
    a = ap.parse_args()
    if a.from_json:
        with open(a.from_json) as f:
            plot(json.load(f)["rows"], a.plot or a.from_json.removesuffix(".json") + ".png")
        return
    global torch, fwd_fp8  # (median_ms, host_us and with_variant use them)
    import torch  # (measuring needs a GPU, PyTorch and cuflash)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash
    from cuflash.kernels import fwd_fp8
    rows = []
    q, k, v = (torch.randn(1, 128, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
    print(f"host time per call (1 x 128 tokens, 2 heads, d = 128): fp8 {host_us(lambda: cuflash.attention(q8, k8, v8)):.1f} us, "
          f"bf16 {host_us(lambda: cuflash.attention(q, k, v)):.1f} us", flush=True)
    for d in a.head_dim:
        h = 2048 // d
        for causal in (False, True):
            for b, s in SHAPES:
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                fp8 = lambda: cuflash.attention(q8, k8, v8, causal=causal)  # noqa: E731
                if a.variants:
                    impls = {n: (lambda f=f: with_variant(f, fp8)) for n, f in VARIANTS.items()
                             if causal or not f.get("lpt")}
                else:
                    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

                    def cudnn():
                        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    impls = {"fp8": fp8, "bf16": lambda: cuflash.attention(q, k, v, causal=causal), "cudnn bf16": cudnn}
                best = {n: median_ms(f) for n, f in impls.items()}
                for _ in range(2):
                    for n, f in impls.items():
                        best[n] = min(best[n], median_ms(f))
                tf = {n: flops / (ms * 1e-3) / 1e12 for n, ms in best.items()}
                rows.append(dict(d=d, causal=causal, batch=b, seqlen=s, nheads=h, tflops=tf))
                print(f"d={d} {'causal' if causal else 'full'} {b}x{s}: "
                      + "  ".join(f"{n} {t:.1f}" for n, t in tf.items()) + " TF/s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    if a.plot:
        plot(rows, a.plot)


if __name__ == "__main__":
    main()
