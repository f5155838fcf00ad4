// Tensor-core primitives: mma.sync m16n8k16 (fp32 accumulate) and ldmatrix.
// Fragment layout (lane l, g = l >> 2, t = l & 3):
//   A 16x16 row-major: a0 = A[g][2t..], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]
//   B 16x8 ("col", stored as rows of B^T): b0 = B[2t..][g], b1 = B[2t+8..][g]
//   C 16x8 fp32: c0,c1 = C[g][2t..2t+1], c2,c3 = C[g+8][2t..2t+1]

// D += A B with A and B in bf16 (kBF16) or fp16.
template <bool kBF16>
__device__ __forceinline__ void mma16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  if constexpr (kBF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{ %0,%1,%2,%3}, { %4,%5,%6,%7}, { %8,%9}, { %0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{ %0,%1,%2,%3}, { %4,%5,%6,%7}, { %8,%9}, { %0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 { %0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 { %0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

#if __CUDA_ARCH__ >= 900
// Four 8x8 b16 matrices from their fragments (as ldsm_x4 gives them) to shared memory,
// transposed; lanes 8i..8i+7 give the addresses of the stored rows of matrix i (sm_90).
__device__ __forceinline__ void stsm_x4_trans(u32 addr, const u32 (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], { %1,%2,%3,%4};"
               :: "r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}
#endif
