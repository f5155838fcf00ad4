// Where a block's sequence lives and which blocks of the other side its rows see: the sequence
// bounds of dense, packed (varlen) and KV-cache batches, and the causal / sliding-window band.
// Needs types.cuh (cdiv).

// Rows of one sequence.
struct SeqRows {
  int len;    // how many
  int start;  // the first, in batch strides (token strides for packed sequences)
};

// Rows of packed (varlen) sequence b: rows cu_seqlens[b] ... cu_seqlens[b + 1] - 1, each
// rows_per_token rows when a KV head's query heads run as rows. A kernel whose grid is sized for
// the longest sequence returns early when its block lies past `len`, inside its own branch on
// cu_seqlens (so the dense path has no compare).
__device__ __forceinline__ SeqRows packed_rows(const int* cu_seqlens, int b, int rows_per_token = 1) {
  SeqRows r;
  r.start = cu_seqlens[b];
  r.len = (cu_seqlens[b + 1] - cu_seqlens[b]) * rows_per_token;
  return r;
}

// Query rows of sequence b: packed (cu_seqlens_q), or batch row b and seqlen_q rows.
__device__ __forceinline__ SeqRows query_rows(const int* cu_seqlens_q, int b, int seqlen_q) {
  return cu_seqlens_q != nullptr ? packed_rows(cu_seqlens_q, b) : SeqRows{seqlen_q, b};
}

// Key/value rows of sequence b: packed (cu_seqlens_k); otherwise, with kKVCache, cache batch row
// kv_batch_idx[b] (or b) and seqlens_k[b] + seqlen_k keys (seqlen_k then counts the tokens just
// appended; either array may be null); dense, batch row b and seqlen_k keys.
template <bool kKVCache = false>
__device__ __forceinline__ SeqRows key_rows(const int* cu_seqlens_k, int b, int seqlen_k,
                                            const int* seqlens_k = nullptr, const int* kv_batch_idx = nullptr) {
  SeqRows r = {seqlen_k, b};
  if (cu_seqlens_k != nullptr) {
    r = packed_rows(cu_seqlens_k, b);
  } else if constexpr (kKVCache) {
    if (seqlens_k != nullptr) r.len += seqlens_k[b];
    if (kv_batch_idx != nullptr) r.start = kv_batch_idx[b];
  }
  return r;
}

// The grid's blocks taken in rounds: in launch order, every (y, z) pair's first x block, then
// every pair's second, and so on, so that each pair's long walks start with the grid rather
// than behind the pairs before it (`reverse`: x from the last, for walks that grow with x).
// Returns (x, y, z).
struct GridBlock {
  int x, y, z;
};
__device__ __forceinline__ GridBlock grid_rounds(bool reverse) {
  const int pairs = gridDim.y * gridDim.z;
  const int lin = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  GridBlock g;
  g.x = reverse ? gridDim.x - 1 - lin / pairs : lin / pairs;
  g.y = lin % pairs % gridDim.y;
  g.z = lin % pairs / gridDim.y;
  return g;
}

// FlashAttention-3's LPT launch order: item `lin` of a walk over `pairs` (head, batch) pairs of
// `per_pair` items each (query tiles or key blocks, longest first) is taken in sections of
// `section` pairs, and within a section every pair's item 0, then every pair's item 1, and so
// on: the longest items of a section start first, its shortest fill the end.
struct LptItem {
  int item, pair;
};
__device__ __forceinline__ LptItem lpt_item(int lin, int per_pair, int pairs, int section) {
  const int first = lin / (section * per_pair) * section, width = min(section, pairs - first);
  const int within = lin - first * per_pair;
  return LptItem{within / width, first + within % width};
}

// A band edge that bounds nothing (an enumerator, so that it is no device global in the module
// as namespace-scope constexpr variables are under -default-device).
enum : int { kUnbounded = 1 << 30 };

// Key j is visible to query i iff i + diag_lo <= j <= i + diag. Bottom-right aligned: causal is
// diag = seqlen_k - seqlen_q; a window adds -window_left / +window_right, -1 meaning unbounded.
struct Band {
  int diag, diag_lo;
};
template <bool kIsCausal, bool kIsLocal>
__device__ __forceinline__ Band make_band(int seqlen_q, int seqlen_k, int window_left, int window_right) {
  Band band;
  band.diag = kIsLocal ? (window_right < 0 ? seqlen_k : seqlen_k - seqlen_q + window_right)
                       : (kIsCausal ? seqlen_k - seqlen_q : kUnbounded);
  band.diag_lo = kIsLocal && window_left >= 0 ? seqlen_k - seqlen_q - window_left : -kUnbounded;
  return band;
}

