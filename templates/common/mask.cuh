// Masks applied to a warp's S fragment (kNT n8-tiles of one 16-row tile).
// Key `col` is visible to query `row` iff col < seqlen_k and, when causal (aligned bottom-right),
// col <= row + seqlen_k - seqlen_q. Per row-half the visible columns of this tile form a prefix,
// so each lane compares its compile-time column offsets against one limit.
template <int kNT>
__device__ __forceinline__ void apply_mask(float (&s)[kNT][4], int row0, int col0, int seqlen_k, int diag) {
  const int lane = threadIdx.x & 31;
  const int c0 = col0 + (lane & 3) * 2;  // this lane's first column
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    // visible iff j * 8 + e < limit; without causality diag is large and the min is a no-op
    const int limit = min(seqlen_k, row0 + (lane >> 2) + r * 8 + diag + 1) - c0;
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (j * 8 + e >= limit) s[j][2 * r + e] = neg_inf();
  }
}
