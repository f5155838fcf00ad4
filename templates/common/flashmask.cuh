// FlashMask (cuflash.masks): per key column j, n int32 row bounds; query row i is masked when
//   causal, n = 1:  i >= LTS              causal, n = 2:  LTS <= i < LTE
//   n = 2:          i >= LTS or i < UTE   n = 4:          LTS <= i < LTE or UTS <= i < UTE
// (the causal mask itself is apply_mask's). Needs types.cuh (neg_inf).

enum : int { kFmSkip = 0, kFmMasked = 1, kFmPlain = 2 };

// The class of the tile of query rows [r0, r1) against one key block, from the block's min and
// max of each column (blk[2c], blk[2c + 1], kernels/flashmask.py): kFmSkip when one interval
// holds every row for every key (r0 >= max start, r1 <= min end), kFmPlain when no interval
// reaches any row (r0 >= max end or r1 <= min start for each), else kFmMasked.
template <int kN, bool kCausal>
__device__ __forceinline__ int flashmask_class(const int* __restrict__ blk, int r0, int r1, int seqlen_q) {
  bool full = false, part = false;
  auto interval = [&](int s_min, int s_max, int e_min, int e_max) {
    full |= r0 >= s_max && r1 <= e_min;
    part |= r0 < e_max && r1 > s_min;
  };
  if constexpr (kCausal && kN == 1) {
    interval(blk[0], blk[1], seqlen_q, seqlen_q);
  } else if constexpr (kCausal || kN == 4) {
    interval(blk[0], blk[1], blk[2], blk[3]);
    if constexpr (kN == 4) interval(blk[4], blk[5], blk[6], blk[7]);
  } else {
    interval(blk[0], blk[1], seqlen_q, seqlen_q);
    interval(0, 0, blk[2], blk[3]);
  }
  return full ? kFmSkip : (part ? kFmMasked : kFmPlain);
}

// The element rule: query row `row` is masked by a column whose bounds are a0 .. a3 (the first
// kN of them are read).
template <int kN, bool kCausal>
__device__ __forceinline__ bool flashmask_hides(int row, int a0, int a1, int a2, int a3) {
  if constexpr (kCausal) return row >= a0 && (kN == 1 || row < a1);
  else if constexpr (kN == 2) return row >= a0 || row < a1;
  else return (row >= a0 && row < a1) || (row >= a2 && row < a3);
}

// Whether column bounds can be read as vectors: each column's kN bounds contiguous (sc = 1),
// columns adjacent (ss = kN), the first column 8 * kN bytes aligned (so a column's kN > 1
// bounds are one 8- or 16-byte load).
template <int kN>
__device__ __forceinline__ bool flashmask_vector(const int* idx, long long ss, long long sc) {
  return sc == 1 && ss == kN && (reinterpret_cast<unsigned long long>(idx) & (kN == 1 ? 7 : 15)) == 0;
}

// The bounds of keys key0 .. key0 + kBlockN - 1 (bound b of key j at idx[j * ss + b * sc]) into
// shared memory at the 32-bit shared address sm, kN ints per key (key key0 + c's at sm + 4 kN c),
// by the calling warp's 32 lanes with 4-byte cp.async (keys >= seqlen_k zero-filled); each lane
// waits for its own copies (an arrival on an mbarrier afterwards publishes them).
template <int kBlockN, int kN>
__device__ __forceinline__ void flashmask_stage(u32 sm, const int* __restrict__ idx, long long ss, long long sc,
                                                int key0, int seqlen_k) {
  static_assert(32 % kN == 0, "a lane copies the same bound column of every key it copies");
  constexpr int kKeysPerStep = 32 / kN;
  const int lane = threadIdx.x & 31;
  int key = key0 + lane / kN;  // element lane + 32 t: key key0 + lane / kN + kKeysPerStep t, column lane % kN
  const int* src = idx + key * ss + (lane % kN) * sc;
  u32 dst = sm + 4 * lane;
#pragma unroll
  for (int t = 0; t < (kBlockN + kKeysPerStep - 1) / kKeysPerStep; ++t) {
    if (kBlockN % kKeysPerStep == 0 || key < key0 + kBlockN) {
      const bool in = key < seqlen_k;
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(dst), "l"(in ? src : idx), "r"(in ? 4 : 0)
                   : "memory");
    }
    key += kKeysPerStep, src += kKeysPerStep * ss, dst += 128;
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
}

