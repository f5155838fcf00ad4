// Hopper warpgroup MMA (wgmma.mma_async, sm_90a): one warpgroup (4 warps, 128 threads) computes
// a 64 x N tile. Its fp32 accumulator has the mma.sync C layout per warp: warp w of the group
// owns rows 16w..16w+15 and n8-tile j of a row-half r sits at d[j][2r], d[j][2r+1] (columns
// 8j + 2(lane & 3) + {0, 1}, row (lane >> 2) + 8r). An A operand in registers has the
// mma.sync A layout per warp, so P = exp(S) feeds the PV product without leaving registers.
//
// Shared operands use the 128-byte swizzle: a tile of R rows x C columns is stored as C / 64
// column blocks of R rows x 128 bytes, and 16-byte chunk c of row r sits at chunk
// c ^ (r & 7) of its row (the hardware applies the same XOR on address bits [4,7) from bits
// [7,10), so every tile starts 1024-byte aligned). ldmatrix-free: wgmma reads these directly.
typedef unsigned long long u64;

// Shared-memory matrix descriptor, 128-byte swizzle: start address, leading and stride byte
// offsets (in 16-byte units). K-major tiles (Q, K: rows of the contraction dim) use SBO = 1024
// (eight 128-byte rows) and ignore LBO; MN-major tiles (V, contracted over its rows) use SBO =
// 1024 between 8-row groups and LBO = the column-block stride.
__device__ __forceinline__ u64 wgmma_desc(u32 addr, u32 lbo, u32 sbo) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) | (1ull << 62);
}

// The same for a K-major tile of 64-byte rows in the 64-byte swizzle (e4m3 at head dim 64): SBO =
// 512 (eight 64-byte rows), layout type 2.
__device__ __forceinline__ u64 wgmma_desc_sw64(u32 addr, u32 sbo) {
  return (u64)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((u64)(sbo >> 4) << 32) | (2ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory"); }
// Shared-memory writes of the generic proxy (cp.async, st.shared) made visible to wgmma's reads.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Keep the compiler from moving accumulator reads or writes across a wgmma fence or wait.
template <int kN>
__device__ __forceinline__ void fence_regs(float (&d)[kN][4]) {
#pragma unroll
  for (int j = 0; j < kN; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e]) :: "memory");
}

template <int kN>
__device__ __forceinline__ void fence_regs(u32 (&a)[kN][4]) {
#pragma unroll
  for (int j = 0; j < kN; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[j][e]) :: "memory");
}

{#- The wgmma instructions themselves, as Jinja macros that a kernel template imports and calls
    for the shapes and element type it uses (an inline asm statement names every accumulator
    register, so each N needs its own operand list). fn: the function's name; n: the product's N;
    bf16: the element type (bf16, else fp16). -#}
{#- Both operands from shared memory (m64 x n x k16; trans = 1 reads A and B MN-major; trans_b,
    when given, sets B's apart from A's). -#}
{% macro wgmma_ss_fn(fn, n, trans, bf16, trans_b=none) %}
{%- set ab = "bf16" if bf16 else "f16" %}
__device__ __forceinline__ void {{ fn }}(float (&d)[{{ n // 8 }}][4], u64 desc_a, u64 desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %{{ n // 2 + 2 }}, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n{{ n }}k16.f32.{{ ab }}.{{ ab }} "
      "{ {% for i in range(n // 2) %}%{{ i }}{{ ", " if not loop.last }}{% endfor %} }, "
      "%{{ n // 2 }}, %{{ n // 2 + 1 }}, p, 1, 1, {{ trans }}, {{ trans if trans_b is none else trans_b }};\n}\n"
      : {% for i in range(n // 2) %}"+f"(d[{{ i // 4 }}][{{ i % 4 }}]){{ ", " if not loop.last }}{% endfor %}
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}
{% endmacro %}
{#- A from registers, B MN-major from shared memory. -#}
{% macro wgmma_rs_fn(fn, n, bf16) %}
{%- set ab = "bf16" if bf16 else "f16" %}
__device__ __forceinline__ void {{ fn }}(float (&d)[{{ n // 8 }}][4], const u32 (&a)[4], u64 desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %{{ n // 2 + 5 }}, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n{{ n }}k16.f32.{{ ab }}.{{ ab }} "
      "{ {% for i in range(n // 2) %}%{{ i }}{{ ", " if not loop.last }}{% endfor %} }, "
      "{ %{{ n // 2 }}, %{{ n // 2 + 1 }}, %{{ n // 2 + 2 }}, %{{ n // 2 + 3 }} }, "
      "%{{ n // 2 + 4 }}, p, 1, 1, 1;\n}\n"
      : {% for i in range(n // 2) %}"+f"(d[{{ i // 4 }}][{{ i % 4 }}]){{ ", " if not loop.last }}{% endfor %}
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}
{% endmacro %}
{#- FP8 (e4m3) products: m64 x n x k32, fp32 accumulators. Both operands must be K-major (8-bit
    types have no transpose), so P V reads V^T (kernels/fwd_fp8.py). -#}
{% macro wgmma_ss_e4m3_fn(fn, n) %}
__device__ __forceinline__ void {{ fn }}(float (&d)[{{ n // 8 }}][4], u64 desc_a, u64 desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %{{ n // 2 + 2 }}, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n{{ n }}k32.f32.e4m3.e4m3 "
      "{ {% for i in range(n // 2) %}%{{ i }}{{ ", " if not loop.last }}{% endfor %} }, "
      "%{{ n // 2 }}, %{{ n // 2 + 1 }}, p, 1, 1;\n}\n"
      : {% for i in range(n // 2) %}"+f"(d[{{ i // 4 }}][{{ i % 4 }}]){{ ", " if not loop.last }}{% endfor %}
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}
{% endmacro %}
{#- A (four registers of four e4m3 values: the m16n8k32 A fragment per warp) from registers. -#}
{% macro wgmma_rs_e4m3_fn(fn, n) %}
__device__ __forceinline__ void {{ fn }}(float (&d)[{{ n // 8 }}][4], const u32 (&a)[4], u64 desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %{{ n // 2 + 5 }}, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n{{ n }}k32.f32.e4m3.e4m3 "
      "{ {% for i in range(n // 2) %}%{{ i }}{{ ", " if not loop.last }}{% endfor %} }, "
      "{ %{{ n // 2 }}, %{{ n // 2 + 1 }}, %{{ n // 2 + 2 }}, %{{ n // 2 + 3 }} }, "
      "%{{ n // 2 + 4 }}, p, 1, 1;\n}\n"
      : {% for i in range(n // 2) %}"+f"(d[{{ i // 4 }}][{{ i % 4 }}]){{ ", " if not loop.last }}{% endfor %}
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}
{% endmacro %}
