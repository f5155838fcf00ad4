"""Time configurations of the warp-specialised backward (cuflash.kernels.bwd_ws) against the
wgmma dK/dV kernel it replaced (CUFLASH_BWD_WS's switch off) and SDPA's cuDNN backward, on an
H100/H200, after checking each one's gradients against the wgmma kernel's.

    python scripts/bench_bwd_ws.py [--quick] [--head-dim D ...]

Configurations: dQ added with atomics after dK's product (``ws``), with dQ's product issued
before dK's so that its adds overlap dK's product (``dq_early``, planned at d = 64), and staged
in shared memory for a producer warp to add (``dq_writer``, planned at d = 128; alone and with
``dq_early``), and the planned one (at d = 128 80-query steps with dQ^T, ``dq_t``); at d = 256 the
planned kernel against the mma.sync one it replaced.
``--deterministic``: the planned deterministic backward (the ordered dQ writer at d = 64 and 128)
against the same without ``dq_early``. ``--lpt``: causal only, key blocks in the plain launch
order against longest first (``lpt``, at every head dim). ``--dtype float16``: fp16 inputs. Prints
one line per shape: TFLOP/s (2.5 x the forward's FLOPs) of each, of the replaced kernel and of
cuDNN, the best one's ratio to both, and the largest |difference| from the wgmma kernel's
gradients (dq, dk, dv) relative to their largest magnitude. Model dim 2048.
"""
import argparse
import contextlib
import dataclasses
import importlib

from cuflash import bench
from cuflash.kernels import bwd_ws

_NONE = dict(dq_early=False, dq_writer=False, dq_t=False)
CONFIGS = {"ws": _NONE, "ws dqearly": {**_NONE, "dq_early": True}, "ws writer": {**_NONE, "dq_writer": True},
           "writer+early": {**_NONE, "dq_writer": True, "dq_early": True}, "planned": {}}
CONFIGS_256 = {"ws": {}}
CONFIGS_DET = {"planned": {}, "not early": dict(dq_early=False)}
CONFIGS_LPT = {"plain order": dict(lpt=False), "lpt": dict(lpt=True)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one shape per head dim and mask")
    ap.add_argument("--head-dim", type=int, nargs="+", default=list(bwd_ws.HEAD_DIMS))
    ap.add_argument("--deterministic", action="store_true", help="deterministic backward configurations")
    ap.add_argument("--lpt", action="store_true", help="causal: plain launch order against longest first")
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    a = ap.parse_args()
    if a.lpt and a.deterministic:
        ap.error("--lpt compares launch orders of the atomic dQ kernels: not with --deterministic")
    torch = bench._torch()
    import cuflash
    from cuflash.backward import attention_backward
    plan = importlib.import_module("cuflash.plan")  # the module (cuflash.plan is the function)
    planned = bwd_ws.planned

    @contextlib.contextmanager
    def configured(ws, **kw):
        """Backward plans made inside run the wgmma kernel (ws=False) or bwd_ws with ``kw``."""
        def set_(on, fields):
            plan.BWD_WS = on
            plan.bwd_ws.planned = lambda *args: dataclasses.replace(planned(*args), **fields)
            plan.forget_plans()
        set_(ws, kw)
        try:
            yield
        finally:
            set_(True, {})
    shapes = ((8, 2048),) if a.quick else ((16, 1024), (8, 2048), (4, 4096), (2, 8192), (1, 16384))
    for d in a.head_dim:
        configs = (CONFIGS_LPT if a.lpt else CONFIGS_256 if d == 256 else CONFIGS_DET if a.deterministic
                   else CONFIGS)
        print(f"\n{'d':>4} {'causal':>6} {'b':>3} {'s':>6} | " + " ".join(f"{n:>10}" for n in configs)
              + f" {'before':>7} {'cuDNN':>7} TF/s | {'best/before':>11} {'best/cuDNN':>10} | max rel diff")
        for causal in (True,) if a.lpt else (False, True):
            for b, s in shapes:
                h = 2048 // d
                shp = (b, s, h, d)
                sets = bench._make_sets(torch, (shp, shp, shp, shp), getattr(torch, a.dtype), min_sets=2)
                saved = [(do, q, k, v, *cuflash.attention(q, k, v, causal=causal, return_lse=True))
                         for q, k, v, do in sets]
                fn = lambda do, q, k, v, o, lse: attention_backward(  # noqa: E731
                    do, q, k, v, o, lse, causal=causal, deterministic=a.deterministic)
                flops = 2.5 * 4 * b * s * s * h * d / (2 if causal else 1)
                tf = lambda ms: flops / ms / 1e9 if ms else float("nan")  # noqa: E731
                with configured(False):
                    base = fn(*saved[0])
                    wgmma = tf(bench.time_cuda(fn, saved, 3, 20))
                diff, res = 0.0, {}
                for name, kw in configs.items():
                    with configured(True, **kw):
                        got = fn(*saved[0])
                        diff = max([diff] + [((x.float() - y.float()).abs().max() / y.float().abs().max()).item()
                                             for x, y in zip(got, base)])
                        res[name] = tf(bench.time_cuda(fn, saved, 3, 20))
                call = bench._sdpa_backward_call(torch, "CUDNN_ATTENTION", sets, causal)
                cudnn = tf(bench.time_interleaved({"cudnn": call}, 3, 20)["cudnn"] if call else None)
                best = max(res.values())
                print(f"{d:>4} {causal!s:>6} {b:>3} {s:>6} | " + " ".join(f"{x:10.1f}" for x in res.values())
                      + f" {wgmma:7.1f} {cudnn:7.1f}      | {best / wgmma:11.2f} {best / cudnn:10.2f} | {diff:.3g}",
                      flush=True)
                del sets, saved, base
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
