"""Context parallelism with cuflash: PyTorch's own ring attention
(``torch.distributed.tensor.experimental.context_parallel``) training a small causal transformer
over 2 GPUs, its per-shard attention calls served by cuflash's kernels.

    torchrun --nproc-per-node 2 examples/context_parallel.py               # train a few steps
    torchrun --nproc-per-node 2 examples/context_parallel.py --check       # compare with one GPU

Inside ``context_parallel(mesh, buffers=..., buffer_seq_dims=...)`` the token, label and rotary
buffers are split along the sequence (head-tail load balancing: rank r holds chunks r and
2*world-1-r of 2*world), and ``F.scaled_dot_product_attention`` runs ring attention: each rank
calls SDPA's flash op on its queries against every rank's keys, one block at a time, and merges the
blocks by their log-sum-exp. With ``cuflash.torch.activate_sdpa()`` those per-block flash calls,
forward and backward, run cuflash (docs/torch.md, "Context parallelism").

``--check`` runs one step of the same model on the same tokens four ways and compares the loss and
every parameter gradient (averaged over the ranks, as data-parallel training would) with a float32
reference computed on one GPU (rank 0 alone, no context parallelism): context parallelism with
cuflash must be within flash-attn's rule of context parallelism with PyTorch's own flash kernel
(error <= 2x that error + 2e-4); one GPU with PyTorch's and with cuflash's kernels are printed for
comparison. It also checks that cuflash's kernels, and no PyTorch attention kernel, ran the
attention of the cuflash step. Exit code 1 on a mismatch.

NCCL's NVLink multicast (NVLS) is turned off (NCCL_NVLS_ENABLE=0) before the process group
starts.
"""
import argparse
import math
import os
import sys
import time

# NVLink SHARP multicast buffers are not wanted here (the collectives are small all-gathers and
# all-to-alls between 2 GPUs): set before NCCL is initialised, which reads it once.
os.environ["NCCL_NVLS_ENABLE"] = "0"

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

try:
    import cuflash.torch  # noqa: F401
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import cuflash.torch  # noqa: F401


