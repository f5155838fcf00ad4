"""One training step of a causal transformer with context parallelism (PyTorch's
``context_parallel``, ring attention on cuflash's kernels) on 2 GPUs, against the same step on
1 GPU, at sequence lengths 32k to 256k (head dim 128); a length that runs out of GPU memory is
recorded as "does not fit".

    python scripts/bench_context_parallel.py                  # table on stdout, JSON to --out
    python scripts/bench_context_parallel.py --lengths 32k,64k --layers 4

The model is examples/context_parallel.py's (d_model 1024, 8 heads of 128, bf16 autocast, float32
weights), 16 layers by default, batch 1. A step is forward and backward (plus, on 2 GPUs, the
all-reduce of the parameter gradients), timed after a warm-up step (which compiles or loads
cuflash's kernels). Both sides run attention on cuflash (activate_sdpa), so the ratio is what
context parallelism buys.

Each (length, GPU count) runs in a process of its own (torchrun for 2 GPUs): a rank that runs out
of memory inside the ring leaves the other waiting in an NCCL collective, and only ending the
job frees it. The ranks write their results to files; the driver collects them, and a length that
does not fit is not tried longer on that GPU count.

Time: causal attention forward and backward cost about 7 * S^2 * heads * head_dim FLOPs per
layer (2 S^2 h d forward, 2.5x that backward), 7.9e15 for 16 layers at S = 256k, about 20 s at
400 TFLOP/s on one H200 (the rest of the model adds under 5% at these lengths); 2 GPUs take
about half. Memory: about 42 * d_model bytes of activations per token and layer (float32
residual stream, bf16 projections, the 4x MLP), 172 GB for 16 layers at 256k on one GPU (does
not fit in an H200's 141 GB; it runs out after a few seconds), 86 GB at 128k; half of that per
GPU on 2. With 1 warm-up and 2 timed steps the runs that fit take about 80 s of GPU time, plus
10-30 s per process to start (8 processes). --budget-s (default 540) stops starting new runs
past that time and records the rest as "not run (time budget)", so one 10-minute call always
finishes and leaves its JSON.
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "context_parallel.py")


def parse_length(text):
    """'32k' -> 32768, '262144' -> 262144."""
    t = text.strip().lower()
    n = int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    if n < 1:
        raise ValueError(f"sequence length {text!r} must be positive")
    return n


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="32k,64k,128k,256k",
                   type=lambda s: [parse_length(x) for x in s.split(",")])
    p.add_argument("--gpus", default="1,2", type=lambda s: [int(x) for x in s.split(",")],
                   help="GPU counts to run each length on")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2, help="timed steps")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="start no run past this many seconds; each run is also cut at the time left")
    p.add_argument("--run-timeout-s", type=float, default=300.0)
    p.add_argument("--out", default="bench_context_parallel.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seqlen", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def model_argv(args, seqlen):
    """The example's arguments for this model at this length."""
    return ["--seqlen", str(seqlen), "--layers", str(args.layers), "--d-model", str(args.d_model),
            "--heads", str(args.heads), "--vocab", str(args.vocab), "--batch", str(args.batch)]


# ---------------------------------------------------------------------------------------------
# Worker: one length on 1 GPU (plain process) or on 2 (under torchrun)

def _example():
    import importlib.util
    spec = importlib.util.spec_from_file_location("cp_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def is_oom(exc):
    """PyTorch's allocator raises OutOfMemoryError; NCCL and cuBLAS failing to allocate say
    "out of memory" in a RuntimeError."""
    import torch
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def worker(args):
    ex = _example()  # sets NCCL_NVLS_ENABLE=0 before any process group
    import torch
    import cuflash.torch
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    res = dict(seqlen=args.seqlen, gpus=world, rank=rank)
    mesh = None
    try:
        if world > 1:
            mesh, rank, _ = ex.init_distributed()
            ex.check_seqlen(args.seqlen, world)
        else:
            torch.cuda.set_device(0)
        margs = ex.parse_args(model_argv(args, args.seqlen))
        dev = torch.device("cuda", torch.cuda.current_device())
        model = ex.build_model(margs, dev)
        cuflash.torch.activate_sdpa()
        times = []
        for _ in range(args.warmup + args.steps):
            tokens, labels = ex.make_batch(margs, dev)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if mesh is not None:
                ex.cp_step(model, tokens, labels, mesh)
            else:
                ex.single_step(model, tokens, labels)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
        res.update(status="ok", warmup_s=times[:args.warmup], step_s=times[args.warmup:],
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                   device=torch.cuda.get_device_name(), total_gib=torch.cuda.mem_get_info()[1] / 2**30)
    except (Exception, SystemExit) as e:  # noqa: BLE001 (recorded, then the process ends)
        res.update(status="does not fit" if is_oom(e) else "error",
                   error=f"{type(e).__name__}: {str(e)[:800]}")
    with open(f"{args.result}.rank{rank}", "w") as f:
        json.dump(res, f)
    if res["status"] != "ok" and world > 1:
        # The other rank may be waiting in a collective this one will never join: end now and
        # let torchrun end the job.
        sys.stdout.flush()
        os._exit(3)
    if world > 1:
        import torch.distributed as dist
        dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------------
# Driver

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(args, seqlen, gpus, timeout, tmp):
    """Run one (length, GPU count) in its own process (group); the merged result."""
    result = os.path.join(tmp, f"s{seqlen}_g{gpus}")
    worker_argv = [os.path.abspath(__file__), "--worker", "--seqlen", str(seqlen), "--result", result,
                   "--warmup", str(args.warmup), "--steps", str(args.steps)] + model_argv(args, seqlen)[2:]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               NCCL_NVLS_ENABLE="0")
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # less fragmentation near the limit
    if gpus == 1:
        cmd = [sys.executable] + worker_argv
        env["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus),
               "--master-port", str(_free_port())] + worker_argv
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers
        log, _ = proc.communicate()
        timed_out = True
    ranks = []
    for r in range(gpus):
        try:
            with open(f"{result}.rank{r}") as f:
                ranks.append(json.load(f))
        except (OSError, ValueError):
            pass
    return merge(seqlen, gpus, ranks, proc.returncode, timed_out, log, time.time() - t0)


