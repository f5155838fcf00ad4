// Backward-pass primitives: warp-level GEMMs on shared-memory tiles, the transposed mask, fp32
// reductions into global memory and element conversions. Needs types.cuh and mma.cuh. kBF16
// selects the element type (bf16, else fp16) of the products and of what is packed.
//
// Operand conventions (lane l, g = l >> 2, t = l & 3). A tile "stored by rows" holds row r at
// byte offset r * stride * 2; ldmatrix fetches four 8x8 matrices per call.
//   ss_nt: acc[mt][nt] += A[mt] . B[nt]^T with A (m x k) and B (n x k) both stored by rows
//          (Q K^T, dO V^T, K Q^T, V dO^T).
//   rs_tn: acc[mt][nt] += A[mt] . B with A in registers (C fragments turned into A fragments)
//          and B (k x n) stored by rows of k, read with ldmatrix.trans (P^T dO, dS^T Q, dS K).
//   st_tn: as rs_tn, with A (m x k) stored transposed (k rows of m) and read with .trans, or
//          (kAT = false) stored by rows of m and read as in ss_nt.

// Per-lane byte offsets inside a tile with rows kS elements apart.
template <int kS>
__device__ __forceinline__ u32 lane_off_a(int lane) {  // A by rows: rows 0-15, column halves
  return ((lane & 15) * kS + (lane >> 4) * 8) * 2;
}
template <int kS>
__device__ __forceinline__ u32 lane_off_b(int lane) {  // B^T by rows: n tiles 2j, 2j+1; k halves
  return (((lane >> 4) * 8 + (lane & 7)) * kS + ((lane >> 3) & 1) * 8) * 2;
}
template <int kS>
__device__ __forceinline__ u32 lane_off_bt(int lane) {  // B by rows of k (.trans): n tiles, k halves
  return ((((lane >> 3) & 1) * 8 + (lane & 7)) * kS + (lane >> 4) * 8) * 2;
}
template <int kS>
__device__ __forceinline__ u32 lane_off_at(int lane) {  // A stored as k rows of m (.trans)
  return (((lane >> 4) * 8 + (lane & 7)) * kS + ((lane >> 3) & 1) * 8) * 2;
}

// acc[kMT][kNT] += A . B^T over kK16 steps of 16 along the inner dim.
// a: lane address of A's first row (lane_off_a), b: lane address of B's first row (lane_off_b).
template <bool kBF16, int kMT, int kNT, int kK16, int kSA, int kSB>
__device__ __forceinline__ void gemm_ss_nt(float (&acc)[kMT][kNT][4], u32 a, u32 b) {
  static_assert(kNT % 2 == 0, "n8 tiles come in pairs");
#pragma unroll
  for (int kk = 0; kk < kK16; ++kk) {
    u32 fa[kMT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) ldsm_x4(fa[mt], a + (mt * 16 * kSA + kk * 16) * 2);
#pragma unroll
    for (int j = 0; j < kNT / 2; ++j) {
      u32 fb[4];
      ldsm_x4(fb, b + (j * 16 * kSB + kk * 16) * 2);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        mma16816<kBF16>(acc[mt][2 * j], fa[mt], fb[0], fb[1]);
        mma16816<kBF16>(acc[mt][2 * j + 1], fa[mt], fb[2], fb[3]);
      }
    }
  }
}

// acc[kMT][kNT] += A . B, A from registers (kK16 16-wide k steps), B (k x n) stored by rows of k.
// b: lane address of B's first row and first column (lane_off_bt).
template <bool kBF16, int kMT, int kNT, int kK16, int kSB>
__device__ __forceinline__ void gemm_rs_tn(float (&acc)[kMT][kNT][4], const u32 (&fa)[kMT][kK16][4], u32 b) {
  static_assert(kNT % 2 == 0, "n8 tiles come in pairs");
#pragma unroll
  for (int kk = 0; kk < kK16; ++kk) {
#pragma unroll
    for (int dj = 0; dj < kNT / 2; ++dj) {
      u32 fb[4];
      ldsm_x4_trans(fb, b + (kk * 16 * kSB + dj * 16) * 2);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        mma16816<kBF16>(acc[mt][2 * dj], fa[mt][kk], fb[0], fb[1]);
        mma16816<kBF16>(acc[mt][2 * dj + 1], fa[mt][kk], fb[2], fb[3]);
      }
    }
  }
}

