"""FlashMask masks (Wang et al., arXiv 2410.01359; PaddlePaddle's ``flashmask_attention``): a
mask stored per key column as intervals of masked query rows, O(seqlen) memory instead of a
dense O(seqlen^2) one.

``startend_row_indices`` is int32 of shape (batch, heads, seqlen_k, n), heads being 1
(broadcast), nheads_k or nheads. For key column j its entries are row bounds in [0, seqlen_q];
query row i is masked (cannot see key j) when:

- causal=True, n=1 (LTS):           i >= LTS
- causal=True, n=2 (LTS, LTE):      LTS <= i < LTE
- causal=False, n=2 (LTS, UTE):     i >= LTS or i < UTE
- causal=False, n=4 (LTS, LTE, UTS, UTE): LTS <= i < LTE or UTS <= i < UTE

and with causal=True the causal mask applies too (aligned bottom-right as everywhere in
cuflash: i sees j only if j <= i + seqlen_k - seqlen_q; Paddle's square case j <= i).
LT = lower-triangle interval, UT = upper-triangle interval. A row that sees no key outputs 0
with LSE +inf.

The builders below return int32 (batch, 1, seqlen, n) arrays for square masks (seqlen_q =
seqlen_k = seqlen), each with the causal flag it is meant for; concatenate builders' outputs
along axis 0 (np.concatenate) for a batch of different masks. ``to_dense`` gives the boolean
mask, True = masked (the polarity of Paddle's -inf entries, the opposite of the 1 = visible
pictures in Paddle's documentation).

cuflash.attention(..., startend_row_indices=) runs the mask in the forward kernels (a prep
kernel reduces the indices per key block; the standard forward skips, masks or runs each tile
plain); those kernels are compiled offline and their GPU tests have not run yet. The backward,
varlen and KV-cache paths do not take the indices. cuflash.plan counts the tiles the forward
skips, masks and leaves unmasked; cuflash.reference applies the mask.
"""
from __future__ import annotations

import numpy as np

from . import validate

__all__ = ["to_dense", "intervals", "full", "causal", "sliding_window", "causal_document", "document",
           "share_question", "global_sliding_window", "causal_blockwise", "prefix_lm_causal",
           "prefix_lm_document", "qk_sparse", "random_eviction", "plot"]


def intervals(startend_row_indices, seqlen_q, causal):
    """The masked row intervals [start, end) of every key column: a list of (start, end) int64
    arrays of shape (batch, heads, seqlen_k), one per interval (LT, and UT without causal)."""
    a = np.asarray(startend_row_indices).astype(np.int64)
    n = a.shape[-1]
    col = [a[..., c] for c in range(n)]
    if causal:
        return [(col[0], np.full_like(col[0], seqlen_q) if n == 1 else col[1])]
    if n == 2:
        return [(col[0], np.full_like(col[0], seqlen_q)), (np.zeros_like(col[1]), col[1])]
    return [(col[0], col[1]), (col[2], col[3])]


def to_dense(startend_row_indices, seqlen_q, causal, rows=None):
    """The dense mask, bool (batch, heads, seqlen_q, seqlen_k), True where query row i cannot see
    key j (the intervals, and the bottom-right causal mask with causal=True). ``rows=(i0, i1)``
    gives only query rows i0:i1. The indices are checked first (validate.check_startend_row_indices)."""
    a = np.asarray(startend_row_indices)
    b, h, sk = (a.shape + (0, 0, 0))[:3]  # a shape of another rank fails the check
    validate.check_startend_row_indices(a, b, h, seqlen_q, sk, validate.boolean(causal, "causal"))
    i0, i1 = (0, seqlen_q) if rows is None else rows
    i = np.arange(i0, i1)[:, None]  # (r, 1) against key columns (1, sk)
    masked = np.zeros((b, h, i1 - i0, sk), dtype=bool)
    for start, end in intervals(a, seqlen_q, causal):
        masked |= (i >= start[:, :, None, :]) & (i < end[:, :, None, :])
    if causal:
        masked |= np.arange(sk) > i + sk - seqlen_q
    return masked


# ---------------------------------------------------------------------------------------------
# Builders: int32 (batch, 1, seqlen, n)

def _pack(batch, *cols):
    """Columns (seqlen,) each -> int32 (batch, 1, seqlen, len(cols))."""
    x = np.stack([np.asarray(c, dtype=np.int64) for c in cols], axis=-1).astype(np.int32)
    return np.broadcast_to(x, (batch, 1) + x.shape).copy()


def _lengths(lengths, name, minimum=1):
    """A list of ints >= minimum -> (ends, starts) of the consecutive spans as int64 arrays."""
    lens = [int(n) for n in lengths]
    if not lens or any(n < minimum for n in lens):
        raise ValueError(f"{name} must be a non-empty list of ints >= {minimum}, got {validate.show(lengths)}")
    ends = np.cumsum(lens)
    return ends, ends - lens


