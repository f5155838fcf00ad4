"""cuflash alone on `bench mask`'s FlashMask families, forward and forward + backward, for comparing
two trees (run it once with each on PYTHONPATH): no FlexAttention or SDPA, so a run takes seconds.

    python scripts/bench_mask_ab.py [--seqlen 8192 32768] [--reps 10] [--head-dim 128] [--deterministic]
    python scripts/bench_mask_ab.py --trial fm_window dq_t [--rounds 3] [--head-dim 128] [--deterministic]
    python scripts/bench_mask_ab.py --trial persistent [--rounds 3] [--head-dim 128]
    python scripts/bench_mask_ab.py --trial double_q [--rounds 3] [--head-dim 128]

Prints per family and length the TF/s on the kept pairs (bench mask's count) and the share of
plain causal attention's TF/s at the same length and pass (#21 asks at least 85%). bf16, d = 128
unless --head-dim says otherwise, 16 heads, batch 1, the masks bench mask builds (seed 0).
``--trial F ...``: in one process, forward + backward with the planned FlashMask bwd_ws variant
against the same with the bool fields F flipped where they apply (bwd_ws.flipped), in rounds
that alternate the two (the order rotated each round), and their ratio. ``--trial persistent``:
the same for the forward alone, the planned fwd_ws variant against it with persistent blocks
flipped (on where it is off, off where it is on; where FwdWsVariant accepts it: 128-row tiles at
d <= 128); ``--trial double_q`` likewise with two Q tiles flipped (persistent blocks only). Rows whose
trial variant is the planned one say "(the same kernel)": their ratio is the runs' noise."""
import argparse
import statistics

import numpy as np
import torch

from cuflash import bench
from cuflash.kernels.bwd_ws import FLIPPABLE

FWD_FLIPPABLE = ("persistent", "double_q")  # the forward's (fwd_ws) trial fields, one at a time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--trial", nargs="+", default=[], choices=(*FLIPPABLE, *FWD_FLIPPABLE), metavar="FIELD")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--deterministic", action="store_true", help="deterministic backward (ordered dQ adds)")
    ap.add_argument("--families", nargs="+", default=list(bench.MASK_FAMILIES), choices=bench.MASK_FAMILIES)
    a = ap.parse_args()
    if a.trial:
        return trial(a)
    for s in a.seqlen:
        shp = (1, s, 16, a.head_dim)
        sets = bench._make_sets(torch, (shp,) * 4, torch.bfloat16, min_sets=2)  # q, k, v, do
        grad_sets = [(*(t.detach().requires_grad_() for t in x[:3]), x[3]) for x in sets]
        causal_tf = {}
        for fam in ("causal", *a.families):
            idx, causal, _, _ = bench._mask_family(fam, s, 16, 0)
            pairs = bench.mask_pairs(idx, s, causal, 16)
            idx = None if fam == "causal" else torch.from_numpy(np.ascontiguousarray(idx)).cuda()
            line = f"{fam:22s} {s:6d}"
            for backward in (False, True):
                ms = bench.time_cuda(bench._grad_fn(torch, _attn(causal, idx, a.deterministic), backward),
                                     grad_sets if backward else sets, 5, a.reps)
                tf = bench.mask_flops(pairs, a.head_dim, backward) / ms / 1e9
                causal_tf.setdefault(backward, tf)
                line += f" | {'fb' if backward else 'f '} {tf:6.1f} {100 * tf / causal_tf[backward]:4.0f}%"
            print(line, flush=True)
        del sets, grad_sets
        torch.cuda.empty_cache()


def _attn(causal, idx, deterministic):
    """cuflash.torch.attention with the FlashMask indices (none for plain causal) as attn(q, k, v)."""
    import cuflash.torch as ct
    kw = {} if idx is None else {"startend_row_indices": idx}
    return lambda q, k, v: ct.attention(q, k, v, causal=causal, deterministic=deterministic, **kw)


def trial(a):
    from dataclasses import replace
    from cuflash.plan import forget_plans
    from cuflash.kernels import bwd_ws, fwd_ws
    fwd = len(a.trial) == 1 and a.trial[0] in FWD_FLIPPABLE
    if not fwd and any(f in FWD_FLIPPABLE for f in a.trial):
        raise SystemExit(f"--trial {' or '.join(FWD_FLIPPABLE)} (the forward's) takes no other field")
    kernels = fwd_ws if fwd else bwd_ws
    planned = kernels.planned

    def flip_fwd(v):  # where the variant's own checks take the other choice
        f = a.trial[0]
        try:
            return replace(v, **{f: not getattr(v, f)}, **({"double_q": False} if f == "persistent" else {}))
        except ValueError:
            return v

    change = flip_fwd if fwd else (lambda v: bwd_ws.flipped(v, a.trial))
    changed = []  # whether the trial's variant differed from the planned one (per family and length)

    def trial_variant(*p, **k):
        v = planned(*p, **k)
        w = change(v) if v.flashmask else v
        changed.append(w != v)
        return w

    modes = {"planned": planned, "trial": trial_variant}
    try:
        for s in a.seqlen:
            shp = (1, s, 16, a.head_dim)
            sets = bench._make_sets(torch, (shp,) * 4, torch.bfloat16, min_sets=2)
            grad_sets = [(*(t.detach().requires_grad_() for t in x[:3]), x[3]) for x in sets]
            for fam in a.families:
                idx, causal, _, _ = bench._mask_family(fam, s, 16, 0)
                pairs = bench.mask_pairs(idx, s, causal, 16)
                idx = torch.from_numpy(np.ascontiguousarray(idx)).cuda()
                tf = {m: [] for m in modes}
                changed.clear()
                for r in range(a.rounds):
                    for m in list(modes)[r % 2:] + list(modes)[:r % 2]:
                        kernels.planned = modes[m]
                        forget_plans()
                        attn = _attn(causal, idx, a.deterministic)
                        ms = bench.time_cuda(bench._grad_fn(torch, attn, not fwd), sets if fwd else grad_sets, 5,
                                             a.reps)
                        tf[m].append(bench.mask_flops(pairs, a.head_dim, not fwd) / ms / 1e9)
                p, w = (statistics.median(tf[m]) for m in modes)
                print(f"{fam:22s} {s:6d} | {'f ' if fwd else 'fb'} planned {p:6.1f} flipped {'+'.join(a.trial)} "
                      f"{w:6.1f} | {w / p:.3f}{'' if any(changed) else ' (the same kernel)'}", flush=True)
            del sets, grad_sets
            torch.cuda.empty_cache()
    finally:
        kernels.planned = planned
        forget_plans()


if __name__ == "__main__":
    main()