// Two 8x8 b16 matrices, transposed; lanes 0-7 and 8-15 give the row addresses.
__device__ __forceinline__ void ldsm_x2_trans(u32 (&r)[2], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 { %0,%1}, [%2];"
               : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// acc[kMT][kNT] += A . B with A (m x k) stored as k rows of m (kAT) or as m rows of k, B (k x n)
// stored by rows of k. a: lane address of A's first k row at this warp's first m column
// (lane_off_at), or of its first m row (lane_off_a); b as in rs_tn.
// An odd last n8 tile is read with ldmatrix .x2 (the lane offsets of lanes 0-15 are the same).
template <bool kBF16, int kMT, int kNT, int kK16, int kSA, int kSB, bool kAT = true>
__device__ __forceinline__ void gemm_st_tn(float (&acc)[kMT][kNT][4], u32 a, u32 b) {
#pragma unroll
  for (int kk = 0; kk < kK16; ++kk) {
    u32 fa[kMT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      if constexpr (kAT) ldsm_x4_trans(fa[mt], a + (kk * 16 * kSA + mt * 16) * 2);
      else ldsm_x4(fa[mt], a + (mt * 16 * kSA + kk * 16) * 2);
    }
#pragma unroll
    for (int dj = 0; dj < kNT / 2; ++dj) {
      u32 fb[4];
      ldsm_x4_trans(fb, b + (kk * 16 * kSB + dj * 16) * 2);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        mma16816<kBF16>(acc[mt][2 * dj], fa[mt], fb[0], fb[1]);
        mma16816<kBF16>(acc[mt][2 * dj + 1], fa[mt], fb[2], fb[3]);
      }
    }
    if constexpr (kNT % 2 == 1) {
      u32 fb[2];
      ldsm_x2_trans(fb, b + (kk * 16 * kSB + (kNT - 1) * 8) * 2);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) mma16816<kBF16>(acc[mt][kNT - 1], fa[mt], fb[0], fb[1]);
    }
  }
}

// C fragments of n8 tiles 2kk and 2kk+1 (16 rows x 16 columns) as one A fragment, packed to the
// element type: the product's k dim is the C tile's columns.
template <bool kBF16, int kNT>
__device__ __forceinline__ void c_to_a(u32 (&a)[kNT / 2][4], const float (&c)[kNT][4]) {
#pragma unroll
  for (int kk = 0; kk < kNT / 2; ++kk) {
    a[kk][0] = pack2<kBF16>(c[2 * kk][0], c[2 * kk][1]);
    a[kk][1] = pack2<kBF16>(c[2 * kk][2], c[2 * kk][3]);
    a[kk][2] = pack2<kBF16>(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    a[kk][3] = pack2<kBF16>(c[2 * kk + 1][2], c[2 * kk + 1][3]);
  }
}

// Transposed mask on an S^T fragment of one 16-key tile (rows = keys, columns = queries): key j
// is visible to query i iff j < seqlen_k, j <= i + diag and, with kLower, j >= i + diag_lo
// (mask.cuh's apply_mask seen from the keys). Invisible scores become -inf.
template <int kQT, bool kLower>
__device__ __forceinline__ void apply_mask_t(float (&s)[kQT][4], int key0, int q0, int seqlen_k, int diag,
                                             int diag_lo) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key0 + (lane >> 2) + r * 8;
    const int base = q0 + (lane & 3) * 2;  // this lane's first query
    // visible iff lo <= j * 8 + e (query >= key - diag) and, with kLower, j * 8 + e <= hi
    const int lo = key < seqlen_k ? key - diag - base : (1 << 30);
    const int hi = key - diag_lo - base;
#pragma unroll
    for (int j = 0; j < kQT; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (j * 8 + e < lo || (kLower && j * 8 + e > hi)) s[j][2 * r + e] = neg_inf();
  }
}

