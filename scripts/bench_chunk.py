"""Chunked attention (``attention_chunk``; Llama 4's chunked layers: 40 query heads on 8 KV heads,
d = 128, chunks of 8192 keys) in one process, the implementations' calls interleaved
(cuflash.bench.time_interleaved; needs a GPU and PyTorch):

    python scripts/bench_chunk.py [--chunk 8192] [--seqlens 16384 32768 65536] [--train] [--json F]

Prefill (batch 1, causal): cuflash.attention with attention_chunk; the same call without a chunk
(plain causal over every key, for scale); cuflash.attention_varlen with each chunk as a sequence
(the same attention when queries and keys align: the plain kernel over short sequences, the
floor a chunk mask can reach); FlexAttention (torch.compile'd flex_attention with the chunk's
BlockMask); SDPA with the dense boolean mask (its fused backends). Training (``--train``,
forward + backward, batch 1, causal): cuflash.torch.attention with attention_chunk (its pieces as
packed sequences), cuflash.torch.attention_varlen with each chunk as a sequence, the call without a
chunk, FlexAttention. Decode (batch 8, one query over a cache of every seqlen): with and without
the chunk. TF/s count the visible (query, key) pairs: 4 * pairs * d per head (forward + backward:
3.5 times that)."""
import argparse
import json
import sys
import time

import torch

from cuflash import bench


def chunk_pairs(s, c):
    """Visible pairs of causal chunked attention over s queries and s keys."""
    full, rest = divmod(s, c)
    return full * c * (c + 1) // 2 + rest * (rest + 1) // 2


def timed(calls, reps, what):
    """(ms per call, errors) of time_interleaved over ``calls``, after each one's first call
    (compiles) run one by one and timed for the log; a call that raises is left out."""
    errors = {}
    for name, (fn, ins) in calls.items():
        t1 = time.perf_counter()
        try:
            fn(*ins[0])
            torch.cuda.synchronize()
        except Exception as e:
            errors[name] = e
        print(f"  {what}{name}: first call {time.perf_counter() - t1:.1f} s", file=sys.stderr, flush=True)
    calls = {n: c_ for n, c_ in calls.items() if n not in errors}
    return bench.time_interleaved(calls, warmup=3, reps=reps, errors=errors), errors


