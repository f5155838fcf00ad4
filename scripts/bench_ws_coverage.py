"""Time the calls that the warp-specialised kernels took over from the older ones: forwards with
softcap, ALiBi and packed (varlen) sequences, chunked prefill into contiguous KV caches, and
backwards with softcap and ALiBi. Prints one JSON line per case (TF/s) for the cuflash that
Python imports, so that an A/B of two trees is two runs (``kvcache-switch``, ``paged-switch`` and
``sinks-switch`` compare fwd_ws with the wgmma kernel in one process instead):

    PYTHONPATH=/path/to/old/tree python scripts/bench_ws_coverage.py fwd-mods old >> ab.jsonl
    PYTHONPATH=. python scripts/bench_ws_coverage.py fwd-mods new >> ab.jsonl

bf16, model dim 2048, `cuflash.bench.time_cuda` medians (one call per sample, so a small call's
host time is in its samples). FLOPs: FlashAttention's count over the pairs each query sees
(backward: 2.5x the forward's).
"""
import argparse
import json

import numpy as np
import torch

import cuflash
from cuflash.backward import attention_backward
from cuflash.bench import time_cuda


def _mk(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def _lengths(rng, total, n):
    """n sequence lengths of at least 256 summing to total."""
    cut = np.sort(rng.choice(np.arange(256, total - 256), n - 1, replace=False))
    return np.diff(np.concatenate([[0], cut, [total]]))


def fwd_mods():
    """Packed sequences (8 of random lengths, 16k tokens) and dense b=4 s=4k calls with softcap or ALiBi."""
    rng = np.random.default_rng(0)
    for d, causal in ((128, True), (128, False), (64, True), (256, True)):
        h, lens = 2048 // d, _lengths(rng, 16384, 8)
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
        sets = [(_mk(16384, h, d), _mk(16384, h, d), _mk(16384, h, d)) for _ in range(3)]
        mx = int(lens.max())
        ms = time_cuda(lambda q, k, v: cuflash.attention_varlen(q, k, v, cu, cu, mx, mx, causal=causal), sets,
                       warmup=5, reps=30)
        flops = sum(4 * n * n * h * d / (2 if causal else 1) for n in lens)
        yield f"varlen d{d} {'causal' if causal else 'full'} 8 seqs 16k", flops / ms / 1e9
    for d, mod in ((256, dict(softcap=50.0)), (128, dict(softcap=30.0)), (128, "alibi"), (64, dict(softcap=30.0))):
        h = 2048 // d
        for causal in (True, False):
            sets = [(_mk(4, 4096, h, d), _mk(4, 4096, h, d), _mk(4, 4096, h, d)) for _ in range(3)]
            kw = dict(alibi_slopes=torch.rand(h, device="cuda")) if mod == "alibi" else mod
            ms = time_cuda(lambda q, k, v: cuflash.attention(q, k, v, causal=causal, **kw), sets, warmup=5, reps=30)
            flops = 4 * 4 * 4096 * 4096 * h * d / (2 if causal else 1)
            yield (f"d{d} {'causal' if causal else 'full'} 4x4k {'alibi' if mod == 'alibi' else 'softcap'}",
                   flops / ms / 1e9)


def bwd_mods():
    """Backward only (forward saved), b=4 s=4k, softcap 30 or ALiBi."""
    for d, mod in ((128, "softcap"), (128, "alibi"), (256, "softcap"), (64, "softcap"), (64, "alibi")):
        h = 2048 // d
        for causal in (True, False):
            kw = dict(softcap=30.0) if mod == "softcap" else dict(alibi_slopes=torch.rand(h, device="cuda"))
            sets = []
            for _ in range(3):
                q, k, v = _mk(4, 4096, h, d), _mk(4, 4096, h, d), _mk(4, 4096, h, d)
                o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, **kw)
                sets.append((torch.randn_like(o), q, k, v, o, lse))
            ms = time_cuda(lambda do, q, k, v, o, lse: attention_backward(do, q, k, v, o, lse, causal=causal, **kw),
                           sets, warmup=5, reps=20)
            flops = 2.5 * 4 * 4 * 4096 * 4096 * h * d / (2 if causal else 1)
            yield f"bwd d{d} {'causal' if causal else 'full'} 4x4k {mod}", flops / ms / 1e9