// On S^T / dP^T fragments (rows = keys, columns = queries): P^T = exp2(S^T c - LSE2) in place,
// and dS^T = P^T (dP^T - D) in place in dP^T, with lse2 and d the per-query values of the
// fragment's first query (this lane's columns at j * 8 + 2 (lane & 3) + {0, 1}).
template <int kQT>
__device__ __forceinline__ void exp_t(float (&s)[kQT][4], const float* lse2, float scale_log2) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int j = 0; j < kQT; ++j) {
    const float2 l = *reinterpret_cast<const float2*>(lse2 + j * 8 + (lane & 3) * 2);
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = exp2_approx(fmaf(s[j][e], scale_log2, -((e & 1) ? l.y : l.x)));
  }
}
template <int kQT>
__device__ __forceinline__ void ds_t(float (&dp)[kQT][4], const float (&p)[kQT][4], const float* d) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int j = 0; j < kQT; ++j) {
    const float2 dd = *reinterpret_cast<const float2*>(d + j * 8 + (lane & 3) * 2);
#pragma unroll
    for (int e = 0; e < 4; ++e) dp[j][e] = p[j][e] * (dp[j][e] - ((e & 1) ? dd.y : dd.x));
  }
}

// Transposed ALiBi: s -= slope * |i + seqlen_k - seqlen_q - j| on an S^T fragment, with `pos0` =
// q0 + seqlen_k - seqlen_q (the key aligned with the fragment's first query) and the slope in
// the units of the raw scores (mask.cuh's apply_alibi seen from the keys).
template <int kQT>
__device__ __forceinline__ void apply_alibi_t(float (&s)[kQT][4], int key0, int pos0, float slope) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float base = static_cast<float>(pos0 + (lane & 3) * 2 - key0 - (lane >> 2) - r * 8);
#pragma unroll
    for (int j = 0; j < kQT; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) s[j][2 * r + e] -= slope * fabsf(base + static_cast<float>(j * 8 + e));
  }
}

// Rows of the LSE/D workspace and of the fp32 dQ accumulator: row i of (sequence b, head h) is
// stats_base(b) + h * head_rows + i. Dense batches: (batch, nheads, head_rows) with head_rows the
// padded seqlen_q. Packed (varlen) batches: (nheads, head_rows), sequence b starting at
// (cu_seqlens_q[b] rounded down to 4) + kVarlenRowGap * b, which leaves every sequence room for
// its rows padded to a multiple of 128 (whole blocks, padding rows disjoint from its neighbour's)
// and keeps 16-byte alignment. cuflash.backward mirrors this layout.
constexpr int kVarlenRowGap = {{ varlen_row_gap }};  // cuflash.kernels.bwd.VARLEN_ROW_GAP
__device__ __forceinline__ long long stats_base(const int* cu_seqlens_q, int b, int nheads, int head_rows) {
  return cu_seqlens_q != nullptr ? (long long)((cu_seqlens_q[b] & ~3) + kVarlenRowGap * b)
                                 : (long long)b * nheads * head_rows;
}

// Per-block scalars (sequence offsets and lengths, band edges) that the main loops need now and
// then: staged in kInfoBytes of shared memory and re-read at each use, because kept in registers
// through the loop they would push the dK/dV kernel into spills. The volatile loads cannot be
// merged or hoisted, so the compiler never keeps the values live.
constexpr int kInfoBytes = {{ info_bytes }};  // cuflash.kernels.bwd.INFO_BYTES
enum {  // int slots (kInfoStats takes two)
  kInfoQb, kInfoKb, kInfoSeqQ, kInfoSeqK, kInfoDiag, kInfoDiagLo, kInfoStats, kInfoUnmasked = kInfoStats + 2, kInfoLower,
  kInfoB,  // bwd_ws lpt and FlashMask: the block's batch
  kInfoRun  // bwd_ws dq_groups: the block's run of key blocks
};
static_assert((kInfoRun + 1) * 4 <= kInfoBytes, "the per-block scalars fit their shared memory");
__device__ __forceinline__ int info_i32(u32 s_info, int slot) {
  int v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(s_info + slot * 4));
  return v;
}
__device__ __forceinline__ long long info_i64(u32 s_info, int slot) {
  long long v;
  asm volatile("ld.shared.b64 %0, [%1];" : "=l"(v) : "r"(s_info + slot * 4));
  return v;
}

