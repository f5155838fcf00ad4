"""The planned deterministic backward against the planned atomic one, in one process, with SDPA's
cuDNN backward beside (their samples interleaved, bench.time_interleaved; model dim 2048, the
`bench backward` shapes):

    python scripts/bench_deterministic.py [--head-dim D ...] [--dtype float16]

Prints per shape the TFLOP/s (2.5 x the forward's FLOPs) of each, the deterministic over the
atomic speed (#20 asks at least 0.85) and over cuDNN's, and whether two deterministic calls gave
bitwise equal gradients (repeatability; their accuracy is the GPU tests' job)."""
import argparse

import torch

import cuflash
from cuflash import bench
from cuflash.backward import attention_backward

SHAPES = ((16, 1024), (8, 2048), (4, 4096), (2, 8192), (1, 16384))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    print(f"{'d':>4} {'causal':>6} {'b':>3} {'s':>6} |   atomic      det   cuDNN | det/atomic | det/cuDNN | bitwise",
          flush=True)
    for d in a.head_dim:
        for causal in (False, True):
            for b, s in SHAPES:
                h = 2048 // d
                shp = (b, s, h, d)
                sets = bench._make_sets(torch, (shp, shp, shp, shp), dtype, min_sets=2)
                saved = [(do, q, k, v, *cuflash.attention(q, k, v, causal=causal, return_lse=True))
                         for q, k, v, do in sets]

                def run(det):
                    return lambda do, q, k, v, o, lse: attention_backward(do, q, k, v, o, lse, causal=causal,
                                                                          deterministic=det)
                first = [x.clone() for x in run(True)(*saved[0])]
                same = all(torch.equal(x, y) for x, y in zip(first, run(True)(*saved[0])))
                calls = {"atomic": (run(False), saved), "det": (run(True), saved)}
                cudnn = bench._sdpa_backward_call(torch, "CUDNN_ATTENTION", sets, causal)
                if cudnn is not None:
                    calls["cudnn"] = cudnn
                ms = bench.time_interleaved(calls, 3, 60)
                ms.setdefault("cudnn", None)
                flops = bench.BACKWARD_FLOPS * bench._flops(b, s, h, d, causal)
                tf = {n: flops / m / 1e9 if m else float("nan") for n, m in ms.items()}  # (nan: cuDNN refused the shape)
                print(f"{d:>4} {str(causal):>6} {b:>3} {s:>6} | {tf['atomic']:8.1f} {tf['det']:8.1f} {tf['cudnn']:7.1f} | "
                      f"{tf['det'] / tf['atomic']:10.3f} | {tf['det'] / tf['cudnn']:9.3f} | {same}", flush=True)
                del sets, saved, first
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
