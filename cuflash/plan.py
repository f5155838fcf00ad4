"""Problem + device facts -> Plan: which kernels launch, with which tiles and grids, and why.

Pure Python: no CuPy, no GPU. The split-KV rule is FlashAttention-2's (``flash_api.cpp``:
``set_params_splitkv`` and ``num_splits_heuristic``), reproduced exactly so the plan can say what
FA2 would have done for any shape.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace
from typing import NamedTuple

from .kernels import KernelVariant, head_dim_bucket
from .kernels import bwd, bwd_ws, fwd_ws
from .kernels.combine import CombineVariant
from .kernels.flashmask import FlashMaskPrepVariant
from .kernels.fwd import (DECODE_BLOCK_M, DECODE_MAX_ROWS, DECODE_WARPS, SPLIT_BLOCK_M, SPLIT_WARPS, FwdVariant,
                          decode_tile, flashmask_tile, fwd_tile, split_block_n, split_tile_n,
                          unaligned_leftpad_tile)

DECODE_WIDE_SPLITS = 16  # more splits than this need four K/V tiles each (the merge's cost)
MAX_SPLITS = 128
# sm_90, dense prefills (no cache, no packed sequences, no window) of at least 128 queries and at
# most this many keys: no split where the warp-specialised forward runs (one launch took 0.36-0.89x
# the time of FA2's split and its merge on 65 of 66 batch-1 shapes of 192-512 tokens at d = 64, 128
# and 256 on an H200: BENCHMARKS.md, "Short prefills")
WS_NO_SPLIT_MAX_KEYS = 512
WS_NO_SPLIT_MIN_QUERIES = 128
MAX_GRID_X, MAX_GRID_YZ = 2**31 - 1, 65535  # CUDA's grid limits
# The warp-specialised forward (kernels/fwd_ws.py) where it applies; CUFLASH_FWD_WS=0 keeps the
# wgmma kernel instead (to compare the two, or to rule one out).
FWD_WS = os.environ.get("CUFLASH_FWD_WS", "1") != "0"
# The warp-specialised backward (kernels/bwd_ws.py) likewise; CUFLASH_BWD_WS=0 keeps the wgmma kernel.
BWD_WS = os.environ.get("CUFLASH_BWD_WS", "1") != "0"


def check_grids(launches) -> None:
    """Raise a ValueError naming the sizes when a launch's grid is beyond CUDA's limits (x < 2^31,
    y and z <= 65535: y counts heads, z batch x splits), before anything is allocated."""
    for l in launches:
        x, y, z = l.grid
        if x > MAX_GRID_X or y > MAX_GRID_YZ or z > MAX_GRID_YZ:
            raise ValueError(f"{l.name} would launch a grid of {l.grid} blocks; CUDA allows at most "
                             f"({MAX_GRID_X}, {MAX_GRID_YZ}, {MAX_GRID_YZ}): the grid's y is the number of "
                             "heads (KV heads for decode), z the batch (times num_splits); use fewer heads, "
                             "a smaller batch or fewer splits per call")


@dataclass(frozen=True)
class DeviceFacts:
    num_sms: int
    arch: int  # compute capability as an int: 80, 86, 89, 90


@dataclass(frozen=True)
class Problem:
    """A validated attention call, without pointers or strides (so plans cache per shape)."""
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    head_dim: int          # as the kernel sees it: a multiple of 8, or a KV cache's own head dim (read element-wise)
    dtype: str             # "fp16" | "bf16"
    causal: bool = False
    return_lse: bool = False
    num_splits: int = 0    # 0 = heuristic, 1 = never split, N = exactly N splits
    heuristic: str = "cuflash"  # split rule: "cuflash" (decode tuned on an H200) or "fa2"
    kv: str = "dense"      # "cache"/"paged": per-batch lengths (seqlen_k is then the capacity)
    window: tuple[int, int] = (-1, -1)  # (left, right) sliding window, -1 = unbounded
    softcap: bool = False
    alibi: bool = False
    varlen: bool = False   # packed sequences: seqlen_q/seqlen_k are the maxima
    deterministic: bool = False  # backward: dQ without atomics, bitwise repeatable
    tma: bool = True       # q, k, v can be read by the TMA (positive strides; see launch.prepare)
    flashmask: int = 0     # FlashMask: bound columns per key of startend_row_indices (1, 2 or 4), 0 = none
    flashmask_heads: int = 0  # heads of startend_row_indices (1, nheads_k or nheads)
    sinks: bool = False    # attention sinks: a logit per query head joins each row's softmax
    leftpad: bool = False  # a KV cache whose sequences start at row cache_leftpad[b]
    dropout: bool = False  # attention dropout on P (the probability, seed and offset are launch arguments)
    page_size: int = 0     # a paged cache's rows per page (0: not known, or not paged)
    chunk: int = 0         # chunked attention (attention_chunk): keys in the query's chunk of this many, 0 = none


@dataclass(frozen=True)
class Launch:
    variant: KernelVariant
    grid: tuple[int, int, int]
    threads: int
    smem: int

    @property
    def name(self) -> str:
        return self.variant.name


@dataclass(frozen=True)
class Plan:
    problem: Problem
    device: DeviceFacts
    launches: tuple[Launch, ...]
    num_splits: int
    n_blocks_per_split: int
    pack_gqa: bool         # seqlen_q == 1 with GQA: a KV head's query heads become rows
    seqlen_q_eff: int      # query rows per (batch, head) as launched
    nheads_eff: int
    ngroups_eff: int       # query heads per KV head as launched
    causal_eff: bool
    window_eff: tuple[int, int]  # (left, right) as launched, -1 = unbounded; local iff either >= 0
    workspace_bytes: int
    efficiency: tuple[tuple[int, float | None], ...]  # (splits, wave efficiency or None if ineligible)
    reason: str
    backward: bool = False  # the launches compute the gradients of the problem's forward
    chunk_eff: int = 0      # attention_chunk as launched (0 where every query's chunk holds every key)

    @functools.cached_property
    def memo(self) -> dict:
        """Per-plan scratch for the launcher (e.g. packed scalar arguments), so the hot path
        never hashes the whole plan."""
        return {}

    @property
    def kernels(self) -> tuple[str, ...]:
        return tuple(l.name for l in self.launches)

    @property
    def local(self) -> bool:
        """A sliding-window (local) kernel runs; a plain causal mask is not one (and a plan that
        launches nothing runs none)."""
        return bool(self.launches) and self.launches[0].variant.local

    def __str__(self) -> str:
        p = self.problem
        extras = "".join([f" window={p.window}" if p.window != (-1, -1) else "",
                          f" attention_chunk={p.chunk}" if p.chunk else "",
                          " softcap" if p.softcap else "", " alibi" if p.alibi else "",
                          " sinks" if p.sinks else "", " dropout" if p.dropout else "",
                          " varlen (max lengths)" if p.varlen else ""])
        lines = [
            f"cuflash {'backward ' if self.backward else ''}plan: batch={p.batch} seqlen_q={p.seqlen_q} seqlen_k={p.seqlen_k} "
            f"heads={p.nheads}/{p.nheads_k} d={p.head_dim} {p.dtype} causal={p.causal}{extras} "
            f"on {self.device.num_sms} SMs (sm_{self.device.arch})",
        ]
        for l in self.launches:
            lines.append(f"  launch {l.name}  grid={l.grid} threads={l.threads} smem={l.smem} B")
        if self.backward:
            lines.append(f"  deterministic={p.deterministic}  workspace={self.workspace_bytes} B")
        else:
            lines.append(f"  num_splits={self.num_splits}  workspace={self.workspace_bytes} B")
        if self.efficiency:
            table = ", ".join(f"{s}:{'-' if e is None else f'{e:.3f}'}" for s, e in self.efficiency)
            lines.append(f"  wave efficiency by split count: {table}")
        lines.append("  why: " + self.reason)
        return "\n".join(lines)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_splits_heuristic(batch_nheads_mblocks: int, num_slots: int, num_n_blocks: int,
                         max_splits: int = MAX_SPLITS) -> tuple[int, tuple[tuple[int, float | None], ...]]:
    """FA2's ``num_splits_heuristic``: (chosen split count, efficiency table it chose from)."""
    if batch_nheads_mblocks >= 0.8 * num_slots:
        return 1, ()
    max_splits = min(max_splits, num_slots, num_n_blocks)

    def eligible(s):  # s splits that give the same blocks per split as s - 1 are the same split
        return s == 1 or cdiv(num_n_blocks, s) != cdiv(num_n_blocks, s - 1)

    table = []
    for s in range(1, max_splits + 1):
        if eligible(s):
            n_waves = batch_nheads_mblocks * s / num_slots
            table.append((s, n_waves / math.ceil(n_waves)))
        else:
            table.append((s, None))
    best = max((e for _, e in table if e is not None), default=0.0)
    for s, e in table:
        if e is not None and e >= 0.85 * best:
            return s, tuple(table)
    return 1, tuple(table)