def _per_key(lengths, values):
    """Each span's value repeated over its keys."""
    return np.repeat(np.asarray(values, dtype=np.int64), lengths)


def full(seqlen, batch=1):
    """No mask (causal=False, n=2): LTS = seqlen, UTE = 0."""
    return _pack(batch, np.full(seqlen, seqlen), np.zeros(seqlen))


def causal(seqlen, batch=1):
    """The causal mask alone (causal=True, n=1): LTS = seqlen, nothing beyond the causal mask."""
    return _pack(batch, np.full(seqlen, seqlen))


def sliding_window(seqlen, window, batch=1):
    """Causal sliding window (causal=True, n=1): query i sees keys i - window .. i
    (flash-attn's window_size=(window, 0)); LTS = min(j + window + 1, seqlen)."""
    if int(window) < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    return _pack(batch, np.minimum(np.arange(seqlen) + int(window) + 1, seqlen))


def causal_document(doc_lens, batch=1):
    """Causal document mask (causal=True, n=1): documents of the given lengths packed in one
    sequence, each token seeing the earlier tokens of its own document; LTS = its document's end."""
    ends, _ = _lengths(doc_lens, "doc_lens")
    return _pack(batch, _per_key(doc_lens, ends))


def document(doc_lens, batch=1):
    """Document mask (causal=False, n=2): block diagonal, each token sees every token of its own
    document; LTS = the document's end, UTE = its start."""
    ends, starts = _lengths(doc_lens, "doc_lens")
    return _pack(batch, _per_key(doc_lens, ends), _per_key(doc_lens, starts))


def share_question(docs, batch=1):
    """Shared-question mask (causal=True, n=1): each document is a question followed by answers,
    ``docs`` a list of [question_len, answer_len, ...]. Causal within each span; every answer sees
    its document's question but no other answer. LTS = the document's end for question keys, the
    answer's end for answer keys."""
    cols = []
    for doc in docs:
        ends, _ = _lengths(doc, "each document of docs")
        off = sum(len(c) for c in cols)
        lts = _per_key(doc, ends + off)
        lts[:doc[0]] = ends[-1] + off  # the question is seen by all of its document
        cols.append(lts)
    if not cols:
        raise ValueError("docs must list at least one document")
    return _pack(batch, np.concatenate(cols))


def global_sliding_window(seqlen, global_tokens, window, batch=1):
    """Global + sliding window (causal=False, n=4): query i sees key j iff |i - j| <= window, or
    i < global_tokens, or j < global_tokens. LTS = min(j + window + 1, seqlen) (seqlen for global
    keys), LTE = seqlen, and rows [global_tokens, j - window) as the upper interval (UTS = UTE = 0
    where it is empty)."""
    g, w = int(global_tokens), int(window)
    if g < 0 or w < 0:
        raise ValueError(f"global_tokens and window must be >= 0, got {global_tokens}, {window}")
    j = np.arange(seqlen)
    lts = np.where(j < g, seqlen, np.minimum(j + w + 1, seqlen))
    upper = j - w > g
    return _pack(batch, lts, np.full(seqlen, seqlen), np.where(upper, g, 0), np.where(upper, j - w, 0))


def causal_blockwise(block_lens, batch=1):
    """Causal blockwise mask (causal=True, n=2), as for in-context examples: every block but the
    last is a causal document; the last block sees all earlier blocks (causally). LTS = the
    block's end, LTE = the last block's start (LTS = LTE = seqlen where that is empty)."""
    ends, starts = _lengths(block_lens, "block_lens")
    seqlen = int(ends[-1])
    lts, lte = ends.copy(), np.full_like(ends, starts[-1])
    empty = lts >= lte
    lts[empty], lte[empty] = seqlen, seqlen
    return _pack(batch, _per_key(block_lens, lts), _per_key(block_lens, lte))


def prefix_lm_causal(seqlen, prefix_len, batch=1):
    """Prefix-LM causal mask (causal=False, n=2): the first prefix_len tokens see each other
    (bidirectional), the rest is causal. LTS = seqlen, UTE = 0 for prefix keys and j after."""
    p = int(prefix_len)
    if not 0 <= p <= seqlen:
        raise ValueError(f"prefix_len must be between 0 and seqlen ({seqlen}), got {prefix_len}")
    j = np.arange(seqlen)
    return _pack(batch, np.full(seqlen, seqlen), np.where(j < p, 0, j))


def prefix_lm_document(docs, batch=1):
    """Prefix-LM document mask (causal=False, n=2): documents packed in one sequence, ``docs`` a
    list of (doc_len, prefix_len); inside each document the prefix is bidirectional and the rest
    causal; no token sees another document. LTS = the document's end, UTE = its start for prefix
    keys and j after."""
    lens = [int(n) for n, _ in docs]
    ends, starts = _lengths(lens, "each doc_len of docs")
    prefix = np.asarray([int(p) for _, p in docs])
    if ((prefix < 0) | (prefix > lens)).any():
        raise ValueError(f"each prefix_len must be between 0 and its doc_len, got {validate.show(docs)}")
    j = np.arange(ends[-1])
    start = _per_key(lens, starts)
    return _pack(batch, _per_key(lens, ends), np.where(j < start + _per_key(lens, prefix), start, j))


