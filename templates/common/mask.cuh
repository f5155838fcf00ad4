// Masks and score modifiers applied to a warp's S fragment (kNT n8-tiles of one 16-row tile).
// Fragment layout: lane holds rows (lane >> 2) and (lane >> 2) + 8 (row-half r), columns
// j * 8 + (lane & 3) * 2 + e of n8-tile j, at s[j][2 * r + e].

// The first key of the chunk that holds key position `pos` (chunked attention; floor division:
// pos is negative for the first rows when seqlen_q > seqlen_k).
__device__ __forceinline__ int chunk_start(int pos, int chunk) {
  const int q = pos >= 0 ? pos / chunk : -((chunk - 1 - pos) / chunk);
  return q * chunk;
}

// Key `col` is visible to query `row` iff col < seqlen_k, col <= row + diag (bottom-right causal
// or a window's right edge; without one diag is large and the min is a no-op) and, with kLower,
// col >= row + diag_lo (a window's left edge) and, with chunk > 0 (chunked attention), col lies in
// the `chunk` keys from chunk_start(row + off). Per row-half the visible columns of this tile form
// one interval, so each lane compares its compile-time column offsets against two limits.
// ``row_step`` 0: every row of the fragment is row0 (query heads packed as rows of one query).
template <int kNT, bool kLower>
__device__ __forceinline__ void apply_mask(float (&s)[kNT][4], int row0, int col0, int seqlen_k, int diag,
                                           int diag_lo, int chunk = 0, int off = 0, int row_step = 1) {
  const int lane = threadIdx.x & 31;
  const int c0 = col0 + (lane & 3) * 2;  // this lane's first column
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + ((lane >> 2) + r * 8) * row_step;
    int limit = min(seqlen_k, row + diag + 1) - c0;  // visible iff j * 8 + e < limit
    int lower = row + diag_lo - c0;                  // and, with kLower, >= lower
    if (kLower && chunk > 0) {
      const int start = chunk_start(row + off, chunk) - c0;
      limit = min(limit, start + chunk);
      lower = max(lower, start);
    }
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (j * 8 + e >= limit || (kLower && j * 8 + e < lower)) s[j][2 * r + e] = neg_inf();
  }
}

// tanh(x) = 1 - 2 / (e^(2x) + 1): one MUFU.EX2, one fast reciprocal; absolute error ~1e-7
// (tanh.approx.f32 has a relative error of 2^-11, visible in softcapped logits).
__device__ __forceinline__ float tanh_fast(float x) {
  return 1.f - __fdividef(2.f, exp2_approx(x * 2.8853900817779268f) + 1.f);
}

// Softcap: s -> tanh(s * scale / softcap). The softmax then scales by softcap (and log2 e), so
// the scores it sees are softcap * tanh(scale * s / softcap).
template <int kNT>
__device__ __forceinline__ void apply_softcap(float (&s)[kNT][4], float softcap_scale) {
#pragma unroll
  for (int j = 0; j < kNT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = tanh_fast(s[j][e] * softcap_scale);
}

// ALiBi: s -= slope * |row + seqlen_k - seqlen_q - col|, with `pos0` = row0 + seqlen_k - seqlen_q
// (the key aligned with the fragment's first row) and the slope already divided by the factor
// the softmax multiplies the raw scores by.
template <int kNT>
__device__ __forceinline__ void apply_alibi(float (&s)[kNT][4], int pos0, int col0, float slope) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float base = static_cast<float>(pos0 + (lane >> 2) + r * 8 - col0 - (lane & 3) * 2);
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) s[j][2 * r + e] -= slope * fabsf(base - static_cast<float>(j * 8 + e));
  }
}
