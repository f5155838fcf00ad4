// Global -> shared copies with cp.async (16 bytes, L2 only). A false predicate reads 0 bytes and
// zero-fills the 16, which gives predicated sequence and head-dim tails for free (the address is
// then never dereferenced, so it may point past the end).

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool pred) {
  int n = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }
// Wait until at most N of this thread's most recent commit groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

// Shared tiles hold kRows rows of kCols 16-bit elements: padded rows kStride elements apart, or
// (kSwizzle) kCols / 64 column blocks of kRows 128-byte rows with 16-byte chunk ch of a row at
// ch ^ (row & 7) (the 128-byte swizzle that wgmma reads; see wgmma.cuh; kStride is then unused).

// Byte offset of 16-byte chunk `ch` of row `row`.
template <int kRows, int kStride, bool kSwizzle>
__device__ __forceinline__ u32 tile_offset(int row, int ch) {
  if constexpr (kSwizzle) return (ch >> 3) * kRows * 128 + row * 128 + (((ch & 7) ^ (row & 7)) << 4);
  return (row * kStride + ch * 8) * 2;
}

// Rows one pass of kThreads threads covers (one 16-byte chunk each); with the swizzle a
// multiple of 8 that divides kRows, so every pass repeats the first pass's XOR pattern.
template <int kRows, int kCols, int kThreads, bool kSwizzle>
__device__ __forceinline__ constexpr int tile_row_step() {
  constexpr int kStep = kSwizzle ? kThreads / (kCols / 8) / 8 * 8 : kThreads / (kCols / 8);
  static_assert(kStep > 0, "a pass must cover at least one row");
  static_assert(!kSwizzle || (kStep % 8 == 0 && kRows % kStep == 0), "swizzle phase repeats per pass");
  return kStep;
}

// Copy a kRows x kCols tile (rows `row_stride` elements apart) into a shared tile, with thread
// tid of kThreads. Rows >= rows_valid and (unless kEvenCols) columns >= d_valid are zero-filled.
// Each thread owns one 16-byte column chunk and walks rows kRowStep apart, so the addresses are
// one base plus a fixed increment (a few live registers) rather than a separately computed
// pointer per chunk.
template <int kRows, int kCols, int kStride, bool kSwizzle, int kThreads, bool kEvenCols>
__device__ __forceinline__ void load_tile(u32 s_tile, const u16* g, long long row_stride,
                                          int rows_valid, int d_valid, int tid) {
  constexpr int kChunks = kCols / 8;               // 16-byte chunks per row
  constexpr int kRowStep = tile_row_step<kRows, kCols, kThreads, kSwizzle>();
  constexpr int kPasses = (kRows + kRowStep - 1) / kRowStep;
  const int ch = tid % kChunks, row0 = tid / kChunks;
  if (row0 >= kRowStep) return;  // threads beyond whole rows idle (e.g. d = 96 with 128 threads)
  const bool col_ok = kEvenCols || ch * 8 < d_valid;
  rows_valid -= row0;
  const u16* src = g + row0 * row_stride + ch * 8;
  const u32 dst = s_tile + tile_offset<kRows, kStride, kSwizzle>(row0, ch);
  // The empty asm hides that the step is loop-invariant in the caller's K/V loop; otherwise the
  // compiler hoists one 64-bit offset per pass out of that loop and runs out of registers.
  long long step = kRowStep * row_stride;
  asm volatile("" : "+l"(step));
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    if (kRows % kRowStep == 0 || row0 + i * kRowStep < kRows) {
      const bool ok = col_ok && i * kRowStep < rows_valid;
      cp_async16(dst + i * tile_offset<kRows, kStride, kSwizzle>(kRowStep, 0), src, ok);  // nothing is read when !ok
    }
    src += step;
  }
}

// Paged variant: tile row r is sequence row j = row_start + r, stored in page pages[j / page_size]
// at row j % page_size. `g` already points at the right head; pages are page_stride apart.
template <int kRows, int kCols, int kStride, bool kSwizzle, int kThreads, bool kEvenCols>
__device__ __forceinline__ void load_tile_paged(u32 s_tile, const u16* g, const int* pages, int page_size,
                                                long long page_stride, long long row_stride, int row_start,
                                                int rows_valid, int d_valid, int tid) {
  constexpr int kChunks = kCols / 8;
  constexpr int kRowStep = tile_row_step<kRows, kCols, kThreads, kSwizzle>();
  constexpr int kPasses = (kRows + kRowStep - 1) / kRowStep;
  const int ch = tid % kChunks, row0 = tid / kChunks;
  if (row0 >= kRowStep) return;
  const bool col_ok = kEvenCols || ch * 8 < d_valid;
  const u32 dst = s_tile + tile_offset<kRows, kStride, kSwizzle>(row0, ch);
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int row = row0 + i * kRowStep;
    if (kRows % kRowStep == 0 || row < kRows) {
      const bool ok = col_ok && row < rows_valid;
      const u16* src = g;
      if (ok) {  // only rows inside the sequence consult the block table
        const int j = row_start + row;
        src = g + pages[j / page_size] * page_stride + (j % page_size) * row_stride + ch * 8;
      }
      cp_async16(dst + i * tile_offset<kRows, kStride, kSwizzle>(kRowStep, 0), src, ok);
    }
  }
}