def qk_sparse(seqlen, maskout, batch=1):
    """QK-sparse mask (causal=True, n=2), as in Paddle's benchmarks: ``maskout`` is a list of
    (offset, length) spans, increasing and disjoint; the queries of a span see only the keys
    before it (the span's keys are dropped for its own queries), every other row is causal.
    LTS = j and LTE = offset + length for the span's keys, LTS = LTE = seqlen elsewhere."""
    lts, lte = np.full(seqlen, seqlen), np.full(seqlen, seqlen)
    last = 0
    for off, n in maskout:
        off, n = int(off), int(n)
        if off < last or n < 0 or off + n > seqlen:
            raise ValueError(f"maskout must be increasing, disjoint (offset, length) spans within seqlen "
                             f"({seqlen}), got {validate.show(maskout)}")
        lts[off:off + n], lte[off:off + n] = np.arange(off, off + n), off + n
        last = off + n
    return _pack(batch, lts, lte)


def random_eviction(seqlen, start_row, seed=0, batch=1, nheads=1):
    """Random eviction mask (causal=True, n=1), as in Paddle's benchmarks: from row start_row on,
    each row evicts one key drawn at random (without replacement, from keys 0 .. seqlen - 2) from
    the KV cache; an evicted key is masked for that row and every later one. LTS = the row that
    evicts key j (at least j + 1), seqlen if it is never evicted. Seeded, different for every
    (batch, head): shape (batch, nheads, seqlen, 1)."""
    if not 1 <= int(start_row) <= seqlen:
        raise ValueError(f"start_row must be between 1 and seqlen ({seqlen}), got {start_row}")
    rng = np.random.default_rng(seed)
    out = np.full((batch, nheads, seqlen, 1), seqlen, dtype=np.int32)
    rows = np.arange(start_row, seqlen)
    for b in range(batch):
        for h in range(nheads):
            keys = rng.choice(seqlen - 1, seqlen - start_row, replace=False)
            out[b, h, keys, 0] = np.maximum(rows, keys + 1)
    return out


# ---------------------------------------------------------------------------------------------
# Picture

def plot(startend_row_indices, seqlen_q, causal, path, *, batch=0, head=0, block=None, title=None):
    """Write a PNG of the dense mask of (batch, head) to ``path``: visible entries dark, masked
    ones light. ``block=(block_m, block_n)`` overlays the tile grid coloured by the planner's
    classification (tile_classes in cuflash/plan.py: skipped, masked, unmasked). Needs matplotlib
    (the ``plot`` extra: pip install 'cuflash[plot]')."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch, Rectangle
    except ImportError as e:
        raise ImportError("cuflash.masks.plot needs matplotlib: pip install 'cuflash[plot]' "
                          f"(or pip install matplotlib); {e}") from None
    a = np.asarray(startend_row_indices)
    masked = to_dense(a, seqlen_q, causal)[batch, head]
    sq, sk = masked.shape
    fig, ax = plt.subplots(figsize=(6, 6 * max(sq, 1) / max(sk, 1) + 1.2))
    ax.imshow(~masked, cmap="Blues", vmin=-0.4, vmax=1, interpolation="nearest",
              extent=(-0.5, sk - 0.5, sq - 0.5, -0.5))
    handles = [Patch(color=plt.get_cmap("Blues")(1.0), label="visible"),
               Patch(color=plt.get_cmap("Blues")(0.28), label="masked")]
    if block is not None:
        from .plan import tile_classes
        bm, bn = block
        colors = {0: "tab:gray", 1: "tab:orange", 2: "tab:green"}
        cls = tile_classes(a[batch:batch + 1, head:head + 1], sq, sk, bm, bn, causal)[0, 0]
        inset = 0.06 * min(bm, bn)  # tiles drawn inside their bounds, so that neighbours' edges do not overlap
        for (m, n), c in np.ndenumerate(cls):
            ax.add_patch(Rectangle((n * bn - 0.5 + inset, m * bm - 0.5 + inset), min(bn, sk - n * bn) - 2 * inset,
                                   min(bm, sq - m * bm) - 2 * inset, fill=False, edgecolor=colors[c],
                                   linewidth=1.5, hatch="//" if c == 0 else None))
        handles += [Patch(fill=False, edgecolor=colors[c], label=f"{name} tile ({bm} x {bn})")
                    for c, name in ((0, "skipped"), (1, "masked"), (2, "unmasked"))]
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    ax.set_title(title or f"FlashMask, n={a.shape[-1]}, causal={bool(causal)}")
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
