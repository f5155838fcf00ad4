"""Where cuflash.jax under jax.jit loses time against cuflash.torch's, on an H100/H200.

    python scripts/jax_timeline.py [--head-dim D] [--causal] [--batch B] [--seqlen S] [--backward] [--dtype T]

Prints, for each path on the same inputs (model dim 2048; ``--backward``: forward + backward, jax.jit
of jax.vjp against torch.autograd.grad, as `bench jax` times them): `bench.time_sync`'s ms per call
with batches of about 10 ms and of about 100 ms (a gap that shrinks with the longer batches is a
fixed cost per batch: dispatch and the final wait, not per call), and a kernel timeline of 30
back-to-back calls recorded by the PyTorch profiler (CUPTI records every kernel and memset in the
process, XLA's too): the mean GPU time per call of each kernel or memset name, and the idle time
between consecutive GPU activities.
"""
import argparse
import os
import statistics

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave memory to PyTorch as well

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import cuflash.jax  # noqa: E402
import cuflash.torch  # noqa: E402
from cuflash import bench  # noqa: E402

CALLS = 30


def timeline(fn, sync):
    """(mean µs per call of each GPU activity name, (median, largest) µs of idle GPU time between
    consecutive activities) over CALLS back-to-back calls of fn."""
    sync(fn())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            out = fn()
        sync(out)
    acts = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)
    per_name = {}
    for e in acts:
        per_name[e.name] = per_name.get(e.name, 0.0) + e.time_range.elapsed_us() / CALLS
    # Idle time: the gaps between consecutive GPU activities (within a call and between calls).
    gaps = [b.time_range.start - a.time_range.end for a, b in zip(acts, acts[1:])]
    return per_name, (statistics.median(gaps) if gaps else 0.0, max(gaps, default=0.0))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--backward", action="store_true", help="forward + backward")
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    a = ap.parse_args()
    b, s, d = a.batch, a.seqlen, a.head_dim
    h = 2048 // d
    key = jax.random.split(jax.random.PRNGKey(0), 4)
    xj = tuple(jax.random.normal(kk, (b, s, h, d), getattr(jnp, a.dtype)) for kk in key)  # q, k, v, do
    xt = tuple(torch.from_dlpack(x).clone().requires_grad_(a.backward and i < 3) for i, x in enumerate(xj))
    fj = bench._jax_fn("cuflash_jax", a.causal, None, a.backward)
    ft = bench._torch_fn(torch, a.causal, None, a.backward)
    paths = {
        "jax": (lambda: fj(*xj), jax.block_until_ready),
        "torch": (lambda: ft(*xt), lambda _: torch.cuda.synchronize()),
    }
    print(f"b={b} s={s} h={h} d={d} causal={a.causal} {a.dtype} {'forward + backward' if a.backward else 'forward'}")
    for name, (fn, sync) in paths.items():
        times = [bench.time_sync(lambda _: fn(), [(None,)], sync, sample_ms=ms) for ms in (10.0, 100.0)]
        per_name, (gap_med, gap_max) = timeline(fn, sync)
        print(f"{name:6s} ms/call {times[0]:.4f} (10 ms batches) {times[1]:.4f} (100 ms batches); "
              f"idle between activities: median {gap_med:.1f} us, max {gap_max:.1f} us")
        for n, us in sorted(per_name.items(), key=lambda x: -x[1]):
            print(f"       {us:9.1f} us/call  {n[:100]}")


if __name__ == "__main__":
    main()
