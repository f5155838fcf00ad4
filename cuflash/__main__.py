"""python -m cuflash {demo,explain,info,warmup,cache,bench}: a thin shell over the library."""
from __future__ import annotations

import argparse
import sys
import time

from cuflash.kernels import FAMILIES

PRESETS = {
    # name: (nheads, nheads_k, head_dim)
    "qwen2.5-7b": (28, 4, 128),
    "llama3-8b": (32, 8, 128),
    "llama2-7b": (32, 32, 128),
    "mistral-7b": (32, 8, 128),
    "gemma2-9b": (16, 8, 256),
    "llama4-scout": (40, 8, 128),  # its chunked layers: --attention-chunk 8192
}


def _fail(message: str, code: int = 1):
    """Exit with ``message`` as one line on stderr."""
    print(message, file=sys.stderr)
    raise SystemExit(code)


def _gpu_error() -> str | None:
    try:
        import cupy
        return None if cupy.cuda.runtime.getDeviceCount() > 0 else "no CUDA device is visible"
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def cmd_explain(a):
    import cuflash
    h, hk, d = PRESETS[a.preset] if a.preset else (
        a.nheads, a.nheads if a.nheads_k is None else a.nheads_k, a.head_dim)
    sks = [a.seqlen_k] if a.seqlen_k is not None else [a.prompt + n for n in a.new_tokens]
    for sk in sks:
        q, kv = (a.batch, a.seqlen_q, h, d), (a.batch, sk, hk, d)
        p = cuflash.plan(q, kv, kv, causal=not a.no_causal, num_sms=a.num_sms, arch=a.arch,
                         num_splits=a.num_splits, dtype=a.dtype, heuristic=a.heuristic,
                         backward=a.backward, deterministic=a.deterministic, varlen=a.varlen,
                         kv_cache=a.kv_cache, page_size=a.page_size, cache_leftpad=a.cache_leftpad,
                         window_size=tuple(a.window), attention_chunk=a.attention_chunk)
        what = (f"{a.prompt}-token prompt + {sk - a.prompt} new tokens (seqlen_k={sk})" if a.seqlen_k is None
                else f"seqlen_k={sk}")
        print(f"== {a.preset + ': ' if a.preset else ''}{what}")
        print(p)
        print()


def cmd_info(a):
    import cuflash
    from cuflash import compiler
    print(f"cuflash {cuflash.__version__}")
    try:
        print(f"NVRTC {'.'.join(map(str, compiler.nvrtc_version()))}")
    except Exception as e:
        print(f"NVRTC: not available ({e})")
    try:
        import cupy
        print(f"CuPy {cupy.__version__}")
    except Exception as e:
        print(f"CuPy: not available ({e})")
    err = _gpu_error()
    if err:
        print(f"GPU: none ({err})")
    else:
        import cupy
        for i in range(cupy.cuda.runtime.getDeviceCount()):
            props = cupy.cuda.runtime.getDeviceProperties(i)
            d = cupy.cuda.Device(i)
            print(f"GPU {i}: {props['name'].decode()}  sm_{d.compute_capability}  "
                  f"{d.attributes['MultiProcessorCount']} SMs  driver {cupy.cuda.runtime.driverGetVersion()}")
    d = compiler.cache_dir()
    try:
        entries, problem = compiler.cache_entries(d), compiler.cache_dir_problem(d)
        print(f"cache: {d}  ({len(entries)} kernels, {sum(s for _, s in entries) / 1e6:.1f} MB)"
              + (f"; not used: it is {problem}" if problem else ""))
    except OSError as e:
        print(f"cache: {d}  (not readable: {e.strerror or e})")


def _archs_of(a) -> list[int]:
    from cuflash import validate
    if a.arch:
        return list(dict.fromkeys(validate.arch(x) for x in a.arch))
    err = _gpu_error()
    if err:
        _fail(f"cuflash: error: no GPU here ({err}); pass --arch sm_90 (or sm_80) to compile offline")
    import cupy
    return [int(cupy.cuda.Device().compute_capability)]


