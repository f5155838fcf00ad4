"""Representative calls of every kernel family with odd shapes, for compute-sanitizer.

    bash scripts/sanitize.sh        # memcheck, racecheck and synccheck over these calls
"""
import numpy as np
import torch

import cuflash


def rnd(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def main():
    torch.manual_seed(0)
    # standard kernel: tails in both sequences, causal with sq > sk, GQA, head dim below the bucket
    for (sq, sk, h, hk, d, causal) in [(113, 203, 4, 2, 64, True), (200, 77, 2, 2, 128, True),
                                       (37, 301, 4, 1, 40, False), (129, 129, 2, 2, 256, True)]:
        cuflash.attention(rnd(2, sq, h, d), rnd(2, sk, hk, d), rnd(2, sk, hk, d), causal=causal, return_lse=True)
    # split-KV + combine, with empty splits; decode tile (GQA packing)
    cuflash.attention(rnd(1, 3, 8, 128), rnd(1, 799, 2, 128), rnd(1, 799, 2, 128), causal=True, num_splits=128)
    cuflash.attention(rnd(2, 1, 28, 128), rnd(2, 339, 4, 128), rnd(2, 339, 4, 128), causal=True)
    cuflash.attention(rnd(1, 1, 8, 64), rnd(1, 5000, 8, 64), rnd(1, 5000, 8, 64), return_lse=True)
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
    torch.cuda.synchronize()
    print("sanitize cases done")


if __name__ == "__main__":
    main()