def merge(seqlen, gpus, ranks, returncode, timed_out, log, wall_s):
    """One row from the ranks' result files: "ok" only when every rank finished; "does not fit"
    when any rank ran out of memory; otherwise "timed out" or "error" with the log's tail."""
    row = dict(seqlen=seqlen, gpus=gpus, wall_s=round(wall_s, 1))
    statuses = [r["status"] for r in ranks]
    if "does not fit" in statuses:
        row.update(status="does not fit", error=next(r["error"] for r in ranks if r["status"] == "does not fit"))
    elif len(ranks) == gpus and all(s == "ok" for s in statuses) and returncode == 0:
        r0 = min(ranks, key=lambda r: r["rank"])
        steps = sorted(r0["step_s"])
        row.update(status="ok", step_s=r0["step_s"], warmup_s=r0["warmup_s"],
                   median_s=steps[len(steps) // 2], peak_gib=[round(r["peak_gib"], 2) for r in ranks],
                   device=r0["device"], total_gib=round(r0["total_gib"], 1))
    else:
        errors = [r["error"] for r in ranks if r.get("error")]
        row.update(status="timed out" if timed_out else "error",
                   error=errors[0] if errors else f"exit code {returncode}: {log[-1500:]}")
    return row


def run_all(args, runner, clock=time.time):
    """Rows for every (length, GPU count), lengths ascending. A GPU count that did not fit at
    one length is not run at longer ones; no run starts past the budget, and each run gets at
    most the time left."""
    start, rows, failed = clock(), [], set()
    for seqlen in sorted(args.lengths):
        for gpus in args.gpus:
            left = args.budget_s - (clock() - start)
            if gpus in failed:
                rows.append(dict(seqlen=seqlen, gpus=gpus, status="does not fit",
                                 error="a shorter length did not fit"))
            elif left < 30:
                rows.append(dict(seqlen=seqlen, gpus=gpus, status="not run (time budget)"))
            else:
                rows.append(runner(seqlen, gpus, min(args.run_timeout_s, left)))
                if rows[-1]["status"] == "does not fit":
                    failed.add(gpus)
            yield rows


def longest_fit(rows):
    """{gpus: the longest length that ran} (None where none did)."""
    out = {}
    for r in rows:
        out.setdefault(r["gpus"], None)
        if r["status"] == "ok":
            out[r["gpus"]] = max(out[r["gpus"]] or 0, r["seqlen"])
    return out


def table(rows):
    """Text table: per length, each GPU count's median step time and peak memory, and the
    1-GPU / 2-GPU time ratio where both ran."""
    gpus = sorted({r["gpus"] for r in rows})
    head = f"{'seqlen':>8s}" + "".join(f" | {g} GPU{'s' if g > 1 else ''}: step s, peak GiB/GPU" for g in gpus)
    lines = [head + " | speed-up", "-" * (len(head) + 11)]
    for seqlen in sorted({r["seqlen"] for r in rows}):
        cells, times = [], {}
        for g in gpus:
            r = next((r for r in rows if r["seqlen"] == seqlen and r["gpus"] == g), None)
            if r is None:
                cells.append("-")
            elif r["status"] == "ok":
                times[g] = r["median_s"]
                cells.append(f"{r['median_s']:8.3f} s, {max(r['peak_gib']):6.1f}")
            else:
                cells.append(r["status"])
        width = [len(f" {g} GPU{'s' if g > 1 else ''}: step s, peak GiB/GPU") for g in gpus]
        row = f"{seqlen // 1024:>7d}k" + "".join(f" | {c:>{w - 1}s}" for c, w in zip(cells, width))
        ratio = (f"{times[min(gpus)] / times[max(gpus)]:.2f}x" if len(times) == len(gpus) and len(gpus) > 1
                 else "-")
        lines.append(row + f" | {ratio}")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    for n in args.lengths:  # PyTorch's load balancing cuts a sequence into 2 * GPUs chunks
        if any(n % (16 * g) for g in args.gpus):
            raise SystemExit(f"length {n} is not a multiple of 16 x {max(args.gpus)} GPUs")
    import tempfile
    config = {k: getattr(args, k) for k in ("lengths", "gpus", "layers", "d_model", "heads", "vocab",
                                            "batch", "warmup", "steps")}
    config["head_dim"] = args.d_model // args.heads
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for rows in run_all(args, lambda s, g, t: run_one(args, s, g, t, tmp)):
            r = rows[-1]
            print(f"{r['seqlen'] // 1024}k on {r['gpus']} GPU(s): {r['status']}"
                  + (f", median step {r['median_s']:.3f} s, peak {max(r['peak_gib']):.1f} GiB"
                     if r["status"] == "ok" else f" ({r['error'][:300]})" if r.get("error") else ""),
                  flush=True)
            with open(args.out, "w") as f:  # after every run: a cut-off call keeps what ran
                json.dump(dict(config=config, results=rows, longest_fit=longest_fit(rows)), f, indent=1)
    print()
    print(table(rows))
    fits = longest_fit(rows)
    print("longest length that fits: " + ", ".join(
        f"{g} GPU{'s' if g > 1 else ''}: {f'{n // 1024}k' if n else 'none'}" for g, n in sorted(fits.items())))
    print(f"JSON: {args.out}")
    return 0 if any(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
