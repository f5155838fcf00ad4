"""A jitted JAX training step with cuflash.jax.attention: one causal attention layer and an MLP
learning to continue a random pattern of 8 tokens repeated along each sequence (the next token is
the one 8 places back: attention has to find it), with plain JAX (no optax, no flax). The step
(forward, jax.grad through cuflash's backward kernels, Adam update) is one jax.jit; the first
step's loss and gradients are checked against the same model with attention written in jnp.

    python examples/jax_train_step.py          # needs JAX with a CUDA GPU (pip install 'cuflash[jax]' jax[cuda13])

Without a GPU it says why and exits 0.
"""
import os
import sys
import time

try:
    import jax
    import jax.numpy as jnp
except ImportError as e:
    print(f"This example needs JAX ({e}); nothing to run.")
    sys.exit(0)
try:
    jax.devices("gpu")
except RuntimeError as e:
    print(f"This example needs JAX with a CUDA GPU, and this JAX has none ({e}); nothing to run.")
    sys.exit(0)
try:
    import cuflash.jax
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import cuflash.jax

VOCAB, DIM, HEADS, KV_HEADS, HEAD_DIM, SEQ, BATCH, PERIOD = 64, 256, 8, 2, 32, 128, 16, 8
DTYPE = jnp.bfloat16


def init(key):
    ks = jax.random.split(key, 7)
    w = lambda k, *s: jax.random.normal(k, s, jnp.float32) / s[0] ** 0.5  # noqa: E731
    return dict(emb=w(ks[0], VOCAB, DIM) * VOCAB ** 0.5, wq=w(ks[1], DIM, HEADS * HEAD_DIM),
                bq=jnp.zeros((HEADS, HEAD_DIM)), bk=jnp.zeros((KV_HEADS, HEAD_DIM)),
                wkv=w(ks[2], DIM, 2 * KV_HEADS * HEAD_DIM), wo=w(ks[3], HEADS * HEAD_DIM, DIM),
                w1=w(ks[4], DIM, 4 * DIM), w2=w(ks[5], 4 * DIM, DIM), head=w(ks[6], DIM, VOCAB) * 0.1)


def reference_attention(q, k, v):
    """Causal GQA attention in jnp (float32 softmax), the check for the first step."""
    k, v = (jnp.repeat(x, HEADS // KV_HEADS, axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * HEAD_DIM ** -0.5
    s = jnp.where(jnp.tril(jnp.ones((SEQ, SEQ), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1).astype(q.dtype), v)


def rope(x):
    """Rotary position embedding of (batch, seq, heads, head_dim): scores see relative positions."""
    half = HEAD_DIM // 2
    angle = jnp.arange(SEQ)[:, None] * 10000.0 ** (-jnp.arange(half) / half)
    cos, sin = jnp.cos(angle)[None, :, None], jnp.sin(angle)[None, :, None]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def loss_fn(params, tokens, attention):
    norm = lambda x: x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)  # noqa: E731
    x = params["emb"][tokens[:, :-1]]                                   # (batch, seq, dim), float32
    h = norm(x).astype(DTYPE)
    q = (h @ params["wq"].astype(DTYPE)).reshape(BATCH, SEQ, HEADS, HEAD_DIM)
    k, v = jnp.split((h @ params["wkv"].astype(DTYPE)).reshape(BATCH, SEQ, 2 * KV_HEADS, HEAD_DIM), 2, axis=2)
    q, k = rope(q + params["bq"].astype(DTYPE)), rope(k + params["bk"].astype(DTYPE))  # biases: attend by position
    x = x + (attention(q, k, v).reshape(BATCH, SEQ, -1) @ params["wo"].astype(DTYPE)).astype(jnp.float32)
    x = x + jax.nn.gelu(norm(x) @ params["w1"]) @ params["w2"]
    logits = norm(x) @ params["head"]
    labels = jax.nn.one_hot(tokens[:, 1:], VOCAB)
    return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), axis=-1))


def cuflash_attention(q, k, v):
    return cuflash.jax.attention(q, k, v, causal=True)


@jax.jit
def train_step(params, opt, tokens):
    """One Adam step; everything, cuflash's kernels included, runs inside this jit on XLA's stream."""
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, cuflash_attention)
    step = opt["step"] + 1
    m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, opt["m"], grads)
    v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, opt["v"], grads)
    lr = 3e-3 * jnp.sqrt(1 - 0.999 ** step) / (1 - 0.9 ** step)
    params = jax.tree.map(lambda p, m, v: p - lr * m / (jnp.sqrt(v) + 1e-8), params, m, v)
    return params, dict(step=step, m=m, v=v), loss


def batch(key):
    """Sequences repeating a random pattern of PERIOD tokens: all but the first PERIOD tokens are
    predictable by looking back."""
    pattern = jax.random.randint(key, (BATCH, PERIOD), 0, VOCAB)
    return jnp.tile(pattern, (1, SEQ // PERIOD + 1))[:, :SEQ + 1]


def main():
    key = jax.random.PRNGKey(0)
    params = init(key)
    opt = dict(step=jnp.zeros((), jnp.int32), m=jax.tree.map(jnp.zeros_like, params),
               v=jax.tree.map(jnp.zeros_like, params))

    tokens = batch(jax.random.fold_in(key, 0))
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_fn), static_argnums=2)(params, tokens, reference_attention)
    loss, grads = jax.jit(jax.value_and_grad(loss_fn), static_argnums=2)(params, tokens, cuflash_attention)
    rel = max(float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
              for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)))
    print(f"step 0: loss {float(loss):.4f} (jnp attention: {float(ref_loss):.4f}), "
          f"largest relative gradient difference {rel:.2e}")
    ok = abs(float(loss) - float(ref_loss)) < 1e-2 and rel < 5e-2

    first = None
    for i in range(1, 301):
        if i == 2:
            start = time.perf_counter()
        params, opt, loss = train_step(params, opt, batch(jax.random.fold_in(key, i)))
        first = first if first is not None else float(loss)
        if i % 50 == 0:
            print(f"step {i}: loss {float(loss):.4f}")
    print(f"{(time.perf_counter() - start) / 299 * 1e3:.2f} ms per step (batch {BATCH}, {SEQ} tokens, "
          f"{HEADS}/{KV_HEADS} heads of {HEAD_DIM})")
    ok = ok and float(loss) < 0.5 * first
    print("OK" if ok else "FAILED: " + ("gradients differ from jnp attention" if rel >= 5e-2 else "loss did not fall"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
