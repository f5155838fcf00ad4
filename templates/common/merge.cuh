// Merging split-KV partials by log-sum-exp: the split kernel's fused merge and the combine kernel.
// Other blocks wrote the partials: loads go through L2 (ld.global.cg), never a stale L1 line.
__device__ __forceinline__ float ld_cg(const float* p) {
  float x;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(x) : "l"(p));
  return x;
}
__device__ __forceinline__ float2 ld_cg2(const float* p) {
  float2 x;
  asm volatile("ld.global.cg.v2.f32 { %0, %1 }, [%2];" : "=f"(x.x), "=f"(x.y) : "l"(p));
  return x;
}

constexpr int kMergeSplitsPerLane = 4;  // up to 128 splits (cuflash.plan.MAX_SPLITS)

// One output row, by one warp. Split s has its LSE at lse_acc[s * split_stride] and its O
// (normalised by its own sum) at o_acc[s * split_stride * kHeadDim + c]. Writes
// O = sum_s exp(lse_s - lse) O_s to out[0 .. head_dim) and returns lse = log(sum_s exp(lse_s))
// (+inf when every split is empty, O then 0). Each lane keeps its splits' LSEs and weights in
// registers (one round of loads), and the partial rows are read eight splits at a time.
template <bool kEven>
__device__ float merge_row(const float* lse_acc, const float* o_acc, long long split_stride,
                           int num_splits, int head_dim, u16* out) {
  const int lane = threadIdx.x & 31;
  float w[kMergeSplitsPerLane];
  float mx = neg_inf();
#pragma unroll
  for (int c = 0; c < kMergeSplitsPerLane; ++c) {
    const int s = c * 32 + lane;
    w[c] = s < num_splits ? ld_cg(lse_acc + s * split_stride) : neg_inf();
    mx = fmaxf(mx, w[c]);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, off));
  const float m_use = mx == neg_inf() ? 0.f : mx;
  float sum = 0.f;
#pragma unroll
  for (int c = 0; c < kMergeSplitsPerLane; ++c) sum += __expf(w[c] - m_use);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, off);
  const float row_lse = sum == 0.f ? pos_inf() : __logf(sum) + m_use;
#pragma unroll
  for (int c = 0; c < kMergeSplitsPerLane; ++c) w[c] = sum == 0.f ? 0.f : __expf(w[c] - row_lse);

  constexpr int kPairs = (kHeadDim + 63) / 64;  // column pairs per lane
  float acc[kPairs][2];
#pragma unroll
  for (int j = 0; j < kPairs; ++j) acc[j][0] = acc[j][1] = 0.f;
#pragma unroll
  for (int c = 0; c < kMergeSplitsPerLane; ++c) {
    const int n = min(32, num_splits - c * 32);  // the same for the whole warp
    if (n <= 0) break;
    const float* part = o_acc + (long long)c * 32 * split_stride * kHeadDim;
#pragma unroll 8
    for (int t = 0; t < n; ++t) {
      const float ws = __shfl_sync(0xffffffff, w[c], t);
#pragma unroll
      for (int j = 0; j < kPairs; ++j) {
        const int col = j * 64 + lane * 2;
        if (col < kHeadDim && (kEven || col < head_dim)) {
          const float2 x = ld_cg2(part + t * split_stride * kHeadDim + col);
          acc[j][0] += ws * x.x;
          acc[j][1] += ws * x.y;
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    const int col = j * 64 + lane * 2;
    if (col < kHeadDim && (kEven || col < head_dim)) *reinterpret_cast<u32*>(out + col) = pack2(acc[j][0], acc[j][1]);
  }
  return row_lse;
}
