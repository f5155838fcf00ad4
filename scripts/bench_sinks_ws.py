"""gpt-oss-shaped prefill with attention sinks (64 query heads, 8 KV heads, d=64; causal, a
128-token window, and without a mask): the warp-specialised forward against the wgmma kernel
(the planner's fwd_ws switch) in one process, three rotated rounds, TF/s over the pairs each
query sees, and the largest difference of their outputs. One JSON line per row.

    python scripts/bench_sinks_ws.py
"""
import importlib
import json

import torch

import cuflash
from cuflash import bench

plan = importlib.import_module("cuflash.plan")  # the module (cuflash.plan is the function)
torch.manual_seed(0)
for b, s, win, causal in ((1, 8192, None, True), (1, 8192, (127, 0), True), (8, 2048, None, True), (4, 4096, None, False)):
    h, hk, d = 64, 8, 64
    sets = [tuple(torch.randn(b, s, n, d, dtype=torch.bfloat16, device="cuda") for n in (h, hk, hk)) for _ in range(3)]
    sinks = torch.randn(h, device="cuda") + 2
    kw = dict(causal=causal, sinks=sinks, **({"window_size": win} if win else {}))

    def timer(ws):
        def t():
            plan.FWD_WS = ws
            plan.forget_plans()
            return bench.time_cuda(lambda q, k, v: cuflash.attention(q, k, v, **kw), sets, 5, 30)
        return t
    got = bench.rotated_rounds({"fwd_ws": timer(True), "wgmma": timer(False)}, 3)
    q, k, v = sets[0]
    outs = []
    for ws in (True, False):
        plan.FWD_WS = ws
        plan.forget_plans()
        outs.append(cuflash.attention(q, k, v, **kw))
    plan.FWD_WS = True
    plan.forget_plans()
    pairs = (min(win[0] + 1, s) * s if win else (s * (s + 1) // 2 if causal else s * s))
    fl = 4 * b * h * d * pairs
    print(json.dumps(dict(row=f"b{b} s{s} {'window' + str(win) if win else 'causal' if causal else 'full'} 64/8 d64 sinks",
                          maxdiff=(outs[0].float() - outs[1].float()).abs().max().item(), **{n: round(fl / ms / 1e9, 1) for n, ms in got.items()})), flush=True)
