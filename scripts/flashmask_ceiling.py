"""The most each FlashMask cell of a `bench mask` grid could reach of plain causal attention's
TF/s on the visible pairs (#21 asks 85%), if the FlashMask kernels computed each tile element at
plain causal's own rate: no GPU needed, the grid's JSON only.

    python scripts/flashmask_ceiling.py [benchmarks/mask-h200-2026-11-29.json]

Per cell (family, length, pass): plain causal's time is its fixed part F (what does not scale with
the tiles computed) plus its computed tile elements at some rate; the ceiling gives the family's
computed tile elements (visible pairs / the forward's tile fill, as `bench mask` counts them) that
same rate, adds F and the FlashMask prep kernel, and divides the family's visible pairs per
second by plain causal's. F, measured on an H200 (BENCHMARKS.md, "Where a FlashMask call's time
goes"): about 13 µs of ramp per attention launch (a launch's idle SM time, ncu, 8k), and in the
forward + backward pass the backward's two memory-bound kernels (rowsum(dO ∘ O) with the dQ
accumulator zeroed, and dQ's conversion: 64 µs at 8k, 250 µs at 32k, bf16, d = 128, 16 heads,
batch 1); the backward's own ramp is taken as the forward's (not measured). With F = 0 the ceiling is the
ratio of the two tile fills ("fill bound"); F lowers it where the family computes fewer tiles than
plain causal (a shorter call carries the same F). A cell whose ceiling is under 85% cannot reach
#21's target on the visible pairs with these tiles and fixed costs, however fast the kernels'
walks become.
"""
import json
import sys

RAMP_US = 13.0  # idle SM time of one attention launch (ncu, H200, plain causal 8k forward)
BWD_FIXED_US = {8192: 64.0, 32768: 250.0}  # bwd_prep + bwd_convert, bf16, d = 128, 16 heads, batch 1
PREP_US = {"fwd": 2.0, "fwd+bwd": 4.0}  # the FlashMask prep kernel (once per pass)


def fixed_us(seqlen, pass_):
    """F: the part of a call that does not scale with the tiles computed (µs)."""
    return RAMP_US if pass_ == "fwd" else 2 * RAMP_US + BWD_FIXED_US[seqlen]


def ceilings(rows):
    """{(family, seqlen, pass): (measured share, ceiling, tile-fill bound)} for the FlashMask rows
    of a `bench mask` JSON's rows, each against the plain causal row of its length and pass."""
    by = {(r["family"], r["seqlen"], r["pass"]): r for r in rows}
    out = {}
    for (fam, s, p), r in by.items():
        c = by.get(("causal", s, p))
        if fam == "causal" or c is None or s not in BWD_FIXED_US:
            continue
        t_c = c["cuflash_ms"] * 1e3
        rate = c["pairs"] / c["fwd_tile_fill"] / (t_c - fixed_us(s, p))  # computed elements per µs
        t_m = r["pairs"] / r["fwd_tile_fill"] / rate + fixed_us(s, p) + PREP_US[p]
        share = lambda pairs, t: (pairs / t) / (c["pairs"] / t_c)  # noqa: E731
        out[(fam, s, p)] = (r["frac_causal"], share(r["pairs"], t_m), r["fwd_tile_fill"] / c["fwd_tile_fill"])
    return out


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/mask-h200-2026-11-29.json"
    with open(path) as f:
        cells = ceilings(json.load(f)["rows"])
    print(f"{'family':22s} {'seqlen':>6s} {'pass':8s} {'measured':>8s} {'ceiling':>8s} {'fill bound':>10s}")
    for (fam, s, p), (m, ceil, fill) in sorted(cells.items(), key=lambda x: (x[0][1], x[0][2], x[0][0])):
        print(f"{fam:22s} {s:6d} {p:8s} {m:8.3f} {ceil:8.3f} {fill:10.3f}" + ("  (ceiling under 0.85)" if ceil < .85 else ""))
    under = [k for k, (m, _, _) in cells.items() if m < .85]
    out = [k for k in under if cells[k][1] < .85]
    print(f"{len(under)} of {len(cells)} cells under 0.85 measured; {len(out)} of them with a ceiling under 0.85")


if __name__ == "__main__":
    main()