def effective_window(causal: bool, window: tuple[int, int], seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """(left, right) with -1 for every bound that hides no key: causal is right = 0; a left edge
    of seqlen_k or more, or a right edge of seqlen_q - 1 or more, reaches past every key."""
    left, right = window
    if causal:
        right = 0
    if left >= seqlen_k:
        left = -1
    if right >= max(seqlen_q - 1, 0):
        right = -1
    return (left, right)


def band_tiles(rows: int, window: tuple[int, int], seqlen_q: int, seqlen_k: int, bn: int, chunk: int = 0) -> int:
    """Most K/V tiles of bn keys that a block of ``rows`` query rows can see under ``window``
    (and chunks of ``chunk`` keys: rows spanning r positions touch at most cdiv(r - 1, chunk) + 1
    whole chunks, and with a right edge see at most r - 1 + right + chunk keys)."""
    n = cdiv(seqlen_k, bn)
    left, right = window
    if chunk:
        r = min(rows, seqlen_q)
        span = (cdiv(r - 1, chunk) + 1) * chunk
        if right >= 0:
            span = min(span, r + right + chunk - 1)
        n = max(1, min(n, cdiv(span, bn) + 1))
    if left < 0:
        return n
    span = min(rows, seqlen_q) + left + (right if right >= 0 else max(seqlen_q - 1, 0))
    return max(1, min(n, cdiv(span, bn) + 1))


def chunk_pieces(batch: int, max_seqlen_q: int, max_seqlen_k: int, chunk: int, lead: int,
                 nheads: int) -> tuple[int, int, int, int]:
    """(c, pieces per sequence, max_seqlen_q, max_seqlen_k of a piece) of chunked attention run as
    packed sequences, the way cuflash.torch and cuflash.jax differentiate it (the backward kernels
    have no chunk mask): sequence b (sq queries, sk keys) becomes, first, its queries before its
    first key (position i + sk - sq < 0: no key, as no chunk of theirs holds one), then for m = 0
    ... cdiv(max_seqlen_k, c) - 1 the keys [m c, min((m + 1) c, sk)) with the queries whose
    position lies there. Each piece's last query sits at its last key's position, so causal
    masks, windows and ALiBi align as within the chunk. ``lead``: at most how many queries come
    before a sequence's first key. c = min(chunk, max_seqlen_k) (a chunk of every key sees what a
    larger one does). A ValueError naming attention_chunk where the pieces outgrow one launch."""
    c = min(chunk, max(max_seqlen_k, 1))
    per_seq = cdiv(max_seqlen_k, c) + 1
    max_q = min(max_seqlen_q, max(c, lead))
    if batch * per_seq > MAX_GRID_YZ or batch * per_seq * max(max_q, 1) * nheads > 2**31 - 1:
        raise ValueError(f"attention_chunk={chunk} as packed sequences (cuflash.torch with gradients or dropout, "
                         f"cuflash.jax) runs each sequence's chunks as sequences of their own: {batch} x {per_seq} pieces of up to {max_q} queries, beyond "
                         f"what one launch takes (at most {MAX_GRID_YZ} pieces and {2**31 - 1} rows x heads); "
                         "use a larger chunk or fewer sequences per call" + (
                             ", or pass one cu_seqlens array for queries and keys when they are the same"
                             if lead else ""))
    return c, per_seq, max_q, min(max_seqlen_k, c)


def chunk_piece_bounds(xp, cu_q, cu_k, ends):
    """cu_seqlens (queries, keys) of chunk_pieces' pieces, from a packed batch's int32 cu_seqlens
    and ``ends`` = int32 (0, c, 2c, ..., (pieces per sequence - 1) c), in ``xp`` (torch or
    jax.numpy; on the arrays' device, no sync): piece m of a sequence ends at key min(m c, sk) and
    at the first query whose position (i + sk - sq) reaches it. Values stay below total + c."""
    sq, sk = (cu_q[1:] - cu_q[:-1])[:, None], (cu_k[1:] - cu_k[:-1])[:, None]
    q_end = xp.minimum((ends - (sk - sq)).clip(min=0), sq)
    k_end = xp.minimum(ends, sk)
    return (xp.concatenate([cu_q[:1], (cu_q[:-1, None] + q_end).reshape(-1)]),
            xp.concatenate([cu_k[:1], (cu_k[:-1, None] + k_end).reshape(-1)]))


def seqused_bounds(xp, cu_q, cu_k, used_q=None, used_k=None):
    """cu_seqlens (queries, keys) of a packed batch whose sequence b uses only its first
    ``used_q[b]`` query and ``used_k[b]`` key tokens (FlashAttention-3's seqused_q / seqused_k;
    None: all of them), as three sequences per sequence, in ``xp`` (torch or jax.numpy; on the
    arrays' device, no sync): the used queries over the used keys, then the unused queries over no
    key (their output 0), then no query over the unused keys (their gradients 0). The tokens keep
    their rows; counts are clamped to [0, the sequence's length], so the bounds stay monotone."""
    def split(cu, used):
        start, end = cu[:-1], cu[1:]
        mid = end if used is None else start + xp.minimum(used.clip(min=0), end - start)
        return start, mid, end
    qa, qb, qc = split(cu_q, used_q)
    ka, kb, kc = split(cu_k, used_k)
    return (xp.concatenate([xp.stack([qa, qb, qc], 1).reshape(-1), cu_q[-1:]]),
            xp.concatenate([xp.stack([ka, kb, kb], 1).reshape(-1), cu_k[-1:]]))


def effective_chunk(p: "Problem") -> int:
    """attention_chunk as launched: 0 when every query's chunk holds every key (dense batches whose
    queries all sit at key positions 0 ... chunk - 1 or later in one chunk: seqlen_k <= chunk and
    seqlen_k >= seqlen_q), as FlashAttention-3 runs it otherwise, at most seqlen_k: a chunk of every
    key sees what any larger one sees (rows before the first key see none either way), and the
    kernels' chunk arithmetic (positions plus the chunk) then stays within int."""
    if p.chunk and p.kv == "dense" and not p.varlen and p.seqlen_q <= p.seqlen_k <= p.chunk:
        return 0
    return min(p.chunk, max(p.seqlen_k, 1))


_derived: list = []  # clear() of each cache kept on plans (cached_on_plans)


def cached_on_plans(cache: dict) -> dict:
    """Register ``cache``, whose entries were derived from plans (per-call plans, prepared
    launches), to be cleared by forget_plans; returns it."""
    on_forget_plans(cache.clear)
    return cache


def on_forget_plans(clear) -> None:
    """Register ``clear()``, which drops what was derived from plans, to be called by forget_plans."""
    _derived.append(clear)


def forget_plans() -> None:
    """Drop every cached plan and everything derived from one, so that calls made after the
    planner's switches change (FWD_WS, BWD_WS, a replaced chooser) are planned afresh."""
    make_plan.cache_clear()
    make_backward_plan.cache_clear()
    for clear in _derived:
        clear()


@functools.lru_cache(maxsize=4096)
def make_plan(p: Problem, dev: DeviceFacts) -> Plan:
    bucket = head_dim_bucket(p.head_dim)
    even = p.head_dim == bucket
    ngroups = p.nheads // p.nheads_k
    why = []

    _dropout_rejects(p)
    if p.flashmask:
        return _flashmask_plan(p, dev)
    window = effective_window(p.causal, p.window, p.seqlen_q, p.seqlen_k)
    chunk = effective_chunk(p)
    causal = window[0] < 0 and window[1] == 0 and not chunk  # FA2: causal is the window (-1, 0)
    local = (window != (-1, -1) and not causal) or chunk > 0
    if p.chunk:
        why.append(f"attention_chunk={p.chunk}: " + (
            f"each query sees only the keys of its chunk (key positions c * floor((i + sk - sq) / c) and the "
            f"{p.chunk - 1} after), within its {'causal ' if p.causal else ''}band, so the band kernels run with "
            "each tile walking only the K/V blocks of its rows' chunks." if chunk else
            f"every query's chunk holds all {p.seqlen_k} keys: no chunk mask."))
    if p.window != (-1, -1):
        why.append(f"window {p.window} " + (f"runs as a local band {window}: K/V tiles outside it are "
                                             "never loaded." if local else
                                             "hides no key beyond " + ("the causal mask." if causal else
                                                                       "the sequence: no window mask.")))
    # FA2's seqlen_q/ngroups swap: one query per head, several heads per KV head -> rows. Not
    # with ALiBi, whose biases depend on the head; a window or chunk masks every row as the one
    # query (the standard kernel's row_step).
    pack = p.seqlen_q == 1 and ngroups > 1 and not p.alibi and not p.dropout
    sq, nh, ng = (ngroups, p.nheads_k, 1) if pack else (p.seqlen_q, p.nheads, ngroups)
    if pack:
        why.append(f"seqlen_q=1 with {ngroups} query heads per KV head: each KV head's query heads "
                   f"run as {ngroups} rows of one query block, so K/V is read once per group "
                   "(FA2's seqlen_q/ngroups swap).")
    if p.causal and not causal and not local:
        why.append("causal with seqlen_q=1 sees every key (bottom-right alignment), so no mask.")
    if p.varlen:
        why.append(f"varlen: {p.batch} packed sequences of at most {p.seqlen_q} queries and "
                   f"{p.seqlen_k} keys; each block reads its sequence's bounds from cu_seqlens.")

    # FA2: block_n by head dim, m-blocks of 64, 2 blocks per SM (128 threads). cuflash's rule
    # counts only the K/V blocks a sliding window can reach.
    bn = split_block_n(p.head_dim)
    n_blocks = cdiv(p.seqlen_k, bn)
    if p.heuristic == "cuflash":
        n_blocks = band_tiles(SPLIT_BLOCK_M, window, p.seqlen_q, p.seqlen_k, bn, chunk)
    m_blocks = cdiv(sq, 64)
    work = p.batch * nh * m_blocks
    slots = 2 * dev.num_sms
    table: tuple = ()
    if p.heuristic not in ("cuflash", "fa2"):
        raise ValueError(f"heuristic must be 'cuflash' or 'fa2', got {p.heuristic!r}")
    decode = sq <= DECODE_MAX_ROWS and even and not p.dropout
    if p.dropout:
        splits = 1
        why.append("dropout: the standard kernel, never split and never the decode tile (flash-attn applies "
                   "dropout in training only, with no KV cache and no split); each lane regenerates its "
                   "Philox4x32-10 words per 16x16 block of P from (seed, offset, batch, head, row, key), zeroes "
                   "the dropped probabilities after the row sums and scales O by 1 / (1 - dropout_p).")
    elif p.seqlen_k == 0:
        splits = 1
        why.append("seqlen_k=0: no key is visible, the standard kernel writes zeros (LSE "
                   + ("the sink" if p.sinks else "+inf") + ").")
    elif p.num_splits == 1:
        splits = 1
        why.append("num_splits=1 was requested: standard kernel.")
    elif p.num_splits > 1:
        splits = p.num_splits
        why.append(f"num_splits={splits} was requested.")
    elif p.heuristic == "cuflash" and decode:
        # Decode: about one block per SM, each split walking at least two 64-key tiles.
        fa2_splits, _ = num_splits_heuristic(work, slots, cdiv(p.seqlen_k, bn))  # FA2 counts every block
        dbn = decode_tile(bucket)[1]
        d_blocks = band_tiles(DECODE_BLOCK_M, window, p.seqlen_q, p.seqlen_k, dbn, chunk)
        d_work = p.batch * nh * cdiv(sq, DECODE_BLOCK_M)
        # At least two tiles per split; beyond 16 splits at least four: the merge reads every
        # split's partials, so more splits must each bring more keys (BENCHMARKS.md, decode splits).
        per_sm = dev.num_sms // d_work
        per_tiles = max(d_blocks // 4, min(d_blocks // 2, DECODE_WIDE_SPLITS))
        splits = max(1, min(per_sm, per_tiles, MAX_SPLITS, MAX_GRID_YZ // p.batch))
        splits = cdiv(d_blocks, cdiv(d_blocks, splits))  # fewest splits with the same tiles per split
        why.append(f"decode: {d_work} block(s) of {DECODE_BLOCK_M} query rows on {dev.num_sms} SMs and "
                   f"{d_blocks} K/V tiles of {dbn} keys; splits are capped by one block per SM "
                   f"({per_sm}) and by the tiles per split, at least two and beyond "
                   f"{DECODE_WIDE_SPLITS} splits at least four ({per_tiles}): "
                   + (f"{splits} splits" if splits > 1 else "no split")
                   + f" (FA2's rule would pick {fa2_splits}: heuristic='fa2').")
    elif (p.heuristic == "cuflash" and dev.arch == 90 and p.kv == "dense" and not (p.varlen or local)
          and p.seqlen_q >= WS_NO_SPLIT_MIN_QUERIES and p.seqlen_k <= WS_NO_SPLIT_MAX_KEYS
          and _fwd_ws_blocker(p, even, bucket, pack) == ""):  # (fwd_ws's head dims all take wgmma tiles on sm_90)
        splits = 1
        why.append(f"sm_90, a prefill of at least {WS_NO_SPLIT_MIN_QUERIES} queries and at most "
                   f"{WS_NO_SPLIT_MAX_KEYS} keys: no split, the warp-specialised kernel in one launch (faster "
                   f"than a split and its merge on so few keys; FA2's rule: heuristic='fa2').")
    else:
        splits, table = num_splits_heuristic(work, slots, n_blocks, max(1, min(MAX_SPLITS, MAX_GRID_YZ // p.batch)))
        head = (f"batch*heads*m_blocks = {p.batch}*{nh}*{m_blocks} = {work} blocks of 64 query rows "
                f"against {slots} slots (2 per SM x {dev.num_sms} SMs)")
        if not table:
            why.append(f"{head} fill >= 80% of the GPU: no split, standard kernel.")
        elif splits == 1:
            why.append(f"{head} leave SMs idle, but with block_n={bn} there "
                       f"{'is only 1 K/V block' if n_blocks == 1 else f'are {n_blocks} K/V blocks'} "
                       "and no split count improves the wave efficiency: standard kernel.")
        else:
            best = max(e for _, e in table if e is not None)
            why.append(f"{head} fill only {work / slots:.1%} of the GPU, so K/V is split: block_n={bn} "
                       f"gives {n_blocks} K/V blocks; the best wave efficiency is {best:.3f} and "
                       f"{splits} is the smallest eligible split count within 85% of it "
                       "(FA2's num_splits_heuristic).")

    launches = []
    mods = dict(local=local, chunk=chunk > 0, softcap=p.softcap, alibi=p.alibi, sinks=p.sinks, leftpad=p.leftpad,
                kv_unaligned=p.kv != "dense" and p.head_dim % 8 != 0)
    if p.leftpad:
        why.append("cache_leftpad: each sequence's keys start at its cache_leftpad row.")
    if mods["kv_unaligned"]:
        why.append(f"head dim {p.head_dim} is not a multiple of 8: the cache's rows are read element by element.")
    if p.softcap or p.alibi:
        why.append("scores are " + " and ".join(
            (["softcapped (softcap * tanh(s / softcap))"] if p.softcap else [])
            + (["biased by ALiBi (-slope * distance)"] if p.alibi else [])) + " in registers.")
    if p.sinks:
        why.append("attention sinks: each head's sink logit joins the softmax of every row as one more "
                   "column with no value (the row starts from max = sink and sum = 1), so the sum and the "
                   "LSE include it" + (" (split 0 carries it; the merge adds the splits' sums)" if splits > 1
                                       else "") + ".")
    if decode:
        why.append(f"{sq} query row(s) per (batch, KV head): decode tile of {DECODE_BLOCK_M} rows whose "
                   f"{DECODE_WARPS} warps share each K/V tile's keys.")
    if splits <= 1:
        if decode:
            bm, bn_fwd, warps, stages, mma = (*decode_tile(bucket), "sync")
        else:
            bm, bn_fwd, warps, stages, mma = fwd_tile(bucket, even, dev.arch, p.kv,
                                                      local or p.softcap or p.alibi or p.dropout)
            if mods["kv_unaligned"] and p.leftpad:
                bm, bn_fwd, warps, stages, mma = unaligned_leftpad_tile((bm, bn_fwd, warps, stages, mma))
        ws = None if decode or mma != "wgmma" else _fwd_ws_blocker(p, even, bucket, pack)
        if ws == "":
            v = fwd_ws.planned(bucket, p.dtype, causal, sq, dev.arch, seqlen_k=p.seqlen_k, local=local,
                               softcap=p.softcap, alibi=p.alibi, varlen=p.varlen, cache=p.kv == "cache",
                               leftpad=p.leftpad, paged=p.kv == "paged", sinks=p.sinks, page_size=p.page_size,
                               chunk=chunk > 0)
            why.append(f"sm_90: the warp-specialised kernel (fwd_ws, sm_90a): a producer warpgroup loads Q and "
                       f"K/V tiles of {v.block_n} keys {'(Q by TMA)' if v.gather else 'by TMA'} into {v.stages} "
                       f"stages on mbarriers; "
                       f"{v.consumers} consumer warpgroups of 64 query rows run wgmma and the softmax"
                       + (", each issuing the next tile's QK^T before this tile's softmax" if v.overlap else "")
                       + ((", taking turns at the exponentials of the softmax (ping-pong: at d=64 they keep "
                           "the MUFU unit as busy as the products keep the tensor cores)" if v.turn_softmax else
                           ", taking turns at the tensor cores (ping-pong)") if v.pingpong else "") + "."
                       + (" Sliding window: each tile walks only the K/V blocks inside the band, masking those on "
                          "its edges." if v.local else "")
                       + (" Packed sequences: the tensor maps span every token, and each block reads its "
                          "sequence's bounds from cu_seqlens and starts its TMA boxes at the sequence's first row "
                          "(one block per query tile of the longest sequence; those past a shorter one's end "
                          "leave at once)." if v.varlen else "")
                       + (" KV cache: the K/V tensor maps are the cache's, and each block reads its key count "
                          "(cache_seqlens)" + (", cache row (cache_batch_idx) and first key row (cache_leftpad)"
                                               if v.leftpad else " and cache row (cache_batch_idx)")
                          + " on the device (one block per query tile)." if v.cache else "")
                       + (" Paged KV cache: " + _fwd_ws_pages(v, p.page_size) if v.paged else "")
                       + (f" Persistent blocks (at most one per SM) take the query tiles from an atomic counter in "
                          f"the one-tile order and load a tile's Q and first K/V while finishing the last: with "
                          f"{p.seqlen_k} keys (at most {fwd_ws.persistent_max_keys(v.head_dim, v.causal, v.turn_softmax)}) each tile walks "
                          f"few K/V blocks, "
                          f"and a one-tile block's start and end would cost a large share of its time."
                          + (" They keep two Q tiles, so that the next tile's Q loads while this one runs "
                             "(O is staged in the tile's own)." if v.double_q else "")
                          if v.persistent else ""))
            launches.append(Launch(v, v.grid(p.batch, sq, nh, dev.num_sms), v.threads, v.smem_bytes))
        else:
            v = FwdVariant(kind="fwd", head_dim=bucket, dtype=p.dtype, causal=causal, even_head_dim=even,
                           block_m=bm, block_n=bn_fwd, warps=warps, arch=dev.arch, stages=stages, kv=p.kv, **mods,
                           mma=mma, dropout=p.dropout)
            if mma == "wgmma":
                why.append(f"sm_90: Hopper's warpgroup MMA (wgmma, sm_90a), {warps // 4} warpgroups of 64 query "
                           f"rows sharing K/V tiles of {bn_fwd} keys; not the warp-specialised kernel: {ws}.")
            launches.append(Launch(v, (cdiv(sq, bm), nh, p.batch), v.threads, v.smem_bytes))
        nbps, workspace = 0, 0
    else:
        bm, bn, warps, stages = decode_tile(bucket) if decode else (
            SPLIT_BLOCK_M, split_tile_n(bucket, local, p.softcap, p.alibi, p.kv, mods["kv_unaligned"], chunk > 0),
            SPLIT_WARPS, 1)
        n_blocks = band_tiles(bm, window, p.seqlen_q, p.seqlen_k, bn, chunk)  # in the kernel's own K/V blocks
        nbps = cdiv(n_blocks, splits)
        v = FwdVariant(kind="fwd_split", head_dim=bucket, dtype=p.dtype, causal=causal, even_head_dim=even,
                       block_m=bm, block_n=bn, warps=warps, arch=dev.arch, stages=stages, kv=p.kv, **mods)
        launches.append(Launch(v, (cdiv(sq, bm), nh, p.batch * splits), v.threads, v.smem_bytes))
        rows = p.batch * nh * sq
        c = CombineVariant(head_dim=bucket, dtype=p.dtype, arch=dev.arch)
        launches.append(Launch(c, c.grid(rows), c.threads, 0))
        workspace = splits * rows * (bucket + 1) * 4
        empty = splits - cdiv(n_blocks, nbps)
        why.append(f"Each split walks {nbps} K/V block(s) of {bn} keys"
                   + (f" ({empty} split(s) get none and write the neutral element)" if empty > 0 else "")
                   + "; the partial outputs are merged by log-sum-exp: by the last split of each "
                   "query block (combine fused into the split kernel), or by the combine kernel "
                   "where no counter buffer can be made (a first call inside a CUDA graph capture).")
    check_grids(launches)
    return Plan(p, dev, tuple(launches), max(splits, 1), nbps, pack, sq, nh, ng, causal, window,
                workspace, table, " ".join(why), chunk_eff=chunk)


def _flashmask_plan(p: Problem, dev: DeviceFacts) -> Plan:
    """A FlashMask forward: the prep kernel reduces startend_row_indices to each K/V tile's min and
    max of every bound column, then the forward kernel (on sm_90 the warp-specialised one where it
    applies, else the standard one; never split, no GQA packing: its rows are query positions)
    skips, masks or runs each tile plain."""
    _flashmask_rejects(p)
    bucket = head_dim_bucket(p.head_dim)
    even = p.head_dim == bucket
    bm, bn, warps, stages, mma = flashmask_tile(bucket, even, dev.arch)
    bn_std = bn
    ws = _fwd_ws_blocker(p, even, bucket, False) if mma == "wgmma" else None
    if ws == "":
        v = fwd_ws.planned(bucket, p.dtype, p.causal, p.seqlen_q, dev.arch, p.flashmask, softcap=p.softcap)
        bm, bn = v.block_m, v.block_n
        kernel = (f"the warp-specialised forward (fwd_ws, sm_90a: a producer warpgroup loading Q and K/V tiles by "
                  f"TMA, {v.consumers} consumer warpgroups of 64 query rows) walks only the K/V blocks of {bn} "
                  f"keys in which some row of its {bm}-row tile is visible (the others are never loaded; a partly "
                  f"masked block's bounds are copied into shared memory with its K tile; "
                  + ("persistent blocks (at most one per SM) take from an atomic counter every "
                     if v.persistent else "the grid runs every ")
                  + f"(head, batch)'s first query tile{' (causal: its last)' if p.causal else ''}, then every one's "
                  f"second, and so on"
                  + (" (loading a tile's Q and first K/V while finishing the last)" if v.persistent else "")
                  + ", so that a mask's long walks start early in every head), masks")
    else:
        v = FwdVariant(kind="fwd", head_dim=bucket, dtype=p.dtype, causal=p.causal, even_head_dim=even, block_m=bm,
                       block_n=bn, warps=warps, arch=dev.arch, stages=stages, softcap=p.softcap, mma=mma,
                       flashmask=p.flashmask)
        kernel = (f"the standard forward kernel (never split, no GQA packing) then skips the math of each tile of "
                  f"{bm} x {bn} whose rows are all masked, masks")
    prep = FlashMaskPrepVariant(columns=p.flashmask, arch=dev.arch)
    heads = p.flashmask_heads or 1
    grid = v.grid(p.batch, p.seqlen_q, p.nheads, dev.num_sms) if ws == "" else (cdiv(p.seqlen_q, bm), p.nheads, p.batch)
    launches = (Launch(v, grid, v.threads, v.smem_bytes),
                Launch(prep, prep.grid(p.batch, heads, p.seqlen_k, bn), prep.threads, 0))
    # Room for the standard kernel's blocks too: launch.prepare runs it instead of fwd_ws when the
    # operands' strides turn out unreadable by the TMA.
    workspace = 4 * max(prep.workspace_ints(p.batch, heads, p.seqlen_k, n) for n in (bn, bn_std))
    why = [f"startend_row_indices (FlashMask, n={p.flashmask}, causal={p.causal}): {prep.name} runs first and "
           f"writes the min and max of each bound column per block of {bn} keys ({workspace} B); {kernel} the "
           "partly masked ones element by element and runs the rest unmasked."]
    if ws:
        why.append(f"sm_90: Hopper's warpgroup MMA (wgmma, sm_90a), {warps // 4} warpgroups of 64 query rows; not "
                   f"the warp-specialised kernel: {ws}.")
    if p.softcap:
        why.append("scores are softcapped (softcap * tanh(s / softcap)) in registers.")
    if p.seqlen_k == 0:
        why.append("seqlen_k=0: no key is visible, the kernel writes zeros (LSE +inf).")
    check_grids(launches)
    return Plan(p, dev, launches, 1, 0, False, p.seqlen_q, p.nheads, p.nheads // p.nheads_k, p.causal, (-1, -1),
                workspace, (), " ".join(why))


def _flashmask_rejects(p: Problem) -> None:
    """A ValueError naming what a FlashMask problem (forward or backward) cannot be combined with."""
    for bad, what in ((p.window != (-1, -1), f"window_size={p.window}"), (p.alibi, "alibi_slopes"),
                      (p.sinks, "sinks (attention sinks)"), (p.chunk, f"attention_chunk={p.chunk}"),
                      (p.num_splits > 1, f"num_splits={p.num_splits}"), (p.kv != "dense", "a KV cache"),
                      (p.varlen, "varlen (packed) sequences")):
        if bad:
            raise ValueError(f"startend_row_indices (FlashMask) cannot be combined with {what}")


def _dropout_rejects(p: Problem) -> None:
    """A ValueError naming what a dropout problem (forward or backward) cannot be combined with.
    flash-attn applies dropout in training only: never with a KV cache or split-KV."""
    if not p.dropout:
        return
    for bad, what in ((p.kv != "dense", "a KV cache"), (p.num_splits > 1, f"num_splits={p.num_splits}"),
                      (p.sinks, "sinks (attention sinks)"), (p.flashmask, "startend_row_indices (FlashMask)")):
        if bad:
            raise ValueError(f"dropout_p > 0 cannot be combined with {what}: dropout is for training, "
                             "where flash-attn has no KV cache and no split")


def _fwd_ws_pages(v, page_size: int) -> str:
    """How fwd_ws variant ``v`` reads a paged cache's pages of ``page_size`` rows (the plan's reason)."""
    if v.gather:
        why = ("a leftpad shifts the rows off the pages' TMA boxes" if v.leftpad else
               "as FlashAttention-3 does for pages the TMA cannot read whole tiles of")
        return (f"the producer warpgroup's 128 threads gather each K/V tile's rows from pages of {page_size} rows "
                f"(looked up in the block table) with 16-byte cp.async copies, {why} (one block per query tile).")
    if page_size >= v.block_n:
        return (f"the K/V tensor maps are the page pool's; the producer looks each tile's page up in the block "
                f"table (pages of {page_size} rows hold whole tiles; one block per query tile).")
    return (f"the K/V tensor maps are the page pool's; each K/V tile spans {v.block_n // page_size} pages of "
            f"{page_size} rows, which the producer looks up in the block table and loads as one TMA box each "
            f"(one block per query tile).")


def _fwd_ws_blocker(p: Problem, even: bool, bucket: int, pack: bool) -> str:
    """Why the warp-specialised forward (kernels/fwd_ws.py) cannot run ``p`` on sm_90, or ""."""
    if not FWD_WS:
        return "CUFLASH_FWD_WS=0 turned it off"
    if pack:
        return "query heads packed as rows (seqlen_q=1 with GQA) do not form the TMA's (seqlen, head) boxes"
    if bucket not in fwd_ws.HEAD_DIMS or not even:
        return f"it has head dims {' and '.join(map(str, fwd_ws.HEAD_DIMS))} only"
    if p.kv == "paged":
        if p.varlen:
            return "it reads no packed sequences over a paged cache"
        if not p.page_size:
            return "a paged cache whose page size the plan was not given"
    if p.dropout:
        return "it has no dropout (its consumers' P has no Philox mask)"
    if p.seqlen_k == 0:
        return "no key to load"
    if not p.tma:
        return "an operand has a stride the TMA cannot read (zero, or beyond 2^40 bytes)"
    return ""


def _bwd_ws_blocker(p: Problem, bucket: int, arch: int) -> str:
    """Why the warp-specialised backward (kernels/bwd_ws.py) cannot run ``p``'s dK/dV kernel, or ""."""
    if arch != 90:
        return "it is a Hopper (sm_90a) kernel"
    if not BWD_WS:
        return "CUFLASH_BWD_WS=0 turned it off"
    if bucket not in bwd_ws.HEAD_DIMS or p.head_dim != bucket:
        return f"it has head dims {', '.join(map(str, bwd_ws.HEAD_DIMS[:-1]))} and {bwd_ws.HEAD_DIMS[-1]} only"
    if p.kv != "dense":
        return "it reads dense K/V only (no KV cache)"
    if p.flashmask and p.softcap:
        return "it has no softcap with FlashMask"
    if p.softcap and p.alibi and bucket in bwd_ws.NO_SOFTCAP_ALIBI:
        return f"at head dim {bucket} it has no registers for softcap and ALiBi together"
    if p.dropout:
        return "it has no dropout (its P^T and dS^T have no Philox mask)"
    if not p.tma:
        return "an operand has a stride the TMA cannot read (zero, or beyond 2^40 bytes)"
    return ""


def backward_kernels(bucket: int, dtype: str, causal: bool, deterministic: bool, arch: int, local: bool = False,
                     softcap: bool = False, alibi: bool = False, flashmask: int = 0,
                     dropout: bool = False) -> tuple[KernelVariant, ...]:
    """The kernels one backward call launches, in launch order (prep, dK/dV, dQ); ``causal`` and
    ``local`` are the mask as launched (effective_window); ``flashmask``: FlashMask's bound
    columns per key (0 = none); ``dropout``: attention dropout."""
    return bwd.kernels(bucket, dtype, causal, deterministic, arch, local, softcap, alibi, flashmask, dropout)


def _chunk_backward(p: Problem, dev: DeviceFacts) -> Plan:
    """The backward of a chunked call as cuflash.torch and cuflash.jax run it (no backward kernel
    takes a chunk): the varlen backward of its pieces (chunk_pieces), the reason saying so."""
    lead = p.seqlen_q if p.varlen else max(0, p.seqlen_q - p.seqlen_k)
    c, per_seq, max_q, max_k = chunk_pieces(p.batch, p.seqlen_q, p.seqlen_k, p.chunk, lead, p.nheads)
    plan = make_backward_plan(replace(p, batch=p.batch * per_seq, seqlen_q=max_q, seqlen_k=max_k, varlen=True,
                                      chunk=0), dev)
    why = (f"attention_chunk={p.chunk}: no backward kernel takes a chunk, so cuflash.torch and cuflash.jax run the "
           f"call, forward and backward, as packed sequences: each of the {p.batch} sequence(s) cut into {per_seq} "
           f"pieces (its queries before its first key, then one per chunk of {c} keys with the queries whose "
           f"positions lie in it), at most {max_q} queries and {max_k} keys each; this is the plan of their backward. ")
    return replace(plan, reason=why + plan.reason)


@functools.lru_cache(maxsize=1024)
def make_backward_plan(p: Problem, dev: DeviceFacts) -> Plan:
    """The backward of ``p``'s forward: FlashAttention-2's algorithm in three kernels, with the
    forward's effective mask (the keys its LSE summed over). With FlashMask (``p.flashmask``) the
    launches end with the FlashMask prep kernel(s), which run first (see _flashmask_backward)."""
    bucket = head_dim_bucket(p.head_dim)
    window = effective_window(p.causal, p.window, p.seqlen_q, p.seqlen_k)
    causal = window[0] < 0 and window[1] == 0
    local = window != (-1, -1) and not causal
    if effective_chunk(p):
        return _chunk_backward(p, dev)
    _dropout_rejects(p)
    if p.flashmask:
        _flashmask_rejects(p)
        causal = p.causal  # the indices' columns follow the caller's causal (as in the forward)
    prep, main, last = backward_kernels(bucket, p.dtype, causal, p.deterministic, dev.arch, local, p.softcap, p.alibi,
                                        p.flashmask, p.dropout)
    ws = _bwd_ws_blocker(p, bucket, dev.arch)
    ordered = False  # deterministic dQ added in a fixed order by the dK/dV kernel (bwd_ws)
    if ws == "":
        main = bwd_ws.planned(bucket, p.dtype, causal, local, p.deterministic, dev.arch, p.flashmask, p.softcap,
                              p.alibi, p.varlen, p.seqlen_k, p.nheads // p.nheads_k, p.seqlen_q)
        ordered = main.dq_ordered
        if main.dq:  # its accumulator is in fragment order (atomic or ordered), or dq_t's swizzled rows
            last = bwd_ws.convert(bucket, p.dtype, dev.arch, p.varlen, main.dq_t, main.dq_groups)
        prep = bwd_ws.prep(main, prep)
    sq, sk, b = p.seqlen_q, p.seqlen_k, p.batch
    pad = main.row_pad
    rows_q = sq if p.varlen else cdiv(sq, pad) * pad  # bwd_prep's rows per head (dense: every padded row)
    launches = (Launch(prep, prep.grid(b, rows_q, p.nheads, p.head_dim), prep.threads, prep.smem_bytes),
                Launch(main, main.grid(b, sq, sk, p.nheads, p.nheads_k), main.threads, main.smem_bytes),
                Launch(last, last.grid(b, sq, sk, p.nheads, p.nheads_k) if last.kind == "bwd_dq"
                       else last.grid(b, sq, p.nheads, p.head_dim), last.threads, last.smem_bytes))
    # fp32 rows of LSE and D (and of the dQ accumulator), each sequence padded to `pad` rows;
    # packed sequences are bounded by batch * max length.
    rows = b * p.nheads * (cdiv(sq, pad) * pad + (bwd.VARLEN_ROW_GAP if p.varlen else 0))
    workspace = 4 * rows * bwd.row_floats(bucket, main, last) + 4 * bwd.sem_words(rows, main)
    why = []
    if p.window != (-1, -1):
        why.append(f"window {p.window} runs as " + (f"a local band {window}" if local else
                                                     "causal" if causal else "no mask") + ", as in the forward.")
    why.append(f"bwd_prep: D = rowsum(dO * O) and the LSE in the log2 domain for each of {p.nheads} heads' query "
               f"rows, padded to multiples of {pad}.")
    if main.family == "bwd_ws":
        kind = ("the warp-specialised kernel (bwd_ws, sm_90a): a producer warpgroup loads K and V once and each "
                "step's Q and dO tiles by TMA, LSE and D by bulk copies, into 2 stages on mbarriers; two consumer "
                + ("warpgroups run wgmma, each on half the head dim of dK, dV" + (" and dQ" if main.dq else "")
                   + " (the block's P^T and dS^T through shared memory)" if main.split_d else "warpgroups of 64 keys run wgmma"))
    elif main.mma == "wgmma":
        kind = (f"Hopper's warpgroup MMA (wgmma, sm_90a), two warpgroups of 64 keys; not the warp-specialised "
                f"kernel: {ws}")
    else:
        kind = "mma.sync" + ((" (the wgmma kernel has no registers for dropout)" if p.dropout else
                              " (the wgmma kernel has no registers for softcap/ALiBi; not the warp-specialised "
                              f"kernel: {ws})") if dev.arch == 90 and bucket in bwd.DKDV_WGMMA_TILES else "")
    why.append(f"{main.kind}: a block per {main.block_n} keys of a KV head keeps K and V in shared memory and walks "
               f"its {p.nheads // p.nheads_k} query head(s) in steps of {main.block_m} query rows, with {kind}; "
               "dK and dV are summed in registers and written once.")
    if p.varlen and main.family == "bwd_ws":
        why.append(f"Packed sequences: {main.kind}'s tensor maps span every token as one batch, and each block reads "
                   "its sequence's bounds from cu_seqlens, leaves at once past its keys and starts its TMA boxes at "
                   "the sequence's first token (one block per key block of the longest sequence); a box's rows past "
                   "the sequence's end (the next sequence's) are padding rows of LSE (+inf) and D (0), so they add "
                   "nothing to dK and dV, keys past it are masked as the tail, and their dQ lands in the sequence's "
                   "padding rows of the accumulator, which bwd_convert does not store.")
    if p.softcap or p.alibi:
        who = f"{main.kind} and {last.kind} recompute" if last.kind == "bwd_dq" else f"{main.kind} recomputes"
        why.append(f"{who} the scores as the forward formed them, "
                   + " and ".join((["softcapped (softcap * tanh(s / softcap))"] if p.softcap else [])
                                  + (["biased by ALiBi (-slope * distance)"] if p.alibi else []))
                   + " in registers" + ("; dS takes the softcap's derivative 1 - tanh^2." if p.softcap else "."))
    if p.dropout:
        why.append("dropout: the forward's mask is regenerated from (seed, offset, batch, head, row, key) in "
                   f"{main.kind}" + (f" and {last.kind}" if last.kind == "bwd_dq" else "") + ": dV = (P Z / (1 - p))^T "
                   "dO and dS = P (Z dP / (1 - p) - D), D = rowsum(dO * O) of the dropped output.")
    if p.sinks:
        why.append("sinks: dq, dk and dv need nothing more, since P = exp(s - LSE) and the LSE holds the sink; "
                   "dsinks = -sum over batch and rows of exp(sink - LSE) * D, from the LSE and D rows of "
                   "bwd_prep, reduced by the caller's framework on the same stream.")
    if ordered:
        order = ("from the last key block that sees it (the key blocks are launched from the last)" if causal or local
                 else "from the first key block")
        who = ("the dK/dV kernel's consumer warpgroups add dQ = dS K into an fp32 accumulator with atomics, each "
               "its own columns, a warp of the producer warpgroup taking the turns for them (they neither spin nor "
               "wait for their adds)," if main.split_d else
               "the dK/dV kernel's dQ writer adds dQ = dS K into an fp32 accumulator with bulk reduce-adds")
        fm_turns = (" (with FlashMask a key block whose tile is fully masked takes no turn)" if p.flashmask else "")
        why.append(f"deterministic=True: {who} in a fixed order: per query block a semaphore lets the key blocks add "
                   "in turn, "
                   f"{order}, each once the previous one's adds are complete{fm_turns}; every gradient is bitwise "
                   "repeatable, and bwd_convert scales dQ into the input dtype.")
        if main.dq_groups > 1:
            why.append(f"Without a mask over at most {bwd_ws.DQ_GROUPS_PLANNED[bucket][1]} keys and queries, the key blocks add in "
                       f"{main.dq_groups} runs of consecutive blocks, each into an fp32 accumulator of its own "
                       "(the first to add into a query block stores, the others add in turn) and walking from "
                       "another query block, so that a block waits at most for the ones before it in its run when "
                       f"a wave starts; bwd_convert sums the {main.dq_groups} accumulators in a fixed order.")
            blocks = -(-p.seqlen_k // main.block_n)
            lens = sorted({blocks // main.dq_groups, -(-blocks // main.dq_groups)})
            if lens[0] <= bwd_ws.SPREAD_RUN[bucket]:
                why.append(f"Runs of at most {bwd_ws.SPREAD_RUN[bucket]} blocks (here runs of "
                           f"{' and '.join(map(str, lens))}) take the spread order instead: a run's blocks start their walks spread over its query blocks and "
                           "each query block takes their adds in the order they reach it, so none waits at the start.")
    elif p.deterministic:
        why.append(f"deterministic=True: dQ has its own kernel, a block per {last.block_m} query rows walking the "
                   "K/V blocks it sees and writing dQ once: no atomics, every gradient is bitwise repeatable"
                   + (" (with this FlashMask mask the dK/dV kernel adds no dQ and skips the masked steps: its "
                      "ordered adds are planned with a causal mask at d = 64 and 128 only)."
                      if p.flashmask and main.family == "bwd_ws" else "."))
    else:
        how = ("bulk reduce-adds of a warp of the producer warpgroup, from a tile the consumers stage in shared "
               "memory (the dQ writer)" if getattr(main, "dq_writer", False) else
               "atomics issued before dK's product, so that they overlap it" if getattr(main, "dq_early", False)
               else "atomics")
        rot = (" Each key block walks its query steps from a different one, so that the blocks running together "
               "add into different rows." if getattr(main, "rotate", False) else "")
        if getattr(main, "dq_t", False):
            rot += (f" Steps of {main.block_m} query rows (FlashAttention-3's tile at d = 128): each consumer "
                    "warpgroup computes dQ^T = K^T dS^T for its 64 columns of the head dim (wgmma's M is 64), with "
                    "dS in shared memory as rows of queries; the accumulator's rows keep the staged tile's swizzled "
                    "16-byte chunks, which bwd_convert reads back.")
        if getattr(main, "lpt", False):
            rot += (" Key blocks are launched longest first (FlashAttention-3's LPT order: every (batch, KV head) "
                    "pair's first key block, which the most query blocks see, then every pair's second, in sections "
                    f"of pairs whose Q, dO and dQ rows fit in {bwd_ws.LPT_BYTES >> 20} MB of L2), so that the short "
                    "blocks fill the end of the grid.")
        why.append(f"deterministic=False: the dK/dV kernel also adds dQ = dS K into an fp32 accumulator with {how} "
                   f"(the order of additions varies), and bwd_convert scales it into the input dtype.{rot}")
    if p.flashmask:
        fm, fm_bytes, sizes = _flashmask_backward(p, dev, main, last)
        launches += fm
        workspace += fm_bytes
        dq = last.kind == "bwd_dq"
        why.append(f"startend_row_indices (FlashMask, n={p.flashmask}, causal={p.causal}): {fm[0].name} runs first "
                   f"and writes the min and max of each bound column per block of "
                   f"{' and of '.join(map(str, sizes))} keys ({fm_bytes} B; the key blocks of {main.kind}"
                   + (f" and {last.kind}" if dq else "") + "), then "
                   + (f"{main.kind} and {last.kind} skip each (key block, query block) tile whose rows are all "
                      "masked (no loads, no math, no dQ), mask the partly masked ones element by element and run "
                      "the rest unmasked." if dq else
                      f"{main.kind} skips each (key block, query block) tile whose rows are all masked (no loads, "
                      "no math, no dQ), masks the partly masked ones element by element and runs the rest "
                      "unmasked.")
                   + (" bwd_ws launches every (batch, KV head) pair's first key block"
                      + (" (ordered dQ with a causal mask: from the last)" if getattr(main, "dq_ordered", False)
                         and p.causal else "")
                      + ", then every one's second, and so on, so that the key blocks of long walks start early in "
                      "every head." if main.family == "bwd_ws" else ""))
    check_grids(launches)
    return Plan(p, dev, launches, 1, 0, False, sq, p.nheads, p.nheads // p.nheads_k, causal, window, workspace,
                (), " ".join(why), backward=True)


def _flashmask_backward(p: Problem, dev: DeviceFacts, main, last) -> tuple[tuple[Launch, ...], int, tuple]:
    """The FlashMask prep launches of a backward, their int32 workspace in bytes and their key-block
    sizes: one per
    key-block size, the dK/dV kernel's (``main.block_n``) first, then the deterministic dQ
    kernel's (``last.block_n``) where it differs. cuflash.backward lays the bounds out in this
    order after the fp32 rows."""
    prep = FlashMaskPrepVariant(columns=p.flashmask, arch=dev.arch)
    heads = p.flashmask_heads or 1
    sizes = dict.fromkeys((main.block_n, last.block_n) if last.kind == "bwd_dq" else (main.block_n,))
    launches = tuple(Launch(prep, prep.grid(p.batch, heads, p.seqlen_k, bn), prep.threads, 0) for bn in sizes)
    return launches, sum(4 * prep.workspace_ints(p.batch, heads, p.seqlen_k, bn) for bn in sizes), tuple(sizes)


def empty_plan(p: Problem, dev: DeviceFacts) -> Plan | None:
    """The plan of a call with nothing to compute (batch, seqlen_q or nheads 0: attention returns
    at once), which launches nothing and says why; None when there is work to plan."""
    empty = [f"{name}=0" for name, n in (("batch", p.batch), ("seqlen_q", p.seqlen_q), ("nheads", p.nheads))
             if n == 0]
    if not empty:
        return None
    return Plan(p, dev, (), 0, 0, False, p.seqlen_q, p.nheads, p.nheads // p.nheads_k, p.causal,
                p.window, 0, (), f"{', '.join(empty)}: nothing to compute, no kernel is launched.")


# ---------------------------------------------------------------------------------------------
# FlashMask tiles (cuflash.masks): the forward's classes (kernels/flashmask.py and
# templates/common/flashmask.cuh apply the same rule on the device).

SKIPPED, MASKED, UNMASKED = 0, 1, 2


class MaskTiles(NamedTuple):
    skipped: int
    masked: int    # masked element by element
    unmasked: int

    @property
    def total(self) -> int:
        return self.skipped + self.masked + self.unmasked


def tile_classes(startend_row_indices, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, causal: bool):
    """FlashMask's tile classification (the paper's Algorithm 1) -> int8 (batch, heads, m_blocks,
    n_blocks) of SKIPPED, MASKED (masked element by element) or UNMASKED. Per key block, the min and
    max of each interval's start and end over its keys decide: query rows [r0, r1) are fully masked
    by an interval if r0 >= max(start) and r1 <= min(end), untouched by it if r0 >= max(end) or
    r1 <= min(start). With causal=True the causal mask (bottom-right) classifies the tile too.
    Conservative: SKIPPED and UNMASKED hold for every element; MASKED may be either."""
    import numpy as np
    from .masks import intervals
    a = np.asarray(startend_row_indices)
    b, h = a.shape[:2]
    nm, nn = cdiv(seqlen_q, block_m), cdiv(seqlen_k, block_n)
    r0 = np.arange(nm)[:, None] * block_m                  # (m, 1): a tile's rows [r0, r1)
    r1 = np.minimum(r0 + block_m, seqlen_q)
    full = np.zeros((b, h, nm, nn), dtype=bool)
    part = np.zeros((b, h, nm, nn), dtype=bool)
    big = np.iinfo(np.int64).max

    def per_block(x, fill, reduce):  # (b, h, seqlen_k) -> (b, h, 1, n_blocks); the padding keys are neutral
        x = np.pad(x, ((0, 0), (0, 0), (0, nn * block_n - seqlen_k)), constant_values=fill)
        return reduce(x.reshape(b, h, nn, block_n), axis=-1)[:, :, None, :]

    for start, end in intervals(a, seqlen_q, causal):
        s_min, s_max = per_block(start, big, np.min), per_block(start, -1, np.max)
        e_min, e_max = per_block(end, big, np.min), per_block(end, -1, np.max)
        full |= (r0 >= s_max) & (r1 <= e_min)
        part |= (r0 < e_max) & (r1 > s_min)
    if causal:  # key j is seen by row i iff j <= i + seqlen_k - seqlen_q
        c0 = np.arange(nn) * block_n
        c1 = np.minimum(c0 + block_n, seqlen_k)
        full |= c0 > r1 - 1 + seqlen_k - seqlen_q
        part |= c1 - 1 > r0 + seqlen_k - seqlen_q
    return np.where(full, SKIPPED, np.where(part, MASKED, UNMASKED)).astype(np.int8)


def mask_tiles(startend_row_indices, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int,
               causal: bool) -> MaskTiles:
    """How many (query block, key block) tiles of block_m x block_n, over the indices' batch and
    heads, a FlashMask kernel would skip, mask element by element and run unmasked
    (:func:`tile_classes`)."""
    import numpy as np
    counts = np.bincount(tile_classes(startend_row_indices, seqlen_q, seqlen_k, block_m, block_n,
                                      causal).ravel(), minlength=3)
    return MaskTiles(*(int(c) for c in counts))


def with_flashmask(plan: Plan, shape: tuple[int, ...], values=None) -> Plan:
    """``plan`` with a sentence on FlashMask's tiles added to its reason: the tiles of the launch
    that walks K/V (the forward's first, the backward's dK/dV kernel) over batch x nheads, and,
    when the indices' ``values`` are given (a host array of ``shape``), how many are skipped,
    masked and unmasked (:func:`mask_tiles`; indices shared by several query heads count once
    per head)."""
    p = plan.problem
    if not plan.launches:
        return replace(plan, reason=f"{plan.reason} FlashMask: no tile to classify.")
    v = plan.launches[1 if plan.backward else 0].variant
    bm, bn = v.block_m, v.block_n
    n = p.batch * p.nheads * cdiv(p.seqlen_q, bm) * cdiv(p.seqlen_k, bn)
    if values is None:
        counts = ("; how many are skipped, masked or unmasked depends on the indices' values, "
                  "which are not on the host (pass them as a NumPy array to count them)")
    else:
        t = mask_tiles(values, p.seqlen_q, p.seqlen_k, bm, bn, p.causal)
        per = p.nheads // shape[1]
        counts = (f": {t.skipped * per} skipped, {t.masked * per} masked, {t.unmasked * per} unmasked "
                  "(from each key block's min and max of the row bounds)")
    return replace(plan, reason=f"{plan.reason} FlashMask: {n} tiles of {bm} x {bn} "
                                f"(batch {p.batch} x {p.nheads} heads){counts}.")
