// Merging split-KV partials by log-sum-exp: the split kernel's fused merge and the combine kernel.
// Other blocks wrote the partials: loads go through L2 (ld.global.cg), never a stale L1 line.
__device__ __forceinline__ float ld_cg(const float* p) {
  float x;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(x) : "l"(p));
  return x;
}
__device__ __forceinline__ float4 ld_cg4(const float* p) {
  float4 x;
  asm volatile("ld.global.cg.v4.f32 { %0, %1, %2, %3 }, [%4];" : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w) : "l"(p));
  return x;
}

// Merge `rows` consecutive partial rows with all kThreads threads of the block. Row r of split s
// has its LSE at lse_acc[r + s * split_stride] and its O (normalised by its own sum; kCols fp32
// columns a row, the head-dim bucket) at o_acc[(r + s * split_stride) * kCols + c]. Writes O =
// sum_s exp(lse_s - lse) O_s in bf16 (kBF16) or fp16, columns below head_dim only unless kEven,
// and lse = log(sum_s exp(lse_s)) (+inf when every split is empty, O then 0) where dest(r, &out,
// &lse_out) points (false: row r does not exist; lse_out may be null). Each thread owns four
// columns of a row and loads kMergeBatch splits' LSEs and partials before using any (one L2 round
// trip per batch, not one per split), merging batches online like the softmax.
template <int kThreads, int kCols, bool kBF16, bool kEven, class Dest>
__device__ __forceinline__ void merge_rows(const float* lse_acc, const float* o_acc, long long split_stride,
                                           int num_splits, int head_dim, int rows, Dest dest) {
  constexpr int kQuads = kCols / 4;
  constexpr int kMergeBatch = 16;  // splits whose partials one thread has in flight at once
  for (int item = threadIdx.x; item < rows * kQuads; item += kThreads) {
    const int r = item / kQuads, c = item % kQuads * 4;
    u16* out;
    float* lse_out;
    if (!dest(r, &out, &lse_out) || (!kEven && c >= head_dim)) continue;
    float m = neg_inf(), l = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    const float* pl = lse_acc + r;             // split s0's LSE and partial columns; both step
    const float* po = o_acc + (long long)r * kCols + c;  // by one split per load
    const long long po_step = split_stride * kCols;
    for (int s0 = 0; s0 < num_splits; s0 += kMergeBatch) {
      float ls[kMergeBatch];
      float4 x[kMergeBatch];
#pragma unroll
      for (int j = 0; j < kMergeBatch; ++j) {
        const bool ok = s0 + j < num_splits;
        ls[j] = ok ? ld_cg(pl) : neg_inf();
        x[j] = ok ? ld_cg4(po) : make_float4(0.f, 0.f, 0.f, 0.f);
        pl += split_stride;
        po += po_step;
      }
      float mx = m;
#pragma unroll
      for (int j = 0; j < kMergeBatch; ++j) mx = fmaxf(mx, ls[j]);
      const float m_use = mx == neg_inf() ? 0.f : mx;
      const float alpha = __expf(m - m_use);
      l *= alpha;
      acc.x *= alpha, acc.y *= alpha, acc.z *= alpha, acc.w *= alpha;
#pragma unroll
      for (int j = 0; j < kMergeBatch; ++j) {
        const float w = __expf(ls[j] - m_use);
        l += w;
        acc.x += w * x[j].x, acc.y += w * x[j].y, acc.z += w * x[j].z, acc.w += w * x[j].w;
      }
      m = mx;
    }
    const float inv = l == 0.f ? 0.f : 1.f / l;
    *reinterpret_cast<uint2*>(out + c) =
        make_uint2(pack2<kBF16>(acc.x * inv, acc.y * inv), pack2<kBF16>(acc.z * inv, acc.w * inv));
    if (c == 0 && lse_out != nullptr) *lse_out = l == 0.f ? pos_inf() : __logf(l) + m;
  }
}