def _selected(a, arch: int) -> list:
    from cuflash.kernels import FAMILIES, all_variants, head_dim_bucket
    variants = all_variants(arch, families=a.family or FAMILIES)
    dims = set()
    if a.preset:
        dims.add(head_dim_bucket(PRESETS[a.preset][2]))
    if a.head_dim:
        dims.update(head_dim_bucket(d) for d in a.head_dim)
    # append kernels have no head-dim, and some kernels (FlashMask's prep, the plain append) no
    # dtype: they serve every shape and are always kept
    if dims:
        variants = [v for v in variants if getattr(v, "head_dim", None) in dims or v.family == "append"]
    if a.dtype:
        want = {"bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "e4m3"}[a.dtype]
        variants = [v for v in variants if getattr(v, "dtype", None) in (want, None, "")]
    return variants


def _progress(i, n, v):
    bar = "#" * (30 * i // n)
    print(f"\r[{bar:<30}] {i}/{n} {v.name:<60}", end="", flush=True)


def _check(variants) -> list[str]:
    """Compile each variant afresh (NVRTC, no disk cache) and return what ptxas reports wrong:
    spills, a stack frame, more than 255 registers."""
    import os
    from concurrent.futures import ThreadPoolExecutor, as_completed
    from cuflash import compiler
    bad = []
    compiler.compile_variant(variants[0])  # alone first: NVRTC loads its builtins then
    with ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as ex:
        futures = {ex.submit(compiler.compile_variant, v): v for v in variants}
        try:
            for i, f in enumerate(as_completed(futures), 1):
                v, r = futures[f], f.result().resources
                if r.spill_stores or r.spill_loads or r.stack_bytes or not 0 < r.registers <= 255:
                    bad.append(f"{v.name}: {r}")
                _progress(i, len(variants), v)
        except BaseException:
            ex.shutdown(wait=False, cancel_futures=True)
            raise
    return bad


def cmd_warmup(a):
    from cuflash import compiler
    if a.all and (a.preset or a.head_dim or a.dtype or a.family):
        _fail("cuflash: error: --all compiles every variant: leave out --preset, --head-dim, --dtype and --family")
    failed = False
    for arch in _archs_of(a):  # every arch is checked before a failure is reported
        variants = _selected(a, arch)
        t0 = time.perf_counter()
        try:
            if a.check:
                bad = _check(variants)
            else:
                compiled, cached = compiler.warmup(variants, progress=_progress)
        finally:
            print()  # ends the progress line
        took = time.perf_counter() - t0
        if a.check:
            print(f"checked {len(variants)} kernels for sm_{arch} in {took:.1f} s: "
                  + ("no spills, no stack, at most 255 registers" if not bad else f"{len(bad)} with problems"))
            for line in bad:
                print("  " + line)
            failed = failed or bool(bad)
        else:
            print(f"compiled {len(compiled)} kernels" + (f" ({len(cached)} already cached)" if cached else "")
                  + f" for sm_{arch} in {took:.1f} s into {compiler.cache_dir()}")
    if not a.check:
        _warmup_torch_node()
    if failed:
        raise SystemExit(1)


def _warmup_torch_node():
    """Builds cuflash.torch's C++ autograd node where PyTorch is installed (cuflash/torch/node.py)."""
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        return
    t0 = time.perf_counter()
    try:
        from cuflash.torch import node
        why = node.why_not()
    except Exception as e:  # (a PyTorch that cannot be imported here)
        why = f"{type(e).__name__}: {e}"
    print(f"C++ autograd node: {'ready' if why is None else 'not built: ' + why + ' (the Python node is used)'} "
          f"({time.perf_counter() - t0:.1f} s)")


def cmd_cache(a):
    from cuflash import compiler
    d = compiler.cache_dir()
    try:
        if a.action == "list":
            entries = compiler.cache_entries(d)
            for p, size in entries:
                print(f"{size:>9}  {p.name}")
            print(f"{len(entries)} kernels in {d}")
            problem = compiler.cache_dir_problem(d)
            if problem:
                print(f"cuflash does not use this directory: it is {problem}", file=sys.stderr)
            return
        # only what cuflash writes there: entries, their locks and interrupted temp files
        removed, left = compiler.clear_cache(d)
    except OSError as e:
        raise SystemExit(f"cannot read the cache directory {d}: {e.strerror or e}") from None
    print(f"removed {removed} kernels from {d}")
    for line in left:
        print(f"not removed: {line}", file=sys.stderr)
    if left:
        raise SystemExit(1)


def cmd_demo(a):
    import numpy as np
    import cuflash
    from cuflash import compiler
    b, s, h, hk, d = 2, 1024, 16, 4, 128
    print(f"cuflash {cuflash.__version__} demo: attention on (batch={b}, seqlen={s}, heads={h}/{hk}, d={d}), causal")
    err = _gpu_error()
    sms = 132 if err else None
    p = cuflash.plan((b, s, h, d), (b, s, hk, d), (b, s, hk, d), causal=True, num_sms=sms,
                     arch=90 if err else None)
    print(p)
    if err:
        print(f"\nNo GPU here ({err}).")
        print("Showing what works without one: the plan above (for a 132-SM sm_90 GPU) and an")
        print("offline NVRTC compile of its kernel:")
        t0 = time.perf_counter()
        c = compiler.compile_variant(p.launches[0].variant)
        r = c.resources
        print(f"  {p.kernels[0]}: {len(c.cubin)} B cubin in {time.perf_counter() - t0:.2f} s, "
              f"{r.registers} registers, {r.spill_stores} B spills, {p.launches[0].smem} B shared memory")
        dec = cuflash.plan((1, 1, 28, 128), (1, 552, 4, 128), (1, 552, 4, 128), causal=True, num_sms=132)
        print(f"\nQwen2.5-7B decode at seqlen_k=552 would run split-KV + combine: {dec.kernels[0]} with "
              f"{dec.num_splits} splits, the last split of each query block merging them (or "
              f"{dec.kernels[1]} inside a first CUDA graph capture). "
              "`python -m cuflash explain --preset qwen2.5-7b` says why.")
        return
    import ml_dtypes
    rng = np.random.default_rng(0)
    mk = lambda *shape: rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)
    q, k, v = mk(b, s, h, d), mk(b, s, hk, d), mk(b, s, hk, d)
    t0 = time.perf_counter()
    out = cuflash.attention(q, k, v, causal=True)
    print(f"\nfirst call (compile or load from cache, copy in/out): {time.perf_counter() - t0:.2f} s")
    ok, err_, bound = cuflash.reference.check_close(out, q, k, v, causal=True)
    print(f"max |out - float64 reference| = {err_:.2e} (bound {bound:.2e}): {'OK' if ok else 'FAILED'}")
    if not ok:
        raise SystemExit(1)


def cmd_bench(a):
    from cuflash import bench
    try:
        bench._torch()
        if a.kind == "jax":
            bench._jax()  # before anything else starts JAX's GPU backend
    except RuntimeError as e:  # no PyTorch, or no CUDA device for it (or for JAX)
        _fail(f"cuflash: error: {e}")
    grid = {"quick": a.quick}  # --dtype / --head-dim narrow the prefill, backward and jax grids
    if a.dtype:
        grid["dtypes"] = tuple(a.dtype)
    if a.head_dim:
        grid["head_dims"] = tuple(a.head_dim)
    if (a.dtype or a.head_dim) and a.kind not in ("prefill", "backward", "jax"):
        _fail(f"cuflash: error: --dtype and --head-dim apply to bench prefill, backward and jax, not {a.kind}")
    if a.deterministic and a.kind != "backward":
        _fail(f"cuflash: error: --deterministic applies to bench backward, not {a.kind}")
    if a.rounds is not None:
        if a.kind not in ("prefill", "backward", "jax"):
            _fail(f"cuflash: error: --rounds applies to bench prefill, backward and jax, not {a.kind}")
        grid["rounds"] = a.rounds
    if a.settle is not None:
        if a.kind not in ("prefill", "backward"):
            _fail(f"cuflash: error: --settle applies to bench prefill and backward, not {a.kind}")
        grid["settle"] = a.settle
    if a.gqa is not None:
        if a.kind not in ("prefill", "backward"):
            _fail(f"cuflash: error: --gqa applies to bench prefill and backward, not {a.kind}")
        try:
            bench.check_gqa(grid.get("head_dims", bench.GRID_HEAD_DIMS), a.gqa)
        except ValueError as e:
            _fail(f"cuflash: error: --{e}")
        grid["gqa"] = a.gqa
    if a.kind == "prefill":
        rows = bench.bench_prefill(**grid)
    elif a.kind == "window":
        rows = bench.bench_window()
    elif a.kind == "overhead":
        rows = bench.bench_overhead()
    elif a.kind == "backward":
        rows = bench.bench_backward(**grid, deterministic=a.deterministic)
    elif a.kind == "jax":
        rows = bench.bench_jax(**grid)
    elif a.kind == "mask":
        rows = bench.bench_mask(quick=a.quick)
    else:
        rows = bench.bench_decode()
    print(bench.format_table(rows, "prefill" if a.kind == "backward" else a.kind))
    if a.json:
        bench.write_results(rows, a.json)
    if a.csv:
        bench.write_results(rows, a.csv)
    if a.plot:
        bench.plot(rows, "prefill" if a.kind == "backward" else a.kind, a.plot)


def _int_in(lo, hi=None):
    """An argparse type: an int >= lo (and <= hi)."""
    def parse(text):
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
        if n < lo or (hi is not None and n > hi):
            bounds = f">= {lo}" if hi is None else f"between {lo} and {hi}"
            raise argparse.ArgumentTypeError(f"expected an int {bounds}, got {n}")
        return n
    return parse


def _seconds(text):
    """An argparse type: seconds, a finite float from 0 to 60."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (a number), got {text!r}") from None
    if not 0 <= x <= 60:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"expected seconds between 0 and 60, got {text}")
    return x


SIZE, HEAD_DIM = _int_in(0), _int_in(1, 256)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr, without the usage block
        self.exit(2, f"cuflash: error: {message} (see: {self.prog} --help)\n")


def main(argv=None):
    ap = _Parser(prog="python -m cuflash", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    sub.add_parser("demo", help="run attention on random data and check it (or plan+compile with no GPU)")

    e = sub.add_parser("explain", help="print the dispatch plan for a shape or model preset")
    e.add_argument("--preset", choices=sorted(PRESETS))
    e.add_argument("--batch", type=SIZE, default=1)
    e.add_argument("--seqlen-q", type=SIZE, default=1)
    e.add_argument("--seqlen-k", type=SIZE)
    e.add_argument("--prompt", type=SIZE, default=40, help="prompt length (with --new-tokens)")
    e.add_argument("--new-tokens", type=SIZE, nargs="+", default=[64, 512])
    e.add_argument("--nheads", type=SIZE, default=32)
    e.add_argument("--nheads-k", type=SIZE)
    e.add_argument("--head-dim", type=HEAD_DIM, default=128)
    e.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float8_e4m3fn"])
    e.add_argument("--no-causal", action="store_true")
    e.add_argument("--num-splits", type=_int_in(0, 128), default=0)
    e.add_argument("--heuristic", default="cuflash", choices=["cuflash", "fa2"],
                   help="split rule: cuflash's own (default) or FlashAttention-2's")
    e.add_argument("--num-sms", type=_int_in(1), default=132, help="SM count (132: H100/H200 SXM)")
    e.add_argument("--arch", default="sm_90")
    e.add_argument("--backward", action="store_true", help="the backward pass's plan")
    e.add_argument("--deterministic", action="store_true", help="with --backward: dQ without atomics")
    e.add_argument("--varlen", action="store_true",
                   help="packed sequences (attention_varlen) of at most --seqlen-q/--seqlen-k tokens")
    e.add_argument("--kv-cache", choices=["contiguous", "paged"],
                   help="a KV cache (attention_with_kvcache) of seqlen_k rows per sequence")
    e.add_argument("--page-size", type=SIZE, help="with --kv-cache paged: rows per page")
    e.add_argument("--cache-leftpad", action="store_true", help="with --kv-cache contiguous or paged: cache_leftpad")
    e.add_argument("--window", type=_int_in(-1), nargs=2, default=[-1, -1], metavar=("LEFT", "RIGHT"),
                   help="window_size (-1: unbounded)")
    e.add_argument("--attention-chunk", type=SIZE, default=0, help="chunked attention: keys per chunk (0: none)")

    sub.add_parser("info", help="GPU, versions and cache")

    w = sub.add_parser("warmup", help="precompile kernels into the disk cache")
    w.add_argument("--arch", action="append", help="e.g. sm_90 or sm_80 (repeatable); needed when there is no GPU")
    w.add_argument("--all", action="store_true", help="every variant of every family (the default selection)")
    w.add_argument("--check", action="store_true",
                   help="compile afresh (no disk cache) and fail on register spills, stack or > 255 registers")
    w.add_argument("--preset", choices=sorted(PRESETS))
    w.add_argument("--head-dim", type=HEAD_DIM, nargs="+")
    w.add_argument("--dtype", choices=["bfloat16", "float16", "float8_e4m3fn"])
    w.add_argument("--family", action="append", choices=list(FAMILIES),
                   help="only these kernel families (repeatable; default: all)")

    c = sub.add_parser("cache", help="list or clear the kernel cache")
    c.add_argument("action", choices=["list", "clear"])

    b = sub.add_parser("bench", help="benchmark against PyTorch SDPA (flash, cuDNN); jax: cuflash.jax under jax.jit "
                                     "against jax.nn.dot_product_attention (cuDNN, XLA); mask: FlashMask masks "
                                     "against FlexAttention and SDPA with a dense mask")
    b.add_argument("kind", choices=["prefill", "decode", "backward", "window", "overhead", "jax", "mask"])
    b.add_argument("--quick", action="store_true")
    b.add_argument("--dtype", nargs="+", choices=["bfloat16", "float16"])
    b.add_argument("--head-dim", type=HEAD_DIM, nargs="+")
    b.add_argument("--deterministic", action="store_true", help="bench backward: cuflash's deterministic mode")
    b.add_argument("--rounds", type=_int_in(1, 99),
                   help="bench prefill / backward: rounds x reps interleaved samples of each implementation; jax: rounds "
                        "of timing, the order rotated each round (default 3)")
    b.add_argument("--settle", type=_seconds,
                   help="bench prefill / backward: seconds of back-to-back calls before the timed samples, so that they see "
                        "the clock the GPU settles at under load (default 0)")
    b.add_argument("--gqa", type=_int_in(1, 64),
                   help="bench prefill / backward: query heads per KV head (SDPA with enable_gqa; default 1)")
    b.add_argument("--json")
    b.add_argument("--csv")
    b.add_argument("--plot")

    a = ap.parse_args(argv)
    command = {"demo": cmd_demo, "explain": cmd_explain, "info": cmd_info, "warmup": cmd_warmup,
               "cache": cmd_cache, "bench": cmd_bench}[a.cmd]
    try:
        command(a)
    except (ValueError, TypeError, NotImplementedError) as e:  # the library's argument checks: one line, no traceback
        _fail(f"cuflash: error: {' '.join(str(e).split())}")
    except KeyboardInterrupt:
        _fail("cuflash: interrupted", 130)


if __name__ == "__main__":
    main(sys.argv[1:])
