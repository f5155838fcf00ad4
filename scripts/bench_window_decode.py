"""Sliding-window decode with GQA (Mistral- and Gemma-style layers: one new token over a long
cache, a window of W keys): cuflash.attention with window_size=(W - 1, 0) over the whole cache,
against the same call over only the window's W keys (the bytes a windowed step must read: the
floor) and against the call without a window over the whole cache. Calls interleaved in one
process (cuflash.bench.time_interleaved; needs a GPU and PyTorch):

    python scripts/bench_window_decode.py [--window 4096] [--seqlens 32768 131072] [--json F]

Each row also names the plan's kernels and split count."""
import argparse
import json
import sys

import torch

from cuflash import bench

HEADS = ((32, 8), (28, 4), (16, 8))


def rows(seqlens, window, batches, d, reps):
    import cuflash
    out = []
    for b in batches:
        for h, hk in HEADS:
            for s in seqlens:
                mk = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
                sets = [(mk(b, 1, h, d), mk(b, s, hk, d), mk(b, s, hk, d)) for _ in range(2)]
                tail = [(q, k[:, -window:], v[:, -window:]) for q, k, v in sets]
                win = (window - 1, 0)
                calls = {
                    "window": (lambda q, k, v: cuflash.attention(q, k, v, causal=True, window_size=win), sets),
                    "window's keys only": (lambda q, k, v: cuflash.attention(q, k, v, causal=True), tail),
                    "no window": (lambda q, k, v: cuflash.attention(q, k, v, causal=True), sets),
                }
                ms = bench.time_interleaved(calls, warmup=5, reps=reps)
                q, k, v = sets[0]
                want = cuflash.attention(*tail[0], causal=True).float()
                diff = (cuflash.attention(q, k, v, causal=True, window_size=win).float() - want).abs().max().item()
                p = cuflash.plan(q, k, v, causal=True, window_size=win)
                row = dict(batch=b, nheads=h, nheads_k=hk, d=d, seqlen_k=s, window=window,
                           us={n: m * 1e3 for n, m in ms.items()}, kernels=list(p.kernels), num_splits=p.num_splits,
                           pack_gqa=p.pack_gqa, max_diff_vs_tail=diff)
                out.append(row)
                print(json.dumps(row), flush=True)
                del sets, tail
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    res = rows(a.seqlens, a.window, a.batches, a.head_dim, a.reps)
    print(f"\n{'batch':>5s} {'heads':>6s} {'keys':>7s}  window / window's keys only / no window (us)")
    for r in res:
        u = r["us"]
        print(f"{r['batch']:5d} {r['nheads']:3d}/{r['nheads_k']:<2d} {r['seqlen_k']:7d}  "
              + " / ".join(f"{u[n]:.1f}" for n in ("window", "window's keys only", "no window")))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(env=bench.env_info(), rows=res), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