def prefill_rows(seqlens, c, h, hk, d, reps, sdpa_max):
    import cuflash
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    for s in seqlens:
        mk = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
        sets = [(mk(1, s, h, d), mk(1, s, hk, d), mk(1, s, hk, d)) for _ in range(2)]
        cu = torch.arange(0, s + c, c, dtype=torch.int32, device="cuda").clamp(max=s).unique()
        chunk_mod = lambda b, hh, qi, kv: (kv <= qi) & (qi // c == kv // c)
        t0 = time.perf_counter()
        block = torch.compile(create_block_mask)(chunk_mod, 1, 1, s, s, device="cuda")
        print(f"seqlen {s}: block mask in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        dense = None
        if s <= sdpa_max:
            i = torch.arange(s, device="cuda")
            dense = (i[None, :] <= i[:, None]) & (i[:, None] // c == i[None, :] // c)
        t = lambda x: x.transpose(1, 2)
        calls = {
            "cuflash chunk": (lambda q, k, v: cuflash.attention(q, k, v, causal=True, attention_chunk=c), sets),
            "cuflash causal (no chunk)": (lambda q, k, v: cuflash.attention(q, k, v, causal=True), sets),
            "cuflash varlen (chunks as sequences)": (lambda q, k, v: cuflash.attention_varlen(
                q[0], k[0], v[0], cu, cu, c, c, causal=True), sets),
            "flex": (lambda q, k, v: flex(t(q), t(k), t(v), block_mask=block, enable_gqa=True), sets),
        }
        if dense is not None:  # K/V heads expanded up front (the fused backends take no GQA), no math fallback
            from torch.nn.attention import SDPBackend, sdpa_kernel
            g = h // hk
            wide = [(q, k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)) for q, k, v in sets]

            def sdpa(q, k, v):
                with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
                    return torch.nn.functional.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=dense)
            calls["sdpa dense mask"] = (sdpa, wide)
        t0 = time.perf_counter()
        ms, errors = timed(calls, reps, "")
        print(f"  timed in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        q, k, v = sets[0]
        ref = cuflash.attention(q, k, v, causal=True, attention_chunk=c).float()
        diff = (flex(t(q), t(k), t(v), block_mask=block, enable_gqa=True).transpose(1, 2).float() - ref).abs().max()
        pairs = chunk_pairs(s, c)
        row = dict(kind="prefill", seqlen=s, chunk=c, nheads=h, nheads_k=hk, d=d, pairs=pairs,
                   kernels=list(cuflash.plan(q, k, v, causal=True, attention_chunk=c).kernels),
                   max_diff_vs_flex=float(diff), errors={n: str(e).splitlines()[0] for n, e in errors.items()},
                   ms=ms, tflops={n: (4 * pairs * d * h / m / 1e9 if m else None) for n, m in ms.items()})
        rows.append(row)
        print(json.dumps(row), flush=True)
        del sets, block, dense, calls
        wide = None
        torch.cuda.empty_cache()
    return rows


def train_rows(seqlens, c, h, hk, d, reps):
    """Forward + backward (cuflash.torch; FlexAttention compiled with its backward)."""
    import cuflash.torch as ct
    from cuflash.bench import BACKWARD_FLOPS
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    for s in seqlens:
        mk = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        sets = [(mk(1, s, h, d), mk(1, s, hk, d), mk(1, s, hk, d), torch.randn(1, s, h, d, device="cuda",
                 dtype=torch.bfloat16)) for _ in range(2)]
        cu = torch.arange(0, s + c, c, dtype=torch.int32, device="cuda").clamp(max=s).unique()
        chunk_mod = lambda b, hh, qi, kv: (kv <= qi) & (qi // c == kv // c)
        block = torch.compile(create_block_mask)(chunk_mod, 1, 1, s, s, device="cuda")
        t = lambda x: x.transpose(1, 2)

        def step(fwd):
            def run(q, k, v, do):
                torch.autograd.grad(fwd(q, k, v), (q, k, v), do)
            return run
        calls = {
            "cuflash chunk": (step(lambda q, k, v: ct.attention(q, k, v, causal=True, attention_chunk=c)), sets),
            "cuflash causal (no chunk)": (step(lambda q, k, v: ct.attention(q, k, v, causal=True)), sets),
            "cuflash varlen (chunks as sequences)": (step(lambda q, k, v: ct.attention_varlen(
                q[0], k[0], v[0], cu, cu, c, c, causal=True)[None]), sets),
            "flex": (step(lambda q, k, v: flex(t(q), t(k), t(v), block_mask=block, enable_gqa=True).transpose(1, 2)),
                     sets),
        }
        ms, errors = timed(calls, reps, f"train {s} ")
        q, k, v, do = sets[0]
        g = torch.autograd.grad(ct.attention(q, k, v, causal=True, attention_chunk=c), (q, k, v), do)
        gf = torch.autograd.grad(flex(t(q), t(k), t(v), block_mask=block, enable_gqa=True).transpose(1, 2),
                                 (q, k, v), do)
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(g, gf))
        pairs = chunk_pairs(s, c)
        row = dict(kind="train", seqlen=s, chunk=c, nheads=h, nheads_k=hk, d=d, pairs=pairs, ms=ms,
                   max_grad_diff_vs_flex=diff, errors={n: str(e).splitlines()[0] for n, e in errors.items()},
                   tflops={n: ((1 + BACKWARD_FLOPS) * 4 * pairs * d * h / m / 1e9 if m else None)
                           for n, m in ms.items()})
        rows.append(row)
        print(json.dumps(row), flush=True)
        del sets, block, calls
        torch.cuda.empty_cache()
    return rows


def decode_rows(seqlens, c, h, hk, d, reps, batch=8):
    import cuflash
    rows = []
    for s in seqlens:
        mk = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
        sets = [(mk(batch, 1, h, d), mk(batch, s, hk, d), mk(batch, s, hk, d)) for _ in range(2)]
        calls = {"cuflash chunk": (lambda q, k, v: cuflash.attention(q, k, v, causal=True, attention_chunk=c), sets),
                 "cuflash (no chunk)": (lambda q, k, v: cuflash.attention(q, k, v, causal=True), sets)}
        ms = bench.time_interleaved(calls, warmup=3, reps=reps)
        q, k, v = sets[0]
        row = dict(kind="decode", batch=batch, seqlen=s, chunk=c, nheads=h, nheads_k=hk, d=d, ms=ms,
                   us={n: m * 1e3 for n, m in ms.items()},
                   kernels=list(cuflash.plan(q, k, v, causal=True, attention_chunk=c).kernels))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[16384, 32768, 65536])
    ap.add_argument("--sdpa-max", type=int, default=16384, help="longest seqlen given to SDPA's dense mask")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--train", action="store_true", help="forward + backward only (no prefill or decode rows)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.train:
        rows = train_rows(a.seqlens, a.chunk, 40, 8, 128, a.reps)
    else:
        rows = (prefill_rows(a.seqlens, a.chunk, 40, 8, 128, a.reps, a.sdpa_max)
                + decode_rows(a.seqlens, a.chunk, 40, 8, 128, a.reps))
    print(f"\n{'kind':8s} {'seqlen':>7s}  " + "  ".join(f"{n}" for n in rows[0]["ms"]))
    for r in rows:
        vals = r["us"] if r["kind"] == "decode" else r["tflops"]
        unit = "us" if r["kind"] == "decode" else "TF/s"
        print(f"{r['kind']:8s} {r['seqlen']:7d}  " + "  ".join(
            f"{n}: {'-' if x is None else f'{x:.1f}'} {unit}" for n, x in vals.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(env=bench.env_info(), rows=rows), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
