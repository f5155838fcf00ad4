"""GPU check of scripts/bwd_rounding_study.py's finding (issue 18): the bf16 backward's misses of
flash-attn's rule (max|grad - ref64| <= 2 * max|grad_same - ref64| + 2e-4) at seqlen_k = 2 come
from the forward's rounding of P before its P V product, which moves the stored O and hence
D = rowsum(dO * O); the old same-precision reference (D from round(P V)) leaves it out, the new
one (D from the same-precision forward's O, cuflash.reference now) makes it.

Per case (bf16, random standard-normal inputs, a seed each) it runs cuflash.attention(...,
return_lse=True) and cuflash.backward.attention_backward on the GPU and prints, for dq and dk:
the kernel's error against the float64 reference, the old and the new same-precision
references' errors, the ratios kernel / reference (with MISS where the rule fails), and the
NumPy emulation's predicted error; then how many of the forward's O elements (rows that see at
least two keys) equal the emulation's / round(P V). A summary per shape follows.

    PYTHONPATH=. python scripts/bwd_accuracy_probe.py [--seeds 60] [--seconds 45]

Writes the report to $OUT/bwd_probe.txt when $OUT is set (the summary also to stdout), else to
stdout. Needs PyTorch with CUDA and cuflash; stops starting new cases after --seconds.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bwd_rounding_study
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # cuflash

import bwd_rounding_study as study  # noqa: E402
from cuflash import reference  # noqa: E402

BF16 = study.DTYPES["bfloat16"]
# (b, sq, sk, h, hk, d, causal, window, seeds as a fraction of --seeds)
SHAPES = [
    (1, 23, 2, 3, 3, 24, False, (-1, 0), 1.0),   # one of the H200 misses
    (2, 17, 2, 3, 3, 24, True, (-1, -1), 1.0),
    (2, 5, 2, 4, 2, 32, False, (-1, 0), 1.0),
    (1, 64, 2, 2, 2, 64, False, (-1, -1), 1.0),
    (1, 23, 2, 4, 4, 64, True, (-1, -1), 1.0),  # d = 64: the wgmma dK/dV kernel on sm_90
    (1, 23, 1, 3, 3, 24, False, (-1, 0), 0.3),   # more keys per row for comparison
    (1, 23, 3, 3, 3, 24, False, (-1, 0), 0.3),
    (1, 23, 8, 3, 3, 24, False, (-1, 0), 0.3),
    (1, 23, 64, 3, 3, 24, False, (-1, 0), 0.3),
]


def to_gpu(x):
    import torch
    return torch.from_numpy(np.ascontiguousarray(x.astype(np.float32))).to("cuda").to(torch.bfloat16)


def to_np(t):
    return t.detach().float().cpu().numpy().astype(BF16)


def warmup(shapes):
    """Compile the kernels of every shape in parallel first (best effort: they compile on first
    use otherwise)."""
    try:
        import cuflash
        from cuflash import compiler
        vs = []
        for b, sq, sk, h, hk, d, causal, window, _ in shapes:
            for bwd in (False, True):  # the forward's kernels and the backward's
                p = cuflash.plan((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), causal=causal, window_size=window,
                                 return_lse=True, dtype="bfloat16", backward=bwd)
                vs += [launch.variant for launch in p.launches]
        t0 = time.time()
        compiler.warmup(vs)
        return f"warmup: {len(set(vs))} kernels ready in {time.time() - t0:.1f} s"
    except Exception as e:  # noqa: BLE001 (the cases compile what they need anyway)
        return f"warmup skipped ({type(e).__name__}: {e})"


def run_case(seed, b, sq, sk, h, hk, d, causal, window):
    import cuflash
    from cuflash.backward import attention_backward
    dout, q, k, v = study.inputs(seed, b, sq, sk, h, hk, d, BF16)
    qt, kt, vt, dot = (to_gpu(x) for x in (q, k, v, dout))
    out, lse = cuflash.attention(qt, kt, vt, causal=causal, window_size=window, return_lse=True)
    grads = [to_np(g) for g in attention_backward(dot, qt, kt, vt, out, lse, causal=causal, window_size=window)]
    w = study.window_of(causal, window)
    ref64 = reference.attention_backward(dout, q, k, v, window_size=w)
    emu_grads, emu_out = study.kernel_emulation(dout, q, k, v, window=w, return_out=True)
    res = {"gpu": study.errors(grads, ref64),
           "old": study.errors(study.old_same_reference(dout, q, k, v, window=w), ref64),
           "new": study.errors(reference.attention_backward(dout, q, k, v, window_size=w, precision="same"), ref64),
           "emu": study.errors(emu_grads, ref64)}
    # the forward's O on rows that see two keys or more: the emulation's, or round(P V)?
    rows = study.visible(sq, sk, *w).sum(axis=1) >= 2
    o = to_np(out).astype(np.float64)[:, rows]
    exact = reference.attention(q, k, v, window_size=w).astype(BF16).astype(np.float64)[:, rows]
    res["o_emu"] = np.mean(o == emu_out.astype(np.float64)[:, rows]) if o.size else np.nan
    res["o_rpv"] = np.mean(o == exact) if o.size else np.nan
    return res


def verdict(err, err_same):
    return "MISS" if err > 2 * err_same + 2e-4 else "ok"


def case_line(tag, seed, r):
    parts = [f"{tag} seed {seed:3d}"]
    for i, g in ((0, "dq"), (1, "dk")):
        e, old, new, emu = r["gpu"][i], r["old"][i], r["new"][i], r["emu"][i]
        ratio = lambda a, s: f"{a / s:.2f}x" if s > 0 else "-"  # noqa: E731
        parts.append(f"{g}: gpu {e:.2e} | old {old:.2e} {ratio(e, old)} {verdict(e, old)} | new {new:.2e} "
                     f"{ratio(e, new)} {verdict(e, new)} | emu {emu:.2e} ({ratio(emu, old)} old, "
                     f"{verdict(emu, old)})")
    parts.append(f"O==emu {r['o_emu']:.0%} O==round(PV) {r['o_rpv']:.0%}")
    return " || ".join(parts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=60, help="seeds per seqlen_k = 2 shape (others get 30%%)")
    ap.add_argument("--seconds", type=float, default=45.0, help="start no new case after this")
    args = ap.parse_args()
    warnings.simplefilter("ignore", RuntimeWarning)  # nan ratios where both errors are 0 (one key per row)
    try:
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False")
    except Exception as e:  # noqa: BLE001
        print(f"bwd_accuracy_probe needs PyTorch with a CUDA GPU: {e}")
        return 1
    t0 = time.time()
    lines = [f"device: {torch.cuda.get_device_name()}; rule: err <= 2 * err_same + 2e-4; old = D from "
             f"round(P V), new = D from the same-precision forward's O (cuflash.reference now)",
             warmup(SHAPES)]
    summary = []
    for b, sq, sk, h, hk, d, causal, window, frac in SHAPES:
        tag = f"b{b} sq{sq} sk{sk} h{h}/{hk} d{d} {'causal' if causal else f'w{window}'}"
        rs = []
        for seed in range(max(1, round(args.seeds * frac))):
            if time.time() - t0 > args.seconds:
                break
            r = run_case(seed, b, sq, sk, h, hk, d, causal, window)
            rs.append(r)
            lines.append(case_line(tag, seed, r))
        if not rs:
            summary.append(f"{tag}: not run (time budget)")
            continue
        a = {key: np.array([r[key] for r in rs]) for key in ("gpu", "old", "new", "emu")}
        miss = lambda e, s: (e > 2 * s + 2e-4).sum(axis=0)  # noqa: E731
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = lambda e, s: np.nanmax(np.where(s > 0, e / s, np.nan), axis=0)  # noqa: E731
            rel = np.nanmax(np.where(a["emu"] > 0, a["gpu"] / a["emu"], np.nan), axis=0)
            summary.append(
                f"{tag}: {len(rs)} cases; misses (dq dk dv) vs old {miss(a['gpu'], a['old'])}, vs new "
                f"{miss(a['gpu'], a['new'])}; emulation predicts vs old {miss(a['emu'], a['old'])}, vs new "
                f"{miss(a['emu'], a['new'])}; max ratio vs old {np.round(ratio(a['gpu'], a['old']), 2)}, vs new "
                f"{np.round(ratio(a['gpu'], a['new']), 2)}; max gpu/emulated err {np.round(rel, 2)}; "
                f"O==emu {np.nanmean([r['o_emu'] for r in rs]):.1%}, O==round(PV) "
                f"{np.nanmean([r['o_rpv'] for r in rs]):.1%}")
    summary.append(f"{time.time() - t0:.1f} s")
    report = "\n".join(lines + ["", "summary:"] + summary) + "\n"
    out_dir = os.environ.get("OUT")
    if out_dir:
        path = os.path.join(out_dir, "bwd_probe.txt")
        with open(path, "w") as f:
            f.write(report)
        print("\n".join(lines[:2] + ["summary:"] + summary + [f"report: {path}"]))
    else:
        print(report, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
