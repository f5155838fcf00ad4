"""A cost model of the FlashMask kernels against plain causal attention, fitted to measured
throughputs, to ask where the time goes and what a change could bring (no GPU needed).

Each block of a launch (forward: a query tile; backward: a key block) costs, in steps of one
128 x 128 tile, F (its fixed start and end) plus, for each tile it computes, 1 + k (k: the
FlashMask kernel's extra work per step over plain causal's kernel), plus mu for a partly masked
tile. Blocks start in launch order (FlashMask: every head's first block, then every head's
second, ...; plain causal: head by head) on 132 SMs, one block per SM, as each SM frees
(list scheduling); a launch takes its makespan. A backward step does 2.5 times a forward step's
products. The share of plain causal's throughput on the visible pairs is then
(pairs / time) / (causal pairs / causal time), forward alone and forward + backward. F, mu and k
are fitted by grid search, forward first, to the shares measured at 8k tokens, bf16, d = 128,
16 heads (BENCHMARKS.md, "Launch order: every head's first tile, then every head's second",
H200, 2026-11-27), then the model answers what-ifs.

    python scripts/flashmask_cost_model.py
"""
import heapq
import itertools

import numpy as np

from cuflash import bench
from cuflash.plan import tile_classes

SMS, HEADS, SEQLEN, BLOCK = 132, 16, 8192, 128
BWD_STEP = 2.5  # a backward step's products over a forward step's (bench.BACKWARD_FLOPS)
# Shares of plain causal's TF/s measured at 8k (forward, forward + backward)
MEASURED = dict(document=(.94, .80), causal_document=(.83, .65), share_question=(.80, .66),
                prefix_lm_document=(.72, .71), global_sliding_window=(.85, .72), causal_blockwise=(.82, .70),
                qk_sparse=(.97, .81), random_eviction=(.72, .59))


def makespan(costs):
    """The time the last of ``costs`` ends when each starts, in order, on the first SM to free."""
    free = [0.0] * SMS
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def classes(name):
    """(tile classes (heads, query tiles, key blocks): 0 skipped, 1 masked, 2 whole; causal;
    visible pairs) of bench mask's family ``name`` at SEQLEN."""
    idx, causal, _ = bench.mask_family(name, SEQLEN, HEADS)
    c = tile_classes(idx, SEQLEN, SEQLEN, BLOCK, BLOCK, causal)[0]
    return np.broadcast_to(c, (HEADS,) + c.shape[1:]), causal, bench.mask_pairs(idx, SEQLEN, causal, HEADS)


def launch_time(c, causal, backward, fixed, mu, k, rounds=True):
    """Makespan of the forward (query tiles) or backward (key blocks) launch over tile classes c."""
    axis = 1 if backward else 2
    per = ((c > 0) * (1 + k + mu * (c == 1))).sum(axis=axis) + fixed * (c > 0).any(axis=axis)
    order = range(per.shape[1] - 1, -1, -1) if causal and not backward else range(per.shape[1])
    if rounds:
        return makespan([per[h, i] for i in order for h in range(per.shape[0])])
    return makespan([per[h, i] for h in range(per.shape[0]) for i in order])


def main():
    fams = {n: classes(n) for n in MEASURED}
    causal_c, _, causal_pairs = classes("causal")

    def shares(n, ff, muf, kf, fb, mub, kb, scale=1.0):
        c, causal, pairs = fams[n]
        tf = launch_time(c, causal, False, ff * scale, muf, kf)
        tb = launch_time(c, causal, True, fb * scale, mub, kb)
        cf = launch_time(causal_c, True, False, ff, 0, 0, rounds=False)
        cb = launch_time(causal_c, True, True, fb, 0, 0, rounds=False)
        return ((pairs / tf) / (causal_pairs / cf),
                (pairs / (tf + BWD_STEP * tb)) / (causal_pairs / (cf + BWD_STEP * cb)))

    def fit(grid, err):
        return min(grid, key=err)

    ff, muf, kf = fit(itertools.product((0.5, 1, 1.5, 2, 3, 4), (0, .1, .2, .3, .5, .8), (0, .05, .1, .15, .2)),
                      lambda p: sum((shares(n, *p, 0, 0, 0)[0] - m[0]) ** 2 for n, m in MEASURED.items()))
    fb, mub, kb = fit(itertools.product((1, 1.75, 2.5, 3.5, 5, 7), (0, .2, .4, .6, .8, 1), (0, .1, .2, .3, .4, .5)),
                      lambda p: sum((shares(n, ff, muf, kf, *p)[1] - m[1]) ** 2 for n, m in MEASURED.items()))
    print(f"fitted: forward F={ff} mu={muf} k={kf}; backward F={fb} mu={mub} k={kb} (steps)")
    cases = [("model", {}), ("persistent (F/4)", dict(scale=0.25)), ("bwd k=0.1", dict(kb=0.1)),
             ("bwd k=0.1, mu=0.2", dict(kb=0.1, mub=0.2)), ("both + persistent", dict(kb=0.1, mub=0.2, scale=0.25))]
    print(f"{'family':22s} {'measured':>10s} " + " ".join(f"{name:>18s}" for name, _ in cases))
    for n, m in MEASURED.items():
        row = []
        for _, what in cases:
            p = dict(ff=ff, muf=muf, kf=kf, fb=fb, mub=mub, kb=kb) | what
            f, fwb = shares(n, **p)
            row.append(f"{f:.2f} / {fwb:.2f}")
        print(f"{n:22s} {m[0]:.2f} / {m[1]:.2f} " + " ".join(f"{x:>18s}" for x in row))


if __name__ == "__main__":
    main()