# ---------------------------------------------------------------------------------------------
# Arguments

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, default=16384, help="tokens per sequence (whole, before sharding)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5, help="training steps (not with --check)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pytorch-kernels", action="store_true",
                   help="train with PyTorch's own flash kernel instead of cuflash's")
    p.add_argument("--check", action="store_true",
                   help="one step compared with one GPU (default seqlen 8192 then)")
    args = p.parse_args(argv)
    if args.check and "--seqlen" not in (argv if argv is not None else sys.argv[1:]):
        args.seqlen = 8192
    if args.d_model % args.heads:
        p.error(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")
    head_dim = args.d_model // args.heads
    if head_dim % 2 or not 8 <= head_dim <= 256:
        p.error(f"the head dim (d_model / heads = {head_dim}) must be even and in 8..256, the "
                "head dims cuflash's SDPA path serves with rotary embeddings")
    for name in ("seqlen", "batch", "layers", "vocab", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be positive")
    return args


def check_seqlen(seqlen, world):
    """PyTorch's head-tail load balancing cuts the sequence into 2 * world chunks; without it
    (a length not divisible so) ring attention skips whole blocks and ranks wait on each other.
    Lengths are held to that, and each rank's half-chunks to whole 8-row groups."""
    if seqlen % (16 * world):
        raise SystemExit(f"--seqlen ({seqlen}) must be a multiple of {16 * world} (16 x world size "
                         f"{world}) for load-balanced context parallelism")


# ---------------------------------------------------------------------------------------------
# The model: pre-norm causal transformer with rotary embeddings

def rope_tables(seqlen, head_dim, base=10000.0):
    """cos and sin, (seqlen, head_dim) float32, of rotary embeddings (rotate-half layout). They
    are the model's only position-dependent state: context parallelism shards them with the
    tokens, so each rank rotates its queries and keys by their global positions."""
    half = head_dim // 2
    freq = base ** (-torch.arange(half, dtype=torch.float64) / half)
    angle = torch.arange(seqlen, dtype=torch.float64)[:, None] * freq
    angle = torch.cat([angle, angle], dim=1)
    return angle.cos().float(), angle.sin().float()


def apply_rope(x, cos, sin):
    """x (batch, seq, heads, head_dim), cos/sin (seq, head_dim), in float32, cast back."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    c, s = cos[:, None], sin[:, None]
    return (x.float() * c + rotated * s).to(x.dtype)


class Block(nn.Module):
    def __init__(self, d_model, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.norm2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model, bias=False)
        self.fc2 = nn.Linear(4 * d_model, d_model, bias=False)

    def forward(self, x, cos, sin):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # F.scaled_dot_product_attention is looked up at each call: context_parallel replaces
        # that attribute of torch.nn.functional with its ring-attention wrapper while active.
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        x = x + self.proj(o.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


class TinyLM(nn.Module):
    """Token embedding, ``layers`` blocks, final norm and an untied output head; ``forward``
    returns the mean next-token cross-entropy over the (local) tokens."""

    def __init__(self, vocab, d_model, heads, layers, seqlen):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        cos, sin = rope_tables(seqlen, d_model // heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "fc2.weight"))
                                else 0.02)

    def forward(self, tokens, labels):
        if self.cos.shape[0] != tokens.shape[1]:
            raise ValueError(f"rotary tables for {self.cos.shape[0]} positions, tokens {tokens.shape[1]}: "
                             "shard them together (context_parallel buffers) or build the model "
                             "for this sequence length")
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def build_model(args, device):
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    return TinyLM(args.vocab, args.d_model, args.heads, args.layers, args.seqlen).to(device)


def make_batch(args, device):
    """Tokens and next-token labels, the same on every rank: a random period-64 pattern per
    sequence, so the loss falls as attention learns to look 64 tokens back."""
    g = torch.Generator().manual_seed(args.seed + 1)
    pattern = torch.randint(0, args.vocab, (args.batch, 64), generator=g)
    seq = pattern.repeat(1, (args.seqlen + 1) // 64 + 1)[:, :args.seqlen + 1]
    # Clones, not views or .contiguous() (a no-op on a batch of 1): context_parallel reshards its
    # buffers in place, and two views of one storage would overwrite each other.
    return seq[:, :-1].clone().to(device), seq[:, 1:].clone().to(device)


# ---------------------------------------------------------------------------------------------
# One training step: with context parallelism, or on one GPU

def _context_parallel():
    try:
        from torch.distributed.tensor.experimental import context_parallel
    except ImportError as e:
        raise SystemExit(f"this PyTorch ({torch.__version__}) has no context_parallel: {e}")
    return context_parallel


def cp_step(model, tokens, labels, mesh, autocast=True):
    """Forward and backward of one batch sharded over ``mesh`` (1-dim, NCCL); parameter
    gradients averaged over the ranks (each rank's loss is the mean over its own tokens, and
    every rank holds as many tokens). Returns the loss averaged over the ranks. ``tokens`` and
    ``labels`` are resharded in place and not restored (they are consumed)."""
    import torch.distributed as dist
    cos, sin = model.cos, model.sin
    with _context_parallel()(mesh, buffers=[tokens, labels, cos, sin], buffer_seq_dims=[1, 1, 0, 0],
                             no_restore_buffers={tokens, labels}):
        # The backward must run inside the context too: it dispatches SDPA's flash backward to
        # ring attention the same way.
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(tokens, labels)
        loss.backward()
    # A sum divided by the world size, not ReduceOp.AVG, which gloo (CPU meshes) lacks.
    group, world = mesh.get_group(), mesh.size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(world)
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=group)
    return loss / world


def single_step(model, tokens, labels, autocast=True):
    """The same step on one GPU, whole sequences."""
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = model(tokens, labels)
    loss.backward()
    return loss.detach()


# ---------------------------------------------------------------------------------------------
# --check: the comparison rule

def max_errors(got, ref):
    """{name: max |got - ref|} over the parameter gradients, plus "loss"."""
    return {n: (got[n].double() - ref[n].double()).abs().max().item() for n in ref}


def rule_failures(err, base, factor=2.0, atol=2e-4):
    """Names where ``err`` breaks flash-attn's rule against the baseline ``base`` (PyTorch's own
    kernel in the same computation): err <= factor * base + atol. The factor leaves room for a
    different (equally valid) order of float32 accumulation; atol covers values whose baseline
    error happens to be near zero."""
    return [n for n in base if not err[n] <= factor * base[n] + atol]


def _kernel_names(fn):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        res = fn()
        torch.cuda.synchronize()
    return res, {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


# PyTorch's own attention kernels: its flash-attention 2 port, FA3 if built, cuDNN's SDPA
# kernels and the memory-efficient (cutlass fmha) kernels.
_PYTORCH_ATTENTION = ("flash_fwd", "flash_bwd", "cudnn_generated", "sdpa", "fmha_cutlass")


def attention_kernels(names):
    """(cuflash's kernels, PyTorch's attention kernels) among CUDA kernel names."""
    ours = {n for n in names if n.startswith(("fwd_", "bwd_"))}
    theirs = {n for n in names if any(t in n for t in _PYTORCH_ATTENTION) and n not in ours}
    return ours, theirs


def _grads(model, loss):
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    out["loss"] = loss.detach().clone().reshape(())
    model.zero_grad(set_to_none=True)
    return out


def run_check(args, mesh, rank, gloo):
    import torch.distributed as dist
    from torch.nn.attention import SDPBackend, sdpa_kernel
    dev = torch.device("cuda", torch.cuda.current_device())
    model = build_model(args, dev)
    results, problems = {}, []

    def cp_run():
        tokens, labels = make_batch(args, dev)
        return cp_step(model, tokens, labels, mesh)

    cuflash.torch.activate_sdpa()
    cp_run()  # first call: compiles (or loads) cuflash's kernels
    model.zero_grad(set_to_none=True)
    loss, names = _kernel_names(cp_run)
    results["cp_cuflash"] = _grads(model, loss)
    ours, theirs = attention_kernels(names)
    if not any(n.startswith("fwd_") for n in ours) or not any(n.startswith("bwd_") for n in ours) or theirs:
        problems.append(f"rank {rank}: attention under context parallelism did not run on cuflash alone: "
                        f"cuflash kernels {sorted(ours)}, PyTorch attention kernels {sorted(theirs)}")
    cuflash.torch.restore_sdpa()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # PyTorch's flash kernel (cuDNN comes first on sm_90)
        results["cp_pytorch_flash"] = _grads(model, cp_run())

    if rank == 0:  # one GPU, whole sequences, no context parallelism
        def one(autocast=True):
            tokens, labels = make_batch(args, dev)
            return _grads(model, single_step(model, tokens, labels, autocast=autocast))
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                ref = one(autocast=False)  # float32 throughout: the reference
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            results["one_gpu_pytorch_flash"] = one()
            cuflash.torch.activate_sdpa()
            try:
                results["one_gpu_cuflash"] = one()
            finally:
                cuflash.torch.restore_sdpa()
        errs = {k: max_errors(v, ref) for k, v in results.items()}
        scale = {n: ref[n].double().abs().max().item() for n in ref}
        print(f"\n{'tensor':34s} {'max|ref|':>9s} " + " ".join(f"{k:>22s}" for k in errs))
        for n in ref:
            print(f"{n:34s} {scale[n]:9.2e} " + " ".join(f"{errs[k][n]:22.3e}" for k in errs))
        bad = rule_failures(errs["cp_cuflash"], errs["cp_pytorch_flash"])
        if bad:
            problems.append("context parallelism with cuflash breaks the rule (error <= 2 x PyTorch "
                            f"flash's + 2e-4) for: {', '.join(bad)}")
        print(f"\nloss: reference {ref['loss'].item():.6f}, CP cuflash "
              f"{results['cp_cuflash']['loss'].item():.6f}, CP PyTorch flash "
              f"{results['cp_pytorch_flash']['loss'].item():.6f}")
    gathered = [None] * dist.get_world_size(gloo)
    dist.all_gather_object(gathered, problems, group=gloo)
    problems = [p for ps in gathered for p in ps]
    if rank == 0:
        print("\n".join(["FAIL: " + p for p in problems]) if problems else
              "PASS: context parallelism on cuflash matches one GPU within flash-attn's rule")
    return 1 if problems else 0


# ---------------------------------------------------------------------------------------------
# Training

def run_train(args, mesh, rank):
    dev = torch.device("cuda", torch.cuda.current_device())
    model = build_model(args, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    if not args.pytorch_kernels:
        cuflash.torch.activate_sdpa()
    world = mesh.size()
    for step in range(args.steps):
        tokens, labels = make_batch(args, dev)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = cp_step(model, tokens, labels, mesh)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if rank == 0:
            note = "  (first step: kernels compiled or loaded)" if step == 0 else ""
            print(f"step {step}: loss {loss.item():.4f}  {dt * 1e3:8.1f} ms  "
                  f"{args.batch * args.seqlen / dt:,.0f} tokens/s on {world} GPUs{note}", flush=True)
    if rank == 0:
        print(f"peak memory on rank 0: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    return 0


def init_distributed():
    """NCCL for the ring (one GPU per rank), plus a gloo group for the host-side bookkeeping
    (the --check verdict), so that rank 1 waiting on rank 0's one-GPU runs holds no GPU work."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    if "RANK" not in os.environ:
        raise SystemExit("run this under torchrun, e.g. torchrun --nproc-per-node 2 "
                         "examples/context_parallel.py")
    if not torch.cuda.is_available():
        raise SystemExit("this example needs CUDA GPUs, and PyTorch sees none")
    if not dist.is_nccl_available():
        raise SystemExit("this PyTorch has no NCCL")
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    mesh = init_device_mesh("cuda", (dist.get_world_size(),), mesh_dim_names=("cp",))
    return mesh, dist.get_rank(), dist.new_group(backend="gloo")


def main(argv=None):
    args = parse_args(argv)
    mesh, rank, gloo = init_distributed()
    import torch.distributed as dist
    try:
        check_seqlen(args.seqlen, mesh.size())
        if rank == 0:
            print(f"context parallelism over {mesh.size()} GPUs: batch {args.batch} x {args.seqlen} tokens, "
                  f"{args.layers} layers, d_model {args.d_model}, {args.heads} heads of "
                  f"{args.d_model // args.heads}, bf16 autocast, attention on "
                  f"{'PyTorch' if args.pytorch_kernels and not args.check else 'cuflash'}", flush=True)
        return run_check(args, mesh, rank, gloo) if args.check else run_train(args, mesh, rank)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
