"""Time configurations of the warp-specialised forward (cuflash.kernels.fwd_ws) against the
wgmma kernel it replaced (planned with CUFLASH_FWD_WS's switch off) and SDPA's cuDNN backend, on
an H100/H200, after checking each one's output against the wgmma kernel's.

    python scripts/bench_fwd_ws.py [--quick] [--tiles | --persistent] [--head-dim D ...]

Default: the four schedules (plain, overlap, pingpong, both: fwd_ws.run's variant flags) on the
planned K/V tile. ``--tiles``: the candidate tiles of each head dim (TILES below), the planned
ones among them. ``--persistent``: the planned tile of each shape with one-tile blocks and with
persistent blocks taking tiles from the counter and in a fixed order. Prints one line per shape:
TFLOP/s of each configuration, of the wgmma kernel and of cuDNN, the best one's ratio to both, and the largest |difference| from the wgmma
kernel's output over all configurations (0 where only the schedule differs: the same arithmetic
in the same order). Model dim 2048, bf16.
"""
import argparse
import contextlib
import importlib
import math

from cuflash import bench
from cuflash.kernels import fwd_ws

SCHEDULES = {"plain": {}, "overlap": dict(overlap=True), "pingpong": dict(pingpong=True),
             "both": dict(overlap=True, pingpong=True)}
BOTH = SCHEDULES["both"]
PERSISTENT = {"one-tile": dict(persistent=False), "persistent": dict(persistent=True),
              "pers static": dict(persistent=True, dynamic=False)}
TILES = {
    64: {"128x128": BOTH, "192x128 ov": dict(block_m=192, overlap=True), "192x128": dict(block_m=192),
         "128x128 pers": dict(persistent=True, **BOTH), "192x128 ov pers": dict(block_m=192, overlap=True, persistent=True),
         "128x176": dict(block_n=176, **BOTH), "128x192": dict(block_n=192, **BOTH),
         "128x128 sm pers": dict(pingpong=True, turn_softmax=True, persistent=True),
         "128x128 sm ov pers": dict(turn_softmax=True, persistent=True, **BOTH)},
    128: {"128x128": BOTH, "128x128 pers": dict(persistent=True, **BOTH), "128x128 ov": dict(overlap=True),
          "128x176": dict(block_n=176, **BOTH),
          "128x176 ov": dict(block_n=176, overlap=True), "128x160": dict(block_n=160, **BOTH)},
    256: {"128x80 plain": dict(block_n=80), "128x80 ov": dict(block_n=80, overlap=True), "128x80": dict(block_n=80, **BOTH),
          "128x80 pers": dict(block_n=80, persistent=True, **BOTH),
          "128x64 ov": dict(block_n=64, overlap=True), "128x64": dict(block_n=64, **BOTH)},
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one shape per head dim and mask")
    ap.add_argument("--tiles", action="store_true", help="candidate tiles instead of schedules")
    ap.add_argument("--persistent", action="store_true", help="the planned variant, one-tile and persistent blocks")
    ap.add_argument("--head-dim", type=int, nargs="+", default=list(fwd_ws.HEAD_DIMS))
    a = ap.parse_args()
    torch = bench._torch()
    import cuflash
    plan = importlib.import_module("cuflash.plan")  # the module (cuflash.plan is the function)

    @contextlib.contextmanager
    def wgmma_planned():
        """The planner's fwd_ws switch off inside (plans made then are dropped on both sides)."""
        def switch(on):
            plan.FWD_WS = on
            plan.forget_plans()
        switch(False)
        try:
            yield
        finally:
            switch(True)
    shapes = ((8, 2048),) if a.quick else ((16, 1024), (8, 2048), (4, 4096), (2, 8192), (1, 16384))
    for d in a.head_dim:
        configs = TILES[d] if a.tiles else PERSISTENT if a.persistent else {
            n: dict(kw, block_n=fwd_ws.TILES[d]["block_n"]) for n, kw in SCHEDULES.items()}
        print(f"\n{'d':>4} {'causal':>6} {'b':>3} {'s':>6} | " + " ".join(f"{n:>12}" for n in configs)
              + f" {'wgmma':>7} {'cuDNN':>7} TF/s | {'best/wgmma':>10} {'best/cuDNN':>10} | max |diff|")
        for causal in (False, True):
            for b, s in shapes:
                h = 2048 // d
                shp = (b, s, h, d)
                sets = bench._make_sets(torch, (shp, shp, shp), torch.bfloat16, extra_bytes=math.prod(shp) * 2)
                q, k, v = sets[0]
                with wgmma_planned():
                    base = cuflash.attention(q, k, v, causal=causal)
                    planned = bench.time_cuda(lambda q, k, v: cuflash.attention(q, k, v, causal=causal), sets, 5, 30)
                flops = 4 * b * s * s * h * d / (2 if causal else 1)
                tf = lambda ms: flops / ms / 1e9 if ms else float("nan")  # noqa: E731
                diff, ws = 0.0, {}
                for name, kw in configs.items():
                    if a.persistent:  # on the planner's tile for this shape
                        p = fwd_ws.planned(d, "bf16", causal, s)
                        kw = dict(block_m=p.block_m, block_n=p.block_n, overlap=p.overlap, pingpong=p.pingpong, **kw)
                    diff = max(diff, (fwd_ws.run(q, k, v, causal=causal, **kw).float() - base.float()).abs().max().item())
                    ws[name] = tf(bench.time_cuda(lambda q, k, v: fwd_ws.run(q, k, v, causal=causal, **kw), sets, 5, 30))
                planned = tf(planned)
                sets_t = [tuple(t.transpose(1, 2) for t in x) for x in sets]
                cudnn = tf(bench._time_sdpa(torch, "CUDNN_ATTENTION", sets_t, causal, False, 5, 30))
                best = max(ws.values())
                print(f"{d:>4} {causal!s:>6} {b:>3} {s:>6} | " + " ".join(f"{x:12.1f}" for x in ws.values())
                      + f" {planned:7.1f} {cudnn:7.1f}      | {best / planned:10.2f} {best / cudnn:10.2f} | {diff:.3g}",
                      flush=True)
                del sets, sets_t, q, k, v
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
