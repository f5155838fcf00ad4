"""attention_with_kvcache rejects bad input before anything is allocated, written or launched
(no GPU needed: hand-made device views stand in for arrays)."""
import numpy as np
import pytest

import cuflash
from conftest import fake_view


def dev(shape, dtype="float16", device=0, strides=None, ptr=1 << 20):
    return fake_view(device, shape, dtype, strides, ptr)


@pytest.fixture(autouse=True)
def views(fake_views):
    """Every test here runs on hand-made device views."""


B, D = 2, 64
Q = (B, 1, 8, D)
CACHE = (B, 128, 2, D)
NEW = (B, 1, 2, D)
PAGED = (20, 16, 2, D)
TABLE = (B, 8)

CASES = {
    "cache_rank": (dict(k_cache=dev((B, 128, 2)), v_cache=dev((B, 128, 2))), ValueError, ["k_cache", "4 dims"]),
    "cache_dtype": (dict(k_cache=dev(CACHE, "bfloat16"), v_cache=dev(CACHE, "bfloat16")), TypeError, ["k_cache", "float16", "bfloat16"]),
    "v_cache_shape": (dict(v_cache=dev((B, 64, 2, D))), ValueError, ["v_cache", "k_cache's shape"]),
    "unaligned_cache": (dict(k_cache=dev(CACHE, ptr=(1 << 20) + 2)), ValueError, ["k_cache", "16-byte aligned"]),
    "cache_batch_without_idx": (dict(k_cache=dev((B + 1, 128, 2, D)), v_cache=dev((B + 1, 128, 2, D))), ValueError, ["k_cache", "batch size 2", "cache_batch_idx"]),
    "k_without_v": (dict(k=dev(NEW), cache_seqlens=3), ValueError, ["k and v must be given together"]),
    "new_k_shape": (dict(k=dev((B, 1, 4, D)), v=dev((B, 1, 4, D)), cache_seqlens=3), ValueError, ["k must be", "(2, 1, 2, 64)"]),
    "new_k_dtype": (dict(k=dev(NEW, "bfloat16"), v=dev(NEW, "bfloat16"), cache_seqlens=3), ValueError, ["k must be float16"]),
    "append_needs_seqlens": (dict(k=dev(NEW), v=dev(NEW)), ValueError, ["cache_seqlens is required"]),
    "seqlens_overflow": (dict(k=dev(NEW), v=dev(NEW), cache_seqlens=128), ValueError, ["must fit the cache", "128 + 1", "128"]),
    "seqlens_negative": (dict(cache_seqlens=-1), ValueError, ["cache_seqlens must be >= 0", "-1"]),
    "seqlens_dtype": (dict(cache_seqlens=dev((B,), "int64")), TypeError, ["cache_seqlens must be int32", "int64"]),
    "seqlens_shape": (dict(cache_seqlens=dev((B + 1,), "int32")), ValueError, ["cache_seqlens", "(2,)", "(3,)"]),
    "rotary_seqlens_dtype": (dict(rotary_seqlens=dev((B,), "int64")), TypeError, ["rotary_seqlens must be int32", "int64"]),
    "rotary_seqlens_shape": (dict(rotary_seqlens=dev((B + 1,), "int32")), ValueError, ["rotary_seqlens", "(2,)", "(3,)"]),
    "cu_new_without_k": (dict(cu_seqlens_k_new=dev((B + 1,), "int32"), cache_seqlens=3), ValueError, ["cu_seqlens_k_new needs new k and v"]),
    "cu_new_dtype": (dict(k=dev((5, 2, D)), v=dev((5, 2, D)), cu_seqlens_k_new=dev((B + 1,), "int64"), cache_seqlens=3), TypeError, ["cu_seqlens_k_new must be int32"]),
    "cu_new_shape": (dict(k=dev((5, 2, D)), v=dev((5, 2, D)), cu_seqlens_k_new=dev((B,), "int32"), cache_seqlens=3), ValueError, ["cu_seqlens_k_new must have shape (batch + 1,) = (3,)", "(2,)"]),
    "cu_new_dense_k": (dict(k=dev(NEW), v=dev(NEW), cu_seqlens_k_new=dev((B + 1,), "int32"), cache_seqlens=3), ValueError, ["k must be float16 of shape (total_new, nheads_k, d)"]),
    "batch_idx_dtype": (dict(k_cache=dev((4, 128, 2, D)), v_cache=dev((4, 128, 2, D)), cache_batch_idx=dev((B,), "int64")), TypeError, ["cache_batch_idx must be int32"]),
    "table_dtype": (dict(k_cache=dev(PAGED), v_cache=dev(PAGED), block_table=dev(TABLE, "int64")), ValueError, ["block_table must be int32", "int64"]),
    "table_shape": (dict(k_cache=dev(PAGED), v_cache=dev(PAGED), block_table=dev((B + 1, 8), "int32")), ValueError, ["block_table", "(2, pages_per_seq)", "(3, 8)"]),
    "table_not_contiguous": (dict(k_cache=dev(PAGED), v_cache=dev(PAGED), block_table=dev(TABLE, "int32", strides=(1, 2))), ValueError, ["block_table rows must be contiguous"]),
    "page_size": (dict(k_cache=dev((20, 0, 2, D)), v_cache=dev((20, 0, 2, D)), block_table=dev(TABLE, "int32")), ValueError, ["page size", "must be positive", "0"]),
    "idx_with_table": (dict(k_cache=dev(PAGED), v_cache=dev(PAGED), block_table=dev(TABLE, "int32"), cache_batch_idx=dev((B,), "int32")), ValueError, ["cache_batch_idx cannot be combined with block_table"]),
    "scale": (dict(softmax_scale=0.0), ValueError, ["softmax_scale", "positive"]),
    "causal": (dict(causal="yes"), TypeError, ["causal must be a bool"]),
    "num_splits": (dict(num_splits=129), ValueError, ["num_splits", "129"]),
    "out_shape": (dict(out=dev((B, 2, 8, D))), ValueError, ["out must have q's shape"]),
    "out_unaligned": (dict(out=dev(Q, ptr=(1 << 20) + 4)), ValueError, ["out must be 16-byte aligned"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kvcache_rejects(case):
    kw, exc, fragments = CASES[case]
    args = dict(q=dev(Q), k_cache=dev(CACHE), v_cache=dev(CACHE))
    args.update(kw)
    q, kc, vc = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    with pytest.raises(exc) as ei:
        cuflash.attention_with_kvcache(q, kc, vc, **args)
    for frag in fragments:
        assert frag in str(ei.value), (frag, str(ei.value))


def test_kvcache_rejects_host_arrays(monkeypatch):
    monkeypatch.undo()  # real views: NumPy arrays live in host memory
    q = np.zeros(Q, np.float16)
    c = np.zeros(CACHE, np.float16)
    with pytest.raises(TypeError, match="device arrays"):
        cuflash.attention_with_kvcache(q, c, c)