def kvcache():
    """A chunk of `new` tokens appended to b=4 contiguous caches of 8192 rows holding `old` each."""
    for d, causal, old, new in ((128, True, 4096, 2048), (128, True, 1024, 1024), (64, True, 4096, 2048),
                                (256, True, 4096, 2048), (128, False, 4096, 2048)):
        h = 2048 // d
        hk, b = max(h // 4, 1), 4
        kc, vc = _mk(b, 8192, hk, d), _mk(b, 8192, hk, d)
        seqlens = torch.full((b,), old, dtype=torch.int32, device="cuda")
        sets = [(_mk(b, new, h, d), _mk(b, new, hk, d), _mk(b, new, hk, d)) for _ in range(3)]
        ms = time_cuda(lambda q, kn, vn: cuflash.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens,
                                                                       causal=causal), sets, warmup=5, reps=30)
        pairs = new * old + (new * (new + 1) // 2 if causal else new * new)
        yield f"kvcache d{d} {'causal' if causal else 'full'} b4 old{old} new{new}", 4 * b * h * d * pairs / ms / 1e9


def _switch(call, sets, flops, ways):
    """TF/s of call(*inputs) with the planner's fwd_ws switch on and off, three rotated rounds, each
    way timed as ``ways`` says (name -> (hide_launch, calls per sample))."""
    import importlib
    from cuflash.bench import rotated_rounds
    plan = importlib.import_module("cuflash.plan")  # the module (cuflash.plan is the function)

    def timer(ws, hide, batch):
        def run():
            plan.FWD_WS = ws
            plan.forget_plans()
            return time_cuda(call, sets, warmup=5, reps=30, hide_launch=hide, batch=batch)
        return run
    got = rotated_rounds({f"{'fwd_ws' if ws else 'wgmma'} {how}": timer(ws, *way) for ws in (True, False)
                          for how, way in ways.items()}, 3)
    plan.FWD_WS = True
    plan.forget_plans()
    return {name: flops / ms / 1e9 for name, ms in got.items()}


def kvcache_switch():
    """Chunks into b=4 caches of 8192 rows, d=128, in one process: fwd_ws against the wgmma kernel
    (the planner's fwd_ws switch), each timed with one call per sample, with hidden launches (GPU
    time only) and with 8 calls per sample."""
    for causal, old, new in ((True, 1024, 1024), (True, 4096, 2048), (False, 1024, 1024)):
        d, b = 128, 4
        h, hk = 2048 // d, 2048 // d // 4
        kc, vc = _mk(b, 8192, hk, d), _mk(b, 8192, hk, d)
        seqlens = torch.full((b,), old, dtype=torch.int32, device="cuda")
        sets = [(_mk(b, new, h, d), _mk(b, new, hk, d), _mk(b, new, hk, d)) for _ in range(3)]
        flops = 4 * b * h * d * (new * old + (new * (new + 1) // 2 if causal else new * new))
        got = _switch(lambda q, kn, vn: cuflash.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens,
                                                                       causal=causal), sets, flops,
                      {"1 call": (False, 1), "hidden": (True, 1), "8 calls": (False, 8)})
        for name, tf in got.items():
            yield f"kvcache d{d} {'causal' if causal else 'full'} b4 old{old} new{new} {name}", tf


def paged_switch():
    """Chunks into b=4 paged caches (pages of 16 or 64 rows in random order, 8192 rows per
    sequence), fwd_ws against the wgmma kernel as kvcache-switch, hidden launches."""
    for d, page, causal, old, new in ((128, 16, True, 4096, 2048), (128, 64, True, 4096, 2048),
                                      (256, 16, True, 4096, 2048), (128, 16, False, 1024, 1024)):
        h, b = 2048 // d, 4
        hk, per = h // 4, 8192 // page
        table = torch.from_numpy(np.random.default_rng(0).permutation(b * per).reshape(b, per).astype(np.int32)).cuda()
        kp, vp = _mk(b * per, page, hk, d), _mk(b * per, page, hk, d)
        seqlens = torch.full((b,), old, dtype=torch.int32, device="cuda")
        sets = [(_mk(b, new, h, d), _mk(b, new, hk, d), _mk(b, new, hk, d)) for _ in range(3)]
        flops = 4 * b * h * d * (new * old + (new * (new + 1) // 2 if causal else new * new))
        got = _switch(lambda q, kn, vn: cuflash.attention_with_kvcache(
            q, kp, vp, kn, vn, cache_seqlens=seqlens, block_table=table, causal=causal), sets, flops,
            {"hidden": (True, 1)})
        for name, tf in got.items():
            yield f"paged{page} d{d} {'causal' if causal else 'full'} b4 old{old} new{new} {name}", tf


def sinks_switch():
    """gpt-oss-shaped prefill with attention sinks (64 query and 8 KV heads, d=64; causal, a
    128-token window, no mask), fwd_ws against the wgmma kernel as kvcache-switch, one call per
    sample; TF/s over the pairs each query sees."""
    torch.manual_seed(0)
    for b, s, win, causal in ((1, 8192, None, True), (1, 8192, (127, 0), True), (8, 2048, None, True),
                              (4, 4096, None, False)):
        h, hk, d = 64, 8, 64
        sets = [(_mk(b, s, h, d), _mk(b, s, hk, d), _mk(b, s, hk, d)) for _ in range(3)]
        kw = dict(causal=causal, sinks=torch.randn(h, device="cuda") + 2, **({"window_size": win} if win else {}))
        pairs = min(win[0] + 1, s) * s if win else s * (s + 1) // 2 if causal else s * s
        got = _switch(lambda q, k, v: cuflash.attention(q, k, v, **kw), sets, 4 * b * h * d * pairs,
                      {"1 call": (False, 1)})
        for name, tf in got.items():
            yield f"sinks 64/8 d64 b{b} s{s} {'window' + str(win[0]) if win else 'causal' if causal else 'full'} {name}", tf


CASES = {"fwd-mods": fwd_mods, "bwd-mods": bwd_mods, "kvcache": kvcache, "kvcache-switch": kvcache_switch,
         "paged-switch": paged_switch, "sinks-switch": sinks_switch}

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", choices=sorted(CASES))
    ap.add_argument("tag", help="a label for the tree being timed (printed with each line)")
    a = ap.parse_args()
    for case, tflops in CASES[a.cases]():
        print(json.dumps(dict(tag=a.tag, case=case, tf=tflops)), flush=True)