// Chunked attention (FlashAttention-3's attention_chunk, Llama 4's chunked layers), on a local
// band: query i sees only the keys of its chunk, the `len` keys from chunk_start(i + off, len)
// (mask.cuh), off = seqlen_k - seqlen_q. len = 0: no chunk (kernels without one never make it).
struct Chunk {
  int len, off;
};

// The block ranges below are built in place by a constructor: returned by value, a struct of
// four ints goes through memory and the kernels' loops get other code from NVVM. kHasUpper: the
// band has an upper edge that depends on the row (causal or a window); kIsLocal: a window, so a
// lower edge too.

// K/V blocks (kBlockN keys each) that the kBlockM query rows from m0 see: [lo, hi), blocks
// outside it are never loaded. Blocks >= full hold the sequence's tail or cross the band's upper
// edge, blocks < left (kIsLocal) cross its lower edge: both need a mask, the ones between none.
// With kSplit (a split-KV partial) only `count` blocks from lo + first are walked. With a chunk
// (local only) each row's band is cut to its chunk: rows' bands and chunks both move right with
// the row, so the first row bounds lo and full and the last one hi and left, as without. The
// kernels write the walk over these blocks out themselves: a loop inside an inlined helper
// gets other loop code (induction variables, registers) from NVVM.
template <int kBlockM, int kBlockN, bool kHasUpper, bool kIsLocal, bool kSplit = false>
struct KvBlocks {
  int lo, hi, full, left;

  __device__ __forceinline__ KvBlocks(int m0, int seqlen_k, Band band, int first = 0, int count = 0,
                                      Chunk chunk = Chunk{0, 0}) {
    hi = cdiv(seqlen_k, kBlockN);
    if constexpr (kHasUpper) hi = min(hi, cdiv(max(0, m0 + kBlockM + band.diag), kBlockN));
    lo = kIsLocal ? max(0, (m0 + band.diag_lo) / kBlockN) : 0;
    int first_start = 0, last_start = 0;  // the chunks of the first and last rows
    if (kIsLocal && chunk.len > 0) {
      first_start = chunk_start(m0 + chunk.off, chunk.len);
      last_start = chunk_start(m0 + kBlockM - 1 + chunk.off, chunk.len);
      hi = min(hi, cdiv(max(0, last_start + chunk.len), kBlockN));
      lo = max(lo, max(0, first_start) / kBlockN);
    }
    if constexpr (kSplit) {
      lo += first;
      hi = min(hi, lo + count);
    }
    full = seqlen_k / kBlockN;
    if constexpr (kHasUpper) full = min(full, max(0, m0 + band.diag + 1) / kBlockN);
    left = kIsLocal ? cdiv(m0 + kBlockM - 1 + band.diag_lo, kBlockN) : 0;
    if (kIsLocal && chunk.len > 0) {
      full = min(full, max(0, first_start + chunk.len) / kBlockN);
      left = max(left, cdiv(last_start, kBlockN));
    }
  }
};

// Query blocks (kBlockM rows each) that see a key of the kBlockN keys from n0: [lo, hi). A step
// over the rows from m0 needs a mask iff m0 < unmasked (it crosses the band's upper edge; every
// step does when the key block holds the sequence's tail) or, with kIsLocal, m0 > lower (it
// crosses the window's lower edge).
template <int kBlockM, int kBlockN, bool kHasUpper, bool kIsLocal>
struct QBlocks {
  int lo, hi, unmasked, lower;

  __device__ __forceinline__ QBlocks(int n0, int seqlen_q, int seqlen_k, Band band) {
    const int last_key = min(n0 + kBlockN, seqlen_k) - 1;
    hi = cdiv(seqlen_q, kBlockM);
    if constexpr (kIsLocal) hi = min(hi, cdiv(max(0, last_key + 1 - band.diag_lo), kBlockM));
    lo = kHasUpper ? min(hi, max(0, n0 - band.diag) / kBlockM) : 0;
    unmasked = n0 + kBlockN > seqlen_k ? kUnbounded : (kHasUpper ? max(0, n0 + kBlockN - 1 - band.diag) : 0);
    lower = kIsLocal ? n0 - band.diag_lo - kBlockM + 1 : kUnbounded;
  }
};
