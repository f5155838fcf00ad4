// The forward's score modifiers on the S^T fragments of bwd_ws/dkdv_ws.cu.j2 (rows = keys,
// columns = queries; bwd.cuh's layout), with the other backward kernels' arithmetic
// (bwd/dkdv.cu.j2): with a softcap the raw score s becomes t = tanh(s * softcap_scale)
// (apply_softcap, before the mask), ALiBi subtracts slope * |i + seqlen_k - seqlen_q - j|, the
// mask sets -inf, and P = exp2(x * scale_log2 - LSE2) with scale_log2 = softcap * log2 e. dS^T
// then takes the softcap's derivative: dS^T = P^T (1 - t^2) (dP^T - D).
//
// The bias and 1 - t^2 are formed in the same pass as P^T, from the softcapped and masked score,
// so that no array of 1 - t^2 factors stays live across the mask: a masked score (-inf) clamps to
// t = -1, whose factor is 0 (P^T is 0 there too), where the unclamped -inf would give 0 * inf.
// Needs mask.cuh and bwd.cuh. kSoftcap and kAlibi select the modifiers.

// This lane's ALiBi distances: |base[r] + j * 8 + e| for element 2 r + e of n8 tile j, with
// `pos0` = the fragment's first query + seqlen_k - seqlen_q and `key0` its first key (as
// bwd.cuh's apply_alibi_t forms them).
struct AlibiT {
  float base[2];
  __device__ __forceinline__ AlibiT(int key0, int pos0) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < 2; ++r) base[r] = static_cast<float>(pos0 + (lane & 3) * 2 - key0 - (lane >> 2) - r * 8);
  }
  __device__ __forceinline__ float dist(int j, int e) const {
    return fabsf(base[e >> 1] + static_cast<float>(j * 8 + (e & 1)));
  }
  // The empty asm keeps the compiler from forming every distance ahead of the scores (they do
  // not depend on them), which would hold dozens more registers through the step.
  __device__ __forceinline__ void fence() { asm volatile("" : "+f"(base[0]), "+f"(base[1])); }
};

// Element e of n8 tile j: from its softcapped, masked score x, returns P = exp2((x - bias) c - l)
// and sets `ds` to what multiplies (dP - D) in dS: P (1 - t^2) with a softcap, else P.
template <bool kSoftcap, bool kAlibi>
__device__ __forceinline__ float p_mods(float x, float l, float scale_log2, const AlibiT& alibi, float slope, int j,
                                        int e, float& ds) {
  float tc = 1.f;
  if constexpr (kSoftcap) {
    const float t = fmaxf(x, -1.f);  // tanh's range; a masked -inf gives t = -1 and a factor 0
    tc = fmaf(-t, t, 1.f);
  }
  if constexpr (kAlibi) x -= slope * alibi.dist(j, e);
  const float p = exp2_approx(fmaf(x, scale_log2, -l));
  ds = kSoftcap ? p * tc : p;
  return p;
}

// P^T over a whole fragment, packed into dV's A operand `pa` (as c_to_a packs it); `s` keeps
// P^T (1 - t^2) with a softcap, else P^T, for ds_t. lse2: the fragment's first query's LSE2.
template <bool kBF16, int kQT, bool kSoftcap, bool kAlibi>
__device__ __forceinline__ void exp_mods_t(float (&s)[kQT][4], u32 (&pa)[kQT / 2][4], const float* lse2,
                                           float scale_log2, AlibiT alibi, float slope) {
  const int lane = threadIdx.x & 31;
  if constexpr (kAlibi) alibi.fence();
#pragma unroll
  for (int j = 0; j < kQT; ++j) {
    const float2 l = *reinterpret_cast<const float2*>(lse2 + j * 8 + (lane & 3) * 2);
    float p[4];
#pragma unroll
    for (int e = 0; e < 4; ++e)
      p[e] = p_mods<kSoftcap, kAlibi>(s[j][e], (e & 1) ? l.y : l.x, scale_log2, alibi, slope, j, e, s[j][e]);
    pa[j / 2][(j & 1) * 2] = pack2<kBF16>(p[0], p[1]);
    pa[j / 2][(j & 1) * 2 + 1] = pack2<kBF16>(p[2], p[3]);
  }
}

// P^T and dS^T = P^T (1 - t^2) (dP^T - D) over whole fragments in one pass, each tile packed into
// the A operands `pa` (dV) and `dsa` (dK) as soon as it is formed, so that the scores' registers
// die as they are used. lse2, d: the fragment's first query's LSE2 and D.
template <bool kBF16, int kQT, bool kSoftcap, bool kAlibi>
__device__ __forceinline__ void p_ds_mods_t(const float (&s)[kQT][4], const float (&dp)[kQT][4],
                                            u32 (&pa)[kQT / 2][4], u32 (&dsa)[kQT / 2][4], const float* lse2,
                                            const float* d, float scale_log2, AlibiT alibi, float slope) {
  const int lane = threadIdx.x & 31;
  if constexpr (kAlibi) alibi.fence();
#pragma unroll
  for (int j = 0; j < kQT; ++j) {
    const float2 l = *reinterpret_cast<const float2*>(lse2 + j * 8 + (lane & 3) * 2);
    const float2 dd = *reinterpret_cast<const float2*>(d + j * 8 + (lane & 3) * 2);
    float p[4], ds[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      p[e] = p_mods<kSoftcap, kAlibi>(s[j][e], (e & 1) ? l.y : l.x, scale_log2, alibi, slope, j, e, ds[e]);
      ds[e] *= dp[j][e] - ((e & 1) ? dd.y : dd.x);
    }
    pa[j / 2][(j & 1) * 2] = pack2<kBF16>(p[0], p[1]);
    pa[j / 2][(j & 1) * 2 + 1] = pack2<kBF16>(p[2], p[3]);
    dsa[j / 2][(j & 1) * 2] = pack2<kBF16>(ds[0], ds[1]);
    dsa[j / 2][(j & 1) * 2 + 1] = pack2<kBF16>(ds[2], ds[3]);
  }
}
