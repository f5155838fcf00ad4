// Attention sinks (gpt-oss, flash-attn's s_aux): one logit per query head that joins each row's
// softmax as an extra column with no value. The logits are read in the caller's dtype.
enum SinkDtype { kSinkF32 = 0, kSinkF16 = 1, kSinkBF16 = 2 };  // cuflash.launch.SINK_DTYPES

// The sink logit at index i of `sinks` (fp32, fp16 or bf16 by `dtype`), as fp32.
__device__ __forceinline__ float sink_logit(const void* sinks, int dtype, int i) {
  if (dtype == kSinkF32) return static_cast<const float*>(sinks)[i];
  const u16 x = static_cast<const u16*>(sinks)[i];
  if (dtype == kSinkBF16) return __int_as_float(static_cast<u32>(x) << 16);
  float f;
  asm("{ .reg .f16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "h"(x));
  return f;
}
