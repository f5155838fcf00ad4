"""Representative calls of every kernel family with odd shapes, for compute-sanitizer.

    bash scripts/sanitize.sh        # memcheck, racecheck and synccheck over these calls
    python scripts/sanitize_cases.py flashmask   # the FlashMask calls alone (fp8: the FP8 forward's)
"""
import sys

import numpy as np
import torch

import cuflash


def rnd(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def flashmask():
    """FlashMask (on sm_90 the warp-specialised forward and backward, at every head dim, atomic and
    deterministic; at d = 64 and 128 the windowed walk, at d = 128 atomic the 80-query dQ^T steps):
    skipped, masked and plain blocks, rows with no visible key, GQA."""
    from cuflash import masks
    from cuflash.backward import attention_backward as fm_backward
    for d, causal, x in ((64, True, masks.causal_document([300, 20, 380], batch=2)),
                         (128, False, masks.global_sliding_window(700, 9, 100, batch=2)),
                         (128, True, masks.share_question([[300, 200, 100], [60, 40]], batch=2)),
                         (256, True, masks.qk_sparse(700, [(100, 50), (500, 30)], batch=2))):
        q, k, v, idx = rnd(2, 700, 4, d), rnd(2, 700, 2, d), rnd(2, 700, 2, d), torch.from_numpy(x).cuda()
        o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, startend_row_indices=idx)
        for det in (False, True):  # atomic dQ; the ordered dQ writer, skipped tiles taking no turn
            fm_backward(torch.randn_like(o), q, k, v, o, lse, causal=causal, startend_row_indices=idx,
                        deterministic=det)
    # persistent forward blocks taking several query tiles each (288 tiles), walks of one block and
    # empty walks (rows from 500 see no key, rows below 128 one block)
    x = np.full((2, 1, 1100, 1), 500, dtype=np.int32)
    q, k, v = rnd(2, 1100, 16, 128), rnd(2, 1100, 16, 128), rnd(2, 1100, 16, 128)
    cuflash.attention(q, k, v, causal=True, startend_row_indices=torch.from_numpy(x).cuda())


def fp8():
    """The FP8 forward (sm_90): every head dim, causal with sq > sk (rows that see no key) and sq < sk,
    tails in both sequences and a V^T whose last group of 32 keys is partly past the keys, GQA,
    descales with a broadcast dim, strided views of a packed qkv."""
    for (b, sq, sk, h, hk, d, causal) in ((2, 300, 211, 4, 2, 64, True), (1, 113, 1000, 6, 2, 128, True),
                                          (2, 129, 70, 2, 1, 256, False), (1, 1100, 1100, 8, 8, 128, True)):
        q, k, v = (rnd(b, s, n, d).to(torch.float8_e4m3fn) for s, n in ((sq, h), (sk, hk), (sk, hk)))
        cuflash.attention(q, k, v, causal=causal, return_lse=True, q_descale=torch.rand(1, hk, device="cuda") + 0.5,
                          v_descale=torch.rand(b, hk, device="cuda") + 0.5)
    qkv = rnd(2, 333, 6, 128).to(torch.float8_e4m3fn)
    cuflash.attention(qkv[:, :, :4], qkv[:, :, 4:5], qkv[:, :, 5:], causal=True)


