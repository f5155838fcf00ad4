"""Plan + buffers -> kernel launches on the caller's stream. No synchronisation, no host copies."""
from __future__ import annotations

import math

import numpy as np

from . import compiler
from .plan import Plan

_LOG2E = math.log2(math.e)


def _strides(view, pack: bool, ngroups: int):
    """(batch, row, head) strides in elements; with GQA packing a KV head's query heads are rows."""
    sb, ss, sh = view.strides[0], view.strides[1], view.strides[2]
    if pack:
        ss, sh = sh, sh * ngroups
    return np.int64(sb), np.int64(ss), np.int64(sh)


def run(plan: Plan, q, k, v, o, lse_ptr: int, workspace, softmax_scale: float, stream, device: int):
    """Launch ``plan``. q, k, v, o are views (arrays.View); ``workspace`` is the pair of device
    pointers (fp32 partial O, fp32 partial LSE) when the plan splits, else None."""
    p = plan.problem
    ngroups = p.nheads // p.nheads_k
    i32 = np.int32
    qs = _strides(q, plan.pack_gqa, ngroups)
    os_ = _strides(o, plan.pack_gqa, ngroups)
    common = (*qs, *_strides(k, False, 1), *_strides(v, False, 1))
    shape = (i32(plan.seqlen_q_eff), i32(p.seqlen_k), i32(plan.nheads_eff), i32(plan.ngroups_eff),
             i32(p.head_dim), np.float32(softmax_scale * _LOG2E))

    main = plan.launches[0]
    fn = compiler.get_kernel(main.variant, device)
    if plan.num_splits == 1 and main.variant.kind == "fwd":
        args = (q.ptr, k.ptr, v.ptr, o.ptr, lse_ptr, *common, *os_, *shape, i32(1), i32(0))
        fn(main.grid, (main.threads,), args, shared_mem=main.smem, stream=stream)
        return
    o_acc_ptr, lse_acc_ptr = workspace
    zero = np.int64(0)
    args = (q.ptr, k.ptr, v.ptr, o_acc_ptr, lse_acc_ptr, *common, zero, zero, zero, *shape,
            i32(plan.num_splits), i32(plan.n_blocks_per_split))
    fn(main.grid, (main.threads,), args, shared_mem=main.smem, stream=stream)
    comb = plan.launches[1]
    rows = p.batch * plan.nheads_eff * plan.seqlen_q_eff
    args = (o_acc_ptr, lse_acc_ptr, o.ptr, lse_ptr, *os_, i32(rows), i32(plan.nheads_eff),
            i32(plan.seqlen_q_eff), i32(p.head_dim), i32(plan.num_splits))
    compiler.get_kernel(comb.variant, device)(comb.grid, (comb.threads,), args, stream=stream)
