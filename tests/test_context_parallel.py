"""Context parallelism (PyTorch's ring attention) on cuflash's SDPA backend.

CPU: PyTorch's own context-parallel dispatch (DTensor's handler for the flash op, its ring
forward and backward, the load-balanced and plain shardings) run over 2 gloo processes, with
cuflash's overrides of the flash ops registered for the CPU key and cuflash's kernels replaced by
float64 references (the backward one taking the LSE and output it is given, as the kernel does):
every per-block call reaches cuflash with the shapes and ``is_causal`` the ring sends, and the
merged output, LSE and gradients equal full attention. Plus the example's pure-Python parts.

GPU (2 CUDA GPUs and NCCL): the example's ``--check`` under torchrun.
"""
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="needs PyTorch (optional dependency)")

from conftest import requires_torch  # noqa: E402

pytestmark = [requires_torch]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "context_parallel.py")


def _example():
    spec = importlib.util.spec_from_file_location("cp_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------------------------------
# CPU: PyTorch's ring attention through cuflash's overrides (2 gloo processes)

def _cp_module():
    """PyTorch's context-parallel module (moved into a package after 2.8), or None."""
    for name in ("torch.distributed.tensor.experimental._context_parallel._attention",
                 "torch.distributed.tensor.experimental._attention"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "_enable_context_parallel_dispatcher"):
            return mod
    return None


def _scores(q, k, causal, scale):
    """(b, h, sq, sk) float64 scores and the mask (bottom-right causal, the flash op's)."""
    import torch
    s = q @ k.transpose(-1, -2) * scale
    sq, sk = s.shape[-2:]
    keep = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq) if causal else None
    return s, keep


def _ref_forward(calls):
    """A stand-in for cuflash's forward (ops._forward_kernel): float64, (b, s, h, d) views."""
    def kernel(q, k, v, out, causal, scale, *rest):
        calls.append(["fwd", list(q.shape), list(k.shape), bool(causal)])
        qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
        s, keep = _scores(qd, kd, causal, scale)
        if keep is not None:
            s = s.masked_fill(~keep, float("-inf"))
        lse = s.logsumexp(-1)
        out.copy_(((s - lse[..., None]).exp() @ vd).transpose(1, 2))
        return out, lse.float()
    return kernel


def _ref_backward(calls):
    """A stand-in for cuflash's backward (ops._backward_kernel): the flash backward in float64,
    from the LSE and output it is given (a ring block's are the merged, global ones)."""
    import torch

    def kernel(dout, q, k, v, out, lse, dq, dk, dv, causal, scale, *rest):
        calls.append(["bwd", list(q.shape), list(k.shape), bool(causal)])
        assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
        qd, kd, vd, dod, od = (x.double().transpose(1, 2) for x in (q, k, v, dout, out))
        s, keep = _scores(qd, kd, causal, scale)
        p = (s - lse.double()[..., None]).exp()
        if keep is not None:
            p = p.masked_fill(~keep, 0.0)
        ds = p * (dod @ vd.transpose(-1, -2) - (dod * od).sum(-1, keepdim=True))
        for buf, g in ((dq, ds @ kd * scale), (dk, ds.transpose(-1, -2) @ qd * scale),
                       (dv, p.transpose(-1, -2) @ dod)):
            buf.copy_(g.transpose(1, 2))
        return dq, dk, dv
    return kernel


def _head_tail(seqlen, world, rank):
    """Positions rank ``rank`` holds under load balancing: chunks rank and 2*world-1-rank of
    2*world (PyTorch's head-tail rule, which its ring's causal blocks assume)."""
    c = seqlen // (2 * world)
    return list(range(rank * c, (rank + 1) * c)) + list(range((2 * world - 1 - rank) * c, (2 * world - rank) * c))


def _leave(dist):
    """Both ranks meet before the group goes: a rank that closed its connections while the other
    still sent on them would end that one in gloo's "Connection closed by peer" (an abort)."""
    dist.barrier()
    dist.destroy_process_group()