def main():
    torch.manual_seed(0)
    # standard kernel: tails in both sequences, causal with sq > sk, GQA, head dim below the bucket;
    # on sm_90 the warp-specialised one at d 64 (128- and 192-row tiles, the latter with three
    # K/V stages without a mask over more than 1024 keys), 128 and 256; causal one-tile blocks in
    # the LPT order with a partial last section (d 256, 2048 keys: sections of 8 of 10 pairs)
    for (sq, sk, h, hk, d, causal) in [(113, 203, 4, 2, 64, True), (200, 77, 2, 2, 128, True),
                                       (37, 301, 4, 1, 40, False), (129, 129, 2, 2, 256, True),
                                       (300, 211, 4, 2, 64, False), (2100, 2100, 1, 1, 64, True),
                                       (1200, 1500, 8, 2, 64, False), (2000, 2048, 5, 5, 256, True)]:
        cuflash.attention(rnd(2, sq, h, d), rnd(2, sk, hk, d), rnd(2, sk, hk, d), causal=causal, return_lse=True)
    # persistent fwd_ws blocks: more query tiles than SMs, rows with no key, tiles from the
    # counter and in a fixed order
    if torch.cuda.get_device_capability() == (9, 0):
        from cuflash.kernels import fwd_ws
        for d, causal, dynamic in ((64, False, True), (128, True, True), (128, False, False), (256, True, True),
                                   (256, False, False)):
            fwd_ws.run(rnd(5, 129, 40, d), rnd(5, 100, 8, d), rnd(5, 100, 8, d), causal=causal, return_lse=True,
                       persistent=True, dynamic=dynamic, **fwd_ws.TILES[d])
        # planned: persistent causal blocks in the LPT order (d 64 on the softmax-turn tile, d 256),
        # one-tile causal blocks (d 128), persistent non-causal (d 64)
        for (b, s, h, d, causal) in ((2, 1024, 16, 64, True), (2, 1024, 16, 256, True), (1, 3000, 8, 128, True),
                                     (2, 1024, 16, 64, False)):
            cuflash.attention(rnd(b, s, h, d), rnd(b, s, h, d), rnd(b, s, h, d), causal=causal)
        for d in (64, 128, 256):  # sliding windows: both edges masked, rows that see no key
            fwd_ws.run(rnd(2, 300, 4, d), rnd(2, 500, 2, d), rnd(2, 500, 2, d), return_lse=True,
                       window_size=(70, 10), **fwd_ws.TILES[d])
        # planned with sinks (num_splits=1): persistent causal with rows that see no key, a window
        sinks = torch.rand(8, device="cuda") + 3
        cuflash.attention(rnd(2, 300, 8, 64), rnd(2, 200, 2, 64), rnd(2, 200, 2, 64), causal=True, sinks=sinks,
                          num_splits=1, return_lse=True)
        cuflash.attention(rnd(2, 700, 8, 128), rnd(2, 700, 2, 128), rnd(2, 700, 2, 128), causal=True,
                          window_size=(127, 0), sinks=sinks.bfloat16(), num_splits=1)
    flashmask()
    if torch.cuda.get_device_capability() == (9, 0):
        fp8()
    # split-KV (merge fused into the split kernel), with empty splits; decode tile (GQA packing)
    cuflash.attention(rnd(1, 3, 8, 128), rnd(1, 799, 2, 128), rnd(1, 799, 2, 128), causal=True, num_splits=128)
    cuflash.attention(rnd(2, 1, 28, 128), rnd(2, 339, 4, 128), rnd(2, 339, 4, 128), causal=True)
    cuflash.attention(rnd(1, 1, 8, 64), rnd(1, 5000, 8, 64), rnd(1, 5000, 8, 64), return_lse=True)
    from cuflash import launch  # the separate combine kernel (what runs inside a first capture)
    launch.FUSED_COMBINE = False
    cuflash.attention(rnd(1, 3, 8, 128), rnd(1, 799, 2, 128), rnd(1, 799, 2, 128), causal=True, num_splits=9,
                      return_lse=True)
    launch.FUSED_COMBINE = True
    # KV cache: append + contiguous cache with batch index, and paged cache
    q, kn, vn = rnd(3, 1, 8, 128), rnd(3, 1, 2, 128), rnd(3, 1, 2, 128)
    kc, vc = rnd(5, 300, 2, 128), rnd(5, 300, 2, 128)
    lens = torch.tensor([10, 299, 0], dtype=torch.int32, device="cuda")
    idx = torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda")
    cuflash.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, cache_batch_idx=idx, causal=True)
    pages = torch.from_numpy(np.random.default_rng(0).permutation(60)[:3 * 19].reshape(3, 19).astype(np.int32)).cuda()
    kp, vp = rnd(60, 16, 2, 128), rnd(60, 16, 2, 128)
    cuflash.attention_with_kvcache(q, kp, vp, kn, vn, cache_seqlens=lens, block_table=pages, causal=True,
                                   num_splits=7)
    # fwd_ws on caches (a chunk of 130 new tokens, num_splits=1): contiguous with a batch index and
    # with a leftpad, and paged with 128-row pages (an empty sequence, tails inside a tile)
    q, kn, vn = rnd(3, 130, 8, 128), rnd(3, 130, 2, 128), rnd(3, 130, 2, 128)
    kc, vc = rnd(5, 600, 2, 128), rnd(5, 600, 2, 128)
    lens = torch.tensor([10, 299, 0], dtype=torch.int32, device="cuda")
    cuflash.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, cache_batch_idx=idx, causal=True,
                                   num_splits=1)
    cuflash.attention_with_kvcache(q, kc[:3], vc[:3], kn, vn, cache_seqlens=lens, num_splits=1, return_lse=True,
                                   cache_leftpad=torch.tensor([3, 100, 0], dtype=torch.int32, device="cuda"))
    pages = torch.from_numpy(np.random.default_rng(1).permutation(20)[:3 * 4].reshape(3, 4).astype(np.int32)).cuda()
    kp, vp = rnd(20, 128, 2, 128), rnd(20, 128, 2, 128)
    cuflash.attention_with_kvcache(q, kp, vp, kn, vn, cache_seqlens=lens, block_table=pages, causal=True,
                                   num_splits=1)
    # and with pages of 32 rows (gathered with cp.async on sm_90) and of 64 (two TMA boxes per K/V
    # tile); tails inside a page
    for page, per in ((32, 14), (64, 7)):
        pages = torch.from_numpy(np.random.default_rng(2).permutation(60)[:3 * per].reshape(3, per).astype(np.int32)).cuda()
        kp, vp = rnd(60, page, 2, 128), rnd(60, page, 2, 128)
        cuflash.attention_with_kvcache(q, kp, vp, kn, vn, cache_seqlens=lens, block_table=pages, causal=True,
                                       num_splits=1)
    # sliding window + softcap + ALiBi (standard, split and decode tiles)
    slopes = torch.rand(4, device="cuda")
    cuflash.attention(rnd(2, 113, 4, 64), rnd(2, 203, 2, 64), rnd(2, 203, 2, 64), causal=True,
                      window_size=(37, 0), softcap=30.0, alibi_slopes=slopes, return_lse=True)
    cuflash.attention(rnd(1, 1, 4, 128), rnd(1, 3000, 2, 128), rnd(1, 3000, 2, 128), window_size=(500, 20),
                      softcap=30.0, alibi_slopes=slopes)
    cuflash.attention(rnd(1, 5, 4, 64), rnd(1, 700, 4, 64), rnd(1, 700, 4, 64), window_size=(50, 50),
                      num_splits=9)
    # varlen: empty and length-1 sequences, dense (GQA) and paged, packed decode through split-KV
    cu_q = torch.tensor([0, 113, 113, 114, 200], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 203, 210, 210, 500], dtype=torch.int32, device="cuda")
    cuflash.attention_varlen(rnd(200, 8, 64), rnd(500, 2, 64), rnd(500, 2, 64), cu_q, cu_k, 113, 290,
                             causal=True, return_lse=True)
    cuflash.attention_varlen(rnd(200, 8, 40), rnd(500, 2, 40), rnd(500, 2, 40), cu_q, cu_k, 113, 290,
                             window_size=(20, 5), alibi_slopes=torch.rand(4, 8, device="cuda"), num_splits=5)
    # fwd_ws (num_splits=1: no split-KV) on packed sequences with softcap and ALiBi: empty and
    # length-1 sequences, blocks past a sequence's end, tiles holding the next sequence's keys
    for d in (64, 128, 256):
        cuflash.attention_varlen(rnd(200, 8, d), rnd(500, 2, d), rnd(500, 2, d), cu_q, cu_k, 113, 290, causal=True,
                                 softcap=30.0, alibi_slopes=torch.rand(8, device="cuda"), num_splits=1,
                                 return_lse=True)
    cu_1 = torch.tensor([0, 1, 1, 2], dtype=torch.int32, device="cuda")
    cu_k1 = torch.tensor([0, 0, 300, 1500], dtype=torch.int32, device="cuda")
    cuflash.attention_varlen(rnd(2, 28, 128), rnd(1500, 4, 128), rnd(1500, 4, 128), cu_1, cu_k1, 1, 1200,
                             causal=True, return_lse=True)
    table = pages[:, :8].contiguous()
    cu_3 = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device="cuda")
    cu_kp = torch.tensor([0, 100, 100, 228], dtype=torch.int32, device="cuda")
    cuflash.attention_varlen(rnd(3, 8, 128), kp, vp, cu_3, cu_kp, 1, 128, causal=True, block_table=table)
    # backward: atomic and deterministic, GQA, causal tails
    from cuflash.backward import attention_backward
    for det in (False, True):
        q, k, v = rnd(2, 113, 4, 64), rnd(2, 203, 2, 64), rnd(2, 203, 2, 64)
        o, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
        attention_backward(torch.randn_like(o), q, k, v, o, lse, causal=True, deterministic=det)
        q, k, v = rnd(1, 77, 2, 128), rnd(1, 77, 2, 128), rnd(1, 77, 2, 128)
        o, lse = cuflash.attention(q, k, v, return_lse=True)
        attention_backward(torch.randn_like(o), q, k, v, o, lse, deterministic=det)
    # the warp-specialised backward (planned on sm_90 for the dense d = 64 / 128 calls above): many
    # steps through both Q/dO stages and both dS^T tiles, a window, and the unplanned dQ variants;
    # at d = 256 both parities' P^T and dS^T tiles, with a key tail; at d = 128 deterministic, the
    # dQ writer's ordered adds (semaphores), key blocks from the last (causal, window) or the first;
    # deterministic without a mask in runs of key blocks (uneven: 5 over 4 runs at d = 256, 3 over 2
    # at d = 64, which take the spread order; 6 over 2 at d = 128), a run's first adds storing
    for d, sk in ((256, 300), (64, 300), (128, 650)):  # d = 128 last: the dQ variants below use its tensors
        q, k, v = rnd(1, 700, 8, d), rnd(1, sk, 2, d), rnd(1, 700, 8, d)[:, :sk, :2]
        for mods in (dict(causal=True), dict(window_size=(100, 20)), dict()):
            o, lse = cuflash.attention(q, k, v, return_lse=True, **mods)
            for det in (False, True):
                attention_backward(torch.randn_like(o), q, k, v, o, lse, deterministic=det, **mods)
    # d = 256 deterministic with a window that leaves most key blocks with no query (blocks of no
    # step: the turn warps take none)
    wq, wk, wv = rnd(2, 64, 2, 256), rnd(2, 700, 2, 256), rnd(2, 700, 2, 256)
    o, lse = cuflash.attention(wq, wk, wv, window_size=(16, 0), return_lse=True)
    attention_backward(torch.randn_like(o), wq, wk, wv, o, lse, window_size=(16, 0), deterministic=True)
    if torch.cuda.get_device_capability() == (9, 0):
        import dataclasses
        import importlib
        plan = importlib.import_module("cuflash.plan")
        planned = plan.bwd_ws.planned
        # planned: 80-query steps (dq_t) with writer + early, rotated walks (atomic); these take
        # 64-query steps
        for e, w, o, r in ((False, False, False, True), (True, False, False, False), (False, True, True, False),
                           (True, True, False, True)):
            flags = dict(dq_early=e, dq_writer=w, dq_ordered=o, rotate=r, dq_t=False)
            plan.bwd_ws.planned = lambda *a, f=flags: dataclasses.replace(planned(*a), **f)
            plan.forget_plans()
            o, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
            attention_backward(torch.randn_like(o), q, k, v, o, lse, causal=True)
        # the planned variants with their causal key blocks launched longest first (planned from
        # 2048 keys): d = 128, and d = 64 with GQA (4 query heads per KV head, where it is planned
        # at d = 64), whose producer re-reads the batch and its first stats row
        plan.bwd_ws.planned = lambda *a: dataclasses.replace(planned(*a), lpt=True)
        plan.forget_plans()
        for q, k, v in ((q, k, v), (rnd(2, 300, 8, 64), rnd(2, 300, 2, 64), rnd(2, 300, 2, 64))):
            o, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
            attention_backward(torch.randn_like(o), q, k, v, o, lse, causal=True)
        plan.bwd_ws.planned = planned
        plan.forget_plans()
    # backward with a window, softcap and ALiBi; varlen backward with empty and length-1 sequences
    from cuflash.backward import attention_varlen_backward
    q, k, v = rnd(2, 113, 4, 64), rnd(2, 203, 2, 64), rnd(2, 203, 2, 64)
    mods = dict(causal=True, window_size=(37, 0), softcap=30.0, alibi_slopes=torch.rand(4, device="cuda"))
    o, lse = cuflash.attention(q, k, v, return_lse=True, **mods)
    for det in (False, True):
        attention_backward(torch.randn_like(o), q, k, v, o, lse, deterministic=det, **mods)
    # the same on bwd_ws (d = 128: softcap and ALiBi together; d = 256: the split head dim)
    for d in (128, 256):
        q, k, v = rnd(2, 113, 4, d), rnd(2, 203, 2, d), rnd(2, 203, 2, d)
        o, lse = cuflash.attention(q, k, v, return_lse=True, **mods)
        for det in (False, True):
            attention_backward(torch.randn_like(o), q, k, v, o, lse, deterministic=det, **mods)
    # ALiBi alone at d = 128: 80-query steps (dq_t)
    alibi = dict(causal=True, alibi_slopes=mods["alibi_slopes"])
    q, k, v = rnd(2, 113, 4, 128), rnd(2, 203, 2, 128), rnd(2, 203, 2, 128)
    o, lse = cuflash.attention(q, k, v, return_lse=True, **alibi)
    for det in (False, True):
        attention_backward(torch.randn_like(o), q, k, v, o, lse, deterministic=det, **alibi)
    # (bwd_ws zeroes the tail tiles' rows of the next sequence; d = 256: the split head dim)
    for d in (64, 128, 256):
        q, k, v = rnd(200, 8, d), rnd(500, 2, d), rnd(500, 2, d)
        o, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, 113, 290, causal=True, return_lse=True)
        for det in (False, True):
            attention_varlen_backward(torch.randn_like(o), q, k, v, o, lse, cu_q, cu_k, 113, 290, causal=True,
                                      deterministic=det)
    # dropout: forward (mma.sync at d=40 and wgmma at d=128 on sm_90) and the mma.sync backward
    import cuflash.torch as ct
    for d in (40, 128):
        q, k, v = (rnd(2, 150, 4, d).requires_grad_() for _ in range(3))
        ct.attention(q, k, v, causal=True, dropout_p=0.17).backward(rnd(2, 150, 4, d))
    # varlen with a head dim that is not a multiple of 8 (padded copies)
    cuflash.attention_varlen(rnd(200, 8, 60), rnd(500, 2, 60), rnd(500, 2, 60), cu_q, cu_k, 113, 290, causal=True)
    torch.cuda.synchronize()
    print("sanitize cases done")


if __name__ == "__main__":
    if sys.argv[1:] in (["flashmask"], ["fp8"]):  # that part alone
        torch.manual_seed(0)
        {"flashmask": flashmask, "fp8": fp8}[sys.argv[1]]()
        torch.cuda.synchronize()
        print(f"sanitize cases done ({sys.argv[1]})")
    else:
        main()
