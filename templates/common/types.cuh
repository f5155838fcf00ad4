// Element types and conversions, written with inline PTX so that no CUDA header is needed.
// Storage type for fp16/bf16 values is a raw 16-bit word; pairs travel as one 32-bit word.
typedef unsigned short u16;
typedef unsigned int u32;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }

// Pack two fp32 values into one 32-bit word of the element type (bf16 with kBF16, else fp16),
// lo in the low half.
template <bool kBF16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 r;
  if constexpr (kBF16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

// The two values of a word that pack2 wrote, as fp32 (exact: every bf16/fp16 value is one).
template <bool kBF16>
__device__ __forceinline__ float2 unpack2(u32 w) {
  if constexpr (kBF16) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  } else {
    float lo, hi;
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }" : "=f"(lo), "=f"(hi) : "r"(w));
    return make_float2(lo, hi);
  }
}

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float log2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ int cdiv(int a, int b) { return (a + b - 1) / b; }

// Generic-to-shared address conversion (the 32-bit address that ldmatrix and cp.async take).
__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

template <bool B> struct Bool { static constexpr bool value = B; };
