"""Time forward-kernel tile configurations on the current GPU, against SDPA in the same run.

    python scripts/tune_tiles.py --d 128 --tiles 128x64x8 128x64x4 --batch 4 --seqlen 4096

Prints, per (d, causal, tile): registers and spills from ptxas, and TFLOP/s (FLOPs 4*b*s^2*h*d,
halved when causal), next to SDPA's flash and cuDNN backends.
"""
import argparse
import dataclasses

import torch

from cuflash import api, bench, compiler
from cuflash.launch import run
from cuflash.plan import Launch, cdiv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--tiles", nargs="+", required=True, help="MxNxW[xStages], e.g. 128x64x4x2")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    a = ap.parse_args()
    dev = torch.cuda.current_device()
    print(f"{torch.cuda.get_device_name()}  b={a.batch} s={a.seqlen} {a.dtype}")
    for d in a.d:
        h = 2048 // d
        shapes = [(a.batch, a.seqlen, h, d)] * 3
        sets = bench._make_sets(torch, shapes, getattr(torch, a.dtype))
        for causal in map(bool, a.causal):
            flops = 4 * a.batch * a.seqlen ** 2 * h * d / (2 if causal else 1)
            base = api.plan(*sets[0], causal=causal)
            sdpa = {}
            sets_t = [tuple(x.transpose(1, 2) for x in s) for s in sets]
            for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
                ms = bench._time_sdpa(torch, name, sets_t, causal, False, 5, 20)
                sdpa[name] = flops / ms / 1e9 if ms else float("nan")
            for t in a.tiles:
                bm, bn, w, st = (list(map(int, t.split("x"))) + [1])[:4]
                v = dataclasses.replace(base.launches[0].variant, block_m=bm, block_n=bn, warps=w, stages=st)
                r = compiler.compile_variant(v).resources
                launch = Launch(v, (cdiv(a.seqlen, bm), h, a.batch), v.threads, v.smem_bytes)
                plan = dataclasses.replace(base, launches=(launch,))

                def call(q, k, v_, out):
                    qv, kv, vv, ov = (api.arrays.view(x, "x") for x in (q, k, v_, out))
                    run(plan, qv, kv, vv, ov, 0, None, d ** -0.5, api.arrays.stream_for(qv), dev)

                outs = [(q, k, v_, torch.empty_like(q)) for q, k, v_ in sets]
                ms = bench.time_cuda(call, outs, warmup=5, reps=20)
                ref = torch.nn.functional.scaled_dot_product_attention(
                    *(x.transpose(1, 2) for x in sets[0]), is_causal=causal).transpose(1, 2)
                call(*outs[0])
                err = (outs[0][3].float() - ref.float()).abs().max().item()
                print(f"d={d:3d} causal={int(causal)} tile={t:>10}  regs={r.registers:3d} "
                      f"spill={r.spill_stores:3d}  smem={v.smem_bytes // 1024:3d}K  "
                      f"{flops / ms / 1e9:6.1f} TFLOP/s  (flash {sdpa['FLASH_ATTENTION']:6.1f}, "
                      f"cuDNN {sdpa['CUDNN_ATTENTION']:6.1f})  maxdiff {err:.3g}", flush=True)


if __name__ == "__main__":
    main()