def _ring_worker(rank, world, init, out_dir, load_balance):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    import cuflash.torch.sdpa as sdpa

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    cp = _cp_module()
    calls = []
    sdpa._device_problem = lambda *xs: None  # CPU tensors stand in for CUDA ones
    sdpa.ops._forward_kernel = _ref_forward(calls)
    sdpa.ops._backward_kernel = _ref_backward(calls)
    lib = torch.library.Library("aten", "IMPL", "CPU")  # these ops have no CPU kernel of their own
    lib.impl("_scaled_dot_product_flash_attention", sdpa._forward_impl, "CPU", with_keyset=True)
    lib.impl("_scaled_dot_product_flash_attention_backward", sdpa._backward_impl, "CPU", with_keyset=True)
    mesh = init_device_mesh("cpu", (world,))

    b, h, s, d, scale = 2, 3, 32, 16, 0.3
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(b, s, h, d, generator=g).bfloat16().transpose(1, 2) for _ in range(4))
    # The reference: full causal attention in float64.
    qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
    sc, keep = _scores(qr, kr, True, scale)
    sc = sc.masked_fill(~keep, float("-inf"))
    ref_lse = sc.logsumexp(-1)
    ref = sc.softmax(-1) @ vr
    ref.backward(dout.double())

    idx = (torch.tensor(_head_tail(s, world, rank)) if load_balance else
           torch.arange(rank * s // world, (rank + 1) * s // world))
    local = [x[:, :, idx].detach().requires_grad_() for x in (q, k, v)]  # keeps SDPA's layout
    cp._cp_options.enable_load_balance = load_balance
    cp._enable_context_parallel_dispatcher()
    try:
        qd, kd, vd = (DTensor.from_local(x, mesh, [Shard(2)], run_check=False) for x in local)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qd, kd, vd, 0.0, True, scale=scale)[:2]
        out.backward(DTensor.from_local(dout[:, :, idx].contiguous(), mesh, [Shard(2)], run_check=False))
        out, lse = out.to_local(), lse.to_local()
    finally:
        cp._disable_context_parallel_dispatcher()
        lib._destroy()
    err = lambda a, r: (a.double() - r.detach()[:, :, idx]).abs().max().item()  # noqa: E731
    res = dict(calls=calls, out=err(out, ref), lse=err(lse, ref_lse),
               grads=[err(x.grad, r.grad) for x, r in zip(local, (qr, kr, vr))],
               lse_shape=list(lse.shape), lse_dtype=str(lse.dtype))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    _leave(dist)


@pytest.mark.parametrize("load_balance", [True, False])
def test_ring_attention_runs_cuflash(tmp_path, load_balance):
    import torch.multiprocessing as mp
    if _cp_module() is None:
        pytest.skip("this PyTorch has no context-parallel dispatcher (torch.distributed.tensor."
                    "experimental._context_parallel)")
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this PyTorch has no gloo backend")
    mp.spawn(_ring_worker, args=(2, f"file://{tmp_path / 'store'}", str(tmp_path), load_balance),
             nprocs=2, join=True)
    r = [json.load(open(tmp_path / f"rank{i}.json")) for i in range(2)]
    s, n = 32, 16  # whole sequence, rows per rank
    if load_balance:  # diagonal block causal; then rank 0: its later half of queries, rank 1: the other's earlier keys
        blocks = [[(n, n, True), (n // 2, n, False)], [(n, n, True), (n, n // 2, False)]]
    else:  # rank 0 skips the later keys; rank 1 sees rank 0's keys whole
        blocks = [[(n, n, True)], [(n, n, True), (n, n, False)]]
    for rank, got in enumerate(r):
        want = [[phase, [2, sq, 3, 16], [2, sk, 3, 16], causal]
                for phase in ("fwd", "bwd") for sq, sk, causal in blocks[rank]]
        assert got["calls"] == want, (rank, got["calls"])
        assert got["lse_shape"] == [2, 3, n] and got["lse_dtype"] == "torch.float32"
        assert got["out"] < 2e-2 and got["lse"] < 1e-4, got  # the output is bf16, the LSE float32
        assert max(got["grads"]) < 3e-2, got
    assert s == 2 * n


def _flash_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
    """SDPA as it runs on a GPU for bf16 operands without a mask: the flash op, with the scale
    computed from the head dim (CPU SDPA would call its own CPU flash op instead)."""
    import torch
    assert attn_mask is None and not enable_gqa
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                              scale=scale)[0]


# context_parallel replaces the attribute of torch.nn.functional named by the function's __name__.
_flash_sdpa.__name__ = "scaled_dot_product_attention"


def _example_worker(rank, world, init, out_dir):
    """The example's cp_step (context_parallel with its buffers, load balancing, the ring, the
    gradient average) on CPU tensors, with bf16 autocast, against its single_step on the whole
    sequence; SDPA calls the flash op, whose cuflash override runs float64 reference kernels."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    import cuflash.torch.sdpa as sdpa

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    calls = []
    sdpa._device_problem = lambda *xs: None
    sdpa.ops._forward_kernel = _ref_forward(calls)
    sdpa.ops._backward_kernel = _ref_backward(calls)
    lib = torch.library.Library("aten", "IMPL", "CPU")
    lib.impl("_scaled_dot_product_flash_attention", sdpa._forward_impl, "CPU", with_keyset=True)
    lib.impl("_scaled_dot_product_flash_attention_backward", sdpa._backward_impl, "CPU", with_keyset=True)
    F.scaled_dot_product_attention = _flash_sdpa
    mesh = init_device_mesh("cpu", (world,))
    ex = _example()
    args = ex.parse_args(["--seqlen", "64", "--layers", "2", "--d-model", "64", "--heads", "2",
                          "--vocab", "50"])
    model = ex.build_model(args, "cpu")
    tokens, labels = ex.make_batch(args, "cpu")
    loss_one = ex.single_step(model, tokens, labels).item()
    one = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    n_single = len(calls)
    loss_cp = ex.cp_step(model, tokens, labels, mesh).item()
    lib._destroy()
    rel = {n: ((p.grad - one[n]).abs().max() / one[n].abs().max()).item() for n, p in model.named_parameters()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(dict(single=calls[:n_single], cp=calls[n_single:], loss_one=loss_one, loss_cp=loss_cp,
                       rel=rel, cos_restored=list(model.cos.shape)), f)
    _leave(dist)


def test_example_cp_step_on_cpu(tmp_path):
    """2 gloo processes: the example's context-parallel step equals its one-process step (loss
    and every gradient, to bf16 autocast's rounding), every attention call having gone through
    cuflash's override as ring blocks of the load-balanced halves."""
    import torch.multiprocessing as mp
    if _cp_module() is None:
        pytest.skip("this PyTorch has no context-parallel dispatcher")
    mp.spawn(_example_worker, args=(2, f"file://{tmp_path / 'store'}", str(tmp_path)), nprocs=2, join=True)
    r = [json.load(open(tmp_path / f"rank{i}.json")) for i in range(2)]
    for rank, got in enumerate(r):
        assert got["single"] == [["fwd", [1, 64, 2, 32], [1, 64, 2, 32], True]] * 2 + \
            [["bwd", [1, 64, 2, 32], [1, 64, 2, 32], True]] * 2
        other = [[1, 16, 2, 32], [1, 32, 2, 32]] if rank == 0 else [[1, 32, 2, 32], [1, 16, 2, 32]]
        blocks = [[[1, 32, 2, 32], [1, 32, 2, 32], True], other + [False]]
        assert got["cp"] == [["fwd"] + b for b in blocks] * 2 + [["bwd"] + b for b in blocks] * 2, got["cp"]
        assert abs(got["loss_cp"] - got["loss_one"]) < 2e-3, got
        assert max(got["rel"].values()) < 2e-2, got["rel"]
        assert got["cos_restored"] == [64, 32]  # context_parallel put the rotary tables back
    assert r[0]["loss_cp"] == r[1]["loss_cp"] and r[0]["rel"] == r[1]["rel"]


# ---------------------------------------------------------------------------------------------
# CPU: the example's pure-Python parts

def test_example_arguments():
    ex = _example()
    a = ex.parse_args([])
    assert (a.seqlen, a.d_model, a.heads, a.check) == (16384, 1024, 8, False)
    assert a.d_model // a.heads == 128
    c = ex.parse_args(["--check"])
    assert c.check and c.seqlen == 8192
    assert ex.parse_args(["--check", "--seqlen", "4096"]).seqlen == 4096
    for bad in (["--heads", "7"], ["--d-model", "4096", "--heads", "8"], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            ex.parse_args(bad)
    ex.check_seqlen(8192, 2)
    with pytest.raises(SystemExit, match="multiple of 32"):
        ex.check_seqlen(8200, 2)
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"  # set on import, before any process group


def test_example_model_on_cpu():
    """The model's step on the CPU (math SDPA): a finite loss near log(vocab) at initialisation,
    gradients on every parameter, and rotary embeddings that make scores depend on relative
    positions only (what lets context parallelism shard the rotary tables with the tokens)."""
    import math
    import torch
    ex = _example()
    a = ex.parse_args(["--seqlen", "64", "--layers", "2", "--d-model", "64", "--heads", "4", "--vocab", "100"])
    model = ex.build_model(a, "cpu")
    tokens, labels = ex.make_batch(a, "cpu")
    assert tokens.shape == labels.shape == (1, 64) and torch.equal(tokens[:, 1:], labels[:, :-1])
    # context_parallel reshards buffers in place: tokens and labels must not share storage.
    assert tokens.untyped_storage().data_ptr() != labels.untyped_storage().data_ptr()
    loss = model(tokens, labels)
    loss.backward()
    assert abs(loss.item() - math.log(100)) < 0.5
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    with pytest.raises(ValueError, match="rotary tables"):
        model(tokens[:, :32], labels[:, :32])
    cos, sin = ex.rope_tables(64, 16)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 1, 1, 16, generator=g, dtype=torch.float64).expand(1, 64, 1, 16) for _ in range(2))
    qr, kr = (ex.apply_rope(x.float(), cos, sin).double() for x in (q, k))
    dots = (qr[0, :, 0] @ kr[0, :, 0].T)
    assert torch.allclose(dots[10, 3], dots[40, 33], atol=1e-5) and torch.allclose(dots[5, 5], dots[60, 60], atol=1e-5)


def test_example_comparison_rule():
    import functools
    import torch
    ex = _example()
    t = functools.partial(torch.tensor, dtype=torch.float64)
    ref = {"w": t([1.0, 2.0]), "loss": t(3.0)}
    base = ex.max_errors({"w": t([1.01, 2.0]), "loss": t(3.001)}, ref)
    assert base["w"] == pytest.approx(0.01) and base["loss"] == pytest.approx(0.001)
    good = ex.max_errors({"w": t([1.0, 2.02]), "loss": t(3.0)}, ref)
    bad = ex.max_errors({"w": t([1.03, 2.0]), "loss": t(3.0)}, ref)
    assert ex.rule_failures(good, base) == [] and ex.rule_failures(bad, base) == ["w"]
    assert ex.rule_failures({"x": 1e-4}, {"x": 0.0}) == [] and ex.rule_failures({"x": 3e-4}, {"x": 0.0}) == ["x"]
    assert ex.rule_failures({"x": float("nan")}, {"x": 1.0}) == ["x"]


def test_example_kernel_classification():
    ex = _example()
    names = {"fwd_ws_d128_bf16_causal_m128n128s2_overlap_pingpong_sm90", "bwd_dkdv_ws_d128_bf16",
             "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4> >(...)",
             "cudnn_generated_fort_native_sdpa_sm90_knob_7", "fmha_cutlassB_bf16_aligned_64x64_k128_sm80",
             "void at::native::vectorized_elementwise_kernel<4>(...)", "ncclDevKernel_AllGather_RING_LL"}
    ours, theirs = ex.attention_kernels(names)
    assert ours == {"fwd_ws_d128_bf16_causal_m128n128s2_overlap_pingpong_sm90", "bwd_dkdv_ws_d128_bf16"}
    assert len(theirs) == 3 and not any("nccl" in n or "elementwise" in n for n in theirs)


def test_example_refuses_without_torchrun(monkeypatch):
    ex = _example()
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit, match="torchrun"):
        ex.init_distributed()


# ---------------------------------------------------------------------------------------------
# GPU: the example's check on 2 GPUs

def _two_gpu_problem():
    import torch
    import torch.distributed as dist
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return f"needs 2 CUDA GPUs, PyTorch sees {torch.cuda.device_count() if torch.cuda.is_available() else 0}"
    if not dist.is_available() or not dist.is_nccl_available():
        return "needs PyTorch with NCCL"
    if _cp_module() is None:
        return "this PyTorch has no context_parallel dispatcher"
    return None


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gpu_context_parallel_check():
    """torchrun --nproc-per-node 2 examples/context_parallel.py --check: loss and gradients of
    context parallelism on cuflash against one GPU, with flash-attn's rule; cuflash's kernels
    must have run the attention."""
    why = _two_gpu_problem()
    if why:
        pytest.skip(why)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",  # torchrun, this Python's
           "--master-port", str(_free_port()), EXAMPLE, "--check"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks
        out, err = proc.communicate()
        pytest.fail(f"the check did not finish in 600 s:\n{out[-4000:]}\n{err[-4000:]}")
    assert proc.returncode == 0 and "PASS" in out, (out[-6000:], err[-6000:])


# ---------------------------------------------------------------------------------------------
# CPU: the benchmark's driver (scripts/bench_context_parallel.py)

def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_cp", os.path.join(ROOT, "scripts", "bench_context_parallel.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_arguments():
    b = _bench()
    a = b.parse_args([])
    assert a.lengths == [32768, 65536, 131072, 262144] and a.gpus == [1, 2]
    assert a.d_model // a.heads == 128 and a.budget_s <= 600
    assert b.parse_args(["--lengths", "8k,12288"]).lengths == [8192, 12288]
    with pytest.raises(ValueError):
        b.parse_length("0k")
    with pytest.raises(SystemExit, match="multiple of 16 x 2"):
        b.main(["--lengths", "1000"])
    ex = _example()
    assert ex.parse_args(b.model_argv(a, 65536)).seqlen == 65536  # the example accepts them


def test_bench_driver_order_budget_and_oom():
    """Ascending lengths; a GPU count that ran out of memory is not run longer; no run starts
    past the budget and each gets at most the time left."""
    b = _bench()
    a = b.parse_args(["--lengths", "64k,32k,128k,256k", "--budget-s", "100", "--run-timeout-s", "60"])
    now, calls = [0.0], []

    def runner(seqlen, gpus, timeout):
        calls.append((seqlen, gpus, timeout))
        now[0] += 10
        oom = gpus == 1 and seqlen >= 128 * 1024
        return dict(seqlen=seqlen, gpus=gpus, status="does not fit" if oom else "ok", median_s=seqlen / 1e5 / gpus,
                    peak_gib=[1.0] * gpus)

    *_, rows = b.run_all(a, runner, clock=lambda: now[0])
    assert calls == [(32768, 1, 60), (32768, 2, 60), (65536, 1, 60), (65536, 2, 60), (131072, 1, 60),
                     (131072, 2, 50), (262144, 2, 40)]
    assert [r["status"] for r in rows if r["gpus"] == 1] == ["ok", "ok", "does not fit", "does not fit"]
    assert b.longest_fit(rows) == {1: 65536, 2: 262144}
    text = b.table(rows)
    assert "does not fit" in text and "2.00x" in text and text.count("\n") == 5
    a.budget_s = 45
    now[0] = 0.0
    *_, rows = b.run_all(a, runner, clock=lambda: now[0])
    assert [r["status"] for r in rows][-5:] == ["not run (time budget)"] * 5


def test_bench_merge_ranks():
    b = _bench()
    ok = dict(status="ok", step_s=[2.0, 1.0, 3.0], warmup_s=[9.0], peak_gib=50.0, device="H200", total_gib=139.8)
    r = b.merge(1024, 2, [dict(ok, rank=1, peak_gib=52.0), dict(ok, rank=0)], 0, False, "", 12.0)
    assert r["status"] == "ok" and r["median_s"] == 2.0 and r["peak_gib"] == [52.0, 50.0]
    oom = dict(rank=1, status="does not fit", error="OutOfMemoryError: CUDA out of memory")
    assert b.merge(1024, 2, [dict(ok, rank=0), oom], 1, False, "", 1.0)["status"] == "does not fit"
    assert b.merge(1024, 2, [dict(ok, rank=0)], 1, False, "log tail", 1.0)["error"].endswith("log tail")
    assert b.merge(1024, 2, [], -9, True, "", 1.0)["status"] == "timed out"
    assert b.merge(1024, 2, [dict(ok, rank=0), dict(ok, rank=1)], 1, False, "", 1.0)["status"] == "error"
