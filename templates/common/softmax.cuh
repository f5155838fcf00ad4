// Online softmax in the exp2 domain with the scale folded in (c = softmax_scale * log2(e) > 0):
// m = max(m, c * max_j s_j), p_j = exp2(c * s_j - m) as one FFMA and one MUFU per score.
// A row's values live in the 4 lanes of a quad; reduce with xor-shuffles 1 and 2.

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// The running maximum of row-half r (row g or g+8) of one 16-row tile once these scores are
// seen, in the exp2 domain: max(row_m, c * max_j s_j). A tree (depth log2(kNT) + 1 rather than a
// chain of kNT), as the exponentials wait for it.
template <int kNT>
__device__ __forceinline__ float softmax_max(const float (&s)[kNT][4], int r, float c, float row_m) {
  float mx[kNT];
#pragma unroll
  for (int j = 0; j < kNT; ++j) mx[j] = fmaxf(s[j][2 * r], s[j][2 * r + 1]);
#pragma unroll
  for (int w = 1; w < kNT; w *= 2)
#pragma unroll
    for (int j = 0; j + w < kNT; j += 2 * w) mx[j] = fmaxf(mx[j], mx[j + w]);
  return fmaxf(row_m, quad_max(mx[0]) * c);
}

// Take the new running maximum m_new (softmax_max) of row-half r: exponentiate the scores in
// place, rescale the running sum (kept per lane, reduced at the end) and return the factor by
// which the output accumulator must be rescaled.
template <int kNT>
__device__ __forceinline__ float softmax_exp(float (&s)[kNT][4], int r, float c, float m_new, float& row_m,
                                             float& row_l) {
  // A row that has seen only masked keys keeps m = -inf; subtract 0 instead so exp2 gives 0.
  const float m_use = m_new == neg_inf() ? 0.f : m_new;
  const float alpha = exp2_approx(row_m - m_use);
  row_m = m_new;
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
    s[j][2 * r] = exp2_approx(fmaf(s[j][2 * r], c, -m_use));
    s[j][2 * r + 1] = exp2_approx(fmaf(s[j][2 * r + 1], c, -m_use));
    sum += s[j][2 * r] + s[j][2 * r + 1];
  }
  row_l = row_l * alpha + sum;
  return alpha;
}

// Both steps for row-half r: returns the output accumulator's rescale factor.
template <int kNT>
__device__ __forceinline__ float softmax_rescale(float (&s)[kNT][4], int r, float c, float& row_m, float& row_l) {
  return softmax_exp<kNT>(s, r, c, softmax_max<kNT>(s, r, c, row_m), row_m, row_l);
}
