// Masks applied to a warp's S fragment (kNT n8-tiles of one 16-row tile).
// Key `col` is visible to query `row` iff col < seqlen_k and, when causal (aligned bottom-right),
// col <= row + seqlen_k - seqlen_q.
template <int kNT>
__device__ __forceinline__ void apply_mask(float (&s)[kNT][4], int row0, int col0, int seqlen_k, int diag) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = row0 + (lane >> 2) + (e >> 1) * 8;
      const int col = col0 + j * 8 + (lane & 3) * 2 + (e & 1);
      bool visible = col < seqlen_k;
      if constexpr (kIsCausal) visible = visible && col <= row + diag;
      if (!visible) s[j][e] = neg_inf();
    }
  }
}
