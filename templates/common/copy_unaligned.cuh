// Global -> shared copies of K/V rows that are not 16-byte aligned (a cache whose head dim is not
// a multiple of 8: its rows are head_dim elements apart, so cp.async's 16-byte chunks cannot
// address them). Each thread gathers one 16-byte chunk of a row element by element (2-byte
// loads; columns >= d_valid and rows >= rows_valid read nothing and are zero) and stores it to
// the same place of the shared tile as load_tile / load_tile_paged would (copy.cuh's
// tile_offset, padded or swizzled), so the rest of the kernel is unchanged. The stores are
// synchronous: they land before the __syncthreads that follows every cp.async wait, which is
// all the pipeline asks of a copy.

__device__ __forceinline__ u16 ld_u16(const u16* p) {
  u16 x;
  asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(x) : "l"(p));
  return x;
}

__device__ __forceinline__ void st_shared16(u32 dst, uint4 x) {
  asm volatile("st.shared.v4.b32 [%0], { %1, %2, %3, %4 };" :: "r"(dst), "r"(x.x), "r"(x.y), "r"(x.z), "r"(x.w));
}

// Chunk `ch` of the row at `src` (null: a row past the sequence): 8 elements, zero past d_valid.
__device__ __forceinline__ uint4 gather_chunk(const u16* src, int ch, int d_valid) {
  u32 w[4] = {0u, 0u, 0u, 0u};
  if (src != nullptr) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int col = ch * 8 + e;
      if (col < d_valid) w[e >> 1] |= (u32)ld_u16(src + col) << ((e & 1) * 16);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Gather a kRows x kCols tile into shared memory with thread tid of kThreads: tile row r comes
// from row_src(r) (null: zero), laid out as load_tile lays it out.
template <int kRows, int kCols, int kStride, bool kSwizzle, int kThreads, class RowSrc>
__device__ __forceinline__ void gather_tile(u32 s_tile, RowSrc row_src, int d_valid, int tid) {
  constexpr int kChunks = kCols / 8;
  constexpr int kRowStep = tile_row_step<kRows, kCols, kThreads, kSwizzle>();
  constexpr int kPasses = (kRows + kRowStep - 1) / kRowStep;
  const int ch = tid % kChunks, row0 = tid / kChunks;
  if (row0 >= kRowStep) return;
  const u32 dst = s_tile + tile_offset<kRows, kStride, kSwizzle>(row0, ch);
  // One row at a time: unrolled, every pass's loads would be in flight at once and hold
  // registers that the kernel's accumulators need (spills in the split and paged kernels).
#pragma unroll 1
  for (int i = 0; i < kPasses; ++i) {
    const int row = row0 + i * kRowStep;
    if (kRows % kRowStep == 0 || row < kRows)
      st_shared16(dst + i * tile_offset<kRows, kStride, kSwizzle>(kRowStep, 0), gather_chunk(row_src(row), ch, d_valid));
  }
}

// load_tile for unaligned rows: kRows x kCols from g (rows row_stride elements apart).
template <int kRows, int kCols, int kStride, bool kSwizzle, int kThreads>
__device__ __forceinline__ void load_tile_unaligned(u32 s_tile, const u16* g, long long row_stride,
                                                    int rows_valid, int d_valid, int tid) {
  gather_tile<kRows, kCols, kStride, kSwizzle, kThreads>(
      s_tile, [&](int row) { return row < rows_valid ? g + row * row_stride : nullptr; }, d_valid, tid);
}

// load_tile_paged for unaligned rows: tile row r is sequence row row_start + r, found through
// the block table `pages` as in load_tile_paged.
template <int kRows, int kCols, int kStride, bool kSwizzle, int kThreads>
__device__ __forceinline__ void load_tile_paged_unaligned(u32 s_tile, const u16* g, const int* pages, int page_size,
                                                          long long page_stride, long long row_stride, int row_start,
                                                          int rows_valid, int d_valid, int tid) {
  gather_tile<kRows, kCols, kStride, kSwizzle, kThreads>(
      s_tile,
      [&](int row) -> const u16* {
        if (row >= rows_valid) return nullptr;  // only rows inside the sequence consult the block table
        const int j = row_start + row;
        return g + pages[j / page_size] * page_stride + (long long)(j % page_size) * row_stride;
      },
      d_valid, tid);
}