// Sets the masked scores of a warp's S fragment (mask.cuh's layout: rows row0 + (lane >> 2)
// (+ 8), columns col0 + j * 8 + (lane & 3) * 2 + e) to -inf, reading column j's bounds at
// idx[j * ss + c * sc]. Columns >= seqlen_k are left to apply_mask.
template <int kNT, int kN, bool kCausal>
__device__ __forceinline__ void apply_flashmask(float (&s)[kNT][4], int row0, int col0, int seqlen_k,
                                                const int* __restrict__ idx, long long ss, long long sc) {
  const int lane = threadIdx.x & 31;
  const int c0 = col0 + (lane & 3) * 2;
#pragma unroll
  for (int j = 0; j < kNT; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = c0 + j * 8 + e;
      if (col >= seqlen_k) continue;
      const int* x = idx + col * ss;
      const int a0 = __ldg(x), a1 = kN > 1 ? __ldg(x + sc) : 0;
      const int a2 = kN > 2 ? __ldg(x + 2 * sc) : 0, a3 = kN > 2 ? __ldg(x + 3 * sc) : 0;
#pragma unroll
      for (int r = 0; r < 2; ++r)
        if (flashmask_hides<kN, kCausal>(row0 + (lane >> 2) + r * 8, a0, a1, a2, a3)) s[j][2 * r + e] = neg_inf();
    }
}

// The same with the K/V block's bounds staged in shared memory by flashmask_stage (the block's
// column c at sm[kN * c], sm 16-byte aligned): a lane reads its two adjacent columns' bounds in
// one 8- or 16-byte load (two at kN = 4). Staged keys >= seqlen_k read as zeros (apply_mask's).
template <int kNT, int kN, bool kCausal>
__device__ __forceinline__ void apply_flashmask_staged(float (&s)[kNT][4], int row0, const int* sm) {
  const int lane = threadIdx.x & 31;
  const int* x0 = sm + (lane & 3) * 2 * kN;
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
    const int* x = x0 + j * 8 * kN;
    int a[2][4] = {};
    if constexpr (kN == 1) {
      const int2 v = *reinterpret_cast<const int2*>(x);
      a[0][0] = v.x, a[1][0] = v.y;
    } else if constexpr (kN == 2) {
      const int4 v = *reinterpret_cast<const int4*>(x);
      a[0][0] = v.x, a[0][1] = v.y, a[1][0] = v.z, a[1][1] = v.w;
    } else {
      const int4 v = reinterpret_cast<const int4*>(x)[0], w = reinterpret_cast<const int4*>(x)[1];
      a[0][0] = v.x, a[0][1] = v.y, a[0][2] = v.z, a[0][3] = v.w;
      a[1][0] = w.x, a[1][1] = w.y, a[1][2] = w.z, a[1][3] = w.w;
    }
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        if (flashmask_hides<kN, kCausal>(row0 + (lane >> 2) + r * 8, a[e][0], a[e][1], a[e][2], a[e][3]))
          s[j][2 * r + e] = neg_inf();
  }
}

// The same on a transposed S^T fragment of one 16-key tile (the backward's dK/dV kernels: rows
// = keys key0 + (lane >> 2) (+ 8), columns = queries q0 + j * 8 + (lane & 3) * 2 + e): each lane
// reads its two keys' bounds once (kVec: one load each where flashmask_vector holds). Keys >=
// seqlen_k are left to apply_mask_t.
template <int kQT, int kN, bool kCausal, bool kVec = false>
__device__ __forceinline__ void apply_flashmask_t(float (&s)[kQT][4], int key0, int q0, int seqlen_k,
                                                  const int* __restrict__ idx, long long ss, long long sc) {
  const int lane = threadIdx.x & 31;
  const int base = q0 + (lane & 3) * 2;  // this lane's first query
  const bool vec = kVec && kN > 1 && flashmask_vector<kN>(idx, ss, sc);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key0 + (lane >> 2) + r * 8;
    if (key >= seqlen_k) continue;
    const int* x = idx + key * ss;
    int a0, a1, a2 = 0, a3 = 0;
    if (vec && kN == 2) {
      const int2 v = __ldg(reinterpret_cast<const int2*>(x));
      a0 = v.x, a1 = v.y;
    } else if (vec && kN == 4) {
      const int4 v = __ldg(reinterpret_cast<const int4*>(x));
      a0 = v.x, a1 = v.y, a2 = v.z, a3 = v.w;
    } else {
      a0 = __ldg(x), a1 = kN > 1 ? __ldg(x + sc) : 0;
      a2 = kN > 2 ? __ldg(x + 2 * sc) : 0, a3 = kN > 2 ? __ldg(x + 3 * sc) : 0;
    }
#pragma unroll
    for (int j = 0; j < kQT; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (flashmask_hides<kN, kCausal>(base + j * 8 + e, a0, a1, a2, a3)) s[j][2 * r + e] = neg_inf();
  }
}