// fp32 reduction into global memory (no return value: red, not atom).
__device__ __forceinline__ void red_add_f32(float* p, float x) {
  asm volatile("red.global.add.f32 [%0], %1;" :: "l"(p), "f"(x) : "memory");
}
__device__ __forceinline__ void red_add_f32x2(float* p, float x, float y) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], { %1, %2};" :: "l"(p), "f"(x), "f"(y) : "memory");
#else
  red_add_f32(p, x);
  red_add_f32(p + 1, y);
#endif
}

__device__ __forceinline__ void red_add_f32x4(float* p, const float (&x)[4]) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], { %1, %2, %3, %4};" :: "l"(p), "f"(x[0]), "f"(x[1]), "f"(x[2]), "f"(x[3])
               : "memory");
#else
  red_add_f32x2(p, x[0], x[1]);
  red_add_f32x2(p + 2, x[2], x[3]);
#endif
}

// The fragment-ordered dQ accumulator of the warp-specialised backward (FlashAttention-3's
// dQaccum): the rows of a 64-row query block hold, per 64-column block, a 64 x 64 piece whose
// 4096 floats are a warpgroup's m64n64 accumulator in register order: value e of n8 tile j of
// thread t (row 16 (t / 32) + (t % 32) / 4 + 8 (e / 2), column 8 j + 2 (t % 4) + e % 2 of the
// piece) at (j * 128 + t) * 4 + e. A thread's four values of a tile are one 16-byte word and a
// warp's 32 words are 512 contiguous bytes, so the adds need no exchange and stay coalesced.
// The word of n8 tile j (8 per piece, then the next piece) of thread t.
__device__ __forceinline__ float* frag_word(float* piece, int j, int t) {
  return piece + (j >> 3) * 4096 + ((j & 7) * 128 + t) * 4;
}
template <int kNT>
__device__ __forceinline__ void red_add_frag(float* piece, const float (&c)[kNT][4], int t) {
#pragma unroll
  for (int j = 0; j < kNT; ++j) red_add_f32x4(frag_word(piece, j, t), c[j]);
}
// The same words stored (the first of ordered adds into an accumulator nobody zeroed).
template <int kNT>
__device__ __forceinline__ void store_frag(float* piece, const float (&c)[kNT][4], int t) {
#pragma unroll
  for (int j = 0; j < kNT; ++j) *reinterpret_cast<float4*>(frag_word(piece, j, t)) = make_float4(c[j][0], c[j][1], c[j][2], c[j][3]);
}

// Write a warp's C fragments (kMT 16-row tiles x kNT n8 tiles, times `mul`) into a padded
// shared tile as the element type: rows row0 + mt * 16 + g (+8), columns col0 + nt * 8 + 2t.
template <bool kBF16, int kMT, int kNT, int kS>
__device__ __forceinline__ void stage_c(u16* tile, const float (&c)[kMT][kNT][4], int row0, int col0, float mul) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const int row = row0 + mt * 16 + (lane >> 2) + r * 8;
        *reinterpret_cast<u32*>(tile + row * kS + col0 + nt * 8 + (lane & 3) * 2) =
            pack2<kBF16>(c[mt][nt][2 * r] * mul, c[mt][nt][2 * r + 1] * mul);
      }
}

// Store rows [0, rows) of a padded shared tile (kRows x kCols, rows kStride apart) to global
// memory in 16-byte chunks, columns below d_valid only (unless kEvenCols). All kThreads threads
// take part.
template <int kRows, int kCols, int kStride, int kThreads, bool kEvenCols>
__device__ __forceinline__ void store_tile(u16* g, long long row_stride, const u16* tile, int rows,
                                           int d_valid, int tid) {
  constexpr int kChunks = kCols / 8;
#pragma unroll
  for (int c = tid; c < kRows * kChunks; c += kThreads) {
    const int row = c / kChunks, ch = c % kChunks;
    if (row < rows && (kEvenCols || ch * 8 < d_valid))
      *reinterpret_cast<uint4*>(g + row * row_stride + ch * 8) =
          *reinterpret_cast<const uint4*>(tile + row * kStride + ch * 8);
  }
}
